//! Layer-wise push: a request's KV leaves the producer layer by layer while prefill still runs.
//!
//! Whole-request push sends one WRITE per consumer rank once prefill has finished, so the whole
//! transfer follows the last layer. Layer-wise, the producer posts the WRITE of a layer range as soon
//! as those layers are final; only the last range's transfer is left after prefill. Read in order:
//!
//! * [`LayerCompletion`]: the notification of one layer range's WRITE — "layers `layers` of my part
//!   `part` of `key` have landed". A producer rank's *part* is the layers it holds that the consumer
//!   rank holds too ([`part_layers`]; both sides compute it from the two layouts).
//! * [`LayerSet`]: a set of layers inside a span, as a bitset.
//! * [`LayerTracker`] (consumer): per (key, producer rank), the layers landed so far. It tells
//!   [`super::completion::Completions`] when a rank's whole part has landed; that counter then
//!   treats the rank as complete exactly as if a whole-request [`super::msg::Completion`] had come.
//!   So timeouts, failures, draining and supersession work unchanged, per rank.
//! * [`LayerSend`] (producer): for one (key, consumer rank), which layers are final, which are
//!   posted and how many WRITEs are in flight; what to post next and when the push to that rank has
//!   ended.
//! * [`restrict_grid`]: a whole-request plan ([`super::plan::Grid`]) cut to a layer range. Rows of a
//!   grid are layers and a copy never crosses a region (one per layer and part), so the cut plan is
//!   merged exactly as the whole one, within the range.
//!
//! Like the rest of `proto`, no I/O, no clock, no `unsafe`.

use std::collections::HashMap;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use super::ids::{Key, Rank};
use super::layout::KvLayout;
use super::plan::{Grid, GridGroup, PlanStats};

/// P → D (as the NIXL notification of a layer range's WRITE): "layers `layers` of `key` have landed;
/// my part of this request is layers `part`".
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerCompletion {
    /// Which transfer and attempt.
    pub key: Key,
    /// The producer rank whose layers these are.
    pub rank: Rank,
    /// Global layers that landed (non-empty, inside `part`).
    pub layers: Range<u32>,
    /// Every layer this producer rank writes into the consumer rank for `key` ([`part_layers`]).
    pub part: Range<u32>,
}

impl LayerCompletion {
    /// Checks the ranges against the sender's layout: `layers` is non-empty and inside `part`, and
    /// `part` is inside the layers the sender holds.
    pub fn check(&self, sender: &KvLayout) -> Result<(), LayerRangeError> {
        let held = sender.layer_range();
        let ok = self.layers.start < self.layers.end
            && self.part.start <= self.layers.start
            && self.layers.end <= self.part.end
            && held.start <= self.part.start
            && self.part.end <= held.end;
        if ok {
            Ok(())
        } else {
            Err(LayerRangeError { layers: self.layers.clone(), part: self.part.clone(), held })
        }
    }
}

/// A [`LayerCompletion`] whose ranges do not fit (empty, outside the part, or a part outside the
/// sender's layers).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("layers {layers:?} of part {part:?} do not fit: a non-empty range inside the part, a part inside {held:?}")]
pub struct LayerRangeError {
    /// Layers in the message.
    pub layers: Range<u32>,
    /// Part in the message.
    pub part: Range<u32>,
    /// Layers the sender holds.
    pub held: Range<u32>,
}

/// The layers producer rank `src` writes into consumer rank `dst`: those both hold. Empty when they
/// share none (PP). Both sides compute it; D refuses a notification naming another part.
pub fn part_layers(src: &KvLayout, dst: &KvLayout) -> Range<u32> {
    let (s, d) = (src.layer_range(), dst.layer_range());
    let part = s.start.max(d.start)..s.end.min(d.end);
    if part.is_empty() {
        0..0
    } else {
        part
    }
}

/// A set of layers inside a fixed span (a bitset).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerSet {
    span: Range<u32>,
    bits: Vec<u64>,
    count: u32,
}

impl LayerSet {
    /// The empty set over `span`.
    pub fn new(span: Range<u32>) -> Self {
        let n = span.len();
        Self { span, bits: vec![0; n.div_ceil(64)], count: 0 }
    }

    /// The span.
    pub fn span(&self) -> Range<u32> {
        self.span.clone()
    }

    /// Layers in the set.
    pub fn len(&self) -> u32 {
        self.count
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Whether every layer of the span is in the set.
    pub fn is_full(&self) -> bool {
        self.count as usize == self.span.len()
    }

    /// Whether `layer` is in the set.
    pub fn contains(&self, layer: u32) -> bool {
        self.span.contains(&layer) && {
            let i = (layer - self.span.start) as usize;
            self.bits[i / 64] & (1 << (i % 64)) != 0
        }
    }

    /// Adds the layers of `layers` inside the span; returns how many were not in the set before.
    pub fn insert(&mut self, layers: Range<u32>) -> u32 {
        let (a, b) = (layers.start.max(self.span.start), layers.end.min(self.span.end));
        let mut added = 0;
        for layer in a..b {
            let i = (layer - self.span.start) as usize;
            let bit = 1u64 << (i % 64);
            if self.bits[i / 64] & bit == 0 {
                self.bits[i / 64] |= bit;
                added += 1;
            }
        }
        self.count += added;
        added
    }

    /// Maximal runs of consecutive layers in the set, in order.
    pub fn runs(&self) -> Vec<Range<u32>> {
        let mut out: Vec<Range<u32>> = Vec::new();
        for layer in self.span.clone().filter(|&l| self.contains(l)) {
            match out.last_mut() {
                Some(r) if r.end == layer => r.end += 1,
                _ => out.push(layer..layer + 1),
            }
        }
        out
    }
}

/// What one [`LayerCompletion`] did to its rank's count ([`LayerTracker::add`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Landed {
    /// New layers landed; the rank's part is not complete yet.
    Partial,
    /// The rank's whole part has now landed.
    Complete,
    /// Every layer named had landed already (a repeat).
    Duplicate,
    /// The rank named another part before: ignored.
    Conflict,
}

/// Counters of layer-wise counting (monotonic).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayerStats {
    /// Layer notifications that brought new layers.
    pub notifications: u64,
    /// Layer notifications whose layers had all landed before.
    pub duplicates: u64,
    /// Layer notifications naming another part than the rank's first.
    pub conflicts: u64,
}

/// Consumer side: layers landed per (key, producer rank). See the module docs.
///
/// It keeps only keys its owner still waits for: [`super::completion::Completions`] feeds it only
/// live or draining keys and calls [`LayerTracker::forget`] when a key's outcome leaves.
#[derive(Debug, Default)]
pub struct LayerTracker {
    keys: HashMap<Key, Vec<(Rank, LayerSet)>>,
    stats: LayerStats,
}

impl LayerTracker {
    /// Counters so far.
    pub fn stats(&self) -> LayerStats {
        self.stats
    }

    /// Keys with layers landed and no outcome yet.
    pub fn keys(&self) -> usize {
        self.keys.len()
    }

    /// Counts `c`'s layers (the caller checked them with [`LayerCompletion::check`]).
    pub fn add(&mut self, c: &LayerCompletion) -> Landed {
        let ranks = self.keys.entry(c.key).or_default();
        let set = match ranks.iter_mut().find(|(r, _)| *r == c.rank) {
            Some((_, set)) => set,
            None => {
                ranks.push((c.rank, LayerSet::new(c.part.clone())));
                let last = ranks.len() - 1;
                &mut ranks[last].1
            }
        };
        if set.span() != c.part {
            self.stats.conflicts += 1;
            return Landed::Conflict;
        }
        if set.insert(c.layers.clone()) == 0 {
            self.stats.duplicates += 1;
            return Landed::Duplicate;
        }
        self.stats.notifications += 1;
        if set.is_full() {
            Landed::Complete
        } else {
            Landed::Partial
        }
    }

    /// Layers landed from `rank` for `key`, and its part (`None` before its first notification).
    pub fn landed(&self, key: Key, rank: Rank) -> Option<(u32, Range<u32>)> {
        let ranks = self.keys.get(&key)?;
        ranks.iter().find(|(r, _)| *r == rank).map(|(_, s)| (s.len(), s.span()))
    }

    /// Drops what is kept for `key` (its outcome is out).
    pub fn forget(&mut self, key: Key) {
        self.keys.remove(&key);
    }
}

/// Producer side: the layer-wise push of one key to one consumer rank. See the module docs.
///
/// Inputs: [`LayerSend::handle_final`] (prefill made layers final), [`LayerSend::handle_done`] (a
/// posted range's WRITE ended), [`LayerSend::stop`] (abort, lease expiry, supersession: post
/// nothing more). Outputs: [`LayerSend::poll_ranges`] (what to post now, one WRITE per run) and
/// [`LayerSend::outcome`] (the push has ended: every layer of the part landed, or it stopped or
/// failed and nothing is in flight any more).
#[derive(Clone, Debug)]
pub struct LayerSend {
    final_layers: LayerSet,
    posted: LayerSet,
    in_flight: u32,
    failed: Option<super::msg::FailureKind>,
    stopped: bool,
}

impl LayerSend {
    /// A push of `part` (see [`part_layers`]) with nothing final yet.
    pub fn new(part: Range<u32>) -> Self {
        Self {
            final_layers: LayerSet::new(part.clone()),
            posted: LayerSet::new(part),
            in_flight: 0,
            failed: None,
            stopped: false,
        }
    }

    /// The part.
    pub fn part(&self) -> Range<u32> {
        self.posted.span()
    }

    /// WRITEs posted and not ended.
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// Layers `layers` are final on the producer (outside the part they are ignored).
    pub fn handle_final(&mut self, layers: Range<u32>) {
        self.final_layers.insert(layers);
    }

    /// The ranges to post now, each a maximal run of final layers not posted yet; they count as
    /// posted (and in flight) from here. Nothing once stopped or failed.
    pub fn poll_ranges(&mut self) -> Vec<Range<u32>> {
        if self.stopped || self.failed.is_some() {
            return Vec::new();
        }
        let runs: Vec<Range<u32>> = self
            .final_layers
            .runs()
            .into_iter()
            .flat_map(|r| {
                // Split each final run at layers already posted.
                let mut out: Vec<Range<u32>> = Vec::new();
                for l in r.filter(|&l| !self.posted.contains(l)) {
                    match out.last_mut() {
                        Some(o) if o.end == l => o.end += 1,
                        _ => out.push(l..l + 1),
                    }
                }
                out
            })
            .collect();
        for r in &runs {
            self.posted.insert(r.clone());
            self.in_flight += 1;
        }
        runs
    }

    /// A posted range's WRITE ended with `result`. The first failure stops further posts.
    pub fn handle_done(&mut self, result: Result<(), super::msg::FailureKind>) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if let Err(kind) = result {
            self.failed.get_or_insert(kind);
        }
    }

    /// The first failure of a posted range, if any (nothing more is posted after it).
    pub fn failed(&self) -> Option<super::msg::FailureKind> {
        self.failed
    }

    /// Post nothing more (the push was aborted or its lease ran out).
    pub fn stop(&mut self) {
        self.stopped = true;
    }

    /// `Some` once the push has ended and nothing is in flight: `Ok` when every layer of the part
    /// landed, `Err` with the first failure, or `Err(Aborted)` when it was stopped short.
    pub fn outcome(&self) -> Option<Result<(), super::msg::FailureKind>> {
        if self.in_flight > 0 {
            return None;
        }
        match (self.failed, self.posted.is_full(), self.stopped) {
            (Some(kind), _, _) => Some(Err(kind)),
            (None, true, _) => Some(Ok(())),
            (None, false, true) => Some(Err(super::msg::FailureKind::Aborted)),
            (None, false, false) => None,
        }
    }
}

/// The rows of `grid` (a whole-request plan from [`super::plan::Planner::plan_grid`] for source
/// layout `src`) whose layer is in `layers`, into `out` (cleared first), with the cut plan's copies
/// and bytes. Cells are kept per group; groups left without rows are dropped. `unmerged` is left 0:
/// a cut does not know its copies before merging (count the whole plan's once).
pub fn restrict_grid(grid: &Grid, src: &KvLayout, layers: Range<u32>, out: &mut Grid) -> PlanStats {
    out.clear();
    let per = src.placement.regions_per_layer();
    let first = src.layer_range().start;
    let mut stats = PlanStats::default();
    for g in &grid.groups {
        let rows = out.rows.len();
        out.rows.extend(grid.rows[g.rows.clone()].iter().filter(|r| layers.contains(&(first + r.src_region / per))));
        if out.rows.len() == rows {
            continue;
        }
        let cells = out.cells.len();
        out.cells.extend_from_slice(&grid.cells[g.cells.clone()]);
        let group = GridGroup { cells: cells..out.cells.len(), rows: rows..out.rows.len() };
        stats.merged += group.copies() as u64;
        stats.bytes += out.cells[group.cells.clone()].iter().map(|c| c.len).sum::<u64>() * group.rows.len() as u64;
        out.groups.push(group);
    }
    stats
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::layout::Parallel;
    use crate::proto::msg::FailureKind;
    use crate::proto::plan::{PlanInput, Planner};
    use crate::proto::testutil::small_layout;

    fn lc(layers: Range<u32>, part: Range<u32>) -> LayerCompletion {
        LayerCompletion { key: Key::new(5, 1), rank: Rank::new(0, 0), layers, part }
    }

    #[test]
    fn set_counts_runs_and_ignores_outside_the_span() {
        let mut s = LayerSet::new(60..140);
        assert_eq!(s.insert(0..62), 2);
        assert_eq!(s.insert(61..63), 1);
        assert_eq!(s.insert(70..72), 2);
        assert_eq!(s.insert(139..200), 1);
        assert_eq!(s.len(), 6);
        assert!(s.contains(127 + 12) && !s.contains(63) && !s.contains(59));
        assert_eq!(s.runs(), vec![60..63, 70..72, 139..140]);
        assert!(!s.is_full());
        s.insert(0..1000);
        assert!(s.is_full());
        assert_eq!(s.runs(), vec![60..140]);
    }

    #[test]
    fn check_refuses_empty_ranges_and_parts_outside_the_sender() {
        let mut l = small_layout(); // 4 layers
        assert!(lc(0..2, 0..4).check(&l).is_ok());
        assert!(lc(2..2, 0..4).check(&l).is_err());
        assert!(lc(3..5, 0..4).check(&l).is_err());
        assert!(lc(0..1, 1..4).check(&l).is_err());
        assert!(lc(0..4, 0..5).check(&l).is_err());
        // PP 2: rank 1 holds layers 2..4 only.
        l.parallel = Parallel { tp_rank: 0, tp_size: 1, pp_rank: 1, pp_size: 2 };
        assert!(lc(2..3, 2..4).check(&l).is_ok());
        let e = lc(1..3, 1..4).check(&l).unwrap_err();
        assert_eq!(e.held, 2..4);
    }

    #[test]
    fn part_is_the_layers_both_ranks_hold() {
        let mut p = small_layout();
        let mut d = small_layout();
        assert_eq!(part_layers(&p, &d), 0..4);
        p.parallel = Parallel { tp_rank: 0, tp_size: 1, pp_rank: 1, pp_size: 2 };
        assert_eq!(part_layers(&p, &d), 2..4);
        d.parallel = Parallel { tp_rank: 0, tp_size: 1, pp_rank: 0, pp_size: 2 };
        assert_eq!(part_layers(&p, &d), 0..0);
    }

    #[test]
    fn tracker_completes_a_rank_once_every_layer_landed() {
        let mut t = LayerTracker::default();
        assert_eq!(t.add(&lc(2..4, 0..4)), Landed::Partial);
        assert_eq!(t.add(&lc(3..4, 0..4)), Landed::Duplicate);
        assert_eq!(t.add(&lc(0..1, 0..2)), Landed::Conflict);
        assert_eq!(t.landed(Key::new(5, 1), Rank::new(0, 0)), Some((2, 0..4)));
        assert_eq!(t.add(&lc(0..1, 0..4)), Landed::Partial);
        // Overlapping a landed layer still brings layer 1.
        assert_eq!(t.add(&lc(1..3, 0..4)), Landed::Complete);
        assert_eq!(t.stats(), LayerStats { notifications: 3, duplicates: 1, conflicts: 1 });
        // Another rank counts separately.
        let other = LayerCompletion { rank: Rank::new(1, 0), ..lc(0..4, 0..4) };
        assert_eq!(t.add(&other), Landed::Complete);
        t.forget(Key::new(5, 1));
        assert_eq!(t.keys(), 0);
        assert_eq!(t.landed(Key::new(5, 1), Rank::new(0, 0)), None);
    }

    #[test]
    fn send_posts_final_runs_once_and_ends_when_all_landed() {
        let mut s = LayerSend::new(0..8);
        assert!(s.poll_ranges().is_empty());
        s.handle_final(0..2);
        s.handle_final(5..6);
        assert_eq!(s.poll_ranges(), vec![0..2, 5..6]);
        assert_eq!(s.in_flight(), 2);
        // Final again, overlapping what was posted: only the new layers go.
        s.handle_final(1..5);
        assert_eq!(s.poll_ranges(), vec![2..5]);
        assert!(s.poll_ranges().is_empty());
        for _ in 0..3 {
            assert_eq!(s.outcome(), None);
            s.handle_done(Ok(()));
        }
        assert_eq!(s.outcome(), None, "layers 6..8 are not final yet");
        s.handle_final(6..100);
        assert_eq!(s.poll_ranges(), vec![6..8]);
        assert_eq!(s.outcome(), None);
        s.handle_done(Ok(()));
        assert_eq!(s.outcome(), Some(Ok(())));
    }

    #[test]
    fn send_stops_and_fails_only_once_nothing_is_in_flight() {
        let mut s = LayerSend::new(0..4);
        s.handle_final(0..1);
        assert_eq!(s.poll_ranges(), vec![0..1]);
        s.stop();
        s.handle_final(1..4);
        assert!(s.poll_ranges().is_empty(), "stopped: nothing more is posted");
        assert_eq!(s.outcome(), None, "a WRITE is still in flight");
        s.handle_done(Ok(()));
        assert_eq!(s.outcome(), Some(Err(FailureKind::Aborted)));

        let mut s = LayerSend::new(0..4);
        s.handle_final(0..1);
        s.handle_final(2..3);
        assert_eq!(s.poll_ranges().len(), 2);
        s.handle_done(Err(FailureKind::TransferFailed { status: -2 }));
        s.handle_final(1..4);
        assert!(s.poll_ranges().is_empty(), "failed: nothing more is posted");
        assert_eq!(s.outcome(), None);
        s.handle_done(Ok(()));
        assert_eq!(s.outcome(), Some(Err(FailureKind::TransferFailed { status: -2 })));
    }

    #[test]
    fn restricted_grids_partition_the_whole_plan() {
        let s = small_layout();
        let d = small_layout();
        let ids: Vec<u32> = (0..4).collect();
        let lists = [ids.clone(), ids];
        let input = PlanInput { src: &s, dst: &d, src_blocks: &lists, dst_blocks: &lists, num_tokens: 64 };
        let mut planner = Planner::new();
        let mut whole = Grid::default();
        let st = planner.plan_grid(&input, &mut whole).expect("plans");
        let mut all = Vec::new();
        whole.for_each(|c| all.push(c));
        let mut cut = Grid::default();
        let mut pieces = Vec::new();
        let (mut bytes, mut merged) = (0, 0);
        for layers in [0..1, 1..3, 3..4] {
            let part = restrict_grid(&whole, &s, layers.clone(), &mut cut);
            assert_eq!(part.bytes, cut.bytes());
            assert_eq!(part.merged, cut.copies() as u64);
            bytes += part.bytes;
            merged += part.merged;
            cut.for_each(|c| {
                // Every copy of the cut lies in a region of a layer of the range (2 parts a layer).
                assert!(layers.contains(&(c.src_region / 2)), "{c:?} outside {layers:?}");
                pieces.push(c);
            });
        }
        assert_eq!((bytes, merged), (st.bytes, st.merged));
        pieces.sort();
        all.sort();
        assert_eq!(pieces, all);
        // No layer: an empty plan.
        assert_eq!(restrict_grid(&whole, &s, 4..9, &mut cut), PlanStats::default());
        assert_eq!(cut.copies(), 0);
    }
}
