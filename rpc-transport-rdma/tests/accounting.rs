//! Pool and credit accounting under load, alone in its own test binary: the
//! registration counters are process-wide, so no other test may run beside it.

#[path = "../../rpc-core/tests/suite/mod.rs"]
mod suite;

mod common;

use rpc_core::Channel;
use rpc_transport_rdma::verbs;

use crate::common::{RdmaBed, echo};
use crate::suite::{pattern, start};

/// Calls `total` echoes with `in_flight` outstanding at a time; sizes cycle
/// from 1 byte to the eager threshold.
async fn echo_load(channel: &Channel, total: usize, in_flight: usize) {
    let sizes = [1usize, 64, 700, 4096, 8000];
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..total {
        if calls.len() >= in_flight {
            calls.join_next().await.unwrap().unwrap();
        }
        let channel = channel.clone();
        let payload = pattern(sizes[i % sizes.len()], i as u64);
        calls.spawn(async move {
            let back = echo(&channel, payload.clone()).await;
            assert!(back == payload);
        });
    }
    while let Some(done) = calls.join_next().await {
        done.unwrap();
    }
}

async fn ten_thousand_calls_256_in_flight_without_rnr_or_registration_growth(channel: &Channel) {
    echo_load(channel, 300, 256).await;
    let registered = settled_registered_bytes().await;
    let registrations = verbs::registrations();
    // rnr_retry is 0 in every test connection: one RNR would fail a call.
    echo_load(channel, 10_000, 256).await;
    assert_eq!(
        settled_registered_bytes().await,
        registered,
        "registered bytes"
    );
    assert_eq!(verbs::registrations(), registrations, "new registrations");
}

/// Registered bytes once in-flight DONEs have been handled (a call returns
/// before the peer has revoked the window of its response).
async fn settled_registered_bytes() -> u64 {
    let mut last = verbs::registered_bytes();
    for _ in 0..100 {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        let now = verbs::registered_bytes();
        if now == last {
            return now;
        }
        last = now;
    }
    panic!("registered bytes never settled");
}

async fn rendezvous_buffers_are_reused_and_windows_revoked(channel: &Channel) {
    let payload = pattern(3 << 20, 5);
    assert!(echo(channel, payload.clone()).await == payload);
    let registered = settled_registered_bytes().await;
    let registrations = verbs::registrations();
    let windows = verbs::windows_exposed();
    for _ in 0..20 {
        assert!(echo(channel, payload.clone()).await == payload);
    }
    assert_eq!(
        verbs::registrations(),
        registrations,
        "pool registered again"
    );
    // Each large frame (request and response) was exposed through a window...
    assert!(verbs::windows_exposed() >= windows + 40);
    // ...and every window was revoked after its DONE.
    assert_eq!(settled_registered_bytes().await, registered);
}

/// One test, so the two phases never overlap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_memory_stays_flat_under_load() {
    crate::require_device!();
    let server = start(&RdmaBed).await;
    let channel = Channel::connect(server.endpoint.clone()).await.unwrap();
    ten_thousand_calls_256_in_flight_without_rnr_or_registration_growth(&channel).await;
    rendezvous_buffers_are_reused_and_windows_revoked(&channel).await;
}
