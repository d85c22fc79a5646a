//! Soft reliable-connected queue pairs: state machine, initiator and responder.
//!
//! Ordering model: every send request gets a sequence number and is executed
//! by the peer strictly in that order. After an RNR NAK for request N the
//! responder drops everything after N until N comes again (go-back-N), and the
//! initiator resends N and its successors when the RNR timer expires.

use std::collections::VecDeque;

use std::collections::HashMap;
use std::net::Shutdown;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use super::faults::FaultKind;
use super::memory::{self, Span};
use super::peer::{PeerProcess, SECRET_LEN, Secret};
use super::ring::RingPair;
use super::wake::{PeerWakers, WAKER_RECV, WAKER_SEND, WAKER_SEND_IS_RECV, need};
use super::wire::{
    self, AckUrgency, Encode, Message, MessageReader, Outcome, ReadOutcome, Request, RequestOp,
    Response,
};
use super::{ContextShared, CqShared, MrEntry, SrqShared, lock, rendezvous_name};
use crate::{
    AccessFlags, ConnectOptions, PostError, QpAddress, QpCaps, QpInit, QpState, QueuePair, RecvWr,
    SendOp, SendWr, Sge, VerbsError, WcOpcode, WcStatus, WorkCompletion,
};

/// Responses an engine turn queues for a peer whose ring is full before it
/// stops reading that peer's requests.
const ENGINE_BACKLOG: usize = 64 * 1024;
/// A peer that answers none of our outstanding requests for this long fails
/// the QP with RETRY_EXC_ERR, as a device's transport retries would (soft
/// has no lost packets to retry: only a peer that stopped answering). So
/// such a peer ends its own connection and lets go of what its requests
/// held, instead of holding it for as long as it lives.
pub(crate) const ACK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Milliseconds since this process first asked (never 0: 0 means "none").
fn now_millis() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

/// A peer that leaves no room in its ring for this long fails the QP: it has
/// stopped reading (nobody ever waits for the room; the engine retries).
const BACKLOG_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);
/// SENDs and WRITEs up to this many bytes travel inside their descriptor.
const EAGER_COPY_BYTES: u64 = 512;
/// Requests a peer may send before this QP reaches RTR (held until then);
/// more is a flood, and the QP fails.
const MAX_EARLY_REQUESTS: usize = 256;
/// How long a dialing QP waits for the acceptor's reply to its handshake.
const DIAL_REPLY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// Dials awaiting their reply at once in this process (each on a thread of
/// its own, for at most [`DIAL_REPLY_TIMEOUT`]); a dial beyond fails at once.
/// Peers that make a server dial sockets that never answer cost it at most
/// this many threads.
pub(crate) const MAX_DIALS_AWAITING_REPLY: usize = 64;
/// Dials awaiting their reply now.
static DIALS_AWAITING_REPLY: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);

/// One dial's place among [`MAX_DIALS_AWAITING_REPLY`]; freed when dropped.
struct DialSlot;

impl DialSlot {
    fn take() -> Option<DialSlot> {
        let taken = DIALS_AWAITING_REPLY.fetch_add(1, AtomicOrdering::AcqRel);
        if taken >= MAX_DIALS_AWAITING_REPLY {
            DIALS_AWAITING_REPLY.fetch_sub(1, AtomicOrdering::AcqRel);
            return None;
        }
        Some(DialSlot)
    }
}

impl Drop for DialSlot {
    fn drop(&mut self) {
        DIALS_AWAITING_REPLY.fetch_sub(1, AtomicOrdering::AcqRel);
    }
}
/// Bytes of a soft QP address's provider part: pid, context id, secret.
const ADDRESS_EXTRA_LEN: usize = 4 + 8 + SECRET_LEN;

/// Who is on the other end, as its hello named it (the pid is checked
/// against the kernel's word before a peer is attached).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Peer {
    pub(crate) pid: u32,
    pub(crate) context: u64,
    pub(crate) qp_num: u32,
}

struct Outstanding {
    wr: SendWr,
    seq: u64,
    request: Request,
    /// A local error found at post time, reported when the request reaches the head.
    local_error: Option<WcStatus>,
}

struct QpInner {
    state: QpState,
    options: ConnectOptions,
    /// Set by `to_rtr` (expected peer) or by the accept loop (attached peer).
    peer: Option<Peer>,
    /// The attached peer's process, as the kernel identified it: every
    /// transfer with its address space goes through this.
    process: Option<Arc<PeerProcess>>,
    writer: Option<UnixStream>,
    /// The shared-memory rings the wire messages travel in (the socket only
    /// carries doorbells and EOF).
    ring: Option<Arc<RingPair>>,
    /// Messages encoded but not yet written: one write per batch, not per message.
    unwritten: Vec<u8>,
    /// What `unwritten` needs from the peer (`need` bits; 0: nothing urgent,
    /// no wake-up).
    unwritten_needs: u32,
    /// Since when the peer's ring has had no room for what the engine
    /// wrote (see [`QpShared::flush_some`]).
    backlog_since: Option<Instant>,
    next_seq: u64,
    outstanding: VecDeque<Outstanding>,
    recv_queue: VecDeque<RecvWr>,
    /// Responder: the sequence number of the next request to execute.
    expected_seq: u64,
    /// Responder: requests that arrived before this QP reached RTR.
    early_requests: VecDeque<Request>,
    rnr_retries_left: u8,
    /// Initiator: when to resend after an RNR NAK.
    rnr_resend_at: Option<Instant>,
    /// A message read from the wire that the fault injector holds until the
    /// instant ([`FaultKind::Delay`]): nothing behind it is read meanwhile.
    held: Option<(Message, Instant)>,
}

impl QpInner {
    /// The earliest timer set: an RNR resend, or the end of a held message.
    fn timer_due(&self) -> Option<Instant> {
        let held_until = self.held.as_ref().map(|(_, until)| *until);
        match (self.rnr_resend_at, held_until) {
            (Some(rnr), Some(held)) => Some(rnr.min(held)),
            (rnr, held) => rnr.or(held),
        }
    }
}

pub(crate) struct QpShared {
    pub(crate) qp_num: u32,
    /// Presented by whoever attaches to this QP over the Unix socket: only
    /// the peer that got our address from the set-up hello knows it.
    secret: Secret,
    pd: u64,
    context: Arc<ContextShared>,
    caps: QpCaps,
    sq_sig_all: bool,
    send_cq: Arc<CqShared>,
    recv_cq: Arc<CqShared>,
    srq: Option<Arc<SrqShared>>,
    inner: Mutex<QpInner>,
    /// The read side of the wire. Whoever holds it progresses the QP: the
    /// engine thread when it wakes, or a caller busy-polling a CQ of this QP.
    reader: Mutex<Option<(UnixStream, MessageReader, Arc<RingPair>)>>,
    /// Bumped on every attach so a stale engine thread knows to stop.
    generation: AtomicU64,
    /// The rings, once attached: a polling caller looks at them without a lock.
    polled_ring: OnceLock<Arc<RingPair>>,
    /// A timer of this QP is set: an RNR resend, or a message the fault
    /// injector holds (mirrors [`QpInner::timer_due`] for the lock-free look
    /// of a polling caller; [`QpShared::note_timers`] keeps it).
    timer_pending: AtomicBool,
    /// Responses a polling caller left unwritten (see `progress_polled`).
    responses_pending: AtomicBool,
    /// The peer's completion-channel eventfds, once attached.
    peer_wakers: OnceLock<PeerWakers>,
    /// This QP's key at its engine (0 before the first attach): a caller
    /// whose messages a full ring did not take asks the engine for a turn.
    engine_key: AtomicU64,
    /// The fault injector's decisions for this QP (none without a plan).
    faults: super::faults::FaultStream,
    /// When the peer must have answered the oldest outstanding request
    /// ([`now_millis`] + [`ACK_TIMEOUT`]; 0 with nothing outstanding): the
    /// engine's periodic look reads it without a lock.
    ack_deadline: AtomicU64,
}

/// The soft CQ behind `cq`, which must belong to device context `context`:
/// QP numbers are unique per context only, so a CQ shared across contexts
/// could not tell their completions apart.
fn cq_of(cq: &Arc<dyn crate::CompletionQueue>, context: u64) -> Result<Arc<CqShared>, VerbsError> {
    let cq = crate::own::<super::SoftCq>(cq.as_any(), "completion queue of another provider")?;
    if cq.inner.context != context {
        return Err(VerbsError::InvalidArgument(
            "completion queue of another device context",
        ));
    }
    Ok(cq.inner.clone())
}

pub(crate) fn create(
    context: Arc<ContextShared>,
    pd: u64,
    init: QpInit,
) -> Result<Arc<dyn QueuePair>, VerbsError> {
    let caps = init.caps;
    if caps.max_send_wr == 0 || caps.max_send_wr > 1 << 14 || caps.max_recv_wr > 1 << 14 {
        return Err(VerbsError::InvalidArgument("queue depth must be 1..=16384"));
    }
    if caps.max_send_sge > 32 || caps.max_recv_sge > 32 || caps.max_inline_data > 4096 {
        return Err(VerbsError::InvalidArgument(
            "at most 32 SGEs and 4096 inline bytes",
        ));
    }
    let srq = match &init.srq {
        Some(srq) => {
            let srq = crate::own::<super::SoftSrq>(srq.as_any(), "SRQ of another provider")?
                .inner
                .clone();
            if srq.context != context.id || srq.pd != pd {
                return Err(VerbsError::InvalidArgument(
                    "SRQ belongs to another protection domain or device context",
                ));
            }
            Some(srq)
        }
        None => None,
    };
    let qp_num = context.next_qp_num.fetch_add(1, AtomicOrdering::Relaxed);
    let shared = Arc::new(QpShared {
        qp_num,
        secret: super::peer::random_secret()?,
        pd,
        caps,
        sq_sig_all: init.sq_sig_all,
        send_cq: cq_of(&init.send_cq, context.id)?,
        recv_cq: cq_of(&init.recv_cq, context.id)?,
        srq,
        inner: Mutex::new(QpInner {
            state: QpState::Reset,
            options: ConnectOptions::default(),
            peer: None,
            process: None,
            writer: None,
            ring: None,
            unwritten: Vec::new(),
            unwritten_needs: 0,
            backlog_since: None,
            next_seq: 0,
            outstanding: VecDeque::new(),
            recv_queue: VecDeque::new(),
            expected_seq: 0,
            early_requests: VecDeque::new(),
            rnr_retries_left: 0,
            rnr_resend_at: None,
            held: None,
        }),
        reader: Mutex::new(None),
        generation: AtomicU64::new(0),
        polled_ring: OnceLock::new(),
        timer_pending: AtomicBool::new(false),
        responses_pending: AtomicBool::new(false),
        peer_wakers: OnceLock::new(),
        engine_key: AtomicU64::new(0),
        ack_deadline: AtomicU64::new(0),
        faults: super::faults::FaultStream::new(context.fault_plan, u64::from(qp_num)),
        context: context.clone(),
    });
    lock(&context.qps).insert(qp_num, Arc::downgrade(&shared));
    shared.send_cq.add_source(&shared);
    if !Arc::ptr_eq(&shared.send_cq, &shared.recv_cq) {
        shared.recv_cq.add_source(&shared);
    }
    Ok(Arc::new(SoftQp {
        shared,
        _srq: init.srq.clone(),
    }))
}

/// The handle users hold; dropping it destroys the QP.
pub(crate) struct SoftQp {
    shared: Arc<QpShared>,
    /// The SRQ it was created with, held as every provider's QP holds it:
    /// the receive pool that owns the SRQ sees from its count that a QP
    /// may still consume its slots (and then never frees them).
    _srq: Option<Arc<dyn crate::SharedReceiveQueue>>,
}

impl SoftQp {
    /// Whether this QP belongs to `context` (QP numbers are unique only
    /// within one opened device).
    pub(crate) fn of_context(&self, context: &Arc<ContextShared>) -> bool {
        Arc::ptr_eq(&self.shared.context, context)
    }

    /// Connects to the peer's soft device and sends the handshake, without
    /// blocking: the Unix socket is non-blocking, the listener behind the
    /// name must be the process the hello named (the kernel says who holds
    /// it: an abstract name is anyone's to bind), and the acceptor's reply
    /// is awaited on a short-lived thread that attaches the QP (or fails it)
    /// within [`DIAL_REPLY_TIMEOUT`]. No thread of the caller ever waits on
    /// the peer.
    fn dial(&self, peer: Peer, peer_secret: &Secret) -> Result<(), VerbsError> {
        let Some(slot) = DialSlot::take() else {
            return Err(VerbsError::Io(std::io::Error::new(
                std::io::ErrorKind::WouldBlock,
                format!(
                    "{MAX_DIALS_AWAITING_REPLY} soft dials already await their peers' replies: refusing another"
                ),
            )));
        };
        let name = rendezvous_name(peer.pid, peer.context);
        // A full listen queue (a burst, or a flood the acceptor is still
        // refusing) makes a non-blocking connect fail at once: the dial's
        // own thread tries again, off the caller's thread.
        let sent = match super::connect_abstract_nonblocking(&name) {
            Ok(stream) => Some(send_handshake(&self.shared, stream, peer, peer_secret)?),
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => None,
            Err(error) => return Err(unreachable(peer, error)),
        };
        let qp = self.shared.clone();
        let secret = *peer_secret;
        std::thread::Builder::new()
            .name(format!("soft-rdma-dial-{}", qp.qp_num))
            .spawn(move || {
                let _slot = slot;
                let sent = match sent {
                    Some(sent) => Ok(sent),
                    None => connect_when_room(&name)
                        .map_err(|error| unreachable(peer, error))
                        .and_then(|stream| send_handshake(&qp, stream, peer, &secret)),
                };
                let attached = match sent {
                    Ok((stream, ring, process)) => match await_reply(&stream) {
                        Ok(wakers) => qp.attach(stream, ring, peer, process, true, wakers),
                        Err(error) => {
                            tracing::debug!(qp = qp.qp_num, %error, "soft dial failed");
                            false
                        }
                    },
                    Err(error) => {
                        tracing::debug!(qp = qp.qp_num, %error, "soft dial failed");
                        false
                    }
                };
                if !attached {
                    qp.enter_error(&mut qp.lock(), None);
                }
            })?;
        Ok(())
    }
}

/// Why a dial could not reach the peer's soft socket.
fn unreachable(peer: Peer, error: std::io::Error) -> VerbsError {
    VerbsError::Io(std::io::Error::new(
        error.kind(),
        format!(
            "cannot reach soft QP {} of process {}: {error} (soft peers must be on this host)",
            peer.qp_num, peer.pid
        ),
    ))
}

/// Connects to abstract socket `name`, trying again while its listen queue
/// is full, for at most [`DIAL_REPLY_TIMEOUT`] (on a dial's own thread).
fn connect_when_room(name: &[u8]) -> std::io::Result<UnixStream> {
    let deadline = Instant::now() + DIAL_REPLY_TIMEOUT;
    loop {
        match super::connect_abstract_nonblocking(name) {
            Err(error)
                if error.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            other => return other,
        }
    }
}

/// Checks who holds the peer's socket and sends it our handshake: what the
/// dial then waits on.
fn send_handshake(
    shared: &Arc<QpShared>,
    stream: UnixStream,
    peer: Peer,
    peer_secret: &Secret,
) -> Result<(UnixStream, RingPair, PeerProcess), VerbsError> {
    let process = PeerProcess::of_socket(&stream, &shared.context.policy)?;
    if process.pid() != peer.pid {
        return Err(VerbsError::Io(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "the soft device socket of process {} is held by process {}: refusing to connect",
                peer.pid,
                process.pid()
            ),
        )));
    }
    let (flags, wake_fds) = shared.wake_fds();
    let handshake = super::Handshake {
        target_qp: peer.qp_num,
        qp_num: shared.qp_num,
        pid: shared.context.pid,
        context: shared.context.id,
        target_secret: *peer_secret,
        wake_flags: flags,
    };
    let (ring, fd) = RingPair::create()?;
    let mut fds = vec![fd.as_fd()];
    fds.extend(wake_fds);
    super::ring::send_with_fds(&stream, &handshake.encode(), &fds)?;
    drop(fd);
    Ok((stream, ring, process))
}

/// The acceptor's reply to a dialer's handshake: accepted (and its
/// channels' wake-up fds, checked), refused, or silent past the time-out.
fn await_reply(stream: &UnixStream) -> std::io::Result<PeerWakers> {
    if !crate::wait_readable(stream.as_raw_fd(), DIAL_REPLY_TIMEOUT)? {
        return Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "the soft peer did not answer the handshake",
        ));
    }
    let mut reply = [0u8; 2];
    let fds = super::ring::receive_with_fds(stream, &mut reply)?;
    if reply[0] != 1 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "the soft peer refused the handshake",
        ));
    }
    PeerWakers::from_set_up(reply[1], &mut fds.into_iter())
}

impl Drop for SoftQp {
    fn drop(&mut self) {
        lock(&self.shared.context.qps).remove(&self.shared.qp_num);
        let mut inner = self.shared.lock();
        if let Some(ring) = inner.ring.as_ref() {
            ring.mark_closed();
        }
        if let Some(writer) = inner.writer.take() {
            let _ = writer.shutdown(Shutdown::Both);
        }
        inner.state = QpState::Error;
    }
}

impl QpShared {
    fn lock(&self) -> MutexGuard<'_, QpInner> {
        lock(&self.inner)
    }

    fn completion(
        &self,
        wr_id: u64,
        status: WcStatus,
        opcode: WcOpcode,
        byte_len: u32,
        imm: Option<u32>,
    ) -> WorkCompletion {
        WorkCompletion {
            wr_id,
            status,
            opcode,
            byte_len,
            imm_data: imm,
            qp_num: self.qp_num,
        }
    }

    /// Checks one local SGE against the context's region table (locked by the caller).
    fn check_local(
        &self,
        regions: &HashMap<u32, MrEntry>,
        sge: &Sge,
        need_write: bool,
    ) -> Result<(), WcStatus> {
        let region = regions.get(&sge.lkey).ok_or(WcStatus::LocProtErr)?;
        if region.pd != self.pd || !region.contains(sge.addr, u64::from(sge.length)) {
            return Err(WcStatus::LocProtErr);
        }
        if need_write && !region.access.contains(AccessFlags::LOCAL_WRITE) {
            return Err(WcStatus::LocProtErr);
        }
        Ok(())
    }

    /// Checks a remote access against this (the responder's) context.
    fn check_remote(
        &self,
        rkey: u32,
        addr: u64,
        len: u64,
        need: AccessFlags,
    ) -> Result<(), Outcome> {
        self.context
            .with_regions(|regions| self.check_remote_in(regions, rkey, addr, len, need))
    }

    /// [`QpShared::check_remote`] against a region table already locked.
    fn check_remote_in(
        &self,
        regions: &HashMap<u32, MrEntry>,
        rkey: u32,
        addr: u64,
        len: u64,
        need: AccessFlags,
    ) -> Result<(), Outcome> {
        let region = regions.get(&rkey).ok_or(Outcome::RemoteAccess)?;
        if region.pd != self.pd
            || !region.contains(addr, len)
            || !region.access.contains(need)
            || region.bound_qp.is_some_and(|qp| qp != self.qp_num)
        {
            return Err(Outcome::RemoteAccess);
        }
        Ok(())
    }

    /// True when `secret` is this QP's (compared in constant time).
    pub(crate) fn secret_matches(&self, secret: &Secret) -> bool {
        super::peer::secrets_match(&self.secret, secret)
    }

    /// Hands a connected socket to this QP and starts its engine. `process`
    /// is the kernel's word on who `peer` is (its pid was checked against
    /// the claimed one by the caller). Returns false when the QP refused.
    pub(crate) fn attach(
        self: &Arc<Self>,
        stream: UnixStream,
        ring: RingPair,
        peer: Peer,
        process: PeerProcess,
        dialed: bool,
        wakers: PeerWakers,
    ) -> bool {
        let mut inner = self.lock();
        let accepted = match inner.peer {
            None => true,
            Some(expected) => expected == peer,
        };
        if !accepted || inner.writer.is_some() || inner.state == QpState::Error {
            let _ = stream.shutdown(Shutdown::Both);
            return false;
        }
        let (Ok(writer), Ok(waiter)) = (stream.try_clone(), stream.try_clone()) else {
            return false;
        };
        if !dialed {
            // The reply to the dialer's handshake, before anything else on
            // the socket: accepted, and our channels' eventfds.
            let (flags, fds) = self.wake_fds();
            if super::ring::send_with_fds(&stream, &[1, flags], &fds).is_err() {
                let _ = stream.shutdown(Shutdown::Both);
                return false;
            }
        }
        let _ = self.peer_wakers.set(wakers);
        let ring = Arc::new(ring);
        inner.peer = Some(peer);
        inner.process = Some(Arc::new(process));
        inner.writer = Some(writer);
        inner.ring = Some(ring.clone());
        let _ = self.polled_ring.set(ring.clone());
        *lock(&self.reader) = Some((stream, MessageReader::new(), ring.clone()));
        let generation = self.generation.fetch_add(1, AtomicOrdering::SeqCst) + 1;
        match super::engine::attach(self.clone(), waiter, ring, generation) {
            Ok(key) => self.engine_key.store(key, AtomicOrdering::Release),
            Err(error) => {
                tracing::warn!(qp = self.qp_num, %error, "soft QP has no engine");
                self.enter_error(&mut inner, None);
                return false;
            }
        }
        tracing::trace!(qp = self.qp_num, ?peer, dialed, "soft QP attached");
        self.send_unsent(&mut inner);
        true
    }

    /// Set-up flags and the eventfds of this QP's completion channels, for
    /// the peer's [`PeerWakers`].
    pub(crate) fn wake_fds(&self) -> (u8, Vec<BorrowedFd<'_>>) {
        let recv = self.recv_cq.wake_fds();
        let mut flags = 0;
        let mut fds = Vec::new();
        if let Some(pair) = recv {
            flags |= WAKER_RECV;
            fds.extend(pair);
        }
        if Arc::ptr_eq(&self.send_cq, &self.recv_cq) {
            if recv.is_some() {
                flags |= WAKER_SEND_IS_RECV;
            }
        } else if let Some(pair) = self.send_cq.wake_fds() {
            flags |= WAKER_SEND;
            fds.extend(pair);
        }
        (flags, fds)
    }

    /// The `need` bits of a request: a receive completion at the peer, or
    /// engine work there.
    fn request_needs(request: &Request) -> u32 {
        let prompt = if request.ack == AckUrgency::Lazy {
            0
        } else {
            need::PROMPT_ACK
        };
        match request.op {
            RequestOp::Send { .. } | RequestOp::Write { imm: Some(_), .. } => {
                prompt
                    | if request.solicited {
                        need::RECV_SOLICITED
                    } else {
                        need::RECV_UNSOLICITED
                    }
            }
            _ => need::ENGINE,
        }
    }

    /// Sends every outstanding request up to the first local error (after
    /// attach, or when the RNR timer expires).
    fn send_unsent(&self, inner: &mut QpInner) {
        if inner.rnr_resend_at.is_some() || !matches!(inner.state, QpState::Rts) {
            return;
        }
        if inner.writer.is_none() {
            return;
        }
        let QpInner {
            outstanding,
            unwritten,
            unwritten_needs,
            ..
        } = inner;
        for o in outstanding.iter().take_while(|o| o.local_error.is_none()) {
            o.request.encode_into(unwritten);
            *unwritten_needs |= Self::request_needs(&o.request);
        }
        self.flush(inner);
    }

    /// Queues a message for the peer; [`QpShared::flush`] writes the batch.
    /// `needs`: what the message needs from the peer (`need` bits; 0: it
    /// may wait for the peer's next look).
    fn write(&self, inner: &mut QpInner, message: &impl Encode, needs: u32) {
        if inner.writer.is_some() {
            message.encode_into(&mut inner.unwritten);
            inner.unwritten_needs |= needs;
        }
    }

    /// Writes the queued messages, as far as the peer's ring has room, for
    /// a caller (a post, a poll): it never waits on the peer. What a full
    /// ring did not take stays queued and the QP's engine is asked for a
    /// turn: it writes the rest as room appears, and fails the QP when none
    /// appears within [`BACKLOG_TIMEOUT`] (a peer that stopped reading). So
    /// no caller, a tokio worker least of all, spins on a hostile peer.
    fn flush(&self, inner: &mut QpInner) {
        if !self.flush_some(inner) {
            let key = self.engine_key.load(AtomicOrdering::Acquire);
            if key != 0 {
                super::engine::poke(self.qp_num, key);
            }
        }
    }

    /// Writes what the peer's ring has room for and keeps the rest queued
    /// (the engine's flush, and a caller's). True when nothing is left.
    fn flush_some(&self, inner: &mut QpInner) -> bool {
        if inner.unwritten.is_empty() {
            return true;
        }
        let needs = inner.unwritten_needs;
        let (Some(writer), Some(ring)) = (inner.writer.as_ref(), inner.ring.as_ref()) else {
            return true;
        };
        let wakers = self.peer_wakers.get();
        // A sleeping peer engine is rung only for work that must not wait
        // for the peer's next poll: engine work, or a request whose
        // initiator wants its acknowledgement promptly. A completion alone
        // (an acknowledgement, a lazily acknowledged SEND) that woke nobody
        // directly waits in the ring: no armed CQ asked for it, and the
        // peer's next poll reads the ring before it looks at its CQ, so it
        // cannot tell the difference.
        let engine_needed = needs & (need::ENGINE | need::PROMPT_ACK) != 0;
        let direct = || wakers.is_some_and(|wakers| wakers.wake(needs)) || !engine_needed;
        let batch = &inner.unwritten;
        // SAFETY: this QP's ring pair is produced on only through
        // `inner.ring`, and only with `&mut QpInner`, which the QP's lock
        // hands out to one thread at a time: we are its only producer now.
        let written = unsafe { ring.send_some(batch, writer, needs != 0, direct) };
        // Either way a polling caller has nothing left to write: what a
        // full ring kept waits for the engine's next turn.
        self.responses_pending.store(false, AtomicOrdering::Relaxed);
        match written {
            Ok(n) if n == inner.unwritten.len() => {
                // Keep the allocation for the next batch.
                inner.unwritten.clear();
                inner.unwritten_needs = 0;
                inner.backlog_since = None;
                true
            }
            Ok(n) => {
                inner.unwritten.drain(..n);
                inner.backlog_since.get_or_insert_with(Instant::now);
                false
            }
            Err(_) => {
                inner.unwritten.clear();
                self.enter_error(inner, Some(WcStatus::RetryExcErr));
                true
            }
        }
    }

    /// Moves the QP to ERROR: the oldest outstanding send completes with
    /// `first` (when given), every other outstanding send and every posted
    /// receive with WR_FLUSH_ERR, and the peer sees the connection close.
    fn enter_error(&self, inner: &mut QpInner, first: Option<WcStatus>) {
        if inner.state == QpState::Error {
            return;
        }
        // Before anything here can learn of the error (and revoke what it
        // exposed): the peer's READs granted until now stop counting.
        if let Some(ring) = inner.ring.as_ref() {
            ring.mark_closed();
        }
        self.ack_deadline.store(0, AtomicOrdering::Relaxed);
        inner.state = QpState::Error;
        inner.rnr_resend_at = None;
        inner.held = None;
        self.note_timers(inner);
        // Messages already queued (e.g. the NAK that explains this error)
        // still go out, best effort, before the wire closes.
        let unwritten = std::mem::take(&mut inner.unwritten);
        if let (false, Some(writer), Some(ring)) = (
            unwritten.is_empty(),
            inner.writer.as_ref(),
            inner.ring.as_ref(),
        ) {
            // SAFETY: as in `flush_some`: we hold `&mut QpInner`, so we are
            // the ring's only producer now.
            let _ = unsafe { ring.send_some(&unwritten, writer, true, || false) };
        }
        for (i, outstanding) in inner.outstanding.drain(..).enumerate() {
            let status = match (i, first) {
                (0, Some(status)) => status,
                _ => outstanding
                    .local_error
                    .filter(|_| i == 0)
                    .unwrap_or(WcStatus::WrFlushErr),
            };
            let opcode = outstanding.wr.op.completion_opcode();
            self.send_cq.push(
                self.completion(outstanding.wr.wr_id, status, opcode, 0, None),
                false,
            );
        }
        for wr in inner.recv_queue.drain(..) {
            self.recv_cq.push(
                self.completion(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0, None),
                false,
            );
        }
        inner.early_requests.clear();
        if let Some(writer) = inner.writer.take() {
            let _ = writer.shutdown(Shutdown::Both);
        }
        tracing::debug!(qp = self.qp_num, ?first, "soft QP entered ERROR");
    }

    /// One turn of this QP's engine (`engine.rs`), after a doorbell, EOF or
    /// a timer: swallows the doorbells, progresses the QP unless a caller
    /// polls it (that caller reads the ring itself and fires RNR resends;
    /// EOF still goes through), then says how to wait next: napping with
    /// the sleeping flag clear while a caller polls (producers ring no
    /// doorbell; the nap bounds the wait of a message that arrives just as
    /// the polling stops), else asleep with the flag set. `Err(())`: bytes
    /// arrived while it was going to sleep, take another turn.
    pub(crate) fn engine_turn(
        &self,
        waiter: &UnixStream,
        ring: &RingPair,
        generation: u64,
    ) -> Result<super::engine::Next, ()> {
        use super::engine::Next;
        if self.generation.load(AtomicOrdering::SeqCst) != generation {
            return Ok(Next::Done);
        }
        ring.set_sleeping(false);
        let peer_gone = drain_doorbells(waiter);
        // A caller reading the ring right now (it holds the reader) may
        // leave acknowledgements for its next poll: look again after a nap.
        let mut caller_active = false;
        if peer_gone || !ring.polled_recently() {
            match self.try_progress(true) {
                Some(true) => {}
                Some(false) => return Ok(Next::Done),
                None if self.lock().state == QpState::Error => return Ok(Next::Done),
                None => caller_active = true,
            }
        }
        let (timer_due, backlogged) = {
            let mut inner = self.lock();
            if inner
                .backlog_since
                .is_some_and(|since| since.elapsed() > BACKLOG_TIMEOUT)
            {
                // The peer has stopped reading.
                self.enter_error(&mut inner, Some(WcStatus::RetryExcErr));
                return Ok(Next::Done);
            }
            if inner.outstanding.is_empty() {
                self.ack_deadline.store(0, AtomicOrdering::Relaxed);
            } else if !caller_active && self.answer_overdue() {
                // The ring was read just above (no caller holds it): the
                // peer has answered nothing for the whole time-out.
                tracing::debug!(qp = self.qp_num, "soft peer answers none of our requests");
                self.enter_error(&mut inner, Some(WcStatus::RetryExcErr));
                return Ok(Next::Done);
            }
            if !inner.unwritten.is_empty() && !ring.polled_recently() {
                // Acknowledgements a polling caller left for its next poll
                // before it stopped (or what a full ring did not take): the
                // engine writes them, as far as the peer's ring has room.
                self.flush_some(&mut inner);
            }
            (inner.timer_due(), !inner.unwritten.is_empty())
        };
        // The second look catches a caller that stopped (and set the flag
        // for us) between the first look and the clearing.
        let polled = ring.polled_recently() && {
            ring.set_sleeping(false);
            ring.polled_recently()
        };
        if polled || backlogged || caller_active {
            // Messages not written yet (the polling caller's to write, or
            // the peer's ring was full) are looked at again after a nap;
            // meanwhile the peer's requests wait in its ring.
            let nap = Instant::now() + super::ring::POLLED_ENGINE_NAP;
            return Ok(Next::Wait(Some(timer_due.map_or(nap, |at| at.min(nap)))));
        }
        // Say we sleep, look once more, then sleep: a producer that
        // publishes after our look sees the flag and rings the doorbell.
        if ring.may_sleep() {
            Ok(Next::Wait(timer_due))
        } else {
            Err(())
        }
    }

    /// Outstanding requests (from now on) must see an answer within
    /// [`ACK_TIMEOUT`].
    fn await_answer_from_now(&self) {
        self.ack_deadline.store(
            now_millis() + ACK_TIMEOUT.as_millis() as u64,
            AtomicOrdering::Relaxed,
        );
    }

    /// True when requests are outstanding and the peer has answered none of
    /// them for [`ACK_TIMEOUT`] (a lock-free look: the engine's turn decides).
    pub(crate) fn answer_overdue(&self) -> bool {
        let deadline = self.ack_deadline.load(AtomicOrdering::Relaxed);
        deadline != 0 && now_millis() >= deadline
    }

    /// True when a caller that polled this QP stopped without arming a CQ
    /// and left work that nobody would otherwise do: doorbells turned off,
    /// or acknowledgements kept for its next poll.
    pub(crate) fn left_by_poller(&self, ring: &RingPair) -> bool {
        !ring.polled_recently()
            && (ring.abandoned_by_poller() || self.responses_pending.load(AtomicOrdering::Relaxed))
    }

    /// The engine could not take this QP: it fails.
    pub(crate) fn fail_from_engine(&self) {
        self.enter_error(&mut self.lock(), None);
    }

    /// Progress on behalf of a caller polling a CQ: marks the process as
    /// polling (its engine thread then naps without asking for doorbells),
    /// writes the acknowledgements the previous poll left, and reads the ring
    /// only; the socket (doorbells, EOF) is the engine thread's, which keeps
    /// watching it. No system call per poll.
    ///
    /// The common case, nothing arrived, nothing to acknowledge and no RNR
    /// timer pending, takes no lock: a few atomic loads.
    pub(crate) fn progress_polled(&self) {
        let Some(ring) = self.polled_ring.get() else {
            return;
        };
        ring.note_poll();
        if self.responses_pending.load(AtomicOrdering::Relaxed) {
            self.flush(&mut self.lock());
        }
        if ring.has_data() || self.timer_pending.load(AtomicOrdering::Relaxed) {
            self.progress_from(false);
        }
    }

    /// Progress for the last poll of an armed CQ, before its caller sleeps
    /// on the channel: reads the ring (not the socket: doorbells and EOF are
    /// the engine's) and writes every pending acknowledgement now.
    pub(crate) fn progress_before_sleep(&self) {
        let Some(ring) = self.polled_ring.get() else {
            return;
        };
        if ring.has_data() || self.timer_pending.load(AtomicOrdering::Relaxed) {
            self.progress_from(false);
        }
        if self.responses_pending.load(AtomicOrdering::Relaxed) {
            self.flush(&mut self.lock());
        }
    }

    /// The caller that polled stopped (it armed a CQ to sleep): asks for
    /// doorbells again and writes the acknowledgements left pending.
    pub(crate) fn stop_polling(&self) {
        let mut inner = self.lock();
        if let Some(ring) = inner.ring.as_ref() {
            ring.stop_polling();
        }
        self.flush(&mut inner);
    }

    /// Executes every request and response waiting on the wire (doorbells
    /// and EOF on the socket too with `check_socket`, the engine's part),
    /// without blocking, and fires a due RNR resend. Returns false once the
    /// QP is in ERROR.
    fn progress_from(&self, check_socket: bool) -> bool {
        self.try_progress(check_socket)
            .unwrap_or_else(|| self.lock().state != QpState::Error)
    }

    /// [`QpShared::progress_from`], or `None` when another thread holds the
    /// reader (a caller polling reads the ring right now).
    fn try_progress(&self, check_socket: bool) -> Option<bool> {
        let mut guard = match self.reader.try_lock() {
            Ok(guard) => guard,
            Err(std::sync::TryLockError::WouldBlock) => return None,
            Err(std::sync::TryLockError::Poisoned(poison)) => poison.into_inner(),
        };
        if let Some((stream, reader, ring)) = guard.as_mut() {
            // Doorbells first, so that once the ring is read (and completions
            // raised, waking their waiter) no system call is left in this
            // pass. After EOF the ring is still read: whatever the peer
            // published before it went is ours.
            let peer_gone = check_socket && drain_doorbells(stream);
            loop {
                {
                    let mut inner = self.lock();
                    if let Some((_, until)) = &inner.held {
                        if Instant::now() < *until {
                            // Held by the fault injector: nothing behind it
                            // is read until it is handled.
                            break;
                        }
                        let (message, _) = inner.held.take().expect("held");
                        self.note_timers(&inner);
                        self.on_message(&mut inner, message);
                        if inner.state == QpState::Error {
                            return Some(false);
                        }
                        continue;
                    }
                    if inner.unwritten.len() >= ENGINE_BACKLOG && !self.flush_some(&mut inner) {
                        // The peer does not drain its ring: read no more of
                        // its requests (each owes it a response) until it
                        // does, whoever reads (the engine or a polling
                        // caller). The engine retries after a nap.
                        break;
                    }
                }
                // SAFETY: this QP's ring pair is consumed only here, through
                // the reader lock we hold (`guard`): no other consumer while
                // this reader lives.
                let outcome = match reader.read(&mut unsafe { RingReader::new(ring) }) {
                    Ok(ReadOutcome::TimedOut) if peer_gone => Ok(ReadOutcome::Closed),
                    outcome => outcome,
                };
                let mut inner = self.lock();
                match outcome {
                    Ok(ReadOutcome::Message(message)) if self.faults.roll(FaultKind::Delay) => {
                        let until = Instant::now() + self.faults.delay();
                        inner.held = Some((message, until));
                        self.note_timers(&inner);
                        // The engine keeps the timer (a caller that polls
                        // may sleep on its CQ before the hold ends).
                        let key = self.engine_key.load(AtomicOrdering::Acquire);
                        if key != 0 {
                            super::engine::poke(self.qp_num, key);
                        }
                    }
                    Ok(ReadOutcome::Message(message)) => self.on_message(&mut inner, message),
                    Ok(ReadOutcome::TimedOut) => {
                        // The wire is drained: acknowledge the whole batch at
                        // once. A polling caller leaves the acknowledgements
                        // for its next post_send (one ring write for both) or
                        // its next poll, whichever comes first, so its
                        // completions reach it one ring write sooner.
                        if check_socket {
                            self.flush_some(&mut inner);
                        } else if !inner.unwritten.is_empty() {
                            self.responses_pending.store(true, AtomicOrdering::Relaxed);
                        }
                        break;
                    }
                    Ok(ReadOutcome::Closed) | Err(_) => {
                        // The peer is gone (or broke the protocol): requests in
                        // flight can never be acknowledged.
                        let first =
                            (!inner.outstanding.is_empty()).then_some(WcStatus::RetryExcErr);
                        self.enter_error(&mut inner, first);
                        return Some(false);
                    }
                }
                if inner.state == QpState::Error {
                    return Some(false);
                }
            }
        }
        drop(guard);
        let mut inner = self.lock();
        if inner.rnr_resend_at.is_some_and(|at| Instant::now() >= at) {
            inner.rnr_resend_at = None;
            self.note_timers(&inner);
            self.send_unsent(&mut inner);
        }
        Some(inner.state != QpState::Error)
    }

    /// A message read from the wire: a request to execute or an answer.
    fn on_message(&self, inner: &mut QpInner, message: Message) {
        match message {
            Message::Request(request) => self.on_request(inner, request),
            Message::Response(response) => self.on_response(inner, response),
        }
    }

    /// Mirrors whether a timer is set ([`QpShared::timer_pending`]); call
    /// after setting or clearing one.
    fn note_timers(&self, inner: &QpInner) {
        self.timer_pending
            .store(inner.timer_due().is_some(), AtomicOrdering::Relaxed);
    }

    // ------------------------------------------------------------ responder

    fn on_request(&self, inner: &mut QpInner, request: Request) {
        match inner.state {
            QpState::Rtr | QpState::Rts => {}
            QpState::Reset | QpState::Init => {
                if inner.early_requests.len() >= MAX_EARLY_REQUESTS {
                    tracing::debug!(qp = self.qp_num, "soft peer flooded a QP before RTR");
                    self.enter_error(inner, None);
                    return;
                }
                inner.early_requests.push_back(request);
                return;
            }
            QpState::Error => return,
        }
        if request.seq != inner.expected_seq {
            // After an RNR NAK: drop until the NAKed request comes again.
            return;
        }
        if request.consumes_receive() && !self.recv_cq_has_room(inner) {
            // Its completion would overflow the CQ (hardware would then
            // lose completions and fail the CQ): the QP fails first, before
            // the request takes a receive, so every receive it took has its
            // completion in a CQ that still polls (a pool gets its slots
            // back). A peer that floods SENDs faster than its owner polls
            // (or before the owner polls at all) ends its own connection.
            tracing::debug!(
                qp = self.qp_num,
                "soft peer's requests would overflow the receive CQ"
            );
            self.enter_error(inner, None);
            return;
        }
        let seq = request.seq;
        let ack = request.ack;
        let outcome = self.execute(inner, request);
        match outcome {
            Outcome::RnrNak => {}
            Outcome::Ack | Outcome::AtomicAck(_) => inner.expected_seq += 1,
            Outcome::RemoteAccess | Outcome::RemoteInvalid | Outcome::RemoteOperation => {}
        }
        let needs = match (outcome, ack) {
            (Outcome::Ack | Outcome::AtomicAck(_), AckUrgency::Lazy) => 0,
            (Outcome::Ack | Outcome::AtomicAck(_), AckUrgency::Completion) => need::SEND_OK,
            (Outcome::Ack | Outcome::AtomicAck(_), AckUrgency::Slots) => need::ENGINE,
            // The initiator's engine keeps the RNR timer.
            (Outcome::RnrNak, _) => need::ENGINE,
            (Outcome::RemoteAccess | Outcome::RemoteInvalid | Outcome::RemoteOperation, _) => {
                need::SEND_ERROR
            }
        };
        self.write(inner, &Response { seq, outcome }, needs);
        if matches!(
            outcome,
            Outcome::RemoteAccess | Outcome::RemoteInvalid | Outcome::RemoteOperation
        ) {
            // As on rxe: the responder's QP goes to ERROR too.
            self.enter_error(inner, None);
        }
    }

    /// Whether the receive CQ has room for one more receive completion and
    /// still for the flush of everything this QP has outstanding (the
    /// completions an ERROR would push), when sends complete there too.
    fn recv_cq_has_room(&self, inner: &QpInner) -> bool {
        let mut reserve = 1 + inner.recv_queue.len();
        if self.recv_cq.is(&self.send_cq) {
            reserve += inner.outstanding.len();
        }
        self.recv_cq.room() >= reserve
    }

    fn take_receive(&self, inner: &mut QpInner) -> Option<RecvWr> {
        match &self.srq {
            Some(srq) => lock(&srq.queue).pop_front(),
            None => inner.recv_queue.pop_front(),
        }
    }

    /// Copies `remote` (the peer's memory) into `local` (ours): the one
    /// direction the soft provider moves payload across processes. Every
    /// write into a process's memory happens in that process, with the
    /// target checked against its own region table at the time of the copy.
    ///
    /// # Safety
    /// As for [`super::memory::read_from`]: for the whole call every `local`
    /// span must be memory of this process valid for writes of its whole
    /// length, which nothing reads or writes meanwhile through a Rust
    /// reference.
    unsafe fn pull(
        process: Option<&Arc<PeerProcess>>,
        remote: &[Span],
        local: &[Span],
    ) -> std::io::Result<()> {
        let process = process.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotConnected, "soft QP has no peer")
        })?;
        // SAFETY: our caller's guarantee for `local`, for this call; the
        // closure runs (once) within it.
        process.transfer(|pid| unsafe { super::parallel::read_from(pid, remote, local) })
    }

    fn execute(&self, inner: &mut QpInner, request: Request) -> Outcome {
        let len = request.len();
        match request.op {
            RequestOp::Send { imm } => {
                if self.faults.roll(FaultKind::RnrDrop) {
                    return Outcome::RnrNak;
                }
                let Some(recv) = self.take_receive(inner) else {
                    return Outcome::RnrNak;
                };
                let capacity: usize = recv.sg_list.iter().map(|s| s.length as usize).sum();
                let spans: Vec<Span> = recv.sg_list.iter().map(|s| (s.addr, s.length)).collect();
                // Checks and the copy (from the descriptor, or pulled from
                // the initiator) under one look at the region table: the
                // receive buffers stay registered until it ends.
                let process = inner.process.clone();
                let checked = self.context.with_regions(|regions| {
                    let local_ok = recv
                        .sg_list
                        .iter()
                        .all(|sge| self.check_local(regions, sge, true).is_ok());
                    if !local_ok {
                        return Err((WcStatus::LocProtErr, Outcome::RemoteOperation));
                    }
                    if capacity < len {
                        return Err((WcStatus::LocLenErr, Outcome::RemoteInvalid));
                    }
                    if let Some(bytes) = &request.inline {
                        // SAFETY: every receive SGE lies in a region of ours
                        // with LOCAL_WRITE (checked just above), registered
                        // until `with_regions` returns; they hold ≥ len
                        // bytes; `bytes` is the decoded descriptor's own
                        // allocation.
                        unsafe { memory::copy_into_spans(bytes, &spans) };
                    } else {
                        // SAFETY: the destination is the first `len` bytes
                        // of the receive SGEs, each inside a region of ours
                        // with LOCAL_WRITE (checked just above) that stays
                        // in the table until `with_regions` returns; by the
                        // contract of the unsafe registration that put it
                        // there, its memory is allocated and may be written
                        // behind the compiler's back meanwhile.
                        unsafe {
                            Self::pull(
                                process.as_ref(),
                                &request.spans,
                                &memory::truncate(&spans, len),
                            )
                        }
                        .map_err(|_| (WcStatus::LocProtErr, Outcome::RemoteOperation))?;
                    }
                    Ok(())
                });
                let pulled = checked;
                if let Err((status, outcome)) = pulled {
                    self.recv_cq.push(
                        self.completion(recv.wr_id, status, WcOpcode::Recv, 0, None),
                        false,
                    );
                    return outcome;
                }
                let completion = self.completion(
                    recv.wr_id,
                    WcStatus::Success,
                    WcOpcode::Recv,
                    len as u32,
                    imm,
                );
                self.recv_cq.push(completion, request.solicited);
                Outcome::Ack
            }
            RequestOp::Write {
                remote_addr,
                rkey,
                imm,
            } => {
                let target = [(remote_addr, len as u32)];
                let process = inner.process.clone();
                let checked = self.context.with_regions(|regions| {
                    self.check_remote_in(
                        regions,
                        rkey,
                        remote_addr,
                        len as u64,
                        AccessFlags::REMOTE_WRITE,
                    )?;
                    let recv = match imm {
                        Some(_) => Some(self.take_receive(inner).ok_or(Outcome::RnrNak)?),
                        None => None,
                    };
                    if let Some(bytes) = &request.inline {
                        // SAFETY: the target lies in a region of ours with
                        // REMOTE_WRITE (checked just above), registered until
                        // `with_regions` returns; `bytes` is the decoded
                        // descriptor's own allocation.
                        unsafe { memory::copy_into_spans(bytes, &target) };
                    } else if len > 0 {
                        // Pulled while the target is known registered.
                        // SAFETY: the target lies in a region of ours with
                        // REMOTE_WRITE (checked just above) that stays in
                        // the table until `with_regions` returns; by the
                        // contract of the unsafe registration that put it
                        // there, its memory is allocated and may be written
                        // behind the compiler's back meanwhile.
                        unsafe { Self::pull(process.as_ref(), &request.spans, &target) }
                            .map_err(|_| Outcome::RemoteOperation)?;
                    }
                    Ok(recv)
                });
                let recv = match checked {
                    Ok(recv) => recv,
                    Err(outcome) => return outcome,
                };
                if let Some(recv) = recv {
                    let completion = self.completion(
                        recv.wr_id,
                        WcStatus::Success,
                        WcOpcode::RecvRdmaWithImm,
                        len as u32,
                        imm,
                    );
                    self.recv_cq.push(completion, request.solicited);
                }
                Outcome::Ack
            }
            RequestOp::Read { remote_addr, rkey } => {
                // The responder only grants the READ; the initiator pulls the
                // bytes into its own memory when the grant arrives (a process
                // never writes into another's memory).
                match self.check_remote(rkey, remote_addr, len as u64, AccessFlags::REMOTE_READ) {
                    Ok(()) => Outcome::Ack,
                    Err(outcome) => outcome,
                }
            }
            RequestOp::CompareSwap {
                remote_addr, rkey, ..
            }
            | RequestOp::FetchAdd {
                remote_addr, rkey, ..
            } => {
                if remote_addr % 8 != 0 || len != 8 {
                    return Outcome::RemoteInvalid;
                }
                self.context
                    .with_regions(|regions| {
                        self.check_remote_in(
                            regions,
                            rkey,
                            remote_addr,
                            8,
                            AccessFlags::REMOTE_ATOMIC,
                        )?;
                        // SAFETY: `remote_addr` is 8-byte aligned (checked
                        // above) and its 8 bytes lie inside a region of ours
                        // with REMOTE_ATOMIC (checked just above; registering
                        // that required LOCAL_WRITE) that stays in the table
                        // until `with_regions` returns: by the contract of the
                        // unsafe registration that put it there, allocated
                        // memory the device may write behind the compiler's
                        // back. The reference does not leave this closure.
                        // Every soft atomic is an AtomicU64 access like this
                        // one; keeping other accesses to these bytes from
                        // racing with it is the application's part, as with
                        // an HCA's atomic unit.
                        let target = unsafe {
                            std::sync::atomic::AtomicU64::from_ptr(remote_addr as usize as *mut u64)
                        };
                        Ok(Self::apply_atomic(target, &request.op))
                    })
                    .unwrap_or_else(|outcome| outcome)
            }
        }
    }

    /// Carries out an atomic on `target`; the value before it.
    fn apply_atomic(target: &std::sync::atomic::AtomicU64, op: &RequestOp) -> Outcome {
        let old = match *op {
            RequestOp::CompareSwap { compare, swap, .. } => {
                match target.compare_exchange(
                    compare,
                    swap,
                    AtomicOrdering::SeqCst,
                    AtomicOrdering::SeqCst,
                ) {
                    Ok(old) | Err(old) => old,
                }
            }
            RequestOp::FetchAdd { add, .. } => target.fetch_add(add, AtomicOrdering::SeqCst),
            _ => return Outcome::RemoteInvalid,
        };
        Outcome::AtomicAck(old)
    }

    // ------------------------------------------------------------ initiator

    fn on_response(&self, inner: &mut QpInner, response: Response) {
        if inner.state == QpState::Error {
            return;
        }
        // The peer answers: the next answer is due a full time-out from now.
        self.await_answer_from_now();
        let Some(head) = inner.outstanding.front() else {
            return;
        };
        if head.seq != response.seq {
            tracing::warn!(
                qp = self.qp_num,
                expected = head.seq,
                got = response.seq,
                "soft QP: unexpected response"
            );
            return;
        }
        match response.outcome {
            Outcome::Ack | Outcome::AtomicAck(_) if self.faults.roll(FaultKind::QpError) => {
                self.enter_error(inner, None);
            }
            Outcome::Ack | Outcome::AtomicAck(_)
                if self.faults.roll(FaultKind::ErrorCompletion) =>
            {
                let status = self.faults.error_status();
                self.enter_error(inner, Some(status));
            }
            Outcome::Ack | Outcome::AtomicAck(_) => {
                let done = inner.outstanding.pop_front().expect("head exists");
                inner.rnr_retries_left = inner.options.rnr_retry;
                let status = self.finish_locally(inner, &done, response.outcome);
                if status != WcStatus::Success || done.wr.signaled || self.sq_sig_all {
                    let opcode = done.wr.op.completion_opcode();
                    let len = done.request.len() as u32;
                    self.send_cq.push(
                        self.completion(done.wr.wr_id, status, opcode, len, None),
                        false,
                    );
                }
                if status != WcStatus::Success {
                    self.enter_error(inner, None);
                    return;
                }
                self.retire_local_errors(inner);
            }
            Outcome::RnrNak => {
                if inner.options.rnr_retry == 7 || inner.rnr_retries_left > 0 {
                    if inner.options.rnr_retry != 7 {
                        inner.rnr_retries_left -= 1;
                    }
                    inner.rnr_resend_at = Some(Instant::now() + inner.options.rnr_timer);
                    self.note_timers(inner);
                    // A polling caller read this NAK, most often, and may be
                    // asleep on its CQ when the timer is due: the engine
                    // keeps the timer (a turn now arms it). Without it the
                    // resend waited for the next poll or the ACK time-out.
                    let key = self.engine_key.load(AtomicOrdering::Acquire);
                    if key != 0 {
                        super::engine::poke(self.qp_num, key);
                    }
                } else {
                    self.enter_error(inner, Some(WcStatus::RnrRetryExcErr));
                }
            }
            Outcome::RemoteAccess => self.enter_error(inner, Some(WcStatus::RemAccessErr)),
            Outcome::RemoteInvalid => self.enter_error(inner, Some(WcStatus::RemInvReqErr)),
            Outcome::RemoteOperation => self.enter_error(inner, Some(WcStatus::RemOpErr)),
        }
    }

    /// The initiator's share of an acknowledged request: a READ's bytes are
    /// pulled from the responder, an atomic's old value written, each into
    /// our own memory while its region is known registered (the local SGEs
    /// are checked again now: they may have been deregistered since the post).
    fn finish_locally(&self, inner: &QpInner, done: &Outstanding, outcome: Outcome) -> WcStatus {
        // The answer must fit the request: an atomic's old value only for an
        // atomic. A peer that answers a SEND or WRITE with one would have us
        // write its bytes into the request's source.
        let atomic = matches!(
            done.request.op,
            RequestOp::CompareSwap { .. } | RequestOp::FetchAdd { .. }
        );
        if matches!(outcome, Outcome::AtomicAck(_)) && !atomic {
            return WcStatus::BadRespErr;
        }
        let writes_locally = matches!(outcome, Outcome::AtomicAck(_))
            || matches!(done.request.op, RequestOp::Read { .. });
        if !writes_locally {
            return WcStatus::Success;
        }
        let local: Vec<Span> = done.wr.sg_list.iter().map(|s| (s.addr, s.length)).collect();
        let result = self.context.with_regions(|regions| {
            if !done
                .wr
                .sg_list
                .iter()
                .all(|sge| self.check_local(regions, sge, true).is_ok())
            {
                return Err(WcStatus::LocProtErr);
            }
            match (outcome, done.request.op) {
                (Outcome::AtomicAck(old), _) => {
                    if local.iter().map(|(_, len)| *len as usize).sum::<usize>() < 8 {
                        return Err(WcStatus::LocLenErr);
                    }
                    // SAFETY: every local SGE lies in a region of ours with
                    // LOCAL_WRITE (checked just above), registered until
                    // `with_regions` returns, and they hold ≥ 8 bytes; the
                    // source is a local array, disjoint from them.
                    unsafe { memory::copy_into_spans(&old.to_le_bytes(), &local) };
                    Ok(())
                }
                (_, RequestOp::Read { remote_addr, .. }) => {
                    let len = done.request.len();
                    if len == 0 {
                        return Ok(());
                    }
                    // SAFETY: every local SGE lies in a region of ours with
                    // LOCAL_WRITE (checked just above) that stays in the
                    // table until `with_regions` returns; by the contract of
                    // the unsafe registration that put it there, its memory
                    // is allocated and may be written behind the compiler's
                    // back meanwhile.
                    unsafe {
                        Self::pull(inner.process.as_ref(), &[(remote_addr, len as u32)], &local)
                    }
                    .map_err(|error| {
                        if error.kind() == std::io::ErrorKind::ConnectionAborted
                            || error.raw_os_error() == Some(libc::ESRCH)
                        {
                            // The responder died under the READ: as on a
                            // device, its response never comes.
                            WcStatus::RetryExcErr
                        } else {
                            WcStatus::RemOpErr
                        }
                    })?;
                    // A responder that entered ERROR since it granted the
                    // READ may have revoked the bytes and reused them (its
                    // pool hands a buffer to the next message): what was
                    // pulled may be another message's. As on a device whose
                    // peer failed before sending the data: no response.
                    if inner.ring.as_ref().is_some_and(|ring| ring.peer_closed()) {
                        return Err(WcStatus::RetryExcErr);
                    }
                    Ok(())
                }
                _ => Ok(()),
            }
        });
        result.err().unwrap_or(WcStatus::Success)
    }

    /// A request that failed local checks completes (with its error) once it
    /// is the oldest, and takes the QP to ERROR.
    fn retire_local_errors(&self, inner: &mut QpInner) {
        if let Some(status) = inner.outstanding.front().and_then(|head| head.local_error) {
            self.enter_error(inner, Some(status));
        }
    }

    fn build_request(
        &self,
        wr: &SendWr,
        seq: u64,
    ) -> Result<(Request, Option<WcStatus>), VerbsError> {
        let caps = self.caps;
        if wr.sg_list.len() > caps.max_send_sge as usize {
            return Err(VerbsError::InvalidArgument(
                "more SGEs than the QP's max_send_sge",
            ));
        }
        let total: u64 = wr.sg_list.iter().map(|s| u64::from(s.length)).sum();
        if total > u64::from(u32::MAX) {
            return Err(VerbsError::InvalidArgument(
                "a work request moves at most 4 GiB",
            ));
        }
        let is_atomic = matches!(
            wr.op,
            SendOp::AtomicCmpAndSwp { .. } | SendOp::AtomicFetchAndAdd { .. }
        );
        if is_atomic && total != 8 {
            return Err(VerbsError::InvalidArgument("atomics take one 8-byte SGE"));
        }
        if wr.inline && (wr.op.writes_locally() || total > u64::from(caps.max_inline_data)) {
            return Err(VerbsError::InvalidArgument(
                "inline data too long (max_inline_data) or not a send/write",
            ));
        }
        let op = match wr.op {
            SendOp::Send => RequestOp::Send { imm: None },
            SendOp::SendWithImm(imm) => RequestOp::Send { imm: Some(imm) },
            SendOp::RdmaWrite { remote_addr, rkey } => RequestOp::Write {
                remote_addr,
                rkey,
                imm: None,
            },
            SendOp::RdmaWriteWithImm {
                remote_addr,
                rkey,
                imm,
            } => RequestOp::Write {
                remote_addr,
                rkey,
                imm: Some(imm),
            },
            SendOp::RdmaRead { remote_addr, rkey } => RequestOp::Read { remote_addr, rkey },
            SendOp::AtomicCmpAndSwp {
                remote_addr,
                rkey,
                compare,
                swap,
            } => RequestOp::CompareSwap {
                remote_addr,
                rkey,
                compare,
                swap,
            },
            SendOp::AtomicFetchAndAdd {
                remote_addr,
                rkey,
                add,
            } => RequestOp::FetchAdd {
                remote_addr,
                rkey,
                add,
            },
        };
        let spans: Vec<Span> = wr.sg_list.iter().map(|s| (s.addr, s.length)).collect();
        let mut local_error = None;
        let mut inline = None;
        if wr.inline {
            match memory::gather_own(&spans) {
                Ok(bytes) => inline = Some(bytes),
                Err(_) => local_error = Some(WcStatus::LocProtErr),
            }
        } else {
            // Small SENDs and WRITEs carry their bytes in the descriptor (read
            // now, after the lkey checks): the responder then needs no
            // process_vm_readv. The verbs contract already forbids changing
            // the buffer before the completion, so when it is read is ours.
            let eager = !wr.op.writes_locally() && total <= EAGER_COPY_BYTES;
            self.context.with_regions(|regions| {
                local_error = wr
                    .sg_list
                    .iter()
                    .find_map(|sge| self.check_local(regions, sge, wr.op.writes_locally()).err());
                if local_error.is_none() && eager {
                    let mut bytes = Vec::with_capacity(total as usize);
                    // SAFETY: every SGE lies in a region of ours (checked just
                    // above), registered until `with_regions` returns, so
                    // allocated memory (the registration contract); `bytes`
                    // was just allocated, so its buffer overlaps none of them.
                    unsafe { memory::copy_from_spans(&spans, &mut bytes) };
                    inline = Some(bytes);
                }
            });
        }
        let request = Request {
            seq,
            op,
            solicited: wr.solicited,
            ack: if wr.signaled || self.sq_sig_all {
                AckUrgency::Completion
            } else {
                AckUrgency::Lazy
            },
            spans: if inline.is_some() { vec![] } else { spans },
            inline,
        };
        Ok((request, local_error))
    }
}

// SAFETY: soft executes requests exactly as their SGEs say (keys checked), completes each on the
// QP's own CQs once, flushes all outstanding ones on ERROR, and numbers QPs uniquely within the
// process.
unsafe impl QueuePair for SoftQp {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn qp_num(&self) -> u32 {
        self.shared.qp_num
    }

    fn state(&self) -> QpState {
        self.shared.lock().state
    }

    fn caps(&self) -> QpCaps {
        self.shared.caps
    }

    fn local_address(&self) -> QpAddress {
        let mut extra = Vec::with_capacity(ADDRESS_EXTRA_LEN);
        extra.extend_from_slice(&self.shared.context.pid.to_le_bytes());
        extra.extend_from_slice(&self.shared.context.id.to_le_bytes());
        extra.extend_from_slice(&self.shared.secret);
        QpAddress {
            qp_num: self.shared.qp_num,
            psn: 0,
            lid: 0,
            gid: [0; 16],
            mtu: 4096,
            extra,
        }
    }

    fn to_init(&self) -> Result<(), VerbsError> {
        let mut inner = self.shared.lock();
        if inner.state != QpState::Reset {
            return Err(VerbsError::InvalidState {
                qp_num: self.shared.qp_num,
                state: inner.state,
                what: "to_init needs RESET",
            });
        }
        inner.state = QpState::Init;
        Ok(())
    }

    fn to_rtr(&self, remote: &QpAddress, options: &ConnectOptions) -> Result<(), VerbsError> {
        if remote.extra.len() != ADDRESS_EXTRA_LEN {
            return Err(VerbsError::InvalidArgument(
                "not a soft-provider queue pair address",
            ));
        }
        if options.rnr_retry > 7 || options.retry_count > 7 {
            return Err(VerbsError::InvalidArgument(
                "rnr_retry and retry_count are 0..=7",
            ));
        }
        let peer = Peer {
            pid: u32::from_le_bytes(remote.extra[..4].try_into().expect("4")),
            context: u64::from_le_bytes(remote.extra[4..12].try_into().expect("8")),
            qp_num: remote.qp_num,
        };
        let peer_secret: Secret = remote.extra[12..].try_into().expect("SECRET_LEN");
        let me = (
            self.shared.context.pid,
            self.shared.context.id,
            self.shared.qp_num,
        );
        let dial = me > (peer.pid, peer.context, peer.qp_num);
        {
            let mut inner = self.shared.lock();
            if inner.state != QpState::Init {
                return Err(VerbsError::InvalidState {
                    qp_num: self.shared.qp_num,
                    state: inner.state,
                    what: "to_rtr needs INIT",
                });
            }
            if inner.peer.is_some_and(|attached| attached != peer) {
                return Err(VerbsError::InvalidArgument(
                    "another peer already connected to this QP",
                ));
            }
            inner.peer = Some(peer);
            inner.options = *options;
            inner.rnr_retries_left = options.rnr_retry;
            inner.state = QpState::Rtr;
            let early: Vec<Request> = inner.early_requests.drain(..).collect();
            for request in early {
                self.shared.on_request(&mut inner, request);
            }
            self.shared.flush(&mut inner);
        }
        if dial {
            if let Err(error) = self.dial(peer, &peer_secret) {
                let mut inner = self.shared.lock();
                self.shared.enter_error(&mut inner, None);
                return Err(error);
            }
        }
        Ok(())
    }

    fn to_rts(&self) -> Result<(), VerbsError> {
        let mut inner = self.shared.lock();
        if inner.state != QpState::Rtr {
            return Err(VerbsError::InvalidState {
                qp_num: self.shared.qp_num,
                state: inner.state,
                what: "to_rts needs RTR",
            });
        }
        inner.state = QpState::Rts;
        Ok(())
    }

    fn to_error(&self) -> Result<(), VerbsError> {
        let mut inner = self.shared.lock();
        self.shared.enter_error(&mut inner, None);
        Ok(())
    }

    unsafe fn post_send(&self, wrs: Vec<SendWr>) -> Result<(), PostError<SendWr>> {
        let shared = &self.shared;
        let mut inner = shared.lock();
        let mut wrs = wrs.into_iter();
        while let Some(wr) = wrs.next() {
            let reject = |error, wr, rest: std::vec::IntoIter<SendWr>| {
                Err(PostError::handing_back(error, wr, rest))
            };
            match inner.state {
                QpState::Rts => {}
                QpState::Error => {
                    // Posting to a QP in ERROR is allowed; the request is flushed.
                    let opcode = wr.op.completion_opcode();
                    shared.send_cq.push(
                        shared.completion(wr.wr_id, WcStatus::WrFlushErr, opcode, 0, None),
                        false,
                    );
                    continue;
                }
                state => {
                    let error = VerbsError::InvalidState {
                        qp_num: shared.qp_num,
                        state,
                        what: "post_send needs RTS",
                    };
                    return reject(error, wr, wrs);
                }
            }
            if inner.outstanding.len() >= shared.caps.max_send_wr as usize {
                return reject(VerbsError::QueueFull("send queue"), wr, wrs);
            }
            let seq = inner.next_seq;
            let (mut request, local_error) = match shared.build_request(&wr, seq) {
                Ok(built) => built,
                Err(error) => return reject(error, wr, wrs),
            };
            // Unsignaled requests are acknowledged lazily, unless the send
            // queue is filling up and needs its slots back.
            if request.ack == AckUrgency::Lazy
                && 2 * (inner.outstanding.len() + 1) >= shared.caps.max_send_wr as usize
            {
                request.ack = AckUrgency::Slots;
            }
            inner.next_seq += 1;
            let sendable = local_error.is_none()
                && inner.rnr_resend_at.is_none()
                && inner.outstanding.iter().all(|o| o.local_error.is_none());
            if sendable {
                shared.write(&mut inner, &request, QpShared::request_needs(&request));
            }
            if inner.outstanding.is_empty() {
                shared.await_answer_from_now();
            }
            inner.outstanding.push_back(Outstanding {
                wr,
                seq,
                request,
                local_error,
            });
            if !sendable {
                shared.retire_local_errors(&mut inner);
            }
        }
        shared.flush(&mut inner);
        Ok(())
    }

    unsafe fn post_recv(&self, wrs: Vec<RecvWr>) -> Result<(), PostError<RecvWr>> {
        let shared = &self.shared;
        let mut inner = shared.lock();
        let mut wrs = wrs.into_iter();
        while let Some(wr) = wrs.next() {
            let error = if shared.srq.is_some() {
                Some(VerbsError::InvalidArgument(
                    "this QP takes its receives from an SRQ",
                ))
            } else if inner.state == QpState::Reset {
                Some(VerbsError::InvalidState {
                    qp_num: shared.qp_num,
                    state: inner.state,
                    what: "post_recv needs INIT or later",
                })
            } else if wr.sg_list.len() > shared.caps.max_recv_sge as usize {
                Some(VerbsError::InvalidArgument(
                    "more SGEs than the QP's max_recv_sge",
                ))
            } else if inner.recv_queue.len() >= shared.caps.max_recv_wr as usize {
                Some(VerbsError::QueueFull("receive queue"))
            } else {
                None
            };
            if let Some(error) = error {
                return Err(PostError::handing_back(error, wr, wrs));
            }
            if inner.state == QpState::Error {
                shared.recv_cq.push(
                    shared.completion(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, 0, None),
                    false,
                );
                continue;
            }
            inner.recv_queue.push_back(wr);
        }
        Ok(())
    }
}

/// What the wire reader reads: the ring (WouldBlock when it is empty).
struct RingReader<'a>(&'a RingPair);

impl<'a> RingReader<'a> {
    /// # Safety
    /// While the reader lives, no other thread of this process consumes from
    /// `ring` ([`RingPair::receive`]'s contract).
    unsafe fn new(ring: &'a RingPair) -> RingReader<'a> {
        RingReader(ring)
    }
}

impl std::io::Read for RingReader<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        // SAFETY: a RingReader is built only by `new`, whose caller promised
        // to be the ring's only consumer while the reader lives.
        match unsafe { self.0.receive(out) }? {
            0 => Err(std::io::ErrorKind::WouldBlock.into()),
            n => Ok(n),
        }
    }
}

/// Reads and drops the doorbell bytes waiting on the socket; true when the
/// peer closed it (or it failed).
fn drain_doorbells(socket: &UnixStream) -> bool {
    use std::io::Read;
    let mut doorbells = [0u8; 64];
    loop {
        match wire::NonBlocking(socket).read(&mut doorbells) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return true,
        }
    }
}
