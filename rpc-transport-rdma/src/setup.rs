//! Connection set-up: bring two queue pairs to RTS over an out-of-band stream.
//!
//! Both sides send a [`Hello`] (protocol version, provider name, the QP's
//! [`QpAddress`], and bytes of the caller's own), connect their QP to the
//! peer's address, then exchange one "ready" byte so that neither side posts a
//! send before the other is ready to receive. The stream is TCP for
//! `connect`/`accept`, but any byte stream works with [`establish`]; keeping it
//! open afterwards gives a liveness signal (EOF = the peer is gone).
//!
//! Wire form of a hello: `len: u32 LE` then `magic "RRPC" | version: u16 |
//! provider_len: u8 | provider | address_len: u32 | address | payload_len: u32 | payload`.

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};

use crate::verbs::{ConnectOptions, QpAddress, QpState, QueuePair, VerbsError};

/// Version of the set-up exchange.
pub const SETUP_VERSION: u16 = 1;
const MAGIC: &[u8; 4] = b"RRPC";
/// Largest hello accepted (addresses are tens of bytes; payloads are small).
pub const MAX_HELLO_LEN: usize = 64 << 10;
const READY: u8 = 0x52;

/// What each side announces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The provider the QP belongs to (`soft`, `ibverbs`): both sides must match.
    pub provider: String,
    /// Where the QP is.
    pub address: QpAddress,
    /// The caller's own bytes (e.g. pool geometry of the RPC protocol).
    pub payload: Vec<u8>,
}

/// Why set-up failed.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// The stream failed or closed.
    #[error("set-up stream: {0}")]
    Io(#[from] std::io::Error),
    /// The peer spoke something else.
    #[error("set-up protocol error: {0}")]
    Protocol(String),
    /// The two sides use different providers.
    #[error(
        "provider mismatch: this side uses {local:?}, the peer uses {peer:?}; set RDMA_PROVIDER to the same value on both"
    )]
    ProviderMismatch {
        /// Ours.
        local: String,
        /// Theirs.
        peer: String,
    },
    /// The QP could not be connected.
    #[error("connecting the queue pair: {0}")]
    Verbs(#[from] VerbsError),
}

impl Hello {
    fn encode(&self) -> Vec<u8> {
        let address = self.address.to_bytes();
        let mut body =
            Vec::with_capacity(16 + self.provider.len() + address.len() + self.payload.len());
        body.extend_from_slice(MAGIC);
        body.extend_from_slice(&SETUP_VERSION.to_le_bytes());
        body.push(self.provider.len() as u8);
        body.extend_from_slice(self.provider.as_bytes());
        body.extend_from_slice(&(address.len() as u32).to_le_bytes());
        body.extend_from_slice(&address);
        body.extend_from_slice(&(self.payload.len() as u32).to_le_bytes());
        body.extend_from_slice(&self.payload);
        let mut out = (body.len() as u32).to_le_bytes().to_vec();
        out.extend_from_slice(&body);
        out
    }

    fn decode(body: &[u8]) -> Result<Hello, SetupError> {
        let bad = |what: &str| SetupError::Protocol(what.to_owned());
        let mut at = 0;
        let mut take = |n: usize| -> Result<&[u8], SetupError> {
            let slice = body.get(at..at + n).ok_or_else(|| bad("hello truncated"))?;
            at += n;
            Ok(slice)
        };
        if take(4)? != MAGIC {
            return Err(bad("not an rdma-rpc peer (bad magic)"));
        }
        let version = u16::from_le_bytes(take(2)?.try_into().expect("2"));
        if version != SETUP_VERSION {
            return Err(SetupError::Protocol(format!(
                "peer speaks set-up version {version}, this build speaks {SETUP_VERSION}: upgrade the older side"
            )));
        }
        let provider_len = take(1)?[0] as usize;
        let provider = String::from_utf8(take(provider_len)?.to_vec())
            .map_err(|_| bad("provider name is not UTF-8"))?;
        let address_len = u32::from_le_bytes(take(4)?.try_into().expect("4")) as usize;
        let address = QpAddress::from_bytes(take(address_len)?)?;
        let payload_len = u32::from_le_bytes(take(4)?.try_into().expect("4")) as usize;
        let payload = take(payload_len)?.to_vec();
        if at != body.len() {
            return Err(bad("trailing bytes after hello"));
        }
        Ok(Hello {
            provider,
            address,
            payload,
        })
    }
}

async fn read_hello<S: AsyncRead + Unpin>(stream: &mut S) -> Result<Hello, SetupError> {
    let len = stream.read_u32_le().await? as usize;
    if len > MAX_HELLO_LEN {
        return Err(SetupError::Protocol(format!(
            "hello of {len} bytes exceeds {MAX_HELLO_LEN}"
        )));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).await?;
    Hello::decode(&body)
}

/// Exchanges hellos on `stream`, connects `qp` (RESET or INIT → RTS) to the
/// peer's QP, and waits until the peer has done the same. Returns the peer's hello.
pub async fn establish<S>(
    stream: &mut S,
    qp: &Arc<dyn QueuePair>,
    provider: &str,
    options: &ConnectOptions,
    payload: &[u8],
) -> Result<Hello, SetupError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    establish_checked(stream, qp, provider, options, payload, |_| Ok(())).await
}

/// [`establish`], with `check` run on the peer's hello before the QP is
/// connected: the place to refuse a peer whose payload does not fit (both
/// sides see both hellos, so both can say why).
pub async fn establish_checked<S>(
    stream: &mut S,
    qp: &Arc<dyn QueuePair>,
    provider: &str,
    options: &ConnectOptions,
    payload: &[u8],
    check: impl FnOnce(&Hello) -> Result<(), SetupError>,
) -> Result<Hello, SetupError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let direct = |peer: Hello| async move {
        qp.to_rtr(&peer.address, options)?;
        qp.to_rts()?;
        Ok(peer)
    };
    establish_with(stream, qp, provider, payload, check, direct).await
}

/// The general form: exchanges hellos, runs `check` on the peer's, lets
/// `connect` bring the QP to RTS (directly from the peer's address, or
/// through a connection manager), then exchanges the readiness byte.
pub async fn establish_with<S, T, F, Fut>(
    stream: &mut S,
    qp: &Arc<dyn QueuePair>,
    provider: &str,
    payload: &[u8],
    check: impl FnOnce(&Hello) -> Result<(), SetupError>,
    connect: F,
) -> Result<T, SetupError>
where
    S: AsyncRead + AsyncWrite + Unpin,
    F: FnOnce(Hello) -> Fut,
    Fut: std::future::Future<Output = Result<T, SetupError>>,
{
    if qp.state() == QpState::Reset {
        qp.to_init()?;
    }
    let local = Hello {
        provider: provider.to_owned(),
        address: qp.local_address(),
        payload: payload.to_vec(),
    };
    stream.write_all(&local.encode()).await?;
    stream.flush().await?;
    let peer = read_hello(stream).await?;
    if peer.provider != provider {
        return Err(SetupError::ProviderMismatch {
            local: provider.to_owned(),
            peer: peer.provider,
        });
    }
    check(&peer)?;
    let connected = connect(peer).await?;
    stream.write_all(&[READY]).await?;
    stream.flush().await?;
    let ready = match stream.read_u8().await {
        Ok(ready) => ready,
        Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err(SetupError::Protocol(
                "the peer closed the set-up connection before it was ready (it refused this side's hello or could not connect its queue pair: see its log)".into(),
            ));
        }
        Err(error) => return Err(error.into()),
    };
    if ready != READY {
        return Err(SetupError::Protocol(
            "peer did not confirm readiness".into(),
        ));
    }
    Ok(connected)
}

/// A connected queue pair with its set-up stream (kept open as a liveness signal).
#[derive(Debug)]
pub struct Established {
    /// The set-up stream; EOF on it means the peer is gone.
    pub stream: TcpStream,
    /// The peer's hello.
    pub peer: Hello,
}

/// Connects `qp` to the QP a [`QpListener`] at `addr` offers.
pub async fn connect(
    addr: impl ToSocketAddrs,
    qp: &Arc<dyn QueuePair>,
    provider: &str,
    options: &ConnectOptions,
    payload: &[u8],
) -> Result<Established, SetupError> {
    let mut stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let peer = establish(&mut stream, qp, provider, options, payload).await?;
    Ok(Established { stream, peer })
}

/// Accepts set-up connections on a TCP port.
#[derive(Debug)]
pub struct QpListener {
    listener: TcpListener,
}

impl QpListener {
    /// Listens on `addr` (port 0 picks one).
    pub async fn bind(addr: impl ToSocketAddrs) -> std::io::Result<QpListener> {
        Ok(QpListener {
            listener: TcpListener::bind(addr).await?,
        })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        self.listener.local_addr()
    }

    /// Waits for the next peer and connects `qp` to it.
    pub async fn accept(
        &self,
        qp: &Arc<dyn QueuePair>,
        provider: &str,
        options: &ConnectOptions,
        payload: &[u8],
    ) -> Result<Established, SetupError> {
        let (mut stream, _) = self.listener.accept().await?;
        stream.set_nodelay(true)?;
        let peer = establish(&mut stream, qp, provider, options, payload).await?;
        Ok(Established { stream, peer })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        Hello {
            provider: "soft".into(),
            address: QpAddress {
                qp_num: 5,
                psn: 1,
                lid: 0,
                gid: [0; 16],
                mtu: 4096,
                extra: vec![1, 2, 3],
            },
            payload: b"geometry".to_vec(),
        }
    }

    #[test]
    fn hello_round_trips_and_rejects_bad_input() {
        let bytes = hello().encode();
        assert_eq!(Hello::decode(&bytes[4..]).unwrap(), hello());
        let mut wrong_magic = bytes[4..].to_vec();
        wrong_magic[0] = b'X';
        assert!(matches!(
            Hello::decode(&wrong_magic),
            Err(SetupError::Protocol(_))
        ));
        let mut wrong_version = bytes[4..].to_vec();
        wrong_version[4] = 9;
        let error = Hello::decode(&wrong_version).unwrap_err().to_string();
        assert!(error.contains("version 9"), "{error}");
        for cut in 0..bytes.len() - 4 {
            assert!(Hello::decode(&bytes[4..4 + cut]).is_err());
        }
    }
}
