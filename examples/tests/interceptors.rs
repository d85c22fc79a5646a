//! Interceptors on generated clients and servers, and as a server-wide layer,
//! behave the same over mem://, tcp://, rdma:// (soft provider) and grpc://.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rdma_rpc_examples::EchoService;
use rdma_rpc_examples::echo::echo_client::EchoClient;
use rdma_rpc_examples::echo::echo_server::EchoServer;
use rdma_rpc_examples::echo::{EchoReply, EchoRequest};
use rpc_core::{Channel, Code, InterceptorLayer, Request, Server, Status};

const TOKEN: &str = "Bearer let-me-in";

/// The server's check: the right bearer token, or `UNAUTHENTICATED`.
fn check_token(request: Request<()>) -> Result<Request<()>, Status> {
    match request.metadata().get("authorization") {
        Some(token) if token == TOKEN => Ok(request),
        Some(_) => Err(Status::unauthenticated("wrong bearer token")),
        None => Err(Status::unauthenticated("a bearer token is required")),
    }
}

/// The client's side: adds the token, and refuses (before sending anything)
/// a call whose deadline is over 10 s.
fn add_token(mut request: Request<()>) -> Result<Request<()>, Status> {
    if request
        .timeout()
        .is_some_and(|timeout| timeout.as_secs() > 10)
    {
        return Err(Status::invalid_argument(
            "deadlines over 10 s are not allowed here",
        ));
    }
    request
        .metadata_mut()
        .insert("authorization", TOKEN)
        .map_err(|error| Status::internal(error.to_string()))?;
    Ok(request)
}

fn echo(message: &str) -> EchoRequest {
    EchoRequest {
        message: message.to_owned(),
        payload: Default::default(),
    }
}

async fn run_over(listen: &str) {
    // Counts every call the server's stack sees (a server-wide layer), and
    // which method it was for.
    let seen = Arc::new(AtomicUsize::new(0));
    let counted = seen.clone();
    let listening = Server::builder()
        .layer(InterceptorLayer::new(move |request: Request<()>| {
            assert_eq!(request.method(), Some("/echo.v1.Echo/Say"));
            counted.fetch_add(1, Ordering::Relaxed);
            Ok(request)
        }))
        .add_service(EchoServer::with_interceptor(EchoService, check_token))
        .listen(listen)
        .await
        .unwrap();
    let endpoint = listening.local_endpoint();
    eprintln!("interceptors over {endpoint}");
    let server = tokio::spawn(listening.serve());
    let channel = Channel::connect(endpoint.clone()).await.unwrap();

    // With the client's interceptor: the token goes with every call.
    let mut client = EchoClient::with_interceptor(channel.clone(), add_token);
    let reply: EchoReply = client.say(echo("hello")).await.unwrap().into_inner();
    assert_eq!(reply.message, "hello", "over {endpoint}");
    assert_eq!(seen.load(Ordering::Relaxed), 1);

    // Without it the server refuses before the handler runs.
    let mut plain = EchoClient::new(channel.clone());
    let status = plain.say(echo("no token")).await.unwrap_err();
    assert_eq!(
        status.code(),
        Code::Unauthenticated,
        "over {endpoint}: {status}"
    );
    assert_eq!(status.message(), "a bearer token is required");
    let mut wrong = Request::new(echo("wrong token"));
    wrong
        .metadata_mut()
        .insert("authorization", "Bearer guess")
        .unwrap();
    let status = plain.say(wrong).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    assert_eq!(status.message(), "wrong bearer token");
    assert_eq!(
        seen.load(Ordering::Relaxed),
        3,
        "the layer saw the refused calls too"
    );

    // The client's interceptor refuses locally: nothing reaches the server.
    let mut long = Request::new(echo("too long"));
    long.set_timeout(std::time::Duration::from_secs(60));
    let status = client.say(long).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(seen.load(Ordering::Relaxed), 3, "nothing was sent");

    // And the connection is fine after all of it.
    let reply = client.say(echo("again")).await.unwrap().into_inner();
    assert_eq!(reply.message, "again");
    server.abort();
}

#[tokio::test]
async fn interceptors_work_over_every_transport() {
    rpc_transport_rdma::register().unwrap();
    rpc_grpc::register();
    for listen in [
        "mem://interceptors",
        "tcp://127.0.0.1:0",
        "rdma://127.0.0.1:0",
        "grpc://127.0.0.1:0",
    ] {
        run_over(listen).await;
    }
}
