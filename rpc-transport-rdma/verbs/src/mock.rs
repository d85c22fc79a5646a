//! A device in memory for the crate's own tests: no engine, no system
//! calls, completions only when a test says so. It runs under Miri, and it
//! lets a test hold a request in flight for as long as it likes, which is
//! how the owners' bookkeeping (`OwnedQueue`, `PooledQp`) is tested: a
//! buffer must not come back before its completion, whatever the order of
//! events.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::{
    AccessFlags, CompletionChannel, CompletionQueue, Context, DeviceCaps, MemoryRegion, PostError,
    ProtectionDomain, QpAddress, QpCaps, QpInit, QpState, QueuePair, RecvWr, SendWr,
    SharedReceiveQueue, VerbsError, WcOpcode, WcStatus, WorkCompletion,
};

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

/// Held by tests that read the process-wide [`crate::leaked_buffers`]
/// counter, so that no other test leaks meanwhile.
pub(crate) static LEAK_COUNTER: Mutex<()> = Mutex::new(());

static NEXT: AtomicU32 = AtomicU32::new(1);

fn next_id() -> u32 {
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// An address to connect a mock QP to (the mock has no wire: any will do).
pub(crate) fn peer_address() -> QpAddress {
    QpAddress {
        qp_num: 1,
        psn: 0,
        lid: 0,
        gid: [0; 16],
        mtu: 4096,
        extra: Vec::new(),
    }
}

/// The mock device.
pub(crate) struct MockContext;

impl MockContext {
    pub(crate) fn open() -> Arc<dyn Context> {
        Arc::new(MockContext)
    }
}

// SAFETY: every CQ is new; PDs are `MockPd`s (test-only device).
unsafe impl Context for MockContext {
    fn device_name(&self) -> &str {
        "mock0"
    }

    fn caps(&self) -> DeviceCaps {
        DeviceCaps {
            max_mr_size: u64::MAX,
            max_sge: 4,
            max_sge_rd: 4,
            atomics: false,
            write_with_imm: false,
            srq: true,
            solicited_events: false,
            max_cqe: 1 << 16,
            max_qp_wr: 1 << 14,
            max_srq_wr: 1 << 16,
            memory_windows: false,
        }
    }

    fn alloc_pd(&self) -> Result<Arc<dyn ProtectionDomain>, VerbsError> {
        Ok(Arc::new(MockPd))
    }

    fn create_comp_channel(&self) -> Result<Arc<dyn CompletionChannel>, VerbsError> {
        Err(VerbsError::Unsupported(
            "completion channels on the mock device",
        ))
    }

    fn create_cq(
        &self,
        capacity: u32,
        _channel: Option<&Arc<dyn CompletionChannel>>,
    ) -> Result<Arc<dyn CompletionQueue>, VerbsError> {
        Ok(Arc::new(MockCq {
            id: next_id(),
            capacity,
            entries: Mutex::new(VecDeque::new()),
        }))
    }
}

pub(crate) struct MockPd;

struct MockMr {
    addr: u64,
    len: usize,
    key: u32,
    access: AccessFlags,
}

// SAFETY: the mock device accesses no memory at all but what `MockQp::deliver` writes, exactly as a
// posted receive names it; deregistering ends nothing because nothing reads through a key.
unsafe impl MemoryRegion for MockMr {
    fn addr(&self) -> u64 {
        self.addr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn lkey(&self) -> u32 {
        self.key
    }
    fn rkey(&self) -> u32 {
        self.key
    }
    fn access(&self) -> AccessFlags {
        self.access
    }
    fn deregister(&self) -> Result<(), VerbsError> {
        Ok(())
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

// SAFETY: each mock QP completes only into the CQs it was created with, numbered
// per device; regions cover exactly what was asked (test-only device).
unsafe impl ProtectionDomain for MockPd {
    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<Arc<dyn MemoryRegion>, VerbsError> {
        Ok(Arc::new(MockMr {
            addr: addr as u64,
            len,
            key: next_id(),
            access,
        }))
    }

    unsafe fn bind_window(
        &self,
        region: &Arc<dyn MemoryRegion>,
        addr: u64,
        len: usize,
        access: AccessFlags,
        _qp: &Arc<dyn QueuePair>,
    ) -> Result<Arc<dyn MemoryRegion>, VerbsError> {
        let end = addr.checked_add(len as u64);
        if addr < region.addr() || end > Some(region.addr() + region.len() as u64) {
            return Err(VerbsError::InvalidArgument("window outside its region"));
        }
        Ok(Arc::new(MockMr {
            addr,
            len,
            key: next_id(),
            access,
        }))
    }

    fn create_qp(&self, init: QpInit) -> Result<Arc<dyn QueuePair>, VerbsError> {
        Ok(Arc::new(MockQp {
            qp_num: next_id(),
            caps: init.caps,
            send_cq: init.send_cq,
            recv_cq: init.recv_cq,
            srq: init.srq,
            state: Mutex::new(MockQpState {
                state: QpState::Reset,
                sends: VecDeque::new(),
                recvs: VecDeque::new(),
                silent: false,
            }),
        }))
    }

    fn create_srq(
        &self,
        _max_wr: u32,
        _max_sge: u32,
    ) -> Result<Arc<dyn SharedReceiveQueue>, VerbsError> {
        Ok(Arc::new(MockSrq {
            posted: Mutex::new(VecDeque::new()),
        }))
    }
}

/// A CQ: a queue of completions.
pub(crate) struct MockCq {
    id: u32,
    capacity: u32,
    entries: Mutex<VecDeque<WorkCompletion>>,
}

impl MockCq {
    fn push(&self, completion: WorkCompletion) {
        lock(&self.entries).push_back(completion);
    }
}

// SAFETY: completions are pushed only by `MockQp` (for requests it holds, once each, after
// `deliver` wrote a receive's memory, or as flushes), with their QP's number, into the CQ that QP
// was created with.
unsafe impl CompletionQueue for MockCq {
    fn capacity(&self) -> u32 {
        self.capacity
    }
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize, VerbsError> {
        let mut entries = lock(&self.entries);
        let mut count = 0;
        while count < out.len() {
            let Some(completion) = entries.pop_front() else {
                break;
            };
            out[count] = completion;
            count += 1;
        }
        Ok(count)
    }
    fn req_notify(&self, _solicited_only: bool) -> Result<(), VerbsError> {
        Ok(())
    }
    fn id(&self) -> u32 {
        self.id
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// An SRQ: the receives posted to it, in order.
pub(crate) struct MockSrq {
    posted: Mutex<VecDeque<RecvWr>>,
}

impl MockSrq {
    /// Receives posted and not consumed.
    pub(crate) fn posted(&self) -> usize {
        lock(&self.posted).len()
    }
}

// SAFETY: receives are consumed only by `MockQp::deliver` of a QP created with this SRQ, which
// writes within the first SGE and completes on that QP's receive CQ.
unsafe impl SharedReceiveQueue for MockSrq {
    unsafe fn post_recv(&self, wrs: Vec<RecvWr>) -> Result<(), PostError<RecvWr>> {
        lock(&self.posted).extend(wrs);
        Ok(())
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

struct MockQpState {
    state: QpState,
    sends: VecDeque<SendWr>,
    recvs: VecDeque<RecvWr>,
    /// ERROR flushes nothing: a device that never reports again.
    silent: bool,
}

/// A QP that keeps what is posted until a test completes it.
pub(crate) struct MockQp {
    qp_num: u32,
    caps: QpCaps,
    send_cq: Arc<dyn CompletionQueue>,
    recv_cq: Arc<dyn CompletionQueue>,
    srq: Option<Arc<dyn SharedReceiveQueue>>,
    state: Mutex<MockQpState>,
}

fn completion(qp_num: u32, wr_id: u64, status: WcStatus, opcode: WcOpcode) -> WorkCompletion {
    WorkCompletion {
        wr_id,
        status,
        opcode,
        byte_len: 0,
        imm_data: None,
        qp_num,
    }
}

impl MockQp {
    /// The mock behind a QP of the mock device.
    pub(crate) fn of(qp: &Arc<dyn QueuePair>) -> &MockQp {
        crate::own::<MockQp>(qp.as_any(), "a mock QP").expect("a mock QP")
    }

    fn cq(cq: &Arc<dyn CompletionQueue>) -> &MockCq {
        crate::own::<MockCq>(cq.as_any(), "a mock CQ").expect("a mock CQ")
    }

    /// Send requests posted and not completed.
    pub(crate) fn sends(&self) -> Vec<SendWr> {
        lock(&self.state).sends.iter().cloned().collect()
    }

    /// Completes the oldest send request with `status`: its completion goes
    /// to the send CQ. False when none is posted.
    pub(crate) fn complete_send(&self, status: WcStatus) -> bool {
        let Some(wr) = lock(&self.state).sends.pop_front() else {
            return false;
        };
        let done = completion(self.qp_num, wr.wr_id, status, wr.op.completion_opcode());
        Self::cq(&self.send_cq).push(done);
        true
    }

    /// The peer sends `message`: it lands in the next receive (the SRQ's
    /// when the QP has one), whose completion goes to the receive CQ.
    pub(crate) fn deliver(&self, message: &[u8]) {
        let wr = match &self.srq {
            Some(srq) => {
                let srq = crate::own::<MockSrq>(srq.as_any(), "a mock SRQ").expect("mock SRQ");
                lock(&srq.posted).pop_front()
            }
            None => lock(&self.state).recvs.pop_front(),
        }
        .expect("a receive is posted");
        let sge = wr.sg_list[0];
        assert!(message.len() <= sge.length as usize, "message fits");
        // SAFETY: the receive names `sge.length` bytes of registered memory
        // that its poster keeps for the device until this completion is
        // polled (the contract of `post_recv`), so nothing else reads or
        // writes them now.
        unsafe {
            std::ptr::copy_nonoverlapping(message.as_ptr(), sge.addr as *mut u8, message.len());
        }
        let mut done = completion(self.qp_num, wr.wr_id, WcStatus::Success, WcOpcode::Recv);
        done.byte_len = message.len() as u32;
        Self::cq(&self.recv_cq).push(done);
    }

    /// From now on ERROR flushes nothing (a device that went silent).
    pub(crate) fn go_silent(&self) {
        lock(&self.state).silent = true;
    }
}

// SAFETY: the mock touches memory only in `deliver` (within a posted receive's SGE), completes each
// request once on its own CQs, flushes everything on `to_error` unless a test made it silent (then
// nothing is ever completed, which the owners must survive by leaking), and numbers QPs uniquely.
unsafe impl QueuePair for MockQp {
    fn qp_num(&self) -> u32 {
        self.qp_num
    }
    fn state(&self) -> QpState {
        lock(&self.state).state
    }
    fn caps(&self) -> QpCaps {
        self.caps
    }
    fn local_address(&self) -> QpAddress {
        QpAddress {
            qp_num: self.qp_num,
            psn: 0,
            lid: 0,
            gid: [0; 16],
            mtu: 4096,
            extra: Vec::new(),
        }
    }
    fn to_init(&self) -> Result<(), VerbsError> {
        lock(&self.state).state = QpState::Init;
        Ok(())
    }
    fn to_rtr(
        &self,
        _remote: &QpAddress,
        _options: &crate::ConnectOptions,
    ) -> Result<(), VerbsError> {
        lock(&self.state).state = QpState::Rtr;
        Ok(())
    }
    fn to_rts(&self) -> Result<(), VerbsError> {
        lock(&self.state).state = QpState::Rts;
        Ok(())
    }
    fn to_error(&self) -> Result<(), VerbsError> {
        let mut state = lock(&self.state);
        state.state = QpState::Error;
        if state.silent {
            return Ok(());
        }
        for wr in std::mem::take(&mut state.sends) {
            let flushed = completion(
                self.qp_num,
                wr.wr_id,
                WcStatus::WrFlushErr,
                wr.op.completion_opcode(),
            );
            Self::cq(&self.send_cq).push(flushed);
        }
        for wr in std::mem::take(&mut state.recvs) {
            let flushed = completion(self.qp_num, wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv);
            Self::cq(&self.recv_cq).push(flushed);
        }
        Ok(())
    }
    unsafe fn post_send(&self, wrs: Vec<SendWr>) -> Result<(), PostError<SendWr>> {
        lock(&self.state).sends.extend(wrs);
        Ok(())
    }
    unsafe fn post_recv(&self, wrs: Vec<RecvWr>) -> Result<(), PostError<RecvWr>> {
        lock(&self.state).recvs.extend(wrs);
        Ok(())
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
