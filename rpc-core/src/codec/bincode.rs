//! serde types via bincode 2 (pinned: 3.0.0 is a tombstone that does not compile).

use std::marker::PhantomData;

use bytes::{BufMut, Bytes, BytesMut};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::Codec;
use crate::status::Status;

/// A [`Codec`] for serde types, encoded with bincode's standard configuration
/// (little-endian, variable-length integers).
#[derive(Debug)]
pub struct BincodeCodec<E, D> {
    _types: PhantomData<fn(E) -> D>,
}

impl<E, D> Default for BincodeCodec<E, D> {
    fn default() -> Self {
        BincodeCodec {
            _types: PhantomData,
        }
    }
}

fn config() -> bincode::config::Configuration {
    bincode::config::standard()
}

impl<E, D> Codec for BincodeCodec<E, D>
where
    E: Serialize + Send + 'static,
    D: DeserializeOwned + Send + 'static,
{
    type Encode = E;
    type Decode = D;

    fn encode(&mut self, item: E, dst: &mut BytesMut) -> Result<(), Status> {
        let mut writer = dst.writer();
        bincode::serde::encode_into_std_write(&item, &mut writer, config())
            .map(|_| ())
            .map_err(|error| Status::internal(format!("failed to encode message: {error}")))
    }

    fn decode(&mut self, src: Bytes) -> Result<D, Status> {
        let (value, used) = bincode::serde::decode_from_slice(&src, config())
            .map_err(|error| Status::internal(format!("failed to decode message: {error}")))?;
        if used != src.len() {
            return Err(Status::internal(format!(
                "failed to decode message: {} trailing bytes",
                src.len() - used
            )));
        }
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Put {
        key: String,
        value: Vec<u8>,
    }

    #[test]
    fn round_trip_and_bad_input() {
        let mut codec = BincodeCodec::<Put, Put>::default();
        let mut buf = BytesMut::new();
        codec
            .encode(
                Put {
                    key: "k".into(),
                    value: vec![1, 2],
                },
                &mut buf,
            )
            .unwrap();
        let mut extra = buf.clone();
        assert_eq!(
            codec.decode(buf.freeze()).unwrap(),
            Put {
                key: "k".into(),
                value: vec![1, 2]
            }
        );
        extra.put_u8(0);
        assert_eq!(
            codec.decode(extra.freeze()).unwrap_err().code(),
            crate::Code::Internal
        );
        assert!(codec.decode(Bytes::from_static(&[200])).is_err());
    }
}
