//! `interop.v1.Interop` (proto/interop.proto) as rdma-rpc and tonic both
//! generate it, with one behaviour implemented for each: the gRPC interop
//! tests call each framework's server with the other's clients (and with
//! Python's grpcio), and expect the same answers.
#![forbid(unsafe_code)]

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};

/// rdma-rpc's code for the service.
pub mod rdma {
    #![allow(missing_docs, clippy::all)]
    include!(concat!(env!("OUT_DIR"), "/rdma-rpc/interop.v1.rs"));
}

/// tonic's code for the service.
pub mod tonic_gen {
    #![allow(missing_docs, unreachable_pub, clippy::all)]
    include!(concat!(env!("OUT_DIR"), "/tonic/interop.v1.rs"));
}

/// The encoded descriptors of proto/interop.proto, for server reflection.
pub const DESCRIPTORS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/interop_descriptors.bin"));

/// The trailer a failed call carries (ASCII), whatever its code.
pub const FAILURE_TRAILER: (&str, &str) = ("x-failure", "as-asked");
/// The binary trailer a failed call carries.
pub const FAILURE_TRAILER_BIN: (&str, &[u8]) = ("x-failure-bin", &[0, 1, 254, 255]);
/// The response metadata of every successful unary call (ASCII).
pub const ANSWER_HEADER: (&str, &str) = ("x-answered", "yes");
/// The binary response metadata of every successful unary call.
pub const ANSWER_HEADER_BIN: (&str, &[u8]) = ("x-answered-bin", &[0, 159, 146, 150]);

/// What both servers count: handlers that were dropped before they
/// finished (a cancelled or timed-out call).
#[derive(Debug, Default, Clone)]
pub struct Counters {
    abandoned: Arc<AtomicUsize>,
}

impl Counters {
    /// Handlers dropped before they finished, so far.
    pub fn abandoned(&self) -> usize {
        self.abandoned.load(Ordering::SeqCst)
    }

    fn guard(&self) -> AbandonGuard {
        AbandonGuard {
            abandoned: self.abandoned.clone(),
            finished: false,
        }
    }
}

/// Counts its handler as abandoned unless it finished.
struct AbandonGuard {
    abandoned: Arc<AtomicUsize>,
    finished: bool,
}

impl AbandonGuard {
    fn finish(mut self) {
        self.finished = true;
    }
}

impl Drop for AbandonGuard {
    fn drop(&mut self) {
        if !self.finished {
            self.abandoned.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// A server stream's answers, the same in both frameworks: `steering.count`
/// answers made by `answer`, each after the steering's pause, then the
/// failure `failure` finds in the steering, if any. The handler counts as
/// abandoned unless the stream got to its end.
fn server_stream_answers<A, S>(
    counters: &Counters,
    steering: Steering,
    answer: impl Fn(&Steering, u32) -> A + Send + Sync + 'static,
    failure: fn(&Steering) -> Option<S>,
) -> impl futures_core::Stream<Item = Result<A, S>> + Send + 'static
where
    A: Send + 'static,
    S: Send + 'static,
{
    let answer = Arc::new(answer);
    let count = steering.count;
    let guard = counters.guard();
    futures_util::stream::unfold((0u32, Some(guard)), move |(index, mut guard)| {
        let steering = steering.clone();
        let answer = answer.clone();
        async move {
            if index > count {
                return None;
            }
            if index == count {
                if let Some(guard) = guard.take() {
                    guard.finish();
                }
                return failure(&steering).map(|status| (Err(status), (index + 1, None)));
            }
            steering.pause().await;
            Some((Ok(answer(&steering, index)), (index + 1, guard)))
        }
    })
}

/// The steering fields of an ask, the same in both frameworks' types.
#[derive(Debug, Clone, Default)]
pub struct Steering {
    /// `body`.
    pub body: Bytes,
    /// `fail_with_code`.
    pub fail_with_code: i32,
    /// `fail_message`.
    pub fail_message: String,
    /// `sleep_ms`.
    pub sleep_ms: u32,
    /// `count`.
    pub count: u32,
    /// `answer_size`.
    pub answer_size: u32,
}

impl Steering {
    /// The body of the answer to this ask.
    pub fn answer_body(&self) -> Bytes {
        if self.answer_size == 0 {
            self.body.clone()
        } else {
            Bytes::from(vec![b'a'; self.answer_size as usize])
        }
    }

    async fn pause(&self) {
        if self.sleep_ms > 0 {
            tokio::time::sleep(Duration::from_millis(u64::from(self.sleep_ms))).await;
        }
    }
}

/// `key=value` for an ASCII entry, `key=hex` for a binary one.
pub fn seen_entry(key: &str, value: &[u8], binary: bool) -> String {
    if binary {
        let hex: String = value.iter().map(|b| format!("{b:02x}")).collect();
        format!("{key}={hex}")
    } else {
        format!("{key}={}", String::from_utf8_lossy(value))
    }
}

/// rdma-rpc's implementation.
#[derive(Debug, Default, Clone)]
pub struct RdmaInterop {
    /// What it counted.
    pub counters: Counters,
}

mod rdma_impl {
    use super::*;
    use rdma::{Answer, Ask};
    use rpc_core::metadata::{Metadata, MetadataValue};
    use rpc_core::{Code, Request, Response, Status, Streaming};

    fn steering(ask: &Ask) -> Steering {
        Steering {
            body: ask.body.clone(),
            fail_with_code: ask.fail_with_code,
            fail_message: ask.fail_message.clone(),
            sleep_ms: ask.sleep_ms,
            count: ask.count,
            answer_size: ask.answer_size,
        }
    }

    fn seen(metadata: &Metadata) -> Vec<String> {
        metadata
            .iter()
            .filter(|(key, _)| key.starts_with("x-"))
            .map(|(key, value)| {
                let binary = matches!(value, MetadataValue::Binary(_));
                seen_entry(key, value.as_bytes(), binary)
            })
            .collect()
    }

    fn failure(steering: &Steering) -> Option<Status> {
        if steering.fail_with_code == 0 {
            return None;
        }
        let mut trailers = Metadata::new();
        trailers
            .insert(FAILURE_TRAILER.0, FAILURE_TRAILER.1)
            .expect("valid");
        trailers
            .insert_bin(FAILURE_TRAILER_BIN.0, FAILURE_TRAILER_BIN.1)
            .expect("valid");
        Some(Status::with_metadata(
            Code::from(steering.fail_with_code),
            steering.fail_message.clone(),
            trailers,
        ))
    }

    type Answers = Pin<Box<dyn Stream<Item = Result<Answer, Status>> + Send>>;

    impl rdma::interop_server::Interop for RdmaInterop {
        async fn unary(&self, request: Request<Ask>) -> Result<Response<Answer>, Status> {
            let guard = self.counters.guard();
            let seen_metadata = seen(request.metadata());
            let steering = steering(request.get_ref());
            steering.pause().await;
            guard.finish();
            if let Some(status) = failure(&steering) {
                return Err(status);
            }
            let mut response = Response::new(Answer {
                body: steering.answer_body(),
                index: 0,
                seen_metadata,
            });
            let metadata = response.metadata_mut();
            metadata
                .insert(ANSWER_HEADER.0, ANSWER_HEADER.1)
                .expect("valid");
            metadata
                .insert_bin(ANSWER_HEADER_BIN.0, ANSWER_HEADER_BIN.1)
                .expect("valid");
            Ok(response)
        }

        type ServerStreamStream = Answers;

        async fn server_stream(
            &self,
            request: Request<Ask>,
        ) -> Result<Response<Self::ServerStreamStream>, Status> {
            let seen_metadata = seen(request.metadata());
            let answer = move |steering: &Steering, index| Answer {
                body: steering.answer_body(),
                index,
                seen_metadata: seen_metadata.clone(),
            };
            let answers = crate::server_stream_answers(
                &self.counters,
                steering(request.get_ref()),
                answer,
                failure,
            );
            Ok(Response::new(Box::pin(answers)))
        }

        async fn client_stream(
            &self,
            request: Request<Streaming<Ask>>,
        ) -> Result<Response<Answer>, Status> {
            let guard = self.counters.guard();
            let seen_metadata = seen(request.metadata());
            let mut asks = request.into_inner();
            let mut body = Vec::new();
            let mut index = 0;
            let mut last = Steering::default();
            while let Some(ask) = asks.message().await? {
                body.extend_from_slice(&ask.body);
                index += 1;
                last = steering(&ask);
            }
            guard.finish();
            if let Some(status) = failure(&last) {
                return Err(status);
            }
            Ok(Response::new(Answer {
                body: Bytes::from(body),
                index,
                seen_metadata,
            }))
        }

        type BidiStream = Answers;

        async fn bidi(
            &self,
            request: Request<Streaming<Ask>>,
        ) -> Result<Response<Self::BidiStream>, Status> {
            let asks = request.into_inner();
            let answers = asks.enumerate().map(|(index, ask)| {
                let ask = ask?;
                let steering = steering(&ask);
                if let Some(status) = failure(&steering) {
                    return Err(status);
                }
                Ok(Answer {
                    body: steering.answer_body(),
                    index: index as u32,
                    seen_metadata: Vec::new(),
                })
            });
            Ok(Response::new(Box::pin(answers)))
        }
    }
}

/// tonic's implementation, the same behaviour.
#[derive(Debug, Default, Clone)]
pub struct TonicInterop {
    /// What it counted.
    pub counters: Counters,
}

mod tonic_impl {
    use super::*;
    use tonic::metadata::{KeyAndValueRef, MetadataMap};
    use tonic::{Code, Request, Response, Status, Streaming};
    use tonic_gen::{Answer, Ask};

    fn steering(ask: &Ask) -> Steering {
        Steering {
            body: ask.body.clone(),
            fail_with_code: ask.fail_with_code,
            fail_message: ask.fail_message.clone(),
            sleep_ms: ask.sleep_ms,
            count: ask.count,
            answer_size: ask.answer_size,
        }
    }

    fn seen(metadata: &MetadataMap) -> Vec<String> {
        metadata
            .iter()
            .filter_map(|entry| match entry {
                KeyAndValueRef::Ascii(key, value) => key
                    .as_str()
                    .starts_with("x-")
                    .then(|| seen_entry(key.as_str(), value.as_bytes(), false)),
                KeyAndValueRef::Binary(key, value) => {
                    let bytes = value.to_bytes().ok()?;
                    key.as_str()
                        .starts_with("x-")
                        .then(|| seen_entry(key.as_str(), &bytes, true))
                }
            })
            .collect()
    }

    fn failure(steering: &Steering) -> Option<Status> {
        if steering.fail_with_code == 0 {
            return None;
        }
        let mut trailers = MetadataMap::new();
        trailers.insert(FAILURE_TRAILER.0, FAILURE_TRAILER.1.parse().expect("valid"));
        trailers.insert_bin(
            FAILURE_TRAILER_BIN.0,
            tonic::metadata::MetadataValue::from_bytes(FAILURE_TRAILER_BIN.1),
        );
        Some(Status::with_metadata(
            Code::from(steering.fail_with_code),
            steering.fail_message.clone(),
            trailers,
        ))
    }

    type Answers = Pin<Box<dyn Stream<Item = Result<Answer, Status>> + Send>>;

    #[tonic::async_trait]
    impl tonic_gen::interop_server::Interop for TonicInterop {
        async fn unary(&self, request: Request<Ask>) -> Result<Response<Answer>, Status> {
            let guard = self.counters.guard();
            let seen_metadata = seen(request.metadata());
            let steering = steering(request.get_ref());
            steering.pause().await;
            guard.finish();
            if let Some(status) = failure(&steering) {
                return Err(status);
            }
            let mut response = Response::new(Answer {
                body: steering.answer_body(),
                index: 0,
                seen_metadata,
            });
            let metadata = response.metadata_mut();
            metadata.insert(ANSWER_HEADER.0, ANSWER_HEADER.1.parse().expect("valid"));
            metadata.insert_bin(
                ANSWER_HEADER_BIN.0,
                tonic::metadata::MetadataValue::from_bytes(ANSWER_HEADER_BIN.1),
            );
            Ok(response)
        }

        type ServerStreamStream = Answers;

        async fn server_stream(
            &self,
            request: Request<Ask>,
        ) -> Result<Response<Self::ServerStreamStream>, Status> {
            let seen_metadata = seen(request.metadata());
            let answer = move |steering: &Steering, index| Answer {
                body: steering.answer_body(),
                index,
                seen_metadata: seen_metadata.clone(),
            };
            let answers = crate::server_stream_answers(
                &self.counters,
                steering(request.get_ref()),
                answer,
                failure,
            );
            Ok(Response::new(Box::pin(answers)))
        }

        async fn client_stream(
            &self,
            request: Request<Streaming<Ask>>,
        ) -> Result<Response<Answer>, Status> {
            let seen_metadata = seen(request.metadata());
            let mut asks = request.into_inner();
            let mut body = Vec::new();
            let mut index = 0;
            let mut last = Steering::default();
            while let Some(ask) = asks.message().await? {
                body.extend_from_slice(&ask.body);
                index += 1;
                last = steering(&ask);
            }
            if let Some(status) = failure(&last) {
                return Err(status);
            }
            Ok(Response::new(Answer {
                body: Bytes::from(body),
                index,
                seen_metadata,
            }))
        }

        type BidiStream = Answers;

        async fn bidi(
            &self,
            request: Request<Streaming<Ask>>,
        ) -> Result<Response<Self::BidiStream>, Status> {
            let asks = request.into_inner();
            let answers = asks.enumerate().map(|(index, ask)| {
                let ask = ask?;
                let steering = steering(&ask);
                if let Some(status) = failure(&steering) {
                    return Err(status);
                }
                Ok(Answer {
                    body: steering.answer_body(),
                    index: index as u32,
                    seen_metadata: Vec::new(),
                })
            });
            Ok(Response::new(Box::pin(answers)))
        }
    }
}
