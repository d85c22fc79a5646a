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
//! - **a CPU is free.** On an oversubscribed machine (more runnable threads
//!   than CPUs, read from `/proc/loadavg` at most every
//!   [`LOAD_CHECK_INTERVAL`]) the CPU a spinner holds is the one its peer or
//!   the application needs: it sleeps at once, as a TCP socket would. One
//!   look is a snapshot (two spinners meeting for an instant count as
//!   three runnable threads), so it takes [`BUSY_LOOKS`] looks in a row over
//!   the CPU count to stop spinning, and [`FREE_LOOKS`] at or under it to
//!   start again (not spinning lowers the count itself).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How often the process looks at the machine's runnable threads.
pub(crate) const LOAD_CHECK_INTERVAL: Duration = Duration::from_millis(2);
/// Looks in a row with more runnable threads than CPUs that stop spinning.
pub(crate) const BUSY_LOOKS: u32 = 2;
/// Looks in a row with no more runnable threads than CPUs that allow it again.
pub(crate) const FREE_LOOKS: u32 = 8;

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

    /// How long to keep polling a wait that began `idle` ago, given whether
    /// the machine has a CPU to spare.
    pub(crate) fn keep_spinning(&self, idle: Duration, cpu_free: bool) -> bool {
        cpu_free && idle < self.budget
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

/// Whether the machine has a CPU to spare for spinning (refreshed at most
/// every [`LOAD_CHECK_INTERVAL`], shared by the whole process).
pub(crate) fn cpu_free(now: Instant) -> bool {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    static CHECKED_AT: AtomicU64 = AtomicU64::new(0);
    static STATE: AtomicU32 = AtomicU32::new(0);
    let epoch = *EPOCH.get_or_init(Instant::now);
    let at = now.saturating_duration_since(epoch).as_micros() as u64 + 1;
    let last = CHECKED_AT.load(Ordering::Relaxed);
    let interval = LOAD_CHECK_INTERVAL.as_micros() as u64;
    if at.saturating_sub(last) >= interval
        && CHECKED_AT
            .compare_exchange(last, at, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        // One caller per interval reads the file and updates the state; the
        // others use its answer.
        if let Some(runnable) = runnable_threads() {
            let state = LoadState::from_bits(STATE.load(Ordering::Relaxed));
            let next = state.look(runnable > online_cpus());
            STATE.store(next.bits(), Ordering::Relaxed);
        }
    }
    !LoadState::from_bits(STATE.load(Ordering::Relaxed)).oversubscribed
}

/// The oversubscription verdict and the looks in a row that disagree with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LoadState {
    oversubscribed: bool,
    against: u32,
}

impl LoadState {
    fn from_bits(bits: u32) -> LoadState {
        LoadState {
            oversubscribed: bits & 1 == 1,
            against: bits >> 1,
        }
    }

    fn bits(self) -> u32 {
        u32::from(self.oversubscribed) | (self.against << 1)
    }

    /// The state after one more look that saw the machine `busy`.
    fn look(self, busy: bool) -> LoadState {
        if busy == self.oversubscribed {
            return LoadState { against: 0, ..self };
        }
        let against = self.against + 1;
        let needed = if self.oversubscribed {
            FREE_LOOKS
        } else {
            BUSY_LOOKS
        };
        if against >= needed {
            LoadState {
                oversubscribed: busy,
                against: 0,
            }
        } else {
            LoadState { against, ..self }
        }
    }
}

/// Threads running or waiting for a CPU, machine-wide: the fourth field of
/// `/proc/loadavg` is `runnable/total` (the reader counts itself).
fn runnable_threads() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    parse_runnable(&text)
}

fn parse_runnable(loadavg: &str) -> Option<usize> {
    let field = loadavg.split_whitespace().nth(3)?;
    field.split_once('/')?.0.parse().ok()
}

fn online_cpus() -> usize {
    static CPUS: OnceLock<usize> = OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, usize::from))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_micros(100);

    #[test]
    fn waits_that_spinning_covers_keep_the_full_spin() {
        let mut policy = SpinPolicy::new(MAX);
        assert!(policy.keep_spinning(Duration::from_micros(99), true));
        assert!(!policy.keep_spinning(MAX, true));
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
        assert!(!policy.keep_spinning(Duration::ZERO, true));
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
    fn no_spinning_without_a_free_cpu() {
        let policy = SpinPolicy::new(MAX);
        assert!(!policy.keep_spinning(Duration::ZERO, false));
    }

    #[test]
    fn a_busy_snapshot_alone_does_not_stop_spinning() {
        let free = LoadState::from_bits(0);
        // One busy look among free ones changes nothing.
        let state = free.look(true).look(false).look(true).look(false);
        assert!(!state.oversubscribed);
        // Two in a row do.
        let busy = free.look(true).look(true);
        assert!(busy.oversubscribed);
        assert_eq!(LoadState::from_bits(busy.bits()), busy);
        // Back only after FREE_LOOKS free looks in a row.
        let mut state = busy;
        for _ in 0..FREE_LOOKS - 1 {
            state = state.look(false);
        }
        assert!(state.oversubscribed);
        assert!(
            state.look(true).look(false).oversubscribed,
            "a busy look resets the count"
        );
        assert!(!state.look(false).oversubscribed);
    }

    #[test]
    fn loadavg_runnable_field() {
        assert_eq!(parse_runnable("1.60 1.30 1.25 3/512 12345\n"), Some(3));
        assert_eq!(parse_runnable("0.00 0.01 0.05 1/80 7"), Some(1));
        assert_eq!(parse_runnable("garbage"), None);
        assert_eq!(parse_runnable("1 2 3 x/5 6"), None);
        // On this machine the file exists and parses.
        if std::path::Path::new("/proc/loadavg").exists() {
            assert!(runnable_threads().is_some_and(|n| n >= 1));
        }
    }
}
