//! [`HttpLayer`]: tower-http's layers (and any tower layer over
//! `http::Request`) in front of an rdma-rpc [`Server`](rpc_core::Server)'s
//! calls, on every transport.
//!
//! tonic's server hands its layers the HTTP/2 request; rdma-rpc's server
//! hands its layers an [`rpc_core::Request`], whatever the transport
//! (`grpc://`, `rdma://`, `tcp://`, `mem://`). `HttpLayer` runs an HTTP
//! stack between the two: each call is shown to it as the request a gRPC
//! client would have sent — `POST` to the method's path, its metadata as
//! headers (`-bin` ones base64), `grpc-timeout`, `content-type:
//! application/grpc`, its extensions (the server's [`rpc_core::PeerInfo`]
//! among them) — and the handler's answer comes back through it as the
//! response head gRPC would send (status 200, `content-type`, the response
//! metadata; a failed call as a trailers-only response with `grpc-status`
//! and `grpc-message`). So the layers that work on heads work as they do
//! under tonic:
//!
//! - tracing (`TraceLayer::new_for_grpc()`: a span per call, its status
//!   classified by `grpc-status`),
//! - authentication and authorization (`ValidateRequestHeaderLayer`,
//!   `AsyncRequireAuthorizationLayer`): an answer of their own, such as
//!   `401 Unauthorized`, ends the call with the status gRPC maps it to
//!   (`UNAUTHENTICATED`; `grpc-status` in their answer wins),
//! - headers (`SetRequestHeaderLayer`, `SetResponseHeaderLayer`,
//!   `PropagateHeaderLayer`, request ids): a header a layer adds or changes is
//!   metadata to the handler (request side) or to the client (response
//!   side); an extension a layer inserts reaches the handler's
//!   [`rpc_core::Request::extensions`].
//!
//! What such a stack does not see are the messages: the request it gets has
//! an empty body ([`HttpLayerBody`]) and the body of its response is not
//! sent. Layers that transform bodies (tower-http's compression, body
//! limits) therefore do nothing here; rdma-rpc has its own for both
//! (`grpc-encoding` on `grpc://`, [`rpc_core::Server::max_frame_len`]). The
//! method's path is the request URI's: a layer that rewrites it routes the
//! call elsewhere.
//!
//! ```
//! # fn demo<L, S>(http_layers: L, service: S) -> rpc_core::Server<impl Sized>
//! # where L: Clone {
//! // e.g. `tower::ServiceBuilder::new().layer(TraceLayer::new_for_grpc())
//! //         .layer(ValidateRequestHeaderLayer::custom(..))`
//! rpc_core::Server::builder().layer(rpc_grpc::HttpLayer::new(http_layers))
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use rpc_core::metadata::{Metadata, parse_grpc_timeout};
use rpc_core::{BoxError, Payload, Request, Response, Status};
use tower_layer::Layer;
use tower_service::Service;

use crate::wire;

/// The body of the HTTP request an [`HttpLayer`]'s stack sees: empty (the
/// call's messages do not pass through it).
pub type HttpLayerBody = http_body_util::Empty<Bytes>;

/// A tower layer that runs an HTTP layer stack (`L`, e.g. tower-http's)
/// around every call of the rdma-rpc services it wraps (see the module
/// docs). Put it in a [`rpc_core::Server`] with `.layer(HttpLayer::new(..))`.
#[derive(Clone)]
pub struct HttpLayer<L> {
    http: L,
}

impl<L> HttpLayer<L> {
    /// Runs `http` (a tower layer over `http::Request<HttpLayerBody>`
    /// services) around each call.
    pub fn new(http: L) -> HttpLayer<L> {
        HttpLayer { http }
    }
}

impl<L> fmt::Debug for HttpLayer<L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpLayer").finish_non_exhaustive()
    }
}

impl<S, L> Layer<S> for HttpLayer<L>
where
    L: Layer<CallService<S>>,
{
    type Service = HttpLayered<L::Service>;

    fn layer(&self, inner: S) -> Self::Service {
        HttpLayered {
            http: self.http.layer(CallService { inner }),
        }
    }
}

/// What one call's HTTP request and the service at the bottom of the stack
/// hand each other: the rdma-rpc request going in, its answer coming out.
#[derive(Default)]
struct Exchange {
    /// The call, until [`CallService`] takes it.
    request: Option<Request<Bytes>>,
    /// The metadata entries HTTP headers cannot carry (keys gRPC reserves,
    /// such as `grpc-encoding`): kept aside, put back.
    request_reserved: Metadata,
    /// The handler's answer, once it gave one.
    answer: Option<Result<Response<Payload>, Status>>,
}

/// The [`Exchange`] of one call, in its HTTP request's extensions.
#[derive(Clone, Default)]
struct ExchangeSlot(Arc<Mutex<Exchange>>);

impl ExchangeSlot {
    fn lock(&self) -> MutexGuard<'_, Exchange> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The rdma-rpc service seen from inside an [`HttpLayer`]'s stack (the
/// innermost service the HTTP layers wrap): takes the call back out of the
/// HTTP request, with what the layers changed, and answers with the
/// response head gRPC would send.
#[derive(Clone, Debug)]
pub struct CallService<S> {
    inner: S,
}

impl<S, B> Service<http::Request<B>> for CallService<S>
where
    S: Service<Request<Bytes>, Response = Response<Payload>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = http::Response<HttpLayerBody>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let (mut parts, _) = request.into_parts();
        let Some(slot) = parts.extensions.remove::<ExchangeSlot>() else {
            return Box::pin(std::future::ready(Err(BoxError::from(Status::internal(
                "an HTTP layer's request reached the rdma-rpc service without its call \
                 (a layer built a new request instead of passing this one on)",
            )))));
        };
        let (call, reserved) = {
            let mut exchange = slot.lock();
            (
                exchange.request.take(),
                std::mem::take(&mut exchange.request_reserved),
            )
        };
        let Some(mut call) = call else {
            return Box::pin(std::future::ready(Err(BoxError::from(Status::internal(
                "an HTTP layer called the rdma-rpc service twice for one call",
            )))));
        };
        let mut metadata = wire::metadata_from_headers(&parts.headers);
        metadata.extend(reserved);
        *call.metadata_mut() = metadata;
        if let Some(timeout) = parts
            .headers
            .get("grpc-timeout")
            .and_then(|value| value.to_str().ok())
            .and_then(parse_grpc_timeout)
        {
            call.set_timeout(timeout);
        }
        call.set_method(parts.uri.path().to_owned());
        // The layers' extensions join the call's (moved into the request on
        // the way in).
        *call.extensions_mut() = std::mem::take(&mut parts.extensions);
        let answered = self.inner.call(call);
        Box::pin(async move {
            let answer = answered
                .await
                .map_err(|error| Status::from_error(error.into()));
            let mut head = http::Response::new(HttpLayerBody::new());
            head.headers_mut()
                .insert(http::header::CONTENT_TYPE, grpc_content_type());
            match &answer {
                Ok(response) => {
                    wire::metadata_into_headers(response.metadata(), head.headers_mut())
                }
                Err(status) => {
                    head.headers_mut().extend(wire::trailers(
                        status.code(),
                        status.message(),
                        status.metadata(),
                    ));
                }
            }
            slot.lock().answer = Some(answer);
            Ok(head)
        })
    }
}

/// An rdma-rpc service behind an HTTP layer stack (what [`HttpLayer`] makes).
#[derive(Clone, Debug)]
pub struct HttpLayered<H> {
    http: H,
}

impl<H, ResponseBody> Service<Request<Bytes>> for HttpLayered<H>
where
    H: Service<http::Request<HttpLayerBody>, Response = http::Response<ResponseBody>>,
    H::Error: Into<BoxError>,
    H::Future: Send + 'static,
    ResponseBody: http_body::Body + Send + 'static,
{
    type Response = Response<Payload>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Payload>, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.http.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut call: Request<Bytes>) -> Self::Future {
        let mut head = http::Request::new(HttpLayerBody::new());
        *head.method_mut() = http::Method::POST;
        match call.method().map(str::parse::<http::Uri>) {
            Some(Ok(uri)) => *head.uri_mut() = uri,
            _ => {
                let status = Status::unimplemented(format!(
                    "method path {:?} is not a URI path",
                    call.method().unwrap_or("")
                ));
                return Box::pin(std::future::ready(Err(BoxError::from(status))));
            }
        }
        *head.version_mut() = http::Version::HTTP_2;
        let headers = head.headers_mut();
        headers.insert(http::header::CONTENT_TYPE, grpc_content_type());
        headers.insert(http::header::TE, HeaderValue::from_static("trailers"));
        if let Some(timeout) = call.timeout() {
            if let Ok(value) = HeaderValue::from_str(&wire::encode_timeout(timeout)) {
                headers.insert("grpc-timeout", value);
            }
        }
        wire::metadata_into_headers(call.metadata(), headers);
        let slot = ExchangeSlot::default();
        {
            let mut exchange = slot.lock();
            exchange.request_reserved = reserved_entries(call.metadata());
            *head.extensions_mut() = std::mem::take(call.extensions_mut());
            exchange.request = Some(call);
        }
        head.extensions_mut().insert(slot.clone());
        let responded = self.http.call(head);
        Box::pin(async move {
            let http_response = responded.await.map_err(Into::into)?;
            let answer = slot.lock().answer.take();
            let (parts, body) = http_response.into_parts();
            // The body is empty (or a layer's refusal text): read to its
            // end all the same, so that layers watching for it (tower-http's
            // trace classifies a call there when its head has no
            // grpc-status) see the call end.
            let mut body = std::pin::pin!(body);
            while let Some(Ok(_)) = http_body_util::BodyExt::frame(&mut body).await {}
            match answer {
                Some(Ok(mut response)) => {
                    let kept = reserved_entries(response.metadata());
                    let mut metadata = wire::metadata_from_headers(&parts.headers);
                    metadata.extend(kept);
                    *response.metadata_mut() = metadata;
                    let mut extensions = parts.extensions;
                    extensions.extend(std::mem::take(response.extensions_mut()));
                    *response.extensions_mut() = extensions;
                    Ok(response)
                }
                Some(Err(status)) => Err(BoxError::from(status)),
                // A layer answered by itself (a refusal).
                None => Err(BoxError::from(refusal_status(parts.status, &parts.headers))),
            }
        })
    }
}

/// `application/grpc`.
fn grpc_content_type() -> HeaderValue {
    HeaderValue::from_static("application/grpc")
}

/// The entries of `metadata` that HTTP headers cannot carry through the
/// stack: keys gRPC reserves.
fn reserved_entries(metadata: &Metadata) -> Metadata {
    let mut kept = Metadata::new();
    for (key, value) in metadata.iter() {
        if wire::is_reserved(key) {
            let _ = match value {
                rpc_core::metadata::MetadataValue::Ascii(_) => {
                    value.to_str().map(|text| kept.append(key, text))
                }
                rpc_core::metadata::MetadataValue::Binary(bytes) => {
                    Some(kept.append_bin(key, bytes.clone()))
                }
            };
        }
    }
    kept
}

/// The status of a call an HTTP layer answered itself: its `grpc-status`
/// if it gave one, else what gRPC maps its HTTP status to.
fn refusal_status(status: StatusCode, headers: &HeaderMap) -> Status {
    if let Some(status) = wire::status_from_trailers(headers) {
        return status;
    }
    if status == StatusCode::OK {
        return Status::internal(
            "an HTTP layer answered the call without passing it on, and without a grpc-status",
        );
    }
    let mapped = wire::status_from_http(status);
    Status::new(
        mapped.code(),
        format!("refused by an HTTP layer with HTTP {status}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use rpc_core::Code;

    /// The inner rdma-rpc service: answers with the metadata, method,
    /// timeout and extensions it saw.
    #[derive(Clone)]
    struct Mirror;

    impl Service<Request<Bytes>> for Mirror {
        type Response = Response<Payload>;
        type Error = Status;
        type Future = std::future::Ready<Result<Response<Payload>, Status>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: Request<Bytes>) -> Self::Future {
            if request.metadata().get("x-fail").is_some() {
                return std::future::ready(Err(Status::permission_denied("told to fail")));
            }
            let mut response = Response::new(Payload::from(request.get_ref().clone()));
            let seen = format!(
                "{} {:?} {:?} {:?} {:?}",
                request.method().unwrap_or(""),
                request.metadata().get("x-added"),
                request.metadata().get("grpc-encoding"),
                request.timeout(),
                request.extensions().get::<&'static str>(),
            );
            response.metadata_mut().insert("x-seen", &seen).unwrap();
            std::future::ready(Ok(response))
        }
    }

    /// An HTTP layer written by hand (as tower-http's are): adds a request
    /// header and an extension, refuses requests without `authorization`
    /// with 401, and adds a response header.
    #[derive(Clone)]
    struct Gate<S>(S);

    impl<S, B> Service<http::Request<B>> for Gate<S>
    where
        S: Service<http::Request<B>, Response = http::Response<HttpLayerBody>>,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
    {
        type Response = http::Response<HttpLayerBody>;
        type Error = S::Error;
        type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

        fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
            self.0.poll_ready(cx)
        }

        fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
            if !request.headers().contains_key("authorization") {
                let mut refusal = http::Response::new(HttpLayerBody::new());
                *refusal.status_mut() = StatusCode::UNAUTHORIZED;
                return Box::pin(std::future::ready(Ok(refusal)));
            }
            request
                .headers_mut()
                .insert("x-added", HeaderValue::from_static("by-the-gate"));
            request.extensions_mut().insert("gate-extension");
            let called = self.0.call(request);
            Box::pin(async move {
                let mut response = called.await?;
                response
                    .headers_mut()
                    .insert("x-gate", HeaderValue::from_static("passed"));
                Ok(response)
            })
        }
    }

    fn gated() -> HttpLayered<Gate<CallService<Mirror>>> {
        HttpLayer::new(tower_layer::layer_fn(Gate)).layer(Mirror)
    }

    fn call(authorized: bool) -> Request<Bytes> {
        let mut request = Request::new(Bytes::from_static(b"hi"));
        request.set_method("/pkg.Svc/Method");
        request.set_timeout(std::time::Duration::from_millis(1500));
        request
            .metadata_mut()
            .insert("grpc-encoding", "gzip")
            .unwrap();
        if authorized {
            request
                .metadata_mut()
                .insert("authorization", "Bearer x")
                .unwrap();
        }
        request
    }

    #[tokio::test]
    async fn headers_and_extensions_a_layer_adds_reach_the_handler_and_the_response() {
        let response = gated().call(call(true)).await.expect("answered");
        assert_eq!(
            response.metadata().get("x-seen"),
            Some(
                "/pkg.Svc/Method Some(\"by-the-gate\") Some(\"gzip\") Some(1.5s) Some(\"gate-extension\")"
            ),
            "method, the layer's header, the reserved entry, the timeout and the layer's extension"
        );
        assert_eq!(response.metadata().get("x-gate"), Some("passed"));
        assert_eq!(
            response.into_inner().into_contiguous(),
            Bytes::from_static(b"hi")
        );
    }

    #[tokio::test]
    async fn a_layers_own_answer_ends_the_call_with_the_status_grpc_maps_it_to() {
        let error = gated().call(call(false)).await.expect_err("refused");
        let status = error.downcast::<Status>().expect("a Status");
        assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
        assert!(status.message().contains("401"), "{status:?}");
    }

    #[tokio::test]
    async fn a_handlers_failure_passes_through_unchanged() {
        let mut request = call(true);
        request.metadata_mut().insert("x-fail", "1").unwrap();
        let error = gated().call(request).await.expect_err("failed");
        let status = error.downcast::<Status>().expect("a Status");
        assert_eq!(status.code(), Code::PermissionDenied);
        assert_eq!(status.message(), "told to fail");
    }
}
