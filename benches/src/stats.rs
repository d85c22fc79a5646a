//! Latency histograms and bandwidth figures (the common ones are
//! `rdma-rpc-floors`'s, shared with rdma-verbs's `verbs_pingpong`), page
//! faults, CPU time and `/proc` figures.

pub use rdma_rpc_floors::stats::{gbps, histogram, p50_p99, record};

/// CPU time this process has used so far (all threads).
pub fn process_cpu_time() -> std::time::Duration {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    std::time::Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

/// This process's minor page faults so far (field 10 of `/proc/self/stat`;
/// 0 where it cannot be read).
pub fn minor_faults() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    stat.rsplit(')')
        .next()
        .and_then(|fields| fields.split_whitespace().nth(7))
        .and_then(|value| value.parse().ok())
        .unwrap_or(0)
}

/// A numeric field of `/proc/<pid>/status` (`pid` may be `self`), e.g.
/// `VmRSS:` (KiB) or `Threads:`; 0 when absent.
pub fn proc_status_field(pid: &str, name: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix(name))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|value| value.parse().ok())
        .unwrap_or(0)
}

/// What a process has spent so far, all its threads together: the
/// counters behind the per-call cost rows of `compare`. A server process
/// of the comparison reports its own over its stdin and stdout
/// ([`answer_counter_requests`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessCounters {
    /// User + system CPU time (`CLOCK_PROCESS_CPUTIME_ID`, threads that
    /// ended included).
    pub cpu: std::time::Duration,
    /// Voluntary context switches (blocking waits), summed over the live
    /// threads' `/proc/self/task/<tid>/status`.
    pub voluntary_switches: u64,
    /// Heap allocations (`alloc`, `alloc_zeroed` and `realloc` calls)
    /// counted by `stats_alloc`'s `INSTRUMENTED_SYSTEM`; `None` where the
    /// binary has not installed it as its global allocator (only `compare`
    /// does).
    pub allocations: Option<u64>,
}

/// The line a process sends on a server's stdin to ask for its counters;
/// the answer is `STATS <cpu ns> <voluntary switches> <allocations or ->`.
pub const COUNTERS_REQUEST: &str = "STATS";

impl ProcessCounters {
    /// This process's counters now.
    pub fn now() -> ProcessCounters {
        ProcessCounters {
            cpu: process_cpu_time(),
            voluntary_switches: voluntary_switches(),
            allocations: allocations(),
        }
    }

    /// What was spent from `earlier` to `self` (0 for a counter that went
    /// back: a thread that ended takes its context switches with it).
    pub fn since(self, earlier: ProcessCounters) -> ProcessCounters {
        ProcessCounters {
            cpu: self.cpu.saturating_sub(earlier.cpu),
            voluntary_switches: self
                .voluntary_switches
                .saturating_sub(earlier.voluntary_switches),
            allocations: self
                .allocations
                .zip(earlier.allocations)
                .map(|(now, then)| now.saturating_sub(then)),
        }
    }

    /// Both processes' spending together (allocations only where both
    /// counted them).
    pub fn plus(self, other: ProcessCounters) -> ProcessCounters {
        ProcessCounters {
            cpu: self.cpu + other.cpu,
            voluntary_switches: self.voluntary_switches + other.voluntary_switches,
            allocations: self.allocations.zip(other.allocations).map(|(a, b)| a + b),
        }
    }

    /// The answer to a [`COUNTERS_REQUEST`].
    pub fn to_line(self) -> String {
        let allocations = self
            .allocations
            .map_or_else(|| "-".to_owned(), |a| a.to_string());
        format!(
            "{COUNTERS_REQUEST} {} {} {allocations}",
            self.cpu.as_nanos(),
            self.voluntary_switches
        )
    }

    /// Reads an answer written by [`to_line`](Self::to_line).
    pub fn from_line(line: &str) -> Option<ProcessCounters> {
        let mut fields = line
            .strip_prefix(COUNTERS_REQUEST)?
            .strip_prefix(' ')?
            .split(' ');
        let cpu = std::time::Duration::from_nanos(fields.next()?.parse().ok()?);
        let voluntary_switches = fields.next()?.parse().ok()?;
        let allocations = match fields.next()? {
            "-" => None,
            count => Some(count.parse().ok()?),
        };
        Some(ProcessCounters {
            cpu,
            voluntary_switches,
            allocations,
        })
    }
}

/// Voluntary context switches of this process's live threads, summed
/// (`/proc/self/status` alone has the main thread's only).
fn voluntary_switches() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(Result::ok)
        .map(|task| {
            let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
            status
                .lines()
                .find_map(|line| line.strip_prefix("voluntary_ctxt_switches:"))
                .and_then(|value| value.trim().parse().ok())
                .unwrap_or(0)
        })
        .sum()
}

/// Heap allocations so far, as `stats_alloc`'s `INSTRUMENTED_SYSTEM`
/// counts them; `None` where it is not the global allocator (it has then
/// counted nothing, while any process that got this far has allocated).
fn allocations() -> Option<u64> {
    let stats = stats_alloc::INSTRUMENTED_SYSTEM.stats();
    let count = (stats.allocations + stats.reallocations) as u64;
    (count > 0).then_some(count)
}

/// Set by the process that starts a server (and holds its stdin): when
/// that stdin ends, the server exits. The starter ending any way at all (a
/// signal included) ends its server, instead of leaving it running and
/// serving the next run's measurements by mistake.
pub const EXIT_WITH_STDIN: &str = "BENCH_EXIT_WITH_STDIN";

/// Answers every [`COUNTERS_REQUEST`] line on stdin with this process's
/// [`ProcessCounters`] on a line of stdout, from a thread of its own, until
/// stdin ends (what a server process of the comparison runs beside its
/// runtime); then, under [`EXIT_WITH_STDIN`], ends the process.
pub fn answer_counter_requests() {
    std::thread::Builder::new()
        .name("counters".into())
        .spawn(|| {
            use std::io::BufRead;
            let mut line = String::new();
            let mut stdin = std::io::stdin().lock();
            while matches!(stdin.read_line(&mut line), Ok(n) if n > 0) {
                if line.trim_end() == COUNTERS_REQUEST {
                    println!("{}", ProcessCounters::now().to_line());
                }
                line.clear();
            }
            if std::env::var_os(EXIT_WITH_STDIN).is_some() {
                std::process::exit(0);
            }
        })
        .expect("counters thread");
}
