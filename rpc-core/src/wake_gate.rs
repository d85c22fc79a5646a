//! [`WakeGated`]: a future polled again only after its own waker fired.
//!
//! A connection's task waits on several things at once in one `select!`, and
//! every wake-up of the task polls each of them. Most are cheap to poll, but
//! a [`CancellationToken`](tokio_util::sync::CancellationToken)'s `cancelled()`
//! takes two mutexes per poll (the token's and its `Notify`'s), which on a hot
//! connection is paid once per frame for a signal that fires once in the
//! connection's life. Gating the future behind a waker of its own (the trick
//! `FuturesUnordered` uses) makes a poll that nothing changed for one atomic
//! swap and one `AtomicWaker` check.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

/// The waker handed to the gated future: notes that it fired, then wakes the
/// task that polls the gate.
struct Gate {
    fired: AtomicBool,
    task: AtomicWaker,
}

impl Wake for Gate {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.fired.store(true, Ordering::Release);
        self.task.wake();
    }
}

pin_project_lite::pin_project! {
    /// Polls `F` on its first poll and afterwards only when `F` woke.
    ///
    /// Correct for any future whose readiness is announced through its waker
    /// (every well-behaved future): a poll skipped is one `F` did not ask for.
    pub(crate) struct WakeGated<F> {
        #[pin]
        inner: F,
        gate: Arc<Gate>,
        waker: Waker,
    }
}

impl<F: Future> WakeGated<F> {
    pub(crate) fn new(inner: F) -> WakeGated<F> {
        let gate = Arc::new(Gate {
            fired: AtomicBool::new(true),
            task: AtomicWaker::new(),
        });
        let waker = Waker::from(gate.clone());
        WakeGated { inner, gate, waker }
    }
}

impl<F: Future> Future for WakeGated<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        // Register first: a wake between the registration and the check
        // below either sets `fired` before we read it or wakes this task.
        this.gate.task.register(cx.waker());
        if !this.gate.fired.swap(false, Ordering::AcqRel) {
            return Poll::Pending;
        }
        this.inner.poll(&mut Context::from_waker(this.waker))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

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
}
