//! Connection set-up over TCP: two soft QPs reach RTS and talk; mismatches fail clearly.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rpc_transport_rdma::setup::{QpListener, SetupError, connect};
use rpc_transport_rdma::verbs::owned::{Completed, OwnedQueue};
use rpc_transport_rdma::verbs::{
    self, AccessFlags, ConnectOptions, Context, QpCaps, QpInit, QueuePair, RegisteredBuffer,
    SendOp, WcStatus,
};

fn qp(
    context: &Arc<dyn Context>,
    pd: &Arc<dyn verbs::ProtectionDomain>,
) -> (Arc<dyn QueuePair>, Arc<dyn verbs::CompletionQueue>) {
    let cq = context.create_cq(64, None).unwrap();
    let qp = pd
        .create_qp(QpInit {
            send_cq: cq.clone(),
            recv_cq: cq.clone(),
            srq: None,
            caps: QpCaps::default(),
            sq_sig_all: true,
        })
        .unwrap();
    (qp, cq)
}

fn wait_owned(queue: &mut OwnedQueue) -> Completed {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(done) = queue.poll().unwrap().pop() {
            return done;
        }
        assert!(Instant::now() < deadline, "no completion");
        std::thread::sleep(Duration::from_micros(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_setup_connects_two_queue_pairs() {
    let provider = verbs::provider("soft").unwrap();
    let context = provider.open("soft0").unwrap();
    let pd = context.alloc_pd().unwrap();
    let inbox = RegisteredBuffer::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    // Posting through OwnedQueue: the buffers move in and come back with
    // their completions (no `unsafe`).
    let mut server = OwnedQueue::new(&context, &pd, QpCaps::default()).unwrap();
    let mut client = OwnedQueue::new(&context, &pd, QpCaps::default()).unwrap();
    let (server_qp, client_qp) = (server.qp().clone(), client.qp().clone());
    server_qp.to_init().unwrap();
    server.post_recv(inbox).unwrap();

    let listener = QpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let options = ConnectOptions::default();
    let accepting = {
        let server_qp = server_qp.clone();
        tokio::spawn(async move {
            listener
                .accept(&server_qp, "soft", &options, b"server says hi")
                .await
        })
    };
    let established = connect(addr, &client_qp, "soft", &options, b"client says hi")
        .await
        .unwrap();
    assert_eq!(established.peer.payload, b"server says hi");
    let accepted = accepting.await.unwrap().unwrap();
    assert_eq!(accepted.peer.payload, b"client says hi");
    assert_eq!(accepted.peer.address, client_qp.local_address());

    let mut outbox = RegisteredBuffer::new(&pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    outbox.as_mut_slice()[..5].copy_from_slice(b"hello");
    client.post_send(SendOp::Send, outbox, 5).unwrap();
    assert_eq!(wait_owned(&mut client).completion.status, WcStatus::Success);
    let received = wait_owned(&mut server);
    assert_eq!(
        (received.completion.status, received.completion.byte_len),
        (WcStatus::Success, 5)
    );
    assert_eq!(&received.buffer.as_slice()[..5], b"hello");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_mismatch_fails_with_a_message_that_says_what_to_change() {
    let context = verbs::provider("soft").unwrap().open("soft0").unwrap();
    let pd = context.alloc_pd().unwrap();
    let (a, _) = qp(&context, &pd);
    let (b, _) = qp(&context, &pd);
    let listener = QpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let options = ConnectOptions::default();
    let server = tokio::spawn(async move { listener.accept(&a, "ibverbs", &options, b"").await });
    let error = connect(addr, &b, "soft", &options, b"").await.unwrap_err();
    assert!(
        matches!(error, SetupError::ProviderMismatch { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("RDMA_PROVIDER"), "{error}");
    assert!(server.await.unwrap().is_err());
}

#[tokio::test]
async fn a_peer_that_is_not_rdma_rpc_is_refused() {
    use tokio::io::AsyncWriteExt;
    let context = verbs::provider("soft").unwrap().open("soft0").unwrap();
    let pd = context.alloc_pd().unwrap();
    let (a, _) = qp(&context, &pd);
    let listener = QpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let client = tokio::spawn(async move {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(b"\x10\x00\x00\x00GET / HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    });
    let error = listener
        .accept(&a, "soft", &ConnectOptions::default(), b"")
        .await
        .unwrap_err();
    assert!(error.to_string().contains("bad magic"), "{error}");
    client.await.unwrap();
}
