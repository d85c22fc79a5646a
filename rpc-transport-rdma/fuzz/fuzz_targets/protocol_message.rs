//! Any bytes in a receive slot given to the RDMA protocol's message decoder:
//! it returns a message or a typed error, never panics, and a message it
//! accepts re-encodes to exactly the bytes it came from (the encoding is
//! canonical: reserved bytes zero, no token where none belongs) and decodes
//! again to the same message.

#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use rdma_rpc_protocol::{Body, HEADER_LEN, Message};

fuzz_target!(|data: &[u8]| {
    let bytes = Bytes::copy_from_slice(data);
    let Ok(message) = Message::decode(bytes.clone()) else {
        return;
    };
    let encoded = message.encode();
    assert_eq!(encoded.len(), message.encoded_len());
    assert_eq!(
        encoded, bytes,
        "an accepted message re-encodes byte for byte"
    );
    assert_eq!(Message::decode(encoded).as_ref(), Ok(&message));
    // The driver's gather path: header, the announce body if any, then the
    // inline bytes (a DATA frame, an announcement's head and tail).
    let (header, announce) = message.encode_header();
    assert_eq!(&header[..], &bytes[..HEADER_LEN]);
    let body_len = announce.map_or(0, |body| body.len());
    if let Some(body) = announce {
        assert_eq!(&body[..], &bytes[HEADER_LEN..HEADER_LEN + body_len]);
    }
    assert_eq!(message.inline().concat(), &bytes[HEADER_LEN + body_len..]);
    if let Body::Data(frame) = &message.body {
        assert_eq!(&frame[..], &bytes[HEADER_LEN..]);
    }
});
