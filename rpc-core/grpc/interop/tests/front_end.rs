//! The `grpc://` front end's own duties, as a gRPC client sees them: the
//! server's shutdown ends its streams, an idle connection is closed, a
//! connection over the server's limit is refused with the reason, and
//! dropping the serve future ends every connection.

use std::time::{Duration, Instant};

use rpc_grpc_interop::tonic_gen::Ask;
use rpc_grpc_interop::tonic_gen::interop_client::InteropClient;
use rpc_grpc_interop::{RdmaInterop, rdma};

type Client = InteropClient<tonic::transport::Channel>;

/// The interop service on `grpc://127.0.0.1:0`, with `configure`'s settings.
async fn listen(
    configure: impl FnOnce(rpc_core::Server) -> rpc_core::Server,
) -> rpc_core::server::Listening {
    rpc_grpc::register();
    configure(rpc_core::Server::builder())
        .add_service(rdma::interop_server::InteropServer::new(
            RdmaInterop::default(),
        ))
        .listen("grpc://127.0.0.1:0")
        .await
        .expect("listen")
}

async fn client(addr: &str) -> Client {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    InteropClient::new(channel)
}

/// An endless server stream: one answer every 5 ms.
fn endless() -> Ask {
    Ask {
        count: u32::MAX,
        sleep_ms: 5,
        ..Ask::default()
    }
}

#[tokio::test]
async fn a_graceful_shutdown_ends_open_grpc_streams_after_the_grace_period() {
    let listening = listen(|server| server.shutdown_grace(Duration::from_millis(300))).await;
    let addr = listening.local_endpoint().authority().to_owned();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(listening.serve_with_shutdown(async {
        let _ = stopped.await;
    }));
    let mut client = client(&addr).await;
    let mut answers = client
        .server_stream(endless())
        .await
        .expect("stream")
        .into_inner();
    for _ in 0..3 {
        answers
            .message()
            .await
            .expect("an answer")
            .expect("not over");
    }
    let signalled = Instant::now();
    stop.send(()).expect("the server listens");
    let status = loop {
        match tokio::time::timeout(Duration::from_secs(5), answers.message())
            .await
            .expect("the stream ends within the grace period and a second")
        {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("an endless stream cannot end well"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("server shutting down"),
        "{status:?}"
    );
    let ended = signalled.elapsed();
    assert!(
        ended >= Duration::from_millis(250),
        "ended after {ended:?}, before the grace period"
    );
    tokio::time::timeout(Duration::from_secs(5), serving)
        .await
        .expect("serve returns once its streams ended")
        .expect("no panic")
        .expect("served");
}

#[tokio::test]
async fn an_idle_grpc_connection_is_closed_and_a_busy_one_is_not() {
    let listening = listen(|server| server.idle_timeout(Duration::from_millis(300))).await;
    let addr = listening.local_endpoint().authority().to_owned();
    let stats = listening.stats();
    let _serving = tokio::spawn(listening.serve());

    // A busy connection: a call every 100 ms for 1.2 s, on one connection.
    let mut busy = client(&addr).await;
    for _ in 0..12 {
        busy.unary(Ask::default()).await.expect("served");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(stats.connections(), 1, "the busy connection stays");

    // An idle one: HTTP/2's handshake, then nothing.
    let socket = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    let (_send, connection) = h2::client::handshake(socket).await.expect("handshake");
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(3), connection)
        .await
        .expect("the server closes an idle connection")
        .ok();
    let closed = started.elapsed();
    assert!(
        closed >= Duration::from_millis(250),
        "closed after {closed:?}, before the idle time-out"
    );
}

#[tokio::test]
async fn a_grpc_connection_over_the_limit_is_refused_with_the_reason() {
    let listening = listen(|server| server.max_connections(1)).await;
    let addr = listening.local_endpoint().authority().to_owned();
    let _serving = tokio::spawn(listening.serve());
    let mut first = client(&addr).await;
    first
        .unary(Ask::default())
        .await
        .expect("the first is served");
    let mut second = client(&addr).await;
    let status = second
        .unary(Ask::default())
        .await
        .expect_err("over the limit");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("connection limit"), "{status:?}");
    first
        .unary(Ask::default())
        .await
        .expect("the first still is");
}

#[tokio::test]
async fn dropping_the_serve_future_ends_its_grpc_connections() {
    let listening = listen(|server| server).await;
    let addr = listening.local_endpoint().authority().to_owned();
    let serving = tokio::spawn(listening.serve());
    let mut client = client(&addr).await;
    let mut answers = client
        .server_stream(endless())
        .await
        .expect("stream")
        .into_inner();
    answers
        .message()
        .await
        .expect("an answer")
        .expect("not over");
    serving.abort();
    let ended = tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            match answers.message().await {
                Ok(Some(_)) => continue,
                other => return other.map(|_| ()),
            }
        }
    })
    .await
    .expect("the stream ends once the serve task is gone");
    assert!(ended.is_err(), "an endless stream cannot end well");
}

#[tokio::test]
async fn a_grpc_front_end_serves_a_listener_bound_elsewhere_without_registration() {
    // No rpc_grpc::register() here: the front end is a value.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let incoming = rpc_grpc::GrpcTransport::default()
        .incoming(listener)
        .expect("a front end over the listener");
    let listening = rpc_core::Server::builder()
        .max_frame_len(1 << 20)
        .add_service(rdma::interop_server::InteropServer::new(
            RdmaInterop::default(),
        ))
        .listen_on_front_end(incoming);
    assert_eq!(
        listening.local_endpoint().to_string(),
        format!("grpc://{addr}")
    );
    let _serving = tokio::spawn(listening.serve());
    let mut client = client(&addr).await;
    let answer = client
        .unary(Ask {
            body: vec![7u8; 1000].into(),
            ..Ask::default()
        })
        .await
        .expect("served")
        .into_inner();
    assert_eq!(answer.body.len(), 1000);
    // The server's own frame limit holds for the injected front end too.
    let status = client
        .unary(Ask {
            body: vec![7u8; 2 << 20].into(),
            ..Ask::default()
        })
        .await
        .expect_err("over the server's 1 MiB limit");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
}
