//! One server connection: read frames, run calls, write responses.
//!
//! A call runs inside the connection's task first: a handler whose future is
//! ready on its first poll answers from here, without a task or a wake-up;
//! one that waits continues as a task of its own, which a cancel frame or
//! the deadline can abort. (A handler that computes long before its first
//! `.await` holds this connection's reading for that long; its other calls
//! wait, other connections do not.)
//!
//! The connection task owns the read side. Responses and control frames go
//! through a queue bounded in bytes ([`OutboundQueue`]) to a writer task. When
//! a frame the connection task must send (a pong, a refusal) finds the queue
//! full, the task stops reading until the frame is queued: a peer that does
//! not read our frames cannot make us buffer. Calls that finish while the
//! queue is full wait for room with their response; they can always drain,
//! because the writer depends on nothing but the peer reading.

use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;
use tower::util::BoxCloneSyncService;
use tracing::Instrument;

use super::stats::{ConnectionSlot, PausedGuard, StatsInner};
use super::{CLOSE_LINGER, ServerConfig};
use crate::conn_io::{OutboundQueue, QueueClosed, Space, flush_inline_by_default};
use crate::frame::{EncodedFrame, Excess, Frame, FrameError, FrameFlags, FrameKind};
use crate::metadata::Metadata;
use crate::metrics::{CallRecord, ConnectionRecord, Side};
use crate::payload::Payload;
use crate::request::{PeerInfo, Request, Response};
use crate::status::{Code, Status};
use crate::stream::{
    FeedError, InboundFeed, KindUnknown, MessageSink, RawInbound, SendCredits, ServerStream,
    ServerStreamSlot, Streaming, TakeOnce, UnaryAnswer, WholeStream,
};
use crate::transport::{Connection, TransportError};
use crate::wake_gate::WakeGated;

pub(crate) type ServerService = BoxCloneSyncService<Request<Bytes>, Response<Payload>, Status>;

type Reserving = Pin<Box<dyn Future<Output = Result<Space, QueueClosed>> + Send>>;

/// Why a connection ended, for the log.
enum Ending {
    PeerClosed,
    Drained,
    /// No call in flight and no frame for the idle time-out.
    Idle,
    /// The transport failed; nothing more can be sent.
    Failed(String),
    /// The writer gave up: the peer took none of our frames for the time-out.
    Stalled(String),
    /// The peer broke the protocol: tell it why (GOAWAY with the reason), then close.
    ProtocolError(String),
    /// The server ended its calls in flight (its grace period is over, or
    /// it was dropped): each ends with `Unavailable`, then the connection.
    ShutDown,
}

/// A frame the connection task must send but has no room for yet; while one
/// waits, the connection reads nothing.
struct Blocked {
    frame: EncodedFrame,
    room: Reserving,
    _paused: PausedGuard,
}

/// Waits for the blocked frame's room, or forever when nothing is blocked.
async fn room_for(blocked: &mut Option<Blocked>) -> Result<Space, QueueClosed> {
    match blocked {
        Some(blocked) => blocked.room.as_mut().await,
        None => std::future::pending().await,
    }
}

/// Queues `frame` now if there is room, else parks it in `blocked`.
fn queue_or_block(
    outbound: &OutboundQueue,
    stats: &Arc<StatsInner>,
    blocked: &mut Option<Blocked>,
    frame: EncodedFrame,
) {
    debug_assert!(
        blocked.is_none(),
        "nothing is read while a frame is blocked"
    );
    match outbound.try_reserve(frame.len()) {
        Some(space) => {
            // A closed queue means the writer is gone; its end is noticed by the loop.
            let _ = outbound.send_reserved(frame, space);
        }
        None => {
            let queue = outbound.clone();
            let len = frame.len();
            *blocked = Some(Blocked {
                frame,
                room: Box::pin(async move { queue.reserve(len).await }),
                _paused: stats.paused(),
            });
        }
    }
}

/// What a call still in flight hears when its server's grace period is over.
pub(crate) const SHUTTING_DOWN: &str = "server shutting down";

/// When a connection's server shuts down.
pub(crate) struct Shutdown {
    /// Gracefully: GOAWAY, no new calls, the end once those in flight are done.
    pub(crate) graceful: CancellationToken,
    /// Now: the calls in flight end with `Unavailable`, then the connection.
    pub(crate) now: CancellationToken,
}

/// Serves one connection until the peer closes it, it breaks, it idles out, or
/// the server shuts down (gracefully: once its in-flight calls are done).
pub(crate) async fn serve_connection(
    connection: Connection,
    service: ServerService,
    config: ServerConfig,
    shutdown: Shutdown,
    stats: Arc<StatsInner>,
    slot: ConnectionSlot,
    scheme: Arc<str>,
) {
    let _slot = slot;
    let _counted = ConnectionRecord::open(Side::Server, &scheme);
    let Connection {
        sink,
        mut stream,
        peer,
    } = connection;
    let idle_timeout = config.idle_timeout;
    let (outbound, writer) = OutboundQueue::new(
        config.outbound_queue_bytes,
        Some(stats.queues.clone()),
        sink,
        flush_inline_by_default(),
    );
    let mut writer = tokio::spawn(writer.run(Some(idle_timeout)));
    let mut writer_done = false;
    let mut calls: JoinSet<u64> = JoinSet::new();
    let mut in_flight: HashMap<u64, AbortHandle> = HashMap::new();
    // The streaming calls among them: where their client messages go.
    let mut streams: HashMap<u64, StreamEntry> = HashMap::new();
    let mut draining = false;
    let mut last_call_id = 0;
    let mut blocked: Option<Blocked> = None;
    // Idle means: no call in flight, and no frame completed (nor call
    // finished) since `last_activity`. The timer is re-armed lazily when it
    // fires, so a busy connection does not touch the timer wheel per frame;
    // and a request that starts a call reads no clock (the call's end does).
    let mut last_activity = Instant::now();
    let idle = tokio::time::sleep(idle_timeout);
    tokio::pin!(idle);
    // Polled only when the token wakes it, not on every turn of the loop.
    let shutting_down = WakeGated::new(shutdown.graceful.cancelled());
    tokio::pin!(shutting_down);
    let ending_now = WakeGated::new(shutdown.now.cancelled());
    tokio::pin!(ending_now);

    // Counts this connection as paused while a full queue stops its reading.
    let mut full_queue_pause: Option<super::stats::PausedGuard> = None;
    let ending = loop {
        if blocked.is_none() && !outbound.has_room() {
            full_queue_pause.get_or_insert_with(|| stats.paused());
        } else {
            full_queue_pause = None;
        }
        tokio::select! {
            () = &mut ending_now => break Ending::ShutDown,
            () = &mut shutting_down, if !draining => {
                draining = true;
                let goaway = Frame::control(FrameKind::GoAway, FrameFlags::EMPTY, last_call_id);
                let _ = outbound.send_unbounded(goaway.encode_parts());
                if in_flight.is_empty() {
                    break Ending::Drained;
                }
            }
            Some(done) = calls.join_next(), if !calls.is_empty() => {
                if let Ok(call_id) = done {
                    in_flight.remove(&call_id);
                    if let Some(stream) = streams.remove(&call_id) {
                        stream.close(|| Status::cancelled("the call has ended"));
                    }
                }
                if in_flight.is_empty() {
                    last_activity = Instant::now();
                    if draining {
                        break Ending::Drained;
                    }
                }
            }
            outcome = &mut writer, if !writer_done => {
                writer_done = true;
                break match outcome {
                    Ok(Err(TransportError::Io(error))) if error.kind() == std::io::ErrorKind::TimedOut => {
                        Ending::Stalled(error.to_string())
                    }
                    Ok(Err(error)) => Ending::Failed(format!("writing failed: {error}")),
                    Ok(Ok(())) | Err(_) => Ending::Failed("writer ended".to_owned()),
                };
            }
            room = room_for(&mut blocked) => {
                let Some(Blocked { frame, .. }) = blocked.take() else { continue };
                match room {
                    Ok(space) => {
                        let _ = outbound.send_reserved(frame, space);
                    }
                    Err(QueueClosed) => break Ending::Failed("writer gone".to_owned()),
                }
            }
            () = &mut idle, if in_flight.is_empty() && !draining => {
                let quiet_until = last_activity + idle_timeout;
                if Instant::now() < quiet_until {
                    idle.as_mut().reset(quiet_until);
                    continue;
                }
                break Ending::Idle;
            }
            // A full outbound queue (a peer that does not read its answers):
            // read no more requests until it has room, so the answers held
            // by calls waiting to queue stay as few as the calls already
            // running (each new request would make one more).
            () = outbound.not_full(), if blocked.is_none() && !outbound.has_room() => {}
            next = stream.next(), if blocked.is_none() && outbound.has_room() => {
                let over_limit = match next {
                    None => break Ending::PeerClosed,
                    Some(Err(TransportError::PeerGone(reason))) => {
                        tracing::debug!(%peer, "{reason}");
                        break Ending::PeerClosed;
                    }
                    // Skipped by the transport.
                    Some(Err(TransportError::Refused { head, len, max })) => {
                        let excess = Excess::of_refused(&head, len, max);
                        Err((head, excess))
                    }
                    Some(Err(rpc_error @ TransportError::Frame(_))) => {
                        break Ending::ProtocolError(format!("bad frame: {rpc_error}"));
                    }
                    Some(Err(error)) => break Ending::Failed(error.to_string()),
                    Some(Ok(bytes)) => {
                        stats.frames_received.fetch_add(1, Ordering::Relaxed);
                        match Frame::decode(bytes.clone(), config.max_frame_len) {
                            Ok(frame) => Ok(frame),
                            // Carried whole, but over our limit all the same
                            // (not a header that merely claims more).
                            Err(FrameError::TooLarge { max, .. }) if bytes.len() > max => {
                                let len = bytes.len();
                                Err((bytes, Excess::Frame { len, max }))
                            }
                            Err(FrameError::MetadataOverLimit { excess, .. }) => {
                                Err((bytes, Excess::Metadata(excess)))
                            }
                            Err(error) => break Ending::ProtocolError(format!("bad frame: {error}")),
                        }
                    }
                };
                let frame = match over_limit {
                    Ok(frame) => frame,
                    Err((head, excess)) => {
                        // A request over the limit fails alone; the
                        // connection and its other calls go on.
                        match Frame::peek_header(&head) {
                            Some((FrameKind::Message, call_id)) => {
                                // A stream message over the limit ends that
                                // stream with the error; its handler decides.
                                if let Some(stream) = streams.get(&call_id) {
                                    stream.feed.finish(Err(Status::resource_exhausted(
                                        excess.describe("stream message", "the server's"),
                                    )));
                                }
                                continue;
                            }
                            Some((FrameKind::Request, call_id)) if !in_flight.contains_key(&call_id) => {
                                last_activity = Instant::now();
                                last_call_id = last_call_id.max(call_id);
                                let status = Status::resource_exhausted(
                                    excess.describe("request", "the server's"),
                                );
                                let refusal = status_frame(call_id, status).encode_parts();
                                queue_or_block(&outbound, &stats, &mut blocked, refusal);
                                continue;
                            }
                            _ => break Ending::ProtocolError(format!(
                                "bad frame: {}", excess.describe("frame", "the")
                            )),
                        }
                    }
                };
                if frame.kind != FrameKind::Request {
                    last_activity = Instant::now();
                }
                match frame.kind {
                    FrameKind::Request => {
                        let call_id = frame.call_id;
                        if in_flight.contains_key(&call_id) {
                            break Ending::ProtocolError(format!("call id {call_id} reused while in flight"));
                        }
                        last_call_id = last_call_id.max(call_id);
                        let refusal = if draining {
                            Some(Status::unavailable("server is shutting down; retry on a new connection"))
                        } else if in_flight.len() >= config.max_concurrent_calls_per_connection {
                            Some(Status::resource_exhausted(format!(
                                "per-connection limit of {} concurrent calls reached",
                                config.max_concurrent_calls_per_connection
                            )))
                        } else {
                            None
                        };
                        if let Some(status) = refusal {
                            last_activity = Instant::now();
                            drop(frame);
                            let refusal = status_frame(call_id, status).encode_parts();
                            queue_or_block(&outbound, &stats, &mut blocked, refusal);
                            continue;
                        }
                        let stream = frame.is_streaming().then(|| {
                            let entry = StreamEntry { feed: InboundFeed::new(), credits: SendCredits::new() };
                            let call_stream = ServerStream {
                                messages: Streaming::new(
                                    RawInbound::new(&entry.feed, call_id, outbound.clone()),
                                    Ok,
                                ),
                                sink: MessageSink::new(call_id, outbound.clone(), entry.credits.clone(), config.max_frame_len, true),
                            };
                            streams.insert(call_id, entry);
                            ServerStreamSlot(TakeOnce::new(call_stream))
                        });
                        // A request that is the client's whole stream: its
                        // messages and half-close, delivered as if they followed.
                        if stream.is_some() && frame.flags.contains(FrameFlags::END_STREAM) {
                            let entry = streams.get(&call_id).expect("inserted above");
                            let messages = frame.payload.clone().into_contiguous();
                            let delivered = if messages.is_empty() {
                                Ok(())
                            } else {
                                entry.feed.push(messages)
                            };
                            if let Err(error) = delivered.and_then(|()| entry.feed.peer_end(Metadata::new())) {
                                break Ending::ProtocolError(format!("client sent {} (call {call_id})", error.describe()));
                            }
                        }
                        // A streaming call of known kind may stream at once
                        // (a whole request stream): from its own task, while
                        // this one reads on (the client's cancel among others).
                        let inline = !frame.is_streaming() || frame.flags.contains(FrameFlags::KIND_UNKNOWN);
                        let mut call = Box::pin(run_call(frame, stream, service.clone(), peer.clone(), outbound.clone(), config.max_frame_len, config.access_log));
                        // A handler whose future is ready at once answers
                        // from this task; one that waits gets a task of its own.
                        if inline && futures_util::poll!(call.as_mut()).is_ready() {
                            if let Some(stream) = streams.remove(&call_id) {
                                stream.close(|| Status::cancelled("the call has ended"));
                            }
                            if in_flight.is_empty() {
                                last_activity = Instant::now();
                            }
                            continue;
                        }
                        in_flight.insert(call_id, calls.spawn(call));
                    }
                    FrameKind::Cancel => {
                        if let Some(stream) = streams.remove(&frame.call_id) {
                            stream.close(|| Status::cancelled("call cancelled by the client"));
                        }
                        if let Some(handle) = in_flight.remove(&frame.call_id) {
                            tracing::debug!(%peer, call_id = frame.call_id, "call cancelled by client");
                            handle.abort();
                        }
                        if draining && in_flight.is_empty() {
                            break Ending::Drained;
                        }
                    }
                    FrameKind::Ping if !frame.flags.contains(FrameFlags::ACK) => {
                        let pong = Frame::control(FrameKind::Ping, FrameFlags::ACK, frame.call_id);
                        queue_or_block(&outbound, &stats, &mut blocked, pong.encode_parts());
                    }
                    FrameKind::Ping | FrameKind::GoAway => {}
                    FrameKind::Response => {
                        break Ending::ProtocolError("client sent a response frame".to_owned());
                    }
                    FrameKind::Message | FrameKind::Headers | FrameKind::Window => {
                        // Frames of a call that ended (they crossed its end) are dropped.
                        let Some(stream) = streams.get(&frame.call_id) else { continue };
                        if let Err(reason) = stream.deliver(frame) {
                            break Ending::ProtocolError(reason);
                        }
                    }
                }
            }
        }
    };

    // Endings on purpose say goodbye and linger, so the peer reads the GOAWAY.
    let mut linger = false;
    match &ending {
        Ending::PeerClosed => tracing::debug!(%peer, "connection closed by client"),
        Ending::Drained => {
            tracing::debug!(%peer, "connection drained for shutdown");
            linger = true;
        }
        Ending::Idle => {
            tracing::debug!(%peer, ?idle_timeout, "closing idle connection");
            stats.idle_closed.fetch_add(1, Ordering::Relaxed);
            let goaway = Frame::control(FrameKind::GoAway, FrameFlags::EMPTY, last_call_id);
            let _ = outbound.send_unbounded(goaway.encode_parts());
            linger = true;
        }
        Ending::Failed(reason) => {
            tracing::warn!(%peer, "connection failed: {reason}");
            stats.failed.fetch_add(1, Ordering::Relaxed);
        }
        Ending::Stalled(reason) => {
            tracing::warn!(%peer, "closing connection: {reason}");
            stats.stalled_closed.fetch_add(1, Ordering::Relaxed);
            stats.failed.fetch_add(1, Ordering::Relaxed);
        }
        Ending::ShutDown => {
            tracing::debug!(%peer, calls = in_flight.len(), "ending the calls in flight: server shutting down");
            if !draining {
                let goaway = Frame::control(FrameKind::GoAway, FrameFlags::EMPTY, last_call_id);
                let _ = outbound.send_unbounded(goaway.encode_parts());
            }
            // Each handler stops where it is; then its call's last frame.
            for (call_id, handler) in in_flight.drain() {
                handler.abort();
                let status = status_frame(call_id, Status::unavailable(SHUTTING_DOWN));
                let _ = outbound.send_unbounded(status.encode_parts());
            }
            for (_, stream) in streams.drain() {
                stream.close(|| Status::unavailable(SHUTTING_DOWN));
            }
            linger = true;
        }
        Ending::ProtocolError(reason) => {
            tracing::warn!(%peer, "closing connection: {reason}");
            stats.failed.fetch_add(1, Ordering::Relaxed);
            let mut goaway = Frame::control(FrameKind::GoAway, FrameFlags::EMPTY, last_call_id);
            goaway.status = Code::Internal;
            goaway.payload = Payload::from(reason.clone());
            let _ = outbound.send_unbounded(goaway.encode_parts());
        }
    }
    drop(blocked);
    for (_, stream) in streams.drain() {
        stream.close(|| Status::unavailable("connection to the client lost"));
    }
    // Handlers of a connection that is gone can deliver nothing: abort them.
    calls.shutdown().await;
    drop(outbound);
    let flushed = async {
        if writer_done {
            return;
        }
        match writer.await {
            Ok(Ok(())) | Err(_) => {}
            Ok(Err(error)) => tracing::debug!(%peer, %error, "flushing the last frames failed"),
        }
    };
    if linger {
        // Read and drop whatever the peer still sends until it closes too.
        let drain = async { while let Some(Ok(_)) = stream.next().await {} };
        let _ =
            tokio::time::timeout(CLOSE_LINGER, futures_util::future::join(flushed, drain)).await;
    } else {
        flushed.await;
    }
}

/// The connection's end of a streaming call: where the client's messages
/// and grants go.
struct StreamEntry {
    feed: InboundFeed,
    credits: Arc<SendCredits>,
}

impl StreamEntry {
    /// Delivers a MESSAGE, HEADERS or WINDOW frame from the client; `Err`
    /// (the reason) when it breaks the stream's rules.
    fn deliver(&self, frame: Frame) -> Result<(), String> {
        let call_id = frame.call_id;
        let end = frame.flags.contains(FrameFlags::END_STREAM);
        match frame.kind {
            FrameKind::Message => {
                let broken =
                    |error: FeedError| format!("client sent {} (call {call_id})", error.describe());
                self.feed
                    .push(frame.payload.into_contiguous())
                    .map_err(broken)?;
                if end {
                    self.feed.peer_end(Metadata::new()).map_err(broken)?;
                }
                Ok(())
            }
            FrameKind::Headers if end && frame.metadata.is_empty() => self
                .feed
                .peer_end(Metadata::new())
                .map_err(|_| format!("client ended stream {call_id} twice")),
            FrameKind::Headers => Err(format!(
                "client sent headers on stream {call_id} (only END_STREAM headers, without metadata, are a client's)"
            )),
            FrameKind::Window => {
                self.credits.grant(frame.window_grant().unwrap_or(0));
                Ok(())
            }
            _ => unreachable!("only stream frames come here"),
        }
    }

    /// The call ended: its handler's sends fail with `why`, and so does a
    /// read of messages the client never sent. (`why` is made only when
    /// something still holds the stream's halves.)
    fn close(self, why: impl FnOnce() -> Status) {
        if Arc::strong_count(&self.credits) == 1 && !self.feed.is_shared() {
            return;
        }
        let why = why();
        self.credits.close(why.clone());
        self.feed.finish(Err(why));
    }
}

fn status_frame(call_id: u64, status: Status) -> Frame {
    let code = if status.code() == Code::Ok {
        Code::Unknown
    } else {
        status.code()
    };
    let message = Payload::from(status.message().to_owned());
    Frame::response(call_id, code, status.metadata().clone(), message)
}

/// What the server does around every call, whoever brought it (a
/// connection of rpc-core's frames, or a front end): metrics, the span and
/// the access log.
pub(crate) struct CallLog {
    record: Option<CallRecord>,
    access: Option<(String, String)>,
    span: tracing::Span,
    started: Option<Instant>,
    request_len: usize,
}

impl CallLog {
    pub(crate) fn start(
        method: &str,
        call_id: u64,
        peer: &str,
        request_len: usize,
        access_log: bool,
    ) -> CallLog {
        let span = tracing::debug_span!("rpc.server", method = %method, call_id, %peer);
        // Only a call someone traces or logs reads the clock for its duration.
        let started = (!span.is_disabled() || access_log).then(Instant::now);
        CallLog {
            record: CallRecord::start(Side::Server, method, request_len),
            access: access_log.then(|| (method.to_owned(), peer.to_owned())),
            span,
            started,
            request_len,
        }
    }

    pub(crate) fn span(&self) -> &tracing::Span {
        &self.span
    }

    pub(crate) fn finish(self, code: Code, response_len: usize) {
        let CallLog {
            record,
            access,
            span,
            started,
            request_len,
        } = self;
        if let Some(record) = record {
            record.finish(code, response_len);
        }
        let elapsed_us = started.map_or(0, |started| started.elapsed().as_micros() as u64);
        if let Some((method, peer)) = access {
            tracing::info!(
                target: "rpc_core::access",
                %method,
                %peer,
                code = %code,
                latency_us = elapsed_us,
                request_bytes = request_len,
                response_bytes = response_len,
                "call"
            );
        }
        tracing::debug!(parent: &span, code = ?code, elapsed_us, "call finished");
    }
}

/// Runs the server's service for one call: under its deadline
/// (`DeadlineExceeded` when it passes), a panic caught as `Internal` for
/// that call alone; then, for a streaming call, checks that the service
/// took the stream (or answered as a unary method does a call of unknown
/// kind).
pub(crate) async fn run_service(
    service: ServerService,
    request: Request<Bytes>,
    stream: Option<&ServerStreamSlot>,
    span: &tracing::Span,
) -> Result<Response<Payload>, Status> {
    let deadline = request.timeout();
    // Named in the refusal of a streaming call no service took.
    let method = stream.map(|_| request.method().unwrap_or_default().to_owned());
    let handler = AssertUnwindSafe(service.oneshot(request)).catch_unwind();
    let outcome = match deadline {
        Some(deadline) => tokio::time::timeout(deadline, handler)
            .instrument(span.clone())
            .await
            .unwrap_or_else(|_| {
                Ok(Err(Status::deadline_exceeded(
                    "deadline exceeded on the server",
                )))
            }),
        None => handler.instrument(span.clone()).await,
    };
    match outcome {
        // A service that took no stream from a streaming call cannot serve it.
        Ok(Ok(response))
            if stream.is_some_and(|slot| !slot.0.is_taken())
                && response.extensions().get::<UnaryAnswer>().is_none() =>
        {
            Err(Status::unimplemented(format!(
                "{} is not a streaming method: call it as a unary one",
                method.as_deref().unwrap_or_default()
            )))
        }
        Ok(result) => result,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(parent: span, panic = %what, "handler panicked");
            Err(Status::internal("handler panicked"))
        }
    }
}

/// A response over the frame limit, as the status the call gets instead.
pub(crate) fn over_frame_limit(len: usize, max_frame_len: usize) -> Option<Status> {
    (len > max_frame_len).then(|| {
        Status::resource_exhausted(format!(
            "response of {len} bytes exceeds the frame limit of {max_frame_len} bytes"
        ))
    })
}

async fn run_call(
    frame: Frame,
    stream: Option<ServerStreamSlot>,
    service: ServerService,
    peer: String,
    outbound: OutboundQueue,
    max_frame_len: usize,
    access_log: bool,
) -> u64 {
    let call_id = frame.call_id;
    let log = CallLog::start(&frame.path, call_id, &peer, frame.payload.len(), access_log);
    let deadline = frame.deadline;
    let kind_unknown = frame.is_kind_unknown();
    let payload = frame.payload.into_contiguous();
    // A stream's messages are its stream's (and, for a call of unknown
    // kind that came whole, a unary method's too: see WholeStream).
    let (payload, whole_stream) = match &stream {
        None => (payload, None),
        Some(_) if kind_unknown && !payload.is_empty() => {
            (Bytes::new(), Some(WholeStream(payload)))
        }
        Some(_) => (Bytes::new(), None),
    };
    let mut request = Request::new(payload);
    *request.metadata_mut() = frame.metadata;
    if let Some(deadline) = deadline {
        request.set_timeout(deadline);
    }
    if kind_unknown {
        request.extensions_mut().insert(KindUnknown);
    }
    if let Some(whole_stream) = whole_stream {
        request.extensions_mut().insert(whole_stream);
    }
    request.set_method(frame.path);
    request.extensions_mut().insert(PeerInfo { addr: peer });
    if let Some(stream) = &stream {
        request.extensions_mut().insert(stream.clone());
    }

    let response = match run_service(service, request, stream.as_ref(), log.span()).await {
        Ok(response) => {
            let unary_answer = kind_unknown && response.extensions().get::<UnaryAnswer>().is_some();
            let (metadata, payload): (Metadata, Payload) = response.into_parts();
            // A stream's messages went before; its end carries none (but a
            // unary method's answer to a call of unknown kind).
            let payload = if stream.is_some() && !unary_answer {
                Payload::new()
            } else {
                payload
            };
            Frame::response(call_id, Code::Ok, metadata, payload)
        }
        Err(status) => status_frame(call_id, status),
    };
    let response = match over_frame_limit(response.encoded_len(), max_frame_len) {
        Some(status) => status_frame(call_id, status),
        None => response,
    };
    log.finish(response.status, response.payload.len());
    // Waits for room in the queue; if the writer is gone there is no one to tell.
    let response = response.encode_parts();
    match outbound.try_reserve(response.len()) {
        Some(space) => {
            let _ = outbound.send_reserved(response, space);
        }
        None => {
            let _ = outbound.send(response).await;
        }
    }
    call_id
}
