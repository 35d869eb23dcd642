//! Transports: what moves bytes between a producer's and a consumer's memory.
//!
//! Read [`Transport`] first. It is shaped after NIXL's agent API: register memory once, exchange
//! opaque metadata, post a WRITE or READ of many descriptors with a notification for the remote side,
//! poll its status, fetch notifications, send a notification on its own. Completion is asynchronous:
//! [`Transport::post`] returns at once and the bytes land later.
//!
//! Implementations: [`loopback`] (in-process, behaves like NIXL including asynchronous completion and
//! injectable faults) and, when built in, NIXL. A transport is owned by the writer thread of its
//! worker; implementations must still be `Send + Sync` because handshakes run on another thread.
//! Vendor types and status codes stay inside each implementation; errors carry the call, the peer and
//! the transport's status.

use std::fmt;
use std::sync::Arc;

use crate::device::MemRegion;
use crate::proto::plan::Grid;

pub mod bounce;
pub mod loopback;
pub mod nixl;
pub mod staged;
pub mod trust;

/// Direction of a transfer, seen from the side that posts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// Local memory → remote memory (push).
    Write,
    /// Remote memory → local memory (pull).
    Read,
}

/// One descriptor pair of a transfer: `len` bytes at `local` and at `remote`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Desc {
    /// Address in this side's registered memory.
    pub local: u64,
    /// Address in the peer's registered memory.
    pub remote: u64,
    /// Bytes.
    pub len: u64,
}

/// `count` equal units of `unit` bytes from `base`, in registered memory: typically the blocks of one
/// KV region. Transports that can index fixed descriptors prepare lists of these once
/// ([`Transport::prepare`]) and post transfers as lists of indices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Units {
    /// Address of unit 0.
    pub base: u64,
    /// Bytes of each unit (and the distance between consecutive units).
    pub unit: u64,
    /// Number of units.
    pub count: u64,
}

/// Handle of a posted transfer, valid until [`Transport::poll`] reports it finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct XferId(pub u64);

/// State of a posted transfer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum XferState {
    /// Still moving bytes.
    Pending,
    /// Every byte landed and the notification (if any) was delivered; the handle is released.
    Done,
}

/// A notification received from a peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// The sending peer's name.
    pub from: String,
    /// The message bytes (a `proto` frame).
    pub msg: Vec<u8>,
}

/// Called by a transport when a completion or notification is ready, so a waiting writer thread
/// wakes without polling. Transports that cannot signal return `true` from
/// [`Transport::needs_polling`] instead.
pub type Waker = Arc<dyn Fn() + Send + Sync>;

/// What went wrong in a transport call.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The transport library is missing or cannot start.
    #[error("{transport} is not available: {reason}")]
    Unavailable {
        /// Transport name.
        transport: &'static str,
        /// Why.
        reason: String,
    },
    /// A call failed with the transport's own status.
    #[error("{call} failed{} with status {status} ({status_text}): {detail}", peer.as_ref().map(|p| format!(" for peer {p}")).unwrap_or_default())]
    Call {
        /// The transport call, e.g. `"postXferReq"`.
        call: &'static str,
        /// The peer, when the call concerns one.
        peer: Option<String>,
        /// The transport's status code.
        status: i32,
        /// The status as text.
        status_text: String,
        /// More context (which transfer, which descriptor).
        detail: String,
    },
    /// The peer is not known (no metadata loaded, or dropped).
    #[error("unknown peer {0}")]
    UnknownPeer(String),
    /// A descriptor lies outside registered memory.
    #[error("descriptor {index} ({addr:#x}+{len}) is outside the {side} registered memory")]
    NotRegistered {
        /// Index of the descriptor.
        index: usize,
        /// Its address.
        addr: u64,
        /// Its length.
        len: u64,
        /// `"local"` or `"remote"`.
        side: &'static str,
    },
    /// The transfer handle is not (or no longer) known.
    #[error("unknown transfer {0:?}")]
    UnknownXfer(XferId),
    /// The transfer failed after it was posted; some bytes may have landed.
    #[error("transfer {id:?} to {peer} failed with status {status}: {detail}")]
    Failed {
        /// The transfer.
        id: XferId,
        /// The peer.
        peer: String,
        /// The transport's status code.
        status: i32,
        /// More context.
        detail: String,
    },
    /// Metadata could not be parsed.
    #[error("bad metadata: {0}")]
    BadMetadata(String),
}

impl TransportError {
    /// The transport's status code where there is one (for failure notifications).
    pub fn status(&self) -> i32 {
        match self {
            TransportError::Call { status, .. } | TransportError::Failed { status, .. } => *status,
            _ => -1,
        }
    }
}

/// What [`Transport::revoke_peer`] can promise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fence {
    /// Nothing the peer posted before the call (nor after it, until the peer is loaded again with
    /// [`Transport::load_remote`]) writes into or reads from this endpoint's memory any more; a copy
    /// that was running when the call began has ended by the time it returns.
    Confirmed,
    /// The transport cannot say: the peer may still reach this endpoint's memory (e.g. RDMA with
    /// keys it already holds). Blocks it could touch must stay quarantined.
    Unconfirmed,
}

/// A NIXL-like transport endpoint (one agent). See the module docs.
pub trait Transport: Send + Sync + fmt::Debug {
    /// This endpoint's name (what peers see as `Notification::from`).
    fn name(&self) -> &str;
    /// Registers memory for transfers. Called once per region, before any transfer uses it.
    ///
    /// # Safety
    ///
    /// From this call until [`Transport::deregister`] returns (or the transport is dropped), peers may
    /// write into and read from the region at any time, without Rust's knowledge. The caller
    /// guarantees that
    ///
    /// 1. `region` describes memory of its kind (host memory mapped in this process, or memory of
    ///    the named accelerator) valid for reads and writes over its whole length for that time;
    /// 2. nothing else accesses the bytes a transfer touches while that transfer is in flight (the
    ///    protocol's block ownership: a producer's blocks are held until released, a consumer's
    ///    registered blocks are not read until received).
    unsafe fn register(&self, region: &MemRegion) -> Result<(), TransportError>;
    /// Removes a registration (before the memory is freed).
    fn deregister(&self, region: &MemRegion) -> Result<(), TransportError>;
    /// Opaque metadata a peer needs to reach this endpoint (sent in the handshake).
    fn local_metadata(&self) -> Result<Vec<u8>, TransportError>;
    /// Loads a peer's metadata; returns the peer's name.
    fn load_remote(&self, metadata: &[u8]) -> Result<String, TransportError>;
    /// Forgets a peer (it went away or restarted).
    fn drop_peer(&self, peer: &str);
    /// Cuts the peer's access to this endpoint's memory, for transfers the peer initiates (its
    /// WRITEs into us, its READs from us); see [`Fence`]. Called when the peer is lost, before any
    /// block it could touch goes back to its owner. The default cannot confirm anything.
    fn revoke_peer(&self, peer: &str) -> Fence {
        let _ = peer;
        Fence::Unconfirmed
    }
    /// Prepares descriptor lists of `units` once, for this endpoint's memory (`peer` is `None`, after
    /// [`Transport::register`]) or for a peer's (after [`Transport::load_remote`]; dropped with the
    /// peer). A later [`Transport::post`] whose descriptors are each exactly one unit on both sides
    /// may then be posted by index instead of building descriptor lists. Transports without such
    /// lists do nothing (the default).
    fn prepare(&self, peer: Option<&str>, units: &[Units]) -> Result<(), TransportError> {
        let _ = (peer, units);
        Ok(())
    }
    /// Posts a transfer of `descs` with `peer`; `notif`, if any, is delivered to the peer after every
    /// byte landed. Returns at once.
    fn post(&self, op: Op, peer: &str, descs: &[Desc], notif: Option<&[u8]>) -> Result<XferId, TransportError>;
    /// Posts a WRITE to `peer` of a plan in grid form (sources local, destinations the peer's), as
    /// [`Transport::post`] would post its expansion. `None`: this transport does not take grids, or
    /// not this one; the caller posts the expanded descriptors instead (the default). Transports
    /// that run a grid without expanding it (staging) save the per-descriptor work of a fragmented
    /// request.
    fn post_grid(&self, peer: &str, grid: &Grid, notif: Option<&[u8]>) -> Option<Result<XferId, TransportError>> {
        let _ = (peer, grid, notif);
        None
    }
    /// Asks the transport to end a posted transfer early: its consumer gave up on it. The handle
    /// still reports its end through [`Transport::poll`] (an error where it was cut short), and
    /// nothing of it is in flight by then. Transports that cannot cut a transfer short let it run
    /// (the default).
    fn cancel(&self, id: XferId) {
        let _ = id;
    }
    /// The consumer stopped waiting for a request (its drain timeout passed): a transport that
    /// receives transfers on the engine's behalf (staging) stops granting and scattering those
    /// whose notification `completes` it (`(sender, notification)`), and tells their senders.
    /// Returns how many it stopped (the default: none).
    fn stop_incoming(&self, completes: &dyn Fn(&str, &[u8]) -> bool) -> usize {
        let _ = completes;
        0
    }
    /// The state of a posted transfer. `Done` and errors release the handle.
    fn poll(&self, id: XferId) -> Result<XferState, TransportError>;
    /// Moves received notifications into `out`; returns how many.
    fn take_notifications(&self, out: &mut Vec<Notification>) -> Result<usize, TransportError>;
    /// Sends a notification to `peer` without a transfer.
    fn send_notification(&self, peer: &str, msg: &[u8]) -> Result<(), TransportError>;
    /// Installs the function called when a completion or notification is ready.
    fn set_waker(&self, waker: Waker);
    /// Whether progress needs [`Transport::poll`] calls (no waker support, or progress is driven
    /// by polling). The writer then polls with backoff while transfers are in flight.
    fn needs_polling(&self) -> bool;
    /// Whether the transport has work of its own in flight that advances only in
    /// [`Transport::poll`] and [`Transport::take_notifications`] calls (staged pieces being gathered,
    /// written or scattered): the writer then polls as it does for its own transfers.
    fn busy(&self) -> bool {
        false
    }
    /// Whether each descriptor of a host-memory transfer costs this transport a system call or
    /// more, so that gathering many small descriptors into one staged WRITE can beat posting them
    /// (NIXL over UCX's `cma`: one `process_vm_writev` per descriptor, 2–3 µs). The engine's `auto`
    /// staging then measures both paths on host memory too ([`crate::proto::path`]). The default,
    /// `false`, suits transports that copy in-process (loopback), where staging only adds copies.
    fn costly_host_descriptors(&self) -> bool {
        false
    }
}
