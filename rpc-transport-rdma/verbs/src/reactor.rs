//! A completion channel registered with tokio's reactor.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use tokio::io::unix::AsyncFd;

use super::{CompletionChannel, VerbsError};

/// Keeps the channel (and so its fd) alive for as long as tokio watches the fd.
struct ChannelFd(Arc<dyn CompletionChannel>);

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.fd()
    }
}

/// A [`CompletionChannel`] whose fd is registered with the current tokio
/// runtime. [`AsyncCompletionChannel::poll_events`] resolves once at least one
/// event arrived, after getting and acknowledging every pending event (the
/// caller then re-arms its CQs and polls them empty).
pub struct AsyncCompletionChannel {
    fd: AsyncFd<ChannelFd>,
    channel: Arc<dyn CompletionChannel>,
}

impl std::fmt::Debug for AsyncCompletionChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncCompletionChannel")
            .field("fd", &self.channel.fd())
            .finish()
    }
}

impl AsyncCompletionChannel {
    /// Registers `channel`'s fd for readability. Must run inside a tokio runtime.
    pub fn new(channel: Arc<dyn CompletionChannel>) -> io::Result<AsyncCompletionChannel> {
        // SAFETY: `ChannelFd` owns a clone of the channel, so the fd it returns
        // stays open for the AsyncFd's whole life; a provider's `fd()` returns
        // the same descriptor on every call (the CompletionChannel contract).
        let fd = unsafe { AsyncFd::register(ChannelFd(channel.clone())) }
            .map_err(|error| error.into_parts().1)?;
        Ok(AsyncCompletionChannel { fd, channel })
    }

    /// Ready once events came in; they are already got and acknowledged.
    /// Returns how many.
    pub fn poll_events(&self, cx: &mut Context<'_>) -> Poll<Result<u32, VerbsError>> {
        loop {
            let mut guard = ready!(self.fd.poll_read_ready(cx)).map_err(VerbsError::Io)?;
            // Events per CQ: most channels serve one CQ, so the first one's
            // count needs no allocation (this runs once per wake-up).
            let mut first: Option<(u32, u32)> = None;
            let mut others: Vec<(u32, u32)> = Vec::new();
            while let Some(cq) = self.channel.get_event()? {
                match &mut first {
                    None => first = Some((cq, 1)),
                    Some((id, count)) if *id == cq => *count += 1,
                    Some(_) => match others.iter_mut().find(|(id, _)| *id == cq) {
                        Some((_, count)) => *count += 1,
                        None => others.push((cq, 1)),
                    },
                }
            }
            guard.clear_ready();
            if let Some(first) = first {
                let mut total = 0;
                for (cq, count) in std::iter::once(first).chain(others) {
                    self.channel.ack_events(cq, count);
                    total += count;
                }
                return Poll::Ready(Ok(total));
            }
        }
    }
}
