//! Service discovery for rdma-rpc through etcd.
//!
//! A server registers each endpoint it listens on (`rdma://…`, `tcp://…`,
//! `grpc://…`) under its service and instance name, attached to a lease it
//! keeps alive ([`Etcd::register`]); a client watches the service's
//! instances and feeds them to a [`BalancedChannel`] ([`Etcd::balanced`]),
//! taking for each instance the endpoint of the first scheme it prefers that
//! the instance registered (rdma:// where both sides can, tcp:// or grpc://
//! otherwise). An instance whose process dies drops out when its lease
//! expires (its time-to-live after the last keep-alive); one that shuts down
//! gracefully deregisters first ([`Registration::deregister`]: the lease is
//! revoked, its keys go at once) and then drains.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use rpc_core::client::LoadSignal;
//! let etcd = rpc_etcd::Etcd::connect_lazy("127.0.0.1:2379")?;
//! // A server, once it listens:
//! let endpoints = ["rdma://10.0.0.1:50051".parse()?, "tcp://10.0.0.1:50052".parse()?];
//! let registration = etcd.register("echo", "host-1", &endpoints, Duration::from_secs(10)).await?;
//! // A client:
//! let balanced = etcd.balanced("echo", &["rdma", "tcp"], rpc_core::Channel::from_endpoint, LoadSignal::default());
//! // The server, shutting down: out of discovery first, then drain.
//! registration.deregister().await?;
//! # Ok(()) }
//! ```
//!
//! Keys: `rdma-rpc/{service}/{instance}/{scheme}`, each holding its endpoint.
//! etcd is spoken to with rdma-rpc's own gRPC client (grpc://) from the part
//! of etcd's v3 API this crate needs (`proto/etcd/`): no protoc, no second
//! gRPC stack. What etcd returns is checked like anything a peer sends: a key
//! or endpoint that does not parse is skipped with a warning.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::Stream;
use rpc_core::client::{BalancedChannel, Discovered, LoadSignal};
use rpc_core::transport::Endpoint;
use rpc_core::{Channel, Status};
use tokio::sync::mpsc;

/// The generated code of `proto/etcd/`.
#[allow(missing_docs, unreachable_pub, clippy::all)]
pub mod proto {
    /// etcd's `mvccpb` (keys and events), as far as discovery reads it.
    pub mod mvccpb {
        rpc_core::include_proto!("mvccpb");
    }
    /// etcd's `etcdserverpb` (KV, Watch, Lease), as far as discovery uses it.
    pub mod etcdserverpb {
        rpc_core::include_proto!("etcdserverpb");
    }
}

use proto::etcdserverpb::{
    DeleteRangeRequest, LeaseGrantRequest, LeaseKeepAliveRequest, LeaseRevokeRequest, PutRequest,
    RangeRequest, WatchCreateRequest, WatchRequest, kv_client::KvClient, lease_client::LeaseClient,
    watch_client::WatchClient, watch_request::RequestUnion,
};
use proto::mvccpb::event::EventType;

/// Where every key of this crate starts.
pub const KEY_ROOT: &str = "rdma-rpc";

/// What can go wrong talking to etcd.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// The etcd address is not `host:port`.
    #[error("bad etcd address {address:?}: {reason}")]
    Address {
        /// What was given.
        address: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A call to etcd failed.
    #[error("etcd: {0}")]
    Call(#[from] Status),
    /// etcd refused the lease.
    #[error("etcd refused a lease of {ttl:?}: {error}")]
    Lease {
        /// The time-to-live asked for.
        ttl: Duration,
        /// etcd's reason.
        error: String,
    },
    /// A name has a `/` or is empty (it would change what a key means).
    #[error("{what} {name:?} must be non-empty and without '/'")]
    Name {
        /// Which name.
        what: &'static str,
        /// The name.
        name: String,
    },
}

/// A connection to an etcd server (one gRPC channel, shared by clones).
#[derive(Clone, Debug)]
pub struct Etcd {
    channel: Channel,
}

impl Etcd {
    /// Connects (lazily, and again whenever the connection fails) to the
    /// etcd server at `address` (`host:port`, or `http://host:port` as etcd
    /// writes its client URLs).
    pub fn connect_lazy(address: &str) -> Result<Etcd, EtcdError> {
        let authority = address.strip_prefix("http://").unwrap_or(address);
        let endpoint = Endpoint::new("grpc", authority).map_err(|error| EtcdError::Address {
            address: address.to_owned(),
            reason: error.to_string(),
        })?;
        let channel = Channel::builder(endpoint)
            .transport(Arc::new(rpc_grpc::GrpcTransport::default()))
            .connect_timeout(Duration::from_secs(2))
            .connect_lazy();
        Ok(Etcd { channel })
    }

    fn kv(&self) -> KvClient<Channel> {
        KvClient::new(self.channel.clone())
    }

    fn lease(&self) -> LeaseClient<Channel> {
        LeaseClient::new(self.channel.clone())
    }

    /// Registers `endpoints` of `instance` of `service` under a lease of
    /// `ttl` (at least a second), which a task keeps alive (every third of
    /// `ttl`) until the [`Registration`] is dropped (the keys then go when
    /// the lease expires, as when the process dies) or deregistered (at
    /// once).
    pub async fn register(
        &self,
        service: &str,
        instance: &str,
        endpoints: &[Endpoint],
        ttl: Duration,
    ) -> Result<Registration, EtcdError> {
        check_name("service", service)?;
        check_name("instance", instance)?;
        let ttl = ttl.max(Duration::from_secs(1));
        let granted = self
            .lease()
            .lease_grant(LeaseGrantRequest {
                ttl: ttl.as_secs() as i64,
                id: 0,
            })
            .await?
            .into_inner();
        if !granted.error.is_empty() || granted.id == 0 {
            return Err(EtcdError::Lease {
                ttl,
                error: granted.error,
            });
        }
        let lease = granted.id;
        let mut keys = Vec::new();
        for endpoint in endpoints {
            let key = format!("{KEY_ROOT}/{service}/{instance}/{}", endpoint.scheme());
            let mut kv = self.kv();
            let put = kv.put(PutRequest {
                key: key.clone().into_bytes().into(),
                value: endpoint.to_string().into_bytes().into(),
                lease,
                prev_kv: false,
            });
            if let Err(status) = put.await {
                let _ = self
                    .lease()
                    .lease_revoke(LeaseRevokeRequest { id: lease })
                    .await;
                return Err(status.into());
            }
            keys.push(key);
        }
        let keepalive = tokio::spawn(keep_alive(self.clone(), lease, ttl));
        Ok(Registration {
            etcd: self.clone(),
            lease,
            keys,
            keepalive,
        })
    }

    /// The instances of `service` as they come and go: for each, the
    /// endpoint of the first scheme in `prefer` it registered (an instance
    /// with none of them is left out). Follows etcd with a watch, and
    /// starts over from a fresh read when the watch breaks.
    pub fn discover(
        &self,
        service: &str,
        prefer: &[&str],
    ) -> impl Stream<Item = Discovered> + Send + 'static {
        let (sender, receiver) = mpsc::unbounded_channel();
        tokio::spawn(follow(
            self.clone(),
            format!("{KEY_ROOT}/{service}/"),
            prefer.iter().map(|scheme| (*scheme).to_owned()).collect(),
            sender,
        ));
        unbounded_stream(receiver)
    }

    /// A [`BalancedChannel`] over `service`'s instances ([`Etcd::discover`]),
    /// each channel made by `make`, compared by `load`.
    pub fn balanced(
        &self,
        service: &str,
        prefer: &[&str],
        make: impl Fn(Endpoint) -> Channel + Send + Sync + 'static,
        load: LoadSignal,
    ) -> BalancedChannel {
        BalancedChannel::from_discovery(self.discover(service, prefer), make, load)
    }

    /// Deletes every key under `service` (tests and tooling).
    pub async fn clear(&self, service: &str) -> Result<(), EtcdError> {
        check_name("service", service)?;
        let prefix = format!("{KEY_ROOT}/{service}/");
        self.kv()
            .delete_range(DeleteRangeRequest {
                range_end: prefix_end(prefix.as_bytes()).into(),
                key: prefix.into_bytes().into(),
            })
            .await?;
        Ok(())
    }
}

/// What a channel's sender sends, as a stream (a bidirectional call's
/// outgoing messages; discovery's changes).
fn bounded_stream<T: Send + 'static>(receiver: mpsc::Receiver<T>) -> impl Stream<Item = T> + Send {
    futures_util::stream::unfold(receiver, |mut receiver| async move {
        receiver.recv().await.map(|item| (item, receiver))
    })
}

/// [`bounded_stream`] for an unbounded channel.
fn unbounded_stream<T: Send + 'static>(
    receiver: mpsc::UnboundedReceiver<T>,
) -> impl Stream<Item = T> + Send {
    futures_util::stream::unfold(receiver, |mut receiver| async move {
        receiver.recv().await.map(|item| (item, receiver))
    })
}

fn check_name(what: &'static str, name: &str) -> Result<(), EtcdError> {
    if name.is_empty() || name.contains('/') {
        return Err(EtcdError::Name {
            what,
            name: name.to_owned(),
        });
    }
    Ok(())
}

/// The end of the range of keys that start with `prefix` (etcd's
/// `range_end`: the prefix with its last byte raised).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// Endpoints registered under a lease kept alive (see [`Etcd::register`]).
#[derive(Debug)]
pub struct Registration {
    etcd: Etcd,
    lease: i64,
    keys: Vec<String>,
    keepalive: tokio::task::JoinHandle<()>,
}

impl Registration {
    /// The lease the keys are attached to.
    pub fn lease(&self) -> i64 {
        self.lease
    }

    /// The keys written.
    pub fn keys(&self) -> &[String] {
        &self.keys
    }

    /// Takes the endpoints out of discovery now (revokes the lease, which
    /// deletes its keys): call it before draining a server that shuts down.
    pub async fn deregister(self) -> Result<(), EtcdError> {
        self.keepalive.abort();
        self.etcd
            .lease()
            .lease_revoke(LeaseRevokeRequest { id: self.lease })
            .await?;
        Ok(())
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // No more keep-alives: the keys go when the lease expires.
        self.keepalive.abort();
    }
}

/// Keeps `lease` alive: a keep-alive every third of `ttl` on one stream,
/// opened again when it breaks.
async fn keep_alive(etcd: Etcd, lease: i64, ttl: Duration) {
    let period = ttl / 3;
    loop {
        let (requests, outgoing) = mpsc::channel::<LeaseKeepAliveRequest>(1);
        let outgoing = bounded_stream(outgoing);
        // The first keep-alive goes with the call: a gRPC server may send
        // its response headers only with its first answer, which waits for
        // a request.
        let _ = requests.try_send(LeaseKeepAliveRequest { id: lease });
        match etcd.lease().lease_keep_alive(outgoing).await {
            Ok(response) => {
                let mut answers = response.into_inner();
                let mut first = true;
                loop {
                    if !std::mem::take(&mut first)
                        && requests
                            .send(LeaseKeepAliveRequest { id: lease })
                            .await
                            .is_err()
                    {
                        break;
                    }
                    match answers.message().await {
                        Ok(Some(answer)) if answer.ttl > 0 => {}
                        Ok(Some(_)) => {
                            tracing::warn!(
                                lease,
                                "etcd lease expired: its endpoints are out of discovery"
                            );
                            return;
                        }
                        Ok(None) => break,
                        Err(status) => {
                            tracing::debug!(lease, %status, "etcd keep-alive stream broke");
                            break;
                        }
                    }
                    tokio::time::sleep(period).await;
                }
            }
            Err(status) => tracing::debug!(lease, %status, "etcd keep-alive failed"),
        }
        tokio::time::sleep(period.min(Duration::from_secs(1))).await;
    }
}

/// What one instance registered: scheme → endpoint.
type Instances = BTreeMap<String, BTreeMap<String, Endpoint>>;

/// Reads `prefix`, then watches it, sending the chosen endpoint of each
/// instance as it changes; starts over when the watch breaks.
async fn follow(
    etcd: Etcd,
    prefix: String,
    prefer: Vec<String>,
    changes: mpsc::UnboundedSender<Discovered>,
) {
    let range_end = prefix_end(prefix.as_bytes());
    let mut chosen: BTreeMap<String, Endpoint> = BTreeMap::new();
    loop {
        let read = etcd
            .kv()
            .range(RangeRequest {
                key: prefix.clone().into_bytes().into(),
                range_end: range_end.clone().into(),
                limit: 0,
                revision: 0,
            })
            .await;
        let (mut instances, revision) = match read {
            Ok(response) => {
                let response = response.into_inner();
                let mut instances = Instances::new();
                for kv in &response.kvs {
                    put(&mut instances, &prefix, &kv.key, &kv.value);
                }
                (
                    instances,
                    response.header.map_or(0, |header| header.revision),
                )
            }
            Err(status) => {
                tracing::debug!(%status, "etcd read failed; trying again");
                if wait_or_closed(&changes, Duration::from_millis(500)).await {
                    return;
                }
                continue;
            }
        };
        if !choose(&instances, &prefer, &mut chosen, &changes) {
            return;
        }
        // Watch from just after what was read.
        let (watch_requests, outgoing) = mpsc::channel::<WatchRequest>(1);
        let _ = watch_requests
            .send(WatchRequest {
                request_union: Some(RequestUnion::CreateRequest(WatchCreateRequest {
                    key: prefix.clone().into_bytes().into(),
                    range_end: range_end.clone().into(),
                    start_revision: revision + 1,
                    progress_notify: false,
                    prev_kv: false,
                })),
            })
            .await;
        let outgoing = bounded_stream(outgoing);
        match WatchClient::new(etcd.channel.clone()).watch(outgoing).await {
            Ok(response) => {
                let mut events = response.into_inner();
                loop {
                    let next = tokio::select! {
                        next = events.message() => next,
                        () = changes.closed() => return,
                    };
                    match next {
                        Ok(Some(answer)) if answer.canceled || answer.compact_revision > 0 => {
                            tracing::debug!(reason = %answer.cancel_reason, "etcd watch canceled");
                            break;
                        }
                        Ok(Some(answer)) => {
                            for event in answer.events {
                                let Some(kv) = event.kv else { continue };
                                if event.r#type == EventType::Delete as i32 {
                                    delete(&mut instances, &prefix, &kv.key);
                                } else {
                                    put(&mut instances, &prefix, &kv.key, &kv.value);
                                }
                            }
                            if !choose(&instances, &prefer, &mut chosen, &changes) {
                                return;
                            }
                        }
                        Ok(None) => break,
                        Err(status) => {
                            tracing::debug!(%status, "etcd watch broke");
                            break;
                        }
                    }
                }
            }
            Err(status) => tracing::debug!(%status, "etcd watch failed"),
        }
        drop(watch_requests);
        if wait_or_closed(&changes, Duration::from_millis(500)).await {
            return;
        }
    }
}

/// Sleeps `pause`; true when nobody listens any more.
async fn wait_or_closed(changes: &mpsc::UnboundedSender<Discovered>, pause: Duration) -> bool {
    tokio::select! {
        () = tokio::time::sleep(pause) => changes.is_closed(),
        () = changes.closed() => true,
    }
}

/// `{prefix}{instance}/{scheme}` → (instance, scheme), both non-empty.
fn split_key<'a>(prefix: &str, key: &'a [u8]) -> Option<(&'a str, &'a str)> {
    let key = std::str::from_utf8(key).ok()?;
    let rest = key.strip_prefix(prefix)?;
    let (instance, scheme) = rest.split_once('/')?;
    (!instance.is_empty() && !scheme.is_empty() && !scheme.contains('/'))
        .then_some((instance, scheme))
}

fn put(instances: &mut Instances, prefix: &str, key: &[u8], value: &[u8]) {
    let Some((instance, scheme)) = split_key(prefix, key) else {
        tracing::warn!(key = %String::from_utf8_lossy(key), "etcd: a key that is not {{instance}}/{{scheme}}: skipped");
        return;
    };
    let endpoint = std::str::from_utf8(value)
        .ok()
        .and_then(|value| value.parse::<Endpoint>().ok())
        .filter(|endpoint| endpoint.scheme() == scheme);
    match endpoint {
        Some(endpoint) => {
            instances
                .entry(instance.to_owned())
                .or_default()
                .insert(scheme.to_owned(), endpoint);
        }
        None => tracing::warn!(
            instance,
            scheme,
            value = %String::from_utf8_lossy(value),
            "etcd: not an endpoint of its key's scheme: skipped"
        ),
    }
}

fn delete(instances: &mut Instances, prefix: &str, key: &[u8]) {
    let Some((instance, scheme)) = split_key(prefix, key) else {
        return;
    };
    if let Some(schemes) = instances.get_mut(instance) {
        schemes.remove(scheme);
        if schemes.is_empty() {
            instances.remove(instance);
        }
    }
}

/// Picks each instance's endpoint (the first preferred scheme it has) and
/// sends what changed against `chosen`; false when nobody listens.
fn choose(
    instances: &Instances,
    prefer: &[String],
    chosen: &mut BTreeMap<String, Endpoint>,
    changes: &mpsc::UnboundedSender<Discovered>,
) -> bool {
    let now: BTreeMap<String, Endpoint> = instances
        .iter()
        .filter_map(|(instance, schemes)| {
            prefer
                .iter()
                .find_map(|scheme| schemes.get(scheme))
                .map(|endpoint| (instance.clone(), endpoint.clone()))
        })
        .collect();
    let mut sent = Vec::new();
    for (instance, endpoint) in chosen.iter() {
        if now.get(instance) != Some(endpoint) {
            sent.push(Discovered::Remove(endpoint.clone()));
        }
    }
    for (instance, endpoint) in &now {
        if chosen.get(instance) != Some(endpoint) {
            sent.push(Discovered::Insert(endpoint.clone()));
        }
    }
    *chosen = now;
    sent.into_iter().all(|change| changes.send(change).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_parse_and_hostile_ones_are_skipped() {
        let prefix = "rdma-rpc/echo/";
        let mut instances = Instances::new();
        put(
            &mut instances,
            prefix,
            b"rdma-rpc/echo/a/rdma",
            b"rdma://10.0.0.1:1",
        );
        put(
            &mut instances,
            prefix,
            b"rdma-rpc/echo/a/tcp",
            b"tcp://10.0.0.1:2",
        );
        put(
            &mut instances,
            prefix,
            b"rdma-rpc/echo/b/tcp",
            b"tcp://10.0.0.2:2",
        );
        // Skipped: a scheme that is not its key's, junk, a key of no instance.
        put(
            &mut instances,
            prefix,
            b"rdma-rpc/echo/c/rdma",
            b"tcp://10.0.0.3:2",
        );
        put(&mut instances, prefix, b"rdma-rpc/echo/d/tcp", b"\xff\xfe");
        put(
            &mut instances,
            prefix,
            b"rdma-rpc/echo//tcp",
            b"tcp://10.0.0.4:2",
        );
        put(
            &mut instances,
            prefix,
            b"rdma-rpc/echo/e",
            b"tcp://10.0.0.5:2",
        );
        assert_eq!(instances.len(), 2);
        let (sender, mut receiver) = mpsc::unbounded_channel();
        let mut chosen = BTreeMap::new();
        let prefer = vec!["rdma".to_owned(), "tcp".to_owned()];
        assert!(choose(&instances, &prefer, &mut chosen, &sender));
        let mut sent = Vec::new();
        while let Ok(change) = receiver.try_recv() {
            sent.push(change);
        }
        assert_eq!(
            sent,
            vec![
                Discovered::Insert("rdma://10.0.0.1:1".parse().unwrap()),
                Discovered::Insert("tcp://10.0.0.2:2".parse().unwrap()),
            ]
        );
        // a loses its rdma:// endpoint: it falls back to tcp://.
        delete(&mut instances, prefix, b"rdma-rpc/echo/a/rdma");
        assert!(choose(&instances, &prefer, &mut chosen, &sender));
        assert_eq!(
            receiver.try_recv().unwrap(),
            Discovered::Remove("rdma://10.0.0.1:1".parse().unwrap())
        );
        assert_eq!(
            receiver.try_recv().unwrap(),
            Discovered::Insert("tcp://10.0.0.1:2".parse().unwrap())
        );
        assert_eq!(prefix_end(b"rdma-rpc/echo/"), b"rdma-rpc/echo0".to_vec());
    }
}
