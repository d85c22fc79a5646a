//! Who is on the other end of a soft connection, as the kernel says, and the
//! checks on everything a peer hands us at set-up.
//!
//! Nothing a peer says about itself is taken as a fact (see
//! `docs/security.md`):
//!
//! - **Identity** comes from `SO_PEERCRED` on the Unix socket (pid and uid
//!   at `connect`/`listen` time), never from the hello. The pid is then held
//!   by a pidfd, and every transfer from the peer's address space (we only
//!   ever read it) checks that pidfd afterwards: bytes read through a pid
//!   recycled for another process are discarded, never delivered.
//! - **Users.** By default only processes of our own effective uid may
//!   connect ([`PeerPolicy::SameUser`]); `RDMA_SOFT_PEERS` widens it.
//! - **Binding to the set-up.** Every soft queue pair has a random 128-bit
//!   secret (from the OS RNG) that travels only in the TCP set-up hello; a
//!   Unix-socket attach must present the target QP's secret.
//! - **Shared memory.** A memfd a peer passes must have exactly the size the
//!   protocol expects and be sealed against shrinking (`F_SEAL_SHRINK`), so
//!   the mapping can never turn into SIGBUS; an "eventfd" must be one, and is
//!   made non-blocking before we ever write to it.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::fs::{MemfdFlags, OFlags, SealFlags};
use rustix::process::{Pid, PidfdFlags};

/// Bytes of a queue pair's attach secret.
pub(crate) const SECRET_LEN: usize = 16;

/// A queue pair's attach secret.
pub(crate) type Secret = [u8; SECRET_LEN];

/// Which local users may connect to this process's soft device.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PeerPolicy {
    /// Only processes running with our effective uid (the default).
    #[default]
    SameUser,
    /// Our own uid and these.
    Users(Vec<u32>),
    /// Any local user. Transfers still need ptrace permission over the peer
    /// (`process_vm_readv`), which the kernel checks.
    AnyUser,
}

impl PeerPolicy {
    /// Parses `same-user`, `any` or `uids=1000,1001` (the form of
    /// `RDMA_SOFT_PEERS`); case-insensitive.
    pub fn parse(text: &str) -> Option<PeerPolicy> {
        let text = text.trim().to_ascii_lowercase();
        match text.as_str() {
            "same-user" | "same" => Some(PeerPolicy::SameUser),
            "any" | "any-user" => Some(PeerPolicy::AnyUser),
            _ => {
                let list = text.strip_prefix("uids=")?;
                list.split(',')
                    .map(|uid| uid.trim().parse().ok())
                    .collect::<Option<Vec<u32>>>()
                    .filter(|uids| !uids.is_empty())
                    .map(PeerPolicy::Users)
            }
        }
    }

    /// The policy `RDMA_SOFT_PEERS` sets (unset: same user only). An
    /// unparsable value falls back to the strictest policy, with a warning.
    pub fn from_env() -> PeerPolicy {
        match std::env::var("RDMA_SOFT_PEERS") {
            Ok(text) if !text.trim().is_empty() => PeerPolicy::parse(&text).unwrap_or_else(|| {
                tracing::warn!(
                    value = %text,
                    "RDMA_SOFT_PEERS: expected same-user, any or uids=<uid>,...; using same-user"
                );
                PeerPolicy::SameUser
            }),
            _ => PeerPolicy::SameUser,
        }
    }

    /// True when a process running as `uid` may connect.
    pub fn allows(&self, uid: u32) -> bool {
        let own = rustix::process::geteuid().as_raw();
        match self {
            _ if uid == own => true,
            PeerPolicy::SameUser => false,
            PeerPolicy::Users(uids) => uids.contains(&uid),
            PeerPolicy::AnyUser => true,
        }
    }
}

/// What the kernel says about the process at the other end of a Unix socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Credentials {
    pub(crate) pid: u32,
    pub(crate) uid: u32,
}

/// `SO_PEERCRED` of a connected Unix socket.
pub(crate) fn peer_credentials(socket: &UnixStream) -> io::Result<Credentials> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // Not `rustix::net::sockopt::socket_peercred`: its `UCred` holds the pid
    // as a non-zero `Pid`, but the kernel reports pid 0 for a peer outside
    // our pid namespace (or a socket with no peer), which that type cannot
    // hold. A plain `ucred` can, and is refused below.
    // SAFETY: `cred` and `len` are live locals, `len` is the size of `cred`
    // (what SO_PEERCRED writes); the fd is borrowed from `socket`, which is
    // alive for the call.
    let got = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if got != 0 {
        return Err(io::Error::last_os_error());
    }
    if cred.pid <= 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "soft peer: the kernel reports no process for the socket",
        ));
    }
    Ok(Credentials {
        pid: cred.pid as u32,
        uid: cred.uid,
    })
}

/// A peer process held by a pidfd: its pid cannot silently come to mean
/// another process.
#[derive(Debug)]
pub(crate) struct PeerProcess {
    pid: u32,
    pidfd: OwnedFd,
}

impl PeerProcess {
    /// Holds the process the kernel named for `socket`, if `policy` allows
    /// its user. The pidfd is opened right after `SO_PEERCRED`; should the
    /// peer have died and its pid been recycled in between (the pid space
    /// wrapping within two system calls), the process now behind the pid
    /// must still run as the same user, or it is refused: one of the same
    /// user could be ptraced by the attacker anyway.
    pub(crate) fn of_socket(socket: &UnixStream, policy: &PeerPolicy) -> io::Result<PeerProcess> {
        let cred = peer_credentials(socket)?;
        if !policy.allows(cred.uid) {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "soft peer process {} runs as uid {}, which RDMA_SOFT_PEERS does not allow",
                    cred.pid, cred.uid
                ),
            ));
        }
        let pidfd = rustix::process::pidfd_open(pid_of(cred.pid)?, PidfdFlags::empty())?;
        let process = PeerProcess {
            pid: cred.pid,
            pidfd,
        };
        if !process.alive() {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "soft peer process exited during set-up",
            ));
        }
        let now = effective_uid_of(cred.pid)?;
        if now != cred.uid {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "soft peer process {} changed user during set-up ({} -> {now})",
                    cred.pid, cred.uid
                ),
            ));
        }
        Ok(process)
    }

    /// The peer's pid (valid while [`PeerProcess::alive`]).
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// True while the process has not exited (its pidfd is not readable).
    /// While it has not exited, its pid cannot have been reused.
    pub(crate) fn alive(&self) -> bool {
        let mut pollfd = [PollFd::new(&self.pidfd, PollFlags::IN)];
        let no_wait = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        matches!(rustix::event::poll(&mut pollfd, Some(&no_wait)), Ok(0))
    }

    /// Runs `transfer` with the peer's pid and keeps its result only if the
    /// peer is still alive afterwards. Transfers only ever *read* the peer
    /// (`process_vm_readv` into our own memory), so one check after is
    /// enough: if the peer had exited (and its pid been reused) before or
    /// during the call, what was read is discarded as an error, never
    /// delivered as the peer's bytes.
    pub(crate) fn transfer<T>(&self, transfer: impl FnOnce(u32) -> io::Result<T>) -> io::Result<T> {
        let result = transfer(self.pid);
        if !self.alive() {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "soft peer process exited",
            ));
        }
        result
    }
}

/// `pid` (as `SO_PEERCRED` reported it, already checked to be positive)
/// as rustix's `Pid`.
fn pid_of(pid: u32) -> io::Result<Pid> {
    i32::try_from(pid)
        .ok()
        .and_then(Pid::from_raw)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::PermissionDenied,
                "soft peer: the kernel reports no process for the socket",
            )
        })
}

/// The effective uid of process `pid` (`/proc/<pid>/status`, second field of `Uid:`).
fn effective_uid_of(pid: u32) -> io::Result<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|uids| uids.split_whitespace().nth(1))
        .and_then(|uid| uid.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no Uid line in /proc status"))
}

/// A fresh secret from the OS RNG.
pub(crate) fn random_secret() -> io::Result<Secret> {
    let mut secret = [0u8; SECRET_LEN];
    fill_random(&mut secret)?;
    Ok(secret)
}

/// Fills `out` from the OS RNG (`getrandom`).
pub(crate) fn fill_random(out: &mut [u8]) -> io::Result<()> {
    let mut filled = 0;
    while filled < out.len() {
        match rustix::rand::getrandom(&mut out[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(got) => filled += got,
            Err(rustix::io::Errno::INTR) => continue,
            Err(error) => return Err(error.into()),
        }
    }
    Ok(())
}

/// Compares two secrets in time independent of where they differ.
pub(crate) fn secrets_match(a: &Secret, b: &Secret) -> bool {
    a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

/// Seals that every shared-memory fd of the soft wire carries: it can never
/// shrink under a mapping (no SIGBUS), nor grow, and the seals are final.
pub(crate) const SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

/// A memfd of `len` bytes, sealed with [`SEALS`], to share with a peer.
pub(crate) fn sealed_memfd(name: &std::ffi::CStr, len: usize) -> io::Result<OwnedFd> {
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    rustix::fs::ftruncate(&fd, len as u64)?;
    rustix::fs::fcntl_add_seals(&fd, SEALS)?;
    Ok(fd)
}

/// Checks a memfd a peer passed before it is mapped: exactly `len` bytes,
/// sealed against shrinking (so the size is final while mapped).
pub(crate) fn check_sealed_memfd(fd: &OwnedFd, len: usize, what: &str) -> io::Result<()> {
    let invalid = |why: String| io::Error::new(io::ErrorKind::InvalidData, why);
    // EINVAL for anything but a memfd (or another sealable file).
    let Ok(seals) = rustix::fs::fcntl_get_seals(fd) else {
        return Err(invalid(format!(
            "soft peer's {what} is not a sealable memfd"
        )));
    };
    if !seals.contains(SealFlags::SHRINK) {
        return Err(invalid(format!(
            "soft peer's {what} is not sealed against shrinking (F_SEAL_SHRINK)"
        )));
    }
    let stat = rustix::fs::fstat(fd)?;
    if stat.st_size as u64 != len as u64 {
        return Err(invalid(format!(
            "soft peer's {what} has {} bytes, expected {len}",
            stat.st_size
        )));
    }
    Ok(())
}

/// Checks that a peer's fd is an eventfd and makes it non-blocking, so a
/// write to it never blocks one of our threads.
pub(crate) fn check_eventfd(fd: &OwnedFd) -> io::Result<()> {
    let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
    if link.as_os_str() != "anon_inode:[eventfd]" {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "soft peer passed {} where an eventfd belongs",
                link.display()
            ),
        ));
    }
    let flags = rustix::fs::fcntl_getfl(fd)?;
    rustix::fs::fcntl_setfl(fd, flags | OFlags::NONBLOCK)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_parses_case_insensitively_and_rejects_junk() {
        assert_eq!(PeerPolicy::parse("SAME-USER"), Some(PeerPolicy::SameUser));
        assert_eq!(PeerPolicy::parse("Any"), Some(PeerPolicy::AnyUser));
        assert_eq!(
            PeerPolicy::parse("uids=1000, 65534"),
            Some(PeerPolicy::Users(vec![1000, 65534]))
        );
        assert_eq!(PeerPolicy::parse("uids="), None);
        assert_eq!(PeerPolicy::parse("uids=x"), None);
        assert_eq!(PeerPolicy::parse("everyone"), None);
        let own = rustix::process::geteuid().as_raw();
        assert!(PeerPolicy::SameUser.allows(own));
        assert!(!PeerPolicy::SameUser.allows(own.wrapping_add(1)));
        assert!(PeerPolicy::Users(vec![own.wrapping_add(1)]).allows(own.wrapping_add(1)));
        assert!(PeerPolicy::AnyUser.allows(own.wrapping_add(7)));
    }

    #[test]
    fn the_kernel_names_the_peer_and_its_pidfd_follows_it() {
        let (a, _b) = UnixStream::pair().unwrap();
        let cred = peer_credentials(&a).unwrap();
        assert_eq!(cred.pid, std::process::id());
        let me = PeerProcess::of_socket(&a, &PeerPolicy::SameUser).unwrap();
        assert!(me.alive());
        assert_eq!(me.transfer(Ok).unwrap(), std::process::id());

        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let process = PeerProcess {
            pid: child.id(),
            pidfd: rustix::process::pidfd_open(pid_of(child.id()).unwrap(), PidfdFlags::empty())
                .unwrap(),
        };
        assert!(process.alive());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!process.alive(), "an exited peer is seen at once");
        let error = process.transfer(|_| Ok(())).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::ConnectionAborted);
    }

    #[test]
    fn memfds_must_be_sealed_and_exactly_sized() {
        let good = sealed_memfd(c"test", 8192).unwrap();
        check_sealed_memfd(&good, 8192, "ring").unwrap();
        let error = check_sealed_memfd(&good, 4096, "ring").unwrap_err();
        assert!(error.to_string().contains("8192 bytes"), "{error}");
        let plain = rustix::fs::memfd_create(c"plain", MemfdFlags::CLOEXEC).unwrap();
        let error = check_sealed_memfd(&plain, 0, "ring").unwrap_err();
        assert!(error.to_string().contains("F_SEAL_SHRINK"), "{error}");
        let (socket, _other) = UnixStream::pair().unwrap();
        let socket = OwnedFd::from(socket);
        let error = check_sealed_memfd(&socket, 0, "ring").unwrap_err();
        assert!(
            error.to_string().contains("not a sealable memfd"),
            "{error}"
        );
        let error = check_eventfd(&socket).unwrap_err();
        assert!(error.to_string().contains("eventfd"), "{error}");
    }

    #[test]
    fn secrets_are_random_and_compared_whole() {
        let a = random_secret().unwrap();
        let b = random_secret().unwrap();
        assert_ne!(a, b);
        assert!(secrets_match(&a, &a));
        let mut c = a;
        c[15] ^= 1;
        assert!(!secrets_match(&a, &c));
    }
}
