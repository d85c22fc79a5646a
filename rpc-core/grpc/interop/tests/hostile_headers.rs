//! Hostile header blocks against the grpc:// server, written as raw HTTP/2
//! frames (no client library would send them): a CONTINUATION flood, a
//! header list far over the limit, and an HPACK bomb (one large header put
//! in the dynamic table, then referenced thousands of times). Each ends
//! with the attacking stream or connection refused, no handler run, the
//! process not grown by the attack's size, and another client served.

mod common;

use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(9 + payload.len());
    out.put_uint(payload.len() as u64, 3);
    out.put_u8(kind);
    out.put_u8(flags);
    out.put_u32(stream);
    out.put_slice(payload);
    out.freeze()
}

/// An HPACK integer with an `n`-bit prefix, its first byte or-ed with `first`.
fn hpack_int(out: &mut BytesMut, first: u8, n: u32, mut value: usize) {
    let max = (1usize << n) - 1;
    if value < max {
        out.put_u8(first | value as u8);
        return;
    }
    out.put_u8(first | max as u8);
    value -= max;
    while value >= 128 {
        out.put_u8((value % 128) as u8 | 0x80);
        value /= 128;
    }
    out.put_u8(value as u8);
}

/// A literal header field, new name, not indexed (or with incremental
/// indexing: it enters the dynamic table).
fn literal(out: &mut BytesMut, name: &str, value: &[u8], index: bool) {
    out.put_u8(if index { 0x40 } else { 0x00 });
    hpack_int(out, 0, 7, name.len());
    out.put_slice(name.as_bytes());
    hpack_int(out, 0, 7, value.len());
    out.put_slice(value);
}

/// The header block of a gRPC request for `Unary`, plus `extra`.
fn request_block(authority: &str, extra: impl FnOnce(&mut BytesMut)) -> BytesMut {
    let mut block = BytesMut::new();
    literal(&mut block, ":method", b"POST", false);
    literal(&mut block, ":scheme", b"http", false);
    literal(&mut block, ":path", b"/interop.v1.Interop/Unary", false);
    literal(&mut block, ":authority", authority.as_bytes(), false);
    literal(&mut block, "content-type", b"application/grpc", false);
    literal(&mut block, "te", b"trailers", false);
    extra(&mut block);
    block
}

/// A raw HTTP/2 connection: the preface and an empty SETTINGS are sent;
/// the server's frames are read (and their kinds kept) by a task of its own.
struct Raw {
    write: tokio::net::tcp::OwnedWriteHalf,
    seen: tokio::task::JoinHandle<Vec<(u8, u32)>>,
}

impl Raw {
    async fn connect(addr: &str) -> Raw {
        let stream = TcpStream::connect(addr).await.unwrap();
        let (mut read, mut write) = stream.into_split();
        write.write_all(PREFACE).await.unwrap();
        write.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
        let seen = tokio::spawn(async move {
            let mut frames = Vec::new();
            let mut buffer = BytesMut::new();
            let mut chunk = [0u8; 16 << 10];
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline {
                let read = tokio::time::timeout(Duration::from_millis(500), read.read(&mut chunk));
                match read.await {
                    Ok(Ok(0)) | Ok(Err(_)) => break,
                    Ok(Ok(n)) => buffer.extend_from_slice(&chunk[..n]),
                    Err(_) => {
                        // Quiet: enough seen once the stream was answered.
                        if frames
                            .iter()
                            .any(|(kind, _)| matches!(*kind, HEADERS | RST_STREAM | GOAWAY))
                        {
                            break;
                        }
                        continue;
                    }
                }
                while buffer.len() >= 9 {
                    let len = (usize::from(buffer[0]) << 16)
                        | (usize::from(buffer[1]) << 8)
                        | usize::from(buffer[2]);
                    if buffer.len() < 9 + len {
                        break;
                    }
                    let kind = buffer[3];
                    let stream = u32::from_be_bytes([buffer[5], buffer[6], buffer[7], buffer[8]])
                        & 0x7fff_ffff;
                    frames.push((kind, stream));
                    let _ = buffer.split_to(9 + len);
                }
            }
            frames
        });
        Raw { write, seen }
    }

    /// Writes `bytes`; false once the server has closed the connection.
    async fn send(&mut self, bytes: &[u8]) -> bool {
        self.write.write_all(bytes).await.is_ok()
    }

    /// The kinds and streams of the frames the server sent.
    async fn frames(self) -> Vec<(u8, u32)> {
        drop(self.write);
        self.seen.await.unwrap()
    }
}

/// Sends `block` as stream 1's request headers (HEADERS, then CONTINUATION
/// frames of 16 KiB) and asserts the server refused the stream or ended
/// the connection.
async fn assert_refused(mut raw: Raw, block: &[u8]) {
    let mut pieces = block.chunks(16 << 10).peekable();
    let mut kind = HEADERS;
    let mut flags = END_STREAM;
    let mut all_sent = true;
    while let Some(piece) = pieces.next() {
        if pieces.peek().is_none() {
            flags |= END_HEADERS;
        }
        all_sent = all_sent && raw.send(&frame(kind, flags, 1, piece)).await;
        kind = CONTINUATION;
        flags = 0;
    }
    let frames = raw.frames().await;
    assert!(
        frames.iter().any(|(kind, stream)| {
            matches!(*kind, RST_STREAM | HEADERS) && *stream == 1 || *kind == GOAWAY
        }),
        "the stream was neither refused nor the connection ended: {frames:?} (all sent: {all_sent})"
    );
}

fn resident_bytes() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<usize>()
                .ok()
        })
        .map_or(0, |kib| kib << 10)
}

/// HEADERS without END_HEADERS, then CONTINUATION frames without end (64
/// MiB if the server let them all in): the server must cut the connection
/// early and never buffer the block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuation_flood_is_cut_off() {
    common::register();
    let server = common::rdma_server().await;
    let before = resident_bytes();
    let mut raw = Raw::connect(&server.addr).await;
    let block = request_block(&server.addr, |_| {});
    assert!(raw.send(&frame(HEADERS, 0, 1, &block)).await);
    let mut filler = BytesMut::new();
    for index in 0..16 {
        literal(
            &mut filler,
            &format!("x-flood-{index}"),
            &[b'a'; 1000],
            false,
        );
    }
    let continuation = frame(CONTINUATION, 0, 1, &filler);
    let mut sent = 0usize;
    while sent < 64 << 20 {
        if !raw.send(&continuation).await {
            break;
        }
        sent += continuation.len();
    }
    assert!(
        sent < 64 << 20,
        "the server took 64 MiB of CONTINUATION frames without closing"
    );
    let frames = raw.frames().await;
    assert!(
        frames.iter().any(|(kind, _)| *kind == GOAWAY),
        "no GOAWAY: {frames:?}"
    );
    assert!(
        resident_bytes() < before + (16 << 20),
        "the process grew by {} bytes",
        resident_bytes().saturating_sub(before)
    );
    common::still_answers(&server).await;
}

/// One header of 1 MiB (the limit is 16 KiB of header list): the stream is
/// refused and no handler runs; the connection goes on or closes cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_list_over_the_limit_is_refused() {
    common::register();
    let server = common::rdma_server().await;
    let stats = server.stats.clone().unwrap();
    let received = stats.frames_received();
    let raw = Raw::connect(&server.addr).await;
    let block = request_block(&server.addr, |block| {
        literal(block, "x-huge", &vec![b'h'; 1 << 20], false);
    });
    // In frames of 16 KiB, the server's (and HTTP/2's default) frame size.
    assert_refused(raw, &block).await;
    assert_eq!(
        stats.frames_received(),
        received,
        "nothing of it reached rpc-core"
    );
    common::still_answers(&server).await;
}

/// An HPACK bomb: a 4 KiB header enters the dynamic table, then 4,000
/// one-byte references to it would decode to 16 MB of headers. The
/// decoded list is bounded (16 KiB), so the stream is refused early.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_hpack_bomb_is_refused_without_decoding_it_all() {
    common::register();
    let server = common::rdma_server().await;
    let stats = server.stats.clone().unwrap();
    let received = stats.frames_received();
    let before = resident_bytes();
    let raw = Raw::connect(&server.addr).await;
    let block = request_block(&server.addr, |block| {
        literal(block, "x-bomb", &[b'b'; 4000], true);
        for _ in 0..4000 {
            // Indexed field 62: the newest dynamic table entry.
            hpack_int(block, 0x80, 7, 62);
        }
    });
    assert_refused(raw, &block).await;
    assert_eq!(stats.frames_received(), received, "no call was opened");
    assert!(
        resident_bytes() < before + (8 << 20),
        "the process grew by {} bytes",
        resident_bytes().saturating_sub(before)
    );
    common::still_answers(&server).await;
}
