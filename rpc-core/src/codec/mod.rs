//! Codecs: how a message becomes payload bytes and back, independent of the transport.
//!
//! Generated code uses [`ProstCodec`]; [`BincodeCodec`] serves hand-written
//! services whose messages are serde types.

mod bincode;
mod payload_buf;
mod prost;
pub mod recycle;

use bytes::{Bytes, BytesMut};

use crate::payload::Payload;
use crate::status::Status;

pub use self::bincode::BincodeCodec;
pub use self::payload_buf::{PayloadBuf, SEPARATE_PARTS_FROM, bytes_copied_by_encoding};
pub use self::prost::ProstCodec;

/// Encodes requests of one type and decodes responses of another (or the
/// reverse on a server).
///
/// Encoding writes into a caller-provided buffer so that a message can be
/// written straight into its frame; decoding gets the payload as [`Bytes`],
/// which may live in a transport's own (e.g. registered) memory.
pub trait Codec: Default + Send + 'static {
    /// The type written.
    type Encode: Send + 'static;
    /// The type read.
    type Decode: Send + 'static;

    /// Appends the encoding of `item` to `dst`. A failure is [`crate::Code::Internal`].
    fn encode(&mut self, item: Self::Encode, dst: &mut BytesMut) -> Result<(), Status>;

    /// The encoded length of `item` if it is cheap to know: the buffer is
    /// sized once, and a large message goes into a recycled buffer
    /// ([`recycle`]) instead of fresh memory. `None` by default.
    fn encoded_len(&self, item: &Self::Encode) -> Option<usize> {
        let _ = item;
        None
    }

    /// Encodes `item` as the payload of a request or response. By default
    /// one buffer written by [`Codec::encode`] (a recycled one when
    /// [`Codec::encoded_len`] says the message is large); codecs that can
    /// keep large fields where they lie return several parts
    /// ([`ProstCodec`] does, through [`PayloadBuf`]).
    fn encode_payload(&mut self, item: Self::Encode) -> Result<Payload, Status> {
        recycle::encode_to_bytes(self, item).map(Payload::from)
    }

    /// Appends the encoding of `item` to `dst`, where a stream gathers the
    /// messages of one frame. By default through [`Codec::encode_payload`]
    /// (its parts are kept or copied as [`PayloadBuf`] does);
    /// [`ProstCodec`] writes in place.
    fn encode_into(&mut self, item: Self::Encode, dst: &mut PayloadBuf) -> Result<(), Status> {
        let payload = self.encode_payload(item)?;
        for part in payload.parts() {
            bytes::BufMut::put(dst, part.clone());
        }
        Ok(())
    }

    /// Decodes one message from a whole payload. A failure is [`crate::Code::Internal`].
    fn decode(&mut self, src: Bytes) -> Result<Self::Decode, Status>;
}
