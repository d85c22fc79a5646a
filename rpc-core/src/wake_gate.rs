//! Gates that let a poll through only after the polled thing's own waker
//! fired: [`WakeGate`], for a `poll_*` function a driver loop calls again
//! and again (inside rpc-core, a future wrapper built on it too).
//!
//! A connection's task waits on several things at once in one `select!`, and
//! every wake-up of the task polls each of them. Most are cheap to poll, but
//! some are not: a [`CancellationToken`](tokio_util::sync::CancellationToken)'s
//! `cancelled()` takes two mutexes per poll (the token's and its `Notify`'s),
//! paid once per frame for a signal that fires once in the connection's life;
//! an HTTP/2 connection walks its streams and send queues on every poll.
//! Gating them behind a waker of their own (the trick `FuturesUnordered`
//! uses) makes a poll that nothing changed for one atomic swap and one
//! `AtomicWaker` check.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

/// The waker handed to the gated side: notes that it fired, then wakes the
/// task that polls the gate.
struct Gate {
    fired: AtomicBool,
    /// Inside [`WakeGate::quiet`]: a wake-up only opens the gate.
    quiet: AtomicBool,
    task: AtomicWaker,
}

impl Wake for Gate {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // SeqCst, with the same in `poll` and `quiet`: either this sees
        // the task leave its quiet spell, or the task sees `fired`.
        self.fired.store(true, Ordering::SeqCst);
        if !self.quiet.load(Ordering::SeqCst) {
            self.task.wake();
        }
    }
}

/// Lets a poll through only after the polled side's own waker fired, or
/// after its last poll was ready (it may be ready again: an `accept` with
/// more connections waiting). For a driver loop that polls something costly
/// on every wake-up of its task (as the `grpc://` gateway polls h2's
/// connection): the skipped polls are the ones it did not ask for.
///
/// Correct for anything whose readiness is announced through the waker of
/// its last poll (every well-behaved `poll_*` function). The first poll
/// goes through.
pub struct WakeGate {
    gate: Arc<Gate>,
    waker: Waker,
}

impl std::fmt::Debug for WakeGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WakeGate")
            .field("open", &self.gate.fired.load(Ordering::Relaxed))
            .finish()
    }
}

impl Default for WakeGate {
    fn default() -> Self {
        WakeGate::new()
    }
}

impl WakeGate {
    /// An open gate: its first poll goes through.
    pub fn new() -> WakeGate {
        let gate = Arc::new(Gate {
            fired: AtomicBool::new(true),
            quiet: AtomicBool::new(false),
            task: AtomicWaker::new(),
        });
        WakeGate {
            waker: Waker::from(gate.clone()),
            gate,
        }
    }

    /// Lets the next poll through (after a change the gated side will not
    /// announce by waking, e.g. a call on it made outside a poll).
    pub fn open(&self) {
        self.gate.fired.store(true, Ordering::Release);
    }

    /// Runs `work` (which may make the gated side wake, such as a call
    /// answered in the driver's own task) with wake-ups of the gated side
    /// only opening the gate, not waking the task: the task is running and
    /// will poll the gate again. Waking itself there would make the
    /// runtime poll it once more for nothing, and on a multi-thread runtime
    /// unpark another worker to look for work.
    ///
    /// The caller must poll the gate (through [`WakeGate::poll`]) after
    /// `work` before its task waits; a driver loop that polls it in every
    /// round does.
    pub fn quiet<R>(&self, work: impl FnOnce() -> R) -> R {
        let was_quiet = self.gate.quiet.swap(true, Ordering::SeqCst);
        let done = work();
        self.gate.quiet.store(was_quiet, Ordering::SeqCst);
        done
    }

    /// Polls `future` once inside [`WakeGate::quiet`], with the gate's own
    /// waker instead of the task's: a wake-up of the future during this
    /// poll (h2 giving a stream send capacity at once, and waking the
    /// waker an earlier `poll_reset` left with it) only opens the gate.
    ///
    /// For a future polled once in the driver's task before it joins a
    /// set that polls it again with a waker of its own (a
    /// `FuturesUnordered`, which polls what is pushed into it): what it
    /// registers here wakes the task through the gate later, at worst
    /// once for nothing.
    pub fn poll_quietly<F: Future + ?Sized>(&self, future: Pin<&mut F>) -> Poll<F::Output> {
        self.quiet(|| future.poll(&mut Context::from_waker(&self.waker)))
    }

    /// Calls `poll` with the gate's own waker if the gate is open, else
    /// returns `Pending`; either way `cx` is woken when the gate opens.
    ///
    /// A wake-up of the gated side during its own poll (h2 waking its
    /// connection's task when it reads a new stream, and then handing that
    /// stream over in the same poll) does not wake the task: the task is
    /// running. Had the poll come back `Pending` after such a wake-up, it
    /// is polled again here (at most twice; then the task is
    /// woken, so a side that yields on purpose still yields). A task that
    /// woke itself would be polled once more for nothing, and on a
    /// multi-thread runtime that wake-up also unparks another worker
    /// (a futex call per wake-up, measured once per call at one call in
    /// flight on a `grpc://` server).
    pub fn poll<T>(
        &self,
        cx: &mut Context<'_>,
        mut poll: impl FnMut(&mut Context<'_>) -> Poll<T>,
    ) -> Poll<T> {
        // Register first: a wake between this and the check below either
        // sets `fired` before it is read or wakes the task.
        self.gate.task.register(cx.waker());
        if !self.gate.fired.swap(false, Ordering::SeqCst) {
            return Poll::Pending;
        }
        let was_quiet = self.gate.quiet.swap(true, Ordering::SeqCst);
        let mut polled = poll(&mut Context::from_waker(&self.waker));
        let mut repolls = REPOLLS;
        while polled.is_pending() && repolls > 0 && self.gate.fired.swap(false, Ordering::SeqCst) {
            repolls -= 1;
            polled = poll(&mut Context::from_waker(&self.waker));
        }
        self.gate.quiet.store(was_quiet, Ordering::SeqCst);
        if polled.is_ready() {
            self.open();
        } else if !was_quiet && self.gate.fired.load(Ordering::SeqCst) {
            // Woken during the last poll (or it keeps waking itself): the
            // task polls again. (Inside `quiet`, its caller does.)
            cx.waker().wake_by_ref();
        }
        polled
    }
}

/// Polls of the gated side in a row that [`WakeGate::poll`] makes when it
/// wakes itself during its own poll.
const REPOLLS: u32 = 2;

pin_project_lite::pin_project! {
    /// Polls `F` on its first poll and afterwards only when `F` woke.
    pub(crate) struct WakeGated<F> {
        #[pin]
        inner: F,
        gate: WakeGate,
    }
}

impl<F: Future> WakeGated<F> {
    pub(crate) fn new(inner: F) -> WakeGated<F> {
        WakeGated {
            inner,
            gate: WakeGate::new(),
        }
    }
}

impl<F: Future> Future for WakeGated<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let mut inner = this.inner;
        this.gate.poll(cx, |cx| inner.as_mut().poll(cx))
    }
}

/// What [`RepollOnWake`]'s waker finds when it fires.
const IDLE: u8 = 0;
/// The inner future is being polled: a wake-up only asks for one more poll.
const POLLING: u8 = 1;
/// Woken during the poll in progress.
const WOKEN: u8 = 2;

/// [`RepollOnWake`]'s waker: during a poll of the inner future it notes the
/// wake-up, outside one it wakes the task.
struct Repoll {
    state: std::sync::atomic::AtomicU8,
    task: AtomicWaker,
}

impl Wake for Repoll {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        match self
            .state
            .compare_exchange(POLLING, WOKEN, Ordering::SeqCst, Ordering::SeqCst)
        {
            // Taken by the poll in progress (or already noted).
            Ok(_) | Err(WOKEN) => {}
            _ => self.task.wake(),
        }
    }
}

pin_project_lite::pin_project! {
    /// Polls `F` again, in the same poll of its task, when `F` woke during
    /// its own poll, instead of letting that wake-up reschedule the task.
    ///
    /// A driver task that runs many futures of its own (a connection task
    /// with its calls in a `FuturesUnordered`) wakes itself whenever one
    /// part makes another ready while it runs: h2, reading a request's
    /// body in the connection's poll, wakes the call waiting for it, and
    /// that call's waker is the task's. Tokio then polls the task again
    /// from the back of the run queue and, on a multi-thread runtime,
    /// unparks another worker to look for work (a futex call and a worker
    /// that wakes for nothing; measured on a `grpc://` server at one call
    /// in flight: 0.4 futex calls per call, the connection's work split
    /// across both workers, where tonic's, whose calls are tasks of their
    /// own, stays on one). A wake-up from anywhere while `F` is polled
    /// (another thread's included) is taken as "poll again"; one outside a
    /// poll wakes the task as usual. After three polls in a row that each
    /// woke, the task is woken instead, so a future that yields on purpose
    /// still yields to the runtime.
    pub struct RepollOnWake<F> {
        #[pin]
        inner: F,
        repoll: Arc<Repoll>,
        waker: Waker,
    }
}

impl<F: Future> RepollOnWake<F> {
    /// `inner`, polled again instead of waking its task when it wakes
    /// during its own poll.
    pub fn new(inner: F) -> RepollOnWake<F> {
        let repoll = Arc::new(Repoll {
            state: std::sync::atomic::AtomicU8::new(IDLE),
            task: AtomicWaker::new(),
        });
        RepollOnWake {
            inner,
            waker: Waker::from(repoll.clone()),
            repoll,
        }
    }
}

impl<F: Future> Future for RepollOnWake<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let mut inner = this.inner;
        let repoll = &**this.repoll;
        // Register first: a wake-up after the last poll below ends finds
        // the task's current waker.
        repoll.task.register(cx.waker());
        for _ in 0..=REPOLLS {
            repoll.state.store(POLLING, Ordering::SeqCst);
            let polled = inner.as_mut().poll(&mut Context::from_waker(this.waker));
            if polled.is_ready() {
                repoll.state.store(IDLE, Ordering::SeqCst);
                return polled;
            }
            if repoll
                .state
                .compare_exchange(POLLING, IDLE, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                return Poll::Pending;
            }
            // Woken while it ran: poll it again now.
        }
        // It keeps waking itself: the runtime decides what runs next.
        repoll.state.store(IDLE, Ordering::SeqCst);
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// Counts the wake-ups of a task's waker.
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A task's waker and its count of wake-ups.
    fn counting_waker() -> (Arc<Count>, Waker) {
        let woken = Arc::new(Count(AtomicUsize::new(0)));
        let task = Waker::from(woken.clone());
        (woken, task)
    }

    /// Counts its polls; ready once `ready` is set (and it was woken).
    struct Probe {
        polls: Arc<AtomicUsize>,
        ready: Arc<AtomicBool>,
        waker: Arc<std::sync::Mutex<Option<Waker>>>,
    }

    impl Future for Probe {
        type Output = ();
        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            self.polls.fetch_add(1, Ordering::Relaxed);
            if self.ready.load(Ordering::Acquire) {
                return Poll::Ready(());
            }
            *self.waker.lock().unwrap() = Some(cx.waker().clone());
            Poll::Pending
        }
    }

    #[test]
    fn a_gate_polls_only_after_its_waker_fired_or_a_ready_poll() {
        let gate = WakeGate::new();
        let polls = AtomicUsize::new(0);
        let kept = std::sync::Mutex::new(None::<Waker>);
        let mut cx = Context::from_waker(Waker::noop());
        let mut poll = |ready: bool| {
            gate.poll(&mut cx, |cx| {
                polls.fetch_add(1, Ordering::Relaxed);
                *kept.lock().unwrap() = Some(cx.waker().clone());
                if ready {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            })
        };
        let polled = |polls: &AtomicUsize| polls.load(Ordering::Relaxed);
        assert!(poll(false).is_pending(), "the first poll goes through");
        assert!(poll(false).is_pending());
        assert!(poll(false).is_pending());
        assert_eq!(polled(&polls), 1, "nothing woke the gated side");
        kept.lock().unwrap().as_ref().unwrap().wake_by_ref();
        assert!(poll(true).is_ready(), "its waker fired");
        assert!(
            poll(false).is_pending(),
            "after a ready poll it may be ready again"
        );
        assert_eq!(polled(&polls), 3);
        assert!(poll(false).is_pending());
        assert_eq!(polled(&polls), 3);
        gate.open();
        assert!(poll(false).is_pending());
        assert_eq!(polled(&polls), 4, "opened by hand");
    }

    #[test]
    fn a_quiet_wake_opens_the_gate_without_waking_the_task() {
        let (woken, task) = counting_waker();
        let mut cx = Context::from_waker(&task);
        let gate = WakeGate::new();
        let kept = std::sync::Mutex::new(None::<Waker>);
        let polls = AtomicUsize::new(0);
        let mut poll = || {
            gate.poll(&mut cx, |cx| {
                polls.fetch_add(1, Ordering::Relaxed);
                *kept.lock().unwrap() = Some(cx.waker().clone());
                Poll::<()>::Pending
            })
        };
        assert!(poll().is_pending());
        let gated_side = kept.lock().unwrap().clone().unwrap();
        gate.quiet(|| gated_side.wake_by_ref());
        assert_eq!(woken.0.load(Ordering::Relaxed), 0, "the task was not woken");
        assert!(poll().is_pending());
        assert_eq!(
            polls.load(Ordering::Relaxed),
            2,
            "but the gate let the next poll through"
        );
        gated_side.wake_by_ref();
        assert_eq!(
            woken.0.load(Ordering::Relaxed),
            1,
            "outside quiet, a wake wakes"
        );
    }

    #[test]
    fn a_wake_during_its_own_poll_polls_again_instead_of_waking_the_task() {
        let (woken, task) = counting_waker();
        let mut cx = Context::from_waker(&task);
        let gate = WakeGate::new();
        // Wakes itself on its first poll only (as h2 does when it reads a
        // stream it hands over on a later look), ready on the second.
        let polls = AtomicUsize::new(0);
        let polled = gate.poll(&mut cx, |cx| {
            if polls.fetch_add(1, Ordering::Relaxed) == 0 {
                cx.waker().wake_by_ref();
                Poll::Pending
            } else {
                Poll::Ready(())
            }
        });
        assert!(polled.is_ready(), "polled again at once");
        assert_eq!(polls.load(Ordering::Relaxed), 2);
        assert_eq!(woken.0.load(Ordering::Relaxed), 0, "the task was not woken");

        // A side that wakes itself on every poll (a yield) is polled a
        // bounded number of times, then the task is woken to come back.
        let gate = WakeGate::new();
        let polls = AtomicUsize::new(0);
        let polled = gate.poll(&mut cx, |cx| {
            polls.fetch_add(1, Ordering::Relaxed);
            cx.waker().wake_by_ref();
            Poll::<()>::Pending
        });
        assert!(polled.is_pending());
        assert_eq!(polls.load(Ordering::Relaxed), 1 + REPOLLS as usize);
        assert_eq!(woken.0.load(Ordering::Relaxed), 1, "the task comes back");
        let polled = gate.poll(&mut cx, |_| {
            polls.fetch_add(1, Ordering::Relaxed);
            Poll::<()>::Pending
        });
        assert!(polled.is_pending());
        assert_eq!(
            polls.load(Ordering::Relaxed),
            2 + REPOLLS as usize,
            "and its next poll goes through"
        );

        // A wake from elsewhere while the task is not polling still wakes it.
        let kept = std::sync::Mutex::new(None::<Waker>);
        let gate = WakeGate::new();
        let _ = gate.poll(&mut cx, |cx| {
            *kept.lock().unwrap() = Some(cx.waker().clone());
            Poll::<()>::Pending
        });
        kept.lock().unwrap().take().unwrap().wake();
        assert_eq!(woken.0.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn polls_the_inner_future_only_after_it_woke() {
        let polls = Arc::new(AtomicUsize::new(0));
        let ready = Arc::new(AtomicBool::new(false));
        let inner_waker = Arc::new(std::sync::Mutex::new(None::<Waker>));
        let mut gated = Box::pin(WakeGated::new(Probe {
            polls: polls.clone(),
            ready: ready.clone(),
            waker: inner_waker.clone(),
        }));
        let task_woken = Arc::new(AtomicUsize::new(0));
        struct Count(Arc<AtomicUsize>);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        let task = Waker::from(Arc::new(Count(task_woken.clone())));
        let mut cx = Context::from_waker(&task);

        assert!(gated.as_mut().poll(&mut cx).is_pending());
        assert_eq!(
            polls.load(Ordering::Relaxed),
            1,
            "the first poll goes through"
        );
        for _ in 0..10 {
            assert!(gated.as_mut().poll(&mut cx).is_pending());
        }
        assert_eq!(
            polls.load(Ordering::Relaxed),
            1,
            "polls nobody asked for are skipped"
        );

        ready.store(true, Ordering::Release);
        inner_waker.lock().unwrap().take().unwrap().wake();
        assert_eq!(task_woken.load(Ordering::Relaxed), 1, "the task is woken");
        assert!(gated.as_mut().poll(&mut cx).is_ready());
        assert_eq!(polls.load(Ordering::Relaxed), 2);
    }

    /// Wakes itself during its first `self_wakes` polls, then waits for a
    /// wake-up from outside (kept in `waker`); ready once `ready` is set.
    struct SelfWaking {
        polls: usize,
        self_wakes: usize,
        ready: Arc<AtomicBool>,
        waker: Arc<std::sync::Mutex<Option<Waker>>>,
    }

    impl Future for SelfWaking {
        type Output = usize;
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<usize> {
            self.polls += 1;
            if self.ready.load(Ordering::Acquire) {
                return Poll::Ready(self.polls);
            }
            *self.waker.lock().unwrap() = Some(cx.waker().clone());
            if self.polls <= self.self_wakes {
                cx.waker().wake_by_ref();
            }
            Poll::Pending
        }
    }

    fn self_waking(
        self_wakes: usize,
    ) -> (
        SelfWaking,
        Arc<AtomicBool>,
        Arc<std::sync::Mutex<Option<Waker>>>,
    ) {
        let ready = Arc::new(AtomicBool::new(false));
        let waker = Arc::new(std::sync::Mutex::new(None));
        let future = SelfWaking {
            polls: 0,
            self_wakes,
            ready: ready.clone(),
            waker: waker.clone(),
        };
        (future, ready, waker)
    }

    #[test]
    fn a_future_that_wakes_during_its_poll_is_polled_again_without_waking_its_task() {
        let (woken, task) = counting_waker();
        let mut cx = Context::from_waker(&task);
        let (future, ready, kept) = self_waking(2);
        let mut future = std::pin::pin!(RepollOnWake::new(future));
        assert!(future.as_mut().poll(&mut cx).is_pending());
        assert_eq!(
            woken.0.load(Ordering::Relaxed),
            0,
            "two wake-ups during its own polls: polled again, the task not woken"
        );
        // A wake-up from outside a poll (the peer's next bytes) wakes the task.
        ready.store(true, Ordering::Release);
        kept.lock().unwrap().take().unwrap().wake();
        assert_eq!(woken.0.load(Ordering::Relaxed), 1);
        assert_eq!(
            future.as_mut().poll(&mut cx),
            Poll::Ready(4),
            "three polls, then the ready one"
        );
    }

    #[test]
    fn a_future_that_always_wakes_itself_still_yields_to_the_runtime() {
        let (woken, task) = counting_waker();
        let mut cx = Context::from_waker(&task);
        let (future, ready, _kept) = self_waking(usize::MAX);
        let mut future = std::pin::pin!(RepollOnWake::new(future));
        assert!(future.as_mut().poll(&mut cx).is_pending());
        assert_eq!(woken.0.load(Ordering::Relaxed), 1, "woken to yield");
        assert!(future.as_mut().poll(&mut cx).is_pending());
        assert_eq!(woken.0.load(Ordering::Relaxed), 2);
        ready.store(true, Ordering::Release);
        assert_eq!(
            future.as_mut().poll(&mut cx),
            Poll::Ready(2 * (REPOLLS as usize + 1) + 1),
            "each poll of the task polled it three times"
        );
    }

    #[test]
    fn a_wake_from_another_thread_reaches_the_task_once_the_poll_is_over() {
        let (woken, task) = counting_waker();
        let mut cx = Context::from_waker(&task);
        let (future, ready, kept) = self_waking(0);
        let mut future = std::pin::pin!(RepollOnWake::new(future));
        assert!(future.as_mut().poll(&mut cx).is_pending());
        let waker = kept.lock().unwrap().take().unwrap();
        ready.store(true, Ordering::Release);
        std::thread::spawn(move || waker.wake()).join().unwrap();
        assert_eq!(woken.0.load(Ordering::Relaxed), 1);
        assert_eq!(future.as_mut().poll(&mut cx), Poll::Ready(2));
    }

    #[test]
    fn a_wake_from_another_thread_during_the_poll_is_taken_as_poll_again() {
        /// Has another thread wake it during its first poll (joined before
        /// the poll returns), then is ready.
        struct WokenElsewhere(usize);
        impl Future for WokenElsewhere {
            type Output = usize;
            fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<usize> {
                self.0 += 1;
                if self.0 > 1 {
                    return Poll::Ready(self.0);
                }
                let waker = cx.waker().clone();
                std::thread::spawn(move || waker.wake()).join().unwrap();
                Poll::Pending
            }
        }
        let (woken, task) = counting_waker();
        let mut cx = Context::from_waker(&task);
        let mut future = std::pin::pin!(RepollOnWake::new(WokenElsewhere(0)));
        assert_eq!(future.as_mut().poll(&mut cx), Poll::Ready(2));
        assert_eq!(
            woken.0.load(Ordering::Relaxed),
            0,
            "polled again, not woken"
        );
    }
}
