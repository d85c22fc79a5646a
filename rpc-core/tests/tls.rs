//! `tls://`: calls inside TLS with certificates made here (rcgen): a good
//! one, one from a CA the client does not trust, an expired one, and mutual
//! TLS with and without a client certificate. Each case registers its own
//! scheme, so their settings never mix.

mod certs;
mod suite;

use std::sync::Arc;

use rpc_core::Channel;
use rpc_core::transport::tls::TlsTransport;
use rpc_core::transport::tls::rustls::{ClientConfig, ServerConfig};

use crate::certs::{Ca, client_config, server_config};
use crate::suite::{Bed, assert_echoes, start};

/// A TLS server under `scheme` on 127.0.0.1.
struct TlsBed(&'static str);

impl Bed for TlsBed {
    fn listen_endpoint(&self) -> String {
        format!("{}://127.0.0.1:0", self.0)
    }
}

/// Registers `scheme` with a server and a client configuration.
fn register(scheme: &str, server: ServerConfig, client: ClientConfig) {
    rpc_core::transport::register(
        scheme,
        Arc::new(TlsTransport::new().with_server(server).with_client(client)),
    );
}

/// Registers `scheme` as a client only, and returns the server's endpoint
/// under it.
fn client_scheme(scheme: &str, client: ClientConfig, server: &suite::RunningServer) -> String {
    rpc_core::transport::register(scheme, Arc::new(TlsTransport::new().with_client(client)));
    format!("{scheme}://{}", server.endpoint.authority())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_go_through_tls_with_a_trusted_certificate() {
    let ca = Ca::new("test CA");
    register(
        "tlsgood",
        server_config(&ca, false, None),
        client_config(&ca, None),
    );
    let server = start(&TlsBed("tlsgood")).await;
    let channel = Channel::connect(server.endpoint.clone()).await.unwrap();
    assert_echoes(&channel, "over TLS").await;
    // A 4 MiB payload: the same framing as tcp://, inside TLS.
    let big = vec![3u8; 4 << 20];
    let back = channel
        .unary(suite::probe("Echo", big.clone()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(back.len(), big.len());
    // "localhost" is a name the certificate carries too.
    let by_name = format!(
        "tlsgood://localhost:{}",
        server.endpoint.authority().rsplit_once(':').unwrap().1
    );
    let channel = Channel::connect(by_name.as_str()).await.unwrap();
    assert_echoes(&channel, "by name").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_an_untrusted_ca_is_refused_and_the_server_goes_on() {
    let ca = Ca::new("test CA");
    let other = Ca::new("someone else");
    register(
        "tlswrongsrv",
        server_config(&ca, false, None),
        client_config(&ca, None),
    );
    let server = start(&TlsBed("tlswrongsrv")).await;
    let endpoint = client_scheme("tlswrongcli", client_config(&other, None), &server);
    let error = Channel::connect(endpoint.as_str())
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("TLS handshake"), "{error}");
    assert!(error.contains("UnknownIssuer"), "{error}");
    let good = Channel::connect(server.endpoint.clone()).await.unwrap();
    assert_echoes(&good, "still serving").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_certificate_is_refused() {
    let ca = Ca::new("test CA");
    register(
        "tlsexpired",
        server_config(&ca, true, None),
        client_config(&ca, None),
    );
    let server = start(&TlsBed("tlsexpired")).await;
    let error = Channel::connect(server.endpoint.clone())
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("TLS handshake"), "{error}");
    assert!(error.contains("certificate expired"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_requires_a_client_certificate_from_the_trusted_ca() {
    let ca = Ca::new("server CA");
    let client_ca = Ca::new("client CA");
    register(
        "tlsmutual",
        server_config(&ca, false, Some(&client_ca)),
        client_config(&ca, Some(&client_ca)),
    );
    let server = start(&TlsBed("tlsmutual")).await;
    let channel = Channel::connect(server.endpoint.clone()).await.unwrap();
    assert_echoes(&channel, "mutual").await;

    // No client certificate: the server refuses (TLS 1.3 tells the client
    // only after its side of the handshake, so the failure may come with the
    // first call rather than the connect).
    let anonymous = client_scheme("tlsanonymous", client_config(&ca, None), &server);
    let failed = match Channel::connect(anonymous.as_str()).await {
        Err(error) => error.to_string(),
        Ok(channel) => channel
            .unary(suite::probe("Echo", "x"))
            .await
            .unwrap_err()
            .to_string(),
    };
    assert!(!failed.is_empty());
    // A certificate from a CA the server does not trust: refused too.
    let stranger = Ca::new("stranger CA");
    let endpoint = client_scheme("tlsstranger", client_config(&ca, Some(&stranger)), &server);
    let refused = match Channel::connect(endpoint.as_str()).await {
        Err(_) => true,
        Ok(channel) => channel.unary(suite::probe("Echo", "x")).await.is_err(),
    };
    assert!(refused, "a certificate of an untrusted CA was accepted");
    assert_echoes(&channel, "the trusted client goes on").await;
}
