//! Bidirectional streaming: two members of a chat room talk at once.
//!
//! ```text
//! cargo run --release --example chat                       # rdma://127.0.0.1:0 (soft provider)
//! cargo run --release --example chat -- tcp://127.0.0.1:0  # the same over TCP
//! ```

use rdma_rpc_examples::streams::{ChatMessage, feed_client::FeedClient};
use rdma_rpc_examples::{FeedServer, init_logging};

/// Bidirectional streaming: two members of a chat room talk at once.
///
/// Ada and Bob each open a chat stream on one connection, say a few lines,
/// and each reads every line said in the room, their own included, while
/// their own stream is still open.
#[derive(Debug, clap::Parser)]
#[command(name = "chat")]
struct Cli {
    /// Where the server listens (rdma://, tcp:// or mem://; port 0: any free port).
    #[arg(value_name = "ENDPOINT", default_value = "rdma://127.0.0.1:0")]
    listen: String,
}

const LINES: [(&str, &str); 4] = [
    ("ada", "hello, is anyone here?"),
    ("bob", "hi ada, bob here"),
    ("ada", "streams work over any endpoint"),
    ("bob", "both ways at once"),
];

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Cli { listen } = clap::Parser::parse();
    init_logging();
    let server = FeedServer::start(&listen).await?;
    let channel = rpc_core::Channel::connect(server.endpoint.clone()).await?;

    // Each member's lines come from a queue it writes to while it reads.
    let mut members = Vec::new();
    for name in ["ada", "bob"] {
        let (say, mut said) = tokio::sync::mpsc::unbounded_channel::<ChatMessage>();
        let outgoing = futures_util::stream::poll_fn(move |cx| said.poll_recv(cx));
        let heard = FeedClient::new(channel.clone())
            .chat(outgoing)
            .await?
            .into_inner();
        members.push((name, say, heard));
    }
    for (from, text) in LINES {
        let (_, say, _) = members
            .iter()
            .find(|(name, _, _)| *name == from)
            .expect("a member");
        say.send(ChatMessage {
            from: from.into(),
            text: text.into(),
        })?;
    }
    for (name, say, mut heard) in members {
        for _ in 0..LINES.len() {
            let line = heard.message().await?.ok_or("the room closed early")?;
            println!("{name} hears {}: {}", line.from, line.text);
        }
        // Done: stop sending (half-close) and leave (dropping cancels the call).
        drop(say);
    }
    server.shutdown().await
}
