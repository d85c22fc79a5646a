//! tonic's code for proto/echo.proto, the same file rdma-rpc's examples use,
//! and both frameworks' code for benches/proto/stream_bench.proto (each in
//! its own folder of OUT_DIR), compiled without protoc (protox parses them).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    let descriptors = protox::compile(["echo.proto"], ["../proto"])?;
    // `bytes` fields as `Bytes`, as in rdma-rpc's examples: each framework
    // gets its cheapest payload type.
    tonic_prost_build::configure()
        .bytes(".")
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    let streams = protox::compile(["stream_bench.proto"], ["proto"])?;
    let tonic_dir = out_dir.join("tonic");
    std::fs::create_dir_all(&tonic_dir)?;
    tonic_prost_build::configure()
        .bytes(".")
        .out_dir(&tonic_dir)
        .compile_fds(streams)?;
    let rpc_dir = out_dir.join("rdma-rpc");
    std::fs::create_dir_all(&rpc_dir)?;
    rpc_codegen::configure()
        .out_dir(&rpc_dir)
        .compile(&["proto/stream_bench.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=../proto/echo.proto");
    println!("cargo:rerun-if-changed=proto/stream_bench.proto");
    Ok(())
}
