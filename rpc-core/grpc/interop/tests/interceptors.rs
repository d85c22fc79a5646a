//! Interceptors against grpcio, both ways: grpcio's client against an
//! rdma-rpc server whose service runs one (`python/interceptor_client.py`),
//! and rdma-rpc's client with one against grpcio's server (and, the same
//! scenario, tonic's and rdma-rpc's).

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{TestServer, grpcio_server, python_ready, rdma_server, tonic_server};
use rpc_core::{Channel, Code, Request, Status};
use rpc_grpc_interop::RdmaInterop;
use rpc_grpc_interop::rdma::Ask;
use rpc_grpc_interop::rdma::interop_client::InteropClient;
use rpc_grpc_interop::rdma::interop_server::InteropServer;

/// The server's interceptor: `x-token` must be `let-me-in`; the handler
/// then sees `x-intercepted: yes` beside it.
fn require_token(mut request: Request<()>) -> Result<Request<()>, Status> {
    match request.metadata().get("x-token") {
        Some("let-me-in") => {}
        Some(_) => return Err(Status::unauthenticated("wrong x-token")),
        None => return Err(Status::unauthenticated("x-token is required")),
    }
    request
        .metadata_mut()
        .insert("x-intercepted", "yes")
        .map_err(|error| Status::internal(error.to_string()))?;
    Ok(request)
}

#[tokio::test]
async fn grpcio_client_against_a_server_interceptor() {
    if !python_ready() {
        return;
    }
    common::register();
    let listening = rpc_core::Server::builder()
        .add_service(InteropServer::with_interceptor(
            RdmaInterop::default(),
            require_token,
        ))
        .listen("grpc://127.0.0.1:0")
        .await
        .unwrap();
    let addr = listening.local_endpoint().authority().to_owned();
    let server = tokio::spawn(listening.serve());
    common::run_python_scenarios(
        "interceptor_client.py",
        vec![addr],
        &["refused", "admitted"],
        Duration::from_secs(120),
    )
    .await;
    server.abort();
}

/// rdma-rpc's client adds `x-token` in an interceptor; the server's handler
/// reports the metadata it saw. A refusal by the client's interceptor sends
/// nothing.
async fn client_interceptor_metadata_reaches(server: TestServer) {
    common::register();
    let channel = Channel::connect(server.endpoint.as_str()).await.unwrap();
    let mut client = InteropClient::with_interceptor(channel, |mut request: Request<()>| {
        if request.metadata().get("x-refuse").is_some() {
            return Err(Status::failed_precondition("refused by the client"));
        }
        request
            .metadata_mut()
            .insert("x-token", "from-the-interceptor")
            .map_err(|error| Status::internal(error.to_string()))?;
        Ok(request)
    });
    let ask = Ask {
        body: Bytes::from_static(b"hello"),
        ..Ask::default()
    };
    let mut request = Request::new(ask.clone());
    request.metadata_mut().insert("x-user", "ada").unwrap();
    let answer = client.unary(request).await.unwrap().into_inner();
    assert_eq!(&answer.body[..], b"hello");
    assert_eq!(
        answer.seen_metadata,
        ["x-user=ada", "x-token=from-the-interceptor"],
        "against {}",
        server.name
    );
    let mut refused = Request::new(ask);
    refused.metadata_mut().insert("x-refuse", "yes").unwrap();
    let status = client.unary(refused).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(status.message(), "refused by the client");
}

#[tokio::test]
async fn client_interceptor_against_grpcio_server() {
    let Some(server) = grpcio_server().await else {
        return;
    };
    client_interceptor_metadata_reaches(server).await;
}

#[tokio::test]
async fn client_interceptor_against_tonic_server() {
    client_interceptor_metadata_reaches(tonic_server().await).await;
}

#[tokio::test]
async fn client_interceptor_against_rdma_rpc_server() {
    client_interceptor_metadata_reaches(rdma_server().await).await;
}
