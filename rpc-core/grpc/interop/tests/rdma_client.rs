//! rdma-rpc's generated client over `grpc://`, against tonic's server (a
//! gRPC implementation no one here wrote) and against rdma-rpc's own server
//! on `grpc://`: the same scenarios, the same answers.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{
    ERROR_CODES, LIMIT, ODD_MESSAGE, TestServer, grpcio_server, rdma_server, tonic_server,
    wait_for_abandoned,
};
use futures_util::StreamExt;
use rpc_core::{Channel, Code, Request};
use rpc_grpc_interop::rdma::Ask;
use rpc_grpc_interop::rdma::interop_client::InteropClient;
use rpc_grpc_interop::{ANSWER_HEADER, ANSWER_HEADER_BIN, FAILURE_TRAILER, FAILURE_TRAILER_BIN};

async fn client(server: &TestServer) -> InteropClient<Channel> {
    common::register();
    // Above the servers' limit, so that theirs is what a large request meets.
    let channel = Channel::builder(server.endpoint.parse().unwrap())
        .max_frame_len(2 * LIMIT)
        .connect()
        .await
        .expect("connect over grpc://");
    InteropClient::new(channel)
}

fn ask(body: &'static [u8]) -> Ask {
    Ask {
        body: Bytes::from_static(body),
        ..Ask::default()
    }
}

async fn unary_carries_messages_and_metadata_both_ways(server: TestServer) {
    let mut client = client(&server).await;
    let mut request = Request::new(ask(b"hello"));
    request.metadata_mut().insert("x-user", "ada").unwrap();
    request
        .metadata_mut()
        .insert_bin("x-blob-bin", vec![0u8, 255, 10])
        .unwrap();
    let response = client.unary(request).await.expect("unary call");
    assert_eq!(
        response.metadata().get(ANSWER_HEADER.0),
        Some(ANSWER_HEADER.1)
    );
    assert_eq!(
        response
            .metadata()
            .get_bin(ANSWER_HEADER_BIN.0)
            .map(|b| &b[..]),
        Some(ANSWER_HEADER_BIN.1)
    );
    let answer = response.into_inner();
    assert_eq!(&answer.body[..], b"hello");
    assert_eq!(answer.seen_metadata, ["x-user=ada", "x-blob-bin=00ff0a"]);
}

async fn every_status_code_comes_back_with_its_message_and_trailers(server: TestServer) {
    let mut client = client(&server).await;
    for code in ERROR_CODES {
        let request = Ask {
            fail_with_code: code,
            fail_message: ODD_MESSAGE.into(),
            ..Ask::default()
        };
        let status = client.unary(request).await.expect_err("fails as asked");
        assert_eq!(status.code() as i32, code, "{status:?}");
        assert_eq!(status.message(), ODD_MESSAGE);
        assert_eq!(
            status.metadata().get(FAILURE_TRAILER.0),
            Some(FAILURE_TRAILER.1)
        );
        assert_eq!(
            status
                .metadata()
                .get_bin(FAILURE_TRAILER_BIN.0)
                .map(|b| &b[..]),
            Some(FAILURE_TRAILER_BIN.1)
        );
    }
}

async fn a_deadline_reaches_the_server_and_ends_the_call(server: TestServer) {
    let mut client = client(&server).await;
    let mut request = Request::new(Ask {
        sleep_ms: 5_000,
        ..Ask::default()
    });
    request.set_timeout(Duration::from_millis(300));
    let started = Instant::now();
    let status = client.unary(request).await.expect_err("times out");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    wait_for_abandoned(&server, 1).await;
}

async fn dropping_a_call_cancels_the_handler(server: TestServer) {
    let mut client = client(&server).await;
    let call = tokio::spawn(async move {
        client
            .unary(Ask {
                sleep_ms: 10_000,
                ..Ask::default()
            })
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    call.abort();
    wait_for_abandoned(&server, 1).await;
}

async fn dropping_a_response_stream_cancels_the_handler(server: TestServer) {
    let mut client = client(&server).await;
    let mut answers = client
        .server_stream(Ask {
            count: 1_000,
            sleep_ms: 20,
            ..Ask::default()
        })
        .await
        .expect("server stream")
        .into_inner();
    answers.next().await.expect("an answer").expect("ok");
    drop(answers);
    wait_for_abandoned(&server, 1).await;
}

async fn a_request_message_over_the_channels_limit_ends_the_call_with_that_error(
    server: TestServer,
) {
    let mut client = client(&server).await;
    // The channel's limit is 2 × LIMIT: this message is refused here,
    // after one that went; the call ends with that error, and the
    // connection goes on.
    let too_big = Ask {
        body: Bytes::from(vec![1u8; 2 * LIMIT + 1]),
        ..Ask::default()
    };
    let (asks, asked) = tokio::sync::mpsc::unbounded_channel();
    asks.send(ask(b"ab")).unwrap();
    let asked = futures_util::stream::unfold(asked, |mut asked| async move {
        asked.recv().await.map(|ask| (ask, asked))
    });
    let mut calling = client.clone();
    let call = tokio::spawn(async move { calling.client_stream(asked).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    asks.send(too_big).unwrap();
    let status = call.await.unwrap().expect_err("the call fails");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("exceeds the") && status.message().contains("limit"),
        "the channel's own reason: {status:?}"
    );
    let answer = client.unary(ask(b"after")).await.expect("the next call");
    assert_eq!(&answer.get_ref().body[..], b"after");
}

async fn sixteen_mib_each_way_and_over_the_limit_is_resource_exhausted(server: TestServer) {
    let mut client = client(&server).await;
    let big = Bytes::from(vec![7u8; 16 << 20]);
    let answer = client
        .unary(Ask {
            body: big.clone(),
            ..Ask::default()
        })
        .await
        .expect("16 MiB echo")
        .into_inner();
    assert!(answer.body == big, "the 16 MiB echo differs");
    let sized = client
        .unary(Ask {
            answer_size: 16 << 20,
            ..Ask::default()
        })
        .await
        .expect("16 MiB answer")
        .into_inner();
    assert_eq!(sized.body.len(), 16 << 20);
    // Over the server's limit: its status, and the connection goes on.
    let over = client
        .unary(Ask {
            body: Bytes::from(vec![1u8; LIMIT + 1]),
            ..Ask::default()
        })
        .await
        .expect_err("over the server's limit");
    assert_eq!(
        over.code() as i32,
        common::over_limit_code(&server),
        "{over:?}"
    );
    // Over the client's limit (a second channel with a limit of 1 MiB).
    let small = Channel::builder(server.endpoint.parse().unwrap())
        .max_frame_len(1 << 20)
        .connect()
        .await
        .expect("connect");
    let over = InteropClient::new(small)
        .unary(Ask {
            answer_size: 2 << 20,
            ..Ask::default()
        })
        .await
        .expect_err("over the client's limit");
    assert_eq!(over.code(), Code::ResourceExhausted, "{over:?}");
    let after = client.unary(ask(b"still")).await.expect("still serving");
    assert_eq!(&after.into_inner().body[..], b"still");
}

async fn server_streams_arrive_in_order_and_end_with_the_status(server: TestServer) {
    let mut client = client(&server).await;
    let mut answers = client
        .server_stream(Ask {
            count: 1000,
            body: Bytes::from_static(b"tick"),
            ..Ask::default()
        })
        .await
        .expect("server stream")
        .into_inner();
    let mut index = 0;
    while let Some(answer) = answers.message().await.expect("answer") {
        assert_eq!(answer.index, index);
        index += 1;
    }
    assert_eq!(index, 1000);
    // An error after messages arrives after them.
    let mut failing = client
        .server_stream(Ask {
            count: 5,
            fail_with_code: Code::Aborted as i32,
            fail_message: "after five".into(),
            ..Ask::default()
        })
        .await
        .expect("server stream")
        .into_inner();
    for expected in 0..5 {
        let answer = failing.message().await.expect("answer").expect("one more");
        assert_eq!(answer.index, expected);
    }
    let status = failing.message().await.expect_err("then the error");
    assert_eq!(status.code(), Code::Aborted);
    assert_eq!(status.message(), "after five");
}

async fn client_streams_and_bidirectional_streams_work(server: TestServer) {
    let mut client = client(&server).await;
    let asks = futures_util::stream::iter((0..100).map(|_| ask(b"ab")));
    let summary = client
        .client_stream(asks)
        .await
        .expect("client stream")
        .into_inner();
    assert_eq!(summary.index, 100);
    assert_eq!(summary.body.len(), 200);
    // Bidirectional, in lock step: each answer comes before the next ask.
    // The first ask goes before the call resolves: a server may hold its
    // response headers back until its first answer (grpcio does).
    let (asks, asked) = tokio::sync::mpsc::unbounded_channel();
    let round_ask = |round: u32| Ask {
        body: Bytes::from(round.to_le_bytes().to_vec()),
        ..Ask::default()
    };
    asks.send(round_ask(0)).unwrap();
    let asked = futures_util::stream::unfold(asked, |mut asked| async move {
        asked.recv().await.map(|ask| (ask, asked))
    });
    let mut answers = client.bidi(asked).await.expect("bidi").into_inner();
    for round in 0..50u32 {
        if round > 0 {
            asks.send(round_ask(round)).unwrap();
        }
        let answer = answers.next().await.expect("an answer").expect("ok");
        assert_eq!(answer.index, round);
        assert_eq!(&answer.body[..], &round.to_le_bytes());
    }
    drop(asks);
    assert!(
        answers.next().await.is_none(),
        "the stream ends after the half-close"
    );
}

macro_rules! against_every_server {
    ($($scenario:ident),* $(,)?) => {
        mod against_tonic {
            use super::*;
            $(
                #[tokio::test]
                async fn $scenario() {
                    super::$scenario(tonic_server().await).await;
                }
            )*
        }
        mod against_rdma_rpc_grpc {
            use super::*;
            $(
                #[tokio::test]
                async fn $scenario() {
                    super::$scenario(rdma_server().await).await;
                }
            )*
        }
        mod against_tonic_service_over_rdma {
            use super::*;
            $(
                #[tokio::test]
                async fn $scenario() {
                    super::$scenario(common::tonic_service_server().await).await;
                }
            )*
        }
        mod against_grpcio {
            use super::*;
            $(
                #[tokio::test]
                async fn $scenario() {
                    let Some(server) = grpcio_server().await else { return };
                    super::$scenario(server).await;
                }
            )*
        }
    };
}

against_every_server!(
    unary_carries_messages_and_metadata_both_ways,
    every_status_code_comes_back_with_its_message_and_trailers,
    a_deadline_reaches_the_server_and_ends_the_call,
    dropping_a_call_cancels_the_handler,
    dropping_a_response_stream_cancels_the_handler,
    a_request_message_over_the_channels_limit_ends_the_call_with_that_error,
    sixteen_mib_each_way_and_over_the_limit_is_resource_exhausted,
    server_streams_arrive_in_order_and_end_with_the_status,
    client_streams_and_bidirectional_streams_work,
);
