//! A mock accelerator: host memory presented as device memory (VRAM of a chosen ordinal), with fault
//! injection, for tests of everything above the device layer.
//!
//! Read [`MockDevice`] first. Like a real device, it knows exactly which memory is its own: every live
//! allocation is tracked, and [`Device::describe`] accepts only ranges inside one of them, the way the
//! CUDA backend attributes a pointer to its allocation and ordinal. [`MockFaults`] makes allocations,
//! descriptions and copies fail on demand.
//!
//! This module must never accept memory it did not allocate, and must never panic in `Drop`.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::host::Mapping;
use super::{Buffer, Device, DeviceError, DeviceKind, MemKind, MemRegion};

/// Faults to inject, settable at run time with [`MockDevice::set_faults`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MockFaults {
    /// Fail this many of the next allocations.
    pub fail_allocs: u32,
    /// Fail every description while set.
    pub fail_describe: bool,
    /// Fail this many of the next copies ([`Buffer::read_at`] or [`Buffer::write_at`] of any buffer of
    /// the device).
    pub fail_copies: u32,
}

/// Counters of a [`MockDevice`], for tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MockStats {
    /// Successful allocations so far.
    pub allocs: u64,
    /// Buffers freed (dropped) so far.
    pub frees: u64,
    /// Allocations alive now.
    pub live_allocations: usize,
    /// Bytes of the allocations alive now.
    pub live_bytes: u64,
}

/// Host memory posing as VRAM of device `dev_id`, with fault injection.
///
/// Internally synchronized; buffers keep the device's bookkeeping alive and untrack themselves when
/// dropped, even after the device itself is gone.
pub struct MockDevice {
    shared: Arc<Shared>,
}

impl MockDevice {
    /// A mock of device ordinal 0.
    pub fn new() -> Self {
        Self::with_dev_id(0)
    }

    /// A mock of device ordinal `dev_id`.
    pub fn with_dev_id(dev_id: u32) -> Self {
        MockDevice {
            shared: Arc::new(Shared {
                dev_id,
                books: Mutex::new(Books::default()),
                fail_allocs: AtomicU32::new(0),
                fail_describe: AtomicBool::new(false),
                fail_copies: AtomicU32::new(0),
            }),
        }
    }

    /// The device ordinal this mock reports.
    pub fn dev_id(&self) -> u32 {
        self.shared.dev_id
    }

    /// Allocates `len` zeroed bytes, returning the concrete buffer.
    pub fn alloc_buffer(&self, len: u64) -> Result<MockBuffer, DeviceError> {
        if take_one(&self.shared.fail_allocs) {
            return Err(DeviceError::Injected { device: DeviceKind::Mock, what: "alloc" });
        }
        let map = Mapping::anon(DeviceKind::Mock, len)?;
        let mut books = self.shared.books();
        books.live.insert(map.addr(), map.len());
        books.allocs += 1;
        books.live_bytes += map.len();
        drop(books);
        Ok(MockBuffer { map, shared: Arc::clone(&self.shared) })
    }

    /// Like [`Device::describe`], and also checks that the memory is on device `claimed_dev_id`, as a
    /// real backend does when the framework says which device a tensor is on.
    pub fn describe_on(&self, addr: u64, len: u64, claimed_dev_id: u32) -> Result<MemRegion, DeviceError> {
        let region = self.describe(addr, len)?;
        if claimed_dev_id != self.shared.dev_id {
            return Err(DeviceError::NotDeviceMemory {
                device: DeviceKind::Mock,
                addr,
                len,
                reason: format!(
                    "memory is on mock device {}, not on the claimed device {claimed_dev_id}",
                    self.shared.dev_id
                ),
            });
        }
        Ok(region)
    }

    /// Replaces the faults to inject (each field is stored on its own: a concurrent operation may see
    /// some fields old and some new).
    pub fn set_faults(&self, faults: MockFaults) {
        self.shared.fail_allocs.store(faults.fail_allocs, Ordering::SeqCst);
        self.shared.fail_describe.store(faults.fail_describe, Ordering::SeqCst);
        self.shared.fail_copies.store(faults.fail_copies, Ordering::SeqCst);
    }

    /// The faults still pending.
    pub fn faults(&self) -> MockFaults {
        MockFaults {
            fail_allocs: self.shared.fail_allocs.load(Ordering::SeqCst),
            fail_describe: self.shared.fail_describe.load(Ordering::SeqCst),
            fail_copies: self.shared.fail_copies.load(Ordering::SeqCst),
        }
    }

    /// Fails the next `n` allocations (replacing any count pending).
    pub fn fail_next_allocs(&self, n: u32) {
        self.shared.fail_allocs.store(n, Ordering::SeqCst);
    }

    /// Fails every description while `on`.
    pub fn fail_describe(&self, on: bool) {
        self.shared.fail_describe.store(on, Ordering::SeqCst);
    }

    /// Fails the next `n` copies (replacing any count pending).
    pub fn fail_next_copies(&self, n: u32) {
        self.shared.fail_copies.store(n, Ordering::SeqCst);
    }

    /// Counters of allocations and frees.
    pub fn stats(&self) -> MockStats {
        let books = self.shared.books();
        MockStats {
            allocs: books.allocs,
            frees: books.frees,
            live_allocations: books.live.len(),
            live_bytes: books.live_bytes,
        }
    }

    /// Allocations alive now.
    pub fn live_allocations(&self) -> usize {
        self.shared.books().live.len()
    }

    /// Bytes of the allocations alive now.
    pub fn live_bytes(&self) -> u64 {
        self.shared.books().live_bytes
    }
}

impl Default for MockDevice {
    fn default() -> Self {
        Self::new()
    }
}

impl Device for MockDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Mock
    }

    /// Its "device memory" is host memory: the CPU copies it.
    fn access(&self) -> super::Access {
        super::Access::Cpu
    }

    fn stager(&self, _lanes: usize, max_entries: usize) -> Result<Option<Box<dyn super::Stager>>, DeviceError> {
        Ok(Some(Box::new(super::stage::HostStager::new(DeviceKind::Mock, max_entries))))
    }

    fn alloc(&self, len: u64) -> Result<Box<dyn Buffer>, DeviceError> {
        Ok(Box::new(self.alloc_buffer(len)?))
    }

    /// Accepts `[addr, addr + len)` only if it lies entirely inside one live allocation of this mock.
    fn describe(&self, addr: u64, len: u64) -> Result<MemRegion, DeviceError> {
        if self.shared.fail_describe.load(Ordering::SeqCst) {
            return Err(DeviceError::Injected { device: DeviceKind::Mock, what: "describe" });
        }
        let reject = |reason: String| DeviceError::NotDeviceMemory { device: DeviceKind::Mock, addr, len, reason };
        let end = super::range_end(DeviceKind::Mock, addr, len)?;
        let books = self.shared.books();
        match books.live.range(..=addr).next_back() {
            Some((&start, &alloc_len)) if addr < start + alloc_len => {
                if end > start + alloc_len {
                    return Err(reject(format!(
                        "range runs past the end of its allocation {start:#x}+{alloc_len} of mock device {}",
                        self.shared.dev_id
                    )));
                }
            }
            _ => return Err(reject(format!("not allocated by this device (mock device {})", self.shared.dev_id))),
        }
        Ok(MemRegion { addr, len, kind: MemKind::Vram, dev_id: self.shared.dev_id })
    }
}

impl fmt::Debug for MockDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MockDevice").field("dev_id", &self.shared.dev_id).field("faults", &self.faults()).finish()
    }
}

/// Memory of a [`MockDevice`]; freed and untracked on drop.
pub struct MockBuffer {
    map: Mapping,
    shared: Arc<Shared>,
}

impl MockBuffer {
    fn injected(&self, what: &'static str) -> Result<(), DeviceError> {
        if take_one(&self.shared.fail_copies) {
            return Err(DeviceError::Injected { device: DeviceKind::Mock, what });
        }
        Ok(())
    }
}

impl Buffer for MockBuffer {
    fn region(&self) -> MemRegion {
        MemRegion { addr: self.map.addr(), len: self.map.len(), kind: MemKind::Vram, dev_id: self.shared.dev_id }
    }

    fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        self.injected("read")?;
        self.map.read_at(DeviceKind::Mock, offset, out)
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.injected("write")?;
        self.map.write_at(DeviceKind::Mock, offset, data)
    }
}

impl Drop for MockBuffer {
    fn drop(&mut self) {
        // Untrack before the mapping goes (fields drop after this), so no describe can succeed for
        // memory that is already unmapped.
        let mut books = self.shared.books();
        if books.live.remove(&self.map.addr()).is_some() {
            books.frees += 1;
            books.live_bytes -= self.map.len();
        }
    }
}

impl fmt::Debug for MockBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MockBuffer")
            .field("addr", &format_args!("{:#x}", self.map.addr()))
            .field("len", &self.map.len())
            .field("dev_id", &self.shared.dev_id)
            .finish()
    }
}

/// State shared by a mock device and its buffers.
struct Shared {
    dev_id: u32,
    books: Mutex<Books>,
    fail_allocs: AtomicU32,
    fail_describe: AtomicBool,
    fail_copies: AtomicU32,
}

impl Shared {
    /// The bookkeeping. Every update of `Books` completes without panicking, so a poisoned lock still
    /// guards consistent data and is entered anyway (which also keeps `Drop` panic-free).
    fn books(&self) -> MutexGuard<'_, Books> {
        self.books.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Live allocations and counters.
#[derive(Default)]
struct Books {
    /// Start address → length of every live allocation (disjoint: they are distinct mappings).
    live: BTreeMap<u64, u64>,
    allocs: u64,
    frees: u64,
    live_bytes: u64,
}

/// Decrements `counter` if positive; whether it did (the operation must fail).
fn take_one(counter: &AtomicU32) -> bool {
    counter.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn tracks_and_attributes() {
        let dev = MockDevice::with_dev_id(3);
        let a = dev.alloc(4096).unwrap();
        let b = dev.alloc(8192).unwrap();
        let (ra, rb) = (a.region(), b.region());
        assert_eq!((ra.kind, ra.dev_id, ra.len), (MemKind::Vram, 3, 4096));
        assert_eq!(dev.describe(ra.addr, ra.len).unwrap(), ra);
        assert_eq!(dev.describe_on(rb.addr + 8191, 1, 3).unwrap().addr, rb.addr + 8191);
        assert!(dev.describe(ra.addr + 4000, 97).unwrap_err().to_string().contains("past the end"));
        let host = crate::device::host::HostDevice::new().alloc_anon(4096).unwrap();
        assert!(dev.describe(host.region().addr, 1).unwrap_err().to_string().contains("not allocated"));
        assert!(dev.describe_on(ra.addr, 1, 0).unwrap_err().to_string().contains("claimed device 0"));
        assert!(dev.describe(ra.addr, 0).is_err());
        assert_eq!(dev.stats(), MockStats { allocs: 2, frees: 0, live_allocations: 2, live_bytes: 12288 });
        drop(a);
        assert_eq!(dev.stats(), MockStats { allocs: 2, frees: 1, live_allocations: 1, live_bytes: 8192 });
        assert!(dev.describe(ra.addr, 1).unwrap_err().to_string().contains("not allocated by this device"));
        drop(dev);
        drop(b); // outlives its device without trouble
    }

    #[test]
    fn faults_count_down() {
        let dev = MockDevice::new();
        dev.set_faults(MockFaults { fail_allocs: 2, fail_describe: false, fail_copies: 1 });
        for _ in 0..2 {
            assert_eq!(dev.alloc(64).unwrap_err(), DeviceError::Injected { device: DeviceKind::Mock, what: "alloc" });
        }
        let buf = dev.alloc(64).unwrap();
        assert_eq!(dev.faults(), MockFaults { fail_allocs: 0, fail_describe: false, fail_copies: 1 });
        assert_eq!(
            buf.write_at(0, &[1]).unwrap_err(),
            DeviceError::Injected { device: DeviceKind::Mock, what: "write" }
        );
        buf.write_at(0, &[1]).unwrap();
        dev.fail_next_copies(1);
        let mut out = [0u8];
        assert!(matches!(buf.read_at(0, &mut out), Err(DeviceError::Injected { what: "read", .. })));
        buf.read_at(0, &mut out).unwrap();
        assert_eq!(out, [1]);
        dev.fail_describe(true);
        assert!(matches!(dev.describe(buf.region().addr, 1), Err(DeviceError::Injected { what: "describe", .. })));
        dev.fail_describe(false);
        assert!(dev.describe(buf.region().addr, 1).is_ok());
        assert_eq!(dev.stats().allocs, 1);
    }
}
