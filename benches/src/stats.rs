//! Latency histograms and bandwidth figures.

use std::time::Duration;

use hdrhistogram::Histogram;

/// A latency histogram in nanoseconds (1 ns .. 60 s, 3 significant digits).
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds")
}

/// Records one duration.
pub fn record(histogram: &mut Histogram<u64>, elapsed: Duration) {
    let _ = histogram.record((elapsed.as_nanos() as u64).max(1));
}

/// `p50 / p99` in µs with one decimal.
pub fn p50_p99(histogram: &Histogram<u64>) -> (f64, f64) {
    (
        histogram.value_at_quantile(0.5) as f64 / 1000.0,
        histogram.value_at_quantile(0.99) as f64 / 1000.0,
    )
}

/// GB/s for `bytes` moved in `elapsed`.
pub fn gbps(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64() / 1e9
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
