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
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

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
        // SAFETY: geteuid has no preconditions and cannot fail.
        let own = unsafe { libc::geteuid() };
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
    // SAFETY: `cred` and `len` are live and sized for SO_PEERCRED's ucred;
    // the fd belongs to `socket`, alive for the call.
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
        // SAFETY: pidfd_open takes a pid and flags, no pointers; a negative
        // return is an error.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, cred.pid as libc::pid_t, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor that nothing else owns.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
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
        let mut pollfd = libc::pollfd {
            fd: self.pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd, zero timeout.
        let ready = unsafe { libc::poll(&mut pollfd, 1, 0) };
        ready == 0
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
        // SAFETY: writes at most `out.len() - filled` bytes into `out`.
        let got =
            unsafe { libc::getrandom(out[filled..].as_mut_ptr().cast(), out.len() - filled, 0) };
        if got < 0 {
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(error);
        }
        filled += got as usize;
    }
    Ok(())
}

/// Compares two secrets in time independent of where they differ.
pub(crate) fn secrets_match(a: &Secret, b: &Secret) -> bool {
    a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

/// Seals that every shared-memory fd of the soft wire carries: it can never
/// shrink under a mapping (no SIGBUS), nor grow, and the seals are final.
pub(crate) const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// A memfd of `len` bytes, sealed with [`SEALS`], to share with a peer.
pub(crate) fn sealed_memfd(name: &std::ffi::CStr, len: usize) -> io::Result<OwnedFd> {
    // SAFETY: a NUL-terminated name; the result is checked.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: a valid fd; the result is checked.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a valid memfd created with MFD_ALLOW_SEALING; the result is checked.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Checks a memfd a peer passed before it is mapped: exactly `len` bytes,
/// sealed against shrinking (so the size is final while mapped).
pub(crate) fn check_sealed_memfd(fd: &OwnedFd, len: usize, what: &str) -> io::Result<()> {
    let invalid = |why: String| io::Error::new(io::ErrorKind::InvalidData, why);
    // SAFETY: F_GET_SEALS takes no pointer; -1 (EINVAL) for a non-memfd.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(invalid(format!(
            "soft peer's {what} is not a sealable memfd"
        )));
    }
    if seals & libc::F_SEAL_SHRINK == 0 {
        return Err(invalid(format!(
            "soft peer's {what} is not sealed against shrinking (F_SEAL_SHRINK)"
        )));
    }
    // SAFETY: an all-zero stat is valid; fstat fills it for a valid fd.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `stat` is live; the fd is valid.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut stat) } != 0 {
        return Err(io::Error::last_os_error());
    }
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
    // SAFETY: F_GETFL/F_SETFL on a valid fd, no pointers.
    unsafe {
        let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        if flags < 0 || libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
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
        // SAFETY: no preconditions.
        let own = unsafe { libc::geteuid() };
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
        // SAFETY: no pointers.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, child.id() as libc::pid_t, 0) };
        assert!(fd >= 0);
        let process = PeerProcess {
            pid: child.id(),
            // SAFETY: a fresh pidfd.
            pidfd: unsafe { OwnedFd::from_raw_fd(fd as RawFd) },
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
        // SAFETY: a NUL-terminated name; checked below.
        let plain = unsafe { libc::memfd_create(c"plain".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(plain >= 0);
        // SAFETY: fresh fd.
        let plain = unsafe { OwnedFd::from_raw_fd(plain) };
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
