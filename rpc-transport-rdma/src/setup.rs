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
//!
//! Everything in a peer's hello is checked before anything is done with it:
//! `len` ≤ [`MAX_HELLO_LEN`] before the body is read, the provider name is
//! 1..=[`MAX_PROVIDER_LEN`] bytes of `a-z 0-9 _ -`, the address is at most
//! [`MAX_ADDRESS_LEN`] bytes and parses as a [`QpAddress`], the payload is what
//! is left of the hello, and nothing trails it. A violation is a
//! [`SetupError::Protocol`] naming the field, its value and the bound.

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};

use crate::verbs::{ConnectOptions, QpAddress, QpState, QueuePair, VerbsError};

/// Version of the set-up exchange.
pub const SETUP_VERSION: u16 = 1;
const MAGIC: &[u8; 4] = rpc_core::frame::RDMA_HELLO_MAGIC;
/// Largest hello accepted (addresses are tens of bytes; payloads are small).
pub const MAX_HELLO_LEN: usize = 64 << 10;
/// Longest provider name (`soft`, `ibverbs`).
pub const MAX_PROVIDER_LEN: usize = 32;
/// Longest QP address: 34 fixed bytes plus the provider's extra bytes (12 for
/// soft, none for ibverbs).
pub const MAX_ADDRESS_LEN: usize = 1024;
const READY: u8 = 0x52;
/// Bytes of a hello around its variable parts: magic, version, the three lengths.
const HELLO_FIXED_LEN: usize = 4 + 2 + 1 + 4 + 4;

const _: () = assert!(MAX_PROVIDER_LEN <= u8::MAX as usize, "provider_len is a u8");
const _: () = assert!(
    HELLO_FIXED_LEN + MAX_PROVIDER_LEN + MAX_ADDRESS_LEN < MAX_HELLO_LEN,
    "a hello with the longest provider and address still has room for a payload"
);
const _: () = assert!(MAX_HELLO_LEN <= u32::MAX as usize, "len is a u32");

/// Whether `name` may be a provider name: 1..=[`MAX_PROVIDER_LEN`] bytes of `a-z 0-9 _ -`.
fn valid_provider(name: &[u8]) -> bool {
    (1..=MAX_PROVIDER_LEN).contains(&name.len())
        && name
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'_' || *b == b'-')
}

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
    /// The server refused the set-up and said why (in place of its hello).
    #[error("the server refused the set-up: {0}")]
    Refused(String),
    /// What arrived is HTTP/2's preface: a gRPC client at an rdma:// port
    /// (answered by [`answer_http2_client`]).
    #[error("{HTTP2_AT_RDMA}")]
    Http2Client,
}

/// What a gRPC (HTTP/2) client at an rdma:// port is told, and the log says.
pub const HTTP2_AT_RDMA: &str = "a gRPC (HTTP/2) client reached this rdma-rpc rdma:// port, which is not gRPC: listen on grpc:// for gRPC clients";

/// The set-up version a refusal carries in place of [`SETUP_VERSION`]: the
/// rest of its body is the reason, UTF-8.
const REFUSAL_VERSION: u16 = u16::MAX;
/// Longest reason a refusal carries.
const MAX_REFUSAL_REASON: usize = 1024;

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
        let out_of_bounds = |field: &str, value: usize, max: usize| {
            SetupError::Protocol(format!("hello: {field} = {value} is outside 0..={max}"))
        };
        if body.len() > MAX_HELLO_LEN {
            return Err(out_of_bounds("len", body.len(), MAX_HELLO_LEN));
        }
        // What is left of the body; each part is split off its front.
        let mut rest = body;
        if take(&mut rest, 4)? != MAGIC {
            // A tcp:// server answers our hello with a frame of its own
            // (closing the connection it cannot parse): name the mix-up.
            let frame = bytes::Bytes::copy_from_slice(body);
            if rpc_core::frame::Frame::decode(frame, MAX_HELLO_LEN).is_ok() {
                return Err(bad(
                    "the peer speaks tcp:// frames, not rdma://'s set-up exchange: it is a tcp:// endpoint, use tcp:// for it",
                ));
            }
            return Err(bad("not an rdma-rpc peer (bad magic)"));
        }
        let version = u16::from_le_bytes(take(&mut rest, 2)?.try_into().expect("2"));
        if version == REFUSAL_VERSION {
            let end = rest.len().min(MAX_REFUSAL_REASON);
            let reason = String::from_utf8_lossy(&rest[..end]);
            return Err(SetupError::Refused(
                reason.trim_end_matches('\0').to_owned(),
            ));
        }
        if version != SETUP_VERSION {
            return Err(SetupError::Protocol(format!(
                "peer speaks set-up version {version}, this build speaks {SETUP_VERSION}: upgrade the older side"
            )));
        }
        let provider_len = take(&mut rest, 1)?[0] as usize;
        if !(1..=MAX_PROVIDER_LEN).contains(&provider_len) {
            return Err(SetupError::Protocol(format!(
                "hello: provider_len = {provider_len} is outside 1..={MAX_PROVIDER_LEN}"
            )));
        }
        let provider = take(&mut rest, provider_len)?;
        if !valid_provider(provider) {
            return Err(SetupError::Protocol(format!(
                "hello: provider = {:?} is not a provider name (1..={MAX_PROVIDER_LEN} bytes of a-z 0-9 _ -)",
                String::from_utf8_lossy(provider)
            )));
        }
        let provider = String::from_utf8(provider.to_vec()).expect("checked ASCII");
        let address_len = u32::from_le_bytes(take(&mut rest, 4)?.try_into().expect("4")) as usize;
        if address_len > MAX_ADDRESS_LEN {
            return Err(out_of_bounds("address_len", address_len, MAX_ADDRESS_LEN));
        }
        let address = QpAddress::from_bytes(take(&mut rest, address_len)?)
            .map_err(|error| SetupError::Protocol(format!("hello: address: {error}")))?;
        let payload_len = u32::from_le_bytes(take(&mut rest, 4)?.try_into().expect("4")) as usize;
        let left = rest.len();
        if payload_len > left {
            return Err(SetupError::Protocol(format!(
                "hello: payload_len = {payload_len} is outside 0..={left} (the rest of the hello)"
            )));
        }
        let payload = take(&mut rest, payload_len)?.to_vec();
        if !rest.is_empty() {
            return Err(bad("trailing bytes after hello"));
        }
        Ok(Hello {
            provider,
            address,
            payload,
        })
    }
}

/// Splits `n` bytes off the front of `rest`.
fn take<'a>(rest: &mut &'a [u8], n: usize) -> Result<&'a [u8], SetupError> {
    let (part, after) = rest
        .split_at_checked(n)
        .ok_or_else(|| SetupError::Protocol("hello truncated".into()))?;
    *rest = after;
    Ok(part)
}

/// Fuzzing entry point (not API): decodes `body` as a peer's hello (what
/// follows the length prefix) and, when it is accepted, checks that it
/// re-encodes to the same bytes and decodes again to the same hello.
#[cfg(any(test, fuzzing))]
pub fn fuzz_decode_hello(body: &[u8]) -> Result<Hello, SetupError> {
    let hello = Hello::decode(body)?;
    let again = hello.encode();
    assert_eq!(
        &again[4..],
        body,
        "an accepted hello re-encodes byte for byte"
    );
    assert_eq!(
        Hello::decode(&again[4..]).expect("re-encoded hello decodes"),
        hello
    );
    Ok(hello)
}

/// What an accepting side writes before it closes a connection whose first
/// bytes were no hello: a length-prefixed body that begins with the hello's
/// magic and is as long as an rpc-core frame header, so that whoever dialed
/// can name the mix-up (a `tcp://` client reads an rdma:// peer; a TLS
/// client reads no TLS). Best effort, within `limit`.
pub async fn refuse_non_hello<S: AsyncWrite + Unpin>(stream: &mut S, limit: std::time::Duration) {
    refuse(stream, "what arrived was no rdma:// hello", limit).await;
}

/// Refuses a dialer in place of the hello, with `reason`, which its set-up
/// reports ([`SetupError::Refused`]). The body begins with the hello's magic
/// and is at least as long as an rpc-core frame header (see
/// [`refuse_non_hello`]). Best effort, within `limit`.
pub async fn refuse<S: AsyncWrite + Unpin>(
    stream: &mut S,
    reason: &str,
    limit: std::time::Duration,
) {
    let reason = &reason.as_bytes()[..reason.len().min(MAX_REFUSAL_REASON)];
    let mut body = Vec::with_capacity(rpc_core::frame::HEADER_LEN + reason.len());
    body.extend_from_slice(MAGIC);
    body.extend_from_slice(&REFUSAL_VERSION.to_le_bytes());
    body.extend_from_slice(reason);
    if body.len() < rpc_core::frame::HEADER_LEN {
        body.resize(rpc_core::frame::HEADER_LEN, 0);
    }
    let mut refusal = Vec::with_capacity(4 + body.len());
    refusal.extend_from_slice(&(body.len() as u32).to_le_bytes());
    refusal.extend_from_slice(&body);
    let _ = tokio::time::timeout(limit, async {
        stream.write_all(&refusal).await?;
        stream.flush().await
    })
    .await;
}

/// Who sent the hello being read: what its silence can mean differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HelloFrom {
    /// The side that dialed: a listener reads its hello first.
    Dialer,
    /// The side that listens: a dialer reads its hello after sending its own.
    Listener,
}

/// Reads the peer's hello (what an accepting side does first, before it
/// builds anything for the peer: [`establish_with`]'s `peer`).
pub async fn read_hello<S: AsyncRead + Unpin>(
    stream: &mut S,
    from: HelloFrom,
) -> Result<Hello, SetupError> {
    let mut prefix = [0u8; 4];
    if let Err(error) = stream.read_exact(&mut prefix).await {
        if error.kind() == std::io::ErrorKind::UnexpectedEof {
            return Err(SetupError::Protocol(
                match from {
                    // Only a dialer's guess: the listener refused it, or
                    // wanted a TLS handshake it did not get.
                    HelloFrom::Listener => {
                        "the peer closed the set-up connection before its hello: it refused this one \
                         (see its log), or it expects TLS here (an rdma+tls:// endpoint)"
                    }
                    HelloFrom::Dialer => {
                        "the peer closed the set-up connection before sending a hello (a port probe, \
                         or a client that gave up)"
                    }
                }
                .into(),
            ));
        }
        return Err(error.into());
    }
    let len = u32::from_le_bytes(prefix) as usize;
    if prefix == rpc_core::frame::HTTP2_PREFACE[..4] {
        return Err(SetupError::Http2Client);
    }
    if len > MAX_HELLO_LEN {
        match tls_record(&prefix) {
            Some(TLS_HANDSHAKE) => {
                return Err(SetupError::Protocol(
                    "the peer opened a TLS handshake: it is an rdma+tls:// client, and this \
                     endpoint is plain rdma:// (register the transport with TLS, under its own scheme)"
                        .into(),
                ));
            }
            Some(_) => {
                return Err(SetupError::Protocol(
                    "the peer answered with a TLS alert: it expects TLS here (an rdma+tls:// \
                     endpoint), and this side is plain rdma://"
                        .into(),
                ));
            }
            None => {}
        }
    }
    if len > MAX_HELLO_LEN {
        return Err(SetupError::Protocol(format!(
            "hello of {len} bytes exceeds {MAX_HELLO_LEN}"
        )));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).await?;
    Hello::decode(&body)
}

/// Answers an HTTP/2 client whose preface began where a hello was expected
/// (its first 4 bytes read already) as a gRPC server would refuse its
/// first call: SETTINGS, then that call's end with `UNAVAILABLE` and
/// [`HTTP2_AT_RDMA`] (a trailers-only response, which grpcio and tonic
/// report as the call's error), then GOAWAY. Reads at most
/// [`HTTP2_ANSWER_READ_LIMIT`] bytes of the client's frames, and the caller
/// bounds the time.
pub async fn answer_http2_client<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S) {
    let _ = answer_http2(stream).await;
}

/// Bytes of the client's frames read before its first call's HEADERS.
pub const HTTP2_ANSWER_READ_LIMIT: usize = 64 << 10;

async fn answer_http2<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S) -> std::io::Result<()> {
    const SETTINGS: u8 = 0x4;
    const HEADERS: u8 = 0x1;
    const GOAWAY: u8 = 0x7;
    const END_STREAM_AND_HEADERS: u8 = 0x5;
    let preface = rpc_core::frame::HTTP2_PREFACE;
    let mut rest = [0u8; 20];
    stream.read_exact(&mut rest).await?;
    if rest[..] != preface[4..] {
        return Ok(());
    }
    stream.write_all(&http2_frame(SETTINGS, 0, 0, &[])).await?;
    stream.flush().await?;
    // The client's frames up to its first HEADERS: its call's stream.
    let mut read = 0usize;
    let call = loop {
        let mut header = [0u8; 9];
        stream.read_exact(&mut header).await?;
        let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
        read += header.len() + len;
        if read > HTTP2_ANSWER_READ_LIMIT {
            return Ok(());
        }
        let mut payload = vec![0u8; len];
        stream.read_exact(&mut payload).await?;
        if header[3] == HEADERS {
            break u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7fff_ffff;
        }
    };
    // A trailers-only response: `:status: 200` (static table entry 8), then
    // literal fields without indexing.
    let mut block = vec![0x88];
    for (name, value) in [
        ("content-type", "application/grpc"),
        ("grpc-status", "14"),
        ("grpc-message", HTTP2_AT_RDMA),
    ] {
        block.push(0x00);
        hpack_string(&mut block, name.as_bytes());
        hpack_string(&mut block, value.as_bytes());
    }
    let mut answer = http2_frame(HEADERS, END_STREAM_AND_HEADERS, call, &block);
    let mut goaway = call.to_be_bytes().to_vec();
    goaway.extend_from_slice(&0u32.to_be_bytes());
    goaway.extend_from_slice(HTTP2_AT_RDMA.as_bytes());
    answer.extend_from_slice(&http2_frame(GOAWAY, 0, 0, &goaway));
    stream.write_all(&answer).await?;
    stream.flush().await?;
    // Read until the client closes (the caller bounds the time), so it
    // reads the answer rather than a reset.
    let mut sink = [0u8; 4096];
    while stream.read(&mut sink).await? > 0 {}
    Ok(())
}

/// An HTTP/2 frame: 24-bit length, type, flags, stream, payload.
fn http2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u32).to_be_bytes();
    let mut frame = vec![len[1], len[2], len[3], kind, flags];
    frame.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// An HPACK string literal, not Huffman-coded: a 7-bit-prefix length, then
/// the bytes.
fn hpack_string(block: &mut Vec<u8>, bytes: &[u8]) {
    let mut len = bytes.len();
    if len < 0x7f {
        block.push(len as u8);
    } else {
        block.push(0x7f);
        len -= 0x7f;
        while len >= 0x80 {
            block.push((len & 0x7f) as u8 | 0x80);
            len >>= 7;
        }
        block.push(len as u8);
    }
    block.extend_from_slice(bytes);
}

/// A TLS record of type handshake (a ClientHello).
const TLS_HANDSHAKE: u8 = 0x16;
/// A TLS record of type alert (what a TLS server answers a plain hello).
const TLS_ALERT: u8 = 0x15;

/// The record type, when the first bytes are a TLS handshake or alert
/// record header: the type, then version 3.1 to 3.4. Read as a hello's
/// length prefix, such a header announces more than [`MAX_HELLO_LEN`], so
/// only a refused hello is ever taken for one.
fn tls_record(prefix: &[u8; 4]) -> Option<u8> {
    (matches!(prefix[0], TLS_HANDSHAKE | TLS_ALERT)
        && prefix[1] == 0x03
        && (0x01..=0x04).contains(&prefix[2]))
    .then_some(prefix[0])
}

const _: () = assert!(
    0x0001_0315 > MAX_HELLO_LEN,
    "a TLS record header is never a valid hello length"
);

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
    establish_with(stream, qp, provider, payload, None, check, direct).await
}

/// The general form: exchanges hellos, runs `check` on the peer's, lets
/// `connect` bring the QP to RTS (directly from the peer's address, or
/// through a connection manager), then exchanges the readiness byte.
///
/// `peer`: the peer's hello when the caller read it already
/// ([`read_hello`]): an accepting side reads it first, so that a peer that
/// never sends one costs it no QP. A dialing side writes its hello first,
/// so the two orders meet.
pub async fn establish_with<S, T, F, Fut>(
    stream: &mut S,
    qp: &Arc<dyn QueuePair>,
    provider: &str,
    payload: &[u8],
    peer: Option<Hello>,
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
    let peer = match peer {
        Some(peer) => peer,
        None => read_hello(stream, HelloFrom::Listener).await?,
    };
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

    /// The body of a hello with each part given raw.
    fn raw(
        provider: &[u8],
        address_len: u32,
        address: &[u8],
        payload_len: u32,
        payload: &[u8],
    ) -> Vec<u8> {
        let mut body = MAGIC.to_vec();
        body.extend_from_slice(&SETUP_VERSION.to_le_bytes());
        body.push(provider.len() as u8);
        body.extend_from_slice(provider);
        body.extend_from_slice(&address_len.to_le_bytes());
        body.extend_from_slice(address);
        body.extend_from_slice(&payload_len.to_le_bytes());
        body.extend_from_slice(payload);
        body
    }

    fn refused(body: &[u8]) -> String {
        match Hello::decode(body) {
            Err(SetupError::Protocol(message)) => message,
            other => panic!("expected a protocol error, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_tls_client_or_a_silent_close_is_named_when_a_hello_is_expected() {
        // The start of a TLS 1.2/1.3 ClientHello record.
        let mut tls: &[u8] = &[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc];
        let error = read_hello(&mut tls, HelloFrom::Dialer)
            .await
            .unwrap_err()
            .to_string();
        assert!(error.contains("rdma+tls:// client"), "{error}");
        // The alert a TLS server sends when a plain hello reached it.
        let mut alert: &[u8] = &[0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x32];
        let error = read_hello(&mut alert, HelloFrom::Listener)
            .await
            .unwrap_err()
            .to_string();
        assert!(error.contains("expects TLS"), "{error}");
        let mut closed: &[u8] = &[];
        let error = read_hello(&mut closed, HelloFrom::Listener)
            .await
            .unwrap_err()
            .to_string();
        assert!(error.contains("before its hello"), "{error}");
        assert!(error.contains("expects TLS"), "{error}");
        // A dialer that closed without a hello: the listener does not
        // guess at TLS (it is the side that would want it).
        let mut closed: &[u8] = &[];
        let error = read_hello(&mut closed, HelloFrom::Dialer)
            .await
            .unwrap_err()
            .to_string();
        assert!(error.contains("before sending a hello"), "{error}");
        assert!(!error.contains("TLS"), "{error}");
        // A hello whose length happens to start like a record is still a hello.
        let mut good = hello().encode();
        let len = u32::from_le_bytes(good[..4].try_into().unwrap());
        assert!(len < 0x0316, "the test hello is short");
        good.truncate(4);
        good[..4].copy_from_slice(&0x0316u32.to_le_bytes());
        let error = read_hello(&mut good.as_slice(), HelloFrom::Dialer)
            .await
            .unwrap_err()
            .to_string();
        assert!(!error.contains("TLS"), "{error}");
    }

    #[test]
    fn every_hello_field_out_of_bounds_is_refused_by_name_value_and_bound() {
        let address = hello().address.to_bytes();
        let len = address.len() as u32;
        // The longest provider name and address are accepted.
        let longest = QpAddress {
            extra: vec![7; MAX_ADDRESS_LEN - 34],
            ..hello().address
        };
        let name = "a".repeat(MAX_PROVIDER_LEN);
        let body = raw(
            name.as_bytes(),
            MAX_ADDRESS_LEN as u32,
            &longest.to_bytes(),
            0,
            b"",
        );
        assert_eq!(fuzz_decode_hello(&body).unwrap().address, longest);

        let message = refused(&raw(b"", len, &address, 0, b""));
        assert!(
            message.contains("provider_len = 0 is outside 1..=32"),
            "{message}"
        );
        let message = refused(&raw(&[b'a'; 33], len, &address, 0, b""));
        assert!(
            message.contains("provider_len = 33 is outside 1..=32"),
            "{message}"
        );
        for bad_name in [&b"Soft"[..], b"so ft", b"soft\n", b"\xff\xfe", b"soft\0"] {
            let message = refused(&raw(bad_name, len, &address, 0, b""));
            assert!(message.contains("provider = "), "{message}");
            assert!(message.contains("a-z 0-9 _ -"), "{message}");
        }
        let message = refused(&raw(b"soft", u32::MAX, &address, 0, b""));
        assert!(
            message.contains("address_len = 4294967295 is outside 0..=1024"),
            "{message}"
        );
        let message = refused(&raw(b"soft", 1025, &[0; 1025], 0, b""));
        assert!(message.contains("address_len = 1025"), "{message}");
        let message = refused(&raw(b"soft", 3, &[0; 3], 0, b""));
        assert!(message.contains("address"), "{message}");
        let message = refused(&raw(b"soft", len, &address, u32::MAX, b"abc"));
        assert!(
            message.contains("payload_len = 4294967295 is outside 0..=3"),
            "{message}"
        );
        let message = refused(&vec![0; MAX_HELLO_LEN + 1]);
        assert!(
            message.contains("len = 65537 is outside 0..=65536"),
            "{message}"
        );
    }
}
