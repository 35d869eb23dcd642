//! The one error type of this crate: every variant names the driver call, the status, the device and
//! the address it concerns, so a failure read in a log says what to fix.
//!
//! Driver statuses are kept as their numeric `CUresult` plus the driver's own name for it
//! ([`DriverStatus`]); no cudarc type appears here, so callers need not depend on cudarc.

use std::fmt;

/// A CUDA driver status (`CUresult`): its number and the driver's name for it
/// (`CUDA_ERROR_INVALID_VALUE`, ...).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DriverStatus {
    /// The `CUresult` value.
    pub code: i32,
    /// The driver's name for it (`cuGetErrorName`), or `CUresult <n>` where the driver has none.
    pub name: String,
}

impl DriverStatus {
    /// `CUDA_ERROR_INVALID_VALUE`: what `cuPointerGetAttribute` answers for an address the driver
    /// does not know (ordinary host memory, freed memory).
    pub const INVALID_VALUE: i32 = 1;
    /// `CUDA_ERROR_NOT_INITIALIZED`.
    pub const NOT_INITIALIZED: i32 = 3;
    /// `CUDA_ERROR_NOT_READY`: an event or stream query whose work is still running.
    pub const NOT_READY: i32 = 600;

    /// A status with its name.
    pub fn new(code: i32, name: impl Into<String>) -> Self {
        DriverStatus { code, name: name.into() }
    }
}

impl fmt::Display for DriverStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name, self.code)
    }
}

/// What went wrong in the CUDA backend.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// The driver library (`libcuda.so.1`) or NVRTC cannot be loaded on this machine.
    #[error("{library} cannot be loaded: {reason}")]
    Unavailable {
        /// Which library (`"CUDA driver (libcuda.so)"`, `"NVRTC (libnvrtc.so)"`).
        library: &'static str,
        /// Why, and what to do about it.
        reason: String,
    },
    /// A driver call failed.
    #[error("{call} failed with {status}{}: {detail}", device.map(|d| format!(" on CUDA device {d}")).unwrap_or_default())]
    Driver {
        /// The driver call, e.g. `"cuMemAlloc"`.
        call: &'static str,
        /// Its status.
        status: DriverStatus,
        /// The device ordinal, when the call concerns one.
        device: Option<u32>,
        /// More context (sizes, addresses).
        detail: String,
    },
    /// A device ordinal that does not exist in this process.
    #[error("CUDA device {ordinal} does not exist: this process sees {count} device(s) (check CUDA_VISIBLE_DEVICES)")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: u32,
        /// Devices visible to this process.
        count: u32,
    },
    /// An address range that cannot describe memory at all (null, empty, wrapping).
    #[error("address range {addr:#x}+{len} is invalid: {reason}")]
    InvalidRange {
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
        /// Why.
        reason: &'static str,
    },
    /// The address is not CUDA device memory (host memory, managed memory, an array, freed memory).
    #[error("address range {addr:#x}+{len} is not CUDA device memory: {reason}")]
    NotDeviceMemory {
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
        /// What it is instead.
        reason: String,
    },
    /// Device memory, but of another device than the one claimed.
    #[error("address range {addr:#x}+{len} is memory of CUDA device {actual}, not of device {claimed}")]
    WrongDevice {
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
        /// The device the caller said it belongs to.
        claimed: u32,
        /// The device the driver says it belongs to.
        actual: u32,
    },
    /// The range starts in a device allocation but runs past its end.
    #[error(
        "address range {addr:#x}+{len} runs past the end of its CUDA allocation {alloc_base:#x}+{alloc_len} on device {device}"
    )]
    OutsideAllocation {
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
        /// The allocation's base address.
        alloc_base: u64,
        /// The allocation's size.
        alloc_len: u64,
        /// Its device.
        device: u32,
    },
    /// A host-side copy or launch argument out of bounds or misaligned.
    #[error("{what}: {detail}")]
    Bounds {
        /// Which operation.
        what: &'static str,
        /// The offending values.
        detail: String,
    },
    /// NVRTC failed to compile the kernels.
    #[error("NVRTC could not compile the kernels for {arch} ({status}): {log}")]
    Compile {
        /// Target architecture, e.g. `compute_90`.
        arch: String,
        /// NVRTC's status.
        status: String,
        /// The compiler's log.
        log: String,
    },
}
