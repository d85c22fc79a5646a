//! `ibverbs`: real rdma-core, through `rdma-mummy-sys` (the dlopen layer under
//! `sideway`), so a binary built with this feature still starts — and says
//! "no RDMA device" — on a machine without rdma-core.
//!
//! The provider speaks the classic verbs C API (`ibv_post_send` with linked
//! work-request lists, `ibv_poll_cq`, basic CQs and QPs), which maps one to one
//! onto the traits; the `_ex` variants are avoided because they misbehave on
//! rdma-core 44 (`docs/providers.md`, "ibverbs"). Known device quirks handled here:
//! a negative errno from `post` (siw) is normalised, `max_sge_rd` is checked
//! before posting a READ (siw reports SUCCESS with half the data otherwise),
//! and the QP state is tracked locally because siw's `ibv_query_qp` always
//! reports RESET.
//!
//! GID selection for RoCE: `RDMA_GID_INDEX` when set, else the first GID of
//! port 1 whose sysfs type is "RoCE v2" and whose address is IPv4-mapped, else
//! the first RoCE v2 GID, else index 0.

use std::any::Any;
use std::collections::HashMap;
use std::ffi::CStr;
use std::os::fd::RawFd;
use std::ptr;
use std::sync::{Arc, Mutex, MutexGuard};

use rdma_mummy_sys as sys;

mod cm;

use super::windows::{self, BindBudget};
use super::{
    AccessFlags, CompletionChannel, CompletionQueue, ConnectOptions, ConnectionManager, Context,
    DeviceCaps, DeviceInfo, MemoryRegion, PostError, ProtectionDomain, Provider, QpAddress, QpCaps,
    QpInit, QpState, QueuePair, RecvWr, SendOp, SendWr, SharedReceiveQueue, VerbsError, WcOpcode,
    WcStatus, WindowCache, WorkCompletion,
};

/// The port every QP uses.
const PORT: u8 = 1;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

fn os_error(what: &str) -> VerbsError {
    let error = std::io::Error::last_os_error();
    VerbsError::Io(std::io::Error::new(
        error.kind(),
        format!("{what}: {error}"),
    ))
}

/// A failed verbs call that returns an errno (positive, or negative on siw).
fn errno_error(what: &str, rc: i32) -> VerbsError {
    let error = std::io::Error::from_raw_os_error(rc.abs());
    VerbsError::Io(std::io::Error::new(
        error.kind(),
        format!("{what}: {error}"),
    ))
}

/// The rdma-core provider.
#[derive(Debug, Clone, Copy, Default)]
pub struct IbverbsProvider;

/// The device list, freed on drop.
struct DeviceList {
    list: *mut *mut sys::ibv_device,
    len: usize,
}

impl DeviceList {
    fn get() -> Result<DeviceList, VerbsError> {
        let mut len = 0;
        // SAFETY: `len` is a valid out-pointer; a null return is an error.
        let list = unsafe { sys::ibv_get_device_list(&mut len) };
        if list.is_null() {
            let error = std::io::Error::last_os_error();
            return Err(VerbsError::ProviderUnavailable {
                provider: "ibverbs",
                reason: format!(
                    "cannot list RDMA devices ({error}): is rdma-core (libibverbs.so.1) installed and the kernel's RDMA support loaded?"
                ),
            });
        }
        Ok(DeviceList {
            list,
            len: len.max(0) as usize,
        })
    }

    fn devices(&self) -> impl Iterator<Item = *mut sys::ibv_device> + '_ {
        // SAFETY: `list` holds `len` valid device pointers while `self` lives.
        (0..self.len).map(move |i| unsafe { *self.list.add(i) })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: `list` came from ibv_get_device_list and is freed once.
        unsafe { sys::ibv_free_device_list(self.list) };
    }
}

fn device_name(device: *mut sys::ibv_device) -> String {
    // SAFETY: `device` is a live entry of a device list; the name is NUL-terminated.
    unsafe { CStr::from_ptr(sys::ibv_get_device_name(device)) }
        .to_string_lossy()
        .into_owned()
}

fn transport_name(device: *mut sys::ibv_device) -> &'static str {
    // SAFETY: `device` is a live entry of a device list.
    match unsafe { (*device).transport_type } {
        sys::ibv_transport_type::IBV_TRANSPORT_IB => "InfiniBand or RoCE",
        sys::ibv_transport_type::IBV_TRANSPORT_IWARP => "iWARP",
        _ => "unknown",
    }
}

// SAFETY: `open` returns an `IbvContext`, which keeps `Context`'s contract.
unsafe impl Provider for IbverbsProvider {
    fn name(&self) -> &'static str {
        "ibverbs"
    }

    fn devices(&self) -> Result<Vec<DeviceInfo>, VerbsError> {
        let list = DeviceList::get()?;
        Ok(list
            .devices()
            .map(|d| DeviceInfo {
                name: device_name(d),
                transport: transport_name(d).into(),
            })
            .collect())
    }

    fn open(&self, name: &str) -> Result<Arc<dyn Context>, VerbsError> {
        let list = DeviceList::get()?;
        let device = list
            .devices()
            .find(|&d| device_name(d) == name)
            .ok_or_else(|| {
                let known: Vec<String> = list.devices().map(device_name).collect();
                if known.is_empty() {
                    VerbsError::NoSuchDevice(format!("{name} (no RDMA device on this machine)"))
                } else {
                    VerbsError::NoSuchDevice(format!("{name} (present: {})", known.join(", ")))
                }
            })?;
        // SAFETY: `device` is a live entry of `list`, which outlives the call.
        let iwarp =
            unsafe { (*device).transport_type } == sys::ibv_transport_type::IBV_TRANSPORT_IWARP;
        // SAFETY: as above; a null return is an error.
        let raw = unsafe { sys::ibv_open_device(device) };
        if raw.is_null() {
            return Err(os_error("ibv_open_device"));
        }
        let context = Arc::new(RawContext { raw });
        // SAFETY: zeroed POD out-structs for the query calls on a live context.
        let (device_attr, port_attr) = unsafe {
            let mut device_attr: sys::ibv_device_attr = std::mem::zeroed();
            let rc = sys::ibv_query_device(context.raw, &mut device_attr);
            if rc != 0 {
                return Err(errno_error("ibv_query_device", rc));
            }
            let mut port_attr: sys::ibv_port_attr = std::mem::zeroed();
            let rc = sys::ibv_query_port(context.raw, PORT, &mut port_attr);
            if rc != 0 {
                return Err(errno_error("ibv_query_port", rc));
            }
            (device_attr, port_attr)
        };
        let ethernet = port_attr.link_layer == sys::IBV_LINK_LAYER_ETHERNET;
        let (gid_index, gid) = select_gid(&context, name, &port_attr, ethernet || iwarp)?;
        Ok(Arc::new(IbvContext {
            raw: context,
            name: name.to_owned(),
            iwarp,
            device_attr,
            port_attr,
            gid_index,
            gid,
            next_cq_id: Mutex::new(1),
        }))
    }
}

/// Owns an `ibv_context`; every other object keeps it alive.
struct RawContext {
    raw: *mut sys::ibv_context,
}

// SAFETY: verbs objects are thread-safe by the libibverbs contract; we only
// pass the pointer to verbs calls.
unsafe impl Send for RawContext {}
// SAFETY: as above.
unsafe impl Sync for RawContext {}

impl Drop for RawContext {
    fn drop(&mut self) {
        // SAFETY: closed once, after every object that holds an Arc to it.
        unsafe { sys::ibv_close_device(self.raw) };
    }
}

fn query_gid(context: &RawContext, index: i32) -> Option<[u8; 16]> {
    // SAFETY: zeroed out-struct, live context.
    unsafe {
        let mut gid: sys::ibv_gid = std::mem::zeroed();
        (sys::ibv_query_gid(context.raw, PORT, index, &mut gid) == 0).then_some(gid.raw)
    }
}

fn select_gid(
    context: &RawContext,
    device: &str,
    port: &sys::ibv_port_attr,
    needs_gid: bool,
) -> Result<(u8, [u8; 16]), VerbsError> {
    if let Ok(index) = std::env::var("RDMA_GID_INDEX") {
        let index: u8 = index
            .parse()
            .map_err(|_| VerbsError::InvalidArgument("RDMA_GID_INDEX must be 0..=255"))?;
        let gid = query_gid(context, i32::from(index))
            .ok_or(VerbsError::InvalidArgument("RDMA_GID_INDEX does not exist"))?;
        return Ok((index, gid));
    }
    if !needs_gid {
        return Ok((0, query_gid(context, 0).unwrap_or([0; 16])));
    }
    // Reading every entry is slow under emulation: look at the first few only.
    let candidates: Vec<(u8, [u8; 16], String)> = (0..port.gid_tbl_len.clamp(0, 8))
        .filter_map(|i| {
            let gid = query_gid(context, i)?;
            if gid == [0; 16] {
                return None;
            }
            let kind = std::fs::read_to_string(format!(
                "/sys/class/infiniband/{device}/ports/{PORT}/gid_attrs/types/{i}"
            ))
            .unwrap_or_default();
            Some((i as u8, gid, kind.trim().to_owned()))
        })
        .collect();
    let ipv4_mapped = |gid: &[u8; 16]| gid[..10] == [0; 10] && gid[10..12] == [0xff, 0xff];
    let chosen = candidates
        .iter()
        .find(|(_, gid, kind)| kind == "RoCE v2" && ipv4_mapped(gid))
        .or_else(|| candidates.iter().find(|(_, _, kind)| kind == "RoCE v2"))
        .or_else(|| candidates.first());
    Ok(chosen.map_or((0, [0; 16]), |(i, gid, _)| (*i, *gid)))
}

/// An opened rdma-core device.
pub struct IbvContext {
    raw: Arc<RawContext>,
    name: String,
    iwarp: bool,
    device_attr: sys::ibv_device_attr,
    port_attr: sys::ibv_port_attr,
    gid_index: u8,
    gid: [u8; 16],
    next_cq_id: Mutex<u32>,
}

// SAFETY: the attribute structs are plain data; the context is thread-safe.
unsafe impl Send for IbvContext {}
// SAFETY: as above.
unsafe impl Sync for IbvContext {}

fn mtu_bytes(mtu: u32) -> u32 {
    match mtu {
        sys::ibv_mtu::IBV_MTU_256 => 256,
        sys::ibv_mtu::IBV_MTU_512 => 512,
        sys::ibv_mtu::IBV_MTU_1024 => 1024,
        sys::ibv_mtu::IBV_MTU_2048 => 2048,
        _ => 4096,
    }
}

fn mtu_enum(bytes: u32) -> u32 {
    match bytes {
        0..=256 => sys::ibv_mtu::IBV_MTU_256,
        257..=512 => sys::ibv_mtu::IBV_MTU_512,
        513..=1024 => sys::ibv_mtu::IBV_MTU_1024,
        1025..=2048 => sys::ibv_mtu::IBV_MTU_2048,
        _ => sys::ibv_mtu::IBV_MTU_4096,
    }
}

// SAFETY: every CQ is a new `ibv_create_cq` of this context; PDs are `IbvPd`s.
unsafe impl Context for IbvContext {
    fn device_name(&self) -> &str {
        &self.name
    }

    fn connection_manager(&self) -> Option<Arc<dyn ConnectionManager>> {
        Some(Arc::new(cm::IbvConnectionManager {
            device: self.name.clone(),
            iwarp: self.iwarp,
        }))
    }

    fn requires_connection_manager(&self) -> bool {
        self.iwarp
    }

    fn caps(&self) -> DeviceCaps {
        let attr = &self.device_attr;
        DeviceCaps {
            max_mr_size: attr.max_mr_size,
            max_sge: attr.max_sge.max(0) as u32,
            max_sge_rd: attr.max_sge_rd.max(0) as u32,
            atomics: attr.atomic_cap != sys::ibv_atomic_cap::IBV_ATOMIC_NONE,
            // iWARP has no RDMA WRITE with immediate (siw rejects it at post).
            write_with_imm: !self.iwarp,
            srq: attr.max_srq > 0,
            // siw raises no event for a solicited SEND on a solicited-only
            // arm (the conformance suite shows it); rxe does.
            solicited_events: !self.iwarp,
            max_cqe: attr.max_cqe.max(0) as u32,
            max_qp_wr: attr.max_qp_wr.max(0) as u32,
            max_srq_wr: attr.max_srq_wr.max(0) as u32,
            memory_windows: binds_windows(attr),
        }
    }

    fn alloc_pd(&self) -> Result<Arc<dyn ProtectionDomain>, VerbsError> {
        // SAFETY: live context; null is an error.
        let pd = unsafe { sys::ibv_alloc_pd(self.raw.raw) };
        if pd.is_null() {
            return Err(os_error("ibv_alloc_pd"));
        }
        let windows = binds_windows(&self.device_attr).then(|| {
            WindowCache::new(
                windows::MAX_CACHED_BYTES,
                !window_reads_confined(&self.device_attr),
            )
        });
        Ok(Arc::new(IbvPd {
            windows,
            raw: Arc::new(RawPd {
                pd,
                _context: self.raw.clone(),
            }),
            port: PortInfo {
                lid: self.port_attr.lid,
                active_mtu: self.port_attr.active_mtu,
                gid_index: self.gid_index,
                gid: self.gid,
                roce_or_iwarp: self.gid != [0; 16]
                    && (self.iwarp || self.port_attr.link_layer == sys::IBV_LINK_LAYER_ETHERNET),
                max_sge_rd: self.device_attr.max_sge_rd.max(1) as u32,
                max_rd_atomic: self.device_attr.max_qp_rd_atom.clamp(1, 16) as u8,
            },
        }))
    }

    fn create_comp_channel(&self) -> Result<Arc<dyn CompletionChannel>, VerbsError> {
        // SAFETY: live context; null is an error.
        let channel = unsafe { sys::ibv_create_comp_channel(self.raw.raw) };
        if channel.is_null() {
            return Err(os_error("ibv_create_comp_channel"));
        }
        // SAFETY: the channel is live; its fd is ours to make non-blocking.
        let fd = unsafe { (*channel).fd };
        // SAFETY: fcntl on a valid fd.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
        }
        Ok(Arc::new(IbvChannel {
            inner: Arc::new(ChannelInner {
                channel,
                cqs: Mutex::default(),
                _context: self.raw.clone(),
            }),
        }))
    }

    fn create_cq(
        &self,
        capacity: u32,
        channel: Option<&Arc<dyn CompletionChannel>>,
    ) -> Result<Arc<dyn CompletionQueue>, VerbsError> {
        let channel = channel
            .map(|channel| {
                super::own::<IbvChannel>(channel.as_any(), "completion channel of another provider")
                    .map(|channel| channel.inner.clone())
            })
            .transpose()?;
        if channel
            .as_ref()
            .is_some_and(|channel| !Arc::ptr_eq(&channel._context, &self.raw))
        {
            return Err(VerbsError::InvalidArgument(
                "completion channel of another device context",
            ));
        }
        let id = {
            let mut next = lock(&self.next_cq_id);
            *next += 1;
            *next - 1
        };
        let raw_channel = channel.as_ref().map_or(ptr::null_mut(), |c| c.channel);
        // SAFETY: live context and channel (or null); the CQ context carries our id.
        let cq = unsafe {
            sys::ibv_create_cq(
                self.raw.raw,
                capacity as i32,
                id as usize as *mut libc::c_void,
                raw_channel,
                0,
            )
        };
        if cq.is_null() {
            return Err(os_error("ibv_create_cq"));
        }
        if let Some(channel) = &channel {
            lock(&channel.cqs).insert(
                id,
                CqEvents {
                    cq: SendPtr(cq),
                    unacked: 0,
                },
            );
        }
        Ok(Arc::new(IbvCq {
            cq,
            id,
            capacity,
            binds: Arc::default(),
            channel,
            _context: self.raw.clone(),
        }))
    }
}

/// True when the device binds type-2 memory windows (2A: to a QP; 2B: to a
/// QP and a PD; both are QP-bound) and can allocate some.
fn memory_windows(attr: &sys::ibv_device_attr) -> bool {
    let type_2 = sys::ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2A.0
        | sys::ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B.0;
    attr.device_cap_flags & type_2 != 0 && attr.max_mw > 0
}

/// The vendor id of Soft-RoCE (`RXE_VENDOR_ID` in the kernel's rxe driver).
const RXE_VENDOR_ID: u32 = 0xff_ffff;

/// Whether this device's protection domains bind type-2 windows for READ
/// windows ([`super::DeviceCaps::memory_windows`]): where the device has
/// them, as `RDMA_MEMORY_WINDOWS` says ([`windows::memory_windows_wanted`]),
/// by default everywhere but on rxe.
///
/// rxe (kernel 6.1) breaks a queue pair that retransmits while a bind sits
/// in its send queue behind an unacknowledged request: `req_retry()` in
/// `rxe_req.c` rewinds the requester to the oldest unacknowledged request
/// and `rxe_requester()` executes the local operations after it again; the
/// second bind of a type-2 window fails (`rxe_bind_mw()`: the window's key
/// changed the first time, -EINVAL) and puts the requester in ERROR with no
/// completion and no further retransmission. The QP stays RTS and falls
/// silent: requests posted after it never go out. Found across two hosts
/// under netem loss and delay (`scripts/rdma-vm/pair-guest.sh`): the stall
/// traced came with one `rxe_bind_mw` returning -EINVAL to `rxe_requester`
/// (a kretprobe); without binds no row stalled, and siw, which has no
/// windows, never did. So on rxe every READ window is a registration of
/// exactly its bytes, unless `RDMA_MEMORY_WINDOWS=on` (the conformance
/// suite's window checks).
fn binds_windows(attr: &sys::ibv_device_attr) -> bool {
    memory_windows(attr) && windows::memory_windows_wanted(binds_windows_by_default(attr))
}

/// Everywhere but on rxe (see [`binds_windows`]).
fn binds_windows_by_default(attr: &sys::ibv_device_attr) -> bool {
    attr.vendor_id != RXE_VENDOR_ID
}

/// False for a device known to check a READ through a memory window only
/// against the registration under the window, not against the window's own
/// range: rxe (kernel 6.1, `check_rkey()` in `rxe_resp.c` calls
/// `mr_check_range()` on the window's MR; measured in the VM: a READ that
/// starts 4 KiB before a window, inside its MR, succeeds). Windows on such
/// a device are bound over registrations of exactly their bytes
/// ([`WindowCache::exact_extents`]).
fn window_reads_confined(attr: &sys::ibv_device_attr) -> bool {
    attr.vendor_id != RXE_VENDOR_ID
}

/// `ibv_inc_rkey`: the next key of a window (its low 8 bits, the "key" part
/// the owner chooses, advance; the index part stays).
fn next_rkey(rkey: u32) -> u32 {
    (rkey & !0xff) | (rkey.wrapping_add(1) & 0xff)
}

#[derive(Clone, Copy)]
struct PortInfo {
    lid: u16,
    active_mtu: u32,
    gid_index: u8,
    gid: [u8; 16],
    roce_or_iwarp: bool,
    max_sge_rd: u32,
    max_rd_atomic: u8,
}

struct RawPd {
    pd: *mut sys::ibv_pd,
    _context: Arc<RawContext>,
}

// SAFETY: thread-safe verbs object.
unsafe impl Send for RawPd {}
// SAFETY: as above.
unsafe impl Sync for RawPd {}

impl Drop for RawPd {
    fn drop(&mut self) {
        // SAFETY: deallocated once, after its MRs, QPs and SRQs (they hold Arcs).
        unsafe { sys::ibv_dealloc_pd(self.pd) };
    }
}

struct IbvPd {
    raw: Arc<RawPd>,
    port: PortInfo,
    /// Registrations over recycled buffers, where the device binds type-2 windows.
    windows: Option<Arc<WindowCache>>,
}

// SAFETY: `create_qp` refuses CQs and SRQs of another context (the device then
// completes each QP only into its own CQs, QP numbers unique per device); regions
// are `ibv_reg_mr` over exactly the bytes and rights asked.
unsafe impl ProtectionDomain for IbvPd {
    unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<Arc<dyn MemoryRegion>, VerbsError> {
        // Bits this crate does not name never reach the device (nor the
        // region's reported rights).
        let access = access & AccessFlags::all();
        // SAFETY: the caller upholds `register`'s contract for the memory.
        let mr = unsafe { sys::ibv_reg_mr(self.raw.pd, addr.cast(), len, access.bits() as i32) };
        if mr.is_null() {
            return Err(os_error("ibv_reg_mr"));
        }
        windows::count_device_registration();
        // SAFETY: a live MR just returned by ibv_reg_mr.
        let (addr, len, lkey, rkey) =
            unsafe { ((*mr).addr as u64, (*mr).length, (*mr).lkey, (*mr).rkey) };
        Ok(Arc::new(IbvMr {
            mr: std::sync::Mutex::new(Some(MrPtr(mr))),
            addr,
            len,
            lkey,
            rkey,
            access,
            _pd: self.raw.clone(),
        }))
    }

    fn window_cache(&self) -> Option<&Arc<WindowCache>> {
        self.windows.as_ref()
    }

    /// `ibv_alloc_mw(TYPE_2)`, then an `IBV_WR_BIND_MW` request on `qp`
    /// (signaled, [`super::WINDOW_BIND_WR_ID`]) with the next key
    /// (`ibv_inc_rkey`). A fresh window per bind, deallocated (not
    /// invalidated for reuse) when revoked: see [`IbvMw::deregister`].
    unsafe fn bind_window(
        &self,
        region: &Arc<dyn MemoryRegion>,
        addr: u64,
        len: usize,
        access: AccessFlags,
        qp: &Arc<dyn QueuePair>,
    ) -> Result<Arc<dyn MemoryRegion>, VerbsError> {
        if self.windows.is_none() {
            return Err(VerbsError::Unsupported("type-2 memory windows"));
        }
        // Only the rights this crate names: a value built with
        // `from_bits_retain` reaches neither the device nor the window's
        // reported rights.
        let access = access & AccessFlags::all();
        let mr = super::own::<IbvMr>(region.as_any(), "region of another provider")?;
        let raw_qp = super::own::<IbvQp>(qp.as_any(), "queue pair of another provider")?;
        if !Arc::ptr_eq(&mr._pd, &self.raw) || !Arc::ptr_eq(&raw_qp._pd, &self.raw) {
            return Err(VerbsError::InvalidArgument(
                "a window over a region or for a QP of another protection domain",
            ));
        }
        let inside = addr
            .checked_add(len as u64)
            .is_some_and(|end| addr >= mr.addr && end <= mr.addr + mr.len as u64);
        if len == 0 || !inside {
            return Err(VerbsError::InvalidArgument("a window outside its region"));
        }
        if !mr.access.contains(AccessFlags::MW_BIND) {
            return Err(VerbsError::InvalidArgument(
                "binding a window over a region registered without MW_BIND",
            ));
        }
        // The region stays registered while its lock is held (deregister
        // takes it): the bind names a live MR.
        let mr_slot = lock(&mr.mr);
        let Some(MrPtr(raw_mr)) = *mr_slot else {
            return Err(VerbsError::InvalidArgument(
                "binding a window over a deregistered region",
            ));
        };
        if !raw_qp.binds.try_acquire() {
            return Err(VerbsError::QueueFull("memory-window binds in flight"));
        }
        // SAFETY: live PD; null is an error.
        let mw = unsafe { sys::ibv_alloc_mw(self.raw.pd, sys::ibv_mw_type::IBV_MW_TYPE_2) };
        if mw.is_null() {
            raw_qp.binds.release();
            return Err(os_error("ibv_alloc_mw"));
        }
        // SAFETY: a live MW just allocated.
        let rkey = next_rkey(unsafe { (*mw).rkey });
        // SAFETY: ibv_send_wr is plain data (pointers, integers, unions of them).
        let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = super::WINDOW_BIND_WR_ID;
        wr.opcode = sys::ibv_wr_opcode::IBV_WR_BIND_MW;
        wr.send_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.bind_mw_tso_union.bind_mw = sys::bind_mw_t {
            mw,
            rkey,
            bind_info: sys::ibv_mw_bind_info {
                mr: raw_mr,
                addr,
                length: len as u64,
                mw_access_flags: access.bits(),
            },
        };
        let mut bad = ptr::null_mut();
        // SAFETY: live QP, MW and MR (the MR's lock is held); the request
        // lives through the call. The caller upholds the memory contract
        // for the window's bytes.
        let rc = unsafe { sys::ibv_post_send(raw_qp.qp, &mut wr, &mut bad) };
        drop(mr_slot);
        if rc != 0 {
            raw_qp.binds.release();
            // SAFETY: the MW was never bound (the post failed); deallocated once.
            unsafe { sys::ibv_dealloc_mw(mw) };
            return Err(errno_error("posting a memory-window bind", rc));
        }
        Ok(Arc::new(IbvMw {
            mw: Mutex::new(Some(MwPtr(mw))),
            addr,
            len,
            rkey,
            access,
            _qp: qp.clone(),
            _region: region.clone(),
            _pd: self.raw.clone(),
        }))
    }

    fn create_qp(&self, init: QpInit) -> Result<Arc<dyn QueuePair>, VerbsError> {
        // rdma-core resolves the CQs and the SRQ by handle in the PD's own
        // context: an object of another context (another `open`) could be
        // taken for a different one of this context. Refused.
        let context = &self.raw._context;
        let cq_of = |cq: &Arc<dyn CompletionQueue>| {
            let cq = super::own::<IbvCq>(cq.as_any(), "CQ of another provider")?;
            if !Arc::ptr_eq(&cq._context, context) {
                return Err(VerbsError::InvalidArgument("CQ of another device context"));
            }
            Ok(cq.cq)
        };
        let binds = super::own::<IbvCq>(init.send_cq.as_any(), "CQ of another provider")?
            .binds
            .clone();
        let srq = match &init.srq {
            Some(srq) => {
                let srq = super::own::<IbvSrq>(srq.as_any(), "SRQ of another provider")?;
                if !Arc::ptr_eq(&srq._pd, &self.raw) {
                    return Err(VerbsError::InvalidArgument(
                        "SRQ of another protection domain",
                    ));
                }
                srq.srq
            }
            None => ptr::null_mut(),
        };
        // SAFETY: zeroed POD; every pointer set is a live verbs object of
        // this PD's context (checked above).
        let mut attr: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attr.send_cq = cq_of(&init.send_cq)?;
        attr.recv_cq = cq_of(&init.recv_cq)?;
        attr.srq = srq;
        attr.cap = sys::ibv_qp_cap {
            max_send_wr: init.caps.max_send_wr,
            max_recv_wr: if srq.is_null() {
                init.caps.max_recv_wr
            } else {
                0
            },
            max_send_sge: init.caps.max_send_sge,
            max_recv_sge: init.caps.max_recv_sge,
            max_inline_data: init.caps.max_inline_data,
        };
        attr.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        attr.sq_sig_all = i32::from(init.sq_sig_all);
        // SAFETY: live PD, valid init attributes.
        let qp = unsafe { sys::ibv_create_qp(self.raw.pd, &mut attr) };
        if qp.is_null() {
            return Err(os_error("ibv_create_qp"));
        }
        let granted = QpCaps {
            max_send_wr: attr.cap.max_send_wr,
            max_recv_wr: attr.cap.max_recv_wr,
            max_send_sge: attr.cap.max_send_sge,
            max_recv_sge: attr.cap.max_recv_sge,
            max_inline_data: attr.cap.max_inline_data,
        };
        let psn = (std::process::id().wrapping_mul(2_654_435_761) ^ qp as usize as u32) & 0xff_ffff;
        Ok(Arc::new(IbvQp {
            qp,
            binds,
            caps: granted,
            port: self.port,
            psn,
            state: Mutex::new(QpState::Reset),
            rts_options: Mutex::new(None),
            _keep: QpDependencies {
                _send_cq: init.send_cq,
                _recv_cq: init.recv_cq,
                _srq: init.srq,
            },
            _pd: self.raw.clone(),
        }))
    }

    fn create_srq(
        &self,
        max_wr: u32,
        max_sge: u32,
    ) -> Result<Arc<dyn SharedReceiveQueue>, VerbsError> {
        // SAFETY: zeroed POD init attributes.
        let mut attr: sys::ibv_srq_init_attr = unsafe { std::mem::zeroed() };
        attr.attr = sys::ibv_srq_attr {
            max_wr,
            max_sge,
            srq_limit: 0,
        };
        // SAFETY: live PD.
        let srq = unsafe { sys::ibv_create_srq(self.raw.pd, &mut attr) };
        if srq.is_null() {
            return Err(os_error("ibv_create_srq"));
        }
        Ok(Arc::new(IbvSrq {
            srq,
            _pd: self.raw.clone(),
        }))
    }
}

/// An `ibv_mr` pointer, passed only to verbs calls.
struct MrPtr(*mut sys::ibv_mr);
// SAFETY: a thread-safe verbs object; the pointer is only handed to
// ibv_dereg_mr, under the IbvMr's lock.
unsafe impl Send for MrPtr {}

struct IbvMr {
    /// `None` once deregistered.
    mr: std::sync::Mutex<Option<MrPtr>>,
    addr: u64,
    len: usize,
    lkey: u32,
    rkey: u32,
    access: AccessFlags,
    _pd: Arc<RawPd>,
}

// SAFETY: rdma-core's `ibv_reg_mr` registration: the HCA enforces range and rights by key; once
// `ibv_dereg_mr` returned 0 it translates the keys for no new access. Requests outstanding at
// that moment are not covered by rdma-core: the crate's owners never deregister memory under
// outstanding requests (they leak it).
unsafe impl MemoryRegion for IbvMr {
    fn addr(&self) -> u64 {
        self.addr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn lkey(&self) -> u32 {
        self.lkey
    }
    fn rkey(&self) -> u32 {
        self.rkey
    }
    fn access(&self) -> AccessFlags {
        self.access
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn deregister(&self) -> Result<(), VerbsError> {
        let mut mr = self.mr.lock().unwrap_or_else(|p| p.into_inner());
        let Some(MrPtr(raw)) = *mr else {
            return Ok(());
        };
        // SAFETY: a live MR, deregistered at most once (the slot is cleared
        // on success, under the lock). Once this returns 0 the HCA no longer
        // translates its keys: no DMA reaches the memory through them.
        let result = unsafe { sys::ibv_dereg_mr(raw) };
        if result != 0 {
            return Err(VerbsError::Io(std::io::Error::from_raw_os_error(
                result.abs(),
            )));
        }
        *mr = None;
        Ok(())
    }
}

impl Drop for IbvMr {
    fn drop(&mut self) {
        if let Err(error) = self.deregister() {
            // Owners that free memory call `deregister` first and leak on
            // failure; here there is nothing more to do than say so.
            tracing::error!(%error, "ibv_dereg_mr failed");
        }
    }
}

/// An `ibv_mw` pointer, passed only to verbs calls.
struct MwPtr(*mut sys::ibv_mw);
// SAFETY: a thread-safe verbs object; the pointer is only handed to
// ibv_dealloc_mw, under the IbvMw's lock.
unsafe impl Send for MwPtr {}

/// A type-2 memory window bound over part of an [`IbvMr`], usable only
/// through the QP it was bound on.
struct IbvMw {
    /// `None` once deallocated.
    mw: Mutex<Option<MwPtr>>,
    addr: u64,
    len: usize,
    rkey: u32,
    access: AccessFlags,
    /// A window bound to a QP holds it (rxe: `ibv_destroy_qp` waits for its
    /// windows): the QP is destroyed only after the window is gone.
    _qp: Arc<dyn QueuePair>,
    /// The region it is bound over (a bound region cannot be deregistered).
    _region: Arc<dyn MemoryRegion>,
    _pd: Arc<RawPd>,
}

// SAFETY: a type-2 memory window: the HCA enforces its range and rights, and `ibv_dealloc_mw`
// returning 0 invalidates it.
unsafe impl MemoryRegion for IbvMw {
    fn addr(&self) -> u64 {
        self.addr
    }
    fn len(&self) -> usize {
        self.len
    }
    /// A window has no local key.
    fn lkey(&self) -> u32 {
        0
    }
    fn rkey(&self) -> u32 {
        self.rkey
    }
    fn access(&self) -> AccessFlags {
        self.access
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    /// `ibv_dealloc_mw`: a system call that returns once the window is gone
    /// (rxe removes it from its key table before returning, and checks the
    /// key again for every packet of a READ response), so no access through
    /// its key happens afterwards. Chosen over invalidating with a posted
    /// `IBV_WR_LOCAL_INV` and waiting for that completion: revoking stays
    /// synchronous (the `Window` contract: the memory is let go only after
    /// this returned), and it works whatever state the QP is in — an
    /// invalidation posted on a QP in ERROR is flushed and proves nothing.
    /// The cost is one `ibv_alloc_mw` per window besides the bind.
    fn deregister(&self) -> Result<(), VerbsError> {
        let mut mw = lock(&self.mw);
        let Some(MwPtr(raw)) = *mw else {
            return Ok(());
        };
        // SAFETY: a live MW, deallocated at most once (the slot is cleared
        // on success, under the lock).
        let rc = unsafe { sys::ibv_dealloc_mw(raw) };
        if rc != 0 {
            return Err(errno_error("ibv_dealloc_mw", rc));
        }
        *mw = None;
        Ok(())
    }
}

impl Drop for IbvMw {
    fn drop(&mut self) {
        if let Err(error) = self.deregister() {
            tracing::error!(%error, "ibv_dealloc_mw failed");
        }
    }
}

#[derive(Clone, Copy)]
struct SendPtr(*mut sys::ibv_cq);
// SAFETY: a CQ pointer passed only to verbs calls.
unsafe impl Send for SendPtr {}

struct CqEvents {
    cq: SendPtr,
    unacked: u32,
}

struct ChannelInner {
    channel: *mut sys::ibv_comp_channel,
    /// CQ id → its pointer and events got but not yet acked (a CQ cannot be
    /// destroyed while events are unacknowledged).
    cqs: Mutex<HashMap<u32, CqEvents>>,
    _context: Arc<RawContext>,
}

// SAFETY: thread-safe verbs object; the map is behind a mutex.
unsafe impl Send for ChannelInner {}
// SAFETY: as above.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: destroyed once, after every CQ that uses it (they hold Arcs).
        unsafe { sys::ibv_destroy_comp_channel(self.channel) };
    }
}

struct IbvChannel {
    inner: Arc<ChannelInner>,
}

// SAFETY: `fd` returns the channel's own descriptor, the same on every call,
// open until `ChannelInner` is dropped, which outlives every IbvChannel.
unsafe impl CompletionChannel for IbvChannel {
    fn fd(&self) -> RawFd {
        // SAFETY: live channel.
        unsafe { (*self.inner.channel).fd }
    }

    fn get_event(&self) -> Result<Option<u32>, VerbsError> {
        let mut cq = ptr::null_mut();
        let mut cq_context = ptr::null_mut();
        // SAFETY: live channel (non-blocking fd); out-pointers are valid.
        let rc = unsafe { sys::ibv_get_cq_event(self.inner.channel, &mut cq, &mut cq_context) };
        if rc != 0 {
            let error = std::io::Error::last_os_error();
            return match error.kind() {
                std::io::ErrorKind::WouldBlock => Ok(None),
                _ => Err(VerbsError::Io(error)),
            };
        }
        let id = cq_context as usize as u32;
        if let Some(events) = lock(&self.inner.cqs).get_mut(&id) {
            events.unacked += 1;
        }
        Ok(Some(id))
    }

    fn ack_events(&self, cq_id: u32, count: u32) {
        let mut cqs = lock(&self.inner.cqs);
        if let Some(events) = cqs.get_mut(&cq_id) {
            let count = count.min(events.unacked);
            events.unacked -= count;
            // SAFETY: live CQ of this channel; count ≤ events got.
            unsafe { sys::ibv_ack_cq_events(events.cq.0, count) };
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

struct IbvCq {
    cq: *mut sys::ibv_cq,
    id: u32,
    capacity: u32,
    /// Memory-window binds in flight on the QPs that send into this CQ.
    binds: Arc<BindBudget>,
    channel: Option<Arc<ChannelInner>>,
    _context: Arc<RawContext>,
}

// SAFETY: thread-safe verbs object.
unsafe impl Send for IbvCq {}
// SAFETY: as above.
unsafe impl Sync for IbvCq {}

impl Drop for IbvCq {
    fn drop(&mut self) {
        if let Some(channel) = &self.channel {
            if let Some(events) = lock(&channel.cqs).remove(&self.id) {
                // SAFETY: ack what was got and never acked, or destroy would wait forever.
                unsafe { sys::ibv_ack_cq_events(self.cq, events.unacked) };
            }
        }
        // SAFETY: destroyed once, after its QPs (they hold Arcs to it).
        unsafe { sys::ibv_destroy_cq(self.cq) };
    }
}

fn wc_status(status: u32) -> WcStatus {
    match status {
        0 => WcStatus::Success,
        1 => WcStatus::LocLenErr,
        2 => WcStatus::LocQpOpErr,
        4 => WcStatus::LocProtErr,
        5 => WcStatus::WrFlushErr,
        6 => WcStatus::MwBindErr,
        7 => WcStatus::BadRespErr,
        8 => WcStatus::LocAccessErr,
        9 => WcStatus::RemInvReqErr,
        10 => WcStatus::RemAccessErr,
        11 => WcStatus::RemOpErr,
        12 => WcStatus::RetryExcErr,
        13 => WcStatus::RnrRetryExcErr,
        _ => WcStatus::GeneralErr,
    }
}

fn wc_opcode(opcode: u32) -> WcOpcode {
    match opcode {
        sys::ibv_wc_opcode::IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
        sys::ibv_wc_opcode::IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
        sys::ibv_wc_opcode::IBV_WC_COMP_SWAP => WcOpcode::CompSwap,
        sys::ibv_wc_opcode::IBV_WC_FETCH_ADD => WcOpcode::FetchAdd,
        sys::ibv_wc_opcode::IBV_WC_RECV => WcOpcode::Recv,
        sys::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
        _ => WcOpcode::Send,
    }
}

// SAFETY: `ibv_poll_cq` reports each request once, after the HCA finished with its memory; the
// wr_id and qp_num are the HCA's (window binds' success completions are consumed here).
unsafe impl CompletionQueue for IbvCq {
    fn capacity(&self) -> u32 {
        self.capacity
    }

    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize, VerbsError> {
        const BATCH: usize = 32;
        let mut done = 0;
        while done < out.len() {
            let want = (out.len() - done).min(BATCH);
            // SAFETY: ibv_wc is plain data; zeroed is a valid bit pattern.
            let mut wcs: [sys::ibv_wc; BATCH] = unsafe { std::mem::zeroed() };
            // SAFETY: live CQ; `wcs` has room for `want` entries.
            let polled = unsafe { sys::ibv_poll_cq(self.cq, want as i32, wcs.as_mut_ptr()) };
            if polled < 0 {
                return Err(errno_error("ibv_poll_cq", polled));
            }
            let mut taken = 0;
            for wc in &wcs[..polled as usize] {
                if wc.wr_id == super::WINDOW_BIND_WR_ID
                    && (wc.opcode == sys::ibv_wc_opcode::IBV_WC_BIND_MW
                        || wc.status != sys::ibv_wc_status::IBV_WC_SUCCESS)
                {
                    // A bind of ours finished: its send-queue entry is free.
                    // A successful one is nobody else's business; a failed
                    // one (the QP broke) is reported like any failure.
                    self.binds.release();
                    if wc.status == sys::ibv_wc_status::IBV_WC_SUCCESS {
                        continue;
                    }
                }
                let slot = &mut out[done + taken];
                taken += 1;
                let with_imm = wc.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
                *slot = WorkCompletion {
                    wr_id: wc.wr_id,
                    status: wc_status(wc.status),
                    opcode: wc_opcode(wc.opcode),
                    byte_len: wc.byte_len,
                    imm_data: if with_imm {
                        // SAFETY: the union holds imm_data when IBV_WC_WITH_IMM is set.
                        Some(unsafe { wc.imm_data_invalidated_rkey_union.imm_data })
                    } else {
                        None
                    },
                    qp_num: wc.qp_num,
                };
            }
            done += taken;
            if (polled as usize) < want {
                break;
            }
        }
        Ok(done)
    }

    fn req_notify(&self, solicited_only: bool) -> Result<(), VerbsError> {
        if self.channel.is_none() {
            return Err(VerbsError::InvalidArgument("CQ has no completion channel"));
        }
        // SAFETY: live CQ.
        let rc = unsafe { sys::ibv_req_notify_cq(self.cq, i32::from(solicited_only)) };
        if rc != 0 {
            Err(errno_error("ibv_req_notify_cq", rc))
        } else {
            Ok(())
        }
    }

    fn id(&self) -> u32 {
        self.id
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

struct IbvSrq {
    srq: *mut sys::ibv_srq,
    _pd: Arc<RawPd>,
}

// SAFETY: thread-safe verbs object.
unsafe impl Send for IbvSrq {}
// SAFETY: as above.
unsafe impl Sync for IbvSrq {}

impl Drop for IbvSrq {
    fn drop(&mut self) {
        // SAFETY: destroyed once, after its QPs (they hold Arcs).
        unsafe { sys::ibv_destroy_srq(self.srq) };
    }
}

/// Receive work requests laid out for `ibv_post_recv`: the SGE arrays must
/// outlive the call, so they are built first and linked afterwards.
fn post_receives(
    wrs: Vec<RecvWr>,
    post: impl FnOnce(*mut sys::ibv_recv_wr, *mut *mut sys::ibv_recv_wr) -> i32,
) -> Result<(), PostError<RecvWr>> {
    if wrs.is_empty() {
        return Ok(());
    }
    let mut sges: Vec<Vec<sys::ibv_sge>> = wrs
        .iter()
        .map(|wr| {
            wr.sg_list
                .iter()
                .map(|s| sys::ibv_sge {
                    addr: s.addr,
                    length: s.length,
                    lkey: s.lkey,
                })
                .collect()
        })
        .collect();
    let mut raw: Vec<sys::ibv_recv_wr> = wrs
        .iter()
        .zip(sges.iter_mut())
        .map(|(wr, sges)| sys::ibv_recv_wr {
            wr_id: wr.wr_id,
            next: ptr::null_mut(),
            sg_list: sges.as_mut_ptr(),
            num_sge: sges.len() as i32,
        })
        .collect();
    for i in 1..raw.len() {
        let next: *mut sys::ibv_recv_wr = &mut raw[i];
        raw[i - 1].next = next;
    }
    let first: *mut sys::ibv_recv_wr = &mut raw[0];
    let mut bad = ptr::null_mut();
    let rc = post(first, &mut bad);
    if rc == 0 {
        return Ok(());
    }
    let failed = raw.iter().position(|wr| ptr::eq(wr, bad)).unwrap_or(0);
    let mut wrs = wrs.into_iter().skip(failed);
    let wr = wrs.next().expect("failed index is in range");
    Err(PostError::handing_back(
        errno_error("post_recv", rc),
        wr,
        wrs,
    ))
}

// SAFETY: rdma-core's SRQ: receives are consumed only by QPs created with it and complete on their
// receive CQs.
unsafe impl SharedReceiveQueue for IbvSrq {
    unsafe fn post_recv(&self, wrs: Vec<RecvWr>) -> Result<(), PostError<RecvWr>> {
        // SAFETY: live SRQ; the linked list and its SGE arrays live through the call.
        post_receives(wrs, |first, bad| unsafe {
            sys::ibv_post_srq_recv(self.srq, first, bad)
        })
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The objects a QP points into: they must outlive it.
struct QpDependencies {
    _send_cq: Arc<dyn CompletionQueue>,
    _recv_cq: Arc<dyn CompletionQueue>,
    _srq: Option<Arc<dyn SharedReceiveQueue>>,
}

struct IbvQp {
    qp: *mut sys::ibv_qp,
    /// Memory-window binds in flight, shared with the send CQ.
    binds: Arc<BindBudget>,
    caps: QpCaps,
    port: PortInfo,
    psn: u32,
    /// Tracked here: siw's ibv_query_qp always reports RESET.
    state: Mutex<QpState>,
    /// What `to_rtr` was given, applied again by `to_rts`.
    rts_options: Mutex<Option<ConnectOptions>>,
    /// Keeps the CQs and SRQ alive as long as the QP.
    _keep: QpDependencies,
    _pd: Arc<RawPd>,
}

// SAFETY: thread-safe verbs object; the state is behind a mutex.
unsafe impl Send for IbvQp {}
// SAFETY: as above.
unsafe impl Sync for IbvQp {}

impl Drop for IbvQp {
    fn drop(&mut self) {
        // SAFETY: destroyed once.
        unsafe { sys::ibv_destroy_qp(self.qp) };
    }
}

/// The IB encoding of a minimum RNR timer (IBA table 45), rounded up.
fn rnr_timer_code(wait: std::time::Duration) -> u8 {
    const MICROS: [(u8, u64); 31] = [
        (1, 10),
        (2, 20),
        (3, 30),
        (4, 40),
        (5, 60),
        (6, 80),
        (7, 120),
        (8, 160),
        (9, 240),
        (10, 320),
        (11, 480),
        (12, 640),
        (13, 960),
        (14, 1280),
        (15, 1920),
        (16, 2560),
        (17, 3840),
        (18, 5120),
        (19, 7680),
        (20, 10240),
        (21, 15360),
        (22, 20480),
        (23, 30720),
        (24, 40960),
        (25, 61440),
        (26, 81920),
        (27, 122880),
        (28, 163840),
        (29, 245760),
        (30, 327680),
        (31, 491520),
    ];
    let micros = wait.as_micros() as u64;
    MICROS
        .iter()
        .find(|(_, us)| *us >= micros)
        .map_or(0, |(code, _)| *code)
}

impl IbvQp {
    fn modify(
        &self,
        attr: &mut sys::ibv_qp_attr,
        mask: u32,
        to: QpState,
        what: &str,
    ) -> Result<(), VerbsError> {
        // SAFETY: live QP; `attr` is initialised for every bit in `mask`.
        let rc = unsafe { sys::ibv_modify_qp(self.qp, attr, mask as i32) };
        if rc != 0 {
            return Err(errno_error(what, rc));
        }
        *lock(&self.state) = to;
        Ok(())
    }

    fn expect_state(&self, expected: QpState, what: &'static str) -> Result<(), VerbsError> {
        let state = self.state();
        if state != expected {
            // SAFETY: live QP.
            let qp_num = unsafe { (*self.qp).qp_num };
            return Err(VerbsError::InvalidState {
                qp_num,
                state,
                what,
            });
        }
        Ok(())
    }
}

// SAFETY: rdma-core's RC QP: the HCA accesses memory as the SGEs say (lkeys checked), completes
// every request on the QP's CQs and flushes them in ERROR; QP numbers are the HCA's, unique among
// live QPs.
unsafe impl QueuePair for IbvQp {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn qp_num(&self) -> u32 {
        // SAFETY: live QP.
        unsafe { (*self.qp).qp_num }
    }

    fn state(&self) -> QpState {
        let cached = *lock(&self.state);
        if matches!(cached, QpState::Rtr | QpState::Rts) {
            // The HCA moves a QP to ERROR by itself; ask (trusting only an ERROR answer).
            // SAFETY: zeroed POD out-structs; live QP.
            let reported = unsafe {
                let mut attr: sys::ibv_qp_attr = std::mem::zeroed();
                let mut init: sys::ibv_qp_init_attr = std::mem::zeroed();
                let rc = sys::ibv_query_qp(
                    self.qp,
                    &mut attr,
                    sys::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32,
                    &mut init,
                );
                (rc == 0).then_some(attr.qp_state)
            };
            if reported == Some(sys::ibv_qp_state::IBV_QPS_ERR) {
                *lock(&self.state) = QpState::Error;
                return QpState::Error;
            }
        }
        cached
    }

    fn caps(&self) -> QpCaps {
        self.caps
    }

    fn local_address(&self) -> QpAddress {
        QpAddress {
            qp_num: self.qp_num(),
            psn: self.psn,
            lid: self.port.lid,
            gid: self.port.gid,
            mtu: mtu_bytes(self.port.active_mtu),
            extra: Vec::new(),
        }
    }

    fn to_init(&self) -> Result<(), VerbsError> {
        self.expect_state(QpState::Reset, "to_init needs RESET")?;
        use sys::ibv_qp_attr_mask as m;
        // SAFETY: zeroed POD.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = PORT;
        attr.qp_access_flags = (AccessFlags::LOCAL_WRITE
            | AccessFlags::REMOTE_WRITE
            | AccessFlags::REMOTE_READ
            | AccessFlags::REMOTE_ATOMIC)
            .bits();
        let mask = m::IBV_QP_STATE.0
            | m::IBV_QP_PKEY_INDEX.0
            | m::IBV_QP_PORT.0
            | m::IBV_QP_ACCESS_FLAGS.0;
        self.modify(&mut attr, mask, QpState::Init, "modify QP to INIT")
    }

    fn to_rtr(&self, remote: &QpAddress, options: &ConnectOptions) -> Result<(), VerbsError> {
        self.expect_state(QpState::Init, "to_rtr needs INIT")?;
        use sys::ibv_qp_attr_mask as m;
        // SAFETY: zeroed POD.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = mtu_enum(remote.mtu.min(mtu_bytes(self.port.active_mtu)));
        attr.dest_qp_num = remote.qp_num;
        attr.rq_psn = remote.psn;
        attr.max_dest_rd_atomic = options.max_rd_atomic.min(self.port.max_rd_atomic).max(1);
        attr.min_rnr_timer = rnr_timer_code(options.rnr_timer);
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.port_num = PORT;
        if self.port.roce_or_iwarp || remote.gid != [0; 16] {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid.raw = remote.gid;
            attr.ah_attr.grh.sgid_index = self.port.gid_index;
            attr.ah_attr.grh.hop_limit = 1;
        }
        let mask = m::IBV_QP_STATE.0
            | m::IBV_QP_AV.0
            | m::IBV_QP_PATH_MTU.0
            | m::IBV_QP_DEST_QPN.0
            | m::IBV_QP_RQ_PSN.0
            | m::IBV_QP_MAX_DEST_RD_ATOMIC.0
            | m::IBV_QP_MIN_RNR_TIMER.0;
        let mut options = *options;
        options.max_rd_atomic = attr.max_dest_rd_atomic;
        *lock(&self.rts_options) = Some(options);
        self.modify(&mut attr, mask, QpState::Rtr, "modify QP to RTR")
    }

    fn to_rts(&self) -> Result<(), VerbsError> {
        self.expect_state(QpState::Rtr, "to_rts needs RTR")?;
        let options = lock(&self.rts_options).unwrap_or_default();
        use sys::ibv_qp_attr_mask as m;
        // SAFETY: zeroed POD.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        attr.timeout = options.ack_timeout_exponent();
        attr.retry_cnt = options.retry_count.min(7);
        attr.rnr_retry = options.rnr_retry.min(7);
        attr.sq_psn = self.psn;
        attr.max_rd_atomic = options.max_rd_atomic.max(1);
        let mask = m::IBV_QP_STATE.0
            | m::IBV_QP_TIMEOUT.0
            | m::IBV_QP_RETRY_CNT.0
            | m::IBV_QP_RNR_RETRY.0
            | m::IBV_QP_SQ_PSN.0
            | m::IBV_QP_MAX_QP_RD_ATOMIC.0;
        self.modify(&mut attr, mask, QpState::Rts, "modify QP to RTS")
    }

    fn to_error(&self) -> Result<(), VerbsError> {
        // SAFETY: zeroed POD.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_ERR;
        self.modify(
            &mut attr,
            sys::ibv_qp_attr_mask::IBV_QP_STATE.0,
            QpState::Error,
            "modify QP to ERROR",
        )
    }

    unsafe fn post_send(&self, wrs: Vec<SendWr>) -> Result<(), PostError<SendWr>> {
        if wrs.is_empty() {
            return Ok(());
        }
        // Checks the device does not make itself (siw would report SUCCESS
        // for a READ into more SGEs than max_sge_rd and move half the data).
        if let Some(i) = wrs.iter().position(|wr| {
            matches!(wr.op, SendOp::RdmaRead { .. })
                && wr.sg_list.len() as u32 > self.port.max_sge_rd
        }) {
            let mut rest = wrs.into_iter().skip(i);
            let wr = rest.next().expect("index in range");
            return Err(PostError::handing_back(
                VerbsError::Unsupported("more SGEs per RDMA READ than the device's max_sge_rd"),
                wr,
                rest,
            ));
        }
        let mut sges: Vec<Vec<sys::ibv_sge>> = wrs
            .iter()
            .map(|wr| {
                wr.sg_list
                    .iter()
                    .map(|s| sys::ibv_sge {
                        addr: s.addr,
                        length: s.length,
                        lkey: s.lkey,
                    })
                    .collect()
            })
            .collect();
        let mut raw: Vec<sys::ibv_send_wr> = wrs
            .iter()
            .zip(sges.iter_mut())
            .map(|(wr, sges)| {
                use sys::ibv_wr_opcode as op;
                // SAFETY: ibv_send_wr is plain data (pointers, integers, unions of them).
                let mut raw: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
                raw.wr_id = wr.wr_id;
                raw.sg_list = sges.as_mut_ptr();
                raw.num_sge = sges.len() as i32;
                let mut flags = 0;
                if wr.signaled {
                    flags |= sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
                }
                if wr.inline {
                    flags |= sys::ibv_send_flags::IBV_SEND_INLINE.0;
                }
                if wr.solicited {
                    flags |= sys::ibv_send_flags::IBV_SEND_SOLICITED.0;
                }
                raw.send_flags = flags;
                let rdma = |remote_addr, rkey| sys::wr_t {
                    rdma: sys::rdma_t { remote_addr, rkey },
                };
                match wr.op {
                    SendOp::Send => raw.opcode = op::IBV_WR_SEND,
                    SendOp::SendWithImm(imm) => {
                        raw.opcode = op::IBV_WR_SEND_WITH_IMM;
                        raw.imm_data_invalidated_rkey_union.imm_data = imm;
                    }
                    SendOp::RdmaWrite { remote_addr, rkey } => {
                        raw.opcode = op::IBV_WR_RDMA_WRITE;
                        raw.wr = rdma(remote_addr, rkey);
                    }
                    SendOp::RdmaWriteWithImm {
                        remote_addr,
                        rkey,
                        imm,
                    } => {
                        raw.opcode = op::IBV_WR_RDMA_WRITE_WITH_IMM;
                        raw.wr = rdma(remote_addr, rkey);
                        raw.imm_data_invalidated_rkey_union.imm_data = imm;
                    }
                    SendOp::RdmaRead { remote_addr, rkey } => {
                        raw.opcode = op::IBV_WR_RDMA_READ;
                        raw.wr = rdma(remote_addr, rkey);
                    }
                    SendOp::AtomicCmpAndSwp {
                        remote_addr,
                        rkey,
                        compare,
                        swap,
                    } => {
                        raw.opcode = op::IBV_WR_ATOMIC_CMP_AND_SWP;
                        raw.wr = sys::wr_t {
                            atomic: sys::atomic_t {
                                remote_addr,
                                compare_add: compare,
                                swap,
                                rkey,
                            },
                        };
                    }
                    SendOp::AtomicFetchAndAdd {
                        remote_addr,
                        rkey,
                        add,
                    } => {
                        raw.opcode = op::IBV_WR_ATOMIC_FETCH_AND_ADD;
                        raw.wr = sys::wr_t {
                            atomic: sys::atomic_t {
                                remote_addr,
                                compare_add: add,
                                swap: 0,
                                rkey,
                            },
                        };
                    }
                }
                raw
            })
            .collect();
        for i in 1..raw.len() {
            let next: *mut sys::ibv_send_wr = &mut raw[i];
            raw[i - 1].next = next;
        }
        let first: *mut sys::ibv_send_wr = &mut raw[0];
        let mut bad = ptr::null_mut();
        // SAFETY: live QP; the linked list and its SGE arrays live through the call.
        let rc = unsafe { sys::ibv_post_send(self.qp, first, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        let failed = raw.iter().position(|wr| ptr::eq(wr, bad)).unwrap_or(0);
        let mut rest = wrs.into_iter().skip(failed);
        let wr = rest.next().expect("failed index is in range");
        Err(PostError::handing_back(
            errno_error("ibv_post_send", rc),
            wr,
            rest,
        ))
    }

    unsafe fn post_recv(&self, wrs: Vec<RecvWr>) -> Result<(), PostError<RecvWr>> {
        // SAFETY: live QP; the linked list and its SGE arrays live through the call.
        post_receives(wrs, |first, bad| unsafe {
            sys::ibv_post_recv(self.qp, first, bad)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// rxe (vendor id 0xffffff) binds no windows unless asked: its binds
    /// break a retransmitting QP. Other devices with windows bind them.
    #[test]
    fn rxe_binds_no_windows_by_default_and_others_do() {
        // SAFETY: ibv_device_attr is plain data (integers and arrays).
        let mut attr: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
        attr.device_cap_flags = sys::ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B.0;
        attr.max_mw = 1024;
        assert!(memory_windows(&attr));
        attr.vendor_id = RXE_VENDOR_ID;
        assert!(!binds_windows_by_default(&attr), "rxe");
        attr.vendor_id = 0x02c9;
        assert!(binds_windows_by_default(&attr), "a Mellanox NIC");
        attr.max_mw = 0;
        assert!(!memory_windows(&attr), "no windows to bind (siw: max_mw 0)");
    }

    #[test]
    fn rnr_timer_codes_round_up_to_the_iba_table() {
        assert_eq!(rnr_timer_code(Duration::from_micros(1)), 1);
        assert_eq!(rnr_timer_code(Duration::from_micros(10)), 1);
        assert_eq!(rnr_timer_code(Duration::from_micros(11)), 2);
        assert_eq!(rnr_timer_code(Duration::from_micros(640)), 12);
        assert_eq!(rnr_timer_code(Duration::from_millis(1)), 14);
        // Beyond the table's largest finite entry: code 0 means 655.36 ms.
        assert_eq!(rnr_timer_code(Duration::from_secs(1)), 0);
    }

    #[test]
    fn mtu_conversions_agree() {
        for bytes in [256, 512, 1024, 2048, 4096] {
            assert_eq!(mtu_bytes(mtu_enum(bytes)), bytes);
        }
        assert_eq!(
            mtu_bytes(mtu_enum(1500)),
            2048,
            "rounds up to the next IB MTU"
        );
    }

    #[test]
    fn completion_statuses_keep_their_verbs_numbers() {
        for status in [
            WcStatus::Success,
            WcStatus::LocProtErr,
            WcStatus::WrFlushErr,
            WcStatus::RemAccessErr,
            WcStatus::RnrRetryExcErr,
        ] {
            assert_eq!(wc_status(status as u32), status);
        }
        assert_eq!(wc_status(3), WcStatus::GeneralErr);
    }

    #[test]
    fn without_rdma_the_provider_reports_a_clear_error() {
        // On machines with a device this lists it; without one it must say why, not crash.
        match IbverbsProvider.devices() {
            Ok(devices) => eprintln!("ibverbs devices: {devices:?}"),
            Err(error) => assert!(error.to_string().contains("RDMA"), "{error}"),
        }
    }
}
