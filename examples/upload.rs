//! Client streaming: a file goes to the server in chunks; one summary comes back.
//!
//! ```text
//! cargo run --release --example upload                             # this example's own binary, over rdma://
//! cargo run --release --example upload -- tcp://127.0.0.1:0 --file Cargo.lock
//! ```

use std::time::Instant;

use rdma_rpc_examples::streams::{Chunk, feed_client::FeedClient};
use rdma_rpc_examples::{FNV1A_START, FeedServer, fnv1a, init_logging};
use rpc_core::bytes::Bytes;

/// Client streaming: a file goes to the server in chunks; one summary comes back.
///
/// Reads the file, sends it as a stream of chunks (each one message, sent as
/// the server's window allows), and checks the server's size and checksum
/// against its own.
#[derive(Debug, clap::Parser)]
#[command(name = "upload")]
struct Cli {
    /// Where the server listens (rdma://, tcp:// or mem://; port 0: any free port).
    #[arg(value_name = "ENDPOINT", default_value = "rdma://127.0.0.1:0")]
    listen: String,
    /// The file to upload (default: this example's own binary).
    #[arg(long)]
    file: Option<std::path::PathBuf>,
    /// Bytes per chunk.
    #[arg(long, default_value_t = 1 << 20)]
    chunk_bytes: usize,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Cli {
        listen,
        file,
        chunk_bytes,
    } = clap::Parser::parse();
    init_logging();
    if chunk_bytes == 0 {
        return Err("--chunk-bytes must be at least 1".into());
    }
    let path = match file {
        Some(path) => path,
        None => std::env::current_exe()?,
    };
    let contents = Bytes::from(std::fs::read(&path)?);
    let server = FeedServer::start(&listen).await?;
    let mut client = FeedClient::connect(server.endpoint.clone()).await?;

    // Chunks are slices of the one buffer: nothing is copied to send them.
    let chunks: Vec<Chunk> = (0..contents.len())
        .step_by(chunk_bytes)
        .map(|offset| Chunk {
            offset: offset as u64,
            data: contents.slice(offset..(offset + chunk_bytes).min(contents.len())),
        })
        .collect();
    let sent = chunks.len();
    let started = Instant::now();
    let summary = client
        .upload(futures_util::stream::iter(chunks))
        .await?
        .into_inner();
    let elapsed = started.elapsed();
    println!(
        "uploaded {} ({} bytes) in {sent} chunks in {elapsed:?} ({:.2} GB/s)",
        path.display(),
        contents.len(),
        contents.len() as f64 / elapsed.as_secs_f64() / 1e9
    );
    let checksum = fnv1a(FNV1A_START, &contents);
    if summary.bytes != contents.len() as u64
        || summary.chunks != sent as u64
        || summary.fnv1a != checksum
    {
        return Err(format!(
            "the server got {} bytes in {} chunks, checksum {:#018x}; sent {} bytes in {sent}, checksum {checksum:#018x}",
            summary.bytes, summary.chunks, summary.fnv1a, contents.len()
        )
        .into());
    }
    println!("the server got every byte: size and checksum {checksum:#018x} match");
    server.shutdown().await
}
