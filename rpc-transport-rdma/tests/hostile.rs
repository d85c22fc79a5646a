//! Hostile local peers against an `rdma://` server on the soft provider.
//!
//! Each test plays an attacker who speaks the documented set-up protocol
//! (the TCP hello of `setup.rs`, then the soft device's Unix-socket
//! handshake of `verbs/soft/mod.rs`) against a server running in a child
//! process (so a crash shows as a dead child, not a dead test), and then
//! proves that the server still serves a normal client.
//!
//! Attacks on the soft provider pass memfds over the Unix socket
//! (`memfd_create`, seals, `sendmsg` with `SCM_RIGHTS`), through rustix's
//! safe calls.
#![forbid(unsafe_code)]

#[path = "../../rpc-core/tests/suite/mod.rs"]
mod suite;

mod common;

use std::io::IoSlice;
use std::io::Read;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rpc_core::Channel;
use rpc_transport_rdma::protocol::{Geometry, PROTOCOL_VERSION};
use rpc_transport_rdma::verbs::QpAddress;
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::{RdmaBed, ensure_registered, strict_config};
use crate::suite::{ChildServer, probe, start_with};

const SERVER_ENV: &str = "RDMA_HOSTILE_SERVER";
const CLIENT_ENV: &str = "RDMA_HOSTILE_CLIENT";
const NOBODY_ENV: &str = "RDMA_HOSTILE_NOBODY";
const NOBODY_BURST_ENV: &str = "RDMA_HOSTILE_NOBODY_BURST";
/// Connections of another user's burst: more than the soft acceptor keeps
/// waiting for their handshake (64), fewer than the shortest listen queue
/// the acceptor has had (128, std's default).
const BURST: usize = 100;
/// Connections the soft acceptor keeps waiting for their handshake at once
/// (`MAX_PENDING_HANDSHAKES` in `verbs/src/soft/mod.rs`).
const PENDING_HANDSHAKES: usize = 64;

/// Not a test by itself: the echo server the attacks aim at, in a child process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper process for the hostile-peer tests"]
async fn hostile_child_server() {
    if std::env::var_os(SERVER_ENV).is_none() {
        return;
    }
    let server = start_with(&RdmaBed, |s| s).await;
    println!("LISTENING {}", server.endpoint);
    std::future::pending::<()>().await;
}

/// Not a test by itself: a normal client in its own process (so its pid is
/// above the server's and it dials the server's soft device, through the
/// acceptor an attacker tries to hold). Prints `LISTENING OK` after 50
/// calls, each within a 2 s deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper process for the hostile-peer tests"]
async fn hostile_child_client() {
    let Ok(endpoint) = std::env::var(CLIENT_ENV) else {
        return;
    };
    ensure_registered();
    let channel = Channel::builder(endpoint.parse().unwrap())
        .timeout(Duration::from_secs(2))
        .connect()
        .await
        .expect("connect within the set-up time-out");
    for i in 0..50u32 {
        let payload = Bytes::from(i.to_le_bytes().to_vec());
        let reply = channel
            .unary(probe("Echo", payload.clone()))
            .await
            .expect("echo within its deadline");
        assert_eq!(reply.into_inner(), payload);
    }
    println!("LISTENING OK");
}

const FEW_FDS_ENV: &str = "RDMA_HOSTILE_FEW_FDS";

/// Not a test by itself: the echo server of
/// [`connections_beyond_the_descriptor_limit_are_refused_with_the_reason`],
/// with a soft `RLIMIT_NOFILE` of 256.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper process for the hostile-peer tests"]
async fn hostile_child_few_fds() {
    if std::env::var(FEW_FDS_ENV).is_err() {
        return;
    }
    let hard = rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum;
    rustix::process::setrlimit(
        rustix::process::Resource::Nofile,
        rustix::process::Rlimit {
            current: Some(256),
            maximum: hard,
        },
    )
    .unwrap();
    let server = crate::suite::start(&RdmaBed).await;
    println!("LISTENING {}", server.endpoint);
    std::future::pending::<()>().await;
}

/// Not a test by itself: sends a soft handshake with a 0-byte memfd as
/// whatever user runs it (the tests run it as `nobody`); prints the reply.
#[test]
#[ignore = "helper process for the hostile-peer tests"]
fn hostile_child_nobody() {
    let Ok(args) = std::env::var(NOBODY_ENV) else {
        return;
    };
    let target: ServerQp = args.parse().unwrap();
    let reply = match UnixStream::connect_addr(&target.socket_name()) {
        Ok(stream) => {
            let fd = memfd(0, false);
            let handshake = target.handshake(std::process::id(), target.secret);
            // The server may refuse us (and close) before we send a thing:
            // the send may fail, the reply is still there to read.
            let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            let fds = [fd.as_fd()];
            assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
            let _ = rustix::net::sendmsg(
                &stream,
                &[IoSlice::new(&handshake)],
                &mut control,
                SendFlags::NOSIGNAL,
            );
            read_reply(&stream)
        }
        Err(error) => format!("connect failed: {error}"),
    };
    println!("LISTENING {reply}");
}

/// Not a test by itself: opens [`BURST`] connections to the soft socket
/// named in the environment (non-blocking: those the listen queue has no
/// room for fail), says nothing on them, prints how many it opened and
/// holds them until killed. The tests run it as `nobody`.
#[test]
#[ignore = "helper process for the hostile-peer tests"]
fn hostile_child_nobody_burst() {
    let Ok(args) = std::env::var(NOBODY_BURST_ENV) else {
        return;
    };
    let target: ServerQp = args.parse().unwrap();
    let name = target.socket_name();
    let held: Vec<OwnedFd> = (0..BURST)
        .filter_map(|_| {
            use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
            let fd = rustix::net::socket_with(
                AddressFamily::UNIX,
                SocketType::STREAM,
                SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
                None,
            )
            .ok()?;
            let name = name.as_abstract_name()?;
            let addr = SocketAddrUnix::new_abstract_name(name).ok()?;
            rustix::net::connect(&fd, &addr).ok()?;
            Some(fd)
        })
        .collect();
    println!("LISTENING {}", held.len());
    loop {
        std::thread::sleep(Duration::from_secs(60));
    }
}

// ------------------------------------------------------------------ the bed

/// The server in its child process, with a normal client of the test's own.
struct Target {
    child: ChildServer,
    normal: Channel,
}

impl Target {
    async fn start() -> Target {
        ensure_registered();
        let child = ChildServer::spawn("hostile_child_server", SERVER_ENV);
        let normal = Channel::builder(child.endpoint.parse().unwrap())
            .timeout(Duration::from_secs(2))
            .connect()
            .await
            .unwrap();
        assert_serves(&normal).await;
        Target { child, normal }
    }

    fn addr(&self) -> String {
        self.child.endpoint.trim_start_matches("rdma://").to_owned()
    }

    /// The server process is alive and answers the normal client and a
    /// client that connects now.
    async fn assert_still_serving(&mut self) {
        assert!(self.child.is_running(), "the server process died");
        assert_serves(&self.normal).await;
        let fresh = Channel::builder(self.child.endpoint.parse().unwrap())
            .timeout(Duration::from_secs(2))
            .connect()
            .await
            .expect("a new client connects");
        assert_serves(&fresh).await;
    }
}

async fn assert_serves(channel: &Channel) {
    for i in 0..20u8 {
        let payload = Bytes::from(vec![i; 100 + usize::from(i) * 997]);
        let reply = channel
            .unary(probe("Echo", payload.clone()))
            .await
            .expect("the server answers");
        assert_eq!(reply.into_inner(), payload);
    }
}

/// What the server's hello says about its soft QP.
#[derive(Debug, Clone, Copy)]
struct ServerQp {
    pid: u32,
    context: u64,
    qp_num: u32,
    secret: [u8; 16],
}

impl ServerQp {
    fn from_address(address: &QpAddress) -> ServerQp {
        assert_eq!(
            address.extra.len(),
            28,
            "soft address: pid, context, secret"
        );
        ServerQp {
            pid: u32::from_le_bytes(address.extra[..4].try_into().unwrap()),
            context: u64::from_le_bytes(address.extra[4..12].try_into().unwrap()),
            qp_num: address.qp_num,
            secret: address.extra[12..28].try_into().unwrap(),
        }
    }

    fn socket_name(&self) -> SocketAddr {
        SocketAddr::from_abstract_name(format!("rdma-rpc-soft.{}.{}", self.pid, self.context))
            .unwrap()
    }

    /// The dialer's handshake (`verbs/soft/mod.rs`, `Handshake`), no wakers.
    fn handshake(&self, claimed_pid: u32, secret: [u8; 16]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&self.qp_num.to_le_bytes());
        out.extend_from_slice(&7u32.to_le_bytes());
        out.extend_from_slice(&claimed_pid.to_le_bytes());
        out.extend_from_slice(&9u64.to_le_bytes());
        out.extend_from_slice(&secret);
        out.push(0);
        out
    }
}

impl std::str::FromStr for ServerQp {
    type Err = String;
    fn from_str(text: &str) -> Result<ServerQp, String> {
        let parts: Vec<&str> = text.split(':').collect();
        let [pid, context, qp_num, secret] = parts[..] else {
            return Err(text.into());
        };
        let secret: Vec<u8> = (0..16)
            .map(|i| u8::from_str_radix(&secret[2 * i..2 * i + 2], 16).unwrap())
            .collect();
        Ok(ServerQp {
            pid: pid.parse().unwrap(),
            context: context.parse().unwrap(),
            qp_num: qp_num.parse().unwrap(),
            secret: secret.try_into().unwrap(),
        })
    }
}

impl std::fmt::Display for ServerQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secret: String = self.secret.iter().map(|b| format!("{b:02x}")).collect();
        write!(f, "{}:{}:{}:{secret}", self.pid, self.context, self.qp_num)
    }
}

/// Starts the set-up exchange as the documented protocol has it, claiming
/// `claimed_pid`/`context`/`qp_num` for our QP, and returns the open TCP
/// stream with what the server's hello said. The server then waits (up to
/// its set-up time-out) for the QPs to connect.
async fn begin_setup(
    addr: &str,
    claimed_pid: u32,
    context: u64,
    qp_num: u32,
) -> (TcpStream, ServerQp) {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let mut extra = Vec::new();
    extra.extend_from_slice(&claimed_pid.to_le_bytes());
    extra.extend_from_slice(&context.to_le_bytes());
    extra.extend_from_slice(&[0x5a; 16]);
    let address = QpAddress {
        qp_num,
        psn: 0,
        lid: 0,
        gid: [0; 16],
        mtu: 4096,
        extra,
    }
    .to_bytes();
    let config = strict_config();
    let geometry = Geometry {
        recv_slots: config.recv_slots,
        initial_credits: config.initial_credits,
        slot_len: config.slot_len() as u32,
        eager_threshold: config.eager_threshold,
        max_frame_len: 4 << 20,
    };
    let host = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    let host = host.trim();
    let mut payload = vec![PROTOCOL_VERSION];
    payload.extend_from_slice(&geometry.encode());
    payload.push(0); // no rdma_cm
    payload.extend_from_slice(&0u16.to_le_bytes());
    payload.extend_from_slice(&0u64.to_le_bytes());
    payload.push(host.len() as u8);
    payload.extend_from_slice(host.as_bytes());
    let mut body = b"RRPC".to_vec();
    body.extend_from_slice(&1u16.to_le_bytes());
    body.push(4);
    body.extend_from_slice(b"soft");
    body.extend_from_slice(&(address.len() as u32).to_le_bytes());
    body.extend_from_slice(&address);
    body.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    body.extend_from_slice(&payload);
    tcp.write_all(&(body.len() as u32).to_le_bytes())
        .await
        .unwrap();
    tcp.write_all(&body).await.unwrap();
    let len = tcp.read_u32_le().await.unwrap() as usize;
    let mut hello = vec![0u8; len];
    tcp.read_exact(&mut hello).await.unwrap();
    let provider_len = hello[6] as usize;
    let at = 7 + provider_len;
    let address_len = u32::from_le_bytes(hello[at..at + 4].try_into().unwrap()) as usize;
    let address = QpAddress::from_bytes(&hello[at + 4..at + 4 + address_len]).unwrap();
    (tcp, ServerQp::from_address(&address))
}

/// A memfd of `len` bytes, sealed against shrinking or not.
fn memfd(len: usize, sealed: bool) -> OwnedFd {
    let sealing = if sealed {
        MemfdFlags::ALLOW_SEALING
    } else {
        MemfdFlags::empty()
    };
    let fd = rustix::fs::memfd_create(c"attack", MemfdFlags::CLOEXEC | sealing).unwrap();
    rustix::fs::ftruncate(&fd, len as u64).unwrap();
    if sealed {
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).unwrap();
    }
    fd
}

/// Bytes of the soft wire's shared rings (both directions, control blocks included).
const RING_MAPPING: usize = 2 * (256 + (4 << 20));

fn send_with_fds(socket: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
    let sent = rustix::net::sendmsg(
        socket,
        &[IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    );
    assert_eq!(sent, Ok(bytes.len()));
}

/// The attacks' fds really travel: what `send_with_fds` sends arrives as
/// the bytes plus the memfds, in order (else every refusal above could be
/// a refusal of a handshake without fds).
#[test]
fn the_attackers_handshakes_carry_their_fds() {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    let (ours, theirs) = UnixStream::pair().unwrap();
    let (small, large) = (memfd(4096, true), memfd(RING_MAPPING, false));
    send_with_fds(&ours, b"hello", &[small.as_fd(), large.as_fd()]);
    let mut bytes = [0u8; 16];
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let received = rustix::net::recvmsg(
        &theirs,
        &mut [std::io::IoSliceMut::new(&mut bytes)],
        &mut control,
        RecvFlags::empty(),
    )
    .unwrap();
    assert_eq!(&bytes[..received.bytes], b"hello");
    let fds: Vec<OwnedFd> = control
        .drain()
        .flat_map(|message| match message {
            RecvAncillaryMessage::ScmRights(fds) => fds.collect(),
            _ => Vec::new(),
        })
        .collect();
    let sizes: Vec<i64> = fds
        .iter()
        .map(|fd| rustix::fs::fstat(fd).unwrap().st_size)
        .collect();
    assert_eq!(sizes, [4096, RING_MAPPING as i64]);
}

/// The acceptor's first byte (1 accepted, 0 refused), or EOF / time-out.
fn read_reply(stream: &UnixStream) -> String {
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut byte = [0u8; 1];
    match (&*stream).read(&mut byte) {
        Ok(0) => "EOF".into(),
        Ok(_) => format!("byte {}", byte[0]),
        Err(error) => format!("error {error}"),
    }
}

/// Sends a handshake for the server's QP with `fds` and returns the reply.
fn attack_handshake(
    server: &ServerQp,
    claimed_pid: u32,
    secret: [u8; 16],
    fds: &[BorrowedFd<'_>],
) -> String {
    let stream = UnixStream::connect_addr(&server.socket_name()).unwrap();
    send_with_fds(&stream, &server.handshake(claimed_pid, secret), fds);
    read_reply(&stream)
}

/// A pid above any real one: our hello claims it so that the server waits
/// for us to dial (the side with the larger address dials).
const HIGH_PID: u32 = u32::MAX - 1;

// ------------------------------------------------------------------ attacks

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_byte_or_unsealed_ring_memfd_is_refused_and_the_server_lives() {
    crate::require_device!();
    let mut target = Target::start().await;
    // A 0-byte memfd (SIGBUS on first access, before), then a full-size one
    // that is not sealed (it could be truncated after the attach, before).
    for fd in [
        memfd(0, false),
        memfd(RING_MAPPING, false),
        memfd(RING_MAPPING + 4096, true),
    ] {
        let (_tcp, server) = begin_setup(&target.addr(), HIGH_PID, 1, 1).await;
        let reply = tokio::task::spawn_blocking(move || {
            attack_handshake(&server, std::process::id(), server.secret, &[fd.as_fd()])
        })
        .await
        .unwrap();
        assert_eq!(reply, "byte 0", "the handshake is refused");
        target.assert_still_serving().await;
    }
    // A sealed one cannot be shrunk by its creator either: the seal is final.
    let sealed = memfd(RING_MAPPING, true);
    assert_eq!(
        rustix::fs::ftruncate(&sealed, 0),
        Err(rustix::io::Errno::PERM)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_user_is_refused_before_anything_is_mapped() {
    crate::require_device!();
    if !rustix::process::geteuid().is_root() {
        println!("skipped: needs root to run the attacker as another user (nobody)");
        return;
    }
    use std::os::unix::process::CommandExt;
    // The test binary must be reachable by `nobody` (a checkout under
    // /root is not): check with a harmless run first.
    let reachable = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--list"])
        .uid(65534)
        .gid(65534)
        .output()
        .is_ok_and(|output| output.status.success());
    if !reachable {
        println!(
            "skipped: this test binary cannot be run as nobody (uid 65534) from where it lies"
        );
        return;
    }
    let mut target = Target::start().await;
    let (_tcp, server) = begin_setup(&target.addr(), HIGH_PID, 1, 1).await;
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "hostile_child_nobody",
            "--ignored",
            "--nocapture",
        ])
        .env(NOBODY_ENV, server.to_string())
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let reply = stdout
        .lines()
        .find_map(|line| {
            line.split_once("LISTENING ")
                .map(|(_, r)| r.trim().to_owned())
        })
        .unwrap_or_else(|| panic!("the nobody attacker printed nothing: {stdout}"));
    assert_eq!(reply, "byte 0", "another user's handshake is refused");
    target.assert_still_serving().await;
}

/// Whether this test binary can run as `nobody` (a checkout under /root
/// cannot): `Err(why)` to print as skipped.
fn runs_as_nobody() -> Result<(), &'static str> {
    use std::os::unix::process::CommandExt;
    if !rustix::process::geteuid().is_root() {
        return Err("needs root to run the attacker as another user (nobody)");
    }
    let reachable = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--list"])
        .uid(65534)
        .gid(65534)
        .output()
        .is_ok_and(|output| output.status.success());
    if !reachable {
        return Err("this test binary cannot be run as nobody (uid 65534) from where it lies");
    }
    Ok(())
}

/// A user the server does not allow opens a burst of silent connections
/// right behind an allowed dialer's handshake (the server is stopped while
/// both queue up, so the acceptor takes them in one go): the dialer's
/// handshake is still read and answered. Before, the acceptor kept the
/// burst among the handshakes it waits for, its newest 64, and dropped the
/// dialer's unread (new clients failed with `WrFlushErr` or `Broken pipe`);
/// now another user is refused as it is accepted and takes no place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_from_another_user_on_the_soft_socket_pushes_no_dialer_out() {
    use std::io::{BufRead, BufReader};
    use std::os::unix::process::CommandExt;
    crate::require_device!();
    if let Err(why) = runs_as_nobody() {
        println!("skipped: {why}");
        return;
    }
    let mut target = Target::start().await;
    let (_tcp, server) = begin_setup(&target.addr(), HIGH_PID, 1, 1).await;
    /// Kills the burst's holder and resumes the server however the test ends.
    struct Burst {
        holder: std::process::Child,
        server: u32,
    }
    impl Drop for Burst {
        fn drop(&mut self) {
            signal(self.server, "-CONT");
            let _ = self.holder.kill();
            let _ = self.holder.wait();
        }
    }
    fn signal(pid: u32, which: &str) {
        let status = std::process::Command::new("kill")
            .args([which, &pid.to_string()])
            .status()
            .expect("kill(1)");
        assert!(status.success(), "kill {which} {pid}");
    }
    // The server stops: what dials it now waits in its listen queue.
    signal(target.child.id(), "-STOP");
    let dialer = UnixStream::connect_addr(&server.socket_name()).unwrap();
    // A handshake from our own pid, with the server QP's secret, which the
    // server answers (a 0-byte ring memfd: refused with byte 0, after it is
    // read). Dropped unread, the dialer would see EOF.
    let ring = memfd(0, false);
    send_with_fds(
        &dialer,
        &server.handshake(std::process::id(), server.secret),
        &[ring.as_fd()],
    );
    let mut holder = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "hostile_child_nobody_burst",
            "--ignored",
            "--nocapture",
        ])
        .env(NOBODY_BURST_ENV, server.to_string())
        .uid(65534)
        .gid(65534)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = holder.stdout.take().unwrap();
    let burst = Burst {
        holder,
        server: target.child.id(),
    };
    let opened: usize = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find_map(|line| {
            line.split_once("LISTENING ")
                .map(|(_, n)| n.trim().parse().unwrap())
        })
        .expect("the burst says how many connections it opened");
    assert!(
        opened > PENDING_HANDSHAKES,
        "the burst queued {opened} connections behind the dialer, more than the acceptor keeps"
    );
    signal(target.child.id(), "-CONT");
    let reply = tokio::task::spawn_blocking(move || read_reply(&dialer))
        .await
        .unwrap();
    assert_eq!(
        reply, "byte 0",
        "the dialer's handshake was read and answered, not dropped for the burst"
    );
    drop(burst);
    target.assert_still_serving().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_pid_is_checked_against_the_kernel() {
    crate::require_device!();
    let mut target = Target::start().await;
    let mut bystander = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    // In the handshake: a bystander's pid (the server would have moved
    // bytes into that process's memory, before).
    let (_tcp, server) = begin_setup(&target.addr(), HIGH_PID, 1, 1).await;
    let fd = memfd(RING_MAPPING, true);
    let bystander_pid = bystander.id();
    let reply = tokio::task::spawn_blocking(move || {
        attack_handshake(&server, bystander_pid, server.secret, &[fd.as_fd()])
    })
    .await
    .unwrap();
    assert_eq!(reply, "byte 0");
    // In the hello: another process's pid, so that the server dials that
    // process's soft socket, which we bind ourselves.
    // pid 1 (init) is older than the server, so the server is the side
    // that dials; the socket name is anyone's to bind.
    let decoy =
        UnixListener::bind_addr(&SocketAddr::from_abstract_name(b"rdma-rpc-soft.1.77").unwrap())
            .unwrap();
    decoy.set_nonblocking(true).unwrap();
    let (mut tcp, _server) = begin_setup(&target.addr(), 1, 77, 1).await;
    // The server refuses to talk to a socket held by another process than
    // the one the hello named, and ends the set-up.
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut rest)).await;
    assert!(read.is_ok(), "the server ends the set-up");
    if let Ok((stream, _)) = decoy.accept() {
        let mut got = Vec::new();
        stream.set_nonblocking(true).unwrap();
        let _ = (&stream).read_to_end(&mut got);
        assert!(
            got.is_empty(),
            "no handshake was sent to the decoy: {got:?}"
        );
    }
    // A wrong secret, with our own pid.
    let (_tcp, server) = begin_setup(&target.addr(), HIGH_PID, 1, 1).await;
    let fd = memfd(RING_MAPPING, true);
    let reply = tokio::task::spawn_blocking(move || {
        attack_handshake(&server, std::process::id(), [0x11; 16], &[fd.as_fd()])
    })
    .await
    .unwrap();
    assert_eq!(reply, "byte 0", "a wrong secret is refused");
    let _ = bystander.kill();
    let _ = bystander.wait();
    target.assert_still_serving().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_to_the_soft_socket_hold_nobody_up() {
    crate::require_device!();
    let mut target = Target::start().await;
    let (_tcp, server) = begin_setup(&target.addr(), HIGH_PID, 1, 1).await;
    // More idle connections than the acceptor keeps pending, sending nothing.
    let idle: Vec<UnixStream> = (0..100)
        .map(|_| UnixStream::connect_addr(&server.socket_name()).unwrap())
        .collect();
    // A client in a younger process dials the server's soft socket
    // through those.
    let started = Instant::now();
    let client =
        ChildServer::spawn_with("hostile_child_client", CLIENT_ENV, &target.child.endpoint);
    assert!(
        client.id() > target.child.id(),
        "the client process must be younger than the server to dial it"
    );
    assert_eq!(client.endpoint, "OK", "the client's 50 calls succeed");
    assert!(started.elapsed() < Duration::from_secs(30));
    drop(idle);
    target.assert_still_serving().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hellos_that_make_the_server_dial_a_silent_socket_block_no_runtime_thread() {
    crate::require_device!();
    let mut target = Target::start().await;
    // Sockets we bind under our own pid: the server dials them (our pid is
    // below its own) and gets no reply, ever.
    let mut decoys = Vec::new();
    let mut setups = Vec::new();
    for context in 0..8u64 {
        let name = format!("rdma-rpc-soft.{}.{}", std::process::id(), 1000 + context);
        decoys.push(
            UnixListener::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap(),
        );
        let addr = target.addr();
        setups.push(tokio::spawn(async move {
            begin_setup(&addr, std::process::id(), 1000 + context, 1).await
        }));
    }
    // Meanwhile the normal client's calls keep their 2 s deadlines.
    let deadline = Instant::now() + Duration::from_secs(6);
    while Instant::now() < deadline {
        assert_serves(&target.normal).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for setup in setups {
        let _ = setup.await;
    }
    drop(decoys);
    target.assert_still_serving().await;
}

/// Threads of process `pid`.
fn threads_of(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|line| line.strip_prefix("Threads:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// 300 hellos, each making the server dial a socket that never answers:
/// the server waits for at most 64 replies at once (each on a short-lived
/// thread), so its threads stay bounded, and a normal client is served
/// throughout. Before, each such hello cost a thread for 5 s, uncapped
/// (480 threads at 100 hellos/s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hellos_that_make_the_server_dial_cost_it_a_bounded_number_of_threads() {
    crate::require_device!();
    let mut target = Target::start().await;
    let pid = target.child.id();
    let baseline = threads_of(pid);
    let mut decoys = Vec::new();
    for context in 0..4u64 {
        let name = format!("rdma-rpc-soft.{}.{}", std::process::id(), 2000 + context);
        decoys.push(
            UnixListener::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap(),
        );
    }
    let mut setups = tokio::task::JoinSet::new();
    for i in 0..300u64 {
        let addr = target.addr();
        setups.spawn(async move {
            let _ = tokio::time::timeout(
                Duration::from_secs(8),
                begin_setup(&addr, std::process::id(), 2000 + i % 4, 1),
            )
            .await;
        });
    }
    let mut most = 0;
    let deadline = Instant::now() + Duration::from_secs(6);
    while Instant::now() < deadline {
        most = most.max(threads_of(pid));
        assert_serves(&target.normal).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    setups.abort_all();
    println!("server threads: {baseline} before, at most {most} during 300 dialing hellos");
    assert!(
        most <= baseline + 64 + 4,
        "{most} threads (from {baseline}) for hellos that make the server dial"
    );
    drop(decoys);
    target.assert_still_serving().await;
}

// ------------------------------------------------- limits over rdma://

/// A server whose process may open 256 descriptors takes connections while
/// each one's descriptors fit (about 10 each on the soft provider, 64 kept
/// for the rest), then refuses new ones in their set-up with the reason;
/// those it took keep working. Before, a client past the limit got as far
/// as its QP and failed there (`connection lost: WrFlushErr`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_descriptor_limit_are_refused_with_the_reason() {
    crate::require_device!();
    ensure_registered();
    let child = ChildServer::spawn("hostile_child_few_fds", FEW_FDS_ENV);
    let mut open = Vec::new();
    let refusal = loop {
        assert!(open.len() < 100, "never refused");
        // Lazily: the first call connects, and a refusal is its status.
        let channel = Channel::builder(child.endpoint.parse().unwrap())
            .timeout(Duration::from_secs(5))
            .connect_lazy();
        match channel.unary(probe("Echo", Bytes::from_static(b"x"))).await {
            Ok(_) => open.push(channel),
            Err(status) => break status,
        }
    };
    println!("{} connections served, then: {refusal:?}", open.len());
    assert_eq!(
        refusal.code(),
        rpc_core::Code::ResourceExhausted,
        "refused with the wrong code: {refusal:?}"
    );
    assert!(
        refusal.message().contains("out of file descriptors"),
        "refused for the wrong reason: {refusal:?}"
    );
    assert!(open.len() >= 10, "only {} connections", open.len());
    for channel in &open {
        assert_serves(channel).await;
    }
}

/// A peer that completes the TCP set-up (hello and readiness) but never
/// connects its queue pair sends no frame: the server's idle time-out
/// closes it, while a normal client is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_up_whose_queue_pair_never_connects_is_closed_by_the_idle_timeout() {
    crate::require_device!();
    let server = start_with(&RdmaBed, |s| s.idle_timeout(Duration::from_millis(500))).await;
    let normal = Channel::connect(server.endpoint.clone()).await.unwrap();
    assert_serves(&normal).await;
    let addr = server.endpoint.authority().to_owned();
    // Our hello claims the larger address, so the server waits for us to
    // dial its soft device, which we never do; we confirm readiness anyway.
    let (mut tcp, _server_qp) = begin_setup(&addr, HIGH_PID, 1, 1).await;
    tcp.write_all(&[0x52]).await.unwrap();
    let started = Instant::now();
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut rest)).await;
    assert!(
        closed.is_ok(),
        "the connection is held past the idle time-out"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "closed by the time-out, not at once"
    );
    assert_serves(&normal).await;
}

/// Beyond `max_connections` an rdma:// client is refused with a message
/// that names the limit; existing connections are unaffected, and a slot
/// that frees is taken again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_connections_beyond_the_limit_are_refused_cleanly() {
    crate::require_device!();
    let server = start_with(&RdmaBed, |s| s.max_connections(2)).await;
    let first = Channel::connect(server.endpoint.clone()).await.unwrap();
    let second = Channel::connect(server.endpoint.clone()).await.unwrap();
    assert_serves(&first).await;
    assert_serves(&second).await;
    let third = Channel::connect(server.endpoint.clone()).await.unwrap();
    let status = third
        .unary(probe("Echo", Bytes::from_static(b"three")))
        .await
        .unwrap_err();
    assert_eq!(
        status.code(),
        rpc_core::Code::ResourceExhausted,
        "{status:?}"
    );
    assert!(
        status.message().contains("connection limit of 2"),
        "{status:?}"
    );
    assert_serves(&first).await;
    drop(first);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let fresh = Channel::connect(server.endpoint.clone()).await.unwrap();
        match fresh
            .unary(probe("Echo", Bytes::from_static(b"four")))
            .await
        {
            Ok(_) => break,
            Err(status) if Instant::now() < deadline => {
                assert!(status.message().contains("connection limit"), "{status:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(status) => panic!("the freed slot was never taken again: {status:?}"),
        }
    }
    assert_serves(&second).await;
}

/// Idle TCP connections to an `rdma://` listener, more than one address may
/// hold, and more coming while they are held: they cost the server no QP,
/// and 64 new clients from another address all get through at once (each
/// call within a second). Before, 128 idle connections from anywhere held
/// every set-up slot for 10 s each: 0 of 64 new clients got through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_set_up_connections_from_one_address_keep_no_other_client_out() {
    use rpc_transport_rdma::transport::MAX_PENDING_HELLOS_PER_SOURCE;
    crate::require_device!();
    let server = start_with(&RdmaBed, |s| s).await;
    let target: std::net::SocketAddr = server.endpoint.authority().parse().unwrap();
    if !target.ip().is_loopback() {
        println!("skipped: needs a loopback server to attack from a second loopback address");
        return;
    }
    let attacker = std::net::SocketAddr::from(([127, 0, 0, 2], 0));
    let connect_idle = move || async move {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(attacker).unwrap();
        socket.connect(target).await
    };
    let mut idle = Vec::new();
    for _ in 0..MAX_PENDING_HELLOS_PER_SOURCE + 44 {
        // Those beyond the address's share are closed by the server.
        if let Ok(socket) = connect_idle().await {
            idle.push(socket);
        }
    }
    // The attacker keeps opening more while the clients come.
    let flood = tokio::spawn(async move {
        loop {
            if let Ok(socket) = connect_idle().await {
                idle.push(socket);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    let mut clients = tokio::task::JoinSet::new();
    for i in 0..64u8 {
        let endpoint = server.endpoint.clone();
        clients.spawn(async move {
            let started = Instant::now();
            let channel = Channel::connect(endpoint)
                .await
                .expect("a new client connects");
            let payload = Bytes::from(vec![i; 64]);
            let reply = channel
                .unary(probe("Echo", payload.clone()))
                .await
                .expect("a new client is served");
            assert_eq!(reply.into_inner(), payload);
            started.elapsed()
        });
    }
    let slowest = clients.join_all().await.into_iter().max().unwrap();
    flood.abort();
    println!("64 new clients beside the idle flood: slowest connect and call {slowest:?}");
    assert!(
        slowest < Duration::from_secs(1),
        "a new client waited {slowest:?}"
    );
}

/// Large frames over rdma:// count against the server's receive budget:
/// a pull waits for its bytes (no READ, no destination) while the budget is
/// spent, and goes on when it frees. Other connections' small frames pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rendezvous_frames_wait_for_the_servers_receive_budget() {
    crate::require_device!();
    const FRAME: usize = 1 << 20;
    // Four requests: each frame is the payload plus a small header.
    const BUDGET: usize = 4 * FRAME + (64 << 10);
    let mut server = start_with(&RdmaBed, |s| {
        s.max_frame_len(2 * FRAME).receive_budget(BUDGET)
    })
    .await;
    let stats = server.stats.clone();
    let payload = Bytes::from(vec![7u8; FRAME]);
    let hang = |channel: &Channel| {
        let channel = channel.clone();
        let payload = payload.clone();
        tokio::spawn(async move { channel.unary(probe("Hang", payload)).await })
    };
    async fn handlers_started(
        events: &mut tokio::sync::mpsc::UnboundedReceiver<crate::suite::Event>,
        count: usize,
        within: Duration,
    ) -> usize {
        let mut started = 0;
        let deadline = tokio::time::Instant::now() + within;
        while started < count {
            match tokio::time::timeout_at(deadline, events.recv()).await {
                Ok(Some(crate::suite::Event::HangStarted)) => started += 1,
                Ok(_) => {}
                Err(_) => break,
            }
        }
        started
    }
    // Connection A: four calls whose handlers hold their 1 MiB requests.
    let a = Channel::connect(server.endpoint.clone()).await.unwrap();
    let mut held: Vec<_> = (0..4).map(|_| hang(&a)).collect();
    assert_eq!(
        handlers_started(&mut server.events, 4, Duration::from_secs(10)).await,
        4
    );
    // Connection C: two more wait for budget; no handler starts.
    let c = Channel::connect(server.endpoint.clone()).await.unwrap();
    let _waiting: Vec<_> = (0..2).map(|_| hang(&c)).collect();
    assert_eq!(
        handlers_started(&mut server.events, 1, Duration::from_millis(500)).await,
        0,
        "a pull went past a spent budget"
    );
    assert!(
        stats.receive_budget().peak() <= BUDGET,
        "the budget was exceeded"
    );
    // Frames queue in order on a connection, so C waits; other connections'
    // small frames (within the per-connection allowance) pass.
    let other = Channel::connect(server.endpoint.clone()).await.unwrap();
    for i in 0..10u8 {
        let small = Bytes::from(vec![i; 4000]);
        let reply = other.unary(probe("Echo", small.clone())).await.unwrap();
        assert_eq!(reply.into_inner(), small);
    }
    // Cancelling two of A's calls frees their bytes: C's pulls go on.
    for call in held.drain(..2) {
        call.abort();
    }
    assert_eq!(
        handlers_started(&mut server.events, 2, Duration::from_secs(10)).await,
        2,
        "the waiting pulls went on once the budget freed"
    );
    assert!(stats.receive_budget().peak() <= BUDGET);
}

// ------------------------------------------------------------ READ windows

mod windows {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use rpc_transport_rdma::setup::{QpListener, connect};
    use rpc_transport_rdma::verbs::owned::OwnedQueue;
    use rpc_transport_rdma::verbs::{
        self, AccessFlags, ConnectOptions, Context, ProtectionDomain, QpCaps, RegisteredBuffer,
        SendOp, WcStatus,
    };

    async fn pair(context: &Arc<dyn Context>, pd: &Arc<dyn ProtectionDomain>) -> [OwnedQueue; 2] {
        let server_queue = OwnedQueue::new(context, pd, QpCaps::default()).unwrap();
        let client_queue = OwnedQueue::new(context, pd, QpCaps::default()).unwrap();
        let (server, client) = (server_queue.qp().clone(), client_queue.qp().clone());
        let listener = QpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let options = ConnectOptions::default();
        let accepting = {
            let server = server.clone();
            tokio::spawn(async move {
                listener
                    .accept(&server, "soft", &options, b"")
                    .await
                    .map(drop)
            })
        };
        let _established = connect(addr, &client, "soft", &options, b"").await.unwrap();
        accepting.await.unwrap().unwrap();
        [server_queue, client_queue]
    }

    /// A READ window exposed to one connection is useless to the peer of
    /// another connection of the same device (as a type-2 memory window
    /// bound to a QP), even with the right key; keys are not sequential.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_window_is_readable_only_through_the_connection_it_was_exposed_to() {
        let context = verbs::provider("soft").unwrap().open("soft0").unwrap();
        let pd = context.alloc_pd().unwrap();
        let [server_a, mut client_a] = pair(&context, &pd).await;
        let [_server_b, mut client_b] = pair(&context, &pd).await;
        let mut secret = RegisteredBuffer::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
        secret.as_mut_slice().fill(0xab);
        let window = secret
            .expose_to(server_a.qp(), 4096, AccessFlags::REMOTE_READ)
            .unwrap();
        let read = |queue: &mut OwnedQueue| {
            let into = RegisteredBuffer::new(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
            let op = SendOp::RdmaRead {
                remote_addr: window.addr(),
                rkey: window.rkey(),
            };
            queue.post_send(op, into, 4096).unwrap();
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if let Some(done) = queue.poll().unwrap().pop() {
                    return (done.completion.status, done.buffer);
                }
                assert!(Instant::now() < deadline, "no completion");
                std::thread::sleep(Duration::from_micros(100));
            }
        };
        let (status, stolen) = read(&mut client_b);
        assert_eq!(status, WcStatus::RemAccessErr);
        assert!(
            stolen.as_slice().iter().all(|&b| b == 0),
            "nothing was read"
        );
        let (status, fetched) = read(&mut client_a);
        assert_eq!(status, WcStatus::Success);
        assert!(fetched.as_slice().iter().all(|&b| b == 0xab));

        let keys: Vec<u32> = (0..16)
            .map(|_| {
                RegisteredBuffer::new(&pd, 64, AccessFlags::REMOTE_READ | AccessFlags::LOCAL_WRITE)
                    .unwrap()
                    .rkey()
            })
            .collect();
        let sequential = keys
            .windows(2)
            .filter(|pair| pair[1] == pair[0].wrapping_add(1))
            .count();
        assert!(sequential < 3, "keys look sequential: {keys:x?}");
    }
}
