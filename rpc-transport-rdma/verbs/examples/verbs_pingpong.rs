//! Verbs-level microbenchmark of the soft provider, beside the machine's floors.
//!
//! ```text
//! cargo run --release -p rdma-verbs --example verbs_pingpong [-- --rounds N] [--only busy|event [--pin|--pin-same]]
//! ```
//! Two processes (this binary re-executes itself as the peer; the two QPs
//! exchange their addresses over a loopback TCP stream). Rows:
//! 64 B SEND/RECV ping-pong round trip in event mode (completion channel) and
//! busy-poll mode; RDMA READ goodput at 64 KiB, 1 MiB, 64 MiB; and the floors:
//! TCP loopback 64 B ping-pong, eventfd ping-pong, shared-memory busy-poll
//! ping-pong, memcpy and process_vm_readv of 64 MiB (crate `rdma-rpc-floors`,
//! the same code as the benchmarks' `compare`). Compare rows of one run.
//!
//! It posts raw work requests (`QueuePair::post_send`/`post_recv`, which are
//! `unsafe`: the memory a request names is the device's until its
//! completion) to measure the provider without the owning wrappers'
//! bookkeeping; each post says why its memory is left alone meanwhile.

#![allow(unsafe_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rdma_rpc_floors::stats::{gbps, histogram, p50_p99, record};
use rdma_rpc_floors::{self as floors, MESSAGE, REGION};
use rdma_verbs::{
    self as verbs, AccessFlags, CompletionChannel, CompletionQueue, ConnectOptions, QpAddress,
    QpCaps, QpInit, QueuePair, RecvWr, RegisteredBuffer, SendOp, SendWr, WcOpcode, WcStatus,
    WorkCompletion, wait_readable,
};

const RECV_SLOTS: usize = 16;
/// Alternating (eventfd floor, soft event mode) measurements.
const EVENT_PAIRS: usize = 5;

fn child(args: &[&str]) -> Child {
    let mut command = Command::new(std::env::current_exe().expect("own path"));
    command
        .arg("--child")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    floors::pin_child(&mut command);
    command.spawn().expect("spawn peer")
}

// ---------------------------------------------------------------- soft verbs

/// A QP with its CQ, channel and buffers. Every buffer stays registered for
/// as long as the endpoint lives, so for as long as the QP can complete a
/// request naming it, and is deregistered before it is freed (which the
/// post contract allows while requests are outstanding).
struct Endpoint {
    qp: Arc<dyn QueuePair>,
    cq: Arc<dyn CompletionQueue>,
    channel: Arc<dyn CompletionChannel>,
    /// Every SEND's source: zeroed at set-up, then never read or written
    /// through a reference.
    send: RegisteredBuffer,
    /// Receive slots: never read or written through a reference (only the
    /// completions are looked at). Receives stay posted to the end, when no
    /// completion says the device is done with them: never dropped (freed
    /// or deregistered), leaked with the process.
    recv: std::mem::ManuallyDrop<RegisteredBuffer>,
    /// The parent's READ destination (read only after the READs completed);
    /// the peer's READ source (filled before the connection, then left alone).
    region: RegisteredBuffer,
    /// The same size, backed by transparent huge pages (the peer READs both).
    huge_region: RegisteredBuffer,
    busy: bool,
}

impl Endpoint {
    fn new(busy: bool) -> Endpoint {
        let context = verbs::provider("soft")
            .expect("soft")
            .open("soft0")
            .expect("open");
        let pd = context.alloc_pd().expect("pd");
        let channel = context.create_comp_channel().expect("channel");
        let cq = context.create_cq(4096, Some(&channel)).expect("cq");
        let caps = QpCaps {
            max_send_wr: 256,
            max_recv_wr: 256,
            ..QpCaps::default()
        };
        let qp = pd
            .create_qp(QpInit {
                send_cq: cq.clone(),
                recv_cq: cq.clone(),
                srq: None,
                caps,
                sq_sig_all: false,
            })
            .expect("qp");
        let send =
            RegisteredBuffer::new(&pd, MESSAGE, AccessFlags::LOCAL_WRITE).expect("send buffer");
        let recv = RegisteredBuffer::new(&pd, MESSAGE * RECV_SLOTS, AccessFlags::LOCAL_WRITE)
            .expect("recv buffer");
        let region = RegisteredBuffer::new(
            &pd,
            REGION,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        )
        .expect("region");
        let huge_region = RegisteredBuffer::new_huge(
            &pd,
            REGION,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        )
        .expect("huge-page region");
        qp.to_init().expect("init");
        for slot in 0..RECV_SLOTS {
            let wr = RecvWr {
                wr_id: slot as u64,
                sg_list: vec![recv.sge(slot * MESSAGE, MESSAGE)],
            };
            // SAFETY: the slot is in `recv`, which the endpoint built here
            // keeps registered while its QP lives, which nothing reads or
            // writes through a reference, and which the endpoint never drops
            // (`ManuallyDrop`: never freed under posted receives).
            unsafe { qp.post_recv(vec![wr]) }.expect("post_recv");
        }
        Endpoint {
            qp,
            cq,
            channel,
            send,
            recv: std::mem::ManuallyDrop::new(recv),
            region,
            huge_region,
            busy,
        }
    }

    /// Waits for the next completion of `opcode` (others are consumed and checked).
    fn wait_for(&self, opcode: WcOpcode) -> WorkCompletion {
        let mut batch = [WorkCompletion::BLANK; 1];
        loop {
            if self.cq.poll(&mut batch).expect("poll") == 1 {
                assert_eq!(batch[0].status, WcStatus::Success, "{:?}", batch[0]);
                if batch[0].opcode == opcode {
                    return batch[0];
                }
                continue;
            }
            if self.busy {
                std::hint::spin_loop();
                continue;
            }
            self.cq.req_notify(false).expect("arm");
            if self.cq.poll(&mut batch).expect("poll") == 1 {
                assert_eq!(batch[0].status, WcStatus::Success);
                if batch[0].opcode == opcode {
                    return batch[0];
                }
                continue;
            }
            assert!(
                wait_readable(self.channel.fd(), Duration::from_secs(10)).expect("poll fd"),
                "no completion in 10 s"
            );
            if let Some(cq) = self.channel.get_event().expect("event") {
                self.channel.ack_events(cq, 1);
            }
        }
    }

    fn send_message(&self, i: u64) {
        let wr = SendWr {
            signaled: i % 64 == 0,
            ..SendWr::new(i, SendOp::Send, vec![self.send.sge(0, MESSAGE)])
        };
        // SAFETY: `send` stays registered while the QP lives and is never
        // read or written through a reference after set-up, so posting it
        // again while earlier unsignaled SENDs of it may still be reading
        // it is fine (the device only reads a SEND's source).
        unsafe { self.qp.post_send(vec![wr]) }.expect("post_send");
    }

    fn repost(&self, completion: &WorkCompletion) {
        let slot = completion.wr_id as usize;
        let wr = RecvWr {
            wr_id: completion.wr_id,
            sg_list: vec![self.recv.sge(slot * MESSAGE, MESSAGE)],
        };
        // SAFETY: the slot's previous receive has completed (`completion`);
        // `recv` stays registered while the QP lives and is never read or
        // written through a reference.
        unsafe { self.qp.post_recv(vec![wr]) }.expect("post_recv");
    }
}

/// Sends one length-prefixed blob.
fn send_blob(stream: &mut TcpStream, bytes: &[u8]) {
    stream
        .write_all(&(bytes.len() as u32).to_le_bytes())
        .expect("send");
    stream.write_all(bytes).expect("send");
}

/// Receives one length-prefixed blob.
fn recv_blob(stream: &mut TcpStream) -> Vec<u8> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).expect("receive");
    let mut bytes = vec![0u8; u32::from_le_bytes(len) as usize];
    stream.read_exact(&mut bytes).expect("receive");
    bytes
}

/// Connects `qp` (INIT) to the peer's on `stream`, as rpc-transport-rdma's
/// set-up does without its checks: both sides send their QP's address and
/// `info`, connect to the other's address, and confirm with one byte.
/// Returns the peer's `info`.
fn establish(stream: &mut TcpStream, qp: &Arc<dyn QueuePair>, info: &[u8]) -> Vec<u8> {
    stream.set_nodelay(true).expect("nodelay");
    send_blob(stream, &qp.local_address().to_bytes());
    send_blob(stream, info);
    let address = QpAddress::from_bytes(&recv_blob(stream)).expect("peer address");
    let peer_info = recv_blob(stream);
    qp.to_rtr(&address, &ConnectOptions::default())
        .expect("to RTR");
    qp.to_rts().expect("to RTS");
    stream.write_all(&[1]).expect("ready");
    let mut ready = [0u8; 1];
    stream.read_exact(&mut ready).expect("peer ready");
    peer_info
}

struct SoftRun {
    pingpong: Histogram<u64>,
    reads: Vec<(usize, bool, f64)>,
}

fn soft_run(busy: bool, rounds: usize, with_reads: bool) -> SoftRun {
    let endpoint = Endpoint::new(busy);
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port().to_string();
    let mut peer = child(&[
        "soft",
        &port,
        if busy { "busy" } else { "event" },
        &rounds.to_string(),
    ]);
    let (mut stream, _) = listener.accept().expect("accept");
    let info = establish(&mut stream, &endpoint.qp, b"");
    let remote_addr = u64::from_le_bytes(info[..8].try_into().expect("addr"));
    let rkey = u32::from_le_bytes(info[8..12].try_into().expect("rkey"));
    let huge_addr = u64::from_le_bytes(info[12..20].try_into().expect("addr"));
    let huge_rkey = u32::from_le_bytes(info[20..24].try_into().expect("rkey"));

    let mut h = histogram();
    for i in 0..rounds as u64 {
        let start = Instant::now();
        endpoint.send_message(i);
        let got = endpoint.wait_for(WcOpcode::Recv);
        record(&mut h, start.elapsed());
        endpoint.repost(&got);
    }

    let mut reads = Vec::new();
    if with_reads {
        let sizes = [
            (64 << 10, 200u64, false),
            (1 << 20, 50, false),
            (REGION, 5, false),
            (1 << 20, 50, true),
            (REGION, 5, true),
        ];
        for (size, repeats, huge) in sizes {
            let (remote_addr, rkey) = if huge {
                (huge_addr, huge_rkey)
            } else {
                (remote_addr, rkey)
            };
            let post = |id: u64| {
                let wr = SendWr::new(
                    id,
                    SendOp::RdmaRead { remote_addr, rkey },
                    vec![endpoint.region.sge(0, size)],
                );
                // SAFETY: `region` stays registered while the QP lives, and
                // nothing reads or writes it through a reference until this
                // READ has completed: the next line waits for that, and the
                // only read of `region` comes after the last READ.
                unsafe { endpoint.qp.post_send(vec![wr]) }.expect("post_send");
                endpoint.wait_for(WcOpcode::RdmaRead);
            };
            post(0);
            let start = Instant::now();
            for id in 0..repeats {
                post(id);
            }
            reads.push((size, huge, gbps(size as u64 * repeats, start.elapsed())));
        }
        assert!(
            endpoint.region.as_slice()[..4096]
                .iter()
                .all(|&b| b == 0x5a),
            "READ brought the peer's bytes"
        );
    }
    // EOF on the set-up stream tells the peer to exit.
    drop(stream);
    peer.wait().expect("peer");
    SoftRun { pingpong: h, reads }
}

fn soft_peer(port: &str, busy: bool, rounds: usize) {
    let mut endpoint = Endpoint::new(busy);
    endpoint.region.as_mut_slice().fill(0x5a);
    endpoint.huge_region.as_mut_slice().fill(0x5a);
    let mut info = endpoint.region.addr().to_le_bytes().to_vec();
    info.extend_from_slice(&endpoint.region.rkey().to_le_bytes());
    info.extend_from_slice(&endpoint.huge_region.addr().to_le_bytes());
    info.extend_from_slice(&endpoint.huge_region.rkey().to_le_bytes());
    let mut stream = TcpStream::connect(format!("127.0.0.1:{port}")).expect("connect");
    establish(&mut stream, &endpoint.qp, &info);
    for i in 0..rounds as u64 {
        let got = endpoint.wait_for(WcOpcode::Recv);
        endpoint.repost(&got);
        endpoint.send_message(i);
    }
    // Serve READs until the parent closes the set-up stream.
    let mut byte = [0u8; 1];
    let _ = stream.read(&mut byte);
}

// ---------------------------------------------------------------- entry

fn run_child(args: &[String]) {
    let arg = |i: usize| args[i].as_str();
    match arg(0) {
        "soft" => soft_peer(arg(1), arg(2) == "busy", arg(3).parse().expect("rounds")),
        other => panic!("unknown peer role {other}"),
    }
}

/// Verbs-level microbenchmark of the soft provider, beside the machine's floors.
///
/// Two processes (this binary re-executes itself as the peer). Rows: 64 B
/// SEND/RECV ping-pong round trip in event mode (completion channel) and
/// busy-poll mode; RDMA READ goodput at 64 KiB, 1 MiB, 64 MiB; and the
/// floors: TCP loopback 64 B ping-pong, eventfd ping-pong, shared-memory
/// busy-poll ping-pong, memcpy and process_vm_readv of 64 MiB. Compare rows
/// of one run.
#[derive(Debug, clap::Parser)]
#[command(name = "verbs_pingpong", args_override_self = true)]
struct Cli {
    /// Round trips per ping-pong row.
    #[arg(long, value_name = "N", default_value_t = 5000)]
    rounds: usize,
    /// Only the soft SEND/RECV ping-pong in this mode, alone (for profiling
    /// it) [default: every row].
    #[arg(long, value_name = "MODE", value_parser = ["busy", "event"])]
    only: Option<String>,
    /// With --only: the two processes pinned to CPUs 0 and 1.
    #[arg(long)]
    pin: bool,
    /// With --only: both processes pinned to CPU 0.
    #[arg(long)]
    pin_same: bool,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some(floors::CHILD_FLAG) {
        floors::pin_from_env();
        return floors::run_child(&args[1..]);
    }
    if args.first().map(String::as_str) == Some("--child") {
        floors::pin_from_env();
        return run_child(&args[1..]);
    }
    let Cli {
        rounds,
        only,
        pin,
        pin_same,
    } = clap::Parser::parse();
    if let Some(mode) = only.as_deref() {
        // One soft row alone (for profiling it), optionally on two pinned CPUs.
        if pin || pin_same {
            floors::place(Some((0, usize::from(!pin_same))));
        }
        let run = soft_run(mode == "busy", rounds, false);
        let (p50, p99) = p50_p99(&run.pingpong);
        println!("soft SEND/RECV ping-pong, {mode} mode: p50 {p50:.2} µs, p99 {p99:.2} µs");
        return;
    }
    eprintln!(
        "floors: TCP, eventfd, shared-memory spin ({rounds} rounds each), memcpy, process_vm_readv..."
    );
    let tcp = floors::tcp_ping_pong(rounds);
    let spin = floors::spin_ping_pong(rounds * 10);
    let memcpy = floors::memcpy_gbps();
    let vm = floors::process_vm_readv_gbps();
    // A wake-up on these VMs costs ~3 µs when both processes share a core
    // and ~40 µs across cores (the woken vCPU was halted), and which one an
    // unpinned pair of processes gets drifts from run to run. So the eventfd
    // floor and soft event mode run alternately, in pairs, with the two
    // processes pinned to different CPUs (the case that costs), and the
    // target uses the median of the pairs' ratios.
    let pinned = floors::place(Some((0, 1)));
    eprintln!(
        "eventfd floor and soft event mode, alternately ({EVENT_PAIRS} pairs, {})...",
        if pinned {
            "processes pinned to CPUs 0 and 1"
        } else {
            "unpinned: fewer than 2 CPUs"
        }
    );
    let mut eventfd = histogram();
    let mut event = histogram();
    let mut ratios = Vec::new();
    let mut reads = Vec::new();
    for pair in 0..EVENT_PAIRS {
        let floor = floors::eventfd_ping_pong(rounds);
        let run = soft_run(false, rounds, pair == 0);
        let (floor_p50, _) = p50_p99(&floor);
        let (event_p50, _) = p50_p99(&run.pingpong);
        eprintln!("  pair {pair}: eventfd {floor_p50:.2} µs, soft event {event_p50:.2} µs");
        ratios.push(event_p50 / floor_p50);
        eventfd.add(&floor).expect("same histogram bounds");
        event.add(&run.pingpong).expect("same histogram bounds");
        if pair == 0 {
            reads = run.reads;
        }
    }
    // For information: the same pair with both processes on one CPU, where
    // a wake-up is cheap and the provider's own work per message shows.
    let same_core = floors::place(Some((0, 0))).then(|| {
        let floor = floors::eventfd_ping_pong(rounds);
        let run = soft_run(false, rounds, false);
        (p50_p99(&floor).0, p50_p99(&run.pingpong).0)
    });
    floors::place(None);
    ratios.sort_by(f64::total_cmp);
    let median_ratio = ratios[ratios.len() / 2];
    eprintln!("soft provider: busy-poll mode...");
    let busy = soft_run(true, rounds, false);

    println!(
        "Two processes, 64 B messages, {rounds} round trips per row (event mode and eventfd: {EVENT_PAIRS} alternating runs each, merged, processes on different CPUs) (µs):\n"
    );
    println!("| path | p50 | p99 |");
    println!("|---|---|---|");
    for (name, h) in [
        (
            "soft SEND/RECV ping-pong, event mode (completion channel)",
            &event,
        ),
        ("soft SEND/RECV ping-pong, busy-poll mode", &busy.pingpong),
        ("floor: TCP loopback ping-pong", &tcp),
        ("floor: eventfd ping-pong (both block in read)", &eventfd),
        ("floor: shared-memory busy-poll ping-pong", &spin),
    ] {
        let (p50, p99) = p50_p99(h);
        println!("| {name} | {p50:.2} | {p99:.2} |");
    }
    let (busy_p50, _) = p50_p99(&busy.pingpong);
    println!("\n| goodput | GB/s |");
    println!("|---|---|");
    for (size, huge, rate) in &reads {
        let pages = if *huge {
            "transparent huge pages"
        } else {
            "4 KiB pages"
        };
        println!(
            "| soft RDMA READ {} KiB, from {pages} | {rate:.2} |",
            size >> 10
        );
    }
    println!("| floor: memcpy 64 MiB (one thread) | {memcpy:.2} |");
    println!("| floor: process_vm_readv 64 MiB | {vm:.2} |");
    if let Some((floor, event)) = same_core {
        println!(
            "\nBoth processes on one CPU (information): eventfd {floor:.2} µs, soft event mode {event:.2} µs p50 ({:.2}×)",
            event / floor
        );
    }
    let read_64m = reads.last().map_or(0.0, |(_, _, rate)| *rate);
    let pairs: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
    println!(
        "\nTargets: event p50 / eventfd floor = {median_ratio:.2}, median of pairs [{}] (goal ≤ 1.2); busy-poll p50 = {busy_p50:.2} µs (goal ≤ 2); READ 64 MiB / memcpy = {:.2} (goal ≥ 0.5)",
        pairs.join(", "),
        read_64m / memcpy
    );
}
