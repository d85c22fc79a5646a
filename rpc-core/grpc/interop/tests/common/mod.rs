//! Servers of `interop.v1.Interop` for the interop tests: rdma-rpc's on
//! `grpc://`, and tonic's on its own HTTP/2 transport.

#![allow(dead_code, unreachable_pub)]

use std::time::{Duration, Instant};

use rpc_grpc_interop::{Counters, RdmaInterop, TonicInterop, rdma, tonic_gen};

/// The largest message each server and client here takes.
pub const LIMIT: usize = 32 << 20;

/// A server running until dropped: in this process, or a Python child.
pub struct TestServer {
    /// Whose server it is: "rdma-rpc", "tonic", "grpcio", or
    /// "tonic-service" (tonic's generated server under rdma-rpc's Server).
    pub name: &'static str,
    /// Where it listens: `grpc://` for HTTP/2 (whoever serves it), else
    /// rdma-rpc's own protocol (`rdma://`).
    pub endpoint: String,
    /// `host:port` of the endpoint.
    pub addr: String,
    /// What its handlers counted (`None` for the Python server, which says
    /// it when asked: see `interop_server.py`).
    pub counters: Option<Counters>,
    /// The health statuses it serves (rdma-rpc's servers).
    pub health: Option<rpc_grpc::health::HealthReporter>,
    /// Its gauges (rdma-rpc's servers).
    pub stats: Option<rpc_core::server::ServerStats>,
    running: Running,
}

enum Running {
    Task(tokio::task::JoinHandle<()>),
    Process(std::process::Child),
}

impl Drop for TestServer {
    fn drop(&mut self) {
        match &mut self.running {
            Running::Task(task) => task.abort(),
            Running::Process(child) => {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// The `PYTHONPATH` under which python3 imports Python's grpcio: `""` where
/// it has it already, else `target/python-grpcio`, which
/// `scripts/python-grpcio` fills from PyPI on first use; `Err(why)` where
/// that cannot be done (no python3, no pip, no network).
fn grpcio_path() -> &'static Result<String, String> {
    static PATH: std::sync::OnceLock<Result<String, String>> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let script =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../scripts/python-grpcio");
        match std::process::Command::new(&script).output() {
            Ok(output) if output.status.success() => {
                Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
            }
            Ok(output) => Err(format!(
                "python3 cannot import grpcio and scripts/python-grpcio could not install it ({})",
                String::from_utf8_lossy(&output.stderr)
                    .lines()
                    .last()
                    .unwrap_or_default()
            )),
            Err(error) => Err(format!("{} did not run ({error})", script.display())),
        }
    })
}

/// Whether Python's grpcio (and grpcio-tools) can run here, installed by
/// `scripts/python-grpcio` where it is missing. Where it cannot be had, a
/// test says why and is skipped, except where `RDMA_RPC_REQUIRE_PYTHON` is
/// set (CI sets it): there it fails.
pub fn python_ready() -> bool {
    let why = match grpcio_path() {
        Ok(_) => return true,
        Err(why) => why,
    };
    assert!(
        std::env::var_os("RDMA_RPC_REQUIRE_PYTHON").is_none(),
        "RDMA_RPC_REQUIRE_PYTHON is set, and {why}"
    );
    println!("skipped: {why}");
    false
}

/// `python3`, with the `PYTHONPATH` under which it imports grpcio.
pub fn python3() -> std::process::Command {
    let mut command = std::process::Command::new("python3");
    if let Ok(path) = grpcio_path() {
        if !path.is_empty() {
            command.env("PYTHONPATH", path);
        }
    }
    command
}

/// Runs `python/{script}` with `args` (within `limit`) and asserts that it
/// passed: exit status 0 and an `ok <scenario>` line for each of
/// `scenarios`. Returns what it printed.
pub async fn run_python_scenarios(
    script: &str,
    args: Vec<String>,
    scenarios: &[&str],
    limit: Duration,
) -> String {
    let path = python_script(script);
    let run = tokio::task::spawn_blocking(move || {
        python3()
            .arg(path)
            .args(args)
            .output()
            .expect("run python3")
    });
    let output = tokio::time::timeout(limit, run)
        .await
        .unwrap_or_else(|_| panic!("{script} ends within {limit:?}"))
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{script} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for scenario in scenarios {
        assert!(
            stdout.lines().any(|line| line == format!("ok {scenario}")),
            "{scenario} did not pass:\n{stdout}"
        );
    }
    stdout
}

/// A Python script of `python/`.
pub fn python_script(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("python")
        .join(name)
}

/// grpcio's server (`python/interop_server.py`) in a child process; `None`
/// (and the reason printed) where Python's grpcio is missing.
pub async fn grpcio_server() -> Option<TestServer> {
    grpcio_server_with_env(&[]).await
}

/// [`grpcio_server`] with `env` set for `interop_server.py`
/// (`INTEROP_COMPRESSION=gzip`: its responses compressed).
pub async fn grpcio_server_with_env(env: &[(&str, &str)]) -> Option<TestServer> {
    if !python_ready() {
        return None;
    }
    let mut child = python3()
        .arg(python_script("interop_server.py"))
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start interop_server.py");
    let stdout = child.stdout.take().expect("piped");
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line).map(|_| line)
    });
    let line = tokio::time::timeout(Duration::from_secs(60), line)
        .await
        .expect("interop_server.py says where it listens within a minute")
        .unwrap()
        .unwrap();
    let port = line
        .trim()
        .strip_prefix("LISTENING ")
        .unwrap_or_else(|| panic!("interop_server.py printed {line:?}"));
    Some(TestServer {
        name: "grpcio",
        endpoint: format!("grpc://127.0.0.1:{port}"),
        addr: format!("127.0.0.1:{port}"),
        counters: None,
        health: None,
        stats: None,
        running: Running::Process(child),
    })
}

/// rdma-rpc's server, serving gRPC on `grpc://127.0.0.1:0`.
pub async fn rdma_server() -> TestServer {
    rdma_server_on("grpc").await
}

/// rdma-rpc's server on `scheme://127.0.0.1:0` (`grpc`, or `rdma` with
/// the soft provider).
pub async fn rdma_server_on(scheme: &str) -> TestServer {
    rdma_server_with_budget(scheme, None).await
}

/// [`rdma_server_on`] with a receive budget of `budget` bytes (at least
/// [`LIMIT`], the frame limit) instead of the default.
pub async fn rdma_server_with_budget(scheme: &str, budget: Option<usize>) -> TestServer {
    register();
    let service = RdmaInterop::default();
    let counters = Some(service.counters.clone());
    let health = rpc_grpc::health::HealthReporter::new();
    health.set_serving("interop.v1.Interop");
    let reflection = rpc_grpc::reflection::ReflectionService::builder()
        .register_encoded_file_descriptor_set(rpc_grpc_interop::DESCRIPTORS)
        .expect("descriptors")
        .with_health()
        .build();
    let mut builder = rpc_core::Server::builder().max_frame_len(LIMIT);
    if let Some(budget) = budget {
        builder = builder.receive_budget(budget);
    }
    let listening = builder
        .add_service(rdma::interop_server::InteropServer::new(service))
        .add_service(health.service())
        .add_service(reflection.v1())
        .add_service(reflection.v1alpha())
        .listen(format!("{scheme}://127.0.0.1:0").as_str())
        .await
        .expect("listen");
    let endpoint = listening.local_endpoint().to_string();
    let addr = listening.local_endpoint().authority().to_owned();
    let stats = Some(listening.stats());
    let task = tokio::spawn(async move {
        let _ = listening.serve().await;
    });
    TestServer {
        name: "rdma-rpc",
        endpoint,
        addr,
        counters,
        health: Some(health),
        stats,
        running: Running::Task(task),
    }
}

/// tonic's server on its own HTTP/2 transport.
pub async fn tonic_server() -> TestServer {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let service = TonicInterop::default();
    let counters = Some(service.counters.clone());
    let incoming = futures_util::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(stream, _)| stream);
        Some((accepted, listener))
    });
    let task = tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(
                tonic_gen::interop_server::InteropServer::new(service)
                    .max_decoding_message_size(LIMIT)
                    .max_encoding_message_size(LIMIT),
            )
            .serve_with_incoming(incoming)
            .await;
    });
    TestServer {
        name: "tonic",
        endpoint: format!("grpc://{addr}"),
        addr,
        counters,
        health: None,
        stats: None,
        running: Running::Task(task),
    }
}

/// tonic's generated server served by rdma-rpc's Server on `rdma://`
/// (soft provider), through `rpc_grpc::tonic::TonicService`.
pub async fn tonic_service_server() -> TestServer {
    register();
    let service = TonicInterop::default();
    let counters = Some(service.counters.clone());
    let tonic_server = tonic_gen::interop_server::InteropServer::new(service)
        .max_decoding_message_size(LIMIT)
        .max_encoding_message_size(LIMIT);
    let listening = rpc_core::Server::builder()
        .max_frame_len(LIMIT)
        .add_service(rpc_grpc::tonic::TonicService::new(tonic_server))
        .listen("rdma://127.0.0.1:0")
        .await
        .expect("listen on rdma://");
    let endpoint = listening.local_endpoint().to_string();
    let addr = listening.local_endpoint().authority().to_owned();
    let task = tokio::spawn(async move {
        let _ = listening.serve().await;
    });
    TestServer {
        name: "tonic-service",
        endpoint,
        addr,
        counters,
        health: None,
        stats: None,
        running: Running::Task(task),
    }
}

/// Registers `grpc://` and `rdma://` (soft provider), and logs to the test
/// output at `RUST_LOG`'s level.
pub fn register() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    rpc_grpc::register();
    rpc_transport_rdma::register().expect("register rdma://");
}

/// The code a server answers for a request over its message limit: the
/// specification's `RESOURCE_EXHAUSTED` (rdma-rpc), where tonic answers
/// `OUT_OF_RANGE`.
pub fn over_limit_code(server: &TestServer) -> i32 {
    // grpcio, like rdma-rpc, answers RESOURCE_EXHAUSTED.
    match server.name {
        "tonic" => 11,
        _ => 8,
    }
}

/// Handlers of `server` that ended before they finished, so far.
pub async fn abandoned(server: &TestServer) -> usize {
    if let Some(counters) = &server.counters {
        return counters.abandoned();
    }
    let mut client =
        tonic_gen::interop_client::InteropClient::connect(format!("http://{}", server.addr))
            .await
            .expect("connect to ask");
    let answer = client
        .unary(tonic_gen::Ask {
            body: bytes::Bytes::from_static(b"__abandoned__"),
            ..Default::default()
        })
        .await
        .expect("the count");
    answer.into_inner().index as usize
}

/// Waits until `server` saw `count` abandoned handlers, or fails after 3 s.
pub async fn wait_for_abandoned(server: &TestServer, count: usize) {
    let started = Instant::now();
    loop {
        let seen = abandoned(server).await;
        if seen >= count {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "the {} server's handler did not end: {seen} of {count} abandoned",
            server.name
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Every status code but OK, by number.
pub const ERROR_CODES: std::ops::RangeInclusive<i32> = 1..=16;

/// A status message that needs percent-encoding on the wire.
pub const ODD_MESSAGE: &str = "100% wrong: «ünïcode», tab\tand newline\n";

/// A raw HTTP/2 connection to `addr` (a hostile peer's), its connection
/// driven in the background.
pub async fn raw_http2_client(addr: &str) -> h2::client::SendRequest<bytes::Bytes> {
    let socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (client, connection) = h2::client::handshake(socket).await.unwrap();
    tokio::spawn(connection);
    client
}

/// The headers of a gRPC call of `interop.v1.Interop/<method>`.
pub fn grpc_request(addr: &str, method: &str) -> http::Request<()> {
    http::Request::post(format!("http://{addr}/interop.v1.Interop/{method}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap()
}

/// Asserts that `server` still answers a new client's call within 5 s.
pub async fn still_answers(server: &TestServer) {
    let channel = rpc_core::Channel::connect(server.endpoint.as_str())
        .await
        .expect("a new client connects");
    let answer = tokio::time::timeout(
        Duration::from_secs(5),
        rdma::interop_client::InteropClient::new(channel).unary(rdma::Ask {
            body: bytes::Bytes::from_static(b"fine"),
            ..rdma::Ask::default()
        }),
    )
    .await
    .expect("answered in time")
    .expect("answered");
    assert_eq!(&answer.into_inner().body[..], b"fine");
}

/// This process's resident memory, in bytes (for the tests that measure
/// what a hostile peer makes the server hold; each alone in its binary).
#[allow(dead_code)]
pub fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|pages| pages.parse().ok())
        .unwrap_or(0);
    pages * 4096
}
