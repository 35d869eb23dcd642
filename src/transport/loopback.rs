//! The in-process transport: NIXL's behaviour without NIXL, for tests, the simulator and the demo.
//!
//! Read [`Fabric`] first: it is the shared medium, and [`Fabric::endpoint`] makes one
//! [`LoopbackTransport`] (one "agent") per name. Endpoints reach each other only after
//! [`Transport::load_remote`] of the peer's [`Transport::local_metadata`], exactly as NIXL agents do
//! after the handshake.
//!
//! Completion is asynchronous, as with NIXL: [`Transport::post`] validates every descriptor against the
//! registered memory of both sides, queues the transfer and returns at once. One worker thread per
//! fabric (spawned on first use, stopped and joined when the last handle to the fabric — a [`Fabric`]
//! or an endpoint — is dropped) copies the bytes, delivers the notification to the peer, marks the
//! transfer done and calls the wakers. The worker blocks on a channel or on the next delayed job's
//! deadline; it never spins.
//!
//! Ordering: jobs (transfers and bare notifications) of one (initiator, target) pair run in the order
//! they were posted, so a notification never overtakes the data posted before it on the same pair.
//! Different pairs are independent: a delayed job holds back only the jobs queued behind it on its
//! own pair.
//!
//! Faults ([`Fault`], [`FaultRates`]) are injected per endpoint; engine tests use them to prove that
//! nothing hangs or leaks when a post fails, a notification is lost, a transfer fails half way or
//! completes late.
//!
//! Memory: host memory ([`MemKind::Dram`]) is copied by the worker with CPU loads and stores. Device
//! memory ([`MemKind::Vram`]) only on an endpoint made with [`Fabric::endpoint_on`] for its device,
//! and as that device says ([`Device::access`]): by the CPU where the memory is mapped into the
//! process (the mock, Neuron), through [`Device::copy`] otherwise (CUDA: the CPU must never load or
//! store a GPU address). An endpoint without a device, or with one that cannot copy in process,
//! refuses to register device memory, naming it, instead of touching it later.
//!
//! What this module must never do: touch memory that is not registered at the moment of the copy
//! (every copy re-validates its ranges under the registration locks, so `deregister` and dropping an
//! endpoint wait for a copy in progress and stop later ones), panic on bad input, or leak its thread.

use std::cmp::Reverse;
use std::collections::hash_map::Entry;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::fmt;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use super::{Desc, Fence, Notification, Op, Transport, TransportError, Waker, XferId, XferState};
use crate::device::{Access, CopyOp, Device, MemKind, MemRegion};
use crate::sync::lock;

/// NIXL's `NIXL_ERR_INVALID_PARAM`: a call was given a bad argument.
pub const STATUS_INVALID_PARAM: i32 = -2;
/// NIXL's `NIXL_ERR_BACKEND`: the backend failed (injected post errors and partial transfers).
pub const STATUS_BACKEND: i32 = -3;
/// NIXL's `NIXL_ERR_NOT_FOUND`: memory or a registration was not found.
pub const STATUS_NOT_FOUND: i32 = -4;
/// NIXL's `NIXL_ERR_REMOTE_DISCONNECT`: the other side went away while a transfer was queued.
pub const STATUS_REMOTE_DISCONNECT: i32 = -10;

/// The name of a status code, as NIXL spells it.
pub fn status_text(status: i32) -> &'static str {
    match status {
        STATUS_INVALID_PARAM => "NIXL_ERR_INVALID_PARAM",
        STATUS_BACKEND => "NIXL_ERR_BACKEND",
        STATUS_NOT_FOUND => "NIXL_ERR_NOT_FOUND",
        STATUS_REMOTE_DISCONNECT => "NIXL_ERR_REMOTE_DISCONNECT",
        _ => "unknown status",
    }
}

/// Longest endpoint name accepted (bytes).
pub const MAX_NAME_LEN: usize = 256;

/// A fault to inject into the next post of an endpoint ([`LoopbackTransport::inject_once`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The post fails at once with [`TransportError::Call`] (status [`STATUS_BACKEND`]); nothing is
    /// copied, no handle is created.
    PostError,
    /// The data lands and `poll` reports `Done`, but the notification is never delivered.
    LoseNotification,
    /// Only the first half of the descriptors (rounded down) is copied; `poll` reports
    /// [`TransportError::Failed`] and no notification is delivered.
    Partial,
    /// The transfer completes normally, but no earlier than this long after the post. Jobs queued
    /// behind it on the same (initiator, target) pair wait for it; other pairs do not.
    Delay(Duration),
    /// The post panics on the caller's thread (a writer), as a bug in a transport or plugin would;
    /// nothing is copied. Tests use it to prove that a panicked writer fails its requests.
    Panic,
}

/// Pseudo-random fault rates of an endpoint ([`LoopbackTransport::set_fault_rates`]).
///
/// Each post that finds no one-shot fault queued draws one number `x` in `[0, 1)` from a xorshift
/// generator seeded with `seed`: `x < post_error` is a [`Fault::PostError`], the next
/// `lose_notification` of the interval a [`Fault::LoseNotification`], the next `partial` a
/// [`Fault::Partial`]. Rates are clamped to `[0, 1]` (NaN counts as 0); where they sum past 1 the later
/// kinds get what is left. The same seed and the same sequence of posts give the same faults.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FaultRates {
    /// Probability that a post fails at once.
    pub post_error: f64,
    /// Probability that a completed transfer's notification is lost.
    pub lose_notification: f64,
    /// Probability that a transfer copies only a prefix and fails.
    pub partial: f64,
    /// Seed of the generator.
    pub seed: u64,
}

/// Counters of one endpoint ([`LoopbackTransport::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoopbackStats {
    /// Posts accepted (a handle was returned).
    pub posts: u64,
    /// Posts refused by an injected [`Fault::PostError`].
    pub post_errors: u64,
    /// Descriptors in accepted posts.
    pub descriptors: u64,
    /// Bytes in accepted posts.
    pub bytes: u64,
    /// Transfers that finished with an error (injected partial, memory deregistered, endpoint gone).
    pub failed_transfers: u64,
    /// Notifications from this endpoint that landed in a peer's inbox (with a transfer or alone).
    pub notifications_sent: u64,
    /// Notifications from this endpoint dropped by an injected [`Fault::LoseNotification`].
    pub notifications_lost: u64,
    /// Notifications that landed in this endpoint's inbox.
    pub notifications_received: u64,
}

/// Whether a fabric's worker thread runs ([`Fabric::worker_watch`]); tests use it to prove that
/// dropping the fabric and its endpoints stops the thread.
#[derive(Clone, Debug)]
pub struct WorkerWatch(Option<Weak<()>>);

impl WorkerWatch {
    /// Whether the worker thread this watch was taken from still runs. A watch taken before the
    /// worker started reports `false` forever.
    pub fn is_running(&self) -> bool {
        self.0.as_ref().is_some_and(|w| w.strong_count() > 0)
    }
}

/// The shared medium of loopback endpoints: a cheap handle (clone it freely).
///
/// The fabric owns the worker thread that performs every copy and delivers every notification. The
/// thread starts with the first post or notification and stops (and is joined) when the last
/// [`Fabric`] handle and the last endpoint of the fabric are dropped.
#[derive(Clone)]
pub struct Fabric {
    shared: Arc<FabricShared>,
}

impl Fabric {
    /// A new, empty fabric. No thread starts until something is posted.
    pub fn new() -> Fabric {
        static NEXT_FABRIC: AtomicU64 = AtomicU64::new(1);
        Fabric {
            shared: Arc::new(FabricShared {
                id: NEXT_FABRIC.fetch_add(1, Ordering::Relaxed),
                endpoints: Mutex::new(HashMap::new()),
                worker: Mutex::new(None),
            }),
        }
    }

    /// A new endpoint named `name` (unique among this fabric's live endpoints, 1 to
    /// [`MAX_NAME_LEN`] bytes) for host memory only: it refuses to register device memory.
    pub fn endpoint(&self, name: &str) -> Result<LoopbackTransport, TransportError> {
        self.make_endpoint(name, None)
    }

    /// A new endpoint named `name` for the memory of `device` (and host memory): device memory it
    /// registers is copied the way the device says ([`Device::access`]).
    pub fn endpoint_on(&self, name: &str, device: Arc<dyn Device>) -> Result<LoopbackTransport, TransportError> {
        self.make_endpoint(name, Some(device))
    }

    fn make_endpoint(&self, name: &str, device: Option<Arc<dyn Device>>) -> Result<LoopbackTransport, TransportError> {
        if name.is_empty() || name.len() > MAX_NAME_LEN {
            return Err(call_error(
                "endpoint",
                None,
                STATUS_INVALID_PARAM,
                format!("endpoint names are 1 to {MAX_NAME_LEN} bytes, got {}", name.len()),
            ));
        }
        static NEXT_ENDPOINT: AtomicU64 = AtomicU64::new(1);
        let mut endpoints = lock(&self.shared.endpoints);
        if endpoints.get(name).and_then(Weak::upgrade).is_some_and(|ep| !ep.is_closed()) {
            return Err(call_error(
                "endpoint",
                None,
                STATUS_INVALID_PARAM,
                format!("an endpoint named {name:?} already exists on this fabric"),
            ));
        }
        let ep = Arc::new(Endpoint {
            id: NEXT_ENDPOINT.fetch_add(1, Ordering::Relaxed),
            name: name.to_owned(),
            closed: AtomicBool::new(false),
            regions: RwLock::new(Vec::new()),
            xfers: Mutex::new(HashMap::new()),
            inbox: Mutex::new(Vec::new()),
            waker: Mutex::new(None),
            stats: Counters::default(),
            device,
            posted: AtomicU64::new(0),
            fences: Mutex::new(HashMap::new()),
        });
        endpoints.insert(name.to_owned(), Arc::downgrade(&ep));
        drop(endpoints);
        Ok(LoopbackTransport {
            ep,
            fabric: self.clone(),
            peers: Mutex::new(HashMap::new()),
            faults: Mutex::new(Faults::default()),
            next_xfer: AtomicU64::new(1),
            unfenceable: AtomicBool::new(false),
        })
    }

    /// Watches the worker thread, if it has started (take the watch after the first post).
    pub fn worker_watch(&self) -> WorkerWatch {
        WorkerWatch(lock(&self.shared.worker).as_ref().map(|w| w.alive.clone()))
    }

    /// Queues a job for the worker, starting the worker on first use.
    fn submit(&self, job: Job) -> Result<(), String> {
        let mut worker = lock(&self.shared.worker);
        if worker.is_none() {
            *worker = Some(WorkerHandle::spawn(self.shared.id)?);
        }
        match worker.as_ref() {
            Some(w) => w.tx.send(job).map_err(|_| "the fabric's worker thread is gone".to_owned()),
            None => Err("the fabric's worker thread did not start".to_owned()),
        }
    }
}

impl Default for Fabric {
    fn default() -> Self {
        Fabric::new()
    }
}

impl fmt::Debug for Fabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fabric")
            .field("id", &self.shared.id)
            .field("endpoints", &lock(&self.shared.endpoints).len())
            .field("worker_running", &self.worker_watch().is_running())
            .finish()
    }
}

/// One endpoint (one NIXL "agent") of a [`Fabric`]. See the module docs.
///
/// Dropping it deregisters all its memory (waiting for a copy in progress), forgets its pending
/// transfers and notifications, and frees its name; transfers other endpoints queued towards it then
/// fail with [`STATUS_REMOTE_DISCONNECT`].
pub struct LoopbackTransport {
    ep: Arc<Endpoint>,
    fabric: Fabric,
    peers: Mutex<HashMap<String, Weak<Endpoint>>>,
    faults: Mutex<Faults>,
    next_xfer: AtomicU64,
    /// Model a data path that cannot fence a peer (as NIXL/UCX): [`Transport::revoke_peer`] then
    /// revokes nothing and answers [`Fence::Unconfirmed`].
    unfenceable: AtomicBool,
}

impl LoopbackTransport {
    /// Makes this endpoint behave like a data path that cannot cut a peer's access to its memory
    /// (`true`; as NIXL over UCX, docs/reliability.md): a lost peer's transfers keep landing, and
    /// [`Transport::revoke_peer`] says so. For tests of the quarantine.
    pub fn set_unfenceable(&self, unfenceable: bool) {
        self.unfenceable.store(unfenceable, Ordering::Release);
    }

    /// Queues a one-shot fault for a later post; each post consumes the oldest queued fault. Only
    /// posts that pass validation consume faults (a post refused for an unknown peer or a descriptor
    /// outside registered memory leaves the queue alone). One-shot faults take precedence over
    /// [`FaultRates`].
    pub fn inject_once(&self, fault: Fault) {
        lock(&self.faults).once.push_back(fault);
    }

    /// Sets pseudo-random fault rates (see [`FaultRates`]) and restarts the generator from the seed.
    pub fn set_fault_rates(&self, rates: FaultRates) {
        let mut faults = lock(&self.faults);
        faults.rng = XorShift::new(rates.seed);
        faults.rates = Some(rates);
    }

    /// Removes queued one-shot faults and fault rates.
    pub fn clear_faults(&self) {
        let mut faults = lock(&self.faults);
        faults.once.clear();
        faults.rates = None;
    }

    /// A snapshot of this endpoint's counters.
    pub fn stats(&self) -> LoopbackStats {
        self.ep.stats.snapshot()
    }

    /// Transfer handles not yet released by [`Transport::poll`] (pending or finished but not polled);
    /// an engine that leaks none brings this back to 0.
    pub fn open_transfers(&self) -> usize {
        lock(&self.ep.xfers).len()
    }

    /// The fabric this endpoint belongs to.
    pub fn fabric(&self) -> &Fabric {
        &self.fabric
    }

    /// The peer endpoint named `peer`, if loaded and still alive.
    fn peer(&self, peer: &str) -> Result<Arc<Endpoint>, TransportError> {
        lock(&self.peers)
            .get(peer)
            .and_then(Weak::upgrade)
            .filter(|ep| !ep.is_closed())
            .ok_or_else(|| TransportError::UnknownPeer(peer.to_owned()))
    }

    fn next_fault(&self) -> Option<Fault> {
        lock(&self.faults).next()
    }
}

impl Transport for LoopbackTransport {
    fn name(&self) -> &str {
        &self.ep.name
    }

    /// Registers `region` for transfers.
    ///
    /// Contract (the loopback copies with plain CPU loads and stores on these addresses): the region
    /// is host-addressable memory owned by the caller, valid for reads and writes for its whole
    /// length from this call until [`Transport::deregister`] returns or the endpoint is dropped, and
    /// not accessed by the caller while a transfer that touches it is in flight (between `post` and
    /// the transfer's completion or notification, as with any DMA engine). Deregistering or dropping
    /// the endpoint waits for a copy in progress; later copies of the range fail instead of running.
    ///
    /// Device memory ([`MemKind::Vram`]) is copied by the endpoint's device (see the module docs);
    /// for memory of [`Access::Cpu`] the contract above holds for it too.
    ///
    /// Errors: an empty region, address 0, a range that wraps or does not fit the address space, a
    /// region registered twice, or device memory on an endpoint whose device cannot copy it (none,
    /// or [`Access::None`]) (status [`STATUS_INVALID_PARAM`]).
    unsafe fn register(&self, region: &MemRegion) -> Result<(), TransportError> {
        let invalid = |detail: String| call_error("register", None, STATUS_INVALID_PARAM, detail);
        if region.len == 0 || region.addr == 0 {
            return Err(invalid(format!("empty or null region {:#x}+{}", region.addr, region.len)));
        }
        if region.kind == MemKind::Vram {
            let what = format!("region {:#x}+{} is device memory (device {})", region.addr, region.len, region.dev_id);
            match self.ep.device.as_deref().map(|d| (d.kind(), d.access())) {
                None => {
                    return Err(invalid(format!(
                        "{what}, and endpoint {:?} has no device to copy it with: the loopback copies only host \
                         memory with the CPU (make the endpoint with Fabric::endpoint_on and the memory's device)",
                        self.ep.name
                    )))
                }
                Some((kind, Access::None)) => {
                    return Err(invalid(format!("{what}, and the endpoint's {kind} device cannot copy it in process")))
                }
                Some((_, Access::Cpu | Access::Device)) => {}
            }
        }
        let fits = region
            .addr
            .checked_add(region.len)
            .is_some_and(|end| usize::try_from(end).is_ok() && isize::try_from(region.len).is_ok());
        if !fits {
            return Err(invalid(format!("region {:#x}+{} does not fit the address space", region.addr, region.len)));
        }
        let mut regions = write(&self.ep.regions);
        if regions.contains(region) {
            return Err(invalid(format!("region {:#x}+{} is already registered", region.addr, region.len)));
        }
        regions.push(*region);
        Ok(())
    }

    /// Removes a registration made with the same region; waits for a copy in progress that uses this
    /// endpoint's memory. Transfers still queued on the range fail with [`STATUS_NOT_FOUND`].
    fn deregister(&self, region: &MemRegion) -> Result<(), TransportError> {
        let mut regions = write(&self.ep.regions);
        match regions.iter().position(|r| r == region) {
            Some(i) => {
                regions.swap_remove(i);
                Ok(())
            }
            None => Err(call_error(
                "deregister",
                None,
                STATUS_NOT_FOUND,
                format!("region {:#x}+{} is not registered", region.addr, region.len),
            )),
        }
    }

    fn local_metadata(&self) -> Result<Vec<u8>, TransportError> {
        Ok(Metadata {
            pid: std::process::id(),
            fabric: self.fabric.shared.id,
            endpoint: self.ep.id,
            name: &self.ep.name,
        }
        .encode())
    }

    /// Loads a peer's metadata. Metadata of another fabric (or process) or bytes that are not loopback
    /// metadata are [`TransportError::BadMetadata`]; metadata of an endpoint that no longer exists is
    /// [`TransportError::UnknownPeer`]. Loading a name again replaces the old peer (it restarted).
    fn load_remote(&self, metadata: &[u8]) -> Result<String, TransportError> {
        let md = Metadata::decode(metadata)?;
        let (pid, fabric) = (std::process::id(), self.fabric.shared.id);
        if md.pid != pid || md.fabric != fabric {
            return Err(TransportError::BadMetadata(format!(
                "endpoint {:?} belongs to fabric {} of process {}, this endpoint to fabric {fabric} of process {pid}",
                md.name, md.fabric, md.pid
            )));
        }
        let peer = lock(&self.fabric.shared.endpoints)
            .get(md.name)
            .and_then(Weak::upgrade)
            .filter(|ep| ep.id == md.endpoint && !ep.is_closed())
            .ok_or_else(|| TransportError::UnknownPeer(md.name.to_owned()))?;
        // Loaded again after a revocation: what it posted before now stays refused.
        if let Some(f) = lock(&self.ep.fences).get_mut(&peer.id) {
            *f = PeerFence { revoked: false, min_seq: peer.posted.load(Ordering::Acquire) };
        }
        lock(&self.peers).insert(md.name.to_owned(), Arc::downgrade(&peer));
        Ok(md.name.to_owned())
    }

    /// Confirmed whenever the peer is known: every job re-checks the target's fences under its
    /// registration lock, which this call takes for writing (so a copy in progress ends first).
    fn revoke_peer(&self, peer: &str) -> Fence {
        if self.unfenceable.load(Ordering::Acquire) {
            return Fence::Unconfirmed;
        }
        let Some(weak) = lock(&self.peers).get(peer).cloned() else { return Fence::Unconfirmed };
        // A peer whose endpoint is gone posts nothing more, and its queued jobs are refused.
        let Some(ep) = weak.upgrade() else { return Fence::Confirmed };
        let _copies = write(&self.ep.regions);
        lock(&self.ep.fences).insert(ep.id, PeerFence { revoked: true, min_seq: 0 });
        Fence::Confirmed
    }

    fn drop_peer(&self, peer: &str) {
        lock(&self.peers).remove(peer);
    }

    /// Validates and queues a transfer; see the module docs. An empty descriptor list is refused
    /// ([`STATUS_INVALID_PARAM`]), as NIXL refuses it; send a bare notification instead.
    fn post(&self, op: Op, peer: &str, descs: &[Desc], notif: Option<&[u8]>) -> Result<XferId, TransportError> {
        let target = self.peer(peer)?;
        if descs.is_empty() {
            return Err(call_error("post", Some(peer), STATUS_INVALID_PARAM, "no descriptors".to_owned()));
        }
        with_regions(&self.ep, &target, |local, remote| check_descs(descs, local, remote).map_err(|e| e.into_error()))?;

        let fault = self.next_fault();
        if fault == Some(Fault::Panic) {
            panic!("loopback: injected panic in a post to {peer}");
        }
        if fault == Some(Fault::PostError) {
            self.ep.stats.post_errors.fetch_add(1, Ordering::Relaxed);
            return Err(call_error("post", Some(peer), STATUS_BACKEND, "injected post error".to_owned()));
        }
        let not_before = match fault {
            // A delay too large for the clock saturates at a year: "never, for any test".
            Some(Fault::Delay(d)) => {
                let now = Instant::now();
                Some(now.checked_add(d).unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600)))
            }
            _ => None,
        };
        let exec_fault = match fault {
            Some(Fault::LoseNotification) => Some(ExecFault::LoseNotification),
            Some(Fault::Partial) => Some(ExecFault::Partial),
            _ => None,
        };

        let id = self.next_xfer.fetch_add(1, Ordering::Relaxed);
        lock(&self.ep.xfers).insert(id, Slot::Pending);
        let job = Job {
            seq: self.ep.posted.fetch_add(1, Ordering::AcqRel),
            from: self.ep.clone(),
            to: target,
            not_before,
            work: Work::Xfer { id, op, descs: descs.to_vec(), notif: notif.map(<[u8]>::to_vec), fault: exec_fault },
        };
        if let Err(why) = self.fabric.submit(job) {
            lock(&self.ep.xfers).remove(&id);
            return Err(call_error("post", Some(peer), STATUS_BACKEND, why));
        }
        let stats = &self.ep.stats;
        stats.posts.fetch_add(1, Ordering::Relaxed);
        stats.descriptors.fetch_add(descs.len() as u64, Ordering::Relaxed);
        stats.bytes.fetch_add(descs.iter().map(|d| d.len).fold(0, u64::saturating_add), Ordering::Relaxed);
        Ok(XferId(id))
    }

    fn poll(&self, id: XferId) -> Result<XferState, TransportError> {
        match lock(&self.ep.xfers).entry(id.0) {
            Entry::Vacant(_) => Err(TransportError::UnknownXfer(id)),
            Entry::Occupied(slot) => match slot.get() {
                Slot::Pending => Ok(XferState::Pending),
                Slot::Done | Slot::Failed(_) => match slot.remove() {
                    Slot::Failed(e) => Err(e),
                    Slot::Done | Slot::Pending => Ok(XferState::Done),
                },
            },
        }
    }

    fn take_notifications(&self, out: &mut Vec<Notification>) -> Result<usize, TransportError> {
        let mut inbox = lock(&self.ep.inbox);
        let n = inbox.len();
        out.append(&mut inbox);
        Ok(n)
    }

    /// Queues a notification for `peer`, delivered after every transfer this endpoint posted to
    /// `peer` before it. Faults do not apply to bare notifications.
    fn send_notification(&self, peer: &str, msg: &[u8]) -> Result<(), TransportError> {
        let target = self.peer(peer)?;
        let job = Job {
            seq: self.ep.posted.fetch_add(1, Ordering::AcqRel),
            from: self.ep.clone(),
            to: target,
            not_before: None,
            work: Work::Notify { msg: msg.to_vec() },
        };
        self.fabric.submit(job).map_err(|why| call_error("send_notification", Some(peer), STATUS_BACKEND, why))
    }

    fn set_waker(&self, waker: Waker) {
        *lock(&self.ep.waker) = Some(waker);
    }

    fn needs_polling(&self) -> bool {
        false
    }
}

impl Drop for LoopbackTransport {
    fn drop(&mut self) {
        self.ep.closed.store(true, Ordering::Release);
        // Waits for a copy in progress on this endpoint's memory; later copies see no registration.
        write(&self.ep.regions).clear();
        lock(&self.ep.waker).take();
        lock(&self.ep.xfers).clear();
        lock(&self.ep.inbox).clear();
        let mut endpoints = lock(&self.fabric.shared.endpoints);
        if endpoints.get(&self.ep.name).is_some_and(|w| Weak::as_ptr(w) == Arc::as_ptr(&self.ep)) {
            endpoints.remove(&self.ep.name);
        }
    }
}

impl fmt::Debug for LoopbackTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoopbackTransport")
            .field("name", &self.ep.name)
            .field("endpoint", &self.ep.id)
            .field("fabric", &self.fabric.shared.id)
            .field("peers", &lock(&self.peers).len())
            .field("open_transfers", &self.open_transfers())
            .finish()
    }
}

// ---------------------------------------------------------------------------------------------
// Shared state.

struct FabricShared {
    id: u64,
    /// Live endpoints by name (for unique names and `load_remote`).
    endpoints: Mutex<HashMap<String, Weak<Endpoint>>>,
    /// The worker, once started.
    worker: Mutex<Option<WorkerHandle>>,
}

impl Drop for FabricShared {
    fn drop(&mut self) {
        let worker = self.worker.get_mut().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(WorkerHandle { tx, handle, .. }) = worker {
            // Disconnecting the channel is what stops the worker.
            drop(tx);
            // The last handle can be dropped on the worker itself (a waker that owned a Fabric):
            // it then exits on its own after the current job, and must not join itself.
            if handle.thread().id() != thread::current().id() && handle.join().is_err() {
                tracing::warn!("loopback fabric worker thread panicked");
            }
        }
    }
}

struct WorkerHandle {
    tx: Sender<Job>,
    handle: JoinHandle<()>,
    /// Alive while the worker thread runs (the thread owns the only strong reference).
    alive: Weak<()>,
}

impl WorkerHandle {
    fn spawn(fabric: u64) -> Result<WorkerHandle, String> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let token = Arc::new(());
        let alive = Arc::downgrade(&token);
        let worker = Worker { rx, lanes: HashMap::new(), timers: BinaryHeap::new() };
        let handle = thread::Builder::new()
            .name(format!("kvpush-loopback-{fabric}"))
            .spawn(move || {
                let _token = token;
                worker.run();
            })
            .map_err(|e| format!("cannot start the fabric's worker thread: {e}"))?;
        Ok(WorkerHandle { tx, handle, alive })
    }
}

/// One endpoint's state, shared with the worker (queued jobs hold it). Holds nothing of the fabric,
/// so queued jobs never keep the worker's channel alive.
struct Endpoint {
    /// Unique in the process.
    id: u64,
    name: String,
    /// Set when the endpoint's `LoopbackTransport` is dropped.
    closed: AtomicBool,
    /// Registered memory. Read-locked (both sides, in `id` order) by validation and by every copy;
    /// write-locked by `register`, `deregister` and drop.
    regions: RwLock<Vec<MemRegion>>,
    xfers: Mutex<HashMap<u64, Slot>>,
    inbox: Mutex<Vec<Notification>>,
    waker: Mutex<Option<Waker>>,
    stats: Counters,
    /// The device whose memory this endpoint may register ([`Fabric::endpoint_on`]).
    device: Option<Arc<dyn Device>>,
    /// Jobs this endpoint posted so far (each job carries its number: [`Job::seq`]).
    posted: AtomicU64,
    /// Peers whose access to this endpoint's memory was revoked ([`Transport::revoke_peer`]), by
    /// endpoint id. Locked inside `regions` (never the other way round).
    fences: Mutex<HashMap<u64, PeerFence>>,
}

/// A revoked peer: refused while `revoked`; once loaded again, its jobs numbered below `min_seq`
/// (posted before it was loaded again) stay refused.
#[derive(Clone, Copy, Debug)]
struct PeerFence {
    revoked: bool,
    min_seq: u64,
}

impl Endpoint {
    /// Whether job `seq` of endpoint `from` may no longer touch this endpoint's memory or inbox.
    fn refuses(&self, from: u64, seq: u64) -> bool {
        lock(&self.fences).get(&from).is_some_and(|f| f.revoked || seq < f.min_seq)
    }

    /// The device that copies this endpoint's device memory, where the CPU must not
    /// ([`Access::Device`]).
    fn copier(&self) -> Option<&Arc<dyn Device>> {
        self.device.as_ref().filter(|d| d.access() == Access::Device)
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Calls the waker outside every lock; a panicking waker is logged, never kills the worker.
    fn wake(&self) {
        if self.is_closed() {
            return;
        }
        let waker = lock(&self.waker).clone();
        if let Some(waker) = waker {
            if panic::catch_unwind(AssertUnwindSafe(|| waker())).is_err() {
                tracing::warn!(endpoint = %self.name, "loopback waker panicked");
            }
        }
    }

    /// Puts a notification in the inbox; false if the endpoint is gone.
    fn deliver(&self, from: &str, msg: Vec<u8>) -> bool {
        let mut inbox = lock(&self.inbox);
        if self.is_closed() {
            return false;
        }
        inbox.push(Notification { from: from.to_owned(), msg });
        self.stats.notifications_received.fetch_add(1, Ordering::Relaxed);
        true
    }

    fn finish(&self, id: u64, result: Slot) {
        if let Some(slot) = lock(&self.xfers).get_mut(&id) {
            *slot = result;
        }
    }
}

enum Slot {
    Pending,
    Done,
    Failed(TransportError),
}

#[derive(Default)]
struct Counters {
    posts: AtomicU64,
    post_errors: AtomicU64,
    descriptors: AtomicU64,
    bytes: AtomicU64,
    failed_transfers: AtomicU64,
    notifications_sent: AtomicU64,
    notifications_lost: AtomicU64,
    notifications_received: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> LoopbackStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        LoopbackStats {
            posts: get(&self.posts),
            post_errors: get(&self.post_errors),
            descriptors: get(&self.descriptors),
            bytes: get(&self.bytes),
            failed_transfers: get(&self.failed_transfers),
            notifications_sent: get(&self.notifications_sent),
            notifications_lost: get(&self.notifications_lost),
            notifications_received: get(&self.notifications_received),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Faults.

#[derive(Default)]
struct Faults {
    once: VecDeque<Fault>,
    rates: Option<FaultRates>,
    rng: XorShift,
}

impl Faults {
    fn next(&mut self) -> Option<Fault> {
        if let Some(fault) = self.once.pop_front() {
            return Some(fault);
        }
        let rates = self.rates?;
        let clamp = |p: f64| if p.is_nan() { 0.0 } else { p.clamp(0.0, 1.0) };
        let x = self.rng.next_f64();
        let post_error = clamp(rates.post_error);
        let lose = post_error + clamp(rates.lose_notification);
        let partial = lose + clamp(rates.partial);
        if x < post_error {
            Some(Fault::PostError)
        } else if x < lose {
            Some(Fault::LoseNotification)
        } else if x < partial {
            Some(Fault::Partial)
        } else {
            None
        }
    }
}

/// xorshift64* (Vigna): small, fast, deterministic; plenty for fault injection.
struct XorShift(u64);

impl XorShift {
    fn new(seed: u64) -> XorShift {
        // Zero is xorshift's fixed point; any seed maps to a non-zero state.
        XorShift(if seed == 0 { 0x9E37_79B9_7F4A_7C15 } else { seed })
    }

    fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `[0, 1)` from the top 53 bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

impl Default for XorShift {
    fn default() -> Self {
        XorShift::new(0)
    }
}

// ---------------------------------------------------------------------------------------------
// Metadata: magic, process id, fabric id, endpoint id, name (little-endian, length-prefixed).

const MAGIC: &[u8; 16] = b"kvpush-loopback1";

struct Metadata<'a> {
    pid: u32,
    fabric: u64,
    endpoint: u64,
    name: &'a str,
}

impl<'a> Metadata<'a> {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(MAGIC.len() + 4 + 8 + 8 + 2 + self.name.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&self.fabric.to_le_bytes());
        out.extend_from_slice(&self.endpoint.to_le_bytes());
        // Names are at most MAX_NAME_LEN (256) bytes, checked in `Fabric::endpoint`.
        out.extend_from_slice(&(self.name.len() as u16).to_le_bytes());
        out.extend_from_slice(self.name.as_bytes());
        out
    }

    fn decode(bytes: &'a [u8]) -> Result<Metadata<'a>, TransportError> {
        let bad =
            |why: &str| TransportError::BadMetadata(format!("not loopback metadata ({} bytes): {why}", bytes.len()));
        let rest = bytes.strip_prefix(MAGIC.as_slice()).ok_or_else(|| bad("wrong magic"))?;
        let (pid, rest) = take::<4>(rest).ok_or_else(|| bad("truncated"))?;
        let (fabric, rest) = take::<8>(rest).ok_or_else(|| bad("truncated"))?;
        let (endpoint, rest) = take::<8>(rest).ok_or_else(|| bad("truncated"))?;
        let (len, rest) = take::<2>(rest).ok_or_else(|| bad("truncated"))?;
        let len = usize::from(u16::from_le_bytes(len));
        if len == 0 || len > MAX_NAME_LEN || rest.len() != len {
            return Err(bad("bad name length"));
        }
        let name = std::str::from_utf8(rest).map_err(|_| bad("name is not UTF-8"))?;
        Ok(Metadata {
            pid: u32::from_le_bytes(pid),
            fabric: u64::from_le_bytes(fabric),
            endpoint: u64::from_le_bytes(endpoint),
            name,
        })
    }
}

fn take<const N: usize>(bytes: &[u8]) -> Option<([u8; N], &[u8])> {
    let (head, rest) = bytes.split_first_chunk::<N>()?;
    Some((*head, rest))
}

// ---------------------------------------------------------------------------------------------
// Validation and copying.

/// Why a descriptor list does not fit the registered memory.
struct Outside {
    index: usize,
    addr: u64,
    len: u64,
    side: &'static str,
}

impl Outside {
    fn into_error(self) -> TransportError {
        TransportError::NotRegistered { index: self.index, addr: self.addr, len: self.len, side: self.side }
    }
}

/// Checks that every descriptor lies inside one registered region on each side.
fn check_descs(descs: &[Desc], local: &[MemRegion], remote: &[MemRegion]) -> Result<(), Outside> {
    let inside = |regions: &[MemRegion], addr: u64, len: u64| regions.iter().any(|r| r.contains(addr, len));
    for (index, d) in descs.iter().enumerate() {
        if !inside(local, d.local, d.len) {
            return Err(Outside { index, addr: d.local, len: d.len, side: "local" });
        }
        if !inside(remote, d.remote, d.len) {
            return Err(Outside { index, addr: d.remote, len: d.len, side: "remote" });
        }
    }
    Ok(())
}

/// Runs `f` with both endpoints' registrations read-locked, always locking the lower id first (one
/// lock when `a` and `b` are the same endpoint), so two threads locking opposite pairs cannot
/// deadlock behind a waiting writer.
fn with_regions<R>(a: &Endpoint, b: &Endpoint, f: impl FnOnce(&[MemRegion], &[MemRegion]) -> R) -> R {
    if a.id == b.id {
        let ra = read(&a.regions);
        f(&ra, &ra)
    } else if a.id < b.id {
        let ra = read(&a.regions);
        let rb = read(&b.regions);
        f(&ra, &rb)
    } else {
        let rb = read(&b.regions);
        let ra = read(&a.regions);
        f(&ra, &rb)
    }
}

/// Copies one descriptor with the CPU. Only called by [`run_xfer`] with both endpoints'
/// registrations read-locked, after [`check_descs`] accepted `d` against exactly those registrations,
/// and for host memory or device memory the CPU may access ([`Access::Cpu`]): `register` refuses
/// device memory of an endpoint without a device that can copy it, and `run_xfer` hands memory of
/// [`Access::Device`] to its device.
fn copy_desc(op: Op, d: &Desc) {
    if d.len == 0 {
        return;
    }
    let (src, dst) = match op {
        Op::Write => (d.local, d.remote),
        Op::Read => (d.remote, d.local),
    };
    // `register` admits only regions whose end fits `usize`, and `d` lies inside one, so these
    // conversions are lossless.
    let (src, dst, len) = (src as usize, dst as usize, d.len as usize);
    let src = std::ptr::with_exposed_provenance::<u8>(src);
    let dst = std::ptr::with_exposed_provenance_mut::<u8>(dst);
    // SAFETY: both `[src, src + len)` and `[dst, dst + len)` lie inside memory registered on their
    // endpoints (checked by `check_descs` under the registration read locks the caller still holds,
    // so no `deregister` or endpoint drop can complete in between). `register`'s contract makes the
    // caller guarantee that registered memory is valid for reads and writes of its whole length
    // while registered, and not accessed by the caller while a transfer on it is in flight; the
    // addresses were exposed by the caller when it took them from its allocation. Neither pointer is
    // null (registration refuses address 0) and `u8` needs no alignment. The ranges may overlap
    // (two endpoints may register the same memory), so `copy` (memmove) is used, not
    // `copy_nonoverlapping`.
    unsafe { std::ptr::copy(src, dst, len) };
}

// ---------------------------------------------------------------------------------------------
// The worker.

struct Job {
    /// The initiator's job number (see [`Endpoint::fences`]).
    seq: u64,
    from: Arc<Endpoint>,
    to: Arc<Endpoint>,
    /// Do not run before this instant ([`Fault::Delay`]).
    not_before: Option<Instant>,
    work: Work,
}

enum Work {
    Xfer { id: u64, op: Op, descs: Vec<Desc>, notif: Option<Vec<u8>>, fault: Option<ExecFault> },
    Notify { msg: Vec<u8> },
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum ExecFault {
    LoseNotification,
    Partial,
}

/// (initiator id, target id): jobs of one lane run in FIFO order.
type LaneKey = (u64, u64);

struct Worker {
    rx: Receiver<Job>,
    /// Jobs waiting behind a delayed job of their lane (a lane exists only while non-empty).
    lanes: HashMap<LaneKey, VecDeque<Job>>,
    /// When a lane's delayed head becomes due; one entry per blocked lane.
    timers: BinaryHeap<Reverse<(Instant, LaneKey)>>,
}

impl Worker {
    /// Blocks on the channel (or on the next deadline) until every sender is gone. Jobs still queued
    /// then belong to endpoints that no longer exist, so they are dropped unexecuted.
    fn run(mut self) {
        loop {
            let now = Instant::now();
            while let Some(&Reverse((due, lane))) = self.timers.peek() {
                if due > now {
                    break;
                }
                self.timers.pop();
                self.drain(lane);
            }
            let received = match self.timers.peek() {
                Some(&Reverse((due, _))) => self.rx.recv_deadline(due),
                None => self.rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            };
            match received {
                Ok(job) => self.enqueue(job),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    fn enqueue(&mut self, job: Job) {
        let key = (job.from.id, job.to.id);
        let lane = self.lanes.entry(key).or_default();
        lane.push_back(job);
        if lane.len() == 1 {
            self.drain(key);
        }
    }

    /// Runs the lane's jobs in order until it is empty or its head is not due yet.
    fn drain(&mut self, key: LaneKey) {
        loop {
            let Some(lane) = self.lanes.get_mut(&key) else { return };
            let Some(head) = lane.front() else {
                self.lanes.remove(&key);
                return;
            };
            if let Some(due) = head.not_before {
                if due > Instant::now() {
                    self.timers.push(Reverse((due, key)));
                    return;
                }
            }
            if let Some(job) = lane.pop_front() {
                run_job(job);
            }
        }
    }
}

fn run_job(job: Job) {
    let Job { seq, from, to, work, .. } = job;
    match work {
        Work::Xfer { id, op, descs, notif, fault } => run_xfer(&from, &to, (id, seq), op, &descs, notif, fault),
        Work::Notify { msg } => {
            if !to.refuses(from.id, seq) && to.deliver(&from.name, msg) {
                from.stats.notifications_sent.fetch_add(1, Ordering::Relaxed);
                to.wake();
            }
        }
    }
}

/// The device that must copy `addr..addr + len` of `ep`'s registered memory `regions`, or `None` where
/// the CPU may (host memory, device memory of [`Access::Cpu`]).
fn device_copier<'a>(ep: &'a Endpoint, regions: &[MemRegion], addr: u64, len: u64) -> Option<&'a Arc<dyn Device>> {
    let vram = regions.iter().find(|r| r.contains(addr, len)).is_some_and(|r| r.kind == MemKind::Vram);
    if vram {
        ep.copier()
    } else {
        None
    }
}

fn run_xfer(
    from: &Endpoint,
    to: &Endpoint,
    (id, seq): (u64, u64),
    op: Op,
    descs: &[Desc],
    notif: Option<Vec<u8>>,
    fault: Option<ExecFault>,
) {
    let partial = fault == Some(ExecFault::Partial);
    let copied = with_regions(from, to, |local, remote| {
        if from.is_closed() || to.is_closed() {
            let gone = if to.is_closed() { &to.name } else { &from.name };
            return Err((STATUS_REMOTE_DISCONNECT, format!("endpoint {gone} went away before the transfer ran")));
        }
        if to.refuses(from.id, seq) {
            let why = format!("endpoint {} revoked the access of {}", to.name, from.name);
            return Err((STATUS_REMOTE_DISCONNECT, why));
        }
        // Registrations may have changed since the post: re-check, and copy nothing unless all fit.
        check_descs(descs, local, remote).map_err(|o| {
            (
                STATUS_NOT_FOUND,
                format!(
                    "descriptor {} ({:#x}+{}) is no longer inside the {} registered memory",
                    o.index, o.addr, o.len, o.side
                ),
            )
        })?;
        let n = if partial { descs.len() / 2 } else { descs.len() };
        // Device memory that only its device may touch goes to that device, in one batch per device;
        // the rest is copied here by the CPU.
        let mut by_device: Vec<(&Arc<dyn Device>, Vec<CopyOp>)> = Vec::new();
        for d in &descs[..n] {
            let on = device_copier(from, local, d.local, d.len).or_else(|| device_copier(to, remote, d.remote, d.len));
            let Some(dev) = on else {
                copy_desc(op, d);
                continue;
            };
            let (src, dst) = match op {
                Op::Write => (d.local, d.remote),
                Op::Read => (d.remote, d.local),
            };
            let copy = CopyOp { dst, src, len: d.len };
            match by_device.iter_mut().find(|(k, _)| Arc::ptr_eq(k, dev)) {
                Some((_, ops)) => ops.push(copy),
                None => by_device.push((dev, vec![copy])),
            }
        }
        for (dev, ops) in by_device {
            // SAFETY: every op lies inside memory registered on its endpoints (checked by
            // `check_descs` under the registration read locks still held here, so no `deregister`
            // or endpoint drop completes before the copy returned); `register`'s contract makes the
            // caller guarantee that registered memory is valid for the transfer's reads and writes
            // and not accessed by anyone else while the transfer is in flight. `Device::copy`
            // returns only once every byte landed.
            unsafe { dev.copy(&ops) }.map_err(|e| {
                (STATUS_BACKEND, format!("{} device copy of {} descriptors: {e}", dev.kind(), ops.len()))
            })?;
        }
        Ok(n)
    });
    let mut notified = false;
    let result = match copied {
        Ok(n) if partial => Slot::Failed(TransportError::Failed {
            id: XferId(id),
            peer: to.name.clone(),
            status: STATUS_BACKEND,
            detail: format!("injected partial transfer: {n} of {} descriptors copied", descs.len()),
        }),
        Ok(_) => {
            if let Some(msg) = notif {
                if fault == Some(ExecFault::LoseNotification) {
                    from.stats.notifications_lost.fetch_add(1, Ordering::Relaxed);
                } else if to.deliver(&from.name, msg) {
                    from.stats.notifications_sent.fetch_add(1, Ordering::Relaxed);
                    notified = true;
                }
            }
            Slot::Done
        }
        Err((status, detail)) => {
            Slot::Failed(TransportError::Failed { id: XferId(id), peer: to.name.clone(), status, detail })
        }
    };
    if matches!(result, Slot::Failed(_)) {
        from.stats.failed_transfers.fetch_add(1, Ordering::Relaxed);
    }
    from.finish(id, result);
    from.wake();
    if notified && to.id != from.id {
        to.wake();
    }
}

// ---------------------------------------------------------------------------------------------

fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(PoisonError::into_inner)
}

fn call_error(call: &'static str, peer: Option<&str>, status: i32, detail: String) -> TransportError {
    TransportError::Call {
        call,
        peer: peer.map(str::to_owned),
        status,
        status_text: status_text(status).to_owned(),
        detail,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::atomic::AtomicUsize;

    use super::*;
    use crate::device::MemKind;

    fn region(buf: &mut [u8]) -> MemRegion {
        MemRegion { addr: buf.as_mut_ptr() as u64, len: buf.len() as u64, kind: MemKind::Dram, dev_id: 0 }
    }

    fn connect(a: &LoopbackTransport, b: &LoopbackTransport) {
        a.load_remote(&b.local_metadata().unwrap()).unwrap();
        b.load_remote(&a.local_metadata().unwrap()).unwrap();
    }

    fn wait(t: &LoopbackTransport, id: XferId) -> Result<XferState, TransportError> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match t.poll(id) {
                Ok(XferState::Pending) => {
                    assert!(Instant::now() < deadline, "transfer {id:?} never completed");
                    thread::sleep(Duration::from_micros(200));
                }
                other => return other,
            }
        }
    }

    fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            thread::sleep(Duration::from_micros(200));
        }
    }

    fn whole(src: &mut [u8], dst: &mut [u8]) -> Desc {
        Desc { local: src.as_mut_ptr() as u64, remote: dst.as_mut_ptr() as u64, len: src.len() as u64 }
    }

    /// Endpoints "a" and "b" of `fabric`, connected, with `src` registered on a and `dst` on b.
    ///
    /// # Safety
    ///
    /// `src` and `dst` outlive both endpoints' use of them (declare them before the endpoints).
    unsafe fn registered_pair(
        fabric: &Fabric,
        src: &mut [u8],
        dst: &mut [u8],
    ) -> (LoopbackTransport, LoopbackTransport) {
        let (a, b) = (fabric.endpoint("a").unwrap(), fabric.endpoint("b").unwrap());
        connect(&a, &b);
        // SAFETY: the caller keeps `src` alive past a's use of it (this function's contract).
        unsafe { a.register(&region(src)) }.unwrap();
        // SAFETY: as above, for `dst` and b.
        unsafe { b.register(&region(dst)) }.unwrap();
        (a, b)
    }

    /// The endpoints of [`registered_pair`] and a write (notification `n`) of all of `src` to
    /// `dst` that a's fabric holds back by `delay`: the test changes b before the copy runs.
    ///
    /// # Safety
    ///
    /// As for [`registered_pair`].
    unsafe fn delayed_write(
        fabric: &Fabric,
        src: &mut [u8],
        dst: &mut [u8],
        delay: Duration,
    ) -> (LoopbackTransport, LoopbackTransport, XferId) {
        // SAFETY: this function's contract is `registered_pair`'s.
        let (a, b) = unsafe { registered_pair(fabric, src, dst) };
        a.inject_once(Fault::Delay(delay));
        let id = a.post(Op::Write, "b", &[whole(src, dst)], Some(b"n")).unwrap();
        (a, b, id)
    }

    #[test]
    fn metadata_round_trips() {
        let md = Metadata { pid: 7, fabric: 9, endpoint: 11, name: "p0/rank1" };
        let bytes = md.encode();
        let back = Metadata::decode(&bytes).unwrap();
        assert_eq!((back.pid, back.fabric, back.endpoint, back.name), (7, 9, 11, "p0/rank1"));
    }

    #[test]
    fn garbage_metadata_is_bad_metadata() {
        let good = Metadata { pid: 1, fabric: 2, endpoint: 3, name: "abc" }.encode();
        let mut bad_utf8 = good.clone();
        let n = bad_utf8.len();
        bad_utf8[n - 1] = 0xff;
        let mut long = good.clone();
        long.push(b'x');
        let mut zero_len = good[..good.len() - 5].to_vec();
        zero_len.extend_from_slice(&[0, 0]);
        let cases: Vec<Vec<u8>> = vec![
            vec![],
            b"garbage".to_vec(),
            good[..MAGIC.len() + 3].to_vec(),
            good[..good.len() - 1].to_vec(),
            long,
            bad_utf8,
            zero_len,
        ];
        for case in cases {
            assert!(matches!(Metadata::decode(&case), Err(TransportError::BadMetadata(_))), "{case:?}");
        }
    }

    #[test]
    fn xorshift_is_deterministic_and_in_range() {
        let mut a = XorShift::new(42);
        let mut b = XorShift::new(42);
        let mut zero = XorShift::new(0);
        for _ in 0..1000 {
            let x = a.next_f64();
            assert!((0.0..1.0).contains(&x));
            assert_eq!(x.to_bits(), b.next_f64().to_bits());
            assert_ne!(zero.next_u64(), 0);
        }
    }

    #[test]
    fn fault_draws_follow_rates_and_one_shots_come_first() {
        let mut f = Faults::default();
        assert_eq!(f.next(), None);
        f.rates = Some(FaultRates { post_error: 1.0, ..FaultRates::default() });
        f.once.push_back(Fault::Partial);
        assert_eq!(f.next(), Some(Fault::Partial));
        assert_eq!(f.next(), Some(Fault::PostError));
        f.rates = Some(FaultRates { post_error: f64::NAN, lose_notification: -3.0, partial: 7.0, seed: 1 });
        assert_eq!(f.next(), Some(Fault::Partial));
        f.rates = Some(FaultRates { post_error: 0.0, lose_notification: 1.0, partial: 1.0, seed: 1 });
        assert_eq!(f.next(), Some(Fault::LoseNotification));
        f.rates = Some(FaultRates::default());
        assert_eq!(f.next(), None);
    }

    #[test]
    fn register_rejects_bad_regions() {
        let fabric = Fabric::new();
        let a = fabric.endpoint("a").unwrap();
        let mut buf = vec![0u8; 64];
        let r = region(&mut buf);
        let status = |e: TransportError| e.status();
        // SAFETY: an empty region is refused before anything could access it.
        assert_eq!(status(unsafe { a.register(&MemRegion { len: 0, ..r }) }.unwrap_err()), STATUS_INVALID_PARAM);
        // SAFETY: a region at address 0 is refused before anything could access it.
        assert_eq!(status(unsafe { a.register(&MemRegion { addr: 0, ..r }) }.unwrap_err()), STATUS_INVALID_PARAM);
        let wrapping = MemRegion { addr: u64::MAX - 8, ..r };
        // SAFETY: a region that wraps the address space is refused before anything could access it.
        let refused = unsafe { a.register(&wrapping) };
        assert_eq!(status(refused.unwrap_err()), STATUS_INVALID_PARAM);
        // SAFETY: the region is a live buffer of this test that outlives the endpoint's use of it.
        unsafe { a.register(&r) }.unwrap();
        // SAFETY: the region is a live buffer of this test that outlives the endpoint's use of it.
        assert_eq!(status(unsafe { a.register(&r) }.unwrap_err()), STATUS_INVALID_PARAM);
        a.deregister(&r).unwrap();
        assert_eq!(status(a.deregister(&r).unwrap_err()), STATUS_NOT_FOUND);
    }

    #[test]
    fn endpoint_names_are_unique_and_reusable_after_drop() {
        let fabric = Fabric::new();
        assert!(fabric.endpoint("").is_err());
        assert!(fabric.endpoint(&"x".repeat(MAX_NAME_LEN + 1)).is_err());
        assert!(fabric.endpoint(&"x".repeat(MAX_NAME_LEN)).is_ok());
        let a = fabric.endpoint("a").unwrap();
        let other = fabric.endpoint("other").unwrap();
        assert_eq!(fabric.endpoint("a").unwrap_err().status(), STATUS_INVALID_PARAM);
        let stale = a.local_metadata().unwrap();
        drop(a);
        let a2 = fabric.endpoint("a").unwrap();
        // Metadata of the dropped incarnation does not reach the new endpoint of the same name.
        assert_eq!(other.load_remote(&stale).unwrap_err(), TransportError::UnknownPeer("a".into()));
        assert_eq!(other.load_remote(&a2.local_metadata().unwrap()).unwrap(), "a");
    }

    #[test]
    fn deregistered_before_the_copy_fails_and_copies_nothing() {
        let fabric = Fabric::new();
        let (mut src, mut dst) = (vec![7u8; 4096], vec![0u8; 4096]);
        // SAFETY: both buffers are this test's, declared before the endpoints and so dropped after them.
        let (a, b, id) = unsafe { delayed_write(&fabric, &mut src, &mut dst, Duration::from_millis(100)) };
        b.deregister(&region(&mut dst)).unwrap();
        match wait(&a, id) {
            Err(TransportError::Failed { status, detail, .. }) => {
                assert_eq!(status, STATUS_NOT_FOUND);
                assert!(detail.contains("remote"), "{detail}");
            }
            other => panic!("expected a failure, got {other:?}"),
        }
        assert!(dst.iter().all(|&x| x == 0));
        let mut notes = Vec::new();
        assert_eq!(b.take_notifications(&mut notes).unwrap(), 0);
        assert_eq!(a.stats().failed_transfers, 1);
    }

    #[test]
    fn target_dropped_before_the_copy_fails_with_remote_disconnect() {
        let fabric = Fabric::new();
        let (mut src, mut dst) = (vec![7u8; 4096], vec![0u8; 4096]);
        // SAFETY: both buffers are this test's, declared before the endpoints and so dropped after them.
        let (a, b, id) = unsafe { delayed_write(&fabric, &mut src, &mut dst, Duration::from_millis(50)) };
        drop(b);
        match wait(&a, id) {
            Err(TransportError::Failed { status, .. }) => assert_eq!(status, STATUS_REMOTE_DISCONNECT),
            other => panic!("expected a failure, got {other:?}"),
        }
        assert!(dst.iter().all(|&x| x == 0));
        // The dropped peer is unknown from now on.
        assert_eq!(
            a.post(Op::Write, "b", &[whole(&mut src, &mut dst)], None),
            Err(TransportError::UnknownPeer("b".into()))
        );
    }

    #[test]
    fn a_delayed_job_holds_back_its_own_pair_only() {
        let fabric = Fabric::new();
        let (a, b, c) = (fabric.endpoint("a").unwrap(), fabric.endpoint("b").unwrap(), fabric.endpoint("c").unwrap());
        connect(&a, &b);
        connect(&a, &c);
        let (mut src, mut dst_b, mut dst_c) = (vec![1u8; 1024], vec![0u8; 1024], vec![0u8; 1024]);
        // SAFETY: the region is a live buffer of this test that outlives the endpoint's use of it.
        unsafe { a.register(&region(&mut src)) }.unwrap();
        // SAFETY: the region is a live buffer of this test that outlives the endpoint's use of it.
        unsafe { b.register(&region(&mut dst_b)) }.unwrap();
        // SAFETY: the region is a live buffer of this test that outlives the endpoint's use of it.
        unsafe { c.register(&region(&mut dst_c)) }.unwrap();
        let t0 = Instant::now();
        a.inject_once(Fault::Delay(Duration::from_millis(300)));
        let slow = a.post(Op::Write, "b", &[whole(&mut src, &mut dst_b)], Some(b"data")).unwrap();
        a.send_notification("b", b"after").unwrap();
        let fast = a.post(Op::Write, "c", &[whole(&mut src, &mut dst_c)], Some(b"c")).unwrap();
        assert_eq!(wait(&a, fast), Ok(XferState::Done));
        assert!(t0.elapsed() < Duration::from_millis(300), "the other pair waited for the delay");
        assert_eq!(a.poll(slow), Ok(XferState::Pending));
        let mut notes = Vec::new();
        assert_eq!(b.take_notifications(&mut notes).unwrap(), 0, "a bare notification overtook the data");
        assert_eq!(wait(&a, slow), Ok(XferState::Done));
        assert!(t0.elapsed() >= Duration::from_millis(300));
        wait_until("both notifications", || {
            b.take_notifications(&mut notes).unwrap();
            notes.len() == 2
        });
        assert_eq!(notes[0].msg, b"data");
        assert_eq!(notes[1].msg, b"after");
    }

    #[test]
    fn a_waker_owning_the_last_fabric_handle_does_not_join_itself() {
        let fabric = Fabric::new();
        let (mut src, mut dst) = (vec![1u8; 64], vec![0u8; 64]);
        // SAFETY: both buffers are this test's, declared before the endpoints and so dropped after them.
        let (a, b) = unsafe { registered_pair(&fabric, &mut src, &mut dst) };
        let (entered_tx, entered_rx) = crossbeam_channel::bounded::<()>(1);
        let (release_tx, release_rx) = crossbeam_channel::bounded::<()>(1);
        let owned = Mutex::new(Some(fabric.clone()));
        a.set_waker(Arc::new(move || {
            let _ = entered_tx.try_send(());
            let _ = release_rx.recv_timeout(Duration::from_secs(10));
            // Dropped here, on the worker thread, after every other handle is gone.
            lock(&owned).take();
        }));
        a.post(Op::Write, "b", &[whole(&mut src, &mut dst)], None).unwrap();
        entered_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        let watch = fabric.worker_watch();
        drop((a, b, fabric));
        assert!(watch.is_running());
        release_tx.send(()).unwrap();
        wait_until("the worker to exit", || !watch.is_running());
    }

    #[test]
    fn a_panicking_waker_does_not_stop_the_worker() {
        let fabric = Fabric::new();
        let (mut src, mut dst) = (vec![1u8; 64], vec![0u8; 64]);
        // SAFETY: both buffers are this test's, declared before the endpoints and so dropped after them.
        let (a, _b) = unsafe { registered_pair(&fabric, &mut src, &mut dst) };
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        a.set_waker(Arc::new(move || {
            seen.fetch_add(1, Ordering::SeqCst);
            panic!("waker bug");
        }));
        for _ in 0..3 {
            let id = a.post(Op::Write, "b", &[whole(&mut src, &mut dst)], None).unwrap();
            assert_eq!(wait(&a, id), Ok(XferState::Done));
        }
        wait_until("three waker calls", || calls.load(Ordering::SeqCst) == 3);
    }

    #[test]
    fn self_transfers_and_overlapping_ranges_are_memmove() {
        let fabric = Fabric::new();
        let a = fabric.endpoint("a").unwrap();
        a.load_remote(&a.local_metadata().unwrap()).unwrap();
        let mut buf: Vec<u8> = (0..=255).collect();
        // SAFETY: the region is a live buffer of this test that outlives the endpoint's use of it.
        unsafe { a.register(&region(&mut buf)) }.unwrap();
        let base = buf.as_mut_ptr() as u64;
        let id = a.post(Op::Write, "a", &[Desc { local: base, remote: base + 1, len: 100 }], Some(b"me")).unwrap();
        assert_eq!(wait(&a, id), Ok(XferState::Done));
        let expected: Vec<u8> = std::iter::once(0).chain(0..100).chain(101..=255).collect();
        assert_eq!(buf, expected);
        let mut notes = Vec::new();
        assert_eq!(a.take_notifications(&mut notes).unwrap(), 1);
        assert_eq!(notes[0].from, "a");
    }
}
