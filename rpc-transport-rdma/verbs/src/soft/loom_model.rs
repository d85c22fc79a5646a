//! Model-checks the soft wire's lock-free handshakes with `loom`: the very
//! functions the provider runs (`soft::sync`), over loom's atomics,
//! in every interleaving (and every outcome of the memory model) loom
//! explores.
//!
//! - The doorbell: a consumer never sleeps on bytes nobody rings for.
//! - The CQ arm word: an arm fires exactly once, whoever takes it, and a
//!   peer's claimed event is taken exactly once, even across a re-arm.

use std::sync::atomic::Ordering;

use super::sync::{self, ARMED_ANY, CLAIMED, DISARMED, Word32, Word64};
use loom::sync::Arc;
use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize};
use loom::thread;

struct L32(AtomicU32);
struct L64(AtomicU64);

impl Word32 for L32 {
    fn load(&self, order: Ordering) -> u32 {
        self.0.load(order)
    }
    fn store(&self, value: u32, order: Ordering) {
        self.0.store(value, order)
    }
    fn compare_exchange(
        &self,
        current: u32,
        new: u32,
        success: Ordering,
        failure: Ordering,
    ) -> Result<u32, u32> {
        self.0.compare_exchange(current, new, success, failure)
    }
    fn fence(&self) {
        loom::sync::atomic::fence(Ordering::SeqCst);
    }
}

impl Word64 for L64 {
    fn load(&self, order: Ordering) -> u64 {
        self.0.load(order)
    }
    fn store(&self, value: u64, order: Ordering) {
        self.0.store(value, order)
    }
}

#[test]
fn the_doorbell_handshake_loses_no_wake_up() {
    loom::model(|| {
        let head = Arc::new(L64(AtomicU64::new(0)));
        let sleeping = Arc::new(L32(AtomicU32::new(0)));
        let rung = Arc::new(AtomicBool::new(false));
        let producer = {
            let (head, sleeping, rung) = (head.clone(), sleeping.clone(), rung.clone());
            thread::spawn(move || {
                if sync::publish(&*head, &*sleeping, 1, true) {
                    rung.store(true, Ordering::SeqCst);
                }
            })
        };
        // The consumer has read nothing yet (tail 0).
        let sleeps = sync::may_sleep(&*head, &*sleeping, 0);
        producer.join().unwrap();
        // Sleeping is fine only if the producer will ring (or has rung).
        assert!(
            !sleeps || rung.load(Ordering::SeqCst),
            "the consumer sleeps on a published message and nobody rings"
        );
    });
}

#[test]
fn an_armed_cq_fires_exactly_once_whoever_takes_it() {
    loom::model(|| {
        let word = Arc::new(L32(AtomicU32::new(DISARMED)));
        sync::arm(&*word, false);
        let events = Arc::new(AtomicUsize::new(0));
        let claimed = Arc::new(AtomicUsize::new(0));
        // A local completion and a peer's batch race for the arm.
        let local = {
            let (word, events) = (word.clone(), events.clone());
            thread::spawn(move || {
                if sync::fire(&*word, false, DISARMED) {
                    events.fetch_add(1, Ordering::SeqCst);
                }
            })
        };
        let peer = {
            let (word, events, claimed) = (word.clone(), events.clone(), claimed.clone());
            thread::spawn(move || {
                if sync::fire(&*word, true, CLAIMED) {
                    events.fetch_add(1, Ordering::SeqCst);
                    claimed.fetch_add(1, Ordering::SeqCst);
                }
            })
        };
        local.join().unwrap();
        peer.join().unwrap();
        assert_eq!(events.load(Ordering::SeqCst), 1, "one event per arm");
        // get_event takes a claimed event exactly once.
        let taken =
            usize::from(sync::take_claimed(&*word)) + usize::from(sync::take_claimed(&*word));
        assert_eq!(taken, claimed.load(Ordering::SeqCst));
        assert_eq!(word.load(Ordering::SeqCst), DISARMED);
    });
}

#[test]
fn a_claim_survives_a_concurrent_re_arm_and_is_taken_once() {
    loom::model(|| {
        let word = Arc::new(L32(AtomicU32::new(ARMED_ANY)));
        let peer = {
            let word = word.clone();
            thread::spawn(move || sync::fire(&*word, false, CLAIMED))
        };
        // The owner re-arms (as after a poll) while the peer claims.
        sync::arm(&*word, true);
        let claimed = peer.join().unwrap();
        let state = word.load(Ordering::SeqCst);
        if claimed {
            assert_eq!(state, CLAIMED, "a re-arm never erases a claimed event");
            assert!(sync::take_claimed(&*word));
        }
        assert!(!sync::take_claimed(&*word), "taken at most once");
        // Whatever happened, the word is armed or disarmed now, never lost
        // in between: a later completion fires it if it is armed.
        let state = word.load(Ordering::SeqCst);
        assert!(matches!(state, DISARMED | sync::ARMED_SOLICITED), "{state}");
    });
}
