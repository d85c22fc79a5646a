//! tcp://'s framing and the channel over a deterministic, simulated network
//! (turmoil: hosts, links and time are simulated, one seed fixes every
//! schedule), under the faults a real network has: a partition mid-call,
//! both ways and one way (segments lost for good, as under a cut cable: the
//! stream stalls and only keepalive can tell), a peer that half-closes
//! mid-frame, a link that holds its segments for a while (a latency spike:
//! nothing lost), and the server's host crashing and coming back. What must hold (issue 34): every call ends with its own answer or
//! an error status within its deadline and a bound, never a hang or another
//! call's bytes; the channel serves again once the network does.
//!
//! The transport is rpc-core's length-prefixed framing (`framed_connection`,
//! what tcp:// runs over a socket) over turmoil's TCP streams, injected as a
//! value (`ChannelBuilder::transport`).

#[path = "suite/mod.rs"]
mod suite;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::{FutureExt, Stream, StreamExt};
use rpc_core::transport::tcp::framed_connection;
use rpc_core::transport::{
    Connection, Endpoint, Listener, Transport, TransportConfig, TransportError,
};
use rpc_core::{Channel, Code};
use tokio::time::Instant;

use crate::suite::{pattern, probe};

/// rpc-core's framing over turmoil's TCP.
struct SimTransport;

fn framed(stream: turmoil::net::TcpStream, max_frame_len: usize) -> Connection {
    let peer = stream
        .peer_addr()
        .map(|addr| addr.to_string())
        .unwrap_or_default();
    let (read, write) = stream.into_split();
    framed_connection(read, write, peer, max_frame_len, None)
}

impl Transport for SimTransport {
    fn connect(
        &self,
        endpoint: &Endpoint,
        config: &TransportConfig,
    ) -> BoxFuture<'static, Result<Connection, TransportError>> {
        let authority = endpoint.authority().to_owned();
        let max_frame_len = config.max_frame_len;
        async move {
            let stream = turmoil::net::TcpStream::connect(authority.as_str()).await?;
            Ok(framed(stream, max_frame_len))
        }
        .boxed()
    }

    fn bind(
        &self,
        endpoint: &Endpoint,
        config: &TransportConfig,
    ) -> BoxFuture<'static, Result<Box<dyn Listener>, TransportError>> {
        let authority = endpoint.authority().to_owned();
        let max_frame_len = config.max_frame_len;
        async move {
            let listener = turmoil::net::TcpListener::bind(authority.as_str()).await?;
            let local = Endpoint::new("sim", &listener.local_addr()?.to_string())?;
            let accepted = futures_util::stream::unfold(listener, move |listener| async move {
                let accepted = listener.accept().await;
                let connection = accepted
                    .map(|(stream, _)| framed(stream, max_frame_len))
                    .map_err(TransportError::from);
                Some((connection, listener))
            });
            Ok(Box::new(SimListener {
                accepted: Box::pin(accepted),
                local,
            }) as Box<dyn Listener>)
        }
        .boxed()
    }
}

struct SimListener {
    accepted: std::pin::Pin<Box<dyn Stream<Item = Result<Connection, TransportError>> + Send>>,
    local: Endpoint,
}

impl Stream for SimListener {
    type Item = Result<Connection, TransportError>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.accepted.poll_next_unpin(cx)
    }
}

impl Listener for SimListener {
    fn local_endpoint(&self) -> Endpoint {
        self.local.clone()
    }
}

/// The suite's probe server on `sim://0.0.0.0:9000` (the simulated host's
/// port 9000).
struct SimBed;

impl suite::Bed for SimBed {
    fn listen_endpoint(&self) -> String {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            rpc_core::transport::register("sim", Arc::new(SimTransport));
        });
        "sim://0.0.0.0:9000".into()
    }
}

/// How one call ended, checked against what it sent.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Answered,
    Failed(Code),
}

/// An Echo call of `len` bytes unique to `seed`, with `deadline`; panics on
/// another call's bytes, or on a call that outlives its deadline by more
/// than a second (simulated time).
async fn echo(channel: &Channel, len: usize, seed: u64, deadline: Duration) -> Outcome {
    let payload = pattern(len, 2 * seed + 1);
    let mut request = probe("Echo", payload.clone());
    request.set_timeout(deadline);
    let started = Instant::now();
    let outcome = match channel.unary(request).await {
        Ok(response) => {
            assert!(
                response.get_ref() == &payload,
                "call {seed}: another message's bytes"
            );
            Outcome::Answered
        }
        Err(status) => Outcome::Failed(status.code()),
    };
    let took = started.elapsed();
    assert!(
        took <= deadline + Duration::from_secs(1),
        "call {seed} took {took:?} with a {deadline:?} deadline ({outcome:?})"
    );
    outcome
}

/// Every call answered, or failed as a network fault makes calls fail:
/// `DEADLINE_EXCEEDED` or `UNAVAILABLE` (its time was checked by [`echo`]).
fn assert_answered_or_failed_in_time(outcomes: &[Outcome]) {
    assert!(
        outcomes.iter().all(|o| matches!(
            o,
            Outcome::Answered | Outcome::Failed(Code::DeadlineExceeded | Code::Unavailable)
        )),
        "{outcomes:?}"
    );
}

/// `count` calls at once of sizes up to 256 KiB (many segments each);
/// returns how they ended.
async fn calls_at_once(
    channel: &Channel,
    count: u64,
    first_seed: u64,
    deadline: Duration,
) -> Vec<Outcome> {
    let calls: Vec<_> = (0..count)
        .map(|i| {
            let channel = channel.clone();
            let len = [64usize, 4096, 64 << 10, 256 << 10][(i % 4) as usize];
            tokio::spawn(async move { echo(&channel, len, first_seed + i, deadline).await })
        })
        .collect();
    let mut outcomes = Vec::new();
    for call in calls {
        outcomes.push(call.await.expect("no panic"));
    }
    outcomes
}

/// Calls (1 s deadline each) until one is answered; returns how long that
/// took, or panics after `bound`.
async fn until_served(channel: &Channel, seed: u64, bound: Duration) -> Duration {
    let started = Instant::now();
    for attempt in 0.. {
        if echo(channel, 64, seed + attempt, Duration::from_secs(1)).await == Outcome::Answered {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < bound,
            "not served again within {bound:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    unreachable!()
}

/// What the client tells the simulation's driver (which alone may crash a host).
const CRASH_NOW: u32 = 1;
const BACK_UP: u32 = 2;

#[test]
fn calls_end_in_time_and_the_channel_recovers_under_partitions_holds_and_a_crash() {
    // Each seed fixes the links' latencies and every scheduling choice.
    for seed in 2026..2031 {
        println!("seed {seed}:");
        one_simulation(seed);
    }
}

fn one_simulation(seed: u64) {
    let mut sim = turmoil::Builder::new()
        .rng_seed(seed)
        .simulation_duration(Duration::from_secs(600))
        .min_message_latency(Duration::from_micros(100))
        .max_message_latency(Duration::from_millis(2))
        .build();
    sim.host("server", || async {
        let _server = suite::start(&SimBed).await;
        std::future::pending::<()>().await;
        Ok(())
    });
    let signal = Arc::new(AtomicU32::new(0));
    let client_signal = signal.clone();
    sim.client("client", async move {
        let channel = Channel::builder("sim://server:9000".parse::<Endpoint>()?)
            .transport(Arc::new(SimTransport))
            .keepalive(Duration::from_secs(5), Duration::from_secs(5))
            .connect_timeout(Duration::from_secs(2))
            .connect_lazy();

        // Healthy: every call answered.
        let healthy = calls_at_once(&channel, 64, 0, Duration::from_secs(5)).await;
        assert!(healthy.iter().all(|o| *o == Outcome::Answered), "{healthy:?}");

        // A partition mid-call: segments in flight are lost for good, the
        // stream stalls; each call ends by its deadline.
        let calls = tokio::spawn({
            let channel = channel.clone();
            async move { calls_at_once(&channel, 32, 1_000, Duration::from_secs(2)).await }
        });
        tokio::time::sleep(Duration::from_millis(3)).await;
        turmoil::partition("client", "server");
        let cut = calls.await?;
        let failed = cut.iter().filter(|o| **o != Outcome::Answered).count();
        assert!(failed > 0, "the partition cut no call: {cut:?}");
        assert_answered_or_failed_in_time(&cut);
        tokio::time::sleep(Duration::from_secs(3)).await;
        turmoil::repair("client", "server");
        // The stalled stream never resumes (nothing retransmits what was
        // lost): keepalive (5 s + 5 s) ends it and the channel connects anew.
        let recovered = until_served(&channel, 2_000, Duration::from_secs(30)).await;
        println!(
            "partition: {failed} of 32 calls failed in time, served again {recovered:?} after repair"
        );

        // A one-way partition (the server's segments lost, the client's
        // still arriving: requests run, answers vanish) mid-call: the same.
        let calls = tokio::spawn({
            let channel = channel.clone();
            async move { calls_at_once(&channel, 32, 2_500, Duration::from_secs(2)).await }
        });
        tokio::time::sleep(Duration::from_millis(3)).await;
        turmoil::partition_oneway("server", "client");
        let cut = calls.await?;
        assert_answered_or_failed_in_time(&cut);
        tokio::time::sleep(Duration::from_secs(3)).await;
        turmoil::repair_oneway("server", "client");
        let recovered_oneway = until_served(&channel, 2_800, Duration::from_secs(30)).await;
        println!(
            "one-way partition: {} of 32 calls failed in time, served again {recovered_oneway:?} after repair",
            cut.iter().filter(|o| **o != Outcome::Answered).count()
        );

        // A peer that half-closes mid-frame (half a length prefix, then
        // FIN): the server ends that connection, and serves the others.
        {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut raw = turmoil::net::TcpStream::connect("server:9000").await?;
            raw.write_all(&[0, 0]).await?;
            raw.shutdown().await?;
            let mut rest = Vec::new();
            let closed = tokio::time::timeout(Duration::from_secs(5), raw.read_to_end(&mut rest)).await;
            assert!(closed.is_ok(), "the server kept a half-closed connection open");
            let served = calls_at_once(&channel, 8, 2_900, Duration::from_secs(5)).await;
            assert!(served.iter().all(|o| *o == Outcome::Answered), "{served:?}");
        }

        // A link that holds its segments for 3 s, then delivers them all:
        // nothing is lost, calls with room in their deadlines are answered.
        turmoil::hold("client", "server");
        let calls = tokio::spawn({
            let channel = channel.clone();
            async move { calls_at_once(&channel, 32, 3_000, Duration::from_secs(10)).await }
        });
        tokio::time::sleep(Duration::from_secs(3)).await;
        turmoil::release("client", "server");
        let held = calls.await?;
        assert!(held.iter().all(|o| *o == Outcome::Answered), "{held:?}");

        // The server's host crashes with calls in flight (echoes, and calls
        // whose handler never answers), then comes back.
        let calls = tokio::spawn({
            let channel = channel.clone();
            async move { calls_at_once(&channel, 32, 4_000, Duration::from_secs(5)).await }
        });
        let hanging: Vec<_> = (0..16)
            .map(|_| {
                let channel = channel.clone();
                tokio::spawn(async move {
                    let mut request = probe("Hang", bytes::Bytes::new());
                    request.set_timeout(Duration::from_secs(5));
                    let started = Instant::now();
                    let status = channel.unary(request).await.expect_err("Hang never answers");
                    (status.code(), started.elapsed())
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        client_signal.store(CRASH_NOW, Ordering::SeqCst);
        let crashed = calls.await?;
        assert_answered_or_failed_in_time(&crashed);
        let mut hung = Vec::new();
        for call in hanging {
            let (code, took) = call.await?;
            assert!(
                matches!(code, Code::Unavailable | Code::DeadlineExceeded),
                "{code:?}"
            );
            assert!(took <= Duration::from_secs(6), "a Hang call took {took:?}");
            hung.push((code, took));
        }
        while client_signal.load(Ordering::SeqCst) != BACK_UP {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let recovered = until_served(&channel, 5_000, Duration::from_secs(30)).await;
        let failed = crashed.iter().filter(|o| **o != Outcome::Answered).count();
        let unavailable = hung.iter().filter(|(code, _)| *code == Code::Unavailable).count();
        let slowest = hung.iter().map(|(_, took)| *took).max().unwrap_or_default();
        println!(
            "crash: {failed} of 32 echoes failed in time; of 16 unanswered calls {unavailable} ended \
             UNAVAILABLE, the rest DEADLINE_EXCEEDED, the last after {slowest:?}; served again \
             {recovered:?} after the host came back"
        );
        let after = calls_at_once(&channel, 64, 6_000, Duration::from_secs(5)).await;
        assert!(after.iter().all(|o| *o == Outcome::Answered), "{after:?}");
        Ok(())
    });
    loop {
        if signal.load(Ordering::SeqCst) == CRASH_NOW {
            sim.crash("server");
            // Down for 2 s of simulated time, then back.
            for _ in 0..2_000 {
                sim.step().expect("the simulation runs");
            }
            sim.bounce("server");
            signal.store(BACK_UP, Ordering::SeqCst);
        }
        if sim.step().expect("the simulation runs") {
            break;
        }
    }
}
