//! gRPC for rdma-rpc: the `grpc://` transport.
//!
//! ```no_run
//! # async fn demo<S: rpc_core::server::RoutableService>(service: S) -> Result<(), rpc_core::Error> {
//! rpc_grpc::register(); // once, at start-up
//! // A server that standard gRPC clients (grpcio, grpc-go, tonic) can call:
//! rpc_core::Server::builder()
//!     .add_service(service)
//!     .serve("grpc://0.0.0.0:50051")
//!     .await?;
//! // A client of any gRPC server:
//! let channel = rpc_core::Channel::connect("grpc://127.0.0.1:50051").await?;
//! # let _ = channel; Ok(()) }
//! ```
//!
//! Registered under the scheme `grpc`, it works with the same
//! [`rpc_core::Server`] (its layers, limits and generated services) and the
//! same [`rpc_core::Channel`] and generated clients as `tcp://` or
//! `rdma://`. Each connection is HTTP/2 (cleartext, with prior knowledge, as
//! gRPC's `insecure` channels speak it) through the `h2` crate.
//!
//! **The server side is a front end** ([`rpc_core::server::front_end`]):
//! each HTTP/2 stream becomes a call of the server's routed tower stack
//! directly, as tonic's server calls its routes, in the connection's task:
//! the request body's messages are what the handler reads (a message that
//! arrived in one DATA frame is a slice of it, not a copy), the handler's
//! messages go into DATA frames under HTTP/2's flow control (a large field
//! as its own), the status into the trailers. Request headers give the
//! method (`:path`), the metadata and the deadline (`grpc-timeout`); an
//! RST_STREAM from the client cancels the handler.
//!
//! **The client side is a front end too**
//! ([`rpc_core::client::front_end`]): each call of a [`rpc_core::Channel`]
//! to `grpc://` is one HTTP/2 stream driven from the call's own task, as
//! tonic's client does: the metadata and deadline (`grpc-timeout`) become
//! its headers, its messages DATA frames under HTTP/2's flow control, and
//! the answer's messages are deframed from the received DATA as the
//! application takes them; dropping the call (or its response stream)
//! resets the stream. The [`rpc_core::Channel`] keeps doing what it does on
//! every transport (reconnects, deadlines, sending again a call the server
//! never saw, metrics). A silent connection is probed with TCP keepalive
//! (the channel's keepalive settings), not HTTP/2 PINGs, which gRPC servers
//! limit.
//!
//! `-bin` metadata travels base64-encoded on HTTP/2 and as bytes in
//! rdma-rpc; `grpc-message` is percent-encoded. A message over the frame
//! limit (`max_frame_len` of the server or channel) fails its call with
//! `RESOURCE_EXHAUSTED`, as gRPC's message size limits do.
//!
//! gRPC's wire does not say whether a method is unary or streaming, so the
//! server runs every call as a stream of unknown kind
//! ([`rpc_core::stream::KindUnknown`]); generated servers serve a unary
//! method's call as one message each way. A hand-written service sees it as
//! a streaming call ([`rpc_core::stream::ServerStream::take`]).
//!
//! **Compression** (gzip) is off by default, as in tonic: a call compressed
//! with an encoding this side does not accept gets `UNIMPLEMENTED`, and
//! `grpc-accept-encoding` says `identity` there (the headers before an
//! answer's messages say nothing of it, as tonic's server's, until the
//! server takes more than identity).
//! [`register_with`] turns it on:
//! [`GrpcOptions::accept_compressed`] takes compressed messages from peers
//! (requests on a server, responses on a client) and advertises it;
//! [`GrpcOptions::send_compressed`] compresses what this side sends (a
//! server only when the client's `grpc-accept-encoding` lists it). One call
//! picks its own with the metadata [`ENCODING_REQUEST`] (`gzip` or
//! `identity`): on a client's request, or on a server's response headers.
//! A compressed message is decompressed only after the receiver reserved
//! the length its gzip trailer declares (from the server's receive budget),
//! and only up to that length and the message limit: a small message that
//! would inflate past either fails its call instead.
//!
//! **HTTP layers** ([`HttpLayer`]): tower-http's layers (trace, auth,
//! headers, request ids) in front of a [`rpc_core::Server`]'s calls, on
//! `grpc://` and every other transport; see [`http_layer`].
//!
//! **TLS** (feature `tls`): `grpcs://` is the same inside TLS 1.2/1.3 with
//! rustls and ALPN `h2`, as gRPC's secure channels speak it; register it
//! with [`register_tls`] (a server configuration to listen, a client one to
//! connect). The client checks the server's certificate against the
//! endpoint's host; a failed handshake fails the connect with rustls' reason.
#![forbid(unsafe_code)]

mod client;
mod cork;
mod data;
pub mod health;
pub mod http_layer;
pub mod reflection;
mod server;
#[cfg(feature = "tonic")]
pub mod tonic;
mod wire;

use std::sync::Arc;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use rpc_core::client::front_end::{CallConnection, CallConnector, CallSettings};
use rpc_core::server::front_end::{FrontEnd, FrontEndListener};
use rpc_core::transport::{
    Connection, Endpoint, Listener, Transport, TransportConfig, TransportError,
};

pub use http_layer::{CallService, HttpLayer, HttpLayerBody, HttpLayered};
pub use wire::{ENCODING_REQUEST, Encoding};

/// The scheme `grpc://` endpoints name.
pub const SCHEME: &str = "grpc";

/// Registers the `grpc` scheme with rpc-core's transports, with the default
/// [`GrpcOptions`]. Call it once at start-up, before a server binds or a
/// channel connects to `grpc://`.
pub fn register() {
    register_with(GrpcOptions::default());
}

/// Registers the `grpc` scheme with `options` for every `grpc://` server and
/// channel of the process (registering again replaces them for what binds
/// or connects later).
pub fn register_with(options: GrpcOptions) {
    rpc_core::transport::register(SCHEME, Arc::new(GrpcTransport::with_options(options)));
}

/// Settings of `grpc://` servers and channels.
#[derive(Debug, Clone, Default)]
pub struct GrpcOptions {
    /// Encodings taken from peers (requests on a server, responses on a
    /// channel) and listed in `grpc-accept-encoding`; empty (the default):
    /// identity only.
    pub accept_compressed: Vec<Encoding>,
    /// The encoding of what this side sends: a channel's requests, a
    /// server's responses when the client accepts it. `None` (the
    /// default): uncompressed. A call may pick its own with
    /// [`ENCODING_REQUEST`].
    pub send_compressed: Option<Encoding>,
}

impl GrpcOptions {
    /// gzip both ways: accepted, and used for what this side sends.
    pub fn gzip() -> GrpcOptions {
        GrpcOptions {
            accept_compressed: vec![Encoding::Gzip],
            send_compressed: Some(Encoding::Gzip),
        }
    }
}

/// gRPC over HTTP/2 as an rdma-rpc transport (see the crate docs).
#[derive(Debug, Clone, Default)]
pub struct GrpcTransport {
    options: Arc<GrpcOptions>,
    #[cfg(feature = "tls")]
    tls: Option<rpc_core::transport::tls::TlsTransport>,
}

impl GrpcTransport {
    /// The transport with `options`, to register under a scheme of one's
    /// own (`rpc_core::transport::register("grpc-gzip", ..)`) where some
    /// endpoints need other options than the `grpc` scheme's.
    pub fn with_options(options: GrpcOptions) -> GrpcTransport {
        GrpcTransport {
            options: Arc::new(options),
            #[cfg(feature = "tls")]
            tls: None,
        }
    }

    /// The same inside TLS (feature `tls`): HTTP/2 over rustls, with ALPN
    /// `h2` set on both configurations, as gRPC requires. `server` lets it
    /// listen (its certificate; a client verifier for mutual TLS), `client`
    /// lets it connect (the roots it trusts); the client checks the
    /// server's certificate against the endpoint's host. Register it as
    /// `grpcs` ([`register_tls`]).
    #[cfg(feature = "tls")]
    pub fn with_tls(
        options: GrpcOptions,
        server: Option<rpc_core::transport::tls::rustls::ServerConfig>,
        client: Option<rpc_core::transport::tls::rustls::ClientConfig>,
    ) -> GrpcTransport {
        let mut tls = rpc_core::transport::tls::TlsTransport::new();
        if let Some(mut server) = server {
            server.alpn_protocols = vec![b"h2".to_vec()];
            tls = tls.with_server(server);
        }
        if let Some(mut client) = client {
            client.alpn_protocols = vec![b"h2".to_vec()];
            tls = tls.with_client(client);
        }
        GrpcTransport {
            options: Arc::new(options),
            tls: Some(tls),
        }
    }
}

impl GrpcTransport {
    /// A front end serving what `listener` accepts (a socket bound or
    /// inherited elsewhere), for [`rpc_core::server::Router::listen_on_front_end`]:
    /// tonic's `serve_with_incoming`, with no registration.
    ///
    /// ```no_run
    /// # async fn demo<S: rpc_core::server::RoutableService>(service: S) -> Result<(), Box<dyn std::error::Error>> {
    /// let listener = tokio::net::TcpListener::bind("127.0.0.1:50051").await?;
    /// let incoming = rpc_grpc::GrpcTransport::default().incoming(listener)?;
    /// rpc_core::Server::builder().add_service(service).listen_on_front_end(incoming).serve().await?;
    /// # Ok(()) }
    /// ```
    pub fn incoming(
        &self,
        listener: tokio::net::TcpListener,
    ) -> Result<Box<dyn FrontEndListener>, TransportError> {
        let settings = H2Settings::for_frame_limit(rpc_core::frame::DEFAULT_MAX_FRAME_LEN, self);
        let scheme = if settings.is_secure() {
            "grpcs"
        } else {
            SCHEME
        };
        #[cfg(feature = "tls")]
        if settings.tls.as_ref().is_some_and(|tls| !tls.has_server()) {
            return Err(TransportError::Other(
                "grpcs:// cannot listen: its GrpcTransport has no TLS server configuration".into(),
            ));
        }
        Ok(Box::new(server::listen_on(listener, scheme, settings)?))
    }
}

/// The scheme of gRPC over TLS.
#[cfg(feature = "tls")]
pub const TLS_SCHEME: &str = "grpcs";

/// Registers `grpcs://` (feature `tls`): gRPC over TLS with these rustls
/// configurations (see [`GrpcTransport::with_tls`]) and `options`.
#[cfg(feature = "tls")]
pub fn register_tls(
    options: GrpcOptions,
    server: Option<rpc_core::transport::tls::rustls::ServerConfig>,
    client: Option<rpc_core::transport::tls::rustls::ClientConfig>,
) {
    rpc_core::transport::register(
        TLS_SCHEME,
        Arc::new(GrpcTransport::with_tls(options, server, client)),
    );
}

impl Transport for GrpcTransport {
    fn connect(
        &self,
        endpoint: &Endpoint,
        config: &TransportConfig,
    ) -> BoxFuture<'static, Result<Connection, TransportError>> {
        let _ = config;
        let refusal = format!(
            "{}:// is connected to by rpc_core::Channel (a front end that makes each call an HTTP/2 stream), not as a transport of frames",
            endpoint.scheme()
        );
        async move { Err(TransportError::Other(refusal.into())) }.boxed()
    }

    fn bind(
        &self,
        endpoint: &Endpoint,
        _config: &TransportConfig,
    ) -> BoxFuture<'static, Result<Box<dyn Listener>, TransportError>> {
        let refusal = format!(
            "{}:// is served by rpc_core::Server (a front end that calls the server's routes), not bound as a transport",
            endpoint.scheme()
        );
        async move { Err(TransportError::Other(refusal.into())) }.boxed()
    }

    fn front_end(&self) -> Option<&dyn FrontEnd> {
        Some(self)
    }

    fn call_connector(&self) -> Option<&dyn CallConnector> {
        Some(self)
    }
}

impl CallConnector for GrpcTransport {
    fn connect(
        &self,
        endpoint: &Endpoint,
        settings: &CallSettings,
    ) -> BoxFuture<'static, Result<Arc<dyn CallConnection>, TransportError>> {
        let endpoint = endpoint.clone();
        let h2 = H2Settings::for_frame_limit(settings.max_message_len, self);
        let settings = settings.clone();
        async move { client::connect(&endpoint, h2, &settings).await }.boxed()
    }
}

impl FrontEnd for GrpcTransport {
    fn bind(
        &self,
        endpoint: &Endpoint,
        config: &TransportConfig,
    ) -> BoxFuture<'static, Result<Box<dyn FrontEndListener>, TransportError>> {
        let endpoint = endpoint.clone();
        let settings = H2Settings::for_frame_limit(config.max_frame_len, self);
        async move {
            #[cfg(feature = "tls")]
            if settings.tls.as_ref().is_some_and(|tls| !tls.has_server()) {
                return Err(TransportError::Other(
                    format!(
                        "{}:// cannot listen: its GrpcTransport has no TLS server configuration (GrpcTransport::with_tls(.., Some(server), ..))",
                        endpoint.scheme()
                    )
                    .into(),
                ));
            }
            let listener = server::bind(&endpoint, settings).await?;
            Ok(Box::new(listener) as Box<dyn FrontEndListener>)
        }
        .boxed()
    }
}

/// HTTP/2 settings of both sides.
#[derive(Debug, Clone)]
pub(crate) struct H2Settings {
    /// Largest gRPC message taken from the peer.
    pub(crate) max_message: usize,
    /// Compression.
    pub(crate) options: Arc<GrpcOptions>,
    /// TLS around HTTP/2 (`grpcs://`).
    #[cfg(feature = "tls")]
    pub(crate) tls: Option<rpc_core::transport::tls::TlsTransport>,
}

/// Each stream's HTTP/2 receive window.
pub(crate) const STREAM_WINDOW: u32 = 1 << 20;
/// The connection's HTTP/2 receive window.
const CONNECTION_WINDOW: u32 = 8 << 20;
/// Largest header block taken (metadata included).
const MAX_HEADER_LIST: u32 = 16 << 10;
/// Streams a client may open at once on one connection.
pub(crate) const MAX_CONCURRENT_STREAMS: u32 = 1024;
/// Bytes h2 buffers per stream beyond what the peer's window let go.
const SEND_BUFFER: usize = 64 << 10;
/// Largest DATA frame.
pub(crate) const MAX_FRAME_SIZE: u32 = 64 << 10;

impl H2Settings {
    fn for_frame_limit(max_frame_len: usize, transport: &GrpcTransport) -> H2Settings {
        H2Settings {
            max_message: server::max_message_for(max_frame_len),
            options: transport.options.clone(),
            #[cfg(feature = "tls")]
            tls: transport.tls.clone(),
        }
    }

    /// Whether HTTP/2 runs inside TLS.
    pub(crate) fn is_secure(&self) -> bool {
        #[cfg(feature = "tls")]
        return self.tls.is_some();
        #[cfg(not(feature = "tls"))]
        false
    }

    fn server(&self) -> h2::server::Builder {
        let mut builder = h2::server::Builder::new();
        builder
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .max_header_list_size(MAX_HEADER_LIST)
            .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
            .max_frame_size(MAX_FRAME_SIZE)
            .max_send_buffer_size(SEND_BUFFER);
        builder
    }

    fn client(&self) -> h2::client::Builder {
        let mut builder = h2::client::Builder::new();
        builder
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .max_header_list_size(MAX_HEADER_LIST)
            .max_frame_size(MAX_FRAME_SIZE)
            .max_send_buffer_size(SEND_BUFFER);
        builder
    }
}
