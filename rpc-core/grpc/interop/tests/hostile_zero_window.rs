//! A hostile HTTP/2 peer of the grpc:// server that asks for large unary
//! answers on a connection whose window it never opens (initial window 0):
//! what the server holds for it stays bounded. Alone in its test binary,
//! because it measures the process's resident memory.

mod common;

use std::time::Duration;

use bytes::{BufMut, BytesMut};
use rpc_core::prost::Message;
use rpc_grpc_interop::rdma;

/// Hostile connections.
const CONNECTIONS: usize = 4;

/// Four connections, each with 300 unary calls for 1 MiB answers, none of
/// which the client lets the server send: per connection the gateway holds
/// at most its 8 MiB queue of answers and 4 MiB (plus a frame) handed over
/// by rpc-core, rpc-core's queue its 1 MiB, and the server reads no more
/// requests while that is full (the rest of what the process grows by is
/// the allocator's and the encode buffers kept for reuse): about 60 MiB for
/// the four (116 MiB while the hand-over was 16 frames, whatever their size).
/// Before, every answer queued in the server: 308 MiB for one such
/// connection, 1.23 GB for four.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_a_client_never_lets_through_are_held_within_a_bound() {
    let server = common::rdma_server().await;
    let before = common::resident_bytes();
    let ask = rdma::Ask {
        answer_size: 1 << 20,
        ..rdma::Ask::default()
    }
    .encode_to_vec();
    let mut message = BytesMut::new();
    message.put_u8(0);
    message.put_u32(ask.len() as u32);
    message.put_slice(&ask);
    let message = message.freeze();
    let mut unread = Vec::new();
    for _ in 0..CONNECTIONS {
        let socket = tokio::net::TcpStream::connect(&server.addr).await.unwrap();
        let (mut client, connection) = h2::client::Builder::new()
            .initial_window_size(0)
            .initial_connection_window_size(0)
            .handshake::<_, bytes::Bytes>(socket)
            .await
            .unwrap();
        tokio::spawn(connection);
        for _ in 0..300 {
            client = client.ready().await.unwrap();
            let (response, mut body) = client
                .send_request(common::grpc_request(&server.addr, "Unary"), false)
                .unwrap();
            body.send_data(message.clone(), true).unwrap();
            unread.push(response);
        }
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let grown = common::resident_bytes().saturating_sub(before);
    println!(
        "resident memory grew by {} MiB for {CONNECTIONS} × 300 unread 1 MiB answers",
        grown >> 20
    );
    assert!(
        grown < 120 << 20,
        "the process grew by {} MiB for {CONNECTIONS} × 300 answers the client never let through",
        grown >> 20
    );
    common::still_answers(&server).await;
    drop(unread);
}
