//! Two RDMA protocol endpoints wired together in memory (as in the crate's
//! tests: receive slots, send slots and READs simulated) and driven by the
//! fuzz input: frames of any size, closes, held credits, partial deliveries,
//! READs completing in any order relative to everything else, time passing,
//! credit windows growing (as far as a simulated shared pool spares slots)
//! and returned by idle sides, and forged messages (structured or raw bytes) injected as if the peer had
//! sent them.
//!
//! Checked throughout: nothing panics; every queue stays within its bound
//! (frames exposed ≤ `max_exposed`, frames queued ≤ `max_queued`, messages
//! waiting for the application ≤ `max_pending` + the receive slots + DONE credits,
//! announcements awaiting DONE ≤ `MAX_UNANSWERED`); a `ProtocolError` or a
//! READ the peer's memory refuses ends the connection (the run), as in the
//! driver. While nothing was forged, the honest harness also checks what
//! tests.rs checks: no message meets an empty receive queue or overflows a
//! slot, and each side receives a prefix of what the other sent, byte exact;
//! and at the end, with credits released and everything run to quiescence,
//! each side has received all the other sent (no deadlock, no lost credit).
//!
//! Shared by the property test `tests/event_orders.rs` (proptest, in every
//! `cargo test`) and the fuzz target `protocol_state`
//! (`rpc-transport-rdma/fuzz`), which both feed [`run`] bytes.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use arbitrary::{Arbitrary, Unstructured};
use bytes::Bytes;
use rdma_rpc_protocol::{
    Announce, Body, Event, Geometry, HEADER_LEN, Inbound, Limits, MAX_BATCH_FRAMES, MAX_UNANSWERED,
    MIN_SLOT_LEN, Message, Protocol, ReadRequest, Route,
};

#[derive(Arbitrary, Debug)]
enum Op {
    /// The application of `side` sends a frame of `len` bytes (×16 when `big`).
    Send { side: bool, len: u16, big: bool },
    /// The application of `side` ends its side.
    Close { side: bool },
    /// The driver of `side` holds back (or releases) credit grants.
    Hold { side: bool, hold: bool },
    /// `side` posts every SEND the protocol allows.
    Transmit { side: bool },
    /// Up to `count` messages reach `side` (its slot is re-posted, the
    /// sender's SEND completes).
    Arrive { side: bool, count: u8 },
    /// `side` handles its events, posts READs and hands frames up.
    Memory { side: bool },
    /// Up to `count` of `side`'s READs complete.
    Reads { side: bool, count: u8 },
    /// Time passes; both sides run their timers.
    Advance { millis: u16 },
    /// A forged message reaches `side` in a receive slot.
    Forge { side: bool, message: Forged },
    /// Raw bytes reach `side` in a receive slot.
    Raw { side: bool, bytes: Vec<u8> },
    /// The driver of `side` commits up to `spare` more slots to its peer's
    /// window, as far as the protocol wants them.
    Grow { side: bool, spare: u8 },
    /// `side` has been idle: it gives back its extra credits.
    Idle { side: bool },
}

#[derive(Arbitrary, Debug)]
enum Forged {
    Data {
        credits: u32,
        len: u16,
    },
    Announce {
        credits: u32,
        token: u64,
        addr: u64,
        len: u64,
        rkey: u32,
        head_len: u8,
    },
    /// An announcement of a window the forging side really exposed, under
    /// another token (the same memory announced again and again).
    Replay {
        credits: u32,
        token: u64,
    },
    Done {
        credits: u32,
        token: u64,
    },
    Credit {
        credits: u32,
    },
    Close {
        credits: u32,
    },
    Return {
        credits: u32,
        returned: u32,
    },
    /// `count` frames of `len` bytes in one BATCH (any count: a BATCH of
    /// fewer than 2 or more than the maximum must be refused).
    Batch {
        credits: u32,
        count: u8,
        len: u8,
    },
}

struct Side {
    protocol: Protocol,
    geometry: Geometry,
    limits: Limits,
    posted_receives: u32,
    /// Our exposed frames: token → (addr, rkey, bytes).
    exposed: HashMap<u64, (u64, u32, Bytes)>,
    next_addr: u64,
    /// READ destinations: token → bytes.
    destinations: HashMap<u64, Vec<u8>>,
    reads: VecDeque<ReadRequest>,
    sent: Vec<Bytes>,
    /// Frames this side announced (each may earn the peer a DONE credit).
    announced: usize,
    queued: usize,
    delivered: usize,
    /// Its application ended its side.
    closed: bool,
}

impl Side {
    fn new(local: Geometry, peer: Geometry, limits: Limits) -> Side {
        Side {
            protocol: Protocol::new(local, peer, limits),
            geometry: local,
            limits,
            posted_receives: local.initial_credits,
            exposed: HashMap::new(),
            next_addr: 0x1000_0000,
            destinations: HashMap::new(),
            reads: VecDeque::new(),
            sent: Vec::new(),
            announced: 0,
            queued: 0,
            delivered: 0,
            closed: false,
        }
    }
}

/// The connection ended (a protocol error, or a READ the peer refused).
struct Ended;

struct Pair {
    sides: [Side; 2],
    /// Messages on the wire towards side 0 and side 1: (bytes, forged).
    wires: [VecDeque<(Bytes, bool)>; 2],
    now: Instant,
    forged: bool,
    /// Time passed: a window may have been revoked mid-pull.
    expired: bool,
    /// Everything that happened so far (messages, READs, events, deliveries).
    moves: u64,
}

fn frame(len: usize, seed: usize) -> Bytes {
    (0..len)
        .map(|i| (i.wrapping_mul(31).wrapping_add(seed)) as u8)
        .collect::<Vec<u8>>()
        .into()
}

impl Pair {
    fn apply(&mut self, op: Op) -> Result<(), Ended> {
        match op {
            Op::Send { side, len, big } => {
                let len = usize::from(len) * if big { 16 } else { 1 };
                let s = &mut self.sides[usize::from(side)];
                let len = len.min(s.protocol.peer_max_frame_len() as usize);
                let route = s.protocol.route(len);
                // The driver's back-pressure: the application waits otherwise.
                if !s.protocol.can_send(route) {
                    return Ok(());
                }
                let bytes = frame(len, s.sent.len());
                s.sent.push(bytes.clone());
                s.queued += 1;
                match route {
                    Route::Eager => s.protocol.send_eager(bytes),
                    Route::Rendezvous => {
                        // Some of the frame inline (as the driver sends a
                        // frame's head and a message's end), the rest behind
                        // the window.
                        let max_inline = s.protocol.max_announce_inline();
                        let head_len = (len % 61).min(max_inline).min(len - 1);
                        let tail_len = (len % 37)
                            .min(max_inline - head_len)
                            .min(len - 1 - head_len);
                        let remote = bytes.slice(head_len..len - tail_len);
                        let addr = s.next_addr;
                        s.next_addr += remote.len() as u64 + 4096;
                        let rkey = (addr >> 12) as u32;
                        let token = s.protocol.send_rendezvous(
                            bytes.slice(..head_len),
                            bytes.slice(len - tail_len..),
                            addr,
                            remote.len() as u64,
                            rkey,
                            self.now,
                        );
                        assert!(s.exposed.insert(token, (addr, rkey, remote)).is_none());
                        s.announced += 1;
                    }
                }
            }
            Op::Close { side } => {
                let s = &mut self.sides[usize::from(side)];
                s.closed = true;
                s.protocol.close();
            }
            Op::Hold { side, hold } => self.sides[usize::from(side)]
                .protocol
                .set_hold_credits(hold),
            Op::Transmit { side } => self.transmit(usize::from(side)),
            Op::Arrive { side, count } => {
                for _ in 0..count {
                    self.arrive(usize::from(side))?;
                }
            }
            Op::Memory { side } => self.memory(usize::from(side)),
            Op::Reads { side, count } => {
                for _ in 0..count {
                    self.read(usize::from(side))?;
                }
            }
            Op::Advance { millis } => {
                self.now += Duration::from_millis(u64::from(millis));
                self.expired |= millis > 0;
                for side in &mut self.sides {
                    side.protocol.handle_timeout(self.now);
                }
            }
            Op::Forge { side, message } => {
                let to = usize::from(side);
                let from = &self.sides[1 - to];
                let message = match message {
                    Forged::Data { credits, len } => Message {
                        credits,
                        body: Body::Data(frame(usize::from(len), 7)),
                    },
                    Forged::Announce {
                        credits,
                        token,
                        addr,
                        len,
                        rkey,
                        head_len,
                    } => Message {
                        credits,
                        body: Body::Announce(Announce {
                            token,
                            addr,
                            len,
                            rkey,
                            head: frame(usize::from(head_len), 3),
                            tail: frame(usize::from(head_len) / 2, 4),
                        }),
                    },
                    Forged::Replay { credits, token } => {
                        let Some((addr, rkey, bytes)) = from.exposed.values().next() else {
                            return Ok(());
                        };
                        Message {
                            credits,
                            body: Body::Announce(Announce {
                                token,
                                addr: *addr,
                                len: bytes.len() as u64,
                                rkey: *rkey,
                                head: bytes::Bytes::new(),
                                tail: bytes::Bytes::new(),
                            }),
                        }
                    }
                    Forged::Done { credits, token } => Message {
                        credits,
                        body: Body::Done { token },
                    },
                    Forged::Credit { credits } => Message {
                        credits,
                        body: Body::Credit,
                    },
                    Forged::Close { credits } => Message {
                        credits,
                        body: Body::Close,
                    },
                    Forged::Return { credits, returned } => Message {
                        credits,
                        body: Body::Return { credits: returned },
                    },
                    Forged::Batch {
                        credits,
                        count,
                        len,
                    } => Message {
                        credits,
                        body: Body::Batch(
                            (0..count)
                                .map(|i| frame(usize::from(len), usize::from(i)))
                                .collect(),
                        ),
                    },
                };
                self.forged = true;
                self.wires[to].push_back((message.encode(), true));
            }
            Op::Raw { side, bytes } => {
                self.forged = true;
                self.wires[usize::from(side)].push_back((bytes.into(), true));
            }
            Op::Grow { side, spare } => {
                let s = &mut self.sides[usize::from(side)];
                let wanted = s.protocol.credits_wanted();
                assert!(s.protocol.window() + wanted <= s.geometry.recv_slots);
                let committed = wanted.min(u32::from(spare));
                s.posted_receives += committed;
                s.protocol.grow_window(committed);
            }
            Op::Idle { side } => {
                let _ = self.sides[usize::from(side)].protocol.return_credits();
            }
        }
        self.check();
        Ok(())
    }

    fn transmit(&mut self, from: usize) {
        let to = 1 - from;
        while let Some(message) = self.sides[from].protocol.poll_transmit() {
            match &message.body {
                Body::Data(_) | Body::Announce(_) => self.sides[from].queued -= 1,
                Body::Batch(frames) => self.sides[from].queued -= frames.len(),
                _ => {}
            }
            let bytes = message.encode();
            let receiver = &mut self.sides[to];
            if !self.forged {
                assert!(
                    bytes.len() <= receiver.geometry.slot_len as usize,
                    "message of {} bytes overflows a {}-byte slot",
                    bytes.len(),
                    receiver.geometry.slot_len
                );
                assert!(
                    receiver.posted_receives > 0,
                    "RNR: a message met no posted receive"
                );
            }
            receiver.posted_receives = receiver.posted_receives.saturating_sub(1);
            self.wires[to].push_back((bytes, false));
            self.moves += 1;
        }
    }

    fn arrive(&mut self, to: usize) -> Result<(), Ended> {
        let Some((bytes, forged)) = self.wires[to].pop_front() else {
            return Ok(());
        };
        self.moves += 1;
        let receiver = &mut self.sides[to];
        receiver.posted_receives += 1;
        receiver
            .protocol
            .handle_received(bytes)
            .map_err(|_| Ended)?;
        if !forged {
            self.sides[1 - to].protocol.handle_send_complete();
        }
        Ok(())
    }

    /// One READ of `side` executes against the peer's exposed memory.
    fn read(&mut self, side: usize) -> Result<(), Ended> {
        let Some(read) = self.sides[side].reads.pop_front() else {
            return Ok(());
        };
        // The peer's windows: the READ must fall inside one with its rkey,
        // else the peer's device refuses it (remote access error).
        let window = self.sides[1 - side]
            .exposed
            .values()
            .find(|(addr, rkey, bytes)| {
                *rkey == read.rkey
                    && read.remote_addr >= *addr
                    && read
                        .remote_addr
                        .checked_add(read.len)
                        .is_some_and(|end| end <= *addr + bytes.len() as u64)
            });
        let Some((addr, _, bytes)) = window else {
            // Honest sides never READ a window that is gone: DONE (which
            // revokes it) goes out only once every READ of the frame
            // completed. Only a revocation on time-out may come first.
            assert!(
                self.forged || self.expired,
                "side {side} READ {} bytes at {:#x} (rkey {:#x}) outside every window its peer exposes: a READ after DONE",
                read.len,
                read.remote_addr,
                read.rkey
            );
            return Err(Ended);
        };
        let from = (read.remote_addr - addr) as usize;
        let chunk = bytes.slice(from..from + read.len as usize);
        let s = &mut self.sides[side];
        let destination = s
            .destinations
            .get_mut(&read.token)
            .expect("a READ has its destination");
        let at = read.offset as usize;
        destination[at..at + chunk.len()].copy_from_slice(&chunk);
        s.protocol.handle_read_complete(read.token, read.len);
        self.moves += 1;
        Ok(())
    }

    fn memory(&mut self, side: usize) {
        let peer_sent = self.sides[1 - side].sent.clone();
        let forged = self.forged;
        let s = &mut self.sides[side];
        let returned = s.protocol.take_returned();
        assert!(
            forged || returned <= s.posted_receives,
            "the peer returned more credits than slots are committed to it"
        );
        s.posted_receives = s.posted_receives.saturating_sub(returned);
        assert!(s.protocol.window() >= s.geometry.initial_credits);
        assert!(s.protocol.window() <= s.geometry.recv_slots);
        while let Some(event) = s.protocol.poll_event() {
            self.moves += 1;
            match event {
                Event::Allocate { token, len } => {
                    assert!(len <= s.geometry.max_frame_len);
                    assert!(
                        s.destinations
                            .insert(token, vec![0; len as usize])
                            .is_none()
                    );
                }
                Event::Release { token, .. } => {
                    assert!(
                        s.exposed.remove(&token).is_some(),
                        "released what was not exposed"
                    );
                }
            }
        }
        while let Some(read) = s.protocol.poll_read() {
            self.moves += 1;
            assert!(read.len > 0 && read.len <= s.limits.read_chunk_len);
            s.reads.push_back(read);
            assert!(s.reads.len() <= s.limits.max_outstanding_reads as usize);
        }
        while let Some(inbound) = s.protocol.poll_inbound() {
            self.moves += 1;
            let bytes = match inbound {
                Inbound::Frame(frame) => frame,
                Inbound::Pulled {
                    token,
                    len,
                    head,
                    tail,
                } => {
                    let mut bytes = s
                        .destinations
                        .remove(&token)
                        .expect("a pulled frame has its destination");
                    assert_eq!(bytes.len() as u64, len);
                    bytes[..head.len()].copy_from_slice(&head);
                    let tail_at = bytes.len() - tail.len();
                    bytes[tail_at..].copy_from_slice(&tail);
                    bytes.into()
                }
                Inbound::Refused { len, max, .. } => {
                    // Over the limit: refused alone, in its place.
                    assert!(len > max);
                    if !forged {
                        assert_eq!(peer_sent[s.delivered].len() as u64, len);
                    }
                    s.delivered += 1;
                    continue;
                }
                Inbound::Closed => continue,
            };
            if !forged {
                assert!(
                    bytes == peer_sent[s.delivered],
                    "frame {} differs",
                    s.delivered
                );
            }
            s.delivered += 1;
        }
    }

    fn check(&self) {
        for s in &self.sides {
            let p = &s.protocol;
            assert!(p.exposed() <= s.limits.max_exposed as usize);
            assert!(s.queued <= s.limits.max_queued);
            assert!(p.pulls() <= MAX_UNANSWERED as usize, "{} pulls", p.pulls());
            assert!(p.unanswered() <= MAX_UNANSWERED as usize);
            // Grants stop once max_pending wait; the peer may still use the
            // credits it holds and the DONE credits paid while holding (at
            // most max_exposed outstanding, one more per frame announced),
            // each message a BATCH of up to MAX_BATCH_FRAMES frames.
            let pending_bound = s.limits.max_pending as usize
                + (s.geometry.recv_slots as usize + s.limits.max_exposed as usize + s.announced)
                    * MAX_BATCH_FRAMES;
            assert!(
                p.pending() <= pending_bound,
                "{} messages wait for the application, bound {pending_bound}",
                p.pending()
            );
        }
    }
}

fn geometry(u: &mut Unstructured<'_>) -> arbitrary::Result<Geometry> {
    let slot_len = u.int_in_range(MIN_SLOT_LEN..=MIN_SLOT_LEN + 300)?;
    let recv_slots = u.int_in_range(3..=8)?;
    Ok(Geometry {
        recv_slots,
        initial_credits: u.int_in_range(3..=recv_slots)?,
        slot_len,
        eager_threshold: u.int_in_range(0..=slot_len - HEADER_LEN as u32)?,
        max_frame_len: u.int_in_range(1..=200_000)?,
    })
}

fn limits(u: &mut Unstructured<'_>) -> arbitrary::Result<Limits> {
    Ok(Limits {
        send_slots: u.int_in_range(1..=8)?,
        max_outstanding_reads: u.int_in_range(1..=4)?,
        read_chunk_len: u.int_in_range(256..=65536)?,
        max_active_pulls: u.int_in_range(1..=3)?,
        max_exposed: u.int_in_range(1..=4)?,
        max_queued: u.int_in_range(1..=8)?,
        max_queued_bytes: u.int_in_range(1..=4096)?,
        max_pending: u.int_in_range(1..=8)?,
        max_pending_bytes: u.int_in_range(1..=4096)?,
        max_exposed_bytes: u.int_in_range(1..=300_000)?,
        rendezvous_timeout: Duration::from_millis(u.int_in_range(1..=5000)?),
    })
}

impl Pair {
    /// Runs both drivers until nothing moves; false when the connection ended.
    fn settle(&mut self) -> bool {
        for side in &mut self.sides {
            side.protocol.set_hold_credits(false);
        }
        for _ in 0..100_000 {
            let before = self.moves;
            for side in 0..2 {
                self.transmit(side);
                while !self.wires[side].is_empty() {
                    if self.arrive(side).is_err() {
                        return false;
                    }
                }
                self.memory(side);
                while !self.sides[side].reads.is_empty() {
                    if self.read(side).is_err() {
                        return false;
                    }
                }
                self.memory(side);
            }
            self.check();
            if self.moves == before {
                return true;
            }
        }
        panic!("no quiescence");
    }
}

/// How far a run got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Reached {
    /// The input did not describe two sides.
    NoInput,
    /// The connection ended (a protocol error, or a READ refused).
    Ended,
    /// Something was forged, or time passed: checked as far as that allows.
    ForgedOrExpired,
    /// Run to quiescence, every frame checked as delivered; a side had
    /// closed, so credits were not cycled further.
    Delivered,
    /// Delivered, and credits cycled afterwards ([`Pair::credits_still_flow`]).
    CreditsCycled,
}

/// Plays the ops `u` describes on two connected sides and checks
/// everything the module docs list; panics on a violation. `honest`: no
/// forged messages and no time passing (those ops are skipped), so every
/// run that does not run out of input reaches the end-to-end checks; half
/// of them (the first byte decides) never close either.
pub(crate) fn run(u: &mut Unstructured<'_>, honest: bool) -> Reached {
    play(u, honest).unwrap_or(Reached::NoInput)
}

fn play(u: &mut Unstructured<'_>, honest: bool) -> arbitrary::Result<Reached> {
    // Half the honest runs never close, so that credits are cycled at the
    // end (a side that closed sends nothing more).
    let never_close = honest && u.arbitrary::<bool>()?;
    let (a, b) = (geometry(u)?, geometry(u)?);
    a.validate().expect("valid");
    b.validate().expect("valid");
    let mut pair = Pair {
        sides: [Side::new(a, b, limits(u)?), Side::new(b, a, limits(u)?)],
        wires: [VecDeque::new(), VecDeque::new()],
        now: Instant::now(),
        forged: false,
        expired: false,
        moves: 0,
    };
    for _ in 0..2000 {
        if u.is_empty() {
            break;
        }
        let Ok(op) = u.arbitrary::<Op>() else { break };
        if honest && matches!(op, Op::Forge { .. } | Op::Raw { .. } | Op::Advance { .. }) {
            continue;
        }
        if never_close && matches!(op, Op::Close { .. }) {
            continue;
        }
        if pair.apply(op).is_err() {
            return Ok(Reached::Ended);
        }
    }
    if pair.forged || pair.expired {
        return Ok(Reached::ForgedOrExpired);
    }
    if !pair.settle() {
        return Ok(Reached::Ended);
    }
    for side in 0..2 {
        let (s, peer) = (&pair.sides[side], &pair.sides[1 - side]);
        assert_eq!(
            s.delivered,
            peer.sent.len(),
            "side {side} received {} of {} frames",
            s.delivered,
            peer.sent.len()
        );
    }
    Ok(if pair.credits_still_flow() {
        Reached::CreditsCycled
    } else {
        Reached::Delivered
    })
}

impl Pair {
    /// After whatever came before, credits still cycle: while neither side
    /// ended, each sends more frames than its peer's whole window, one at a
    /// time and run to quiescence, and each arrives. A credit lost anywhere
    /// (never granted back, granted twice and then refused, a slot never
    /// re-counted) shows as a side that cannot send or a frame that never
    /// arrives.
    fn credits_still_flow(&mut self) -> bool {
        if self.sides.iter().any(|s| s.closed) {
            return false;
        }
        for round in 0..2 * self.sides[0]
            .geometry
            .recv_slots
            .max(self.sides[1].geometry.recv_slots)
            + 2
        {
            for side in 0..2 {
                let s = &self.sides[side];
                let len = (round as usize * 7) % (s.protocol.peer_max_frame_len() as usize + 1);
                let route = s.protocol.route(len);
                assert!(
                    s.protocol.can_send(route),
                    "side {side} cannot send a frame of {len} B at quiescence (round {round}): credits {}, window {}",
                    s.protocol.send_credits(),
                    self.sides[1 - side].protocol.window()
                );
                self.apply(Op::Send {
                    side: side == 1,
                    len: len as u16,
                    big: false,
                })
                .unwrap_or_else(|_| panic!("the connection ended on an honest frame"));
            }
            assert!(self.settle(), "the connection ended while credits cycled");
        }
        for side in 0..2 {
            assert_eq!(
                self.sides[side].delivered,
                self.sides[1 - side].sent.len(),
                "side {side}: frames lost while credits cycled"
            );
        }
        true
    }
}
