//! What every RDMA test binary shares: the strict configuration and the bed.

use std::sync::{Arc, Once};

use rpc_transport_rdma::{RdmaConfig, RdmaTransport};

/// `rdma://127.0.0.1:0` with the strict test configuration.
pub(crate) struct RdmaBed;

impl crate::suite::Bed for RdmaBed {
    fn listen_endpoint(&self) -> String {
        ensure_registered();
        format!("rdma://{}:0", test_addr())
    }

    fn available(&self) -> Result<(), String> {
        device_available()
    }
}

/// `Err` with the reason when the configured provider has no usable device
/// (e.g. `RDMA_PROVIDER=ibverbs` on a machine without RDMA).
pub(crate) fn device_available() -> Result<(), String> {
    rpc_transport_rdma::device::open(&strict_config())
        .map(drop)
        .map_err(|error| format!("no RDMA device: {error}"))
}

/// Returns from the calling test, printing `skipped: …`, when no device is usable.
#[macro_export]
macro_rules! require_device {
    () => {
        if let Err(why) = $crate::common::device_available() {
            println!("skipped: {why}");
            return;
        }
    };
}
/// The address servers listen on: `RDMA_TEST_ADDR` (an address of the RDMA
/// device's netdev, needed where connections go through rdma_cm), else loopback.
pub(crate) fn test_addr() -> String {
    std::env::var("RDMA_TEST_ADDR").unwrap_or_else(|_| "127.0.0.1".into())
}

/// The configuration every test connection uses: the environment's provider
/// (soft unless `RDMA_PROVIDER` says otherwise) and no RNR retries.
pub(crate) fn strict_config() -> RdmaConfig {
    let mut config = RdmaConfig::from_env().expect("valid RDMA_* environment");
    if config.provider.is_none() {
        config.provider = Some("soft".into());
    }
    config.connect.rnr_retry = 0;
    config
}

/// Registers `rdma://` with [`strict_config`], once per test binary.
pub(crate) fn ensure_registered() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| register_scheme("rdma", strict_config()));
}

/// Registers a transport with `config` under its own scheme, so tests with
/// special settings do not disturb tests running in parallel.
pub(crate) fn register_scheme(scheme: &str, config: RdmaConfig) {
    rpc_core::transport::register(
        scheme,
        Arc::new(RdmaTransport::new(config).expect("valid config")),
    );
}

/// One Echo call of the suite's probe service that may fail.
#[allow(dead_code)] // not every test binary calls it
pub(crate) async fn try_echo(
    channel: &rpc_core::Channel,
    payload: bytes::Bytes,
) -> Result<bytes::Bytes, rpc_core::Status> {
    Ok(channel
        .unary(crate::suite::probe("Echo", payload))
        .await?
        .into_inner())
}

/// One Echo call of the suite's probe service; the payload that came back.
#[allow(dead_code)] // not every test binary calls it
pub(crate) async fn echo(channel: &rpc_core::Channel, payload: bytes::Bytes) -> bytes::Bytes {
    channel
        .unary(crate::suite::probe("Echo", payload))
        .await
        .expect("echo call")
        .into_inner()
}
