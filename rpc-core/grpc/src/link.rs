//! The rdma-rpc side of a `grpc://` channel's connection: the
//! [`Connection`] rpc-core's client reads frames from and writes frames to,
//! and the client gateway's handles on it. (The server side has no such
//! link: it is a front end that calls the server's routes, `server.rs`.)

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures_util::Sink;
use futures_util::task::AtomicWaker;
use rpc_core::Payload;
use rpc_core::frame::{EncodedFrame, Frame, FrameError, FrameFlags, FrameKind};
use rpc_core::stream::{BATCH_BYTES, SendWindow};
use rpc_core::transport::{Connection, TransportError};
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::{CancellationToken, PollSender};

/// Frames queued towards rpc-core before a sender waits.
const TO_CORE_QUEUE: usize = 64;
/// Frames queued from rpc-core before rpc-core waits. Few: rpc-core counts a
/// frame as written once it is here, so what waits here is held beside the
/// gateway's own bounded queue. At 4, a stream's messages/s and 1 MiB echoes
/// lost 10-35% (the gateway and rpc-core's writer took turns); 16 measured
/// as 64 did.
const FROM_CORE_QUEUE: usize = 16;
/// Bytes of frames queued from rpc-core before rpc-core waits (it may pass
/// it by one frame): with [`FROM_CORE_QUEUE`] alone, 16 answers of the
/// largest frame a peer that reads nothing (a zero HTTP/2 window) makes a
/// connection hold.
const FROM_CORE_BYTES: usize = 4 << 20;

/// Where the gateway hands frames to rpc-core. Cloned into every call's
/// tasks.
#[derive(Clone)]
pub(crate) struct ToCore {
    frames: mpsc::Sender<Result<Bytes, TransportError>>,
}

/// rpc-core no longer reads this connection.
#[derive(Debug)]
pub(crate) struct CoreGone;

impl ToCore {
    /// Hands `frame` to rpc-core, waiting while its queue is full.
    pub(crate) async fn send(&self, frame: Frame) -> Result<(), CoreGone> {
        let bytes = frame.encode();
        match self.frames.try_send(Ok(bytes)) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(frame)) => {
                self.frames.send(frame).await.map_err(|_| CoreGone)
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Err(CoreGone),
        }
    }
}

/// A new translated connection: what rpc-core gets, where the gateway puts
/// frames for it, where it takes rpc-core's frames from, and the token that
/// ends rpc-core's frame stream once the gateway's connection is over.
pub(crate) fn new_connection(peer: String) -> (Connection, ToCore, FromCore, CancellationToken) {
    let (to_core, mut core_reads) = mpsc::channel(TO_CORE_QUEUE);
    let (core_writes, frames_from_core) = mpsc::channel(FROM_CORE_QUEUE);
    let queued = Arc::new(QueuedBytes::default());
    let from_core = FromCore {
        frames: frames_from_core,
        queued: queued.clone(),
    };
    let ended = CancellationToken::new();
    let mut ended_wait = Box::pin(ended.clone().cancelled_owned());
    let stream = futures_util::stream::poll_fn(move |cx| match core_reads.poll_recv(cx) {
        Poll::Ready(Some(frame)) => Poll::Ready(Some(frame)),
        Poll::Ready(None) => Poll::Ready(None),
        // Call tasks may still hold senders: the connection's end ends the stream.
        Poll::Pending => ended_wait.as_mut().poll(cx).map(|()| None),
    });
    let sink = ToGateway {
        frames: PollSender::new(core_writes),
        queued,
    };
    let connection = Connection {
        sink: Box::pin(sink),
        stream: Box::pin(stream),
        peer,
    };
    let to_core = ToCore { frames: to_core };
    (connection, to_core, from_core, ended)
}

/// Bytes of rpc-core's frames that the gateway has not taken yet, and
/// rpc-core's writer waiting for them to drop below [`FROM_CORE_BYTES`].
#[derive(Default)]
struct QueuedBytes {
    bytes: AtomicUsize,
    room: AtomicWaker,
}

/// The sink rpc-core writes a translated connection's frames to: bounded
/// in frames ([`FROM_CORE_QUEUE`]) and in bytes ([`FROM_CORE_BYTES`]).
struct ToGateway {
    frames: PollSender<EncodedFrame>,
    queued: Arc<QueuedBytes>,
}

impl Sink<EncodedFrame> for ToGateway {
    type Error = TransportError;

    fn poll_ready(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        let full = || self.queued.bytes.load(Ordering::Acquire) >= FROM_CORE_BYTES;
        if full() {
            self.queued.room.register(cx.waker());
            // The gateway may have taken a frame before we registered.
            if full() {
                return Poll::Pending;
            }
        }
        self.frames
            .poll_reserve(cx)
            .map_err(|_| TransportError::Closed)
    }

    fn start_send(mut self: Pin<&mut Self>, frame: EncodedFrame) -> Result<(), Self::Error> {
        self.queued.bytes.fetch_add(frame.len(), Ordering::AcqRel);
        self.frames
            .send_item(frame)
            .map_err(|_| TransportError::Closed)
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn poll_close(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.frames.close();
        Poll::Ready(Ok(()))
    }
}

/// Where the gateway takes rpc-core's frames from; taking one makes room
/// for rpc-core's writer.
pub(crate) struct FromCore {
    frames: mpsc::Receiver<EncodedFrame>,
    queued: Arc<QueuedBytes>,
}

impl FromCore {
    /// The next frame rpc-core wrote; `None` once rpc-core closed the
    /// connection. Cancel-safe (as `mpsc::Receiver::recv`).
    pub(crate) async fn recv(&mut self) -> Option<EncodedFrame> {
        let frame = self.frames.recv().await?;
        self.queued.bytes.fetch_sub(frame.len(), Ordering::AcqRel);
        self.queued.room.wake();
        Some(frame)
    }
}

/// A frame rpc-core sent, decoded. rpc-core's own frames are valid; an
/// error here is a bug, and ends the connection.
pub(crate) fn decode(frame: EncodedFrame) -> Result<Frame, FrameError> {
    Frame::decode(frame.into_contiguous(), usize::MAX)
}

/// Messages for one MESSAGE frame towards rpc-core: as many as are ready,
/// up to [`BATCH_BYTES`], so that a stream of small messages costs a frame
/// per batch, not per message (as rdma-rpc's own senders do).
#[derive(Debug, Default)]
pub(crate) struct MessageBatch {
    payload: BytesMut,
}

impl MessageBatch {
    /// Whether `message` still fits the batch (an empty batch takes any).
    pub(crate) fn has_room_for(&self, message: &[u8]) -> bool {
        self.payload.is_empty() || self.payload.len() + 4 + message.len() <= BATCH_BYTES
    }

    pub(crate) fn push(&mut self, message: &[u8]) {
        self.payload.reserve(4 + message.len());
        self.payload.put_u32_le(message.len() as u32);
        self.payload.put_slice(message);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.payload.is_empty()
    }

    /// Hands what the batch holds (if anything) to rpc-core as one MESSAGE
    /// frame, not the sender's last.
    pub(crate) async fn flush(&mut self, to_core: &ToCore, call_id: u64) -> Result<(), CoreGone> {
        if self.is_empty() {
            return Ok(());
        }
        to_core.send(self.take_frame(call_id, false)).await
    }

    /// The batch as a MESSAGE frame (`last`: the sender's last), leaving it empty.
    pub(crate) fn take_frame(&mut self, call_id: u64, last: bool) -> Frame {
        let flags = if last {
            FrameFlags::END_STREAM
        } else {
            FrameFlags::EMPTY
        };
        let mut frame = Frame::control(FrameKind::Message, flags, call_id);
        frame.payload = Payload::from(self.payload.split().freeze());
        frame
    }
}

/// The messages of a MESSAGE frame's payload (`u32` LE length, bytes, …).
pub(crate) fn split_messages(mut payload: Bytes) -> Vec<Bytes> {
    let mut messages = Vec::new();
    while payload.len() >= 4 {
        let len = payload.get_u32_le() as usize;
        if len > payload.len() {
            break;
        }
        messages.push(payload.split_to(len));
    }
    messages
}

/// What the connection's task hands one call's task: rpc-core's frames
/// for the call. Unbounded here because what goes in is bounded where it is
/// made (a connection's queued bytes, the call's window); and it allocates
/// nothing until the first item, little then, where a tokio channel's first
/// block holds 32 items: per call, that was the largest allocation.
pub(crate) fn call_queue<T>() -> (CallSender<T>, CallReceiver<T>) {
    let shared = Arc::new(Mutex::new(CallQueue {
        items: VecDeque::new(),
        waker: None,
        senders: 1,
    }));
    (CallSender(shared.clone()), CallReceiver(shared))
}

struct CallQueue<T> {
    items: VecDeque<T>,
    waker: Option<Waker>,
    senders: usize,
}

fn lock<T>(queue: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    queue.lock().unwrap_or_else(|poison| poison.into_inner())
}

/// The sending side of [`call_queue`]; the queue ends when every sender is dropped.
pub(crate) struct CallSender<T>(Arc<Mutex<CallQueue<T>>>);

impl<T> CallSender<T> {
    /// Queues `item` for the call's task.
    pub(crate) fn send(&self, item: T) {
        let waker = {
            let mut queue = lock(&self.0);
            queue.items.push_back(item);
            queue.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl<T> Clone for CallSender<T> {
    fn clone(&self) -> Self {
        lock(&self.0).senders += 1;
        CallSender(self.0.clone())
    }
}

impl<T> Drop for CallSender<T> {
    fn drop(&mut self) {
        let waker = {
            let mut queue = lock(&self.0);
            queue.senders -= 1;
            if queue.senders == 0 {
                queue.waker.take()
            } else {
                None
            }
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// The receiving side of [`call_queue`].
pub(crate) struct CallReceiver<T>(Arc<Mutex<CallQueue<T>>>);

impl<T> CallReceiver<T> {
    /// The next item; `None` once every sender is gone and the queue is empty.
    pub(crate) async fn recv(&mut self) -> Option<T> {
        std::future::poll_fn(|cx| {
            let mut queue = lock(&self.0);
            if let Some(item) = queue.items.pop_front() {
                return Poll::Ready(Some(item));
            }
            if queue.senders == 0 {
                return Poll::Ready(None);
            }
            queue.waker = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }
}

/// One stream direction's window towards rpc-core: the gateway waits in
/// [`acquire`](StreamWindow::acquire) before it hands rpc-core a message,
/// and rpc-core's WINDOW frames [`grant`](StreamWindow::grant) more.
#[derive(Debug, Default)]
pub(crate) struct StreamWindow {
    window: Mutex<SendWindow>,
    room: Notify,
}

impl StreamWindow {
    pub(crate) fn grant(&self, grant: u32) {
        self.lock().grant(grant);
        self.room.notify_one();
    }

    /// Counts a message of `len` bytes if it may go now.
    pub(crate) fn try_acquire(&self, len: usize) -> bool {
        let cost = SendWindow::cost(len);
        let mut window = self.lock();
        let fits = window.fits(cost);
        if fits {
            window.consume(cost);
        }
        fits
    }

    /// Waits until a message of `len` bytes may go, and counts it.
    pub(crate) async fn acquire(&self, len: usize) {
        let cost = SendWindow::cost(len);
        loop {
            {
                let mut window = self.lock();
                if window.fits(cost) {
                    window.consume(cost);
                    return;
                }
            }
            // `notify_one` keeps a permit when no one waits: no lost grant.
            self.room.notified().await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SendWindow> {
        self.window
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rpc_core::stream::{GRANT_AT, INITIAL_WINDOW};
    use std::time::Duration;

    #[test]
    fn message_frames_split_into_their_messages() {
        let frame = Frame::message(3, Bytes::from_static(b"abc"), false);
        let payload = frame.payload.clone().into_contiguous();
        assert_eq!(split_messages(payload), vec![Bytes::from_static(b"abc")]);
        let mut two = Vec::new();
        for message in [&b"x"[..], b""] {
            two.extend_from_slice(&(message.len() as u32).to_le_bytes());
            two.extend_from_slice(message);
        }
        assert_eq!(split_messages(Bytes::from(two)).len(), 2);
    }

    #[test]
    fn a_batch_is_one_message_frame_of_several_messages_up_to_its_size() {
        let mut batch = MessageBatch::default();
        batch.push(b"one");
        batch.push(b"");
        assert!(batch.has_room_for(&[0u8; 1000]));
        assert!(!batch.has_room_for(&vec![0u8; BATCH_BYTES]));
        let frame = batch.take_frame(9, true);
        assert!(batch.is_empty());
        assert_eq!(frame.kind, FrameKind::Message);
        assert!(frame.flags.contains(FrameFlags::END_STREAM));
        // What rpc-core decodes from it.
        let decoded = Frame::decode(frame.encode(), usize::MAX).unwrap();
        let messages = split_messages(decoded.payload.into_contiguous());
        assert_eq!(messages, [Bytes::from_static(b"one"), Bytes::new()]);
        // An empty batch takes even a message larger than a batch.
        assert!(batch.has_room_for(&vec![0u8; 2 * BATCH_BYTES]));
    }

    /// A peer that reads nothing holds at most [`FROM_CORE_BYTES`] (plus
    /// one frame) of rpc-core's answers here, however large they are, and
    /// at most [`FROM_CORE_QUEUE`] frames however small.
    #[tokio::test]
    async fn what_rpc_core_hands_the_gateway_is_bounded_in_bytes_and_in_frames() {
        let (mut connection, _to_core, mut from_core, _ended) = new_connection("test".into());
        let answer = |len: usize| EncodedFrame {
            head: Bytes::from(vec![0u8; 16]),
            payload: Payload::from(Bytes::from(vec![7u8; len])),
        };
        let ready = |connection: &mut Connection| {
            let mut cx = Context::from_waker(Waker::noop());
            connection.sink.as_mut().poll_ready(&mut cx).is_ready()
        };
        // 1 MiB answers: rpc-core waits once the bytes reach the bound.
        let mut sent = 0;
        while ready(&mut connection) {
            connection
                .sink
                .as_mut()
                .start_send(answer(1 << 20))
                .unwrap();
            sent += 1;
            assert!(sent <= FROM_CORE_QUEUE, "never held back");
        }
        assert_eq!(sent, FROM_CORE_BYTES.div_ceil((1 << 20) + 16));
        // Taking one makes room for one more.
        assert!(from_core.recv().await.is_some());
        assert!(ready(&mut connection));
        connection
            .sink
            .as_mut()
            .start_send(answer(1 << 20))
            .unwrap();
        assert!(!ready(&mut connection));
        for _ in 0..sent {
            assert!(from_core.recv().await.is_some());
        }
        assert_eq!(from_core.queued.bytes.load(Ordering::Acquire), 0);
        // Small answers: the frame bound holds them.
        let mut small = 0;
        while ready(&mut connection) {
            connection.sink.as_mut().start_send(answer(10)).unwrap();
            small += 1;
            assert!(small <= FROM_CORE_QUEUE, "never held back");
        }
        assert_eq!(small, FROM_CORE_QUEUE);
    }

    #[tokio::test]
    async fn a_call_queue_keeps_order_wakes_its_receiver_and_ends_with_its_last_sender() {
        let (sender, mut receiver) = call_queue();
        let second = sender.clone();
        sender.send(1);
        second.send(2);
        assert_eq!(receiver.recv().await, Some(1));
        assert_eq!(receiver.recv().await, Some(2));
        // A waiting receiver is woken by a send from another task.
        let waiting = tokio::spawn(async move {
            let got = receiver.recv().await;
            (got, receiver)
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished());
        second.send(3);
        let (got, mut receiver) = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("woken")
            .unwrap();
        assert_eq!(got, Some(3));
        // Items sent before the last sender went are still delivered; then it ends.
        second.send(4);
        drop(second);
        let ending = tokio::spawn(async move { (receiver.recv().await, receiver.recv().await) });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!ending.is_finished(), "one sender is left");
        drop(sender);
        let items = tokio::time::timeout(Duration::from_secs(5), ending)
            .await
            .expect("the last sender's drop wakes it")
            .unwrap();
        assert_eq!(items, (Some(4), None));
    }

    #[tokio::test]
    async fn a_window_holds_messages_back_until_rpc_core_grants_more() {
        let window = Arc::new(StreamWindow::default());
        let big = (INITIAL_WINDOW / 2) as usize;
        window.acquire(big).await;
        window.acquire(big - 1000).await;
        // Over the window, with more than GRANT_AT outstanding: it waits.
        let waiting = tokio::spawn({
            let window = window.clone();
            async move { window.acquire(2000).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished());
        window.grant(GRANT_AT);
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("the grant lets it go")
            .unwrap();
    }
}
