//! Host DRAM: anonymous or file-backed mappings through memmap2, and validation of host ranges the
//! framework allocated.
//!
//! Read [`HostDevice`] first, then [`HostBuffer`]. Memory kvpush owns is a [`memmap2::MmapRaw`]: a
//! mapping known only by its raw pointer, so [`Buffer::write_at`] can copy into it through `&self`
//! without ever creating a Rust reference that another writer could invalidate. That is also how the
//! memory is used for real: a transport (or a NIC) writes into it through its raw address.
//! [`HostDevice::describe`] checks a range against `/proc/self/maps` and never dereferences it.
//!
//! This module must never hand out a shared slice of memory that `&self` methods can write to: slices
//! of a [`HostBuffer`] borrow it mutably.

use std::fmt;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use memmap2::{MmapMut, MmapOptions, MmapRaw};

use super::{Buffer, Device, DeviceError, DeviceKind, MemKind, MemRegion};

/// Host DRAM.
///
/// [`Device::alloc`] returns zeroed anonymous memory; [`HostDevice::alloc_anon`] and
/// [`HostDevice::alloc_file`] return the concrete [`HostBuffer`] for callers that fill or checksum
/// the memory as a slice. [`Device::describe`] accepts any readable range mapped in this process.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostDevice {
    _private: (),
}

impl HostDevice {
    /// A host device. Stateless: every instance is equivalent.
    pub fn new() -> Self {
        HostDevice { _private: () }
    }

    /// Allocates `len` zeroed bytes as a private anonymous mapping.
    pub fn alloc_anon(&self, len: u64) -> Result<HostBuffer, DeviceError> {
        let map = Mapping::anon(DeviceKind::Host, len)?;
        tracing::debug!(addr = format_args!("{:#x}", map.addr()), len, "host: anonymous mapping");
        Ok(HostBuffer { map, path: None })
    }

    /// Maps the first `len` bytes of the file at `path`, shared, read-write.
    ///
    /// The file is created if missing and extended (with zeros) to `len` bytes if shorter; existing
    /// contents are kept and a longer file is not truncated. Writes reach the file (call
    /// [`HostBuffer::flush`] to make them durable); a file under `/dev/shm` gives shared memory
    /// another process can map. Truncating the file while it is mapped makes accesses past its new
    /// end fault (SIGBUS): a KV cache file must not be truncated while in use.
    pub fn alloc_file(&self, path: impl AsRef<Path>, len: u64) -> Result<HostBuffer, DeviceError> {
        let path = path.as_ref();
        let fail = |reason: String| DeviceError::Alloc { device: DeviceKind::Host, len, reason };
        let size = checked_len(len).map_err(&fail)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| fail(format!("cannot open {}: {e}", path.display())))?;
        let file_len = file.metadata().map_err(|e| fail(format!("cannot stat {}: {e}", path.display())))?.len();
        if file_len < len {
            file.set_len(len)
                .map_err(|e| fail(format!("cannot extend {} from {file_len} to {len} bytes: {e}", path.display())))?;
        }
        let raw = MmapOptions::new()
            .len(size)
            .map_raw(&file)
            .map_err(|e| fail(format!("cannot map {}: {e}", path.display())))?;
        let map = Mapping::new(raw, len);
        tracing::debug!(addr = format_args!("{:#x}", map.addr()), len, path = %path.display(), "host: file mapping");
        Ok(HostBuffer { map, path: Some(path.to_owned()) })
    }
}

impl Device for HostDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Host
    }

    fn access(&self) -> super::Access {
        super::Access::Cpu
    }

    /// Copies on a thread of their own ([`super::host_stage::CopyThread`]), so a WRITE and the next
    /// piece's gather overlap.
    fn stager(&self, lanes: usize, max_entries: usize) -> Result<Option<Box<dyn super::Stager>>, DeviceError> {
        Ok(Some(Box::new(super::host_stage::CopyThread::new(DeviceKind::Host, lanes, max_entries)?)))
    }

    fn alloc(&self, len: u64) -> Result<Box<dyn Buffer>, DeviceError> {
        Ok(Box::new(self.alloc_anon(len)?))
    }

    /// Accepts `[addr, addr + len)` if it is non-empty, does not wrap, and (on Linux) lies inside
    /// readable mappings of this process according to `/proc/self/maps`.
    ///
    /// This is a check at registration time, not a guarantee: the owner may unmap the range later.
    /// Where `/proc/self/maps` cannot be read (not Linux, no procfs) the mapping check is skipped.
    fn describe(&self, addr: u64, len: u64) -> Result<MemRegion, DeviceError> {
        let reject = |reason: String| DeviceError::NotDeviceMemory { device: DeviceKind::Host, addr, len, reason };
        if addr == 0 {
            return Err(reject("null address".into()));
        }
        let end = super::range_end(DeviceKind::Host, addr, len)?;
        match std::fs::read_to_string("/proc/self/maps") {
            Ok(maps) => check_mapped(&maps, addr, end).map_err(reject)?,
            Err(e) => tracing::debug!(error = %e, "host: /proc/self/maps unreadable, range not checked"),
        }
        Ok(MemRegion { addr, len, kind: MemKind::Dram, dev_id: 0 })
    }
}

/// Host memory kvpush owns: an anonymous or file-backed mapping, unmapped on drop.
///
/// Region, copies and slices all refer to the same bytes. [`Buffer::read_at`] and
/// [`Buffer::write_at`] are serialized with each other by an internal lock, so two Rust-level copies
/// never race; writers that use the raw address (transports, NICs) are outside that lock and must be
/// kept off ranges that are being copied or sliced by the protocol that hands them the address.
pub struct HostBuffer {
    map: Mapping,
    path: Option<PathBuf>,
}

impl HostBuffer {
    /// The bytes, for filling and checksumming where the buffer is owned.
    ///
    /// Borrows mutably because [`Buffer::write_at`] writes through `&self`: a shared borrow could not
    /// promise that the bytes stay unchanged while the slice lives.
    pub fn as_slice(&mut self) -> &[u8] {
        self.map.as_mut_slice()
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.map.as_mut_slice()
    }

    /// The backing file, for a file-backed buffer.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Writes modified pages of a file-backed buffer to the file and waits until they are durable
    /// (msync). For an anonymous buffer this does nothing useful but succeeds.
    pub fn flush(&self) -> Result<(), DeviceError> {
        self.map.raw.flush().map_err(|e| DeviceError::Copy {
            device: DeviceKind::Host,
            offset: 0,
            len: self.map.len,
            reason: match &self.path {
                Some(p) => format!("cannot flush mapping of {} to disk: {e}", p.display()),
                None => format!("cannot flush anonymous mapping: {e}"),
            },
        })
    }
}

impl Buffer for HostBuffer {
    fn region(&self) -> MemRegion {
        MemRegion { addr: self.map.addr(), len: self.map.len, kind: MemKind::Dram, dev_id: 0 }
    }

    fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        self.map.read_at(DeviceKind::Host, offset, out)
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.map.write_at(DeviceKind::Host, offset, data)
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("addr", &format_args!("{:#x}", self.map.addr()))
            .field("len", &self.map.len)
            .field("path", &self.path)
            .finish()
    }
}

/// A read-write mapping of `len > 0` bytes, accessed only through its raw pointer; shared with the
/// mock backend (which reports its own [`DeviceKind`] in errors).
pub(super) struct Mapping {
    raw: MmapRaw,
    /// `raw.len()` as u64; never 0.
    len: u64,
    /// Serializes [`Mapping::read_at`] and [`Mapping::write_at`], so that two copies through `&self`
    /// are never a data race. Guards no data (the bytes are reached through `raw`), hence poisoning
    /// is ignored.
    copy_lock: Mutex<()>,
}

impl Mapping {
    /// `len` zeroed bytes of private anonymous memory.
    pub(super) fn anon(device: DeviceKind, len: u64) -> Result<Self, DeviceError> {
        let fail = |reason: String| DeviceError::Alloc { device, len, reason };
        let size = checked_len(len).map_err(fail)?;
        let map = MmapMut::map_anon(size).map_err(|e| fail(format!("anonymous mmap failed: {e}")))?;
        Ok(Mapping::new(MmapRaw::from(map), len))
    }

    /// Wraps `raw`, which maps `len > 0` bytes read-write.
    fn new(raw: MmapRaw, len: u64) -> Self {
        debug_assert_eq!(raw.len() as u64, len);
        Mapping { raw, len, copy_lock: Mutex::new(()) }
    }

    pub(super) fn addr(&self) -> u64 {
        self.raw.as_ptr() as u64
    }

    pub(super) fn len(&self) -> u64 {
        self.len
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `raw` maps `raw.len()` bytes read-write for as long as it lives, and it lives as long
        // as `self`, which the returned slice borrows mutably; so no `&self` copy can touch the bytes
        // while the slice lives. Mapped memory is initialized (zeros or file contents). Writers using
        // the raw address are bound by `HostBuffer`'s contract not to touch ranges being sliced.
        unsafe { std::slice::from_raw_parts_mut(self.raw.as_mut_ptr(), self.raw.len()) }
    }

    /// Checks that `[offset, offset + len)` lies in the mapping; returns the offset as usize.
    fn check(&self, device: DeviceKind, offset: u64, len: usize) -> Result<usize, DeviceError> {
        let len64 = len as u64;
        let fail = |reason: String| DeviceError::Copy { device, offset, len: len64, reason };
        let end = offset.checked_add(len64).ok_or_else(|| fail("offset + length overflows".into()))?;
        if end > self.len {
            return Err(fail(format!("out of range: the buffer holds {} bytes", self.len)));
        }
        // In range of a mapping of `raw.len(): usize` bytes, so it fits in usize.
        Ok(offset as usize)
    }

    pub(super) fn read_at(&self, device: DeviceKind, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        let off = self.check(device, offset, out.len())?;
        let _copy = self.copy_lock.lock().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: `check` put `[off, off + out.len())` inside the mapping, which is readable and lives
        // as long as `self`, so the source is valid for `out.len()` bytes; `out` is valid for writes
        // of its length. `copy` (memmove) tolerates overlap. No Rust reference to the mapping is live:
        // slices need `&mut self`, and the other `&self` copy (`write_at`) is excluded by the lock.
        unsafe { std::ptr::copy(self.raw.as_ptr().add(off), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    pub(super) fn write_at(&self, device: DeviceKind, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        let off = self.check(device, offset, data.len())?;
        let _copy = self.copy_lock.lock().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: `check` put `[off, off + data.len())` inside the mapping, which is writable (mapped
        // read-write) and lives as long as `self`, so the destination is valid for `data.len()`
        // bytes. `copy` (memmove) tolerates overlap. No Rust reference to the mapping is live: slices
        // need `&mut self`, and other `&self` copies are excluded by the lock.
        unsafe { std::ptr::copy(data.as_ptr(), self.raw.as_mut_ptr().add(off), data.len()) };
        Ok(())
    }
}

/// `len` as a mapping size: non-zero and at most `isize::MAX` (what mmap and slices allow).
fn checked_len(len: u64) -> Result<usize, String> {
    if len == 0 {
        return Err("zero-length allocation".into());
    }
    usize::try_from(len)
        .ok()
        .filter(|&n| isize::try_from(n).is_ok())
        .ok_or_else(|| format!("{len} bytes exceeds the address space"))
}

/// Checks that `[addr, end)` is covered by readable mappings listed in `maps` (the format of
/// `/proc/<pid>/maps`: `start-end perms offset dev inode path`, hex addresses, sorted by start).
fn check_mapped(maps: &str, addr: u64, end: u64) -> Result<(), String> {
    let mut covered = addr; // everything in [addr, covered) is mapped and readable
    for line in maps.lines() {
        let mut fields = line.split_ascii_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else { continue };
        let Some((start, stop)) = range.split_once('-') else { continue };
        let (Ok(start), Ok(stop)) = (u64::from_str_radix(start, 16), u64::from_str_radix(stop, 16)) else {
            continue;
        };
        if stop <= covered {
            continue;
        }
        if start > covered {
            break;
        }
        if !perms.starts_with('r') {
            return Err(format!("mapping {start:#x}-{stop:#x} is not readable ({perms})"));
        }
        covered = stop;
        if covered >= end {
            return Ok(());
        }
    }
    if covered == addr {
        Err("not mapped in this process (per /proc/self/maps)".into())
    } else {
        Err(format!("bytes from {covered:#x} on are not mapped in this process (per /proc/self/maps)"))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const MAPS: &str = "\
00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/dbus-daemon
00651000-00652000 r--p 00051000 08:02 173521      /usr/bin/dbus-daemon
00652000-00655000 rw-p 00052000 08:02 173521      /usr/bin/dbus-daemon
00e03000-00e24000 rw-p 00000000 00:00 0           [heap]
7ffd0000-7ffd1000 ---p 00000000 00:00 0
7ffd1000-7ffd2000 rw-p 00000000 00:00 0           [stack with spaces]
";

    #[test]
    fn maps_coverage() {
        assert_eq!(check_mapped(MAPS, 0x400000, 0x401000), Ok(()));
        // A hole after the first mapping.
        assert!(check_mapped(MAPS, 0x451000, 0x654000).unwrap_err().contains("from 0x452000"));
        // Three adjacent mappings together.
        assert_eq!(check_mapped(MAPS, 0x651000, 0x655000), Ok(()));
        assert!(check_mapped(MAPS, 0x650fff, 0x651001).unwrap_err().contains("not mapped"));
        assert_eq!(check_mapped(MAPS, 0xe03000, 0xe24000), Ok(()));
        assert!(check_mapped(MAPS, 0xe23000, 0xe25000).unwrap_err().contains("0xe24000"));
        assert!(check_mapped(MAPS, 0x1000, 0x2000).unwrap_err().contains("not mapped"));
        assert!(check_mapped(MAPS, 0x7ffd0800, 0x7ffd1800).unwrap_err().contains("not readable"));
        assert_eq!(check_mapped(MAPS, 0x7ffd1000, 0x7ffd2000), Ok(()));
        assert!(check_mapped(MAPS, 0x8000_0000, 0x8000_1000).is_err());
        assert!(check_mapped("garbage\n\n", 0x1000, 0x2000).is_err());
    }

    #[test]
    fn alloc_copies_and_bounds() {
        let dev = HostDevice::new();
        let buf = dev.alloc(4096).unwrap();
        let r = buf.region();
        assert_eq!((r.len, r.kind, r.dev_id), (4096, MemKind::Dram, 0));
        assert_ne!(r.addr, 0);
        let mut out = [1u8; 16];
        buf.read_at(4080, &mut out).unwrap();
        assert_eq!(out, [0; 16], "anonymous memory is zeroed");
        buf.write_at(4090, b"abcdef").unwrap();
        let mut out = [0u8; 6];
        buf.read_at(4090, &mut out).unwrap();
        assert_eq!(&out, b"abcdef");
        buf.write_at(4096, &[]).unwrap();
        let err = buf.write_at(4091, b"abcdef").unwrap_err();
        assert!(matches!(err, DeviceError::Copy { device: DeviceKind::Host, offset: 4091, len: 6, .. }), "{err}");
        assert!(err.to_string().contains("4096 bytes"), "{err}");
        let err = buf.read_at(u64::MAX, &mut out).unwrap_err();
        assert!(err.to_string().contains("overflows"), "{err}");
        assert!(matches!(dev.alloc(0), Err(DeviceError::Alloc { len: 0, .. })));
        assert!(matches!(dev.alloc(u64::MAX), Err(DeviceError::Alloc { .. })));
    }

    #[test]
    fn slices_see_copies() {
        let mut buf = HostDevice::new().alloc_anon(64).unwrap();
        buf.as_mut_slice()[10] = 7;
        let mut b = [0u8; 1];
        buf.read_at(10, &mut b).unwrap();
        assert_eq!(b, [7]);
        buf.write_at(11, &[8]).unwrap();
        assert_eq!(&buf.as_slice()[10..12], &[7, 8]);
        assert_eq!(buf.as_slice().len(), 64);
        assert!(format!("{buf:?}").contains("len: 64"));
    }

    /// What `describe` accepts (a buffer of its own, a range inside one, memory it did not allocate)
    /// is tested through the public API (tests/device.rs, `host_describe`); here, that its refusals
    /// say why.
    #[test]
    fn describe_refusals_say_why() {
        let dev = HostDevice::new();
        let err = dev.describe(0, 10).unwrap_err();
        assert!(err.to_string().contains("null"), "{err}");
        assert!(dev.describe(u64::MAX - 10, 100).unwrap_err().to_string().contains("wraps"));
    }

    #[test]
    fn concurrent_writes_through_shared_refs() {
        let buf = HostDevice::new().alloc_anon(8 * 1024).unwrap();
        std::thread::scope(|s| {
            for t in 0..8u8 {
                let buf = &buf;
                s.spawn(move || buf.write_at(u64::from(t) * 1024, &[t; 1024]).unwrap());
            }
        });
        let mut out = vec![0u8; 8 * 1024];
        buf.read_at(0, &mut out).unwrap();
        for (i, chunk) in out.chunks(1024).enumerate() {
            assert!(chunk.iter().all(|&b| usize::from(b) == i));
        }
    }
}
