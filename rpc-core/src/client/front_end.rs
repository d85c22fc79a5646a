//! Client front ends: connections that take whole calls (gRPC's HTTP/2)
//! rather than rpc-core's frames, as the server's
//! [`front_end`](crate::server::front_end) brings whole calls to its routes.
//!
//! A transport whose connections speak another protocol says so from
//! [`Transport::call_connector`](crate::transport::Transport::call_connector);
//! a [`crate::Channel`] to its scheme then connects through the
//! [`CallConnector`] and hands each call to the [`CallConnection`] as it is:
//! the method, the time left of its deadline, its metadata and its encoded
//! message (or its request messages, [`OutgoingMessages`]). The connection
//! answers with the response, or the response metadata and its messages
//! ([`Streaming::from_response`]). No rpc-core frame is made, and the call
//! runs in the caller's task, as tonic's calls do.
//!
//! The channel keeps doing what it does on every transport around the
//! call: connecting and reconnecting with backoff, the deadline (also given
//! to the connection, to send to the server), sending again a call the
//! server never saw ([`CallFailure::unprocessed`]), metrics and tracing.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;

use crate::metadata::Metadata;
use crate::payload::Payload;
use crate::request::Response;
use crate::stream::Streaming;
use crate::transport::{Endpoint, TransportError};

pub use super::connection::{CallFailure, Keepalive};
pub use crate::stream::{MessageTarget, OutgoingMessages};

/// A transport's way to open call-taking connections (see the module docs).
pub trait CallConnector: Send + Sync + 'static {
    /// Opens a connection to `endpoint`.
    fn connect(
        &self,
        endpoint: &Endpoint,
        settings: &CallSettings,
    ) -> BoxFuture<'static, Result<Arc<dyn CallConnection>, TransportError>>;
}

/// What a channel asks of its front end's connections.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct CallSettings {
    /// Largest message sent or taken (the channel's `max_frame_len`): a
    /// larger response message fails its call with `ResourceExhausted`.
    pub max_message_len: usize,
    /// How to probe a silent connection ([`crate::client::ChannelBuilder::keepalive`]).
    pub keepalive: Option<Keepalive>,
}

impl CallSettings {
    /// Settings with a message limit and no keepalive.
    pub fn new(max_message_len: usize) -> CallSettings {
        CallSettings {
            max_message_len,
            keepalive: None,
        }
    }
}

/// One call as a channel hands it to a [`CallConnection`].
#[derive(Debug)]
#[non_exhaustive]
pub struct OutgoingCall<B> {
    /// The method path (`/package.Service/Method`).
    pub path: String,
    /// Time left of the call's deadline, if it has one: the server should
    /// hear of it (the channel enforces it too).
    pub timeout: Option<Duration>,
    /// The request metadata.
    pub metadata: Metadata,
    /// The encoded request message, or the request messages.
    pub body: B,
}

impl<B> OutgoingCall<B> {
    /// A call of `path` with `body`, no deadline and no metadata.
    pub fn new(path: impl Into<String>, body: B) -> OutgoingCall<B> {
        OutgoingCall {
            path: path.into(),
            timeout: None,
            metadata: Metadata::new(),
            body,
        }
    }
}

/// A streaming call that failed before the connection took its messages:
/// the failure, and the messages back, so that a call the server never saw
/// can go again on another connection.
#[derive(Debug)]
pub struct StreamFailure {
    /// Why it failed.
    pub failure: CallFailure,
    /// The request messages, when the connection did not take them.
    pub unsent: Option<OutgoingMessages>,
}

impl From<CallFailure> for StreamFailure {
    fn from(failure: CallFailure) -> StreamFailure {
        StreamFailure {
            failure,
            unsent: None,
        }
    }
}

/// One connection of a client front end: it takes whole calls. Each call's
/// future runs in the caller's task; dropping it before it ends cancels the
/// call at the server (as does dropping a streaming call's [`Streaming`]).
pub trait CallConnection: Send + Sync + 'static {
    /// Whether new calls may start on it (not closed, not told to go away).
    fn is_usable(&self) -> bool;

    /// A unary call: the response (its metadata the server's headers and
    /// trailers together) and message, or the call's error.
    fn unary(
        &self,
        call: OutgoingCall<Payload>,
    ) -> BoxFuture<'static, Result<Response<Bytes>, CallFailure>>;

    /// A streaming call of any kind: resolves once the server sent its
    /// response metadata, with its messages ([`Streaming::from_response`]).
    fn streaming(
        &self,
        call: OutgoingCall<OutgoingMessages>,
    ) -> BoxFuture<'static, Result<Response<Streaming<Bytes>>, StreamFailure>>;
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::task::{Context, Poll};

    use futures_util::FutureExt;

    use super::*;
    use crate::transport::{Connection, Listener, Transport, TransportConfig};
    use crate::{Channel, Code, Request, Status};

    /// What a fake front end's connection does with the calls it takes.
    #[derive(Clone, Copy)]
    enum Behaviour {
        /// Fails every call as never seen by the server.
        Refuse,
        /// Fails every call as processed.
        Fail,
        /// Answers: a unary call with its message; a streaming call with
        /// the messages it was sent, then trailers.
        Echo,
        /// A streaming call's answer never ends.
        Hang,
    }

    /// A front end whose n-th connection behaves as `plan[n]` (the last
    /// one after that).
    struct FakeFrontEnd {
        plan: Vec<Behaviour>,
        connects: AtomicUsize,
        /// Set when a hanging answer's stream is dropped.
        hang_dropped: Arc<AtomicBool>,
    }

    impl FakeFrontEnd {
        fn new(plan: Vec<Behaviour>) -> Arc<FakeFrontEnd> {
            Arc::new(FakeFrontEnd {
                plan,
                connects: AtomicUsize::new(0),
                hang_dropped: Arc::new(AtomicBool::new(false)),
            })
        }
    }

    impl Transport for FakeFrontEnd {
        fn connect(
            &self,
            _: &Endpoint,
            _: &TransportConfig,
        ) -> BoxFuture<'static, Result<Connection, TransportError>> {
            async { Err(TransportError::Closed) }.boxed()
        }

        fn bind(
            &self,
            _: &Endpoint,
            _: &TransportConfig,
        ) -> BoxFuture<'static, Result<Box<dyn Listener>, TransportError>> {
            async { Err(TransportError::Closed) }.boxed()
        }

        fn call_connector(&self) -> Option<&dyn CallConnector> {
            Some(self)
        }
    }

    impl CallConnector for FakeFrontEnd {
        fn connect(
            &self,
            _: &Endpoint,
            _: &CallSettings,
        ) -> BoxFuture<'static, Result<Arc<dyn CallConnection>, TransportError>> {
            let n = self.connects.fetch_add(1, Ordering::SeqCst);
            let behaviour = self.plan[n.min(self.plan.len() - 1)];
            let connection = Arc::new(FakeConnection {
                behaviour,
                usable: AtomicBool::new(true),
                hang_dropped: self.hang_dropped.clone(),
            });
            async move { Ok(connection as Arc<dyn CallConnection>) }.boxed()
        }
    }

    struct FakeConnection {
        behaviour: Behaviour,
        usable: AtomicBool,
        hang_dropped: Arc<AtomicBool>,
    }

    /// Collects what a request stream sends.
    struct Collect(Arc<Mutex<(Vec<Bytes>, bool)>>);

    impl MessageTarget for Collect {
        fn send_headers(&mut self, _: Metadata) -> Result<(), Status> {
            Ok(())
        }
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
            Poll::Ready(Ok(()))
        }
        fn start_send(&mut self, message: Payload) -> Result<(), Status> {
            self.0.lock().unwrap().0.push(message.into_contiguous());
            Ok(())
        }
        fn poll_flush(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
            Poll::Ready(Ok(()))
        }
        fn close(&mut self) -> Result<(), Status> {
            self.0.lock().unwrap().1 = true;
            Ok(())
        }
    }

    /// A response stream that never yields (its flag says when it is dropped).
    struct Hanging(#[allow(dead_code)] DropFlag);

    impl futures_core::Stream for Hanging {
        type Item = Result<Bytes, Status>;
        fn poll_next(
            self: std::pin::Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Self::Item>> {
            Poll::Pending
        }
    }

    /// Sets its flag when dropped.
    struct DropFlag(Arc<AtomicBool>);

    impl Drop for DropFlag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    impl CallConnection for FakeConnection {
        fn is_usable(&self) -> bool {
            self.usable.load(Ordering::SeqCst)
        }

        fn unary(
            &self,
            call: OutgoingCall<Payload>,
        ) -> BoxFuture<'static, Result<Response<Bytes>, CallFailure>> {
            let answer = match self.behaviour {
                Behaviour::Refuse => {
                    self.usable.store(false, Ordering::SeqCst);
                    Err(CallFailure::unprocessed(Status::unavailable("going away")))
                }
                Behaviour::Fail => Err(CallFailure::processed(Status::aborted("failed"))),
                Behaviour::Echo | Behaviour::Hang => {
                    let mut metadata = Metadata::new();
                    metadata.insert("x-path", &call.path).unwrap();
                    Ok(Response::from_parts(metadata, call.body.into_contiguous()))
                }
            };
            async move { answer }.boxed()
        }

        fn streaming(
            &self,
            call: OutgoingCall<OutgoingMessages>,
        ) -> BoxFuture<'static, Result<Response<Streaming<Bytes>>, StreamFailure>> {
            let behaviour = self.behaviour;
            if let Behaviour::Refuse = behaviour {
                self.usable.store(false, Ordering::SeqCst);
            }
            let hang_dropped = self.hang_dropped.clone();
            async move {
                match behaviour {
                    Behaviour::Refuse => Err(StreamFailure {
                        failure: CallFailure::unprocessed(Status::unavailable("going away")),
                        unsent: Some(call.body),
                    }),
                    Behaviour::Fail => {
                        Err(CallFailure::processed(Status::aborted("failed")).into())
                    }
                    Behaviour::Echo => {
                        let sent = Arc::new(Mutex::new((Vec::new(), false)));
                        call.body
                            .send_to(Collect(sent.clone()), 1 << 20)
                            .await
                            .map_err(CallFailure::processed)?;
                        let (messages, closed) = sent.lock().unwrap().clone();
                        assert!(closed, "the request stream was closed after its messages");
                        let trailers = Arc::new(std::sync::OnceLock::new());
                        let mut end = Metadata::new();
                        end.insert("x-sent", &messages.len().to_string()).unwrap();
                        trailers.set(end).unwrap();
                        let answers = futures_util::stream::iter(messages.into_iter().map(Ok));
                        Ok(Response::new(Streaming::from_response(answers, trailers)))
                    }
                    Behaviour::Hang => Ok(Response::new(Streaming::from_response(
                        Hanging(DropFlag(hang_dropped)),
                        Arc::new(std::sync::OnceLock::new()),
                    ))),
                }
            }
            .boxed()
        }
    }

    fn channel(front_end: &Arc<FakeFrontEnd>) -> Channel {
        Channel::builder("fake://server:1".parse().unwrap())
            .transport(front_end.clone())
            .backoff(crate::client::Backoff {
                initial: Duration::from_millis(1),
                max: Duration::from_millis(1),
                jitter: 0.0,
            })
            .connect_lazy()
    }

    fn unary_request(body: &'static [u8]) -> Request<Payload> {
        let mut request = Request::new(Payload::from(Bytes::from_static(body)));
        request.set_method("/fake.Service/Unary");
        request
    }

    fn streaming_request(
        messages: Vec<&'static [u8]>,
    ) -> Request<impl futures_core::Stream<Item = Payload> + Send + 'static> {
        let mut request = Request::new(futures_util::stream::iter(
            messages
                .into_iter()
                .map(|message| Payload::from(Bytes::from_static(message))),
        ));
        request.set_method("/fake.Service/Stream");
        request
    }

    #[tokio::test]
    async fn a_unary_call_goes_whole_to_the_front_end_and_its_answer_comes_back() {
        let front_end = FakeFrontEnd::new(vec![Behaviour::Echo]);
        let response = channel(&front_end)
            .unary(unary_request(b"hi"))
            .await
            .unwrap();
        assert_eq!(response.get_ref(), &Bytes::from_static(b"hi"));
        assert_eq!(
            response.metadata().get("x-path"),
            Some("/fake.Service/Unary")
        );
    }

    #[tokio::test]
    async fn a_call_the_server_never_saw_goes_again_on_a_new_connection_once() {
        let front_end = FakeFrontEnd::new(vec![Behaviour::Refuse, Behaviour::Echo]);
        let response = channel(&front_end)
            .unary(unary_request(b"again"))
            .await
            .unwrap();
        assert_eq!(response.get_ref(), &Bytes::from_static(b"again"));
        assert_eq!(front_end.connects.load(Ordering::SeqCst), 2);

        // Refused on every connection: the second refusal is the answer.
        let front_end = FakeFrontEnd::new(vec![Behaviour::Refuse]);
        let status = channel(&front_end)
            .unary(unary_request(b"x"))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unavailable);
        assert_eq!(front_end.connects.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_call_the_server_saw_is_not_sent_again() {
        let front_end = FakeFrontEnd::new(vec![Behaviour::Fail, Behaviour::Echo]);
        let status = channel(&front_end)
            .unary(unary_request(b"x"))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Aborted);
        assert_eq!(front_end.connects.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_refused_stream_takes_its_messages_to_the_next_connection() {
        let front_end = FakeFrontEnd::new(vec![Behaviour::Refuse, Behaviour::Echo]);
        let response = channel(&front_end)
            .streaming(streaming_request(vec![b"one", b"two", b"three"]))
            .await
            .unwrap();
        let mut answers = response.into_inner();
        let mut got = Vec::new();
        while let Some(answer) = answers.message().await.unwrap() {
            got.push(answer);
        }
        assert_eq!(got, vec![&b"one"[..], &b"two"[..], &b"three"[..]]);
        assert_eq!(
            answers
                .trailers()
                .and_then(|t| t.get("x-sent").map(str::to_owned)),
            Some("3".to_owned())
        );
        assert_eq!(front_end.connects.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_front_end_stream_ends_at_the_deadline_and_is_dropped() {
        let front_end = FakeFrontEnd::new(vec![Behaviour::Hang]);
        let mut request = streaming_request(vec![b"x"]);
        request.set_timeout(Duration::from_millis(100));
        let mut answers = channel(&front_end)
            .streaming(request)
            .await
            .unwrap()
            .into_inner();
        let status = answers.message().await.unwrap_err();
        assert_eq!(status.code(), Code::DeadlineExceeded);
        assert!(
            front_end.hang_dropped.load(Ordering::SeqCst),
            "the front end's stream is dropped at the deadline (which cancels the call)"
        );
        assert!(answers.message().await.unwrap().is_none(), "then it ends");
    }

    #[test]
    fn outgoing_messages_say_when_they_are_all_there() {
        let ready = OutgoingMessages(crate::stream::Outbound::Whole(vec![Payload::from(
            Bytes::from_static(b"a"),
        )]));
        assert_eq!(ready.ready().map(<[Payload]>::len), Some(1));
        assert_eq!(ready.into_ready().unwrap().len(), 1);
        let pending = futures_util::stream::pending::<Payload>();
        let many = OutgoingMessages(crate::stream::Outbound::ready_or_many(pending));
        assert!(many.ready().is_none());
        assert!(many.into_ready().is_err());
    }
}
