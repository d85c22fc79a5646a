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
//! # use std::sync::Arc;
//! # use rpc_transport_rdma::verbs::{self, AccessFlags, QpCaps, QpInit, RegisteredBuffer, owned::OwnedQueue};
//! # let context = verbs::provider("soft").unwrap().open("soft0").unwrap();
//! # let pd = context.alloc_pd().unwrap();
//! # let cq = context.create_cq(16, None).unwrap();
//! # let qp = pd.create_qp(QpInit { send_cq: cq.clone(), recv_cq: cq.clone(), srq: None,
//! #     caps: QpCaps::default(), sq_sig_all: false }).unwrap();
//! # qp.to_init().unwrap();
//! let mut queue = OwnedQueue::new(qp, cq);
//! let mut buffer = RegisteredBuffer::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
//! queue.post_recv(buffer).unwrap();
//! buffer.as_mut_slice()[0] = 1; // error[E0382]: the device owns it now
//! ```
//!
//! The same without the offending line compiles and runs:
//!
//! ```
//! # use std::sync::Arc;
//! # use rpc_transport_rdma::verbs::{self, AccessFlags, QpCaps, QpInit, RegisteredBuffer, owned::OwnedQueue};
//! # let context = verbs::provider("soft").unwrap().open("soft0").unwrap();
//! # let pd = context.alloc_pd().unwrap();
//! # let cq = context.create_cq(16, None).unwrap();
//! # let qp = pd.create_qp(QpInit { send_cq: cq.clone(), recv_cq: cq.clone(), srq: None,
//! #     caps: QpCaps::default(), sq_sig_all: false }).unwrap();
//! # qp.to_init().unwrap();
//! let mut queue = OwnedQueue::new(qp, cq);
//! let buffer = RegisteredBuffer::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
//! queue.post_recv(buffer).unwrap();
//! assert_eq!(queue.in_flight(), 1);
//! ```

use std::collections::HashMap;
use std::sync::Arc;

use super::{
    CompletionQueue, QueuePair, RecvWr, RegisteredBuffer, SendOp, SendWr, VerbsError,
    WorkCompletion,
};

/// The top bit of every wr_id an [`OwnedQueue`] posts (raw posts on the same
/// QP keep it clear, so completions are never mistaken for each other).
pub const OWNED_WR_ID_BIT: u64 = 1 << 63;

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
/// Poll its CQ only through [`OwnedQueue::poll`]: completions polled
/// elsewhere never return their buffers (they are freed with the queue,
/// each deregistered first, which is safe but leaks them until then).
pub struct OwnedQueue {
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
    /// Wraps `qp`, whose send and receive completions go to `cq`.
    pub fn new(qp: Arc<dyn QueuePair>, cq: Arc<dyn CompletionQueue>) -> OwnedQueue {
        OwnedQueue {
            qp,
            cq,
            in_flight: HashMap::new(),
            next: 0,
            polled: vec![WorkCompletion::BLANK; 32],
        }
    }

    fn next_wr_id(&mut self) -> u64 {
        self.next = self.next.wrapping_add(1) & !OWNED_WR_ID_BIT;
        self.next | OWNED_WR_ID_BIT
    }

    /// Posts a receive into the whole of `buffer`; returns its wr_id.
    pub fn post_recv(&mut self, buffer: RegisteredBuffer) -> Result<u64, PostFailed> {
        let wr_id = self.next_wr_id();
        let wr = RecvWr {
            wr_id,
            sg_list: vec![buffer.sge(0, buffer.len())],
        };
        // SAFETY: the SGE covers `buffer`, which moves into `in_flight` (or
        // back to the caller on failure) in `track`: nothing can reach it
        // until `poll` returns it with this wr_id's completion, and if the
        // queue is dropped first the buffer is deregistered before it is freed.
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
        // its completion is polled (or deregistered before it is freed).
        let posted = unsafe { self.qp.post_send(vec![wr]) };
        self.track(wr_id, buffer, posted.map_err(|failed| failed.error))
    }

    /// Polls the CQ once: every completion of ours that arrived, each with
    /// its buffer (completions of raw posts on the same CQ are dropped).
    pub fn poll(&mut self) -> Result<Vec<Completed>, VerbsError> {
        let count = self.cq.poll(&mut self.polled)?;
        Ok(self.polled[..count]
            .iter()
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

    /// The queue pair.
    pub fn qp(&self) -> &Arc<dyn QueuePair> {
        &self.qp
    }
}
