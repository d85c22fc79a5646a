//! A long run over rdma:// that must leave nothing behind: N echo calls,
//! 128 in flight, sizes mixed from 64 B to 1 MiB, through the generated
//! client, against a server in its own process.
//!
//! ```text
//! cargo run --release -p rdma-rpc-benches --bin soak -- [--calls 10000000] [--in-flight 128]
//! ```
//! Prints errors (goal 0), the resident memory of both processes after the
//! warm-up and at the end (growth under 5%), this process's registered bytes
//! and registrations (flat) and both processes' threads (flat). Exits
//! non-zero on an error or a thread more: those hold at any length. The
//! memory goals are judged over the full run: pools grow to the high-water
//! mark of large frames in flight (bounded by their caps), which a short run
//! (CI runs 100,000 calls) may still be climbing.

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use bytes::Bytes;
use rdma_rpc_benches::contenders::{self, Contender};
use rdma_rpc_benches::stats::proc_status_field;
use rdma_rpc_examples::echo::{EchoRequest, echo_client::EchoClient};
use rpc_transport_rdma::verbs;
use tokio::task::JoinSet;

/// Payload sizes, cycled: eager and rendezvous, small to 1 MiB.
const SIZES: [usize; 7] = [64, 700, 4 << 10, 8 << 10, 64 << 10, 256 << 10, 1 << 20];

/// Resident memory and threads of one process, from `/proc/<pid>/status`.
#[derive(Debug, Clone, Copy)]
struct Footprint {
    rss_kib: u64,
    threads: u64,
}

fn footprint(pid: &str) -> Footprint {
    Footprint {
        rss_kib: proc_status_field(pid, "VmRSS:"),
        threads: proc_status_field(pid, "Threads:"),
    }
}

/// What the client process holds registered, settled (a call returns
/// before the peer has revoked the window of its response).
async fn settled_registered() -> (u64, u64) {
    let mut last = (verbs::registered_bytes(), verbs::registrations());
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = (verbs::registered_bytes(), verbs::registrations());
        if now == last {
            return now;
        }
        last = now;
    }
    last
}

/// Runs `calls` echoes with `in_flight` outstanding; returns the errors.
async fn run(
    client: &EchoClient<rpc_core::Channel>,
    first: u64,
    calls: u64,
    in_flight: usize,
) -> u64 {
    let payloads: Vec<Bytes> = SIZES
        .iter()
        .map(|&size| Bytes::from((0..size).map(|i| i as u8).collect::<Vec<u8>>()))
        .collect();
    let mut errors = 0;
    let mut tasks: JoinSet<bool> = JoinSet::new();
    for call in first..first + calls {
        while tasks.len() >= in_flight {
            if !tasks.join_next().await.expect("a task").expect("no panic") {
                errors += 1;
            }
        }
        let payload = payloads[call as usize % payloads.len()].clone();
        let mut client = client.clone();
        tasks.spawn(async move {
            let request = EchoRequest {
                message: String::new(),
                payload: payload.clone(),
            };
            match client.say(request).await {
                Ok(reply) => reply.into_inner().payload == payload,
                Err(status) => {
                    eprintln!("call failed: {status}");
                    false
                }
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        if !done.expect("no panic") {
            errors += 1;
        }
    }
    errors
}

/// A long run over rdma:// that must leave nothing behind.
///
/// N echo calls, sizes mixed from 64 B to 1 MiB, through the generated
/// client, against a server in its own process (this binary again, with
/// `--serve`), after a warm-up of N/20 calls (at least 30,000). Prints
/// errors (goal 0), the resident memory of both processes after the warm-up
/// and at the end (growth under 5%), this process's registered bytes and
/// registrations (flat) and both processes' threads (flat). Exits non-zero
/// on an error or a thread more.
#[derive(Debug, clap::Parser)]
#[command(name = "soak", args_override_self = true)]
struct Cli {
    /// Echo calls after the warm-up.
    #[arg(long, value_name = "N", default_value_t = 10_000_000)]
    calls: u64,
    /// Calls in flight (at least 1).
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    in_flight: u32,
    /// Internal: serve CONTENDER and print `LISTENING <address>` (the
    /// server process this binary starts).
    #[arg(long, value_name = "CONTENDER", hide = true)]
    serve: Option<Contender>,
}

fn main() {
    let cli = <Cli as clap::Parser>::parse();
    if let Some(contender) = cli.serve {
        contenders::serve(contender);
        return;
    }
    let calls = cli.calls;
    let in_flight = cli.in_flight as usize;
    let config = rpc_transport_rdma::RdmaConfig::from_env().expect("RDMA_* settings");
    rpc_transport_rdma::register_with(config).expect("register rdma://");
    let contender = Contender::RdmaAdaptive;
    let (server, addr) = contenders::spawn_server(contender.key(), contender.poll_mode());
    let server_pid = server.id().to_string();
    let warmup = (calls / 20).max(30_000);
    let passed = contenders::runtime().block_on(async move {
        let endpoint: rpc_core::transport::Endpoint =
            format!("rdma://{addr}").parse().expect("endpoint");
        let channel = rpc_core::Channel::builder(endpoint)
            .max_frame_len(4 << 20)
            .connect()
            .await
            .expect("connect");
        let client = EchoClient::new(channel);
        let started = Instant::now();
        let mut errors = run(&client, 0, warmup, in_flight).await;
        let registered = settled_registered().await;
        let (client_warm, server_warm) = (footprint("self"), footprint(&server_pid));
        errors += run(&client, warmup, calls, in_flight).await;
        let elapsed = started.elapsed();
        let registered_end = settled_registered().await;
        let (client_end, server_end) = (footprint("self"), footprint(&server_pid));
        let growth = |warm: Footprint, end: Footprint| {
            (end.rss_kib as f64 - warm.rss_kib as f64) / warm.rss_kib.max(1) as f64 * 100.0
        };
        let rate = (warmup + calls) as f64 / elapsed.as_secs_f64();
        println!(
            "soak: {} calls after {warmup} warm-up, {in_flight} in flight, sizes 64 B-1 MiB over rdma://: {:.1} s, {rate:.0} calls/s\n",
            calls,
            elapsed.as_secs_f64()
        );
        println!("| measure | after warm-up | at the end | goal | |");
        println!("|---|---|---|---|---|");
        let verdict = |ok: bool| if ok { "met" } else { "missed" };
        let passed = errors == 0 && client_end.threads == client_warm.threads
            && server_end.threads == server_warm.threads;
        let line = |name: &str, warm: String, end: String, goal: &str, ok: bool| {
            println!("| {name} | {warm} | {end} | {goal} | {} |", verdict(ok));
        };
        line("errors", "-".into(), errors.to_string(), "0", errors == 0);
        for (name, warm, end) in [
            ("client RSS (KiB)", client_warm, client_end),
            ("server RSS (KiB)", server_warm, server_end),
        ] {
            let grew = growth(warm, end);
            line(
                name,
                warm.rss_kib.to_string(),
                format!("{} ({grew:+.1}%)", end.rss_kib),
                "< +5%",
                grew < 5.0,
            );
        }
        line(
            "client registered bytes",
            registered.0.to_string(),
            registered_end.0.to_string(),
            // Never more; less once the rendezvous pool's timer deregistered
            // buffers idle for `LargePoolConfig::trim_idle_after`.
            "not grown",
            registered_end.0 <= registered.0,
        );
        line(
            "client registrations",
            registered.1.to_string(),
            registered_end.1.to_string(),
            "flat",
            registered_end.1 == registered.1,
        );
        for (name, warm, end) in [
            ("client threads", client_warm, client_end),
            ("server threads", server_warm, server_end),
        ] {
            line(
                name,
                warm.threads.to_string(),
                end.threads.to_string(),
                "flat",
                end.threads == warm.threads,
            );
        }
        passed
    });
    drop(server);
    if !passed {
        std::process::exit(1);
    }
}
