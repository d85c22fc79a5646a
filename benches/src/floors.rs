//! The physical floors: what the machine itself can do, measured the same way
//! as the soft provider, so the table shows how far above them we are.
//!
//! This module needs raw OS primitives (eventfd, a shared mapping,
//! process_vm_readv) that the library wraps only inside `verbs/`; the unsafe
//! blocks here are confined to those calls, each with its SAFETY note.

#![allow(unsafe_code)]

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::RawFd;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use hdrhistogram::Histogram;

use crate::stats::{gbps, histogram, record};

/// Bytes per ping-pong message.
pub const MESSAGE: usize = 64;
/// Bytes copied by the bandwidth floors.
pub const REGION: usize = 64 << 20;

/// An eventfd, inheritable by a child process (no CLOEXEC).
pub fn eventfd_inheritable() -> io::Result<RawFd> {
    // SAFETY: no pointers; a negative return is an error.
    let fd = unsafe { libc::eventfd(0, 0) };
    if fd < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(fd)
    }
}

/// Blocks until the eventfd counter is non-zero, and resets it.
pub fn eventfd_wait(fd: RawFd) -> io::Result<u64> {
    let mut value = 0u64;
    // SAFETY: reads 8 bytes into a live u64.
    let n = unsafe { libc::read(fd, (&mut value as *mut u64).cast(), 8) };
    if n == 8 {
        Ok(value)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Adds one to the eventfd counter, waking a reader.
pub fn eventfd_signal(fd: RawFd) -> io::Result<()> {
    let one = 1u64;
    // SAFETY: writes 8 bytes from a live u64.
    let n = unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
    if n == 8 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// One page of memory shared with a child process (memfd, inheritable), seen as two counters.
pub struct SharedPage {
    fd: RawFd,
    page: *mut AtomicU64,
}

// SAFETY: the page is only accessed through atomics.
unsafe impl Send for SharedPage {}

impl SharedPage {
    /// Creates the memfd and maps it.
    pub fn create() -> io::Result<SharedPage> {
        let name = c"rdma-rpc-floor";
        // SAFETY: a valid NUL-terminated name; no CLOEXEC so a child inherits it.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: resizing our own new memfd.
        if unsafe { libc::ftruncate(fd, 4096) } != 0 {
            return Err(io::Error::last_os_error());
        }
        SharedPage::map(fd)
    }

    /// Maps an inherited memfd.
    pub fn map(fd: RawFd) -> io::Result<SharedPage> {
        // SAFETY: maps one page of a memfd that is at least one page long.
        let page = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if page == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(SharedPage {
            fd,
            page: page.cast(),
        })
    }

    /// The memfd number (to pass to the child).
    pub fn fd(&self) -> RawFd {
        self.fd
    }

    /// Counter `index` (0 or 1).
    pub fn counter(&self, index: usize) -> &AtomicU64 {
        assert!(index < 2);
        // SAFETY: the mapping is 4096 bytes, page-aligned, alive as long as
        // `self`; AtomicU64 has no invalid bit patterns.
        unsafe { &*self.page.add(index * 8) }
    }

    /// Spins until counter `index` equals `value`.
    pub fn spin_until(&self, index: usize, value: u64) {
        while self.counter(index).load(Ordering::Acquire) != value {
            std::hint::spin_loop();
        }
    }
}

/// Copies `len` bytes at `remote` in process `pid` into `local` (one call, looping on short reads).
pub fn process_vm_read(pid: u32, remote: u64, local: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < local.len() {
        let local_iov = libc::iovec {
            iov_base: local[done..].as_mut_ptr().cast(),
            iov_len: local.len() - done,
        };
        let remote_iov = libc::iovec {
            iov_base: (remote as usize + done) as *mut libc::c_void,
            iov_len: local.len() - done,
        };
        // SAFETY: one iovec each, both valid for their lengths in their processes
        // (the kernel checks the remote one).
        let n =
            unsafe { libc::process_vm_readv(pid as libc::pid_t, &local_iov, 1, &remote_iov, 1, 0) };
        if n <= 0 {
            return Err(io::Error::last_os_error());
        }
        done += n as usize;
    }
    Ok(())
}

// ---------------------------------------------------------------- measurements

/// 64 B TCP loopback ping-pong with a child process (TCP_NODELAY).
pub fn tcp_ping_pong(rounds: usize) -> Histogram<u64> {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port().to_string();
    let mut peer = child(&["tcp", &port, &rounds.to_string()]);
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
    let ping = eventfd_inheritable().expect("eventfd");
    let pong = eventfd_inheritable().expect("eventfd");
    let mut peer = child(&[
        "eventfd",
        &ping.to_string(),
        &pong.to_string(),
        &rounds.to_string(),
    ]);
    let mut h = histogram();
    for _ in 0..rounds {
        let start = Instant::now();
        eventfd_signal(ping).expect("signal");
        eventfd_wait(pong).expect("wait");
        record(&mut h, start.elapsed());
    }
    peer.wait().expect("peer");
    h
}

/// Ping-pong through a shared page, both processes spinning.
pub fn spin_ping_pong(rounds: usize) -> Histogram<u64> {
    let page = SharedPage::create().expect("shared page");
    let mut peer = child(&["spin", &page.fd().to_string(), &rounds.to_string()]);
    let mut h = histogram();
    for i in 1..=rounds as u64 {
        let start = Instant::now();
        page.counter(0).store(i, Ordering::Release);
        page.spin_until(1, i);
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
    let mut peer = child(&[mode]);
    let mut lines = BufReader::new(peer.stdout.take().expect("stdout")).lines();
    let line = lines.next().expect("peer address").expect("line");
    let addr: u64 = line.trim().parse().expect("address");
    let mut local = vec![0u8; REGION];
    process_vm_read(peer.id(), addr, &mut local).expect("process_vm_readv");
    let best = (0..5)
        .map(|_| {
            let start = Instant::now();
            process_vm_read(peer.id(), addr, &mut local).expect("process_vm_readv");
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

fn child(args: &[&str]) -> Child {
    let mut command = Command::new(std::env::current_exe().expect("own path"));
    command
        .arg(CHILD_FLAG)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    pin_child(&mut command);
    command.spawn().expect("spawn peer")
}

/// The environment variable that tells a child process which CPU to pin itself to.
const CHILD_CPU_ENV: &str = "RDMA_RPC_BENCH_CPU";
/// The CPU children are pinned to (`usize::MAX`: none).
static CHILD_CPU: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(usize::MAX);

/// CPUs online (not the affinity mask: that is what pinning changes).
fn cpus_online() -> usize {
    // SAFETY: sysconf takes no pointers.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(n).unwrap_or(1).max(1)
}

/// Pins the calling thread to `cpu` (`None`: every online CPU).
fn pin_self(cpu: Option<usize>) -> io::Result<()> {
    // SAFETY: an all-zero cpu_set_t is the empty set; CPU_SET writes inside it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for c in 0..cpus_online() {
        if cpu.is_none_or(|cpu| cpu == c) {
            // SAFETY: c < CPU_SETSIZE on any machine this runs on.
            unsafe { libc::CPU_SET(c, &mut set) };
        }
    }
    // SAFETY: a valid set of the size given, for the calling thread (0).
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Places the following two-process measurements: `Some((ours, child))`
/// pins this thread to CPU `ours` and every child spawned from now on to CPU
/// `child` (so each wake-up crosses cores, whatever the scheduler would
/// have chosen); `None` undoes it. False (and nothing pinned) on a machine
/// with fewer CPUs than named.
pub fn place(cpus: Option<(usize, usize)>) -> bool {
    let available = cpus_online();
    match cpus {
        Some((ours, child)) if ours.max(child) < available => {
            if pin_self(Some(ours)).is_err() {
                return false;
            }
            CHILD_CPU.store(child, Ordering::Relaxed);
            true
        }
        Some(_) => false,
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
            let (ping, pong): (RawFd, RawFd) =
                (arg(1).parse().expect("fd"), arg(2).parse().expect("fd"));
            for _ in 0..arg(3).parse::<usize>().expect("rounds") {
                eventfd_wait(ping).expect("wait");
                eventfd_signal(pong).expect("signal");
            }
        }
        "spin" => {
            let page = SharedPage::map(arg(1).parse().expect("fd")).expect("map");
            for i in 1..=arg(2).parse::<u64>().expect("rounds") {
                page.spin_until(0, i);
                page.counter(1).store(i, Ordering::Release);
            }
        }
        mode @ ("vm" | "vm-huge") => {
            let mut region = Vec::with_capacity(REGION);
            if mode == "vm-huge" {
                rpc_transport_rdma::verbs::advise_huge_pages(region.spare_capacity_mut());
            }
            region.resize(REGION, 0x5au8);
            println!("{}", region.as_ptr() as u64);
            std::io::stdout().flush().expect("flush");
            let mut sink = Vec::new();
            let _ = std::io::stdin().read_to_end(&mut sink);
            std::hint::black_box(&region);
        }
        other => panic!("unknown floor role {other}"),
    }
}

/// CPU time this process has used so far (all threads).
pub fn process_cpu_time() -> std::time::Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes one timespec we own.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut now) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_PROCESS_CPUTIME_ID)");
    std::time::Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}
