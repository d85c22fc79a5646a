//! A peer that speaks the set-up protocol by hand with an absurd hello
//! (2^32 − 1 receive slots of 2^32 − 1 bytes, frames up to 2^64 − 1 bytes;
//! a 4 GiB address) is refused before its QP is connected, the server says
//! why, and the server's other clients notice nothing.
//!
//! Its own test binary: it captures the process's log to read the reason.

#[path = "../../rpc-core/tests/suite/mod.rs"]
mod suite;

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use rpc_core::Channel;
use rpc_transport_rdma::protocol::{GEOMETRY_LEN, Geometry};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::{RdmaBed, echo};
use crate::suite::{assert_echoes, pattern, start};

/// Everything logged in this process (at debug level and above).
fn log() -> Arc<Mutex<Vec<u8>>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Arc::new(Mutex::new(Vec::new()));
        let writer = log.clone();
        tracing_subscriber::fmt()
            .with_env_filter("debug")
            .with_ansi(false)
            .with_writer(move || Captured(writer.clone()))
            .init();
        log
    })
    .clone()
}

struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Waits up to five seconds for `text` to appear in the log.
async fn assert_logged(log: &Mutex<Vec<u8>>, text: &str) {
    for _ in 0..500 {
        if String::from_utf8_lossy(&log.lock().unwrap()).contains(text) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "the server did not log {text:?}; its log:\n{}",
        String::from_utf8_lossy(&log.lock().unwrap())
    );
}

/// The parts of a set-up hello body (after its `len: u32`), as `setup.rs`
/// documents them.
struct RawHello<'a> {
    provider: &'a [u8],
    address: &'a [u8],
    payload: &'a [u8],
}

/// Splits a hello body into its parts.
fn parse(body: &[u8]) -> RawHello<'_> {
    assert_eq!(&body[..4], b"RRPC");
    let provider_len = body[6] as usize;
    let provider = &body[7..7 + provider_len];
    let at = 7 + provider_len;
    let address_len = u32::from_le_bytes(body[at..at + 4].try_into().unwrap()) as usize;
    let address = &body[at + 4..at + 4 + address_len];
    let at = at + 4 + address_len;
    let payload_len = u32::from_le_bytes(body[at..at + 4].try_into().unwrap()) as usize;
    let payload = &body[at + 4..at + 4 + payload_len];
    assert_eq!(at + 4 + payload_len, body.len());
    RawHello {
        provider,
        address,
        payload,
    }
}

/// A hello body; `address_len` as given, whatever `address` holds.
fn hello_body(provider: &[u8], address_len: u32, address: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut body = b"RRPC".to_vec();
    body.extend_from_slice(&1u16.to_le_bytes());
    body.push(provider.len() as u8);
    body.extend_from_slice(provider);
    body.extend_from_slice(&address_len.to_le_bytes());
    body.extend_from_slice(address);
    body.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    body.extend_from_slice(payload);
    body
}

/// A hello body as this process's own client sends it (the accepting side
/// reads the dialer's hello first, so the attacker starts from a real one):
/// a client dials a listener of ours, which keeps what it says.
async fn template_hello() -> Vec<u8> {
    let listener = tokio::net::TcpListener::bind((crate::common::test_addr(), 0))
        .await
        .unwrap();
    let endpoint: rpc_core::transport::Endpoint =
        format!("rdma://{}", listener.local_addr().unwrap())
            .parse()
            .unwrap();
    let dialer = tokio::spawn(async move { Channel::connect(endpoint).await });
    let (mut stream, _) = listener.accept().await.unwrap();
    let len = stream.read_u32_le().await.unwrap() as usize;
    let mut body = vec![0; len];
    stream.read_exact(&mut body).await.unwrap();
    dialer.abort();
    body
}

/// Speaks the set-up protocol by hand: sends `body` as its hello, reads the
/// server's answer (its hello, or its refusal of a hello it cannot read), and returns what the server does next: the
/// readiness byte, or `None` when it closes the connection instead.
async fn hostile_setup(endpoint: &str, body: Vec<u8>) -> Option<u8> {
    let addr = endpoint.strip_prefix("rdma://").unwrap();
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_u32_le(body.len() as u32).await.unwrap();
    stream.write_all(&body).await.unwrap();
    let answer = async {
        let len = stream.read_u32_le().await.ok()? as usize;
        let mut server = vec![0; len];
        // Its hello, or the refusal it writes for a hello it cannot read.
        stream.read_exact(&mut server).await.ok()?;
        assert_eq!(&server[..4], b"RRPC");
        stream.read_u8().await.ok()
    };
    tokio::time::timeout(Duration::from_secs(5), answer)
        .await
        .expect("the server answers or closes within the set-up time")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absurd_hello_is_refused_with_the_reason_and_other_clients_keep_working() {
    crate::require_device!();
    let log = log();
    let server = start(&RdmaBed).await;
    let endpoint = server.endpoint.to_string();
    let before = Channel::connect(server.endpoint.clone()).await.unwrap();
    assert_echoes(&before, "before").await;

    // A real client's transport hello with the geometry replaced: every
    // other field (version, host, rdma_cm) is one the server accepts.
    let template = template_hello().await;
    let client = parse(&template);
    let absurd = Geometry {
        recv_slots: u32::MAX,
        initial_credits: u32::MAX,
        slot_len: u32::MAX,
        eager_threshold: u32::MAX - 16,
        max_frame_len: u64::MAX,
    };
    let mut payload = client.payload.to_vec();
    payload[1..1 + GEOMETRY_LEN].copy_from_slice(&absurd.encode());
    let body = hello_body(
        client.provider,
        client.address.len() as u32,
        client.address,
        &payload,
    );
    let answer = hostile_setup(&endpoint, body).await;
    assert_eq!(answer, None, "the server must not confirm readiness");
    // Why, in the server's log (the listener's error for that connection).
    assert_logged(
        &log,
        "peer's pools: bad geometry: recv_slots = 4294967295 is outside 3..=65536",
    )
    .await;

    // A hello that claims a 4 GiB address.
    let body = hello_body(client.provider, u32::MAX, client.address, client.payload);
    let answer = hostile_setup(&endpoint, body).await;
    assert_eq!(answer, None);
    assert_logged(&log, "hello: address_len = 4294967295 is outside 0..=1024").await;

    // The client connected before still gets answers, and a new one connects.
    assert_echoes(&before, "after").await;
    let after = Channel::connect(server.endpoint.clone()).await.unwrap();
    let payload = pattern(100_000, 7);
    assert!(echo(&after, payload.clone()).await == payload);
    assert_echoes(&before, "still").await;
}
