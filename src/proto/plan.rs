//! Transfer planning: block ids on both sides → merged `(src, dst, len)` copies for one rank pair.
//!
//! Read [`Planner::plan`]. The input is one producer rank's layout and blocks, one consumer rank's
//! layout and blocks, and the token count. The planner
//!
//! 1. finds the KV heads this producer supplies to this consumer ([`tp_sources`]; heterogeneous TP,
//!    replicated heads and latent KV) and the layers both hold (PP);
//! 2. per KV group, finds the tokens to move — the tail the consumer listed (a prefix hit on D
//!    shortens its list), cut to the window for sliding-window groups and widened to whole blocks
//!    where both block sizes are equal ([`whole_blocks`]: the token count is exact, so a window
//!    counts back from the real last token) — and splits them into *pieces*, each inside one block
//!    on both sides (block sizes may differ);
//! 3. turns pieces into copies *relative to a layer's region bases*, merging on the fly. Every layer of
//!    a group has the same geometry, so this relative plan is built once per group and instantiated
//!    per layer by adding region bases: planning cost grows with blocks, not blocks × layers.
//!
//! Copies never cross a region (one region per layer and part; see [`super::merge`]). Output goes into
//! a `Vec` the caller owns and reuses; the planner keeps its scratch buffers between calls.
//!
//! [`Planner::plan_grid`] stops before step 3's instantiation and returns the plan as a [`Grid`]: each
//! group's relative copies (cells) and the layers they repeat over (rows). A fragmented request of
//! 64 layers is 131072 copies but a grid of 2048 cells and 64 rows; a transport that runs grids
//! (the staged one) never sees the expansion.

use core::ops::Range;

use super::layout::{tp_sources, BlockOrder, GroupKind, KvLayout, KvPlacement};
use super::merge::{push_merged, Copy};
use super::msg::{blocks_for, check_block_lists, RangeError};

/// Everything needed to plan one producer rank → consumer rank transfer.
#[derive(Clone, Copy, Debug)]
pub struct PlanInput<'a> {
    /// Layout of the side data is copied from.
    pub src: &'a KvLayout,
    /// Layout of the side data is copied to.
    pub dst: &'a KvLayout,
    /// Source block ids per KV group (tails, as in a registration).
    pub src_blocks: &'a [Vec<u32>],
    /// Destination block ids per KV group (tails).
    pub dst_blocks: &'a [Vec<u32>],
    /// Tokens of the request, exact (the planner widens what moves to whole blocks itself).
    pub num_tokens: u64,
}

/// Counts describing a plan.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanStats {
    /// Copies before merging (one per piece, layer, part and head run).
    pub unmerged: u64,
    /// Copies after merging (the descriptors to post).
    pub merged: u64,
    /// Bytes moved.
    pub bytes: u64,
}

/// Why a transfer cannot be planned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// The two layouts describe different models.
    #[error("source and destination layouts describe different models")]
    ModelMismatch,
    /// The source rank supplies nothing to the destination rank (TP heads or PP layers).
    #[error("source rank {src} writes nothing into destination rank {dst}")]
    NotATarget {
        /// Source rank.
        src: super::ids::Rank,
        /// Destination rank.
        dst: super::ids::Rank,
    },
    /// Source block lists do not fit the source layout.
    #[error("source blocks: {0}")]
    SourceBlocks(#[source] RangeError),
    /// Destination block lists do not fit the destination layout.
    #[error("destination blocks: {0}")]
    DestinationBlocks(#[source] RangeError),
    /// One side keeps K and V side by side in each cell ([`KvPlacement::CellJoint`]) and the other
    /// does not: its cells would have to be split into elements.
    #[error(
        "placements {src:?} (source) and {dst:?} (destination) cannot be mapped: CellJoint pairs only with CellJoint"
    )]
    PlacementMix {
        /// Source placement.
        src: KvPlacement,
        /// Destination placement.
        dst: KvPlacement,
    },
    /// One side packs the tokens of a block by its block size ([`KvPlacement::HeadJoint`]: vLLM's
    /// CPU backend lays tokens out per ISA), and the block sizes differ: a token's bytes in one
    /// block size are not at its place in the other.
    #[error(
        "{src_tokens}-token and {dst_tokens}-token blocks cannot be mapped: HeadJoint blocks (vLLM's CPU backend) \
         pack their tokens by block size; give both sides the same block size"
    )]
    PackedBlockSizes {
        /// Source block size in tokens.
        src_tokens: u32,
        /// Destination block size in tokens.
        dst_tokens: u32,
    },
    /// The destination wants tokens the source's list does not cover.
    #[error("group {group}: destination needs tokens from {needed} but source blocks start at token {held}")]
    MissingSource {
        /// Group index.
        group: usize,
        /// First token the destination needs.
        needed: u64,
        /// First token the source lists.
        held: u64,
    },
}

/// `tokens` widened to the whole blocks that hold them where both sides' blocks are the same size;
/// unchanged otherwise.
///
/// A request is named by its exact token count, so a sliding window counts back from its real last
/// token; what moves is whole blocks: backends may lay a block's tokens out by block size (vLLM's
/// CPU backend packs them per ISA, [`KvPlacement::HeadJoint`]), so a copy of part of a block could
/// garble them. The extra slots are the tail of the last block (D overwrites it as it appends) and
/// the head of a window's first block (tokens D may hold but never attends to). With different block
/// sizes no block maps onto one block of the other side: the exact tokens move (packed layouts of
/// different sizes are refused before this).
pub fn whole_blocks(tokens: Range<u64>, src_block_tokens: u32, dst_block_tokens: u32) -> Range<u64> {
    if src_block_tokens != dst_block_tokens || tokens.is_empty() {
        return tokens;
    }
    let bt = u64::from(dst_block_tokens.max(1));
    tokens.start / bt * bt..tokens.end.div_ceil(bt) * bt
}

/// A token run that lies inside one block on each side.
#[derive(Clone, Copy, Debug)]
struct Piece {
    src_block: u32,
    src_tok: u32,
    dst_block: u32,
    dst_tok: u32,
    tokens: u32,
    /// 0 for a partial block; n ≥ 1 for n whole blocks with consecutive ids on both sides
    /// (`src_block..src_block + n`, `dst_block..dst_block + n`).
    run: u32,
}

/// Byte geometry of one side, precomputed.
#[derive(Clone, Copy, Debug)]
struct Geo {
    order: BlockOrder,
    block_tokens: u64,
    heads: u64,
    elem: u64,
    stride: u64,
    part_bytes: u64,
    placement: KvPlacement,
}

impl Geo {
    fn of(l: &KvLayout) -> Geo {
        let elem = u64::from(l.model.head_dim) * l.model.dtype.size();
        // A CellJoint cell is K then V of one head and token, and both always move: plan it as one
        // part whose element is the whole cell (the planner pairs CellJoint only with CellJoint).
        let (placement, elem, part_bytes) = match l.placement {
            KvPlacement::CellJoint => (KvPlacement::Single, 2 * elem, 2 * l.part_bytes()),
            p => (p, elem, l.part_bytes()),
        };
        Geo {
            order: l.order,
            block_tokens: l.block_tokens.into(),
            heads: l.local_heads().into(),
            elem,
            stride: l.block_stride,
            part_bytes,
            placement,
        }
    }

    /// (region part index, byte offset from the region base) of an element run's start.
    #[inline]
    fn at(&self, block: u32, part: u32, tok: u64, head: u64) -> (u32, u64) {
        let (rp, part_off, head_span) = match self.placement {
            KvPlacement::Separate => (part, 0, 1),
            KvPlacement::Joint => (0, u64::from(part) * self.part_bytes, 1),
            KvPlacement::Single | KvPlacement::CellJoint => (0, 0, 1),
            // Each head holds its K tokens then its V tokens (validated: Hnd only).
            KvPlacement::HeadJoint => (0, u64::from(part) * self.block_tokens * self.elem, 2),
        };
        let within = match self.order {
            BlockOrder::Hnd => (head * head_span * self.block_tokens + tok) * self.elem,
            BlockOrder::Nhd => (tok * self.heads + head) * self.elem,
        };
        (rp, u64::from(block) * self.stride + part_off + within)
    }
}

/// A plan in grid form: per KV group, the copies of one layer relative to that layer's regions
/// (*cells*) and the layers they repeat over (*rows*). Expanded ([`Grid::for_each`]) it is exactly
/// what [`Planner::plan`] returns, in the same order: group by group, row by row, cell by cell.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Grid {
    /// Relative copies: `src_region`/`dst_region` is the part index within a row (below
    /// [`KvPlacement::regions_per_layer`]), `src_addr`/`dst_addr` the offset from that part's base.
    pub cells: Vec<Copy>,
    /// Rows (layers).
    pub rows: Vec<GridRow>,
    /// Groups: which cells repeat over which rows.
    pub groups: Vec<GridGroup>,
}

/// One row of a [`Grid`]: a layer's regions on both sides.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GridRow {
    /// Region id of the row's part 0 on the source side (part `p` is `src_region + p`)...
    pub src_region: u32,
    /// ...and on the destination side.
    pub dst_region: u32,
    /// Base address of each part on the source side (unused parts 0)...
    pub src: [u64; 2],
    /// ...and on the destination side.
    pub dst: [u64; 2],
}

/// One group of a [`Grid`]: cells `cells` repeat over rows `rows` (indices into the grid's vectors).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GridGroup {
    /// Index range into [`Grid::cells`].
    pub cells: Range<usize>,
    /// Index range into [`Grid::rows`].
    pub rows: Range<usize>,
}

impl GridGroup {
    /// Copies this group expands to.
    pub fn copies(&self) -> usize {
        self.cells.len() * self.rows.len()
    }
}

impl Grid {
    /// Empties the grid, keeping its allocations.
    pub fn clear(&mut self) {
        self.cells.clear();
        self.rows.clear();
        self.groups.clear();
    }

    /// Copies the grid expands to.
    pub fn copies(&self) -> usize {
        self.groups.iter().map(GridGroup::copies).sum()
    }

    /// Bytes the grid moves.
    pub fn bytes(&self) -> u64 {
        self.groups
            .iter()
            .map(|g| self.cells[g.cells.clone()].iter().map(|c| c.len).sum::<u64>() * g.rows.len() as u64)
            .sum()
    }

    /// Cell `c` instantiated in row `r`: an absolute copy.
    #[inline]
    pub fn at(&self, r: &GridRow, c: &Copy) -> Copy {
        Copy {
            src_region: r.src_region + c.src_region,
            dst_region: r.dst_region + c.dst_region,
            src_addr: r.src[c.src_region as usize] + c.src_addr,
            dst_addr: r.dst[c.dst_region as usize] + c.dst_addr,
            len: c.len,
        }
    }

    /// Calls `f` with every copy, in order.
    pub fn for_each(&self, mut f: impl FnMut(Copy)) {
        for g in &self.groups {
            for r in &self.rows[g.rows.clone()] {
                for c in &self.cells[g.cells.clone()] {
                    f(self.at(r, c));
                }
            }
        }
    }
}

/// Plans transfers; keeps scratch buffers so repeated calls do not allocate.
#[derive(Debug, Default)]
pub struct Planner {
    pieces: Vec<Piece>,
    rel: Vec<Copy>,
    grid: Grid,
}

impl Planner {
    /// A planner with empty scratch buffers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Plans the copies of `input` into `out` (cleared first), merged. On error `out` is left empty.
    ///
    /// Merging is streaming, in token order: runs contiguous on both sides merge whenever their
    /// blocks ascend together (what allocators hand out); a run listed in descending order on both
    /// sides stays one copy per block.
    pub fn plan(&mut self, input: &PlanInput<'_>, out: &mut Vec<Copy>) -> Result<PlanStats, PlanError> {
        out.clear();
        let mut grid = std::mem::take(&mut self.grid);
        let result = self.plan_grid(input, &mut grid);
        if result.is_ok() {
            out.reserve(grid.copies());
            grid.for_each(|c| out.push(c));
        }
        self.grid = grid;
        result
    }

    /// Plans `input` into `grid` (cleared first) without expanding it: [`Planner::plan`]'s copies
    /// and counts, in grid form. On error `grid` is left empty.
    pub fn plan_grid(&mut self, input: &PlanInput<'_>, grid: &mut Grid) -> Result<PlanStats, PlanError> {
        let result = self.plan_inner(input, grid);
        if result.is_err() {
            grid.clear();
        }
        result
    }

    fn plan_inner(&mut self, input: &PlanInput<'_>, grid: &mut Grid) -> Result<PlanStats, PlanError> {
        grid.clear();
        let (src, dst) = (input.src, input.dst);
        if src.model != dst.model {
            return Err(PlanError::ModelMismatch);
        }
        check_block_lists(input.src_blocks, input.num_tokens, src).map_err(PlanError::SourceBlocks)?;
        check_block_lists(input.dst_blocks, input.num_tokens, dst).map_err(PlanError::DestinationBlocks)?;
        let not_target = PlanError::NotATarget { src: src.parallel.rank(), dst: dst.parallel.rank() };
        let heads = tp_sources(&src.model, src.parallel.tp_size, dst.parallel.tp_size, dst.parallel.tp_rank)
            .into_iter()
            .find(|s| s.tp_rank == src.parallel.tp_rank)
            .map(|s| s.heads)
            .ok_or(not_target.clone())?;
        let (sl, dl) = (src.layer_range(), dst.layer_range());
        let layers = sl.start.max(dl.start)..sl.end.min(dl.end);
        if layers.is_empty() {
            return Err(not_target);
        }
        let cells = (src.placement == KvPlacement::CellJoint, dst.placement == KvPlacement::CellJoint);
        if cells.0 != cells.1 {
            return Err(PlanError::PlacementMix { src: src.placement, dst: dst.placement });
        }
        let packed = src.placement == KvPlacement::HeadJoint || dst.placement == KvPlacement::HeadJoint;
        if packed && src.block_tokens != dst.block_tokens {
            return Err(PlanError::PackedBlockSizes { src_tokens: src.block_tokens, dst_tokens: dst.block_tokens });
        }
        // Parts the planner moves per block: a CellJoint cell is one (see `Geo::of`).
        let parts = if cells.0 { 1 } else { src.parts() };
        let (gs, gd) = (Geo::of(src), Geo::of(dst));
        let (src_heads, dst_heads) = (src.head_range(), dst.head_range());
        let slice = Heads {
            src_first: u64::from(heads.start - src_heads.start),
            dst_first: u64::from(heads.start - dst_heads.start),
            count: u64::from(heads.end - heads.start),
        };
        let (per_s, per_d) = (src.placement.regions_per_layer(), dst.placement.regions_per_layer());
        let mut stats = PlanStats::default();
        for (g, group) in src.model.groups.iter().enumerate() {
            let group_layers = group.layers.iter().copied().filter(|l| layers.contains(l));
            let n_layers = group_layers.clone().count() as u64;
            if n_layers == 0 {
                continue;
            }
            let tokens = match self.tokens(g, group.kind, input)? {
                Some(t) => t,
                None => continue,
            };
            self.pieces_for(g, tokens, input);
            let unmerged = self.relative_copies(&gs, &gd, &slice, parts);
            stats.unmerged += unmerged * n_layers;
            let (cells, rows) = (grid.cells.len(), grid.rows.len());
            grid.cells.extend_from_slice(&self.rel);
            let bases = |l: &KvLayout, first: u32, per: u32| {
                let at = |p: u32| if p < per { l.region_bases[(first + p) as usize] } else { 0 };
                [at(0), at(1)]
            };
            for layer in group_layers {
                let (s0, d0) = ((layer - sl.start) * per_s, (layer - dl.start) * per_d);
                grid.rows.push(GridRow {
                    src_region: s0,
                    dst_region: d0,
                    src: bases(src, s0, per_s),
                    dst: bases(dst, d0, per_d),
                });
            }
            let group = GridGroup { cells: cells..grid.cells.len(), rows: rows..grid.rows.len() };
            stats.merged += group.copies() as u64;
            grid.groups.push(group);
            let group_bytes: u64 = self.rel.iter().map(|c| c.len).sum();
            stats.bytes += group_bytes * n_layers;
        }
        Ok(stats)
    }

    /// The token range of group `g` to move, or `None` if the destination needs nothing.
    fn tokens(&self, g: usize, kind: GroupKind, input: &PlanInput<'_>) -> Result<Option<Range<u64>>, PlanError> {
        let n = input.num_tokens;
        let first_listed = |blocks: &[u32], block_tokens: u32| {
            (blocks_for(n, block_tokens) - blocks.len() as u64) * u64::from(block_tokens)
        };
        let mut start = first_listed(&input.dst_blocks[g], input.dst.block_tokens);
        if let GroupKind::SlidingWindow { window_tokens } = kind {
            start = start.max(n.saturating_sub(window_tokens.into()));
        }
        if start >= n {
            return Ok(None);
        }
        let held = first_listed(&input.src_blocks[g], input.src.block_tokens);
        if held > start {
            return Err(PlanError::MissingSource { group: g, needed: start, held });
        }
        Ok(Some(whole_blocks(start..n, input.src.block_tokens, input.dst.block_tokens)))
    }

    /// Splits `tokens` into pieces inside one block on each side (no division in the loop).
    fn pieces_for(&mut self, g: usize, tokens: Range<u64>, input: &PlanInput<'_>) {
        self.pieces.clear();
        let (bts, btd) = (u64::from(input.src.block_tokens), u64::from(input.dst.block_tokens));
        let (ls, ld) = (&input.src_blocks[g], &input.dst_blocks[g]);
        let n = input.num_tokens;
        let skip_s = blocks_for(n, input.src.block_tokens) - ls.len() as u64;
        let skip_d = blocks_for(n, input.dst.block_tokens) - ld.len() as u64;
        let mut t = tokens.start;
        // Indices into the lists; `tokens()` guaranteed both cover `tokens`.
        let mut is = (t / bts - skip_s) as usize;
        let mut id = (t / btd - skip_d) as usize;
        let mut os = t % bts;
        let mut od = t % btd;
        while t < tokens.end {
            let take = (bts - os).min(btd - od).min(tokens.end - t);
            let (sb, db) = (ls[is], ld[id]);
            let whole = take == bts && take == btd;
            let extends = whole
                && self.pieces.last().is_some_and(|l| {
                    l.run > 0 && l.src_block.wrapping_add(l.run) == sb && l.dst_block.wrapping_add(l.run) == db
                });
            match self.pieces.last_mut() {
                Some(last) if extends => last.run += 1,
                _ => self.pieces.push(Piece {
                    src_block: sb,
                    src_tok: os as u32,
                    dst_block: db,
                    dst_tok: od as u32,
                    tokens: take as u32,
                    run: u32::from(whole),
                }),
            }
            t += take;
            os += take;
            od += take;
            if os == bts {
                os = 0;
                is += 1;
            }
            if od == btd {
                od = 0;
                id += 1;
            }
        }
    }

    /// Builds the merged relative plan of the current pieces into `self.rel`; returns the number of
    /// copies before merging.
    fn relative_copies(&mut self, gs: &Geo, gd: &Geo, slice: &Heads, parts: u32) -> u64 {
        self.rel.clear();
        let mut emitted = 0u64;
        let rel = &mut self.rel;
        let pieces = &self.pieces;
        // Emit in address order: when both sides keep a block's parts together, piece by piece;
        // otherwise part by part (each part is its own region on at least one side).
        let interleaved = |p: KvPlacement| matches!(p, KvPlacement::Joint | KvPlacement::HeadJoint);
        let piece_major = interleaved(gs.placement) && interleaved(gd.placement);
        // Whole blocks with consecutive ids are one contiguous range per part on both sides when
        // a block's part is contiguous for the heads moved and parts are not interleaved.
        let dense = slice.count == gs.heads
            && slice.count == gd.heads
            && gs.order == gd.order
            && gs.stride == gs.part_bytes
            && gd.stride == gd.part_bytes
            && !interleaved(gs.placement)
            && !interleaved(gd.placement);
        let by_head = gs.placement == KvPlacement::HeadJoint || gd.placement == KvPlacement::HeadJoint;
        if piece_major {
            // Block by block, K then V of each (runs are expanded: parts interleave in memory).
            for p in pieces {
                for i in 0..p.run.max(1) {
                    let one = Piece { src_block: p.src_block + i, dst_block: p.dst_block + i, run: p.run.min(1), ..*p };
                    for part in 0..parts {
                        emitted += emit_piece(rel, gs, gd, slice, &one, part);
                    }
                }
            }
        } else {
            for part in 0..parts {
                for p in pieces {
                    emitted += emit(rel, gs, gd, slice, p, part, dense);
                }
            }
        }
        if by_head {
            // A head's K and V (and the next head's) follow each other in memory but are emitted
            // part by part: put them in address order and merge what is contiguous on both sides.
            crate::proto::merge::merge_unordered(rel);
        }
        emitted
    }
}

/// The heads moved, as local indices on each side.
#[derive(Clone, Copy, Debug)]
struct Heads {
    src_first: u64,
    dst_first: u64,
    count: u64,
}

/// Emits the copies of one piece (or run of whole blocks) and part; returns the copies before merging.
#[inline]
fn emit(rel: &mut Vec<Copy>, gs: &Geo, gd: &Geo, h: &Heads, p: &Piece, part: u32, dense: bool) -> u64 {
    if p.run <= 1 {
        return emit_piece(rel, gs, gd, h, p, part);
    }
    if dense {
        let (s, d) = (gs.at(p.src_block, part, 0, 0), gd.at(p.dst_block, part, 0, 0));
        let len = u64::from(p.run) * gs.part_bytes;
        push_merged(rel, Copy { src_region: s.0, dst_region: d.0, src_addr: s.1, dst_addr: d.1, len });
        let per_block = if gs.order == BlockOrder::Hnd { h.count } else { 1 };
        return u64::from(p.run) * per_block;
    }
    let mut n = 0;
    for i in 0..p.run {
        let one = Piece { src_block: p.src_block + i, dst_block: p.dst_block + i, run: 1, ..*p };
        n += emit_piece(rel, gs, gd, h, &one, part);
    }
    n
}

/// Emits the copies of one piece and part at the coarsest granularity contiguous on both sides.
#[inline]
fn emit_piece(rel: &mut Vec<Copy>, gs: &Geo, gd: &Geo, h: &Heads, p: &Piece, part: u32) -> u64 {
    let n = u64::from(p.tokens);
    let (st, dt) = (u64::from(p.src_tok), u64::from(p.dst_tok));
    let mut one = |s: (u32, u64), d: (u32, u64), len: u64| {
        push_merged(rel, Copy { src_region: s.0, dst_region: d.0, src_addr: s.1, dst_addr: d.1, len });
    };
    let elem = gs.elem;
    match (gs.order, gd.order) {
        (BlockOrder::Hnd, BlockOrder::Hnd) => {
            for i in 0..h.count {
                one(
                    gs.at(p.src_block, part, st, h.src_first + i),
                    gd.at(p.dst_block, part, dt, h.dst_first + i),
                    n * elem,
                );
            }
            h.count
        }
        (BlockOrder::Nhd, BlockOrder::Nhd) if h.count == gs.heads && h.count == gd.heads => {
            one(gs.at(p.src_block, part, st, 0), gd.at(p.dst_block, part, dt, 0), n * h.count * elem);
            1
        }
        (BlockOrder::Nhd, BlockOrder::Nhd) => {
            for t in 0..n {
                one(
                    gs.at(p.src_block, part, st + t, h.src_first),
                    gd.at(p.dst_block, part, dt + t, h.dst_first),
                    h.count * elem,
                );
            }
            n
        }
        _ => {
            for i in 0..h.count {
                for t in 0..n {
                    one(
                        gs.at(p.src_block, part, st + t, h.src_first + i),
                        gd.at(p.dst_block, part, dt + t, h.dst_first + i),
                        elem,
                    );
                }
            }
            n * h.count
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::layout::{DType, KvGroup, KvKind, ModelShape, Parallel};

    fn model(layers: u32, heads: u32, groups: Vec<KvGroup>) -> ModelShape {
        ModelShape {
            total_layers: layers,
            kv_heads: heads,
            head_dim: 4,
            dtype: DType::F16,
            kind: KvKind::KeyValue,
            groups,
        }
    }

    /// Two layers, one head: layer 0 in a full-attention group, layer 1 in a sliding window of
    /// `window_tokens` tokens.
    fn full_and_window(window_tokens: u32) -> ModelShape {
        let groups = vec![
            KvGroup { kind: GroupKind::Full, layers: vec![0] },
            KvGroup { kind: GroupKind::SlidingWindow { window_tokens }, layers: vec![1] },
        ];
        model(2, 1, groups)
    }

    fn full(layers: u32) -> Vec<KvGroup> {
        vec![KvGroup { kind: GroupKind::Full, layers: (0..layers).collect() }]
    }

    fn layout(
        m: &ModelShape,
        bt: u32,
        order: BlockOrder,
        placement: KvPlacement,
        par: Parallel,
        base: u64,
    ) -> KvLayout {
        let mut l = KvLayout {
            model: m.clone(),
            block_tokens: bt,
            order,
            placement,
            block_stride: 0,
            num_blocks: 64,
            parallel: par,
            region_bases: Vec::new(),
        };
        l.block_stride = l.part_bytes() * u64::from(placement.parts_in_block());
        let n = l.layer_range().len() as u64 * u64::from(placement.regions_per_layer());
        l.region_bases = (0..n).map(|i| base + i * (1 << 20)).collect();
        l.validate().expect("test layout is valid");
        l
    }

    /// Single-rank source (regions from 1 GiB) and destination (from 16 GiB) layouts of `m`, with
    /// their block tokens and placements.
    fn single_rank(
        m: &ModelShape,
        block_tokens: (u32, u32),
        order: BlockOrder,
        placement: (KvPlacement, KvPlacement),
    ) -> (KvLayout, KvLayout) {
        let s = layout(m, block_tokens.0, order, placement.0, Parallel::SINGLE, 1 << 30);
        let d = layout(m, block_tokens.1, order, placement.1, Parallel::SINGLE, 1 << 34);
        (s, d)
    }

    #[test]
    fn contiguous_blocks_merge_to_one_copy_per_layer_and_part() {
        let m = model(3, 2, full(3));
        let (s, d) = single_rank(&m, (16, 16), BlockOrder::Hnd, (KvPlacement::Separate, KvPlacement::Separate));
        let ids: Vec<u32> = (10..20).collect();
        let input = PlanInput {
            src: &s,
            dst: &d,
            src_blocks: std::slice::from_ref(&ids),
            dst_blocks: std::slice::from_ref(&ids),
            num_tokens: 160,
        };
        let mut out = Vec::new();
        let st = Planner::new().plan(&input, &mut out).expect("plans");
        assert_eq!(out.len(), 3 * 2);
        assert_eq!(st.merged, 6);
        // 10 blocks x 2 heads per layer and part before merging.
        assert_eq!(st.unmerged, 3 * 2 * 10 * 2);
        assert_eq!(st.bytes, 3 * 2 * 10 * s.part_bytes());
        assert_eq!(out[0].src_addr, (1 << 30) + 10 * s.block_stride);
        assert_eq!(out[0].len, 10 * s.part_bytes());
    }

    #[test]
    fn joint_placement_merges_k_and_v_of_consecutive_blocks() {
        let m = model(1, 2, full(1));
        let (s, d) = single_rank(&m, (16, 16), BlockOrder::Nhd, (KvPlacement::Joint, KvPlacement::Joint));
        let input =
            PlanInput { src: &s, dst: &d, src_blocks: &[vec![3, 4, 5]], dst_blocks: &[vec![7, 8, 9]], num_tokens: 48 };
        let mut out = Vec::new();
        Planner::new().plan(&input, &mut out).expect("plans");
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].len, 3 * s.block_stride);
    }

    #[test]
    fn prefix_hit_on_destination_writes_only_the_tail() {
        let m = model(1, 1, full(1));
        let (s, d) = single_rank(&m, (16, 32), BlockOrder::Hnd, (KvPlacement::Separate, KvPlacement::Separate));
        // 100 tokens: P has 7 blocks of 16, D lists only its last 2 of 4 blocks of 32 (tokens 64..100).
        let src_ids: Vec<u32> = (0..7).collect();
        let input =
            PlanInput { src: &s, dst: &d, src_blocks: &[src_ids], dst_blocks: &[vec![40, 41]], num_tokens: 100 };
        let mut out = Vec::new();
        let st = Planner::new().plan(&input, &mut out).expect("plans");
        let elem = 4 * 2;
        assert_eq!(st.bytes, 2 * 36 * elem);
        // Source blocks 4.. hold tokens 64..; they are contiguous, as are D's 40, 41.
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].src_addr, (1 << 30) + 4 * s.block_stride);
        assert_eq!(out[0].dst_addr, (1 << 34) + 40 * d.block_stride);
    }

    #[test]
    fn sliding_window_moves_only_the_window() {
        let m = full_and_window(20);
        let (s, d) = single_rank(&m, (16, 16), BlockOrder::Hnd, (KvPlacement::Separate, KvPlacement::Separate));
        let ids: Vec<u32> = (0..4).collect();
        let input = PlanInput {
            src: &s,
            dst: &d,
            src_blocks: &[ids.clone(), ids.clone()],
            dst_blocks: &[ids.clone(), ids],
            num_tokens: 64,
        };
        let mut out = Vec::new();
        let st = Planner::new().plan(&input, &mut out).expect("plans");
        let elem = 8;
        // Full group: 64 tokens x K,V; window group: the last 20 tokens (44..64) in whole blocks:
        // 32..64, x K,V.
        assert_eq!(st.bytes, (64 + 32) * 2 * elem);
    }

    #[test]
    fn window_counts_back_from_the_exact_count_and_moves_whole_blocks() {
        let m = full_and_window(20);
        let elem = 8;
        let plan = |bts: (u32, u32), n: u64| {
            let (s, d) = single_rank(&m, bts, BlockOrder::Hnd, (KvPlacement::Separate, KvPlacement::Separate));
            let (ls, ld): (Vec<u32>, Vec<u32>) =
                ((0..blocks_for(n, bts.0) as u32).collect(), (0..blocks_for(n, bts.1) as u32).collect());
            let lists: (Vec<Vec<u32>>, Vec<Vec<u32>>) = (vec![ls.clone(), ls], vec![ld.clone(), ld]);
            let input = PlanInput { src: &s, dst: &d, src_blocks: &lists.0, dst_blocks: &lists.1, num_tokens: n };
            let mut out = Vec::new();
            let st = Planner::new().plan(&input, &mut out).expect("plans");
            (st.bytes, out)
        };
        // 50 tokens in 16-token blocks: the window is tokens 30..50, in blocks 1..4 (tokens 16..64);
        // the full group's 50 tokens are blocks 0..4 (0..64). Counted back from 64 (the count rounded
        // up) the window would start at token 44 and miss 30..44.
        let (bytes, out) = plan((16, 16), 50);
        assert_eq!(bytes, (64 + 48) * 2 * elem);
        // Every copy is whole blocks: 16 tokens of one head (the layouts' blocks are one head).
        assert!(out.iter().all(|c| c.len % (16 * elem) == 0 && c.src_addr % (16 * elem) == 0), "{out:?}");
        // Different block sizes: the exact tokens, the window from token 30.
        let (bytes, _) = plan((16, 32), 50);
        assert_eq!(bytes, (50 + 20) * 2 * elem);
        assert_eq!(whole_blocks(30..50, 16, 16), 16..64);
        assert_eq!(whole_blocks(30..50, 16, 32), 30..50);
        assert_eq!(whole_blocks(32..48, 16, 16), 32..48);
    }

    #[test]
    fn grid_is_compact_and_expands_to_the_plan() {
        // Two groups (full and sliding window), Separate on one side and Joint on the other,
        // fragmented ids: one cell per block and part, one row per layer, and the expansion is the
        // plan, copy for copy.
        let groups = vec![
            KvGroup { kind: GroupKind::Full, layers: vec![0, 2, 3] },
            KvGroup { kind: GroupKind::SlidingWindow { window_tokens: 32 }, layers: vec![1] },
        ];
        let m = model(4, 2, groups);
        let (s, d) = single_rank(&m, (16, 16), BlockOrder::Hnd, (KvPlacement::Separate, KvPlacement::Joint));
        let src_ids: Vec<u32> = (0..8).map(|i| (i * 5) % 8).collect();
        let dst_ids: Vec<u32> = (0..8).map(|i| 40 - 3 * i).collect();
        let input = PlanInput {
            src: &s,
            dst: &d,
            src_blocks: &[src_ids.clone(), src_ids],
            dst_blocks: &[dst_ids.clone(), dst_ids],
            num_tokens: 128,
        };
        let mut planner = Planner::new();
        let mut grid = Grid::default();
        let st = planner.plan_grid(&input, &mut grid).expect("plans");
        let mut out = Vec::new();
        assert_eq!(planner.plan(&input, &mut out).expect("plans"), st);
        assert_eq!(grid.groups.len(), 2);
        // Full group: one cell per block and part (a block's heads are contiguous on both sides).
        assert_eq!(grid.groups[0].rows.len(), 3);
        assert_eq!(grid.groups[0].cells.len(), 8 * 2);
        // Window of 32 tokens: the last 2 blocks.
        assert_eq!(grid.groups[1].rows.len(), 1);
        assert_eq!(grid.groups[1].cells.len(), 2 * 2);
        assert_eq!(grid.copies() as u64, st.merged);
        assert_eq!(grid.bytes(), st.bytes);
        let mut expanded = Vec::new();
        grid.for_each(|c| expanded.push(c));
        assert_eq!(expanded, out);
        assert!(grid.cells.iter().all(|c| c.src_region < 2 && c.dst_region < 1));
        // Layer 2 (the full group's second row): source regions 4 and 5, destination region 2.
        let row = grid.rows[grid.groups[0].rows.start + 1];
        assert_eq!((row.src_region, row.dst_region), (4, 2));
        assert_eq!(row.src, [s.region_bases[4], s.region_bases[5]]);
        assert_eq!(row.dst, [d.region_bases[2], 0]);
        // An error leaves the grid empty.
        let far = vec![vec![1000u32; 8], vec![1000u32; 8]];
        let bad = PlanInput { dst_blocks: &far, ..input };
        assert!(matches!(planner.plan_grid(&bad, &mut grid), Err(PlanError::DestinationBlocks(_))));
        assert_eq!(grid, Grid::default());
    }

    #[test]
    fn tp_four_to_two_writes_a_head_slice() {
        let m = model(1, 8, full(1));
        let par = |r, n| Parallel { tp_rank: r, tp_size: n, pp_rank: 0, pp_size: 1 };
        let s = layout(&m, 16, BlockOrder::Hnd, KvPlacement::Separate, par(1, 4), 1 << 30);
        let d = layout(&m, 16, BlockOrder::Hnd, KvPlacement::Separate, par(0, 2), 1 << 34);
        let input = PlanInput { src: &s, dst: &d, src_blocks: &[vec![0]], dst_blocks: &[vec![5]], num_tokens: 16 };
        let mut out = Vec::new();
        Planner::new().plan(&input, &mut out).expect("plans");
        // P rank 1 holds heads 2,3 = D rank 0's local heads 2,3: one run per part.
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].src_addr, 1 << 30);
        assert_eq!(out[0].dst_addr, (1 << 34) + 5 * d.block_stride + 2 * 16 * 8);
        // P rank 1 does not write into D rank 1.
        let d1 = layout(&m, 16, BlockOrder::Hnd, KvPlacement::Separate, par(1, 2), 1 << 34);
        let input = PlanInput { dst: &d1, ..input };
        assert!(matches!(Planner::new().plan(&input, &mut out), Err(PlanError::NotATarget { .. })));
    }

    #[test]
    fn bad_inputs_are_errors() {
        let m = model(1, 1, full(1));
        let (s, d) = single_rank(&m, (16, 16), BlockOrder::Hnd, (KvPlacement::Separate, KvPlacement::Separate));
        let mut out = Vec::new();
        let mut p = Planner::new();
        let bad_id = PlanInput { src: &s, dst: &d, src_blocks: &[vec![64]], dst_blocks: &[vec![0]], num_tokens: 16 };
        assert!(matches!(p.plan(&bad_id, &mut out), Err(PlanError::SourceBlocks(RangeError::BlockId { .. }))));
        let short_src =
            PlanInput { src: &s, dst: &d, src_blocks: &[vec![1]], dst_blocks: &[vec![0, 1]], num_tokens: 32 };
        assert!(matches!(p.plan(&short_src, &mut out), Err(PlanError::MissingSource { needed: 0, held: 16, .. })));
        let mut other = d.clone();
        other.model.head_dim = 8;
        let mismatch =
            PlanInput { src: &s, dst: &other, src_blocks: &[vec![1]], dst_blocks: &[vec![0]], num_tokens: 16 };
        assert_eq!(p.plan(&mismatch, &mut out), Err(PlanError::ModelMismatch));
    }

    #[test]
    fn cell_joint_moves_whole_cells_of_the_heads_moved() {
        // [heads, tokens, K‖V]: P TP 1 (2 heads) into D TP 2 rank 1 (head 1), 16 → 32 token blocks.
        let m = model(1, 2, full(1));
        let par = |tp_rank, tp_size| Parallel { tp_rank, tp_size, pp_rank: 0, pp_size: 1 };
        let s = layout(&m, 16, BlockOrder::Hnd, KvPlacement::CellJoint, par(0, 1), 1 << 30);
        let d = layout(&m, 32, BlockOrder::Hnd, KvPlacement::CellJoint, par(1, 2), 1 << 34);
        let input = PlanInput { src: &s, dst: &d, src_blocks: &[vec![3, 4]], dst_blocks: &[vec![9]], num_tokens: 32 };
        let mut out = Vec::new();
        let st = Planner::new().plan(&input, &mut out).expect("plans");
        let cell = 2 * 4 * 2; // K and V of 4 f16 elements
        assert_eq!(st.bytes, 32 * cell);
        // Head 1 of each P block (16 cells after head 0's) into D's only head, tokens 0.. and 16...
        assert_eq!(out.len(), 2);
        assert_eq!(
            (out[0].src_addr, out[0].dst_addr),
            ((1 << 30) + 3 * s.block_stride + 16 * cell, (1 << 34) + 9 * d.block_stride)
        );
        assert_eq!(out[1].src_addr, (1 << 30) + 4 * s.block_stride + 16 * cell);
        assert_eq!(out[1].dst_addr, (1 << 34) + 9 * d.block_stride + 16 * cell);
        assert!(out.iter().all(|c| c.len == 16 * cell));
        // NHD cells: the token's cells of the heads moved, one copy per token.
        let s = layout(&m, 16, BlockOrder::Nhd, KvPlacement::CellJoint, par(0, 1), 1 << 30);
        let d = layout(&m, 16, BlockOrder::Nhd, KvPlacement::CellJoint, par(1, 2), 1 << 34);
        let input = PlanInput { src: &s, dst: &d, src_blocks: &[vec![2]], dst_blocks: &[vec![5]], num_tokens: 16 };
        Planner::new().plan(&input, &mut out).expect("plans");
        assert_eq!(out.len(), 16);
        assert_eq!(
            (out[1].src_addr, out[1].dst_addr, out[1].len),
            ((1 << 30) + 2 * s.block_stride + (2 + 1) * cell, (1 << 34) + 5 * d.block_stride + cell, cell)
        );
    }

    #[test]
    fn head_joint_blocks_of_different_sizes_are_refused() {
        let m = model(1, 2, full(1));
        for placements in
            [(KvPlacement::HeadJoint, KvPlacement::HeadJoint), (KvPlacement::Separate, KvPlacement::HeadJoint)]
        {
            let (s, d) = single_rank(&m, (16, 32), BlockOrder::Hnd, placements);
            let input =
                PlanInput { src: &s, dst: &d, src_blocks: &[vec![1, 2]], dst_blocks: &[vec![0]], num_tokens: 32 };
            let mut out = Vec::new();
            assert_eq!(
                Planner::new().plan(&input, &mut out),
                Err(PlanError::PackedBlockSizes { src_tokens: 16, dst_tokens: 32 })
            );
        }
        // Same block sizes: whole blocks map byte for byte.
        let (s, d) = single_rank(&m, (16, 16), BlockOrder::Hnd, (KvPlacement::HeadJoint, KvPlacement::HeadJoint));
        let input = PlanInput { src: &s, dst: &d, src_blocks: &[vec![1]], dst_blocks: &[vec![0]], num_tokens: 16 };
        assert!(Planner::new().plan(&input, &mut Vec::new()).is_ok());
    }

    #[test]
    fn cell_joint_pairs_only_with_cell_joint() {
        let m = model(1, 2, full(1));
        let (s, d) = single_rank(&m, (16, 16), BlockOrder::Hnd, (KvPlacement::CellJoint, KvPlacement::HeadJoint));
        let input = PlanInput { src: &s, dst: &d, src_blocks: &[vec![1]], dst_blocks: &[vec![0]], num_tokens: 16 };
        let mut out = Vec::new();
        assert_eq!(
            Planner::new().plan(&input, &mut out),
            Err(PlanError::PlacementMix { src: KvPlacement::CellJoint, dst: KvPlacement::HeadJoint })
        );
    }

    /// A hybrid layout as vLLM's hybrid allocator makes it: layers 0, 2 full attention, layers 1, 3 a
    /// `window`-token sliding window, each window layer sharing the K and V regions of the full
    /// layer before it. Regions from `base`, 1 MiB apart.
    fn hybrid(bt: u32, window: u32, base: u64) -> KvLayout {
        let groups = vec![
            KvGroup { kind: GroupKind::Full, layers: vec![0, 2] },
            KvGroup { kind: GroupKind::SlidingWindow { window_tokens: window }, layers: vec![1, 3] },
        ];
        let mut l = layout(&model(4, 2, groups), bt, BlockOrder::Hnd, KvPlacement::Separate, Parallel::SINGLE, base);
        let at = |i: u64| base + i * (1 << 20);
        l.region_bases = vec![at(0), at(1), at(0), at(1), at(2), at(3), at(2), at(3)];
        l.validate().expect("shared regions of two groups are valid");
        l
    }

    /// The distinct regions of `l` as byte arrays, each byte set by `fill(region, offset)`.
    fn memory(l: &KvLayout, fill: impl Fn(usize, u64) -> u8) -> Vec<(u64, Vec<u8>)> {
        l.distinct_regions()
            .into_iter()
            .map(|i| (l.region_bases[i], (0..l.region_len()).map(|o| fill(i, o)).collect()))
            .collect()
    }

    /// The bytes at `addr..addr + len` of `mem`; panics when they are in no region.
    fn bytes_at(mem: &mut [(u64, Vec<u8>)], addr: u64, len: u64) -> &mut [u8] {
        let (base, buf) = mem
            .iter_mut()
            .find(|(b, v)| *b <= addr && addr + len <= *b + v.len() as u64)
            .unwrap_or_else(|| panic!("{addr:#x}+{len} is in no region"));
        let off = (addr - *base) as usize;
        &mut buf[off..off + len as usize]
    }

    #[test]
    fn shared_regions_move_each_groups_blocks_and_touch_no_other() {
        // 100 tokens in 16-token blocks: 7 blocks per group; the window (32 tokens: 68..100) lies in
        // blocks 4..7. Both sides' groups draw their ids from one pool, interleaved, so a copy that
        // addressed a region with the other group's ids would land in a neighbour of a right block.
        let (s, d) = (hybrid(16, 32, 1 << 30), hybrid(16, 32, 1 << 34));
        let n = 100u64;
        let src_blocks = vec![(0..7).map(|i| 2 * i + 1).collect::<Vec<u32>>(), (0..7).map(|i| 2 * i + 2).collect()];
        let dst_blocks = vec![(0..7).map(|i| 40 + 2 * i).collect::<Vec<u32>>(), (0..7).map(|i| 41 + 2 * i).collect()];
        let input = PlanInput { src: &s, dst: &d, src_blocks: &src_blocks, dst_blocks: &dst_blocks, num_tokens: n };
        let mut out = Vec::new();
        let st = Planner::new().plan(&input, &mut out).expect("plans");
        let mut src = memory(&s, |i, o| (o as u8).wrapping_mul(31) ^ (i as u8).wrapping_mul(97) ^ (o >> 8) as u8);
        const UNTOUCHED: u8 = 0xEE;
        let mut dst = memory(&d, |_, _| UNTOUCHED);
        for c in &out {
            let data = bytes_at(&mut src, c.src_addr, c.len).to_vec();
            bytes_at(&mut dst, c.dst_addr, c.len).copy_from_slice(&data);
        }
        // Expected, from the layouts' geometry alone: per group, the whole blocks holding what D
        // needs (every block in the full group, the window's blocks 4..7 in the other) of each of
        // its layers' K and V; every other byte of D untouched.
        let part = s.part_bytes();
        let mut expected = memory(&d, |_, _| UNTOUCHED);
        let mut moved = 0;
        for (g, first) in [(0usize, 0usize), (1, 4)] {
            for layer in [g as u64, g as u64 + 2] {
                for p in 0..2 {
                    for i in first..7 {
                        let sa = s.region_bases[(layer * 2 + p) as usize] + u64::from(src_blocks[g][i]) * part;
                        let da = d.region_bases[(layer * 2 + p) as usize] + u64::from(dst_blocks[g][i]) * part;
                        let data = bytes_at(&mut src, sa, part).to_vec();
                        bytes_at(&mut expected, da, part).copy_from_slice(&data);
                        moved += part;
                    }
                }
            }
        }
        assert_eq!(st.bytes, moved, "bytes planned");
        for ((base, got), (_, want)) in dst.iter().zip(&expected) {
            if let Some(o) = (0..got.len()).find(|&o| got[o] != want[o]) {
                let block = o as u64 / part;
                panic!("D region at {base:#x}: byte {o} (block {block}) is {:#x}, expected {:#x}", got[o], want[o]);
            }
        }
        // The window group's blocks before the window were never written (D needs none of them).
        for (i, &block) in dst_blocks[1][..4].iter().enumerate() {
            let a = d.region_bases[2] + u64::from(block) * part;
            assert!(bytes_at(&mut dst, a, part).iter().all(|&b| b == UNTOUCHED), "window block {i} written");
        }
    }
}
