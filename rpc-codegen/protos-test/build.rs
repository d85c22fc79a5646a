//! Compiles the test protos (and the top-level example protos) with rpc-codegen.

fn main() -> std::io::Result<()> {
    rpc_codegen::configure().compile(
        &[
            "proto/acme/common/v1/types.proto",
            "proto/acme/inventory/v1/inventory.proto",
            "proto/plain.proto",
            "../../proto/echo.proto",
            "../../proto/kv.proto",
        ],
        &["proto", "../../proto"],
    )
}
