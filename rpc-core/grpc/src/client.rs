//! The connecting side: a client front end
//! ([`rpc_core::client::front_end`]) that makes each call of a
//! [`rpc_core::Channel`] one HTTP/2 stream to any gRPC server, straight
//! from the call's own task, as tonic's client does: the request's metadata
//! become its headers (its deadline `grpc-timeout`), its messages go into
//! DATA frames under HTTP/2's flow control, and the response's messages are
//! deframed from the received DATA as the application takes them. One task
//! per connection drives HTTP/2 itself; no rpc-core frame is made. Dropping
//! a call (or its response stream) before its end resets the stream
//! (RST_STREAM CANCEL).

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use futures_core::Stream;
use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use h2::client::{ResponseFuture, SendRequest};
use h2::{RecvStream, SendStream};
use http::{HeaderValue, StatusCode};
use rpc_core::client::front_end::{
    CallConnection, CallFailure, CallSettings, MessageTarget, OutgoingCall, OutgoingMessages,
    StreamFailure,
};
use rpc_core::codec::PayloadBuf;
use rpc_core::metadata::Metadata;
use rpc_core::transport::{Endpoint, TransportError};
use rpc_core::{Code, Payload, Response, Status, Streaming};
use tokio::net::TcpStream;
use tokio::task::AbortHandle;

use crate::H2Settings;
use crate::data::{FramedQueue, plain_prefix};
use crate::wire::{self, Deframer, Encoding};

/// Bytes of a request stream's messages held before they are pushed into
/// HTTP/2 and the sender waits for the server's window.
const PENDING_BYTES: usize = 64 << 10;

/// Opens an HTTP/2 connection to the gRPC server at `endpoint` (inside TLS
/// when `settings` carry it).
pub(crate) async fn connect(
    endpoint: &Endpoint,
    settings: H2Settings,
    call_settings: &CallSettings,
) -> Result<Arc<dyn CallConnection>, TransportError> {
    let port = endpoint
        .port()
        .ok_or_else(|| TransportError::InvalidEndpoint {
            endpoint: endpoint.to_string(),
            reason: "grpc:// needs a port (grpc://host:port)",
        })?;
    let socket = TcpStream::connect((endpoint.host(), port)).await?;
    socket.set_nodelay(true)?;
    if let Some(keepalive) = call_settings.keepalive {
        // The kernel probes a silent connection: HTTP/2 PINGs would do it
        // too, but gRPC servers limit how often a client may ping (grpc-go
        // sends GOAWAY to one that pings more than every 5 minutes).
        // The kernel counts in whole seconds, and takes no 0.
        let second = Duration::from_secs(1);
        let probes = socket2::TcpKeepalive::new()
            .with_time(keepalive.interval.max(second))
            .with_interval((keepalive.timeout / 4).max(second))
            .with_retries(4);
        let socket_ref = socket2::SockRef::from(&socket);
        socket_ref.set_tcp_keepalive(&probes)?;
        // Probes go only while nothing sent waits for its acknowledgement:
        // a server gone while a request was on its way is caught by this.
        socket_ref.set_tcp_user_timeout(Some(keepalive.timeout.max(second)))?;
    }
    #[cfg(feature = "tls")]
    if let Some(tls) = settings.tls.clone() {
        let stream = tls.client_handshake(socket, endpoint).await?;
        return over(stream, endpoint, settings).await;
    }
    over(socket, endpoint, settings).await
}

/// HTTP/2 over `io`, connected to `endpoint`.
async fn over<T>(
    io: T,
    endpoint: &Endpoint,
    settings: H2Settings,
) -> Result<Arc<dyn CallConnection>, TransportError>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (send_request, connection) = settings
        .client()
        .handshake::<_, Bytes>(io)
        .await
        .map_err(|error| TransportError::Other(Box::new(error)))?;
    let closed = Arc::new(AtomicBool::new(false));
    let authority = http::uri::Authority::try_from(endpoint.authority()).map_err(|_| {
        TransportError::InvalidEndpoint {
            endpoint: endpoint.to_string(),
            reason: "not a valid HTTP authority",
        }
    })?;
    let peer = endpoint.to_string();
    tokio::spawn({
        let closed = closed.clone();
        async move {
            // Ends once the server closed it, or once every handle (the
            // channel's connection and its calls' streams) is gone.
            if let Err(error) = connection.await {
                tracing::debug!(%error, %peer, "grpc: HTTP/2 connection failed");
            }
            closed.store(true, Ordering::Release);
        }
    });
    Ok(Arc::new(GrpcConnection {
        inner: Arc::new(Inner {
            send_request,
            closed,
            authority,
            settings,
        }),
    }))
}

/// One HTTP/2 connection of a channel.
struct GrpcConnection {
    inner: Arc<Inner>,
}

struct Inner {
    send_request: SendRequest<Bytes>,
    /// The connection ended, or refused a new stream (it is going away).
    closed: Arc<AtomicBool>,
    authority: http::uri::Authority,
    settings: H2Settings,
}

impl CallConnection for GrpcConnection {
    fn is_usable(&self) -> bool {
        !self.inner.closed.load(Ordering::Acquire)
    }

    fn unary(
        &self,
        call: OutgoingCall<Payload>,
    ) -> BoxFuture<'static, Result<Response<Bytes>, CallFailure>> {
        unary(self.inner.clone(), call).boxed()
    }

    fn streaming(
        &self,
        call: OutgoingCall<OutgoingMessages>,
    ) -> BoxFuture<'static, Result<Response<Streaming<Bytes>>, StreamFailure>> {
        streaming(self.inner.clone(), call).boxed()
    }
}

impl Inner {
    /// The encoding of a call's request messages: its own pick, else the
    /// channel's.
    fn encoding(&self, metadata: &Metadata) -> Option<Encoding> {
        wire::requested_encoding(metadata).unwrap_or(self.settings.options.send_compressed)
    }

    /// A request message of `len` bytes within the channel's limit, or
    /// `ResourceExhausted` (the call is not sent).
    fn check_message(&self, len: usize) -> Result<(), Status> {
        let max = self.settings.max_message;
        if len > max {
            return Err(Status::resource_exhausted(format!(
                "request message of {len} bytes exceeds this channel's limit of {max} bytes (Channel::builder().max_frame_len)"
            )));
        }
        Ok(())
    }

    /// Opens the call's HTTP/2 stream; a failure here is a call the server
    /// never saw.
    async fn open(
        &self,
        request: http::Request<()>,
        end_of_stream: bool,
    ) -> Result<(ResponseFuture, SendStream<Bytes>), CallFailure> {
        let opened = async {
            let mut sender = self.send_request.clone().ready().await?;
            sender.send_request(request, end_of_stream)
        };
        opened.await.map_err(|error| {
            // A connection that takes no new stream is done for new calls.
            self.closed.store(true, Ordering::Release);
            CallFailure::unprocessed(Status::unavailable(format!(
                "gRPC connection cannot take a new call: {error}"
            )))
        })
    }

    fn request(
        &self,
        path: &str,
        timeout: Option<Duration>,
        metadata: &Metadata,
        encoding: Option<Encoding>,
    ) -> Result<http::Request<()>, Status> {
        if let Err(excess) = metadata.check_limits() {
            return Err(Status::invalid_argument(format!("request {excess}")));
        }
        let options = &self.settings.options;
        let uri = http::Uri::builder()
            .scheme(if self.settings.is_secure() {
                http::uri::Scheme::HTTPS
            } else {
                http::uri::Scheme::HTTP
            })
            .authority(self.authority.clone())
            .path_and_query(path)
            .build()
            .map_err(|error| {
                Status::internal(format!("cannot make a gRPC request URI: {error}"))
            })?;
        let mut request = http::Request::builder()
            .method(http::Method::POST)
            .uri(uri)
            .body(())
            .map_err(|error| Status::internal(format!("cannot make a gRPC request: {error}")))?;
        let headers = request.headers_mut();
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static(wire::CONTENT_TYPE),
        );
        headers.insert(http::header::TE, HeaderValue::from_static("trailers"));
        if let Some(encoding) = encoding {
            headers.insert("grpc-encoding", HeaderValue::from_static(encoding.name()));
        }
        if !options.accept_compressed.is_empty() {
            headers.insert(
                "grpc-accept-encoding",
                wire::accept_encoding_value(&options.accept_compressed),
            );
        }
        if let Some(timeout) = timeout {
            if let Ok(value) = HeaderValue::from_str(&wire::encode_timeout(timeout)) {
                headers.insert("grpc-timeout", value);
            }
        }
        wire::metadata_into_headers(metadata, headers);
        if !headers.contains_key(http::header::USER_AGENT) {
            headers.insert(
                http::header::USER_AGENT,
                HeaderValue::from_static(concat!("rdma-rpc/", env!("CARGO_PKG_VERSION"))),
            );
        }
        Ok(request)
    }

    /// The response's head: a trailers-only answer's status, or the
    /// response metadata with the body and its message encoding.
    fn head(&self, response: http::Response<RecvStream>) -> Result<Head, Status> {
        let (parts, body) = response.into_parts();
        if parts.status != StatusCode::OK {
            return Err(wire::status_from_http(parts.status));
        }
        if !wire::is_grpc_content_type(parts.headers.get(http::header::CONTENT_TYPE)) {
            return Err(Status::unknown(format!(
                "the server answered with content-type {:?}, not gRPC",
                parts.headers.get(http::header::CONTENT_TYPE)
            )));
        }
        if let Some(status) = wire::status_from_trailers(&parts.headers) {
            return Ok(Head::TrailersOnly(status));
        }
        let accepted = &self.settings.options.accept_compressed;
        let encoding = wire::message_encoding(&parts.headers, accepted).map_err(|name| {
            Status::internal(format!(
                "the server compressed its response with {name:?}, which this channel does not accept (rpc_grpc::GrpcOptions::accept_compressed)"
            ))
        })?;
        Ok(Head::Body {
            metadata: wire::metadata_from_headers(&parts.headers),
            deframer: Deframer::with_encoding(self.settings.max_message, encoding),
            body,
        })
    }
}

/// What a response starts with.
enum Head {
    /// The status and nothing else.
    TrailersOnly(Status),
    /// The response metadata; messages and trailers follow in `body`.
    Body {
        metadata: Metadata,
        deframer: Deframer,
        body: RecvStream,
    },
}

async fn unary(
    inner: Arc<Inner>,
    call: OutgoingCall<Payload>,
) -> Result<Response<Bytes>, CallFailure> {
    let encoding = inner.encoding(&call.metadata);
    inner.check_message(call.body.len())?;
    let request = inner.request(&call.path, call.timeout, &call.metadata, encoding)?;
    let (response, mut body) = inner.open(request, false).await?;
    let mut queue = FramedQueue::default();
    queue.push(call.body, encoding);
    // All of it to h2 at once: h2 sends it as the window allows while the
    // answer is read (a server may answer before it read it all, or send
    // its headers first and wait for the rest). A failed write leaves the
    // end to the answer, which says why.
    if let Err(error) = queue.send_now(&mut body, true) {
        tracing::debug!(%error, "grpc: request failed");
    }
    unary_answer(&inner, response).await
}

/// A unary call's answer: its headers, one message, its trailers.
async fn unary_answer(
    inner: &Inner,
    response: ResponseFuture,
) -> Result<Response<Bytes>, CallFailure> {
    // Before the answer's headers a refusal (REFUSED_STREAM) is one the
    // server never processed; after them, no error is.
    let response = response.await.map_err(|error| failure_of(&error))?;
    let (metadata, mut deframer, mut body) = match inner.head(response)? {
        Head::TrailersOnly(status) if status.code() == Code::Ok => {
            return Err(no_message().into());
        }
        Head::TrailersOnly(status) => return Err(status.into()),
        Head::Body {
            metadata,
            deframer,
            body,
        } => (metadata, deframer, body),
    };
    let mut message = None;
    while let Some(chunk) = body.data().await {
        let chunk = chunk.map_err(|error| wire::status_from_h2(&error))?;
        let _ = body.flow_control().release_capacity(chunk.len());
        deframer.push(chunk);
        while let Some(next) = deframer.next_decompressed().map_err(bad_response)? {
            if message.replace(next).is_some() {
                return Err(Status::internal(
                    "the server sent more than one response message for a unary call",
                )
                .into());
            }
        }
    }
    deframer.finish().map_err(bad_response)?;
    let trailers = body
        .trailers()
        .await
        .map_err(|error| wire::status_from_h2(&error))?;
    let status = trailers
        .as_ref()
        .and_then(wire::status_from_trailers)
        .ok_or_else(no_status)?;
    if status.code() != Code::Ok {
        return Err(status.into());
    }
    let message = message.ok_or_else(no_message)?;
    let mut metadata = metadata;
    metadata.extend(status.metadata().clone());
    Ok(Response::from_parts(metadata, message))
}

async fn streaming(
    inner: Arc<Inner>,
    call: OutgoingCall<OutgoingMessages>,
) -> Result<Response<Streaming<Bytes>>, StreamFailure> {
    let encoding = inner.encoding(&call.metadata);
    let messages = call.body;
    let request = match inner.request(&call.path, call.timeout, &call.metadata, encoding) {
        Ok(request) => request,
        Err(status) => return Err(CallFailure::processed(status).into()),
    };
    let oversized = messages
        .ready()
        .unwrap_or_default()
        .iter()
        .try_for_each(|message| inner.check_message(message.len()));
    if let Err(status) = oversized {
        return Err(CallFailure::processed(status).into());
    }
    // A request stream with nothing in it ends with its headers.
    let empty = messages.ready().is_some_and(<[Payload]>::is_empty);
    let (response, mut body) = match inner.open(request, empty).await {
        Ok(opened) => opened,
        Err(failure) => {
            return Err(StreamFailure {
                failure,
                unsent: Some(messages),
            });
        }
    };
    let local_failure = Arc::new(Mutex::new(None));
    let max_message = inner.settings.max_message;
    let pump = match messages.into_ready() {
        Ok(_) if empty => None,
        Ok(ready) => {
            // All there already: to h2 at once (as a unary request).
            let mut queue = FramedQueue::default();
            for message in ready {
                queue.push(message, encoding);
            }
            if let Err(error) = queue.send_now(&mut body, true) {
                tracing::debug!(%error, "grpc: request stream failed");
            }
            None
        }
        Err(messages) => {
            let body = Arc::new(Mutex::new(body));
            let broken = Arc::new(AtomicBool::new(false));
            let target = RequestTarget {
                body: body.clone(),
                queue: FramedQueue::default(),
                encoding,
                broken: broken.clone(),
            };
            let local_failure = local_failure.clone();
            // Sent from here while the messages are ready and the window
            // open (a stream that is there already needs no task); the
            // rest from a task of its own.
            let mut pump = Box::pin(async move {
                let Err(status) = messages.send_to(target, max_message).await else {
                    return;
                };
                if broken.load(Ordering::Acquire) {
                    // HTTP/2 took no more (the server ended the call, or
                    // the connection broke): the answer says why.
                    tracing::debug!(%status, "grpc: request stream failed");
                    return;
                }
                // The application's stream failed (or a message was over
                // the limit): that is the call's end, and the server must
                // not wait for the rest.
                tracing::debug!(%status, "grpc: the request stream ended the call");
                *lock(&local_failure) = Some(status);
                lock(&body).send_reset(h2::Reason::CANCEL);
            });
            match futures_util::poll!(pump.as_mut()) {
                Poll::Ready(()) => None,
                Poll::Pending => Some(PumpGuard(tokio::spawn(pump).abort_handle())),
            }
        }
    };
    let failed = |status: Status| -> StreamFailure {
        let local = lock(&local_failure).take();
        CallFailure::processed(local.unwrap_or(status)).into()
    };
    let response = match response.await {
        Ok(response) => response,
        Err(error) => return Err(failed(wire::status_from_h2(&error))),
    };
    let trailers = Arc::new(OnceLock::new());
    let (metadata, messages) = match inner.head(response) {
        Err(status) => return Err(failed(status)),
        Ok(Head::TrailersOnly(status)) if status.code() == Code::Ok => {
            let _ = trailers.set(status.metadata().clone());
            (Metadata::new(), ResponseMessages::ended())
        }
        Ok(Head::TrailersOnly(status)) => return Err(failed(status)),
        Ok(Head::Body {
            metadata,
            deframer,
            body,
        }) => (
            metadata,
            ResponseMessages {
                body: Some(body),
                deframer,
                trailers: trailers.clone(),
                pump,
                local_failure,
                reading_trailers: false,
                done: false,
            },
        ),
    };
    Ok(Response::from_parts(
        metadata,
        Streaming::from_response(messages, trailers),
    ))
}

/// Aborts a request stream's task when the call is over or dropped.
struct PumpGuard(AbortHandle);

impl Drop for PumpGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A streaming call's response messages, deframed from the HTTP/2 stream
/// as the application takes them; then the status from the trailers.
struct ResponseMessages {
    /// `None` once the stream ended.
    body: Option<RecvStream>,
    deframer: Deframer,
    trailers: Arc<OnceLock<Metadata>>,
    pump: Option<PumpGuard>,
    /// Why the request stream ended the call, if it did.
    local_failure: Arc<Mutex<Option<Status>>>,
    reading_trailers: bool,
    /// The stream ended (well, or with the one error it yielded).
    done: bool,
}

impl ResponseMessages {
    /// A response that ended with its headers.
    fn ended() -> ResponseMessages {
        ResponseMessages {
            body: None,
            deframer: Deframer::new(0),
            trailers: Arc::new(OnceLock::new()),
            pump: None,
            local_failure: Arc::new(Mutex::new(None)),
            reading_trailers: true,
            done: true,
        }
    }

    /// Ends the stream with `status` (the request stream's own failure
    /// first: it is why the server's side failed).
    fn fail(&mut self, status: Status) -> Poll<Option<Result<Bytes, Status>>> {
        self.done = true;
        self.body = None;
        self.pump = None;
        let local = lock(&self.local_failure).take();
        Poll::Ready(Some(Err(local.unwrap_or(status))))
    }
}

impl Stream for ResponseMessages {
    type Item = Result<Bytes, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        loop {
            match this.deframer.next_decompressed() {
                Ok(Some(message)) => return Poll::Ready(Some(Ok(message))),
                Ok(None) => {}
                Err(error) => return this.fail(bad_response(error)),
            }
            let Some(body) = this.body.as_mut() else {
                return Poll::Ready(None);
            };
            if !this.reading_trailers {
                match ready!(body.poll_data(cx)) {
                    Some(Ok(chunk)) => {
                        let _ = body.flow_control().release_capacity(chunk.len());
                        this.deframer.push(chunk);
                        continue;
                    }
                    Some(Err(error)) => return this.fail(wire::status_from_h2(&error)),
                    None => {
                        if let Err(error) = this.deframer.finish() {
                            return this.fail(bad_response(error));
                        }
                        this.reading_trailers = true;
                    }
                }
            }
            let status = match ready!(body.poll_trailers(cx)) {
                Ok(trailers) => trailers.as_ref().and_then(wire::status_from_trailers),
                Err(error) => return this.fail(wire::status_from_h2(&error)),
            };
            let Some(status) = status else {
                return this.fail(no_status());
            };
            if status.code() != Code::Ok {
                return this.fail(status);
            }
            let _ = this.trailers.set(status.metadata().clone());
            this.done = true;
            this.body = None;
            this.pump = None;
            return Poll::Ready(None);
        }
    }
}

/// A request stream's messages into the call's HTTP/2 stream (shared with
/// the task that sends them, which resets the stream when they fail; only
/// that task locks it).
struct RequestTarget {
    body: Arc<Mutex<SendStream<Bytes>>>,
    queue: FramedQueue,
    encoding: Option<Encoding>,
    /// Set when HTTP/2 refused a write: what ended the sending is then the
    /// stream's end, not the application's stream.
    broken: Arc<AtomicBool>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

impl RequestTarget {
    fn flushed(&mut self, end: bool, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        self.queue
            .poll_flush(&mut lock(&self.body), end, cx)
            .map_err(|error| {
                self.broken.store(true, Ordering::Release);
                error
            })
            .map_err(|error| match error {
                Some(error) => wire::status_from_h2(&error),
                None => Status::cancelled("the call's stream closed"),
            })
    }
}

impl MessageTarget for RequestTarget {
    fn send_headers(&mut self, _metadata: Metadata) -> Result<(), Status> {
        // The request's headers went when the stream opened.
        Ok(())
    }

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        if self.queue.held() >= PENDING_BYTES {
            return self.flushed(false, cx);
        }
        Poll::Ready(Ok(()))
    }

    fn start_send(&mut self, message: Payload) -> Result<(), Status> {
        self.queue.push(message, self.encoding);
        Ok(())
    }

    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        self.flushed(false, cx)
    }

    fn framing(&mut self) -> Option<fn(usize, &mut PayloadBuf)> {
        // A compressed request compresses each message alone.
        self.encoding
            .is_none()
            .then_some(plain_prefix as fn(usize, &mut PayloadBuf))
    }

    fn start_send_framed(&mut self, framed: Payload) -> Result<(), Status> {
        self.queue.push_framed(framed);
        Ok(())
    }

    fn close(&mut self) -> Result<(), Status> {
        // Everything went in the flush before: only END_STREAM is left.
        self.queue
            .send_now(&mut lock(&self.body), true)
            .map_err(|error| {
                self.broken.store(true, Ordering::Release);
                wire::status_from_h2(&error)
            })
    }
}

/// How a call that HTTP/2 ended before the answer's headers fails: as
/// [`wire::status_from_h2`] says, and a refusal by the server (REFUSED_STREAM) is one
/// it never processed, so the channel may send it again.
fn failure_of(error: &h2::Error) -> CallFailure {
    let status = wire::status_from_h2(error);
    let refused = error.is_reset() && error.is_remote();
    if refused && error.reason() == Some(h2::Reason::REFUSED_STREAM) {
        CallFailure::unprocessed(status)
    } else {
        CallFailure::processed(status)
    }
}

fn bad_response(error: wire::DeframeError) -> Status {
    match error {
        wire::DeframeError::TooLarge { len, max } => Status::resource_exhausted(format!(
            "response message of {len} bytes exceeds this channel's limit of {max} bytes (Channel::builder().max_frame_len)"
        )),
        error => Status::internal(format!("bad response: {error}")),
    }
}

fn no_status() -> Status {
    Status::internal("the server ended the response without a grpc-status")
}

fn no_message() -> Status {
    Status::internal("the server sent no response message for a unary call")
}
