//! Message transports: how whole frames move between two processes.
//!
//! A transport is message-oriented: a [`Connection`] sends and receives whole
//! frames as [`Bytes`]. This is what RDMA offers natively (one SEND is one
//! message) and what TCP gets from a length prefix. Received frames may live in
//! the transport's own buffers (a `Bytes` with a custom owner), so a transport
//! can hand payloads up without a copy.
//!
//! Transports are found by the scheme of an [`Endpoint`] in a process-wide
//! registry. `tcp` and `mem` are built in; other crates add theirs with
//! [`register`] (the RDMA transport registers `rdma` with one call at start-up),
//! so that rpc-core knows nothing about them.
//!
//! | role | trait / type |
//! |---|---|
//! | connector: endpoint → connection | [`Transport::connect`] |
//! | listener: a stream of connections | [`Transport::bind`] → [`Listener`] |
//! | connection: a frame sink and a frame stream | [`Connection`] |

mod budget;
mod endpoint;
pub mod memory;
pub mod tcp;
#[cfg(feature = "tls")]
pub mod tls;

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, LazyLock, RwLock};

use bytes::Bytes;
use futures_core::Stream;
use futures_util::Sink;
use futures_util::future::BoxFuture;

use crate::frame::{DEFAULT_MAX_FRAME_LEN, EncodedFrame, FrameError};
use crate::status::BoxError;

pub use budget::{ConnectionBudget, PER_CONNECTION_ALLOWANCE, ReceiveBudget, Reservation};
pub use endpoint::Endpoint;

/// Sends whole frames. `poll_flush` pushes everything fed so far to the peer.
pub type FrameSink = Pin<Box<dyn Sink<EncodedFrame, Error = TransportError> + Send>>;
/// Receives whole frames; ends (`None`) when the peer closed the connection cleanly.
///
/// A stream that keeps polling while it waits (spinning, or yielding and
/// waking itself, as rdma:// does for a few microseconds) must not do so
/// when [`polling_quietly`] says so: then it hands out what is there, or
/// registers the waker and returns `Pending` at once.
pub type FrameStream = Pin<Box<dyn Stream<Item = Result<Bytes, TransportError>> + Send>>;

thread_local! {
    static QUIETLY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `poll` (a poll of a [`FrameStream`]) so that the stream neither
/// spins nor wakes the waker itself while there is nothing to take: how a
/// reader leaves a stream to another task (whose waker it polls with)
/// without waking that task.
pub fn poll_quietly<R>(poll: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            QUIETLY.with(|quietly| quietly.set(self.0));
        }
    }
    let _restore = Restore(QUIETLY.with(|quietly| quietly.replace(true)));
    poll()
}

/// Whether the stream being polled on this thread is polled through
/// [`poll_quietly`] (see [`FrameStream`]).
pub fn polling_quietly() -> bool {
    QUIETLY.with(std::cell::Cell::get)
}

/// One established connection: a frame sink, a frame stream, and who is on the other end.
pub struct Connection {
    /// Outgoing frames.
    pub sink: FrameSink,
    /// Incoming frames.
    pub stream: FrameStream,
    /// The peer, for logs and [`crate::PeerInfo`].
    pub peer: String,
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

/// Settings every transport honours.
#[derive(Debug, Clone)]
pub struct TransportConfig {
    /// Largest frame accepted from the peer; a larger one is a [`FrameError::TooLarge`]
    /// detected before its bytes are buffered where the transport can.
    pub max_frame_len: usize,
    /// Where a listener's connections reserve the bytes of each frame they
    /// receive, before buffering it (see [`ReceiveBudget`]). A server sets it
    /// for [`Transport::bind`]; `None` (clients) means no limit beyond
    /// `max_frame_len`. A transport that cannot reserve before it buffers
    /// should still reserve before it hands a frame up, so that a server's
    /// pending frames stay bounded and its reading stops when the budget is spent.
    pub receive_budget: Option<ReceiveBudget>,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            max_frame_len: DEFAULT_MAX_FRAME_LEN,
            receive_budget: None,
        }
    }
}

/// A stream of accepted connections.
///
/// An `Err` item is one failed accept (e.g. out of file descriptors); the
/// listener stays usable. Dropping it stops listening.
pub trait Listener: Stream<Item = Result<Connection, TransportError>> + Send + Unpin {
    /// Where it listens, with the real port when port 0 was asked for.
    fn local_endpoint(&self) -> Endpoint;
}

/// A way to reach peers: connects to endpoints (the connector role) and binds
/// listeners.
pub trait Transport: Send + Sync + 'static {
    /// Opens a connection to `endpoint`.
    fn connect(
        &self,
        endpoint: &Endpoint,
        config: &TransportConfig,
    ) -> BoxFuture<'static, Result<Connection, TransportError>>;

    /// Starts listening on `endpoint`.
    fn bind(
        &self,
        endpoint: &Endpoint,
        config: &TransportConfig,
    ) -> BoxFuture<'static, Result<Box<dyn Listener>, TransportError>>;

    /// The transport's listening side when it is a front end, one that
    /// brings its calls to the server's routes itself rather than as
    /// rpc-core's frames (gRPC's HTTP/2: see [`crate::server::front_end`]).
    /// A [`crate::Server`] binds through it instead of [`Transport::bind`].
    fn front_end(&self) -> Option<&dyn crate::server::front_end::FrontEnd> {
        None
    }

    /// The transport's connecting side when it is a client front end, one
    /// whose connections take whole calls rather than rpc-core's frames
    /// (gRPC's HTTP/2: see [`crate::client::front_end`]). A
    /// [`crate::Channel`] connects through it instead of
    /// [`Transport::connect`].
    fn call_connector(&self) -> Option<&dyn crate::client::front_end::CallConnector> {
        None
    }
}

/// What can go wrong below the RPC layer. Its `Debug` is its message and
/// causes (see [`crate::Error`]).
#[derive(thiserror::Error)]
pub enum TransportError {
    /// The endpoint string is not `scheme://authority`.
    #[error("invalid endpoint {endpoint:?}: {reason}")]
    InvalidEndpoint {
        /// What was given.
        endpoint: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// No transport is registered for the scheme.
    #[error("no transport for scheme {scheme:?} (registered: {registered}){hint}")]
    UnknownScheme {
        /// The scheme asked for.
        scheme: String,
        /// The schemes that are registered.
        registered: String,
        /// What to do about it.
        hint: &'static str,
    },
    /// An operating-system error.
    #[error("i/o error: {0}")]
    Io(#[from] io::Error),
    /// The peer sent something that is not a valid frame.
    #[error("protocol error: {0}")]
    Frame(#[from] FrameError),
    /// A frame over this side's limit was skipped whole: nothing of it was
    /// kept but its first bytes, and the connection goes on. rpc-core answers
    /// (server) or fails (client) the call it belongs to with
    /// `ResourceExhausted`; a transport yields it and keeps yielding frames.
    #[error("frame of {len} bytes exceeds the limit of {max} bytes (skipped)")]
    Refused {
        /// The frame's first bytes (its header, [`crate::frame::HEADER_LEN`],
        /// when the transport has them), which name the call.
        head: bytes::Bytes,
        /// The frame's length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The connection is closed.
    #[error("connection closed")]
    Closed,
    /// The peer went away without closing the connection (its process
    /// exited, or its end was dropped): the end of the connection, not a
    /// failure of ours. Calls still in flight on it fail `Unavailable`.
    #[error("{0}")]
    PeerGone(String),
    /// The peer refused the connection for want of room (connections, file
    /// descriptors, memory) and said why: a connect that gets it fails
    /// `ResourceExhausted`, not `Unavailable`.
    #[error("the peer has no room for this connection: {0}")]
    ResourceExhausted(String),
    /// A transport-specific error (e.g. from the RDMA provider).
    #[error("{0}")]
    Other(BoxError),
}

impl fmt::Debug for TransportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        crate::error::write_chain(self, f)
    }
}

static REGISTRY: LazyLock<RwLock<BTreeMap<String, Arc<dyn Transport>>>> = LazyLock::new(|| {
    let mut map: BTreeMap<String, Arc<dyn Transport>> = BTreeMap::new();
    map.insert("tcp".into(), Arc::new(tcp::TcpTransport));
    map.insert("mem".into(), Arc::new(memory::MemoryTransport));
    RwLock::new(map)
});

/// Makes `transport` serve endpoints with `scheme`, replacing (and returning)
/// any earlier one. Call it once at start-up.
pub fn register(scheme: &str, transport: Arc<dyn Transport>) -> Option<Arc<dyn Transport>> {
    REGISTRY
        .write()
        .unwrap_or_else(|poison| poison.into_inner())
        .insert(scheme.to_ascii_lowercase(), transport)
}

/// The transport registered for `scheme`.
pub fn lookup(scheme: &str) -> Result<Arc<dyn Transport>, TransportError> {
    let registry = REGISTRY.read().unwrap_or_else(|poison| poison.into_inner());
    registry
        .get(scheme)
        .cloned()
        .ok_or_else(|| TransportError::UnknownScheme {
            scheme: scheme.to_owned(),
            registered: registry.keys().cloned().collect::<Vec<_>>().join(", "),
            hint: match scheme {
                "rdma" => "; call rpc_transport_rdma::register() once at start-up",
                "grpc" => "; call rpc_grpc::register() once at start-up",
                "grpcs" => {
                    "; call rpc_grpc::register_tls(..) once at start-up (rpc-grpc's feature tls)"
                }
                _ => "",
            },
        })
}

/// Connects to `endpoint` with the transport its scheme names. An I/O error
/// names the endpoint (and, where it helps, what to check).
pub async fn connect(
    endpoint: &Endpoint,
    config: &TransportConfig,
) -> Result<Connection, TransportError> {
    connect_with(&*lookup(endpoint.scheme())?, endpoint, config).await
}

/// Connects to `endpoint` with `transport`, whatever the scheme (no registry).
pub async fn connect_with(
    transport: &dyn Transport,
    endpoint: &Endpoint,
    config: &TransportConfig,
) -> Result<Connection, TransportError> {
    transport
        .connect(endpoint, config)
        .await
        .map_err(|error| in_context(error, "cannot connect to", endpoint))
}

/// Binds a listener on `endpoint` with the transport its scheme names. An
/// I/O error names the endpoint (and, where it helps, what to check).
pub async fn bind(
    endpoint: &Endpoint,
    config: &TransportConfig,
) -> Result<Box<dyn Listener>, TransportError> {
    bind_with(&*lookup(endpoint.scheme())?, endpoint, config).await
}

/// Binds a listener on `endpoint` with `transport`, whatever the scheme.
pub async fn bind_with(
    transport: &dyn Transport,
    endpoint: &Endpoint,
    config: &TransportConfig,
) -> Result<Box<dyn Listener>, TransportError> {
    transport
        .bind(endpoint, config)
        .await
        .map_err(|error| in_context(error, "cannot listen on", endpoint))
}

/// An I/O error of a connect or bind, with the endpoint and a hint; its kind
/// stays (callers match on it).
pub(crate) fn in_context(
    error: TransportError,
    doing: &str,
    endpoint: &Endpoint,
) -> TransportError {
    let TransportError::Io(io) = error else {
        return error;
    };
    let over_tcp = match endpoint.scheme() {
        "rdma" => " (rdma:// runs its set-up exchange on this TCP port)",
        _ => "",
    };
    let hint = match io.kind() {
        io::ErrorKind::ConnectionRefused => {
            format!("; is a server listening there{over_tcp}?")
        }
        io::ErrorKind::AddrInUse => format!(
            "; another process (or an earlier run) holds this port{over_tcp}: pick another, or port 0 for any free one"
        ),
        io::ErrorKind::AddrNotAvailable => {
            "; that address is not one of this host's (listen on 0.0.0.0 for all)".to_owned()
        }
        io::ErrorKind::PermissionDenied => "; ports below 1024 need privileges".to_owned(),
        _ => String::new(),
    };
    TransportError::Io(io::Error::new(
        io.kind(),
        format!("{doing} {endpoint}: {io}{hint}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unregistered_scheme_says_which_call_registers_it() {
        for (scheme, call) in [
            ("rdma", "rpc_transport_rdma::register()"),
            ("grpc", "rpc_grpc::register()"),
            ("grpcs", "rpc_grpc::register_tls("),
        ] {
            let error = lookup(scheme)
                .err()
                .expect("not registered in rpc-core's tests");
            let text = error.to_string();
            assert!(text.contains(call), "{scheme}: {text}");
            assert!(text.contains("registered: "), "{scheme}: {text}");
        }
        let other = lookup("carrier-pigeon").err().unwrap().to_string();
        assert!(!other.contains("; call"), "{other}");
    }

    /// A port where nothing listens (bound, then released).
    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .map(|addr| addr.port())
            .expect("a free port")
    }

    #[tokio::test]
    async fn a_refused_connect_names_the_endpoint_and_what_to_check() {
        let endpoint: Endpoint = format!("tcp://127.0.0.1:{}", free_port()).parse().unwrap();
        let error = connect(&endpoint, &TransportConfig::default())
            .await
            .expect_err("nothing listens");
        let TransportError::Io(io) = &error else {
            panic!("{error}")
        };
        assert_eq!(io.kind(), io::ErrorKind::ConnectionRefused);
        let message = error.to_string();
        assert!(
            message.contains(&format!("cannot connect to {endpoint}"))
                && message.contains("is a server listening there?"),
            "{message}"
        );
    }

    #[tokio::test]
    async fn binding_a_port_in_use_names_the_endpoint_and_what_to_do() {
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint: Endpoint = format!("tcp://{}", held.local_addr().unwrap())
            .parse()
            .unwrap();
        let error = bind(&endpoint, &TransportConfig::default())
            .await
            .err()
            .expect("the port is held");
        let message = error.to_string();
        assert!(
            message.contains(&format!("cannot listen on {endpoint}"))
                && message.contains("holds this port")
                && message.contains("port 0"),
            "{message}"
        );
    }
}
