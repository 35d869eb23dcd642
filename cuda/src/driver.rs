//! The CUDA driver, opened at run time: devices and their primary contexts, device memory, streams
//! and events.
//!
//! Read [`Gpu`] first. [`Gpu::open`] checks that the driver library can be loaded *before* any
//! driver call (cudarc panics on a missing library; this crate answers [`CudaError::Unavailable`]
//! instead), retains the device's primary context — the one PyTorch and every runtime-API user
//! shares — and makes it current on the calling thread. [`Gpu::make_current`] is the hook to call on
//! every other thread that touches device memory through a library (NIXL/UCX look at the current
//! context when a backend is created and when they post), before that library is used.
//!
//! Every raw driver call sits in an `unsafe` block with its justification; no cudarc type leaves
//! this module. `Drop` implementations never panic: a failed free is ignored (nothing can be done
//! about it and the process's context still owns the memory).

use std::ffi::c_void;
use std::fmt;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys, DriverError};

use crate::error::{CudaError, DriverStatus};
use crate::pointer::{self, MemoryType, PointerInfo, PointerQueries};

/// Converts cudarc's error into our status (number and driver name).
pub(crate) fn status(e: DriverError) -> DriverStatus {
    let code = e.0 as i32;
    let name = e.error_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("CUresult {code}"));
    DriverStatus { code, name }
}

pub(crate) fn drv(
    call: &'static str,
    device: Option<u32>,
    detail: impl Into<String>,
) -> impl FnOnce(DriverError) -> CudaError {
    let detail = detail.into();
    move |e| CudaError::Driver { call, status: status(e), device, detail }
}

/// Whether the CUDA driver library can be loaded and initialized in this process. The first call
/// decides; later calls return the same answer. Never panics.
pub fn driver_available() -> Result<(), CudaError> {
    static STATE: OnceLock<Result<(), CudaError>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            // SAFETY: only tries to dlopen the driver library under its usual names and closes it again;
            // no symbol is called.
            if !unsafe { sys::is_culib_present() } {
                return Err(CudaError::Unavailable {
                    library: "CUDA driver (libcuda.so)",
                    reason:
                        "no NVIDIA driver found: neither libcuda.so nor libcuda.so.1 can be opened (no GPU on this \
                             machine, or the driver's library directory is not on LD_LIBRARY_PATH)"
                            .into(),
                });
            }
            result::init().map_err(drv("cuInit", None, "initializing the driver"))
        })
        .clone()
}

/// Whether NVRTC (the run-time compiler for the staging kernels) can be loaded. Never panics.
pub fn nvrtc_available() -> Result<(), CudaError> {
    // SAFETY: only tries to dlopen libnvrtc under its usual names; no symbol is called.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::Unavailable {
            library: "NVRTC (libnvrtc.so)",
            reason: "libnvrtc.so / libnvrtc.so.13 cannot be opened: put the CUDA toolkit's lib64 directory (or the \
                     nvidia-cuda-nvrtc wheel's lib directory) on LD_LIBRARY_PATH"
                .into(),
        })
    }
}

/// Number of CUDA devices this process sees.
pub fn device_count() -> Result<u32, CudaError> {
    driver_available()?;
    let n = result::device::get_count().map_err(drv("cuDeviceGetCount", None, "counting devices"))?;
    Ok(n.max(0) as u32)
}

/// One CUDA device and its retained primary context.
pub struct Gpu {
    ordinal: u32,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    name: String,
    cc: (i32, i32),
    sms: u32,
}

// SAFETY: a CUcontext handle may be used from any thread (the driver API is thread-safe; making it
// current is per thread, which `make_current` does where needed). The other fields are plain data.
unsafe impl Send for Gpu {}
// SAFETY: as above; no method mutates the struct.
unsafe impl Sync for Gpu {}

impl fmt::Debug for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("compute_capability", &self.cc)
            .finish_non_exhaustive()
    }
}

impl Gpu {
    /// Opens device `ordinal` (this process's numbering), retains its primary context and makes it
    /// current on the calling thread.
    pub fn open(ordinal: u32) -> Result<Arc<Gpu>, CudaError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        let o = Some(ordinal);
        let dev = result::device::get(ordinal as i32).map_err(drv("cuDeviceGet", o, "getting the device"))?;
        let name = result::device::get_name(dev).map_err(drv("cuDeviceGetName", o, ""))?;
        let attr = |a: sys::CUdevice_attribute, what: &'static str| {
            // SAFETY: `dev` came from cuDeviceGet above.
            unsafe { result::device::get_attribute(dev, a) }.map_err(drv("cuDeviceGetAttribute", o, what))
        };
        let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "compute capability")?;
        let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "compute capability")?;
        let sms = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "multiprocessors")?;
        // SAFETY: `dev` came from cuDeviceGet; the retained context is released in Drop.
        let ctx = unsafe { result::primary_ctx::retain(dev) }.map_err(drv(
            "cuDevicePrimaryCtxRetain",
            o,
            "retaining the primary context",
        ))?;
        let gpu = Arc::new(Gpu { ordinal, dev, ctx, name, cc: (major, minor), sms: sms.max(1) as u32 });
        gpu.make_current()?;
        Ok(gpu)
    }

    /// Makes this device's primary context current on the calling thread.
    ///
    /// Call it before creating a NIXL backend that will register this device's memory, and on every
    /// thread that posts transfers of it: UCX's CUDA transports use the current context.
    pub fn make_current(&self) -> Result<(), CudaError> {
        // SAFETY: `self.ctx` is a retained primary context, valid until Drop.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(drv(
            "cuCtxSetCurrent",
            Some(self.ordinal),
            "making the primary context current",
        ))
    }

    /// Device ordinal (this process's numbering).
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The device's name, e.g. `NVIDIA H200`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Compute capability (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }

    /// Number of multiprocessors.
    pub fn multiprocessors(&self) -> u32 {
        self.sms
    }

    /// Validates that `[addr, addr + len)` is device memory of this device inside one allocation
    /// (see [`pointer::validate`]).
    pub fn validate(&self, addr: u64, len: u64) -> Result<PointerInfo, CudaError> {
        pointer::validate(self, addr, len, self.ordinal)
    }

    /// Allocates `len` bytes of device memory (`cuMemAlloc`), zeroed.
    pub fn alloc(self: &Arc<Self>, len: u64) -> Result<DeviceMem, CudaError> {
        if len == 0 {
            return Err(CudaError::Bounds { what: "cuMemAlloc", detail: "zero bytes".into() });
        }
        self.make_current()?;
        let o = Some(self.ordinal);
        // SAFETY: the context is current; the pointer is freed exactly once, in DeviceMem's Drop.
        let ptr = unsafe { result::malloc_sync(len as usize) }.map_err(drv("cuMemAlloc", o, format!("{len} bytes")))?;
        let mem = DeviceMem { gpu: Arc::clone(self), ptr, len };
        mem.memset(0)?;
        Ok(mem)
    }

    /// Waits until every stream of this context is idle.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.make_current()?;
        result::ctx::synchronize().map_err(drv("cuCtxSynchronize", Some(self.ordinal), ""))
    }

    fn attribute(&self, addr: u64, attr: sys::CUpointer_attribute) -> Result<u64, DriverStatus> {
        // Every attribute queried here is at most 8 bytes (an enum, a bool, an int): read into a
        // zeroed u64 and take the low bytes, whatever width the driver writes.
        let mut v: u64 = 0;
        // SAFETY: `v` is valid for 8 bytes of writes; the driver reads no memory at `addr`.
        unsafe { sys::cuPointerGetAttribute(&mut v as *mut u64 as *mut c_void, attr, addr) }
            .result()
            .map_err(status)?;
        Ok(v)
    }
}

impl PointerQueries for Gpu {
    fn memory_type(&self, addr: u64) -> Result<MemoryType, DriverStatus> {
        let v = self.attribute(addr, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE)?;
        Ok(MemoryType::from_raw(v as u32))
    }

    fn is_managed(&self, addr: u64) -> Result<bool, DriverStatus> {
        Ok(self.attribute(addr, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED)? & 0xff != 0)
    }

    fn device_ordinal(&self, addr: u64) -> Result<i32, DriverStatus> {
        Ok(self.attribute(addr, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)? as u32 as i32)
    }

    fn address_range(&self, addr: u64) -> Result<(u64, u64), DriverStatus> {
        self.make_current().map_err(|e| match e {
            CudaError::Driver { status, .. } => status,
            other => DriverStatus::new(-1, other.to_string()),
        })?;
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: both out-pointers are valid; the driver reads no memory at `addr`.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) }.result().map_err(status)?;
        Ok((base, size as u64))
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // SAFETY: releases the reference retained in `open`. An error cannot be acted upon here.
        let _ = unsafe { result::primary_ctx::release(self.dev) };
    }
}

/// Device memory kvpush owns (`cuMemAlloc`), freed on drop.
pub struct DeviceMem {
    gpu: Arc<Gpu>,
    ptr: u64,
    len: u64,
}

impl fmt::Debug for DeviceMem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceMem")
            .field("device", &self.gpu.ordinal)
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl DeviceMem {
    /// Device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Never true (allocations are at least one byte); for API symmetry.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    fn range(&self, what: &'static str, offset: u64, len: usize) -> Result<u64, CudaError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len => Ok(self.ptr + offset),
            _ => Err(CudaError::Bounds {
                what,
                detail: format!("{len} bytes at offset {offset} of a {}-byte allocation", self.len),
            }),
        }
    }

    /// Copies `data` to `offset` (synchronous).
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), CudaError> {
        let dst = self.range("copy to device", offset, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        self.gpu.make_current()?;
        // SAFETY: `[dst, dst + data.len())` lies in this live allocation (checked above); the copy is
        // synchronous, so `data` outlives it.
        unsafe { result::memcpy_htod_sync(dst, data) }.map_err(drv(
            "cuMemcpyHtoD",
            Some(self.gpu.ordinal),
            format!("{} bytes to {dst:#x}", data.len()),
        ))
    }

    /// Copies `out.len()` bytes from `offset` into `out` (synchronous).
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), CudaError> {
        let src = self.range("copy from device", offset, out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        self.gpu.make_current()?;
        let n = out.len();
        // SAFETY: `[src, src + n)` lies in this live allocation (checked above); the copy is synchronous.
        unsafe { result::memcpy_dtoh_sync(out, src) }.map_err(drv(
            "cuMemcpyDtoH",
            Some(self.gpu.ordinal),
            format!("{n} bytes from {src:#x}"),
        ))
    }

    /// Sets every byte to `value` (synchronous).
    pub fn memset(&self, value: u8) -> Result<(), CudaError> {
        self.gpu.make_current()?;
        // SAFETY: the whole live allocation; synchronous.
        unsafe { result::memset_d8_sync(self.ptr, value, self.len as usize) }.map_err(drv(
            "cuMemsetD8",
            Some(self.gpu.ordinal),
            format!("{} bytes at {:#x}", self.len, self.ptr),
        ))
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        if self.gpu.make_current().is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc in this context and is freed only here. An error cannot be
            // acted upon in Drop.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Page-locked host memory (`cuMemHostAlloc`), freed on drop: copies between it and the device run
/// asynchronously at full speed, where copies from pageable memory go through the driver's own
/// staging buffers.
pub struct PinnedHost {
    gpu: Arc<Gpu>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointer is owned memory that only this value hands out, through `&self`/`&mut self`
// borrows; the driver frees it in Drop.
unsafe impl Send for PinnedHost {}
// SAFETY: shared references only read (`as_slice`).
unsafe impl Sync for PinnedHost {}

impl fmt::Debug for PinnedHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedHost").field("device", &self.gpu.ordinal).field("len", &self.len).finish()
    }
}

impl PinnedHost {
    /// `len` bytes (at least one) of zeroed page-locked memory, usable with `gpu`'s context.
    pub fn new(gpu: &Arc<Gpu>, len: usize) -> Result<PinnedHost, CudaError> {
        let len = len.max(1);
        gpu.make_current()?;
        // SAFETY: the context is current; the pointer is freed exactly once, in Drop.
        let ptr = unsafe { result::malloc_host(len, 0) }.map_err(drv(
            "cuMemHostAlloc",
            Some(gpu.ordinal),
            format!("{len} bytes"),
        ))? as *mut u8;
        // SAFETY: `ptr` points at `len` freshly allocated bytes owned by this value.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(PinnedHost { gpu: Arc::clone(gpu), ptr, len })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is `len` initialized bytes owned by this value; writers need `&mut self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, for writing.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as for `as_slice`, and `&mut self` makes this the only borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (at least one byte); for API symmetry.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        if self.gpu.make_current().is_ok() {
            // SAFETY: `ptr` came from cuMemHostAlloc and is freed only here; no copy uses it any more
            // (owners wait for their streams before dropping it). An error cannot be acted upon here.
            let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
        }
    }
}

/// A driver object of one device's primary context — a stream or an event: the struct of the
/// device and the raw handle, `Send` and `Sync`, a `Debug` naming the device, and `new`, which makes
/// the context current and creates the handle with `$create` (driver call `$call`). What each does
/// with its handle, and how it is destroyed, stays with the type.
macro_rules! context_object {
    ($(#[$doc:meta])* $name:ident($raw:ty), $(#[$new_doc:meta])* new: $call:literal, $create:expr) => {
        $(#[$doc])*
        pub struct $name {
            gpu: Arc<Gpu>,
            raw: $raw,
        }

        // SAFETY: stream and event handles may be used from any thread; the driver serializes the
        // work queued on a stream.
        unsafe impl Send for $name {}
        // SAFETY: as above.
        unsafe impl Sync for $name {}

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_struct(stringify!($name)).field("device", &self.gpu.ordinal).finish_non_exhaustive()
            }
        }

        impl $name {
            $(#[$new_doc])*
            pub fn new(gpu: &Arc<Gpu>) -> Result<$name, CudaError> {
                gpu.make_current()?;
                let raw = $create.map_err(drv($call, Some(gpu.ordinal), ""))?;
                Ok($name { gpu: Arc::clone(gpu), raw })
            }
        }
    };
}

context_object!(
    /// A non-blocking stream of one device.
    Stream(sys::CUstream),
    /// Creates a stream that does not synchronize with the legacy default stream.
    new: "cuStreamCreate",
    result::stream::create(result::stream::StreamKind::NonBlocking)
);

impl Stream {
    /// Waits for all work queued on this stream.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.gpu.make_current()?;
        // SAFETY: `raw` is a live stream of this context.
        unsafe { result::stream::synchronize(self.raw) }.map_err(drv("cuStreamSynchronize", Some(self.gpu.ordinal), ""))
    }

    /// Queues a memset of `len` bytes at device address `ptr`.
    ///
    /// # Safety
    ///
    /// 1. `[ptr, ptr + len)` is live device memory of this stream's device until the memset ran;
    /// 2. nothing else reads or writes it meanwhile.
    pub unsafe fn memset(&self, ptr: u64, len: u64, value: u8) -> Result<(), CudaError> {
        self.gpu.make_current()?;
        // SAFETY: the caller's preconditions 1 and 2.
        unsafe { result::memset_d8_async(ptr, value, len as usize, self.raw) }.map_err(drv(
            "cuMemsetD8Async",
            Some(self.gpu.ordinal),
            format!("{len} bytes at {ptr:#x}"),
        ))
    }

    /// Queues a copy of `src` to device address `dst` (`cuMemcpyHtoDAsync`), ordered after the work
    /// queued so far on this stream.
    ///
    /// From pageable host memory (an ordinary Rust buffer) the driver takes the bytes before it
    /// returns — it stages them, waiting for the stream first if it must — so `src` may be dropped or
    /// reused at once. From page-locked memory it reads them later, while the copy runs.
    ///
    /// # Safety
    ///
    /// 1. `[dst, dst + src.len())` is live device memory of this stream's device, valid for writes
    ///    until the copy ran;
    /// 2. nothing else accesses that range until the copy ran, except work ordered after it;
    /// 3. where `src` is page-locked host memory, it stays valid and unchanged until the copy ran.
    pub unsafe fn copy_to_device(&self, dst: u64, src: &[u8]) -> Result<(), CudaError> {
        if src.is_empty() {
            return Ok(());
        }
        self.gpu.make_current()?;
        // SAFETY: the destination is writable device memory of this context that nobody else touches
        // until the copy ran (preconditions 1, 2); `src` is a live slice for the duration of the call,
        // and where the driver reads it after returning it stays valid (precondition 3; pageable
        // memory is staged before the call returns). `raw` is a live stream of the current context.
        unsafe { result::memcpy_htod_async(dst, src, self.raw) }.map_err(drv(
            "cuMemcpyHtoDAsync",
            Some(self.gpu.ordinal),
            format!("{} bytes to {dst:#x}", src.len()),
        ))
    }

    /// Copies `out.len()` bytes at device address `src` into `out` after the work queued so far on
    /// this stream (`cuMemcpyDtoHAsync`, then `cuStreamSynchronize`): returns when the bytes are in
    /// `out`, and sees every copy and kernel queued on this stream before the call.
    ///
    /// # Safety
    ///
    /// `[src, src + out.len())` is live device memory of this stream's device, valid for reads, and
    /// written meanwhile by nothing that is not ordered before this copy on this stream.
    pub unsafe fn copy_from_device(&self, src: u64, out: &mut [u8]) -> Result<(), CudaError> {
        if out.is_empty() {
            return Ok(());
        }
        self.gpu.make_current()?;
        let n = out.len();
        // SAFETY: the source is readable device memory of this context (the caller's precondition);
        // `out` is a live, exclusively borrowed buffer of `n` bytes, and the synchronize below
        // returns only once the copy has written it, so no write lands after `out`'s borrow ends (a
        // synchronize that fails reports a sticky context error, after which the stream runs no more
        // work). `raw` is a live stream of the current context.
        unsafe { result::memcpy_dtoh_async(out, src, self.raw) }.map_err(drv(
            "cuMemcpyDtoHAsync",
            Some(self.gpu.ordinal),
            format!("{n} bytes from {src:#x}"),
        ))?;
        self.synchronize()
    }

    /// Queues a copy of `len` bytes from device address `src` to `dst` (`cuMemcpyDtoDAsync`).
    ///
    /// # Safety
    ///
    /// Both ranges are live device memory of this stream's device; nothing writes the source or
    /// accesses the destination, other than work ordered on this stream, until the copy ran.
    pub unsafe fn copy_device(&self, dst: u64, src: u64, len: usize) -> Result<(), CudaError> {
        if len == 0 {
            return Ok(());
        }
        self.gpu.make_current()?;
        // SAFETY: the caller's contract; `raw` is a live stream of the current context.
        unsafe { result::memcpy_dtod_async(dst, src, len, self.raw) }.map_err(drv(
            "cuMemcpyDtoDAsync",
            Some(self.gpu.ordinal),
            format!("{len} bytes from {src:#x} to {dst:#x}"),
        ))
    }

    /// Queues a copy of `len` bytes from `src` to `dst` where either address may be device memory
    /// or host memory of this process (`cuMemcpyAsync`: with unified addressing the driver tells
    /// which from the address). From or to pageable host memory the driver may finish the copy before
    /// returning; call [`Stream::synchronize`] to know it landed.
    ///
    /// # Safety
    ///
    /// `src..src + len` is valid for reads and `dst..dst + len` for writes (device memory of this
    /// stream's context, or host memory of this process) until the copy ran; nothing writes the
    /// source or accesses the destination meanwhile other than work ordered on this stream.
    pub unsafe fn copy(&self, dst: u64, src: u64, len: usize) -> Result<(), CudaError> {
        if len == 0 {
            return Ok(());
        }
        self.gpu.make_current()?;
        // SAFETY: the caller's contract covers both ranges until the copy ran; `raw` is a live stream
        // of the current context.
        unsafe { sys::cuMemcpyAsync(dst, src, len, self.raw).result() }.map_err(drv(
            "cuMemcpyAsync",
            Some(self.gpu.ordinal),
            format!("{len} bytes from {src:#x} to {dst:#x}"),
        ))
    }

    pub(crate) fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// The device.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.gpu.make_current().is_ok() {
            // SAFETY: destroyed once, here; pending work still completes (driver semantics).
            let _ = unsafe { result::stream::destroy(self.raw) };
        }
    }
}

context_object!(
    /// An event without timing, to learn when queued work finished without blocking.
    Event(sys::CUevent),
    /// Creates an event (`CU_EVENT_DISABLE_TIMING`).
    new: "cuEventCreate",
    result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
);

impl Event {
    /// Records the event after the work queued so far on `stream`.
    pub fn record(&self, stream: &Stream) -> Result<(), CudaError> {
        self.gpu.make_current()?;
        // SAFETY: both handles are live and belong to the same context.
        unsafe { result::event::record(self.raw, stream.raw) }.map_err(drv("cuEventRecord", Some(self.gpu.ordinal), ""))
    }

    /// Whether the work before the last `record` finished (true also if never recorded).
    pub fn is_done(&self) -> Result<bool, CudaError> {
        // SAFETY: `raw` is a live event. Querying needs no current context.
        match unsafe { result::event::query(self.raw) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(drv("cuEventQuery", Some(self.gpu.ordinal), "")(e)),
        }
    }

    /// Blocks until the work before the last `record` finished.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: `raw` is a live event.
        unsafe { result::event::synchronize(self.raw) }.map_err(drv("cuEventSynchronize", Some(self.gpu.ordinal), ""))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: destroyed once, here.
        let _ = unsafe { result::event::destroy(self.raw) };
    }
}
