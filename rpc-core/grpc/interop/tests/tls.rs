//! `grpcs://` (gRPC over TLS, ALPN h2) against grpcio's secure channels
//! both ways, with certificates made here by a test CA (rcgen).

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{grpcio_server_with_env, python_ready};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, SanType};
use rpc_core::Channel;
use rpc_core::transport::tls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rpc_core::transport::tls::rustls::{ClientConfig, RootCertStore, ServerConfig};
use rpc_grpc::{GrpcOptions, GrpcTransport};
use rpc_grpc_interop::RdmaInterop;
use rpc_grpc_interop::rdma::Ask;
use rpc_grpc_interop::rdma::interop_client::InteropClient;
use rpc_grpc_interop::rdma::interop_server::InteropServer;

/// A test CA and a leaf for localhost and 127.0.0.1 it signed.
struct Pki {
    ca: rcgen::Certificate,
    leaf: rcgen::Certificate,
    leaf_key: KeyPair,
}

impl Pki {
    fn new(name: &str) -> Pki {
        let ca_key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let ca = params.self_signed(&ca_key).unwrap();
        let leaf_key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        params
            .subject_alt_names
            .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
        let leaf = params.signed_by(&leaf_key, &ca, &ca_key).unwrap();
        Pki { ca, leaf, leaf_key }
    }

    fn server_config(&self) -> ServerConfig {
        ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(
                vec![self.leaf.der().clone()],
                PrivateKeyDer::Pkcs8(self.leaf_key.serialize_der().into()),
            )
            .unwrap()
    }

    fn client_config(&self) -> ClientConfig {
        let mut roots = RootCertStore::empty();
        roots
            .add(CertificateDer::from(self.ca.der().to_vec()))
            .unwrap();
        ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth()
    }

    /// Writes the CA, leaf and key as PEM files into `dir`; returns their paths.
    fn write_pem(&self, dir: &std::path::Path) -> [String; 3] {
        let files = [
            ("ca.pem", self.ca.pem()),
            ("leaf.pem", self.leaf.pem()),
            ("leaf.key", self.leaf_key.serialize_pem()),
        ];
        files.map(|(name, pem)| {
            let path = dir.join(name);
            std::fs::write(&path, pem).unwrap();
            path.to_string_lossy().into_owned()
        })
    }
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("rdma-rpc-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test]
async fn grpcio_secure_channel_against_grpcs_server() {
    if !python_ready() {
        return;
    }
    common::register();
    let pki = Pki::new("grpcs test CA");
    let other = Pki::new("another CA");
    rpc_core::transport::register(
        "grpcs",
        Arc::new(GrpcTransport::with_tls(
            GrpcOptions::default(),
            Some(pki.server_config()),
            None,
        )),
    );
    let listening = rpc_core::Server::builder()
        .add_service(InteropServer::new(RdmaInterop::default()))
        .listen("grpcs://127.0.0.1:0")
        .await
        .unwrap();
    let port = listening.local_endpoint().port().unwrap();
    let server = tokio::spawn(listening.serve());
    let dir = temp_dir("grpcs-server");
    let [ca, _, _] = pki.write_pem(&dir);
    let other_dir = temp_dir("grpcs-other");
    let [other_ca, _, _] = other.write_pem(&other_dir);
    common::run_python_scenarios(
        "tls_client.py",
        vec![port.to_string(), ca, other_ca],
        &["secure_calls", "untrusted_refused"],
        Duration::from_secs(120),
    )
    .await;
    server.abort();
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(other_dir);
}

#[tokio::test]
async fn grpcs_channel_against_grpcio_secure_server() {
    if !python_ready() {
        return;
    }
    common::register();
    let pki = Pki::new("grpcio server CA");
    let dir = temp_dir("grpcio-secure");
    let [_, leaf, key] = pki.write_pem(&dir);
    let Some(server) = grpcio_server_with_env(&[
        ("INTEROP_TLS_CERT", leaf.as_str()),
        ("INTEROP_TLS_KEY", key.as_str()),
    ])
    .await
    else {
        return;
    };
    rpc_core::transport::register(
        "grpcstrusting",
        Arc::new(GrpcTransport::with_tls(
            GrpcOptions::default(),
            None,
            Some(pki.client_config()),
        )),
    );
    let port = server.addr.rsplit(':').next().unwrap().to_owned();
    // A transport with no server configuration cannot listen, and says so.
    let listened = rpc_core::Server::builder()
        .add_service(InteropServer::new(RdmaInterop::default()))
        .listen_with(
            Arc::new(GrpcTransport::with_tls(
                GrpcOptions::default(),
                None,
                Some(pki.client_config()),
            )),
            "grpcs://127.0.0.1:0",
        )
        .await;
    let Err(error) = listened else {
        panic!("no server configuration, yet it listens");
    };
    assert!(
        error.to_string().contains("no TLS server configuration"),
        "{error}"
    );
    // The certificate names localhost and 127.0.0.1: both are checked and pass.
    for host in ["localhost", "127.0.0.1"] {
        let channel = Channel::connect(format!("grpcstrusting://{host}:{port}").as_str())
            .await
            .unwrap();
        let mut client = InteropClient::new(channel);
        let ask = Ask {
            body: Bytes::from_static(b"over tls"),
            ..Ask::default()
        };
        let answer = client.unary(ask).await.unwrap().into_inner();
        assert_eq!(&answer.body[..], b"over tls", "via {host}");
    }

    // A channel that trusts another CA fails the handshake, with the reason.
    let other = Pki::new("another CA");
    rpc_core::transport::register(
        "grpcsother",
        Arc::new(GrpcTransport::with_tls(
            GrpcOptions::default(),
            None,
            Some(other.client_config()),
        )),
    );
    let channel = Channel::builder(format!("grpcsother://localhost:{port}").parse().unwrap())
        .connect_timeout(Duration::from_secs(10))
        .connect_lazy();
    let status = InteropClient::new(channel)
        .unary(Ask::default())
        .await
        .unwrap_err();
    assert_eq!(status.code(), rpc_core::Code::Unavailable, "{status}");
    assert!(
        status.message().contains("TLS handshake") || status.message().contains("certificate"),
        "{status}"
    );
    let _ = std::fs::remove_dir_all(dir);
}
