//! Shared code of the examples: the generated services and their implementations.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::SystemTime;

use rpc_core::{Request, Response, Status};

/// `proto/echo.proto`.
pub mod echo {
    #![allow(missing_docs)]
    rpc_core::include_proto!("echo.v1");
}

/// `proto/kv.proto`.
pub mod kv {
    #![allow(missing_docs)]
    rpc_core::include_proto!("kv.v1");
}

/// `proto/streams.proto`.
pub mod streams {
    #![allow(missing_docs)]
    rpc_core::include_proto!("streams.v1");
}

/// `proto/cross_host.proto`: the two-host suite's service.
pub mod cross_host {
    #![allow(missing_docs)]
    rpc_core::include_proto!("crosshost.v1");
}

/// The encoded descriptors of the example protos, for server reflection.
pub const DESCRIPTORS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/descriptors.bin"));

/// The echo service: returns what it gets.
#[derive(Debug, Default, Clone, Copy)]
pub struct EchoService;

impl echo::echo_server::Echo for EchoService {
    async fn say(
        &self,
        request: Request<echo::EchoRequest>,
    ) -> Result<Response<echo::EchoReply>, Status> {
        let echo::EchoRequest { message, payload } = request.into_inner();
        Ok(Response::new(echo::EchoReply { message, payload }))
    }
}

/// FNV-1a, 64 bit: the upload example's checksum, continued over `data`
/// from `hash` (start with [`FNV1A_START`]).
pub fn fnv1a(mut hash: u64, data: &[u8]) -> u64 {
    for &byte in data {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// FNV-1a's starting value.
pub const FNV1A_START: u64 = 0xcbf2_9ce4_8422_2325;

/// `streams.v1.Feed`: a tick feed, an upload sink and a chat room.
#[derive(Debug)]
pub struct FeedService {
    room: tokio::sync::broadcast::Sender<streams::ChatMessage>,
}

impl Default for FeedService {
    fn default() -> Self {
        FeedService {
            room: tokio::sync::broadcast::channel(1024).0,
        }
    }
}

/// A boxed stream of responses, as the streaming methods return.
pub type ResponseStream<T> =
    std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<T, Status>> + Send>>;

impl streams::feed_server::Feed for FeedService {
    type WatchStream = ResponseStream<streams::Tick>;

    async fn watch(
        &self,
        request: Request<streams::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let streams::WatchRequest { count, interval_ms } = request.into_inner();
        let interval = std::time::Duration::from_millis(u64::from(interval_ms));
        let ticks = futures_util::stream::unfold(0u64, move |sequence| async move {
            if sequence >= u64::from(count) {
                return None;
            }
            if sequence > 0 {
                tokio::time::sleep(interval).await;
            }
            let tick = streams::Tick {
                sequence,
                at: Some(now()),
            };
            Some((Ok(tick), sequence + 1))
        });
        Ok(Response::new(Box::pin(ticks)))
    }

    async fn upload(
        &self,
        request: Request<rpc_core::Streaming<streams::Chunk>>,
    ) -> Result<Response<streams::UploadSummary>, Status> {
        let mut chunks = request.into_inner();
        let mut summary = streams::UploadSummary {
            fnv1a: FNV1A_START,
            ..Default::default()
        };
        while let Some(chunk) = chunks.message().await? {
            if chunk.offset != summary.bytes {
                return Err(Status::invalid_argument(format!(
                    "chunk at offset {} where {} was due",
                    chunk.offset, summary.bytes
                )));
            }
            summary.fnv1a = fnv1a(summary.fnv1a, &chunk.data);
            summary.bytes += chunk.data.len() as u64;
            summary.chunks += 1;
        }
        Ok(Response::new(summary))
    }

    type ChatStream = ResponseStream<streams::ChatMessage>;

    async fn chat(
        &self,
        request: Request<rpc_core::Streaming<streams::ChatMessage>>,
    ) -> Result<Response<Self::ChatStream>, Status> {
        let mut said = request.into_inner();
        let room = self.room.clone();
        let heard = room.subscribe();
        // What this member says goes to the room until it stops sending (or is gone).
        tokio::spawn(async move {
            while let Ok(Some(message)) = said.message().await {
                let _ = room.send(message);
            }
        });
        let heard = futures_util::stream::unfold(heard, |mut heard| async move {
            let line = match heard.recv().await {
                Ok(message) => message,
                // A member that reads too slowly misses lines, and is told so.
                Err(tokio::sync::broadcast::error::RecvError::Lagged(missed)) => {
                    streams::ChatMessage {
                        from: "room".into(),
                        text: format!("you missed {missed} lines"),
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
            };
            Some((Ok(line), heard))
        });
        Ok(Response::new(Box::pin(heard)))
    }
}

/// A `streams.v1.Feed` server running in this process, for the one-process
/// streaming examples.
#[derive(Debug)]
pub struct FeedServer {
    /// Where it listens (the real port when asked for port 0).
    pub endpoint: rpc_core::transport::Endpoint,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), rpc_core::Error>>,
}

impl FeedServer {
    /// Registers rdma:// and starts serving [`FeedService`] on `listen`.
    pub async fn start(listen: &str) -> Result<FeedServer, Box<dyn std::error::Error>> {
        rpc_transport_rdma::register()?;
        let listening = rpc_core::Server::builder()
            .add_service(streams::feed_server::FeedServer::new(FeedService::default()))
            .listen(listen)
            .await?;
        let endpoint = listening.local_endpoint();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(listening.serve_with_shutdown(async {
            let _ = stopped.await;
        }));
        println!("server listening on {endpoint}");
        Ok(FeedServer {
            endpoint,
            stop,
            task,
        })
    }

    /// Shuts the server down gracefully and waits for it.
    pub async fn shutdown(self) -> Result<(), Box<dyn std::error::Error>> {
        let _ = self.stop.send(());
        self.task.await??;
        println!("server shut down gracefully; done");
        Ok(())
    }
}

/// Logs to stderr at the level in `RUST_LOG` (default `info`).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Longest page a scan returns.
pub const MAX_SCAN_PAGE: u32 = 1000;

/// An in-memory key-value store implementing `kv.v1.KeyValue`.
#[derive(Debug, Default)]
pub struct KvStore {
    entries: Mutex<BTreeMap<String, kv::Entry>>,
}

fn now() -> rpc_core::prost_types::Timestamp {
    let since_epoch = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    rpc_core::prost_types::Timestamp {
        seconds: since_epoch.as_secs() as i64,
        nanos: since_epoch.subsec_nanos() as i32,
    }
}

impl kv::key_value_server::KeyValue for KvStore {
    async fn get(&self, request: Request<kv::GetRequest>) -> Result<Response<kv::Entry>, Status> {
        let key = request.into_inner().key;
        let entries = self.entries.lock().unwrap();
        entries
            .get(&key)
            .cloned()
            .map(Response::new)
            .ok_or_else(|| Status::not_found(format!("no key {key:?}")))
    }

    async fn put(&self, request: Request<kv::PutRequest>) -> Result<Response<kv::Entry>, Status> {
        let kv::PutRequest {
            key,
            value,
            expected_version,
        } = request.into_inner();
        if key.is_empty() {
            return Err(Status::invalid_argument("key must not be empty"));
        }
        let mut entries = self.entries.lock().unwrap();
        let current = entries.get(&key).map_or(0, |entry| entry.version);
        if let Some(expected) = expected_version {
            if expected != current {
                return Err(Status::failed_precondition(format!(
                    "key {key:?} is at version {current}, not {expected}"
                )));
            }
        }
        let entry = kv::Entry {
            key: key.clone(),
            value,
            version: current + 1,
            updated_at: Some(now()),
        };
        entries.insert(key, entry.clone());
        Ok(Response::new(entry))
    }

    async fn delete(&self, request: Request<kv::DeleteRequest>) -> Result<Response<()>, Status> {
        self.entries
            .lock()
            .unwrap()
            .remove(&request.into_inner().key);
        Ok(Response::new(()))
    }

    async fn scan(
        &self,
        request: Request<kv::ScanRequest>,
    ) -> Result<Response<kv::ScanReply>, Status> {
        let kv::ScanRequest {
            start,
            limit,
            include_values,
        } = request.into_inner();
        let limit = if limit == 0 {
            100
        } else {
            limit.min(MAX_SCAN_PAGE)
        } as usize;
        let entries = self.entries.lock().unwrap();
        let mut page = entries.range(start..).map(|(_, entry)| entry.clone());
        let mut reply = kv::ScanReply::default();
        for mut entry in page.by_ref().take(limit) {
            if !include_values {
                entry.value.clear();
            }
            reply.entries.push(entry);
        }
        reply.next_start = page.next().map(|entry| entry.key).unwrap_or_default();
        Ok(Response::new(reply))
    }
}

/// Installs a Prometheus exporter that serves `/metrics` over HTTP on
/// `listen`, and turns on rdma-rpc's metrics (`rpc_core::metrics`). Call it
/// inside a tokio runtime (the exporter's HTTP server runs on it).
pub fn export_prometheus(
    listen: std::net::SocketAddr,
) -> Result<(), metrics_exporter_prometheus::BuildError> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(listen)
        .install()?;
    rpc_core::metrics::enable();
    Ok(())
}

/// The body of `GET /metrics` from a Prometheus exporter at `addr`.
pub async fn scrape(addr: std::net::SocketAddr) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await?;
    match answer.split_once("\r\n\r\n") {
        Some((head, body)) if head.starts_with("HTTP/1.1 200") => Ok(body.to_owned()),
        _ => Err(std::io::Error::other(format!(
            "unexpected answer from the exporter: {:.200}",
            answer
        ))),
    }
}
