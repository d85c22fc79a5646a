//! `rdma://host:port`: rpc-core's message transport over RDMA.
//!
//! Connecting opens a TCP connection to `host:port` for the set-up exchange
//! ([`crate::setup`]), whose hello carries this transport's part: the protocol
//! version, the receive-pool [`Geometry`] and, for the soft provider, the
//! host's boot id (soft only reaches processes on the same host). Then a
//! [`Driver`] task runs the connection; the application gets a frame sink and
//! a frame stream, like any rpc-core transport.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_core::Stream;
use futures_util::SinkExt;
use futures_util::future::BoxFuture;
use rpc_core::transport::{
    Connection, Endpoint, Listener, Transport, TransportConfig, TransportError,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::sync::PollSender;

use crate::config::RdmaConfig;
use crate::device::{self, Device};
use crate::driver::{Driver, Endpoint as QpEndpoint, InboundShared};
use crate::pool::SlotPool;
use crate::protocol::{GEOMETRY_LEN, Geometry, PROTOCOL_VERSION, Protocol};
use crate::setup::{self, Hello, SetupError};
use crate::verbs::{AccessFlags, AsyncCompletionChannel, QpCaps, QpInit, RecvWr, VerbsError};

/// How long the set-up exchange may take before the attempt is abandoned.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(10);
/// Frames the sink buffers before the application waits for the driver.
const OUTGOING_FRAMES: usize = 64;

/// The RDMA transport; register it with [`crate::register`].
#[derive(Debug, Clone)]
pub struct RdmaTransport {
    config: Arc<RdmaConfig>,
}

impl RdmaTransport {
    /// A transport with `config` (validated).
    pub fn new(config: RdmaConfig) -> Result<RdmaTransport, crate::ConfigError> {
        config.validate()?;
        Ok(RdmaTransport {
            config: Arc::new(config),
        })
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
        let rdma = self.config.clone();
        let authority = endpoint.authority().to_owned();
        let max_frame_len = config.max_frame_len;
        Box::pin(async move {
            let device = device::open(&rdma).map_err(other)?;
            let attempt = async {
                let socket = TcpStream::connect(&authority).await?;
                socket.set_nodelay(true)?;
                establish(socket, &device, &rdma, max_frame_len, authority.clone()).await
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
        let rdma = self.config.clone();
        let authority = endpoint.authority().to_owned();
        // The scheme it was registered under (`rdma`, or a test's own).
        let scheme = endpoint.scheme().to_owned();
        let max_frame_len = config.max_frame_len;
        Box::pin(async move {
            // Open the device now: a missing device fails the bind, not each accept.
            let device = device::open(&rdma).map_err(other)?;
            let listener = TcpListener::bind(&authority).await?;
            let local: Endpoint = format!("{scheme}://{}", listener.local_addr()?)
                .parse()
                .map_err(|_| TransportError::InvalidEndpoint {
                    endpoint: authority.clone(),
                    reason: "not host:port",
                })?;
            let (accepted, incoming) = mpsc::channel(16);
            let accept_loop =
                tokio::spawn(accept_loop(listener, device, rdma, max_frame_len, accepted));
            Ok(Box::new(RdmaListener {
                incoming,
                local,
                accept_loop,
            }) as Box<dyn Listener>)
        })
    }
}

async fn accept_loop(
    listener: TcpListener,
    device: Arc<Device>,
    config: Arc<RdmaConfig>,
    max_frame_len: usize,
    accepted: mpsc::Sender<Result<Connection, TransportError>>,
) {
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
        let device = device.clone();
        let config = config.clone();
        let accepted = accepted.clone();
        tokio::spawn(async move {
            let _ = socket.set_nodelay(true);
            let attempt = establish(socket, &device, &config, max_frame_len, peer.to_string());
            let result = match tokio::time::timeout(SETUP_TIMEOUT, attempt).await {
                Ok(result) => result,
                Err(_) => Err(TransportError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("RDMA set-up with {peer} timed out"),
                ))),
            };
            if let Err(error) = &result {
                tracing::debug!(%peer, %error, "rdma set-up failed");
            }
            let _ = accepted.send(result).await;
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

/// What this transport adds to the set-up hello.
fn hello_payload(geometry: &Geometry, host: &str) -> Vec<u8> {
    let mut payload = vec![PROTOCOL_VERSION];
    payload.extend_from_slice(&geometry.encode());
    payload.push(host.len() as u8);
    payload.extend_from_slice(host.as_bytes());
    payload
}

fn parse_hello_payload(payload: &[u8]) -> Result<(Geometry, String), SetupError> {
    let bad = |what: &str| SetupError::Protocol(what.to_owned());
    let version = *payload.first().ok_or_else(|| bad("empty RDMA hello"))?;
    if version != PROTOCOL_VERSION {
        return Err(SetupError::Protocol(format!(
            "peer speaks RDMA protocol version {version}, this build speaks {PROTOCOL_VERSION}: upgrade the older side"
        )));
    }
    let geometry = payload
        .get(1..1 + GEOMETRY_LEN)
        .ok_or_else(|| bad("RDMA hello truncated"))?;
    let geometry = Geometry::decode(geometry)
        .map_err(|error| SetupError::Protocol(format!("peer's pools: {error}")))?;
    let host_len = *payload
        .get(1 + GEOMETRY_LEN)
        .ok_or_else(|| bad("RDMA hello truncated"))? as usize;
    let host = payload
        .get(2 + GEOMETRY_LEN..2 + GEOMETRY_LEN + host_len)
        .ok_or_else(|| bad("RDMA hello truncated"))?;
    if payload.len() != 2 + GEOMETRY_LEN + host_len {
        return Err(bad("trailing bytes in RDMA hello"));
    }
    Ok((geometry, String::from_utf8_lossy(host).into_owned()))
}

/// This host's identity as the soft provider sees it: the kernel's boot id.
fn host_identity() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|id| id.trim().to_owned())
        .unwrap_or_default()
}

/// Checks the peer's hello against ours, before the QP is connected.
fn check_peer(hello: &Hello, provider: &str, host: &str) -> Result<Geometry, SetupError> {
    let (geometry, peer_host) = parse_hello_payload(&hello.payload)?;
    if provider == "soft" && peer_host != host {
        return Err(SetupError::Protocol(
            "the soft RDMA provider connects processes of one host only, and the peer runs on \
             another host: use RDMA_PROVIDER=ibverbs with an RDMA device on both hosts, or a \
             tcp:// endpoint"
                .into(),
        ));
    }
    Ok(geometry)
}

/// Builds a QP with its CQ, channel and pools; receives are posted at once.
fn prepare(device: &Device, config: &RdmaConfig) -> Result<QpEndpoint, VerbsError> {
    let limits = &config.limits;
    let channel = device.context.create_comp_channel()?;
    let cq_depth = config.recv_slots + limits.send_slots + limits.max_outstanding_reads + 8;
    let cq = device.context.create_cq(cq_depth, Some(&channel))?;
    let qp = device.pd.create_qp(QpInit {
        send_cq: cq.clone(),
        recv_cq: cq.clone(),
        srq: None,
        caps: QpCaps {
            max_send_wr: limits.send_slots + limits.max_outstanding_reads,
            max_recv_wr: config.recv_slots,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
        },
        sq_sig_all: false,
    })?;
    qp.to_init()?;
    let slot_len = config.slot_len();
    let recv = SlotPool::new(
        &device.pd,
        config.recv_slots as usize,
        slot_len,
        AccessFlags::LOCAL_WRITE,
    )?;
    let receives = (0..recv.count())
        .map(|slot| RecvWr {
            wr_id: slot as u64,
            sg_list: vec![recv.sge(slot, slot_len)],
        })
        .collect();
    qp.post_recv(receives).map_err(|error| error.error)?;
    let send = SlotPool::new(
        &device.pd,
        limits.send_slots as usize,
        slot_len,
        AccessFlags::LOCAL_WRITE,
    )?;
    let channel = AsyncCompletionChannel::new(channel)?;
    Ok(QpEndpoint {
        qp,
        cq,
        channel,
        recv,
        send,
    })
}

/// Runs the set-up exchange on `socket` and starts the connection's driver.
async fn establish(
    mut socket: TcpStream,
    device: &Arc<Device>,
    config: &RdmaConfig,
    max_frame_len: usize,
    peer: String,
) -> Result<Connection, TransportError> {
    let endpoint = prepare(device, config).map_err(other)?;
    let local = Geometry {
        recv_slots: config.recv_slots,
        slot_len: config.slot_len() as u32,
        eager_threshold: config.eager_threshold,
        max_frame_len: max_frame_len as u64,
    };
    let host = host_identity();
    let payload = hello_payload(&local, &host);
    let mut peer_geometry = None;
    setup::establish_checked(
        &mut socket,
        &endpoint.qp,
        device.provider,
        &config.connect,
        &payload,
        |hello| {
            peer_geometry = Some(check_peer(hello, device.provider, &host)?);
            Ok(())
        },
    )
    .await
    .map_err(other)?;
    let peer_geometry = peer_geometry.expect("checked before connecting");
    let protocol = Protocol::new(local, peer_geometry, config.limits);

    let (outgoing_tx, outgoing_rx) = mpsc::channel(OUTGOING_FRAMES);
    let (inbound_tx, inbound_rx) = mpsc::unbounded_channel();
    let shared = Arc::new(InboundShared::default());
    let driver = Driver::new(
        endpoint,
        device.clone(),
        protocol,
        config,
        socket,
        outgoing_rx,
        inbound_tx,
        shared.clone(),
    );
    tokio::spawn(driver.run());
    Ok(Connection {
        sink: Box::pin(PollSender::new(outgoing_tx).sink_map_err(|_| TransportError::Closed)),
        stream: Box::pin(InboundFrames {
            receiver: inbound_rx,
            shared,
            limit: config.inbound_backlog,
        }),
        peer: format!("rdma://{peer}"),
    })
}

/// The application's end of the inbound frames.
struct InboundFrames {
    receiver: mpsc::UnboundedReceiver<Result<Bytes, TransportError>>,
    shared: Arc<InboundShared>,
    limit: usize,
}

impl Stream for InboundFrames {
    type Item = Result<Bytes, TransportError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let item = self.receiver.poll_recv(cx);
        if let Poll::Ready(Some(Ok(_))) = &item {
            let before = self.shared.backlog.fetch_sub(1, Ordering::AcqRel);
            if before >= self.limit {
                self.shared.drained.notify_one();
            }
        }
        item
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_payload_round_trips_and_checks_version_and_host() {
        let geometry = Geometry {
            recv_slots: 64,
            slot_len: 8208,
            eager_threshold: 8192,
            max_frame_len: 1 << 26,
        };
        let payload = hello_payload(&geometry, "boot-a");
        assert_eq!(
            parse_hello_payload(&payload).unwrap(),
            (geometry, "boot-a".to_owned())
        );
        let mut newer = payload.clone();
        newer[0] = PROTOCOL_VERSION + 1;
        let error = parse_hello_payload(&newer).unwrap_err().to_string();
        assert!(error.contains("upgrade the older side"), "{error}");
        for cut in 0..payload.len() {
            assert!(parse_hello_payload(&payload[..cut]).is_err());
        }
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
}
