//! rdma-verbs: RDMA's vocabulary behind provider traits, with a safe API
//! that is sound. The only crate of rdma-rpc with `unsafe` code; it knows
//! nothing of the RPC layer (see the crate's README for a two-process READ
//! and the ownership rules in full).
//!
//! The names and semantics are those of libibverbs, so that what you know
//! from `man ibv_post_send` holds here:
//!
//! - a [`Provider`] lists and opens devices; an opened device is a
//!   [`Context`];
//! - a [`ProtectionDomain`] registers memory ([`MemoryRegion`]: `lkey` for
//!   local access, `rkey` for the peer, access flags) and creates queue pairs;
//! - a [`CompletionQueue`] collects [`WorkCompletion`]s, and may be tied to a
//!   [`CompletionChannel`], a pollable fd that becomes readable once the CQ
//!   was armed with [`CompletionQueue::req_notify`] and a completion arrived;
//! - a [`QueuePair`] (reliable connected) moves RESET → INIT → RTR → RTS and
//!   to ERROR, and takes [`SendWr`]s and [`RecvWr`]s with scatter/gather lists;
//!   a [`SharedReceiveQueue`] feeds receives to several QPs.
//!
//! Errors of a *posted* work request are reported as completions with a
//! [`WcStatus`], as on hardware; errors of the *post* itself hand the work
//! requests back ([`PostError`]).
//!
//! Providers: [`soft`] (always built) — our own software device with faithful
//! RC semantics between processes of one host; `ibverbs` (feature `ibverbs`)
//! — real rdma-core.
//!
//! # Memory and ownership
//!
//! Posting a raw work request is `unsafe` ([`QueuePair::post_send`]): the
//! memory it names is the device's until its completion. The safe side:
//!
//! - [`RegisteredBuffer`]: registered heap memory that only the local device
//!   writes, and only for a request that owns it; memory a peer may write
//!   comes from the `unsafe` [`RegisteredBuffer::new_remote_writable`].
//! - [`owned::OwnedQueue`]: a QP with its own CQ; buffers move in with a post
//!   and come back with their completion.
//! - [`pooled::PooledQp`]: a connection's QP over the device's shared pools
//!   ([`shared`], [`pool`]), the only poster of requests naming pooled memory
//!   and the only poller of their completions.
//!
//! Memory under an outstanding request is never freed or deregistered: it
//! comes back with the completion or flush, or is leaked
//! ([`leaked_buffers`]) when none can come.

#![allow(unsafe_code)]

#[cfg(feature = "ibverbs")]
pub mod ibverbs;
/// The README's code, compiled as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

#[cfg(test)]
pub(crate) mod mock;
pub mod owned;
pub mod pool;
pub mod pooled;
pub mod reactor;
pub mod shared;
pub mod soft;
pub mod windows;

pub use reactor::AsyncCompletionChannel;
pub use windows::{
    MAX_BINDS_IN_FLIGHT, WINDOW_BIND_WR_ID, WindowCache, cached_registration_bytes,
    cached_registrations, device_registrations, windows_bound,
};

use std::fmt;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::time::Duration;

use bytes::Bytes;

bitflags::bitflags! {
    /// Memory access rights of a [`MemoryRegion`] (values as in `ibv_access_flags`).
    #[derive(Clone, Copy, PartialEq, Eq, Hash, Default, Debug)]
    pub struct AccessFlags: u32 {
        /// The local HCA may write (needed for receives and READ/atomic destinations).
        const LOCAL_WRITE = 1;
        /// The peer may RDMA WRITE into the region.
        const REMOTE_WRITE = 1 << 1;
        /// The peer may RDMA READ from the region.
        const REMOTE_READ = 1 << 2;
        /// The peer may run atomics on the region.
        const REMOTE_ATOMIC = 1 << 3;
        /// Memory windows may be bound over the region (`IBV_ACCESS_MW_BIND`);
        /// gives the peer nothing by itself.
        const MW_BIND = 1 << 4;
    }
}

impl AccessFlags {
    /// Local reads only.
    pub const NONE: AccessFlags = AccessFlags::empty();
}

/// One scatter/gather element: `length` bytes at `addr` inside the region of `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Start address (a virtual address of this process).
    pub addr: u64,
    /// Bytes.
    pub length: u32,
    /// The local key of the region that contains the range.
    pub lkey: u32,
}

/// What a send work request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// Two-sided send into the peer's next receive.
    Send,
    /// Send with 32 bits of immediate data delivered in the receive completion.
    SendWithImm(u32),
    /// One-sided write to `remote_addr` in the peer's region `rkey`.
    RdmaWrite {
        /// Target address in the peer.
        remote_addr: u64,
        /// The peer region's remote key.
        rkey: u32,
    },
    /// A write that also consumes a receive at the peer and delivers `imm`.
    RdmaWriteWithImm {
        /// Target address in the peer.
        remote_addr: u64,
        /// The peer region's remote key.
        rkey: u32,
        /// Immediate data for the peer's receive completion.
        imm: u32,
    },
    /// One-sided read from `remote_addr` in the peer into the local SGEs.
    RdmaRead {
        /// Source address in the peer.
        remote_addr: u64,
        /// The peer region's remote key.
        rkey: u32,
    },
    /// 64-bit compare-and-swap at an 8-byte aligned remote address; the old value lands in the SGE.
    AtomicCmpAndSwp {
        /// Target address in the peer (8-byte aligned).
        remote_addr: u64,
        /// The peer region's remote key.
        rkey: u32,
        /// Value expected.
        compare: u64,
        /// Value stored when it matches.
        swap: u64,
    },
    /// 64-bit fetch-and-add at an 8-byte aligned remote address; the old value lands in the SGE.
    AtomicFetchAndAdd {
        /// Target address in the peer (8-byte aligned).
        remote_addr: u64,
        /// The peer region's remote key.
        rkey: u32,
        /// Added to the remote value.
        add: u64,
    },
}

impl SendOp {
    /// The completion opcode a successful request of this kind reports.
    pub fn completion_opcode(&self) -> WcOpcode {
        match self {
            SendOp::Send | SendOp::SendWithImm(_) => WcOpcode::Send,
            SendOp::RdmaWrite { .. } | SendOp::RdmaWriteWithImm { .. } => WcOpcode::RdmaWrite,
            SendOp::RdmaRead { .. } => WcOpcode::RdmaRead,
            SendOp::AtomicCmpAndSwp { .. } => WcOpcode::CompSwap,
            SendOp::AtomicFetchAndAdd { .. } => WcOpcode::FetchAdd,
        }
    }

    /// True for operations whose local SGEs are written (READ, atomics).
    pub fn writes_locally(&self) -> bool {
        matches!(
            self,
            SendOp::RdmaRead { .. }
                | SendOp::AtomicCmpAndSwp { .. }
                | SendOp::AtomicFetchAndAdd { .. }
        )
    }
}

/// A send-queue work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// The operation.
    pub op: SendOp,
    /// Local memory: gathered for sends and writes, scattered into for reads and atomics.
    pub sg_list: Vec<Sge>,
    /// Produce a completion on success (errors always complete).
    pub signaled: bool,
    /// Copy the data at post time (lkeys ignored); up to the QP's `max_inline_data`.
    pub inline: bool,
    /// Ask the peer's CQ to raise a solicited event.
    pub solicited: bool,
}

impl SendWr {
    /// A signaled request with no inline data and no solicited event.
    pub fn new(wr_id: u64, op: SendOp, sg_list: Vec<Sge>) -> SendWr {
        SendWr {
            wr_id,
            op,
            sg_list,
            signaled: true,
            inline: false,
            solicited: false,
        }
    }
}

/// A receive work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Where an incoming SEND's bytes land, in order.
    pub sg_list: Vec<Sge>,
}

/// Completion status (numbers as in `ibv_wc_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum WcStatus {
    /// The request completed.
    Success = 0,
    /// A receive buffer was too small, or a send longer than the path allows.
    LocLenErr = 1,
    /// Internal QP consistency error.
    LocQpOpErr = 2,
    /// An SGE's lkey is invalid, its range is outside the region, or the region lacks an access right.
    LocProtErr = 4,
    /// Flushed: the QP was (or went) in the ERROR state.
    WrFlushErr = 5,
    /// Memory window bind error.
    MwBindErr = 6,
    /// Unexpected response from the peer.
    BadRespErr = 7,
    /// Local access error on a received write.
    LocAccessErr = 8,
    /// The peer found the request invalid (e.g. its receive buffer was too small).
    RemInvReqErr = 9,
    /// The peer refused access: unknown rkey, range outside the region, or missing right.
    RemAccessErr = 10,
    /// The peer could not complete the operation.
    RemOpErr = 11,
    /// Transport retries exhausted: the peer stopped answering (or died).
    RetryExcErr = 12,
    /// Receiver-not-ready retries exhausted: the peer never posted a receive.
    RnrRetryExcErr = 13,
    /// Any other error.
    GeneralErr = 21,
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            WcStatus::Success => "SUCCESS",
            WcStatus::LocLenErr => "LOC_LEN_ERR",
            WcStatus::LocQpOpErr => "LOC_QP_OP_ERR",
            WcStatus::LocProtErr => "LOC_PROT_ERR",
            WcStatus::WrFlushErr => "WR_FLUSH_ERR",
            WcStatus::MwBindErr => "MW_BIND_ERR",
            WcStatus::BadRespErr => "BAD_RESP_ERR",
            WcStatus::LocAccessErr => "LOC_ACCESS_ERR",
            WcStatus::RemInvReqErr => "REM_INV_REQ_ERR",
            WcStatus::RemAccessErr => "REM_ACCESS_ERR",
            WcStatus::RemOpErr => "REM_OP_ERR",
            WcStatus::RetryExcErr => "RETRY_EXC_ERR",
            WcStatus::RnrRetryExcErr => "RNR_RETRY_EXC_ERR",
            WcStatus::GeneralErr => "GENERAL_ERR",
        };
        f.write_str(name)
    }
}

/// What a completion completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    /// A SEND or SEND_WITH_IMM.
    Send,
    /// An RDMA WRITE (with or without immediate).
    RdmaWrite,
    /// An RDMA READ.
    RdmaRead,
    /// A compare-and-swap.
    CompSwap,
    /// A fetch-and-add.
    FetchAdd,
    /// A receive consumed by a SEND.
    Recv,
    /// A receive consumed by an RDMA WRITE with immediate.
    RecvRdmaWithImm,
}

/// A work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The `wr_id` of the request.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// What completed (meaningful for errors only as far as the provider knows it).
    pub opcode: WcOpcode,
    /// Bytes received (receives) or transferred.
    pub byte_len: u32,
    /// Immediate data of a SEND_WITH_IMM / WRITE_WITH_IMM receive.
    pub imm_data: Option<u32>,
    /// The local QP the request belonged to.
    pub qp_num: u32,
}

impl WorkCompletion {
    /// A placeholder to poll into (`GeneralErr`, all zero).
    pub const BLANK: WorkCompletion = WorkCompletion {
        wr_id: 0,
        status: WcStatus::GeneralErr,
        opcode: WcOpcode::Send,
        byte_len: 0,
        imm_data: None,
        qp_num: 0,
    };
}

/// Queue pair states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Just created; nothing may be posted.
    Reset,
    /// Receives may be posted.
    Init,
    /// Ready to receive: receives are processed.
    Rtr,
    /// Ready to send.
    Rts,
    /// Broken: every outstanding and newly posted request completes with WR_FLUSH_ERR.
    Error,
}

/// Sizes of a queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth (ignored with an SRQ).
    pub max_recv_wr: u32,
    /// SGEs per send request.
    pub max_send_sge: u32,
    /// SGEs per receive request.
    pub max_recv_sge: u32,
    /// Largest inline send.
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 64,
        }
    }
}

/// What a new queue pair is built with.
#[derive(Clone)]
pub struct QpInit {
    /// Completions of send requests.
    pub send_cq: Arc<dyn CompletionQueue>,
    /// Completions of receives.
    pub recv_cq: Arc<dyn CompletionQueue>,
    /// Take receives from this SRQ instead of an own receive queue.
    pub srq: Option<Arc<dyn SharedReceiveQueue>>,
    /// Sizes.
    pub caps: QpCaps,
    /// Every send request completes, whatever its `signaled` says.
    pub sq_sig_all: bool,
}

/// Reliability settings applied when connecting (RTR/RTS attributes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectOptions {
    /// Receiver-not-ready retries, 0..=7; 7 means retry forever.
    pub rnr_retry: u8,
    /// Wait between RNR retries (the peer's `min_rnr_timer`).
    pub rnr_timer: Duration,
    /// Transport retries before RETRY_EXC_ERR, 0..=7.
    pub retry_count: u8,
    /// How long a request waits for its acknowledgement before it is sent
    /// again (the QP's local ACK timeout). The hardware takes it as an
    /// exponent, 4.096 µs × 2^n: this is rounded up to the next such value
    /// (see [`ConnectOptions::ack_timeout_exponent`]). With `retry_count` it
    /// sets how long a silent peer or a cut link is retried before the QP
    /// fails: [`ConnectOptions::retry_budget`]. iWARP leaves retransmission
    /// to TCP and ignores both; the soft provider does not lose packets.
    pub ack_timeout: Duration,
    /// Outstanding RDMA READs / atomics this QP may have at the peer.
    pub max_rd_atomic: u8,
}

impl ConnectOptions {
    /// The local ACK timeout as the verbs take it: the smallest `n` in
    /// 1..=31 with 4.096 µs × 2^n ≥ `ack_timeout` (31 for anything longer;
    /// 0, "wait forever", is never chosen).
    pub fn ack_timeout_exponent(&self) -> u8 {
        let nanos = self.ack_timeout.as_nanos();
        (1u8..=31).find(|&n| 4096u128 << n >= nanos).unwrap_or(31)
    }

    /// The ACK timeout the device is given: 4.096 µs × 2^exponent.
    pub fn effective_ack_timeout(&self) -> Duration {
        Duration::from_nanos(4096u64 << self.ack_timeout_exponent())
    }

    /// How long an RC QP (InfiniBand, RoCE) keeps resending to a peer that
    /// does not acknowledge before its work requests fail with
    /// RETRY_EXC_ERR and the connection ends: the first try and
    /// `retry_count` retries, each waiting [`Self::effective_ack_timeout`].
    /// Devices may wait somewhat longer (timer granularity).
    pub fn retry_budget(&self) -> Duration {
        self.effective_ack_timeout() * (u32::from(self.retry_count.min(7)) + 1)
    }
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            rnr_retry: 7,
            rnr_timer: Duration::from_micros(640),
            retry_count: 7,
            // 4.096 µs × 2^14: retried for about 0.54 s in all.
            ack_timeout: Duration::from_nanos(4096 << 14),
            max_rd_atomic: 16,
        }
    }
}

/// What a peer needs to reach a queue pair, exchanged out of band (TCP or
/// Unix socket) before connecting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QpAddress {
    /// The queue pair number.
    pub qp_num: u32,
    /// Initial packet sequence number.
    pub psn: u32,
    /// Port LID (InfiniBand), 0 on RoCE/iWARP/soft.
    pub lid: u16,
    /// GID (RoCE v2: IPv4-mapped address).
    pub gid: [u8; 16],
    /// Path MTU in bytes.
    pub mtu: u32,
    /// Provider-specific bytes (soft: where to rendezvous).
    pub extra: Vec<u8>,
}

impl QpAddress {
    /// Serialises for the out-of-band exchange.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(32 + self.extra.len());
        out.extend_from_slice(&self.qp_num.to_le_bytes());
        out.extend_from_slice(&self.psn.to_le_bytes());
        out.extend_from_slice(&self.lid.to_le_bytes());
        out.extend_from_slice(&self.gid);
        out.extend_from_slice(&self.mtu.to_le_bytes());
        out.extend_from_slice(&(self.extra.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.extra);
        out
    }

    /// Parses [`QpAddress::to_bytes`] output.
    pub fn from_bytes(bytes: &[u8]) -> Result<QpAddress, VerbsError> {
        let bad = || VerbsError::InvalidArgument("malformed queue pair address");
        if bytes.len() < 34 {
            return Err(bad());
        }
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
        let extra_len = u32_at(30) as usize;
        if bytes.len() != 34 + extra_len {
            return Err(bad());
        }
        Ok(QpAddress {
            qp_num: u32_at(0),
            psn: u32_at(4),
            lid: u16::from_le_bytes([bytes[8], bytes[9]]),
            gid: bytes[10..26].try_into().expect("16 bytes"),
            mtu: u32_at(26),
            extra: bytes[34..].to_vec(),
        })
    }
}

/// What can fail in a verbs call.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// The provider cannot be used on this machine (library or kernel support missing).
    #[error("RDMA provider {provider} is unavailable: {reason}")]
    ProviderUnavailable {
        /// Which provider.
        provider: &'static str,
        /// Why.
        reason: String,
    },
    /// No device with that name.
    #[error("no RDMA device named {0:?}")]
    NoSuchDevice(String),
    /// The call is not allowed in the QP's current state.
    #[error("queue pair {qp_num} is in state {state:?}: {what}")]
    InvalidState {
        /// The QP.
        qp_num: u32,
        /// Its state.
        state: QpState,
        /// What was attempted.
        what: &'static str,
    },
    /// The queue is full.
    #[error("{0} is full")]
    QueueFull(&'static str),
    /// An argument is out of range.
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// The device does not support the operation.
    #[error("not supported by this device: {0}")]
    Unsupported(&'static str),
    /// An operating-system error.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}

/// A failed post: why, and the work requests that were not posted (the failing one first).
#[derive(Debug)]
pub struct PostError<W> {
    /// Why the first of `rejected` could not be posted.
    pub error: VerbsError,
    /// The requests handed back, in order.
    pub rejected: Vec<W>,
}

impl<W> PostError<W> {
    /// The error for `failed` and every request after it, handed back in order.
    pub fn handing_back(
        error: VerbsError,
        failed: W,
        rest: impl IntoIterator<Item = W>,
    ) -> PostError<W> {
        let mut rejected = vec![failed];
        rejected.extend(rest);
        PostError { error, rejected }
    }
}

impl<W: fmt::Debug> fmt::Display for PostError<W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "post failed ({} work requests handed back): {}",
            self.rejected.len(),
            self.error
        )
    }
}

impl<W: fmt::Debug> std::error::Error for PostError<W> {}

/// A device as listed by a provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Name to open it by (`soft0`, `rxe0`, `mlx5_0`).
    pub name: String,
    /// Transport in words (`soft`, `InfiniBand`, `RoCE v2`, `iWARP`).
    pub transport: String,
}

/// What a device supports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceCaps {
    /// Largest registered region.
    pub max_mr_size: u64,
    /// Most SGEs per send or receive.
    pub max_sge: u32,
    /// Most SGEs per RDMA READ.
    pub max_sge_rd: u32,
    /// Atomics are supported.
    pub atomics: bool,
    /// RDMA WRITE with immediate is supported.
    pub write_with_imm: bool,
    /// Shared receive queues are supported.
    pub srq: bool,
    /// A CQ armed solicited-only raises an event for a solicited SEND
    /// (siw raises none: `docs/providers.md`).
    pub solicited_events: bool,
    /// Largest CQ.
    pub max_cqe: u32,
    /// Deepest queue.
    pub max_qp_wr: u32,
    /// Deepest shared receive queue.
    pub max_srq_wr: u32,
    /// This device's protection domains bind type-2 memory windows over
    /// registered memory ([`ProtectionDomain::bind_window`]): a READ window
    /// per large frame costs a posted work request instead of a
    /// registration. False where the device has none, with
    /// `RDMA_MEMORY_WINDOWS=off`, and on rxe unless `RDMA_MEMORY_WINDOWS=on`
    /// (its binds break a retransmitting QP: docs/providers.md).
    pub memory_windows: bool,
}

/// A family of devices (soft, ibverbs).
///
/// # Safety
/// Every [`Context`] `open` returns upholds that trait's contract (the safe
/// posters of this crate rely on it).
pub unsafe trait Provider: Send + Sync {
    /// `soft` or `ibverbs`.
    fn name(&self) -> &'static str;
    /// The devices present.
    fn devices(&self) -> Result<Vec<DeviceInfo>, VerbsError>;
    /// Opens a device by name.
    fn open(&self, device: &str) -> Result<Arc<dyn Context>, VerbsError>;
}

/// An opened device.
///
/// # Safety
/// The safe posters ([`owned::OwnedQueue`], [`pooled::PooledQp`]) hand memory
/// back when they poll its completion, so an implementation must give them
/// objects they alone complete into: every CQ `create_cq` returns is new,
/// shared with no other object returned before, and every PD `alloc_pd`
/// returns upholds [`ProtectionDomain`]'s contract.
pub unsafe trait Context: Send + Sync {
    /// The device's name.
    fn device_name(&self) -> &str;
    /// What the device supports.
    fn caps(&self) -> DeviceCaps;
    /// A new protection domain.
    fn alloc_pd(&self) -> Result<Arc<dyn ProtectionDomain>, VerbsError>;
    /// A new completion channel.
    fn create_comp_channel(&self) -> Result<Arc<dyn CompletionChannel>, VerbsError>;
    /// A new completion queue of at least `capacity` entries, optionally tied to `channel`.
    fn create_cq(
        &self,
        capacity: u32,
        channel: Option<&Arc<dyn CompletionChannel>>,
    ) -> Result<Arc<dyn CompletionQueue>, VerbsError>;

    /// The connection manager (rdma_cm) of this device, if the provider has one.
    fn connection_manager(&self) -> Option<Arc<dyn ConnectionManager>> {
        None
    }

    /// True when QPs of this device connect only through the connection
    /// manager (iWARP): the out-of-band address exchange cannot connect them.
    fn requires_connection_manager(&self) -> bool {
        false
    }
}

/// Connects queue pairs by IP address and port (rdma_cm): how RoCE users
/// address peers, and the only way iWARP QPs connect. Blocking calls; async
/// code runs them on a blocking thread.
pub trait ConnectionManager: Send + Sync {
    /// Listens on `addr` (port 0 picks one).
    fn listen(&self, addr: std::net::SocketAddr) -> Result<Arc<dyn CmListener>, VerbsError>;

    /// Connects `qp` (in INIT) to the listener at `addr`, sending `token` as
    /// private data, and waits until the connection is established (QP in RTS).
    fn connect(
        &self,
        qp: &Arc<dyn QueuePair>,
        addr: std::net::SocketAddr,
        token: u64,
        options: &ConnectOptions,
        timeout: Duration,
    ) -> Result<CmConnection, VerbsError>;
}

/// A listening connection-manager endpoint.
pub trait CmListener: Send + Sync {
    /// Where it listens (the real port).
    fn local_addr(&self) -> std::net::SocketAddr;

    /// Waits for the connection request that carries `token`, accepts it
    /// with `qp` (in INIT), and waits until it is established (QP in RTS).
    fn accept(
        &self,
        qp: &Arc<dyn QueuePair>,
        token: u64,
        options: &ConnectOptions,
        timeout: Duration,
    ) -> Result<CmConnection, VerbsError>;
}

/// An established connection-manager connection; dropping it disconnects.
/// Keep it as long as the QP is used.
pub struct CmConnection(pub Box<dyn std::any::Any + Send + Sync>);

impl fmt::Debug for CmConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CmConnection")
    }
}

/// A protection domain: memory regions and queue pairs that may work together.
///
/// # Safety
/// An implementation must keep what the safe types of this crate rely on:
/// - `create_qp` returns a new QP whose work completions go only into the
///   CQs named in its [`QpInit`] (and whose receives come only from its
///   SRQ), and refuses CQs and SRQs of another device context; its QP number
///   is unique among the QPs completing into those CQs;
/// - a region `register` (or `register_window`) returns covers exactly
///   `addr..addr + len` with exactly `access`: never more rights (a remote
///   write the caller did not ask for would race its references).
pub unsafe trait ProtectionDomain: Send + Sync {
    /// Registers `len` bytes at `addr` with `access` rights.
    ///
    /// # Safety
    /// The memory must stay allocated, and must not be moved, until the
    /// returned region is dropped and no work request that names it is
    /// outstanding: the device (or, for `soft`, another thread or process)
    /// reads and writes it behind the compiler's back.
    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<Arc<dyn MemoryRegion>, VerbsError>;

    /// Registers a window over `len` bytes at `addr` that only requests
    /// arriving on `qp` may use (the semantics of a type-2 memory window
    /// bound to a QP): the peer of another connection that learns or
    /// guesses the key gets REM_ACCESS_ERR. Providers without bound windows
    /// register an ordinary region (see `docs/security.md`).
    ///
    /// # Safety
    /// As for [`ProtectionDomain::register`].
    unsafe fn register_window(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
        qp: &Arc<dyn QueuePair>,
    ) -> Result<Arc<dyn MemoryRegion>, VerbsError> {
        let _ = qp;
        // SAFETY: the caller upholds `register`'s contract.
        unsafe { self.register(addr, len, access) }
    }

    /// The registrations this PD binds memory windows over, when the device
    /// has type-2 windows ([`DeviceCaps::memory_windows`]); `None` when every
    /// window must be a registration of its own
    /// ([`ProtectionDomain::register_window`]).
    fn window_cache(&self) -> Option<&Arc<WindowCache>> {
        None
    }

    /// Binds a type-2 memory window over `len` bytes at `addr` inside
    /// `region` (a region of this PD registered with
    /// [`AccessFlags::MW_BIND`]), with `access`, for requests arriving on
    /// `qp` only. On hardware the bind is a work request on `qp`'s send
    /// queue (signaled; its completion is the provider's own and never
    /// reaches a poller): it takes effect before anything posted on `qp`
    /// after it, so a key announced by a later SEND is valid when the peer
    /// gets it. At most [`MAX_BINDS_IN_FLIGHT`] binds per CQ are in flight;
    /// beyond that this fails ([`VerbsError::QueueFull`]) instead of
    /// overflowing the send queue. Deregistering the window invalidates it
    /// at once (`ibv_dealloc_mw`).
    ///
    /// # Safety
    /// As for [`ProtectionDomain::register`], for the window's bytes, until
    /// the window is deregistered; and `region` must stay registered until
    /// then.
    unsafe fn bind_window(
        &self,
        region: &Arc<dyn MemoryRegion>,
        addr: u64,
        len: usize,
        access: AccessFlags,
        qp: &Arc<dyn QueuePair>,
    ) -> Result<Arc<dyn MemoryRegion>, VerbsError> {
        let _ = (region, addr, len, access, qp);
        Err(VerbsError::Unsupported("memory windows"))
    }

    /// A new reliable-connected queue pair in state RESET.
    fn create_qp(&self, init: QpInit) -> Result<Arc<dyn QueuePair>, VerbsError>;

    /// A new shared receive queue holding up to `max_wr` receives of up to `max_sge` SGEs.
    fn create_srq(
        &self,
        max_wr: u32,
        max_sge: u32,
    ) -> Result<Arc<dyn SharedReceiveQueue>, VerbsError>;
}

/// A registered memory region; deregistered on drop.
///
/// # Safety
/// Implementing this trait vouches for the device behind it, as safe code
/// relies on it ([`RegisteredBuffer`], the window cache): `addr`, `len` and
/// the keys describe what was registered; the device reaches the memory
/// only through those keys, only within the range and with the rights
/// registered (a region without `REMOTE_WRITE`/`REMOTE_ATOMIC` is never
/// written by a peer; without `LOCAL_WRITE`, never by the local device);
/// and once [`MemoryRegion::deregister`] returned `Ok`, the device starts no
/// access to the memory through it again. (A region dropped without a
/// successful `deregister` promises nothing: owners call `deregister`
/// first and leak the memory on `Err`. Requests outstanding at the moment
/// of deregistration are not covered: owners never deregister memory under
/// them.)
pub unsafe trait MemoryRegion: Send + Sync {
    /// Start address.
    fn addr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// True when the region is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Key for local access (SGEs).
    fn lkey(&self) -> u32;
    /// Key the peer names the region by.
    fn rkey(&self) -> u32;
    /// Access rights.
    fn access(&self) -> AccessFlags;
    /// Deregisters now (dropping the region deregisters it too, if this was
    /// not called). Once this returned `Ok`, the device starts no new access
    /// through this region's keys. Local work requests still outstanding
    /// are not covered (owners never deregister memory under their own
    /// requests), nor, on soft, a peer's READ granted before (it may read
    /// what the memory holds afterwards: a window is read-only, so this can
    /// leak bytes, never corrupt them). On `Err` the device may still reach
    /// the memory: its owner must never free or reuse it (leak it).
    fn deregister(&self) -> Result<(), VerbsError>;
    /// Lets a provider recognise its own regions (to bind windows over them).
    fn as_any(&self) -> &dyn std::any::Any;
}

/// A completion queue.
///
/// # Safety
/// Implementing this trait vouches for the device behind it, as the safe
/// owners ([`owned::OwnedQueue`], [`pooled::PooledQp`]) rely on it: `poll`
/// reports each work request at most once, only after the device is done
/// with the memory the request names (every read and write of it has
/// finished), with the request's `wr_id` and the number of the QP that
/// posted it, and reports only requests of QPs created with this CQ.
pub unsafe trait CompletionQueue: Send + Sync {
    /// Entries it holds.
    fn capacity(&self) -> u32;
    /// Moves up to `out.len()` completions into `out`; returns how many.
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize, VerbsError>;
    /// Arms the CQ: the next completion (`solicited_only`: the next solicited or
    /// error completion) raises one event on its channel.
    fn req_notify(&self, solicited_only: bool) -> Result<(), VerbsError>;
    /// An id unique among the CQs of its context (what [`CompletionChannel::get_event`] returns).
    fn id(&self) -> u32;
    /// Lets a provider recognise its own CQs.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// A completion channel: an fd that becomes readable when an armed CQ gets a completion.
///
/// Waker contract: register [`CompletionChannel::fd`] with your reactor for
/// readability; when it fires, call [`CompletionChannel::get_event`] until it
/// returns `None`, ack what you got, re-arm the CQs, then poll them empty.
/// Re-arming before the final poll is what guarantees no completion is lost.
///
/// # Safety
/// [`CompletionChannel::fd`] returns the same descriptor on every call, and
/// that descriptor stays open for as long as the channel lives: callers
/// register it with a reactor ([`AsyncCompletionChannel`]) for that long.
pub unsafe trait CompletionChannel: Send + Sync {
    /// The fd to wait on (non-blocking).
    fn fd(&self) -> RawFd;
    /// The id of a CQ with an event, or `None` when no event is pending (never blocks).
    fn get_event(&self) -> Result<Option<u32>, VerbsError>;
    /// Acknowledges `count` events of CQ `cq_id`.
    fn ack_events(&self, cq_id: u32, count: u32);
    /// Lets a provider recognise its own channels.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// A reliable-connected queue pair.
///
/// # Safety
/// Implementing this trait vouches for the device behind it, as the safe
/// owners rely on it: the device reads and writes local memory only as the
/// posted requests' SGEs say (checked against the lkeys' regions); every
/// signaled send request, and every failed one, completes on the send CQ
/// the QP was created with, every posted receive on its receive CQ, and
/// everything outstanding is flushed there once the QP is in ERROR (which
/// [`QueuePair::to_error`] brings about); and `qp_num` is unique among the
/// live QPs of its opened device.
pub unsafe trait QueuePair: Send + Sync {
    /// The queue pair number.
    fn qp_num(&self) -> u32;
    /// Current state.
    fn state(&self) -> QpState;
    /// Sizes granted.
    fn caps(&self) -> QpCaps;
    /// What the peer needs to connect to this QP.
    fn local_address(&self) -> QpAddress;
    /// RESET → INIT.
    fn to_init(&self) -> Result<(), VerbsError>;
    /// INIT → RTR, pointing the QP at `remote`.
    fn to_rtr(&self, remote: &QpAddress, options: &ConnectOptions) -> Result<(), VerbsError>;
    /// RTR → RTS.
    fn to_rts(&self) -> Result<(), VerbsError>;
    /// Any state → ERROR: every outstanding request completes with WR_FLUSH_ERR.
    fn to_error(&self) -> Result<(), VerbsError>;
    /// Posts send requests, in order. On failure the failing request and all after it come back.
    ///
    /// # Safety
    /// Until the request completes (or is flushed) and that completion was
    /// polled, the memory every SGE names must stay allocated and
    /// registered: the device reads a SEND's or WRITE's source, and writes a
    /// READ's or atomic's destination, behind the compiler's back. A
    /// destination must not be read or written through a Rust reference
    /// meanwhile, a source not written. Do not deregister or free the
    /// memory before then (rdma-core does not promise that is safe; leak it
    /// if no completion can come). An `inline` request's SGEs are read
    /// during the call itself and must be readable then. The QP must not be
    /// one an [`owned::OwnedQueue`] or a [`pooled::PooledQp`] owns: their
    /// wr_ids are theirs.
    unsafe fn post_send(&self, wrs: Vec<SendWr>) -> Result<(), PostError<SendWr>>;
    /// Posts receives, in order. On failure the failing request and all after it come back.
    ///
    /// # Safety
    /// Until the receive completes (or is flushed) and that completion was
    /// polled, the memory every SGE names must stay allocated and
    /// registered, and must not be read or written through a Rust
    /// reference: the device writes the incoming message there behind the
    /// compiler's back. Do not deregister or free it before then (rdma-core
    /// does not promise that is safe; leak it if no completion can come).
    /// The QP must not be one an [`owned::OwnedQueue`] or a
    /// [`pooled::PooledQp`] owns: their wr_ids are theirs.
    unsafe fn post_recv(&self, wrs: Vec<RecvWr>) -> Result<(), PostError<RecvWr>>;

    /// Lets a provider recognise its own QPs (e.g. its connection manager).
    fn as_any(&self) -> &dyn std::any::Any;

    /// RESET → INIT → RTR → RTS in one call.
    fn connect(&self, remote: &QpAddress, options: &ConnectOptions) -> Result<(), VerbsError> {
        if self.state() == QpState::Reset {
            self.to_init()?;
        }
        self.to_rtr(remote, options)?;
        self.to_rts()
    }
}

/// A shared receive queue.
///
/// # Safety
/// As for [`QueuePair`]: a posted receive is consumed only by a QP created
/// with this SRQ, its memory written only as its SGEs say, and its
/// completion (or flush) reported on that QP's receive CQ.
pub unsafe trait SharedReceiveQueue: Send + Sync {
    /// Posts receives shared by every QP attached to this SRQ.
    ///
    /// # Safety
    /// As for [`QueuePair::post_recv`]: until the receive's completion (on
    /// the CQ of whichever QP consumed it) or its flush was polled, the
    /// memory every SGE names stays allocated and registered and is not
    /// read or written through a Rust reference. The SRQ must not be a
    /// [`shared::SharedReceivePool`]'s.
    unsafe fn post_recv(&self, wrs: Vec<RecvWr>) -> Result<(), PostError<RecvWr>>;
    /// Lets a provider recognise its own SRQs.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Bytes registered through [`RegisteredBuffer`]s and [`ExposedBuffer`]
/// windows that are alive in this process (a leak check for pools).
static REGISTERED_BYTES: AtomicU64 = AtomicU64::new(0);
/// [`RegisteredBuffer`]s registered since start.
static REGISTRATIONS: AtomicU64 = AtomicU64::new(0);
/// [`ExposedBuffer`] windows registered since start.
static WINDOWS: AtomicU64 = AtomicU64::new(0);

/// Bytes currently registered through [`RegisteredBuffer`]s and
/// [`ExposedBuffer`] windows in this process.
pub fn registered_bytes() -> u64 {
    REGISTERED_BYTES.load(AtomicOrdering::Relaxed)
}

/// Buffers registered ([`RegisteredBuffer::new`]) in this process so far:
/// what a pool that registers once keeps flat.
pub fn registrations() -> u64 {
    REGISTRATIONS.load(AtomicOrdering::Relaxed)
}

/// Windows registered over already registered buffers
/// ([`RegisteredBuffer::expose`]) in this process so far.
pub fn windows_exposed() -> u64 {
    WINDOWS.load(AtomicOrdering::Relaxed)
}

/// [`RegisteredBuffer`]s leaked so far (see [`leaked_buffers`]).
static LEAKED: AtomicU64 = AtomicU64::new(0);

/// Registered buffers given up without being deregistered or freed, because
/// a work request naming them never completed where its owner could poll it
/// (a device that stopped reporting, a completion queue that failed). Zero
/// on a healthy device: flushes bring everything back.
pub fn leaked_buffers() -> u64 {
    LEAKED.load(AtomicOrdering::Relaxed)
}

/// Counts one live registration of `len` bytes; uncounts on drop.
struct RegistrationTally(usize);

impl RegistrationTally {
    fn new(len: usize, counter: &AtomicU64) -> RegistrationTally {
        let total = REGISTERED_BYTES.fetch_add(len as u64, AtomicOrdering::Relaxed) + len as u64;
        counter.fetch_add(1, AtomicOrdering::Relaxed);
        record_registered(total);
        RegistrationTally(len)
    }
}

impl Drop for RegistrationTally {
    fn drop(&mut self) {
        let total =
            REGISTERED_BYTES.fetch_sub(self.0 as u64, AtomicOrdering::Relaxed) - self.0 as u64;
        record_registered(total);
    }
}

/// Whether [`record_registered`] publishes the `rdma_registered_bytes` gauge.
static METRICS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Publishes `rdma_registered_bytes` (a `metrics` gauge: bytes registered
/// through [`RegisteredBuffer`]s and windows, process-wide) from now on.
/// Off until called: the RDMA transport calls it when the application
/// enabled rpc-core's metrics.
pub fn enable_metrics() {
    METRICS.store(true, AtomicOrdering::Relaxed);
}

/// `rdma_registered_bytes`, once [`enable_metrics`] was called.
fn record_registered(total: u64) {
    if METRICS.load(AtomicOrdering::Relaxed) {
        metrics::gauge!("rdma_registered_bytes").set(total as f64);
    }
}

/// Memory of a [`RegisteredBuffer`]: a raw allocation, not a `Box`, since
/// the device writes it behind the compiler's back (moving a `Box` would
/// assert a uniqueness the device does not respect).
struct RawMemory {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    /// A mapping of its own (`mmap`), not a heap allocation.
    mapped: bool,
}

/// Buffers from this size up are mappings of their own: freeing one gives
/// its pages back to the system at once. From the heap, a burst of
/// rendezvous buffers (80 KiB each, under glibc's mmap threshold, which
/// also rises as large blocks are freed) stayed resident after they were
/// freed: attack 6 of issue 30 left the server at 297 MiB with 2 MiB of
/// buffers registered.
const MAP_FROM: usize = 64 << 10;
/// Larger buffers come from the allocator (which maps them itself), as
/// before: the pool keeps those for reuse (`max_cached_large_bytes`).
const MAP_UP_TO: usize = 2 << 20;

// SAFETY: `RawMemory` owns either a heap allocation or a private anonymous
// mapping of its own, neither with any thread affinity; every access to its
// bytes goes through `RegisteredBuffer`'s `&self` /
// `&mut self` methods, which follow Rust's aliasing rules across threads.
unsafe impl Send for RawMemory {}
// SAFETY: as above; `&RawMemory` only hands out `&[u8]`.
unsafe impl Sync for RawMemory {}

impl RawMemory {
    /// Alignment of every buffer: enough for 8-byte atomics, and no more
    /// than the allocator's own, so that `alloc_zeroed` is `calloc`: fresh
    /// zero pages nobody touched yet, which registration (or
    /// `make_resident`, after the huge-page advice) faults in. A larger
    /// alignment makes Rust zero every byte first, faulting the pages in as
    /// small pages before the huge-page advice can apply.
    const ALIGN: usize = 16;

    fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len, Self::ALIGN).expect("buffer size within isize")
    }

    /// `len` zeroed bytes: a mapping of its own from [`MAP_FROM`] up (fresh
    /// zero pages, page-aligned), else from the heap.
    fn zeroed(len: usize) -> RawMemory {
        if len == 0 {
            return RawMemory {
                ptr: std::ptr::NonNull::<u64>::dangling().cast(),
                len,
                mapped: false,
            };
        }
        if (MAP_FROM..MAP_UP_TO).contains(&len) && !cfg!(miri) {
            // SAFETY: a new private anonymous mapping at an address the
            // kernel chooses: it aliases nothing; unmapped only in `Drop`.
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if ptr != libc::MAP_FAILED {
                if let Some(ptr) = std::ptr::NonNull::new(ptr.cast::<u8>()) {
                    return RawMemory {
                        ptr,
                        len,
                        mapped: true,
                    };
                }
            }
            // Out of mappings (vm.max_map_count): the heap's turn.
        }
        let layout = Self::layout(len);
        // SAFETY: `layout` has a non-zero size (checked above).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = std::ptr::NonNull::new(ptr) else {
            std::alloc::handle_alloc_error(layout)
        };
        RawMemory {
            ptr,
            len,
            mapped: false,
        }
    }
}

impl Drop for RawMemory {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: mapped in `zeroed` with this length, and unmapped only
            // here, once (after the region over it was deregistered).
            let unmapped = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
            if unmapped != 0 {
                // Its pages stay mapped (leaked), never reused: at most a
                // leak, as when deregistration fails.
                tracing::warn!(
                    len = self.len,
                    error = %std::io::Error::last_os_error(),
                    "munmap of a buffer failed; its pages stay mapped"
                );
            }
        } else if self.len > 0 {
            // SAFETY: allocated in `zeroed` with this very layout, and freed
            // only here, once.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) };
        }
    }
}

/// Access a peer may use to write into memory: [`RegisteredBuffer::new`]
/// refuses it (a peer's write would race the safe slices it hands out).
const REMOTE_WRITES: AccessFlags = AccessFlags::REMOTE_WRITE.union(AccessFlags::REMOTE_ATOMIC);

/// A buffer (heap memory, or a mapping of its own from 64 KiB to 2 MiB)
/// registered with a protection domain, owning both: the region
/// is deregistered before the memory is freed (and the memory is leaked, not
/// freed, if deregistration fails), so no device access through a key can
/// reach freed memory. The keys themselves are plain numbers that may be
/// copied anywhere; what makes them harmless after the drop is
/// [`MemoryRegion::deregister`]'s contract.
///
/// Only the local device writes a buffer made by [`RegisteredBuffer::new`],
/// and only for a work request that names it, which safe code posts only
/// by moving the buffer in ([`owned::OwnedQueue`], [`pooled::PooledQp`]):
/// so `as_slice` and `as_mut_slice` never race the device. A peer may write
/// only into one made by the `unsafe` [`RegisteredBuffer::new_remote_writable`]:
/// a safe constructor refuses remote writes and atomics.
///
/// ```
/// # use rdma_verbs::{self as verbs, AccessFlags, RegisteredBuffer};
/// # let context = verbs::provider("soft").unwrap().open("soft0").unwrap();
/// # let pd = context.alloc_pd().unwrap();
/// let refused = RegisteredBuffer::new(&pd, 64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
/// assert!(refused.is_err(), "memory a peer may write gives no safe slices");
/// ```
pub struct RegisteredBuffer {
    // Field order matters: `region` is dropped (deregistered) before `data` is freed.
    region: Arc<dyn MemoryRegion>,
    pd: Arc<dyn ProtectionDomain>,
    data: RawMemory,
    _tally: RegistrationTally,
}

impl RegisteredBuffer {
    /// Allocates `len` zeroed bytes and registers them with `access`, which
    /// may not include [`AccessFlags::REMOTE_WRITE`] or
    /// [`AccessFlags::REMOTE_ATOMIC`] (`InvalidArgument`; see
    /// [`RegisteredBuffer::new_remote_writable`]).
    pub fn new(
        pd: &Arc<dyn ProtectionDomain>,
        len: usize,
        access: AccessFlags,
    ) -> Result<RegisteredBuffer, VerbsError> {
        refuse_remote_writes(access)?;
        Self::allocate(pd, len, access, false)
    }

    /// [`RegisteredBuffer::new`], asking for transparent huge pages first
    /// ([`advise_huge_pages`]; before registration pins the pages): memory
    /// a peer READs through the soft provider comes across twice as fast.
    pub fn new_huge(
        pd: &Arc<dyn ProtectionDomain>,
        len: usize,
        access: AccessFlags,
    ) -> Result<RegisteredBuffer, VerbsError> {
        refuse_remote_writes(access)?;
        Self::allocate(pd, len, access, true)
    }

    /// A buffer the peer may write (RDMA WRITE) or run atomics on, as
    /// `access` says.
    ///
    /// # Safety
    /// While the region is registered, any holder of its rkey may write the
    /// bytes at any moment. The caller must not read or write them through
    /// [`RegisteredBuffer::as_slice`] or [`RegisteredBuffer::as_mut_slice`]
    /// (or a post that names them) while a peer may be writing: only after
    /// the peer said, through a completion this side polled (a SEND or a
    /// WRITE_WITH_IMM that follows the writes on the same QP), that it is
    /// done and will not write again until told.
    pub unsafe fn new_remote_writable(
        pd: &Arc<dyn ProtectionDomain>,
        len: usize,
        access: AccessFlags,
    ) -> Result<RegisteredBuffer, VerbsError> {
        Self::allocate(pd, len, access, false)
    }

    fn allocate(
        pd: &Arc<dyn ProtectionDomain>,
        len: usize,
        access: AccessFlags,
        huge: bool,
    ) -> Result<RegisteredBuffer, VerbsError> {
        let data = RawMemory::zeroed(len);
        if huge {
            advise_huge_pages_in(data.ptr.as_ptr() as usize, len);
        }
        // SAFETY: `data` is `len` bytes (a heap allocation or a mapping of its
        // own) that this struct owns and never moves; `Drop` frees it only after the region was
        // deregistered successfully (the window cache's clone of the region
        // is untracked first), and `leak` never frees it.
        let region = unsafe { pd.register(data.ptr.as_ptr(), len, access)? };
        let extra = region.access() - access;
        if region.addr() != data.ptr.as_ptr() as u64
            || region.len() != len
            || extra.intersects(AccessFlags::all() - AccessFlags::LOCAL_WRITE)
        {
            // A provider that broke its contract: nothing of this memory can
            // be trusted to be out of the device's reach, so it is leaked.
            std::mem::forget(region);
            std::mem::forget(data);
            return Err(VerbsError::InvalidArgument(
                "the provider registered other memory or rights than asked",
            ));
        }
        if access.contains(AccessFlags::MW_BIND) && len > 0 {
            // SAFETY: `data` is this buffer's memory, just registered as
            // `region` on `pd`; `Drop` untracks it before deregistering and
            // freeing it (and `leak` frees nothing).
            unsafe {
                windows::track_registered(data.ptr.as_ptr() as usize, len, &**pd, region.clone())
            };
        }
        Ok(RegisteredBuffer {
            region,
            pd: pd.clone(),
            data,
            _tally: RegistrationTally::new(len, &REGISTRATIONS),
        })
    }

    /// Gives the buffer up without deregistering or freeing it: for memory
    /// the device may still write (a request whose completion cannot come).
    pub(crate) fn leak(self) {
        LEAKED.fetch_add(1, AtomicOrdering::Relaxed);
        tracing::warn!(
            len = self.len(),
            "a registered buffer is leaked: the device may still reach it"
        );
        std::mem::forget(self);
    }

    /// Lets the peer reach exactly the first `len` bytes with `access` (e.g.
    /// `REMOTE_READ` for a rendezvous announcement), through a second region
    /// of its own key. The buffer is read-only while exposed;
    /// [`ExposedBuffer::revoke`] deregisters the window and hands it back.
    pub fn expose(self, len: usize, access: AccessFlags) -> Result<ExposedBuffer, ExposeError> {
        self.expose_with(len, access, None)
    }

    /// [`RegisteredBuffer::expose`], for requests arriving on `qp` only
    /// ([`ProtectionDomain::register_window`]): the window of one connection
    /// is useless to the peer of another.
    pub fn expose_to(
        self,
        qp: &Arc<dyn QueuePair>,
        len: usize,
        access: AccessFlags,
    ) -> Result<ExposedBuffer, ExposeError> {
        self.expose_with(len, access, Some(qp))
    }

    fn expose_with(
        self,
        len: usize,
        access: AccessFlags,
        qp: Option<&Arc<dyn QueuePair>>,
    ) -> Result<ExposedBuffer, ExposeError> {
        if len > self.len() {
            return Err(ExposeError {
                error: VerbsError::InvalidArgument("exposed length exceeds the buffer"),
                buffer: self,
            });
        }
        if access.intersects(REMOTE_WRITES) {
            // An exposed buffer hands out `&[u8]`: the peer may only READ it.
            return Err(ExposeError {
                error: VerbsError::InvalidArgument(
                    "a buffer is exposed for remote reads only (remote writes race its slices)",
                ),
                buffer: self,
            });
        }
        let addr = self.data.ptr.as_ptr();
        // A memory window over the buffer's registration (or one of exactly
        // the window's bytes, where the device needs it: `WindowCache`),
        // where the device binds them and the buffer was registered for it.
        let mut bound = None;
        if let (Some(qp), Some(cache)) = (qp, self.pd.window_cache()) {
            if self.region.access().contains(AccessFlags::MW_BIND) && len > 0 {
                // The window owns this buffer until it is deregistered: its
                // bytes stay allocated, registered and unwritten until then.
                // SAFETY: the bytes lie in this buffer's memory, which this
                // window (holding the buffer) keeps allocated, registered
                // (its region deregisters only when the buffer drops, after
                // the window) and unwritten (an exposed buffer gives `&[u8]`
                // only) until the window is deregistered or leaked.
                match unsafe { cache.bind(&*self.pd, qp, &self.as_slice()[..len]) } {
                    Ok(window) => bound = window,
                    Err(error) => {
                        tracing::debug!(%error, "binding a memory window failed; registering a window instead");
                    }
                }
            }
        }
        let is_bound = bound.is_some();
        let window = match bound {
            Some(window) => Ok(window),
            // SAFETY: the range lies inside `data` (checked above), which
            // stays allocated and unmoved while the window exists: the
            // `Window` below owns this buffer and hands it back (or frees it)
            // only after the window was deregistered, leaking it if that
            // fails. The access grants no remote write (checked above), and
            // while exposed the buffer is only read (`Window` gives `&[u8]`).
            None => unsafe {
                match qp {
                    Some(qp) => self.pd.register_window(addr, len, access, qp),
                    None => self.pd.register(addr, len, access),
                }
            },
        };
        match window {
            Ok(window) => Ok(Window {
                window,
                _tally: RegistrationTally::new(len, &WINDOWS),
                held: Some(self),
                bound: is_bound,
            }),
            Err(error) => Err(ExposeError {
                error,
                buffer: self,
            }),
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `data` is `len` initialised (zeroed) bytes owned by this
        // buffer. Nothing writes them while this borrow lives: the local
        // device writes only for a posted request, and safe code posts one
        // only by moving the buffer away (`OwnedQueue`, `PooledQp`); a peer
        // writes only into a buffer made by `new_remote_writable`, whose
        // caller promised not to read while it may. (Crate code that posts
        // parts of a buffer it keeps, the shared pools, never calls this on
        // it: it borrows single slots with `range`/`range_mut`.)
        unsafe { std::slice::from_raw_parts(self.data.ptr.as_ptr(), self.data.len) }
    }

    /// `len` bytes at `start`, borrowing nothing else of the buffer (for
    /// owners that post parts of a buffer they keep: the shared pools).
    ///
    /// # Safety
    /// No request the device may still execute names any of these bytes,
    /// and nothing writes them while the returned slice lives.
    pub(crate) unsafe fn range(&self, start: usize, len: usize) -> &[u8] {
        assert!(
            start
                .checked_add(len)
                .is_some_and(|end| end <= self.data.len),
            "range inside the buffer"
        );
        // SAFETY: `start..start + len` lies inside the `len`-byte allocation
        // `data` owns (asserted); the caller's contract keeps every writer,
        // the device included, off these bytes while the slice lives. No
        // other byte of the buffer is borrowed.
        unsafe { std::slice::from_raw_parts(self.data.ptr.as_ptr().add(start), len) }
    }

    /// [`RegisteredBuffer::range`], writable.
    ///
    /// # Safety
    /// No request the device may still execute names any of these bytes,
    /// and nothing else reads or writes them while the returned slice lives.
    #[allow(clippy::mut_from_ref)] // the bytes are a raw allocation, not `self`'s fields
    pub(crate) unsafe fn range_mut(&self, start: usize, len: usize) -> &mut [u8] {
        assert!(
            start
                .checked_add(len)
                .is_some_and(|end| end <= self.data.len),
            "range inside the buffer"
        );
        // SAFETY: in bounds (asserted); the caller's contract makes this the
        // only access to these bytes while the slice lives.
        unsafe { std::slice::from_raw_parts_mut(self.data.ptr.as_ptr().add(start), len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only
        // borrow of the bytes.
        unsafe { std::slice::from_raw_parts_mut(self.data.ptr.as_ptr(), self.data.len) }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.data.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.data.len == 0
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.region.addr()
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.region.lkey()
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.region.rkey()
    }

    /// An SGE for `len` bytes at `offset`.
    ///
    /// # Panics
    /// When the range is not inside the buffer (or `len` exceeds `u32`), as
    /// slice indexing does; [`RegisteredBuffer::try_sge`] returns `None`.
    pub fn sge(&self, offset: usize, len: usize) -> Sge {
        self.try_sge(offset, len).unwrap_or_else(|| {
            panic!(
                "SGE of {len} bytes at {offset} outside a registered buffer of {} bytes",
                self.len()
            )
        })
    }

    /// An SGE for `len` bytes at `offset`, or `None` when the range is not
    /// inside the buffer.
    pub fn try_sge(&self, offset: usize, len: usize) -> Option<Sge> {
        let end = offset.checked_add(len)?;
        if end > self.data.len {
            return None;
        }
        Some(Sge {
            addr: self.region.addr() + offset as u64,
            length: u32::try_from(len).ok()?,
            lkey: self.region.lkey(),
        })
    }
}

impl Drop for RegisteredBuffer {
    fn drop(&mut self) {
        if self.region.access().contains(AccessFlags::MW_BIND) {
            windows::untrack_registered(self.data.ptr.as_ptr() as usize);
        }
        if let Err(error) = self.region.deregister() {
            // The device may still reach these bytes: never free them.
            tracing::error!(%error, len = self.data.len, "deregistering memory failed; leaking it");
            let leaked = std::mem::replace(&mut self.data, RawMemory::zeroed(0));
            std::mem::forget(leaked);
        }
    }
}

impl fmt::Debug for RegisteredBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisteredBuffer")
            .field("addr", &self.addr())
            .field("len", &self.len())
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .finish()
    }
}

/// Memory the peer may reach through a window region of its own key, and
/// what keeps that memory alive (`T`): dropping it (or
/// [`revoke`](Window::revoke)) deregisters the window first and lets go of
/// `T` only if that worked — otherwise `T` is leaked, never freed or reused,
/// since the peer may still reach the memory.
pub struct Window<T> {
    window: Arc<dyn MemoryRegion>,
    _tally: RegistrationTally,
    /// `None` only after the window was revoked (or leaked).
    held: Option<T>,
    /// A memory window bound over an existing registration.
    bound: bool,
}

/// A [`RegisteredBuffer`] whose first bytes the peer may reach
/// ([`RegisteredBuffer::expose`]); revoking hands the buffer back.
pub type ExposedBuffer = Window<RegisteredBuffer>;

/// Bytes the peer may READ where they lie: a REMOTE_READ window over exactly
/// the bytes, bound to one QP ([`ExposedBytes::expose`]). This is how a large
/// payload leaves without a copy: the `Bytes` (a handle on immutable memory)
/// moves in and is released only after the window is deregistered, so the
/// memory stays allocated and unchanged for as long as the peer can reach
/// it. The types enforce the rule: whoever handed the `Bytes` over cannot
/// free or change that memory, and the window cannot outlive it.
pub type ExposedBytes = Window<Bytes>;

static BYTES_WINDOWS: AtomicU64 = AtomicU64::new(0);

/// How many of [`windows_exposed`] were over an application's own bytes
/// ([`ExposedBytes`]: sent without a copy) rather than over a pooled copy.
pub fn windows_over_application_bytes() -> u64 {
    BYTES_WINDOWS.load(AtomicOrdering::Relaxed)
}

impl<T> Window<T> {
    /// Start address of the window.
    pub fn addr(&self) -> u64 {
        self.window.addr()
    }

    /// Length of the window.
    pub fn len(&self) -> usize {
        self.window.len()
    }

    /// True when the window is empty.
    pub fn is_empty(&self) -> bool {
        self.window.is_empty()
    }

    /// The key the peer names the window by.
    pub fn rkey(&self) -> u32 {
        self.window.rkey()
    }

    /// True when the window is a type-2 memory window bound over an
    /// existing registration (no registration of its own; see
    /// [`windows`]); false when it is a registration of exactly its bytes.
    pub fn is_bound(&self) -> bool {
        self.bound
    }

    /// What keeps the memory alive.
    fn held(&self) -> &T {
        self.held.as_ref().expect("present until revoked")
    }

    /// Deregisters the window (the peer's key stops working) and hands back
    /// what kept the memory alive; `None` when the window could not be
    /// deregistered (the peer may still reach the memory: it is leaked).
    pub fn revoke(mut self) -> Option<T> {
        self.revoke_window()
    }

    fn revoke_window(&mut self) -> Option<T> {
        let held = self.held.take()?;
        match self.window.deregister() {
            Ok(()) => Some(held),
            Err(error) => {
                tracing::error!(%error, "revoking a READ window failed; leaking its memory");
                std::mem::forget(held);
                None
            }
        }
    }
}

impl<T> Drop for Window<T> {
    fn drop(&mut self) {
        drop(self.revoke_window());
    }
}

impl<T> fmt::Debug for Window<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Window")
            .field("addr", &self.addr())
            .field("len", &self.len())
            .field("rkey", &self.rkey())
            .field("bound", &self.bound)
            .finish()
    }
}

impl Window<RegisteredBuffer> {
    /// The exposed bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.held().as_slice()[..self.window.len()]
    }
}

impl Window<Bytes> {
    /// A REMOTE_READ window over exactly `bytes` that only requests
    /// arriving on `qp` may use: where the device has memory windows, a
    /// window bound over a cached registration — of the recycled or pooled
    /// buffer the bytes lie in, or of the bytes themselves, which the cache
    /// then keeps alive while registered ([`windows`]); else a registration
    /// of exactly the bytes.
    pub fn expose(
        pd: &Arc<dyn ProtectionDomain>,
        qp: &Arc<dyn QueuePair>,
        bytes: Bytes,
    ) -> Result<ExposedBytes, VerbsError> {
        if bytes.is_empty() {
            return Err(VerbsError::InvalidArgument("exposing no bytes"));
        }
        if let Some(cache) = pd.window_cache() {
            // SAFETY: `bytes` moves into the `Window` built from this window,
            // which drops it only after deregistering the window (and leaks
            // it if that fails).
            match unsafe { cache.bind_bytes(&**pd, qp, &bytes) } {
                Ok(Some(window)) => {
                    BYTES_WINDOWS.fetch_add(1, AtomicOrdering::Relaxed);
                    return Ok(Window {
                        _tally: RegistrationTally::new(bytes.len(), &WINDOWS),
                        window,
                        held: Some(bytes),
                        bound: true,
                    });
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::debug!(%error, "binding a memory window failed; registering the bytes instead");
                }
            }
        }
        let addr = bytes.as_ptr().cast_mut();
        // SAFETY: the range is exactly `bytes`, which this value owns until the
        // window is deregistered (`Drop`, `revoke`; leaked if that fails), so
        // the memory stays allocated. The window is REMOTE_READ only and the
        // provider only ever reads registered memory for a READ's responder,
        // so the `*mut` is never written through; `Bytes` memory is immutable.
        let window =
            unsafe { pd.register_window(addr, bytes.len(), AccessFlags::REMOTE_READ, qp) }?;
        BYTES_WINDOWS.fetch_add(1, AtomicOrdering::Relaxed);
        Ok(Window {
            _tally: RegistrationTally::new(bytes.len(), &WINDOWS),
            window,
            held: Some(bytes),
            bound: false,
        })
    }

    /// The exposed bytes.
    pub fn bytes(&self) -> &Bytes {
        self.held()
    }
}

/// `InvalidArgument` when `access` lets a peer write.
fn refuse_remote_writes(access: AccessFlags) -> Result<(), VerbsError> {
    if access.intersects(REMOTE_WRITES) {
        return Err(VerbsError::InvalidArgument(
            "memory a peer may write is registered only through the unsafe \
             RegisteredBuffer::new_remote_writable",
        ));
    }
    Ok(())
}

/// [`RegisteredBuffer::expose`] failed; the buffer comes back.
#[derive(Debug)]
pub struct ExposeError {
    /// Why.
    pub error: VerbsError,
    /// The buffer, unchanged.
    pub buffer: RegisteredBuffer,
}

/// Asks the kernel to back the whole pages inside `memory` with transparent
/// huge pages (`MADV_HUGEPAGE`; effective where THP is in `madvise` or
/// `always` mode). A hint: whatever the outcome, the memory and its contents
/// are unchanged. Memory a peer READs through the soft provider gains most:
/// `process_vm_readv` pins one 2 MiB page where it pinned 512 small ones.
pub fn advise_huge_pages(memory: &mut [std::mem::MaybeUninit<u8>]) {
    advise_huge_pages_in(memory.as_mut_ptr() as usize, memory.len());
}

/// [`advise_huge_pages`] for the whole pages of `start..start + len`, which
/// the caller holds a mutable borrow of.
fn advise_huge_pages_in(start: usize, len: usize) {
    if cfg!(miri) {
        return; // No system calls under Miri; a hint is all this was.
    }
    const PAGE: usize = 4096;
    let first = start.next_multiple_of(PAGE);
    let end = (start + len) & !(PAGE - 1);
    if end <= first {
        return;
    }
    // SAFETY: `first..end` lies inside memory the caller borrows mutably for
    // the call; MADV_HUGEPAGE changes only how the kernel backs those pages,
    // never their contents or the mapping.
    let _ = unsafe { libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE) };
}

/// Backs every page of `bytes` with memory now, as registering memory with a
/// hardware device (which pins it) does: a pool's buffers count in the
/// process's resident memory from their registration, not from the first
/// frame that lands in them, and no first-touch page fault lands on the
/// data path (the soft provider copies into them with `process_vm_readv`).
pub(crate) fn make_resident(bytes: &mut [u8]) {
    if bytes.is_empty() || cfg!(miri) {
        return;
    }
    // SAFETY: the range is exactly the slice we borrow mutably;
    // MADV_POPULATE_WRITE faults its pages in as a write would, keeping
    // their contents (zeros here).
    let populated = unsafe {
        libc::madvise(
            bytes.as_mut_ptr().cast(),
            bytes.len(),
            libc::MADV_POPULATE_WRITE,
        )
    };
    if populated != 0 {
        // Kernels before 5.14 (or memory it refuses): touch each page.
        for page in bytes.chunks_mut(4096) {
            // A volatile write, so the store of the zero already there is kept.
            // SAFETY: `page` is a valid, exclusively borrowed, non-empty slice.
            unsafe { std::ptr::write_volatile(page.as_mut_ptr(), page[0]) };
        }
    }
}

/// Waits until `fd` is readable or `timeout` passes; `Ok(true)` when readable.
/// For blocking users of a [`CompletionChannel`] (tests, tools); async code
/// registers the fd with its reactor instead.
pub fn wait_readable(fd: RawFd, timeout: Duration) -> std::io::Result<bool> {
    let mut pollfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let millis = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    loop {
        // SAFETY: one valid pollfd for the duration of the call.
        let ready = unsafe { libc::poll(&mut pollfd, 1, millis) };
        if ready >= 0 {
            return Ok(ready > 0 && pollfd.revents & libc::POLLIN != 0);
        }
        let error = std::io::Error::last_os_error();
        if error.kind() != std::io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

/// A verbs object handed to a provider as provider type `T`, or the error
/// that says it belongs to another provider (`what`).
pub(crate) fn own<'a, T: 'static>(
    object: &'a dyn std::any::Any,
    what: &'static str,
) -> Result<&'a T, VerbsError> {
    object
        .downcast_ref::<T>()
        .ok_or(VerbsError::InvalidArgument(what))
}

/// Every provider compiled into this build, soft first.
pub fn providers() -> Vec<Arc<dyn Provider>> {
    #[allow(unused_mut)]
    let mut providers: Vec<Arc<dyn Provider>> = vec![Arc::new(soft::SoftProvider)];
    #[cfg(feature = "ibverbs")]
    providers.push(Arc::new(ibverbs::IbverbsProvider));
    providers
}

/// The provider named `name` (`soft`, `ibverbs`).
pub fn provider(name: &str) -> Result<Arc<dyn Provider>, VerbsError> {
    let ibverbs = name.eq_ignore_ascii_case("ibverbs");
    providers()
        .into_iter()
        .find(|p| p.name().eq_ignore_ascii_case(name))
        .ok_or_else(|| VerbsError::ProviderUnavailable {
            provider: if ibverbs { "ibverbs" } else { "unknown" },
            reason: if ibverbs {
                "this build has no ibverbs support: enable the feature rpc-transport-rdma/ibverbs \
                 (features = [\"ibverbs\"] on the rpc-transport-rdma dependency)"
                    .to_owned()
            } else {
                format!("no provider named {name:?} (known: soft, ibverbs)")
            },
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ack_timeout_rounds_up_to_the_exponent_the_verbs_take() {
        let with = |ack_timeout| ConnectOptions {
            ack_timeout,
            ..ConnectOptions::default()
        };
        // The default is what the QPs were given before it was a setting.
        assert_eq!(ConnectOptions::default().ack_timeout_exponent(), 14);
        let budget = ConnectOptions::default().retry_budget();
        assert!(budget > Duration::from_millis(530) && budget < Duration::from_millis(540));
        assert_eq!(with(Duration::ZERO).ack_timeout_exponent(), 1);
        assert_eq!(with(Duration::from_nanos(8192)).ack_timeout_exponent(), 1);
        assert_eq!(with(Duration::from_nanos(8193)).ack_timeout_exponent(), 2);
        // 4.096 µs × 2^18 ≈ 1.07 s: one second rounds up to it.
        assert_eq!(with(Duration::from_secs(1)).ack_timeout_exponent(), 18);
        assert_eq!(
            with(Duration::from_secs(1_000_000)).ack_timeout_exponent(),
            31
        );
        let options = ConnectOptions {
            retry_count: 3,
            ..with(Duration::from_millis(100))
        };
        // 4.096 µs × 2^15 ≈ 134 ms per try, four tries.
        assert_eq!(
            options.effective_ack_timeout(),
            Duration::from_nanos(4096 << 15)
        );
        assert_eq!(
            options.retry_budget(),
            Duration::from_nanos(4 * (4096 << 15))
        );
    }

    /// A protection domain that registers more rights than asked (what an
    /// `unsafe impl` that broke its contract would do).
    struct WideningPd(Arc<dyn ProtectionDomain>, AccessFlags);

    // SAFETY: test-only, and deliberately in breach of the contract: the
    // test shows `RegisteredBuffer` refuses what it returns.
    unsafe impl ProtectionDomain for WideningPd {
        unsafe fn register(
            &self,
            addr: *mut u8,
            len: usize,
            access: AccessFlags,
        ) -> Result<Arc<dyn MemoryRegion>, VerbsError> {
            // SAFETY: forwarded with the caller's promise about the memory.
            unsafe { self.0.register(addr, len, access | self.1) }
        }

        fn create_qp(&self, init: QpInit) -> Result<Arc<dyn QueuePair>, VerbsError> {
            self.0.create_qp(init)
        }

        fn create_srq(
            &self,
            max_wr: u32,
            max_sge: u32,
        ) -> Result<Arc<dyn SharedReceiveQueue>, VerbsError> {
            self.0.create_srq(max_wr, max_sge)
        }
    }

    #[test]
    fn a_region_with_rights_nobody_asked_for_is_refused_and_its_memory_kept_away() {
        let _counter = crate::mock::LEAK_COUNTER.lock();
        let inner = crate::mock::MockContext::open().alloc_pd().unwrap();
        let honest = RegisteredBuffer::new(&inner, 64, AccessFlags::LOCAL_WRITE);
        assert!(honest.is_ok(), "the mock registers what was asked");
        // Any right that lets a peer reach the memory, or windows be bound
        // over it, that nobody asked for.
        for right in [
            AccessFlags::REMOTE_WRITE,
            AccessFlags::REMOTE_READ,
            AccessFlags::REMOTE_ATOMIC,
            AccessFlags::MW_BIND,
        ] {
            let widening: Arc<dyn ProtectionDomain> = Arc::new(WideningPd(inner.clone(), right));
            let refused = RegisteredBuffer::new(&widening, 64, AccessFlags::LOCAL_WRITE);
            assert!(
                matches!(refused, Err(VerbsError::InvalidArgument(_))),
                "a region with {right:?} unasked is never handed out as safe memory"
            );
        }
    }

    #[test]
    fn qp_address_round_trips_and_rejects_garbage() {
        let address = QpAddress {
            qp_num: 7,
            psn: 0xabcdef,
            lid: 3,
            gid: [9; 16],
            mtu: 4096,
            extra: b"soft".to_vec(),
        };
        assert_eq!(QpAddress::from_bytes(&address.to_bytes()).unwrap(), address);
        assert!(QpAddress::from_bytes(&address.to_bytes()[..20]).is_err());
        let mut longer = address.to_bytes();
        longer.push(0);
        assert!(QpAddress::from_bytes(&longer).is_err());
    }

    #[test]
    fn access_flags_debug_and_contains() {
        let flags = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
        assert!(flags.contains(AccessFlags::REMOTE_READ));
        assert!(!flags.contains(AccessFlags::REMOTE_WRITE));
        assert_eq!(
            format!("{flags:?}"),
            "AccessFlags(LOCAL_WRITE | REMOTE_READ)"
        );
        assert_eq!(AccessFlags::from_bits_truncate(0xff), AccessFlags::all());
        assert_eq!(AccessFlags::NONE, AccessFlags::empty());
    }
}
