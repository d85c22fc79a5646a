//! rdma-rpc's code for gRPC's standard services (proto/grpc/...), and their
//! descriptors, which the reflection service serves about itself and health.

fn main() -> std::io::Result<()> {
    let out_dir = std::path::PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    rpc_codegen::configure()
        .file_descriptor_set_path(out_dir.join("standard_services.bin"))
        .compile(
            &[
                "proto/grpc/health/v1/health.proto",
                "proto/grpc/reflection/v1/reflection.proto",
                "proto/grpc/reflection/v1alpha/reflection.proto",
            ],
            &["proto"],
        )
}
