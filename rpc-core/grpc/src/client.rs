//! The connecting side: rdma-rpc calls out as standard gRPC over HTTP/2, to
//! any gRPC server.
//!
//! One HTTP/2 connection is one rpc-core [`Connection`]; each call rpc-core
//! opens is one HTTP/2 stream. The [`rpc_core::Channel`] above keeps doing
//! what it does on every transport (deadlines, cancellation, reconnects):
//! its deadline also goes to the server as `grpc-timeout`, and its cancel
//! is an RST_STREAM(CANCEL).

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use h2::SendStream;
use h2::client::{ResponseFuture, SendRequest};
use http::{HeaderValue, Request, StatusCode};
use rpc_core::Payload;
use rpc_core::frame::{Frame, FrameFlags, FrameKind};
use rpc_core::metadata::Metadata;
use rpc_core::stream::SendWindow;
use rpc_core::transport::{Connection, Endpoint, TransportError};
use rpc_core::{Code, Status};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::link::{self, CallReceiver, CallSender, MessageBatch, StreamWindow, ToCore};
use crate::wire::{self, Deframer, Encoding};
use crate::{H2Settings, data};

/// Window given back to rpc-core once this much is owed: less than
/// rpc-core's `GRANT_AT` outstanding never holds a sender back.
const GRANT_BATCH: u64 = 64 << 10;
const _: () = assert!(GRANT_BATCH < rpc_core::stream::GRANT_AT as u64);

/// Opens an HTTP/2 connection to the gRPC server at `endpoint` (inside TLS
/// when `settings` carry it).
pub(crate) async fn connect(
    endpoint: &Endpoint,
    settings: H2Settings,
) -> Result<Connection, TransportError> {
    let port = endpoint
        .port()
        .ok_or_else(|| TransportError::InvalidEndpoint {
            endpoint: endpoint.to_string(),
            reason: "grpc:// needs a port (grpc://host:port)",
        })?;
    let socket = TcpStream::connect((endpoint.host(), port)).await?;
    socket.set_nodelay(true)?;
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
) -> Result<Connection, TransportError>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (send_request, connection) = settings
        .client()
        .handshake::<_, Bytes>(io)
        .await
        .map_err(|error| TransportError::Other(Box::new(error)))?;
    let (core_connection, to_core, from_core, ended) = link::new_connection(endpoint.to_string());
    let authority = endpoint.authority().to_owned();
    tokio::spawn(async move {
        drive(
            send_request,
            connection,
            to_core,
            from_core,
            authority,
            settings,
        )
        .await;
        ended.cancel();
    });
    Ok(core_connection)
}

/// What the gateway keeps of one call in flight.
struct Call {
    /// The server's messages towards rpc-core wait on this window.
    window: Arc<StreamWindow>,
    /// rpc-core's frames for the call, to its task.
    out: CallSender<ClientOut>,
}

/// What rpc-core asks of a call after opening it.
enum ClientOut {
    /// Messages to send; `true` when they are the last.
    Messages(Bytes, bool),
    HalfClose,
    Cancel,
}

async fn drive<T>(
    send_request: SendRequest<Bytes>,
    connection: h2::client::Connection<T, Bytes>,
    to_core: ToCore,
    mut from_core: link::FromCore,
    authority: String,
    settings: H2Settings,
) where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut connection = std::pin::pin!(connection);
    let mut calls: HashMap<u64, Call> = HashMap::new();
    let mut tasks = JoinSet::new();
    let (finished_tx, mut finished) = mpsc::unbounded_channel::<u64>();
    loop {
        tokio::select! {
            ended = &mut connection => {
                if let Err(error) = ended {
                    tracing::debug!(%error, %authority, "grpc: HTTP/2 connection failed");
                }
                break;
            }
            frame = from_core.recv() => {
                let Some(frame) = frame else { break };
                let frame = match link::decode(frame) {
                    Ok(frame) => frame,
                    Err(error) => {
                        tracing::error!(%error, "grpc: rpc-core sent a frame it could not decode");
                        break;
                    }
                };
                let call_id = frame.call_id;
                match frame.kind {
                    FrameKind::Request => {
                        let window = Arc::new(StreamWindow::default());
                        let (out, out_rx) = link::call_queue();
                        let call = run_call(
                            send_request.clone(),
                            frame,
                            out_rx,
                            to_core.clone(),
                            window.clone(),
                            authority.clone(),
                            settings.clone(),
                        );
                        let finished_tx = finished_tx.clone();
                        tasks.spawn(async move {
                            call.await;
                            let _ = finished_tx.send(call_id);
                        });
                        calls.insert(call_id, Call { window, out });
                    }
                    FrameKind::Message => {
                        let last = frame.flags.contains(FrameFlags::END_STREAM);
                        route(&calls, call_id, ClientOut::Messages(frame.payload.into_contiguous(), last));
                    }
                    FrameKind::Headers => route(&calls, call_id, ClientOut::HalfClose),
                    FrameKind::Cancel => {
                        if let Some(call) = calls.remove(&call_id) {
                            call.out.send(ClientOut::Cancel);
                        }
                    }
                    FrameKind::Window => {
                        if let (Some(call), Some(grant)) = (calls.get(&call_id), frame.window_grant()) {
                            call.window.grant(grant);
                        }
                    }
                    FrameKind::Ping if !frame.flags.contains(FrameFlags::ACK) => {
                        let pong = Frame::control(FrameKind::Ping, FrameFlags::ACK, call_id);
                        if to_core.send(pong).await.is_err() {
                            break;
                        }
                    }
                    _ => {}
                }
            }
            Some(call_id) = finished.recv() => {
                calls.remove(&call_id);
            }
        }
    }
    tasks.abort_all();
}

fn route(calls: &HashMap<u64, Call>, call_id: u64, out: ClientOut) {
    if let Some(call) = calls.get(&call_id) {
        call.out.send(out);
    }
}

/// One call: the HTTP/2 request, the client's messages, and the response
/// back to rpc-core; ends silently when rpc-core cancels it.
async fn run_call(
    send_request: SendRequest<Bytes>,
    opening: Frame,
    mut out: CallReceiver<ClientOut>,
    to_core: ToCore,
    window: Arc<StreamWindow>,
    authority: String,
    settings: H2Settings,
) {
    let call_id = opening.call_id;
    // This call's encoding: its own pick, else the channel's.
    let encoding =
        wire::requested_encoding(&opening.metadata).unwrap_or(settings.options.send_compressed);
    let streaming = opening.is_streaming();
    let ended_at_opening = streaming && opening.flags.contains(FrameFlags::END_STREAM);
    // A whole stream (its messages in the opening frame) ends after them.
    let whole = ended_at_opening && !opening.payload.is_empty();
    let request = match build_request(&opening, &authority, encoding, &settings) {
        Ok(request) => request,
        Err(status) => {
            let _ = to_core.send(status_frame(call_id, &status)).await;
            return;
        }
    };
    let opened = async {
        let mut sender = send_request.ready().await?;
        sender.send_request(request, ended_at_opening && !whole)
    };
    // rpc-core's frames for the call wait in `out` meanwhile; a cancel among
    // them resets the stream as soon as it is open.
    let (response, mut body) = match opened.await {
        Ok(opened) => opened,
        Err(error) => {
            let _ = to_core
                .send(status_frame(call_id, &error_status(&error)))
                .await;
            return;
        }
    };
    let first = if !streaming {
        Some(vec![opening.payload.into_contiguous()])
    } else if whole {
        Some(link::split_messages(opening.payload.into_contiguous()))
    } else {
        None
    };
    let write = write_requests(&mut body, &mut out, first, &to_core, call_id, encoding);
    let read = read_response(response, call_id, streaming, &to_core, &window, &settings);
    tokio::select! {
        biased;
        () = write => {}
        end = read => {
            let _ = to_core.send(end).await;
        }
    }
}

/// Sends the client's messages; returns only when rpc-core cancels the call
/// (after resetting the stream). A failed write leaves the end to the
/// response, which says why.
async fn write_requests(
    body: &mut SendStream<Bytes>,
    out: &mut CallReceiver<ClientOut>,
    first: Option<Vec<Bytes>>,
    to_core: &ToCore,
    call_id: u64,
    encoding: Option<Encoding>,
) {
    let mut writing = true;
    let mut ungranted = 0u64;
    // A unary request's message, or a whole stream's: all there is.
    if let Some(messages) = first {
        writing = false;
        let sent = data::write_messages(body, &messages, encoding)
            .await
            .and_then(|()| body.send_data(Bytes::new(), true));
        if let Err(error) = sent {
            tracing::debug!(call_id, %error, "grpc: request failed");
        }
    }
    while let Some(next) = out.recv().await {
        match next {
            ClientOut::Cancel => {
                body.send_reset(h2::Reason::CANCEL);
                return;
            }
            ClientOut::Messages(payload, last) if writing => {
                let messages = link::split_messages(payload);
                let cost: u64 = messages.iter().map(|m| SendWindow::cost(m.len())).sum();
                let mut sent = data::write_messages(body, &messages, encoding).await;
                if last {
                    sent = sent.and_then(|()| body.send_data(Bytes::new(), true));
                    writing = false;
                }
                match sent {
                    Ok(()) => {
                        // HTTP/2 took the bytes: rpc-core may send as many
                        // more (in batches: see GRANT_BATCH).
                        ungranted += cost;
                        if ungranted >= GRANT_BATCH {
                            let grant = ungranted.min(u64::from(u32::MAX)) as u32;
                            ungranted -= u64::from(grant);
                            if to_core.send(Frame::window(call_id, grant)).await.is_err() {
                                return;
                            }
                        }
                    }
                    Err(error) => {
                        tracing::debug!(call_id, %error, "grpc: request stream failed");
                        writing = false;
                    }
                }
            }
            ClientOut::HalfClose if writing => {
                writing = false;
                if let Err(error) = body.send_data(Bytes::new(), true) {
                    tracing::debug!(call_id, %error, "grpc: half-close failed");
                }
            }
            ClientOut::Messages(..) | ClientOut::HalfClose => {}
        }
    }
    // rpc-core dropped the call (its connection is ending): stop the stream.
    body.send_reset(h2::Reason::CANCEL);
}

fn build_request(
    opening: &Frame,
    authority: &str,
    encoding: Option<Encoding>,
    settings: &H2Settings,
) -> Result<Request<()>, Status> {
    let options = &settings.options;
    let uri = http::Uri::builder()
        .scheme(if settings.is_secure() {
            "https"
        } else {
            "http"
        })
        .authority(authority)
        .path_and_query(opening.path.as_str())
        .build()
        .map_err(|error| Status::internal(format!("cannot make a gRPC request URI: {error}")))?;
    let mut request = Request::builder()
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
    if let Some(deadline) = opening.deadline {
        if let Ok(value) = HeaderValue::from_str(&wire::encode_timeout(deadline)) {
            headers.insert("grpc-timeout", value);
        }
    }
    wire::metadata_into_headers(&opening.metadata, headers);
    if !headers.contains_key(http::header::USER_AGENT) {
        headers.insert(
            http::header::USER_AGENT,
            HeaderValue::from_static(concat!("rdma-rpc/", env!("CARGO_PKG_VERSION"))),
        );
    }
    Ok(request)
}

/// The server's response → rpc-core's frames; returns the final one.
async fn read_response(
    response: ResponseFuture,
    call_id: u64,
    streaming: bool,
    to_core: &ToCore,
    window: &StreamWindow,
    settings: &H2Settings,
) -> Frame {
    let fail = |status: Status| status_frame(call_id, &status);
    let response = match response.await {
        Ok(response) => response,
        Err(error) => return fail(error_status(&error)),
    };
    let (parts, mut body) = response.into_parts();
    if parts.status != StatusCode::OK {
        return fail(wire::status_from_http(parts.status));
    }
    if !wire::is_grpc_content_type(parts.headers.get(http::header::CONTENT_TYPE)) {
        return fail(Status::unknown(format!(
            "the server answered with content-type {:?}, not gRPC",
            parts.headers.get(http::header::CONTENT_TYPE)
        )));
    }
    if let Some(status) = wire::status_from_trailers(&parts.headers) {
        // Trailers-only: the status and nothing else.
        return end_frame(call_id, streaming, status, Metadata::new(), None);
    }
    let encoding = match wire::message_encoding(&parts.headers, &settings.options.accept_compressed)
    {
        Ok(encoding) => encoding,
        Err(name) => {
            return fail(Status::internal(format!(
                "the server compressed its response with {name:?}, which this channel does not accept (rpc_grpc::GrpcOptions::accept_compressed)"
            )));
        }
    };
    let headers = wire::metadata_from_headers(&parts.headers);
    if streaming
        && to_core
            .send(Frame::headers(call_id, headers.clone()))
            .await
            .is_err()
    {
        return fail(Status::cancelled("the channel went away"));
    }
    let mut deframer = Deframer::with_encoding(settings.max_message, encoding);
    let mut unary_message = None;
    let mut batch = MessageBatch::default();
    let gone = || Status::cancelled("the channel went away");
    loop {
        let chunk = match body.data().await {
            Some(Ok(chunk)) => chunk,
            Some(Err(error)) => return fail(error_status(&error)),
            None => break,
        };
        let _ = body.flow_control().release_capacity(chunk.len());
        deframer.push(chunk);
        loop {
            let message = match deframer.next_decompressed() {
                Ok(Some(message)) => message,
                Ok(None) => break,
                Err(wire::DeframeError::TooLarge { len, max }) => {
                    return fail(Status::resource_exhausted(format!(
                        "response message of {len} bytes exceeds this channel's limit of {max} bytes (Channel::builder().max_frame_len)"
                    )));
                }
                Err(error) => return fail(Status::internal(format!("bad response: {error}"))),
            };
            if !streaming {
                if unary_message.replace(message).is_some() {
                    return fail(Status::internal(
                        "the server sent more than one response message for a unary call",
                    ));
                }
                continue;
            }
            // The messages ready together go in one frame, under the window.
            if !batch.has_room_for(&message) || !window.try_acquire(message.len()) {
                if batch.flush(to_core, call_id).await.is_err() {
                    return fail(gone());
                }
                window.acquire(message.len()).await;
            }
            batch.push(&message);
        }
        if batch.flush(to_core, call_id).await.is_err() {
            return fail(gone());
        }
    }
    if let Err(error) = deframer.finish() {
        return fail(Status::internal(format!("bad response: {error}")));
    }
    let status = match body.trailers().await {
        Ok(Some(trailers)) => wire::status_from_trailers(&trailers),
        Ok(None) => None,
        Err(error) => return fail(error_status(&error)),
    };
    let Some(status) = status else {
        return fail(Status::internal(
            "the server ended the response without a grpc-status",
        ));
    };
    end_frame(call_id, streaming, status, headers, unary_message)
}

/// The RESPONSE frame that ends a call with `status`; a unary call's
/// carries its one message and the response headers with the trailers.
fn end_frame(
    call_id: u64,
    streaming: bool,
    status: Status,
    headers: Metadata,
    unary_message: Option<Bytes>,
) -> Frame {
    if status.code() != Code::Ok {
        return status_frame(call_id, &status);
    }
    let trailers = status.metadata().clone();
    if streaming {
        return Frame::response(call_id, Code::Ok, trailers, Payload::new());
    }
    let Some(message) = unary_message else {
        return status_frame(
            call_id,
            &Status::internal("the server sent no response message for a unary call"),
        );
    };
    let mut metadata = headers;
    metadata.extend(trailers);
    Frame::response(call_id, Code::Ok, metadata, message)
}

fn status_frame(call_id: u64, status: &Status) -> Frame {
    let code = if status.code() == Code::Ok {
        Code::Unknown
    } else {
        status.code()
    };
    Frame::response(
        call_id,
        code,
        status.metadata().clone(),
        Payload::from(status.message().to_owned()),
    )
}

/// The status of a call that HTTP/2 ended: a reset by the server maps as
/// the specification says; a broken connection is `UNAVAILABLE`.
fn error_status(error: &h2::Error) -> Status {
    match error.reason() {
        Some(reason) if error.is_reset() => wire::status_from_reset(reason),
        _ => Status::unavailable(format!("gRPC connection failed: {error}")),
    }
}
