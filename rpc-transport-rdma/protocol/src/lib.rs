//! The RDMA protocol of one rdma-rpc connection, as a sans-IO state machine.
//!
//! Its own crate (only `bytes` and `thiserror`: nothing async, no I/O) so that
//! what a peer can send is fuzzed and tested without a device or a runtime;
//! rpc-transport-rdma re-exports it as `rpc_transport_rdma::protocol`.
//!
//! [`Protocol`] decides everything and does nothing: it never touches a queue
//! pair, a buffer or a clock. The driver (rpc-transport-rdma's `driver`
//! module) feeds it what happened through `handle_*` and asks it what to do
//! next through `poll_*`, in the style of quinn-proto:
//!
//! | input | meaning |
//! |---|---|
//! | [`Protocol::send_eager`] / [`Protocol::send_rendezvous`] / [`Protocol::close`] | the application sends a frame, or ends its side |
//! | [`Protocol::handle_received`] | a SEND landed in a receive slot (already re-posted) |
//! | [`Protocol::handle_send_complete`] | a send slot is free again |
//! | [`Protocol::handle_read_complete`] | an RDMA READ chunk arrived |
//! | [`Protocol::handle_timeout`] | time passed [`Protocol::poll_timeout`] |
//!
//! | output | the driver then |
//! |---|---|
//! | [`Protocol::poll_transmit`] | copies the message into a send slot and posts a SEND |
//! | [`Protocol::poll_event`] | allocates a READ destination, or frees an exposed frame |
//! | [`Protocol::poll_read`] | posts an RDMA READ chunk |
//! | [`Protocol::poll_inbound`] | hands a frame (or the end) to the application |
//!
//! **Credits.** A SEND needs a posted receive at the peer. Each side starts
//! with the peer's `initial_credits`, spends one per message, and gets them
//! back in the `credits` field of the peer's messages once the peer has
//! re-posted the slots. The last credit is kept for an explicit CREDIT
//! message, which is sent when a quarter of the window waits to be granted or
//! when the peer may be down to its reserve. So no message ever meets an
//! empty receive queue: no RNR, whatever the load.
//!
//! **A window that follows the load.** Receive slots come from a pool shared
//! by every connection of the device (an SRQ), so what a connection's peer
//! may send — its *window* — is slots committed to it in that pool. It starts
//! at `initial_credits` (a few slots: an idle connection costs little) and
//! grows up to `recv_slots` while the peer keeps running out: when the peer
//! is down to a quarter of its window, [`Protocol::credits_wanted`] asks the
//! driver for as much again, and what the driver commits
//! ([`Protocol::grow_window`]) goes out as extra credits. A side that has been
//! idle gives back what it holds beyond the peer's `initial_credits` with a
//! RETURN message ([`Protocol::return_credits`]); the peer's window shrinks by
//! as much and its driver releases the slots ([`Protocol::take_returned`]).
//!
//! **Eager and rendezvous.** A frame up to the eager threshold travels inside
//! the message. A larger one stays in the sender's memory behind a window
//! that covers exactly its bytes (REMOTE_READ only); the message announces
//! `{token, addr, len, rkey}` and carries the frame's first bytes (its head:
//! header, path, metadata) inline, so a payload is read where the
//! application's `Bytes` already hold it. The receiver checks the length
//! against its limit before allocating anything, pulls the frame in chunks
//! with at most `max_outstanding_reads` READs in flight, then answers DONE so
//! the sender revokes the window. A window the receiver never finishes is
//! revoked after `rendezvous_timeout`.
//!
//! **Order.** Frames reach the application in the order they were sent: an
//! eager frame that arrives behind a rendezvous frame waits for its pull.
//!
//! **Bounds.** Everything the peer can make this side hold is bounded. Its
//! [`Geometry`] is checked field by field ([`Geometry::validate`]). Received
//! frames waiting for the application (frames behind a pull, pulls not
//! done) stop credit grants at [`Limits::max_pending`] (or
//! [`Limits::max_pending_bytes`]), so at most that plus what our receive
//! slots hold wait (a BATCH fills a slot with at most [`MAX_BATCH_FRAMES`]
//! frames, all slices of that slot's one copy), plus one message per frame we
//! announce meanwhile (its DONE's credit, which a peer may spend on frames).
//! Announcements awaiting our DONE are at most [`MAX_UNANSWERED`] (an honest
//! peer has at most [`MAX_EXPOSED`] out), and an announced range must not
//! wrap around the address space.
#![forbid(unsafe_code)]

pub mod message;

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;

pub use message::{
    Announce, BATCH_ENTRY_LEN, Body, HEADER_LEN, MAX_BATCH_FRAMES, Message, MessageError,
    PROTOCOL_VERSION,
};

/// What one side of a connection offers, exchanged in the set-up hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// The most credits this side grants the peer at once (its window's cap).
    pub recv_slots: u32,
    /// Credits the peer holds at the start, committed before it may send
    /// ([`MIN_RECV_SLOTS`]..=`recv_slots`).
    pub initial_credits: u32,
    /// Bytes per receive slot, header included.
    pub slot_len: u32,
    /// Frames up to this many bytes travel eagerly (≤ `slot_len - HEADER_LEN`).
    pub eager_threshold: u32,
    /// Largest frame this side accepts.
    pub max_frame_len: u64,
}

/// Bytes of an encoded [`Geometry`].
pub const GEOMETRY_LEN: usize = 24;
/// Fewest receive slots a side may offer. One credit stays in reserve for
/// CREDIT messages; with only two slots, two idle sides would answer each
/// other's CREDIT messages forever (each sees the other at its reserve).
pub const MIN_RECV_SLOTS: u32 = 3;
/// Most receive slots a side may offer: 512 times the transport's default of
/// 128, and as many receive work requests as large hardware queues take
/// (`max_qp_wr` is 16 K to 32 K on common NICs). A peer's slots are the
/// credits this side holds, so the bound keeps a peer from claiming billions.
pub const MAX_RECV_SLOTS: u32 = 1 << 16;
/// Largest eager threshold a side may offer: 1 MiB, the largest the transport
/// configures (`RdmaConfig::validate`). Larger frames go by rendezvous anyway.
pub const MAX_EAGER_THRESHOLD: u32 = 1 << 20;
/// Smallest receive slot: a header plus an ANNOUNCE body, the largest message
/// that is not DATA.
pub const MIN_SLOT_LEN: u32 = (HEADER_LEN + message::ANNOUNCE_BODY_LEN) as u32;
/// Largest receive slot: a header plus the largest eager threshold.
pub const MAX_SLOT_LEN: u32 = HEADER_LEN as u32 + MAX_EAGER_THRESHOLD;
/// Most frames a side keeps announced (exposed) at once:
/// [`Limits::max_exposed`] above it counts as this.
pub const MAX_EXPOSED: u32 = 1024;
/// Most announcements of the peer this side holds before it has sent their
/// DONE (being pulled, waiting to be, or DONE queued); one more is
/// [`ProtocolError::TooManyUnanswered`]. An honest peer has at most
/// [`MAX_EXPOSED`] announcements out; the slack covers windows it revoked by
/// its timeout while our DONE still waits for a credit.
pub const MAX_UNANSWERED: u32 = 4 * MAX_EXPOSED;
/// Largest `max_frame_len` a side may offer: 4 GiB − 1, the largest frame any
/// rdma-rpc transport carries (TCP's length prefix and each section length of
/// rpc-core's frame header are `u32`; rpc-core's default is 64 MiB).
pub const MAX_FRAME_LEN: u64 = u32::MAX as u64;

const _: () = assert!(
    MIN_RECV_SLOTS >= 3,
    "reserve credit plus no idle credit ping-pong"
);
const _: () = assert!(MIN_RECV_SLOTS <= MAX_RECV_SLOTS);
const _: () = assert!(
    MIN_SLOT_LEN as usize >= HEADER_LEN + message::ANNOUNCE_BODY_LEN,
    "every non-DATA message fits a slot"
);
const _: () = assert!(MIN_SLOT_LEN < MAX_SLOT_LEN);
const _: () = assert!(
    MAX_SLOT_LEN as u64 <= MAX_FRAME_LEN,
    "an eager frame is never larger than a frame may be"
);
const _: () = assert!(MAX_FRAME_LEN <= u32::MAX as u64, "the wire format's limit");
const _: () = assert!(
    MAX_EXPOSED < MAX_UNANSWERED,
    "an honest peer never reaches the limit on unanswered announcements"
);
const _: () = assert!(
    (MAX_RECV_SLOTS as u64) * (MAX_SLOT_LEN as u64) <= 1 << 37,
    "the largest receive pool a peer can describe stays within 128 GiB"
);

/// The peer's geometry is unusable; the message names the field, its value
/// and the bound.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GeometryError {
    /// The encoded geometry has the wrong size.
    #[error("geometry of {len} bytes, expected {GEOMETRY_LEN}")]
    Length {
        /// Bytes received.
        len: usize,
    },
    /// A field is outside its bounds.
    #[error("{field} = {value} is outside {min}..={max} ({why})")]
    OutOfBounds {
        /// Which field (`recv_slots`, `slot_len`, `eager_threshold`, `max_frame_len`).
        field: &'static str,
        /// What the peer said.
        value: u64,
        /// Smallest allowed.
        min: u64,
        /// Largest allowed.
        max: u64,
        /// Where the bound comes from.
        why: &'static str,
    },
}

fn within(
    field: &'static str,
    value: u64,
    min: u64,
    max: u64,
    why: &'static str,
) -> Result<(), GeometryError> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(GeometryError::OutOfBounds {
            field,
            value,
            min,
            max,
            why,
        })
    }
}

impl Geometry {
    /// Fixed-size little-endian form for the hello.
    pub fn encode(&self) -> [u8; GEOMETRY_LEN] {
        let mut out = [0u8; GEOMETRY_LEN];
        out[0..4].copy_from_slice(&self.recv_slots.to_le_bytes());
        out[4..8].copy_from_slice(&self.slot_len.to_le_bytes());
        out[8..12].copy_from_slice(&self.eager_threshold.to_le_bytes());
        out[12..20].copy_from_slice(&self.max_frame_len.to_le_bytes());
        out[20..24].copy_from_slice(&self.initial_credits.to_le_bytes());
        out
    }

    /// Parses and validates the peer's geometry.
    pub fn decode(bytes: &[u8]) -> Result<Geometry, ProtocolError> {
        let bytes: &[u8; GEOMETRY_LEN] = bytes
            .try_into()
            .map_err(|_| GeometryError::Length { len: bytes.len() })?;
        let geometry = Geometry {
            recv_slots: u32::from_le_bytes(bytes[0..4].try_into().expect("4")),
            slot_len: u32::from_le_bytes(bytes[4..8].try_into().expect("4")),
            eager_threshold: u32::from_le_bytes(bytes[8..12].try_into().expect("4")),
            max_frame_len: u64::from_le_bytes(bytes[12..20].try_into().expect("8")),
            initial_credits: u32::from_le_bytes(bytes[20..24].try_into().expect("4")),
        };
        geometry.validate()?;
        Ok(geometry)
    }

    /// Checks every field against its bounds ([`MIN_RECV_SLOTS`]..=[`MAX_RECV_SLOTS`],
    /// [`MIN_SLOT_LEN`]..=[`MAX_SLOT_LEN`], an eager threshold that fits a
    /// slot's payload, `max_frame_len` ≤ [`MAX_FRAME_LEN`]): the invariants
    /// the protocol relies on, and sanity for what a peer claims.
    pub fn validate(&self) -> Result<(), GeometryError> {
        within(
            "recv_slots",
            self.recv_slots.into(),
            MIN_RECV_SLOTS.into(),
            MAX_RECV_SLOTS.into(),
            "one credit in reserve; at most MAX_RECV_SLOTS",
        )?;
        within(
            "initial_credits",
            self.initial_credits.into(),
            MIN_RECV_SLOTS.into(),
            self.recv_slots.into(),
            "one credit in reserve; at most recv_slots",
        )?;
        within(
            "slot_len",
            self.slot_len.into(),
            MIN_SLOT_LEN.into(),
            MAX_SLOT_LEN.into(),
            "a header plus an announcement, up to a header plus MAX_EAGER_THRESHOLD",
        )?;
        within(
            "eager_threshold",
            self.eager_threshold.into(),
            0,
            u64::from(self.slot_len) - HEADER_LEN as u64,
            "a slot's payload: slot_len minus the 16-byte header",
        )?;
        within(
            "max_frame_len",
            self.max_frame_len,
            0,
            MAX_FRAME_LEN,
            "the wire format's 4 GiB - 1",
        )?;
        Ok(())
    }
}

/// Local knobs of the protocol (not negotiated).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Send slots: messages in flight before a send completion is needed.
    pub send_slots: u32,
    /// RDMA READ chunks in flight (bounded by the QP's `max_rd_atomic`).
    pub max_outstanding_reads: u32,
    /// Bytes per READ chunk.
    pub read_chunk_len: u64,
    /// Rendezvous frames being pulled at once (each holds a destination buffer).
    pub max_active_pulls: u32,
    /// Our announced frames awaiting DONE before we stop taking large frames
    /// (at most [`MAX_EXPOSED`]; more counts as that).
    pub max_exposed: u32,
    /// Frames queued for sending before the application waits.
    pub max_queued: usize,
    /// Bytes of eager frames queued for sending before the application
    /// waits (a frame always fits an empty queue): what a peer that grants
    /// no credits makes this side hold, whatever the frames' number.
    pub max_queued_bytes: usize,
    /// Received frames waiting for the application (eager frames behind a
    /// frame still being pulled, announced frames not yet pulled) before
    /// credit grants are held back, so the peer stops sending.
    pub max_pending: u32,
    /// Bytes of received frames waiting for the application before credit
    /// grants are held back (as for [`Limits::max_pending`]).
    pub max_pending_bytes: usize,
    /// Bytes of our announced frames awaiting DONE before we stop taking
    /// large frames (one frame is always let through): what a peer that
    /// never pulls makes this side hold until the revocation time-out.
    pub max_exposed_bytes: u64,
    /// An announced frame not DONE by then is revoked.
    pub rendezvous_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            send_slots: 128,
            max_outstanding_reads: 16,
            read_chunk_len: 1 << 20,
            max_active_pulls: 4,
            max_exposed: 16,
            max_queued: 256,
            max_queued_bytes: 64 << 10,
            max_pending: 256,
            max_pending_bytes: 64 << 10,
            max_exposed_bytes: 4 << 20,
            rendezvous_timeout: Duration::from_secs(30),
        }
    }
}

/// The peer broke the protocol; the connection must end.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// A message could not be parsed.
    #[error(transparent)]
    Message(#[from] MessageError),
    /// An announcement of nothing.
    #[error("announced frame of 0 bytes")]
    EmptyAnnounce,
    /// A token already in use by another announcement.
    #[error("announcement reuses token {0}")]
    DuplicateToken(u64),
    /// A DONE for a token this side never announced.
    #[error("DONE for unknown token {0}")]
    UnknownToken(u64),
    /// The peer sent without a credit.
    #[error("peer sent {received} messages with {granted} credits granted")]
    CreditOverrun {
        /// Messages received.
        received: u64,
        /// Credits granted so far (initial slots included).
        granted: u64,
    },
    /// The peer gave back credits it does not hold, or more than it was
    /// granted beyond its initial ones.
    #[error(
        "peer returned {returned} credits; it holds {held}, {beyond_initial} beyond its initial ones"
    )]
    BadReturn {
        /// Credits the RETURN gave back.
        returned: u32,
        /// Credits the peer held as far as this side knows.
        held: u64,
        /// Of the window, credits beyond the initial ones.
        beyond_initial: u32,
    },
    /// The peer granted more credits than it has receive slots.
    #[error("peer granted {credits} credits, more than its {slots} receive slots")]
    CreditOverflow {
        /// Credits we would hold.
        credits: u64,
        /// The peer's slots.
        slots: u32,
    },
    /// A frame after the peer's CLOSE.
    #[error("frame after CLOSE")]
    AfterClose,
    /// An announced range that wraps around the address space.
    #[error("announced frame of {len} bytes at {addr:#x} wraps around the address space")]
    AnnounceRange {
        /// Announced address.
        addr: u64,
        /// Announced length.
        len: u64,
    },
    /// More announcements awaiting DONE than any honest peer makes.
    #[error(
        "more than {max} announced frames await DONE (an honest peer exposes at most {MAX_EXPOSED})"
    )]
    TooManyUnanswered {
        /// [`MAX_UNANSWERED`].
        max: u32,
    },
    /// The peer's geometry is unusable.
    #[error("bad geometry: {0}")]
    Geometry(#[from] GeometryError),
}

/// How a frame travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Inside a message.
    Eager,
    /// Announced, then pulled by the peer.
    Rendezvous,
}

/// Something the driver must do with memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// Take a registered destination of `len` bytes for `token`; its READs follow.
    Allocate {
        /// The peer's announcement.
        token: u64,
        /// Bytes.
        len: u64,
    },
    /// Our frame `token` is no longer reachable by the peer: revoke its window
    /// and free it (`expired`: no DONE came in time).
    Release {
        /// Our announcement.
        token: u64,
        /// Revoked by the timeout rather than by DONE.
        expired: bool,
    },
}

/// One RDMA READ to post: `len` bytes from the peer's `remote_addr` into the
/// destination of `token` at `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadRequest {
    /// Which pull.
    pub token: u64,
    /// Offset in the destination: in the frame, after the inline head.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// Source address in the peer.
    pub remote_addr: u64,
    /// The peer's window key.
    pub rkey: u32,
}

/// What the application receives next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inbound {
    /// An eager frame.
    Frame(Bytes),
    /// The READs of `token` completed: the frame is `head`, then what they
    /// put in its destination (which left room for `head` in front and
    /// `tail` behind), then `tail`.
    Pulled {
        /// The announcement's token.
        token: u64,
        /// Bytes of the whole frame, `head` and `tail` included.
        len: u64,
        /// The frame's first bytes, from the announcement.
        head: Bytes,
        /// The frame's last bytes, from the announcement.
        tail: Bytes,
    },
    /// An announced frame over our `max_frame_len`: nothing was allocated or
    /// read, DONE went back so the peer frees it; the application answers
    /// the call it belongs to (named in `head`) and the connection goes on.
    Refused {
        /// The frame's first bytes, from the announcement.
        head: Bytes,
        /// Bytes of the whole frame, as announced.
        len: u64,
        /// Our limit.
        max: u64,
    },
    /// The peer sends no more frames.
    Closed,
}

enum Pending {
    Frame(Bytes),
    Pull(u64),
    Refused { head: Bytes, len: u64 },
    Closed,
}

struct Pull {
    announce: Announce,
    allocated: bool,
    next_offset: u64,
    received: u64,
}

/// One connection's protocol state.
pub struct Protocol {
    local: Geometry,
    peer: Geometry,
    limits: Limits,
    /// Refuses an announced frame from its head alone (see
    /// [`Protocol::refusing_heads`]).
    refuse_head: fn(&[u8]) -> bool,
    // Credits.
    send_credits: u32,
    /// Receives consumed (and re-posted) since our last grant that held
    /// something other than a CREDIT or RETURN message.
    owed_for_data: u32,
    /// DONE and RETURN messages received since our last grant: re-granted
    /// even while we hold credits back, since they add nothing to what
    /// waits here and free what we hold (see [`Protocol::poll_transmit`]).
    owed_for_control: u32,
    /// Our announcements whose DONE credit the peer may still need: one
    /// credit each, paid even while we hold credits back (at most as many
    /// as frames we have exposed).
    done_debt: u32,
    /// DONE credits paid since we last granted in full, less the DONEs that
    /// came back for frames still exposed: at most `max_exposed` while
    /// holding, whatever the peer does with them.
    done_credits_paid: u32,
    granted_total: u64,
    received_total: u64,
    /// Credits the peer gave back with RETURN messages.
    returned_total: u64,
    /// Credits the peer may hold at once (slots committed to it).
    window: u32,
    /// Returned credits the driver has not released yet.
    returned_unclaimed: u32,
    /// The peer ran down to a quarter of its window since the last growth.
    starved: bool,
    hold_credits: bool,
    free_send_slots: u32,
    // Outgoing.
    control: VecDeque<Body>,
    queue: VecDeque<Body>,
    close_queued: bool,
    close_sent: bool,
    /// A RETURN is queued (its count is fixed when it goes out).
    return_queued: bool,
    /// Bytes of the DATA frames in `queue`.
    queued_bytes: usize,
    next_token: u64,
    /// Our announced frames awaiting DONE: revocation time and length.
    exposed: HashMap<u64, (Instant, u64)>,
    /// Bytes of the frames in `exposed`.
    exposed_bytes: u64,
    // Incoming.
    pulls: HashMap<u64, Pull>,
    /// The peer's announcements whose DONE we have not transmitted.
    unanswered: u32,
    pull_order: VecDeque<u64>,
    active_pulls: u32,
    reads_outstanding: u32,
    pending: VecDeque<Pending>,
    /// Bytes of the frames in `pending`.
    pending_bytes: usize,
    close_received: bool,
    events: VecDeque<Event>,
}

impl Protocol {
    /// A connection between `local` and `peer` (both validated).
    pub fn new(local: Geometry, peer: Geometry, limits: Limits) -> Protocol {
        let limits = Limits {
            max_exposed: limits.max_exposed.min(MAX_EXPOSED),
            ..limits
        };
        Protocol {
            local,
            peer,
            limits,
            refuse_head: |_| false,
            send_credits: peer.initial_credits,
            owed_for_data: 0,
            owed_for_control: 0,
            done_debt: 0,
            done_credits_paid: 0,
            granted_total: u64::from(local.initial_credits),
            received_total: 0,
            returned_total: 0,
            window: local.initial_credits,
            returned_unclaimed: 0,
            starved: false,
            hold_credits: false,
            free_send_slots: limits.send_slots.max(1),
            control: VecDeque::new(),
            queue: VecDeque::new(),
            close_queued: false,
            close_sent: false,
            return_queued: false,
            queued_bytes: 0,
            next_token: 1,
            exposed: HashMap::new(),
            exposed_bytes: 0,
            pulls: HashMap::new(),
            unanswered: 0,
            pull_order: VecDeque::new(),
            active_pulls: 0,
            reads_outstanding: 0,
            pending: VecDeque::new(),
            pending_bytes: 0,
            close_received: false,
            events: VecDeque::new(),
        }
    }

    /// Refuses, as it refuses a frame over the size limit (DONE at once,
    /// [`Inbound::Refused`], nothing pulled or allocated), every announced
    /// frame whose head `refuse` says can only be refused: the layer above
    /// knows its frames' headers (say, metadata over its limit).
    pub fn refusing_heads(mut self, refuse: fn(&[u8]) -> bool) -> Protocol {
        self.refuse_head = refuse;
        self
    }

    /// How a frame of `len` bytes travels.
    pub fn route(&self, len: usize) -> Route {
        let fits_peer = len <= self.peer.slot_len as usize - HEADER_LEN;
        if len <= self.local.eager_threshold as usize && fits_peer {
            Route::Eager
        } else {
            Route::Rendezvous
        }
    }

    /// The most bytes (head and tail together) an announcement can carry
    /// inline: what is left of the peer's receive slot after the header and
    /// the announce body.
    pub fn max_announce_inline(&self) -> usize {
        (self.peer.slot_len as usize).saturating_sub(HEADER_LEN + message::ANNOUNCE_BODY_LEN)
    }

    /// The largest frame the peer accepts.
    pub fn peer_max_frame_len(&self) -> u64 {
        self.peer.max_frame_len
    }

    /// Whether another frame of `route` may be queued now (else the
    /// application waits: this is the sink's back-pressure).
    pub fn can_send(&self, route: Route) -> bool {
        !self.close_queued
            && self.queue.len() < self.limits.max_queued
            && (self.queued_bytes == 0 || self.queued_bytes < self.limits.max_queued_bytes)
            && (route == Route::Eager
                || self.exposed.is_empty()
                || ((self.exposed.len() as u32) < self.limits.max_exposed
                    && self.exposed_bytes < self.limits.max_exposed_bytes))
    }

    /// Queues an eager frame.
    pub fn send_eager(&mut self, frame: Bytes) {
        debug_assert_eq!(self.route(frame.len()), Route::Eager);
        self.queued_bytes += frame.len();
        self.queue.push_back(Body::Data(frame));
    }

    /// Bytes of eager frames queued, not yet in a message.
    pub fn queued_bytes(&self) -> usize {
        self.queued_bytes
    }

    /// Bytes of our announced frames awaiting DONE.
    pub fn exposed_bytes(&self) -> u64 {
        self.exposed_bytes
    }

    /// Queues the announcement of a frame that is `head`, then `len` bytes
    /// the driver put behind a window at `addr` with `rkey`, then `tail`;
    /// returns its token.
    ///
    /// # Panics
    /// When `head` and `tail` together are longer than
    /// [`Protocol::max_announce_inline`].
    pub fn send_rendezvous(
        &mut self,
        head: Bytes,
        tail: Bytes,
        addr: u64,
        len: u64,
        rkey: u32,
        now: Instant,
    ) -> u64 {
        assert!(
            head.len() + tail.len() <= self.max_announce_inline(),
            "an announcement's inline bytes must fit the peer's slot"
        );
        let token = self.next_token;
        self.next_token += 1;
        let frame_len = len + (head.len() + tail.len()) as u64;
        self.exposed
            .insert(token, (now + self.limits.rendezvous_timeout, frame_len));
        self.exposed_bytes += frame_len;
        self.queue.push_back(Body::Announce(Announce {
            token,
            addr,
            len,
            rkey,
            head,
            tail,
        }));
        token
    }

    /// Ends our side: CLOSE goes out after every queued frame.
    pub fn close(&mut self) {
        if !self.close_queued {
            self.close_queued = true;
            self.queue.push_back(Body::Close);
        }
    }

    /// Holds back credit grants while the application is not reading (so the
    /// peer stops sending), or releases them.
    pub fn set_hold_credits(&mut self, hold: bool) {
        self.hold_credits = hold;
    }

    /// A message arrived in a receive slot that the driver has already re-posted.
    pub fn handle_received(&mut self, bytes: Bytes) -> Result<(), ProtocolError> {
        self.received_total += 1;
        if self.received_total > self.granted_total {
            return Err(ProtocolError::CreditOverrun {
                received: self.received_total,
                granted: self.granted_total,
            });
        }
        let message = Message::decode(bytes)?;
        let credits = u64::from(self.send_credits) + u64::from(message.credits);
        if credits > u64::from(self.peer.recv_slots) {
            return Err(ProtocolError::CreditOverflow {
                credits,
                slots: self.peer.recv_slots,
            });
        }
        self.send_credits = credits as u32;
        if !matches!(message.body, Body::Credit | Body::Return { .. }) {
            self.owed_for_data += 1;
        }
        if matches!(message.body, Body::Done { .. } | Body::Return { .. }) {
            self.owed_for_control = self.owed_for_control.saturating_add(1);
        }
        match message.body {
            Body::Data(frame) => {
                if self.close_received {
                    return Err(ProtocolError::AfterClose);
                }
                self.pending_bytes += frame.len();
                self.pending.push_back(Pending::Frame(frame));
            }
            Body::Batch(frames) => {
                if self.close_received {
                    return Err(ProtocolError::AfterClose);
                }
                self.pending_bytes += frames.iter().map(Bytes::len).sum::<usize>();
                self.pending.extend(frames.into_iter().map(Pending::Frame));
            }
            Body::Announce(announce) => {
                if self.close_received {
                    return Err(ProtocolError::AfterClose);
                }
                if announce.len == 0 {
                    return Err(ProtocolError::EmptyAnnounce);
                }
                if announce.addr.checked_add(announce.len).is_none() {
                    return Err(ProtocolError::AnnounceRange {
                        addr: announce.addr,
                        len: announce.len,
                    });
                }
                if self.pulls.contains_key(&announce.token) {
                    return Err(ProtocolError::DuplicateToken(announce.token));
                }
                if self.unanswered >= MAX_UNANSWERED {
                    return Err(ProtocolError::TooManyUnanswered {
                        max: MAX_UNANSWERED,
                    });
                }
                self.unanswered += 1;
                if announce.frame_len() > self.local.max_frame_len
                    || (self.refuse_head)(&announce.head)
                {
                    // Checked before anything is allocated: the frame is
                    // refused whole, the peer gets its DONE at once.
                    self.control.push_back(Body::Done {
                        token: announce.token,
                    });
                    let len = announce.frame_len();
                    self.pending.push_back(Pending::Refused {
                        head: announce.head,
                        len,
                    });
                } else {
                    let token = announce.token;
                    self.pulls.insert(
                        announce.token,
                        Pull {
                            announce,
                            allocated: false,
                            next_offset: 0,
                            received: 0,
                        },
                    );
                    self.pull_order.push_back(token);
                    self.pending.push_back(Pending::Pull(token));
                }
            }
            Body::Done { token } => {
                if let Some((_, frame_len)) = self.exposed.remove(&token) {
                    self.exposed_bytes -= frame_len;
                    // A DONE credit came back as one: it counts no more
                    // against the spell's cap (a DONE for a window revoked
                    // already does not).
                    self.done_credits_paid = self.done_credits_paid.saturating_sub(1);
                    self.events.push_back(Event::Release {
                        token,
                        expired: false,
                    });
                } else if token == 0 || token >= self.next_token {
                    return Err(ProtocolError::UnknownToken(token));
                }
                // Else: revoked by the timeout already; nothing to free.
                self.done_debt = self.done_debt.min(self.exposed.len() as u32);
            }
            Body::Credit => {}
            Body::Return { credits } => {
                let held = self.peer_credits();
                let beyond_initial = self.window - self.local.initial_credits;
                if credits == 0 || u64::from(credits) > held || credits > beyond_initial {
                    return Err(ProtocolError::BadReturn {
                        returned: credits,
                        held,
                        beyond_initial,
                    });
                }
                self.returned_total += u64::from(credits);
                // The peer wants to hold its initial credits and no more;
                // grants of ours still in flight to it stay covered.
                let window = (held - u64::from(credits)).max(self.local.initial_credits.into());
                let window = window as u32;
                self.returned_unclaimed += self.window - window;
                self.window = window;
                self.starved = false;
            }
            Body::Close => {
                if self.close_received {
                    return Err(ProtocolError::AfterClose);
                }
                self.close_received = true;
                self.pending.push_back(Pending::Closed);
            }
        }
        let peer_credits = self.peer_credits();
        if peer_credits * 4 <= u64::from(self.window) || peer_credits <= 1 {
            self.starved = true;
        }
        Ok(())
    }

    /// Credits the peer holds as far as this side knows (an upper bound:
    /// messages in flight make it lower).
    fn peer_credits(&self) -> u64 {
        self.granted_total - self.received_total - self.returned_total
    }

    /// Credits to grant with the next message: what brings the peer back to
    /// its window.
    fn owed(&self) -> u32 {
        u64::from(self.window).saturating_sub(self.peer_credits()) as u32
    }

    /// How many more receive slots this side would like to commit to the
    /// peer: as many again as its window while the peer keeps running down
    /// to a quarter of it, up to `recv_slots`; else 0. The driver commits
    /// what the shared pool can spare and calls [`Protocol::grow_window`].
    pub fn credits_wanted(&self) -> u32 {
        if !self.starved || self.holding() || self.close_received {
            return 0;
        }
        self.window.min(self.local.recv_slots - self.window)
    }

    /// `credits` more receive slots are committed to the peer: its window
    /// grows by that much (granted with the next message). Clears the
    /// request of [`Protocol::credits_wanted`] even when `credits` is 0.
    pub fn grow_window(&mut self, credits: u32) {
        self.window = (self.window + credits).min(self.local.recv_slots);
        self.starved = false;
    }

    /// The peer's current window: receive slots committed to it.
    pub fn window(&self) -> u32 {
        self.window
    }

    /// Credits the peer gave back since the last call: the driver releases
    /// that many slots of the shared pool.
    pub fn take_returned(&mut self) -> u32 {
        std::mem::take(&mut self.returned_unclaimed)
    }

    /// Credits we hold beyond the peer's initial ones.
    pub fn excess_credits(&self) -> u32 {
        self.send_credits.saturating_sub(self.peer.initial_credits)
    }

    /// We have been idle: queues a RETURN of the credits held beyond the
    /// peer's initial ones, so its pool gets those slots back. False when
    /// there is nothing to give back or we are busy (frames queued).
    pub fn return_credits(&mut self) -> bool {
        if self.excess_credits() == 0
            || self.unanswered > 0
            || !self.queue.is_empty()
            || !self.control.is_empty()
            || self.close_queued
            || self.return_queued
        {
            return false;
        }
        self.return_queued = true;
        self.control.push_back(Body::Return { credits: 0 });
        true
    }

    /// A SEND completed: its slot is free.
    pub fn handle_send_complete(&mut self) {
        self.free_send_slots += 1;
    }

    /// A READ chunk of `token` completed with `len` bytes.
    pub fn handle_read_complete(&mut self, token: u64, len: u64) {
        self.reads_outstanding = self.reads_outstanding.saturating_sub(1);
        let Some(pull) = self.pulls.get_mut(&token) else {
            return;
        };
        pull.received += len;
        if pull.received >= pull.announce.len {
            self.active_pulls -= 1;
            self.pull_order.retain(|t| *t != token);
            self.control.push_back(Body::Done { token });
            // The entry stays until `poll_inbound` hands the frame up.
            pull.next_offset = u64::MAX;
        }
    }

    /// Revokes announcements whose time is up.
    pub fn handle_timeout(&mut self, now: Instant) {
        let expired: Vec<u64> = self
            .exposed
            .iter()
            .filter(|(_, (deadline, _))| *deadline <= now)
            .map(|(token, _)| *token)
            .collect();
        for token in expired {
            if let Some((_, frame_len)) = self.exposed.remove(&token) {
                self.exposed_bytes -= frame_len;
            }
            self.events.push_back(Event::Release {
                token,
                expired: true,
            });
        }
        self.done_debt = self.done_debt.min(self.exposed.len() as u32);
    }

    /// When [`Protocol::handle_timeout`] wants to run next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.exposed.values().map(|(deadline, _)| *deadline).min()
    }

    /// The next message to send, if credits and a send slot allow.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<Message> {
        if self.free_send_slots == 0 || self.send_credits == 0 {
            return None;
        }
        // Everything but CREDIT keeps one credit in reserve; frames keep
        // one more while we owe DONEs, so that a DONE can always go (a
        // holding peer re-grants DONEs, not frames).
        let frame_reserve = self.frame_reserve();
        let body = if self.send_credits >= 2 && !self.control.is_empty() {
            self.control.pop_front()
        } else if self.send_credits >= frame_reserve {
            self.queue.pop_front()
        } else {
            None
        };
        let mut body = match body {
            Some(Body::Data(frame)) => {
                self.queued_bytes -= frame.len();
                self.batch_behind(frame)
            }
            Some(body) => body,
            None if self.needs_credit_message() => Body::Credit,
            None => return None,
        };
        self.send_credits -= 1;
        match &mut body {
            Body::Close => self.close_sent = true,
            Body::Done { .. } => self.unanswered -= 1,
            Body::Return { credits } => {
                self.return_queued = false;
                // What we hold beyond the initial credits once this message
                // is sent, plus its own credit, which the peer re-grants.
                let excess = (self.send_credits + 1).saturating_sub(self.peer.initial_credits);
                if excess == 0 {
                    // Grants came in meanwhile and were spent: nothing to
                    // give back; the credit goes unused.
                    self.send_credits += 1;
                    return self.poll_transmit();
                }
                *credits = excess;
                self.send_credits -= excess;
            }
            _ => {}
        }
        if matches!(body, Body::Announce(_)) {
            self.done_debt += 1;
        }
        let credits = if self.holding() {
            // Held back, but for what control messages spent and what our
            // announcements' DONEs need.
            let credits = self
                .owed()
                .min(self.owed_for_control.saturating_add(self.payable_debt()));
            let from_control = credits.min(self.owed_for_control);
            self.owed_for_control -= from_control;
            self.done_debt = self.done_debt.saturating_sub(credits - from_control);
            self.done_credits_paid += credits - from_control;
            credits
        } else {
            let credits = self.owed();
            if credits > 0 {
                self.owed_for_data = 0;
                self.owed_for_control = 0;
                self.done_credits_paid = 0;
            }
            credits
        };
        self.granted_total += u64::from(credits);
        self.free_send_slots -= 1;
        Some(Message { credits, body })
    }

    /// `first` alone (DATA), or with the eager frames queued right behind it
    /// as one BATCH, as many as fit the peer's slot (up to
    /// [`MAX_BATCH_FRAMES`]): frames queued at once cost one message.
    fn batch_behind(&mut self, first: Bytes) -> Body {
        let room = self.peer.slot_len as usize;
        let mut len = HEADER_LEN + BATCH_ENTRY_LEN + first.len();
        let mut first = Some(first);
        let mut frames = Vec::new();
        while frames.len().max(1) < MAX_BATCH_FRAMES {
            let Some(Body::Data(next)) = self.queue.front() else {
                break;
            };
            if len + BATCH_ENTRY_LEN + next.len() > room {
                break;
            }
            len += BATCH_ENTRY_LEN + next.len();
            let Some(Body::Data(next)) = self.queue.pop_front() else {
                unreachable!("the front was DATA");
            };
            self.queued_bytes -= next.len();
            frames.extend(first.take());
            frames.push(next);
        }
        match first {
            Some(alone) => Body::Data(alone),
            None => Body::Batch(frames),
        }
    }

    /// Whether credit grants are held back: the driver asked (the application
    /// is not reading), or `max_pending` frames (or `max_pending_bytes`)
    /// wait for the application (frames behind a pull, pulls not done).
    /// What is pending drains once the application reads, but the
    /// application may itself wait for the peer: a server whose answers are
    /// announced waits for their DONEs before it reads more calls. So
    /// holding never withholds what the peer's DONE and RETURN messages
    /// spent, nor the credit each of our announcements' DONE needs (sent
    /// alone in a CREDIT once the peer is at its reserve); a side that owes
    /// DONEs keeps two credits from its frames for them. Once held, the
    /// peer can add at most the credits it still has, `max_exposed`, and one
    /// message per frame we announce meanwhile.
    fn holding(&self) -> bool {
        self.hold_credits
            || self.pending.len() >= self.limits.max_pending.max(1) as usize
            || self.pending_bytes >= self.limits.max_pending_bytes.max(1)
    }

    /// Credits a DATA, BATCH, ANNOUNCE or CLOSE needs: one is kept for a
    /// CREDIT, and one more for a DONE while we owe any.
    fn frame_reserve(&self) -> u32 {
        if self.unanswered > 0 { 3 } else { 2 }
    }

    /// DONE credits we may pay now while holding: one per frame announced,
    /// and, while any awaits DONE, what brings the peer up to the two
    /// credits a DONE needs (it may have spent them on frames before it
    /// owed a DONE, or on a CREDIT). An honest peer spends each on a DONE,
    /// which frees it again; a hostile one that spends them on frames gets
    /// no more than `max_exposed` beyond one per frame we announce.
    fn payable_debt(&self) -> u32 {
        let to_reach_a_done = if self.exposed.is_empty() {
            0
        } else {
            2u64.saturating_sub(self.peer_credits()) as u32
        };
        self.done_debt.max(to_reach_a_done).min(
            self.limits
                .max_exposed
                .saturating_sub(self.done_credits_paid),
        )
    }

    fn needs_credit_message(&self) -> bool {
        if self.owed() == 0 {
            return false;
        }
        if self.holding() {
            // Only what is re-granted while holding, once the peer is at its
            // reserve: it may have a DONE to send and nothing to send it with.
            // Never for a CREDIT received, and DONE credits are capped per
            // spell, so two holding sides cannot answer each other forever.
            return self.owed_for_control.saturating_add(self.payable_debt()) > 0
                && self.peer_credits() <= 1;
        }
        // What the peer can still send as far as it knows (an upper bound:
        // messages in flight make it lower). At its reserve it is blocked.
        // CREDIT messages alone never trigger a batch grant, or two idle sides
        // would answer each other forever.
        let threshold = (self.window / 4).max(2);
        self.owed_for_data >= threshold || self.peer_credits() <= 1
    }

    /// The next memory action.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<Event> {
        if let Some(event) = self.events.pop_front() {
            return Some(event);
        }
        if self.active_pulls < self.limits.max_active_pulls {
            let token = self
                .pull_order
                .iter()
                .find(|token| !self.pulls[*token].allocated)
                .copied()?;
            let pull = self.pulls.get_mut(&token).expect("ordered pulls exist");
            pull.allocated = true;
            self.active_pulls += 1;
            return Some(Event::Allocate {
                token,
                len: pull.announce.frame_len(),
            });
        }
        None
    }

    /// The destination of an [`Event::Allocate`] cannot be had yet (e.g. the
    /// server-wide receive budget is spent): the pull goes back to waiting,
    /// no READ is issued for it, and the next `poll_event` asks again.
    pub fn defer_allocation(&mut self, token: u64) {
        if let Some(pull) = self.pulls.get_mut(&token) {
            if pull.allocated && pull.next_offset == 0 {
                pull.allocated = false;
                self.active_pulls -= 1;
            }
        }
    }

    /// The next READ chunk to post.
    #[must_use]
    pub fn poll_read(&mut self) -> Option<ReadRequest> {
        if self.reads_outstanding >= self.limits.max_outstanding_reads {
            return None;
        }
        for token in &self.pull_order {
            let pull = self.pulls.get_mut(token).expect("ordered pulls exist");
            if !pull.allocated || pull.next_offset >= pull.announce.len {
                continue;
            }
            let offset = pull.next_offset;
            let len = (pull.announce.len - offset).min(self.limits.read_chunk_len);
            pull.next_offset += len;
            self.reads_outstanding += 1;
            return Some(ReadRequest {
                token: *token,
                offset: pull.announce.head.len() as u64 + offset,
                len,
                remote_addr: pull.announce.addr + offset,
                rkey: pull.announce.rkey,
            });
        }
        None
    }

    /// The next thing for the application, in send order.
    #[must_use]
    pub fn poll_inbound(&mut self) -> Option<Inbound> {
        match self.pending.front()? {
            Pending::Frame(_) => match self.pending.pop_front() {
                Some(Pending::Frame(frame)) => {
                    self.pending_bytes -= frame.len();
                    Some(Inbound::Frame(frame))
                }
                _ => unreachable!("front was a frame"),
            },
            Pending::Pull(token) => {
                let token = *token;
                let pull = &self.pulls[&token];
                if pull.received < pull.announce.len {
                    return None;
                }
                let pull = self.pulls.remove(&token).expect("looked up above");
                self.pending.pop_front();
                Some(Inbound::Pulled {
                    token,
                    len: pull.announce.frame_len(),
                    head: pull.announce.head,
                    tail: pull.announce.tail,
                })
            }
            Pending::Refused { .. } => match self.pending.pop_front() {
                Some(Pending::Refused { head, len }) => Some(Inbound::Refused {
                    head,
                    len,
                    max: self.local.max_frame_len,
                }),
                _ => unreachable!("front was a refused frame"),
            },
            Pending::Closed => {
                self.pending.pop_front();
                Some(Inbound::Closed)
            }
        }
    }

    /// The peer sent CLOSE.
    pub fn peer_closed(&self) -> bool {
        self.close_received
    }

    /// We sent CLOSE.
    pub fn close_sent(&self) -> bool {
        self.close_sent
    }

    /// Every send slot is in flight: only a send completion lets the next
    /// message go out.
    pub fn send_slots_exhausted(&self) -> bool {
        self.free_send_slots == 0
    }

    /// Every send slot is free (all posted SENDs completed).
    pub fn sends_idle(&self) -> bool {
        self.free_send_slots == self.limits.send_slots.max(1)
    }

    /// Frames of ours the peer may still read.
    pub fn exposed(&self) -> usize {
        self.exposed.len()
    }

    /// Frames of the peer being (or waiting to be) pulled.
    pub fn pulls(&self) -> usize {
        self.pulls.len()
    }

    /// Received messages not yet handed to the application (see the
    /// module's bounds).
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// The peer's announcements not yet answered by a DONE we transmitted
    /// (at most [`MAX_UNANSWERED`]).
    pub fn unanswered(&self) -> usize {
        self.unanswered as usize
    }

    /// Messages wait to go out and only the peer's credits hold them back.
    pub fn waits_for_credits(&self) -> bool {
        let frame_reserve = self.frame_reserve();
        let waiting = (!self.queue.is_empty() && self.send_credits < frame_reserve)
            || (!self.control.is_empty() && self.send_credits < 2);
        waiting && self.free_send_slots > 0
    }

    /// Credits we hold for sending.
    pub fn send_credits(&self) -> u32 {
        self.send_credits
    }

    /// Both sides closed, nothing is in flight, nothing is exposed or being pulled.
    pub fn is_finished(&self) -> bool {
        self.close_sent
            && self.close_received
            && self.sends_idle()
            && self.control.is_empty()
            && self.exposed.is_empty()
            && self.pulls.is_empty()
    }
}

#[cfg(test)]
mod tests;
