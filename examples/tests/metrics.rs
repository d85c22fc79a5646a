//! The metrics example's path, scraped over HTTP as Prometheus does: calls
//! over rdma:// show up per method and code, with latency, bytes,
//! connections and the RDMA transport's gauges.

use rdma_rpc_examples::echo::EchoRequest;
use rdma_rpc_examples::echo::echo_client::EchoClient;
use rdma_rpc_examples::echo::echo_server::EchoServer;
use rdma_rpc_examples::{EchoService, export_prometheus, scrape};

/// The value of the sample of `name` whose labels include every one of
/// `labels` (`key="value"` each).
fn sample(body: &str, name: &str, labels: &[&str]) -> Option<f64> {
    body.lines()
        .filter(|line| !line.starts_with('#'))
        .find(|line| {
            let (series, _) = line.rsplit_once(' ').unwrap_or((line, ""));
            let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
            metric == name && labels.iter().all(|label| rest.contains(label))
        })
        .and_then(|line| line.rsplit_once(' '))
        .and_then(|(_, value)| value.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_connections_and_rdma_gauges_are_scraped() {
    let mut config = rpc_transport_rdma::RdmaConfig::from_env().unwrap();
    if config.provider.is_none() {
        config.provider = Some("soft".into());
    }
    rpc_transport_rdma::register_with(config).unwrap();
    // A free port for the exporter.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    export_prometheus(addr).unwrap();

    let listening = rpc_core::Server::builder()
        .add_service(EchoServer::new(EchoService))
        .listen("rdma://127.0.0.1:0")
        .await
        .unwrap();
    let endpoint = listening.local_endpoint();
    let server = tokio::spawn(listening.serve());
    let mut client = EchoClient::connect(endpoint.to_string()).await.unwrap();
    for i in 0..20 {
        client
            .say(EchoRequest {
                message: format!("call {i}"),
                payload: vec![1u8; 100].into(),
            })
            .await
            .unwrap();
    }
    // A call to a method the server does not have: counted by its code.
    let mut request = rpc_core::Request::new(bytes_of("x"));
    request.set_method("/echo.v1.Echo/Missing");
    let channel = rpc_core::Channel::connect(endpoint.clone()).await.unwrap();
    let status = channel.unary(request).await.unwrap_err();
    assert_eq!(status.code(), rpc_core::Code::Unimplemented);

    let body = scrape(addr).await.unwrap();
    let say = "method=\"/echo.v1.Echo/Say\"";
    assert_eq!(
        sample(&body, "rpc_server_calls_total", &[say, "code=\"Ok\""]),
        Some(20.0),
        "{body}"
    );
    assert_eq!(
        sample(&body, "rpc_client_calls_total", &[say, "code=\"Ok\""]),
        Some(20.0),
        "{body}"
    );
    assert_eq!(
        sample(
            &body,
            "rpc_client_calls_total",
            &["method=\"/echo.v1.Echo/Missing\"", "code=\"Unimplemented\""]
        ),
        Some(1.0),
        "{body}"
    );
    assert_eq!(
        sample(&body, "rpc_server_call_duration_seconds_count", &[say]),
        Some(20.0),
        "{body}"
    );
    assert!(
        sample(&body, "rpc_server_request_bytes_total", &[say]).unwrap() >= 20.0 * 100.0,
        "{body}"
    );
    assert_eq!(
        sample(&body, "rpc_server_calls_in_flight", &[say]),
        Some(0.0),
        "{body}"
    );
    assert_eq!(
        sample(
            &body,
            "rpc_connections",
            &["side=\"server\"", "scheme=\"rdma\""]
        ),
        Some(2.0),
        "{body}"
    );
    assert_eq!(
        sample(
            &body,
            "rpc_connections",
            &["side=\"client\"", "scheme=\"rdma\""]
        ),
        Some(2.0),
        "{body}"
    );
    assert!(
        sample(&body, "rdma_registered_bytes", &[]).unwrap() > 0.0,
        "{body}"
    );
    server.abort();
}

fn bytes_of(text: &str) -> rpc_core::bytes::Bytes {
    rpc_core::bytes::Bytes::copy_from_slice(text.as_bytes())
}
