//! rpc-transport-rdma: RDMA for rdma-rpc.
#![forbid(unsafe_code)]
//!
//! - [`verbs`]: the RDMA vocabulary behind provider traits, with the `soft`
//!   provider (a software RDMA device with RC semantics between processes of
//!   one host) and, with feature `ibverbs`, real rdma-core.
//! - [`protocol`]: the RPC-over-RDMA protocol of one connection as a sans-IO
//!   state machine (credits, eager vs rendezvous, READ scheduling, close).
//! - [`transport`]: `rdma://host:port` for rpc-core — a tokio driver per
//!   connection around the protocol, with the device's shared receive and
//!   send slots and a completion reactor.
//!
//! Enable it with one line at start-up; then any rpc-core client or server
//! takes `rdma://` endpoints:
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! rpc_transport_rdma::register()?;
//! let channel = rpc_core::Channel::connect("rdma://127.0.0.1:50051").await?;
//! # Ok(()) }
//! ```
//!
//! With feature `tls`, `RdmaTransport::with_tls` runs the set-up exchange
//! inside TLS (`rdma+tls://`): certificates checked before any queue pair
//! connects.
//!
//! The provider is `RDMA_PROVIDER` (`soft` | `ibverbs`), else ibverbs when it
//! is compiled in and has a device, else soft; see [`RdmaConfig`] for the rest.
//!
//! **Metrics.** Once `rpc_core::metrics::enable()` was called, besides
//! rpc-core's call and connection metrics:
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `rdma_registered_bytes` | gauge | | memory registered with the device(s), process-wide |
//! | `rdma_credit_stalls_total` | counter | | times a connection's messages had to wait for the peer's credits |
//! | `rdma_rendezvous_in_flight` | gauge | `direction` (`out`: ours the peer may READ; `in`: the peer's being pulled) | large frames in flight |

mod admission;
pub mod config;
pub mod device;
mod link;
pub mod rendezvous_budget;
pub mod setup;
mod setup_socket;
mod spin;
pub mod transport;

/// The sans-IO protocol lives in its own crate (`rdma-rpc-protocol`); this
/// keeps its old path, `rpc_transport_rdma::protocol`.
pub use rdma_rpc_protocol as protocol;

/// The verbs layer lives in its own crate (`rdma-verbs`, the only crate of
/// the workspace with `unsafe`); this keeps its old path,
/// `rpc_transport_rdma::verbs`.
pub use rdma_verbs as verbs;

use std::sync::Arc;

pub use config::{ConfigError, PollMode, RdmaConfig};
pub use transport::RdmaTransport;
pub use verbs::pool;

/// Registers the RDMA transport for `rdma://` endpoints, configured from the
/// environment ([`RdmaConfig::from_env`]). Call it once at start-up.
pub fn register() -> Result<(), ConfigError> {
    register_with(RdmaConfig::from_env()?)
}

/// Registers the RDMA transport for `rdma://` endpoints with `config`.
pub fn register_with(config: RdmaConfig) -> Result<(), ConfigError> {
    device::check(&config).map_err(|error| ConfigError(error.to_string()))?;
    let transport = RdmaTransport::new(config)?;
    rpc_core::transport::register("rdma", Arc::new(transport));
    Ok(())
}
