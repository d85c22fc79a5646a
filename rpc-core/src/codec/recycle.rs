//! Large encode buffers, recycled: the [`rpc_recycle`] crate (which the RDMA
//! verbs layer reads without depending on rpc-core), and encoding into them.

pub use rpc_recycle::*;

use bytes::{Bytes, BytesMut};

use super::Codec;
use crate::status::Status;

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
