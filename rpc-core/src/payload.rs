//! [`Payload`]: the bytes of an outgoing message, as one or more parts.

use std::collections::VecDeque;
use std::fmt;
use std::io::IoSlice;

use bytes::{Buf, BufMut, Bytes};

use crate::codec::recycle;

/// The bytes of an outgoing message: one part, or several that are sent one
/// after the other as if they were one buffer.
///
/// A message whose large `bytes` field is a [`Bytes`] the application
/// already holds (a [`crate::SendBuffer`], a file read, a tensor) encodes as
/// three parts: the bytes before the field, the field's own bytes (never
/// copied), and the bytes after it. Transports send the parts where they
/// lie: tcp:// with vectored writes, rdma:// by letting the peer READ the
/// large part in place. A received message is always one contiguous
/// [`Bytes`], so only outgoing requests and responses are a `Payload`.
///
/// `Payload` is a [`Buf`] (for decoding or copying it) and converts from
/// everything `Bytes` does.
#[derive(Clone, Default)]
pub struct Payload {
    /// The first part; empty only when the whole payload is.
    first: Bytes,
    /// Parts after `first`, none of them empty.
    rest: VecDeque<Bytes>,
    /// Bytes in all parts.
    len: usize,
}

impl Payload {
    /// An empty payload.
    pub const fn new() -> Payload {
        Payload {
            first: Bytes::new(),
            rest: VecDeque::new(),
            len: 0,
        }
    }

    /// A payload of `parts`, in order (empty parts are dropped).
    pub fn from_parts(parts: impl IntoIterator<Item = Bytes>) -> Payload {
        let mut payload = Payload::new();
        for part in parts {
            payload.push(part);
        }
        payload
    }

    /// Appends `part`.
    pub fn push(&mut self, part: Bytes) {
        if part.is_empty() {
            return;
        }
        self.len += part.len();
        if self.first.is_empty() {
            self.first = part;
        } else {
            self.rest.push_back(part);
        }
    }

    /// Bytes in all parts.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The parts, in order (none empty).
    pub fn parts(&self) -> impl ExactSizeIterator<Item = &Bytes> + '_ {
        PartsIter {
            first: (!self.first.is_empty()).then_some(&self.first),
            rest: self.rest.iter(),
        }
    }

    /// How many parts there are.
    pub fn part_count(&self) -> usize {
        usize::from(!self.first.is_empty()) + self.rest.len()
    }

    /// The bytes in one buffer: free for a payload of one part, else a copy
    /// (into a recycled buffer when large).
    pub fn into_contiguous(self) -> Bytes {
        if self.rest.is_empty() {
            return self.first;
        }
        let mut joined = recycle::take(self.len);
        joined.put_slice(&self.first);
        for part in &self.rest {
            joined.put_slice(part);
        }
        recycle::into_bytes(joined)
    }
}

struct PartsIter<'a> {
    first: Option<&'a Bytes>,
    rest: std::collections::vec_deque::Iter<'a, Bytes>,
}

impl<'a> Iterator for PartsIter<'a> {
    type Item = &'a Bytes;

    fn next(&mut self) -> Option<&'a Bytes> {
        self.first.take().or_else(|| self.rest.next())
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let len = usize::from(self.first.is_some()) + self.rest.len();
        (len, Some(len))
    }
}

impl ExactSizeIterator for PartsIter<'_> {}

impl Buf for Payload {
    fn remaining(&self) -> usize {
        self.len
    }

    fn chunk(&self) -> &[u8] {
        &self.first
    }

    fn chunks_vectored<'a>(&'a self, dst: &mut [IoSlice<'a>]) -> usize {
        let mut filled = 0;
        for (slot, part) in dst.iter_mut().zip(self.parts()) {
            *slot = IoSlice::new(part);
            filled += 1;
        }
        filled
    }

    fn advance(&mut self, mut cnt: usize) {
        assert!(cnt <= self.len, "advanced past the end of a payload");
        self.len -= cnt;
        while cnt > 0 {
            let step = cnt.min(self.first.len());
            self.first.advance(step);
            cnt -= step;
            if self.first.is_empty() {
                self.first = self.rest.pop_front().unwrap_or_default();
            }
        }
    }

    fn copy_to_bytes(&mut self, len: usize) -> Bytes {
        assert!(len <= self.len, "copied past the end of a payload");
        if len <= self.first.len() {
            // Within one part: a slice of it, no copy.
            let bytes = self.first.split_to(len);
            self.len -= len;
            if self.first.is_empty() {
                self.first = self.rest.pop_front().unwrap_or_default();
            }
            return bytes;
        }
        let mut joined = bytes::BytesMut::with_capacity(len);
        while joined.len() < len {
            let take = (len - joined.len()).min(self.first.len());
            joined.put_slice(&self.first[..take]);
            self.advance(take);
        }
        joined.freeze()
    }
}

impl From<Bytes> for Payload {
    fn from(bytes: Bytes) -> Payload {
        Payload {
            len: bytes.len(),
            first: bytes,
            rest: VecDeque::new(),
        }
    }
}

impl From<Payload> for Bytes {
    /// [`Payload::into_contiguous`].
    fn from(payload: Payload) -> Bytes {
        payload.into_contiguous()
    }
}

impl From<Vec<u8>> for Payload {
    fn from(bytes: Vec<u8>) -> Payload {
        Payload::from(Bytes::from(bytes))
    }
}

impl From<&'static [u8]> for Payload {
    fn from(bytes: &'static [u8]) -> Payload {
        Payload::from(Bytes::from_static(bytes))
    }
}

impl From<&'static str> for Payload {
    fn from(text: &'static str) -> Payload {
        Payload::from(Bytes::from_static(text.as_bytes()))
    }
}

impl From<String> for Payload {
    fn from(text: String) -> Payload {
        Payload::from(Bytes::from(text))
    }
}

impl PartialEq for Payload {
    /// Equal when the bytes are, however they are split into parts.
    fn eq(&self, other: &Payload) -> bool {
        self.len == other.len && self.clone().into_contiguous() == other.clone().into_contiguous()
    }
}

impl Eq for Payload {}

impl PartialEq<[u8]> for Payload {
    fn eq(&self, other: &[u8]) -> bool {
        self.len == other.len() && self.clone().into_contiguous() == other
    }
}

impl PartialEq<Bytes> for Payload {
    fn eq(&self, other: &Bytes) -> bool {
        self == other.as_ref()
    }
}

impl fmt::Debug for Payload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.rest.is_empty() {
            return fmt::Debug::fmt(&self.first, f);
        }
        f.debug_struct("Payload")
            .field("len", &self.len)
            .field("parts", &self.part_count())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn three_parts() -> Payload {
        Payload::from_parts([
            Bytes::from_static(b"head-"),
            Bytes::new(),
            Bytes::from(vec![7u8; 100]),
            Bytes::from_static(b"-tail"),
        ])
    }

    #[test]
    fn parts_skip_empty_ones_and_join_in_order() {
        let payload = three_parts();
        assert_eq!(payload.len(), 110);
        assert_eq!(payload.part_count(), 3);
        let lens: Vec<usize> = payload.parts().map(Bytes::len).collect();
        assert_eq!(lens, [5, 100, 5]);
        let joined = payload.clone().into_contiguous();
        assert_eq!(&joined[..5], b"head-");
        assert_eq!(&joined[105..], b"-tail");
        assert_eq!(payload, joined);
        assert!(Payload::from_parts([Bytes::new()]).is_empty());
        assert_eq!(Payload::new().part_count(), 0);
    }

    #[test]
    fn one_part_converts_without_a_copy() {
        let bytes = Bytes::from(vec![1u8; 4096]);
        let at = bytes.as_ptr();
        assert_eq!(Payload::from(bytes).into_contiguous().as_ptr(), at);
    }

    #[test]
    fn reads_as_a_buf_across_parts() {
        let mut payload = three_parts();
        let mut slices = [IoSlice::new(&[]); 4];
        assert_eq!(payload.chunks_vectored(&mut slices), 3);
        assert_eq!(&*slices[2], b"-tail");
        // Within the first part: a slice, no copy.
        let first = payload.first.as_ptr();
        assert_eq!(payload.copy_to_bytes(2).as_ptr(), first);
        // Across parts: joined.
        let across = payload.copy_to_bytes(4);
        assert_eq!(&across[..], &[b'a', b'd', b'-', 7]);
        payload.advance(99);
        assert_eq!(payload.remaining(), 5);
        assert_eq!(payload.chunk(), b"-tail");
        assert_eq!(payload.part_count(), 1);
        payload.advance(5);
        assert!(payload.is_empty() && payload.chunk().is_empty());
    }

    #[test]
    #[should_panic(expected = "past the end")]
    fn advancing_past_the_end_panics() {
        three_parts().advance(111);
    }
}
