//! The messages of the RDMA protocol, as they sit in a receive slot.
//!
//! Every message is one SEND into one pre-posted receive slot of the peer and
//! starts with a 16-byte header:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | protocol version ([`PROTOCOL_VERSION`]) |
//! | 1 | 1 | kind: 1 DATA, 2 ANNOUNCE, 3 DONE, 4 CREDIT, 5 CLOSE, 6 RETURN, 7 BATCH |
//! | 2 | 2 | reserved, zero |
//! | 4 | 4 | credits granted to the receiver of this message (u32 LE) |
//! | 8 | 8 | token (ANNOUNCE, DONE), credits given back (RETURN: 1..=u32::MAX), else zero (u64 LE) |
//!
//! Then, by kind: DATA carries one whole rpc-core frame; ANNOUNCE carries
//! `addr: u64 | len: u64 | rkey: u32 | head_len: u32 | tail_len: u32 |
//! reserved: u32 (zero)` and then `head_len + tail_len` bytes: the frame is
//! the first `head_len` of them, then the `len` bytes that wait in the
//! sender's memory at `addr` for an RDMA READ, then the last `tail_len` (a
//! frame's small head, and the small end of a message after its large field,
//! ride in the message, so the large part can be read where it already
//! lies); BATCH carries 2 to [`MAX_BATCH_FRAMES`] whole frames, each as
//! `len: u32` and then its `len` bytes, filling the message exactly (what
//! a sender had queued at once travels in one slot, one completion, one
//! credit); DONE, CREDIT, CLOSE and RETURN carry nothing.

use bytes::{BufMut, Bytes, BytesMut};

/// Version byte of every message.
pub const PROTOCOL_VERSION: u8 = 5;
/// Bytes of the common header.
pub const HEADER_LEN: usize = 16;
/// Bytes of an ANNOUNCE body before its inline head.
pub const ANNOUNCE_BODY_LEN: usize = 32;
/// The most frames one BATCH carries: bounds what one message (one credit)
/// adds to the receiver's queue of frames for the application.
pub const MAX_BATCH_FRAMES: usize = 64;
/// Bytes in front of each frame of a BATCH (its length, u32 LE).
pub const BATCH_ENTRY_LEN: usize = 4;

/// A rendezvous announcement: the frame is `head`, then `len` bytes at
/// `addr` (readable with `rkey` until the receiver says DONE for `token`),
/// then `tail`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Announce {
    /// Names this transfer in DONE.
    pub token: u64,
    /// Address in the sender.
    pub addr: u64,
    /// Bytes to READ (not counting `head`).
    pub len: u64,
    /// Key of the window that covers exactly `addr..addr + len`.
    pub rkey: u32,
    /// The frame's first bytes, carried in the message (may be empty).
    pub head: Bytes,
    /// The frame's last bytes, after the remote part, carried in the message
    /// (may be empty).
    pub tail: Bytes,
}

impl Announce {
    /// Bytes of the whole frame: the inline head and tail and the remote
    /// part (saturating: a peer's `len` near `u64::MAX` must not wrap to a
    /// small frame that passes the length check).
    pub fn frame_len(&self) -> u64 {
        (self.inline_len() as u64).saturating_add(self.len)
    }

    /// Bytes carried in the message: head and tail.
    pub fn inline_len(&self) -> usize {
        self.head.len() + self.tail.len()
    }
}

/// What a message says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body {
    /// A whole frame, copied into the slot.
    Data(Bytes),
    /// Several whole frames (2 to [`MAX_BATCH_FRAMES`]), in send order,
    /// copied into one slot.
    Batch(Vec<Bytes>),
    /// A frame to pull with RDMA READ.
    Announce(Announce),
    /// The receiver pulled the announced frame: the sender may free it.
    Done {
        /// The announcement's token.
        token: u64,
    },
    /// Only credits.
    Credit,
    /// The sender gives back `credits` of the credits it holds (it was idle):
    /// the receiver's window shrinks by as much.
    Return {
        /// Credits given back (above 0).
        credits: u32,
    },
    /// The sender sends nothing more.
    Close,
}

/// One message: a credit grant plus a body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Receives the sender has re-posted since its last grant.
    pub credits: u32,
    /// What it carries.
    pub body: Body,
}

/// A received message that breaks the protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MessageError {
    /// Shorter than its header or its kind's body.
    #[error("message of {len} bytes is truncated")]
    Truncated {
        /// Bytes received.
        len: usize,
    },
    /// A version this build does not speak.
    #[error("unsupported RDMA protocol version {0}")]
    Version(u8),
    /// An unknown kind byte.
    #[error("unknown RDMA message kind {0}")]
    Kind(u8),
    /// Reserved bits set, or bytes after a fixed-size body.
    #[error("malformed RDMA message: {0}")]
    Malformed(&'static str),
}

const KIND_DATA: u8 = 1;
const KIND_ANNOUNCE: u8 = 2;
const KIND_DONE: u8 = 3;
const KIND_CREDIT: u8 = 4;
const KIND_CLOSE: u8 = 5;
const KIND_RETURN: u8 = 6;
const KIND_BATCH: u8 = 7;

impl Message {
    /// The header, and the fixed body bytes that follow it (the
    /// announcement's [`tail`](Announce::tail) is not copied here: the caller gathers header,
    /// body and tail into its send slot).
    pub fn encode_header(&self) -> ([u8; HEADER_LEN], Option<[u8; ANNOUNCE_BODY_LEN]>) {
        let (kind, token) = match &self.body {
            Body::Data(_) => (KIND_DATA, 0),
            Body::Batch(_) => (KIND_BATCH, 0),
            Body::Announce(announce) => (KIND_ANNOUNCE, announce.token),
            Body::Done { token } => (KIND_DONE, *token),
            Body::Credit => (KIND_CREDIT, 0),
            Body::Close => (KIND_CLOSE, 0),
            Body::Return { credits } => (KIND_RETURN, u64::from(*credits)),
        };
        let mut header = [0u8; HEADER_LEN];
        header[0] = PROTOCOL_VERSION;
        header[1] = kind;
        header[4..8].copy_from_slice(&self.credits.to_le_bytes());
        header[8..16].copy_from_slice(&token.to_le_bytes());
        let announce = match &self.body {
            Body::Announce(announce) => {
                let mut body = [0u8; ANNOUNCE_BODY_LEN];
                body[0..8].copy_from_slice(&announce.addr.to_le_bytes());
                body[8..16].copy_from_slice(&announce.len.to_le_bytes());
                body[16..20].copy_from_slice(&announce.rkey.to_le_bytes());
                let head_len = u32::try_from(announce.head.len()).expect("a head fits a slot");
                body[20..24].copy_from_slice(&head_len.to_le_bytes());
                let tail_len = u32::try_from(announce.tail.len()).expect("a tail fits a slot");
                body[24..28].copy_from_slice(&tail_len.to_le_bytes());
                Some(body)
            }
            _ => None,
        };
        (header, announce)
    }

    /// Bytes this message occupies in a slot.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN
            + match &self.body {
                Body::Data(frame) => frame.len(),
                Body::Batch(frames) => frames
                    .iter()
                    .map(|frame| BATCH_ENTRY_LEN + frame.len())
                    .sum(),
                Body::Announce(announce) => ANNOUNCE_BODY_LEN + announce.inline_len(),
                _ => 0,
            }
    }

    /// Writes the whole message to the front of `slot` (the driver's send
    /// slot) and returns its length, [`Message::encoded_len`].
    ///
    /// # Panics
    /// When `slot` is shorter than that.
    pub fn encode_into(&self, slot: &mut [u8]) -> usize {
        let mut out = &mut slot[..self.encoded_len()];
        let (header, announce) = self.encode_header();
        out.put_slice(&header);
        if let Some(body) = announce {
            out.put_slice(&body);
        }
        match &self.body {
            Body::Data(frame) => out.put_slice(frame),
            Body::Batch(frames) => {
                for frame in frames {
                    let len = u32::try_from(frame.len()).expect("a batched frame fits a slot");
                    out.put_u32_le(len);
                    out.put_slice(frame);
                }
            }
            Body::Announce(announce) => {
                out.put_slice(&announce.head);
                out.put_slice(&announce.tail);
            }
            _ => {}
        }
        debug_assert!(out.is_empty(), "encoded_len counts every byte");
        self.encoded_len()
    }

    /// The whole message as one buffer (tests, and the slow path).
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::zeroed(self.encoded_len());
        self.encode_into(&mut out);
        out.freeze()
    }

    /// Parses a received message; a DATA frame is a slice of `bytes`.
    pub fn decode(bytes: Bytes) -> Result<Message, MessageError> {
        if bytes.len() < HEADER_LEN {
            return Err(MessageError::Truncated { len: bytes.len() });
        }
        if bytes[0] != PROTOCOL_VERSION {
            return Err(MessageError::Version(bytes[0]));
        }
        if bytes[2] != 0 || bytes[3] != 0 {
            return Err(MessageError::Malformed(
                "reserved header bytes are not zero",
            ));
        }
        let credits = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes"));
        let token = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
        let rest = bytes.len() - HEADER_LEN;
        let fixed = |body: Body| {
            if rest != 0 {
                Err(MessageError::Malformed("bytes after a fixed-size message"))
            } else if token != 0 && !matches!(body, Body::Done { .. } | Body::Return { .. }) {
                Err(MessageError::Malformed(
                    "token set on a message without one",
                ))
            } else {
                Ok(body)
            }
        };
        let body = match bytes[1] {
            KIND_DATA => {
                if token != 0 {
                    return Err(MessageError::Malformed("token set on DATA"));
                }
                Body::Data(bytes.slice(HEADER_LEN..))
            }
            KIND_BATCH => {
                if token != 0 {
                    return Err(MessageError::Malformed("token set on BATCH"));
                }
                Body::Batch(decode_batch(&bytes)?)
            }
            KIND_ANNOUNCE => {
                if rest < ANNOUNCE_BODY_LEN {
                    return Err(MessageError::Truncated { len: bytes.len() });
                }
                let body = &bytes[HEADER_LEN..];
                let head_len = u32::from_le_bytes(body[20..24].try_into().expect("4 bytes"));
                let tail_len = u32::from_le_bytes(body[24..28].try_into().expect("4 bytes"));
                if body[28..32] != [0; 4] {
                    return Err(MessageError::Malformed(
                        "reserved announcement bytes are not zero",
                    ));
                }
                let inline_len = head_len as usize + tail_len as usize;
                match (rest - ANNOUNCE_BODY_LEN).cmp(&inline_len) {
                    std::cmp::Ordering::Less => {
                        return Err(MessageError::Truncated { len: bytes.len() });
                    }
                    std::cmp::Ordering::Greater => {
                        return Err(MessageError::Malformed(
                            "bytes after an announcement's inline bytes",
                        ));
                    }
                    std::cmp::Ordering::Equal => {}
                }
                let start = HEADER_LEN + ANNOUNCE_BODY_LEN;
                Body::Announce(Announce {
                    token,
                    addr: u64::from_le_bytes(body[0..8].try_into().expect("8 bytes")),
                    len: u64::from_le_bytes(body[8..16].try_into().expect("8 bytes")),
                    rkey: u32::from_le_bytes(body[16..20].try_into().expect("4 bytes")),
                    head: bytes.slice(start..start + head_len as usize),
                    tail: bytes.slice(start + head_len as usize..),
                })
            }
            KIND_DONE => fixed(Body::Done { token })?,
            KIND_CREDIT => fixed(Body::Credit)?,
            KIND_CLOSE => fixed(Body::Close)?,
            KIND_RETURN => {
                let credits = u32::try_from(token)
                    .ok()
                    .filter(|credits| *credits > 0)
                    .ok_or(MessageError::Malformed(
                        "RETURN of no credits, or of more than 2^32 - 1",
                    ))?;
                fixed(Body::Return { credits })?
            }
            other => return Err(MessageError::Kind(other)),
        };
        Ok(Message { credits, body })
    }
}

/// The frames of a BATCH message (`bytes` is the whole message): each a
/// slice of `bytes`.
fn decode_batch(bytes: &Bytes) -> Result<Vec<Bytes>, MessageError> {
    let mut frames = Vec::new();
    let mut at = HEADER_LEN;
    while at < bytes.len() {
        if frames.len() == MAX_BATCH_FRAMES {
            return Err(MessageError::Malformed("BATCH of more than 64 frames"));
        }
        let Some(prefix) = bytes.get(at..at + BATCH_ENTRY_LEN) else {
            return Err(MessageError::Truncated { len: bytes.len() });
        };
        let len = u32::from_le_bytes(prefix.try_into().expect("4 bytes")) as usize;
        let start = at + BATCH_ENTRY_LEN;
        if bytes.len() - start < len {
            return Err(MessageError::Truncated { len: bytes.len() });
        }
        frames.push(bytes.slice(start..start + len));
        at = start + len;
    }
    if frames.len() < 2 {
        return Err(MessageError::Malformed(
            "BATCH of fewer than 2 frames (one frame travels as DATA)",
        ));
    }
    Ok(frames)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<Message> {
        vec![
            Message {
                credits: 3,
                body: Body::Data(Bytes::from_static(b"frame bytes")),
            },
            Message {
                credits: 0,
                body: Body::Data(Bytes::new()),
            },
            Message {
                credits: 7,
                body: Body::Announce(Announce {
                    token: 9,
                    addr: 0x7f00_0000_1000,
                    len: 1 << 20,
                    rkey: 0xdead,
                    head: Bytes::new(),
                    tail: Bytes::new(),
                }),
            },
            Message {
                credits: 2,
                body: Body::Announce(Announce {
                    token: 10,
                    addr: 0x7f00_0000_2000,
                    len: 1 << 30,
                    rkey: 0xbeef,
                    head: Bytes::from_static(b"the frame's header, path and metadata"),
                    tail: Bytes::from_static(b"the message's end"),
                }),
            },
            Message {
                credits: 1,
                body: Body::Done { token: 9 },
            },
            Message {
                credits: 64,
                body: Body::Credit,
            },
            Message {
                credits: 0,
                body: Body::Close,
            },
            Message {
                credits: 2,
                body: Body::Return { credits: 60 },
            },
            Message {
                credits: 5,
                body: Body::Batch(vec![
                    Bytes::from_static(b"first frame"),
                    Bytes::new(),
                    Bytes::from_static(b"third"),
                ]),
            },
        ]
    }

    fn batch_of(count: usize) -> Vec<u8> {
        let mut bytes = Message {
            credits: 0,
            body: Body::Credit,
        }
        .encode()
        .to_vec();
        bytes[1] = KIND_BATCH;
        for index in 0..count {
            bytes.extend_from_slice(&1u32.to_le_bytes());
            bytes.push(index as u8);
        }
        bytes
    }

    #[test]
    fn a_batch_lays_out_length_prefixed_frames_and_refuses_anything_else() {
        let batch = all().pop().unwrap().encode();
        assert_eq!(batch[1], KIND_BATCH);
        assert_eq!(&batch[HEADER_LEN..HEADER_LEN + 4], &11u32.to_le_bytes());
        assert_eq!(&batch[HEADER_LEN + 4..HEADER_LEN + 15], b"first frame");
        assert_eq!(
            &batch[HEADER_LEN + 15..HEADER_LEN + 19],
            &0u32.to_le_bytes()
        );
        assert_eq!(
            &batch[HEADER_LEN + 19..HEADER_LEN + 23],
            &5u32.to_le_bytes()
        );
        assert_eq!(&batch[HEADER_LEN + 23..], b"third");
        let frames = match Message::decode(batch.clone()).unwrap().body {
            Body::Batch(frames) => frames,
            other => panic!("{other:?}"),
        };
        assert_eq!(frames[2], &b"third"[..]);

        // A cut anywhere inside the last frame or its prefix (a cut right
        // after the second frame leaves a valid batch of two).
        for cut in HEADER_LEN + 20..batch.len() {
            assert!(
                matches!(
                    Message::decode(batch.slice(..cut)),
                    Err(MessageError::Truncated { .. })
                ),
                "cut at {cut}"
            );
        }
        // A length that runs past the end.
        let mut long = batch.to_vec();
        long[HEADER_LEN + 19] = 6;
        assert!(matches!(
            Message::decode(long.into()),
            Err(MessageError::Truncated { .. })
        ));
        // No token, at least 2 frames, at most MAX_BATCH_FRAMES.
        let mut token = batch.to_vec();
        token[8] = 1;
        assert_eq!(
            Message::decode(token.into()),
            Err(MessageError::Malformed("token set on BATCH"))
        );
        for count in [0, 1, MAX_BATCH_FRAMES + 1] {
            assert!(
                matches!(
                    Message::decode(batch_of(count).into()),
                    Err(MessageError::Malformed(_))
                ),
                "{count} frames"
            );
        }
        assert!(Message::decode(batch_of(MAX_BATCH_FRAMES).into()).is_ok());
    }

    #[test]
    fn the_fuzz_seeds_are_messages_of_this_version() {
        macro_rules! seed {
            ($name:literal) => {
                (
                    $name,
                    &include_bytes!(concat!("../../fuzz/seeds/protocol_message/", $name))[..],
                )
            };
        }
        let seeds = [
            seed!("data"),
            seed!("announce"),
            seed!("done"),
            seed!("credit"),
            seed!("close"),
            seed!("return"),
            seed!("batch"),
        ];
        for (name, bytes) in seeds {
            let bytes = Bytes::from_static(bytes);
            let message = Message::decode(bytes.clone())
                .unwrap_or_else(|error| panic!("seed {name}: {error}"));
            assert_eq!(message.encode(), bytes, "seed {name} is canonical");
        }
    }

    #[test]
    fn encode_into_writes_what_encode_returns() {
        for message in all() {
            let mut slot = vec![0xee; message.encoded_len() + 8];
            let len = message.encode_into(&mut slot);
            assert_eq!(len, message.encoded_len());
            assert_eq!(&slot[..len], &message.encode()[..]);
            assert_eq!(&slot[len..], &[0xee; 8]);
        }
    }

    #[test]
    fn an_announcement_with_reserved_bytes_or_a_short_tail_is_refused() {
        let announce = Message {
            credits: 0,
            body: Body::Announce(Announce {
                token: 1,
                addr: 0x1000,
                len: 100,
                rkey: 5,
                head: Bytes::from_static(b"head"),
                tail: Bytes::from_static(b"tail"),
            }),
        }
        .encode();
        let mut reserved = announce.to_vec();
        reserved[HEADER_LEN + 29] = 1;
        assert_eq!(
            Message::decode(reserved.into()),
            Err(MessageError::Malformed(
                "reserved announcement bytes are not zero"
            ))
        );
        // A tail longer than the bytes that follow.
        let mut short = announce.to_vec();
        short[HEADER_LEN + 24] = 5;
        assert!(matches!(
            Message::decode(short.into()),
            Err(MessageError::Truncated { .. })
        ));
        // One byte fewer than announced, and one more.
        let mut long = announce.to_vec();
        long[HEADER_LEN + 24] = 3;
        assert!(matches!(
            Message::decode(long.into()),
            Err(MessageError::Malformed(_))
        ));
    }

    #[test]
    fn every_kind_round_trips() {
        for message in all() {
            let bytes = message.encode();
            assert_eq!(bytes.len(), message.encoded_len());
            assert_eq!(Message::decode(bytes).unwrap(), message);
        }
    }

    #[test]
    fn documented_header_layout() {
        let bytes = Message {
            credits: 0x0102_0304,
            body: Body::Done { token: 0x1122 },
        }
        .encode();
        assert_eq!(
            &bytes[..],
            &[
                PROTOCOL_VERSION,
                3,
                0,
                0,
                4,
                3,
                2,
                1,
                0x22,
                0x11,
                0,
                0,
                0,
                0,
                0,
                0
            ]
        );
    }

    #[test]
    fn bad_messages_are_typed_errors() {
        let done = Message {
            credits: 0,
            body: Body::Done { token: 1 },
        }
        .encode();
        for cut in 0..HEADER_LEN {
            assert_eq!(
                Message::decode(done.slice(..cut)),
                Err(MessageError::Truncated { len: cut })
            );
        }
        let mut bad = done.to_vec();
        bad[0] = PROTOCOL_VERSION + 1;
        assert_eq!(
            Message::decode(bad.clone().into()),
            Err(MessageError::Version(PROTOCOL_VERSION + 1))
        );
        bad[0] = PROTOCOL_VERSION;
        bad[1] = 77;
        assert_eq!(Message::decode(bad.into()), Err(MessageError::Kind(77)));
        let mut trailing = done.to_vec();
        trailing.push(0);
        assert!(matches!(
            Message::decode(trailing.into()),
            Err(MessageError::Malformed(_))
        ));
        let announce = all()[2].encode();
        assert!(matches!(
            Message::decode(announce.slice(..announce.len() - 1)),
            Err(MessageError::Truncated { .. })
        ));
        // An announcement's head shorter or longer than its length field says.
        let with_head = all()[3].encode();
        assert!(matches!(
            Message::decode(with_head.slice(..with_head.len() - 1)),
            Err(MessageError::Truncated { .. })
        ));
        let mut longer = with_head.to_vec();
        longer.push(0);
        assert!(matches!(
            Message::decode(longer.into()),
            Err(MessageError::Malformed(_))
        ));
        let mut credit_with_token = all()[5].encode().to_vec();
        credit_with_token[8] = 1;
        assert!(matches!(
            Message::decode(credit_with_token.into()),
            Err(MessageError::Malformed(_))
        ));
    }
}
