//! The standard services (health, reflection) are rdma-rpc services like
//! any other: served over every transport. Here over rdma:// (soft provider)
//! and tcp://, with rdma-rpc's own generated clients.

mod common;

use futures_util::StreamExt;
use rpc_core::Channel;
use rpc_core::prost::Message;
use rpc_grpc::health::ServingStatus;
use rpc_grpc::health::proto::HealthCheckRequest;
use rpc_grpc::health::proto::health_client::HealthClient;
use rpc_grpc::reflection::v1::ServerReflectionRequest;
use rpc_grpc::reflection::v1::server_reflection_client::ServerReflectionClient;
use rpc_grpc::reflection::v1::server_reflection_request::MessageRequest;
use rpc_grpc::reflection::v1::server_reflection_response::MessageResponse;

async fn health_and_reflection_answer_over(scheme: &str) {
    let server = common::rdma_server_on(scheme).await;
    let channel = Channel::connect(server.endpoint.as_str())
        .await
        .expect("connect");
    let mut health = HealthClient::new(channel.clone());
    let status = health
        .check(HealthCheckRequest {
            service: "interop.v1.Interop".into(),
        })
        .await
        .expect("check")
        .into_inner();
    assert_eq!(status.status, ServingStatus::Serving as i32);

    let mut reflection = ServerReflectionClient::new(channel);
    let asks = futures_util::stream::iter([
        MessageRequest::ListServices(String::new()),
        MessageRequest::FileContainingSymbol("interop.v1.Ask".into()),
    ])
    .map(|request| ServerReflectionRequest {
        host: String::new(),
        message_request: Some(request),
    });
    let mut answers = reflection
        .server_reflection_info(asks)
        .await
        .expect("reflection")
        .into_inner();
    let Some(MessageResponse::ListServicesResponse(list)) =
        answers.message().await.unwrap().unwrap().message_response
    else {
        panic!("a service list first")
    };
    let names: Vec<_> = list
        .service
        .iter()
        .map(|service| service.name.as_str())
        .collect();
    assert!(names.contains(&"interop.v1.Interop"), "{names:?}");
    assert!(names.contains(&"grpc.health.v1.Health"), "{names:?}");
    let Some(MessageResponse::FileDescriptorResponse(files)) =
        answers.message().await.unwrap().unwrap().message_response
    else {
        panic!("then a file")
    };
    let file =
        rpc_core::prost_types::FileDescriptorProto::decode(&files.file_descriptor_proto[0][..])
            .unwrap();
    assert_eq!(file.name(), "interop.proto");
    assert!(answers.message().await.unwrap().is_none());
}

#[tokio::test]
async fn health_and_reflection_answer_over_rdma() {
    health_and_reflection_answer_over("rdma").await;
}

#[tokio::test]
async fn health_and_reflection_answer_over_tcp() {
    health_and_reflection_answer_over("tcp").await;
}
