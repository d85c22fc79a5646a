//! The application's two ends of a connection: a frame sink and a frame
//! stream that turn the connection themselves (no driver task between them
//! and the queue pair).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_core::Stream;
use futures_util::Sink;
use rpc_core::frame::EncodedFrame;
use rpc_core::transport::TransportError;

use super::state::Outcome;
use super::{Link, Poller};
use crate::config::PollMode;
use crate::spin::SpinPolicy;

/// The longest a multi-thread runtime's reader polls in place (without
/// giving its worker back) before it arms the CQ and sleeps: tokio's own
/// bound on the time between two awaits. It must cover a peer's wake-up
/// (30–60 µs on a small VM): a spin shorter than that sleeps whenever the
/// peer slept once, and then both sides pay wake-ups until the
/// conversation ends (at 30 µs, a `#[tokio::main]` echo's p50 was
/// 55–110 µs; at 100 µs, 8–10 µs).
const IN_PLACE_SPIN: Duration = Duration::from_micros(100);

/// Outgoing frames: `start_send` gives a frame to the protocol (a large one
/// is exposed for the peer's READs), `poll_flush` posts what the protocol
/// may send (one doorbell), `poll_ready` waits while the protocol takes no
/// more (the peer's credits, the queue's bound).
pub(crate) struct RdmaSink {
    link: Arc<Link>,
}

impl RdmaSink {
    pub(super) fn new(link: Arc<Link>) -> RdmaSink {
        RdmaSink { link }
    }

    /// Ready once no frame waits for the protocol (and what could be posted
    /// was posted when `post`).
    fn poll_taken(&self, cx: &mut Context<'_>, post: bool) -> Poll<Result<(), TransportError>> {
        let link = &self.link;
        let mut first = true;
        loop {
            let mut state = link.lock();
            if let Some(outcome) = &state.outcome {
                return Poll::Ready(Err(outcome.to_error()));
            }
            if state.failure.is_some() {
                // The housekeeper settles the reason (the peer's, maybe)
                // and wakes us: the writer then fails with it, not with a
                // bare "closed" that would race the reader's better one.
                link.wakers.writer.register(cx.waker());
                return Poll::Pending;
            }
            if !state.has_stashed() && (!post || !first) {
                return Poll::Ready(Ok(()));
            }
            first = false;
            if state.turn() {
                link.wake_others(&mut state, Poller::Writer);
                continue;
            }
            link.wake_keeper_if_due(&mut state);
            if !state.has_stashed() {
                return Poll::Ready(Ok(()));
            }
            // The protocol takes nothing until a completion (credits, a send
            // slot) or a READ of the peer: wait for the channel.
            link.wakers.writer.register(cx.waker());
            if !state.arm() || state.turn() {
                link.wake_others(&mut state, Poller::Writer);
                continue;
            }
            drop(state);
            if link.poll_channel().is_pending() {
                return Poll::Pending;
            }
        }
    }

    /// The sink is done: our CLOSE goes out after every frame given so far.
    fn close(&self) {
        let mut state = self.link.lock();
        if !state.sink_closed {
            state.sink_closed = true;
            state.turn();
            self.link.wake_others(&mut state, Poller::Writer);
        }
        drop(state);
        self.link.wakers.keeper.wake();
    }
}

impl Sink<EncodedFrame> for RdmaSink {
    type Error = TransportError;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.poll_taken(cx, false)
    }

    fn start_send(self: Pin<&mut Self>, frame: EncodedFrame) -> Result<(), Self::Error> {
        let mut state = self.link.lock();
        if state.is_ending() || state.sink_closed {
            return Err(TransportError::Closed);
        }
        if let Err(reason) = state.stash(frame) {
            state.fail(reason);
            drop(state);
            self.link.wakers.keeper.wake();
            return Err(TransportError::Closed);
        }
        Ok(())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.poll_taken(cx, true)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        match self.poll_taken(cx, true) {
            Poll::Ready(Ok(())) => {
                self.close();
                Poll::Ready(Ok(()))
            }
            other => other,
        }
    }
}

impl Drop for RdmaSink {
    fn drop(&mut self) {
        self.close();
    }
}

/// How a reader waits when there is nothing to take.
enum Wait {
    /// Poll again after every other task had its turn.
    Yield,
    /// Poll again at once, without giving the worker back.
    InPlace,
    /// Arm the CQ and sleep on its channel.
    Sleep,
}

/// Incoming frames, taken by the task that polls: the CQ is polled, receives
/// re-posted and the protocol turned inside `poll_next`.
pub(crate) struct RdmaStream<Y> {
    link: Arc<Link>,
    mode: PollMode,
    /// The adaptive spin of this poller.
    spin: SpinPolicy,
    /// Since when the stream found nothing to take.
    idle_since: Option<Instant>,
    /// A multi-thread runtime: yielding there wakes a sibling worker.
    multi_thread: bool,
    /// Gave the worker back once since the last frame (so that the task a
    /// frame woke, waiting in the worker's LIFO slot, ran first).
    yielded: bool,
    /// How a current-thread runtime's reader yields: tokio's `yield_now`,
    /// whose wake tokio defers until the scheduler had its round, so a
    /// `block_on` future woken by the last frame is polled before the
    /// reader polls again (a plain self-wake runs the reader up to 61
    /// times first: ~7 µs more per call). One future, reset per yield.
    yielder: Pin<Box<Y>>,
    fresh_yield: fn() -> Y,
    done: bool,
}

impl<Y: Future<Output = ()>> RdmaStream<Y> {
    /// `fresh_yield` is `tokio::task::yield_now`.
    pub(super) fn new(link: Arc<Link>, mode: PollMode, fresh_yield: fn() -> Y) -> RdmaStream<Y> {
        let spin = match mode {
            PollMode::Adaptive { spin } => SpinPolicy::new(spin),
            _ => SpinPolicy::new(Duration::ZERO),
        };
        let multi_thread = tokio::runtime::Handle::try_current().is_ok_and(|handle| {
            handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread
        });
        RdmaStream {
            link,
            mode,
            spin,
            idle_since: None,
            multi_thread,
            yielded: false,
            yielder: Box::pin(fresh_yield()),
            fresh_yield,
            done: false,
        }
    }

    /// Whether (and how) to poll again before sleeping.
    fn wait(&mut self) -> Wait {
        if rpc_core::transport::polling_quietly() {
            // A reader leaving the stream to another task: the wait is that
            // task's, not ours to spin or time.
            return Wait::Sleep;
        }
        let now = Instant::now();
        let idle = now - *self.idle_since.get_or_insert(now);
        match self.mode {
            PollMode::Event => Wait::Sleep,
            PollMode::BusyPoll => Wait::Yield,
            // A multi-thread worker that yields goes through the run queue
            // and may wake a sibling worker: yield once (the task the last
            // frame woke runs first: it sits in this worker's LIFO slot,
            // which nobody steals), then spin in place, briefly.
            PollMode::Adaptive { .. } if self.multi_thread => {
                if idle >= IN_PLACE_SPIN || !self.spin.may_spin_in_place(idle, now) {
                    Wait::Sleep
                } else if !self.yielded {
                    self.yielded = true;
                    Wait::Yield
                } else {
                    Wait::InPlace
                }
            }
            // Past a few microseconds this also gives the CPU away between
            // polls, and stops spinning when another thread wanted the CPU.
            PollMode::Adaptive { .. } => {
                if self.spin.keep_spinning(idle, now) {
                    Wait::Yield
                } else {
                    Wait::Sleep
                }
            }
        }
    }

    /// Something came: the wait (if any) teaches the spin policy.
    fn woke(&mut self) {
        self.yielded = false;
        if let Some(since) = self.idle_since.take() {
            self.spin.waited(since.elapsed());
        }
    }
}

impl<Y: Future<Output = ()>> Stream for RdmaStream<Y> {
    type Item = Result<Bytes, TransportError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        let link = self.link.clone();
        // Registered before the first look: a wake after it is not lost.
        link.wakers.reader.register(cx.waker());
        loop {
            let mut state = link.lock();
            let mut progressed = false;
            let mut item = state.next_inbound();
            if item.is_none() {
                progressed = state.turn();
                if progressed {
                    link.wake_others(&mut state, Poller::Reader);
                    item = state.next_inbound();
                } else {
                    link.wake_keeper_if_due(&mut state);
                }
            }
            if let Some(item) = item {
                state.received = false;
                drop(state);
                self.woke();
                return Poll::Ready(Some(item));
            }
            if state.inbound_closed {
                self.done = true;
                return Poll::Ready(None);
            }
            if let Some(outcome) = &state.outcome {
                self.done = true;
                return Poll::Ready(match outcome {
                    Outcome::Clean => None,
                    failed => Some(Err(failed.to_error())),
                });
            }
            if state.failure.is_some() {
                // The housekeeper ends the connection and wakes us.
                drop(state);
                link.wakers.keeper.wake();
                return Poll::Pending;
            }
            if progressed {
                continue;
            }
            match self.wait() {
                Wait::InPlace => {
                    drop(state);
                    std::hint::spin_loop();
                    continue;
                }
                Wait::Yield if self.multi_thread => {
                    drop(state);
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                Wait::Yield => {
                    drop(state);
                    let fresh = (self.fresh_yield)();
                    self.yielder.set(fresh);
                    if self.yielder.as_mut().poll(cx).is_ready() {
                        continue;
                    }
                    return Poll::Pending;
                }
                Wait::Sleep => {}
            }
            if !state.arm() || state.turn() {
                link.wake_others(&mut state, Poller::Reader);
                continue;
            }
            drop(state);
            if link.poll_channel().is_pending() {
                return Poll::Pending;
            }
        }
    }
}

impl<Y> Drop for RdmaStream<Y> {
    fn drop(&mut self) {
        self.link.lock().stream_dropped = true;
        self.link.wakers.keeper.wake();
    }
}
