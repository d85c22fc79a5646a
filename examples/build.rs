//! Generates the example services from the top-level proto/ folder.
//!
//! `bytes` fields become `bytes::Bytes`, so a payload decoded from a frame
//! that lives in the transport's (registered) memory is a slice of it, not a
//! copy.

fn main() -> std::io::Result<()> {
    let mut config = prost_build::Config::new();
    config.bytes(["."]);
    rpc_codegen::configure().compile_with_config(
        config,
        &["../proto/echo.proto", "../proto/kv.proto"],
        &["../proto"],
    )
}
