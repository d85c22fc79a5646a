//! Settings of the RDMA transport, with defaults and environment overrides.

use std::time::Duration;

use crate::pool::LargePoolConfig;
use crate::protocol::{
    HEADER_LEN, Limits, MAX_EAGER_THRESHOLD, MAX_EXPOSED, MAX_RECV_SLOTS, MIN_RECV_SLOTS,
};
use crate::verbs::ConnectOptions;
use crate::verbs::shared::PoolCaps;

/// How a connection's driver waits for completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollMode {
    /// Arm the CQ and sleep on its channel whenever there is nothing to do.
    /// Cheapest on CPU; every message then pays a thread wake-up.
    Event,
    /// Keep polling the CQ (yielding to other tasks between polls) for up
    /// to `spin` after the last activity, then arm and sleep. The default: a
    /// round trip that completes within the spin costs no wake-up. Adaptive:
    /// a connection whose waits outlast the spin stops spinning, and nobody
    /// spins while another thread wants the CPU (see `docs/providers.md`
    /// and ARCHITECTURE.md, "Polling policy").
    Adaptive {
        /// The longest a wait is polled before the reader sleeps.
        spin: Duration,
    },
    /// Never sleep: poll the CQ between every other task's turn. Lowest
    /// latency; keeps a core busy for as long as the connection lives.
    BusyPoll,
}

/// Default of [`RdmaConfig::window_growth_bytes`]: 32 MiB.
pub const DEFAULT_WINDOW_GROWTH_BYTES: usize = 32 << 20;
/// Default of [`RdmaConfig::send_pool_bytes`]: 32 MiB.
pub const DEFAULT_SEND_POOL_BYTES: usize = 32 << 20;

/// Default spin of [`PollMode::Adaptive`].
pub const DEFAULT_SPIN: Duration = Duration::from_micros(100);

impl PollMode {
    /// Parses `event`, `busy` or `spin=<µs>` (the form of `RDMA_POLL`).
    pub fn parse(text: &str) -> Option<PollMode> {
        match text {
            "event" => Some(PollMode::Event),
            "busy" | "busy-poll" => Some(PollMode::BusyPoll),
            "adaptive" => Some(PollMode::Adaptive { spin: DEFAULT_SPIN }),
            _ => text
                .strip_prefix("spin=")
                .and_then(|micros| micros.parse().ok())
                .map(|micros| PollMode::Adaptive {
                    spin: Duration::from_micros(micros),
                }),
        }
    }
}

/// Test-only fault injection (eRPC's `fault_inject`): makes this side break
/// the protocol on purpose so tests can prove the peer copes. Only with the
/// cargo feature `fault-injection` (the crate's own tests turn it on); a
/// build without it has no such setting.
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Announce rendezvous frames with a wrong rkey.
    ForgeRkey,
    /// Announce rendezvous frames at an address outside the exposed window.
    ForgeRange,
    /// Announce rendezvous frames as longer than they are, by this many bytes.
    ForgeLength(u64),
    /// Send every BATCH with its first frame's length prefix set to
    /// `u32::MAX` (running past the end of the message).
    ForgeBatch,
}

/// Everything the RDMA transport can be told.
#[derive(Debug, Clone)]
pub struct RdmaConfig {
    /// `soft` or `ibverbs`; `None`: `RDMA_PROVIDER`, else ibverbs when it is
    /// compiled in and has a device, else soft.
    pub provider: Option<String>,
    /// Device name; `None`: `RDMA_DEVICE`, else the provider's first device.
    pub device: Option<String>,
    /// The most receive slots of the device's shared pool one connection's
    /// peer may hold as credits (its window grows to this under load).
    pub recv_slots: u32,
    /// Receive slots committed to a new connection's peer before it may send
    /// (its initial credits; what an idle connection costs).
    pub initial_credits: u32,
    /// Cap of the device's shared receive (and send) pool, in slots; bounded
    /// by the device's deepest SRQ. The first connection of a slot length
    /// sets it for all.
    pub max_shared_slots: usize,
    /// Bytes of the device's shared receive slots that credit windows may
    /// grow by beyond their `initial_credits`, all connections together:
    /// what busy peers share, and all that peers who stop reading can hold
    /// beyond their initial windows.
    pub window_growth_bytes: usize,
    /// Bytes of the device's shared send slots, all connections together
    /// (a connection with no SEND in flight always gets one more): what
    /// peers that never acknowledge our SENDs can hold.
    pub send_pool_bytes: usize,
    /// Frames up to this many bytes are sent eagerly (copied into a slot);
    /// larger ones by rendezvous (pulled with RDMA READ). Slots are this plus
    /// the message header.
    pub eager_threshold: u32,
    /// Protocol knobs: send slots, READ chunking and depth, queue bounds,
    /// rendezvous revocation timeout.
    pub limits: Limits,
    /// Received frames waiting for the application before credits are held back.
    pub inbound_backlog: usize,
    /// How drivers wait.
    pub poll_mode: PollMode,
    /// The rendezvous buffer pool of each device, and the device-wide bound
    /// on rendezvous memory in use (`max_in_use_bytes`, 64 MiB; see
    /// [`crate::rendezvous_budget`]). Part of the device's identity: a
    /// different setting opens a device of its own.
    pub large_pool: LargePoolConfig,
    /// QP reliability settings. Their [`ConnectOptions::retry_budget`] (about
    /// 0.54 s by default on InfiniBand and RoCE) is how long a cut link or a
    /// dead peer is retried before a connection with sends in flight ends
    /// and its calls fail `Unavailable`; a connection that is only waiting
    /// learns of it from the channel's keepalive
    /// (`rpc_core::ChannelBuilder::keepalive`).
    pub connect: ConnectOptions,
    /// The port a listener's rdma_cm listens on, beside its TCP set-up port,
    /// for peers whose device connects only through rdma_cm (iWARP): 0 (the
    /// default) picks a free one and announces it in the hello; a fixed one
    /// (`RDMA_CM_PORT`) is what a firewall between hosts can open. One
    /// listener per port and address.
    pub cm_port: u16,
    /// Test-only (feature `fault-injection`): break the protocol on purpose.
    #[cfg(feature = "fault-injection")]
    pub fault: Option<Fault>,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            provider: None,
            device: None,
            recv_slots: 128,
            initial_credits: 4,
            max_shared_slots: 1 << 16,
            window_growth_bytes: DEFAULT_WINDOW_GROWTH_BYTES,
            send_pool_bytes: DEFAULT_SEND_POOL_BYTES,
            eager_threshold: 8 << 10,
            limits: Limits::default(),
            inbound_backlog: 1024,
            poll_mode: PollMode::Adaptive { spin: DEFAULT_SPIN },
            large_pool: LargePoolConfig::default(),
            connect: ConnectOptions::default(),
            cm_port: 0,
            #[cfg(feature = "fault-injection")]
            fault: None,
        }
    }
}

/// A setting that cannot work. Its `Debug` is its message, so that `main`
/// returning it (boxed) prints the reason, not the struct.
#[derive(Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid RDMA transport setting: {0}")]
pub struct ConfigError(pub String);

impl std::fmt::Debug for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl RdmaConfig {
    /// The defaults with `RDMA_PROVIDER`, `RDMA_DEVICE`, `RDMA_POLL`
    /// (`event` | `busy` | `spin=<µs>`), `RDMA_EAGER_THRESHOLD`,
    /// `RDMA_CM_PORT`, `RDMA_ACK_TIMEOUT_MS` and `RDMA_RETRY_COUNT` (the QPs'
    /// ACK timeout and retries: [`ConnectOptions::retry_budget`]) applied.
    /// (`RDMA_GID_INDEX` is read by the ibverbs provider itself.)
    pub fn from_env() -> Result<RdmaConfig, ConfigError> {
        RdmaConfig::from_vars(|name| std::env::var(name).ok())
    }

    /// [`RdmaConfig::from_env`] over any source of variables.
    fn from_vars(lookup: impl Fn(&str) -> Option<String>) -> Result<RdmaConfig, ConfigError> {
        let mut config = RdmaConfig::default();
        let var = |name: &str| lookup(name).filter(|v| !v.is_empty());
        config.provider = var("RDMA_PROVIDER");
        config.device = var("RDMA_DEVICE");
        if let Some(poll) = var("RDMA_POLL") {
            config.poll_mode = PollMode::parse(&poll).ok_or_else(|| {
                ConfigError(format!(
                    "RDMA_POLL={poll:?}: expected event, busy or spin=<microseconds>"
                ))
            })?;
        }
        if let Some(port) = var("RDMA_CM_PORT") {
            config.cm_port = port.parse().map_err(|_| {
                ConfigError(format!("RDMA_CM_PORT={port:?}: expected a port number"))
            })?;
        }
        if let Some(millis) = var("RDMA_ACK_TIMEOUT_MS") {
            // (A value too large for a Duration is refused, not a panic.)
            config.connect.ack_timeout = millis
                .parse::<f64>()
                .ok()
                .and_then(|m| Duration::try_from_secs_f64(m / 1000.0).ok())
                .ok_or_else(|| {
                    ConfigError(format!(
                        "RDMA_ACK_TIMEOUT_MS={millis:?}: expected milliseconds"
                    ))
                })?;
        }
        if let Some(retries) = var("RDMA_RETRY_COUNT") {
            config.connect.retry_count =
                retries.parse().ok().filter(|r| *r <= 7).ok_or_else(|| {
                    ConfigError(format!("RDMA_RETRY_COUNT={retries:?}: expected 0..=7"))
                })?;
        }
        if let Some(threshold) = var("RDMA_EAGER_THRESHOLD") {
            config.eager_threshold = threshold.parse().map_err(|_| {
                ConfigError(format!(
                    "RDMA_EAGER_THRESHOLD={threshold:?}: expected bytes"
                ))
            })?;
        }
        config.validate()?;
        Ok(config)
    }

    /// Bytes per receive (and send) slot.
    pub fn slot_len(&self) -> usize {
        HEADER_LEN + self.eager_threshold as usize
    }

    /// The shared pools' caps in slots of [`RdmaConfig::slot_len`].
    pub fn pool_caps(&self) -> PoolCaps {
        let slots = |bytes: usize| bytes / self.slot_len();
        PoolCaps {
            receive: self.max_shared_slots,
            growth: slots(self.window_growth_bytes),
            send: slots(self.send_pool_bytes),
        }
    }

    /// Checks the settings against each other.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let fail = |what: &str| Err(ConfigError(what.to_owned()));
        if !(MIN_RECV_SLOTS..=MAX_RECV_SLOTS).contains(&self.recv_slots) {
            return fail(
                "recv_slots must be 3..=65536 (one credit stays in reserve; peers refuse more)",
            );
        }
        if !(MIN_RECV_SLOTS..=self.recv_slots).contains(&self.initial_credits) {
            return fail("initial_credits must be 3..=recv_slots (one credit stays in reserve)");
        }
        if self.max_shared_slots < self.initial_credits as usize {
            return fail("max_shared_slots must hold at least one connection's initial_credits");
        }
        if self.eager_threshold < 64 || self.eager_threshold > MAX_EAGER_THRESHOLD {
            return fail("eager_threshold must be between 64 bytes and 1 MiB");
        }
        if self.limits.send_slots == 0 || self.limits.max_outstanding_reads == 0 {
            return fail("send_slots and max_outstanding_reads must be above 0");
        }
        if self.limits.read_chunk_len == 0 || self.limits.read_chunk_len > 1 << 30 {
            return fail("read_chunk_len must be between 1 byte and 1 GiB");
        }
        if self.limits.max_active_pulls == 0 || self.limits.max_exposed == 0 {
            return fail("max_active_pulls and max_exposed must be above 0");
        }
        if self.large_pool.max_in_use_bytes == 0 {
            return fail("large_pool.max_in_use_bytes must be above 0");
        }
        if self.limits.max_exposed > MAX_EXPOSED {
            return fail("max_exposed must be at most 1024 (peers refuse more unanswered frames)");
        }
        if self.limits.max_pending == 0 {
            return fail("max_pending must be above 0");
        }
        if self.inbound_backlog == 0 {
            return fail("inbound_backlog must be above 0");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_modes_parse() {
        assert_eq!(PollMode::parse("event"), Some(PollMode::Event));
        assert_eq!(PollMode::parse("busy"), Some(PollMode::BusyPoll));
        assert_eq!(
            PollMode::parse("spin=25"),
            Some(PollMode::Adaptive {
                spin: Duration::from_micros(25)
            })
        );
        assert_eq!(PollMode::parse("spin=x"), None);
        assert_eq!(PollMode::parse("fast"), None);
    }

    #[test]
    fn defaults_are_valid_and_bad_settings_are_refused() {
        RdmaConfig::default().validate().unwrap();
        let two_slots = RdmaConfig {
            recv_slots: 2,
            ..RdmaConfig::default()
        };
        assert!(two_slots.validate().unwrap_err().0.contains("3..=65536"));
        let too_many = RdmaConfig {
            recv_slots: 1 << 17,
            ..RdmaConfig::default()
        };
        assert!(too_many.validate().unwrap_err().0.contains("3..=65536"));
        let mut exposed = RdmaConfig::default();
        exposed.limits.max_exposed = 5000;
        assert!(exposed.validate().unwrap_err().0.contains("max_exposed"));
        let tiny = RdmaConfig {
            eager_threshold: 10,
            ..RdmaConfig::default()
        };
        assert!(tiny.validate().is_err());
    }

    #[test]
    fn the_retry_budget_comes_from_the_environment() {
        let from = |pairs: &[(&str, &str)]| {
            let pairs: Vec<(String, String)> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            RdmaConfig::from_vars(move |name| {
                pairs
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.clone())
            })
        };
        let config = from(&[("RDMA_ACK_TIMEOUT_MS", "100"), ("RDMA_RETRY_COUNT", "3")]).unwrap();
        assert_eq!(config.connect.retry_count, 3);
        assert_eq!(config.connect.ack_timeout, Duration::from_millis(100));
        // 4.096 µs × 2^15 per try, four tries.
        assert_eq!(
            config.connect.retry_budget(),
            Duration::from_nanos(4 * (4096 << 15))
        );
        let defaults = from(&[]).unwrap();
        assert_eq!(defaults.connect, ConnectOptions::default());
        let bad = from(&[("RDMA_RETRY_COUNT", "8")]).unwrap_err();
        assert!(bad.0.contains("0..=7"), "{bad}");
        for bad in ["soon", "-1", "NaN", "inf", "1e308"] {
            let refused = from(&[("RDMA_ACK_TIMEOUT_MS", bad)]).unwrap_err();
            assert!(refused.0.contains("milliseconds"), "{bad}: {refused}");
        }
    }
}
