//! gzip on grpc:// (`rpc_grpc::GrpcOptions`), against grpcio both ways and
//! on the wire. The gzip server and channels use a scheme of their own
//! (`grpcgzip`, a `GrpcTransport` with `GrpcOptions::gzip()`), so that the
//! default `grpc` scheme keeps the default options in this process.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use common::{grpcio_server_with_env, python_ready, rdma_server, tonic_server};
use rpc_core::{Channel, Code, Request};
use rpc_grpc::{ENCODING_REQUEST, GrpcOptions, GrpcTransport};
use rpc_grpc_interop::RdmaInterop;
use rpc_grpc_interop::rdma::Ask;
use rpc_grpc_interop::rdma::interop_client::InteropClient;
use rpc_grpc_interop::rdma::interop_server::InteropServer;

const GZIP: &str = "grpcgzip";

fn register() {
    common::register();
    rpc_core::transport::register(
        GZIP,
        Arc::new(GrpcTransport::with_options(GrpcOptions::gzip())),
    );
}

/// rdma-rpc's interop server on `scheme` (`grpc` or the gzip one).
async fn server_on(scheme: &str) -> (String, tokio::task::JoinHandle<()>) {
    let listening = rpc_core::Server::builder()
        .max_frame_len(common::LIMIT)
        .add_service(InteropServer::new(RdmaInterop::default()))
        .listen(format!("{scheme}://127.0.0.1:0").as_str())
        .await
        .unwrap();
    let addr = listening.local_endpoint().authority().to_owned();
    let task = tokio::spawn(async move {
        let _ = listening.serve().await;
    });
    (addr, task)
}

#[tokio::test]
async fn grpcio_client_compresses_against_a_gzip_server_and_is_refused_by_default() {
    if !python_ready() {
        return;
    }
    register();
    let (gzip_addr, gzip_server) = server_on(GZIP).await;
    let (plain_addr, plain_server) = server_on("grpc").await;
    common::run_python_scenarios(
        "compression_client.py",
        vec![gzip_addr, plain_addr],
        &[
            "gzip_unary",
            "gzip_server_stream",
            "gzip_client_stream",
            "refused_by_default",
        ],
        Duration::from_secs(120),
    )
    .await;
    gzip_server.abort();
    plain_server.abort();
}

fn big_ask() -> Ask {
    Ask {
        body: Bytes::from(b"compressible ".repeat(200_000)),
        ..Ask::default()
    }
}

/// rdma-rpc's gzip channel calling `server`: a large unary call and a
/// server stream come back whole.
async fn gzip_channel_calls(name: &str, addr: &str) {
    let channel = Channel::builder(format!("{GZIP}://{addr}").parse().unwrap())
        .max_frame_len(2 * common::LIMIT)
        .connect()
        .await
        .unwrap();
    let mut client = InteropClient::new(channel);
    let ask = big_ask();
    let answer = client.unary(ask.clone()).await.unwrap().into_inner();
    assert_eq!(answer.body, ask.body, "against {name}");
    let stream = Ask {
        count: 3,
        answer_size: 100_000,
        ..Ask::default()
    };
    let mut answers = client.server_stream(stream).await.unwrap().into_inner();
    let mut count = 0;
    while let Some(answer) = answers.message().await.unwrap() {
        assert_eq!(answer.body.len(), 100_000);
        count += 1;
    }
    assert_eq!(count, 3);
}

#[tokio::test]
async fn gzip_channel_against_grpcio_server_that_compresses_its_answers() {
    register();
    let Some(server) = grpcio_server_with_env(&[("INTEROP_COMPRESSION", "gzip")]).await else {
        return;
    };
    gzip_channel_calls(server.name, &server.addr).await;
}

#[tokio::test]
async fn gzip_channel_against_rdma_rpc_gzip_server() {
    register();
    let (addr, task) = server_on(GZIP).await;
    gzip_channel_calls("rdma-rpc gzip", &addr).await;
    task.abort();
}

/// tonic's server accepts no compression unless told to: a compressed call
/// gets UNIMPLEMENTED, which shows the channel did compress; the same
/// channel's call that asks for identity is answered.
#[tokio::test]
async fn gzip_channel_compresses_unless_the_call_asks_for_identity() {
    register();
    let server = tonic_server().await;
    let channel = Channel::connect(format!("{GZIP}://{}", server.addr).as_str())
        .await
        .unwrap();
    let mut client = InteropClient::new(channel);
    let status = client.unary(big_ask()).await.unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented, "{status}");
    let mut plain = Request::new(big_ask());
    plain
        .metadata_mut()
        .insert(ENCODING_REQUEST, "identity")
        .unwrap();
    let answer = client.unary(plain).await.unwrap().into_inner();
    assert_eq!(answer.body, big_ask().body);
    // And rdma-rpc's default server refuses it the same way.
    let ours = rdma_server().await;
    let channel = Channel::connect(format!("{GZIP}://{}", ours.addr).as_str())
        .await
        .unwrap();
    let status = InteropClient::new(channel)
        .unary(big_ask())
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented, "{status}");
    assert!(status.message().contains("gzip"), "{status}");
}

/// On the wire: the gzip server answers a client that accepts gzip with
/// `grpc-encoding: gzip` and compressed messages, and one that does not
/// with plain ones; a compressed request that inflates past what its gzip
/// trailer declares fails its call without the server holding the rest.
#[tokio::test]
async fn the_gzip_server_compresses_only_for_clients_that_accept_it() {
    register();
    let (addr, task) = server_on(GZIP).await;
    let client = common::raw_http2_client(&addr).await;
    let ask = {
        use prost::Message;
        big_ask().encode_to_vec()
    };
    for accepts in [true, false] {
        let accept: &[(&str, &str)] = if accepts {
            &[("grpc-accept-encoding", "gzip")]
        } else {
            &[]
        };
        let response = send_message(&client, &addr, accept, false, &ask).await;
        let response = response.await.unwrap();
        let encoding = response.headers().get("grpc-encoding").cloned();
        let mut received = BytesMut::new();
        let mut stream = response.into_body();
        while let Some(chunk) = stream.data().await {
            let chunk = chunk.unwrap();
            let _ = stream.flow_control().release_capacity(chunk.len());
            received.extend_from_slice(&chunk);
        }
        let trailers = stream.trailers().await.unwrap().unwrap();
        assert_eq!(trailers.get("grpc-status").unwrap(), "0");
        if accepts {
            assert_eq!(encoding.unwrap(), "gzip");
            assert_eq!(received[0], 1, "the answer is compressed");
            assert!(received.len() < ask.len() / 10, "{} bytes", received.len());
        } else {
            assert!(encoding.is_none());
            assert_eq!(received[0], 0, "the answer is plain");
            assert!(received.len() > ask.len());
        }
    }

    // A bomb: 64 MiB of zeros whose trailer declares 1,000 bytes.
    let mut bomb = {
        use std::io::Write;
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.write_all(&vec![0u8; 64 << 20]).unwrap();
        encoder.finish().unwrap()
    };
    let tail = bomb.len() - 4;
    bomb[tail..].copy_from_slice(&1000u32.to_le_bytes());
    let response = send_message(&client, &addr, &[("grpc-encoding", "gzip")], true, &bomb).await;
    let response = response.await.unwrap();
    let status = match response.headers().get("grpc-status") {
        Some(status) => status.clone(),
        None => {
            let mut stream = response.into_body();
            while stream.data().await.is_some() {}
            stream
                .trailers()
                .await
                .unwrap()
                .unwrap()
                .get("grpc-status")
                .unwrap()
                .clone()
        }
    };
    assert_eq!(status, "13", "INTERNAL: it does not decompress as declared");
    task.abort();
}

/// Sends one `Unary` call with `headers` and one message (its compressed
/// flag set when `compressed`) over a raw HTTP/2 connection; its response.
/// What a server says of the encodings it takes (`grpc-accept-encoding`):
/// the gzip server lists gzip on every answer; a default (identity-only)
/// server says nothing on an answer, as tonic's does, and `identity` on the
/// UNIMPLEMENTED it gives a compressed request.
#[tokio::test]
async fn servers_name_the_encodings_they_take_on_answers_only_where_they_take_more_than_identity() {
    register();
    let (gzip_addr, gzip_task) = server_on(GZIP).await;
    let (plain_addr, plain_task) = server_on("grpc").await;
    let ask = {
        use prost::Message;
        Ask {
            body: vec![7u8; 16].into(),
            ..Default::default()
        }
        .encode_to_vec()
    };
    /// A request to `addr` with `headers` (its message flagged compressed
    /// or not), and what its answer says.
    struct Case<'a> {
        addr: &'a str,
        headers: &'a [(&'a str, &'a str)],
        compressed: bool,
        status: &'a str,
        advertised: Option<&'a str>,
    }
    let cases = [
        Case {
            addr: &gzip_addr,
            headers: &[],
            compressed: false,
            status: "0",
            advertised: Some("gzip,identity"),
        },
        Case {
            addr: &plain_addr,
            headers: &[],
            compressed: false,
            status: "0",
            advertised: None,
        },
        Case {
            addr: &plain_addr,
            headers: &[("grpc-encoding", "gzip")],
            compressed: true,
            status: "12",
            advertised: Some("identity"),
        },
    ];
    for Case {
        addr,
        headers,
        compressed,
        status,
        advertised,
    } in cases
    {
        let client = common::raw_http2_client(addr).await;
        let response = send_message(&client, addr, headers, compressed, &ask).await;
        let response = response.await.unwrap();
        assert_eq!(
            response
                .headers()
                .get("grpc-accept-encoding")
                .map(|value| value.to_str().unwrap()),
            advertised,
            "{addr} {headers:?}"
        );
        let (head, mut body) = response.into_parts();
        let code = match head.headers.get("grpc-status") {
            // Trailers-only: the status came with the headers.
            Some(code) => code.clone(),
            None => {
                while let Some(chunk) = body.data().await {
                    let _ = body.flow_control().release_capacity(chunk.unwrap().len());
                }
                body.trailers().await.unwrap().unwrap()["grpc-status"].clone()
            }
        };
        assert_eq!(code, status, "{addr} {headers:?}");
    }
    gzip_task.abort();
    plain_task.abort();
}

async fn send_message(
    client: &h2::client::SendRequest<Bytes>,
    addr: &str,
    headers: &[(&str, &str)],
    compressed: bool,
    message: &[u8],
) -> h2::client::ResponseFuture {
    let mut request = common::grpc_request(addr, "Unary");
    for (name, value) in headers {
        request.headers_mut().insert(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            http::HeaderValue::from_str(value).unwrap(),
        );
    }
    let mut sender = client.clone().ready().await.unwrap();
    let (response, mut body) = sender.send_request(request, false).unwrap();
    let mut data = BytesMut::new();
    data.put_u8(u8::from(compressed));
    data.put_u32(message.len() as u32);
    data.put_slice(message);
    body.send_data(data.freeze(), true).unwrap();
    response
}
