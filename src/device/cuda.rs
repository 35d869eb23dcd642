//! The CUDA device: kvpush's [`Device`] and [`Buffer`] over the `kvpush-cuda` crate (driver API
//! loaded at run time, so kvpush builds and runs without CUDA).
//!
//! Read [`CudaDevice`] first. [`Device::describe`] validates a framework's KV tensor pointer with
//! the driver — device memory, of this device, inside one allocation — and attributes it
//! ([`MemKind::Vram`], device ordinal) for registration with NIXL. [`CudaDevice::make_current`] is
//! the hook that makes the device's primary context current on the calling thread: call it before
//! the NIXL backend is created and on every thread that posts transfers of this memory (UCX's CUDA
//! transports use the current context). Errors of `kvpush-cuda` become [`DeviceError`]s that keep
//! their text (driver call, status, address, device).
//!
//! `KVPUSH_DEVICE=cuda` picks device `KVPUSH_CUDA_DEVICE` (default 0); without a driver it is a
//! clear [`DeviceError::Unavailable`], never a panic.
//!
//! [`CudaStager`] is the device's [`Stager`]: each gather or scatter copies its entry table to the
//! device and runs one kernel (`kvp_gather_table` / `kvp_scatter_table`) on the stager's stream, and
//! an event per lane says when it finished.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use kvpush_cuda::{CudaError, DeviceMem, Event, Gpu, Kernels, PinnedHost, Stream};

use super::stage::{check_entries, check_table, TableCheck, ENTRY_BYTES};
use super::{Access, Buffer, CopyOp, Device, DeviceError, DeviceKind, MemKind, MemRegion, StageEntry, Stager};

/// The environment variable naming the CUDA device ordinal `KVPUSH_DEVICE=cuda` opens (default 0).
pub const DEVICE_ENV: &str = "KVPUSH_CUDA_DEVICE";

/// The environment variable naming a PTX file of the staging kernels (`gpu_push --emit-ptx`), loaded
/// when NVRTC cannot be (as `gpu_push --ptx` does). Read when a process first loads the kernels for
/// a device.
pub const PTX_ENV: &str = "KVPUSH_CUDA_PTX";

/// A CUDA device (one ordinal, its primary context).
#[derive(Clone)]
pub struct CudaDevice {
    gpu: Arc<Gpu>,
    /// The stream of [`Device::copy`], made on first use; the lock keeps one batch of copies and its
    /// synchronize together.
    copies: Arc<Mutex<Option<Stream>>>,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice").field("gpu", &self.gpu).finish()
    }
}

impl CudaDevice {
    /// Opens device `ordinal` and makes its primary context current on this thread.
    pub fn open(ordinal: u32) -> Result<Self, CudaError> {
        Gpu::open(ordinal).map(|gpu| CudaDevice { gpu, copies: Arc::default() })
    }

    /// Opens the device named by `KVPUSH_CUDA_DEVICE` (default 0).
    pub fn from_env() -> Result<Self, DeviceError> {
        let unavailable =
            |why: String| DeviceError::Unavailable { requested: "cuda".into(), tried: vec![("cuda".into(), why)] };
        let ordinal = match std::env::var(DEVICE_ENV) {
            Ok(v) => v
                .trim()
                .parse::<u32>()
                .map_err(|_| unavailable(format!("{DEVICE_ENV}={v:?} is not a device ordinal")))?,
            Err(_) => 0,
        };
        Self::open(ordinal).map_err(|e| unavailable(e.to_string()))
    }

    /// Makes this device's context current on the calling thread. Call before creating the NIXL
    /// backend, and on each thread that posts transfers of this device's memory.
    pub fn make_current(&self) -> Result<(), DeviceError> {
        self.gpu.make_current().map_err(|e| DeviceError::Unavailable {
            requested: "cuda".into(),
            tried: vec![("cuda".into(), e.to_string())],
        })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> u32 {
        self.gpu.ordinal()
    }

    /// The `kvpush-cuda` device (kernels, streams).
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Allocates `len` zeroed bytes of device memory, as the concrete buffer type.
    pub fn alloc_cuda(&self, len: u64) -> Result<CudaBuffer, DeviceError> {
        let mem = self.gpu.alloc(len).map_err(|e| DeviceError::Alloc {
            device: DeviceKind::Cuda,
            len,
            reason: e.to_string(),
        })?;
        Ok(CudaBuffer { mem })
    }
}

impl Device for CudaDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cuda
    }

    fn alloc(&self, len: u64) -> Result<Box<dyn Buffer>, DeviceError> {
        Ok(Box::new(self.alloc_cuda(len)?))
    }

    /// Accepts device memory of this device lying inside one allocation (`cuPointerGetAttribute`,
    /// `cuMemGetAddressRange`); host, managed or another device's memory is refused with the reason.
    fn describe(&self, addr: u64, len: u64) -> Result<MemRegion, DeviceError> {
        let info = self.gpu.validate(addr, len).map_err(|e| DeviceError::NotDeviceMemory {
            device: DeviceKind::Cuda,
            addr,
            len,
            reason: e.to_string(),
        })?;
        Ok(MemRegion { addr: info.addr, len: info.len, kind: MemKind::Vram, dev_id: info.device })
    }

    /// Device memory: the CPU must not touch it; [`Device::copy`] moves it.
    fn access(&self) -> Access {
        Access::Device
    }

    /// Queues every op on the device's copy stream (`cuMemcpyAsync`, so either side may be host
    /// memory) and waits for the stream: every byte landed when this returns.
    unsafe fn copy(&self, ops: &[CopyOp]) -> Result<(), DeviceError> {
        let failed = |op: Option<&CopyOp>, e: CudaError| DeviceError::Copy {
            device: DeviceKind::Cuda,
            offset: op.map_or(0, |o| o.dst),
            len: op.map_or_else(|| ops.iter().map(|o| o.len).fold(0, u64::saturating_add), |o| o.len),
            reason: format!("in-process copy of {} ops: {e}", ops.len()),
        };
        // A poisoned lock only means another copier panicked; the stream is still sound.
        let mut stream = self.copies.lock().unwrap_or_else(|p| p.into_inner());
        if stream.is_none() {
            *stream = Some(Stream::new(&self.gpu).map_err(|e| failed(None, e))?);
        }
        let Some(stream) = stream.as_ref() else { return Ok(()) };
        let mut queued = Ok(());
        for op in ops {
            let len = usize::try_from(op.len).map_err(|_| {
                failed(Some(op), CudaError::Bounds { what: "copy", detail: format!("{} bytes", op.len) })
            })?;
            // SAFETY: `Device::copy`'s contract: both ranges are valid for the whole call and touched by
            // nothing else; the synchronize below returns only after the copy ran.
            if let Err(e) = unsafe { stream.copy(op.dst, op.src, len) } {
                queued = Err(failed(Some(op), e));
                break;
            }
        }
        // Wait even after a failed queue: copies queued before it may still run.
        let synced = stream.synchronize().map_err(|e| failed(None, e));
        queued.and(synced)
    }

    /// A [`CudaStager`] on this device (kernels loaded once per process and device).
    fn stager(&self, lanes: usize, max_entries: usize) -> Result<Option<Box<dyn Stager>>, DeviceError> {
        Ok(Some(Box::new(CudaStager::new(&self.gpu, lanes, max_entries)?)))
    }
}

/// Device memory kvpush owns; freed on drop.
pub struct CudaBuffer {
    mem: DeviceMem,
}

impl fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBuffer").field("mem", &self.mem).finish()
    }
}

impl CudaBuffer {
    /// The `kvpush-cuda` allocation (for kernels).
    pub fn mem(&self) -> &DeviceMem {
        &self.mem
    }
}

impl Buffer for CudaBuffer {
    fn region(&self) -> MemRegion {
        MemRegion { addr: self.mem.ptr(), len: self.mem.len(), kind: MemKind::Vram, dev_id: self.mem.gpu().ordinal() }
    }

    fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        self.mem.read(offset, out).map_err(|e| DeviceError::Copy {
            device: DeviceKind::Cuda,
            offset,
            len: out.len() as u64,
            reason: e.to_string(),
        })
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.mem.write(offset, data).map_err(|e| DeviceError::Copy {
            device: DeviceKind::Cuda,
            offset,
            len: data.len() as u64,
            reason: e.to_string(),
        })
    }
}

/// An operation's entries: decoded, or already in table form.
#[derive(Clone, Copy)]
enum Entries<'a> {
    List(&'a [StageEntry]),
    Table(&'a [u8]),
}

impl Entries<'_> {
    fn len(&self) -> usize {
        match self {
            Entries::List(l) => l.len(),
            Entries::Table(t) => t.len() / ENTRY_BYTES,
        }
    }

    /// Checks the entries as every operation must take them: aligned, and at most `max_entries`.
    fn check(&self, max_entries: usize) -> Result<(), DeviceError> {
        match *self {
            Entries::List(l) => check_entries(DeviceKind::Cuda, l, max_entries),
            Entries::Table(t) => check_table(DeviceKind::Cuda, t, max_entries).map(drop),
        }
    }

    /// Bytes the entries move (for error messages).
    fn bytes(&self) -> u64 {
        match self {
            Entries::List(l) => l.iter().map(|e| u64::from(e.len)).sum(),
            Entries::Table(t) => {
                t.chunks_exact(ENTRY_BYTES).map(|e| u64::from(u32::from_le_bytes([e[12], e[13], e[14], e[15]]))).sum()
            }
        }
    }
}

/// Staging copies on one GPU: table-driven gather and scatter kernels on one stream, one event and
/// one device-resident entry table per lane.
///
/// Operations of every lane run in the order they were started (one stream); [`Stager::write`] is
/// queued on the same stream, so the next operation sees it, and [`Stager::read`] waits for
/// everything queued before it.
pub struct CudaStager {
    gpu: Arc<Gpu>,
    kernels: Arc<Kernels>,
    stream: Stream,
    /// Snapshots of peers' tables ([`Stager::scatter_table`]), off the kernels' stream so that
    /// taking one does not wait for queued scatters.
    tables: Stream,
    lanes: Vec<Lane>,
    max_entries: usize,
}

/// One lane: its entry table in device memory, the page-locked host copy it is filled from (or read
/// into), and the event recorded after its last operation. Neither table is touched again before
/// the lane is done.
struct Lane {
    table: DeviceMem,
    host: PinnedHost,
    done: Event,
    /// Recorded on the tables' stream after a snapshot's copies ([`Stager::scatter_table`]).
    snapped: Event,
    /// A scatter whose snapshot is being taken: it is checked and launched once `snapped` is done.
    pending: Option<PendingScatter>,
}

/// A scatter waiting for its table's snapshot.
struct PendingScatter {
    n: usize,
    slot: u64,
    check: TableCheck,
}

impl fmt::Debug for CudaStager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaStager")
            .field("device", &self.gpu.ordinal())
            .field("lanes", &self.lanes.len())
            .field("max_entries", &self.max_entries)
            .finish_non_exhaustive()
    }
}

impl CudaStager {
    /// A stager of `lanes` lanes of at most `max_entries` entries each on `gpu`: loads the staging
    /// kernels (see [`PTX_ENV`]) unless this process has them loaded for this device, and allocates a
    /// stream, and per lane a `max_entries × 16`-byte device table and an event.
    pub fn new(gpu: &Arc<Gpu>, lanes: usize, max_entries: usize) -> Result<CudaStager, DeviceError> {
        let unavailable = |e: CudaError| DeviceError::Unavailable {
            requested: format!("cuda:{} staging", gpu.ordinal()),
            tried: vec![(format!("cuda:{}", gpu.ordinal()), e.to_string())],
        };
        let kernels = shared_kernels(gpu).map_err(unavailable)?;
        let stream = Stream::new(gpu).map_err(unavailable)?;
        let tables = Stream::new(gpu).map_err(unavailable)?;
        // Each lane's tables hold its entries and, for a gather, the receiver's table after them.
        let table_bytes = (max_entries.max(1) as u64).saturating_mul(2 * ENTRY_BYTES as u64);
        let lanes = (0..lanes)
            .map(|_| {
                let table = gpu.alloc(table_bytes).map_err(|e| DeviceError::Alloc {
                    device: DeviceKind::Cuda,
                    len: table_bytes,
                    reason: format!("staging table: {e}"),
                })?;
                let host = PinnedHost::new(gpu, table_bytes as usize).map_err(|e| DeviceError::Alloc {
                    device: DeviceKind::Cuda,
                    len: table_bytes,
                    reason: format!("page-locked staging table: {e}"),
                })?;
                Ok(Lane {
                    table,
                    host,
                    done: Event::new(gpu).map_err(unavailable)?,
                    snapped: Event::new(gpu).map_err(unavailable)?,
                    pending: None,
                })
            })
            .collect::<Result<_, DeviceError>>()?;
        Ok(CudaStager { gpu: Arc::clone(gpu), kernels, stream, tables, lanes, max_entries })
    }

    fn no_lane(&self, lane: usize) -> DeviceError {
        DeviceError::Copy {
            device: DeviceKind::Cuda,
            offset: 0,
            len: 0,
            reason: format!("staging lane {lane} does not exist (this stager has {} lanes)", self.lanes.len()),
        }
    }

    /// Queues the table gather (`gather`) or scatter kernel over the first `n` entries of `lane`'s
    /// device table and records the lane's event.
    ///
    /// # Safety
    ///
    /// The lane's device table holds those entries once the work queued so far on the kernels'
    /// stream ran, they are aligned, and the calling operation's contract holds for them.
    unsafe fn launch(&self, lane: usize, n: usize, slot: u64, gather: bool) -> Result<(), CudaError> {
        let l = &self.lanes[lane];
        // SAFETY: forwarded from this function's contract.
        unsafe {
            if gather {
                self.kernels.gather_table(&self.stream, &l.table, n as u64, slot)
            } else {
                self.kernels.scatter_table(&self.stream, &l.table, n as u64, slot)
            }
        }?;
        l.done.record(&self.stream)
    }

    /// Copies the entries to the lane's table (through its page-locked host table), then queues the
    /// table gather (`gather`) or scatter kernel over them and records the lane's event.
    ///
    /// # Safety
    ///
    /// The calling `gather` or `scatter`'s contract; the lane's previous operation is done (the
    /// caller's rule), so neither of its tables is still being read. The entries are checked here.
    unsafe fn run(
        &mut self,
        lane: usize,
        entries: Entries<'_>,
        slot: u64,
        gather: bool,
        extra: Option<(u64, &[u8])>,
    ) -> Result<(), DeviceError> {
        entries.check(self.max_entries)?;
        let what = if gather { "gather" } else { "scatter" };
        let n = entries.len();
        let failed = |e: CudaError| DeviceError::Copy {
            device: DeviceKind::Cuda,
            offset: 0,
            len: entries.bytes(),
            reason: format!("{what} of {n} entries on lane {lane}: {e}"),
        };
        if lane >= self.lanes.len() {
            return Err(self.no_lane(lane));
        }
        self.gpu.make_current().map_err(failed)?;
        let l = &mut self.lanes[lane];
        let mine = n * ENTRY_BYTES;
        let extra_len = extra.map_or(0, |(_, t)| t.len());
        if extra_len > l.host.len() - mine {
            return Err(failed(CudaError::Bounds {
                what: "staging table",
                detail: format!("{extra_len} table bytes after {mine} do not fit {} bytes", l.host.len()),
            }));
        }
        let host = l.host.as_mut_slice();
        match entries {
            Entries::List(list) => {
                for (chunk, e) in host.chunks_exact_mut(ENTRY_BYTES).zip(list) {
                    chunk.copy_from_slice(&e.to_bytes());
                }
            }
            Entries::Table(t) => host[..mine].copy_from_slice(t),
        }
        if let Some((_, t)) = extra {
            host[mine..mine + extra_len].copy_from_slice(t);
        }
        // SAFETY: the lane's tables hold `2 × max_entries × 16` bytes, `entries` passed
        // `Entries::check` (at most `max_entries`) and the extra table fits after them (checked); the
        // copy is queued on the kernels' stream after the lane's previous kernel, and the host table
        // is not written again before the lane is done (after the copy and the kernel ran).
        unsafe { self.stream.copy_to_device(l.table.ptr(), &l.host.as_slice()[..mine + extra_len]) }.map_err(failed)?;
        if let Some((to, _)) = extra {
            // SAFETY: the source is the lane's device table, just written by the copy queued before on
            // this stream; the destination is the caller's (`Stager::write`'s contract for `to`).
            unsafe { self.stream.copy_device(to, l.table.ptr() + mine as u64, extra_len) }.map_err(failed)?;
        }
        // SAFETY: the table holds these entries once the copy queued just before runs; they are
        // aligned (`Entries::check`); the KV and slot ranges they name are the caller's contract.
        unsafe { self.launch(lane, n, slot, gather) }.map_err(failed)
    }
}

impl Stager for CudaStager {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cuda
    }

    unsafe fn gather(&mut self, lane: usize, entries: &[StageEntry], slot: u64) -> Result<(), DeviceError> {
        // SAFETY: forwarded from `Stager::gather`'s contract; `run` checks the entries.
        unsafe { self.run(lane, Entries::List(entries), slot, true, None) }
    }

    unsafe fn gather_with_table(
        &mut self,
        lane: usize,
        local: &[u8],
        slot: u64,
        table_to: u64,
        table: &[u8],
    ) -> Result<(), DeviceError> {
        // SAFETY: forwarded from the contracts of `Stager::write` (for `table_to`) and
        // `Stager::gather`; `run` checks the entries.
        unsafe { self.run(lane, Entries::Table(local), slot, true, Some((table_to, table))) }
    }

    unsafe fn scatter(&mut self, lane: usize, entries: &[StageEntry], slot: u64) -> Result<(), DeviceError> {
        // SAFETY: forwarded from `Stager::scatter`'s contract; `run` checks the entries.
        unsafe { self.run(lane, Entries::List(entries), slot, false, None) }
    }

    unsafe fn scatter_table(
        &mut self,
        lane: usize,
        table_at: u64,
        n: usize,
        slot: u64,
        check: TableCheck,
    ) -> Result<(), DeviceError> {
        let failed = |e: String| DeviceError::Copy {
            device: DeviceKind::Cuda,
            offset: table_at,
            len: (n * ENTRY_BYTES) as u64,
            reason: format!("scatter of {n} entries on lane {lane}: {e}"),
        };
        if n > self.max_entries {
            return Err(failed(format!("at most {} entries per operation", self.max_entries)));
        }
        if lane >= self.lanes.len() {
            return Err(self.no_lane(lane));
        }
        let len = n * ENTRY_BYTES;
        let l = &mut self.lanes[lane];
        if l.pending.is_some() {
            return Err(failed("the lane is still taking a snapshot".into()));
        }
        // The snapshot: the peer's table into the lane's device table (device to device), and from
        // there into its page-locked host table, both queued on the tables' stream with an event
        // after them. Nothing waits here: `is_done` checks the host copy once the event is done and
        // only then queues the kernel, which reads the device copy. Neither copy is written by
        // anything outside this stager. Waiting here instead held the staging thread for every
        // piece until the GPU ran the copies (~290 µs a piece on one H200 shared with P's process).
        let host_at = l.host.as_mut_slice().as_mut_ptr() as u64;
        // SAFETY: `table_at..+len` is readable device memory (the caller's contract); the lane's
        // device table holds `max_entries × 16 ≥ len` bytes and no kernel reads it (the lane is done).
        unsafe { self.tables.copy_device(l.table.ptr(), table_at, len) }.map_err(|e| failed(e.to_string()))?;
        // SAFETY: the lane's device table is readable device memory written only by the copy just
        // queued before this one on the same stream; the lane's page-locked host table holds
        // `max_entries × 16 ≥ len` bytes, lives as long as the stager, and is read only after
        // `snapped` (recorded after this copy) is done.
        unsafe { self.tables.copy(host_at, l.table.ptr(), len) }.map_err(|e| failed(e.to_string()))?;
        l.snapped.record(&self.tables).map_err(|e| failed(e.to_string()))?;
        l.pending = Some(PendingScatter { n, slot, check });
        Ok(())
    }

    fn is_done(&mut self, lane: usize) -> Result<bool, DeviceError> {
        let lane_error = |e: String| DeviceError::Copy {
            device: DeviceKind::Cuda,
            offset: 0,
            len: 0,
            reason: format!("staging lane {lane}: {e}"),
        };
        let max_entries = self.max_entries;
        if lane >= self.lanes.len() {
            return Err(self.no_lane(lane));
        }
        let l = &mut self.lanes[lane];
        if l.pending.is_some() {
            if !l.snapped.is_done().map_err(|e| lane_error(e.to_string()))? {
                return Ok(false);
            }
            let Some(PendingScatter { n, slot, mut check }) = l.pending.take() else { return Ok(false) };
            let snapshot = &l.host.as_slice()[..n * ENTRY_BYTES];
            check(snapshot).map_err(|e| lane_error(format!("scatter of {n} entries refused: {e}")))?;
            check_table(DeviceKind::Cuda, snapshot, max_entries)?;
            // SAFETY: the device table holds the checked snapshot (its copies ran: `snapped` is
            // done); the contract of `scatter_table` covers every entry `check` accepted.
            unsafe { self.launch(lane, n, slot, false) }
                .map_err(|e| lane_error(format!("scatter of {n} entries: {e}")))?;
            return Ok(false);
        }
        l.done.is_done().map_err(|e| lane_error(e.to_string()))
    }

    unsafe fn read(&mut self, addr: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        // SAFETY: the caller guarantees `addr..addr + out.len()` is readable device memory of this
        // device; the copy is ordered after this stager's queued writes and operations.
        unsafe { self.stream.copy_from_device(addr, out) }.map_err(|e| DeviceError::Copy {
            device: DeviceKind::Cuda,
            offset: addr,
            len: out.len() as u64,
            reason: e.to_string(),
        })
    }

    unsafe fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), DeviceError> {
        // The caller's `data` may be page-locked memory, which the driver would read only when the
        // copy runs, after this call returned: copy from a pageable Vec of ours instead, whose bytes
        // the driver takes before returning.
        let own = data.to_vec();
        // SAFETY: the caller guarantees `addr..addr + data.len()` is writable device memory of this
        // device that nobody else accesses until the copy is seen; later operations of this stager
        // are queued after the copy on the same stream. `own` is pageable (see above).
        unsafe { self.stream.copy_to_device(addr, &own) }.map_err(|e| DeviceError::Copy {
            device: DeviceKind::Cuda,
            offset: addr,
            len: data.len() as u64,
            reason: e.to_string(),
        })
    }
}

impl Drop for CudaStager {
    fn drop(&mut self) {
        // Wait for queued work before the lanes' tables are freed: a running kernel may still read
        // them. A failure here (a sticky context error) leaves nothing running to wait for.
        let _ = self.stream.synchronize();
        let _ = self.tables.synchronize();
    }
}

/// The staging kernels of device `gpu`, loaded once per process and device while any stager holds
/// them: compiled with NVRTC for the device's architecture, or, where NVRTC cannot be loaded, read
/// from the PTX file named by [`PTX_ENV`].
fn shared_kernels(gpu: &Arc<Gpu>) -> Result<Arc<Kernels>, CudaError> {
    static LOADED: OnceLock<Mutex<HashMap<u32, Weak<Kernels>>>> = OnceLock::new();
    // A poisoned lock only means another thread panicked while loading; the map is still sound.
    let mut loaded = LOADED.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    if let Some(k) = loaded.get(&gpu.ordinal()).and_then(Weak::upgrade) {
        return Ok(k);
    }
    let kernels = match Kernels::load(gpu) {
        Ok(k) => k,
        Err(CudaError::Unavailable { library, reason }) => match std::env::var_os(PTX_ENV) {
            Some(path) => {
                let ptx = std::fs::read_to_string(&path).map_err(|e| CudaError::Bounds {
                    what: "reading the staging kernels' PTX",
                    detail: format!("{PTX_ENV}={}: {e}", path.to_string_lossy()),
                })?;
                Kernels::from_ptx(gpu, &ptx)?
            }
            None => {
                let reason = format!("{reason}; or set {PTX_ENV} to a PTX file of the kernels (gpu_push --emit-ptx)");
                return Err(CudaError::Unavailable { library, reason });
            }
        },
        Err(e) => return Err(e),
    };
    let kernels = Arc::new(kernels);
    loaded.insert(gpu.ordinal(), Arc::downgrade(&kernels));
    Ok(kernels)
}
