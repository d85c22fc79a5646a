//! Discovery through a real etcd server (issue 33): at `RDMA_RPC_ETCD`
//! (default `127.0.0.1:2379`). Without one the tests print `skipped: …`,
//! unless `RDMA_RPC_REQUIRE_ETCD=1` (CI, which installs and starts etcd),
//! where they fail.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdma_rpc_examples::echo::echo_client::EchoClient;
use rdma_rpc_examples::echo::echo_server::{Echo, EchoServer};
use rdma_rpc_examples::echo::{EchoReply, EchoRequest};
use rpc_core::client::LoadSignal;
use rpc_core::transport::Endpoint;
use rpc_core::{Request, Response, Server, Status};
use rpc_etcd::{Etcd, Registration};

/// An echo service that answers with its instance's name and the scheme
/// the call came over.
#[derive(Clone)]
struct Named(&'static str);

impl Echo for Named {
    async fn say(&self, request: Request<EchoRequest>) -> Result<Response<EchoReply>, Status> {
        let _ = request;
        Ok(Response::new(EchoReply {
            message: self.0.to_owned(),
            payload: Default::default(),
        }))
    }
}

/// etcd, or why not: `RDMA_RPC_ETCD`'s, else one at 127.0.0.1:2379, else
/// one this test binary starts where the `etcd` program is installed (the
/// distribution's `etcd-server`), on ports of its own, stopped when the
/// binary exits.
async fn etcd() -> Result<Etcd, String> {
    let address = match std::env::var("RDMA_RPC_ETCD") {
        Ok(address) => address,
        Err(_) if reachable("127.0.0.1:2379").await => "127.0.0.1:2379".to_owned(),
        Err(_) => own_etcd()?,
    };
    let etcd = Etcd::connect_lazy(&address).map_err(|error| error.to_string())?;
    match tokio::time::timeout(Duration::from_secs(5), etcd.clear("probe")).await {
        Ok(Ok(())) => Ok(etcd),
        Ok(Err(error)) => Err(format!("no etcd at {address}: {error}")),
        Err(_) => Err(format!("no etcd at {address}: no answer in 5 s")),
    }
}

async fn reachable(address: &str) -> bool {
    tokio::net::TcpStream::connect(address).await.is_ok()
}

/// An etcd of this process's own (once), or why there is none.
fn own_etcd() -> Result<String, String> {
    static OWN: std::sync::OnceLock<Result<String, String>> = std::sync::OnceLock::new();
    OWN.get_or_init(|| {
        let free = || -> Result<u16, String> {
            Ok(std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|listener| listener.local_addr())
                .map_err(|error| error.to_string())?
                .port())
        };
        let (client, peer) = (free()?, free()?);
        let data = std::env::temp_dir().join(format!("rpc-etcd-test-{}", std::process::id()));
        // etcd under a watchdog that stops it, and removes its data, once
        // this test process is gone (statics are never dropped).
        let script = format!(
            "etcd --data-dir {data} --listen-client-urls http://127.0.0.1:{client} \
             --advertise-client-urls http://127.0.0.1:{client} \
             --listen-peer-urls http://127.0.0.1:{peer} \
             --initial-advertise-peer-urls http://127.0.0.1:{peer} \
             --initial-cluster default=http://127.0.0.1:{peer} >/dev/null 2>&1 & etcd=$!; \
             while kill -0 {parent} 2>/dev/null && kill -0 $etcd 2>/dev/null; do sleep 0.5; done; \
             kill $etcd 2>/dev/null; wait $etcd; rm -rf {data}",
            data = data.display(),
            parent = std::process::id(),
        );
        if std::process::Command::new("etcd")
            .arg("--version")
            .output()
            .is_err()
        {
            return Err(
                "no etcd at 127.0.0.1:2379 and no `etcd` program to start: install etcd-server"
                    .into(),
            );
        }
        std::process::Command::new("sh")
            .args(["-c", &script])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|error| format!("starting etcd: {error}"))?;
        let address = format!("127.0.0.1:{client}");
        for _ in 0..100 {
            if std::net::TcpStream::connect(&address).is_ok() {
                return Ok(address);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(format!(
            "the etcd started at {address} did not listen within 10 s"
        ))
    })
    .clone()
}
macro_rules! require_etcd {
    () => {
        match etcd().await {
            Ok(etcd) => etcd,
            Err(why) if std::env::var("RDMA_RPC_REQUIRE_ETCD").is_ok_and(|v| v == "1") => {
                panic!("{why} (RDMA_RPC_REQUIRE_ETCD=1)")
            }
            Err(why) => {
                println!("skipped: {why}");
                return;
            }
        }
    };
}

/// One server instance: echo over rdma:// and tcp://, registered in etcd.
struct Instance {
    /// What it registered: its rdma:// endpoint, then its tcp:// one.
    endpoints: Vec<Endpoint>,
    registration: Option<Registration>,
    servers: Vec<tokio::task::JoinHandle<Result<(), rpc_core::Error>>>,
}

impl Instance {
    async fn start(etcd: &Etcd, service: &str, name: &'static str, ttl: Duration) -> Instance {
        let mut endpoints: Vec<Endpoint> = Vec::new();
        let mut servers = Vec::new();
        for listen in ["rdma://127.0.0.1:0", "tcp://127.0.0.1:0"] {
            let listening = Server::builder()
                .add_service(EchoServer::new(Named(name)))
                .listen(listen)
                .await
                .expect("listen");
            endpoints.push(listening.local_endpoint());
            servers.push(tokio::spawn(listening.serve()));
        }
        let registration = etcd
            .register(service, name, &endpoints, ttl)
            .await
            .expect("register");
        Instance {
            endpoints,
            registration: Some(registration),
            servers,
        }
    }

    /// The process dies: no more keep-alives, its servers gone at once.
    fn kill(mut self) {
        drop(self.registration.take());
        for server in &self.servers {
            server.abort();
        }
    }
}

/// `count` calls; how many each instance answered.
async fn spread(
    client: &mut EchoClient<rpc_core::client::BalancedChannel>,
    count: usize,
) -> Result<BTreeMap<String, usize>, Status> {
    let mut answered = BTreeMap::new();
    for _ in 0..count {
        let mut request = Request::new(EchoRequest::default());
        request.set_timeout(Duration::from_secs(5));
        let reply = client.say(request).await?.into_inner();
        *answered.entry(reply.message).or_default() += 1;
    }
    Ok(answered)
}

/// Three instances register; a client watches them into a balanced channel
/// (rdma:// preferred); one is killed (its lease expires), one is added, one
/// deregisters before it stops: calls keep being answered, by the live
/// instances only, over rdma://.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_come_and_go_and_calls_follow_them() {
    let etcd = require_etcd!();
    rpc_transport_rdma::register().expect("rdma://");
    let service = format!("echo-{}", std::process::id());
    etcd.clear(&service).await.expect("clear");
    const TTL: Duration = Duration::from_secs(2);
    let a = Instance::start(&etcd, &service, "a", TTL).await;
    let b = Instance::start(&etcd, &service, "b", TTL).await;
    let c = Instance::start(&etcd, &service, "c", TTL).await;
    let balanced = etcd.balanced(
        &service,
        &["rdma", "tcp"],
        rpc_core::Channel::from_endpoint,
        LoadSignal::default(),
    );
    let mut client = EchoClient::new(balanced);

    // All three answer.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let answered = spread(&mut client, 150).await.expect("calls");
        if answered.len() == 3 {
            println!("three instances: {answered:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not all three answered: {answered:?}"
        );
    }

    // b dies: the balancer ejects it at its first failed call, and its
    // lease expires within TTL, which takes it out of discovery.
    let mut watcher = Box::pin(etcd.discover(&service, &["rdma", "tcp"]));
    let b_endpoint = b.endpoints[0].clone();
    let killed = Instant::now();
    b.kill();
    let expired = tokio::spawn(async move {
        loop {
            match futures_util::StreamExt::next(&mut watcher).await {
                Some(rpc_core::client::Discovered::Remove(endpoint)) if endpoint == b_endpoint => {
                    return killed.elapsed();
                }
                Some(_) => {}
                None => panic!("discovery ended"),
            }
        }
    });
    let mut failed = 0;
    let gone = loop {
        match spread(&mut client, 20).await {
            Ok(answered) if !answered.contains_key("b") => break killed.elapsed(),
            Ok(_) => {}
            // Calls that reached b's dead servers before the lease ran out.
            Err(status) => {
                assert_eq!(status.code(), rpc_core::Code::Unavailable, "{status:?}");
                failed += 1;
            }
        }
        assert!(
            killed.elapsed() < TTL * 4,
            "b still answers or is still tried"
        );
    };
    let after_kill = spread(&mut client, 150)
        .await
        .expect("calls after the kill");
    assert!(!after_kill.contains_key("b"), "{after_kill:?}");
    let out_of_discovery = tokio::time::timeout(TTL * 3, expired)
        .await
        .expect("b's lease expired")
        .expect("no panic");
    println!(
        "b killed: no calls to it after {gone:?} ({failed} failed UNAVAILABLE first), out of discovery \
         after {out_of_discovery:?} (lease {TTL:?}); then {after_kill:?}"
    );

    // d joins: it is called within a second or so.
    let joined = Instant::now();
    let d = Instance::start(&etcd, &service, "d", TTL).await;
    loop {
        let answered = spread(&mut client, 30).await.expect("calls");
        if answered.contains_key("d") {
            break;
        }
        assert!(
            joined.elapsed() < Duration::from_secs(10),
            "d never answered"
        );
    }
    println!("d joined: answering after {:?}", joined.elapsed());

    // a shuts down gracefully: deregistered first, then drained; no call fails.
    let Instance {
        registration,
        servers,
        ..
    } = a;
    registration
        .unwrap()
        .deregister()
        .await
        .expect("deregister");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after_leave = spread(&mut client, 150)
        .await
        .expect("no call fails after a graceful leave");
    assert!(!after_leave.contains_key("a"), "{after_leave:?}");
    for server in servers {
        server.abort();
    }
    let last = spread(&mut client, 150).await.expect("calls");
    assert_eq!(
        last.keys().cloned().collect::<Vec<_>>(),
        vec!["c".to_owned(), "d".to_owned()],
        "{last:?}"
    );
    println!("a left gracefully: {after_leave:?}, then {last:?}");
    drop((c, d));
    etcd.clear(&service).await.expect("clear");
}

/// The client takes rdma:// where an instance registered it, and falls back
/// to what else it registered otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_is_preferred_and_tcp_taken_where_there_is_no_rdma() {
    let etcd = require_etcd!();
    rpc_transport_rdma::register().expect("rdma://");
    let service = format!("prefer-{}", std::process::id());
    etcd.clear(&service).await.expect("clear");
    let both = Instance::start(&etcd, &service, "both", Duration::from_secs(5)).await;
    // An instance with tcp:// only.
    let listening = Server::builder()
        .add_service(EchoServer::new(Named("tcp-only")))
        .listen("tcp://127.0.0.1:0")
        .await
        .expect("listen");
    let tcp_only = listening.local_endpoint();
    let server = tokio::spawn(listening.serve());
    let _registration = etcd
        .register(
            &service,
            "tcp-only",
            std::slice::from_ref(&tcp_only),
            Duration::from_secs(5),
        )
        .await
        .expect("register");
    let mut discovered = Box::pin(etcd.discover(&service, &["rdma", "tcp"]));
    let mut chosen = Vec::new();
    while chosen.len() < 2 {
        let next = tokio::time::timeout(
            Duration::from_secs(5),
            futures_util::StreamExt::next(&mut discovered),
        )
        .await
        .expect("discovery answers")
        .expect("a change");
        match next {
            rpc_core::client::Discovered::Insert(endpoint) => chosen.push(endpoint),
            other => panic!("{other:?}"),
        }
    }
    chosen.sort_by_key(|endpoint| endpoint.to_string());
    let schemes: Vec<&str> = chosen.iter().map(|endpoint| endpoint.scheme()).collect();
    assert_eq!(schemes, vec!["rdma", "tcp"], "{chosen:?}");
    assert_eq!(chosen[1], tcp_only);
    println!("chosen: {chosen:?}");
    drop(both);
    server.abort();
    etcd.clear(&service).await.expect("clear");
}
