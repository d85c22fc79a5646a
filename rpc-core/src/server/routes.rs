//! [`Routes`]: dispatch by `/package.Service/Method` to the added services.

use std::collections::HashMap;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::future::{self, BoxFuture, FutureExt};
use tower::util::BoxCloneSyncService;
use tower_service::Service;

use crate::payload::Payload;
use crate::request::{Request, Response};
use crate::status::{BoxError, Status};

/// The response of a routable service: its message already encoded, as one
/// buffer (`Response<Bytes>`) or as parts (`Response<Payload>`, what
/// generated servers return so a large field is sent where it lies).
pub trait EncodedResponse: Send + 'static {
    /// The response with its message as a [`Payload`].
    fn into_payload(self) -> Response<Payload>;
}

impl EncodedResponse for Response<Bytes> {
    fn into_payload(self) -> Response<Payload> {
        self.map(Payload::from)
    }
}

impl EncodedResponse for Response<Payload> {
    fn into_payload(self) -> Response<Payload> {
        self
    }
}

/// A service the [`crate::Server`] can route to: its full name
/// (`package.Service`) picks the requests it gets. Generated servers implement it.
pub trait NamedService {
    /// `package.Service`, as in the method paths `/package.Service/Method`.
    const NAME: &'static str;
}

/// What [`crate::Server::add_service`] accepts: a named tower service of
/// encoded requests and responses (generated `FooServer`s are). Implemented for every type
/// that fits; never implement it by hand.
pub trait RoutableService:
    Service<
        Request<Bytes>,
        Response: EncodedResponse,
        Error: Into<BoxError>,
        Future: Send + 'static,
    > + NamedService
    + Clone
    + Send
    + Sync
    + 'static
{
}

impl<S> RoutableService for S where
    S: Service<
            Request<Bytes>,
            Response: EncodedResponse,
            Error: Into<BoxError>,
            Future: Send + 'static,
        > + NamedService
        + Clone
        + Send
        + Sync
        + 'static
{
}

type RouteService = BoxCloneSyncService<Request<Bytes>, Response<Payload>, Status>;

/// The routing table: service name → service. It is itself the innermost
/// service of the server's tower stack.
#[derive(Clone, Default)]
pub struct Routes {
    services: Arc<HashMap<&'static str, RouteService>>,
}

impl std::fmt::Debug for Routes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.services.keys()).finish()
    }
}

impl Routes {
    /// Adds `service`, replacing one with the same name.
    pub fn add_service<S: RoutableService>(&mut self, service: S) {
        let service =
            tower::ServiceExt::map_err(service, |error: S::Error| Status::from_error(error.into()));
        let service = tower::ServiceExt::map_response(service, EncodedResponse::into_payload);
        Arc::make_mut(&mut self.services).insert(S::NAME, BoxCloneSyncService::new(service));
    }

    /// Names of the services routed to.
    pub fn service_names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.services.keys().copied()
    }
}

/// Splits `/package.Service/Method` into its two names.
pub(crate) fn split_path(path: &str) -> Option<(&str, &str)> {
    let (service, method) = path.strip_prefix('/')?.split_once('/')?;
    (!service.is_empty() && !method.is_empty() && !method.contains('/'))
        .then_some((service, method))
}

impl Service<Request<Bytes>> for Routes {
    type Response = Response<Payload>;
    type Error = Status;
    type Future = BoxFuture<'static, Result<Response<Payload>, Status>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Bytes>) -> Self::Future {
        let path = request.method().unwrap_or_default();
        let Some((service_name, _)) = split_path(path) else {
            let status = Status::unimplemented(format!("malformed method path {path:?}"));
            return future::ready(Err(status)).boxed();
        };
        match self.services.get(service_name) {
            Some(service) => tower::ServiceExt::oneshot(service.clone(), request).boxed(),
            None => {
                let status = Status::unimplemented(format!("unknown service {service_name}"));
                future::ready(Err(status)).boxed()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_path_accepts_only_two_names() {
        assert_eq!(split_path("/pkg.Svc/Get"), Some(("pkg.Svc", "Get")));
        for bad in ["", "/", "pkg.Svc/Get", "/pkg.Svc/", "//Get", "/a/b/c"] {
            assert_eq!(split_path(bad), None, "{bad}");
        }
    }
}
