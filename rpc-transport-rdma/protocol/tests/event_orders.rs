//! Issue 34: the protocol under arbitrary orders of events, as a property
//! test in every `cargo test`: two sides wired together
//! ([`two_sides`], shared with the fuzz target `protocol_state`) play ops
//! drawn from bytes — sends of every size, closes, held credits, partial
//! deliveries, READs completing in any order, time passing, windows grown
//! and returned, forged messages — and every invariant of `two_sides` is
//! checked after each op: no slot lost (no message meets an empty receive
//! queue, every frame arrives), no READ after DONE, no credit leak (credits
//! still cycle at the end), every queue within its bound.
//!
//! A failure prints the shrunk bytes; proptest keeps them in
//! `tests/event_orders.proptest-regressions` and replays them first on
//! every later run. More cases: `PROPTEST_CASES=100000`.

mod two_sides;

use arbitrary::Unstructured;
use proptest::prelude::*;
use proptest::strategy::ValueTree;

use two_sides::Reached;

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 1_000,
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::WithSource("proptest-regressions"),
        )),
        ..ProptestConfig::default()
    })]

    /// Everything goes: forged messages, raw bytes, time passing.
    #[test]
    fn any_order_of_events_keeps_every_invariant(
        bytes in proptest::collection::vec(any::<u8>(), 0..6_000)
    ) {
        two_sides::run(&mut Unstructured::new(&bytes), false);
    }

    /// Honest peers, no time passing: every run ends with the end-to-end
    /// checks (each frame delivered, credits still cycling).
    #[test]
    fn any_order_of_honest_events_delivers_everything_and_keeps_credits(
        bytes in proptest::collection::vec(any::<u8>(), 0..6_000)
    ) {
        let reached = two_sides::run(&mut Unstructured::new(&bytes), true);
        prop_assert!(reached != Reached::Ended, "an honest connection ended");
    }
}

/// The honest property is not vacuous: most of its runs get through to the
/// end-to-end checks, most of those with credits cycled afterwards.
#[test]
fn honest_runs_reach_the_end_to_end_checks() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = proptest::collection::vec(any::<u8>(), 100..6_000);
    let mut reached = std::collections::HashMap::<Reached, u32>::new();
    for _ in 0..300 {
        let bytes = strategy.new_tree(&mut runner).unwrap().current();
        *reached
            .entry(two_sides::run(&mut Unstructured::new(&bytes), true))
            .or_default() += 1;
    }
    println!("300 honest runs: {reached:?}");
    let cycled = reached.get(&Reached::CreditsCycled).copied().unwrap_or(0);
    let delivered = cycled + reached.get(&Reached::Delivered).copied().unwrap_or(0);
    assert!(delivered >= 240, "{reached:?}");
    assert!(cycled >= 100, "{reached:?}");
}
