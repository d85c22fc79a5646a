//! The tokio driver of one RDMA connection: a task that owns the queue pair,
//! the completion queue and the pools, feeds completions into the sans-IO
//! [`Protocol`] and carries out what it asks for.
//!
//! The application talks to the task through two channels (frames out, frames
//! in). The task's loop:
//!
//! 1. take outgoing frames while the protocol accepts them (eager ones go to
//!    the protocol; a rendezvous frame's payload is exposed where it lies
//!    behind a REMOTE_READ window of exactly its length, its head rides in the
//!    announcement; a head too long for that is copied with the payload into
//!    a pooled buffer instead);
//! 2. poll the CQ in batches: receives are copied out and their slots
//!    re-posted to the device's shared receive queue at once, send slots
//!    given back to the device's shared send pool, READ chunks accounted;
//! 3. carry out the protocol's events, READs and transmits (posted in
//!    batches); commit more slots of the shared receive pool when the peer
//!    keeps running out of credits, release those it gives back;
//! 4. hand frames up in order, holding credits back while the application lags;
//! 5. when there was nothing to do: keep polling while the [`PollMode`] says
//!    (adaptive: while this connection's recent waits say spinning pays and
//!    the machine has a CPU to spare, see [`crate::spin`]), then arm the CQ,
//!    poll once more (a completion may have slipped in before the arming),
//!    and sleep on the completion channel, the outgoing channel, the set-up
//!    socket and the rendezvous timer.
//!
//! The set-up socket stays open as the liveness signal: EOF means the peer is
//! gone. Before closing on an error, a side writes the reason there (a `u32 LE`
//! length and UTF-8 text), so the peer's calls fail with that reason.
//!
//! A connection idle for [`CREDIT_RETURN_IDLE`] gives back the credits it
//! holds beyond the peer's initial ones (a RETURN message), so the peer's
//! shared pool gets those slots back. When the connection ends, its QP goes
//! to ERROR and its CQ is drained before the QP is destroyed, so every shared
//! slot the device consumed for it comes back to the pools.

use std::collections::HashMap;
use std::future::poll_fn;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use rpc_core::frame::EncodedFrame;
use rpc_core::transport::{ConnectionBudget, Reservation, TransportError};
use tokio::sync::{Notify, mpsc};

#[cfg(feature = "fault-injection")]
use crate::config::Fault;
use crate::config::{PollMode, RdmaConfig};
use crate::device::{Device, SharedPools};
use crate::pool::{LargePool, PooledBuffer};
use crate::protocol::{Body, Event, HEADER_LEN, Inbound, Message, Protocol, Route};
use crate::setup_socket::{SetupSocket, SocketRead};
use crate::spin::SpinPolicy;
use crate::verbs::pooled::{Polled, PolledCompletion, PooledQp, SendSlot};
use crate::verbs::{
    AccessFlags, AsyncCompletionChannel, CmConnection, ExposedBuffer, ExposedBytes, WcOpcode,
    WcStatus, WorkCompletion, pooled::POLL_BATCH,
};

/// A connection with no traffic for this long gives back the credits it
/// holds beyond the peer's initial ones.
pub(crate) const CREDIT_RETURN_IDLE: Duration = Duration::from_millis(100);
/// How long an ending connection waits for the flushed completions of its
/// sends (each one returns a shared send slot).
const DRAIN_WAIT: Duration = Duration::from_millis(100);
/// Longest close reason accepted from the peer.
const MAX_REASON_LEN: usize = 4096;
/// Bytes of the set-up socket kept: a close reason with its length prefix.
const REASON_BUFFER: usize = MAX_REASON_LEN + 4;
/// How long a driver whose application closed the connection waits for the
/// peer to take its last frames (and pull its windows) before it ends the
/// connection anyway: a peer whose queue pair never connected, or that
/// stopped reading, cannot hold a closed connection's resources.
const CLOSE_LINGER: std::time::Duration = std::time::Duration::from_secs(5);
/// Why a connection ended whose peer left without a word.
const PEER_WENT_AWAY: &str = "peer went away (its set-up connection closed)";
/// How long a side whose QP was flushed waits for the peer to say why.
const PEER_REASON_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// A frame of ours the peer may READ until DONE (or the time-out).
enum Exposed {
    /// The application's payload, read where it lies (no copy).
    Payload(ExposedBytes),
    /// A copy of the frame in a pooled buffer.
    Pooled {
        window: ExposedBuffer,
        pool: Arc<LargePool>,
    },
}

impl Exposed {
    /// Revokes the window and frees (or returns) its memory.
    fn release(self) {
        match self {
            Exposed::Payload(window) => {
                // The payload is let go (or leaked if the window stays).
                drop(window.revoke());
            }
            Exposed::Pooled { window, pool } => {
                if let Some(buffer) = window.revoke() {
                    drop(PooledBuffer::restore(buffer, pool));
                }
            }
        }
    }
}

/// What the application's stream half shares with the driver.
#[derive(Debug, Default)]
pub(crate) struct InboundShared {
    /// Frames handed up and not yet taken.
    pub(crate) backlog: AtomicUsize,
    /// Woken when the backlog drops below the limit.
    pub(crate) drained: Notify,
}

/// Slots of the shared receive pool committed to one connection: its peer's
/// credit window. Released when dropped (after the QP, see [`Driver`]).
pub(crate) struct Commitment {
    pub(crate) pools: Arc<SharedPools>,
    pub(crate) slots: usize,
}

impl Commitment {
    /// Commits `initial` slots (all or nothing).
    pub(crate) fn new(
        pools: Arc<SharedPools>,
        initial: usize,
    ) -> Result<Commitment, crate::verbs::shared::CommitError> {
        let slots = pools.receive.commit(initial, initial)?;
        Ok(Commitment { pools, slots })
    }
}

impl Drop for Commitment {
    fn drop(&mut self) {
        self.pools.receive.release(self.slots);
    }
}

/// A connection's verbs objects, built before set-up.
pub(crate) struct Endpoint {
    pub(crate) queue: PooledQp,
    pub(crate) channel: AsyncCompletionChannel,
    pub(crate) commitment: Commitment,
}

/// The running connection.
pub(crate) struct Driver {
    // Drop order matters: the queue (its QP and CQ, and whatever memory of
    // the pools its requests still hold) goes before the commitment.
    queue: PooledQp,
    /// The rdma_cm connection of the QP, when it was connected through one.
    _cm: Option<CmConnection>,
    channel: AsyncCompletionChannel,
    /// Shared receive slots committed to the peer (released after the QP
    /// is gone), and the pools.
    commitment: Commitment,
    pools: Arc<SharedPools>,
    /// A send slot taken and not used yet (given back before sleeping).
    spare_send: Option<SendSlot>,
    /// The shared send pool had no slot: wait for a completion of our own.
    send_pool_starved: bool,
    /// When an idle connection gives back its extra credits.
    return_at: Option<Instant>,
    /// Frames wait for the peer's credits (counted once per stall).
    credit_stalled: bool,
    exposed: HashMap<u64, Exposed>,
    device: Arc<Device>,
    protocol: Protocol,
    outgoing: mpsc::Receiver<EncodedFrame>,
    outgoing_open: bool,
    stashed: Option<EncodedFrame>,
    inbound: Option<mpsc::UnboundedSender<Result<Bytes, TransportError>>>,
    inbound_shared: Arc<InboundShared>,
    inbound_limit: usize,
    socket: SetupSocket,
    peer_reason: Vec<u8>,
    socket_eof: bool,
    /// How the set-up socket ended, seen while waiting, not yet handled.
    socket_closed: Option<SocketRead>,
    /// The peer closed cleanly and then dropped the set-up socket.
    peer_left: bool,
    /// The set-up socket closed with no reason and no clean close before:
    /// the peer went away (see [`TransportError::PeerGone`]).
    peer_vanished: bool,
    /// When the application dropped both halves (with work still in flight).
    gone_since: Option<Instant>,
    /// The server-wide receive budget (accepted connections of a `Server`):
    /// a rendezvous destination is taken only once its bytes are reserved.
    budget: Option<ConnectionBudget>,
    /// The pull waiting for budget (token, length).
    budget_wait: Option<(u64, u64)>,
    /// A reservation that came in while waiting, for that token.
    budget_ready: Option<(u64, Reservation)>,
    /// Reservations of pulls in progress, attached to their frames when handed up.
    reservations: HashMap<u64, Reservation>,
    /// The failure was a flush or unanswered retries: our QP broke, maybe
    /// because the peer (or its process) is gone.
    flushed: bool,
    poll_mode: PollMode,
    /// The device raises events for solicited SENDs on solicited-only arms.
    solicited_events: bool,
    #[cfg(feature = "fault-injection")]
    fault: Option<Fault>,
    completions: Vec<PolledCompletion>,
}

/// How the driver ended.
enum End {
    /// Both sides closed, or the application left and nothing is in flight.
    Clean,
    /// Something broke; the reason goes to the application and the peer.
    Failed(String),
}

impl Driver {
    /// Builds the driver of an established connection.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        endpoint: Endpoint,
        cm: Option<CmConnection>,
        device: Arc<Device>,
        protocol: Protocol,
        config: &RdmaConfig,
        socket: SetupSocket,
        outgoing: mpsc::Receiver<EncodedFrame>,
        inbound: mpsc::UnboundedSender<Result<Bytes, TransportError>>,
        inbound_shared: Arc<InboundShared>,
        budget: Option<ConnectionBudget>,
    ) -> Driver {
        let Endpoint {
            queue,
            channel,
            commitment,
        } = endpoint;
        let solicited_events = device.context.caps().solicited_events;
        Driver {
            pools: commitment.pools.clone(),
            commitment,
            spare_send: None,
            send_pool_starved: false,
            return_at: None,
            credit_stalled: false,
            queue,
            _cm: cm,
            channel,
            exposed: HashMap::new(),
            device,
            protocol,
            outgoing,
            outgoing_open: true,
            stashed: None,
            inbound: Some(inbound),
            inbound_shared,
            inbound_limit: config.inbound_backlog,
            socket,
            peer_reason: Vec::new(),
            socket_eof: false,
            socket_closed: None,
            peer_left: false,
            peer_vanished: false,
            gone_since: None,
            budget,
            budget_wait: None,
            budget_ready: None,
            reservations: HashMap::new(),
            flushed: false,
            poll_mode: config.poll_mode,
            solicited_events,
            #[cfg(feature = "fault-injection")]
            fault: config.fault,
            completions: Vec::with_capacity(POLL_BATCH),
        }
    }

    /// Runs the connection to its end.
    pub(crate) async fn run(mut self) {
        let end = self.run_until_end().await;
        self.drain().await;
        match end {
            End::Clean => {
                tracing::debug!(qp = self.queue.qp().qp_num(), "rdma connection closed");
            }
            End::Failed(mut reason) => {
                let mut gone = self.peer_vanished;
                if self.flushed {
                    // Our QP broke, maybe because the peer's did: the peer is
                    // about to say why on the set-up socket (or is gone, and
                    // EOF says so). If it says nothing, we say what we saw.
                    match self.await_peer_reason().await {
                        Some(peer_reason) => {
                            reason = format!("peer closed the connection: {peer_reason}");
                        }
                        None if self.socket_eof => {
                            // No reason, and its set-up socket closed: the
                            // peer went away (a process that exits does
                            // this), which ends the connection; no failure.
                            gone = true;
                            reason = PEER_WENT_AWAY.to_owned();
                        }
                        None => self.tell_peer(&reason),
                    }
                } else if !gone {
                    self.tell_peer(&reason);
                }
                tracing::debug!(qp = self.queue.qp().qp_num(), %reason, gone, "rdma connection ended");
                if let Some(inbound) = self.inbound.take() {
                    let error = if gone {
                        TransportError::PeerGone(reason)
                    } else {
                        TransportError::Other(reason.into())
                    };
                    let _ = inbound.send(Err(error));
                }
            }
        }
        // Dropping the driver destroys the QP first, then frees the memory:
        // each buffer's region is deregistered before its bytes go, and no
        // provider touches memory through a key after its deregistration
        // (soft: every write into our memory is ours, made under the region
        // lock with the key checked at that moment), so READs still in
        // flight can't land in a freed or reused buffer.
    }

    async fn run_until_end(&mut self) -> End {
        let mut idle_since: Option<Instant> = None;
        let mut spin = match self.poll_mode {
            PollMode::Adaptive { spin } => SpinPolicy::new(spin),
            _ => SpinPolicy::new(Duration::ZERO),
        };
        loop {
            let progressed = match self.turn() {
                Ok(progressed) => progressed,
                Err(reason) => return End::Failed(reason),
            };
            if let Some(end) = self.ended() {
                return end;
            }
            if progressed {
                self.return_at = None;
                if let Some(since) = idle_since.take() {
                    spin.waited(since.elapsed());
                }
                tokio::task::yield_now().await;
                continue;
            }
            let now = Instant::now();
            let idle = now - *idle_since.get_or_insert(now);
            let spin_left = match self.poll_mode {
                PollMode::Event => false,
                PollMode::BusyPoll => true,
                // Past a few microseconds this also gives the CPU away
                // between polls (two processes on one core ran a 1 MiB echo
                // at 0.8 ms instead of 0.24 without it), and stops spinning
                // when another thread wanted the CPU.
                PollMode::Adaptive { .. } => spin.keep_spinning(idle, now),
            };
            if spin_left {
                tokio::task::yield_now().await;
                continue;
            }
            // Arm, then poll once more: a completion that arrived after the
            // last poll but before the arming raises no event. Every message
            // of the peer is solicited; a completion of our own (a SEND done,
            // a READ landed) only needs to wake us when we wait for one.
            let closing_with_sends_in_flight =
                self.protocol.close_sent() && !self.protocol.sends_idle();
            let solicited_only = self.solicited_events
                && self.queue.reads_in_flight() == 0
                && !self.protocol.send_slots_exhausted()
                && !self.send_pool_starved
                && !closing_with_sends_in_flight;
            if let Err(error) = self.queue.req_notify(solicited_only) {
                return End::Failed(format!("arming the completion queue: {error}"));
            }
            match self.turn() {
                Ok(true) => {
                    if let Some(since) = idle_since.take() {
                        spin.waited(since.elapsed());
                    }
                    continue;
                }
                Ok(false) => {}
                Err(reason) => return End::Failed(reason),
            }
            if let Some(end) = self.ended() {
                return end;
            }
            // Asleep, this connection holds no send slot, and an idle one
            // gives back its extra credits after a while.
            if let Some(slot) = self.spare_send.take() {
                self.queue.put_back(slot);
            }
            if self.return_at.is_none() && self.protocol.excess_credits() > 0 {
                self.return_at = Some(Instant::now() + CREDIT_RETURN_IDLE);
            }
            if let Err(reason) = self.sleep().await {
                return End::Failed(reason);
            }
            // The wait ends when the next turn finds work (the loop's top
            // accounts for it, the time asleep included).
        }
    }

    /// Waits for a completion event, an outgoing frame, the socket, room in
    /// the inbound backlog, or the rendezvous timer.
    async fn sleep(&mut self) -> Result<(), String> {
        let linger = self.gone_since.map(|since| since + CLOSE_LINGER);
        // The application dropped its stream half but may still hold the
        // sink (its writer flushing): look again shortly, as no event says
        // when it lets go.
        let inbound_closed = self
            .inbound
            .as_ref()
            .is_none_or(mpsc::UnboundedSender::is_closed);
        let recheck = (inbound_closed && self.gone_since.is_none())
            .then(|| Instant::now() + std::time::Duration::from_millis(100));
        let timer = [
            self.protocol.poll_timeout(),
            linger,
            recheck,
            self.return_at,
        ]
        .into_iter()
        .flatten()
        .min();
        // Wakes when the application drops its stream half.
        let inbound = self.inbound.clone();
        let mut application_left = std::pin::pin!(async move {
            match inbound {
                Some(inbound) => inbound.closed().await,
                None => std::future::pending().await,
            }
        });
        let sleep = timer.map(|at| tokio::time::sleep_until(at.into()));
        let mut sleep = sleep.map(Box::pin);
        let drained = self.inbound_shared.clone();
        let mut drained = std::pin::pin!(drained.drained.notified());
        poll_fn(|cx| {
            let mut ready = false;
            match self.channel.poll_events(cx) {
                Poll::Ready(Ok(_)) => ready = true,
                Poll::Ready(Err(error)) => {
                    return Poll::Ready(Err(format!("completion channel: {error}")));
                }
                Poll::Pending => {}
            }
            if self.outgoing_open && self.stashed.is_none() {
                if let Poll::Ready(frame) = self.outgoing.poll_recv(cx) {
                    match frame {
                        Some(frame) => self.stashed = Some(frame),
                        None => self.outgoing_open = false,
                    }
                    ready = true;
                }
            }
            if !self.socket_eof && self.socket_closed.is_none() {
                match self
                    .socket
                    .poll_read_into(cx, &mut self.peer_reason, REASON_BUFFER)
                {
                    Poll::Ready(SocketRead::Data) => ready = true,
                    Poll::Ready(closed) => {
                        self.socket_closed = Some(closed);
                        ready = true;
                    }
                    Poll::Pending => {}
                }
            }
            if drained.as_mut().poll(cx).is_ready() {
                ready = true;
            }
            if !inbound_closed && application_left.as_mut().poll(cx).is_ready() {
                ready = true;
            }
            if let (Some((token, len)), None, Some(budget)) =
                (self.budget_wait, &self.budget_ready, self.budget.as_mut())
            {
                match budget.poll_reserve(cx, len as usize) {
                    Poll::Ready(Ok(reservation)) => {
                        self.budget_ready = Some((token, reservation));
                        ready = true;
                    }
                    Poll::Ready(Err(error)) => {
                        return Poll::Ready(Err(format!("receive budget: {error}")));
                    }
                    Poll::Pending => {}
                }
            }
            if let Some(sleep) = sleep.as_mut() {
                if sleep.as_mut().poll(cx).is_ready() {
                    ready = true;
                }
            }
            if ready {
                Poll::Ready(Ok(()))
            } else {
                Poll::Pending
            }
        })
        .await
    }

    /// When the connection is over.
    fn ended(&mut self) -> Option<End> {
        let nothing_in_flight = self.protocol.close_sent()
            && self.protocol.sends_idle()
            && self.protocol.exposed() == 0
            && self.queue.reads_in_flight() == 0;
        if self.protocol.is_finished() || self.peer_left {
            return Some(End::Clean);
        }
        // The application dropped both halves: nobody waits for anything more.
        // (A frame stashed for lack of credits keeps `outgoing_open` set; the
        // channel itself says whether the application still holds its end.)
        let application_gone = (!self.outgoing_open || self.outgoing.is_closed())
            && self
                .inbound
                .as_ref()
                .is_none_or(mpsc::UnboundedSender::is_closed);
        if application_gone && nothing_in_flight {
            return Some(End::Clean);
        }
        if application_gone {
            let since = *self.gone_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= CLOSE_LINGER {
                return Some(End::Failed(format!(
                    "closed by this side; the peer did not take its last frames within {CLOSE_LINGER:?}"
                )));
            }
        }
        None
    }

    /// One round of work; true when anything happened.
    fn turn(&mut self) -> Result<bool, String> {
        let mut progressed = false;
        progressed |= self.take_outgoing()?;
        progressed |= self.poll_completions()?;
        progressed |= self.carry_out()?;
        progressed |= self.deliver();
        if self.return_at.is_some_and(|at| at <= Instant::now()) {
            self.return_at = None;
            if self.protocol.return_credits() {
                progressed |= self.carry_out()?;
            }
        }
        self.adjust_window();
        if let Some(at) = self.protocol.poll_timeout() {
            if at <= Instant::now() {
                self.protocol.handle_timeout(Instant::now());
                progressed |= self.carry_out()?;
            }
        }
        if !self.socket_eof {
            progressed |= self.read_socket()?;
        }
        Ok(progressed)
    }

    /// Releases the shared receive slots the peer gave back, then commits
    /// more while the peer keeps running out of credits (as many as the
    /// pool spares). In that order: a RETURN and a new shortage can arrive
    /// in one batch, and committing first would find the pool short by the
    /// slots about to be released and register a chunk the connection never
    /// needs at once.
    fn adjust_window(&mut self) {
        let returned = self.protocol.take_returned() as usize;
        if returned > 0 {
            self.commitment.slots -= returned;
            self.pools.receive.release(returned);
        }
        let wanted = self.protocol.credits_wanted();
        if wanted > 0 {
            let committed = match self.pools.receive.commit(0, wanted as usize) {
                Ok(committed) => committed,
                Err(error) => {
                    tracing::debug!(%error, "the credit window stays as it is");
                    0
                }
            };
            self.commitment.slots += committed;
            self.protocol.grow_window(committed as u32);
        }
    }

    /// The QP goes to ERROR and every completion still due comes back: each
    /// returns what its request held (a receive the device consumed for this
    /// QP, a SEND's slot, a READ's destination), which the queue would
    /// otherwise have to leak.
    async fn drain(&mut self) {
        let _ = self.queue.qp().to_error();
        if let Some(slot) = self.spare_send.take() {
            self.queue.put_back(slot);
        }
        let deadline = Instant::now() + DRAIN_WAIT;
        loop {
            self.completions.clear();
            match self.queue.poll(&mut self.completions) {
                Ok(0) => {}
                Ok(_) => continue,
                Err(error) => {
                    tracing::warn!(%error, "draining the completion queue");
                    break;
                }
            }
            if self.queue.outstanding() == 0 || Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if self.queue.outstanding() > 0 {
            tracing::warn!(
                sends = self.queue.sends_in_flight(),
                reads = self.queue.reads_in_flight(),
                "requests never completed; their memory stays out of the pools"
            );
        }
    }

    fn take_outgoing(&mut self) -> Result<bool, String> {
        let mut progressed = false;
        loop {
            let frame = match self.stashed.take() {
                Some(frame) => frame,
                None if self.outgoing_open => match self.outgoing.try_recv() {
                    Ok(frame) => frame,
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        self.outgoing_open = false;
                        self.protocol.close();
                        progressed = true;
                        break;
                    }
                },
                None => break,
            };
            let route = self.protocol.route(frame.len());
            if !self.protocol.can_send(route) {
                self.stashed = Some(frame);
                break;
            }
            progressed = true;
            match route {
                Route::Eager => self.protocol.send_eager(frame.into_contiguous()),
                Route::Rendezvous => self.expose(frame)?,
            }
        }
        if !self.outgoing_open && self.stashed.is_none() {
            self.protocol.close();
        }
        Ok(progressed)
    }

    /// Exposes a large frame to the peer's READs: its largest payload part
    /// where it lies, with everything before it (the frame's head, the start
    /// of the message) and after it (the message's end) inline in the
    /// announcement when they fit there; else a copy of the frame in a
    /// pooled buffer.
    fn expose(&mut self, frame: EncodedFrame) -> Result<(), String> {
        let Some((head, remote, tail)) =
            split_for_announce(&frame, self.protocol.max_announce_inline())
        else {
            return self.expose_copy(frame.into_contiguous());
        };
        let window = match ExposedBytes::expose(&self.device.pd, self.queue.qp(), remote) {
            Ok(window) => window,
            Err(error) => {
                // Memory the device cannot register where it lies (on
                // hardware: some file or device mappings) goes the copied way.
                tracing::debug!(%error, len = frame.len(), "payload not registrable in place: copying it");
                return self.expose_copy(frame.into_contiguous());
            }
        };
        let (addr, len, rkey) = self.forged(window.addr(), window.len() as u64, window.rkey());
        let token = self
            .protocol
            .send_rendezvous(head, tail, addr, len, rkey, Instant::now());
        self.exposed.insert(token, Exposed::Payload(window));
        rendezvous_gauge(OUT, 1.0);
        Ok(())
    }

    /// What the announcement says about a window: the truth, unless a test
    /// asked this side to forge it.
    #[cfg_attr(not(feature = "fault-injection"), allow(unused_mut))]
    fn forged(&self, mut addr: u64, mut len: u64, mut rkey: u32) -> (u64, u64, u32) {
        #[cfg(feature = "fault-injection")]
        match self.fault {
            Some(Fault::ForgeRkey) => rkey ^= 0x5a5a_0000,
            Some(Fault::ForgeRange) => addr += 1 << 30,
            Some(Fault::ForgeLength(extra)) => len += extra,
            Some(Fault::ForgeBatch) | None => {}
        }
        (addr, len, rkey)
    }

    /// A test asked this side to send broken BATCH messages.
    fn forges_batches(&self) -> bool {
        #[cfg(feature = "fault-injection")]
        return self.fault == Some(Fault::ForgeBatch);
        #[cfg(not(feature = "fault-injection"))]
        false
    }

    /// Copies a large frame into a pooled buffer and exposes exactly its bytes.
    fn expose_copy(&mut self, frame: Bytes) -> Result<(), String> {
        let mut buffer = self
            .device
            .large
            .take(frame.len())
            .map_err(|error| format!("rendezvous buffer of {} bytes: {error}", frame.len()))?;
        buffer.buffer_mut().as_mut_slice()[..frame.len()].copy_from_slice(&frame);
        let (registered, pool) = buffer.into_parts();
        let window =
            match registered.expose_to(self.queue.qp(), frame.len(), AccessFlags::REMOTE_READ) {
                Ok(window) => window,
                Err(failed) => {
                    drop(PooledBuffer::restore(failed.buffer, pool));
                    return Err(format!("exposing a rendezvous frame: {}", failed.error));
                }
            };
        let (addr, len, rkey) = self.forged(window.addr(), window.len() as u64, window.rkey());
        let token = self.protocol.send_rendezvous(
            Bytes::new(),
            Bytes::new(),
            addr,
            len,
            rkey,
            Instant::now(),
        );
        self.exposed.insert(token, Exposed::Pooled { window, pool });
        rendezvous_gauge(OUT, 1.0);
        Ok(())
    }

    fn poll_completions(&mut self) -> Result<bool, String> {
        let mut progressed = false;
        loop {
            let mut completions = std::mem::take(&mut self.completions);
            completions.clear();
            // Every completion of the batch gave back what it held, even
            // after one failed.
            let count = self
                .queue
                .poll(&mut completions)
                .map_err(|error| format!("polling the completion queue: {error}"));
            let mut failure = count.as_ref().err().cloned();
            for polled in completions.drain(..) {
                if failure.is_some() {
                    break;
                }
                if let Err(reason) = self.on_completion(polled) {
                    failure = Some(reason);
                }
            }
            self.completions = completions;
            if let Some(reason) = failure {
                return Err(reason);
            }
            let count = count.unwrap_or(0);
            progressed |= count > 0;
            if count < POLL_BATCH {
                return Ok(progressed);
            }
        }
    }

    fn on_completion(&mut self, polled: PolledCompletion) -> Result<(), String> {
        let PolledCompletion { completion, polled } = polled;
        if completion.status != WcStatus::Success {
            if completion.status == WcStatus::WrFlushErr && self.protocol.peer_closed() {
                // The peer closed cleanly and destroyed its QP, which took
                // ours to ERROR: the end of the connection, not a failure.
                self.peer_left = true;
                return Ok(());
            }
            // A flush, or retries that went unanswered: the peer may simply
            // be gone (a process that exits takes its QP with it; a SEND it
            // had not acknowledged yet runs out of retries), which its
            // set-up socket's EOF will tell.
            self.flushed = matches!(
                completion.status,
                WcStatus::WrFlushErr | WcStatus::RetryExcErr
            );
            return Err(describe_failure(&completion, &polled));
        }
        match polled {
            Polled::Received(message) => {
                let message = message.ok_or("a receive completion without its message")?;
                self.protocol
                    .handle_received(message)
                    .map_err(|error| format!("peer broke the RDMA protocol: {error}"))?;
            }
            Polled::Sent => {
                self.send_pool_starved = false;
                self.protocol.handle_send_complete();
            }
            Polled::Read { key, len } => {
                self.protocol.handle_read_complete(key, len);
            }
            // A READ into a pull this side let go of: nothing waits for it.
            Polled::AbandonedRead => {}
            Polled::Other => {
                return Err(format!(
                    "completion with unknown wr_id {:#x}",
                    completion.wr_id
                ));
            }
        }
        Ok(())
    }

    /// Reserves `len` bytes of the receive budget for pull `token`; false
    /// when they are not free yet (the sleep waits for them).
    fn reserve(&mut self, token: u64, len: u64) -> Result<bool, String> {
        let Some(budget) = self.budget.as_mut() else {
            return Ok(true);
        };
        if let Some((ready, _)) = &self.budget_ready {
            if *ready == token {
                let (_, reservation) = self.budget_ready.take().expect("checked");
                self.reservations.insert(token, reservation);
                self.budget_wait = None;
                return Ok(true);
            }
        }
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match budget.poll_reserve(&mut cx, len as usize) {
            Poll::Ready(Ok(reservation)) => {
                self.reservations.insert(token, reservation);
                self.budget_wait = None;
                Ok(true)
            }
            Poll::Ready(Err(error)) => Err(format!("receive budget: {error}")),
            Poll::Pending => {
                self.budget_wait = Some((token, len));
                Ok(false)
            }
        }
    }

    /// Events, READs and transmits the protocol asks for.
    fn carry_out(&mut self) -> Result<bool, String> {
        let mut progressed = false;
        while let Some(event) = self.protocol.poll_event() {
            match event {
                Event::Allocate { token, len } => {
                    if !self.reserve(token, len)? {
                        // No budget yet: the pull waits (no READ for it), and
                        // the driver sleeps until the budget frees up.
                        self.protocol.defer_allocation(token);
                        break;
                    }
                    progressed = true;
                    let destination = self.device.large.take(len as usize).map_err(|error| {
                        format!("destination of {len} bytes for a rendezvous frame: {error}")
                    })?;
                    self.queue.pull_into(token, destination);
                    rendezvous_gauge(IN, 1.0);
                }
                Event::Release { token, expired } => {
                    progressed = true;
                    if expired {
                        tracing::warn!(token, "rendezvous frame not pulled in time: revoked");
                    }
                    if let Some(exposed) = self.exposed.remove(&token) {
                        rendezvous_gauge(OUT, -1.0);
                        exposed.release();
                    }
                }
            }
        }
        while let Some(read) = self.protocol.poll_read() {
            progressed = true;
            self.queue
                .read(
                    read.token,
                    read.offset as usize,
                    read.len as usize,
                    read.remote_addr,
                    read.rkey,
                )
                .map_err(|error| format!("READ into its destination: {error}"))?;
        }
        loop {
            // A slot first (a connection with no SEND in flight may take one
            // past the pool's cap: it has no completion of its own to wait
            // for), then the message. None while every one of the
            // connection's send slots is in flight: it holds at most
            // `send_slots` of the shared pool, never one more.
            if self.spare_send.is_none() && self.protocol.send_slots_exhausted() {
                break;
            }
            let slot = match self.spare_send.take() {
                Some(slot) => slot,
                None => match self
                    .queue
                    .take_send_slot(self.queue.sends_in_flight() == 0)
                    .map_err(|error| format!("shared send slot: {error}"))?
                {
                    Some(slot) => slot,
                    None => {
                        self.send_pool_starved = true;
                        break;
                    }
                },
            };
            let Some(message) = self.protocol.poll_transmit() else {
                self.spare_send = Some(slot);
                break;
            };
            progressed = true;
            let forge = self.forges_batches();
            self.queue.send(slot, |buffer| {
                let len = message.encode_into(buffer);
                if forge {
                    forge_batch(&message, buffer);
                }
                len
            });
        }
        let stalled = self.protocol.waits_for_credits();
        if stalled && !self.credit_stalled && rpc_core::metrics::enabled() {
            metrics::counter!("rdma_credit_stalls_total").increment(1);
        }
        self.credit_stalled = stalled;
        if self.queue.has_batch() {
            self.queue
                .post()
                .map_err(|error| format!("posting sends: {error}"))?;
        }
        Ok(progressed)
    }

    /// Hands frames up in order while the application keeps up.
    fn deliver(&mut self) -> bool {
        let mut progressed = false;
        loop {
            let backlog = self.inbound_shared.backlog.load(Ordering::Acquire);
            let application_reads = self
                .inbound
                .as_ref()
                .is_some_and(|inbound| !inbound.is_closed());
            if application_reads && backlog >= self.inbound_limit {
                self.protocol.set_hold_credits(true);
                return progressed;
            }
            self.protocol.set_hold_credits(false);
            let Some(inbound) = self.protocol.poll_inbound() else {
                return progressed;
            };
            progressed = true;
            let frame = match inbound {
                Inbound::Frame(frame) => frame,
                Inbound::Pulled {
                    token,
                    len,
                    head,
                    tail,
                } => {
                    let mut destination = self
                        .queue
                        .finish_pull(token)
                        .expect("a pulled frame has its destination, no READ into it in flight");
                    rendezvous_gauge(IN, -1.0);
                    // Every READ completed: the head goes in front of what
                    // they wrote, the tail behind it.
                    let frame_bytes = &mut destination.buffer_mut().as_mut_slice()[..len as usize];
                    frame_bytes[..head.len()].copy_from_slice(&head);
                    frame_bytes[len as usize - tail.len()..].copy_from_slice(&tail);
                    let frame = destination.into_bytes(len as usize);
                    match self.reservations.remove(&token) {
                        Some(reservation) => reservation.attach(frame),
                        None => frame,
                    }
                }
                Inbound::Refused { head, len, max } => {
                    // As over tcp://: skipped whole (never pulled); rpc-core
                    // answers the call it belongs to, the connection goes on.
                    if let Some(inbound) = &self.inbound {
                        let _ = inbound.send(Err(TransportError::Refused {
                            head,
                            len: usize::try_from(len).unwrap_or(usize::MAX),
                            max: usize::try_from(max).unwrap_or(usize::MAX),
                        }));
                    }
                    continue;
                }
                Inbound::Closed => {
                    // The stream ends after everything the peer sent.
                    self.inbound = None;
                    continue;
                }
            };
            if let Some(inbound) = &self.inbound {
                self.inbound_shared.backlog.fetch_add(1, Ordering::AcqRel);
                if inbound.send(Ok(frame)).is_err() {
                    self.inbound_shared.backlog.fetch_sub(1, Ordering::AcqRel);
                }
            }
        }
    }

    /// Reads a close reason or EOF from the set-up socket.
    fn read_socket(&mut self) -> Result<bool, String> {
        let mut progressed = false;
        loop {
            let read = match self.socket_closed.take() {
                Some(closed) => closed,
                None => match self
                    .socket
                    .try_read_into(&mut self.peer_reason, REASON_BUFFER)
                {
                    Some(read) => read,
                    None => return Ok(progressed),
                },
            };
            match read {
                SocketRead::Data => progressed = true,
                SocketRead::Eof => {
                    self.socket_eof = true;
                    return self.on_socket_eof().map(|()| true);
                }
                SocketRead::Failed(error) => {
                    self.socket_eof = true;
                    return Err(format!("peer connection lost: {error}"));
                }
            }
        }
    }

    fn on_socket_eof(&mut self) -> Result<(), String> {
        // Whatever the peer sent before closing is in our CQ already (a SEND
        // completes at the sender only after it landed here): take it first.
        self.poll_completions()?;
        self.carry_out()?;
        self.deliver();
        if let Some(reason) = decode_reason(&self.peer_reason) {
            return Err(format!("peer closed the connection: {reason}"));
        }
        if self.protocol.peer_closed() {
            // A clean close, then the peer left: nothing more can go out.
            self.peer_left = true;
            return Ok(());
        }
        self.peer_vanished = true;
        Err(PEER_WENT_AWAY.into())
    }

    /// The peer's close reason, if it arrives on the set-up socket soon.
    async fn await_peer_reason(&mut self) -> Option<String> {
        let deadline = tokio::time::Instant::now() + PEER_REASON_WAIT;
        if let Some(SocketRead::Eof | SocketRead::Failed(_)) = self.socket_closed.take() {
            self.socket_eof = true;
        }
        while !self.socket_eof && decode_reason(&self.peer_reason).is_none() {
            let read = self.socket.read_into(&mut self.peer_reason, REASON_BUFFER);
            match tokio::time::timeout_at(deadline, read).await {
                Err(_) | Ok(SocketRead::Failed(_)) => break,
                Ok(SocketRead::Eof) => self.socket_eof = true,
                Ok(SocketRead::Data) if self.peer_reason.len() >= REASON_BUFFER => break,
                Ok(SocketRead::Data) => {}
            }
        }
        decode_reason(&self.peer_reason)
    }

    /// Best effort: tells the peer why we close, on the set-up socket.
    fn tell_peer(&mut self, reason: &str) {
        let text = &reason.as_bytes()[..reason.len().min(MAX_REASON_LEN)];
        let mut message = (text.len() as u32).to_le_bytes().to_vec();
        message.extend_from_slice(text);
        self.socket.write_now(&message);
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // Rendezvous frames still counted when the connection ended.
        rendezvous_gauge(OUT, -(self.exposed.len() as f64));
        rendezvous_gauge(IN, -(self.queue.pulls() as f64));
    }
}

/// Our frames the peer may READ.
const OUT: &str = "out";
/// The peer's frames being pulled.
const IN: &str = "in";

/// `rdma_rendezvous_in_flight{direction}`, while `rpc_core::metrics` records.
fn rendezvous_gauge(direction: &'static str, delta: f64) {
    if delta != 0.0 && rpc_core::metrics::enabled() {
        metrics::gauge!("rdma_rendezvous_in_flight", "direction" => direction).increment(delta);
    }
}

/// [`Fault::ForgeBatch`]: a BATCH whose first frame runs past its end.
fn forge_batch(message: &Message, slot: &mut [u8]) {
    if matches!(message.body, Body::Batch(_)) {
        slot[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    }
}

fn decode_reason(bytes: &[u8]) -> Option<String> {
    let len = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
    let text = bytes.get(4..4 + len.min(MAX_REASON_LEN))?;
    Some(String::from_utf8_lossy(text).into_owned())
}

/// How a large frame is announced: the inline head, the one part the peer
/// READs (the payload's largest), and the inline tail; `None` when the bytes
/// around that part do not fit `max_inline` (the frame is copied instead).
fn split_for_announce(frame: &EncodedFrame, max_inline: usize) -> Option<(Bytes, Bytes, Bytes)> {
    let header_len = rpc_core::frame::HEADER_LEN;
    if frame.payload.is_empty() && frame.head.len() > max_inline && header_len <= max_inline {
        // One contiguous frame: its header rides inline (so the peer can
        // name the call even if it refuses the frame), the rest is read
        // where it lies.
        let head = &frame.head;
        return Some((
            head.slice(..header_len),
            head.slice(header_len..),
            Bytes::new(),
        ));
    }
    let parts: Vec<&Bytes> = frame.payload.parts().collect();
    let (index, remote) = parts
        .iter()
        .enumerate()
        .max_by_key(|(_, part)| part.len())?;
    if frame.len() - remote.len() > max_inline {
        return None;
    }
    let join = |first: Option<&Bytes>, rest: &[&Bytes]| -> Bytes {
        match (first.filter(|bytes| !bytes.is_empty()), rest) {
            (None, []) => Bytes::new(),
            (Some(only), []) => only.clone(),
            (None, [only]) => (*only).clone(),
            (first, rest) => {
                let mut joined = BytesMut::new();
                joined.extend_from_slice(first.map_or(&[][..], |bytes| bytes));
                for part in rest {
                    joined.extend_from_slice(part);
                }
                joined.freeze()
            }
        }
    };
    let head = join(Some(&frame.head), &parts[..index]);
    let tail = join(None, &parts[index + 1..]);
    Some((head, (*remote).clone(), tail))
}

fn describe_failure(completion: &WorkCompletion, polled: &Polled) -> String {
    let read = matches!(polled, Polled::Read { .. } | Polled::AbandonedRead);
    let what = match polled {
        _ if completion.wr_id == crate::verbs::WINDOW_BIND_WR_ID => {
            "binding a rendezvous READ window (memory window)"
        }
        Polled::Received(_) => "a receive",
        Polled::Sent => "a send",
        Polled::Read { .. } | Polled::AbandonedRead => "a rendezvous READ",
        Polled::Other => "a work request",
    };
    let why = match (read, completion.status) {
        (true, WcStatus::WrFlushErr) => {
            "flushed: the queue pair went to ERROR under a rendezvous READ (iWARP devices report a remote access error - a bad rkey, range or length in the peer's announcement - this way; or the peer is gone)"
        }
        (_, WcStatus::WrFlushErr) => "flushed: the queue pair is in error (peer gone?)",
        (true, WcStatus::RemAccessErr) => {
            "remote access error: the peer announced a region it does not expose (bad rkey, range or length)"
        }
        (_, WcStatus::RetryExcErr) => "retries exceeded: the peer does not answer",
        (_, WcStatus::RnrRetryExcErr) => "receiver not ready: the peer posted no receive",
        _ => "",
    };
    let opcode = match completion.opcode {
        WcOpcode::RdmaRead => " (RDMA READ)",
        _ => "",
    };
    format!(
        "{what}{opcode} failed with {:?}{}{why}",
        completion.status,
        if why.is_empty() { "" } else { ": " }
    )
}
