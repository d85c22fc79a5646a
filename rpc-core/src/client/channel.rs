//! [`Channel`]: a cheap, cloneable handle that multiplexes calls over one
//! connection, connecting lazily and reconnecting with backoff.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;
use tower_service::Service;
use tracing::Instrument;

use tower::retry::backoff::{
    Backoff as _, ExponentialBackoff, ExponentialBackoffMaker, MakeBackoff,
};
use tower::util::rng::HasherRng;

use super::connection::{ClientConnection, Keepalive, OpenStream};
use super::front_end::{CallConnection, CallSettings, OutgoingCall, StreamFailure};
use crate::conn_io::DEFAULT_OUTBOUND_QUEUE_BYTES;
use crate::error::Error;
use crate::frame::{DEFAULT_MAX_FRAME_LEN, Frame, FrameKind};
use crate::metrics::{CallRecord, Side};
use crate::payload::Payload;
use crate::request::{Request, Response};
use crate::status::{Code, Status};
use crate::stream::{
    InboundMessages, Outbound, OutboundMessages, OutgoingMessages, RawCodec, SendMessages,
    Streaming, TakeOnce, into_streaming_request, take_inbound,
};
use crate::transport::TransportError;
use crate::transport::{self, Endpoint, TransportConfig};

/// How long to wait between failed connection attempts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// Wait after the first failure (doubled after each further one).
    pub initial: Duration,
    /// Longest wait (before jitter).
    pub max: Duration,
    /// Random extra wait, as a fraction of the wait (0.5: up to +50%), so
    /// that clients that lost one server do not all come back at once.
    pub jitter: f64,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            initial: Duration::from_millis(50),
            max: Duration::from_secs(5),
            jitter: 0.5,
        }
    }
}

impl Backoff {
    /// tower's jittered exponential backoff with these settings (made
    /// valid: `max` at least `initial` and above 0, jitter within 0..=100).
    fn maker(&self) -> ExponentialBackoffMaker {
        let max = self.max.max(self.initial).max(Duration::from_millis(1));
        let jitter = if self.jitter.is_nan() {
            0.0
        } else {
            self.jitter.clamp(0.0, 100.0)
        };
        ExponentialBackoffMaker::new(self.initial, max, jitter, HasherRng::default())
            .expect("the settings were made valid above")
    }
}

/// Configures and creates a [`Channel`].
///
/// ```no_run
/// # async fn demo() -> Result<(), rpc_core::Error> {
/// use std::time::Duration;
/// let channel = rpc_core::Channel::builder("tcp://127.0.0.1:50051".parse()?)
///     .connect_timeout(Duration::from_secs(1))
///     .timeout(Duration::from_secs(5))
///     .connect()
///     .await?;
/// # let _ = channel; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct ChannelBuilder {
    endpoint: Endpoint,
    connect_timeout: Duration,
    default_timeout: Option<Duration>,
    max_frame_len: usize,
    backoff: Backoff,
    keepalive: Option<Keepalive>,
    outbound_queue_bytes: usize,
    fallback: Option<Endpoint>,
    transport: Option<InjectedTransport>,
}

/// A transport given to [`ChannelBuilder::transport`].
#[derive(Clone)]
struct InjectedTransport(Arc<dyn transport::Transport>);

impl std::fmt::Debug for InjectedTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Transport")
    }
}

/// Attempts of one call: a call that a server provably never saw (it sent
/// GOAWAY first, or the connection was already closed) is sent once more on a
/// new connection.
const MAX_ATTEMPTS: usize = 2;

impl ChannelBuilder {
    /// Time allowed for establishing a connection (default 5 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Timeout for calls whose request sets none (default: none).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.default_timeout = Some(timeout);
        self
    }

    /// Largest frame sent or accepted (default 64 MiB).
    pub fn max_frame_len(mut self, len: usize) -> Self {
        self.max_frame_len = len;
        self
    }

    /// Probes a silent connection: after `interval` without a frame from the
    /// server a ping is sent, and after `timeout` more the connection is
    /// declared dead (pending calls fail with `Unavailable`). This is what ends
    /// calls without deadlines when the server's host vanishes without closing
    /// the connection. Default: 30 s and 20 s.
    pub fn keepalive(mut self, interval: Duration, timeout: Duration) -> Self {
        self.keepalive = Some(Keepalive { interval, timeout });
        self
    }

    /// Turns keepalive probing off.
    pub fn no_keepalive(mut self) -> Self {
        self.keepalive = None;
        self
    }

    /// Bytes of request frames queued for the transport (default 1 MiB,
    /// [`crate::server::DEFAULT_OUTBOUND_QUEUE_BYTES`]). A request frame holds
    /// its room until it is flushed; when the queue is full, new calls wait for
    /// room and `poll_ready` (tower) is pending, so a server that stops reading
    /// pushes back on the application instead of the channel buffering. A
    /// request larger than the queue is sent alone.
    pub fn outbound_queue_bytes(mut self, bytes: usize) -> Self {
        self.outbound_queue_bytes = bytes;
        self
    }

    /// Where to connect when the endpoint cannot be reached (opt-in;
    /// default: nowhere). For an `rdma://` endpoint whose host or peer cannot
    /// do RDMA (no RDMA device, the soft provider's peer on another host, a
    /// plain gRPC server at that address), a `tcp://` or `grpc://` endpoint
    /// of the same service. Each new connection tries the endpoint first and
    /// the fallback after any failure to connect to it; the first fallback
    /// is logged (a warning, with why the endpoint failed), later ones at
    /// debug level.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), rpc_core::Error> {
    /// let channel = rpc_core::Channel::builder("rdma://10.0.0.7:50051".parse()?)
    ///     .fallback("grpc://10.0.0.7:50052".parse()?)
    ///     .connect()
    ///     .await?;
    /// # let _ = channel; Ok(()) }
    /// ```
    pub fn fallback(mut self, endpoint: Endpoint) -> Self {
        self.fallback = Some(endpoint);
        self
    }

    /// Connects to the endpoint with `transport` instead of the one its
    /// scheme names in the registry ([`transport::register`]), as tonic's
    /// `connect_with_connector`: tests and embedders need no process-global
    /// registration, and any scheme goes. The fallback, if any, still comes
    /// from the registry.
    ///
    /// ```
    /// # async fn demo() -> Result<(), rpc_core::Error> {
    /// use std::sync::Arc;
    /// use rpc_core::transport::memory::MemoryTransport;
    /// let channel = rpc_core::Channel::builder("inproc://echo".parse()?)
    ///     .transport(Arc::new(MemoryTransport))
    ///     .connect_lazy();
    /// # let _ = channel; Ok(()) }
    /// ```
    pub fn transport(mut self, transport: Arc<dyn transport::Transport>) -> Self {
        self.transport = Some(InjectedTransport(transport));
        self
    }

    /// Waits between failed connection attempts.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// A channel that connects on its first call.
    pub fn connect_lazy(self) -> Channel {
        Channel {
            ready: Ready::default(),
            inner: Arc::new(ChannelInner {
                current: Mutex::new(None),
                connecting: tokio::sync::Mutex::new({
                    let mut maker = self.backoff.maker();
                    Reconnect {
                        retry_at: None,
                        backoff: maker.make_backoff(),
                        maker,
                        last_error: None,
                    }
                }),
                config: self,
                fell_back: std::sync::atomic::AtomicBool::new(false),
            }),
        }
    }

    /// A channel with its connection established now.
    pub async fn connect(self) -> Result<Channel, Error> {
        let channel = self.connect_lazy();
        let connection = channel.inner.open_connection().await?;
        *channel.inner.current_slot() = Some(connection);
        Ok(channel)
    }
}

struct Reconnect {
    retry_at: Option<Instant>,
    /// The waits between failed attempts (reset by a success).
    backoff: ExponentialBackoff,
    maker: ExponentialBackoffMaker,
    /// Why the last attempt failed, and the code its calls got.
    last_error: Option<(Code, String)>,
}

/// A channel's connection: one of rpc-core's frames, or one of a client
/// front end's that takes whole calls ([`super::front_end`]).
#[derive(Clone)]
enum Link {
    Frames(Arc<ClientConnection>),
    Calls(Arc<dyn CallConnection>),
}

impl Link {
    fn is_usable(&self) -> bool {
        match self {
            Link::Frames(connection) => connection.is_usable(),
            Link::Calls(connection) => connection.is_usable(),
        }
    }
}

struct ChannelInner {
    config: ChannelBuilder,
    current: Mutex<Option<Link>>,
    /// Serialises connection attempts and holds the backoff state.
    connecting: tokio::sync::Mutex<Reconnect>,
    /// Whether a connection went to the fallback (logged once).
    fell_back: std::sync::atomic::AtomicBool,
}

impl ChannelInner {
    fn current_slot(&self) -> std::sync::MutexGuard<'_, Option<Link>> {
        self.current
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    fn usable(&self) -> Option<Link> {
        self.current_slot()
            .as_ref()
            .filter(|c| c.is_usable())
            .cloned()
    }

    async fn open_connection(&self) -> Result<Link, Error> {
        let endpoint = &self.config.endpoint;
        let error = match self.open_connection_to(endpoint).await {
            Ok(connection) => return Ok(connection),
            Err(error) => error,
        };
        let Some(fallback) = &self.config.fallback else {
            return Err(error);
        };
        if self
            .fell_back
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::debug!(%endpoint, %fallback, %error, "connecting to the fallback");
        } else {
            tracing::warn!(
                %endpoint, %fallback, %error,
                "cannot connect to the endpoint; falling back (logged once per channel)"
            );
        }
        self.open_connection_to(fallback).await
    }

    async fn open_connection_to(&self, endpoint: &Endpoint) -> Result<Link, Error> {
        let config = TransportConfig {
            max_frame_len: self.config.max_frame_len,
            receive_budget: None,
        };
        let injected = self
            .config
            .transport
            .as_ref()
            .filter(|_| *endpoint == self.config.endpoint);
        let connecting = async {
            let transport = match injected {
                Some(InjectedTransport(transport)) => transport.clone(),
                None => transport::lookup(endpoint.scheme())?,
            };
            if let Some(connector) = transport.call_connector() {
                let mut settings = CallSettings::new(self.config.max_frame_len);
                settings.keepalive = self.config.keepalive;
                return connector
                    .connect(endpoint, &settings)
                    .await
                    .map(Link::Calls)
                    .map_err(|error| transport::in_context(error, "cannot connect to", endpoint));
            }
            let connection = transport::connect_with(&*transport, endpoint, &config).await?;
            Ok(Link::Frames(ClientConnection::start(
                connection,
                endpoint.scheme(),
                self.config.max_frame_len,
                self.config.keepalive,
                self.config.outbound_queue_bytes,
            )))
        };
        match tokio::time::timeout(self.config.connect_timeout, connecting).await {
            Ok(Ok(link)) => Ok(link),
            Ok(Err(error)) => Err(error.into()),
            Err(_) => Err(Error::ConnectTimeout {
                endpoint: endpoint.to_string(),
                timeout: self.config.connect_timeout,
            }),
        }
    }

    /// The live connection, or a new one; fails fast while backing off.
    async fn connection(&self) -> Result<Link, Status> {
        if let Some(connection) = self.usable() {
            return Ok(connection);
        }
        let mut reconnect = self.connecting.lock().await;
        if let Some(connection) = self.usable() {
            return Ok(connection);
        }
        let endpoint = &self.config.endpoint;
        if let Some(retry_at) = reconnect.retry_at {
            let now = Instant::now();
            if now < retry_at {
                let (code, why) = reconnect
                    .last_error
                    .clone()
                    .unwrap_or((Code::Unavailable, "unknown error".into()));
                return Err(Status::new(
                    code,
                    format!(
                        "cannot connect to {endpoint}: {why}; next attempt in {:?}",
                        retry_at - now
                    ),
                ));
            }
        }
        match self.open_connection().await {
            Ok(connection) => {
                tracing::debug!(%endpoint, "connected");
                reconnect.retry_at = None;
                reconnect.backoff = reconnect.maker.make_backoff();
                reconnect.last_error = None;
                *self.current_slot() = Some(connection.clone());
                Ok(connection)
            }
            Err(error) => {
                let wait = reconnect.backoff.next_backoff();
                reconnect.retry_at = Some(wait.deadline());
                tracing::debug!(%endpoint, %error, "connect failed");
                let why = error.to_string();
                let message = format!("cannot connect to {endpoint}: {why}");
                // A peer that said it has no room is out of resources, not
                // unreachable (retrying it at once only adds to its load);
                // its refusal is the source, as on a GOAWAY refusal.
                let status = match error {
                    Error::Transport(refusal @ TransportError::ResourceExhausted(_)) => {
                        Status::resource_exhausted(message).with_source(refusal)
                    }
                    error => Status::unavailable(message).with_source(error),
                };
                reconnect.last_error = Some((status.code(), why));
                Err(status)
            }
        }
    }
}

/// A client connection to one endpoint, shared by all its clones.
///
/// It implements `tower::Service<Request<Payload>>` (responses are
/// `Response<Bytes>`): the request carries the method path ([`Request::set_method`]; generated clients set it) and an
/// optional timeout. Any number of calls may be in flight at once on its one
/// connection. The connection is opened on the first call (or by
/// [`ChannelBuilder::connect`]); when it is lost, every pending call fails with
/// [`Code::Unavailable`] at once and the next call reconnects, waiting
/// between failed attempts as [`Backoff`] says (calls during that wait fail
/// fast with `Unavailable`).
///
/// When the server closes the connection gracefully (GOAWAY: shutting down,
/// or the connection was idle), calls it never saw are sent again on a new
/// connection, once; so an idle channel whose connection the server reaped
/// just reconnects on its next call.
///
/// A call's timeout is sent to the server as a deadline and enforced here
/// too: [`Code::DeadlineExceeded`] when it passes. Dropping a call's future
/// sends a cancel frame and the server aborts the handler.
///
/// As a tower `Service`, `poll_ready` is pending while the connection's
/// outbound queue is full ([`ChannelBuilder::outbound_queue_bytes`]).
pub struct Channel {
    inner: Arc<ChannelInner>,
    ready: Ready,
}

/// `poll_ready`'s state, per clone: the connection it last looked at (kept,
/// so a ready check costs two atomic loads, not the channel's lock) and the
/// wait for room in a full queue.
#[derive(Default)]
struct Ready {
    connection: Option<Link>,
    waiting: Option<Pin<Box<dyn Future<Output = ()> + Send + Sync>>>,
}

impl Clone for Channel {
    fn clone(&self) -> Channel {
        Channel {
            inner: self.inner.clone(),
            ready: Ready::default(),
        }
    }
}

impl fmt::Debug for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Channel")
            .field("endpoint", &self.inner.config.endpoint)
            .finish()
    }
}

impl Channel {
    /// A builder with default settings for `endpoint`.
    pub fn builder(endpoint: Endpoint) -> ChannelBuilder {
        ChannelBuilder {
            endpoint,
            connect_timeout: Duration::from_secs(5),
            default_timeout: None,
            max_frame_len: DEFAULT_MAX_FRAME_LEN,
            backoff: Backoff::default(),
            fallback: None,
            transport: None,
            keepalive: Some(Keepalive::default()),
            outbound_queue_bytes: DEFAULT_OUTBOUND_QUEUE_BYTES,
        }
    }

    /// Connects now with default settings.
    pub async fn connect<E>(endpoint: E) -> Result<Channel, Error>
    where
        E: TryInto<Endpoint>,
        E::Error: Into<Error>,
    {
        Channel::builder(endpoint.try_into().map_err(Into::into)?)
            .connect()
            .await
    }

    /// A channel with default settings that connects on its first call.
    pub fn from_endpoint(endpoint: Endpoint) -> Channel {
        Channel::builder(endpoint).connect_lazy()
    }

    /// The endpoint this channel talks to.
    pub fn endpoint(&self) -> &Endpoint {
        &self.inner.config.endpoint
    }

    /// Connects now if not connected (a probe of whether the server is
    /// reachable again): `Unavailable` when it is not.
    pub(crate) async fn ensure_connected(&self) -> Result<(), Status> {
        self.inner.connection().await.map(drop)
    }

    /// Performs one call with an encoded message: [`Bytes`], a [`Payload`]
    /// of several parts, or anything else that converts to one.
    pub async fn unary<P: Into<Payload>>(
        &self,
        request: Request<P>,
    ) -> Result<Response<Bytes>, Status> {
        call(self.inner.clone(), request.map(Into::into)).await
    }

    /// Performs one streaming call with encoded messages: sends each message
    /// `request` yields (as the server's window allows), then half-closes,
    /// and resolves once the server sent its response metadata, with its
    /// messages. Generated clients wrap this with typed messages.
    pub async fn streaming<S>(
        &self,
        request: Request<S>,
    ) -> Result<Response<Streaming<Bytes>>, Status>
    where
        S: futures_core::Stream<Item = Payload> + Send + 'static,
    {
        let request = request.map(Outbound::ready_or_many);
        let response = call(self.inner.clone(), into_streaming_request(request)).await?;
        let (metadata, inbound) = take_inbound(response)?;
        Ok(Response::from_parts(metadata, inbound))
    }
}

fn path_of<T>(request: &Request<T>) -> Result<String, Status> {
    request.method().map(str::to_owned).ok_or_else(|| {
        Status::internal(
            "request has no method path: set one with Request::set_method or use a generated client",
        )
    })
}

async fn call(
    inner: Arc<ChannelInner>,
    request: Request<Payload>,
) -> Result<Response<Bytes>, Status> {
    if let Some(OutboundMessages(messages)) = request.extensions().get::<OutboundMessages>() {
        let Some(messages) = messages.take() else {
            return Err(Status::internal(
                "a streaming call cannot be sent twice (its messages were taken by an earlier attempt)",
            ));
        };
        return call_streaming(inner, request, messages).await;
    }
    let path = path_of(&request)?;
    let timeout = request.timeout().or(inner.config.default_timeout);
    let record = CallRecord::start(Side::Client, &path, request.get_ref().len());
    let span = tracing::debug_span!(
        "rpc.client",
        method = %path,
        call_id = tracing::field::Empty,
        peer = %inner.config.endpoint,
    );
    // The clock is read for a deadline or a traced call, not for every call.
    let started = (timeout.is_some() || !span.is_disabled()).then(Instant::now);
    let deadline = timeout
        .zip(started)
        .map(|(timeout, started)| started + timeout);
    let work = async {
        let mut attempt = 1;
        loop {
            let connection = inner.connection().await?;
            let remaining =
                deadline.map(|deadline| deadline.saturating_duration_since(Instant::now()));
            if remaining == Some(Duration::ZERO) {
                return Err(deadline_exceeded(timeout));
            }
            let metadata = request.metadata().clone();
            let payload = request.get_ref().clone();
            let connection = match connection {
                Link::Frames(connection) => connection,
                Link::Calls(connection) => {
                    let call = OutgoingCall {
                        path: path.clone(),
                        timeout: remaining,
                        metadata,
                        body: payload,
                    };
                    match connection.unary(call).await {
                        Ok(response) => return Ok(Ok(response)),
                        Err(failure) if failure.unprocessed && attempt < MAX_ATTEMPTS => {
                            tracing::debug!(status = %failure.status, "the server never saw the call: sending it again on a new connection");
                            attempt += 1;
                            continue;
                        }
                        Err(failure) => return Err(failure.status),
                    }
                }
            };
            let failure = match connection
                .start_call(&path, remaining, metadata, payload)
                .await
            {
                Ok(pending) => {
                    span.record("call_id", pending.call_id());
                    match pending.await {
                        Ok(frame) => return Ok(into_response(frame)),
                        Err(failure) => failure,
                    }
                }
                Err(failure) => failure,
            };
            if !failure.unprocessed || attempt >= MAX_ATTEMPTS {
                return Err(failure.status);
            }
            tracing::debug!(status = %failure.status, "the server never saw the call: sending it again on a new connection");
            attempt += 1;
        }
    };
    let outcome = match deadline {
        Some(deadline) => {
            match tokio::time::timeout_at(deadline, work.instrument(span.clone())).await {
                Ok(outcome) => outcome,
                Err(_) => Err(deadline_exceeded(timeout)),
            }
        }
        None => work.instrument(span.clone()).await,
    };
    let outcome = outcome.and_then(|response| response);
    let code = outcome.as_ref().map_or_else(Status::code, |_| Code::Ok);
    if let Some(record) = record {
        record.finish(code, outcome.as_ref().map_or(0, |r| r.get_ref().len()));
    }
    tracing::debug!(parent: &span, ?code, elapsed_us = started.map_or(0, |started| started.elapsed().as_micros() as u64), "call finished");
    outcome
}

/// A streaming call: opens it, starts sending its messages, and resolves
/// with the server's response metadata; the server's messages are in the
/// response's extensions ([`InboundMessages`]). The deadline covers the whole
/// stream. Once its first message is taken, a streaming call is never sent
/// again: its messages are the application's, and may be gone.
async fn call_streaming(
    inner: Arc<ChannelInner>,
    request: Request<Payload>,
    messages: Outbound,
) -> Result<Response<Bytes>, Status> {
    let path = path_of(&request)?;
    let timeout = request.timeout().or(inner.config.default_timeout);
    let deadline = timeout.map(|timeout| (Instant::now() + timeout, timeout));
    let kind_unknown = request
        .extensions()
        .get::<crate::stream::KindUnknown>()
        .is_some();
    let mut messages = messages;
    let open = async {
        // Opening is sent again on a new connection when this server never
        // saw it (as for unary calls): no message has been taken yet.
        let mut attempt = 1;
        let (connection, open) = loop {
            let connection = inner.connection().await?;
            let remaining =
                deadline.map(|(deadline, _)| deadline.saturating_duration_since(Instant::now()));
            let connection = match connection {
                Link::Frames(connection) => connection,
                Link::Calls(connection) => {
                    let call = OutgoingCall {
                        path: path.clone(),
                        timeout: remaining,
                        metadata: request.metadata().clone(),
                        body: OutgoingMessages(messages),
                    };
                    match connection.streaming(call).await {
                        Ok(response) => {
                            let (metadata, mut inbound) = response.into_parts();
                            if let Some((deadline, budget)) = deadline {
                                inbound = inbound.with_deadline(deadline, budget);
                            }
                            let mut response = Response::from_parts(metadata, Bytes::new());
                            response
                                .extensions_mut()
                                .insert(InboundMessages(TakeOnce::new(inbound)));
                            return Ok(response);
                        }
                        Err(StreamFailure {
                            failure,
                            unsent: Some(unsent),
                        }) if failure.unprocessed && attempt < MAX_ATTEMPTS => {
                            messages = unsent.0;
                            attempt += 1;
                            continue;
                        }
                        Err(StreamFailure { failure, .. }) => return Err(failure.status),
                    }
                }
            };
            match connection
                .start_stream(
                    &path,
                    remaining,
                    request.metadata().clone(),
                    kind_unknown,
                    // Whole only for a call of unknown kind (tonic's calls
                    // through TonicChannel: most are unary, answered in one
                    // frame each way). A known streaming method's handler
                    // would start streaming before the server reads on, and
                    // on siw0 its cancel then took over a second to arrive
                    // (not yet understood: see issue 29's notes).
                    if kind_unknown { messages.whole() } else { None },
                )
                .await
            {
                Ok(open) => break (connection, open),
                Err(failure) if failure.unprocessed && attempt < MAX_ATTEMPTS => attempt += 1,
                Err(failure) => return Err(failure.status),
            }
        };
        let OpenStream {
            call_id,
            headers,
            mut inbound,
            mut sink,
            sent_whole,
        } = open;
        let messages = match messages {
            Outbound::Whole(messages) if !sent_whole => {
                Outbound::many(futures_util::stream::iter(messages), RawCodec)
            }
            messages => messages,
        };
        let pump = match messages {
            // The messages went with the request frame.
            _ if sent_whole => None,
            Outbound::Whole(_) => unreachable!("a whole stream not sent whole became Many"),
            Outbound::One(message) => {
                if let Err(status) = sink.send_last(message).await {
                    connection.end_call(call_id, status.clone());
                    return Err(status);
                }
                None
            }
            // Sent from here while the messages are ready and the window
            // open (a request stream that is there already, such as the one
            // message of tonic's unary calls, needs no task); the rest from
            // a task of its own.
            Outbound::Many(messages) => {
                let mut pump = Box::pin(send_messages(connection.clone(), call_id, sink, messages));
                match futures_util::poll!(pump.as_mut()) {
                    std::task::Poll::Ready(()) => None,
                    std::task::Poll::Pending => Some(tokio::spawn(pump).abort_handle()),
                }
            }
        };
        inbound.set_guard(Box::new(StreamGuard {
            connection,
            call_id,
            pump,
        }));
        if let Some((deadline, budget)) = deadline {
            inbound.set_deadline(deadline, budget);
        }
        let headers = match headers.await {
            Ok(frame) => frame,
            Err(failure) => return Err(failure.status),
        };
        if headers.kind == FrameKind::Response && headers.status != Code::Ok {
            return Err(super::reader::status_of(&headers));
        }
        // Headers, or a final OK response (whose metadata is the trailers).
        let metadata = if headers.kind == FrameKind::Headers {
            headers.metadata
        } else {
            crate::Metadata::new()
        };
        let mut response = Response::from_parts(metadata, Bytes::new());
        response
            .extensions_mut()
            .insert(InboundMessages(TakeOnce::new(Streaming::new(inbound, Ok))));
        Ok(response)
    };
    match deadline {
        Some((deadline, budget)) => tokio::time::timeout_at(deadline, open)
            .await
            .unwrap_or_else(|_| Err(deadline_exceeded(Some(budget)))),
        None => open.await,
    }
}

/// Held by the application's end of a client stream: dropping it cancels
/// the call (a no-op once it has ended) and stops sending its messages.
struct StreamGuard {
    connection: Arc<ClientConnection>,
    call_id: u64,
    pump: Option<tokio::task::AbortHandle>,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if let Some(pump) = &self.pump {
            pump.abort();
        }
        self.connection.end_call(
            self.call_id,
            Status::cancelled("call cancelled by the client"),
        );
    }
}

/// Sends a client stream's messages as its window allows, then half-closes.
/// A message that cannot be sent (too large, or the stream yielded an
/// error) ends the call with that error.
async fn send_messages(
    connection: Arc<ClientConnection>,
    call_id: u64,
    sink: crate::stream::MessageSink,
    messages: SendMessages,
) {
    let (sink, result) = messages(sink).await;
    // A call that already ended needs no further word.
    if let Err(failure) = result {
        if sink.call_ended().is_none() {
            connection.end_call(call_id, failure);
        }
    }
}

fn deadline_exceeded(timeout: Option<Duration>) -> Status {
    let budget = timeout.unwrap_or_default();
    Status::deadline_exceeded(format!("deadline of {budget:?} exceeded"))
}

fn into_response(frame: Frame) -> Result<Response<Bytes>, Status> {
    if frame.status == Code::Ok {
        Ok(Response::from_parts(
            frame.metadata,
            frame.payload.into_contiguous(),
        ))
    } else {
        Err(super::reader::status_of(&frame))
    }
}

/// The future of a [`Channel`] call.
pub struct ResponseFuture {
    inner: Pin<Box<dyn Future<Output = Result<Response<Bytes>, Status>> + Send>>,
}

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl Future for ResponseFuture {
    type Output = Result<Response<Bytes>, Status>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl Service<Request<Payload>> for Channel {
    type Response = Response<Bytes>;
    type Error = Status;
    type Future = ResponseFuture;

    /// Ready unless the live connection's outbound queue is full. Calls are
    /// multiplexed without a limit on their number; put a ConcurrencyLimit
    /// layer in front to bound them.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        if !self
            .ready
            .connection
            .as_ref()
            .is_some_and(|connection| connection.is_usable())
        {
            self.ready.connection = self.inner.usable();
            self.ready.waiting = None;
        }
        // Not connected yet (or the connection is going away): the call
        // connects. A front end's connection applies its own flow control.
        let Some(Link::Frames(connection)) = &self.ready.connection else {
            return Poll::Ready(Ok(()));
        };
        let outbound = connection.outbound();
        if outbound.has_room() {
            self.ready.waiting = None;
            return Poll::Ready(Ok(()));
        }
        let waiting = self
            .ready
            .waiting
            .get_or_insert_with(|| Box::pin(outbound.not_full()));
        match waiting.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => {
                self.ready.waiting = None;
                Poll::Ready(Ok(()))
            }
        }
    }

    fn call(&mut self, request: Request<Payload>) -> ResponseFuture {
        // poll_ready saw room; the call reserves its own (and waits if the
        // queue filled up meanwhile).
        ResponseFuture {
            inner: Box::pin(call(self.inner.clone(), request)),
        }
    }
}
