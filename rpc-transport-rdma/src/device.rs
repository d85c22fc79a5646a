//! Opened devices, shared by every connection of the process that uses them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use crate::config::RdmaConfig;
use crate::pool::{LargePool, LargePoolConfig};
use crate::rendezvous_budget::RendezvousBudget;
pub use crate::verbs::shared::{PoolCaps, SharedPools};
use crate::verbs::{self, Context, ProtectionDomain, VerbsError};

/// One opened device: its context, one protection domain, and the rendezvous pool.
pub struct Device {
    /// `soft` or `ibverbs`.
    pub provider: &'static str,
    /// The device's name.
    pub name: String,
    /// The opened device.
    pub context: Arc<dyn Context>,
    /// Every connection's memory and QPs live here.
    pub pd: Arc<dyn ProtectionDomain>,
    /// Rendezvous buffers.
    pub large: Arc<LargePool>,
    /// The bound on rendezvous memory in use, all connections together
    /// ([`LargePoolConfig::max_in_use_bytes`]).
    pub rendezvous: RendezvousBudget,
    /// Shared receive and send slots, by slot length.
    shared: Mutex<HashMap<usize, Arc<SharedPools>>>,
    /// A timer trims [`Device::large`]'s idle buffers (on the runtime of a
    /// connection; started again by the next connection if that runtime
    /// ended).
    trimming: AtomicBool,
}

/// The longest the pool's trimming timer sleeps.
const MAX_TRIM_PERIOD: Duration = Duration::from_secs(3600);

impl Device {
    /// The shared pools for slots of `slot_len` bytes, created by the first
    /// connection that asks (its `caps` are the caps for all of them, the
    /// receive cap bounded by the device's deepest SRQ).
    pub fn shared_pools(
        &self,
        slot_len: usize,
        caps: PoolCaps,
    ) -> Result<Arc<SharedPools>, VerbsError> {
        let mut shared = self
            .shared
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        if let Some(pools) = shared.get(&slot_len) {
            return Ok(pools.clone());
        }
        let device_caps = self.context.caps();
        if !device_caps.srq {
            return Err(VerbsError::Unsupported(
                "shared receive queues (rdma:// needs a device with SRQ support)",
            ));
        }
        let caps = PoolCaps {
            receive: caps.receive.min(device_caps.max_srq_wr as usize),
            ..caps
        };
        let pools = Arc::new(SharedPools::with_caps(&self.pd, slot_len, caps)?);
        shared.insert(slot_len, pools.clone());
        Ok(pools)
    }
}

/// What a device's connections hold of its shared resources, process-wide:
/// the leak check of a chaos run or a test, all back to 0 (`lost_send_slots`
/// and `leaked_buffers` on a healthy device too) once every connection has
/// closed ([`Device::accounting`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Accounting {
    /// `rdma://` connections alive in this process, on any device.
    pub connections: usize,
    /// Shared receive slots committed to connections (their peers' windows).
    pub committed_receive_slots: usize,
    /// The part of `committed_receive_slots` that windows grew by.
    pub grown_receive_slots: usize,
    /// Shared send slots taken or in flight, lost ones included.
    pub send_slots_out: usize,
    /// Send slots whose SEND never completed where it could be polled.
    pub lost_send_slots: usize,
    /// Rendezvous buffers taken from the pool and not returned (pull
    /// destinations, exposed frames, received frames the application holds).
    pub rendezvous_buffers_out: usize,
    /// Bytes charged to the device's bound on rendezvous memory in use.
    pub rendezvous_bytes_charged: usize,
    /// Registered buffers given up for good, process-wide
    /// ([`verbs::leaked_buffers`]).
    pub leaked_buffers: u64,
}

impl Accounting {
    /// Everything a connection holds is back: nothing alive, committed,
    /// taken, charged, lost or leaked.
    pub fn is_settled(&self) -> bool {
        *self == Accounting::default()
    }

    /// Settled but for send slots given up as lost: SENDs a torn-down QP's
    /// device never completed where the connection could poll them (siw
    /// flushes a destroyed QP late, docs/providers.md). Those stay out for
    /// good and are never reused; everything else is back.
    pub fn is_settled_but_lost_slots(&self) -> bool {
        *self
            == Accounting {
                send_slots_out: self.lost_send_slots,
                lost_send_slots: self.lost_send_slots,
                ..Accounting::default()
            }
    }
}

impl Device {
    /// What this device's connections hold now (see [`Accounting`]).
    pub fn accounting(&self) -> Accounting {
        let shared = self
            .shared
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        let mut accounting = Accounting {
            connections: crate::link::live_links(),
            rendezvous_buffers_out: self.large.buffers_out(),
            rendezvous_bytes_charged: self.rendezvous.in_use(),
            leaked_buffers: verbs::leaked_buffers(),
            ..Accounting::default()
        };
        for pools in shared.values() {
            accounting.committed_receive_slots += pools.receive.committed();
            accounting.grown_receive_slots += pools.receive.grown();
            accounting.send_slots_out += pools.send.out();
            accounting.lost_send_slots += pools.send.lost();
        }
        accounting
    }
}

impl Device {
    /// Starts (if none runs) the timer that gives the rendezvous pool's idle
    /// buffers back ([`LargePool::trim_idle`]) every half
    /// [`LargePoolConfig::trim_idle_after`] (at least a second): a task on
    /// the current tokio runtime, not a thread. Each connection calls it as
    /// it starts.
    pub(crate) fn keep_pool_trimmed(self: &Arc<Self>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.trimming.swap(true, Ordering::AcqRel) {
            return;
        }
        /// Lets the next connection start the timer again once this one's
        /// runtime dropped it.
        struct Trimming(Arc<Device>);
        impl Drop for Trimming {
            fn drop(&mut self) {
                self.0.trimming.store(false, Ordering::Release);
            }
        }
        let trimming = Trimming(self.clone());
        let period = (self.large.config().trim_idle_after / 2)
            .clamp(Duration::from_secs(1), MAX_TRIM_PERIOD);
        runtime.spawn(async move {
            loop {
                tokio::time::sleep(period).await;
                let freed = trimming.0.large.trim_idle(Instant::now());
                if freed > 0 {
                    tracing::debug!(freed, "idle rendezvous buffers deregistered");
                }
            }
        });
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("provider", &self.provider)
            .field("name", &self.name)
            .finish()
    }
}

type DeviceKey = (&'static str, String, LargePoolConfig);

static DEVICES: LazyLock<Mutex<HashMap<DeviceKey, Arc<Device>>>> = LazyLock::new(Default::default);

/// The provider and device `config` selects: its own fields, else
/// `RDMA_PROVIDER`/`RDMA_DEVICE`, else ibverbs when compiled in with a
/// device present, else soft.
pub fn select(config: &RdmaConfig) -> Result<(Arc<dyn verbs::Provider>, String), VerbsError> {
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let provider = match config.provider.clone().or_else(|| env("RDMA_PROVIDER")) {
        Some(name) => verbs::provider(&name)?,
        None => verbs::providers()
            .into_iter()
            .rev() // ibverbs (when compiled in) before soft
            .find(|p| p.devices().is_ok_and(|devices| !devices.is_empty()))
            .ok_or(VerbsError::ProviderUnavailable {
                provider: "soft",
                reason: "no provider has a device".into(),
            })?,
    };
    let device = match config.device.clone().or_else(|| env("RDMA_DEVICE")) {
        Some(device) => device,
        None => provider
            .devices()?
            .into_iter()
            .next()
            .map(|d| d.name)
            .ok_or_else(|| VerbsError::ProviderUnavailable {
                provider: provider.name(),
                reason: "no RDMA device found (set RDMA_DEVICE, or RDMA_PROVIDER=soft)".into(),
            })?,
    };
    Ok((provider, device))
}

/// Checks, without opening anything, that the provider and device `config`
/// (or `RDMA_PROVIDER`/`RDMA_DEVICE`) name exist in this build and on this
/// host: what `register()` runs, so a bad setting fails there and not at
/// the first connection.
pub fn check(config: &RdmaConfig) -> Result<(), VerbsError> {
    let (provider, device) = select(config)?;
    let devices = provider.devices()?;
    if devices.iter().any(|d| d.name == device) {
        return Ok(());
    }
    Err(VerbsError::ProviderUnavailable {
        provider: provider.name(),
        reason: format!(
            "no RDMA device {device:?} (this host has: {})",
            if devices.is_empty() {
                "none".to_owned()
            } else {
                devices
                    .iter()
                    .map(|d| d.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        ),
    })
}

/// Opens (once per process) the device `config` selects.
pub fn open(config: &RdmaConfig) -> Result<Arc<Device>, VerbsError> {
    // The verbs crate knows nothing of rpc-core: it publishes
    // `rdma_registered_bytes` once told that the application records
    // metrics (every connection opens its device through here).
    if rpc_core::metrics::enabled() {
        verbs::enable_metrics();
    }
    let (provider, name) = select(config)?;
    let key = (provider.name(), name.clone(), config.large_pool);
    let mut devices = DEVICES.lock().unwrap_or_else(|poison| poison.into_inner());
    if let Some(device) = devices.get(&key) {
        return Ok(device.clone());
    }
    let context = provider.open(&name)?;
    let pd = context.alloc_pd()?;
    let large = LargePool::new(pd.clone(), config.large_pool)?;
    let device = Arc::new(Device {
        provider: provider.name(),
        name,
        context,
        pd,
        rendezvous: RendezvousBudget::new(config.large_pool.max_in_use_bytes),
        large,
        shared: Mutex::default(),
        trimming: AtomicBool::new(false),
    });
    devices.insert(key, device.clone());
    Ok(device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_lost_send_slots_may_stay_out_of_a_settled_but_lost_account() {
        let lost = Accounting {
            send_slots_out: 3,
            lost_send_slots: 3,
            ..Accounting::default()
        };
        assert!(lost.is_settled_but_lost_slots() && !lost.is_settled());
        assert!(Accounting::default().is_settled_but_lost_slots());
        // A slot out that is not counted lost is still held.
        let held = Accounting {
            send_slots_out: 4,
            ..lost
        };
        assert!(!held.is_settled_but_lost_slots());
        for other in [
            Accounting {
                connections: 1,
                ..lost
            },
            Accounting {
                rendezvous_buffers_out: 1,
                ..lost
            },
            Accounting {
                rendezvous_bytes_charged: 1,
                ..lost
            },
            Accounting {
                committed_receive_slots: 1,
                ..lost
            },
            Accounting {
                leaked_buffers: 1,
                ..lost
            },
        ] {
            assert!(!other.is_settled_but_lost_slots(), "{other:?}");
        }
    }

    fn with(provider: Option<&str>, device: Option<&str>) -> RdmaConfig {
        RdmaConfig {
            provider: provider.map(str::to_owned),
            device: device.map(str::to_owned),
            ..RdmaConfig::default()
        }
    }

    #[test]
    fn register_checks_the_provider_and_device_it_is_given() {
        for name in ["soft", "SOFT", "Soft"] {
            check(&with(Some(name), None)).expect(name);
        }
        check(&with(Some("soft"), Some("soft0"))).expect("soft0");
        let bogus = crate::register_with(with(Some("bogus"), None))
            .unwrap_err()
            .to_string();
        assert!(
            bogus.contains("no provider named \"bogus\" (known: soft, ibverbs)"),
            "{bogus}"
        );
        let missing = crate::register_with(with(Some("soft"), Some("mlx5_0")))
            .unwrap_err()
            .to_string();
        assert!(
            missing.contains("no RDMA device \"mlx5_0\" (this host has: soft0)"),
            "{missing}"
        );
        if cfg!(not(feature = "ibverbs")) {
            let ibverbs = check(&with(Some("IBVERBS"), None)).unwrap_err().to_string();
            assert!(
                ibverbs.contains("enable the feature rpc-transport-rdma/ibverbs"),
                "{ibverbs}"
            );
        }
    }
}
