//! A seeded fault injector for the soft provider (issue 34; eRPC's testing
//! builds have one): with cargo feature `fault-injection`, a [`FaultPlan`]
//! makes the device fail on purpose at chosen rates, the way real RC
//! hardware fails, so the failure paths above it run on schedule rather
//! than by luck.
//!
//! The plan is local: it comes from the process's own environment
//! (`RDMA_SOFT_FAULTS`) or from `SoftProvider::open_with_faults`, never
//! from a peer. Without the feature no plan can be set: the hooks ask a
//! stream with no plan (one branch), and a set `RDMA_SOFT_FAULTS` makes the
//! device refuse to open rather than be ignored.
//!
//! **Determinism.** Every decision is a hash of the seed, the QP's number
//! (QPs are numbered in creation order per device context), the fault's kind
//! and how many times that QP has asked about that kind: the same seed and
//! the same program give the same fault schedule per QP, so a failing run
//! can be replayed (and shrunk by lowering rates or disabling kinds).
//! Registrations draw from one stream per device context.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// What the injector can make go wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// An acknowledged send completes with an error status instead
    /// (RETRY_EXC_ERR, REM_ACCESS_ERR, REM_OP_ERR or RNR_RETRY_EXC_ERR, as
    /// when an ACK is lost and the retries run out): the QP enters ERROR,
    /// what is behind it flushes, the peer sees the connection close. The
    /// responder had already executed the request, as on a real fabric.
    ErrorCompletion,
    /// The QP enters ERROR when an answer arrives, before completing
    /// anything: every outstanding send and posted receive flushes
    /// (WR_FLUSH_ERR), the peer sees the connection close (as when the
    /// peer's host dies).
    QpError,
    /// An arriving SEND finds no receive posted (the receive is left in
    /// place): the responder answers RNR NAK and the sender retries after
    /// its RNR timer, up to its `rnr_retry` count.
    RnrDrop,
    /// A memory registration or window bind fails with ENOMEM.
    Registration,
    /// A message read from the wire (a request to execute, or the answer
    /// that completes one of ours) is held for 1–20 ms, drawn from the same
    /// stream, and nothing behind it is read meanwhile: a completion comes
    /// late, and to the peer this side's doorbell looks stalled (its
    /// requests wait unexecuted, their answers late). Order is kept.
    Delay,
}

impl FaultKind {
    /// Every kind, in the order of [`FaultCounts`].
    pub const ALL: [FaultKind; KINDS] = [
        FaultKind::ErrorCompletion,
        FaultKind::QpError,
        FaultKind::RnrDrop,
        FaultKind::Registration,
        FaultKind::Delay,
    ];

    /// The name used in `RDMA_SOFT_FAULTS` and in tables.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::ErrorCompletion => "error_completion",
            FaultKind::QpError => "qp_error",
            FaultKind::RnrDrop => "rnr_drop",
            FaultKind::Registration => "registration",
            FaultKind::Delay => "delay",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Faults injected so far in this process, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultCounts {
    /// Indexed as [`FaultKind::ALL`].
    pub by_kind: [u64; KINDS],
}

impl FaultCounts {
    /// How many of `kind`.
    pub fn of(&self, kind: FaultKind) -> u64 {
        self.by_kind[kind.index()]
    }

    /// All kinds together.
    pub fn total(&self) -> u64 {
        self.by_kind.iter().sum()
    }
}

/// How many kinds of fault there are.
const KINDS: usize = 5;

static INJECTED: [AtomicU64; KINDS] = [const { AtomicU64::new(0) }; KINDS];

/// Faults the soft provider has injected in this process so far.
pub fn injected_faults() -> FaultCounts {
    let mut counts = FaultCounts::default();
    for (count, injected) in counts.by_kind.iter_mut().zip(&INJECTED) {
        *count = injected.load(Ordering::Relaxed);
    }
    counts
}

static PAUSED: AtomicBool = AtomicBool::new(false);

/// Stops (`true`) or resumes injecting faults in this process, whatever the
/// plans say: a chaos run stops the faults to check that everything
/// recovers. Occasions while paused are not counted (the schedule after a
/// pause is still the seed's, shifted).
pub fn pause_injection(paused: bool) {
    PAUSED.store(paused, Ordering::Relaxed);
}

/// The environment variable a device reads its plan from when it opens.
pub const FAULTS_ENV: &str = "RDMA_SOFT_FAULTS";

/// A seed and a rate (0 to 1, per occasion) for each kind of fault.
///
/// Its text form, as `RDMA_SOFT_FAULTS` takes it: `seed=N` and any of
/// `error_completion=R`, `qp_error=R`, `rnr_drop=R`, `registration=R`, `delay=R`,
/// comma-separated (`seed=7,error_completion=0.001,rnr_drop=0.05`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultPlan {
    /// Where every decision starts.
    pub seed: u64,
    /// Per acknowledged send: [`FaultKind::ErrorCompletion`].
    pub error_completion: f64,
    /// Per acknowledged send: [`FaultKind::QpError`].
    pub qp_error: f64,
    /// Per arriving SEND that would take a receive: [`FaultKind::RnrDrop`].
    pub rnr_drop: f64,
    /// Per registration or window bind: [`FaultKind::Registration`].
    pub registration: f64,
    /// Per message read from the wire: [`FaultKind::Delay`].
    pub delay: f64,
}

impl FaultPlan {
    /// A plan with this seed and no faults (set the rates you want).
    pub fn new(seed: u64) -> FaultPlan {
        FaultPlan {
            seed,
            error_completion: 0.0,
            qp_error: 0.0,
            rnr_drop: 0.0,
            registration: 0.0,
            delay: 0.0,
        }
    }

    /// The rate of `kind`.
    pub fn rate(&self, kind: FaultKind) -> f64 {
        match kind {
            FaultKind::ErrorCompletion => self.error_completion,
            FaultKind::QpError => self.qp_error,
            FaultKind::RnrDrop => self.rnr_drop,
            FaultKind::Registration => self.registration,
            FaultKind::Delay => self.delay,
        }
    }

    fn rate_mut(&mut self, kind: FaultKind) -> &mut f64 {
        match kind {
            FaultKind::ErrorCompletion => &mut self.error_completion,
            FaultKind::QpError => &mut self.qp_error,
            FaultKind::RnrDrop => &mut self.rnr_drop,
            FaultKind::Registration => &mut self.registration,
            FaultKind::Delay => &mut self.delay,
        }
    }

    /// Parses the text form (see the type's docs); `seed` is required.
    pub fn parse(text: &str) -> Result<FaultPlan, String> {
        let mut seed = None;
        let mut plan = FaultPlan::new(0);
        for item in text
            .split(',')
            .map(str::trim)
            .filter(|item| !item.is_empty())
        {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| format!("{item:?} is not key=value"))?;
            if key == "seed" {
                seed = Some(
                    value
                        .parse::<u64>()
                        .map_err(|_| format!("seed {value:?} is not an unsigned integer"))?,
                );
                continue;
            }
            let kind = FaultKind::ALL
                .into_iter()
                .find(|kind| kind.name() == key)
                .ok_or_else(|| {
                    format!(
                        "unknown fault {key:?} (known: seed, {})",
                        FaultKind::ALL.map(FaultKind::name).join(", ")
                    )
                })?;
            let rate = value
                .parse::<f64>()
                .ok()
                .filter(|rate| (0.0..=1.0).contains(rate))
                .ok_or_else(|| format!("{key}={value:?}: a rate is a number from 0 to 1"))?;
            *plan.rate_mut(kind) = rate;
        }
        plan.seed = seed.ok_or("a fault plan needs seed=N (to replay it)")?;
        Ok(plan)
    }
}

impl std::fmt::Display for FaultPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "seed={}", self.seed)?;
        for kind in FaultKind::ALL {
            if self.rate(kind) > 0.0 {
                write!(f, ",{}={}", kind.name(), self.rate(kind))?;
            }
        }
        Ok(())
    }
}

/// A plan set in code for the whole process ([`set_process_plan`]).
static PROCESS_PLAN: std::sync::Mutex<Option<FaultPlan>> = std::sync::Mutex::new(None);

/// Sets (or clears) the plan every soft device of this process opens with
/// from now on, in place of `RDMA_SOFT_FAULTS`: for a program or test that
/// opens its device through layers it does not control (an `rdma://`
/// transport) and would rather not change its own environment. Devices
/// already open keep their plan.
pub fn set_process_plan(plan: Option<FaultPlan>) {
    *PROCESS_PLAN
        .lock()
        .unwrap_or_else(|poison| poison.into_inner()) = plan;
}

/// The plan of a device context, if any: [`set_process_plan`]'s, else
/// `RDMA_SOFT_FAULTS`'s.
pub(crate) fn plan_from_env() -> Result<Option<FaultPlan>, String> {
    let set = *PROCESS_PLAN
        .lock()
        .unwrap_or_else(|poison| poison.into_inner());
    if set.is_some() {
        return Ok(set);
    }
    let Ok(text) = std::env::var(FAULTS_ENV) else {
        return Ok(None);
    };
    if !cfg!(feature = "fault-injection") {
        return Err(format!(
            "{FAULTS_ENV} is set, but rdma-verbs was built without its fault-injection feature"
        ));
    }
    FaultPlan::parse(&text)
        .map(Some)
        .map_err(|error| format!("{FAULTS_ENV}: {error}"))
}

/// One stream of decisions: a QP's (or a context's registrations').
#[derive(Debug)]
pub(crate) struct FaultStream {
    plan: Option<FaultPlan>,
    stream: u64,
    asked: [AtomicU64; KINDS],
}

impl FaultStream {
    /// Stream `stream` of `plan`.
    pub(crate) fn new(plan: Option<FaultPlan>, stream: u64) -> FaultStream {
        FaultStream {
            plan,
            stream,
            asked: Default::default(),
        }
    }

    /// Whether a fault of `kind` happens on this occasion (counted when it
    /// does).
    #[inline]
    pub(crate) fn roll(&self, kind: FaultKind) -> bool {
        let Some(plan) = &self.plan else {
            return false;
        };
        let rate = plan.rate(kind);
        if rate <= 0.0 || PAUSED.load(Ordering::Relaxed) {
            return false;
        }
        let occasion = self.asked[kind.index()].fetch_add(1, Ordering::Relaxed);
        let hit = unit(decision(plan.seed, self.stream, kind, occasion)) < rate;
        if hit {
            INJECTED[kind.index()].fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                stream = self.stream,
                fault = kind.name(),
                occasion,
                "soft provider: injected fault"
            );
        }
        hit
    }

    /// The error status of an [`FaultKind::ErrorCompletion`] (drawn from
    /// the same stream, so it replays too).
    pub(crate) fn error_status(&self) -> crate::WcStatus {
        use crate::WcStatus;
        const STATUSES: [WcStatus; 4] = [
            WcStatus::RetryExcErr,
            WcStatus::RemAccessErr,
            WcStatus::RemOpErr,
            WcStatus::RnrRetryExcErr,
        ];
        let seed = self.plan.map_or(0, |plan| plan.seed);
        let occasion = self.asked[FaultKind::ErrorCompletion.index()].load(Ordering::Relaxed);
        let pick = decision(
            seed ^ 0x5eed,
            self.stream,
            FaultKind::ErrorCompletion,
            occasion,
        );
        STATUSES[(pick % STATUSES.len() as u64) as usize]
    }
}

impl FaultStream {
    /// How long a [`FaultKind::Delay`] holds its message: 1–20 ms, drawn
    /// from the same stream (so it replays too).
    pub(crate) fn delay(&self) -> std::time::Duration {
        let seed = self.plan.map_or(0, |plan| plan.seed);
        let occasion = self.asked[FaultKind::Delay.index()].load(Ordering::Relaxed);
        let pick = decision(seed ^ 0xde1a, self.stream, FaultKind::Delay, occasion);
        std::time::Duration::from_millis(1 + pick % 20)
    }
}

/// splitmix64's finaliser: a well-mixed 64-bit hash of `x`.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn decision(seed: u64, stream: u64, kind: FaultKind, occasion: u64) -> u64 {
    mix(mix(mix(seed ^ mix(stream)) ^ kind.index() as u64) ^ occasion)
}

/// The top 53 bits of `x` as a number in [0, 1).
fn unit(x: u64) -> f64 {
    (x >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(plan: FaultPlan, stream: u64, kind: FaultKind, occasions: usize) -> Vec<usize> {
        let faults = FaultStream::new(Some(plan), stream);
        (0..occasions).filter(|_| faults.roll(kind)).collect()
    }

    #[test]
    fn the_same_seed_gives_the_same_schedule_per_stream() {
        let plan = FaultPlan {
            rnr_drop: 0.05,
            ..FaultPlan::new(42)
        };
        let first = schedule(plan, 0x41, FaultKind::RnrDrop, 10_000);
        assert_eq!(first, schedule(plan, 0x41, FaultKind::RnrDrop, 10_000));
        // About the rate asked for.
        assert!(
            (400..=600).contains(&first.len()),
            "{} of 10,000",
            first.len()
        );
        // Another stream, another seed: another schedule.
        assert_ne!(first, schedule(plan, 0x42, FaultKind::RnrDrop, 10_000));
        let other_seed = FaultPlan { seed: 43, ..plan };
        assert_ne!(
            first,
            schedule(other_seed, 0x41, FaultKind::RnrDrop, 10_000)
        );
        // A kind at rate 0 never fires, and asking about it does not move
        // the other kinds' schedules.
        let faults = FaultStream::new(Some(plan), 0x41);
        let mut hits = Vec::new();
        for occasion in 0..10_000 {
            assert!(!faults.roll(FaultKind::QpError));
            if faults.roll(FaultKind::RnrDrop) {
                hits.push(occasion);
            }
        }
        assert_eq!(hits, first);
    }

    #[test]
    fn plans_parse_and_print_and_bad_ones_say_why() {
        let plan = FaultPlan::parse("seed=7, error_completion=0.001,rnr_drop=0.5").unwrap();
        assert_eq!(plan.seed, 7);
        assert_eq!(plan.error_completion, 0.001);
        assert_eq!(plan.rnr_drop, 0.5);
        assert_eq!(plan.qp_error, 0.0);
        assert_eq!(FaultPlan::parse(&plan.to_string()).unwrap(), plan);
        for (bad, says) in [
            ("rnr_drop=0.1", "needs seed"),
            ("seed=x", "not an unsigned integer"),
            ("seed=1,rnr_drop=2", "from 0 to 1"),
            ("seed=1,lost_packets=0.1", "unknown fault"),
            ("seed=1,qp_error", "not key=value"),
        ] {
            let error = FaultPlan::parse(bad).unwrap_err();
            assert!(error.contains(says), "{bad}: {error}");
        }
    }

    #[test]
    fn no_plan_no_faults_and_hits_are_counted() {
        assert!(!FaultStream::new(None, 0).roll(FaultKind::Registration));
        let before = injected_faults().of(FaultKind::Registration);
        let always = FaultStream::new(
            Some(FaultPlan {
                registration: 1.0,
                ..FaultPlan::new(1)
            }),
            9,
        );
        assert!(always.roll(FaultKind::Registration));
        assert!(injected_faults().of(FaultKind::Registration) > before);
    }
}
