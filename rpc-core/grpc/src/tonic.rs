//! tonic over rdma-rpc's transports (feature `tonic`): keep the code
//! `tonic-build` generated, swap the transport.
//!
//! - [`TonicChannel`] is a `tonic::client::GrpcService`: a tonic generated
//!   client built on it (`GreeterClient::new(TonicChannel::new(channel))`)
//!   carries its calls over any rdma-rpc [`Channel`] (`rdma://`, `tcp://`,
//!   `mem://`, `grpc://`).
//! - [`TonicService`] wraps a tonic generated server (`GreeterServer::new(..)`)
//!   so that an rdma-rpc [`rpc_core::Server`] serves it on any endpoint, next
//!   to or instead of tonic's own HTTP/2 listener.
//!
//! Both translate between tonic's HTTP/2-shaped requests (headers, a body of
//! length-prefixed messages, trailers) and rdma-rpc calls in process, with
//! no HTTP/2 on the wire. Every kind of rpc works: tonic's requests do not
//! say a method's kind, so [`TonicChannel`] opens every call as a stream of
//! unknown kind ([`KindUnknown`]), which a unary method serves as one message
//! each way.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use futures_util::{Stream, StreamExt};
use http::{HeaderMap, HeaderValue, StatusCode};
use http_body::Frame as BodyFrame;
use http_body_util::{BodyExt, StreamBody};
use rpc_core::stream::{KindUnknown, ServerStream, Streaming};
use rpc_core::{Channel, Code, Payload, Request, Response, Status};

use crate::wire::{self, Deframer};

/// A tonic `GrpcService` over an rdma-rpc [`Channel`] (see the module docs).
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// # mod greeter_client { pub struct GreeterClient<T>(T); impl<T> GreeterClient<T> { pub fn new(t: T) -> Self { Self(t) } } }
/// rpc_transport_rdma::register()?;
/// let channel = rpc_core::Channel::connect("rdma://10.0.0.7:50051").await?;
/// // tonic-build's client, unchanged:
/// let client = greeter_client::GreeterClient::new(rpc_grpc::tonic::TonicChannel::new(channel));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct TonicChannel {
    channel: Channel,
}

impl TonicChannel {
    /// Carries tonic's calls over `channel`.
    pub fn new(channel: Channel) -> TonicChannel {
        TonicChannel { channel }
    }
}

type ResponseFuture =
    Pin<Box<dyn Future<Output = Result<http::Response<tonic::body::Body>, Infallible>> + Send>>;

impl tower_service::Service<http::Request<tonic::body::Body>> for TonicChannel {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // The Channel queues and pushes back per call.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> ResponseFuture {
        let channel = self.channel.clone();
        Box::pin(async move {
            let response = match call_over(channel, request).await {
                Ok(response) => response,
                Err(status) => trailers_only_response(&status),
            };
            Ok(response)
        })
    }
}

/// One tonic call as an rdma-rpc streaming call of unknown kind.
async fn call_over(
    channel: Channel,
    request: http::Request<tonic::body::Body>,
) -> Result<http::Response<tonic::body::Body>, Status> {
    let (parts, body) = request.into_parts();
    let messages = request_messages(body);
    let mut call = Request::new(messages);
    call.set_method(parts.uri.path().to_owned());
    *call.metadata_mut() = wire::metadata_from_headers(&parts.headers);
    if let Some(timeout) = parts
        .headers
        .get("grpc-timeout")
        .and_then(wire::parse_timeout)
    {
        call.set_timeout(timeout);
    }
    call.extensions_mut().insert(KindUnknown);
    let response = channel.streaming(call).await?;
    let (metadata, answers) = response.into_parts();
    let mut response = http::Response::new(tonic::body::Body::new(response_body(answers)));
    let headers = response.headers_mut();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(wire::CONTENT_TYPE),
    );
    wire::metadata_into_headers(&metadata, headers);
    Ok(response)
}

/// tonic's request body → the messages in it. A body that breaks (or is
/// not gRPC) ends the stream early: the server sees fewer messages, and
/// tonic's own side has reported its error.
fn request_messages(body: tonic::body::Body) -> impl Stream<Item = Payload> + Send + 'static {
    let deframer = Deframer::new(usize::MAX);
    // Boxed: the unfold moves its state through every message's future.
    futures_util::stream::unfold(Box::new((body, deframer, false)), |mut state| async move {
        let (body, deframer, done) = &mut *state;
        loop {
            match deframer.next_message() {
                Ok(Some(message)) => {
                    return Some((Payload::from(message), state));
                }
                Ok(None) if *done => return None,
                Ok(None) => {}
                Err(error) => {
                    tracing::debug!(%error, "grpc: tonic request body is not gRPC");
                    return None;
                }
            }
            match body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        deframer.push(data);
                    }
                }
                Some(Err(status)) => {
                    tracing::debug!(%status, "grpc: tonic request body failed");
                    return None;
                }
                None => *done = true,
            }
        }
    })
}

/// The server's messages and final status → an HTTP body of
/// length-prefixed messages and trailers.
fn response_body(
    answers: Streaming<Bytes>,
) -> StreamBody<impl Stream<Item = Result<BodyFrame<Bytes>, Status>> + Send + 'static> {
    let frames = futures_util::stream::unfold(Some(answers), |answers| async move {
        let mut answers = answers?;
        let frame = match answers.next().await {
            Some(Ok(message)) => {
                let mut data = BytesMut::new();
                wire::frame_message(&message, &mut data);
                return Some((Ok(BodyFrame::data(data.freeze())), Some(answers)));
            }
            Some(Err(status)) => BodyFrame::trailers(wire::trailers(
                status.code(),
                status.message(),
                status.metadata(),
            )),
            None => {
                let trailers = answers.trailers().unwrap_or_default();
                BodyFrame::trailers(wire::trailers(Code::Ok, "", &trailers))
            }
        };
        Some((Ok(frame), None))
    });
    StreamBody::new(frames)
}

/// A response that is only the status, as gRPC's trailers-only responses are.
fn trailers_only_response(status: &Status) -> http::Response<tonic::body::Body> {
    let mut response = http::Response::new(tonic::body::Body::empty());
    let headers = response.headers_mut();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(wire::CONTENT_TYPE),
    );
    headers.extend(wire::trailers(
        status.code(),
        status.message(),
        status.metadata(),
    ));
    response
}

/// A tonic generated server served by an rdma-rpc [`rpc_core::Server`]
/// (see the module docs).
///
/// ```no_run
/// # async fn demo<S>(greeter: S) -> Result<(), Box<dyn std::error::Error>>
/// # where S: tower_service::Service<http::Request<http_body_util::combinators::UnsyncBoxBody<bytes::Bytes, tonic::Status>>, Response = http::Response<tonic::body::Body>, Error = std::convert::Infallible>
/// #   + tonic::server::NamedService + Clone + Send + Sync + 'static, S::Future: Send + 'static {
/// rpc_transport_rdma::register()?;
/// rpc_core::Server::builder()
///     // tonic-build's server, unchanged: `GreeterServer::new(MyGreeter)`.
///     .add_service(rpc_grpc::tonic::TonicService::new(greeter))
///     .serve("rdma://0.0.0.0:50051")
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct TonicService<S> {
    inner: S,
}

impl<S> TonicService<S> {
    /// Serves `inner`, a tonic generated server.
    pub fn new(inner: S) -> TonicService<S> {
        TonicService { inner }
    }
}

impl<S: tonic::server::NamedService> rpc_core::server::NamedService for TonicService<S> {
    const NAME: &'static str = S::NAME;
}

/// The request body tonic's server gets: its error is tonic's own status,
/// which tonic passes on with its code (any other error is `UNKNOWN`).
type ServiceBody = http_body_util::combinators::UnsyncBoxBody<Bytes, tonic::Status>;

impl<S> tower_service::Service<Request<Bytes>> for TonicService<S>
where
    S: tower_service::Service<
            http::Request<ServiceBody>,
            Response = http::Response<tonic::body::Body>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Payload>;
    type Error = Status;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Payload>, Status>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        self.inner.poll_ready(cx).map_err(|never| match never {})
    }

    fn call(&mut self, mut request: Request<Bytes>) -> Self::Future {
        let mut inner = self.inner.clone();
        // The clone may not be ready: the one polled is, so it serves this call.
        std::mem::swap(&mut inner, &mut self.inner);
        Box::pin(async move {
            let stream = ServerStream::take(&mut request);
            let http_request = http_request(&request);
            match stream {
                None => {
                    let http_request = http_request.map(|_| {
                        let mut data = BytesMut::new();
                        wire::frame_message(request.get_ref(), &mut data);
                        http_body_util::Full::new(data.freeze())
                            .map_err(|never: Infallible| match never {})
                            .boxed_unsync()
                    });
                    let response = inner
                        .call(http_request)
                        .await
                        .map_err(|never: Infallible| -> Status { match never {} })?;
                    unary_response(response).await
                }
                Some(ServerStream { messages, mut sink }) => {
                    let body = StreamBody::new(messages.map(|message| {
                        message
                            .map(|message| {
                                let mut data = BytesMut::new();
                                wire::frame_message(&message, &mut data);
                                BodyFrame::data(data.freeze())
                            })
                            .map_err(tonic::Status::from)
                    }))
                    .boxed_unsync();
                    let http_request = http_request.map(|_| body);
                    let response = inner
                        .call(http_request)
                        .await
                        .map_err(|never: Infallible| -> Status { match never {} })?;
                    let (parts, mut body) = response.into_parts();
                    check_http(&parts)?;
                    if let Some(status) = wire::status_from_trailers(&parts.headers) {
                        return status_result(status);
                    }
                    sink.send_headers(wire::metadata_from_headers(&parts.headers))
                        .await?;
                    let mut deframer = Deframer::new(usize::MAX);
                    while let Some(frame) = body.frame().await {
                        let frame = frame.map_err(Status::from)?;
                        match frame.into_data() {
                            Ok(data) => {
                                deframer.push(data);
                                while let Some(message) =
                                    deframer.next_message().map_err(bad_body)?
                                {
                                    sink.send(Payload::from(message)).await?;
                                }
                            }
                            Err(frame) => {
                                if let Ok(trailers) = frame.into_trailers() {
                                    deframer.finish().map_err(bad_body)?;
                                    return status_result(status_of(&trailers)?);
                                }
                            }
                        }
                    }
                    Err(Status::internal(
                        "the tonic service ended its response without a grpc-status",
                    ))
                }
            }
        })
    }
}

/// The HTTP request tonic's server gets for an rdma-rpc call.
fn http_request(request: &Request<Bytes>) -> http::Request<()> {
    let mut http_request = http::Request::new(());
    *http_request.method_mut() = http::Method::POST;
    if let Ok(uri) = request.method().unwrap_or("/").parse() {
        *http_request.uri_mut() = uri;
    }
    let headers = http_request.headers_mut();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(wire::CONTENT_TYPE),
    );
    headers.insert(http::header::TE, HeaderValue::from_static("trailers"));
    if let Some(timeout) = request.timeout() {
        if let Ok(value) = HeaderValue::from_str(&wire::encode_timeout(timeout)) {
            headers.insert("grpc-timeout", value);
        }
    }
    wire::metadata_into_headers(request.metadata(), headers);
    http_request
}

/// A unary call's HTTP response → its one message, or its status.
async fn unary_response(
    response: http::Response<tonic::body::Body>,
) -> Result<Response<Payload>, Status> {
    let (parts, mut body) = response.into_parts();
    check_http(&parts)?;
    if let Some(status) = wire::status_from_trailers(&parts.headers) {
        status_result(status)?;
        return Err(Status::internal(
            "the tonic service answered OK without a message",
        ));
    }
    let mut metadata = wire::metadata_from_headers(&parts.headers);
    let mut deframer = Deframer::new(usize::MAX);
    let mut message = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(Status::from)?;
        match frame.into_data() {
            Ok(data) => {
                deframer.push(data);
                while let Some(next) = deframer.next_message().map_err(bad_body)? {
                    if message.replace(next).is_some() {
                        return Err(Status::internal(
                            "the tonic service sent more than one message for a unary call",
                        ));
                    }
                }
            }
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    deframer.finish().map_err(bad_body)?;
                    let status = status_of(&trailers)?;
                    status_result(status.clone())?;
                    metadata.extend(status.metadata().clone());
                    let message = message.ok_or_else(|| {
                        Status::internal("the tonic service answered OK without a message")
                    })?;
                    return Ok(Response::from_parts(metadata, Payload::from(message)));
                }
            }
        }
    }
    Err(Status::internal(
        "the tonic service ended its response without a grpc-status",
    ))
}

fn check_http(parts: &http::response::Parts) -> Result<(), Status> {
    if parts.status != StatusCode::OK {
        return Err(wire::status_from_http(parts.status));
    }
    Ok(())
}

fn status_of(trailers: &HeaderMap) -> Result<Status, Status> {
    wire::status_from_trailers(trailers)
        .ok_or_else(|| Status::internal("the tonic service's trailers carry no grpc-status"))
}

/// `Ok` (the trailers as the response's metadata) for an OK status, else
/// the status as the call's error.
fn status_result(status: Status) -> Result<Response<Payload>, Status> {
    if status.code() == Code::Ok {
        Ok(Response::from_parts(
            status.metadata().clone(),
            Payload::new(),
        ))
    } else {
        Err(status)
    }
}

fn bad_body(error: wire::DeframeError) -> Status {
    Status::internal(format!("the tonic service's response is not gRPC: {error}"))
}
