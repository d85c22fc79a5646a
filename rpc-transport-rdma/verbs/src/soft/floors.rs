//! Safe handles on the two operating-system facilities the soft provider is
//! built from, for code that measures the machine's *floors* beside it
//! (what the hardware and kernel do for the same job with nothing on top:
//! the `verbs_pingpong` example, the benchmarks' `rdma-rpc-floors` crate)
//! without `unsafe` of its own:
//!
//! - [`SharedWords`]: 64-bit atomic words in memory shared between
//!   processes, a sealed memfd as the soft wire's rings and arm words are;
//! - [`read_process_memory`]: `process_vm_readv` from another process's
//!   address space into a slice of ours, the way the soft provider moves
//!   every payload.
//!
//! Both are sound whatever the other process does: the shared memory is
//! only ever accessed through atomics and can never shrink under the
//! mapping, and reading another address space only writes the caller's
//! `&mut [u8]`.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

use rustix::mm::{MapFlags, ProtFlags};

use super::{memory, peer};

/// Bytes of a page: a [`SharedWords`] mapping is a whole number of them.
const PAGE: usize = 4096;

/// `words` 64-bit atomic words in memory that other processes can map too:
/// a memfd sealed at its size (it can neither shrink nor grow, and the
/// seals are final), mapped shared and accessed only through [`AtomicU64`].
///
/// Pass [`SharedWords::fd`] to another process (inherited, or over a Unix
/// socket with `SCM_RIGHTS`), which maps the same memory with
/// [`SharedWords::open`]; a store on one side is seen by a load on the
/// other, with the usual orderings.
///
/// ```
/// use std::sync::atomic::Ordering;
/// use rdma_verbs::soft::floors::SharedWords;
///
/// let words = SharedWords::create(2).unwrap();
/// let other = SharedWords::open(words.fd().try_clone_to_owned().unwrap(), 2).unwrap();
/// words.word(1).store(7, Ordering::Release);
/// assert_eq!(other.word(1).load(Ordering::Acquire), 7);
/// ```
pub struct SharedWords {
    base: NonNull<AtomicU64>,
    words: usize,
    mapped: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is owned by this value (unmapped once, in `Drop`) and
// only ever accessed through the atomics `word` hands out, which any thread
// may use.
unsafe impl Send for SharedWords {}
// SAFETY: as above: shared access is atomic access.
unsafe impl Sync for SharedWords {}

impl std::fmt::Debug for SharedWords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedWords")
            .field("words", &self.words)
            .field("fd", &self.fd.as_raw_fd())
            .finish()
    }
}

/// Bytes mapped for `words` words: whole pages, at least one.
fn mapped_len(words: usize) -> io::Result<usize> {
    words
        .checked_mul(8)
        .map(|bytes| bytes.max(1).next_multiple_of(PAGE))
        .filter(|&bytes| bytes <= isize::MAX as usize)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "too many shared words"))
}

impl SharedWords {
    /// `words` words, zeroed, in a fresh sealed memfd (close-on-exec: a
    /// child process gets it by an explicit hand-over, e.g. as its stdin).
    pub fn create(words: usize) -> io::Result<SharedWords> {
        let mapped = mapped_len(words)?;
        let fd = peer::sealed_memfd(c"rdma-verbs-shared-words", mapped)?;
        // SAFETY: `sealed_memfd` just made `fd` a memfd of `mapped` bytes,
        // sealed against shrinking.
        unsafe { SharedWords::map(fd, words, mapped) }
    }

    /// Maps the words another [`SharedWords`] (of this process or another)
    /// created, after checking that `fd` is a memfd of exactly the size
    /// `words` words take, sealed against shrinking: a memfd that could
    /// shrink could turn a later access into SIGBUS, so it is refused
    /// (`InvalidData`) before anything is mapped.
    pub fn open(fd: OwnedFd, words: usize) -> io::Result<SharedWords> {
        let mapped = mapped_len(words)?;
        peer::check_sealed_memfd(&fd, mapped, "shared words")?;
        // SAFETY: `check_sealed_memfd` just checked that `fd` is a memfd of
        // exactly `mapped` bytes, sealed against shrinking.
        unsafe { SharedWords::map(fd, words, mapped) }
    }

    /// Maps `mapped` bytes of `fd`, shared, readable and writable.
    ///
    /// # Safety
    /// `fd` must be a memfd of at least `mapped` bytes that can never
    /// shrink (sealed with `F_SEAL_SHRINK`): every later access to a word
    /// would otherwise risk SIGBUS. `words * 8` must not exceed `mapped`.
    unsafe fn map(fd: OwnedFd, words: usize, mapped: usize) -> io::Result<SharedWords> {
        // SAFETY: a null hint without MAP_FIXED: the kernel picks unused
        // addresses, so the call replaces or aliases no memory of ours.
        let base = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                mapped,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        }?;
        let base = NonNull::new(base.cast::<AtomicU64>())
            .ok_or_else(|| io::Error::other("mmap returned a null mapping"))?;
        Ok(SharedWords {
            base,
            words,
            mapped,
            fd,
        })
    }

    /// Word `index`.
    ///
    /// # Panics
    /// When `index` is not below [`SharedWords::len`].
    pub fn word(&self, index: usize) -> &AtomicU64 {
        assert!(
            index < self.words,
            "shared word {index} of {} words",
            self.words
        );
        // SAFETY: `index < words` and `words * 8 <= mapped`, so the 8 bytes
        // lie inside the mapping, which is page-aligned (hence 8-aligned at
        // every multiple of 8), backed by a memfd that cannot shrink (`map`'s
        // contract) and stays mapped for as long as `&self` lives (unmapped
        // only in `Drop`). This type only ever accesses it through atomics,
        // and any bit pattern is a valid `u64`. (Another process that maps
        // the same memfd may write it any way it likes: it can change the
        // values, never the validity of the memory.)
        unsafe { AtomicU64::from_ptr(self.base.as_ptr().add(index).cast::<u64>()) }
    }

    /// How many words there are.
    pub fn len(&self) -> usize {
        self.words
    }

    /// True when there are none (the mapping is still one page).
    pub fn is_empty(&self) -> bool {
        self.words == 0
    }

    /// The memfd, to hand to another process (which calls
    /// [`SharedWords::open`] with the same number of words).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsFd for SharedWords {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd()
    }
}

impl Drop for SharedWords {
    fn drop(&mut self) {
        // SAFETY: `base` is the start of the `mapped`-byte mapping `map`
        // made for this value (nothing else builds a SharedWords); it is
        // unmapped only here, once, and no reference from `word` outlives
        // `&self`.
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.mapped) };
    }
}

/// Fills `local` with the bytes at `remote_addr..remote_addr + local.len()`
/// in process `pid`'s address space (`process_vm_readv`, looping over short
/// transfers and `EINTR`): the soft provider's copy, on one thread.
///
/// Fails with the OS error where any of the range is not mapped readable in
/// that process (`EFAULT`), the process does not exist (`ESRCH`) or may not
/// be read by us (`EPERM`); `local` may then hold part of the bytes.
///
/// Sound for any arguments: the kernel writes only into `local`, which the
/// caller lends exclusively for the call, and checks every remote address
/// against the target's mappings instead of touching unmapped memory. Any
/// byte is a valid `u8`. (Reading this process's own memory this way is
/// like reading `/proc/self/mem`: the bytes come from outside the language,
/// whoever is writing them.)
pub fn read_process_memory(pid: u32, remote_addr: u64, local: &mut [u8]) -> io::Result<()> {
    /// Bytes per span at most (spans carry u32 lengths).
    const SPAN: usize = 1 << 30;
    let len = local.len();
    if remote_addr.checked_add(len as u64).is_none() {
        return Err(rustix::io::Errno::FAULT.into());
    }
    let spans = |start: u64| -> Vec<memory::Span> {
        (0..len)
            .step_by(SPAN)
            .map(|at| (start + at as u64, SPAN.min(len - at) as u32))
            .collect()
    };
    let remote = spans(remote_addr);
    let local_spans = spans(local.as_mut_ptr() as u64);
    // SAFETY: the local spans cover exactly `local`, derived from the
    // caller's exclusive borrow, which nothing else can use during the call
    // and which this function does not touch until the call returns (as
    // std's `read` into a `&mut [u8]`): writable memory of this process, for
    // the whole call, that no other reference reads or writes meanwhile.
    // Any bytes are a valid `[u8]`, whatever the kernel wrote.
    unsafe { memory::read_from(pid, &remote, &local_spans) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn words_are_shared_between_two_mappings_of_one_memfd() {
        let words = SharedWords::create(600).unwrap();
        assert_eq!(words.len(), 600);
        let other = SharedWords::open(words.fd().try_clone_to_owned().unwrap(), 600).unwrap();
        other.word(599).store(42, Ordering::Release);
        assert_eq!(words.word(599).load(Ordering::Acquire), 42);
        assert_eq!(words.word(0).load(Ordering::Acquire), 0, "zeroed");
    }

    #[test]
    fn a_memfd_of_another_size_or_without_seals_is_refused() {
        let words = SharedWords::create(2).unwrap();
        let error = SharedWords::open(words.fd().try_clone_to_owned().unwrap(), 1000).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidData, "{error}");
        let (socket, _) = std::os::unix::net::UnixStream::pair().unwrap();
        let error = SharedWords::open(OwnedFd::from(socket), 1).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidData, "{error}");
    }

    #[test]
    #[should_panic(expected = "shared word 2 of 2 words")]
    fn a_word_past_the_end_panics() {
        let words = SharedWords::create(2).unwrap();
        words.word(2);
    }

    #[test]
    fn reads_memory_and_reports_bad_addresses() {
        let source: Vec<u8> = (0..10_000).map(|i| (i % 251) as u8).collect();
        let mut copy = vec![0u8; source.len()];
        read_process_memory(std::process::id(), source.as_ptr() as u64, &mut copy).unwrap();
        assert_eq!(copy, source);
        let error = read_process_memory(std::process::id(), 8, &mut copy).unwrap_err();
        assert_eq!(
            error.raw_os_error(),
            Some(rustix::io::Errno::FAULT.raw_os_error())
        );
        let error = read_process_memory(std::process::id(), u64::MAX - 4, &mut copy).unwrap_err();
        assert_eq!(
            error.raw_os_error(),
            Some(rustix::io::Errno::FAULT.raw_os_error())
        );
        read_process_memory(std::process::id(), 8, &mut []).unwrap();
    }
}
