//! The write half shared by client and server connections: a queue bounded in
//! bytes, drained into the transport by the tasks that send (on multi-thread
//! runtimes) or by the connection's writer task ([`writer`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use tokio::sync::{Notify, mpsc};

use crate::frame::{EncodedFrame, HEADER_LEN};
use crate::transport::FrameSink;

mod writer;

use writer::WriterShared;
pub(crate) use writer::{WriterTask, flush_inline_by_default};

/// Most frames written before one flush.
pub(crate) const WRITE_BATCH: usize = 64;

/// Default bytes of frames one connection queues for its transport; see
/// [`crate::server::Server::outbound_queue_bytes`].
pub const DEFAULT_OUTBOUND_QUEUE_BYTES: usize = 1 << 20;

/// Default of [`crate::server::Server::outbound_budget`]: 32 MiB.
pub const DEFAULT_OUTBOUND_BUDGET: usize = 32 << 20;

/// The least a connection may queue however many share the outbound budget.
pub const OUTBOUND_SHARE_FLOOR: usize = 64 << 10;

/// Gauges a server keeps over all its connections' queues, and the budget
/// they share.
#[derive(Debug, Default)]
pub(crate) struct QueueGauges {
    /// Bytes queued now, all connections together.
    pub(crate) queued: AtomicUsize,
    /// The most bytes one connection ever had queued.
    pub(crate) peak: AtomicUsize,
    /// Bytes all connections' queues may hold together (0: no shared
    /// budget, each queue has its own capacity).
    budget: usize,
    /// Queues sharing the budget now.
    sharing: AtomicUsize,
}

impl QueueGauges {
    /// Gauges for queues that share `budget` bytes.
    pub(crate) fn with_budget(budget: usize) -> QueueGauges {
        QueueGauges {
            budget,
            ..QueueGauges::default()
        }
    }

    /// What one queue of `capacity` bytes may hold now: an equal share of
    /// the budget, at least [`OUTBOUND_SHARE_FLOOR`], at most `capacity`.
    pub(crate) fn share(&self, capacity: usize) -> usize {
        if self.budget == 0 {
            return capacity;
        }
        let queues = self.sharing.load(Ordering::Relaxed).max(1);
        (self.budget / queues).clamp(OUTBOUND_SHARE_FLOOR.min(capacity), capacity)
    }
}

/// A frame in the queue, with the queue space it holds until it is written.
pub(crate) struct Queued {
    pub(super) frame: EncodedFrame,
    _space: Option<Space>,
}

/// Queue space held by one frame.
pub(crate) struct Space {
    queue: Arc<QueueShared>,
    charged: usize,
}

impl Drop for Space {
    fn drop(&mut self) {
        self.queue.room.release(self.charged);
        if let Some(gauges) = &self.queue.gauges {
            gauges.queued.fetch_sub(self.charged, Ordering::Relaxed);
        }
    }
}

/// The connection's queue was closed: its writer is gone.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QueueClosed;

/// The byte count of one queue, kept lock-free: a reservation that fits is
/// one compare-and-swap and its release one subtraction; only senders that
/// find the queue full wait (on `freed`), and only then does a release
/// wake anybody. (A semaphore here cost a mutex per frame, about a tenth of
/// the calls per second at 128 in flight.)
pub(crate) struct Room {
    used: AtomicUsize,
    capacity: usize,
    /// The server-wide budget this queue has a share of, if any.
    shared_budget: Option<Arc<QueueGauges>>,
    closed: AtomicBool,
    /// Senders waiting for room (so a release knows whether to wake; and
    /// while any waits, new calls are not ready: first come, first served).
    waiting: AtomicUsize,
    /// `poll_ready`s waiting for the queue to take new calls.
    watchers: AtomicUsize,
    freed: Notify,
}

impl Room {
    /// What the queue may hold now: its capacity, or its share of the
    /// server's outbound budget when that is less.
    fn limit(&self) -> usize {
        match &self.shared_budget {
            Some(gauges) => gauges.share(self.capacity),
            None => self.capacity,
        }
    }

    /// Takes `charge` bytes if they fit (a frame larger than the whole queue
    /// fits an empty queue); false when full or closed.
    fn try_take(&self, charge: usize) -> Result<bool, QueueClosed> {
        if self.closed.load(Ordering::Acquire) {
            return Err(QueueClosed);
        }
        let limit = self.limit();
        let mut used = self.used.load(Ordering::SeqCst);
        loop {
            if used != 0 && used + charge > limit {
                return Ok(false);
            }
            match self.used.compare_exchange_weak(
                used,
                used + charge,
                Ordering::SeqCst,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(true),
                Err(actual) => used = actual,
            }
        }
    }

    fn release(&self, charge: usize) {
        // SeqCst here and in the waiters (their count, then their look at
        // `used`): either a waiter sees the room or we see the waiter.
        self.used.fetch_sub(charge, Ordering::SeqCst);
        if self.waiting.load(Ordering::SeqCst) + self.watchers.load(Ordering::SeqCst) > 0 {
            self.freed.notify_waiters();
        }
    }

    /// Waits until `charge` bytes fit, then takes them.
    async fn take(&self, charge: usize) -> Result<(), QueueClosed> {
        // Nobody waiting: take the room at once if it fits (the common case).
        if self.waiting.load(Ordering::SeqCst) == 0 && self.try_take(charge)? {
            return Ok(());
        }
        let _waiter = Waiter::new(self);
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            // Registered before the second look: a release after it wakes us.
            freed.as_mut().enable();
            if self.try_take(charge)? {
                return Ok(());
            }
            freed.await;
        }
    }

    /// Waits until the queue takes new calls (or closed).
    pub(crate) async fn not_full(&self) {
        if self.has_room() {
            return;
        }
        self.watchers.fetch_add(1, Ordering::SeqCst);
        let _watcher = Watcher(self);
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if self.has_room() {
                return;
            }
            freed.await;
        }
    }

    /// True while the queue takes new calls: room is left and no sender
    /// waits for it (or the queue closed: senders then fail fast).
    pub(crate) fn has_room(&self) -> bool {
        self.closed.load(Ordering::Acquire)
            || (self.waiting.load(Ordering::SeqCst) == 0
                && self.used.load(Ordering::SeqCst) < self.limit())
    }
}

/// Counts a waiter for as long as it waits (also when its future is dropped).
struct Waiter<'a>(&'a Room);

impl<'a> Waiter<'a> {
    fn new(room: &'a Room) -> Waiter<'a> {
        room.waiting.fetch_add(1, Ordering::SeqCst);
        Waiter(room)
    }
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        // The last waiting sender leaving may let new calls in.
        if self.0.waiting.fetch_sub(1, Ordering::SeqCst) == 1
            && self.0.watchers.load(Ordering::SeqCst) > 0
        {
            self.0.freed.notify_waiters();
        }
    }
}

/// Counts a `not_full` waiter for as long as it waits.
struct Watcher<'a>(&'a Room);

impl Drop for Watcher<'_> {
    fn drop(&mut self) {
        self.0.watchers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The sending side of one connection's outbound queue; clones share it.
///
/// Every frame is charged its length (at least [`HEADER_LEN`], at most the
/// whole capacity, so a frame larger than the queue still goes, alone) until
/// the writer has handed it to the transport and flushed it. Senders that do
/// not fit wait. Tiny control frames whose number is bounded by other means
/// (one cancel per call, one final GOAWAY) may skip the bound with
/// [`OutboundQueue::send_unbounded`].
///
/// One `Arc` behind every clone and every queued frame's [`Space`]: a call
/// task's handle costs one reference count, not one per part.
#[derive(Clone)]
pub(crate) struct OutboundQueue {
    shared: Arc<QueueShared>,
}

pub(crate) struct QueueShared {
    tx: mpsc::UnboundedSender<Queued>,
    room: Room,
    gauges: Option<Arc<QueueGauges>>,
    writer: Arc<WriterShared>,
}

impl Drop for QueueShared {
    fn drop(&mut self) {
        if let Some(gauges) = &self.room.shared_budget {
            gauges.sharing.fetch_sub(1, Ordering::Relaxed);
        }
        // The last sender is gone: the writer closes the sink. The sender
        // goes first (fields drop only after this), so that the writer the
        // kick wakes finds the queue disconnected, not merely empty.
        let (placeholder, _) = mpsc::unbounded_channel();
        drop(std::mem::replace(&mut self.tx, placeholder));
        self.writer.kick();
    }
}

impl OutboundQueue {
    /// A queue of `capacity` bytes into `sink`, and the writer task to spawn
    /// (it closes the sink once every sender is gone). With `gauges` that
    /// carry a budget, the queue holds at most its share of that budget.
    /// With `flush_inline` a sender writes and flushes its frame itself when
    /// no other task is writing, and the writer task only takes over what
    /// would wait.
    pub(crate) fn new(
        capacity: usize,
        gauges: Option<Arc<QueueGauges>>,
        sink: FrameSink,
        flush_inline: bool,
    ) -> (OutboundQueue, WriterTask) {
        let capacity = capacity.max(HEADER_LEN);
        let shared_budget = gauges.clone().filter(|gauges| gauges.budget > 0);
        if let Some(gauges) = &shared_budget {
            gauges.sharing.fetch_add(1, Ordering::Relaxed);
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let writer = WriterShared::new(sink, rx, flush_inline);
        let queue = OutboundQueue {
            shared: Arc::new(QueueShared {
                tx,
                room: Room {
                    used: AtomicUsize::new(0),
                    capacity,
                    shared_budget,
                    closed: AtomicBool::new(false),
                    waiting: AtomicUsize::new(0),
                    watchers: AtomicUsize::new(0),
                    freed: Notify::new(),
                },
                gauges,
                writer: writer.clone(),
            }),
        };
        (queue, WriterTask::new(writer))
    }

    fn charge(&self, len: usize) -> usize {
        len.clamp(HEADER_LEN, self.shared.room.capacity)
    }

    fn space(&self, charged: usize) -> Space {
        if let Some(gauges) = &self.shared.gauges {
            gauges.queued.fetch_add(charged, Ordering::Relaxed);
            let queued = self.queued_bytes();
            if queued > gauges.peak.load(Ordering::Relaxed) {
                gauges.peak.fetch_max(queued, Ordering::Relaxed);
            }
        }
        Space {
            queue: self.shared.clone(),
            charged,
        }
    }

    /// Waits for room for a frame of `len` bytes (cancel-safe).
    pub(crate) async fn reserve(&self, len: usize) -> Result<Space, QueueClosed> {
        let charge = self.charge(len);
        self.shared.room.take(charge).await?;
        Ok(self.space(charge))
    }

    /// Room for a frame of `len` bytes if there is some now.
    pub(crate) fn try_reserve(&self, len: usize) -> Option<Space> {
        let charge = self.charge(len);
        match self.shared.room.try_take(charge) {
            Ok(true) => Some(self.space(charge)),
            _ => None,
        }
    }

    /// Queues `frame` in the room reserved for it.
    pub(crate) fn send_reserved(
        &self,
        frame: EncodedFrame,
        space: Space,
    ) -> Result<(), QueueClosed> {
        self.shared
            .tx
            .send(Queued {
                frame,
                _space: Some(space),
            })
            .map_err(|_| QueueClosed)?;
        self.shared.writer.queued();
        Ok(())
    }

    /// Waits for room, then queues `frame`.
    pub(crate) async fn send(&self, frame: EncodedFrame) -> Result<(), QueueClosed> {
        let space = self.reserve(frame.len()).await?;
        self.send_reserved(frame, space)
    }

    /// Queues a small control frame without waiting for room.
    pub(crate) fn send_unbounded(&self, frame: EncodedFrame) -> Result<(), QueueClosed> {
        self.shared
            .tx
            .send(Queued {
                frame,
                _space: None,
            })
            .map_err(|_| QueueClosed)?;
        self.shared.writer.queued();
        Ok(())
    }

    /// Wakes everyone waiting for room with [`QueueClosed`]; later reservations fail too.
    pub(crate) fn close(&self) {
        self.shared.room.closed.store(true, Ordering::Release);
        self.shared.room.freed.notify_waiters();
    }

    /// Bytes charged to frames not yet written.
    pub(crate) fn queued_bytes(&self) -> usize {
        self.shared.room.used.load(Ordering::Relaxed)
    }

    /// True while the queue takes new calls (`Channel::poll_ready`).
    pub(crate) fn has_room(&self) -> bool {
        self.shared.room.has_room()
    }

    /// Resolves once the queue takes new calls (`Channel::poll_ready`).
    pub(crate) fn not_full(&self) -> impl std::future::Future<Output = ()> + Send + Sync + 'static {
        let shared = self.shared.clone();
        async move { shared.room.not_full().await }
    }
}
