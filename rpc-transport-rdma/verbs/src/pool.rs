//! Registered memory for the RDMA transport, registered once and reused.
//!
//! (Receive and send slots, shared by a device's connections, are
//! [`crate::shared`].)
//!
//! - [`LargePool`]: registered buffers for rendezvous frames, shared by the
//!   connections of one device. Buffers come in size classes (from 64 KiB
//!   in quarter steps of powers of two to 8 MiB, then whole MiB: see
//!   [`size_class`]); a set is registered when the device opens, a miss
//!   registers what the peak needs and a little ahead of it
//!   ([`LargePool::take`]), and a returned buffer is kept for the next frame
//!   of its class up to a byte cap. After warm-up the hot path registers
//!   nothing (the transport's tests check [`crate::registrations`]).
//! - [`PooledBuffer::into_bytes`]: a pulled frame handed up as [`Bytes`] over
//!   its registered destination, back in the pool when the last clone drops.
//!
//! **Ownership while the device works.** Posting is `unsafe` in the verbs
//! traits: memory named by a posted request must not be touched through a
//! Rust reference until its completion. A [`PooledBuffer`] is never named by
//! a posted request while anyone outside this crate holds it: a READ into
//! one is posted only by [`crate::pooled::PooledQp`], which keeps the buffer
//! until the completion (or flush) of every READ into it was polled from its
//! own CQ, and leaks it if none can come.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::{AccessFlags, ProtectionDomain, RegisteredBuffer, VerbsError};

/// Rendezvous buffers from this size up ask for transparent huge pages.
const HUGE_PAGES_FROM: usize = 2 << 20;

/// Smallest rendezvous size class.
pub const MIN_CLASS: usize = 64 << 10;
const MIB: usize = 1 << 20;

/// Up to this size classes step by a quarter of a power of two; above it by
/// whole MiB.
const QUARTER_STEPS_UP_TO: usize = 8 * MIB;

/// The size class (buffer length) that holds `len` bytes: at least
/// [`MIN_CLASS`]; then powers of two and the three quarter steps between
/// them up to 8 MiB (64, 80, 96, 112, 128, 160 KiB, ...); then whole MiB.
///
/// A frame is a payload and a few bytes of header, and payloads are often
/// a power of two: with power-of-two classes a 1 MiB message took a 2 MiB
/// buffer. Quarter steps keep the space a buffer wastes under a quarter
/// (an eighth above 8 MiB) and every class a multiple of 16 KiB.
pub fn size_class(len: usize) -> usize {
    if len <= MIN_CLASS {
        MIN_CLASS
    } else if len <= QUARTER_STEPS_UP_TO {
        // The largest power of two below `len`, and a quarter of it.
        let base = 1usize << (usize::BITS - 1 - (len - 1).leading_zeros());
        let step = base / 4;
        base + (len - base).div_ceil(step) * step
    } else {
        len.div_ceil(MIB) * MIB
    }
}

/// Sizes of the [`LargePool`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LargePoolConfig {
    /// Buffers of each power-of-two class from 64 KiB to 1 MiB registered
    /// when the device opens (default 1: 1.9 MiB, resident from the start
    /// as pinning makes it on hardware). Every process that opens the device pays this, most
    /// of which (clients) never send a large payload; a burst beyond it
    /// grows its class ahead of demand (see [`LargePool::take`]).
    pub prealloc_per_class: usize,
    /// Bytes of free buffers under 2 MiB kept registered for reuse
    /// (default 32 MiB); a buffer returned to a full pool makes room by
    /// deregistering the longest-idle ones. Before, 512 MiB for all: what a
    /// burst of hostile peers made the pool register stayed resident after
    /// they left.
    pub max_cached_bytes: usize,
    /// The same for buffers of 2 MiB and more, on huge pages (default
    /// 512 MiB, as before for all): each fresh one costs the kernel huge
    /// pages and a registration, and frames of MiB reuse a few buffers over
    /// and over. Idle trimming frees them too.
    pub max_cached_large_bytes: usize,
    /// Free buffers unused for this long are deregistered and freed
    /// ([`LargePool::trim_idle`], run by the transport's timer), down to
    /// the size of the start-up set (default 10 s).
    pub trim_idle_after: Duration,
    /// Bytes of rendezvous frames in use at once on the device, all
    /// connections together: the destinations of frames being pulled and
    /// our frames exposed to the peers' READs (default 64 MiB,
    /// [`DEFAULT_MAX_IN_USE_BYTES`]). The pool itself does not enforce it:
    /// the transport charges each frame before it takes a destination or
    /// exposes a frame, and waits beyond it (rpc-transport-rdma's
    /// `rendezvous_budget` module: each connection's first frame of a kind
    /// always goes through).
    pub max_in_use_bytes: usize,
}

/// Default of [`LargePoolConfig::max_in_use_bytes`]: 64 MiB.
pub const DEFAULT_MAX_IN_USE_BYTES: usize = 64 << 20;

impl Default for LargePoolConfig {
    fn default() -> Self {
        LargePoolConfig {
            prealloc_per_class: 1,
            max_cached_bytes: 32 << 20,
            max_cached_large_bytes: 512 << 20,
            trim_idle_after: Duration::from_secs(10),
            max_in_use_bytes: DEFAULT_MAX_IN_USE_BYTES,
        }
    }
}

/// Classes up to this size grow ahead of demand on a miss (see
/// [`LargePool::take`]); larger ones register exactly what is asked.
const GROW_AHEAD_UP_TO: usize = 2 * MIB;

/// A miss this soon after the previous one of its class continues a
/// streak: the load is still rising (see [`LargePool::take`]).
const MISS_STREAK_WITHIN: Duration = Duration::from_millis(250);

/// A class's recent misses.
#[derive(Debug, Clone, Copy)]
struct MissStreak {
    last: Instant,
    /// Misses in a row, each within [`MISS_STREAK_WITHIN`] of the last.
    len: u32,
}

impl MissStreak {
    /// Counts a miss at `now`; how many buffers to register ahead of it
    /// with `out` of the class out: 1 for the first miss of a streak (a
    /// spare: a buffer freed a moment late, such as a window the peer has
    /// not released yet, is no new peak), then 3, 7, 15, ... (doubling),
    /// never more than half of `out` (at least 1).
    fn miss(streak: &mut Option<MissStreak>, now: Instant, out: usize) -> usize {
        let len = match streak {
            Some(last) if now.duration_since(last.last) <= MISS_STREAK_WITHIN => last.len + 1,
            _ => 1,
        };
        *streak = Some(MissStreak { last: now, len });
        let doubling = (1usize << len.min(20)) - 1;
        doubling.min((out / 2).max(1))
    }
}

#[derive(Default)]
struct FreeLists {
    /// Free buffers by class, each with the sequence number and the time
    /// of its return (oldest first).
    by_class: HashMap<usize, Vec<(RegisteredBuffer, u64, Instant)>>,
    /// Buffers of each class taken and not returned yet.
    out: HashMap<usize, usize>,
    /// Each class's latest misses.
    misses: HashMap<usize, Option<MissStreak>>,
    /// Bytes of all free buffers.
    cached_bytes: usize,
    /// Bytes of the free buffers of huge-page classes (see [`is_large`]).
    large_cached_bytes: usize,
    returns: u64,
}

/// Classes of buffers that live on huge pages ([`HUGE_PAGES_FROM`] and up)
/// are cached under their own cap ([`LargePoolConfig::max_cached_large_bytes`]):
/// each fresh one costs the kernel huge pages and a registration under the
/// connection's lock (a connection's housekeeper stalled over a second in a
/// busy test process while 64 MiB frames registered fresh buffers), and a
/// process that moves frames of MiB reuses a few of them over and over,
/// while a burst of small frames (attack 6 of issue 30: 80 KiB buffers)
/// must not stay resident.
fn is_large(class: usize) -> bool {
    class >= HUGE_PAGES_FROM
}

/// A class with no free buffer borrows one of a larger class up to this
/// many times its size (registered and idle already) before it registers.
const BORROW_UP_TO: usize = 4;

impl FreeLists {
    /// A free buffer of `class`, else the smallest free one of a larger
    /// class up to [`BORROW_UP_TO`] times its size (it goes back to its own
    /// class when returned).
    fn take_free(&mut self, class: usize) -> Option<RegisteredBuffer> {
        let larger = self
            .by_class
            .iter()
            .filter(|(size, list)| {
                **size >= class && **size <= class.saturating_mul(BORROW_UP_TO) && !list.is_empty()
            })
            .map(|(size, _)| *size)
            .min()?;
        let (buffer, _, _) = self
            .by_class
            .get_mut(&larger)
            .and_then(Vec::pop)
            .expect("not empty");
        self.uncount(larger);
        Some(buffer)
    }

    fn uncount(&mut self, class: usize) {
        self.cached_bytes -= class;
        if is_large(class) {
            self.large_cached_bytes -= class;
        }
    }

    /// Bytes of free buffers of the kind (large or not) of `class`.
    fn cached_like(&self, class: usize) -> usize {
        if is_large(class) {
            self.large_cached_bytes
        } else {
            self.cached_bytes - self.large_cached_bytes
        }
    }

    /// The free buffer returned longest ago (of classes `which` takes):
    /// its class and when.
    fn oldest(&self, which: impl Fn(usize) -> bool) -> Option<(usize, Instant)> {
        self.by_class
            .iter()
            .filter(|(class, _)| which(**class))
            .filter_map(|(class, list)| list.first().map(|(_, seq, at)| (*seq, *class, *at)))
            .min()
            .map(|(_, class, at)| (class, at))
    }

    /// Removes the free buffer returned longest ago (of classes `which` takes).
    fn evict_oldest(&mut self, which: impl Fn(usize) -> bool) -> Option<RegisteredBuffer> {
        let (class, _) = self.oldest(which)?;
        let list = self.by_class.get_mut(&class).expect("found above");
        let (buffer, _, _) = list.remove(0);
        self.uncount(class);
        Some(buffer)
    }
}

/// Registered buffers for rendezvous frames, by size class.
pub struct LargePool {
    pd: Arc<dyn ProtectionDomain>,
    config: LargePoolConfig,
    free: Mutex<FreeLists>,
    /// Buffers this pool registered so far.
    registrations: AtomicU64,
    /// Bytes of the start-up set: what idle trimming keeps.
    floor_bytes: AtomicUsize,
}

impl std::fmt::Debug for LargePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LargePool")
            .field("config", &self.config)
            .field("cached_bytes", &self.lists().cached_bytes)
            .finish()
    }
}

impl LargePool {
    /// A pool on `pd` with its start-up set registered.
    pub fn new(
        pd: Arc<dyn ProtectionDomain>,
        config: LargePoolConfig,
    ) -> Result<Arc<LargePool>, VerbsError> {
        let pool = Arc::new(LargePool {
            pd,
            config,
            free: Mutex::new(FreeLists::default()),
            registrations: AtomicU64::new(0),
            floor_bytes: AtomicUsize::new(0),
        });
        let mut class = MIN_CLASS;
        while class <= MIB {
            for _ in 0..config.prealloc_per_class {
                let buffer = pool.register(class)?;
                pool.keep(buffer);
            }
            class *= 2;
        }
        pool.floor_bytes
            .store(pool.cached_bytes(), Ordering::Relaxed);
        Ok(pool)
    }

    fn lists(&self) -> std::sync::MutexGuard<'_, FreeLists> {
        self.free
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    fn register(&self, class: usize) -> Result<RegisteredBuffer, VerbsError> {
        // Large destinations are what a server echoes back (peers READ
        // them): huge pages make that READ about twice as fast on soft.
        // Where the device binds memory windows, a READ window over a
        // buffer (a copied frame, or a received one sent on) is bound over
        // its registration instead of registering it again.
        self.registrations.fetch_add(1, Ordering::Relaxed);
        let access = if self.pd.window_cache().is_some() {
            AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND
        } else {
            AccessFlags::LOCAL_WRITE
        };
        let mut buffer = if class >= HUGE_PAGES_FROM {
            RegisteredBuffer::new_huge(&self.pd, class, access)?
        } else {
            RegisteredBuffer::new(&self.pd, class, access)?
        };
        // Resident from the start (as a hardware registration pins it): a
        // buffer registered ahead of a peak costs its memory now, and the
        // frame that first lands in it takes no page faults.
        crate::make_resident(buffer.as_mut_slice());
        Ok(buffer)
    }

    /// A buffer of at least `len` bytes (registered only on a miss): of
    /// its size class, else a free one of a larger class up to
    /// 4 times as large.
    ///
    /// A miss means the class's buffers did not cover this peak. For
    /// classes up to 2 MiB a lone miss registers the buffer asked for and
    /// one spare; misses in a row (each within 250 ms of the last) mean the
    /// load is still rising: each registers, besides the buffer asked for,
    /// 3, 7, 15, ... more, at most half as many again as the class has out
    /// (within `max_cached_bytes`), kept free. A load that keeps rising
    /// registers a logarithmic number of times, not once per new peak, and
    /// each registration (pinning pages on hardware) stays off the data path
    /// for longer; a rare peak a little above the last one, late in a long run,
    /// registers about what it needs instead of half its class again.
    /// Larger classes register exactly what is asked.
    pub fn take(self: &Arc<Self>, len: usize) -> Result<PooledBuffer, VerbsError> {
        let class = size_class(len);
        let (cached, ahead) = {
            let mut lists = self.lists();
            let buffer = lists.take_free(class);
            // Counted by the class of the buffer handed out (a borrowed one
            // goes back to its own).
            let out_class = buffer.as_ref().map_or(class, RegisteredBuffer::len);
            let out = lists.out.entry(out_class).or_default();
            let out_before = *out;
            *out += 1;
            let ahead = match &buffer {
                Some(_) => 0,
                None if class <= GROW_AHEAD_UP_TO => {
                    let room = self
                        .config
                        .max_cached_bytes
                        .saturating_sub(lists.cached_like(class));
                    let streak = lists.misses.entry(class).or_default();
                    MissStreak::miss(streak, Instant::now(), out_before).min(room / class)
                }
                None => 0,
            };
            (buffer, ahead)
        };
        let buffer = match cached {
            Some(buffer) => buffer,
            None => match self.register(class) {
                Ok(buffer) => buffer,
                Err(error) => {
                    self.returned(class);
                    return Err(error);
                }
            },
        };
        for _ in 0..ahead {
            // Best effort: the buffer asked for is there already.
            match self.register(class) {
                Ok(spare) => self.keep(spare),
                Err(_) => break,
            }
        }
        Ok(PooledBuffer {
            buffer: Some(buffer),
            pool: self.clone(),
        })
    }

    /// One buffer of `class` is no longer out (returned, or lost).
    fn returned(&self, class: usize) {
        let mut lists = self.lists();
        if let Some(out) = lists.out.get_mut(&class) {
            *out = out.saturating_sub(1);
        }
    }

    /// A buffer taken from this pool comes back.
    fn put_back(&self, buffer: RegisteredBuffer) {
        self.returned(buffer.len());
        self.keep(buffer);
    }

    /// Keeps `buffer` free for reuse, within `max_cached_bytes` (or
    /// `max_cached_large_bytes` for a huge-page class): the longest idle
    /// buffers of its kind go first.
    fn keep(&self, buffer: RegisteredBuffer) {
        let class = buffer.len();
        let large = is_large(class);
        let cap = if large {
            self.config.max_cached_large_bytes
        } else {
            self.config.max_cached_bytes
        };
        if class > cap {
            return; // Dropped here: deregistered.
        }
        let mut evicted = Vec::new();
        {
            let mut lists = self.lists();
            while lists.cached_like(class) + class > cap {
                match lists.evict_oldest(|other| is_large(other) == large) {
                    Some(old) => evicted.push(old),
                    None => break,
                }
            }
            lists.cached_bytes += class;
            if large {
                lists.large_cached_bytes += class;
            }
            lists.returns += 1;
            let seq = lists.returns;
            lists
                .by_class
                .entry(class)
                .or_default()
                .push((buffer, seq, Instant::now()));
        }
        // Deregistered outside the lock.
        drop(evicted);
    }

    /// Deregisters and frees the free buffers unused for
    /// [`LargePoolConfig::trim_idle_after`] as of `now`, the longest idle
    /// first, down to the size of the start-up set; returns the bytes freed.
    /// (The transport runs it from a timer: a burst's buffers do not stay
    /// registered and resident once the burst is over.)
    pub fn trim_idle(&self, now: Instant) -> usize {
        let floor = self.floor_bytes.load(Ordering::Relaxed);
        let mut trimmed = Vec::new();
        {
            let mut lists = self.lists();
            while lists.cached_bytes > floor {
                match lists.oldest(|_| true) {
                    Some((_, at))
                        if now.saturating_duration_since(at) >= self.config.trim_idle_after =>
                    {
                        trimmed.extend(lists.evict_oldest(|_| true));
                    }
                    _ => break,
                }
            }
        }
        // Deregistered outside the lock.
        trimmed.iter().map(RegisteredBuffer::len).sum()
    }

    /// The pool's settings.
    pub fn config(&self) -> &LargePoolConfig {
        &self.config
    }

    /// Buffers this pool registered so far (misses and growth ahead of them).
    pub fn registrations(&self) -> u64 {
        self.registrations.load(Ordering::Relaxed)
    }

    /// Buffers taken and not returned yet (a pull's destination, a frame
    /// being exposed, bytes handed up): what a leak check wants back at 0.
    pub fn buffers_out(&self) -> usize {
        self.lists().out.values().sum()
    }

    /// Bytes of the buffers taken and not returned yet (by their class).
    pub fn bytes_out(&self) -> usize {
        self.lists()
            .out
            .iter()
            .map(|(class, out)| class * out)
            .sum()
    }

    /// Bytes of free buffers held for reuse.
    pub fn cached_bytes(&self) -> usize {
        self.lists().cached_bytes
    }
}

/// A buffer of a [`LargePool`], returned to it on drop.
///
/// Whoever holds one may read and write it: no work request names it (a
/// READ into it is posted only by [`crate::pooled::PooledQp`], which holds
/// the buffer until that READ's completion).
pub struct PooledBuffer {
    buffer: Option<RegisteredBuffer>,
    pool: Arc<LargePool>,
}

impl std::fmt::Debug for PooledBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PooledBuffer").field(&self.buffer).finish()
    }
}

impl PooledBuffer {
    /// The registered buffer.
    pub fn buffer(&self) -> &RegisteredBuffer {
        self.buffer.as_ref().expect("present until drop")
    }

    /// The registered buffer, writable.
    pub fn buffer_mut(&mut self) -> &mut RegisteredBuffer {
        self.buffer.as_mut().expect("present until drop")
    }

    /// Takes the buffer out of the pool's care (e.g. to expose it); give it
    /// back with [`PooledBuffer::restore`].
    pub fn into_parts(mut self) -> (RegisteredBuffer, Arc<LargePool>) {
        let buffer = self.buffer.take().expect("present until drop");
        (buffer, self.pool.clone())
    }

    /// Puts a buffer taken with [`PooledBuffer::into_parts`] back under the pool's care.
    pub fn restore(buffer: RegisteredBuffer, pool: Arc<LargePool>) -> PooledBuffer {
        PooledBuffer {
            buffer: Some(buffer),
            pool,
        }
    }

    /// The first `len` bytes as [`Bytes`] without a copy; the buffer goes back
    /// to the pool when the last clone of those bytes drops.
    ///
    /// # Panics
    /// When `len` exceeds the buffer.
    pub fn into_bytes(self, len: usize) -> Bytes {
        assert!(len <= self.buffer().len(), "length within the buffer");
        Bytes::from_owner(PulledFrame { buffer: self, len })
    }

    /// Never frees, deregisters or reuses the buffer: the device may still
    /// write it (a READ whose completion cannot come any more). The pool
    /// counts it as returned.
    pub(crate) fn leak(mut self) {
        if let Some(buffer) = self.buffer.take() {
            self.pool.returned(buffer.len());
            buffer.leak();
        }
    }
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            self.pool.put_back(buffer);
        }
    }
}

struct PulledFrame {
    buffer: PooledBuffer,
    len: usize,
}

impl AsRef<[u8]> for PulledFrame {
    fn as_ref(&self) -> &[u8] {
        &self.buffer.buffer().as_slice()[..self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Provider, soft::SoftProvider};

    fn pd() -> Arc<dyn ProtectionDomain> {
        let provider = SoftProvider;
        let device = provider.devices().unwrap().remove(0).name;
        provider.open(&device).unwrap().alloc_pd().unwrap()
    }

    #[test]
    fn size_classes() {
        assert_eq!(size_class(1), 64 << 10);
        assert_eq!(size_class(64 << 10), 64 << 10);
        assert_eq!(size_class((64 << 10) + 1), 80 << 10);
        assert_eq!(size_class(100_000), 112 << 10);
        assert_eq!(size_class(128 << 10), 128 << 10);
        assert_eq!(size_class((128 << 10) + 1), 160 << 10);
        // A 1 MiB payload and its header: a quarter more, not twice.
        assert_eq!(size_class(1 << 20), 1 << 20);
        assert_eq!(size_class((1 << 20) + 30), 1280 << 10);
        assert_eq!(size_class((3 << 20) + 1), 3584 << 10);
        assert_eq!(size_class(8 << 20), 8 << 20);
        // Whole MiB above 8 MiB.
        assert_eq!(size_class((8 << 20) + 1), 9 << 20);
        assert_eq!(size_class(64 << 20), 64 << 20);
        assert_eq!(size_class((256 << 20) + 60), 257 << 20);
        // Every class holds its length, wastes under a quarter, and is a
        // multiple of 16 KiB.
        for len in (1..(20 << 20)).step_by(4093) {
            let class = size_class(len);
            assert!(class >= len, "{len}");
            assert!(
                class == MIN_CLASS || (class - len) * 4 < len,
                "{len} in {class}"
            );
            assert_eq!(class % (16 << 10), 0, "{len}");
        }
    }

    #[test]
    fn buffers_are_reused_and_bytes_return_them() {
        let pool = LargePool::new(
            pd(),
            LargePoolConfig {
                prealloc_per_class: 1,
                max_cached_bytes: 8 << 20,
                max_cached_large_bytes: 8 << 20,
                ..LargePoolConfig::default()
            },
        )
        .unwrap();
        let start = pool.cached_bytes();
        let mut buffer = pool.take(100_000).unwrap();
        assert_eq!(buffer.buffer().len(), 128 << 10);
        assert_eq!(pool.cached_bytes(), start - (128 << 10));
        buffer.buffer_mut().as_mut_slice()[..3].copy_from_slice(b"abc");
        let addr = buffer.buffer().addr();
        let bytes = buffer.into_bytes(3);
        let clone = bytes.clone();
        drop(bytes);
        assert_eq!(&clone[..], b"abc");
        assert_eq!(pool.cached_bytes(), start - (128 << 10));
        drop(clone);
        assert_eq!(pool.cached_bytes(), start);
        // The same registered buffer comes back for the next frame of its class.
        assert_eq!(pool.take(70_000).unwrap().buffer().addr(), addr);
        // Over the cap, returned buffers are deregistered rather than kept...
        let big: Vec<_> = (0..3).map(|_| pool.take(4 << 20).unwrap()).collect();
        drop(big);
        assert!(pool.cached_bytes() <= start + (8 << 20));
        // ...the longest idle of its kind first: a 6 MiB buffer just returned
        // evicts the 4 MiB ones returned before it and is itself there for
        // the next frame.
        let six = pool.take(6 << 20).unwrap();
        let six_at = six.buffer().addr();
        drop(six);
        assert!(pool.cached_bytes() <= start + (8 << 20));
        assert_eq!(pool.take(6 << 20).unwrap().buffer().addr(), six_at);
        // A buffer larger than its kind's whole cap is never kept.
        let small_pool = LargePool::new(
            pd(),
            LargePoolConfig {
                prealloc_per_class: 0,
                max_cached_bytes: 64 << 10,
                ..LargePoolConfig::default()
            },
        )
        .unwrap();
        drop(small_pool.take(100_000).unwrap());
        assert_eq!(small_pool.cached_bytes(), 0);
    }

    #[test]
    fn huge_page_buffers_have_their_own_cap_and_small_returns_do_not_evict_them() {
        let pool = LargePool::new(
            pd(),
            LargePoolConfig {
                prealloc_per_class: 0,
                max_cached_bytes: 1 << 20,
                max_cached_large_bytes: 40 << 20,
                ..LargePoolConfig::default()
            },
        )
        .unwrap();
        let large = 16 << 20;
        // A frame each way, again and again: two buffers, registered once.
        for _ in 0..3 {
            let (out, back) = (pool.take(large).unwrap(), pool.take(large).unwrap());
            drop((out, back));
        }
        assert_eq!(pool.registrations(), 2, "reused, not registered per frame");
        assert_eq!(pool.cached_bytes(), 2 * large);
        // Small returns stay within their own 1 MiB, not evicting the large.
        let small: Vec<_> = (0..8).map(|_| pool.take(256 << 10).unwrap()).collect();
        drop(small);
        assert!(
            pool.cached_bytes() - 2 * large <= 1 << 20,
            "{}",
            pool.cached_bytes()
        );
        assert!(
            pool.cached_bytes() >= 2 * large,
            "the large ones are still there"
        );
        // A third large one is over the large cap: the longest idle goes.
        let three: Vec<_> = (0..3).map(|_| pool.take(large).unwrap()).collect();
        drop(three);
        assert!(
            pool.cached_bytes() <= (40 << 20) + (1 << 20),
            "{}",
            pool.cached_bytes()
        );
    }

    #[test]
    fn a_rising_load_grows_a_class_ahead_of_it_and_a_repeat_registers_nothing() {
        let pool = LargePool::new(
            pd(),
            LargePoolConfig {
                prealloc_per_class: 0,
                max_cached_bytes: 256 << 20,
                ..LargePoolConfig::default()
            },
        )
        .unwrap();
        // 100 buffers of one class out at once, taken one by one.
        let held: Vec<_> = (0..100).map(|_| pool.take(1 << 20).unwrap()).collect();
        let first = pool.registrations();
        // At least the peak, at most half as much again ahead of it.
        assert!(first >= 100, "{first}");
        assert!(first <= 100 + 100 / 2 + 1, "{first}");
        // Ahead of the peak: the next takes find free buffers.
        assert!(pool.cached_bytes() > 0);
        drop(held);
        // The same peak again registers nothing.
        let held: Vec<_> = (0..100).map(|_| pool.take(1 << 20).unwrap()).collect();
        assert_eq!(pool.registrations(), first);
        drop(held);
        // A lone peak one above all it has, later, registers that buffer and
        // one spare, not half the class again.
        std::thread::sleep(MISS_STREAK_WITHIN + Duration::from_millis(50));
        let in_class = first as usize;
        let held: Vec<_> = (0..=in_class)
            .map(|_| pool.take(1 << 20).unwrap())
            .collect();
        assert_eq!(pool.registrations(), first + 2);
        // The spare covers the next one above.
        let spare = pool.take(1 << 20).unwrap();
        assert_eq!(pool.registrations(), first + 2);
        drop((held, spare));
        let first = first + 2;
        // A class above the grow-ahead limit registers exactly what is asked.
        let large: Vec<_> = (0..3).map(|_| pool.take(3 << 20).unwrap()).collect();
        assert_eq!(pool.registrations(), first + 3);
        drop(large);
        // An empty class borrows a free buffer of a larger one before it
        // registers, and the buffer goes back to its own class.
        let before = pool.registrations();
        let borrowed = pool.take(300 << 10).unwrap();
        assert_eq!(borrowed.buffer().len(), 1 << 20);
        assert_eq!(pool.registrations(), before);
        drop(borrowed);
        assert_eq!(pool.take(1 << 20).unwrap().buffer().len(), 1 << 20);
        // Not from a class more than BORROW_UP_TO times larger.
        let tiny = pool.take(1000).unwrap();
        assert_eq!(tiny.buffer().len(), MIN_CLASS);
        assert!(pool.registrations() > before);
        drop(tiny);
        // Growth ahead stays within the cache's cap.
        let small = LargePool::new(
            pd(),
            LargePoolConfig {
                prealloc_per_class: 0,
                max_cached_bytes: 2 << 20,
                ..LargePoolConfig::default()
            },
        )
        .unwrap();
        let held: Vec<_> = (0..8).map(|_| small.take(1 << 20).unwrap()).collect();
        assert!(small.cached_bytes() <= 2 << 20);
        drop(held);
        assert!(small.cached_bytes() <= 2 << 20);
    }

    #[test]
    fn buffers_idle_past_the_trim_time_are_deregistered_down_to_the_start_up_set() {
        let pool = LargePool::new(
            pd(),
            LargePoolConfig {
                prealloc_per_class: 1,
                max_cached_bytes: 64 << 20,
                trim_idle_after: Duration::from_secs(10),
                ..LargePoolConfig::default()
            },
        )
        .unwrap();
        let start_up = pool.cached_bytes();
        assert!(start_up > 0);
        // A burst: 40 buffers of 1 MiB out at once, then all back.
        let burst: Vec<_> = (0..40).map(|_| pool.take(1 << 20).unwrap()).collect();
        assert_eq!(pool.bytes_out(), 40 << 20);
        drop(burst);
        assert_eq!(pool.bytes_out(), 0);
        let after_burst = pool.cached_bytes();
        assert!(after_burst >= start_up + (39 << 20), "{after_burst}");
        // Not idle long enough yet: nothing goes.
        let now = Instant::now();
        assert_eq!(pool.trim_idle(now), 0);
        assert_eq!(pool.cached_bytes(), after_burst);
        // Idle long enough: deregistered, the longest idle first, until the
        // cache is down to the start-up set's size (within one buffer).
        let later = now + Duration::from_secs(11);
        let trimmed = pool.trim_idle(later);
        assert_eq!(trimmed, after_burst - pool.cached_bytes());
        assert!(pool.cached_bytes() <= start_up, "{}", pool.cached_bytes());
        assert!(
            pool.cached_bytes() + (1 << 20) > start_up,
            "{}",
            pool.cached_bytes()
        );
        assert_eq!(pool.trim_idle(later + Duration::from_secs(60)), 0);
        // What is left still serves the next frame.
        drop(pool.take(1 << 20).unwrap());
    }
}
