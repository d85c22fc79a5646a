//! Receive and send slots shared by every connection of a device, so a
//! connection costs registered memory only while it has messages in flight.
//!
//! - [`SharedReceivePool`]: one shared receive queue (SRQ) and the slots
//!   posted to it. Every connection's QP takes its receives from the SRQ; a
//!   connection's peer may send only as many messages as slots are
//!   *committed* to the connection (its credit window, see the protocol's
//!   docs), and the pool never commits more slots than it has posted, so no
//!   SEND meets an empty SRQ (no RNR). A connection starts with a few
//!   committed slots and commits more while its peer keeps running out.
//! - [`SharedSendPool`]: send slots a connection takes for one message and
//!   gets back with that SEND's completion.
//!
//! Both grow in chunks of [`CHUNK_SLOTS`] slots, one registration each, up to
//! a cap, and never shrink: after warm-up nothing is registered on the hot
//! path, and what is registered is what the busiest moment needed.
//!
//! **Ownership while the device works.** A slot named by a posted request is
//! marked so until the completion polled for it comes back, and no
//! reference to it is handed out meanwhile (asserted). Only this crate posts
//! requests naming slots, and only this crate's pollers hand completions
//! in: the receive pool's own posts on its SRQ (which it does not hand out),
//! and [`crate::pooled::PooledQp`], which owns a connection's QP and CQ. A
//! receive slot's wr_id is its index in the pool (the pooled QP's tag bits
//! clear). A pool whose slots are still the device's when it is dropped
//! leaks their memory instead of freeing it.

use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;

use crate::{
    AccessFlags, ProtectionDomain, RecvWr, RegisteredBuffer, Sge, SharedReceiveQueue, VerbsError,
};

/// A device's shared receive and send slots of one slot length.
#[derive(Debug)]
pub struct SharedPools {
    /// The SRQ and its slots.
    pub receive: SharedReceivePool,
    /// Send slots.
    pub send: SharedSendPool,
}

/// The caps of a device's [`SharedPools`], in slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolCaps {
    /// Receive slots registered at most (initial windows and growth together).
    pub receive: usize,
    /// Receive slots committed beyond connections' initial windows, all
    /// connections together: what busy (or hostile) peers may hold for
    /// windows larger than the initial one.
    pub growth: usize,
    /// Send slots registered at most (a connection with no SEND in flight
    /// still gets one past it).
    pub send: usize,
}

impl PoolCaps {
    /// `slots` for every cap.
    pub fn uniform(slots: usize) -> PoolCaps {
        PoolCaps {
            receive: slots,
            growth: slots,
            send: slots,
        }
    }
}

impl SharedPools {
    /// Both pools, for slots of `slot_len` bytes, up to about `max_slots` each.
    pub fn new(
        pd: &Arc<dyn ProtectionDomain>,
        slot_len: usize,
        max_slots: usize,
    ) -> Result<SharedPools, VerbsError> {
        Self::with_caps(pd, slot_len, PoolCaps::uniform(max_slots))
    }

    /// Both pools, for slots of `slot_len` bytes, within `caps`.
    pub fn with_caps(
        pd: &Arc<dyn ProtectionDomain>,
        slot_len: usize,
        caps: PoolCaps,
    ) -> Result<SharedPools, VerbsError> {
        let mut receive = SharedReceivePool::new(pd, slot_len, caps.receive)?;
        receive.max_grown = caps.growth;
        Ok(SharedPools {
            receive,
            send: SharedSendPool::new(pd, slot_len, caps.send),
        })
    }
}

/// Slots per registration of either pool.
pub const CHUNK_SLOTS: usize = 256;

/// Registered chunks of equal slots.
#[derive(Debug)]
struct Chunks {
    slot_len: usize,
    chunks: Vec<RegisteredBuffer>,
}

impl Chunks {
    fn slots(&self) -> usize {
        self.chunks.len() * CHUNK_SLOTS
    }

    /// Registers one more chunk; returns the indices of its slots.
    fn grow(
        &mut self,
        pd: &Arc<dyn ProtectionDomain>,
    ) -> Result<std::ops::Range<usize>, VerbsError> {
        let first = self.slots();
        self.chunks.push(RegisteredBuffer::new(
            pd,
            CHUNK_SLOTS * self.slot_len,
            AccessFlags::LOCAL_WRITE,
        )?);
        Ok(first..first + CHUNK_SLOTS)
    }

    fn sge(&self, slot: usize, len: usize) -> Sge {
        assert!(len <= self.slot_len, "slot range");
        self.chunks[slot / CHUNK_SLOTS].sge((slot % CHUNK_SLOTS) * self.slot_len, len)
    }

    /// The first `len` bytes of `slot` (at most the slot), borrowing no
    /// other slot of its chunk: the device may be writing those.
    ///
    /// # Safety
    /// No request the device may still execute names `slot`, and nothing
    /// writes it while the slice lives.
    unsafe fn bytes(&self, slot: usize, len: usize) -> &[u8] {
        let start = (slot % CHUNK_SLOTS) * self.slot_len;
        // SAFETY: the caller's contract, for exactly this slot's bytes.
        unsafe { self.chunks[slot / CHUNK_SLOTS].range(start, len.min(self.slot_len)) }
    }

    /// The whole of `slot`, writable, borrowing no other slot of its chunk.
    ///
    /// # Safety
    /// No request the device may still execute names `slot`, and nothing
    /// else reads or writes it while the slice lives.
    #[allow(clippy::mut_from_ref)] // the slots are raw memory, not `self`'s fields
    unsafe fn bytes_mut(&self, slot: usize) -> &mut [u8] {
        let start = (slot % CHUNK_SLOTS) * self.slot_len;
        // SAFETY: the caller's contract, for exactly this slot's bytes.
        unsafe { self.chunks[slot / CHUNK_SLOTS].range_mut(start, self.slot_len) }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

/// No slot can be committed: the pool is at its cap.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the shared receive pool is full: {committed} of at most {max} slots are committed to connections \
     (raise RdmaConfig::max_shared_slots, or lower initial_credits)"
)]
pub struct PoolFull {
    /// Slots committed.
    pub committed: usize,
    /// The pool's cap.
    pub max: usize,
}

/// Why slots could not be committed.
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    /// At the cap.
    #[error(transparent)]
    Full(#[from] PoolFull),
    /// Registering or posting a new chunk failed.
    #[error("growing the shared receive pool: {0}")]
    Verbs(#[from] VerbsError),
}

#[derive(Debug)]
struct ReceiveState {
    chunks: Chunks,
    /// Slots posted to the SRQ (the device's until their completion).
    posted: Vec<bool>,
    books: SlotLedger,
}

/// The receive pool's books: slots committed to connections, and the part
/// of them that windows grew by. Pure arithmetic: the pool keeps it under
/// its lock, and `loom_model` runs the same methods from connections on
/// several threads, with [`WindowBooks`], checking that nothing is
/// committed past what is registered and everything comes back.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlotLedger {
    committed: usize,
    grown: usize,
}

impl SlotLedger {
    /// Commits at least `at_least` and at most `want` (or `at_least`, if
    /// more) of the `registered` slots; `None` when fewer than `at_least`
    /// are free (nothing committed).
    pub(crate) fn commit(
        &mut self,
        registered: usize,
        at_least: usize,
        want: usize,
    ) -> Option<usize> {
        let free = registered.saturating_sub(self.committed);
        if free < at_least {
            return None;
        }
        let committed = free.min(want.max(at_least));
        self.committed += committed;
        Some(committed)
    }

    /// How many of `want` slots windows may still grow by, all together,
    /// within `max_grown`.
    pub(crate) fn growth_allowed(&self, want: usize, max_grown: usize) -> usize {
        want.min(max_grown.saturating_sub(self.grown))
    }

    /// `slots` just committed grew a window.
    pub(crate) fn grew(&mut self, slots: usize) {
        self.grown += slots;
    }

    /// Gives back `slots` of a connection's initial window.
    pub(crate) fn release(&mut self, slots: usize) {
        self.committed = self.committed.saturating_sub(slots);
    }

    /// Gives back `slots` a window grew by.
    pub(crate) fn release_grown(&mut self, slots: usize) {
        self.grown = self.grown.saturating_sub(slots);
        self.committed = self.committed.saturating_sub(slots);
    }

    /// Slots committed.
    pub(crate) fn committed(&self) -> usize {
        self.committed
    }

    /// The part of them windows grew by.
    pub(crate) fn grown(&self) -> usize {
        self.grown
    }
}

/// One connection's part of the receive pool: its initial slots and what
/// its window grew by, in the order they go back (what it grew by first).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WindowBooks {
    /// Slots of the initial window still held.
    pub initial: usize,
    /// Slots the window grew by, still held.
    pub grown: usize,
}

impl WindowBooks {
    /// The peer gave back `slots`: takes them from what the window grew by
    /// first, then from the initial slots; returns (grown, initial) to give
    /// back to the pool ([`SharedReceivePool::release_grown`],
    /// [`SharedReceivePool::release`]).
    pub fn give_back(&mut self, slots: usize) -> (usize, usize) {
        let from_grown = slots.min(self.grown);
        self.grown -= from_grown;
        let from_initial = (slots - from_grown).min(self.initial);
        self.initial -= from_initial;
        (from_grown, from_initial)
    }

    /// Everything still held, as (grown, initial); the books are empty after.
    pub fn take_all(&mut self) -> (usize, usize) {
        let all = (self.grown, self.initial);
        *self = WindowBooks::default();
        all
    }
}

/// An SRQ and the receive slots posted to it (see the module docs).
pub struct SharedReceivePool {
    srq: Arc<dyn SharedReceiveQueue>,
    pd: Arc<dyn ProtectionDomain>,
    max_slots: usize,
    /// Cap of [`SharedReceivePool::grow`]'s commitments, all together.
    max_grown: usize,
    state: Mutex<ReceiveState>,
}

impl std::fmt::Debug for SharedReceivePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = lock(&self.state);
        f.debug_struct("SharedReceivePool")
            .field("slot_len", &state.chunks.slot_len)
            .field("slots", &state.chunks.slots())
            .field("committed", &state.books.committed())
            .field("max_slots", &self.max_slots)
            .finish()
    }
}

impl SharedReceivePool {
    /// An SRQ for up to `max_slots` receives of `slot_len` bytes (rounded up
    /// to whole chunks); no slot is registered until one is committed.
    pub fn new(
        pd: &Arc<dyn ProtectionDomain>,
        slot_len: usize,
        max_slots: usize,
    ) -> Result<SharedReceivePool, VerbsError> {
        let max_slots = (max_slots / CHUNK_SLOTS).max(1) * CHUNK_SLOTS;
        let max_wr = u32::try_from(max_slots)
            .map_err(|_| VerbsError::InvalidArgument("shared receive pool over 2^32 slots"))?;
        Ok(SharedReceivePool {
            srq: pd.create_srq(max_wr, 1)?,
            pd: pd.clone(),
            max_slots,
            max_grown: max_slots,
            state: Mutex::new(ReceiveState {
                chunks: Chunks {
                    slot_len,
                    chunks: Vec::new(),
                },
                posted: Vec::new(),
                books: SlotLedger::default(),
            }),
        })
    }

    /// The SRQ every connection's QP is created with
    /// ([`crate::pooled::PooledQp::new`]).
    pub(crate) fn srq(&self) -> &Arc<dyn SharedReceiveQueue> {
        &self.srq
    }

    /// The protection domain its slots are registered with.
    pub(crate) fn pd(&self) -> &Arc<dyn ProtectionDomain> {
        &self.pd
    }

    /// Bytes per slot.
    pub fn slot_len(&self) -> usize {
        lock(&self.state).chunks.slot_len
    }

    /// Slots committed to connections.
    pub fn committed(&self) -> usize {
        lock(&self.state).books.committed()
    }

    /// Slots registered and posted (or being handled by a driver).
    pub fn capacity(&self) -> usize {
        lock(&self.state).chunks.slots()
    }

    /// Commits at least `at_least` and at most `want` slots to a connection,
    /// registering and posting chunks as needed up to the cap; returns how
    /// many. Fails only when `at_least` cannot be had.
    pub fn commit(&self, at_least: usize, want: usize) -> Result<usize, CommitError> {
        self.commit_locked(&mut lock(&self.state), at_least, want)
    }

    /// Commits up to `want` more slots to a connection whose window grows
    /// (none when the pool is full), within the pool's growth cap, which
    /// all connections share; returns how many. Give them back with
    /// [`SharedReceivePool::release_grown`].
    pub fn grow(&self, want: usize) -> Result<usize, VerbsError> {
        let mut state = lock(&self.state);
        let want = state.books.growth_allowed(want, self.max_grown);
        if want == 0 {
            return Ok(0);
        }
        let committed = match self.commit_locked(&mut state, 0, want) {
            Ok(committed) => committed,
            Err(CommitError::Full(_)) => 0,
            Err(CommitError::Verbs(error)) => return Err(error),
        };
        state.books.grew(committed);
        Ok(committed)
    }

    /// Slots committed by [`SharedReceivePool::grow`], all connections together.
    pub fn grown(&self) -> usize {
        lock(&self.state).books.grown()
    }

    /// A connection gives back `slots` its window grew by.
    pub fn release_grown(&self, slots: usize) {
        lock(&self.state).books.release_grown(slots);
    }

    fn commit_locked(
        &self,
        state: &mut ReceiveState,
        at_least: usize,
        want: usize,
    ) -> Result<usize, CommitError> {
        let want = want.max(at_least);
        while state.chunks.slots() - state.books.committed() < want
            && state.chunks.slots() + CHUNK_SLOTS <= self.max_slots
        {
            let slots = state.chunks.grow(&self.pd)?;
            state.posted.resize(slots.end, false);
            Self::post(&self.srq, state, slots)?;
        }
        let registered = state.chunks.slots();
        state
            .books
            .commit(registered, at_least, want)
            .ok_or_else(|| {
                PoolFull {
                    committed: state.books.committed(),
                    max: self.max_slots,
                }
                .into()
            })
    }

    /// A connection no longer needs `slots` of its commitment (its peer gave
    /// them back, or it ended).
    pub fn release(&self, slots: usize) {
        lock(&self.state).books.release(slots);
    }

    fn post(
        srq: &Arc<dyn SharedReceiveQueue>,
        state: &mut ReceiveState,
        slots: impl IntoIterator<Item = usize>,
    ) -> Result<(), VerbsError> {
        let slot_len = state.chunks.slot_len;
        let mut wrs = Vec::new();
        for slot in slots {
            assert!(!state.posted[slot], "slot {slot} is posted already");
            state.posted[slot] = true;
            wrs.push(RecvWr {
                wr_id: slot as u64,
                sg_list: vec![state.chunks.sge(slot, slot_len)],
            });
        }
        // SAFETY: every SGE covers one slot of a chunk this pool registered,
        // which stays allocated and registered while the pool (which owns the
        // SRQ and outlives every QP attached to it through the `Arc`s the
        // connections hold) lives; each slot was just marked posted, and
        // `take`/`bytes` hand out no reference to a posted slot.
        let posted = unsafe { srq.post_recv(wrs) };
        posted.map_err(|failed| {
            for wr in failed.rejected {
                state.posted[wr.wr_id as usize] = false;
            }
            failed.error
        })
    }

    /// The receive in `slot` completed with `len` bytes: copies them out.
    /// The slot is the caller's until [`SharedReceivePool::repost`].
    ///
    /// # Safety
    /// The completion of the receive this pool posted in `slot` was polled
    /// from a CQ (so the device is done with the slot: the
    /// [`crate::CompletionQueue`] contract).
    pub(crate) unsafe fn take(&self, slot: usize, len: usize) -> Result<Bytes, VerbsError> {
        let mut state = lock(&self.state);
        Self::claim(&mut state, slot)?;
        if len > state.chunks.slot_len {
            return Err(VerbsError::InvalidArgument(
                "a receive completion longer than its slot",
            ));
        }
        // SAFETY: the slot's receive completed (this function's contract),
        // so no request names it; it is no longer marked posted (`claim`),
        // so this pool posts nothing into it until `repost`, which takes
        // the state lock we hold.
        Ok(Bytes::copy_from_slice(unsafe {
            state.chunks.bytes(slot, len)
        }))
    }

    /// The receive in `slot` completed with an error (e.g. flushed): the slot
    /// is the caller's, to repost.
    ///
    /// # Safety
    /// As for [`SharedReceivePool::take`].
    pub(crate) unsafe fn take_failed(&self, slot: usize) -> Result<(), VerbsError> {
        Self::claim(&mut lock(&self.state), slot)
    }

    fn claim(state: &mut ReceiveState, slot: usize) -> Result<(), VerbsError> {
        match state.posted.get_mut(slot) {
            Some(posted) if *posted => {
                *posted = false;
                Ok(())
            }
            _ => Err(VerbsError::InvalidArgument(
                "a receive completion for a slot that is not posted",
            )),
        }
    }

    /// Posts `slots` (taken before) to the SRQ again.
    pub(crate) fn repost(&self, slots: &[usize]) -> Result<(), VerbsError> {
        Self::post(&self.srq, &mut lock(&self.state), slots.iter().copied())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SendSlot {
    Free,
    /// Taken by a connection, not posted.
    Held,
    /// Named by a posted SEND until its completion.
    InFlight,
}

#[derive(Debug)]
struct SendState {
    chunks: Chunks,
    slots: Vec<SendSlot>,
    free: Vec<usize>,
    lost: usize,
}

/// Send slots shared by the connections of a device (see the module docs).
pub struct SharedSendPool {
    pd: Arc<dyn ProtectionDomain>,
    max_slots: usize,
    state: Mutex<SendState>,
}

impl std::fmt::Debug for SharedSendPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = lock(&self.state);
        f.debug_struct("SharedSendPool")
            .field("slot_len", &state.chunks.slot_len)
            .field("slots", &state.chunks.slots())
            .field("free", &state.free.len())
            .finish()
    }
}

impl SharedSendPool {
    /// A pool of slots of `slot_len` bytes, registered a chunk at a time up
    /// to about `max_slots`.
    pub fn new(
        pd: &Arc<dyn ProtectionDomain>,
        slot_len: usize,
        max_slots: usize,
    ) -> SharedSendPool {
        SharedSendPool {
            pd: pd.clone(),
            max_slots: max_slots.max(CHUNK_SLOTS),
            state: Mutex::new(SendState {
                chunks: Chunks {
                    slot_len,
                    chunks: Vec::new(),
                },
                slots: Vec::new(),
                free: Vec::new(),
                lost: 0,
            }),
        }
    }

    /// Slots registered.
    pub fn capacity(&self) -> usize {
        lock(&self.state).chunks.slots()
    }

    /// A free slot for one message, registering a chunk when none is free
    /// and the cap allows (or `past_cap`: a connection with no SEND in
    /// flight, which could not wait for a completion of its own). `None`:
    /// wait for a completion.
    pub(crate) fn take(&self, past_cap: bool) -> Result<Option<usize>, VerbsError> {
        let mut state = lock(&self.state);
        if state.free.is_empty() && (past_cap || state.chunks.slots() < self.max_slots) {
            let slots = state.chunks.grow(&self.pd)?;
            state.slots.resize(slots.end, SendSlot::Free);
            state.free.extend(slots.rev());
        }
        let Some(slot) = state.free.pop() else {
            return Ok(None);
        };
        state.slots[slot] = SendSlot::Held;
        Ok(Some(slot))
    }

    /// Gives back a slot taken and not sent.
    pub(crate) fn put_back(&self, slot: usize) {
        let mut state = lock(&self.state);
        assert_eq!(
            state.slots[slot],
            SendSlot::Held,
            "slot {slot} put back twice"
        );
        state.slots[slot] = SendSlot::Free;
        state.free.push(slot);
    }

    /// Writes a message into held `slot` with `write` (which returns its
    /// length) and marks the slot in flight: the SGE is for a SEND posted
    /// next ([`crate::pooled::PooledQp::send`]).
    pub(crate) fn fill(&self, slot: usize, write: impl FnOnce(&mut [u8]) -> usize) -> Sge {
        let mut state = lock(&self.state);
        assert_eq!(state.slots[slot], SendSlot::Held, "slot {slot} is not held");
        // SAFETY: the slot is Held (asserted): taken from the free list by
        // `take` and not posted since, so no request names it and nothing
        // else of this pool touches it; we hold the state lock.
        let len = write(unsafe { state.chunks.bytes_mut(slot) });
        state.slots[slot] = SendSlot::InFlight;
        state.chunks.sge(slot, len)
    }

    /// The SEND from `slot` will never complete where anyone polls it: the
    /// slot stays in flight for good (its memory is the device's as far as
    /// anyone can tell), and the pool leaks its chunk when dropped.
    pub(crate) fn lose(&self, slot: usize) {
        let mut state = lock(&self.state);
        if state.slots.get(slot) == Some(&SendSlot::InFlight) {
            state.lost += 1;
        }
    }

    /// Slots taken by connections or named by SENDs in flight (lost ones
    /// included): 0 once every connection has ended, on a healthy device.
    pub fn out(&self) -> usize {
        let state = lock(&self.state);
        state.slots.len() - state.free.len()
    }

    /// Send slots lost for good: their SEND never completed where a poller
    /// could see it, so they stay out of the pool.
    pub fn lost(&self) -> usize {
        lock(&self.state).lost
    }

    /// The SEND from `slot` completed (or was flushed): the slot is free.
    ///
    /// # Safety
    /// The completion (or flush) of the SEND posted from `slot` was polled
    /// from a CQ: the device no longer reads the slot.
    pub(crate) unsafe fn completed(&self, slot: usize) -> Result<(), VerbsError> {
        let mut state = lock(&self.state);
        match state.slots.get(slot) {
            Some(SendSlot::InFlight) => {
                state.slots[slot] = SendSlot::Free;
                state.free.push(slot);
                Ok(())
            }
            _ => Err(VerbsError::InvalidArgument(
                "a send completion for a slot not in flight",
            )),
        }
    }
}

impl Drop for SharedSendPool {
    fn drop(&mut self) {
        let state = self
            .state
            .get_mut()
            .unwrap_or_else(|poison| poison.into_inner());
        if state.slots.contains(&SendSlot::InFlight) {
            // A SEND the device may still read: never free its memory.
            for chunk in state.chunks.chunks.drain(..) {
                chunk.leak();
            }
        }
    }
}

impl Drop for SharedReceivePool {
    fn drop(&mut self) {
        let state = self
            .state
            .get_mut()
            .unwrap_or_else(|poison| poison.into_inner());
        // Posted receives are the SRQ's until it is destroyed, which happens
        // when its last `Arc` goes: this pool's, unless a QP still holds
        // one. Then the device may still write them: never free them.
        if Arc::strong_count(&self.srq) > 1 && state.posted.contains(&true) {
            for chunk in state.chunks.chunks.drain(..) {
                chunk.leak();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock::MockContext;

    /// loom: three connections of one device, on threads of their own,
    /// commit their initial windows, grow them, are given back part of
    /// them and end, each step under the pool's lock on its own (as
    /// `SharedReceivePool` and rpc-transport-rdma's `Commitment` take it),
    /// over the very books the pool keeps ([`SlotLedger`], [`WindowBooks`]).
    /// In every interleaving: nothing is committed past what is registered,
    /// growth stays within its cap, and once every connection ended the
    /// books are back to zero (no slot lost or counted twice).
    #[test]
    fn the_receive_books_balance_in_every_interleaving() {
        const REGISTERED: usize = 8;
        const MAX_GROWN: usize = 3;
        fn check(books: &SlotLedger) {
            assert!(books.committed() <= REGISTERED, "{books:?}");
            assert!(books.grown() <= books.committed(), "{books:?}");
            assert!(books.grown() <= MAX_GROWN, "{books:?}");
        }
        // Three threads of seven lock steps each: every interleaving is too
        // many; loom's preemption bound keeps those with at most three forced
        // switches (loom's docs: a bound of 2 or 3 catches most bugs).
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(3);
        model.check(|| {
            let ledger = loom::sync::Arc::new(loom::sync::Mutex::new(SlotLedger::default()));
            let connections: Vec<_> = (0..3usize)
                .map(|connection| {
                    let ledger = ledger.clone();
                    loom::thread::spawn(move || {
                        let mut window = WindowBooks::default();
                        {
                            let mut books = ledger.lock().unwrap();
                            // All or nothing, as `Commitment::new`.
                            if let Some(initial) = books.commit(REGISTERED, 3, 3) {
                                window.initial = initial;
                            }
                            check(&books);
                        }
                        if window.initial == 0 {
                            return; // refused: the pool is full
                        }
                        {
                            // As `SharedReceivePool::grow`.
                            let mut books = ledger.lock().unwrap();
                            let want = books.growth_allowed(2, MAX_GROWN);
                            if let Some(grown) = books.commit(REGISTERED, 0, want) {
                                books.grew(grown);
                                window.grown += grown;
                            }
                            check(&books);
                        }
                        // The peer gives some back (`Commitment::give_back`).
                        let (grown, initial) = window.give_back(1 + connection);
                        for release in [grown, initial].into_iter().enumerate() {
                            let mut books = ledger.lock().unwrap();
                            match release {
                                (0, slots) => books.release_grown(slots),
                                (_, slots) => books.release(slots),
                            }
                            check(&books);
                        }
                        // The connection ends (`Commitment`'s drop).
                        let (grown, initial) = window.take_all();
                        ledger.lock().unwrap().release_grown(grown);
                        ledger.lock().unwrap().release(initial);
                    })
                })
                .collect();
            for connection in connections {
                connection.join().unwrap();
            }
            assert_eq!(*ledger.lock().unwrap(), SlotLedger::default());
        });
    }

    /// Issue 30, attack 6: windows grow only within the growth cap that all
    /// connections share, and the send pool stops registering at its cap;
    /// initial windows still come from the receive cap.
    #[test]
    fn window_growth_and_send_slots_stay_within_their_caps() {
        let context = MockContext::open();
        let pd = context.alloc_pd().unwrap();
        let caps = PoolCaps {
            receive: 8 * CHUNK_SLOTS,
            growth: CHUNK_SLOTS,
            send: CHUNK_SLOTS,
        };
        let pools = SharedPools::with_caps(&pd, 64, caps).unwrap();
        for _ in 0..100 {
            assert_eq!(pools.receive.commit(4, 4).unwrap(), 4);
        }
        assert_eq!(pools.receive.grow(200).unwrap(), 200);
        assert_eq!(
            pools.receive.grow(200).unwrap(),
            CHUNK_SLOTS - 200,
            "capped"
        );
        assert_eq!(pools.receive.grow(1).unwrap(), 0);
        assert_eq!(pools.receive.committed(), 400 + CHUNK_SLOTS);
        // Initial windows are not growth: still granted.
        assert_eq!(pools.receive.commit(4, 4).unwrap(), 4);
        pools.receive.release_grown(100);
        assert_eq!(pools.receive.grown(), CHUNK_SLOTS - 100);
        assert_eq!(pools.receive.grow(200).unwrap(), 100);

        let mut taken = Vec::new();
        while let Some(slot) = pools.send.take(false).unwrap() {
            taken.push(slot);
            assert!(taken.len() <= CHUNK_SLOTS, "past the cap");
        }
        assert_eq!(taken.len(), CHUNK_SLOTS);
        assert_eq!(pools.send.capacity(), CHUNK_SLOTS);
        // A connection with nothing in flight still gets a slot.
        let extra = pools.send.take(true).unwrap().expect("one past the cap");
        pools.send.put_back(extra);
        for slot in taken {
            pools.send.put_back(slot);
        }
    }
}
