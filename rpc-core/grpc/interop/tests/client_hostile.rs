//! rdma-rpc's `grpc://` channel against raw HTTP/2 servers that do what no
//! well-behaved gRPC server does, or what one may: it ends every call with
//! a clear status, never a hang.

use std::time::Duration;

use bytes::Bytes;
use rpc_core::{Channel, Code, Payload, Request};
use tokio::net::TcpListener;

/// Serves one HTTP/2 connection with `answer` for each stream (given the
/// request, kept alive as long as the connection) until the client leaves.
async fn raw_server<F>(answer: F) -> String
where
    F: Fn(http::Request<h2::RecvStream>, h2::server::SendResponse<Bytes>) -> Option<h2::RecvStream>
        + Send
        + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (socket, _) = listener.accept().await.unwrap();
        let mut connection = h2::server::handshake(socket).await.unwrap();
        let mut kept = Vec::new();
        while let Some(Ok((request, respond))) = connection.accept().await {
            kept.extend(answer(request, respond));
        }
    });
    format!("grpc://{addr}")
}

fn unary(body: Bytes) -> Request<Payload> {
    let mut request = Request::new(Payload::from(body));
    request.set_method("/hostile.Server/Call");
    request.set_timeout(Duration::from_secs(10));
    request
}

/// An answer's head that says gRPC, messages to follow.
fn grpc_head() -> http::Response<()> {
    http::Response::builder()
        .header("content-type", "application/grpc")
        .body(())
        .unwrap()
}

/// The trailers that end an answer with `code` and `message`.
fn trailers(code: &str, message: &str) -> http::HeaderMap {
    trailers_only(code, message).headers().clone()
}

fn trailers_only(code: &str, message: &str) -> http::Response<()> {
    http::Response::builder()
        .header("content-type", "application/grpc")
        .header("grpc-status", code)
        .header("grpc-message", message)
        .body(())
        .unwrap()
}

/// The server answers (a refusal) without reading the request, whose
/// 1 MiB does not fit the stream's window, and without resetting the
/// stream: the answer ends the call, the unsent rest does not hold it.
#[tokio::test]
async fn an_answer_before_the_request_was_read_ends_the_call() {
    rpc_grpc::register();
    let endpoint = raw_server(|request, mut respond| {
        respond
            .send_response(trailers_only("8", "too big"), true)
            .unwrap();
        // Held unread: its window never opens again.
        Some(request.into_body())
    })
    .await;
    let channel = Channel::connect(endpoint.as_str()).await.unwrap();
    let status = tokio::time::timeout(
        Duration::from_secs(5),
        channel.unary(unary(Bytes::from(vec![0u8; 1 << 20]))),
    )
    .await
    .expect("the answer ends the call at once")
    .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(status.message(), "too big");
}

/// A server that answers a unary call with two messages, or with none, or
/// without a status, or with a body that is not gRPC: each call fails with
/// `Internal` or `Unknown` saying why, and the connection serves the next.
#[tokio::test]
async fn broken_answers_fail_their_call_with_the_reason() {
    rpc_grpc::register();
    let endpoint = raw_server(|request, mut respond| {
        let what = request.uri().path().rsplit('/').next().unwrap().to_owned();
        let grpc = grpc_head();
        let message = Bytes::from_static(&[0, 0, 0, 0, 1, 7]);
        match what.as_str() {
            "Two" => {
                let mut body = respond.send_response(grpc, false).unwrap();
                body.send_data(message.clone(), false).unwrap();
                body.send_data(message, false).unwrap();
                body.send_trailers(trailers("0", "")).unwrap();
            }
            "None" => {
                let mut body = respond.send_response(grpc, false).unwrap();
                body.send_trailers(trailers("0", "")).unwrap();
            }
            "NoStatus" => {
                let mut body = respond.send_response(grpc, false).unwrap();
                body.send_data(message, true).unwrap();
            }
            "Truncated" => {
                let mut body = respond.send_response(grpc, false).unwrap();
                body.send_data(Bytes::from_static(&[0, 0, 0, 0, 9, 1]), false)
                    .unwrap();
                body.send_trailers(trailers("0", "")).unwrap();
            }
            _ => {
                let html = http::Response::builder()
                    .header("content-type", "text/html")
                    .body(())
                    .unwrap();
                let mut body = respond.send_response(html, false).unwrap();
                body.send_data(Bytes::from_static(b"<html>"), true).unwrap();
            }
        }
        Some(request.into_body())
    })
    .await;
    let channel = Channel::connect(endpoint.as_str()).await.unwrap();
    for (method, code, says) in [
        ("Two", Code::Internal, "more than one response message"),
        ("None", Code::Internal, "no response message"),
        ("NoStatus", Code::Internal, "without a grpc-status"),
        ("Truncated", Code::Internal, "bad response"),
        ("Html", Code::Unknown, "not gRPC"),
    ] {
        let mut request = unary(Bytes::from_static(b"x"));
        request.set_method(format!("/hostile.Server/{method}"));
        let status = channel.unary(request).await.unwrap_err();
        assert_eq!(status.code(), code, "{method}: {status:?}");
        assert!(status.message().contains(says), "{method}: {status:?}");
    }
}

/// The server sends its answer's headers first and reads the whole 1 MiB
/// request before it answers (as a proxy may): the request keeps going
/// while the answer is read, so the call completes.
#[tokio::test]
async fn a_request_keeps_going_after_the_answers_headers() {
    rpc_grpc::register();
    let endpoint = raw_server(|request, mut respond| {
        tokio::spawn(async move {
            let mut answer = respond.send_response(grpc_head(), false).unwrap();
            let mut body = request.into_body();
            let mut read = 0;
            while let Some(chunk) = body.data().await {
                let chunk = chunk.unwrap();
                read += chunk.len();
                let _ = body.flow_control().release_capacity(chunk.len());
            }
            // The message: its length, as one varint-free byte string.
            let text = read.to_string();
            let mut message = vec![0, 0, 0, 0, text.len() as u8];
            message.extend_from_slice(text.as_bytes());
            answer.send_data(Bytes::from(message), false).unwrap();
            answer.send_trailers(trailers("0", "")).unwrap();
        });
        None
    })
    .await;
    let channel = Channel::connect(endpoint.as_str()).await.unwrap();
    let answer = tokio::time::timeout(
        Duration::from_secs(5),
        channel.unary(unary(Bytes::from(vec![0u8; 1 << 20]))),
    )
    .await
    .expect("the call completes")
    .unwrap();
    // gRPC's 5-byte prefix and the 1 MiB message went.
    assert_eq!(answer.get_ref(), &Bytes::from(((1 << 20) + 5).to_string()));
}

/// The server ends a streaming call with an error while the client is
/// still sending (and resets the stream, as h2 does when it stops
/// reading): the application sees the server's status, not the failed
/// write that followed it.
#[tokio::test]
async fn the_servers_status_wins_over_the_writes_it_cut_off() {
    rpc_grpc::register();
    let endpoint = raw_server(|request, mut respond| {
        tokio::spawn(async move {
            let mut body = request.into_body();
            // One chunk read, then the refusal; the body is dropped unread.
            let _ = body.data().await;
            respond
                .send_response(trailers_only("7", "not you"), true)
                .unwrap();
        });
        None
    })
    .await;
    let channel = Channel::connect(endpoint.as_str()).await.unwrap();
    let (messages, rx) = tokio::sync::mpsc::channel::<Payload>(4);
    let feeding = tokio::spawn(async move {
        for _ in 0..256 {
            let message = Payload::from(Bytes::from(vec![1u8; 16 << 10]));
            if messages.send(message).await.is_err() {
                break;
            }
        }
        // Held open: the call must end without the stream's end.
        std::future::pending::<()>().await;
    });
    let mut request = Request::new(tokio_stream_of(rx));
    request.set_method("/hostile.Server/Bidi");
    let status = match channel.streaming(request).await {
        Err(status) => status,
        Ok(response) => response
            .into_inner()
            .message()
            .await
            .expect_err("the call fails"),
    };
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert_eq!(status.message(), "not you");
    feeding.abort();
}

/// A channel whose keepalive settings are under a second (the kernel's
/// unit) still connects and calls.
#[tokio::test]
async fn a_keepalive_under_a_second_still_connects() {
    rpc_grpc::register();
    let endpoint = raw_server(|request, mut respond| {
        let mut answer = respond.send_response(grpc_head(), false).unwrap();
        answer
            .send_data(Bytes::from_static(&[0, 0, 0, 0, 2, b'o', b'k']), false)
            .unwrap();
        answer.send_trailers(trailers("0", "")).unwrap();
        Some(request.into_body())
    })
    .await;
    let channel = Channel::builder(endpoint.parse().unwrap())
        .keepalive(Duration::from_millis(500), Duration::from_millis(300))
        .connect()
        .await
        .expect("connects");
    let answer = channel
        .unary(unary(Bytes::from_static(b"x")))
        .await
        .unwrap();
    assert_eq!(answer.get_ref(), &Bytes::from_static(b"ok"));
}

/// A response message with an unknown flag ends the stream with one error;
/// the stream then ends instead of yielding it again.
#[tokio::test]
async fn a_broken_response_stream_yields_one_error_then_ends() {
    rpc_grpc::register();
    let endpoint = raw_server(|request, mut respond| {
        let mut answer = respond.send_response(grpc_head(), false).unwrap();
        answer
            .send_data(
                Bytes::from_static(&[2, 0, 0, 0, 1, 7, 0, 0, 0, 0, 0]),
                false,
            )
            .unwrap();
        Some(request.into_body())
    })
    .await;
    let channel = Channel::connect(endpoint.as_str()).await.unwrap();
    let mut request = Request::new(futures_util::stream::iter([Payload::from(
        Bytes::from_static(b"x"),
    )]));
    request.set_method("/hostile.Server/Stream");
    let mut answers = channel.streaming(request).await.unwrap().into_inner();
    let status = answers.message().await.expect_err("the broken message");
    assert_eq!(status.code(), Code::Internal, "{status:?}");
    assert!(answers.message().await.unwrap().is_none(), "then the end");
}

/// A request over the channel's own limit fails here, unsent: the server
/// sees no stream.
#[tokio::test]
async fn a_request_over_the_channels_limit_is_not_sent() {
    rpc_grpc::register();
    let streams = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = streams.clone();
    let endpoint = raw_server(move |request, _respond| {
        seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Some(request.into_body())
    })
    .await;
    let channel = Channel::builder(endpoint.parse().unwrap())
        .max_frame_len(4 << 10)
        .connect()
        .await
        .unwrap();
    let status = channel
        .unary(unary(Bytes::from(vec![0u8; 8 << 10])))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("exceeds this channel's limit"),
        "{status:?}"
    );
    let mut request = Request::new(futures_util::stream::iter([Payload::from(Bytes::from(
        vec![0u8; 8 << 10],
    ))]));
    request.set_method("/hostile.Server/Stream");
    let status = channel.streaming(request).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(streams.load(std::sync::atomic::Ordering::SeqCst), 0);
}

/// The messages an mpsc receiver yields, as a stream.
fn tokio_stream_of(
    rx: tokio::sync::mpsc::Receiver<Payload>,
) -> impl futures_core::Stream<Item = Payload> + Send + 'static {
    futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|message| (message, rx))
    })
}
