//! One multiplexed client connection: a call table, a reader task and a writer task.
//!
//! Calls are matched to responses by call id. The table is the single source
//! of truth for which calls are pending: a call registers before its request
//! is queued, the reader removes it to deliver the response, a dropped call
//! removes it and queues a cancel frame, and closing the connection drains it,
//! failing every pending call at once.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::conn_io::write_frames;
use crate::frame::{Frame, FrameFlags, FrameKind};
use crate::metadata::Metadata;
use crate::status::{Code, Status};
use crate::transport::{Connection, FrameStream};

type CallResult = Result<Frame, Status>;

#[derive(Default)]
struct CallTable {
    pending: HashMap<u64, oneshot::Sender<CallResult>>,
    /// Set once the connection is closed: why, as the status new calls get.
    closed: Option<Status>,
}

struct Shared {
    calls: Mutex<CallTable>,
    /// A GOAWAY arrived: pending calls finish here, new calls go elsewhere.
    draining: AtomicBool,
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
            let _ = waiter.send(Err(status.clone()));
        }
        self.shutdown.cancel();
    }
}

/// A live connection shared by every clone of a [`crate::Channel`].
pub(crate) struct ClientConnection {
    shared: Arc<Shared>,
    outbound: mpsc::UnboundedSender<Bytes>,
    next_call_id: AtomicU64,
    max_frame_len: usize,
}

impl ClientConnection {
    /// Takes over `connection` and starts its reader and writer tasks.
    pub(crate) fn start(
        connection: Connection,
        max_frame_len: usize,
        keepalive: Option<Keepalive>,
    ) -> Arc<ClientConnection> {
        let Connection { sink, stream, peer } = connection;
        let shared = Arc::new(Shared {
            calls: Mutex::default(),
            draining: AtomicBool::new(false),
            shutdown: CancellationToken::new(),
            peer,
        });
        let (outbound, outbound_rx) = mpsc::unbounded_channel();

        let writer_shared = shared.clone();
        tokio::spawn(async move {
            let outcome = tokio::select! {
                outcome = write_frames(sink, outbound_rx) => outcome,
                () = writer_shared.shutdown.cancelled() => Ok(()),
            };
            let reason = match outcome {
                Ok(()) => "connection closed".to_owned(),
                Err(error) => format!("connection lost: {error}"),
            };
            writer_shared.close(Status::unavailable(reason));
        });

        tokio::spawn(read_frames(
            shared.clone(),
            stream,
            outbound.clone(),
            max_frame_len,
            keepalive,
        ));

        Arc::new(ClientConnection {
            shared,
            outbound,
            next_call_id: AtomicU64::new(1),
            max_frame_len,
        })
    }

    /// True while new calls may start here.
    pub(crate) fn is_usable(&self) -> bool {
        !self.shared.draining.load(Ordering::Acquire) && !self.shared.shutdown.is_cancelled()
    }

    /// Registers a call and queues its request frame.
    pub(crate) fn start_call(
        self: &Arc<Self>,
        path: &str,
        deadline: Option<Duration>,
        metadata: Metadata,
        payload: Bytes,
    ) -> Result<PendingCall, Status> {
        let call_id = self.next_call_id.fetch_add(1, Ordering::Relaxed);
        let frame = Frame::request(call_id, path, deadline, metadata, payload);
        let len = frame.encoded_len();
        if len > self.max_frame_len {
            return Err(Status::resource_exhausted(format!(
                "request frame of {len} bytes exceeds the frame limit of {} bytes",
                self.max_frame_len
            )));
        }
        if path.len() > crate::frame::MAX_PATH_LEN {
            return Err(Status::invalid_argument(
                "method path longer than 65535 bytes",
            ));
        }
        let (sender, receiver) = oneshot::channel();
        {
            let mut table = self.shared.table();
            if let Some(status) = &table.closed {
                return Err(status.clone());
            }
            table.pending.insert(call_id, sender);
        }
        if self.outbound.send(frame.encode()).is_err() {
            self.shared.table().pending.remove(&call_id);
            return Err(Status::unavailable("connection closed"));
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
            let cancel = Frame::control(FrameKind::Cancel, FrameFlags::EMPTY, call_id);
            let _ = self.outbound.send(cancel.encode());
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
            Poll::Ready(Err(_)) => Err(Status::unavailable("connection closed")),
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
    outbound: mpsc::UnboundedSender<Bytes>,
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
    let reason = loop {
        let next = tokio::select! {
            () = shared.shutdown.cancelled() => return,
            () = keepalive_tick(&mut ticker) => {
                let Some(keepalive) = keepalive else { continue };
                let silent = last_heard.elapsed();
                if silent >= keepalive.interval + keepalive.timeout {
                    tracing::warn!(peer = %shared.peer, ?silent, "closing connection: keepalive timed out");
                    break format!("connection lost: nothing heard from the server for {silent:?} (keepalive)");
                }
                if silent >= keepalive.interval {
                    let ping = Frame::control(FrameKind::Ping, FrameFlags::EMPTY, 0);
                    let _ = outbound.send(ping.encode());
                }
                continue;
            }
            next = stream.next() => next,
        };
        last_heard = tokio::time::Instant::now();
        let bytes = match next {
            None => break "connection closed by peer".to_owned(),
            Some(Err(error)) => break format!("connection lost: {error}"),
            Some(Ok(bytes)) => bytes,
        };
        let frame = match Frame::decode(bytes, max_frame_len) {
            Ok(frame) => frame,
            Err(error) => {
                tracing::warn!(peer = %shared.peer, %error, "closing connection: bad frame from server");
                break format!("protocol error from server: {error}");
            }
        };
        match frame.kind {
            FrameKind::Response => {
                let waiter = shared.table().pending.remove(&frame.call_id);
                // No waiter: the call was cancelled or timed out; drop the late response.
                if let Some(waiter) = waiter {
                    let _ = waiter.send(Ok(frame));
                }
            }
            FrameKind::Ping if !frame.flags.contains(FrameFlags::ACK) => {
                let _ = outbound
                    .send(Frame::control(FrameKind::Ping, FrameFlags::ACK, frame.call_id).encode());
            }
            FrameKind::Ping => {}
            FrameKind::GoAway if frame.status != Code::Ok => {
                let reason = String::from_utf8_lossy(&frame.payload).into_owned();
                tracing::warn!(peer = %shared.peer, %reason, "server closed the connection");
                break format!("server closed the connection: {reason}");
            }
            FrameKind::GoAway => {
                tracing::debug!(peer = %shared.peer, "server sent GOAWAY; new calls use a new connection");
                shared.draining.store(true, Ordering::Release);
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
