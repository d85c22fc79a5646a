//! [`Metadata`]: the key/value headers that travel with a request, a response or a status.
//!
//! Keys are ASCII (`a-z 0-9 - _ .`; upper case is folded to lower case on
//! insert). As in gRPC, a key that ends in `-bin` carries a binary value and
//! every other key carries a printable ASCII string. Unlike HTTP/2 gRPC, binary
//! values travel as raw bytes (no base64).
//!
//! ```
//! use rpc_core::Metadata;
//! let mut md = Metadata::new();
//! md.insert("x-request-id", "42").unwrap();
//! md.insert_bin("trace-bin", vec![0u8, 1, 2]).unwrap();
//! assert_eq!(md.get("x-request-id"), Some("42"));
//! assert_eq!(md.get_bin("trace-bin").map(|b| &b[..]), Some(&[0u8, 1, 2][..]));
//! ```

use std::fmt;

use bytes::{Buf, BufMut, Bytes};

/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 255;

/// Largest metadata block one frame may carry, in encoded bytes (each entry
/// costs its key, its value and 6 bytes of lengths). A frame over it fails
/// its call alone with `ResourceExhausted`; its entries are never decoded.
pub const MAX_METADATA_LEN: usize = 64 << 10;

/// Most metadata entries one frame may carry; counted before any is decoded.
pub const MAX_METADATA_ENTRIES: usize = 1_024;

/// A metadata block over [`MAX_METADATA_LEN`] or [`MAX_METADATA_ENTRIES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MetadataOverLimit {
    /// The encoded block is longer than [`MAX_METADATA_LEN`].
    #[error("metadata of {len} bytes exceeds the limit of {max} bytes")]
    Bytes {
        /// The block's encoded length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The block has more entries than [`MAX_METADATA_ENTRIES`].
    #[error("metadata with {count} entries exceeds the limit of {max} entries")]
    Entries {
        /// Entries counted (counting stops one past the limit).
        count: usize,
        /// The limit.
        max: usize,
    },
}

/// Why a key or value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidMetadata {
    /// The key is empty, too long, or has a character outside `a-z 0-9 - _ .`.
    #[error("invalid metadata key {0:?}: keys are 1..=255 chars of a-z 0-9 - _ .")]
    Key(String),
    /// An ASCII value holds a byte that is not printable ASCII.
    #[error("invalid value for metadata key {0:?}: values must be printable ASCII")]
    AsciiValue(String),
    /// A binary value was given for a key without the `-bin` suffix, or a string value for one with it.
    #[error(
        "metadata key {0:?}: binary values need a key ending in \"-bin\", string values a key without it"
    )]
    WrongKind(String),
    /// The encoded block is truncated or malformed.
    #[error("malformed metadata block: {0}")]
    Malformed(&'static str),
}

/// A metadata value: a printable ASCII string or, under a `-bin` key, bytes.
#[derive(Clone, PartialEq, Eq)]
pub enum MetadataValue {
    /// A printable ASCII string.
    Ascii(Bytes),
    /// Arbitrary bytes (key ends in `-bin`).
    Binary(Bytes),
}

impl MetadataValue {
    /// The raw bytes of the value.
    pub fn as_bytes(&self) -> &Bytes {
        match self {
            MetadataValue::Ascii(bytes) | MetadataValue::Binary(bytes) => bytes,
        }
    }

    /// The value as a string when it is an ASCII value.
    pub fn to_str(&self) -> Option<&str> {
        match self {
            // Validated as printable ASCII on the way in, so always UTF-8.
            MetadataValue::Ascii(bytes) => std::str::from_utf8(bytes).ok(),
            MetadataValue::Binary(_) => None,
        }
    }
}

impl fmt::Debug for MetadataValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetadataValue::Ascii(_) => write!(f, "{:?}", self.to_str().unwrap_or_default()),
            MetadataValue::Binary(bytes) => write!(f, "{bytes:?}"),
        }
    }
}

/// An ordered multimap of metadata entries.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Metadata {
    entries: Vec<(String, MetadataValue)>,
}

fn normalize_key(key: &str) -> Result<String, InvalidMetadata> {
    let valid = !key.is_empty()
        && key.len() <= MAX_KEY_LEN
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if valid {
        Ok(key.to_ascii_lowercase())
    } else {
        Err(InvalidMetadata::Key(key.to_owned()))
    }
}

fn is_binary_key(key: &str) -> bool {
    key.ends_with("-bin")
}

fn check_ascii_value(key: &str, value: &[u8]) -> Result<(), InvalidMetadata> {
    if value.iter().all(|b| (0x20..0x7f).contains(b)) {
        Ok(())
    } else {
        Err(InvalidMetadata::AsciiValue(key.to_owned()))
    }
}

impl Metadata {
    /// An empty map.
    pub fn new() -> Metadata {
        Metadata::default()
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Sets the string value of `key`, replacing every earlier value of it.
    pub fn insert(&mut self, key: &str, value: &str) -> Result<(), InvalidMetadata> {
        let (key, value) = Self::ascii_entry(key, value)?;
        self.remove(&key);
        self.entries.push((key, value));
        Ok(())
    }

    /// Adds a string value for `key`, keeping earlier ones.
    pub fn append(&mut self, key: &str, value: &str) -> Result<(), InvalidMetadata> {
        let (key, value) = Self::ascii_entry(key, value)?;
        self.entries.push((key, value));
        Ok(())
    }

    /// Sets the binary value of `key` (which must end in `-bin`), replacing earlier values.
    pub fn insert_bin(
        &mut self,
        key: &str,
        value: impl Into<Bytes>,
    ) -> Result<(), InvalidMetadata> {
        let key = normalize_key(key)?;
        if !is_binary_key(&key) {
            return Err(InvalidMetadata::WrongKind(key));
        }
        self.remove(&key);
        self.entries
            .push((key, MetadataValue::Binary(value.into())));
        Ok(())
    }

    /// Adds a binary value for `key` (which must end in `-bin`), keeping earlier values.
    pub fn append_bin(
        &mut self,
        key: &str,
        value: impl Into<Bytes>,
    ) -> Result<(), InvalidMetadata> {
        let key = normalize_key(key)?;
        if !is_binary_key(&key) {
            return Err(InvalidMetadata::WrongKind(key));
        }
        self.entries
            .push((key, MetadataValue::Binary(value.into())));
        Ok(())
    }

    fn ascii_entry(key: &str, value: &str) -> Result<(String, MetadataValue), InvalidMetadata> {
        let key = normalize_key(key)?;
        if is_binary_key(&key) {
            return Err(InvalidMetadata::WrongKind(key));
        }
        check_ascii_value(&key, value.as_bytes())?;
        Ok((
            key,
            MetadataValue::Ascii(Bytes::copy_from_slice(value.as_bytes())),
        ))
    }

    /// The first string value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.get_value(key).and_then(MetadataValue::to_str)
    }

    /// The first binary value of `key`.
    pub fn get_bin(&self, key: &str) -> Option<&Bytes> {
        match self.get_value(key)? {
            MetadataValue::Binary(bytes) => Some(bytes),
            MetadataValue::Ascii(_) => None,
        }
    }

    /// The first value of `key`, of either kind.
    pub fn get_value(&self, key: &str) -> Option<&MetadataValue> {
        self.entries
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| v)
    }

    /// Every value of `key`, in insertion order.
    pub fn get_all<'a>(&'a self, key: &'a str) -> impl Iterator<Item = &'a MetadataValue> + 'a {
        self.entries
            .iter()
            .filter(move |(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| v)
    }

    /// Removes every value of `key`; returns how many were removed.
    pub fn remove(&mut self, key: &str) -> usize {
        let before = self.entries.len();
        self.entries.retain(|(k, _)| !k.eq_ignore_ascii_case(key));
        before - self.entries.len()
    }

    /// All entries in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &MetadataValue)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Adds every entry of `other` after the entries of `self`.
    pub fn extend(&mut self, other: Metadata) {
        self.entries.extend(other.entries);
    }

    /// Bytes [`Metadata::encode`] will write.
    pub fn encoded_len(&self) -> usize {
        self.entries
            .iter()
            .map(|(k, v)| 2 + 4 + k.len() + v.as_bytes().len())
            .sum()
    }

    /// Writes the wire form: per entry `key_len: u16 LE, value_len: u32 LE, key, value`.
    pub fn encode(&self, dst: &mut impl BufMut) {
        for (key, value) in &self.entries {
            let value = value.as_bytes();
            dst.put_u16_le(key.len() as u16);
            dst.put_u32_le(value.len() as u32);
            dst.put_slice(key.as_bytes());
            dst.put_slice(value);
        }
    }

    /// Whether this metadata fits in one frame: at most [`MAX_METADATA_LEN`]
    /// encoded bytes and [`MAX_METADATA_ENTRIES`] entries (what a receiver
    /// takes).
    pub fn check_limits(&self) -> Result<(), MetadataOverLimit> {
        if self.entries.len() > MAX_METADATA_ENTRIES {
            return Err(MetadataOverLimit::Entries {
                count: self.entries.len(),
                max: MAX_METADATA_ENTRIES,
            });
        }
        let len = self.encoded_len();
        if len > MAX_METADATA_LEN {
            return Err(MetadataOverLimit::Bytes {
                len,
                max: MAX_METADATA_LEN,
            });
        }
        Ok(())
    }

    /// Checks an encoded block against the limits before anything of it is
    /// decoded: its length, then its entries, counted by walking their
    /// lengths (allocating nothing). A block that does not parse is left to
    /// [`Metadata::decode`] to refuse.
    pub fn check_encoded_limits(block: &[u8]) -> Result<(), MetadataOverLimit> {
        if block.len() > MAX_METADATA_LEN {
            return Err(MetadataOverLimit::Bytes {
                len: block.len(),
                max: MAX_METADATA_LEN,
            });
        }
        let mut rest = block;
        let mut count = 0;
        while rest.len() >= 6 {
            count += 1;
            if count > MAX_METADATA_ENTRIES {
                return Err(MetadataOverLimit::Entries {
                    count,
                    max: MAX_METADATA_ENTRIES,
                });
            }
            let key_len = usize::from(u16::from_le_bytes([rest[0], rest[1]]));
            let value_len = u32::from_le_bytes([rest[2], rest[3], rest[4], rest[5]]) as usize;
            let entry = 6usize.saturating_add(key_len).saturating_add(value_len);
            if entry > rest.len() {
                break;
            }
            rest = &rest[entry..];
        }
        Ok(())
    }

    /// Parses the wire form, validating every key and ASCII value. Values are
    /// slices of `src` (no copy). Call [`Metadata::check_encoded_limits`]
    /// first on a block from a peer.
    pub fn decode(mut src: Bytes) -> Result<Metadata, InvalidMetadata> {
        let mut entries = Vec::new();
        while src.has_remaining() {
            if src.remaining() < 6 {
                return Err(InvalidMetadata::Malformed("truncated entry header"));
            }
            let key_len = usize::from(src.get_u16_le());
            let value_len = src.get_u32_le() as usize;
            if src.remaining() < key_len || src.remaining() - key_len < value_len {
                return Err(InvalidMetadata::Malformed("entry longer than the block"));
            }
            let key_bytes = src.split_to(key_len);
            let key = std::str::from_utf8(&key_bytes)
                .map_err(|_| InvalidMetadata::Malformed("key is not ASCII"))?;
            let key = normalize_key(key)?;
            if key.as_bytes() != &key_bytes[..] {
                return Err(InvalidMetadata::Key(key));
            }
            let value = src.split_to(value_len);
            let value = if is_binary_key(&key) {
                MetadataValue::Binary(value)
            } else {
                check_ascii_value(&key, &value)?;
                MetadataValue::Ascii(value)
            };
            entries.push((key, value));
        }
        Ok(Metadata { entries })
    }
}

impl fmt::Debug for Metadata {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

/// Parses gRPC's `grpc-timeout` value: 1 to 8 digits and a unit
/// (`H M S m u n`), as HTTP/2 gRPC peers and tonic's requests carry it;
/// `None` for anything else.
pub fn parse_grpc_timeout(text: &str) -> Option<std::time::Duration> {
    use std::time::Duration;
    if text.len() < 2 || text.len() > 9 {
        return None;
    }
    let (digits, unit) = text.split_at(text.len() - 1);
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let value: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(value * 3600),
        "M" => Duration::from_secs(value * 60),
        "S" => Duration::from_secs(value),
        "m" => Duration::from_millis(value),
        "u" => Duration::from_micros(value),
        "n" => Duration::from_nanos(value),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;

    fn block(entries: usize, value_len: usize) -> Vec<u8> {
        let mut md = Metadata::new();
        for i in 0..entries {
            md.insert(&format!("k{i}"), &"v".repeat(value_len)).unwrap();
        }
        let mut out = BytesMut::new();
        md.encode(&mut out);
        out.to_vec()
    }

    #[test]
    fn limits_are_checked_on_the_encoded_block_before_decoding() {
        assert_eq!(
            Metadata::check_encoded_limits(&block(MAX_METADATA_ENTRIES, 1)),
            Ok(())
        );
        assert_eq!(
            Metadata::check_encoded_limits(&block(MAX_METADATA_ENTRIES + 5, 1)),
            Err(MetadataOverLimit::Entries {
                count: MAX_METADATA_ENTRIES + 1,
                max: MAX_METADATA_ENTRIES
            }),
            "counting stops one past the limit"
        );
        let long = block(1, MAX_METADATA_LEN);
        assert_eq!(
            Metadata::check_encoded_limits(&long),
            Err(MetadataOverLimit::Bytes {
                len: long.len(),
                max: MAX_METADATA_LEN
            })
        );
        // A block that does not parse is decode's to refuse, not a limit.
        assert_eq!(
            Metadata::check_encoded_limits(&[1, 0, 9, 9, 9, 9, b'k']),
            Ok(())
        );
        // The sender's check agrees with the receiver's.
        let mut md = Metadata::new();
        for i in 0..=MAX_METADATA_ENTRIES {
            md.insert(&format!("k{i}"), "v").unwrap();
        }
        assert!(matches!(
            md.check_limits(),
            Err(MetadataOverLimit::Entries { .. })
        ));
        let mut md = Metadata::new();
        md.insert("k", &"v".repeat(MAX_METADATA_LEN)).unwrap();
        assert!(matches!(
            md.check_limits(),
            Err(MetadataOverLimit::Bytes { .. })
        ));
    }

    #[test]
    fn keys_are_validated_and_folded_to_lower_case() {
        let mut md = Metadata::new();
        md.insert("X-Trace", "a").unwrap();
        assert_eq!(md.get("x-trace"), Some("a"));
        assert!(matches!(md.insert("", "a"), Err(InvalidMetadata::Key(_))));
        assert!(matches!(
            md.insert("bad key", "a"),
            Err(InvalidMetadata::Key(_))
        ));
        assert!(matches!(
            md.insert("k", "caf\u{e9}"),
            Err(InvalidMetadata::AsciiValue(_))
        ));
        assert!(matches!(
            md.insert("k-bin", "a"),
            Err(InvalidMetadata::WrongKind(_))
        ));
        assert!(matches!(
            md.insert_bin("k", vec![1]),
            Err(InvalidMetadata::WrongKind(_))
        ));
    }

    #[test]
    fn insert_replaces_and_append_keeps() {
        let mut md = Metadata::new();
        md.append("k", "1").unwrap();
        md.append("k", "2").unwrap();
        assert_eq!(md.get_all("k").count(), 2);
        md.insert("k", "3").unwrap();
        assert_eq!(md.get_all("k").count(), 1);
        assert_eq!(md.get("k"), Some("3"));
        assert_eq!(md.remove("k"), 1);
        assert!(md.is_empty());
        md.append_bin("b-bin", vec![1u8]).unwrap();
        md.append_bin("b-bin", vec![2u8]).unwrap();
        assert_eq!(md.get_all("b-bin").count(), 2);
        assert!(md.append_bin("b", vec![1u8]).is_err());
    }

    #[test]
    fn wire_round_trip_keeps_order_and_kinds() {
        let mut md = Metadata::new();
        md.insert("a", "x").unwrap();
        md.insert_bin("b-bin", vec![0u8, 255, 10]).unwrap();
        md.append("a", "y").unwrap();
        let mut buf = BytesMut::new();
        md.encode(&mut buf);
        assert_eq!(buf.len(), md.encoded_len());
        let back = Metadata::decode(buf.freeze()).unwrap();
        assert_eq!(back, md);
    }

    #[test]
    fn decode_rejects_truncation_bad_keys_and_bad_values() {
        let mut md = Metadata::new();
        md.insert("key", "value").unwrap();
        let mut buf = BytesMut::new();
        md.encode(&mut buf);
        let full = buf.freeze();
        for cut in 1..full.len() {
            assert!(Metadata::decode(full.slice(..cut)).is_err(), "cut at {cut}");
        }
        let mut upper = BytesMut::new();
        upper.put_u16_le(3);
        upper.put_u32_le(0);
        upper.put_slice(b"KEY");
        assert!(Metadata::decode(upper.freeze()).is_err());
        let mut ctrl = BytesMut::new();
        ctrl.put_u16_le(1);
        ctrl.put_u32_le(1);
        ctrl.put_slice(b"k\n");
        assert!(matches!(
            Metadata::decode(ctrl.freeze()),
            Err(InvalidMetadata::AsciiValue(_))
        ));
    }
}
