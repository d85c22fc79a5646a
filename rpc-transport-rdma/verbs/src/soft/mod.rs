//! `soft`: a software RDMA device with reliable-connected semantics, for
//! processes on one host and inside one process.
//!
//! How it works (see `docs/providers.md` for the comparison with the kernel):
//!
//! - **Keys and checks.** Each opened context keeps a table of its memory
//!   regions. Local SGEs are checked against it when posted (LOC_PROT_ERR);
//!   remote keys, ranges and access rights are checked by the *responder*
//!   against its own table (REM_ACCESS_ERR at the initiator), as an HCA would.
//! - **The wire.** Two connected QPs share a pair of single-producer
//!   single-consumer descriptor rings in shared memory (`ring`), with a Unix
//!   stream socket beside them for doorbells and EOF. A fixed set of engine
//!   threads per process (`engine`: one per core, at most 4, each an epoll
//!   loop) executes each QP's peer requests (the responder role) and
//!   retires its own (the initiator role); a caller polling a CQ does that
//!   work itself, with no thread hop and, when nothing arrived, no lock.
//! - **Payload.** Bytes move directly between the two address spaces with
//!   `process_vm_readv`/`process_vm_writev`, never through a network stack;
//!   messages up to 512 B travel inside their descriptor and are copied into
//!   registered memory with plain copies after the key checks. This needs
//!   the same user on both sides (no Yama restrictions measured on these
//!   hosts); registering memory needs no special allocation.
//! - **Completion channel.** A semaphore eventfd, one count per event
//!   waiting. A CQ's arm lives in shared memory (`wake`): a completion here
//!   or a peer about to cause one takes it, so a peer can wake a caller
//!   sleeping on the channel directly.
//! - **Failures.** A peer that dies closes the socket: the initiator's
//!   oldest request completes with RETRY_EXC_ERR and everything else flushes,
//!   at once.

mod engine;
// Without the feature its public types are not exported (no plan can be set).
#[cfg_attr(not(feature = "fault-injection"), allow(dead_code, unreachable_pub))]
mod faults;
pub mod floors;
#[cfg(test)]
mod loom_model;
mod memory;
mod parallel;
mod peer;
mod qp;
mod ring;
mod sync;
mod wake;
mod wire;

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};

#[cfg(feature = "fault-injection")]
pub use faults::{
    FAULTS_ENV, FaultCounts, FaultKind, FaultPlan, injected_faults, pause_injection,
    set_process_plan,
};
pub use peer::PeerPolicy;

use super::{
    AccessFlags, CompletionChannel, CompletionQueue, Context, DeviceCaps, DeviceInfo, MemoryRegion,
    PostError, ProtectionDomain, Provider, QpInit, QueuePair, RecvWr, SharedReceiveQueue,
    VerbsError, WorkCompletion,
};

/// The one device the soft provider offers.
pub const DEVICE_NAME: &str = "soft0";

/// The soft provider.
#[derive(Debug, Clone, Copy, Default)]
pub struct SoftProvider;

// SAFETY: `open` returns a `SoftContext`, which keeps `Context`'s contract.
unsafe impl Provider for SoftProvider {
    fn name(&self) -> &'static str {
        "soft"
    }

    fn devices(&self) -> Result<Vec<DeviceInfo>, VerbsError> {
        Ok(vec![DeviceInfo {
            name: DEVICE_NAME.into(),
            transport: "soft (shared host)".into(),
        }])
    }

    fn open(&self, device: &str) -> Result<Arc<dyn Context>, VerbsError> {
        let plan = faults::plan_from_env().map_err(|reason| VerbsError::ProviderUnavailable {
            provider: "soft",
            reason,
        })?;
        open_device(device, plan)
    }
}

fn open_device(
    device: &str,
    plan: Option<faults::FaultPlan>,
) -> Result<Arc<dyn Context>, VerbsError> {
    if device != DEVICE_NAME {
        return Err(VerbsError::NoSuchDevice(device.to_owned()));
    }
    Ok(Arc::new(SoftContext {
        shared: ContextShared::new(plan)?,
    }))
}

#[cfg(feature = "fault-injection")]
impl SoftProvider {
    /// Opens `device` with `plan`'s faults (see [`FaultPlan`]), whatever
    /// `RDMA_SOFT_FAULTS` says. Only with the feature `fault-injection`.
    pub fn open_with_faults(
        &self,
        device: &str,
        plan: FaultPlan,
    ) -> Result<Arc<dyn Context>, VerbsError> {
        open_device(device, Some(plan))
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct MrEntry {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) access: AccessFlags,
    pub(crate) pd: u64,
    /// A window bound to this local QP: only requests arriving on it may use it.
    pub(crate) bound_qp: Option<u32>,
}

impl MrEntry {
    pub(crate) fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr + self.len)
    }
}

static NEXT_CONTEXT: AtomicU64 = AtomicU64::new(1);

/// State of one opened soft device.
pub(crate) struct ContextShared {
    pub(crate) id: u64,
    pub(crate) pid: u32,
    mrs: RwLock<HashMap<u32, MrEntry>>,
    /// Which local users may connect (`RDMA_SOFT_PEERS`).
    pub(crate) policy: PeerPolicy,
    next_qp_num: AtomicU32,
    next_cq_id: AtomicU32,
    next_pd: AtomicU64,
    qps: Mutex<HashMap<u32, Weak<qp::QpShared>>>,
    /// The injector's plan (feature `fault-injection`), given to each QP.
    pub(crate) fault_plan: Option<faults::FaultPlan>,
    /// The injector's decisions about registrations and window binds.
    registration_faults: faults::FaultStream,
}

impl ContextShared {
    fn new(fault_plan: Option<faults::FaultPlan>) -> Result<Arc<ContextShared>, VerbsError> {
        let shared = Arc::new(ContextShared {
            id: NEXT_CONTEXT.fetch_add(1, Ordering::Relaxed),
            pid: std::process::id(),
            mrs: RwLock::new(HashMap::new()),
            policy: PeerPolicy::from_env(),
            next_qp_num: AtomicU32::new(0x40),
            next_cq_id: AtomicU32::new(1),
            next_pd: AtomicU64::new(1),
            qps: Mutex::new(HashMap::new()),
            fault_plan,
            // QP streams are numbered from 0x40: this one is apart.
            registration_faults: faults::FaultStream::new(fault_plan, u64::from(u32::MAX) + 1),
        });
        let listener = listen_abstract(&rendezvous_name(shared.pid, shared.id))?;
        let weak = Arc::downgrade(&shared);
        std::thread::Builder::new()
            .name(format!("soft-rdma-listen-{}", shared.id))
            .spawn(move || accept_loop(listener, weak))?;
        Ok(shared)
    }

    /// Runs `f` with the region table read-locked. A region `f` finds there
    /// stays registered until `f` returns (deregistering takes the write
    /// lock), so by the registration contract its memory stays valid and `f`
    /// may copy into or out of it directly.
    pub(crate) fn with_regions<R>(&self, f: impl FnOnce(&HashMap<u32, MrEntry>) -> R) -> R {
        f(&self.mrs.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Registers `entry` under a fresh random key (keys are not guessable:
    /// 32 random bits, never 0, never one in use).
    ///
    /// # Safety
    /// While the key is in the table, work requests and peers that name it
    /// make this process copy into, out of, and run atomics on
    /// `[entry.addr, entry.addr + entry.len)` directly (see
    /// [`ContextShared::with_regions`]). Until the key is removed (by
    /// `SoftMr::deregister`, at the latest when the region is dropped) that
    /// memory must stay allocated and in place, and be memory the device may
    /// read and write behind the compiler's back: the contract of
    /// [`ProtectionDomain::register`].
    unsafe fn insert_region(&self, entry: MrEntry) -> Result<u32, VerbsError> {
        let mut regions = self.mrs.write().unwrap_or_else(|p| p.into_inner());
        loop {
            let mut bytes = [0u8; 4];
            peer::fill_random(&mut bytes)?;
            let key = u32::from_le_bytes(bytes);
            if key != 0 && !regions.contains_key(&key) {
                regions.insert(key, entry);
                return Ok(key);
            }
        }
    }
}

impl Drop for ContextShared {
    fn drop(&mut self) {
        // Wake the accept loop so it sees the context is gone.
        let _ = connect_abstract_nonblocking(&rendezvous_name(self.pid, self.id));
    }
}

/// The abstract Unix socket a context accepts QP connections on.
pub(crate) fn rendezvous_name(pid: u32, context: u64) -> Vec<u8> {
    format!("rdma-rpc-soft.{pid}.{context}").into_bytes()
}

/// How long an accepted Unix connection may take to send its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// Unix connections waiting for their handshake at once; beyond it the
/// oldest is dropped (an idle peer can delay nobody for long).
const MAX_PENDING_HANDSHAKES: usize = 64;

/// What a dialing QP sends over the Unix socket, with the rings' memfd and
/// its CQs' wake-up fds: `target_qp: u32 | qp_num: u32 | pid: u32 |
/// context: u64 | target_secret: [u8; 16] | wake_flags: u8`, little-endian.
/// The pid must be the kernel's (`SO_PEERCRED`); the secret the target QP's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Handshake {
    pub(crate) target_qp: u32,
    pub(crate) qp_num: u32,
    pub(crate) pid: u32,
    pub(crate) context: u64,
    pub(crate) target_secret: peer::Secret,
    pub(crate) wake_flags: u8,
}

/// Bytes of an encoded [`Handshake`].
pub(crate) const HANDSHAKE_LEN: usize = 4 + 4 + 4 + 8 + peer::SECRET_LEN + 1;

impl Handshake {
    pub(crate) fn encode(&self) -> [u8; HANDSHAKE_LEN] {
        let mut out = [0u8; HANDSHAKE_LEN];
        out[0..4].copy_from_slice(&self.target_qp.to_le_bytes());
        out[4..8].copy_from_slice(&self.qp_num.to_le_bytes());
        out[8..12].copy_from_slice(&self.pid.to_le_bytes());
        out[12..20].copy_from_slice(&self.context.to_le_bytes());
        out[20..36].copy_from_slice(&self.target_secret);
        out[36] = self.wake_flags;
        out
    }

    pub(crate) fn decode(bytes: &[u8; HANDSHAKE_LEN]) -> Handshake {
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4"));
        Handshake {
            target_qp: u32_at(0),
            qp_num: u32_at(4),
            pid: u32_at(8),
            context: u64::from_le_bytes(bytes[12..20].try_into().expect("8")),
            target_secret: bytes[20..36].try_into().expect("16"),
            wake_flags: bytes[36],
        }
    }
}

/// Decodes a handshake from arbitrary bytes (fuzzing entry point): never
/// panics; `None` unless exactly [`HANDSHAKE_LEN`] bytes.
#[cfg(any(test, fuzzing))]
pub fn fuzz_handshake(bytes: &[u8]) -> bool {
    let Ok(array) = <&[u8; HANDSHAKE_LEN]>::try_from(bytes) else {
        return false;
    };
    let handshake = Handshake::decode(array);
    Handshake::decode(&handshake.encode()) == handshake
}

/// Feeds arbitrary bytes to the soft wire's descriptor reader, as a hostile
/// peer's ring would (fuzzing entry point): never panics; returns how many
/// messages decoded before the end or the first error. Each decoded message
/// must survive an encode/decode round trip.
#[cfg(any(test, fuzzing))]
pub fn fuzz_wire(bytes: &[u8]) -> usize {
    use std::io::Read;
    struct Chunks<'a>(&'a [u8]);
    impl Read for Chunks<'_> {
        fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
            if self.0.is_empty() {
                return Err(std::io::ErrorKind::WouldBlock.into());
            }
            // Uneven chunks, as a ring delivers them.
            let n = out.len().min(self.0.len()).min(1 + self.0[0] as usize);
            out[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }
    let mut reader = wire::MessageReader::new();
    let mut input = Chunks(bytes);
    let mut decoded = 0;
    while let Ok(wire::ReadOutcome::Message(message)) = reader.read(&mut input) {
        let mut encoded = Vec::new();
        wire::Encode::encode_into(&message, &mut encoded);
        let again = wire::Message::decode(&encoded[4..]).expect("re-decodes");
        assert_eq!(again, message, "round trip");
        decoded += 1;
    }
    decoded
}

/// Connects to an abstract Unix socket without blocking (a listener that
/// never accepts fills its backlog; then this fails instead of waiting).
pub(crate) fn connect_abstract_nonblocking(name: &[u8]) -> std::io::Result<UnixStream> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    // `sun_path` of a `sockaddr_un`, whose first byte (0) marks the name abstract.
    const SUN_PATH_LEN: usize = 108;
    if name.len() + 1 > SUN_PATH_LEN {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "abstract socket name too long",
        ));
    }
    let addr = SocketAddrUnix::new_abstract_name(name)?;
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
        None,
    )?;
    rustix::net::connect(&fd, &addr)?;
    Ok(UnixStream::from(fd))
}

/// Connections the kernel queues for the soft socket before the acceptor
/// takes them (the kernel caps it at `net.core.somaxconn`): a burst of
/// connections, a flood from a user the acceptor then refuses included,
/// leaves room for a dialer, whose non-blocking connect would fail on a full
/// queue instead of waiting.
const LISTEN_BACKLOG: i32 = 4096;

/// Listens on abstract Unix socket `name` with [`LISTEN_BACKLOG`].
fn listen_abstract(name: &[u8]) -> std::io::Result<UnixListener> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let addr = SocketAddrUnix::new_abstract_name(name)?;
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    rustix::net::bind(&fd, &addr)?;
    rustix::net::listen(&fd, LISTEN_BACKLOG)?;
    Ok(UnixListener::from(fd))
}

/// A Unix connection waiting for its handshake.
struct PendingHandshake {
    stream: UnixStream,
    deadline: Instant,
}

/// The context's Unix-socket acceptor: one thread, never blocked by a peer.
/// The listener and every connection waiting for its handshake are
/// non-blocking and watched with `poll`; a handshake must arrive within
/// [`HANDSHAKE_TIMEOUT`], at most [`MAX_PENDING_HANDSHAKES`] wait at once.
fn accept_loop(listener: UnixListener, context: Weak<ContextShared>) {
    if listener.set_nonblocking(true).is_err() {
        return;
    }
    let mut pending: VecDeque<PendingHandshake> = VecDeque::new();
    let mut failed_accepts: u64 = 0;
    let mut last_warning: Option<Instant> = None;
    loop {
        let now = Instant::now();
        pending.retain(|waiting| waiting.deadline > now);
        let timeout = pending
            .iter()
            .map(|waiting| waiting.deadline.saturating_duration_since(now))
            .min()
            .unwrap_or(Duration::from_secs(1));
        let (ready, revents) = {
            let mut pollfds: Vec<PollFd<'_>> = std::iter::once(listener.as_fd())
                .chain(pending.iter().map(|waiting| waiting.stream.as_fd()))
                .map(|fd| PollFd::from_borrowed_fd(fd, PollFlags::IN))
                .collect();
            let millis = timeout.as_millis().clamp(1, 1000) as i64;
            let timeout = Timespec {
                tv_sec: millis / 1000,
                tv_nsec: (millis % 1000) * 1_000_000,
            };
            // An error (EINTR) is a wait that found nothing.
            let ready = rustix::event::poll(&mut pollfds, Some(&timeout)).unwrap_or(0);
            let revents: Vec<bool> = pollfds.iter().map(|fd| !fd.revents().is_empty()).collect();
            (ready, revents)
        };
        let Some(context) = context.upgrade() else {
            return;
        };
        if ready == 0 {
            continue;
        }
        // Handshakes first (their pollfds follow the listener's, in order).
        let ready_streams: Vec<usize> = (0..pending.len()).filter(|&i| revents[i + 1]).collect();
        for &i in ready_streams.iter().rev() {
            let Some(waiting) = pending.remove(i) else {
                continue;
            };
            if let Err(error) = handle_handshake(&context, waiting.stream) {
                tracing::debug!(%error, "soft device refused a connection");
            }
        }
        if revents[0] {
            loop {
                match listener.accept() {
                    Ok((stream, _)) => {
                        if stream.set_nonblocking(true).is_err() {
                            continue;
                        }
                        // A user the policy does not allow is refused now,
                        // before it takes a handshake's place: a flood from
                        // another user never pushes an allowed dialer out.
                        let allowed = peer::peer_credentials(&stream)
                            .is_ok_and(|cred| context.policy.allows(cred.uid));
                        if !allowed {
                            let _ = (&stream).write_all(&[0]);
                            continue;
                        }
                        if pending.len() >= MAX_PENDING_HANDSHAKES {
                            pending.pop_front();
                        }
                        pending.push_back(PendingHandshake {
                            stream,
                            deadline: Instant::now() + HANDSHAKE_TIMEOUT,
                        });
                    }
                    Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(error) => {
                        // Out of fds, say: back off instead of spinning, and
                        // say so at most once per 5 s.
                        failed_accepts += 1;
                        if last_warning
                            .is_none_or(|at: Instant| at.elapsed() >= Duration::from_secs(5))
                        {
                            tracing::warn!(%error, failed_accepts, "soft device: accept failed");
                            last_warning = Some(Instant::now());
                            failed_accepts = 0;
                        }
                        std::thread::sleep(Duration::from_millis(100));
                        break;
                    }
                }
            }
        }
    }
}

/// Reads one dialer's handshake (already waiting: non-blocking) and
/// attaches it to the target QP, or refuses it with the reason.
fn handle_handshake(context: &Arc<ContextShared>, stream: UnixStream) -> std::io::Result<()> {
    let refuse = |stream: &UnixStream, why: String| {
        let _ = (&*stream).write_all(&[0]);
        std::io::Error::new(std::io::ErrorKind::PermissionDenied, why)
    };
    let process = match peer::PeerProcess::of_socket(&stream, &context.policy) {
        Ok(process) => process,
        Err(error) => return Err(refuse(&stream, error.to_string())),
    };
    let mut bytes = [0u8; HANDSHAKE_LEN];
    let fds = ring::receive_with_fds(&stream, &mut bytes)?;
    let handshake = Handshake::decode(&bytes);
    if handshake.pid != process.pid() {
        return Err(refuse(
            &stream,
            format!(
                "soft peer claims pid {} but the kernel says {}",
                handshake.pid,
                process.pid()
            ),
        ));
    }
    let qp = lock(&context.qps)
        .get(&handshake.target_qp)
        .and_then(Weak::upgrade)
        .filter(|qp| qp.secret_matches(&handshake.target_secret));
    let Some(qp) = qp else {
        return Err(refuse(
            &stream,
            format!("no QP {} with that secret", handshake.target_qp),
        ));
    };
    let mut fds = fds.into_iter();
    let ring = match fds.next().map(|fd| ring::RingPair::open(&fd)) {
        Some(Ok(ring)) => ring,
        Some(Err(error)) => return Err(refuse(&stream, error.to_string())),
        None => return Err(refuse(&stream, "handshake without its ring".into())),
    };
    let wakers = match wake::PeerWakers::from_set_up(handshake.wake_flags, &mut fds) {
        Ok(wakers) => wakers,
        Err(error) => return Err(refuse(&stream, error.to_string())),
    };
    let peer = qp::Peer {
        pid: handshake.pid,
        context: handshake.context,
        qp_num: handshake.qp_num,
    };
    qp.attach(stream, ring, peer, process, false, wakers);
    Ok(())
}

/// An opened soft device.
pub struct SoftContext {
    shared: Arc<ContextShared>,
}

// SAFETY: every CQ is created here, new, tagged with this context; PDs are `SoftPd`s.
unsafe impl Context for SoftContext {
    fn device_name(&self) -> &str {
        DEVICE_NAME
    }

    fn caps(&self) -> DeviceCaps {
        DeviceCaps {
            max_mr_size: u64::MAX,
            max_sge: 32,
            max_sge_rd: 32,
            atomics: true,
            write_with_imm: true,
            srq: true,
            solicited_events: true,
            max_cqe: 1 << 20,
            max_qp_wr: 1 << 14,
            max_srq_wr: 1 << 20,
            memory_windows: super::windows::memory_windows_wanted(true),
        }
    }

    fn alloc_pd(&self) -> Result<Arc<dyn ProtectionDomain>, VerbsError> {
        let id = self.shared.next_pd.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::new(SoftPd {
            context: self.shared.clone(),
            id,
            windows: super::windows::memory_windows_wanted(true)
                .then(|| super::WindowCache::new(super::windows::MAX_CACHED_BYTES, false)),
        }))
    }

    fn create_comp_channel(&self) -> Result<Arc<dyn CompletionChannel>, VerbsError> {
        Ok(Arc::new(SoftChannel {
            inner: Arc::new(ChannelShared::new()?),
        }))
    }

    fn create_cq(
        &self,
        capacity: u32,
        channel: Option<&Arc<dyn CompletionChannel>>,
    ) -> Result<Arc<dyn CompletionQueue>, VerbsError> {
        if capacity == 0 || capacity > self.caps().max_cqe {
            return Err(VerbsError::InvalidArgument(
                "CQ capacity must be 1..=max_cqe",
            ));
        }
        let channel = channel
            .map(|channel| {
                super::own::<SoftChannel>(
                    channel.as_any(),
                    "completion channel of another provider",
                )
                .map(|channel| channel.inner.clone())
            })
            .transpose()?;
        let id = self.shared.next_cq_id.fetch_add(1, Ordering::Relaxed);
        let arm = match channel {
            Some(_) => Some(wake::ArmWord::create()?),
            None => None,
        };
        let inner = Arc::new(CqShared {
            id,
            context: self.shared.id,
            capacity,
            state: Mutex::default(),
            channel,
            arm,
            sources: Mutex::default(),
        });
        if let Some(channel) = &inner.channel {
            let mut cqs = lock(&channel.cqs);
            cqs.retain(|cq| cq.strong_count() > 0);
            cqs.push(Arc::downgrade(&inner));
        }
        Ok(Arc::new(SoftCq { inner }))
    }
}

struct SoftPd {
    context: Arc<ContextShared>,
    id: u64,
    /// Registrations over recycled buffers that windows are bound over
    /// (`None` with `RDMA_MEMORY_WINDOWS=off`).
    windows: Option<Arc<super::WindowCache>>,
}

impl SoftPd {
    /// `qp` as a QP of this PD's device: a window bound to a QP number of
    /// another opened device would be usable by this device's QP of the
    /// same number.
    fn own_qp<'a>(&self, qp: &'a Arc<dyn super::QueuePair>) -> Result<&'a qp::SoftQp, VerbsError> {
        let qp = super::own::<qp::SoftQp>(qp.as_any(), "queue pair of another provider")?;
        if !qp.of_context(&self.context) {
            return Err(VerbsError::InvalidArgument(
                "queue pair of another opened soft device",
            ));
        }
        Ok(qp)
    }
}

impl SoftPd {
    /// A region (or, with `bound_qp`, a window) in the key table.
    ///
    /// # Safety
    /// As for [`ContextShared::insert_region`], for the `len` bytes at
    /// `addr`, until the returned region is deregistered or dropped.
    unsafe fn insert(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
        bound_qp: Option<u32>,
    ) -> Result<Arc<dyn MemoryRegion>, VerbsError> {
        if addr.is_null() && len > 0 {
            return Err(VerbsError::InvalidArgument("null address"));
        }
        if self
            .context
            .registration_faults
            .roll(faults::FaultKind::Registration)
        {
            return Err(VerbsError::Io(std::io::Error::from_raw_os_error(
                libc::ENOMEM,
            )));
        }
        let remote = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
        if access.bits() & remote.bits() != 0 && !access.contains(AccessFlags::LOCAL_WRITE) {
            // As in verbs: remote write or atomic access requires local write.
            return Err(VerbsError::InvalidArgument(
                "REMOTE_WRITE and REMOTE_ATOMIC require LOCAL_WRITE",
            ));
        }
        let entry = MrEntry {
            addr: addr as u64,
            len: len as u64,
            access,
            pd: self.id,
            bound_qp,
        };
        // SAFETY: the entry covers exactly the `len` bytes at `addr`, which
        // our caller keeps valid until the region we return is deregistered
        // or dropped; both remove the key (`SoftMr::deregister`, `Drop`).
        let key = unsafe { self.context.insert_region(entry) }?;
        Ok(Arc::new(SoftMr {
            context: self.context.clone(),
            key,
            entry,
        }))
    }
}

// SAFETY: `qp::create` refuses CQs and SRQs of another context and numbers QPs per
// context (so per CQ); the engine completes a QP's requests only into its own CQs;
// regions are registered over exactly the bytes and rights asked.
unsafe impl ProtectionDomain for SoftPd {
    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<Arc<dyn MemoryRegion>, VerbsError> {
        // SAFETY: our caller upholds `register`'s contract for these bytes
        // until the region we return is dropped, as `insert` needs.
        let region = unsafe { self.insert(addr, len, access, None) }?;
        super::windows::count_device_registration();
        Ok(region)
    }

    unsafe fn register_window(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
        qp: &Arc<dyn super::QueuePair>,
    ) -> Result<Arc<dyn MemoryRegion>, VerbsError> {
        self.own_qp(qp)?;
        // SAFETY: our caller upholds `register`'s contract for these bytes
        // (`register_window`'s), as `insert` needs.
        let region = unsafe { self.insert(addr, len, access, Some(qp.qp_num())) }?;
        super::windows::count_device_registration();
        Ok(region)
    }

    fn window_cache(&self) -> Option<&Arc<super::WindowCache>> {
        self.windows.as_ref()
    }

    /// A window is a key-table entry bound to `qp`, like
    /// [`ProtectionDomain::register_window`]'s, made after the checks a
    /// device makes when it binds a type-2 window (the region is this PD's,
    /// registered with MW_BIND and still registered; the range lies inside
    /// it). Synchronous: no work request, no completion.
    unsafe fn bind_window(
        &self,
        region: &Arc<dyn MemoryRegion>,
        addr: u64,
        len: usize,
        access: AccessFlags,
        qp: &Arc<dyn super::QueuePair>,
    ) -> Result<Arc<dyn MemoryRegion>, VerbsError> {
        if self.windows.is_none() {
            return Err(VerbsError::Unsupported(
                "memory windows (RDMA_MEMORY_WINDOWS=off)",
            ));
        }
        self.own_qp(qp)?;
        let region = super::own::<SoftMr>(region.as_any(), "region of another provider")?;
        let registered = self
            .context
            .mrs
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(&region.key);
        if !registered || region.entry.pd != self.id {
            return Err(VerbsError::InvalidArgument(
                "binding a window over a region of another PD, or a deregistered one",
            ));
        }
        if !region.entry.access.contains(AccessFlags::MW_BIND) {
            return Err(VerbsError::InvalidArgument(
                "binding a window over a region registered without MW_BIND",
            ));
        }
        let inside = addr.checked_add(len as u64).is_some_and(|end| {
            addr >= region.entry.addr && end <= region.entry.addr + region.entry.len
        });
        if len == 0 || !inside {
            return Err(VerbsError::InvalidArgument("a window outside its region"));
        }
        // SAFETY: our caller upholds `register`'s contract for the window's
        // bytes until the window is deregistered (`bind_window`'s), as
        // `insert` needs.
        unsafe { self.insert(addr as *mut u8, len, access, Some(qp.qp_num())) }
    }

    fn create_qp(&self, init: QpInit) -> Result<Arc<dyn QueuePair>, VerbsError> {
        qp::create(self.context.clone(), self.id, init)
    }

    fn create_srq(
        &self,
        max_wr: u32,
        max_sge: u32,
    ) -> Result<Arc<dyn SharedReceiveQueue>, VerbsError> {
        if max_wr == 0 || max_sge == 0 {
            return Err(VerbsError::InvalidArgument(
                "SRQ needs max_wr and max_sge above 0",
            ));
        }
        Ok(Arc::new(SoftSrq {
            inner: Arc::new(SrqShared {
                max_wr,
                max_sge,
                queue: Mutex::default(),
                pd: self.id,
                context: self.context.id,
            }),
        }))
    }
}

struct SoftMr {
    context: Arc<ContextShared>,
    key: u32,
    entry: MrEntry,
}

// SAFETY: soft writes registered memory only in this process, through its key table, checking
// range and rights under the region lock; deregistering removes the key under that lock, after
// which no access starts through it here. One exception, outside this process: a READ the
// responder granted before deregistration may still be pulled by the peer process afterwards
// (`process_vm_readv` by another process: no undefined behaviour here, but the peer may see what
// the memory holds by then; docs/providers.md).
unsafe impl MemoryRegion for SoftMr {
    fn addr(&self) -> u64 {
        self.entry.addr
    }
    fn len(&self) -> usize {
        self.entry.len as usize
    }
    fn lkey(&self) -> u32 {
        self.key
    }
    fn rkey(&self) -> u32 {
        self.key
    }
    fn access(&self) -> AccessFlags {
        self.entry.access
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    /// Removes the key under the region table's write lock, which waits for
    /// every copy in progress (they hold the read lock and check the key at
    /// the time of the copy): afterwards nothing touches the memory. Never fails.
    fn deregister(&self) -> Result<(), VerbsError> {
        self.context
            .mrs
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.key);
        Ok(())
    }
}

impl Drop for SoftMr {
    fn drop(&mut self) {
        let _ = self.deregister();
    }
}

#[derive(Default)]
struct CqState {
    entries: VecDeque<WorkCompletion>,
    overflowed: bool,
}

/// Completion queue internals, shared with the QPs that complete into it.
pub(crate) struct CqShared {
    id: u32,
    /// The device context it belongs to (QPs of another are refused).
    pub(crate) context: u64,
    capacity: u32,
    state: Mutex<CqState>,
    channel: Option<Arc<ChannelShared>>,
    /// The arm, shared with peer processes (with a channel only).
    arm: Option<wake::ArmWord>,
    /// QPs that complete into this CQ: an empty poll progresses them.
    sources: Mutex<Vec<Weak<qp::QpShared>>>,
}

impl CqShared {
    pub(crate) fn add_source(&self, qp: &Arc<qp::QpShared>) {
        let mut sources = lock(&self.sources);
        sources.retain(|source| source.strong_count() > 0);
        sources.push(Arc::downgrade(qp));
    }

    /// Progresses every QP that completes into this CQ. The source list
    /// stays locked meanwhile (no allocation per poll): nothing that holds a
    /// QP's or this CQ's other locks takes it.
    fn progress_sources(&self, polling: bool) {
        let sources = lock(&self.sources);
        for qp in sources.iter().filter_map(Weak::upgrade) {
            if polling {
                qp.progress_polled();
            } else {
                qp.progress_before_sleep();
            }
        }
    }

    /// What a peer needs to wake a caller sleeping on this CQ: the arm
    /// word's memfd and the channel's eventfd (with a channel only).
    pub(crate) fn wake_fds(&self) -> Option<[BorrowedFd<'_>; 2]> {
        match (&self.arm, &self.channel) {
            (Some(arm), Some(channel)) => Some([arm.fd(), channel.eventfd.as_fd()]),
            _ => None,
        }
    }

    /// True while armed (not fired, nor claimed by a peer).
    fn is_armed(&self) -> bool {
        self.arm
            .as_ref()
            .is_some_and(|arm| matches!(arm.state(), wake::ARMED_ANY | wake::ARMED_SOLICITED))
    }

    /// Entries this CQ can still take (none once it overflowed).
    pub(crate) fn room(&self) -> usize {
        let state = lock(&self.state);
        if state.overflowed {
            return 0;
        }
        (self.capacity as usize).saturating_sub(state.entries.len())
    }

    /// Whether this is the same CQ as `other`.
    pub(crate) fn is(&self, other: &CqShared) -> bool {
        std::ptr::eq(self, other)
    }

    /// Adds a completion; raises the channel event if the CQ is armed for it.
    pub(crate) fn push(&self, completion: WorkCompletion, solicited: bool) {
        let mut state = lock(&self.state);
        if state.entries.len() >= self.capacity as usize {
            tracing::error!(cq = self.id, "completion queue overflow");
            state.overflowed = true;
            return;
        }
        state.entries.push_back(completion);
        let is_error = completion.status != super::WcStatus::Success;
        if let (Some(arm), Some(channel)) = (&self.arm, &self.channel) {
            if arm.fire(solicited || is_error, wake::DISARMED) {
                channel.raise(self.id);
            }
        }
    }
}

struct SoftCq {
    inner: Arc<CqShared>,
}

// SAFETY: soft pushes a completion once per request, after the engine finished every copy the
// request makes, tagged with its QP's number, into the CQ that QP was created with.
unsafe impl CompletionQueue for SoftCq {
    fn capacity(&self) -> u32 {
        self.inner.capacity
    }

    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize, VerbsError> {
        let mut state = lock(&self.inner.state);
        if state.entries.is_empty() && !state.overflowed {
            // Nothing ready: do the work ourselves instead of waiting for the
            // engine threads to wake (without the state lock: progress
            // completes into CQs). An armed CQ's last poll before sleeping is
            // not "polling".
            let armed = self.inner.is_armed();
            drop(state);
            self.inner.progress_sources(!armed);
            state = lock(&self.inner.state);
        }
        if state.overflowed {
            return Err(VerbsError::QueueFull(
                "completion queue (it overflowed; completions were lost)",
            ));
        }
        let n = out.len().min(state.entries.len());
        for (slot, completion) in out.iter_mut().zip(state.entries.drain(..n)) {
            *slot = completion;
        }
        Ok(n)
    }

    fn req_notify(&self, solicited_only: bool) -> Result<(), VerbsError> {
        if self.inner.channel.is_none() {
            return Err(VerbsError::InvalidArgument("CQ has no completion channel"));
        }
        if let Some(arm) = &self.inner.arm {
            arm.arm(solicited_only);
        }
        // The caller stops polling and will sleep on the channel: peers take
        // the arm and wake it directly for completions of this CQ, and ring
        // doorbells (our engine) for the rest.
        for qp in lock(&self.inner.sources).iter().filter_map(Weak::upgrade) {
            qp.stop_polling();
        }
        Ok(())
    }

    fn id(&self) -> u32 {
        self.inner.id
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Completion channel internals: an eventfd and the queue of CQ ids with events.
///
/// The eventfd counts in semaphore mode, one per event waiting: our threads
/// add one when a CQ fires here (queued in `events`), peer processes when
/// they take the arm of one of our CQs (see `wake`).
pub(crate) struct ChannelShared {
    eventfd: OwnedFd,
    events: Mutex<VecDeque<u32>>,
    /// The CQs that report here (a peer-claimed event is found in their arm).
    cqs: Mutex<Vec<Weak<CqShared>>>,
}

impl ChannelShared {
    fn new() -> Result<ChannelShared, VerbsError> {
        use rustix::event::EventfdFlags;
        let eventfd = rustix::event::eventfd(
            0,
            EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC | EventfdFlags::SEMAPHORE,
        )
        .map_err(std::io::Error::from)?;
        Ok(ChannelShared {
            eventfd,
            events: Mutex::default(),
            cqs: Mutex::default(),
        })
    }

    fn raise(&self, cq_id: u32) {
        lock(&self.events).push_back(cq_id);
        wake::signal_eventfd(self.eventfd.as_fd());
    }

    /// Takes one count off the eventfd; false when it is zero (no event).
    fn take_count(&self) -> bool {
        let mut counter = [0u8; 8];
        // Our own non-blocking semaphore eventfd: subtracts one, or fails
        // with EAGAIN at zero.
        matches!(rustix::io::read(&self.eventfd, &mut counter), Ok(8))
    }
}

struct SoftChannel {
    inner: Arc<ChannelShared>,
}

// SAFETY: `fd` returns the channel's own eventfd, the same on every call,
// open until the `ChannelShared` it lives in is dropped, which every
// SoftChannel (and every CQ of the channel) keeps alive.
unsafe impl CompletionChannel for SoftChannel {
    fn fd(&self) -> RawFd {
        self.inner.eventfd.as_raw_fd()
    }

    /// One count off the eventfd, then the event it stands for: a queued
    /// one, or an arm a peer claimed. Every event is recorded before its
    /// count is added, so a count taken always finds one.
    fn get_event(&self) -> Result<Option<u32>, VerbsError> {
        if !self.inner.take_count() {
            return Ok(None);
        }
        if let Some(event) = lock(&self.inner.events).pop_front() {
            return Ok(Some(event));
        }
        let cqs = lock(&self.inner.cqs);
        let claimed = cqs
            .iter()
            .filter_map(Weak::upgrade)
            .find(|cq| cq.arm.as_ref().is_some_and(wake::ArmWord::take_claimed));
        // None only if the claimed CQ was destroyed meanwhile.
        Ok(claimed.map(|cq| cq.id))
    }

    fn ack_events(&self, _cq_id: u32, _count: u32) {}

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Shared receive queue internals.
pub(crate) struct SrqShared {
    max_wr: u32,
    max_sge: u32,
    pub(crate) queue: Mutex<VecDeque<RecvWr>>,
    pub(crate) pd: u64,
    /// The device context it belongs to (PD ids are numbered per context).
    pub(crate) context: u64,
}

struct SoftSrq {
    inner: Arc<SrqShared>,
}

// SAFETY: a soft SRQ's receives are taken only by QPs created with it; the copy into one is checked
// against its SGEs' keys and completes on that QP's receive CQ.
unsafe impl SharedReceiveQueue for SoftSrq {
    unsafe fn post_recv(&self, wrs: Vec<RecvWr>) -> Result<(), PostError<RecvWr>> {
        let mut queue = lock(&self.inner.queue);
        let mut wrs = wrs.into_iter();
        while let Some(wr) = wrs.next() {
            let error = if wr.sg_list.len() > self.inner.max_sge as usize {
                Some(VerbsError::InvalidArgument(
                    "more SGEs than the SRQ's max_sge",
                ))
            } else if queue.len() >= self.inner.max_wr as usize {
                Some(VerbsError::QueueFull("shared receive queue"))
            } else {
                None
            };
            if let Some(error) = error {
                return Err(PostError::handing_back(error, wr, wrs));
            }
            queue.push_back(wr);
        }
        Ok(())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
