//! The host bounce's executor: staging ([`crate::transport::staged`]) whose slots are host DRAM, for a
//! worker whose NIC cannot reach its KV's device memory (docs/deployment.md §4, "Trainium P → GPU D";
//! `proto::bounce::decide` says which side bounces).
//!
//! Read [`host_bounce`] first. The staged transport already gathers a transfer's pieces into bounded
//! slots, WRITEs slot to slot and scatters on the receiver; for a bounce its slots are host memory
//! ([`HostSlots`]) and the device's KV is never registered with the NIC ([`HostOnly`]), so every byte
//! of the worker's KV crosses the NIC through `slots × slot_bytes` of host memory: on P, gathered
//! from device memory into a send slot and written to the peer; on D, written by the peer into a
//! receive slot and scattered into device memory before the transfer's notification is delivered.
//! The slot copies run while the NIC WRITEs other slots (the staged transport gathers ahead).
//!
//! This module must never register device memory with the NIC it wraps: a post that names device
//! memory directly is refused by that transport as unregistered, never attempted.

use std::sync::Arc;

use super::staged::{PathChoice, Staged, StagingConfig};
use super::{Desc, Notification, Op, Transport, TransportError, Units, Waker, XferId, XferState};
use crate::device::bounce::HostSlots;
use crate::device::{Device, MemKind, MemRegion};
use crate::proto::plan::Grid;

/// `geometry` as a bounce runs it: every WRITE that touches the worker's KV is staged, whatever its
/// shape (the NIC has no direct path to choose).
pub fn bounce_geometry(geometry: StagingConfig) -> StagingConfig {
    StagingConfig { min_descs: 1, max_mean_desc: u64::MAX, choice: PathChoice::Always, ..geometry }
}

/// Wraps `nic` (the transport whose NIC cannot reach `device`'s memory) in a staged transport whose
/// slots are host memory and whose KV regions stay off the NIC. `geometry`'s slots and slot bytes
/// bound the host memory; its policy is replaced by [`bounce_geometry`]'s.
pub fn host_bounce(
    nic: Arc<dyn Transport>,
    device: Arc<dyn Device>,
    geometry: StagingConfig,
) -> Result<Staged, TransportError> {
    let kind = device.kind();
    let inner: Arc<dyn Transport> = Arc::new(HostOnly { nic });
    Staged::new(inner, &HostSlots::new(device), bounce_geometry(geometry))?.ok_or(TransportError::Unavailable {
        transport: "host bounce",
        reason: format!("{kind} memory cannot be copied in this process, so it cannot be bounced through host memory"),
    })
}

/// The NIC of a bounce: `nic` for host memory; device memory is kept from it (registered with the
/// staged transport above only).
#[derive(Debug)]
pub struct HostOnly {
    nic: Arc<dyn Transport>,
}

impl Transport for HostOnly {
    fn name(&self) -> &str {
        self.nic.name()
    }

    unsafe fn register(&self, region: &MemRegion) -> Result<(), TransportError> {
        if region.kind == MemKind::Vram {
            return Ok(());
        }
        // SAFETY: forwarded; the caller's contract is the NIC's.
        unsafe { self.nic.register(region) }
    }

    fn deregister(&self, region: &MemRegion) -> Result<(), TransportError> {
        if region.kind == MemKind::Vram {
            return Ok(());
        }
        self.nic.deregister(region)
    }

    fn local_metadata(&self) -> Result<Vec<u8>, TransportError> {
        self.nic.local_metadata()
    }

    fn load_remote(&self, metadata: &[u8]) -> Result<String, TransportError> {
        self.nic.load_remote(metadata)
    }

    fn drop_peer(&self, peer: &str) {
        self.nic.drop_peer(peer)
    }

    fn prepare(&self, peer: Option<&str>, units: &[Units]) -> Result<(), TransportError> {
        self.nic.prepare(peer, units)
    }

    fn post(&self, op: Op, peer: &str, descs: &[Desc], notif: Option<&[u8]>) -> Result<XferId, TransportError> {
        self.nic.post(op, peer, descs, notif)
    }

    fn post_grid(&self, peer: &str, grid: &Grid, notif: Option<&[u8]>) -> Option<Result<XferId, TransportError>> {
        self.nic.post_grid(peer, grid, notif)
    }

    fn cancel(&self, id: XferId) {
        self.nic.cancel(id)
    }

    fn stop_incoming(&self, completes: &dyn Fn(&str, &[u8]) -> bool) -> usize {
        self.nic.stop_incoming(completes)
    }

    fn poll(&self, id: XferId) -> Result<XferState, TransportError> {
        self.nic.poll(id)
    }

    fn take_notifications(&self, out: &mut Vec<Notification>) -> Result<usize, TransportError> {
        self.nic.take_notifications(out)
    }

    fn send_notification(&self, peer: &str, msg: &[u8]) -> Result<(), TransportError> {
        self.nic.send_notification(peer, msg)
    }

    fn set_waker(&self, waker: Waker) {
        self.nic.set_waker(waker)
    }

    fn needs_polling(&self) -> bool {
        self.nic.needs_polling()
    }

    fn busy(&self) -> bool {
        self.nic.busy()
    }

    fn costly_host_descriptors(&self) -> bool {
        self.nic.costly_host_descriptors()
    }
}
