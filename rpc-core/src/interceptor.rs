//! [`Interceptor`]: a function over a call's metadata that may change it or
//! refuse the call, on the client or the server, over every transport.
//!
//! As in tonic, an interceptor sees the request without its message
//! (`Request<()>`): metadata, method path, timeout and extensions (on the
//! server, [`crate::PeerInfo`]). It returns the request, changed or not, or a
//! [`Status`] that ends the call there: on the client the call fails with it
//! before anything is sent; on the server the handler never runs and the
//! client gets it.
//!
//! ```
//! use rpc_core::interceptor::InterceptedService;
//! use rpc_core::{Request, Status};
//!
//! /// Refuses calls without the right bearer token.
//! fn check_token(request: Request<()>) -> Result<Request<()>, Status> {
//!     match request.metadata().get("authorization") {
//!         Some(token) if token == "Bearer let-me-in" => Ok(request),
//!         _ => Err(Status::unauthenticated("a valid bearer token is required")),
//!     }
//! }
//!
//! # fn wrap<S>(service: S) -> InterceptedService<S, fn(Request<()>) -> Result<Request<()>, Status>> {
//! // Around one generated service (`FooServer::with_interceptor` does the same),
//! // or around every route with `Server::builder().layer(InterceptorLayer::new(check_token))`.
//! InterceptedService::new(service, check_token)
//! # }
//! ```
//!
//! Generated clients have `FooClient::with_interceptor(channel, f)`, generated
//! servers `FooServer::with_interceptor(service, f)`; [`InterceptorLayer`] puts
//! one in any tower stack (`Server::builder().layer(..)`, a
//! `tower::ServiceBuilder` over a `Channel`). Interceptors run in the order
//! the layers are stacked, outermost first.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use pin_project_lite::pin_project;
use tower::Layer;
use tower_service::Service;

use crate::request::Request;
use crate::server::NamedService;
use crate::status::{BoxError, Status};

/// Sees (and may change) a request's metadata before the call goes on, or
/// refuses it with a [`Status`]. Implemented for every
/// `FnMut(Request<()>) -> Result<Request<()>, Status>`.
pub trait Interceptor {
    /// The request without its message; `Err` ends the call with that status.
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status>;
}

impl<F> Interceptor for F
where
    F: FnMut(Request<()>) -> Result<Request<()>, Status>,
{
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        self(request)
    }
}

/// A service that runs an [`Interceptor`] before each call of `inner`.
#[derive(Clone)]
pub struct InterceptedService<S, F> {
    inner: S,
    interceptor: F,
}

impl<S, F> InterceptedService<S, F> {
    /// Runs `interceptor` before every call of `inner`.
    pub fn new(inner: S, interceptor: F) -> InterceptedService<S, F> {
        InterceptedService { inner, interceptor }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Unwraps the service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: fmt::Debug, F> fmt::Debug for InterceptedService<S, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InterceptedService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S: NamedService, F> NamedService for InterceptedService<S, F> {
    const NAME: &'static str = S::NAME;
}

impl<S, F, B> Service<Request<B>> for InterceptedService<S, F>
where
    S: Service<Request<B>>,
    S::Error: Into<BoxError>,
    F: Interceptor,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let mut message = None;
        let head = request.map(|body| message = Some(body));
        match self.interceptor.call(head) {
            Ok(head) => {
                let request = head.map(|()| message.take().expect("taken by the map above"));
                ResponseFuture::called(self.inner.call(request))
            }
            Err(status) => ResponseFuture::refused(status),
        }
    }
}

pin_project! {
    /// The response of an [`InterceptedService`]: the inner service's, or the
    /// interceptor's refusal.
    pub struct ResponseFuture<Fut> {
        // The inner call; `None` when the interceptor refused it.
        #[pin]
        called: Option<Fut>,
        refused: Option<Status>,
    }
}

impl<Fut> ResponseFuture<Fut> {
    fn called(future: Fut) -> ResponseFuture<Fut> {
        ResponseFuture {
            called: Some(future),
            refused: None,
        }
    }

    fn refused(status: Status) -> ResponseFuture<Fut> {
        ResponseFuture {
            called: None,
            refused: Some(status),
        }
    }
}

impl<Fut, T, E> Future for ResponseFuture<Fut>
where
    Fut: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        match this.called.as_pin_mut() {
            Some(future) => future.poll(cx).map_err(Into::into),
            None => Poll::Ready(Err(Box::new(
                this.refused
                    .take()
                    .expect("a refused call's future polled after it completed"),
            ))),
        }
    }
}

/// A tower layer that wraps services in [`InterceptedService`]s.
#[derive(Clone)]
pub struct InterceptorLayer<F> {
    interceptor: F,
}

impl<F> InterceptorLayer<F> {
    /// Runs `interceptor` before every call of the services it wraps.
    pub fn new(interceptor: F) -> InterceptorLayer<F> {
        InterceptorLayer { interceptor }
    }
}

impl<F> fmt::Debug for InterceptorLayer<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InterceptorLayer").finish_non_exhaustive()
    }
}

impl<S, F: Clone> Layer<S> for InterceptorLayer<F> {
    type Service = InterceptedService<S, F>;

    fn layer(&self, inner: S) -> Self::Service {
        InterceptedService::new(inner, self.interceptor.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Response;

    /// An inner service that answers with the metadata value `seen` it got.
    #[derive(Clone)]
    struct Echo;

    impl Service<Request<u32>> for Echo {
        type Response = Response<String>;
        type Error = Status;
        type Future = std::future::Ready<Result<Response<String>, Status>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: Request<u32>) -> Self::Future {
            let seen = request.metadata().get("seen").unwrap_or("none").to_owned();
            std::future::ready(Ok(Response::new(format!(
                "{seen} {}",
                request.into_inner()
            ))))
        }
    }

    #[tokio::test]
    async fn an_interceptor_changes_metadata_keeps_the_message_or_refuses() {
        use tower::ServiceExt;
        let mut calls = 0;
        let mut service = InterceptedService::new(Echo, move |mut request: Request<()>| {
            calls += 1;
            if request.metadata().get("deny").is_some() {
                return Err(Status::permission_denied(format!("call {calls} refused")));
            }
            request
                .metadata_mut()
                .insert("seen", &format!("call {calls}"))
                .map_err(|error| Status::internal(error.to_string()))?;
            Ok(request)
        });
        let answer = (&mut service).oneshot(Request::new(7)).await.unwrap();
        assert_eq!(answer.into_inner(), "call 1 7");

        let mut denied = Request::new(8);
        denied.metadata_mut().insert("deny", "yes").unwrap();
        let error = (&mut service).oneshot(denied).await.unwrap_err();
        let status = Status::from_error(error);
        assert_eq!(status.code(), crate::Code::PermissionDenied);
        assert_eq!(status.message(), "call 2 refused");

        // Through a layer, with the method path and timeout kept.
        let layered = InterceptorLayer::new(|request: Request<()>| {
            assert_eq!(request.method(), Some("/a.B/C"));
            assert_eq!(request.timeout(), Some(std::time::Duration::from_secs(3)));
            Ok(request)
        })
        .layer(Echo);
        let mut request = Request::new(9);
        request.set_method("/a.B/C");
        request.set_timeout(std::time::Duration::from_secs(3));
        let answer = layered.oneshot(request).await.unwrap();
        assert_eq!(answer.into_inner(), "none 9");
    }
}
