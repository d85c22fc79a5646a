//! Any bytes in a receive slot given to the RDMA protocol's message decoder:
//! it returns a message or a typed error, never panics, and a message it
//! accepts re-encodes to exactly the bytes it came from (the encoding is
//! canonical: reserved bytes zero, no token where none belongs) and decodes
//! again to the same message.

#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use rdma_rpc_protocol::{Body, HEADER_LEN, MAX_BATCH_FRAMES, Message};

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
    // The driver's path: the message written straight into its send slot.
    let mut slot = vec![0u8; bytes.len()];
    assert_eq!(message.encode_into(&mut slot), bytes.len());
    assert_eq!(&slot[..], &bytes[..]);
    let (header, _) = message.encode_header();
    assert_eq!(&header[..], &bytes[..HEADER_LEN]);
    match &message.body {
        Body::Data(frame) => assert_eq!(&frame[..], &bytes[HEADER_LEN..]),
        Body::Batch(frames) => {
            assert!((2..=MAX_BATCH_FRAMES).contains(&frames.len()));
            let carried: usize = frames.iter().map(|frame| 4 + frame.len()).sum();
            assert_eq!(HEADER_LEN + carried, bytes.len());
        }
        _ => {}
    }
});
