//! Round-trip latency of an empty unary call, per transport and runtime flavour.
//!
//! ```text
//! cargo run --release -p rdma-rpc-benches --bin latency -- [--calls N] [--warmup N]
//! ```
//! The server runs on its own runtime thread, the client on another, in one
//! process. Each call is `echo.v1.Echo/Say` with an empty message, one at a
//! time. Prints a markdown table; timings on a shared machine drift, so
//! compare rows of the same run.

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rdma_rpc_examples::EchoService;
use rdma_rpc_examples::echo::{EchoRequest, echo_client::EchoClient, echo_server::EchoServer};
use rpc_core::Server;

#[derive(Clone, Copy, Debug)]
enum Flavor {
    /// Server and client each on a current-thread runtime of its own thread.
    SeparateCurrent,
    /// Server and client each on a 2-worker multi-thread runtime.
    SeparateMulti,
    /// Server and client tasks on one current-thread runtime: no cross-thread
    /// wake-ups, so this is the framework's own cost per call.
    SharedCurrent,
}

impl Flavor {
    fn label(self) -> &'static str {
        match self {
            Flavor::SeparateCurrent => "server, client: current_thread each",
            Flavor::SeparateMulti => "server, client: multi_thread (2 workers) each",
            Flavor::SharedCurrent => "server + client on one current_thread",
        }
    }
}

fn runtime(flavor: Flavor) -> tokio::runtime::Runtime {
    match flavor {
        Flavor::SeparateCurrent | Flavor::SharedCurrent => {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
        }
        Flavor::SeparateMulti => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build(),
    }
    .expect("runtime")
}

struct Row {
    transport: &'static str,
    flavor: Flavor,
    histogram: Histogram<u64>,
    elapsed: Duration,
}

async fn call_loop(
    endpoint: rpc_core::transport::Endpoint,
    warmup: u64,
    calls: u64,
) -> (Histogram<u64>, Duration) {
    let mut client = EchoClient::connect(endpoint).await.expect("connect");
    for _ in 0..warmup {
        client
            .say(EchoRequest::default())
            .await
            .expect("warm-up call");
    }
    let mut histogram = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("histogram");
    let started = Instant::now();
    for _ in 0..calls {
        let call = Instant::now();
        client.say(EchoRequest::default()).await.expect("call");
        histogram
            .record(call.elapsed().as_nanos() as u64)
            .expect("record");
    }
    (histogram, started.elapsed())
}

fn measure_one_thread(listen: &str, transport: &'static str, warmup: u64, calls: u64) -> Row {
    let (histogram, elapsed) = runtime(Flavor::SharedCurrent).block_on(async {
        let listening = Server::builder()
            .add_service(EchoServer::new(EchoService))
            .listen(listen)
            .await
            .expect("bind");
        let endpoint = listening.local_endpoint();
        let server = tokio::spawn(listening.serve());
        let outcome = call_loop(endpoint, warmup, calls).await;
        server.abort();
        outcome
    });
    Row {
        transport,
        flavor: Flavor::SharedCurrent,
        histogram,
        elapsed,
    }
}

fn measure(listen: &str, transport: &'static str, flavor: Flavor, warmup: u64, calls: u64) -> Row {
    if let Flavor::SharedCurrent = flavor {
        return measure_one_thread(listen, transport, warmup, calls);
    }
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let listen = listen.to_owned();
    let server = std::thread::spawn(move || {
        runtime(flavor).block_on(async move {
            let listening = Server::builder()
                .add_service(EchoServer::new(EchoService))
                .listen(listen.as_str())
                .await
                .expect("bind");
            ready_tx
                .send(listening.local_endpoint())
                .expect("report endpoint");
            listening
                .serve_with_shutdown(async {
                    let _ = stop_rx.await;
                })
                .await
                .expect("serve");
        });
    });
    let endpoint = ready_rx.recv().expect("server started");
    let (histogram, elapsed) = runtime(flavor).block_on(call_loop(endpoint, warmup, calls));
    let _ = stop_tx.send(());
    server.join().expect("server thread");
    Row {
        transport,
        flavor,
        histogram,
        elapsed,
    }
}

fn micros(nanos: u64) -> String {
    format!("{:.1}", nanos as f64 / 1000.0)
}

/// Round-trip latency of an empty unary call, per transport and runtime flavour.
///
/// The server runs on its own runtime thread, the client on another, in one
/// process (or both on one current-thread runtime, for the framework's own
/// cost). Each call is `echo.v1.Echo/Say` with an empty message, one at a
/// time, over tcp:// and mem://. Prints a markdown table; timings on a
/// shared machine drift, so compare rows of the same run.
#[derive(Debug, clap::Parser)]
#[command(name = "latency", args_override_self = true)]
struct Cli {
    /// Measured calls per row.
    #[arg(long, value_name = "N", default_value_t = 20_000)]
    calls: u64,
    /// Unmeasured warm-up calls per row, before the measured ones.
    #[arg(long, value_name = "N", default_value_t = 2_000)]
    warmup: u64,
    /// Only the rows whose name (transport, then runtimes) contains TEXT,
    /// e.g. `mem://` or `multi_thread` [default: every row].
    #[arg(long, value_name = "TEXT")]
    only: Option<String>,
}

fn main() {
    let Cli {
        calls,
        warmup,
        only,
    } = clap::Parser::parse();
    let mut rows = Vec::new();
    for flavor in [
        Flavor::SeparateCurrent,
        Flavor::SeparateMulti,
        Flavor::SharedCurrent,
    ] {
        for (listen, transport) in [
            ("tcp://127.0.0.1:0", "tcp://"),
            ("mem://latency-bench", "mem://"),
        ] {
            let row_name = format!("{transport} {}", flavor.label());
            if only
                .as_ref()
                .is_some_and(|only| !row_name.contains(only.as_str()))
            {
                continue;
            }
            eprintln!(
                "measuring {transport}, {} ({calls} calls)...",
                flavor.label()
            );
            rows.push(measure(listen, transport, flavor, warmup, calls));
        }
    }
    println!("Empty unary call, one in flight, {calls} calls after {warmup} warm-up (µs):\n");
    println!("| transport | runtimes | p50 | p99 | p99.9 | mean | calls/s |");
    println!("|---|---|---|---|---|---|---|");
    for row in rows {
        let h = &row.histogram;
        println!(
            "| {} | {} | {} | {} | {} | {:.1} | {:.0} |",
            row.transport,
            row.flavor.label(),
            micros(h.value_at_quantile(0.5)),
            micros(h.value_at_quantile(0.99)),
            micros(h.value_at_quantile(0.999)),
            h.mean() / 1000.0,
            h.len() as f64 / row.elapsed.as_secs_f64()
        );
    }
}
