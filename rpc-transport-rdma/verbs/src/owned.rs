//! Posting without `unsafe`: the buffer moves into the work request and
//! comes back with its completion (the shape of tokio-uring's and monoio's
//! `(result, buf)`).
//!
//! [`QueuePair::post_send`] and [`QueuePair::post_recv`] are `unsafe`: the
//! memory a request names must not be touched until the request completes,
//! and the compiler cannot see the device. [`OwnedQueue`] makes that rule a
//! type rule instead: posting takes a [`RegisteredBuffer`] **by value**, so
//! the caller has nothing left to read, write or free while the device owns
//! it, and [`OwnedQueue::poll`] hands it back only with the completion the CQ
//! reported for it.
//!
//! ```compile_fail
//! # use rdma_verbs::{self as verbs, AccessFlags, QpCaps, RegisteredBuffer, owned::OwnedQueue};
//! # let context = verbs::provider("soft").unwrap().open("soft0").unwrap();
//! # let pd = context.alloc_pd().unwrap();
//! let mut queue = OwnedQueue::new(&context, &pd, QpCaps::default()).unwrap();
//! queue.qp().to_init().unwrap();
//! let mut buffer = RegisteredBuffer::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
//! queue.post_recv(buffer).unwrap();
//! buffer.as_mut_slice()[0] = 1; // error[E0382]: the device owns it now
//! ```
//!
//! The same without the offending line compiles and runs:
//!
//! ```
//! # use rdma_verbs::{self as verbs, AccessFlags, QpCaps, RegisteredBuffer, owned::OwnedQueue};
//! # let context = verbs::provider("soft").unwrap().open("soft0").unwrap();
//! # let pd = context.alloc_pd().unwrap();
//! let mut queue = OwnedQueue::new(&context, &pd, QpCaps::default()).unwrap();
//! queue.qp().to_init().unwrap(); // receives may be posted from INIT on
//! let buffer = RegisteredBuffer::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
//! queue.post_recv(buffer).unwrap();
//! assert_eq!(queue.in_flight(), 1);
//! ```
//!
//! A queue creates its own CQ and never hands it out, so no other queue's
//! completions can reach it (a queue that took another's completion would
//! hand back a buffer the device still owns). That rests on the device: a
//! [`Context`] and [`ProtectionDomain`]
//! are `unsafe trait`s whose implementations promise new CQs and QPs that
//! complete only into their own CQs, so a safe wrapper cannot hand one
//! shared CQ to two queues. There is no way to build one over a CQ of your
//! own:
//!
//! ```compile_fail
//! # use rdma_verbs::{self as verbs, QpCaps, QpInit, owned::OwnedQueue};
//! # let context = verbs::provider("soft").unwrap().open("soft0").unwrap();
//! # let pd = context.alloc_pd().unwrap();
//! let cq = context.create_cq(16, None).unwrap();
//! let qp = pd.create_qp(QpInit { send_cq: cq.clone(), recv_cq: cq.clone(), srq: None,
//!     caps: QpCaps::default(), sq_sig_all: false }).unwrap();
//! let queue = OwnedQueue::new(qp, cq); // error[E0308]: it takes a context and a PD
//! ```

use std::collections::HashMap;
use std::sync::Arc;

use super::{
    CompletionChannel, CompletionQueue, Context, ProtectionDomain, QpCaps, QpInit, QueuePair,
    RecvWr, RegisteredBuffer, SendOp, SendWr, VerbsError, WorkCompletion,
};

/// A posted buffer that came back: its completion (status, bytes, imm) and the buffer.
#[derive(Debug)]
pub struct Completed {
    /// The completion the CQ reported.
    pub completion: WorkCompletion,
    /// The buffer, the caller's again.
    pub buffer: RegisteredBuffer,
}

/// A post that failed: why, and the buffer back, unchanged.
#[derive(Debug, thiserror::Error)]
#[error("posting failed: {error}")]
pub struct PostFailed {
    /// Why.
    pub error: VerbsError,
    /// The buffer.
    pub buffer: RegisteredBuffer,
}

/// A queue pair whose requests own their buffers until completion.
///
/// It creates its QP and CQ together and is the CQ's only poller: a
/// completion is matched to its buffer by QP number and wr_id, and every
/// buffer comes back through [`OwnedQueue::poll`] only. Dropped with
/// buffers still posted, it moves the QP to ERROR, takes back what is
/// flushed, and leaks (never frees or deregisters) any buffer whose
/// completion did not come.
pub struct OwnedQueue {
    // Drop order: `Drop` settles `in_flight` first; then the QP goes, then the CQ.
    qp: Arc<dyn QueuePair>,
    cq: Arc<dyn CompletionQueue>,
    in_flight: HashMap<u64, RegisteredBuffer>,
    next: u64,
    polled: Vec<WorkCompletion>,
}

impl std::fmt::Debug for OwnedQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedQueue")
            .field("qp", &self.qp.qp_num())
            .field("in_flight", &self.in_flight.len())
            .finish()
    }
}

impl OwnedQueue {
    /// A new RC QP of `caps` (in RESET) on `pd`, with a CQ of its own that
    /// holds a completion for every request it can have posted.
    pub fn new(
        context: &Arc<dyn Context>,
        pd: &Arc<dyn ProtectionDomain>,
        caps: QpCaps,
    ) -> Result<OwnedQueue, VerbsError> {
        Self::with_channel(context, pd, caps, None)
    }

    /// [`OwnedQueue::new`], with the CQ tied to `channel` (to wait for its
    /// completions: [`CompletionChannel`]).
    pub fn with_channel(
        context: &Arc<dyn Context>,
        pd: &Arc<dyn ProtectionDomain>,
        caps: QpCaps,
        channel: Option<&Arc<dyn CompletionChannel>>,
    ) -> Result<OwnedQueue, VerbsError> {
        let depth = caps.max_send_wr.saturating_add(caps.max_recv_wr).max(1);
        let cq = context.create_cq(depth, channel)?;
        let qp = pd.create_qp(QpInit {
            send_cq: cq.clone(),
            recv_cq: cq.clone(),
            srq: None,
            caps,
            sq_sig_all: true,
        })?;
        Ok(OwnedQueue {
            qp,
            cq,
            in_flight: HashMap::new(),
            next: 0,
            polled: vec![WorkCompletion::BLANK; 32],
        })
    }

    fn next_wr_id(&mut self) -> u64 {
        self.next = self.next.wrapping_add(1);
        self.next
    }

    /// Posts a receive into the whole of `buffer`; returns its wr_id.
    pub fn post_recv(&mut self, buffer: RegisteredBuffer) -> Result<u64, PostFailed> {
        let wr_id = self.next_wr_id();
        let wr = RecvWr {
            wr_id,
            sg_list: vec![buffer.sge(0, buffer.len())],
        };
        // SAFETY: the SGE covers `buffer`, which moves into `in_flight` (or
        // back to the caller on failure) in `track`: nothing else can reach
        // it until `poll` matches this wr_id's completion on this QP, polled
        // from the CQ only this queue holds. If the queue is dropped first,
        // `Drop` keeps the buffer until its flush, or leaks it.
        let posted = unsafe { self.qp.post_recv(vec![wr]) };
        self.track(wr_id, buffer, posted.map_err(|failed| failed.error))
    }

    /// Keeps a posted buffer until its completion, or hands it back.
    fn track(
        &mut self,
        wr_id: u64,
        buffer: RegisteredBuffer,
        posted: Result<(), VerbsError>,
    ) -> Result<u64, PostFailed> {
        match posted {
            Ok(()) => {
                self.in_flight.insert(wr_id, buffer);
                Ok(wr_id)
            }
            Err(error) => Err(PostFailed { error, buffer }),
        }
    }

    /// Posts `op` over the first `len` bytes of `buffer` (the source of a
    /// send or write, the destination of a READ or an atomic), signaled;
    /// returns its wr_id.
    pub fn post_send(
        &mut self,
        op: SendOp,
        buffer: RegisteredBuffer,
        len: usize,
    ) -> Result<u64, PostFailed> {
        let Some(sge) = buffer.try_sge(0, len) else {
            return Err(PostFailed {
                error: VerbsError::InvalidArgument("length exceeds the buffer"),
                buffer,
            });
        };
        let wr_id = self.next_wr_id();
        let wr = SendWr::new(wr_id, op, vec![sge]);
        // SAFETY: as in `post_recv`: the buffer is owned by `in_flight` until
        // this wr_id's completion on this QP is polled from this queue's own
        // CQ (or `Drop` leaks it). Signaled: every request completes.
        let posted = unsafe { self.qp.post_send(vec![wr]) };
        self.track(wr_id, buffer, posted.map_err(|failed| failed.error))
    }

    /// Polls the CQ once: every completion that arrived, each with its buffer.
    pub fn poll(&mut self) -> Result<Vec<Completed>, VerbsError> {
        let count = self.cq.poll(&mut self.polled)?;
        let qp_num = self.qp.qp_num();
        Ok(self.polled[..count]
            .iter()
            .filter(|completion| completion.qp_num == qp_num)
            .filter_map(|completion| {
                self.in_flight
                    .remove(&completion.wr_id)
                    .map(|buffer| Completed {
                        completion: *completion,
                        buffer,
                    })
            })
            .collect())
    }

    /// Buffers the device holds.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The queue pair (to connect it). Posting on it directly is `unsafe`
    /// and not allowed: its wr_ids are this queue's.
    pub fn qp(&self) -> &Arc<dyn QueuePair> {
        &self.qp
    }
}

impl Drop for OwnedQueue {
    fn drop(&mut self) {
        if self.in_flight.is_empty() {
            return;
        }
        // Flush what is posted and take it back; a buffer whose completion
        // does not come may still be the device's: leak it.
        let _ = self.qp.to_error();
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(100);
        while !self.in_flight.is_empty() && std::time::Instant::now() < deadline {
            match self.poll() {
                Ok(done) if done.is_empty() => std::thread::yield_now(),
                Ok(_) => {}
                Err(_) => break,
            }
        }
        for (_, buffer) in self.in_flight.drain() {
            buffer.leak();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock::{MockContext, MockQp};
    use crate::{AccessFlags, ConnectOptions, WcStatus};

    fn queue() -> (OwnedQueue, Arc<dyn ProtectionDomain>) {
        let context = MockContext::open();
        let pd = context.alloc_pd().unwrap();
        let queue = OwnedQueue::new(&context, &pd, QpCaps::default()).unwrap();
        let remote = crate::mock::peer_address();
        queue
            .qp()
            .connect(&remote, &ConnectOptions::default())
            .unwrap();
        (queue, pd)
    }

    fn buffer(pd: &Arc<dyn ProtectionDomain>) -> RegisteredBuffer {
        RegisteredBuffer::new(pd, 64, AccessFlags::LOCAL_WRITE).unwrap()
    }

    #[test]
    fn two_queues_number_alike_and_never_take_each_others_buffers() {
        let (mut a, pd) = queue();
        let (mut b, _) = queue();
        let a_buffer = buffer(&pd);
        let a_addr = a_buffer.addr();
        let b_buffer = buffer(&pd);
        let b_addr = b_buffer.addr();
        let a_id = a.post_recv(a_buffer).unwrap();
        let b_id = b.post_send(SendOp::Send, b_buffer, 8).unwrap();
        assert_eq!(a_id, b_id, "both number from the same start");
        // B's send completes: only B hears of it, with B's buffer.
        MockQp::of(b.qp()).complete_send(WcStatus::Success);
        assert!(a.poll().unwrap().is_empty());
        assert_eq!(a.in_flight(), 1);
        let done = b.poll().unwrap();
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].buffer.addr(), b_addr);
        // A's receive is flushed when its QP breaks: back with A's buffer.
        a.qp().to_error().unwrap();
        let done = a.poll().unwrap();
        assert_eq!(done[0].completion.status, WcStatus::WrFlushErr);
        assert_eq!(done[0].buffer.addr(), a_addr);
    }

    #[test]
    fn dropped_with_buffers_posted_it_takes_back_flushes_and_leaks_the_rest() {
        let _counter = crate::mock::LEAK_COUNTER.lock();
        let (mut flushing, pd) = queue();
        flushing.post_recv(buffer(&pd)).unwrap();
        let leaked = crate::leaked_buffers();
        drop(flushing);
        assert_eq!(crate::leaked_buffers(), leaked, "flushed, then freed");

        let (mut silent, pd) = queue();
        silent.post_recv(buffer(&pd)).unwrap();
        MockQp::of(silent.qp()).go_silent();
        drop(silent);
        assert_eq!(crate::leaked_buffers(), leaked + 1, "no flush: leaked");
    }

    #[test]
    fn a_post_past_the_buffer_hands_it_back() {
        let (mut queue, pd) = queue();
        let failed = queue.post_send(SendOp::Send, buffer(&pd), 65).unwrap_err();
        assert_eq!(failed.buffer.len(), 64);
        assert_eq!(queue.in_flight(), 0);
    }
}
