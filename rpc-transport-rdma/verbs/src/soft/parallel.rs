//! Large cross-process copies split across the cores.
//!
//! One `process_vm_readv` runs on one core. A rendezvous READ moves a
//! payload while the peer waits for it, so a single copying thread leaves
//! the other cores idle exactly when the call's latency is the copy (tcp://
//! over loopback, by contrast, copies on the sender's and the receiver's
//! core at once). A READ of at least [`SPLIT_FROM`] bytes is therefore cut
//! into pieces: the thread that finishes the READ copies one piece, a small
//! process-wide set of helper threads the others.
//!
//! The caller never waits for a helper that has not started: once its own
//! piece is done it takes every piece no helper claimed yet, so on a busy
//! machine (helpers not scheduled) the copy degrades to the single-thread
//! one, not to a stall. It returns only after every piece has finished,
//! which keeps the caller's guarantee (the local spans stay registered for
//! the call) covering the helpers' writes too. Helpers only ever write our
//! own memory, with `process_vm_readv`, as the caller would.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use super::lock;
use super::memory::{self, Span};

/// Copies from this many bytes (one READ chunk of the RPC transport) are
/// split. Measured on 2 cores with `bulk_probe`: from 256 KiB to 1 MiB a
/// split made no difference above the noise but woke a helper (two context
/// switches) per copy; at 16 MiB it is worth 30%.
pub(crate) const SPLIT_FROM: usize = 1024 * 1024;
/// Bytes per piece: several pieces per thread, claimed one at a time, so the
/// threads end within one piece of each other.
const PIECE_LEN: usize = 256 * 1024;
/// Pieces per copy at most.
const MAX_PIECES: usize = 64;
/// Helper threads at most, whatever the core count: memory bandwidth, not
/// cores, bounds a copy beyond a few threads.
const MAX_HELPERS: usize = 3;
/// Polls of the unfinished count before the caller sleeps on it (a helper
/// that started a piece usually ends within the caller's own piece).
const SPIN_BEFORE_SLEEP: u32 = 2_000;

/// Copies `remote` (in process `pid`) into `local` (ours) like
/// [`memory::read_from`], on several threads when the copy is large and the
/// machine has more than one core.
///
/// # Safety
/// As for [`memory::read_from`]: for the whole call every `local` span must
/// be memory of this process valid for writes of its whole length, which
/// nothing reads or writes meanwhile through a Rust reference. (Helper
/// threads write it too, but only before this function returns.)
pub(crate) unsafe fn read_from(pid: u32, remote: &[Span], local: &[Span]) -> io::Result<()> {
    let len = memory::total(local);
    let pool = if len >= SPLIT_FROM && len == memory::total(remote) {
        helpers()
    } else {
        None
    };
    let Some((pool, helpers)) = pool else {
        // SAFETY: our caller's guarantee for `local`, for this call, which
        // ends before ours.
        return unsafe { memory::read_from(pid, remote, local) };
    };
    let pieces = (len / PIECE_LEN).clamp(helpers + 1, MAX_PIECES);
    // SAFETY: our caller guarantees `local` writable and unobserved until we
    // return; the pieces are cut out of `local` (`memory::slice`); and
    // `finish`, made right below, calls `run_claimable` then `wait` on the
    // job when dropped: before we return, or as we unwind.
    let job = Arc::new(unsafe { Job::new(pid, remote, local, len, pieces) });
    let finish = Finish(&job);
    {
        let mut queue = lock(&pool.queue);
        queue.push_back(job.clone());
    }
    for _ in 1..pieces {
        pool.ready.notify_one();
    }
    // Our own share, then everything no helper claimed, then the wait.
    drop(finish);
    job.take_error()
}

/// Finishes a split copy when dropped, also while unwinding: copies every
/// piece nobody claimed yet, then waits for the pieces helpers took. After
/// that no thread writes the copy's local spans.
struct Finish<'a>(&'a Job);

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        self.0.run_claimable();
        self.0.wait();
    }
}

/// One split copy: its pieces, which of them are claimed, how many are
/// still running, and the first error.
struct Job {
    pid: u32,
    pieces: Vec<(Vec<Span>, Vec<Span>)>,
    next: AtomicUsize,
    unfinished: AtomicUsize,
    finished_lock: Mutex<()>,
    finished: Condvar,
    error: Mutex<Option<io::Error>>,
}

impl Job {
    /// `count` pieces of the copy of the first `len` bytes of `remote` (in
    /// process `pid`) into `local`.
    ///
    /// # Safety
    /// Every piece is copied into `local` by `run_claimable`, on whichever
    /// thread calls it, helpers included (they find the job in the pool's
    /// queue), possibly later than this call. The caller must keep every
    /// `local` span writable memory of this process that nothing reads or
    /// writes through a Rust reference until every piece has finished: it
    /// must call `run_claimable` (which leaves no piece unclaimed) and then
    /// `wait` (which returns once every claimed piece has finished) before
    /// the spans stop being such memory.
    unsafe fn new(pid: u32, remote: &[Span], local: &[Span], len: usize, count: usize) -> Job {
        let each = len.div_ceil(count);
        let pieces = (0..count)
            .map(|i| {
                let start = (i * each).min(len);
                let piece_len = each.min(len - start);
                (
                    memory::slice(remote, start, piece_len),
                    memory::slice(local, start, piece_len),
                )
            })
            .collect();
        Job {
            pid,
            pieces,
            next: AtomicUsize::new(0),
            unfinished: AtomicUsize::new(count),
            finished_lock: Mutex::new(()),
            finished: Condvar::new(),
            error: Mutex::new(None),
        }
    }

    fn exhausted(&self) -> bool {
        self.next.load(Ordering::Acquire) >= self.pieces.len()
    }

    /// Copies pieces nobody claimed yet, until none is left.
    fn run_claimable(&self) {
        loop {
            let index = self.next.fetch_add(1, Ordering::AcqRel);
            let Some((remote, local)) = self.pieces.get(index) else {
                return;
            };
            // SAFETY: `local` is a piece of the spans `Job::new`'s caller
            // keeps writable and unobserved until `wait` has returned, and
            // `wait` cannot return before this piece is done: `unfinished`
            // counts it until the `fetch_sub` below, after the copy.
            if let Err(error) = unsafe { memory::read_from(self.pid, remote, local) } {
                lock(&self.error).get_or_insert(error);
            }
            if self.unfinished.fetch_sub(1, Ordering::AcqRel) == 1 {
                // Taking the lock orders this notify after a waiter's check.
                let _guard = lock(&self.finished_lock);
                self.finished.notify_all();
            }
        }
    }

    /// Waits until every piece has finished.
    fn wait(&self) {
        let mut spins = 0;
        while self.unfinished.load(Ordering::Acquire) > 0 && spins < SPIN_BEFORE_SLEEP {
            std::hint::spin_loop();
            spins += 1;
        }
        let mut guard = lock(&self.finished_lock);
        while self.unfinished.load(Ordering::Acquire) > 0 {
            guard = self
                .finished
                .wait(guard)
                .unwrap_or_else(|poison| poison.into_inner());
        }
    }

    /// The first error of a finished copy, if any.
    fn take_error(&self) -> io::Result<()> {
        match lock(&self.error).take() {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }
}

/// The process's copy helpers: a queue of split copies with pieces left.
struct Pool {
    /// Helper threads running (set once, after they are started).
    helpers: AtomicUsize,
    queue: Mutex<VecDeque<Arc<Job>>>,
    ready: Condvar,
}

/// The helpers, started on first use; `None` on one core (or when no
/// thread could be started).
fn helpers() -> Option<(&'static Pool, usize)> {
    static POOL: OnceLock<Option<&'static Pool>> = OnceLock::new();
    let pool = (*POOL.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let wanted = cores.saturating_sub(1).min(MAX_HELPERS);
        if wanted == 0 {
            return None;
        }
        // Lives as long as the process, like its helper threads.
        let pool: &'static Pool = Box::leak(Box::new(Pool {
            helpers: AtomicUsize::new(0),
            queue: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
        }));
        let started = (0..wanted)
            .take_while(|i| {
                std::thread::Builder::new()
                    .name(format!("soft-rdma-copy-{i}"))
                    .spawn(move || helper(pool))
                    .is_ok()
            })
            .count();
        pool.helpers.store(started, Ordering::Release);
        (started > 0).then_some(pool)
    }))?;
    Some((pool, pool.helpers.load(Ordering::Acquire)))
}

/// A helper thread: takes pieces of the oldest job with pieces left, sleeps
/// when there is none.
fn helper(pool: &'static Pool) {
    loop {
        let job = {
            let mut queue = lock(&pool.queue);
            loop {
                while queue.front().is_some_and(|job| job.exhausted()) {
                    queue.pop_front();
                }
                if let Some(job) = queue.front() {
                    break job.clone();
                }
                queue = pool
                    .ready
                    .wait(queue)
                    .unwrap_or_else(|poison| poison.into_inner());
            }
        };
        job.run_claimable();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_copy_moves_every_byte_across_uneven_spans() {
        let len = 3 * SPLIT_FROM + 12_345;
        let src: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        let mut a = vec![0u8; 100_000];
        let mut b = vec![0u8; len - 100_000];
        let local = [
            (a.as_mut_ptr() as u64, a.len() as u32),
            (b.as_mut_ptr() as u64, b.len() as u32),
        ];
        let cut = 700_001;
        let remote = [
            (src.as_ptr() as u64, cut as u32),
            (src.as_ptr() as u64 + cut as u64, (len - cut) as u32),
        ];
        for _ in 0..20 {
            a.fill(0);
            b.fill(0);
            // SAFETY: the local spans are exactly the vectors `a` and `b`,
            // which nothing touches until the call returns.
            unsafe { read_from(std::process::id(), &remote, &local) }.unwrap();
            assert_eq!(&a[..], &src[..100_000]);
            assert_eq!(&b[..], &src[100_000..]);
        }
    }

    #[test]
    fn a_bad_address_in_any_piece_fails_the_copy() {
        let len = 4 * SPLIT_FROM;
        let src = vec![1u8; len];
        let mut dst = vec![0u8; len];
        // The last quarter of the source is unmapped (address 8 onwards).
        let remote = [
            (src.as_ptr() as u64, (len - SPLIT_FROM) as u32),
            (8, SPLIT_FROM as u32),
        ];
        // SAFETY: the local span is exactly the vector `dst`, which nothing
        // touches until the call returns.
        let err = unsafe {
            read_from(
                std::process::id(),
                &remote,
                &[(dst.as_mut_ptr() as u64, len as u32)],
            )
        }
        .unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EFAULT));
        // Every piece was waited for: the job is done with `dst` here.
        dst.fill(2);
    }
}
