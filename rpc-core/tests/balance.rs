//! `BalancedChannel` over a live server and a dead endpoint: once the dead
//! one has failed a call it is ejected, and when its ejection runs out it is
//! probed (its channel tries to connect), not sent calls: no later call
//! fails, however long after.

mod suite;

use std::time::Duration;

use rpc_core::Code;
use rpc_core::client::BalancedChannel;
use rpc_core::transport::Endpoint;

use crate::suite::{TcpBed, probe, start};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_endpoint_is_probed_not_sent_calls_after_its_ejection() {
    let server = start(&TcpBed).await;
    // A port where nothing listens: bound, then released.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead: Endpoint = format!("tcp://{}", listener.local_addr().unwrap())
        .parse()
        .unwrap();
    drop(listener);
    let balanced = BalancedChannel::from_endpoints([server.endpoint.clone(), dead]);
    // Calls until the dead endpoint is picked once: that call fails
    // Unavailable and ejects it.
    let mut failed = None;
    for i in 0..200 {
        if let Err(status) = balanced.unary(probe("Echo", format!("{i}"))).await {
            failed = Some(status);
            break;
        }
    }
    let failed = failed.expect("the dead endpoint was never picked in 200 calls");
    assert_eq!(failed.code(), Code::Unavailable, "{failed:?}");
    // Each round waits past the previous ejection (the first is at most
    // 150 ms, then they double): every call meanwhile and after goes to the
    // live server.
    for round in 0..3u64 {
        tokio::time::sleep(Duration::from_millis(200 << round)).await;
        for i in 0..50 {
            balanced
                .unary(probe("Echo", format!("{round}/{i}")))
                .await
                .unwrap_or_else(|status| panic!("round {round}, call {i}: {status:?}"));
        }
    }
}

/// An endpoint at its connection limit refuses with `ResourceExhausted`:
/// that ejects it as `Unavailable` does, and the calls go to the endpoint
/// with room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_that_refuses_for_want_of_room_is_ejected() {
    use crate::suite::start_with;
    let roomy = start(&TcpBed).await;
    let full = start_with(&TcpBed, |server| server.max_connections(1)).await;
    // Another client holds the full server's one place.
    let holder = rpc_core::Channel::connect(full.endpoint.clone())
        .await
        .unwrap();
    holder.unary(probe("Echo", "mine")).await.unwrap();
    let balanced = BalancedChannel::from_endpoints([roomy.endpoint.clone(), full.endpoint.clone()]);
    let mut refused = None;
    for i in 0..200 {
        if let Err(status) = balanced.unary(probe("Echo", format!("{i}"))).await {
            refused = Some(status);
            break;
        }
    }
    let refused = refused.expect("the full endpoint was never picked in 200 calls");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    for i in 0..100 {
        balanced
            .unary(probe("Echo", format!("after {i}")))
            .await
            .unwrap_or_else(|status| panic!("call {i} after the ejection: {status:?}"));
    }
    drop(holder);
}

/// Counts the calls its server takes and answers each 20 ms late.
#[derive(Clone)]
struct Slow<S> {
    inner: S,
    calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl<S> tower::Service<rpc_core::Request<bytes::Bytes>> for Slow<S>
where
    S: tower::Service<rpc_core::Request<bytes::Bytes>> + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: rpc_core::Request<bytes::Bytes>) -> Self::Future {
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let call = self.inner.call(request);
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            call.await
        })
    }
}

/// A slow endpoint (20 ms per call) and a fast one, one call at a time:
/// calls in flight cannot tell them apart (none on either: a coin toss),
/// the peak-EWMA of their latency can, and sends nearly every call to the
/// fast one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peak_ewma_sends_calls_to_the_faster_endpoint() {
    use rpc_core::client::LoadSignal;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let fast = start(&TcpBed).await;
    let slow_calls = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = slow_calls.clone();
    let slow = crate::suite::start_layered(
        &TcpBed,
        rpc_core::Server::builder().layer(tower::layer::layer_fn(move |inner| Slow {
            inner,
            calls: counted.clone(),
        })),
    )
    .await;
    const CALLS: usize = 200;
    let mut shares = Vec::new();
    for load in [LoadSignal::PendingRequests, LoadSignal::peak_ewma()] {
        let balanced = BalancedChannel::from_endpoints_with_load(
            [fast.endpoint.clone(), slow.endpoint.clone()],
            rpc_core::Channel::from_endpoint,
            load,
        );
        let before = slow_calls.load(Ordering::Relaxed);
        for i in 0..CALLS {
            balanced
                .unary(probe("Echo", format!("{i}")))
                .await
                .unwrap_or_else(|status| panic!("{load:?}, call {i}: {status:?}"));
        }
        let to_slow = slow_calls.load(Ordering::Relaxed) - before;
        println!("{load:?}: {to_slow} of {CALLS} calls went to the slow endpoint");
        shares.push(to_slow);
    }
    assert!(
        (CALLS / 5..=CALLS * 4 / 5).contains(&shares[0]),
        "pending calls: {} of {CALLS} to the slow endpoint (a coin toss expected)",
        shares[0]
    );
    assert!(
        shares[1] <= CALLS / 20,
        "peak EWMA: {} of {CALLS} calls to the slow endpoint",
        shares[1]
    );
}
