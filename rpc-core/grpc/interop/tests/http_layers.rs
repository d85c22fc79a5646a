//! tower-http's layers in front of an rdma-rpc server through
//! `rpc_grpc::HttpLayer`: tracing (its gRPC classifier), a bearer-token
//! check (`ValidateRequestHeaderLayer`), request and response headers and request ids, served on
//! `grpc://` to tonic's client and on `rdma://` to rdma-rpc's.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use rpc_grpc_interop::{RdmaInterop, rdma, tonic_gen};
use tower_http::classify::GrpcFailureClass;
use tower_http::request_id::{MakeRequestUuid, SetRequestIdLayer};
use tower_http::set_header::{SetRequestHeaderLayer, SetResponseHeaderLayer};
use tower_http::trace::TraceLayer;
use tower_http::validate_request::ValidateRequestHeaderLayer;

/// What the tracing layer saw.
#[derive(Default)]
struct Traced {
    requests: AtomicUsize,
    responses: AtomicUsize,
    failures: AtomicUsize,
}

/// The interop service behind tower-http's layers on `endpoint`: trace
/// (outermost), a bearer token, a request header, a request id and a
/// response header.
async fn listen(endpoint: &str, traced: Arc<Traced>) -> rpc_core::server::Listening {
    common::register();
    let (on_request, on_response, on_failure) = (traced.clone(), traced.clone(), traced);
    let http_layers = tower::ServiceBuilder::new()
        .layer(
            TraceLayer::new_for_grpc()
                .on_request(move |_: &http::Request<_>, _: &tracing::Span| {
                    on_request.requests.fetch_add(1, Ordering::Relaxed);
                })
                .on_response(
                    move |_: &http::Response<_>, _: std::time::Duration, _: &tracing::Span| {
                        on_response.responses.fetch_add(1, Ordering::Relaxed);
                    },
                )
                .on_failure(
                    move |_: GrpcFailureClass, _: std::time::Duration, _: &tracing::Span| {
                        on_failure.failures.fetch_add(1, Ordering::Relaxed);
                    },
                ),
        )
        .layer(ValidateRequestHeaderLayer::custom(check_token))
        .layer(SetRequestIdLayer::new(
            HeaderName::from_static("x-request-id"),
            MakeRequestUuid,
        ))
        .layer(SetRequestHeaderLayer::overriding(
            HeaderName::from_static("x-via"),
            HeaderValue::from_static("tower-http"),
        ))
        .layer(SetResponseHeaderLayer::overriding(
            HeaderName::from_static("x-served-by"),
            HeaderValue::from_static("rdma-rpc"),
        ));
    rpc_core::Server::builder()
        .layer(rpc_grpc::HttpLayer::new(http_layers))
        .add_service(rdma::interop_server::InteropServer::new(
            RdmaInterop::default(),
        ))
        .listen(endpoint)
        .await
        .expect("listen")
}

/// The bearer token check, as a tower-http validation: `401` without it.
fn check_token(
    request: &mut http::Request<rpc_grpc::HttpLayerBody>,
) -> Result<(), http::Response<rpc_grpc::HttpLayerBody>> {
    match request.headers().get(http::header::AUTHORIZATION) {
        Some(value) if value == "Bearer let-me-in" => Ok(()),
        _ => {
            let mut refusal = http::Response::new(rpc_grpc::HttpLayerBody::new());
            *refusal.status_mut() = http::StatusCode::UNAUTHORIZED;
            Err(refusal)
        }
    }
}

/// `x-request-id=<a UUID>` and `x-via=tower-http`, in the order the
/// handler saw them, from the interop answer's `seen_metadata`.
fn check_seen(seen: &[String]) {
    assert!(seen.contains(&"x-via=tower-http".to_owned()), "{seen:?}");
    let id = seen
        .iter()
        .find_map(|entry| entry.strip_prefix("x-request-id="))
        .unwrap_or_else(|| panic!("no request id in {seen:?}"));
    assert_eq!(id.len(), 36, "a UUID: {id}");
}

#[tokio::test]
async fn tower_http_layers_run_in_front_of_grpc_for_tonics_client() {
    let traced = Arc::new(Traced::default());
    let listening = listen("grpc://127.0.0.1:0", traced.clone()).await;
    let addr = listening.local_endpoint().authority().to_owned();
    let server = tokio::spawn(listening.serve());
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = tonic_gen::interop_client::InteropClient::new(channel);
    let ask = tonic_gen::Ask {
        body: Bytes::from_static(b"hello"),
        ..tonic_gen::Ask::default()
    };

    // No token: the validation layer answers 401, which gRPC maps to
    // UNAUTHENTICATED; the handler never runs.
    let status = client
        .unary(tonic::Request::new(ask.clone()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    assert!(status.message().contains("401"), "{status:?}");

    // With the token: the layers' request headers reach the handler as
    // metadata, their response header reaches the client.
    let mut request = tonic::Request::new(ask.clone());
    request
        .metadata_mut()
        .insert("authorization", "Bearer let-me-in".parse().unwrap());
    let response = client.unary(request).await.expect("admitted");
    assert_eq!(
        response
            .metadata()
            .get("x-served-by")
            .map(|v| v.to_str().unwrap()),
        Some("rdma-rpc")
    );
    let answer = response.into_inner();
    assert_eq!(&answer.body[..], b"hello");
    check_seen(&answer.seen_metadata);

    // A server stream passes the layers once, at its start.
    let mut request = tonic::Request::new(tonic_gen::Ask {
        count: 3,
        ..ask.clone()
    });
    request
        .metadata_mut()
        .insert("authorization", "Bearer let-me-in".parse().unwrap());
    let mut answers = client.server_stream(request).await.unwrap().into_inner();
    let mut count = 0;
    while let Some(answer) = answers.message().await.unwrap() {
        check_seen(&answer.seen_metadata);
        count += 1;
    }
    assert_eq!(count, 3);

    // A handler's failure keeps its code and message, and the trace layer's
    // gRPC classifier sees it as a failure.
    let mut request = tonic::Request::new(tonic_gen::Ask {
        fail_with_code: tonic::Code::NotFound as i32,
        fail_message: "no such thing".into(),
        ..ask
    });
    request
        .metadata_mut()
        .insert("authorization", "Bearer let-me-in".parse().unwrap());
    let status = client.unary(request).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::NotFound);
    assert_eq!(status.message(), "no such thing");

    assert_eq!(
        traced.requests.load(Ordering::Relaxed),
        4,
        "one span per call"
    );
    assert_eq!(traced.responses.load(Ordering::Relaxed), 4);
    assert_eq!(
        traced.failures.load(Ordering::Relaxed),
        1,
        "the NOT_FOUND call (the 401 is a refusal without grpc-status: tower-http classifies it as \
         a success of HTTP, as under tonic)"
    );
    server.abort();
}

#[tokio::test]
async fn the_same_layers_run_on_rdma() {
    let traced = Arc::new(Traced::default());
    let listening = listen("rdma://127.0.0.1:0", traced.clone()).await;
    let endpoint = listening.local_endpoint().to_string();
    let server = tokio::spawn(listening.serve());
    let channel = rpc_core::Channel::connect(endpoint.as_str()).await.unwrap();
    let mut client = rdma::interop_client::InteropClient::new(channel);
    let ask = rdma::Ask {
        body: Bytes::from_static(b"over rdma"),
        ..rdma::Ask::default()
    };
    let status = client
        .unary(rpc_core::Request::new(ask.clone()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), rpc_core::Code::Unauthenticated, "{status:?}");

    let mut request = rpc_core::Request::new(ask);
    request
        .metadata_mut()
        .insert("authorization", "Bearer let-me-in")
        .unwrap();
    let response = client.unary(request).await.expect("admitted");
    assert_eq!(response.metadata().get("x-served-by"), Some("rdma-rpc"));
    let answer = response.into_inner();
    assert_eq!(&answer.body[..], b"over rdma");
    check_seen(&answer.seen_metadata);
    assert_eq!(traced.requests.load(Ordering::Relaxed), 2);
    server.abort();
}
