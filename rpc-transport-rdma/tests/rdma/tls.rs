//! `rdma+tls://`: the set-up exchange inside TLS (certificates made here).
//! A trusted server and a client with its certificate call each other,
//! eager and rendezvous payloads alike; an untrusted server, a client
//! without a certificate and plain/TLS mix-ups are refused with errors that
//! say why, and the server goes on serving.

use std::sync::Arc;

use rpc_core::Channel;
use rpc_core::transport::tls::TlsTransport;
use rpc_transport_rdma::RdmaTransport;

use crate::certs::{Ca, client_config, client_config_trusting_hex, server_config};
use crate::common::{echo, ensure_registered, strict_config, test_addr};
use crate::suite::{Bed, ChildServer, RunningServer, assert_echoes, pattern, start};

/// A server under `scheme` (registered by the test).
struct SchemeBed(&'static str);

impl Bed for SchemeBed {
    fn listen_endpoint(&self) -> String {
        format!("{}://{}:0", self.0, test_addr())
    }
}

/// Registers an RDMA transport with `tls` around its set-up under `scheme`.
fn register_tls(scheme: &str, tls: TlsTransport) {
    let transport = RdmaTransport::new(strict_config())
        .expect("valid config")
        .with_tls(tls);
    rpc_core::transport::register(scheme, Arc::new(transport));
}

/// `server`'s address under another scheme.
fn under(scheme: &str, server: &RunningServer) -> String {
    format!("{scheme}://{}", server.endpoint.authority())
}

/// The error of a connect and, should the connect succeed (TLS 1.3 tells a
/// client about its refused certificate only after its side finished), of
/// the first call.
async fn failure(endpoint: &str) -> String {
    match Channel::connect(endpoint).await {
        Err(error) => error.to_string(),
        Ok(channel) => channel
            .unary(crate::suite::probe("Echo", "x"))
            .await
            .expect_err("the call should fail")
            .to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_up_inside_mutual_tls_carries_calls_and_refuses_strangers() {
    crate::require_device!();
    let ca = Ca::new("server CA");
    let client_ca = Ca::new("client CA");
    register_tls(
        "rdmatls",
        TlsTransport::new()
            .with_server(server_config(&ca, false, Some(&client_ca)))
            .with_client(client_config(&ca, Some(&client_ca))),
    );
    let server = start(&SchemeBed("rdmatls")).await;
    let channel = Channel::connect(server.endpoint.clone()).await.unwrap();
    assert_echoes(&channel, "over rdma+tls").await;
    // The server names the peer by the scheme the connection came in under
    // (logs, `Request::remote_addr`): this one's set-up went through TLS.
    let response = channel
        .unary(crate::suite::probe(
            "Echo",
            bytes::Bytes::from_static(b"who"),
        ))
        .await
        .unwrap();
    let peer = response.metadata().get("x-peer").unwrap();
    assert!(
        peer.starts_with(&format!("rdmatls://{}:", test_addr())),
        "{peer}"
    );
    // A rendezvous payload: pulled by READ once the set-up is through.
    let big = pattern(3 << 20, 7);
    assert!(echo(&channel, big.clone()).await == big);

    // A client that trusts another CA refuses the server's certificate.
    let stranger_ca = Ca::new("someone else");
    register_tls(
        "rdmatlsstranger",
        TlsTransport::new().with_client(client_config(&stranger_ca, Some(&client_ca))),
    );
    let error = failure(&under("rdmatlsstranger", &server)).await;
    assert!(error.contains("TLS handshake"), "{error}");
    assert!(error.contains("UnknownIssuer"), "{error}");

    // A client without a certificate is refused by the server.
    register_tls(
        "rdmatlsanonymous",
        TlsTransport::new().with_client(client_config(&ca, None)),
    );
    let error = failure(&under("rdmatlsanonymous", &server)).await;
    println!("without a client certificate: {error}");
    assert!(
        error.contains("CertificateRequired") || error.contains("before its hello"),
        "{error}"
    );

    // None of it disturbed the server.
    assert_echoes(&channel, "still connected").await;
    let again = Channel::connect(server.endpoint.clone()).await.unwrap();
    assert_echoes(&again, "a new client").await;
}

const CLIENT_ENV: &str = "RDMA_TEST_CHILD_TLS_CLIENT";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper process for a_tls_client_process_that_exits_ends_its_connection_normally"]
async fn child_tls_client_process() {
    let Some(setting) = std::env::var_os(CLIENT_ENV) else {
        return;
    };
    let setting = setting.into_string().unwrap();
    let (endpoint, ca) = setting.split_once(' ').unwrap();
    register_tls(
        "rdmatlsexit",
        TlsTransport::new().with_client(client_config_trusting_hex(ca)),
    );
    let channel = Channel::connect(endpoint).await.unwrap();
    assert_echoes(&channel, "hi").await;
    println!("LISTENING called");
    // What a program that is done does: exit, with the connection open (no
    // TLS close_notify is sent).
    std::process::exit(0);
}

/// A client process that exits ends its connection as a close does over
/// `rdma+tls://` too: the TLS stream's end without a close_notify reads as
/// the peer's exit, and the server counts no failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_client_process_that_exits_ends_its_connection_normally() {
    crate::require_device!();
    let ca = Ca::new("test CA");
    register_tls(
        "rdmatlsexit",
        TlsTransport::new()
            .with_server(server_config(&ca, false, None))
            .with_client(client_config(&ca, None)),
    );
    let server = start(&SchemeBed("rdmatlsexit")).await;
    let setting = format!("{} {}", server.endpoint, ca.hex());
    for _ in 0..3 {
        let child =
            ChildServer::spawn_with("rdma::tls::child_tls_client_process", CLIENT_ENV, &setting);
        assert_eq!(child.endpoint, "called");
        drop(child);
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while server.stats.connections() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the connections never ended"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(server.stats.failed_connections(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_and_tls_set_ups_name_the_mix_up_both_ways() {
    crate::require_device!();
    ensure_registered();
    let ca = Ca::new("test CA");
    register_tls(
        "rdmatlsmix",
        TlsTransport::new()
            .with_server(server_config(&ca, false, None))
            .with_client(client_config(&ca, None)),
    );
    // A plain rdma:// client at a TLS server.
    let tls_server = start(&SchemeBed("rdmatlsmix")).await;
    let error = failure(&under("rdma", &tls_server)).await;
    assert!(error.contains("expects TLS"), "{error}");
    // A TLS client at a plain rdma:// server.
    let plain_server = start(&SchemeBed("rdma")).await;
    let error = failure(&under("rdmatlsmix", &plain_server)).await;
    assert!(error.contains("did not answer in TLS"), "{error}");
    // Both servers still serve their own kind.
    let channel = Channel::connect(tls_server.endpoint.clone()).await.unwrap();
    assert_echoes(&channel, "tls").await;
    let channel = Channel::connect(plain_server.endpoint.clone())
        .await
        .unwrap();
    assert_echoes(&channel, "plain").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_transport_without_a_server_configuration_refuses_to_listen() {
    crate::require_device!();
    let ca = Ca::new("test CA");
    register_tls(
        "rdmatlsclientonly",
        TlsTransport::new().with_client(client_config(&ca, None)),
    );
    let endpoint = "rdmatlsclientonly://127.0.0.1:0".parse().unwrap();
    let error = rpc_core::transport::bind(&endpoint, &Default::default())
        .await
        .err()
        .expect("no server configuration")
        .to_string();
    assert!(error.contains("with_server"), "{error}");
}

/// Peers that open the TLS set-up port and send garbage, or nothing, hold
/// no runtime thread and no one else up: a real client connects and calls
/// while they are there, and the server goes on after they leave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_and_silence_at_the_tls_set_up_port_hold_nobody_up() {
    use tokio::io::AsyncWriteExt;
    crate::require_device!();
    let ca = Ca::new("test CA");
    register_tls(
        "rdmatlshostile",
        TlsTransport::new()
            .with_server(server_config(&ca, false, None))
            .with_client(client_config(&ca, None)),
    );
    let server = start(&SchemeBed("rdmatlshostile")).await;
    let addr = server.endpoint.authority().to_owned();
    let mut attackers = Vec::new();
    for i in 0..32 {
        let mut socket = tokio::net::TcpStream::connect(&addr).await.unwrap();
        if i % 2 == 0 {
            // A plaintext hello's worth of garbage, then nothing more.
            let _ = socket.write_all(&[0x41; 512]).await;
        }
        attackers.push(socket);
    }
    let started = std::time::Instant::now();
    let channel = Channel::connect(server.endpoint.clone()).await.unwrap();
    assert_echoes(&channel, "past the attackers").await;
    // A set-up that queued behind the attackers would wait for their
    // handshakes to time out (10 s).
    assert!(
        started.elapsed() < std::time::Duration::from_secs(8),
        "the set-up waited for the attackers: {:?}",
        started.elapsed()
    );
    drop(attackers);
    let again = Channel::connect(server.endpoint.clone()).await.unwrap();
    assert_echoes(&again, "after they left").await;
}
