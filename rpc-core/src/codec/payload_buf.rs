//! [`PayloadBuf`]: where a codec writes a message, keeping large `Bytes`
//! fields where they lie.
//!
//! The only `unsafe` in rpc-core, and it is bookkeeping: [`BufMut`] is an
//! `unsafe` trait (its `advance_mut` promises initialised bytes), and prost
//! only writes into a `BufMut`. Every method delegates to a [`BytesMut`],
//! which upholds the contract itself; nothing here touches raw memory.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};

use bytes::buf::UninitSlice;
use bytes::{Buf, BufMut, BytesMut};

use super::recycle;
use crate::payload::Payload;

/// A `Bytes` of at least this many bytes that a codec writes with
/// [`BufMut::put`] (prost does so for `bytes` fields of type `Bytes`) is kept
/// as a part of its own rather than copied.
pub const SEPARATE_PARTS_FROM: usize = 32 << 10;

static BYTES_COPIED: AtomicU64 = AtomicU64::new(0);

/// Messages that copied fewer bytes (and kept no part) are not counted.
const COUNT_COPIES_FROM: usize = 32 << 10;

/// Bytes codecs wrote into [`PayloadBuf`] chunks (copied) since the process
/// started, as opposed to large `Bytes` kept as parts of their own, counted
/// for large messages only (those with a part kept, or with at least 32 KiB
/// copied): small calls, the hot path, touch no shared counter. Tests and benchmarks read it to prove a large field
/// was sent without a copy.
pub fn bytes_copied_by_encoding() -> u64 {
    BYTES_COPIED.load(Ordering::Relaxed)
}

/// The first chunk's capacity at most: the bytes a message has before its
/// first large field fit here, and if the message turns out large for other
/// reasons, at most this much is copied once into a chunk sized for the rest.
const FIRST_CHUNK: usize = 16 << 10;

/// A [`BufMut`] that builds a [`Payload`]: small writes go into chunks sized
/// by the codec's length hint (recycled buffers for large ones), and a large
/// `Bytes` written with [`BufMut::put`] becomes a part of its own, not a copy.
///
/// ```
/// use bytes::{BufMut, Bytes};
/// use rpc_core::codec::PayloadBuf;
///
/// let field = Bytes::from(vec![7u8; 1 << 20]);
/// let mut buf = PayloadBuf::with_len_hint(3 + field.len());
/// buf.put_slice(b"key");
/// buf.put(field.clone());
/// let payload = buf.finish();
/// assert_eq!(payload.len(), 3 + (1 << 20));
/// assert!(payload.parts().any(|part| part.as_ptr() == field.as_ptr()), "not copied");
/// ```
#[derive(Debug, Default)]
pub struct PayloadBuf {
    /// Where small writes go.
    current: BytesMut,
    /// Finished parts, in order.
    done: Payload,
    /// The encoded length the codec announced (0 when unknown).
    hint: usize,
    /// Bytes in parts that were kept, not copied.
    kept: usize,
}

impl PayloadBuf {
    /// A buffer for a message of about `len` bytes.
    pub fn with_len_hint(len: usize) -> PayloadBuf {
        PayloadBuf {
            current: BytesMut::with_capacity(len.min(FIRST_CHUNK)),
            done: Payload::new(),
            hint: len,
            kept: 0,
        }
    }

    /// The message written.
    pub fn finish(mut self) -> Payload {
        // Frozen whole (no split): a small message stays one plain allocation.
        let last = std::mem::take(&mut self.current);
        self.done.push(recycle::into_bytes(last));
        let copied = self.done.len() - self.kept;
        if self.kept > 0 || copied >= COUNT_COPIES_FROM {
            BYTES_COPIED.fetch_add(copied as u64, Ordering::Relaxed);
        }
        self.done
    }

    fn written(&self) -> usize {
        self.done.len() + self.current.len()
    }

    /// Makes room for at least one of `needed` more bytes in `current`.
    fn grow(&mut self, needed: usize) {
        let rest = self.hint.saturating_sub(self.written());
        let want = needed.max(rest).max(FIRST_CHUNK);
        if self.current.len() <= FIRST_CHUNK && self.done.is_empty() {
            // Still the start of the message: move it into a chunk that holds
            // the rest too, so a message large for other reasons than a
            // `Bytes` field stays one part.
            let mut next = recycle::take(self.current.len() + want);
            next.put_slice(&self.current);
            self.current = next;
        } else {
            self.seal_current();
            self.current = recycle::take(want);
        }
    }

    /// Copies `src` into `current`, growing it (into new chunks) as it fills.
    fn put_slice_across(&mut self, mut src: &[u8]) {
        while !src.is_empty() {
            let mut room = self.current.capacity() - self.current.len();
            if room == 0 {
                self.grow(src.len());
                room = self.current.capacity() - self.current.len();
            }
            let step = room.min(src.len());
            // Within capacity: `extend_from_slice` does not reallocate.
            self.current.extend_from_slice(&src[..step]);
            src = &src[step..];
        }
    }

    /// Moves what `current` holds into `done`, keeping its spare room for
    /// what follows when it is an ordinary allocation.
    fn seal_current(&mut self) {
        if self.current.is_empty() {
            return;
        }
        if self.current.capacity() < recycle::RECYCLE_FROM {
            self.done.push(self.current.split().freeze());
        } else {
            // A recycled buffer goes back whole when its bytes are dropped.
            let full = std::mem::take(&mut self.current);
            self.done.push(recycle::into_bytes(full));
        }
    }
}

// SAFETY: every method keeps `BufMut`'s contract by delegating to `BytesMut`:
// `chunk_mut` is `BytesMut::chunk_mut` of `current` (after `grow` made room,
// so it never reallocates under bytes already handed out), and `advance_mut`
// advances that same `BytesMut` by what its caller initialised.
unsafe impl BufMut for PayloadBuf {
    fn remaining_mut(&self) -> usize {
        isize::MAX as usize - self.written()
    }

    unsafe fn advance_mut(&mut self, cnt: usize) {
        // SAFETY: the caller initialised `cnt` bytes of the chunk that
        // `chunk_mut` returned, which is `current`'s spare capacity.
        unsafe { self.current.advance_mut(cnt) }
    }

    fn chunk_mut(&mut self) -> &mut UninitSlice {
        if self.current.capacity() == self.current.len() {
            self.grow(1);
        }
        self.current.chunk_mut()
    }

    #[inline]
    fn put_slice(&mut self, src: &[u8]) {
        // The common case (a codec's small writes: tags, varints, short
        // fields) fits the chunk: one copy, no loop.
        if self.current.capacity() - self.current.len() >= src.len() {
            self.current.extend_from_slice(src);
        } else {
            self.put_slice_across(src);
        }
    }

    #[inline]
    fn put_u8(&mut self, byte: u8) {
        if self.current.capacity() > self.current.len() {
            self.current.put_u8(byte);
        } else {
            self.put_slice_across(&[byte]);
        }
    }

    fn put<T: Buf>(&mut self, mut src: T)
    where
        Self: Sized,
    {
        let len = src.remaining();
        if len >= SEPARATE_PARTS_FROM {
            // For `Bytes` this is a new handle on the same memory (prost
            // writes `bytes` fields of type `Bytes` this way); other sources
            // are copied once into a part of their own.
            self.seal_current();
            let part = src.copy_to_bytes(len);
            self.kept += part.len();
            self.done.push(part);
            return;
        }
        while src.has_remaining() {
            let chunk = src.chunk();
            let step = chunk.len();
            self.put_slice(chunk);
            src.advance(step);
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use prost::Message;

    use super::*;

    #[derive(Clone, PartialEq, ::prost::Message)]
    struct Blob {
        #[prost(uint64, tag = "1")]
        offset: u64,
        #[prost(bytes = "bytes", tag = "2")]
        data: Bytes,
        #[prost(string, tag = "3")]
        name: String,
    }

    #[derive(Clone, PartialEq, ::prost::Message)]
    struct Wrapper {
        #[prost(message, optional, tag = "1")]
        inner: Option<Blob>,
        #[prost(bytes = "bytes", tag = "2")]
        more: Bytes,
    }

    fn encode(message: &impl Message) -> Payload {
        let mut buf = PayloadBuf::with_len_hint(message.encoded_len());
        message.encode(&mut buf).unwrap();
        buf.finish()
    }

    fn holds(payload: &Payload, bytes: &Bytes) -> bool {
        payload
            .parts()
            .any(|part| part.as_ptr() == bytes.as_ptr() && part.len() == bytes.len())
    }

    #[test]
    fn a_large_bytes_field_is_a_part_of_its_own() {
        let blob = Blob {
            offset: 9,
            data: Bytes::from(vec![3u8; 256 << 10]),
            name: "tensor".into(),
        };
        let payload = encode(&blob);
        assert_eq!(payload.len(), blob.encoded_len());
        assert_eq!(payload.part_count(), 3, "before, the field, after");
        assert!(
            holds(&payload, &blob.data),
            "the field's memory, not a copy"
        );
        assert_eq!(payload.clone().into_contiguous(), blob.encode_to_vec());
        // And it decodes straight from the parts.
        assert_eq!(Blob::decode(payload).unwrap(), blob);
    }

    #[test]
    fn nested_and_several_fields_each_stay_in_place() {
        let wrapper = Wrapper {
            inner: Some(Blob {
                offset: 1,
                data: Bytes::from(vec![1u8; 100 << 10]),
                name: String::new(),
            }),
            more: Bytes::from(vec![2u8; 40 << 10]),
        };
        let payload = encode(&wrapper);
        assert!(holds(&payload, &wrapper.inner.as_ref().unwrap().data));
        assert!(holds(&payload, &wrapper.more));
        assert_eq!(payload.into_contiguous(), wrapper.encode_to_vec());
    }

    #[test]
    fn small_fields_and_large_other_content_stay_one_part() {
        let small = Blob {
            offset: 1,
            data: Bytes::from(vec![5u8; SEPARATE_PARTS_FROM - 1]),
            name: "x".repeat(1000),
        };
        let payload = encode(&small);
        assert_eq!(payload.part_count(), 1, "copied: below the threshold");
        assert_eq!(payload.into_contiguous(), small.encode_to_vec());

        // Large for a string's sake: moved once out of the first chunk, one part.
        let text = Blob {
            offset: 2,
            data: Bytes::new(),
            name: "y".repeat(3 << 20),
        };
        let payload = encode(&text);
        assert_eq!(payload.part_count(), 1);
        assert_eq!(payload.into_contiguous(), text.encode_to_vec());
    }

    #[test]
    fn a_wrong_hint_still_encodes_every_byte() {
        let blob = Blob {
            offset: u64::MAX,
            data: Bytes::from(vec![9u8; 70 << 10]),
            name: "z".repeat(50 << 10),
        };
        for hint in [0, 1, 100, blob.encoded_len() / 2, blob.encoded_len() * 3] {
            let mut buf = PayloadBuf::with_len_hint(hint);
            blob.encode(&mut buf).unwrap();
            assert_eq!(
                buf.finish().into_contiguous(),
                blob.encode_to_vec(),
                "hint {hint}"
            );
        }
    }
}
