//! Metrics through the [`metrics`](https://docs.rs/metrics) facade: install
//! any recorder (e.g. `metrics-exporter-prometheus`), call [`enable`], and
//! servers, channels and transports report what they do. Until [`enable`]
//! is called, recording costs one relaxed atomic load per call and nothing
//! is built or allocated.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `rpc_server_calls_total` | counter | `method`, `code` | calls finished by a server, by status code (`Ok`, `NotFound`, …; a call abandoned by its client is `Cancelled`) |
//! | `rpc_server_call_duration_seconds` | histogram | `method` | from the request's arrival to its response |
//! | `rpc_server_calls_in_flight` | gauge | `method` | calls a server is running |
//! | `rpc_server_request_bytes_total`, `rpc_server_response_bytes_total` | counter | `method` | message bytes in and out |
//! | `rpc_client_calls_total` | counter | `method`, `code` | calls finished by a `Channel` |
//! | `rpc_client_call_duration_seconds` | histogram | `method` | from the call to its response or failure |
//! | `rpc_client_calls_in_flight` | gauge | `method` | calls a `Channel` waits for |
//! | `rpc_client_request_bytes_total`, `rpc_client_response_bytes_total` | counter | `method` | message bytes out and in |
//! | `rpc_connections` | gauge | `side` (`server`/`client`), `scheme` | open connections |
//!
//! The rdma:// transport adds its own (`rpc_transport_rdma`'s docs):
//! registered bytes, credit stalls, rendezvous frames in flight.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use ::metrics::{Label, counter, gauge, histogram};

use crate::status::Code;

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Starts recording through the installed `metrics` recorder (and describes
/// every metric to it).
pub fn enable() {
    describe();
    ENABLED.store(true, Ordering::Relaxed);
}

/// Stops recording.
pub fn disable() {
    ENABLED.store(false, Ordering::Relaxed);
}

/// Whether [`enable`] was called (for transports that record their own).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

fn describe() {
    use ::metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    for side in ["server", "client"] {
        describe_counter!(
            format!("rpc_{side}_calls_total"),
            "calls finished, by method and status code"
        );
        describe_histogram!(
            format!("rpc_{side}_call_duration_seconds"),
            Unit::Seconds,
            "call latency, by method"
        );
        describe_gauge!(
            format!("rpc_{side}_calls_in_flight"),
            "calls in progress, by method"
        );
        describe_counter!(
            format!("rpc_{side}_request_bytes_total"),
            Unit::Bytes,
            "request message bytes, by method"
        );
        describe_counter!(
            format!("rpc_{side}_response_bytes_total"),
            Unit::Bytes,
            "response message bytes, by method"
        );
    }
    describe_gauge!("rpc_connections", "open connections, by side and scheme");
}

/// Which end of a call records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Server,
    Client,
}

impl Side {
    fn names(self) -> [&'static str; 5] {
        match self {
            Side::Server => [
                "rpc_server_calls_total",
                "rpc_server_call_duration_seconds",
                "rpc_server_calls_in_flight",
                "rpc_server_request_bytes_total",
                "rpc_server_response_bytes_total",
            ],
            Side::Client => [
                "rpc_client_calls_total",
                "rpc_client_call_duration_seconds",
                "rpc_client_calls_in_flight",
                "rpc_client_request_bytes_total",
                "rpc_client_response_bytes_total",
            ],
        }
    }

    fn label(self) -> &'static str {
        match self {
            Side::Server => "server",
            Side::Client => "client",
        }
    }
}

/// One call being recorded: started with [`CallRecord::start`], ended with
/// [`CallRecord::finish`]; dropped unfinished, it counts as `Cancelled`.
#[derive(Debug)]
pub(crate) struct CallRecord {
    side: Side,
    method: String,
    started: Instant,
    finished: bool,
}

impl CallRecord {
    /// Records a call of `method` with a request of `request_bytes`; `None`
    /// while metrics are off.
    pub(crate) fn start(side: Side, method: &str, request_bytes: usize) -> Option<CallRecord> {
        if !enabled() {
            return None;
        }
        let [_, _, in_flight, request, _] = side.names();
        gauge!(in_flight, "method" => method.to_owned()).increment(1.0);
        counter!(request, "method" => method.to_owned()).increment(request_bytes as u64);
        Some(CallRecord {
            side,
            method: method.to_owned(),
            started: Instant::now(),
            finished: false,
        })
    }

    /// The call ended with `code` and a response of `response_bytes`.
    pub(crate) fn finish(mut self, code: Code, response_bytes: usize) {
        self.record(code, response_bytes);
    }

    fn record(&mut self, code: Code, response_bytes: usize) {
        self.finished = true;
        let [calls, duration, in_flight, _, response] = self.side.names();
        let method = &self.method;
        gauge!(in_flight, "method" => method.clone()).decrement(1.0);
        histogram!(duration, "method" => method.clone())
            .record(self.started.elapsed().as_secs_f64());
        counter!(response, "method" => method.clone()).increment(response_bytes as u64);
        counter!(calls, "method" => method.clone(), "code" => code.to_string()).increment(1);
    }
}

impl Drop for CallRecord {
    fn drop(&mut self) {
        if !self.finished {
            self.record(Code::Cancelled, 0);
        }
    }
}

/// An open connection, counted in `rpc_connections` until dropped.
#[derive(Debug)]
pub(crate) struct ConnectionRecord {
    labels: Vec<Label>,
}

impl ConnectionRecord {
    /// Counts a connection of `side` over `scheme`; `None` while metrics are off.
    pub(crate) fn open(side: Side, scheme: &str) -> Option<ConnectionRecord> {
        if !enabled() {
            return None;
        }
        let labels = vec![
            Label::new("side", side.label()),
            Label::new("scheme", scheme.to_owned()),
        ];
        gauge!("rpc_connections", labels.clone()).increment(1.0);
        Some(ConnectionRecord { labels })
    }
}

impl Drop for ConnectionRecord {
    fn drop(&mut self) {
        gauge!("rpc_connections", self.labels.clone()).decrement(1.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_recorded_until_enabled() {
        disable();
        assert!(CallRecord::start(Side::Server, "/a.B/C", 10).is_none());
        assert!(ConnectionRecord::open(Side::Client, "tcp").is_none());
    }
}
