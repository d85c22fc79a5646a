//! Large encode buffers, recycled: a large message is encoded into memory that
//! earlier messages already touched, so steady traffic of large messages
//! allocates (and page-faults in) nothing per call.
//!
//! Memory above the allocator's mmap threshold (32 MiB at most with glibc) is
//! mapped fresh on every allocation and unmapped on every free: a 64 MiB
//! message then costs 16,384 page faults, which is longer than copying it.
//! Buffers of [`RECYCLE_FROM`] bytes or more go back to a process-wide free
//! list when the last `Bytes` over them is dropped (after the transport sent
//! the frame, or the peer READ it), bounded by [`MAX_IDLE_BYTES`] in all: a
//! buffer returned to a full list makes room by freeing the longest-idle ones.

use std::sync::Mutex;

use bytes::{Bytes, BytesMut};

use super::Codec;
use crate::status::Status;

/// Messages at least this long (by the codec's length hint) are encoded into
/// recycled buffers; smaller ones into an ordinary allocation.
pub const RECYCLE_FROM: usize = 1 << 20;

/// Idle recycled buffers the process keeps, in bytes, all together.
pub const MAX_IDLE_BYTES: usize = 512 << 20;

/// What is done to the memory of each new recycled buffer before its first
/// use; see [`prepare_new_buffers_with`].
pub type PrepareBuffer = fn(&mut [std::mem::MaybeUninit<u8>]);

static PREPARE: std::sync::OnceLock<PrepareBuffer> = std::sync::OnceLock::new();

/// Sets, once per process, what is done to the memory of every new recycled
/// buffer before its first use (later calls change nothing). rdma:// asks
/// the kernel to back it with transparent huge pages: a peer's READ of a
/// 64 MiB frame then pins 32 pages instead of 16,384, which doubles the soft
/// provider's READ (`docs/providers.md`).
pub fn prepare_new_buffers_with(prepare: PrepareBuffer) {
    let _ = PREPARE.set(prepare);
}

/// The free list: idle buffers and their total capacity.
struct FreeList {
    idle: Vec<BytesMut>,
    bytes: usize,
}

static FREE: Mutex<FreeList> = Mutex::new(FreeList {
    idle: Vec::new(),
    bytes: 0,
});

fn free_list() -> std::sync::MutexGuard<'static, FreeList> {
    FREE.lock().unwrap_or_else(|poison| poison.into_inner())
}

/// A buffer of at least `len` bytes: the smallest idle one that fits when
/// `len` is [`RECYCLE_FROM`] or more, else a new one. Hand it out with
/// [`into_bytes`] so it comes back.
pub(crate) fn take(len: usize) -> BytesMut {
    if len < RECYCLE_FROM {
        return BytesMut::with_capacity(len);
    }
    let mut free = free_list();
    let best = free
        .idle
        .iter()
        .enumerate()
        .filter(|(_, buffer)| buffer.capacity() >= len)
        .min_by_key(|(_, buffer)| buffer.capacity())
        .map(|(index, _)| index);
    match best {
        Some(index) => {
            let buffer = free.idle.remove(index);
            free.bytes -= buffer.capacity();
            buffer
        }
        None => {
            drop(free);
            let mut buffer = BytesMut::with_capacity(len);
            if let Some(prepare) = PREPARE.get() {
                prepare(buffer.spare_capacity_mut());
            }
            buffer
        }
    }
}

/// Gives `buffer` back, freeing the longest-idle buffers to make room (or
/// `buffer` itself when it is larger than the whole list may hold).
fn give_back(mut buffer: BytesMut) {
    if buffer.capacity() > MAX_IDLE_BYTES {
        return;
    }
    buffer.clear();
    let mut evicted = Vec::new();
    let mut free = free_list();
    // `idle` is in order of return: the front has waited longest.
    while free.bytes + buffer.capacity() > MAX_IDLE_BYTES && !free.idle.is_empty() {
        let old = free.idle.remove(0);
        free.bytes -= old.capacity();
        evicted.push(old);
    }
    free.bytes += buffer.capacity();
    free.idle.push(buffer);
    drop(free);
    drop(evicted);
}

/// Bytes of idle recycled buffers now (for tests and metrics).
pub fn idle_bytes() -> usize {
    free_list().bytes
}

/// A recycled buffer behind `Bytes`: back to the free list on the last drop.
struct Recycled(BytesMut);

impl AsRef<[u8]> for Recycled {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        give_back(std::mem::take(&mut self.0));
    }
}

/// `buffer` as `Bytes` that return it to the free list when the last clone
/// drops (small buffers are simply frozen).
pub(crate) fn into_bytes(buffer: BytesMut) -> Bytes {
    if buffer.capacity() < RECYCLE_FROM {
        return buffer.freeze();
    }
    Bytes::from_owner(Recycled(buffer))
}

/// Encodes `item` with `codec` into one buffer: a recycled one when the
/// codec says the message is large, else a fresh allocation.
pub(crate) fn encode_to_bytes<C: Codec>(codec: &mut C, item: C::Encode) -> Result<Bytes, Status> {
    let hint = codec.encoded_len(&item);
    match hint {
        Some(len) if len >= RECYCLE_FROM => {
            let mut buffer = take(len);
            codec.encode(item, &mut buffer)?;
            Ok(into_bytes(buffer))
        }
        _ => {
            let mut buffer = BytesMut::with_capacity(hint.unwrap_or(0));
            codec.encode(item, &mut buffer)?;
            Ok(buffer.freeze())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::ProstCodec;

    #[derive(Clone, PartialEq, ::prost::Message)]
    struct Blob {
        #[prost(bytes = "bytes", tag = "1")]
        data: Bytes,
    }

    #[test]
    fn a_large_message_reuses_the_buffer_of_the_one_before() {
        let mut codec = ProstCodec::<Blob, Blob>::default();
        let blob = Blob {
            data: Bytes::from(vec![5u8; 3 << 20]),
        };
        let first = encode_to_bytes(&mut codec, blob.clone()).unwrap();
        let first_at = first.as_ptr();
        let decoded: Blob = codec.decode(first.clone()).unwrap();
        assert_eq!(decoded, blob);
        drop(decoded);
        drop(first);
        assert!(idle_bytes() >= 3 << 20, "the buffer went back");
        let second = encode_to_bytes(&mut codec, blob.clone()).unwrap();
        assert_eq!(
            second.as_ptr(),
            first_at,
            "the same memory, no new allocation"
        );
        assert_eq!(codec.decode(second).unwrap(), blob);

        // Small messages do not touch the free list.
        let small = Blob {
            data: Bytes::from_static(b"tiny"),
        };
        let before = idle_bytes();
        drop(encode_to_bytes(&mut codec, small).unwrap());
        assert_eq!(idle_bytes(), before);
    }
}
