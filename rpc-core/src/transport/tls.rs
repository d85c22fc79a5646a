//! `tls://host:port`: tcp:// framing (the same length prefix and limits)
//! inside TLS 1.2 or 1.3, with [`rustls`] (feature `tls`).
//!
//! A [`TlsTransport`] carries a rustls server configuration (certificate
//! chain and key; optionally a client-certificate verifier for mutual TLS),
//! a client configuration (the roots to trust; optionally a client
//! certificate), or both; register it under `tls` and every `Channel` and
//! `Server` takes `tls://` endpoints:
//!
//! ```no_run
//! # fn demo(server: rpc_core::transport::tls::rustls::ServerConfig,
//! #         client: rpc_core::transport::tls::rustls::ClientConfig) {
//! use std::sync::Arc;
//! use rpc_core::transport::tls::TlsTransport;
//! rpc_core::transport::register(
//!     "tls",
//!     Arc::new(TlsTransport::new().with_server(server).with_client(client)),
//! );
//! # }
//! ```
//!
//! The client checks the server's certificate against the host of the
//! endpoint (a DNS name or an IP address). A handshake that fails (unknown
//! issuer, expired or wrong-name certificate, missing client certificate)
//! fails the connect with rustls' reason; on the server it only drops that
//! connection. Handshakes run beside the accept loop, at most
//! [`MAX_PENDING_HANDSHAKES`] at once, each bounded by the handshake
//! time-out, so a peer that never finishes one holds nothing for long.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_core::Stream;
use futures_util::FutureExt;
use futures_util::future::BoxFuture;
pub use rustls;
use rustls::pki_types::ServerName;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
pub use tokio_rustls;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use super::tcp::framed_connection;
use super::{
    Connection, Endpoint, Listener, ReceiveBudget, Transport, TransportConfig, TransportError,
};

/// Handshakes a listener runs at once; beyond, it accepts no more until one ends.
pub const MAX_PENDING_HANDSHAKES: usize = 256;
/// Default bound on one handshake.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The `tls://` transport (see the module docs).
#[derive(Clone)]
pub struct TlsTransport {
    server: Option<Arc<rustls::ServerConfig>>,
    client: Option<Arc<rustls::ClientConfig>>,
    handshake_timeout: Duration,
}

impl std::fmt::Debug for TlsTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsTransport")
            .field("server", &self.server.is_some())
            .field("client", &self.client.is_some())
            .field("handshake_timeout", &self.handshake_timeout)
            .finish()
    }
}

impl Default for TlsTransport {
    fn default() -> Self {
        TlsTransport::new()
    }
}

impl TlsTransport {
    /// A transport that can neither connect nor listen until configured.
    pub fn new() -> TlsTransport {
        TlsTransport {
            server: None,
            client: None,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
        }
    }

    /// Listens with `config` (its certificate; a client verifier for mutual TLS).
    pub fn with_server(mut self, config: rustls::ServerConfig) -> TlsTransport {
        self.server = Some(Arc::new(config));
        self
    }

    /// Connects with `config` (the roots it trusts; its own certificate for
    /// mutual TLS).
    pub fn with_client(mut self, config: rustls::ClientConfig) -> TlsTransport {
        self.client = Some(Arc::new(config));
        self
    }

    /// Bounds each handshake (default [`DEFAULT_HANDSHAKE_TIMEOUT`]).
    pub fn handshake_timeout(mut self, timeout: Duration) -> TlsTransport {
        self.handshake_timeout = timeout;
        self
    }
}

fn not_configured(scheme: &str, role: &str, with: &str) -> TransportError {
    TransportError::Other(
        format!(
            "{scheme}:// cannot {role}: its TlsTransport has no {with} configuration (TlsTransport::with_{with})"
        )
        .into(),
    )
}

fn handshake_failed(what: &str, error: io::Error) -> TransportError {
    // A peer that answers with something other than TLS (a plaintext
    // server's first bytes) reads as a corrupt record.
    let hint = if error.kind() == io::ErrorKind::InvalidData
        && error.to_string().contains("corrupt message")
    {
        " (the peer did not answer in TLS: is it a plaintext tcp:// or rdma:// server?)"
    } else {
        ""
    };
    TransportError::Io(io::Error::new(
        error.kind(),
        format!("TLS handshake {what} failed: {error}{hint}"),
    ))
}

impl TlsTransport {
    /// Runs the client side of a handshake on `tcp`, connected to `endpoint`,
    /// checking the server's certificate against the endpoint's host; bounded
    /// by the handshake time-out. Other transports that run their set-up over
    /// TCP (`rdma+tls://`) protect it with this.
    pub async fn client_handshake(
        &self,
        tcp: TcpStream,
        endpoint: &Endpoint,
    ) -> Result<tokio_rustls::client::TlsStream<TcpStream>, TransportError> {
        let scheme = endpoint.scheme();
        let client = self
            .client
            .clone()
            .ok_or_else(|| not_configured(scheme, "connect", "client"))?;
        let name = ServerName::try_from(endpoint.host().to_owned()).map_err(|_| {
            TransportError::InvalidEndpoint {
                endpoint: endpoint.to_string(),
                reason: "the host is neither a DNS name nor an IP address a certificate can name",
            }
        })?;
        let handshake = TlsConnector::from(client).connect(name, tcp);
        self.bounded(handshake, &format!("with {endpoint}"), "no answer")
            .await
    }

    /// Runs the server side of a handshake on an accepted `tcp` (from
    /// `peer`), bounded by the handshake time-out. `scheme` names the
    /// transport in the error when no server configuration is set.
    pub async fn server_handshake(
        &self,
        tcp: TcpStream,
        scheme: &str,
    ) -> Result<tokio_rustls::server::TlsStream<TcpStream>, TransportError> {
        let server = self
            .server
            .clone()
            .ok_or_else(|| not_configured(scheme, "listen", "server"))?;
        let peer = tcp
            .peer_addr()
            .map_or_else(|_| "a peer".to_owned(), |peer| peer.to_string());
        let handshake = TlsAcceptor::from(server).accept(tcp);
        self.bounded(handshake, &format!("from {peer}"), "no ClientHello")
            .await
    }

    /// A handshake with `what` (`with host:port`, `from peer`), bounded by
    /// the handshake time-out; `silence` says what did not come in time.
    async fn bounded<S>(
        &self,
        handshake: impl std::future::Future<Output = io::Result<S>>,
        what: &str,
        silence: &str,
    ) -> Result<S, TransportError> {
        let timeout = self.handshake_timeout;
        match tokio::time::timeout(timeout, handshake).await {
            Ok(Ok(stream)) => Ok(stream),
            Ok(Err(error)) => Err(handshake_failed(what, error)),
            Err(_) => Err(handshake_failed(
                what,
                io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{silence} within {timeout:?}"),
                ),
            )),
        }
    }

    /// Whether it can listen (has a server configuration).
    pub fn has_server(&self) -> bool {
        self.server.is_some()
    }

    /// Whether it can connect (has a client configuration).
    pub fn has_client(&self) -> bool {
        self.client.is_some()
    }
}

fn into_connection<S>(
    stream: S,
    peer: String,
    max_frame_len: usize,
    budget: Option<&ReceiveBudget>,
) -> Connection
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    let (read, write) = tokio::io::split(stream);
    framed_connection(read, write, peer, max_frame_len, budget)
}

impl Transport for TlsTransport {
    fn connect(
        &self,
        endpoint: &Endpoint,
        config: &TransportConfig,
    ) -> BoxFuture<'static, Result<Connection, TransportError>> {
        let endpoint = endpoint.clone();
        let max_frame_len = config.max_frame_len;
        let tls = self.clone();
        async move {
            if !tls.has_client() {
                return Err(not_configured(endpoint.scheme(), "connect", "client"));
            }
            let tcp = TcpStream::connect(endpoint.authority()).await?;
            tcp.set_nodelay(true)?;
            let peer = tcp.peer_addr()?.to_string();
            let stream = tls.client_handshake(tcp, &endpoint).await?;
            Ok(into_connection(stream, peer, max_frame_len, None))
        }
        .boxed()
    }

    fn bind(
        &self,
        endpoint: &Endpoint,
        config: &TransportConfig,
    ) -> BoxFuture<'static, Result<Box<dyn Listener>, TransportError>> {
        let authority = endpoint.authority().to_owned();
        let max_frame_len = config.max_frame_len;
        let budget = config.receive_budget.clone();
        let scheme = endpoint.scheme().to_owned();
        let tls = self.clone();
        async move {
            if !tls.has_server() {
                return Err(not_configured(&scheme, "listen", "server"));
            }
            let listener = TcpListener::bind(&authority).await?;
            let local = Endpoint::new(&scheme, &listener.local_addr()?.to_string())?;
            let (accepted, incoming) = mpsc::channel(64);
            tokio::spawn(accept_loop(
                listener,
                tls,
                local.scheme().to_owned(),
                max_frame_len,
                budget,
                accepted,
            ));
            Ok(Box::new(TlsListener { local, incoming }) as Box<dyn Listener>)
        }
        .boxed()
    }
}

/// Accepts TCP connections and runs their handshakes beside each other;
/// ends when the listener is dropped.
async fn accept_loop(
    listener: TcpListener,
    tls: TlsTransport,
    scheme: String,
    max_frame_len: usize,
    budget: Option<ReceiveBudget>,
    accepted: mpsc::Sender<Result<Connection, TransportError>>,
) {
    let pending = Arc::new(Semaphore::new(MAX_PENDING_HANDSHAKES));
    loop {
        let permit = tokio::select! {
            () = accepted.closed() => return,
            permit = pending.clone().acquire_owned() => permit,
        };
        let Ok(permit) = permit else { return };
        let (tcp, peer) = tokio::select! {
            () = accepted.closed() => return,
            result = listener.accept() => match result {
                Ok(socket) => socket,
                Err(error) => {
                    if accepted.send(Err(error.into())).await.is_err() {
                        return;
                    }
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let tls = tls.clone();
        let scheme = scheme.clone();
        let budget = budget.clone();
        let accepted = accepted.clone();
        tokio::spawn(async move {
            let _permit = permit;
            match tls.server_handshake(tcp, &scheme).await {
                Ok(stream) => {
                    let connection =
                        into_connection(stream, peer.to_string(), max_frame_len, budget.as_ref());
                    let _ = accepted.send(Ok(connection)).await;
                }
                Err(error) => tracing::debug!(%peer, %error, "TLS handshake failed"),
            }
        });
    }
}

struct TlsListener {
    local: Endpoint,
    incoming: mpsc::Receiver<Result<Connection, TransportError>>,
}

impl Stream for TlsListener {
    type Item = Result<Connection, TransportError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().incoming.poll_recv(cx)
    }
}

impl Listener for TlsListener {
    fn local_endpoint(&self) -> Endpoint {
        self.local.clone()
    }
}
