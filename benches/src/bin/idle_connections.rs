//! What idle connections cost a server, and how many it holds.
//!
//! ```text
//! cargo run --release -p rdma-rpc-benches --bin idle_connections -- rdma 1000
//! cargo run --release -p rdma-rpc-benches --bin idle_connections -- tcp 10000
//! ```
//! Starts an echo server in a child process (this binary again, with
//! `--serve`), opens N connections to it from this process, makes one call
//! on each, and prints the server's resident memory, threads and file
//! descriptors before and with the connections held, and per connection.
//! Raise `ulimit -n` first for thousands of connections (both processes
//! need one descriptor per connection, the soft provider several).

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use rdma_rpc_benches::contenders::spawn_server;
use rdma_rpc_examples::echo::{EchoRequest, echo_client::EchoClient};
use rpc_core::Channel;

/// The server's gauges from /proc.
#[derive(Debug, Clone, Copy)]
struct Gauges {
    rss_kib: u64,
    threads: u64,
    fds: u64,
}

fn gauges(pid: u32) -> Gauges {
    let field = |name: &str| rdma_rpc_benches::stats::proc_status_field(&pid.to_string(), name);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |dir| dir.count() as u64);
    Gauges {
        rss_kib: field("VmRSS:"),
        threads: field("Threads:"),
        fds,
    }
}

fn serve(scheme: &str) {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(rdma_rpc_benches::contenders::serve_many_connections(scheme));
}

/// What idle connections cost a server, and how many it holds.
///
/// Starts an echo server in a child process (this binary again, with
/// `--serve`), opens COUNT connections to it from this process, makes one
/// call on each, and prints the server's resident memory, threads and file
/// descriptors before and with the connections held, and per connection.
/// Raise `ulimit -n` first for thousands of connections (both processes
/// need one descriptor per connection, the soft provider several). Without
/// both arguments, prints this help.
#[derive(Debug, clap::Parser)]
#[command(name = "idle_connections", args_override_self = true)]
struct Cli {
    /// The transport the connections use.
    #[arg(value_name = "SCHEME", value_parser = ["rdma", "tcp"])]
    scheme: Option<String>,
    /// How many connections to open and hold.
    #[arg(value_name = "COUNT")]
    count: Option<usize>,
    /// Internal: serve echo on SCHEME://127.0.0.1:0 and print `LISTENING
    /// <endpoint>` (the server process this binary starts).
    #[arg(long, value_name = "SCHEME", hide = true, exclusive = true)]
    serve: Option<String>,
}

fn main() {
    let cli = <Cli as clap::Parser>::parse();
    if let Some(scheme) = cli.serve {
        serve(&scheme);
        return;
    }
    let (Some(scheme), Some(count)) = (cli.scheme, cli.count) else {
        <Cli as clap::CommandFactory>::command()
            .print_help()
            .expect("print help");
        return;
    };
    let (server, endpoint) = spawn_server(&scheme, "adaptive");
    let pid = server.id();
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async move {
        rpc_transport_rdma::register().expect("rdma");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let before = gauges(pid);
        let started = Instant::now();
        let mut held = Vec::with_capacity(count);
        let mut errors = 0usize;
        let mut first_error = None;
        for _ in 0..count {
            let connected = async {
                let channel = Channel::builder(endpoint.parse()?)
                    .no_keepalive()
                    .connect()
                    .await?;
                let mut client = EchoClient::new(channel.clone());
                client
                    .say(EchoRequest {
                        message: "hi".into(),
                        payload: Default::default(),
                    })
                    .await?;
                Ok::<_, Box<dyn std::error::Error>>(channel)
            };
            match connected.await {
                Ok(channel) => held.push(channel),
                Err(error) => {
                    errors += 1;
                    first_error.get_or_insert_with(|| error.to_string());
                }
            }
        }
        let opened = started.elapsed();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let with = gauges(pid);
        let n = held.len().max(1) as f64;
        println!(
            "| {scheme}:// idle connections | {} held, {errors} errors, opened in {:.1} s |",
            held.len(),
            opened.as_secs_f64()
        );
        if let Some(error) = first_error {
            println!("first error: {error}");
        }
        println!("| server | before | with the connections | per connection |");
        println!("|---|---|---|---|");
        println!(
            "| RSS | {:.1} MiB | {:.1} MiB | {:.1} KiB |",
            before.rss_kib as f64 / 1024.0,
            with.rss_kib as f64 / 1024.0,
            (with.rss_kib as f64 - before.rss_kib as f64) / n
        );
        println!(
            "| threads | {} | {} | {:.2} |",
            before.threads,
            with.threads,
            (with.threads as f64 - before.threads as f64) / n
        );
        println!(
            "| fds | {} | {} | {:.2} |",
            before.fds,
            with.fds,
            (with.fds as f64 - before.fds as f64) / n
        );
        drop(held);
    });
    drop(server);
}
