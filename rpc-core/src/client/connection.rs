//! One multiplexed client connection: a call table, a reader task, and a
//! writer task for what the calling tasks do not write themselves.
//!
//! Calls are matched to responses by call id. The table is the single source
//! of truth for which calls are pending: a call registers before its request
//! is queued, the reader removes it to deliver the response, a dropped call
//! removes it and queues a cancel frame, and closing the connection drains it,
//! failing every pending call at once.
//!
//! Requests go through a queue bounded in bytes; a call waits for room before
//! its request is queued (and [`crate::Channel`]'s `poll_ready` waits while
//! the queue is full). The reader never waits for that queue (a ping's answer
//! is dropped when there is no room), so responses always drain.
//!
//! A GOAWAY from the server names the highest call id it saw: calls above it
//! were never processed there, so they fail with a failure the channel may
//! retry on a new connection; once no call is left, the connection closes.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::conn_io::{OutboundQueue, flush_inline_by_default};
use crate::frame::{Frame, FrameError, FrameFlags, FrameKind};
use crate::metadata::Metadata;
use crate::metrics::{ConnectionRecord, Side};
use crate::payload::Payload;
use crate::status::{Code, Status};
use crate::stream::{FeedError, InboundFeed, MessageSink, RawInbound, SendCredits};
use crate::transport::{Connection, FrameStream, TransportError};
use crate::wake_gate::WakeGated;

/// Why a call failed, and whether it may be sent again on another connection
/// because this server never saw it.
#[derive(Debug)]
pub(crate) struct CallFailure {
    pub(crate) status: Status,
    pub(crate) unprocessed: bool,
}

impl CallFailure {
    fn processed(status: Status) -> CallFailure {
        CallFailure {
            status,
            unprocessed: false,
        }
    }

    fn unprocessed(status: Status) -> CallFailure {
        CallFailure {
            status,
            unprocessed: true,
        }
    }
}

impl From<Status> for CallFailure {
    fn from(status: Status) -> CallFailure {
        CallFailure::processed(status)
    }
}

type CallResult = Result<Frame, CallFailure>;

/// Who waits for a call's frames.
enum Waiter {
    /// A unary call: its response.
    Unary(oneshot::Sender<CallResult>),
    /// A streaming call: its headers, then its messages and end.
    Stream(StreamWaiter),
}

struct StreamWaiter {
    /// Until the server's headers (or its final response) arrive.
    headers: Option<oneshot::Sender<CallResult>>,
    feed: InboundFeed,
    credits: Arc<SendCredits>,
    /// Opened with `KIND_UNKNOWN`: a unary method may answer with one final
    /// response that carries its message.
    kind_unknown: bool,
}

impl StreamWaiter {
    fn fail(self, failure: CallFailure) {
        self.credits.close(failure.status.clone());
        self.feed.finish(Err(failure.status.clone()));
        if let Some(headers) = self.headers {
            let _ = headers.send(Err(failure));
        }
    }
}

impl Waiter {
    fn fail(self, failure: CallFailure) {
        match self {
            Waiter::Unary(waiter) => {
                let _ = waiter.send(Err(failure));
            }
            Waiter::Stream(stream) => stream.fail(failure),
        }
    }
}

#[derive(Default)]
struct CallTable {
    pending: HashMap<u64, Waiter>,
    /// Set once the connection is closed: why, as the status new calls get.
    closed: Option<Status>,
    /// Set by a graceful GOAWAY: the highest call id the server saw.
    goaway: Option<u64>,
}

struct Shared {
    calls: Mutex<CallTable>,
    /// A GOAWAY arrived: pending calls finish here, new calls go elsewhere.
    draining: AtomicBool,
    /// Set with `shutdown`: read per call, where the token's own check
    /// takes a lock.
    closed: AtomicBool,
    shutdown: CancellationToken,
    peer: String,
}

impl Shared {
    fn table(&self) -> MutexGuard<'_, CallTable> {
        self.calls
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// Marks the connection closed and fails every pending call with `status`.
    fn close(&self, status: Status) {
        let pending = {
            let mut table = self.table();
            if table.closed.is_none() {
                table.closed = Some(status.clone());
            }
            std::mem::take(&mut table.pending)
        };
        if !pending.is_empty() {
            tracing::debug!(peer = %self.peer, calls = pending.len(), "failing pending calls: {}", status.message());
        }
        for (_, waiter) in pending {
            waiter.fail(CallFailure::processed(status.clone()));
        }
        self.closed.store(true, Ordering::Release);
        self.shutdown.cancel();
    }
}

/// A live connection shared by every clone of a [`crate::Channel`].
pub(crate) struct ClientConnection {
    shared: Arc<Shared>,
    outbound: OutboundQueue,
    next_call_id: AtomicU64,
    max_frame_len: usize,
}

impl ClientConnection {
    /// Takes over `connection` and starts its reader and writer tasks.
    pub(crate) fn start(
        connection: Connection,
        scheme: &str,
        max_frame_len: usize,
        keepalive: Option<Keepalive>,
        outbound_queue_bytes: usize,
    ) -> Arc<ClientConnection> {
        let Connection { sink, stream, peer } = connection;
        let shared = Arc::new(Shared {
            calls: Mutex::default(),
            draining: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            shutdown: CancellationToken::new(),
            peer,
        });
        let (outbound, writer) =
            OutboundQueue::new(outbound_queue_bytes, None, sink, flush_inline_by_default());

        let writer_shared = shared.clone();
        let writer_queue = outbound.clone();
        tokio::spawn(async move {
            let outcome = tokio::select! {
                outcome = writer.run(None) => outcome,
                () = WakeGated::new(writer_shared.shutdown.cancelled()) => Ok(()),
            };
            let reason = match outcome {
                Ok(()) => "connection closed".to_owned(),
                Err(error) => format!("connection lost: {error}"),
            };
            writer_shared.close(Status::unavailable(reason));
            writer_queue.close();
        });

        // Counted while its reader runs: from now until the connection ends.
        let counted = ConnectionRecord::open(Side::Client, scheme);
        tokio::spawn(
            read_frames(
                shared.clone(),
                stream,
                outbound.clone(),
                max_frame_len,
                keepalive,
            )
            .map(move |()| drop(counted)),
        );

        Arc::new(ClientConnection {
            shared,
            outbound,
            next_call_id: AtomicU64::new(1),
            max_frame_len,
        })
    }

    /// True while new calls may start here.
    pub(crate) fn is_usable(&self) -> bool {
        !self.shared.draining.load(Ordering::Acquire) && !self.shared.closed.load(Ordering::Acquire)
    }

    /// The queue this connection's frames wait in.
    pub(crate) fn outbound(&self) -> &OutboundQueue {
        &self.outbound
    }

    /// Waits for room in the outbound queue, registers a call and queues its
    /// request frame. A failure marked unprocessed never reached the server.
    pub(crate) async fn start_call(
        self: &Arc<Self>,
        path: &str,
        deadline: Option<Duration>,
        metadata: Metadata,
        payload: Payload,
    ) -> Result<PendingCall, CallFailure> {
        check_path(path)?;
        let call_id = self.next_call_id.fetch_add(1, Ordering::Relaxed);
        let frame = Frame::request(call_id, path, deadline, metadata, payload);
        let (sender, receiver) = oneshot::channel();
        self.queue_request(frame, Waiter::Unary(sender)).await?;
        Ok(PendingCall {
            connection: self.clone(),
            call_id,
            receiver,
            finished: false,
        })
    }

    /// Opens a streaming call: registers it and queues its request frame.
    /// Its messages go through the returned sink; the server's headers
    /// arrive on `headers`, its messages and end on `inbound`.
    pub(crate) async fn start_stream(
        self: &Arc<Self>,
        path: &str,
        deadline: Option<Duration>,
        metadata: Metadata,
        kind_unknown: bool,
    ) -> Result<OpenStream, CallFailure> {
        check_path(path)?;
        let call_id = self.next_call_id.fetch_add(1, Ordering::Relaxed);
        let mut frame = Frame::stream_request(call_id, path, deadline, metadata);
        if kind_unknown {
            frame.flags = frame.flags | FrameFlags::KIND_UNKNOWN;
        }
        let (sender, headers) = oneshot::channel();
        let feed = InboundFeed::new();
        let credits = SendCredits::new();
        let waiter = StreamWaiter {
            headers: Some(sender),
            feed: feed.clone(),
            credits: credits.clone(),
            kind_unknown,
        };
        self.queue_request(frame, Waiter::Stream(waiter)).await?;
        Ok(OpenStream {
            call_id,
            headers,
            inbound: RawInbound::new(&feed, call_id, self.outbound.clone()),
            sink: MessageSink::new(
                call_id,
                self.outbound.clone(),
                credits,
                self.max_frame_len,
                false,
            ),
        })
    }

    /// Registers `waiter` for the call of `frame` and queues the frame.
    async fn queue_request(
        self: &Arc<Self>,
        frame: Frame,
        waiter: Waiter,
    ) -> Result<(), CallFailure> {
        let len = frame.encoded_len();
        if len > self.max_frame_len {
            return Err(Status::resource_exhausted(format!(
                "request frame of {len} bytes exceeds the frame limit of {} bytes",
                self.max_frame_len
            ))
            .into());
        }
        let call_id = frame.call_id;
        let encoded = frame.encode_parts();
        let closed = || {
            let status = self
                .shared
                .table()
                .closed
                .clone()
                .unwrap_or_else(|| Status::unavailable("connection closed"));
            CallFailure::unprocessed(status)
        };
        let space = match self.outbound.try_reserve(encoded.len()) {
            Some(space) => space,
            None => self
                .outbound
                .reserve(encoded.len())
                .await
                .map_err(|_| closed())?,
        };
        {
            let mut table = self.shared.table();
            if let Some(status) = &table.closed {
                return Err(CallFailure::unprocessed(status.clone()));
            }
            if table.goaway.is_some() {
                return Err(CallFailure::unprocessed(Status::unavailable(
                    "the server sent GOAWAY; retry on a new connection",
                )));
            }
            table.pending.insert(call_id, waiter);
        }
        if self.outbound.send_reserved(encoded, space).is_err() {
            self.shared.table().pending.remove(&call_id);
            return Err(closed());
        }
        Ok(())
    }

    fn abandon(&self, call_id: u64) {
        self.end_call(call_id, Status::cancelled("call cancelled by the client"));
    }

    /// Ends a call the server may still be working on: a cancel frame tells
    /// it to stop, and a stream's ends fail with `why`.
    pub(crate) fn end_call(&self, call_id: u64, why: Status) {
        let waiter = self.shared.table().pending.remove(&call_id);
        if let Some(waiter) = waiter {
            // At most one per call: bounded without taking room from requests.
            let cancel = Frame::control(FrameKind::Cancel, FrameFlags::EMPTY, call_id);
            let _ = self.outbound.send_unbounded(cancel.encode_parts());
            waiter.fail(CallFailure::processed(why));
        }
    }
}

fn check_path(path: &str) -> Result<(), CallFailure> {
    if path.len() > crate::frame::MAX_PATH_LEN {
        return Err(Status::invalid_argument("method path longer than 65535 bytes").into());
    }
    Ok(())
}

/// A streaming call just opened (see [`ClientConnection::start_stream`]).
pub(crate) struct OpenStream {
    pub(crate) call_id: u64,
    pub(crate) headers: oneshot::Receiver<CallResult>,
    pub(crate) inbound: RawInbound,
    pub(crate) sink: MessageSink,
}

impl Drop for ClientConnection {
    fn drop(&mut self) {
        // The last handle is gone: stop both tasks, which closes the transport.
        self.shared.close(Status::unavailable("channel dropped"));
    }
}

/// A call in flight. Resolves to the response frame; dropping it before then
/// sends a cancel frame so the server aborts the handler.
pub(crate) struct PendingCall {
    connection: Arc<ClientConnection>,
    call_id: u64,
    receiver: oneshot::Receiver<CallResult>,
    finished: bool,
}

impl PendingCall {
    pub(crate) fn call_id(&self) -> u64 {
        self.call_id
    }
}

impl Future for PendingCall {
    type Output = CallResult;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<CallResult> {
        let outcome = match Pin::new(&mut self.receiver).poll(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Ok(outcome)) => outcome,
            Poll::Ready(Err(_)) => Err(CallFailure::processed(Status::unavailable(
                "connection closed",
            ))),
        };
        self.finished = true;
        Poll::Ready(outcome)
    }
}

impl Drop for PendingCall {
    fn drop(&mut self) {
        if !self.finished {
            self.connection.abandon(self.call_id);
        }
    }
}

/// Liveness probing of an otherwise silent connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keepalive {
    /// Silence after which a ping is sent.
    pub interval: Duration,
    /// Further silence after which the connection is declared dead and every
    /// pending call fails with `Unavailable`.
    pub timeout: Duration,
}

impl Default for Keepalive {
    fn default() -> Self {
        Keepalive {
            interval: Duration::from_secs(30),
            timeout: Duration::from_secs(20),
        }
    }
}

/// Ticks every `keepalive.interval`, or never.
async fn keepalive_tick(ticker: &mut Option<tokio::time::Interval>) {
    match ticker {
        Some(ticker) => {
            ticker.tick().await;
        }
        None => std::future::pending().await,
    }
}

async fn read_frames(
    shared: Arc<Shared>,
    mut stream: FrameStream,
    outbound: OutboundQueue,
    max_frame_len: usize,
    keepalive: Option<Keepalive>,
) {
    let mut last_heard = tokio::time::Instant::now();
    let mut ticker = keepalive.map(|keepalive| {
        let period = keepalive
            .interval
            .min(keepalive.timeout)
            .max(Duration::from_millis(1));
        let mut ticker = tokio::time::interval_at(last_heard + period, period);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker
    });
    // Polled only when the token wakes it, not once per frame.
    let shutting_down = WakeGated::new(shared.shutdown.cancelled());
    tokio::pin!(shutting_down);
    let reason = loop {
        let next = tokio::select! {
            () = &mut shutting_down => return,
            () = keepalive_tick(&mut ticker) => {
                let Some(keepalive) = keepalive else { continue };
                let silent = last_heard.elapsed();
                if silent >= keepalive.interval + keepalive.timeout {
                    tracing::warn!(peer = %shared.peer, ?silent, "closing connection: keepalive timed out");
                    break format!("connection lost: nothing heard from the server for {silent:?} (keepalive)");
                }
                if silent >= keepalive.interval {
                    // One per period at most: bounded without taking room from requests.
                    let ping = Frame::control(FrameKind::Ping, FrameFlags::EMPTY, 0);
                    let _ = outbound.send_unbounded(ping.encode_parts());
                }
                continue;
            }
            next = stream.next() => next,
        };
        if keepalive.is_some() {
            last_heard = tokio::time::Instant::now();
        }
        let decoded = match next {
            None => break "connection closed by peer".to_owned(),
            Some(Err(TransportError::Refused { head, len, max })) => Err((head, len, max)),
            Some(Err(error)) => break format!("connection lost: {error}"),
            Some(Ok(bytes)) => match Frame::decode(bytes.clone(), max_frame_len) {
                Ok(frame) => Ok(frame),
                Err(FrameError::TooLarge { max, .. }) if bytes.len() > max => {
                    let len = bytes.len();
                    Err((bytes, len, max))
                }
                Err(error) => {
                    tracing::warn!(peer = %shared.peer, %error, "closing connection: bad frame from server");
                    break format!("protocol error from server: {error}");
                }
            },
        };
        let frame = match decoded {
            Ok(frame) => frame,
            Err((head, len, max)) => {
                // A response over our limit fails its call alone.
                match Frame::peek_header(&head) {
                    Some((FrameKind::Response | FrameKind::Message, call_id)) => {
                        let waiter = shared.table().pending.remove(&call_id);
                        if let Some(waiter) = waiter {
                            if matches!(waiter, Waiter::Stream(_)) {
                                // The server still runs the call: stop it.
                                let cancel =
                                    Frame::control(FrameKind::Cancel, FrameFlags::EMPTY, call_id);
                                let _ = outbound.send_unbounded(cancel.encode_parts());
                            }
                            waiter.fail(CallFailure::processed(Status::resource_exhausted(
                                format!("response of {len} bytes exceeds this channel's limit of {max} bytes (Channel::builder().max_frame_len)"),
                            )));
                        }
                        continue;
                    }
                    _ => {
                        break format!(
                            "protocol error from server: frame of {len} bytes exceeds the limit of {max} bytes"
                        );
                    }
                }
            }
        };
        match frame.kind {
            FrameKind::Response => {
                let (waiter, drained) = {
                    let mut table = shared.table();
                    let waiter = table.pending.remove(&frame.call_id);
                    (waiter, table.goaway.is_some() && table.pending.is_empty())
                };
                // No waiter: the call was cancelled or timed out; drop the late response.
                match waiter {
                    Some(Waiter::Unary(waiter)) => {
                        let _ = waiter.send(Ok(frame));
                    }
                    Some(Waiter::Stream(stream))
                        if stream.kind_unknown
                            && stream.headers.is_some()
                            && frame.status == Code::Ok =>
                    {
                        unary_answer(stream, frame);
                    }
                    Some(Waiter::Stream(stream)) => {
                        if frame.status == Code::Ok && !frame.payload.is_empty() {
                            stream.fail(CallFailure::processed(Status::internal("protocol error from server: a streaming call ended with a message in its final response")));
                            break "protocol error from server: a streaming call's final response carries a message".to_owned();
                        }
                        stream
                            .credits
                            .close(Status::cancelled("the call has ended"));
                        stream.feed.finish(stream_end(&frame));
                        if let Some(headers) = stream.headers {
                            let _ = headers.send(Ok(frame));
                        }
                    }
                    None => {}
                }
                if drained {
                    break "the server sent GOAWAY and no call is left".to_owned();
                }
            }
            FrameKind::Headers | FrameKind::Message | FrameKind::Window => {
                if let Err(error) = stream_frame(&shared, frame) {
                    tracing::warn!(peer = %shared.peer, %error, "closing connection: bad stream frame from server");
                    break format!("protocol error from server: {error}");
                }
            }
            FrameKind::Ping if !frame.flags.contains(FrameFlags::ACK) => {
                // Never wait here (responses must keep draining): no room, no answer.
                let pong =
                    Frame::control(FrameKind::Ping, FrameFlags::ACK, frame.call_id).encode_parts();
                if let Some(space) = outbound.try_reserve(pong.len()) {
                    let _ = outbound.send_reserved(pong, space);
                }
            }
            FrameKind::Ping => {}
            FrameKind::GoAway if frame.status != Code::Ok => {
                let reason = String::from_utf8_lossy(&frame.payload.into_contiguous()).into_owned();
                tracing::warn!(peer = %shared.peer, %reason, "server closed the connection");
                break format!("server closed the connection: {reason}");
            }
            FrameKind::GoAway => {
                tracing::debug!(peer = %shared.peer, last_call_id = frame.call_id, "server sent GOAWAY; new calls use a new connection");
                shared.draining.store(true, Ordering::Release);
                let (unprocessed, drained) = {
                    let mut table = shared.table();
                    table.goaway = Some(frame.call_id);
                    let unseen: Vec<u64> = table
                        .pending
                        .keys()
                        .copied()
                        .filter(|&call_id| call_id > frame.call_id)
                        .collect();
                    let unprocessed: Vec<_> = unseen
                        .into_iter()
                        .filter_map(|call_id| table.pending.remove(&call_id))
                        .collect();
                    (unprocessed, table.pending.is_empty())
                };
                for waiter in unprocessed {
                    waiter.fail(CallFailure::unprocessed(Status::unavailable(
                        "the server sent GOAWAY before it saw this call",
                    )));
                }
                if drained {
                    break "the server sent GOAWAY and no call is left".to_owned();
                }
            }
            FrameKind::Request | FrameKind::Cancel => {
                tracing::warn!(peer = %shared.peer, kind = ?frame.kind, "closing connection: server sent a client-only frame");
                break format!(
                    "protocol error from server: unexpected {:?} frame",
                    frame.kind
                );
            }
        }
    };
    shared.close(Status::unavailable(reason));
}

/// How the final response of a streaming call ends its stream of messages.
fn stream_end(frame: &Frame) -> Result<Metadata, Status> {
    if frame.status == Code::Ok {
        Ok(frame.metadata.clone())
    } else {
        Err(status_of(frame))
    }
}

/// The error status a non-OK response frame carries.
pub(crate) fn status_of(frame: &Frame) -> Status {
    let payload = frame.payload.clone().into_contiguous();
    let message = String::from_utf8_lossy(&payload).into_owned();
    Status::with_metadata(frame.status, message, frame.metadata.clone())
}

/// A unary method's answer to a call of unknown kind: its response
/// metadata, its one message and the end, all in one final response (see
/// docs/wire-format.md, "Kind unknown").
fn unary_answer(stream: StreamWaiter, frame: Frame) {
    stream
        .credits
        .close(Status::cancelled("the call has ended"));
    let message = crate::stream::single_message(frame.payload).into_contiguous();
    // The feed is new and its window whole: one message always fits.
    let _ = stream.feed.push(message);
    stream.feed.finish(Ok(Metadata::new()));
    if let Some(headers) = stream.headers {
        let _ = headers.send(Ok(Frame::headers(frame.call_id, frame.metadata)));
    }
}

/// Delivers a HEADERS, MESSAGE or WINDOW frame of a streaming call. A frame
/// for a call no longer pending is dropped (it crossed a cancel); one that
/// breaks the stream's rules is a protocol error, described in `Err`.
fn stream_frame(shared: &Shared, frame: Frame) -> Result<(), String> {
    let mut table = shared.table();
    let stream = match table.pending.get_mut(&frame.call_id) {
        None => return Ok(()),
        Some(Waiter::Unary(_)) => {
            return Err(format!(
                "{:?} frame for unary call {}",
                frame.kind, frame.call_id
            ));
        }
        Some(Waiter::Stream(stream)) => stream,
    };
    match frame.kind {
        FrameKind::Headers if frame.flags.contains(FrameFlags::END_STREAM) => {
            Err("a server ends a stream with its final response, not END_STREAM headers".into())
        }
        FrameKind::Headers => match stream.headers.take() {
            Some(headers) => {
                let _ = headers.send(Ok(frame));
                Ok(())
            }
            None => Err(format!("second headers frame for call {}", frame.call_id)),
        },
        FrameKind::Message if stream.headers.is_some() => {
            Err(format!("message before headers on call {}", frame.call_id))
        }
        FrameKind::Message if frame.flags.contains(FrameFlags::END_STREAM) => {
            Err("a server ends a stream with its final response, not an END_STREAM message".into())
        }
        FrameKind::Message => stream
            .feed
            .push(frame.payload.into_contiguous())
            .map_err(|error: FeedError| format!("{} (call {})", error.describe(), frame.call_id)),
        FrameKind::Window => {
            stream.credits.grant(frame.window_grant().unwrap_or(0));
            Ok(())
        }
        _ => unreachable!("only stream frames come here"),
    }
}
