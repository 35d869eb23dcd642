//! RAII over libnrt: a [`Runtime`] (owned or attached) and the [`Tensor`]s allocated from it.
//!
//! Read [`Runtime`] first. libnrt is one runtime per process. An *owned* runtime is started by
//! [`Runtime::init`] and closed when the last `Arc<Runtime>` goes (every [`Tensor`] holds one, so
//! tensors are always freed before the runtime closes); at most one owned runtime per library is
//! alive at a time. An *attached* runtime ([`Runtime::attach`]) is one a framework started: kvpush
//! allocates from it and never initialises nor closes it.
//!
//! `Drop` never fails or panics: `nrt_tensor_free` and `nrt_close` return nothing to report.

use std::ffi::{c_int, CString};
use std::fmt;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};

use crate::sys::{self, nrt_tensor_t};
use crate::{result, Error, Lib, Status};

/// Libraries (by path) with an owned runtime alive in this process.
static OWNED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// The libnrt version ([`Lib::version`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Version {
    /// Major.
    pub major: u64,
    /// Minor.
    pub minor: u64,
    /// Patch.
    pub patch: u64,
    /// Maintenance.
    pub maintenance: u64,
    /// Free-form detail the library reports.
    pub detail: String,
    /// The library's git hash.
    pub git_hash: String,
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}.{}", self.major, self.minor, self.patch, self.maintenance)?;
        if !self.detail.is_empty() {
            write!(f, " ({})", self.detail)?;
        }
        Ok(())
    }
}

/// Where a tensor's memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Device memory (HBM) of a NeuronCore.
    Device,
    /// Host memory managed by libnrt.
    Host,
}

/// A Neuron runtime this process uses, owned or attached (see the module docs).
pub struct Runtime {
    lib: Arc<Lib>,
    owned: bool,
}

impl Runtime {
    /// Starts the runtime (`nrt_init`, framework-less) and owns it: it is closed when the last
    /// handle (including every tensor's) is dropped.
    ///
    /// Fails with [`Error::AlreadyOwned`] while another owned runtime of the same library is alive
    /// in this process, and with `nrt_init`'s status (for instance when a framework already started
    /// the runtime: attach to it instead).
    pub fn init(lib: Arc<Lib>) -> Result<Arc<Runtime>, Error> {
        let mut owned = OWNED.lock().unwrap_or_else(PoisonError::into_inner);
        if owned.iter().any(|p| p == lib.path()) {
            return Err(Error::AlreadyOwned { library: lib.path().to_owned() });
        }
        // SAFETY: no owned runtime of this library is alive (checked under the lock, which is held
        // until the path is recorded); a framework that started it makes nrt_init fail, which is
        // reported, not ignored.
        unsafe { result::init(&lib, sys::NRT_FRAMEWORK_TYPE_NO_FW, c"", c"") }?;
        owned.push(lib.path().to_owned());
        Ok(Arc::new(Runtime { lib, owned: true }))
    }

    /// Uses the runtime a framework in this process already started. Nothing is called now; calls
    /// made before the framework's `nrt_init` fail with `NRT_UNINITIALIZED`. Never closes it.
    pub fn attach(lib: Arc<Lib>) -> Arc<Runtime> {
        Arc::new(Runtime { lib, owned: false })
    }

    /// Whether this handle started the runtime and will close it.
    pub fn is_owned(&self) -> bool {
        self.owned
    }

    /// The library.
    pub fn lib(&self) -> &Arc<Lib> {
        &self.lib
    }

    /// Allocates a tensor of `size` bytes on NeuronCore `core` (device placement) or in host memory
    /// managed by libnrt (host placement; `core` is ignored), named `name` (for libnrt's own tools).
    pub fn allocate(
        self: &Arc<Self>,
        placement: Placement,
        core: u32,
        size: usize,
        name: &str,
    ) -> Result<Tensor, Error> {
        let bad = |reason: String| Error::BadArgument { call: "nrt_tensor_allocate", reason };
        let cname = CString::new(name).map_err(|_| bad(format!("tensor name {name:?} contains a NUL byte")))?;
        let (p, vnc) = match placement {
            Placement::Device => {
                let vnc = c_int::try_from(core).map_err(|_| bad(format!("core {core} does not fit in a C int")))?;
                (sys::NRT_TENSOR_PLACEMENT_DEVICE, vnc)
            }
            Placement::Host => (sys::NRT_TENSOR_PLACEMENT_HOST, -1),
        };
        // SAFETY: the runtime outlives the call (we hold an Arc to it) and an owned runtime is only
        // closed when the last Arc goes; an attached one is the framework's to keep open.
        let raw = unsafe { result::tensor_allocate(&self.lib, p, vnc, size, &cname) }?;
        // SAFETY: `raw` was just allocated by this library and is live.
        let actual = match unsafe { result::tensor_size(&self.lib, raw) } {
            Ok(n) => n,
            Err(e) => {
                // SAFETY: `raw` is ours, live, and not used after this.
                let _ = unsafe { result::tensor_free(&self.lib, raw) };
                return Err(e);
            }
        };
        Ok(Tensor {
            rt: Arc::clone(self),
            raw,
            size: actual,
            placement,
            core: (placement == Placement::Device).then_some(core),
            io: Mutex::new(()),
        })
    }

    /// The dma-buf fd of the device range `[va, va + size)` (`nrt_get_dmabuf_fd`, optional), for
    /// EFA peer-direct registration. The range must lie in a live device allocation (libnrt checks).
    pub fn dmabuf_fd(&self, va: u64, size: u64) -> Result<OwnedFd, Error> {
        // SAFETY: libnrt validates the range against its allocations and fails otherwise; the runtime
        // is alive as long as `self`.
        unsafe { result::dmabuf_fd(&self.lib, va, size) }
    }

    /// The PCI address of the EFA device attached to the Neuron device holding `va`
    /// (`nrt_get_attached_efa_bdf`, optional).
    pub fn attached_efa_bdf(&self, va: u64) -> Result<String, Error> {
        // SAFETY: libnrt only looks `va` up in its allocations and fails when it is not one of them.
        unsafe { result::attached_efa_bdf(&self.lib, va) }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        // SAFETY: this runtime was started by `init`, and this is its last handle: every tensor
        // holds one, so none is alive.
        let _ = unsafe { result::close(&self.lib) };
        OWNED.lock().unwrap_or_else(PoisonError::into_inner).retain(|p| p != self.lib.path());
    }
}

impl fmt::Debug for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runtime").field("library", &self.lib.path()).field("owned", &self.owned).finish()
    }
}

/// A tensor allocated by kvpush from a [`Runtime`]; freed on drop.
///
/// Copies in and out ([`Tensor::read_at`], [`Tensor::write_at`]) are bounds-checked here and
/// serialized with each other per tensor.
pub struct Tensor {
    rt: Arc<Runtime>,
    raw: NonNull<nrt_tensor_t>,
    size: usize,
    placement: Placement,
    core: Option<u32>,
    /// Serializes copies through libnrt on this tensor. Guards no data; poisoning is ignored.
    io: Mutex<()>,
}

// SAFETY: a tensor handle is an opaque pointer to libnrt's bookkeeping, which libnrt lets any
// thread use (frameworks call it from many threads); our own copies on one tensor are serialized by
// `io`, and the handle is freed exactly once, in `Drop`.
unsafe impl Send for Tensor {}
// SAFETY: as for `Send`: `&Tensor` only allows reads of immutable fields and libnrt calls
// serialized by `io`.
unsafe impl Sync for Tensor {}

impl Tensor {
    /// Size in bytes (as libnrt reports it).
    pub fn size(&self) -> usize {
        self.size
    }

    /// Where the memory lives.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// The NeuronCore of a device tensor.
    pub fn core(&self) -> Option<u32> {
        self.core
    }

    /// The runtime this tensor belongs to.
    pub fn runtime(&self) -> &Arc<Runtime> {
        &self.rt
    }

    /// The raw handle, valid while `self` lives (for registering it elsewhere).
    pub fn as_raw(&self) -> NonNull<nrt_tensor_t> {
        self.raw
    }

    /// The virtual address of the memory in this process, or `None` where libnrt has not mapped
    /// it (device memory without `NEURON_RT_MAP_HBM=1`).
    pub fn va(&self) -> Result<Option<u64>, Error> {
        // SAFETY: `raw` is live while `self` is.
        Ok(unsafe { result::tensor_va(&self.rt.lib, self.raw) }?.map(|p| p.as_ptr() as u64))
    }

    fn check_range(&self, call: &'static str, offset: u64, len: usize) -> Result<usize, Error> {
        let end = offset.checked_add(len as u64);
        match (usize::try_from(offset), end) {
            (Ok(off), Some(end)) if end <= self.size as u64 => Ok(off),
            _ => Err(Error::BadArgument {
                call,
                reason: format!("{len} bytes at offset {offset} are out of range of a tensor of {} bytes", self.size),
            }),
        }
    }

    /// Copies `out.len()` bytes from `offset` into `out` (`nrt_tensor_read`).
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        let off = self.check_range("nrt_tensor_read", offset, out.len())?;
        let _io = self.io.lock().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: `raw` is live while `self` is; the range was checked against its size.
        unsafe { result::tensor_read(&self.rt.lib, self.raw, off, out) }
    }

    /// Copies `data` to `offset` (`nrt_tensor_write`).
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        let off = self.check_range("nrt_tensor_write", offset, data.len())?;
        let _io = self.io.lock().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: `raw` is live while `self` is; the range was checked against its size.
        unsafe { result::tensor_write(&self.rt.lib, self.raw, off, data) }
    }

    /// Sets every byte to zero: `nrt_tensor_memset` where the library has it, else writes of a
    /// zeroed chunk.
    pub fn zero(&self) -> Result<(), Error> {
        let _io = self.io.lock().unwrap_or_else(PoisonError::into_inner);
        if self.rt.lib.supports("nrt_tensor_memset") {
            // SAFETY: `raw` is live while `self` is; the whole tensor is in range.
            return unsafe { result::tensor_memset(&self.rt.lib, self.raw, 0, 0, self.size) };
        }
        const CHUNK: usize = 1 << 20;
        let zeros = vec![0u8; CHUNK.min(self.size)];
        let mut off = 0;
        while off < self.size {
            let n = CHUNK.min(self.size - off);
            // SAFETY: `raw` is live while `self` is; `[off, off + n)` lies inside the tensor.
            unsafe { result::tensor_write(&self.rt.lib, self.raw, off, &zeros[..n]) }?;
            off += n;
        }
        Ok(())
    }

    /// The dma-buf fd of the whole tensor (device placement; see [`Runtime::dmabuf_fd`]).
    pub fn dmabuf_fd(&self) -> Result<OwnedFd, Error> {
        let va = self.mapped_va("nrt_get_dmabuf_fd")?;
        self.rt.dmabuf_fd(va, self.size as u64)
    }

    /// The PCI address of the EFA device attached to this tensor's Neuron device.
    pub fn attached_efa_bdf(&self) -> Result<String, Error> {
        let va = self.mapped_va("nrt_get_attached_efa_bdf")?;
        self.rt.attached_efa_bdf(va)
    }

    fn mapped_va(&self, call: &'static str) -> Result<u64, Error> {
        self.va()?.ok_or_else(|| Error::BadArgument {
            call,
            reason: "the tensor has no virtual address in this process (nrt_tensor_get_va returned NULL; \
                     NEURON_RT_MAP_HBM=1 maps device memory)"
                .into(),
        })
    }
}

impl Drop for Tensor {
    fn drop(&mut self) {
        // SAFETY: `raw` was allocated by this runtime's library, is freed only here, and the runtime
        // is still alive (we hold an Arc to it, dropped after this).
        let _ = unsafe { result::tensor_free(&self.rt.lib, self.raw) };
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("size", &self.size)
            .field("placement", &self.placement)
            .field("core", &self.core)
            .field("va", &self.va().ok().flatten().map(|v| format!("{v:#x}")))
            .finish()
    }
}

/// Whether `status` means the runtime is not (or no longer) running: the answer libnrt gives to
/// calls made before `nrt_init` or after `nrt_close`.
pub fn is_not_running(status: Status) -> bool {
    status == Status::UNINITIALIZED || status == Status::CLOSED
}
