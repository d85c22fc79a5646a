//! CPU per message and per call of rdma-rpc's `grpc://` server against
//! tonic's, both called by tonic's client: the server's own CPU time (and
//! the client's) over one workload, in alternated rounds.
//!
//! Throughput on a shared 2-core machine swings between runs; the CPU a
//! server spends per message swings much less, and is what a server change
//! moves. `compare` gives the throughput rows; this gives their cost.
//!
//! ```sh
//! cargo run --release -p rdma-rpc-benches --bin grpc_cpu -- --workload flood
//! cargo run --release -p rdma-rpc-benches --bin grpc_cpu -- --workload unary --in-flight 128 --multi-thread
//! ```
//!
//! `--client rdma-rpc` calls both servers with rdma-rpc's `Channel` over
//! `grpc://` instead: the cost of rdma-rpc's gRPC client beside tonic's
//! (`--client tonic`, the default), on the same servers.

use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use rdma_rpc_benches::contenders::{self, Client, Contender};
use rdma_rpc_benches::stats::ProcessCounters;
use rdma_rpc_benches::streams::StreamClient;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Workload {
    /// 64 B messages on one server stream.
    Flood,
    /// 64 B messages echoed on one bidirectional stream.
    Bidi,
    /// 64 B unary calls, `--in-flight` at a time.
    Unary,
    /// 64 B unary calls one at a time from the runtime's `block_on` (as a
    /// `#[tokio::main]` body calls; `compare`'s latency rows), with their
    /// p50 and p99.
    Latency,
}

/// Which gRPC client calls the servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum GrpcClient {
    /// tonic's generated client.
    Tonic,
    /// rdma-rpc's generated client on a `grpc://` Channel.
    RdmaRpc,
}

/// CPU per message or call of the grpc:// and tonic servers (tonic's client).
#[derive(Debug, Parser)]
struct Cli {
    /// What to run.
    #[arg(long, value_enum, default_value = "flood")]
    workload: Workload,
    /// Messages per round (streams), or calls per round (unary).
    #[arg(long, default_value_t = 1_000_000)]
    count: u64,
    /// Unary calls outstanding at once.
    #[arg(long, default_value_t = 128)]
    in_flight: u64,
    /// Rounds; each runs both servers, one after the other.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// The client calling both servers.
    #[arg(long, value_enum, default_value = "tonic")]
    client: GrpcClient,
    /// Multi-thread runtimes (2 workers) in both processes.
    #[arg(long)]
    multi_thread: bool,
    /// Count the servers' instructions instead of timing them: each server
    /// runs under valgrind's callgrind (slow: use counts in the tens of
    /// thousands), collecting over the measured run only; prints
    /// instructions per message or call.
    #[arg(long)]
    instructions: bool,
    /// The server process (internal).
    #[arg(long, hide = true)]
    serve: Option<String>,
}

fn main() {
    let cli = Cli::parse();
    if let Some(key) = &cli.serve {
        contenders::serve(Contender::from_key(key).expect("a contender's key"));
        return;
    }
    if cli.multi_thread {
        contenders::use_multi_thread_runtimes();
    }
    rpc_grpc::register();
    println!(
        "{:?}, {} runtimes, {} client calling; CPU of each whole process per {}",
        cli.workload,
        if cli.multi_thread {
            "multi-thread"
        } else {
            "current-thread"
        },
        match cli.client {
            GrpcClient::Tonic => "tonic's",
            GrpcClient::RdmaRpc => "rdma-rpc's grpc://",
        },
        if cli.workload == Workload::Unary {
            "call"
        } else {
            "message"
        }
    );
    for round in 1..=cli.rounds {
        for contender in [Contender::RpcGrpc, Contender::Tonic] {
            let (server, addr) = if cli.instructions {
                let out = format!(
                    "--callgrind-out-file={}/callgrind.%p",
                    callgrind_dir().display()
                );
                let wrapper = ["valgrind", "--tool=callgrind", "--instr-atstart=no", &out];
                contenders::spawn_server_under(&wrapper, contender.key(), contender.poll_mode())
            } else {
                contenders::spawn_server(contender.key(), contender.poll_mode())
            };
            let measured = contenders::runtime().block_on(measure(&cli, &addr, &server));
            if cli.instructions {
                let instructions = server_instructions(&server);
                println!(
                    "round {round} {:<32} server {:>10.0} instructions per {}",
                    server_label(contender),
                    instructions as f64 / measured.0 as f64,
                    if cli.workload == Workload::Unary || cli.workload == Workload::Latency {
                        "call"
                    } else {
                        "message"
                    }
                );
                continue;
            }
            let (count, elapsed, server_cpu, client_cpu, latency) = measured;
            let per = |cpu: Duration| cpu.as_nanos() as f64 / count as f64;
            let latency = latency
                .map(|h| {
                    format!(
                        "   p50 {:>6.1} µs   p99 {:>6.1} µs",
                        h.value_at_quantile(0.5) as f64 / 1e3,
                        h.value_at_quantile(0.99) as f64 / 1e3
                    )
                })
                .unwrap_or_default();
            println!(
                "round {round} {:<32} {:>10.0} /s   server {:>8.1} ns   client {:>8.1} ns{latency}",
                server_label(contender),
                count as f64 / elapsed.as_secs_f64(),
                per(server_cpu),
                per(client_cpu),
            );
        }
    }
}

/// The server's name in the rows (whichever client calls it).
fn server_label(contender: Contender) -> &'static str {
    match contender {
        Contender::RpcGrpc => "rdma-rpc grpc:// server",
        _ => "tonic server",
    }
}

/// What one workload measured: (messages or calls, time, server CPU, client
/// CPU, each call's latency where the workload times calls).
type Measured = (
    u64,
    Duration,
    Duration,
    Duration,
    Option<hdrhistogram::Histogram<u64>>,
);

/// One workload against the server at `addr`, after a warm-up of a tenth
/// of it.
async fn measure(cli: &Cli, addr: &str, server: &contenders::ServerProcess) -> Measured {
    let client = match cli.client {
        GrpcClient::Tonic => Client::connect_tonic(addr).await,
        GrpcClient::RdmaRpc => Client::connect_grpc(addr).await,
    };
    let latencies =
        std::cell::RefCell::new(hdrhistogram::Histogram::<u64>::new(3).expect("a histogram"));
    let run = |count: u64| {
        let client = client.clone();
        let latencies = &latencies;
        async move {
            match cli.workload {
                Workload::Latency => {
                    let mut client = client;
                    let payload = bytes::Bytes::from_static(&[7u8; 64]);
                    let mut timed = hdrhistogram::Histogram::<u64>::new(3).expect("a histogram");
                    for _ in 0..count {
                        let started = Instant::now();
                        client.say(&payload).await;
                        timed
                            .record(started.elapsed().as_nanos() as u64)
                            .expect("a latency in range");
                    }
                    *latencies.borrow_mut() = timed;
                }
                Workload::Flood | Workload::Bidi => {
                    let mut streams: StreamClient = client.streams().expect("a streams client");
                    let got = if cli.workload == Workload::Flood {
                        streams.flood(count).await
                    } else {
                        streams.pipe(count).await
                    };
                    assert_eq!(got, count, "every message arrives");
                }
                Workload::Unary => unary(&client, count, cli.in_flight).await,
            }
        }
    };
    run((cli.count / 10).max(1)).await;
    if cli.instructions {
        callgrind_control(&["--instr=on"], server);
    }
    // Under callgrind the server reads no counters (rustix's vDSO lookup
    // faults under valgrind): its CPU time is not what is measured there.
    let server_cpu = || {
        if cli.instructions {
            Duration::ZERO
        } else {
            server.counters().expect("server counters").cpu
        }
    };
    let server_before = server_cpu();
    let client_before = ProcessCounters::now();
    let started = Instant::now();
    run(cli.count).await;
    let elapsed = started.elapsed();
    if cli.instructions {
        callgrind_control(&["--instr=off"], server);
    }
    let server_after = server_cpu();
    let client_after = ProcessCounters::now();
    (
        cli.count,
        elapsed,
        server_after - server_before,
        client_after.cpu - client_before.cpu,
        (cli.workload == Workload::Latency).then(|| latencies.into_inner()),
    )
}

/// `count` 64 B calls, `in_flight` at a time.
async fn unary(client: &Client, count: u64, in_flight: u64) {
    let payload = bytes::Bytes::from_static(&[7u8; 64]);
    let mut workers = tokio::task::JoinSet::new();
    for worker in 0..in_flight {
        let mut client = client.clone();
        let payload = payload.clone();
        let calls = count / in_flight + u64::from(worker < count % in_flight);
        workers.spawn(async move {
            for _ in 0..calls {
                client.say(&payload).await;
            }
        });
    }
    workers.join_all().await;
}

/// Where this run's callgrind outputs go:
/// `target/bench-results/callgrind-<this process's id>/`, emptied when
/// this run first asks for it (so an earlier run's dumps never count).
fn callgrind_dir() -> &'static std::path::Path {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../target/bench-results")
            .join(format!("callgrind-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("target/bench-results/callgrind-<pid>");
        dir
    })
}

/// Runs `callgrind_control` with `args` against the server (under
/// callgrind).
fn callgrind_control(args: &[&str], server: &contenders::ServerProcess) {
    let status = std::process::Command::new("callgrind_control")
        .args(args)
        .arg(server.id().to_string())
        .stdout(std::process::Stdio::null())
        .status()
        .expect("callgrind_control (valgrind) installed");
    assert!(status.success(), "callgrind_control {args:?}: {status}");
}

/// The instructions the server (under callgrind) executed while collection
/// was on: the `totals:` lines of its dumps (`callgrind.<pid>.<n>`).
fn server_instructions(server: &contenders::ServerProcess) -> u64 {
    callgrind_control(&["--dump"], server);
    let output = format!("callgrind.{}", server.id());
    let mut total = 0;
    for entry in std::fs::read_dir(callgrind_dir()).expect("the callgrind directory") {
        let path = entry.expect("an entry").path();
        let name = path
            .file_name()
            .and_then(|name| name.to_str())
            .unwrap_or("");
        let ours = name == output
            || name
                .strip_prefix(&output)
                .is_some_and(|rest| rest.starts_with('.'));
        if !ours {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("a callgrind dump");
        total += text
            .lines()
            .find_map(|line| line.strip_prefix("totals: "))
            .and_then(|count| count.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0);
    }
    // callgrind_control exits 0 even when it found no such process.
    assert!(
        total > 0,
        "no instructions in a callgrind dump of server {} in {}",
        server.id(),
        callgrind_dir().display()
    );
    total
}
