//! [`SendBuffer`]: build a large payload in place, send it without a copy.

use std::fmt;
use std::ops::{Deref, DerefMut};

use bytes::{Bytes, BytesMut};

use crate::codec::recycle;

/// Memory to build a large payload in place and send without copying it.
///
/// It comes from the process's recycled large buffers (`codec::recycle`):
/// steady traffic reuses memory instead of mapping (and page-faulting) new
/// memory per call, and where rdma:// is registered that memory is backed by
/// huge pages, which a peer's RDMA READ through the soft provider copies at
/// memory speed. [`freeze`](SendBuffer::freeze) turns it into [`Bytes`];
/// sent as a raw payload ([`crate::Channel::unary`]), those bytes are never
/// copied on the sending side: tcp:// writes them from where they lie, and
/// rdma:// lets the peer READ them there.
///
/// ```no_run
/// use rpc_core::{Channel, Request, SendBuffer};
///
/// async fn send_tensor(channel: &Channel, tensor: &[f32]) -> Result<(), rpc_core::Status> {
///     let mut buffer = SendBuffer::with_capacity(tensor.len() * 4);
///     for value in tensor {
///         buffer.extend_from_slice(&value.to_le_bytes()); // written once, in place
///     }
///     let mut request = Request::new(buffer.freeze()); // frozen: immutable from here on
///     request.set_method("/tensors.v1.Store/Put");
///     channel.unary(request).await?; // the peer READs the buffer itself; no copy on this side
///     Ok(())
/// }
/// ```
///
/// **Ownership.** `freeze` consumes the buffer, and `Bytes` are immutable:
/// memory handed to a call stays alive and unchanged until the call is done
/// with it (over rdma://, until the peer's DONE or the window's revocation;
/// the transport holds a reference until then), and it goes back to the
/// recycled buffers only after the last reference is dropped. The types
/// enforce this; there is no timer:
///
/// ```compile_fail,E0382
/// let mut buffer = rpc_core::SendBuffer::with_capacity(1 << 20);
/// buffer.extend_from_slice(b"tensor bytes");
/// let payload = buffer.freeze();
/// buffer.extend_from_slice(b"more"); // error: `buffer` was moved by `freeze`
/// ```
///
/// ```compile_fail,E0594
/// let payload = rpc_core::SendBuffer::with_capacity(64).freeze();
/// let mut alias = payload.clone();
/// alias[0] = 1; // error: `Bytes` cannot be written through
/// ```
pub struct SendBuffer {
    buffer: BytesMut,
}

impl SendBuffer {
    /// An empty buffer with room for at least `capacity` bytes.
    pub fn with_capacity(capacity: usize) -> SendBuffer {
        SendBuffer {
            buffer: recycle::take(capacity),
        }
    }

    /// Bytes written so far.
    pub fn len(&self) -> usize {
        self.buffer.len()
    }

    /// True when nothing was written.
    pub fn is_empty(&self) -> bool {
        self.buffer.is_empty()
    }

    /// Bytes it can hold without growing.
    pub fn capacity(&self) -> usize {
        self.buffer.capacity()
    }

    /// Appends `bytes`.
    pub fn extend_from_slice(&mut self, bytes: &[u8]) {
        self.buffer.extend_from_slice(bytes);
    }

    /// Grows or shrinks to `len` bytes; new bytes are `value`. Fill the
    /// buffer in place afterwards through `DerefMut`.
    pub fn resize(&mut self, len: usize, value: u8) {
        self.buffer.resize(len, value);
    }

    /// The payload: immutable from now on, and back among the recycled
    /// buffers when its last clone is dropped.
    pub fn freeze(self) -> Bytes {
        recycle::into_bytes(self.buffer)
    }
}

impl Deref for SendBuffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.buffer
    }
}

impl DerefMut for SendBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buffer
    }
}

impl AsRef<[u8]> for SendBuffer {
    fn as_ref(&self) -> &[u8] {
        &self.buffer
    }
}

impl AsMut<[u8]> for SendBuffer {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.buffer
    }
}

impl std::io::Write for SendBuffer {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl fmt::Debug for SendBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SendBuffer")
            .field("len", &self.len())
            .field("capacity", &self.capacity())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filled_in_place_frozen_and_recycled_after_the_last_reference() {
        let mut buffer = SendBuffer::with_capacity(2 << 20);
        buffer.resize(2 << 20, 0);
        buffer[..5].copy_from_slice(b"hello");
        let at = buffer.as_ptr();
        let payload = buffer.freeze();
        assert_eq!(payload.as_ptr(), at, "frozen where it was written");
        assert_eq!(&payload[..5], b"hello");
        let held = payload.slice(1..3);
        drop(payload);
        // Still referenced by `held`: not reused.
        let other = SendBuffer::with_capacity(2 << 20);
        assert_ne!(other.as_ptr(), at);
        drop(held);
        // Now the memory is free for the next buffer of its size.
        let again = SendBuffer::with_capacity(2 << 20);
        assert_eq!(again.as_ptr(), at);
        drop(other);
    }
}
