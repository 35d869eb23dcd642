//! Devices: the memory KV caches live in, and how kvpush describes it to a transport.
//!
//! Read [`Device`] first. A device validates and attributes memory the framework allocated
//! ([`Device::describe`]: which kind of memory, which device ordinal), allocates memory kvpush owns
//! (benches and the demo: [`Device::alloc`] returns an RAII [`Buffer`]), and copies bytes in and out of
//! its memory for verification. Backends: [`host`] (DRAM through memmap2: anonymous or file-backed
//! mappings), [`mock`] (host memory presented as device memory, with fault injection, for tests),
//! [`neuron`] (AWS Neuron device memory through libnrt, loaded at run time by `neuron/neuron-sys`)
//! and [`cuda`] (NVIDIA GPU memory, validated through the driver API of `cuda/`'s `kvpush-cuda`, loaded
//! at run time).
//!
//! [`select`] picks a backend from `KVPUSH_DEVICE=auto|neuron|cuda|host|mock`; an unknown value or a
//! backend that is not available is an error naming everything that was tried and why it failed.
//! Vendor types never leave a backend module.

use std::fmt;
use std::sync::Arc;

pub mod bounce;
pub mod cuda;
pub mod host;
pub mod host_stage;
pub mod mock;
pub mod neuron;
pub mod stage;

pub use stage::{BadEntry, StageEntry, Stager};

/// Kind of memory, as a transport registers it (NIXL's DRAM_SEG / VRAM_SEG).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemKind {
    /// Host memory.
    Dram,
    /// Accelerator memory (GPU HBM, Neuron HBM).
    Vram,
}

/// A validated, attributed memory range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MemRegion {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Kind of memory.
    pub kind: MemKind,
    /// Device ordinal (0 for host memory).
    pub dev_id: u32,
}

impl MemRegion {
    /// Whether `[addr, addr + len)` lies inside this region.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr && addr.checked_add(len).is_some_and(|end| end <= self.addr + self.len)
    }
}

/// Registered regions, kept sorted by start address so that finding the one holding a range is a
/// binary search. A staged piece checks every one of its thousands of entries against them, and a
/// vLLM model registers a region per layer (two with separate K and V), so a scan per entry costs
/// regions × entries comparisons (128 × 8192 for a 32 MiB piece of 4 KiB blocks).
#[derive(Clone, Debug, Default)]
pub struct RegionSet {
    sorted: Vec<MemRegion>,
}

impl RegionSet {
    /// Adds `region`.
    pub fn insert(&mut self, region: MemRegion) {
        let i = self.sorted.partition_point(|r| r.addr <= region.addr);
        self.sorted.insert(i, region);
    }

    /// Removes every copy of `region`.
    pub fn remove(&mut self, region: &MemRegion) {
        self.sorted.retain(|r| r != region);
    }

    /// The region holding all of `[addr, addr + len)`. Regions do not overlap in practice; where
    /// they do, a range the binary search misses is looked for in every region.
    pub fn find(&self, addr: u64, len: u64) -> Option<&MemRegion> {
        let i = self.sorted.partition_point(|r| r.addr <= addr).checked_sub(1);
        i.map(|i| &self.sorted[i])
            .filter(|r| r.contains(addr, len))
            .or_else(|| self.sorted.iter().find(|r| r.contains(addr, len)))
    }

    /// The regions, by start address.
    pub fn iter(&self) -> impl Iterator<Item = &MemRegion> {
        self.sorted.iter()
    }
}

/// Which backend a device is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// AWS Neuron (Trainium, Inferentia).
    Neuron,
    /// NVIDIA CUDA.
    Cuda,
    /// Host DRAM.
    Host,
    /// Host memory posing as a device, with fault injection.
    Mock,
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceKind::Neuron => "neuron",
            DeviceKind::Cuda => "cuda",
            DeviceKind::Host => "host",
            DeviceKind::Mock => "mock",
        })
    }
}

/// What went wrong with a device.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// `KVPUSH_DEVICE` names no backend.
    #[error(
        "unknown device {value:?} in KVPUSH_DEVICE (expected one of auto, neuron, cuda, cuda:<ordinal>, host, mock)"
    )]
    Unknown {
        /// The value given.
        value: String,
    },
    /// The requested backend (or, for `auto`, every backend) is not available.
    #[error("device {requested} is not available: {}", tried.iter().map(|(n, why)| format!("{n}: {why}")).collect::<Vec<_>>().join("; "))]
    Unavailable {
        /// What was asked for.
        requested: String,
        /// Every backend tried, with the reason it failed.
        tried: Vec<(String, String)>,
    },
    /// An allocation failed.
    #[error("{device}: cannot allocate {len} bytes: {reason}")]
    Alloc {
        /// Backend.
        device: DeviceKind,
        /// Bytes asked for.
        len: u64,
        /// Why.
        reason: String,
    },
    /// A pointer is not memory of this device (or not of the ordinal claimed).
    #[error("{device}: address range {addr:#x}+{len} is not memory of this device: {reason}")]
    NotDeviceMemory {
        /// Backend.
        device: DeviceKind,
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
        /// Why.
        reason: String,
    },
    /// A copy in or out of device memory failed or was out of bounds.
    #[error("{device}: copy of {len} bytes at offset {offset} failed: {reason}")]
    Copy {
        /// Backend.
        device: DeviceKind,
        /// Offset in the buffer.
        offset: u64,
        /// Bytes.
        len: u64,
        /// Why.
        reason: String,
    },
    /// A fault injected by the mock backend.
    #[error("{device}: injected fault: {what}")]
    Injected {
        /// Backend.
        device: DeviceKind,
        /// Which operation.
        what: &'static str,
    },
}

/// Memory owned by kvpush on some device; freed on drop.
pub trait Buffer: Send + Sync + fmt::Debug {
    /// The memory, as a transport registers it.
    fn region(&self) -> MemRegion;
    /// Copies `out.len()` bytes from `offset` into `out`.
    fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), DeviceError>;
    /// Copies `data` to `offset`.
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), DeviceError>;
}

/// Who can copy a device's memory inside this process ([`Device::access`]): what an in-process
/// transport ([`crate::transport::loopback`]) needs to know before it moves the memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// The CPU loads and stores the memory at the addresses the device gives (host memory; the
    /// mock's host memory posing as device memory; Neuron HBM mapped into the process).
    Cpu,
    /// Only the device moves it: [`Device::copy`] (CUDA device memory).
    Device,
    /// Nothing in this process can copy it.
    None,
}

/// One copy of [`Device::copy`]: `len` bytes from address `src` to address `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CopyOp {
    /// Destination address.
    pub dst: u64,
    /// Source address.
    pub src: u64,
    /// Bytes.
    pub len: u64,
}

/// A memory backend. Implementations are internally synchronized.
pub trait Device: Send + Sync + fmt::Debug {
    /// Which backend this is.
    fn kind(&self) -> DeviceKind;
    /// Allocates `len` bytes (zeroed) that kvpush owns.
    fn alloc(&self, len: u64) -> Result<Box<dyn Buffer>, DeviceError>;
    /// Validates that `[addr, addr + len)` is memory of this device and attributes it.
    fn describe(&self, addr: u64, len: u64) -> Result<MemRegion, DeviceError>;
    /// A [`Stager`] running gathers and scatters on `lanes` lanes of at most `max_entries` entries
    /// each, or `None` where this device has none (the staged transport then posts directly).
    fn stager(&self, lanes: usize, max_entries: usize) -> Result<Option<Box<dyn Stager>>, DeviceError> {
        let _ = (lanes, max_entries);
        Ok(None)
    }
    /// Who can copy this device's memory inside this process. The default, [`Access::None`], makes
    /// an in-process transport refuse the memory instead of touching it.
    fn access(&self) -> Access {
        Access::None
    }
    /// Copies every `op` through the device and returns once every byte landed: the in-process data
    /// path for memory of [`Access::Device`]. Either side of an op may also be host memory of this
    /// process. The default refuses ([`DeviceError::Copy`]): this device cannot copy in process.
    ///
    /// # Safety
    ///
    /// For the whole call, every op's source is memory of this device (or host memory) valid for
    /// reads and its destination valid for writes, and nothing else writes a source or accesses a
    /// destination.
    unsafe fn copy(&self, ops: &[CopyOp]) -> Result<(), DeviceError> {
        Err(DeviceError::Copy {
            device: self.kind(),
            offset: ops.first().map_or(0, |o| o.dst),
            len: ops.iter().map(|o| o.len).fold(0, u64::saturating_add),
            reason: format!("{} devices do not copy their memory in process", self.kind()),
        })
    }
}

/// The end of `[addr, addr + len)` for a backend's `describe`, or its `NotDeviceMemory` if the range
/// is empty or wraps past the end of the address space.
pub(crate) fn range_end(device: DeviceKind, addr: u64, len: u64) -> Result<u64, DeviceError> {
    let reject = |reason: &str| DeviceError::NotDeviceMemory { device, addr, len, reason: reason.into() };
    if len == 0 {
        return Err(reject("empty range"));
    }
    addr.checked_add(len).ok_or_else(|| reject("range wraps past the end of the address space"))
}

/// Picks the backend named by `spec` (`auto|neuron|cuda|cuda:<ordinal>|host|mock`, case-insensitive).
///
/// `auto` tries Neuron, then CUDA, then host. An explicit backend that is not available is an error,
/// never a silent fallback. `cuda:<ordinal>` opens that device (a framework worker names the GPU its
/// KV cache is on); plain `cuda` opens `KVPUSH_CUDA_DEVICE` (default 0).
pub fn select(spec: &str) -> Result<Arc<dyn Device>, DeviceError> {
    let spec = spec.trim().to_ascii_lowercase();
    if let Some(ordinal) = spec.strip_prefix("cuda:") {
        let ordinal: u32 = ordinal.parse().map_err(|_| DeviceError::Unknown { value: spec.clone() })?;
        return cuda::CudaDevice::open(ordinal).map(|d| Arc::new(d) as Arc<dyn Device>).map_err(|why| {
            DeviceError::Unavailable {
                requested: spec.clone(),
                tried: vec![(format!("cuda:{ordinal}"), why.to_string())],
            }
        });
    }
    let mut tried = Vec::new();
    let candidates: &[&str] = match spec.as_str() {
        "auto" | "" => &["neuron", "cuda", "host"],
        "neuron" => &["neuron"],
        "cuda" => &["cuda"],
        "host" => &["host"],
        "mock" => &["mock"],
        _ => return Err(DeviceError::Unknown { value: spec }),
    };
    for &name in candidates {
        match open(name) {
            Ok(d) => return Ok(d),
            Err(why) => tried.push((name.to_owned(), why)),
        }
    }
    Err(DeviceError::Unavailable { requested: if spec.is_empty() { "auto".into() } else { spec }, tried })
}

/// Picks the backend named by the `KVPUSH_DEVICE` environment variable (default `auto`).
pub fn from_env() -> Result<Arc<dyn Device>, DeviceError> {
    select(&std::env::var("KVPUSH_DEVICE").unwrap_or_else(|_| "auto".into()))
}

fn open(name: &str) -> Result<Arc<dyn Device>, String> {
    match name {
        "host" => Ok(Arc::new(host::HostDevice::new())),
        "mock" => Ok(Arc::new(mock::MockDevice::new())),
        "neuron" => neuron::open_for_select(),
        "cuda" => cuda::CudaDevice::from_env().map(|d| Arc::new(d) as Arc<dyn Device>).map_err(|e| match e {
            // The one reason inside, not the error around it: the caller lists it under "cuda".
            DeviceError::Unavailable { mut tried, .. } if tried.len() == 1 => tried.remove(0).1,
            e => e.to_string(),
        }),
        other => Err(format!("no backend named {other}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(addr: u64, len: u64) -> MemRegion {
        MemRegion { addr, len, kind: MemKind::Vram, dev_id: 0 }
    }

    #[test]
    fn region_set_finds_the_region_holding_a_range() {
        let mut set = RegionSet::default();
        // Inserted out of order, with gaps: 128 regions of 1 MiB, every other MiB.
        for i in (0..128u64).rev() {
            set.insert(region((2 * i + 1) << 20, 1 << 20));
        }
        for i in 0..128u64 {
            let base = (2 * i + 1) << 20;
            assert_eq!(set.find(base, 1 << 20).map(|r| r.addr), Some(base));
            assert_eq!(set.find(base + 4096, 4096).map(|r| r.addr), Some(base));
            // Past the end, straddling the end, and in the gap before it.
            assert!(set.find(base + (1 << 20), 1).is_none());
            assert!(set.find(base + (1 << 20) - 1, 2).is_none());
            assert!(set.find(base - 4096, 4096).is_none());
        }
        assert!(set.find(0, 1).is_none());
        assert!(set.find(u64::MAX, 1).is_none());
        set.remove(&region(3 << 20, 1 << 20));
        assert!(set.find(3 << 20, 1).is_none());
        assert_eq!(set.iter().count(), 127);
    }

    #[test]
    fn region_set_finds_a_range_in_an_overlapped_region() {
        let mut set = RegionSet::default();
        set.insert(region(0x1000, 0x10000));
        set.insert(region(0x2000, 0x1000));
        // The nearest start below is 0x2000, which does not hold the range; the outer region does.
        assert_eq!(set.find(0x4000, 0x100).map(|r| r.addr), Some(0x1000));
        assert_eq!(set.find(0x2000, 0x100).map(|r| r.addr), Some(0x2000));
    }
}
