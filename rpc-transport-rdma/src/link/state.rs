//! The protocol state of one RDMA connection and the synchronous steps that
//! turn it: admitting outgoing frames, polling the CQ, carrying out what the
//! sans-IO [`Protocol`] asks for, handing frames up. Every step runs under
//! the connection's one lock, from whichever task needs progress (the reader,
//! a sender, the housekeeper); nothing here waits.

use std::collections::HashMap;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use rpc_core::frame::EncodedFrame;
use rpc_core::transport::{ConnectionBudget, Reservation, TransportError};

#[cfg(feature = "fault-injection")]
use crate::config::Fault;
use crate::config::RdmaConfig;
use crate::device::{Device, SharedPools};
use crate::protocol::{Event, Inbound, Protocol, Route};
use crate::rendezvous_budget::{BudgetWaiter, Charge};
use crate::verbs::pooled::{POLL_BATCH, Polled, PolledCompletion, PooledQp, SendSlot};
use crate::verbs::shared::WindowBooks;
use crate::verbs::{AsyncCompletionChannel, CmConnection, WcOpcode, WcStatus, WorkCompletion};

use super::expose::{Exposed, IN, OUT, forge_batch, rendezvous_gauge};

/// Slots of the shared receive pool committed to one connection: its peer's
/// credit window, the initial slots plus what it grew by (within the pool's
/// growth cap, shared by all connections). Released when dropped (after the
/// QP, see [`LinkState`]).
pub(crate) struct Commitment {
    pub(crate) pools: Arc<SharedPools>,
    books: WindowBooks,
}

impl Commitment {
    /// Commits `initial` slots (all or nothing).
    pub(crate) fn new(
        pools: Arc<SharedPools>,
        initial: usize,
    ) -> Result<Commitment, crate::verbs::shared::CommitError> {
        let initial = pools.receive.commit(initial, initial)?;
        Ok(Commitment {
            pools,
            books: WindowBooks { initial, grown: 0 },
        })
    }

    /// Grows the window by up to `want` slots; returns how many.
    fn grow(&mut self, want: usize) -> Result<usize, crate::verbs::VerbsError> {
        let grown = self.pools.receive.grow(want)?;
        self.books.grown += grown;
        Ok(grown)
    }

    /// The peer gave back `slots` (what the window grew by first).
    fn give_back(&mut self, slots: usize) {
        let (grown, initial) = self.books.give_back(slots);
        self.pools.receive.release_grown(grown);
        self.pools.receive.release(initial);
    }
}

impl Drop for Commitment {
    fn drop(&mut self) {
        let (grown, initial) = self.books.take_all();
        self.pools.receive.release_grown(grown);
        self.pools.receive.release(initial);
    }
}

/// A connection's verbs objects, built before set-up.
pub(crate) struct Endpoint {
    pub(crate) queue: PooledQp,
    pub(crate) channel: AsyncCompletionChannel,
    pub(crate) commitment: Commitment,
}

/// How a connection ended, as its stream reports it.
#[derive(Debug)]
pub(super) enum Outcome {
    /// Both sides closed, or the application left: the stream ends (`None`).
    Clean,
    /// The peer went away without closing ([`TransportError::PeerGone`]).
    Gone(String),
    /// Something broke.
    Failed(String),
}

impl Outcome {
    /// The error the application's ends report.
    pub(super) fn to_error(&self) -> TransportError {
        match self {
            Outcome::Clean => TransportError::Closed,
            Outcome::Gone(reason) => TransportError::PeerGone(reason.clone()),
            Outcome::Failed(reason) => TransportError::Other(reason.clone().into()),
        }
    }
}

/// The connection: its queue pair, pools, protocol and what the application
/// left with it.
pub(crate) struct LinkState {
    // Drop order matters: the queue (its QP and CQ, and whatever memory of
    // the pools its requests still hold) goes before the commitment.
    pub(super) queue: PooledQp,
    /// The rdma_cm connection of the QP, when it was connected through one.
    _cm: Option<CmConnection>,
    /// Shared receive slots committed to the peer (released after the QP
    /// is gone), and the pools.
    commitment: Commitment,
    /// A send slot taken and not used yet (given back before sleeping).
    spare_send: Option<SendSlot>,
    /// The shared send pool had no slot: wait for a completion of our own.
    send_pool_starved: bool,
    /// Frames wait for the peer's credits (counted once per stall).
    credit_stalled: bool,
    pub(super) exposed: HashMap<u64, Exposed>,
    pub(super) device: Arc<Device>,
    pub(super) protocol: Protocol,
    /// A frame the sink accepted that the protocol could not take yet.
    stashed: Option<EncodedFrame>,
    /// The application closed (or dropped) its sink.
    pub(super) sink_closed: bool,
    /// The application dropped its stream: frames that arrive are dropped.
    pub(super) stream_dropped: bool,
    /// Frames received and not yet taken beyond which credits are held back.
    inbound_limit: usize,
    /// The peer's CLOSE was handed up: the stream ends after it.
    pub(super) inbound_closed: bool,
    /// The server-wide receive budget (accepted connections of a `Server`):
    /// a rendezvous destination is taken only once its bytes are reserved.
    pub(super) budget: Option<ConnectionBudget>,
    /// The pull waiting for budget (token, length).
    pub(super) budget_wait: Option<(u64, u64)>,
    /// A reservation that came in while waiting, for that token.
    pub(super) budget_ready: Option<(u64, Reservation)>,
    /// Reservations of pulls in progress, attached to their frames when handed up.
    reservations: HashMap<u64, Reservation>,
    /// Our places in the queue of the device's bound on rendezvous memory
    /// (`Device::rendezvous`): for a pull's destination, and for a frame
    /// to expose.
    pull_budget: BudgetWaiter,
    exposure_budget: BudgetWaiter,
    /// What the pulls not handed up yet hold of that bound, by token.
    pull_charges: HashMap<u64, Charge>,
    /// What our exposed frames hold of it, by token.
    exposure_charges: HashMap<u64, Charge>,
    /// A pull's destination or the stashed frame waits for that bound.
    pub(super) waits_for_rendezvous_budget: bool,
    /// Wakes the reader, the writer and the housekeeper once the bound has
    /// room for what waits (set by `link::start`).
    pub(super) budget_waker: std::task::Waker,
    /// The failure was a flush or unanswered retries: our QP broke, maybe
    /// because the peer (or its process) is gone.
    pub(super) flushed: bool,
    /// The peer closed cleanly and then its QP (or set-up socket) went away.
    pub(super) peer_left: bool,
    /// Why the connection broke; the housekeeper ends it.
    pub(super) failure: Option<String>,
    /// How it ended, once the housekeeper ended it.
    pub(super) outcome: Option<Outcome>,
    /// Turns that made progress (the housekeeper's idleness check).
    pub(super) progress: u64,
    /// Something the housekeeper handles came up (a failure, a timer, a
    /// wait for budget): whoever turned wakes it.
    pub(super) keeper_due: bool,
    /// The rendezvous time-out the housekeeper's timer is set for: an
    /// earlier one makes it due (it is not woken by completions).
    pub(super) keeper_timer: Option<std::time::Instant>,
    /// The housekeeper watches the credits we hold beyond the initial ones
    /// (to give them back when idle): more of them makes it due otherwise.
    pub(super) keeper_watches_credits: bool,
    /// A message or a READ completed since the reader last took a frame:
    /// whoever else turned wakes the reader.
    pub(super) received: bool,

    /// The device raises events for solicited SENDs on solicited-only arms.
    solicited_events: bool,
    #[cfg(feature = "fault-injection")]
    pub(super) fault: Option<Fault>,
    completions: Vec<PolledCompletion>,
}

impl LinkState {
    /// The state of an established connection.
    pub(super) fn new(
        queue: PooledQp,
        commitment: Commitment,
        cm: Option<CmConnection>,
        device: Arc<Device>,
        protocol: Protocol,
        config: &RdmaConfig,
        budget: Option<ConnectionBudget>,
    ) -> LinkState {
        let solicited_events = device.context.caps().solicited_events;
        let (pull_budget, exposure_budget) =
            (device.rendezvous.waiter(), device.rendezvous.waiter());
        LinkState {
            commitment,
            spare_send: None,
            send_pool_starved: false,
            credit_stalled: false,
            queue,
            _cm: cm,
            exposed: HashMap::new(),
            device,
            protocol,
            stashed: None,
            sink_closed: false,
            stream_dropped: false,
            inbound_limit: config.inbound_backlog,
            inbound_closed: false,
            pull_budget,
            exposure_budget,
            pull_charges: HashMap::new(),
            exposure_charges: HashMap::new(),
            waits_for_rendezvous_budget: false,
            budget_waker: std::task::Waker::noop().clone(),
            budget,
            budget_wait: None,
            budget_ready: None,
            reservations: HashMap::new(),
            flushed: false,
            peer_left: false,
            failure: None,
            outcome: None,
            progress: 0,
            keeper_due: false,
            keeper_timer: None,
            keeper_watches_credits: false,
            received: false,
            solicited_events,
            #[cfg(feature = "fault-injection")]
            fault: config.fault,
            completions: Vec::with_capacity(POLL_BATCH),
        }
    }

    /// The connection is over (or breaking): nothing more is sent or taken.
    pub(super) fn is_ending(&self) -> bool {
        self.failure.is_some() || self.outcome.is_some()
    }

    /// Records why the connection broke (the first reason wins).
    pub(super) fn fail(&mut self, reason: String) {
        if self.failure.is_none() && self.outcome.is_none() {
            self.failure = Some(reason);
        }
        self.keeper_due = true;
    }

    /// A frame is waiting for the protocol to take it.
    pub(super) fn has_stashed(&self) -> bool {
        self.stashed.is_some()
    }

    /// Takes `frame` from the sink (the sink said it was ready).
    pub(super) fn stash(&mut self, frame: EncodedFrame) -> Result<(), String> {
        debug_assert!(self.stashed.is_none(), "the sink was not ready");
        self.stashed = Some(frame);
        self.admit().map(|_| ())
    }

    /// Hands the stashed frame to the protocol if it takes one now; queues
    /// our CLOSE once the sink closed and nothing is stashed.
    fn admit(&mut self) -> Result<bool, String> {
        let mut progressed = false;
        if let Some(frame) = self.stashed.take() {
            let route = self.protocol.route(frame.len());
            if !self.protocol.can_send(route) {
                self.stashed = Some(frame);
            } else if route == Route::Eager {
                progressed = true;
                self.protocol.send_eager(frame.into_contiguous());
            } else {
                // The device's bound on rendezvous memory: a frame waits
                // (with the sink) while it is spent, unless none of ours is
                // exposed (then it goes past it: nothing of ours can free it).
                let mut cx = Context::from_waker(&self.budget_waker);
                let holds_none = self.exposure_charges.is_empty();
                match self
                    .exposure_budget
                    .poll_charge(&mut cx, frame.len(), holds_none)
                {
                    Poll::Ready(charge) => {
                        progressed = true;
                        let token = self.expose(frame)?;
                        self.exposure_charges.insert(token, charge);
                    }
                    Poll::Pending => {
                        self.stashed = Some(frame);
                        self.waits_for_rendezvous_budget = true;
                    }
                }
            }
        }
        if self.sink_closed && self.stashed.is_none() && !self.protocol.close_sent() {
            self.protocol.close();
            progressed = true;
        }
        Ok(progressed)
    }

    /// One round of work: admit, poll the CQ, carry out, adjust the window.
    /// True when anything happened. An error is recorded ([`LinkState::fail`]).
    pub(super) fn turn(&mut self) -> bool {
        if self.is_ending() {
            return false;
        }
        match self.try_turn() {
            Ok(progressed) => {
                if progressed {
                    self.progress += 1;
                }
                progressed
            }
            Err(reason) => {
                self.fail(reason);
                true
            }
        }
    }

    fn try_turn(&mut self) -> Result<bool, String> {
        self.waits_for_rendezvous_budget = false;
        let mut progressed = self.admit()?;
        progressed |= self.poll_completions()?;
        progressed |= self.carry_out()?;
        if self.stashed.is_some() && self.admit()? {
            progressed = true;
            self.carry_out()?;
        }
        self.adjust_window();
        // (The earliest time-out is a scan of the exposed frames: looked up
        // once per turn, again only after some were handled.)
        let mut timeout = self.protocol.poll_timeout();
        if let Some(at) = timeout {
            let now = std::time::Instant::now();
            if at <= now {
                self.protocol.handle_timeout(now);
                progressed |= self.carry_out()?;
                timeout = self.protocol.poll_timeout();
            }
        }
        if timeout.is_some_and(|at| self.keeper_timer.is_none_or(|armed| at < armed)) {
            self.keeper_due = true;
        }
        if !self.keeper_watches_credits && self.protocol.excess_credits() > 0 {
            self.keeper_due = true;
        }
        if self.stream_dropped {
            // Nobody takes frames any more: they are let go as they come.
            while self.next_inbound().is_some() {
                progressed = true;
            }
        }
        Ok(progressed)
    }

    /// Gives back credits beyond the peer's initial ones (an idle connection).
    pub(super) fn return_credits(&mut self) {
        if self.is_ending() {
            return;
        }
        if self.protocol.return_credits() {
            if let Err(reason) = self.carry_out() {
                self.fail(reason);
            }
        }
    }

    /// Arms the CQ before a wait. Every message of the peer is solicited; a
    /// completion of our own (a SEND done, a READ landed) only needs to wake
    /// us when we wait for one. A send slot taken and not used goes back.
    pub(super) fn arm(&mut self) -> bool {
        if let Some(slot) = self.spare_send.take() {
            self.queue.put_back(slot);
        }
        let closing_with_sends_in_flight =
            self.protocol.close_sent() && !self.protocol.sends_idle();
        let solicited_only = self.solicited_events
            && self.queue.reads_in_flight() == 0
            && !self.protocol.send_slots_exhausted()
            && !self.send_pool_starved
            && self.stashed.is_none()
            && !closing_with_sends_in_flight;
        match self.queue.req_notify(solicited_only) {
            Ok(()) => true,
            Err(error) => {
                self.fail(format!("arming the completion queue: {error}"));
                false
            }
        }
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
            self.commitment.give_back(returned);
        }
        let wanted = self.protocol.credits_wanted();
        if wanted > 0 {
            let committed = match self.commitment.grow(wanted as usize) {
                Ok(committed) => committed,
                Err(error) => {
                    tracing::debug!(%error, "the credit window stays as it is");
                    0
                }
            };
            self.protocol.grow_window(committed as u32);
            // Credits beyond the initial ones go back after a quiet while.
            self.keeper_due |= committed > 0;
        }
    }

    /// One step of the end: the QP goes to ERROR and the completions still
    /// due come back (each returns what its request held: a receive the
    /// device consumed for this QP, a SEND's slot, a READ's destination).
    /// True while some are outstanding.
    pub(super) fn drain_step(&mut self, first: bool) -> bool {
        if first {
            let _ = self.queue.qp().to_error();
            if let Some(slot) = self.spare_send.take() {
                self.queue.put_back(slot);
            }
        }
        loop {
            self.completions.clear();
            match self.queue.poll(&mut self.completions) {
                Ok(0) => break,
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(%error, "draining the completion queue");
                    return false;
                }
            }
        }
        self.completions.clear();
        self.queue.outstanding() > 0
    }

    /// Lets go of every window of ours the peer could still READ, and of
    /// what the connection holds of the device's bound on rendezvous memory.
    pub(super) fn revoke_all(&mut self) {
        for (_, exposed) in self.exposed.drain() {
            rendezvous_gauge(OUT, -1.0);
            exposed.release();
        }
        self.exposure_charges.clear();
        // The connection is over: its pulls leave the device's bound now,
        // not when the application lets go of its ends.
        self.pull_charges.clear();
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
                self.received = true;
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
                self.received = true;
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
    /// when they are not free yet (the housekeeper waits for them).
    fn reserve(&mut self, token: u64, len: u64) -> Result<bool, String> {
        let Some(budget) = self.budget.as_mut() else {
            return Ok(true);
        };
        if self.reservations.contains_key(&token) {
            // Reserved on an earlier try that then waited for the device's
            // bound on rendezvous memory.
            return Ok(true);
        }
        if let Some((ready, _)) = &self.budget_ready {
            if *ready == token {
                let (_, reservation) = self.budget_ready.take().expect("checked");
                self.reservations.insert(token, reservation);
                self.budget_wait = None;
                return Ok(true);
            }
        }
        let mut cx = Context::from_waker(std::task::Waker::noop());
        match budget.poll_reserve(&mut cx, len as usize) {
            Poll::Ready(Ok(reservation)) => {
                self.reservations.insert(token, reservation);
                self.budget_wait = None;
                Ok(true)
            }
            Poll::Ready(Err(error)) => Err(format!("receive budget: {error}")),
            Poll::Pending => {
                self.budget_wait = Some((token, len));
                self.keeper_due = true;
                Ok(false)
            }
        }
    }

    /// Events, READs and transmits the protocol asks for.
    pub(super) fn carry_out(&mut self) -> Result<bool, String> {
        let mut progressed = false;
        while let Some(event) = self.protocol.poll_event() {
            match event {
                Event::Allocate { token, len } => {
                    if !self.reserve(token, len)? {
                        // No budget yet: the pull waits (no READ for it),
                        // and the housekeeper waits for the budget.
                        self.protocol.defer_allocation(token);
                        break;
                    }
                    // Then the device's bound on rendezvous memory, which
                    // a connection with no pull of its own passes at once
                    // (what it pulls frees the peer's memory, never ours).
                    let mut cx = Context::from_waker(&self.budget_waker);
                    let holds_none = self.pull_charges.is_empty();
                    let charge = match self.pull_budget.poll_charge(
                        &mut cx,
                        usize::try_from(len).unwrap_or(usize::MAX),
                        holds_none,
                    ) {
                        Poll::Ready(charge) => charge,
                        Poll::Pending => {
                            self.waits_for_rendezvous_budget = true;
                            self.protocol.defer_allocation(token);
                            break;
                        }
                    };
                    progressed = true;
                    let destination = self.device.large.take(len as usize).map_err(|error| {
                        format!("destination of {len} bytes for a rendezvous frame: {error}")
                    })?;
                    self.queue.pull_into(token, destination);
                    self.pull_charges.insert(token, charge);
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
                    self.exposure_charges.remove(&token);
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

    /// The next frame (or skipped frame) for the application, in order;
    /// credits are held back while `inbound_limit` frames wait for it.
    pub(super) fn next_inbound(&mut self) -> Option<Result<Bytes, TransportError>> {
        loop {
            let inbound = self.protocol.poll_inbound();
            self.protocol
                .set_hold_credits(self.protocol.pending() >= self.inbound_limit);
            let frame = match inbound? {
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
                    // The frame is the application's now: its bytes leave
                    // the device's bound (the server's receive budget, when
                    // there is one, holds them until they are dropped).
                    self.pull_charges.remove(&token);
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
                    return Some(Err(TransportError::Refused {
                        head,
                        len: usize::try_from(len).unwrap_or(usize::MAX),
                        max: usize::try_from(max).unwrap_or(usize::MAX),
                    }));
                }
                Inbound::Closed => {
                    // The stream ends after everything the peer sent.
                    self.inbound_closed = true;
                    continue;
                }
            };
            return Some(Ok(frame));
        }
    }

    /// Whether the connection is over by itself (both sides closed, or the
    /// peer left after closing), or the application left and nothing of it
    /// is in flight any more.
    pub(super) fn finished(&self) -> bool {
        if self.protocol.is_finished() || self.peer_left {
            return true;
        }
        self.application_gone() && self.nothing_in_flight()
    }

    /// The application dropped (or closed) both halves.
    pub(super) fn application_gone(&self) -> bool {
        self.sink_closed && self.stream_dropped
    }

    fn nothing_in_flight(&self) -> bool {
        self.protocol.close_sent()
            && self.protocol.sends_idle()
            && self.protocol.exposed() == 0
            && self.queue.reads_in_flight() == 0
    }
}

impl Drop for LinkState {
    fn drop(&mut self) {
        // A spare send slot is put back when the connection waits
        // (`arm`) or drains; a state dropped where neither ran (its
        // runtime dropped with its tasks) gives it back here.
        if let Some(slot) = self.spare_send.take() {
            self.queue.put_back(slot);
        }
        // Rendezvous frames still counted when the connection ended.
        rendezvous_gauge(OUT, -(self.exposed.len() as f64));
        rendezvous_gauge(IN, -(self.queue.pulls() as f64));
    }
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
