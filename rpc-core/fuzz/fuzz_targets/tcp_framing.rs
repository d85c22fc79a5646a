//! Any byte stream given to the TCP length-prefix decoder, split at an
//! arbitrary point: frames come out whole or it errors, never panics.

#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use rpc_core::frame::Frame;
use rpc_core::transport::tcp::LengthPrefixCodec;
use tokio_util::codec::Decoder;

fuzz_target!(|data: &[u8]| {
    let Some((&split, rest)) = data.split_first() else { return };
    let split = (split as usize).min(rest.len());
    let mut codec = LengthPrefixCodec::new(4096);
    let mut buf = BytesMut::from(&rest[..split]);
    let feed = |buf: &mut BytesMut, codec: &mut LengthPrefixCodec| -> bool {
        loop {
            match codec.decode(buf) {
                Ok(Some(frame)) => {
                    assert!(frame.len() <= 4096);
                    let _ = Frame::decode(frame, 4096);
                }
                Ok(None) => return true,
                Err(_) => return false,
            }
        }
    };
    if feed(&mut buf, &mut codec) {
        buf.extend_from_slice(&rest[split..]);
        if feed(&mut buf, &mut codec) {
            let _ = codec.decode_eof(&mut buf);
        }
    }
});
