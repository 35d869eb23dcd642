//! Host slots for device memory: the device half of a host bounce (docs/deployment.md §4, "Trainium
//! P → GPU D"), where a NIC cannot reach a worker's device memory and its KV goes through host memory.
//!
//! Read [`HostSlots`] first. It presents a device to the staged transport
//! ([`crate::transport::staged`]) with one change: the memory the transport allocates — its send and
//! receive slots — is host DRAM, while the KV it describes stays the device's own. Its [`Stager`]
//! ([`BounceStager`]) therefore copies between device memory and host slots: with the CPU where the
//! device's memory is mapped into the process (Neuron HBM under `NEURON_RT_MAP_HBM=1`, the mock), with
//! the device's own copy ([`Device::copy`], CUDA's host↔device copies) otherwise. Host memory stays
//! bounded by the transport's slots × slot bytes.
//!
//! This module must never hand the transport device memory as a slot, nor copy memory the device
//! cannot attribute: KV ranges are described by the wrapped device, and a device that can copy its
//! memory in no way has no bounce.

use std::fmt;
use std::sync::Arc;

use super::host::HostDevice;
use super::stage::{check_entries, HostStager, StageEntry, Stager};
use super::{Access, Buffer, CopyOp, Device, DeviceError, DeviceKind, MemRegion};

/// `device` with host-memory slots: see the module docs.
#[derive(Debug)]
pub struct HostSlots {
    device: Arc<dyn Device>,
    host: HostDevice,
}

impl HostSlots {
    /// Wraps `device`; its KV stays where it is, what the staged transport allocates is host memory.
    pub fn new(device: Arc<dyn Device>) -> HostSlots {
        HostSlots { device, host: HostDevice::new() }
    }
}

impl Device for HostSlots {
    fn kind(&self) -> DeviceKind {
        self.device.kind()
    }

    /// Host memory, registered by the transport as DRAM: the bounce's slots.
    fn alloc(&self, len: u64) -> Result<Box<dyn Buffer>, DeviceError> {
        self.host.alloc(len)
    }

    fn describe(&self, addr: u64, len: u64) -> Result<MemRegion, DeviceError> {
        self.device.describe(addr, len)
    }

    /// Copies between the device's memory and host slots; `None` where the device can copy its
    /// memory in no way ([`Access::None`]).
    fn stager(&self, _lanes: usize, max_entries: usize) -> Result<Option<Box<dyn Stager>>, DeviceError> {
        let kind = self.device.kind();
        Ok(match self.device.access() {
            Access::None => None,
            access => Some(Box::new(BounceStager {
                device: Arc::clone(&self.device),
                access,
                host: HostStager::new(kind, max_entries),
                max_entries,
            })),
        })
    }

    fn access(&self) -> Access {
        self.device.access()
    }

    unsafe fn copy(&self, ops: &[CopyOp]) -> Result<(), DeviceError> {
        // SAFETY: forwarded; the caller's contract is the wrapped device's.
        unsafe { self.device.copy(ops) }
    }
}

/// Gathers device memory into host slots and scatters host slots into device memory, synchronously
/// (every operation is done when its call returns; the staged transport overlaps the next slot's
/// copy with the previous slot's WRITE, which the NIC runs meanwhile).
pub struct BounceStager {
    device: Arc<dyn Device>,
    access: Access,
    /// Copies with the CPU: the device's memory where it is mapped, and the slots' tables always.
    host: HostStager,
    max_entries: usize,
}

impl fmt::Debug for BounceStager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BounceStager").field("device", &self.device.kind()).field("access", &self.access).finish()
    }
}

impl BounceStager {
    /// Runs `ops` with the device's copy (memory only the device moves).
    ///
    /// # Safety
    ///
    /// The contract of [`Device::copy`] for every op.
    unsafe fn device_copy(
        &self,
        entries: &[StageEntry],
        op: impl Fn(&StageEntry) -> CopyOp,
    ) -> Result<(), DeviceError> {
        check_entries(self.device.kind(), entries, self.max_entries)?;
        let ops: Vec<CopyOp> = entries.iter().map(op).collect();
        // SAFETY: forwarded from this function's contract.
        unsafe { self.device.copy(&ops) }
    }
}

impl Stager for BounceStager {
    fn kind(&self) -> DeviceKind {
        self.device.kind()
    }

    unsafe fn gather(&mut self, lane: usize, entries: &[StageEntry], slot: u64) -> Result<(), DeviceError> {
        match self.access {
            // SAFETY: the caller's contract; the device's memory is mapped into the process
            // (`Access::Cpu`), so the CPU copy reads exactly the device memory the entries name.
            Access::Cpu => unsafe { self.host.gather(lane, entries, slot) },
            // SAFETY: the caller's contract: each source is device memory valid for reads, each
            // destination the host slot's part valid for writes, untouched by others meanwhile —
            // `Device::copy`'s contract (one side host memory), for the whole (synchronous) call.
            _ => unsafe {
                self.device_copy(entries, |e| CopyOp {
                    dst: slot + u64::from(e.off),
                    src: e.addr,
                    len: u64::from(e.len),
                })
            },
        }
    }

    unsafe fn scatter(&mut self, lane: usize, entries: &[StageEntry], slot: u64) -> Result<(), DeviceError> {
        match self.access {
            // SAFETY: as in `gather`, directions swapped.
            Access::Cpu => unsafe { self.host.scatter(lane, entries, slot) },
            // SAFETY: as in `gather`, directions swapped: host slot to device memory.
            _ => unsafe {
                self.device_copy(entries, |e| CopyOp {
                    dst: e.addr,
                    src: slot + u64::from(e.off),
                    len: u64::from(e.len),
                })
            },
        }
    }

    fn is_done(&mut self, _lane: usize) -> Result<bool, DeviceError> {
        Ok(true)
    }

    /// The staged transport reads only its slots' tables, which are host memory here.
    unsafe fn read(&mut self, addr: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract; the range is a host slot's table (see above).
        unsafe { self.host.read(addr, out) }
    }

    /// The staged transport writes only its slots' tables, which are host memory here.
    unsafe fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract; the range is a host slot's table (see above).
        unsafe { self.host.write(addr, data) }
    }
}
