//! The reading side of a client connection: frames are read by the
//! connection's reader task, or, on a multi-thread runtime, by a caller that
//! waits outside any task (a `#[tokio::main]` body, `block_on`) while nobody
//! else reads: it reads and hands out frames itself until its own response
//! is there, so that response needs no wake-up of another thread (whose
//! cost on a small VM is tens of microseconds). When such a caller stops it
//! leaves the stream to the reader task: it polls the stream quietly with
//! the task's waker ([`hand_back`]), so the task is woken only when a frame
//! comes, not once per call.

use std::sync::atomic::Ordering;
use std::sync::{Mutex, TryLockError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures_util::StreamExt;

use super::connection::{CallFailure, Keepalive, Shared, StreamWaiter, Waiter};
use crate::conn_io::OutboundQueue;
use crate::frame::{Excess, Frame, FrameError, FrameFlags, FrameKind};
use crate::metadata::Metadata;
use crate::status::{Code, Status};
use crate::stream::FeedError;
use crate::transport::{FrameStream, TransportError, poll_quietly};
use crate::wake_gate::WakeGated;

/// Frames one turn of a reader handles before it yields.
const READ_BATCH: usize = 64;

/// The connection's frame stream and who reads it.
pub(super) struct ReadSide {
    core: Mutex<ReaderCore>,
    /// The reader task's waker, as of its last poll: a caller that stops
    /// reading leaves the stream to it.
    task: Mutex<Option<Waker>>,
}

struct ReaderCore {
    stream: FrameStream,
    /// When a frame last came (keepalive).
    last_heard: tokio::time::Instant,
    /// Why the connection ended, when a reader saw it end.
    ended: Option<String>,
}

impl ReadSide {
    pub(super) fn new(stream: FrameStream) -> ReadSide {
        ReadSide {
            core: Mutex::new(ReaderCore {
                stream,
                last_heard: tokio::time::Instant::now(),
                ended: None,
            }),
            task: Mutex::new(None),
        }
    }

    /// Wakes the reader task (a caller saw the connection end).
    pub(super) fn wake_task(&self) {
        if let Some(waker) = self.task_waker() {
            waker.wake();
        }
    }

    fn register_task(&self, waker: &Waker) {
        let mut task = self
            .task
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        if !task.as_ref().is_some_and(|known| known.will_wake(waker)) {
            *task = Some(waker.clone());
        }
    }

    fn task_waker(&self) -> Option<Waker> {
        self.task
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .clone()
    }

    fn last_heard(&self) -> tokio::time::Instant {
        self.core
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .last_heard
    }
}

/// Whether a caller on this thread should read for itself, on a connection
/// of a multi-thread runtime: it waits outside any task (tasks get their
/// wake-ups through their worker's LIFO slot, the runtime's `block_on`
/// through another thread).
pub(super) fn caller_reads(multi_thread: bool) -> bool {
    multi_thread && tokio::task::try_id().is_none()
}

/// Reads and handles frames until `done()` says so, the stream has nothing
/// (`Pending`, `cx` registered with it), a batch was handled (`Ready(Ok)`),
/// or the connection ended (`Ready(Err(reason))`). `None` when another
/// reader holds the stream.
pub(super) fn read_some(
    shared: &Shared,
    outbound: &OutboundQueue,
    max_frame_len: usize,
    cx: &mut Context<'_>,
    done: &mut dyn FnMut() -> bool,
) -> Option<Poll<Result<(), String>>> {
    let mut core = match shared.read.core.try_lock() {
        Ok(core) => core,
        Err(TryLockError::Poisoned(poison)) => poison.into_inner(),
        Err(TryLockError::WouldBlock) => return None,
    };
    if let Some(reason) = &core.ended {
        return Some(Poll::Ready(Err(reason.clone())));
    }
    for _ in 0..READ_BATCH {
        if done() {
            return Some(Poll::Ready(Ok(())));
        }
        match core.stream.poll_next_unpin(cx) {
            Poll::Pending => return Some(Poll::Pending),
            Poll::Ready(item) => {
                core.last_heard = tokio::time::Instant::now();
                if let Err(reason) = handle_item(shared, outbound, max_frame_len, item) {
                    core.ended = Some(reason.clone());
                    return Some(Poll::Ready(Err(reason)));
                }
            }
        }
    }
    Some(Poll::Ready(Ok(())))
}

/// A caller that read for itself stops: it leaves the stream to the reader
/// task without waking it. It takes what frames are there (handing them
/// out) and polls the stream quietly with the task's waker, so the next
/// frame wakes the task. A batch that does not end, a connection that
/// ended, or a task that never polled yet: the task is woken instead.
pub(super) fn hand_back(shared: &Shared, outbound: &OutboundQueue, max_frame_len: usize) {
    let mut core = match shared.read.core.try_lock() {
        Ok(core) => core,
        Err(TryLockError::Poisoned(poison)) => poison.into_inner(),
        // Another reader holds the stream; it leaves it in turn.
        Err(TryLockError::WouldBlock) => return,
    };
    let Some(task) = shared.read.task_waker() else {
        drop(core);
        shared.read.wake_task();
        return;
    };
    if core.ended.is_none() {
        let mut cx = Context::from_waker(&task);
        for _ in 0..READ_BATCH {
            match poll_quietly(|| core.stream.poll_next_unpin(&mut cx)) {
                // The stream holds the task's waker now.
                Poll::Pending => return,
                Poll::Ready(item) => {
                    core.last_heard = tokio::time::Instant::now();
                    if let Err(reason) = handle_item(shared, outbound, max_frame_len, item) {
                        core.ended = Some(reason);
                        break;
                    }
                }
            }
        }
    }
    drop(core);
    task.wake();
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

pub(super) async fn read_frames(
    shared: std::sync::Arc<Shared>,
    outbound: OutboundQueue,
    max_frame_len: usize,
    keepalive: Option<Keepalive>,
) {
    // However this task ends, the transport's stream goes with it (the
    // connection's shared state may outlive it): the peer sees us gone.
    let _release = ReleaseStream(&shared);
    let mut ticker = keepalive.map(|keepalive| {
        let period = keepalive
            .interval
            .min(keepalive.timeout)
            .max(Duration::from_millis(1));
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker
    });
    // Polled only when the token wakes it, not once per frame.
    let shutting_down = WakeGated::new(shared.shutdown.cancelled());
    tokio::pin!(shutting_down);
    let reading = std::future::poll_fn(|cx| {
        shared.read.register_task(cx.waker());
        match read_some(&shared, &outbound, max_frame_len, cx, &mut || false) {
            // A caller reads; it wakes this task when it stops.
            None => Poll::Pending,
            Some(Poll::Ready(Ok(()))) => {
                // A whole batch: let the tasks it woke run.
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            Some(Poll::Ready(Err(reason))) => Poll::Ready(reason),
            Some(Poll::Pending) => Poll::Pending,
        }
    });
    tokio::pin!(reading);
    let reason = loop {
        tokio::select! {
            () = &mut shutting_down => return,
            () = keepalive_tick(&mut ticker) => {
                let Some(keepalive) = keepalive else { continue };
                let silent = shared.read.last_heard().elapsed();
                if silent >= keepalive.interval + keepalive.timeout {
                    tracing::warn!(peer = %shared.peer, ?silent, "closing connection: keepalive timed out");
                    break format!("connection lost: nothing heard from the server for {silent:?} (keepalive)");
                }
                if silent >= keepalive.interval {
                    // One per period at most: bounded without taking room from requests.
                    let ping = Frame::control(FrameKind::Ping, FrameFlags::EMPTY, 0);
                    let _ = outbound.send_unbounded(ping.encode_parts());
                }
            }
            reason = &mut reading => break reason,
        }
    };
    shared.close(Status::unavailable(reason));
}

/// Drops the transport's stream when the reader task ends.
struct ReleaseStream<'a>(&'a Shared);

impl Drop for ReleaseStream<'_> {
    fn drop(&mut self) {
        let mut core = self
            .0
            .read
            .core
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        core.ended
            .get_or_insert_with(|| "connection closed".to_owned());
        core.stream = Box::pin(futures_util::stream::empty());
    }
}

/// Handles one item of the stream; `Err(reason)` ends the connection.
fn handle_item(
    shared: &Shared,
    outbound: &OutboundQueue,
    max_frame_len: usize,
    item: Option<Result<bytes::Bytes, TransportError>>,
) -> Result<(), String> {
    let decoded = match item {
        None => return Err("connection closed by peer".to_owned()),
        Some(Err(TransportError::Refused { head, len, max })) => {
            let excess = Excess::of_refused(&head, len, max);
            Err((head, excess))
        }
        Some(Err(error)) => return Err(format!("connection lost: {error}")),
        Some(Ok(bytes)) => match Frame::decode(bytes.clone(), max_frame_len) {
            Ok(frame) => Ok(frame),
            Err(FrameError::TooLarge { max, .. }) if bytes.len() > max => {
                let len = bytes.len();
                Err((bytes, Excess::Frame { len, max }))
            }
            Err(FrameError::MetadataOverLimit { excess, .. }) => {
                Err((bytes, Excess::Metadata(excess)))
            }
            Err(error) => {
                tracing::warn!(peer = %shared.peer, %error, "closing connection: bad frame from server");
                return Err(format!("protocol error from server: {error}"));
            }
        },
    };
    let frame = match decoded {
        Ok(frame) => frame,
        Err((head, excess)) => {
            // A response over our limit fails its call alone.
            match Frame::peek_header(&head) {
                Some((FrameKind::Response | FrameKind::Message | FrameKind::Headers, call_id)) => {
                    let waiter = shared.table().pending.remove(&call_id);
                    if let Some(waiter) = waiter {
                        if matches!(waiter, Waiter::Stream(_)) {
                            // The server still runs the call: stop it.
                            let cancel =
                                Frame::control(FrameKind::Cancel, FrameFlags::EMPTY, call_id);
                            let _ = outbound.send_unbounded(cancel.encode_parts());
                        }
                        let hint = match excess {
                            Excess::Frame { .. } => " (Channel::builder().max_frame_len)",
                            Excess::Metadata(_) => "",
                        };
                        waiter.fail(CallFailure::processed(Status::resource_exhausted(format!(
                            "{}{hint}",
                            excess.describe("response", "this channel's")
                        ))));
                    }
                    return Ok(());
                }
                _ => {
                    return Err(format!(
                        "protocol error from server: {}",
                        excess.describe("frame", "the")
                    ));
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
                        return Err("protocol error from server: a streaming call's final response carries a message".to_owned());
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
                return Err("the server sent GOAWAY and no call is left".to_owned());
            }
        }
        FrameKind::Headers | FrameKind::Message | FrameKind::Window => {
            if let Err(error) = stream_frame(shared, frame) {
                tracing::warn!(peer = %shared.peer, %error, "closing connection: bad stream frame from server");
                return Err(format!("protocol error from server: {error}"));
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
            let closed = format!("server closed the connection: {reason}");
            // A refusal for want of room (a connection limit): the calls on
            // it fail `ResourceExhausted`, as a refused set-up does (and a
            // balancer reads the source to eject the endpoint).
            if frame.status == Code::ResourceExhausted {
                shared.close(
                    Status::resource_exhausted(closed.clone())
                        .with_source(TransportError::ResourceExhausted(reason)),
                );
            }
            return Err(closed);
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
                return Err("the server sent GOAWAY and no call is left".to_owned());
            }
        }
        FrameKind::Request | FrameKind::Cancel => {
            tracing::warn!(peer = %shared.peer, kind = ?frame.kind, "closing connection: server sent a client-only frame");
            return Err(format!(
                "protocol error from server: unexpected {:?} frame",
                frame.kind
            ));
        }
    }
    Ok(())
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
