//! Draining a connection's outbound queue into its transport.
//!
//! On a multi-thread runtime the task that queues a frame writes and flushes
//! it itself when no other task is writing (one frame or a batch: whatever
//! is queued by then), so a request reaches the transport without waking
//! another task; the writer task takes over only when the transport makes a
//! writer wait (its buffer full, no credits) or a write fails. On a
//! current-thread runtime the writer task drains the queue, a batch per
//! flush: waking it costs no thread switch there, and it batches the frames
//! of every task that ran before it.

use std::future::poll_fn;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use futures_util::task::AtomicWaker;
use tokio::sync::mpsc;

use super::{Queued, WRITE_BATCH};
use crate::transport::{FrameSink, TransportError};

/// Whether senders flush their own frames on the current runtime: on a
/// multi-thread one (where waking the writer task may wake another thread).
pub(crate) fn flush_inline_by_default() -> bool {
    tokio::runtime::Handle::try_current()
        .is_ok_and(|handle| handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
}

/// What the senders and the writer task share.
pub(crate) struct WriterShared {
    io: Mutex<WriterIo>,
    /// A frame was queued since the holder of `io` last looked.
    dirty: AtomicBool,
    /// The writer task.
    task: AtomicWaker,
    flush_inline: bool,
}

/// The transport's sink and the queue's receiving end.
struct WriterIo {
    /// `None` once the writer task ended (the transport is let go then).
    sink: Option<FrameSink>,
    rx: mpsc::UnboundedReceiver<Queued>,
    /// Taken from the queue, not yet given to the sink (it was not ready).
    next: Option<Queued>,
    /// Given to the sink, waiting for the flush: their queue space is
    /// released once it completes.
    fed: Vec<Queued>,
    /// A failure seen by an inline writer, for the writer task to report.
    error: Option<TransportError>,
    /// Flushes completed (the writer task's stall clock restarts on each).
    flushes: u64,
    /// The sink was closed (every sender gone) or failed.
    finished: bool,
}

/// Why draining stopped.
enum Drained {
    /// Nothing left to write.
    Idle,
    /// Every sender is gone and the sink is closed.
    Closed,
}

impl WriterIo {
    /// Writes what is queued, a batch per flush, until nothing is left.
    fn drive(&mut self, cx: &mut Context<'_>) -> Poll<Result<Drained, TransportError>> {
        if let Some(error) = self.error.take() {
            return Poll::Ready(Err(error));
        }
        let Some(sink) = self.sink.as_mut() else {
            return Poll::Ready(Ok(Drained::Closed));
        };
        if self.finished {
            return Poll::Ready(Ok(Drained::Closed));
        }
        loop {
            let mut disconnected = false;
            while self.fed.len() < WRITE_BATCH {
                if self.next.is_none() {
                    match self.rx.try_recv() {
                        Ok(queued) => self.next = Some(queued),
                        Err(mpsc::error::TryRecvError::Empty) => break,
                        Err(mpsc::error::TryRecvError::Disconnected) => {
                            disconnected = true;
                            break;
                        }
                    }
                }
                if self.fed.is_empty() {
                    ready!(sink.as_mut().poll_ready(cx))?;
                } else if sink.as_mut().poll_ready(cx)?.is_pending() {
                    // Flush what was fed; the rest follows.
                    break;
                }
                let queued = self.next.take().expect("taken above");
                sink.as_mut().start_send(queued.frame.clone())?;
                self.fed.push(queued);
            }
            if !self.fed.is_empty() {
                ready!(sink.as_mut().poll_flush(cx))?;
                self.fed.clear();
                self.flushes += 1;
                continue;
            }
            if disconnected {
                ready!(sink.as_mut().poll_close(cx))?;
                self.finished = true;
                return Poll::Ready(Ok(Drained::Closed));
            }
            return Poll::Ready(Ok(Drained::Idle));
        }
    }
}

impl WriterShared {
    pub(super) fn new(
        sink: FrameSink,
        rx: mpsc::UnboundedReceiver<Queued>,
        flush_inline: bool,
    ) -> Arc<WriterShared> {
        Arc::new(WriterShared {
            io: Mutex::new(WriterIo {
                sink: Some(sink),
                rx,
                next: None,
                fed: Vec::with_capacity(WRITE_BATCH),
                error: None,
                flushes: 0,
                finished: false,
            }),
            dirty: AtomicBool::new(false),
            task: AtomicWaker::new(),
            flush_inline,
        })
    }

    fn lock(&self) -> MutexGuard<'_, WriterIo> {
        self.io.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    /// Wakes the writer task.
    pub(super) fn kick(&self) {
        self.task.wake();
    }

    /// A frame was queued: write it now (inline) or have the writer task do it.
    pub(super) fn queued(&self) {
        // SeqCst with the holder's clear-then-look: either the holder of
        // `io` sees the flag after it lets go, or we get the lock.
        self.dirty.store(true, Ordering::SeqCst);
        if !self.flush_inline {
            self.kick();
            return;
        }
        loop {
            let mut io = match self.io.try_lock() {
                Ok(io) => io,
                Err(TryLockError::Poisoned(poison)) => poison.into_inner(),
                // Whoever holds it looks at the flag after letting go.
                Err(TryLockError::WouldBlock) => return,
            };
            self.dirty.store(false, Ordering::SeqCst);
            // No waker of ours: what would wait is the writer task's.
            let mut cx = Context::from_waker(Waker::noop());
            match io.drive(&mut cx) {
                Poll::Ready(Ok(Drained::Idle)) => {}
                Poll::Ready(Ok(Drained::Closed)) | Poll::Pending => {
                    drop(io);
                    self.kick();
                    return;
                }
                Poll::Ready(Err(error)) => {
                    io.error = Some(error);
                    drop(io);
                    self.kick();
                    return;
                }
            }
            drop(io);
            if !self.dirty.load(Ordering::SeqCst) {
                return;
            }
        }
    }
}

/// The connection's writer task: drains what senders left (or, on a
/// current-thread runtime, everything), closes the sink once every sender is
/// gone, and fails when the transport takes nothing for `stall_timeout`.
pub(crate) struct WriterTask {
    shared: Arc<WriterShared>,
}

impl WriterTask {
    pub(super) fn new(shared: Arc<WriterShared>) -> WriterTask {
        WriterTask { shared }
    }

    /// Runs until the sink is closed (`Ok`) or fails. With `stall_timeout`,
    /// a transport that takes no frame (or completes no flush) for that long
    /// fails with `TimedOut`: the peer is not taking what we send.
    ///
    /// However it ends (also when dropped), the sink is dropped, queued
    /// frames are let go and later sends fail.
    pub(crate) async fn run(self, stall_timeout: Option<Duration>) -> Result<(), TransportError> {
        let finish = Finish(self.shared);
        let shared = &finish.0;
        let mut stall: Option<(u64, std::pin::Pin<Box<tokio::time::Sleep>>)> = None;
        let result = poll_fn(|cx| {
            loop {
                shared.task.register(cx.waker());
                shared.dirty.store(false, Ordering::SeqCst);
                let mut io = shared.lock();
                match io.drive(cx) {
                    Poll::Ready(Ok(Drained::Idle)) => {
                        drop(io);
                        stall = None;
                        if shared.dirty.load(Ordering::SeqCst) {
                            continue;
                        }
                        return Poll::Pending;
                    }
                    Poll::Ready(Ok(Drained::Closed)) => return Poll::Ready(Ok(())),
                    Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                    Poll::Pending => {
                        let Some(limit) = stall_timeout else {
                            return Poll::Pending;
                        };
                        // Armed when the transport first makes us wait, and
                        // again after each flush that completes meanwhile.
                        let flushes = io.flushes;
                        drop(io);
                        let (since, timer) = stall
                            .get_or_insert_with(|| (flushes, Box::pin(tokio::time::sleep(limit))));
                        if *since != flushes {
                            *since = flushes;
                            timer.as_mut().reset(tokio::time::Instant::now() + limit);
                        }
                        if timer.as_mut().poll(cx).is_ready() {
                            return Poll::Ready(Err(TransportError::Io(std::io::Error::new(
                                std::io::ErrorKind::TimedOut,
                                format!("the peer took none of our frames for {limit:?}"),
                            ))));
                        }
                        return Poll::Pending;
                    }
                }
            }
        })
        .await;
        drop(finish);
        result
    }
}

/// Ends the writer: nothing is written any more.
struct Finish(Arc<WriterShared>);

impl Drop for Finish {
    fn drop(&mut self) {
        let mut io = self.0.lock();
        io.finished = true;
        io.sink = None;
        io.rx.close();
        while io.rx.try_recv().is_ok() {}
        io.next = None;
        io.fed.clear();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures_util::SinkExt;
    use tokio::sync::mpsc;
    use tokio_util::sync::PollSender;

    use crate::conn_io::OutboundQueue;
    use crate::frame::{EncodedFrame, Frame, FrameFlags, FrameKind};
    use crate::transport::{FrameSink, TransportError};

    /// A sink that holds one frame until the test takes it: every other
    /// write waits (what a full socket or a peer out of credits does).
    fn narrow_sink() -> (FrameSink, mpsc::Receiver<EncodedFrame>) {
        let (tx, rx) = mpsc::channel(1);
        let sink = PollSender::new(tx).sink_map_err(|_| TransportError::Closed);
        (Box::pin(sink), rx)
    }

    fn frame(sender: u64, index: u64) -> EncodedFrame {
        Frame::control(FrameKind::Ping, FrameFlags::EMPTY, sender << 32 | index).encode_parts()
    }

    fn id(frame: EncodedFrame) -> u64 {
        let (_, id) = Frame::peek_header(&frame.into_contiguous()).expect("a frame");
        id
    }

    /// Senders on several workers write their own frames while the sink
    /// keeps making them wait: every frame arrives once, each sender's in
    /// its order, and the writer task closes the sink when they are gone.
    async fn every_frame_arrives_in_order(flush_inline: bool) {
        const SENDERS: u64 = 8;
        const FRAMES: u64 = 500;
        let (sink, mut written) = narrow_sink();
        let (queue, writer) = OutboundQueue::new(1 << 20, None, sink, flush_inline);
        let writer = tokio::spawn(writer.run(Some(Duration::from_secs(10))));
        let mut senders = Vec::new();
        for sender in 0..SENDERS {
            let queue = queue.clone();
            senders.push(tokio::spawn(async move {
                for index in 0..FRAMES {
                    queue.send(frame(sender, index)).await.expect("queue open");
                    if index % 7 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
            }));
        }
        drop(queue);
        let mut next = [0u64; SENDERS as usize];
        for _ in 0..SENDERS * FRAMES {
            let got = tokio::time::timeout(Duration::from_secs(10), written.recv())
                .await
                .expect("a frame within 10 s: nothing may stay queued")
                .expect("the sink is open until the senders are gone");
            let got = id(got);
            let (sender, index) = ((got >> 32) as usize, got & 0xffff_ffff);
            assert_eq!(index, next[sender], "sender {sender}'s frames in order");
            next[sender] += 1;
        }
        for sender in senders {
            sender.await.expect("sender");
        }
        writer
            .await
            .expect("writer task")
            .expect("the writer closes the sink cleanly");
        assert!(
            written.recv().await.is_none(),
            "the sink was closed and dropped"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn senders_that_flush_inline_lose_and_reorder_nothing() {
        every_frame_arrives_in_order(true).await;
    }

    #[tokio::test]
    async fn the_writer_task_alone_loses_and_reorders_nothing() {
        every_frame_arrives_in_order(false).await;
    }

    /// The writer task, running on another worker, must see the queue
    /// disconnected when the last sender goes (a kick that came before the
    /// sender was really gone found it merely empty, and the writer slept
    /// for ever: a server's connection then never ended).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_writer_ends_when_the_last_sender_goes_whatever_the_timing() {
        for round in 0..300 {
            let (sink, mut written) = narrow_sink();
            let (queue, writer) = OutboundQueue::new(1 << 20, None, sink, round % 2 == 0);
            let writer = tokio::spawn(writer.run(None));
            let sender = queue.clone();
            tokio::spawn(async move {
                sender.send(frame(0, 0)).await.expect("queue open");
            })
            .await
            .expect("sender");
            assert!(written.recv().await.is_some(), "the frame arrives");
            drop(queue);
            tokio::time::timeout(Duration::from_secs(5), writer)
                .await
                .unwrap_or_else(|_| {
                    panic!("round {round}: the writer never saw the last sender go")
                })
                .expect("writer task")
                .expect("a clean close");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sink_that_takes_nothing_fails_the_writer_after_the_stall_time_out() {
        let (sink, written) = narrow_sink();
        let (queue, writer) = OutboundQueue::new(1 << 20, None, sink, true);
        let writer = tokio::spawn(writer.run(Some(Duration::from_millis(200))));
        for index in 0..3 {
            queue.send(frame(0, index)).await.expect("queue open");
        }
        let outcome = tokio::time::timeout(Duration::from_secs(5), writer)
            .await
            .expect("the writer gives up within the time-out")
            .expect("writer task");
        match outcome {
            Err(TransportError::Io(error)) => {
                assert_eq!(error.kind(), std::io::ErrorKind::TimedOut);
            }
            other => panic!("expected a stall time-out, got {other:?}"),
        }
        // Nothing is written any more: later frames are refused.
        assert!(queue.send(frame(0, 9)).await.is_err());
        drop(written);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_that_fails_inline_is_reported_by_the_writer_task() {
        let (sink, written) = narrow_sink();
        drop(written);
        let (queue, writer) = OutboundQueue::new(1 << 20, None, sink, true);
        let writer = tokio::spawn(writer.run(None));
        let _ = queue.send(frame(0, 0)).await;
        let outcome = tokio::time::timeout(Duration::from_secs(5), writer)
            .await
            .expect("the failure reaches the writer task")
            .expect("writer task");
        assert!(
            matches!(outcome, Err(TransportError::Closed)),
            "{outcome:?}"
        );
    }
}
