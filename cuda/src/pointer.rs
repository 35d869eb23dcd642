//! Validation and attribution of a KV tensor's address range, written against four driver queries.
//!
//! Read [`validate`]. It asks the driver (through [`PointerQueries`]) what the start address is —
//! memory type, managed or not, device ordinal — and which allocation holds it, and accepts the range
//! only if it is plain device memory of the claimed device lying wholly inside one allocation. The
//! logic depends only on the trait, so tests drive it with a mock of the driver (tests/cuda.rs) and
//! the real backend with `cuPointerGetAttribute` / `cuMemGetAddressRange` ([`crate::Gpu`]).
//!
//! This module never dereferences an address.

use crate::error::{CudaError, DriverStatus};

/// What `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` says an address is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryType {
    /// `CU_MEMORYTYPE_HOST`: page-locked host memory known to the driver.
    Host,
    /// `CU_MEMORYTYPE_DEVICE`: device memory.
    Device,
    /// `CU_MEMORYTYPE_ARRAY`: a CUDA array.
    Array,
    /// `CU_MEMORYTYPE_UNIFIED`: unified memory.
    Unified,
    /// A value this crate does not know.
    Other(u32),
}

impl MemoryType {
    /// From the driver's `CUmemorytype` value.
    pub fn from_raw(v: u32) -> Self {
        match v {
            1 => MemoryType::Host,
            2 => MemoryType::Device,
            3 => MemoryType::Array,
            4 => MemoryType::Unified,
            other => MemoryType::Other(other),
        }
    }
}

/// The driver queries validation needs. Implemented by [`crate::Gpu`] over the real driver and by
/// test mocks. Each returns the driver's status on failure.
pub trait PointerQueries {
    /// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE)`.
    fn memory_type(&self, addr: u64) -> Result<MemoryType, DriverStatus>;
    /// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_IS_MANAGED)`.
    fn is_managed(&self, addr: u64) -> Result<bool, DriverStatus>;
    /// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)`, in this process's numbering.
    fn device_ordinal(&self, addr: u64) -> Result<i32, DriverStatus>;
    /// `cuMemGetAddressRange`: base and size of the allocation holding `addr`.
    fn address_range(&self, addr: u64) -> Result<(u64, u64), DriverStatus>;
}

/// A validated range of device memory and where it lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PointerInfo {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Device ordinal (this process's numbering).
    pub device: u32,
    /// Base of the allocation holding the range.
    pub alloc_base: u64,
    /// Size of that allocation.
    pub alloc_len: u64,
}

fn driver(call: &'static str, device: Option<u32>, addr: u64, status: DriverStatus) -> CudaError {
    CudaError::Driver { call, status, device, detail: format!("address {addr:#x}") }
}

/// Accepts `[addr, addr + len)` if it is device memory of device `claimed`, inside one allocation.
///
/// Errors, in the order checked: [`CudaError::InvalidRange`] (null, empty, wrapping);
/// [`CudaError::NotDeviceMemory`] (the driver does not know the address, or it is host, array or
/// managed memory); [`CudaError::WrongDevice`]; [`CudaError::OutsideAllocation`]; a failing query
/// other than "unknown address" is a [`CudaError::Driver`] naming the call.
pub fn validate(q: &impl PointerQueries, addr: u64, len: u64, claimed: u32) -> Result<PointerInfo, CudaError> {
    if addr == 0 {
        return Err(CudaError::InvalidRange { addr, len, reason: "null address" });
    }
    if len == 0 {
        return Err(CudaError::InvalidRange { addr, len, reason: "empty range" });
    }
    let end = addr.checked_add(len).ok_or(CudaError::InvalidRange {
        addr,
        len,
        reason: "range wraps past the end of the address space",
    })?;
    let not_device = |reason: String| CudaError::NotDeviceMemory { addr, len, reason };
    let mem_type = match q.memory_type(addr) {
        Ok(t) => t,
        Err(s) if s.code == DriverStatus::INVALID_VALUE => {
            return Err(not_device(format!(
                "the driver does not know this address ({s} from cuPointerGetAttribute): ordinary host memory, \
                 freed memory, or memory of another process"
            )))
        }
        Err(s) => return Err(driver("cuPointerGetAttribute(MEMORY_TYPE)", None, addr, s)),
    };
    match mem_type {
        MemoryType::Device => {}
        MemoryType::Host => return Err(not_device("it is page-locked host memory (use the host device)".into())),
        MemoryType::Array => return Err(not_device("it is a CUDA array, not linear device memory".into())),
        MemoryType::Unified => return Err(not_device("it is unified memory".into())),
        MemoryType::Other(v) => return Err(not_device(format!("the driver reports memory type {v}"))),
    }
    if q.is_managed(addr).map_err(|s| driver("cuPointerGetAttribute(IS_MANAGED)", None, addr, s))? {
        return Err(not_device(
            "it is managed (cudaMallocManaged) memory, which can migrate to the host; register plain device memory"
                .into(),
        ));
    }
    let ordinal = q.device_ordinal(addr).map_err(|s| driver("cuPointerGetAttribute(DEVICE_ORDINAL)", None, addr, s))?;
    let actual = u32::try_from(ordinal)
        .map_err(|_| not_device(format!("the driver reports device ordinal {ordinal} for it")))?;
    if actual != claimed {
        return Err(CudaError::WrongDevice { addr, len, claimed, actual });
    }
    let (alloc_base, alloc_len) =
        q.address_range(addr).map_err(|s| driver("cuMemGetAddressRange", Some(actual), addr, s))?;
    let alloc_end = alloc_base.saturating_add(alloc_len);
    if addr < alloc_base || end > alloc_end {
        return Err(CudaError::OutsideAllocation { addr, len, alloc_base, alloc_len, device: actual });
    }
    Ok(PointerInfo { addr, len, device: actual, alloc_base, alloc_len })
}
