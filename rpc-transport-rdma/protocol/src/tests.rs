//! Two protocol endpoints wired together in memory: receive slots, send
//! slots and READs are simulated exactly enough to catch an RNR (a message
//! meeting no posted receive), a lost credit, or a frame out of order.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::*;

/// A fixed window of `slots` credits.
fn geometry(slots: u32, slot_len: u32) -> Geometry {
    windowed(slots, slots, slot_len)
}

/// A window that starts at `initial` credits and may grow to `max`.
fn windowed(initial: u32, max: u32, slot_len: u32) -> Geometry {
    Geometry {
        recv_slots: max,
        initial_credits: initial,
        slot_len,
        eager_threshold: slot_len - HEADER_LEN as u32,
        max_frame_len: 64 << 20,
    }
}

struct Side {
    protocol: Protocol,
    geometry: Geometry,
    /// Receives committed to the peer (its window in slots).
    posted_receives: u32,
    /// Slots the simulated shared pool can still commit to this side's peer.
    pool_spare: u32,
    /// The largest window this side gave its peer.
    max_window: u32,
    /// Our exposed frames: token → (addr, rkey, remote bytes, inline head length).
    exposed: HashMap<u64, (u64, u32, Bytes, usize)>,
    next_addr: u64,
    /// READ destinations: token → bytes.
    destinations: HashMap<u64, Vec<u8>>,
    delivered: Vec<Bytes>,
    /// Frames refused as over the limit: (length, limit).
    refused: Vec<(u64, u64)>,
    closed: bool,
    released: Vec<(u64, bool)>,
    max_reads_seen: u32,
    reads_in_flight: VecDeque<ReadRequest>,
    messages_sent: u64,
    credit_messages_sent: u64,
    /// The application reads only while fewer of its own frames than this
    /// await DONE (a server whose answers wait to be pulled stops taking
    /// calls); `usize::MAX` reads always.
    reads_while_exposed_below: usize,
    /// The application answers every frame it reads with one of this
    /// length (announced when large).
    answer_len: Option<usize>,
    /// Its answers go out one step after the read (a handler's latency).
    delay_answers: bool,
    delayed: Vec<Bytes>,
}

impl Side {
    fn new(local: Geometry, peer: Geometry, limits: Limits) -> Side {
        Side {
            protocol: Protocol::new(local, peer, limits),
            geometry: local,
            posted_receives: local.initial_credits,
            pool_spare: u32::MAX,
            max_window: local.initial_credits,
            exposed: HashMap::new(),
            next_addr: 0x1000_0000,
            destinations: HashMap::new(),
            delivered: Vec::new(),
            refused: Vec::new(),
            closed: false,
            released: Vec::new(),
            max_reads_seen: 0,
            reads_in_flight: VecDeque::new(),
            messages_sent: 0,
            credit_messages_sent: 0,
            reads_while_exposed_below: usize::MAX,
            answer_len: None,
            delay_answers: false,
            delayed: Vec::new(),
        }
    }

    /// What the driver does when the application sends `frame`.
    fn send(&mut self, frame: Bytes, now: Instant) {
        match self.protocol.route(frame.len()) {
            Route::Eager => self.protocol.send_eager(frame),
            Route::Rendezvous => {
                // Frames of different lengths carry heads of different
                // lengths inline (none for some), the rest is READ.
                // And tails of different lengths.
                let max_inline = self.protocol.max_announce_inline();
                let head_len = (frame.len() % 61).min(max_inline).min(frame.len() - 1);
                let tail_len = (frame.len() % 37)
                    .min(max_inline - head_len)
                    .min(frame.len() - 1 - head_len);
                let head = frame.slice(..head_len);
                let tail = frame.slice(frame.len() - tail_len..);
                let remote = frame.slice(head_len..frame.len() - tail_len);
                let addr = self.next_addr;
                self.next_addr += remote.len() as u64 + 4096;
                let rkey = (addr >> 12) as u32;
                let token =
                    self.protocol
                        .send_rendezvous(head, tail, addr, remote.len() as u64, rkey, now);
                self.exposed.insert(token, (addr, rkey, remote, head_len));
            }
        }
    }
}

struct Pair {
    a: Side,
    b: Side,
    now: Instant,
    /// Messages on the wire, a → b and b → a.
    wire_ab: VecDeque<Bytes>,
    wire_ba: VecDeque<Bytes>,
}

impl Pair {
    fn new(a: Geometry, b: Geometry, limits: Limits) -> Pair {
        Pair {
            a: Side::new(a, b, limits),
            b: Side::new(b, a, limits),
            now: Instant::now(),
            wire_ab: VecDeque::new(),
            wire_ba: VecDeque::new(),
        }
    }

    fn symmetric(slots: u32, slot_len: u32) -> Pair {
        Pair::new(
            geometry(slots, slot_len),
            geometry(slots, slot_len),
            Limits::default(),
        )
    }

    /// Everything each side wants to do, once; true when anything happened.
    fn step(&mut self) -> Result<bool, ProtocolError> {
        let mut progress = false;
        progress |= Self::transmit(&mut self.a, &mut self.b, &mut self.wire_ab);
        progress |= Self::transmit(&mut self.b, &mut self.a, &mut self.wire_ba);
        progress |= Self::arrive(&mut self.b, &mut self.a, &mut self.wire_ab)?;
        progress |= Self::arrive(&mut self.a, &mut self.b, &mut self.wire_ba)?;
        progress |= Self::memory(&mut self.a, &self.b);
        progress |= Self::memory(&mut self.b, &self.a);
        Ok(progress)
    }

    fn transmit(from: &mut Side, to: &mut Side, wire: &mut VecDeque<Bytes>) -> bool {
        let mut progress = false;
        while let Some(message) = from.protocol.poll_transmit() {
            let bytes = message.encode();
            assert!(
                bytes.len() <= to.geometry.slot_len as usize,
                "message of {} bytes overflows a {}-byte slot",
                bytes.len(),
                to.geometry.slot_len
            );
            assert!(
                to.posted_receives > 0,
                "RNR: a message met no posted receive"
            );
            to.posted_receives -= 1;
            from.messages_sent += 1;
            if message.body == Body::Credit {
                from.credit_messages_sent += 1;
            }
            wire.push_back(bytes);
            progress = true;
        }
        progress
    }

    /// Messages land: the receiver re-posts the slot and hands the message in;
    /// the sender's slot completes.
    fn arrive(
        to: &mut Side,
        from: &mut Side,
        wire: &mut VecDeque<Bytes>,
    ) -> Result<bool, ProtocolError> {
        let mut progress = false;
        while let Some(bytes) = wire.pop_front() {
            to.posted_receives += 1;
            to.protocol.handle_received(bytes)?;
            from.protocol.handle_send_complete();
            progress = true;
        }
        Ok(progress)
    }

    /// Events, READs (completed one step later) and deliveries of `side`,
    /// and what its driver does with the shared pool: commits the slots the
    /// window asks for (as far as the pool has them), releases returned ones.
    fn memory(side: &mut Side, peer: &Side) -> bool {
        let mut progress = false;
        for answer in std::mem::take(&mut side.delayed) {
            side.send(answer, Instant::now());
            progress = true;
        }
        let wanted = side.protocol.credits_wanted();
        if wanted > 0 {
            let committed = wanted.min(side.pool_spare);
            side.pool_spare -= committed;
            side.posted_receives += committed;
            side.protocol.grow_window(committed);
            side.max_window = side.max_window.max(side.protocol.window());
            progress |= committed > 0;
        }
        let returned = side.protocol.take_returned();
        if returned > 0 {
            side.posted_receives -= returned;
            side.pool_spare += returned;
            progress = true;
        }
        while let Some(read) = side.reads_in_flight.pop_front() {
            let (addr, rkey, remote, head_len) =
                peer.exposed.get(&read.token).expect("still exposed");
            assert_eq!(read.rkey, *rkey);
            let offset = (read.remote_addr - addr) as usize;
            let destination = side.destinations.get_mut(&read.token).expect("allocated");
            let head_len = *head_len;
            assert_eq!((head_len + offset) as u64, read.offset);
            destination[head_len + offset..head_len + offset + read.len as usize]
                .copy_from_slice(&remote[offset..offset + read.len as usize]);
            side.protocol.handle_read_complete(read.token, read.len);
            progress = true;
        }
        while let Some(event) = side.protocol.poll_event() {
            match event {
                Event::Allocate { token, len } => {
                    assert!(
                        side.destinations
                            .insert(token, vec![0; len as usize])
                            .is_none()
                    );
                }
                Event::Release { token, expired } => {
                    assert!(side.exposed.remove(&token).is_some(), "released twice");
                    side.released.push((token, expired));
                }
            }
            progress = true;
        }
        while let Some(read) = side.protocol.poll_read() {
            side.reads_in_flight.push_back(read);
            side.max_reads_seen = side.max_reads_seen.max(side.reads_in_flight.len() as u32);
            progress = true;
        }
        while side.protocol.exposed() + side.delayed.len() < side.reads_while_exposed_below {
            let Some(inbound) = side.protocol.poll_inbound() else {
                break;
            };
            match inbound {
                Inbound::Frame(read) => {
                    if let Some(len) = side.answer_len {
                        let answer = frame(len, read.len() as u8);
                        if side.delay_answers {
                            side.delayed.push(answer);
                        } else {
                            side.send(answer, Instant::now());
                        }
                    }
                    side.delivered.push(read);
                }
                Inbound::Pulled {
                    token,
                    len,
                    head,
                    tail,
                } => {
                    let mut bytes = side.destinations.remove(&token).expect("pulled");
                    assert_eq!(bytes.len() as u64, len);
                    bytes[..head.len()].copy_from_slice(&head);
                    let tail_at = bytes.len() - tail.len();
                    bytes[tail_at..].copy_from_slice(&tail);
                    side.delivered.push(bytes.into());
                }
                Inbound::Refused { len, max, .. } => side.refused.push((len, max)),
                Inbound::Closed => side.closed = true,
            }
            progress = true;
        }
        progress
    }

    fn run(&mut self) -> Result<(), ProtocolError> {
        for _ in 0..1_000_000 {
            if !self.step()? {
                return Ok(());
            }
        }
        panic!("no quiescence after a million steps");
    }
}

fn frame(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect::<Vec<u8>>()
        .into()
}

#[test]
fn eager_and_rendezvous_frames_arrive_in_send_order_byte_exact() {
    let mut pair = Pair::symmetric(8, 4096);
    let sizes = [1, 4080, 4081, 100_000, 5, 3 << 20, 0, 70_000, 12];
    let frames: Vec<Bytes> = sizes
        .iter()
        .enumerate()
        .map(|(i, len)| frame(*len, i as u8))
        .collect();
    for f in &frames {
        pair.a.send(f.clone(), pair.now);
    }
    pair.run().unwrap();
    assert_eq!(pair.b.delivered, frames);
    // Every announced frame was released by DONE, none by the timeout.
    assert_eq!(pair.a.exposed.len(), 0);
    assert!(pair.a.released.iter().all(|(_, expired)| !expired));
    assert_eq!(pair.a.protocol.exposed(), 0);
    assert_eq!(pair.b.protocol.pulls(), 0);
}

/// The soak's deadlock (CI, stop 38): a server stops reading calls while
/// its announced answers await DONE; calls pile up in front of it, so it
/// holds credits back; the client, out of credits, could not send the DONEs
/// the server waited for. Held credits now never strand a DONE: every
/// call is read and answered, every answer released by DONE.
#[test]
fn a_side_that_stops_reading_until_its_answers_are_pulled_still_gets_their_dones() {
    let limits = Limits {
        max_pending_bytes: 4 << 10,
        ..Limits::default()
    };
    let client = geometry(4, 2048);
    let server = geometry(4, 2048);
    let mut pair = Pair::new(client, server, limits);
    pair.b.reads_while_exposed_below = 2;
    pair.b.answer_len = Some(20_000);
    let calls: Vec<Bytes> = (0..300).map(|i| frame(1000, i as u8)).collect();
    for call in &calls {
        pair.a.send(call.clone(), pair.now);
    }
    pair.run().unwrap();
    assert_eq!(pair.b.delivered, calls);
    assert_eq!(pair.a.delivered.len(), calls.len());
    assert!(pair.a.delivered.iter().all(|answer| answer.len() == 20_000));
    assert!(pair.b.released.iter().all(|(_, expired)| !expired));
    assert_eq!(pair.b.protocol.exposed(), 0);
}

/// One run of a server that reads a call only while fewer than `k` of its
/// answers await DONE (or wait to be sent), with small windows and pending
/// bounds: every call read, every answer delivered, or why not.
#[allow(clippy::too_many_arguments)]
fn server_waiting_for_dones(
    windows: (u32, u32),
    max_exposed: u32,
    k: usize,
    max_pending_bytes: usize,
    call_len: usize,
    delay_answers: bool,
) -> Result<(), String> {
    let limits = Limits {
        max_pending_bytes,
        max_exposed,
        ..Limits::default()
    };
    let mut pair = Pair::new(geometry(windows.0, 2048), geometry(windows.1, 2048), limits);
    pair.b.reads_while_exposed_below = k;
    pair.b.answer_len = Some(20_000);
    pair.b.delay_answers = delay_answers;
    let calls: Vec<Bytes> = (0..300).map(|i| frame(call_len, i as u8)).collect();
    for call in &calls {
        pair.a.send(call.clone(), pair.now);
    }
    pair.run().map_err(|error| error.to_string())?;
    if pair.b.delivered.len() != calls.len() || pair.a.delivered.len() != calls.len() {
        return Err(format!(
            "stuck: the server read {} calls, the client got {} answers",
            pair.b.delivered.len(),
            pair.a.delivered.len()
        ));
    }
    Ok(())
}

/// A second reader's sweep (session 34): the first fixes deadlocked here
/// when the server took one call at a time through a long spell of holding
/// (an honest client spent the credits meant for its DONEs on calls), or
/// answered a step late.
#[test]
fn servers_waiting_for_dones_never_deadlock_across_windows_and_bounds() {
    let mut failures = Vec::new();
    for windows in [(3, 3), (3, 4), (4, 3), (4, 4), (8, 8)] {
        for max_exposed in [1, 2, 16] {
            // The harness's server exposes up to `k` answers: within the bound.
            for k in [1, 2, 8].into_iter().filter(|k| *k <= max_exposed as usize) {
                for max_pending_bytes in [1 << 10, 4 << 10] {
                    for call_len in [100, 1000] {
                        for delay in [false, true] {
                            if let Err(why) = server_waiting_for_dones(
                                windows,
                                max_exposed,
                                k,
                                max_pending_bytes,
                                call_len,
                                delay,
                            ) {
                                failures.push(format!(
                                    "windows {windows:?} max_exposed {max_exposed} k {k} \
                                     max_pending_bytes {max_pending_bytes} call {call_len} \
                                     late answers {delay}: {why}"
                                ));
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn one_way_flood_returns_credits_without_rnr() {
    // b never sends a frame: every credit a gets back comes from CREDIT messages.
    let mut pair = Pair::symmetric(16, 256);
    let mut sent = Vec::new();
    for round in 0..500u32 {
        for i in 0..7 {
            let f = frame((round as usize * 7 + i) % 200, i as u8);
            sent.push(f.clone());
            pair.a.send(f, pair.now);
        }
        pair.step().unwrap();
    }
    pair.run().unwrap();
    assert_eq!(pair.b.delivered, sent);
    assert!(pair.b.credit_messages_sent > 0);
    // Batched: far fewer credit messages than frames.
    assert!(
        pair.b.credit_messages_sent * 3 < sent.len() as u64,
        "{} credit messages for {} frames",
        pair.b.credit_messages_sent,
        sent.len()
    );
}

#[test]
fn both_directions_at_full_load_with_the_smallest_pools() {
    // Three slots a side, the minimum. Any credit bug deadlocks (run() never
    // delivers everything), livelocks (run() never quiesces) or overruns (the
    // harness asserts RNR).
    for slots in [3, 4, 5] {
        let mut pair = Pair::symmetric(slots, 128);
        let mut sent_a = Vec::new();
        let mut sent_b = Vec::new();
        for i in 0..300 {
            let fa = frame(i % 100, 1);
            let fb = frame((i * 7) % 300, 2); // some are rendezvous
            pair.a.send(fa.clone(), pair.now);
            pair.b.send(fb.clone(), pair.now);
            sent_a.push(fa);
            sent_b.push(fb);
        }
        pair.run().unwrap();
        assert_eq!(pair.b.delivered, sent_a, "slots={slots}");
        assert_eq!(pair.a.delivered, sent_b, "slots={slots}");
    }
}

#[test]
fn held_credits_stop_the_peer_and_release_resumes_it() {
    let mut pair = Pair::symmetric(8, 256);
    pair.b.protocol.set_hold_credits(true);
    for i in 0..50 {
        pair.a.send(frame(100, i), pair.now);
    }
    pair.run().unwrap();
    // a spent its credits down to the reserve and stopped: 7 messages, each
    // a BATCH of the two 100-byte frames that fill a 256-byte slot.
    assert_eq!(pair.a.messages_sent, 7);
    assert_eq!(pair.b.delivered.len(), 14);
    assert_eq!(pair.a.protocol.send_credits(), 1);
    pair.b.protocol.set_hold_credits(false);
    pair.run().unwrap();
    assert_eq!(pair.b.delivered.len(), 50);
}

#[test]
fn reads_are_chunked_and_bounded() {
    let limits = Limits {
        max_outstanding_reads: 3,
        read_chunk_len: 64 << 10,
        max_active_pulls: 2,
        ..Limits::default()
    };
    let mut pair = Pair::new(geometry(8, 1024), geometry(8, 1024), limits);
    let frames: Vec<Bytes> = (0..5).map(|i| frame(1 << 20, i)).collect();
    for f in &frames {
        pair.a.send(f.clone(), pair.now);
    }
    pair.step().unwrap();
    pair.step().unwrap();
    assert!(
        pair.b.destinations.len() <= 2,
        "at most two destinations at once"
    );
    pair.run().unwrap();
    assert_eq!(pair.b.delivered, frames);
    assert_eq!(pair.b.max_reads_seen, 3);
}

#[test]
fn an_announcement_over_the_limit_is_refused_alone_before_allocating() {
    let small = Geometry {
        max_frame_len: 1 << 20,
        ..geometry(8, 1024)
    };
    let mut pair = Pair::new(geometry(8, 1024), small, Limits::default());
    let before = frame(100, 1);
    let after = frame(200, 2);
    pair.a.send(before.clone(), pair.now);
    pair.a.send(frame((1 << 20) + 1, 0), pair.now);
    pair.a.send(after.clone(), pair.now);
    pair.run().unwrap();
    // Nothing was allocated or read for it; the frames around it arrive.
    assert!(pair.b.destinations.is_empty());
    assert_eq!(pair.b.delivered, vec![before, after]);
    assert_eq!(
        pair.b.refused,
        vec![((1 << 20) + 1, 1 << 20)],
        "refused, in order, with its length and the limit"
    );
    // DONE came back: the sender revoked its window (not by the timeout).
    assert!(pair.a.exposed.is_empty());
    assert_eq!(pair.a.released.len(), 1);
    assert!(!pair.a.released[0].1, "released by DONE");
}

fn received(protocol: &mut Protocol, credits: u32, body: Body) -> Result<(), ProtocolError> {
    protocol.handle_received(Message { credits, body }.encode())
}

#[test]
fn forged_and_broken_messages_are_errors() {
    let g = geometry(4, 1024);
    let fresh = || Protocol::new(g, g, Limits::default());
    let announce = |token, len| {
        Body::Announce(Announce {
            token,
            addr: 0x1000,
            len,
            rkey: 1,
            head: Bytes::new(),
            tail: Bytes::new(),
        })
    };

    let mut p = fresh();
    assert_eq!(
        received(&mut p, 0, announce(1, 0)),
        Err(ProtocolError::EmptyAnnounce)
    );
    let mut p = fresh();
    received(&mut p, 0, announce(1, 10)).unwrap();
    assert_eq!(
        received(&mut p, 0, announce(1, 10)),
        Err(ProtocolError::DuplicateToken(1))
    );
    let mut p = fresh();
    assert_eq!(
        received(&mut p, 0, Body::Done { token: 5 }),
        Err(ProtocolError::UnknownToken(5))
    );
    let mut p = fresh();
    assert!(matches!(
        received(&mut p, 1, Body::Credit),
        Err(ProtocolError::CreditOverflow { .. })
    ));
    let mut p = fresh();
    for _ in 0..4 {
        received(&mut p, 0, Body::Data(Bytes::new())).unwrap();
    }
    assert!(matches!(
        received(&mut p, 0, Body::Data(Bytes::new())),
        Err(ProtocolError::CreditOverrun {
            received: 5,
            granted: 4
        })
    ));
    let mut p = fresh();
    received(&mut p, 0, Body::Close).unwrap();
    assert_eq!(
        received(&mut p, 0, Body::Data(Bytes::new())),
        Err(ProtocolError::AfterClose)
    );
    let mut p = fresh();
    assert!(matches!(
        p.handle_received(Bytes::from_static(b"short")),
        Err(ProtocolError::Message(MessageError::Truncated { len: 5 }))
    ));
    // The inline head counts toward the frame limit: a remote part exactly
    // at the limit plus one head byte is too large, refused before any
    // destination is taken.
    let mut p = fresh();
    let over = Body::Announce(Announce {
        token: 1,
        addr: 0x1000,
        len: g.max_frame_len,
        rkey: 1,
        head: Bytes::from_static(b"h"),
        tail: Bytes::new(),
    });
    received(&mut p, 0, over).unwrap();
    assert_refused(&mut p, g.max_frame_len + 1, g.max_frame_len);
    // A length that would wrap around with the head added is too large, not small.
    let mut p = fresh();
    let wrapping = Body::Announce(Announce {
        token: 1,
        addr: 0,
        len: u64::MAX,
        rkey: 1,
        head: Bytes::from_static(b"hh"),
        tail: Bytes::new(),
    });
    received(&mut p, 0, wrapping).unwrap();
    assert_refused(&mut p, u64::MAX, g.max_frame_len);
    // So does the inline tail.
    let mut p = fresh();
    let over = Body::Announce(Announce {
        token: 1,
        addr: 0x1000,
        len: g.max_frame_len - 1,
        rkey: 1,
        head: Bytes::from_static(b"h"),
        tail: Bytes::from_static(b"t"),
    });
    received(&mut p, 0, over).unwrap();
    assert_refused(&mut p, g.max_frame_len + 1, g.max_frame_len);
}

/// A frame whose head the layer above refuses is refused as one over the
/// size limit is (nothing pulled, DONE at once); one it accepts is pulled.
#[test]
fn an_announced_frame_whose_head_is_refused_is_never_pulled() {
    let g = geometry(4, 1024);
    let announce = |head: &'static [u8]| {
        Body::Announce(Announce {
            token: 1,
            addr: 0x1000,
            len: 5000,
            rkey: 1,
            head: Bytes::from_static(head),
            tail: Bytes::new(),
        })
    };
    let mut p =
        Protocol::new(g, g, Limits::default()).refusing_heads(|head| head.starts_with(b"bad"));
    received(&mut p, 0, announce(b"bad head")).unwrap();
    assert_refused(&mut p, 5008, g.max_frame_len);
    let mut p =
        Protocol::new(g, g, Limits::default()).refusing_heads(|head| head.starts_with(b"bad"));
    received(&mut p, 0, announce(b"good head")).unwrap();
    assert!(
        !matches!(p.poll_inbound(), Some(Inbound::Refused { .. })),
        "an accepted head is pulled"
    );
}

/// `p` refused the frame it was just announced: nothing allocated, the
/// refusal handed up, a DONE for it sent.
fn assert_refused(p: &mut Protocol, len: u64, max: u64) {
    assert_eq!(p.poll_event(), None, "nothing allocated");
    assert!(matches!(
        p.poll_inbound(),
        Some(Inbound::Refused { len: l, max: m, .. }) if l == len && m == max
    ));
    let done =
        std::iter::from_fn(|| p.poll_transmit()).find(|m| matches!(m.body, Body::Done { .. }));
    assert!(done.is_some(), "DONE sent for the refused frame");
}

#[test]
fn an_unanswered_announcement_is_revoked_after_the_timeout() {
    let limits = Limits {
        rendezvous_timeout: Duration::from_secs(5),
        ..Limits::default()
    };
    let g = geometry(4, 1024);
    let mut p = Protocol::new(g, g, limits);
    let start = Instant::now();
    let token = p.send_rendezvous(Bytes::new(), Bytes::new(), 0x1000, 5000, 7, start);
    assert!(p.poll_transmit().is_some());
    assert_eq!(p.poll_timeout(), Some(start + Duration::from_secs(5)));
    p.handle_timeout(start + Duration::from_secs(4));
    assert_eq!(p.poll_event(), None);
    p.handle_timeout(start + Duration::from_secs(5));
    assert_eq!(
        p.poll_event(),
        Some(Event::Release {
            token,
            expired: true
        })
    );
    assert_eq!(p.poll_timeout(), None);
    // A DONE that comes too late is harmless.
    received(&mut p, 0, Body::Done { token }).unwrap();
    assert_eq!(p.poll_event(), None);
}

#[test]
fn close_is_ordered_after_frames_and_both_sides_finish() {
    let mut pair = Pair::symmetric(4, 512);
    pair.a.send(frame(100, 1), pair.now);
    pair.a.send(frame(10_000, 2), pair.now);
    pair.a.protocol.close();
    assert!(!pair.a.protocol.can_send(Route::Eager));
    pair.run().unwrap();
    assert_eq!(pair.b.delivered.len(), 2);
    assert!(pair.b.closed);
    assert!(!pair.a.protocol.is_finished(), "b has not closed yet");
    pair.b.protocol.close();
    pair.run().unwrap();
    assert!(pair.a.closed);
    assert!(pair.a.protocol.is_finished());
    assert!(pair.b.protocol.is_finished());
}

#[test]
fn geometry_round_trips_and_bad_geometry_is_refused() {
    let g = geometry(64, 8192);
    assert_eq!(Geometry::decode(&g.encode()).unwrap(), g);
    assert!(Geometry::decode(&g.encode()[..19]).is_err());
    let two_slots = Geometry { recv_slots: 2, ..g };
    assert!(Geometry::decode(&two_slots.encode()).is_err());
    let tiny_slots = Geometry { slot_len: 20, ..g };
    assert!(Geometry::decode(&tiny_slots.encode()).is_err());
    let eager_too_big = Geometry {
        eager_threshold: 8192,
        ..g
    };
    assert!(Geometry::decode(&eager_too_big.encode()).is_err());
}

#[test]
fn every_geometry_field_out_of_bounds_is_refused_by_name_value_and_bound() {
    let g = geometry(128, 8192 + HEADER_LEN as u32);
    g.validate().unwrap();
    // The extremes are accepted.
    for ok in [
        Geometry {
            recv_slots: MIN_RECV_SLOTS,
            initial_credits: MIN_RECV_SLOTS,
            slot_len: MIN_SLOT_LEN,
            eager_threshold: 0,
            max_frame_len: 0,
        },
        Geometry {
            recv_slots: MAX_RECV_SLOTS,
            initial_credits: MAX_RECV_SLOTS,
            slot_len: MAX_SLOT_LEN,
            eager_threshold: MAX_EAGER_THRESHOLD,
            max_frame_len: MAX_FRAME_LEN,
        },
    ] {
        assert_eq!(Geometry::decode(&ok.encode()), Ok(ok));
    }
    let cases = [
        (
            Geometry {
                initial_credits: 2,
                ..g
            },
            "initial_credits = 2 ",
            "3..=128",
        ),
        (
            Geometry {
                initial_credits: 129,
                ..g
            },
            "initial_credits = 129 ",
            "3..=128",
        ),
        (
            Geometry { recv_slots: 2, ..g },
            "recv_slots = 2 ",
            "3..=65536",
        ),
        (
            Geometry {
                recv_slots: MAX_RECV_SLOTS + 1,
                ..g
            },
            "recv_slots = 65537 ",
            "3..=65536",
        ),
        (
            Geometry {
                recv_slots: u32::MAX,
                ..g
            },
            "recv_slots = 4294967295 ",
            "3..=65536",
        ),
        (
            Geometry {
                slot_len: MIN_SLOT_LEN - 1,
                eager_threshold: 0,
                ..g
            },
            "slot_len = 47 ",
            "48..=1048592",
        ),
        (
            Geometry {
                slot_len: u32::MAX,
                ..g
            },
            "slot_len = 4294967295 ",
            "48..=1048592",
        ),
        (
            Geometry {
                eager_threshold: 8193,
                ..g
            },
            "eager_threshold = 8193 ",
            "0..=8192",
        ),
        (
            Geometry {
                eager_threshold: u32::MAX,
                ..g
            },
            "eager_threshold = 4294967295 ",
            "0..=8192",
        ),
        (
            Geometry {
                max_frame_len: MAX_FRAME_LEN + 1,
                ..g
            },
            "max_frame_len = 4294967296 ",
            "0..=4294967295",
        ),
        (
            Geometry {
                max_frame_len: u64::MAX,
                ..g
            },
            "max_frame_len = 18446744073709551615 ",
            "0..=4294967295",
        ),
    ];
    for (bad, field, bound) in cases {
        let error = Geometry::decode(&bad.encode()).unwrap_err();
        assert!(matches!(error, ProtocolError::Geometry(_)), "{error:?}");
        let message = error.to_string();
        assert!(message.contains(field), "{message}");
        assert!(message.contains(bound), "{message}");
    }
    // The attack hello's geometry: everything at its type's maximum.
    let absurd = Geometry {
        recv_slots: u32::MAX,
        initial_credits: u32::MAX,
        slot_len: u32::MAX,
        eager_threshold: u32::MAX - HEADER_LEN as u32,
        max_frame_len: u64::MAX,
    };
    assert!(Geometry::decode(&absurd.encode()).is_err());
    let error = Geometry::decode(&[0; 7]).unwrap_err().to_string();
    assert!(error.contains("7 bytes"), "{error}");
}

/// Found while writing the protocol_state fuzz target (forged announcements):
/// an announcement whose range wraps around the address space made the READ
/// of its second chunk compute `addr + offset` past `u64::MAX` (a panic with
/// overflow checks, a READ at a wrapped address without).
#[test]
fn an_announcement_whose_range_wraps_is_refused() {
    let g = geometry(4, 1024);
    let limits = Limits {
        read_chunk_len: 64,
        ..Limits::default()
    };
    let mut p = Protocol::new(g, g, limits);
    let error = received(
        &mut p,
        0,
        Body::Announce(Announce {
            token: 1,
            addr: u64::MAX - 100,
            len: 1000,
            rkey: 1,
            head: Bytes::new(),
            tail: Bytes::new(),
        }),
    )
    .unwrap_err();
    assert_eq!(
        error,
        ProtocolError::AnnounceRange {
            addr: u64::MAX - 100,
            len: 1000
        }
    );
    assert!(error.to_string().contains("wraps"), "{error}");
    assert_eq!(p.poll_event(), None, "nothing allocated");
    // The last byte of the address space is a valid end.
    let mut p = Protocol::new(g, g, limits);
    received(
        &mut p,
        0,
        Body::Announce(Announce {
            token: 1,
            addr: u64::MAX - 1000,
            len: 1000,
            rkey: 1,
            head: Bytes::new(),
            tail: Bytes::new(),
        }),
    )
    .unwrap();
    assert!(matches!(p.poll_event(), Some(Event::Allocate { .. })));
    let mut end = 0;
    while let Some(read) = p.poll_read() {
        end = read.remote_addr + read.len;
        p.handle_read_complete(read.token, read.len);
    }
    assert_eq!(end, u64::MAX);
}

#[test]
fn a_deferred_allocation_issues_no_read_and_is_asked_for_again() {
    let g = Geometry {
        recv_slots: 16,
        initial_credits: 16,
        slot_len: 4096,
        eager_threshold: 4096 - HEADER_LEN as u32,
        max_frame_len: 1 << 20,
    };
    let mut p = Protocol::new(g, g, Limits::default());
    received(
        &mut p,
        0,
        Body::Announce(Announce {
            token: 9,
            addr: 4096,
            len: 100_000,
            rkey: 1,
            head: Bytes::new(),
            tail: Bytes::new(),
        }),
    )
    .unwrap();
    let Some(Event::Allocate { token, len }) = p.poll_event() else {
        panic!("allocation asked for");
    };
    assert_eq!((token, len), (9, 100_000));
    p.defer_allocation(token);
    assert_eq!(p.poll_read(), None, "no READ without a destination");
    assert!(
        matches!(p.poll_event(), Some(Event::Allocate { token: 9, .. })),
        "asked for again"
    );
    assert!(p.poll_read().is_some(), "READs once allocated");
}

/// A peer that follows the credit rules exactly (else it only earns a
/// CreditOverrun) and otherwise does what hurts: what it may send and grant
/// is tracked here, the rest is up to each test.
#[derive(Default)]
struct Hostile {
    /// Credits `p` granted it and it has not spent.
    credits: u64,
    /// `p`'s messages it received and has not granted back.
    owed: u32,
}

impl Hostile {
    /// Takes everything `p` transmits now (its SENDs complete at once).
    fn take(&mut self, p: &mut Protocol) -> usize {
        let mut count = 0;
        while let Some(message) = p.poll_transmit() {
            p.handle_send_complete();
            self.credits += u64::from(message.credits);
            self.owed += 1;
            count += 1;
        }
        count
    }

    /// Sends `body` to `p` granting `grant` (≤ what it owes) if it has a credit.
    fn send(
        &mut self,
        p: &mut Protocol,
        grant: u32,
        body: Body,
    ) -> Option<Result<(), ProtocolError>> {
        if self.credits == 0 {
            return None;
        }
        self.credits -= 1;
        let grant = grant.min(self.owed);
        self.owed -= grant;
        Some(received(p, grant, body))
    }
}

/// What a hostile peer can make this side hold: it announces one frame that
/// is never pulled to the end and floods eager frames behind it, granting
/// back every credit it may so this side keeps granting too. Without a bound
/// the queue of messages waiting for the application grew with every round;
/// now credits are held once `max_pending` wait, and the peer can add at
/// most what it still has (our receive slots), then stalls.
#[test]
fn a_flooding_peer_cannot_grow_what_waits_for_the_application() {
    let g = geometry(8, 1024);
    let limits = Limits {
        max_pending: 16,
        ..Limits::default()
    };
    let mut p = Protocol::new(g, g, limits);
    let mut peer = Hostile {
        credits: 8,
        owed: 0,
    };
    let announce = Body::Announce(Announce {
        token: 1,
        addr: 0x1000,
        len: 1 << 20,
        rkey: 1,
        head: Bytes::new(),
        tail: Bytes::new(),
    });
    peer.send(&mut p, 0, announce).unwrap().unwrap();
    let mut stalled = false;
    for _ in 0..10_000 {
        let mut sent = 0;
        while let Some(result) = peer.send(&mut p, u32::MAX, Body::Data(Bytes::from_static(b"x"))) {
            result.unwrap();
            sent += 1;
        }
        let transmitted = peer.take(&mut p);
        assert!(
            p.pending() <= 16 + 8,
            "{} messages wait for the application",
            p.pending()
        );
        if sent == 0 && transmitted == 0 {
            stalled = true;
            break;
        }
    }
    assert!(stalled, "the peer was stopped");
    // Once the application takes what waits (here: the pull finishes), the
    // credits flow again.
    while let Some(event) = p.poll_event() {
        assert!(matches!(event, Event::Allocate { .. }));
    }
    while let Some(read) = p.poll_read() {
        p.handle_read_complete(read.token, read.len);
    }
    while p.poll_inbound().is_some() {}
    assert!(peer.take(&mut p) > 0);
    assert!(peer.credits > 0);
}

/// A peer that keeps announcing (the same window under new tokens) while it
/// grants this side just enough credits for CREDIT messages, never two for
/// a DONE: the DONEs queued without bound. Now more than MAX_UNANSWERED
/// announcements awaiting DONE are a protocol error.
#[test]
fn announcements_awaiting_done_are_bounded() {
    let g = geometry(8, 1024);
    let mut p = Protocol::new(g, g, Limits::default());
    let mut peer = Hostile {
        credits: 8,
        owed: 0,
    };
    let mut token = 0;
    let error = 'run: loop {
        assert!(token < 100_000, "never refused");
        // One credit when this side has none: enough for a CREDIT message.
        let grant = u32::from(p.send_credits() == 0);
        if peer.credits == 0 && grant == 0 && peer.take(&mut p) == 0 {
            panic!("stalled after {token} announcements");
        }
        while peer.credits > 0 {
            token += 1;
            let announce = Body::Announce(Announce {
                token,
                addr: 0x1000,
                len: 1,
                rkey: 1,
                head: Bytes::new(),
                tail: Bytes::new(),
            });
            let grant = u32::from(p.send_credits() == 0);
            if let Some(Err(error)) = peer.send(&mut p, grant, announce) {
                break 'run error;
            }
            // This side pulls and delivers at once.
            while let Some(event) = p.poll_event() {
                assert!(matches!(event, Event::Allocate { .. }));
            }
            while let Some(read) = p.poll_read() {
                p.handle_read_complete(read.token, read.len);
            }
            while p.poll_inbound().is_some() {}
            assert_eq!(p.pulls(), 0);
        }
        peer.take(&mut p);
        assert!(p.unanswered() <= MAX_UNANSWERED as usize);
    };
    assert_eq!(
        error,
        ProtocolError::TooManyUnanswered {
            max: MAX_UNANSWERED
        }
    );
    assert_eq!(p.unanswered(), MAX_UNANSWERED as usize);
}

/// The receiver's window grows while a pipelining peer keeps running out of
/// credits, never past `recv_slots`, and shrinks back to the initial credits
/// once the peer, idle, returns what it holds beyond them; no message ever
/// meets a receive that was not committed (the harness asserts it).
#[test]
fn a_window_grows_under_a_pipeline_and_is_returned_when_idle() {
    let g = windowed(4, 128, 1024);
    let mut pair = Pair::new(g, g, Limits::default());
    let frames: Vec<Bytes> = (0..2_000).map(|i| frame(100, i as u8)).collect();
    for f in &frames {
        pair.a.send(f.clone(), pair.now);
    }
    pair.run().unwrap();
    assert_eq!(pair.b.delivered, frames);
    assert!(
        pair.b.max_window > 4,
        "the window never grew: {}",
        pair.b.max_window
    );
    assert!(pair.b.max_window <= 128);
    let committed = pair.b.posted_receives;
    assert_eq!(committed, pair.b.protocol.window());
    assert!(pair.a.protocol.excess_credits() > 0);
    // Idle: a gives back what it holds beyond b's initial credits.
    assert!(pair.a.protocol.return_credits());
    assert!(!pair.a.protocol.return_credits(), "one RETURN at a time");
    pair.run().unwrap();
    assert_eq!(pair.b.protocol.window(), 4);
    assert_eq!(pair.b.posted_receives, 4);
    assert_eq!(
        pair.b.pool_spare,
        u32::MAX,
        "every grown slot went back to the pool"
    );
    assert!(pair.a.protocol.send_credits() >= 3);
    assert_eq!(pair.a.protocol.excess_credits(), 0);
    assert!(
        !pair.a.protocol.return_credits(),
        "nothing left to give back"
    );
    // And it grows again when the load comes back.
    for f in &frames {
        pair.a.send(f.clone(), pair.now);
    }
    pair.run().unwrap();
    assert_eq!(pair.b.delivered.len(), 2 * frames.len());
    assert!(pair.b.protocol.window() > 4);
}

/// One call at a time never needs more than the initial credits: the window
/// of an idle or ping-pong connection stays at its few slots.
#[test]
fn ping_pong_never_grows_the_window() {
    let g = windowed(4, 128, 1024);
    let mut pair = Pair::new(g, g, Limits::default());
    for i in 0..500 {
        pair.a.send(frame(200, i as u8), pair.now);
        pair.run().unwrap();
        pair.b.send(frame(300, i as u8), pair.now);
        pair.run().unwrap();
    }
    assert_eq!(pair.b.delivered.len(), 500);
    assert_eq!(pair.a.delivered.len(), 500);
    assert_eq!(pair.a.max_window, 4);
    assert_eq!(pair.b.max_window, 4);
}

/// A pool with nothing to spare keeps the window at its initial credits and
/// everything still arrives, in both directions at once.
#[test]
fn an_exhausted_pool_keeps_the_window_small_and_loses_nothing() {
    let g = windowed(3, 1024, 512);
    let mut pair = Pair::new(g, g, Limits::default());
    pair.a.pool_spare = 0;
    pair.b.pool_spare = 2;
    let frames: Vec<Bytes> = (0..1_000).map(|i| frame(50 + i % 400, i as u8)).collect();
    for f in &frames {
        pair.a.send(f.clone(), pair.now);
        pair.b.send(f.clone(), pair.now);
    }
    pair.run().unwrap();
    assert_eq!(pair.a.delivered, frames);
    assert_eq!(pair.b.delivered, frames);
    assert_eq!(pair.a.max_window, 3);
    assert_eq!(pair.b.max_window, 5);
}

/// A RETURN must give back credits the peer holds, beyond the initial ones.
#[test]
fn forged_returns_are_errors() {
    let g = windowed(4, 128, 1024);
    // The window is at its initial credits: nothing may be returned.
    let mut p = Protocol::new(g, g, Limits::default());
    let error = received(&mut p, 0, Body::Return { credits: 1 }).unwrap_err();
    assert!(
        matches!(
            error,
            ProtocolError::BadReturn {
                returned: 1,
                beyond_initial: 0,
                ..
            }
        ),
        "{error:?}"
    );
    // Grown by 10, the peer holds 14 − 1 (this message): returning 11 is
    // more than the growth.
    let mut p = Protocol::new(g, g, Limits::default());
    p.grow_window(10);
    p.send_eager(frame(10, 1));
    assert_eq!(p.poll_transmit().unwrap().credits, 10);
    let error = received(&mut p, 0, Body::Return { credits: 11 }).unwrap_err();
    assert!(
        matches!(error, ProtocolError::BadReturn { .. }),
        "{error:?}"
    );
    let mut p = Protocol::new(g, g, Limits::default());
    p.grow_window(10);
    p.send_eager(frame(10, 1));
    assert_eq!(p.poll_transmit().unwrap().credits, 10);
    received(&mut p, 0, Body::Return { credits: 10 }).unwrap();
    assert_eq!(p.window(), 4);
    assert_eq!(p.take_returned(), 10);
    assert_eq!(p.take_returned(), 0);
    // A RETURN of nothing does not even decode.
    let mut zero = Message {
        credits: 0,
        body: Body::Return { credits: 1 },
    }
    .encode()
    .to_vec();
    zero[8] = 0;
    assert!(Message::decode(zero.into()).is_err());
}

#[test]
fn eager_frames_queued_at_once_share_messages_in_order() {
    // 10-byte frames: (256 - 16) / (4 + 10) = 17 fit one 256-byte slot.
    let mut pair = Pair::symmetric(8, 256);
    let frames: Vec<Bytes> = (0..100).map(|i| frame(10, i)).collect();
    for f in &frames {
        pair.a.send(f.clone(), pair.now);
    }
    pair.run().unwrap();
    assert_eq!(pair.b.delivered, frames);
    let data_messages = pair.a.messages_sent - pair.a.credit_messages_sent;
    assert!(
        (6..=8).contains(&data_messages),
        "100 frames, 17 a slot: {data_messages} messages"
    );

    // A rendezvous frame ends a batch: what is queued after it goes after it.
    let mut p = Protocol::new(geometry(8, 4096), geometry(8, 4096), Limits::default());
    p.send_eager(frame(1, 1));
    p.send_eager(frame(1, 2));
    p.send_rendezvous(frame(3, 3), Bytes::new(), 0x1000, 8192, 7, Instant::now());
    p.send_eager(frame(1, 4));
    let kinds: Vec<Body> = std::iter::from_fn(|| p.poll_transmit().map(|m| m.body)).collect();
    assert!(
        matches!(&kinds[..], [Body::Batch(two), Body::Announce(_), Body::Data(last)]
            if two == &[frame(1, 1), frame(1, 2)] && last == &frame(1, 4)),
        "{kinds:?}"
    );
}

#[test]
fn a_batch_holds_at_most_max_batch_frames() {
    let mut p = Protocol::new(geometry(8, 4096), geometry(8, 4096), Limits::default());
    for i in 0..100 {
        p.send_eager(frame(1, i));
    }
    let first = p.poll_transmit().expect("credits and a slot");
    let Body::Batch(frames) = first.body else {
        panic!("{first:?}");
    };
    assert_eq!(frames.len(), MAX_BATCH_FRAMES);
    assert_eq!(frames[63], frame(1, 63));
    // The receiver takes what a peer's batch carries, and no more.
    let mut receiver = Protocol::new(geometry(8, 4096), geometry(8, 4096), Limits::default());
    received(&mut receiver, 0, Body::Batch(frames)).unwrap();
    let inbound = std::iter::from_fn(|| receiver.poll_inbound()).count();
    assert_eq!(inbound, MAX_BATCH_FRAMES);
}

/// A peer that grants no credits leaves our eager frames queued: the queue
/// is bounded in bytes (issue 30, attack 6), not only in frames, and a frame
/// larger than the bound still fits an empty queue.
#[test]
fn eager_frames_waiting_for_credits_are_bounded_in_bytes() {
    let g = geometry(8, 8 << 10);
    let limits = Limits {
        max_queued_bytes: 16 << 10,
        ..Limits::default()
    };
    let mut p = Protocol::new(g, g, limits);
    let frame = Bytes::from(vec![7u8; 3000]);
    let mut queued = 0;
    while p.can_send(Route::Eager) {
        p.send_eager(frame.clone());
        queued += 1;
        assert!(queued < 1000, "the queue never filled");
    }
    // 16 KiB of 3000-byte frames: six fit below the bound, the sixth crosses it.
    assert_eq!(queued, 6);
    assert_eq!(p.queued_bytes(), 6 * 3000);
    // Transmitting (the peer's initial credits) frees queue bytes again.
    while let Some(_message) = p.poll_transmit() {
        p.handle_send_complete();
    }
    assert!(p.queued_bytes() < 6 * 3000);
    assert!(p.can_send(Route::Eager));

    let tiny = Limits {
        max_queued_bytes: 1,
        ..Limits::default()
    };
    let mut p = Protocol::new(g, g, tiny);
    assert!(p.can_send(Route::Eager), "an empty queue takes any frame");
    p.send_eager(frame.clone());
    assert!(!p.can_send(Route::Eager));
}

/// Frames the application has not taken hold back credits once they add up
/// to `max_pending_bytes`, whatever their number: the peer can then add at
/// most the credits it still has.
#[test]
fn received_frames_waiting_for_the_application_are_bounded_in_bytes() {
    let g = geometry(8, 8 << 10);
    let limits = Limits {
        max_pending: 100_000,
        max_pending_bytes: 32 << 10,
        ..Limits::default()
    };
    let mut p = Protocol::new(g, g, limits);
    let mut peer = Hostile {
        credits: 8,
        owed: 0,
    };
    let frame = Bytes::from(vec![1u8; 4000]);
    let mut stalled = false;
    for _ in 0..10_000 {
        let mut sent = 0;
        while let Some(result) = peer.send(&mut p, u32::MAX, Body::Data(frame.clone())) {
            result.unwrap();
            sent += 1;
        }
        let transmitted = peer.take(&mut p);
        assert!(
            p.pending() * 4000 <= (32 << 10) + 8 * 4000,
            "{} frames of 4000 bytes wait for the application",
            p.pending()
        );
        if sent == 0 && transmitted == 0 {
            stalled = true;
            break;
        }
    }
    assert!(stalled, "the peer was stopped");
    while p.poll_inbound().is_some() {}
    assert!(
        peer.take(&mut p) > 0,
        "taking the frames grants credits again"
    );
}

/// Announced frames that a peer never pulls are bounded in bytes as well as
/// in number; one frame always goes, however large.
#[test]
fn announced_frames_awaiting_done_are_bounded_in_bytes() {
    let g = geometry(8, 8 << 10);
    let limits = Limits {
        max_exposed_bytes: 3 << 20,
        ..Limits::default()
    };
    let now = Instant::now();
    let mut p = Protocol::new(g, g, limits);
    let mut announced = 0;
    while p.can_send(Route::Rendezvous) {
        p.send_rendezvous(Bytes::new(), Bytes::new(), 0x1000, 1 << 20, 1, now);
        announced += 1;
        assert!(announced < 100, "never bounded");
    }
    assert_eq!(announced, 3);
    assert_eq!(p.exposed_bytes(), 3 << 20);
    // Revoked at the time-out: room again.
    p.handle_timeout(now + Limits::default().rendezvous_timeout);
    assert_eq!(p.exposed_bytes(), 0);
    assert!(p.can_send(Route::Rendezvous));
    // One frame larger than the bound still goes, alone.
    p.send_rendezvous(Bytes::new(), Bytes::new(), 0x1000, 64 << 20, 1, now);
    assert!(!p.can_send(Route::Rendezvous));
    assert!(
        p.can_send(Route::Eager),
        "eager frames do not wait for DONEs"
    );
}
