//! Generates the example services from the top-level proto/ folder.

fn main() -> std::io::Result<()> {
    rpc_codegen::configure().compile(&["../proto/echo.proto", "../proto/kv.proto"], &["../proto"])
}
