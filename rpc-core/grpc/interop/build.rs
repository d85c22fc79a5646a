//! Both frameworks' code for proto/interop.proto, each in its own folder of
//! OUT_DIR, compiled without protoc (protox parses the file for tonic).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    let descriptors = protox::compile(["interop.proto"], ["proto"])?;
    let tonic_dir = out_dir.join("tonic");
    std::fs::create_dir_all(&tonic_dir)?;
    tonic_prost_build::configure()
        .bytes(".")
        .out_dir(&tonic_dir)
        .compile_fds(descriptors)?;
    let rpc_dir = out_dir.join("rdma-rpc");
    std::fs::create_dir_all(&rpc_dir)?;
    rpc_codegen::configure()
        .out_dir(&rpc_dir)
        .file_descriptor_set_path(out_dir.join("interop_descriptors.bin"))
        .compile(&["proto/interop.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto/interop.proto");
    Ok(())
}
