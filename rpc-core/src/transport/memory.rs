//! `mem://name`: connections inside one process, for tests and for measuring
//! the framework without a kernel in the way.
//!
//! Binding registers `name` in a process-wide table until the listener is
//! dropped; connecting creates a pair of bounded frame queues. Frames move as
//! `Bytes` handles, never copied. The server's side reserves each frame in the
//! server's [`ReceiveBudget`] before handing it up (the bytes already exist —
//! the sender made them — so this bounds what the server holds and stops its
//! reading, like TCP's, rather than an allocation).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_core::Stream;
use futures_util::future::BoxFuture;
use futures_util::{FutureExt, SinkExt};
use tokio::sync::mpsc;
use tokio_util::sync::PollSender;

use super::{
    Connection, ConnectionBudget, Endpoint, Listener, ReceiveBudget, Transport, TransportConfig,
    TransportError,
};
use crate::frame::{EncodedFrame, HEADER_LEN};

/// Frames a direction of a connection buffers before the sender waits.
pub const QUEUE_FRAMES: usize = 256;

/// The in-memory transport (registered as `mem`).
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryTransport;

type AcceptQueue = mpsc::UnboundedSender<Connection>;

/// A bound name: listener id, its accept queue, and its server's receive budget.
type Bound = (u64, AcceptQueue, Option<ReceiveBudget>);

/// Bound names → their listeners.
static LISTENERS: LazyLock<Mutex<HashMap<String, Bound>>> = LazyLock::new(Default::default);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn listeners() -> std::sync::MutexGuard<'static, HashMap<String, Bound>> {
    LISTENERS
        .lock()
        .unwrap_or_else(|poison| poison.into_inner())
}

struct FrameReceiver {
    receiver: mpsc::Receiver<EncodedFrame>,
    max_frame_len: usize,
    budget: Option<ConnectionBudget>,
    /// A received frame waiting for room in the budget.
    waiting: Option<Bytes>,
}

impl Stream for FrameReceiver {
    type Item = Result<Bytes, TransportError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        let frame = match this.waiting.take() {
            Some(frame) => frame,
            None => match this.receiver.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Ready(Some(frame)) if frame.len() > this.max_frame_len => {
                    // Skipped, as tcp:// skips it: only its header is kept.
                    let (len, max) = (frame.len(), this.max_frame_len);
                    let head = frame.head.slice(..frame.head.len().min(HEADER_LEN));
                    return Poll::Ready(Some(Err(TransportError::Refused { head, len, max })));
                }
                // The receiver decodes one buffer: a frame sent in two parts
                // is joined here (the one copy tcp:// saves with writev).
                Poll::Ready(Some(frame)) => frame.into_contiguous(),
            },
        };
        let Some(budget) = &mut this.budget else {
            return Poll::Ready(Some(Ok(frame)));
        };
        match budget.poll_reserve(cx, frame.len()) {
            Poll::Pending => {
                this.waiting = Some(frame);
                Poll::Pending
            }
            Poll::Ready(Err(error)) => Poll::Ready(Some(Err(error))),
            Poll::Ready(Ok(reservation)) => Poll::Ready(Some(Ok(reservation.attach(frame)))),
        }
    }
}

fn half(
    sender: mpsc::Sender<EncodedFrame>,
    receiver: mpsc::Receiver<EncodedFrame>,
    max_frame_len: usize,
    budget: Option<ConnectionBudget>,
    peer: String,
) -> Connection {
    Connection {
        sink: Box::pin(PollSender::new(sender).sink_map_err(|_| TransportError::Closed)),
        stream: Box::pin(FrameReceiver {
            receiver,
            max_frame_len,
            budget,
            waiting: None,
        }),
        peer,
    }
}

impl Transport for MemoryTransport {
    fn connect(
        &self,
        endpoint: &Endpoint,
        config: &TransportConfig,
    ) -> BoxFuture<'static, Result<Connection, TransportError>> {
        let name = endpoint.authority().to_owned();
        let max = config.max_frame_len;
        async move {
            let refused = || {
                TransportError::Io(std::io::Error::new(
                    std::io::ErrorKind::ConnectionRefused,
                    format!("nothing listens on mem://{name}"),
                ))
            };
            let (accept, budget) = listeners()
                .get(&name)
                .map(|(_, accept, budget)| (accept.clone(), budget.clone()))
                .ok_or_else(refused)?;
            let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
            let (to_server, server_rx) = mpsc::channel(QUEUE_FRAMES);
            let (to_client, client_rx) = mpsc::channel(QUEUE_FRAMES);
            let server_side = half(
                to_client,
                server_rx,
                max,
                budget.as_ref().map(ReceiveBudget::connection),
                format!("mem://{name}#client-{id}"),
            );
            accept.send(server_side).map_err(|_| refused())?;
            Ok(half(
                to_server,
                client_rx,
                max,
                None,
                format!("mem://{name}"),
            ))
        }
        .boxed()
    }

    fn bind(
        &self,
        endpoint: &Endpoint,
        config: &TransportConfig,
    ) -> BoxFuture<'static, Result<Box<dyn Listener>, TransportError>> {
        let endpoint = endpoint.clone();
        let budget = config.receive_budget.clone();
        async move {
            let name = endpoint.authority().to_owned();
            let (accept, incoming) = mpsc::unbounded_channel();
            let mut table = listeners();
            if table
                .get(&name)
                .is_some_and(|(_, existing, _)| !existing.is_closed())
            {
                return Err(TransportError::Io(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    format!("mem://{name} is already bound"),
                )));
            }
            let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
            table.insert(name.clone(), (id, accept, budget));
            Ok(Box::new(MemoryListener {
                id,
                name,
                endpoint,
                incoming,
            }) as Box<dyn Listener>)
        }
        .boxed()
    }
}

struct MemoryListener {
    id: u64,
    name: String,
    endpoint: Endpoint,
    incoming: mpsc::UnboundedReceiver<Connection>,
}

impl Stream for MemoryListener {
    type Item = Result<Connection, TransportError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.incoming.poll_recv(cx).map(|next| next.map(Ok))
    }
}

impl Listener for MemoryListener {
    fn local_endpoint(&self) -> Endpoint {
        self.endpoint.clone()
    }
}

impl Drop for MemoryListener {
    fn drop(&mut self) {
        let mut table = listeners();
        if table
            .get(&self.name)
            .is_some_and(|(id, _, _)| *id == self.id)
        {
            table.remove(&self.name);
        }
    }
}
