//! tower layers as users stack them: in a `Server`'s stack, any layer whose
//! error is `Into<BoxError>` composes without a `MapErr` (its errors become
//! a `Status`, as tonic maps them), and a rate limit shared by every
//! connection works behind a `Buffer`; on the client, `DeadlineLayer` is a
//! timeout the server sees.

mod suite;

use std::time::{Duration, Instant};

use bytes::Bytes;
use rpc_core::{Channel, Code, Server};
use tower::buffer::BufferLayer;
use tower::limit::{ConcurrencyLimitLayer, RateLimitLayer};
use tower::load_shed::LoadShedLayer;
use tower::timeout::TimeoutLayer;

use crate::suite::{Event, TcpBed, next_event, probe, start_layered};

/// `LoadShed` over `ConcurrencyLimit` over `Timeout`, no `MapErr`: a call
/// beyond the limit is shed (`ResourceExhausted`), a call past the timeout
/// is `DeadlineExceeded`, others go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_shed_concurrency_limit_and_timeout_compose_without_map_err() {
    let mut server = start_layered(
        &TcpBed,
        Server::builder()
            .layer(LoadShedLayer::new())
            .layer(ConcurrencyLimitLayer::new(1))
            .layer(TimeoutLayer::new(Duration::from_millis(300))),
    )
    .await;
    let channel = Channel::connect(server.endpoint.clone()).await.unwrap();
    let hang = {
        let channel = channel.clone();
        tokio::spawn(async move { channel.unary(probe("Hang", "")).await })
    };
    assert_eq!(
        next_event(&mut server.events, Duration::from_secs(5)).await,
        Event::HangStarted
    );
    let shed = channel.unary(probe("Echo", "x")).await.unwrap_err();
    assert_eq!(shed.code(), Code::ResourceExhausted, "{shed:?}");
    let timed_out = hang.await.unwrap().unwrap_err();
    assert_eq!(timed_out.code(), Code::DeadlineExceeded, "{timed_out:?}");
    let echoed = channel.unary(probe("Echo", "through")).await.unwrap();
    assert_eq!(echoed.into_inner(), Bytes::from_static(b"through"));
}

/// tower's `RateLimit` is one service with one budget; behind a `Buffer`
/// every connection's calls share it: 6 calls at 2 per 400 ms take at least
/// two more periods, and all succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_behind_a_buffer_is_shared_by_all_connections() {
    let period = Duration::from_millis(400);
    let server = start_layered(
        &TcpBed,
        Server::builder()
            .layer(BufferLayer::new(64))
            .layer(RateLimitLayer::new(2, period)),
    )
    .await;
    let started = Instant::now();
    let mut calls = Vec::new();
    for i in 0..6 {
        // Three connections, two calls each.
        let channel = Channel::connect(server.endpoint.clone()).await.unwrap();
        calls.push(tokio::spawn(async move {
            channel.unary(probe("Echo", format!("call {i}"))).await
        }));
    }
    for call in calls {
        call.await.unwrap().expect("rate-limited, not refused");
    }
    assert!(
        started.elapsed() >= 2 * period,
        "6 calls at 2 per {period:?} went through in {:?}",
        started.elapsed()
    );
}

/// A client `DeadlineLayer` is a timeout the server sees: the handler gets
/// the layer's timeout as its request's deadline (less transit), and a
/// handler that outlives it is cut off on both sides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_deadline_layer_is_the_deadline_the_server_sees() {
    use tower::{Layer, ServiceExt};
    let mut server = start_layered(&TcpBed, Server::builder()).await;
    let channel = Channel::connect(server.endpoint.clone()).await.unwrap();
    let layer = rpc_core::client::DeadlineLayer::new(Duration::from_millis(1500));
    let response = layer
        .layer(channel.clone())
        .oneshot(probe("Timeout", "").map(rpc_core::Payload::from))
        .await
        .unwrap();
    let micros = u64::from_le_bytes(response.into_inner()[..8].try_into().unwrap());
    assert!(
        (1_000_000..=1_500_000).contains(&micros),
        "the handler saw a deadline of {micros} µs"
    );
    let status = rpc_core::client::DeadlineLayer::new(Duration::from_millis(200))
        .layer(channel.clone())
        .oneshot(probe("Hang", "").map(rpc_core::Payload::from))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    // The server's handler ended too (its deadline passed, and the
    // abandoned call was cancelled).
    assert_eq!(
        next_event(&mut server.events, Duration::from_secs(5)).await,
        Event::HangStarted
    );
    assert_eq!(
        next_event(&mut server.events, Duration::from_secs(5)).await,
        Event::HangDropped
    );
}

/// `Server::access_log(true)` logs one INFO line per call, with the method,
/// the peer, the code, the latency and the sizes.
#[tokio::test]
async fn the_access_log_has_one_line_per_call() {
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    // A current-thread runtime: the server's tasks log through this default.
    let _guard = tracing::subscriber::set_default(subscriber);
    let server = start_layered(&TcpBed, Server::builder().access_log(true)).await;
    let channel = Channel::connect(server.endpoint.clone()).await.unwrap();
    channel.unary(probe("Echo", "12345")).await.unwrap();
    let failed = channel.unary(probe("Nope", "")).await.unwrap_err();
    assert_eq!(failed.code(), Code::Unimplemented);
    let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let lines: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("rpc_core::access"))
        .collect();
    assert_eq!(lines.len(), 2, "{log}");
    assert!(lines[0].contains("INFO"), "{}", lines[0]);
    for field in [
        "method=/test.Probe/Echo",
        "code=Ok",
        "request_bytes=5",
        "response_bytes=5",
        "latency_us=",
        "peer=",
    ] {
        assert!(lines[0].contains(field), "{field} missing: {}", lines[0]);
    }
    assert!(lines[1].contains("method=/test.Probe/Nope"), "{}", lines[1]);
    assert!(lines[1].contains("code=Unimplemented"), "{}", lines[1]);
}
