//! The physical floors: what the machine itself can do, measured the same way
//! as the soft provider, so a table shows how far above them we are. Used by
//! the benchmarks' `compare` (crate `rdma-rpc-benches`) and by rdma-verbs's
//! `verbs_pingpong` example.
//!
//! Every ping-pong runs between two processes: the binary re-executes itself
//! with [`CHILD_FLAG`] (its `main` hands the arguments after it to
//! [`run_child`]). What the child needs besides its arguments (an eventfd,
//! the shared page's memfd) is handed over as its stdin and stdout, so
//! neither side handles a raw fd number. The shared page and the
//! cross-process read are `rdma_verbs::soft::floors`'s safe types; the rest
//! is rustix and std. No `unsafe` here.

#![forbid(unsafe_code)]

pub mod stats;

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use hdrhistogram::Histogram;
use rdma_verbs::soft::floors::{SharedWords, read_process_memory};
use rustix::event::{EventfdFlags, eventfd};
use rustix::thread::{CpuSet, sched_setaffinity};

use crate::stats::{gbps, histogram, record};

/// Bytes per ping-pong message.
pub const MESSAGE: usize = 64;
/// Bytes copied by the bandwidth floors.
pub const REGION: usize = 64 << 20;

/// Blocks until the eventfd counter is non-zero, and resets it.
fn eventfd_wait(fd: impl AsFd) -> io::Result<u64> {
    let mut value = [0u8; 8];
    match rustix::io::read(fd, &mut value)? {
        8 => Ok(u64::from_ne_bytes(value)),
        n => Err(io::Error::other(format!("eventfd read of {n} bytes"))),
    }
}

/// Adds one to the eventfd counter, waking a reader.
fn eventfd_signal(fd: impl AsFd) -> io::Result<()> {
    match rustix::io::write(fd, &1u64.to_ne_bytes())? {
        8 => Ok(()),
        n => Err(io::Error::other(format!("eventfd write of {n} bytes"))),
    }
}

/// Spins until `word` equals `value`.
fn spin_until(word: &AtomicU64, value: u64) {
    while word.load(Ordering::Acquire) != value {
        std::hint::spin_loop();
    }
}

/// Words of the shared page: the parent's counter, then the child's.
const SPIN_WORDS: usize = 2;

// ---------------------------------------------------------------- measurements

/// 64 B TCP loopback ping-pong with a child process (TCP_NODELAY).
pub fn tcp_ping_pong(rounds: usize) -> Histogram<u64> {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port().to_string();
    let mut peer = child(
        &["tcp", &port, &rounds.to_string()],
        Stdio::piped(),
        Stdio::piped(),
    );
    let (mut stream, _) = listener.accept().expect("accept");
    stream.set_nodelay(true).expect("nodelay");
    let mut buf = [7u8; MESSAGE];
    let mut h = histogram();
    for _ in 0..rounds {
        let start = Instant::now();
        stream.write_all(&buf).expect("write");
        stream.read_exact(&mut buf).expect("read");
        record(&mut h, start.elapsed());
    }
    peer.wait().expect("peer");
    h
}

/// 64 B ping-pong through shared memory + eventfd: both processes block in read().
pub fn eventfd_ping_pong(rounds: usize) -> Histogram<u64> {
    let ping = eventfd(0, EventfdFlags::CLOEXEC).expect("eventfd");
    let pong = eventfd(0, EventfdFlags::CLOEXEC).expect("eventfd");
    // The child waits on `ping` as its stdin and signals `pong` as its stdout.
    let dup = |fd: &OwnedFd| Stdio::from(fd.try_clone().expect("dup eventfd"));
    let mut peer = child(&["eventfd", &rounds.to_string()], dup(&ping), dup(&pong));
    let mut h = histogram();
    for _ in 0..rounds {
        let start = Instant::now();
        eventfd_signal(&ping).expect("signal");
        eventfd_wait(&pong).expect("wait");
        record(&mut h, start.elapsed());
    }
    peer.wait().expect("peer");
    h
}

/// Ping-pong through a shared page, both processes spinning.
pub fn spin_ping_pong(rounds: usize) -> Histogram<u64> {
    let page = SharedWords::create(SPIN_WORDS).expect("shared page");
    // The child maps the page from its stdin.
    let memfd = page.fd().try_clone_to_owned().expect("dup memfd");
    let mut peer = child(
        &["spin", &rounds.to_string()],
        Stdio::from(memfd),
        Stdio::piped(),
    );
    let mut h = histogram();
    for i in 1..=rounds as u64 {
        let start = Instant::now();
        page.word(0).store(i, Ordering::Release);
        spin_until(page.word(1), i);
        record(&mut h, start.elapsed());
    }
    peer.wait().expect("peer");
    h
}

/// Single-thread memcpy of 64 MiB, best of five (GB/s).
pub fn memcpy_gbps() -> f64 {
    let src = vec![1u8; REGION];
    let mut dst = vec![0u8; REGION];
    dst.copy_from_slice(&src);
    let best = (0..5)
        .map(|_| {
            let start = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            start.elapsed()
        })
        .min()
        .expect("runs");
    std::hint::black_box(&dst);
    gbps(REGION as u64, best)
}

/// process_vm_readv of 64 MiB from a child process, best of five (GB/s).
pub fn process_vm_readv_gbps() -> f64 {
    process_vm_readv_gbps_from("vm")
}

/// [`process_vm_readv_gbps`] from memory the child backed with transparent
/// huge pages (as rdma:// does for what peers READ): the soft provider's
/// READ floor for that memory.
pub fn process_vm_readv_huge_gbps() -> f64 {
    process_vm_readv_gbps_from("vm-huge")
}

fn process_vm_readv_gbps_from(mode: &str) -> f64 {
    let mut peer = child(&[mode], Stdio::piped(), Stdio::piped());
    let mut lines = BufReader::new(peer.stdout.take().expect("stdout")).lines();
    let line = lines.next().expect("peer address").expect("line");
    let addr: u64 = line.trim().parse().expect("address");
    let mut local = vec![0u8; REGION];
    read_process_memory(peer.id(), addr, &mut local).expect("process_vm_readv");
    let best = (0..5)
        .map(|_| {
            let start = Instant::now();
            read_process_memory(peer.id(), addr, &mut local).expect("process_vm_readv");
            start.elapsed()
        })
        .min()
        .expect("runs");
    assert!(local.iter().all(|&b| b == 0x5a), "read the peer's bytes");
    drop(peer.stdin.take());
    peer.wait().expect("peer");
    gbps(REGION as u64, best)
}

/// The argument that makes a benchmark binary run [`run_child`] instead.
pub const CHILD_FLAG: &str = "--floor-child";

fn child(args: &[&str], stdin: Stdio, stdout: Stdio) -> Child {
    let mut command = Command::new(std::env::current_exe().expect("own path"));
    command
        .arg(CHILD_FLAG)
        .args(args)
        .stdin(stdin)
        .stdout(stdout);
    pin_child(&mut command);
    command.spawn().expect("spawn peer")
}

// ---------------------------------------------------------------- placement

/// The environment variable that tells a child process which CPU to pin itself to.
const CHILD_CPU_ENV: &str = "RDMA_RPC_BENCH_CPU";
/// The CPU children are pinned to (`usize::MAX`: none).
static CHILD_CPU: AtomicUsize = AtomicUsize::new(usize::MAX);

/// The CPUs online (not the affinity mask: that is what pinning changes),
/// from `/sys/devices/system/cpu/online` (`0-3,5,7-8`), where glibc's
/// `sysconf(_SC_NPROCESSORS_ONLN)` counts them too; where that cannot be
/// read, the first `available_parallelism` CPUs.
fn cpus_online() -> Vec<usize> {
    let parsed = std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|list| parse_cpu_list(list.trim()));
    parsed.unwrap_or_else(|| {
        (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect()
    })
}

/// The CPUs of a kernel CPU list (`0-3,5`), or `None` when it is not one.
fn parse_cpu_list(list: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for range in list.split(',') {
        let (first, last) = range.split_once('-').unwrap_or((range, range));
        let (first, last): (usize, usize) = (first.parse().ok()?, last.parse().ok()?);
        cpus.extend(first..=last);
    }
    (!cpus.is_empty()).then_some(cpus)
}

/// Pins the calling thread to `cpu` (`None`: every online CPU).
fn pin_self(cpu: Option<usize>) -> io::Result<()> {
    let mut set = CpuSet::new();
    for c in cpus_online() {
        if c < CpuSet::MAX_CPU && cpu.is_none_or(|cpu| cpu == c) {
            set.set(c);
        }
    }
    Ok(sched_setaffinity(None, &set)?)
}

/// Places the following two-process measurements: `Some((ours, child))`
/// pins this thread to CPU `ours` and every child spawned from now on to CPU
/// `child` (so each wake-up crosses cores, whatever the scheduler would
/// have chosen); `None` undoes it. False (and nothing pinned) on a machine
/// where either CPU is not online.
pub fn place(cpus: Option<(usize, usize)>) -> bool {
    match cpus {
        Some((ours, child)) => {
            let online = cpus_online();
            if !online.contains(&ours) || !online.contains(&child) || pin_self(Some(ours)).is_err()
            {
                return false;
            }
            CHILD_CPU.store(child, Ordering::Relaxed);
            true
        }
        None => {
            CHILD_CPU.store(usize::MAX, Ordering::Relaxed);
            pin_self(None).is_ok()
        }
    }
}

/// Passes the child placement (see [`place`]) to a child about to be spawned.
pub fn pin_child(command: &mut Command) {
    let cpu = CHILD_CPU.load(Ordering::Relaxed);
    if cpu != usize::MAX {
        command.env(CHILD_CPU_ENV, cpu.to_string());
    }
}

/// In a child: pins the process's main thread (and threads it starts
/// later) to the CPU its parent chose, if any.
pub fn pin_from_env() {
    if let Some(cpu) = std::env::var(CHILD_CPU_ENV)
        .ok()
        .and_then(|cpu| cpu.parse().ok())
    {
        let _ = pin_self(Some(cpu));
    }
}

// ---------------------------------------------------------------- the child

/// A duplicate of this process's stdin or stdout, where the parent put an fd.
fn standard_fd(fd: impl AsFd) -> OwnedFd {
    fd.as_fd().try_clone_to_owned().expect("dup a standard fd")
}

/// The child side of the floors; binaries call it when started with [`CHILD_FLAG`].
pub fn run_child(args: &[String]) {
    let arg = |i: usize| args[i].as_str();
    match arg(0) {
        "tcp" => {
            let rounds: usize = arg(2).parse().expect("rounds");
            let mut stream = TcpStream::connect(format!("127.0.0.1:{}", arg(1))).expect("connect");
            stream.set_nodelay(true).expect("nodelay");
            let mut buf = [0u8; MESSAGE];
            for _ in 0..rounds {
                stream.read_exact(&mut buf).expect("read");
                stream.write_all(&buf).expect("write");
            }
        }
        "eventfd" => {
            let (ping, pong) = (standard_fd(io::stdin()), standard_fd(io::stdout()));
            for _ in 0..arg(1).parse::<usize>().expect("rounds") {
                eventfd_wait(&ping).expect("wait");
                eventfd_signal(&pong).expect("signal");
            }
        }
        "spin" => {
            let page = SharedWords::open(standard_fd(io::stdin()), SPIN_WORDS).expect("map");
            for i in 1..=arg(1).parse::<u64>().expect("rounds") {
                spin_until(page.word(0), i);
                page.word(1).store(i, Ordering::Release);
            }
        }
        mode @ ("vm" | "vm-huge") => {
            let mut region = Vec::with_capacity(REGION);
            if mode == "vm-huge" {
                rdma_verbs::advise_huge_pages(region.spare_capacity_mut());
            }
            region.resize(REGION, 0x5au8);
            println!("{}", region.as_ptr() as u64);
            io::stdout().flush().expect("flush");
            let mut sink = Vec::new();
            let _ = io::stdin().read_to_end(&mut sink);
            std::hint::black_box(&region);
        }
        other => panic!("unknown floor role {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_as_the_kernel_writes_them() {
        assert_eq!(parse_cpu_list("0"), Some(vec![0]));
        assert_eq!(parse_cpu_list("0-3,5,7-8"), Some(vec![0, 1, 2, 3, 5, 7, 8]));
        assert_eq!(parse_cpu_list(""), None);
        assert_eq!(parse_cpu_list("0-x"), None);
        assert!(!cpus_online().is_empty());
    }
}
