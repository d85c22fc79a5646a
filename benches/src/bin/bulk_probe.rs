//! One contender, payload sizes one after the other (comma-separated), N
//! echoes each, on one connection: for profiling the bulk path.
//!
//! ```text
//! cargo run --release -p rdma-rpc-benches --bin bulk_probe -- rdma 262144,67108864 20
//! ```
//! The server runs in a child process (this binary again, with `--serve`);
//! prints GB/s both ways and minor page faults per call.

#![forbid(unsafe_code)]

use std::time::Instant;

use rdma_rpc_benches::contenders::{self, Client, Contender};
use rdma_rpc_benches::stats::minor_faults;

/// Payload sizes in bytes, from a comma-separated list (`262144,67108864`).
#[derive(Debug, Clone)]
struct Sizes(Vec<usize>);

impl std::str::FromStr for Sizes {
    type Err = std::num::ParseIntError;

    fn from_str(list: &str) -> Result<Sizes, Self::Err> {
        list.split(',')
            .map(str::parse)
            .collect::<Result<_, _>>()
            .map(Sizes)
    }
}

/// One contender, payload sizes one after the other, N echoes each, on one
/// connection: for profiling the bulk path.
///
/// The server runs in a child process (this binary again, with `--serve`);
/// prints GB/s both ways and minor page faults per call for each size.
#[derive(Debug, clap::Parser)]
#[command(name = "bulk_probe", args_override_self = true)]
struct Cli {
    /// The contender to measure.
    #[arg(value_name = "CONTENDER", default_value = "rdma")]
    contender: Contender,
    /// Payload sizes in bytes, comma-separated, measured one after the other.
    #[arg(value_name = "BYTES", default_value = "67108864")]
    sizes: Sizes,
    /// Echoes per size (at least 1).
    #[arg(value_name = "CALLS", default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    calls: u32,
    /// Internal: serve CONTENDER and print `LISTENING <address>` (the
    /// server process this binary starts).
    #[arg(long, value_name = "CONTENDER", hide = true, exclusive = true)]
    serve: Option<Contender>,
}

fn main() {
    let cli = <Cli as clap::Parser>::parse();
    if let Some(contender) = cli.serve {
        contenders::serve(contender);
        return;
    }
    let contender = cli.contender;
    let key = contender.key();
    let Sizes(sizes) = cli.sizes;
    let calls = cli.calls as usize;
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
