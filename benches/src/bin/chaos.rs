//! Calls over rdma:// while the soft provider fails on purpose (its seeded
//! fault injector, `docs/faults.md`) and client processes are killed,
//! checking what must hold whatever fails: every call (unary, and the three
//! stream kinds) ends with its own answer or an error status, within its
//! deadline and a bound; once every connection has closed, what they held
//! of the device is back (the accounting counters); the server keeps
//! serving new connections; its threads and memory stay flat.
//!
//! ```text
//! cargo run --release -p rdma-rpc-benches --bin chaos -- [--seed S] [--seconds 60]
//! ```
//! The server and the client each run in a process of their own with
//! `RDMA_SOFT_FAULTS` set (seeds S and S+1; without `--seed` one is drawn
//! and printed, so a failing run can be replayed); beside them, short-lived
//! client processes (seeds S+2, S+3, …) call with 16 in flight and are
//! killed (SIGKILL) after 0.2–1.5 s, drawn from the seed. Prints a table of
//! calls by kind and outcome, faults injected by kind and process, the
//! accounting after the run, the server's threads and RSS, and the
//! invariant violations (goal 0); exits non-zero on a violation.
//!
//! What it does not cover yet (issue 34): tcp:// and grpc:// under network
//! faults.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use rdma_rpc_benches::contenders;
use rdma_rpc_benches::streams::RpcStreamBench;
use rdma_rpc_benches::streams::rpc_bench::stream_bench_client::StreamBenchClient;
use rdma_rpc_benches::streams::rpc_bench::stream_bench_server::StreamBenchServer;
use rdma_rpc_benches::streams::rpc_bench::{Blob, FloodRequest};
use rdma_rpc_examples::EchoService;
use rdma_rpc_examples::echo::EchoRequest;
use rdma_rpc_examples::echo::echo_client::EchoClient;
use rdma_rpc_examples::echo::echo_server::EchoServer;
use rpc_core::{Channel, Code, Request, Server, Status};
use rpc_transport_rdma::device::Accounting;
use rpc_transport_rdma::verbs::soft::{FaultKind, FaultPlan, injected_faults, pause_injection};
use tokio::task::JoinSet;

/// Payload sizes of unary calls and stream messages, cycled: eager and
/// rendezvous (READ) frames.
const SIZES: [usize; 6] = [64, 700, 8 << 10, 64 << 10, 256 << 10, 1 << 20];
/// Every call's deadline (a stream's covers the whole stream).
const DEADLINE: Duration = Duration::from_secs(3);
/// How long past its deadline a call may take to end before it counts as hung.
const GRACE: Duration = Duration::from_secs(2);
/// Default fault rates (per occasion; see `docs/faults.md`).
const DEFAULT_RATES: &str =
    "error_completion=0.0005,qp_error=0.0002,rnr_drop=0.01,registration=0.001,delay=0.0005";
/// Messages of one server stream, of one client stream and of one
/// bidirectional stream.
const STREAM_MESSAGES: usize = 12;
/// How long the server may take to see every connection of the run closed
/// and everything they held back.
const SETTLE: Duration = Duration::from_secs(20);

/// Calls over rdma:// with faults injected on both sides.
#[derive(Debug, clap::Parser)]
#[command(name = "chaos", args_override_self = true)]
struct Cli {
    /// The seed (the server's; the client's is the next one). Drawn and
    /// printed when not given.
    #[arg(long)]
    seed: Option<u64>,
    /// How long the client calls.
    #[arg(long, default_value_t = 60.0)]
    seconds: f64,
    /// Calls in flight.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    in_flight: u32,
    /// Fault rates, as `RDMA_SOFT_FAULTS` takes them without the seed.
    #[arg(long, default_value = DEFAULT_RATES)]
    rates: String,
    /// No client processes killed beside the main one.
    #[arg(long)]
    no_kills: bool,
    /// Internal: serve over rdma:// (the server process).
    #[arg(long, hide = true)]
    serve: bool,
    /// Internal: call the server at this address (a client process).
    #[arg(long, hide = true, value_name = "ADDR")]
    client: Option<String>,
}

fn main() {
    let cli = <Cli as clap::Parser>::parse();
    if cli.serve {
        return serve();
    }
    if let Some(addr) = &cli.client {
        return client(addr, &cli);
    }
    let seed = cli.seed.unwrap_or_else(drawn_seed);
    let plan = |seed: u64| format!("seed={seed},{}", cli.rates);
    for side in [plan(seed), plan(seed.wrapping_add(1))] {
        if let Err(error) = FaultPlan::parse(&side) {
            eprintln!("chaos: bad --rates: {error}");
            std::process::exit(2);
        }
    }
    println!(
        "chaos: seed {seed} (replay: --seed {seed}), {} s, {} in flight, rates {}{}",
        cli.seconds,
        cli.in_flight,
        cli.rates,
        if cli.no_kills {
            ""
        } else {
            ", client processes killed"
        }
    );
    rpc_transport_rdma::register().expect("register rdma:// (this process: no faults)");

    let mut server = spawn(&["--serve"], &plan(seed));
    let addr = read_until(&mut server.lines, "LISTENING ").expect("the server listens");
    let server_pid = server.child.id();
    // The server's threads once it has served a connection (the soft
    // provider starts its engine threads with the first one), before its
    // faults begin.
    if let Err(error) = contenders::runtime().block_on(fresh_calls(&addr)) {
        eprintln!("chaos: the server did not serve before the faults began: {error}");
        std::process::exit(1);
    }
    let threads_before = thread_names(server_pid);
    if !tell(&mut server, "RESUME", "RESUMED") {
        eprintln!("chaos: the server process did not answer");
        std::process::exit(1);
    }
    let rss = RssSampler::start(server_pid);
    let rates = cli.rates.clone();
    let killer = (!cli.no_kills).then(|| {
        Killer::start(addr.clone(), seed, move |seed| {
            format!("seed={seed},{rates}")
        })
    });

    let mut client = spawn(
        &[
            "--client",
            &addr,
            "--seconds",
            &cli.seconds.to_string(),
            "--in-flight",
            &cli.in_flight.to_string(),
        ],
        &plan(seed.wrapping_add(1)),
    );
    let report = read_until(&mut client.lines, "RESULT ").unwrap_or_default();
    let client_exit = client.child.wait().expect("client exit");
    let kills = killer.map(Killer::stop).unwrap_or_default();
    let mut violations: Vec<String> = Vec::new();
    if !client_exit.success() {
        violations.push(format!("the client process ended with {client_exit}"));
    }
    let report: serde_json::Value = serde_json::from_str(&report).unwrap_or_else(|_| {
        violations.push("the client process printed no result".into());
        serde_json::Value::Null
    });

    // With the faults stopped, the server serves a new client (this
    // process's, which has none): nothing it needs was lost for good.
    if !tell(&mut server, "PAUSE", "PAUSED") {
        violations.push("the server process did not answer".into());
    }
    let served = contenders::runtime().block_on(fresh_calls(&addr));
    if let Err(error) = &served {
        violations.push(format!(
            "the server did not serve a new connection: {error}"
        ));
    }
    // Every connection is closed now (this process's runtime is gone, the
    // clients have ended or were killed): what they held must come back.
    let server_accounting = server_accounting(&mut server);
    match &server_accounting {
        Some(accounting) if accounting["settled"] == true => {}
        Some(accounting) => violations.push(format!(
            "the server's accounting did not settle within {SETTLE:?}: {accounting}"
        )),
        None => violations.push("the server reported no accounting".into()),
    }
    if report["accounting"]["settled"] != true && !report.is_null() {
        violations.push(format!(
            "the client's accounting did not settle: {}",
            report["accounting"]
        ));
    }
    let threads_after = thread_names(server_pid);
    if threads_after.len() > threads_before.len() {
        violations.push(format!(
            "server threads grew: {threads_before:?} -> {threads_after:?}"
        ));
    }
    let rss = rss.stop();
    violations.extend(rss.violation());
    let server_faults = server_faults(&mut server);
    drop(server);

    println!("\n| calls by kind and outcome | count |\n|---|---|");
    if let Some(outcomes) = report["outcomes"].as_object() {
        for (outcome, count) in outcomes {
            println!("| {outcome} | {count} |");
        }
    }
    println!("\n| fault | client | server |\n|---|---|---|");
    for kind in FaultKind::ALL {
        println!(
            "| {} | {} | {} |",
            kind.name(),
            report["faults"][kind.name()],
            server_faults.get(kind.name()).copied().unwrap_or_default()
        );
    }
    println!("\nclient processes killed mid-call: {kills}");
    println!(
        "accounting after the run: server {}; client {}",
        server_accounting.unwrap_or_default(),
        report["accounting"]
    );
    println!(
        "server threads: {} before, {} after; {rss}",
        threads_before.len(),
        threads_after.len()
    );
    if let Some(theirs) = report["violations"].as_array() {
        violations.extend(theirs.iter().filter_map(|v| v.as_str().map(str::to_owned)));
    }
    println!("\ninvariant violations: {} (goal 0)", violations.len());
    for violation in &violations {
        println!("  - {violation}");
    }
    println!("seed {seed}");
    if !violations.is_empty() {
        std::process::exit(1);
    }
}

/// The names of a process's threads, sorted.
fn thread_names(pid: u32) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|tasks| {
            tasks
                .filter_map(|task| {
                    let path = task.ok()?.path().join("comm");
                    Some(std::fs::read_to_string(path).ok()?.trim().to_owned())
                })
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// A process's resident set, in KiB.
fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Samples the server's RSS every 250 ms while the faults run.
struct RssSampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<u64>>,
}

impl RssSampler {
    fn start(pid: u32) -> RssSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !stopped.load(Ordering::Relaxed) {
                samples.extend(rss_kib(pid));
                std::thread::sleep(Duration::from_millis(250));
            }
            samples.extend(rss_kib(pid));
            samples
        });
        RssSampler { stop, thread }
    }

    fn stop(self) -> Rss {
        self.stop.store(true, Ordering::Relaxed);
        Rss(self.thread.join().unwrap_or_default())
    }
}

/// The server's RSS samples, KiB.
struct Rss(Vec<u64>);

impl Rss {
    fn halves(&self) -> (u64, u64) {
        let (first, second) = self.0.split_at(self.0.len() / 2);
        let peak = |samples: &[u64]| samples.iter().copied().max().unwrap_or_default();
        (peak(first), peak(second))
    }

    /// Flat: the second half's peak within twice the first half's and
    /// 64 MiB (pools grow to their caps while the load finds them, then
    /// stay; a leak keeps growing).
    fn violation(&self) -> Option<String> {
        let (first, second) = self.halves();
        (second > 2 * first + 64 * 1024).then(|| {
            format!(
                "server RSS grew: peak {first} KiB in the first half, {second} KiB in the second"
            )
        })
    }
}

impl std::fmt::Display for Rss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (first, second) = self.halves();
        let mib = |kib: u64| kib as f64 / 1024.0;
        write!(
            f,
            "server RSS {:.0} MiB at the start, peak {:.0} MiB (first half) and {:.0} MiB (second half), {:.0} MiB at the end",
            mib(self.0.first().copied().unwrap_or_default()),
            mib(first),
            mib(second),
            mib(self.0.last().copied().unwrap_or_default()),
        )
    }
}

/// Starts client processes that call beside the main client and kills each
/// (SIGKILL) after a while drawn from the seed: peers that die mid-call,
/// with calls, streams and READs in flight.
struct Killer {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl Killer {
    fn start(addr: String, seed: u64, plan: impl Fn(u64) -> String + Send + 'static) -> Killer {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut draw = seed ^ 0x9e37_79b9_7f4a_7c15;
            let mut kills = 0u64;
            while !stopped.load(Ordering::Relaxed) {
                let victim = Command::new(std::env::current_exe().expect("own path"))
                    .args(["--client", &addr, "--seconds", "3600", "--in-flight", "16"])
                    .env("RDMA_SOFT_FAULTS", plan(seed.wrapping_add(2 + kills)))
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn();
                let Ok(mut victim) = victim else { break };
                draw = splitmix(draw);
                let lives = Duration::from_millis(200 + draw % 1300);
                let born = Instant::now();
                while born.elapsed() < lives && !stopped.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(20));
                }
                let _ = victim.kill();
                let _ = victim.wait();
                kills += 1;
            }
            kills
        });
        Killer { stop, thread }
    }

    /// Stops killing; returns how many were killed.
    fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

fn splitmix(state: u64) -> u64 {
    let mut z = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn drawn_seed() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    now.as_nanos() as u64 ^ u64::from(std::process::id()).rotate_left(32)
}

/// A child process of this binary and its stdout's lines.
struct Process {
    child: Child,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(args: &[&str], plan: &str) -> Process {
    let mut child = Command::new(std::env::current_exe().expect("own path"))
        .args(args)
        .env("RDMA_SOFT_FAULTS", plan)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("a child process");
    let lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    Process { child, lines }
}

fn read_until(
    lines: &mut std::io::Lines<BufReader<std::process::ChildStdout>>,
    prefix: &str,
) -> Option<String> {
    for line in lines {
        let line = line.ok()?;
        if let Some(rest) = line.strip_prefix(prefix) {
            return Some(rest.to_owned());
        }
    }
    None
}

/// Sends `command` to the server process and waits for its `answer`.
fn tell(server: &mut Process, command: &str, answer: &str) -> bool {
    if let Some(stdin) = server.child.stdin.as_mut() {
        let _ = writeln!(stdin, "{command}");
    }
    read_until(&mut server.lines, answer).is_some()
}

/// Asks the server process for its injected faults.
fn server_faults(server: &mut Process) -> BTreeMap<String, u64> {
    if let Some(stdin) = server.child.stdin.as_mut() {
        let _ = writeln!(stdin, "FAULTS");
    }
    read_until(&mut server.lines, "FAULTS ")
        .and_then(|line| serde_json::from_str(&line).ok())
        .unwrap_or_default()
}

/// Asks the server process for its accounting once its connections have
/// closed (it waits up to [`SETTLE`]).
fn server_accounting(server: &mut Process) -> Option<serde_json::Value> {
    if let Some(stdin) = server.child.stdin.as_mut() {
        let _ = writeln!(stdin, "ACCOUNTING");
    }
    read_until(&mut server.lines, "ACCOUNTING ").and_then(|line| serde_json::from_str(&line).ok())
}

fn faults_json() -> serde_json::Value {
    let counts = injected_faults();
    FaultKind::ALL
        .iter()
        .map(|kind| (kind.name().to_owned(), counts.of(*kind).into()))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// Waits (up to `within`) until this process's device holds nothing for a
/// connection; returns what it held last, as JSON with `settled`.
fn settled_accounting(within: Duration) -> serde_json::Value {
    let config = rpc_transport_rdma::RdmaConfig::from_env().expect("config");
    let device = rpc_transport_rdma::device::open(&config).expect("the device");
    let until = Instant::now() + within;
    let mut accounting = device.accounting();
    while !accounting.is_settled() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(100));
        accounting = device.accounting();
    }
    accounting_json(&accounting)
}

fn accounting_json(accounting: &Accounting) -> serde_json::Value {
    serde_json::json!({
        "settled": accounting.is_settled(),
        "connections": accounting.connections,
        "committed_receive_slots": accounting.committed_receive_slots,
        "grown_receive_slots": accounting.grown_receive_slots,
        "send_slots_out": accounting.send_slots_out,
        "lost_send_slots": accounting.lost_send_slots,
        "rendezvous_buffers_out": accounting.rendezvous_buffers_out,
        "rendezvous_bytes_charged": accounting.rendezvous_bytes_charged,
        "leaked_buffers": accounting.leaked_buffers,
    })
}

/// The server process: echo and the stream bench over rdma:// (its device
/// opens with the plan in `RDMA_SOFT_FAULTS`); answers `FAULTS`, `PAUSE`,
/// `RESUME` and `ACCOUNTING` on stdin.
fn serve() {
    // No faults until the orchestrator has seen this server serve.
    pause_injection(true);
    rpc_transport_rdma::register().expect("register rdma://");
    std::thread::spawn(|| {
        for line in std::io::stdin().lines() {
            let Ok(line) = line else { break };
            match line.trim() {
                "FAULTS" => println!("FAULTS {}", faults_json()),
                "PAUSE" => {
                    pause_injection(true);
                    println!("PAUSED");
                }
                "RESUME" => {
                    pause_injection(false);
                    println!("RESUMED");
                }
                "ACCOUNTING" => println!("ACCOUNTING {}", settled_accounting(SETTLE)),
                _ => {}
            }
        }
    });
    contenders::runtime().block_on(async {
        let listening = Server::builder()
            .max_frame_len(4 << 20)
            .add_service(EchoServer::new(EchoService))
            .add_service(StreamBenchServer::new(RpcStreamBench))
            .listen("rdma://127.0.0.1:0")
            .await
            .expect("bind");
        println!("LISTENING {}", listening.local_endpoint().authority());
        listening.serve().await.expect("serve");
    });
}

/// The clients of one channel.
#[derive(Clone)]
struct Clients {
    echo: EchoClient<Channel>,
    streams: StreamBenchClient<Channel>,
}

impl Clients {
    fn new(channel: Channel) -> Clients {
        Clients {
            echo: EchoClient::new(channel.clone()),
            streams: StreamBenchClient::new(channel),
        }
    }
}

/// 100 unary calls and one call of each stream kind from a fresh
/// connection, every one answered correctly.
async fn fresh_calls(addr: &str) -> Result<(), String> {
    let endpoint: rpc_core::transport::Endpoint = format!("rdma://{addr}")
        .parse()
        .map_err(|e| format!("{e}"))?;
    let channel = Channel::builder(endpoint)
        .max_frame_len(4 << 20)
        .connect()
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let clients = Clients::new(channel);
    for call in 0..100 + KINDS.len() {
        let kind = if call < 100 {
            CallKind::Unary
        } else {
            KINDS[call - 100]
        };
        match kind.call(clients.clone(), call).await {
            Outcome::Answered => {}
            Outcome::Failed(status) => return Err(format!("call {call} ({kind:?}): {status}")),
            Outcome::Wrong(what) => return Err(format!("call {call} ({kind:?}): {what}")),
        }
    }
    Ok(())
}

/// What a client calls, in turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallKind {
    /// `Echo.Say`, one payload of [`SIZES`].
    Unary,
    /// `StreamBench.Flood`: [`STREAM_MESSAGES`] messages of one size.
    ServerStream,
    /// `StreamBench.Upload`: [`STREAM_MESSAGES`] messages of cycled sizes.
    ClientStream,
    /// `StreamBench.Pipe`: [`STREAM_MESSAGES`] stamped messages of cycled
    /// sizes, each echoed back in order.
    Bidi,
}

/// The mix: five unary calls to each stream.
const MIX: [CallKind; 8] = [
    CallKind::Unary,
    CallKind::ServerStream,
    CallKind::Unary,
    CallKind::ClientStream,
    CallKind::Unary,
    CallKind::Bidi,
    CallKind::Unary,
    CallKind::Unary,
];
/// Each stream kind once.
const KINDS: [CallKind; 3] = [
    CallKind::ServerStream,
    CallKind::ClientStream,
    CallKind::Bidi,
];

/// How one call ended.
enum Outcome {
    Answered,
    Failed(Status),
    Wrong(String),
}

/// A payload of `size` bytes unique to (`call`, `message`): a pattern with
/// the pair stamped at its start, so an answer that carries another call's
/// (or another message's) bytes is caught, not taken as equal.
fn stamped(size: usize, call: usize, message: usize) -> Bytes {
    let mut bytes: Vec<u8> = (0..size).map(|i| (i * 31) as u8).collect();
    let stamp = [(call as u64).to_le_bytes(), (message as u64).to_le_bytes()].concat();
    let stamped = size.min(stamp.len());
    bytes[..stamped].copy_from_slice(&stamp[..stamped]);
    Bytes::from(bytes)
}

impl CallKind {
    fn name(self) -> &'static str {
        match self {
            CallKind::Unary => "unary",
            CallKind::ServerStream => "server stream",
            CallKind::ClientStream => "client stream",
            CallKind::Bidi => "bidi stream",
        }
    }

    /// Makes call number `call` of this kind and checks what comes back.
    async fn call(self, mut clients: Clients, call: usize) -> Outcome {
        let size = |message: usize| SIZES[(call / MIX.len() + message) % SIZES.len()];
        let result: Result<Option<String>, Status> = async {
            match self {
                CallKind::Unary => {
                    let payload = stamped(size(0), call, 0);
                    let mut request = Request::new(EchoRequest {
                        message: String::new(),
                        payload: payload.clone(),
                    });
                    request.set_timeout(DEADLINE);
                    let reply = clients.echo.say(request).await?.into_inner();
                    Ok((reply.payload != payload).then(|| "a wrong answer".to_owned()))
                }
                CallKind::ServerStream => {
                    // Flood's messages are 0x5a bytes; sizes up to 256 KiB.
                    let size = size(0).min(256 << 10);
                    let mut request = Request::new(FloodRequest {
                        count: STREAM_MESSAGES as u64,
                        size: size as u32,
                    });
                    request.set_timeout(DEADLINE);
                    let mut messages = clients.streams.flood(request).await?.into_inner();
                    let mut received = 0;
                    while let Some(blob) = messages.message().await? {
                        if blob.data.len() != size || blob.data.iter().any(|&b| b != 0x5a) {
                            return Ok(Some(format!("message {received} differs")));
                        }
                        received += 1;
                    }
                    Ok((received != STREAM_MESSAGES).then(|| {
                        format!("{received} of {STREAM_MESSAGES} messages, and no error")
                    }))
                }
                CallKind::ClientStream => {
                    let blobs: Vec<Blob> = (0..STREAM_MESSAGES)
                        .map(|message| Blob {
                            data: stamped(size(message), call, message),
                        })
                        .collect();
                    let bytes: u64 = blobs.iter().map(|b| b.data.len() as u64).sum();
                    let mut request = Request::new(futures_util::stream::iter(blobs));
                    request.set_timeout(DEADLINE);
                    let total = clients.streams.upload(request).await?.into_inner();
                    Ok((total.messages != STREAM_MESSAGES as u64 || total.bytes != bytes).then(
                        || {
                            format!(
                                "the server counted {} messages, {} B; {STREAM_MESSAGES}, {bytes} B were sent",
                                total.messages, total.bytes
                            )
                        },
                    ))
                }
                CallKind::Bidi => {
                    let sent: Vec<Bytes> = (0..STREAM_MESSAGES)
                        .map(|message| stamped(size(message), call, message))
                        .collect();
                    let outgoing = futures_util::stream::iter(sent.clone())
                        .map(|data| Blob { data });
                    let mut request = Request::new(outgoing);
                    request.set_timeout(DEADLINE);
                    let mut echoes = clients.streams.pipe(request).await?.into_inner();
                    let mut received = 0;
                    while let Some(blob) = echoes.message().await? {
                        if sent.get(received) != Some(&blob.data) {
                            return Ok(Some(format!("echo {received} differs")));
                        }
                        received += 1;
                    }
                    Ok((received != STREAM_MESSAGES).then(|| {
                        format!("{received} of {STREAM_MESSAGES} echoes, and no error")
                    }))
                }
            }
        }
        .await;
        match result {
            Ok(None) => Outcome::Answered,
            Ok(Some(wrong)) => Outcome::Wrong(wrong),
            Err(status) => Outcome::Failed(status),
        }
    }
}

/// A client process: calls for `--seconds`, `--in-flight` at a time, then
/// prints `RESULT {json}` (outcomes, faults, violations, and its device's
/// accounting once its connections have closed).
fn client(addr: &str, cli: &Cli) {
    rpc_transport_rdma::register().expect("register rdma://");
    let addr = addr.to_owned();
    let seconds = cli.seconds;
    let in_flight = cli.in_flight as usize;
    let (outcomes, mut violations) = contenders::runtime().block_on(async move {
        let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
        let mut violations: Vec<String> = Vec::new();
        let endpoint: rpc_core::transport::Endpoint =
            format!("rdma://{addr}").parse().expect("endpoint");
        // A lazy channel: a connection the faults broke is made again.
        let channel = Channel::builder(endpoint)
            .max_frame_len(4 << 20)
            .connect_lazy();
        let clients = Clients::new(channel);
        let until = Instant::now() + Duration::from_secs_f64(seconds);
        let mut tasks: JoinSet<(CallKind, Option<Outcome>)> = JoinSet::new();
        let mut call = 0usize;
        let mut record = |(kind, outcome): (CallKind, Option<Outcome>),
                          violations: &mut Vec<String>| {
            let name = kind.name();
            let key = match outcome {
                Some(Outcome::Answered) => "answered".to_owned(),
                Some(Outcome::Failed(status)) => {
                    if !matches!(status.code(), Code::Unavailable | Code::DeadlineExceeded) {
                        eprintln!("chaos: a {name} call failed: {status}");
                    }
                    format!("{:?}", status.code())
                }
                Some(Outcome::Wrong(what)) => {
                    violations.push(format!("a {name} call: {what}"));
                    "WRONG".to_owned()
                }
                None => {
                    violations.push(format!(
                        "a {name} call did not end within its deadline + {GRACE:?}"
                    ));
                    "HUNG".to_owned()
                }
            };
            *outcomes.entry(format!("{name}: {key}")).or_default() += 1;
        };
        while Instant::now() < until {
            while tasks.len() >= in_flight {
                let done = tasks.join_next().await.expect("a task").expect("no panic");
                record(done, &mut violations);
            }
            let kind = MIX[call % MIX.len()];
            let clients = clients.clone();
            let number = call;
            call += 1;
            tasks.spawn(async move {
                let outcome = tokio::time::timeout(DEADLINE + GRACE, kind.call(clients, number))
                    .await
                    .ok();
                (kind, outcome)
            });
        }
        while let Some(done) = tasks.join_next().await {
            record(done.expect("no panic"), &mut violations);
        }
        drop(clients);
        (outcomes, violations)
    });
    if !outcomes.keys().any(|key| key.ends_with(": answered")) {
        violations.push("no call was answered".into());
    }
    // The runtime (and with it the channel's connection) is gone.
    let accounting = settled_accounting(SETTLE);
    let result = serde_json::json!({
        "outcomes": outcomes,
        "faults": faults_json(),
        "violations": violations,
        "accounting": accounting,
    });
    println!("RESULT {result}");
}
