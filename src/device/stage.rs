//! Staging copies: packing a transfer's scattered pieces of KV memory into a contiguous staging slot
//! (gather) and unpacking a slot into KV memory (scatter), on the device the memory lives on.
//!
//! Read [`Stager`] first. The staged transport ([`crate::transport::staged`]) describes one piece of
//! a transfer as a table of [`StageEntry`]s — `len` bytes at KV address `addr` ↔ offset `off` of the
//! slot's data area — and asks the device to run it. Each operation runs on a *lane* (one per staging
//! slot); the caller never starts an operation on a lane before the previous one is done
//! ([`Stager::is_done`]). Backends: host memory (and the mock device, whose memory is host memory)
//! copy at once on the calling thread ([`HostStager`]); CUDA runs a kernel per operation and reports
//! completion through an event.

use std::fmt;

use super::{DeviceError, DeviceKind};

/// Alignment of every entry's address, offset and length (the CUDA kernels move 16-byte words).
pub const STAGE_ALIGN: u64 = 16;
/// Bytes of one entry in a staging table (address u64, offset u32, length u32, little endian).
pub const ENTRY_BYTES: usize = 16;

/// One copy of a staged piece: `len` bytes at KV address `addr` ↔ offset `off` of the slot's data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StageEntry {
    /// Address in KV memory.
    pub addr: u64,
    /// Offset in the staging slot's data area.
    pub off: u32,
    /// Bytes.
    pub len: u32,
}

/// What [`Stager::scatter_table`] runs on a table's snapshot before scattering it: `Err` names the
/// first entry it refuses. Owned, since a stager may run it after the call returns.
pub type TableCheck = Box<dyn FnMut(&[u8]) -> Result<(), BadEntry> + Send>;

/// A scatter-table entry the receiver refused ([`Stager::scatter_table`]'s check): it is misaligned,
/// reads past the piece's data, or writes outside the receiver's registered KV memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "entry {index} ({addr:#x}+{len} from offset {off}) is not an aligned range of registered KV memory inside the piece"
)]
pub struct BadEntry {
    /// The entry's index in the table.
    pub index: usize,
    /// Its destination address.
    pub addr: u64,
    /// Its length.
    pub len: u32,
    /// Its offset in the piece's data.
    pub off: u32,
}

impl StageEntry {
    /// The entry's table form.
    pub fn to_bytes(self) -> [u8; ENTRY_BYTES] {
        let mut b = [0u8; ENTRY_BYTES];
        b[..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..12].copy_from_slice(&self.off.to_le_bytes());
        b[12..].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Reads an entry from its table form.
    pub fn from_bytes(b: &[u8; ENTRY_BYTES]) -> StageEntry {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[..8]);
        StageEntry { addr: u64::from_le_bytes(a), off: u32_at(8), len: u32_at(12) }
    }

    /// Whether address, offset and length are all [`STAGE_ALIGN`]-aligned and the length non-zero.
    pub fn aligned(&self) -> bool {
        self.len > 0 && (self.addr | u64::from(self.off) | u64::from(self.len)).is_multiple_of(STAGE_ALIGN)
    }
}

/// Runs staging copies on one device. See the module docs.
///
/// Lanes are numbered `0..lanes`. An operation's entries must be [`StageEntry::aligned`], their data
/// ranges (`off..off + len`) must lie inside the slot, and there are at most `max_entries` of them.
pub trait Stager: Send + fmt::Debug {
    /// Which device runs the copies.
    fn kind(&self) -> DeviceKind;
    /// Starts copying each entry's `len` bytes from `addr` to `slot + off` on `lane`.
    ///
    /// # Safety
    ///
    /// Until [`Stager::is_done`] reports the lane done: every entry's `addr..addr + len` is memory of
    /// this device valid for reads, `slot..slot + off + len` valid for writes, and nothing else
    /// writes the sources or accesses the written part of the slot.
    unsafe fn gather(&mut self, lane: usize, entries: &[StageEntry], slot: u64) -> Result<(), DeviceError>;
    /// Starts copying each entry's `len` bytes from `slot + off` to `addr` on `lane`.
    ///
    /// # Safety
    ///
    /// As for [`Stager::gather`] with the directions swapped: the destinations are valid for writes
    /// and untouched by anyone else, the slot's part is valid for reads and not written meanwhile.
    unsafe fn scatter(&mut self, lane: usize, entries: &[StageEntry], slot: u64) -> Result<(), DeviceError>;
    /// [`Stager::write`] of `table` to `table_to`, then [`Stager::gather`] of the entries of `local`
    /// (in table form) on `lane`: the sender's step for one piece (the receiver's table and the data,
    /// both into the send slot). Backends may do both in fewer copies.
    ///
    /// # Safety
    ///
    /// The contracts of [`Stager::write`] (for `table_to`) and [`Stager::gather`] (for `local`'s
    /// entries).
    unsafe fn gather_with_table(
        &mut self,
        lane: usize,
        local: &[u8],
        slot: u64,
        table_to: u64,
        table: &[u8],
    ) -> Result<(), DeviceError> {
        // SAFETY: forwarded from this function's contract.
        unsafe {
            self.write(table_to, table)?;
            self.gather_table(lane, local, slot)
        }
    }
    /// [`Stager::gather`] of the entries of `table` (table form) on `lane`. The default decodes
    /// them; a backend that copies straight from table form takes them as they are.
    ///
    /// # Safety
    ///
    /// The contract of [`Stager::gather`] for `table`'s entries.
    unsafe fn gather_table(&mut self, lane: usize, table: &[u8], slot: u64) -> Result<(), DeviceError> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.gather(lane, &parse_table(table), slot) }
    }
    /// Takes a snapshot of the `n`-entry table at `table_at` (this device's memory, e.g. a slot's
    /// table area that a peer wrote), hands it to `check` in table form, and only if `check` accepts
    /// it starts the scatter the snapshot describes on `lane` (as [`Stager::scatter`]). The scatter
    /// reads the snapshot, never `table_at` again, so a writer that changes the table after the
    /// check changes nothing. The default reads the table with [`Stager::read`] and checks it before
    /// returning; a stager whose snapshot is an asynchronous copy may check it later, in
    /// [`Stager::is_done`], which then reports a rejected table as the lane's error (nothing was
    /// scattered).
    ///
    /// # Safety
    ///
    /// `table_at..table_at + 16 n` is memory of this device valid for reads; for every entry `check`
    /// accepts, the contract of [`Stager::scatter`].
    unsafe fn scatter_table(
        &mut self,
        lane: usize,
        table_at: u64,
        n: usize,
        slot: u64,
        mut check: TableCheck,
    ) -> Result<(), DeviceError> {
        let mut table = vec![0u8; n * ENTRY_BYTES];
        // SAFETY: the caller guarantees the table's bytes are readable memory of this device.
        unsafe { self.read(table_at, &mut table) }?;
        check(&table).map_err(|e| DeviceError::Copy {
            device: self.kind(),
            offset: 0,
            len: 0,
            reason: e.to_string(),
        })?;
        // SAFETY: `check` accepted every entry of this private copy; the caller's contract covers them.
        unsafe { self.scatter_snapshot(lane, table, slot) }
    }
    /// [`Stager::scatter`] of the entries of `snapshot` (table form: a private copy that
    /// [`Stager::scatter_table`] read and its check accepted) on `lane`. The default decodes them; a
    /// backend that copies straight from table form keeps the snapshot as it is.
    ///
    /// # Safety
    ///
    /// The contract of [`Stager::scatter`] for `snapshot`'s entries.
    unsafe fn scatter_snapshot(&mut self, lane: usize, snapshot: Vec<u8>, slot: u64) -> Result<(), DeviceError> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.scatter(lane, &parse_table(&snapshot), slot) }
    }
    /// Whether the lane's last operation finished (an error if it failed).
    fn is_done(&mut self, lane: usize) -> Result<bool, DeviceError>;
    /// Copies `out.len()` bytes at `addr` into `out`, synchronously.
    ///
    /// # Safety
    ///
    /// `addr..addr + out.len()` is memory of this device valid for reads.
    unsafe fn read(&mut self, addr: u64, out: &mut [u8]) -> Result<(), DeviceError>;
    /// Copies `data` to `addr`; later operations on any lane see it.
    ///
    /// # Safety
    ///
    /// `addr..addr + data.len()` is memory of this device valid for writes, accessed by no one else
    /// until the copy is seen.
    unsafe fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), DeviceError>;
}

/// The entries of a table in table form (trailing bytes short of an entry are ignored).
pub fn parse_table(table: &[u8]) -> Vec<StageEntry> {
    table
        .chunks_exact(ENTRY_BYTES)
        .map(|c| {
            let mut b = [0u8; ENTRY_BYTES];
            b.copy_from_slice(c);
            StageEntry::from_bytes(&b)
        })
        .collect()
}

/// Checks a table's entries (table form) against the stager's rules without decoding them; returns
/// how many there are.
pub fn check_table(kind: DeviceKind, table: &[u8], max_entries: usize) -> Result<usize, DeviceError> {
    let bad = |what: String| DeviceError::Copy { device: kind, offset: 0, len: 0, reason: what };
    let n = table.len() / ENTRY_BYTES;
    if !table.len().is_multiple_of(ENTRY_BYTES) || n > max_entries {
        return Err(bad(format!("a table of {} bytes: at most {max_entries} entries of {ENTRY_BYTES}", table.len())));
    }
    // addr | off | len over each entry's bytes: the low 4 bits of the first byte of each field.
    let misaligned = table
        .chunks_exact(ENTRY_BYTES)
        .position(|e| (e[0] | e[8] | e[12]) & (STAGE_ALIGN as u8 - 1) != 0 || e[12..16] == [0, 0, 0, 0]);
    if let Some(k) = misaligned {
        return Err(bad(format!("staging entry {k} is not {STAGE_ALIGN}-byte aligned or is empty")));
    }
    Ok(n)
}

/// Checks an operation's entries against the stager's rules (shared by every backend).
pub fn check_entries(kind: DeviceKind, entries: &[StageEntry], max_entries: usize) -> Result<(), DeviceError> {
    let bad = |what: String| DeviceError::Copy { device: kind, offset: 0, len: 0, reason: what };
    if entries.len() > max_entries {
        return Err(bad(format!("{} staging entries, at most {max_entries} per operation", entries.len())));
    }
    if let Some(e) = entries.iter().find(|e| !e.aligned()) {
        return Err(bad(format!("staging entry {e:?} is not {STAGE_ALIGN}-byte aligned or is empty")));
    }
    Ok(())
}

/// Host memory: copies on the calling thread; every operation is done when its call returns.
#[derive(Debug, Clone, Copy)]
pub struct HostStager {
    kind: DeviceKind,
    max_entries: usize,
}

impl HostStager {
    /// A stager for host memory presented as `kind` (host or mock).
    pub fn new(kind: DeviceKind, max_entries: usize) -> Self {
        HostStager { kind, max_entries }
    }
}

impl Stager for HostStager {
    fn kind(&self) -> DeviceKind {
        self.kind
    }

    unsafe fn gather(&mut self, _lane: usize, entries: &[StageEntry], slot: u64) -> Result<(), DeviceError> {
        check_entries(self.kind, entries, self.max_entries)?;
        for e in entries {
            // SAFETY: the caller guarantees the source and the slot's part are valid host memory that
            // nobody else touches during the operation (which ends before this call returns); the two
            // never overlap (KV memory and staging slots are separate allocations).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    e.addr as usize as *const u8,
                    (slot + u64::from(e.off)) as usize as *mut u8,
                    e.len as usize,
                )
            };
        }
        Ok(())
    }

    unsafe fn scatter(&mut self, _lane: usize, entries: &[StageEntry], slot: u64) -> Result<(), DeviceError> {
        check_entries(self.kind, entries, self.max_entries)?;
        for e in entries {
            // SAFETY: as in `gather`, directions swapped (the caller's contract).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (slot + u64::from(e.off)) as usize as *const u8,
                    e.addr as usize as *mut u8,
                    e.len as usize,
                )
            };
        }
        Ok(())
    }

    fn is_done(&mut self, _lane: usize) -> Result<bool, DeviceError> {
        Ok(true)
    }

    unsafe fn read(&mut self, addr: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        // SAFETY: the caller guarantees `addr..addr + out.len()` is readable host memory; `out` is a
        // distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(addr as usize as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    unsafe fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), DeviceError> {
        // SAFETY: the caller guarantees `addr..addr + data.len()` is writable host memory nobody else
        // accesses meanwhile; `data` is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as usize as *mut u8, data.len()) };
        Ok(())
    }
}

/// Test support: the entries that gather `picks` (offset, length) of the memory at `base` into a
/// slot one after another, from its start.
#[cfg(test)]
pub(crate) fn packed_entries(base: u64, picks: &[(u64, u32)]) -> Vec<StageEntry> {
    let mut off = 0;
    picks
        .iter()
        .map(|&(at, len)| {
            let e = StageEntry { addr: base + at, off, len };
            off += len;
            e
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_alignment() {
        let e = StageEntry { addr: 0x1234_5678_9abc_def0, off: 0x10, len: 4096 };
        assert_eq!(StageEntry::from_bytes(&e.to_bytes()), e);
        assert!(e.aligned());
        assert!(!StageEntry { len: 8, ..e }.aligned());
        assert!(!StageEntry { len: 0, ..e }.aligned());
        assert!(!StageEntry { addr: 0x1001, ..e }.aligned());
    }

    #[test]
    fn host_gather_then_scatter_moves_every_byte() {
        let host = crate::device::host::HostDevice::new();
        let (mut src, mut slot, mut dst) =
            (host.alloc_anon(4096).unwrap(), host.alloc_anon(1024).unwrap(), host.alloc_anon(4096).unwrap());
        for (i, b) in src.as_mut_slice().iter_mut().enumerate() {
            *b = (i * 7 % 251) as u8;
        }
        let (src_at, slot_at, dst_at) = (
            src.as_mut_slice().as_ptr() as u64,
            slot.as_mut_slice().as_mut_ptr() as u64,
            dst.as_mut_slice().as_mut_ptr() as u64,
        );
        let picks = [(1024u64, 64u32), (16, 32), (3008, 48)];
        let g = packed_entries(src_at, &picks);
        let s: Vec<StageEntry> =
            g.iter().zip(picks).map(|(e, (at, _))| StageEntry { addr: dst_at + at, ..*e }).collect();
        let mut st = HostStager::new(DeviceKind::Host, 8);
        // SAFETY: every range lies inside `src`, `slot` or `dst`, which outlive the calls and are not
        // otherwise accessed meanwhile.
        unsafe {
            st.gather(0, &g, slot_at).unwrap();
            st.scatter(1, &s, slot_at).unwrap();
        }
        assert!(st.is_done(0).unwrap());
        let (src, dst) = (src.as_mut_slice().to_vec(), dst.as_mut_slice().to_vec());
        for (at, len) in picks {
            let r = at as usize..at as usize + len as usize;
            assert_eq!(dst[r.clone()], src[r]);
        }
        let picked =
            |i: usize| picks.iter().any(|&(at, len)| (at as usize..(at + u64::from(len)) as usize).contains(&i));
        assert!(
            (0..dst.len()).filter(|&i| !picked(i)).all(|i| dst[i] == 0),
            "bytes outside the entries stay untouched"
        );
        // Misaligned or too many entries are refused before anything is copied.
        let bad = [StageEntry { len: 8, ..g[0] }];
        // SAFETY: refused before any copy.
        let err = unsafe { st.gather(0, &bad, slot_at) }.unwrap_err();
        assert!(err.to_string().contains("aligned"), "{err}");
        let many = vec![g[0]; 9];
        // SAFETY: refused before any copy.
        let err = unsafe { st.gather(0, &many, slot_at) }.unwrap_err();
        assert!(err.to_string().contains("at most 8"), "{err}");
    }

    #[test]
    fn scatter_table_runs_only_what_the_check_accepts() {
        let host = crate::device::host::HostDevice::new();
        let (mut slot, mut dst, mut table) =
            (host.alloc_anon(4096).unwrap(), host.alloc_anon(4096).unwrap(), host.alloc_anon(4096).unwrap());
        slot.as_mut_slice().iter_mut().enumerate().for_each(|(i, b)| *b = (i % 251) as u8 + 1);
        let (slot_at, dst_at) = (slot.as_mut_slice().as_ptr() as u64, dst.as_mut_slice().as_ptr() as u64);
        let entries =
            [StageEntry { addr: dst_at + 1024, off: 0, len: 64 }, StageEntry { addr: dst_at, off: 64, len: 32 }];
        for (k, e) in entries.iter().enumerate() {
            table.as_mut_slice()[k * ENTRY_BYTES..(k + 1) * ENTRY_BYTES].copy_from_slice(&e.to_bytes());
        }
        let table_at = table.as_mut_slice().as_ptr() as u64;
        let mut st = HostStager::new(DeviceKind::Host, 8);
        let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let saw = std::sync::Arc::clone(&seen);
        // SAFETY: refused by the check before anything is copied.
        let err = unsafe {
            st.scatter_table(
                0,
                table_at,
                2,
                slot_at,
                Box::new(move |t: &[u8]| {
                    saw.store(t.len(), std::sync::atomic::Ordering::Relaxed);
                    Err(BadEntry { index: 1, addr: 0xdead, len: 16, off: 0 })
                }),
            )
        }
        .unwrap_err();
        assert!(err.to_string().contains("entry 1 (0xdead+16 from offset 0)"), "{err}");
        assert_eq!(seen.load(std::sync::atomic::Ordering::Relaxed), 32, "the check sees the whole table");
        assert!(dst.as_mut_slice().iter().all(|&b| b == 0), "nothing scattered");
        // SAFETY: the entries lie in `dst` and `slot`, which outlive the call.
        unsafe { st.scatter_table(0, table_at, 2, slot_at, Box::new(|_: &[u8]| Ok(()))) }.unwrap();
        let (d, sl) = (dst.as_mut_slice().to_vec(), slot.as_mut_slice().to_vec());
        assert_eq!(d[1024..1088], sl[..64]);
        assert_eq!(d[..32], sl[64..96]);
    }

    #[test]
    fn tables_are_checked_without_decoding() {
        let good = StageEntry { addr: 0x1000, off: 32, len: 4096 };
        let table: Vec<u8> = [good, good].iter().flat_map(|e| e.to_bytes()).collect();
        assert_eq!(check_table(DeviceKind::Host, &table, 2).unwrap(), 2);
        assert!(check_table(DeviceKind::Host, &table, 1).unwrap_err().to_string().contains("at most 1"));
        assert!(check_table(DeviceKind::Host, &table[..20], 2).is_err(), "a partial entry");
        for bad in [
            StageEntry { addr: 0x1008, ..good },
            StageEntry { off: 40, ..good },
            StageEntry { len: 4100, ..good },
            StageEntry { len: 0, ..good },
        ] {
            let t: Vec<u8> = [good, bad].iter().flat_map(|e| e.to_bytes()).collect();
            let err = check_table(DeviceKind::Host, &t, 2).unwrap_err();
            assert!(err.to_string().contains("entry 1"), "{bad:?}: {err}");
            assert!(check_entries(DeviceKind::Host, &parse_table(&t), 2).is_err(), "both checks agree");
        }
    }
}
