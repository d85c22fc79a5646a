//! The soft wire's two lock-free handshakes, written once over a small
//! atomics trait so that the very same code runs in the provider (std
//! atomics on shared memory) and under the `loom` model checker
//! (`loom_model.rs` beside it, a unit test, which explores every
//! interleaving and memory ordering the C11 model allows).
//!
//! - **Doorbell** (`ring`): a producer publishes the head, then looks at the
//!   consumer's `sleeping` flag; a consumer sets the flag, then looks at the
//!   head once more before it sleeps. One of them always sees the other, so
//!   a consumer never sleeps on bytes that nobody rings for.
//! - **Arm word** (`wake`): a CQ's arm fires exactly once, whoever takes it
//!   (a local completion or a peer's claim), and a peer's claim survives a
//!   re-arm until `get_event` takes it.

use std::sync::atomic::Ordering;

/// A 32-bit atomic word.
pub(crate) trait Word32 {
    /// Atomic load.
    fn load(&self, order: Ordering) -> u32;
    /// Atomic store.
    fn store(&self, value: u32, order: Ordering);
    /// Atomic compare-and-swap.
    fn compare_exchange(
        &self,
        current: u32,
        new: u32,
        success: Ordering,
        failure: Ordering,
    ) -> Result<u32, u32>;
    /// A sequentially consistent fence (of the same memory model as the word).
    fn fence(&self);
}

/// A 64-bit atomic word.
pub(crate) trait Word64 {
    /// Atomic load.
    fn load(&self, order: Ordering) -> u64;
    /// Atomic store.
    fn store(&self, value: u64, order: Ordering);
}

impl Word32 for std::sync::atomic::AtomicU32 {
    fn load(&self, order: Ordering) -> u32 {
        std::sync::atomic::AtomicU32::load(self, order)
    }
    fn store(&self, value: u32, order: Ordering) {
        std::sync::atomic::AtomicU32::store(self, value, order)
    }
    fn compare_exchange(
        &self,
        current: u32,
        new: u32,
        success: Ordering,
        failure: Ordering,
    ) -> Result<u32, u32> {
        std::sync::atomic::AtomicU32::compare_exchange(self, current, new, success, failure)
    }
    fn fence(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
    }
}

impl Word64 for std::sync::atomic::AtomicU64 {
    fn load(&self, order: Ordering) -> u64 {
        std::sync::atomic::AtomicU64::load(self, order)
    }
    fn store(&self, value: u64, order: Ordering) {
        std::sync::atomic::AtomicU64::store(self, value, order)
    }
}

// ------------------------------------------------------------- doorbell

/// Producer: publishes `new_head`; true when the consumer declared itself
/// asleep and must be woken (a doorbell). With `wake` false the bytes wait
/// for the consumer's next look and nobody is woken.
pub(crate) fn publish<H: Word64, S: Word32>(
    head: &H,
    sleeping: &S,
    new_head: u64,
    wake: bool,
) -> bool {
    if !wake {
        head.store(new_head, Ordering::Release);
        return false;
    }
    // A SeqCst fence between the store and the load, on both sides (here
    // and in `may_sleep`): of two such fences one comes first, so either we
    // see the flag or the consumer sees the head (the store-buffering
    // litmus test, forbidden with fences; loom checks it in this form).
    head.store(new_head, Ordering::Release);
    sleeping.fence();
    sleeping.load(Ordering::Relaxed) != 0
}

/// Consumer about to sleep: declares it, then looks at the head once more;
/// true when nothing arrived (it may sleep until a doorbell), false when
/// bytes wait (it must read them; it clears the flag itself).
pub(crate) fn may_sleep<H: Word64, S: Word32>(head: &H, sleeping: &S, tail: u64) -> bool {
    sleeping.store(1, Ordering::Relaxed);
    sleeping.fence();
    head.load(Ordering::Acquire) == tail
}

// ------------------------------------------------------------ arm word

/// Not armed (or fired already).
pub(crate) const DISARMED: u32 = 0;
/// Armed for the next completion.
pub(crate) const ARMED_ANY: u32 = 1;
/// Armed for the next solicited or error completion.
pub(crate) const ARMED_SOLICITED: u32 = 2;
/// Fired by a peer: an event waits to be taken by `get_event`.
pub(crate) const CLAIMED: u32 = 3;

fn update<W: Word32>(word: &W, mut next: impl FnMut(u32) -> Option<u32>) -> bool {
    let mut state = word.load(Ordering::SeqCst);
    loop {
        let Some(new) = next(state) else {
            return false;
        };
        match word.compare_exchange(state, new, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) => return true,
            Err(actual) => state = actual,
        }
    }
}

/// Arms for the next (solicited-only: solicited or error) completion. An
/// event a peer claimed and nobody took yet stays: it is the event this arm
/// would raise.
pub(crate) fn arm<W: Word32>(word: &W, solicited_only: bool) {
    let mode = if solicited_only {
        ARMED_SOLICITED
    } else {
        ARMED_ANY
    };
    update(word, |state| (state != CLAIMED).then_some(mode));
}

/// Takes the arm if it covers a completion that is solicited (or an error)
/// or not; true when taken: the taker raises the one event. `to` is
/// `DISARMED` (a local completion, queued by the taker) or `CLAIMED` (a
/// peer's, reported by `get_event`).
pub(crate) fn fire<W: Word32>(word: &W, solicited_or_error: bool, to: u32) -> bool {
    update(word, |state| {
        let covered = state == ARMED_ANY || (state == ARMED_SOLICITED && solicited_or_error);
        covered.then_some(to)
    })
}

/// Takes a peer's claimed event; true when there was one.
pub(crate) fn take_claimed<W: Word32>(word: &W) -> bool {
    word.compare_exchange(CLAIMED, DISARMED, Ordering::SeqCst, Ordering::SeqCst)
        .is_ok()
}
