//! Any bytes as a dialer's soft handshake: the decoder never panics and
//! what it decodes re-encodes to the same handshake.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = rpc_transport_rdma::verbs::soft::fuzz_handshake(data);
});
