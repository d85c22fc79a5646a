//! tonic's code for proto/echo.proto, the same file rdma-rpc's examples use,
//! compiled without protoc (protox parses it).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let descriptors = protox::compile(["echo.proto"], ["../proto"])?;
    // `bytes` fields as `Bytes`, as in rdma-rpc's examples: each framework
    // gets its cheapest payload type.
    tonic_prost_build::configure()
        .bytes(".")
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    println!("cargo:rerun-if-changed=../proto/echo.proto");
    Ok(())
}
