//! rdma-rpc's client code for the part of etcd's v3 API that discovery uses
//! (`proto/etcd/`).

fn main() -> std::io::Result<()> {
    rpc_codegen::configure().compile(&["proto/etcd/rpc.proto"], &["proto"])
}
