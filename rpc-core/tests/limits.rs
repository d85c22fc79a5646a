//! The server's resource limits under attack: each test runs one attack and
//! checks that it fails cleanly while a normal client keeps being served.
//!
//! | attack | defence |
//! |---|---|
//! | requests flooded on one connection, responses never read | bounded outbound queue: the connection stops reading |
//! | the same on many connections | server-wide outbound budget, an equal share each |
//! | many connections announcing large frames | server-wide receive budget |
//! | silent connections, slowloris | idle time-out |
//! | more connections than wanted | connection limit with a clean refusal |
//! | out of file descriptors | accept backs off and recovers |

mod suite;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use futures_util::{SinkExt, StreamExt};
use rpc_core::frame::{Frame, FrameFlags, FrameKind};
use rpc_core::transport::{self, TransportConfig};
use rpc_core::{Channel, Code, Metadata};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::suite::{Bed, MemBed, TcpBed, assert_echoes, probe, start_with};

/// Waits until `condition` holds, checking every 5 ms; panics after 20 s with `what`.
async fn until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A request frame for `/test.Probe/{method}` with its TCP length prefix.
fn raw_request(call_id: u64, method: &str, payload: Bytes) -> Bytes {
    let frame = Frame::request(
        call_id,
        format!("/test.Probe/{method}"),
        None,
        Metadata::new(),
        payload,
    )
    .encode();
    let mut out = BytesMut::with_capacity(4 + frame.len());
    out.put_u32_le(frame.len() as u32);
    out.put_slice(&frame);
    out.freeze()
}

/// Reads frames from a raw TCP connection until the server closes it (or
/// `limit` passes, which fails the test); returns them.
async fn frames_until_closed(stream: &mut TcpStream, limit: Duration) -> Vec<Frame> {
    let mut bytes = Vec::new();
    let read = tokio::time::timeout(limit, async {
        let mut chunk = [0u8; 4096];
        loop {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => bytes.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await;
    assert!(read.is_ok(), "the server did not close the connection");
    let mut frames = Vec::new();
    let mut rest = &bytes[..];
    while rest.len() >= 4 {
        let len = u32::from_le_bytes(rest[..4].try_into().unwrap()) as usize;
        let frame = Bytes::copy_from_slice(&rest[4..4 + len]);
        frames.push(Frame::decode(frame, 1 << 20).unwrap());
        rest = &rest[4 + len..];
    }
    frames
}

// ------------------------------------------- 1: flood, never read responses

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_that_never_reads_responses_is_held_back_by_the_outbound_queue() {
    const QUEUE: usize = 64 << 10;
    const REQUESTS: u64 = 65_536; // 4 KiB each: 256 MiB, far beyond any socket buffer
    let server = start_with(&TcpBed, |s| {
        s.outbound_queue_bytes(QUEUE)
            .max_concurrent_calls_per_connection(16)
    })
    .await;
    let stats = server.stats.clone();
    let addr = server.endpoint.authority().to_owned();

    let written = Arc::new(AtomicU64::new(0));
    let flooder = tokio::spawn({
        let written = written.clone();
        async move {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            let payload = Bytes::from(vec![7u8; 4096]);
            for call_id in 1..=REQUESTS {
                let request = raw_request(call_id, "Echo", payload.clone());
                if stream.write_all(&request).await.is_err() {
                    break;
                }
                written.fetch_add(1, Ordering::Relaxed);
            }
            stream
        }
    });

    // The queue fills and the connection stops reading. (A pause can also be
    // momentary, while the writer catches up; once the socket's buffers are
    // full it lasts, and the server reads nothing more.)
    let read_before = loop {
        until("the flooding connection pauses", || {
            stats.paused_connections() == 1
        })
        .await;
        let read = stats.frames_received();
        tokio::time::sleep(Duration::from_millis(100)).await;
        if stats.paused_connections() == 1 && stats.frames_received() == read {
            break read;
        }
    };

    // A normal client is served meanwhile.
    let normal = Channel::connect(server.endpoint.clone()).await.unwrap();
    for i in 0..20 {
        let text = format!("normal {i}");
        let response = normal.unary(probe("Echo", text.clone())).await.unwrap();
        assert_eq!(response.into_inner(), Bytes::from(text));
    }

    assert_eq!(
        stats.frames_received(),
        read_before + 20,
        "the paused connection read nothing while the normal client was served"
    );
    assert_eq!(stats.paused_connections(), 1);
    assert!(
        read_before < REQUESTS / 4,
        "the server read {read_before} of {REQUESTS} requests"
    );
    assert!(
        stats.outbound_queue_peak() <= QUEUE,
        "queued {} bytes on one connection, limit {QUEUE}",
        stats.outbound_queue_peak()
    );
    assert!(!flooder.is_finished(), "the flood was not held back");
    assert!(written.load(Ordering::Relaxed) < REQUESTS);

    // The flooder goes away: everything it held is released.
    flooder.abort();
    let _ = flooder.await;
    until("the flood's connection is gone", || {
        stats.connections() == 1 && stats.paused_connections() == 0
    })
    .await;
    until("its queue and frames are released", || {
        stats.outbound_queued_bytes() == 0 && stats.receive_budget().in_use() == 0
    })
    .await;
    assert_echoes(&normal, "still served").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_never_read_share_the_outbound_budget() {
    // Issue 30, attack 6: each of many peers that never read its answers
    // used to hold a whole outbound queue; together they hold the budget.
    const QUEUE: usize = 1 << 20;
    const BUDGET: usize = 512 << 10;
    const FLOODERS: usize = 4;
    let server = start_with(&TcpBed, |s| {
        s.outbound_queue_bytes(QUEUE)
            .outbound_budget(BUDGET)
            .max_concurrent_calls_per_connection(16)
    })
    .await;
    let stats = server.stats.clone();
    let mut flooders = Vec::new();
    for _ in 0..FLOODERS {
        let addr = server.endpoint.authority().to_owned();
        flooders.push(tokio::spawn(async move {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            let payload = Bytes::from(vec![7u8; 4096]);
            for call_id in 1..=65_536u64 {
                let request = raw_request(call_id, "Echo", payload.clone());
                if stream.write_all(&request).await.is_err() {
                    break;
                }
            }
            stream
        }));
    }
    until("every flooding connection pauses", || {
        stats.paused_connections() == FLOODERS
    })
    .await;
    // Held a while: the pauses last, and what is queued stays within the budget.
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(
            stats.outbound_queued_bytes() <= BUDGET,
            "{} bytes queued by {FLOODERS} connections, budget {BUDGET}",
            stats.outbound_queued_bytes()
        );
    }
    assert_eq!(stats.outbound_share(QUEUE), BUDGET / FLOODERS);
    assert!(stats.outbound_queue_peak() <= BUDGET / FLOODERS);
    let normal = Channel::connect(server.endpoint.clone()).await.unwrap();
    assert_echoes(&normal, "served beside the flooders").await;
    for flooder in flooders {
        flooder.abort();
        let _ = flooder.await;
    }
    until("the flooders' queues are released", || {
        stats.outbound_queued_bytes() == 0 && stats.connections() == 1
    })
    .await;
    assert_eq!(
        stats.outbound_share(QUEUE),
        BUDGET,
        "one connection: the whole budget"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_poll_ready_waits_while_its_outbound_queue_is_full() {
    // A "server" that accepts and reads nothing until told to.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (start_reading, reading) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let _ = reading.await;
        let mut sink = tokio::io::sink();
        let _ = tokio::io::copy(&mut socket, &mut sink).await;
    });

    let mut channel = Channel::builder(format!("tcp://{addr}").parse().unwrap())
        .outbound_queue_bytes(256 << 10)
        .no_keepalive()
        .connect()
        .await
        .unwrap();
    let payload = Bytes::from(vec![1u8; 64 << 10]);
    // The calls are driven from this task: each has reserved its room in the
    // queue (or queued for it) before readiness is checked again.
    let mut calls = futures_util::stream::FuturesUnordered::new();
    let mut started = 0;
    let blocked = loop {
        let _ = futures_util::poll!(calls.next());
        let ready = tokio::time::timeout(
            Duration::from_secs(1),
            tower::ServiceExt::ready(&mut channel),
        )
        .await;
        if ready.is_err() {
            break true;
        }
        if started >= 2000 {
            break false;
        }
        calls.push(tower::Service::call(
            &mut channel,
            probe("Echo", payload.clone()).map(Into::into),
        ));
        started += 1;
    };
    assert!(
        blocked,
        "poll_ready stayed ready through {started} calls of 64 KiB to a server that reads nothing"
    );

    // Once the peer reads, the queue drains and the channel is ready again.
    start_reading.send(()).unwrap();
    let ready = std::future::poll_fn(|cx| {
        let _ = calls.poll_next_unpin(cx);
        tower::Service::poll_ready(&mut channel, cx)
    });
    tokio::time::timeout(Duration::from_secs(10), ready)
        .await
        .expect("ready once the peer reads")
        .unwrap();
    drop(calls);
    server.abort();
}

// ---------------------------- 2: many connections announcing large frames

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_frames_on_many_connections_stay_within_the_receive_budget() {
    const FRAME: usize = 256 << 10;
    const BUDGET: usize = 4 * FRAME;
    let server = start_with(&TcpBed, |s| s.max_frame_len(FRAME).receive_budget(BUDGET)).await;
    let stats = server.stats.clone();
    let addr = server.endpoint.authority().to_owned();
    assert_eq!(stats.receive_budget().capacity(), BUDGET);

    // 20 connections each announce a whole frame and send most of it.
    let mut attackers = Vec::new();
    for _ in 0..20 {
        let mut stream = TcpStream::connect(&addr).await.unwrap();
        stream
            .write_all(&(FRAME as u32).to_le_bytes())
            .await
            .unwrap();
        stream
            .write_all(&vec![0u8; FRAME - (16 << 10)])
            .await
            .unwrap();
        attackers.push(stream);
    }
    until("20 connections are served", || stats.connections() == 20).await;
    until("the budget is taken", || {
        stats.receive_budget().in_use() == BUDGET
    })
    .await;

    // Small calls still go (per-connection allowance), on old and new connections.
    let normal = Channel::connect(server.endpoint.clone()).await.unwrap();
    for i in 0..10 {
        assert_echoes(&normal, if i % 2 == 0 { "small" } else { "calls" }).await;
    }
    assert_eq!(stats.receive_budget().in_use(), BUDGET);
    assert_eq!(
        stats.receive_budget().peak(),
        BUDGET,
        "the budget was exceeded"
    );

    // A large frame waits for the budget while it is taken...
    let large = pattern(FRAME - 1024);
    let waiting = tokio::spawn({
        let normal = normal.clone();
        let large = large.clone();
        async move { normal.unary(probe("Echo", large)).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiting.is_finished(), "a large frame passed a full budget");

    // ...and gets it when the attackers go.
    drop(attackers);
    let response = tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .expect("the large call completes once the budget is free")
        .unwrap()
        .unwrap();
    assert!(response.into_inner() == large);
    until("every reservation is released", || {
        stats.receive_budget().in_use() == 0 && stats.connections() == 1
    })
    .await;
    assert!(stats.receive_budget().peak() <= BUDGET);
}

fn pattern(len: usize) -> Bytes {
    (0..len)
        .map(|i| (i * 7 % 251) as u8)
        .collect::<Vec<u8>>()
        .into()
}

// ------------------------------------------------ 3: idle and slow peers

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_and_slowloris_connections_are_closed_after_the_idle_timeout() {
    let server = start_with(&TcpBed, |s| s.idle_timeout(Duration::from_millis(200))).await;
    let stats = server.stats.clone();
    let addr = server.endpoint.authority().to_owned();
    let normal = Channel::connect(server.endpoint.clone()).await.unwrap();

    // A connection that never sends a byte.
    let mut silent = TcpStream::connect(&addr).await.unwrap();
    // A connection that announces a frame and trickles it a byte per 50 ms.
    let mut slow = TcpStream::connect(&addr).await.unwrap();
    slow.write_all(&100u32.to_le_bytes()).await.unwrap();
    let (mut slow_read, mut slow_write) = slow.into_split();
    let trickle = tokio::spawn(async move {
        let mut sent = 0;
        while slow_write.write_all(&[1u8]).await.is_ok() {
            sent += 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        sent
    });

    // A call longer than the idle time-out is not cut: it is in flight.
    let long = normal
        .unary(probe("Sleep", 600u64.to_le_bytes().to_vec()))
        .await;
    assert!(long.is_ok(), "{long:?}");

    for (name, frames) in [
        (
            "silent",
            frames_until_closed(&mut silent, Duration::from_secs(10)).await,
        ),
        ("slowloris", {
            let mut bytes = Vec::new();
            tokio::time::timeout(Duration::from_secs(10), slow_read.read_to_end(&mut bytes))
                .await
                .expect("slowloris connection closed")
                .ok();
            let frame = Frame::decode(Bytes::copy_from_slice(&bytes[4..]), 1 << 20).unwrap();
            vec![frame]
        }),
    ] {
        assert_eq!(frames.len(), 1, "{name}: {frames:?}");
        assert_eq!(frames[0].kind, FrameKind::GoAway, "{name}");
        assert_eq!(frames[0].status, Code::Ok, "{name}: a graceful GOAWAY");
    }
    let sent = trickle.await.unwrap();
    assert!(
        sent >= 2,
        "the slowloris kept sending ({sent} bytes) and was still closed"
    );
    assert!(stats.idle_closed_connections() >= 2);
    assert_echoes(&normal, "unaffected").await;
}

/// An idle channel whose connection the server closed reconnects on its next call.
async fn idle_channel_reconnects_transparently(bed: &dyn Bed) {
    let server = start_with(bed, |s| s.idle_timeout(Duration::from_millis(200))).await;
    let stats = server.stats.clone();
    let channel = Channel::builder(server.endpoint.clone())
        .no_keepalive()
        .connect()
        .await
        .unwrap();
    let first = channel.unary(probe("Echo", "one")).await.unwrap();
    until("the idle connection is closed", || {
        stats.idle_closed_connections() == 1 && stats.connections() == 0
    })
    .await;
    let second = channel.unary(probe("Echo", "two")).await.unwrap();
    assert_eq!(second.get_ref(), &Bytes::from_static(b"two"));
    assert_ne!(
        first.metadata().get("x-peer"),
        second.metadata().get("x-peer"),
        "a new connection"
    );
    // A streaming call, too, opens on a new connection.
    until("the idle connection is closed", || {
        stats.idle_closed_connections() == 2 && stats.connections() == 0
    })
    .await;
    let mut counted = crate::suite::count_stream(&channel, 3, u64::MAX, 8, None)
        .await
        .unwrap()
        .into_inner();
    for n in 0..3 {
        assert_eq!(
            crate::suite::number_of(&counted.message().await.unwrap().unwrap()),
            n
        );
    }
    assert_eq!(counted.message().await.unwrap(), None);
    // Keepalive pings are frames: a channel that pings more often than the
    // time-out keeps its connection.
    let pinging = Channel::builder(server.endpoint.clone())
        .keepalive(Duration::from_millis(50), Duration::from_secs(5))
        .connect()
        .await
        .unwrap();
    let before = pinging.unary(probe("Echo", "a")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    let after = pinging.unary(probe("Echo", "b")).await.unwrap();
    assert_eq!(
        before.metadata().get("x-peer"),
        after.metadata().get("x-peer")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_channel_reconnects_transparently_tcp() {
    idle_channel_reconnects_transparently(&TcpBed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_channel_reconnects_transparently_mem() {
    idle_channel_reconnects_transparently(&MemBed).await;
}

/// A fake server that answers a connection's first request with a graceful
/// GOAWAY naming `last_seen` as the last call it saw, and serves the next
/// connection properly. Returns what the channel got.
async fn goaway_race(last_seen: impl Fn(u64) -> u64 + Send + 'static) -> Result<Bytes, Code> {
    let config = TransportConfig::default();
    let mut listener = transport::bind(&"tcp://127.0.0.1:0".parse().unwrap(), &config)
        .await
        .unwrap();
    let endpoint = listener.local_endpoint();
    let fake = tokio::spawn(async move {
        let mut first = listener.next().await.unwrap().unwrap();
        let request = Frame::decode(first.stream.next().await.unwrap().unwrap(), 1 << 20).unwrap();
        let goaway = Frame::control(
            FrameKind::GoAway,
            FrameFlags::EMPTY,
            last_seen(request.call_id),
        );
        first.sink.send(goaway.encode_parts()).await.unwrap();
        first.sink.close().await.unwrap();
        while let Some(Ok(_)) = first.stream.next().await {}
        let mut second = listener.next().await.unwrap().unwrap();
        let request = Frame::decode(second.stream.next().await.unwrap().unwrap(), 1 << 20).unwrap();
        let response = Frame::response(request.call_id, Code::Ok, Metadata::new(), request.payload);
        second.sink.send(response.encode_parts()).await.unwrap();
        second
    });
    let channel = Channel::connect(endpoint).await.unwrap();
    let outcome = channel.unary(probe("Echo", "racing")).await;
    let outcome = outcome.map(|r| r.into_inner()).map_err(|s| s.code());
    if outcome.is_ok() {
        drop(fake.await.unwrap());
    } else {
        fake.abort();
    }
    outcome
}

#[tokio::test]
async fn a_call_the_server_never_saw_before_its_goaway_is_retried_once() {
    // The GOAWAY says the server saw nothing: the call goes again, on a new connection.
    assert_eq!(
        goaway_race(|call_id| call_id - 1).await,
        Ok(Bytes::from_static(b"racing"))
    );
    // The GOAWAY says it saw the call: it may have run, so it is not sent again.
    assert_eq!(goaway_race(|call_id| call_id).await, Err(Code::Unavailable));
}

// ----------------------------------------------------- 4: connection limit

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_limit_are_refused_with_a_clear_error() {
    let server = start_with(&TcpBed, |s| s.max_connections(2)).await;
    let stats = server.stats.clone();
    let first = Channel::connect(server.endpoint.clone()).await.unwrap();
    let second = Channel::connect(server.endpoint.clone()).await.unwrap();
    assert_echoes(&first, "one").await;
    assert_echoes(&second, "two").await;
    assert_eq!(stats.connections(), 2);

    // A raw third connection reads the refusal.
    let mut raw = TcpStream::connect(server.endpoint.authority())
        .await
        .unwrap();
    let frames = frames_until_closed(&mut raw, Duration::from_secs(10)).await;
    assert_eq!(frames.len(), 1, "{frames:?}");
    assert_eq!(frames[0].kind, FrameKind::GoAway);
    assert_eq!(frames[0].status, Code::ResourceExhausted);
    let reason = String::from_utf8(frames[0].payload.clone().into_contiguous().to_vec()).unwrap();
    assert!(reason.contains("connection limit of 2"), "{reason}");

    // A channel's call fails with that reason.
    let third = Channel::connect(server.endpoint.clone()).await.unwrap();
    let status = third.unary(probe("Echo", "three")).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("connection limit of 2"),
        "{status:?}"
    );
    assert!(stats.refused_connections() >= 2);

    // The others keep working; once one closes, a new connection is served.
    assert_echoes(&first, "still one").await;
    assert_echoes(&second, "still two").await;
    drop(first);
    until("the first connection is gone", || stats.connections() == 1).await;
    let fourth = Channel::connect(server.endpoint.clone()).await.unwrap();
    assert_echoes(&fourth, "four").await;
    drop(fourth);
    until("the fourth connection is gone", || stats.connections() == 1).await;
    // The refused channel connects again by itself.
    assert_echoes(&third, "three, later").await;
}

// ------------------------------------------- 5: out of file descriptors

const EMFILE_CHILD: &str = "RPC_CORE_TEST_EMFILE_CHILD";

/// Not a test by itself: the server of
/// `out_of_file_descriptors_the_server_backs_off_and_recovers`, in a child
/// process whose descriptor limit is low.
#[tokio::test]
#[ignore = "helper process for out_of_file_descriptors_the_server_backs_off_and_recovers"]
async fn emfile_child_server() {
    if std::env::var_os(EMFILE_CHILD).is_none() {
        return;
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .init();
    let server = start_with(&TcpBed, |s| s).await;
    println!("LISTENING {}", server.endpoint);
    std::future::pending::<()>().await;
}

/// CPU time (user + system, in clock ticks) a process has used.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command (which may hold spaces) start after ") ".
    let fields: Vec<&str> = stat.rsplit_once(") ").unwrap().1.split(' ').collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_file_descriptors_the_server_backs_off_and_recovers() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    // The child runs this test binary again under `ulimit -n 64`: only its
    // limit changes, not this process's.
    let mut child = Command::new("sh")
        .arg("-c")
        .arg("ulimit -n 64 && exec \"$0\" \"$@\"")
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "emfile_child_server",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(EMFILE_CHILD, "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let pid = child.id();
    let mut child = Kill(child);
    let mut lines = BufReader::new(stdout).lines();
    let endpoint = loop {
        let line = lines.next().expect("child printed its endpoint").unwrap();
        if let Some((_, endpoint)) = line.split_once("LISTENING ") {
            break endpoint.trim().to_owned();
        }
    };
    let (warnings_tx, mut warnings) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if line.contains("accept failed") {
                let _ = warnings_tx.send(line);
            }
        }
    });
    let addr = endpoint.strip_prefix("tcp://").unwrap().to_owned();

    // More connections than the child has descriptors: the kernel queues the
    // rest, and the child's accept fails with EMFILE.
    let mut hogs = Vec::new();
    for _ in 0..120 {
        hogs.push(TcpStream::connect(&addr).await.unwrap());
    }
    let first = tokio::time::timeout(Duration::from_secs(20), warnings.recv())
        .await
        .expect("the child warns that accept failed")
        .unwrap();
    assert!(first.contains("WARN"), "{first}");
    assert!(
        first.contains("lack of resources") && first.contains("pausing"),
        "{first}"
    );
    let exhausted_at = Instant::now();
    let ticks_before = cpu_ticks(pid);

    // While out of descriptors it neither spins nor exits nor floods the log.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let ticks = cpu_ticks(pid) - ticks_before;
    assert!(
        ticks < 50,
        "the child used {ticks} ticks of CPU in 1.5 s out of descriptors: spinning"
    );
    assert!(child.0.try_wait().unwrap().is_none(), "the server exited");
    let mut repeated = 0;
    while warnings.try_recv().is_ok() {
        repeated += 1;
    }
    assert!(
        repeated <= (exhausted_at.elapsed().as_secs() / 5) as usize,
        "{repeated} more accept warnings within {:?}",
        exhausted_at.elapsed()
    );

    // Descriptors free up: it serves again.
    drop(hogs);
    let channel = Channel::connect(endpoint.as_str()).await.unwrap();
    let response = tokio::time::timeout(
        Duration::from_secs(20),
        channel.unary(probe("Echo", "back")),
    )
    .await
    .expect("served once descriptors are free")
    .unwrap();
    assert_eq!(response.into_inner(), Bytes::from_static(b"back"));
    assert!(child.0.try_wait().unwrap().is_none(), "the server exited");
}

/// One host cannot take every connection place: beyond its share (here 3
/// of 10) its new connections are refused with the reason, while a client
/// from another address is served; a freed place is its host's again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_holds_at_most_its_share_of_the_connections() {
    let server = start_with(&TcpBed, |s| {
        s.max_connections(10).max_connections_per_address(3)
    })
    .await;
    let stats = server.stats.clone();
    let target: std::net::SocketAddr = server.endpoint.authority().parse().unwrap();
    let from_second_address = || async move {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket
            .bind(std::net::SocketAddr::from(([127, 0, 0, 2], 0)))
            .unwrap();
        socket.connect(target).await.unwrap()
    };
    // Three idle connections from 127.0.0.2 are served (kept open).
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(from_second_address().await);
    }
    until("three connections are served", || stats.connections() == 3).await;
    // The fourth from that address reads the refusal.
    let mut fourth = from_second_address().await;
    let frames = frames_until_closed(&mut fourth, Duration::from_secs(10)).await;
    assert_eq!(frames.len(), 1, "{frames:?}");
    assert_eq!(frames[0].kind, FrameKind::GoAway);
    assert_eq!(frames[0].status, Code::ResourceExhausted);
    let reason = String::from_utf8(frames[0].payload.clone().into_contiguous().to_vec()).unwrap();
    assert!(
        reason.contains("connection limit of 3 per address reached for 127.0.0.2"),
        "{reason}"
    );
    // A client from 127.0.0.1 is served meanwhile.
    let channel = Channel::connect(server.endpoint.clone()).await.unwrap();
    assert_echoes(&channel, "another address").await;
    // A place freed is the address's again.
    drop(held.pop());
    until("the closed one is gone", || stats.connections() == 3).await;
    let again = from_second_address().await;
    until("its place is taken again", || stats.connections() == 4).await;
    drop(again);
}
