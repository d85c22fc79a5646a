//! A client told where to fall back: an `rdma://` endpoint whose peer is a
//! plain gRPC server (it cannot do RDMA) is reached over `grpc://` instead.

mod common;

use std::time::Duration;

use bytes::Bytes;
use rpc_core::Channel;
use rpc_grpc_interop::rdma::Ask;
use rpc_grpc_interop::rdma::interop_client::InteropClient;

#[tokio::test]
async fn an_rdma_endpoint_that_is_a_plain_grpc_server_falls_back_to_grpc() {
    common::register();
    for server in [common::tonic_server().await, common::rdma_server().await] {
        let not_rdma = format!("rdma://{}", server.addr);
        // Without a fallback, the RDMA set-up fails: this peer speaks HTTP/2.
        let refused = Channel::builder(not_rdma.parse().unwrap())
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await;
        assert!(
            refused.is_err(),
            "{} server took an rdma:// set-up",
            server.name
        );
        let channel = Channel::builder(not_rdma.parse().unwrap())
            .connect_timeout(Duration::from_secs(5))
            .fallback(server.endpoint.parse().unwrap())
            .connect()
            .await
            .expect("connects through the fallback");
        let answer = InteropClient::new(channel)
            .unary(Ask {
                body: Bytes::from_static(b"over grpc"),
                ..Ask::default()
            })
            .await
            .expect("a call through the fallback")
            .into_inner();
        assert_eq!(&answer.body[..], b"over grpc", "{}", server.name);
    }
}

#[tokio::test]
async fn a_dead_rdma_endpoint_falls_back_to_tcp() {
    common::register();
    let server = common::rdma_server_on("tcp").await;
    let nothing_there = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = format!("rdma://{}", nothing_there.local_addr().unwrap());
    drop(nothing_there);
    let channel = Channel::builder(dead.parse().unwrap())
        .fallback(server.endpoint.parse().unwrap())
        .connect_lazy();
    let mut client = InteropClient::new(channel);
    for _ in 0..3 {
        let answer = client
            .unary(Ask {
                body: Bytes::from_static(b"over tcp"),
                ..Ask::default()
            })
            .await
            .expect("a call through the fallback")
            .into_inner();
        assert_eq!(&answer.body[..], b"over tcp");
    }
}
