//! Protocol Buffers via prost.

use std::marker::PhantomData;

use bytes::{Bytes, BytesMut};

use super::{Codec, PayloadBuf};
use crate::payload::Payload;
use crate::status::Status;

/// A [`Codec`] for prost messages: the default of generated code.
#[derive(Debug)]
pub struct ProstCodec<E, D> {
    _types: PhantomData<fn(E) -> D>,
}

impl<E, D> Default for ProstCodec<E, D> {
    fn default() -> Self {
        ProstCodec {
            _types: PhantomData,
        }
    }
}

impl<E, D> Codec for ProstCodec<E, D>
where
    E: prost::Message + Send + 'static,
    D: prost::Message + Default + Send + 'static,
{
    type Encode = E;
    type Decode = D;

    fn encode(&mut self, item: E, dst: &mut BytesMut) -> Result<(), Status> {
        item.encode(dst)
            .map_err(|error| Status::internal(format!("failed to encode message: {error}")))
    }

    fn encoded_len(&self, item: &E) -> Option<usize> {
        Some(item.encoded_len())
    }

    /// Large `bytes` fields of type [`Bytes`] are parts of their own: sent
    /// where they lie, never copied ([`PayloadBuf`]).
    fn encode_payload(&mut self, item: E) -> Result<Payload, Status> {
        let mut buf = PayloadBuf::with_len_hint(item.encoded_len());
        item.encode(&mut buf)
            .map_err(|error| Status::internal(format!("failed to encode message: {error}")))?;
        Ok(buf.finish())
    }

    fn encode_into(&mut self, item: E, dst: &mut PayloadBuf) -> Result<(), Status> {
        item.encode(dst)
            .map_err(|error| Status::internal(format!("failed to encode message: {error}")))
    }

    fn decode(&mut self, src: Bytes) -> Result<D, Status> {
        D::decode(src)
            .map_err(|error| Status::internal(format!("failed to decode message: {error}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, PartialEq, ::prost::Message)]
    struct Point {
        #[prost(int32, tag = "1")]
        x: i32,
        #[prost(string, tag = "2")]
        label: String,
    }

    #[test]
    fn round_trip_and_bad_input() {
        let mut codec = ProstCodec::<Point, Point>::default();
        let mut buf = BytesMut::new();
        let point = Point {
            x: -3,
            label: "p".into(),
        };
        codec.encode(point.clone(), &mut buf).unwrap();
        assert_eq!(codec.decode(buf.freeze()).unwrap(), point);
        let err = codec.decode(Bytes::from_static(&[0x0a, 0xff])).unwrap_err();
        assert_eq!(err.code(), crate::Code::Internal);
    }
}
