//! Any byte stream given to the TCP framing, split at an arbitrary point:
//! the length-prefix decoder and the reader a server and a client read with
//! (`FrameReader`, which skips frames over the limit) yield frames whole, a
//! skipped frame's header, or an error; never a panic, never a frame over
//! the limit, never more bytes than came in.

#![no_main]

use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use bytes::BytesMut;
use futures_core::Stream;
use libfuzzer_sys::fuzz_target;
use rpc_core::frame::{Frame, HEADER_LEN};
use rpc_core::transport::TransportError;
use rpc_core::transport::tcp::{FrameReader, LENGTH_PREFIX_LEN, length_prefix_codec};
use tokio_util::codec::Decoder;

const MAX: usize = 4096;

fuzz_target!(|data: &[u8]| {
    let Some((&split, rest)) = data.split_first() else { return };
    let split = (split as usize).min(rest.len());
    let mut codec = length_prefix_codec(MAX);
    let mut buf = BytesMut::from(&rest[..split]);
    let feed = |buf: &mut BytesMut, codec: &mut tokio_util::codec::LengthDelimitedCodec| -> bool {
        loop {
            match codec.decode(buf) {
                Ok(Some(frame)) => {
                    assert!(frame.len() <= MAX);
                    let _ = Frame::decode(frame.freeze(), MAX);
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

    // The reader connections use: a slice never blocks, so every poll is ready.
    let mut reader = FrameReader::new(rest, MAX, None);
    let mut cx = Context::from_waker(Waker::noop());
    let mut consumed = 0;
    loop {
        match Pin::new(&mut reader).poll_next(&mut cx) {
            Poll::Ready(Some(Ok(frame))) => {
                assert!(frame.len() <= MAX);
                consumed += LENGTH_PREFIX_LEN + frame.len();
                let _ = Frame::decode(frame, MAX);
            }
            Poll::Ready(Some(Err(TransportError::Refused { head, len, max }))) => {
                assert!(len > max && max == MAX);
                assert!(head.len() <= HEADER_LEN.min(len));
                consumed += LENGTH_PREFIX_LEN + len;
                let _ = Frame::peek_header(&head);
            }
            Poll::Ready(Some(Err(_)) | None) => break,
            Poll::Pending => panic!("a slice reader never waits"),
        }
        assert!(consumed <= rest.len(), "{consumed} bytes out of {}", rest.len());
    }
});
