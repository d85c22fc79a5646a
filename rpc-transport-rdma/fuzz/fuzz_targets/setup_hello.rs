//! Any bytes as a peer's set-up hello (the body after its length prefix) and
//! as the RDMA transport's part of it (the hello's payload): each decoder
//! returns a value or a `SetupError`, never panics, and what it accepts
//! re-encodes byte for byte (checked inside the entry points). The first
//! byte picks which decoder sees the rest; an accepted hello's payload goes
//! on to the transport's decoder, as in a real set-up.

#![no_main]

use libfuzzer_sys::fuzz_target;
use rpc_transport_rdma::setup::{
    MAX_ADDRESS_LEN, MAX_HELLO_LEN, MAX_PROVIDER_LEN, fuzz_decode_hello,
};
use rpc_transport_rdma::transport::fuzz_decode_transport_hello;

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    if which & 1 == 0 {
        if let Ok(hello) = fuzz_decode_hello(rest) {
            assert!(rest.len() <= MAX_HELLO_LEN);
            assert!((1..=MAX_PROVIDER_LEN).contains(&hello.provider.len()));
            assert!(hello.address.to_bytes().len() <= MAX_ADDRESS_LEN);
            let _ = fuzz_decode_transport_hello(&hello.payload);
        }
    } else {
        let _ = fuzz_decode_transport_hello(rest);
    }
});
