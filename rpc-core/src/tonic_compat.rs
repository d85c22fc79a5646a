//! Conversions to and from tonic's types (feature `tonic`), for code that
//! moves between the two: `Request`, `Response`, `Status` and the metadata.
//!
//! ```
//! let status = rpc_core::Status::not_found("no such key");
//! let theirs: tonic::Status = status.into();
//! assert_eq!(theirs.code(), tonic::Code::NotFound);
//! let ours = rpc_core::Status::from(theirs);
//! assert_eq!(ours.code(), rpc_core::Code::NotFound);
//! ```
//!
//! rdma-rpc's [`Metadata`] is stricter than tonic's `MetadataMap`: keys are
//! letters, digits, `-`, `_` and `.`; ASCII values printable ASCII. A
//! `MetadataMap` converts with [`Metadata::try_from`], which names the entry
//! it cannot take. The conversions of requests, responses and statuses
//! cannot fail: they leave such an entry out (none that tonic's own
//! generated code or a gRPC peer's valid headers produce). A request's
//! `grpc-timeout` (tonic keeps the timeout there) becomes its
//! [`Request::timeout`], and back.

use tonic::metadata::{KeyAndValueRef, MetadataMap};

use crate::metadata::{InvalidMetadata, Metadata, MetadataValue};
use crate::request::{Request, Response};
use crate::status::{Code, Status};

/// tonic keeps a request's timeout as this header.
const GRPC_TIMEOUT: &str = "grpc-timeout";

impl TryFrom<&MetadataMap> for Metadata {
    type Error = InvalidMetadata;

    fn try_from(map: &MetadataMap) -> Result<Metadata, InvalidMetadata> {
        let mut metadata = Metadata::new();
        for entry in map.iter() {
            match entry {
                KeyAndValueRef::Ascii(key, value) => {
                    let value = value
                        .to_str()
                        .map_err(|_| InvalidMetadata::AsciiValue(key.to_string()))?;
                    metadata.append(key.as_str(), value)?;
                }
                KeyAndValueRef::Binary(key, value) => {
                    let bytes = value
                        .to_bytes()
                        .map_err(|_| InvalidMetadata::Malformed("binary value is not base64"))?;
                    metadata.append_bin(key.as_str(), bytes)?;
                }
            }
        }
        Ok(metadata)
    }
}

impl TryFrom<MetadataMap> for Metadata {
    type Error = InvalidMetadata;

    fn try_from(map: MetadataMap) -> Result<Metadata, InvalidMetadata> {
        Metadata::try_from(&map)
    }
}

/// The entries of `map` rdma-rpc's metadata can carry (see the module docs).
fn lenient(map: &MetadataMap) -> Metadata {
    let mut metadata = Metadata::new();
    for entry in map.iter() {
        let _ = match entry {
            KeyAndValueRef::Ascii(key, value) => match value.to_str() {
                Ok(value) => metadata.append(key.as_str(), value),
                Err(_) => continue,
            },
            KeyAndValueRef::Binary(key, value) => match value.to_bytes() {
                Ok(bytes) => metadata.append_bin(key.as_str(), bytes),
                Err(_) => continue,
            },
        };
    }
    metadata
}

impl From<&Metadata> for MetadataMap {
    fn from(metadata: &Metadata) -> MetadataMap {
        let mut map = MetadataMap::with_capacity(metadata.len());
        for (key, value) in metadata.iter() {
            // Every key and value rdma-rpc's metadata holds is one tonic's takes.
            match value {
                MetadataValue::Ascii(bytes) => {
                    let key = tonic::metadata::AsciiMetadataKey::from_bytes(key.as_bytes());
                    let value = tonic::metadata::AsciiMetadataValue::try_from(bytes.as_ref());
                    if let (Ok(key), Ok(value)) = (key, value) {
                        map.append(key, value);
                    }
                }
                MetadataValue::Binary(bytes) => {
                    if let Ok(key) = tonic::metadata::BinaryMetadataKey::from_bytes(key.as_bytes())
                    {
                        map.append_bin(
                            key,
                            tonic::metadata::BinaryMetadataValue::from_bytes(bytes),
                        );
                    }
                }
            }
        }
        map
    }
}

impl From<Metadata> for MetadataMap {
    fn from(metadata: Metadata) -> MetadataMap {
        MetadataMap::from(&metadata)
    }
}

impl From<tonic::Code> for Code {
    fn from(code: tonic::Code) -> Code {
        Code::from(code as i32)
    }
}

impl From<Code> for tonic::Code {
    fn from(code: Code) -> tonic::Code {
        tonic::Code::from(code as i32)
    }
}

impl From<tonic::Status> for Status {
    fn from(status: tonic::Status) -> Status {
        Status::with_metadata(
            status.code().into(),
            status.message(),
            lenient(status.metadata()),
        )
    }
}

impl From<Status> for tonic::Status {
    fn from(status: Status) -> tonic::Status {
        tonic::Status::with_metadata(
            status.code().into(),
            status.message(),
            MetadataMap::from(status.metadata()),
        )
    }
}

impl<T> From<tonic::Request<T>> for Request<T> {
    fn from(request: tonic::Request<T>) -> Request<T> {
        let (map, extensions, message) = request.into_parts();
        let timeout = map
            .get(GRPC_TIMEOUT)
            .and_then(|value| value.to_str().ok())
            .and_then(crate::metadata::parse_grpc_timeout);
        let mut ours = Request::new(message);
        let mut metadata = lenient(&map);
        metadata.remove(GRPC_TIMEOUT);
        *ours.metadata_mut() = metadata;
        if let Some(timeout) = timeout {
            ours.set_timeout(timeout);
        }
        *ours.extensions_mut() = extensions;
        ours
    }
}

impl<T> From<Request<T>> for tonic::Request<T> {
    fn from(request: Request<T>) -> tonic::Request<T> {
        let timeout = request.timeout();
        let map = MetadataMap::from(request.metadata());
        let mut request = request;
        let extensions = std::mem::take(request.extensions_mut());
        let mut theirs = tonic::Request::from_parts(map, extensions, request.into_inner());
        if let Some(timeout) = timeout {
            theirs.set_timeout(timeout);
        }
        theirs
    }
}

impl<T> From<tonic::Response<T>> for Response<T> {
    fn from(response: tonic::Response<T>) -> Response<T> {
        let (map, message, extensions) = response.into_parts();
        let mut ours = Response::from_parts(lenient(&map), message);
        *ours.extensions_mut() = extensions;
        ours
    }
}

impl<T> From<Response<T>> for tonic::Response<T> {
    fn from(mut response: Response<T>) -> tonic::Response<T> {
        let extensions = std::mem::take(response.extensions_mut());
        let (metadata, message) = response.into_parts();
        tonic::Response::from_parts(MetadataMap::from(&metadata), message, extensions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn both_kinds() -> Metadata {
        let mut metadata = Metadata::new();
        metadata.insert("x-user", "ada").unwrap();
        metadata.append("x-tag", "a").unwrap();
        metadata.append("x-tag", "b").unwrap();
        metadata
            .insert_bin("x-trace-bin", vec![0u8, 1, 254, 255])
            .unwrap();
        metadata
    }

    #[test]
    fn metadata_round_trips_through_a_metadata_map_with_binary_values_and_repeats() {
        let map = MetadataMap::from(both_kinds());
        assert_eq!(map.get("x-user").unwrap(), "ada");
        let tags: Vec<_> = map.get_all("x-tag").iter().collect();
        assert_eq!(tags, ["a", "b"]);
        assert_eq!(
            map.get_bin("x-trace-bin").unwrap().to_bytes().unwrap(),
            &[0u8, 1, 254, 255][..]
        );
        assert_eq!(Metadata::try_from(&map).unwrap(), both_kinds());
    }

    #[test]
    fn a_metadata_map_entry_rdma_rpc_cannot_carry_is_named_or_left_out() {
        let mut map = MetadataMap::new();
        map.insert("x-ok", "yes".parse().unwrap());
        // A header name tonic takes and rdma-rpc's keys do not ('!').
        map.insert(
            tonic::metadata::AsciiMetadataKey::from_bytes(b"x-odd!").unwrap(),
            "v".parse().unwrap(),
        );
        let refused = Metadata::try_from(&map).unwrap_err();
        assert!(refused.to_string().contains("x-odd!"), "{refused}");
        let status: Status = tonic::Status::with_metadata(tonic::Code::Aborted, "m", map).into();
        assert_eq!(status.metadata().get("x-ok"), Some("yes"));
        assert_eq!(status.metadata().len(), 1, "the odd entry is left out");
    }

    #[test]
    fn statuses_keep_code_message_and_metadata_both_ways() {
        let ours = Status::with_metadata(Code::ResourceExhausted, "full", both_kinds());
        let theirs = tonic::Status::from(ours);
        assert_eq!(theirs.code(), tonic::Code::ResourceExhausted);
        assert_eq!(theirs.message(), "full");
        assert_eq!(theirs.metadata().get("x-user").unwrap(), "ada");
        let back = Status::from(theirs);
        assert_eq!(back.code(), Code::ResourceExhausted);
        assert_eq!(back.message(), "full");
        assert_eq!(back.metadata(), &both_kinds());
        for number in 0..=16 {
            let code = Code::from(number);
            assert_eq!(Code::from(tonic::Code::from(code)), code);
        }
    }

    #[derive(Debug, Clone, PartialEq)]
    struct Marker(u32);

    #[test]
    fn requests_keep_message_metadata_timeout_and_extensions_both_ways() {
        let mut ours = Request::new("hello");
        *ours.metadata_mut() = both_kinds();
        ours.set_timeout(Duration::from_millis(1500));
        ours.extensions_mut().insert(Marker(7));
        let theirs = tonic::Request::from(ours);
        assert_eq!(theirs.get_ref(), &"hello");
        assert_eq!(theirs.metadata().get("x-user").unwrap(), "ada");
        assert!(
            theirs.metadata().get(GRPC_TIMEOUT).is_some(),
            "tonic's timeout"
        );
        assert_eq!(theirs.extensions().get::<Marker>(), Some(&Marker(7)));
        let back = Request::from(theirs);
        assert_eq!(back.get_ref(), &"hello");
        assert_eq!(
            back.metadata(),
            &both_kinds(),
            "grpc-timeout is not metadata"
        );
        assert_eq!(back.timeout(), Some(Duration::from_millis(1500)));
        assert_eq!(back.extensions().get::<Marker>(), Some(&Marker(7)));
    }

    #[test]
    fn responses_keep_message_metadata_and_extensions_both_ways() {
        let mut ours = Response::from_parts(both_kinds(), 42u8);
        ours.extensions_mut().insert(Marker(9));
        let theirs = tonic::Response::<u8>::from(ours);
        assert_eq!(theirs.get_ref(), &42);
        assert_eq!(theirs.extensions().get::<Marker>(), Some(&Marker(9)));
        let back = Response::from(theirs);
        assert_eq!(back.metadata(), &both_kinds());
        assert_eq!(back.extensions().get::<Marker>(), Some(&Marker(9)));
        assert_eq!(back.into_inner(), 42);
    }

    #[test]
    fn grpc_timeouts_parse_in_every_unit_and_refuse_the_rest() {
        use crate::metadata::parse_grpc_timeout as parse_timeout;
        assert_eq!(parse_timeout("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(parse_timeout("3M"), Some(Duration::from_secs(180)));
        assert_eq!(parse_timeout("4S"), Some(Duration::from_secs(4)));
        assert_eq!(parse_timeout("1500m"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_timeout("7u"), Some(Duration::from_micros(7)));
        assert_eq!(parse_timeout("9n"), Some(Duration::from_nanos(9)));
        for bad in ["", "S", "123456789S", "1x", "-1S", "1.5S"] {
            assert_eq!(parse_timeout(bad), None, "{bad}");
        }
    }
}
