//! tonic's generated client over its own HTTP/2 transport, against
//! rdma-rpc's server on `grpc://`, and (the control: the scenarios say what
//! gRPC does) against tonic's own server.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{
    ERROR_CODES, LIMIT, ODD_MESSAGE, TestServer, grpcio_server, rdma_server, tonic_server,
    wait_for_abandoned,
};
use futures_util::StreamExt;
use rpc_grpc_interop::tonic_gen::Ask;
use rpc_grpc_interop::tonic_gen::interop_client::InteropClient;
use rpc_grpc_interop::{ANSWER_HEADER, ANSWER_HEADER_BIN, FAILURE_TRAILER, FAILURE_TRAILER_BIN};
use tonic::{Code, Request};

/// tonic's channel to an HTTP/2 endpoint, or its client over rdma-rpc's
/// Channel (`TonicChannel`) to an `rdma://` one: either, as one type.
type AnyChannel = tower::util::BoxCloneSyncService<
    http::Request<tonic::body::Body>,
    http::Response<tonic::body::Body>,
    tower::BoxError,
>;

async fn client(server: &TestServer) -> InteropClient<AnyChannel> {
    use tower::ServiceExt;
    let channel = if server.endpoint.starts_with("grpc://") {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.addr))
            .unwrap()
            .connect()
            .await
            .expect("connect");
        AnyChannel::new(channel.map_err(|error| -> tower::BoxError { Box::new(error) }))
    } else {
        common::register();
        // Above the servers' limit, so that theirs is what a large request meets.
        let channel = rpc_core::Channel::builder(server.endpoint.parse().unwrap())
            .max_frame_len(2 * LIMIT)
            .connect()
            .await
            .expect("connect");
        AnyChannel::new(rpc_grpc::tonic::TonicChannel::new(channel).map_err(tower::BoxError::from))
    };
    InteropClient::new(channel)
        .max_decoding_message_size(LIMIT)
        .max_encoding_message_size(2 * LIMIT)
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
    request
        .metadata_mut()
        .insert("x-user", "ada".parse().unwrap());
    request.metadata_mut().insert_bin(
        "x-blob-bin",
        tonic::metadata::MetadataValue::from_bytes(&[0, 255, 10]),
    );
    let response = client.unary(request).await.expect("unary call");
    assert_eq!(
        response.metadata().get(ANSWER_HEADER.0).unwrap(),
        ANSWER_HEADER.1
    );
    assert_eq!(
        &response
            .metadata()
            .get_bin(ANSWER_HEADER_BIN.0)
            .unwrap()
            .to_bytes()
            .unwrap()[..],
        ANSWER_HEADER_BIN.1
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
            status.metadata().get(FAILURE_TRAILER.0).unwrap(),
            FAILURE_TRAILER.1
        );
        assert_eq!(
            &status
                .metadata()
                .get_bin(FAILURE_TRAILER_BIN.0)
                .unwrap()
                .to_bytes()
                .unwrap()[..],
            FAILURE_TRAILER_BIN.1
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
    assert!(
        matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{status:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(2));
    wait_for_abandoned(&server, 1).await;
}

async fn dropping_a_call_cancels_the_handler(server: TestServer) {
    let mut client = client(&server).await;
    let call = client.unary(Ask {
        sleep_ms: 10_000,
        ..Ask::default()
    });
    // The call is dropped (cancelled) when the sleep wins.
    tokio::select! {
        ended = call => panic!("the call ended by itself: {ended:?}"),
        () = tokio::time::sleep(Duration::from_millis(300)) => {}
    }
    wait_for_abandoned(&server, 1).await;
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
    let after = client.unary(ask(b"still")).await.expect("still serving");
    assert_eq!(&after.into_inner().body[..], b"still");
}

async fn every_streaming_kind_works(server: TestServer) {
    let mut client = client(&server).await;
    let mut answers = client
        .server_stream(Ask {
            count: 1000,
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
    let asks = futures_util::stream::iter((0..100).map(|_| ask(b"ab")));
    let summary = client
        .client_stream(asks)
        .await
        .expect("client stream")
        .into_inner();
    assert_eq!(summary.index, 100);
    assert_eq!(summary.body.len(), 200);
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
    }
    drop(asks);
    assert!(answers.next().await.is_none());
}

async fn a_thousand_calls_in_flight_on_one_connection(server: TestServer) {
    let client = client(&server).await;
    let calls = (0..1000u32).map(|n| {
        let mut client = client.clone();
        async move {
            let body = Bytes::from(n.to_le_bytes().to_vec());
            let ask = Ask {
                body: body.clone(),
                ..Ask::default()
            };
            let answer = client.unary(Request::new(ask)).await.expect("call");
            assert_eq!(answer.into_inner().body, body);
        }
    });
    tokio::time::timeout(
        Duration::from_secs(60),
        futures_util::future::join_all(calls),
    )
    .await
    .expect("every call answered");
}

macro_rules! against_every_server {
    ($($scenario:ident),* $(,)?) => {
        mod against_rdma_rpc_grpc {
            use super::*;
            $(
                #[tokio::test]
                async fn $scenario() {
                    super::$scenario(rdma_server().await).await;
                }
            )*
        }
        mod against_tonic {
            use super::*;
            $(
                #[tokio::test]
                async fn $scenario() {
                    super::$scenario(tonic_server().await).await;
                }
            )*
        }
        mod over_rdma_to_rdma_rpc {
            use super::*;
            $(
                #[tokio::test]
                async fn $scenario() {
                    super::$scenario(common::rdma_server_on("rdma").await).await;
                }
            )*
        }
        mod over_rdma_to_tonic_service {
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
    sixteen_mib_each_way_and_over_the_limit_is_resource_exhausted,
    every_streaming_kind_works,
    a_thousand_calls_in_flight_on_one_connection,
);
