//! The main job in one process: starts an echo server, calls it, prints what happened.
//!
//! ```text
//! cargo run --release --example echo                      # rdma://127.0.0.1:0 (soft provider)
//! cargo run --release --example echo -- tcp://127.0.0.1:0 # the same over TCP
//! cargo run --release --example echo -- mem://echo        # in-process transport
//! ```

use std::time::{Duration, Instant};

use rdma_rpc_examples::echo::{EchoRequest, echo_client::EchoClient, echo_server::EchoServer};
use rdma_rpc_examples::{EchoService, init_logging};
use rpc_core::{Code, Request, Server};

/// The main job in one process: starts an echo server, calls it, prints what happened.
///
/// Calls with a message, with metadata, with a 4 MiB payload, 2,000
/// sequential calls for latency, one with a deadline that expires; then
/// shuts the server down gracefully.
#[derive(Debug, clap::Parser)]
#[command(name = "echo")]
struct Cli {
    /// Where the server listens (rdma://, tcp:// or mem://; port 0: any
    /// free port); the client connects to the address it got.
    #[arg(value_name = "ENDPOINT", default_value = "rdma://127.0.0.1:0")]
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
    let endpoint = listening.local_endpoint();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(listening.serve_with_shutdown(async {
        let _ = stopped.await;
    }));
    println!("server listening on {endpoint}");

    let mut client = EchoClient::connect(endpoint.clone()).await?;
    println!("client connected to {endpoint}");

    let started = Instant::now();
    let reply = client
        .say(EchoRequest {
            message: "hello, rdma-rpc".into(),
            payload: Default::default(),
        })
        .await?;
    println!(
        "say(\"hello, rdma-rpc\") -> {:?} in {:?}",
        reply.get_ref().message,
        started.elapsed()
    );

    let mut request = Request::new(EchoRequest {
        message: "with metadata".into(),
        payload: Default::default(),
    });
    request.metadata_mut().insert("x-request-id", "42")?;
    let reply = client.say(request).await?;
    println!(
        "say with metadata x-request-id=42 -> {:?}",
        reply.get_ref().message
    );

    let payload: rpc_core::bytes::Bytes = (0..(4 << 20)).map(|i: u32| (i % 251) as u8).collect();
    let started = Instant::now();
    let reply = client
        .say(EchoRequest {
            message: "4 MiB".into(),
            payload: payload.clone(),
        })
        .await?;
    let elapsed = started.elapsed();
    assert_eq!(
        reply.get_ref().payload,
        payload,
        "payload came back different"
    );
    println!(
        "say with a 4 MiB payload -> identical bytes back in {elapsed:?} ({:.2} GB/s both ways)",
        2.0 * payload.len() as f64 / elapsed.as_secs_f64() / 1e9
    );

    let rounds = 2000;
    let started = Instant::now();
    for i in 0..rounds {
        client
            .say(EchoRequest {
                message: format!("#{i}"),
                payload: Default::default(),
            })
            .await?;
    }
    println!(
        "{rounds} sequential calls: {:?} per call",
        started.elapsed() / rounds
    );

    let mut request = Request::new(EchoRequest {
        message: "too late".into(),
        payload: Default::default(),
    });
    request.set_timeout(Duration::from_nanos(1));
    match client.say(request).await {
        Err(status) if status.code() == Code::DeadlineExceeded => {
            println!("a call with a 1 ns timeout -> DeadlineExceeded, as it should")
        }
        other => return Err(format!("expected DeadlineExceeded, got {other:?}").into()),
    }

    let _ = stop.send(());
    server.await??;
    println!("server shut down gracefully; done");
    Ok(())
}
