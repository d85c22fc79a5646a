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
