//! Generates the example services from the top-level proto/ folder.
//!
//! `bytes` fields become `bytes::Bytes` (rpc-codegen's default), so a payload
//! decoded from a frame that lives in the transport's (registered) memory is
//! a slice of it, not a copy.

fn main() -> std::io::Result<()> {
    // The descriptors too: the grpc example serves them by reflection.
    let out_dir = std::path::PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    rpc_codegen::configure()
        .file_descriptor_set_path(out_dir.join("descriptors.bin"))
        .compile(
            &[
                "../proto/echo.proto",
                "../proto/kv.proto",
                "../proto/streams.proto",
                "../proto/cross_host.proto",
            ],
            &["../proto"],
        )
}
