//! Latency histograms and bandwidth figures, as every benchmark reports them.

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

/// `p50 / p99` in µs.
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
