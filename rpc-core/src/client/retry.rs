//! [`RetryPolicy`]: retries of idempotent calls, within a retry budget.
//!
//! For `tower::retry::RetryLayer` over a [`Channel`](crate::Channel) or a
//! [`BalancedChannel`](crate::client::BalancedChannel): a call is retried
//! only when its method is one the application declared idempotent, it failed
//! `Unavailable` (the server never answered it: connection failed, server
//! gone, or it was refused for shutdown), attempts are left, and the budget
//! allows — a [`TpsBudget`] shared by every clone, so retries stay a fraction
//! of the calls (default 20% plus 10 a second) and a failing backend never
//! sees a retry storm. Each retry waits a jittered backoff first, and carries
//! its attempt number in `x-retry-attempt`.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tower::retry::budget::{Budget, TpsBudget};

use crate::payload::Payload;
use crate::request::{Request, Response};
use crate::status::{BoxError, Code, Status};

/// Retries `Unavailable` failures of idempotent methods (see the module docs).
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    idempotent: Arc<HashSet<String>>,
    budget: Arc<TpsBudget>,
    attempts_left: usize,
    attempt: usize,
    backoff: Duration,
}

impl RetryPolicy {
    /// Retries calls of `methods` (full paths, `/pkg.Service/Method`), at
    /// most 2 more attempts each, within the default budget.
    pub fn idempotent<I, S>(methods: I) -> RetryPolicy
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RetryPolicy {
            idempotent: Arc::new(methods.into_iter().map(Into::into).collect()),
            budget: Arc::new(TpsBudget::new(Duration::from_secs(10), 10, 0.2)),
            attempts_left: 2,
            attempt: 0,
            backoff: Duration::from_millis(10),
        }
    }

    /// At most `retries` more attempts per call.
    pub fn max_retries(mut self, retries: usize) -> RetryPolicy {
        self.attempts_left = retries;
        self
    }

    /// Retries may be `percent` of calls (0.0..=1000.0) plus `min_per_sec`
    /// a second, counted over `ttl` (tower's `TpsBudget`).
    pub fn budget(mut self, ttl: Duration, min_per_sec: u32, percent: f32) -> RetryPolicy {
        self.budget = Arc::new(TpsBudget::new(ttl, min_per_sec, percent));
        self
    }

    /// The first retry's backoff (doubled each time, jittered ±50%).
    pub fn backoff(mut self, first: Duration) -> RetryPolicy {
        self.backoff = first;
        self
    }

    fn retryable(&self, request: &Request<Payload>, status: &Status) -> bool {
        status.code() == Code::Unavailable
            && request
                .method()
                .is_some_and(|method| self.idempotent.contains(method))
    }
}

fn status_of(error: &BoxError) -> Option<&Status> {
    error.downcast_ref::<Status>()
}

impl<E> tower::retry::Policy<Request<Payload>, Response<Bytes>, E> for RetryPolicy
where
    E: AsStatus,
{
    type Future = Pin<Box<dyn Future<Output = ()> + Send>>;

    fn retry(
        &mut self,
        request: &mut Request<Payload>,
        result: &mut Result<Response<Bytes>, E>,
    ) -> Option<Self::Future> {
        let status = match result {
            Ok(_) => {
                self.budget.deposit();
                return None;
            }
            Err(error) => error.as_status()?,
        };
        if !self.retryable(request, status) || self.attempts_left == 0 || !self.budget.withdraw() {
            return None;
        }
        self.attempts_left -= 1;
        self.attempt += 1;
        let _ = request
            .metadata_mut()
            .insert("x-retry-attempt", &self.attempt.to_string());
        let doubled = self.backoff.saturating_mul(1 << (self.attempt - 1).min(16));
        let jitter = 0.5 + f64::from(rand_unit(self.attempt));
        let wait = doubled.mul_f64(jitter);
        Some(Box::pin(async move { tokio::time::sleep(wait).await }))
    }

    /// A streaming call is never retried: its messages are the
    /// application's stream, which the first attempt consumes.
    fn clone_request(&mut self, request: &Request<Payload>) -> Option<Request<Payload>> {
        if crate::stream::is_streaming(request) {
            return None;
        }
        Some(request.clone())
    }
}

/// An error a [`RetryPolicy`] can read the `Status` of: `Status` itself (a
/// `Channel`'s error) or a boxed one (behind other tower layers).
pub trait AsStatus {
    /// The status inside, if any.
    fn as_status(&self) -> Option<&Status>;
}

impl AsStatus for Status {
    fn as_status(&self) -> Option<&Status> {
        Some(self)
    }
}

impl AsStatus for BoxError {
    fn as_status(&self) -> Option<&Status> {
        status_of(self)
    }
}

/// A number in [0, 1) that differs between calls.
fn rand_unit(salt: usize) -> f32 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_usize(salt);
    (hasher.finish() % 1_000) as f32 / 1_000.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::retry::Policy;

    fn request(method: &'static str) -> Request<Payload> {
        let mut request = Request::new(Payload::from(Bytes::from_static(b"x")));
        request.set_method(method);
        request
    }

    #[test]
    fn only_unavailable_idempotent_calls_are_retried_within_attempts_and_budget() {
        let mut policy = RetryPolicy::idempotent(["/kv.Kv/Get"]).max_retries(2);
        let unavailable = || Err::<Response<Bytes>, Status>(Status::unavailable("gone"));
        let mut get = request("/kv.Kv/Get");
        assert!(policy.retry(&mut get, &mut unavailable()).is_some());
        assert_eq!(get.metadata().get("x-retry-attempt"), Some("1"));
        assert!(policy.retry(&mut get, &mut unavailable()).is_some());
        assert!(
            policy.retry(&mut get, &mut unavailable()).is_none(),
            "attempts spent"
        );
        let mut fresh = RetryPolicy::idempotent(["/kv.Kv/Get"]);
        let mut put = request("/kv.Kv/Put");
        assert!(
            fresh.retry(&mut put, &mut unavailable()).is_none(),
            "not idempotent"
        );
        let mut failed = Err::<Response<Bytes>, Status>(Status::internal("bug"));
        assert!(
            fresh.retry(&mut get, &mut failed).is_none(),
            "not Unavailable"
        );
        // An empty budget (no minimum, no percentage): nothing is retried.
        let mut broke =
            RetryPolicy::idempotent(["/kv.Kv/Get"]).budget(Duration::from_secs(1), 0, 0.0);
        assert!(
            broke.retry(&mut get, &mut unavailable()).is_none(),
            "budget spent"
        );
    }

    #[test]
    fn streaming_calls_are_never_cloned_for_a_retry() {
        use tower::retry::Policy;
        let mut policy = RetryPolicy::idempotent(["/kv.Kv/Watch"]);
        let unary = request("/kv.Kv/Watch");
        assert!(Policy::<_, Response<Bytes>, Status>::clone_request(&mut policy, &unary).is_some());
        let messages = crate::stream::Outbound::One(Payload::new());
        let mut streaming = crate::stream::into_streaming_request(Request::new(messages));
        streaming.set_method("/kv.Kv/Watch");
        assert!(
            Policy::<_, Response<Bytes>, Status>::clone_request(&mut policy, &streaming).is_none()
        );
    }
}
