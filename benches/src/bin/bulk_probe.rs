//! One contender, one payload size, N echoes: for profiling the bulk path.
//!
//! ```text
//! cargo run --release -p rdma-rpc-benches --bin bulk_probe -- rdma 67108864 20
//! ```
//! The server runs in a child process (this benchmark suite's `compare
//! --serve`); prints GB/s both ways and minor page faults per call.

use std::time::Instant;

use rdma_rpc_benches::contenders::{self, Client, Contender};
use rdma_rpc_benches::stats::minor_faults;

fn main() {
    let mut args = std::env::args().skip(1);
    let key = args.next().unwrap_or_else(|| "rdma".into());
    if key == "--serve" {
        let key = args.next().expect("--serve CONTENDER");
        contenders::serve(Contender::from_key(&key).expect("contender key"));
        return;
    }
    let size: usize = args.next().and_then(|v| v.parse().ok()).unwrap_or(64 << 20);
    let calls: usize = args.next().and_then(|v| v.parse().ok()).unwrap_or(20);
    let contender = Contender::from_key(&key).expect("contender key");
    let config = rpc_transport_rdma::RdmaConfig::from_env().expect("RDMA_* settings");
    rpc_transport_rdma::register_with(config).expect("register rdma://");
    let (_server, addr) = contenders::spawn_server(contender.key(), contender.poll_mode());
    contenders::runtime().block_on(async move {
        let mut client = Client::connect(contender, &addr).await;
        let payload = bytes::Bytes::from(vec![7u8; size]);
        for _ in 0..3 {
            assert_eq!(client.say(&payload).await, size);
        }
        let faults = minor_faults();
        let started = Instant::now();
        for _ in 0..calls {
            assert_eq!(client.say(&payload).await, size);
        }
        let elapsed = started.elapsed();
        let faults = minor_faults() - faults;
        println!(
            "{key} {size} B × {calls}: {:.2} GB/s both ways, {:.1} ms/call, {:.0} minor faults/call (client)",
            (2 * size * calls) as f64 / elapsed.as_secs_f64() / 1e9,
            elapsed.as_secs_f64() * 1e3 / calls as f64,
            faults as f64 / calls as f64
        );
    });
}
