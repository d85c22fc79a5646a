//! The listening side: standard gRPC clients over HTTP/2 in, rdma-rpc calls
//! out to the [`rpc_core::Server`] that bound the endpoint.
//!
//! Each HTTP/2 connection becomes one rpc-core [`Connection`]; each HTTP/2
//! stream becomes one call, opened as a stream of unknown kind
//! ([`FrameFlags::KIND_UNKNOWN`]) because gRPC's wire does not say whether a
//! method is unary. Per call, one future reads and writes: the request body
//! into MESSAGE frames under the call's window, and rpc-core's HEADERS,
//! MESSAGE and RESPONSE frames into the HTTP/2 response, granting window
//! back as HTTP/2's own flow control takes the bytes. A request whose body
//! came whole with its headers (a unary call from most clients) opens its
//! call with one frame that carries its messages and half-close too.
//!
//! The calls' futures run in the connection's task, beside h2's connection
//! (whose streams share it anyway), so a call costs no task of its own; and
//! that loop never waits on rpc-core itself (the calls do), since rpc-core
//! may be waiting for the calls.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use h2::server::SendResponse;
use h2::{RecvStream, SendStream};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use rpc_core::frame::{Frame, FrameFlags, FrameKind, HEADER_LEN};
use rpc_core::metadata::Metadata;
use rpc_core::stream::SendWindow;
use rpc_core::transport::{Connection, Endpoint, Listener, TransportError};
use rpc_core::wake_gate::WakeGate;
use rpc_core::{Code, Status};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use crate::link::{self, CallReceiver, CallSender, MessageBatch, StreamWindow, ToCore};
use crate::wire::{self, Deframed, Deframer, Encoding};
use crate::{H2Settings, data};

/// Accepted connections waiting for the server to take them.
const ACCEPT_QUEUE: usize = 64;
/// How long a new connection has to finish the HTTP/2 handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a closing connection waits for its streams to finish.
const CLOSE_LINGER: Duration = Duration::from_secs(1);
/// Bytes of rpc-core's messages a connection's writers hold at once, not
/// yet taken by HTTP/2 (whose peer may not read): beyond it, the gateway
/// takes no more frames from rpc-core, whose own outbound queue then fills
/// and holds the handlers back, as on every transport.
const QUEUED_BYTES: usize = 8 << 20;

/// A compressed request message that inflates to this much or more is
/// inflated on a blocking thread, not on a runtime worker.
const INFLATE_OFF_THREAD: usize = 1 << 20;

/// Window given back to rpc-core once this much is owed: less than
/// rpc-core's `GRANT_AT` outstanding never holds a sender back.
pub(crate) const GRANT_BATCH: u64 = 64 << 10;
const _: () = assert!(GRANT_BATCH < rpc_core::stream::GRANT_AT as u64);

/// A bound `grpc://` endpoint.
pub(crate) struct GrpcListener {
    accepted: mpsc::Receiver<Result<Connection, TransportError>>,
    local: Endpoint,
    accept_task: tokio::task::JoinHandle<()>,
}

impl Drop for GrpcListener {
    fn drop(&mut self) {
        self.accept_task.abort();
    }
}

impl futures_core::Stream for GrpcListener {
    type Item = Result<Connection, TransportError>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.accepted.poll_recv(cx)
    }
}

impl Listener for GrpcListener {
    fn local_endpoint(&self) -> Endpoint {
        self.local.clone()
    }
}

/// Listens on `endpoint`; every accepted TCP connection speaks HTTP/2.
pub(crate) async fn bind(
    endpoint: &Endpoint,
    settings: H2Settings,
    budget: Option<rpc_core::transport::ReceiveBudget>,
) -> Result<GrpcListener, TransportError> {
    let listener =
        tokio::net::TcpListener::bind((endpoint.host(), endpoint.port().unwrap_or(0))).await?;
    let local_addr = listener.local_addr()?;
    let local = Endpoint::new(endpoint.scheme(), &local_addr.to_string())?;
    let (queue, accepted) = mpsc::channel(ACCEPT_QUEUE);
    let accept_task = tokio::spawn(async move {
        loop {
            let accepted = listener.accept().await;
            let item = match accepted {
                Ok((socket, peer)) => {
                    let _ = socket.set_nodelay(true);
                    let (connection, to_core, from_core, ended) = link::new_connection(
                        format!("grpc://{peer}"),
                        budget.as_ref().map(|budget| budget.connection()),
                    );
                    let settings = settings.clone();
                    tokio::spawn(async move {
                        serve_socket(socket, settings, to_core, from_core).await;
                        ended.cancel();
                    });
                    Ok(connection)
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

/// What the gateway keeps of one call in flight.
struct Call {
    /// The client's messages towards rpc-core wait on this window (none
    /// when the request came whole: no message follows it).
    window: Option<Arc<StreamWindow>>,
    /// rpc-core's frames for the call, to its future.
    out: CallSender<Out>,
}

/// The calls of one connection, each a future that ends with its call id.
/// They run in the connection's task (as h2's streams share its
/// connection anyway): a call costs no task of its own.
type CallFutures = FuturesUnordered<Pin<Box<dyn Future<Output = u64> + Send>>>;

/// What a call's future writes to the client.
enum Out {
    Headers(Metadata),
    /// Messages, and their bytes of the connection's queue (see [`QUEUED_BYTES`]).
    Messages(Bytes, OwnedSemaphorePermit),
    /// The call's final frame, and the room in the connection's queue of
    /// the answer it carries (a unary method's message).
    End(Frame, Option<OwnedSemaphorePermit>),
    /// The gateway ends the call itself (the client broke a rule).
    Fail(Status),
}

/// A frame from rpc-core waiting for room in the connection's queue.
enum Stashed {
    /// A MESSAGE frame's payload, for its call.
    Messages(u64, Bytes),
    /// A final frame that carries an answer.
    End(Frame),
}

/// Serves an accepted socket: its TLS handshake first on `grpcs://`.
async fn serve_socket(
    socket: TcpStream,
    settings: H2Settings,
    to_core: ToCore,
    from_core: link::FromCore,
) {
    #[cfg(feature = "tls")]
    if let Some(tls) = settings.tls.clone() {
        match tls.server_handshake(socket, crate::TLS_SCHEME).await {
            Ok(stream) => serve_connection(stream, settings, to_core, from_core).await,
            Err(error) => tracing::debug!(%error, "grpcs: TLS handshake failed"),
        }
        return;
    }
    serve_connection(socket, settings, to_core, from_core).await;
}

/// Serves one HTTP/2 connection until the client or rpc-core ends it.
async fn serve_connection<T>(
    socket: T,
    settings: H2Settings,
    to_core: ToCore,
    mut from_core: link::FromCore,
) where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let handshake = settings.server().handshake::<_, Bytes>(socket);
    let mut h2 = match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
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
    let accept = wire::accept_encoding_value(&settings.options.accept_compressed);
    let mut calls: HashMap<u64, Call> = HashMap::new();
    let mut running = CallFutures::new();
    let mut next_call_id = 1u64;
    let mut going_away = false;
    // h2's connection is polled only when it asked to be (it does much
    // work per poll), not on every wake-up of this loop (a frame from
    // rpc-core, a call's progress).
    let h2_woke = WakeGate::new();
    let queued = Arc::new(Semaphore::new(QUEUED_BYTES));
    // A frame that carries messages, waiting for room in the queue.
    let mut stashed: Option<(Stashed, u32)> = None;
    loop {
        tokio::select! {
            room = queued.clone().acquire_many_owned(stashed.as_ref().map_or(0, |s| s.1)), if stashed.is_some() => {
                let (waiting, _) = stashed.take().expect("checked");
                let Ok(room) = room else { break };
                match waiting {
                    Stashed::Messages(call_id, payload) => {
                        route(&calls, call_id, Out::Messages(payload, room));
                    }
                    Stashed::End(frame) => {
                        if let Some(call) = calls.remove(&frame.call_id) {
                            call.out.send(Out::End(frame, Some(room)));
                        }
                    }
                }
            }
            accepted = std::future::poll_fn(|cx| h2_woke.poll(cx, |cx| h2.poll_accept(cx))) => match accepted {
                Some(Ok((request, mut respond))) => {
                    let call_id = next_call_id;
                    next_call_id += 1;
                    let Some((mut opening, request_encoding)) = open_call(call_id, &request, &mut respond, &settings.options, &accept) else {
                        continue;
                    };
                    let coding = CallCoding {
                        accept: accept.clone(),
                        send: settings.options.send_compressed,
                        client_accepts: wire::EncodingSet::accepted_by(request.headers()),
                        response: None,
                    };
                    let mut body = request.into_body();
                    let (out, out_rx) = link::call_queue();
                    // The call's future sends its opening itself: this loop
                    // never waits on rpc-core, which may wait on the calls.
                    // A compressed body is read by `read_requests`, which
                    // reserves what each message declares before inflating it.
                    let whole = if request_encoding.is_some() {
                        Whole::NotYet(None)
                    } else {
                        read_whole(&mut body, settings.max_message)
                    };
                    let call: Pin<Box<dyn Future<Output = ()> + Send>> = match whole {
                        Whole::Stream { messages, taken } => {
                            // One frame for the whole call, and nothing to read.
                            opening.flags = opening.flags | FrameFlags::END_STREAM;
                            opening.payload = messages.into();
                            calls.insert(call_id, Call { window: None, out });
                            let to_core = to_core.clone();
                            Box::pin(async move {
                                if to_core.send(opening).await.is_ok() {
                                    // Accounted for in the frame: the window may go back.
                                    let _ = body.flow_control().release_capacity(taken);
                                    drop(body);
                                    write_responses(respond, out_rx, to_core, call_id, coding).await;
                                }
                            })
                        }
                        Whole::Broken(status) => {
                            refuse(&mut respond, &status, &accept);
                            continue;
                        }
                        Whole::Reset => continue,
                        Whole::NotYet(first) => {
                            let window = Arc::new(StreamWindow::default());
                            let reading = read_requests(body, first, to_core.clone(), window.clone(), out.clone(), call_id, Deframer::with_encoding(settings.max_message, request_encoding));
                            calls.insert(call_id, Call { window: Some(window), out });
                            let to_core = to_core.clone();
                            Box::pin(async move {
                                if to_core.send(opening).await.is_ok() {
                                    serve_call(reading, respond, out_rx, to_core, call_id, coding).await;
                                }
                            })
                        }
                    };
                    running.push(Box::pin(async move {
                        call.await;
                        call_id
                    }));
                }
                Some(Err(error)) => {
                    tracing::debug!(%error, "grpc: HTTP/2 connection failed");
                    break;
                }
                None => break,
            },
            frame = from_core.recv(), if stashed.is_none() => {
                let Some(frame) = frame else {
                    // rpc-core closed the connection: let streams finish, briefly.
                    h2.graceful_shutdown();
                    let _ = tokio::time::timeout(CLOSE_LINGER, async {
                        while let Some(Ok(_)) = h2.accept().await {}
                    }).await;
                    break;
                };
                let frame = match link::decode(frame) {
                    Ok(frame) => frame,
                    Err(error) => {
                        tracing::error!(%error, "grpc: rpc-core sent a frame it could not decode");
                        break;
                    }
                };
                match frame.kind {
                    FrameKind::Headers => route(&calls, frame.call_id, Out::Headers(frame.metadata)),
                    FrameKind::Message => {
                        let payload = frame.payload.into_contiguous();
                        let needed = payload.len().clamp(1, QUEUED_BYTES) as u32;
                        match queued.clone().try_acquire_many_owned(needed) {
                            Ok(room) => route(&calls, frame.call_id, Out::Messages(payload, room)),
                            Err(_) => stashed = Some((Stashed::Messages(frame.call_id, payload), needed)),
                        }
                    }
                    // A unary method's answer rides in its final frame: it
                    // takes room in the queue as messages do, so answers a
                    // peer does not read (a zero HTTP/2 window) hold the
                    // gateway to QUEUED_BYTES, and rpc-core's own queue
                    // then holds the handlers back.
                    FrameKind::Response if !frame.payload.is_empty() => {
                        let needed = frame.payload.len().clamp(1, QUEUED_BYTES) as u32;
                        match queued.clone().try_acquire_many_owned(needed) {
                            Ok(room) => {
                                if let Some(call) = calls.remove(&frame.call_id) {
                                    call.out.send(Out::End(frame, Some(room)));
                                }
                            }
                            Err(_) => stashed = Some((Stashed::End(frame), needed)),
                        }
                    }
                    FrameKind::Response => {
                        if let Some(call) = calls.remove(&frame.call_id) {
                            call.out.send(Out::End(frame, None));
                        }
                    }
                    FrameKind::Window => {
                        let window = calls.get(&frame.call_id).and_then(|call| call.window.as_ref());
                        if let (Some(window), Some(grant)) = (window, frame.window_grant()) {
                            window.grant(grant);
                        }
                    }
                    FrameKind::Ping if !frame.flags.contains(FrameFlags::ACK) => {
                        let pong = Frame::control(FrameKind::Ping, FrameFlags::ACK, frame.call_id);
                        let to_core = to_core.clone();
                        // Beside the calls, for the reason above (0 is no call's id).
                        running.push(Box::pin(async move {
                            let _ = to_core.send(pong).await;
                            0
                        }));
                    }
                    FrameKind::GoAway if !going_away => {
                        going_away = true;
                        h2.graceful_shutdown();
                        h2_woke.open();
                    }
                    _ => {}
                }
            }
            Some(call_id) = running.next(), if !running.is_empty() => {
                calls.remove(&call_id);
            }
        }
    }
    // Dropping the calls' futures ends every call's reader and writer.
    drop(running);
}

/// What a new call's request body holds already (h2 has read it with the
/// headers), without waiting for more.
enum Whole {
    /// The whole body has arrived: its messages, for the opening frame (a
    /// unary call's request, mostly, sent with its headers in one write),
    /// and the bytes taken from the body, whose window goes back once that
    /// frame has reserved its own.
    Stream { messages: Bytes, taken: usize },
    /// More is to come (or might be): the data read so far, if any.
    NotYet(Option<Bytes>),
    /// The body breaks gRPC's framing (the call's answer).
    Broken(Status),
    /// The client reset the stream already.
    Reset,
}

// A whole stream is the messages of one DATA frame (at most
// MAX_FRAME_SIZE bytes, at least 5 a message), sent to rpc-core without
// waiting for window: their cost there (each message's bytes plus
// MESSAGE_CHARGE) must fit a stream's initial window, or rpc-core would take
// a client's many tiny messages for a peer over its window.
const _: () = assert!(
    crate::MAX_FRAME_SIZE as u64
        + (crate::MAX_FRAME_SIZE as u64 / 5) * rpc_core::stream::MESSAGE_CHARGE as u64
        <= rpc_core::stream::INITIAL_WINDOW as u64
);

/// Takes what `body` holds now: its whole stream when it has ended with
/// the first piece of data (or with none).
fn read_whole(body: &mut RecvStream, max_message: usize) -> Whole {
    let chunk = match body.data().now_or_never() {
        None => return Whole::NotYet(None),
        Some(None) => {
            return Whole::Stream {
                messages: Bytes::new(),
                taken: 0,
            };
        }
        Some(Some(Err(_))) => return Whole::Reset,
        Some(Some(Ok(chunk))) => chunk,
    };
    if !body.is_end_stream() {
        return Whole::NotYet(Some(chunk));
    }
    let taken = chunk.len();
    let mut deframer = Deframer::new(max_message);
    deframer.push(chunk);
    let mut batch = MessageBatch::default();
    let broken = |body: &mut RecvStream, error| {
        // Nothing of it is kept.
        let _ = body.flow_control().release_capacity(taken);
        Whole::Broken(deframe_status(error))
    };
    loop {
        match deframer.next_message() {
            Ok(Some(message)) => batch.push(&message),
            Ok(None) => break,
            Err(error) => return broken(body, error),
        }
    }
    match deframer.finish() {
        Ok(()) => Whole::Stream {
            messages: batch.take(),
            taken,
        },
        Err(error) => broken(body, error),
    }
}

/// One call's two directions in one future: `reading` (the request body
/// towards rpc-core) and rpc-core's answer towards the client. The call is
/// over when its answer is: a request body the client has not ended by then
/// is dropped, and h2 resets it with `NO_ERROR`, as HTTP/2 asks of a server
/// that answers before it read the whole request.
///
/// Both are pinned here, in the future's own state.
async fn serve_call(
    reading: impl Future<Output = ()>,
    respond: SendResponse<Bytes>,
    out: CallReceiver<Out>,
    to_core: ToCore,
    call_id: u64,
    coding: CallCoding,
) {
    let writing = write_responses(respond, out, to_core, call_id, coding);
    let (mut reading, mut writing) = (std::pin::pin!(reading), std::pin::pin!(writing));
    tokio::select! {
        () = &mut writing => {}
        () = &mut reading => writing.await,
    }
}

fn route(calls: &HashMap<u64, Call>, call_id: u64, out: Out) {
    if let Some(call) = calls.get(&call_id) {
        call.out.send(out);
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

/// Checks a new HTTP/2 request and makes the frame that opens its call in
/// rpc-core; answers it here (and returns `None`) when it cannot be one.
fn open_call(
    call_id: u64,
    request: &Request<RecvStream>,
    respond: &mut SendResponse<Bytes>,
    options: &crate::GrpcOptions,
    accept: &HeaderValue,
) -> Option<(Frame, Option<Encoding>)> {
    if request.method() != http::Method::POST {
        refuse_http(respond, StatusCode::METHOD_NOT_ALLOWED);
        return None;
    }
    let headers = request.headers();
    if !wire::is_grpc_content_type(headers.get(http::header::CONTENT_TYPE)) {
        refuse_http(respond, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        return None;
    }
    let encoding = match wire::message_encoding(headers, &options.accept_compressed) {
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
    let deadline = match headers.get("grpc-timeout") {
        None => None,
        Some(value) => match wire::parse_timeout(value) {
            Some(timeout) => Some(timeout),
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
        },
    };
    let metadata = wire::metadata_from_headers(headers);
    let mut opening = Frame::stream_request(call_id, path, deadline, metadata);
    opening.flags = FrameFlags::STREAMING | FrameFlags::KIND_UNKNOWN;
    Some((opening, encoding))
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

/// The client's request body → MESSAGE frames (the messages ready together
/// in one), under the call's window; the end of the body → the half-close
/// (on the last message frame when it came with it); a reset → a cancel.
async fn read_requests(
    mut body: RecvStream,
    mut first: Option<Bytes>,
    to_core: ToCore,
    window: Arc<StreamWindow>,
    fail: CallSender<Out>,
    call_id: u64,
    mut deframer: Deframer,
) {
    let max_message = deframer.max();
    let mut batch = MessageBatch::default();
    // Held while a message that came in pieces is assembled: its announced
    // bytes, from the server's receive budget. HTTP/2's window is given
    // back as each piece is taken, so the window does not bound what the
    // gateway holds (a client may open a thousand streams, each with most
    // of a message): the budget does.
    let mut assembling: Option<(usize, Option<rpc_core::transport::Reservation>)> = None;
    loop {
        let next = match first.take() {
            Some(chunk) => Some(Ok(chunk)),
            None => body.data().await,
        };
        match next {
            Some(Ok(chunk)) => {
                let chunk_len = chunk.len();
                deframer.push(chunk);
                loop {
                    let message = match deframer.next() {
                        Ok(Some(Deframed::Plain(message))) => message,
                        Ok(Some(Deframed::Compressed(encoding, compressed))) => {
                            assembling = None;
                            // What came before goes first, in order.
                            if batch.flush(&to_core, call_id).await.is_err() {
                                return;
                            }
                            let sent = send_decompressed(
                                &to_core,
                                &window,
                                call_id,
                                encoding,
                                compressed,
                                max_message,
                            )
                            .await;
                            match sent {
                                Ok(true) => continue,
                                Ok(false) => return,
                                Err(status) => {
                                    fail.send(Out::Fail(status));
                                    return;
                                }
                            }
                        }
                        Ok(None) => break,
                        Err(error) => {
                            fail.send(Out::Fail(deframe_status(error)));
                            return;
                        }
                    };
                    // Whole: its frame reserves its own bytes on the way in.
                    assembling = None;
                    if !batch.has_room_for(&message) || !window.try_acquire(message.len()) {
                        if batch.flush(&to_core, call_id).await.is_err() {
                            return;
                        }
                        window.acquire(message.len()).await;
                    }
                    batch.push(&message);
                }
                // The body's end came with this data: it rides on the batch.
                let ended = body.is_end_stream();
                if ended && deframer.finish().is_err() {
                    continue;
                }
                if !batch.is_empty() {
                    if to_core
                        .send(batch.take_frame(call_id, ended))
                        .await
                        .is_err()
                    {
                        return;
                    }
                    if ended {
                        return;
                    }
                }
                // The whole messages went in frames, which reserved their
                // bytes. What is left is one message being assembled: its
                // announced length comes out of the budget (once) before
                // the peer may send more of it.
                if let Some(len) = deframer.pending_len() {
                    if assembling.as_ref().is_none_or(|(held, _)| *held != len) {
                        match to_core.reserve(len).await {
                            Ok(reservation) => assembling = Some((len, reservation)),
                            Err(_) => return,
                        }
                    }
                }
                let _ = body.flow_control().release_capacity(chunk_len);
            }
            Some(Err(error)) => {
                tracing::debug!(call_id, %error, "grpc: request stream ended by an error");
                let _ = to_core
                    .send(Frame::control(
                        FrameKind::Cancel,
                        FrameFlags::EMPTY,
                        call_id,
                    ))
                    .await;
                return;
            }
            None => {
                if let Err(error) = deframer.finish() {
                    fail.send(Out::Fail(deframe_status(error)));
                    return;
                }
                let _ = to_core.send(Frame::half_close(call_id)).await;
                return;
            }
        }
    }
}

/// Inflates one compressed request message and hands it to rpc-core as a
/// frame of its own. It waits for the call's window first (holding nothing
/// of the budget meanwhile, as a plain message does), then reserves the
/// length its trailer declares (within `max_message`) from the receive
/// budget, and the frame carries that reservation: a small message that
/// would inflate to a large one makes the gateway hold no more than the
/// budget allows, and one that inflates past what it declared fails. A
/// large one is inflated off the runtime's worker threads.
/// `Ok(false)`: rpc-core is gone.
async fn send_decompressed(
    to_core: &ToCore,
    window: &StreamWindow,
    call_id: u64,
    encoding: Encoding,
    compressed: Bytes,
    max_message: usize,
) -> Result<bool, Status> {
    let declared = wire::declared_len(encoding, &compressed).map_err(deframe_status)?;
    if declared > max_message {
        return Err(deframe_status(wire::DeframeError::TooLarge {
            len: declared,
            max: max_message,
        }));
    }
    window.acquire(declared).await;
    let mut batch = MessageBatch::default();
    let frame_len = MessageBatch::frame_len_for(declared);
    let Ok(reservation) = to_core.reserve(frame_len).await else {
        return Ok(false);
    };
    let message = if declared >= INFLATE_OFF_THREAD {
        let inflating =
            tokio::task::spawn_blocking(move || wire::decompress(encoding, &compressed, declared));
        inflating
            .await
            .map_err(|_| Status::internal("inflating a request message failed"))?
    } else {
        let inflated = wire::decompress(encoding, &compressed, declared);
        drop(compressed);
        inflated
    }
    .map_err(deframe_status)?;
    batch.push(&message);
    drop(message);
    Ok(to_core
        .send_reserved(batch.take_frame(call_id, false), reservation)
        .await
        .is_ok())
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

/// rpc-core's frames for one call → its HTTP/2 response. A reset from the
/// client cancels the call in rpc-core.
async fn write_responses(
    mut respond: SendResponse<Bytes>,
    mut out: CallReceiver<Out>,
    to_core: ToCore,
    call_id: u64,
    mut coding: CallCoding,
) {
    let cancel = || Frame::control(FrameKind::Cancel, FrameFlags::EMPTY, call_id);
    let mut body: Option<SendStream<Bytes>> = None;
    let mut ungranted = 0u64;
    loop {
        let next = tokio::select! {
            next = out.recv() => next,
            reset = reset_of(&mut respond, &mut body) => {
                tracing::debug!(call_id, ?reset, "grpc: client reset the stream");
                let _ = to_core.send(cancel()).await;
                return;
            }
        };
        let result = match next {
            // rpc-core dropped the call without an end: its connection ended.
            None => {
                send_reset(&mut respond, &mut body, h2::Reason::INTERNAL_ERROR);
                return;
            }
            Some(Out::Headers(metadata)) => {
                start_body(&mut respond, &mut body, &metadata, &mut coding)
            }
            Some(Out::Messages(payload, room)) => {
                let messages = link::split_messages(payload);
                let cost: u64 = messages.iter().map(|m| SendWindow::cost(m.len())).sum();
                let sent = send_messages(
                    &mut respond,
                    &mut body,
                    &Metadata::new(),
                    &messages,
                    &mut coding,
                )
                .await;
                // HTTP/2 took them (or the stream failed): their room is free.
                drop(room);
                ungranted += cost;
                // Less than rpc-core's GRANT_AT ungranted never holds its
                // sender back, so grants go in batches (none for a unary call).
                if sent.is_ok() && ungranted >= GRANT_BATCH {
                    let grant = ungranted.min(u64::from(u32::MAX)) as u32;
                    ungranted -= u64::from(grant);
                    if grant > 0 && to_core.send(Frame::window(call_id, grant)).await.is_err() {
                        return;
                    }
                }
                sent
            }
            Some(Out::End(frame, room)) => {
                finish(&mut respond, &mut body, frame, &mut coding).await;
                // HTTP/2 took the answer (or the stream failed).
                drop(room);
                return;
            }
            Some(Out::Fail(status)) => {
                let _ = to_core.send(cancel()).await;
                finish_with(&mut respond, &mut body, &status, &coding.accept);
                return;
            }
        };
        if let Err(error) = result {
            tracing::debug!(call_id, %error, "grpc: response stream failed");
            let _ = to_core.send(cancel()).await;
            return;
        }
    }
}

/// Waits for the client to reset the stream.
async fn reset_of(
    respond: &mut SendResponse<Bytes>,
    body: &mut Option<SendStream<Bytes>>,
) -> Result<h2::Reason, h2::Error> {
    std::future::poll_fn(|cx| match body {
        Some(stream) => stream.poll_reset(cx),
        None => respond.poll_reset(cx),
    })
    .await
}

fn send_reset(
    respond: &mut SendResponse<Bytes>,
    body: &mut Option<SendStream<Bytes>>,
    reason: h2::Reason,
) {
    match body {
        Some(stream) => stream.send_reset(reason),
        None => respond.send_reset(reason),
    }
}

/// Sends the response headers (with `metadata`) unless they went already.
fn start_body(
    respond: &mut SendResponse<Bytes>,
    body: &mut Option<SendStream<Bytes>>,
    metadata: &Metadata,
    coding: &mut CallCoding,
) -> Result<(), h2::Error> {
    if body.is_none() {
        let mut response = Response::new(());
        grpc_headers(response.headers_mut(), &coding.accept);
        coding.response = coding.choose(metadata);
        if let Some(encoding) = coding.response {
            response
                .headers_mut()
                .insert("grpc-encoding", HeaderValue::from_static(encoding.name()));
        }
        wire::metadata_into_headers(metadata, response.headers_mut());
        *body = Some(respond.send_response(response, false)?);
    }
    Ok(())
}

/// How one call's messages are encoded: what this server accepts, what it
/// would send, what the client accepts, and (once the response headers
/// went) what the response uses.
struct CallCoding {
    /// This server's `grpc-accept-encoding`.
    accept: HeaderValue,
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

/// Sends the response headers (with `metadata`) unless they went already,
/// then `messages`, as HTTP/2's flow control lets them go.
async fn send_messages(
    respond: &mut SendResponse<Bytes>,
    body: &mut Option<SendStream<Bytes>>,
    metadata: &Metadata,
    messages: &[Bytes],
    coding: &mut CallCoding,
) -> Result<(), h2::Error> {
    start_body(respond, body, metadata, coding)?;
    match body.as_mut() {
        Some(stream) => data::write_messages(stream, messages, coding.response).await,
        None => Ok(()),
    }
}

fn grpc_headers(headers: &mut HeaderMap, accept: &HeaderValue) {
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(wire::CONTENT_TYPE),
    );
    headers.insert("grpc-accept-encoding", accept.clone());
}

/// Ends the response with rpc-core's final frame for the call. An OK end
/// with no headers before it is a unary method's answer (every call here is
/// of unknown kind): its metadata and message, then the trailers.
async fn finish(
    respond: &mut SendResponse<Bytes>,
    body: &mut Option<SendStream<Bytes>>,
    frame: Frame,
    coding: &mut CallCoding,
) {
    if frame.status != Code::Ok {
        let message = String::from_utf8_lossy(&frame.payload.into_contiguous()).into_owned();
        let status = Status::with_metadata(frame.status, message, frame.metadata);
        return finish_with(respond, body, &status, &coding.accept);
    }
    if body.is_none() {
        let message = frame.payload.into_contiguous();
        if let Err(error) = send_messages(respond, body, &frame.metadata, &[message], coding).await
        {
            tracing::debug!(%error, "grpc: could not send the answer");
            return;
        }
        return finish_with(respond, body, &Status::new(Code::Ok, ""), &coding.accept);
    }
    finish_with(
        respond,
        body,
        &Status::with_metadata(Code::Ok, "", frame.metadata),
        &coding.accept,
    );
}

fn finish_with(
    respond: &mut SendResponse<Bytes>,
    body: &mut Option<SendStream<Bytes>>,
    status: &Status,
    accept: &HeaderValue,
) {
    let result = match body {
        Some(stream) => stream.send_trailers(wire::trailers(
            status.code(),
            status.message(),
            status.metadata(),
        )),
        None => respond
            .send_response(
                trailers_only(status.code(), status.message(), status.metadata(), accept),
                true,
            )
            .map(drop),
    };
    if let Err(error) = result {
        tracing::debug!(%error, "grpc: could not end the response");
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
    grpc_headers(response.headers_mut(), accept);
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
