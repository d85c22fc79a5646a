//! Writing gRPC messages into an HTTP/2 stream under HTTP/2's flow control,
//! for both sides (a server's responses, a channel's requests): messages are
//! framed into a queue, and the queue goes to h2 only as far as the peer's
//! window lets it, so what a slow peer makes a side hold stays bounded by
//! what the writer lets queue.

use std::collections::VecDeque;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use h2::SendStream;
use rpc_core::Payload;
use rpc_core::codec::PayloadBuf;

use crate::wire::{self, Encoding};

/// A message at least this long goes after its own prefix rather than
/// copied behind it.
const COPY_BELOW: usize = 16 << 10;

/// Framed messages on their way into one HTTP/2 stream.
#[derive(Default)]
pub(crate) struct FramedQueue {
    /// Framed bytes h2 has not taken yet.
    pending: VecDeque<Bytes>,
    pending_len: usize,
    /// Small messages framed together, not yet in `pending`.
    batch: BytesMut,
}

impl FramedQueue {
    /// Bytes held.
    pub(crate) fn held(&self) -> usize {
        self.pending_len + self.batch.len()
    }

    /// Frames `message` behind what is held, compressed with `encoding`
    /// if given: a small one copied into the batch, a large one after its
    /// own prefix (its parts are not copied).
    pub(crate) fn push(&mut self, message: Payload, encoding: Option<Encoding>) {
        let message = match encoding {
            Some(encoding) => Payload::from(wire::compress(encoding, &message.into_contiguous())),
            None => message,
        };
        let prefix = prefix(message.len(), encoding.is_some());
        if message.len() < COPY_BELOW {
            self.batch.reserve(prefix.len() + message.len());
            self.batch.extend_from_slice(&prefix);
            for part in message.parts() {
                self.batch.extend_from_slice(part);
            }
        } else {
            self.batch.extend_from_slice(&prefix);
            self.move_batch();
            for part in message.parts() {
                self.pending_len += part.len();
                self.pending.push_back(part.clone());
            }
        }
    }

    /// Takes messages framed already (uncompressed, behind gRPC's prefix).
    pub(crate) fn push_framed(&mut self, framed: Payload) {
        self.move_batch();
        for part in framed.parts() {
            self.pending_len += part.len();
            self.pending.push_back(part.clone());
        }
    }

    fn move_batch(&mut self) {
        if !self.batch.is_empty() {
            let batch = self.batch.split().freeze();
            self.pending_len += batch.len();
            self.pending.push_back(batch);
        }
    }

    /// Hands everything held to h2 at once, `end` ending the stream after
    /// it: h2 sends it as the peer's window allows, holding the rest (the
    /// same `Bytes`, not copies). For messages that are in memory whole
    /// already (a unary request, a request stream that had ended): no
    /// capacity is reserved and awaited first, so the calling task takes
    /// h2's lock once per piece and is not woken when window opens.
    pub(crate) fn send_now(
        &mut self,
        body: &mut SendStream<Bytes>,
        end: bool,
    ) -> Result<(), h2::Error> {
        self.move_batch();
        if self.pending.is_empty() {
            return if end {
                body.send_data(Bytes::new(), true)
            } else {
                Ok(())
            };
        }
        while let Some(piece) = self.pending.pop_front() {
            self.pending_len -= piece.len();
            body.send_data(piece, end && self.pending.is_empty())?;
        }
        Ok(())
    }

    /// Hands what is held to h2 as the peer's window allows; with `end`,
    /// the last piece ends the stream (an empty DATA frame when nothing
    /// is held). `Err(None)`: the stream closed.
    pub(crate) fn poll_flush(
        &mut self,
        body: &mut SendStream<Bytes>,
        end: bool,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), Option<h2::Error>>> {
        self.move_batch();
        while let Some(front) = self.pending.front_mut() {
            body.reserve_capacity(front.len());
            let capacity = match body.poll_capacity(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => return Poll::Ready(Err(None)),
                Poll::Ready(Some(Err(error))) => return Poll::Ready(Err(Some(error))),
                Poll::Ready(Some(Ok(capacity))) => capacity,
            };
            if capacity == 0 {
                continue;
            }
            let piece = front.split_to(capacity.min(front.len()));
            if front.is_empty() {
                self.pending.pop_front();
            }
            self.pending_len -= piece.len();
            body.send_data(piece, end && self.pending.is_empty())
                .map_err(Some)?;
            if end && self.pending.is_empty() {
                return Poll::Ready(Ok(()));
            }
        }
        if end {
            body.send_data(Bytes::new(), true).map_err(Some)?;
        }
        Poll::Ready(Ok(()))
    }
}

/// gRPC's prefix of an uncompressed message of `len` bytes, for a
/// `MessageTarget` that has the sink frame ready messages together
/// (`MessageTarget::framing`): both sides' writers.
pub(crate) fn plain_prefix(len: usize, batch: &mut PayloadBuf) {
    batch.put_u8(0);
    batch.put_u32(len as u32);
}

/// gRPC's 5-byte prefix of a message of `len` bytes.
fn prefix(len: usize, compressed: bool) -> [u8; wire::MESSAGE_PREFIX] {
    let len = (len as u32).to_be_bytes();
    [u8::from(compressed), len[0], len[1], len[2], len[3]]
}
