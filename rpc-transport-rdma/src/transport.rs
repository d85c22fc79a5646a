//! `rdma://host:port`: rpc-core's message transport over RDMA.
//!
//! Connecting opens a TCP connection to `host:port` for the set-up exchange
//! ([`crate::setup`]), whose hello carries this transport's part: the protocol
//! version, the receive-pool [`Geometry`] and, for the soft provider, the
//! host's boot id (soft only reaches processes on the same host). Then the
//! connection (the crate's private `link` module) is turned by the tasks that use its frame sink
//! and frame stream, like any rpc-core transport, with a housekeeper for its
//! timers and its end.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_core::Stream;
use futures_util::future::BoxFuture;
use rpc_core::transport::{
    Connection, Endpoint, Listener, Transport, TransportConfig, TransportError,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::admission::Slots;
use crate::config::RdmaConfig;
use crate::device::{self, Device};
use crate::link::{Commitment, Endpoint as QpEndpoint};
use crate::protocol::{GEOMETRY_LEN, Geometry, MAX_FRAME_LEN, PROTOCOL_VERSION, Protocol};
use crate::setup::{self, Hello, SetupError};
use crate::setup_socket::SetupSocket;
use crate::verbs::{
    AsyncCompletionChannel, CmConnection, CmListener, ConnectOptions, MAX_BINDS_IN_FLIGHT,
    QueuePair, VerbsError,
    pooled::{PooledQp, PooledQpConfig},
};
#[cfg(feature = "tls")]
use rpc_core::transport::tls::TlsTransport;

/// How long the set-up exchange may take before the attempt is abandoned
/// (an accepted one: from the connection, hello included).
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(10);
pub use crate::admission::{
    DESCRIPTOR_RESERVE, HELLO_TIMEOUT, MAX_PENDING_HELLOS, MAX_PENDING_HELLOS_PER_SOURCE,
    MAX_PENDING_SETUPS, MAX_PENDING_SETUPS_PER_SOURCE,
};

/// The RDMA transport; register it with [`crate::register`].
#[derive(Debug, Clone)]
pub struct RdmaTransport {
    config: Arc<RdmaConfig>,
    /// TLS around the set-up exchange (`rdma+tls://`).
    #[cfg(feature = "tls")]
    tls: Option<TlsTransport>,
}

impl RdmaTransport {
    /// A transport with `config` (validated).
    pub fn new(config: RdmaConfig) -> Result<RdmaTransport, crate::ConfigError> {
        config.validate()?;
        // Large messages are encoded into recycled buffers that peers READ:
        // huge pages make those READs about twice as fast on the soft provider.
        rpc_core::codec::recycle::prepare_new_buffers_with(crate::verbs::advise_huge_pages);
        Ok(RdmaTransport {
            config: Arc::new(config),
            #[cfg(feature = "tls")]
            tls: None,
        })
    }

    /// Runs every set-up exchange of this transport inside TLS (feature
    /// `tls`): the server proves its certificate before any hello is sent,
    /// the client too when `tls` verifies clients (mutual TLS), and nothing a
    /// network attacker rewrites in the hellos (queue pair addresses, pool
    /// geometry, the rdma_cm port and token, the soft provider's QP secret)
    /// is accepted. RDMA traffic itself is not encrypted (see
    /// `docs/security.md`). Register it under its own scheme,
    /// conventionally `rdma+tls`, so plain and TLS endpoints never mix:
    ///
    /// ```no_run
    /// # fn demo(tls: rpc_core::transport::tls::TlsTransport) -> Result<(), Box<dyn std::error::Error>> {
    /// use std::sync::Arc;
    /// use rpc_transport_rdma::{RdmaConfig, RdmaTransport};
    /// let transport = RdmaTransport::new(RdmaConfig::from_env()?)?.with_tls(tls);
    /// rpc_core::transport::register("rdma+tls", Arc::new(transport));
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "tls")]
    pub fn with_tls(mut self, tls: TlsTransport) -> RdmaTransport {
        self.tls = Some(tls);
        self
    }

    /// The client side of the set-up connection: TLS when configured.
    async fn open_setup(
        &self,
        socket: TcpStream,
        endpoint: &Endpoint,
    ) -> Result<SetupSocket, TransportError> {
        #[cfg(feature = "tls")]
        if let Some(tls) = &self.tls {
            let stream = tls.client_handshake(socket, endpoint).await?;
            return Ok(SetupSocket::Tls(Box::new(stream.into())));
        }
        let _ = endpoint;
        Ok(SetupSocket::Plain(socket))
    }

    /// The server side of an accepted set-up connection: TLS when configured.
    async fn accept_setup(
        &self,
        socket: TcpStream,
        scheme: &str,
    ) -> Result<SetupSocket, TransportError> {
        #[cfg(feature = "tls")]
        if let Some(tls) = &self.tls {
            let stream = tls.server_handshake(socket, scheme).await?;
            return Ok(SetupSocket::Tls(Box::new(stream.into())));
        }
        let _ = scheme;
        Ok(SetupSocket::Plain(socket))
    }
}

/// Logs, at WARN and at most once every 5 s (a peer may dial in a loop),
/// that a gRPC client reached this rdma:// port.
fn warn_http2_client(peer: &impl std::fmt::Display) {
    static LAST: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);
    let mut last = LAST.lock().unwrap_or_else(|poison| poison.into_inner());
    let now = std::time::Instant::now();
    if last.is_none_or(|at| now.duration_since(at) >= Duration::from_secs(5)) {
        *last = Some(now);
        tracing::warn!(%peer, "{}", setup::HTTP2_AT_RDMA);
    }
}

fn other(error: impl std::error::Error + Send + Sync + 'static) -> TransportError {
    TransportError::Other(Box::new(error))
}

impl Transport for RdmaTransport {
    fn connect(
        &self,
        endpoint: &Endpoint,
        config: &TransportConfig,
    ) -> BoxFuture<'static, Result<Connection, TransportError>> {
        let transport = self.clone();
        let rdma = self.config.clone();
        let endpoint = endpoint.clone();
        let authority = endpoint.authority().to_owned();
        let max_frame_len = config.max_frame_len;
        Box::pin(async move {
            let device = device::open(&rdma).map_err(other)?;
            let attempt = async {
                let socket = TcpStream::connect(&authority).await?;
                socket.set_nodelay(true)?;
                let peer_ip = socket.peer_addr()?.ip();
                let socket = transport.open_setup(socket, &endpoint).await?;
                establish(
                    socket,
                    None,
                    peer_ip,
                    &device,
                    &rdma,
                    max_frame_len,
                    // Labelled with the scheme it was dialled under
                    // (`rdma+tls://…` says the set-up went through TLS).
                    format!("{}://{authority}", endpoint.scheme()),
                    Role::Connect,
                )
                .await
            };
            tokio::time::timeout(SETUP_TIMEOUT, attempt)
                .await
                .map_err(|_| {
                    TransportError::Io(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("RDMA set-up with {authority} timed out"),
                    ))
                })?
        })
    }

    fn bind(
        &self,
        endpoint: &Endpoint,
        config: &TransportConfig,
    ) -> BoxFuture<'static, Result<Box<dyn Listener>, TransportError>> {
        let transport = self.clone();
        let rdma = self.config.clone();
        let authority = endpoint.authority().to_owned();
        // The scheme it was registered under (`rdma`, or a test's own).
        let scheme = endpoint.scheme().to_owned();
        let max_frame_len = config.max_frame_len;
        let receive_budget = config.receive_budget.clone();
        Box::pin(async move {
            #[cfg(feature = "tls")]
            if transport.tls.as_ref().is_some_and(|tls| !tls.has_server()) {
                return Err(TransportError::Other(
                    format!("{scheme}:// cannot listen: its TlsTransport has no server configuration (TlsTransport::with_server)").into(),
                ));
            }
            // Open the device now: a missing device fails the bind, not each accept.
            let device = device::open(&rdma).map_err(other)?;
            let listener = TcpListener::bind(&authority).await?;
            let local: Endpoint = format!("{scheme}://{}", listener.local_addr()?)
                .parse()
                .map_err(|_| TransportError::InvalidEndpoint {
                    endpoint: authority.clone(),
                    reason: "not host:port",
                })?;
            // rdma_cm listens beside TCP (on its own port, announced in the
            // hello) for peers whose device connects only through it (iWARP).
            let cm = match device.context.connection_manager() {
                Some(manager) => {
                    let addr = SocketAddr::new(listener.local_addr()?.ip(), rdma.cm_port);
                    let any_port = rdma.cm_port == 0;
                    // On iWARP the port rdma_cm picks must also be free in the
                    // kernel's TCP port space, where an ephemeral port of an
                    // unrelated connection may already hold it (EADDRINUSE):
                    // another pick then succeeds (a fixed port is not retried).
                    let listen = move || {
                        let mut attempt = 1;
                        loop {
                            match manager.listen(addr) {
                                Err(VerbsError::Io(error))
                                    if error.kind() == std::io::ErrorKind::AddrInUse
                                        && any_port
                                        && attempt < CM_LISTEN_ATTEMPTS =>
                                {
                                    attempt += 1;
                                }
                                result => return result,
                            }
                        }
                    };
                    match tokio::task::spawn_blocking(listen).await {
                        Ok(Ok(cm)) => Some(cm),
                        Ok(Err(error)) if device.context.requires_connection_manager() => {
                            return Err(other(error));
                        }
                        Ok(Err(error)) => {
                            tracing::debug!(%error, "no rdma_cm listener; direct connections only");
                            None
                        }
                        Err(error) => return Err(other(error)),
                    }
                }
                None => None,
            };
            let (accepted, incoming) = mpsc::channel(16);
            let accept_loop = tokio::spawn(accept_loop(
                transport,
                scheme,
                listener,
                cm,
                device,
                rdma,
                max_frame_len,
                receive_budget,
                accepted,
            ));
            Ok(Box::new(RdmaListener {
                incoming,
                local,
                accept_loop,
            }) as Box<dyn Listener>)
        })
    }
}

#[allow(clippy::too_many_arguments)]
async fn accept_loop(
    transport: RdmaTransport,
    scheme: String,
    listener: TcpListener,
    cm: Option<Arc<dyn CmListener>>,
    device: Arc<Device>,
    config: Arc<RdmaConfig>,
    max_frame_len: usize,
    receive_budget: Option<rpc_core::transport::ReceiveBudget>,
    accepted: mpsc::Sender<Result<Connection, TransportError>>,
) {
    let hellos = Slots::hellos();
    let setups = Slots::setups();
    let mut refused: u64 = 0;
    let mut last_refusal_log: Option<std::time::Instant> = None;
    loop {
        let (socket, peer) = tokio::select! {
            result = listener.accept() => match result {
                Ok(pair) => pair,
                Err(error) => {
                    if accepted.send(Err(error.into())).await.is_err() {
                        return;
                    }
                    continue;
                }
            },
            () = accepted.closed() => return,
        };
        let Some(hello_slot) = hellos.try_take(peer.ip()) else {
            // Too many connections wait to say hello (in all, or from this
            // address): refuse this one now (dropping the socket closes it).
            refused += 1;
            if last_refusal_log.is_none_or(|at| at.elapsed() >= Duration::from_secs(5)) {
                tracing::warn!(
                    %peer,
                    refused,
                    limit = MAX_PENDING_HELLOS,
                    per_source = MAX_PENDING_HELLOS_PER_SOURCE,
                    "rdma connections waiting for a hello at their limit: refusing new ones"
                );
                last_refusal_log = Some(std::time::Instant::now());
                refused = 0;
            }
            continue;
        };
        let device = device.clone();
        let config = config.clone();
        let accepted = accepted.clone();
        let cm = cm.clone();
        let transport = transport.clone();
        let scheme = scheme.clone();
        let budget = receive_budget
            .as_ref()
            .map(rpc_core::transport::ReceiveBudget::connection);
        let setups = setups.clone();
        tokio::spawn(async move {
            let _ = socket.set_nodelay(true);
            let role = Role::Accept {
                cm: cm.clone(),
                token: new_token(),
                budget,
            };
            let deadline = tokio::time::Instant::now() + SETUP_TIMEOUT;
            let attempt = async {
                // The peer's hello first, before anything is built for it.
                let said_hello = async {
                    let mut socket = transport.accept_setup(socket, &scheme).await?;
                    match setup::read_hello(&mut socket, setup::HelloFrom::Dialer).await {
                        Ok(hello) => Ok::<_, TransportError>((socket, hello)),
                        Err(SetupError::Http2Client) => {
                            warn_http2_client(&peer);
                            setup::answer_http2_client(&mut socket).await;
                            Err(other(SetupError::Http2Client))
                        }
                        Err(error) => {
                            if !matches!(error, SetupError::Io(_)) {
                                setup::refuse_non_hello(&mut socket, Duration::from_millis(100))
                                    .await;
                            }
                            Err(other(error))
                        }
                    }
                };
                let (socket, hello) = tokio::time::timeout(HELLO_TIMEOUT, said_hello)
                    .await
                    .map_err(|_| {
                        TransportError::Io(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!("{peer} sent no hello within {HELLO_TIMEOUT:?}"),
                        ))
                    })??;
                let Some(_setup_slot) = setups.take(peer.ip(), deadline).await else {
                    return Err(TransportError::Io(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!(
                            "no set-up slot for {peer} in time ({MAX_PENDING_SETUPS} in all, {MAX_PENDING_SETUPS_PER_SOURCE} per address)"
                        ),
                    )));
                };
                drop(hello_slot);
                // Room for this connection's descriptors, or a refusal the
                // client reads (before, it got as far as its QP and failed
                // there: `WrFlushErr`).
                let per = crate::admission::descriptors_per_connection(device.provider);
                let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
                if let Err(reason) = crate::admission::descriptors_allow(
                    crate::link::live_links(),
                    setups.taken_in_all(),
                    per,
                    limit,
                ) {
                    let mut socket = socket;
                    setup::refuse(&mut socket, &reason, Duration::from_millis(100)).await;
                    return Err(TransportError::Io(std::io::Error::other(reason)));
                }
                establish(
                    socket,
                    Some(hello),
                    peer.ip(),
                    &device,
                    &config,
                    max_frame_len,
                    format!("{scheme}://{peer}"),
                    role,
                )
                .await
            };
            let result = match tokio::time::timeout_at(deadline, attempt).await {
                Ok(result) => result,
                Err(_) => Err(TransportError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("RDMA set-up with {peer} timed out"),
                ))),
            };
            // A failed set-up concerns that peer only: it is logged, not
            // reported as a failed accept (which would pause the server).
            match result {
                Ok(connection) => {
                    let _ = accepted.send(Ok(connection)).await;
                }
                Err(error) => tracing::debug!(%peer, %error, "rdma set-up failed"),
            }
        });
    }
}

/// Accepted RDMA connections.
struct RdmaListener {
    incoming: mpsc::Receiver<Result<Connection, TransportError>>,
    local: Endpoint,
    accept_loop: tokio::task::JoinHandle<()>,
}

impl Drop for RdmaListener {
    fn drop(&mut self) {
        self.accept_loop.abort();
    }
}

impl Stream for RdmaListener {
    type Item = Result<Connection, TransportError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.incoming.poll_recv(cx)
    }
}

impl Listener for RdmaListener {
    fn local_endpoint(&self) -> Endpoint {
        self.local.clone()
    }
}

/// Longest host identity in a hello (a boot id is 36 bytes).
const MAX_HOST_LEN: usize = 64;
/// Bytes of [`TransportHello`] before the host: version, geometry, rdma_cm
/// flag, port and token, host length.
const TRANSPORT_HELLO_FIXED: usize = 1 + GEOMETRY_LEN + 1 + 2 + 8 + 1;

const _: () = assert!(MAX_HOST_LEN <= u8::MAX as usize, "host_len is a u8");
const _: () = assert!(
    TRANSPORT_HELLO_FIXED + MAX_HOST_LEN <= setup::MAX_HELLO_LEN,
    "the longest transport hello fits a set-up hello"
);
const _: () = assert!(
    rpc_core::frame::DEFAULT_MAX_FRAME_LEN as u64 <= MAX_FRAME_LEN,
    "the default frame limit is one a peer accepts in a hello"
);

/// Whether `host` may be a host identity: up to [`MAX_HOST_LEN`] bytes of
/// `A-Z a-z 0-9 - . _ :` (a boot id is lower-case hex and dashes; empty when
/// the kernel did not say).
fn valid_host(host: &[u8]) -> bool {
    host.len() <= MAX_HOST_LEN
        && host
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b':'))
}

/// What this transport adds to the set-up hello.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TransportHello {
    geometry: Geometry,
    /// The host (kernel boot id): soft only connects processes of one host.
    host: String,
    /// This side's device connects only through rdma_cm (iWARP).
    requires_cm: bool,
    /// The accepting side's rdma_cm port (0: none).
    cm_port: u16,
    /// The accepting side's token for this connection's rdma_cm request.
    cm_token: u64,
}

impl TransportHello {
    fn encode(&self) -> Vec<u8> {
        let mut payload = vec![PROTOCOL_VERSION];
        payload.extend_from_slice(&self.geometry.encode());
        payload.push(u8::from(self.requires_cm));
        payload.extend_from_slice(&self.cm_port.to_le_bytes());
        payload.extend_from_slice(&self.cm_token.to_le_bytes());
        payload.push(self.host.len() as u8);
        payload.extend_from_slice(self.host.as_bytes());
        payload
    }

    fn decode(payload: &[u8]) -> Result<TransportHello, SetupError> {
        let bad = |what: &str| SetupError::Protocol(what.to_owned());
        let version = *payload.first().ok_or_else(|| bad("empty RDMA hello"))?;
        if version != PROTOCOL_VERSION {
            return Err(SetupError::Protocol(format!(
                "peer speaks RDMA protocol version {version}, this build speaks {PROTOCOL_VERSION}: upgrade the older side"
            )));
        }
        const FIXED: usize = TRANSPORT_HELLO_FIXED;
        if payload.len() < FIXED {
            return Err(bad("RDMA hello truncated"));
        }
        let geometry = Geometry::decode(&payload[1..1 + GEOMETRY_LEN])
            .map_err(|error| SetupError::Protocol(format!("peer's pools: {error}")))?;
        let at = 1 + GEOMETRY_LEN;
        let requires_cm = match payload[at] {
            0 => false,
            1 => true,
            _ => return Err(bad("RDMA hello: bad rdma_cm flag")),
        };
        let cm_port = u16::from_le_bytes(payload[at + 1..at + 3].try_into().expect("2"));
        let cm_token = u64::from_le_bytes(payload[at + 3..at + 11].try_into().expect("8"));
        let host_len = payload[at + 11] as usize;
        if host_len > MAX_HOST_LEN {
            return Err(SetupError::Protocol(format!(
                "RDMA hello: host_len = {host_len} is outside 0..={MAX_HOST_LEN}"
            )));
        }
        let host = payload
            .get(FIXED..FIXED + host_len)
            .ok_or_else(|| bad("RDMA hello truncated"))?;
        if payload.len() != FIXED + host_len {
            return Err(bad("trailing bytes in RDMA hello"));
        }
        if !valid_host(host) {
            return Err(SetupError::Protocol(format!(
                "RDMA hello: host = {:?} is not a host identity (up to {MAX_HOST_LEN} bytes of A-Z a-z 0-9 - . _ :)",
                String::from_utf8_lossy(host)
            )));
        }
        Ok(TransportHello {
            geometry,
            host: String::from_utf8(host.to_vec()).expect("checked ASCII"),
            requires_cm,
            cm_port,
            cm_token,
        })
    }
}

/// This host's identity as the soft provider sees it: the kernel's boot id.
fn host_identity() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|id| id.trim().to_owned())
        .unwrap_or_default()
}

/// Checks the peer's hello against ours, before the QP is connected.
fn check_peer(hello: &Hello, provider: &str, host: &str) -> Result<TransportHello, SetupError> {
    let peer = TransportHello::decode(&hello.payload)?;
    if provider == "soft" && peer.host != host {
        return Err(SetupError::Protocol(
            "the soft RDMA provider connects processes of one host only, and the peer runs on \
             another host: use RDMA_PROVIDER=ibverbs with an RDMA device on both hosts, or a \
             tcp:// endpoint"
                .into(),
        ));
    }
    Ok(peer)
}

/// Fuzzing entry point (not API): decodes `payload` as the transport's part
/// of a peer's hello and, when it is accepted, checks that it re-encodes to
/// the same bytes and that [`check_peer`] agrees with the decoder.
#[cfg(any(test, fuzzing))]
pub fn fuzz_decode_transport_hello(payload: &[u8]) -> Result<(), SetupError> {
    let decoded = TransportHello::decode(payload);
    let hello = Hello {
        provider: "ibverbs".into(),
        address: crate::verbs::QpAddress {
            qp_num: 1,
            psn: 0,
            lid: 0,
            gid: [0; 16],
            mtu: 4096,
            extra: Vec::new(),
        },
        payload: payload.to_vec(),
    };
    assert_eq!(check_peer(&hello, "ibverbs", "").is_ok(), decoded.is_ok());
    let decoded = decoded?;
    decoded
        .geometry
        .validate()
        .expect("a decoded geometry is valid");
    assert_eq!(
        decoded.encode(),
        payload,
        "an accepted hello re-encodes byte for byte"
    );
    Ok(())
}

/// A token no other pending connection of this process has.
fn new_token() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.write_u32(std::process::id());
    hasher.finish() | 1
}

/// Which side of the set-up exchange this is.
enum Role {
    /// We dialled the TCP connection.
    Connect,
    /// We accepted it; `cm` is the listener's rdma_cm endpoint, if the device
    /// has one, and `token` names this connection's request to it.
    Accept {
        cm: Option<Arc<dyn CmListener>>,
        token: u64,
        /// This connection's share of the server's receive budget.
        budget: Option<rpc_core::transport::ConnectionBudget>,
    },
}

/// Picks of an rdma_cm listening port before giving up on EADDRINUSE.
const CM_LISTEN_ATTEMPTS: u32 = 8;

/// How long rdma_cm may take to connect a QP (slow under emulation).
const CM_TIMEOUT: Duration = Duration::from_secs(20);

/// Brings the QP to RTS: from the peer's address, or through rdma_cm when
/// either side's device needs it (iWARP). Returns the rdma_cm connection to
/// keep, if any.
async fn connect_queue_pair(
    device: &Arc<Device>,
    qp: &Arc<dyn QueuePair>,
    options: &ConnectOptions,
    role: Role,
    peer: Hello,
    peer_ip: std::net::IpAddr,
) -> Result<Option<CmConnection>, SetupError> {
    let peer_transport = TransportHello::decode(&peer.payload)?;
    let local_requires = device.context.requires_connection_manager();
    if !local_requires && !peer_transport.requires_cm {
        qp.to_rtr(&peer.address, options)?;
        qp.to_rts()?;
        return Ok(None);
    }
    let no_cm = || {
        SetupError::Protocol(
            "one side's RDMA device (iWARP) connects only through rdma_cm, which the other side does not offer: use the ibverbs provider on both sides".into(),
        )
    };
    let qp = qp.clone();
    let options = *options;
    let connection = match role {
        Role::Accept { cm, token, .. } => {
            let listener = cm.ok_or_else(no_cm)?;
            tokio::task::spawn_blocking(move || listener.accept(&qp, token, &options, CM_TIMEOUT))
                .await
        }
        Role::Connect => {
            if peer_transport.cm_port == 0 {
                return Err(no_cm());
            }
            let manager = device.context.connection_manager().ok_or_else(no_cm)?;
            let addr = std::net::SocketAddr::new(peer_ip, peer_transport.cm_port);
            let token = peer_transport.cm_token;
            tokio::task::spawn_blocking(move || {
                manager.connect(&qp, addr, token, &options, CM_TIMEOUT)
            })
            .await
        }
    };
    let connection = connection
        .map_err(|error| SetupError::Protocol(format!("rdma_cm task failed: {error}")))??;
    Ok(Some(connection))
}

/// Builds a QP with its CQ and channel, attached to the device's shared
/// receive queue, with the peer's initial credits committed in its pool.
fn prepare(
    device: &Device,
    config: &RdmaConfig,
) -> Result<QpEndpoint, crate::verbs::shared::CommitError> {
    let limits = &config.limits;
    let channel = device.context.create_comp_channel()?;
    // The send queue holds the protocol's SENDs and READs, plus the binds of
    // READ windows (memory windows, where the device has them): at most
    // MAX_BINDS_IN_FLIGHT per CQ, refused beyond (the frame then gets a
    // registration), so a bind never takes an entry the protocol counts on.
    // Each completes into the CQ too.
    let sq_depth = limits.send_slots + limits.max_outstanding_reads + MAX_BINDS_IN_FLIGHT;
    let cq_depth = config.recv_slots + sq_depth + 8;
    let pools = device.shared_pools(config.slot_len(), config.pool_caps())?;
    let commitment = Commitment::new(pools.clone(), config.initial_credits as usize)?;
    let queue = PooledQp::new(
        &device.context,
        &device.pd,
        pools,
        Some(&channel),
        PooledQpConfig {
            max_send_wr: sq_depth,
            cq_depth,
            max_inline_data: 64,
        },
    )?;
    let channel = AsyncCompletionChannel::new(channel).map_err(VerbsError::from)?;
    Ok(QpEndpoint {
        queue,
        channel,
        commitment,
    })
}

/// Runs the set-up exchange on `socket` and starts the connection's driver.
#[allow(clippy::too_many_arguments)]
async fn establish(
    mut socket: SetupSocket,
    peer_hello: Option<Hello>,
    peer_ip: std::net::IpAddr,
    device: &Arc<Device>,
    config: &RdmaConfig,
    max_frame_len: usize,
    peer: String,
    mut role: Role,
) -> Result<Connection, TransportError> {
    let budget = match &mut role {
        Role::Accept { budget, .. } => budget.take(),
        Role::Connect => None,
    };
    let endpoint = prepare(device, config).map_err(other)?;
    let local = Geometry {
        recv_slots: config.recv_slots,
        initial_credits: config.initial_credits,
        slot_len: config.slot_len() as u32,
        eager_threshold: config.eager_threshold,
        // Nothing larger fits the wire format: announce at most that.
        max_frame_len: (max_frame_len as u64).min(crate::protocol::MAX_FRAME_LEN),
    };
    let host = host_identity();
    let requires_cm = device.context.requires_connection_manager();
    let (cm_port, cm_token) = match &role {
        Role::Accept {
            cm: Some(listener),
            token,
            ..
        } => (listener.local_addr().port(), *token),
        _ => (0, 0),
    };
    let hello = TransportHello {
        geometry: local,
        host: host.clone(),
        requires_cm,
        cm_port,
        cm_token,
    };
    let mut peer_geometry = None;
    let cm = setup::establish_with(
        &mut socket,
        endpoint.queue.qp(),
        device.provider,
        &hello.encode(),
        peer_hello,
        |hello| {
            peer_geometry = Some(check_peer(hello, device.provider, &host)?.geometry);
            Ok(())
        },
        |peer| {
            connect_queue_pair(
                device,
                endpoint.queue.qp(),
                &config.connect,
                role,
                peer,
                peer_ip,
            )
        },
    )
    .await
    .map_err(|error| match error {
        // The only refusal a peer that sent a hello gets: no room for it.
        SetupError::Refused(reason) => TransportError::ResourceExhausted(reason),
        error => other(error),
    })?;
    let peer_geometry = peer_geometry.expect("checked before connecting");
    // A frame announcing metadata over rpc-core's limit can only be
    // refused: it is, before a byte of it is pulled.
    let protocol = Protocol::new(local, peer_geometry, config.limits)
        .refusing_heads(|head| rpc_core::frame::Frame::peek_metadata_excess(head).is_some());
    Ok(crate::link::start(
        endpoint,
        cm,
        device.clone(),
        protocol,
        config,
        socket,
        budget,
        peer,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fuzz_seeds_are_hellos_of_this_version() {
        // The first byte picks the decoder in the setup_hello target.
        let seeds: [&[u8]; 2] = [
            include_bytes!("../fuzz/seeds/setup_hello/transport"),
            include_bytes!("../fuzz/seeds/setup_hello/transport_cm"),
        ];
        for seed in seeds {
            let hello = TransportHello::decode(&seed[1..]).expect("a seed of this version");
            assert_eq!(hello.encode(), &seed[1..]);
        }
        assert!(TransportHello::decode(&seeds[1][1..]).unwrap().requires_cm);
    }

    #[test]
    fn hello_payload_round_trips_and_checks_version_and_host() {
        let geometry = Geometry {
            recv_slots: 64,
            initial_credits: 16,
            slot_len: 8208,
            eager_threshold: 8192,
            max_frame_len: 1 << 26,
        };
        let ours = TransportHello {
            geometry,
            host: "boot-a".into(),
            requires_cm: true,
            cm_port: 4791,
            cm_token: 0x1234_5678_9abc_def1,
        };
        let payload = ours.encode();
        assert_eq!(TransportHello::decode(&payload).unwrap(), ours);
        let mut newer = payload.clone();
        newer[0] = PROTOCOL_VERSION + 1;
        let error = TransportHello::decode(&newer).unwrap_err().to_string();
        assert!(error.contains("upgrade the older side"), "{error}");
        for cut in 0..payload.len() {
            assert!(TransportHello::decode(&payload[..cut]).is_err());
        }
        let mut longer = payload.clone();
        longer.push(0);
        assert!(TransportHello::decode(&longer).is_err());
        let hello = Hello {
            provider: "soft".into(),
            address: crate::verbs::QpAddress {
                qp_num: 1,
                psn: 0,
                lid: 0,
                gid: [0; 16],
                mtu: 4096,
                extra: Vec::new(),
            },
            payload,
        };
        assert!(check_peer(&hello, "soft", "boot-a").is_ok());
        let error = check_peer(&hello, "soft", "boot-b")
            .unwrap_err()
            .to_string();
        assert!(error.contains("one host only"), "{error}");
        assert!(check_peer(&hello, "ibverbs", "boot-b").is_ok());
    }

    fn ours(geometry: Geometry) -> TransportHello {
        TransportHello {
            geometry,
            host: "0b3c5d2e-55c9-4f49-9a1d-1d1e53a3e7a1".into(),
            requires_cm: false,
            cm_port: 0,
            cm_token: 0,
        }
    }

    /// The geometry `establish` offers for `config` and the default frame limit.
    fn offered(config: &RdmaConfig) -> Geometry {
        Geometry {
            recv_slots: config.recv_slots,
            initial_credits: config.initial_credits,
            slot_len: config.slot_len() as u32,
            eager_threshold: config.eager_threshold,
            max_frame_len: rpc_core::frame::DEFAULT_MAX_FRAME_LEN as u64,
        }
    }

    #[test]
    fn what_a_valid_config_offers_is_accepted() {
        let default = RdmaConfig::default();
        let largest_slots = RdmaConfig {
            eager_threshold: 1 << 20,
            ..RdmaConfig::default()
        };
        let smallest_slots = RdmaConfig {
            eager_threshold: 64,
            recv_slots: crate::protocol::MIN_RECV_SLOTS,
            initial_credits: crate::protocol::MIN_RECV_SLOTS,
            ..RdmaConfig::default()
        };
        for config in [default, largest_slots, smallest_slots] {
            config.validate().unwrap();
            let hello = ours(offered(&config));
            let payload = hello.encode();
            assert_eq!(TransportHello::decode(&payload).unwrap(), hello);
            fuzz_decode_transport_hello(&payload).unwrap();
        }
    }

    #[test]
    fn an_absurd_geometry_or_host_is_refused_by_name_value_and_bound() {
        let default = offered(&RdmaConfig::default());
        let cases = [
            (
                Geometry {
                    recv_slots: u32::MAX,
                    ..default
                },
                "recv_slots = 4294967295 is outside 3..=65536",
            ),
            (
                Geometry {
                    slot_len: u32::MAX,
                    ..default
                },
                "slot_len = 4294967295 is outside 48..=1048592",
            ),
            (
                Geometry {
                    eager_threshold: u32::MAX,
                    ..default
                },
                "eager_threshold = 4294967295 is outside 0..=8192",
            ),
            (
                Geometry {
                    max_frame_len: u64::MAX,
                    ..default
                },
                "max_frame_len = 18446744073709551615 is outside 0..=4294967295",
            ),
        ];
        for (geometry, expected) in cases {
            let error = TransportHello::decode(&ours(geometry).encode())
                .unwrap_err()
                .to_string();
            assert!(error.contains("peer's pools"), "{error}");
            assert!(error.contains(expected), "{error}");
        }
        let mut long_host = ours(default);
        long_host.host = "a".repeat(MAX_HOST_LEN + 1);
        let error = TransportHello::decode(&long_host.encode())
            .unwrap_err()
            .to_string();
        assert!(error.contains("host_len = 65 is outside 0..=64"), "{error}");
        for host in ["boot id", "boot\nid", "bööt", "\u{1b}[31m"] {
            let mut odd = ours(default);
            odd.host = host.into();
            let error = TransportHello::decode(&odd.encode())
                .unwrap_err()
                .to_string();
            assert!(error.contains("host = "), "{error}");
            assert!(error.contains("not a host identity"), "{error}");
        }
        let mut no_host = ours(default);
        no_host.host = String::new();
        assert_eq!(TransportHello::decode(&no_host.encode()).unwrap(), no_host);
    }
}
