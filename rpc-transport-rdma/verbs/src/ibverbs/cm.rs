//! rdma_cm for the ibverbs provider: connecting our own QPs by IP address.
//!
//! The QPs stay ours (created on our context); a cm id only carries the
//! connection: its `rdma_init_qp_attr` gives the attributes for each state
//! (RoCE/IB), or the kernel moves the QP itself (iWARP: the active side sees
//! ESTABLISHED directly, never CONNECT_RESPONSE). Private data carries an
//! 8-byte token so a listener hands each request to the accept that waits
//! for it. Every call blocks (with a timeout): async callers use a blocking
//! thread.

use std::collections::HashMap;
use std::ffi::CStr;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rdma_mummy_sys as sys;

use super::{IbvQp, errno_error, lock, os_error};
use crate::{
    CmConnection, CmListener, ConnectOptions, ConnectionManager, QpState, QueuePair, VerbsError,
};

/// An event channel plus the ids on it; destroyed in the right order.
struct Channel(*mut sys::rdma_event_channel);

// SAFETY: librdmacm objects may be used from any thread; each channel is
// read by one thread at a time here.
unsafe impl Send for Channel {}
// SAFETY: as above.
unsafe impl Sync for Channel {}

impl Channel {
    fn new() -> Result<Channel, VerbsError> {
        // SAFETY: no arguments; null is the error return.
        let channel = unsafe { sys::rdma_create_event_channel() };
        if channel.is_null() {
            return Err(os_error("rdma_create_event_channel"));
        }
        Ok(Channel(channel))
    }

    fn fd(&self) -> i32 {
        // SAFETY: live channel.
        unsafe { (*self.0).fd }
    }

    /// The next event, or `None` after `timeout`. The caller acks it.
    fn next(&self, timeout: Duration) -> Result<Option<Event>, VerbsError> {
        if !crate::wait_readable(self.fd(), timeout).map_err(VerbsError::Io)? {
            return Ok(None);
        }
        let mut event: *mut sys::rdma_cm_event = std::ptr::null_mut();
        // SAFETY: live channel; `event` receives an event we ack in Event's drop.
        let rc = unsafe { sys::rdma_get_cm_event(self.0, &mut event) };
        if rc != 0 {
            return Err(os_error("rdma_get_cm_event"));
        }
        Ok(Some(Event(event)))
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: destroyed once, after the ids on it (their owners drop first).
        unsafe { sys::rdma_destroy_event_channel(self.0) };
    }
}

/// A received event; acked on drop.
struct Event(*mut sys::rdma_cm_event);

impl Event {
    fn kind(&self) -> u32 {
        // SAFETY: a live event until acked.
        unsafe { (*self.0).event }
    }

    fn status(&self) -> i32 {
        // SAFETY: as above.
        unsafe { (*self.0).status }
    }

    fn id(&self) -> *mut sys::rdma_cm_id {
        // SAFETY: as above.
        unsafe { (*self.0).id }
    }

    /// The connection's private data (what a request carried).
    fn private_data(&self) -> Vec<u8> {
        // SAFETY: for connection events `param.conn` is the active member; the
        // private data stays valid until the event is acked.
        unsafe {
            let conn = &(*self.0).param.conn;
            if conn.private_data.is_null() {
                return Vec::new();
            }
            std::slice::from_raw_parts(
                conn.private_data.cast::<u8>(),
                conn.private_data_len as usize,
            )
            .to_vec()
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: acked once.
        unsafe { sys::rdma_ack_cm_event(self.0) };
    }
}

fn event_name(kind: u32) -> &'static str {
    use sys::rdma_cm_event_type as e;
    match kind {
        e::RDMA_CM_EVENT_ADDR_RESOLVED => "ADDR_RESOLVED",
        e::RDMA_CM_EVENT_ADDR_ERROR => "ADDR_ERROR",
        e::RDMA_CM_EVENT_ROUTE_RESOLVED => "ROUTE_RESOLVED",
        e::RDMA_CM_EVENT_ROUTE_ERROR => "ROUTE_ERROR",
        e::RDMA_CM_EVENT_CONNECT_REQUEST => "CONNECT_REQUEST",
        e::RDMA_CM_EVENT_CONNECT_RESPONSE => "CONNECT_RESPONSE",
        e::RDMA_CM_EVENT_CONNECT_ERROR => "CONNECT_ERROR",
        e::RDMA_CM_EVENT_UNREACHABLE => "UNREACHABLE",
        e::RDMA_CM_EVENT_REJECTED => "REJECTED",
        e::RDMA_CM_EVENT_ESTABLISHED => "ESTABLISHED",
        e::RDMA_CM_EVENT_DISCONNECTED => "DISCONNECTED",
        e::RDMA_CM_EVENT_DEVICE_REMOVAL => "DEVICE_REMOVAL",
        e::RDMA_CM_EVENT_TIMEWAIT_EXIT => "TIMEWAIT_EXIT",
        _ => "other",
    }
}

/// A cm id with the channel its events arrive on; destroyed on drop (which
/// disconnects an established connection).
struct Id {
    id: *mut sys::rdma_cm_id,
    channel: Channel,
}

// SAFETY: see Channel.
unsafe impl Send for Id {}
// SAFETY: see Channel.
unsafe impl Sync for Id {}

impl Drop for Id {
    fn drop(&mut self) {
        // SAFETY: live id, destroyed once, before its channel (field order).
        unsafe {
            sys::rdma_disconnect(self.id);
            sys::rdma_destroy_id(self.id);
        }
    }
}

impl Id {
    fn new() -> Result<Id, VerbsError> {
        let channel = Channel::new()?;
        let mut id: *mut sys::rdma_cm_id = std::ptr::null_mut();
        // SAFETY: live channel; `id` receives the new id.
        let rc = unsafe {
            sys::rdma_create_id(
                channel.0,
                &mut id,
                std::ptr::null_mut(),
                sys::rdma_port_space::RDMA_PS_TCP,
            )
        };
        if rc != 0 {
            return Err(os_error("rdma_create_id"));
        }
        Ok(Id { id, channel })
    }

    /// Waits for `wanted`; any other event is an error that names it.
    fn expect(&self, wanted: u32, deadline: Instant, what: &str) -> Result<(), VerbsError> {
        let left = deadline.saturating_duration_since(Instant::now());
        match self.channel.next(left)? {
            None => Err(VerbsError::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("rdma_cm: {what}: no {} in time", event_name(wanted)),
            ))),
            Some(event) if event.kind() == wanted => Ok(()),
            Some(event) => Err(VerbsError::Io(std::io::Error::other(format!(
                "rdma_cm: {what}: got {} (status {}) instead of {}",
                event_name(event.kind()),
                event.status(),
                event_name(wanted)
            )))),
        }
    }

    fn device_name(&self) -> String {
        // SAFETY: a resolved id has a live verbs context and device.
        unsafe {
            let verbs = (*self.id).verbs;
            if verbs.is_null() {
                return String::new();
            }
            CStr::from_ptr(sys::ibv_get_device_name((*verbs).device))
                .to_string_lossy()
                .into_owned()
        }
    }
}

fn sockaddr(addr: SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(v4) => {
            // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in.
            let sin = unsafe { &mut *(&mut storage as *mut _ as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as u16;
            sin.sin_port = v4.port().to_be();
            sin.sin_addr.s_addr = u32::from_ne_bytes(v4.ip().octets());
        }
        SocketAddr::V6(v6) => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6 = unsafe { &mut *(&mut storage as *mut _ as *mut libc::sockaddr_in6) };
            sin6.sin6_family = libc::AF_INET6 as u16;
            sin6.sin6_port = v6.port().to_be();
            sin6.sin6_addr.s6_addr = v6.ip().octets();
        }
    }
    storage
}

fn ibv_qp(qp: &Arc<dyn QueuePair>) -> Result<&IbvQp, VerbsError> {
    crate::own(
        qp.as_any(),
        "rdma_cm connects only QPs of the ibverbs provider",
    )
}

/// Moves `qp` to `state` with the attributes the cm id gives for it; on the
/// way to RTS, the ACK timeout is ours (`options`), not rdma_cm's (which
/// derives it from the path's packet lifetime: about 1 s per try on RoCE).
fn apply(
    qp: &IbvQp,
    id: *mut sys::rdma_cm_id,
    state: QpState,
    options: &ConnectOptions,
) -> Result<(), VerbsError> {
    // SAFETY: zeroed POD.
    let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
    attr.qp_state = match state {
        QpState::Init => sys::ibv_qp_state::IBV_QPS_INIT,
        QpState::Rtr => sys::ibv_qp_state::IBV_QPS_RTR,
        _ => sys::ibv_qp_state::IBV_QPS_RTS,
    };
    let mut mask = 0;
    // SAFETY: live id with a resolved route or a request; out-params we own.
    let rc = unsafe { sys::rdma_init_qp_attr(id, &mut attr, &mut mask) };
    if rc != 0 {
        return Err(os_error("rdma_init_qp_attr"));
    }
    let mask = mask as u32;
    // (rdma_cm sets a timeout for InfiniBand and RoCE only: iWARP's is TCP's.)
    if state == QpState::Rts && mask & sys::ibv_qp_attr_mask::IBV_QP_TIMEOUT.0 != 0 {
        attr.timeout = options.ack_timeout_exponent();
    }
    qp.modify(&mut attr, mask, state, "modify QP with rdma_cm attributes")
}

fn conn_param(
    qp: &IbvQp,
    options: &ConnectOptions,
    token: Option<&[u8; 8]>,
) -> sys::rdma_conn_param {
    let depth = options.max_rd_atomic.min(qp.port.max_rd_atomic).max(1);
    sys::rdma_conn_param {
        private_data: token.map_or(std::ptr::null(), |t| t.as_ptr().cast()),
        private_data_len: if token.is_some() { 8 } else { 0 },
        responder_resources: depth,
        initiator_depth: depth,
        flow_control: 1,
        retry_count: options.retry_count.min(7),
        rnr_retry_count: options.rnr_retry.min(7),
        srq: 0,
        qp_num: qp.qp_num(),
    }
}

/// rdma_cm of one device.
pub(super) struct IbvConnectionManager {
    pub(super) device: String,
    pub(super) iwarp: bool,
}

/// librdmacm's convention: 0, or -1 with errno set.
fn check_rc(rc: i32, what: &str) -> Result<(), VerbsError> {
    if rc == 0 { Ok(()) } else { Err(os_error(what)) }
}

fn check_device(id: &Id, device: &str) -> Result<(), VerbsError> {
    let routed = id.device_name();
    if routed != device {
        return Err(VerbsError::InvalidArgument(if routed.is_empty() {
            "rdma_cm resolved no RDMA device for that address"
        } else {
            "rdma_cm routes that address through another RDMA device than the QP's (set RDMA_DEVICE to match, or use an address of the QP's device)"
        }));
    }
    Ok(())
}

impl ConnectionManager for IbvConnectionManager {
    fn listen(&self, addr: SocketAddr) -> Result<Arc<dyn CmListener>, VerbsError> {
        let id = Id::new()?;
        let mut storage = sockaddr(addr);
        // SAFETY: live id; the sockaddr outlives the call.
        let rc = unsafe {
            sys::rdma_bind_addr(id.id, (&mut storage as *mut libc::sockaddr_storage).cast())
        };
        if rc != 0 {
            return Err(os_error("rdma_bind_addr"));
        }
        // SAFETY: bound id.
        let rc = unsafe { sys::rdma_listen(id.id, 64) };
        if rc != 0 {
            return Err(os_error("rdma_listen"));
        }
        // SAFETY: a bound id's route holds its source address (what the
        // inline rdma_get_src_port reads; the dlopen layer does not export it).
        let port = unsafe {
            let src = &(*id.id).route.addr.src_addr_union;
            if src.src_addr.sa_family == libc::AF_INET6 as u16 {
                u16::from_be(src.src_sin6.sin6_port)
            } else {
                u16::from_be(src.src_sin.sin_port)
            }
        };
        let shared = Arc::new(Pending::default());
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let shared = shared.clone();
            let stop = stop.clone();
            let listen_id = Arc::new(id);
            let keep = listen_id.clone();
            std::thread::Builder::new()
                .name("rdma-cm-listen".into())
                .spawn(move || dispatch(&keep, &shared, &stop))
                .map_err(VerbsError::Io)?;
            listen_id
        };
        Ok(Arc::new(IbvCmListener {
            local: SocketAddr::new(addr.ip(), port),
            device: self.device.clone(),
            iwarp: self.iwarp,
            pending: shared,
            stop,
            _id: thread,
        }))
    }

    fn connect(
        &self,
        qp: &Arc<dyn QueuePair>,
        addr: SocketAddr,
        token: u64,
        options: &ConnectOptions,
        timeout: Duration,
    ) -> Result<CmConnection, VerbsError> {
        let deadline = Instant::now() + timeout;
        let mut attempt = 1;
        loop {
            match self.connect_once(qp, addr, token, options, deadline) {
                // On iWARP the port rdma_cm bound for us must also be free in
                // the kernel's TCP port space, where an unrelated socket (an
                // ephemeral port, a connection in TIME_WAIT) may hold it:
                // rdma_connect then fails with EADDRINUSE before anything was
                // sent, the QP still in INIT. A fresh id binds another port.
                Err(VerbsError::Io(error))
                    if error.kind() == std::io::ErrorKind::AddrInUse
                        && attempt < CM_CONNECT_ATTEMPTS
                        && Instant::now() < deadline =>
                {
                    tracing::debug!(%error, attempt, "rdma_cm: local port taken; another one");
                    attempt += 1;
                }
                result => return result,
            }
        }
    }
}

/// Local ports an rdma_cm connect tries before giving up on EADDRINUSE.
const CM_CONNECT_ATTEMPTS: u32 = 8;

impl IbvConnectionManager {
    /// One connect attempt through a fresh rdma_cm id (a fresh local port).
    fn connect_once(
        &self,
        qp: &Arc<dyn QueuePair>,
        addr: SocketAddr,
        token: u64,
        options: &ConnectOptions,
        deadline: Instant,
    ) -> Result<CmConnection, VerbsError> {
        let ibv = ibv_qp(qp)?;
        let timeout = deadline.saturating_duration_since(Instant::now());
        let id = Id::new()?;
        let mut dst = sockaddr(addr);
        let millis = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: live id; the sockaddr outlives the call.
        let rc = unsafe {
            sys::rdma_resolve_addr(
                id.id,
                std::ptr::null_mut(),
                (&mut dst as *mut libc::sockaddr_storage).cast(),
                millis,
            )
        };
        check_rc(rc, "rdma_resolve_addr")?;
        id.expect(
            sys::rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED,
            deadline,
            "resolving the address",
        )?;
        check_device(&id, &self.device)?;
        // SAFETY: live id with a resolved address.
        let rc = unsafe { sys::rdma_resolve_route(id.id, millis) };
        check_rc(rc, "rdma_resolve_route")?;
        id.expect(
            sys::rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED,
            deadline,
            "resolving the route",
        )?;
        if ibv.state() == QpState::Reset {
            apply(ibv, id.id, QpState::Init, options)?;
        }
        let token = token.to_le_bytes();
        let mut param = conn_param(ibv, options, Some(&token));
        // SAFETY: live id with a route; `param` and the token outlive the call.
        let rc = unsafe { sys::rdma_connect(id.id, &mut param) };
        if rc != 0 {
            return Err(os_error("rdma_connect"));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let event = id.channel.next(left)?.ok_or_else(|| {
            VerbsError::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "rdma_cm: no answer to the connection request in time",
            ))
        })?;
        use sys::rdma_cm_event_type as e;
        match event.kind() {
            e::RDMA_CM_EVENT_CONNECT_RESPONSE => {
                drop(event);
                apply(ibv, id.id, QpState::Rtr, options)?;
                apply(ibv, id.id, QpState::Rts, options)?;
                // SAFETY: live id after CONNECT_RESPONSE.
                let rc = unsafe { sys::rdma_establish(id.id) };
                if rc != 0 {
                    return Err(os_error("rdma_establish"));
                }
            }
            e::RDMA_CM_EVENT_ESTABLISHED => {
                // iWARP: the kernel moved the QP to RTS.
                *lock(&ibv.state) = QpState::Rts;
            }
            kind => {
                return Err(VerbsError::Io(std::io::Error::new(
                    std::io::ErrorKind::ConnectionRefused,
                    format!(
                        "rdma_cm: connecting to {addr}: {} (status {})",
                        event_name(kind),
                        event.status()
                    ),
                )));
            }
        }
        Ok(CmConnection(Box::new(id)))
    }
}

/// Connection requests that arrived, by token, and who waits for which.
#[derive(Default)]
struct Pending {
    requests: Mutex<HashMap<u64, usize>>,
    arrived: Condvar,
}

/// The listener's thread: takes connection requests off the listening id's
/// channel and files them by token.
fn dispatch(listen: &Id, pending: &Pending, stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        let event = match listen.channel.next(Duration::from_millis(100)) {
            Ok(Some(event)) => event,
            Ok(None) => continue,
            Err(error) => {
                tracing::warn!(%error, "rdma_cm listener stops");
                return;
            }
        };
        if event.kind() != sys::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST {
            continue;
        }
        let data = event.private_data();
        let id = event.id();
        let token = data
            .get(..8)
            .map(|t| u64::from_le_bytes(t.try_into().expect("8 bytes")));
        drop(event);
        match token {
            Some(token) => {
                lock(&pending.requests).insert(token, id as usize);
                pending.arrived.notify_all();
            }
            None => {
                // SAFETY: a request id we own and refuse.
                unsafe {
                    sys::rdma_reject(id, std::ptr::null(), 0);
                    sys::rdma_destroy_id(id);
                }
            }
        }
    }
}

struct IbvCmListener {
    local: SocketAddr,
    device: String,
    iwarp: bool,
    pending: Arc<Pending>,
    stop: Arc<AtomicBool>,
    _id: Arc<Id>,
}

impl Drop for IbvCmListener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Requests nobody accepted.
        for (_, id) in lock(&self.pending.requests).drain() {
            // SAFETY: request ids we own.
            unsafe {
                sys::rdma_reject(id as *mut sys::rdma_cm_id, std::ptr::null(), 0);
                sys::rdma_destroy_id(id as *mut sys::rdma_cm_id);
            }
        }
    }
}

impl CmListener for IbvCmListener {
    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn accept(
        &self,
        qp: &Arc<dyn QueuePair>,
        token: u64,
        options: &ConnectOptions,
        timeout: Duration,
    ) -> Result<CmConnection, VerbsError> {
        let ibv = ibv_qp(qp)?;
        let deadline = Instant::now() + timeout;
        let raw = {
            let mut requests = lock(&self.pending.requests);
            loop {
                if let Some(id) = requests.remove(&token) {
                    break id as *mut sys::rdma_cm_id;
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(VerbsError::Io(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "rdma_cm: the peer's connection request did not arrive in time",
                    )));
                }
                requests = self
                    .pending
                    .arrived
                    .wait_timeout(requests, left)
                    .unwrap_or_else(|poison| poison.into_inner())
                    .0;
            }
        };
        // Its own channel, so its ESTABLISHED comes to us, not the listener.
        let channel = Channel::new()?;
        // SAFETY: a request id we own; a live channel.
        let rc = unsafe { sys::rdma_migrate_id(raw, channel.0) };
        if rc != 0 {
            return Err(os_error("rdma_migrate_id"));
        }
        let id = Id { id: raw, channel };
        check_device(&id, &self.device)?;
        if ibv.state() == QpState::Reset {
            apply(ibv, id.id, QpState::Init, options)?;
        }
        if !self.iwarp {
            apply(ibv, id.id, QpState::Rtr, options)?;
        }
        let mut param = conn_param(ibv, options, None);
        // SAFETY: live request id; `param` outlives the call.
        let rc = unsafe { sys::rdma_accept(id.id, &mut param) };
        if rc != 0 {
            return Err(errno_error("rdma_accept", rc));
        }
        id.expect(
            sys::rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED,
            deadline,
            "accepting",
        )?;
        if self.iwarp {
            *lock(&ibv.state) = QpState::Rts;
        } else {
            apply(ibv, id.id, QpState::Rts, options)?;
        }
        Ok(CmConnection(Box::new(id)))
    }
}
