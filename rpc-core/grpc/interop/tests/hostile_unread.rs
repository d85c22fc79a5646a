//! A hostile HTTP/2 peer of the grpc:// server that opens many server
//! streams and never reads them: what the server holds stays bounded. Alone
//! in its test binary, because it measures the process's resident memory.

mod common;

use std::time::Duration;

use bytes::{BufMut, BytesMut};
use rpc_core::prost::Message;
use rpc_grpc_interop::rdma;

/// Many server streams that the client never reads: the server holds a
/// bounded amount, not each stream's window of answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_its_streams_is_held_back() {
    let server = common::rdma_server().await;
    let before = common::resident_bytes();
    let mut client = common::raw_http2_client(&server.addr).await;
    let ask = rdma::Ask {
        count: 1_000_000,
        answer_size: 64 << 10,
        ..rdma::Ask::default()
    }
    .encode_to_vec();
    let mut message = BytesMut::new();
    message.put_u8(0);
    message.put_u32(ask.len() as u32);
    message.put_slice(&ask);
    let message = message.freeze();
    let mut unread = Vec::new();
    for _ in 0..200 {
        client = client.ready().await.unwrap();
        let (response, mut body) = client
            .send_request(common::grpc_request(&server.addr, "ServerStream"), false)
            .unwrap();
        body.send_data(message.clone(), true).unwrap();
        unread.push(response);
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let grown = common::resident_bytes().saturating_sub(before);
    println!("resident memory grew by {} MiB", grown >> 20);
    // Each stream's rdma-rpc window alone is 4 MiB (800 MiB for 200).
    assert!(
        grown < 200 << 20,
        "the process grew by {} MiB for 200 unread streams",
        grown >> 20
    );
    common::still_answers(&server).await;
    drop(unread);
}
