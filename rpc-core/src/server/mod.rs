//! The server side: [`Server`] builder, [`Router`], and serving loops.
//!
//! ```no_run
//! # use rpc_core::{Server, server::Routes};
//! # async fn demo<S>(service: S) -> Result<(), rpc_core::Error>
//! # where S: tower::Service<rpc_core::Request<bytes::Bytes>, Response = rpc_core::Response<bytes::Bytes>, Error = rpc_core::Status>
//! #     + rpc_core::server::NamedService + Clone + Send + Sync + 'static, S::Future: Send + 'static {
//! Server::builder()
//!     .layer(tower::timeout::TimeoutLayer::new(std::time::Duration::from_secs(10)))
//!     .add_service(service)
//!     .serve("tcp://0.0.0.0:50051")
//!     .await
//! # }
//! ```
//!
//! Any tower layer whose error is `Into<BoxError>` composes as it is (no
//! `MapErr`): errors become a [`Status`] as tonic maps them
//! ([`Status::from_error`](crate::Status::from_error): tower's timeout is
//! `DeadlineExceeded`, load shedding `ResourceExhausted`). The layered
//! service is cloned per call; a layer whose state must be shared by every
//! call — tower's `RateLimit`, which is not `Clone` for that reason — goes
//! behind a `Buffer`:
//! `.layer(BufferLayer::new(1024)).layer(RateLimitLayer::new(100, Duration::from_secs(1)))`
//! (`rpc-core/tests/server_layers.rs`).
//!
//! Each connection runs a task that reads frames and spawns a task per call.
//! A call runs the layered service under the client's deadline
//! ([`Code::DeadlineExceeded`](crate::Code) when it passes) with panics caught
//! ([`Code::Internal`](crate::Code) for that call only); a cancel frame aborts
//! its task. A connection that sends a malformed frame is closed; the server
//! and its other connections carry on.
//!
//! # Limits
//!
//! Every resource a peer can make the server hold is bounded; each bound has a
//! builder method and a default:
//!
//! | what | builder method | default |
//! |---|---|---|
//! | size of one frame | [`Server::max_frame_len`] | 64 MiB |
//! | bytes of received frames held, all connections together | [`Server::receive_budget`] | 256 MiB, at least 4 × `max_frame_len` |
//! | bytes of frames queued for sending, per connection | [`Server::outbound_queue_bytes`] | 1 MiB |
//! | bytes of frames queued for sending, all connections together (each an equal share, at least 64 KiB) | [`Server::outbound_budget`] | 32 MiB |
//! | calls in flight, per connection | [`Server::max_concurrent_calls_per_connection`] | 4096 |
//! | connections | [`Server::max_connections`] | 10,000 |
//! | connections from one address | [`Server::max_connections_per_address`] | 1,024 |
//! | silence of a connection with no call in flight; a peer that takes none of our frames | [`Server::idle_timeout`] | 60 s |
//!
//! When a bound is reached the server pushes back instead of buffering: a
//! connection whose outbound queue is full, or whose next frame does not fit
//! the receive budget, reads nothing until there is room, which stalls the
//! peer through the transport's flow control. [`Listening::stats`] shows the
//! gauges. `docs/security.md` explains what each limit protects.

mod address_share;
mod connection;
pub mod front_end;
mod routes;
mod stats;
pub mod streaming;
pub mod unary;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::util::BoxCloneSyncService;
use tower_layer::{Identity, Layer, Stack};
use tower_service::Service;

use crate::error::Error;
use crate::frame::{DEFAULT_MAX_FRAME_LEN, Frame, FrameFlags, FrameKind};
use crate::metrics::{ConnectionRecord, Side};
use crate::payload::Payload;
use crate::request::{Request, Response};
use crate::status::{BoxError, Code, Status};
use crate::transport::{
    self, Connection, Endpoint, Listener, ReceiveBudget, TransportConfig, TransportError,
};

pub use crate::conn_io::{
    DEFAULT_OUTBOUND_BUDGET, DEFAULT_OUTBOUND_QUEUE_BYTES, OUTBOUND_SHARE_FLOOR,
};
pub use routes::{NamedService, RoutableService, Routes};
pub use stats::ServerStats;

/// Default per-connection limit on concurrent calls.
pub const DEFAULT_MAX_CONCURRENT_CALLS_PER_CONNECTION: usize = 4096;

/// Default limit on open connections.
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
/// Default of [`Server::max_connections_per_address`].
pub const DEFAULT_MAX_CONNECTIONS_PER_ADDRESS: usize = 1_024;

/// Default idle time-out; see [`Server::idle_timeout`].
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Default for [`Server::shutdown_grace`].
const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Smallest default receive budget; see [`Server::receive_budget`].
pub const DEFAULT_RECEIVE_BUDGET: usize = 256 << 20;

/// Pause after an accept failed for lack of resources (out of file
/// descriptors, buffers or memory) before the next attempt: the pending
/// connection stays in the kernel's backlog, and retrying at once would spin.
const ACCEPT_EXHAUSTED_PAUSE: Duration = Duration::from_millis(100);

/// At most one warning per this interval for each kind of repeated event
/// (failed accepts, refused connections); the others are counted and reported
/// with the next warning.
const WARN_INTERVAL: Duration = Duration::from_secs(5);

/// How long a connection being closed on purpose (refused, idle, drained) is
/// still read and discarded after our last frame, so that the peer reads that
/// frame (GOAWAY) rather than a reset caused by unread bytes.
pub(crate) const CLOSE_LINGER: Duration = Duration::from_secs(1);

/// Refused connections lingering at once; beyond this they are dropped at once.
const MAX_LINGERING_REFUSALS: usize = 64;

#[derive(Debug, Clone)]
pub(crate) struct ServerConfig {
    pub(crate) max_concurrent_calls_per_connection: usize,
    pub(crate) max_frame_len: usize,
    pub(crate) max_connections: usize,
    pub(crate) max_connections_per_address: usize,
    pub(crate) idle_timeout: Duration,
    /// `None`: the default, which depends on `max_frame_len`.
    pub(crate) receive_budget: Option<usize>,
    pub(crate) outbound_queue_bytes: usize,
    pub(crate) outbound_budget: usize,
    pub(crate) access_log: bool,
    pub(crate) shutdown_grace: Duration,
}

impl ServerConfig {
    fn receive_budget(&self) -> usize {
        self.receive_budget
            .unwrap_or(DEFAULT_RECEIVE_BUDGET.max(self.max_frame_len.saturating_mul(4)))
            .max(self.max_frame_len)
    }
}

/// Builds a server: layers, limits, then services.
#[derive(Debug, Clone)]
pub struct Server<L = Identity> {
    layer: L,
    config: ServerConfig,
}

impl Server {
    /// A builder with no layers and default limits.
    pub fn builder() -> Server<Identity> {
        Server {
            layer: Identity::new(),
            config: ServerConfig {
                max_concurrent_calls_per_connection: DEFAULT_MAX_CONCURRENT_CALLS_PER_CONNECTION,
                max_frame_len: DEFAULT_MAX_FRAME_LEN,
                max_connections: DEFAULT_MAX_CONNECTIONS,
                max_connections_per_address: DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
                idle_timeout: DEFAULT_IDLE_TIMEOUT,
                receive_budget: None,
                outbound_queue_bytes: DEFAULT_OUTBOUND_QUEUE_BYTES,
                outbound_budget: DEFAULT_OUTBOUND_BUDGET,
                access_log: false,
                shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            },
        }
    }
}

impl<L> Server<L> {
    /// Wraps every call in `layer`. The first layer added is the outermost.
    pub fn layer<NewLayer>(self, layer: NewLayer) -> Server<Stack<NewLayer, L>> {
        Server {
            layer: Stack::new(layer, self.layer),
            config: self.config,
        }
    }

    /// Calls one connection may have in flight; more are answered with
    /// `ResourceExhausted` (default [`DEFAULT_MAX_CONCURRENT_CALLS_PER_CONNECTION`]).
    pub fn max_concurrent_calls_per_connection(mut self, limit: usize) -> Self {
        self.config.max_concurrent_calls_per_connection = limit.max(1);
        self
    }

    /// Largest frame accepted or sent (default 64 MiB).
    pub fn max_frame_len(mut self, len: usize) -> Self {
        self.config.max_frame_len = len;
        self
    }

    /// Connections served at once (default [`DEFAULT_MAX_CONNECTIONS`], 10,000;
    /// at least 1).
    ///
    /// A connection beyond the limit is accepted only to be refused: the server
    /// sends it a GOAWAY with status `RESOURCE_EXHAUSTED` and the reason
    /// ("connection limit of N reached"), then closes it. A [`crate::Channel`]
    /// fails its calls with `UNAVAILABLE` carrying that reason. Protects file
    /// descriptors and the per-connection memory the other limits allow; keep
    /// it below the process's `RLIMIT_NOFILE`. (Accepting fails for lack of file
    /// descriptors anyway: the server then backs off 100 ms, warns at most once
    /// per 5 s, and keeps accepting.)
    pub fn max_connections(mut self, limit: usize) -> Self {
        self.config.max_connections = limit.max(1);
        self
    }

    /// Caps the connections open at once from one source address (default
    /// [`DEFAULT_MAX_CONNECTIONS_PER_ADDRESS`], 1,024), so that one host
    /// cannot take every place of [`Server::max_connections`] and lock out
    /// the rest. A connection beyond it is refused as one beyond
    /// `max_connections` is (GOAWAY `RESOURCE_EXHAUSTED`, "connection limit
    /// of N per address reached for IP"). Transports whose peers have no IP
    /// address (`mem://`) count toward `max_connections` only. Raise it for
    /// a server whose clients share an address by design (a proxy, a load
    /// test from one host).
    pub fn max_connections_per_address(mut self, limit: usize) -> Self {
        self.config.max_connections_per_address = limit.max(1);
        self
    }

    /// Closes connections that do nothing (default [`DEFAULT_IDLE_TIMEOUT`], 60 s).
    ///
    /// A connection with no call in flight that has not completed a frame for
    /// `timeout` gets a GOAWAY and is closed. This reclaims connections that
    /// never send a frame (including an `rdma://` connection whose peer never
    /// gets going) and "slowloris" peers that trickle a frame's bytes without
    /// ever completing it. The same limit applies to the other direction: a
    /// peer that takes none of our frames for `timeout` (its receive window
    /// stays closed while we have frames for it) is disconnected, which ends
    /// the calls that wait to send it their responses. So a response frame must
    /// leave within `timeout`: 64 MiB in 60 s needs about 1.1 MB/s.
    ///
    /// Pings are frames: a [`crate::Channel`] with keepalive (by default a ping
    /// after 30 s of silence) keeps its idle connection open; the 60 s default
    /// is twice that interval so healthy idle clients are never cut. A channel
    /// whose idle connection was closed reconnects on its next call, and a call
    /// that raced with the GOAWAY is retried there transparently.
    pub fn idle_timeout(mut self, timeout: Duration) -> Self {
        self.config.idle_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// How long a graceful shutdown ([`Listening::serve_with_shutdown`]) waits
    /// for the calls in flight (default 10 s). Calls still running then,
    /// streams above all, end with `Unavailable` ("server shutting down"),
    /// as gRPC servers end theirs after a GOAWAY; then the server returns.
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.config.shutdown_grace = grace;
        self
    }

    /// Logs one INFO line per call (target `rpc_core::access`): method,
    /// peer, status code, latency and message sizes. Off by default.
    pub fn access_log(mut self, enabled: bool) -> Self {
        self.config.access_log = enabled;
        self
    }

    /// Bytes of received frames the server holds at once, all connections
    /// together (default: [`DEFAULT_RECEIVE_BUDGET`], 256 MiB, or 4 ×
    /// [`max_frame_len`](Self::max_frame_len) if that is larger; never less
    /// than `max_frame_len`, so that any frame fits once others are released).
    ///
    /// The transport reserves a frame's length here before it buffers the
    /// frame, and the frame holds its reservation until its last reference is
    /// dropped: while it is received and dispatched and, for requests, while
    /// the handler keeps (a slice of) the request payload — with generated
    /// services, until the message is decoded. A frame that does not fit waits
    /// for others to be released; meanwhile its connection reads nothing, so
    /// the peer is held back by the transport's flow control instead of the
    /// server buffering. Each connection may also hold up to 16 KiB of small
    /// frames outside the budget ([`transport::PER_CONNECTION_ALLOWANCE`]), so
    /// ordinary small calls go on while peers hold the budget with large
    /// frames they are slow to finish. `tcp://` and `mem://` honour the
    /// budget; other transports may (see [`TransportConfig::receive_budget`]).
    /// A handler that keeps request payloads for good holds budget for good.
    pub fn receive_budget(mut self, bytes: usize) -> Self {
        self.config.receive_budget = Some(bytes);
        self
    }

    /// Bytes of frames (responses, pongs, refusals) one connection may queue
    /// for its transport (default [`DEFAULT_OUTBOUND_QUEUE_BYTES`], 1 MiB).
    ///
    /// A frame holds its room until the transport has flushed it. When the
    /// queue is full, finished calls wait to queue their responses and the
    /// connection stops reading new frames, so a peer that sends requests but
    /// never reads the responses is held back by its own send window instead of
    /// growing the server's memory. A frame larger than the queue is sent alone.
    /// Memory per such connection is bounded by this queue plus the responses of
    /// the calls in flight ([`max_concurrent_calls_per_connection`](Self::max_concurrent_calls_per_connection)),
    /// and lasts until [`idle_timeout`](Self::idle_timeout) ends a peer that takes nothing.
    pub fn outbound_queue_bytes(mut self, bytes: usize) -> Self {
        self.config.outbound_queue_bytes = bytes;
        self
    }

    /// Bytes all connections' outbound queues may hold together (default
    /// [`DEFAULT_OUTBOUND_BUDGET`], 32 MiB).
    ///
    /// Each connection may queue an equal share of it (the budget divided by
    /// the connections open), at least [`OUTBOUND_SHARE_FLOOR`] (64 KiB) and
    /// at most [`outbound_queue_bytes`](Self::outbound_queue_bytes). A
    /// connection over its share stops reading, as one whose queue is full:
    /// many peers that stop reading their answers hold about
    /// `max(budget, connections × 64 KiB)` of queued answers together, not
    /// `connections × outbound_queue_bytes` (plus, per connection, one frame
    /// larger than its share: an empty queue takes any one frame, up to
    /// `max_frame_len`, so that it can be sent at all), and a well-behaved
    /// connection never waits for another's room. `0` turns the sharing off.
    pub fn outbound_budget(mut self, bytes: usize) -> Self {
        self.config.outbound_budget = bytes;
        self
    }

    /// Adds the first service.
    pub fn add_service<S: RoutableService>(self, service: S) -> Router<L> {
        let mut routes = Routes::default();
        routes.add_service(service);
        Router {
            server: self,
            routes,
        }
    }
}

/// A server with its services, ready to serve.
#[derive(Debug, Clone)]
pub struct Router<L = Identity> {
    server: Server<L>,
    routes: Routes,
}

impl<L> Router<L>
where
    L: Layer<Routes>,
    L::Service:
        Service<Request<Bytes>, Response = Response<Payload>> + Clone + Send + Sync + 'static,
    <L::Service as Service<Request<Bytes>>>::Error: Into<BoxError> + Send,
    <L::Service as Service<Request<Bytes>>>::Future: Send + 'static,
{
    /// Adds another service.
    pub fn add_service<S: RoutableService>(mut self, service: S) -> Self {
        self.routes.add_service(service);
        self
    }

    /// Binds `endpoint` now; serving starts with [`Listening::serve`]. Use it to
    /// learn the port when binding port 0.
    pub async fn listen<E>(self, endpoint: E) -> Result<Listening, Error>
    where
        E: TryInto<Endpoint>,
        E::Error: Into<Error>,
    {
        let endpoint = endpoint.try_into().map_err(Into::into)?;
        let transport = transport::lookup(endpoint.scheme())?;
        self.listen_with(transport, endpoint).await
    }

    /// Binds `endpoint` with `transport` instead of the one its scheme names
    /// in the registry ([`transport::register`]): no process-global
    /// registration, any scheme. The transport gets the server's frame limit
    /// and receive budget, as with [`listen`](Self::listen).
    pub async fn listen_with<E>(
        self,
        transport: Arc<dyn transport::Transport>,
        endpoint: E,
    ) -> Result<Listening, Error>
    where
        E: TryInto<Endpoint>,
        E::Error: Into<Error>,
    {
        let endpoint = endpoint.try_into().map_err(Into::into)?;
        let budget = ReceiveBudget::new(self.server.config.receive_budget());
        let transport_config = TransportConfig {
            max_frame_len: self.server.config.max_frame_len,
            receive_budget: Some(budget.clone()),
        };
        let incoming = match transport.front_end() {
            Some(front_end) => Incoming::Calls(
                front_end
                    .bind(&endpoint, &transport_config)
                    .await
                    .map_err(|error| transport::in_context(error, "cannot listen on", &endpoint))?,
            ),
            None => Incoming::Frames(
                transport::bind_with(&*transport, &endpoint, &transport_config).await?,
            ),
        };
        Ok(self.listening(incoming, budget))
    }

    /// Serves connections from `incoming`, any [`Listener`]
    /// made outside (tonic's `serve_with_incoming`): a stream of accepted
    /// connections and the endpoint they were accepted on. Such a listener
    /// was built without the server's [`TransportConfig`], so the receive
    /// budget holds only what the connections' transport reserves in it
    /// (none, unless it was given [`Listening::stats`]'s budget); the other
    /// limits apply as everywhere.
    pub fn listen_on(self, incoming: Box<dyn transport::Listener>) -> Listening {
        let budget = ReceiveBudget::new(self.server.config.receive_budget());
        self.listening(Incoming::Frames(incoming), budget)
    }

    /// Serves a front end's connections from `incoming` (gRPC's:
    /// `rpc_grpc::GrpcTransport::incoming(tcp_listener)`), as
    /// [`Router::listen_on`] serves a transport's: tonic's
    /// `serve_with_incoming`, for a socket bound (or inherited) elsewhere,
    /// with no process-global registration.
    pub fn listen_on_front_end(self, incoming: Box<dyn front_end::FrontEndListener>) -> Listening {
        let budget = ReceiveBudget::new(self.server.config.receive_budget());
        self.listening(Incoming::Calls(incoming), budget)
    }

    fn listening(self, listener: Incoming, budget: ReceiveBudget) -> Listening {
        let service = self.server.layer.layer(self.routes);
        let service = tower::ServiceExt::map_err(
            service,
            |error: <L::Service as Service<Request<Bytes>>>::Error| {
                Status::from_error(error.into())
            },
        );
        Listening {
            listener,
            service: BoxCloneSyncService::new(service),
            stats: ServerStats::new(budget, self.server.config.outbound_budget),
            config: self.server.config,
        }
    }

    /// Serves on `endpoint` until the process ends or accepting fails for good.
    pub async fn serve<E>(self, endpoint: E) -> Result<(), Error>
    where
        E: TryInto<Endpoint>,
        E::Error: Into<Error>,
    {
        self.listen(endpoint).await?.serve().await
    }

    /// Serves on `endpoint` until `signal` completes, then shuts down
    /// gracefully: stops accepting, tells every client (GOAWAY), lets in-flight
    /// calls finish for up to [`Server::shutdown_grace`], ends those still
    /// running with `Unavailable`, and returns. Dropping the future (or
    /// aborting its task) ends every connection it serves at once.
    pub async fn serve_with_shutdown<E, F>(self, endpoint: E, signal: F) -> Result<(), Error>
    where
        E: TryInto<Endpoint>,
        E::Error: Into<Error>,
        F: Future<Output = ()> + Send,
    {
        self.listen(endpoint)
            .await?
            .serve_with_shutdown(signal)
            .await
    }
}

/// A bound server that has not started serving yet.
pub struct Listening {
    listener: Incoming,
    service: connection::ServerService,
    config: ServerConfig,
    stats: ServerStats,
}

impl std::fmt::Debug for Listening {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listening")
            .field("endpoint", &self.listener.local_endpoint())
            .finish()
    }
}

impl Listening {
    /// Where the server listens (with the real port when port 0 was asked for).
    pub fn local_endpoint(&self) -> Endpoint {
        self.listener.local_endpoint()
    }

    /// Live gauges and counters of this server (connections, budgets, queues);
    /// the handle stays valid while and after it serves.
    pub fn stats(&self) -> ServerStats {
        self.stats.clone()
    }

    /// Serves until the process ends.
    pub async fn serve(self) -> Result<(), Error> {
        self.serve_with_shutdown(std::future::pending()).await
    }

    /// Serves until `signal` completes, then shuts down gracefully (as
    /// `Server::serve_with_shutdown` describes). Dropping the future ends
    /// every connection it serves at once.
    pub async fn serve_with_shutdown<F>(self, signal: F) -> Result<(), Error>
    where
        F: Future<Output = ()> + Send,
    {
        let Listening {
            mut listener,
            service,
            config,
            stats,
        } = self;
        let endpoint = listener.local_endpoint();
        let scheme: Arc<str> = endpoint.scheme().into();
        tracing::info!(%endpoint, max_connections = config.max_connections, "serving");
        let connections = TaskTracker::new();
        // Connections run on tasks of their own: they end when this future
        // is dropped (or its task aborted), not only after a graceful end.
        let abort = CancellationToken::new();
        let _abort_when_dropped = abort.clone().drop_guard();
        let shutdown = abort.child_token();
        let slots = Arc::new(Semaphore::new(config.max_connections));
        let shares = address_share::AddressShares::new(config.max_connections_per_address);
        let lingering_refusals = Arc::new(Semaphore::new(MAX_LINGERING_REFUSALS));
        let mut accept_warnings = RateLimit::new(WARN_INTERVAL);
        let mut refusal_warnings = RateLimit::new(WARN_INTERVAL);
        let mut signal = std::pin::pin!(signal);
        loop {
            tokio::select! {
                () = &mut signal => break,
                accepted = listener.next() => match accepted {
                    Some(Ok(connection)) => match (slots.clone().try_acquire_owned(), shares.take(connection.peer())) {
                        (Ok(slot), Ok(share)) => {
                            tracing::debug!(peer = %connection.peer(), "accepted connection");
                            let slot = stats.inner.connection_slot(slot);
                            let shutdown = connection::Shutdown {
                                graceful: shutdown.child_token(),
                                now: abort.child_token(),
                            };
                            match connection {
                                Accepted::Frames(connection) => {
                                    let served = connection::serve_connection(
                                        connection,
                                        service.clone(),
                                        config.clone(),
                                        shutdown,
                                        stats.inner.clone(),
                                        slot,
                                        scheme.clone(),
                                    );
                                    connections.spawn(async move {
                                        let _share = share;
                                        served.await
                                    });
                                }
                                Accepted::Calls(connection) => {
                                    let calls = front_end::Calls::new(
                                        service.clone(),
                                        stats.budget().clone(),
                                        connection.peer().to_owned(),
                                        config.clone(),
                                        shutdown,
                                    );
                                    let served = connection.serve(calls);
                                    let counted = ConnectionRecord::open(Side::Server, &scheme);
                                    connections.spawn(async move {
                                        let (_share, _slot, _counted) = (share, slot, counted);
                                        served.await
                                    });
                                }
                            }
                        }
                        (slot, share) => {
                            // Per address first: it names who is refused.
                            let (limit, reason) = match share {
                                Err(ip) => (
                                    config.max_connections_per_address,
                                    format!(
                                        "server connection limit of {} per address reached for {ip}; try again later",
                                        config.max_connections_per_address
                                    ),
                                ),
                                Ok(_) => (
                                    config.max_connections,
                                    format!(
                                        "server connection limit of {} reached; try again later",
                                        config.max_connections
                                    ),
                                ),
                            };
                            drop(slot);
                            stats.inner.refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            if let Some(suppressed) = refusal_warnings.allow() {
                                tracing::warn!(
                                    %endpoint,
                                    peer = %connection.peer(),
                                    limit,
                                    suppressed,
                                    %reason,
                                    "refusing a connection"
                                );
                            }
                            let linger = lingering_refusals.clone().try_acquire_owned().ok();
                            match connection {
                                Accepted::Frames(connection) => {
                                    connections.spawn(refuse(
                                        connection,
                                        reason,
                                        linger,
                                        shutdown.child_token(),
                                    ));
                                }
                                // Only while few refusals linger; others are dropped at once.
                                Accepted::Calls(connection) => if let Some(linger) = linger {
                                    let refusal = connection.refuse(reason);
                                    let shutdown = shutdown.child_token();
                                    connections.spawn(async move {
                                        let _linger = linger;
                                        tokio::select! {
                                            () = refusal => {}
                                            () = tokio::time::sleep(FRONT_END_REFUSAL) => {}
                                            () = shutdown.cancelled() => {}
                                        }
                                    });
                                },
                            }
                        }
                    },
                    Some(Err(error)) => {
                        stats.inner.accept_errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let exhausted = is_resource_exhaustion(&error);
                        if let Some(suppressed) = accept_warnings.allow() {
                            if exhausted {
                                tracing::warn!(
                                    %endpoint,
                                    %error,
                                    suppressed,
                                    "accept failed for lack of resources; pausing accepts for {ACCEPT_EXHAUSTED_PAUSE:?}"
                                );
                            } else {
                                tracing::warn!(%endpoint, %error, suppressed, "accept failed");
                            }
                        }
                        if exhausted {
                            tokio::select! {
                                () = &mut signal => break,
                                () = tokio::time::sleep(ACCEPT_EXHAUSTED_PAUSE) => {}
                            }
                        }
                    }
                    None => break,
                },
            }
        }
        drop(listener);
        tracing::info!(%endpoint, in_flight_connections = connections.len(), "shutting down");
        shutdown.cancel();
        connections.close();
        if tokio::time::timeout(config.shutdown_grace, connections.wait())
            .await
            .is_err()
        {
            tracing::info!(
                %endpoint,
                in_flight_connections = connections.len(),
                grace = ?config.shutdown_grace,
                "grace period over: ending the calls still in flight"
            );
            abort.cancel();
            connections.wait().await;
        }
        Ok(())
    }
}

/// True when a failed accept means the process or system ran out of something
/// (file descriptors, buffers, memory) rather than that one incoming connection
/// failed: then retrying at once would fail again (and spin).
fn is_resource_exhaustion(error: &TransportError) -> bool {
    use std::io::ErrorKind;
    match error {
        TransportError::Io(error) => !matches!(
            error.kind(),
            ErrorKind::ConnectionAborted
                | ErrorKind::ConnectionReset
                | ErrorKind::ConnectionRefused
                | ErrorKind::BrokenPipe
                | ErrorKind::NotConnected
                | ErrorKind::TimedOut
                | ErrorKind::UnexpectedEof
                | ErrorKind::InvalidData
                | ErrorKind::Interrupted
                | ErrorKind::WouldBlock
        ),
        // A failed set-up of one connection (e.g. RDMA's exchange) or a bad frame.
        _ => false,
    }
}

/// Lets one event of a repeated kind through per interval and counts the rest.
#[derive(Debug)]
struct RateLimit {
    interval: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimit {
    fn new(interval: Duration) -> RateLimit {
        RateLimit {
            interval,
            last: None,
            suppressed: 0,
        }
    }

    /// `Some(events suppressed since the last one allowed)`, or `None` to stay quiet.
    fn allow(&mut self) -> Option<u64> {
        let now = Instant::now();
        match self.last {
            Some(last) if now.duration_since(last) < self.interval => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

/// Refuses a connection over the limit: a GOAWAY with `RESOURCE_EXHAUSTED` and
/// `reason`, then the close. With a `linger` slot it reads and discards what
/// the peer sends meanwhile (at most [`CLOSE_LINGER`]), so that the peer sees
/// the GOAWAY rather than a reset; without one it closes at once.
/// How long a front end's connection may take to say it is refused.
const FRONT_END_REFUSAL: Duration = Duration::from_secs(3);

/// What a server listens with.
enum Incoming {
    /// A transport's connections of rpc-core's frames.
    Frames(Box<dyn Listener>),
    /// A front end's connections, which bring their calls themselves.
    Calls(Box<dyn front_end::FrontEndListener>),
}

enum Accepted {
    Frames(Connection),
    Calls(Box<dyn front_end::FrontEndConnection>),
}

impl Accepted {
    fn peer(&self) -> &str {
        match self {
            Accepted::Frames(connection) => &connection.peer,
            Accepted::Calls(connection) => connection.peer(),
        }
    }
}

impl Incoming {
    fn local_endpoint(&self) -> Endpoint {
        match self {
            Incoming::Frames(listener) => listener.local_endpoint(),
            Incoming::Calls(listener) => listener.local_endpoint(),
        }
    }

    async fn next(&mut self) -> Option<Result<Accepted, TransportError>> {
        match self {
            Incoming::Frames(listener) => Some(listener.next().await?.map(Accepted::Frames)),
            Incoming::Calls(listener) => Some(listener.next().await?.map(Accepted::Calls)),
        }
    }
}

async fn refuse(
    connection: Connection,
    reason: String,
    linger: Option<OwnedSemaphorePermit>,
    shutdown: CancellationToken,
) {
    let Connection {
        mut sink,
        mut stream,
        peer,
    } = connection;
    let mut goaway = Frame::control(FrameKind::GoAway, FrameFlags::EMPTY, 0);
    goaway.status = Code::ResourceExhausted;
    goaway.payload = Payload::from(reason);
    let refusal = async {
        if sink.send(goaway.encode_parts()).await.is_ok()
            && sink.close().await.is_ok()
            && linger.is_some()
        {
            while let Some(Ok(_)) = stream.next().await {}
        }
    };
    tokio::select! {
        () = refusal => {}
        () = tokio::time::sleep(CLOSE_LINGER) => {}
        () = shutdown.cancelled() => {}
    }
    tracing::debug!(%peer, "refused connection closed");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limit_lets_one_through_per_interval_and_counts_the_rest() {
        let mut limit = RateLimit::new(Duration::from_secs(3600));
        assert_eq!(limit.allow(), Some(0));
        assert_eq!(limit.allow(), None);
        assert_eq!(limit.allow(), None);
        limit.last = Some(Instant::now() - Duration::from_secs(3601));
        assert_eq!(limit.allow(), Some(2));
        assert_eq!(limit.allow(), None);
    }

    #[test]
    fn out_of_descriptors_is_exhaustion_and_a_reset_is_not() {
        let emfile = TransportError::Io(std::io::Error::from_raw_os_error(24));
        let enfile = TransportError::Io(std::io::Error::from_raw_os_error(23));
        let reset = TransportError::Io(std::io::ErrorKind::ConnectionAborted.into());
        assert!(is_resource_exhaustion(&emfile));
        assert!(is_resource_exhaustion(&enfile));
        assert!(!is_resource_exhaustion(&reset));
        assert!(!is_resource_exhaustion(&TransportError::Closed));
    }

    #[test]
    fn receive_budget_default_scales_with_the_frame_limit_and_fits_a_frame() {
        let mut config = Server::builder().config;
        assert_eq!(config.receive_budget(), DEFAULT_RECEIVE_BUDGET);
        config.max_frame_len = 256 << 20;
        assert_eq!(config.receive_budget(), 1 << 30);
        config.receive_budget = Some(1000);
        assert_eq!(config.receive_budget(), 256 << 20, "never below one frame");
    }
}
