//! rdma-rpc beside tonic and tarpc and the machine's floors, in one run.
//!
//! ```text
//! cargo run --release -p rdma-rpc-benches -- --quick     # under 2 minutes on 2 cores
//! cargo run --release -p rdma-rpc-benches -- --full
//! cargo run --release -p rdma-rpc-benches -- --quick --load 1   # with a busy process competing
//! cargo run --release -p rdma-rpc-benches -- --quick --multi-thread   # #[tokio::main]-like runtimes
//! ```
//! Every contender's server runs in its own process (this binary, started
//! with `--serve <contender>`); the client runs here; both on current-thread
//! tokio runtimes. Prints progress on stderr and a markdown table on stdout
//! (ratios to tonic in brackets); writes the numbers as JSON and the charts
//! (latency CDF, goodput against size; SVG and PNG) to
//! `target/bench-results/`. `benches/README.md` explains every row.

#![forbid(unsafe_code)]

use std::alloc::System;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rdma_rpc_benches::contenders::{self, Client, Contender, ServerProcess};
use rdma_rpc_benches::floors;
use rdma_rpc_benches::plot::{self, Chart, Series};
use rdma_rpc_benches::stats::{self, gbps, histogram, record};
use rdma_rpc_benches::stats::{ProcessCounters, minor_faults};
use rdma_rpc_benches::streams::{self, StreamResults};
use serde::Serialize;
use stats_alloc::{INSTRUMENTED_SYSTEM, StatsAlloc};

/// The system allocator, counting allocations for the heap-allocations row
/// (in the server processes too: they are this binary).
#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// The 64 B throughput point whose window the per-call cost rows (CPU,
/// context switches, allocations) are measured over.
const COST_IN_FLIGHT: usize = 128;

/// How much each workload does.
#[derive(Debug, Clone, Serialize)]
struct Settings {
    mode: &'static str,
    latency_calls: u64,
    warmup_calls: u64,
    throughput_seconds: f64,
    in_flight: Vec<usize>,
    /// (payload bytes, echoes)
    large: Vec<(usize, u32)>,
    overhead_calls: u64,
    floor_rounds: usize,
    /// Busy processes competing for the CPUs during the whole run.
    load: usize,
    /// Multi-thread runtimes (2 workers) instead of current-thread ones.
    multi_thread: bool,
    /// 64 B messages on each of the server stream and the bidirectional stream.
    stream_messages: u64,
    /// Bytes of the streamed upload (in 1 MiB messages).
    upload_bytes: u64,
}

impl Settings {
    fn quick() -> Settings {
        Settings {
            mode: "quick",
            latency_calls: 3_000,
            warmup_calls: 300,
            throughput_seconds: 0.6,
            in_flight: vec![1, 16, 128],
            large: vec![(256 << 10, 20), (1 << 20, 6), (16 << 20, 2), (64 << 20, 1)],
            overhead_calls: 5_000,
            floor_rounds: 2_000,
            load: 0,
            multi_thread: false,
            stream_messages: 200_000,
            upload_bytes: 1 << 30,
        }
    }

    fn full() -> Settings {
        Settings {
            mode: "full",
            latency_calls: 20_000,
            warmup_calls: 2_000,
            throughput_seconds: 3.0,
            in_flight: vec![1, 16, 128],
            large: vec![
                (256 << 10, 500),
                (1 << 20, 200),
                (16 << 20, 20),
                (64 << 20, 4),
                (256 << 20, 2),
            ],
            overhead_calls: 50_000,
            floor_rounds: 10_000,
            load: 0,
            multi_thread: false,
            stream_messages: 2_000_000,
            upload_bytes: 1 << 30,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
struct Latency {
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
    /// (µs, fraction of calls at or below)
    cdf: Vec<(f64, f64)>,
}

impl Latency {
    fn from(h: &Histogram<u64>) -> Latency {
        let us = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
        let mut cdf = Vec::new();
        let mut q = 0.0;
        while q < 0.9995 {
            cdf.push((us(q).max(0.001), q));
            q += if q < 0.9 { 0.01 } else { 0.001 };
        }
        Latency {
            p50_us: us(0.5),
            p99_us: us(0.99),
            p999_us: us(0.999),
            cdf,
        }
    }
}

/// What one 64 B call costs client and server together, over the window
/// of the throughput point at [`COST_IN_FLIGHT`] calls in flight.
#[derive(Debug, Clone, Serialize)]
struct CallCost {
    in_flight: usize,
    /// Calls completed in the window.
    calls: u64,
    /// User + system CPU µs per call.
    cpu_us: f64,
    /// Voluntary context switches per call.
    voluntary_switches: f64,
    /// Heap allocations (alloc, alloc_zeroed, realloc) per call.
    allocations: Option<f64>,
}

impl CallCost {
    /// The cost per call of `calls` that took `spent` in both processes.
    fn per_call(spent: ProcessCounters, calls: u64) -> CallCost {
        let calls_f = calls.max(1) as f64;
        CallCost {
            in_flight: COST_IN_FLIGHT,
            calls,
            cpu_us: spent.cpu.as_secs_f64() * 1e6 / calls_f,
            voluntary_switches: spent.voluntary_switches as f64 / calls_f,
            allocations: spent.allocations.map(|a| a as f64 / calls_f),
        }
    }
}

/// Both processes' counters now: this one's and the server's (`None` if
/// the server did not answer).
fn both_counters(server: &ServerProcess) -> Option<(ProcessCounters, ProcessCounters)> {
    let server = server.counters()?;
    Some((ProcessCounters::now(), server))
}

#[derive(Debug, Clone, Serialize)]
struct Measured {
    contender: Contender,
    label: &'static str,
    latency_64b: Latency,
    /// (calls in flight, calls/s)
    throughput_64b: Vec<(usize, f64)>,
    /// Per-call cost at [`COST_IN_FLIGHT`] in flight (`None` where the
    /// server did not report its counters).
    cost_64b: Option<CallCost>,
    /// (payload bytes, GB/s counting both directions)
    goodput: Vec<(usize, f64)>,
    /// (payload bytes, minor page faults of the client process per echo)
    faults_per_echo: Vec<(usize, f64)>,
    /// (payload bytes, GB/s both ways) of echoes of a `SendBuffer` in the
    /// message's `bytes` field (rdma-rpc only: empty for the others)
    send_buffer_goodput: Vec<(usize, f64)>,
    /// CPU µs per empty call over the framework's in-memory transport.
    cpu_per_call_us: Option<f64>,
    /// The streaming workloads (rdma-rpc and tonic; tarpc has no streaming).
    streams: Option<StreamResults>,
}

#[derive(Debug, Clone, Serialize)]
struct Floors {
    tcp_pingpong_p50_us: f64,
    tcp_pingpong_p99_us: f64,
    eventfd_pingpong_p50_us: f64,
    spin_pingpong_p50_us: f64,
    memcpy_gbps: f64,
    process_vm_readv_gbps: f64,
    process_vm_readv_huge_gbps: f64,
}

#[derive(Debug, Clone, Serialize)]
struct Report {
    settings: Settings,
    rdma_provider: String,
    contenders: Vec<Measured>,
    floors: Floors,
}

fn register_rdma(poll: &str) {
    let mut config = rpc_transport_rdma::RdmaConfig::from_env().expect("RDMA settings");
    config.poll_mode = rpc_transport_rdma::PollMode::parse(poll).expect("poll mode");
    rpc_transport_rdma::register_with(config).expect("register rdma://");
}

/// Measures `contender`'s client against its `server` at `addr`.
async fn measure(
    contender: Contender,
    addr: &str,
    server: &ServerProcess,
    settings: &Settings,
) -> Measured {
    let mut client = Client::connect(contender, addr).await;
    let small = bytes::Bytes::from_static(&[7u8; 64]);
    for _ in 0..settings.warmup_calls {
        client.say(&small).await;
    }
    eprintln!("  64 B latency, {} calls", settings.latency_calls);
    let mut h = histogram();
    for _ in 0..settings.latency_calls {
        let started = Instant::now();
        client.say(&small).await;
        record(&mut h, started.elapsed());
    }
    let latency_64b = Latency::from(&h);

    let mut throughput_64b = Vec::new();
    let mut cost_64b = None;
    for &in_flight in &settings.in_flight {
        eprintln!(
            "  64 B throughput, {in_flight} in flight, {} s",
            settings.throughput_seconds
        );
        let before = (in_flight == COST_IN_FLIGHT)
            .then(|| both_counters(server))
            .flatten();
        let deadline = Instant::now() + Duration::from_secs_f64(settings.throughput_seconds);
        let started = Instant::now();
        let mut workers = tokio::task::JoinSet::new();
        for _ in 0..in_flight {
            let mut client = client.clone();
            workers.spawn(async move {
                let mut done = 0u64;
                let small = bytes::Bytes::from_static(&[7u8; 64]);
                while Instant::now() < deadline {
                    client.say(&small).await;
                    done += 1;
                }
                done
            });
        }
        let mut total = 0;
        while let Some(done) = workers.join_next().await {
            total += done.expect("worker");
        }
        let elapsed = started.elapsed();
        if let Some((client_before, server_before)) = before {
            cost_64b = both_counters(server).map(|(client_after, server_after)| {
                let spent = client_after
                    .since(client_before)
                    .plus(server_after.since(server_before));
                CallCost::per_call(spent, total)
            });
        }
        throughput_64b.push((in_flight, total as f64 / elapsed.as_secs_f64()));
    }

    let mut goodput = Vec::new();
    let mut faults_per_echo = Vec::new();
    for &(size, rounds) in &settings.large {
        eprintln!("  {} echo × {rounds}", size_label(size));
        let payload = bytes::Bytes::from(vec![0x5au8; size]);
        assert_eq!(client.say(&payload).await, size, "warm-up echo");
        let faults = minor_faults();
        let started = Instant::now();
        for _ in 0..rounds {
            assert_eq!(client.say(&payload).await, size);
        }
        let moved = 2 * size as u64 * u64::from(rounds);
        goodput.push((size, gbps(moved, started.elapsed())));
        faults_per_echo.push((size, (minor_faults() - faults) as f64 / f64::from(rounds)));
    }
    let mut send_buffer_goodput = Vec::new();
    for &(size, rounds) in &settings.large {
        let mut buffer = rpc_core::SendBuffer::with_capacity(size);
        buffer.resize(size, 0x5a);
        let payload = buffer.freeze();
        if client.say_send_buffer(&payload).await.is_none() {
            break;
        }
        eprintln!(
            "  {} echo of a SendBuffer field × {rounds}",
            size_label(size)
        );
        let started = Instant::now();
        for _ in 0..rounds {
            assert_eq!(client.say_send_buffer(&payload).await, Some(size));
        }
        let moved = 2 * size as u64 * u64::from(rounds);
        send_buffer_goodput.push((size, gbps(moved, started.elapsed())));
    }
    let streams = match client.streams() {
        Some(mut streams) => Some(
            streams::measure(
                &mut streams,
                settings.stream_messages,
                settings.upload_bytes,
            )
            .await,
        ),
        None => None,
    };
    Measured {
        contender,
        label: contender.label(),
        latency_64b,
        throughput_64b,
        cost_64b,
        goodput,
        faults_per_echo,
        send_buffer_goodput,
        cpu_per_call_us: None,
        streams,
    }
}

/// CPU per empty call with client and server on one thread, over the
/// framework's in-memory transport.
fn cpu_per_call(contender: Contender, calls: u64) -> Option<f64> {
    contenders::runtime().block_on(async {
        let mut client = contenders::in_memory(contender).await?;
        let empty = bytes::Bytes::new();
        for _ in 0..calls / 10 {
            client.say(&empty).await;
        }
        let started = stats::process_cpu_time();
        for _ in 0..calls {
            client.say(&empty).await;
        }
        let spent = stats::process_cpu_time() - started;
        Some(spent.as_secs_f64() * 1e6 / calls as f64)
    })
}

fn ratio(value: f64, tonic: f64) -> String {
    if tonic > 0.0 {
        format!(" ({:.2}×)", value / tonic)
    } else {
        String::new()
    }
}

fn print_table(report: &Report) {
    let columns = &report.contenders;
    let tonic = columns
        .iter()
        .find(|m| m.contender == Contender::Tonic)
        .unwrap_or(&columns[0]);
    let header: Vec<&str> = columns.iter().map(|m| m.label).collect();
    println!(
        "rdma-rpc against tonic and tarpc ({} mode; RDMA provider: {}). Two processes, one connection, \
         {} runtimes, loopback{}. Ratios to tonic in brackets.\n",
        report.settings.mode,
        report.rdma_provider,
        if report.settings.multi_thread {
            "multi-thread (2 workers)"
        } else {
            "current-thread"
        },
        match report.settings.load {
            0 => String::new(),
            n => format!(", {n} busy process(es) competing for the CPUs"),
        }
    );
    println!("| workload | {} |", header.join(" | "));
    println!("|---|{}", "---|".repeat(columns.len()));
    let row = |name: &str, value: &dyn Fn(&Measured) -> Option<f64>, digits: usize| {
        let base = value(tonic).unwrap_or(0.0);
        let cells: Vec<String> = columns
            .iter()
            .map(|m| match value(m) {
                Some(v) => format!("{v:.digits$}{}", ratio(v, base)),
                None => "—".to_owned(),
            })
            .collect();
        println!("| {name} | {} |", cells.join(" | "));
    };
    row("64 B echo p50 (µs)", &|m| Some(m.latency_64b.p50_us), 1);
    row("64 B echo p99 (µs)", &|m| Some(m.latency_64b.p99_us), 1);
    row("64 B echo p99.9 (µs)", &|m| Some(m.latency_64b.p999_us), 1);
    for (index, &in_flight) in report.settings.in_flight.iter().enumerate() {
        row(
            &format!("64 B calls/s, {in_flight} in flight"),
            &|m| Some(m.throughput_64b[index].1),
            0,
        );
    }
    row(
        &format!("CPU per 64 B call at {COST_IN_FLIGHT} in flight, client + server (µs)"),
        &|m| m.cost_64b.as_ref().map(|c| c.cpu_us),
        2,
    );
    row(
        &format!(
            "voluntary context switches per 64 B call at {COST_IN_FLIGHT} in flight, client + server"
        ),
        &|m| m.cost_64b.as_ref().map(|c| c.voluntary_switches),
        3,
    );
    row(
        &format!("heap allocations per 64 B call at {COST_IN_FLIGHT} in flight, client + server"),
        &|m| m.cost_64b.as_ref().and_then(|c| c.allocations),
        1,
    );
    for (index, &(size, _)) in report.settings.large.iter().enumerate() {
        row(
            &format!("{} echo goodput (GB/s, both ways)", size_label(size)),
            &|m| Some(m.goodput[index].1),
            2,
        );
    }
    for (index, &(size, _)) in report.settings.large.iter().enumerate() {
        row(
            &format!(
                "{} echo of a SendBuffer field (GB/s, both ways)",
                size_label(size)
            ),
            &|m| m.send_buffer_goodput.get(index).map(|(_, g)| *g),
            2,
        );
    }
    for (index, &(size, _)) in report.settings.large.iter().enumerate() {
        row(
            &format!(
                "{} echo: client minor page faults per echo",
                size_label(size)
            ),
            &|m| Some(m.faults_per_echo[index].1),
            0,
        );
    }
    row(
        "CPU per empty call, in-memory transport (µs)",
        &|m| m.cpu_per_call_us,
        2,
    );
    row(
        "64 B messages/s on one server stream",
        &|m| m.streams.as_ref().map(|s| s.server_stream_per_s),
        0,
    );
    row(
        "64 B messages/s echoed on one bidirectional stream",
        &|m| m.streams.as_ref().map(|s| s.bidi_per_s),
        0,
    );
    row(
        &format!(
            "{} upload in 1 MiB stream messages (GB/s)",
            size_label(report.settings.upload_bytes as usize)
        ),
        &|m| m.streams.as_ref().map(|s| s.upload_gbps),
        2,
    );
    let f = &report.floors;
    println!("\nFloors (two processes, same machine, same run):\n");
    println!("| floor | value |");
    println!("|---|---|");
    println!(
        "| TCP loopback 64 B ping-pong p50 / p99 (µs) | {:.1} / {:.1} |",
        f.tcp_pingpong_p50_us, f.tcp_pingpong_p99_us
    );
    println!(
        "| shared memory + eventfd 64 B ping-pong p50 (µs) | {:.1} |",
        f.eventfd_pingpong_p50_us
    );
    println!(
        "| shared memory busy-poll ping-pong p50 (µs) | {:.2} |",
        f.spin_pingpong_p50_us
    );
    println!(
        "| memcpy 64 MiB, one thread (GB/s) | {:.2} |",
        f.memcpy_gbps
    );
    println!(
        "| process_vm_readv 64 MiB (GB/s) | {:.2} |",
        f.process_vm_readv_gbps
    );
    println!(
        "| process_vm_readv 64 MiB from huge pages: the soft READ's floor for what rdma:// exposes (GB/s) | {:.2} |",
        f.process_vm_readv_huge_gbps
    );
}

/// The goals of a run under load or on multi-thread runtimes: rdma://
/// (default mode) no worse than tcp:// on latency and calls/s. Needs only
/// those two contenders.
fn print_load_goals(report: &Report) {
    let get = |c: Contender| report.contenders.iter().find(|m| m.contender == c);
    let (Some(rdma), Some(tcp)) = (get(Contender::RdmaAdaptive), get(Contender::RpcTcp)) else {
        return;
    };
    let verdict = |ok: bool| if ok { "met" } else { "missed" };
    println!(
        "\nGoals against tcp:// ({} busy process(es), {} runtimes):\n",
        report.settings.load,
        if report.settings.multi_thread {
            "multi-thread"
        } else {
            "current-thread"
        }
    );
    println!("| goal | rdma:// | tcp:// | |");
    println!("|---|---|---|---|");
    for (name, ours, theirs) in [
        (
            "64 B p50 ≤ tcp://",
            rdma.latency_64b.p50_us,
            tcp.latency_64b.p50_us,
        ),
        (
            "64 B p99 ≤ tcp://",
            rdma.latency_64b.p99_us,
            tcp.latency_64b.p99_us,
        ),
        (
            "64 B p99.9 ≤ tcp://",
            rdma.latency_64b.p999_us,
            tcp.latency_64b.p999_us,
        ),
    ] {
        println!(
            "| {name} | {ours:.1} µs | {theirs:.1} µs | {} |",
            verdict(ours <= theirs)
        );
    }
    let rate = |m: &Measured, n: usize| {
        m.throughput_64b
            .iter()
            .find(|(k, _)| *k == n)
            .map_or(0.0, |(_, r)| *r)
    };
    for n in [16, 128] {
        let (ours, theirs) = (rate(rdma, n), rate(tcp, n));
        println!(
            "| calls/s at {n} in flight ≥ tcp:// | {ours:.0} | {theirs:.0} | {} |",
            verdict(ours >= theirs)
        );
    }
}

/// The gRPC goals: rdma-rpc serving gRPC within 10% of tonic (tonic's
/// client for both), and tonic's client over rdma:// at ≤ 0.2× of tonic's
/// p50 over HTTP/2. Printed whenever those contenders ran.
fn print_grpc_goals(report: &Report) {
    let get = |c: Contender| report.contenders.iter().find(|m| m.contender == c);
    let (Some(tonic), Some(grpc), Some(adapter)) = (
        get(Contender::Tonic),
        get(Contender::RpcGrpc),
        get(Contender::TonicOverRdma),
    ) else {
        return;
    };
    let at_128 = |m: &Measured| {
        m.throughput_64b
            .iter()
            .find(|(n, _)| *n == 128)
            .map_or(0.0, |(_, r)| *r)
    };
    let verdict = |ok: bool| if ok { "met" } else { "missed" };
    println!("\ngRPC goals (tonic's client throughout):\n");
    println!("| goal | measured | |");
    println!("|---|---|---|");
    let p50 = grpc.latency_64b.p50_us / tonic.latency_64b.p50_us;
    println!(
        "| rdma-rpc serving grpc:// 64 B p50 within 10% of tonic (≤ 1.1×) | {p50:.2}× | {} |",
        verdict(p50 <= 1.1)
    );
    let rate = at_128(grpc) / at_128(tonic);
    println!(
        "| rdma-rpc serving grpc:// calls/s at 128 in flight within 10% of tonic (≥ 0.9×) | {rate:.2}× | {} |",
        verdict(rate >= 0.9)
    );
    let over_rdma = adapter.latency_64b.p50_us / tonic.latency_64b.p50_us;
    println!(
        "| tonic's client over rdma:// 64 B p50 ≤ 0.2× tonic over HTTP/2 | {over_rdma:.3}× | {} |",
        verdict(over_rdma <= 0.2)
    );
}

fn print_goals(report: &Report) {
    print_grpc_goals(report);
    if report.settings.load > 0 || report.settings.multi_thread {
        print_load_goals(report);
        return;
    }
    if report.contenders.len() < Contender::ALL.len() {
        println!("\n(Goals need every contender; run without --only.)");
        return;
    }
    let get = |c: Contender| {
        report
            .contenders
            .iter()
            .find(|m| m.contender == c)
            .expect("measured")
    };
    let (rdma, busy, tcp, tonic, tarpc) = (
        get(Contender::RdmaAdaptive),
        get(Contender::RdmaBusy),
        get(Contender::RpcTcp),
        get(Contender::Tonic),
        get(Contender::Tarpc),
    );
    let at_128 = |m: &Measured| {
        m.throughput_64b
            .iter()
            .find(|(n, _)| *n == 128)
            .map_or(0.0, |(_, r)| *r)
    };
    let at_size = |m: &Measured, size: usize| {
        m.goodput
            .iter()
            .find(|(s, _)| *s == size)
            .map_or(0.0, |(_, g)| *g)
    };
    let largest = |m: &Measured| at_size(m, 64 << 20);
    let verdict = |ok: bool| if ok { "met" } else { "missed" };
    println!("\nGoals:\n");
    println!("| goal | measured | |");
    println!("|---|---|---|");
    let p = rdma.latency_64b.p50_us / tonic.latency_64b.p50_us;
    println!(
        "| rdma 64 B p50, default mode ≤ 0.1× tonic | {p:.3}× | {} |",
        verdict(p <= 0.1)
    );
    println!(
        "| rdma 64 B p50, busy-poll ≤ 10 µs | {:.1} µs | {} |",
        busy.latency_64b.p50_us,
        verdict(busy.latency_64b.p50_us <= 10.0)
    );
    let best_rdma_rate = at_128(rdma).max(at_128(busy));
    println!(
        "| rdma calls/s at 128 in flight ≥ 5× tonic | {:.2}× | {} |",
        best_rdma_rate / at_128(tonic),
        verdict(best_rdma_rate >= 5.0 * at_128(tonic))
    );
    println!(
        "| rdma calls/s at 128 in flight ≥ 1.5× tarpc | {:.2}× | {} |",
        best_rdma_rate / at_128(tarpc),
        verdict(best_rdma_rate >= 1.5 * at_128(tarpc))
    );
    let send_buffer = |m: &Measured| {
        m.send_buffer_goodput
            .iter()
            .find(|(s, _)| *s == 64 << 20)
            .map_or(0.0, |(_, g)| *g)
    };
    let share = send_buffer(rdma).max(send_buffer(busy)) / report.floors.memcpy_gbps;
    println!(
        "| rdma 64 MiB echo of a SendBuffer ≥ 50% of memcpy | {:.0}% | {} |",
        share * 100.0,
        verdict(share >= 0.5)
    );
    let over_tonic = largest(rdma) / largest(tonic);
    println!(
        "| rdma 64 MiB echo ≥ 4× tonic (ordinary Bytes) | {over_tonic:.2}× | {} |",
        verdict(over_tonic >= 4.0)
    );
    let (mut worst_tonic, mut worst_tcp) = (f64::INFINITY, f64::INFINITY);
    for &(size, _) in &report.settings.large {
        worst_tonic = worst_tonic.min(at_size(rdma, size) / at_size(tonic, size));
        worst_tcp = worst_tcp.min(at_size(rdma, size) / at_size(tcp, size));
    }
    println!(
        "| rdma ≥ 2× tonic at every size from 256 KiB | worst {worst_tonic:.2}× | {} |",
        verdict(worst_tonic >= 2.0)
    );
    println!(
        "| rdma ≥ 1.5× tcp:// at every size from 256 KiB | worst {worst_tcp:.2}× | {} |",
        verdict(worst_tcp >= 1.5)
    );
    println!(
        "| tcp:// p50 ≤ tarpc p50 | {:.1} vs {:.1} µs | {} |",
        tcp.latency_64b.p50_us,
        tarpc.latency_64b.p50_us,
        verdict(tcp.latency_64b.p50_us <= tarpc.latency_64b.p50_us)
    );
    if let (Some(ours), Some(theirs)) = (tcp.cpu_per_call_us, tonic.cpu_per_call_us) {
        println!(
            "| in-memory CPU per call ≤ 1/3 of tonic's | {:.2}× | {} |",
            ours / theirs,
            verdict(ours * 3.0 <= theirs)
        );
    }
    print_stream_goals(rdma, busy, tonic, verdict);
}

/// The streaming goals: rdma:// (the better polling mode) against tonic.
fn print_stream_goals(
    rdma: &Measured,
    busy: &Measured,
    tonic: &Measured,
    verdict: impl Fn(bool) -> &'static str,
) {
    let (Some(ours), Some(ours_busy), Some(theirs)) =
        (&rdma.streams, &busy.streams, &tonic.streams)
    else {
        return;
    };
    let best = |value: fn(&StreamResults) -> f64| value(ours).max(value(ours_busy));
    for (name, value, goal) in [
        (
            "rdma 64 B messages/s, server stream ≥ 5× tonic",
            (|s: &StreamResults| s.server_stream_per_s) as fn(&StreamResults) -> f64,
            5.0,
        ),
        (
            "rdma 64 B messages/s, bidirectional stream ≥ 5× tonic",
            |s: &StreamResults| s.bidi_per_s,
            5.0,
        ),
        (
            "rdma upload in 1 MiB messages ≥ 2× tonic",
            |s: &StreamResults| s.upload_gbps,
            2.0,
        ),
    ] {
        let times = best(value) / value(theirs);
        println!("| {name} | {times:.2}× | {} |", verdict(times >= goal));
    }
}

fn write_outputs(report: &Report) -> Vec<String> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench-results");
    std::fs::create_dir_all(&dir).expect("target/bench-results");
    let mut written = Vec::new();
    let json = dir.join(format!("compare-{}.json", report.settings.mode));
    std::fs::write(
        &json,
        serde_json::to_string_pretty(report).expect("serialise"),
    )
    .expect("write JSON");
    written.push(json.display().to_string());

    let png = match plot::load_font() {
        Ok(()) => true,
        Err(why) => {
            eprintln!("PNG charts skipped (no font): {why}; SVG charts are written");
            false
        }
    };
    let latency = Chart {
        title: "64-byte echo latency, one call in flight".into(),
        x_label: "latency (µs, log scale)".into(),
        y_label: "fraction of calls at or below".into(),
        series: report
            .contenders
            .iter()
            .map(|m| Series {
                name: m.label.to_owned(),
                points: m.latency_64b.cdf.clone(),
            })
            .collect(),
    };
    let goodput = Chart {
        title: "Echo goodput against payload size".into(),
        x_label: "payload (MiB, log scale)".into(),
        y_label: "GB/s (both directions)".into(),
        series: report
            .contenders
            .iter()
            .map(|m| Series {
                name: m.label.to_owned(),
                points: m
                    .goodput
                    .iter()
                    .map(|(size, g)| (*size as f64 / (1 << 20) as f64, *g))
                    .collect(),
            })
            .collect(),
    };
    for (chart, stem) in [(latency, "latency-cdf"), (goodput, "goodput")] {
        match plot::write(&chart, &dir.join(stem), png) {
            Ok(files) => written.extend(files),
            Err(error) => eprintln!("chart {stem} failed: {error}"),
        }
    }
    written
}

/// rdma-rpc beside tonic and tarpc and the machine's floors, in one run.
///
/// Every contender's server runs in its own process (this binary, started
/// with `--serve <contender>`); the client runs here; both on current-thread
/// tokio runtimes unless `--multi-thread`. Prints progress on stderr and a
/// markdown table on stdout (ratios to tonic in brackets), then a verdict
/// per goal; writes the numbers as JSON and the charts (latency CDF,
/// goodput against size; SVG and PNG) to `target/bench-results/`.
/// `benches/README.md` explains every row.
#[derive(Debug, clap::Parser)]
#[command(name = "compare", args_override_self = true)]
struct Cli {
    /// Short runs (the default): 3,000 latency calls, 0.6 s per throughput
    /// point, echoes up to 64 MiB; under 2 minutes on 2 cores.
    #[arg(long, overrides_with = "full")]
    quick: bool,
    /// The numbers for a report: 20,000 latency calls, 3 s per throughput
    /// point, echoes up to 256 MiB.
    #[arg(long, overrides_with = "quick")]
    full: bool,
    /// Only these contenders, comma-separated [default: all of them; the
    /// goal verdicts need all].
    #[arg(
        long,
        value_name = "CONTENDERS",
        value_delimiter = ',',
        action = clap::ArgAction::Set
    )]
    only: Option<Vec<Contender>>,
    /// Busy processes competing for the CPUs during the whole run.
    #[arg(long, value_name = "N", default_value_t = 0)]
    load: usize,
    /// Multi-thread runtimes (2 workers, what `#[tokio::main]` gives) in
    /// both processes instead of current-thread ones.
    #[arg(long)]
    multi_thread: bool,
    /// Internal: serve CONTENDER and print `LISTENING <address>` (the
    /// server process this binary starts for each contender).
    #[arg(long, value_name = "CONTENDER", hide = true)]
    serve: Option<Contender>,
    /// Internal: keep a CPU busy until killed (the processes `--load` starts).
    #[arg(long, hide = true)]
    burn: bool,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some(floors::CHILD_FLAG) {
        return floors::run_child(&args[1..]);
    }
    let cli = <Cli as clap::Parser>::parse();
    if cli.multi_thread {
        contenders::use_multi_thread_runtimes();
    }
    if let Some(contender) = cli.serve {
        return contenders::serve(contender);
    }
    if cli.burn {
        burn();
    }
    let settings = Settings {
        load: cli.load,
        multi_thread: cli.multi_thread,
        ..if cli.full {
            Settings::full()
        } else {
            Settings::quick()
        }
    };
    let only = cli.only;
    let _load = BusyProcesses::start(settings.load);
    let started = Instant::now();
    let rdma_provider = rpc_transport_rdma::device::select(
        &rpc_transport_rdma::RdmaConfig::from_env().expect("RDMA settings"),
    )
    .map(|(provider, device)| format!("{} ({device})", provider.name()))
    .unwrap_or_else(|error| format!("unavailable: {error}"));

    let mut measured = Vec::new();
    let chosen = only.unwrap_or_else(|| Contender::ALL.to_vec());
    for contender in chosen {
        eprintln!(
            "[{:>5.1}s] {}",
            started.elapsed().as_secs_f64(),
            contender.label()
        );
        let (server, addr) = contenders::spawn_server(contender.key(), contender.poll_mode());
        register_rdma(contender.poll_mode());
        let result = contenders::runtime().block_on(measure(contender, &addr, &server, &settings));
        drop(server);
        measured.push(result);
    }
    eprintln!(
        "[{:>5.1}s] CPU per call over in-memory transports",
        started.elapsed().as_secs_f64()
    );
    for m in &mut measured {
        m.cpu_per_call_us = match m.contender {
            Contender::RdmaAdaptive | Contender::RdmaBusy => None,
            other => cpu_per_call(other, settings.overhead_calls),
        };
    }
    eprintln!("[{:>5.1}s] floors", started.elapsed().as_secs_f64());
    let rounds = settings.floor_rounds;
    let tcp = floors::tcp_ping_pong(rounds);
    let eventfd = floors::eventfd_ping_pong(rounds);
    let spin = floors::spin_ping_pong(rounds * 10);
    let us = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    let floors = Floors {
        tcp_pingpong_p50_us: us(&tcp, 0.5),
        tcp_pingpong_p99_us: us(&tcp, 0.99),
        eventfd_pingpong_p50_us: us(&eventfd, 0.5),
        spin_pingpong_p50_us: us(&spin, 0.5),
        memcpy_gbps: floors::memcpy_gbps(),
        process_vm_readv_gbps: floors::process_vm_readv_gbps(),
        process_vm_readv_huge_gbps: floors::process_vm_readv_huge_gbps(),
    };
    let report = Report {
        settings,
        rdma_provider,
        contenders: measured,
        floors,
    };
    print_table(&report);
    print_goals(&report);
    let written = write_outputs(&report);
    println!("\nWritten: {}", written.join(", "));
    eprintln!("[{:>5.1}s] done", started.elapsed().as_secs_f64());
}

/// Processes that keep a CPU busy each (this binary with `--burn`), killed
/// when dropped.
struct BusyProcesses(Vec<std::process::Child>);

impl BusyProcesses {
    fn start(count: usize) -> BusyProcesses {
        let exe = std::env::current_exe().expect("own path");
        BusyProcesses(
            (0..count)
                .map(|_| {
                    std::process::Command::new(&exe)
                        .arg("--burn")
                        .spawn()
                        .expect("start a busy process")
                })
                .collect(),
        )
    }
}

impl Drop for BusyProcesses {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Spins until killed (what `--load` runs, like `yes > /dev/null`). Exits
/// by itself after an hour in case its parent died without killing it.
fn burn() -> ! {
    let until = Instant::now() + Duration::from_secs(3600);
    let mut counter = 0u64;
    while Instant::now() < until {
        for _ in 0..1_000_000 {
            counter = std::hint::black_box(counter.wrapping_add(1));
        }
    }
    std::process::exit(0)
}

/// `256 KiB`, `64 MiB`: a payload size for a row label.
fn size_label(size: usize) -> String {
    if size >= 1 << 20 {
        format!("{} MiB", size >> 20)
    } else {
        format!("{} KiB", size >> 10)
    }
}
