//! Two RDMA protocol endpoints wired together in memory, driven by the fuzz
//! input: the harness and its checks are `rdma-rpc-protocol`'s
//! `tests/two_sides` (shared with the property test
//! `tests/event_orders.rs`, which runs in every `cargo test`). The first
//! byte picks honest runs (no forgery, no time passing: end-to-end checks)
//! or anything goes.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../protocol/tests/two_sides/mod.rs"]
mod two_sides;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let _ = two_sides::run(&mut arbitrary::Unstructured::new(rest), mode & 1 == 1);
});
