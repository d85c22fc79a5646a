//! Many connections on one server: what each costs it idle and busy, and
//! how latency holds up as they grow.
//!
//! ```text
//! cargo run --release -p rdma-rpc-benches --bin scale -- --connections 10,100,1000 --processes 10
//! cargo run --release -p rdma-rpc-benches --bin scale -- --transports rdma,tcp --connections 100 --processes 100 --in-flight 100
//! ```
//! For each transport and connection count: a fresh echo server in its own
//! process; `--processes` client processes open the connections between
//! them (one call each), wait, then call on every connection in turn with
//! `--in-flight` calls in flight in all, the same for every connection
//! count (so latency shows what more connections cost, not more load),
//! until each connection had `--calls` 64 B calls. Prints the server's
//! threads, resident memory and registered bytes with the connections idle
//! and busy, calls/s, p50/p99 and errors, then the issue's goals. Raise
//! `ulimit -n` first for thousands of connections.

#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use rdma_rpc_benches::stats::proc_status_field;
use rdma_rpc_examples::echo::{EchoRequest, echo_client::EchoClient};
use rpc_core::Channel;

/// The server's gauges: /proc for threads and memory, its own word for
/// registered bytes.
#[derive(Debug, Clone, Copy, Default)]
struct Gauges {
    threads: u64,
    rss_kib: u64,
    registered: u64,
}

/// One measured row.
struct Row {
    transport: String,
    connections: usize,
    base: Gauges,
    idle: Gauges,
    busy: Gauges,
    calls_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    errors: u64,
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// `--serve SCHEME`: the echo server; prints `LISTENING <endpoint>`, then
/// answers each `stats` line on stdin with `STATS <registered bytes>`.
fn serve(scheme: &str) {
    std::thread::spawn(|| {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if line == "stats" {
                println!("STATS {}", rpc_transport_rdma::verbs::registered_bytes());
            }
        }
        // The parent went away.
        std::process::exit(0);
    });
    runtime().block_on(rdma_rpc_benches::contenders::serve_many_connections(scheme));
}

fn request() -> EchoRequest {
    EchoRequest {
        message: "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef".into(),
        payload: Default::default(),
    }
}

/// `--client ENDPOINT CONNECTIONS CALLS CALLERS`: opens the connections
/// (one call each), prints `CONNECTED <errors>`, waits for `go` on stdin,
/// then `CALLERS` tasks call, each on its share of the connections in turn,
/// until every connection had `CALLS` calls; prints
/// `RESULT <errors> <calls> <seconds>` and `LATENCIES <µs> ...`.
fn client(endpoint: &str, connections: usize, calls: usize, callers: usize) {
    runtime().block_on(async {
        rpc_transport_rdma::register().expect("rdma");
        let mut clients = Vec::with_capacity(connections);
        let mut errors = 0u64;
        for _ in 0..connections {
            let opened = async {
                let channel = Channel::builder(endpoint.parse()?)
                    .no_keepalive()
                    .connect()
                    .await?;
                let mut client = EchoClient::new(channel);
                client.say(request()).await?;
                Ok::<_, Box<dyn std::error::Error>>(client)
            };
            match opened.await {
                Ok(client) => clients.push(client),
                Err(error) => {
                    errors += 1;
                    eprintln!("connect: {error}");
                }
            }
        }
        println!("CONNECTED {errors}");
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
        let started = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        let clients = std::sync::Arc::new(clients);
        let callers = callers.clamp(1, clients.len().max(1));
        for caller in 0..callers {
            let clients = clients.clone();
            tasks.spawn(async move {
                // This caller's connections, in turn: every connection gets
                // `calls` calls, with `callers` calls in flight in all.
                let mine: Vec<EchoClient<Channel>> = clients
                    .iter()
                    .skip(caller)
                    .step_by(callers)
                    .cloned()
                    .collect();
                let mut latencies = Vec::with_capacity(calls * mine.len());
                let mut errors = 0u64;
                for _ in 0..calls {
                    for client in &mine {
                        let call = Instant::now();
                        match client.clone().say(request()).await {
                            Ok(_) => latencies.push(call.elapsed().as_micros() as u32),
                            Err(_) => errors += 1,
                        }
                    }
                }
                (latencies, errors)
            });
        }
        let mut latencies = Vec::new();
        while let Some(done) = tasks.join_next().await {
            let (mut some, failed) = done.expect("client task");
            latencies.append(&mut some);
            errors += failed;
        }
        let elapsed = started.elapsed().as_secs_f64();
        println!("RESULT {errors} {} {elapsed}", latencies.len());
        let mut out = String::from("LATENCIES");
        for latency in latencies {
            out.push(' ');
            out.push_str(&latency.to_string());
        }
        println!("{out}");
    });
}

/// A child process speaking the line protocol above.
struct Peer {
    child: Child,
    stdin: ChildStdin,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl Peer {
    fn spawn(args: &[&str]) -> Peer {
        let mut child = Command::new(std::env::current_exe().expect("own path"))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("child process");
        let stdin = child.stdin.take().expect("stdin");
        let lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        Peer {
            child,
            stdin,
            lines,
        }
    }

    /// The next line starting with `prefix`, without it.
    fn expect(&mut self, prefix: &str) -> String {
        for line in self.lines.by_ref() {
            let line = line.expect("child output");
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.trim().to_owned();
            }
        }
        panic!("child exited before printing {prefix}");
    }

    fn say(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("child stdin");
        self.stdin.flush().expect("child stdin");
    }

    fn gauges(&mut self) -> Gauges {
        self.say("stats");
        let registered = self.expect("STATS ").parse().expect("registered bytes");
        let pid = self.child.id().to_string();
        Gauges {
            threads: proc_status_field(&pid, "Threads:"),
            rss_kib: proc_status_field(&pid, "VmRSS:"),
            registered,
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn measure(
    transport: &str,
    connections: usize,
    processes: usize,
    in_flight: usize,
    calls: usize,
) -> Row {
    eprintln!("{transport}:// {connections} connections from {processes} processes");
    let mut server = Peer::spawn(&["--serve", transport]);
    let endpoint = server.expect("LISTENING ");
    std::thread::sleep(Duration::from_millis(300));
    let base = server.gauges();
    let processes = processes.clamp(1, connections.max(1));
    let mut clients: Vec<Peer> = (0..processes)
        .map(|i| {
            let share = connections / processes + usize::from(i < connections % processes);
            let callers = in_flight / processes + usize::from(i < in_flight % processes);
            Peer::spawn(&[
                "--client",
                &endpoint,
                &share.to_string(),
                &calls.to_string(),
                &callers.max(1).to_string(),
            ])
        })
        .collect();
    let mut errors: u64 = clients
        .iter_mut()
        .map(|c| c.expect("CONNECTED ").parse::<u64>().expect("errors"))
        .sum();
    std::thread::sleep(Duration::from_millis(500));
    let idle = server.gauges();
    for client in &mut clients {
        client.say("go");
    }
    // Early, while every connection is still calling.
    std::thread::sleep(Duration::from_millis(20));
    let busy = server.gauges();
    let mut latencies = Vec::new();
    let mut slowest = 0f64;
    let mut total = 0u64;
    for client in &mut clients {
        let result = client.expect("RESULT ");
        let mut fields = result.split_whitespace();
        errors += fields
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(1);
        total += fields
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        slowest = slowest.max(fields.next().and_then(|v| v.parse().ok()).unwrap_or(0.0));
        latencies.extend(
            client
                .expect("LATENCIES")
                .split_whitespace()
                .filter_map(|v| v.parse::<u32>().ok()),
        );
    }
    latencies.sort_unstable();
    let quantile = |q: f64| {
        latencies
            .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
            .map_or(f64::NAN, |v| f64::from(*v))
    };
    Row {
        transport: transport.to_owned(),
        connections,
        base,
        idle,
        busy,
        calls_per_s: total as f64 / slowest.max(1e-9),
        p50_us: quantile(0.5),
        p99_us: quantile(0.99),
        errors,
    }
}

/// Many connections on one server: what each costs it idle and busy, and
/// how latency holds up as they grow.
///
/// For each transport and connection count: a fresh echo server in its own
/// process; `--processes` client processes open the connections between
/// them (one call each), wait, then call on every connection in turn with
/// `--in-flight` calls in flight in all, the same for every connection count
/// (so latency shows what more connections cost, not more load), until each
/// connection had `--calls` 64 B calls. Prints the server's threads,
/// resident memory and registered bytes with the connections idle and busy,
/// calls/s, p50/p99 and errors, then the goals. Raise `ulimit -n` first for
/// thousands of connections.
#[derive(Debug, clap::Parser)]
#[command(name = "scale", args_override_self = true)]
struct Cli {
    /// Transports to measure, comma-separated.
    #[arg(
        long,
        value_name = "SCHEMES",
        value_delimiter = ',',
        action = clap::ArgAction::Set,
        value_parser = ["rdma", "tcp"],
        default_value = "rdma"
    )]
    transports: Vec<String>,
    /// Connection counts to measure, comma-separated, a fresh server each.
    #[arg(
        long,
        value_name = "COUNTS",
        value_delimiter = ',',
        action = clap::ArgAction::Set,
        default_value = "10,100,1000"
    )]
    connections: Vec<usize>,
    /// Client processes the connections are spread over.
    #[arg(long, value_name = "N", default_value_t = 10)]
    processes: usize,
    /// 64 B calls on each connection.
    #[arg(long, value_name = "N", default_value_t = 100)]
    calls: usize,
    /// Calls in flight in all, whatever the connection count.
    #[arg(long, value_name = "N", default_value_t = 10)]
    in_flight: usize,
    /// Internal: the echo server on SCHEME (see `serve`).
    #[arg(long, value_name = "SCHEME", hide = true, exclusive = true)]
    serve: Option<String>,
    /// Internal: a client process (see `client`).
    #[arg(
        long,
        num_args = 4,
        value_names = ["ENDPOINT", "CONNECTIONS", "CALLS", "CALLERS"],
        hide = true,
        exclusive = true
    )]
    client: Option<Vec<String>>,
}

/// Runs [`client`] with the values of `--client ENDPOINT CONNECTIONS CALLS
/// CALLERS`, or exits with clap's error for one that is not a number.
fn run_client(values: &[String]) {
    let number = |index: usize, name: &str| -> usize {
        values[index].parse().unwrap_or_else(|_| {
            <Cli as clap::CommandFactory>::command()
                .error(
                    clap::error::ErrorKind::ValueValidation,
                    format!("--client {name}: '{}' is not a number", values[index]),
                )
                .exit()
        })
    };
    client(
        &values[0],
        number(1, "CONNECTIONS"),
        number(2, "CALLS"),
        number(3, "CALLERS"),
    );
}

fn main() {
    let Cli {
        transports,
        connections,
        processes,
        calls,
        in_flight,
        serve: serve_scheme,
        client: client_values,
    } = clap::Parser::parse();
    if let Some(scheme) = serve_scheme {
        return serve(&scheme);
    }
    if let Some(values) = client_values {
        return run_client(&values);
    }
    let rows: Vec<Row> = transports
        .iter()
        .flat_map(|t| {
            connections
                .iter()
                .map(|&n| measure(t, n, processes, in_flight, calls))
                .collect::<Vec<_>>()
        })
        .collect();
    println!(
        "\n{processes} client processes, {in_flight} calls in flight in all (whatever the connection count), {calls} 64 B calls per connection.\n"
    );
    println!(
        "| transport | connections | server threads (none / idle / busy) | RSS per idle connection (KiB) | registered per connection, idle / busy (KiB) | calls/s | p50 (µs) | p99 (µs) | errors |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for row in &rows {
        let n = row.connections.max(1) as f64;
        let per = |g: Gauges| (g.registered as f64 - row.base.registered as f64) / n / 1024.0;
        println!(
            "| {}:// | {} | {} / {} / {} | {:.1} | {:.1} / {:.1} | {:.0} | {:.0} | {:.0} | {} |",
            row.transport,
            row.connections,
            row.base.threads,
            row.idle.threads,
            row.busy.threads,
            (row.idle.rss_kib as f64 - row.base.rss_kib as f64) / n,
            per(row.idle),
            per(row.busy),
            row.calls_per_s,
            row.p50_us,
            row.p99_us,
            row.errors
        );
    }
    for transport in &transports {
        let mine: Vec<&Row> = rows.iter().filter(|r| &r.transport == transport).collect();
        let (Some(first), Some(last)) = (mine.first(), mine.last()) else {
            continue;
        };
        if mine.len() < 2 {
            continue;
        }
        println!("\nGoals ({transport}://):\n");
        println!("| goal | measured | |");
        println!("|---|---|---|");
        let verdict = |ok: bool| if ok { "met" } else { "missed" };
        let threads_flat = last.busy.threads <= first.busy.threads;
        println!(
            "| server threads independent of connections | {} at {} vs {} at {} | {} |",
            last.busy.threads,
            last.connections,
            first.busy.threads,
            first.connections,
            verdict(threads_flat)
        );
        let per_idle = (last.idle.registered as f64 - last.base.registered as f64)
            / last.connections.max(1) as f64;
        println!(
            "| registered memory per idle connection ≤ 64 KiB | {:.1} KiB | {} |",
            per_idle / 1024.0,
            verdict(per_idle <= 64.0 * 1024.0)
        );
        let errors: u64 = mine.iter().map(|r| r.errors).sum();
        println!("| 0 errors | {errors} | {} |", verdict(errors == 0));
        let ratio = last.p99_us / first.p99_us;
        println!(
            "| p99 at {} ≤ 3× p99 at {} | {ratio:.2}× | {} |",
            last.connections,
            first.connections,
            verdict(ratio <= 3.0)
        );
    }
}
