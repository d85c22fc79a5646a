//! The wire format: one [`Frame`] per transport message.
//!
//! A frame is a fixed 40-byte little-endian header, then the method path,
//! then the metadata block, then the payload. Transports carry frames as whole
//! messages (TCP adds a 4-byte length prefix; RDMA sends one frame per
//! message), so a frame's length is known before it is decoded and a decoder
//! never waits for more bytes. `docs/wire-format.md` is the normative
//! description; the constants here are the source of truth for the numbers.
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | version ([`PROTOCOL_VERSION`]) |
//! | 1 | 1 | kind ([`FrameKind`]) |
//! | 2 | 2 | flags ([`FrameFlags`]) |
//! | 4 | 4 | status code (responses; 0 otherwise) |
//! | 8 | 8 | call id |
//! | 16 | 8 | deadline: remaining microseconds, 0 = none |
//! | 24 | 2 | path length |
//! | 26 | 2 | reserved, 0 |
//! | 28 | 4 | metadata length |
//! | 32 | 4 | payload length |
//! | 36 | 4 | reserved, 0 |

use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::metadata::{InvalidMetadata, Metadata, MetadataOverLimit};
use crate::payload::Payload;
use crate::status::Code;

/// The protocol version this build writes and the only one it accepts.
pub const PROTOCOL_VERSION: u8 = 1;
/// Size of the fixed header.
pub const HEADER_LEN: usize = 40;

/// How the hello of rdma://'s set-up exchange begins (after its length
/// prefix, which tcp:// framing reads as a frame length): a frame that starts
/// so is a mix-up of schemes, named as such ([`FrameError::RdmaPeer`]).
pub const RDMA_HELLO_MAGIC: &[u8; 4] = b"RRPC";
/// How an HTTP/2 client (a gRPC client) begins a connection: at an
/// rdma-rpc tcp:// or rdma:// port it is a mix-up, named as such
/// ([`FrameError::Http2Peer`]).
pub const HTTP2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Default limit on a whole frame (header + path + metadata + payload): 64 MiB.
pub const DEFAULT_MAX_FRAME_LEN: usize = 64 << 20;
/// Longest method path.
pub const MAX_PATH_LEN: usize = u16::MAX as usize;

const _: () = assert!(
    HEADER_LEN % 8 == 0,
    "header keeps 8-byte alignment of what follows"
);
const _: () = assert!(DEFAULT_MAX_FRAME_LEN <= u32::MAX as usize);

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// Client → server: start a call (path, metadata, deadline, request message).
    Request = 1,
    /// Server → client: a call's result (status, metadata, response message).
    Response = 2,
    /// Client → server: abandon a call; the server aborts its handler.
    Cancel = 3,
    /// Either way: liveness probe; answered by a ping with [`FrameFlags::ACK`].
    Ping = 4,
    /// Either way: the sender takes no new calls on this connection.
    GoAway = 5,
    /// Either way: one message of a streaming call. With
    /// [`FrameFlags::END_STREAM`], the sender's last message.
    Message = 6,
    /// Server → client: a streaming call's response metadata, before its
    /// first message. Client → server, with [`FrameFlags::END_STREAM`] and
    /// nothing else: the client sends no more messages (half-close).
    Headers = 7,
    /// Either way: the receiver of a stream lets the sender send this many
    /// more messages (a `u32` in the payload).
    Window = 8,
}

impl FrameKind {
    pub(crate) fn from_u8(value: u8) -> Option<FrameKind> {
        Some(match value {
            1 => FrameKind::Request,
            2 => FrameKind::Response,
            3 => FrameKind::Cancel,
            4 => FrameKind::Ping,
            5 => FrameKind::GoAway,
            6 => FrameKind::Message,
            7 => FrameKind::Headers,
            8 => FrameKind::Window,
            _ => return None,
        })
    }
}

/// Frame flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct FrameFlags(u16);

impl FrameFlags {
    /// No flags.
    pub const EMPTY: FrameFlags = FrameFlags(0);
    /// Last frame of its direction of the call. Unary requests and responses always set it.
    pub const END_STREAM: FrameFlags = FrameFlags(0x1);
    /// A ping that answers a ping.
    pub const ACK: FrameFlags = FrameFlags(0x2);
    /// A request that opens a streaming call: its messages follow as
    /// [`FrameKind::Message`] frames, and so do the server's. With
    /// [`END_STREAM`](Self::END_STREAM) as well, the request is the client's
    /// whole stream: its payload holds all of the client's messages (in a
    /// message frame's encoding; none when empty), and no message frame follows.
    pub const STREAMING: FrameFlags = FrameFlags(0x4);
    /// With [`STREAMING`](Self::STREAMING), on a request: the sender does
    /// not know whether the method is unary or streaming (a gateway from
    /// gRPC, whose wire does not say). A unary method takes one message
    /// and answers with one final response that carries its message
    /// (docs/wire-format.md, "Kind unknown").
    pub const KIND_UNKNOWN: FrameFlags = FrameFlags(0x8);
    const KNOWN: u16 = 0xf;

    /// The raw bits.
    pub fn bits(self) -> u16 {
        self.0
    }

    /// True when every flag of `other` is set.
    pub fn contains(self, other: FrameFlags) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for FrameFlags {
    type Output = FrameFlags;
    fn bitor(self, rhs: FrameFlags) -> FrameFlags {
        FrameFlags(self.0 | rhs.0)
    }
}

/// Why bytes were not a valid frame. The connection that sent them is closed,
/// except where a variant says its call fails alone.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The message is larger than the configured maximum.
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Length announced or received.
        len: usize,
        /// The configured limit.
        max: usize,
    },
    /// The version byte is not [`PROTOCOL_VERSION`].
    #[error("unsupported protocol version {0} (this build speaks version {PROTOCOL_VERSION})")]
    BadVersion(u8),
    /// The bytes are the hello of rdma://'s set-up exchange: an rdma://
    /// peer was reached at a tcp:// endpoint.
    #[error(
        "the peer speaks rdma://'s set-up exchange, not tcp:// frames: it is an rdma:// endpoint, use rdma:// for it"
    )]
    RdmaPeer,
    /// The bytes are HTTP/2's connection preface: a gRPC (HTTP/2) client
    /// reached a tcp:// endpoint.
    #[error(
        "the peer speaks HTTP/2 (a gRPC client?), not tcp:// frames: this is an rdma-rpc tcp:// port, not gRPC: listen on grpc:// for gRPC clients"
    )]
    Http2Peer,
    /// The kind byte names no [`FrameKind`].
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// A flag bit this version does not define is set.
    #[error("unknown frame flags {0:#06x}")]
    UnknownFlags(u16),
    /// A reserved field is not zero.
    #[error("reserved header field is not zero")]
    ReservedNotZero,
    /// The message is shorter than its header says.
    #[error("truncated frame: header announces {expected} bytes, message has {actual}")]
    Truncated {
        /// Bytes the header announces.
        expected: usize,
        /// Bytes present.
        actual: usize,
    },
    /// The message is longer than its header says.
    #[error("frame has {actual} bytes but its header announces {expected}")]
    TrailingBytes {
        /// Bytes the header announces.
        expected: usize,
        /// Bytes present.
        actual: usize,
    },
    /// The method path is missing, not UTF-8, or present where none belongs.
    #[error("invalid method path: {0}")]
    InvalidPath(&'static str),
    /// The metadata block is malformed.
    #[error(transparent)]
    Metadata(#[from] InvalidMetadata),
    /// A well-formed frame whose metadata is over the limits: refused
    /// before any entry is decoded, and for its call alone (the receiver
    /// fails that call with `ResourceExhausted`; the connection goes on).
    #[error("{kind:?} frame of call {call_id}: {excess}")]
    MetadataOverLimit {
        /// The frame's kind.
        kind: FrameKind,
        /// The frame's call.
        call_id: u64,
        /// Which limit, by how much.
        excess: MetadataOverLimit,
    },
    /// A section or flag this kind of frame never carries is present, or a
    /// field has a value its kind forbids.
    #[error("malformed {kind:?} frame: {reason}")]
    Malformed {
        /// The frame's kind.
        kind: FrameKind,
        /// What is wrong.
        reason: &'static str,
    },
}

/// A frame carried whole but refused for its call alone: the call fails with
/// `ResourceExhausted`, the connection goes on.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Excess {
    /// Over the receiver's frame limit.
    Frame {
        /// The frame's length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Its metadata is over [`crate::metadata::MAX_METADATA_LEN`] or
    /// [`crate::metadata::MAX_METADATA_ENTRIES`].
    Metadata(MetadataOverLimit),
}

impl Excess {
    /// Why a transport skipped a frame ([`TransportError::Refused`]): its
    /// head's metadata over the limit, else its length over `max`.
    ///
    /// [`TransportError::Refused`]: crate::transport::TransportError::Refused
    pub(crate) fn of_refused(head: &[u8], len: usize, max: usize) -> Excess {
        match Frame::peek_metadata_excess(head) {
            Some(excess) => Excess::Metadata(excess),
            None => Excess::Frame { len, max },
        }
    }

    /// What was refused, in words: "`what` of N bytes exceeds `whose` limit
    /// of M bytes" or "`what` metadata of ... exceeds the limit of ...".
    pub(crate) fn describe(&self, what: &str, whose: &str) -> String {
        match self {
            Excess::Frame { len, max } => {
                format!("{what} of {len} bytes exceeds {whose} limit of {max} bytes")
            }
            Excess::Metadata(excess) => format!("{what} {excess}"),
        }
    }
}

/// Payloads shorter than this are copied behind the head by
/// [`Frame::encode_parts`]; longer ones travel as a part of their own.
pub const JOIN_PAYLOAD_BELOW: usize = 4 << 10;

/// An encoded frame as two parts: the head (header, path, metadata) and the
/// payload. On the wire, and to the receiver, the frame is `head` followed by
/// `payload`; keeping them apart means a large payload (a message the codec
/// encoded, or a `Bytes` the application handed over) is never copied just to
/// put a header in front of it. Transports write the parts with vectored
/// writes (tcp://) or let the peer READ the payload where it lies (rdma://).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EncodedFrame {
    /// The first bytes of the frame.
    pub head: Bytes,
    /// The bytes after `head`, in one or more parts.
    pub payload: Payload,
}

impl EncodedFrame {
    /// Bytes of the whole frame.
    pub fn len(&self) -> usize {
        self.head.len() + self.payload.len()
    }

    /// True for a frame of no bytes (never one [`Frame`] encodes).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The frame in one buffer: free when one part is empty, else a copy.
    pub fn into_contiguous(self) -> Bytes {
        if self.payload.is_empty() {
            return self.head;
        }
        if self.head.is_empty() {
            return self.payload.into_contiguous();
        }
        // A large frame is joined in a recycled buffer (no fresh mapping).
        let mut joined = crate::codec::recycle::take(self.len());
        joined.put_slice(&self.head);
        for part in self.payload.parts() {
            joined.put_slice(part);
        }
        crate::codec::recycle::into_bytes(joined)
    }
}

impl From<Bytes> for EncodedFrame {
    /// A frame already in one buffer.
    fn from(frame: Bytes) -> EncodedFrame {
        EncodedFrame {
            head: frame,
            payload: Payload::new(),
        }
    }
}

/// A decoded frame. `path` is empty for every kind but [`FrameKind::Request`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// What the frame is.
    pub kind: FrameKind,
    /// Flags.
    pub flags: FrameFlags,
    /// The call it belongs to (0 for connection-level frames).
    pub call_id: u64,
    /// Status code of a response ([`Code::Ok`] otherwise).
    pub status: Code,
    /// Time the caller still allows, for requests.
    pub deadline: Option<Duration>,
    /// `/package.Service/Method` of a request.
    pub path: String,
    /// Metadata of the request, response or status.
    pub metadata: Metadata,
    /// The encoded message; for a non-OK response, the status message in
    /// UTF-8. One part in a decoded frame.
    pub payload: Payload,
}

impl Frame {
    /// A unary request frame.
    pub fn request(
        call_id: u64,
        path: impl Into<String>,
        deadline: Option<Duration>,
        metadata: Metadata,
        payload: impl Into<Payload>,
    ) -> Frame {
        Frame {
            kind: FrameKind::Request,
            flags: FrameFlags::END_STREAM,
            call_id,
            status: Code::Ok,
            deadline,
            path: path.into(),
            metadata,
            payload: payload.into(),
        }
    }

    /// A unary response frame: `status` OK with a message in `payload`, or an
    /// error whose message is the payload.
    pub fn response(
        call_id: u64,
        status: Code,
        metadata: Metadata,
        payload: impl Into<Payload>,
    ) -> Frame {
        Frame {
            kind: FrameKind::Response,
            flags: FrameFlags::END_STREAM,
            call_id,
            status,
            deadline: None,
            path: String::new(),
            metadata,
            payload: payload.into(),
        }
    }

    /// The request that opens a streaming call: no message (those follow as
    /// [`FrameKind::Message`] frames).
    pub fn stream_request(
        call_id: u64,
        path: impl Into<String>,
        deadline: Option<Duration>,
        metadata: Metadata,
    ) -> Frame {
        Frame {
            kind: FrameKind::Request,
            flags: FrameFlags::STREAMING,
            call_id,
            status: Code::Ok,
            deadline,
            path: path.into(),
            metadata,
            payload: Payload::new(),
        }
    }

    /// The request of a streaming call whose client sends its whole stream
    /// at once: `messages` (in a message frame's encoding, see
    /// [`Frame::message`]; empty for none) and its half-close, in one frame.
    pub fn whole_stream_request(
        call_id: u64,
        path: impl Into<String>,
        deadline: Option<Duration>,
        metadata: Metadata,
        messages: impl Into<Payload>,
    ) -> Frame {
        let mut frame = Frame::stream_request(call_id, path, deadline, metadata);
        frame.flags = FrameFlags::STREAMING | FrameFlags::END_STREAM;
        frame.payload = messages.into();
        frame
    }

    /// A message frame that carries one message of a streaming call; `last`
    /// sets [`FrameFlags::END_STREAM`].
    pub fn message(call_id: u64, message: impl Into<Payload>, last: bool) -> Frame {
        Frame::messages(call_id, crate::stream::single_message(message.into()), last)
    }

    /// A message frame whose payload is one or more messages, each a `u32`
    /// length and that many bytes (see docs/wire-format.md).
    pub(crate) fn messages(call_id: u64, payload: Payload, last: bool) -> Frame {
        let flags = if last {
            FrameFlags::END_STREAM
        } else {
            FrameFlags::EMPTY
        };
        let mut frame = Frame::control(FrameKind::Message, flags, call_id);
        frame.payload = payload;
        frame
    }

    /// A streaming call's response metadata (server → client).
    pub fn headers(call_id: u64, metadata: Metadata) -> Frame {
        let mut frame = Frame::control(FrameKind::Headers, FrameFlags::EMPTY, call_id);
        frame.metadata = metadata;
        frame
    }

    /// The client's half-close of a streaming call: it sends no more messages.
    pub fn half_close(call_id: u64) -> Frame {
        Frame::control(FrameKind::Headers, FrameFlags::END_STREAM, call_id)
    }

    /// Lets the peer send `grant` (at least 1) more messages on a stream.
    pub fn window(call_id: u64, grant: u32) -> Frame {
        let mut frame = Frame::control(FrameKind::Window, FrameFlags::EMPTY, call_id);
        frame.payload = Payload::from(Bytes::copy_from_slice(&grant.to_le_bytes()));
        frame
    }

    /// The grant of a [`FrameKind::Window`] frame (decoded frames always have one).
    pub fn window_grant(&self) -> Option<u32> {
        if self.kind != FrameKind::Window {
            return None;
        }
        let bytes: [u8; 4] = self.payload.clone().into_contiguous()[..].try_into().ok()?;
        Some(u32::from_le_bytes(bytes))
    }

    /// True for the request of a streaming call.
    pub fn is_streaming(&self) -> bool {
        self.flags.contains(FrameFlags::STREAMING)
    }

    /// True for a streaming request whose sender does not know the
    /// method's kind ([`FrameFlags::KIND_UNKNOWN`]).
    pub fn is_kind_unknown(&self) -> bool {
        self.flags
            .contains(FrameFlags::STREAMING | FrameFlags::KIND_UNKNOWN)
    }

    /// A frame with no path, metadata or payload.
    pub fn control(kind: FrameKind, flags: FrameFlags, call_id: u64) -> Frame {
        Frame {
            kind,
            flags,
            call_id,
            status: Code::Ok,
            deadline: None,
            path: String::new(),
            metadata: Metadata::new(),
            payload: Payload::new(),
        }
    }

    /// Bytes [`Frame::encode`] produces.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + self.path.len() + self.metadata.encoded_len() + self.payload.len()
    }

    /// Encodes the frame as its head and its payload, without copying a
    /// payload of [`JOIN_PAYLOAD_BELOW`] bytes or more (a smaller one is copied
    /// behind the head: one buffer is cheaper for the transports then).
    ///
    /// # Panics
    /// As [`Frame::encode`].
    pub fn encode_parts(&self) -> EncodedFrame {
        if self.payload.len() < JOIN_PAYLOAD_BELOW {
            return EncodedFrame::from(self.encode());
        }
        let head_len = self.encoded_len() - self.payload.len();
        let mut head = BytesMut::with_capacity(head_len);
        self.encode_head_into(&mut head);
        EncodedFrame {
            head: head.freeze(),
            payload: self.payload.clone(),
        }
    }

    /// Encodes the frame into one contiguous buffer.
    ///
    /// # Panics
    /// When the path is longer than [`MAX_PATH_LEN`] or a section exceeds 4 GiB;
    /// callers check the path and the frame limit first.
    pub fn encode(&self) -> Bytes {
        let mut dst = BytesMut::with_capacity(self.encoded_len());
        self.encode_into(&mut dst);
        dst.freeze()
    }

    /// Appends the encoded frame to `dst`.
    pub fn encode_into(&self, dst: &mut BytesMut) {
        dst.reserve(self.encoded_len());
        self.encode_head_into(dst);
        for part in self.payload.parts() {
            dst.put_slice(part);
        }
    }

    /// Appends everything before the payload to `dst`.
    fn encode_head_into(&self, dst: &mut BytesMut) {
        let path_len = u16::try_from(self.path.len()).expect("method path longer than 64 KiB");
        let metadata_len = u32::try_from(self.metadata.encoded_len()).expect("metadata over 4 GiB");
        let payload_len = u32::try_from(self.payload.len()).expect("payload over 4 GiB");
        let deadline_us = self
            .deadline
            .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1))
            .unwrap_or(0);
        dst.put_u8(PROTOCOL_VERSION);
        dst.put_u8(self.kind as u8);
        dst.put_u16_le(self.flags.0);
        dst.put_u32_le(self.status as i32 as u32);
        dst.put_u64_le(self.call_id);
        dst.put_u64_le(deadline_us);
        dst.put_u16_le(path_len);
        dst.put_u16_le(0);
        dst.put_u32_le(metadata_len);
        dst.put_u32_le(payload_len);
        dst.put_u32_le(0);
        dst.put_slice(self.path.as_bytes());
        self.metadata.encode(dst);
    }

    /// The kind and call id in the first bytes of a frame (its header), for
    /// a frame that is not decoded whole (one over the limit, skipped by the
    /// transport); `None` unless the version and kind are valid.
    pub fn peek_header(head: &[u8]) -> Option<(FrameKind, u64)> {
        if head.len() < 16 || head[0] != PROTOCOL_VERSION {
            return None;
        }
        let kind = FrameKind::from_u8(head[1])?;
        let call_id = u64::from_le_bytes(head[8..16].try_into().expect("8 bytes"));
        Some((kind, call_id))
    }

    /// The metadata limit a frame's header already breaks
    /// ([`crate::metadata::MAX_METADATA_LEN`]), from its first
    /// [`HEADER_LEN`] bytes: a transport skips such a frame instead of
    /// holding it whole, since it can only be refused. `None` when it keeps
    /// the limit, or `head` is shorter than a header or starts no frame.
    pub fn peek_metadata_excess(head: &[u8]) -> Option<MetadataOverLimit> {
        // Only what starts as a frame (version, kind) of a kind that carries
        // metadata: metadata on any other is a protocol error, which the
        // decoder reports as before.
        let (kind, _) = Frame::peek_header(head)?;
        if !matches!(
            kind,
            FrameKind::Request | FrameKind::Response | FrameKind::Headers
        ) {
            return None;
        }
        let len = u32::from_le_bytes(head.get(28..32)?.try_into().ok()?) as usize;
        (len > crate::metadata::MAX_METADATA_LEN).then_some(MetadataOverLimit::Bytes {
            len,
            max: crate::metadata::MAX_METADATA_LEN,
        })
    }

    /// Decodes one whole message. The payload is a slice of `message` (no copy).
    ///
    /// Rejects, with a typed error, a message over `max_len`, a wrong version,
    /// an unknown kind or flag, non-zero reserved fields, a length that does not
    /// match the header, an invalid path, malformed metadata, and metadata
    /// over [`crate::metadata::MAX_METADATA_LEN`] bytes or
    /// [`crate::metadata::MAX_METADATA_ENTRIES`] entries (checked before any
    /// entry is decoded: [`FrameError::MetadataOverLimit`]).
    pub fn decode(mut message: Bytes, max_len: usize) -> Result<Frame, FrameError> {
        let actual = message.len();
        if actual > max_len {
            return Err(FrameError::TooLarge {
                len: actual,
                max: max_len,
            });
        }
        if actual < HEADER_LEN {
            return Err(FrameError::Truncated {
                expected: HEADER_LEN,
                actual,
            });
        }
        if message.starts_with(RDMA_HELLO_MAGIC) {
            return Err(FrameError::RdmaPeer);
        }
        let version = message.get_u8();
        if version != PROTOCOL_VERSION {
            return Err(FrameError::BadVersion(version));
        }
        let kind_byte = message.get_u8();
        let kind = FrameKind::from_u8(kind_byte).ok_or(FrameError::UnknownKind(kind_byte))?;
        let flags = message.get_u16_le();
        if flags & !FrameFlags::KNOWN != 0 {
            return Err(FrameError::UnknownFlags(flags));
        }
        let status = Code::from(message.get_u32_le() as i32);
        let call_id = message.get_u64_le();
        let deadline_us = message.get_u64_le();
        let path_len = usize::from(message.get_u16_le());
        let reserved_a = message.get_u16_le();
        let metadata_len = message.get_u32_le() as usize;
        let payload_len = message.get_u32_le() as usize;
        let reserved_b = message.get_u32_le();
        if reserved_a != 0 || reserved_b != 0 {
            return Err(FrameError::ReservedNotZero);
        }
        let expected = HEADER_LEN + path_len + metadata_len + payload_len;
        if expected > max_len {
            return Err(FrameError::TooLarge {
                len: expected,
                max: max_len,
            });
        }
        if actual < expected {
            return Err(FrameError::Truncated { expected, actual });
        }
        if actual > expected {
            return Err(FrameError::TrailingBytes { expected, actual });
        }
        let path_bytes = message.split_to(path_len);
        let path = match kind {
            FrameKind::Request => {
                let path = std::str::from_utf8(&path_bytes)
                    .map_err(|_| FrameError::InvalidPath("not UTF-8"))?;
                if !path.starts_with('/') {
                    return Err(FrameError::InvalidPath(
                        "a request path must start with '/'",
                    ));
                }
                path.to_owned()
            }
            _ if path_len != 0 => {
                return Err(FrameError::InvalidPath("only request frames carry a path"));
            }
            _ => String::new(),
        };
        let streaming = flags & FrameFlags::STREAMING.0 != 0;
        let kind_unknown = flags & FrameFlags::KIND_UNKNOWN.0 != 0;
        let malformed = |reason| Err(FrameError::Malformed { kind, reason });
        match kind {
            FrameKind::Request
                if streaming && payload_len != 0 && flags & FrameFlags::END_STREAM.0 == 0 =>
            {
                return malformed(
                    "a streaming request carries messages only with END_STREAM (the client's whole stream)",
                );
            }
            FrameKind::Request if kind_unknown && !streaming => {
                return malformed("KIND_UNKNOWN is only for a streaming request");
            }
            FrameKind::Request => {}
            _ if streaming => return malformed("only a request may be flagged STREAMING"),
            _ if kind_unknown => return malformed("only a request may be flagged KIND_UNKNOWN"),
            FrameKind::Message if metadata_len != 0 => {
                return malformed("a message frame carries no metadata");
            }
            FrameKind::Headers if payload_len != 0 => {
                return malformed("a headers frame carries no payload");
            }
            FrameKind::Window if metadata_len != 0 || payload_len != 4 => {
                return malformed("a window frame carries a 4-byte grant and nothing else");
            }
            FrameKind::Window if message[metadata_len..].iter().all(|&b| b == 0) => {
                return malformed("a window grant is at least 1");
            }
            _ => {}
        }
        if let Err(excess) = Metadata::check_encoded_limits(&message[..metadata_len]) {
            return Err(FrameError::MetadataOverLimit {
                kind,
                call_id,
                excess,
            });
        }
        let metadata = Metadata::decode(message.split_to(metadata_len))?;
        Ok(Frame {
            kind,
            flags: FrameFlags(flags),
            call_id,
            status,
            deadline: (deadline_us != 0).then(|| Duration::from_micros(deadline_us)),
            path,
            metadata,
            payload: Payload::from(message),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Frame {
        let mut metadata = Metadata::new();
        metadata.insert("x-user", "ada").unwrap();
        metadata.insert_bin("blob-bin", vec![1u8, 2, 3]).unwrap();
        Frame::request(
            7,
            "/echo.Echo/Say",
            Some(Duration::from_millis(1500)),
            metadata,
            Bytes::from_static(b"hello"),
        )
    }

    /// Only kinds that carry metadata are refused from their header; on a
    /// message the length is a protocol error for the decoder to report.
    #[test]
    fn a_header_announcing_too_much_metadata_is_seen_on_kinds_that_carry_it() {
        let head = |kind: FrameKind| {
            let mut frame = Frame::control(kind, FrameFlags::EMPTY, 3).encode().to_vec();
            frame[28..32].copy_from_slice(&u32::MAX.to_le_bytes());
            frame
        };
        for kind in [FrameKind::Request, FrameKind::Response, FrameKind::Headers] {
            assert!(
                Frame::peek_metadata_excess(&head(kind)).is_some(),
                "{kind:?}"
            );
        }
        for kind in [FrameKind::Message, FrameKind::Window] {
            assert!(
                Frame::peek_metadata_excess(&head(kind)).is_none(),
                "{kind:?}"
            );
        }
        let within = Frame::control(FrameKind::Request, FrameFlags::EMPTY, 3).encode();
        assert!(Frame::peek_metadata_excess(&within).is_none());
        assert!(Frame::peek_metadata_excess(&head(FrameKind::Request)[..20]).is_none());
    }

    #[test]
    fn parts_are_the_frame_and_a_large_payload_is_not_copied() {
        let small = sample();
        let parts = small.encode_parts();
        assert!(
            parts.payload.is_empty(),
            "a small payload rides in the head"
        );
        assert_eq!(parts.into_contiguous(), small.encode());

        let mut large = sample();
        let field = Bytes::from(vec![9u8; JOIN_PAYLOAD_BELOW]);
        large.payload = Payload::from_parts([Bytes::from_static(b"key"), field.clone()]);
        let parts = large.encode_parts();
        assert_eq!(parts.payload.part_count(), 2);
        assert_eq!(
            parts.payload.parts().nth(1).unwrap().as_ptr(),
            field.as_ptr(),
            "the payload's parts themselves"
        );
        assert_eq!(parts.len(), large.encoded_len());
        let joined = parts.into_contiguous();
        assert_eq!(joined, large.encode());
        assert_eq!(Frame::decode(joined, DEFAULT_MAX_FRAME_LEN).unwrap(), large);
    }

    #[test]
    fn round_trip_every_kind() {
        let frames = [
            sample(),
            Frame::response(
                7,
                Code::NotFound,
                Metadata::new(),
                Bytes::from_static(b"gone"),
            ),
            Frame::control(FrameKind::Cancel, FrameFlags::EMPTY, 9),
            Frame::control(FrameKind::Ping, FrameFlags::ACK, 0),
            Frame::control(FrameKind::GoAway, FrameFlags::EMPTY, 41),
            Frame::stream_request(11, "/echo.Echo/Chat", None, Metadata::new()),
            Frame::message(11, Bytes::from_static(b"one"), false),
            Frame::message(11, Bytes::new(), true),
            Frame::headers(11, {
                let mut metadata = Metadata::new();
                metadata.insert("x-served-by", "a").unwrap();
                metadata
            }),
            Frame::half_close(11),
            Frame::window(11, 16),
        ];
        for frame in frames {
            let bytes = frame.encode();
            assert_eq!(bytes.len(), frame.encoded_len());
            assert_eq!(Frame::decode(bytes, DEFAULT_MAX_FRAME_LEN).unwrap(), frame);
        }
    }

    #[test]
    fn header_layout_is_little_endian_at_documented_offsets() {
        let bytes = sample().encode();
        assert_eq!(bytes[0], PROTOCOL_VERSION);
        assert_eq!(bytes[1], FrameKind::Request as u8);
        assert_eq!(u16::from_le_bytes([bytes[2], bytes[3]]), 1);
        assert_eq!(u64::from_le_bytes(bytes[8..16].try_into().unwrap()), 7);
        assert_eq!(
            u64::from_le_bytes(bytes[16..24].try_into().unwrap()),
            1_500_000
        );
        assert_eq!(u16::from_le_bytes([bytes[24], bytes[25]]), 14);
        assert_eq!(u32::from_le_bytes(bytes[32..36].try_into().unwrap()), 5);
        assert_eq!(&bytes[HEADER_LEN..HEADER_LEN + 14], b"/echo.Echo/Say");
        assert_eq!(&bytes[bytes.len() - 5..], b"hello");
    }

    /// The example in docs/wire-format.md, byte for byte.
    #[test]
    fn documented_example_bytes() {
        let mut metadata = Metadata::new();
        metadata.insert("x-user", "ada").unwrap();
        let frame = Frame::request(
            7,
            "/echo.v1.Echo/Say",
            Some(Duration::from_millis(1500)),
            metadata,
            Bytes::from_static(b"hello"),
        );
        let mut expected = vec![
            0x01, 0x01, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, // version, kind, flags, status
            0x07, 0, 0, 0, 0, 0, 0, 0, // call id
            0x60, 0xe3, 0x16, 0, 0, 0, 0, 0, // deadline 1_500_000 µs
            0x11, 0x00, 0x00, 0x00, // path_len 17, reserved
            0x0f, 0, 0, 0, // metadata_len 15
            0x05, 0, 0, 0, // payload_len 5
            0, 0, 0, 0, // reserved
        ];
        expected.extend_from_slice(b"/echo.v1.Echo/Say");
        expected.extend_from_slice(&[0x06, 0x00, 0x03, 0x00, 0x00, 0x00]);
        expected.extend_from_slice(b"x-userada");
        expected.extend_from_slice(b"hello");
        assert_eq!(&frame.encode()[..], &expected[..]);
    }

    /// The stream frames in docs/wire-format.md, byte for byte.
    #[test]
    fn documented_stream_bytes() {
        let mut window = vec![0x01, 0x08, 0, 0, 0, 0, 0, 0, 0x07, 0, 0, 0, 0, 0, 0, 0];
        window.extend_from_slice(&[0; 16]); // deadline, path_len, reserved, metadata_len
        window.extend_from_slice(&[0x04, 0, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0]);
        assert_eq!(&Frame::window(7, 16).encode()[..], &window[..]);
        let mut half_close = vec![
            0x01, 0x07, 0x01, 0x00, 0, 0, 0, 0, 0x07, 0, 0, 0, 0, 0, 0, 0,
        ];
        half_close.extend_from_slice(&[0; 24]);
        assert_eq!(&Frame::half_close(7).encode()[..], &half_close[..]);
        let two = Payload::from(Bytes::from_static(&[2, 0, 0, 0, b'h', b'i', 0, 0, 0, 0]));
        let frame = Frame::messages(7, two, false).encode();
        assert_eq!(frame[1], 0x06);
        assert_eq!(u32::from_le_bytes(frame[32..36].try_into().unwrap()), 10);
        assert_eq!(&frame[HEADER_LEN..], &[2, 0, 0, 0, b'h', b'i', 0, 0, 0, 0]);
        assert_eq!(
            &Frame::message(7, Bytes::from_static(b"hi"), false).encode()[HEADER_LEN..],
            &[2, 0, 0, 0, b'h', b'i']
        );
    }

    #[test]
    fn rejects_bad_version_kind_flags_and_reserved() {
        let good = sample().encode();
        let patch = |offset: usize, value: u8| {
            let mut raw = BytesMut::from(&good[..]);
            raw[offset] = value;
            Frame::decode(raw.freeze(), DEFAULT_MAX_FRAME_LEN)
        };
        assert_eq!(patch(0, 2), Err(FrameError::BadVersion(2)));
        assert_eq!(patch(1, 0), Err(FrameError::UnknownKind(0)));
        assert_eq!(patch(1, 99), Err(FrameError::UnknownKind(99)));
        assert_eq!(patch(3, 0x80), Err(FrameError::UnknownFlags(0x8001)));
        assert_eq!(patch(2, 0x11), Err(FrameError::UnknownFlags(0x0011)));
        assert_eq!(patch(26, 1), Err(FrameError::ReservedNotZero));
        assert_eq!(patch(39, 1), Err(FrameError::ReservedNotZero));
    }

    #[test]
    fn rejects_every_truncation_and_trailing_bytes() {
        let good = sample().encode();
        for cut in 0..good.len() {
            let err = Frame::decode(good.slice(..cut), DEFAULT_MAX_FRAME_LEN).unwrap_err();
            assert!(
                matches!(err, FrameError::Truncated { .. }),
                "cut {cut}: {err}"
            );
        }
        let mut longer = BytesMut::from(&good[..]);
        longer.put_u8(0);
        assert!(matches!(
            Frame::decode(longer.freeze(), DEFAULT_MAX_FRAME_LEN),
            Err(FrameError::TrailingBytes { .. })
        ));
    }

    #[test]
    fn rejects_frames_and_announced_lengths_over_the_limit() {
        let good = sample().encode();
        assert!(matches!(
            Frame::decode(good.clone(), good.len() - 1),
            Err(FrameError::TooLarge { .. })
        ));
        // A short message whose header announces a 3 GiB payload.
        let mut raw = BytesMut::from(&good[..]);
        raw[32..36].copy_from_slice(&(3u32 << 30).to_le_bytes());
        assert!(matches!(
            Frame::decode(raw.freeze(), DEFAULT_MAX_FRAME_LEN),
            Err(FrameError::TooLarge { .. })
        ));
    }

    #[test]
    fn rejects_paths_that_are_missing_misplaced_or_not_utf8() {
        let mut no_slash = sample();
        no_slash.path = "echo.Echo/Say".into();
        assert!(matches!(
            Frame::decode(no_slash.encode(), DEFAULT_MAX_FRAME_LEN),
            Err(FrameError::InvalidPath(_))
        ));
        let mut misplaced = Frame::control(FrameKind::Cancel, FrameFlags::EMPTY, 1);
        misplaced.path = "/x".into();
        assert!(matches!(
            Frame::decode(misplaced.encode(), DEFAULT_MAX_FRAME_LEN),
            Err(FrameError::InvalidPath(_))
        ));
        let mut raw = BytesMut::from(&sample().encode()[..]);
        raw[HEADER_LEN + 1] = 0xff;
        assert!(matches!(
            Frame::decode(raw.freeze(), DEFAULT_MAX_FRAME_LEN),
            Err(FrameError::InvalidPath(_))
        ));
    }

    #[test]
    fn stream_frames_carry_only_what_their_kind_allows() {
        let reject = |frame: Frame, what: &str| {
            let decoded = Frame::decode(frame.encode(), DEFAULT_MAX_FRAME_LEN);
            assert!(
                matches!(decoded, Err(FrameError::Malformed { .. })),
                "{what}: {decoded:?}"
            );
        };
        let mut with_message = Frame::stream_request(1, "/a.B/C", None, Metadata::new());
        with_message.payload = Payload::from(Bytes::from_static(b"x"));
        reject(
            with_message,
            "streaming request with a message but without END_STREAM",
        );
        let whole = Frame::whole_stream_request(
            1,
            "/a.B/C",
            None,
            Metadata::new(),
            crate::stream::single_message(Payload::from(Bytes::from_static(b"x"))),
        );
        let decoded = Frame::decode(whole.encode(), DEFAULT_MAX_FRAME_LEN).unwrap();
        assert!(decoded.is_streaming() && decoded.flags.contains(FrameFlags::END_STREAM));
        assert_eq!(
            decoded.payload.into_contiguous(),
            Bytes::from_static(b"\x01\0\0\0x")
        );
        let mut flagged = Frame::message(1, Bytes::new(), false);
        flagged.flags = FrameFlags::STREAMING;
        reject(flagged, "STREAMING on a message");
        let mut unknown_unary = Frame::request(1, "/a.B/C", None, Metadata::new(), Bytes::new());
        unknown_unary.flags = FrameFlags::END_STREAM | FrameFlags::KIND_UNKNOWN;
        reject(unknown_unary, "KIND_UNKNOWN on a unary request");
        let mut unknown_message = Frame::message(1, Bytes::new(), false);
        unknown_message.flags = FrameFlags::KIND_UNKNOWN;
        reject(unknown_message, "KIND_UNKNOWN on a message");
        let mut unknown = Frame::stream_request(1, "/a.B/C", None, Metadata::new());
        unknown.flags = FrameFlags::STREAMING | FrameFlags::KIND_UNKNOWN;
        let decoded = Frame::decode(unknown.encode(), DEFAULT_MAX_FRAME_LEN).unwrap();
        assert!(decoded.is_streaming() && decoded.is_kind_unknown());
        let mut message_metadata = Frame::message(1, Bytes::new(), false);
        message_metadata.metadata.insert("x-a", "b").unwrap();
        reject(message_metadata, "metadata on a message");
        let mut headers_payload = Frame::headers(1, Metadata::new());
        headers_payload.payload = Payload::from(Bytes::from_static(b"x"));
        reject(headers_payload, "payload on headers");
        let mut zero = Frame::window(1, 1);
        zero.payload = Payload::from(Bytes::from_static(&[0, 0, 0, 0]));
        reject(zero, "grant of 0");
        let mut short = Frame::window(1, 1);
        short.payload = Payload::from(Bytes::from_static(&[1, 0, 0]));
        reject(short, "3-byte grant");
        let window = Frame::decode(Frame::window(3, 70_000).encode(), DEFAULT_MAX_FRAME_LEN);
        assert_eq!(window.unwrap().window_grant(), Some(70_000));
    }

    #[test]
    fn garbage_never_panics() {
        // A cheap deterministic sweep; the cargo-fuzz target does the real search.
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        for len in 0..512 {
            let mut raw = Vec::with_capacity(len);
            for _ in 0..len {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                raw.push(state as u8);
            }
            if len > 1 {
                raw[0] = PROTOCOL_VERSION;
            }
            let _ = Frame::decode(Bytes::from(raw), 4096);
        }
    }
}
