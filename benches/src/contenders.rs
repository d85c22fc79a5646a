//! The frameworks the comparison runs, each as a server (in its own process)
//! and a client, all serving the same echo service: `proto/echo.proto` for
//! rdma-rpc and tonic, an equivalent serde service for tarpc.

use std::net::SocketAddr;
use std::time::Duration;

use futures_util::StreamExt;
use rdma_rpc_examples::EchoService;
use rdma_rpc_examples::echo as rpc_echo;
use rpc_core::Server;

use crate::streams;

/// tonic's code for `proto/echo.proto` (from build.rs).
pub mod tonic_echo {
    #![allow(missing_docs, unreachable_pub, clippy::all)]
    tonic::include_proto!("echo.v1");
}

/// tarpc's version of the echo service.
pub mod tarpc_echo {
    /// Echo: returns the message and payload it was given.
    #[tarpc::service]
    pub trait Echo {
        /// Returns `(message, payload)` unchanged.
        async fn say(
            message: String,
            payload: serde_bytes::ByteBuf,
        ) -> (String, serde_bytes::ByteBuf);
    }
}

/// The largest message any contender is configured to accept.
pub const MAX_MESSAGE: usize = 300 << 20;

/// Who is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Contender {
    /// rdma-rpc over `rdma://` (soft provider unless `RDMA_PROVIDER` says otherwise), default polling.
    RdmaAdaptive,
    /// rdma-rpc over `rdma://` in busy-poll mode.
    RdmaBusy,
    /// rdma-rpc over `tcp://`.
    RpcTcp,
    /// tonic: gRPC over HTTP/2 on loopback TCP.
    Tonic,
    /// tarpc over TCP with its bincode transport.
    Tarpc,
    /// rdma-rpc's server speaking gRPC on `grpc://`, called by tonic's
    /// client over HTTP/2 (what a standard gRPC client gets).
    RpcGrpc,
    /// tonic's generated client over `rdma://` through
    /// `rpc_grpc::tonic::TonicChannel`, to rdma-rpc's server.
    TonicOverRdma,
}

impl Contender {
    /// Every contender, in table order.
    pub const ALL: [Contender; 7] = [
        Contender::RdmaAdaptive,
        Contender::RdmaBusy,
        Contender::RpcTcp,
        Contender::Tonic,
        Contender::Tarpc,
        Contender::RpcGrpc,
        Contender::TonicOverRdma,
    ];

    /// Column title.
    pub fn label(self) -> &'static str {
        match self {
            Contender::RdmaAdaptive => "rdma-rpc rdma:// (default)",
            Contender::RdmaBusy => "rdma-rpc rdma:// (busy-poll)",
            Contender::RpcTcp => "rdma-rpc tcp://",
            Contender::Tonic => "tonic",
            Contender::Tarpc => "tarpc",
            Contender::RpcGrpc => "rdma-rpc grpc:// (tonic client)",
            Contender::TonicOverRdma => "tonic client over rdma://",
        }
    }

    /// The name used on the command line of a server process.
    pub fn key(self) -> &'static str {
        match self {
            Contender::RdmaAdaptive => "rdma",
            Contender::RdmaBusy => "rdma-busy",
            Contender::RpcTcp => "tcp",
            Contender::Tonic => "tonic",
            Contender::Tarpc => "tarpc",
            Contender::RpcGrpc => "grpc",
            Contender::TonicOverRdma => "tonic-rdma",
        }
    }

    /// The contender named `key`.
    pub fn from_key(key: &str) -> Option<Contender> {
        Contender::ALL.into_iter().find(|c| c.key() == key)
    }

    /// `RDMA_POLL` for both processes of this contender.
    pub fn poll_mode(self) -> &'static str {
        match self {
            Contender::RdmaBusy => "busy",
            _ => "adaptive",
        }
    }
}

/// Lets command lines take a contender by its [`key`](Contender::key)
/// (`rdma`, `rdma-busy`, `tcp`, `tonic`, `tarpc`), with the keys listed in
/// `--help` and a clear error for any other word.
impl clap::ValueEnum for Contender {
    fn value_variants<'a>() -> &'a [Self] {
        &Contender::ALL
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.key()).help(self.label()))
    }
}

static MULTI_THREAD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes [`runtime`] (here and in the server processes started after this)
/// a 2-worker multi-thread runtime, what `#[tokio::main]` gives a user.
pub fn use_multi_thread_runtimes() {
    MULTI_THREAD.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`runtime`] builds multi-thread runtimes (`BENCH_RUNTIME=multi`
/// in a server process).
pub fn multi_thread_runtimes() -> bool {
    MULTI_THREAD.load(std::sync::atomic::Ordering::Relaxed)
        || std::env::var("BENCH_RUNTIME").is_ok_and(|flavor| flavor == "multi")
}

/// The runtime every process of the comparison runs: current-thread, or
/// multi-thread with 2 workers after [`use_multi_thread_runtimes`].
pub fn runtime() -> tokio::runtime::Runtime {
    if multi_thread_runtimes() {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime")
    } else {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }
}

/// Serves `contender` on a free loopback port; prints `LISTENING <addr>` and runs forever,
/// answering requests for its counters on stdin ([`ServerProcess::counters`]).
pub fn serve(contender: Contender) {
    crate::stats::answer_counter_requests();
    rpc_transport_rdma::register().expect("RDMA settings");
    rpc_grpc::register();
    runtime().block_on(async move {
        match contender {
            Contender::RdmaAdaptive
            | Contender::RdmaBusy
            | Contender::RpcTcp
            | Contender::RpcGrpc
            | Contender::TonicOverRdma => {
                let scheme = match contender {
                    Contender::RpcTcp => "tcp",
                    Contender::RpcGrpc => "grpc",
                    _ => "rdma",
                };
                let listening = Server::builder()
                    .max_frame_len(MAX_MESSAGE)
                    .add_service(rpc_echo::echo_server::EchoServer::new(EchoService))
                    .add_service(
                        streams::rpc_bench::stream_bench_server::StreamBenchServer::new(
                            streams::RpcStreamBench,
                        ),
                    )
                    .listen(format!("{scheme}://127.0.0.1:0").as_str())
                    .await
                    .expect("bind");
                announce(listening.local_endpoint().authority());
                listening.serve().await.expect("serve");
            }
            Contender::Tonic => {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("bind");
                announce(&listener.local_addr().expect("addr").to_string());
                let incoming = tokio_stream_of(listener);
                tonic::transport::Server::builder()
                    .add_service(
                        tonic_echo::echo_server::EchoServer::new(TonicEcho)
                            .max_decoding_message_size(MAX_MESSAGE)
                            .max_encoding_message_size(MAX_MESSAGE),
                    )
                    .add_service(
                        streams::tonic_bench::stream_bench_server::StreamBenchServer::new(
                            streams::TonicStreamBench,
                        ),
                    )
                    .serve_with_incoming(incoming)
                    .await
                    .expect("serve");
            }
            Contender::Tarpc => {
                let mut listener = tarpc::serde_transport::tcp::listen(
                    "127.0.0.1:0",
                    tarpc::tokio_serde::formats::Bincode::default,
                )
                .await
                .expect("bind");
                listener.config_mut().max_frame_length(MAX_MESSAGE);
                announce(&listener.local_addr().to_string());
                serve_tarpc(listener.filter_map(|r| async { r.ok() })).await;
            }
        }
    });
}

fn announce(addr: &str) {
    println!("LISTENING {addr}");
}

/// Accepted TCP connections (with TCP_NODELAY) as the stream tonic serves.
fn tokio_stream_of(
    listener: tokio::net::TcpListener,
) -> impl futures_util::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    futures_util::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(stream, _)| {
            let _ = stream.set_nodelay(true);
            stream
        });
        Some((accepted, listener))
    })
}

/// Serves tarpc on every transport `transports` yields.
pub async fn serve_tarpc<T>(transports: impl futures_util::Stream<Item = T>)
where
    T: tarpc::Transport<
            tarpc::Response<tarpc_echo::EchoResponse>,
            tarpc::ClientMessage<tarpc_echo::EchoRequest>,
        > + Send
        + 'static,
{
    use tarpc::server::Channel as _;
    use tarpc_echo::Echo as _;
    transports
        .for_each(|transport| async move {
            let channel = tarpc::server::BaseChannel::with_defaults(transport);
            tokio::spawn(
                channel
                    .execute(TarpcEcho.serve())
                    .for_each(|response| async move {
                        tokio::spawn(response);
                    }),
            );
        })
        .await;
}

/// tonic's echo service.
#[derive(Debug, Clone, Copy)]
pub struct TonicEcho;

#[tonic::async_trait]
impl tonic_echo::echo_server::Echo for TonicEcho {
    async fn say(
        &self,
        request: tonic::Request<tonic_echo::EchoRequest>,
    ) -> Result<tonic::Response<tonic_echo::EchoReply>, tonic::Status> {
        let tonic_echo::EchoRequest { message, payload } = request.into_inner();
        Ok(tonic::Response::new(tonic_echo::EchoReply {
            message,
            payload,
        }))
    }
}

/// tarpc's echo service.
#[derive(Debug, Clone, Copy)]
pub struct TarpcEcho;

impl tarpc_echo::Echo for TarpcEcho {
    async fn say(
        self,
        _: tarpc::context::Context,
        message: String,
        payload: serde_bytes::ByteBuf,
    ) -> (String, serde_bytes::ByteBuf) {
        (message, payload)
    }
}

/// A connected client of any contender.
#[derive(Clone)]
pub enum Client {
    /// rdma-rpc (any transport): the generated client, and its channel for raw calls.
    Rpc(
        rpc_echo::echo_client::EchoClient<rpc_core::Channel>,
        rpc_core::Channel,
    ),
    /// tonic: the generated client, and its channel for the streaming client.
    Tonic(
        tonic_echo::echo_client::EchoClient<tonic::transport::Channel>,
        tonic::transport::Channel,
    ),
    /// tarpc.
    Tarpc(tarpc_echo::EchoClient),
    /// tonic's generated client over an rdma-rpc Channel.
    TonicOverRdma(tonic_echo::echo_client::EchoClient<rpc_grpc::tonic::TonicChannel>),
}

/// A deadline far enough for a 64 MiB echo on a slow machine.
const CALL_DEADLINE: Duration = Duration::from_secs(120);

impl Client {
    /// tonic's client, to any gRPC server at `addr`.
    pub async fn connect_tonic(addr: &str) -> Client {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .expect("endpoint")
            .tcp_nodelay(true)
            .connect()
            .await
            .expect("connect");
        Client::Tonic(
            tonic_echo::echo_client::EchoClient::new(channel.clone())
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
            channel,
        )
    }

    /// rdma-rpc's client over `grpc://`, to any gRPC server at `addr`.
    pub async fn connect_grpc(addr: &str) -> Client {
        Client::rpc(&format!("grpc://{addr}")).await
    }

    /// rdma-rpc's generated client on a channel to `endpoint`.
    async fn rpc(endpoint: &str) -> Client {
        let channel = rpc_core::Channel::builder(endpoint.parse().expect("endpoint"))
            .max_frame_len(MAX_MESSAGE)
            .connect()
            .await
            .expect("connect");
        Client::Rpc(
            rpc_echo::echo_client::EchoClient::new(channel.clone()),
            channel,
        )
    }

    /// Connects to `contender`'s server at `addr`.
    pub async fn connect(contender: Contender, addr: &str) -> Client {
        match contender {
            Contender::RdmaAdaptive | Contender::RdmaBusy | Contender::RpcTcp => {
                let scheme = if contender == Contender::RpcTcp {
                    "tcp"
                } else {
                    "rdma"
                };
                Client::rpc(&format!("{scheme}://{addr}")).await
            }
            Contender::TonicOverRdma => {
                let channel =
                    rpc_core::Channel::builder(format!("rdma://{addr}").parse().expect("endpoint"))
                        .max_frame_len(MAX_MESSAGE)
                        .connect()
                        .await
                        .expect("connect");
                Client::TonicOverRdma(
                    tonic_echo::echo_client::EchoClient::new(rpc_grpc::tonic::TonicChannel::new(
                        channel,
                    ))
                    .max_decoding_message_size(MAX_MESSAGE)
                    .max_encoding_message_size(MAX_MESSAGE),
                )
            }
            Contender::Tonic | Contender::RpcGrpc => Client::connect_tonic(addr).await,
            Contender::Tarpc => {
                let addr: SocketAddr = addr.parse().expect("address");
                let mut connect = tarpc::serde_transport::tcp::connect(
                    addr,
                    tarpc::tokio_serde::formats::Bincode::default,
                );
                connect.config_mut().max_frame_length(MAX_MESSAGE);
                let transport = connect.await.expect("connect");
                Client::tarpc(transport)
            }
        }
    }

    /// A tarpc client over any transport (TCP, or in-memory channels).
    pub fn tarpc<T>(transport: T) -> Client
    where
        T: tarpc::Transport<
                tarpc::ClientMessage<tarpc_echo::EchoRequest>,
                tarpc::Response<tarpc_echo::EchoResponse>,
            > + Send
            + 'static,
    {
        Client::Tarpc(
            tarpc_echo::EchoClient::new(tarpc::client::Config::default(), transport).spawn(),
        )
    }

    /// A streaming client on the same connection (rdma-rpc and tonic;
    /// `None` for tarpc, which has no streaming).
    pub fn streams(&self) -> Option<streams::StreamClient> {
        match self {
            Client::Rpc(_, channel) => Some(streams::StreamClient::Rpc(
                streams::rpc_bench::stream_bench_client::StreamBenchClient::new(channel.clone()),
            )),
            Client::Tonic(_, channel) => Some(streams::StreamClient::Tonic(
                streams::tonic_bench::stream_bench_client::StreamBenchClient::new(channel.clone()),
            )),
            Client::Tarpc(_) | Client::TonicOverRdma(_) => None,
        }
    }

    /// One echo of `payload` built in a [`rpc_core::SendBuffer`], in the
    /// generated client's `bytes` field (rdma-rpc only: `None` for the
    /// others); returns the length that came back. Nothing copies the field
    /// on either side: it is a payload part of its own, which the peer READs
    /// where it lies.
    pub async fn say_send_buffer(&mut self, payload: &bytes::Bytes) -> Option<usize> {
        if !matches!(self, Client::Rpc(..)) {
            return None;
        }
        Some(self.say(payload).await)
    }

    /// One echo of `payload`; returns the length of the payload that came back.
    /// rdma-rpc and tonic take the `Bytes` as it is (their `bytes` fields are
    /// `Bytes`); tarpc's serde message needs its own buffer.
    pub async fn say(&mut self, payload: &bytes::Bytes) -> usize {
        match self {
            Client::Rpc(client, _) => client
                .say(rpc_echo::EchoRequest {
                    message: String::new(),
                    payload: payload.clone(),
                })
                .await
                .expect("rdma-rpc call")
                .into_inner()
                .payload
                .len(),
            Client::Tonic(client, _) => client
                .say(tonic_echo::EchoRequest {
                    message: String::new(),
                    payload: payload.clone(),
                })
                .await
                .expect("tonic call")
                .into_inner()
                .payload
                .len(),
            Client::TonicOverRdma(client) => client
                .say(tonic_echo::EchoRequest {
                    message: String::new(),
                    payload: payload.clone(),
                })
                .await
                .expect("tonic call over rdma://")
                .into_inner()
                .payload
                .len(),
            Client::Tarpc(client) => {
                let mut context = tarpc::context::current();
                context.deadline = std::time::Instant::now() + CALL_DEADLINE;
                client
                    .say(
                        context,
                        String::new(),
                        serde_bytes::ByteBuf::from(payload.to_vec()),
                    )
                    .await
                    .expect("tarpc call")
                    .1
                    .len()
            }
        }
    }
}

/// Runs server and client of `contender` over its framework's in-memory
/// transport on the current runtime and returns the client (rdma-rpc:
/// `mem://`; tonic: HTTP/2 over `tokio::io::duplex`; tarpc: its channel
/// transport). `RdmaBusy` is not an in-memory contender.
pub async fn in_memory(contender: Contender) -> Option<Client> {
    match contender {
        Contender::RdmaAdaptive
        | Contender::RdmaBusy
        | Contender::RpcGrpc
        | Contender::TonicOverRdma => None,
        Contender::RpcTcp => {
            let name = format!("mem://overhead-{}", std::process::id());
            let listening = Server::builder()
                .add_service(rpc_echo::echo_server::EchoServer::new(EchoService))
                .listen(name.as_str())
                .await
                .expect("bind mem://");
            let endpoint = listening.local_endpoint();
            tokio::spawn(listening.serve());
            let channel = rpc_core::Channel::connect(endpoint).await.expect("connect");
            Some(Client::Rpc(
                rpc_echo::echo_client::EchoClient::new(channel.clone()),
                channel,
            ))
        }
        Contender::Tonic => {
            let (client_io, server_io) = tokio::io::duplex(1 << 20);
            tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(tonic_echo::echo_server::EchoServer::new(TonicEcho))
                    .serve_with_incoming(futures_util::stream::iter([Ok::<_, std::io::Error>(
                        server_io,
                    )])),
            );
            let mut client_io = Some(client_io);
            let channel = tonic::transport::Endpoint::from_static("http://in-memory")
                .connect_with_connector(tower::service_fn(move |_| {
                    let io = client_io.take();
                    async move {
                        io.map(hyper_util::rt::TokioIo::new).ok_or_else(|| {
                            std::io::Error::other("the in-memory connection is single-use")
                        })
                    }
                }))
                .await
                .expect("connect in memory");
            Some(Client::Tonic(
                tonic_echo::echo_client::EchoClient::new(channel.clone()),
                channel,
            ))
        }
        Contender::Tarpc => {
            let (client_side, server_side) = tarpc::transport::channel::unbounded();
            tokio::spawn(serve_tarpc(futures_util::stream::iter([server_side])));
            Some(Client::tarpc(client_side))
        }
    }
}

/// A server process of this benchmark binary, killed on drop.
#[derive(Debug)]
pub struct ServerProcess {
    child: std::process::Child,
    /// Where requests for its counters go.
    stdin: std::process::ChildStdin,
    /// Its stdout's lines after `LISTENING`, from a thread that reads them.
    lines: std::sync::mpsc::Receiver<String>,
}

/// How long [`ServerProcess::counters`] waits for an answer.
const COUNTERS_TIMEOUT: Duration = Duration::from_secs(5);

impl ServerProcess {
    /// The server's pid.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The server's counters now, as it reports them on a
    /// [`COUNTERS_REQUEST`](crate::stats::COUNTERS_REQUEST) (servers run by
    /// [`serve`] answer; `None` from one that does not answer within 5 s,
    /// or has ended).
    pub fn counters(&self) -> Option<crate::stats::ProcessCounters> {
        use std::io::Write;
        while self.lines.try_recv().is_ok() {}
        writeln!(&self.stdin, "{}", crate::stats::COUNTERS_REQUEST).ok()?;
        let deadline = std::time::Instant::now() + COUNTERS_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let line = self.lines.recv_timeout(left).ok()?;
            if let Some(counters) = crate::stats::ProcessCounters::from_line(&line) {
                return Some(counters);
            }
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts this binary again with `--serve <arg>` and `RDMA_POLL=<poll>`,
/// and waits for its `LISTENING <address>` line.
pub fn spawn_server(arg: &str, poll: &str) -> (ServerProcess, String) {
    spawn_server_under(&[], arg, poll)
}

/// [`spawn_server`], run by `wrapper` (a program and its arguments, e.g.
/// valgrind's; none: this binary itself).
pub fn spawn_server_under(wrapper: &[&str], arg: &str, poll: &str) -> (ServerProcess, String) {
    use std::io::{BufRead, BufReader};
    let exe = std::env::current_exe().expect("own path");
    let mut command = match wrapper.split_first() {
        Some((program, args)) => {
            let mut command = std::process::Command::new(program);
            command.args(args).arg(exe);
            command
        }
        None => std::process::Command::new(exe),
    };
    let mut child = command
        .args(["--serve", arg])
        .env("RDMA_POLL", poll)
        .env(
            "BENCH_RUNTIME",
            if multi_thread_runtimes() {
                "multi"
            } else {
                "current"
            },
        )
        // Its stdin is ours: when this process ends, so does the server.
        .env(crate::stats::EXIT_WITH_STDIN, "1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("server process");
    let stdout = child.stdout.take().expect("stdout");
    let stdin = child.stdin.take().expect("stdin");
    let (send, lines) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(format!("{arg} stdout"))
        .spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if send.send(line).is_err() {
                    break;
                }
            }
        })
        .expect("stdout thread");
    let server = ServerProcess {
        child,
        stdin,
        lines,
    };
    while let Ok(line) = server.lines.recv() {
        if let Some(addr) = line.strip_prefix("LISTENING ") {
            return (server, addr.to_owned());
        }
    }
    panic!("server process {arg} exited early");
}

/// The generated echo service on `scheme://127.0.0.1:0`, for benchmarks
/// that hold many connections (up to 20,000, idle for up to 10 minutes, all
/// from this host: no per-address share): prints `LISTENING <endpoint>`,
/// then serves until the process ends.
pub async fn serve_many_connections(scheme: &str) {
    use rdma_rpc_examples::EchoService;
    use rdma_rpc_examples::echo::echo_server::EchoServer;
    rpc_transport_rdma::register().expect("rdma");
    let listening = rpc_core::Server::builder()
        .max_connections(20_000)
        .max_connections_per_address(20_000)
        .idle_timeout(std::time::Duration::from_secs(600))
        .add_service(EchoServer::new(EchoService))
        .listen(format!("{scheme}://127.0.0.1:0").as_str())
        .await
        .expect("listen");
    println!("LISTENING {}", listening.local_endpoint());
    listening.serve().await.expect("serve");
}
