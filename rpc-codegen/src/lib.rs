//! rpc-codegen: `.proto` → Rust, from `build.rs`, with no `protoc` on the machine.
//!
//! [protox](https://docs.rs/protox) parses the files, prost-build generates the
//! messages, and this crate adds, for every service `Foo` in package `pkg`:
//!
//! - `foo_client::FooClient<T>`: one `async fn` per rpc over any tower service
//!   of `rpc_core::Request<rpc_core::Payload>` (usually an `rpc_core::Channel`), and
//!   `FooClient::connect("tcp://host:port")`;
//! - `foo_server::Foo`: the trait you implement with plain `async fn`s, and
//!   `foo_server::FooServer<S>`, the tower service `rpc_core::Server` routes
//!   `/pkg.Foo/Method` to.
//!
//! ```no_run
//! // build.rs
//! fn main() -> std::io::Result<()> {
//!     rpc_codegen::compile_protos("proto/echo.proto")
//! }
//! ```
//! and in the crate: `mod echo { rpc_core::include_proto!("echo.v1"); }`.
//!
//! Every rpc is generated, shaped like tonic's: a server-streaming handler
//! returns `Response<Self::MethodStream>` (an associated type: any `Stream`
//! of `Result<Msg, Status>`), client- and bidirectional-streaming handlers
//! take `Request<rpc_core::Streaming<Msg>>`; clients take
//! `impl IntoStreamingRequest` (any `Stream` of messages) and return
//! `rpc_core::Streaming<Msg>` for streamed responses.
#![forbid(unsafe_code)]

mod diagnostic;
mod generator;

use std::io;
use std::path::{Path, PathBuf};

pub use generator::{ServiceGenerator, client_module, server_module};
/// prost-build, for [`Builder::compile_with_config`] without a direct
/// dependency on it (and at the version rpc-codegen uses).
pub use prost_build;

/// Compiles one `.proto` file, with its own folder as the include path, into `OUT_DIR`.
pub fn compile_protos(proto: impl AsRef<Path>) -> io::Result<()> {
    let proto = proto.as_ref();
    let include = proto
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    configure().compile(&[proto], &[include])
}

/// A [`Builder`] with defaults: client and server, output to `OUT_DIR`.
pub fn configure() -> Builder {
    Builder {
        out_dir: None,
        build_client: true,
        build_server: true,
        emit_rerun_if_changed: true,
        bytes_fields_as_vec: false,
        file_descriptor_set_path: None,
    }
}

/// Options for code generation.
#[derive(Debug, Clone)]
pub struct Builder {
    out_dir: Option<PathBuf>,
    build_client: bool,
    build_server: bool,
    emit_rerun_if_changed: bool,
    bytes_fields_as_vec: bool,
    file_descriptor_set_path: Option<PathBuf>,
}

/// A prost-build configuration for rpc-core: generated messages refer to
/// `::rpc_core::prost`, `::rpc_core::prost_types` (well-known types) and
/// `::rpc_core::prost::bytes`, so a crate using them depends on rpc-core only;
/// every `bytes` field is `bytes::Bytes`. Adjust it (type attributes, field
/// attributes, `Vec<u8>` fields with `config.bytes(std::iter::empty::<&str>())`)
/// and pass it to [`Builder::compile_with_config`]; the `prost_build` crate is
/// re-exported as [`prost_build`] for that, so no direct
/// dependency on it is needed either.
pub fn config() -> prost_build::Config {
    let mut config = prost_build::Config::new();
    config.prost_path("::rpc_core::prost");
    config.prost_types_path("::rpc_core::prost_types");
    config.bytes(["."]);
    config
}

impl Builder {
    /// Where the generated `<package>.rs` files go (default: `OUT_DIR`).
    pub fn out_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.out_dir = Some(dir.into());
        self
    }

    /// Generate `<svc>_client` modules (default true).
    pub fn build_client(mut self, yes: bool) -> Self {
        self.build_client = yes;
        self
    }

    /// Generate `<svc>_server` modules (default true).
    pub fn build_server(mut self, yes: bool) -> Self {
        self.build_server = yes;
        self
    }

    /// Print `cargo:rerun-if-changed` for every input file (default true;
    /// turn it off outside build scripts).
    pub fn emit_rerun_if_changed(mut self, yes: bool) -> Self {
        self.emit_rerun_if_changed = yes;
        self
    }

    /// Generate `Vec<u8>` for protobuf `bytes` fields instead of the default
    /// `bytes::Bytes` (default false). With `Bytes`, a field decoded from a
    /// received frame is a slice of the buffer the transport received it in
    /// (for rdma://, the registered buffer it was READ into), not a copy; and
    /// a large field sent is not copied either: it is a part of the payload
    /// of its own (`rpc_core::codec::PayloadBuf`), which the peer READs where
    /// it lies. With `Vec<u8>`, a large field is copied once when encoded.
    pub fn bytes_fields_as_vec(mut self, yes: bool) -> Self {
        self.bytes_fields_as_vec = yes;
        self
    }

    /// Also write the compiled files, with every file they import, as an
    /// encoded `google.protobuf.FileDescriptorSet` to `path` (what server
    /// reflection serves: `rpc_grpc::reflection`). Typically
    /// `PathBuf::from(env::var("OUT_DIR")?).join("descriptors.bin")`, read
    /// back with `include_bytes!(concat!(env!("OUT_DIR"), "/descriptors.bin"))`.
    pub fn file_descriptor_set_path(mut self, path: impl Into<PathBuf>) -> Self {
        self.file_descriptor_set_path = Some(path.into());
        self
    }

    /// Compiles `protos`, resolving imports against `includes`.
    pub fn compile(
        self,
        protos: &[impl AsRef<Path>],
        includes: &[impl AsRef<Path>],
    ) -> io::Result<()> {
        let mut config = config();
        if self.bytes_fields_as_vec {
            config.bytes(std::iter::empty::<&str>());
        }
        self.compile_with_config(config, protos, includes)
    }

    /// Like [`Builder::compile`], with a prost-build configuration of your own
    /// (type attributes, bytes fields, ...): start from [`config()`], which
    /// makes the generated code refer to prost, prost-types and bytes through
    /// `rpc_core` (so your crate needs no dependency on them) and uses
    /// `bytes::Bytes` for every `bytes` field. A `prost_build::Config::new()`
    /// of your own works too, with prost's defaults (`::prost` paths, which
    /// your crate must then depend on, and `Vec<u8>` fields).
    pub fn compile_with_config(
        self,
        mut config: prost_build::Config,
        protos: &[impl AsRef<Path>],
        includes: &[impl AsRef<Path>],
    ) -> io::Result<()> {
        let descriptors = protox::compile(protos, includes).map_err(|error| {
            let includes: Vec<&Path> = includes.iter().map(AsRef::as_ref).collect();
            io::Error::new(
                io::ErrorKind::InvalidInput,
                diagnostic::ProtoError::new(&error, &includes),
            )
        })?;
        if self.emit_rerun_if_changed {
            for proto in protos {
                println!("cargo:rerun-if-changed={}", proto.as_ref().display());
            }
            for file in &descriptors.file {
                for include in includes {
                    let candidate = include.as_ref().join(file.name());
                    if candidate.exists() {
                        println!("cargo:rerun-if-changed={}", candidate.display());
                    }
                }
            }
        }
        let out_dir = match self.out_dir {
            Some(dir) => dir,
            None => std::env::var_os("OUT_DIR")
                .map(PathBuf::from)
                .ok_or_else(|| {
                    io::Error::other("OUT_DIR is not set: call from build.rs or set out_dir()")
                })?,
        };
        std::fs::create_dir_all(&out_dir)?;
        if let Some(path) = &self.file_descriptor_set_path {
            std::fs::write(path, prost::Message::encode_to_vec(&descriptors))?;
        }
        config.out_dir(out_dir);
        config.service_generator(Box::new(ServiceGenerator::new(
            self.build_client,
            self.build_server,
        )));
        config.compile_fds(descriptors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compiles `main.proto`, which says `text`, from a fresh folder; the
    /// error's text.
    fn compile_error(name: &str, text: &str) -> String {
        let dir =
            std::env::temp_dir().join(format!("rpc-codegen-err-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("main.proto"), text).unwrap();
        let error = configure()
            .out_dir(&dir)
            .emit_rerun_if_changed(false)
            .compile(&[dir.join("main.proto")], &[&dir])
            .expect_err("the file is wrong");
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(error.kind(), io::ErrorKind::InvalidInput);
        // What `fn main() -> io::Result<()>` prints shows the same lines.
        let debug = format!("{error:?}");
        let display = error.to_string();
        assert!(debug.contains(&display), "{debug}");
        display
    }

    #[test]
    fn a_syntax_error_names_its_file_line_and_column_with_a_caret() {
        let text = compile_error(
            "syntax",
            "syntax = \"proto3\";\npackage p;\nmessage M {\n  string name = 1\n}\n",
        );
        assert!(text.starts_with("error: expected ';' or '['"), "{text}");
        assert!(text.contains("main.proto:5:1"), "{text}");
        assert!(text.contains("5 | }"), "{text}");
        assert!(text.contains("  | ^"), "{text}");
    }

    #[test]
    fn a_missing_import_names_the_line_and_the_include_paths_searched() {
        let text = compile_error(
            "import",
            "syntax = \"proto3\";\npackage p;\nimport \"common/types.proto\";\nmessage M {}\n",
        );
        assert!(
            text.contains("import 'common/types.proto' not found"),
            "{text}"
        );
        assert!(text.contains("main.proto:3:1"), "{text}");
        assert!(
            text.contains("3 | import \"common/types.proto\";"),
            "{text}"
        );
        assert!(text.contains("include paths searched: "), "{text}");
        assert!(text.contains("rpc-codegen-err-import"), "{text}");
    }

    #[test]
    fn an_unknown_type_names_its_place() {
        let text = compile_error(
            "type",
            "syntax = \"proto3\";\npackage p;\nmessage M {\n  Missing m = 1;\n}\n",
        );
        assert!(text.contains("main.proto:4:3"), "{text}");
        assert!(text.contains("4 |   Missing m = 1;"), "{text}");
        assert!(text.contains("^^^^^^^"), "{text}");
    }

    /// Generates `blob.proto` into a fresh folder; the generated Rust.
    fn generate(builder: Builder, name: &str) -> String {
        let dir = std::env::temp_dir().join(format!("rpc-codegen-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let proto = dir.join("blob.proto");
        std::fs::write(
            &proto,
            "syntax = \"proto3\";\npackage blob.v1;\nimport \"google/protobuf/timestamp.proto\";\n\
             message Blob { bytes data = 1; google.protobuf.Timestamp at = 2; }\n",
        )
        .unwrap();
        builder
            .out_dir(&dir)
            .emit_rerun_if_changed(false)
            .compile(&[&proto], &[&dir])
            .unwrap();
        let generated = std::fs::read_to_string(dir.join("blob.v1.rs")).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        generated
    }

    #[test]
    fn the_descriptor_set_holds_the_files_and_their_imports() {
        let path = std::env::temp_dir().join(format!("rpc-codegen-fds-{}.bin", std::process::id()));
        generate(configure().file_descriptor_set_path(&path), "fds");
        let encoded = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let set: prost_types::FileDescriptorSet = prost::Message::decode(&encoded[..]).unwrap();
        let names: Vec<_> = set.file.iter().map(|file| file.name()).collect();
        assert!(names.contains(&"blob.proto"), "{names:?}");
        assert!(
            names.contains(&"google/protobuf/timestamp.proto"),
            "{names:?}"
        );
    }

    #[test]
    fn bytes_fields_are_bytes_by_default_and_vec_on_request() {
        let default = generate(configure(), "default");
        assert!(default.contains("bytes::Bytes"), "{default}");
        let vec = generate(configure().bytes_fields_as_vec(true), "vec");
        assert!(vec.contains("::prost::alloc::vec::Vec<u8>"), "{vec}");
        assert!(!vec.contains("bytes::Bytes"), "{vec}");
    }

    /// A user's crate depends on rpc-core only: every path to prost,
    /// prost-types and bytes in generated code goes through it.
    #[test]
    fn generated_code_reaches_prost_through_rpc_core() {
        let generated = generate(configure(), "paths");
        assert!(
            generated.contains("::rpc_core::prost::bytes::Bytes"),
            "{generated}"
        );
        assert!(
            generated.contains("::rpc_core::prost_types::Timestamp"),
            "{generated}"
        );
        assert!(
            generated.contains("derive(Clone, PartialEq, ::rpc_core::prost::Message)")
                || generated.contains("::rpc_core::prost::Message"),
            "{generated}"
        );
        for line in generated.lines() {
            for root in ["::prost::", "::prost_types::", "::bytes::"] {
                let at = line.find(root);
                let through_rpc_core = at.is_some_and(|at| {
                    line[..at].ends_with("rpc_core") || line[..at].ends_with("rpc_core::prost")
                });
                assert!(
                    at.is_none() || through_rpc_core,
                    "{root} outside rpc_core: {line}"
                );
            }
        }
    }
}
