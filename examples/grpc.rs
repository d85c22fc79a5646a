//! One service over rdma:// and gRPC at once: standard gRPC clients (here
//! Python's grpcio) call it over HTTP/2 on grpc://, rdma-rpc's clients over
//! RDMA, with health and reflection for gRPC's tooling.
//!
//! ```text
//! cargo run --release --example grpc                # serve, call over both, exit
//! cargo run --release --example grpc -- --serve     # keep serving: try grpcurl or
//!                                                   # python3 examples/python/echo_client.py
//! ```

use std::process::Command;

use rdma_rpc_examples::echo::{EchoRequest, echo_client::EchoClient, echo_server::EchoServer};
use rdma_rpc_examples::{EchoService, init_logging};
use rpc_core::{Channel, Server};

/// Serves echo.v1.Echo on rdma:// and on grpc:// at once (with
/// grpc.health.v1 and grpc.reflection.v1), calls it over both with the
/// Rust client and over gRPC with Python's grpcio (when installed).
#[derive(Debug, clap::Parser)]
#[command(name = "grpc")]
struct Cli {
    /// Where rdma-rpc's own protocol listens.
    #[arg(long, default_value = "rdma://127.0.0.1:0")]
    rdma: String,
    /// Where gRPC over HTTP/2 listens.
    #[arg(long, default_value = "grpc://127.0.0.1:0")]
    grpc: String,
    /// Keep serving after the calls (stop with Ctrl-C).
    #[arg(long)]
    serve: bool,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cli: Cli = clap::Parser::parse();
    init_logging();
    rpc_transport_rdma::register()?;
    rpc_grpc::register();

    // One set of services, two listeners.
    let health = rpc_grpc::health::HealthReporter::new();
    health.set_serving("echo.v1.Echo");
    let reflection = rpc_grpc::reflection::ReflectionService::builder()
        .register_encoded_file_descriptor_set(rdma_rpc_examples::DESCRIPTORS)?
        .with_health()
        .build();
    let router = Server::builder()
        .add_service(EchoServer::new(EchoService))
        .add_service(health.service())
        .add_service(reflection.v1())
        .add_service(reflection.v1alpha());
    let over_rdma = router.clone().listen(cli.rdma.as_str()).await?;
    let over_grpc = router.listen(cli.grpc.as_str()).await?;
    let (rdma, grpc) = (over_rdma.local_endpoint(), over_grpc.local_endpoint());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut servers = Vec::new();
    for listening in [over_rdma, over_grpc] {
        let mut stopped = stopped.clone();
        servers.push(tokio::spawn(listening.serve_with_shutdown(async move {
            let _ = stopped.wait_for(|stop| *stop).await;
        })));
    }
    println!("serving echo.v1.Echo on {rdma} and on {grpc}");

    for endpoint in [&rdma, &grpc] {
        let mut client = EchoClient::new(Channel::connect(endpoint.clone()).await?);
        let reply = client
            .say(EchoRequest {
                message: format!("hello over {}", endpoint.scheme()),
                payload: Default::default(),
            })
            .await?;
        println!("rust client over {endpoint}: {:?}", reply.get_ref().message);
    }

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/echo_client.py");
    match Command::new("python3")
        .arg(script)
        .arg(grpc.authority())
        .output()
    {
        Ok(output) if output.status.success() => {
            print!("{}", String::from_utf8_lossy(&output.stdout));
        }
        Ok(output) => println!(
            "python grpcio client did not run: {}(pip install grpcio grpcio-tools)",
            String::from_utf8_lossy(&output.stderr)
                .lines()
                .last()
                .map(|line| format!("{line}; "))
                .unwrap_or_default()
        ),
        Err(error) => println!("python grpcio client did not run: no python3 ({error})"),
    }

    if cli.serve {
        println!(
            "serving until Ctrl-C; e.g. python3 {script} {}",
            grpc.authority()
        );
        tokio::signal::ctrl_c().await?;
    }
    health.set_not_serving("");
    let _ = stop.send(true);
    for server in servers {
        server.await??;
    }
    println!("servers shut down gracefully; done");
    Ok(())
}
