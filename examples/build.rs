//! Generates the example services from the top-level proto/ folder.
//!
//! `bytes` fields become `bytes::Bytes` (rpc-codegen's default), so a payload
//! decoded from a frame that lives in the transport's (registered) memory is
//! a slice of it, not a copy.

fn main() -> std::io::Result<()> {
    rpc_codegen::configure().compile(&["../proto/echo.proto", "../proto/kv.proto"], &["../proto"])
}
