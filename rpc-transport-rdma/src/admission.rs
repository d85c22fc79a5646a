//! Who may start an `rdma://` set-up on a listener, and how many at once.
//!
//! A set-up has two phases, each with its own bound, total and per source
//! address (as a web server's accept queue and per-IP limits):
//!
//! - **waiting for the peer's hello** ([`MAX_PENDING_HELLOS`],
//!   [`MAX_PENDING_HELLOS_PER_SOURCE`], at most [`HELLO_TIMEOUT`]): the
//!   connection holds a TCP socket and a small task, nothing of the device.
//!   A connection beyond either bound is closed at once.
//! - **setting up** ([`MAX_PENDING_SETUPS`],
//!   [`MAX_PENDING_SETUPS_PER_SOURCE`], at most
//!   [`crate::transport::SETUP_TIMEOUT`] in all): after a well-formed hello,
//!   the listener builds a QP and commits receive slots for the peer. A
//!   hello that finds the bounds reached waits for a slot (its set-up's time
//!   runs meanwhile) rather than fail: a burst of honest clients queues.
//!
//! So connections that never say hello cost no QP and are gone within
//! seconds, and one source address can hold at most its share of either
//! phase: clients from other addresses still get through.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// How long an accepted connection may take to send its hello (after the
/// TLS handshake of `rdma+tls://`, which it includes).
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(3);
/// Connections a listener waits on for a hello at once.
pub const MAX_PENDING_HELLOS: usize = 1024;
/// Of those, from one source address.
pub const MAX_PENDING_HELLOS_PER_SOURCE: usize = 256;
/// Set-ups past the hello (each holds a QP, a CQ and its committed receive
/// slots) a listener runs at once.
pub const MAX_PENDING_SETUPS: usize = 128;
/// Of those, for one source address.
pub const MAX_PENDING_SETUPS_PER_SOURCE: usize = 64;

/// Slots of one phase, counted in all and per source address.
#[derive(Debug)]
pub(crate) struct Slots {
    total_limit: usize,
    per_source_limit: usize,
    taken: Mutex<Taken>,
    freed: Notify,
}

#[derive(Debug, Default)]
struct Taken {
    total: usize,
    by_source: HashMap<IpAddr, usize>,
}

impl Slots {
    /// Slots with these bounds.
    pub(crate) fn new(total_limit: usize, per_source_limit: usize) -> Arc<Slots> {
        Arc::new(Slots {
            total_limit,
            per_source_limit,
            taken: Mutex::new(Taken::default()),
            freed: Notify::new(),
        })
    }

    /// The hello-phase slots of a listener.
    pub(crate) fn hellos() -> Arc<Slots> {
        Slots::new(MAX_PENDING_HELLOS, MAX_PENDING_HELLOS_PER_SOURCE)
    }

    /// The set-up-phase slots of a listener.
    pub(crate) fn setups() -> Arc<Slots> {
        Slots::new(MAX_PENDING_SETUPS, MAX_PENDING_SETUPS_PER_SOURCE)
    }

    /// A slot for `source` now, or `None` when a bound is reached.
    pub(crate) fn try_take(self: &Arc<Slots>, source: IpAddr) -> Option<Slot> {
        // An IPv4 peer on a dual-stack listener arrives as `::ffff:a.b.c.d`:
        // it shares its IPv4 address's slots.
        let source = source.to_canonical();
        let mut taken = self.taken.lock().unwrap_or_else(|p| p.into_inner());
        let mine = taken.by_source.get(&source).copied().unwrap_or(0);
        if taken.total >= self.total_limit || mine >= self.per_source_limit {
            return None;
        }
        taken.total += 1;
        *taken.by_source.entry(source).or_default() += 1;
        Some(Slot {
            slots: self.clone(),
            source,
        })
    }

    /// A slot for `source`, waiting until `deadline` for one to be freed.
    pub(crate) async fn take(self: &Arc<Slots>, source: IpAddr, deadline: Instant) -> Option<Slot> {
        loop {
            // Registered before the look: a slot freed after it wakes us.
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if let Some(slot) = self.try_take(source) {
                return Some(slot);
            }
            if tokio::time::timeout_at(deadline, freed).await.is_err() {
                return None;
            }
        }
    }

    /// Slots taken in all.
    pub(crate) fn taken_in_all(&self) -> usize {
        self.taken.lock().unwrap_or_else(|p| p.into_inner()).total
    }

    /// Slots taken in all, and by `source`.
    #[cfg(test)]
    fn taken(&self, source: IpAddr) -> (usize, usize) {
        let taken = self.taken.lock().unwrap();
        (
            taken.total,
            taken.by_source.get(&source).copied().unwrap_or(0),
        )
    }
}

/// File descriptors one connection holds, by provider: the soft provider's
/// QP holds its Unix socket, its rings' and CQ arms' memfds, its completion
/// channel's and its peer's eventfds, and a pidfd; then the set-up socket (9
/// measured, 10 counted). A device's QP holds its completion channel, beside
/// the set-up socket.
pub(crate) fn descriptors_per_connection(provider: &str) -> usize {
    if provider == "soft" { 10 } else { 4 }
}

/// Descriptors kept for everything else the process opens.
pub const DESCRIPTOR_RESERVE: usize = 64;

/// Whether the process can open one more connection's descriptors:
/// `live` connections and `pending` set-ups (this one included) at `per`
/// descriptors each, plus [`DESCRIPTOR_RESERVE`], within the soft
/// `RLIMIT_NOFILE` (`limit`, `None`: unlimited). `Err` says why not.
pub(crate) fn descriptors_allow(
    live: usize,
    pending: usize,
    per: usize,
    limit: Option<u64>,
) -> Result<(), String> {
    let Some(limit) = limit else {
        return Ok(());
    };
    let needed = (live + pending) * per + DESCRIPTOR_RESERVE;
    if needed as u64 > limit {
        return Err(format!(
            "the server is out of file descriptors for another rdma:// connection ({live} open, \
             {pending} being set up, about {per} descriptors each, RLIMIT_NOFILE {limit}); \
             try again later"
        ));
    }
    Ok(())
}

/// One taken slot; given back when dropped.
#[derive(Debug)]
pub(crate) struct Slot {
    slots: Arc<Slots>,
    source: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        {
            let mut taken = self.slots.taken.lock().unwrap_or_else(|p| p.into_inner());
            taken.total -= 1;
            if let Some(mine) = taken.by_source.get_mut(&self.source) {
                *mine -= 1;
                if *mine == 0 {
                    taken.by_source.remove(&self.source);
                }
            }
        }
        self.slots.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn one_source_takes_its_share_and_others_still_get_through() {
        let slots = Slots::new(4, 2);
        let a1 = slots.try_take(ip(1)).unwrap();
        let _a2 = slots.try_take(ip(1)).unwrap();
        assert!(slots.try_take(ip(1)).is_none(), "past its share");
        let _b1 = slots.try_take(ip(2)).unwrap();
        let _c1 = slots.try_take(ip(3)).unwrap();
        assert!(slots.try_take(ip(4)).is_none(), "past the total");
        assert_eq!(slots.taken(ip(1)), (4, 2));
        drop(a1);
        assert_eq!(slots.taken(ip(1)), (3, 1));
        assert!(slots.try_take(ip(4)).is_some(), "a freed slot is anyone's");
    }

    #[test]
    fn descriptors_count_live_and_pending_connections_and_a_reserve() {
        assert!(descriptors_allow(5, 1, 10, None).is_ok(), "no limit");
        assert!(descriptors_allow(93, 1, 10, Some(1024)).is_ok());
        let refused = descriptors_allow(96, 1, 10, Some(1024)).unwrap_err();
        assert!(refused.contains("out of file descriptors"), "{refused}");
        assert!(refused.contains("RLIMIT_NOFILE 1024"), "{refused}");
    }

    #[test]
    fn an_ipv4_mapped_source_shares_its_ipv4_addresses_slots() {
        let slots = Slots::new(4, 1);
        let _held = slots.try_take(ip(1)).unwrap();
        let mapped = IpAddr::from(std::net::Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped());
        assert!(slots.try_take(mapped).is_none(), "the same source");
        assert_eq!(slots.taken(ip(1)), (1, 1));
    }

    #[tokio::test]
    async fn a_waiter_gets_the_next_freed_slot_or_gives_up_at_its_deadline() {
        let slots = Slots::new(1, 1);
        let held = slots.try_take(ip(1)).unwrap();
        let soon = Instant::now() + Duration::from_millis(50);
        assert!(
            slots.take(ip(2), soon).await.is_none(),
            "none freed in time"
        );
        let waiter = tokio::spawn({
            let slots = slots.clone();
            async move {
                slots
                    .take(ip(2), Instant::now() + Duration::from_secs(5))
                    .await
                    .map(|slot| slot.source)
            }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(held);
        assert_eq!(waiter.await.unwrap(), Some(ip(2)));
        assert_eq!(slots.taken(ip(2)), (0, 0), "the waiter's slot went with it");
    }
}
