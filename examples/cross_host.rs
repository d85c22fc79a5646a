//! The two-host suite: a server on one host, a client on another, every call
//! kind checked end to end across the link between them, and calls kept in
//! flight while that link loses packets, slows down, goes down, or the
//! server's host dies.
//!
//! ```text
//! cross_host serve rdma://10.0.2.1:50051      # on the server's host
//! cross_host check rdma://10.0.2.1:50051      # on the client's: every call kind, 2,000
//!                                             # concurrent calls, 48 MiB both ways, leaks
//! cross_host load rdma://10.0.2.1:50051 --label "loss 10%" --expect complete \
//!     --fault "tc qdisc add dev eth0 root netem loss 10%" --restore "tc qdisc del dev eth0 root"
//! ```
//!
//! The VM stage runs it between two guests (`scripts/rdma-vm/pair`); it runs
//! the same between two real machines. `check` ends with a `test result:`
//! line and fails on any wrong answer; `load` prints one row of the fault
//! table (docs/providers.md) and fails when the run broke what `--expect`
//! says must hold. Payloads are checked by content, not only by length.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use rdma_rpc_examples::cross_host::cross_host_client::CrossHostClient;
use rdma_rpc_examples::cross_host::cross_host_server::{CrossHost, CrossHostServer};
use rdma_rpc_examples::cross_host::{
    AccountingReply, AccountingRequest, Blob, Digest, DownloadRequest,
};
use rdma_rpc_examples::{FNV1A_START, ResponseStream, fnv1a, init_logging};
use rpc_core::bytes::Bytes;
use rpc_core::client::Backoff;
use rpc_core::transport::Endpoint;
use rpc_core::{Channel, Code, Request, Response, Server, Status};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, clap::Parser)]
#[command(name = "cross_host", about = "The two-host suite: serve, check, load")]
enum Cli {
    /// Serves the suite's service on ENDPOINT until interrupted.
    Serve {
        #[arg(value_name = "ENDPOINT")]
        listen: String,
    },
    /// Every call kind against a server on another host; fails on any wrong answer or leak.
    Check {
        #[arg(value_name = "ENDPOINT")]
        endpoint: String,
        /// Calls in flight at once in the concurrency check.
        #[arg(long, default_value_t = 2000)]
        concurrent: usize,
        /// MiB echoed both ways in the large-payload check.
        #[arg(long, default_value_t = 48)]
        large_mib: usize,
    },
    /// Keeps small calls, large (RDMA READ) echoes and a bidirectional stream in flight for
    /// SECONDS, runs FAULT part way, RESTORE after it, and prints one row of the fault table.
    Load {
        #[arg(value_name = "ENDPOINT")]
        endpoint: String,
        /// The row's name.
        #[arg(long)]
        label: String,
        #[arg(long, default_value_t = 12.0)]
        seconds: f64,
        /// A shell command that breaks the link (run at --fault-at).
        #[arg(long)]
        fault: Option<String>,
        /// A shell command that mends it (run --fault-for after the fault).
        #[arg(long)]
        restore: Option<String>,
        #[arg(long, default_value_t = 3.0)]
        fault_at: f64,
        #[arg(long, default_value_t = 2.0)]
        fault_for: f64,
        /// What must hold: `complete` (every call answered correctly), `unavailable` (calls
        /// in flight end UNAVAILABLE within the budget and 1 s, and calls succeed again after
        /// the restore), `dead` (the server is gone: calls end UNAVAILABLE within the budget
        /// and 1 s; its accounting is not asked for).
        #[arg(long, default_value = "complete")]
        expect: Expect,
        /// The retry budget the fault must be noticed within (plus 1 s), in milliseconds.
        #[arg(long, default_value_t = 1000)]
        budget_ms: u64,
        /// Keepalive interval and timeout of the channel, in milliseconds each
        /// (default: the channel's, 30 s and 20 s).
        #[arg(long)]
        keepalive_ms: Option<u64>,
        /// Small (64 B) calls in flight.
        #[arg(long, default_value_t = 16)]
        small: usize,
        /// Large echoes in flight, and their size in KiB.
        #[arg(long, default_value_t = 2)]
        large: usize,
        #[arg(long, default_value_t = 1024)]
        large_kib: usize,
        /// Seconds a call (or a stream round trip) may take before it counts as hung.
        #[arg(long, default_value_t = 20)]
        deadline_s: u64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Expect {
    Complete,
    Unavailable,
    Dead,
}

fn main() -> Result<(), Error> {
    let cli: Cli = clap::Parser::parse();
    init_logging();
    rpc_transport_rdma::register()?;
    // A user's `#[tokio::main]`: the multi-thread runtime.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        match cli {
            Cli::Serve { listen } => serve(&listen).await,
            Cli::Check {
                endpoint,
                concurrent,
                large_mib,
            } => check(&endpoint, concurrent, large_mib << 20).await,
            Cli::Load {
                endpoint,
                label,
                seconds,
                fault,
                restore,
                fault_at,
                fault_for,
                expect,
                budget_ms,
                keepalive_ms,
                small,
                large,
                large_kib,
                deadline_s,
            } => {
                let plan = LoadPlan {
                    label,
                    run_for: Duration::from_secs_f64(seconds),
                    fault,
                    restore,
                    fault_at: Duration::from_secs_f64(fault_at),
                    fault_for: Duration::from_secs_f64(fault_for),
                    expect,
                    budget: Duration::from_millis(budget_ms),
                    keepalive: keepalive_ms.map(Duration::from_millis),
                    small,
                    large,
                    large_len: large_kib << 10,
                    deadline: Duration::from_secs(deadline_s),
                };
                load(&endpoint, plan).await
            }
        }
    })
}

// ------------------------------------------------------------------ server

/// Message `seq` of `len` bytes: every byte depends on both, so a slot
/// mixed up with another's, or a READ from the wrong offset, shows.
fn fill(seq: u64, len: usize) -> Bytes {
    let mut data = vec![0u8; len];
    let mut x = seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    data.into()
}

/// The largest message `download` makes (it is told sizes by a client).
const MAX_DOWNLOAD_LEN: u32 = 16 << 20;

#[derive(Debug, Clone, Copy)]
struct CrossHostService;

impl CrossHost for CrossHostService {
    async fn echo(&self, request: Request<Blob>) -> Result<Response<Blob>, Status> {
        let blob = request.into_inner();
        if blob.fail_code != 0 {
            return Err(Status::new(
                Code::from(blob.fail_code),
                format!("message {} failed as it asked", blob.seq),
            ));
        }
        Ok(Response::new(blob))
    }

    type DownloadStream = ResponseStream<Blob>;

    async fn download(
        &self,
        request: Request<DownloadRequest>,
    ) -> Result<Response<Self::DownloadStream>, Status> {
        let DownloadRequest { count, size } = request.into_inner();
        if size > MAX_DOWNLOAD_LEN {
            return Err(Status::invalid_argument(format!(
                "messages of {size} bytes: at most {MAX_DOWNLOAD_LEN}"
            )));
        }
        let messages = futures_util::stream::iter(0..u64::from(count)).map(move |seq| {
            Ok(Blob {
                seq,
                data: fill(seq, size as usize),
                fail_code: 0,
            })
        });
        Ok(Response::new(Box::pin(messages)))
    }

    async fn upload(
        &self,
        request: Request<rpc_core::Streaming<Blob>>,
    ) -> Result<Response<Digest>, Status> {
        let mut messages = request.into_inner();
        let mut digest = Digest {
            fnv1a: FNV1A_START,
            ..Digest::default()
        };
        while let Some(blob) = messages.message().await? {
            digest.messages += 1;
            digest.bytes += blob.data.len() as u64;
            digest.fnv1a = fnv1a(digest.fnv1a, &blob.data);
        }
        Ok(Response::new(digest))
    }

    type PipeStream = ResponseStream<Blob>;

    async fn pipe(
        &self,
        request: Request<rpc_core::Streaming<Blob>>,
    ) -> Result<Response<Self::PipeStream>, Status> {
        let back = futures_util::stream::unfold(Some(request.into_inner()), |inbound| async {
            let mut inbound = inbound?;
            match inbound.message().await {
                Ok(Some(blob)) => Some((Ok(blob), Some(inbound))),
                Ok(None) => None,
                Err(status) => Some((Err(status), None)),
            }
        });
        Ok(Response::new(Box::pin(back)))
    }

    async fn accounting(
        &self,
        _request: Request<AccountingRequest>,
    ) -> Result<Response<AccountingReply>, Status> {
        let accounting = rdma_accounting().map_err(|error| Status::internal(error.to_string()))?;
        Ok(Response::new(accounting))
    }
}

/// This process's rdma:// accounting.
fn device_accounting() -> Result<rpc_transport_rdma::device::Accounting, Error> {
    let config = rpc_transport_rdma::RdmaConfig::from_env()?;
    Ok(rpc_transport_rdma::device::open(&config)?.accounting())
}

/// This process's rdma:// accounting, as the proto carries it.
fn rdma_accounting() -> Result<AccountingReply, Error> {
    let a = device_accounting()?;
    Ok(AccountingReply {
        connections: a.connections as u64,
        committed_receive_slots: a.committed_receive_slots as u64,
        grown_receive_slots: a.grown_receive_slots as u64,
        send_slots_out: a.send_slots_out as u64,
        lost_send_slots: a.lost_send_slots as u64,
        rendezvous_buffers_out: a.rendezvous_buffers_out as u64,
        rendezvous_bytes_charged: a.rendezvous_bytes_charged as u64,
        leaked_buffers: a.leaked_buffers,
    })
}

async fn serve(listen: &str) -> Result<(), Error> {
    let listening = Server::builder()
        .add_service(CrossHostServer::new(CrossHostService))
        .listen(listen)
        .await?;
    println!(
        "cross_host server listening on {}",
        listening.local_endpoint()
    );
    listening
        .serve_with_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    println!("cross_host server stopped");
    Ok(())
}

// ------------------------------------------------------------------ check

/// A channel to `endpoint` with keepalive probes `keepalive` apart (and
/// `keepalive` to answer), or the channel's default ones.
fn channel(endpoint: &str, keepalive: Option<Duration>) -> Result<Channel, Error> {
    let endpoint: Endpoint = endpoint.parse()?;
    let mut builder = Channel::builder(endpoint);
    if let Some(keepalive) = keepalive {
        builder = builder.keepalive(keepalive, keepalive);
    }
    Ok(builder
        // Back within half a second of a link's return, not the default 5 s.
        .backoff(Backoff {
            initial: Duration::from_millis(50),
            max: Duration::from_millis(500),
            jitter: 0.5,
        })
        .connect_lazy())
}

/// The longest one check may take (TCG-emulated guests are slow, not this slow).
const STEP_TIMEOUT: Duration = Duration::from_secs(180);

/// One named check: passes or says why not.
async fn step<F>(passed: &mut u32, failed: &mut u32, name: &str, check: F)
where
    F: std::future::Future<Output = Result<String, Error>>,
{
    let started = Instant::now();
    // A stalled link fails the step instead of hanging the suite.
    let bounded = async {
        tokio::time::timeout(STEP_TIMEOUT, check)
            .await
            .unwrap_or_else(|_| Err(format!("not done within {STEP_TIMEOUT:?}").into()))
    };
    match bounded.await {
        Ok(detail) => {
            *passed += 1;
            println!("ok {name}: {detail} ({:.2?})", started.elapsed());
        }
        Err(error) => {
            *failed += 1;
            println!("FAILED {name}: {error}");
        }
    }
}

fn blob(seq: u64, len: usize) -> Blob {
    Blob {
        seq,
        data: fill(seq, len),
        fail_code: 0,
    }
}

fn expect_blob(got: &Blob, seq: u64, len: usize) -> Result<(), Error> {
    if got.seq != seq || got.data != fill(seq, len) {
        return Err(format!(
            "message {seq} of {len} bytes came back as message {} of {} bytes, or with other bytes",
            got.seq,
            got.data.len()
        )
        .into());
    }
    Ok(())
}

async fn check(endpoint: &str, concurrent: usize, large_len: usize) -> Result<(), Error> {
    let client = CrossHostClient::new(channel(endpoint, None)?);
    let (mut passed, mut failed) = (0, 0);
    let (p, f) = (&mut passed, &mut failed);

    step(p, f, "unary", async {
        let sizes = [0, 1, 100, 4000, 4097, 65_536, 1 << 20];
        let mut client = client.clone();
        for seq in 0..210u64 {
            let len = sizes[seq as usize % sizes.len()];
            let reply = client.echo(blob(seq, len)).await?.into_inner();
            expect_blob(&reply, seq, len)?;
        }
        Ok(format!("210 echoes of {sizes:?} bytes"))
    })
    .await;

    step(p, f, "error status", async {
        let mut client = client.clone();
        let status = client
            .echo(Blob {
                seq: 7,
                fail_code: Code::NotFound as i32,
                ..Blob::default()
            })
            .await
            .err()
            .ok_or("a call asked to fail succeeded")?;
        if status.code() != Code::NotFound || !status.message().contains("message 7") {
            return Err(format!("wrong status: {status:?}").into());
        }
        Ok(format!("{:?}: {}", status.code(), status.message()))
    })
    .await;

    step(p, f, "server stream", async {
        let mut client = client.clone();
        let mut total = 0;
        for (count, size) in [(1000u32, 4096u32), (6, 8 << 20)] {
            let mut messages = client
                .download(DownloadRequest { count, size })
                .await?
                .into_inner();
            let mut seq = 0;
            while let Some(got) = messages.message().await? {
                expect_blob(&got, seq, size as usize)?;
                seq += 1;
                total += got.data.len();
            }
            if seq != u64::from(count) {
                return Err(format!("{seq} of {count} messages came").into());
            }
        }
        Ok(format!("1,000 × 4 KiB and 6 × 8 MiB, {total} bytes"))
    })
    .await;

    step(p, f, "client stream", async {
        let mut client = client.clone();
        let sizes: Vec<usize> = (0..1000).map(|_| 4096).chain([8 << 20; 4]).collect();
        let mut expected = Digest {
            fnv1a: FNV1A_START,
            ..Digest::default()
        };
        let blobs: Vec<Blob> = sizes
            .iter()
            .enumerate()
            .map(|(seq, &len)| blob(seq as u64, len))
            .collect();
        for b in &blobs {
            expected.messages += 1;
            expected.bytes += b.data.len() as u64;
            expected.fnv1a = fnv1a(expected.fnv1a, &b.data);
        }
        let digest = client
            .upload(futures_util::stream::iter(blobs))
            .await?
            .into_inner();
        if digest != expected {
            return Err(format!("sent {expected:?}, the server counted {digest:?}").into());
        }
        Ok(format!(
            "{} messages, {} bytes",
            digest.messages, digest.bytes
        ))
    })
    .await;

    step(p, f, "bidirectional stream", async {
        let mut client = client.clone();
        let (send, sent) = tokio::sync::mpsc::channel::<Blob>(64);
        let outgoing = tokio_stream_from(sent);
        let mut back = client.pipe(outgoing).await?.into_inner();
        let sizes = [64usize, 4096, 300_000];
        let writer = tokio::spawn(async move {
            for seq in 0..1000u64 {
                if send
                    .send(blob(seq, sizes[seq as usize % sizes.len()]))
                    .await
                    .is_err()
                {
                    break;
                }
            }
        });
        for seq in 0..1000u64 {
            let got = back.message().await?.ok_or("the stream ended early")?;
            expect_blob(&got, seq, sizes[seq as usize % sizes.len()])?;
        }
        writer.await?;
        if back.message().await?.is_some() {
            return Err("a message more than was sent came back".into());
        }
        Ok("1,000 messages of 64 B, 4 KiB and 300 KB, each back in order".to_owned())
    })
    .await;

    step(p, f, "concurrent calls", async {
        let calls = (0..concurrent as u64).map(|seq| {
            let mut client = client.clone();
            async move {
                let reply = client.echo(blob(seq, 256)).await?.into_inner();
                expect_blob(&reply, seq, 256)
            }
        });
        let results = futures_util::future::join_all(calls).await;
        let bad = results.iter().filter(|r| r.is_err()).count();
        if let Some(Err(error)) = results.into_iter().find(|r| r.is_err()) {
            return Err(format!("{bad} of {concurrent} calls failed; the first: {error}").into());
        }
        Ok(format!("{concurrent} calls of 256 B in flight at once"))
    })
    .await;

    step(p, f, "large payload both ways", async {
        let mut client = client.clone();
        let started = Instant::now();
        let reply = client.echo(blob(48, large_len)).await?.into_inner();
        let took = started.elapsed();
        expect_blob(&reply, 48, large_len)?;
        Ok(format!(
            "{} MiB there and back, {:.1} MB/s each way",
            large_len >> 20,
            large_len as f64 / took.as_secs_f64() / 1e6 * 2.0
        ))
    })
    .await;

    drop(client);
    step(p, f, "accounting", async {
        let lost = client_settled().await?;
        let server_side = server_accounting(endpoint).await?;
        Ok(format!(
            "this side settled ({lost} send slots given up); the server holds {server_side:?} \
             (the asking connection)"
        ))
    })
    .await;

    println!(
        "test result: {}. {passed} passed; {failed} failed",
        if failed == 0 { "ok" } else { "FAILED" }
    );
    if failed > 0 {
        return Err(format!("{failed} checks failed").into());
    }
    Ok(())
}

/// An mpsc receiver as a stream.
fn tokio_stream_from<T: Send + 'static>(
    mut receiver: tokio::sync::mpsc::Receiver<T>,
) -> impl futures_util::Stream<Item = T> + Send + 'static {
    futures_util::stream::poll_fn(move |cx| receiver.poll_recv(cx))
}

/// Asks `measure` until `settled` holds, for up to 10 s; the last answer.
async fn settle<T, F, Fut>(measure: F, settled: impl Fn(&T) -> bool) -> Result<T, Error>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, Error>>,
{
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let now = measure().await?;
        if settled(&now) || Instant::now() >= until {
            return Ok(now);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits (up to 10 s) until this process's connections hold nothing but
/// send slots given up as lost
/// ([`rpc_transport_rdma::device::Accounting::is_settled_but_lost_slots`]);
/// returns how many those are.
async fn client_settled() -> Result<usize, Error> {
    let settled = |a: &rpc_transport_rdma::device::Accounting| a.is_settled_but_lost_slots();
    let now = settle(|| async { device_accounting() }, settled).await?;
    if !settled(&now) {
        return Err(format!("this side still holds {now:?}").into());
    }
    Ok(now.lost_send_slots)
}

/// The server's accounting, asked once through `client` within `timeout`.
async fn ask_accounting(
    mut client: CrossHostClient<Channel>,
    timeout: Duration,
) -> Result<AccountingReply, Error> {
    let mut request = Request::new(AccountingRequest {});
    request.set_timeout(timeout);
    Ok(client.accounting(request).await?.into_inner())
}

/// The server's accounting now, asked once over a new connection (5 s).
async fn server_accounting_now(endpoint: &str) -> Result<AccountingReply, Error> {
    let client = CrossHostClient::new(channel(endpoint, None)?);
    ask_accounting(client, Duration::from_secs(5)).await
}

/// The server's accounting over a fresh connection, once it shows nothing
/// but that connection: no other connection, no rendezvous buffer out or
/// charged, nothing leaked.
async fn server_accounting(endpoint: &str) -> Result<AccountingReply, Error> {
    let client = CrossHostClient::new(channel(endpoint, None)?);
    let only_this = |a: &AccountingReply| {
        a.connections == 1
            && a.rendezvous_buffers_out == 0
            && a.rendezvous_bytes_charged == 0
            && a.leaked_buffers == 0
    };
    let now = settle(
        || ask_accounting(client.clone(), Duration::from_secs(10)),
        only_this,
    )
    .await?;
    if !only_this(&now) {
        return Err(format!("the server still holds {now:?}").into());
    }
    Ok(now)
}

// ------------------------------------------------------------------ load

#[derive(Debug)]
struct LoadPlan {
    label: String,
    run_for: Duration,
    fault: Option<String>,
    restore: Option<String>,
    fault_at: Duration,
    fault_for: Duration,
    expect: Expect,
    budget: Duration,
    keepalive: Option<Duration>,
    small: usize,
    large: usize,
    large_len: usize,
    /// Past this a call counts as hung.
    deadline: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Small,
    Large,
    Stream,
}

/// One call (or stream round trip): when it started and ended, from the
/// run's start, and how.
#[derive(Debug, Clone, Copy)]
struct Outcome {
    kind: Kind,
    started: Duration,
    ended: Duration,
    code: Code,
    wrong: bool,
}

/// Runs `command` with `sh -c`, and says when it started (from `start`);
/// a command that has not finished within 10 s is killed and fails.
async fn run_command(command: &str, start: Instant) -> Result<Duration, Error> {
    let at = start.elapsed();
    let mut child = std::process::Command::new("sh")
        .arg("-c")
        .arg(command)
        .stdin(std::process::Stdio::null())
        .spawn()?;
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = child.try_wait()? {
            if !status.success() {
                return Err(format!("`{command}` failed: {status}").into());
            }
            return Ok(at);
        }
        if Instant::now() >= until {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("`{command}` did not finish within 10 s").into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn load(endpoint: &str, plan: LoadPlan) -> Result<(), Error> {
    let client = CrossHostClient::new(channel(endpoint, plan.keepalive)?);
    // Connected before the clock starts.
    let mut first = Request::new(blob(0, 64));
    first.set_timeout(Duration::from_secs(30));
    client.clone().echo(first).await?;
    let start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let (record, recorded) = tokio::sync::mpsc::unbounded_channel::<Outcome>();
    let call_deadline = plan.deadline;
    let mut workers = tokio::task::JoinSet::new();
    let unary_worker = |kind: Kind, len: usize, worker: u64| {
        let (mut client, stop, record) = (client.clone(), stop.clone(), record.clone());
        async move {
            let mut seq = worker << 40;
            while !stop.load(Ordering::Relaxed) {
                seq += 1;
                let began = start.elapsed();
                let mut request = Request::new(blob(seq, len));
                request.set_timeout(call_deadline);
                let (code, wrong) = match client.echo(request).await {
                    Ok(reply) => (Code::Ok, expect_blob(reply.get_ref(), seq, len).is_err()),
                    Err(status) => (status.code(), false),
                };
                note_outcome(&record, kind, began, start, code, wrong).await;
            }
        }
    };
    for worker in 0..plan.small {
        workers.spawn(unary_worker(Kind::Small, 64, worker as u64));
    }
    for worker in 0..plan.large {
        workers.spawn(unary_worker(
            Kind::Large,
            plan.large_len,
            (plan.small + worker) as u64,
        ));
    }
    {
        let (client, stop, record) = (client.clone(), stop.clone(), record.clone());
        workers.spawn(stream_worker(client, stop, record, start, call_deadline));
    }
    drop(record);
    let collector = tokio::spawn(collect_outcomes(recorded, start, endpoint.to_owned()));

    let mut fault_error = None;
    let mut fault_at = None;
    let mut restore_at = None;
    if let Some(fault) = &plan.fault {
        tokio::time::sleep_until((start + plan.fault_at).into()).await;
        match run_command(fault, start).await {
            Ok(at) => fault_at = Some(at),
            Err(error) => fault_error = Some(error.to_string()),
        }
        if let Some(restore) = &plan.restore {
            tokio::time::sleep_until((start + plan.fault_at + plan.fault_for).into()).await;
            match run_command(restore, start).await {
                Ok(at) => restore_at = Some(at),
                Err(error) => fault_error = Some(error.to_string()),
            }
        }
    }
    tokio::time::sleep_until((start + plan.run_for).into()).await;
    stop.store(true, Ordering::Relaxed);
    let ran = start.elapsed();
    let mut hung = 0;
    let drained = tokio::time::timeout(call_deadline + Duration::from_secs(5), async {
        while workers.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        hung = workers.len();
        workers.abort_all();
    }
    drop(workers);
    let outcomes = collector.await?;
    drop(client);

    let report = Report::of(&plan, &outcomes, ran, fault_at, restore_at, hung);
    // What it held: this side always; the server's, unless it is gone.
    let mut leaks = Vec::new();
    let mut lost = 0;
    match client_settled().await {
        Ok(given_up) => lost = given_up,
        Err(error) => leaks.push(error.to_string()),
    }
    if plan.expect != Expect::Dead
        && let Err(error) = server_accounting(endpoint).await
    {
        leaks.push(error.to_string());
    }
    let mut violations = report.violations(&plan);
    violations.extend(fault_error);
    violations.extend(leaks.iter().cloned());
    println!(
        "FAULT | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
        plan.label,
        report.answered(),
        report.errors(),
        report.small_rate(),
        report.small_latency(),
        report.noticed(),
        report.recovered(plan.expect),
        match (leaks.is_empty(), lost) {
            (false, _) => "LEAKED".to_owned(),
            (true, 0) => "0".to_owned(),
            (true, lost) =>
                format!("0 ({lost} send slots never completed by the device, given up)"),
        },
        if violations.is_empty() {
            "ok".to_owned()
        } else {
            format!("VIOLATED: {}", violations.join("; "))
        }
    );
    if violations.is_empty() {
        Ok(())
    } else {
        Err(violations.join("; ").into())
    }
}

/// Gathers the workers' outcomes until they are all gone. When nothing at
/// all completes for 3 s it prints what this side's connections hold then,
/// and what the server holds, asked over a connection of its own (once per
/// such silence): a stalled pull shows as rendezvous buffers out, a send
/// the device never completed as a send slot out.
async fn collect_outcomes(
    mut recorded: tokio::sync::mpsc::UnboundedReceiver<Outcome>,
    start: Instant,
    endpoint: String,
) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    let mut silent_since = Instant::now();
    let mut told = false;
    loop {
        match tokio::time::timeout(Duration::from_millis(500), recorded.recv()).await {
            Ok(Some(outcome)) => {
                outcomes.push(outcome);
                silent_since = Instant::now();
                told = false;
            }
            Ok(None) => return outcomes,
            Err(_) if !told && silent_since.elapsed() >= Duration::from_secs(3) => {
                told = true;
                let at = start.elapsed().as_secs_f64();
                let holds = rdma_accounting().map_or_else(|e| e.to_string(), |a| format!("{a:?}"));
                println!("silent: nothing completed for 3 s at {at:.1} s; this side holds {holds}");
                let server = server_accounting_now(&endpoint)
                    .await
                    .map_or_else(|e| e.to_string(), |a| format!("{a:?}"));
                println!("silent: the server holds {server} (with the asking connection)");
            }
            Err(_) => {}
        }
    }
}

/// Records how a call began at `began` (from `start`) ended; after a
/// failure waits 20 ms: not a hot loop against a channel that is backing off.
async fn note_outcome(
    record: &tokio::sync::mpsc::UnboundedSender<Outcome>,
    kind: Kind,
    began: Duration,
    start: Instant,
    code: Code,
    wrong: bool,
) {
    let _ = record.send(Outcome {
        kind,
        started: began,
        ended: start.elapsed(),
        code,
        wrong,
    });
    if code != Code::Ok {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A bidirectional stream kept busy with round trips of 4 KiB messages;
/// reopened after a failure.
async fn stream_worker(
    mut client: CrossHostClient<Channel>,
    stop: Arc<AtomicBool>,
    record: tokio::sync::mpsc::UnboundedSender<Outcome>,
    start: Instant,
    deadline: Duration,
) {
    let mut seq = u64::MAX >> 1;
    while !stop.load(Ordering::Relaxed) {
        let (send, sent) = tokio::sync::mpsc::channel::<Blob>(1);
        let began = start.elapsed();
        let mut request = Request::new(tokio_stream_from(sent));
        request.set_timeout(Duration::from_secs(3600));
        let mut back = match client.pipe(request).await {
            Ok(response) => response.into_inner(),
            Err(status) => {
                note_outcome(&record, Kind::Stream, began, start, status.code(), false).await;
                continue;
            }
        };
        while !stop.load(Ordering::Relaxed) {
            seq += 1;
            let began = start.elapsed();
            let round_trip = async {
                send.send(blob(seq, 4096))
                    .await
                    .map_err(|_| Status::unavailable("the stream's sender is gone"))?;
                back.message()
                    .await?
                    .ok_or_else(|| Status::unavailable("the stream ended"))
            };
            let (code, wrong) = match tokio::time::timeout(deadline, round_trip).await {
                Ok(Ok(got)) => (Code::Ok, expect_blob(&got, seq, 4096).is_err()),
                Ok(Err(status)) => (status.code(), false),
                Err(_) => (Code::DeadlineExceeded, false),
            };
            note_outcome(&record, Kind::Stream, began, start, code, wrong).await;
            if code != Code::Ok {
                break;
            }
        }
    }
}

/// What one load run did, reduced to a row of the fault table.
struct Report {
    answered: BTreeMap<Kind, usize>,
    errors: BTreeMap<String, usize>,
    wrong: usize,
    hung: usize,
    small_latencies: Vec<Duration>,
    ran: Duration,
    large_len: usize,
    /// From the fault to the first call that ended in an error.
    noticed: Option<Duration>,
    /// From the restore (else the fault) to the end of the first call that
    /// began after it and succeeded.
    recovered: Option<Duration>,
    fault_at: Option<Duration>,
    /// Calls that ended in an error long after the fault was noticed and
    /// mended (a sign of a connection that never came back).
    late_errors: usize,
}

impl Report {
    fn of(
        plan: &LoadPlan,
        outcomes: &[Outcome],
        ran: Duration,
        fault_at: Option<Duration>,
        restore_at: Option<Duration>,
        hung: usize,
    ) -> Report {
        let mut answered = BTreeMap::new();
        let mut errors = BTreeMap::new();
        let mut small_latencies = Vec::new();
        for o in outcomes {
            if o.code == Code::Ok {
                *answered.entry(o.kind).or_insert(0) += 1;
                if o.kind == Kind::Small {
                    small_latencies.push(o.ended - o.started);
                }
            } else {
                *errors.entry(format!("{:?}", o.code)).or_insert(0) += 1;
            }
        }
        small_latencies.sort();
        let noticed = fault_at.and_then(|at| {
            outcomes
                .iter()
                .filter(|o| o.code != Code::Ok && o.ended >= at)
                .map(|o| o.ended - at)
                .min()
        });
        let mended = restore_at.or(fault_at);
        let recovered = mended.and_then(|at| {
            outcomes
                .iter()
                .filter(|o| o.code == Code::Ok && o.started >= at)
                .map(|o| o.ended - at)
                .min()
        });
        let late_errors = match mended {
            Some(at) if plan.expect == Expect::Unavailable => {
                let settled = at + Duration::from_secs(5);
                outcomes
                    .iter()
                    .filter(|o| o.code != Code::Ok && o.started >= settled)
                    .count()
            }
            _ => 0,
        };
        Report {
            answered,
            errors,
            wrong: outcomes.iter().filter(|o| o.wrong).count(),
            hung,
            small_latencies,
            ran,
            large_len: plan.large_len,
            noticed,
            recovered,
            fault_at,
            late_errors,
        }
    }

    fn answered(&self) -> String {
        let n = |kind| self.answered.get(&kind).copied().unwrap_or(0);
        format!(
            "{} small, {} × {} KiB, {} stream msgs",
            n(Kind::Small),
            n(Kind::Large),
            self.large_len >> 10,
            n(Kind::Stream)
        )
    }

    fn errors(&self) -> String {
        if self.errors.is_empty() {
            return "none".to_owned();
        }
        self.errors
            .iter()
            .map(|(code, n)| format!("{n} {code}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn small_rate(&self) -> String {
        format!(
            "{:.0} calls/s",
            self.small_latencies.len() as f64 / self.ran.as_secs_f64()
        )
    }

    fn small_latency(&self) -> String {
        let at = |q: f64| {
            let l = &self.small_latencies;
            l.get(((l.len().saturating_sub(1)) as f64 * q) as usize)
                .copied()
                .unwrap_or_default()
        };
        format!("p50 {:.1?}, p99 {:.1?}", at(0.5), at(0.99))
    }

    fn noticed(&self) -> String {
        match (self.fault_at, self.noticed) {
            (None, _) => "-".to_owned(),
            (Some(_), None) => "no error".to_owned(),
            (Some(_), Some(after)) => format!("{:.2} s", after.as_secs_f64()),
        }
    }

    fn recovered(&self, expect: Expect) -> String {
        match (self.fault_at, self.recovered) {
            _ if expect == Expect::Dead => "- (gone)".to_owned(),
            // The fault lasts the whole run: nothing is restored to recover from.
            _ if expect == Expect::Complete => "-".to_owned(),
            (None, _) => "-".to_owned(),
            (Some(_), None) => "never".to_owned(),
            (Some(_), Some(after)) => format!("{:.2} s", after.as_secs_f64()),
        }
    }

    /// What `plan.expect` says must not have happened, and did.
    fn violations(&self, plan: &LoadPlan) -> Vec<String> {
        let mut broken = Vec::new();
        if self.wrong > 0 {
            broken.push(format!("{} wrong answers", self.wrong));
        }
        if self.hung > 0 {
            broken.push(format!(
                "{} workers hung past the calls' deadline",
                self.hung
            ));
        }
        if let Some(n) = self.errors.get("DeadlineExceeded") {
            broken.push(format!(
                "{n} calls hung until their {:?} deadline",
                plan.deadline
            ));
        }
        let other: Vec<_> = self
            .errors
            .keys()
            .filter(|code| !matches!(code.as_str(), "Unavailable" | "DeadlineExceeded"))
            .collect();
        if !other.is_empty() {
            broken.push(format!("codes other than Unavailable: {other:?}"));
        }
        let within = plan.budget + Duration::from_secs(1);
        match plan.expect {
            Expect::Complete => {
                if !self.errors.is_empty() {
                    broken.push(format!("calls failed: {}", self.errors()));
                }
            }
            Expect::Unavailable | Expect::Dead => match self.noticed {
                None => broken.push("no call noticed the fault".to_owned()),
                Some(after) if after > within => broken.push(format!(
                    "the first call failed {after:.2?} after the fault, past the {:.2?} budget and 1 s",
                    plan.budget
                )),
                Some(_) => {}
            },
        }
        if plan.expect == Expect::Unavailable {
            match self.recovered {
                None => broken.push("no call succeeded after the restore".to_owned()),
                Some(after) if after > Duration::from_secs(5) => broken.push(format!(
                    "calls succeeded again only {after:.2?} after the restore"
                )),
                Some(_) => {}
            }
            if self.late_errors > 0 {
                broken.push(format!(
                    "{} calls begun 5 s after the restore failed",
                    self.late_errors
                ));
            }
        }
        if plan.expect != Expect::Dead
            && plan.large > 0
            && !self.answered.contains_key(&Kind::Large)
        {
            broken.push("no large echo completed".to_owned());
        }
        broken
    }
}
