//! The NIXL transport: one NIXL agent per worker, through nixl-sys (`stub-api`: `libnixl_capi.so` is
//! opened at run time, so kvpush builds without NIXL).
//!
//! Read [`NixlTransport::new`] first: it refuses to start when the real library cannot be loaded
//! (nixl-sys would otherwise abort the process at the first call), creates the agent without a
//! progress thread (the writer thread drives progress by polling) and one backend (UCX by default,
//! LIBFABRIC for EFA, parameters passed through). Memory is registered once per region. Descriptor
//! lists of fixed units (a KV region's blocks) are prepared once (`prepXferDlist`): ours after
//! registration, each peer's when its metadata is loaded, reused until the peer goes. A post whose
//! descriptors are each exactly one unit on both sides — a fragmented request, where merging found
//! nothing to merge — is made from index lists (`makeXferReq`) with no per-descriptor lookup; merged
//! runs longer than a unit are built into lists for that post (`createXferReq`), since one large
//! descriptor beats many prepared ones. Each WRITE or READ carries the notification the remote agent
//! receives after the data. The agent is created with NIXL's reader-writer thread sync, so a
//! handshake thread may load metadata while a writer thread posts.
//!
//! nixl-sys reports errors without NIXL's numeric status; [`status_of`] maps them back to NIXL's
//! codes so every error names the call, the status, the peer and the transfer. No NIXL type leaves
//! this module.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use std::sync::Arc;

use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, MemoryRegion, NixlDescriptor, NixlError, NotificationMap, OptArgs,
    RegistrationHandle, ThreadSync, XferDescList, XferDlistHandle, XferOp, XferRequest, XferStatus,
};

use super::{Desc, Fence, Notification, Op, Transport, TransportError, Units, Waker, XferId, XferState};
use crate::device::{MemKind, MemRegion};
use crate::sync::lock;

/// NIXL status codes (nixl_types.h), for errors and failure notifications.
pub mod status {
    /// The transfer is still in progress.
    pub const IN_PROG: i32 = 1;
    /// Success.
    pub const SUCCESS: i32 = 0;
    /// The request was not posted.
    pub const ERR_NOT_POSTED: i32 = -1;
    /// A parameter is invalid.
    pub const ERR_INVALID_PARAM: i32 = -2;
    /// The backend failed.
    pub const ERR_BACKEND: i32 = -3;
    /// Something (an agent, a registration, metadata) was not found.
    pub const ERR_NOT_FOUND: i32 = -4;
    /// Unknown error.
    pub const ERR_UNKNOWN: i32 = -8;
}

/// NIXL's status code for a nixl-sys error.
pub fn status_of(e: &NixlError) -> i32 {
    match e {
        NixlError::InvalidParam | NixlError::StringConversionError(_) => status::ERR_INVALID_PARAM,
        NixlError::NotFound => status::ERR_NOT_FOUND,
        NixlError::BackendError | NixlError::FailedToCreateBackend => status::ERR_BACKEND,
        NixlError::FailedToCreateXferRequest => status::ERR_NOT_POSTED,
        _ => status::ERR_UNKNOWN,
    }
}

fn status_text(status: i32) -> &'static str {
    match status {
        status::IN_PROG => "NIXL_IN_PROG",
        status::SUCCESS => "NIXL_SUCCESS",
        status::ERR_NOT_POSTED => "NIXL_ERR_NOT_POSTED",
        status::ERR_INVALID_PARAM => "NIXL_ERR_INVALID_PARAM",
        status::ERR_BACKEND => "NIXL_ERR_BACKEND",
        status::ERR_NOT_FOUND => "NIXL_ERR_NOT_FOUND",
        _ => "NIXL_ERR_UNKNOWN",
    }
}

fn call_err(call: &'static str, peer: Option<&str>, e: &NixlError, detail: String) -> TransportError {
    let status = status_of(e);
    TransportError::Call {
        call,
        peer: peer.map(str::to_owned),
        status,
        status_text: status_text(status).to_owned(),
        detail: format!("{detail}: {e}"),
    }
}

/// Configuration of a NIXL transport endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NixlConfig {
    /// The agent's name; unique among every agent it talks to (e.g. `"prefill/tp0.pp0"`).
    pub agent_name: String,
    /// The backend plugin: `"UCX"` (default) or `"LIBFABRIC"` (EFA).
    pub backend: String,
    /// Backend parameters, passed through (`key=value`), over the plugin's defaults.
    pub params: Vec<(String, String)>,
}

impl NixlConfig {
    /// A UCX endpoint named `agent_name` with the plugin's default parameters.
    pub fn new(agent_name: impl Into<String>) -> Self {
        Self { agent_name: agent_name.into(), backend: "UCX".into(), params: Vec::new() }
    }
}

/// First bytes of version 1 of a kvpush NIXL agent's metadata: then one device ordinal (u32, little
/// endian) for all of its memory, then NIXL's own metadata. Still decoded; no longer sent.
pub const MD_MAGIC: [u8; 4] = *b"KNX1";

/// First bytes of version 2 (sent now): the number of registered regions `n` (u32), then `n` times
/// `(addr: u64, len: u64, device: u32)`, all little endian, then NIXL's own metadata. The peer's
/// NIXL names the memory of a remote descriptor by the device of the region holding it, so one agent
/// may register memory of several devices (a worker's NeuronCores, or GPUs).
pub const MD_MAGIC_V2: [u8; 4] = *b"KNX2";

/// Bytes of one region entry in [`MD_MAGIC_V2`] metadata.
const MD_REGION_BYTES: usize = 20;

/// The devices of a peer's memory, as its metadata says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct PeerDevices {
    /// The device of memory outside every listed region (v1: all memory; v2: the first region's).
    default: u32,
    /// `(addr, len, device)` of each registered region (v2), sorted by address.
    regions: Vec<(u64, u64, u32)>,
}

impl PeerDevices {
    /// The device of the peer's memory at `[addr, addr + len)`.
    fn device_of(&self, addr: u64, len: u64) -> u32 {
        let i = self.regions.partition_point(|&(a, _, _)| a <= addr);
        match i.checked_sub(1).map(|i| self.regions[i]) {
            Some((a, l, dev)) if addr.checked_add(len).is_some_and(|end| end <= a.saturating_add(l)) => dev,
            _ => self.default,
        }
    }
}

/// Splits kvpush metadata (v2, v1, or NIXL's own, whose memory is taken to be on device 0) into the
/// peer's devices and NIXL's metadata.
fn decode_metadata(metadata: &[u8]) -> Result<(PeerDevices, &[u8]), TransportError> {
    let short = || TransportError::BadMetadata("kvpush NIXL metadata cut short".into());
    if let Some(rest) = metadata.strip_prefix(&MD_MAGIC_V2[..]) {
        let n = rest.get(..4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).ok_or_else(short)? as usize;
        let table = n.checked_mul(MD_REGION_BYTES).and_then(|t| rest.get(4..4 + t)).ok_or_else(short)?;
        let mut regions: Vec<(u64, u64, u32)> = table
            .chunks_exact(MD_REGION_BYTES)
            .map(|c| {
                let u64_at = |o: usize| u64::from_le_bytes(c[o..o + 8].try_into().unwrap_or([0; 8]));
                (u64_at(0), u64_at(8), u32::from_le_bytes(c[16..20].try_into().unwrap_or([0; 4])))
            })
            .collect();
        let default = regions.first().map(|r| r.2).unwrap_or(0);
        regions.sort_unstable_by_key(|r| r.0);
        return Ok((PeerDevices { default, regions }, &rest[4 + table.len()..]));
    }
    match metadata.strip_prefix(&MD_MAGIC[..]) {
        Some(rest) if rest.len() >= 4 => {
            let default = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
            Ok((PeerDevices { default, regions: Vec::new() }, &rest[4..]))
        }
        Some(_) => Err(short()),
        None => Ok((PeerDevices::default(), metadata)),
    }
}

/// [`MD_MAGIC_V2`] metadata for `regions` and NIXL's metadata `md`.
fn encode_metadata(regions: &[MemRegion], md: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + regions.len() * MD_REGION_BYTES + md.len());
    out.extend_from_slice(&MD_MAGIC_V2);
    // Fits: a transport registers far fewer than 2^32 regions (one per KV region).
    out.extend_from_slice(&(regions.len() as u32).to_le_bytes());
    for r in regions {
        out.extend_from_slice(&r.addr.to_le_bytes());
        out.extend_from_slice(&r.len.to_le_bytes());
        out.extend_from_slice(&r.dev_id.to_le_bytes());
    }
    out.extend_from_slice(md);
    out
}

/// Backend parameters from the environment, added after the configured ones (so they win):
/// `KVPUSH_NIXL_PARAMS="key=value,key=value"` (UCX, for instance, takes `num_threads`).
pub const PARAMS_ENV: &str = "KVPUSH_NIXL_PARAMS";

fn env_params() -> Result<Vec<(String, String)>, TransportError> {
    let Ok(v) = std::env::var(PARAMS_ENV) else { return Ok(Vec::new()) };
    parse_params(&v).map_err(|reason| TransportError::Unavailable { transport: "NIXL", reason })
}

/// Parses `key=value,key=value` (empty items are skipped).
pub fn parse_params(v: &str) -> Result<Vec<(String, String)>, String> {
    v.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.trim().to_owned())),
            _ => Err(format!("{PARAMS_ENV}: {p:?} is not key=value")),
        })
        .collect()
}

/// Whether the real NIXL library can be loaded in this process (never aborts).
pub fn available() -> bool {
    !nixl_sys::is_stub()
}

/// Memory as nixl-sys describes it for registration.
#[derive(Debug)]
struct RegionDesc(MemRegion);

impl MemoryRegion for RegionDesc {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.0.addr as usize as *const u8
    }
    fn size(&self) -> usize {
        self.0.len as usize
    }
}

impl NixlDescriptor for RegionDesc {
    fn mem_type(&self) -> MemType {
        mem_type(self.0.kind)
    }
    fn device_id(&self) -> u64 {
        u64::from(self.0.dev_id)
    }
}

fn mem_type(kind: MemKind) -> MemType {
    match kind {
        MemKind::Dram => MemType::Dram,
        MemKind::Vram => MemType::Vram,
    }
}

/// Most units one prepared list holds (NIXL indexes them with `int`; a list costs tens of bytes per
/// unit inside NIXL). Larger layouts are posted from lists built per post.
pub const MAX_PREPARED_UNITS: u64 = 1 << 22;

/// A NIXL prepared descriptor list.
struct DlistHandle(XferDlistHandle);

// SAFETY: the handle is an opaque pointer to a NIXL object that only NIXL calls touch; the agent is
// created with `ThreadSync::Rw`, under which NIXL serialises its own state, and kvpush never uses a
// handle from two threads at once without holding `NixlTransport`'s locks (posts read it, only
// `prepare`/`drop_peer` replace it). It is released before the agent (see `Drop for NixlTransport`).
unsafe impl Send for DlistHandle {}
// SAFETY: as for `Send`: shared references only pass the handle to NIXL calls that take it as input.
unsafe impl Sync for DlistHandle {}

/// A prepared list of units and how to find a unit's index in it.
struct Prepared {
    handle: DlistHandle,
    /// Each span with the index of its first unit, sorted by base.
    spans: Vec<(Units, i32)>,
}

impl Prepared {
    /// The index of the unit that is exactly `[addr, addr + len)`, if there is one.
    fn index(&self, addr: u64, len: u64) -> Option<i32> {
        let i = self.spans.partition_point(|(u, _)| u.base <= addr).checked_sub(1)?;
        let (u, first) = self.spans[i];
        let off = addr - u.base;
        if len != u.unit || !off.is_multiple_of(u.unit) || off / u.unit >= u.count {
            return None;
        }
        // Fits: the total unit count is at most MAX_PREPARED_UNITS < i32::MAX.
        Some(first + (off / u.unit) as i32)
    }
}

/// How transfers were posted (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PostCounts {
    /// Posted from prepared lists by index.
    pub prepared: u64,
    /// Posted from descriptor lists built for the post.
    pub built: u64,
}

/// A posted transfer.
struct Posted {
    req: XferRequest,
    peer: String,
    /// The prepared lists it was made from, kept alive until it finishes.
    _lists: Option<(Arc<Prepared>, Arc<Prepared>)>,
}

/// A NIXL agent with one backend. See the module docs.
pub struct NixlTransport {
    name: String,
    /// Our prepared list, then each peer's (by agent name). Released before the agent (`Drop`).
    prepared_local: Mutex<Option<Arc<Prepared>>>,
    prepared_remote: Mutex<HashMap<String, Arc<Prepared>>>,
    posted_prepared: AtomicU64,
    posted_built: AtomicU64,
    agent: Agent,
    backend: Backend,
    regs: Mutex<Vec<(MemRegion, RegistrationHandle)>>,
    xfers: Mutex<HashMap<u64, Posted>>,
    next: AtomicU64,
    peers: Mutex<Vec<String>>,
    /// The devices of each peer's memory, as its metadata says (name its memory in remote
    /// descriptors).
    peer_dev: Mutex<HashMap<String, PeerDevices>>,
}

impl fmt::Debug for NixlTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NixlTransport").field("name", &self.name).finish_non_exhaustive()
    }
}

impl NixlTransport {
    /// Creates the agent and its backend. A missing `libnixl_capi.so` (or plugin) is an error naming
    /// what to fix, never an abort.
    pub fn new(config: &NixlConfig) -> Result<Self, TransportError> {
        if !available() {
            return Err(TransportError::Unavailable {
                transport: "NIXL",
                reason: "libnixl_capi.so cannot be loaded: run scripts/nixl.sh (or install NIXL) and put its \
                         library directory on LD_LIBRARY_PATH; `kvpush doctor` shows what was found"
                    .into(),
            });
        }
        // No progress thread: the writer thread that owns this agent polls, and sleeps when idle.
        // Reader-writer sync: handshakes (metadata) and writer threads (posts) share the agent.
        let cfg = AgentConfig { enable_prog_thread: false, thread_sync: ThreadSync::Rw, ..AgentConfig::default() };
        let agent = Agent::new_configured(&config.agent_name, &cfg)
            .map_err(|e| call_err("createAgent", None, &e, format!("agent {}", config.agent_name)))?;
        let (_, mut params) = agent.get_plugin_params(&config.backend).map_err(|e| {
            call_err(
                "getPluginParams",
                None,
                &e,
                format!(
                    "backend plugin {} (is NIXL_PLUGIN_DIR set to the plugin directory? `kvpush doctor` lists the \
                     plugins found)",
                    config.backend
                ),
            )
        })?;
        for (k, v) in config.params.iter().cloned().chain(env_params()?) {
            params.set(&k, &v).map_err(|e| call_err("setParam", None, &e, format!("{k}={v}")))?;
        }
        let backend = agent
            .create_backend(&config.backend, &params)
            .map_err(|e| call_err("createBackend", None, &e, format!("backend {}", config.backend)))?;
        Ok(Self {
            name: config.agent_name.clone(),
            prepared_local: Mutex::new(None),
            prepared_remote: Mutex::new(HashMap::new()),
            posted_prepared: AtomicU64::new(0),
            posted_built: AtomicU64::new(0),
            agent,
            backend,
            regs: Mutex::new(Vec::new()),
            xfers: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            peers: Mutex::new(Vec::new()),
            peer_dev: Mutex::new(HashMap::new()),
        })
    }

    /// The devices of a peer's memory, as its metadata named them (all on device 0 if unknown).
    fn peer_devices(&self, peer: &str) -> PeerDevices {
        lock(&self.peer_dev).get(peer).cloned().unwrap_or_default()
    }

    /// Plugins the NIXL library finds (for `kvpush doctor`).
    pub fn plugins(&self) -> Vec<String> {
        self.agent
            .get_available_plugins()
            .map(|l| l.iter().filter_map(|s| s.ok()).map(str::to_owned).collect())
            .unwrap_or_default()
    }

    /// How many transfers were posted from prepared lists and from lists built per post.
    pub fn post_counts(&self) -> PostCounts {
        PostCounts {
            prepared: self.posted_prepared.load(Ordering::Relaxed),
            built: self.posted_built.load(Ordering::Relaxed),
        }
    }

    /// Our prepared list and `peer`'s, when both exist.
    fn prepared_pair(&self, peer: &str) -> Option<(Arc<Prepared>, Arc<Prepared>)> {
        let local = lock(&self.prepared_local).clone()?;
        let remote = lock(&self.prepared_remote).get(peer).cloned()?;
        Some((local, remote))
    }

    /// Index lists for `descs` when each is exactly one unit of `lists` on both sides.
    fn indices(lists: &(Arc<Prepared>, Arc<Prepared>), descs: &[Desc]) -> Option<(Vec<i32>, Vec<i32>)> {
        let (mut li, mut ri) = (Vec::with_capacity(descs.len()), Vec::with_capacity(descs.len()));
        for d in descs {
            li.push(lists.0.index(d.local, d.len)?);
            ri.push(lists.1.index(d.remote, d.len)?);
        }
        Some((li, ri))
    }

    /// The registered region holding `[addr, addr + len)`, for its memory type and device.
    fn local_region(&self, addr: u64, len: u64) -> Option<MemRegion> {
        lock(&self.regs).iter().map(|(r, _)| *r).find(|r| r.contains(addr, len))
    }

    fn opt_args(&self, notif: Option<&[u8]>) -> Result<OptArgs, NixlError> {
        let mut args = OptArgs::new()?;
        args.add_backend(&self.backend)?;
        if let Some(msg) = notif {
            args.set_notification_message(msg)?;
            // The message alone is not sent: the flag makes NIXL deliver it after the data.
            args.set_has_notification(true)?;
        }
        Ok(args)
    }
}

/// Traces what one post spent making its request (`started` to `made`: lists built or indexed,
/// `createXferReq` or `makeXferReq`) and in `postXferReq` (`made` to now).
fn trace_post(peer: &str, descs: usize, prepared: bool, started: std::time::Instant, made: std::time::Instant) {
    let posted = std::time::Instant::now();
    tracing::trace!(
        %peer,
        descs,
        prepared,
        make_us = (made - started).as_secs_f64() * 1e6,
        post_us = (posted - made).as_secs_f64() * 1e6,
        "NIXL post"
    );
}

impl Transport for NixlTransport {
    fn name(&self) -> &str {
        &self.name
    }

    unsafe fn register(&self, region: &MemRegion) -> Result<(), TransportError> {
        let handle = self.agent.register_memory(&RegionDesc(*region), None).map_err(|e| {
            call_err("registerMem", None, &e, format!("{:#x}+{} ({:?})", region.addr, region.len, region.kind))
        })?;
        lock(&self.regs).push((*region, handle));
        Ok(())
    }

    fn deregister(&self, region: &MemRegion) -> Result<(), TransportError> {
        let mut regs = lock(&self.regs);
        let i = regs.iter().position(|(r, _)| r == region).ok_or_else(|| TransportError::Call {
            call: "deregisterMem",
            peer: None,
            status: status::ERR_NOT_FOUND,
            status_text: status_text(status::ERR_NOT_FOUND).into(),
            detail: format!("{:#x}+{} is not registered", region.addr, region.len),
        })?;
        // Dropping the handle deregisters the memory.
        let (_, mut handle) = regs.swap_remove(i);
        handle
            .deregister()
            .map_err(|e| call_err("deregisterMem", None, &e, format!("{:#x}+{}", region.addr, region.len)))
    }

    /// [`MD_MAGIC_V2`]: every registered region with its device, then NIXL's metadata.
    fn local_metadata(&self) -> Result<Vec<u8>, TransportError> {
        let regions: Vec<MemRegion> = lock(&self.regs).iter().map(|(r, _)| *r).collect();
        let md =
            self.agent.get_local_md().map_err(|e| call_err("getLocalMD", None, &e, format!("agent {}", self.name)))?;
        Ok(encode_metadata(&regions, &md))
    }

    /// Loads metadata from [`Transport::local_metadata`] (v2 or v1), or NIXL's own, whose peer is
    /// taken to be on device 0.
    fn load_remote(&self, metadata: &[u8]) -> Result<String, TransportError> {
        let (dev, metadata) = decode_metadata(metadata)?;
        let name = self
            .agent
            .load_remote_md(metadata)
            .map_err(|e| call_err("loadRemoteMD", None, &e, format!("{} bytes of metadata", metadata.len())))?;
        // A peer that restarted has new memory: its old prepared list must not be used.
        lock(&self.prepared_remote).remove(&name);
        lock(&self.peer_dev).insert(name.clone(), dev);
        let mut peers = lock(&self.peers);
        if !peers.contains(&name) {
            peers.push(name.clone());
        }
        Ok(name)
    }

    /// Unconfirmed: NIXL has no call that cuts one peer's access to our registered memory.
    /// `invalidateRemoteMD` (`nixlAgentData::invalidateRemoteMD`, src/core/nixl_agent.cpp in
    /// ai-dynamo/nixl) forgets the peer's sections and calls the UCX backend's `disconnect`
    /// (`nixlUcxEngine::disconnect`, src/plugins/ucx/ucx_backend.cpp), which only erases *our*
    /// connection (`remoteConnMap.erase`; `nixlUcxEp::closeImpl` in src/plugins/ucx/ucx_utils.cpp
    /// then closes our endpoint without waiting). The peer keeps its own endpoint and the remote keys
    /// it unpacked from our metadata; over DC, shared memory or CUDA IPC it needs no endpoint of ours
    /// to write. Only `ucp_mem_unmap` (`nixlUcxContext::memDereg`, reached through
    /// `nixlUcxEngine::deregisterMem`) kills the keys, for every peer at once. docs/reliability.md.
    fn revoke_peer(&self, peer: &str) -> Fence {
        let _ = peer;
        Fence::Unconfirmed
    }

    fn drop_peer(&self, peer: &str) {
        lock(&self.peers).retain(|p| p != peer);
        lock(&self.peer_dev).remove(peer);
        lock(&self.prepared_remote).remove(peer);
        if let Err(e) = self.agent.invalidate_remote_md(peer) {
            tracing::debug!(agent = %self.name, %peer, error = %e, "invalidateRemoteMD failed");
        }
    }

    fn prepare(&self, peer: Option<&str>, units: &[Units]) -> Result<(), TransportError> {
        let who = peer.unwrap_or("local memory");
        let total: u64 = units.iter().map(|u| u.count).sum();
        if total == 0 || total > MAX_PREPARED_UNITS {
            tracing::debug!(agent = %self.name, peer = %who, total, "not preparing a descriptor list of this size");
            return Ok(());
        }
        let invalid = |detail: String| TransportError::Call {
            call: "prepXferDlist",
            peer: peer.map(str::to_owned),
            status: status::ERR_INVALID_PARAM,
            status_text: status_text(status::ERR_INVALID_PARAM).into(),
            detail,
        };
        let mut spans: Vec<Units> = units.iter().copied().filter(|u| u.count > 0).collect();
        spans.sort_by_key(|u| u.base);
        for w in spans.windows(2) {
            if w[0].base + w[0].unit * w[0].count > w[1].base {
                return Err(invalid(format!("unit spans at {:#x} and {:#x} overlap", w[0].base, w[1].base)));
            }
        }
        // Memory kind and device: our registered regions say; a peer's memory is of the same kind
        // (as for posts, see `post`), on the device its metadata named for the region holding it.
        let (kind, dev_of) = {
            let regs = lock(&self.regs);
            let first = regs.first().map(|(r, _)| *r).ok_or_else(|| invalid("no memory registered".into()))?;
            if peer.is_none() {
                for (i, u) in spans.iter().enumerate() {
                    let len = u.unit * u.count;
                    if !regs.iter().any(|(r, _)| r.contains(u.base, len) && r.kind == first.kind) {
                        return Err(TransportError::NotRegistered { index: i, addr: u.base, len, side: "local" });
                    }
                }
            }
            let dev_of: Box<dyn Fn(u64, u64) -> u32> = match peer {
                Some(p) => {
                    let devs = self.peer_devices(p);
                    Box::new(move |addr, len| devs.device_of(addr, len))
                }
                None => {
                    let ours: Vec<MemRegion> = regs.iter().map(|(r, _)| *r).collect();
                    Box::new(move |addr, len| {
                        ours.iter().find(|r| r.contains(addr, len)).map_or(first.dev_id, |r| r.dev_id)
                    })
                }
            };
            (first.kind, dev_of)
        };
        let err = |call, e: NixlError| call_err(call, peer, &e, format!("{total} units of {who}"));
        let mut list = XferDescList::new(mem_type(kind)).map_err(|e| err("createXferDList", e))?;
        let mut indexed = Vec::with_capacity(spans.len());
        let mut next = 0i32;
        for u in spans {
            let dev_id = u64::from(dev_of(u.base, u.unit * u.count));
            for i in 0..u.count {
                list.add_desc((u.base + i * u.unit) as usize, u.unit as usize, dev_id);
            }
            indexed.push((u, next));
            // At most MAX_PREPARED_UNITS in all.
            next += u.count as i32;
        }
        let args = self.opt_args(None).map_err(|e| err("optArgs", e))?;
        // NIXL names our own memory with the empty agent name (NIXL_INIT_AGENT).
        let handle = self
            .agent
            .prepare_xfer_dlist(peer.unwrap_or(""), &list, Some(&args))
            .map_err(|e| err("prepXferDlist", e))?;
        let prepared = Arc::new(Prepared { handle: DlistHandle(handle), spans: indexed });
        match peer {
            None => *lock(&self.prepared_local) = Some(prepared),
            Some(p) => {
                lock(&self.prepared_remote).insert(p.to_owned(), prepared);
            }
        }
        tracing::debug!(agent = %self.name, peer = %who, total, "descriptor list prepared");
        Ok(())
    }

    fn post(&self, op: Op, peer: &str, descs: &[Desc], notif: Option<&[u8]>) -> Result<XferId, TransportError> {
        if !lock(&self.peers).iter().any(|p| p == peer) {
            return Err(TransportError::UnknownPeer(peer.to_owned()));
        }
        let xop = match op {
            Op::Write => XferOp::Write,
            Op::Read => XferOp::Read,
        };
        // What NIXL's calls cost, apart from the rest of a post (docs/benchmarks.md, "The fixed cost
        // of one NIXL post"): traced per post.
        let started = std::time::Instant::now();
        if let Some(lists) = self.prepared_pair(peer) {
            if let Some((li, ri)) = Self::indices(&lists, descs) {
                let args =
                    self.opt_args(notif).map_err(|e| call_err("optArgs", Some(peer), &e, "notification".into()))?;
                let what = || format!("{op:?} of {} prepared descriptors", descs.len());
                let req = self
                    .agent
                    .make_xfer_req(xop, &lists.0.handle.0, &li, &lists.1.handle.0, &ri, Some(&args))
                    .map_err(|e| call_err("makeXferReq", Some(peer), &e, what()))?;
                let made = std::time::Instant::now();
                self.agent
                    .post_xfer_req(&req, Some(&args))
                    .map_err(|e| call_err("postXferReq", Some(peer), &e, what()))?;
                trace_post(peer, descs.len(), true, started, made);
                self.posted_prepared.fetch_add(1, Ordering::Relaxed);
                let id = self.next.fetch_add(1, Ordering::Relaxed);
                lock(&self.xfers).insert(id, Posted { req, peer: peer.to_owned(), _lists: Some(lists) });
                return Ok(XferId(id));
            }
        }
        let first = descs.first().ok_or_else(|| TransportError::Call {
            call: "createXferReq",
            peer: Some(peer.to_owned()),
            status: status::ERR_INVALID_PARAM,
            status_text: status_text(status::ERR_INVALID_PARAM).into(),
            detail: "no descriptors".into(),
        })?;
        let region = self.local_region(first.local, first.len).ok_or(TransportError::NotRegistered {
            index: 0,
            addr: first.local,
            len: first.len,
            side: "local",
        })?;
        let mt = mem_type(region.kind);
        let peer_devs = self.peer_devices(peer);
        let build = |e: NixlError| call_err("createXferDList", Some(peer), &e, format!("{} descriptors", descs.len()));
        let mut local = XferDescList::new(mt).map_err(build)?;
        let mut remote = XferDescList::new(mt).map_err(build)?;
        {
            let regs = lock(&self.regs);
            for (index, d) in descs.iter().enumerate() {
                let r = regs
                    .iter()
                    .map(|(r, _)| r)
                    .find(|r| r.contains(d.local, d.len))
                    .ok_or(TransportError::NotRegistered { index, addr: d.local, len: d.len, side: "local" })?;
                local.add_desc(d.local as usize, d.len as usize, u64::from(r.dev_id));
                // The peer's memory is of the same kind, on the device its metadata named for it.
                remote.add_desc(d.remote as usize, d.len as usize, u64::from(peer_devs.device_of(d.remote, d.len)));
            }
        }
        let args = self.opt_args(notif).map_err(|e| call_err("optArgs", Some(peer), &e, "notification".into()))?;
        let req = self
            .agent
            .create_xfer_req(xop, &local, &remote, peer, Some(&args))
            .map_err(|e| call_err("createXferReq", Some(peer), &e, format!("{op:?} of {} descriptors", descs.len())))?;
        let made = std::time::Instant::now();
        self.agent
            .post_xfer_req(&req, Some(&args))
            .map_err(|e| call_err("postXferReq", Some(peer), &e, format!("{op:?} of {} descriptors", descs.len())))?;
        trace_post(peer, descs.len(), false, started, made);
        self.posted_built.fetch_add(1, Ordering::Relaxed);
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        lock(&self.xfers).insert(id, Posted { req, peer: peer.to_owned(), _lists: None });
        Ok(XferId(id))
    }

    fn poll(&self, id: XferId) -> Result<XferState, TransportError> {
        let mut xfers = lock(&self.xfers);
        let p = xfers.get(&id.0).ok_or(TransportError::UnknownXfer(id))?;
        match self.agent.get_xfer_status(&p.req) {
            Ok(XferStatus::InProgress) => Ok(XferState::Pending),
            Ok(XferStatus::Success) => {
                xfers.remove(&id.0);
                Ok(XferState::Done)
            }
            Err(e) => {
                let peer = xfers.remove(&id.0).map(|p| p.peer).unwrap_or_default();
                Err(TransportError::Failed {
                    id,
                    peer,
                    status: status_of(&e),
                    detail: format!("getXferStatus: {} ({e})", status_text(status_of(&e))),
                })
            }
        }
    }

    fn take_notifications(&self, out: &mut Vec<Notification>) -> Result<usize, TransportError> {
        let err = |e: NixlError| call_err("getNotifs", None, &e, format!("agent {}", self.name));
        let mut map = NotificationMap::new().map_err(err)?;
        self.agent.get_notifications(&mut map, None).map_err(err)?;
        let mut n = 0;
        let agents: Vec<String> = map.agents().filter_map(|a| a.ok()).map(str::to_owned).collect();
        for agent in agents {
            let count = map.get_notifications_size(&agent).map_err(err)?;
            for i in 0..count {
                let msg = map.get_notification_bytes(&agent, i).map_err(err)?;
                out.push(Notification { from: agent.clone(), msg });
                n += 1;
            }
        }
        Ok(n)
    }

    fn send_notification(&self, peer: &str, msg: &[u8]) -> Result<(), TransportError> {
        self.agent
            .send_notification(peer, msg, Some(&self.backend))
            .map_err(|e| call_err("genNotif", Some(peer), &e, format!("{} bytes", msg.len())))
    }

    fn set_waker(&self, _waker: Waker) {
        // NIXL has no completion callback: nothing to keep. `needs_polling` makes the writer poll.
    }

    fn needs_polling(&self) -> bool {
        true
    }

    /// UCX's `cma` path (host memory between processes) does one `process_vm_writev` per
    /// descriptor, 2–3 µs each (docs/benchmarks.md, "NIXL bandwidth against the single-descriptor
    /// ceiling").
    fn costly_host_descriptors(&self) -> bool {
        true
    }
}

impl Drop for NixlTransport {
    fn drop(&mut self) {
        // Prepared lists hold the agent's raw handle, not a reference to it: release them (and the
        // requests made from them) while the agent is alive.
        lock(&self.xfers).clear();
        lock(&self.prepared_remote).clear();
        *lock(&self.prepared_local) = None;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn backend_params_parse() {
        assert_eq!(
            super::parse_params(" num_threads=2, ,split_batch_size = 64").unwrap(),
            vec![("num_threads".into(), "2".into()), ("split_batch_size".into(), "64".into())]
        );
        assert!(super::parse_params("num_threads").unwrap_err().contains("not key=value"));
        assert!(super::parse_params("=3").is_err());
    }

    /// Metadata bytes written by hand from the layout `MD_MAGIC_V2` documents, not by the encoder.
    #[test]
    fn metadata_carries_a_device_per_region_and_still_reads_v1() {
        use super::{decode_metadata, encode_metadata, PeerDevices};
        use crate::device::{MemKind, MemRegion};
        #[rustfmt::skip]
        let v2: Vec<u8> = [
            &b"KNX2"[..], &[2, 0, 0, 0],
            &[0x00, 0x10, 0, 0, 0, 0, 0, 0], &[0x00, 0x01, 0, 0, 0, 0, 0, 0], &[3, 0, 0, 0],
            &[0x00, 0x00, 0, 0, 1, 0, 0, 0], &[0x00, 0x10, 0, 0, 0, 0, 0, 0], &[1, 0, 0, 0],
            b"nixl",
        ].concat();
        let regions = [
            MemRegion { addr: 0x1000, len: 0x100, kind: MemKind::Vram, dev_id: 3 },
            MemRegion { addr: 0x1_0000_0000, len: 0x1000, kind: MemKind::Vram, dev_id: 1 },
        ];
        assert_eq!(encode_metadata(&regions, b"nixl"), v2);
        let (devs, md) = decode_metadata(&v2).unwrap();
        assert_eq!(md, b"nixl");
        assert_eq!(devs.device_of(0x1000, 0x100), 3);
        assert_eq!(devs.device_of(0x1_0000_0800, 0x800), 1);
        assert_eq!(devs.device_of(0x1_0000_0800, 0x801), 3, "outside every region: the first region's device");
        assert_eq!(devs.device_of(0x10ff, 2), 3);
        // Version 1: one device for everything; NIXL's own metadata: device 0.
        let v1 = [&b"KNX1"[..], &[7, 0, 0, 0], b"md"].concat();
        let (devs, md) = decode_metadata(&v1).unwrap();
        assert_eq!((devs.device_of(0x1000, 1), md), (7, &b"md"[..]));
        assert_eq!(decode_metadata(b"raw nixl").unwrap(), (PeerDevices::default(), &b"raw nixl"[..]));
        // Cut short anywhere in the header or the table: an error, never a guess.
        for cut in [5, 8, 27, 47] {
            let e = decode_metadata(&v2[..cut]).unwrap_err();
            assert!(e.to_string().contains("cut short"), "{cut}: {e}");
        }
        assert!(decode_metadata(b"KNX1\x01").is_err());
        let huge = [&b"KNX2"[..], &u32::MAX.to_le_bytes()].concat();
        assert!(decode_metadata(&huge).is_err(), "a count beyond the bytes present is refused");
    }
}
