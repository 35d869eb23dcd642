//! The Scribbler: a block pool that reuses a block the moment an outcome gives it back, as a busy
//! serving engine would, and catches any byte that lands in it afterwards.
//!
//! Read [`Scribbler::give`] and [`Scribbler::take`]. When an engine's outcome releases blocks (on D:
//! any outcome, received, failed or ended; on P: `Sent`, which says the sources may be reused), the
//! harness gives them back here and the Scribbler at once overwrites every byte of them, in every
//! worker's memory, with a canary: the demo's KV pattern under a seed no request uses, one per block
//! and release. On P that is the "sources overwritten the moment they are released": a WRITE that
//! still reads them sends the canary, which D's verification of that request then sees. The canary
//! is checked when the block is handed out again and, for the blocks still free, at the end of the
//! scenario ([`Scribbler::sweep`]); a canary that changed is a byte of an old transfer that landed
//! after the owner was told the block was free, counted as one corrupt block.
//!
//! The pool is LIFO, so a freed block is the next one handed out: a late write into it also lands in
//! the next request's data and fails that request's verification. It never decides anything for an
//! engine; it only keeps the owner's side of the block contract and reports who broke it.

use std::collections::{HashMap, HashSet};

use kvpush::device::Buffer;
use kvpush::proto::layout::KvLayout;

use crate::demo::pattern;
use crate::layouts::BLOCK_TOKENS;

/// The memory of one side's workers: each worker's layout and buffers (block ids are the same on
/// every worker of a side).
pub type Memory<'a> = Vec<(&'a KvLayout, &'a [Box<dyn Buffer>])>;

/// A side's block pool with canaries. See the module docs.
#[derive(Debug)]
pub struct Scribbler {
    name: &'static str,
    total: u32,
    free: Vec<u32>,
    out: HashSet<u32>,
    /// The canary seed written into each free block.
    canary: HashMap<u32, u64>,
    /// Releases so far (each writes fresh canaries).
    generation: u64,
    /// Blocks whose canary changed while they were free.
    corrupt: u64,
    /// Block ids given back that were not handed out (a double release); never silently absorbed.
    bad_releases: Vec<String>,
    /// Where the corruption was seen, for a human.
    notes: Vec<String>,
}

/// The seed of the canary written into `block` at `generation`: the high bit marks it as a canary,
/// so no request's seed (the harness draws them below 2^63) can produce the same bytes.
fn canary_seed(side: &str, block: u32, generation: u64) -> u64 {
    let salt = side.bytes().fold(0u64, |h, b| h.rotate_left(5) ^ u64::from(b));
    (1u64 << 63) | (salt << 48) ^ (generation << 20) ^ u64::from(block)
}

impl Scribbler {
    /// A pool of `total` blocks, all free; the free blocks of `mem` get their first canary.
    pub fn new(name: &'static str, total: u32, mem: &Memory<'_>) -> Scribbler {
        let mut s = Scribbler {
            name,
            total,
            free: Vec::with_capacity(total as usize),
            out: HashSet::new(),
            canary: HashMap::new(),
            generation: 0,
            corrupt: 0,
            bad_releases: Vec::new(),
            notes: Vec::new(),
        };
        let all: Vec<u32> = (0..total).rev().collect();
        s.scribble(&all, mem);
        s.free = all;
        s
    }

    /// Writes a fresh canary into `blocks` on every worker.
    fn scribble(&mut self, blocks: &[u32], mem: &Memory<'_>) {
        self.generation += 1;
        for &b in blocks {
            let seed = canary_seed(self.name, b, self.generation);
            for (l, bufs) in mem {
                // A device error on host memory is a harness bug: loud, never hidden as "clean".
                pattern::fill(l, bufs, &[vec![b]], u64::from(BLOCK_TOKENS), seed).expect("canary written");
            }
            self.canary.insert(b, seed);
        }
    }

    /// Whether `block`'s canary is intact on every worker; a changed one is counted.
    fn check(&mut self, b: u32, mem: &Memory<'_>, when: &str) -> bool {
        let Some(&seed) = self.canary.get(&b) else { return true };
        for (w, (l, bufs)) in mem.iter().enumerate() {
            let v = pattern::verify(l, bufs, &[vec![b]], u64::from(BLOCK_TOKENS), seed).expect("canary read");
            if !v.ok() {
                self.corrupt += 1;
                if self.notes.len() < 8 {
                    self.notes.push(format!(
                        "{} block {b} (worker {w}) written while free, seen {when}: {} elements changed",
                        self.name, v.mismatched_elements
                    ));
                }
                return false;
            }
        }
        true
    }

    /// `n` blocks for a new owner (LIFO), each checked first; `None` while too few are free.
    pub fn take(&mut self, n: usize, mem: &Memory<'_>) -> Option<Vec<u32>> {
        if self.free.len() < n {
            return None;
        }
        let mut ids = Vec::with_capacity(n);
        for _ in 0..n {
            let b = self.free.pop()?;
            self.check(b, mem, "when handed out again");
            self.canary.remove(&b);
            self.out.insert(b);
            ids.push(b);
        }
        Some(ids)
    }

    /// The owner got `blocks` back: they are overwritten with canaries at once and free again.
    pub fn give(&mut self, blocks: &[u32], mem: &Memory<'_>, what: &str) {
        let mut back = Vec::with_capacity(blocks.len());
        for &b in blocks {
            if self.out.remove(&b) {
                back.push(b);
            } else {
                self.bad_releases.push(format!("{} block {b} released but not handed out ({what})", self.name));
            }
        }
        self.scribble(&back, mem);
        self.free.extend(back.iter().rev());
    }

    /// Checks every free block's canary (at the end, once transfers had time to land).
    pub fn sweep(&mut self, mem: &Memory<'_>) {
        let free = self.free.clone();
        for b in free {
            if !self.check(b, mem, "at the end") {
                // Counted once: a fresh canary, so a later sweep does not count it again.
                self.scribble(&[b], mem);
            }
        }
    }

    /// Blocks handed out and not given back.
    pub fn outstanding(&self) -> u64 {
        self.out.len() as u64
    }

    /// Blocks handed out now.
    pub fn total(&self) -> u32 {
        self.total
    }

    /// Corrupt blocks seen so far.
    pub fn corrupt(&self) -> u64 {
        self.corrupt
    }

    /// Double releases and corruption sites, for the report.
    pub fn notes(&self) -> impl Iterator<Item = &String> {
        self.bad_releases.iter().chain(&self.notes)
    }

    /// Double releases seen.
    pub fn bad_releases(&self) -> u64 {
        self.bad_releases.len() as u64
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kvpush::device::host::HostDevice;
    use kvpush::device::Device;

    use super::*;
    use crate::layouts;

    /// A byte written into a free block is counted once, by the sweep or by the next `take`; blocks
    /// untouched are not.
    #[test]
    fn a_write_into_a_free_block_is_caught() {
        let dev: Arc<dyn Device> = Arc::new(HostDevice::new());
        let mut l = layouts::separate(layouts::full_model(2, 2, 8), 8, layouts::tp(0, 1));
        let bufs = layouts::allocate(&mut l, dev.as_ref()).expect("memory");
        let mem: Memory<'_> = vec![(&l, &bufs[..])];
        let mut s = Scribbler::new("D", 8, &mem);
        let got = s.take(3, &mem).expect("free");
        assert_eq!(s.outstanding(), 3);
        s.give(&got, &mem, "test");
        s.sweep(&mem);
        assert_eq!(s.corrupt(), 0, "{:?}", s.notes().collect::<Vec<_>>());
        // A late transfer's bytes land in block got[1] after it was given back.
        pattern::fill(&l, &bufs, &[vec![got[1]]], 1, 42).expect("late write");
        s.sweep(&mem);
        assert_eq!(s.corrupt(), 1);
        s.sweep(&mem);
        assert_eq!(s.corrupt(), 1, "counted once");
        // Caught on reuse too.
        pattern::fill(&l, &bufs, &[vec![got[0]]], 1, 43).expect("late write");
        let again = s.take(8, &mem).expect("all free");
        assert_eq!(again.len(), 8);
        assert_eq!(s.corrupt(), 2);
        // A double release is named, not absorbed.
        s.give(&again, &mem, "all");
        s.give(&again[..1], &mem, "again");
        assert_eq!(s.bad_releases(), 1);
        assert_eq!(s.outstanding(), 0);
    }
}
