//! Front ends: listeners that speak another protocol (gRPC's HTTP/2) and
//! bring each of its calls straight to the server's routed tower stack, as
//! tonic's server calls its routes, with no rpc-core frames in between.
//!
//! A transport that is a front end says so from
//! [`Transport::front_end`](crate::transport::Transport::front_end); a
//! [`crate::Server`] bound on its scheme then accepts
//! [`FrontEndConnection`]s, admits each as it admits a connection of frames
//! (the connection limits, in all and per address), and hands it [`Calls`]:
//! the server's layered service with what the server does around every
//! call (the deadline, a panic caught as `Internal`, metrics, the access
//! log, the end of calls when the server's grace period is over).
//!
//! A front end's call brings its request messages as a
//! [`Streaming::from_messages`] and takes the handler's through a
//! [`MessageSink::from_target`]; [`Calls::call`] runs it as a streaming call
//! of unknown kind (a unary method takes one message and answers with one,
//! [`CallEnd::Answer`]), since gRPC's wire does not say a method's kind.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_core::Stream;
use futures_util::future::BoxFuture;

use super::ServerConfig;
use super::connection::{self, CallLog, SHUTTING_DOWN, ServerService, Shutdown};
use crate::payload::Payload;
use crate::request::{PeerInfo, Request, Response};
use crate::status::{Code, Status};
use crate::stream::{KindUnknown, ServerStream, ServerStreamSlot, TakeOnce, UnaryAnswer};
use crate::transport::{Endpoint, ReceiveBudget, TransportConfig, TransportError};

#[cfg(doc)]
use crate::stream::{MessageSink, Streaming};

/// A listening front end's way to bind (see the module docs).
pub trait FrontEnd: Send + Sync + 'static {
    /// Starts listening on `endpoint` (the limits and the receive budget
    /// come with each connection's [`Calls`]).
    fn bind(
        &self,
        endpoint: &Endpoint,
        config: &TransportConfig,
    ) -> BoxFuture<'static, Result<Box<dyn FrontEndListener>, TransportError>>;
}

/// A stream of a front end's accepted connections. An `Err` item is one
/// failed accept; the listener stays usable. Dropping it stops listening.
pub trait FrontEndListener:
    Stream<Item = Result<Box<dyn FrontEndConnection>, TransportError>> + Send + Unpin
{
    /// Where it listens, with the real port when port 0 was asked for.
    fn local_endpoint(&self) -> Endpoint;
}

/// One accepted connection of a front end.
pub trait FrontEndConnection: Send + 'static {
    /// The peer, for logs, limits per address and [`PeerInfo`].
    fn peer(&self) -> &str;

    /// Serves the connection's calls with `calls` until the peer or the
    /// server ends it: a graceful shutdown ([`Calls::shutting_down`]) stops
    /// new calls and lets those in flight finish.
    fn serve(self: Box<Self>, calls: Calls) -> BoxFuture<'static, ()>;

    /// Turns the connection away for want of room, saying why in the
    /// protocol's own way (`RESOURCE_EXHAUSTED`), within a few seconds.
    fn refuse(self: Box<Self>, reason: String) -> BoxFuture<'static, ()>;
}

/// How one call a front end brought ended.
#[derive(Debug)]
pub enum CallEnd {
    /// A unary method answered: send the response's metadata, its one
    /// message, then an OK status (nothing went through the call's sink).
    Answer(Response<Payload>),
    /// The call ended with this status after the messages its handler sent
    /// through the sink: OK with the trailing metadata, or the error.
    Ended(Status),
}

/// The server's side of a front end's connection (see the module docs):
/// cheap to clone, one per connection.
#[derive(Clone)]
pub struct Calls {
    inner: Arc<CallsInner>,
}

struct CallsInner {
    service: ServerService,
    budget: ReceiveBudget,
    peer: String,
    config: ServerConfig,
    shutdown: Shutdown,
}

impl std::fmt::Debug for Calls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Calls")
            .field("peer", &self.inner.peer)
            .finish_non_exhaustive()
    }
}

impl Calls {
    pub(crate) fn new(
        service: ServerService,
        budget: ReceiveBudget,
        peer: String,
        config: ServerConfig,
        shutdown: Shutdown,
    ) -> Calls {
        Calls {
            inner: Arc::new(CallsInner {
                service,
                budget,
                peer,
                config,
                shutdown,
            }),
        }
    }

    /// Runs one call: `request` carries its method path, metadata and
    /// timeout (its message is unused: the messages are `stream`'s). The
    /// future ends when the handler has; dropping it cancels the handler.
    /// Once the server's grace period is over it ends with `Unavailable`.
    pub fn call(
        &self,
        request: Request<()>,
        stream: ServerStream,
    ) -> impl Future<Output = CallEnd> + Send + 'static {
        let inner = self.inner.clone();
        let log = CallLog::start(
            request.method().unwrap_or_default(),
            0,
            &inner.peer,
            0,
            inner.config.access_log,
        );
        let slot = ServerStreamSlot(TakeOnce::new(stream));
        let mut request = request.map(|()| Bytes::new());
        let extensions = request.extensions_mut();
        extensions.insert(KindUnknown);
        extensions.insert(PeerInfo {
            addr: inner.peer.clone(),
        });
        extensions.insert(slot.clone());
        async move {
            let running =
                connection::run_service(inner.service.clone(), request, Some(&slot), log.span());
            let outcome = tokio::select! {
                biased;
                outcome = running => outcome,
                () = inner.shutdown.now.cancelled() => Err(Status::unavailable(SHUTTING_DOWN)),
            };
            let end = match outcome {
                Ok(response) if response.extensions().get::<UnaryAnswer>().is_some() => {
                    match connection::over_frame_limit(
                        response.get_ref().len(),
                        inner.config.max_frame_len,
                    ) {
                        Some(status) => CallEnd::Ended(status),
                        None => CallEnd::Answer(response),
                    }
                }
                Ok(response) => {
                    let (trailers, _) = response.into_parts();
                    CallEnd::Ended(Status::with_metadata(Code::Ok, "", trailers))
                }
                Err(status) => CallEnd::Ended(status),
            };
            let (code, len) = match &end {
                CallEnd::Answer(response) => (Code::Ok, response.get_ref().len()),
                CallEnd::Ended(status) => (status.code(), 0),
            };
            log.finish(code, len);
            end
        }
    }

    /// The server's receive budget: what the front end reserves a
    /// request message's bytes from before it holds them (one
    /// [`ReceiveBudget::connection`] per connection).
    pub fn receive_budget(&self) -> &ReceiveBudget {
        &self.inner.budget
    }

    /// The peer this connection is with.
    pub fn peer(&self) -> &str {
        &self.inner.peer
    }

    /// The largest message a call takes or sends (the server's frame limit).
    pub fn max_frame_len(&self) -> usize {
        self.inner.config.max_frame_len
    }

    /// Calls one connection may have in flight at once.
    pub fn max_concurrent_calls(&self) -> usize {
        self.inner.config.max_concurrent_calls_per_connection
    }

    /// How long a connection with no call in flight stays open.
    pub fn idle_timeout(&self) -> Duration {
        self.inner.config.idle_timeout
    }

    /// Ready once the server shuts down gracefully: take no new calls, let
    /// those in flight finish.
    pub fn shutting_down(&self) -> impl Future<Output = ()> + Send + 'static {
        self.inner.shutdown.graceful.clone().cancelled_owned()
    }

    /// Ready once the server's grace period is over (or it was dropped):
    /// the calls in flight end with `Unavailable`; close the connection.
    pub fn ending_now(&self) -> impl Future<Output = ()> + Send + 'static {
        self.inner.shutdown.now.clone().cancelled_owned()
    }
}
