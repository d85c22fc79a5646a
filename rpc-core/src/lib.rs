//! rpc-core: the transport-agnostic heart of rdma-rpc.
//!
//! # Start here: a `.proto`, generated code, a server and a client
//!
//! Most users never touch this crate's traits directly. They write a
//! `.proto`, let `rpc-codegen` generate a typed client and server from
//! `build.rs` (no `protoc` needed), implement the service trait, and pick a
//! transport by the endpoint's scheme:
//!
//! ```text
//! // proto/echo.proto
//! syntax = "proto3";
//! package echo.v1;
//! service Echo { rpc Say(EchoRequest) returns (EchoReply); }
//! message EchoRequest { string message = 1; bytes payload = 2; }
//! message EchoReply { string message = 1; bytes payload = 2; }
//!
//! // build.rs
//! fn main() -> std::io::Result<()> {
//!     rpc_codegen::compile_protos("proto/echo.proto")
//! }
//! ```
//!
//! ```text
//! // src/main.rs (the same as the README's; it needs the generated code, so it is not a doctest here)
//! mod echo { include!(concat!(env!("OUT_DIR"), "/echo.v1.rs")); }
//! use echo::{EchoReply, EchoRequest, echo_client::EchoClient, echo_server::{Echo, EchoServer}};
//! use rpc_core::{Request, Response, Server, Status};
//!
//! struct MyEcho;
//! impl Echo for MyEcho {
//!     async fn say(&self, request: Request<EchoRequest>) -> Result<Response<EchoReply>, Status> {
//!         let EchoRequest { message, payload } = request.into_inner();
//!         Ok(Response::new(EchoReply { message, payload }))
//!     }
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     rpc_transport_rdma::register()?; // rdma:// (the soft provider where there is no device)
//!     let server = Server::builder().add_service(EchoServer::new(MyEcho));
//!     tokio::spawn(server.listen("rdma://127.0.0.1:50051").await?.serve());
//!     let mut client = EchoClient::connect("rdma://127.0.0.1:50051").await?;
//!     let reply = client.say(EchoRequest { message: "hi".into(), payload: Default::default() }).await?;
//!     println!("{}", reply.into_inner().message);
//!     Ok(())
//! }
//! ```
//!
//! The same code runs over `tcp://`, `mem://` (in process), `grpc://`
//! (standard gRPC clients and servers, crate `rpc-grpc`) and `rdma://`
//! (crate `rpc-transport-rdma`). The repository's README is the guide; its
//! sections, and where each lives in code:
//!
//! | topic | README section | here |
//! |---|---|---|
//! | the four rpc kinds, streams | Streaming | [`stream`], [`server::streaming`] |
//! | gRPC: `grpc://`, tonic's code, health, reflection, gzip | Using it with gRPC and tonic | crate `rpc-grpc`, [`server::front_end`], [`client::front_end`] |
//! | TLS on `tcp://`, `rdma://`'s set-up, `grpcs://` | TLS | `transport::tls` (feature `tls`) |
//! | several servers: balancing, discovery, retries | Several servers | [`client`] |
//! | interceptors, tower layers | Interceptors; A service in five minutes | [`Interceptor`], [`Server::layer`] |
//! | metrics and the access log | Metrics and access log | [`metrics`] |
//! | RDMA providers (soft, rxe, siw, hardware) | Testing on real RDMA | crate `rpc-transport-rdma` |
//! | limits and what a hostile peer cannot do | Security and limits | [`server`] (its Limits table) |
//!
//! # How a call travels
//!
//! - A generated client (see `rpc-codegen`) wraps an [`RpcClient`] around a
//!   tower service, usually a [`Channel`]. It encodes the message with a
//!   [`codec::Codec`] ([`codec::ProstCodec`] by default), sets the method path
//!   on the [`Request`], and calls the service.
//! - The [`Channel`] multiplexes calls on one connection from a
//!   [`transport::Transport`] chosen by the endpoint's scheme (`tcp://`,
//!   `mem://`, or one registered by another crate such as `rdma://`). Each call
//!   is one request [`frame::Frame`] and one response frame.
//! - The [`Server`] accepts connections, decodes frames, and runs the layered
//!   [`server::Routes`], which dispatch by `/package.Service/Method` to
//!   generated servers; they decode, call the user's trait, and encode. A
//!   front end ([`server::front_end`], gRPC's HTTP/2) brings its calls to
//!   the same routes without frames; a [`Channel`] to a client front end
//!   ([`client::front_end`]) hands it each call whole.
//! - Failures are a [`Status`] with a gRPC [`Code`]; set-up failures are an [`Error`].
//!
//! Underneath the generated code is a tower service of encoded messages;
//! one can be written by hand:
//!
//! ```
//! // A complete round trip over the in-memory transport with a hand-written service.
//! use bytes::Bytes;
//! use rpc_core::{Channel, Request, Response, Server, Status, server::NamedService};
//!
//! #[derive(Clone)]
//! struct Upper;
//! impl NamedService for Upper { const NAME: &'static str = "demo.Upper"; }
//! impl tower::Service<Request<Bytes>> for Upper {
//!     type Response = Response<Bytes>;
//!     type Error = Status;
//!     type Future = std::future::Ready<Result<Response<Bytes>, Status>>;
//!     fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Status>> {
//!         std::task::Poll::Ready(Ok(()))
//!     }
//!     fn call(&mut self, request: Request<Bytes>) -> Self::Future {
//!         let upper = request.get_ref().to_ascii_uppercase();
//!         std::future::ready(Ok(Response::new(Bytes::from(upper))))
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let server = Server::builder().add_service(Upper).listen("mem://doc-upper").await?;
//! tokio::spawn(server.serve());
//! let channel = Channel::connect("mem://doc-upper").await?;
//! let mut request = Request::new(Bytes::from_static(b"hi"));
//! request.set_method("/demo.Upper/Shout");
//! let response = channel.unary(request).await?;
//! assert_eq!(response.into_inner(), Bytes::from_static(b"HI"));
//! # Ok(()) }
//! ```

// What generated code (rpc-codegen) refers to, so that a user's crate needs
// no direct dependency on them, and always the versions rpc-core was built
// with.
#[doc(no_inline)]
pub use bytes;
#[doc(no_inline)]
pub use prost;
#[doc(no_inline)]
pub use prost_types;

pub mod client;
pub mod codec;
mod conn_io;
mod error;
pub mod frame;
pub mod interceptor;
pub mod metadata;
pub mod metrics;
mod payload;
mod request;
mod send_buffer;
pub mod server;
mod status;
pub mod stream;
#[cfg(feature = "tonic")]
pub mod tonic_compat;
pub mod transport;
pub mod wake_gate;

pub use client::{Channel, RpcClient};
pub use error::Error;
pub use interceptor::{InterceptedService, Interceptor, InterceptorLayer};
pub use metadata::Metadata;
pub use payload::Payload;
pub use request::{IntoRequest, PeerInfo, Request, Response};
pub use send_buffer::SendBuffer;
pub use server::Server;
pub use status::{BoxError, Code, Status};
pub use stream::{IntoStreamingRequest, Streaming};

/// Includes the Rust code `rpc-codegen` generated for a protobuf package:
/// `rpc_core::include_proto!("echo.v1");` inside the module that should hold it.
#[macro_export]
macro_rules! include_proto {
    ($package:tt) => {
        include!(concat!(env!("OUT_DIR"), concat!("/", $package, ".rs")));
    };
}

/// Re-exports for generated code; not a stable API.
#[doc(hidden)]
pub mod codegen {
    pub use bytes::Bytes;
    pub use futures_util::future::BoxFuture;
    pub use std::future::Future;
    pub use std::sync::Arc;
    pub use std::task::{Context, Poll};
    pub use tower_service::Service;

    pub use crate::client::{Channel, RpcClient};
    pub use crate::codec::ProstCodec;
    pub use crate::interceptor::{InterceptedService, Interceptor};
    pub use crate::server::NamedService;
    pub use crate::server::streaming::{
        client_streaming as client_streaming_handler, server_streaming as server_streaming_handler,
        streaming as streaming_handler,
    };
    pub use crate::server::unary::handle as unary;
    pub use crate::{
        BoxError, Error, IntoRequest, IntoStreamingRequest, Payload, Request, Response, Status,
        Streaming,
    };
    pub use futures_core::Stream;
}
