//! Any bytes as what a hostile peer writes into the soft provider's
//! descriptor ring: the reader (fed in uneven chunks, as a ring delivers
//! them) yields messages or an error, never panics, and every message it
//! yields survives an encode/decode round trip (checked inside the entry point).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = rpc_transport_rdma::verbs::soft::fuzz_wire(data);
});
