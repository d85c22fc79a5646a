//! `grpc.health.v1.Health`, the standard health service: what gRPC's
//! tooling (grpc-health-probe, grpcio's health stub) and Kubernetes' gRPC
//! probes ask. An rdma-rpc service like any other, so it is served over
//! every transport.
//!
//! ```no_run
//! # async fn demo() -> Result<(), rpc_core::Error> {
//! let health = rpc_grpc::health::HealthReporter::new();
//! health.set_serving("echo.v1.Echo");
//! rpc_core::Server::builder()
//!     .add_service(health.service())
//!     .serve("grpc://0.0.0.0:50051")
//!     .await
//! # }
//! ```
//!
//! The server as a whole (the service name `""`) is `SERVING` from the
//! start; [`HealthReporter::set_not_serving`] of `""` says it is going down.

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use futures_util::Stream;
use rpc_core::{Request, Response, Status};
use tokio::sync::watch;

/// The generated messages, client and server of `grpc.health.v1`.
pub mod proto {
    #![allow(missing_docs, unreachable_pub, clippy::all)]
    rpc_core::include_proto!("grpc.health.v1");
}

pub use proto::health_check_response::ServingStatus;
use proto::{HealthCheckRequest, HealthCheckResponse, HealthListRequest, HealthListResponse};

/// Longest service name a health request may ask about.
const MAX_SERVICE_NAME: usize = 1024;

/// Sets the serving status of services; cloned handles share it.
#[derive(Debug, Clone)]
pub struct HealthReporter {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    statuses: Mutex<HashMap<String, ServingStatus>>,
    /// Bumped on every change; watchers re-read their service then.
    changes: watch::Sender<u64>,
}

impl Default for HealthReporter {
    fn default() -> Self {
        HealthReporter::new()
    }
}

impl HealthReporter {
    /// A reporter whose server as a whole (`""`) is `SERVING`.
    pub fn new() -> HealthReporter {
        let mut statuses = HashMap::new();
        statuses.insert(String::new(), ServingStatus::Serving);
        HealthReporter {
            shared: Arc::new(Shared {
                statuses: Mutex::new(statuses),
                changes: watch::channel(0).0,
            }),
        }
    }

    /// The health service that answers from this reporter.
    pub fn service(&self) -> proto::health_server::HealthServer<HealthService> {
        proto::health_server::HealthServer::new(HealthService {
            reporter: self.clone(),
        })
    }

    /// `service` is serving.
    pub fn set_serving(&self, service: &str) {
        self.set_status(service, ServingStatus::Serving);
    }

    /// `service` is not serving (`""`: the whole server, e.g. while it
    /// drains before a shutdown).
    pub fn set_not_serving(&self, service: &str) {
        self.set_status(service, ServingStatus::NotServing);
    }

    /// Sets `service`'s status; watchers of it hear the change.
    pub fn set_status(&self, service: &str, status: ServingStatus) {
        self.lock().insert(service.to_owned(), status);
        self.shared
            .changes
            .send_modify(|generation| *generation += 1);
    }

    /// Forgets `service`: a check of it is `NOT_FOUND` again.
    pub fn clear(&self, service: &str) {
        self.lock().remove(service);
        self.shared
            .changes
            .send_modify(|generation| *generation += 1);
    }

    /// `service`'s status, if it has one.
    pub fn status(&self, service: &str) -> Option<ServingStatus> {
        self.lock().get(service).copied()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, ServingStatus>> {
        self.shared
            .statuses
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }
}

/// The health service (made by [`HealthReporter::service`]).
#[derive(Debug, Clone)]
pub struct HealthService {
    reporter: HealthReporter,
}

type StatusStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

fn checked_name(request: &HealthCheckRequest) -> Result<String, Status> {
    if request.service.len() > MAX_SERVICE_NAME {
        return Err(Status::invalid_argument(format!(
            "service name of {} bytes; at most {MAX_SERVICE_NAME}",
            request.service.len()
        )));
    }
    Ok(request.service.clone())
}

impl proto::health_server::Health for HealthService {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        let service = checked_name(request.get_ref())?;
        match self.reporter.status(&service) {
            Some(status) => Ok(Response::new(HealthCheckResponse {
                status: status as i32,
            })),
            None => Err(Status::not_found(format!(
                "no health status for service {service:?}"
            ))),
        }
    }

    async fn list(
        &self,
        _request: Request<HealthListRequest>,
    ) -> Result<Response<HealthListResponse>, Status> {
        let statuses: BTreeMap<_, _> = self
            .reporter
            .lock()
            .iter()
            .map(|(name, status)| {
                (
                    name.clone(),
                    HealthCheckResponse {
                        status: *status as i32,
                    },
                )
            })
            .collect();
        Ok(Response::new(HealthListResponse {
            statuses: statuses.into_iter().collect(),
        }))
    }

    type WatchStream = StatusStream;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let service = checked_name(request.get_ref())?;
        let reporter = self.reporter.clone();
        let changes = reporter.shared.changes.subscribe();
        // The status now, then each change of it (not of other services).
        let statuses = futures_util::stream::unfold(
            (reporter, changes, service, None),
            |(reporter, mut changes, service, last)| async move {
                loop {
                    changes.borrow_and_update();
                    let now = reporter
                        .status(&service)
                        .unwrap_or(ServingStatus::ServiceUnknown);
                    if last != Some(now) {
                        let response = HealthCheckResponse { status: now as i32 };
                        return Some((Ok(response), (reporter, changes, service, Some(now))));
                    }
                    changes.changed().await.ok()?;
                }
            },
        );
        Ok(Response::new(Box::pin(statuses)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use proto::health_server::Health;

    #[tokio::test]
    async fn check_list_and_watch_follow_the_reporter() {
        let reporter = HealthReporter::new();
        let service = HealthService {
            reporter: reporter.clone(),
        };
        let ask = |name: &str| {
            Request::new(HealthCheckRequest {
                service: name.into(),
            })
        };
        let whole = service.check(ask("")).await.unwrap().into_inner();
        assert_eq!(whole.status, ServingStatus::Serving as i32);
        let unknown = service.check(ask("echo.v1.Echo")).await.unwrap_err();
        assert_eq!(unknown.code(), rpc_core::Code::NotFound);

        let mut watch = service
            .watch(ask("echo.v1.Echo"))
            .await
            .unwrap()
            .into_inner();
        let first = watch.next().await.unwrap().unwrap();
        assert_eq!(first.status, ServingStatus::ServiceUnknown as i32);
        // Another service's change is not this watcher's.
        reporter.set_serving("other.v1.Other");
        reporter.set_serving("echo.v1.Echo");
        let next = watch.next().await.unwrap().unwrap();
        assert_eq!(next.status, ServingStatus::Serving as i32);
        reporter.set_not_serving("echo.v1.Echo");
        let next = watch.next().await.unwrap().unwrap();
        assert_eq!(next.status, ServingStatus::NotServing as i32);

        let list = service
            .list(Request::new(HealthListRequest {}))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(list.statuses.len(), 3);
        assert_eq!(
            list.statuses["echo.v1.Echo"].status,
            ServingStatus::NotServing as i32
        );
        reporter.clear("echo.v1.Echo");
        assert!(service.check(ask("echo.v1.Echo")).await.is_err());
        let long = "x".repeat(MAX_SERVICE_NAME + 1);
        assert_eq!(
            service.check(ask(&long)).await.unwrap_err().code(),
            rpc_core::Code::InvalidArgument
        );
    }
}
