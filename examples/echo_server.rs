//! An echo server in its own process.
//!
//! ```text
//! cargo run --release --example echo_server -- rdma://127.0.0.1:50051
//! ```
//! Stops gracefully on Ctrl-C.

use rdma_rpc_examples::echo::echo_server::EchoServer;
use rdma_rpc_examples::{EchoService, init_logging};
use rpc_core::Server;

/// An echo server in its own process; stops gracefully on Ctrl-C.
#[derive(Debug, clap::Parser)]
#[command(name = "echo_server")]
struct Cli {
    /// Where to listen (rdma:// or tcp://).
    #[arg(value_name = "ENDPOINT", default_value = "rdma://127.0.0.1:50051")]
    listen: String,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Cli { listen } = clap::Parser::parse();
    init_logging();
    // The one line that enables rdma:// (provider from RDMA_PROVIDER, else
    // ibverbs when built in and a device exists, else soft).
    rpc_transport_rdma::register()?;
    let listening = Server::builder()
        .add_service(EchoServer::new(EchoService))
        .listen(listen.as_str())
        .await?;
    println!("echo server listening on {}", listening.local_endpoint());
    listening
        .serve_with_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    println!("echo server stopped");
    Ok(())
}
