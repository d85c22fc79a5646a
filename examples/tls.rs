//! TLS on rdma-rpc's own transports, in one process: makes a throwaway
//! certificate authority and a server certificate (rcgen, nothing read from
//! files), serves Echo over `tls://` (tcp:// framing inside TLS) and
//! `rdma+tls://` (rdma:// whose set-up exchange runs inside TLS, so the
//! server's certificate is checked before any queue pair connects), calls it
//! with a client that trusts the authority, and shows that a client trusting
//! another authority is refused.
//!
//! TLS is off by default in rdma-rpc's crates; this example turns it on
//! with the examples' `tls` feature:
//!
//! ```text
//! cargo run --release --example tls --features tls                         # tls:// and rdma+tls://
//! cargo run --release --example tls --features tls -- tls://127.0.0.1:0   # only tls://
//! ```

use std::sync::Arc;
use std::time::Instant;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, SanType};
use rdma_rpc_examples::echo::{EchoRequest, echo_client::EchoClient, echo_server::EchoServer};
use rdma_rpc_examples::{EchoService, init_logging};
use rpc_core::transport::tls::TlsTransport;
use rpc_core::transport::tls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rpc_core::transport::tls::rustls::{ClientConfig, RootCertStore, ServerConfig};
use rpc_core::transport::{Endpoint, Transport};
use rpc_core::{Channel, Server};
use rpc_transport_rdma::{RdmaConfig, RdmaTransport};

/// TLS on rdma-rpc's own transports: a throwaway certificate authority, an
/// Echo server per endpoint, a client that trusts the authority and one
/// that does not (and is refused).
#[derive(Debug, clap::Parser)]
#[command(name = "tls")]
struct Cli {
    /// Where the servers listen: `tls://host:port` and/or
    /// `rdma+tls://host:port` (port 0: any free port). The server
    /// certificate names localhost and 127.0.0.1, so the host must be one
    /// of them.
    #[arg(
        value_name = "ENDPOINT",
        default_values = ["tls://127.0.0.1:0", "rdma+tls://127.0.0.1:0"]
    )]
    listen: Vec<String>,
}

type BoxError = Box<dyn std::error::Error>;

/// A certificate authority made at start-up, and the key it signs with.
struct CertificateAuthority {
    certificate: rcgen::Certificate,
    key: KeyPair,
}

impl CertificateAuthority {
    /// A new self-signed authority called `name`.
    fn new(name: &str) -> Result<CertificateAuthority, rcgen::Error> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        Ok(CertificateAuthority {
            certificate: params.self_signed(&key)?,
            key,
        })
    }

    /// A server certificate for localhost and 127.0.0.1 that this authority
    /// signs, with its private key.
    fn server_certificate(
        &self,
    ) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), rcgen::Error> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec!["localhost".to_owned()])?;
        params
            .subject_alt_names
            .push(SanType::IpAddress([127, 0, 0, 1].into()));
        let certificate = params.signed_by(&key, &self.certificate, &self.key)?;
        Ok((
            vec![certificate.der().clone()],
            PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        ))
    }

    /// A client configuration that trusts this authority and nothing else.
    fn trusting_client(&self) -> Result<ClientConfig, BoxError> {
        let mut roots = RootCertStore::empty();
        roots.add(self.certificate.der().clone())?;
        Ok(ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth())
    }
}

/// The transport for `scheme` (`tls` or `rdma+tls`) with `tls` around its
/// connections (tls://) or its set-up exchange (rdma+tls://).
fn transport_for(scheme: &str, tls: TlsTransport) -> Result<Arc<dyn Transport>, BoxError> {
    match scheme {
        "tls" => Ok(Arc::new(tls)),
        // The provider from RDMA_PROVIDER, else ibverbs when built in and a
        // device exists, else soft.
        "rdma+tls" => Ok(Arc::new(
            RdmaTransport::new(RdmaConfig::from_env()?)?.with_tls(tls),
        )),
        other => Err(format!(
            "{other}:// is not a TLS scheme this example serves: use tls:// or rdma+tls://"
        )
        .into()),
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let Cli { listen } = clap::Parser::parse();
    init_logging();

    let started = Instant::now();
    let authority = CertificateAuthority::new("rdma-rpc example CA")?;
    let (chain, key) = authority.server_certificate()?;
    let server_config = ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    // A client that trusts only a different authority: it must refuse the
    // server's certificate.
    let stranger = CertificateAuthority::new("some other CA")?;
    println!(
        "made a certificate authority and a server certificate for localhost and 127.0.0.1 in {:?}",
        started.elapsed()
    );

    let mut failures = Vec::new();
    for listen in &listen {
        let endpoint: Endpoint = listen.parse()?;
        let scheme = endpoint.scheme().to_owned();
        // The server side and the trusting client side, registered under
        // the scheme so that `listen` and `EchoClient::connect` take it.
        let trusted = TlsTransport::new()
            .with_server(server_config.clone())
            .with_client(authority.trusting_client()?);
        rpc_core::transport::register(&scheme, transport_for(&scheme, trusted)?);

        let listening = Server::builder()
            .add_service(EchoServer::new(EchoService))
            .listen(endpoint)
            .await?;
        let endpoint = listening.local_endpoint();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(listening.serve_with_shutdown(async {
            let _ = stopped.await;
        }));
        println!("server listening on {endpoint}");

        // A client that trusts the authority: the handshake checks the
        // server's certificate against the endpoint's host (127.0.0.1).
        let mut client = EchoClient::connect(endpoint.clone()).await?;
        let reply = client
            .say(EchoRequest {
                message: format!("hello over {scheme}://"),
                payload: Default::default(),
            })
            .await?;
        println!(
            "  client trusting the CA: say -> {:?}",
            reply.get_ref().message
        );
        // The certificate names localhost too.
        let by_name = format!("{scheme}://localhost:{}", endpoint.port().unwrap_or(0));
        let mut client = EchoClient::connect(by_name.as_str()).await?;
        let payload: rpc_core::bytes::Bytes = (0..(1 << 20)).map(|i: u32| i as u8).collect();
        let reply = client
            .say(EchoRequest {
                message: "1 MiB".into(),
                payload: payload.clone(),
            })
            .await?;
        if reply.get_ref().payload != payload {
            return Err(format!("{by_name}: the 1 MiB payload came back different").into());
        }
        println!(
            "  client trusting the CA, by name {by_name}: a 1 MiB payload came back identical"
        );

        // A client that trusts another authority: the same endpoint, through
        // a transport of its own (not registered).
        let untrusting = TlsTransport::new().with_client(stranger.trusting_client()?);
        let connected = Channel::builder(endpoint.clone())
            .transport(transport_for(&scheme, untrusting)?)
            .connect()
            .await;
        match connected {
            Err(error) if error.to_string().contains("certificate") => {
                println!("  client trusting another CA: refused, as it should: {error}");
            }
            Err(error) => {
                failures.push(format!(
                    "{endpoint}: a client trusting another CA failed, but not for the certificate: {error}"
                ));
            }
            Ok(_) => failures.push(format!(
                "{endpoint}: a client trusting another CA connected; it should have been refused"
            )),
        }

        // The server goes on serving after refusing a stranger.
        let reply = client
            .say(EchoRequest {
                message: "still here".into(),
                payload: Default::default(),
            })
            .await?;
        println!(
            "  after the refusal, the trusting client: say -> {:?}",
            reply.get_ref().message
        );

        let _ = stop.send(());
        server.await??;
        println!("  server on {endpoint} shut down gracefully");
    }

    if failures.is_empty() {
        println!("done");
        Ok(())
    } else {
        Err(failures.join("\n").into())
    }
}
