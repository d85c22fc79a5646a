//! The soft wire's fast path: descriptors travel through a pair of
//! single-producer single-consumer byte rings in memory shared by the two
//! processes (a memfd passed over the connection's Unix socket), so a busy
//! poller on either side moves a message with no system call.
//!
//! The Unix socket stays for two things: EOF (the peer process is gone) and
//! doorbells. A consumer about to sleep sets its `sleeping` flag, looks at
//! the ring once more, and blocks on the socket; a producer that finds the
//! flag set after publishing writes one byte there. Both sides use SeqCst on
//! the flag and the head index, so one of them always sees the other (no lost
//! wake-up).
//!
//! While a caller of the consuming process polls (it reads the ring itself),
//! that process's engine thread does not declare itself asleep: it naps at
//! most [`POLLED_ENGINE_NAP`] with the flag clear, so producers ring no
//! doorbell (no system call, no thread woken to compete with the poller).
//! When the polling stops, the engine's next nap ends within that bound and
//! it goes back to sleeping with the flag set.
//!
//! A producer whose batch only causes completions in armed CQs of the
//! consumer wakes the consumer's sleeping caller directly instead (see
//! `wake`); the doorbell is for the consumer's engine thread.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use rustix::mm::{MapFlags, ProtFlags};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// Bytes of ring data per direction. The rings carry work-request
/// descriptors, with data only for inline sends (at most 4096 bytes) and
/// messages of at most 512 bytes (other payloads move by `process_vm_*`); a
/// record larger than the room left is written in pieces, and a full ring
/// is back-pressure, so 128 KiB is ample. Every page of a ring ends up
/// resident as it wraps, in both processes, so this is what a busy
/// connection costs each side in memory (it was 4 MiB, 8 MiB a connection). Under Miri, which runs only the index
/// arithmetic over heap memory in one process, 64 KiB: the same logic,
/// wrapped around in a time Miri can afford.
pub(crate) const RING_BYTES: usize = if cfg!(miri) { 64 << 10 } else { 128 << 10 };
/// Control block before each direction's data: head, tail, sleeping and
/// closed, each on its own cache line.
const CONTROL: usize = 256;
/// A caller that polled this recently is taken to be polling still.
const POLL_GRACE_NS: u64 = 100_000;
/// While its process polls, the engine thread naps at most this long (with
/// the sleeping flag clear), which bounds the wait of a message that arrives
/// just as the polling stops.
pub(crate) const POLLED_ENGINE_NAP: Duration = Duration::from_millis(1);
const HALF: usize = CONTROL + RING_BYTES;
/// Bytes of the shared mapping (both halves).
const MAPPED: usize = 2 * HALF;
const _: () = assert!(RING_BYTES.is_power_of_two(), "index arithmetic masks");
const _: () = assert!(
    3 * 64 + 8 <= CONTROL,
    "the four control words fit the block"
);

/// The shared mapping: two halves, dialer → acceptor first.
struct Mapping {
    base: *mut u8,
    /// The half this process produces into, claimed for as long as the
    /// mapping lives (none for heap memory).
    _claim: Option<HalfClaim>,
    /// Heap memory instead of a shared mapping: both ends of a test's ring
    /// pair in one process, where Miri can run them (no mmap).
    #[cfg(test)]
    heap: bool,
}

/// Page alignment of a heap-backed mapping (tests).
#[cfg(test)]
const PAGE: usize = 4096;

// SAFETY: a Mapping is the address of a process-wide shared mapping, which
// it unmaps on drop (from whichever thread); it gives no access to the
// memory by itself. `RingPair` accesses it: the control words only
// atomically, each half's data only from its one producer or one consumer
// at a time (the contracts of its unsafe `send_some` and `receive`; across
// `RingPair`s, the `HalfClaim` each mapping holds).
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        #[cfg(test)]
        if self.heap {
            let layout = std::alloc::Layout::from_size_align(MAPPED, PAGE).expect("layout");
            // SAFETY: `heap_pair` allocated `base` with this layout; it is
            // freed only here, once, after both ends (which share this
            // Mapping through an `Arc`) are gone.
            unsafe { std::alloc::dealloc(self.base, layout) };
            return;
        }
        // SAFETY: `base` is the start of the MAPPED-byte mapping `map_half` made
        // (the only other builder, `heap_pair`, was handled above); it is
        // unmapped only here, once,
        // and the rings' pointers into it do not outlive the Mapping.
        let _ = unsafe { rustix::mm::munmap(self.base.cast(), MAPPED) };
    }
}

/// Ring halves this process produces into, by the memfd's device and inode
/// and the half: each has one producer in the process (in this copy of the
/// crate: two versions of it linked into one process keep a set each). A hostile peer that
/// passed one memfd in two handshakes would otherwise have two of our QPs
/// produce into one half under different locks.
static PRODUCED_HALVES: std::sync::Mutex<std::collections::BTreeSet<(u64, u64, usize)>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// This process's claim on producing into one half of a ring memfd.
struct HalfClaim((u64, u64, usize));

impl HalfClaim {
    /// Claims half `tx` of the memfd `fd`, or says it is taken.
    fn take(fd: BorrowedFd<'_>, tx: usize) -> io::Result<HalfClaim> {
        let stat = rustix::fs::fstat(fd)?;
        let key = (stat.st_dev as u64, stat.st_ino as u64, tx);
        let mut halves = PRODUCED_HALVES
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        if !halves.insert(key) {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "this ring memory is already mapped by another soft QP of this process (a memfd passed twice)",
            ));
        }
        Ok(HalfClaim(key))
    }
}

impl Drop for HalfClaim {
    fn drop(&mut self) {
        PRODUCED_HALVES
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .remove(&self.0);
    }
}

/// One QP's view of the two rings.
pub(crate) struct RingPair {
    mapping: Arc<Mapping>,
    /// Which half we produce into (0: dialer → acceptor).
    tx: usize,
    /// The producer's last look at the consumer's tail (process-local): room
    /// is known without touching the consumer's cache line until it runs out.
    seen_tail: AtomicU64,
    /// Our own copy of the head we produce to and the tail we consume from.
    /// The shared words are the peer's to overwrite at will: we only publish
    /// to them, and what we read of the peer's is validated against these.
    local_head: AtomicU64,
    local_tail: AtomicU64,
    /// When a caller of this process last polled our side (process-local;
    /// 0: not polling).
    polled_at: AtomicU64,
}

impl std::fmt::Debug for RingPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingPair").field("tx", &self.tx).finish()
    }
}

/// Maps both rings, shared, readable and writable, as the side that
/// produces into half `tx` (0: the dialer), once this process holds that
/// half's claim.
///
/// # Safety
/// `fd` must be a memfd of at least [`MAPPED`] bytes that can never shrink
/// (sealed with `F_SEAL_SHRINK`): the rings access all of it, and an access
/// past the end of the file would be SIGBUS.
unsafe fn map_half(fd: BorrowedFd<'_>, tx: usize) -> io::Result<RingPair> {
    let claim = HalfClaim::take(fd, tx)?;
    // SAFETY: a null hint without MAP_FIXED: the kernel picks unused
    // addresses, so the call replaces or aliases no memory of ours.
    let base = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            MAPPED,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED,
            fd,
            0,
        )
    }?;
    let mapping = Mapping {
        base: base.cast(),
        _claim: Some(claim),
        #[cfg(test)]
        heap: false,
    };
    Ok(RingPair::new(Arc::new(mapping), tx))
}

impl RingPair {
    /// Creates the shared memory (dialing side), sealed so that it can never
    /// shrink under either side's mapping; returns the rings and the fd to pass.
    pub(crate) fn create() -> io::Result<(RingPair, OwnedFd)> {
        let fd = super::peer::sealed_memfd(c"rdma-rpc-soft-ring", MAPPED)?;
        // SAFETY: `sealed_memfd` just made `fd` a memfd of MAPPED bytes,
        // sealed against shrinking.
        let ring = unsafe { map_half(fd.as_fd(), 0) }?;
        Ok((ring, fd))
    }

    /// Maps the shared memory the dialer passed (accepting side), after
    /// checking its size and seals: a peer's fd that could shrink would turn
    /// our next access into SIGBUS.
    pub(crate) fn open(fd: &OwnedFd) -> io::Result<RingPair> {
        super::peer::check_sealed_memfd(fd, MAPPED, "descriptor ring")?;
        // SAFETY: `check_sealed_memfd` just checked that `fd` is a memfd of
        // exactly MAPPED bytes, sealed against shrinking.
        unsafe { map_half(fd.as_fd(), 1) }
    }

    /// Both ends of a ring pair over zeroed heap memory in this process
    /// (tests; what Miri runs the index logic on).
    #[cfg(test)]
    fn heap_pair() -> (RingPair, RingPair) {
        let layout = std::alloc::Layout::from_size_align(MAPPED, PAGE).expect("layout");
        // SAFETY: MAPPED is not zero.
        let base = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!base.is_null(), "out of memory");
        let mapping = Arc::new(Mapping {
            base,
            _claim: None,
            heap: true,
        });
        (RingPair::new(mapping.clone(), 0), RingPair::new(mapping, 1))
    }

    fn new(mapping: Arc<Mapping>, tx: usize) -> RingPair {
        RingPair {
            mapping,
            tx,
            seen_tail: AtomicU64::new(0),
            local_head: AtomicU64::new(0),
            local_tail: AtomicU64::new(0),
            polled_at: AtomicU64::new(0),
        }
    }

    /// Control word `slot` (0: head, 1: tail, 2: sleeping, 3: closed) of
    /// `half`, each on its own cache line.
    fn control(&self, half: usize, slot: usize) -> *mut u8 {
        assert!(half < 2 && slot < 4, "no such ring control word");
        // SAFETY: half * HALF + slot * 64 ≤ HALF + 192 < MAPPED (the bounds
        // asserted just above), and slot * 64 + 8 ≤ CONTROL (the constant
        // assertion beside CONTROL): the offset and the word there stay
        // inside the mapping `base` starts, before the data bytes.
        unsafe { self.mapping.base.add(half * HALF + slot * 64) }
    }

    fn head(&self, half: usize) -> &AtomicU64 {
        // SAFETY: `control` returns an address inside the MAPPED-byte shared
        // mapping that `self.mapping` keeps mapped while `self` (so the
        // returned reference) lives, over a memfd that cannot shrink (the
        // contract of `map_half`, which both constructors uphold). It is 8-byte
        // aligned: the mapping is page-aligned, HALF and 64 are multiples of
        // 8. This process accesses the control words only atomically; a peer
        // process writing them changes their values, not their validity.
        unsafe { AtomicU64::from_ptr(self.control(half, 0).cast()) }
    }

    fn tail(&self, half: usize) -> &AtomicU64 {
        // SAFETY: as in `head` (slot 1 is 64 bytes further: 8-byte aligned).
        unsafe { AtomicU64::from_ptr(self.control(half, 1).cast()) }
    }

    fn sleeping(&self, half: usize) -> &AtomicU32 {
        // SAFETY: as in `head` (slot 2 is 128 bytes further: 4-byte aligned).
        unsafe { AtomicU32::from_ptr(self.control(half, 2).cast()) }
    }

    fn closed(&self, half: usize) -> &AtomicU32 {
        // SAFETY: as in `head` (slot 3 is 192 bytes further: 4-byte aligned).
        unsafe { AtomicU32::from_ptr(self.control(half, 3).cast()) }
    }

    /// Says to the peer that our QP has entered ERROR (or is gone): from
    /// now on our side may revoke what it exposed and reuse the memory.
    /// Set before anything of ours can learn of the error.
    pub(crate) fn mark_closed(&self) {
        self.closed(self.tx).store(1, Ordering::SeqCst);
        // A store orders only what came before it: the fence keeps our
        // later reuse of the memory from showing before the word does.
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Whether the peer's QP has entered ERROR. A READ pulls the peer's
    /// bytes after the peer granted it; a peer that has entered ERROR since
    /// may have revoked and reused them, so the pull cannot stand (on a
    /// device the responder sends the bytes before its answer leaves).
    pub(crate) fn peer_closed(&self) -> bool {
        // A load orders only what comes after it: the fence keeps the
        // pull's reads from completing after the look at the word.
        std::sync::atomic::fence(Ordering::SeqCst);
        self.closed(self.rx()).load(Ordering::SeqCst) != 0
    }

    /// The first of `half`'s RING_BYTES data bytes.
    fn data(&self, half: usize) -> *mut u8 {
        assert!(half < 2, "no such ring half");
        // SAFETY: half * HALF + CONTROL + RING_BYTES ≤ MAPPED (asserted just
        // above): the offset, and the RING_BYTES after it, lie inside the
        // mapping `base` starts.
        unsafe { self.mapping.base.add(half * HALF + CONTROL) }
    }

    fn rx(&self) -> usize {
        1 - self.tx
    }

    /// Appends what of `bytes` fits (the caller is the only producer) and
    /// returns how many bytes that was: it never waits for the consumer,
    /// which is rung for a full ring. Then, when `wake` and the consumer's
    /// engine sleeps, calls `direct`: true when it woke the consumer's
    /// sleeping caller (or nobody needs waking), else the doorbell rings on
    /// `socket`. Without `wake` the bytes wait for the consumer's next look.
    /// Nobody waits on a peer here: what does not fit is the caller's to
    /// keep and write later (the QP's engine does).
    ///
    /// # Safety
    /// No other thread of this process produces on this ring pair while
    /// this call runs: two copies into the same ring bytes at once would
    /// race.
    pub(crate) unsafe fn send_some(
        &self,
        bytes: &[u8],
        socket: &UnixStream,
        wake: bool,
        direct: impl FnOnce() -> bool,
    ) -> io::Result<usize> {
        let half = self.tx;
        let mut written = 0;
        let mut consumer_sleeps = false;
        // Free bytes between the consumer's tail and our head; never more
        // than RING_BYTES, whatever the indices say.
        let room_between = |head: u64, tail: u64| {
            (RING_BYTES as u64).saturating_sub(head.wrapping_sub(tail)) as usize
        };
        while written < bytes.len() {
            let head = self.local_head.load(Ordering::Relaxed);
            let mut tail = self.seen_tail.load(Ordering::Relaxed);
            if room_between(head, tail) < bytes.len() - written {
                tail = self.tail(half).load(Ordering::Acquire);
                // The consumer's tail is the peer's word: it must lie between
                // what it had consumed before and what we produced.
                let seen = self.seen_tail.load(Ordering::Relaxed);
                if tail.wrapping_sub(seen) > head.wrapping_sub(seen) {
                    return Err(corrupt("the peer moved its ring tail past our head"));
                }
                self.seen_tail.store(tail, Ordering::Relaxed);
            }
            let room = room_between(head, tail);
            if room == 0 {
                // Wake the consumer if it sleeps; the rest is the caller's.
                self.doorbell(socket);
                break;
            }
            let n = room.min(bytes.len() - written);
            let at = (head as usize) & (RING_BYTES - 1);
            let first = n.min(RING_BYTES - at);
            // SAFETY: at < RING_BYTES (masked) and first ≤ RING_BYTES - at,
            // so [at, at + first) lies in this half's RING_BYTES data bytes
            // (`data`); n ≤ room ≤ RING_BYTES, so [0, n - first) does too.
            // The sources are n bytes of `bytes` from `written` on (n ≤
            // bytes.len() - written), our own memory, not in the mapping.
            // No other thread of ours writes this half: our caller is the
            // only producer meanwhile (this function's contract). The
            // consumer (a RingPair of this module, in this or the peer
            // process) reads only below the head, which moves past these
            // bytes after the copy (`sync::publish`, Release). A known
            // deviation, as in any shared-memory IPC: a hostile peer
            // *process* may write these bytes concurrently, which Rust's
            // memory model would call a race; it changes only their values
            // (the memfd cannot shrink), and this process never holds a
            // reference into the mapping's data.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes[written..].as_ptr(),
                    self.data(half).add(at),
                    first,
                );
                std::ptr::copy_nonoverlapping(
                    bytes[written + first..].as_ptr(),
                    self.data(half),
                    n - first,
                );
            }
            let new_head = head.wrapping_add(n as u64);
            self.local_head.store(new_head, Ordering::Relaxed);
            // The doorbell handshake (model-checked in `loom_model.rs`).
            consumer_sleeps =
                super::sync::publish(self.head(half), self.sleeping(half), new_head, wake);
            written += n;
        }
        if consumer_sleeps && !direct() {
            self.ring_doorbell(socket);
        }
        Ok(written)
    }

    /// Rings the doorbell if the consumer sleeps (a full ring: wake it to drain).
    fn doorbell(&self, socket: &UnixStream) {
        if self.sleeping(self.tx).load(Ordering::SeqCst) != 0 {
            self.ring_doorbell(socket);
        }
    }

    fn ring_doorbell(&self, socket: &UnixStream) {
        // A full socket buffer already holds doorbells, so EAGAIN is fine.
        let _ = rustix::net::send(socket, &[1u8], SendFlags::DONTWAIT | SendFlags::NOSIGNAL);
    }

    /// Copies out up to `out.len()` bytes that arrived (the caller is the
    /// only consumer); 0 when the ring is empty. The head is the peer's word:
    /// one that claims more than a ring's worth of bytes is refused.
    ///
    /// # Safety
    /// No other thread of this process consumes from this ring pair while
    /// this call runs: two copies out of the same bytes while the tail moves
    /// would race with the producer reusing them.
    pub(crate) unsafe fn receive(&self, out: &mut [u8]) -> io::Result<usize> {
        let half = self.rx();
        let tail = self.local_tail.load(Ordering::Relaxed);
        let head = self.head(half).load(Ordering::SeqCst);
        let available = head.wrapping_sub(tail);
        if available > RING_BYTES as u64 {
            return Err(corrupt("the peer's ring head is out of range"));
        }
        let n = (available as usize).min(out.len());
        if n == 0 {
            return Ok(0);
        }
        let at = (tail as usize) & (RING_BYTES - 1);
        let first = n.min(RING_BYTES - at);
        // SAFETY: at < RING_BYTES (masked) and first ≤ RING_BYTES - at, so
        // [at, at + first) lies in this half's RING_BYTES data bytes
        // (`data`); n ≤ available ≤ RING_BYTES (checked above), so
        // [0, n - first) does too; `out` has room for n ≥ first bytes (n ≤
        // out.len()). No other thread of ours reads this half: our caller is
        // the only consumer meanwhile (this function's contract). The
        // producer writes only past the tail, which moves past these bytes
        // after the copy (Release, below). A hostile peer process changing
        // the bytes meanwhile (the known deviation noted in `send_some`)
        // changes only what is copied, which is decoded and validated like
        // any other input.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data(half).add(at), out.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(self.data(half), out[first..].as_mut_ptr(), n - first);
        }
        let tail = tail.wrapping_add(n as u64);
        self.local_tail.store(tail, Ordering::Relaxed);
        self.tail(half).store(tail, Ordering::Release);
        Ok(n)
    }

    /// True when bytes are waiting to be received (or the peer's head is
    /// corrupt, which the next `receive` reports).
    pub(crate) fn has_data(&self) -> bool {
        let half = self.rx();
        self.head(half).load(Ordering::SeqCst) != self.local_tail.load(Ordering::Relaxed)
    }

    /// Records that a caller of this process is polling for our messages,
    /// and takes the doorbells off: a poller reads the ring itself and, when
    /// it stops, says so ([`RingPair::stop_polling`], which asks for
    /// doorbells again) and looks once more. Without this, the first message
    /// after each wake-up of an event-driven caller woke the engine thread
    /// too (it sleeps with the flag set until a doorbell or its time-out):
    /// two threads per wake-up instead of one.
    pub(crate) fn note_poll(&self) {
        self.polled_at.store(monotonic_ns(), Ordering::Relaxed);
        let sleeping = self.sleeping(self.rx());
        if sleeping.load(Ordering::Relaxed) != 0 {
            sleeping.store(0, Ordering::SeqCst);
        }
    }

    /// Records that the polling caller stopped (it is about to sleep) and
    /// asks producers for doorbells at once, on the engine's behalf (it may
    /// be napping with the flag clear). The caller looks at the ring once
    /// more after this (its last poll before sleeping), which covers what was
    /// published before the flag.
    pub(crate) fn stop_polling(&self) {
        self.polled_at.store(0, Ordering::SeqCst);
        self.set_sleeping(true);
        // As in `sync::may_sleep`: the flag's store is fenced before the
        // caller's last look at the head (the producer fences too).
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// True when a caller of this process polled within the grace period
    /// (the engine then naps with the sleeping flag clear).
    pub(crate) fn polled_recently(&self) -> bool {
        let polled_at = self.polled_at.load(Ordering::SeqCst);
        monotonic_ns().saturating_sub(polled_at) < POLL_GRACE_NS
    }

    /// True when a caller of this process turned our doorbells off to poll
    /// and then stopped without asking for them again (it never armed a
    /// CQ): nobody would wake the engine for what arrives.
    pub(crate) fn abandoned_by_poller(&self) -> bool {
        self.sleeping(self.rx()).load(Ordering::SeqCst) == 0 && !self.polled_recently()
    }

    /// Declares that our consumer is about to sleep, then looks once more:
    /// true when nothing arrived (sleep until a doorbell; the flag stays
    /// set), false when bytes wait (model-checked in `loom_model.rs`).
    pub(crate) fn may_sleep(&self) -> bool {
        let half = self.rx();
        super::sync::may_sleep(
            self.head(half),
            self.sleeping(half),
            self.local_tail.load(Ordering::Relaxed),
        )
    }

    /// Declares (or clears) that our consumer is about to sleep on the socket.
    pub(crate) fn set_sleeping(&self, sleeping: bool) {
        self.sleeping(self.rx())
            .store(u32::from(sleeping), Ordering::SeqCst);
    }
}

fn corrupt(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("soft-RDMA ring: {what}"),
    )
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process of the host.
fn monotonic_ns() -> u64 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// Most fds one set-up message carries.
pub(crate) const MAX_FDS: usize = 8;

/// Room for one control message carrying up to [`MAX_FDS`] fds (and the
/// padding that aligns it).
const FD_CONTROL_SPACE: usize = rustix::cmsg_space!(ScmRights(MAX_FDS));

/// Sends `bytes` and `fds` (at most [`MAX_FDS`]) in one message (SCM_RIGHTS).
pub(crate) fn send_with_fds(
    socket: &UnixStream,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    assert!(fds.len() <= MAX_FDS, "at most MAX_FDS fds");
    let mut space = [MaybeUninit::<u8>::uninit(); FD_CONTROL_SPACE];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        let fitted = control.push(SendAncillaryMessage::ScmRights(fds));
        assert!(fitted, "FD_CONTROL_SPACE holds MAX_FDS fds");
    }
    let sent = rustix::net::sendmsg(
        socket,
        &[IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    if sent != bytes.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, "short handshake"));
    }
    Ok(())
}

/// Receives exactly `out.len()` bytes and the fds sent with them (opened
/// close-on-exec; every fd received is owned by the result, or closed).
pub(crate) fn receive_with_fds(socket: &UnixStream, out: &mut [u8]) -> io::Result<Vec<OwnedFd>> {
    let expected = out.len();
    let mut space = [MaybeUninit::<u8>::uninit(); FD_CONTROL_SPACE];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(
        socket,
        &mut [IoSliceMut::new(out)],
        &mut control,
        RecvFlags::WAITALL | RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = message {
            fds.extend(received);
        }
    }
    if got.bytes != expected {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "short handshake",
        ));
    }
    Ok(fds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    // Each test below has one producer and one consumer thread per ring
    // pair: the contract of `send_some` and `receive`.
    fn receive(ring: &RingPair, out: &mut [u8]) -> io::Result<usize> {
        // SAFETY: see above.
        unsafe { ring.receive(out) }
    }

    fn send_some(
        ring: &RingPair,
        bytes: &[u8],
        socket: &UnixStream,
        wake: bool,
        direct: impl FnOnce() -> bool,
    ) -> io::Result<usize> {
        // SAFETY: see above.
        unsafe { ring.send_some(bytes, socket, wake, direct) }
    }

    /// All of `bytes`, waiting (in a test thread) while the ring is full.
    fn send(
        ring: &RingPair,
        bytes: &[u8],
        socket: &UnixStream,
        wake: bool,
        direct: impl Fn() -> bool,
    ) -> io::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut written = 0;
        while written < bytes.len() {
            written += send_some(ring, &bytes[written..], socket, wake, &direct)?;
            assert!(Instant::now() < deadline, "the consumer never drained");
            if written < bytes.len() {
                std::thread::yield_now();
            }
        }
        Ok(())
    }

    #[test]
    fn a_side_that_closes_is_seen_closed_by_its_peer_only() {
        let (one, other) = RingPair::heap_pair();
        assert!(!one.peer_closed() && !other.peer_closed());
        one.mark_closed();
        assert!(other.peer_closed(), "the peer sees it");
        assert!(!one.peer_closed(), "it is not the other side's word");
    }

    #[test]
    fn bytes_cross_the_ring_in_order_through_wrap_around() {
        let (producer, fd) = RingPair::create().unwrap();
        let consumer = RingPair::open(&fd).unwrap();
        let (socket, _other) = UnixStream::pair().unwrap();
        // Three quarters of the ring and an odd tail: every round wraps at
        // another place.
        let chunk: Vec<u8> = (0..=255u8).cycle().take(RING_BYTES / 4 * 3 + 3).collect();
        let mut got = Vec::new();
        let mut buffer = vec![0u8; 65536];
        for _ in 0..20 {
            send(&producer, &chunk, &socket, true, || false).unwrap();
            let mut round = 0;
            while round < chunk.len() {
                let n = receive(&consumer, &mut buffer).unwrap();
                got.extend_from_slice(&buffer[..n]);
                round += n;
            }
        }
        assert_eq!(got.len(), chunk.len() * 20);
        assert!(got.chunks(chunk.len()).all(|c| c == chunk.as_slice()));
        assert!(!consumer.has_data());
    }

    #[test]
    fn send_some_takes_what_fits_and_never_waits_for_a_consumer() {
        let (producer, fd) = RingPair::create().unwrap();
        let consumer = RingPair::open(&fd).unwrap();
        let (socket, _other) = UnixStream::pair().unwrap();
        let bytes = vec![7u8; RING_BYTES - 100];
        assert_eq!(
            send_some(&producer, &bytes, &socket, true, || false).unwrap(),
            bytes.len()
        );
        // 100 bytes of room left, nobody draining: no wait, a short count.
        let started = Instant::now();
        assert_eq!(
            send_some(&producer, &[1u8; 300], &socket, true, || false).unwrap(),
            100
        );
        assert_eq!(
            send_some(&producer, &[1u8; 300], &socket, true, || false).unwrap(),
            0
        );
        assert!(started.elapsed() < Duration::from_millis(500));
        // Once the consumer drains, the rest goes through.
        let mut buffer = vec![0u8; 4096];
        assert_eq!(receive(&consumer, &mut buffer).unwrap(), 4096);
        assert_eq!(
            send_some(&producer, &[1u8; 200], &socket, true, || false).unwrap(),
            200
        );
    }

    #[test]
    fn a_sleeping_consumer_gets_a_doorbell() {
        let (producer, fd) = RingPair::create().unwrap();
        let consumer = RingPair::open(&fd).unwrap();
        let (ours, theirs) = UnixStream::pair().unwrap();
        consumer.set_sleeping(true);
        send(&producer, b"hello", &ours, true, || false).unwrap();
        let mut byte = [0u8; 1];
        use std::io::Read;
        (&theirs).read_exact(&mut byte).unwrap();
        consumer.set_sleeping(false);
        let mut out = [0u8; 8];
        assert_eq!(receive(&consumer, &mut out).unwrap(), 5);
        assert_eq!(&out[..5], b"hello");
    }

    #[test]
    fn indices_a_hostile_peer_writes_are_refused_not_trusted() {
        let (producer, fd) = RingPair::create().unwrap();
        let consumer = RingPair::open(&fd).unwrap();
        let (socket, _other) = UnixStream::pair().unwrap();
        send(&producer, b"abc", &socket, false, || false).unwrap();
        // The "peer" (the producer's side of the mapping) claims a head far
        // beyond a ring's worth of bytes: the consumer refuses it.
        producer.head(0).store(u64::MAX / 2, Ordering::SeqCst);
        let mut out = [0u8; 16];
        assert_eq!(
            receive(&consumer, &mut out).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        // A consumer that moves its tail past what was produced is refused
        // by the producer once it needs to look at the tail.
        let (producer, fd) = RingPair::create().unwrap();
        let consumer = RingPair::open(&fd).unwrap();
        consumer.tail(0).store(1 << 40, Ordering::SeqCst);
        let big = vec![7u8; RING_BYTES];
        send(&producer, &big[..RING_BYTES / 2], &socket, false, || false).unwrap();
        let error = send(&producer, &big, &socket, false, || false).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidData);
    }

    /// One memfd passed in two handshakes is refused the second time: two
    /// of our QPs never produce into one half. The first mapping's end
    /// frees the half again.
    #[test]
    fn a_ring_memfd_passed_twice_is_refused_while_the_first_lives() {
        let (dialer, fd) = RingPair::create().unwrap();
        let acceptor = RingPair::open(&fd).expect("the acceptor's half is free");
        let twice = RingPair::open(&fd).expect_err("that half is taken");
        assert_eq!(twice.kind(), io::ErrorKind::AlreadyExists, "{twice}");
        drop(acceptor);
        let again = RingPair::open(&fd).expect("freed with the first acceptor");
        drop((dialer, again));
    }

    #[test]
    fn an_unsealed_or_short_memfd_is_refused_before_it_is_mapped() {
        let fd = rustix::fs::memfd_create(c"short", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let error = RingPair::open(&fd).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidData);
        let short = super::super::peer::sealed_memfd(c"short", 4096).unwrap();
        let error = RingPair::open(&short).unwrap_err();
        assert!(error.to_string().contains("4096 bytes"), "{error}");
    }

    /// The index arithmetic over heap memory (Miri runs this one): bytes
    /// come out as they went in across the wrap-around, a full ring takes no
    /// more, and a head that claims more than a ring's worth is refused.
    #[test]
    fn the_indices_wrap_around_and_a_forged_head_is_refused() {
        let (producer, consumer) = RingPair::heap_pair();
        let (socket, _other) = UnixStream::pair().unwrap();
        let chunk = |len: usize, seed: u8| -> Vec<u8> {
            (0..len)
                .map(|i| seed.wrapping_add((i % 251) as u8))
                .collect()
        };
        let mut out = vec![0u8; RING_BYTES];
        // Three quarters in and out, then three quarters again: the second
        // lot wraps around the end of the data.
        for seed in [1u8, 2] {
            let bytes = chunk(3 * RING_BYTES / 4, seed);
            assert_eq!(
                send_some(&producer, &bytes, &socket, false, || true).unwrap(),
                bytes.len()
            );
            assert!(consumer.has_data());
            let mut got = 0;
            while got < bytes.len() {
                got += receive(&consumer, &mut out[got..bytes.len()]).unwrap();
            }
            assert_eq!(&out[..bytes.len()], &bytes[..]);
            assert_eq!(receive(&consumer, &mut out).unwrap(), 0, "empty");
        }
        // A forged head (the peer's word) beyond a ring's worth is refused.
        producer
            .head(producer.tx)
            .store(u64::MAX / 2, Ordering::SeqCst);
        assert_eq!(
            receive(&consumer, &mut out).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
    }
}
