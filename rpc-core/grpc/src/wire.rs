//! gRPC over HTTP/2 as bytes and headers, without I/O: length-prefixed
//! messages, `grpc-timeout`, `grpc-message`, metadata ↔ HTTP/2 headers, and
//! how HTTP statuses and stream resets map to status codes. Everything here
//! follows the gRPC over HTTP/2 specification (PROTOCOL-HTTP2.md).

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD_NO_PAD;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue};
use rpc_core::metadata::{Metadata, MetadataValue};
use rpc_core::{Code, Status};

/// Bytes before each message: a compressed flag and a big-endian `u32` length.
pub(crate) const MESSAGE_PREFIX: usize = 5;

/// The content type of every gRPC request and response.
pub(crate) const CONTENT_TYPE: &str = "application/grpc";

/// Headers that are gRPC's or HTTP/2's own, never metadata.
pub(crate) fn is_reserved(name: &str) -> bool {
    matches!(
        name,
        "content-type"
            | "te"
            | "host"
            | "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "upgrade"
            | "content-length"
            | "grpc-timeout"
            | "grpc-encoding"
            | "grpc-accept-encoding"
            | "grpc-message-type"
            | "grpc-status"
            | "grpc-message"
            | "grpc-status-details-bin"
            | ENCODING_REQUEST
    )
}

/// Metadata that picks one call's message encoding, as in gRPC's core:
/// `gzip` or `identity`, on a client's request or a server's response
/// headers. Never sent as a header.
pub const ENCODING_REQUEST: &str = "grpc-internal-encoding-request";

/// A message encoding of `grpc-encoding` other than `identity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Encoding {
    /// gzip (RFC 1952).
    Gzip,
}

impl Encoding {
    /// Its name in `grpc-encoding` and `grpc-accept-encoding`.
    pub fn name(self) -> &'static str {
        match self {
            Encoding::Gzip => "gzip",
        }
    }

    fn bit(self) -> u8 {
        match self {
            Encoding::Gzip => 1,
        }
    }

    /// The encoding `name` names; `None` for `identity` and unknown names.
    pub fn from_name(name: &str) -> Option<Encoding> {
        match name.trim() {
            "gzip" => Some(Encoding::Gzip),
            _ => None,
        }
    }
}

/// What `grpc-encoding` says of a request or response: identity, an
/// encoding this side accepts, or one it does not (named).
pub(crate) fn message_encoding(
    headers: &HeaderMap,
    accepted: &[Encoding],
) -> Result<Option<Encoding>, String> {
    let Some(value) = headers.get("grpc-encoding") else {
        return Ok(None);
    };
    let name = value.to_str().unwrap_or("(not text)").trim();
    if name == "identity" {
        return Ok(None);
    }
    match Encoding::from_name(name) {
        Some(encoding) if accepted.contains(&encoding) => Ok(Some(encoding)),
        _ => Err(name.to_owned()),
    }
}

/// A set of encodings (without allocating: one bit each).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct EncodingSet(u8);

impl EncodingSet {
    /// The encodings `headers`' `grpc-accept-encoding` lists (on every line).
    pub(crate) fn accepted_by(headers: &HeaderMap) -> EncodingSet {
        let mut set = EncodingSet::default();
        for encoding in headers
            .get_all("grpc-accept-encoding")
            .iter()
            .filter_map(|value| value.to_str().ok())
            .flat_map(|list| list.split(','))
            .filter_map(Encoding::from_name)
        {
            set.0 |= encoding.bit();
        }
        set
    }

    pub(crate) fn contains(self, encoding: Encoding) -> bool {
        self.0 & encoding.bit() != 0
    }
}

/// `grpc-accept-encoding`'s value for `accepted`: them, then identity.
pub(crate) fn accept_encoding_value(accepted: &[Encoding]) -> HeaderValue {
    let mut names: Vec<&str> = accepted.iter().map(|encoding| encoding.name()).collect();
    names.push("identity");
    HeaderValue::from_str(&names.join(",")).unwrap_or(HeaderValue::from_static("identity"))
}

/// The encoding one call's metadata asks for with [`ENCODING_REQUEST`]:
/// `Some(None)` for identity, `None` when it does not say.
pub(crate) fn requested_encoding(metadata: &Metadata) -> Option<Option<Encoding>> {
    let name = metadata.get(ENCODING_REQUEST)?;
    if name.trim() == "identity" {
        return Some(None);
    }
    Encoding::from_name(name).map(Some)
}

/// `message` compressed with `encoding`.
pub(crate) fn compress(encoding: Encoding, message: &[u8]) -> Bytes {
    match encoding {
        Encoding::Gzip => {
            let mut encoder = flate2::write::GzEncoder::new(
                Vec::with_capacity(message.len() / 2 + 64),
                flate2::Compression::fast(),
            );
            // Writing into a Vec cannot fail.
            let _ = std::io::Write::write_all(&mut encoder, message);
            Bytes::from(encoder.finish().unwrap_or_default())
        }
    }
}

/// The length a compressed message says it has once decompressed (gzip's
/// ISIZE, the length modulo 2^32 of the last member): what the receiver
/// reserves before it decompresses. The peer's word: [`decompress`] holds
/// it to it.
pub(crate) fn declared_len(encoding: Encoding, compressed: &[u8]) -> Result<usize, DeframeError> {
    match encoding {
        Encoding::Gzip => {
            let tail = compressed
                .len()
                .checked_sub(4)
                .filter(|_| compressed.len() >= 18)
                .ok_or_else(|| DeframeError::Decompress("shorter than a gzip member".into()))?;
            let size = u32::from_le_bytes(compressed[tail..].try_into().expect("4 bytes"));
            Ok(size as usize)
        }
    }
}

/// Decompresses a message that must come to exactly `expected` bytes (its
/// [`declared_len`], within the receiver's limit): a message that would
/// grow past it fails as soon as it does, so a compressed message never
/// makes the receiver hold more than it reserved. One gzip member, as gRPC
/// senders write it (the trailer [`declared_len`] reads is the last one's).
pub(crate) fn decompress(
    encoding: Encoding,
    compressed: &[u8],
    expected: usize,
) -> Result<Bytes, DeframeError> {
    use std::io::Read;
    match encoding {
        Encoding::Gzip => {
            let mut out = Vec::with_capacity(expected);
            let decoder = flate2::read::GzDecoder::new(compressed);
            decoder
                .take(expected as u64 + 1)
                .read_to_end(&mut out)
                .map_err(|error| DeframeError::Decompress(error.to_string()))?;
            if out.len() > expected {
                return Err(DeframeError::Decompress(format!(
                    "it decompresses past the {expected} bytes its gzip trailer declares"
                )));
            }
            if out.len() < expected {
                return Err(DeframeError::Decompress(format!(
                    "it decompresses to {} bytes, not the {expected} its gzip trailer declares",
                    out.len()
                )));
            }
            Ok(Bytes::from(out))
        }
    }
}

/// True for a `content-type` that names gRPC (`application/grpc`,
/// `application/grpc+proto`, `application/grpc;…`).
pub(crate) fn is_grpc_content_type(value: Option<&HeaderValue>) -> bool {
    let Some(value) = value.and_then(|value| value.to_str().ok()) else {
        return false;
    };
    // Case-insensitive, without a lowercased copy per call.
    let starts_with = |prefix: &str| {
        value
            .get(..prefix.len())
            .is_some_and(|head| head.eq_ignore_ascii_case(prefix))
    };
    value.eq_ignore_ascii_case(CONTENT_TYPE)
        || starts_with("application/grpc+")
        || starts_with("application/grpc;")
}

/// The metadata in `headers`: every header that is not reserved and that
/// rdma-rpc's metadata can hold; `-bin` values are base64 (padded or not).
/// A header that cannot be metadata (a key or value rdma-rpc refuses, a
/// `-bin` value that is not base64) is left out and named in the log.
pub(crate) fn metadata_from_headers(headers: &HeaderMap) -> Metadata {
    let mut metadata = Metadata::new();
    for (name, value) in headers {
        let key = name.as_str();
        if is_reserved(key) || key.starts_with(':') {
            continue;
        }
        let added = if key.ends_with("-bin") {
            let text = value.as_bytes();
            let decoded = STANDARD_NO_PAD.decode(
                text.strip_suffix(b"==")
                    .or(text.strip_suffix(b"="))
                    .unwrap_or(text),
            );
            match decoded {
                Ok(bytes) => metadata.append_bin(key, bytes).is_ok(),
                Err(_) => false,
            }
        } else {
            value
                .to_str()
                .ok()
                .is_some_and(|text| metadata.append(key, text).is_ok())
        };
        if !added {
            tracing::debug!(
                header = key,
                "header left out of the metadata: not valid metadata"
            );
        }
    }
    metadata
}

/// Adds `metadata` to `headers`: `-bin` values base64 without padding. An
/// entry whose key HTTP/2 cannot carry is left out (rdma-rpc's keys are a
/// subset of HTTP/2's, so this does not happen with validated metadata).
pub(crate) fn metadata_into_headers(metadata: &Metadata, headers: &mut HeaderMap) {
    for (key, value) in metadata.iter() {
        if is_reserved(key) {
            continue;
        }
        let Ok(name) = HeaderName::from_bytes(key.as_bytes()) else {
            continue;
        };
        let value = match value {
            MetadataValue::Ascii(bytes) => HeaderValue::from_maybe_shared(bytes.clone()),
            MetadataValue::Binary(bytes) => HeaderValue::from_str(&STANDARD_NO_PAD.encode(bytes)),
        };
        if let Ok(value) = value {
            headers.append(name, value);
        }
    }
}

/// `grpc-timeout`'s value for `timeout`: at most 8 digits, in the finest
/// unit that holds it (rounded up, so a deadline never grows).
pub(crate) fn encode_timeout(timeout: Duration) -> String {
    const MAX: u128 = 99_999_999;
    let nanos = timeout.as_nanos().max(1);
    let units: [(u128, char); 6] = [
        (1, 'n'),
        (1_000, 'u'),
        (1_000_000, 'm'),
        (1_000_000_000, 'S'),
        (60_000_000_000, 'M'),
        (3_600_000_000_000, 'H'),
    ];
    for (size, unit) in units {
        let value = nanos.div_ceil(size);
        if value <= MAX {
            return format!("{value}{unit}");
        }
    }
    format!("{MAX}H")
}

/// Parses a `grpc-timeout` value (`1`–`8` digits and a unit of `H M S m u n`).
pub(crate) fn parse_timeout(value: &HeaderValue) -> Option<Duration> {
    value
        .to_str()
        .ok()
        .and_then(rpc_core::metadata::parse_grpc_timeout)
}

/// `grpc-message`'s value: percent-encoded UTF-8 (bytes outside printable
/// ASCII, and `%`, as `%XX`).
pub(crate) fn encode_message(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for byte in message.bytes() {
        if (0x20..0x7f).contains(&byte) && byte != b'%' {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// Decodes a `grpc-message` value; a malformed escape is kept as it is,
/// and bytes that are not UTF-8 become U+FFFD, as the specification asks.
pub(crate) fn decode_message(value: &[u8]) -> String {
    let mut out = Vec::with_capacity(value.len());
    let mut i = 0;
    while i < value.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if value[i] == b'%' && i + 2 < value.len() {
            if let (Some(high), Some(low)) = (hex(value[i + 1]), hex(value[i + 2])) {
                out.push((high * 16 + low) as u8);
                i += 3;
                continue;
            }
        }
        out.push(value[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The status in `grpc-status` / `grpc-message` of `headers` (a response's
/// trailers, or its headers when it is trailers-only), with the rest of
/// them as the status's metadata; `None` without `grpc-status`.
pub(crate) fn status_from_trailers(headers: &HeaderMap) -> Option<Status> {
    let code = headers.get("grpc-status")?;
    let code = code
        .to_str()
        .ok()
        .and_then(|text| text.parse::<i32>().ok())
        .map(Code::from)
        .unwrap_or(Code::Unknown);
    let message = headers
        .get("grpc-message")
        .map(|value| decode_message(value.as_bytes()))
        .unwrap_or_default();
    Some(Status::with_metadata(
        code,
        message,
        metadata_from_headers(headers),
    ))
}

/// `grpc-status`'s value for `code`, without formatting (and allocating)
/// one per call.
fn status_value(code: Code) -> HeaderValue {
    const VALUES: [&str; 17] = [
        "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15", "16",
    ];
    match VALUES.get(code as usize) {
        Some(value) => HeaderValue::from_static(value),
        None => HeaderValue::from(code as i32),
    }
}

/// The trailers that end a response with `status` (and `metadata`).
pub(crate) fn trailers(code: Code, message: &str, metadata: &Metadata) -> HeaderMap {
    let mut headers = HeaderMap::new();
    metadata_into_headers(metadata, &mut headers);
    headers.insert("grpc-status", status_value(code));
    if !message.is_empty() {
        if let Ok(value) = HeaderValue::from_str(&encode_message(message)) {
            headers.insert("grpc-message", value);
        }
    }
    headers
}

/// The status of a response whose HTTP status is not 200, as the
/// specification maps it.
pub(crate) fn status_from_http(status: http::StatusCode) -> Status {
    let code = match status.as_u16() {
        400 => Code::Internal,
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        404 => Code::Unimplemented,
        429 | 502 | 503 | 504 => Code::Unavailable,
        _ => Code::Unknown,
    };
    Status::new(
        code,
        format!("the server answered HTTP {status}, not a gRPC response"),
    )
}

/// The status of a call that HTTP/2 ended, on either side: a reset maps as
/// gRPC's specification says ([`status_from_reset`]); a broken connection
/// (or, on a client, a GOAWAY that cut the call off: h2 does not say
/// whether the server saw it) is `UNAVAILABLE`.
pub(crate) fn status_from_h2(error: &h2::Error) -> Status {
    match error.reason() {
        Some(reason) if error.is_reset() => status_from_reset(reason),
        _ => Status::unavailable(format!("the HTTP/2 connection failed: {error}")),
    }
}

/// The status of a call whose stream the peer reset with `reason`.
pub(crate) fn status_from_reset(reason: h2::Reason) -> Status {
    let code = match reason {
        h2::Reason::REFUSED_STREAM => Code::Unavailable,
        h2::Reason::CANCEL => Code::Cancelled,
        h2::Reason::ENHANCE_YOUR_CALM => Code::ResourceExhausted,
        h2::Reason::INADEQUATE_SECURITY => Code::PermissionDenied,
        _ => Code::Internal,
    };
    Status::new(code, format!("the peer reset the stream ({reason})"))
}

/// A message with its gRPC prefix (not compressed).
#[cfg_attr(not(any(test, feature = "tonic")), allow(dead_code))]
pub(crate) fn frame_message(message: &[u8], dst: &mut BytesMut) {
    frame_message_flagged(message, false, dst);
}

/// A message with its gRPC prefix, its compressed flag set when `compressed`.
pub(crate) fn frame_message_flagged(message: &[u8], compressed: bool, dst: &mut BytesMut) {
    dst.reserve(MESSAGE_PREFIX + message.len());
    dst.put_u8(u8::from(compressed));
    dst.put_u32(message.len() as u32);
    dst.put_slice(message);
}

/// A message the deframer took from the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Deframed {
    /// Not compressed.
    Plain(Bytes),
    /// Compressed with the stream's encoding: the receiver reserves its
    /// [`declared_len`], then [`decompress`]es it.
    Compressed(Encoding, Bytes),
}

/// Why the bytes of a stream are not a sequence of gRPC messages.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum DeframeError {
    /// A message longer than the receiver's limit.
    #[error("message of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A compressed message on a stream whose `grpc-encoding` is identity.
    #[error("compressed message, but the stream's grpc-encoding is identity")]
    Compressed,
    /// A compressed message that does not decompress as it declares.
    #[error("compressed message does not decompress: {0}")]
    Decompress(String),
    /// A compressed flag other than 0 or 1.
    #[error("message flag {0} is not 0 or 1")]
    BadFlag(u8),
    /// The stream ended inside a message.
    #[error("the stream ended inside a message ({0} bytes of it)")]
    Truncated(usize),
}

/// Splits the DATA of one HTTP/2 stream into gRPC messages. A message
/// that lies within one pushed chunk is a slice of it (never copied); only
/// one that comes in pieces is assembled, in a buffer of its announced
/// length (at most `max` bytes), the only message it holds.
#[derive(Debug)]
pub(crate) struct Deframer {
    /// What is left of the chunks pushed, while no message is assembled.
    head: Bytes,
    /// A message that came in pieces (its prefix first), once `head` ran
    /// out inside it.
    assembling: BytesMut,
    max: usize,
    /// The stream's `grpc-encoding` (`None`: identity).
    encoding: Option<Encoding>,
}

impl Deframer {
    /// A deframer that refuses messages over `max` bytes.
    pub(crate) fn new(max: usize) -> Deframer {
        Deframer {
            head: Bytes::new(),
            assembling: BytesMut::new(),
            max,
            encoding: None,
        }
    }

    /// The same, for a stream whose `grpc-encoding` is `encoding`.
    pub(crate) fn with_encoding(max: usize, encoding: Option<Encoding>) -> Deframer {
        Deframer {
            encoding,
            ..Deframer::new(max)
        }
    }

    /// The next whole message, compressed or not.
    pub(crate) fn next(&mut self) -> Result<Option<Deframed>, DeframeError> {
        let compressed = self.first_byte() == Some(1);
        let Some(message) = self.take(compressed)? else {
            return Ok(None);
        };
        match (compressed, self.encoding) {
            (false, _) => Ok(Some(Deframed::Plain(message))),
            (true, Some(encoding)) => Ok(Some(Deframed::Compressed(encoding, message))),
            (true, None) => Err(DeframeError::Compressed),
        }
    }

    /// The next whole message, decompressed (within `max`) if it must be;
    /// for a receiver that has no budget to reserve it from (a client).
    pub(crate) fn next_decompressed(&mut self) -> Result<Option<Bytes>, DeframeError> {
        match self.next()? {
            None => Ok(None),
            Some(Deframed::Plain(message)) => Ok(Some(message)),
            Some(Deframed::Compressed(encoding, message)) => {
                let expected = declared_len(encoding, &message)?;
                if expected > self.max {
                    return Err(DeframeError::TooLarge {
                        len: expected,
                        max: self.max,
                    });
                }
                decompress(encoding, &message, expected).map(Some)
            }
        }
    }

    /// Adds bytes the peer sent.
    pub(crate) fn push(&mut self, mut data: Bytes) {
        if !self.assembling.is_empty() {
            // Only what the message being assembled still needs is copied;
            // the rest stays a chunk (its messages slices of it).
            if self.assembling.len() < MESSAGE_PREFIX {
                let needed = (MESSAGE_PREFIX - self.assembling.len()).min(data.len());
                self.assembling.extend_from_slice(&data.split_to(needed));
            }
            if let Some((_, len)) = self.prefix() {
                let needed = (MESSAGE_PREFIX + len)
                    .saturating_sub(self.assembling.len())
                    .min(data.len());
                self.assembling.extend_from_slice(&data.split_to(needed));
            }
            if data.is_empty() {
                return;
            }
            // The head is empty while a message is assembled.
            debug_assert!(self.head.is_empty());
            self.head = data;
        } else if self.head.is_empty() {
            self.head = data;
        } else {
            // Two chunks with no message taken between them (a caller that
            // pushes before it takes): the rest of the first goes first.
            let mut joined = BytesMut::with_capacity(self.head.len() + data.len());
            joined.extend_from_slice(&self.head);
            joined.extend_from_slice(&data);
            self.head = joined.freeze();
        }
    }

    /// The next whole message, if one is buffered: only on a stream whose
    /// encoding is identity (a compressed one is an error).
    pub(crate) fn next_message(&mut self) -> Result<Option<Bytes>, DeframeError> {
        if self.first_byte() == Some(1) {
            return Err(DeframeError::Compressed);
        }
        self.take(false)
    }

    fn buffered(&self) -> &[u8] {
        if self.assembling.is_empty() {
            &self.head
        } else {
            &self.assembling
        }
    }

    fn first_byte(&self) -> Option<u8> {
        self.buffered().first().copied()
    }

    /// The flag and length of the message at the front, once its prefix is in.
    fn prefix(&self) -> Option<(u8, usize)> {
        let buffered = self.buffered();
        let prefix = buffered.get(..MESSAGE_PREFIX)?;
        let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
        Some((prefix[0], len))
    }

    fn take(&mut self, compressed_allowed: bool) -> Result<Option<Bytes>, DeframeError> {
        let Some((flag, len)) = self.prefix() else {
            // A prefix cut between chunks: the few bytes go to assembling.
            if !self.head.is_empty() && self.assembling.is_empty() {
                self.assembling.extend_from_slice(&self.head);
                self.head = Bytes::new();
            }
            return Ok(None);
        };
        match flag {
            0 => {}
            1 if compressed_allowed && self.encoding.is_some() => {}
            1 => return Err(DeframeError::Compressed),
            other => return Err(DeframeError::BadFlag(other)),
        }
        if len > self.max {
            return Err(DeframeError::TooLarge { len, max: self.max });
        }
        let whole = MESSAGE_PREFIX + len;
        if self.assembling.is_empty() {
            if self.head.len() >= whole {
                // Within the chunk: a slice of it.
                let message = self.head.slice(MESSAGE_PREFIX..whole);
                self.head.advance(whole);
                return Ok(Some(message));
            }
            // It comes in pieces: assemble it in a buffer of its length.
            self.assembling.reserve(whole);
            self.assembling.extend_from_slice(&self.head);
            self.head = Bytes::new();
            return Ok(None);
        }
        if self.assembling.len() < whole {
            self.assembling.reserve(whole - self.assembling.len());
            return Ok(None);
        }
        self.assembling.advance(MESSAGE_PREFIX);
        let message = self.assembling.split_to(len).freeze();
        debug_assert!(
            self.assembling.is_empty(),
            "push copies no more than the message"
        );
        Ok(Some(message))
    }

    /// The length the message being assembled announced, once its prefix
    /// is in (and it is incomplete): what the receiver is about to hold.
    pub(crate) fn pending_len(&self) -> Option<usize> {
        let (_, len) = self.prefix()?;
        (self.buffered().len() < MESSAGE_PREFIX + len).then_some(len)
    }

    /// The stream ended: `Err` when a message was cut short.
    pub(crate) fn finish(&self) -> Result<(), DeframeError> {
        match self.buffered().len() {
            0 => Ok(()),
            left => Err(DeframeError::Truncated(left)),
        }
    }
}

/// Base64 as the specification lets a sender write it (padded).
#[cfg(test)]
fn padded(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_round_trip_in_the_finest_unit_that_fits() {
        assert_eq!(encode_timeout(Duration::from_millis(1500)), "1500000u");
        assert_eq!(encode_timeout(Duration::from_nanos(5)), "5n");
        assert_eq!(encode_timeout(Duration::from_secs(200)), "200000m");
        assert_eq!(encode_timeout(Duration::from_secs(1_000_000)), "1000000S");
        assert_eq!(encode_timeout(Duration::ZERO), "1n");
        assert_eq!(encode_timeout(Duration::from_secs(u64::MAX)), "99999999H");
        for text in ["1H", "2M", "3S", "4m", "5u", "6n", "12345678S"] {
            let parsed = parse_timeout(&HeaderValue::from_static(text)).unwrap();
            let again = parse_timeout(&HeaderValue::from_str(&encode_timeout(parsed)).unwrap());
            assert_eq!(again, Some(parsed), "{text}");
        }
        for bad in ["", "S", "1", "123456789S", "1x", "-1S", "1.5S", " 1S"] {
            assert_eq!(
                parse_timeout(&HeaderValue::from_str(bad).unwrap()),
                None,
                "{bad:?}"
            );
        }
    }

    #[test]
    fn status_messages_are_percent_encoded_and_decoded_leniently() {
        let text = "bad: 100% \"wrong\" — ünïcode\n";
        let encoded = encode_message(text);
        assert!(encoded.bytes().all(|b| (0x20..0x7f).contains(&b)));
        assert!(encoded.contains("100%25"));
        assert_eq!(decode_message(encoded.as_bytes()), text);
        assert_eq!(decode_message(b"50%"), "50%");
        assert_eq!(decode_message(b"%zz%4"), "%zz%4");
        assert_eq!(decode_message(b"%FF"), "\u{fffd}");
    }

    #[test]
    fn metadata_maps_to_headers_and_back_with_binary_values_in_base64() {
        let mut metadata = Metadata::new();
        metadata.insert("x-user", "ada").unwrap();
        metadata.append("x-multi", "1").unwrap();
        metadata.append("x-multi", "2").unwrap();
        metadata
            .insert_bin("trace-bin", vec![0u8, 1, 2, 255])
            .unwrap();
        let mut headers = HeaderMap::new();
        metadata_into_headers(&metadata, &mut headers);
        assert_eq!(headers.get("trace-bin").unwrap(), "AAEC/w");
        headers.insert("content-type", HeaderValue::from_static(CONTENT_TYPE));
        headers.insert("grpc-timeout", HeaderValue::from_static("1S"));
        headers.insert(
            "x-padded-bin",
            HeaderValue::from_str(&padded(b"ab")).unwrap(),
        );
        headers.insert("x-broken-bin", HeaderValue::from_static("!!!"));
        headers.insert(
            "x-bad-value",
            HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap(),
        );
        let back = metadata_from_headers(&headers);
        assert_eq!(back.get("x-user"), Some("ada"));
        assert_eq!(
            back.get_all("x-multi")
                .filter_map(|v| v.to_str())
                .collect::<Vec<_>>(),
            ["1", "2"]
        );
        assert_eq!(back.get_bin("trace-bin").unwrap().as_ref(), &[0, 1, 2, 255]);
        assert_eq!(back.get_bin("x-padded-bin").unwrap().as_ref(), b"ab");
        for left_out in [
            "content-type",
            "grpc-timeout",
            "x-broken-bin",
            "x-bad-value",
        ] {
            assert!(back.get_value(left_out).is_none(), "{left_out}");
        }
    }

    #[test]
    fn trailers_carry_the_status_and_read_back() {
        let mut metadata = Metadata::new();
        metadata.insert("x-why", "quota").unwrap();
        let headers = trailers(Code::ResourceExhausted, "over 100%", &metadata);
        let status = status_from_trailers(&headers).unwrap();
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(status.message(), "over 100%");
        assert_eq!(status.metadata().get("x-why"), Some("quota"));
        assert!(status_from_trailers(&HeaderMap::new()).is_none());
        let mut odd = HeaderMap::new();
        odd.insert("grpc-status", HeaderValue::from_static("banana"));
        assert_eq!(status_from_trailers(&odd).unwrap().code(), Code::Unknown);
    }

    #[test]
    fn http_statuses_and_resets_map_as_the_specification_says() {
        let code =
            |status: u16| status_from_http(http::StatusCode::from_u16(status).unwrap()).code();
        assert_eq!(code(400), Code::Internal);
        assert_eq!(code(401), Code::Unauthenticated);
        assert_eq!(code(403), Code::PermissionDenied);
        assert_eq!(code(404), Code::Unimplemented);
        for unavailable in [429, 502, 503, 504] {
            assert_eq!(code(unavailable), Code::Unavailable);
        }
        assert_eq!(code(500), Code::Unknown);
        assert_eq!(
            status_from_reset(h2::Reason::CANCEL).code(),
            Code::Cancelled
        );
        assert_eq!(
            status_from_reset(h2::Reason::REFUSED_STREAM).code(),
            Code::Unavailable
        );
        assert_eq!(
            status_from_reset(h2::Reason::ENHANCE_YOUR_CALM).code(),
            Code::ResourceExhausted
        );
        assert_eq!(
            status_from_reset(h2::Reason::PROTOCOL_ERROR).code(),
            Code::Internal
        );
    }

    #[test]
    fn the_deframer_splits_messages_across_and_within_chunks_and_enforces_its_rules() {
        let mut wire = BytesMut::new();
        frame_message(b"hello", &mut wire);
        frame_message(b"", &mut wire);
        frame_message(&[7u8; 300], &mut wire);
        let wire = wire.freeze();
        // Every split point of the same bytes gives the same messages.
        for cut in 0..wire.len() {
            let mut deframer = Deframer::new(1024);
            let mut got = Vec::new();
            for part in [wire.slice(..cut), wire.slice(cut..)] {
                deframer.push(part);
                while let Some(message) = deframer.next_message().unwrap() {
                    got.push(message);
                }
            }
            deframer.finish().unwrap();
            assert_eq!(got.len(), 3, "cut at {cut}");
            assert_eq!(&got[0][..], b"hello");
            assert!(got[1].is_empty());
            assert_eq!(&got[2][..], &[7u8; 300][..]);
        }
        let mut small = Deframer::new(100);
        small.push(wire.slice(5 + 5 + 5..));
        assert_eq!(
            small.next_message(),
            Err(DeframeError::TooLarge { len: 300, max: 100 })
        );
        let mut compressed = Deframer::new(100);
        compressed.push(Bytes::from_static(&[1, 0, 0, 0, 1, 9]));
        assert_eq!(compressed.next_message(), Err(DeframeError::Compressed));
        let mut odd = Deframer::new(100);
        odd.push(Bytes::from_static(&[2, 0, 0, 0, 0]));
        assert_eq!(odd.next_message(), Err(DeframeError::BadFlag(2)));
        let mut cut = Deframer::new(100);
        cut.push(Bytes::from_static(&[0, 0, 0, 0, 4, 1]));
        assert_eq!(cut.next_message(), Ok(None));
        assert_eq!(cut.pending_len(), Some(4));
        assert_eq!(cut.finish(), Err(DeframeError::Truncated(6)));
    }

    #[test]
    fn garbage_never_panics_any_parser() {
        // A small deterministic generator: the same bytes every run.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..20_000 {
            let len = (next() % 24) as usize;
            let bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            let mut deframer = Deframer::new((next() % 64) as usize);
            deframer.push(Bytes::from(bytes.clone()));
            while let Ok(Some(_)) = deframer.next_message() {}
            let _ = deframer.pending_len();
            let _ = deframer.finish();
            let _ = decode_message(&bytes);
            if let Ok(value) = HeaderValue::from_bytes(&bytes) {
                let _ = parse_timeout(&value);
            }
        }
    }

    #[test]
    fn content_types_that_name_grpc() {
        let check =
            |value: &'static str| is_grpc_content_type(Some(&HeaderValue::from_static(value)));
        assert!(check("application/grpc"));
        assert!(check("application/grpc+proto"));
        assert!(check("Application/GRPC;charset=utf-8"));
        assert!(!check("application/json"));
        assert!(!check("application/grpc-web"));
        assert!(!check("APPLICATION/GRPC-WEB+proto"));
        assert!(check("APPLICATION/GRPC+PROTO"));
        assert!(!check("application/grp"));
        assert!(!check(""));
        assert!(!is_grpc_content_type(None));
    }

    #[test]
    fn every_status_code_is_its_number_in_grpc_status() {
        for number in 0..=16 {
            let code = Code::from(number);
            assert_eq!(code as i32, number);
            assert_eq!(status_value(code), HeaderValue::from(number));
        }
    }

    #[test]
    fn gzip_messages_round_trip_and_are_held_to_their_declared_length() {
        let message = b"a message that compresses, a message that compresses".repeat(50);
        let compressed = compress(Encoding::Gzip, &message);
        assert!(compressed.len() < message.len() / 4);
        assert_eq!(declared_len(Encoding::Gzip, &compressed), Ok(message.len()));
        assert_eq!(
            decompress(Encoding::Gzip, &compressed, message.len()).unwrap(),
            &message[..]
        );

        // A bomb that lies about its size: 8 MiB of zeros declaring 100 bytes
        // stops at 101 bytes decompressed and fails.
        let zeros = vec![0u8; 8 << 20];
        let mut bomb = compress(Encoding::Gzip, &zeros).to_vec();
        let tail = bomb.len() - 4;
        bomb[tail..].copy_from_slice(&100u32.to_le_bytes());
        assert_eq!(declared_len(Encoding::Gzip, &bomb), Ok(100));
        let error = decompress(Encoding::Gzip, &bomb, 100).unwrap_err();
        assert!(matches!(error, DeframeError::Decompress(_)), "{error}");
        // One that declares more than it holds fails too.
        let error = decompress(Encoding::Gzip, &compressed, message.len() + 1).unwrap_err();
        assert!(error.to_string().contains("not the"), "{error}");
        // Garbage is no gzip.
        assert!(declared_len(Encoding::Gzip, b"short").is_err());
        assert!(decompress(Encoding::Gzip, &[0u8; 40], 0).is_err());
    }

    #[test]
    fn a_message_within_one_chunk_is_a_slice_of_it_and_one_in_pieces_copies_only_itself() {
        let mut wire = BytesMut::new();
        for message in [&b"first"[..], &[7u8; 3000][..], b"third", b"fourth"] {
            frame_message(message, &mut wire);
        }
        let wire = wire.freeze();
        let within = |message: &Bytes, chunk: &Bytes| {
            let range = chunk.as_ptr_range();
            range.contains(&message.as_ptr()) && message.len() <= chunk.len()
        };
        // The first message and a part of the second in one chunk; the
        // rest of the second, the third and the fourth in another.
        let (one, two) = (wire.slice(..100), wire.slice(100..));
        let mut deframer = Deframer::new(4096);
        deframer.push(one.clone());
        let first = deframer.next_message().unwrap().unwrap();
        assert_eq!(&first[..], b"first");
        assert!(within(&first, &one), "not copied");
        assert_eq!(deframer.next_message().unwrap(), None);
        assert_eq!(deframer.pending_len(), Some(3000));
        deframer.push(two.clone());
        let second = deframer.next_message().unwrap().unwrap();
        assert_eq!(second.len(), 3000);
        assert!(
            !within(&second, &one) && !within(&second, &two),
            "assembled"
        );
        for expected in [&b"third"[..], b"fourth"] {
            let message = deframer.next_message().unwrap().unwrap();
            assert_eq!(&message[..], expected);
            assert!(
                within(&message, &two),
                "after an assembled message, still a slice"
            );
        }
        assert_eq!(deframer.next_message().unwrap(), None);
        deframer.finish().unwrap();
    }

    #[test]
    fn the_deframer_takes_compressed_messages_only_on_a_compressed_stream() {
        let message = Bytes::from(vec![9u8; 1000]);
        let compressed = compress(Encoding::Gzip, &message);
        let mut wire = BytesMut::new();
        frame_message_flagged(&compressed, true, &mut wire);
        frame_message_flagged(b"plain", false, &mut wire);
        let wire = wire.freeze();

        let mut deframer = Deframer::with_encoding(2000, Some(Encoding::Gzip));
        deframer.push(wire.clone());
        assert_eq!(
            deframer.next(),
            Ok(Some(Deframed::Compressed(
                Encoding::Gzip,
                compressed.clone()
            )))
        );
        assert_eq!(
            deframer.next(),
            Ok(Some(Deframed::Plain(Bytes::from_static(b"plain"))))
        );
        assert_eq!(deframer.next(), Ok(None));

        let mut decompressing = Deframer::with_encoding(2000, Some(Encoding::Gzip));
        decompressing.push(wire.clone());
        assert_eq!(decompressing.next_decompressed(), Ok(Some(message.clone())));

        // Within the compressed length, over the limit once inflated.
        let mut small = Deframer::with_encoding(999, Some(Encoding::Gzip));
        small.push(wire.clone());
        assert_eq!(
            small.next_decompressed(),
            Err(DeframeError::TooLarge {
                len: 1000,
                max: 999
            })
        );

        let mut identity = Deframer::new(2000);
        identity.push(wire);
        assert_eq!(identity.next(), Err(DeframeError::Compressed));
    }

    #[test]
    fn encodings_are_negotiated_from_the_headers() {
        let mut headers = HeaderMap::new();
        assert_eq!(message_encoding(&headers, &[]), Ok(None));
        headers.insert("grpc-encoding", HeaderValue::from_static("gzip"));
        assert_eq!(message_encoding(&headers, &[]), Err("gzip".to_owned()));
        assert_eq!(
            message_encoding(&headers, &[Encoding::Gzip]),
            Ok(Some(Encoding::Gzip))
        );
        headers.insert("grpc-encoding", HeaderValue::from_static("snappy"));
        assert_eq!(
            message_encoding(&headers, &[Encoding::Gzip]),
            Err("snappy".to_owned())
        );
        headers.insert(
            "grpc-accept-encoding",
            HeaderValue::from_static("identity, deflate, gzip"),
        );
        assert!(EncodingSet::accepted_by(&headers).contains(Encoding::Gzip));
        headers.insert(
            "grpc-accept-encoding",
            HeaderValue::from_static("identity, deflate"),
        );
        headers.append("grpc-accept-encoding", HeaderValue::from_static("gzip"));
        assert!(
            EncodingSet::accepted_by(&headers).contains(Encoding::Gzip),
            "on a second line too"
        );
        headers.remove("grpc-accept-encoding");
        assert!(!EncodingSet::accepted_by(&headers).contains(Encoding::Gzip));
        assert_eq!(accept_encoding_value(&[Encoding::Gzip]), "gzip,identity");
        assert_eq!(accept_encoding_value(&[]), "identity");
        let mut metadata = Metadata::new();
        assert_eq!(requested_encoding(&metadata), None);
        metadata.insert(ENCODING_REQUEST, "identity").unwrap();
        assert_eq!(requested_encoding(&metadata), Some(None));
        metadata.insert(ENCODING_REQUEST, "gzip").unwrap();
        assert_eq!(requested_encoding(&metadata), Some(Some(Encoding::Gzip)));
        // Never sent as a header.
        let mut out = HeaderMap::new();
        metadata_into_headers(&metadata, &mut out);
        assert!(out.is_empty());
    }
}
