//! `grpc.reflection.v1` (and its older name `grpc.reflection.v1alpha`):
//! server reflection, so that grpcurl, grpcio's reflection client and other
//! tooling can list a server's services and fetch their descriptors. An
//! rdma-rpc service like any other, so it is served over every transport.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! // build.rs: rpc_codegen::configure().file_descriptor_set_path(out_dir.join("descriptors.bin"))
//! # const DESCRIPTORS: &[u8] = &[];
//! let reflection = rpc_grpc::reflection::ReflectionService::builder()
//!     .register_encoded_file_descriptor_set(DESCRIPTORS)? // include_bytes!(concat!(env!("OUT_DIR"), "/descriptors.bin"))
//!     .build();
//! rpc_core::Server::builder()
//!     .add_service(reflection.v1())
//!     .add_service(reflection.v1alpha()) // for tools that only know the old name
//!     .serve("grpc://0.0.0.0:50051")
//!     .await?;
//! # Ok(()) }
//! ```

use std::collections::{BTreeSet, HashMap};
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use rpc_core::prost::Message;
use rpc_core::prost_types::{DescriptorProto, FileDescriptorProto, FileDescriptorSet};
use rpc_core::{Code, Request, Response, Status, Streaming};

/// The generated messages, client and server of `grpc.reflection.v1`.
pub mod v1 {
    #![allow(missing_docs, unreachable_pub, clippy::all)]
    rpc_core::include_proto!("grpc.reflection.v1");
}

/// The generated messages, client and server of `grpc.reflection.v1alpha`.
pub mod v1alpha {
    #![allow(missing_docs, unreachable_pub, clippy::all)]
    rpc_core::include_proto!("grpc.reflection.v1alpha");
}

/// Descriptors of the standard services this crate serves (health,
/// reflection): an encoded `FileDescriptorSet`.
pub const STANDARD_SERVICES: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/standard_services.bin"));

/// Longest request string (a file or symbol name) looked up.
const MAX_NAME: usize = 4096;

/// Collects descriptors; [`build`](ReflectionBuilder::build) makes the service.
#[derive(Debug, Default)]
pub struct ReflectionBuilder {
    files: Vec<FileDescriptorProto>,
    listed: BTreeSet<String>,
}

impl ReflectionBuilder {
    /// Adds the files of an encoded `FileDescriptorSet` (what
    /// `rpc_codegen::Builder::file_descriptor_set_path` writes); their
    /// services are listed.
    pub fn register_encoded_file_descriptor_set(
        mut self,
        encoded: &[u8],
    ) -> Result<Self, rpc_core::prost::DecodeError> {
        let set = FileDescriptorSet::decode(encoded)?;
        for file in set.file {
            for service in &file.service {
                self.listed
                    .insert(qualified(file.package(), service.name()));
            }
            self.files.push(file);
        }
        Ok(self)
    }

    /// Lists `grpc.health.v1.Health` too (add it to the server as well:
    /// [`crate::health`]).
    pub fn with_health(mut self) -> Self {
        self.listed.insert("grpc.health.v1.Health".to_owned());
        self
    }

    /// The service, with the reflection services' own descriptors.
    pub fn build(mut self) -> ReflectionService {
        let standard =
            FileDescriptorSet::decode(STANDARD_SERVICES).expect("descriptors built by this crate");
        self.files.extend(standard.file);
        self.listed
            .insert("grpc.reflection.v1.ServerReflection".to_owned());
        self.listed
            .insert("grpc.reflection.v1alpha.ServerReflection".to_owned());
        ReflectionService {
            index: Arc::new(Index::new(self.files, self.listed)),
        }
    }
}

fn qualified(package: &str, name: &str) -> String {
    if package.is_empty() {
        name.to_owned()
    } else {
        format!("{package}.{name}")
    }
}

/// What the service answers from: files by name, the file of each symbol.
#[derive(Debug)]
struct Index {
    /// Encoded file, and the names of the files it imports.
    files: HashMap<String, (Bytes, Vec<String>)>,
    /// Fully-qualified symbol (message, enum, service, method) → file name.
    symbols: HashMap<String, String>,
    services: Vec<String>,
}

impl Index {
    fn new(files: Vec<FileDescriptorProto>, listed: BTreeSet<String>) -> Index {
        let mut index = Index {
            files: HashMap::new(),
            symbols: HashMap::new(),
            services: listed.into_iter().collect(),
        };
        for file in files {
            let name = file.name().to_owned();
            let package = file.package().to_owned();
            for message in &file.message_type {
                index.add_message(&package, message, &name);
            }
            for enumeration in &file.enum_type {
                index
                    .symbols
                    .insert(qualified(&package, enumeration.name()), name.clone());
            }
            for service in &file.service {
                let service_name = qualified(&package, service.name());
                for method in &service.method {
                    index
                        .symbols
                        .insert(format!("{service_name}.{}", method.name()), name.clone());
                }
                index.symbols.insert(service_name, name.clone());
            }
            let encoded = Bytes::from(file.encode_to_vec());
            index.files.insert(name, (encoded, file.dependency.clone()));
        }
        index
    }

    fn add_message(&mut self, scope: &str, message: &DescriptorProto, file: &str) {
        let name = qualified(scope, message.name());
        for nested in &message.nested_type {
            self.add_message(&name, nested, file);
        }
        for enumeration in &message.enum_type {
            self.symbols
                .insert(qualified(&name, enumeration.name()), file.to_owned());
        }
        self.symbols.insert(name, file.to_owned());
    }

    /// `file`, then every file it imports (transitively), each once.
    fn with_imports(&self, file: &str) -> Option<Vec<Bytes>> {
        self.files.get(file)?;
        let mut seen = BTreeSet::new();
        let mut order = Vec::new();
        let mut pending = vec![file.to_owned()];
        while let Some(name) = pending.pop() {
            if !seen.insert(name.clone()) {
                continue;
            }
            if let Some((encoded, imports)) = self.files.get(&name) {
                order.push(encoded.clone());
                pending.extend(imports.iter().rev().cloned());
            }
        }
        Some(order)
    }
}

/// Server reflection over the registered descriptors (made by
/// [`ReflectionService::builder`]); serve it as [`v1`](Self::v1) and, for
/// older tools, [`v1alpha`](Self::v1alpha).
#[derive(Debug, Clone)]
pub struct ReflectionService {
    index: Arc<Index>,
}

impl ReflectionService {
    /// Starts collecting descriptors.
    pub fn builder() -> ReflectionBuilder {
        ReflectionBuilder::default()
    }

    /// The service as `grpc.reflection.v1.ServerReflection`.
    pub fn v1(&self) -> v1::server_reflection_server::ServerReflectionServer<ReflectionService> {
        v1::server_reflection_server::ServerReflectionServer::new(self.clone())
    }

    /// The service as `grpc.reflection.v1alpha.ServerReflection`.
    pub fn v1alpha(
        &self,
    ) -> v1alpha::server_reflection_server::ServerReflectionServer<ReflectionService> {
        v1alpha::server_reflection_server::ServerReflectionServer::new(self.clone())
    }
}

/// The answer to one request, the same in both versions.
enum Answer {
    Files(Vec<Bytes>),
    Services(Vec<String>),
    Error(Code, String),
}

impl Index {
    fn answer(&self, request: Query<'_>) -> Answer {
        let not_found = |what: String| Answer::Error(Code::NotFound, what);
        match request {
            Query::File(name) if name.len() <= MAX_NAME => match self.with_imports(name) {
                Some(files) => Answer::Files(files),
                None => not_found(format!("no file {name:?}")),
            },
            Query::Symbol(symbol) if symbol.len() <= MAX_NAME => {
                match self
                    .symbols
                    .get(symbol)
                    .and_then(|file| self.with_imports(file))
                {
                    Some(files) => Answer::Files(files),
                    None => not_found(format!("no symbol {symbol:?}")),
                }
            }
            Query::File(_) | Query::Symbol(_) => Answer::Error(
                Code::InvalidArgument,
                format!("name longer than {MAX_NAME} bytes"),
            ),
            Query::Services => Answer::Services(self.services.clone()),
            Query::Extensions => Answer::Error(
                Code::Unimplemented,
                "extensions are not indexed (proto3 services do not use them)".to_owned(),
            ),
            Query::Empty => Answer::Error(Code::InvalidArgument, "empty request".to_owned()),
        }
    }
}

enum Query<'a> {
    File(&'a str),
    Symbol(&'a str),
    Services,
    Extensions,
    Empty,
}

type Responses<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// The same implementation for both versions' generated types.
macro_rules! reflection_version {
    ($version:ident) => {
        impl $version::server_reflection_server::ServerReflection for ReflectionService {
            type ServerReflectionInfoStream = Responses<$version::ServerReflectionResponse>;

            async fn server_reflection_info(
                &self,
                request: Request<Streaming<$version::ServerReflectionRequest>>,
            ) -> Result<Response<Self::ServerReflectionInfoStream>, Status> {
                use $version::server_reflection_request::MessageRequest;
                use $version::server_reflection_response::MessageResponse;
                let index = self.index.clone();
                let responses = request.into_inner().map(move |request| {
                    let request = request?;
                    let query = match &request.message_request {
                        Some(MessageRequest::FileByFilename(name)) => Query::File(name),
                        Some(MessageRequest::FileContainingSymbol(symbol)) => Query::Symbol(symbol),
                        Some(MessageRequest::ListServices(_)) => Query::Services,
                        Some(MessageRequest::FileContainingExtension(_))
                        | Some(MessageRequest::AllExtensionNumbersOfType(_)) => Query::Extensions,
                        None => Query::Empty,
                    };
                    let response = match index.answer(query) {
                        Answer::Files(files) => MessageResponse::FileDescriptorResponse(
                            $version::FileDescriptorResponse {
                                file_descriptor_proto: files,
                            },
                        ),
                        Answer::Services(services) => {
                            MessageResponse::ListServicesResponse($version::ListServiceResponse {
                                service: services
                                    .into_iter()
                                    .map(|name| $version::ServiceResponse { name })
                                    .collect(),
                            })
                        }
                        Answer::Error(code, message) => {
                            MessageResponse::ErrorResponse($version::ErrorResponse {
                                error_code: code as i32,
                                error_message: message,
                            })
                        }
                    };
                    Ok($version::ServerReflectionResponse {
                        valid_host: request.host.clone(),
                        original_request: Some(request),
                        message_response: Some(response),
                    })
                });
                Ok(Response::new(Box::pin(responses)))
            }
        }
    };
}

reflection_version!(v1);
reflection_version!(v1alpha);

#[cfg(test)]
mod tests {
    use super::*;

    fn index() -> Arc<Index> {
        ReflectionService::builder().with_health().build().index
    }

    #[test]
    fn lists_services_and_finds_files_with_their_imports() {
        let index = index();
        let Answer::Services(services) = index.answer(Query::Services) else {
            panic!("a list")
        };
        assert_eq!(
            services,
            [
                "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection"
            ]
        );
        for symbol in [
            "grpc.health.v1.Health",
            "grpc.health.v1.Health.Watch",
            "grpc.health.v1.HealthCheckResponse",
            "grpc.health.v1.HealthCheckResponse.ServingStatus",
        ] {
            let Answer::Files(files) = index.answer(Query::Symbol(symbol)) else {
                panic!("{symbol} not found")
            };
            let file = FileDescriptorProto::decode(&files[0][..]).unwrap();
            assert_eq!(file.name(), "grpc/health/v1/health.proto", "{symbol}");
        }
        assert!(matches!(
            index.answer(Query::Symbol("no.such.Thing")),
            Answer::Error(Code::NotFound, _)
        ));
        assert!(matches!(
            index.answer(Query::File("grpc/reflection/v1/reflection.proto")),
            Answer::Files(files) if files.len() == 1
        ));
        let long = "x".repeat(MAX_NAME + 1);
        assert!(matches!(
            index.answer(Query::File(&long)),
            Answer::Error(Code::InvalidArgument, _)
        ));
    }

    #[test]
    fn a_file_comes_with_every_file_it_imports() {
        let mut user = FileDescriptorProto {
            name: Some("user.proto".into()),
            package: Some("user.v1".into()),
            dependency: vec!["grpc/health/v1/health.proto".into()],
            ..Default::default()
        };
        user.message_type.push(DescriptorProto {
            name: Some("Thing".into()),
            ..Default::default()
        });
        let set = FileDescriptorSet { file: vec![user] };
        let index = ReflectionService::builder()
            .register_encoded_file_descriptor_set(&set.encode_to_vec())
            .unwrap()
            .build()
            .index;
        let Answer::Files(files) = index.answer(Query::Symbol("user.v1.Thing")) else {
            panic!("found")
        };
        let names: Vec<_> = files
            .iter()
            .map(|file| {
                FileDescriptorProto::decode(&file[..])
                    .unwrap()
                    .name()
                    .to_owned()
            })
            .collect();
        assert_eq!(names, ["user.proto", "grpc/health/v1/health.proto"]);
    }
}
