//! An echo client in its own process: a few calls, then latency of sequential calls.
//!
//! ```text
//! cargo run --release --example echo_client -- rdma://127.0.0.1:50051 [calls]
//! ```

use std::time::Instant;

use rdma_rpc_examples::echo::{EchoRequest, echo_client::EchoClient};
use rdma_rpc_examples::init_logging;

/// An echo client in its own process: a few calls, then latency of sequential calls.
///
/// Says hello, then makes CALLS sequential calls with 64 B payloads and
/// prints their p50, p99 and maximum latency.
#[derive(Debug, clap::Parser)]
#[command(name = "echo_client")]
struct Cli {
    /// The server to call (rdma:// or tcp://).
    #[arg(value_name = "ENDPOINT", default_value = "rdma://127.0.0.1:50051")]
    endpoint: String,
    /// Sequential calls to measure.
    #[arg(value_name = "CALLS", default_value_t = 1000)]
    calls: u32,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Cli { endpoint, calls } = clap::Parser::parse();
    init_logging();
    // The one line that enables rdma:// (provider from RDMA_PROVIDER, else
    // ibverbs when built in and a device exists, else soft).
    rpc_transport_rdma::register()?;
    let mut client = EchoClient::connect(endpoint.as_str()).await?;
    let reply = client
        .say(EchoRequest {
            message: "hello".into(),
            payload: Default::default(),
        })
        .await?;
    println!(
        "{endpoint}: say(\"hello\") -> {:?}",
        reply.into_inner().message
    );
    let mut latencies = Vec::with_capacity(calls as usize);
    for i in 0..calls {
        let started = Instant::now();
        client
            .say(EchoRequest {
                message: format!("{i}"),
                payload: vec![0; 64].into(),
            })
            .await?;
        latencies.push(started.elapsed());
    }
    latencies.sort();
    if !latencies.is_empty() {
        let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
        println!(
            "{calls} calls with 64 B payloads: p50 {:?}, p99 {:?}, max {:?}",
            at(0.5),
            at(0.99),
            at(1.0)
        );
    }
    Ok(())
}
