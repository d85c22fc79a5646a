//! Shared pieces of the benchmark binaries.

pub mod contenders;
pub mod floors;
pub mod plot;
pub mod stats;
pub mod streams;
