//! `tcp://host:port`: frames over TCP, each behind a 4-byte little-endian length.
//!
//! TCP_NODELAY is on (an RPC frame should leave now, not after Nagle's delay).
//! The length prefix is checked against the frame limit before the frame is
//! buffered, so an oversized announcement costs nothing but the close; on a
//! server, a frame's bytes are also reserved in the server's
//! [`ReceiveBudget`] before its buffer is allocated ([`FrameReader`]). Frames
//! are written without a copy ([`FrameWriter`]).

use std::collections::VecDeque;
use std::io::IoSlice;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures_core::Stream;
use futures_util::future::BoxFuture;
use futures_util::{FutureExt, Sink};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::LengthDelimitedCodec;
use tokio_util::io::poll_read_buf;

use super::{
    Connection, ConnectionBudget, Endpoint, Listener, ReceiveBudget, Reservation, Transport,
    TransportConfig, TransportError,
};
use crate::frame::{EncodedFrame, Frame, FrameError, HEADER_LEN};
use crate::payload::Payload;

/// Size of the length prefix in front of every frame.
pub const LENGTH_PREFIX_LEN: usize = 4;

/// The TCP transport (registered as `tcp`).
#[derive(Debug, Clone, Copy, Default)]
pub struct TcpTransport;

/// tcp://'s framing — `len: u32 LE`, then `len` bytes of frame — as tokio's
/// `LengthDelimitedCodec`, for tools and fuzzing. The transport itself reads
/// with [`FrameReader`], which does what the codec cannot: it reserves a
/// frame's bytes in the server's receive budget before it allocates them,
/// reads large frames into recycled buffers, and skips a frame over the limit
/// whole (its call is refused, the connection goes on) where the codec fails
/// the stream; it writes with [`FrameWriter`] (one `writev` per batch, the
/// payload's parts never copied).
pub fn length_prefix_codec(max_frame_len: usize) -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder()
        .little_endian()
        .length_field_type::<u32>()
        .max_frame_length(max_frame_len)
        .new_codec()
}

/// Bytes a connection reads ahead before it knows how long the next frame is.
/// Frames up to this size are assembled here and copied out; longer ones get
/// a buffer of their exact length once their bytes are reserved.
pub const READ_AHEAD: usize = 8 << 10;

/// Bytes buffered by [`FrameWriter`] before `poll_ready` flushes first.
const WRITE_HIGH_WATER: usize = 256 << 10;

/// Slices handed to one vectored write.
const MAX_IOV: usize = 64;

/// Reads length-prefixed frames from a byte stream.
///
/// Unlike a `FramedRead` with [`length_prefix_codec`], it allocates a frame's
/// buffer only after it reserved the frame's bytes in the server's
/// [`ReceiveBudget`] (when there is one), and at the frame's exact length; until
/// then it holds at most [`READ_AHEAD`] bytes. While it waits for the budget it
/// reads nothing, so the peer's sends stall on TCP's window. Each frame it
/// yields holds its reservation until the frame's last reference is dropped.
pub struct FrameReader<R> {
    io: R,
    staging: BytesMut,
    max_frame_len: usize,
    budget: Option<ConnectionBudget>,
    state: ReadState,
    eof: bool,
    done: bool,
    /// No frame read yet: its first bytes may be HTTP/2's preface.
    first: bool,
}

enum ReadState {
    /// Waiting for the 4-byte length.
    Prefix,
    /// Length known (and consumed); reserving its bytes.
    Reserve { len: usize },
    /// A frame of at most [`READ_AHEAD`] bytes, being assembled in `staging`.
    Small {
        len: usize,
        reservation: Option<Reservation>,
    },
    /// A larger frame, read straight into its own buffer.
    Large {
        buf: BytesMut,
        len: usize,
        reservation: Option<Reservation>,
    },
    /// A frame over the limit: its header is kept, the rest read and
    /// dropped as it comes (never more than [`READ_AHEAD`] held).
    Skip {
        head: BytesMut,
        len: usize,
        /// Bytes of the frame not read yet (header included).
        left: usize,
    },
}

impl<R> std::fmt::Debug for FrameReader<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameReader")
            .field("buffered", &self.staging.len())
            .field("max_frame_len", &self.max_frame_len)
            .finish_non_exhaustive()
    }
}

fn closed_inside_a_frame(received: usize) -> TransportError {
    TransportError::Io(std::io::Error::new(
        std::io::ErrorKind::UnexpectedEof,
        format!("connection closed inside a frame ({received} bytes of it received)"),
    ))
}

/// Bytes of HTTP/2's preface that name an HTTP/2 peer ("PRI * HTTP/2.0").
const PREFACE_CHECKED: usize = 14;

/// Why the first bytes of a frame over the limit (`head`, of a header of
/// `header_len` bytes) cannot begin a frame: an rdma:// hello, or anything
/// else (`TooLarge`, its lengths filled in by the caller); `None` while they
/// still can.
fn not_a_frame(head: &[u8], header_len: usize) -> Option<FrameError> {
    use crate::frame::{FrameKind, PROTOCOL_VERSION, RDMA_HELLO_MAGIC};
    let magic_len = head.len().min(RDMA_HELLO_MAGIC.len());
    if !head.is_empty() && head[..magic_len] == RDMA_HELLO_MAGIC[..magic_len] {
        return (magic_len == RDMA_HELLO_MAGIC.len()).then_some(FrameError::RdmaPeer);
    }
    if head
        .first()
        .is_some_and(|version| *version != PROTOCOL_VERSION)
        || head
            .get(1)
            .is_some_and(|kind| FrameKind::from_u8(*kind).is_none())
        || (head.len() == header_len && crate::frame::Frame::peek_header(head).is_none())
    {
        return Some(FrameError::TooLarge { len: 0, max: 0 });
    }
    None
}

fn with_reservation(frame: Bytes, reservation: Option<Reservation>) -> Bytes {
    match reservation {
        Some(reservation) => reservation.attach(frame),
        None => frame,
    }
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// Frames of at most `max_frame_len` bytes from `io`, reserved in `budget` if given.
    pub fn new(io: R, max_frame_len: usize, budget: Option<ConnectionBudget>) -> FrameReader<R> {
        FrameReader {
            io,
            staging: BytesMut::new(),
            max_frame_len,
            budget,
            state: ReadState::Prefix,
            eof: false,
            done: false,
            first: true,
        }
    }

    /// Reads more into `staging`, never beyond [`READ_AHEAD`] bytes in all.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), TransportError>> {
        let room = READ_AHEAD - self.staging.len();
        self.staging.reserve(room);
        let mut limited = (&mut self.staging).limit(room);
        let read = ready!(poll_read_buf(Pin::new(&mut self.io), cx, &mut limited))?;
        if read == 0 {
            self.eof = true;
        }
        Poll::Ready(Ok(()))
    }

    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, TransportError>>> {
        loop {
            match &mut self.state {
                ReadState::Prefix => {
                    // HTTP/2's preface read as a length is 541,676,112
                    // bytes ("PRI "): named before any limit is looked at.
                    // Only the connection's first frame: not a cost per frame.
                    let preface = &crate::frame::HTTP2_PREFACE[..PREFACE_CHECKED];
                    let seen = self.staging.len().min(PREFACE_CHECKED);
                    if self.first
                        && self.staging.len() >= LENGTH_PREFIX_LEN
                        && self.staging[..seen] == preface[..seen]
                    {
                        if seen == PREFACE_CHECKED {
                            return Poll::Ready(Some(Err(FrameError::Http2Peer.into())));
                        }
                        if !self.eof {
                            ready!(self.poll_fill(cx))?;
                            continue;
                        }
                    }
                    if self.staging.len() >= LENGTH_PREFIX_LEN {
                        self.first = false;
                        let len = self.staging.get_u32_le() as usize;
                        if len > self.max_frame_len {
                            self.state = ReadState::Skip {
                                head: BytesMut::new(),
                                len,
                                left: len,
                            };
                            continue;
                        }
                        self.state = ReadState::Reserve { len };
                    } else if self.eof {
                        return Poll::Ready(match self.staging.len() {
                            0 => None,
                            partial => Some(Err(closed_inside_a_frame(partial))),
                        });
                    } else {
                        ready!(self.poll_fill(cx))?;
                    }
                }
                ReadState::Reserve { len } => {
                    let len = *len;
                    if len > READ_AHEAD {
                        // A large frame's header first: one whose metadata
                        // is over the limit can only be refused, so it is
                        // skipped instead of held whole.
                        if self.staging.len() < HEADER_LEN {
                            if self.eof {
                                return Poll::Ready(Some(Err(closed_inside_a_frame(
                                    self.staging.len(),
                                ))));
                            }
                            ready!(self.poll_fill(cx))?;
                            continue;
                        }
                        if Frame::peek_metadata_excess(&self.staging[..HEADER_LEN]).is_some() {
                            self.state = ReadState::Skip {
                                head: BytesMut::new(),
                                len,
                                left: len,
                            };
                            continue;
                        }
                    }
                    let reservation = match &mut self.budget {
                        Some(budget) => Some(ready!(budget.poll_reserve(cx, len))?),
                        None => None,
                    };
                    self.state = if len <= READ_AHEAD {
                        ReadState::Small { len, reservation }
                    } else {
                        // A large frame is read into a recycled buffer: no
                        // fresh mapping (and its page faults) per frame.
                        let mut buf = crate::codec::recycle::take(len);
                        buf.extend_from_slice(&self.staging);
                        self.staging.clear();
                        ReadState::Large {
                            buf,
                            len,
                            reservation,
                        }
                    };
                }
                ReadState::Small { len, reservation } => {
                    let len = *len;
                    if self.staging.len() >= len {
                        let reservation = reservation.take();
                        let frame = Bytes::copy_from_slice(&self.staging[..len]);
                        self.staging.advance(len);
                        self.state = ReadState::Prefix;
                        return Poll::Ready(Some(Ok(with_reservation(frame, reservation))));
                    }
                    if self.eof {
                        return Poll::Ready(Some(Err(closed_inside_a_frame(self.staging.len()))));
                    }
                    ready!(self.poll_fill(cx))?;
                }
                ReadState::Large {
                    buf,
                    len,
                    reservation,
                } => {
                    let missing = *len - buf.len();
                    if missing == 0 {
                        let frame = crate::codec::recycle::into_bytes(std::mem::take(buf));
                        let reservation = reservation.take();
                        self.state = ReadState::Prefix;
                        return Poll::Ready(Some(Ok(with_reservation(frame, reservation))));
                    }
                    let mut limited = (&mut *buf).limit(missing);
                    let read = ready!(poll_read_buf(Pin::new(&mut self.io), cx, &mut limited))?;
                    if read == 0 {
                        self.eof = true;
                        return Poll::Ready(Some(Err(closed_inside_a_frame(buf.len()))));
                    }
                }
                ReadState::Skip { head, len, left } => {
                    let header_len = HEADER_LEN.min(*len);
                    let had_header = head.len() == header_len;
                    let take = self.staging.len().min(*left);
                    let keep = take.min(header_len - head.len());
                    head.extend_from_slice(&self.staging[..keep]);
                    self.staging.advance(take);
                    *left -= take;
                    if !had_header {
                        // Only what starts as a frame is skipped; anything
                        // else over the limit ends the connection as soon
                        // as its first bytes say so.
                        if let Some(error) = not_a_frame(head, header_len) {
                            let error = match error {
                                FrameError::TooLarge { .. } => FrameError::TooLarge {
                                    len: *len,
                                    max: self.max_frame_len,
                                },
                                other => other,
                            };
                            return Poll::Ready(Some(Err(error.into())));
                        }
                    }
                    if *left == 0 {
                        let (head, len) = (std::mem::take(head).freeze(), *len);
                        self.state = ReadState::Prefix;
                        let max = self.max_frame_len;
                        return Poll::Ready(Some(Err(TransportError::Refused { head, len, max })));
                    }
                    if self.eof {
                        let received = *len - *left;
                        return Poll::Ready(Some(Err(closed_inside_a_frame(received))));
                    }
                    ready!(self.poll_fill(cx))?;
                }
            }
        }
    }
}

impl<R: AsyncRead + Unpin> Stream for FrameReader<R> {
    type Item = Result<Bytes, TransportError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        let next = ready!(this.poll_frame(cx));
        // After an error or the end, the stream is over; a skipped frame
        // is not an error of the stream.
        if !matches!(next, Some(Ok(_) | Err(TransportError::Refused { .. }))) {
            this.done = true;
            this.staging = BytesMut::new();
            this.state = ReadState::Prefix;
        }
        Poll::Ready(next)
    }
}

/// Writes frames behind their length prefixes without copying them: a flush
/// hands the queued prefixes and frames to one vectored write after another.
pub struct FrameWriter<W> {
    io: W,
    queue: VecDeque<Outgoing>,
    buffered: usize,
}

struct Outgoing {
    prefix: [u8; LENGTH_PREFIX_LEN],
    /// Bytes of the prefix already written.
    prefix_sent: usize,
    /// What is left of the frame's head, then of its payload.
    head: Bytes,
    payload: Payload,
}

impl<W> std::fmt::Debug for FrameWriter<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameWriter")
            .field("queued_frames", &self.queue.len())
            .field("buffered", &self.buffered)
            .finish_non_exhaustive()
    }
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    /// A frame sink over `io`.
    pub fn new(io: W) -> FrameWriter<W> {
        FrameWriter {
            io,
            queue: VecDeque::new(),
            buffered: 0,
        }
    }

    fn poll_write_queue(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), TransportError>> {
        while !self.queue.is_empty() {
            let mut slices = [IoSlice::new(&[]); MAX_IOV];
            let mut count = 0;
            for outgoing in &self.queue {
                // A frame goes in only whole (its payload may be several parts).
                if count + 2 + outgoing.payload.part_count() > MAX_IOV && count > 0 {
                    break;
                }
                if outgoing.prefix_sent < LENGTH_PREFIX_LEN {
                    slices[count] = IoSlice::new(&outgoing.prefix[outgoing.prefix_sent..]);
                    count += 1;
                }
                if !outgoing.head.is_empty() {
                    slices[count] = IoSlice::new(&outgoing.head);
                    count += 1;
                }
                count += outgoing.payload.chunks_vectored(&mut slices[count..]);
            }
            let mut written =
                ready!(Pin::new(&mut self.io).poll_write_vectored(cx, &slices[..count]))?;
            if written == 0 {
                return Poll::Ready(Err(
                    std::io::Error::from(std::io::ErrorKind::WriteZero).into()
                ));
            }
            self.buffered -= written;
            while written > 0 {
                let front = self.queue.front_mut().expect("written bytes were queued");
                let prefix = (LENGTH_PREFIX_LEN - front.prefix_sent).min(written);
                front.prefix_sent += prefix;
                written -= prefix;
                let taken = front.head.len().min(written);
                front.head.advance(taken);
                written -= taken;
                let taken = front.payload.remaining().min(written);
                front.payload.advance(taken);
                written -= taken;
                if front.prefix_sent == LENGTH_PREFIX_LEN
                    && front.head.is_empty()
                    && front.payload.is_empty()
                {
                    self.queue.pop_front();
                }
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<W: AsyncWrite + Unpin> Sink<EncodedFrame> for FrameWriter<W> {
    type Error = TransportError;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), TransportError>> {
        let this = self.get_mut();
        if this.buffered >= WRITE_HIGH_WATER {
            ready!(this.poll_write_queue(cx))?;
        }
        Poll::Ready(Ok(()))
    }

    fn start_send(self: Pin<&mut Self>, frame: EncodedFrame) -> Result<(), TransportError> {
        let this = self.get_mut();
        let len = u32::try_from(frame.len()).map_err(|_| FrameError::TooLarge {
            len: frame.len(),
            max: u32::MAX as usize,
        })?;
        this.buffered += LENGTH_PREFIX_LEN + frame.len();
        this.queue.push_back(Outgoing {
            prefix: len.to_le_bytes(),
            prefix_sent: 0,
            head: frame.head,
            payload: frame.payload,
        });
        Ok(())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), TransportError>> {
        let this = self.get_mut();
        ready!(this.poll_write_queue(cx))?;
        Pin::new(&mut this.io).poll_flush(cx).map_err(Into::into)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), TransportError>> {
        let this = self.get_mut();
        ready!(this.poll_write_queue(cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx).map_err(Into::into)
    }
}

fn into_connection(
    stream: TcpStream,
    max_frame_len: usize,
    budget: Option<&ReceiveBudget>,
) -> Result<Connection, TransportError> {
    stream.set_nodelay(true)?;
    let peer = stream.peer_addr()?.to_string();
    let (read, write) = stream.into_split();
    Ok(framed_connection(read, write, peer, max_frame_len, budget))
}

/// A [`Connection`] of length-prefixed frames over a byte stream's halves:
/// what tcp:// runs over a socket (and tls:// inside TLS), for any other
/// stream too (a Unix socket, a simulated network's stream in tests). Frames
/// over `max_frame_len` are refused; `budget`, a server's, is where each
/// received frame is reserved before it is buffered.
pub fn framed_connection<R, W>(
    read: R,
    write: W,
    peer: String,
    max_frame_len: usize,
    budget: Option<&ReceiveBudget>,
) -> Connection
where
    R: AsyncRead + Send + Unpin + 'static,
    W: AsyncWrite + Send + Unpin + 'static,
{
    Connection {
        sink: Box::pin(FrameWriter::new(write)),
        stream: Box::pin(FrameReader::new(
            read,
            max_frame_len,
            budget.map(ReceiveBudget::connection),
        )),
        peer,
    }
}

impl Transport for TcpTransport {
    fn connect(
        &self,
        endpoint: &Endpoint,
        config: &TransportConfig,
    ) -> BoxFuture<'static, Result<Connection, TransportError>> {
        let authority = endpoint.authority().to_owned();
        let max = config.max_frame_len;
        async move {
            let stream = TcpStream::connect(&authority).await?;
            into_connection(stream, max, None)
        }
        .boxed()
    }

    fn bind(
        &self,
        endpoint: &Endpoint,
        config: &TransportConfig,
    ) -> BoxFuture<'static, Result<Box<dyn Listener>, TransportError>> {
        let authority = endpoint.authority().to_owned();
        let max_frame_len = config.max_frame_len;
        let budget = config.receive_budget.clone();
        async move {
            let listener = TcpListener::bind(&authority).await?;
            let local = Endpoint::new("tcp", &listener.local_addr()?.to_string())?;
            Ok(Box::new(TcpFrameListener {
                listener,
                local,
                max_frame_len,
                budget,
            }) as Box<dyn Listener>)
        }
        .boxed()
    }
}

struct TcpFrameListener {
    listener: TcpListener,
    local: Endpoint,
    max_frame_len: usize,
    budget: Option<ReceiveBudget>,
}

impl Stream for TcpFrameListener {
    type Item = Result<Connection, TransportError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        match this.listener.poll_accept(cx) {
            Poll::Ready(Ok((stream, _))) => Poll::Ready(Some(into_connection(
                stream,
                this.max_frame_len,
                this.budget.as_ref(),
            ))),
            Poll::Ready(Err(error)) => Poll::Ready(Some(Err(error.into()))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Listener for TcpFrameListener {
    fn local_endpoint(&self) -> Endpoint {
        self.local.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_codec_frames_as_the_transport_does() {
        use tokio_util::codec::{Decoder, Encoder};
        let mut codec = length_prefix_codec(8);
        let mut buf = BytesMut::new();
        codec.encode(Bytes::from_static(b"abc"), &mut buf).unwrap();
        assert_eq!(&buf[..LENGTH_PREFIX_LEN], &3u32.to_le_bytes());
        let mut partial = buf.split_to(5);
        assert!(codec.decode(&mut partial).unwrap().is_none());
        partial.unsplit(buf);
        assert_eq!(&codec.decode(&mut partial).unwrap().unwrap()[..], b"abc");

        let mut huge = BytesMut::new();
        huge.put_u32_le(9);
        assert!(codec.decode(&mut huge).is_err(), "over the limit");

        let mut cut = BytesMut::new();
        cut.put_u32_le(4);
        cut.put_u8(1);
        assert!(codec.decode_eof(&mut cut).is_err());
    }

    /// A gRPC client at a tcp:// port is named as such (the server logs it
    /// at WARN), before its preface is taken for a 516 MiB frame, whatever
    /// the frame limit.
    #[tokio::test]
    async fn an_http2_preface_is_named_as_a_grpc_client() {
        use futures_util::StreamExt;
        let mut bytes = crate::frame::HTTP2_PREFACE.to_vec();
        bytes.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
        for limit in [1 << 20, usize::MAX] {
            let mut reader = FrameReader::new(&bytes[..], limit, None);
            let error = reader.next().await.unwrap().unwrap_err();
            assert!(
                matches!(error, TransportError::Frame(FrameError::Http2Peer)),
                "{error}"
            );
            assert!(error.to_string().contains("listen on grpc://"), "{error}");
        }
        // Part of it, then the end: an ordinary short read.
        let mut reader = FrameReader::new(&bytes[..8], 1 << 20, None);
        assert!(reader.next().await.unwrap().is_err());
    }

    #[tokio::test]
    async fn reader_and_writer_carry_small_and_large_frames_and_reserve_before_buffering() {
        use futures_util::{SinkExt, StreamExt};
        use tokio::io::AsyncWriteExt;

        let budget = ReceiveBudget::new(1 << 20);
        let (client, server) = tokio::io::duplex(64 << 10);
        let (_, client_write) = tokio::io::split(client);
        let (server_read, _) = tokio::io::split(server);
        let mut writer = FrameWriter::new(client_write);
        let mut reader = FrameReader::new(server_read, 1 << 20, Some(budget.connection()));

        let small = Bytes::from_static(b"hello");
        let large = Bytes::from((0..300_000u32).map(|i| i as u8).collect::<Vec<u8>>());
        let sending = tokio::spawn(async move {
            writer.feed(small.into()).await.unwrap();
            writer.feed(Bytes::new().into()).await.unwrap();
            // In parts, as `Frame::encode_parts` makes them: one frame on the wire.
            let parts = EncodedFrame {
                head: large.slice(..1000),
                payload: Payload::from_parts([large.slice(1000..5000), large.slice(5000..)]),
            };
            writer.feed(parts).await.unwrap();
            writer.flush().await.unwrap();
            writer
        });
        assert_eq!(&reader.next().await.unwrap().unwrap()[..], b"hello");
        assert!(reader.next().await.unwrap().unwrap().is_empty());
        let received = reader.next().await.unwrap().unwrap();
        assert_eq!(received.len(), 300_000);
        assert!(received.iter().enumerate().all(|(i, b)| *b == i as u8));
        assert_eq!(budget.in_use(), 300_000, "the frame holds its reservation");
        drop(received);
        assert_eq!(budget.in_use(), 0);

        // A frame announced but cut short by the end of the stream.
        let writer = sending.await.unwrap();
        let mut raw = writer.io;
        raw.write_all(&100u32.to_le_bytes()).await.unwrap();
        raw.write_all(&[1u8; 10]).await.unwrap();
        raw.shutdown().await.unwrap();
        let error = reader.next().await.unwrap().unwrap_err();
        assert!(
            error.to_string().contains("closed inside a frame"),
            "{error}"
        );
        assert!(reader.next().await.is_none());
        assert_eq!(budget.in_use(), 0);
    }

    #[tokio::test]
    async fn reader_waits_for_the_budget_before_reading_a_large_frame() {
        use futures_util::StreamExt;
        use tokio::io::AsyncWriteExt;

        let budget = ReceiveBudget::new(100_000);
        let mut holder = budget.connection();
        let held = holder.reserve(90_000).await.unwrap();
        let (mut client, server) = tokio::io::duplex(1 << 20);
        let mut reader = FrameReader::new(server, 1 << 20, Some(budget.connection()));
        client.write_all(&50_000u32.to_le_bytes()).await.unwrap();
        client.write_all(&[9u8; 50_000]).await.unwrap();
        let waiting = futures_util::poll!(reader.next());
        assert!(waiting.is_pending(), "no room: the frame waits");
        drop(held);
        let frame = reader.next().await.unwrap().unwrap();
        assert_eq!(frame.len(), 50_000);
        assert_eq!(budget.in_use(), 50_000);

        // A frame over the limit is skipped without a reservation: its
        // header comes up, its bytes are dropped as they arrive, and the
        // next frame reads as usual.
        drop(frame);
        let big = crate::frame::Frame::request(
            7,
            "/a.B/C",
            None,
            crate::metadata::Metadata::new(),
            Bytes::from(vec![5u8; 2 << 20]),
        )
        .encode();
        let big_len = big.len();
        let writer = tokio::spawn(async move {
            client
                .write_all(&(big.len() as u32).to_le_bytes())
                .await
                .unwrap();
            client.write_all(&big).await.unwrap();
            client.write_all(&3u32.to_le_bytes()).await.unwrap();
            client.write_all(b"abc").await.unwrap();
            client
        });
        match reader.next().await.unwrap() {
            Err(TransportError::Refused { head, len, max }) => {
                assert_eq!((len, max), (big_len, 1 << 20));
                assert_eq!(head.len(), crate::frame::HEADER_LEN);
                assert_eq!(
                    crate::frame::Frame::peek_header(&head),
                    Some((crate::frame::FrameKind::Request, 7))
                );
            }
            other => panic!("expected a skipped frame, got {other:?}"),
        }
        assert_eq!(budget.in_use(), 0, "nothing reserved for a skipped frame");
        assert_eq!(&reader.next().await.unwrap().unwrap()[..], b"abc");
        drop(writer.await.unwrap());
    }

    /// A large frame whose header announces metadata over the limit is
    /// skipped as it arrives (it can only be refused): nothing is reserved
    /// or held for it, though it is within the frame limit, and the next
    /// frame reads as usual. (Held whole, it would wait here for a budget
    /// that cannot take it.)
    #[tokio::test]
    async fn a_frame_announcing_metadata_over_the_limit_is_skipped_not_held() {
        use futures_util::StreamExt;
        use tokio::io::AsyncWriteExt;

        let budget = ReceiveBudget::new(1 << 20);
        let (mut client, server) = tokio::io::duplex(1 << 20);
        let mut reader = FrameReader::new(server, 64 << 20, Some(budget.connection()));
        let metadata_len = 4 << 20;
        let mut frame = crate::frame::Frame::request(
            9,
            "/a.B/C",
            None,
            crate::metadata::Metadata::new(),
            Bytes::new(),
        )
        .encode()
        .to_vec();
        frame[28..32].copy_from_slice(&(metadata_len as u32).to_le_bytes());
        frame.resize(frame.len() + metadata_len, 1);
        let frame_len = frame.len();
        let writer = tokio::spawn(async move {
            client
                .write_all(&(frame_len as u32).to_le_bytes())
                .await
                .unwrap();
            client.write_all(&frame).await.unwrap();
            client.write_all(&3u32.to_le_bytes()).await.unwrap();
            client.write_all(b"xyz").await.unwrap();
            client
        });
        let first = tokio::time::timeout(std::time::Duration::from_secs(10), reader.next())
            .await
            .expect("not waiting for room to hold it");
        match first.unwrap() {
            Err(TransportError::Refused { head, len, .. }) => {
                assert_eq!(len, frame_len);
                assert!(matches!(
                    crate::frame::Frame::peek_metadata_excess(&head),
                    Some(crate::metadata::MetadataOverLimit::Bytes { len, .. }) if len == metadata_len
                ));
            }
            other => panic!("expected a skipped frame, got {other:?}"),
        }
        assert_eq!(budget.in_use(), 0, "nothing reserved for it");
        assert_eq!(&reader.next().await.unwrap().unwrap()[..], b"xyz");
        drop(writer.await.unwrap());
    }
}
