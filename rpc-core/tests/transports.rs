//! The transport conformance suite over `tcp://` and `mem://`, plus the
//! TCP-only cases (raw byte streams, a real server process killed).

mod suite;

mod tcp {
    use crate::suite::TcpBed;
    crate::transport_suite!(TcpBed);
}

mod mem {
    use crate::suite::MemBed;
    crate::transport_suite!(MemBed);
}

/// Cases that need raw TCP byte streams or a second process.
mod tcp_only {
    use std::time::{Duration, Instant};

    use rpc_core::Channel;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use crate::suite::{
        ChildServer, TcpBed, assert_all_unavailable_within_a_second, assert_echoes,
        spawn_hanging_calls, start_with,
    };

    const CHILD_ENV: &str = "RPC_CORE_TEST_CHILD_SERVER";

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn gib_payload_round_trips() {
        crate::suite::gib_payload_round_trips(&TcpBed).await;
    }

    /// Writes `bytes` on a raw TCP connection and checks the server closes it.
    async fn expect_closed(addr: &str, bytes: &[u8], half_close: bool) {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let _ = stream.write_all(bytes).await;
        if half_close {
            stream.shutdown().await.unwrap();
        }
        let mut sink = Vec::new();
        let read =
            tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut sink)).await;
        assert!(read.is_ok(), "server did not close the connection");
    }

    #[tokio::test]
    async fn raw_byte_streams_close_only_their_connection() {
        let server = start_with(&TcpBed, |s| s.max_frame_len(1 << 20)).await;
        let addr = server.endpoint.authority().to_owned();
        let healthy = Channel::connect(server.endpoint.clone()).await.unwrap();

        // A 4 GiB length prefix and no frame header: refused before anything
        // more is buffered (a real frame over the limit is skipped and its
        // call refused: the suite's frames_over_the_limit_fail_their_call_only).
        let mut huge = u32::MAX.to_le_bytes().to_vec();
        huge.extend_from_slice(&[0xee; 40]);
        expect_closed(&addr, &huge, false).await;
        // A frame cut short by EOF.
        let mut cut = 100u32.to_le_bytes().to_vec();
        cut.extend_from_slice(&[1u8; 10]);
        expect_closed(&addr, &cut, true).await;
        // Random bytes.
        expect_closed(&addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", false).await;

        assert_echoes(&healthy, "ok").await;
        let fresh = Channel::connect(server.endpoint.clone()).await.unwrap();
        assert_echoes(&fresh, "ok").await;
    }

    /// Not a test by itself: the server half of
    /// `killed_server_process_fails_pending_calls_within_a_second`, run in a
    /// child process of this test binary.
    #[tokio::test]
    #[ignore = "helper process for killed_server_process_fails_pending_calls_within_a_second"]
    async fn child_server_process() {
        if std::env::var_os(CHILD_ENV).is_none() {
            return;
        }
        let server = start_with(&TcpBed, |s| s).await;
        println!("LISTENING {}", server.endpoint);
        std::future::pending::<()>().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn killed_server_process_fails_pending_calls_within_a_second() {
        let mut child = ChildServer::spawn("tcp_only::child_server_process", CHILD_ENV);
        let endpoint = child.endpoint.clone();
        let channel = Channel::connect(endpoint.as_str()).await.unwrap();
        assert_echoes(&channel, "hi").await;
        let pending = spawn_hanging_calls(&channel, 16);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let killed = Instant::now();
        child.kill();
        assert_all_unavailable_within_a_second(pending, killed).await;
    }
}

/// Transports passed as values (`ChannelBuilder::transport`,
/// `Router::listen_with`, `Router::listen_on`): no registration, any scheme.
mod injected {
    use std::sync::Arc;

    use rpc_core::transport::memory::MemoryTransport;
    use rpc_core::transport::{Transport, TransportConfig};
    use rpc_core::{Channel, Server};
    use tokio::sync::mpsc;

    use crate::suite::{Probe, assert_echoes};

    #[tokio::test]
    async fn a_transport_passed_as_a_value_needs_no_registration() {
        let (events, _seen) = mpsc::unbounded_channel();
        let listening = Server::builder()
            .add_service(Probe::new(events))
            .listen_with(Arc::new(MemoryTransport), "inproc://injected")
            .await
            .unwrap();
        assert_eq!(listening.local_endpoint().scheme(), "inproc");
        let server = tokio::spawn(listening.serve());

        let channel = Channel::builder("inproc://injected".parse().unwrap())
            .transport(Arc::new(MemoryTransport))
            .connect()
            .await
            .unwrap();
        assert_echoes(&channel, "over an injected transport").await;

        // The scheme is in no registry: without the value it cannot connect.
        let error = Channel::connect("inproc://injected").await.unwrap_err();
        assert!(error.to_string().contains("inproc"), "{error}");
        server.abort();
    }

    #[tokio::test]
    async fn a_listener_made_outside_is_served() {
        let config = TransportConfig {
            max_frame_len: 1 << 20,
            receive_budget: None,
        };
        let listener = MemoryTransport
            .bind(&"inproc://outside".parse().unwrap(), &config)
            .await
            .unwrap();
        let (events, _seen) = mpsc::unbounded_channel();
        let listening = Server::builder()
            .add_service(Probe::new(events))
            .listen_on(listener);
        let server = tokio::spawn(listening.serve());
        let channel = Channel::builder("inproc://outside".parse().unwrap())
            .transport(Arc::new(MemoryTransport))
            .connect()
            .await
            .unwrap();
        assert_echoes(&channel, "served from an incoming stream").await;
        server.abort();
    }
}
