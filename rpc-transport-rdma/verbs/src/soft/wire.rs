//! The soft "wire" between two connected queue pairs: the request/response
//! descriptors that travel in the shared-memory rings (`ring`), their
//! encoding and the reader that reassembles them. Payload bytes travel in a
//! descriptor only for inline sends and messages up to 512 B; otherwise the
//! responder moves them directly between the two address spaces with
//! `process_vm_*`.

use std::io::{self, Read};

use super::memory::Span;

/// Initiator → responder: one work request to execute, in sequence order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Request {
    pub(crate) seq: u64,
    pub(crate) op: RequestOp,
    pub(crate) solicited: bool,
    /// How promptly the initiator wants the acknowledgement.
    pub(crate) ack: AckUrgency,
    /// The initiator's memory: the data source of sends and writes, the
    /// destination of reads. Empty for inline sends.
    pub(crate) spans: Vec<Span>,
    /// Inline data (sends and writes marked inline).
    pub(crate) inline: Option<Vec<u8>>,
}

impl Request {
    /// Bytes the request moves.
    pub(crate) fn len(&self) -> usize {
        match &self.inline {
            Some(bytes) => bytes.len(),
            None => self.spans.iter().map(|(_, len)| *len as usize).sum(),
        }
    }

    /// Whether the responder takes a receive for it (a SEND, or a WRITE
    /// with an immediate).
    pub(crate) fn consumes_receive(&self) -> bool {
        matches!(
            self.op,
            RequestOp::Send { .. } | RequestOp::Write { imm: Some(_), .. }
        )
    }
}

/// How promptly an initiator wants a request acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AckUrgency {
    /// Whenever the initiator next looks (an unsignaled request: a sleeping
    /// initiator has nothing to complete, so nobody is woken for it).
    Lazy,
    /// Promptly, and it ends in a completion (a signaled request): the
    /// initiator's caller may be sleeping on it.
    Completion,
    /// Promptly, with no completion (the send queue is filling up): the
    /// initiator's engine frees the slots.
    Slots,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RequestOp {
    Send {
        imm: Option<u32>,
    },
    Write {
        remote_addr: u64,
        rkey: u32,
        imm: Option<u32>,
    },
    Read {
        remote_addr: u64,
        rkey: u32,
    },
    CompareSwap {
        remote_addr: u64,
        rkey: u32,
        compare: u64,
        swap: u64,
    },
    FetchAdd {
        remote_addr: u64,
        rkey: u32,
        add: u64,
    },
}

/// Responder → initiator: the outcome of request `seq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Response {
    pub(crate) seq: u64,
    pub(crate) outcome: Outcome,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Ack,
    /// Atomic done; the value before it.
    AtomicAck(u64),
    /// Receiver not ready: no receive posted. Retry later.
    RnrNak,
    /// Unknown rkey, range outside the region, or missing access right.
    RemoteAccess,
    /// Invalid request (receive buffer too small, misaligned atomic).
    RemoteInvalid,
    /// The responder failed to carry out a valid request.
    RemoteOperation,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Message {
    Request(Request),
    Response(Response),
}

const REQUEST: u8 = 1;
const RESPONSE: u8 = 2;
/// Largest message accepted; a request lists at most a few hundred spans.
const MAX_MESSAGE: usize = 1 << 20;

fn put_opt_u32(out: &mut Vec<u8>, value: Option<u32>) {
    out.push(value.is_some() as u8);
    out.extend_from_slice(&value.unwrap_or(0).to_le_bytes());
}

/// Appends a length-prefixed encoding to a buffer (no allocation of its own).
pub(crate) trait Encode {
    fn encode_into(&self, out: &mut Vec<u8>);
}

/// Writes the 4-byte length placeholder, runs `body`, then fills it in.
fn framed(out: &mut Vec<u8>, body: impl FnOnce(&mut Vec<u8>)) {
    let at = out.len();
    out.extend_from_slice(&[0u8; 4]);
    body(out);
    let len = (out.len() - at - 4) as u32;
    out[at..at + 4].copy_from_slice(&len.to_le_bytes());
}

impl Encode for Request {
    fn encode_into(&self, out: &mut Vec<u8>) {
        let request = self;
        framed(out, |out| {
            out.push(REQUEST);
            out.extend_from_slice(&request.seq.to_le_bytes());
            let ack = match request.ack {
                AckUrgency::Lazy => 0u8,
                AckUrgency::Completion => 1,
                AckUrgency::Slots => 2,
            };
            out.push(u8::from(request.solicited) | (ack << 1));
            let (kind, a, b, c, d): (u8, u64, u32, u64, u64) = match request.op {
                RequestOp::Send { .. } => (1, 0, 0, 0, 0),
                RequestOp::Write {
                    remote_addr, rkey, ..
                } => (2, remote_addr, rkey, 0, 0),
                RequestOp::Read { remote_addr, rkey } => (3, remote_addr, rkey, 0, 0),
                RequestOp::CompareSwap {
                    remote_addr,
                    rkey,
                    compare,
                    swap,
                } => (4, remote_addr, rkey, compare, swap),
                RequestOp::FetchAdd {
                    remote_addr,
                    rkey,
                    add,
                } => (5, remote_addr, rkey, add, 0),
            };
            let imm = match request.op {
                RequestOp::Send { imm } | RequestOp::Write { imm, .. } => imm,
                _ => None,
            };
            out.push(kind);
            put_opt_u32(out, imm);
            out.extend_from_slice(&a.to_le_bytes());
            out.extend_from_slice(&b.to_le_bytes());
            out.extend_from_slice(&c.to_le_bytes());
            out.extend_from_slice(&d.to_le_bytes());
            out.extend_from_slice(&(request.spans.len() as u32).to_le_bytes());
            for (addr, len) in &request.spans {
                out.extend_from_slice(&addr.to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
            }
            match &request.inline {
                Some(bytes) => {
                    out.push(1);
                    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
                    out.extend_from_slice(bytes);
                }
                None => out.push(0),
            }
        });
    }
}

impl Encode for Response {
    fn encode_into(&self, out: &mut Vec<u8>) {
        framed(out, |out| {
            out.push(RESPONSE);
            out.extend_from_slice(&self.seq.to_le_bytes());
            let (code, value) = match self.outcome {
                Outcome::Ack => (0u8, 0u64),
                Outcome::AtomicAck(old) => (1, old),
                Outcome::RnrNak => (2, 0),
                Outcome::RemoteAccess => (3, 0),
                Outcome::RemoteInvalid => (4, 0),
                Outcome::RemoteOperation => (5, 0),
            };
            out.push(code);
            out.extend_from_slice(&value.to_le_bytes());
        });
    }
}

impl Encode for Message {
    fn encode_into(&self, out: &mut Vec<u8>) {
        match self {
            Message::Request(request) => request.encode_into(out),
            Message::Response(response) => response.encode_into(out),
        }
    }
}

impl Message {
    pub(crate) fn decode(body: &[u8]) -> io::Result<Message> {
        let bad = || {
            io::Error::new(
                io::ErrorKind::InvalidData,
                "malformed soft-RDMA wire message",
            )
        };
        let mut cursor = Cursor { bytes: body, at: 0 };
        match cursor.u8().ok_or_else(bad)? {
            REQUEST => {
                let seq = cursor.u64().ok_or_else(bad)?;
                let flags = cursor.u8().ok_or_else(bad)?;
                let solicited = flags & 1 != 0;
                let ack = match (flags >> 1) & 3 {
                    0 => AckUrgency::Lazy,
                    1 => AckUrgency::Completion,
                    2 => AckUrgency::Slots,
                    _ => return Err(bad()),
                };
                let kind = cursor.u8().ok_or_else(bad)?;
                let has_imm = cursor.u8().ok_or_else(bad)? != 0;
                let imm_value = cursor.u32().ok_or_else(bad)?;
                let imm = has_imm.then_some(imm_value);
                let a = cursor.u64().ok_or_else(bad)?;
                let b = cursor.u32().ok_or_else(bad)?;
                let c = cursor.u64().ok_or_else(bad)?;
                let d = cursor.u64().ok_or_else(bad)?;
                let op = match kind {
                    1 => RequestOp::Send { imm },
                    2 => RequestOp::Write {
                        remote_addr: a,
                        rkey: b,
                        imm,
                    },
                    3 => RequestOp::Read {
                        remote_addr: a,
                        rkey: b,
                    },
                    4 => RequestOp::CompareSwap {
                        remote_addr: a,
                        rkey: b,
                        compare: c,
                        swap: d,
                    },
                    5 => RequestOp::FetchAdd {
                        remote_addr: a,
                        rkey: b,
                        add: c,
                    },
                    _ => return Err(bad()),
                };
                let count = cursor.u32().ok_or_else(bad)? as usize;
                if count > MAX_MESSAGE / 12 {
                    return Err(bad());
                }
                let mut spans = Vec::with_capacity(count);
                for _ in 0..count {
                    spans.push((cursor.u64().ok_or_else(bad)?, cursor.u32().ok_or_else(bad)?));
                }
                let inline = match cursor.u8().ok_or_else(bad)? {
                    0 => None,
                    _ => {
                        let len = cursor.u32().ok_or_else(bad)? as usize;
                        Some(cursor.take(len).ok_or_else(bad)?.to_vec())
                    }
                };
                Ok(Message::Request(Request {
                    seq,
                    op,
                    solicited,
                    ack,
                    spans,
                    inline,
                }))
            }
            RESPONSE => {
                let seq = cursor.u64().ok_or_else(bad)?;
                let code = cursor.u8().ok_or_else(bad)?;
                let value = cursor.u64().ok_or_else(bad)?;
                let outcome = match code {
                    0 => Outcome::Ack,
                    1 => Outcome::AtomicAck(value),
                    2 => Outcome::RnrNak,
                    3 => Outcome::RemoteAccess,
                    4 => Outcome::RemoteInvalid,
                    5 => Outcome::RemoteOperation,
                    _ => return Err(bad()),
                };
                Ok(Message::Response(Response { seq, outcome }))
            }
            _ => Err(bad()),
        }
    }
}

struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let slice = self.bytes.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(slice)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4")))
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8")))
    }
}

/// Accumulates bytes from a stream and yields whole messages; tolerates read
/// time-outs in the middle of a message.
pub(crate) struct MessageReader {
    buf: Vec<u8>,
    /// What one read lands in (kept, so a read does not zero a fresh one).
    chunk: Box<[u8]>,
    /// Where the next message starts in `buf` (consumed bytes are dropped in
    /// bulk, not one message at a time).
    start: usize,
}

/// What one read produced.
pub(crate) enum ReadOutcome {
    Message(Message),
    /// The read timed out (or would block) with no whole message yet.
    TimedOut,
    /// The peer closed the socket.
    Closed,
}

impl MessageReader {
    pub(crate) fn new() -> MessageReader {
        MessageReader {
            buf: Vec::with_capacity(4096),
            chunk: vec![0u8; 8192].into_boxed_slice(),
            start: 0,
        }
    }

    fn take_message(&mut self) -> io::Result<Option<Message>> {
        let buf = &self.buf[self.start..];
        if buf.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_le_bytes(buf[..4].try_into().expect("4")) as usize;
        if len > MAX_MESSAGE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "soft-RDMA wire message too long",
            ));
        }
        if buf.len() < 4 + len {
            return Ok(None);
        }
        let message = Message::decode(&buf[4..4 + len])?;
        self.start += 4 + len;
        if self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        }
        Ok(Some(message))
    }

    /// The next message, a time-out, or EOF.
    pub(crate) fn read(&mut self, stream: &mut impl Read) -> io::Result<ReadOutcome> {
        loop {
            if let Some(message) = self.take_message()? {
                return Ok(ReadOutcome::Message(message));
            }
            match stream.read(&mut self.chunk) {
                Ok(0) => return Ok(ReadOutcome::Closed),
                Ok(n) => {
                    if self.start > 0 {
                        self.buf.drain(..self.start);
                        self.start = 0;
                    }
                    self.buf.extend_from_slice(&self.chunk[..n]);
                }
                Err(error)
                    if matches!(
                        error.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Ok(ReadOutcome::TimedOut);
                }
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) if error.kind() == io::ErrorKind::ConnectionReset => {
                    return Ok(ReadOutcome::Closed);
                }
                Err(error) => return Err(error),
            }
        }
    }
}

/// Reads from a socket without blocking, whatever the socket's mode
/// (`recv` with `MSG_DONTWAIT`), so a blocking writer can share it.
pub(crate) struct NonBlocking<'a>(pub(crate) &'a std::os::unix::net::UnixStream);

impl Read for NonBlocking<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let (n, _) = rustix::net::recv(self.0, out, rustix::net::RecvFlags::DONTWAIT)?;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_through_a_chunked_reader() {
        let messages = vec![
            Message::Request(Request {
                seq: 1,
                op: RequestOp::Write {
                    remote_addr: 0x1000,
                    rkey: 7,
                    imm: Some(9),
                },
                solicited: true,
                ack: AckUrgency::Lazy,
                spans: vec![(0x2000, 16), (0x3000, 8)],
                inline: None,
            }),
            Message::Request(Request {
                seq: 2,
                op: RequestOp::Send { imm: None },
                solicited: false,
                ack: AckUrgency::Completion,
                spans: vec![],
                inline: Some(b"tiny".to_vec()),
            }),
            Message::Request(Request {
                seq: 3,
                op: RequestOp::CompareSwap {
                    remote_addr: 8,
                    rkey: 1,
                    compare: 2,
                    swap: 3,
                },
                solicited: false,
                ack: AckUrgency::Slots,
                spans: vec![(0x10, 8)],
                inline: None,
            }),
            Message::Response(Response {
                seq: 3,
                outcome: Outcome::AtomicAck(42),
            }),
            Message::Response(Response {
                seq: 4,
                outcome: Outcome::RnrNak,
            }),
        ];
        let mut bytes = Vec::new();
        for message in &messages {
            message.encode_into(&mut bytes);
        }
        // Feed one byte at a time.
        struct Dribble<'a>(&'a [u8]);
        impl Read for Dribble<'_> {
            fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
                if self.0.is_empty() {
                    return Ok(0);
                }
                out[0] = self.0[0];
                self.0 = &self.0[1..];
                Ok(1)
            }
        }
        let mut source = Dribble(&bytes);
        let mut reader = MessageReader::new();
        for expected in messages {
            match reader.read(&mut source).unwrap() {
                ReadOutcome::Message(message) => assert_eq!(message, expected),
                _ => panic!("expected a message"),
            }
        }
        assert!(matches!(
            reader.read(&mut source).unwrap(),
            ReadOutcome::Closed
        ));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(Message::decode(&[9, 9, 9]).is_err());
        assert!(Message::decode(&[REQUEST, 1]).is_err());
        assert!(Message::decode(&[]).is_err());
    }

    #[test]
    fn the_fuzz_entry_decodes_what_was_encoded_and_survives_garbage() {
        let mut bytes = Vec::new();
        Message::Response(Response {
            seq: 5,
            outcome: Outcome::Ack,
        })
        .encode_into(&mut bytes);
        assert_eq!(super::super::fuzz_wire(&bytes), 1);
        let mut state = 0x1234_5678u32;
        for _ in 0..2000 {
            let garbage: Vec<u8> = (0..64)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 17;
                    state ^= state << 5;
                    state as u8
                })
                .collect();
            super::super::fuzz_wire(&garbage);
        }
    }
}
