//! One RDMA connection without a driver task: its state sits behind one lock
//! and is turned by whichever task needs progress, quinn-style.
//!
//! - The application's **stream** ([`io::RdmaStream`]) polls the CQ in
//!   batches, re-posts receives, carries out what the protocol asks and hands
//!   frames up, all inside its own `poll_next`: a response is decoded by the
//!   task that waits for frames, with no task or channel in between.
//! - The application's **sink** ([`io::RdmaSink`]) gives frames to the
//!   protocol in `start_send` and posts them (one doorbell per flush) in
//!   `poll_flush`, from the task that sends.
//! - A **housekeeper** future ([`keeper`]) does only what no message
//!   triggers: timers (rendezvous time-outs, giving back idle credits, the
//!   linger of a closed connection), the set-up socket (the peer's close
//!   reason, its EOF as the liveness signal), waits for the server's receive
//!   budget, and the end of the connection (the QP to ERROR, the CQ drained,
//!   the reason told to the peer).
//!
//! Whoever waits arms the CQ, turns once more (a completion that slipped in
//! before the arming raises no event) and registers on the completion
//! channel. The channel's readiness wakes the stream and the sink when they
//! wait ([`Wakers`]), since tokio keeps one waker per readiness; the
//! housekeeper only once the application is gone.

mod expose;
pub(crate) mod io;
mod keeper;
pub(crate) mod state;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;
use rpc_core::transport::{Connection, ConnectionBudget};

use crate::config::RdmaConfig;
use crate::device::Device;
use crate::protocol::Protocol;
use crate::setup_socket::SetupSocket;
use crate::verbs::{AsyncCompletionChannel, CmConnection};

use state::LinkState;
pub(crate) use state::{Commitment, Endpoint};

/// A connection with no traffic for this long gives back the credits it
/// holds beyond the peer's initial ones.
pub(crate) const CREDIT_RETURN_IDLE: std::time::Duration = std::time::Duration::from_millis(100);

/// The tasks that wait on one connection. The completion channel's readiness
/// wakes all of them; a turn that changes what one waits for wakes it.
#[derive(Default)]
pub(crate) struct Wakers {
    /// The application's stream, waiting for frames.
    reader: AtomicWaker,
    /// The application's sink, waiting for the protocol to take a frame.
    writer: AtomicWaker,
    /// The housekeeper: woken by a turn that makes it due, and by the
    /// channel only once the application is gone (before that, completions
    /// are the stream's and the sink's to take, and a time-out they bring
    /// closer makes the housekeeper due).
    keeper: AtomicWaker,
    /// The application is gone: the housekeeper waits on the channel.
    keeper_on_channel: AtomicBool,
}

impl Wake for Wakers {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.reader.wake();
        self.writer.wake();
        if self.keeper_on_channel.load(Ordering::Acquire) {
            self.keeper.wake();
        }
    }
}

/// Wakes every task of a connection, the housekeeper included: what the
/// device's bound on rendezvous memory wakes once it has room for a pull or
/// a frame of ours that waits (whoever turns next takes it).
struct EveryTask(Arc<Wakers>);

impl Wake for EveryTask {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.reader.wake();
        self.0.writer.wake();
        self.0.keeper.wake();
    }
}

/// Which task turned the connection (so it wakes the others, not itself).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Poller {
    Reader,
    Writer,
    Keeper,
}

/// What the sink, the stream and the housekeeper share.
/// `rdma://` connections alive in this process (each holds its QP's file
/// descriptors): what the listener's descriptor check counts.
static LIVE_LINKS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Connections alive in this process.
pub(crate) fn live_links() -> usize {
    LIVE_LINKS.load(std::sync::atomic::Ordering::Relaxed)
}

/// One live connection, counted while it lives.
struct Alive;

impl Alive {
    fn new() -> Alive {
        LIVE_LINKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Alive
    }
}

impl Drop for Alive {
    fn drop(&mut self) {
        LIVE_LINKS.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

pub(crate) struct Link {
    /// Counted among [`live_links`] (declared first: dropped with the QP).
    _alive: Alive,
    state: Mutex<LinkState>,
    channel: AsyncCompletionChannel,
    wakers: Arc<Wakers>,
    /// Wakes every waiter: what the completion channel is polled with.
    everyone: Waker,
}

impl Link {
    fn lock(&self) -> MutexGuard<'_, LinkState> {
        self.state
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// Waits for completion events (already got and acknowledged when this
    /// returns `Ready`). The caller registered its own waker and armed the CQ.
    fn poll_channel(&self) -> Poll<()> {
        let mut cx = Context::from_waker(&self.everyone);
        match self.channel.poll_events(&mut cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(_)) => Poll::Ready(()),
            Poll::Ready(Err(error)) => {
                self.lock().fail(format!("completion channel: {error}"));
                self.wakers.keeper.wake();
                Poll::Ready(())
            }
        }
    }

    /// After a turn that made no progress: the housekeeper may still have
    /// become due (a credit window grew, a time-out came closer).
    fn wake_keeper_if_due(&self, state: &mut LinkState) {
        if std::mem::take(&mut state.keeper_due) {
            self.wakers.keeper.wake();
        }
    }

    /// After `who` turned the connection: wakes whoever has something new.
    fn wake_others(&self, state: &mut LinkState, who: Poller) {
        if std::mem::take(&mut state.keeper_due) && who != Poller::Keeper {
            self.wakers.keeper.wake();
        }
        if who != Poller::Reader && std::mem::take(&mut state.received) {
            self.wakers.reader.wake();
        }
        if who != Poller::Writer && !state.has_stashed() {
            self.wakers.writer.wake();
        }
    }
}

/// Starts an established connection: the state behind its lock, the
/// housekeeper, and the application's sink and stream.
#[allow(clippy::too_many_arguments)]
pub(crate) fn start(
    endpoint: Endpoint,
    cm: Option<CmConnection>,
    device: Arc<Device>,
    protocol: Protocol,
    config: &RdmaConfig,
    socket: SetupSocket,
    budget: Option<ConnectionBudget>,
    peer: String,
) -> Connection {
    let Endpoint {
        queue,
        channel,
        commitment,
    } = endpoint;
    device.keep_pool_trimmed();
    let mut state = LinkState::new(queue, commitment, cm, device, protocol, config, budget);
    let wakers = Arc::new(Wakers::default());
    state.budget_waker = Waker::from(Arc::new(EveryTask(wakers.clone())));
    let link = Arc::new(Link {
        _alive: Alive::new(),
        state: Mutex::new(state),
        channel,
        everyone: Waker::from(wakers.clone()),
        wakers,
    });
    tokio::spawn(keeper::run(link.clone(), socket));
    Connection {
        sink: Box::pin(io::RdmaSink::new(link.clone())),
        stream: Box::pin(io::RdmaStream::new(
            link,
            config.poll_mode,
            tokio::task::yield_now,
        )),
        peer,
    }
}
