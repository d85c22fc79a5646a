//! tcp:// against rdma:// (soft provider), server and client in two processes.
//!
//! ```text
//! cargo run --release -p rdma-rpc-benches --bin transports -- [--calls N] [--seconds S] [--large N]
//! ```
//! For each contender, this binary starts itself as a server process
//! (`--serve ENDPOINT`), connects, and measures, over one connection, with
//! a raw-bytes echo service (no protobuf copies, so the transport shows):
//!
//! - latency of a 64-byte echo, one call in flight (p50, p99);
//! - throughput of 64-byte echoes with 128 in flight (calls/s);
//! - goodput of a 64 MiB echo (bytes moved both ways / time, GB/s).
//!
//! Both processes run a current-thread tokio runtime. The rdma:// rows run
//! in the default adaptive polling mode and in busy-poll mode (`RDMA_POLL`
//! is passed to the server too). Prints a markdown table; compare rows of
//! the same run, as absolute times drift on a shared machine.

#![forbid(unsafe_code)]

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdma_rpc_benches::contenders::spawn_server;
use rdma_rpc_benches::stats::{gbps, histogram, p50_p99, record};
use rpc_core::server::NamedService;
use rpc_core::{Channel, Request, Response, Server, Status};

/// `/bench.Raw/Echo`: returns the request's bytes.
#[derive(Clone, Copy)]
struct RawEcho;

impl NamedService for RawEcho {
    const NAME: &'static str = "bench.Raw";
}

impl tower::Service<Request<Bytes>> for RawEcho {
    type Response = Response<Bytes>;
    type Error = Status;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Bytes>, Status>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Bytes>) -> Self::Future {
        Box::pin(async move { Ok(Response::new(request.into_inner())) })
    }
}

const LARGE: usize = 64 << 20;
const FRAME_LIMIT: usize = LARGE + (1 << 20);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn serve(listen: &str) {
    rpc_transport_rdma::register().expect("RDMA settings");
    runtime().block_on(async {
        let listening = Server::builder()
            .max_frame_len(FRAME_LIMIT)
            .add_service(RawEcho)
            .listen(listen)
            .await
            .expect("bind");
        println!("LISTENING {}", listening.local_endpoint());
        listening.serve().await.expect("serve");
    });
}

fn echo(payload: Bytes) -> Request<Bytes> {
    let mut request = Request::new(payload);
    request.set_method("/bench.Raw/Echo");
    request
}

struct Measured {
    p50: f64,
    p99: f64,
    calls_per_second: f64,
    goodput: f64,
}

async fn measure(endpoint: &str, calls: u64, seconds: f64, large_rounds: u32) -> Measured {
    let channel = Channel::builder(endpoint.parse().expect("endpoint"))
        .max_frame_len(FRAME_LIMIT)
        .connect()
        .await
        .expect("connect");
    let small = Bytes::from(vec![7u8; 64]);
    for _ in 0..calls / 10 {
        channel.unary(echo(small.clone())).await.expect("warm-up");
    }
    let mut latencies = histogram();
    for _ in 0..calls {
        let started = Instant::now();
        channel.unary(echo(small.clone())).await.expect("call");
        record(&mut latencies, started.elapsed());
    }
    let (p50, p99) = p50_p99(&latencies);

    // 128 in flight for `seconds`.
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..128 {
        let channel = channel.clone();
        let small = small.clone();
        workers.spawn(async move {
            let mut done = 0u64;
            while Instant::now() < deadline {
                channel.unary(echo(small.clone())).await.expect("call");
                done += 1;
            }
            done
        });
    }
    let mut total = 0;
    while let Some(done) = workers.join_next().await {
        total += done.expect("worker");
    }
    let calls_per_second = total as f64 / started.elapsed().as_secs_f64();

    let large = Bytes::from(vec![3u8; LARGE]);
    channel.unary(echo(large.clone())).await.expect("warm-up");
    let started = Instant::now();
    for _ in 0..large_rounds {
        let back = channel.unary(echo(large.clone())).await.expect("large");
        assert_eq!(back.get_ref().len(), LARGE);
    }
    let goodput = gbps(
        2 * LARGE as u64 * u64::from(large_rounds),
        started.elapsed(),
    );
    Measured {
        p50,
        p99,
        calls_per_second,
        goodput,
    }
}

/// tcp:// against rdma:// (soft provider), server and client in two processes.
///
/// For each contender, this binary starts itself as a server process
/// (`--serve ENDPOINT`), connects, and measures over one connection, with a
/// raw-bytes echo service: latency of a 64-byte echo, one call in flight
/// (p50, p99); throughput of 64-byte echoes with 128 in flight (calls/s);
/// goodput of a 64 MiB echo (GB/s both ways). Both processes run a
/// current-thread tokio runtime; the rdma:// rows run in adaptive,
/// busy-poll and event-only polling modes. Prints a markdown table; compare
/// rows of the same run.
#[derive(Debug, clap::Parser)]
#[command(name = "transports", args_override_self = true)]
struct Cli {
    /// Sequential 64 B echoes for the latency row (after a tenth as many to
    /// warm up).
    #[arg(long, value_name = "N", default_value_t = 20_000)]
    calls: u64,
    /// Seconds of 64 B echoes with 128 in flight, for calls/s.
    #[arg(long, value_name = "S", default_value_t = 3.0, value_parser = parse_seconds)]
    seconds: f64,
    /// 64 MiB echoes for the goodput row (after one to warm up).
    #[arg(long, value_name = "N", default_value_t = 8)]
    large: u32,
    /// Internal: serve the raw echo on ENDPOINT and print `LISTENING
    /// <endpoint>` (the server process this binary starts).
    #[arg(long, value_name = "ENDPOINT", hide = true)]
    serve: Option<String>,
}

/// A duration in seconds: a finite number, not negative.
fn parse_seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(seconds) if seconds.is_finite() && seconds >= 0.0 => Ok(seconds),
        Ok(_) => Err("must be a finite number of seconds, not negative".to_owned()),
        Err(error) => Err(error.to_string()),
    }
}

fn main() {
    let cli = <Cli as clap::Parser>::parse();
    if let Some(listen) = cli.serve {
        return serve(&listen);
    }
    let (calls, seconds, large_rounds) = (cli.calls, cli.seconds, cli.large);
    let contenders = [
        ("tcp://", "tcp://127.0.0.1:0", "adaptive"),
        (
            "rdma:// (soft, adaptive spin)",
            "rdma://127.0.0.1:0",
            "adaptive",
        ),
        ("rdma:// (soft, busy-poll)", "rdma://127.0.0.1:0", "busy"),
        ("rdma:// (soft, event only)", "rdma://127.0.0.1:0", "event"),
    ];
    let mut rows = Vec::new();
    for (name, listen, poll) in contenders {
        eprintln!("measuring {name}...");
        let (server, endpoint) = spawn_server(listen, poll);
        let config = rpc_transport_rdma::RdmaConfig {
            poll_mode: rpc_transport_rdma::PollMode::parse(poll).expect("poll mode"),
            ..rpc_transport_rdma::RdmaConfig::from_env().expect("RDMA settings")
        };
        rpc_transport_rdma::register_with(config).expect("register");
        let measured = runtime().block_on(measure(&endpoint, calls, seconds, large_rounds));
        drop(server);
        rows.push((name, measured));
    }
    let tcp_p50 = rows[0].1.p50;
    let tcp_rate = rows[0].1.calls_per_second;
    let tcp_goodput = rows[0].1.goodput;
    println!(
        "Two processes, one connection, current-thread runtimes; {calls} sequential 64 B echoes, \
         128 in flight for {seconds} s, {large_rounds} × 64 MiB echoes. Ratios to tcp:// in brackets.\n"
    );
    println!("| transport | 64 B p50 µs | 64 B p99 µs | 64 B calls/s @128 | 64 MiB echo GB/s |");
    println!("|---|---|---|---|---|");
    for (name, m) in rows {
        println!(
            "| {name} | {:.1} ({:.2}×) | {:.1} | {:.0} ({:.2}×) | {:.2} ({:.2}×) |",
            m.p50,
            m.p50 / tcp_p50,
            m.p99,
            m.calls_per_second,
            m.calls_per_second / tcp_rate,
            m.goodput,
            m.goodput / tcp_goodput
        );
    }
}
