//! Python's grpcio as the client (`python/interop_client.py`): against
//! rdma-rpc's server on `grpc://`, and (the control) against tonic's.

mod common;

use std::time::Duration;

use common::{
    TestServer, python_ready, python_script, rdma_server, tonic_server, wait_for_abandoned,
};

/// Runs interop_client.py against `server` and checks every scenario passed.
async fn grpcio_client_passes_every_scenario(server: TestServer) {
    let over_limit = common::over_limit_code(&server).to_string();
    common::run_python_scenarios(
        "interop_client.py",
        vec![server.addr.clone(), over_limit, server.name.to_owned()],
        &[
            "unary_metadata",
            "every_status_code",
            "deadline",
            "cancellation",
            "large_messages",
            "streams",
        ],
        Duration::from_secs(180),
    )
    .await;
    // The deadline and the cancellation each ended a handler early.
    wait_for_abandoned(&server, 2).await;
}

#[tokio::test]
async fn grpcio_client_against_rdma_rpc_grpc_server() {
    if !python_ready() {
        return;
    }
    grpcio_client_passes_every_scenario(rdma_server().await).await;
}

#[tokio::test]
async fn grpcio_client_against_tonic_server() {
    if !python_ready() {
        return;
    }
    grpcio_client_passes_every_scenario(tonic_server().await).await;
}

/// grpcio's health and reflection clients against rdma-rpc's server: the
/// standard services answer over gRPC, and a Watch sees a change made here.
#[tokio::test]
async fn grpcio_health_and_reflection_clients_against_rdma_rpc_server() {
    if !python_ready() {
        return;
    }
    let server = rdma_server().await;
    let health = server
        .health
        .clone()
        .expect("rdma-rpc's server reports health");
    let mut child = common::python3()
        .arg(python_script("standard_services_client.py"))
        .arg(&server.addr)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run standard_services_client.py");
    let stdout = child.stdout.take().expect("piped");
    let (lines_tx, mut lines) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
            let Ok(line) = line else { break };
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    let read_all = async {
        while let Some(line) = lines.recv().await {
            if line == "watching" {
                health.set_not_serving("interop.v1.Interop");
            }
            seen.push(line);
        }
    };
    tokio::time::timeout(Duration::from_secs(120), read_all)
        .await
        .expect("standard_services_client.py ends within 2 minutes");
    let output = child.wait_with_output().expect("wait");
    assert!(
        output.status.success(),
        "standard_services_client.py failed: {seen:?}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for part in ["ok reflection", "ok health", "ok watch"] {
        assert!(
            seen.iter().any(|line| line == part),
            "{part} missing: {seen:?}"
        );
    }
}
