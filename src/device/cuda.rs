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

use std::fmt;
use std::sync::Arc;

use kvpush_cuda::{CudaError, DeviceMem, Gpu};

use super::{Buffer, Device, DeviceError, DeviceKind, MemKind, MemRegion};

/// The environment variable naming the CUDA device ordinal `KVPUSH_DEVICE=cuda` opens (default 0).
pub const DEVICE_ENV: &str = "KVPUSH_CUDA_DEVICE";

/// A CUDA device (one ordinal, its primary context).
#[derive(Clone)]
pub struct CudaDevice {
    gpu: Arc<Gpu>,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice").field("gpu", &self.gpu).finish()
    }
}

fn unavailable(e: CudaError) -> String {
    e.to_string()
}

impl CudaDevice {
    /// Opens device `ordinal` and makes its primary context current on this thread.
    pub fn open(ordinal: u32) -> Result<Self, String> {
        Gpu::open(ordinal).map(|gpu| CudaDevice { gpu }).map_err(unavailable)
    }

    /// Opens the device named by `KVPUSH_CUDA_DEVICE` (default 0).
    pub fn from_env() -> Result<Self, String> {
        let ordinal = match std::env::var(DEVICE_ENV) {
            Ok(v) => v.trim().parse::<u32>().map_err(|_| format!("{DEVICE_ENV}={v:?} is not a device ordinal"))?,
            Err(_) => 0,
        };
        Self::open(ordinal)
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
