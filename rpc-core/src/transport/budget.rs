//! [`ReceiveBudget`]: bytes of received frames a server may hold, across all its connections.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::PollSemaphore;

use super::TransportError;

/// Bytes of small frames each connection may hold outside the shared budget.
pub const PER_CONNECTION_ALLOWANCE: usize = 16 << 10;

/// A server-wide budget of bytes for received frames; cheap to clone (all
/// clones share one budget).
///
/// A transport that receives frames for a server reserves each frame's length
/// here *before* it allocates the buffer for the frame's bytes, and attaches
/// the reservation to the frame it hands up ([`Reservation::attach`]): the
/// bytes count until the last reference to the frame's buffer is dropped —
/// while the frame is being received, while it waits to be dispatched, and for
/// as long as the handler keeps (a slice of) the request payload. A frame
/// that does not fit waits for others to be released, and its connection
/// reads nothing meanwhile, which pushes back on the peer through the
/// transport's own flow control (TCP's window, RDMA's credits).
///
/// Each connection also has a small allowance of its own
/// ([`PER_CONNECTION_ALLOWANCE`]) for frames up to that size: small requests
/// are not queued behind large frames that peers are slow to send, so a few
/// peers stalling half-way through huge frames cannot starve everyone else's
/// small calls. The memory a server's received frames can occupy is therefore
/// at most `capacity + connections × PER_CONNECTION_ALLOWANCE` (plus what each
/// transport buffers before a frame's length is known, e.g. TCP's 8 KiB read
/// buffer per connection).
///
/// No deadlock: a reservation never exceeds the capacity (a frame larger than
/// the capacity reserves all of it), and waiters are served first come, first
/// served, so a frame waits only for frames that are already held and will be
/// released when they are processed.
#[derive(Clone)]
pub struct ReceiveBudget {
    inner: Arc<BudgetInner>,
}

struct BudgetInner {
    semaphore: Arc<Semaphore>,
    capacity: usize,
    peak: AtomicUsize,
    /// Bytes held under the connections' own allowances, all connections together.
    allowance_in_use: AtomicUsize,
}

impl fmt::Debug for ReceiveBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReceiveBudget")
            .field("capacity", &self.capacity())
            .field("in_use", &self.in_use())
            .field("peak", &self.peak())
            .finish()
    }
}

impl ReceiveBudget {
    /// A budget of `capacity` bytes (at least 1, at most what a semaphore holds).
    pub fn new(capacity: usize) -> ReceiveBudget {
        let capacity = capacity.clamp(1, Semaphore::MAX_PERMITS);
        ReceiveBudget {
            inner: Arc::new(BudgetInner {
                semaphore: Arc::new(Semaphore::new(capacity)),
                capacity,
                peak: AtomicUsize::new(0),
                allowance_in_use: AtomicUsize::new(0),
            }),
        }
    }

    /// The shared budget's size in bytes.
    pub fn capacity(&self) -> usize {
        self.inner.capacity
    }

    /// Bytes of the shared budget reserved now.
    pub fn in_use(&self) -> usize {
        self.inner.capacity - self.inner.semaphore.available_permits()
    }

    /// The most bytes of the shared budget ever reserved at once.
    pub fn peak(&self) -> usize {
        self.inner.peak.load(Ordering::Relaxed)
    }

    /// Bytes held under the connections' own allowances, summed over connections.
    pub fn allowance_in_use(&self) -> usize {
        self.inner.allowance_in_use.load(Ordering::Relaxed)
    }

    /// A handle for one connection: its own allowance plus this shared budget.
    pub fn connection(&self) -> ConnectionBudget {
        ConnectionBudget {
            budget: self.clone(),
            poll: PollSemaphore::new(self.inner.semaphore.clone()),
            allowance: Arc::new(Allowance {
                used: AtomicUsize::new(0),
                budget: self.inner.clone(),
            }),
        }
    }

    fn charge(&self, len: usize) -> u32 {
        len.clamp(1, self.inner.capacity.min(u32::MAX as usize)) as u32
    }

    fn note_peak(&self) {
        self.inner.peak.fetch_max(self.in_use(), Ordering::Relaxed);
    }
}

/// One connection's view of a [`ReceiveBudget`]: reserve a frame's bytes
/// before buffering them.
pub struct ConnectionBudget {
    budget: ReceiveBudget,
    poll: PollSemaphore,
    allowance: Arc<Allowance>,
}

/// A connection's own allowance; a reservation from it holds one `Arc` of it.
struct Allowance {
    used: AtomicUsize,
    budget: Arc<BudgetInner>,
}

impl fmt::Debug for ConnectionBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectionBudget")
            .field(
                "allowance_in_use",
                &self.allowance.used.load(Ordering::Relaxed),
            )
            .field("budget", &self.budget)
            .finish()
    }
}

impl ConnectionBudget {
    /// Reserves `len` bytes for a frame: from the connection's allowance when
    /// the frame is small and it has room, else from the shared budget,
    /// waiting (registering `cx`) until they are free. After `Pending`, call
    /// again with the same `len` to keep the place in the queue.
    pub fn poll_reserve(
        &mut self,
        cx: &mut Context<'_>,
        len: usize,
    ) -> Poll<Result<Reservation, TransportError>> {
        if len <= PER_CONNECTION_ALLOWANCE {
            let taken =
                self.allowance
                    .used
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                        (used + len <= PER_CONNECTION_ALLOWANCE).then_some(used + len)
                    });
            if taken.is_ok() {
                self.budget
                    .inner
                    .allowance_in_use
                    .fetch_add(len, Ordering::Relaxed);
                return Poll::Ready(Ok(Reservation(Held::Allowance {
                    allowance: self.allowance.clone(),
                    len,
                })));
            }
        }
        let charge = self.budget.charge(len);
        match self.poll.poll_acquire_many(cx, charge) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => Poll::Ready(Err(TransportError::Closed)),
            Poll::Ready(Some(permit)) => {
                self.budget.note_peak();
                Poll::Ready(Ok(Reservation(Held::Shared(permit))))
            }
        }
    }

    /// [`poll_reserve`](Self::poll_reserve) as a future.
    pub async fn reserve(&mut self, len: usize) -> Result<Reservation, TransportError> {
        std::future::poll_fn(|cx| self.poll_reserve(cx, len)).await
    }
}

/// Bytes reserved for one frame; released when dropped, or, once attached,
/// when the frame's last reference is dropped.
pub struct Reservation(Held);

enum Held {
    Shared(OwnedSemaphorePermit),
    Allowance {
        allowance: Arc<Allowance>,
        len: usize,
    },
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Held::Allowance { allowance, len } = self {
            allowance.used.fetch_sub(*len, Ordering::AcqRel);
            allowance
                .budget
                .allowance_in_use
                .fetch_sub(*len, Ordering::Relaxed);
        }
    }
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Held::Shared(permit) => write!(f, "Reservation(shared {})", permit.num_permits()),
            Held::Allowance { len, .. } => write!(f, "Reservation(allowance {len})"),
        }
    }
}

struct Budgeted {
    frame: Bytes,
    _reservation: Reservation,
}

impl AsRef<[u8]> for Budgeted {
    fn as_ref(&self) -> &[u8] {
        &self.frame
    }
}

impl Reservation {
    /// `frame`, holding this reservation until its last reference (or slice) is dropped.
    pub fn attach(self, frame: Bytes) -> Bytes {
        Bytes::from_owner(Budgeted {
            frame,
            _reservation: self,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready<T>(poll: Poll<T>) -> T {
        match poll {
            Poll::Ready(value) => value,
            Poll::Pending => panic!("pending"),
        }
    }

    #[test]
    fn frames_hold_their_bytes_until_dropped_and_waiters_get_them() {
        let budget = ReceiveBudget::new(100 << 10);
        let mut a = budget.connection();
        let mut b = budget.connection();
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);

        // Small frames use the connection's allowance, not the shared budget.
        let small = ready(a.poll_reserve(&mut cx, 1000)).unwrap();
        assert_eq!(budget.in_use(), 0);
        assert_eq!(budget.allowance_in_use(), 1000);
        let small = small.attach(Bytes::from(vec![7u8; 1000]));
        let slice = small.slice(10..20);
        drop(small);
        assert_eq!(budget.allowance_in_use(), 1000, "a slice keeps the frame");
        drop(slice);
        assert_eq!(budget.allowance_in_use(), 0);

        // Large frames share the budget; one that does not fit waits.
        let first = ready(a.poll_reserve(&mut cx, 60 << 10)).unwrap();
        assert_eq!(budget.in_use(), 60 << 10);
        assert!(b.poll_reserve(&mut cx, 60 << 10).is_pending());
        // Small frames of another connection still pass.
        let _small = ready(b.poll_reserve(&mut cx, 100)).unwrap();
        drop(first);
        let second = ready(b.poll_reserve(&mut cx, 60 << 10)).unwrap();
        assert_eq!(budget.in_use(), 60 << 10);
        assert_eq!(budget.peak(), 60 << 10);
        drop(second);
        assert_eq!(budget.in_use(), 0);

        // A frame larger than the whole budget takes all of it rather than never fitting.
        let all = ready(a.poll_reserve(&mut cx, 1 << 20)).unwrap();
        assert_eq!(budget.in_use(), budget.capacity());
        drop(all);
        assert_eq!(budget.in_use(), 0);
    }
}
