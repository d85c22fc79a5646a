//! Streaming calls in the transport suite: the `test.Streams` service and
//! the tests that call it over every transport.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use rpc_core::server::NamedService;
use rpc_core::stream::{INITIAL_WINDOW, MESSAGE_CHARGE, ServerStream};
use rpc_core::transport::{self, TransportConfig};
use rpc_core::{Channel, Code, Metadata, Payload, Request, Response, Status, Streaming};
use tokio::sync::mpsc;

use super::{
    Bed, DropReporter, Event, KillableServer, method_name, next_event, pattern, probe, start,
    start_with,
};

/// `count` as the first 8 bytes of a `len`-byte message (at least 8).
pub fn numbered(count: u64, len: usize) -> Bytes {
    let mut message = vec![0u8; len.max(8)];
    message[..8].copy_from_slice(&count.to_le_bytes());
    message.into()
}

/// The number at the start of a message.
pub fn number_of(message: &[u8]) -> u64 {
    u64::from_le_bytes(message[..8].try_into().expect("8 bytes"))
}

/// `/test.Streams/{Count,Sink,Echo,Collect,Ignore}`, written by hand over
/// [`ServerStream`] (generated servers do the same through rpc-codegen's glue).
#[derive(Clone)]
pub struct Streams {
    events: mpsc::UnboundedSender<Event>,
    streamed: Arc<AtomicU64>,
}

impl Streams {
    pub fn new(events: mpsc::UnboundedSender<Event>, streamed: Arc<AtomicU64>) -> Streams {
        Streams { events, streamed }
    }
}

impl NamedService for Streams {
    const NAME: &'static str = "test.Streams";
}

impl Streams {
    async fn handle(self, mut request: Request<Bytes>) -> Result<Response<Bytes>, Status> {
        let method = method_name(&request);
        let Some(ServerStream {
            mut messages,
            mut sink,
        }) = ServerStream::take(&mut request)
        else {
            return Err(Status::unimplemented(format!(
                "{method} is a streaming method"
            )));
        };
        let _reporter = DropReporter(self.events.clone(), Event::StreamDropped);
        let _ = self.events.send(Event::StreamStarted);
        match method.as_str() {
            // One request (count, fail after, message size); that many numbered messages.
            "Count" => {
                let spec = messages
                    .message()
                    .await?
                    .ok_or_else(|| Status::invalid_argument("no request"))?;
                let count = number_of(&spec[..8]);
                let fail_after = number_of(&spec[8..16]);
                let len = number_of(&spec[16..24]) as usize;
                let mut headers = Metadata::new();
                headers.insert("x-stream", "count").unwrap();
                sink.send_headers(headers).await?;
                // Batched: the messages that are ready together share a frame.
                let streamed = self.streamed.clone();
                let numbers = futures_util::stream::iter(0..count).map(move |n| {
                    if n == fail_after {
                        let mut status = Status::aborted(format!("failed after {n} messages"));
                        status
                            .metadata_mut()
                            .insert("x-sent", &n.to_string())
                            .unwrap();
                        return Err(status);
                    }
                    // Counted as the sink takes it: it may hold one back for window.
                    streamed.fetch_add(1, Ordering::SeqCst);
                    Ok(Payload::from(numbered(n, len)))
                });
                sink.send_all(numbers).await?;
                let mut trailers = Metadata::new();
                trailers.insert("x-total", &count.to_string()).unwrap();
                Ok(Response::from_parts(trailers, Bytes::new()))
            }
            // Numbered messages in; how many, once they are all in order.
            "Sink" => {
                let mut expected = 0u64;
                while let Some(message) = messages.message().await? {
                    if number_of(&message) != expected {
                        return Err(Status::data_loss(format!(
                            "message {} where {expected} was due",
                            number_of(&message)
                        )));
                    }
                    expected += 1;
                }
                sink.send(Bytes::copy_from_slice(&expected.to_le_bytes()))
                    .await?;
                Ok(Response::new(Bytes::new()))
            }
            // Each message back as it comes.
            "Echo" => {
                sink.send_headers(request.metadata().clone()).await?;
                while let Some(message) = messages.message().await? {
                    sink.send(message).await?;
                }
                Ok(Response::new(Bytes::new()))
            }
            // Everything until the client's half-close, then all of it back, last first.
            "Collect" => {
                // Headers first: the client's call resolves on them.
                sink.send_headers(Metadata::new()).await?;
                let mut all = Vec::new();
                while let Some(message) = messages.message().await? {
                    all.push(message);
                }
                for message in all.into_iter().rev() {
                    sink.send(message).await?;
                }
                Ok(Response::new(Bytes::new()))
            }
            // Takes the stream and never reads it.
            "Ignore" => {
                sink.send_headers(Metadata::new()).await?;
                std::future::pending::<()>().await;
                unreachable!()
            }
            other => Err(Status::unimplemented(format!("unknown method {other}"))),
        }
    }
}

impl tower::Service<Request<Bytes>> for Streams {
    type Response = Response<Bytes>;
    type Error = Status;
    type Future = futures_util::future::BoxFuture<'static, Result<Response<Bytes>, Status>>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Status>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Bytes>) -> Self::Future {
        Box::pin(self.clone().handle(request))
    }
}

/// A streaming request for `/test.Streams/{method}` with these messages.
pub fn streams_request<S>(method: &str, messages: S) -> Request<S> {
    let mut request = Request::new(messages);
    request.set_method(format!("/test.Streams/{method}"));
    request
}

/// Opens a `Count` stream: `count` messages of `len` bytes, failing after `fail_after`.
pub async fn count_stream(
    channel: &Channel,
    count: u64,
    fail_after: u64,
    len: usize,
    timeout: Option<Duration>,
) -> Result<Response<Streaming<Bytes>>, Status> {
    let mut spec = Vec::new();
    for value in [count, fail_after, len as u64] {
        spec.extend_from_slice(&value.to_le_bytes());
    }
    let message = Payload::from(Bytes::from(spec));
    let mut request = streams_request("Count", futures_util::stream::iter([message]));
    if let Some(timeout) = timeout {
        request.set_timeout(timeout);
    }
    channel.streaming(request).await
}

/// A streaming request for `/test.Streams/{method}` with no messages.
pub fn empty_streams_request(method: &str) -> Request<futures_util::stream::Empty<Payload>> {
    streams_request(method, futures_util::stream::empty())
}

/// A client stream fed from a channel: the sender, and the stream to pass.
pub fn fed_stream() -> (
    mpsc::UnboundedSender<Payload>,
    impl futures_core::Stream<Item = Payload> + Send + 'static,
) {
    let (sender, mut receiver) = mpsc::unbounded_channel();
    let stream = futures_util::stream::poll_fn(move |cx| receiver.poll_recv(cx));
    (sender, stream)
}

/// Opens a `/test.Streams/{method}` stream fed from a channel: the sender
/// of the client's messages, and the server's.
pub async fn open_fed(
    channel: &Channel,
    method: &str,
) -> (mpsc::UnboundedSender<Payload>, Streaming<Bytes>) {
    let (sender, stream) = fed_stream();
    let replies = channel
        .streaming(streams_request(method, stream))
        .await
        .unwrap()
        .into_inner();
    (sender, replies)
}

/// Messages of the million-message test (`RPC_SUITE_STREAM_MESSAGES` overrides).
fn million() -> u64 {
    std::env::var("RPC_SUITE_STREAM_MESSAGES")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(1_000_000)
}

/// Waits (up to `limit`) for a `StreamDropped` event, skipping others.
async fn stream_dropped_within(events: &mut mpsc::UnboundedReceiver<Event>, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if next_event(events, left).await == Event::StreamDropped {
            return;
        }
    }
}

/// Waits until `counter` has not moved for 200 ms (up to 60 s: slow
/// machines such as the TCG VM), and returns it.
async fn settle(counter: &AtomicU64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = counter.load(Ordering::SeqCst);
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = counter.load(Ordering::SeqCst);
        if now == last || Instant::now() > deadline {
            return now;
        }
        last = now;
    }
}

// ---------------------------------------------------------------- the tests

pub async fn stream_of_a_million_messages_arrives_in_order(bed: &dyn Bed) {
    let server = start(bed).await;
    let channel = Channel::connect(server.endpoint.clone()).await.unwrap();
    let total = million();
    let started = Instant::now();
    let response = count_stream(&channel, total, u64::MAX, 8, None)
        .await
        .unwrap();
    assert_eq!(response.metadata().get("x-stream"), Some("count"));
    let mut messages = response.into_inner();
    let mut expected = 0u64;
    while let Some(message) = messages.message().await.unwrap() {
        assert_eq!(number_of(&message), expected, "in order, none lost");
        expected += 1;
    }
    assert_eq!(expected, total);
    let trailers = messages.trailers().expect("trailers after a good end");
    assert_eq!(trailers.get("x-total"), Some(total.to_string().as_str()));
    let elapsed = started.elapsed();
    println!(
        "{total} messages in {elapsed:?} ({:.0} messages/s)",
        total as f64 / elapsed.as_secs_f64()
    );
}

pub async fn client_stream_and_half_closed_bidi_stream(bed: &dyn Bed) {
    let server = start(bed).await;
    let channel = Channel::connect(server.endpoint.clone()).await.unwrap();
    // Client streaming: 10,000 numbered messages, counted in order by the server.
    let messages = futures_util::stream::iter((0..10_000).map(|n| Payload::from(numbered(n, 8))));
    let mut reply = channel
        .streaming(streams_request("Sink", messages))
        .await
        .unwrap()
        .into_inner();
    let count = reply.message().await.unwrap().expect("one reply");
    assert_eq!(number_of(&count), 10_000);
    assert_eq!(reply.message().await.unwrap(), None);

    // Half-close: the server answers only after the client finished sending.
    let (sender, mut back) = open_fed(&channel, "Collect").await;
    for n in 0..100 {
        sender.send(Payload::from(numbered(n, 8))).unwrap();
    }
    drop(sender);
    for n in (0..100).rev() {
        let message = back
            .message()
            .await
            .unwrap()
            .expect("message after half-close");
        assert_eq!(number_of(&message), n);
    }
    assert_eq!(back.message().await.unwrap(), None);
    // A stream with no messages at all ends well too.
    let mut empty = channel
        .streaming(empty_streams_request("Collect"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(empty.message().await.unwrap(), None);
}

pub async fn slow_consumer_bounds_the_producer_to_the_window(bed: &dyn Bed) {
    // 64-byte messages: each costs the window its length plus MESSAGE_CHARGE.
    let cost = 64 + u64::from(MESSAGE_CHARGE);
    let window = u64::from(INITIAL_WINDOW) / cost;
    let server = start(bed).await;
    let channel = Channel::connect(server.endpoint.clone()).await.unwrap();
    // Server → client: the handler can never be more than a window ahead.
    let mut messages = count_stream(&channel, u64::MAX, u64::MAX, 64, None)
        .await
        .unwrap()
        .into_inner();
    // Let the producer run until it stops: at the window (one more may be
    // pulled and held back for room).
    let stalled = settle(&server.streamed).await;
    assert!(
        stalled <= window + 1,
        "{stalled} messages in flight with a window of {window}"
    );
    assert!(
        stalled >= window,
        "the producer stopped at {stalled} messages, short of the window of {window}"
    );
    // Taking messages lets it go on, never more than the window ahead.
    for taken in 1..=2 * window {
        messages.message().await.unwrap().unwrap();
        let ahead = server.streamed.load(Ordering::SeqCst) - taken;
        assert!(
            ahead <= window + 1,
            "{ahead} messages in flight with a window of {window}"
        );
    }
    let stalled = settle(&server.streamed).await - 2 * window;
    assert!(
        (window..=window + 1).contains(&stalled),
        "after the reads the producer stopped {stalled} ahead"
    );
    drop(messages);

    // Client → server: a handler that never reads takes at most a window.
    let yielded = Arc::new(AtomicU64::new(0));
    let counter = yielded.clone();
    let endless = futures_util::stream::iter(0u64..).map(move |n| {
        counter.fetch_add(1, Ordering::SeqCst);
        Payload::from(numbered(n, 64))
    });
    let stream = channel
        .streaming(streams_request("Ignore", endless))
        .await
        .unwrap();
    let pulled = settle(&yielded).await;
    // The sender pulls the message it then waits to send.
    assert!(
        (window..=window + 1).contains(&pulled),
        "the client pulled {pulled} messages for a window of {window}"
    );
    drop(stream);
}

pub async fn dropping_a_stream_cancels_its_handler(bed: &dyn Bed) {
    let mut server = start(bed).await;
    let channel = Channel::connect(server.endpoint.clone()).await.unwrap();
    let mut messages = count_stream(&channel, u64::MAX, u64::MAX, 8, None)
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        next_event(&mut server.events, Duration::from_secs(5)).await,
        Event::StreamStarted
    );
    for _ in 0..10 {
        messages.message().await.unwrap().unwrap();
    }
    drop(messages);
    stream_dropped_within(&mut server.events, Duration::from_secs(1)).await;

    // A bidi stream dropped while both directions are open.
    let (sender, mut echo) = open_fed(&channel, "Echo").await;
    assert_eq!(
        next_event(&mut server.events, Duration::from_secs(5)).await,
        Event::StreamStarted
    );
    sender.send(Payload::from(numbered(1, 8))).unwrap();
    assert_eq!(number_of(&echo.message().await.unwrap().unwrap()), 1);
    drop(echo);
    stream_dropped_within(&mut server.events, Duration::from_secs(1)).await;
    drop(sender);
    // The connection goes on.
    channel.unary(probe("Echo", "after")).await.unwrap();
}

pub async fn stream_deadline_covers_the_whole_stream(bed: &dyn Bed) {
    let mut server = start(bed).await;
    let channel = Channel::connect(server.endpoint.clone()).await.unwrap();
    let started = Instant::now();
    // Long enough for the TCG VM to open the stream within it.
    let budget = Duration::from_secs(2);
    let mut messages = count_stream(&channel, u64::MAX, u64::MAX, 8, Some(budget))
        .await
        .unwrap()
        .into_inner();
    let mut received = 0u64;
    let status = loop {
        match messages.message().await {
            Ok(Some(_)) => received += 1,
            Ok(None) => panic!("an endless stream ended"),
            Err(status) => break status,
        }
    };
    let elapsed = started.elapsed();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(received > 0, "messages flowed before the deadline");
    assert!(
        elapsed >= budget - Duration::from_millis(5) && elapsed < budget + Duration::from_secs(2),
        "ended after {elapsed:?} for a deadline of {budget:?}"
    );
    assert_eq!(
        messages.message().await.unwrap(),
        None,
        "nothing after the end"
    );
    stream_dropped_within(&mut server.events, Duration::from_secs(1)).await;
}

pub async fn stream_error_after_messages_arrives_after_them(bed: &dyn Bed) {
    let server = start(bed).await;
    let channel = Channel::connect(server.endpoint.clone()).await.unwrap();
    let mut messages = count_stream(&channel, 100, 5, 8, None)
        .await
        .unwrap()
        .into_inner();
    for n in 0..5 {
        assert_eq!(number_of(&messages.message().await.unwrap().unwrap()), n);
    }
    let status = messages.message().await.unwrap_err();
    assert_eq!(status.code(), Code::Aborted);
    assert_eq!(status.message(), "failed after 5 messages");
    assert_eq!(status.metadata().get("x-sent"), Some("5"));
    assert_eq!(messages.message().await.unwrap(), None);
    // The handler sent its headers, then failed: the stream yields the error.
    let mut messages = count_stream(&channel, 100, 0, 8, None)
        .await
        .unwrap()
        .into_inner();
    assert_eq!(messages.message().await.unwrap_err().code(), Code::Aborted);
    // An error before the headers fails the call itself.
    let status = channel
        .streaming(empty_streams_request("Count"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
}

pub async fn stream_peer_killed_ends_both_sides_within_a_second(bed: &dyn Bed) {
    // The server dies: its runtime is shut down at once, as a crash would.
    let server = KillableServer::start(bed);
    let endpoint = server.endpoint.clone();
    let channel = Channel::connect(endpoint).await.unwrap();
    let (_sender, mut echo) = open_fed(&channel, "Echo").await;
    let killed = Instant::now();
    let gone = server.kill();
    let status = tokio::time::timeout(Duration::from_secs(1), echo.message())
        .await
        .expect("the stream ends within a second")
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(killed.elapsed() < Duration::from_secs(1));
    gone.join().unwrap();

    // The client dies: its connection goes without a word.
    let mut server = start(bed).await;
    let config = TransportConfig::default();
    let mut raw = transport::connect(&server.endpoint, &config).await.unwrap();
    use futures_util::SinkExt;
    let open =
        rpc_core::frame::Frame::stream_request(1, "/test.Streams/Sink", None, Metadata::new());
    raw.sink.send(open.encode_parts()).await.unwrap();
    let message = rpc_core::frame::Frame::message(1, numbered(0, 8), false);
    raw.sink.send(message.encode_parts()).await.unwrap();
    assert_eq!(
        next_event(&mut server.events, Duration::from_secs(5)).await,
        Event::StreamStarted
    );
    drop(raw);
    stream_dropped_within(&mut server.events, Duration::from_secs(1)).await;
}

pub async fn hundred_streams_interleaved_with_unary_calls(bed: &dyn Bed) {
    let server = start(bed).await;
    let channel = Channel::connect(server.endpoint.clone()).await.unwrap();
    let streams = (0..100u64).map(|stream| {
        let channel = channel.clone();
        tokio::spawn(async move {
            let (sender, mut echo) = open_fed(&channel, "Echo").await;
            // Some messages ahead of their echoes, up to the window.
            for n in 0..200u64 {
                sender
                    .send(Payload::from(numbered(stream << 32 | n, 16)))
                    .unwrap();
                if n >= 20 {
                    let echoed = echo.message().await.unwrap().unwrap();
                    assert_eq!(number_of(&echoed), stream << 32 | (n - 20));
                }
            }
            drop(sender);
            for n in 180..200u64 {
                let echoed = echo.message().await.unwrap().unwrap();
                assert_eq!(number_of(&echoed), stream << 32 | n);
            }
            assert_eq!(echo.message().await.unwrap(), None);
        })
    });
    let streams: Vec<_> = streams.collect();
    let unary = (0..500u64).map(|n| {
        let channel = channel.clone();
        tokio::spawn(async move {
            let text = Bytes::from(format!("call {n}"));
            let response = channel.unary(probe("Echo", text.clone())).await.unwrap();
            assert_eq!(response.into_inner(), text);
        })
    });
    let unary: Vec<_> = unary.collect();
    for task in streams.into_iter().chain(unary) {
        tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("no stream or call hangs")
            .unwrap();
    }
}

pub async fn large_stream_messages_and_one_over_the_limit(bed: &dyn Bed) {
    let server = start_with(bed, |server| server.max_frame_len(8 << 20)).await;
    let channel = Channel::connect(server.endpoint.clone()).await.unwrap();
    // Large messages go as any large frame does (by RDMA READ on rdma://).
    let sizes = [4 << 20, 1, 6 << 20, 300 << 10];
    let sent: Vec<Bytes> = sizes
        .iter()
        .enumerate()
        .map(|(seed, &len)| pattern(len, seed as u64 + 1))
        .collect();
    let messages = futures_util::stream::iter(sent.clone().into_iter().map(Payload::from));
    let mut echo = channel
        .streaming(streams_request("Echo", messages))
        .await
        .unwrap()
        .into_inner();
    for expected in &sent {
        let echoed = echo.message().await.unwrap().unwrap();
        assert_eq!(echoed.len(), expected.len());
        assert!(
            echoed == expected,
            "echo of {} bytes differs",
            expected.len()
        );
    }
    assert_eq!(echo.message().await.unwrap(), None);

    // A message over the server's limit fails its stream, not the connection.
    let messages = futures_util::stream::iter([
        Payload::from(numbered(0, 8)),
        Payload::from(pattern(9 << 20, 9)),
    ]);
    let mut echo = channel
        .streaming(streams_request("Echo", messages))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(number_of(&echo.message().await.unwrap().unwrap()), 0);
    let status = echo.message().await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    channel.unary(probe("Echo", "still here")).await.unwrap();
}

pub async fn stream_and_unary_methods_called_the_wrong_way(bed: &dyn Bed) {
    let server = start(bed).await;
    let channel = Channel::connect(server.endpoint.clone()).await.unwrap();
    // A unary method called as a stream.
    let mut request = Request::new(futures_util::stream::iter([Payload::from(
        Bytes::from_static(b"x"),
    )]));
    request.set_method("/test.Probe/Echo");
    let status = channel.streaming(request).await.unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented, "{status:?}");
    // A streaming method called as unary.
    let mut request = Request::new(Bytes::new());
    request.set_method("/test.Streams/Count");
    let status = channel.unary(request).await.unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented, "{status:?}");
    // Unknown streaming method.
    let status = channel
        .streaming(empty_streams_request("Nope"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented);
    channel.unary(probe("Echo", "fine")).await.unwrap();
}

/// Opens a stream to `Ignore` on a raw connection, sends `frames` after it,
/// and returns the reason of the GOAWAY the server closes the connection with.
async fn raw_stream_then_expect_close(
    endpoint: &rpc_core::transport::Endpoint,
    frames: Vec<rpc_core::frame::Frame>,
) -> String {
    let open =
        rpc_core::frame::Frame::stream_request(1, "/test.Streams/Ignore", None, Metadata::new());
    raw_frames_then_expect_close(endpoint, std::iter::once(open).chain(frames).collect()).await
}

/// Sends `frames` on a raw connection and returns the reason of the GOAWAY
/// the server closes the connection with.
async fn raw_frames_then_expect_close(
    endpoint: &rpc_core::transport::Endpoint,
    frames: Vec<rpc_core::frame::Frame>,
) -> String {
    use futures_util::SinkExt;
    let config = TransportConfig::default();
    let mut raw = transport::connect(endpoint, &config).await.unwrap();
    for frame in frames {
        // The server may close before the last frames are written.
        if raw.sink.send(frame.encode_parts()).await.is_err() {
            break;
        }
    }
    loop {
        let next = tokio::time::timeout(Duration::from_secs(10), raw.stream.next())
            .await
            .expect("the server closes the connection");
        let Some(Ok(bytes)) = next else {
            panic!("closed without a GOAWAY");
        };
        let frame = rpc_core::frame::Frame::decode(bytes, config.max_frame_len).unwrap();
        if frame.kind == rpc_core::frame::FrameKind::GoAway {
            assert_eq!(frame.status, Code::Internal);
            return String::from_utf8(frame.payload.into_contiguous().to_vec()).unwrap();
        }
    }
}

pub async fn hostile_stream_frames_close_only_that_connection(bed: &dyn Bed) {
    let server = start(bed).await;
    let healthy = Channel::connect(server.endpoint.clone()).await.unwrap();
    let (keep, mut healthy_stream) = open_fed(&healthy, "Echo").await;

    // More than the window to a handler that never reads.
    let message = numbered(0, 60 << 10);
    let beyond = (u64::from(INITIAL_WINDOW) / (60 << 10)) as usize + 2;
    let frames = (0..beyond)
        .map(|_| rpc_core::frame::Frame::message(1, message.clone(), false))
        .collect();
    let reason = raw_stream_then_expect_close(&server.endpoint, frames).await;
    assert!(reason.contains("beyond the stream's window"), "{reason}");

    // A message frame whose entries do not add up.
    let mut malformed = rpc_core::frame::Frame::message(1, Bytes::from_static(b"abc"), false);
    malformed.payload = Payload::from(Bytes::from_static(&[9, 0, 0, 0, 1]));
    let reason = raw_stream_then_expect_close(&server.endpoint, vec![malformed]).await;
    assert!(reason.contains("length-prefixed"), "{reason}");

    // Headers with metadata from a client; a second half-close.
    let mut headers = rpc_core::frame::Frame::headers(1, Metadata::new());
    headers.metadata.insert("x-a", "b").unwrap();
    let reason = raw_stream_then_expect_close(&server.endpoint, vec![headers]).await;
    assert!(reason.contains("headers"), "{reason}");
    let twice = vec![
        rpc_core::frame::Frame::half_close(1),
        rpc_core::frame::Frame::half_close(1),
    ];
    let reason = raw_stream_then_expect_close(&server.endpoint, twice).await;
    assert!(reason.contains("twice"), "{reason}");

    // The others never noticed.
    channel_still_streams(&mut healthy_stream, &keep).await;
    healthy.unary(probe("Echo", "fine")).await.unwrap();
}

async fn channel_still_streams(
    echo: &mut Streaming<Bytes>,
    sender: &mpsc::UnboundedSender<Payload>,
) {
    sender.send(Payload::from(numbered(7, 8))).unwrap();
    assert_eq!(number_of(&echo.message().await.unwrap().unwrap()), 7);
}

/// Messages in a message frame's encoding (a `u32` LE length, then the bytes).
fn message_entries(messages: &[&[u8]]) -> Bytes {
    let mut entries = Vec::new();
    for message in messages {
        entries.extend_from_slice(&(message.len() as u32).to_le_bytes());
        entries.extend_from_slice(message);
    }
    entries.into()
}

/// The messages of a message frame's payload.
fn split_entries(mut payload: Bytes) -> Vec<Bytes> {
    let mut messages = Vec::new();
    while payload.len() >= 4 {
        let len = u32::from_le_bytes(payload[..4].try_into().unwrap()) as usize;
        let _ = payload.split_to(4);
        messages.push(payload.split_to(len));
    }
    messages
}

pub async fn whole_stream_requests_carry_the_clients_messages(bed: &dyn Bed) {
    use futures_util::SinkExt;
    use rpc_core::frame::{Frame, FrameFlags, FrameKind};
    let server = start(bed).await;
    let config = TransportConfig::default();
    let mut raw = transport::connect(&server.endpoint, &config).await.unwrap();
    let whole = |call_id, method: &str, messages: &[&[u8]], kind_unknown: bool| {
        let mut frame = Frame::whole_stream_request(
            call_id,
            method,
            None,
            Metadata::new(),
            message_entries(messages),
        );
        if kind_unknown {
            frame.flags = frame.flags | FrameFlags::KIND_UNKNOWN;
        }
        frame
    };
    let (zero, one, two) = (numbered(0, 8), numbered(1, 8), numbered(2, 8));
    let requests = [
        // A streaming method gets the messages, then the half-close.
        whole(1, "/test.Streams/Collect", &[&zero, &one, &two], false),
        whole(3, "/test.Streams/Collect", &[], false),
        // A unary method of a call of unknown kind answers in one response.
        whole(5, "/test.Probe/Double", &[&[21]], true),
        whole(7, "/test.Probe/Double", &[&[1], &[2]], true),
        whole(9, "/test.Probe/Double", &[], true),
    ];
    for request in requests {
        raw.sink.send(request.encode_parts()).await.unwrap();
    }
    let mut messages: std::collections::HashMap<u64, Vec<Bytes>> = Default::default();
    let mut ends = std::collections::HashMap::new();
    while ends.len() < 5 {
        let bytes = tokio::time::timeout(Duration::from_secs(10), raw.stream.next())
            .await
            .expect("every call ends")
            .expect("the connection stays open")
            .unwrap();
        let frame = Frame::decode(bytes, config.max_frame_len).unwrap();
        match frame.kind {
            FrameKind::Message => messages
                .entry(frame.call_id)
                .or_default()
                .extend(split_entries(frame.payload.into_contiguous())),
            FrameKind::Response => {
                let text =
                    String::from_utf8_lossy(&frame.payload.clone().into_contiguous()).into_owned();
                ends.insert(frame.call_id, (frame.status, frame.payload, text));
            }
            FrameKind::Headers => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(
        messages.remove(&1).unwrap(),
        vec![two, one, zero.clone()],
        "last first"
    );
    assert_eq!(ends[&1].0, Code::Ok);
    assert_eq!(messages.remove(&3), None, "no messages, and ended");
    assert_eq!(ends[&3].0, Code::Ok);
    assert_eq!(ends[&5].0, Code::Ok, "{}", ends[&5].2);
    assert_eq!(
        ends[&5].1.clone().into_contiguous(),
        Bytes::from_static(&[42])
    );
    assert_eq!(
        messages.remove(&5),
        None,
        "the answer rides on the response"
    );
    assert_eq!(ends[&7].0, Code::InvalidArgument);
    assert!(ends[&7].2.contains("sent more"), "{}", ends[&7].2);
    assert_eq!(ends[&9].0, Code::InvalidArgument);
    assert!(ends[&9].2.contains("sent none"), "{}", ends[&9].2);
    assert!(messages.is_empty(), "{messages:?}");

    // A whole stream that breaks the message encoding closes its connection.
    let mut broken = whole(1, "/test.Streams/Collect", &[], false);
    broken.payload = Payload::from(Bytes::from_static(&[9, 0, 0, 0, 1]));
    let reason = raw_frames_then_expect_close(&server.endpoint, vec![broken]).await;
    assert!(reason.contains("length-prefixed"), "{reason}");
    // Without END_STREAM a streaming request carries no messages.
    let mut open = whole(1, "/test.Streams/Collect", &[&zero], false);
    open.flags = FrameFlags::STREAMING;
    let reason = raw_frames_then_expect_close(&server.endpoint, vec![open]).await;
    assert!(reason.contains("END_STREAM"), "{reason}");
}

/// A graceful shutdown ends a stream that would never end by itself: once
/// the grace period is over it ends with `Unavailable` ("server shutting
/// down") and the server returns. Before, the stream flowed on until the
/// client dropped it, and the server never returned.
pub async fn graceful_shutdown_ends_open_streams_after_the_grace_period(bed: &dyn Bed) {
    let grace = Duration::from_millis(300);
    let server = start_with(bed, |server| server.shutdown_grace(grace)).await;
    let channel = Channel::connect(server.endpoint.clone()).await.unwrap();
    let (sender, mut echo) = open_fed(&channel, "Echo").await;
    sender.send(Payload::from(numbered(1, 8))).unwrap();
    assert_eq!(number_of(&echo.message().await.unwrap().unwrap()), 1);
    let started = Instant::now();
    server.shutdown().await;
    let took = started.elapsed();
    assert!(
        took >= grace,
        "the server waited for the grace period ({took:?})"
    );
    assert!(
        took < grace + Duration::from_secs(2),
        "and no longer ({took:?})"
    );
    let status = tokio::time::timeout(Duration::from_secs(1), echo.message())
        .await
        .expect("the stream ends")
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("server shutting down"),
        "{status:?}"
    );
}

/// Aborting the task that runs `serve()` ends the connections it served:
/// an open stream ends with `Unavailable` within a second.
pub async fn aborting_the_serve_task_ends_its_connections(bed: &dyn Bed) {
    let server = start(bed).await;
    let channel = Channel::connect(server.endpoint.clone()).await.unwrap();
    let (sender, mut echo) = open_fed(&channel, "Echo").await;
    sender.send(Payload::from(numbered(1, 8))).unwrap();
    assert_eq!(number_of(&echo.message().await.unwrap().unwrap()), 1);
    server.task.abort();
    let status = tokio::time::timeout(Duration::from_secs(1), echo.message())
        .await
        .expect("the stream ends within a second of the abort")
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    drop(sender);
}
