//! The write half shared by client and server connections: a queue bounded in
//! bytes, and the task that drains it into the transport.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::SinkExt;
use tokio::sync::{AcquireError, OwnedSemaphorePermit, Semaphore, mpsc};

use crate::frame::HEADER_LEN;
use crate::transport::{FrameSink, TransportError};

/// Most frames written before one flush.
pub(crate) const WRITE_BATCH: usize = 64;

/// Default bytes of frames one connection queues for its transport; see
/// [`crate::server::Server::outbound_queue_bytes`].
pub const DEFAULT_OUTBOUND_QUEUE_BYTES: usize = 1 << 20;

/// Gauges a server keeps over all its connections' queues.
#[derive(Debug, Default)]
pub(crate) struct QueueGauges {
    /// Bytes queued now, all connections together.
    pub(crate) queued: AtomicUsize,
    /// The most bytes one connection ever had queued.
    pub(crate) peak: AtomicUsize,
}

/// A frame in the queue, with the queue space it holds until it is written.
pub(crate) struct Queued {
    frame: Bytes,
    _space: Option<Space>,
}

/// Queue space held by one frame.
pub(crate) struct Space {
    _permit: OwnedSemaphorePermit,
    charged: usize,
    gauges: Option<Arc<QueueGauges>>,
}

impl Drop for Space {
    fn drop(&mut self) {
        if let Some(gauges) = &self.gauges {
            gauges.queued.fetch_sub(self.charged, Ordering::Relaxed);
        }
    }
}

/// The connection's queue was closed: its writer is gone.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QueueClosed;

impl From<AcquireError> for QueueClosed {
    fn from(_: AcquireError) -> QueueClosed {
        QueueClosed
    }
}

/// The sending side of one connection's outbound queue; clones share it.
///
/// Every frame is charged its length (at least [`HEADER_LEN`], at most the
/// whole capacity, so a frame larger than the queue still goes, alone) until
/// the writer has handed it to the transport and flushed it. Senders that do
/// not fit wait, first come first served. Tiny control frames whose number is
/// bounded by other means (one cancel per call, one final GOAWAY) may skip the
/// bound with [`OutboundQueue::send_unbounded`].
#[derive(Clone)]
pub(crate) struct OutboundQueue {
    tx: mpsc::UnboundedSender<Queued>,
    space: Arc<Semaphore>,
    capacity: usize,
    gauges: Option<Arc<QueueGauges>>,
}

impl OutboundQueue {
    /// A queue of `capacity` bytes and the receiver for [`write_frames`].
    pub(crate) fn new(
        capacity: usize,
        gauges: Option<Arc<QueueGauges>>,
    ) -> (OutboundQueue, mpsc::UnboundedReceiver<Queued>) {
        let capacity = capacity.clamp(HEADER_LEN, Semaphore::MAX_PERMITS.min(u32::MAX as usize));
        let (tx, rx) = mpsc::unbounded_channel();
        let queue = OutboundQueue {
            tx,
            space: Arc::new(Semaphore::new(capacity)),
            capacity,
            gauges,
        };
        (queue, rx)
    }

    fn charge(&self, len: usize) -> usize {
        len.clamp(HEADER_LEN, self.capacity)
    }

    fn space(&self, permit: OwnedSemaphorePermit) -> Space {
        let charged = permit.num_permits();
        if let Some(gauges) = &self.gauges {
            gauges.queued.fetch_add(charged, Ordering::Relaxed);
            gauges
                .peak
                .fetch_max(self.queued_bytes(), Ordering::Relaxed);
        }
        Space {
            _permit: permit,
            charged,
            gauges: self.gauges.clone(),
        }
    }

    /// Waits for room for a frame of `len` bytes (cancel-safe; the place in
    /// line is lost when the future is dropped).
    pub(crate) async fn reserve(&self, len: usize) -> Result<Space, QueueClosed> {
        let permit = self
            .space
            .clone()
            .acquire_many_owned(self.charge(len) as u32)
            .await?;
        Ok(self.space(permit))
    }

    /// Room for a frame of `len` bytes if there is some now.
    pub(crate) fn try_reserve(&self, len: usize) -> Option<Space> {
        let permit = self
            .space
            .clone()
            .try_acquire_many_owned(self.charge(len) as u32)
            .ok()?;
        Some(self.space(permit))
    }

    /// Queues `frame` in the room reserved for it.
    pub(crate) fn send_reserved(&self, frame: Bytes, space: Space) -> Result<(), QueueClosed> {
        self.tx
            .send(Queued {
                frame,
                _space: Some(space),
            })
            .map_err(|_| QueueClosed)
    }

    /// Waits for room, then queues `frame`.
    pub(crate) async fn send(&self, frame: Bytes) -> Result<(), QueueClosed> {
        let space = self.reserve(frame.len()).await?;
        self.send_reserved(frame, space)
    }

    /// Queues a small control frame without waiting for room.
    pub(crate) fn send_unbounded(&self, frame: Bytes) -> Result<(), QueueClosed> {
        self.tx
            .send(Queued {
                frame,
                _space: None,
            })
            .map_err(|_| QueueClosed)
    }

    /// Wakes everyone waiting for room with [`QueueClosed`]; later reservations fail too.
    pub(crate) fn close(&self) {
        self.space.close();
    }

    /// Bytes charged to frames not yet written.
    pub(crate) fn queued_bytes(&self) -> usize {
        self.capacity - self.space.available_permits()
    }

    /// The semaphore that measures the room, for pollers (`Channel::poll_ready`).
    pub(crate) fn space_semaphore(&self) -> &Arc<Semaphore> {
        &self.space
    }
}

/// Writes queued frames, a batch per flush, until every sender is gone; then
/// closes the sink. Batching lets concurrent calls share one system call (or
/// one doorbell) without delaying a lone call. A frame's queue space is
/// released once the flush that carries it completes.
///
/// With `stall_timeout`, handing a frame to the transport or flushing a batch
/// that takes longer fails with `TimedOut`: the peer is not taking what we send.
pub(crate) async fn write_frames(
    mut sink: FrameSink,
    mut outbound: mpsc::UnboundedReceiver<Queued>,
    stall_timeout: Option<Duration>,
) -> Result<(), TransportError> {
    let mut batch = Vec::with_capacity(WRITE_BATCH);
    while outbound.recv_many(&mut batch, WRITE_BATCH).await > 0 {
        for queued in &batch {
            within(stall_timeout, sink.feed(queued.frame.clone())).await?;
        }
        within(stall_timeout, sink.flush()).await?;
        batch.clear();
    }
    within(stall_timeout, sink.close()).await
}

async fn within<F>(limit: Option<Duration>, work: F) -> Result<(), TransportError>
where
    F: std::future::Future<Output = Result<(), TransportError>>,
{
    match limit {
        None => work.await,
        Some(limit) => tokio::time::timeout(limit, work).await.unwrap_or_else(|_| {
            Err(TransportError::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the peer took none of our frames for {limit:?}"),
            )))
        }),
    }
}
