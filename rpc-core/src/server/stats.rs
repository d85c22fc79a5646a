//! [`ServerStats`]: what a server holds now, for monitoring and for tests of its limits.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use tokio::sync::OwnedSemaphorePermit;

use crate::conn_io::QueueGauges;
use crate::transport::ReceiveBudget;

/// Live gauges and counters of one server ([`super::Listening::stats`]); cheap
/// to clone, all clones read the same numbers.
#[derive(Debug, Clone)]
pub struct ServerStats {
    pub(crate) inner: Arc<StatsInner>,
    budget: ReceiveBudget,
}

#[derive(Debug, Default)]
pub(crate) struct StatsInner {
    pub(crate) connections: AtomicUsize,
    pub(crate) refused: AtomicU64,
    pub(crate) accept_errors: AtomicU64,
    pub(crate) idle_closed: AtomicU64,
    pub(crate) stalled_closed: AtomicU64,
    pub(crate) failed: AtomicU64,
    pub(crate) paused: AtomicUsize,
    pub(crate) frames_received: AtomicU64,
    pub(crate) queues: Arc<QueueGauges>,
}

impl StatsInner {
    /// Counts a connection while the returned slot lives.
    pub(crate) fn connection_slot(
        self: &Arc<Self>,
        permit: OwnedSemaphorePermit,
    ) -> ConnectionSlot {
        self.connections.fetch_add(1, Ordering::Relaxed);
        ConnectionSlot {
            _permit: permit,
            stats: self.clone(),
        }
    }

    /// Counts a connection whose reading is paused while the guard lives.
    pub(crate) fn paused(self: &Arc<Self>) -> PausedGuard {
        self.paused.fetch_add(1, Ordering::Relaxed);
        PausedGuard(self.clone())
    }
}

/// One of the server's [`super::Server::max_connections`] places.
pub(crate) struct ConnectionSlot {
    _permit: OwnedSemaphorePermit,
    stats: Arc<StatsInner>,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.stats.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection that reads nothing until its outbound queue has room.
pub(crate) struct PausedGuard(Arc<StatsInner>);

impl Drop for PausedGuard {
    fn drop(&mut self) {
        self.0.paused.fetch_sub(1, Ordering::Relaxed);
    }
}

impl ServerStats {
    pub(crate) fn new(budget: ReceiveBudget, outbound_budget: usize) -> ServerStats {
        ServerStats {
            inner: Arc::new(StatsInner {
                queues: Arc::new(QueueGauges::with_budget(outbound_budget)),
                ..StatsInner::default()
            }),
            budget,
        }
    }

    /// The server's receive budget (what front ends reserve from).
    pub(crate) fn budget(&self) -> &ReceiveBudget {
        &self.budget
    }

    /// Connections being served now (refused ones not included).
    pub fn connections(&self) -> usize {
        self.inner.connections.load(Ordering::Relaxed)
    }

    /// Connections refused so far because [`super::Server::max_connections`] were open.
    pub fn refused_connections(&self) -> u64 {
        self.inner.refused.load(Ordering::Relaxed)
    }

    /// Accepts that failed so far (e.g. out of file descriptors).
    pub fn accept_errors(&self) -> u64 {
        self.inner.accept_errors.load(Ordering::Relaxed)
    }

    /// Connections closed so far by [`super::Server::idle_timeout`] for silence.
    pub fn idle_closed_connections(&self) -> u64 {
        self.inner.idle_closed.load(Ordering::Relaxed)
    }

    /// Connections closed so far because the peer took none of our frames
    /// for [`super::Server::idle_timeout`].
    pub fn stalled_closed_connections(&self) -> u64 {
        self.inner.stalled_closed.load(Ordering::Relaxed)
    }

    /// Connections that ended in a failure (a transport error, a protocol
    /// error from the client, a stalled client); a client that closed or
    /// went away ended its connection normally and is not counted.
    pub fn failed_connections(&self) -> u64 {
        self.inner.failed.load(Ordering::Relaxed)
    }

    /// Connections that read nothing now because their outbound queue is full.
    pub fn paused_connections(&self) -> usize {
        self.inner.paused.load(Ordering::Relaxed)
    }

    /// Frames received so far, all connections together.
    pub fn frames_received(&self) -> u64 {
        self.inner.frames_received.load(Ordering::Relaxed)
    }

    /// Bytes of frames queued for sending now, all connections together.
    pub fn outbound_queued_bytes(&self) -> usize {
        self.inner.queues.queued.load(Ordering::Relaxed)
    }

    /// Bytes one connection may queue for sending now: its equal share of
    /// [`super::Server::outbound_budget`] among the connections open, within
    /// [`super::Server::outbound_queue_bytes`] and at least
    /// [`crate::server::OUTBOUND_SHARE_FLOOR`].
    pub fn outbound_share(&self, queue_bytes: usize) -> usize {
        self.inner.queues.share(queue_bytes)
    }

    /// The most bytes one connection ever had queued for sending; never more
    /// than [`super::Server::outbound_queue_bytes`].
    pub fn outbound_queue_peak(&self) -> usize {
        self.inner.queues.peak.load(Ordering::Relaxed)
    }

    /// The server's receive budget: capacity, bytes reserved now, peak.
    pub fn receive_budget(&self) -> &ReceiveBudget {
        &self.budget
    }
}
