//! Moving bytes between address spaces without the network stack:
//! `process_vm_readv` from the peer into our own memory (a process only ever
//! writes its own memory; also on our own pid for addresses no region check
//! vouches for, such as inline data, where it turns a bad address into
//! `EFAULT` instead of a crash), and plain copies for spans already checked
//! against registered regions.

use std::io;

/// A range of a process's memory: (address, length).
pub(crate) type Span = (u64, u32);

fn to_iovecs(spans: &[Span]) -> Vec<libc::iovec> {
    spans
        .iter()
        .filter(|(_, len)| *len > 0)
        .map(|&(addr, len)| libc::iovec {
            iov_base: addr as usize as *mut libc::c_void,
            iov_len: len as usize,
        })
        .collect()
}

/// The bytes `spans` cover.
pub(crate) fn total(spans: &[Span]) -> usize {
    spans.iter().map(|(_, len)| *len as usize).sum()
}

/// Drops the first `n` bytes of `iovecs`.
fn advance(iovecs: &mut Vec<libc::iovec>, mut n: usize) {
    let mut consumed = 0;
    for iov in iovecs.iter_mut() {
        if n == 0 {
            break;
        }
        if n >= iov.iov_len {
            n -= iov.iov_len;
            consumed += 1;
        } else {
            iov.iov_base = (iov.iov_base as usize + n) as *mut libc::c_void;
            iov.iov_len -= n;
            n = 0;
        }
    }
    iovecs.drain(..consumed);
}

/// Copies `remote` (in process `pid`) into `local` (ours) with
/// `process_vm_readv`. Lengths must match. The soft provider only ever
/// moves bytes this way across processes: each process writes its own
/// memory, never another's.
///
/// The remote side needs no promise: the kernel checks every remote
/// address against `pid`'s mappings and fails with `EFAULT` (or `ESRCH`,
/// `EPERM`) instead of touching anything else; the bytes are only read.
///
/// # Safety
/// Every `local` span is written, by the kernel, behind the compiler's back.
/// For the whole call each one must be memory of this process that is valid
/// for writes of its whole length (a span the kernel finds unmapped fails
/// the call with `EFAULT`, but one that is mapped is written whatever it
/// holds), and nothing may read or write it meanwhile through a Rust
/// reference (nor hold one to it across the call). On error, any prefix
/// of the local bytes may have been written.
pub(crate) unsafe fn read_from(pid: u32, remote: &[Span], local: &[Span]) -> io::Result<()> {
    let len = total(local);
    if len != total(remote) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "scatter/gather lengths differ",
        ));
    }
    let mut local = to_iovecs(local);
    let mut remote = to_iovecs(remote);
    let mut done = 0;
    while done < len {
        let local_count = local.len().min(libc::UIO_MAXIOV as usize);
        let remote_count = remote.len().min(libc::UIO_MAXIOV as usize);
        // SAFETY: `local` and `remote` are live Vecs of iovecs, and the
        // counts passed are at most their lengths. The local iovecs cover
        // only bytes of the caller's `local` spans not written yet (`advance`
        // drops what is done), which our caller guarantees writable and
        // unobserved for this call. Remote addresses need nothing of us: the
        // kernel checks them against `pid`'s mappings and only reads them.
        let moved = unsafe {
            libc::process_vm_readv(
                pid as libc::pid_t,
                local.as_ptr(),
                local_count as libc::c_ulong,
                remote.as_ptr(),
                remote_count as libc::c_ulong,
                0,
            )
        };
        if moved < 0 {
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(error);
        }
        if moved == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "process_vm transfer made no progress",
            ));
        }
        let moved = moved as usize;
        done += moved;
        advance(&mut local, moved);
        advance(&mut remote, moved);
    }
    Ok(())
}

/// Reads our own memory into a new buffer (inline sends). Any `spans` are
/// fine: the kernel reads them (an unmapped one fails with `EFAULT`
/// instead of crashing), and the only memory written is the new buffer.
pub(crate) fn gather_own(spans: &[Span]) -> io::Result<Vec<u8>> {
    let mut out = vec![0u8; total(spans)];
    let dst = [(out.as_mut_ptr() as u64, out.len() as u32)];
    // SAFETY: the one local span is the start of `out` and no longer than it
    // (`as u32` can only shorten it), a buffer this function just allocated
    // and neither reads nor borrows until the call returns. (`spans` are the
    // remote side: only read, and checked by the kernel.)
    unsafe { read_from(std::process::id(), spans, &dst) }?;
    Ok(out)
}

/// Copies `bytes` into our own memory `spans`, in order, with plain memory
/// copies (no system call): the small-message fast path, for spans already
/// checked against registered regions.
///
/// # Safety
/// Every span must be writable memory of this process for its whole length,
/// kept valid for the call (inside a registered region that cannot be
/// deregistered meanwhile), and must not overlap `bytes`. The spans must hold
/// at least `bytes.len()` bytes.
pub(crate) unsafe fn copy_into_spans(bytes: &[u8], spans: &[Span]) {
    let mut at = 0;
    for &(addr, len) in spans {
        let n = (len as usize).min(bytes.len() - at);
        if n == 0 {
            break;
        }
        // SAFETY: the caller vouches for [addr, addr + len) being valid for
        // writes and disjoint from `bytes`; n ≤ len and n ≤ what is left.
        unsafe { std::ptr::copy_nonoverlapping(bytes[at..].as_ptr(), addr as usize as *mut u8, n) };
        at += n;
    }
    debug_assert_eq!(at, bytes.len(), "spans shorter than the bytes");
}

/// Appends the bytes of our own memory `spans` to `out`, with plain memory
/// copies (no system call).
///
/// # Safety
/// Every span must be readable memory of this process for its whole length,
/// kept valid for the call (inside a registered region that cannot be
/// deregistered meanwhile), and must not overlap `out`'s buffer.
pub(crate) unsafe fn copy_from_spans(spans: &[Span], out: &mut Vec<u8>) {
    for &(addr, len) in spans {
        // SAFETY: the caller vouches for [addr, addr + len) being valid for
        // reads for the call and disjoint from `out`'s buffer (which
        // `extend_from_slice` writes, and may move, while the slice lives).
        let source =
            unsafe { std::slice::from_raw_parts(addr as usize as *const u8, len as usize) };
        out.extend_from_slice(source);
    }
}

/// The first `len` bytes of `spans`.
pub(crate) fn truncate(spans: &[Span], len: usize) -> Vec<Span> {
    slice(spans, 0, len)
}

/// The `len` bytes of `spans` from byte `start` on (fewer where they end).
pub(crate) fn slice(spans: &[Span], mut start: usize, mut len: usize) -> Vec<Span> {
    let mut out = Vec::new();
    for &(addr, span_len) in spans {
        if len == 0 {
            break;
        }
        let span_len = span_len as usize;
        if start >= span_len {
            start -= span_len;
            continue;
        }
        let take = (span_len - start).min(len);
        out.push((addr + start as u64, take as u32));
        len -= take;
        start = 0;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scatter_gather_between_uneven_lists() {
        let src: Vec<u8> = (0..100u8).collect();
        let mut a = [0u8; 30];
        let mut b = [0u8; 70];
        let local = [(a.as_mut_ptr() as u64, 30), (b.as_mut_ptr() as u64, 70)];
        let remote = [(src.as_ptr() as u64, 10), (src.as_ptr() as u64 + 10, 90)];
        // SAFETY: the local spans are exactly the arrays `a` and `b`, which
        // nothing touches until the call returns.
        unsafe { read_from(std::process::id(), &remote, &local) }.unwrap();
        assert_eq!(&a[..], &src[..30]);
        assert_eq!(&b[..], &src[30..]);
        assert_eq!(gather_own(&remote).unwrap(), src);
    }

    #[test]
    fn plain_copies_scatter_and_gather_across_uneven_spans() {
        let src: Vec<u8> = (0..100u8).collect();
        let mut a = [0u8; 30];
        let mut b = [0u8; 80];
        let spans = [(a.as_mut_ptr() as u64, 30), (b.as_mut_ptr() as u64, 80)];
        // SAFETY: both spans are live local arrays, disjoint from `src`.
        unsafe { copy_into_spans(&src, &spans) };
        assert_eq!(&a[..], &src[..30]);
        assert_eq!(&b[..70], &src[30..]);
        assert_eq!(&b[70..], &[0u8; 10]);
        let mut out = vec![9u8];
        // SAFETY: both spans are live local arrays, disjoint from `out`'s
        // heap buffer.
        unsafe {
            copy_from_spans(
                &[(a.as_ptr() as u64, 30), (b.as_ptr() as u64, 70)],
                &mut out,
            )
        };
        assert_eq!(out[0], 9);
        assert_eq!(&out[1..], &src[..]);
    }

    #[test]
    fn slices_cut_across_span_boundaries() {
        let spans = [(100, 10), (200, 5), (300, 20)];
        assert_eq!(slice(&spans, 0, 35), spans.to_vec());
        assert_eq!(slice(&spans, 8, 10), vec![(108, 2), (200, 5), (300, 3)]);
        assert_eq!(slice(&spans, 15, 4), vec![(300, 4)]);
        assert_eq!(slice(&spans, 30, 100), vec![(315, 5)]);
        assert_eq!(slice(&spans, 35, 1), vec![]);
        assert_eq!(truncate(&spans, 12), vec![(100, 10), (200, 2)]);
    }

    #[test]
    fn bad_addresses_fail_instead_of_crashing() {
        let mut dst = [0u8; 8];
        // SAFETY: the local span is exactly the array `dst`, which nothing
        // touches until the call returns.
        let err = unsafe {
            read_from(
                std::process::id(),
                &[(8, 8)],
                &[(dst.as_mut_ptr() as u64, 8)],
            )
        }
        .unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EFAULT));
    }
}
