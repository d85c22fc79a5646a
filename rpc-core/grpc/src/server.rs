//! The listening side: a front end ([`rpc_core::server::front_end`]) that
//! brings standard gRPC clients' calls straight to the server's routes.
//!
//! One task per HTTP/2 connection (the server's): it drives h2's connection
//! and the connection's calls, each a future in the same task, as h2's
//! streams share its connection anyway. A call's request body becomes the
//! messages its handler reads (slices of the received DATA: a message that
//! arrived in one frame is never copied), and the handler's messages go
//! into DATA frames as HTTP/2's flow control lets them (a large one after
//! its own prefix, not copied). No rpc-core frame is made on the way: the
//! server runs each call with [`Calls::call`], which does what it does for
//! every call (deadline, panics, metrics, access log, shutdown).
//!
//! gRPC's wire does not say a method's kind, so every call is opened as a
//! stream of unknown kind: a unary method takes the one message and
//! answers with one ([`CallEnd::Answer`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use h2::server::SendResponse;
use h2::{RecvStream, SendStream};
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use rpc_core::codec::PayloadBuf;
use rpc_core::frame::HEADER_LEN;
use rpc_core::metadata::Metadata;
use rpc_core::server::front_end::{CallEnd, Calls, FrontEndConnection, FrontEndListener};
use rpc_core::stream::{MessageSink, MessageTarget, ServerStream, Streaming};
use rpc_core::transport::{ConnectionBudget, Endpoint, TransportError};
use rpc_core::wake_gate::{RepollOnWake, WakeGate};
use rpc_core::{Code, Payload, Request, Status};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

use crate::H2Settings;
use crate::cork::{Cork, Corked};
use crate::data::{FramedQueue, plain_prefix};
use crate::wire::{self, Deframed, Deframer, Encoding};

/// Accepted connections waiting for the server to take them.
const ACCEPT_QUEUE: usize = 64;
/// How long a new connection has to finish the HTTP/2 handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a closing connection waits for its streams to finish.
const CLOSE_LINGER: Duration = Duration::from_secs(1);
/// Bytes of answers a connection holds that HTTP/2 has not taken yet (its
/// peer may not read): while they are over it, the connection starts no
/// new call, so a peer that lets nothing through (a zero HTTP/2 window)
/// holds about this much, whatever it asks for.
const QUEUED_BYTES: usize = 8 << 20;
/// Bytes of a stream's messages its writer holds before it pushes them
/// into HTTP/2 and waits for the window.
const PENDING_BYTES: usize = 64 << 10;
/// A compressed request message that inflates to this much or more is
/// inflated on a blocking thread, not on a runtime worker.
const INFLATE_OFF_THREAD: usize = 1 << 20;

/// A bound `grpc://` endpoint.
pub(crate) struct GrpcListener {
    accepted: mpsc::Receiver<Result<Box<dyn FrontEndConnection>, TransportError>>,
    local: Endpoint,
    accept_task: tokio::task::JoinHandle<()>,
}

impl Drop for GrpcListener {
    fn drop(&mut self) {
        self.accept_task.abort();
    }
}

impl futures_core::Stream for GrpcListener {
    type Item = Result<Box<dyn FrontEndConnection>, TransportError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.accepted.poll_recv(cx)
    }
}

impl FrontEndListener for GrpcListener {
    fn local_endpoint(&self) -> Endpoint {
        self.local.clone()
    }
}

/// Listens on `endpoint`; every accepted TCP connection speaks HTTP/2.
pub(crate) async fn bind(
    endpoint: &Endpoint,
    settings: H2Settings,
) -> Result<GrpcListener, TransportError> {
    let listener =
        tokio::net::TcpListener::bind((endpoint.host(), endpoint.port().unwrap_or(0))).await?;
    listen_on(listener, endpoint.scheme(), settings)
}

/// Serves what `listener` accepts (bound here or elsewhere) as `scheme`.
pub(crate) fn listen_on(
    listener: tokio::net::TcpListener,
    scheme: &str,
    settings: H2Settings,
) -> Result<GrpcListener, TransportError> {
    let local_addr = listener.local_addr()?;
    let local = Endpoint::new(scheme, &local_addr.to_string())?;
    let (queue, accepted) = mpsc::channel(ACCEPT_QUEUE);
    let accept_task = tokio::spawn(async move {
        loop {
            let item = match listener.accept().await {
                Ok((socket, peer)) => {
                    let _ = socket.set_nodelay(true);
                    Ok(Box::new(GrpcConnection {
                        socket,
                        peer: format!("grpc://{peer}"),
                        settings: settings.clone(),
                    }) as Box<dyn FrontEndConnection>)
                }
                Err(error) => Err(TransportError::Io(error)),
            };
            if queue.send(item).await.is_err() {
                return;
            }
        }
    });
    Ok(GrpcListener {
        accepted,
        local,
        accept_task,
    })
}

/// An accepted TCP connection, before its (TLS and) HTTP/2 handshake.
struct GrpcConnection {
    socket: TcpStream,
    peer: String,
    settings: H2Settings,
}

/// What a connection is accepted for.
enum Role {
    Serve(Calls),
    /// Every call it opens gets this status, then GOAWAY.
    Refuse(Status),
}

impl FrontEndConnection for GrpcConnection {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn serve(self: Box<Self>, calls: Calls) -> BoxFuture<'static, ()> {
        serve_socket(*self, Role::Serve(calls)).boxed()
    }

    fn refuse(self: Box<Self>, reason: String) -> BoxFuture<'static, ()> {
        serve_socket(*self, Role::Refuse(Status::resource_exhausted(reason))).boxed()
    }
}

/// Serves an accepted socket: its TLS handshake first on `grpcs://`.
async fn serve_socket(connection: GrpcConnection, role: Role) {
    let GrpcConnection {
        socket, settings, ..
    } = connection;
    #[cfg(feature = "tls")]
    if let Some(tls) = settings.tls.clone() {
        match tls.server_handshake(socket, crate::TLS_SCHEME).await {
            Ok(stream) => serve_h2(stream, settings, role).await,
            Err(error) => tracing::debug!(%error, "grpcs: TLS handshake failed"),
        }
        return;
    }
    serve_h2(socket, settings, role).await;
}

/// What every call of one connection shares.
struct Shared {
    max_message: usize,
    options: Arc<crate::GrpcOptions>,
    /// This server's `grpc-accept-encoding`.
    accept: HeaderValue,
    /// What the headers before an answer's messages say of it: nothing
    /// where the server takes identity only (as tonic's server; gRPC's
    /// spec allows it), else [`Shared::accept`]. A trailers-only answer (a
    /// refusal, a status without messages) always says it.
    advertised: Option<HeaderValue>,
    /// Where assembled and inflated request messages reserve their bytes.
    budget: Option<tokio::sync::Mutex<ConnectionBudget>>,
    /// Bytes of answers not yet taken by HTTP/2 (see [`QUEUED_BYTES`]).
    queued: AtomicUsize,
}

/// The HTTP/2 connection and its calls, in one task.
async fn serve_h2<T>(socket: T, settings: H2Settings, role: Role)
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut builder = settings.server();
    if let Role::Serve(calls) = &role {
        let most = u32::try_from(calls.max_concurrent_calls()).unwrap_or(u32::MAX);
        builder.max_concurrent_streams(most.min(crate::MAX_CONCURRENT_STREAMS));
    }
    let (socket, cork) = crate::cork::corked(socket);
    let handshake = builder.handshake::<_, Bytes>(socket);
    let h2 = match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
        Ok(Ok(h2)) => h2,
        Ok(Err(error)) => {
            tracing::debug!(%error, "grpc: HTTP/2 handshake failed");
            return;
        }
        Err(_) => {
            tracing::debug!("grpc: HTTP/2 handshake timed out");
            return;
        }
    };
    // The server's limits and budget come with its calls.
    let (max_message, budget) = match &role {
        Role::Serve(calls) => (
            max_message_for(calls.max_frame_len()),
            Some(calls.receive_budget().connection()),
        ),
        Role::Refuse(_) => (settings.max_message, None),
    };
    let accept = wire::accept_encoding_value(&settings.options.accept_compressed);
    let shared = Arc::new(Shared {
        max_message,
        advertised: (!settings.options.accept_compressed.is_empty()).then(|| accept.clone()),
        accept,
        options: settings.options.clone(),
        budget: budget.map(tokio::sync::Mutex::new),
        queued: AtomicUsize::new(0),
    });
    match role {
        // h2 wakes a call's waker (the task's) while this task reads the
        // call's body: polled again at once, not rescheduled.
        Role::Serve(calls) => RepollOnWake::new(serve_calls(h2, calls, shared, &cork)).await,
        Role::Refuse(status) => refuse_calls(h2, &status, &shared.accept).await,
    }
    // What h2 wrote while corked, if the connection ended in a burst.
    let _ = tokio::time::timeout(CLOSE_LINGER, cork.finish()).await;
}

type H2Connection<T> = h2::server::Connection<Corked<T>, Bytes>;

/// Answers every call of a refused connection with `status`, says GOAWAY,
/// and closes once its streams are done (or after [`CLOSE_LINGER`]).
async fn refuse_calls<T>(mut h2: H2Connection<T>, status: &Status, accept: &HeaderValue)
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    h2.graceful_shutdown();
    let _ = tokio::time::timeout(CLOSE_LINGER, async {
        while let Some(Ok((_, mut respond))) = h2.accept().await {
            refuse(&mut respond, status, accept);
        }
    })
    .await;
}

/// The calls in flight on one connection, each a future that sends its
/// own response.
type CallFutures = FuturesUnordered<Pin<Box<dyn Future<Output = ()> + Send>>>;

/// Serves one HTTP/2 connection's calls until the client or the server ends it.
async fn serve_calls<T>(mut h2: H2Connection<T>, calls: Calls, shared: Arc<Shared>, cork: &Cork<T>)
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut running = CallFutures::new();
    // h2's connection is polled only when it asked to be (it does much
    // work per poll), not on every wake-up of this task (a call's progress).
    let h2_woke = WakeGate::new();
    let idle_timeout = calls.idle_timeout();
    let mut idle = std::pin::pin!(tokio::time::sleep(idle_timeout));
    let mut shutting_down = std::pin::pin!(calls.shutting_down());
    let mut ending_now = std::pin::pin!(calls.ending_now());
    let mut going_away = false;
    let mut ended_at: Option<tokio::time::Instant> = None;
    // Calls taken, and how many the idle timer saw last (no clock read per call).
    let (mut taken, mut taken_at_idle_check) = (0u64, 0u64);
    loop {
        // New calls wait (in h2, under its stream limit) while answers
        // HTTP/2 has not taken are over the bound.
        let accepting = shared.queued.load(Ordering::Relaxed) < QUEUED_BYTES;
        tokio::select! {
            event = std::future::poll_fn(|cx| h2_woke.poll(cx, |cx| {
                let polled = poll_h2(&mut h2, cx, accepting);
                if polled.is_pending() && cork.is_corked() {
                    // h2 has no more calls to hand over (and has flushed
                    // into the cork): the burst's answers go now, in one
                    // write.
                    cork.uncork_and_send(cx);
                }
                polled
            })) => match event {
                H2Event::Call(request, respond) => {
                    taken += 1;
                    // Until h2 has handed over every call that arrived with
                    // this one, what it writes waits (see `cork`).
                    cork.cork();
                    let mut call = Box::pin(serve_call(request, respond, calls.clone(), shared.clone()));
                    // Its first poll now, in this task: a handler that
                    // answers at once answers before the next call is taken
                    // (and counts its answer against QUEUED_BYTES first).
                    // Its answer wakes h2, and h2 this task (and the
                    // call, if it gave the call capacity at once): quietly,
                    // as the loop polls h2 next anyway, and `running` polls
                    // a call pushed into it with a waker of its own.
                    if h2_woke.poll_quietly(call.as_mut()).is_pending() {
                        running.push(call);
                    }
                }
                H2Event::Closed => break,
                H2Event::Failed(error) => {
                    tracing::debug!(%error, "grpc: HTTP/2 connection failed");
                    break;
                }
            },
            Some(()) = running.next(), if !running.is_empty() => {
                // Its answer may have freed room for new calls.
                h2_woke.open();
                if running.is_empty() {
                    idle.as_mut().reset(tokio::time::Instant::now() + idle_timeout);
                }
            }
            () = &mut idle, if running.is_empty() && !going_away => {
                if taken != taken_at_idle_check {
                    // Calls came (and went) since: idle from now on.
                    taken_at_idle_check = taken;
                    idle.as_mut().reset(tokio::time::Instant::now() + idle_timeout);
                    continue;
                }
                tracing::debug!(peer = %calls.peer(), "grpc: connection idle, closing");
                going_away = true;
                h2.graceful_shutdown();
                h2_woke.open();
                ended_at = Some(tokio::time::Instant::now() + CLOSE_LINGER);
            }
            () = &mut shutting_down, if !going_away => {
                going_away = true;
                h2.graceful_shutdown();
                h2_woke.open();
            }
            // The calls end themselves (Unavailable); their streams are
            // given a moment to say so.
            () = &mut ending_now, if ended_at.is_none() => {
                ended_at = Some(tokio::time::Instant::now() + CLOSE_LINGER);
                if !going_away {
                    going_away = true;
                    h2.graceful_shutdown();
                    h2_woke.open();
                }
            }
            () = sleep_until(ended_at) => break,
        }
    }
    // Dropping the calls' futures cancels their handlers.
    drop(running);
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

// A transient return value, moved once: not worth a box.
#[allow(clippy::large_enum_variant)]
enum H2Event {
    Call(http::Request<RecvStream>, SendResponse<Bytes>),
    Closed,
    Failed(h2::Error),
}

/// Drives h2's connection: taking its new streams while `accepting`, else
/// only its I/O (new streams wait in h2).
fn poll_h2<T>(h2: &mut H2Connection<T>, cx: &mut Context<'_>, accepting: bool) -> Poll<H2Event>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    if accepting {
        h2.poll_accept(cx).map(|accepted| match accepted {
            Some(Ok((request, respond))) => H2Event::Call(request, respond),
            Some(Err(error)) => H2Event::Failed(error),
            None => H2Event::Closed,
        })
    } else {
        h2.poll_closed(cx).map(|closed| match closed {
            Ok(()) => H2Event::Closed,
            Err(error) => H2Event::Failed(error),
        })
    }
}

/// One call, from its request headers to its trailers.
async fn serve_call(
    request: http::Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
    calls: Calls,
    shared: Arc<Shared>,
) {
    let Some((call, encoding)) = open_call(&request, &mut respond, &shared) else {
        return;
    };
    let coding = CallCoding {
        send: shared.options.send_compressed,
        client_accepts: wire::EncodingSet::accepted_by(request.headers()),
        response: None,
    };
    let mut body = request.into_body();
    // Told when the client broke gRPC's framing: its call ends so.
    let (failed, failure) = oneshot::channel();
    let messages = match encoding {
        // A compressed body is read message by message: each reserves
        // what it declares before it is inflated.
        Some(_) => request_messages(body, None, encoding, shared.clone(), failed),
        None => match read_whole(&mut body, shared.max_message) {
            Whole::Messages(messages) => {
                drop(body);
                Streaming::from_messages(futures_util::stream::iter(messages.into_iter().map(Ok)))
            }
            Whole::Broken(status) => return refuse(&mut respond, &status, &shared.accept),
            Whole::Reset => return,
            Whole::NotYet(first) => request_messages(body, first, None, shared.clone(), failed),
        },
    };
    let writer = Arc::new(Mutex::new(Writer {
        respond,
        body: None,
        queue: FramedQueue::default(),
        coding,
        shared: shared.clone(),
        ended: false,
    }));
    let sink = MessageSink::from_target(Target(writer.clone()), shared.max_message);
    let running = calls.call(call, ServerStream { messages, sink });
    let end = tokio::select! {
        end = running => end,
        Ok(status) = failure => CallEnd::Ended(status),
        reason = std::future::poll_fn(|cx| lock(&writer).poll_reset(cx)) => {
            // Dropping the call cancels its handler.
            tracing::debug!(?reason, "grpc: the client reset a stream");
            lock(&writer).ended = true;
            return;
        }
    };
    finish(&writer, end).await;
}

/// What a new call's request body holds already (h2 has read it with the
/// headers), without waiting for more.
enum Whole {
    /// The whole body has arrived (a unary call's request, mostly, sent
    /// with its headers in one write): its messages, slices of its DATA.
    Messages(Vec<Bytes>),
    /// More is to come (or might be): the data read so far, if any.
    NotYet(Option<Bytes>),
    /// The body breaks gRPC's framing (the call's answer).
    Broken(Status),
    /// The client reset the stream already.
    Reset,
}

/// Takes what `body` holds now: its whole stream when it has ended with
/// the first piece of data (or with none). Its window goes back at once:
/// what it holds is one DATA frame.
fn read_whole(body: &mut RecvStream, max_message: usize) -> Whole {
    let chunk = match body.data().now_or_never() {
        None => return Whole::NotYet(None),
        Some(None) => return Whole::Messages(Vec::new()),
        Some(Some(Err(_))) => return Whole::Reset,
        Some(Some(Ok(chunk))) => chunk,
    };
    if !body.is_end_stream() {
        return Whole::NotYet(Some(chunk));
    }
    let _ = body.flow_control().release_capacity(chunk.len());
    let mut deframer = Deframer::new(max_message);
    deframer.push(chunk);
    let mut messages = Vec::new();
    loop {
        match deframer.next_message() {
            Ok(Some(message)) => messages.push(message),
            Ok(None) => break,
            Err(error) => return Whole::Broken(deframe_status(error)),
        }
    }
    match deframer.finish() {
        Ok(()) => Whole::Messages(messages),
        Err(error) => Whole::Broken(deframe_status(error)),
    }
}

/// The client's messages as its handler reads them: the body's DATA is
/// taken (and its HTTP/2 window given back) only as the handler asks for
/// the next message, so a handler that stops reading holds the client to
/// its window. A message that comes in pieces reserves its announced
/// length from the server's receive budget before more of it is taken
/// (the window does not bound it: a client may open many streams, each
/// with most of a message). A body that breaks gRPC's framing ends the
/// call with the reason (`failed`).
fn request_messages(
    body: RecvStream,
    first: Option<Bytes>,
    encoding: Option<Encoding>,
    shared: Arc<Shared>,
    failed: oneshot::Sender<Status>,
) -> Streaming<Bytes> {
    let mut reader = RequestReader {
        body,
        deframer: Deframer::with_encoding(shared.max_message, encoding),
        shared,
        assembling: None,
        failed: Some(failed),
        ended: false,
    };
    if let Some(chunk) = first {
        reader.take(chunk);
    }
    // Boxed: the unfold moves its state in and out of each message's
    // future, and a box is one pointer to move (the reader itself is a few
    // hundred bytes; copying it per message was a tenth of a bidi stream's
    // server CPU).
    Streaming::from_messages(futures_util::stream::unfold(
        Box::new(reader),
        |mut reader| async move {
            let item = reader.next().await?;
            Some((item, reader))
        },
    ))
}

struct RequestReader {
    body: RecvStream,
    deframer: Deframer,
    shared: Arc<Shared>,
    /// The announced length of the message being assembled, and its bytes
    /// of the receive budget.
    assembling: Option<(usize, Option<rpc_core::transport::Reservation>)>,
    failed: Option<oneshot::Sender<Status>>,
    ended: bool,
}

impl RequestReader {
    fn take(&mut self, chunk: Bytes) {
        let _ = self.body.flow_control().release_capacity(chunk.len());
        self.deframer.push(chunk);
    }

    fn fail(&mut self, status: Status) -> Option<Result<Bytes, Status>> {
        self.ended = true;
        if let Some(failed) = self.failed.take() {
            let _ = failed.send(status.clone());
        }
        Some(Err(status))
    }

    async fn next(&mut self) -> Option<Result<Bytes, Status>> {
        if self.ended {
            return None;
        }
        loop {
            match self.deframer.next() {
                Ok(Some(Deframed::Plain(message))) => {
                    // Assembled under a reservation: the message holds it.
                    let message = match self.assembling.take() {
                        Some((_, Some(reservation))) => reservation.attach(message),
                        _ => message,
                    };
                    return Some(Ok(message));
                }
                Ok(Some(Deframed::Compressed(encoding, compressed))) => {
                    self.assembling = None;
                    return match self.inflate(encoding, compressed).await {
                        Ok(message) => Some(Ok(message)),
                        Err(status) => self.fail(status),
                    };
                }
                Ok(None) => {}
                Err(error) => return self.fail(deframe_status(error)),
            }
            // What is left is part of a message: its announced length
            // comes out of the budget (once) before more of it is taken.
            if let Some(len) = self.deframer.pending_len() {
                if self
                    .assembling
                    .as_ref()
                    .is_none_or(|(held, _)| *held != len)
                {
                    let reservation = match &self.shared.budget {
                        Some(budget) => Some(budget.lock().await.reserve(len).await),
                        None => None,
                    };
                    let reservation = match reservation.transpose() {
                        Ok(reservation) => reservation,
                        Err(_) => return self.fail(Status::unavailable("server shutting down")),
                    };
                    self.assembling = Some((len, reservation));
                }
            }
            match self.body.data().await {
                Some(Ok(chunk)) => self.take(chunk),
                Some(Err(error)) => {
                    tracing::debug!(%error, "grpc: request stream ended by an error");
                    self.ended = true;
                    return Some(Err(Status::cancelled(format!(
                        "the client's request stream failed: {error}"
                    ))));
                }
                None => {
                    self.ended = true;
                    return match self.deframer.finish() {
                        Ok(()) => None,
                        Err(error) => self.fail(deframe_status(error)),
                    };
                }
            }
        }
    }

    /// Inflates one compressed request message: it reserves the length its
    /// trailer declares (within the message limit) from the receive budget
    /// first, and the message holds that reservation; one that inflates
    /// past what it declared fails. A large one is inflated off the
    /// runtime's worker threads.
    async fn inflate(&mut self, encoding: Encoding, compressed: Bytes) -> Result<Bytes, Status> {
        let max_message = self.shared.max_message;
        let declared = wire::declared_len(encoding, &compressed).map_err(deframe_status)?;
        if declared > max_message {
            return Err(deframe_status(wire::DeframeError::TooLarge {
                len: declared,
                max: max_message,
            }));
        }
        let reservation = match &self.shared.budget {
            Some(budget) => Some(
                budget
                    .lock()
                    .await
                    .reserve(declared)
                    .await
                    .map_err(|_| Status::unavailable("server shutting down"))?,
            ),
            None => None,
        };
        let message = if declared >= INFLATE_OFF_THREAD {
            tokio::task::spawn_blocking(move || wire::decompress(encoding, &compressed, declared))
                .await
                .map_err(|_| Status::internal("inflating a request message failed"))?
        } else {
            wire::decompress(encoding, &compressed, declared)
        }
        .map_err(deframe_status)?;
        Ok(match reservation {
            Some(reservation) => reservation.attach(message),
            None => message,
        })
    }
}

fn deframe_status(error: wire::DeframeError) -> Status {
    match error {
        wire::DeframeError::TooLarge { .. } => {
            Status::resource_exhausted(format!("request {error} (the server's max_frame_len)"))
        }
        wire::DeframeError::Compressed => Status::unimplemented(error.to_string()),
        wire::DeframeError::Decompress(_) => Status::internal(error.to_string()),
        _ => Status::internal(error.to_string()),
    }
}

/// Answers a request with `status` alone (a trailers-only response).
fn refuse(respond: &mut SendResponse<Bytes>, status: &Status, accept: &HeaderValue) {
    let response = trailers_only(status.code(), status.message(), status.metadata(), accept);
    let _ = respond.send_response(response, true);
}

/// Answers a request that is not gRPC with a bare HTTP status.
fn refuse_http(respond: &mut SendResponse<Bytes>, status: StatusCode) {
    let mut response = Response::new(());
    *response.status_mut() = status;
    let _ = respond.send_response(response, true);
}

/// Checks a new HTTP/2 request and makes the call's request (method,
/// metadata, timeout) and its messages' encoding; answers it here (and
/// returns `None`) when it cannot be a call.
fn open_call(
    request: &http::Request<RecvStream>,
    respond: &mut SendResponse<Bytes>,
    shared: &Shared,
) -> Option<(Request<()>, Option<Encoding>)> {
    let accept = &shared.accept;
    if request.method() != http::Method::POST {
        refuse_http(respond, StatusCode::METHOD_NOT_ALLOWED);
        return None;
    }
    let headers = request.headers();
    if !wire::is_grpc_content_type(headers.get(http::header::CONTENT_TYPE)) {
        refuse_http(respond, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        return None;
    }
    let encoding = match wire::message_encoding(headers, &shared.options.accept_compressed) {
        Ok(encoding) => encoding,
        Err(name) => {
            refuse(
                respond,
                &Status::unimplemented(format!(
                    "grpc-encoding {name:?} is not accepted here (grpc-accept-encoding: {})",
                    accept.to_str().unwrap_or("identity")
                )),
                accept,
            );
            return None;
        }
    };
    let path = request.uri().path();
    if !is_method_path(path) {
        refuse(
            respond,
            &Status::unimplemented(format!(
                "{path:?} is not a method path (/package.Service/Method)"
            )),
            accept,
        );
        return None;
    }
    let mut call = Request::new(());
    if let Some(value) = headers.get("grpc-timeout") {
        match wire::parse_timeout(value) {
            Some(timeout) => call.set_timeout(timeout),
            None => {
                refuse(
                    respond,
                    &Status::invalid_argument(format!(
                        "grpc-timeout {value:?} is not 1 to 8 digits and a unit (H M S m u n)"
                    )),
                    accept,
                );
                return None;
            }
        }
    }
    *call.metadata_mut() = wire::metadata_from_headers(headers);
    call.set_method(path.to_owned());
    Some((call, encoding))
}

/// `/service/method`, both non-empty, within rpc-core's path limit.
fn is_method_path(path: &str) -> bool {
    let Some(rest) = path.strip_prefix('/') else {
        return false;
    };
    let mut parts = rest.split('/');
    let (Some(service), Some(method), None) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    !service.is_empty() && !method.is_empty() && path.len() <= rpc_core::frame::MAX_PATH_LEN
}

/// How one call's messages are encoded: what this server would send,
/// what the client accepts, and (once the response headers went) what the
/// response uses.
struct CallCoding {
    /// The server's encoding for responses ([`crate::GrpcOptions::send_compressed`]).
    send: Option<Encoding>,
    /// What the client's `grpc-accept-encoding` lists.
    client_accepts: wire::EncodingSet,
    /// The response's encoding, chosen with its headers.
    response: Option<Encoding>,
}

impl CallCoding {
    /// The response's encoding: the call's own pick
    /// ([`wire::ENCODING_REQUEST`] in the response metadata), else the
    /// server's; either only if the client accepts it.
    fn choose(&self, metadata: &Metadata) -> Option<Encoding> {
        let wanted = wire::requested_encoding(metadata).unwrap_or(self.send)?;
        self.client_accepts.contains(wanted).then_some(wanted)
    }
}

/// One call's HTTP/2 response: its headers, its messages under HTTP/2's
/// flow control, its trailers. The handler's sink ([`Target`]) writes the
/// messages; the call's future the rest. Both run in the connection's
/// task, one after the other, so the lock is never contended.
struct Writer {
    respond: SendResponse<Bytes>,
    /// Once the response headers went.
    body: Option<SendStream<Bytes>>,
    /// Framed messages HTTP/2 has not taken yet.
    queue: FramedQueue,
    coding: CallCoding,
    shared: Arc<Shared>,
    /// The call is over: a handler that kept its sink sends no more.
    ended: bool,
}

fn lock(writer: &Mutex<Writer>) -> MutexGuard<'_, Writer> {
    writer.lock().unwrap_or_else(|poison| poison.into_inner())
}

impl Drop for Writer {
    fn drop(&mut self) {
        let held = self.queue.held();
        self.shared.queued.fetch_sub(held, Ordering::Relaxed);
    }
}

impl Writer {
    /// Sends the response headers (with `metadata`) unless they went already.
    fn start(&mut self, metadata: &Metadata) -> Result<(), Status> {
        if self.body.is_some() {
            return Ok(());
        }
        let mut response = Response::new(());
        grpc_headers(response.headers_mut(), self.shared.advertised.as_ref());
        self.coding.response = self.coding.choose(metadata);
        if let Some(encoding) = self.coding.response {
            response
                .headers_mut()
                .insert("grpc-encoding", HeaderValue::from_static(encoding.name()));
        }
        wire::metadata_into_headers(metadata, response.headers_mut());
        let body = self
            .respond
            .send_response(response, false)
            .map_err(|error| wire::status_from_h2(&error))?;
        self.body = Some(body);
        Ok(())
    }

    /// Frames `message` behind what is pending (compressed if the response is).
    fn push(&mut self, message: Payload) {
        let before = self.queue.held();
        self.queue.push(message, self.coding.response);
        let after = self.queue.held();
        self.shared
            .queued
            .fetch_add(after - before, Ordering::Relaxed);
    }

    /// Takes messages the sink framed already (see [`plain_prefix`]).
    fn push_framed(&mut self, framed: Payload) {
        self.shared
            .queued
            .fetch_add(framed.len(), Ordering::Relaxed);
        self.queue.push_framed(framed);
    }

    /// Hands what is pending to HTTP/2 as its window allows.
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        let Some(body) = self.body.as_mut() else {
            return Poll::Ready(Ok(()));
        };
        let before = self.queue.held();
        let flushed = self.queue.poll_flush(body, false, cx);
        let sent = before - self.queue.held();
        self.shared.queued.fetch_sub(sent, Ordering::Relaxed);
        flushed.map_err(|error| match error {
            Some(error) => wire::status_from_h2(&error),
            None => Status::cancelled("the stream closed"),
        })
    }

    fn poll_reset(&mut self, cx: &mut Context<'_>) -> Poll<h2::Reason> {
        let reset = match self.body.as_mut() {
            Some(body) => body.poll_reset(cx),
            None => self.respond.poll_reset(cx),
        };
        reset.map(|reset| reset.unwrap_or(h2::Reason::CANCEL))
    }

    /// Ends the response with `status` (its metadata the trailers): in the
    /// headers when none went (trailers-only), else as trailers.
    fn end(&mut self, status: &Status) {
        self.ended = true;
        let result = match self.body.as_mut() {
            Some(body) => body.send_trailers(wire::trailers(
                status.code(),
                status.message(),
                status.metadata(),
            )),
            None => self
                .respond
                .send_response(
                    trailers_only(
                        status.code(),
                        status.message(),
                        status.metadata(),
                        &self.shared.accept,
                    ),
                    true,
                )
                .map(drop),
        };
        if let Err(error) = result {
            tracing::debug!(%error, "grpc: could not end the response");
        }
    }
}

/// Ends a call's response: a unary method's answer (headers, message,
/// trailers), or the trailers after what the handler sent.
async fn finish(writer: &Mutex<Writer>, end: CallEnd) {
    let status = match end {
        CallEnd::Answer(response) => {
            let (metadata, message) = response.into_parts();
            let started = {
                let mut writer = lock(writer);
                writer.start(&metadata).map(|()| writer.push(message))
            };
            match started {
                Ok(()) => Status::new(Code::Ok, ""),
                Err(status) => status,
            }
        }
        CallEnd::Ended(status) => status,
    };
    // What the handler (or the answer) left goes before the trailers.
    if status.code() == Code::Ok || lock(writer).body.is_some() {
        let flushed = std::future::poll_fn(|cx| lock(writer).poll_flush(cx)).await;
        if let Err(error) = flushed {
            tracing::debug!(%error, "grpc: response stream failed");
            return;
        }
    }
    lock(writer).end(&status);
}

/// The handler's sink on a call's [`Writer`].
struct Target(Arc<Mutex<Writer>>);

fn ended() -> Status {
    Status::cancelled("the call has ended")
}

impl MessageTarget for Target {
    fn send_headers(&mut self, metadata: Metadata) -> Result<(), Status> {
        let mut writer = lock(&self.0);
        if writer.ended {
            return Err(ended());
        }
        writer.start(&metadata)
    }

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        let mut writer = lock(&self.0);
        if writer.ended {
            return Poll::Ready(Err(ended()));
        }
        if writer.queue.held() >= PENDING_BYTES {
            return writer.poll_flush(cx);
        }
        Poll::Ready(Ok(()))
    }

    fn start_send(&mut self, message: Payload) -> Result<(), Status> {
        let mut writer = lock(&self.0);
        if writer.ended {
            return Err(ended());
        }
        writer.push(message);
        Ok(())
    }

    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        let mut writer = lock(&self.0);
        if writer.ended {
            return Poll::Ready(Err(ended()));
        }
        writer.poll_flush(cx)
    }

    fn framing(&mut self) -> Option<fn(usize, &mut PayloadBuf)> {
        // A compressed response compresses each message alone.
        let uncompressed = lock(&self.0).coding.response.is_none();
        uncompressed.then_some(plain_prefix as fn(usize, &mut PayloadBuf))
    }

    fn start_send_framed(&mut self, framed: Payload) -> Result<(), Status> {
        let mut writer = lock(&self.0);
        if writer.ended {
            return Err(ended());
        }
        writer.push_framed(framed);
        Ok(())
    }
}

fn grpc_headers(headers: &mut HeaderMap, accept: Option<&HeaderValue>) {
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(wire::CONTENT_TYPE),
    );
    if let Some(accept) = accept {
        headers.insert("grpc-accept-encoding", accept.clone());
    }
}

/// A response that is only headers, with the status in them.
fn trailers_only(
    code: Code,
    message: &str,
    metadata: &Metadata,
    accept: &HeaderValue,
) -> Response<()> {
    let mut response = Response::new(());
    grpc_headers(response.headers_mut(), Some(accept));
    response
        .headers_mut()
        .extend(wire::trailers(code, message, metadata));
    response
}

/// Bytes of one gRPC message the gateway takes, for a frame limit: what
/// fits a MESSAGE frame with its header and length.
pub(crate) fn max_message_for(max_frame_len: usize) -> usize {
    max_frame_len.saturating_sub(HEADER_LEN + 4)
}
