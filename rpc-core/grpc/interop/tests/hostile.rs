//! Hostile HTTP/2 peers of the grpc:// server: what they can make it hold
//! stays bounded, and other clients are served meanwhile.

mod common;

use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};

/// Streams that announce large messages and send most of them: the server
/// takes only what its receive budget (plus HTTP/2's windows) allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announced_large_messages_are_held_within_the_receive_budget() {
    let server = common::rdma_server().await;
    messages_sent_in_part_are_held_within_the_budget(&server, common::LIMIT - 1024).await;
}

/// The same with messages smaller than a stream's HTTP/2 window (256 KiB,
/// 256 streams against a 32 MiB budget): the window is given back as the
/// pieces come, so it is the budget that must bound them, not the window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_messages_sent_in_part_on_many_streams_are_held_within_the_budget() {
    let server = common::rdma_server_with_budget("grpc", Some(common::LIMIT)).await;
    messages_sent_in_part_are_held_within_the_budget(&server, 256 << 10).await;
}

/// Opens streams that each announce an `announced`-byte message and send
/// all of it but its last byte, twice the server's receive budget in all;
/// asserts the server took no more than its budget (and 16 MiB of HTTP/2
/// windows) and still answers a new client.
async fn messages_sent_in_part_are_held_within_the_budget(
    server: &common::TestServer,
    announced: usize,
) {
    let budget = server
        .stats
        .as_ref()
        .expect("rdma-rpc's server")
        .receive_budget()
        .capacity();
    let mut client = common::raw_http2_client(&server.addr).await;
    let streams = 2 * budget / announced + 2;
    let deadline = Instant::now() + Duration::from_secs(3);
    let payload = Bytes::from(vec![1u8; announced]);
    let mut senders = Vec::new();
    for _ in 0..streams {
        client = client.ready().await.unwrap();
        let (_response, mut body) = client
            .send_request(common::grpc_request(&server.addr, "Unary"), false)
            .unwrap();
        let payload = payload.clone();
        senders.push(tokio::spawn(async move {
            let mut prefix = BytesMut::new();
            prefix.put_u8(0);
            prefix.put_u32(announced as u32);
            let mut sent = 0usize;
            let mut data = vec![prefix.freeze(), payload.slice(..announced - 1)];
            for piece in data.drain(..) {
                let mut piece = piece;
                while !piece.is_empty() {
                    body.reserve_capacity(piece.len());
                    let capacity = tokio::time::timeout_at(
                        deadline.into(),
                        std::future::poll_fn(|cx| body.poll_capacity(cx)),
                    )
                    .await;
                    let Ok(Some(Ok(capacity))) = capacity else {
                        return (sent, body);
                    };
                    let chunk = piece.split_to(capacity.min(piece.len()));
                    sent += chunk.len();
                    if body.send_data(chunk, false).is_err() {
                        return (sent, body);
                    }
                }
            }
            (sent, body)
        }));
    }
    let mut total = 0;
    let mut held = Vec::new();
    for sender in senders {
        let (sent, body) = sender.await.unwrap();
        total += sent;
        held.push(body);
    }
    // Without the reservation each stream could make the server assemble
    // a whole message: `streams` × `announced`, twice the budget.
    let bound = budget + 16 * (1 << 20);
    assert!(
        total <= bound,
        "the server took {total} bytes of incomplete messages; budget {budget}"
    );
    common::still_answers(server).await;
    drop(held);
}

/// A client that never ends its request body does not keep a call it was
/// answered on: the server ends the stream after its trailers with
/// `RST_STREAM(NO_ERROR)`, as HTTP/2 asks of a server that answers early,
/// instead of waiting for a body that may never end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_answer_releases_a_request_body_the_client_never_ends() {
    use prost::Message;
    let server = common::rdma_server().await;
    let client = common::raw_http2_client(&server.addr).await;
    let mut client = client.ready().await.unwrap();
    let (response, mut body) = client
        .send_request(common::grpc_request(&server.addr, "Bidi"), false)
        .unwrap();
    // One message whose answer is a failure; the body stays open.
    let ask = rpc_grpc_interop::rdma::Ask {
        fail_with_code: 9,
        fail_message: "no".to_owned(),
        ..Default::default()
    }
    .encode_to_vec();
    let mut message = BytesMut::new();
    message.put_u8(0);
    message.put_u32(ask.len() as u32);
    message.put_slice(&ask);
    body.send_data(message.freeze(), false).unwrap();

    let within = Duration::from_secs(5);
    assert_eq!(grpc_status_of(response, within).await, "9");
    // The server let the stream go: the request side is reset, NO_ERROR.
    let reset = tokio::time::timeout(within, std::future::poll_fn(|cx| body.poll_reset(cx)))
        .await
        .expect("the server resets the request side in time")
        .expect("a reset");
    assert_eq!(reset, h2::Reason::NO_ERROR);
    common::still_answers(&server).await;
}

/// The `grpc-status` of an answer: in its trailers, or in the headers of a
/// trailers-only answer.
async fn grpc_status_of(
    response: h2::client::ResponseFuture,
    within: Duration,
) -> http::HeaderValue {
    answer_of(response, within).await.1
}

/// An answer's DATA (all of it) and its `grpc-status` (from the trailers,
/// or from the headers of a trailers-only answer).
async fn answer_of(
    response: h2::client::ResponseFuture,
    within: Duration,
) -> (BytesMut, http::HeaderValue) {
    let response = tokio::time::timeout(within, response)
        .await
        .expect("answered in time")
        .expect("a response");
    assert_eq!(response.status(), 200);
    if let Some(status) = response.headers().get("grpc-status") {
        return (BytesMut::new(), status.clone());
    }
    let mut answer = response.into_body();
    let mut data = BytesMut::new();
    let trailers = tokio::time::timeout(within, async {
        while let Some(chunk) = answer.data().await {
            data.extend_from_slice(&chunk.expect("the answer's data"));
        }
        answer.trailers().await
    })
    .await
    .expect("the trailers in time")
    .expect("trailers")
    .expect("some trailers");
    let status = trailers.get("grpc-status").expect("grpc-status").clone();
    (data, status)
}

/// Whole request bodies (headers, then data with END_STREAM at once, as a
/// unary call sends them) that break gRPC's message framing fail their own
/// call with a status; the connection and the server go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_bodies_that_break_grpc_framing_fail_their_call_only() {
    let server = common::rdma_server().await;
    let client = common::raw_http2_client(&server.addr).await;
    let within = Duration::from_secs(5);
    let cases: [(&[u8], &str); 3] = [
        // A prefix that announces 10 bytes, and 3 of them.
        (&[0, 0, 0, 0, 10, 1, 2, 3], "13"),
        // A compressed message, where the server accepts identity only.
        (&[1, 0, 0, 0, 1, 7], "12"),
        // Half a prefix.
        (&[0, 0], "13"),
    ];
    for (body_bytes, code) in cases {
        let mut client = client.clone().ready().await.unwrap();
        let (response, mut body) = client
            .send_request(common::grpc_request(&server.addr, "Unary"), false)
            .unwrap();
        body.send_data(Bytes::from_static(body_bytes), true)
            .unwrap();
        let status = grpc_status_of(response, within).await;
        assert_eq!(status, code, "body {body_bytes:?}");
    }
    // The same connection still serves a good call: an empty Ask, whole.
    let mut client = client.ready().await.unwrap();
    let (response, mut body) = client
        .send_request(common::grpc_request(&server.addr, "Unary"), false)
        .unwrap();
    body.send_data(Bytes::from_static(&[0, 0, 0, 0, 0]), true)
        .unwrap();
    assert_eq!(grpc_status_of(response, within).await, "0");
    common::still_answers(&server).await;
}

/// A client stream of 13,107 empty messages in one DATA frame with
/// END_STREAM (legal, if odd): the gateway hands rpc-core the whole stream
/// at once, and it must fit the stream's window there, not be taken for a
/// peer that broke it (which would end the client's whole connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_body_of_tiny_messages_is_one_call_not_a_broken_window() {
    use prost::Message;
    let server = common::rdma_server().await;
    let client = common::raw_http2_client(&server.addr).await;
    let mut client = client.ready().await.unwrap();
    let (response, mut body) = client
        .send_request(common::grpc_request(&server.addr, "ClientStream"), false)
        .unwrap();
    let messages = 65_535 / 5;
    body.send_data(Bytes::from(vec![0u8; messages * 5]), true)
        .unwrap();
    let (data, status) = answer_of(response, Duration::from_secs(10)).await;
    assert_eq!(status, "0");
    let answer = rpc_grpc_interop::rdma::Answer::decode(&data[5..]).unwrap();
    assert_eq!(answer.index as usize, messages);
    common::still_answers(&server).await;
}

/// "Rapid reset" (CVE-2023-44487): streams opened and reset at once, as
/// fast as the client can, on one connection. Each would start a call; the
/// server must neither fall behind nor keep them: it answers a new client
/// meanwhile and afterwards, and holds no stream-call work once it is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_reset_as_soon_as_opened_neither_stall_nor_stay() {
    let server = common::rdma_server().await;
    let mut client = common::raw_http2_client(&server.addr).await;
    let mut opened = 0usize;
    let started = Instant::now();
    for _ in 0..5000 {
        client = match tokio::time::timeout(Duration::from_secs(5), client.clone().ready()).await {
            Ok(Ok(client)) => client,
            // The server may end a connection that does this (h2 answers
            // too many resets with GOAWAY): that is a fine outcome too.
            Ok(Err(_)) => break,
            Err(_) => panic!("the server stopped taking streams without ending the connection"),
        };
        let Ok((_response, mut body)) =
            client.send_request(common::grpc_request(&server.addr, "Unary"), false)
        else {
            break;
        };
        body.send_reset(h2::Reason::CANCEL);
        opened += 1;
    }
    assert!(opened > 0);
    eprintln!(
        "opened and reset {opened} streams in {:?}",
        started.elapsed()
    );
    common::still_answers(&server).await;
    // Once the attacker is gone, nothing of its connection stays: rpc-core's
    // connection (and with it every call it started) ends.
    drop(client);
    let stats = server.stats.as_ref().expect("rdma-rpc's server");
    let deadline = Instant::now() + Duration::from_secs(5);
    while stats.connections() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(stats.connections(), 0, "a connection outlived its client");
    assert_eq!(stats.outbound_queued_bytes(), 0);
}
