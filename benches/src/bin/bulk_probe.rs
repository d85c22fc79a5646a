//! One contender, payload sizes one after the other (comma-separated), N
//! echoes each, on one connection: for profiling the bulk path.
//!
//! ```text
//! cargo run --release -p rdma-rpc-benches --bin bulk_probe -- rdma 262144,67108864 20
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
    let sizes: Vec<usize> = args
        .next()
        .map(|v| v.split(',').map(|s| s.parse().expect("BYTES")).collect())
        .unwrap_or_else(|| vec![64 << 20]);
    let calls: usize = args.next().and_then(|v| v.parse().ok()).unwrap_or(20);
    let contender = Contender::from_key(&key).expect("contender key");
    let config = rpc_transport_rdma::RdmaConfig::from_env().expect("RDMA_* settings");
    rpc_transport_rdma::register_with(config).expect("register rdma://");
    let (_server, addr) = contenders::spawn_server(contender.key(), contender.poll_mode());
    contenders::runtime().block_on(async move {
        let mut client = Client::connect(contender, &addr).await;
        for size in sizes {
            let payload = bytes::Bytes::from(vec![7u8; size]);
            for _ in 0..3 {
                assert_eq!(client.say(&payload).await, size);
            }
            let faults = minor_faults();
            let started = Instant::now();
            let mut each = Vec::with_capacity(calls);
            for _ in 0..calls {
                let call = Instant::now();
                assert_eq!(client.say(&payload).await, size);
                each.push(call.elapsed());
            }
            let elapsed = started.elapsed();
            each.sort();
            let faults = minor_faults() - faults;
            println!(
                "{key} {size} B × {calls}: {:.2} GB/s both ways, {:.3} ms/call (median {:.3}, max {:.3}), {:.0} minor faults/call (client)",
                (2 * size * calls) as f64 / elapsed.as_secs_f64() / 1e9,
                elapsed.as_secs_f64() * 1e3 / calls as f64,
                each[calls / 2].as_secs_f64() * 1e3,
                each[calls - 1].as_secs_f64() * 1e3,
                faults as f64 / calls as f64
            );
        }
    });
}
