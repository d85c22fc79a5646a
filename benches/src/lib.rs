//! Shared pieces of the benchmark binaries.

pub mod floors;
pub mod stats;
