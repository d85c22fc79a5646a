//! The housekeeper of one connection: what no message triggers. It sleeps on
//! the set-up socket, one timer and its waker; the data path never waits
//! for it.
//!
//! - timers: rendezvous frames the peer did not pull in time, credits an
//!   idle connection gives back ([`CREDIT_RETURN_IDLE`]), the linger of a
//!   connection the application left with frames still in flight;
//! - the set-up socket, the liveness signal: EOF means the peer is gone.
//!   Before closing on an error a side writes the reason there (a `u32 LE`
//!   length and UTF-8 text), so the peer's calls fail with that reason;
//! - the server's receive budget, when a pull waits for it, and the
//!   device's bound on rendezvous memory, when a pull or a frame waits;
//! - turning the connection while the application no longer does (it left);
//! - the end: the QP goes to ERROR and its CQ is drained (every shared slot
//!   the device consumed comes back to the pools), then the stream learns how
//!   the connection ended.

use std::future::poll_fn;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::{Duration, Instant};

use super::state::Outcome;
use super::{CREDIT_RETURN_IDLE, Link, Poller};
use crate::setup_socket::{SetupSocket, SocketRead};

/// How long an ending connection waits for the flushed completions of its
/// requests (each returns memory to a pool).
const DRAIN_WAIT: Duration = Duration::from_millis(100);
/// Longest close reason accepted from the peer.
const MAX_REASON_LEN: usize = 4096;
/// Bytes of the set-up socket kept: a close reason with its length prefix.
const REASON_BUFFER: usize = MAX_REASON_LEN + 4;
/// How long a connection whose application closed it waits for the peer to
/// take its last frames (and pull its windows) before it ends anyway: a
/// peer whose queue pair never connected, or that stopped reading, cannot
/// hold a closed connection's resources.
const CLOSE_LINGER: Duration = Duration::from_secs(5);
/// Why a connection ended whose peer left without a word.
const PEER_WENT_AWAY: &str = "peer went away (its set-up connection closed)";
/// How long a side whose QP was flushed waits for the peer to say why.
const PEER_REASON_WAIT: Duration = Duration::from_millis(200);

/// The housekeeper's own state.
struct Keeper {
    link: Arc<Link>,
    socket: SetupSocket,
    peer_reason: Vec<u8>,
    socket_eof: bool,
    /// The set-up socket closed with no reason and no clean close before:
    /// the peer went away (see `TransportError::PeerGone`).
    peer_vanished: bool,
    /// When an idle connection gives back its extra credits, and the count
    /// of busy turns when that was decided.
    return_at: Option<(Instant, u64)>,
    /// When the application left with work in flight.
    gone_since: Option<Instant>,
}

/// Runs the housekeeping of `link` until the connection ends, then ends it.
pub(super) async fn run(link: Arc<Link>, socket: SetupSocket) {
    let mut keeper = Keeper {
        link,
        socket,
        peer_reason: Vec::new(),
        socket_eof: false,
        peer_vanished: false,
        return_at: None,
        gone_since: None,
    };
    keeper.watch().await;
    keeper.end().await;
}

impl Keeper {
    /// Until the connection is over.
    async fn watch(&mut self) {
        let mut timer = Box::pin(tokio::time::sleep(Duration::from_secs(3600)));
        let mut armed_for: Option<Instant> = None;
        let link = self.link.clone();
        poll_fn(|cx| {
            link.wakers.keeper.register(cx.waker());
            loop {
                // The set-up socket: a reason, EOF, or nothing.
                if !self.socket_eof {
                    match self
                        .socket
                        .poll_read_into(cx, &mut self.peer_reason, REASON_BUFFER)
                    {
                        Poll::Ready(SocketRead::Data) => continue,
                        Poll::Ready(SocketRead::Eof) => {
                            self.socket_eof = true;
                            self.on_socket_eof();
                            return Poll::Ready(());
                        }
                        Poll::Ready(SocketRead::Failed(error)) => {
                            self.socket_eof = true;
                            link.lock()
                                .fail(format!("peer connection lost: {error}"));
                            return Poll::Ready(());
                        }
                        Poll::Pending => {}
                    }
                }
                let mut guard = link.lock();
                let state = &mut *guard;
                let now = Instant::now();
                let application_gone = state.application_gone();
                if application_gone {
                    // Nobody turns the connection but us now.
                    self.gone_since.get_or_insert(now);
                    if state.turn() {
                        link.wake_others(state, Poller::Keeper);
                        continue;
                    }
                }
                if state.is_ending() || state.finished() {
                    return Poll::Ready(());
                }
                if self
                    .gone_since
                    .is_some_and(|since| now >= since + CLOSE_LINGER)
                {
                    state.fail(format!(
                        "closed by this side; the peer did not take its last frames within {CLOSE_LINGER:?}"
                    ));
                    return Poll::Ready(());
                }
                // The budget a pull waits for.
                if let (Some((token, len)), None, Some(budget)) =
                    (state.budget_wait, &state.budget_ready, state.budget.as_mut())
                {
                    match budget.poll_reserve(cx, len as usize) {
                        Poll::Ready(Ok(reservation)) => {
                            state.budget_ready = Some((token, reservation));
                            state.turn();
                            state.received = true;
                            link.wake_others(state, Poller::Keeper);
                            continue;
                        }
                        Poll::Ready(Err(error)) => {
                            state.fail(format!("receive budget: {error}"));
                            return Poll::Ready(());
                        }
                        Poll::Pending => {}
                    }
                }
                // The device's bound on rendezvous memory had room for a
                // pull or a frame of ours (its waker woke us): whoever turns
                // takes it, and the application may not be turning now.
                if state.waits_for_rendezvous_budget && state.turn() {
                    link.wake_others(state, Poller::Keeper);
                    continue;
                }
                // Rendezvous time-outs (the turn handles those due).
                let rendezvous = state.protocol.poll_timeout();
                state.keeper_timer = rendezvous;
                if rendezvous.is_some_and(|at| at <= now) {
                    state.turn();
                    link.wake_others(state, Poller::Keeper);
                    continue;
                }
                // Credits beyond the initial ones, given back after a quiet while.
                if state.protocol.excess_credits() > 0 {
                    match self.return_at {
                        Some((at, busy)) if at <= now => {
                            if busy == state.progress {
                                state.return_credits();
                                link.wake_others(state, Poller::Keeper);
                                self.return_at = None;
                            } else {
                                self.return_at = Some((now + CREDIT_RETURN_IDLE, state.progress));
                            }
                            continue;
                        }
                        Some(_) => {}
                        None => {
                            self.return_at = Some((now + CREDIT_RETURN_IDLE, state.progress));
                        }
                    }
                } else {
                    self.return_at = None;
                }
                state.keeper_watches_credits = self.return_at.is_some();
                let deadline = [
                    rendezvous,
                    self.return_at.map(|(at, _)| at),
                    self.gone_since.map(|since| since + CLOSE_LINGER),
                ]
                .into_iter()
                .flatten()
                .min();
                if application_gone && !state.arm() {
                    continue;
                }
                drop(guard);
                if application_gone {
                    // Completions are ours to take now: the channel wakes us.
                    link.wakers.keeper_on_channel.store(true, Ordering::Release);
                }
                if application_gone && link.poll_channel().is_ready() {
                    continue;
                }
                if let Some(at) = deadline {
                    if armed_for != Some(at) {
                        timer.as_mut().reset(at.into());
                        armed_for = Some(at);
                    }
                    if timer.as_mut().poll(cx).is_ready() {
                        armed_for = None;
                        continue;
                    }
                }
                return Poll::Pending;
            }
        })
        .await;
    }

    /// The set-up socket reached EOF: whatever the peer sent before closing
    /// is in our CQ already (a SEND completes at the sender only after it
    /// landed here), so the turn takes it first; then the reason decides.
    fn on_socket_eof(&mut self) {
        let mut state = self.link.lock();
        state.turn();
        if let Some(reason) = decode_reason(&self.peer_reason) {
            state.fail(format!("peer closed the connection: {reason}"));
        } else if state.protocol.peer_closed() {
            // A clean close, then the peer left: nothing more can go out.
            state.peer_left = true;
        } else {
            self.peer_vanished = true;
            state.fail(PEER_WENT_AWAY.into());
        }
    }

    /// Ends the connection: drains the QP, settles the reason, tells the
    /// stream (and the peer, on a failure of ours).
    async fn end(&mut self) {
        let link = self.link.clone();
        let failure = link.lock().failure.clone();
        self.drain().await;
        let outcome = match failure {
            None => {
                tracing::debug!("rdma connection closed");
                Outcome::Clean
            }
            Some(mut reason) => {
                let mut gone = self.peer_vanished;
                let flushed = link.lock().flushed;
                if flushed {
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
                tracing::debug!(%reason, gone, "rdma connection ended");
                if gone {
                    Outcome::Gone(reason)
                } else {
                    Outcome::Failed(reason)
                }
            }
        };
        let mut state = link.lock();
        state.revoke_all();
        state.outcome = Some(outcome);
        drop(state);
        link.wakers.reader.wake();
        link.wakers.writer.wake();
    }

    /// The QP goes to ERROR and every completion still due comes back, or
    /// [`DRAIN_WAIT`] passes (then the memory those requests hold is leaked
    /// by the queue, never reused).
    async fn drain(&mut self) {
        let deadline = Instant::now() + DRAIN_WAIT;
        let mut first = true;
        loop {
            let outstanding = self.link.lock().drain_step(first);
            first = false;
            if !outstanding {
                return;
            }
            if Instant::now() >= deadline {
                let state = self.link.lock();
                tracing::warn!(
                    sends = state.queue.sends_in_flight(),
                    reads = state.queue.reads_in_flight(),
                    "requests never completed; their memory stays out of the pools"
                );
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// The peer's close reason, if it arrives on the set-up socket soon.
    async fn await_peer_reason(&mut self) -> Option<String> {
        let deadline = tokio::time::Instant::now() + PEER_REASON_WAIT;
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

fn decode_reason(bytes: &[u8]) -> Option<String> {
    let len = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
    let text = bytes.get(4..4 + len.min(MAX_REASON_LEN))?;
    Some(String::from_utf8_lossy(text).into_owned())
}
