//! READ windows without a registration per frame: type-2 memory windows
//! bound over cached registrations of memory whose lifetime is known.
//!
//! Registering memory pins its pages (on hardware about 100 µs per MiB);
//! registering every large frame's payload, and deregistering it after the
//! peer's DONE, costs that on every call. A type-2 memory window costs a
//! work request instead: it is bound over a range of an existing
//! registration (made with [`AccessFlags::MW_BIND`], which grants the peer
//! nothing by itself), REMOTE_READ only, usable only through the queue pair
//! it was bound on, and destroyed at once when revoked (`ibv_dealloc_mw`).
//!
//! The registration it is bound over must cover memory that stays the same
//! for as long as the registration exists. Caching registrations of
//! arbitrary memory is unsound: when memory is freed and the allocator maps
//! new pages at the same address, a registration made before still names the
//! old, pinned pages, and a window bound over it would let the peer READ
//! them instead of the payload (UCX's registration cache needs hooks into
//! `malloc`/`munmap` for this reason). So [`WindowCache`] caches
//! registrations only of rpc-core's recycled large buffers
//! (`rpc_recycle`, re-exported as `rpc_core::codec::recycle`: encoded large messages, frozen
//! `SendBuffer`s, large frames read from sockets), whose memory that module
//! tracks: it recognises bytes inside a live recycled buffer
//! (`recycled_memory`), and calls this module's hook before that memory is
//! freed, which deregisters what is cached over it first. Any other `Bytes`
//! keeps its exact registration per frame
//! ([`ProtectionDomain::register_window`]).
//!
//! Memory whose lifetime this module makes known itself: any other `Bytes`
//! the application sends (a `Vec` it filled, a file it read) is cached
//! together with a clone of those `Bytes` (`Owner::Held`): the clone keeps
//! the memory allocated, and immutable, for as long as the registration is
//! cached, so a later frame in the same bytes (the same tensor sent again,
//! or to another peer) finds the same pages under the same registration.
//! Only bytes of [`HOLD_FROM`] or more are held (shorter frames are mostly
//! encoded afresh per call). The price is memory kept after the
//! application let go of it, bounded by [`MAX_HELD_BYTES`] per protection
//! domain (idle ones evicted, least
//! recently used first; never one under a bound window). A frame that lies
//! in held bytes gets a window over exactly the held range or a part of it;
//! with exact extents (rxe), only over exactly the held range.
//!
//! The other memory of known lifetime is the transport's own registered
//! buffers ([`super::RegisteredBuffer`]s registered with MW_BIND: the
//! rendezvous pool's, where the device has windows). A frame received into
//! one is handed up as `Bytes` over it, and a server that sends those bytes
//! back (an echo, a proxy) gets a window bound over the buffer's own
//! registration: the buffer is alive, and registered, for as long as the
//! bytes are; [`super::RegisteredBuffer`] forgets it (and releases what the
//! caches hold over it) before deregistering and freeing it.
//!
//! A device that checks a READ through a window only against the
//! registration under it, not the window's own range (rxe in kernel 6.1),
//! gets registrations of exactly each window's bytes instead, cached by
//! extent ([`WindowCache::exact_extents`]): otherwise the peer could READ the
//! rest of the buffer.
//!
//! The cache is bounded in bytes ([`MAX_CACHED_BYTES`] per protection
//! domain): a registration no window uses is evicted, least recently used
//! first; one under a bound window never is. When nothing can be evicted,
//! the frame falls back to its own registration.
//!
//! Counters for tests and metrics: [`device_registrations`] (every
//! registration a provider made: `ibv_reg_mr` calls on ibverbs),
//! [`cached_registrations`], [`cached_registration_bytes`],
//! [`windows_bound`].

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use rpc_recycle::{self as recycle, RecycledMemory};

use super::{AccessFlags, MemoryRegion, ProtectionDomain, QueuePair, VerbsError};

/// Memory-window binds a completion queue may have in flight (posted, their
/// completion not yet polled): each holds a send-queue entry of its QP and
/// will take a CQ entry, so whoever sizes a QP and its CQ adds this much to
/// both (the RDMA transport does). A bind beyond it is refused, never
/// posted, and the frame gets a registration of its own.
pub const MAX_BINDS_IN_FLIGHT: u32 = 16;

const _: () = assert!(MAX_BINDS_IN_FLIGHT >= 1 && MAX_BINDS_IN_FLIGHT <= 1024);

/// The `wr_id` of a memory-window bind. Its completion is the provider's
/// own: a successful one is consumed by the CQ's poll, a failed one (the
/// QP broke) is reported with this id. The top two bits are set, a tag the
/// RDMA transport's own requests never use.
pub const WINDOW_BIND_WR_ID: u64 = 0xc000_0000_6d77_b1d0;

/// Of [`MAX_CACHED_BYTES`], the application's own bytes a cache keeps
/// alive (and registered) after the application let go of them.
pub const MAX_HELD_BYTES: usize = 64 << 20;

/// Application bytes shorter than this are not held: a frame of them gets
/// a registration of its own. Mid-size frames are mostly encoded afresh
/// for each call (a message whose fields were copied into a new buffer);
/// holding those would keep every one of them alive to the cap for nothing
/// (measured: a soak of mixed sizes grew both processes' RSS by over 100%).
/// Large messages are encoded into recycled buffers, cached without being
/// held; what is held is the application's own large `Bytes`.
pub const HOLD_FROM: usize = 1 << 20;

/// Registrations each protection domain's [`WindowCache`] keeps, in bytes
/// (1 GiB: twice the recycled buffers' idle cap, so that idle and in-flight
/// buffers both fit).
pub const MAX_CACHED_BYTES: usize = 1 << 30;

static DEVICE_REGISTRATIONS: AtomicU64 = AtomicU64::new(0);
static CACHED_REGISTRATIONS: AtomicU64 = AtomicU64::new(0);
static CACHED_BYTES: AtomicU64 = AtomicU64::new(0);
static WINDOWS_BOUND: AtomicU64 = AtomicU64::new(0);

/// Memory registrations providers made in this process so far, for any
/// purpose (on ibverbs: `ibv_reg_mr` calls). What the bulk path keeps flat
/// when its windows are bound over cached registrations.
pub fn device_registrations() -> u64 {
    DEVICE_REGISTRATIONS.load(Ordering::Relaxed)
}

/// Counts one registration by a provider.
pub(crate) fn count_device_registration() {
    DEVICE_REGISTRATIONS.fetch_add(1, Ordering::Relaxed);
}

/// Registrations [`WindowCache`]s made so far (each over a whole recycled buffer).
pub fn cached_registrations() -> u64 {
    CACHED_REGISTRATIONS.load(Ordering::Relaxed)
}

/// Bytes the [`WindowCache`]s keep registered now.
pub fn cached_registration_bytes() -> u64 {
    CACHED_BYTES.load(Ordering::Relaxed)
}

/// Memory windows bound so far (each a READ window without a registration of its own).
pub fn windows_bound() -> u64 {
    WINDOWS_BOUND.load(Ordering::Relaxed)
}

/// Counts one bound window.
pub(crate) fn count_window_bound() {
    WINDOWS_BOUND.fetch_add(1, Ordering::Relaxed);
}

/// Whether a protection domain binds type-2 windows for READ windows, on a
/// device that has them: `RDMA_MEMORY_WINDOWS=off` makes every READ window
/// a registration of its own (for comparisons, and as a way around a device
/// whose windows misbehave), `=on` binds windows even where the provider
/// would not by default (`device_default`: rxe's is off, see the ibverbs
/// provider); providers ask this when they allocate a protection domain.
pub(crate) fn memory_windows_wanted(device_default: bool) -> bool {
    windows_setting(
        std::env::var("RDMA_MEMORY_WINDOWS").ok().as_deref(),
        device_default,
    )
}

/// What a value of `RDMA_MEMORY_WINDOWS` (if set) says, on a device whose
/// default is `device_default`.
fn windows_setting(value: Option<&str>, device_default: bool) -> bool {
    match value {
        Some("off" | "0" | "false" | "no") => false,
        Some("on" | "1" | "true" | "yes") => true,
        _ => device_default,
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

/// Binds in flight on the QPs that send into one completion queue (see
/// [`MAX_BINDS_IN_FLIGHT`]); shared by the CQ, which counts completions
/// back, and its QPs, which count binds out.
#[derive(Debug, Default)]
#[cfg_attr(not(feature = "ibverbs"), allow(dead_code))] // only devices post binds
pub(crate) struct BindBudget(AtomicU32);

#[cfg_attr(not(feature = "ibverbs"), allow(dead_code))]
impl BindBudget {
    /// Takes one bind slot; false when all are in flight.
    pub(crate) fn try_acquire(&self) -> bool {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_BINDS_IN_FLIGHT).then_some(n + 1)
            })
            .is_ok()
    }

    /// Gives one back (a bind completed, or was never posted).
    pub(crate) fn release(&self) {
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }
}

/// Whose memory a cached registration covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Owner {
    /// A recycled buffer (its id from `rpc_core::codec::recycle`).
    Recycled(u64),
    /// A registered buffer of the transport (its id in [`KNOWN`]).
    Registered(u64),
    /// Bytes of the application that the cache itself keeps alive (a
    /// number of the cache's own).
    Held(u64),
}

/// What a cached registration covers: `len` bytes at `addr`, inside the
/// memory of `owner` (all of it, or exactly a window's bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    owner: Owner,
    addr: usize,
    len: usize,
}

/// A cached registration, and how many bound windows use it.
struct Cached {
    region: Arc<dyn MemoryRegion>,
    users: usize,
    last_use: u64,
    /// For [`Owner::Held`]: what keeps the memory alive; dropped only after
    /// the region is deregistered.
    holder: Option<bytes::Bytes>,
}

/// A registration leaving the cache, and the bytes it kept alive (let go of
/// only once the registration is gone).
struct Evicted {
    region: Arc<dyn MemoryRegion>,
    holder: Option<bytes::Bytes>,
}

impl From<Cached> for Evicted {
    fn from(cached: Cached) -> Evicted {
        Evicted {
            region: cached.region,
            holder: cached.holder,
        }
    }
}

#[derive(Default)]
struct CacheState {
    entries: HashMap<Key, Cached>,
    bytes: usize,
    tick: u64,
    /// Held ranges by start address: (length, number).
    held: BTreeMap<usize, (usize, u64)>,
    held_bytes: usize,
    next_held: u64,
}

impl CacheState {
    /// Takes `key` out of the cache's books.
    fn remove(&mut self, key: &Key) -> Option<Cached> {
        let cached = self.entries.remove(key)?;
        self.bytes -= key.len;
        CACHED_BYTES.fetch_sub(key.len as u64, Ordering::Relaxed);
        if let Owner::Held(number) = key.owner {
            if self.held.get(&key.addr).is_some_and(|(_, n)| *n == number) {
                self.held.remove(&key.addr);
            }
            self.held_bytes -= key.len;
        }
        Some(cached)
    }

    /// The held range that covers `start..start + len` (exactly it, when
    /// `exact`).
    fn held_covering(&self, start: usize, len: usize, exact: bool) -> Option<Key> {
        let (&addr, &(held_len, number)) = self.held.range(..=start).next_back()?;
        let covers = if exact {
            addr == start && held_len == len
        } else {
            start + len <= addr + held_len
        };
        covers.then_some(Key {
            owner: Owner::Held(number),
            addr,
            len: held_len,
        })
    }
}

/// One protection domain's registrations over memory of known lifetime,
/// which its memory windows are bound over (the module docs say why only
/// those).
///
/// Where the device confines a READ to its window's range (the spec; soft;
/// hardware), a recycled buffer is registered once, whole, and any frame in
/// it gets a window over that registration. A device that checks a window's
/// READ only against the registration under it (rxe in kernel 6.1:
/// [`WindowCache::exact_extents`]) would let the peer read the rest of the
/// buffer — older frames, possibly to other peers — so there every window is
/// bound over a registration of exactly its bytes, cached by extent: steady
/// traffic (frames of one size in the same buffers) registers nothing after
/// warm-up; frames of many sizes register each new extent once.
pub struct WindowCache {
    state: Mutex<CacheState>,
    max_bytes: usize,
    exact: bool,
    /// rpc-core tells this module when recycled memory is freed.
    recycled: bool,
    registrations: AtomicU64,
}

impl std::fmt::Debug for WindowCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = lock(&self.state);
        f.debug_struct("WindowCache")
            .field("entries", &state.entries.len())
            .field("bytes", &state.bytes)
            .field("max_bytes", &self.max_bytes)
            .field("exact_extents", &self.exact)
            .finish()
    }
}

/// Every live cache, for the release hooks.
static CACHES: Mutex<Vec<Weak<WindowCache>>> = Mutex::new(Vec::new());

fn live_caches() -> Vec<Arc<WindowCache>> {
    let mut caches = lock(&CACHES);
    caches.retain(|cache| cache.strong_count() > 0);
    caches.iter().filter_map(Weak::upgrade).collect()
}

/// True when rpc-core calls this module's release hook: installed once per
/// process, with the first cache. Were another hook set before it, no cache
/// would be told when recycled memory is freed, so none registers any.
fn recycled_memory_hooked() -> bool {
    static HOOKED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HOOKED.get_or_init(|| {
        let hooked = recycle::on_release(release_recycled);
        if !hooked {
            tracing::warn!(
                "another release hook is set for rpc-core's recycled buffers: READ windows over them get registrations of their own"
            );
        }
        hooked
    })
}

/// rpc-core's release hook: the memory of a recycled buffer is about to be
/// freed, so nothing registered over it may remain.
fn release_recycled(memory: RecycledMemory) {
    for cache in live_caches() {
        cache.release(Owner::Recycled(memory.id));
    }
}

impl WindowCache {
    /// A cache of at most `max_bytes` of registrations, each over a whole
    /// buffer, or (`exact_extents`) over exactly a window's bytes (the hook
    /// that keeps it sound is installed with the first cache).
    pub fn new(max_bytes: usize, exact_extents: bool) -> Arc<WindowCache> {
        let cache = Arc::new(WindowCache {
            state: Mutex::new(CacheState::default()),
            max_bytes,
            exact: exact_extents,
            recycled: recycled_memory_hooked(),
            registrations: AtomicU64::new(0),
        });
        lock(&CACHES).push(Arc::downgrade(&cache));
        cache
    }

    /// True when every window is bound over a registration of exactly its
    /// bytes (the device does not confine a window's READs to its range).
    pub fn exact_extents(&self) -> bool {
        self.exact
    }

    /// Bytes registered now.
    pub fn cached_bytes(&self) -> usize {
        lock(&self.state).bytes
    }

    /// Registrations this cache made so far.
    pub fn registrations(&self) -> u64 {
        self.registrations.load(Ordering::Relaxed)
    }

    /// A REMOTE_READ window over exactly `bytes`, usable only through `qp`,
    /// bound over a registration of the memory of known lifetime the bytes
    /// lie in: a cached one of their recycled buffer (registered on the
    /// first use), or their registered buffer's own (or, with exact
    /// extents, a cached one of exactly the bytes). `Ok(None)`: the bytes
    /// lie in no such memory, or the cache is full of registrations in use;
    /// the caller registers them itself. `pd` is the cache's own PD.
    ///
    /// Deregistering the window invalidates it, then lets its registration
    /// be evicted again. The window does not keep `bytes` alive: its owner
    /// must, until it is deregistered ([`super::ExposedBytes`] does).
    ///
    /// # Safety
    /// Until the returned window is deregistered (or leaked, never freed),
    /// `bytes` must stay allocated and must not be written by anyone (the
    /// peer READs them behind the compiler's back); when they lie in a
    /// [`super::RegisteredBuffer`], that buffer must stay alive until then.
    pub(crate) unsafe fn bind(
        self: &Arc<Self>,
        pd: &dyn ProtectionDomain,
        qp: &Arc<dyn QueuePair>,
        bytes: &[u8],
    ) -> Result<Option<Arc<dyn MemoryRegion>>, VerbsError> {
        let start = bytes.as_ptr() as usize;
        let recycled = if self.recycled {
            recycle::recycled_memory(bytes)
        } else {
            None
        };
        let key = if let Some(memory) = recycled {
            let owner = Owner::Recycled(memory.id);
            if self.exact {
                Key {
                    owner,
                    addr: start,
                    len: bytes.len(),
                }
            } else {
                Key {
                    owner,
                    addr: memory.addr,
                    len: memory.len,
                }
            }
        } else {
            let Some((id, region)) = registered_buffer(pd, bytes) else {
                return Ok(None);
            };
            if !self.exact {
                // SAFETY: `bytes` lie inside `region`, the registration of a
                // live registered buffer of this PD (`registered_buffer`
                // found it under its lock). This function's caller keeps
                // that buffer alive, and `bytes` allocated and unwritten,
                // until the window is deregistered; the buffer's region
                // stays registered as long as the buffer lives. The window
                // is READ-only, so the device never writes the bytes.
                let window = unsafe {
                    pd.bind_window(
                        &region,
                        start as u64,
                        bytes.len(),
                        AccessFlags::REMOTE_READ,
                        qp,
                    )?
                };
                count_window_bound();
                return Ok(Some(window));
            }
            Key {
                owner: Owner::Registered(id),
                addr: start,
                len: bytes.len(),
            }
        };
        // SAFETY: `bytes` lie inside `key`'s range (the recycled buffer or
        // registered buffer found above); this function's caller keeps them
        // allocated and unwritten until the window is deregistered. The
        // release hooks cannot run for memory that is still alive.
        unsafe { self.lease_and_bind(pd, qp, key, None, bytes) }
    }

    /// Leases the registration of `key` (registering it on a miss, holding
    /// `holder` with it) and binds a READ window over exactly `bytes`.
    /// `Ok(None)`: the registration does not fit.
    ///
    /// # Safety
    /// `bytes` lie inside `key`'s range, and stay allocated and unwritten
    /// until the window is deregistered (or leaked).
    unsafe fn lease_and_bind(
        self: &Arc<Self>,
        pd: &dyn ProtectionDomain,
        qp: &Arc<dyn QueuePair>,
        key: Key,
        holder: Option<&bytes::Bytes>,
        bytes: &[u8],
    ) -> Result<Option<Arc<dyn MemoryRegion>>, VerbsError> {
        let Some(region) = self.lease(pd, key, holder)? else {
            return Ok(None);
        };
        // SAFETY: `bytes` lie inside `key`'s memory, which this function's
        // caller keeps alive and unwritten until the window is deregistered;
        // the window is READ-only, so the device never writes them. `region`
        // stays registered until then: the lease taken above keeps it from
        // eviction until `LeasedWindow` gives it back.
        let window = unsafe {
            pd.bind_window(
                &region,
                bytes.as_ptr() as u64,
                bytes.len(),
                AccessFlags::REMOTE_READ,
                qp,
            )
        };
        match window {
            Ok(window) => {
                count_window_bound();
                Ok(Some(Arc::new(LeasedWindow {
                    window,
                    lease: Mutex::new(Some(Lease {
                        cache: self.clone(),
                        key,
                    })),
                })))
            }
            Err(error) => {
                self.unlease(key);
                Err(error)
            }
        }
    }

    /// [`WindowCache::bind`] for `Bytes` in any memory: bytes that lie in
    /// no memory of known lifetime are held by the cache (a clone of `bytes`
    /// keeps them allocated and unchanged while they are registered), within
    /// [`MAX_HELD_BYTES`]. `Ok(None)`: nothing fits; the caller registers
    /// the bytes itself.
    ///
    /// # Safety
    /// A clone of `bytes` stays alive until the returned window is
    /// deregistered (or is leaked, never dropped).
    pub(crate) unsafe fn bind_bytes(
        self: &Arc<Self>,
        pd: &dyn ProtectionDomain,
        qp: &Arc<dyn QueuePair>,
        bytes: &bytes::Bytes,
    ) -> Result<Option<Arc<dyn MemoryRegion>>, VerbsError> {
        // SAFETY: the caller keeps a clone of `bytes` alive until the window
        // is deregistered: their memory stays allocated (and, as `Bytes`,
        // unwritten) until then, and so does a registered buffer they lie in
        // (a `Bytes` over one owns it).
        if let Some(window) = unsafe { self.bind(pd, qp, bytes)? } {
            return Ok(Some(window));
        }
        let known = (self.recycled && recycle::recycled_memory(bytes).is_some())
            || registered_buffer(pd, bytes).is_some();
        if known {
            // Memory of known lifetime that did not fit: not held either.
            return Ok(None);
        }
        let start = bytes.as_ptr() as usize;
        let key = {
            let mut state = lock(&self.state);
            match state.held_covering(start, bytes.len(), self.exact) {
                Some(key) => key,
                // Too short to be worth keeping alive: a registration of
                // its own.
                None if bytes.len() < HOLD_FROM => return Ok(None),
                None => {
                    state.next_held += 1;
                    Key {
                        owner: Owner::Held(state.next_held),
                        addr: start,
                        len: bytes.len(),
                    }
                }
            }
        };
        // SAFETY: `key`'s range is one allocation that covers `bytes`: the
        // held `Bytes` it was first registered for, or these bytes. The
        // caller keeps these bytes alive and unwritten (immutable `Bytes`)
        // until the window is deregistered.
        unsafe { self.lease_and_bind(pd, qp, key, Some(bytes), bytes) }
    }

    /// The registration of `key`, with one more user; registered now on a
    /// miss. `None` when it does not fit beside the registrations in use.
    fn lease(
        &self,
        pd: &dyn ProtectionDomain,
        key: Key,
        holder: Option<&bytes::Bytes>,
    ) -> Result<Option<Arc<dyn MemoryRegion>>, VerbsError> {
        let evicted = {
            let mut state = lock(&self.state);
            state.tick += 1;
            let tick = state.tick;
            if let Some(cached) = state.entries.get_mut(&key) {
                cached.users += 1;
                cached.last_use = tick;
                return Ok(Some(cached.region.clone()));
            }
            if key.len > self.max_bytes {
                return Ok(None);
            }
            let mut evicted = Vec::new();
            if holder.is_some() {
                match self.evict_held_for(&mut state, key.len) {
                    Some(held) => evicted = held,
                    None => return Ok(None),
                }
            }
            match self.evict_for(&mut state, key.len) {
                Some(more) => {
                    evicted.extend(more);
                    evicted
                }
                None => {
                    drop(state);
                    release_all(evicted);
                    return Ok(None);
                }
            }
        };
        release_all(evicted);
        // SAFETY: `key` covers memory of a recycled buffer (or of a
        // registered buffer) that is allocated for as long as the buffer
        // lives; the release hooks deregister this region before that
        // memory is freed (it is in the cache from the insert below until
        // then, or deregistered right here). Held bytes are kept allocated
        // by the clone the entry stores, dropped only after the region is
        // deregistered. The region is MW_BIND only: the
        // device reads it only through windows bound over frozen bytes, and
        // never writes it, so the buffer's owner may keep writing the parts
        // that are not frozen. For recycled memory this relies on
        // rpc-recycle's documented behaviour (`on_release` runs before
        // recycled memory is freed; `recycled_memory` answers only while
        // the bytes asked about keep a frozen buffer alive): a specific
        // crate of this workspace, tested for it, not an `unsafe` contract.
        // A bug there would let a peer READ stale pages through a window
        // (the region is MW_BIND only and windows REMOTE_READ only: nothing
        // in this process is written).
        let region = unsafe { pd.register(key.addr as *mut u8, key.len, AccessFlags::MW_BIND)? };
        let mut state = lock(&self.state);
        state.tick += 1;
        let tick = state.tick;
        if let Some(cached) = state.entries.get_mut(&key) {
            // Registered by another connection meanwhile: use that one.
            cached.users += 1;
            cached.last_use = tick;
            let existing = cached.region.clone();
            drop(state);
            deregister_all(vec![region]);
            return Ok(Some(existing));
        }
        state.bytes += key.len;
        if let Owner::Held(number) = key.owner {
            state.held.insert(key.addr, (key.len, number));
            state.held_bytes += key.len;
        }
        state.entries.insert(
            key,
            Cached {
                region: region.clone(),
                users: 1,
                last_use: tick,
                holder: holder.cloned(),
            },
        );
        drop(state);
        CACHED_REGISTRATIONS.fetch_add(1, Ordering::Relaxed);
        self.registrations.fetch_add(1, Ordering::Relaxed);
        CACHED_BYTES.fetch_add(key.len as u64, Ordering::Relaxed);
        Ok(Some(region))
    }

    /// Removes idle registrations, least recently used first, until `len`
    /// more bytes fit; `None` (nothing removed) when they cannot.
    fn evict_for(&self, state: &mut CacheState, len: usize) -> Option<Vec<Evicted>> {
        let idle: usize = state
            .entries
            .iter()
            .filter(|(_, cached)| cached.users == 0)
            .map(|(key, _)| key.len)
            .sum();
        if (state.bytes - idle) + len > self.max_bytes {
            return None;
        }
        let mut evicted = Vec::new();
        while state.bytes + len > self.max_bytes {
            let (&key, _) = state
                .entries
                .iter()
                .filter(|(_, cached)| cached.users == 0)
                .min_by_key(|(_, cached)| cached.last_use)
                .expect("enough idle bytes");
            let cached = state.remove(&key).expect("present");
            evicted.push(cached.into());
        }
        Some(evicted)
    }

    /// Removes idle held registrations, least recently used first, until
    /// `len` more held bytes fit under [`MAX_HELD_BYTES`]; `None` (nothing
    /// removed) when they cannot.
    fn evict_held_for(&self, state: &mut CacheState, len: usize) -> Option<Vec<Evicted>> {
        let idle_held = |state: &CacheState| -> usize {
            state
                .entries
                .iter()
                .filter(|(key, cached)| matches!(key.owner, Owner::Held(_)) && cached.users == 0)
                .map(|(key, _)| key.len)
                .sum()
        };
        if len > MAX_HELD_BYTES || (state.held_bytes - idle_held(state)) + len > MAX_HELD_BYTES {
            return None;
        }
        let mut evicted = Vec::new();
        while state.held_bytes + len > MAX_HELD_BYTES {
            let (&key, _) = state
                .entries
                .iter()
                .filter(|(key, cached)| matches!(key.owner, Owner::Held(_)) && cached.users == 0)
                .min_by_key(|(_, cached)| cached.last_use)
                .expect("enough idle held bytes");
            let cached = state.remove(&key).expect("present");
            evicted.push(cached.into());
        }
        Some(evicted)
    }

    /// One user fewer for the registration of `key`.
    fn unlease(&self, key: Key) {
        let mut state = lock(&self.state);
        state.tick += 1;
        let tick = state.tick;
        if let Some(cached) = state.entries.get_mut(&key) {
            cached.users -= 1;
            cached.last_use = tick;
        }
    }

    /// A release hook's part: the memory of `owner` is about to be freed.
    fn release(&self, owner: Owner) {
        let released: Vec<(Key, Cached)> = {
            let mut state = lock(&self.state);
            let keys: Vec<Key> = state
                .entries
                .keys()
                .filter(|key| key.owner == owner)
                .copied()
                .collect();
            keys.into_iter()
                .filter_map(|key| state.remove(&key).map(|cached| (key, cached)))
                .collect()
        };
        for (_, cached) in released {
            if cached.users > 0 {
                // Cannot happen: a bound window holds bytes of the buffer,
                // which keeps it alive. Deregistering fails (a window is
                // bound over it) and leaks the region; say so loudly.
                tracing::error!(
                    users = cached.users,
                    "memory freed under a bound memory window"
                );
            }
            deregister_all(vec![cached.region]);
        }
    }
}

impl Drop for WindowCache {
    fn drop(&mut self) {
        let state = std::mem::take(&mut *lock(&self.state));
        CACHED_BYTES.fetch_sub(state.bytes as u64, Ordering::Relaxed);
        release_all(state.entries.into_values().map(Evicted::from).collect());
    }
}

/// Deregisters what leaves the cache, then lets go of the bytes each kept
/// alive; bytes under a registration that failed to deregister are leaked
/// with it (the device might still read them).
fn release_all(evicted: Vec<Evicted>) {
    for Evicted { region, holder } in evicted {
        match region.deregister() {
            Ok(()) => drop(holder),
            Err(error) => {
                tracing::error!(%error, "deregistering a cached registration failed; leaking it");
                std::mem::forget(region);
                std::mem::forget(holder);
            }
        }
    }
}

/// A [`super::RegisteredBuffer`] registered with MW_BIND: windows may be
/// bound over its region while bytes of it are held.
struct Known {
    len: usize,
    id: u64,
    /// The protection domain's identity (its address).
    pd: usize,
    region: Arc<dyn MemoryRegion>,
}

/// Registered buffers with MW_BIND, by start address; each is in here from
/// its registration until just before it is deregistered and freed.
static KNOWN: Mutex<BTreeMap<usize, Known>> = Mutex::new(BTreeMap::new());
static NEXT_KNOWN: AtomicU64 = AtomicU64::new(1);

fn pd_id(pd: &dyn ProtectionDomain) -> usize {
    pd as *const dyn ProtectionDomain as *const () as usize
}

/// Records a registered buffer windows may be bound over.
///
/// # Safety
/// `addr..addr + len` is the memory of a live [`super::RegisteredBuffer`]
/// registered as `region` on `pd`, and [`untrack_registered`]`(addr)` runs
/// before that memory is deregistered or freed: [`WindowCache::bind`] binds
/// windows over it on the strength of this entry.
pub(crate) unsafe fn track_registered(
    addr: usize,
    len: usize,
    pd: &dyn ProtectionDomain,
    region: Arc<dyn MemoryRegion>,
) {
    let known = Known {
        len,
        id: NEXT_KNOWN.fetch_add(1, Ordering::Relaxed),
        pd: pd_id(pd),
        region,
    };
    lock(&KNOWN).insert(addr, known);
}

/// Forgets a registered buffer, and deregisters what the caches registered
/// over it: it is about to be deregistered and freed.
pub(crate) fn untrack_registered(addr: usize) {
    let known = lock(&KNOWN).remove(&addr);
    if let Some(known) = known {
        for cache in live_caches() {
            cache.release(Owner::Registered(known.id));
        }
    }
}

/// The registered buffer of `pd` that holds all of `bytes`: its id and region.
fn registered_buffer(
    pd: &dyn ProtectionDomain,
    bytes: &[u8],
) -> Option<(u64, Arc<dyn MemoryRegion>)> {
    let start = bytes.as_ptr() as usize;
    let end = start.checked_add(bytes.len())?;
    let known = lock(&KNOWN);
    let (&addr, known) = known.range(..=start).next_back()?;
    (end <= addr + known.len && known.pd == pd_id(pd)).then(|| (known.id, known.region.clone()))
}

/// Deregisters regions nobody uses any more; one that fails is leaked (it
/// grants no remote access by itself, and no window will be bound over it).
fn deregister_all(regions: Vec<Arc<dyn MemoryRegion>>) {
    for region in regions {
        if let Err(error) = region.deregister() {
            tracing::error!(%error, "deregistering a cached registration failed; leaking it");
            std::mem::forget(region);
        }
    }
}

/// A user of a cached registration; given back when the window is deregistered.
struct Lease {
    cache: Arc<WindowCache>,
    key: Key,
}

/// A memory window with the lease on the registration it is bound over.
struct LeasedWindow {
    window: Arc<dyn MemoryRegion>,
    lease: Mutex<Option<Lease>>,
}

// SAFETY: delegates to the bound window of a provider's `MemoryRegion`, whose contract carries
// over; deregistering invalidates that window before the lease goes back.
unsafe impl MemoryRegion for LeasedWindow {
    fn addr(&self) -> u64 {
        self.window.addr()
    }
    fn len(&self) -> usize {
        self.window.len()
    }
    fn lkey(&self) -> u32 {
        self.window.lkey()
    }
    fn rkey(&self) -> u32 {
        self.window.rkey()
    }
    fn access(&self) -> AccessFlags {
        self.window.access()
    }
    fn deregister(&self) -> Result<(), VerbsError> {
        self.window.deregister()?;
        if let Some(lease) = lock(&self.lease).take() {
            lease.cache.unlease(lease.key);
        }
        Ok(())
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for LeasedWindow {
    fn drop(&mut self) {
        if let Err(error) = self.deregister() {
            // The registration stays leased (never evicted, never
            // deregistered): the window may still be usable.
            tracing::error!(%error, "invalidating a memory window failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tests keep every payload allocated and unwritten until its
    /// window is deregistered (or the test ends, leaking nothing the
    /// device still reads: the windows are dropped first).
    impl WindowCache {
        fn bind_kept(
            self: &Arc<Self>,
            pd: &dyn ProtectionDomain,
            qp: &Arc<dyn QueuePair>,
            bytes: &[u8],
        ) -> Result<Option<Arc<dyn MemoryRegion>>, VerbsError> {
            // SAFETY: see above.
            unsafe { self.bind(pd, qp, bytes) }
        }

        fn bind_bytes_kept(
            self: &Arc<Self>,
            pd: &dyn ProtectionDomain,
            qp: &Arc<dyn QueuePair>,
            bytes: &bytes::Bytes,
        ) -> Result<Option<Arc<dyn MemoryRegion>>, VerbsError> {
            // SAFETY: see above.
            unsafe { self.bind_bytes(pd, qp, bytes) }
        }
    }
    use crate::soft::SoftProvider;
    use crate::{Provider, QpCaps, QpInit, RegisteredBuffer};
    use bytes::Bytes;

    /// A PD and a QP of the soft device; under Miri (no system calls) of
    /// the mock device, whose windows check nothing: the tests below are
    /// about the cache's own tables.
    fn soft() -> (Arc<dyn ProtectionDomain>, Arc<dyn QueuePair>) {
        let context = if cfg!(miri) {
            crate::mock::MockContext::open()
        } else {
            SoftProvider.open("soft0").unwrap()
        };
        let pd = context.alloc_pd().unwrap();
        let cq = context.create_cq(64, None).unwrap();
        let qp = pd
            .create_qp(QpInit {
                send_cq: cq.clone(),
                recv_cq: cq,
                srq: None,
                caps: QpCaps::default(),
                sq_sig_all: false,
            })
            .unwrap();
        (pd, qp)
    }

    /// A frozen recycled buffer of `len` bytes.
    fn recycled(len: usize, fill: u8) -> Bytes {
        let mut buffer = recycle::take(len);
        buffer.resize(len, fill);
        recycle::into_bytes(buffer)
    }

    /// `RDMA_MEMORY_WINDOWS`: `off` wins over a device that binds by
    /// default, `on` over one that does not (rxe), anything else leaves the
    /// device's default.
    #[test]
    fn the_windows_setting_overrides_the_device_default_both_ways() {
        for default in [true, false] {
            assert_eq!(windows_setting(None, default), default, "unset");
            assert_eq!(
                windows_setting(Some("maybe"), default),
                default,
                "unknown value"
            );
            for off in ["off", "0", "false", "no"] {
                assert!(!windows_setting(Some(off), default), "{off}");
            }
            for on in ["on", "1", "true", "yes"] {
                assert!(windows_setting(Some(on), default), "{on}");
            }
        }
    }

    #[test]
    fn one_registration_per_recycled_buffer_however_many_windows() {
        let (pd, qp) = soft();
        let cache = WindowCache::new(256 << 20, false);
        let payload = recycled((3 << 20) + 4096 * 5, 1);
        let memory = recycle::recycled_memory(&payload).unwrap();
        let first = cache
            .bind_kept(&*pd, &qp, &payload[..1 << 20])
            .unwrap()
            .expect("a recycled buffer");
        assert_eq!(first.addr(), payload.as_ptr() as u64, "exactly the bytes");
        assert_eq!(first.len(), 1 << 20);
        assert_eq!(first.access(), AccessFlags::REMOTE_READ);
        let second = cache
            .bind_kept(&*pd, &qp, &payload[1000..2000])
            .unwrap()
            .unwrap();
        assert_eq!(second.addr(), payload.as_ptr() as u64 + 1000);
        assert_ne!(second.rkey(), first.rkey());
        assert_eq!(cache.registrations(), 1, "the buffer is registered once");
        assert_eq!(cache.cached_bytes(), memory.len, "all of it");
        first.deregister().unwrap();
        second.deregister().unwrap();
        let third = cache.bind_kept(&*pd, &qp, &payload).unwrap().unwrap();
        third.deregister().unwrap();
        assert_eq!(
            cache.registrations(),
            1,
            "and stays registered while it lives"
        );
        // Bytes elsewhere are not the cache's business.
        let plain = Bytes::from(vec![7u8; 2 << 20]);
        assert!(cache.bind_kept(&*pd, &qp, &plain).unwrap().is_none());
    }

    /// `Bytes` of `len` bytes whose memory says when it is freed.
    fn watched(len: usize, fill: u8) -> (Bytes, Arc<std::sync::atomic::AtomicBool>) {
        struct Watched(Vec<u8>, Arc<std::sync::atomic::AtomicBool>);
        impl AsRef<[u8]> for Watched {
            fn as_ref(&self) -> &[u8] {
                &self.0
            }
        }
        impl Drop for Watched {
            fn drop(&mut self) {
                self.1.store(true, Ordering::SeqCst);
            }
        }
        let freed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let bytes = Bytes::from_owner(Watched(vec![fill; len], freed.clone()));
        (bytes, freed)
    }

    #[test]
    fn application_bytes_are_registered_once_and_kept_alive_while_cached() {
        let (pd, qp) = soft();
        let cache = WindowCache::new(MAX_CACHED_BYTES, false);
        let (payload, freed) = watched(1 << 20, 4);
        let first = cache
            .bind_bytes_kept(&*pd, &qp, &payload)
            .unwrap()
            .expect("held");
        assert_eq!(first.addr(), payload.as_ptr() as u64, "exactly the bytes");
        assert_eq!(first.len(), 1 << 20);
        assert_eq!(first.access(), AccessFlags::REMOTE_READ);
        first.deregister().unwrap();
        // Short bytes are not held (a registration of their own).
        let short = Bytes::from(vec![1u8; HOLD_FROM - 1]);
        assert!(cache.bind_bytes_kept(&*pd, &qp, &short).unwrap().is_none());
        // The same bytes again, and a part of them: no new registration.
        let again = cache.bind_bytes_kept(&*pd, &qp, &payload).unwrap().unwrap();
        let part = cache
            .bind_bytes_kept(&*pd, &qp, &payload.slice(4096..8192))
            .unwrap()
            .unwrap();
        assert_eq!(part.addr(), payload.as_ptr() as u64 + 4096);
        assert_eq!(cache.registrations(), 1);
        again.deregister().unwrap();
        part.deregister().unwrap();
        // The application lets go: the cache keeps the memory (registered
        // pages must not be freed under it) until the registration goes.
        drop(payload);
        assert!(!freed.load(Ordering::SeqCst), "kept alive by the cache");
        drop(cache);
        assert!(freed.load(Ordering::SeqCst), "freed after deregistration");
    }

    #[test]
    fn with_exact_extents_only_the_same_bytes_share_a_held_registration() {
        let (pd, qp) = soft();
        let cache = WindowCache::new(MAX_CACHED_BYTES, true);
        let payload = Bytes::from(vec![5u8; 1 << 20]);
        for _ in 0..3 {
            let window = cache.bind_bytes_kept(&*pd, &qp, &payload).unwrap().unwrap();
            window.deregister().unwrap();
        }
        assert_eq!(cache.registrations(), 1);
        // A part would be bound over a registration of all the bytes, which
        // such a device lets a READ through the window reach: its own.
        let payload = Bytes::from(vec![5u8; 3 << 20]);
        let whole = cache.bind_bytes_kept(&*pd, &qp, &payload).unwrap().unwrap();
        whole.deregister().unwrap();
        let part = cache
            .bind_bytes_kept(&*pd, &qp, &payload.slice(..HOLD_FROM))
            .unwrap()
            .unwrap();
        assert_eq!(cache.registrations(), 3);
        part.deregister().unwrap();
    }

    #[test]
    fn held_bytes_stay_within_their_cap_least_recently_used_first() {
        let (pd, qp) = soft();
        let cache = WindowCache::new(MAX_CACHED_BYTES, false);
        let len = MAX_HELD_BYTES / 4;
        let mut watched_all = Vec::new();
        for fill in 0..5u8 {
            let (bytes, freed) = watched(len, fill);
            cache
                .bind_bytes_kept(&*pd, &qp, &bytes)
                .unwrap()
                .unwrap()
                .deregister()
                .unwrap();
            watched_all.push(freed);
        }
        assert_eq!(cache.registrations(), 5);
        assert!(
            cache.cached_bytes() <= MAX_HELD_BYTES,
            "{}",
            cache.cached_bytes()
        );
        assert!(watched_all[0].load(Ordering::SeqCst), "the oldest let go");
        assert!(!watched_all[4].load(Ordering::SeqCst), "the newest kept");
        // One in use is never evicted: with a window bound over each of four
        // held ranges, a fifth does not fit and is not held.
        let held: Vec<Bytes> = (0..4u8).map(|fill| watched(len, fill).0).collect();
        let windows: Vec<_> = held
            .iter()
            .map(|bytes| cache.bind_bytes_kept(&*pd, &qp, bytes).unwrap().unwrap())
            .collect();
        let extra = watched(len, 9).0;
        assert!(cache.bind_bytes_kept(&*pd, &qp, &extra).unwrap().is_none());
        for window in windows {
            window.deregister().unwrap();
        }
    }

    #[test]
    fn idle_registrations_are_evicted_least_recently_used_first_never_one_in_use() {
        let (pd, qp) = soft();
        let len = (13 << 20) + 4096 * 3;
        let [a, b, c] = [1, 2, 3].map(|fill| recycled(len, fill));
        let size = recycle::recycled_memory(&a).unwrap().len;
        for other in [&b, &c] {
            assert_eq!(recycle::recycled_memory(other).unwrap().len, size);
        }
        let cache = WindowCache::new(2 * size, false);
        let bind = |bytes: &Bytes| cache.bind_kept(&*pd, &qp, bytes).unwrap();
        bind(&a).unwrap().deregister().unwrap();
        bind(&b).unwrap().deregister().unwrap();
        assert_eq!(cache.registrations(), 2);
        // Full: C takes the place of A, the least recently used.
        bind(&c).unwrap().deregister().unwrap();
        assert_eq!(cache.registrations(), 3);
        assert_eq!(cache.cached_bytes(), 2 * size);
        bind(&b).unwrap().deregister().unwrap();
        assert_eq!(cache.registrations(), 3, "B was kept");
        // Two windows in use hold both registrations: a third buffer finds
        // no room and is left to its caller (who registers it exactly).
        let over_b = bind(&b).unwrap();
        let over_c = bind(&c).unwrap();
        assert!(bind(&a).is_none(), "nothing idle to evict");
        assert_eq!(cache.registrations(), 3);
        over_c.deregister().unwrap();
        let over_a = bind(&a).expect("C was idle: evicted for A");
        assert_eq!(cache.registrations(), 4);
        over_a.deregister().unwrap();
        over_b.deregister().unwrap();
    }

    #[test]
    fn the_release_hook_deregisters_before_the_memory_is_freed() {
        let (pd, qp) = soft();
        let cache = WindowCache::new(usize::MAX, false);
        // Larger than the recycled buffers' idle cap: freed when the last
        // bytes go (only reserved, never touched: it costs no memory).
        let mut buffer = recycle::take(recycle::MAX_IDLE_BYTES + 4096);
        buffer.extend_from_slice(b"payload");
        let payload = recycle::into_bytes(buffer);
        let window = cache.bind_kept(&*pd, &qp, &payload).unwrap().unwrap();
        window.deregister().unwrap();
        assert!(cache.cached_bytes() > recycle::MAX_IDLE_BYTES);
        drop(payload);
        assert_eq!(cache.cached_bytes(), 0, "deregistered by the hook");
    }

    /// Where the device does not confine a window's READs to its range,
    /// each window is bound over a registration of exactly its bytes,
    /// cached by extent, and released with the memory it covers.
    #[test]
    fn exact_extents_register_each_window_extent_once_and_release_it_with_the_memory() {
        let (pd, qp) = soft();
        let cache = WindowCache::new(256 << 20, true);
        assert!(cache.exact_extents());
        let payload = recycled((5 << 20) + 4096 * 7, 4);
        let bind = |bytes: &[u8]| cache.bind_kept(&*pd, &qp, bytes).unwrap().expect("bound");
        let whole = bind(&payload[..1 << 20]);
        assert_eq!(
            (whole.addr(), whole.len()),
            (payload.as_ptr() as u64, 1 << 20)
        );
        whole.deregister().unwrap();
        bind(&payload[..1 << 20]).deregister().unwrap();
        assert_eq!(cache.registrations(), 1, "the same extent again: cached");
        assert_eq!(cache.cached_bytes(), 1 << 20, "exactly the window's bytes");
        let part = bind(&payload[1000..2000]);
        assert_eq!(cache.registrations(), 2, "another extent: registered once");
        assert_eq!(cache.cached_bytes(), (1 << 20) + 1000);
        part.deregister().unwrap();

        // A registered buffer's window gets an exact registration too (not
        // the buffer's own, which covers older frames' bytes), released
        // before the buffer is deregistered and freed.
        let buffer = RegisteredBuffer::new(
            &pd,
            1 << 20,
            AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND,
        )
        .unwrap();
        let window = bind(&buffer.as_slice()[..4096]);
        assert_eq!(cache.registrations(), 3);
        window.deregister().unwrap();
        drop(buffer);
        assert_eq!(
            cache.cached_bytes(),
            (1 << 20) + 1000,
            "the buffer's extent went with it"
        );
    }

    #[test]
    fn registered_buffers_with_mw_bind_take_windows_over_their_own_registration() {
        let (pd, qp) = soft();
        let cache = WindowCache::new(1 << 20, false);
        let with = RegisteredBuffer::new(
            &pd,
            1 << 20,
            AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND,
        )
        .unwrap();
        let without = RegisteredBuffer::new(&pd, 1 << 20, AccessFlags::LOCAL_WRITE).unwrap();
        let window = cache
            .bind_kept(&*pd, &qp, &with.as_slice()[4096..8192])
            .unwrap()
            .expect("a registered buffer with MW_BIND");
        assert_eq!(window.addr(), with.addr() + 4096);
        assert_eq!(window.len(), 4096);
        window.deregister().unwrap();
        assert!(
            cache
                .bind_kept(&*pd, &qp, &without.as_slice()[..4096])
                .unwrap()
                .is_none()
        );
        assert_eq!(cache.registrations(), 0, "nothing registered for either");
        // Another PD's buffer is not this PD's to bind over.
        let (other_pd, _) = soft();
        let foreign = RegisteredBuffer::new(
            &other_pd,
            1 << 20,
            AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND,
        )
        .unwrap();
        assert!(
            cache
                .bind_kept(&*pd, &qp, &foreign.as_slice()[..4096])
                .unwrap()
                .is_none()
        );
    }
}
