//! What the conformance tests stand on: the provider under test, registered
//! buffers, connected QP pairs, and completion polling.
//!
//! The provider comes from `RDMA_PROVIDER` (default `soft`) and the device
//! from `RDMA_DEVICE` (default: the provider's first), so the same binary runs
//! against real rdma-core inside the kernel-RDMA VM.

#![allow(unreachable_pub, dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_verbs::{
    self as verbs, AccessFlags, CompletionChannel, CompletionQueue, ConnectOptions, Context,
    DeviceCaps, PostError, ProtectionDomain, QpCaps, QpInit, QueuePair, RecvWr, RegisteredBuffer,
    SendOp, SendWr, Sge, SharedReceiveQueue, WorkCompletion,
};

/// How long a test waits for a completion before failing (generous: rxe under TCG is slow).
pub const COMPLETION_TIMEOUT: Duration = Duration::from_secs(10);

/// The provider and device under test.
pub struct Device {
    pub context: Arc<dyn Context>,
    pub caps: DeviceCaps,
    pub quirks: Quirks,
}

/// Where a device does not do what the IB spec (and the soft provider) does,
/// as measured with this suite on Debian 12's kernel 6.1 in the RDMA VM.
/// `docs/providers.md` lists each one. A test that meets a quirk checks the
/// device's own behaviour instead and prints `known deviation (...)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Quirks {
    /// Which device family (for the message).
    pub family: &'static str,
    /// A bad lkey completes with LOC_QP_OP_ERR, not LOC_PROT_ERR (rxe, siw).
    pub bad_lkey_as_qp_op_err: bool,
    /// A bad lkey or an SGE outside its region completes with LOC_QP_OP_ERR (siw).
    pub local_protection_as_qp_op_err: bool,
    /// A READ from a region registered without REMOTE_READ succeeds (siw does not check the right).
    pub remote_read_right_not_enforced: bool,
    /// When the peer dies mid-transfer, one completion can come twice and another never (siw).
    pub duplicate_completion_on_peer_death: bool,
    /// A READ posted after the peer died may neither complete nor fail for many seconds (rxe under emulation).
    pub dead_peer_read_may_hang: bool,
    /// A READ to a dead peer's QP on the same host completes with REM_ACCESS_ERR at once (rxe answers for the destroyed QP).
    pub dead_peer_as_rem_access_err: bool,
    /// The QP's state cannot be read back: `ibv_query_qp` reports RESET, so an ERROR it entered by itself is not seen (siw).
    pub qp_state_not_queryable: bool,
    /// The sender of a message its receiver could not hold sees REM_OP_ERR, not REM_INV_REQ_ERR (rxe).
    pub receive_too_small_sender_rem_op_err: bool,
    /// An inline send longer than the QP's max_inline_data is accepted (siw).
    pub inline_limit_not_enforced: bool,
    /// A refused READ completes (WR_FLUSH_ERR) after a SEND posted behind it completes with SUCCESS (siw).
    pub refused_read_completes_after_later_send: bool,
    /// A receive too small for the message completes with LOC_QP_OP_ERR, not LOC_LEN_ERR (rxe).
    pub receive_too_small_as_qp_op_err: bool,
    /// Work requests posted after the QP entered ERROR never complete (rxe, siw on 6.1).
    pub no_flush_after_error: bool,
    /// Receives still posted when the QP errors by itself (retries exhausted) are not flushed (rxe 6.1).
    pub no_receive_flush_on_internal_error: bool,
    /// The initiator learns nothing of errors at the responder: its SEND or WRITE completes with SUCCESS (iWARP).
    pub no_remote_errors_at_initiator: bool,
    /// A READ the responder refuses completes with WR_FLUSH_ERR, not REM_ACCESS_ERR (siw).
    pub remote_access_as_flush: bool,
    /// A dead peer shows as WR_FLUSH_ERR (the TCP connection resets), not RETRY_EXC_ERR (iWARP).
    pub peer_death_as_flush: bool,
    /// No receiver-not-ready flow control: no RNR wait, no RNR_RETRY_EXC_ERR (iWARP).
    pub no_rnr: bool,
    /// No SEND_WITH_IMM (siw: post fails with EINVAL).
    pub no_send_with_imm: bool,
    /// A misaligned atomic is refused at post time (EINVAL) rather than completing with an error (rxe).
    pub misaligned_atomic_refused_at_post: bool,
    /// Posting to a QP in RESET succeeds (siw).
    pub posting_in_reset_accepted: bool,
    /// A solicited SEND raises no event on a CQ armed for solicited completions only (siw).
    pub no_solicited_events: bool,
    /// An SRQ holds more receives than asked for (depth rounded up; rxe).
    pub srq_depth_rounded_up: bool,
    /// A READ through a memory window is checked against the registration
    /// under the window, not the window's own range (rxe 6.1: `check_rkey`
    /// calls `mr_check_range` on the window's MR).
    pub window_range_not_enforced: bool,
}

impl Quirks {
    fn of(provider: &str, device: &str) -> Quirks {
        match (provider, device) {
            ("ibverbs", name) if name.starts_with("rxe") => Quirks {
                family: "rxe, kernel 6.1",
                bad_lkey_as_qp_op_err: true,
                receive_too_small_sender_rem_op_err: true,
                dead_peer_as_rem_access_err: true,
                dead_peer_read_may_hang: true,
                receive_too_small_as_qp_op_err: true,
                no_flush_after_error: true,
                no_receive_flush_on_internal_error: true,
                misaligned_atomic_refused_at_post: true,
                srq_depth_rounded_up: true,
                window_range_not_enforced: true,
                ..Quirks::default()
            },
            ("ibverbs", name) if name.starts_with("siw") => Quirks {
                family: "siw, kernel 6.1",
                bad_lkey_as_qp_op_err: true,
                local_protection_as_qp_op_err: true,
                remote_read_right_not_enforced: true,
                duplicate_completion_on_peer_death: true,
                qp_state_not_queryable: true,
                inline_limit_not_enforced: true,
                refused_read_completes_after_later_send: true,
                no_flush_after_error: true,
                no_remote_errors_at_initiator: true,
                remote_access_as_flush: true,
                peer_death_as_flush: true,
                no_rnr: true,
                no_send_with_imm: true,
                posting_in_reset_accepted: true,
                no_solicited_events: true,
                ..Quirks::default()
            },
            _ => Quirks {
                family: "none",
                ..Quirks::default()
            },
        }
    }

    /// True (and says so, visibly) when `quirk` applies to this device.
    pub fn applies(&self, quirk: bool, test: &str, what: &str) -> bool {
        if quirk {
            eprintln!("known deviation ({}): {test}: {what}", self.family);
        }
        quirk
    }
}

/// The device under test, or `None` (after printing `skipped: no RDMA device …`)
/// when the selected provider has no device here.
pub fn device() -> Option<Device> {
    let provider_name = std::env::var("RDMA_PROVIDER").unwrap_or_else(|_| "soft".into());
    let provider = verbs::provider(&provider_name)
        .expect("provider compiled in (build with --features ibverbs)");
    let devices = match provider.devices() {
        Ok(devices) => devices,
        Err(error) => {
            eprintln!("skipped: no RDMA device: {error}");
            return None;
        }
    };
    let device_name = match std::env::var("RDMA_DEVICE") {
        Ok(name) => name,
        Err(_) => match devices.first() {
            Some(device) => device.name.clone(),
            None => {
                eprintln!("skipped: no RDMA device: provider {provider_name} lists none");
                return None;
            }
        },
    };
    let context = provider.open(&device_name).expect("open device");
    let caps = context.caps();
    let quirks = Quirks::of(&provider_name, &device_name);
    Some(Device {
        context,
        caps,
        quirks,
    })
}

/// Says a test is skipped because the device lacks something, visibly.
pub fn skip(test: &str, why: &str) {
    eprintln!("skipped: {test}: {why}");
}

/// A registered buffer with test helpers.
pub struct Buffer {
    inner: RegisteredBuffer,
}

impl Buffer {
    #[allow(unsafe_code)]
    pub fn new(pd: &Arc<dyn ProtectionDomain>, len: usize, access: AccessFlags) -> Buffer {
        // SAFETY: the suite reads and writes a buffer's bytes only before it
        // posts the requests (its own or the peer's WRITEs and atomics) that
        // reach them, or after it polled the completions that end them; the
        // peer is this very process.
        let inner = unsafe { RegisteredBuffer::new_remote_writable(pd, len, access) };
        Buffer {
            inner: inner.expect("register"),
        }
    }

    pub fn bytes(&self) -> &[u8] {
        self.inner.as_slice()
    }

    pub fn fill(&mut self, seed: u8) {
        for (i, byte) in self.inner.as_mut_slice().iter_mut().enumerate() {
            *byte = seed.wrapping_add((i * 7 % 251) as u8);
        }
    }

    pub fn write(&mut self, offset: usize, bytes: &[u8]) {
        self.inner.as_mut_slice()[offset..offset + bytes.len()].copy_from_slice(bytes);
    }

    pub fn addr(&self) -> u64 {
        self.inner.addr()
    }

    pub fn rkey(&self) -> u32 {
        self.inner.rkey()
    }

    pub fn lkey(&self) -> u32 {
        self.inner.lkey()
    }

    pub fn sge(&self, offset: usize, len: usize) -> Sge {
        self.inner.sge(offset, len)
    }

    pub fn u64_at(&self, offset: usize) -> u64 {
        u64::from_le_bytes(self.bytes()[offset..offset + 8].try_into().unwrap())
    }
}

/// One side of a connection: a QP with its CQs (sharing one completion channel).
pub struct Side {
    pub pd: Arc<dyn ProtectionDomain>,
    pub qp: Arc<dyn QueuePair>,
    pub send_cq: Arc<dyn CompletionQueue>,
    pub recv_cq: Arc<dyn CompletionQueue>,
    pub channel: Arc<dyn CompletionChannel>,
    /// The device connects QPs only through rdma_cm (iWARP).
    pub requires_cm: bool,
    /// The device's rdma_cm, if any.
    pub cm: Option<Arc<dyn verbs::ConnectionManager>>,
}

pub struct SideOptions {
    pub caps: QpCaps,
    pub sq_sig_all: bool,
    pub srq: Option<Arc<dyn SharedReceiveQueue>>,
    pub cq_capacity: u32,
}

impl Default for SideOptions {
    fn default() -> Self {
        SideOptions {
            caps: QpCaps::default(),
            sq_sig_all: false,
            srq: None,
            cq_capacity: 1024,
        }
    }
}

impl Side {
    pub fn new(device: &Device, pd: &Arc<dyn ProtectionDomain>, options: SideOptions) -> Side {
        let channel = device.context.create_comp_channel().expect("channel");
        let send_cq = device
            .context
            .create_cq(options.cq_capacity, Some(&channel))
            .expect("send cq");
        let recv_cq = device
            .context
            .create_cq(options.cq_capacity, Some(&channel))
            .expect("recv cq");
        let qp = pd
            .create_qp(QpInit {
                send_cq: send_cq.clone(),
                recv_cq: recv_cq.clone(),
                srq: options.srq,
                caps: options.caps,
                sq_sig_all: options.sq_sig_all,
            })
            .expect("create qp");
        Side {
            pd: pd.clone(),
            qp,
            send_cq,
            recv_cq,
            channel,
            requires_cm: device.context.requires_connection_manager(),
            cm: device.context.connection_manager(),
        }
    }

    pub fn post_send(&self, wr: SendWr) {
        post_sends(&self.qp, vec![wr]).expect("post_send");
    }

    pub fn post_recv(&self, wr_id: u64, sg_list: Vec<Sge>) {
        post_recvs(&self.qp, vec![RecvWr { wr_id, sg_list }]).expect("post_recv");
    }
}

/// Two connected QPs in one process, each with its own PD.
pub struct Pair {
    pub a: Side,
    pub b: Side,
    /// rdma_cm connections (iWARP devices), kept as long as the QPs.
    pub _cm: Vec<verbs::CmConnection>,
}

/// The address rdma_cm listens on and connects to: `RDMA_TEST_ADDR` (an
/// address of the device's netdev), else loopback.
pub fn cm_ip() -> std::net::IpAddr {
    std::env::var("RDMA_TEST_ADDR")
        .ok()
        .and_then(|addr| addr.parse().ok())
        .unwrap_or(std::net::Ipv4Addr::LOCALHOST.into())
}

/// How long an rdma_cm connect may take under emulation.
pub const CM_TIMEOUT: Duration = Duration::from_secs(20);

/// Connects `a` and `b`: from each other's addresses, or through rdma_cm
/// when the device connects only that way (iWARP). Returns what to keep.
pub fn connect(
    device: &Device,
    a: &Side,
    b: &Side,
    options: ConnectOptions,
) -> Vec<verbs::CmConnection> {
    connect_qps(device, &a.qp, &b.qp, options)
}

/// [`connect`] for two bare QPs.
pub fn connect_qps(
    device: &Device,
    a: &Arc<dyn QueuePair>,
    b: &Arc<dyn QueuePair>,
    options: ConnectOptions,
) -> Vec<verbs::CmConnection> {
    a.to_init().expect("a init");
    b.to_init().expect("b init");
    if device.context.requires_connection_manager() {
        let cm = device.context.connection_manager().expect("rdma_cm");
        let listener = cm
            .listen(std::net::SocketAddr::new(cm_ip(), 0))
            .expect("rdma_cm listen");
        let token = 0x5eed_0000_0000_0001 ^ u64::from(b.qp_num());
        let accepting = {
            let listener = listener.clone();
            let qp = b.clone();
            std::thread::spawn(move || listener.accept(&qp, token, &options, CM_TIMEOUT))
        };
        let active = cm
            .connect(a, listener.local_addr(), token, &options, CM_TIMEOUT)
            .expect("rdma_cm connect");
        let passive = accepting.join().unwrap().expect("rdma_cm accept");
        return vec![active, passive];
    }
    let (address_a, address_b) = (a.local_address(), b.local_address());
    a.to_rtr(&address_b, &options).expect("a rtr");
    b.to_rtr(&address_a, &options).expect("b rtr");
    a.to_rts().expect("a rts");
    b.to_rts().expect("b rts");
    Vec::new()
}

impl Pair {
    pub fn new(device: &Device) -> Pair {
        Pair::with(
            device,
            SideOptions::default(),
            SideOptions::default(),
            ConnectOptions::default(),
        )
    }

    /// Default sides, connected with `options`.
    pub fn connected_with(device: &Device, options: ConnectOptions) -> Pair {
        Pair::with(
            device,
            SideOptions::default(),
            SideOptions::default(),
            options,
        )
    }

    pub fn with(device: &Device, a: SideOptions, b: SideOptions, options: ConnectOptions) -> Pair {
        let pd_a = device.context.alloc_pd().expect("pd");
        let pd_b = device.context.alloc_pd().expect("pd");
        let a = Side::new(device, &pd_a, a);
        let b = Side::new(device, &pd_b, b);
        let _cm = connect(device, &a, &b, options);
        Pair { a, b, _cm }
    }
}

/// A placeholder completion to poll into.
pub const BLANK: WorkCompletion = WorkCompletion::BLANK;

/// Polls `cq` until `n` completions arrived, failing after [`COMPLETION_TIMEOUT`].
pub fn wait(cq: &Arc<dyn CompletionQueue>, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + COMPLETION_TIMEOUT;
    let mut got = Vec::with_capacity(n);
    let mut batch = [BLANK; 32];
    while got.len() < n {
        let want = (n - got.len()).min(batch.len());
        let polled = cq.poll(&mut batch[..want]).expect("poll");
        got.extend_from_slice(&batch[..polled]);
        if polled == 0 {
            assert!(
                Instant::now() < deadline,
                "timed out with {} of {n} completions: {got:?}",
                got.len()
            );
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    got
}

/// Asserts that `cq` stays empty for `for_how_long`.
pub fn assert_quiet(cq: &Arc<dyn CompletionQueue>, for_how_long: Duration) {
    std::thread::sleep(for_how_long);
    let mut batch = [BLANK; 4];
    let polled = cq.poll(&mut batch).expect("poll");
    assert_eq!(polled, 0, "unexpected completions: {:?}", &batch[..polled]);
}

/// A signaled send work request.
pub fn wr(wr_id: u64, op: SendOp, sg_list: Vec<Sge>) -> SendWr {
    SendWr::new(wr_id, op, sg_list)
}

// The suite posts raw work requests (that is what it tests). Posting is
// `unsafe`: every test keeps the buffers its requests name alive and does not
// read or write them until the request's completion (or until the end of the
// test, when QPs go before buffers), which is the contract the three
// functions below rely on. Bad keys and ranges are fine: providers check them.

/// Posts send requests (`QueuePair::post_send`).
#[allow(unsafe_code)]
pub fn post_sends(qp: &Arc<dyn QueuePair>, wrs: Vec<SendWr>) -> Result<(), PostError<SendWr>> {
    // SAFETY: see above: the suite keeps request memory alive and untouched.
    unsafe { qp.post_send(wrs) }
}

/// Posts receives (`QueuePair::post_recv`).
#[allow(unsafe_code)]
pub fn post_recvs(qp: &Arc<dyn QueuePair>, wrs: Vec<RecvWr>) -> Result<(), PostError<RecvWr>> {
    // SAFETY: see above.
    unsafe { qp.post_recv(wrs) }
}

/// Posts receives to a shared receive queue.
#[allow(unsafe_code)]
pub fn post_srq_recvs(
    srq: &Arc<dyn SharedReceiveQueue>,
    wrs: Vec<RecvWr>,
) -> Result<(), PostError<RecvWr>> {
    // SAFETY: see above.
    unsafe { srq.post_recv(wrs) }
}
