//! Shared pieces of the benchmark binaries.

#![forbid(unsafe_code)]

pub mod contenders;
/// The physical floors (their own crate, `rdma-rpc-floors`, so that
/// rdma-verbs's `verbs_pingpong` example measures them the same way).
pub use rdma_rpc_floors as floors;
pub mod plot;
pub mod stats;
pub mod streams;
