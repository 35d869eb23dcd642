//! The staging kernels — gather, scatter and a pattern fill — compiled at run time with NVRTC and
//! launched through the driver API.
//!
//! Read [`SOURCE`] for the kernels and [`crate::unitpack`] for the plan they follow. [`Kernels::load`]
//! compiles the source for the device's own architecture (`compute_XY` PTX, turned into machine code
//! by the driver at module load), so nothing is built ahead and no CUDA toolkit is needed at build
//! time; only `libnvrtc` at run time. [`compile_ptx`] alone needs no GPU, only NVRTC.
//!
//! Each kernel gives one warp one unit (a block of one region) at a time, moving it with 16-byte
//! loads and stores, four in flight per lane; the grid is a few waves of the device's multiprocessors
//! and loops over the units. Unit `u` lives at `bases[u / blocks] + ids[u % blocks] * stride`
//! ([`UnitTable`] holds `bases` and `ids` in device memory). The table kernels
//! ([`Kernels::gather_table`], [`Kernels::scatter_table`]) take their pieces from a device table of
//! 16-byte entries `{addr, off, len}` instead, one warp per entry, the same way.

use std::ffi::{c_void, CString};
use std::fmt;
use std::sync::Arc;

use cudarc::driver::{result, sys};
use cudarc::nvrtc::result as nvrtc;

use crate::driver::{drv, nvrtc_available, DeviceMem, Gpu, Stream};
use crate::error::CudaError;
use crate::unitpack::{Pack, Side, UnitSpace, ALIGN};

/// CUDA C source of the kernels. The pattern functions must stay identical to
/// [`crate::unitpack::mix64`], [`crate::unitpack::unit_seed`] and [`crate::unitpack::pattern_word`].
pub const SOURCE: &str = r#"
typedef unsigned long long u64;
typedef unsigned int u32;

__device__ __forceinline__ u64 kvp_mix64(u64 x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

// One warp copies n16 16-byte words; four loads in flight per lane.
__device__ __forceinline__ void kvp_copy_unit(const uint4* __restrict__ src, uint4* __restrict__ dst, u64 n16, u32 lane) {
    u64 i = lane;
    for (; i + 96 < n16; i += 128) {
        uint4 a = src[i], b = src[i + 32], c = src[i + 64], d = src[i + 96];
        dst[i] = a; dst[i + 32] = b; dst[i + 64] = c; dst[i + 96] = d;
    }
    for (; i < n16; i += 32) dst[i] = src[i];
}

__device__ __forceinline__ u64 kvp_unit_addr(const u64* __restrict__ bases, const u32* __restrict__ ids, u32 blocks, u64 stride, u64 u) {
    return bases[u / blocks] + (u64)ids[u % blocks] * stride;
}

extern "C" __global__ void kvp_gather(const u64* __restrict__ bases, const u32* __restrict__ ids, u32 blocks,
                                      u64 stride, u64 unit_bytes, u64 first_unit, u64 units, unsigned char* staging) {
    const u32 lane = threadIdx.x & 31;
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    const u64 n16 = unit_bytes >> 4;
    for (u64 k = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; k < units; k += warps) {
        const uint4* src = (const uint4*)kvp_unit_addr(bases, ids, blocks, stride, first_unit + k);
        kvp_copy_unit(src, (uint4*)(staging + k * unit_bytes), n16, lane);
    }
}

extern "C" __global__ void kvp_scatter(const u64* __restrict__ bases, const u32* __restrict__ ids, u32 blocks,
                                       u64 stride, u64 unit_bytes, u64 first_unit, u64 units, const unsigned char* staging) {
    const u32 lane = threadIdx.x & 31;
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    const u64 n16 = unit_bytes >> 4;
    for (u64 k = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; k < units; k += warps) {
        uint4* dst = (uint4*)kvp_unit_addr(bases, ids, blocks, stride, first_unit + k);
        kvp_copy_unit((const uint4*)(staging + k * unit_bytes), dst, n16, lane);
    }
}

// A staging table: n entries of 16 bytes, {u64 addr; u32 off; u32 len;} little endian, read as one
// uint4 (x, y: addr; z: off; w: len). Every address, offset and length is a multiple of 16 bytes.
__device__ __forceinline__ uint4 kvp_table_entry(const unsigned char* __restrict__ table, u64 k) {
    return ((const uint4*)table)[k];
}

// One warp per entry: copies len bytes from addr to slot + off.
extern "C" __global__ void kvp_gather_table(const unsigned char* __restrict__ table, u64 n, unsigned char* slot) {
    const u32 lane = threadIdx.x & 31;
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 k = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; k < n; k += warps) {
        const uint4 e = kvp_table_entry(table, k);
        const uint4* src = (const uint4*)((u64)e.x | ((u64)e.y << 32));
        kvp_copy_unit(src, (uint4*)(slot + e.z), (u64)(e.w >> 4), lane);
    }
}

// One warp per entry: copies len bytes from slot + off to addr.
extern "C" __global__ void kvp_scatter_table(const unsigned char* __restrict__ table, u64 n, unsigned char* slot) {
    const u32 lane = threadIdx.x & 31;
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 k = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; k < n; k += warps) {
        const uint4 e = kvp_table_entry(table, k);
        uint4* dst = (uint4*)((u64)e.x | ((u64)e.y << 32));
        kvp_copy_unit((const uint4*)(slot + e.z), dst, (u64)(e.w >> 4), lane);
    }
}

// Word w of unit (r, j) is (u32)(mix64(mix64(seed ^ (r << 32) ^ j) + w) >> 16).
extern "C" __global__ void kvp_fill(const u64* __restrict__ bases, const u32* __restrict__ ids, u32 blocks,
                                    u64 stride, u64 unit_bytes, u64 units, u64 seed) {
    const u32 lane = threadIdx.x & 31;
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    const u64 n16 = unit_bytes >> 4;
    for (u64 u = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; u < units; u += warps) {
        const u64 h = kvp_mix64(seed ^ ((u64)(u / blocks) << 32) ^ (u64)(u % blocks));
        uint4* dst = (uint4*)kvp_unit_addr(bases, ids, blocks, stride, u);
        for (u64 i = lane; i < n16; i += 32) {
            uint4 v;
            v.x = (u32)(kvp_mix64(h + 4 * i + 0) >> 16);
            v.y = (u32)(kvp_mix64(h + 4 * i + 1) >> 16);
            v.z = (u32)(kvp_mix64(h + 4 * i + 2) >> 16);
            v.w = (u32)(kvp_mix64(h + 4 * i + 3) >> 16);
            dst[i] = v;
        }
    }
}
"#;

const THREADS: u32 = 256;

/// The kernels of [`SOURCE`] that [`Kernels::from_ptx`] looks up: gather, scatter, fill, and the
/// table-driven gather and scatter.
const KERNEL_NAMES: [&str; 5] = ["kvp_gather", "kvp_scatter", "kvp_fill", "kvp_gather_table", "kvp_scatter_table"];

/// Bytes of one entry of a staging table (`{u64 addr; u32 off; u32 len;}`, little endian).
pub const TABLE_ENTRY_BYTES: u64 = 16;

/// Compiles [`SOURCE`] to PTX for `arch` (e.g. `compute_90`) with NVRTC. Needs no GPU.
pub fn compile_ptx(arch: &str) -> Result<String, CudaError> {
    nvrtc_available()?;
    let fail = |status: String, log: String| CudaError::Compile { arch: arch.into(), status, log };
    let src = CString::new(SOURCE).map_err(|e| fail("source".into(), e.to_string()))?;
    let prog =
        nvrtc::create_program(&src, Some(c"kvpush_staging.cu")).map_err(|e| fail(format!("{e:?}"), String::new()))?;
    let opts = [format!("--gpu-architecture={arch}"), "--std=c++17".to_owned()];
    // SAFETY: `prog` is a live program; `src` outlives it (destroyed below).
    let compiled = unsafe { nvrtc::compile_program(prog, &opts) };
    let out = match compiled {
        Ok(()) => {
            // SAFETY: `prog` compiled successfully.
            unsafe { nvrtc::get_ptx(prog) }.map_err(|e| fail(format!("{e:?}"), "nvrtcGetPTX failed".into()))
        }
        Err(e) => {
            // SAFETY: `prog` is live; the log exists after a failed compilation.
            let log = unsafe { nvrtc::get_program_log(prog) }
                .map(|l| c_chars_to_string(&l))
                .unwrap_or_else(|e| format!("(no log: {e:?})"));
            Err(fail(format!("{e:?}"), log))
        }
    };
    // SAFETY: destroyed once; nothing refers to it afterwards.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    Ok(c_chars_to_string(&out?))
}

fn c_chars_to_string(v: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = v.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// One side's unit addressing in device memory: region bases and block ids, reused between requests.
pub struct UnitTable {
    space: UnitSpace,
    stride: u64,
    bases: DeviceMem,
    ids: DeviceMem,
}

impl fmt::Debug for UnitTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnitTable").field("space", &self.space).field("stride", &self.stride).finish_non_exhaustive()
    }
}

impl UnitTable {
    /// A table for up to `max_regions` regions and `max_blocks` request blocks.
    pub fn new(gpu: &Arc<Gpu>, max_regions: u32, max_blocks: u32) -> Result<UnitTable, CudaError> {
        let bases = gpu.alloc(u64::from(max_regions.max(1)) * 8)?;
        let ids = gpu.alloc(u64::from(max_blocks.max(1)) * 4)?;
        Ok(UnitTable { space: UnitSpace { regions: 0, blocks: 0, unit_bytes: 0 }, stride: 0, bases, ids })
    }

    /// Loads one side of a request (synchronous copies of `bases` and `ids`).
    pub fn load(&mut self, space: UnitSpace, side: &Side<'_>) -> Result<(), CudaError> {
        side.check(&space).map_err(|e| CudaError::Bounds { what: "unit table", detail: e.to_string() })?;
        if u64::from(space.regions) * 8 > self.bases.len() || u64::from(space.blocks) * 4 > self.ids.len() {
            return Err(CudaError::Bounds {
                what: "unit table",
                detail: format!(
                    "{} regions × {} blocks exceed the table's capacity ({} × {})",
                    space.regions,
                    space.blocks,
                    self.bases.len() / 8,
                    self.ids.len() / 4
                ),
            });
        }
        let b: Vec<u8> = side.bases.iter().flat_map(|v| v.to_le_bytes()).collect();
        let i: Vec<u8> = side.ids.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.bases.write(0, &b)?;
        self.ids.write(0, &i)?;
        self.space = space;
        self.stride = side.stride;
        Ok(())
    }

    /// The loaded request's units.
    pub fn space(&self) -> UnitSpace {
        self.space
    }
}

/// The compiled kernels, loaded into one device's primary context.
pub struct Kernels {
    gpu: Arc<Gpu>,
    module: sys::CUmodule,
    gather: sys::CUfunction,
    scatter: sys::CUfunction,
    fill: sys::CUfunction,
    gather_table: sys::CUfunction,
    scatter_table: sys::CUfunction,
    grid_max: u32,
}

// SAFETY: module and function handles may be used from any thread.
unsafe impl Send for Kernels {}
// SAFETY: as above; launching takes `&self` and the driver serializes per stream.
unsafe impl Sync for Kernels {}

impl fmt::Debug for Kernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kernels").field("device", &self.gpu.ordinal()).finish_non_exhaustive()
    }
}

impl Kernels {
    /// Compiles the kernels for `gpu`'s architecture with NVRTC and loads them.
    pub fn load(gpu: &Arc<Gpu>) -> Result<Kernels, CudaError> {
        let (major, minor) = gpu.compute_capability();
        let ptx = compile_ptx(&format!("compute_{major}{minor}"))?;
        Kernels::from_ptx(gpu, &ptx)
    }

    /// Loads kernels from PTX compiled earlier (by [`compile_ptx`], for an architecture ≤ the device's).
    pub fn from_ptx(gpu: &Arc<Gpu>, ptx: &str) -> Result<Kernels, CudaError> {
        let o = Some(gpu.ordinal());
        let image = CString::new(ptx).map_err(|e| CudaError::Bounds { what: "PTX", detail: e.to_string() })?;
        gpu.make_current()?;
        // SAFETY: `image` is a NUL-terminated PTX text that outlives the call; the context is current.
        let module = unsafe { result::module::load_data(image.as_ptr() as *const c_void) }.map_err(drv(
            "cuModuleLoadData",
            o,
            "loading the staging kernels",
        ))?;
        let func = |name: &'static str| {
            let cname =
                CString::new(name).map_err(|e| CudaError::Bounds { what: "kernel name", detail: e.to_string() })?;
            // SAFETY: `module` was just loaded and is unloaded only in Drop.
            unsafe { result::module::get_function(module, cname) }.map_err(drv("cuModuleGetFunction", o, name))
        };
        let lookup = || -> Result<_, CudaError> {
            let [gather, scatter, fill, gather_table, scatter_table] = KERNEL_NAMES;
            Ok((func(gather)?, func(scatter)?, func(fill)?, func(gather_table)?, func(scatter_table)?))
        };
        let (gather, scatter, fill, gather_table, scatter_table) = match lookup() {
            Ok(fns) => fns,
            Err(e) => {
                // SAFETY: unloading the module loaded above, once; no function of it is kept.
                let _ = unsafe { result::module::unload(module) };
                return Err(e);
            }
        };
        Ok(Kernels {
            gpu: Arc::clone(gpu),
            module,
            gather,
            scatter,
            fill,
            gather_table,
            scatter_table,
            grid_max: gpu.multiprocessors() * 8,
        })
    }

    fn grid(&self, units: u64) -> u32 {
        let warps_per_block = u64::from(THREADS / 32);
        units.div_ceil(warps_per_block).clamp(1, u64::from(self.grid_max)) as u32
    }

    fn launch(
        &self,
        name: &'static str,
        f: sys::CUfunction,
        units: u64,
        stream: &Stream,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        if stream.gpu().ordinal() != self.gpu.ordinal() {
            return Err(CudaError::Bounds {
                what: name,
                detail: format!(
                    "stream of device {} for kernels of device {}",
                    stream.gpu().ordinal(),
                    self.gpu.ordinal()
                ),
            });
        }
        self.gpu.make_current()?;
        // SAFETY: `f` is a function of this loaded module; `params` points at one live value per kernel
        // parameter, of the kernel's parameter types, read by the driver during this call. Memory
        // validity is the caller's precondition (see the public unsafe fns).
        unsafe { result::launch_kernel(f, (self.grid(units), 1, 1), (THREADS, 1, 1), 0, stream.raw(), params) }
            .map_err(drv("cuLaunchKernel", Some(self.gpu.ordinal()), format!("{name} over {units} units")))
    }

    /// Queues the gather ([`Pack::Gather`]) of units `first_unit..first_unit + units` of `table` into
    /// `staging` at `offset`, packed, or their scatter ([`Pack::Scatter`]) from there to their places
    /// in `table`'s loaded side. The gather and the scatter kernels take the same parameters.
    ///
    /// # Safety
    ///
    /// 1. Every unit address of `table`'s loaded side is device memory of this device, valid for
    ///    `unit_bytes` of reads (gather) or writes (scatter) until the kernel finished;
    /// 2. gather: nothing writes those units or that part of `staging` while the kernel runs, and
    ///    nothing reads that part of `staging` before it finished (wait on an event recorded after
    ///    it); scatter: that part of `staging` holds the landed piece and is not written while the
    ///    kernel runs, and nothing else accesses the destination units meanwhile.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn pack(
        &self,
        pack: Pack,
        stream: &Stream,
        table: &UnitTable,
        first_unit: u64,
        units: u64,
        staging: &DeviceMem,
        offset: u64,
    ) -> Result<(), CudaError> {
        let sp = table.space;
        let bytes = units.checked_mul(sp.unit_bytes);
        let fits = first_unit.checked_add(units).is_some_and(|e| e <= sp.units())
            && bytes.and_then(|b| b.checked_add(offset)).is_some_and(|e| e <= staging.len())
            && offset.is_multiple_of(ALIGN);
        if !fits || sp.unit_bytes == 0 {
            return Err(CudaError::Bounds {
                what: "staging piece",
                detail: format!(
                    "units {first_unit}..+{units} of {} ({} bytes each) at offset {offset} of a {}-byte staging buffer",
                    sp.units(),
                    sp.unit_bytes,
                    staging.len()
                ),
            });
        }
        let (name, func) = match pack {
            Pack::Gather => ("kvp_gather", self.gather),
            Pack::Scatter => ("kvp_scatter", self.scatter),
        };
        // The calling contract covers the units and the staging piece (checked to fit above).
        self.launch_units(name, func, table, [first_unit, units, staging.ptr() + offset], units, stream)
    }

    /// Launches `func`, a kernel whose parameters are `table`'s unit addressing (`bases, ids, blocks,
    /// stride, unit_bytes`, as the kernels of [`SOURCE`] take them) followed by the `u64`s of `rest`,
    /// over `units` units.
    fn launch_units<const N: usize>(
        &self,
        name: &'static str,
        func: sys::CUfunction,
        table: &UnitTable,
        mut rest: [u64; N],
        units: u64,
        stream: &Stream,
    ) -> Result<(), CudaError> {
        let sp = table.space;
        let (mut bases, mut ids, mut blocks, mut stride, mut ub) =
            (table.bases.ptr(), table.ids.ptr(), sp.blocks, table.stride, sp.unit_bytes);
        let mut params = vec![
            &mut bases as *mut u64 as *mut c_void,
            &mut ids as *mut u64 as *mut c_void,
            &mut blocks as *mut u32 as *mut c_void,
            &mut stride as *mut u64 as *mut c_void,
            &mut ub as *mut u64 as *mut c_void,
        ];
        params.extend(rest.iter_mut().map(|v| v as *mut u64 as *mut c_void));
        self.launch(name, func, units, stream, &mut params)
    }

    /// Queues the gather of the `n` entries at the start of `table` into the slot at device address
    /// `slot`: entry `{addr, off, len}` (16 little-endian bytes: `addr` u64, `off` u32, `len` u32)
    /// copies `len` bytes from `addr` to `slot + off`. One warp moves one entry at a time.
    ///
    /// # Safety
    ///
    /// 1. When the kernel runs, `table`'s first `n` entries hold the intended entries (written
    ///    before this call, or by a copy queued on `stream` before it), and nothing writes them until
    ///    the kernel finished;
    /// 2. every entry's `addr`, `off` and `len` are multiples of 16 bytes;
    /// 3. every entry's `addr..addr + len` is device memory this device can read, valid until the
    ///    kernel finished, and `slot + off..slot + off + len` device memory it can write, valid as
    ///    long; no destination overlaps a source (destinations overlapping each other leave the
    ///    bytes they share unspecified);
    /// 4. nothing writes the sources or accesses the destination ranges while the kernel runs, and
    ///    nothing reads the destinations before it finished (wait on an event recorded after it).
    pub unsafe fn gather_table(&self, stream: &Stream, table: &DeviceMem, n: u64, slot: u64) -> Result<(), CudaError> {
        // SAFETY: forwarded from this function's contract (the table's entries, the readable
        // sources, the writable slot ranges, nothing else touching either meanwhile).
        unsafe { self.run_table("kvp_gather_table", self.gather_table, stream, table, n, slot) }
    }

    /// Queues the scatter of the slot at device address `slot` by the `n` entries at the start of
    /// `table`: entry `{addr, off, len}` copies `len` bytes from `slot + off` to `addr`.
    ///
    /// # Safety
    ///
    /// As for [`Kernels::gather_table`] with the directions swapped:
    /// 1. `table`'s first `n` entries hold the intended entries when the kernel runs and are not
    ///    written until it finished;
    /// 2. every entry's `addr`, `off` and `len` are multiples of 16 bytes;
    /// 3. every `slot + off..slot + off + len` is device memory this device can read and every
    ///    `addr..addr + len` device memory it can write, both valid until the kernel finished; no
    ///    destination overlaps a source (overlapping destinations leave the bytes they share
    ///    unspecified);
    /// 4. nothing writes the slot's ranges or accesses the destinations while the kernel runs, and
    ///    nothing reads the destinations before it finished.
    pub unsafe fn scatter_table(&self, stream: &Stream, table: &DeviceMem, n: u64, slot: u64) -> Result<(), CudaError> {
        // SAFETY: forwarded from this function's contract (directions swapped).
        unsafe { self.run_table("kvp_scatter_table", self.scatter_table, stream, table, n, slot) }
    }

    /// Checks the table's size and the slot's alignment and launches `func` (the table gather or
    /// scatter, which take the same parameters) over `n` entries. `n == 0` queues nothing.
    ///
    /// # Safety
    ///
    /// The calling `gather_table` or `scatter_table`'s contract.
    unsafe fn run_table(
        &self,
        name: &'static str,
        func: sys::CUfunction,
        stream: &Stream,
        table: &DeviceMem,
        n: u64,
        slot: u64,
    ) -> Result<(), CudaError> {
        let fits = n.checked_mul(TABLE_ENTRY_BYTES).is_some_and(|b| b <= table.len());
        if !fits || !slot.is_multiple_of(ALIGN) || table.gpu().ordinal() != self.gpu.ordinal() {
            return Err(CudaError::Bounds {
                what: name,
                detail: format!(
                    "{n} entries of {TABLE_ENTRY_BYTES} bytes in a {}-byte table of device {}, slot {slot:#x} \
                     ({ALIGN}-byte aligned slot on device {} needed)",
                    table.len(),
                    table.gpu().ordinal(),
                    self.gpu.ordinal()
                ),
            });
        }
        if n == 0 {
            return Ok(());
        }
        let (mut t, mut count, mut s) = (table.ptr(), n, slot);
        let mut params = [
            &mut t as *mut u64 as *mut c_void,
            &mut count as *mut u64 as *mut c_void,
            &mut s as *mut u64 as *mut c_void,
        ];
        self.launch(name, func, n, stream, &mut params)
    }

    /// Queues a fill of every unit of `table`'s loaded side with the pattern of its logical position
    /// ([`crate::unitpack::pattern_fill`] with `seed`).
    ///
    /// # Safety
    ///
    /// Every unit address of `table`'s loaded side is device memory of this device, valid for writes
    /// of `unit_bytes` and accessed by nothing else until the kernel finished.
    pub unsafe fn fill(&self, stream: &Stream, table: &UnitTable, seed: u64) -> Result<(), CudaError> {
        let sp = table.space;
        if sp.units() == 0 {
            return Err(CudaError::Bounds { what: "kvp_fill", detail: "no unit table loaded".into() });
        }
        // The calling contract covers every unit of the loaded side.
        self.launch_units("kvp_fill", self.fill, table, [sp.units(), seed], sp.units(), stream)
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        if self.gpu.make_current().is_ok() {
            // SAFETY: unloaded once, here; no launch can follow (we own the handles).
            let _ = unsafe { result::module::unload(self.module) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_looked_up_is_in_the_source() {
        assert!(KERNEL_NAMES.contains(&"kvp_gather_table") && KERNEL_NAMES.contains(&"kvp_scatter_table"));
        for name in KERNEL_NAMES {
            let decl = format!("extern \"C\" __global__ void {name}(");
            assert_eq!(
                SOURCE.matches(&decl).count(),
                1,
                "{name} is looked up by from_ptx but not defined once in SOURCE"
            );
        }
        // The table kernels take (table, n, slot), as `run_table` packs them.
        for name in ["kvp_gather_table", "kvp_scatter_table"] {
            let decl = format!("{name}(const unsigned char* __restrict__ table, u64 n, unsigned char* slot)");
            assert!(SOURCE.contains(&decl), "{name}'s parameters changed: {decl}");
        }
    }
}
