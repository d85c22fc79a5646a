//! The service generator: prost-build calls it once per service.
//!
//! Code is built as tokens ([`client_module`], [`server_module`]) so tests can
//! compare it token by token, then pretty-printed into prost's output.

use proc_macro2::{Ident, Span, TokenStream};
use prost_build::{Comments, Method, Service};
use quote::{format_ident, quote};

/// Implements [`prost_build::ServiceGenerator`] for rdma-rpc clients and servers.
#[derive(Debug, Clone)]
pub struct ServiceGenerator {
    build_client: bool,
    build_server: bool,
}

impl ServiceGenerator {
    /// A generator that emits the client module, the server module, or both.
    pub fn new(build_client: bool, build_server: bool) -> ServiceGenerator {
        ServiceGenerator {
            build_client,
            build_server,
        }
    }
}

impl prost_build::ServiceGenerator for ServiceGenerator {
    fn generate(&mut self, service: Service, buf: &mut String) {
        let mut tokens = TokenStream::new();
        if self.build_client {
            tokens.extend(client_module(&service));
        }
        if self.build_server {
            tokens.extend(server_module(&service));
        }
        let file: syn::File = syn::parse2(tokens).expect("generated code parses");
        buf.push_str(&prettyplease::unparse(&file));
    }
}

/// The four kinds of rpc.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Unary,
    ServerStreaming,
    ClientStreaming,
    Bidi,
}

fn kind(method: &Method) -> Kind {
    match (method.client_streaming, method.server_streaming) {
        (false, false) => Kind::Unary,
        (false, true) => Kind::ServerStreaming,
        (true, false) => Kind::ClientStreaming,
        (true, true) => Kind::Bidi,
    }
}

/// The associated type of the server trait for a method's response stream
/// (`WatchStream` for `Watch`), as tonic names it.
fn stream_type(method: &Method) -> Ident {
    format_ident!("{}Stream", method.proto_name)
}

/// `package.Service`, or `Service` without a package.
fn full_service_name(service: &Service) -> String {
    if service.package.is_empty() {
        service.proto_name.clone()
    } else {
        format!("{}.{}", service.package, service.proto_name)
    }
}

/// `/package.Service/Method`.
fn method_path(service: &Service, method: &Method) -> String {
    format!("/{}/{}", full_service_name(service), method.proto_name)
}

/// An identifier, raw when it is a Rust keyword (`r#type`).
fn ident(name: &str) -> Ident {
    syn::parse_str::<Ident>(name).unwrap_or_else(|_| Ident::new_raw(name, Span::call_site()))
}

/// `snake_case` of a CamelCase service name (`HTTPProxy` → `http_proxy`).
fn snake_case(name: &str) -> String {
    heck::ToSnakeCase::to_snake_case(name)
}

/// The type of a message as seen from inside a generated `*_client`/`*_server`
/// module: prost's paths are relative to the package module, so add `super::`.
fn message_type(rust_type: &str) -> TokenStream {
    let path =
        if rust_type == "()" || rust_type.starts_with("::") || rust_type.starts_with("crate::") {
            rust_type.to_owned()
        } else {
            format!("super::{rust_type}")
        };
    let ty: syn::Type = syn::parse_str(&path).expect("prost type path parses");
    quote!(#ty)
}

/// Proto comments as `#[doc]` attributes. Lines are trimmed (an indented
/// comment line would become a doctest) and brackets escaped (no broken links).
fn doc_attrs(comments: &Comments) -> TokenStream {
    let lines = comments
        .leading
        .iter()
        .chain(comments.trailing.iter())
        .flat_map(|block| block.lines());
    let docs = lines.map(|line| {
        let text = format!(" {}", line.trim().replace('[', "\\[").replace(']', "\\]"));
        quote!(#[doc = #text])
    });
    quote!(#(#docs)*)
}

/// The `<service>_client` module.
pub fn client_module(service: &Service) -> TokenStream {
    let module = format_ident!("{}_client", snake_case(&service.name));
    let client = format_ident!("{}Client", service.name);
    let service_doc = doc_attrs(&service.comments);
    let module_doc = format!(" Client for the `{}` service.", full_service_name(service));
    let methods = service
        .methods
        .iter()
        .map(|method| client_method(service, method));
    quote! {
        #[doc = #module_doc]
        pub mod #module {
            // Like any generated API, not every item is used by every crate.
            #![allow(unused_imports, dead_code, clippy::let_unit_value)]
            use rpc_core::codegen::*;

            #service_doc
            #[derive(Debug, Clone)]
            pub struct #client<T> {
                inner: RpcClient<T>,
            }

            impl #client<Channel> {
                /// Connects to `endpoint` (`tcp://host:port`, `rdma://host:port`, `mem://name`).
                pub async fn connect<D>(endpoint: D) -> Result<Self, Error>
                where
                    D: TryInto<rpc_core::transport::Endpoint>,
                    D::Error: Into<Error>,
                {
                    Ok(Self::new(Channel::connect(endpoint).await?))
                }
            }

            impl<T> #client<T>
            where
                T: Service<Request<Payload>, Response = Response<Bytes>>,
                T::Error: Into<BoxError>,
            {
                /// Wraps a tower service: a `Channel`, or any stack of layers over one.
                pub fn new(inner: T) -> Self {
                    Self { inner: RpcClient::new(inner) }
                }

                /// Wraps `inner` with `interceptor`, which sees every request's
                /// metadata before it is sent and may change it or refuse the
                /// call (see `rpc_core::interceptor`).
                pub fn with_interceptor<F: Interceptor>(
                    inner: T,
                    interceptor: F,
                ) -> #client<InterceptedService<T, F>> {
                    #client::new(InterceptedService::new(inner, interceptor))
                }

                /// The wrapped service.
                pub fn into_inner(self) -> T {
                    self.inner.into_inner()
                }

                #(#methods)*
            }
        }
    }
}

fn client_method(service: &Service, method: &Method) -> TokenStream {
    let name = ident(&method.name);
    let input = message_type(&method.input_type);
    let output = message_type(&method.output_type);
    let path = method_path(service, method);
    let docs = doc_attrs(&method.comments);
    let deprecated = method
        .options
        .deprecated
        .unwrap_or(false)
        .then(|| quote!(#[deprecated]));
    let codec = quote!(let codec: ProstCodec<#input, #output> = ProstCodec::default(););
    let (request, response, body) = match kind(method) {
        Kind::Unary => (
            quote!(impl IntoRequest<#input>),
            quote!(Response<#output>),
            quote!(self.inner.unary(request.into_request(), #path, codec).await),
        ),
        Kind::ServerStreaming => (
            quote!(impl IntoRequest<#input>),
            quote!(Response<Streaming<#output>>),
            quote!(self.inner.server_streaming(request.into_request(), #path, codec).await),
        ),
        Kind::ClientStreaming => (
            quote!(impl IntoStreamingRequest<Message = #input>),
            quote!(Response<#output>),
            quote!(self.inner.client_streaming(request.into_streaming_request(), #path, codec).await),
        ),
        Kind::Bidi => (
            quote!(impl IntoStreamingRequest<Message = #input>),
            quote!(Response<Streaming<#output>>),
            quote!(self.inner.streaming(request.into_streaming_request(), #path, codec).await),
        ),
    };
    quote! {
        #docs
        #deprecated
        pub async fn #name(
            &mut self,
            request: #request,
        ) -> Result<#response, Status> {
            #codec
            #body
        }
    }
}

/// A method of the server trait, with the associated type of its response
/// stream for server- and bidirectional-streaming rpcs.
fn server_trait_method(method: &Method) -> TokenStream {
    let name = ident(&method.name);
    let input = message_type(&method.input_type);
    let output = message_type(&method.output_type);
    let docs = doc_attrs(&method.comments);
    let request = match kind(method) {
        Kind::Unary | Kind::ServerStreaming => quote!(Request<#input>),
        Kind::ClientStreaming | Kind::Bidi => quote!(Request<Streaming<#input>>),
    };
    let (stream_item, response) = match kind(method) {
        Kind::Unary | Kind::ClientStreaming => (None, quote!(Response<#output>)),
        Kind::ServerStreaming | Kind::Bidi => {
            let stream = stream_type(method);
            let doc = format!(
                " The stream of responses [`Self::{}`] returns: any `Stream` (a boxed one, or your own type).",
                method.name
            );
            (
                Some(quote! {
                    #[doc = #doc]
                    type #stream: Stream<Item = Result<#output, Status>> + Send + 'static;
                }),
                quote!(Response<Self::#stream>),
            )
        }
    };
    quote! {
        #stream_item
        #docs
        fn #name(
            &self,
            request: #request,
        ) -> impl Future<Output = Result<#response, Status>> + Send;
    }
}

/// The `<service>_server` module.
pub fn server_module(service: &Service) -> TokenStream {
    let module = format_ident!("{}_server", snake_case(&service.name));
    let trait_name = format_ident!("{}", service.name);
    let server = format_ident!("{}Server", service.name);
    let service_doc = doc_attrs(&service.comments);
    let module_doc = format!(" Server for the `{}` service.", full_service_name(service));
    let full_name = full_service_name(service);
    let trait_methods = service.methods.iter().map(server_trait_method);
    let arms = service.methods.iter().map(|method| {
        let name = ident(&method.name);
        let input = message_type(&method.input_type);
        let output = message_type(&method.output_type);
        let path = method_path(service, method);
        let glue = match kind(method) {
            Kind::Unary => quote!(unary),
            Kind::ServerStreaming => quote!(server_streaming_handler),
            Kind::ClientStreaming => quote!(client_streaming_handler),
            Kind::Bidi => quote!(streaming_handler),
        };
        quote! {
            #path => Box::pin(async move {
                let codec: ProstCodec<#output, #input> = ProstCodec::default();
                #glue(codec, request, |request| async move { inner.#name(request).await }).await
            }),
        }
    });
    quote! {
        #[doc = #module_doc]
        pub mod #module {
            #![allow(unused_imports, unused_variables, dead_code, clippy::let_unit_value)]
            use rpc_core::codegen::*;

            #service_doc
            pub trait #trait_name: Send + Sync + 'static {
                #(#trait_methods)*
            }

            #[doc = concat!(" The tower service that routes `/", #full_name, "/*` calls to a [`", stringify!(#trait_name), "`].")]
            pub struct #server<S> {
                inner: Arc<S>,
            }

            impl<S> #server<S> {
                /// Serves `inner`.
                pub fn new(inner: S) -> Self {
                    Self { inner: Arc::new(inner) }
                }

                /// Serves an implementation that is already shared.
                pub fn from_arc(inner: Arc<S>) -> Self {
                    Self { inner }
                }

                /// Serves `inner`, running `interceptor` on every request's
                /// metadata first; a refusal ends the call before the handler
                /// runs (see `rpc_core::interceptor`).
                pub fn with_interceptor<F: Interceptor>(
                    inner: S,
                    interceptor: F,
                ) -> InterceptedService<Self, F> {
                    InterceptedService::new(Self::new(inner), interceptor)
                }
            }

            impl<S> Clone for #server<S> {
                fn clone(&self) -> Self {
                    Self { inner: self.inner.clone() }
                }
            }

            impl<S> std::fmt::Debug for #server<S> {
                fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str(stringify!(#server))
                }
            }

            impl<S: #trait_name> NamedService for #server<S> {
                const NAME: &'static str = #full_name;
            }

            impl<S: #trait_name> Service<Request<Bytes>> for #server<S> {
                type Response = Response<Payload>;
                type Error = Status;
                type Future = BoxFuture<'static, Result<Response<Payload>, Status>>;

                fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
                    Poll::Ready(Ok(()))
                }

                fn call(&mut self, request: Request<Bytes>) -> Self::Future {
                    let inner = self.inner.clone();
                    match request.method().unwrap_or_default() {
                        #(#arms)*
                        other => {
                            let status = Status::unimplemented(format!("unknown method {other}"));
                            Box::pin(async move { Err(status) })
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn method(name: &str, proto_name: &str, input: &str, output: &str) -> Method {
        Method {
            name: name.into(),
            proto_name: proto_name.into(),
            comments: Comments::default(),
            input_type: input.into(),
            output_type: output.into(),
            input_proto_type: String::new(),
            output_proto_type: String::new(),
            options: Default::default(),
            client_streaming: false,
            server_streaming: false,
        }
    }

    fn service() -> Service {
        let mut say = method("say_hello", "SayHello", "HelloRequest", "HelloReply");
        say.comments.leading = vec![" Says hello [politely].".into(), "    indented".into()];
        let mut watch = method("watch", "Watch", "HelloRequest", "HelloReply");
        watch.server_streaming = true;
        let mut upload = method("upload", "Upload", "HelloRequest", "HelloReply");
        upload.client_streaming = true;
        let mut chat = method("chat", "Chat", "HelloRequest", "HelloReply");
        chat.client_streaming = true;
        chat.server_streaming = true;
        Service {
            name: "Greeter".into(),
            proto_name: "Greeter".into(),
            package: "helloworld.v1".into(),
            comments: Comments::default(),
            methods: vec![
                say,
                watch,
                method("r#type", "Type", "()", "::prost_types::Timestamp"),
                upload,
                chat,
            ],
            options: Default::default(),
        }
    }

    fn same(actual: TokenStream, expected: TokenStream) {
        assert_eq!(actual.to_string(), expected.to_string());
    }

    #[test]
    fn client_method_tokens() {
        let service = service();
        same(
            client_method(&service, &service.methods[0]),
            quote! {
                #[doc = " Says hello \\[politely\\]."]
                #[doc = " indented"]
                pub async fn say_hello(
                    &mut self,
                    request: impl IntoRequest<super::HelloRequest>,
                ) -> Result<Response<super::HelloReply>, Status> {
                    let codec: ProstCodec<super::HelloRequest, super::HelloReply> = ProstCodec::default();
                    self.inner.unary(request.into_request(), "/helloworld.v1.Greeter/SayHello", codec).await
                }
            },
        );
    }

    #[test]
    fn well_known_and_keyword_methods_keep_their_paths() {
        let service = service();
        same(
            client_method(&service, &service.methods[2]),
            quote! {
                pub async fn r#type(
                    &mut self,
                    request: impl IntoRequest<()>,
                ) -> Result<Response<::prost_types::Timestamp>, Status> {
                    let codec: ProstCodec<(), ::prost_types::Timestamp> = ProstCodec::default();
                    self.inner.unary(request.into_request(), "/helloworld.v1.Greeter/Type", codec).await
                }
            },
        );
    }

    #[test]
    fn client_methods_of_the_streaming_kinds() {
        let service = service();
        same(
            client_method(&service, &service.methods[1]),
            quote! {
                pub async fn watch(
                    &mut self,
                    request: impl IntoRequest<super::HelloRequest>,
                ) -> Result<Response<Streaming<super::HelloReply>>, Status> {
                    let codec: ProstCodec<super::HelloRequest, super::HelloReply> = ProstCodec::default();
                    self.inner.server_streaming(request.into_request(), "/helloworld.v1.Greeter/Watch", codec).await
                }
            },
        );
        same(
            client_method(&service, &service.methods[3]),
            quote! {
                pub async fn upload(
                    &mut self,
                    request: impl IntoStreamingRequest<Message = super::HelloRequest>,
                ) -> Result<Response<super::HelloReply>, Status> {
                    let codec: ProstCodec<super::HelloRequest, super::HelloReply> = ProstCodec::default();
                    self.inner.client_streaming(request.into_streaming_request(), "/helloworld.v1.Greeter/Upload", codec).await
                }
            },
        );
        same(
            client_method(&service, &service.methods[4]),
            quote! {
                pub async fn chat(
                    &mut self,
                    request: impl IntoStreamingRequest<Message = super::HelloRequest>,
                ) -> Result<Response<Streaming<super::HelloReply>>, Status> {
                    let codec: ProstCodec<super::HelloRequest, super::HelloReply> = ProstCodec::default();
                    self.inner.streaming(request.into_streaming_request(), "/helloworld.v1.Greeter/Chat", codec).await
                }
            },
        );
    }

    #[test]
    fn server_trait_methods_of_every_kind() {
        let service = service();
        same(
            server_trait_method(&service.methods[1]),
            quote! {
                #[doc = " The stream of responses [`Self::watch`] returns: any `Stream` (a boxed one, or your own type)."]
                type WatchStream: Stream<Item = Result<super::HelloReply, Status>> + Send + 'static;
                fn watch(
                    &self,
                    request: Request<super::HelloRequest>,
                ) -> impl Future<Output = Result<Response<Self::WatchStream>, Status>> + Send;
            },
        );
        same(
            server_trait_method(&service.methods[3]),
            quote! {
                fn upload(
                    &self,
                    request: Request<Streaming<super::HelloRequest>>,
                ) -> impl Future<Output = Result<Response<super::HelloReply>, Status>> + Send;
            },
        );
        let chat = server_trait_method(&service.methods[4]).to_string();
        assert!(
            chat.contains(
                &quote!(
                    type ChatStream: Stream<Item = Result<super::HelloReply, Status>>
                        + Send
                        + 'static;
                )
                .to_string()
            ),
            "{chat}"
        );
        assert!(
            chat.contains(&quote!(request: Request<Streaming<super::HelloRequest>>,).to_string()),
            "{chat}"
        );
        assert!(
            chat.contains(&quote!(Result<Response<Self::ChatStream>, Status>).to_string()),
            "{chat}"
        );
    }

    #[test]
    fn server_trait_and_routing_cover_every_rpc() {
        let service = service();
        let server = server_module(&service).to_string();
        let trait_method = quote! {
            fn say_hello(
                &self,
                request: Request<super::HelloRequest>,
            ) -> impl Future<Output = Result<Response<super::HelloReply>, Status>> + Send;
        }
        .to_string();
        assert!(server.contains(&trait_method), "{server}");
        assert!(server.contains(&quote!(pub trait Greeter: Send + Sync + 'static).to_string()));
        assert!(
            server.contains(
                &quote!(
                    const NAME: &'static str = "helloworld.v1.Greeter";
                )
                .to_string()
            )
        );
        for (path, glue) in [
            ("SayHello", "unary"),
            ("Watch", "server_streaming_handler"),
            ("Upload", "client_streaming_handler"),
            ("Chat", "streaming_handler"),
        ] {
            let arm = format!("\"/helloworld.v1.Greeter/{path}\" =>");
            let at = server
                .find(&arm)
                .unwrap_or_else(|| panic!("no arm for {path}: {server}"));
            let glue_call = format!("{glue} (codec , request");
            assert!(
                server[at..].find(&glue_call).is_some_and(|i| i < 200),
                "{path} is routed through {glue}: {server}"
            );
        }
        let client = client_module(&service).to_string();
        assert!(client.contains(&quote!(pub mod greeter_client).to_string()));
        assert!(client.contains(&quote!(pub struct GreeterClient<T>).to_string()));
        for name in ["say_hello", "watch", "upload", "chat", "r#type"] {
            assert!(
                client.contains(&format!("pub async fn {name}")),
                "{name}: {client}"
            );
        }
    }

    #[test]
    fn generated_modules_parse_as_rust() {
        let service = service();
        syn::parse2::<syn::File>(client_module(&service)).unwrap();
        syn::parse2::<syn::File>(server_module(&service)).unwrap();
    }

    #[test]
    fn names() {
        assert_eq!(snake_case("Greeter"), "greeter");
        assert_eq!(snake_case("KeyValueStore"), "key_value_store");
        assert_eq!(snake_case("HTTPProxy"), "http_proxy");
        assert_eq!(snake_case("V2Api"), "v2_api");
        assert_eq!(
            full_service_name(&Service {
                package: String::new(),
                ..service()
            }),
            "Greeter"
        );
        assert_eq!(ident("type").to_string(), "r#type");
        assert_eq!(ident("get").to_string(), "get");
    }
}
