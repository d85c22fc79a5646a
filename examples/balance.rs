//! Load balancing in one process: starts three Echo servers, spreads calls
//! over them with a `BalancedChannel` (tower's power-of-two-choices on
//! pending calls), prints how many each server took, then stops one and
//! shows the calls going on over the other two once the balancer has
//! ejected it.
//!
//! ```text
//! cargo run --release --example balance                      # rdma://127.0.0.1:0 (soft provider)
//! cargo run --release --example balance -- tcp://127.0.0.1:0 # the same over TCP
//! cargo run --release --example balance -- mem://balance     # in-process: mem://balance-0, -1, -2
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use futures_util::StreamExt;
use rdma_rpc_examples::echo::echo_client::EchoClient;
use rdma_rpc_examples::echo::echo_server::{Echo, EchoServer};
use rdma_rpc_examples::echo::{EchoReply, EchoRequest};
use rdma_rpc_examples::init_logging;
use rpc_core::client::BalancedChannel;
use rpc_core::transport::Endpoint;
use rpc_core::{Error, Request, Response, Server, Status};

/// Load balancing in one process: three Echo servers behind one balanced
/// client; one of them stops half way.
#[derive(Debug, clap::Parser)]
#[command(name = "balance")]
struct Cli {
    /// Where the servers listen (rdma://, tcp:// or mem://). Port 0 (the
    /// default): each server gets a free port of its own; another port P:
    /// P, P+1 and P+2; mem://NAME: NAME-0, NAME-1 and NAME-2.
    #[arg(value_name = "ENDPOINT", default_value = "rdma://127.0.0.1:0")]
    listen: String,
    /// Calls in each round (before and after a server stops).
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u32).range(1..))]
    calls: u32,
    /// Calls in flight at once.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    in_flight: u32,
}

/// Servers the example starts.
const SERVERS: usize = 3;
/// Calls after the stop during which failures are expected: the calls that
/// were sent to the stopped server before the balancer ejected it.
const SETTLING_CALLS: u32 = 50;

/// Echo that counts the calls its server's handler ran.
#[derive(Debug, Clone)]
struct CountingEcho {
    calls: Arc<AtomicUsize>,
}

impl Echo for CountingEcho {
    async fn say(&self, request: Request<EchoRequest>) -> Result<Response<EchoReply>, Status> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let EchoRequest { message, payload } = request.into_inner();
        Ok(Response::new(EchoReply { message, payload }))
    }
}

/// One of the example's servers, running in this process.
struct RunningServer {
    endpoint: Endpoint,
    calls: Arc<AtomicUsize>,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), Error>>,
}

impl RunningServer {
    /// Starts serving a [`CountingEcho`] on `listen`.
    async fn start(listen: Endpoint) -> Result<RunningServer, Error> {
        let calls = Arc::new(AtomicUsize::new(0));
        let listening = Server::builder()
            .add_service(EchoServer::new(CountingEcho {
                calls: calls.clone(),
            }))
            .listen(listen)
            .await?;
        let endpoint = listening.local_endpoint();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(listening.serve_with_shutdown(async {
            let _ = stopped.await;
        }));
        Ok(RunningServer {
            endpoint,
            calls,
            stop,
            task,
        })
    }

    /// Calls its handler ran so far.
    fn calls(&self) -> usize {
        self.calls.load(Ordering::Relaxed)
    }

    /// Shuts it down gracefully and waits until it has.
    async fn shutdown(self) -> Result<(), Box<dyn std::error::Error>> {
        let _ = self.stop.send(());
        self.task.await??;
        Ok(())
    }
}

/// Where server `index` of [`SERVERS`] listens, given the command line's
/// endpoint.
fn server_endpoint(
    listen: &Endpoint,
    index: usize,
) -> Result<Endpoint, Box<dyn std::error::Error>> {
    let authority = match listen.port() {
        _ if listen.scheme() == "mem" => format!("{}-{index}", listen.authority()),
        None | Some(0) => listen.authority().to_owned(),
        Some(port) => {
            let port = usize::from(port) + index;
            let port = u16::try_from(port).map_err(|_| format!("port {port} is out of range"))?;
            format!("{}:{port}", listen.host())
        }
    };
    Ok(Endpoint::new(listen.scheme(), &authority)?)
}

/// The outcome of a round of calls.
#[derive(Debug, Default)]
struct Round {
    succeeded: u32,
    failed: Vec<Status>,
}

/// Makes `calls` calls through `client`, `in_flight` at a time.
async fn round(client: &EchoClient<BalancedChannel>, calls: u32, in_flight: u32) -> Round {
    let outcomes = futures_util::stream::iter(0..calls)
        .map(|i| {
            let mut client = client.clone();
            async move {
                let message = format!("call #{i}");
                let reply = client
                    .say(EchoRequest {
                        message: message.clone(),
                        payload: Default::default(),
                    })
                    .await?;
                if reply.get_ref().message != message {
                    return Err(Status::internal(format!(
                        "sent {message:?}, got {:?} back",
                        reply.get_ref().message
                    )));
                }
                Ok(())
            }
        })
        .buffer_unordered(in_flight as usize)
        .collect::<Vec<Result<(), Status>>>()
        .await;
    let mut round = Round::default();
    for outcome in outcomes {
        match outcome {
            Ok(()) => round.succeeded += 1,
            Err(status) => round.failed.push(status),
        }
    }
    round
}

/// Prints how many calls each server took since `before` (one count per
/// server), marking the stopped one.
fn print_counts(servers: &[Option<RunningServer>], before: &[usize], now: &[usize]) {
    for (index, server) in servers.iter().enumerate() {
        let taken = now[index] - before[index];
        match server {
            Some(server) => println!("  server {index} ({}): {taken} calls", server.endpoint),
            None => println!("  server {index} (stopped): {taken} calls"),
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Cli {
        listen,
        calls,
        in_flight,
    } = clap::Parser::parse();
    init_logging();
    // The one line that enables rdma:// (provider from RDMA_PROVIDER, else
    // ibverbs when built in and a device exists, else soft).
    rpc_transport_rdma::register()?;
    let listen: Endpoint = listen.parse()?;

    let mut servers = Vec::new();
    for index in 0..SERVERS {
        let server = RunningServer::start(server_endpoint(&listen, index)?).await?;
        println!("server {index} listening on {}", server.endpoint);
        servers.push(Some(server));
    }
    let counts = |servers: &[Option<RunningServer>], last: &[usize]| -> Vec<usize> {
        servers
            .iter()
            .zip(last)
            .map(|(server, &last)| server.as_ref().map_or(last, RunningServer::calls))
            .collect()
    };

    // One client over the three: each call goes to the less loaded of two
    // servers picked at random.
    let endpoints: Vec<Endpoint> = servers
        .iter()
        .flatten()
        .map(|server| server.endpoint.clone())
        .collect();
    let client = EchoClient::new(BalancedChannel::from_endpoints(endpoints));

    let started = Instant::now();
    let all = round(&client, calls, in_flight).await;
    let after_all = counts(&servers, &[0; SERVERS]);
    println!(
        "{calls} calls, {in_flight} in flight, over {SERVERS} servers: {} succeeded, {} failed in {:?}",
        all.succeeded,
        all.failed.len(),
        started.elapsed()
    );
    print_counts(&servers, &[0; SERVERS], &after_all);
    let mut problems = Vec::new();
    if let Some(status) = all.failed.first() {
        problems.push(format!(
            "{} calls failed with all servers up, the first: {status}",
            all.failed.len()
        ));
    }
    if let Some(idle) = after_all.iter().position(|&taken| taken == 0) {
        problems.push(format!("server {idle} took no calls"));
    }

    // Stop one server: its calls fail `Unavailable` until the balancer has
    // ejected it, and it is tried again only after a probe reaches it.
    const STOPPED: usize = 1;
    let stopped = servers[STOPPED].take().expect("started");
    let stopped_endpoint = stopped.endpoint.clone();
    stopped.shutdown().await?;
    println!("server {STOPPED} ({stopped_endpoint}) stopped");

    // At most the calls in flight can have gone to the stopped server
    // before its first failure ejected it.
    let settling_calls = SETTLING_CALLS.max(in_flight);
    let settling = round(&client, settling_calls, in_flight).await;
    println!(
        "{settling_calls} calls while the balancer notices: {} succeeded, {} failed",
        settling.succeeded,
        settling.failed.len()
    );
    if let Some(status) = settling.failed.first() {
        println!("  the first failure (expected, the stopped server's): {status}");
    }

    let after_settling = counts(&servers, &after_all);
    let started = Instant::now();
    let remaining = round(&client, calls, in_flight).await;
    let after_remaining = counts(&servers, &after_settling);
    println!(
        "{calls} calls over the {} servers left: {} succeeded, {} failed in {:?}",
        SERVERS - 1,
        remaining.succeeded,
        remaining.failed.len(),
        started.elapsed()
    );
    print_counts(&servers, &after_settling, &after_remaining);
    if let Some(status) = remaining.failed.first() {
        problems.push(format!(
            "{} calls failed after the balancer settled, the first: {status}",
            remaining.failed.len()
        ));
    }
    for (index, server) in servers.iter().enumerate() {
        if server.is_some() && after_remaining[index] == after_settling[index] {
            problems.push(format!(
                "server {index} took no calls after server {STOPPED} stopped"
            ));
        }
    }

    for server in servers.into_iter().flatten() {
        server.shutdown().await?;
    }
    if problems.is_empty() {
        println!("servers shut down gracefully; done");
        Ok(())
    } else {
        Err(problems.join("\n").into())
    }
}
