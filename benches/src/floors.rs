//! The physical floors: what the machine itself can do, measured the same way
//! as the soft provider, so the table shows how far above them we are.
//!
//! This module needs raw OS primitives (eventfd, a shared mapping,
//! process_vm_readv) that the library wraps only inside `verbs/`; the unsafe
//! blocks here are confined to those calls, each with its SAFETY note.

#![allow(unsafe_code)]

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};

/// An eventfd, inheritable by a child process (no CLOEXEC).
pub fn eventfd_inheritable() -> io::Result<RawFd> {
    // SAFETY: no pointers; a negative return is an error.
    let fd = unsafe { libc::eventfd(0, 0) };
    if fd < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(fd)
    }
}

/// Blocks until the eventfd counter is non-zero, and resets it.
pub fn eventfd_wait(fd: RawFd) -> io::Result<u64> {
    let mut value = 0u64;
    // SAFETY: reads 8 bytes into a live u64.
    let n = unsafe { libc::read(fd, (&mut value as *mut u64).cast(), 8) };
    if n == 8 {
        Ok(value)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Adds one to the eventfd counter, waking a reader.
pub fn eventfd_signal(fd: RawFd) -> io::Result<()> {
    let one = 1u64;
    // SAFETY: writes 8 bytes from a live u64.
    let n = unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
    if n == 8 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// One page of memory shared with a child process (memfd, inheritable), seen as two counters.
pub struct SharedPage {
    fd: RawFd,
    page: *mut AtomicU64,
}

// SAFETY: the page is only accessed through atomics.
unsafe impl Send for SharedPage {}

impl SharedPage {
    /// Creates the memfd and maps it.
    pub fn create() -> io::Result<SharedPage> {
        let name = c"rdma-rpc-floor";
        // SAFETY: a valid NUL-terminated name; no CLOEXEC so a child inherits it.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: resizing our own new memfd.
        if unsafe { libc::ftruncate(fd, 4096) } != 0 {
            return Err(io::Error::last_os_error());
        }
        SharedPage::map(fd)
    }

    /// Maps an inherited memfd.
    pub fn map(fd: RawFd) -> io::Result<SharedPage> {
        // SAFETY: maps one page of a memfd that is at least one page long.
        let page = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if page == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(SharedPage {
            fd,
            page: page.cast(),
        })
    }

    /// The memfd number (to pass to the child).
    pub fn fd(&self) -> RawFd {
        self.fd
    }

    /// Counter `index` (0 or 1).
    pub fn counter(&self, index: usize) -> &AtomicU64 {
        assert!(index < 2);
        // SAFETY: the mapping is 4096 bytes, page-aligned, alive as long as
        // `self`; AtomicU64 has no invalid bit patterns.
        unsafe { &*self.page.add(index * 8) }
    }

    /// Spins until counter `index` equals `value`.
    pub fn spin_until(&self, index: usize, value: u64) {
        while self.counter(index).load(Ordering::Acquire) != value {
            std::hint::spin_loop();
        }
    }
}

/// Copies `len` bytes at `remote` in process `pid` into `local` (one call, looping on short reads).
pub fn process_vm_read(pid: u32, remote: u64, local: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < local.len() {
        let local_iov = libc::iovec {
            iov_base: local[done..].as_mut_ptr().cast(),
            iov_len: local.len() - done,
        };
        let remote_iov = libc::iovec {
            iov_base: (remote as usize + done) as *mut libc::c_void,
            iov_len: local.len() - done,
        };
        // SAFETY: one iovec each, both valid for their lengths in their processes
        // (the kernel checks the remote one).
        let n =
            unsafe { libc::process_vm_readv(pid as libc::pid_t, &local_iov, 1, &remote_iov, 1, 0) };
        if n <= 0 {
            return Err(io::Error::last_os_error());
        }
        done += n as usize;
    }
    Ok(())
}
