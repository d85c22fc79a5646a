#![forbid(unsafe_code)]
//! rpc-recycle: large encode buffers, recycled, with their memory tracked.
//!
//! (rpc-core re-exports this crate as `rpc_core::codec::recycle`; the RDMA
//! verbs crate reads [`recycled_memory`] and sets [`on_release`] without
//! depending on rpc-core.)
//!
//! Large encode buffers, recycled: a large message is encoded into memory that
//! earlier messages already touched, so steady traffic of large messages
//! allocates (and page-faults in) nothing per call.
//!
//! Memory above the allocator's mmap threshold (32 MiB at most with glibc) is
//! mapped fresh on every allocation and unmapped on every free: a 64 MiB
//! message then costs 16,384 page faults, which is longer than copying it.
//! Buffers of [`RECYCLE_FROM`] bytes or more go back to a process-wide free
//! list when the last `Bytes` over them is dropped (after the transport sent
//! the frame, or the peer READ it), bounded by [`MAX_IDLE_BYTES`] in all: a
//! buffer returned to a full list makes room by freeing the longest-idle ones.
//!
//! # Memory whose lifetime is known
//!
//! A transport may keep state about a recycled buffer's memory for as long as
//! the buffer lives (rdma:// keeps a memory registration over it, so that a
//! large frame needs no registration of its own). For that this module tracks
//! every recycled buffer it hands out, from the first time it is frozen into
//! `Bytes` until its memory goes back to the allocator, and says so:
//!
//! - [`recycled_memory`] tells whether some bytes lie inside a recycled buffer
//!   that is frozen (immutable, and kept alive by those very bytes), and
//!   names that buffer's memory ([`RecycledMemory`]: address, capacity, and an
//!   id never given to other memory);
//! - the hook set with [`on_release`] runs with that [`RecycledMemory`]
//!   **before** the memory is freed (evicted from the free list, returned
//!   while the list is full, or dropped by whoever had taken it).
//!
//! Between being taken and being frozen again, a buffer is written by its
//! taker (an encoder, a socket read, a `SendBuffer` (rpc-core)), who may also
//! grow it (moving it to new memory) or drop it. The free list keeps a
//! second handle on the memory meanwhile, so the memory cannot be freed, and
//! no other buffer can be placed at its address, behind the tracker's back:
//! a buffer frozen at the address it was taken at is the same memory (the
//! same id); anything else is new memory (a new id), and a taken buffer whose
//! taker let go of it is released (hook first) at the tracker's next use.

use std::collections::BTreeMap;
use std::sync::Mutex;

use bytes::{Bytes, BytesMut};

/// Messages at least this long (by the codec's length hint) are encoded into
/// recycled buffers; smaller ones into an ordinary allocation.
pub const RECYCLE_FROM: usize = 1 << 20;

/// Idle recycled buffers the process keeps, in bytes, all together.
pub const MAX_IDLE_BYTES: usize = 512 << 20;

/// What is done to the memory of each new recycled buffer before its first
/// use; see [`prepare_new_buffers_with`].
pub type PrepareBuffer = fn(&mut [std::mem::MaybeUninit<u8>]);

static PREPARE: std::sync::OnceLock<PrepareBuffer> = std::sync::OnceLock::new();

/// Sets, once per process, what is done to the memory of every new recycled
/// buffer before its first use (later calls change nothing). rdma:// asks
/// the kernel to back it with transparent huge pages: a peer's READ of a
/// 64 MiB frame then pins 32 pages instead of 16,384, which doubles the soft
/// provider's READ (`docs/providers.md`).
pub fn prepare_new_buffers_with(prepare: PrepareBuffer) {
    let _ = PREPARE.set(prepare);
}

/// The memory of one recycled buffer ([`recycled_memory`], [`on_release`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RecycledMemory {
    /// Start address of the buffer's memory.
    pub addr: usize,
    /// Bytes of memory from `addr` (the buffer's capacity).
    pub len: usize,
    /// Names this memory for as long as it is a recycled buffer; never given
    /// to other memory in this process, even at the same address later.
    pub id: u64,
}

/// Called with a recycled buffer's memory just before that memory is freed;
/// see [`on_release`].
pub type ReleaseHook = fn(RecycledMemory);

static RELEASE: std::sync::OnceLock<ReleaseHook> = std::sync::OnceLock::new();

/// Sets, once per process, what is called with a recycled buffer's memory
/// just before it goes back to the allocator (later calls change nothing).
/// rdma:// deregisters what it registered over that memory, so that no
/// registration outlives the memory it describes: the allocator may map
/// other pages at the same address afterwards, and a registration made
/// before would still name the old pages.
///
/// The hook runs on whichever thread frees the memory, with no lock of this
/// module held; it must not take or return recycled buffers itself.
///
/// Returns true when this call set `hook`; false when a hook was set before
/// (then `hook` is never called, and whoever depends on it must not rely on
/// recycled memory's lifetime).
#[must_use = "a hook that was not set is never called"]
pub fn on_release(hook: ReleaseHook) -> bool {
    RELEASE.set(hook).is_ok()
}

/// The recycled buffer whose memory holds all of `bytes`, while that buffer is
/// frozen: `Some` only when `bytes` lie inside a buffer handed out as `Bytes`
/// (an encoded large message, a frozen `SendBuffer` (rpc-core), a large frame
/// read from a socket). Holding `bytes` (a `Bytes` over them, say) keeps that
/// buffer alive, so the answer stays true, and [`on_release`] is not called
/// for it, for as long as they are held.
pub fn recycled_memory(bytes: &[u8]) -> Option<RecycledMemory> {
    let start = bytes.as_ptr() as usize;
    let end = start.checked_add(bytes.len())?;
    let free = free_list();
    let (&addr, tracked) = free.tracked.range(..=start).next_back()?;
    (matches!(tracked.state, State::Frozen) && end <= addr + tracked.len).then_some(
        RecycledMemory {
            addr,
            len: tracked.len,
            id: tracked.id,
        },
    )
}

/// Where a tracked buffer is.
enum State {
    /// On the free list.
    Idle,
    /// Taken to be written: the second handle keeps its memory allocated
    /// until the buffer is frozen again or its taker has let go of it.
    Taken(Bytes),
    /// Frozen into `Bytes` (immutable until every clone is dropped).
    Frozen,
}

/// A tracked buffer's memory.
struct Tracked {
    len: usize,
    id: u64,
    state: State,
}

/// The free list: idle buffers and their total capacity, and every tracked
/// buffer by start address.
struct FreeList {
    idle: Vec<BytesMut>,
    bytes: usize,
    tracked: BTreeMap<usize, Tracked>,
    /// How many of `tracked` are [`State::Taken`].
    taken: usize,
    next_id: u64,
}

static FREE: Mutex<FreeList> = Mutex::new(FreeList {
    idle: Vec::new(),
    bytes: 0,
    tracked: BTreeMap::new(),
    taken: 0,
    next_id: 1,
});

fn free_list() -> std::sync::MutexGuard<'static, FreeList> {
    FREE.lock().unwrap_or_else(|poison| poison.into_inner())
}

/// Memory to free once the lock is released: the hook runs for each first.
#[derive(Default)]
struct Releases {
    memory: Vec<RecycledMemory>,
    buffers: Vec<BytesMut>,
    handles: Vec<Bytes>,
}

impl Releases {
    fn run(self) {
        if let Some(hook) = RELEASE.get() {
            for memory in &self.memory {
                hook(*memory);
            }
        }
        drop(self.buffers);
        drop(self.handles);
    }
}

impl FreeList {
    /// Stops tracking the buffer at `addr` (its memory is about to be freed).
    fn untrack(&mut self, addr: usize, releases: &mut Releases) {
        if let Some(tracked) = self.tracked.remove(&addr) {
            if let State::Taken(handle) = tracked.state {
                self.taken -= 1;
                releases.handles.push(handle);
            }
            releases.memory.push(RecycledMemory {
                addr,
                len: tracked.len,
                id: tracked.id,
            });
        }
    }

    /// Releases taken buffers whose taker let go of them (dropped, or grew
    /// them into new memory): only the second handle is left.
    fn collect_abandoned(&mut self, releases: &mut Releases) {
        if self.taken == 0 {
            return;
        }
        let abandoned: Vec<usize> = self
            .tracked
            .iter()
            .filter(|(_, t)| matches!(&t.state, State::Taken(handle) if handle.is_unique()))
            .map(|(addr, _)| *addr)
            .collect();
        for addr in abandoned {
            self.untrack(addr, releases);
        }
    }
}

/// A buffer of at least `len` bytes: the smallest idle one that fits when
/// `len` is [`RECYCLE_FROM`] or more, else a new one. Hand it out with
/// [`into_bytes`] so it comes back.
pub fn take(len: usize) -> BytesMut {
    if len < RECYCLE_FROM {
        return BytesMut::with_capacity(len);
    }
    let mut releases = Releases::default();
    let mut free = free_list();
    free.collect_abandoned(&mut releases);
    let best = free
        .idle
        .iter()
        .enumerate()
        .filter(|(_, buffer)| buffer.capacity() >= len)
        .min_by_key(|(_, buffer)| buffer.capacity())
        .map(|(index, _)| index);
    let taken = match best {
        Some(index) => {
            let mut buffer = free.idle.remove(index);
            free.bytes -= buffer.capacity();
            let addr = buffer.as_ptr() as usize;
            // A second handle on the memory (an empty split shares it): until
            // the buffer is frozen again, its memory stays allocated whatever
            // the taker does, so nothing else can be placed at `addr`.
            let handle = buffer.split_to(0).freeze();
            let mut newly_taken = false;
            if let Some(tracked) = free.tracked.get_mut(&addr) {
                tracked.state = State::Taken(handle);
                newly_taken = true;
            }
            if newly_taken {
                free.taken += 1;
            }
            Some(buffer)
        }
        None => None,
    };
    drop(free);
    releases.run();
    taken.unwrap_or_else(|| {
        let mut buffer = BytesMut::with_capacity(len);
        if let Some(prepare) = PREPARE.get() {
            prepare(buffer.spare_capacity_mut());
        }
        buffer
    })
}

/// Gives `buffer` (frozen until now) back, freeing the longest-idle buffers
/// to make room (or `buffer` itself when it is larger than the whole list
/// may hold); the release hook runs before any of them is freed.
fn give_back(mut buffer: BytesMut) {
    let addr = buffer.as_ptr() as usize;
    let mut releases = Releases::default();
    let mut free = free_list();
    free.collect_abandoned(&mut releases);
    if buffer.capacity() > MAX_IDLE_BYTES {
        free.untrack(addr, &mut releases);
        releases.buffers.push(buffer);
        drop(free);
        releases.run();
        return;
    }
    buffer.clear();
    // `idle` is in order of return: the front has waited longest.
    while free.bytes + buffer.capacity() > MAX_IDLE_BYTES && !free.idle.is_empty() {
        let old = free.idle.remove(0);
        free.bytes -= old.capacity();
        free.untrack(old.as_ptr() as usize, &mut releases);
        releases.buffers.push(old);
    }
    if let Some(tracked) = free.tracked.get_mut(&addr) {
        tracked.state = State::Idle;
    }
    free.bytes += buffer.capacity();
    free.idle.push(buffer);
    drop(free);
    releases.run();
}

/// Starts (or goes on) tracking `buffer`, about to be frozen.
fn freeze_tracked(buffer: &BytesMut) {
    let addr = buffer.as_ptr() as usize;
    let len = buffer.capacity();
    let mut releases = Releases::default();
    let mut free = free_list();
    free.collect_abandoned(&mut releases);
    let same_memory = matches!(
        free.tracked.get(&addr),
        Some(Tracked {
            state: State::Taken(_),
            ..
        })
    );
    if same_memory {
        // Taken from the free list at this address, whose memory the second
        // handle kept allocated: the same memory (a split may have shortened
        // it, never lengthened it).
        let tracked = free.tracked.get_mut(&addr).expect("checked");
        let State::Taken(handle) = std::mem::replace(&mut tracked.state, State::Frozen) else {
            unreachable!("checked")
        };
        tracked.len = tracked.len.min(len);
        free.taken -= 1;
        releases.handles.push(handle);
    } else {
        // New memory. Every tracked buffer's memory is allocated (frozen,
        // idle, or held by a second handle), so none overlaps it; an entry
        // that does is stale all the same, and is released first.
        let stale: Vec<usize> = free
            .tracked
            .range(..addr.saturating_add(len))
            .filter(|(start, t)| **start + t.len > addr)
            .map(|(start, _)| *start)
            .collect();
        for start in stale {
            free.untrack(start, &mut releases);
        }
        let id = free.next_id;
        free.next_id += 1;
        free.tracked.insert(
            addr,
            Tracked {
                len,
                id,
                state: State::Frozen,
            },
        );
    }
    drop(free);
    releases.run();
}

/// Bytes of idle recycled buffers now (for tests and metrics).
pub fn idle_bytes() -> usize {
    free_list().bytes
}

/// A recycled buffer behind `Bytes`: back to the free list on the last drop.
struct Recycled(BytesMut);

impl AsRef<[u8]> for Recycled {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        give_back(std::mem::take(&mut self.0));
    }
}

/// `buffer` as `Bytes` that return it to the free list when the last clone
/// drops (small buffers are simply frozen).
pub fn into_bytes(buffer: BytesMut) -> Bytes {
    if buffer.capacity() < RECYCLE_FROM {
        return buffer.freeze();
    }
    freeze_tracked(&buffer);
    Bytes::from_owner(Recycled(buffer))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the release hook saw, process-wide (tests pick out their own ids).
    static RELEASED: Mutex<Vec<RecycledMemory>> = Mutex::new(Vec::new());

    fn record(memory: RecycledMemory) {
        // The memory is still allocated while the hook runs: any byte of it can be read.
        RELEASED.lock().unwrap().push(memory);
    }

    fn released(id: u64) -> bool {
        RELEASED
            .lock()
            .unwrap()
            .iter()
            .any(|memory| memory.id == id)
    }

    /// A frozen recycled buffer of `len` bytes (a size no other test uses, so
    /// that no test running beside it takes it from the free list).
    fn frozen(len: usize, fill: u8) -> Bytes {
        let mut buffer = take(len);
        buffer.resize(len, fill);
        into_bytes(buffer)
    }

    #[test]
    fn frozen_buffers_are_recognised_with_one_id_across_reuse() {
        let _ = on_release(record);
        let len = (7 << 20) + 4096;
        let bytes = frozen(len, 1);
        let memory = recycled_memory(&bytes).expect("a frozen recycled buffer");
        assert_eq!(memory.addr, bytes.as_ptr() as usize);
        assert!(memory.len >= len);
        // Any slice of it names the same memory; bytes that are not inside
        // a recycled buffer are not recognised.
        assert_eq!(recycled_memory(&bytes[100..200]), Some(memory));
        assert_eq!(recycled_memory(&bytes[len - 1..]), Some(memory));
        assert_eq!(recycled_memory(&vec![0u8; 4096]), None);
        assert_eq!(recycled_memory(&Bytes::from(vec![0u8; 2 << 20])), None);
        let at = bytes.as_ptr();
        drop(bytes);
        // Idle on the free list: not frozen, so no bytes can be over it.
        // Taken again and frozen at the same address: the same memory, and
        // the same id, with no release in between.
        let again = frozen(len, 2);
        assert_eq!(again.as_ptr(), at, "the same memory");
        assert_eq!(recycled_memory(&again), Some(memory));
        assert!(!released(memory.id));
        // A different buffer is different memory with a new id.
        let other = frozen(len, 3);
        let other_memory = recycled_memory(&other).unwrap();
        assert_ne!(other_memory.id, memory.id);
        assert!(
            other_memory.addr + other_memory.len <= memory.addr
                || memory.addr + memory.len <= other_memory.addr
        );
    }

    #[test]
    fn memory_is_released_before_it_is_freed_by_every_route() {
        let _ = on_release(record);
        // Larger than the whole free list may hold: freed at once when the
        // last bytes go (only reserved, never touched: no memory is used).
        let huge = into_bytes(BytesMut::with_capacity(MAX_IDLE_BYTES + 4096));
        let id = recycled_memory(&huge).unwrap().id;
        drop(huge);
        assert!(released(id), "a buffer too large to keep");

        // Taken, then dropped by its taker instead of frozen: released at
        // the free list's next use.
        let len = (9 << 20) + 4096;
        let bytes = frozen(len, 4);
        let first = recycled_memory(&bytes).unwrap();
        drop(bytes);
        let abandoned = take(len);
        assert_eq!(abandoned.as_ptr() as usize, first.addr);
        drop(abandoned);
        assert!(
            !released(first.id),
            "the second handle keeps it until the next use"
        );
        // (Any use does; this one takes nothing another test may be waiting for.)
        drop(into_bytes(BytesMut::with_capacity(RECYCLE_FROM)));
        assert!(released(first.id), "an abandoned buffer");

        // Taken, then grown into new memory: the old memory is released,
        // the new one is new (another id).
        let len = (11 << 20) + 4096;
        let bytes = frozen(len, 5);
        let old = recycled_memory(&bytes).unwrap();
        drop(bytes);
        let mut grown = take(len);
        assert_eq!(grown.as_ptr() as usize, old.addr);
        grown.resize(2 * old.len, 6);
        let grown = into_bytes(grown);
        let new = recycled_memory(&grown).unwrap();
        assert_ne!(new.id, old.id);
        assert!(released(old.id), "the memory it left");
        assert!(!released(new.id));
    }
}
