//! The streaming workloads of the comparison: 64 B messages on one server
//! stream and on one bidirectional stream, and an upload in 1 MiB messages,
//! served alike by rdma-rpc (any transport) and tonic from
//! `benches/proto/stream_bench.proto`. tarpc has no streaming.

use std::pin::Pin;
use std::time::Instant;

use bytes::Bytes;
use futures_util::Stream;
use serde::Serialize;

/// rdma-rpc's code for `stream_bench.proto`.
pub mod rpc_bench {
    #![allow(missing_docs, unreachable_pub, clippy::all)]
    include!(concat!(env!("OUT_DIR"), "/rdma-rpc/bench.v1.rs"));
}

/// tonic's code for `stream_bench.proto`.
pub mod tonic_bench {
    #![allow(missing_docs, unreachable_pub, clippy::all)]
    include!(concat!(env!("OUT_DIR"), "/tonic/bench.v1.rs"));
}

/// Bytes of a message of the message-rate workloads.
pub const MESSAGE_BYTES: usize = 64;
/// Bytes of a message of the upload.
pub const UPLOAD_MESSAGE_BYTES: usize = 1 << 20;

type RpcStream<T> = Pin<Box<dyn Stream<Item = Result<T, rpc_core::Status>> + Send>>;
type TonicStream<T> = Pin<Box<dyn Stream<Item = Result<T, tonic::Status>> + Send>>;

/// `count` messages of `size` bytes, all slices of one buffer.
fn blobs(count: u64, size: usize) -> impl Iterator<Item = Bytes> + Send + 'static {
    let data = Bytes::from(vec![0x5au8; size]);
    (0..count).map(move |_| data.clone())
}

/// rdma-rpc's implementation.
#[derive(Debug, Clone, Copy)]
pub struct RpcStreamBench;

impl rpc_bench::stream_bench_server::StreamBench for RpcStreamBench {
    type FloodStream = RpcStream<rpc_bench::Blob>;

    async fn flood(
        &self,
        request: rpc_core::Request<rpc_bench::FloodRequest>,
    ) -> Result<rpc_core::Response<Self::FloodStream>, rpc_core::Status> {
        let rpc_bench::FloodRequest { count, size } = request.into_inner();
        let messages = blobs(count, size as usize).map(|data| Ok(rpc_bench::Blob { data }));
        Ok(rpc_core::Response::new(Box::pin(
            futures_util::stream::iter(messages),
        )))
    }

    type PipeStream = RpcStream<rpc_bench::Blob>;

    async fn pipe(
        &self,
        request: rpc_core::Request<rpc_core::Streaming<rpc_bench::Blob>>,
    ) -> Result<rpc_core::Response<Self::PipeStream>, rpc_core::Status> {
        Ok(rpc_core::Response::new(Box::pin(request.into_inner())))
    }

    async fn upload(
        &self,
        request: rpc_core::Request<rpc_core::Streaming<rpc_bench::Blob>>,
    ) -> Result<rpc_core::Response<rpc_bench::Total>, rpc_core::Status> {
        let mut blobs = request.into_inner();
        let mut total = rpc_bench::Total::default();
        while let Some(blob) = blobs.message().await? {
            total.messages += 1;
            total.bytes += blob.data.len() as u64;
        }
        Ok(rpc_core::Response::new(total))
    }
}

/// tonic's implementation.
#[derive(Debug, Clone, Copy)]
pub struct TonicStreamBench;

#[tonic::async_trait]
impl tonic_bench::stream_bench_server::StreamBench for TonicStreamBench {
    type FloodStream = TonicStream<tonic_bench::Blob>;

    async fn flood(
        &self,
        request: tonic::Request<tonic_bench::FloodRequest>,
    ) -> Result<tonic::Response<Self::FloodStream>, tonic::Status> {
        let tonic_bench::FloodRequest { count, size } = request.into_inner();
        let messages = blobs(count, size as usize).map(|data| Ok(tonic_bench::Blob { data }));
        Ok(tonic::Response::new(Box::pin(futures_util::stream::iter(
            messages,
        ))))
    }

    type PipeStream = TonicStream<tonic_bench::Blob>;

    async fn pipe(
        &self,
        request: tonic::Request<tonic::Streaming<tonic_bench::Blob>>,
    ) -> Result<tonic::Response<Self::PipeStream>, tonic::Status> {
        Ok(tonic::Response::new(Box::pin(request.into_inner())))
    }

    async fn upload(
        &self,
        request: tonic::Request<tonic::Streaming<tonic_bench::Blob>>,
    ) -> Result<tonic::Response<tonic_bench::Total>, tonic::Status> {
        let mut blobs = request.into_inner();
        let mut total = tonic_bench::Total::default();
        while let Some(blob) = blobs.message().await? {
            total.messages += 1;
            total.bytes += blob.data.len() as u64;
        }
        Ok(tonic::Response::new(total))
    }
}

/// A streaming client of rdma-rpc or tonic.
#[derive(Debug, Clone)]
pub enum StreamClient {
    /// rdma-rpc, over the channel of the echo client.
    Rpc(rpc_bench::stream_bench_client::StreamBenchClient<rpc_core::Channel>),
    /// tonic, over the channel of the echo client.
    Tonic(tonic_bench::stream_bench_client::StreamBenchClient<tonic::transport::Channel>),
}

impl StreamClient {
    /// Asks for `count` messages of [`MESSAGE_BYTES`] on one server stream;
    /// returns how many came.
    pub async fn flood(&mut self, count: u64) -> u64 {
        let size = MESSAGE_BYTES as u32;
        let mut received = 0;
        match self {
            StreamClient::Rpc(client) => {
                let request = rpc_bench::FloodRequest { count, size };
                let mut messages = client.flood(request).await.expect("flood").into_inner();
                while messages.message().await.expect("flood message").is_some() {
                    received += 1;
                }
            }
            StreamClient::Tonic(client) => {
                let request = tonic_bench::FloodRequest { count, size };
                let mut messages = client.flood(request).await.expect("flood").into_inner();
                while messages.message().await.expect("flood message").is_some() {
                    received += 1;
                }
            }
        }
        received
    }

    /// Sends `count` messages of [`MESSAGE_BYTES`] on one bidirectional
    /// stream, as fast as the stream takes them, and reads their echoes;
    /// returns how many came back.
    pub async fn pipe(&mut self, count: u64) -> u64 {
        let mut received = 0;
        match self {
            StreamClient::Rpc(client) => {
                let outgoing = futures_util::stream::iter(
                    blobs(count, MESSAGE_BYTES).map(|data| rpc_bench::Blob { data }),
                );
                let mut echoes = client.pipe(outgoing).await.expect("pipe").into_inner();
                while echoes.message().await.expect("pipe message").is_some() {
                    received += 1;
                }
            }
            StreamClient::Tonic(client) => {
                let outgoing = futures_util::stream::iter(
                    blobs(count, MESSAGE_BYTES).map(|data| tonic_bench::Blob { data }),
                );
                let mut echoes = client.pipe(outgoing).await.expect("pipe").into_inner();
                while echoes.message().await.expect("pipe message").is_some() {
                    received += 1;
                }
            }
        }
        received
    }

    /// Uploads `bytes` (rounded up to whole messages) in messages of
    /// [`UPLOAD_MESSAGE_BYTES`]; returns the bytes the server counted.
    pub async fn upload(&mut self, bytes: u64) -> u64 {
        let count = bytes.div_ceil(UPLOAD_MESSAGE_BYTES as u64);
        match self {
            StreamClient::Rpc(client) => {
                let outgoing = futures_util::stream::iter(
                    blobs(count, UPLOAD_MESSAGE_BYTES).map(|data| rpc_bench::Blob { data }),
                );
                client
                    .upload(outgoing)
                    .await
                    .expect("upload")
                    .into_inner()
                    .bytes
            }
            StreamClient::Tonic(client) => {
                let outgoing = futures_util::stream::iter(
                    blobs(count, UPLOAD_MESSAGE_BYTES).map(|data| tonic_bench::Blob { data }),
                );
                client
                    .upload(outgoing)
                    .await
                    .expect("upload")
                    .into_inner()
                    .bytes
            }
        }
    }
}

/// What one contender's streams did.
#[derive(Debug, Clone, Serialize)]
pub struct StreamResults {
    /// 64 B messages per second on one server stream.
    pub server_stream_per_s: f64,
    /// 64 B messages per second echoed on one bidirectional stream.
    pub bidi_per_s: f64,
    /// Goodput of the upload, GB/s.
    pub upload_gbps: f64,
}

/// Runs the three workloads: `messages` messages on each stream, and an
/// upload of `upload_bytes`.
pub async fn measure(client: &mut StreamClient, messages: u64, upload_bytes: u64) -> StreamResults {
    // Warm-up: connections, pools, code.
    client.flood(1_000).await;
    client.pipe(1_000).await;
    client.upload(8 * UPLOAD_MESSAGE_BYTES as u64).await;

    eprintln!("  server stream: {messages} messages of {MESSAGE_BYTES} B");
    let started = Instant::now();
    assert_eq!(
        client.flood(messages).await,
        messages,
        "every message arrives"
    );
    let server_stream_per_s = messages as f64 / started.elapsed().as_secs_f64();

    eprintln!("  bidirectional stream: {messages} messages of {MESSAGE_BYTES} B echoed");
    let started = Instant::now();
    assert_eq!(client.pipe(messages).await, messages, "every echo arrives");
    let bidi_per_s = messages as f64 / started.elapsed().as_secs_f64();

    eprintln!(
        "  upload of {} MiB in {} KiB messages",
        upload_bytes >> 20,
        UPLOAD_MESSAGE_BYTES >> 10
    );
    let started = Instant::now();
    let counted = client.upload(upload_bytes).await;
    assert_eq!(counted, upload_bytes, "the server counted every byte");
    let upload_gbps = counted as f64 / started.elapsed().as_secs_f64() / 1e9;
    StreamResults {
        server_stream_per_s,
        bidi_per_s,
        upload_gbps,
    }
}
