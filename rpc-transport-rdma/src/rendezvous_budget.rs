//! The device-wide bound on rendezvous memory in use: the destinations of
//! the peers' frames being pulled and our frames exposed for the peers'
//! READs, all connections of a device together.
//!
//! Each connection charges a frame's bytes before it takes a pull's
//! destination (the pull waits: no READ is issued, the protocol's credits
//! push back on the peer) and before it exposes a frame (the frame stays
//! with the sink, which is not ready: the application waits). A charge is
//! released when the pulled frame is handed to the application, or when
//! the exposed frame is revoked (its DONE, its time-out, or the end of the
//! connection).
//!
//! **Every connection always moves.** A connection that holds no charge of
//! a kind (no pull, or nothing exposed) takes its next one of that kind past
//! the bound at once, whatever its size; waiters are otherwise served first
//! come, first served, and a frame larger than the bound charges all of it.
//! So a pull is never held back by exposures that wait for it (the two
//! sides of a connection, or two processes, each with their bound spent on
//! frames the other must pull), a 64 MiB frame goes through a 16 MiB bound,
//! and peers that never pull what they were offered slow the others down to
//! one frame at a time in each direction until the rendezvous time-out (or
//! the queue pair's ACK time-out) ends what they hold, never to a halt. What
//! peers can make a device hold is at most the bound plus, per connection,
//! one pulled and one exposed frame.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::PollSemaphore;

/// The bound of one device (see the module's docs); cheap to clone.
#[derive(Clone)]
pub struct RendezvousBudget {
    inner: Arc<Inner>,
}

struct Inner {
    semaphore: Arc<Semaphore>,
    capacity: usize,
    /// Bytes charged past the bound (connections' first frames of a kind).
    past_bound: AtomicUsize,
    /// The most bytes charged at once, past the bound included.
    peak: AtomicUsize,
}

impl std::fmt::Debug for RendezvousBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RendezvousBudget")
            .field("capacity", &self.capacity())
            .field("in_use", &self.in_use())
            .field("past_bound", &self.past_bound())
            .finish()
    }
}

impl RendezvousBudget {
    /// A bound of `capacity` bytes (at least 1, at most 4 GiB − 1).
    pub fn new(capacity: usize) -> RendezvousBudget {
        let capacity = capacity.clamp(1, u32::MAX as usize);
        RendezvousBudget {
            inner: Arc::new(Inner {
                semaphore: Arc::new(Semaphore::new(capacity)),
                capacity,
                past_bound: AtomicUsize::new(0),
                peak: AtomicUsize::new(0),
            }),
        }
    }

    /// The bound in bytes.
    pub fn capacity(&self) -> usize {
        self.inner.capacity
    }

    /// Bytes charged within the bound now (waiters' partial shares included).
    pub fn in_use(&self) -> usize {
        self.inner.capacity - self.inner.semaphore.available_permits()
    }

    /// Bytes charged past the bound now (each connection's one frame of a
    /// kind that went through while the bound was spent).
    pub fn past_bound(&self) -> usize {
        self.inner.past_bound.load(Ordering::Relaxed)
    }

    /// The most bytes charged at once so far, within and past the bound.
    pub fn peak(&self) -> usize {
        self.inner.peak.load(Ordering::Relaxed)
    }

    /// A connection's place in the queue for one kind of charge.
    pub(crate) fn waiter(&self) -> BudgetWaiter {
        BudgetWaiter {
            budget: self.clone(),
            poll: PollSemaphore::new(self.inner.semaphore.clone()),
        }
    }

    fn note_peak(&self) {
        let now = self.in_use() + self.past_bound();
        self.inner.peak.fetch_max(now, Ordering::Relaxed);
    }
}

/// One connection's wait for one kind of charge (pulls, or exposures): at
/// most one frame waits at a time, and it keeps its place in the queue
/// while it is asked for again with the same length.
pub(crate) struct BudgetWaiter {
    budget: RendezvousBudget,
    poll: PollSemaphore,
}

impl BudgetWaiter {
    /// Charges `len` bytes (all of the bound when `len` exceeds it). When
    /// the bound is spent: past it at once if the connection holds no
    /// charge of this kind (`holds_none`), else `Pending` (the waker of `cx`
    /// is woken once the bytes are the connection's).
    pub(crate) fn poll_charge(
        &mut self,
        cx: &mut Context<'_>,
        len: usize,
        holds_none: bool,
    ) -> Poll<Charge> {
        let bytes = len.clamp(1, self.budget.capacity());
        match self.poll.poll_acquire_many(cx, bytes as u32) {
            Poll::Ready(Some(permit)) => {
                self.budget.note_peak();
                Poll::Ready(Charge {
                    _held: Held::Bounded { _permit: permit },
                })
            }
            // The semaphore is never closed; if it were, the bound would be
            // gone, not the connection's right to move.
            Poll::Ready(None) => Poll::Ready(self.past_bound(len)),
            Poll::Pending if holds_none => {
                // Leave the queue (what it was given goes back to it).
                self.poll = PollSemaphore::new(self.budget.inner.semaphore.clone());
                Poll::Ready(self.past_bound(len))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn past_bound(&self, len: usize) -> Charge {
        self.budget
            .inner
            .past_bound
            .fetch_add(len, Ordering::Relaxed);
        self.budget.note_peak();
        Charge {
            _held: Held::PastBound {
                budget: self.budget.clone(),
                len,
            },
        }
    }
}

/// Bytes of a [`RendezvousBudget`] one frame holds; released when dropped.
pub(crate) struct Charge {
    _held: Held,
}

enum Held {
    Bounded {
        _permit: OwnedSemaphorePermit,
    },
    PastBound {
        budget: RendezvousBudget,
        len: usize,
    },
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Held::PastBound { budget, len } = self {
            budget.inner.past_bound.fetch_sub(*len, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;
    use std::task::{Wake, Waker};

    use super::*;

    #[derive(Default)]
    struct Flag(AtomicBool);

    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn charge(
        waiter: &mut BudgetWaiter,
        waker: &Waker,
        len: usize,
        holds_none: bool,
    ) -> Option<Charge> {
        match waiter.poll_charge(&mut Context::from_waker(waker), len, holds_none) {
            Poll::Ready(charge) => Some(charge),
            Poll::Pending => None,
        }
    }

    #[test]
    fn charges_stay_within_the_bound_and_a_waiter_is_woken_when_bytes_come_back() {
        let budget = RendezvousBudget::new(1000);
        let flag = Arc::new(Flag::default());
        let waker = Waker::from(flag.clone());
        let mut a = budget.waiter();
        let mut b = budget.waiter();
        let first = charge(&mut a, &waker, 600, true).unwrap();
        let second = charge(&mut a, &waker, 400, false).unwrap();
        assert_eq!(budget.in_use(), 1000);
        assert_eq!(budget.past_bound(), 0);
        // Spent: a connection that holds a charge waits...
        assert!(charge(&mut b, &waker, 500, false).is_none());
        assert!(!flag.0.load(Ordering::SeqCst));
        drop(second);
        // ...first come, first served: 400 came back, it needs 500.
        assert!(!flag.0.load(Ordering::SeqCst));
        drop(first);
        assert!(
            flag.0.load(Ordering::SeqCst),
            "woken once its bytes are there"
        );
        let third = charge(&mut b, &waker, 500, false).unwrap();
        assert_eq!(budget.in_use(), 500);
        drop(third);
        assert_eq!(budget.in_use(), 0);
        assert_eq!(budget.peak(), 1000);
    }

    #[test]
    fn a_connection_holding_nothing_goes_past_the_bound_and_a_huge_frame_takes_all_of_it() {
        let budget = RendezvousBudget::new(1000);
        let waker = Waker::noop();
        let mut a = budget.waiter();
        let mut b = budget.waiter();
        let held = charge(&mut a, waker, 900, true).unwrap();
        // b waits (it holds a charge of this kind) and has 100 of its 500 set
        // aside; then its own charges are all gone: it goes past the bound
        // at once and leaves the queue, giving back what it was set aside.
        assert!(charge(&mut b, waker, 500, false).is_none());
        let alone = charge(&mut b, waker, 500, true).unwrap();
        assert_eq!(budget.past_bound(), 500);
        assert_eq!(budget.in_use(), 900);
        drop(alone);
        assert_eq!(budget.past_bound(), 0);
        drop(held);
        // A frame larger than the bound charges all of it, no more.
        let huge = charge(&mut a, waker, 64 << 20, true).unwrap();
        assert_eq!(budget.in_use(), 1000);
        assert!(charge(&mut b, waker, 1, false).is_none());
        drop(huge);
        assert!(charge(&mut b, waker, 1, false).is_some());
        assert_eq!(budget.in_use(), 0);
        assert_eq!(budget.peak(), 1400);
    }
}
