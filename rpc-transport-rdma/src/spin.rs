//! When a driver with nothing to do keeps polling, and when it arms its
//! completion queue and sleeps: [`SpinPolicy`].
//!
//! Spinning answers a small call in a few microseconds instead of the
//! 30–40 µs of a cross-core wake-up, but it costs a CPU for as long as it
//! lasts. It pays only while two things hold:
//!
//! - **work comes soon.** Each connection learns it from its own waits: a
//!   wait that ended within the maximum spin would have been caught by
//!   spinning, so the next wait spins that long; a wait spun through in vain
//!   halves the next one. A connection with sporadic traffic soon stops
//!   spinning; one in a conversation spins its replies in.
//! - **its CPU is not wanted elsewhere.** A spinner that has waited
//!   [`YIELD_CPU_AFTER`] gives its CPU away between polls (`sched_yield`).
//!   If that let another thread run for [`CONTENDED_YIELD`] or longer, the
//!   machine has more runnable threads than CPUs: the CPU the spinner holds
//!   is the one its peer or the application needs. It arms and sleeps at
//!   once, as a TCP socket would, and every connection of the process stops
//!   spinning for [`CONTENDED_BACKOFF`]. On an idle machine `sched_yield`
//!   finds nobody to run (or a thread that runs a few microseconds, such as
//!   the soft provider's engine checking in) and costs next to nothing; a
//!   fast answer (within `YIELD_CPU_AFTER`) never pays even that.
//! - **the machine has a CPU to spare.** Before any of that, a wait does not
//!   spin at all while the machine has more runnable threads than this
//!   process may use CPUs (the running count of `/proc/loadavg`, read at
//!   most every [`RUN_QUEUE_CHECK`] per process): a spinner would take the
//!   CPU its peer or the application is queued for, so it arms and sleeps
//!   as a TCP socket would. Inside a container that shows the host's count,
//!   this errs towards not spinning.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How long a spinning driver polls before it also yields its CPU to the
/// operating system between polls (small calls complete well within it).
pub(crate) const YIELD_CPU_AFTER: Duration = Duration::from_micros(20);

/// A `sched_yield` that kept the spinner off its CPU this long gave it to a
/// thread that wants it. Measured under one busy process: thresholds of
/// 150 and 400 µs missed most of the contention (wake-up preemption hands
/// the CPU back within a few hundred µs) and p99.9 rose to 4 ms; the soft
/// engine's check-in, which must not count, takes a few µs.
pub(crate) const CONTENDED_YIELD: Duration = Duration::from_micros(50);

/// How long the process stops spinning once a spinner found its CPU wanted.
pub(crate) const CONTENDED_BACKOFF: Duration = Duration::from_millis(5);

/// How often a process looks at the machine's run queue (see the module docs).
pub(crate) const RUN_QUEUE_CHECK: Duration = Duration::from_millis(1);

/// One connection's spin budget.
#[derive(Debug, Clone)]
pub(crate) struct SpinPolicy {
    max: Duration,
    budget: Duration,
}

impl SpinPolicy {
    /// A policy that spins at most `max` per wait.
    pub(crate) fn new(max: Duration) -> SpinPolicy {
        SpinPolicy { max, budget: max }
    }

    /// Whether a wait that began `idle` ago keeps polling. Past
    /// [`YIELD_CPU_AFTER`] this yields the CPU once and returns false (for
    /// this wait, and for the whole process a while) if another thread
    /// wanted it.
    pub(crate) fn keep_spinning(&self, idle: Duration, now: Instant) -> bool {
        if idle >= self.budget || !cpu_free(now) || oversubscribed(now) {
            return false;
        }
        if idle < YIELD_CPU_AFTER {
            return true;
        }
        // A wait this long is rarely a small call's answer: let a thread
        // that shares this CPU run - often the peer we wait for.
        if yield_cpu() >= CONTENDED_YIELD {
            cpu_contended(now);
            return false;
        }
        true
    }

    /// Whether a wait that began `idle` ago keeps polling in place (a
    /// multi-thread worker's short spin, bounded by its caller): the budget
    /// and the machine allow it. It never yields the CPU: a few tens of
    /// microseconds are less than a scheduler slice, and a yield would let
    /// the threads our own sleeps woke look like contention.
    pub(crate) fn may_spin_in_place(&self, idle: Duration, now: Instant) -> bool {
        idle < self.budget && cpu_free(now) && !crowded(now)
    }

    /// The wait ended after `waited` (spinning, then maybe sleeping): a
    /// wait the maximum spin would have covered earns the next wait that
    /// much spin; a longer one halves it. A sleeper's wake-up takes tens of
    /// microseconds itself, so a wait up to half the maximum longer still
    /// counts as covered.
    pub(crate) fn waited(&mut self, waited: Duration) {
        if waited <= self.max + self.max / 2 {
            self.budget = self.max;
        } else {
            self.budget /= 2;
            if self.budget < Duration::from_micros(1) {
                self.budget = Duration::ZERO;
            }
        }
    }

    /// The current budget (for tests).
    #[cfg(test)]
    fn budget(&self) -> Duration {
        self.budget
    }
}

/// Gives the CPU to another runnable thread, if any; how long that took.
fn yield_cpu() -> Duration {
    let started = Instant::now();
    std::thread::yield_now();
    started.elapsed()
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn micros_since_epoch(now: Instant) -> u64 {
    now.saturating_duration_since(epoch()).as_micros() as u64
}

/// When spinning is allowed again after a spinner found its CPU wanted.
struct SpinBackoff {
    /// Microseconds since [`epoch`] before which nobody spins.
    no_spin_until: AtomicU64,
}

impl SpinBackoff {
    const fn new() -> SpinBackoff {
        SpinBackoff {
            no_spin_until: AtomicU64::new(0),
        }
    }

    fn allows(&self, now: Instant) -> bool {
        micros_since_epoch(now) >= self.no_spin_until.load(Ordering::Relaxed)
    }

    fn contended(&self, now: Instant) {
        let until = micros_since_epoch(now) + CONTENDED_BACKOFF.as_micros() as u64;
        self.no_spin_until.fetch_max(until, Ordering::Relaxed);
    }
}

/// The process's backoff: every connection's driver shares it.
static BACKOFF: SpinBackoff = SpinBackoff::new();

/// Whether spinning is allowed now (no spinner of the process found its CPU
/// wanted within the last [`CONTENDED_BACKOFF`]).
pub(crate) fn cpu_free(now: Instant) -> bool {
    BACKOFF.allows(now)
}

/// A spinner found its CPU wanted: nobody in the process spins for a while.
fn cpu_contended(now: Instant) {
    BACKOFF.contended(now);
}

/// The number of runnable threads in `/proc/loadavg` ("0.50 0.40 0.30 3/245 1234": 3).
fn running_from_loadavg(text: &str) -> Option<usize> {
    let field = text.split_ascii_whitespace().nth(3)?;
    field.split_once('/')?.0.parse().ok()
}

/// Runnable threads on the machine now, if the kernel says (Linux).
fn running_threads() -> Option<usize> {
    use std::os::unix::fs::FileExt;
    static LOADAVG: OnceLock<Option<std::fs::File>> = OnceLock::new();
    let file = LOADAVG
        .get_or_init(|| std::fs::File::open("/proc/loadavg").ok())
        .as_ref()?;
    let mut buffer = [0u8; 128];
    let len = file.read_at(&mut buffer, 0).ok()?;
    running_from_loadavg(std::str::from_utf8(&buffer[..len]).ok()?)
}

/// CPUs this process may run on.
fn usable_cpus() -> usize {
    static CPUS: OnceLock<usize> = OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, usize::from))
}

/// The machine's run queue, as last looked at: when (µs since [`epoch`]),
/// and how many threads were runnable (`usize::MAX` before the first look,
/// 0 where the kernel does not say).
static RUN_QUEUE_CHECKED: AtomicU64 = AtomicU64::new(0);
static RUNNING: AtomicUsize = AtomicUsize::new(0);

/// Runnable threads on the machine, looked up at most every
/// [`RUN_QUEUE_CHECK`] (one thread of the process reads; the others use its
/// answer). 0 where the kernel does not say.
fn running_now(now: Instant) -> usize {
    let at = micros_since_epoch(now).max(1);
    let checked = RUN_QUEUE_CHECKED.load(Ordering::Relaxed);
    if at.saturating_sub(checked) >= RUN_QUEUE_CHECK.as_micros() as u64
        && RUN_QUEUE_CHECKED
            .compare_exchange(checked, at, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        let running = running_threads().unwrap_or(0);
        RUNNING.store(running, Ordering::Relaxed);
        return running;
    }
    RUNNING.load(Ordering::Relaxed)
}

/// Whether more threads want to run than this process has CPUs (see
/// [`running_now`]). False where the kernel does not say.
pub(crate) fn oversubscribed(now: Instant) -> bool {
    running_now(now) > usable_cpus()
}

/// Like [`oversubscribed`], with one thread of slack: what an in-place
/// spinner uses. Two processes in a conversation each spin one thread; a
/// wake-up (a runtime worker woken by its I/O driver, the soft engine
/// checking in) adds one for a few microseconds, and counting it stopped
/// both spinners, whose sleeps then woke more threads.
fn crowded(now: Instant) -> bool {
    running_now(now) > usable_cpus() + 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    const MAX: Duration = Duration::from_micros(100);

    #[test]
    fn waits_that_spinning_covers_keep_the_full_spin() {
        let mut policy = SpinPolicy::new(MAX);
        let now = Instant::now();
        assert!(cpu_free(now) || !policy.keep_spinning(Duration::from_micros(5), now));
        // (Unless the machine is busier than its CPUs: tests run beside others.)
        let crowded = oversubscribed(now);
        assert!(!cpu_free(now) || crowded || policy.keep_spinning(Duration::from_micros(5), now));
        assert!(!policy.keep_spinning(MAX, now));
        policy.waited(Duration::from_micros(7));
        assert_eq!(policy.budget(), MAX);
    }

    #[test]
    fn long_waits_stop_the_spinning_and_a_short_one_brings_it_back() {
        let mut policy = SpinPolicy::new(MAX);
        for _ in 0..8 {
            policy.waited(Duration::from_millis(3));
        }
        assert_eq!(policy.budget(), Duration::ZERO);
        assert!(!policy.keep_spinning(Duration::ZERO, Instant::now()));
        // A reply that came within the maximum spin: spin again.
        policy.waited(Duration::from_micros(40));
        assert_eq!(policy.budget(), MAX);
        // So does one that a sleeper's wake-up made look a little longer.
        policy.waited(Duration::ZERO);
        policy.waited(Duration::from_micros(140));
        assert_eq!(policy.budget(), MAX);
        // One long wait halves it.
        policy.waited(Duration::from_millis(1));
        assert_eq!(policy.budget(), MAX / 2);
    }

    #[test]
    fn a_wanted_cpu_stops_spinning_for_the_backoff() {
        let backoff = SpinBackoff::new();
        let now = epoch() + Duration::from_secs(1);
        assert!(backoff.allows(now));
        backoff.contended(now);
        assert!(!backoff.allows(now));
        assert!(!backoff.allows(now + CONTENDED_BACKOFF - Duration::from_micros(10)));
        assert!(backoff.allows(now + CONTENDED_BACKOFF));
    }

    #[test]
    fn yielding_to_a_busy_thread_on_the_same_cpu_takes_long() {
        // Pin this thread and a busy one to one CPU: a yield lets the busy
        // one run for a scheduler slice, far longer than CONTENDED_YIELD.
        #[cfg(target_os = "linux")]
        {
            let cpu = rustix::thread::sched_getcpu();
            let pin = move || {
                let mut set = rustix::thread::CpuSet::new();
                set.set(cpu);
                let _ = rustix::thread::sched_setaffinity(None, &set);
            };
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let busy = {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    pin();
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            };
            pin();
            std::thread::sleep(Duration::from_millis(20));
            let longest = (0..10).map(|_| yield_cpu()).max().unwrap();
            stop.store(true, Ordering::Relaxed);
            busy.join().unwrap();
            assert!(longest >= CONTENDED_YIELD, "{longest:?}");
        }
    }

    #[test]
    fn the_running_count_is_read_from_loadavg() {
        assert_eq!(running_from_loadavg("2.39 2.22 1.96 3/98 29721\n"), Some(3));
        assert_eq!(running_from_loadavg("0.00 0.00 0.00 12/1045 1"), Some(12));
        assert_eq!(running_from_loadavg("0.00 0.00 0.00"), None);
        assert_eq!(running_from_loadavg("0.00 0.00 0.00 x/1 1"), None);
        #[cfg(target_os = "linux")]
        assert!(running_threads().is_some_and(|running| running >= 1));
    }

    #[test]
    fn more_busy_threads_than_cpus_stop_the_spinning() {
        #[cfg(target_os = "linux")]
        {
            let stop = std::sync::Arc::new(AtomicBool::new(false));
            let busy: Vec<_> = (0..usable_cpus() + 2)
                .map(|_| {
                    let stop = stop.clone();
                    std::thread::spawn(move || {
                        while !stop.load(Ordering::Relaxed) {
                            std::hint::spin_loop();
                        }
                    })
                })
                .collect();
            // The busy threads are runnable for the whole second: the run
            // queue looked at every RUN_QUEUE_CHECK shows more of them than
            // CPUs, and a policy with a full budget then does not spin.
            let policy = SpinPolicy::new(MAX);
            let deadline = Instant::now() + Duration::from_secs(1);
            let mut seen = false;
            while Instant::now() < deadline && !seen {
                std::thread::sleep(RUN_QUEUE_CHECK);
                let now = Instant::now();
                seen = oversubscribed(now) && !policy.keep_spinning(Duration::ZERO, now);
            }
            stop.store(true, Ordering::Relaxed);
            for thread in busy {
                thread.join().unwrap();
            }
            assert!(seen, "the run queue never showed more threads than CPUs");
        }
    }
}
