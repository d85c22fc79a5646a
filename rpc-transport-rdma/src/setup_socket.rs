//! The set-up connection a driver keeps after the hellos: EOF on it means
//! the peer is gone, and a side that closes on an error writes its reason
//! there first. Plain TCP for `rdma://`; TLS for a transport configured with
//! [`crate::RdmaTransport::with_tls`] (feature `tls`).

use std::future::poll_fn;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// What one read of the set-up socket found.
pub(crate) enum SocketRead {
    /// Bytes, appended to the caller's buffer (up to its bound; the rest dropped).
    Data,
    /// The peer closed it (EOF).
    Eof,
    /// It broke.
    Failed(std::io::Error),
}

/// The set-up connection of an established RDMA connection.
pub(crate) enum SetupSocket {
    /// `rdma://`: the TCP connection itself.
    Plain(TcpStream),
    /// `rdma+tls://`: the same connection inside TLS.
    #[cfg(feature = "tls")]
    Tls(Box<rpc_core::transport::tls::tokio_rustls::TlsStream<TcpStream>>),
}

impl SetupSocket {
    /// Reads what is there into `into` (bytes beyond `limit` are dropped: a
    /// close reason is bounded); registers `cx` when there is nothing.
    pub(crate) fn poll_read_into(
        &mut self,
        cx: &mut Context<'_>,
        into: &mut Vec<u8>,
        limit: usize,
    ) -> Poll<SocketRead> {
        let mut buffer = [0u8; 1024];
        let mut read = ReadBuf::new(&mut buffer);
        match Pin::new(&mut *self).poll_read(cx, &mut read) {
            Poll::Pending => Poll::Pending,
            // TLS reports a peer that closed without a close_notify (any
            // process that exits) this way: for the liveness signal it is
            // the same EOF as over plain TCP.
            Poll::Ready(Err(error)) if error.kind() == std::io::ErrorKind::UnexpectedEof => {
                Poll::Ready(SocketRead::Eof)
            }
            Poll::Ready(Err(error)) => Poll::Ready(SocketRead::Failed(error)),
            Poll::Ready(Ok(())) if read.filled().is_empty() => Poll::Ready(SocketRead::Eof),
            Poll::Ready(Ok(())) => Poll::Ready(append_bounded(into, read.filled(), limit)),
        }
    }

    /// Waits for the next read.
    pub(crate) async fn read_into(&mut self, into: &mut Vec<u8>, limit: usize) -> SocketRead {
        poll_fn(|cx| self.poll_read_into(cx, into, limit)).await
    }

    /// Best effort, never waits: writes `bytes` (a close reason, small enough
    /// for an idle socket's buffer) and flushes.
    pub(crate) fn write_now(&mut self, bytes: &[u8]) {
        match self {
            SetupSocket::Plain(stream) => {
                let _ = stream.try_write(bytes);
            }
            #[cfg(feature = "tls")]
            SetupSocket::Tls(stream) => {
                let mut cx = Context::from_waker(std::task::Waker::noop());
                let mut stream = Pin::new(stream.as_mut());
                let _ = stream.as_mut().poll_write(&mut cx, bytes);
                let _ = stream.as_mut().poll_flush(&mut cx);
            }
        }
    }
}

/// Appends what fits of `bytes` to `into` under `limit` bytes in all (a
/// close reason is bounded; the rest is dropped).
fn append_bounded(into: &mut Vec<u8>, bytes: &[u8], limit: usize) -> SocketRead {
    let room = limit.saturating_sub(into.len());
    into.extend_from_slice(&bytes[..bytes.len().min(room)]);
    SocketRead::Data
}

impl From<TcpStream> for SetupSocket {
    fn from(stream: TcpStream) -> SetupSocket {
        SetupSocket::Plain(stream)
    }
}

impl AsyncRead for SetupSocket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            SetupSocket::Plain(stream) => Pin::new(stream).poll_read(cx, buf),
            #[cfg(feature = "tls")]
            SetupSocket::Tls(stream) => Pin::new(stream.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for SetupSocket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            SetupSocket::Plain(stream) => Pin::new(stream).poll_write(cx, buf),
            #[cfg(feature = "tls")]
            SetupSocket::Tls(stream) => Pin::new(stream.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            SetupSocket::Plain(stream) => Pin::new(stream).poll_flush(cx),
            #[cfg(feature = "tls")]
            SetupSocket::Tls(stream) => Pin::new(stream.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            SetupSocket::Plain(stream) => Pin::new(stream).poll_shutdown(cx),
            #[cfg(feature = "tls")]
            SetupSocket::Tls(stream) => Pin::new(stream.as_mut()).poll_shutdown(cx),
        }
    }
}
