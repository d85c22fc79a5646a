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
        let grpc = http::Response::builder()
            .header("content-type", "application/grpc")
            .body(())
            .unwrap();
        let message = Bytes::from_static(&[0, 0, 0, 0, 1, 7]);
        match what.as_str() {
            "Two" => {
                let mut body = respond.send_response(grpc, false).unwrap();
                body.send_data(message.clone(), false).unwrap();
                body.send_data(message, false).unwrap();
                body.send_trailers(trailers_only("0", "").headers().clone())
                    .unwrap();
            }
            "None" => {
                let mut body = respond.send_response(grpc, false).unwrap();
                body.send_trailers(trailers_only("0", "").headers().clone())
                    .unwrap();
            }
            "NoStatus" => {
                let mut body = respond.send_response(grpc, false).unwrap();
                body.send_data(message, true).unwrap();
            }
            "Truncated" => {
                let mut body = respond.send_response(grpc, false).unwrap();
                body.send_data(Bytes::from_static(&[0, 0, 0, 0, 9, 1]), false)
                    .unwrap();
                body.send_trailers(trailers_only("0", "").headers().clone())
                    .unwrap();
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
