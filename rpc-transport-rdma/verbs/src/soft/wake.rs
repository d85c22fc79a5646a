//! Waking a caller that sleeps on a completion channel, from another process.
//!
//! An armed CQ fires once: on its next completion (or, armed solicited-only,
//! its next solicited or error completion). The soft provider keeps that arm
//! in an [`ArmWord`], one word of memory shared with every peer process whose
//! QPs complete into the CQ. Whoever fires the CQ takes the arm with one
//! compare-and-swap, so an arm fires exactly once:
//!
//! - a completion pushed in this process (engine thread or polling caller)
//!   swaps the word to `DISARMED` and queues the event;
//! - a peer whose batch of wire messages will complete into the armed CQ
//!   swaps it to `CLAIMED` and writes the channel's eventfd itself: the
//!   sleeping caller wakes directly, one thread hop instead of two (our
//!   engine thread, then the caller). `get_event` reports the claimed CQ;
//!   the caller's next poll reads the ring and finds the completion.
//!
//! The channel's eventfd counts in semaphore mode: every event (queued or
//! claimed) adds one before anyone can take it, every event taken subtracts
//! one, so the fd is readable exactly while an event waits.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};

use rustix::mm::{MapFlags, ProtFlags};

pub(crate) use super::sync::{ARMED_ANY, ARMED_SOLICITED, CLAIMED, DISARMED};

/// Bytes mapped per word (one page).
const PAGE: usize = 4096;

/// A CQ's arm state, in a one-page memfd that peer processes map too.
pub(crate) struct ArmWord {
    base: *mut u8,
    fd: OwnedFd,
}

// SAFETY: the mapping is only used through the atomic word at its start.
unsafe impl Send for ArmWord {}
// SAFETY: as above.
unsafe impl Sync for ArmWord {}

impl Drop for ArmWord {
    fn drop(&mut self) {
        // SAFETY: `base` is the start of the PAGE-byte mapping `map` made for
        // this word (nothing else builds an ArmWord); it is unmapped only
        // here, once, and no reference into it outlives `self`.
        let _ = unsafe { rustix::mm::munmap(self.base.cast(), PAGE) };
    }
}

impl std::fmt::Debug for ArmWord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArmWord")
            .field("state", &self.state())
            .finish()
    }
}

impl ArmWord {
    /// A fresh, disarmed word (for a CQ with a completion channel), in a
    /// memfd sealed so that it can never shrink under a peer's mapping.
    pub(crate) fn create() -> io::Result<ArmWord> {
        let fd = super::peer::sealed_memfd(c"rdma-rpc-soft-arm", PAGE)?;
        // SAFETY: `sealed_memfd` just made `fd` a memfd of PAGE bytes,
        // sealed against shrinking.
        unsafe { ArmWord::map(fd) }
    }

    /// Maps a word a peer passed at set-up, after checking that the memfd
    /// is exactly one page and sealed against shrinking (else a peer could
    /// truncate it and turn our next access into SIGBUS).
    pub(crate) fn map_peer(fd: OwnedFd) -> io::Result<ArmWord> {
        super::peer::check_sealed_memfd(&fd, PAGE, "completion-queue arm word")?;
        // SAFETY: `check_sealed_memfd` just checked that `fd` is a memfd of
        // exactly PAGE bytes, sealed against shrinking.
        unsafe { ArmWord::map(fd) }
    }

    /// Maps the word's page, shared, readable and writable.
    ///
    /// # Safety
    /// `fd` must be a memfd of at least [`PAGE`] bytes that can never shrink
    /// (sealed with `F_SEAL_SHRINK`): every later access to the word would
    /// otherwise risk SIGBUS.
    unsafe fn map(fd: OwnedFd) -> io::Result<ArmWord> {
        // SAFETY: a null hint without MAP_FIXED: the kernel picks unused
        // addresses, so the call replaces or aliases no memory of ours.
        let base = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                PAGE,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        }?;
        Ok(ArmWord {
            base: base.cast(),
            fd,
        })
    }

    /// The memfd, to pass to a peer.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn word(&self) -> &AtomicU32 {
        // SAFETY: `base` is the start of a live, page-aligned (so 4-byte
        // aligned) PAGE-byte shared mapping that `self` owns until drop,
        // backed by a memfd that cannot shrink (`map`'s contract); this
        // module only ever accesses its first 4 bytes through this atomic.
        // (A peer process that maps the same page may write it any way it
        // likes: it can change the value, never the validity of the memory.)
        unsafe { AtomicU32::from_ptr(self.base.cast()) }
    }

    /// The current state (`DISARMED`, `ARMED_*`, `CLAIMED`).
    pub(crate) fn state(&self) -> u32 {
        self.word().load(Ordering::SeqCst)
    }

    /// Arms for the next (solicited-only: solicited or error) completion.
    /// An event a peer claimed and nobody took yet stays: it is the event
    /// this arm would raise.
    pub(crate) fn arm(&self, solicited_only: bool) {
        super::sync::arm(self.word(), solicited_only);
    }

    /// Takes the arm if it covers a completion that is solicited (or an
    /// error) or not; true when taken: the taker raises the one event.
    /// `to` is `DISARMED` (a local completion, queued by the taker) or
    /// `CLAIMED` (a peer's, reported by `get_event`).
    pub(crate) fn fire(&self, solicited_or_error: bool, to: u32) -> bool {
        super::sync::fire(self.word(), solicited_or_error, to)
    }

    /// Takes a peer's claimed event; true when there was one.
    pub(crate) fn take_claimed(&self) -> bool {
        super::sync::take_claimed(self.word())
    }
}

/// Adds one to an eventfd (non-blocking; it never saturates in practice).
pub(crate) fn signal_eventfd(fd: BorrowedFd<'_>) {
    let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
}

/// One CQ of the peer QP: its arm word and its channel's eventfd.
#[derive(Debug)]
pub(crate) struct PeerCq {
    arm: ArmWord,
    eventfd: OwnedFd,
}

impl PeerCq {
    /// Takes the arm for a completion this batch will cause and wakes the
    /// peer's caller; false when the CQ is not armed for it.
    fn claim(&self, solicited_or_error: bool) -> bool {
        let claimed = self.arm.fire(solicited_or_error, CLAIMED);
        if claimed {
            signal_eventfd(self.eventfd.as_fd());
        }
        claimed
    }
}

/// The peer QP's CQs that have completion channels (passed at set-up).
#[derive(Debug, Default)]
pub(crate) struct PeerWakers {
    recv: Option<PeerCq>,
    /// `None` also when the send CQ is the receive CQ (`send_is_recv`).
    send: Option<PeerCq>,
    send_is_recv: bool,
}

/// Set-up flags: which CQs' (arm word, eventfd) pairs follow.
pub(crate) const WAKER_RECV: u8 = 1;
pub(crate) const WAKER_SEND: u8 = 2;
pub(crate) const WAKER_SEND_IS_RECV: u8 = 4;

/// What a batch of wire messages causes at the peer (bits).
pub(crate) mod need {
    /// Work with no completion at the peer (READ, WRITE, atomics, RNR NAK):
    /// its engine must run.
    pub(crate) const ENGINE: u32 = 1;
    /// A receive completion, solicited.
    pub(crate) const RECV_SOLICITED: u32 = 2;
    /// A receive completion, not solicited.
    pub(crate) const RECV_UNSOLICITED: u32 = 4;
    /// A successful send completion the initiator asked for.
    pub(crate) const SEND_OK: u32 = 8;
    /// An error completion at the initiator.
    pub(crate) const SEND_ERROR: u32 = 16;
    /// The initiator wants the request acknowledged promptly (a signaled
    /// request, or its send queue is filling up): if nobody at the peer is
    /// woken directly, its engine must be.
    pub(crate) const PROMPT_ACK: u32 = 32;
    /// What causes completions (the rest is about engines).
    pub(crate) const COMPLETIONS: u32 = RECV_SOLICITED | RECV_UNSOLICITED | SEND_OK | SEND_ERROR;
}

impl PeerWakers {
    /// Rebuilds what the peer's set-up message carried: for each CQ named
    /// in `flags`, its arm word's memfd then its channel's eventfd.
    pub(crate) fn from_set_up(
        flags: u8,
        fds: &mut impl Iterator<Item = OwnedFd>,
    ) -> io::Result<PeerWakers> {
        let mut next = |present: bool| -> io::Result<Option<PeerCq>> {
            if !present {
                return Ok(None);
            }
            let (Some(arm), Some(eventfd)) = (fds.next(), fds.next()) else {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "soft set-up: missing completion-channel fds",
                ));
            };
            super::peer::check_eventfd(&eventfd)?;
            Ok(Some(PeerCq {
                arm: ArmWord::map_peer(arm)?,
                eventfd,
            }))
        };
        let recv = next(flags & WAKER_RECV != 0)?;
        let send = next(flags & WAKER_SEND != 0)?;
        Ok(PeerWakers {
            send_is_recv: flags & WAKER_SEND_IS_RECV != 0 && recv.is_some(),
            recv,
            send,
        })
    }

    /// Wakes the peer's caller directly for a batch that causes `needs`,
    /// when every completion it causes lands in an armed CQ (whose arm this
    /// takes). False when the peer's engine must be woken instead: the batch
    /// has engine work, or a CQ is not armed for it (then either nobody
    /// sleeps on it, or its event is raised already and the caller's next
    /// poll reads the ring; the engine keeps acknowledgements prompt).
    pub(crate) fn wake(&self, needs: u32) -> bool {
        if needs & need::ENGINE != 0 || needs & need::COMPLETIONS == 0 {
            return false;
        }
        let send = if self.send_is_recv {
            self.recv.as_ref()
        } else {
            self.send.as_ref()
        };
        let recv_needed = needs & (need::RECV_SOLICITED | need::RECV_UNSOLICITED) != 0;
        let send_needed = needs & (need::SEND_OK | need::SEND_ERROR) != 0;
        if (recv_needed && self.recv.is_none()) || (send_needed && send.is_none()) {
            return false;
        }
        // An arm for any completion fires on the batch's first; a
        // solicited-only arm fires on its first solicited receive or error
        // (ibv_req_notify_cq), whatever else the batch completes before it.
        let send_error = needs & need::SEND_ERROR != 0;
        let same_cq = self.send_is_recv && recv_needed && send_needed;
        let mut woke = true;
        if recv_needed {
            let solicited = needs & need::RECV_SOLICITED != 0 || (same_cq && send_error);
            woke &= self.recv.as_ref().is_some_and(|cq| cq.claim(solicited));
        }
        if send_needed && !same_cq {
            woke &= send.is_some_and(|cq| cq.claim(send_error));
        }
        woke
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::event::EventfdFlags;

    #[test]
    fn an_arm_fires_once_whoever_takes_it() {
        let word = ArmWord::create().unwrap();
        let peer = ArmWord::map_peer(dup(word.fd())).unwrap();
        assert!(!word.fire(true, DISARMED), "not armed");
        word.arm(false);
        assert!(peer.fire(false, CLAIMED), "the peer takes it");
        assert!(!word.fire(true, DISARMED), "taken already");
        word.arm(false);
        assert_eq!(word.state(), CLAIMED, "a pending claim survives re-arming");
        assert!(word.take_claimed());
        assert!(!word.take_claimed());
        word.arm(true);
        assert!(
            !peer.fire(false, CLAIMED),
            "solicited-only skips the unsolicited"
        );
        assert!(word.fire(true, DISARMED));
        assert_eq!(peer.state(), DISARMED);
    }

    /// A second descriptor for `fd` (close-on-exec), as a peer would hold.
    fn dup(fd: impl AsFd) -> OwnedFd {
        rustix::io::fcntl_dupfd_cloexec(fd, 0).unwrap()
    }

    fn eventfd_count(fd: impl AsFd) -> u64 {
        let mut total = 0;
        let mut value = [0u8; 8];
        while matches!(rustix::io::read(fd.as_fd(), &mut value), Ok(8)) {
            total += u64::from_ne_bytes(value);
        }
        total
    }

    #[test]
    fn a_peer_wakes_the_caller_only_for_completions_an_armed_cq_fires_on() {
        let arm = ArmWord::create().unwrap();
        let eventfd =
            rustix::event::eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC).unwrap();
        let mut fds = [dup(arm.fd()), dup(&eventfd)].into_iter();
        let wakers = PeerWakers::from_set_up(WAKER_RECV | WAKER_SEND_IS_RECV, &mut fds).unwrap();

        assert!(
            !wakers.wake(need::RECV_UNSOLICITED),
            "not armed: the engine's job"
        );
        arm.arm(false);
        assert!(
            !wakers.wake(need::ENGINE | need::RECV_UNSOLICITED),
            "engine work"
        );
        assert!(wakers.wake(need::RECV_UNSOLICITED | need::SEND_OK));
        assert_eq!(eventfd_count(&eventfd), 1, "one write for the one CQ");
        assert!(!wakers.wake(need::RECV_UNSOLICITED), "the arm is taken");
        assert!(arm.take_claimed());

        arm.arm(true);
        assert!(!wakers.wake(need::RECV_UNSOLICITED), "solicited-only arm");
        assert!(!wakers.wake(need::SEND_OK), "send OK is not solicited");
        assert!(
            wakers.wake(need::RECV_SOLICITED | need::SEND_OK),
            "a solicited receive fires it, whatever else the batch completes"
        );
        assert_eq!(eventfd_count(&eventfd), 1);
        assert!(arm.take_claimed());
        arm.arm(true);
        assert!(wakers.wake(need::SEND_ERROR), "an error fires it");
        assert_eq!(eventfd_count(&eventfd), 1);

        let none = PeerWakers::default();
        assert!(
            !none.wake(need::RECV_SOLICITED),
            "no channel: no direct wake"
        );
    }
}
