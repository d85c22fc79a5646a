//! A gRPC client at an rdma-rpc port that is not gRPC: an rdma:// port
//! answers its first call with `UNAVAILABLE` and a message that says to
//! listen on grpc:// (grpcio's and tonic's clients both report it), where it
//! used to get a reset ("Expected SETTINGS frame as the first frame").

mod common;

use std::time::Duration;

use rpc_grpc_interop::tonic_gen::Ask;
use rpc_grpc_interop::tonic_gen::interop_client::InteropClient;

const HINT: &str = "listen on grpc:// for gRPC clients";

#[tokio::test]
async fn tonic_at_an_rdma_port_is_told_to_use_grpc() {
    let server = common::rdma_server_on("rdma").await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect()
        .await
        .expect("TCP connects: the set-up port listens");
    let status = tokio::time::timeout(
        Duration::from_secs(10),
        InteropClient::new(channel).unary(Ask::default()),
    )
    .await
    .expect("answered, not left hanging")
    .expect_err("not a gRPC server");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(status.message().contains(HINT), "{status:?}");
    assert!(status.message().contains("rdma://"), "{status:?}");
    // The server goes on serving rdma-rpc's own clients.
    common::still_answers(&server).await;
}

#[tokio::test]
async fn grpcio_at_an_rdma_port_is_told_to_use_grpc() {
    if !common::python_ready() {
        return;
    }
    let server = common::rdma_server_on("rdma").await;
    let script = "import grpc, sys\n\
                  channel = grpc.insecure_channel(sys.argv[1])\n\
                  try:\n    channel.unary_unary('/interop.v1.Interop/Unary')(b'', timeout=10)\n\
                  except grpc.RpcError as error:\n    print(error.code().name, error.details())\n";
    let addr = server.addr.clone();
    let output = tokio::task::spawn_blocking(move || {
        common::python3()
            .args(["-c", script, &addr])
            .output()
            .expect("run python3")
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.starts_with("UNAVAILABLE "), "{stdout}");
    assert!(stdout.contains(HINT), "{stdout}");
}
