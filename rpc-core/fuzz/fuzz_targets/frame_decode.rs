//! Any bytes given to the frame decoder: it returns a frame or a typed error,
//! never panics, and a frame it accepts survives encode → decode unchanged.
//! (Not byte identity: a status number outside 0..=16 decodes as UNKNOWN.)

#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use rpc_core::frame::Frame;

fuzz_target!(|data: &[u8]| {
    let message = Bytes::copy_from_slice(data);
    if let Ok(frame) = Frame::decode(message.clone(), 1 << 20) {
        let again = Frame::decode(frame.encode(), 1 << 20).expect("an accepted frame re-encodes validly");
        assert_eq!(again, frame);
        assert_eq!(frame.encode().len(), message.len());
    }
});
