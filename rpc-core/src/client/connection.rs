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

use futures_util::FutureExt;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::conn_io::{OutboundQueue, flush_inline_by_default};
use crate::frame::{Frame, FrameFlags, FrameKind};
use crate::metadata::Metadata;
use crate::metrics::{ConnectionRecord, Side};
use crate::payload::Payload;
use crate::status::Status;
use crate::stream::{InboundFeed, MessageSink, RawInbound, SendCredits};
use crate::transport::Connection;

use super::reader::{ReadSide, caller_reads, hand_back, read_frames, read_some};
use crate::wake_gate::WakeGated;

/// Why a call failed, and whether it may be sent again on another connection
/// because this server never saw it.
#[derive(Debug)]
pub struct CallFailure {
    pub(crate) status: Status,
    pub(crate) unprocessed: bool,
}

impl CallFailure {
    /// A call the server saw (or may have seen): it ends with `status`.
    pub fn processed(status: Status) -> CallFailure {
        CallFailure {
            status,
            unprocessed: false,
        }
    }

    /// A call the server provably never saw (the connection was closed
    /// or going away before it went, or the server refused its stream
    /// unprocessed): the channel sends it again, once, on the connection
    /// it then has (a new one when this one is no longer usable).
    pub fn unprocessed(status: Status) -> CallFailure {
        CallFailure {
            status,
            unprocessed: true,
        }
    }

    /// The status the call ends with.
    pub fn status(&self) -> &Status {
        &self.status
    }
}

impl From<Status> for CallFailure {
    fn from(status: Status) -> CallFailure {
        CallFailure::processed(status)
    }
}

pub(super) type CallResult = Result<Frame, CallFailure>;

/// Who waits for a call's frames.
pub(super) enum Waiter {
    /// A unary call: its response.
    Unary(oneshot::Sender<CallResult>),
    /// A streaming call: its headers, then its messages and end.
    Stream(StreamWaiter),
}

pub(super) struct StreamWaiter {
    /// Until the server's headers (or its final response) arrive.
    pub(super) headers: Option<oneshot::Sender<CallResult>>,
    pub(super) feed: InboundFeed,
    pub(super) credits: Arc<SendCredits>,
    /// Opened with `KIND_UNKNOWN`: a unary method may answer with one final
    /// response that carries its message.
    pub(super) kind_unknown: bool,
}

impl StreamWaiter {
    pub(super) fn fail(self, failure: CallFailure) {
        self.credits.close(failure.status.clone());
        self.feed.finish(Err(failure.status.clone()));
        if let Some(headers) = self.headers {
            let _ = headers.send(Err(failure));
        }
    }
}

impl Waiter {
    pub(super) fn fail(self, failure: CallFailure) {
        match self {
            Waiter::Unary(waiter) => {
                let _ = waiter.send(Err(failure));
            }
            Waiter::Stream(stream) => stream.fail(failure),
        }
    }
}

#[derive(Default)]
pub(super) struct CallTable {
    pub(super) pending: HashMap<u64, Waiter>,
    /// Set once the connection is closed: why, as the status new calls get.
    closed: Option<Status>,
    /// Set by a graceful GOAWAY: the highest call id the server saw.
    pub(super) goaway: Option<u64>,
}

pub(super) struct Shared {
    calls: Mutex<CallTable>,
    /// A GOAWAY arrived: pending calls finish here, new calls go elsewhere.
    pub(super) draining: AtomicBool,
    /// Set with `shutdown`: read per call, where the token's own check
    /// takes a lock.
    closed: AtomicBool,
    pub(super) shutdown: CancellationToken,
    pub(super) peer: String,
    /// The frame stream and its readers.
    pub(super) read: ReadSide,
}

impl Shared {
    pub(super) fn table(&self) -> MutexGuard<'_, CallTable> {
        self.calls
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// Marks the connection closed and fails every pending call with `status`.
    pub(super) fn close(&self, status: Status) {
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
    /// Started on a multi-thread runtime (see [`caller_reads`]).
    multi_thread: bool,
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
            read: ReadSide::new(stream),
        });
        // Read once: the runtime's flavour decides how frames are written
        // and who reads them.
        let multi_thread = flush_inline_by_default();
        let (outbound, writer) = OutboundQueue::new(outbound_queue_bytes, None, sink, multi_thread);

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
            read_frames(shared.clone(), outbound.clone(), max_frame_len, keepalive)
                .map(move |()| drop(counted)),
        );

        Arc::new(ClientConnection {
            shared,
            outbound,
            next_call_id: AtomicU64::new(1),
            max_frame_len,
            multi_thread,
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
        check_request(path, &metadata)?;
        let call_id = self.next_call_id.fetch_add(1, Ordering::Relaxed);
        let frame = Frame::request(call_id, path, deadline, metadata, payload);
        let (sender, receiver) = oneshot::channel();
        self.queue_request(frame, Waiter::Unary(sender)).await?;
        Ok(PendingCall {
            connection: self.clone(),
            call_id,
            receiver,
            finished: false,
            owns_call: true,
            reads: caller_reads(self.multi_thread),
            read: false,
        })
    }

    /// Opens a streaming call: registers it and queues its request frame.
    /// Its messages go through the returned sink, unless `whole` (the
    /// client's whole stream, encoded) went with the request frame
    /// (`sent_whole`: it did, when the frame stays within the limit); the
    /// server's headers arrive on `headers`, its messages and end on
    /// `inbound`.
    pub(crate) async fn start_stream(
        self: &Arc<Self>,
        path: &str,
        deadline: Option<Duration>,
        metadata: Metadata,
        kind_unknown: bool,
        whole: Option<Payload>,
    ) -> Result<OpenStream, CallFailure> {
        check_request(path, &metadata)?;
        let call_id = self.next_call_id.fetch_add(1, Ordering::Relaxed);
        let mut frame = match whole {
            Some(messages) => {
                let frame = Frame::whole_stream_request(
                    call_id,
                    path,
                    deadline,
                    metadata.clone(),
                    messages,
                );
                if frame.encoded_len() <= self.max_frame_len {
                    frame
                } else {
                    Frame::stream_request(call_id, path, deadline, metadata)
                }
            }
            None => Frame::stream_request(call_id, path, deadline, metadata),
        };
        let sent_whole = frame.flags.contains(FrameFlags::END_STREAM);
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
            headers: PendingCall {
                connection: self.clone(),
                call_id,
                receiver: headers,
                finished: false,
                // The stream's guard ends the call when it is dropped.
                owns_call: false,
                reads: caller_reads(self.multi_thread),
                read: false,
            },
            sent_whole,
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

    /// A caller that read frames itself stops reading (see [`hand_back`]).
    fn hand_back(&self) {
        hand_back(&self.shared, &self.outbound, self.max_frame_len);
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

/// What a request frame carries beside its payload, checked before anything
/// is sent: a call the server would refuse fails here, unsent.
fn check_request(path: &str, metadata: &Metadata) -> Result<(), CallFailure> {
    if path.len() > crate::frame::MAX_PATH_LEN {
        return Err(Status::invalid_argument("method path longer than 65535 bytes").into());
    }
    if let Err(excess) = metadata.check_limits() {
        return Err(Status::invalid_argument(format!("request {excess}")).into());
    }
    Ok(())
}

/// A streaming call just opened (see [`ClientConnection::start_stream`]).
pub(crate) struct OpenStream {
    pub(crate) call_id: u64,
    /// The server's headers, or a final response (which may carry the one
    /// message of a call of unknown kind).
    pub(crate) headers: PendingCall,
    /// The client's whole stream went with the request frame.
    pub(crate) sent_whole: bool,
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
    /// Dropped before its answer, it abandons the call (a unary call's;
    /// a stream's headers leave that to the stream).
    owns_call: bool,
    /// The caller reads frames itself while nobody else does (see
    /// [`super::reader`]).
    reads: bool,
    /// It did: the reader task takes over when the call ends.
    read: bool,
}

impl PendingCall {
    pub(crate) fn call_id(&self) -> u64 {
        self.call_id
    }
}

impl Future for PendingCall {
    type Output = CallResult;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<CallResult> {
        let this = &mut *self;
        // `Some(None)`: the connection dropped the call's sender.
        let mut answer = match Pin::new(&mut this.receiver).poll(cx) {
            Poll::Pending => None,
            Poll::Ready(answer) => Some(answer.ok()),
        };
        if answer.is_none() && this.reads {
            let connection = &this.connection;
            let receiver = &mut this.receiver;
            let read = read_some(
                &connection.shared,
                &connection.outbound,
                connection.max_frame_len,
                cx,
                &mut || match receiver.try_recv() {
                    Err(oneshot::error::TryRecvError::Empty) => false,
                    Ok(got) => {
                        answer = Some(Some(got));
                        true
                    }
                    Err(oneshot::error::TryRecvError::Closed) => {
                        answer = Some(None);
                        true
                    }
                },
            );
            if let Some(read) = read {
                this.read = true;
                match read {
                    // A batch and no answer yet: poll again soon.
                    Poll::Ready(Ok(())) if answer.is_none() => cx.waker().wake_by_ref(),
                    // The connection ended: the reader task closes it
                    // (which fails this call).
                    Poll::Ready(Err(_)) => connection.shared.read.wake_task(),
                    _ => {}
                }
            }
        }
        let outcome = match answer {
            None => return Poll::Pending,
            Some(Some(outcome)) => outcome,
            Some(None) => Err(CallFailure::processed(Status::unavailable(
                "connection closed",
            ))),
        };
        this.finished = true;
        if this.read {
            // The stream may hold this caller's waker: the task reads again.
            this.connection.hand_back();
        }
        Poll::Ready(outcome)
    }
}

impl Drop for PendingCall {
    fn drop(&mut self) {
        if !self.finished {
            if self.owns_call {
                self.connection.abandon(self.call_id);
            }
            if self.read {
                self.connection.hand_back();
            }
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
