//! A connection's queue pair over a device's shared pools: the one place that
//! posts requests naming pooled memory, and the one poller of their
//! completions.
//!
//! The shared pools ([`SharedPools`]: receive slots on an SRQ, send slots)
//! and the rendezvous pool ([`crate::pool::LargePool`]) hand their memory to
//! the device and must not hand it to anyone else until the device is done
//! with it. A [`PooledQp`] keeps that rule by itself, with nothing trusted
//! from its caller:
//!
//! - it creates its QP and CQ together (the CQ is never handed out, so no
//!   other poller can take its completions, and no other QP completes into
//!   it), and encodes in every wr_id what the request holds;
//! - a send slot is written by [`PooledQp::send`] and marked in flight in
//!   the same step; it goes back to its pool only when [`PooledQp::poll`]
//!   polled that SEND's completion (or its flush);
//! - a READ's destination ([`PooledQp::pull_into`]) is held here, out of
//!   everyone's reach, until the completion or flush of every READ into it
//!   was polled ([`PooledQp::finish_pull`] hands it back only then);
//! - a receive slot's message is copied out when its completion is polled,
//!   and the slot is posted again;
//! - when it is dropped with requests still outstanding (the peer never
//!   answered, the CQ failed), the QP goes to ERROR and what it can poll
//!   comes back; whatever is still outstanding is leaked: a send slot stays
//!   out of its pool, a READ destination is never freed or deregistered.
//!   Deregistering memory under outstanding requests is something rdma-core
//!   does not promise to survive, so no provider is asked to.
//!
//! ```
//! # use std::sync::Arc;
//! # use rdma_verbs::{self as verbs, pooled::{PooledQp, PooledQpConfig}, shared::SharedPools};
//! let context = verbs::provider("soft")?.open("soft0")?;
//! let pd = context.alloc_pd()?;
//! let pools = Arc::new(SharedPools::new(&pd, 256, 1024)?);
//! let qp = PooledQp::new(&context, &pd, pools, None, PooledQpConfig::default())?;
//! assert_eq!(qp.outstanding(), 0);
//! # Ok::<(), verbs::VerbsError>(())
//! ```

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;

use crate::pool::PooledBuffer;
use crate::shared::SharedPools;
use crate::{
    CompletionChannel, CompletionQueue, Context, ProtectionDomain, QpCaps, QpInit, QueuePair,
    SendOp, SendWr, VerbsError, WcStatus, WorkCompletion,
};

/// The top two bits of a wr_id say what a request holds.
const TAG_SHIFT: u32 = 62;
const INDEX_MASK: u64 = (1 << TAG_SHIFT) - 1;
/// A receive slot of the shared receive pool (its index is the pool's).
const TAG_RECV: u64 = 0;
/// A send slot of the shared send pool.
const TAG_SEND: u64 = 1;
/// A READ into a held destination.
const TAG_READ: u64 = 2;

static READS_POSTED: AtomicU64 = AtomicU64::new(0);
static READS_FAILED: AtomicU64 = AtomicU64::new(0);

/// READs [`PooledQp`]s batched for posting so far, process-wide.
pub fn reads_posted() -> u64 {
    READS_POSTED.load(Ordering::Relaxed)
}

/// READs of [`PooledQp`]s that ended with an error or a flush (a
/// connection torn down under them), process-wide: each held its
/// destination until that completion was polled.
pub fn reads_failed() -> u64 {
    READS_FAILED.load(Ordering::Relaxed)
}

/// Completions taken from the CQ per poll.
pub const POLL_BATCH: usize = 32;

/// Sizes of a [`PooledQp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PooledQpConfig {
    /// Send queue depth: SENDs, READs and window binds in flight.
    pub max_send_wr: u32,
    /// Completion queue depth (receives of the SRQ land here too).
    pub cq_depth: u32,
    /// Largest inline SEND.
    pub max_inline_data: u32,
}

impl Default for PooledQpConfig {
    fn default() -> Self {
        PooledQpConfig {
            max_send_wr: 128,
            cq_depth: 512,
            max_inline_data: 64,
        }
    }
}

/// A send slot taken from the shared send pool and not sent yet: write a
/// message into it with [`PooledQp::send`], or give it back with
/// [`PooledQp::put_back`]. Only a [`PooledQp`] makes one.
#[derive(Debug, PartialEq, Eq)]
pub struct SendSlot(usize);

/// What a polled completion did.
#[derive(Debug)]
pub enum Polled {
    /// A receive: the message it carried (copied out of its slot, which is
    /// posted again), or `None` when it failed (`completion.status`).
    Received(Option<Bytes>),
    /// A SEND completed or failed; its slot is back in the pool.
    Sent,
    /// A READ into pull `key` completed or failed (`len` is what it asked for).
    Read {
        /// The pull ([`PooledQp::pull_into`]).
        key: u64,
        /// The READ's length.
        len: u64,
    },
    /// A READ into a pull its owner let go of ([`PooledQp::abandon_pull`]):
    /// its destination went back to the pool with its last READ.
    AbandonedRead,
    /// A completion of no request of this queue's pools (a window bind's
    /// failure, reported by the provider with its own wr_id).
    Other,
}

/// One polled completion and what it did.
#[derive(Debug)]
pub struct PolledCompletion {
    /// The completion as the CQ reported it.
    pub completion: WorkCompletion,
    /// What it released.
    pub polled: Polled,
}

/// A READ destination held while READs into it are in flight.
#[derive(Debug)]
struct Pull {
    buffer: PooledBuffer,
    /// READs in flight into it: (wr index, offset, length). Never
    /// overlapping: two copies into the same bytes at once would race.
    reads: Vec<(u64, usize, usize)>,
    /// Its owner let go of it: freed once its last READ is polled.
    abandoned: bool,
}

/// A connection's QP and CQ over the device's shared pools (see the module docs).
pub struct PooledQp {
    // Drop order: `Drop` leaks what is outstanding first; then the QP goes
    // before the CQ.
    qp: Arc<dyn QueuePair>,
    cq: Arc<dyn CompletionQueue>,
    pools: Arc<SharedPools>,
    batch: Vec<SendWr>,
    sends_in_flight: HashMap<u64, usize>,
    /// Pulls by their key: the id of each one's destination in `held`.
    pulls: HashMap<u64, u64>,
    /// Destinations held, by an id of their own (never reused): a pull its
    /// owner let go of keeps its id, and its memory, until its last READ is
    /// polled, whatever pull takes its key meanwhile.
    held: HashMap<u64, Pull>,
    next_pull: u64,
    /// READs in flight: wr index → (destination id, pull key, length).
    reads: HashMap<u64, (u64, u64, u64)>,
    next_read: u64,
    reposts: Vec<usize>,
    polled: Vec<WorkCompletion>,
    max_inline: usize,
}

impl std::fmt::Debug for PooledQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PooledQp")
            .field("qp", &self.qp.qp_num())
            .field("sends_in_flight", &self.sends_in_flight.len())
            .field("reads_in_flight", &self.reads.len())
            .finish()
    }
}

impl PooledQp {
    /// Creates a CQ of `config.cq_depth` entries (tied to `channel`, if
    /// any) and an RC QP in INIT that takes its receives from `pools`'
    /// shared receive queue and completes into that CQ.
    pub fn new(
        context: &Arc<dyn Context>,
        pd: &Arc<dyn ProtectionDomain>,
        pools: Arc<SharedPools>,
        channel: Option<&Arc<dyn CompletionChannel>>,
        config: PooledQpConfig,
    ) -> Result<PooledQp, VerbsError> {
        // The QP takes receives from the pools' SRQ and sends from their
        // slots: it must live in their protection domain.
        if !std::ptr::addr_eq(Arc::as_ptr(pd), Arc::as_ptr(pools.receive.pd())) {
            return Err(VerbsError::InvalidArgument(
                "a pooled QP on another protection domain than its pools'",
            ));
        }
        let cq = context.create_cq(config.cq_depth, channel)?;
        let qp = pd.create_qp(QpInit {
            send_cq: cq.clone(),
            recv_cq: cq.clone(),
            srq: Some(pools.receive.srq().clone()),
            caps: QpCaps {
                max_send_wr: config.max_send_wr,
                max_recv_wr: 0,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: config.max_inline_data,
            },
            sq_sig_all: false,
        })?;
        qp.to_init()?;
        let max_inline = qp.caps().max_inline_data as usize;
        Ok(PooledQp {
            qp,
            cq,
            pools,
            batch: Vec::new(),
            sends_in_flight: HashMap::new(),
            pulls: HashMap::new(),
            held: HashMap::new(),
            next_pull: 0,
            reads: HashMap::new(),
            next_read: 0,
            reposts: Vec::new(),
            polled: vec![WorkCompletion::BLANK; POLL_BATCH],
            max_inline,
        })
    }

    /// The queue pair (to connect it, move it to ERROR, bind windows on
    /// it). Posting on it directly is `unsafe` and not allowed: its wr_ids
    /// are this queue's.
    pub fn qp(&self) -> &Arc<dyn QueuePair> {
        &self.qp
    }

    /// The pools it draws from.
    pub fn pools(&self) -> &Arc<SharedPools> {
        &self.pools
    }

    /// Arms the CQ ([`CompletionQueue::req_notify`]).
    pub fn req_notify(&self, solicited_only: bool) -> Result<(), VerbsError> {
        self.cq.req_notify(solicited_only)
    }

    /// A free send slot, registering a chunk when none is free and the
    /// pool's cap allows (or `past_cap`). `None`: wait for a completion.
    pub fn take_send_slot(&mut self, past_cap: bool) -> Result<Option<SendSlot>, VerbsError> {
        Ok(self.pools.send.take(past_cap)?.map(SendSlot))
    }

    /// Gives back a slot taken and not sent.
    pub fn put_back(&mut self, slot: SendSlot) {
        self.pools.send.put_back(slot.0);
    }

    /// Writes a message into `slot` with `write` (which returns its length)
    /// and batches a SEND of it (inline when it fits; solicited, so that a
    /// peer asleep on a solicited-only arm wakes for it). Posted by
    /// [`PooledQp::post`].
    pub fn send(&mut self, slot: SendSlot, write: impl FnOnce(&mut [u8]) -> usize) {
        let index = slot.0;
        let sge = self.pools.send.fill(index, write);
        let wr_id = (TAG_SEND << TAG_SHIFT) | index as u64;
        let mut wr = SendWr::new(wr_id, SendOp::Send, vec![sge]);
        wr.inline = sge.length as usize <= self.max_inline;
        wr.solicited = true;
        self.batch.push(wr);
        self.sends_in_flight.insert(wr_id, index);
    }

    /// SENDs batched or posted and not completed.
    pub fn sends_in_flight(&self) -> usize {
        self.sends_in_flight.len()
    }

    /// Holds `destination` for pull `key` (READs into it follow with
    /// [`PooledQp::read`]). A destination already held under `key` is
    /// abandoned ([`PooledQp::abandon_pull`]).
    pub fn pull_into(&mut self, key: u64, destination: PooledBuffer) {
        self.abandon_pull(key);
        let id = self.next_pull;
        self.next_pull += 1;
        self.pulls.insert(key, id);
        self.held.insert(
            id,
            Pull {
                buffer: destination,
                reads: Vec::new(),
                abandoned: false,
            },
        );
    }

    /// Batches a READ of `len` bytes at `remote_addr` (the peer's `rkey`)
    /// into pull `key`'s destination at `offset`. Posted by [`PooledQp::post`].
    /// Refused when the range is outside the destination or overlaps a READ
    /// into it still in flight (the device would write the same bytes twice
    /// at once).
    pub fn read(
        &mut self,
        key: u64,
        offset: usize,
        len: usize,
        remote_addr: u64,
        rkey: u32,
    ) -> Result<(), VerbsError> {
        let held = self.pulls.get(&key).copied();
        let pull = match held.and_then(|id| self.held.get_mut(&id)) {
            Some(pull) => pull,
            None => {
                return Err(VerbsError::InvalidArgument(
                    "READ for a pull with no destination",
                ));
            }
        };
        let sge = pull
            .buffer
            .buffer()
            .try_sge(offset, len)
            .ok_or(VerbsError::InvalidArgument(
                "READ outside its destination buffer",
            ))?;
        let end = offset + len;
        if pull
            .reads
            .iter()
            .any(|&(_, start, length)| offset < start + length && start < end)
        {
            return Err(VerbsError::InvalidArgument(
                "READ overlapping another READ in flight into its destination",
            ));
        }
        let index = self.next_read;
        self.next_read = (self.next_read + 1) & INDEX_MASK;
        let wr_id = (TAG_READ << TAG_SHIFT) | index;
        pull.reads.push((index, offset, len));
        self.batch.push(SendWr::new(
            wr_id,
            SendOp::RdmaRead { remote_addr, rkey },
            vec![sge],
        ));
        let id = held.expect("found above");
        self.reads.insert(index, (id, key, len as u64));
        READS_POSTED.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// READs batched or posted and not completed.
    pub fn reads_in_flight(&self) -> usize {
        self.reads.len()
    }

    /// Pull `key`'s destination, once no READ into it is in flight (`None`
    /// while one is, or when there is no such pull).
    pub fn finish_pull(&mut self, key: u64) -> Option<PooledBuffer> {
        let id = *self.pulls.get(&key)?;
        if !self.held.get(&id)?.reads.is_empty() {
            return None;
        }
        self.pulls.remove(&key);
        self.held.remove(&id).map(|pull| pull.buffer)
    }

    /// Lets go of pull `key`'s destination: back to its pool now if no READ
    /// into it is in flight, else when the last one is polled.
    pub fn abandon_pull(&mut self, key: u64) {
        let Some(id) = self.pulls.remove(&key) else {
            return;
        };
        if let Some(pull) = self.held.get_mut(&id) {
            if pull.reads.is_empty() {
                self.held.remove(&id);
            } else {
                pull.abandoned = true;
            }
        }
    }

    /// Destinations held: of pulls (finished or not), and of pulls let go
    /// of whose last READ is still in flight.
    pub fn pulls(&self) -> usize {
        self.held.len()
    }

    /// True when something is batched and not posted.
    pub fn has_batch(&self) -> bool {
        !self.batch.is_empty()
    }

    /// Posts everything batched, in order. On failure the requests stay
    /// counted as outstanding (their memory is never reused): the
    /// connection is broken, and dropping this queue leaks them.
    pub fn post(&mut self) -> Result<(), VerbsError> {
        if self.batch.is_empty() {
            return Ok(());
        }
        let wrs = std::mem::take(&mut self.batch);
        // SAFETY: every SGE names pooled memory that this queue holds until
        // the request's completion is polled from its own CQ (which nothing
        // else polls, and into which no other QP completes): a send slot,
        // written by `send` and marked in flight in the pool (`fill`), no
        // reference to which the pool hands out until `completed`; or a
        // READ destination held in `held` with its READ counted, handed
        // back only once the count is zero. The memory stays allocated and
        // registered: the pools outlive this queue (it holds their `Arc`),
        // and `Drop` leaks whatever is still outstanding. Inline SENDs' slots
        // are readable during the call. Every wr_id carries its tag, none
        // the provider's own (window binds).
        unsafe { self.qp.post_send(wrs) }.map_err(|failed| failed.error)
    }

    /// Moves up to [`POLL_BATCH`] completions from the CQ into `out`, each
    /// with what it released; returns how many. Receive slots whose
    /// completions came are posted again before this returns.
    pub fn poll(&mut self, out: &mut Vec<PolledCompletion>) -> Result<usize, VerbsError> {
        let count = self.cq.poll(&mut self.polled)?;
        let mut failure = None;
        for index in 0..count {
            let completion = self.polled[index];
            let polled = match self.release(&completion) {
                Ok(polled) => polled,
                Err(error) => {
                    failure.get_or_insert(error);
                    Polled::Other
                }
            };
            out.push(PolledCompletion { completion, polled });
        }
        if !self.reposts.is_empty() {
            let reposts = std::mem::take(&mut self.reposts);
            let reposted = self.pools.receive.repost(&reposts);
            self.reposts = reposts;
            self.reposts.clear();
            reposted?;
        }
        match failure {
            Some(error) => Err(error),
            None => Ok(count),
        }
    }

    /// Gives back what `completion`'s request held, whatever its status.
    fn release(&mut self, completion: &WorkCompletion) -> Result<Polled, VerbsError> {
        if completion.qp_num != self.qp.qp_num() {
            return Ok(Polled::Other);
        }
        let index = completion.wr_id & INDEX_MASK;
        match completion.wr_id >> TAG_SHIFT {
            TAG_RECV => {
                let slot = index as usize;
                // SAFETY (both): `completion` was polled from this queue's own
                // CQ, into which only its QP completes; a receive wr_id with
                // the RECV tag is one the receive pool posted in `slot` (raw
                // posts on this QP are not allowed: `QueuePair::post_recv`),
                // and a polled completion means the device is done with it.
                let message = if completion.status == WcStatus::Success {
                    let len = completion.byte_len as usize;
                    Some(unsafe { self.pools.receive.take(slot, len) }?)
                } else {
                    unsafe { self.pools.receive.take_failed(slot) }?;
                    None
                };
                self.reposts.push(slot);
                Ok(Polled::Received(message))
            }
            TAG_SEND => match self.sends_in_flight.remove(&completion.wr_id) {
                Some(slot) => {
                    // SAFETY: this SEND (wr_id matched among this queue's
                    // own, on its own QP) was polled from this queue's CQ:
                    // the device no longer reads its slot.
                    unsafe { self.pools.send.completed(slot) }?;
                    Ok(Polled::Sent)
                }
                None => Ok(Polled::Other),
            },
            TAG_READ => {
                let Some((id, key, len)) = self.reads.remove(&index) else {
                    return Ok(Polled::Other);
                };
                if completion.status != WcStatus::Success {
                    READS_FAILED.fetch_add(1, Ordering::Relaxed);
                }
                let mut abandoned = false;
                if let Some(pull) = self.held.get_mut(&id) {
                    pull.reads.retain(|&(read, _, _)| read != index);
                    abandoned = pull.abandoned;
                    if pull.reads.is_empty() && abandoned {
                        self.held.remove(&id);
                    }
                }
                Ok(if abandoned {
                    Polled::AbandonedRead
                } else {
                    Polled::Read { key, len }
                })
            }
            _ => Ok(Polled::Other),
        }
    }

    /// Requests posted whose completions were not polled yet.
    pub fn outstanding(&self) -> usize {
        self.sends_in_flight.len() + self.reads.len()
    }
}

impl Drop for PooledQp {
    fn drop(&mut self) {
        if self.outstanding() == 0 {
            return;
        }
        // Flush what can be flushed and take back what comes.
        let _ = self.qp.to_error();
        let mut out = Vec::new();
        for _ in 0..64 {
            out.clear();
            match self.poll(&mut out) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            if self.outstanding() == 0 {
                return;
            }
        }
        // The rest may still be the device's: never reuse or free it.
        tracing::warn!(
            sends = self.sends_in_flight.len(),
            reads = self.reads.len(),
            "requests never completed: their memory stays out of the pools"
        );
        for (_, slot) in self.sends_in_flight.drain() {
            self.pools.send.lose(slot);
        }
        for (_, pull) in self.held.drain() {
            if !pull.reads.is_empty() {
                pull.buffer.leak();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock::{MockContext, MockQp};
    use crate::pool::{LargePool, LargePoolConfig};
    use crate::{ConnectOptions, SendOp};

    struct Bed {
        queue: PooledQp,
        large: Arc<LargePool>,
    }

    impl Bed {
        fn new() -> Bed {
            let context = MockContext::open();
            let pd = context.alloc_pd().unwrap();
            let pools = Arc::new(SharedPools::new(&pd, 256, 256).unwrap());
            pools.receive.commit(4, 4).unwrap();
            let queue =
                PooledQp::new(&context, &pd, pools, None, PooledQpConfig::default()).unwrap();
            let remote = crate::mock::peer_address();
            queue
                .qp()
                .connect(&remote, &ConnectOptions::default())
                .unwrap();
            let config = LargePoolConfig {
                prealloc_per_class: 0,
                max_cached_bytes: 1 << 20,
                ..LargePoolConfig::default()
            };
            let large = LargePool::new(pd, config).unwrap();
            Bed { queue, large }
        }

        fn mock(&self) -> &MockQp {
            MockQp::of(self.queue.qp())
        }

        fn poll(&mut self) -> Vec<PolledCompletion> {
            let mut out = Vec::new();
            self.queue.poll(&mut out).unwrap();
            out
        }
    }

    #[test]
    fn a_read_destination_comes_back_only_with_its_completion() {
        let mut bed = Bed::new();
        let destination = bed.large.take(4096).unwrap();
        // (A miss registers a spare too.)
        let cached = bed.large.cached_bytes();
        let addr = destination.buffer().addr();
        bed.queue.pull_into(7, destination);
        bed.queue.read(7, 0, 2048, 0x1000, 42).unwrap();
        bed.queue.read(7, 2048, 2048, 0x1800, 42).unwrap();
        bed.queue.post().unwrap();
        let posted = bed.mock().sends();
        assert_eq!(posted.len(), 2);
        assert_eq!(posted[0].sg_list[0].addr, addr);
        assert!(matches!(posted[0].op, SendOp::RdmaRead { rkey: 42, .. }));
        // Not handed back, nor back in the pool, while READs are in flight.
        assert!(bed.queue.finish_pull(7).is_none());
        bed.queue.abandon_pull(7);
        assert_eq!(bed.large.cached_bytes(), cached);
        assert!(bed.mock().complete_send(WcStatus::Success));
        let polled = bed.poll();
        assert!(
            matches!(polled[0].polled, Polled::AbandonedRead),
            "the pull was let go of"
        );
        assert_eq!(bed.large.cached_bytes(), cached, "one READ still in flight");
        // The second READ is flushed: that too ends it.
        bed.queue.qp().to_error().unwrap();
        let polled = bed.poll();
        assert_eq!(polled[0].completion.status, WcStatus::WrFlushErr);
        assert_eq!(bed.queue.outstanding(), 0);
        assert_eq!(
            bed.large.cached_bytes(),
            cached + (64 << 10),
            "back in the pool"
        );
    }

    /// A new pull under the key of one let go of with a READ in flight
    /// does not release the old destination: it stays held (out of the pool)
    /// until that READ is polled.
    #[test]
    fn a_new_pull_under_a_key_keeps_the_old_destination_until_its_read_completes() {
        let mut bed = Bed::new();
        bed.queue.pull_into(7, bed.large.take(4096).unwrap());
        bed.queue.read(7, 0, 4096, 0x1000, 42).unwrap();
        bed.queue.post().unwrap();
        let cached = bed.large.cached_bytes();
        let out = bed.large.buffers_out();
        bed.queue.pull_into(7, bed.large.take(4096).unwrap());
        assert_eq!(bed.queue.pulls(), 2, "the old destination is still held");
        assert_eq!(bed.large.buffers_out(), out + 1);
        assert!(
            bed.large.cached_bytes() <= cached,
            "nothing went back to the pool"
        );
        bed.mock().complete_send(WcStatus::Success);
        let polled = bed.poll();
        assert!(matches!(polled[0].polled, Polled::AbandonedRead));
        assert_eq!(bed.queue.pulls(), 1);
        assert_eq!(bed.large.buffers_out(), out, "the old one is back now");
        assert!(
            bed.queue.finish_pull(7).is_some(),
            "the new pull is untouched"
        );
    }

    #[test]
    fn a_finished_pull_hands_its_destination_back_once_every_read_completed() {
        let mut bed = Bed::new();
        bed.queue.pull_into(1, bed.large.take(100).unwrap());
        bed.queue.read(1, 0, 100, 0x1000, 9).unwrap();
        assert!(
            bed.queue.read(2, 0, 100, 0x1000, 9).is_err(),
            "no such pull"
        );
        assert!(
            bed.queue.read(1, 99, 10, 0x2000, 9).is_err(),
            "overlaps a READ in flight"
        );
        assert!(
            bed.queue.read(1, 64 << 10, 1, 0x1000, 9).is_err(),
            "outside the destination"
        );
        bed.queue.post().unwrap();
        assert!(bed.queue.finish_pull(1).is_none());
        bed.mock().complete_send(WcStatus::Success);
        bed.poll();
        let destination = bed.queue.finish_pull(1).expect("every READ completed");
        assert_eq!(destination.buffer().len(), 64 << 10);
    }

    #[test]
    fn dropped_with_reads_no_device_will_complete_it_leaks_their_memory() {
        let mut bed = Bed::new();
        bed.queue.pull_into(3, bed.large.take(4096).unwrap());
        let cached = bed.large.cached_bytes();
        bed.queue.read(3, 0, 4096, 0x1000, 5).unwrap();
        let slot = bed.queue.take_send_slot(true).unwrap().unwrap();
        bed.queue.send(slot, |buffer| {
            buffer[..5].copy_from_slice(b"hello");
            5
        });
        bed.queue.post().unwrap();
        bed.mock().go_silent();
        let _counter = crate::mock::LEAK_COUNTER.lock();
        let leaked = crate::leaked_buffers();
        let pools = bed.queue.pools().clone();
        drop(bed.queue);
        assert_eq!(
            crate::leaked_buffers(),
            leaked + 1,
            "the READ's destination"
        );
        assert_eq!(bed.large.cached_bytes(), cached, "never back in the pool");
        assert_eq!(pools.send.lost(), 1, "the SEND's slot stays out");
    }

    #[test]
    fn a_send_slot_is_reused_only_after_its_completion() {
        let mut bed = Bed::new();
        let first = bed.queue.take_send_slot(true).unwrap().unwrap();
        let first_index = first.0;
        bed.queue.send(first, |buffer| {
            buffer[..2].copy_from_slice(b"hi");
            2
        });
        bed.queue.post().unwrap();
        assert_eq!(bed.mock().sends()[0].sg_list[0].length, 2);
        assert!(bed.mock().sends()[0].inline);
        let second = bed.queue.take_send_slot(true).unwrap().unwrap();
        assert_ne!(second.0, first_index, "a slot in flight is not handed out");
        bed.queue.put_back(second);
        bed.mock().complete_send(WcStatus::Success);
        assert!(matches!(bed.poll()[0].polled, Polled::Sent));
        assert_eq!(bed.queue.sends_in_flight(), 0);
    }

    #[test]
    fn a_received_message_is_copied_out_and_its_slot_posted_again() {
        let mut bed = Bed::new();
        let srq = bed.queue.pools().receive.srq().clone();
        let srq = crate::own::<crate::mock::MockSrq>(srq.as_any(), "mock").unwrap();
        let posted = srq.posted();
        assert!(posted >= 4);
        bed.mock().deliver(b"a message");
        assert_eq!(srq.posted(), posted - 1);
        let polled = bed.poll();
        match &polled[0].polled {
            Polled::Received(Some(message)) => assert_eq!(&message[..], b"a message"),
            other => panic!("{other:?}"),
        }
        assert_eq!(srq.posted(), posted, "posted again");
    }

    #[test]
    fn completions_of_another_qp_release_nothing() {
        let mut bed = Bed::new();
        bed.queue.pull_into(1, bed.large.take(100).unwrap());
        bed.queue.read(1, 0, 100, 0x1000, 9).unwrap();
        bed.queue.post().unwrap();
        let wr_id = bed.mock().sends()[0].wr_id;
        let forged = WorkCompletion {
            wr_id,
            status: WcStatus::Success,
            opcode: crate::WcOpcode::RdmaRead,
            byte_len: 100,
            imm_data: None,
            qp_num: bed.queue.qp().qp_num() + 1,
        };
        assert!(matches!(bed.queue.release(&forged).unwrap(), Polled::Other));
        assert_eq!(bed.queue.reads_in_flight(), 1);
    }
}
