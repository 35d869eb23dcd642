//! The KV layout descriptor: what one worker's KV cache looks like in memory.
//!
//! Read [`KvLayout`] first. It is sent in the handshake, so each side knows the other's physical
//! layout, and it is all the planner needs to turn block ids into addresses: the model's shape
//! ([`ModelShape`], which must match on both sides), the per-block byte layout (block size in tokens,
//! [`BlockOrder`], [`KvPlacement`], block stride) and where each layer's regions start.
//!
//! Tensor parallelism splits KV heads across ranks ([`head_range`]); pipeline parallelism splits
//! layers ([`pp_layer_range`], vLLM's rule). [`tp_sources`] and [`tp_targets`] say which producer
//! rank writes which heads into which consumer rank; both sides call the same functions, so the
//! consumer's expected notification count ([`expected_notifications`]) always agrees with what the
//! producers send.
//!
//! Nothing here allocates per request or does I/O; a layout is validated once ([`KvLayout::validate`]).

use core::fmt;
use core::ops::Range;

use serde::{Deserialize, Serialize};

use super::ids::Rank;

/// Largest number of layers a layout may describe.
pub const MAX_LAYERS: u32 = 4096;
/// Largest number of KV cache groups (vLLM's hybrid allocator groups).
pub const MAX_GROUPS: usize = 64;
/// Largest tensor- or pipeline-parallel size.
pub const MAX_PARALLEL: u16 = 4096;
/// Largest number of blocks in one region.
pub const MAX_BLOCKS: u32 = 1 << 28;
/// Largest block size in tokens.
pub const MAX_BLOCK_TOKENS: u32 = 1 << 16;
/// Largest number of KV heads of a model.
pub const MAX_KV_HEADS: u32 = 1 << 16;
/// Largest head dimension (elements).
pub const MAX_HEAD_DIM: u32 = 1 << 16;

/// Element type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
    /// IEEE single precision.
    F32,
    /// 8-bit float, e4m3.
    F8E4M3,
    /// 8-bit float, e5m2.
    F8E5M2,
    /// Raw bytes (quantized caches whose scale lives elsewhere).
    U8,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size(self) -> u64 {
        match self {
            DType::F16 | DType::Bf16 => 2,
            DType::F32 => 4,
            DType::F8E4M3 | DType::F8E5M2 | DType::U8 => 1,
        }
    }
}

/// Order of elements inside one block (per K or V part).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BlockOrder {
    /// `[heads, tokens, head_dim]`: each head's tokens are contiguous.
    Hnd,
    /// `[tokens, heads, head_dim]`: each token's heads are contiguous.
    Nhd,
}

/// What a block holds: keys and values, or one latent vector per token (MLA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KvKind {
    /// Separate K and V, split across TP ranks by KV head.
    KeyValue,
    /// One latent part per token (MLA), the same on every TP rank (replicated).
    Latent,
}

/// Where the parts of one layer live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KvPlacement {
    /// K and V in two regions per layer (vLLM's `[2, num_blocks, ...]` is this with two bases).
    Separate,
    /// One region per layer; each block holds its K part then its V part (`[num_blocks, 2, ...]`).
    Joint,
    /// One region per layer with one part per block ([`KvKind::Latent`] only).
    Single,
    /// One region per layer; within a block each KV head holds its K tokens, then its V tokens
    /// (`[num_blocks, kv_heads, 2, block_tokens, head_dim]`, vLLM's CPU backend). [`BlockOrder::Hnd`]
    /// only.
    HeadJoint,
    /// One region per layer; each (head, token) cell holds that token's K then its V side by side
    /// (`[.., 2 · head_dim]` cells: vLLM's `[blocks, heads, tokens, K‖V]` pages, in either order).
    /// K and V of a cell always move together.
    CellJoint,
}

impl KvPlacement {
    /// Number of parts (K, V) each block of a region holds.
    pub const fn parts_in_block(self) -> u32 {
        match self {
            KvPlacement::Joint | KvPlacement::HeadJoint | KvPlacement::CellJoint => 2,
            KvPlacement::Separate | KvPlacement::Single => 1,
        }
    }

    /// Number of memory regions each layer has.
    pub const fn regions_per_layer(self) -> u32 {
        match self {
            KvPlacement::Separate => 2,
            KvPlacement::Joint | KvPlacement::Single | KvPlacement::HeadJoint | KvPlacement::CellJoint => 1,
        }
    }
}

/// Attention kind of a KV cache group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GroupKind {
    /// Full attention: every token's KV is needed.
    Full,
    /// Sliding window: only the last `window_tokens` tokens' KV is needed.
    SlidingWindow {
        /// Window length in tokens (> 0).
        window_tokens: u32,
    },
}

impl fmt::Display for GroupKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GroupKind::Full => write!(f, "full"),
            GroupKind::SlidingWindow { window_tokens } => write!(f, "sliding_window({window_tokens})"),
        }
    }
}

/// A KV cache group: layers that share one block table.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvGroup {
    /// Attention kind of every layer in the group.
    pub kind: GroupKind,
    /// Global layer indices, strictly increasing.
    #[serde(deserialize_with = "super::bounded::vec::<_, _, { MAX_LAYERS as usize }>")]
    pub layers: Vec<u32>,
}

/// The model-determined part of a layout; must be identical on producer and consumer.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelShape {
    /// Layers of the whole model (over all PP ranks).
    pub total_layers: u32,
    /// KV heads of the whole model (1 for [`KvKind::Latent`]).
    pub kv_heads: u32,
    /// Elements per head (for MLA: the latent width).
    pub head_dim: u32,
    /// Element type.
    pub dtype: DType,
    /// Keys and values, or an MLA latent.
    pub kind: KvKind,
    /// KV cache groups; every layer belongs to exactly one.
    #[serde(deserialize_with = "super::bounded::vec::<_, _, MAX_GROUPS>")]
    pub groups: Vec<KvGroup>,
}

/// Where this worker sits in its engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Parallel {
    /// Tensor-parallel rank, `< tp_size`.
    pub tp_rank: u16,
    /// Tensor-parallel size.
    pub tp_size: u16,
    /// Pipeline-parallel rank, `< pp_size`.
    pub pp_rank: u16,
    /// Pipeline-parallel size.
    pub pp_size: u16,
}

impl Parallel {
    /// A single-worker engine (TP 1, PP 1).
    pub const SINGLE: Parallel = Parallel { tp_rank: 0, tp_size: 1, pp_rank: 0, pp_size: 1 };

    /// This worker's rank.
    pub const fn rank(&self) -> Rank {
        Rank { tp: self.tp_rank, pp: self.pp_rank }
    }
}

/// The physical KV layout of one worker.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvLayout {
    /// The model's shape.
    pub model: ModelShape,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Element order inside a block part.
    pub order: BlockOrder,
    /// How K and V are placed.
    pub placement: KvPlacement,
    /// Bytes from one block to the next within a region (≥ the bytes a block holds).
    pub block_stride: u64,
    /// Blocks in every region.
    pub num_blocks: u32,
    /// TP and PP position.
    pub parallel: Parallel,
    /// Region base addresses: for each local layer (in order, starting at this PP rank's first
    /// layer), `placement.regions_per_layer()` bases (K then V for [`KvPlacement::Separate`]).
    #[serde(deserialize_with = "super::bounded::vec::<_, _, { 2 * MAX_LAYERS as usize }>")]
    pub region_bases: Vec<u64>,
}

/// A layout that cannot describe real memory, with the offending value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// A size field is zero or above its limit.
    #[error("layout field `{field}` = {value} is outside 1..={max}")]
    OutOfRange {
        /// Field name.
        field: &'static str,
        /// Its value.
        value: u64,
        /// Largest allowed value.
        max: u64,
    },
    /// A rank is not below its size.
    #[error("layout {what} rank {rank} is not below its size {size}")]
    RankOutOfRange {
        /// `"tp"` or `"pp"`.
        what: &'static str,
        /// The rank.
        rank: u16,
        /// The size.
        size: u16,
    },
    /// KV heads cannot be split evenly over the TP size.
    #[error("{kv_heads} KV heads cannot be split over TP size {tp_size}")]
    HeadsNotDivisible {
        /// Model KV heads.
        kv_heads: u32,
        /// TP size.
        tp_size: u16,
    },
    /// The placement does not fit the KV kind.
    #[error("placement {placement:?} does not fit KV kind {kind:?}")]
    PlacementMismatch {
        /// Placement.
        placement: KvPlacement,
        /// KV kind.
        kind: KvKind,
    },
    /// The placement needs another block order.
    #[error("placement {placement:?} needs block order {needs:?}, the layout has {order:?}")]
    PlacementOrder {
        /// Placement.
        placement: KvPlacement,
        /// The order it needs.
        needs: BlockOrder,
        /// The layout's order.
        order: BlockOrder,
    },
    /// A latent (MLA) model must declare exactly one KV head.
    #[error("latent KV must declare 1 KV head, got {0}")]
    LatentHeads(u32),
    /// The block stride is smaller than the bytes a block holds.
    #[error("block stride {stride} is smaller than the {needed} bytes a block holds")]
    StrideTooSmall {
        /// Declared stride.
        stride: u64,
        /// Bytes one block holds.
        needed: u64,
    },
    /// The number of region bases does not match the local layers.
    #[error("{got} region bases given, {expected} expected ({layers} local layers x {per_layer} per layer)")]
    RegionCount {
        /// Bases given.
        got: usize,
        /// Bases expected.
        expected: u64,
        /// Local layers.
        layers: u32,
        /// Regions per layer.
        per_layer: u32,
    },
    /// A region would wrap around the address space or starts at address zero.
    #[error("region {index} at {base:#x} of {len} bytes is not a valid address range")]
    BadRegion {
        /// Region index.
        index: usize,
        /// Base address.
        base: u64,
        /// Length in bytes.
        len: u64,
    },
    /// Two regions overlap (other than one region shared by layers of different KV groups).
    #[error("regions {a} and {b} overlap")]
    Overlap {
        /// First region index.
        a: usize,
        /// Second region index.
        b: usize,
    },
    /// Two layers of one KV group share a region: their blocks, addressed by the same block ids,
    /// would be the same bytes.
    #[error(
        "regions {a} and {b} are one region shared by layers {layer_a} and {layer_b} of the same KV group {group}"
    )]
    SharedWithinGroup {
        /// First region index.
        a: usize,
        /// Second region index.
        b: usize,
        /// Global layer of region `a`.
        layer_a: u32,
        /// Global layer of region `b`.
        layer_b: u32,
        /// Their KV group.
        group: usize,
    },
    /// The groups do not partition the model's layers.
    #[error("KV groups are malformed: {0}")]
    Groups(String),
}

/// Range of global layers held by pipeline-parallel rank `pp_rank` of `pp_size` (vLLM's rule:
/// an even split, the remainder spread over the ranks before the last).
pub fn pp_layer_range(total_layers: u32, pp_size: u16, pp_rank: u16) -> Range<u32> {
    let size = u32::from(pp_size.max(1));
    let rank = u32::from(pp_rank).min(size - 1);
    let base = total_layers / size;
    let rem = total_layers % size;
    // Ranks `first_extra .. size - 1` hold one layer more than `base` (rem < size, so no underflow).
    let first_extra = size - 1 - rem;
    let extra_before = rank.clamp(first_extra, size - 1) - first_extra;
    let start = rank * base + extra_before;
    let len = base + u32::from(rank >= first_extra && rank < size - 1);
    start..start + len
}

/// Global KV heads held by TP rank `tp_rank` of `tp_size` (for [`KvKind::Latent`]: `0..1`).
///
/// With more ranks than heads, heads are replicated: rank `r` holds head `r / (tp_size / kv_heads)`.
pub fn head_range(model: &ModelShape, tp_size: u16, tp_rank: u16) -> Range<u32> {
    let tp = u32::from(tp_size.max(1));
    let r = u32::from(tp_rank);
    match model.kind {
        KvKind::Latent => 0..1,
        KvKind::KeyValue if model.kv_heads >= tp => {
            let per = model.kv_heads / tp;
            r * per..(r + 1) * per
        }
        KvKind::KeyValue => {
            let reps = tp / model.kv_heads.max(1);
            let h = r / reps.max(1);
            h..h + 1
        }
    }
}

/// One producer TP rank writing a slice of global heads into a consumer rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeadSlice {
    /// The other side's TP rank (producer for [`tp_sources`], consumer for [`tp_targets`]).
    pub tp_rank: u16,
    /// Global head indices moved.
    pub heads: Range<u32>,
}

/// The producer TP rank chosen to supply global head `head` to consumer TP rank `dst_rank`.
fn source_rank(model: &ModelShape, src_tp: u16, dst_rank: u16, head: u32) -> u16 {
    let tp = u32::from(src_tp.max(1));
    let r = match model.kind {
        // Replicated everywhere: spread consumer ranks over producer ranks.
        KvKind::Latent => u32::from(dst_rank) % tp,
        KvKind::KeyValue if model.kv_heads >= tp => head / (model.kv_heads / tp),
        KvKind::KeyValue => {
            let reps = tp / model.kv_heads.max(1);
            head * reps + u32::from(dst_rank) % reps.max(1)
        }
    };
    // r < tp <= u16::MAX by construction.
    r.min(tp - 1) as u16
}

/// Producer TP ranks (of `src_tp`) that write into consumer TP rank `dst_rank` (of `dst_tp`), and the
/// global heads each supplies, in head order. Exactly one producer supplies each head.
pub fn tp_sources(model: &ModelShape, src_tp: u16, dst_tp: u16, dst_rank: u16) -> Vec<HeadSlice> {
    let mut out: Vec<HeadSlice> = Vec::new();
    for h in head_range(model, dst_tp, dst_rank) {
        let s = source_rank(model, src_tp, dst_rank, h);
        match out.last_mut() {
            Some(last) if last.tp_rank == s && last.heads.end == h => last.heads.end = h + 1,
            _ => out.push(HeadSlice { tp_rank: s, heads: h..h + 1 }),
        }
    }
    out
}

/// Consumer TP ranks (of `dst_tp`) that producer TP rank `src_rank` (of `src_tp`) writes into, and
/// the global heads it writes into each. The inverse of [`tp_sources`].
pub fn tp_targets(model: &ModelShape, src_tp: u16, src_rank: u16, dst_tp: u16) -> Vec<HeadSlice> {
    let mut out = Vec::new();
    for d in 0..dst_tp {
        for s in tp_sources(model, src_tp, dst_tp, d) {
            if s.tp_rank == src_rank {
                out.push(HeadSlice { tp_rank: d, heads: s.heads });
            }
        }
    }
    out
}

/// Producer PP ranks (of `src_pp`) whose layers overlap the layers of consumer PP rank `dst_pp`.
pub fn pp_sources(total_layers: u32, src_pp: u16, dst_pp_size: u16, dst_pp: u16) -> Vec<u16> {
    let mine = pp_layer_range(total_layers, dst_pp_size, dst_pp);
    (0..src_pp.max(1))
        .filter(|&p| {
            let theirs = pp_layer_range(total_layers, src_pp, p);
            theirs.start < mine.end && mine.start < theirs.end
        })
        .collect()
}

/// Completion notifications a consumer rank waits for: one per producer (TP, PP) rank writing into it.
pub fn expected_notifications(model: &ModelShape, src: Parallel, dst: Parallel) -> u32 {
    let tp = tp_sources(model, src.tp_size, dst.tp_size, dst.tp_rank).len() as u32;
    let pp = pp_sources(model.total_layers, src.pp_size, dst.pp_size, dst.pp_rank).len() as u32;
    tp * pp
}

impl KvLayout {
    /// Global layers this worker holds.
    pub fn layer_range(&self) -> Range<u32> {
        pp_layer_range(self.model.total_layers, self.parallel.pp_size, self.parallel.pp_rank)
    }

    /// Global KV heads this worker holds.
    pub fn head_range(&self) -> Range<u32> {
        head_range(&self.model, self.parallel.tp_size, self.parallel.tp_rank)
    }

    /// KV heads held locally.
    pub fn local_heads(&self) -> u32 {
        let r = self.head_range();
        r.end - r.start
    }

    /// K or V parts per block (2 for keys and values, 1 for a latent).
    pub fn parts(&self) -> u32 {
        match self.model.kind {
            KvKind::KeyValue => 2,
            KvKind::Latent => 1,
        }
    }

    /// Bytes of one part (K, V or latent) of one block.
    pub fn part_bytes(&self) -> u64 {
        u64::from(self.block_tokens)
            * u64::from(self.local_heads())
            * u64::from(self.model.head_dim)
            * self.model.dtype.size()
    }

    /// Bytes of one region: `num_blocks * block_stride`.
    pub fn region_len(&self) -> u64 {
        u64::from(self.num_blocks) * self.block_stride
    }

    /// Number of regions (bases) this layout describes.
    pub fn num_regions(&self) -> usize {
        self.region_bases.len()
    }

    /// Region index and in-block byte offset of `part` of local layer `local_layer`.
    pub fn part_location(&self, local_layer: u32, part: u32) -> (u32, u64) {
        let per = self.placement.regions_per_layer();
        match self.placement {
            KvPlacement::Separate => (local_layer * per + part, 0),
            KvPlacement::Joint => (local_layer, u64::from(part) * self.part_bytes()),
            KvPlacement::Single => (local_layer, 0),
            // Head 0's part; the other heads follow every 2 parts' worth of one head.
            KvPlacement::HeadJoint => {
                let head_part = self.part_bytes() / u64::from(self.local_heads().max(1));
                (local_layer, u64::from(part) * head_part)
            }
            // Cell 0's part; the other cells follow every 2 parts' worth of one head and token.
            KvPlacement::CellJoint => {
                (local_layer, u64::from(part) * u64::from(self.model.head_dim) * self.model.dtype.size())
            }
        }
    }

    /// The KV group index of each global layer, `None` for layers in no group.
    pub fn group_of_layer(&self, layer: u32) -> Option<usize> {
        self.model.groups.iter().position(|g| g.layers.binary_search(&layer).is_ok())
    }

    /// Checks every invariant the planner and codec rely on.
    pub fn validate(&self) -> Result<(), LayoutError> {
        let m = &self.model;
        fn range(field: &'static str, value: u64, max: u64) -> Result<(), LayoutError> {
            if value == 0 || value > max {
                Err(LayoutError::OutOfRange { field, value, max })
            } else {
                Ok(())
            }
        }
        range("total_layers", m.total_layers.into(), MAX_LAYERS.into())?;
        range("kv_heads", m.kv_heads.into(), MAX_KV_HEADS.into())?;
        range("head_dim", m.head_dim.into(), MAX_HEAD_DIM.into())?;
        range("block_tokens", self.block_tokens.into(), MAX_BLOCK_TOKENS.into())?;
        range("num_blocks", self.num_blocks.into(), MAX_BLOCKS.into())?;
        range("tp_size", self.parallel.tp_size.into(), MAX_PARALLEL.into())?;
        range("pp_size", self.parallel.pp_size.into(), u64::from(MAX_PARALLEL).min(m.total_layers.into()))?;
        range("groups", m.groups.len() as u64, MAX_GROUPS as u64)?;
        let p = self.parallel;
        if p.tp_rank >= p.tp_size {
            return Err(LayoutError::RankOutOfRange { what: "tp", rank: p.tp_rank, size: p.tp_size });
        }
        if p.pp_rank >= p.pp_size {
            return Err(LayoutError::RankOutOfRange { what: "pp", rank: p.pp_rank, size: p.pp_size });
        }
        match (m.kind, self.placement) {
            (
                KvKind::KeyValue,
                KvPlacement::Separate | KvPlacement::Joint | KvPlacement::HeadJoint | KvPlacement::CellJoint,
            ) => {}
            (KvKind::Latent, KvPlacement::Single) => {}
            (kind, placement) => return Err(LayoutError::PlacementMismatch { placement, kind }),
        }
        if self.placement == KvPlacement::HeadJoint && self.order != BlockOrder::Hnd {
            return Err(LayoutError::PlacementOrder {
                placement: self.placement,
                needs: BlockOrder::Hnd,
                order: self.order,
            });
        }
        if m.kind == KvKind::Latent && m.kv_heads != 1 {
            return Err(LayoutError::LatentHeads(m.kv_heads));
        }
        let tp = u32::from(p.tp_size);
        if m.kind == KvKind::KeyValue
            && ((m.kv_heads >= tp && !m.kv_heads.is_multiple_of(tp))
                || (m.kv_heads < tp && !tp.is_multiple_of(m.kv_heads)))
        {
            return Err(LayoutError::HeadsNotDivisible { kv_heads: m.kv_heads, tp_size: p.tp_size });
        }
        self.validate_groups()?;
        let needed = self.part_bytes() * u64::from(self.placement.parts_in_block());
        if self.block_stride < needed {
            return Err(LayoutError::StrideTooSmall { stride: self.block_stride, needed });
        }
        let layers = self.layer_range();
        let local = layers.end - layers.start;
        let per = self.placement.regions_per_layer();
        let expected = u64::from(local) * u64::from(per);
        if self.region_bases.len() as u64 != expected {
            return Err(LayoutError::RegionCount {
                got: self.region_bases.len(),
                expected,
                layers: local,
                per_layer: per,
            });
        }
        let len = self.block_stride.checked_mul(self.num_blocks.into()).ok_or(LayoutError::BadRegion {
            index: 0,
            base: 0,
            len: u64::MAX,
        })?;
        let mut sorted: Vec<(u64, usize)> = Vec::with_capacity(self.region_bases.len());
        for (index, &base) in self.region_bases.iter().enumerate() {
            if base == 0 || base.checked_add(len).is_none() {
                return Err(LayoutError::BadRegion { index, base, len });
            }
            sorted.push((base, index));
        }
        sorted.sort_unstable();
        // Runs of one base are one region shared by layers of several KV groups (vLLM's hybrid
        // allocator: groups alias from byte 0, and a block id belongs to one group at a time). Each
        // group addresses the region through its own block ids, so a run may hold each group once.
        let mut run = 0;
        for i in 1..=sorted.len() {
            if i < sorted.len() && sorted[i].0 == sorted[run].0 {
                continue;
            }
            self.check_shared_run(&sorted[run..i])?;
            if let Some(&(next, b)) = sorted.get(i) {
                if sorted[run].0 + len > next {
                    return Err(LayoutError::Overlap { a: sorted[i - 1].1, b });
                }
            }
            run = i;
        }
        Ok(())
    }

    /// The global layer and KV group of region `index` (`None`: a layer in no group, which
    /// [`KvLayout::validate_groups`] has already refused).
    fn region_group(&self, index: usize) -> (u32, Option<usize>) {
        let per = self.placement.regions_per_layer() as usize;
        let layer = self.layer_range().start + (index / per) as u32;
        (layer, self.group_of_layer(layer))
    }

    /// Refuses a run of regions at one base unless each belongs to a layer of a different group.
    fn check_shared_run(&self, run: &[(u64, usize)]) -> Result<(), LayoutError> {
        for (i, &(_, a)) in run.iter().enumerate() {
            for &(_, b) in &run[i + 1..] {
                let ((layer_a, ga), (layer_b, gb)) = (self.region_group(a), self.region_group(b));
                if ga == gb {
                    let (a, b) = (a.min(b), a.max(b));
                    let (layer_a, layer_b) = (layer_a.min(layer_b), layer_a.max(layer_b));
                    return Err(LayoutError::SharedWithinGroup { a, b, layer_a, layer_b, group: ga.unwrap_or(0) });
                }
            }
        }
        Ok(())
    }

    /// Indices of the distinct regions: the first region of each base. Layers of several KV groups
    /// may share one region ([`KvLayout::validate`]); memory is registered once per distinct region.
    pub fn distinct_regions(&self) -> Vec<usize> {
        let mut seen = std::collections::BTreeSet::new();
        (0..self.region_bases.len()).filter(|&i| seen.insert(self.region_bases[i])).collect()
    }

    fn validate_groups(&self) -> Result<(), LayoutError> {
        let total = self.model.total_layers;
        let mut seen = vec![false; total as usize];
        for (gi, g) in self.model.groups.iter().enumerate() {
            if g.layers.is_empty() {
                return Err(LayoutError::Groups(format!("group {gi} has no layers")));
            }
            if let GroupKind::SlidingWindow { window_tokens: 0 } = g.kind {
                return Err(LayoutError::Groups(format!("group {gi} has a sliding window of 0 tokens")));
            }
            let mut prev: Option<u32> = None;
            for &l in &g.layers {
                if l >= total {
                    return Err(LayoutError::Groups(format!("group {gi} names layer {l} of {total}")));
                }
                if prev.is_some_and(|p| p >= l) {
                    return Err(LayoutError::Groups(format!("group {gi} layers are not strictly increasing")));
                }
                prev = Some(l);
                if std::mem::replace(&mut seen[l as usize], true) {
                    return Err(LayoutError::Groups(format!("layer {l} is in more than one group")));
                }
            }
        }
        if let Some(l) = seen.iter().position(|s| !s) {
            return Err(LayoutError::Groups(format!("layer {l} is in no group")));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn model(kv_heads: u32, kind: KvKind) -> ModelShape {
        ModelShape {
            total_layers: 4,
            kv_heads,
            head_dim: 8,
            dtype: DType::Bf16,
            kind,
            groups: vec![KvGroup { kind: GroupKind::Full, layers: vec![0, 1, 2, 3] }],
        }
    }

    #[test]
    fn pp_split_matches_vllm_rule() {
        // vLLM: 10 layers over 4 ranks -> [2, 3, 3, 2].
        let lens: Vec<u32> = (0..4).map(|r| pp_layer_range(10, 4, r).len() as u32).collect();
        assert_eq!(lens, vec![2, 3, 3, 2]);
        assert_eq!(pp_layer_range(10, 4, 0), 0..2);
        assert_eq!(pp_layer_range(10, 4, 3), 8..10);
        // Even split.
        assert_eq!(pp_layer_range(64, 2, 1), 32..64);
        assert_eq!(pp_layer_range(7, 1, 0), 0..7);
        // Ranges tile the layers for many shapes.
        for total in 1..40u32 {
            for size in 1..=total.min(9) as u16 {
                let mut next = 0;
                for r in 0..size {
                    let range = pp_layer_range(total, size, r);
                    assert_eq!(range.start, next, "total {total} size {size} rank {r}");
                    assert!(!range.is_empty());
                    next = range.end;
                }
                assert_eq!(next, total);
            }
        }
    }

    #[test]
    fn heads_split_and_replicate() {
        let m = model(8, KvKind::KeyValue);
        assert_eq!(head_range(&m, 2, 1), 4..8);
        assert_eq!(head_range(&m, 8, 3), 3..4);
        // 16 ranks over 8 heads: two replicas of each head.
        assert_eq!(head_range(&m, 16, 5), 2..3);
        assert_eq!(head_range(&model(1, KvKind::Latent), 8, 7), 0..1);
    }

    #[test]
    fn sources_and_targets_agree() {
        for kind in [KvKind::KeyValue, KvKind::Latent] {
            let heads = if kind == KvKind::Latent { 1 } else { 8 };
            let m = model(heads, kind);
            for p in [1u16, 2, 4, 8, 16] {
                for d in [1u16, 2, 4, 8, 16] {
                    for dr in 0..d {
                        let sources = tp_sources(&m, p, d, dr);
                        // Each needed head supplied exactly once by a producer that holds it.
                        let covered: Vec<u32> = sources.iter().flat_map(|s| s.heads.clone()).collect();
                        let wanted: Vec<u32> = head_range(&m, d, dr).collect();
                        assert_eq!(covered, wanted);
                        for s in &sources {
                            let held = head_range(&m, p, s.tp_rank);
                            assert!(held.start <= s.heads.start && s.heads.end <= held.end);
                            let t = tp_targets(&m, p, s.tp_rank, d);
                            assert!(t.contains(&HeadSlice { tp_rank: dr, heads: s.heads.clone() }));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn expected_counts() {
        let m = model(8, KvKind::KeyValue);
        let par = |tp_rank, tp_size, pp_rank, pp_size| Parallel { tp_rank, tp_size, pp_rank, pp_size };
        // P TP 4 -> D TP 2: two producers per consumer.
        assert_eq!(expected_notifications(&m, par(0, 4, 0, 1), par(1, 2, 0, 1)), 2);
        // P TP 2 -> D TP 4: one producer per consumer.
        assert_eq!(expected_notifications(&m, par(0, 2, 0, 1), par(3, 4, 0, 1)), 1);
        // P PP 2 into D PP 1: both stages write.
        assert_eq!(expected_notifications(&m, par(0, 2, 0, 2), par(0, 2, 0, 1)), 2);
        // MLA: one producer per consumer whatever the sizes.
        let l = model(1, KvKind::Latent);
        assert_eq!(expected_notifications(&l, par(0, 8, 0, 1), par(5, 4, 0, 1)), 1);
    }

    fn layout() -> KvLayout {
        KvLayout {
            model: model(8, KvKind::KeyValue),
            block_tokens: 16,
            order: BlockOrder::Hnd,
            placement: KvPlacement::Separate,
            block_stride: 16 * 8 * 8 * 2,
            num_blocks: 10,
            parallel: Parallel::SINGLE,
            region_bases: (0..8).map(|i| 0x10000 + i * 0x10000).collect(),
        }
    }

    #[test]
    fn validate_accepts_and_names_faults() {
        layout().validate().expect("valid layout");
        let mut l = layout();
        l.region_bases.pop();
        assert!(matches!(l.validate(), Err(LayoutError::RegionCount { got: 7, expected: 8, .. })));
        let mut l = layout();
        l.region_bases[1] = l.region_bases[0] + 8;
        assert!(matches!(l.validate(), Err(LayoutError::Overlap { .. })));
        let mut l = layout();
        l.block_stride = 10;
        assert!(matches!(l.validate(), Err(LayoutError::StrideTooSmall { .. })));
        let mut l = layout();
        l.parallel.tp_size = 3;
        assert!(matches!(l.validate(), Err(LayoutError::HeadsNotDivisible { .. })));
        let mut l = layout();
        l.model.groups[0].layers = vec![0, 1, 3];
        assert!(matches!(l.validate(), Err(LayoutError::Groups(_))));
        let mut l = layout();
        l.placement = KvPlacement::Single;
        assert!(matches!(l.validate(), Err(LayoutError::PlacementMismatch { .. })));
        let mut l = layout();
        l.region_bases[3] = u64::MAX - 4;
        assert!(matches!(l.validate(), Err(LayoutError::BadRegion { index: 3, .. })));
    }

    /// Layers 0, 2 full attention and 1, 3 a sliding window, each window layer sharing the regions
    /// of the full layer before it (vLLM's hybrid allocator: groups alias from byte 0).
    fn hybrid() -> KvLayout {
        let mut l = layout();
        l.model.groups = vec![
            KvGroup { kind: GroupKind::Full, layers: vec![0, 2] },
            KvGroup { kind: GroupKind::SlidingWindow { window_tokens: 32 }, layers: vec![1, 3] },
        ];
        // K and V of layer 0 at bases 0, 1; layer 1 shares them; layers 2 and 3 share 2, 3.
        let base = |i: u64| 0x10000 + i * 0x10000;
        l.region_bases = vec![base(0), base(1), base(0), base(1), base(2), base(3), base(2), base(3)];
        l
    }

    #[test]
    fn a_region_shared_by_layers_of_different_groups_is_one_region() {
        let l = hybrid();
        l.validate().expect("layers of two groups share a region");
        // Registered once: the first region of each base.
        assert_eq!(l.distinct_regions(), vec![0, 1, 4, 5]);
        // Two layers of one group on one region: their blocks would be the same bytes.
        let mut same = hybrid();
        same.region_bases[4] = same.region_bases[0];
        same.region_bases[5] = same.region_bases[1];
        same.region_bases[6] = same.region_bases[0];
        same.region_bases[7] = same.region_bases[1];
        match same.validate() {
            Err(LayoutError::SharedWithinGroup { layer_a: 0, layer_b: 2, group: 0, .. }) => {}
            other => panic!("layers 0 and 2 of group 0 on one region: {other:?}"),
        }
        // A region that starts inside another is still an overlap, shared or not.
        let mut partial = hybrid();
        partial.region_bases[2] += 64;
        assert!(matches!(partial.validate(), Err(LayoutError::Overlap { .. })), "{:?}", partial.validate());
        // K of one layer on V of a layer of the same group: refused as before.
        let mut kv = layout();
        kv.region_bases[1] = kv.region_bases[0];
        assert!(matches!(kv.validate(), Err(LayoutError::SharedWithinGroup { group: 0, .. })), "{:?}", kv.validate());
        // Without sharing, every region is distinct.
        assert_eq!(layout().distinct_regions(), (0..8).collect::<Vec<_>>());
    }
}
