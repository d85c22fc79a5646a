//! Verbs-level microbenchmark of the soft provider, beside the machine's floors.
//!
//! ```text
//! cargo run --release -p rdma-rpc-benches --bin verbs_pingpong [-- --rounds N] [--only busy|event]
//! ```
//! Two processes (this binary re-executes itself as the peer). Rows:
//! 64 B SEND/RECV ping-pong round trip in event mode (completion channel) and
//! busy-poll mode; RDMA READ goodput at 64 KiB, 1 MiB, 64 MiB; and the floors:
//! TCP loopback 64 B ping-pong, eventfd ping-pong, shared-memory busy-poll
//! ping-pong, memcpy and process_vm_readv of 64 MiB. Compare rows of one run.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rdma_rpc_benches::floors::{self, MESSAGE, REGION};
use rdma_rpc_benches::stats::{gbps, histogram, p50_p99, record};
use rpc_transport_rdma::setup::{self, QpListener};
use rpc_transport_rdma::verbs::{
    self, AccessFlags, CompletionChannel, CompletionQueue, ConnectOptions, QpCaps, QpInit,
    QueuePair, RecvWr, RegisteredBuffer, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
    wait_readable,
};

const RECV_SLOTS: usize = 16;

fn child(args: &[&str]) -> Child {
    Command::new(std::env::current_exe().expect("own path"))
        .arg("--child")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn peer")
}

// ---------------------------------------------------------------- soft verbs

struct Endpoint {
    qp: Arc<dyn QueuePair>,
    cq: Arc<dyn CompletionQueue>,
    channel: Arc<dyn CompletionChannel>,
    send: RegisteredBuffer,
    recv: RegisteredBuffer,
    region: RegisteredBuffer,
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
        qp.to_init().expect("init");
        for slot in 0..RECV_SLOTS {
            qp.post_recv(vec![RecvWr {
                wr_id: slot as u64,
                sg_list: vec![recv.sge(slot * MESSAGE, MESSAGE)],
            }])
            .expect("recv");
        }
        Endpoint {
            qp,
            cq,
            channel,
            send,
            recv,
            region,
            busy,
        }
    }

    /// Waits for the next completion of `opcode` (others are consumed and checked).
    fn wait_for(&self, opcode: WcOpcode) -> WorkCompletion {
        let mut batch = [WorkCompletion {
            wr_id: 0,
            status: WcStatus::GeneralErr,
            opcode: WcOpcode::Send,
            byte_len: 0,
            imm_data: None,
            qp_num: 0,
        }; 1];
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
        self.qp.post_send(vec![wr]).expect("send");
    }

    fn repost(&self, completion: &WorkCompletion) {
        let slot = completion.wr_id as usize;
        self.qp
            .post_recv(vec![RecvWr {
                wr_id: completion.wr_id,
                sg_list: vec![self.recv.sge(slot * MESSAGE, MESSAGE)],
            }])
            .expect("recv");
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

struct SoftRun {
    pingpong: Histogram<u64>,
    reads: Vec<(usize, f64)>,
}

fn soft_run(busy: bool, rounds: usize, with_reads: bool) -> SoftRun {
    let endpoint = Endpoint::new(busy);
    let rt = runtime();
    let listener = rt.block_on(QpListener::bind("127.0.0.1:0")).expect("bind");
    let port = listener.local_addr().expect("addr").port().to_string();
    let mut peer = child(&[
        "soft",
        &port,
        if busy { "busy" } else { "event" },
        &rounds.to_string(),
    ]);
    let established = rt
        .block_on(listener.accept(&endpoint.qp, "soft", &ConnectOptions::default(), b""))
        .expect("set-up");
    let info = &established.peer.payload;
    let remote_addr = u64::from_le_bytes(info[..8].try_into().expect("addr"));
    let rkey = u32::from_le_bytes(info[8..12].try_into().expect("rkey"));

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
        for (size, repeats) in [(64 << 10, 200u64), (1 << 20, 50), (REGION, 5)] {
            let post = |id: u64| {
                let wr = SendWr::new(
                    id,
                    SendOp::RdmaRead { remote_addr, rkey },
                    vec![endpoint.region.sge(0, size)],
                );
                endpoint.qp.post_send(vec![wr]).expect("read");
                endpoint.wait_for(WcOpcode::RdmaRead);
            };
            post(0);
            let start = Instant::now();
            for id in 0..repeats {
                post(id);
            }
            reads.push((size, gbps(size as u64 * repeats, start.elapsed())));
        }
        assert!(
            endpoint.region.as_slice()[..4096]
                .iter()
                .all(|&b| b == 0x5a),
            "READ brought the peer's bytes"
        );
    }
    drop(established);
    peer.wait().expect("peer");
    SoftRun { pingpong: h, reads }
}

fn soft_peer(port: &str, busy: bool, rounds: usize) {
    let mut endpoint = Endpoint::new(busy);
    endpoint.region.as_mut_slice().fill(0x5a);
    let mut info = endpoint.region.addr().to_le_bytes().to_vec();
    info.extend_from_slice(&endpoint.region.rkey().to_le_bytes());
    let rt = runtime();
    let mut established = rt
        .block_on(setup::connect(
            format!("127.0.0.1:{port}"),
            &endpoint.qp,
            "soft",
            &ConnectOptions::default(),
            &info,
        ))
        .expect("set-up");
    for i in 0..rounds as u64 {
        let got = endpoint.wait_for(WcOpcode::Recv);
        endpoint.repost(&got);
        endpoint.send_message(i);
    }
    // Serve READs until the parent closes the set-up stream.
    let mut byte = [0u8; 1];
    let _ = rt.block_on(tokio::io::AsyncReadExt::read(
        &mut established.stream,
        &mut byte,
    ));
}

// ---------------------------------------------------------------- entry

fn run_child(args: &[String]) {
    let arg = |i: usize| args[i].as_str();
    match arg(0) {
        "soft" => soft_peer(arg(1), arg(2) == "busy", arg(3).parse().expect("rounds")),
        other => panic!("unknown peer role {other}"),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some(floors::CHILD_FLAG) {
        return floors::run_child(&args[1..]);
    }
    if args.first().map(String::as_str) == Some("--child") {
        return run_child(&args[1..]);
    }
    let mut rounds = 5000usize;
    let mut only: Option<String> = None;
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        match arg.as_str() {
            "--rounds" => {
                rounds = iter
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--rounds N")
            }
            "--only" => only = iter.next().cloned(),
            other => panic!("unknown argument {other}; use --rounds N [--only busy|event]"),
        }
    }
    if let Some(mode) = only.as_deref() {
        // One soft row alone (for profiling it).
        let run = soft_run(mode == "busy", rounds, false);
        let (p50, p99) = p50_p99(&run.pingpong);
        println!("soft SEND/RECV ping-pong, {mode} mode: p50 {p50:.2} µs, p99 {p99:.2} µs");
        return;
    }
    eprintln!(
        "floors: TCP, eventfd, shared-memory spin ({rounds} rounds each), memcpy, process_vm_readv..."
    );
    let tcp = floors::tcp_ping_pong(rounds);
    let eventfd = floors::eventfd_ping_pong(rounds);
    let spin = floors::spin_ping_pong(rounds * 10);
    let memcpy = floors::memcpy_gbps();
    let vm = floors::process_vm_readv_gbps();
    eprintln!("soft provider: event mode (+ READ goodput), busy-poll mode...");
    let event = soft_run(false, rounds, true);
    let busy = soft_run(true, rounds, false);

    println!("Two processes, 64 B messages, {rounds} round trips per row (µs):\n");
    println!("| path | p50 | p99 |");
    println!("|---|---|---|");
    for (name, h) in [
        (
            "soft SEND/RECV ping-pong, event mode (completion channel)",
            &event.pingpong,
        ),
        ("soft SEND/RECV ping-pong, busy-poll mode", &busy.pingpong),
        ("floor: TCP loopback ping-pong", &tcp),
        ("floor: eventfd ping-pong (both block in read)", &eventfd),
        ("floor: shared-memory busy-poll ping-pong", &spin),
    ] {
        let (p50, p99) = p50_p99(h);
        println!("| {name} | {p50:.2} | {p99:.2} |");
    }
    let (event_p50, _) = p50_p99(&event.pingpong);
    let (eventfd_p50, _) = p50_p99(&eventfd);
    let (busy_p50, _) = p50_p99(&busy.pingpong);
    println!("\n| goodput | GB/s |");
    println!("|---|---|");
    for (size, rate) in &event.reads {
        println!("| soft RDMA READ {} KiB | {rate:.2} |", size >> 10);
    }
    println!("| floor: memcpy 64 MiB (one thread) | {memcpy:.2} |");
    println!("| floor: process_vm_readv 64 MiB | {vm:.2} |");
    let read_64m = event.reads.last().map_or(0.0, |(_, rate)| *rate);
    println!(
        "\nTargets: event p50 / eventfd floor = {:.2} (goal ≤ 1.2); busy-poll p50 = {busy_p50:.2} µs (goal ≤ 2); READ 64 MiB / memcpy = {:.2} (goal ≥ 0.5)",
        event_p50 / eventfd_p50,
        read_64m / memcpy
    );
}
