//! Server streaming: a client watches a feed of ticks as the server sends them.
//!
//! ```text
//! cargo run --release --example watch                       # rdma://127.0.0.1:0 (soft provider)
//! cargo run --release --example watch -- tcp://127.0.0.1:0  # the same over TCP
//! ```

use std::time::{Duration, Instant};

use rdma_rpc_examples::streams::{WatchRequest, feed_client::FeedClient};
use rdma_rpc_examples::{FeedServer, init_logging};
use rpc_core::{Code, Request};

/// Server streaming: a client watches a feed of ticks as the server sends them.
///
/// Watches 5 ticks 100 ms apart, printing each as it arrives; then stops
/// watching a second feed early (dropping the stream cancels the server's
/// handler), and shows a deadline ending a third one.
#[derive(Debug, clap::Parser)]
#[command(name = "watch")]
struct Cli {
    /// Where the server listens (rdma://, tcp:// or mem://; port 0: any free port).
    #[arg(value_name = "ENDPOINT", default_value = "rdma://127.0.0.1:0")]
    listen: String,
    /// Ticks to watch.
    #[arg(long, default_value_t = 5)]
    count: u32,
    /// Milliseconds between ticks.
    #[arg(long, default_value_t = 100)]
    interval_ms: u32,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Cli {
        listen,
        count,
        interval_ms,
    } = clap::Parser::parse();
    init_logging();
    let server = FeedServer::start(&listen).await?;
    let mut client = FeedClient::connect(server.endpoint.clone()).await?;

    let started = Instant::now();
    let mut ticks = client
        .watch(WatchRequest { count, interval_ms })
        .await?
        .into_inner();
    while let Some(tick) = ticks.message().await? {
        println!("tick {} after {:?}", tick.sequence, started.elapsed());
    }
    println!("the feed ended after {count} ticks");

    // Stop early: dropping the stream cancels the call on the server.
    let mut ticks = client
        .watch(WatchRequest {
            count: 1_000_000,
            interval_ms: 1,
        })
        .await?
        .into_inner();
    for _ in 0..3 {
        ticks.message().await?;
    }
    drop(ticks);
    println!("stopped watching an endless feed after 3 ticks (the server's handler is cancelled)");

    // A deadline covers the whole stream.
    let mut request = Request::new(WatchRequest {
        count: 1_000_000,
        interval_ms: 10,
    });
    request.set_timeout(Duration::from_millis(250));
    let mut ticks = client.watch(request).await?.into_inner();
    let mut seen = 0;
    let ended = loop {
        match ticks.message().await {
            Ok(Some(_)) => seen += 1,
            Ok(None) => break None,
            Err(status) => break Some(status),
        }
    };
    match ended {
        Some(status) if status.code() == Code::DeadlineExceeded => {
            println!(
                "a 250 ms deadline ended a feed after {seen} ticks -> DeadlineExceeded, as it should"
            )
        }
        other => return Err(format!("expected DeadlineExceeded, got {other:?}").into()),
    }
    server.shutdown().await
}
