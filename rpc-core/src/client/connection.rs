//! One multiplexed client connection: a call table, a reader task and a writer task.
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

use crate::conn_io::{OutboundQueue, write_frames};
use crate::frame::{Frame, FrameError, FrameFlags, FrameKind};
use crate::metadata::Metadata;
use crate::metrics::{ConnectionRecord, Side};
use crate::payload::Payload;
use crate::status::{Code, Status};
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

#[derive(Default)]
struct CallTable {
    pending: HashMap<u64, oneshot::Sender<CallResult>>,
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
            let _ = waiter.send(Err(CallFailure::processed(status.clone())));
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
        let (outbound, outbound_rx) = OutboundQueue::new(outbound_queue_bytes, None);

        let writer_shared = shared.clone();
        let writer_queue = outbound.clone();
        tokio::spawn(async move {
            let outcome = tokio::select! {
                outcome = write_frames(sink, outbound_rx, None) => outcome,
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
        if path.len() > crate::frame::MAX_PATH_LEN {
            return Err(Status::invalid_argument("method path longer than 65535 bytes").into());
        }
        let call_id = self.next_call_id.fetch_add(1, Ordering::Relaxed);
        let frame = Frame::request(call_id, path, deadline, metadata, payload);
        let len = frame.encoded_len();
        if len > self.max_frame_len {
            return Err(Status::resource_exhausted(format!(
                "request frame of {len} bytes exceeds the frame limit of {} bytes",
                self.max_frame_len
            ))
            .into());
        }
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
        let (sender, receiver) = oneshot::channel();
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
            table.pending.insert(call_id, sender);
        }
        if self.outbound.send_reserved(encoded, space).is_err() {
            self.shared.table().pending.remove(&call_id);
            return Err(closed());
        }
        Ok(PendingCall {
            connection: self.clone(),
            call_id,
            receiver,
            finished: false,
        })
    }

    fn abandon(&self, call_id: u64) {
        let was_pending = self.shared.table().pending.remove(&call_id).is_some();
        if was_pending {
            // At most one per call: bounded without taking room from requests.
            let cancel = Frame::control(FrameKind::Cancel, FrameFlags::EMPTY, call_id);
            let _ = self.outbound.send_unbounded(cancel.encode_parts());
        }
    }
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
                    Some((FrameKind::Response, call_id)) => {
                        let waiter = shared.table().pending.remove(&call_id);
                        if let Some(waiter) = waiter {
                            let _ = waiter.send(Err(CallFailure::processed(Status::resource_exhausted(
                                format!("response of {len} bytes exceeds this channel's limit of {max} bytes (Channel::builder().max_frame_len)"),
                            ))));
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
                if let Some(waiter) = waiter {
                    let _ = waiter.send(Ok(frame));
                }
                if drained {
                    break "the server sent GOAWAY and no call is left".to_owned();
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
                    let _ = waiter.send(Err(CallFailure::unprocessed(Status::unavailable(
                        "the server sent GOAWAY before it saw this call",
                    ))));
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
