//! [`BalancedChannel`]: calls spread over several servers.
//!
//! One lazily connected [`Channel`] per endpoint (rdma://, tcp://, any
//! scheme, mixed), behind tower's power-of-two-choices balancer: each call
//! goes to the less loaded of two endpoints picked at random, loaded as
//! [`LoadSignal`] says (calls in flight by default, or a peak-EWMA of their
//! latency). An endpoint whose call fails `Unavailable` (its connection failed
//! or its server is gone), or `ResourceExhausted` because it refused the
//! connection for want of room, is ejected — not picked — for a backoff that
//! doubles with each consecutive failure (100 ms up to 10 s, ±50% jitter);
//! then it is probed (its channel connects) before it takes calls again: a
//! probe that fails ejects it for the next backoff, so no call is sent to an
//! endpoint that is still down; a success resets it.
//!
//! The endpoints come from a list ([`BalancedChannel::from_endpoints`]) or
//! from a name resolved again every interval
//! ([`BalancedChannel::from_dns`], through a [`Resolve`]: the system
//! resolver by default, or one of your own): endpoints that appear are
//! added, those that disappear are removed once their calls are done.

use std::collections::BTreeSet;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_core::Stream;
use tokio::sync::mpsc;
use tower::ServiceExt;
use tower::buffer::Buffer;
use tower::discover::Change;
use tower::load::{CompleteOnResponse, Load, PeakEwma, PendingRequests};
use tower_service::Service;

use super::Channel;
use crate::payload::Payload;
use crate::request::{Request, Response};
use crate::status::{BoxError, Code, Status};
use crate::transport::{Endpoint, TransportError};

/// First ejection of a failing endpoint.
pub const EJECT_BASE: Duration = Duration::from_millis(100);
/// Longest ejection.
pub const EJECT_MAX: Duration = Duration::from_secs(10);
/// Calls a [`BalancedChannel`] queues before its callers wait.
const QUEUE: usize = 1024;

/// Resolves a host name to addresses (see [`BalancedChannel::from_dns`]).
pub trait Resolve: Send + Sync + 'static {
    /// The addresses of `host_port` (`name:port`) now.
    fn resolve(
        &self,
        host_port: &str,
    ) -> Pin<Box<dyn Future<Output = std::io::Result<Vec<SocketAddr>>> + Send + 'static>>;
}

/// The system's resolver (`/etc/hosts`, DNS), through tokio.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemResolver;

impl Resolve for SystemResolver {
    fn resolve(
        &self,
        host_port: &str,
    ) -> Pin<Box<dyn Future<Output = std::io::Result<Vec<SocketAddr>>> + Send + 'static>> {
        let host_port = host_port.to_owned();
        Box::pin(async move { Ok(tokio::net::lookup_host(host_port).await?.collect()) })
    }
}

type Call = Pin<Box<dyn Future<Output = Result<Response<Bytes>, Status>> + Send>>;

/// What the balancer compares when it picks the less loaded of two
/// endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum LoadSignal {
    /// Calls in flight to the endpoint (tower's `PendingRequests`): cheap,
    /// and blind to an endpoint that answers slowly while few calls wait on
    /// it.
    #[default]
    PendingRequests,
    /// The peak-EWMA of the endpoint's response latency, times its calls in
    /// flight plus one (tower's `PeakEwma`, after Finagle): a latency spike
    /// counts at once and is forgotten over `decay`, so an endpoint that
    /// slows down is picked less before its queue grows. `default_rtt` is
    /// what an endpoint that has not answered yet is assumed to take.
    PeakEwma {
        /// The latency assumed before the first answer.
        default_rtt: Duration,
        /// How long a latency takes to be forgotten (the EWMA's time constant).
        decay: Duration,
    },
}

impl LoadSignal {
    /// [`LoadSignal::PeakEwma`] with a 1 ms default latency and a 10 s decay
    /// (Finagle's).
    pub fn peak_ewma() -> LoadSignal {
        LoadSignal::PeakEwma {
            default_rtt: Duration::from_millis(1),
            decay: Duration::from_secs(10),
        }
    }
}

/// Several endpoints behind one cloneable service (see the module docs).
/// Create it inside a tokio runtime.
#[derive(Clone)]
pub struct BalancedChannel {
    inner: Buffer<Request<Payload>, <Balanced as Service<Request<Payload>>>::Future>,
}

impl std::fmt::Debug for BalancedChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BalancedChannel").finish_non_exhaustive()
    }
}

type Balanced = tower::balance::p2c::Balance<Changes, Request<Payload>>;

/// Everything a [`BalancedChannel`] is built with beyond its endpoints.
#[derive(Clone)]
struct Membership {
    make: Arc<dyn Fn(Endpoint) -> Channel + Send + Sync>,
    load: LoadSignal,
}

impl Membership {
    fn member(&self, endpoint: Endpoint) -> Member {
        let ejecting = Ejecting::new((self.make)(endpoint));
        match self.load {
            LoadSignal::PendingRequests => Member::Pending(PendingRequests::new(
                ejecting,
                CompleteOnResponse::default(),
            )),
            LoadSignal::PeakEwma { default_rtt, decay } => Member::Ewma(PeakEwma::new(
                ejecting,
                default_rtt,
                decay.as_nanos() as f64,
                CompleteOnResponse::default(),
            )),
        }
    }
}

impl BalancedChannel {
    /// Balances over `endpoints` (default channel settings).
    pub fn from_endpoints(endpoints: impl IntoIterator<Item = Endpoint>) -> BalancedChannel {
        Self::from_endpoints_with(endpoints, Channel::from_endpoint)
    }

    /// Balances over `endpoints`, each channel made by `make` (e.g.
    /// `|endpoint| Channel::builder(endpoint).timeout(..).connect_lazy()`).
    pub fn from_endpoints_with(
        endpoints: impl IntoIterator<Item = Endpoint>,
        make: impl Fn(Endpoint) -> Channel + Send + Sync + 'static,
    ) -> BalancedChannel {
        Self::from_endpoints_with_load(endpoints, make, LoadSignal::default())
    }

    /// [`BalancedChannel::from_endpoints_with`], comparing endpoints by `load`.
    pub fn from_endpoints_with_load(
        endpoints: impl IntoIterator<Item = Endpoint>,
        make: impl Fn(Endpoint) -> Channel + Send + Sync + 'static,
        load: LoadSignal,
    ) -> BalancedChannel {
        let membership = Membership {
            make: Arc::new(make),
            load,
        };
        let (changes, receiver) = mpsc::unbounded_channel();
        for endpoint in endpoints {
            let _ = changes.send(Change::Insert(
                endpoint.clone(),
                membership.member(endpoint),
            ));
        }
        // The list never changes: the sender lives as long as the balancer.
        Self::start(Changes {
            receiver,
            _keep: Some(changes),
        })
    }

    /// Balances over the addresses `host:port` resolves to, as
    /// `scheme://address:port`, resolving again every `interval`.
    pub fn from_dns(
        scheme: &str,
        host_port: &str,
        interval: Duration,
        resolver: Arc<dyn Resolve>,
    ) -> BalancedChannel {
        Self::from_dns_with_load(scheme, host_port, interval, resolver, LoadSignal::default())
    }

    /// [`BalancedChannel::from_dns`], comparing endpoints by `load`.
    pub fn from_dns_with_load(
        scheme: &str,
        host_port: &str,
        interval: Duration,
        resolver: Arc<dyn Resolve>,
        load: LoadSignal,
    ) -> BalancedChannel {
        let membership = Membership {
            make: Arc::new(Channel::from_endpoint),
            load,
        };
        let (changes, receiver) = mpsc::unbounded_channel();
        tokio::spawn(follow_dns(
            scheme.to_owned(),
            host_port.to_owned(),
            interval,
            resolver,
            membership,
            changes,
        ));
        Self::start(Changes {
            receiver,
            _keep: None,
        })
    }

    /// Balances over the endpoints a discovery system reports as they come
    /// and go (`rpc-etcd` feeds it from etcd), each channel made by `make`,
    /// compared by `load`. An endpoint removed leaves once its calls are
    /// done; when `discovered` ends, the endpoints stay as they are.
    pub fn from_discovery<S>(
        discovered: S,
        make: impl Fn(Endpoint) -> Channel + Send + Sync + 'static,
        load: LoadSignal,
    ) -> BalancedChannel
    where
        S: Stream<Item = Discovered> + Send + 'static,
    {
        let membership = Membership {
            make: Arc::new(make),
            load,
        };
        let (changes, receiver) = mpsc::unbounded_channel();
        tokio::spawn(follow_discovery(Box::pin(discovered), membership, changes));
        Self::start(Changes {
            receiver,
            _keep: None,
        })
    }

    fn start(changes: Changes) -> BalancedChannel {
        let balanced = tower::balance::p2c::Balance::new(changes);
        BalancedChannel {
            inner: Buffer::new(balanced, QUEUE),
        }
    }

    /// Performs one call with an encoded message, as [`Channel::unary`].
    /// Its timeout covers the wait for a ready endpoint too.
    pub async fn unary<P: Into<Payload>>(
        &self,
        request: Request<P>,
    ) -> Result<Response<Bytes>, Status> {
        let timeout = request.timeout();
        let call = self.clone().oneshot(request.map(Into::into));
        match timeout {
            Some(timeout) => tokio::time::timeout(timeout, call)
                .await
                .unwrap_or_else(|_| {
                    Err(Status::deadline_exceeded(format!(
                        "deadline of {timeout:?} exceeded"
                    )))
                }),
            None => call.await,
        }
    }
}

impl Service<Request<Payload>> for BalancedChannel {
    type Response = Response<Bytes>;
    type Error = Status;
    type Future = Call;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        self.inner
            .poll_ready(cx)
            .map_err(|error| Status::from_error(unbuffer(error)))
    }

    fn call(&mut self, request: Request<Payload>) -> Call {
        let call = self.inner.call(request);
        Box::pin(async move {
            call.await
                .map_err(|error| Status::from_error(unbuffer(error)))
        })
    }
}

/// The `Status` a member failed with, from inside the buffer's and the
/// balancer's error wrappers.
fn unbuffer(error: BoxError) -> BoxError {
    let mut current: &(dyn std::error::Error + 'static) = &*error;
    loop {
        if let Some(status) = current.downcast_ref::<Status>() {
            return Box::new(status.clone());
        }
        match current.source() {
            Some(source) => current = source,
            None => return error,
        }
    }
}

/// The membership changes the balancer follows.
struct Changes {
    receiver: mpsc::UnboundedReceiver<Change<Endpoint, Member>>,
    /// For a fixed list: keeps the stream open.
    _keep: Option<mpsc::UnboundedSender<Change<Endpoint, Member>>>,
}

impl Stream for Changes {
    type Item = Result<Change<Endpoint, Member>, BoxError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut()
            .receiver
            .poll_recv(cx)
            .map(|change| change.map(Ok))
    }
}

/// One endpoint of the balancer, with the load it reports.
enum Member {
    Pending(PendingRequests<Ejecting>),
    Ewma(PeakEwma<Ejecting>),
}

/// A [`Member`]'s load: one kind for every member of a balancer.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
enum MemberLoad {
    Pending(tower::load::pending_requests::Count),
    Ewma(tower::load::peak_ewma::Cost),
}

impl Load for Member {
    type Metric = MemberLoad;

    fn load(&self) -> MemberLoad {
        match self {
            Member::Pending(member) => MemberLoad::Pending(member.load()),
            Member::Ewma(member) => MemberLoad::Ewma(member.load()),
        }
    }
}

impl Service<Request<Payload>> for Member {
    type Response = Response<Bytes>;
    type Error = Status;
    type Future = futures_util::future::Either<
        <PendingRequests<Ejecting> as Service<Request<Payload>>>::Future,
        <PeakEwma<Ejecting> as Service<Request<Payload>>>::Future,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        match self {
            Member::Pending(member) => member.poll_ready(cx),
            Member::Ewma(member) => member.poll_ready(cx),
        }
    }

    fn call(&mut self, request: Request<Payload>) -> Self::Future {
        match self {
            Member::Pending(member) => futures_util::future::Either::Left(member.call(request)),
            Member::Ewma(member) => futures_util::future::Either::Right(member.call(request)),
        }
    }
}

async fn follow_dns(
    scheme: String,
    host_port: String,
    interval: Duration,
    resolver: Arc<dyn Resolve>,
    membership: Membership,
    changes: mpsc::UnboundedSender<Change<Endpoint, Member>>,
) {
    let mut current: BTreeSet<Endpoint> = BTreeSet::new();
    loop {
        match resolver.resolve(&host_port).await {
            Ok(addresses) => {
                let resolved: BTreeSet<Endpoint> = addresses
                    .iter()
                    .filter_map(|address| Endpoint::new(&scheme, &address.to_string()).ok())
                    .collect();
                for gone in current.difference(&resolved) {
                    tracing::debug!(endpoint = %gone, "no longer resolved: removed");
                    if changes.send(Change::Remove(gone.clone())).is_err() {
                        return;
                    }
                }
                for new in resolved.difference(&current) {
                    tracing::debug!(endpoint = %new, "resolved: added");
                    if changes
                        .send(Change::Insert(new.clone(), membership.member(new.clone())))
                        .is_err()
                    {
                        return;
                    }
                }
                current = resolved;
            }
            // Keep what we have; try again next time.
            Err(error) => tracing::warn!(%host_port, %error, "resolving failed"),
        }
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            () = changes.closed() => return,
        }
    }
}

/// A change to the endpoints a discovery system reports
/// ([`BalancedChannel::from_discovery`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Discovered {
    /// An endpoint to send calls to.
    Insert(Endpoint),
    /// An endpoint that is gone (or going): no new calls.
    Remove(Endpoint),
}

async fn follow_discovery(
    mut discovered: Pin<Box<dyn Stream<Item = Discovered> + Send>>,
    membership: Membership,
    changes: mpsc::UnboundedSender<Change<Endpoint, Member>>,
) {
    use futures_util::StreamExt;
    loop {
        let next = tokio::select! {
            next = discovered.next() => next,
            () = changes.closed() => return,
        };
        let change = match next {
            Some(Discovered::Insert(endpoint)) => {
                tracing::debug!(%endpoint, "discovered: added");
                Change::Insert(endpoint.clone(), membership.member(endpoint))
            }
            Some(Discovered::Remove(endpoint)) => {
                tracing::debug!(%endpoint, "discovered: removed");
                Change::Remove(endpoint)
            }
            None => {
                // Discovery ended: keep what we have while the balancer lives.
                changes.closed().await;
                return;
            }
        };
        if changes.send(change).is_err() {
            return;
        }
    }
}

/// Consecutive failures of one endpoint, and until when it is ejected.
#[derive(Debug, Default)]
struct Health {
    failures: u32,
    ejected_until: Option<Instant>,
}

type Probe = Pin<Box<dyn Future<Output = Result<(), Status>> + Send>>;

/// A member channel that is not ready while ejected, nor until a probe
/// reached its server again.
struct Ejecting {
    channel: Channel,
    health: Arc<Mutex<Health>>,
    wait: Option<Pin<Box<tokio::time::Sleep>>>,
    probe: Option<Probe>,
}

impl std::fmt::Debug for Ejecting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ejecting")
            .field("endpoint", self.channel.endpoint())
            .field("health", &self.health)
            .field("probing", &self.probe.is_some())
            .finish()
    }
}

impl Ejecting {
    fn new(channel: Channel) -> Ejecting {
        Ejecting {
            channel,
            health: Arc::default(),
            wait: None,
            probe: None,
        }
    }

    fn health(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }
}

impl Health {
    /// One more consecutive failure: ejected for the next backoff.
    fn failed(&mut self) -> Duration {
        self.failures += 1;
        let ejected = ejection(self.failures);
        self.ejected_until = Some(Instant::now() + ejected);
        ejected
    }
}

/// The ejection after `failures` consecutive failures, jittered by ±50%.
fn ejection(failures: u32) -> Duration {
    let doubled = EJECT_BASE.saturating_mul(1 << failures.saturating_sub(1).min(16));
    let base = doubled.min(EJECT_MAX);
    // A cheap random factor in [0.5, 1.5): the clock's low bits, hashed.
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(failures);
    let unit = (hasher.finish() % 1_000) as f64 / 1_000.0;
    base.mul_f64(0.5 + unit)
}

impl Service<Request<Payload>> for Ejecting {
    type Response = Response<Bytes>;
    type Error = Status;
    type Future = Call;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        loop {
            let until = self.health().ejected_until;
            let Some(until) = until else { break };
            if Instant::now() < until {
                let wait = self
                    .wait
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(until.into())));
                if wait.deadline() != until.into() {
                    wait.as_mut().reset(until.into());
                }
                if wait.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
            }
            self.wait = None;
            // Ejection over: reach the server before taking calls again.
            let channel = self.channel.clone();
            let probe = self
                .probe
                .get_or_insert_with(|| Box::pin(async move { channel.ensure_connected().await }));
            match probe.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(outcome) => {
                    self.probe = None;
                    let mut health = self.health();
                    match outcome {
                        Ok(()) => {
                            health.failures = 0;
                            health.ejected_until = None;
                        }
                        Err(status) => {
                            let ejected = health.failed();
                            tracing::debug!(endpoint = %self.channel.endpoint(), ?ejected, %status, "probe failed: still ejected");
                        }
                    }
                }
            }
        }
        self.channel.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Payload>) -> Call {
        let health = self.health.clone();
        let endpoint = self.channel.endpoint().clone();
        let call = self.channel.call(request);
        Box::pin(async move {
            let outcome = call.await;
            let mut health = health.lock().unwrap_or_else(|poison| poison.into_inner());
            match &outcome {
                Err(status) if status.code() == Code::Unavailable || refused_for_room(status) => {
                    let ejected = health.failed();
                    tracing::debug!(%endpoint, failures = health.failures, ?ejected, %status, "endpoint ejected");
                }
                _ => {
                    health.failures = 0;
                    health.ejected_until = None;
                }
            }
            outcome
        })
    }
}

/// Whether a call failed because its endpoint refused a connection for want
/// of room (`ResourceExhausted` from the connection, not from a handler): as
/// much a reason to eject the endpoint as `Unavailable`.
fn refused_for_room(status: &Status) -> bool {
    use std::error::Error as _;
    let Some(source) = status.source() else {
        return false;
    };
    matches!(
        source.downcast_ref::<TransportError>(),
        Some(TransportError::ResourceExhausted(_))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ejections_double_up_to_the_cap_with_jitter() {
        for failures in 1..40 {
            let expected = EJECT_BASE
                .saturating_mul(1 << (failures - 1).min(16))
                .min(EJECT_MAX);
            let got = ejection(failures);
            assert!(
                got >= expected / 2 && got < expected * 3 / 2,
                "{failures}: {got:?}"
            );
        }
    }
}
