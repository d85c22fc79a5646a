//! Streaming calls: each direction of a stream is a sequence of message
//! frames under a window of bytes, then an end.
//!
//! The pieces, one per side of one direction:
//!
//! - the **receiver** keeps a queue (`InboundFeed`) that the connection's reader
//!   pushes messages into (never waiting: a message beyond the window is a
//!   protocol error, so the queue never holds more than the window), and the
//!   application reads it as a [`Streaming<T>`]. What the application takes
//!   frees window; every [`GRANT_AT`] bytes of it go back to the sender in
//!   one `WINDOW` frame.
//! - the **sender** writes through a [`MessageSink`]: it takes the messages
//!   that are ready at once (up to [`BATCH_BYTES`]) into one `MESSAGE` frame,
//!   waiting for window, then for room in the connection's outbound queue.
//!   A slow consumer therefore holds at most [`INITIAL_WINDOW`] bytes of a
//!   stream (plus one message, when a single message is larger), and the
//!   producer waits.
//!
//! Each message costs the window its length plus [`MESSAGE_CHARGE`], so
//! many tiny messages are bounded too. Frames of all streams and unary
//! calls of a connection share its transport in order, so on rdma:// a
//! stream's frames are ordinary frames under the connection's receive
//! credits.

use std::any::Any;
use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::{Buf, BufMut, Bytes};
use futures_core::Stream;
use futures_util::future::BoxFuture;
use futures_util::{FutureExt, StreamExt};

use crate::codec::{Codec, PayloadBuf};
use crate::conn_io::OutboundQueue;
use crate::frame::{Frame, HEADER_LEN};
use crate::metadata::Metadata;
use crate::payload::Payload;
use crate::request::Request;
use crate::status::Status;

/// Bytes a stream's sender may have sent beyond what the receiver granted
/// back: the window each direction of every stream starts with (both sides
/// know it, so it is never sent). A message that does not fit may still go
/// while less than [`GRANT_AT`] is outstanding: that is the most a receiver
/// that took everything keeps ungranted, so a message of any size (up to
/// the frame limit) always goes eventually.
pub const INITIAL_WINDOW: u32 = 4 << 20;

/// What a message costs the window beyond its length.
pub const MESSAGE_CHARGE: u32 = 64;

/// Bytes the application takes before the receiver grants them back in
/// one `WINDOW` frame.
pub const GRANT_AT: u32 = INITIAL_WINDOW / 4;

/// Messages ready together share one `MESSAGE` frame up to this many bytes
/// (so that the frame stays under rdma://'s default eager threshold of
/// 8 KiB and goes in one SEND); a larger message is a frame of its own.
pub const BATCH_BYTES: usize = (8 << 10) - HEADER_LEN;

/// Bytes of the length before each message in a `MESSAGE` frame.
const LENGTH_PREFIX: usize = 4;

/// What a message of `len` bytes costs the window.
fn charge(len: usize) -> u64 {
    len as u64 + u64::from(MESSAGE_CHARGE)
}

/// How a direction of a stream ended: its trailing metadata, or an error.
pub(crate) type StreamEnd = Result<Metadata, Status>;

/// Why the reader could not take a frame of messages for a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FeedError {
    /// The peer sent more than it was granted.
    WindowExceeded,
    /// The peer sent a message after it ended its direction.
    AfterEnd,
    /// The frame's payload is not a sequence of length-prefixed messages.
    Malformed,
}

impl FeedError {
    pub(crate) fn describe(self) -> &'static str {
        match self {
            FeedError::WindowExceeded => "messages beyond the stream's window",
            FeedError::AfterEnd => "a message after the end of its stream",
            FeedError::Malformed => {
                "a message frame that is not a sequence of length-prefixed messages"
            }
        }
    }
}

/// The next message of a `MESSAGE` frame's payload (a `u32` length, then
/// that many bytes): `Ok(None)` at its end, `Err` when malformed.
fn next_message(payload: &mut Bytes) -> Result<Option<Bytes>, FeedError> {
    if !payload.has_remaining() {
        return Ok(None);
    }
    if payload.len() < LENGTH_PREFIX {
        return Err(FeedError::Malformed);
    }
    let len = payload.get_u32_le() as usize;
    if len > payload.len() {
        return Err(FeedError::Malformed);
    }
    Ok(Some(payload.split_to(len)))
}

/// The payload of a `MESSAGE` frame that carries one message.
pub(crate) fn single_message(message: Payload) -> Payload {
    let len = u32::try_from(message.len()).unwrap_or(u32::MAX);
    let mut payload = Payload::from(Bytes::copy_from_slice(&len.to_le_bytes()));
    for part in message.parts() {
        payload.push(part.clone());
    }
    payload
}

#[derive(Default)]
struct InboundState {
    messages: VecDeque<Bytes>,
    /// Set when the direction ended (its last messages may still be queued),
    /// by the peer or here (an error, the call's end).
    end: Option<StreamEnd>,
    /// The peer ended its direction: anything more from it breaks the protocol.
    peer_ended: bool,
    /// The end was handed to the application.
    done: bool,
    /// Trailers of a stream that ended well, once the application saw its end.
    trailers: Option<Metadata>,
    waker: Option<Waker>,
    /// Window the peer used, in all.
    received: u64,
    /// Window the peer may use, in all: the initial window plus grants.
    allowed: u64,
}

fn lock(state: &Mutex<InboundState>) -> MutexGuard<'_, InboundState> {
    state.lock().unwrap_or_else(|poison| poison.into_inner())
}

/// The connection reader's end of one stream direction.
#[derive(Clone)]
pub(crate) struct InboundFeed {
    state: Arc<Mutex<InboundState>>,
}

impl InboundFeed {
    pub(crate) fn new() -> InboundFeed {
        InboundFeed {
            state: Arc::new(Mutex::new(InboundState {
                allowed: u64::from(INITIAL_WINDOW),
                ..InboundState::default()
            })),
        }
    }

    /// Whether anything besides this handle reads the feed.
    pub(crate) fn is_shared(&self) -> bool {
        Arc::strong_count(&self.state) > 1
    }

    /// Queues the messages of a `MESSAGE` frame's payload; never waits.
    /// Messages for a direction that already ended here (with an error)
    /// are dropped.
    pub(crate) fn push(&self, mut payload: Bytes) -> Result<(), FeedError> {
        if payload.is_empty() {
            return Err(FeedError::Malformed);
        }
        let waker = {
            let mut state = lock(&self.state);
            if state.peer_ended {
                return Err(FeedError::AfterEnd);
            }
            // Checked one by one as they are split off: a frame of many tiny
            // messages fails at the first one beyond the window.
            while let Some(message) = next_message(&mut payload)? {
                let cost = charge(message.len());
                // Within the window, or with less than GRANT_AT outstanding
                // (see INITIAL_WINDOW).
                let granted = state.allowed - u64::from(INITIAL_WINDOW);
                let outstanding = state.received.saturating_sub(granted);
                if outstanding >= u64::from(GRANT_AT) && state.received + cost > state.allowed {
                    return Err(FeedError::WindowExceeded);
                }
                state.received += cost;
                if state.end.is_none() {
                    state.messages.push_back(message);
                }
            }
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
        Ok(())
    }

    /// The peer ended its direction well; `Err` when it had already.
    pub(crate) fn peer_end(&self, trailers: Metadata) -> Result<(), FeedError> {
        {
            let mut state = lock(&self.state);
            if state.peer_ended {
                return Err(FeedError::AfterEnd);
            }
            state.peer_ended = true;
        }
        self.finish(Ok(trailers));
        Ok(())
    }

    /// Ends the direction (the first end counts; later ones are ignored).
    /// Returns false when it had already ended.
    pub(crate) fn finish(&self, end: StreamEnd) -> bool {
        let waker = {
            let mut state = lock(&self.state);
            if state.end.is_some() {
                return false;
            }
            state.end = Some(end);
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
        true
    }
}

/// The sending side's view of one stream direction's window, without I/O:
/// what it sent, what the receiver allows, and whether a message may go
/// now. rdma-rpc's own streams keep one per direction; a gateway that feeds
/// messages into rdma-rpc (the gRPC one, say) keeps one to send exactly what
/// the receiver accepts.
#[derive(Debug, Clone)]
pub struct SendWindow {
    /// Window used, in all.
    sent: u64,
    /// Window the peer allows, in all: the initial window plus its grants.
    allowed: u64,
}

impl Default for SendWindow {
    fn default() -> Self {
        SendWindow::new()
    }
}

impl SendWindow {
    /// A stream's window before any grant: [`INITIAL_WINDOW`].
    pub fn new() -> SendWindow {
        SendWindow {
            sent: 0,
            allowed: u64::from(INITIAL_WINDOW),
        }
    }

    /// What a message of `len` bytes costs the window (its length plus
    /// [`MESSAGE_CHARGE`]).
    pub fn cost(len: usize) -> u64 {
        charge(len)
    }

    /// The receiver granted `grant` more bytes.
    pub fn grant(&mut self, grant: u32) {
        self.allowed = self.allowed.saturating_add(u64::from(grant));
    }

    /// Whether a message costing `cost` may go now: it fits, or less than
    /// [`GRANT_AT`] is outstanding (see [`INITIAL_WINDOW`]).
    pub fn fits(&self, cost: u64) -> bool {
        self.fits_after(0, cost)
    }

    /// [`fits`](Self::fits) after `pending` more not yet consumed.
    fn fits_after(&self, pending: u64, cost: u64) -> bool {
        let sent = self.sent + pending;
        let granted = self.allowed.saturating_sub(u64::from(INITIAL_WINDOW));
        sent + cost <= self.allowed || sent.saturating_sub(granted) < u64::from(GRANT_AT)
    }

    /// A message costing `cost` went.
    pub fn consume(&mut self, cost: u64) {
        self.sent += cost;
    }
}

#[derive(Default)]
struct CreditState {
    window: SendWindow,
    /// Why nothing more may be sent: the call ended.
    closed: Option<Status>,
    waker: Option<Waker>,
}

impl CreditState {
    fn fits(&self, pending: u64, cost: u64) -> bool {
        self.window.fits_after(pending, cost)
    }
}

/// The window of a stream's sending direction.
pub(crate) struct SendCredits {
    state: Mutex<CreditState>,
}

impl SendCredits {
    pub(crate) fn new() -> Arc<SendCredits> {
        Arc::new(SendCredits {
            state: Mutex::new(CreditState::default()),
        })
    }

    fn state(&self) -> MutexGuard<'_, CreditState> {
        self.state
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// The peer granted `grant` more bytes of window.
    pub(crate) fn grant(&self, grant: u32) {
        let waker = {
            let mut state = self.state();
            state.window.grant(grant);
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// The call ended: every wait for window now fails with `status`.
    pub(crate) fn close(&self, status: Status) {
        let waker = {
            let mut state = self.state();
            if state.closed.is_none() {
                state.closed = Some(status);
            }
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    fn poll_room(&self, cx: &mut Context<'_>, cost: u64) -> Poll<Result<(), Status>> {
        let mut state = self.state();
        if let Some(status) = &state.closed {
            return Poll::Ready(Err(status.clone()));
        }
        if state.fits(0, cost) {
            return Poll::Ready(Ok(()));
        }
        state.waker = Some(cx.waker().clone());
        Poll::Pending
    }

    /// Whether `cost` more fits now, after `pending` not yet consumed.
    fn has_room(&self, pending: u64, cost: u64) -> bool {
        self.state().fits(pending, cost)
    }

    fn consume(&self, cost: u64) {
        self.state().window.consume(cost);
    }

    fn closed(&self) -> Option<Status> {
        self.state().closed.clone()
    }
}

/// The application's end of one stream direction, as raw message bytes.
pub(crate) struct RawInbound {
    state: Arc<Mutex<InboundState>>,
    /// Messages taken from the shared queue at once, one lock per batch.
    local: VecDeque<Bytes>,
    /// Window taken by the application and not yet granted back.
    ungranted: u64,
    call_id: u64,
    /// Where grants go.
    outbound: OutboundQueue,
    /// Held while the application holds the stream; dropping it cancels the
    /// call if it is still going (client side).
    guard: Option<Box<dyn Any + Send>>,
    /// When the call's deadline passes (client side).
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    budget: std::time::Duration,
}

impl RawInbound {
    pub(crate) fn new(feed: &InboundFeed, call_id: u64, outbound: OutboundQueue) -> RawInbound {
        RawInbound {
            state: feed.state.clone(),
            local: VecDeque::new(),
            ungranted: 0,
            call_id,
            outbound,
            guard: None,
            deadline: None,
            budget: std::time::Duration::ZERO,
        }
    }

    /// Keeps `guard` alive as long as this end is (and drops it when the
    /// deadline passes).
    pub(crate) fn set_guard(&mut self, guard: Box<dyn Any + Send>) {
        self.guard = Some(guard);
    }

    /// Ends the stream with `DeadlineExceeded` at `deadline`.
    pub(crate) fn set_deadline(
        &mut self,
        deadline: tokio::time::Instant,
        budget: std::time::Duration,
    ) {
        self.deadline = Some(Box::pin(tokio::time::sleep_until(deadline)));
        self.budget = budget;
    }

    /// Gives taken window back once enough of it gathered.
    fn grant(&mut self, taken: usize) {
        self.ungranted += charge(taken);
        if self.ungranted < u64::from(GRANT_AT) {
            return;
        }
        let grant = u32::try_from(self.ungranted).unwrap_or(u32::MAX);
        {
            let mut state = lock(&self.state);
            // Grants only matter while the peer may still send.
            if state.end.is_some() {
                return;
            }
            state.allowed += u64::from(grant);
        }
        self.ungranted -= u64::from(grant);
        // One per GRANT_AT bytes taken: bounded by what the peer sent.
        let _ = self
            .outbound
            .send_unbounded(Frame::window(self.call_id, grant).encode_parts());
    }

    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, Status>>> {
        if let Some(message) = self.local.pop_front() {
            self.grant(message.len());
            return Poll::Ready(Some(Ok(message)));
        }
        // Once per batch, not per message: a producer that never lets the
        // queue run dry cannot outrun the deadline.
        if let Some(expired) = self.poll_deadline(cx) {
            return Poll::Ready(Some(Err(expired)));
        }
        let mut state = lock(&self.state);
        if state.done {
            return Poll::Ready(None);
        }
        std::mem::swap(&mut self.local, &mut state.messages);
        if let Some(message) = self.local.pop_front() {
            drop(state);
            self.grant(message.len());
            return Poll::Ready(Some(Ok(message)));
        }
        if let Some(end) = state.end.take() {
            state.done = true;
            state.waker = None;
            let item = match end {
                Ok(trailers) => {
                    state.trailers = Some(trailers);
                    None
                }
                Err(status) => Some(Err(status)),
            };
            drop(state);
            // The call is over: no deadline to watch.
            self.deadline = None;
            return Poll::Ready(item);
        }
        state.waker = Some(cx.waker().clone());
        drop(state);
        Poll::Pending
    }

    /// Ends the stream with `DeadlineExceeded` once the deadline passed
    /// (and registers for it otherwise).
    fn poll_deadline(&mut self, cx: &mut Context<'_>) -> Option<Status> {
        let deadline = self.deadline.as_mut()?;
        if deadline.as_mut().poll(cx).is_pending() {
            return None;
        }
        self.deadline = None;
        let status = Status::deadline_exceeded(format!("deadline of {:?} exceeded", self.budget));
        self.local.clear();
        {
            let mut state = lock(&self.state);
            if state.done {
                return None;
            }
            state.done = true;
            // Ended: what the peer still sends is dropped.
            state.end = Some(Err(status.clone()));
            state.messages.clear();
            state.waker = None;
        }
        // Cancels the call on the server.
        self.guard = None;
        Some(status)
    }

    fn trailers(&self) -> Option<Metadata> {
        lock(&self.state).trailers.clone()
    }
}

/// A stream of messages from the peer: the responses of a server- or
/// bidirectional-streaming call on the client, the requests of a client- or
/// bidirectional-streaming call in a server handler.
///
/// It yields each message in order, then ends: with `None` when the peer
/// ended the stream well, or with one `Err(status)` (the call's error, a
/// lost connection as `Unavailable`, the deadline as `DeadlineExceeded`).
/// Taking messages is what lets the peer send more: a consumer that stops
/// reading holds at most [`INITIAL_WINDOW`] bytes of them (each counted with
/// [`MESSAGE_CHARGE`]; see there for a message larger than the window).
///
/// On the client, dropping it before its end cancels the call: the server's
/// handler is aborted.
pub struct Streaming<T> {
    inbound: Inbound,
    decode: Box<dyn FnMut(Bytes) -> Result<T, Status> + Send>,
}

/// Where a [`Streaming`]'s messages come from.
enum Inbound {
    /// A stream of rpc-core's own frames.
    Frames(RawInbound),
    /// A front end's messages ([`Streaming::from_messages`],
    /// [`Streaming::from_response`]), with the trailers of a response.
    Messages(
        Pin<Box<dyn Stream<Item = Result<Bytes, Status>> + Send>>,
        Option<Arc<std::sync::OnceLock<Metadata>>>,
    ),
}

impl Inbound {
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, Status>>> {
        match self {
            Inbound::Frames(inbound) => inbound.poll_next(cx),
            Inbound::Messages(messages, _) => messages.as_mut().poll_next(cx),
        }
    }
}

impl<T> fmt::Debug for Streaming<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("Streaming");
        if let Inbound::Frames(inbound) = &self.inbound {
            debug.field("call_id", &inbound.call_id);
        }
        debug.finish_non_exhaustive()
    }
}

impl Streaming<Bytes> {
    /// The messages of a call that a front end (gRPC's HTTP/2, say) brought
    /// to the server itself ([`crate::server::front_end`]): each item one
    /// encoded message, an `Err` the end of the stream with that status.
    /// The front end applies its own flow control: what it has not yielded
    /// yet is what the client may not send more than its window of.
    pub fn from_messages(
        messages: impl Stream<Item = Result<Bytes, Status>> + Send + 'static,
    ) -> Streaming<Bytes> {
        Streaming {
            inbound: Inbound::Messages(Box::pin(messages.fuse()), None),
            decode: Box::new(Ok),
        }
    }

    /// The response messages of a call a client front end made
    /// ([`crate::client::front_end`]): as [`Streaming::from_messages`], and
    /// [`Streaming::trailers`] gives what the front end puts in `trailers`
    /// when the stream has ended well. Dropping it before its end should
    /// cancel the call (the front end's stream sees to that).
    pub fn from_response(
        messages: impl Stream<Item = Result<Bytes, Status>> + Send + 'static,
        trailers: Arc<std::sync::OnceLock<Metadata>>,
    ) -> Streaming<Bytes> {
        Streaming {
            inbound: Inbound::Messages(Box::pin(messages.fuse()), Some(trailers)),
            decode: Box::new(Ok),
        }
    }
}

impl<T> Streaming<T> {
    pub(crate) fn new(
        inbound: RawInbound,
        decode: impl FnMut(Bytes) -> Result<T, Status> + Send + 'static,
    ) -> Streaming<T> {
        Streaming {
            inbound: Inbound::Frames(inbound),
            decode: Box::new(decode),
        }
    }

    /// The next message; `Ok(None)` once the stream ended well.
    pub async fn message(&mut self) -> Result<Option<T>, Status> {
        match futures_util::StreamExt::next(self).await {
            Some(Ok(message)) => Ok(Some(message)),
            Some(Err(status)) => Err(status),
            None => Ok(None),
        }
    }

    /// The trailing metadata the server sent with its final status; `Some`
    /// once the stream has ended well (on the client side).
    pub fn trailers(&self) -> Option<Metadata> {
        match &self.inbound {
            Inbound::Frames(inbound) => inbound.trailers(),
            Inbound::Messages(_, trailers) => trailers.as_ref().and_then(|t| t.get().cloned()),
        }
    }

    /// Ends the stream with `DeadlineExceeded` at `deadline` (a front end's
    /// response stream; rpc-core's own carry their deadline already):
    /// the front end's stream is dropped then, which cancels the call.
    pub(crate) fn with_deadline(
        mut self,
        deadline: tokio::time::Instant,
        budget: std::time::Duration,
    ) -> Streaming<T> {
        if let Inbound::Messages(messages, trailers) = self.inbound {
            let mut messages = Some(messages);
            let mut expiry = Box::pin(tokio::time::sleep_until(deadline));
            let bounded = futures_util::stream::poll_fn(move |cx| {
                let Some(inner) = messages.as_mut() else {
                    return Poll::Ready(None);
                };
                if expiry.as_mut().poll(cx).is_ready() {
                    messages = None;
                    return Poll::Ready(Some(Err(Status::deadline_exceeded(format!(
                        "deadline of {budget:?} exceeded"
                    )))));
                }
                let next = inner.as_mut().poll_next(cx);
                if matches!(next, Poll::Ready(None)) {
                    messages = None;
                }
                next
            });
            self.inbound = Inbound::Messages(Box::pin(bounded), trailers);
        }
        self
    }

    /// The stream of raw messages `self` is (as rpc-core's and front ends'
    /// streams are made), decoded with `decode` instead.
    pub(crate) fn decoded_with<U>(
        self,
        decode: impl FnMut(Bytes) -> Result<U, Status> + Send + 'static,
    ) -> Streaming<U> {
        Streaming {
            inbound: self.inbound,
            decode: Box::new(decode),
        }
    }

    /// The same stream, decoded with `decode`.
    pub fn map_decoder<U>(
        self,
        mut decode: impl FnMut(T) -> Result<U, Status> + Send + 'static,
    ) -> Streaming<U>
    where
        T: 'static,
    {
        let mut inner = self.decode;
        Streaming {
            inbound: self.inbound,
            decode: Box::new(move |bytes| inner(bytes).and_then(&mut decode)),
        }
    }
}

impl<T> Unpin for Streaming<T> {}

impl<T> Stream for Streaming<T> {
    type Item = Result<T, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        match this.inbound.poll_next(cx) {
            Poll::Ready(Some(Ok(bytes))) => Poll::Ready(Some((this.decode)(bytes))),
            Poll::Ready(Some(Err(status))) => Poll::Ready(Some(Err(status))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// The sending half of a streaming call: a server handler's responses (see
/// [`ServerStream`]), or, inside the client, its requests.
pub struct MessageSink {
    inner: SinkInner,
}

enum SinkInner {
    /// rpc-core's own frames, on one of its connections.
    Frames(FramesSink),
    /// A front end's writer ([`MessageSink::from_target`]).
    Target(TargetSink),
}

impl fmt::Debug for MessageSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("MessageSink");
        if let SinkInner::Frames(sink) = &self.inner {
            debug.field("call_id", &sink.call_id);
        }
        debug.finish_non_exhaustive()
    }
}

/// Where a front end's call sends its response metadata and messages
/// ([`MessageSink::from_target`]): gRPC's gateway writes them into the
/// HTTP/2 stream under HTTP/2's flow control. The shape is a `Sink` of
/// messages with the metadata before them.
pub trait MessageTarget: Send + 'static {
    /// Sends the response metadata (once, before any message).
    fn send_headers(&mut self, metadata: Metadata) -> Result<(), Status>;
    /// Ready when the target takes another message; it should hold few
    /// (bounded in bytes) before it has pushed the earlier ones out.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>>;
    /// Takes one encoded message, after `poll_ready` said `Ready(Ok)`.
    fn start_send(&mut self, message: Payload) -> Result<(), Status>;
    /// Ready once everything taken has gone to the peer's side (what the
    /// peer's flow control lets go).
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>>;

    /// How the target frames a message, when it takes messages framed by
    /// the sink ([`MessageTarget::start_send_framed`]): a function that
    /// writes the prefix of a message of the given length. The sink then
    /// encodes the messages that are ready together straight into one
    /// buffer behind their prefixes (one hand-over, no copy per message).
    /// `None` (the default; also for a target that must see each message
    /// alone, to compress it): one [`MessageTarget::start_send`] each.
    fn framing(&mut self) -> Option<fn(usize, &mut PayloadBuf)> {
        None
    }

    /// Takes messages framed as [`MessageTarget::framing`] said, after
    /// `poll_ready` said `Ready(Ok)`.
    fn start_send_framed(&mut self, framed: Payload) -> Result<(), Status> {
        let _ = framed;
        Err(Status::internal(
            "this message target frames its messages itself",
        ))
    }

    /// No message follows (a client's half-close), called after the last
    /// [`MessageTarget::poll_flush`] of a client front end's request stream
    /// ([`OutgoingMessages::send_to`]). The default does nothing.
    fn close(&mut self) -> Result<(), Status> {
        Ok(())
    }
}

/// Bytes of ready messages a [`MessageTarget`] gets framed together.
const FRAMED_BATCH: usize = 32 << 10;

/// Bytes counted per message for its prefix in a framed batch (gRPC's
/// length prefix): a batch of empty messages ends too.
const FRAMED_PREFIX_COUNTED: usize = 5;

/// A [`MessageSink`] over a [`MessageTarget`].
struct TargetSink {
    target: Box<dyn MessageTarget>,
    max_message: usize,
    headers_sent: bool,
}

impl TargetSink {
    fn start(&mut self) -> Result<(), Status> {
        if !self.headers_sent {
            self.headers_sent = true;
            self.target.send_headers(Metadata::new())?;
        }
        Ok(())
    }

    async fn put(&mut self, message: Payload) -> Result<(), Status> {
        if message.len() > self.max_message {
            return Err(Status::resource_exhausted(format!(
                "stream message of {} bytes exceeds the limit of {} bytes",
                message.len(),
                self.max_message
            )));
        }
        self.start()?;
        std::future::poll_fn(|cx| self.target.poll_ready(cx)).await?;
        self.target.start_send(message)
    }

    async fn flush(&mut self) -> Result<(), Status> {
        std::future::poll_fn(|cx| self.target.poll_flush(cx)).await
    }

    fn check_len(&self, len: usize) -> Result<(), Status> {
        check_message_len(len, self.max_message)
    }

    async fn send_encoded<C, S>(&mut self, messages: S, mut codec: C) -> Result<(), Status>
    where
        C: Codec,
        S: Stream<Item = Result<C::Encode, Status>>,
    {
        let mut messages = std::pin::pin!(messages);
        let mut held: Option<Prepared<C::Encode>> = None;
        let mut ended = false;
        while !ended {
            // What is ready goes together; the target flushes only when
            // the producer has nothing more at once.
            let first = match held.take() {
                Some(first) => first,
                None => {
                    let next = match messages.next().now_or_never() {
                        Some(next) => next,
                        None => {
                            self.flush().await?;
                            messages.next().await
                        }
                    };
                    match next {
                        None => break,
                        Some(Err(status)) => {
                            self.flush().await?;
                            return Err(status);
                        }
                        Some(Ok(item)) => Prepared::new(&mut codec, item)?,
                    }
                }
            };
            // A producer that never waits gives its worker back now and
            // then (a front end's connection shares its task).
            tokio::task::consume_budget().await;
            self.check_len(first.len())?;
            self.start()?;
            std::future::poll_fn(|cx| self.target.poll_ready(cx)).await?;
            let Some(prefix) = self.target.framing() else {
                let message = match first {
                    Prepared::Typed(item, _) => codec.encode_payload(item)?,
                    Prepared::Encoded(payload) => payload,
                };
                self.target.start_send(message)?;
                continue;
            };
            let mut bytes = FRAMED_PREFIX_COUNTED + first.len();
            let mut batch = PayloadBuf::with_len_hint(bytes.min(FRAMED_BATCH) + 16);
            first.write_with(&mut codec, &mut batch, prefix)?;
            let mut failure = None;
            // More that are ready now, as far as the batch goes.
            let max_message = self.max_message;
            let stop = fill_batch(messages.as_mut(), &mut codec, &mut batch, prefix, |len| {
                if bytes + FRAMED_PREFIX_COUNTED + len > FRAMED_BATCH {
                    return Ok(false);
                }
                check_message_len(len, max_message)?;
                bytes += FRAMED_PREFIX_COUNTED + len;
                Ok(true)
            })?;
            match stop {
                BatchStop::Nothing => {}
                BatchStop::Ended => ended = true,
                BatchStop::Failed(status) => failure = Some(status),
                BatchStop::Held(item) => held = Some(item),
            }
            self.target.start_send_framed(batch.finish())?;
            if let Some(status) = failure {
                self.flush().await?;
                return Err(status);
            }
        }
        self.start()?;
        self.flush().await
    }
}

/// A [`MessageSink`] over rpc-core's frames.
struct FramesSink {
    call_id: u64,
    outbound: OutboundQueue,
    credits: Arc<SendCredits>,
    max_frame_len: usize,
    /// Server side: whether the response metadata went out.
    headers_sent: bool,
    server: bool,
}

/// Why [`fill_batch`] stopped.
enum BatchStop<T> {
    /// The producer has nothing more ready now.
    Nothing,
    /// Its stream is over.
    Ended,
    /// Its stream ended with this error.
    Failed(Status),
    /// This message did not fit: it starts the next batch.
    Held(Prepared<T>),
}

/// Appends the messages `messages` has ready now to `batch`, each behind
/// its `prefix`, as long as `admit` takes its length (and counts it). A
/// message goes from the producer straight into the batch: the hot loop of
/// a fast stream moves no message through an intermediate value.
fn fill_batch<C, S>(
    mut messages: Pin<&mut S>,
    codec: &mut C,
    batch: &mut PayloadBuf,
    prefix: impl Fn(usize, &mut PayloadBuf),
    mut admit: impl FnMut(usize) -> Result<bool, Status>,
) -> Result<BatchStop<C::Encode>, Status>
where
    C: Codec,
    S: Stream<Item = Result<C::Encode, Status>>,
{
    loop {
        let item = match messages.next().now_or_never() {
            None => return Ok(BatchStop::Nothing),
            Some(None) => return Ok(BatchStop::Ended),
            Some(Some(Err(status))) => return Ok(BatchStop::Failed(status)),
            Some(Some(Ok(item))) => item,
        };
        match codec.encoded_len(&item) {
            Some(len) => {
                if !admit(len)? {
                    return Ok(BatchStop::Held(Prepared::Typed(item, len)));
                }
                prefix(len, batch);
                codec.encode_into(item, batch)?;
            }
            None => {
                let payload = codec.encode_payload(item)?;
                if !admit(payload.len())? {
                    return Ok(BatchStop::Held(Prepared::Encoded(payload)));
                }
                prefix(payload.len(), batch);
                for part in payload.parts() {
                    batch.put(part.clone());
                }
            }
        }
    }
}

/// `ResourceExhausted` for a stream message over `max_message` bytes.
fn check_message_len(len: usize, max_message: usize) -> Result<(), Status> {
    if len > max_message {
        return Err(Status::resource_exhausted(format!(
            "stream message of {len} bytes exceeds the limit of {max_message} bytes"
        )));
    }
    Ok(())
}

/// A message ready to go into a batch: its length is known.
enum Prepared<T> {
    /// Encoded in place when written (the codec knows the length).
    Typed(T, usize),
    /// Encoded already.
    Encoded(Payload),
}

impl<T> Prepared<T> {
    fn new<C: Codec<Encode = T>>(codec: &mut C, item: T) -> Result<Prepared<T>, Status> {
        Ok(match codec.encoded_len(&item) {
            Some(len) => Prepared::Typed(item, len),
            None => Prepared::Encoded(codec.encode_payload(item)?),
        })
    }

    fn len(&self) -> usize {
        match self {
            Prepared::Typed(_, len) => *len,
            Prepared::Encoded(payload) => payload.len(),
        }
    }

    /// Appends the length and the message to `batch`.
    fn write<C: Codec<Encode = T>>(
        self,
        codec: &mut C,
        batch: &mut PayloadBuf,
    ) -> Result<(), Status> {
        let len = u32::try_from(self.len())
            .map_err(|_| Status::resource_exhausted("stream message over 4 GiB"))?;
        batch.put_u32_le(len);
        self.write_body(codec, batch)
    }

    /// Appends `prefix` (for the message's length) and the message to `batch`.
    fn write_with<C: Codec<Encode = T>>(
        self,
        codec: &mut C,
        batch: &mut PayloadBuf,
        prefix: fn(usize, &mut PayloadBuf),
    ) -> Result<(), Status> {
        if u32::try_from(self.len()).is_err() {
            return Err(Status::resource_exhausted("stream message over 4 GiB"));
        }
        prefix(self.len(), batch);
        self.write_body(codec, batch)
    }

    fn write_body<C: Codec<Encode = T>>(
        self,
        codec: &mut C,
        batch: &mut PayloadBuf,
    ) -> Result<(), Status> {
        match self {
            Prepared::Typed(item, _) => codec.encode_into(item, batch),
            Prepared::Encoded(payload) => {
                for part in payload.parts() {
                    batch.put(part.clone());
                }
                Ok(())
            }
        }
    }
}

impl MessageSink {
    pub(crate) fn new(
        call_id: u64,
        outbound: OutboundQueue,
        credits: Arc<SendCredits>,
        max_frame_len: usize,
        server: bool,
    ) -> MessageSink {
        MessageSink {
            inner: SinkInner::Frames(FramesSink {
                call_id,
                outbound,
                credits,
                max_frame_len,
                headers_sent: !server,
                server,
            }),
        }
    }

    /// A server handler's sink whose messages go to a front end's `target`
    /// (see [`crate::server::front_end`]); a message over `max_message`
    /// bytes fails with `ResourceExhausted`, unsent.
    pub fn from_target(target: impl MessageTarget, max_message: usize) -> MessageSink {
        MessageSink {
            inner: SinkInner::Target(TargetSink {
                target: Box::new(target),
                max_message,
                headers_sent: false,
            }),
        }
    }

    /// Sends the response metadata (server side, before any message; a
    /// message sent first sends empty metadata). Sending it again does nothing.
    pub async fn send_headers(&mut self, metadata: Metadata) -> Result<(), Status> {
        match &mut self.inner {
            SinkInner::Frames(sink) => sink.send_headers(metadata).await,
            SinkInner::Target(sink) if !sink.headers_sent => {
                sink.headers_sent = true;
                sink.target.send_headers(metadata)
            }
            SinkInner::Target(_) => Ok(()),
        }
    }

    /// Sends one encoded message once the peer's window allows it. Fails
    /// when the call has ended (the status says how), or when the message
    /// is over the frame limit (`ResourceExhausted`).
    pub async fn send(&mut self, message: impl Into<Payload>) -> Result<(), Status> {
        match &mut self.inner {
            SinkInner::Frames(sink) => sink.send_one(message.into(), false).await,
            SinkInner::Target(sink) => {
                sink.put(message.into()).await?;
                sink.flush().await
            }
        }
    }

    /// Sends every encoded message of `messages` in order, the ones that are
    /// ready together in one frame (up to [`BATCH_BYTES`]): a fast producer
    /// pays per frame, not per message, and a lone message is not held
    /// back. An error the stream yields ends the sending with it, after the
    /// messages before it. Generated servers send a handler's stream so.
    pub async fn send_all<S>(&mut self, messages: S) -> Result<(), Status>
    where
        S: Stream<Item = Result<Payload, Status>>,
    {
        self.send_encoded(messages, RawCodec, false).await
    }

    /// Sends the last message of the client's stream.
    pub(crate) async fn send_last(&mut self, message: Payload) -> Result<(), Status> {
        match &mut self.inner {
            SinkInner::Frames(sink) => sink.send_one(message, true).await,
            SinkInner::Target(_) => self.send(message).await,
        }
    }

    /// Sends every message of `messages`, encoded with `codec` (see
    /// [`FramesSink::send_encoded`]).
    pub(crate) async fn send_encoded<C, S>(
        &mut self,
        messages: S,
        codec: C,
        half_close: bool,
    ) -> Result<(), Status>
    where
        C: Codec,
        S: Stream<Item = Result<C::Encode, Status>>,
    {
        match &mut self.inner {
            SinkInner::Frames(sink) => sink.send_encoded(messages, codec, half_close).await,
            SinkInner::Target(sink) => sink.send_encoded(messages, codec).await,
        }
    }

    /// The reason the call ended, if it has (client side: whether a failure
    /// to send still needs telling).
    pub(crate) fn call_ended(&self) -> Option<Status> {
        match &self.inner {
            SinkInner::Frames(sink) => sink.credits.closed(),
            SinkInner::Target(_) => None,
        }
    }
}

impl FramesSink {
    /// Queues `frame` once there is room for it in the connection's queue.
    async fn queue(&self, frame: Frame) -> Result<(), Status> {
        let encoded = frame.encode_parts();
        let gone = || {
            self.credits
                .closed()
                .unwrap_or_else(|| Status::unavailable("connection closed"))
        };
        // `reserve` takes room at once when it is there.
        let space = self
            .outbound
            .reserve(encoded.len())
            .await
            .map_err(|_| gone())?;
        if let Some(status) = self.credits.closed() {
            return Err(status);
        }
        self.outbound
            .send_reserved(encoded, space)
            .map_err(|_| gone())
    }

    /// Fails a message whose frame would exceed the frame limit.
    fn check_len(&self, len: usize) -> Result<(), Status> {
        let frame_len = HEADER_LEN + LENGTH_PREFIX + len;
        if frame_len > self.max_frame_len {
            return Err(Status::resource_exhausted(format!(
                "stream message frame of {frame_len} bytes exceeds the frame limit of {} bytes",
                self.max_frame_len
            )));
        }
        Ok(())
    }

    /// Waits until a message costing `cost` fits the peer's window.
    async fn room(&self, cost: u64) -> Result<(), Status> {
        std::future::poll_fn(|cx| self.credits.poll_room(cx, cost)).await
    }

    /// Queues a `MESSAGE` frame of messages costing `cost` in all.
    async fn send_batch(&mut self, batch: Payload, cost: u64, last: bool) -> Result<(), Status> {
        // A producer that never waits (a window of 4 MiB is tens of
        // thousands of small messages) gives its worker back now and then,
        // as tokio's own resources do: a server polls a new call's handler
        // from the connection's task first, which meanwhile reads nothing
        // (not even the cancel of this very call).
        tokio::task::consume_budget().await;
        if !self.headers_sent {
            self.send_headers(Metadata::new()).await?;
        }
        // The window is used only once the frame is queued: a send dropped
        // while it waits for room costs nothing.
        self.queue(Frame::messages(self.call_id, batch, last && !self.server))
            .await?;
        self.credits.consume(cost);
        Ok(())
    }

    async fn send_headers(&mut self, metadata: Metadata) -> Result<(), Status> {
        if self.headers_sent {
            return Ok(());
        }
        self.queue(Frame::headers(self.call_id, metadata)).await?;
        self.headers_sent = true;
        Ok(())
    }

    async fn send_one(&mut self, message: Payload, last: bool) -> Result<(), Status> {
        self.check_len(message.len())?;
        let cost = charge(message.len());
        self.room(cost).await?;
        self.send_batch(single_message(message), cost, last).await
    }

    /// Sends every message of `messages`, encoded with `codec`, in order:
    /// the messages that are ready together go in one frame (up to
    /// [`BATCH_BYTES`], and as far as the window allows), so a fast producer
    /// pays per frame, not per message, and a lone message is not delayed.
    /// An error the stream yields ends the sending with it, after the
    /// messages before it. With `half_close`, the client's direction ends
    /// with the stream.
    async fn send_encoded<C, S>(
        &mut self,
        messages: S,
        mut codec: C,
        half_close: bool,
    ) -> Result<(), Status>
    where
        C: Codec,
        S: Stream<Item = Result<C::Encode, Status>>,
    {
        let mut messages = std::pin::pin!(messages);
        let mut held: Option<Prepared<C::Encode>> = None;
        loop {
            let first = match held.take() {
                Some(first) => first,
                None => match messages.next().await {
                    Some(item) => Prepared::new(&mut codec, item?)?,
                    None => break,
                },
            };
            self.check_len(first.len())?;
            let mut cost = charge(first.len());
            self.room(cost).await?;
            let mut bytes = LENGTH_PREFIX + first.len();
            let mut batch = PayloadBuf::with_len_hint(bytes.min(BATCH_BYTES));
            first.write(&mut codec, &mut batch)?;
            let (mut ended, mut failure) = (false, None);
            // More that are ready now, as far as the batch and the window go.
            // (A message that fits the batch fits a frame: no length check.)
            let credits = &self.credits;
            let stop = fill_batch(
                messages.as_mut(),
                &mut codec,
                &mut batch,
                |len, batch| batch.put_u32_le(len as u32),
                |len| {
                    if bytes + LENGTH_PREFIX + len > BATCH_BYTES
                        || !credits.has_room(cost, charge(len))
                    {
                        return Ok(false);
                    }
                    cost += charge(len);
                    bytes += LENGTH_PREFIX + len;
                    Ok(true)
                },
            )?;
            match stop {
                BatchStop::Nothing => {}
                BatchStop::Ended => ended = true,
                BatchStop::Failed(status) => failure = Some(status),
                BatchStop::Held(item) => held = Some(item),
            }
            self.send_batch(batch.finish(), cost, ended && half_close)
                .await?;
            if let Some(status) = failure {
                return Err(status);
            }
            if ended {
                return Ok(());
            }
        }
        if half_close {
            self.queue(Frame::half_close(self.call_id)).await?;
        }
        Ok(())
    }
}

/// A codec that writes raw messages as they are (`Channel::streaming`).
#[derive(Debug, Default)]
pub(crate) struct RawCodec;

impl Codec for RawCodec {
    type Encode = Payload;
    type Decode = Bytes;

    fn encode(&mut self, item: Payload, dst: &mut bytes::BytesMut) -> Result<(), Status> {
        for part in item.parts() {
            dst.put_slice(part);
        }
        Ok(())
    }

    fn encode_payload(&mut self, item: Payload) -> Result<Payload, Status> {
        Ok(item)
    }

    fn decode(&mut self, src: Bytes) -> Result<Bytes, Status> {
        Ok(src)
    }
}

/// A one-time slot that can travel in `http::Extensions` (which want `Clone`).
pub(crate) struct TakeOnce<T>(Arc<Mutex<Option<T>>>);

impl<T> Clone for TakeOnce<T> {
    fn clone(&self) -> Self {
        TakeOnce(self.0.clone())
    }
}

impl<T> TakeOnce<T> {
    pub(crate) fn new(value: T) -> TakeOnce<T> {
        TakeOnce(Arc::new(Mutex::new(Some(value))))
    }

    pub(crate) fn take(&self) -> Option<T> {
        self.0
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .take()
    }

    pub(crate) fn is_taken(&self) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .is_none()
    }
}

/// Sends a client's stream of messages through its sink (the typed stream
/// and its codec, boxed).
pub(crate) type SendMessages =
    Box<dyn FnOnce(MessageSink) -> BoxFuture<'static, (MessageSink, Result<(), Status>)> + Send>;

/// What a client streams: one message (server-streaming calls), messages
/// that were all there when the call began, or a stream of them.
pub(crate) enum Outbound {
    One(Payload),
    Whole(Vec<Payload>),
    Many(SendMessages),
}

/// The most messages, and bytes, of a request stream that
/// [`Outbound::ready_or_many`] takes before the call begins.
const WHOLE_MESSAGES: usize = 64;
const WHOLE_BYTES: usize = 64 << 10;

impl Outbound {
    /// A request stream of encoded messages: [`Outbound::Whole`] when it
    /// has ended by the time the call begins (within [`WHOLE_MESSAGES`] and
    /// [`WHOLE_BYTES`]), so that they travel with the request frame;
    /// otherwise the messages it had ready, then the rest, as the window
    /// allows. The stream is polled with a waker that does nothing, then
    /// (if it was not over) again by whoever sends the rest.
    pub(crate) fn ready_or_many<S>(messages: S) -> Outbound
    where
        S: Stream<Item = Payload> + Send + 'static,
    {
        let mut messages = Box::pin(messages);
        let mut ready = Vec::new();
        let mut bytes = 0;
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        while ready.len() < WHOLE_MESSAGES && bytes < WHOLE_BYTES {
            match messages.as_mut().poll_next(&mut cx) {
                std::task::Poll::Ready(Some(message)) => {
                    bytes += message.len();
                    ready.push(message);
                }
                std::task::Poll::Ready(None) => return Outbound::Whole(ready),
                std::task::Poll::Pending => break,
            }
        }
        Outbound::many(futures_util::stream::iter(ready).chain(messages), RawCodec)
    }

    /// The messages of a request that goes whole (see
    /// [`crate::Frame::whole_stream_request`]), if it is one.
    pub(crate) fn whole(&self) -> Option<Payload> {
        let messages = self.ready()?;
        let mut payload = Payload::new();
        for message in messages {
            for part in single_message(message.clone()).parts() {
                payload.push(part.clone());
            }
        }
        Some(payload)
    }

    /// The messages, when all of them were there as the call began.
    fn ready(&self) -> Option<&[Payload]> {
        match self {
            Outbound::One(message) => Some(std::slice::from_ref(message)),
            Outbound::Whole(messages) => Some(messages),
            Outbound::Many(_) => None,
        }
    }

    /// `messages`, encoded with `codec` as the window allows, then a half-close.
    pub(crate) fn many<C, S>(messages: S, codec: C) -> Outbound
    where
        C: Codec,
        S: Stream<Item = C::Encode> + Send + 'static,
    {
        Outbound::Many(Box::new(move |mut sink| {
            async move {
                let result = sink.send_encoded(messages.map(Ok), codec, true).await;
                (sink, result)
            }
            .boxed()
        }))
    }
}

/// The request messages of a streaming call a [`crate::Channel`] hands to
/// a client front end ([`crate::client::front_end`]): all of them at once
/// when they were there as the call began, else a stream the front end
/// sends through its [`MessageTarget`] as the peer's flow control allows.
pub struct OutgoingMessages(pub(crate) Outbound);

impl fmt::Debug for OutgoingMessages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.0 {
            Outbound::One(_) => "one",
            Outbound::Whole(_) => "whole",
            Outbound::Many(_) => "stream",
        };
        f.debug_tuple("OutgoingMessages").field(&kind).finish()
    }
}

impl OutgoingMessages {
    /// The messages when every one of them was there as the call began
    /// (see [`OutgoingMessages::into_ready`]), without taking them.
    pub fn ready(&self) -> Option<&[Payload]> {
        self.0.ready()
    }

    /// The messages, when every one of them was there as the call began
    /// (a server-streaming call's one request, or a short request stream
    /// that had ended): they can go with the request's headers, and the
    /// request ends after them. `Err(self)` for a stream still going.
    pub fn into_ready(self) -> Result<Vec<Payload>, OutgoingMessages> {
        match self.0 {
            Outbound::One(message) => Ok(vec![message]),
            Outbound::Whole(messages) => Ok(messages),
            many @ Outbound::Many(_) => Err(OutgoingMessages(many)),
        }
    }

    /// Sends every message to `target` in order, as it takes them (the ones
    /// that are ready together framed at once where the target frames with
    /// [`MessageTarget::framing`]), then flushes it and closes it
    /// ([`MessageTarget::close`]). A message over `max_message` bytes, or an
    /// error the application's stream yields, ends the sending with it.
    pub async fn send_to(
        self,
        target: impl MessageTarget,
        max_message: usize,
    ) -> Result<(), Status> {
        let mut sink = MessageSink::from_target(target, max_message);
        let (mut sink, result) = match self.0 {
            Outbound::One(message) => {
                let result = sink.send(message).await;
                (sink, result)
            }
            Outbound::Whole(messages) => {
                let result = sink
                    .send_all(futures_util::stream::iter(messages).map(Ok))
                    .await;
                (sink, result)
            }
            Outbound::Many(send) => send(sink).await,
        };
        result?;
        match &mut sink.inner {
            SinkInner::Target(target) => target.target.close(),
            SinkInner::Frames(_) => unreachable!("a sink made from a target"),
        }
    }
}

/// The request extension that makes a call through a [`crate::Channel`] a
/// streaming call: its messages.
#[derive(Clone)]
pub(crate) struct OutboundMessages(pub(crate) TakeOnce<Outbound>);

/// The response extension of a streaming call: the server's messages.
#[derive(Clone)]
pub(crate) struct InboundMessages(pub(crate) TakeOnce<Streaming<Bytes>>);

/// The request extension a server puts on a streaming call.
#[derive(Clone)]
pub(crate) struct ServerStreamSlot(pub(crate) TakeOnce<ServerStream>);

/// A client's streaming request as the tower stack carries it: no payload,
/// its messages in [`OutboundMessages`].
pub(crate) fn into_streaming_request(request: Request<Outbound>) -> Request<Payload> {
    let mut messages = None;
    let mut request = request.map(|outbound| {
        messages = Some(outbound);
        Payload::new()
    });
    if let Some(messages) = messages {
        request
            .extensions_mut()
            .insert(OutboundMessages(TakeOnce::new(messages)));
    }
    request
}

/// The response metadata and the server's messages of a streaming call's
/// response; `Unimplemented` when the service that answered carries no
/// streams.
pub(crate) fn take_inbound<T>(
    mut response: crate::Response<T>,
) -> Result<(Metadata, Streaming<Bytes>), Status> {
    let inbound = response
        .extensions_mut()
        .remove::<InboundMessages>()
        .and_then(|messages| messages.0.take())
        .ok_or_else(|| {
            Status::unimplemented(
                "the service under this client does not carry streaming calls: they need a Channel (or tower layers over one)",
            )
        })?;
    Ok((response.into_parts().0, inbound))
}

/// A streaming call whose caller does not know whether the method is unary
/// or streaming ([`FrameFlags::KIND_UNKNOWN`](crate::frame::FrameFlags::KIND_UNKNOWN)),
/// as a gateway from gRPC does not: a unary method takes one message and
/// answers with one final response that carries its message. In a
/// request's extensions it makes
/// [`Channel::streaming`](crate::Channel::streaming) open the call so; a
/// server puts it in the extensions of such a call's request.
#[derive(Debug, Clone, Copy, Default)]
pub struct KindUnknown;

/// On the request of a call of unknown kind whose client sent its whole
/// stream with the request ([`FrameFlags::STREAMING`](crate::frame::FrameFlags::STREAMING)
/// with `END_STREAM`): those messages, in a message frame's encoding, so
/// that a unary method takes its one message without reading the stream.
/// The stream holds them too, for a streaming method.
#[derive(Debug, Clone)]
pub(crate) struct WholeStream(pub(crate) Bytes);

impl WholeStream {
    /// The one message a unary method takes; `Err` says "none" or "more".
    pub(crate) fn into_single(self) -> Result<Bytes, &'static str> {
        let mut messages = self.0;
        match next_message(&mut messages) {
            Ok(Some(message)) if messages.is_empty() => Ok(message),
            Ok(None) | Err(_) => Err("none"),
            Ok(Some(_)) => Err("more"),
        }
    }
}

/// Marks a server's response to a call of unknown kind that a unary method
/// answered: its final response frame carries the message.
#[derive(Debug, Clone, Copy)]
pub(crate) struct UnaryAnswer;

/// True for a streaming call whose client did not say the method's kind.
pub(crate) fn is_kind_unknown<T>(request: &Request<T>) -> bool {
    request.extensions().get::<KindUnknown>().is_some()
}

/// True for a request that carries a streaming call (either side).
pub(crate) fn is_streaming<T>(request: &Request<T>) -> bool {
    request.extensions().get::<OutboundMessages>().is_some()
        || request.extensions().get::<ServerStreamSlot>().is_some()
}

/// A server handler's streaming call: the client's messages and the sink
/// for the handler's own. Generated servers take it for you; a hand-written
/// service takes it with [`ServerStream::take`].
#[derive(Debug)]
pub struct ServerStream {
    /// The client's messages, as raw encoded bytes.
    pub messages: Streaming<Bytes>,
    /// Where the handler's messages go.
    pub sink: MessageSink,
}

impl ServerStream {
    /// Takes the stream of a streaming call out of its request: `None` for a
    /// unary call (or when it was taken already). A service that returns `Ok`
    /// for a streaming call without taking it answers `Unimplemented`.
    pub fn take<T>(request: &mut Request<T>) -> Option<ServerStream> {
        request
            .extensions_mut()
            .remove::<ServerStreamSlot>()
            .and_then(|slot| slot.0.take())
    }
}

/// Conversion into a streaming request: generated client methods for
/// client- and bidirectional-streaming rpcs take `impl IntoStreamingRequest`,
/// so any `Stream` of messages and a `Request` around one both work.
pub trait IntoStreamingRequest {
    /// The stream of messages.
    type Stream: Stream<Item = Self::Message> + Send + 'static;
    /// One message.
    type Message;

    /// Wraps or passes through.
    fn into_streaming_request(self) -> Request<Self::Stream>;
}

impl<T> IntoStreamingRequest for T
where
    T: Stream + Send + 'static,
{
    type Stream = T;
    type Message = T::Item;

    fn into_streaming_request(self) -> Request<T> {
        Request::new(self)
    }
}

impl<T> IntoStreamingRequest for Request<T>
where
    T: Stream + Send + 'static,
{
    type Stream = T;
    type Message = T::Item;

    fn into_streaming_request(self) -> Request<T> {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A codec of empty messages.
    #[derive(Default)]
    struct Nothing;

    impl Codec for Nothing {
        type Encode = ();
        type Decode = ();

        fn encode(&mut self, (): (), _: &mut bytes::BytesMut) -> Result<(), Status> {
            Ok(())
        }

        fn encoded_len(&self, (): &()) -> Option<usize> {
            Some(0)
        }

        fn decode(&mut self, _: Bytes) -> Result<(), Status> {
            Ok(())
        }
    }

    /// A framed target (gRPC's 5-byte prefix) that keeps the batches it is
    /// handed.
    struct Batches(Arc<Mutex<Vec<usize>>>);

    impl MessageTarget for Batches {
        fn send_headers(&mut self, _: Metadata) -> Result<(), Status> {
            Ok(())
        }
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
            Poll::Ready(Ok(()))
        }
        fn start_send(&mut self, _: Payload) -> Result<(), Status> {
            Err(Status::internal("framed only"))
        }
        fn poll_flush(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
            Poll::Ready(Ok(()))
        }
        fn framing(&mut self) -> Option<fn(usize, &mut PayloadBuf)> {
            Some(|len, batch| {
                batch.put_u8(0);
                batch.put_u32(len as u32);
            })
        }
        fn start_send_framed(&mut self, framed: Payload) -> Result<(), Status> {
            lock_batches(&self.0).push(framed.len());
            Ok(())
        }
    }

    fn lock_batches(batches: &Mutex<Vec<usize>>) -> std::sync::MutexGuard<'_, Vec<usize>> {
        batches.lock().unwrap()
    }

    #[tokio::test]
    async fn a_ready_stream_of_empty_messages_still_goes_out_in_bounded_batches() {
        let batches = Arc::new(Mutex::new(Vec::new()));
        let mut sink = MessageSink::from_target(Batches(batches.clone()), 1 << 20);
        let count = 20_000;
        let messages = futures_util::stream::iter((0..count).map(|_| Ok(())));
        sink.send_encoded(messages, Nothing, false).await.unwrap();
        let batches = lock_batches(&batches);
        assert_eq!(
            batches.iter().sum::<usize>(),
            count * 5,
            "every prefix sent"
        );
        assert!(batches.len() > 1, "more than one batch: {batches:?}");
        assert!(
            batches.iter().all(|len| *len <= FRAMED_BATCH),
            "batches within {FRAMED_BATCH} bytes: {batches:?}"
        );
    }

    fn frame_of(messages: &[&[u8]]) -> Bytes {
        let mut payload = Vec::new();
        for message in messages {
            payload.extend_from_slice(&(message.len() as u32).to_le_bytes());
            payload.extend_from_slice(message);
        }
        payload.into()
    }

    #[test]
    fn a_request_stream_that_is_over_when_the_call_begins_goes_whole() {
        let messages = vec![Payload::from(&b"one"[..]), Payload::from(&b"two"[..])];
        let outbound = Outbound::ready_or_many(futures_util::stream::iter(messages));
        assert!(matches!(&outbound, Outbound::Whole(messages) if messages.len() == 2));
        let whole = outbound.whole().unwrap().into_contiguous();
        assert_eq!(whole, frame_of(&[b"one", b"two"]));
        // One that is still producing, or too long to carry whole, does not.
        let pending = futures_util::stream::iter(vec![Payload::from(&b"one"[..])])
            .chain(futures_util::stream::pending());
        assert!(matches!(
            Outbound::ready_or_many(pending),
            Outbound::Many(_)
        ));
        let long = futures_util::stream::iter((0..WHOLE_MESSAGES + 1).map(|_| Payload::new()));
        assert!(matches!(Outbound::ready_or_many(long), Outbound::Many(_)));
    }

    #[test]
    fn a_feed_takes_whole_frames_of_messages_and_rejects_malformed_ones() {
        let feed = InboundFeed::new();
        feed.push(frame_of(&[b"a", b"", b"ccc"])).unwrap();
        assert_eq!(
            lock(&feed.state).messages,
            [&b"a"[..], b"", b"ccc"].map(Bytes::from_static)
        );
        for bad in [
            Bytes::new(),
            Bytes::from_static(&[1, 0, 0]),
            Bytes::from_static(&[5, 0, 0, 0, b'x']),
        ] {
            assert_eq!(feed.push(bad), Err(FeedError::Malformed));
        }
        feed.peer_end(Metadata::new()).unwrap();
        assert_eq!(feed.push(frame_of(&[b"late"])), Err(FeedError::AfterEnd));
        assert_eq!(feed.peer_end(Metadata::new()), Err(FeedError::AfterEnd));
    }

    #[test]
    fn the_window_bounds_what_a_peer_may_send_and_grants_extend_it() {
        let feed = InboundFeed::new();
        let message = vec![0u8; 1000];
        let per_message = charge(message.len());
        let fit = u64::from(INITIAL_WINDOW) / per_message;
        let frame = frame_of(&[&message[..]]);
        for _ in 0..fit {
            feed.push(frame.clone()).unwrap();
        }
        assert_eq!(feed.push(frame.clone()), Err(FeedError::WindowExceeded));
        // A frame of a million empty messages fails at the first one beyond
        // the window, without splitting the rest.
        let feed = InboundFeed::new();
        let empties = Bytes::from(vec![0u8; 4 * 1_000_000]);
        assert_eq!(feed.push(empties), Err(FeedError::WindowExceeded));
        assert!(lock(&feed.state).messages.len() as u64 <= u64::from(INITIAL_WINDOW) / charge(0));
        // Grants let more in.
        let feed = InboundFeed::new();
        for _ in 0..fit {
            feed.push(frame.clone()).unwrap();
        }
        lock(&feed.state).allowed += u64::from(GRANT_AT);
        for _ in 0..u64::from(GRANT_AT) / per_message {
            feed.push(frame.clone()).unwrap();
        }
        assert_eq!(feed.push(frame), Err(FeedError::WindowExceeded));
    }

    #[test]
    fn a_message_larger_than_the_window_goes_once_little_is_outstanding() {
        let big = vec![0u8; INITIAL_WINDOW as usize + 1];
        let feed = InboundFeed::new();
        feed.push(frame_of(&[&big[..]])).unwrap();
        // The sender's rule agrees: alone it fits, after it nothing does
        // until the receiver grants.
        let credits = SendCredits::new();
        assert!(credits.state().fits(0, charge(big.len())));
        credits.consume(charge(big.len()));
        assert!(!credits.state().fits(0, charge(1)));
        credits.grant(u32::try_from(charge(big.len())).unwrap());
        assert!(credits.state().fits(0, charge(big.len())));
        // Outstanding at GRANT_AT or more: only what fits the window goes.
        let credits = SendCredits::new();
        credits.consume(u64::from(GRANT_AT));
        assert!(!credits.state().fits(0, u64::from(INITIAL_WINDOW)));
        assert!(
            credits
                .state()
                .fits(0, u64::from(INITIAL_WINDOW - GRANT_AT))
        );
    }
}
