//! [`Corked`]: a connection's writes held back while its task takes a burst
//! of calls, then sent with one system call.
//!
//! h2 flushes its connection every time it is polled: a server task that
//! takes one call, answers it and polls h2 for the next would write (and
//! push through TCP) once per call. tonic's server does not, because its
//! calls run in tasks of their own after h2 has taken every call that
//! arrived. This task answers calls as it takes them, so it corks the socket
//! instead: from a call taken until h2 has no more calls to hand over, what
//! h2 writes is kept here, and goes out whenever about [`CORK_LIMIT`] has
//! gathered; then the task uncorks and sends the rest with one write.
//!
//! The limit is small on purpose. A whole burst's answers in one write
//! (64 KiB at first) saved the server a little CPU but made the client's
//! answers arrive all at once: tonic's client on a multi-thread runtime
//! then wakes a hundred callers together, across its workers, and spent
//! 2-3 µs more per call (measured with `grpc_cpu`, 128 calls in flight:
//! 52-57 k calls/s with 64 KiB, 4 KiB 59-61 k, 512 B to 2 KiB 63-67 k, no
//! cork 62-66 k at 0.8 µs more server CPU per call; current-thread runtimes
//! 85-88 k with 64 KiB, 100-102 k with 1 KiB). At 16 calls in flight even
//! 1 KiB held too much (alternated `grpc_cpu` rounds, calls/s, limits 0 /
//! 256 B / 512 B / 1 KiB: current-thread 87-88 k / 85-87 k / 75-83 k /
//! 70-73 k; multi-thread 37 k / 38-39 k / 39 k / 35-37 k), while at 128 in
//! flight 256 B was as good as 1 KiB (current-thread 84-95 k against
//! 92-98 k, multi-thread 55-59 k against 56-60 k; no cork 51-52 k): about
//! two small answers.

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, ready};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes kept while corked at most (about two small answers): a write
/// beyond it goes out (after what is kept) at once.
pub(crate) const CORK_LIMIT: usize = 256;

/// The I/O and what was written to it while corked.
struct CorkState<T> {
    io: T,
    corked: bool,
    held: BytesMut,
}

impl<T: AsyncWrite + Unpin> CorkState<T> {
    /// Writes what is held.
    fn poll_write_held(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.held.is_empty() {
            let written = ready!(Pin::new(&mut self.io).poll_write(cx, &self.held))?;
            if written == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.held.advance(written);
        }
        Poll::Ready(Ok(()))
    }
}

/// The I/O h2 drives (see the module docs); [`Cork`] is the connection
/// task's handle on it.
pub(crate) struct Corked<T> {
    state: Arc<Mutex<CorkState<T>>>,
}

/// Corks and uncorks a [`Corked`] I/O, and sends what it holds when the
/// connection ends.
pub(crate) struct Cork<T> {
    state: Arc<Mutex<CorkState<T>>>,
}

fn lock<T>(state: &Mutex<CorkState<T>>) -> MutexGuard<'_, CorkState<T>> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `io`, uncorked, and the handle that corks it.
pub(crate) fn corked<T>(io: T) -> (Corked<T>, Cork<T>) {
    let state = Arc::new(Mutex::new(CorkState {
        io,
        corked: false,
        held: BytesMut::new(),
    }));
    (
        Corked {
            state: state.clone(),
        },
        Cork { state },
    )
}

impl<T: AsyncWrite + Unpin> Cork<T> {
    /// Holds writes back from now on.
    pub(crate) fn cork(&self) {
        lock(&self.state).corked = true;
    }

    /// Whether writes are held back.
    pub(crate) fn is_corked(&self) -> bool {
        lock(&self.state).corked
    }

    /// Lets writes through again; what is held goes with the next write
    /// or flush.
    pub(crate) fn uncork(&self) {
        lock(&self.state).corked = false;
    }

    /// Uncorks and starts writing what is held, in the caller's task: h2
    /// has flushed already (into the cork), so nothing else would. What
    /// the socket does not take now goes with h2's next write or flush,
    /// which the caller's waker (registered here) brings about; an error
    /// is left for h2 to meet on its next use of the socket.
    pub(crate) fn uncork_and_send(&self, cx: &mut Context<'_>) {
        let mut state = lock(&self.state);
        state.corked = false;
        if let Poll::Ready(Ok(())) = state.poll_write_held(cx) {
            let _ = Pin::new(&mut state.io).poll_flush(cx);
        }
    }

    /// Uncorks and writes what is held (the connection is ending: h2 will
    /// not flush again).
    pub(crate) async fn finish(&self) -> io::Result<()> {
        self.uncork();
        std::future::poll_fn(|cx| {
            let mut state = lock(&self.state);
            ready!(state.poll_write_held(cx))?;
            Pin::new(&mut state.io).poll_flush(cx)
        })
        .await
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Corked<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut lock(&self.state).io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Corked<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let mut state = lock(&self.state);
        let len: usize = bufs.iter().map(|buf| buf.len()).sum();
        if state.corked && state.held.len() + len <= CORK_LIMIT {
            for buf in bufs {
                state.held.extend_from_slice(buf);
            }
            return Poll::Ready(Ok(len));
        }
        // What is held goes first, then this write as it is.
        ready!(state.poll_write_held(cx))?;
        Pin::new(&mut state.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        // Vectored writes are taken whole while corked; uncorked they go to
        // the I/O, which writes what it can of them.
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut state = lock(&self.state);
        if state.corked {
            return Poll::Ready(Ok(()));
        }
        ready!(state.poll_write_held(cx))?;
        Pin::new(&mut state.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut state = lock(&self.state);
        ready!(state.poll_write_held(cx))?;
        Pin::new(&mut state.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn corked_writes_wait_for_the_uncorked_flush_and_keep_their_order() {
        let (near, mut far) = tokio::io::duplex(1 << 20);
        let (mut io, cork) = corked(near);
        io.write_all(b"one ").await.unwrap();
        io.flush().await.unwrap();
        cork.cork();
        io.write_all(b"two ").await.unwrap();
        io.write_all(b"three ").await.unwrap();
        io.flush().await.unwrap();
        let mut got = vec![0u8; 64];
        let n = far.read(&mut got).await.unwrap();
        assert_eq!(&got[..n], b"one ", "nothing corked went out");
        cork.uncork();
        io.write_all(b"four").await.unwrap();
        io.flush().await.unwrap();
        let mut rest = vec![0u8; 14];
        far.read_exact(&mut rest).await.unwrap();
        assert_eq!(&rest, b"two three four", "held bytes first, in order");
    }

    #[tokio::test]
    async fn a_write_past_the_limit_goes_out_with_what_was_held() {
        let (near, mut far) = tokio::io::duplex(1 << 20);
        let (mut io, cork) = corked(near);
        cork.cork();
        io.write_all(b"held").await.unwrap();
        let big = vec![7u8; CORK_LIMIT];
        io.write_all(&big).await.unwrap();
        assert!(cork.is_corked());
        let mut got = vec![0u8; 4 + CORK_LIMIT];
        far.read_exact(&mut got).await.unwrap();
        assert_eq!(&got[..4], b"held");
        assert!(got[4..].iter().all(|&b| b == 7));
    }

    #[tokio::test]
    async fn small_answers_leave_about_every_cork_limit_while_corked() {
        let (near, mut far) = tokio::io::duplex(1 << 20);
        let (mut io, cork) = corked(near);
        cork.cork();
        let answer = [5u8; 100];
        // The write that would take the held bytes past the limit goes out
        // with them.
        let answers = CORK_LIMIT / answer.len() + 1;
        for _ in 0..answers {
            io.write_all(&answer).await.unwrap();
        }
        io.write_all(b"next").await.unwrap();
        io.flush().await.unwrap();
        assert!(cork.is_corked());
        // A client is not kept waiting for the whole burst.
        let mut got = vec![0u8; answers * answer.len()];
        far.read_exact(&mut got).await.unwrap();
        assert!(got.iter().all(|&b| b == 5));
        assert_eq!(
            &lock(&cork.state).held[..],
            b"next",
            "what came after is held"
        );
    }

    #[tokio::test]
    async fn uncork_and_send_writes_what_is_held_without_another_flush() {
        let (near, mut far) = tokio::io::duplex(1 << 20);
        let (mut io, cork) = corked(near);
        cork.cork();
        io.write_all(b"burst").await.unwrap();
        io.flush().await.unwrap();
        std::future::poll_fn(|cx| {
            cork.uncork_and_send(cx);
            Poll::Ready(())
        })
        .await;
        assert!(!cork.is_corked());
        let mut got = vec![0u8; 5];
        far.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"burst");
    }

    #[tokio::test]
    async fn finish_sends_what_is_held_when_h2_will_not_flush_again() {
        let (near, mut far) = tokio::io::duplex(1 << 20);
        let (mut io, cork) = corked(near);
        cork.cork();
        io.write_all(b"last answer").await.unwrap();
        io.flush().await.unwrap();
        drop(io);
        cork.finish().await.unwrap();
        let mut got = vec![0u8; 11];
        far.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"last answer");
    }
}
