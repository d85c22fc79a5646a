//! rpc-core's transport conformance suite over `rdma://`, then the cases
//! only RDMA has: rendezvous payloads up to 256 MiB, pool and credit
//! accounting under load, forged rendezvous descriptors, a killed peer process.
//!
//! The provider comes from `RDMA_PROVIDER` (default `soft` here), so the same
//! binary runs on a real device: `RDMA_PROVIDER=ibverbs RDMA_DEVICE=rxe0`.
//! Every connection is made with `rnr_retry = 0`: a single RNR (a SEND that
//! finds no posted receive, i.e. a credit bug) fails the connection and the test.

#[path = "../../rpc-core/tests/suite/mod.rs"]
mod suite;

#[path = "../../rpc-core/tests/certs/mod.rs"]
mod certs;

mod common;
mod rdma;

mod over_rdma {
    use crate::common::RdmaBed;
    crate::transport_suite!(RdmaBed);
}
