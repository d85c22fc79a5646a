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

use super::connection::{ClientConnection, Keepalive};
use crate::conn_io::DEFAULT_OUTBOUND_QUEUE_BYTES;
use crate::error::Error;
use crate::frame::{DEFAULT_MAX_FRAME_LEN, Frame};
use crate::metrics::{CallRecord, Side};
use crate::payload::Payload;
use crate::request::{Request, Response};
use crate::status::{Code, Status};
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
    last_error: Option<String>,
}

struct ChannelInner {
    config: ChannelBuilder,
    current: Mutex<Option<Arc<ClientConnection>>>,
    /// Serialises connection attempts and holds the backoff state.
    connecting: tokio::sync::Mutex<Reconnect>,
}

impl ChannelInner {
    fn current_slot(&self) -> std::sync::MutexGuard<'_, Option<Arc<ClientConnection>>> {
        self.current
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    fn usable(&self) -> Option<Arc<ClientConnection>> {
        self.current_slot()
            .as_ref()
            .filter(|c| c.is_usable())
            .cloned()
    }

    async fn open_connection(&self) -> Result<Arc<ClientConnection>, Error> {
        let config = TransportConfig {
            max_frame_len: self.config.max_frame_len,
            receive_budget: None,
        };
        let endpoint = &self.config.endpoint;
        match tokio::time::timeout(
            self.config.connect_timeout,
            transport::connect(endpoint, &config),
        )
        .await
        {
            Ok(Ok(connection)) => Ok(ClientConnection::start(
                connection,
                self.config.endpoint.scheme(),
                self.config.max_frame_len,
                self.config.keepalive,
                self.config.outbound_queue_bytes,
            )),
            Ok(Err(error)) => Err(error.into()),
            Err(_) => Err(Error::ConnectTimeout {
                endpoint: endpoint.to_string(),
                timeout: self.config.connect_timeout,
            }),
        }
    }

    /// The live connection, or a new one; fails fast while backing off.
    async fn connection(&self) -> Result<Arc<ClientConnection>, Status> {
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
                return Err(Status::unavailable(format!(
                    "cannot connect to {endpoint}: {}; next attempt in {:?}",
                    reconnect.last_error.as_deref().unwrap_or("unknown error"),
                    retry_at - now
                )));
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
                reconnect.last_error = Some(error.to_string());
                tracing::debug!(%endpoint, %error, "connect failed");
                Err(
                    Status::unavailable(format!("cannot connect to {endpoint}: {error}"))
                        .with_source(error),
                )
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
    connection: Option<Arc<ClientConnection>>,
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
}

async fn call(
    inner: Arc<ChannelInner>,
    request: Request<Payload>,
) -> Result<Response<Bytes>, Status> {
    let Some(path) = request.method().map(str::to_owned) else {
        return Err(Status::internal(
            "request has no method path: set one with Request::set_method or use a generated client",
        ));
    };
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
        let payload = frame.payload.into_contiguous();
        let message = String::from_utf8_lossy(&payload).into_owned();
        Err(Status::with_metadata(frame.status, message, frame.metadata))
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
        // Not connected yet (or the connection is going away): the call connects.
        let Some(connection) = &self.ready.connection else {
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
