//! Metrics: an echo server and client over rdma:// (or any endpoint) with a
//! Prometheus exporter; makes some calls, then prints what a Prometheus
//! scrape of `/metrics` returns (rdma-rpc's own metrics only).
//!
//! `cargo run --release --example metrics [-- ENDPOINT [METRICS_ADDR]]`
//! (defaults `rdma://127.0.0.1:0` and `127.0.0.1:9464`). With `--serve` it
//! keeps serving (and exporting) until Ctrl-C.

use std::net::SocketAddr;

use rdma_rpc_examples::echo::EchoRequest;
use rdma_rpc_examples::echo::echo_client::EchoClient;
use rdma_rpc_examples::echo::echo_server::EchoServer;
use rdma_rpc_examples::{EchoService, export_prometheus, init_logging, scrape};

/// Metrics: an echo server and client with a Prometheus exporter.
///
/// Makes 100 calls, then prints what a Prometheus scrape of `/metrics`
/// returns (rdma-rpc's own metrics only).
#[derive(Debug, clap::Parser)]
#[command(name = "metrics")]
struct Cli {
    /// Where the echo server listens (rdma://, tcp:// or mem://; port 0: any
    /// free port); the client connects to the address it got.
    #[arg(value_name = "ENDPOINT", default_value = "rdma://127.0.0.1:0")]
    endpoint: String,
    /// Where the exporter serves `/metrics` over HTTP.
    #[arg(value_name = "METRICS_ADDR", default_value = "127.0.0.1:9464")]
    metrics_addr: SocketAddr,
    /// After the calls, keep serving (and exporting) until Ctrl-C.
    #[arg(long)]
    serve: bool,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Cli {
        endpoint,
        metrics_addr,
        serve: keep_serving,
    } = clap::Parser::parse();
    init_logging();
    rpc_transport_rdma::register()?;
    export_prometheus(metrics_addr)?;

    let listening = rpc_core::Server::builder()
        .add_service(EchoServer::new(EchoService))
        .listen(endpoint.as_str())
        .await?;
    let endpoint = listening.local_endpoint();
    let server = tokio::spawn(listening.serve());
    let mut client = EchoClient::connect(endpoint.to_string()).await?;
    for i in 0..100 {
        client
            .say(EchoRequest {
                message: format!("call {i}"),
                payload: vec![7u8; 64 * i].into(),
            })
            .await?;
    }
    println!("100 calls over {endpoint}; metrics at http://{metrics_addr}/metrics:");
    let body = scrape(metrics_addr).await?;
    for line in body
        .lines()
        .filter(|line| line.starts_with("rpc_") || line.starts_with("rdma_"))
    {
        println!("{line}");
    }
    if keep_serving {
        println!("serving {endpoint} and http://{metrics_addr}/metrics until Ctrl-C");
        tokio::signal::ctrl_c().await?;
    }
    server.abort();
    Ok(())
}
