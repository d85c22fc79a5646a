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
//! Each connection runs a task that reads frames and spawns a task per call.
//! A call runs the layered service under the client's deadline
//! ([`Code::DeadlineExceeded`](crate::Code) when it passes) with panics caught
//! ([`Code::Internal`](crate::Code) for that call only); a cancel frame aborts
//! its task. A connection that sends a malformed frame is closed; the server
//! and its other connections carry on.

mod connection;
mod routes;
pub mod unary;

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::util::BoxCloneSyncService;
use tower_layer::{Identity, Layer, Stack};
use tower_service::Service;

use crate::error::Error;
use crate::frame::DEFAULT_MAX_FRAME_LEN;
use crate::request::{Request, Response};
use crate::status::{BoxError, Status};
use crate::transport::{self, Endpoint, Listener, TransportConfig};

pub use routes::{NamedService, RoutableService, Routes};

/// Default per-connection limit on concurrent calls.
pub const DEFAULT_MAX_CONCURRENT_CALLS_PER_CONNECTION: usize = 4096;

/// Pause after a failed accept (e.g. out of file descriptors) before the next one.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(20);

#[derive(Debug, Clone)]
pub(crate) struct ServerConfig {
    pub(crate) max_concurrent_calls_per_connection: usize,
    pub(crate) max_frame_len: usize,
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
    L::Service: Service<Request<Bytes>, Response = Response<Bytes>> + Clone + Send + Sync + 'static,
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
        let transport_config = TransportConfig {
            max_frame_len: self.server.config.max_frame_len,
            receive_budget: None,
        };
        let listener = transport::bind(&endpoint, &transport_config).await?;
        let service = self.server.layer.layer(self.routes);
        let service = tower::ServiceExt::map_err(
            service,
            |error: <L::Service as Service<Request<Bytes>>>::Error| {
                Status::from_error(error.into())
            },
        );
        Ok(Listening {
            listener,
            service: BoxCloneSyncService::new(service),
            config: self.server.config,
        })
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
    /// calls finish, and returns.
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
    listener: Box<dyn Listener>,
    service: connection::ServerService,
    config: ServerConfig,
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

    /// Serves until the process ends.
    pub async fn serve(self) -> Result<(), Error> {
        self.serve_with_shutdown(std::future::pending()).await
    }

    /// Serves until `signal` completes, then shuts down gracefully.
    pub async fn serve_with_shutdown<F>(self, signal: F) -> Result<(), Error>
    where
        F: Future<Output = ()> + Send,
    {
        let Listening {
            mut listener,
            service,
            config,
        } = self;
        let endpoint = listener.local_endpoint();
        tracing::info!(%endpoint, "serving");
        let connections = TaskTracker::new();
        let shutdown = CancellationToken::new();
        let mut signal = std::pin::pin!(signal);
        loop {
            tokio::select! {
                () = &mut signal => break,
                accepted = listener.next() => match accepted {
                    Some(Ok(connection)) => {
                        tracing::debug!(peer = %connection.peer, "accepted connection");
                        connections.spawn(connection::serve_connection(
                            connection,
                            service.clone(),
                            config.clone(),
                            shutdown.child_token(),
                        ));
                    }
                    Some(Err(error)) => {
                        tracing::warn!(%endpoint, %error, "accept failed");
                        tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                    }
                    None => break,
                },
            }
        }
        drop(listener);
        tracing::info!(%endpoint, in_flight_connections = connections.len(), "shutting down");
        shutdown.cancel();
        connections.close();
        connections.wait().await;
        Ok(())
    }
}
