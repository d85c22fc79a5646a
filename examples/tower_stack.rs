//! rdma-rpc inside tower stacks, on both sides, with the key-value service.
//!
//! Client: `Retry` (idempotent calls only) → `Timeout` → `ConcurrencyLimit` → `Channel`.
//! Server: a `Chaos` layer that fails every third first attempt with `Unavailable`,
//! delays calls that ask for it, and records how many calls run at once.
//!
//! ```text
//! cargo run --release --example tower_stack                  # rdma://127.0.0.1:0
//! cargo run --release --example tower_stack -- tcp://127.0.0.1:0
//! cargo run --release --example tower_stack -- mem://kv
//! ```

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use rdma_rpc_examples::kv::{
    GetRequest, PutRequest, ScanRequest, key_value_client::KeyValueClient,
    key_value_server::KeyValueServer,
};
use rdma_rpc_examples::{KvStore, init_logging};
use rpc_core::bytes::Bytes;
use rpc_core::{BoxError, Channel, Code, Payload, Request, Response, Server, Status};
use tower::{Layer, Service, ServiceBuilder};

/// Counters the server layer keeps.
#[derive(Debug, Default)]
struct ChaosStats {
    calls: AtomicUsize,
    injected_failures: AtomicUsize,
    running: AtomicUsize,
    most_running: AtomicUsize,
}

/// Server layer: fails every third call that is not a retry with `Unavailable`, sleeps for
/// `x-delay-ms` before calls that carry it, and tracks concurrency.
#[derive(Clone)]
struct ChaosLayer(Arc<ChaosStats>);

impl<S> Layer<S> for ChaosLayer {
    type Service = Chaos<S>;
    fn layer(&self, inner: S) -> Chaos<S> {
        Chaos {
            inner,
            stats: self.0.clone(),
        }
    }
}

#[derive(Clone)]
struct Chaos<S> {
    inner: S,
    stats: Arc<ChaosStats>,
}

impl<S> Service<Request<Bytes>> for Chaos<S>
where
    S: Service<Request<Bytes>, Response = Response<Payload>, Error = Status>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    type Response = Response<Payload>;
    type Error = Status;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Payload>, Status>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Bytes>) -> Self::Future {
        let stats = self.stats.clone();
        let mut inner = self.inner.clone();
        std::mem::swap(&mut inner, &mut self.inner);
        Box::pin(async move {
            let n = stats.calls.fetch_add(1, Ordering::Relaxed);
            // Retried calls pass, so every idempotent call succeeds in the end.
            if n % 3 == 2 && request.metadata().get("x-retry-attempt").is_none() {
                stats.injected_failures.fetch_add(1, Ordering::Relaxed);
                return Err(Status::unavailable("chaos layer: try again"));
            }
            let running = stats.running.fetch_add(1, Ordering::SeqCst) + 1;
            stats.most_running.fetch_max(running, Ordering::SeqCst);
            let delay = request
                .metadata()
                .get("x-delay-ms")
                .and_then(|ms| ms.parse().ok())
                .unwrap_or(1);
            tokio::time::sleep(Duration::from_millis(delay)).await;
            let outcome = inner.call(request).await;
            stats.running.fetch_sub(1, Ordering::SeqCst);
            outcome
        })
    }
}

/// Retries `Unavailable` failures of idempotent methods (Get, Scan, Delete), at most `attempts` times.
#[derive(Clone)]
struct RetryIdempotent {
    attempts: usize,
    retries: Arc<AtomicUsize>,
}

fn is_idempotent(path: Option<&str>) -> bool {
    matches!(
        path.and_then(|p| p.rsplit('/').next()),
        Some("Get" | "Scan" | "Delete")
    )
}

impl tower::retry::Policy<Request<Payload>, Response<Bytes>, BoxError> for RetryIdempotent {
    type Future = Pin<Box<dyn Future<Output = ()> + Send>>;

    fn retry(
        &mut self,
        request: &mut Request<Payload>,
        result: &mut Result<Response<Bytes>, BoxError>,
    ) -> Option<Self::Future> {
        let Err(error) = result else { return None };
        let unavailable = error
            .downcast_ref::<Status>()
            .is_some_and(|s| s.code() == Code::Unavailable);
        if !unavailable || !is_idempotent(request.method()) || self.attempts == 0 {
            return None;
        }
        self.attempts -= 1;
        let attempt = self.retries.fetch_add(1, Ordering::Relaxed) + 1;
        let _ = request
            .metadata_mut()
            .insert("x-retry-attempt", &attempt.to_string());
        Some(Box::pin(tokio::time::sleep(Duration::from_millis(2))))
    }

    fn clone_request(&mut self, request: &Request<Payload>) -> Option<Request<Payload>> {
        Some(request.clone())
    }
}

/// rdma-rpc inside tower stacks, on both sides, with the key-value service.
///
/// Client: `Retry` (idempotent calls only) → `Timeout` → `ConcurrencyLimit`
/// → `Channel`. Server: a `Chaos` layer that fails every third first
/// attempt with `Unavailable`, delays calls that ask for it, and records how
/// many calls run at once.
#[derive(Debug, clap::Parser)]
#[command(name = "tower_stack")]
struct Cli {
    /// Where the server listens (rdma://, tcp:// or mem://; port 0: any
    /// free port); the client connects to the address it got.
    #[arg(value_name = "ENDPOINT", default_value = "rdma://127.0.0.1:0")]
    listen: String,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Cli { listen } = clap::Parser::parse();
    init_logging();
    // The one line that enables rdma:// (provider from RDMA_PROVIDER, else
    // ibverbs when built in and a device exists, else soft).
    rpc_transport_rdma::register()?;
    let stats = Arc::new(ChaosStats::default());
    let listening = Server::builder()
        .layer(ChaosLayer(stats.clone()))
        .add_service(KeyValueServer::new(KvStore::default()))
        .listen(listen.as_str())
        .await?;
    let endpoint = listening.local_endpoint();
    tokio::spawn(listening.serve());
    println!("key-value server with a chaos layer on {endpoint}");

    let retries = Arc::new(AtomicUsize::new(0));
    let stack = ServiceBuilder::new()
        .retry(RetryIdempotent {
            attempts: 3,
            retries: retries.clone(),
        })
        .timeout(Duration::from_millis(200))
        .concurrency_limit(8)
        .service(Channel::connect(endpoint).await?);
    let client = KeyValueClient::new(stack);

    let (mut put_ok, mut put_failed) = (0, 0);
    for i in 0..12 {
        let request = PutRequest {
            key: format!("key-{i:02}"),
            value: vec![i as u8; 1024].into(),
            expected_version: None,
        };
        match client.clone().put(request).await {
            Ok(_) => put_ok += 1,
            Err(status) => {
                assert_eq!(status.code(), Code::Unavailable);
                put_failed += 1;
            }
        }
    }
    println!(
        "put x12: {put_ok} ok, {put_failed} failed with Unavailable and were not retried (Put is not idempotent)"
    );

    let before = retries.load(Ordering::Relaxed);
    let gets = (0..64).map(|i| {
        let mut client = client.clone();
        async move {
            client
                .get(GetRequest {
                    key: format!("key-{:02}", i % 12),
                })
                .await
        }
    });
    let results = futures_util::future::join_all(gets).await;
    let found = results.iter().filter(|r| r.is_ok()).count();
    let not_found = results
        .iter()
        .filter(|r| matches!(r, Err(s) if s.code() == Code::NotFound))
        .count();
    println!(
        "get x64 concurrently: {found} found, {not_found} NotFound (keys whose put failed), {} transparent retries",
        retries.load(Ordering::Relaxed) - before
    );
    assert_eq!(
        found + not_found,
        64,
        "every get succeeded or was NotFound after retries"
    );
    println!(
        "the server saw at most {} calls at once (client concurrency limit: 8)",
        stats.most_running.load(Ordering::SeqCst)
    );

    let page = client
        .clone()
        .scan(ScanRequest {
            start: String::new(),
            limit: 5,
            include_values: false,
        })
        .await?
        .into_inner();
    println!(
        "scan limit 5: {:?}, next page starts at {:?}",
        page.entries.iter().map(|e| &e.key).collect::<Vec<_>>(),
        page.next_start
    );

    let mut slow = Request::new(GetRequest {
        key: "key-00".into(),
    });
    slow.metadata_mut().insert("x-delay-ms", "1000")?;
    match client.clone().get(slow).await {
        Err(status) if status.code() == Code::DeadlineExceeded => println!(
            "a get the server delays by 1 s -> DeadlineExceeded after the 200 ms client timeout"
        ),
        // The chaos layer may have failed it first; a retry then hits the delay.
        other => return Err(format!("expected DeadlineExceeded, got {other:?}").into()),
    }
    println!(
        "server: {} calls, {} failed on purpose",
        stats.calls.load(Ordering::Relaxed),
        stats.injected_failures.load(Ordering::Relaxed)
    );
    Ok(())
}
