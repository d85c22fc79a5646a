//! Certificates made for the TLS tests (rcgen): a certificate authority,
//! leaf certificates for localhost and 127.0.0.1 it signs (valid, or
//! expired), and rustls configurations from them. Shared by `tls://` and
//! `rdma+tls://` tests.

#![allow(dead_code)]

use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, SanType};
use rpc_core::transport::tls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rpc_core::transport::tls::rustls::server::WebPkiClientVerifier;
use rpc_core::transport::tls::rustls::{ClientConfig, RootCertStore, ServerConfig};

/// A certificate authority and what it signs.
pub(crate) struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    pub(crate) fn new(name: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        Ca {
            cert: params.self_signed(&key).unwrap(),
            key,
        }
    }

    /// A leaf certificate for localhost, 127.0.0.1 and `RDMA_TEST_ADDR` (if
    /// set), valid now unless `expired`.
    pub(crate) fn leaf(
        &self,
        expired: bool,
    ) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        params
            .subject_alt_names
            .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
        // The RDMA suites listen on the device's netdev address where one is
        // given (the VM stage: RDMA_TEST_ADDR=10.0.0.1).
        if let Some(ip) = std::env::var("RDMA_TEST_ADDR")
            .ok()
            .and_then(|addr| addr.parse().ok())
        {
            params.subject_alt_names.push(SanType::IpAddress(ip));
        }
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        (
            vec![cert.der().clone()],
            PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
    }

    /// The authority's certificate, hex-encoded DER (to hand to a child process).
    pub(crate) fn hex(&self) -> String {
        self.cert.der().iter().map(|b| format!("{b:02x}")).collect()
    }

    pub(crate) fn roots(&self) -> RootCertStore {
        let mut roots = RootCertStore::empty();
        roots.add(self.cert.der().clone()).unwrap();
        roots
    }
}

/// A server configuration with a leaf of `ca` (expired if `expired`),
/// verifying clients against `client_ca` when given (mutual TLS).
pub(crate) fn server_config(ca: &Ca, expired: bool, client_ca: Option<&Ca>) -> ServerConfig {
    let (chain, key) = ca.leaf(expired);
    let builder = ServerConfig::builder();
    let builder = match client_ca {
        Some(client_ca) => builder.with_client_cert_verifier(
            WebPkiClientVerifier::builder(Arc::new(client_ca.roots()))
                .build()
                .unwrap(),
        ),
        None => builder.with_no_client_auth(),
    };
    builder.with_single_cert(chain, key).unwrap()
}

/// A client configuration trusting `trusts`, presenting a leaf of
/// `identity` when given.
pub(crate) fn client_config(trusts: &Ca, identity: Option<&Ca>) -> ClientConfig {
    let builder = ClientConfig::builder().with_root_certificates(trusts.roots());
    match identity {
        Some(ca) => {
            let (chain, key) = ca.leaf(false);
            builder.with_client_auth_cert(chain, key).unwrap()
        }
        None => builder.with_no_client_auth(),
    }
}

/// A client configuration trusting the authority [`Ca::hex`] printed.
pub(crate) fn client_config_trusting_hex(hex: &str) -> ClientConfig {
    let der: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(&hex[at..at + 2], 16).expect("hex"))
        .collect();
    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from(der))
        .expect("a CA certificate");
    ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth()
}
