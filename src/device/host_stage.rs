//! Host staging copies on a thread of their own: [`CopyThread`], the [`Stager`] of host memory.
//!
//! Read [`CopyThread`] first. Staging host memory between processes (issue #22 item 3) pays for a
//! gather and a scatter `memcpy` per byte to save a system call per descriptor; on the sender, the
//! WRITE of one piece (UCX's `cma`: a `process_vm_writev` on the writer thread) and the gather of
//! the next then run side by side instead of one after the other, so the writer's core spends its
//! time on the WRITE and the gather costs only the other core's time. The receiver's writer likewise
//! keeps answering grants while a piece is scattered.
//!
//! Entries are copied straight from their table form (no decoded list per piece), neighbours that
//! continue each other on both sides as one `memcpy`. This module must never let a copy outlive
//! its caller's promise: a lane reports done only after its last copy returned, and dropping the
//! stager waits for every queued copy.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{unbounded, Sender};

use super::stage::{check_entries, check_table, HostStager, StageEntry, Stager, ENTRY_BYTES};
use super::{DeviceError, DeviceKind};

/// Which way a job copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dir {
    /// Entry sources into the slot.
    Gather,
    /// The slot into entry destinations.
    Scatter,
}

/// One queued operation: its lane's sequence number, a table of entries (table form) and the slot.
struct Job {
    lane: usize,
    seq: u64,
    dir: Dir,
    table: Vec<u8>,
    slot: u64,
}

/// Runs each lane's gathers and scatters on one copy thread, in the order they were started; a lane
/// is done once the thread has finished its latest operation. Entries are checked
/// ([`check_entries`], [`check_table`]) before an operation is queued, so a queued copy cannot fail.
pub struct CopyThread {
    kind: DeviceKind,
    max_entries: usize,
    /// Per lane: operations started.
    started: Vec<u64>,
    /// Per lane: the sequence number of the last operation the thread finished.
    finished: Arc<Vec<AtomicU64>>,
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl fmt::Debug for CopyThread {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CopyThread").field("kind", &self.kind).field("lanes", &self.started.len()).finish()
    }
}

/// Copies `table`'s entries between their addresses and `slot` (see [`Dir`]), merging entries that
/// continue each other on both sides into one copy.
///
/// # Safety
///
/// 1. Every entry's `addr..addr + len` and `slot + off..slot + off + len` are host memory of this
///    process, valid for reads on the source side and writes on the destination side;
/// 2. nothing else accesses the destination bytes or writes the source bytes during the call;
/// 3. the two sides never overlap.
unsafe fn run(dir: Dir, table: &[u8], slot: u64) {
    let mut pending: Option<(u64, u64, u64)> = None; // (addr, slot offset, len) of the merged copy
    let flush = |(addr, off, len): (u64, u64, u64)| {
        let at = slot + off;
        let (src, dst) = match dir {
            Dir::Gather => (addr, at),
            Dir::Scatter => (at, addr),
        };
        // SAFETY: (1)–(3) of this function's contract cover every merged range: a merged copy is
        // the union of entries that are adjacent on both sides.
        unsafe { std::ptr::copy_nonoverlapping(src as usize as *const u8, dst as usize as *mut u8, len as usize) };
    };
    for chunk in table.chunks_exact(ENTRY_BYTES) {
        let mut b = [0u8; ENTRY_BYTES];
        b.copy_from_slice(chunk);
        let e = StageEntry::from_bytes(&b);
        let (addr, off, len) = (e.addr, u64::from(e.off), u64::from(e.len));
        pending = match pending {
            Some((a, o, l)) if a + l == addr && o + l == off => Some((a, o, l + len)),
            Some(p) => {
                flush(p);
                Some((addr, off, len))
            }
            None => Some((addr, off, len)),
        };
    }
    if let Some(p) = pending {
        flush(p);
    }
}

impl CopyThread {
    /// A stager of `lanes` lanes of at most `max_entries` entries per operation, for host memory
    /// presented as `kind`; starts its copy thread.
    pub fn new(kind: DeviceKind, lanes: usize, max_entries: usize) -> Result<CopyThread, DeviceError> {
        let finished: Arc<Vec<AtomicU64>> = Arc::new((0..lanes).map(|_| AtomicU64::new(0)).collect());
        let (tx, rx) = unbounded::<Job>();
        let done = Arc::clone(&finished);
        let thread = std::thread::Builder::new()
            .name("kvpush-stage".into())
            .spawn(move || {
                for job in rx {
                    // SAFETY: `gather_raw` and `scatter_raw` queue a job only under their callers'
                    // contracts (the Stager's), which hold until the lane reports done — after the
                    // store below — and the entries were checked to lie in the slot's bounds.
                    unsafe { run(job.dir, &job.table, job.slot) };
                    done[job.lane].store(job.seq, Ordering::Release);
                }
            })
            .map_err(|e| DeviceError::Alloc { device: kind, len: 0, reason: format!("staging copy thread: {e}") })?;
        Ok(CopyThread { kind, max_entries, started: vec![0; lanes], finished, jobs: Some(tx), thread: Some(thread) })
    }

    fn lane_error(&self, lane: usize) -> DeviceError {
        DeviceError::Copy {
            device: self.kind,
            offset: 0,
            len: 0,
            reason: format!("staging lane {lane} does not exist (this stager has {} lanes)", self.started.len()),
        }
    }

    /// Queues `table` (checked) on `lane`.
    fn queue(&mut self, lane: usize, dir: Dir, table: Vec<u8>, slot: u64) -> Result<(), DeviceError> {
        if lane >= self.started.len() {
            return Err(self.lane_error(lane));
        }
        self.started[lane] += 1;
        let job = Job { lane, seq: self.started[lane], dir, table, slot };
        let sent = self.jobs.as_ref().map(|tx| tx.send(job));
        if !matches!(sent, Some(Ok(()))) {
            return Err(DeviceError::Copy {
                device: self.kind,
                offset: 0,
                len: 0,
                reason: "the staging copy thread has stopped".into(),
            });
        }
        Ok(())
    }

    fn to_table(entries: &[StageEntry]) -> Vec<u8> {
        entries.iter().flat_map(|e| e.to_bytes()).collect()
    }
}

impl Stager for CopyThread {
    fn kind(&self) -> DeviceKind {
        self.kind
    }

    unsafe fn gather(&mut self, lane: usize, entries: &[StageEntry], slot: u64) -> Result<(), DeviceError> {
        check_entries(self.kind, entries, self.max_entries)?;
        self.queue(lane, Dir::Gather, Self::to_table(entries), slot)
    }

    unsafe fn scatter(&mut self, lane: usize, entries: &[StageEntry], slot: u64) -> Result<(), DeviceError> {
        check_entries(self.kind, entries, self.max_entries)?;
        self.queue(lane, Dir::Scatter, Self::to_table(entries), slot)
    }

    /// Queues the table as it is: the copy thread reads table form.
    unsafe fn gather_table(&mut self, lane: usize, table: &[u8], slot: u64) -> Result<(), DeviceError> {
        check_table(self.kind, table, self.max_entries)?;
        self.queue(lane, Dir::Gather, table.to_vec(), slot)
    }

    /// Queues the snapshot itself: the copy thread reads this private copy, never the table area
    /// again.
    unsafe fn scatter_snapshot(&mut self, lane: usize, snapshot: Vec<u8>, slot: u64) -> Result<(), DeviceError> {
        check_table(self.kind, &snapshot, self.max_entries)?;
        self.queue(lane, Dir::Scatter, snapshot, slot)
    }

    fn is_done(&mut self, lane: usize) -> Result<bool, DeviceError> {
        let started = *self.started.get(lane).ok_or_else(|| self.lane_error(lane))?;
        Ok(self.finished[lane].load(Ordering::Acquire) == started)
    }

    unsafe fn read(&mut self, addr: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract, passed on (a synchronous copy on this thread).
        unsafe { HostStager::new(self.kind, self.max_entries).read(addr, out) }
    }

    unsafe fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract, passed on (a synchronous copy on this thread).
        unsafe { HostStager::new(self.kind, self.max_entries).write(addr, data) }
    }
}

impl Drop for CopyThread {
    /// Waits for every queued copy: their memory is promised only until their lane reports done.
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::host::HostDevice;
    use crate::device::stage::{packed_entries, BadEntry};

    fn wait(st: &mut CopyThread, lane: usize) {
        let t = std::time::Instant::now();
        while !st.is_done(lane).unwrap() {
            assert!(t.elapsed().as_secs() < 10, "lane {lane} never finished");
            std::thread::yield_now();
        }
    }

    #[test]
    fn gathers_and_scatters_on_the_copy_thread_merging_neighbours() {
        let host = HostDevice::new();
        let (mut src, mut slot, mut dst, mut table) = (
            host.alloc_anon(1 << 16).unwrap(),
            host.alloc_anon(1 << 16).unwrap(),
            host.alloc_anon(1 << 16).unwrap(),
            host.alloc_anon(4096).unwrap(),
        );
        src.as_mut_slice().iter_mut().enumerate().for_each(|(i, b)| *b = (i * 13 % 251) as u8 + 1);
        let (src_at, slot_at, dst_at) = (
            src.as_mut_slice().as_ptr() as u64,
            slot.as_mut_slice().as_ptr() as u64,
            dst.as_mut_slice().as_ptr() as u64,
        );
        // Two neighbours on both sides (one copy), one out of order, one after a gap.
        let picks = [(4096u64, 4096u32), (8192, 4096), (0, 64), (32768, 1024)];
        let gather = packed_entries(src_at, &picks);
        let mut st = CopyThread::new(DeviceKind::Host, 4, 8).unwrap();
        let local: Vec<u8> = gather.iter().flat_map(|e| e.to_bytes()).collect();
        let remote: Vec<u8> = gather
            .iter()
            .zip(picks)
            .flat_map(|(e, (at, _))| StageEntry { addr: dst_at + at, ..*e }.to_bytes())
            .collect();
        let table_at = table.as_mut_slice().as_ptr() as u64;
        // SAFETY: every range lies in `src`, `slot`, `dst` or `table`, which outlive the stager's
        // operations (each is waited for) and are not otherwise accessed meanwhile.
        unsafe { st.gather_with_table(1, &local, slot_at, table_at, &remote) }.unwrap();
        wait(&mut st, 1);
        // SAFETY: as above; the check accepts only entries inside `dst`.
        unsafe {
            let written = remote.clone();
            st.scatter_table(
                3,
                table_at,
                picks.len(),
                slot_at,
                Box::new(move |t: &[u8]| {
                    assert_eq!(t, &written[..], "the check sees the table as written");
                    Ok(())
                }),
            )
        }
        .unwrap();
        wait(&mut st, 3);
        let (s, d) = (src.as_mut_slice().to_vec(), dst.as_mut_slice().to_vec());
        for (at, len) in picks {
            let r = at as usize..at as usize + len as usize;
            assert_eq!(d[r.clone()], s[r], "entry at {at}");
        }
        let picked =
            |i: usize| picks.iter().any(|&(at, len)| (at as usize..(at + u64::from(len)) as usize).contains(&i));
        assert!((0..d.len()).filter(|&i| !picked(i)).all(|i| d[i] == 0), "nothing outside the entries");
        // Refused before anything is queued: a misaligned entry, too many, a lane that does not exist,
        // a table the check rejects.
        let bad = [StageEntry { len: 8, ..gather[0] }];
        // SAFETY: refused before any copy.
        assert!(unsafe { st.gather(0, &bad, slot_at) }.is_err());
        // SAFETY: refused before any copy.
        assert!(unsafe { st.gather(0, &[gather[0]; 9], slot_at) }.unwrap_err().to_string().contains("at most 8"));
        // SAFETY: refused before any copy.
        assert!(unsafe { st.gather(4, &gather, slot_at) }.unwrap_err().to_string().contains("lane 4"));
        dst.as_mut_slice().fill(0);
        // SAFETY: refused by the check before anything is queued.
        let err = unsafe {
            st.scatter_table(
                2,
                table_at,
                picks.len(),
                slot_at,
                Box::new(|_: &[u8]| Err(BadEntry { index: 0, addr: 0xdead, len: 16, off: 0 })),
            )
        }
        .unwrap_err();
        assert!(err.to_string().contains("0xdead"), "{err}");
        assert!(st.is_done(2).unwrap(), "nothing was queued on lane 2");
        assert!(dst.as_mut_slice().iter().all(|&b| b == 0), "nothing scattered");
    }

    #[test]
    fn dropping_waits_for_queued_copies() {
        let host = HostDevice::new();
        let (mut src, mut slot) = (host.alloc_anon(64 << 20).unwrap(), host.alloc_anon(64 << 20).unwrap());
        src.as_mut_slice().fill(7);
        let (src_at, slot_at) = (src.as_mut_slice().as_ptr() as u64, slot.as_mut_slice().as_ptr() as u64);
        let mut st = CopyThread::new(DeviceKind::Host, 1, 16).unwrap();
        let entries: Vec<StageEntry> = (0..16)
            .map(|k| StageEntry { addr: src_at + k * (4 << 20), off: (k * (4 << 20)) as u32, len: 4 << 20 })
            .collect();
        // SAFETY: the ranges lie in `src` and `slot`, which outlive `st` (dropped first, which waits).
        unsafe { st.gather(0, &entries, slot_at) }.unwrap();
        drop(st);
        assert!(slot.as_mut_slice().iter().all(|&b| b == 7), "the copy finished before the drop returned");
    }
}
