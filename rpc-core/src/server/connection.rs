//! One server connection: read frames, run a task per call, write responses.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::time::Instant;

use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use tokio::sync::mpsc;
use tokio::task::{AbortHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;
use tower::util::BoxCloneSyncService;
use tracing::Instrument;

use super::ServerConfig;
use crate::conn_io::write_frames;
use crate::frame::{Frame, FrameFlags, FrameKind};
use crate::metadata::Metadata;
use crate::request::{PeerInfo, Request, Response};
use crate::status::{Code, Status};
use crate::transport::{Connection, TransportError};

pub(crate) type ServerService = BoxCloneSyncService<Request<Bytes>, Response<Bytes>, Status>;

/// Why a connection ended, for the log.
enum Ending {
    PeerClosed,
    Drained,
    /// The transport failed; nothing more can be sent.
    Failed(String),
    /// The peer broke the protocol: tell it why (GOAWAY with the reason), then close.
    ProtocolError(String),
}

/// Serves one connection until the peer closes it, it breaks, or `shutdown`
/// fires and its in-flight calls are done.
pub(crate) async fn serve_connection(
    connection: Connection,
    service: ServerService,
    config: ServerConfig,
    shutdown: CancellationToken,
) {
    let Connection {
        sink,
        mut stream,
        peer,
    } = connection;
    let (outbound, outbound_rx) = mpsc::unbounded_channel::<Bytes>();
    let writer = tokio::spawn(write_frames(sink, outbound_rx));
    let mut calls: JoinSet<u64> = JoinSet::new();
    let mut in_flight: HashMap<u64, AbortHandle> = HashMap::new();
    let mut draining = false;
    let mut last_call_id = 0;

    let ending = loop {
        tokio::select! {
            () = shutdown.cancelled(), if !draining => {
                draining = true;
                let goaway = Frame::control(FrameKind::GoAway, FrameFlags::EMPTY, last_call_id);
                let _ = outbound.send(goaway.encode());
                if in_flight.is_empty() {
                    break Ending::Drained;
                }
            }
            Some(done) = calls.join_next(), if !calls.is_empty() => {
                if let Ok(call_id) = done {
                    in_flight.remove(&call_id);
                }
                if draining && in_flight.is_empty() {
                    break Ending::Drained;
                }
            }
            next = stream.next() => {
                let bytes = match next {
                    None => break Ending::PeerClosed,
                    Some(Err(rpc_error @ TransportError::Frame(_))) => {
                        break Ending::ProtocolError(format!("bad frame: {rpc_error}"));
                    }
                    Some(Err(error)) => break Ending::Failed(error.to_string()),
                    Some(Ok(bytes)) => bytes,
                };
                let frame = match Frame::decode(bytes, config.max_frame_len) {
                    Ok(frame) => frame,
                    Err(error) => break Ending::ProtocolError(format!("bad frame: {error}")),
                };
                match frame.kind {
                    FrameKind::Request => {
                        let call_id = frame.call_id;
                        if in_flight.contains_key(&call_id) {
                            break Ending::ProtocolError(format!("call id {call_id} reused while in flight"));
                        }
                        last_call_id = last_call_id.max(call_id);
                        let refusal = if draining {
                            Some(Status::unavailable("server is shutting down; retry on a new connection"))
                        } else if in_flight.len() >= config.max_concurrent_calls_per_connection {
                            Some(Status::resource_exhausted(format!(
                                "per-connection limit of {} concurrent calls reached",
                                config.max_concurrent_calls_per_connection
                            )))
                        } else {
                            None
                        };
                        if let Some(status) = refusal {
                            let _ = outbound.send(status_frame(call_id, status).encode());
                            continue;
                        }
                        let call = run_call(frame, service.clone(), peer.clone(), outbound.clone(), config.max_frame_len);
                        in_flight.insert(call_id, calls.spawn(call));
                    }
                    FrameKind::Cancel => {
                        if let Some(handle) = in_flight.remove(&frame.call_id) {
                            tracing::debug!(%peer, call_id = frame.call_id, "call cancelled by client");
                            handle.abort();
                        }
                        if draining && in_flight.is_empty() {
                            break Ending::Drained;
                        }
                    }
                    FrameKind::Ping if !frame.flags.contains(FrameFlags::ACK) => {
                        let pong = Frame::control(FrameKind::Ping, FrameFlags::ACK, frame.call_id);
                        let _ = outbound.send(pong.encode());
                    }
                    FrameKind::Ping | FrameKind::GoAway => {}
                    FrameKind::Response => {
                        break Ending::ProtocolError("client sent a response frame".to_owned());
                    }
                }
            }
        }
    };

    match &ending {
        Ending::PeerClosed => tracing::debug!(%peer, "connection closed by client"),
        Ending::Drained => tracing::debug!(%peer, "connection drained for shutdown"),
        Ending::Failed(reason) => tracing::warn!(%peer, "connection failed: {reason}"),
        Ending::ProtocolError(reason) => {
            tracing::warn!(%peer, "closing connection: {reason}");
            let mut goaway = Frame::control(FrameKind::GoAway, FrameFlags::EMPTY, last_call_id);
            goaway.status = Code::Internal;
            goaway.payload = Bytes::from(reason.clone());
            let _ = outbound.send(goaway.encode());
        }
    }
    // Handlers of a connection that is gone can deliver nothing: abort them.
    calls.shutdown().await;
    drop(outbound);
    match writer.await {
        Ok(Ok(())) | Err(_) => {}
        Ok(Err(error)) => tracing::debug!(%peer, %error, "flushing the last frames failed"),
    }
}

fn status_frame(call_id: u64, status: Status) -> Frame {
    let code = if status.code() == Code::Ok {
        Code::Unknown
    } else {
        status.code()
    };
    let message = Bytes::from(status.message().to_owned());
    Frame::response(call_id, code, status.metadata().clone(), message)
}

async fn run_call(
    frame: Frame,
    service: ServerService,
    peer: String,
    outbound: mpsc::UnboundedSender<Bytes>,
    max_frame_len: usize,
) -> u64 {
    let call_id = frame.call_id;
    let started = Instant::now();
    let span = tracing::debug_span!("rpc.server", method = %frame.path, call_id, %peer);
    let deadline = frame.deadline;
    let mut request = Request::new(frame.payload);
    *request.metadata_mut() = frame.metadata;
    if let Some(deadline) = deadline {
        request.set_timeout(deadline);
    }
    request.set_method(frame.path);
    request.extensions_mut().insert(PeerInfo { addr: peer });

    let handler = AssertUnwindSafe(service.oneshot(request)).catch_unwind();
    let outcome = match deadline {
        Some(deadline) => tokio::time::timeout(deadline, handler)
            .instrument(span.clone())
            .await
            .unwrap_or_else(|_| {
                Ok(Err(Status::deadline_exceeded(
                    "deadline exceeded on the server",
                )))
            }),
        None => handler.instrument(span.clone()).await,
    };
    let response = match outcome {
        Ok(Ok(response)) => {
            let (metadata, payload): (Metadata, Bytes) = response.into_parts();
            Frame::response(call_id, Code::Ok, metadata, payload)
        }
        Ok(Err(status)) => status_frame(call_id, status),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(parent: &span, panic = %what, "handler panicked");
            status_frame(call_id, Status::internal("handler panicked"))
        }
    };
    let response = if response.encoded_len() > max_frame_len {
        let status = Status::resource_exhausted(format!(
            "response of {} bytes exceeds the frame limit of {max_frame_len} bytes",
            response.encoded_len()
        ));
        status_frame(call_id, status)
    } else {
        response
    };
    tracing::debug!(parent: &span, code = ?response.status, elapsed_us = started.elapsed().as_micros() as u64, "call finished");
    let _ = outbound.send(response.encode());
    call_id
}
