//! Large frames of ours the peer READs: exposing a frame's payload where it
//! lies (or a copy of it in a pooled buffer) behind a REMOTE_READ window of
//! exactly its length, and announcing it.

use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use rpc_core::frame::EncodedFrame;

#[cfg(feature = "fault-injection")]
use crate::config::Fault;
use crate::pool::{LargePool, PooledBuffer};
use crate::protocol::{Body, HEADER_LEN, Message};
use crate::verbs::{AccessFlags, ExposedBuffer, ExposedBytes};

use super::state::LinkState;

/// A frame of ours the peer may READ until DONE (or the time-out).
pub(super) enum Exposed {
    /// The application's payload, read where it lies (no copy).
    Payload(ExposedBytes),
    /// A copy of the frame in a pooled buffer.
    Pooled {
        window: ExposedBuffer,
        pool: Arc<LargePool>,
    },
}

impl Exposed {
    /// Revokes the window and frees (or returns) its memory.
    pub(super) fn release(self) {
        match self {
            Exposed::Payload(window) => {
                // The payload is let go (or leaked if the window stays).
                drop(window.revoke());
            }
            Exposed::Pooled { window, pool } => {
                if let Some(buffer) = window.revoke() {
                    drop(PooledBuffer::restore(buffer, pool));
                }
            }
        }
    }
}

/// Our frames the peer may READ.
pub(super) const OUT: &str = "out";
/// The peer's frames being pulled.
pub(super) const IN: &str = "in";

/// `rdma_rendezvous_in_flight{direction}`, while `rpc_core::metrics` records.
pub(super) fn rendezvous_gauge(direction: &'static str, delta: f64) {
    if delta != 0.0 && rpc_core::metrics::enabled() {
        metrics::gauge!("rdma_rendezvous_in_flight", "direction" => direction).increment(delta);
    }
}

impl LinkState {
    /// Exposes a large frame to the peer's READs: its largest payload part
    /// where it lies, with everything before it (the frame's head, the start
    /// of the message) and after it (the message's end) inline in the
    /// announcement when they fit there; else a copy of the frame in a
    /// pooled buffer. Returns the announcement's token.
    pub(super) fn expose(&mut self, frame: EncodedFrame) -> Result<u64, String> {
        let Some((head, remote, tail)) =
            split_for_announce(&frame, self.protocol.max_announce_inline())
        else {
            return self.expose_copy(frame.into_contiguous());
        };
        let window = match ExposedBytes::expose(&self.device.pd, self.queue.qp(), remote) {
            Ok(window) => window,
            Err(error) => {
                // Memory the device cannot register where it lies (on
                // hardware: some file or device mappings) goes the copied way.
                tracing::debug!(%error, len = frame.len(), "payload not registrable in place: copying it");
                return self.expose_copy(frame.into_contiguous());
            }
        };
        let (addr, len, rkey) = self.forged(window.addr(), window.len() as u64, window.rkey());
        let token = self
            .protocol
            .send_rendezvous(head, tail, addr, len, rkey, Instant::now());
        self.exposed.insert(token, Exposed::Payload(window));
        // Its time-out is the housekeeper's.
        self.keeper_due = true;
        rendezvous_gauge(OUT, 1.0);
        Ok(token)
    }

    /// Copies a large frame into a pooled buffer and exposes exactly its
    /// bytes; returns the announcement's token.
    fn expose_copy(&mut self, frame: Bytes) -> Result<u64, String> {
        let mut buffer = self
            .device
            .large
            .take(frame.len())
            .map_err(|error| format!("rendezvous buffer of {} bytes: {error}", frame.len()))?;
        buffer.buffer_mut().as_mut_slice()[..frame.len()].copy_from_slice(&frame);
        let (registered, pool) = buffer.into_parts();
        let window =
            match registered.expose_to(self.queue.qp(), frame.len(), AccessFlags::REMOTE_READ) {
                Ok(window) => window,
                Err(failed) => {
                    drop(PooledBuffer::restore(failed.buffer, pool));
                    return Err(format!("exposing a rendezvous frame: {}", failed.error));
                }
            };
        let (addr, len, rkey) = self.forged(window.addr(), window.len() as u64, window.rkey());
        let token = self.protocol.send_rendezvous(
            Bytes::new(),
            Bytes::new(),
            addr,
            len,
            rkey,
            Instant::now(),
        );
        self.exposed.insert(token, Exposed::Pooled { window, pool });
        self.keeper_due = true;
        rendezvous_gauge(OUT, 1.0);
        Ok(token)
    }

    /// What the announcement says about a window: the truth, unless a test
    /// asked this side to forge it.
    #[cfg_attr(not(feature = "fault-injection"), allow(unused_mut))]
    fn forged(&self, mut addr: u64, mut len: u64, mut rkey: u32) -> (u64, u64, u32) {
        #[cfg(feature = "fault-injection")]
        match self.fault {
            Some(Fault::ForgeRkey) => rkey ^= 0x5a5a_0000,
            Some(Fault::ForgeRange) => addr += 1 << 30,
            Some(Fault::ForgeLength(extra)) => len += extra,
            Some(Fault::ForgeBatch) | None => {}
        }
        (addr, len, rkey)
    }

    /// A test asked this side to send broken BATCH messages.
    pub(super) fn forges_batches(&self) -> bool {
        #[cfg(feature = "fault-injection")]
        return self.fault == Some(Fault::ForgeBatch);
        #[cfg(not(feature = "fault-injection"))]
        false
    }
}

/// [`Fault::ForgeBatch`]: a BATCH whose first frame runs past its end.
pub(super) fn forge_batch(message: &Message, slot: &mut [u8]) {
    if matches!(message.body, Body::Batch(_)) {
        slot[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    }
}

/// How a large frame is announced: the inline head, the one part the peer
/// READs (the payload's largest), and the inline tail; `None` when the bytes
/// around that part do not fit `max_inline` (the frame is copied instead).
fn split_for_announce(frame: &EncodedFrame, max_inline: usize) -> Option<(Bytes, Bytes, Bytes)> {
    let header_len = rpc_core::frame::HEADER_LEN;
    if frame.payload.is_empty() && frame.head.len() > max_inline && header_len <= max_inline {
        // One contiguous frame: its header rides inline (so the peer can
        // name the call even if it refuses the frame), the rest is read
        // where it lies.
        let head = &frame.head;
        return Some((
            head.slice(..header_len),
            head.slice(header_len..),
            Bytes::new(),
        ));
    }
    let parts: Vec<&Bytes> = frame.payload.parts().collect();
    let (index, remote) = parts
        .iter()
        .enumerate()
        .max_by_key(|(_, part)| part.len())?;
    if frame.len() - remote.len() > max_inline {
        return None;
    }
    let join = |first: Option<&Bytes>, rest: &[&Bytes]| -> Bytes {
        match (first.filter(|bytes| !bytes.is_empty()), rest) {
            (None, []) => Bytes::new(),
            (Some(only), []) => only.clone(),
            (None, [only]) => (*only).clone(),
            (first, rest) => {
                let mut joined = BytesMut::new();
                joined.extend_from_slice(first.map_or(&[][..], |bytes| bytes));
                for part in rest {
                    joined.extend_from_slice(part);
                }
                joined.freeze()
            }
        }
    };
    let head = join(Some(&frame.head), &parts[..index]);
    let tail = join(None, &parts[index + 1..]);
    Some((head, (*remote).clone(), tail))
}
