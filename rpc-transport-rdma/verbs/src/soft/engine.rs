//! The soft provider's engine threads: a fixed set per process, each an
//! `epoll` loop over the sockets of the queue pairs it serves.
//!
//! A connected soft QP needs someone to execute its peer's requests and
//! retire its own when no caller polls one of its CQs. That used to be a
//! thread per QP; a server with a thousand clients ran a thousand threads.
//! Now each attached QP is handed to one of [`engine_count`] engine threads
//! (by QP number), which waits on the doorbell sockets of all its QPs at
//! once and on per-QP timers (RNR resends, the nap of a QP whose caller
//! polls). An idle QP costs an entry in a table: no thread, no wake-up.
//!
//! What one turn of an engine does for a QP is the old per-QP loop body
//! ([`QpShared::engine_turn`]): swallow doorbells, progress the QP unless a
//! caller polls it, then declare it asleep (doorbells wanted) or napping.
//! A turn never waits on the peer: what the QP writes to a ring that is
//! full stays queued and the QP stops reading its peer's requests until
//! the ring drains ([`QpShared::progress`]), so a peer that stops reading
//! stalls only itself, never the other QPs of its engine.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rustix::event::{EventfdFlags, Timespec, epoll};

use super::lock;
use super::qp::QpShared;
use super::ring::RingPair;

/// Engine threads at most (one per core up to this).
const MAX_ENGINES: usize = 4;
/// QPs one turn of the loop serves back to back before it looks at the
/// others again (a QP whose peer keeps sending does not starve the rest).
const TURNS_IN_A_ROW: u32 = 16;
/// epoll events taken per wait.
const EVENTS_PER_WAIT: usize = 256;
/// The epoll key of the engine's own wake-up eventfd.
const WAKE_KEY: u64 = 0;
/// How often an engine with QPs looks for one that a polling caller left
/// without saying so (it stopped polling without arming a CQ): doorbells
/// turned off, or acknowledgements left for a next poll that never came;
/// and for one whose peer answered none of its requests for the
/// acknowledgement time-out.
/// Such a QP is taken up again within this bound. One look at all QPs per
/// engine (atomic loads), not a wake-up per QP.
const ABANDONED_POLL_CHECK: Duration = Duration::from_millis(100);

/// What a turn decided about the QP's next wait.
pub(crate) enum Next {
    /// Wait for a doorbell (or EOF), and also for this instant when given.
    Wait(Option<Instant>),
    /// The QP is in ERROR or was re-attached: forget it.
    Done,
}

/// A QP an engine serves.
struct Entry {
    qp: Arc<QpShared>,
    /// A clone of the QP's socket: doorbells and EOF.
    waiter: UnixStream,
    ring: Arc<RingPair>,
    /// The attach this entry belongs to.
    generation: u64,
    /// The timer this entry waits for (heap items that differ are stale).
    timer: Option<Instant>,
}

/// One engine thread's shared half: new QPs come in through `incoming`.
struct Engine {
    epoll: OwnedFd,
    wake: OwnedFd,
    incoming: Mutex<Vec<(u64, Entry)>>,
    /// Keys of QPs a caller asked a turn for ([`poke`]).
    poked: Mutex<Vec<u64>>,
}

/// The process's engines, started on first use.
fn engines() -> io::Result<&'static [&'static Engine]> {
    static ENGINES: OnceLock<Result<&'static [&'static Engine], io::ErrorKind>> = OnceLock::new();
    let started = ENGINES.get_or_init(|| {
        let mut engines = Vec::new();
        let mut failure = io::ErrorKind::Other;
        for i in 0..engine_count() {
            let engine = match Engine::new() {
                Ok(engine) => engine,
                Err(error) => {
                    failure = error.kind();
                    break;
                }
            };
            let spawned = std::thread::Builder::new()
                .name(format!("soft-rdma-engine-{i}"))
                .spawn(move || engine.run());
            if let Err(error) = spawned {
                failure = error.kind();
                break;
            }
            engines.push(engine);
        }
        if engines.is_empty() {
            return Err(failure);
        }
        // The engines live as long as the process, like their threads.
        Ok(&*Box::leak(engines.into_boxed_slice()))
    });
    started.map_err(|kind| io::Error::new(kind, "cannot start the soft provider's engine threads"))
}

/// Engine threads of this process: one per core, at most [`MAX_ENGINES`].
pub(crate) fn engine_count() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, MAX_ENGINES)
}

static NEXT_KEY: AtomicU64 = AtomicU64::new(WAKE_KEY + 1);

/// Hands an attached QP to an engine; its first turn comes at once.
/// Returns the QP's key at its engine (for [`poke`]).
pub(crate) fn attach(
    qp: Arc<QpShared>,
    waiter: UnixStream,
    ring: Arc<RingPair>,
    generation: u64,
) -> io::Result<u64> {
    let engines = engines()?;
    let engine = &engines[qp.qp_num as usize % engines.len()];
    waiter.set_nonblocking(true)?;
    let key = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
    lock(&engine.incoming).push((
        key,
        Entry {
            qp,
            waiter,
            ring,
            generation,
            timer: None,
        },
    ));
    engine.wake();
    Ok(key)
}

/// Asks the engine of QP `qp_num` for a turn of the QP attached under `key`
/// soon (a caller left it messages that a full ring did not take: the
/// engine writes them as room appears, or fails the QP when none does).
pub(crate) fn poke(qp_num: u32, key: u64) {
    let Ok(engines) = engines() else {
        return;
    };
    let engine = &engines[qp_num as usize % engines.len()];
    lock(&engine.poked).push(key);
    engine.wake();
}

impl Engine {
    fn new() -> io::Result<&'static Engine> {
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        let wake = rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        epoll_add(&epoll, &wake, WAKE_KEY)?;
        // Lives as long as the process, like its thread.
        Ok(Box::leak(Box::new(Engine {
            epoll,
            wake,
            incoming: Mutex::new(Vec::new()),
            poked: Mutex::new(Vec::new()),
        })))
    }

    fn wake(&self) {
        // A full counter (EAGAIN) already means "wake up".
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }

    fn drain_wake(&self) {
        let mut count = [0u8; 8];
        // Non-blocking: EAGAIN when nobody woke us.
        let _ = rustix::io::read(&self.wake, &mut count);
    }

    /// The engine thread.
    fn run(&self) {
        let mut entries: HashMap<u64, Entry> = HashMap::new();
        let mut timers: BinaryHeap<Reverse<(Instant, u64)>> = BinaryHeap::new();
        let mut events: Vec<epoll::Event> = Vec::with_capacity(EVENTS_PER_WAIT);
        let mut due: Vec<u64> = Vec::new();
        let mut next_check = Instant::now() + ABANDONED_POLL_CHECK;
        loop {
            let wake_at = timers
                .peek()
                .map(|Reverse((at, _))| *at)
                .into_iter()
                .chain((!entries.is_empty()).then_some(next_check))
                .min();
            let timeout = wake_at.map(|at| {
                let left = at.saturating_duration_since(Instant::now());
                // Rounded up to whole milliseconds: waking early would only spin.
                let millis = left.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as i64;
                Timespec {
                    tv_sec: millis / 1000,
                    tv_nsec: (millis % 1000) * 1_000_000,
                }
            });
            events.clear();
            // An error (EINTR) is a wait that returned nothing.
            let _ = epoll::wait(
                &self.epoll,
                rustix::buffer::spare_capacity(&mut events),
                timeout.as_ref(),
            );
            due.clear();
            for event in &events {
                let key = event.data.u64();
                if key == WAKE_KEY {
                    self.drain_wake();
                } else {
                    due.push(key);
                }
            }
            for (key, entry) in lock(&self.incoming).drain(..) {
                if epoll_add(&self.epoll, &entry.waiter, key).is_err() {
                    entry.qp.fail_from_engine();
                    continue;
                }
                entries.insert(key, entry);
                due.push(key);
            }
            due.extend(lock(&self.poked).drain(..));
            let now = Instant::now();
            while let Some(Reverse((at, key))) = timers.peek().copied() {
                if at > now {
                    break;
                }
                timers.pop();
                if entries.get(&key).is_some_and(|e| e.timer == Some(at)) {
                    due.push(key);
                }
            }
            if now >= next_check {
                next_check = now + ABANDONED_POLL_CHECK;
                due.extend(
                    entries
                        .iter()
                        .filter(|(_, e)| {
                            (e.timer.is_none() && e.qp.left_by_poller(&e.ring))
                                || e.qp.answer_overdue()
                        })
                        .map(|(key, _)| *key),
                );
            }
            due.sort_unstable();
            due.dedup();
            for &key in &due {
                let Some(entry) = entries.get_mut(&key) else {
                    continue;
                };
                match turns(entry) {
                    Next::Wait(timer) => {
                        entry.timer = timer;
                        if let Some(at) = timer {
                            timers.push(Reverse((at, key)));
                        }
                    }
                    Next::Done => {
                        if let Some(entry) = entries.remove(&key) {
                            epoll_delete(&self.epoll, &entry.waiter);
                        }
                    }
                }
            }
        }
    }
}

/// Up to [`TURNS_IN_A_ROW`] turns for one QP: more while bytes keep
/// arriving, then a timer "now" so that the others get their turn first.
fn turns(entry: &Entry) -> Next {
    for _ in 0..TURNS_IN_A_ROW {
        match entry
            .qp
            .engine_turn(&entry.waiter, &entry.ring, entry.generation)
        {
            Ok(next) => return next,
            Err(()) => continue,
        }
    }
    Next::Wait(Some(Instant::now()))
}

fn epoll_add(epoll: &OwnedFd, fd: impl AsFd, key: u64) -> io::Result<()> {
    epoll::add(
        epoll,
        fd,
        epoll::EventData::new_u64(key),
        epoll::EventFlags::IN | epoll::EventFlags::RDHUP,
    )?;
    Ok(())
}

fn epoll_delete(epoll: &OwnedFd, fd: impl AsFd) {
    let _ = epoll::delete(epoll, fd);
}
