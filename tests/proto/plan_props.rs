//! Property tests of the transfer planner ([`Planner::plan`]) against a naive reference planner.
//!
//! The reference below is written from the layout definitions alone (`proto::layout` and DESIGN.md
//! §2), not from the planner's code: one copy per token, head, layer and K/V part, each of
//! `head_dim * dtype.size()` bytes. For random models (TP, PP, latent KV, KV groups with sliding
//! windows), random physical layouts on each side (block sizes, orders, placements, strides, region
//! bases adjacent or apart) and random block lists (prefix hits, contiguous or shuffled ids), every
//! producer rank is planned into every consumer rank and checked:
//!
//! * the plan moves exactly the bytes the reference moves, to the same places (compared as canonical
//!   runs of the map "destination byte → source byte", see [`canonical`]);
//! * every copy stays inside the regions it names, no destination byte is written twice (by one
//!   producer or by all producers of a consumer together), the stats add up, no two consecutive
//!   copies continue each other, and (for ascending block lists, see below) merging the output again
//!   with [`merge_unordered`] finds nothing more to merge;
//! * the producers writing into a consumer cover every element the consumer needs, computed from the
//!   consumer's layout alone, and their number is [`expected_notifications`].
//!
//! Maximal merging is asserted only when every block list ascends. The planner merges while it emits
//! pieces in token order, so two copies that are contiguous on both sides but emitted apart stay two
//! descriptors: source and destination lists `[1, 0]` (1 layer, 1 head, 1-token blocks, 2 tokens) give
//! two copies per part where one would do. That is a missed merge, not wrong data. Once the planner
//! merges such runs, pass `true` instead of `s.ascending` in [`plan_matches_reference`].
//!
//! Sizes are kept small (head dim ≤ 4, ≤ 5 layers, ≤ 200 tokens) so that the file runs in a few
//! seconds in debug mode.

use std::collections::BTreeMap;

use kvpush::proto::layout::{
    expected_notifications, tp_sources, BlockOrder, DType, GroupKind, KvGroup, KvKind, KvLayout, KvPlacement,
    ModelShape, Parallel,
};
use kvpush::proto::merge::{merge_unordered, Copy};
use kvpush::proto::plan::{PlanError, PlanInput, PlanStats, Planner};
use kvpush_testkit::rng::Rng;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

// ---------------------------------------------------------------------------------------------
// The reference planner.
// ---------------------------------------------------------------------------------------------

/// `len` bytes copied from source address `src` to destination address `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Move {
    dst: u64,
    src: u64,
    len: u64,
}

/// What the reference says one producer rank does for one consumer rank.
#[derive(Debug)]
enum Expected {
    /// The producer supplies no head to the consumer, or they share no layer.
    NotATarget,
    /// The source lists lack tokens the destination needs: `(group, first needed, first held)` of every
    /// such group (the planner may name any of them).
    Missing(Vec<(usize, u64, u64)>),
    /// One side is HeadJoint and the block sizes differ: refused (tokens are packed by block size).
    Packed,
    /// The element copies.
    Moves(Vec<Move>),
}

/// Whether the planner must refuse `src` → `dst` as HeadJoint blocks of different sizes.
fn packed_mismatch(src: &KvLayout, dst: &KvLayout) -> bool {
    (src.placement == KvPlacement::HeadJoint || dst.placement == KvPlacement::HeadJoint)
        && src.block_tokens != dst.block_tokens
}

/// Bytes of one element (one head of one token of one part).
fn elem_bytes(model: &ModelShape) -> u64 {
    u64::from(model.head_dim) * model.dtype.size()
}

/// First token a tail list of `len` blocks of `block_tokens` covers, for a request of `n` tokens.
fn first_covered(n: u64, block_tokens: u32, len: usize) -> u64 {
    let bt = u64::from(block_tokens);
    (n.div_ceil(bt) - len as u64) * bt
}

/// First token of group `g` the destination needs: what its (tail) list covers, cut to the window.
fn first_needed(model: &ModelShape, g: usize, dst: &KvLayout, dst_blocks: &[Vec<u32>], n: u64) -> u64 {
    let listed = first_covered(n, dst.block_tokens, dst_blocks[g].len());
    match model.groups[g].kind {
        GroupKind::Full => listed,
        GroupKind::SlidingWindow { window_tokens } => listed.max(n.saturating_sub(window_tokens.into())),
    }
}

/// The tokens that move when `first..n` are needed: whole blocks where both sides' blocks are the
/// same size (backends may pack a block's tokens by block size), exactly those tokens otherwise.
fn moved(first: u64, n: u64, src_block_tokens: u32, dst_block_tokens: u32) -> std::ops::Range<u64> {
    if src_block_tokens != dst_block_tokens {
        return first..n;
    }
    let bt = u64::from(dst_block_tokens);
    (first - first % bt)..n.div_ceil(bt) * bt
}

/// The block id and in-block token offset of token `t` in a tail list.
fn locate(list: &[u32], n: u64, block_tokens: u32, t: u64) -> (u32, u64) {
    let bt = u64::from(block_tokens);
    let first_entry_block = n.div_ceil(bt) - list.len() as u64;
    (list[(t / bt - first_entry_block) as usize], t % bt)
}

/// Region index and byte address of global head `head` of token `tok` (in-block offset) of `part` of
/// global layer `layer` in block `block`.
fn element_addr(l: &KvLayout, layer: u32, part: u32, block: u32, tok: u64, head: u32) -> (usize, u64) {
    let local_layer = u64::from(layer - l.layer_range().start);
    let heads = l.head_range();
    let local_heads = u64::from(heads.end - heads.start);
    let head = u64::from(head - heads.start);
    let elem = elem_bytes(&l.model);
    let bt = u64::from(l.block_tokens);
    let part_bytes = bt * local_heads * elem;
    let (regions_per_layer, region_in_layer, part_offset) = match l.placement {
        KvPlacement::Separate => (2, u64::from(part), 0),
        KvPlacement::Joint => (1, 0, u64::from(part) * part_bytes),
        KvPlacement::Single | KvPlacement::HeadJoint => (1, 0, 0),
        KvPlacement::CellJoint => (1, 0, u64::from(part) * elem),
    };
    let region = (local_layer * regions_per_layer + region_in_layer) as usize;
    let within = match (l.order, l.placement) {
        // [heads, {K, V}, tokens, head_dim]
        (BlockOrder::Hnd, KvPlacement::HeadJoint) => ((head * 2 + u64::from(part)) * bt + tok) * elem,
        // [heads, tokens, {K, V}, head_dim] and [tokens, heads, {K, V}, head_dim]
        (BlockOrder::Hnd, KvPlacement::CellJoint) => (head * bt + tok) * 2 * elem,
        (BlockOrder::Nhd, KvPlacement::CellJoint) => (tok * local_heads + head) * 2 * elem,
        (BlockOrder::Hnd, _) => (head * bt + tok) * elem,
        (BlockOrder::Nhd, _) => (tok * local_heads + head) * elem,
    };
    (region, l.region_bases[region] + u64::from(block) * l.block_stride + part_offset + within)
}

/// K and V parts per block.
fn parts(model: &ModelShape) -> u32 {
    match model.kind {
        KvKind::KeyValue => 2,
        KvKind::Latent => 1,
    }
}

/// The naive plan of producer `src` → consumer `dst`: one element copy per token, head, layer, part.
fn reference(src: &KvLayout, dst: &KvLayout, src_blocks: &[Vec<u32>], dst_blocks: &[Vec<u32>], n: u64) -> Expected {
    let model = &src.model;
    let supplied = tp_sources(model, src.parallel.tp_size, dst.parallel.tp_size, dst.parallel.tp_rank)
        .into_iter()
        .find(|s| s.tp_rank == src.parallel.tp_rank);
    let Some(heads) = supplied.map(|s| s.heads) else {
        return Expected::NotATarget;
    };
    let (sl, dl) = (src.layer_range(), dst.layer_range());
    let shared: Vec<u32> = (0..model.total_layers).filter(|l| sl.contains(l) && dl.contains(l)).collect();
    if shared.is_empty() {
        return Expected::NotATarget;
    }
    if packed_mismatch(src, dst) {
        return Expected::Packed;
    }
    let elem = elem_bytes(model);
    let mut missing = Vec::new();
    let mut moves = Vec::new();
    for layer in shared {
        let g = model.groups.iter().position(|g| g.layers.contains(&layer)).expect("every layer is in a group");
        let first = first_needed(model, g, dst, dst_blocks, n);
        if first >= n {
            continue;
        }
        let held = first_covered(n, src.block_tokens, src_blocks[g].len());
        if held > first {
            if !missing.contains(&(g, first, held)) {
                missing.push((g, first, held));
            }
            continue;
        }
        for t in moved(first, n, src.block_tokens, dst.block_tokens) {
            let (sb, st) = locate(&src_blocks[g], n, src.block_tokens, t);
            let (db, dt) = locate(&dst_blocks[g], n, dst.block_tokens, t);
            for h in heads.clone() {
                for part in 0..parts(model) {
                    let (_, s) = element_addr(src, layer, part, sb, st, h);
                    let (_, d) = element_addr(dst, layer, part, db, dt, h);
                    moves.push(Move { dst: d, src: s, len: elem });
                }
            }
        }
    }
    if missing.is_empty() {
        Expected::Moves(moves)
    } else {
        Expected::Missing(missing)
    }
}

/// Every element consumer `dst` needs, from its own layout and lists alone (no TP sources): every
/// local head of every held layer for every needed token (in whole blocks where the producers' blocks,
/// `src_block_tokens`, are the same size).
fn needed_by(dst: &KvLayout, dst_blocks: &[Vec<u32>], n: u64, src_block_tokens: u32) -> Vec<Move> {
    let model = &dst.model;
    let elem = elem_bytes(model);
    let mut out = Vec::new();
    for layer in dst.layer_range() {
        let g = model.groups.iter().position(|g| g.layers.contains(&layer)).expect("every layer is in a group");
        let first = first_needed(model, g, dst, dst_blocks, n);
        if first >= n {
            continue;
        }
        for t in moved(first, n, src_block_tokens, dst.block_tokens) {
            let (db, dt) = locate(&dst_blocks[g], n, dst.block_tokens, t);
            for h in dst.head_range() {
                for part in 0..parts(model) {
                    let (_, d) = element_addr(dst, layer, part, db, dt, h);
                    out.push(Move { dst: d, src: 0, len: elem });
                }
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Comparing plans.
// ---------------------------------------------------------------------------------------------

/// Canonical form of a set of copies: sorted by destination, runs that continue on both sides joined.
/// Two sets of copies move the same bytes to the same places exactly when their canonical forms are
/// equal (the form is the unique partition of the map "destination byte → source byte" into maximal
/// runs of slope one). Fails if a destination byte is written twice. With `ignore_src`, only the
/// destination bytes are compared (source addresses are zeroed).
fn canonical(mut v: Vec<Move>, ignore_src: bool) -> Result<Vec<Move>, String> {
    v.retain(|m| m.len > 0);
    if ignore_src {
        v.iter_mut().for_each(|m| m.src = 0);
    }
    v.sort_unstable();
    let mut out: Vec<Move> = Vec::with_capacity(v.len());
    for m in v {
        if let Some(last) = out.last_mut() {
            if m.dst < last.dst + last.len {
                return Err(format!("destination byte {:#x} written twice: {last:x?} and {m:x?}", m.dst));
            }
            let src_continues = ignore_src || m.src == last.src + last.len;
            if m.dst == last.dst + last.len && src_continues {
                last.len += m.len;
                continue;
            }
        }
        out.push(m);
    }
    Ok(out)
}

/// Compares two canonical forms, naming the first difference.
fn same_runs(what: &str, got: &[Move], want: &[Move]) -> Result<(), TestCaseError> {
    if got == want {
        return Ok(());
    }
    let i = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len()));
    Err(TestCaseError::fail(format!(
        "{what}: {} runs planned, {} expected; first difference at run {i}: planned {:x?}, expected {:x?}",
        got.len(),
        want.len(),
        got.get(i),
        want.get(i)
    )))
}

fn moves_of(copies: &[Copy]) -> Vec<Move> {
    copies.iter().map(|c| Move { dst: c.dst_addr, src: c.src_addr, len: c.len }).collect()
}

/// Whether `[addr, addr + len)` lies in region `index` of `l`.
fn in_region(l: &KvLayout, index: u32, addr: u64, len: u64) -> bool {
    let Some(&base) = l.region_bases.get(index as usize) else {
        return false;
    };
    let end = base + u64::from(l.num_blocks) * l.block_stride;
    addr >= base && addr.checked_add(len).is_some_and(|e| e <= end)
}

/// Checks of one plan that need no reference: regions, stats, maximal merging.
fn check_plan_shape(
    src: &KvLayout,
    dst: &KvLayout,
    out: &[Copy],
    stats: &PlanStats,
    check_maximal: bool,
) -> Result<(), TestCaseError> {
    for c in out {
        prop_assert!(c.len > 0, "empty copy {:x?}", c);
        prop_assert!(in_region(src, c.src_region, c.src_addr, c.len), "copy {:x?} leaves its source region", c);
        prop_assert!(in_region(dst, c.dst_region, c.dst_addr, c.len), "copy {:x?} leaves its destination region", c);
    }
    prop_assert_eq!(stats.bytes, out.iter().map(|c| c.len).sum::<u64>(), "stats.bytes");
    prop_assert_eq!(stats.merged, out.len() as u64, "stats.merged");
    prop_assert!(stats.merged <= stats.unmerged, "merged {} > unmerged {}", stats.merged, stats.unmerged);
    for w in out.windows(2) {
        prop_assert!(!w[0].continued_by(&w[1]), "consecutive copies {:x?} and {:x?} were not merged", w[0], w[1]);
    }
    if check_maximal {
        let mut again = out.to_vec();
        merge_unordered(&mut again);
        prop_assert_eq!(again.len(), out.len(), "merge_unordered merges the planner's output further");
    }
    Ok(())
}

/// Plans `src` → `dst` and checks the result against the reference. Returns the plan's copies if it
/// succeeded (as moves), `None` if it was refused (as the reference says it must be).
fn check_pair(
    planner: &mut Planner,
    out: &mut Vec<Copy>,
    input: &PlanInput<'_>,
    check_maximal: bool,
) -> Result<Option<Vec<Move>>, TestCaseError> {
    let (src, dst) = (input.src, input.dst);
    let want = reference(src, dst, input.src_blocks, input.dst_blocks, input.num_tokens);
    let got = planner.plan(input, out);
    let pair = format!("P rank {:?} -> D rank {:?}", src.parallel.rank(), dst.parallel.rank());
    match (want, got) {
        (Expected::NotATarget, Err(PlanError::NotATarget { src: s, dst: d })) => {
            prop_assert_eq!(s, src.parallel.rank());
            prop_assert_eq!(d, dst.parallel.rank());
            Ok(None)
        }
        (Expected::Missing(m), Err(PlanError::MissingSource { group, needed, held })) => {
            prop_assert!(
                m.contains(&(group, needed, held)),
                "{}: MissingSource {:?} not in {:?}",
                pair,
                (group, needed, held),
                m
            );
            Ok(None)
        }
        (Expected::Packed, Err(PlanError::PackedBlockSizes { src_tokens, dst_tokens })) => {
            prop_assert_eq!((src_tokens, dst_tokens), (src.block_tokens, dst.block_tokens));
            Ok(None)
        }
        (Expected::Moves(want), Ok(stats)) => {
            check_plan_shape(src, dst, out, &stats, check_maximal)?;
            let got = moves_of(out);
            let got_runs = canonical(got.clone(), false).map_err(|e| TestCaseError::fail(format!("{pair}: {e}")))?;
            let want_runs = canonical(want, false).map_err(|e| TestCaseError::fail(format!("reference: {e}")))?;
            same_runs(&pair, &got_runs, &want_runs)?;
            Ok(Some(got))
        }
        (want, got) => {
            let want = match want {
                Expected::Moves(m) => format!("Moves({} element copies)", m.len()),
                other => format!("{other:?}"),
            };
            Err(TestCaseError::fail(format!("{pair}: planner returned {got:?}, reference says {want}")))
        }
    }
}

/// Byte-level comparison for the example tests: the map "destination byte → source byte" of the plan
/// equals the reference's, and no destination byte is written twice.
fn byte_map(moves: &[Move]) -> BTreeMap<u64, u64> {
    let mut map = BTreeMap::new();
    for m in moves {
        for i in 0..m.len {
            let prev = map.insert(m.dst + i, m.src + i);
            assert!(prev.is_none(), "destination byte {:#x} written twice", m.dst + i);
        }
    }
    map
}

// ---------------------------------------------------------------------------------------------
// Generating scenarios.
// ---------------------------------------------------------------------------------------------

/// How the region bases of a layout are laid out.
#[derive(Clone, Copy, Debug)]
enum Regions {
    /// Back to back in index order: a copy merged across a region boundary is still contiguous in
    /// memory, so only the region check can catch it.
    Adjacent,
    /// Back to back in a shuffled order.
    AdjacentShuffled,
    /// Apart, with gaps of random (also odd) sizes.
    Gaps,
}

/// How the block ids of a list are chosen.
#[derive(Clone, Copy, Debug)]
enum Ids {
    /// A run of consecutive ids, ascending.
    Ascending,
    /// A run of consecutive ids, descending.
    Descending,
    /// Distinct random ids in random order.
    Shuffled,
}

/// One engine's parallelism and physical layout, as drawn.
#[derive(Clone, Debug)]
struct SideParams {
    tp_log: u32,
    pp: u16,
    block_tokens_log: u32,
    /// 0: separate K and V regions, 1: joint, 2: K and V per head (joint where the order is NHD).
    joint: u8,
    pad_elems: u64,
    extra_blocks: u32,
    regions: Regions,
    base_page: u64,
}

/// One KV group's block lists, as drawn.
#[derive(Clone, Debug)]
struct ListParams {
    /// Percentage of the request's blocks the destination lists (100: no prefix hit).
    dst_keep_pct: u64,
    /// Percentage of the blocks the source may list beyond those the destination needs.
    src_extra_pct: u64,
    src_ids: Ids,
    dst_ids: Ids,
}

/// A whole test case, as drawn.
#[derive(Clone, Debug)]
struct Case {
    latent: bool,
    heads_log: u32,
    head_dim: u32,
    dtype: DType,
    total_layers: u32,
    layer_group: Vec<usize>,
    windows: Vec<Option<u32>>,
    num_tokens: u64,
    src_nhd: bool,
    dst_order_differs: bool,
    src: SideParams,
    dst: SideParams,
    lists: Vec<ListParams>,
    short_src: Option<usize>,
    /// Every list ascending (whatever `lists` says), for the maximal-merge check.
    ascending_only: bool,
    seed: u64,
}

/// A case turned into layouts of every rank on both sides and block lists.
#[derive(Debug)]
struct Scenario {
    model: ModelShape,
    src: Vec<KvLayout>,
    dst: Vec<KvLayout>,
    src_blocks: Vec<Vec<u32>>,
    dst_blocks: Vec<Vec<u32>>,
    num_tokens: u64,
    /// A source list was cut below what the destination needs.
    short: bool,
    /// Every list is strictly increasing.
    ascending: bool,
}

fn dtype() -> impl Strategy<Value = DType> {
    prop_oneof![
        Just(DType::F16),
        Just(DType::Bf16),
        Just(DType::F32),
        Just(DType::F8E4M3),
        Just(DType::F8E5M2),
        Just(DType::U8),
    ]
}

fn ids() -> impl Strategy<Value = Ids> {
    prop_oneof![2 => Just(Ids::Ascending), 1 => Just(Ids::Descending), 2 => Just(Ids::Shuffled)]
}

fn side() -> impl Strategy<Value = SideParams> {
    (
        0u32..4,
        prop_oneof![2 => Just(1u16), 2 => Just(2u16), 1 => Just(3u16)],
        0u32..=5,
        0u8..3,
        prop_oneof![3 => Just(0u64), 1 => 1u64..=3],
        prop_oneof![1 => Just(0u32), 1 => 1u32..=6],
        prop_oneof![Just(Regions::Adjacent), Just(Regions::AdjacentShuffled), Just(Regions::Gaps)],
        1u64..=0xffff,
    )
        .prop_map(|(tp_log, pp, block_tokens_log, joint, pad_elems, extra_blocks, regions, base_page)| {
            SideParams { tp_log, pp, block_tokens_log, joint, pad_elems, extra_blocks, regions, base_page }
        })
}

fn list() -> impl Strategy<Value = ListParams> {
    (prop_oneof![6 => Just(100u64), 3 => 0u64..=100, 1 => Just(0u64)], 0u64..=100, ids(), ids()).prop_map(
        |(dst_keep_pct, src_extra_pct, src_ids, dst_ids)| ListParams { dst_keep_pct, src_extra_pct, src_ids, dst_ids },
    )
}

fn case() -> impl Strategy<Value = Case> {
    let model = (
        prop::bool::weighted(0.2),
        0u32..4,
        1u32..=4,
        dtype(),
        1u32..=5,
        prop::collection::vec(0usize..3, 5),
        prop::collection::vec(prop::option::weighted(0.5, 1u32..=160), 3),
        prop_oneof![1u64..=24, 1u64..=200],
    );
    let sides = (
        any::<bool>(),
        prop::bool::weighted(0.2),
        side(),
        side(),
        prop::collection::vec(list(), 3),
        prop::option::weighted(0.1, 0usize..3),
        prop::bool::weighted(0.4),
        any::<u64>(),
    );
    (model, sides).prop_map(
        |(
            (latent, heads_log, head_dim, dtype, total_layers, layer_group, windows, num_tokens),
            (src_nhd, dst_order_differs, src, dst, lists, short_src, ascending_only, seed),
        )| Case {
            latent,
            heads_log,
            head_dim,
            dtype,
            total_layers,
            layer_group,
            windows,
            num_tokens,
            src_nhd,
            dst_order_differs,
            src,
            dst,
            lists,
            short_src,
            ascending_only,
            seed,
        },
    )
}

/// The layouts of every rank (PP-major) of one engine.
fn engine_layouts(
    model: &ModelShape,
    p: &SideParams,
    order: BlockOrder,
    num_blocks: u32,
    cells: bool,
    rng: &mut Rng,
) -> Result<Vec<KvLayout>, TestCaseError> {
    let tp_size = 1u16 << p.tp_log;
    let pp_size = p.pp.min(model.total_layers as u16);
    let placement = match (model.kind, p.joint, order) {
        (KvKind::Latent, ..) => KvPlacement::Single,
        // K‖V cells pair only with K‖V cells: both sides or neither (the case's choice).
        (KvKind::KeyValue, ..) if cells => KvPlacement::CellJoint,
        (KvKind::KeyValue, 0, _) => KvPlacement::Separate,
        (KvKind::KeyValue, 2, BlockOrder::Hnd) => KvPlacement::HeadJoint,
        (KvKind::KeyValue, ..) => KvPlacement::Joint,
    };
    let elem = elem_bytes(model);
    let mut out = Vec::new();
    for pp_rank in 0..pp_size {
        for tp_rank in 0..tp_size {
            let parallel = Parallel { tp_rank, tp_size, pp_rank, pp_size };
            let mut l = KvLayout {
                model: model.clone(),
                block_tokens: 1 << p.block_tokens_log,
                order,
                placement,
                block_stride: 0,
                num_blocks,
                parallel,
                region_bases: Vec::new(),
            };
            let heads = u64::from(l.head_range().end - l.head_range().start);
            let parts_in_block = u64::from(placement.parts_in_block());
            l.block_stride = u64::from(l.block_tokens) * heads * elem * parts_in_block + p.pad_elems * elem;
            let regions_per_layer = if placement == KvPlacement::Separate { 2 } else { 1 };
            let n = l.layer_range().len() * regions_per_layer;
            let len = l.block_stride * u64::from(num_blocks);
            let base = p.base_page << 12;
            l.region_bases = match p.regions {
                Regions::Adjacent => (0..n as u64).map(|i| base + i * len).collect(),
                Regions::AdjacentShuffled => {
                    let mut slots: Vec<u64> = (0..n as u64).collect();
                    rng.shuffle(&mut slots);
                    slots.iter().map(|s| base + s * len).collect()
                }
                Regions::Gaps => {
                    let mut at = base;
                    let mut bases = Vec::with_capacity(n);
                    for _ in 0..n {
                        bases.push(at);
                        let gap = match rng.below(3) {
                            0 => 1 + rng.below(3),
                            1 => elem * (1 + rng.below(4)),
                            _ => 1 + rng.below(0x1_0000),
                        };
                        at += len + gap;
                    }
                    bases
                }
            };
            prop_assert_eq!(l.validate(), Ok(()), "generated layout {:?}", l);
            out.push(l);
        }
    }
    Ok(out)
}

/// `len` distinct block ids below `num_blocks`.
fn block_ids(len: u64, num_blocks: u32, how: Ids, rng: &mut Rng) -> Vec<u32> {
    let nb = u64::from(num_blocks);
    match how {
        Ids::Ascending | Ids::Descending => {
            let start = rng.below(nb - len + 1) as u32;
            let mut v: Vec<u32> = (start..start + len as u32).collect();
            if matches!(how, Ids::Descending) {
                v.reverse();
            }
            v
        }
        Ids::Shuffled => {
            let mut all: Vec<u32> = (0..num_blocks).collect();
            for i in 0..len as usize {
                let j = i + rng.below(nb - i as u64) as usize;
                all.swap(i, j);
            }
            all.truncate(len as usize);
            all
        }
    }
}

fn build(c: &Case) -> Result<Scenario, TestCaseError> {
    let mut rng = Rng(c.seed);
    // KV groups: each layer goes to the group it drew; empty groups are dropped.
    let mut groups: Vec<(usize, KvGroup)> = Vec::new();
    for layer in 0..c.total_layers {
        let drawn = c.layer_group[layer as usize];
        match groups.iter_mut().find(|(d, _)| *d == drawn) {
            Some((_, g)) => g.layers.push(layer),
            None => {
                let kind = match c.windows[drawn] {
                    None => GroupKind::Full,
                    Some(w) => GroupKind::SlidingWindow { window_tokens: w },
                };
                groups.push((drawn, KvGroup { kind, layers: vec![layer] }));
            }
        }
    }
    let model = ModelShape {
        total_layers: c.total_layers,
        kv_heads: if c.latent { 1 } else { 1 << c.heads_log },
        head_dim: c.head_dim,
        dtype: c.dtype,
        kind: if c.latent { KvKind::Latent } else { KvKind::KeyValue },
        groups: groups.into_iter().map(|(_, g)| g).collect(),
    };
    let n = c.num_tokens;
    let (bts, btd) = (1u32 << c.src.block_tokens_log, 1u32 << c.dst.block_tokens_log);
    let (full_s, full_d) = (n.div_ceil(bts.into()), n.div_ceil(btd.into()));
    let src_num_blocks = full_s as u32 + c.src.extra_blocks;
    let dst_num_blocks = full_d as u32 + c.dst.extra_blocks;
    let mut short = false;
    let (mut src_blocks, mut dst_blocks) = (Vec::new(), Vec::new());
    for (g, group) in model.groups.iter().enumerate() {
        let lp = &c.lists[g];
        let dst_len = (full_d * lp.dst_keep_pct).div_ceil(100);
        let mut first = (full_d - dst_len) * u64::from(btd);
        if let GroupKind::SlidingWindow { window_tokens } = group.kind {
            first = first.max(n.saturating_sub(window_tokens.into()));
        }
        let min_src = if first >= n { 0 } else { full_s - first / u64::from(bts) };
        let mut src_len = min_src + (full_s - min_src) * lp.src_extra_pct / 100;
        if c.short_src == Some(g) && min_src > 0 {
            src_len = min_src - 1;
            short = true;
        }
        let (src_ids, dst_ids) =
            if c.ascending_only { (Ids::Ascending, Ids::Ascending) } else { (lp.src_ids, lp.dst_ids) };
        src_blocks.push(block_ids(src_len, src_num_blocks, src_ids, &mut rng));
        dst_blocks.push(block_ids(dst_len, dst_num_blocks, dst_ids, &mut rng));
    }
    let src_order = if c.src_nhd { BlockOrder::Nhd } else { BlockOrder::Hnd };
    let dst_order = match (c.dst_order_differs, src_order) {
        (false, o) => o,
        (true, BlockOrder::Hnd) => BlockOrder::Nhd,
        (true, BlockOrder::Nhd) => BlockOrder::Hnd,
    };
    // One case in five keeps K and V side by side in each cell on both sides.
    let cells = c.seed.is_multiple_of(5);
    let src = engine_layouts(&model, &c.src, src_order, src_num_blocks, cells, &mut rng)?;
    let dst = engine_layouts(&model, &c.dst, dst_order, dst_num_blocks, cells, &mut rng)?;
    let ascending = src_blocks.iter().chain(&dst_blocks).all(|l| l.windows(2).all(|w| w[0] < w[1]));
    Ok(Scenario { model, src, dst, src_blocks, dst_blocks, num_tokens: n, short, ascending })
}

/// Plans every producer rank into every consumer rank of `s` and checks each plan against the
/// reference; per consumer rank, checks the producers together (coverage, no double writes, count).
fn check_scenario(s: &Scenario, check_maximal: bool) -> Result<(), TestCaseError> {
    let mut planner = Planner::new();
    let mut out = Vec::new();
    for dst in &s.dst {
        let mut ok = 0u32;
        let mut written = Vec::new();
        for src in &s.src {
            let input =
                PlanInput { src, dst, src_blocks: &s.src_blocks, dst_blocks: &s.dst_blocks, num_tokens: s.num_tokens };
            if let Some(moves) = check_pair(&mut planner, &mut out, &input, check_maximal)? {
                ok += 1;
                written.extend(moves);
            }
        }
        if s.short || packed_mismatch(&s.src[0], dst) {
            continue;
        }
        let rank = dst.parallel.rank();
        prop_assert_eq!(ok, expected_notifications(&s.model, s.src[0].parallel, dst.parallel), "D rank {:?}", rank);
        let written = canonical(written, true)
            .map_err(|e| TestCaseError::fail(format!("producers together into D rank {rank:?}: {e}")))?;
        let needed = canonical(needed_by(dst, &s.dst_blocks, s.num_tokens, s.src[0].block_tokens), true)
            .map_err(|e| TestCaseError::fail(format!("needed by D rank {rank:?}: {e}")))?;
        same_runs(&format!("bytes written into D rank {rank:?} by all producers"), &written, &needed)?;
    }
    Ok(())
}

proptest! {
    // 256 cases unless `PROPTEST_CASES` says otherwise (a soak: `PROPTEST_CASES=30000`). No regression
    // file is written (this test owns no other file); a failure prints its minimal case.
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

    /// The merged plan moves exactly the reference's bytes, inside its regions, maximally merged.
    #[test]
    fn plan_matches_reference(c in case()) {
        let s = build(&c)?;
        // Maximal merging only for ascending lists: see the module docs (a known missed merge).
        check_scenario(&s, s.ascending)?;
    }
}

// ---------------------------------------------------------------------------------------------
// Named examples.
// ---------------------------------------------------------------------------------------------

/// A model of `layers` layers in one full-attention group (or two, the odd layers in a window group).
fn example_model(layers: u32, kv_heads: u32, window: Option<u32>) -> ModelShape {
    let groups = match window {
        None => vec![KvGroup { kind: GroupKind::Full, layers: (0..layers).collect() }],
        Some(w) => vec![
            KvGroup { kind: GroupKind::Full, layers: (0..layers).step_by(2).collect() },
            KvGroup { kind: GroupKind::SlidingWindow { window_tokens: w }, layers: (1..layers).step_by(2).collect() },
        ],
    };
    ModelShape { total_layers: layers, kv_heads, head_dim: 2, dtype: DType::F16, kind: KvKind::KeyValue, groups }
}

/// Every TP rank (PP 1) of an engine; regions back to back from `base`.
fn example_engine(
    model: &ModelShape,
    tp_size: u16,
    block_tokens: u32,
    order: BlockOrder,
    placement: KvPlacement,
    base: u64,
) -> Vec<KvLayout> {
    (0..tp_size)
        .map(|tp_rank| {
            let mut l = KvLayout {
                model: model.clone(),
                block_tokens,
                order,
                placement,
                block_stride: 0,
                num_blocks: 32,
                parallel: Parallel { tp_rank, tp_size, pp_rank: 0, pp_size: 1 },
                region_bases: Vec::new(),
            };
            l.block_stride = l.part_bytes() * if placement == KvPlacement::Joint { 2 } else { 1 };
            let n = u64::from(model.total_layers) * u64::from(placement.regions_per_layer());
            l.region_bases = (0..n).map(|i| base + i * l.region_len()).collect();
            l.validate().expect("example layout is valid");
            l
        })
        .collect()
}

/// Plans every producer into every consumer, compares each plan with the reference byte by byte and
/// runs the scenario checks; returns, per consumer rank, the copies of each producer that wrote into it.
fn check_example(
    src: &[KvLayout],
    dst: &[KvLayout],
    src_blocks: &[Vec<u32>],
    dst_blocks: &[Vec<u32>],
    num_tokens: u64,
) -> Vec<Vec<(u16, Vec<Copy>)>> {
    let mut planner = Planner::new();
    let mut per_dst = Vec::new();
    for d in dst {
        let mut writers = Vec::new();
        for s in src {
            let input = PlanInput { src: s, dst: d, src_blocks, dst_blocks, num_tokens };
            let mut out = Vec::new();
            match (planner.plan(&input, &mut out), reference(s, d, src_blocks, dst_blocks, num_tokens)) {
                (Ok(_), Expected::Moves(want)) => {
                    assert_eq!(byte_map(&moves_of(&out)), byte_map(&want), "{:?} -> {:?}", s.parallel, d.parallel);
                    writers.push((s.parallel.tp_rank, out));
                }
                (Err(PlanError::NotATarget { .. }), Expected::NotATarget) => {}
                (got, want) => panic!("{:?} -> {:?}: planner {got:?}, reference {want:?}", s.parallel, d.parallel),
            }
        }
        per_dst.push(writers);
    }
    let scenario = Scenario {
        model: src[0].model.clone(),
        src: src.to_vec(),
        dst: dst.to_vec(),
        src_blocks: src_blocks.to_vec(),
        dst_blocks: dst_blocks.to_vec(),
        num_tokens,
        short: false,
        ascending: src_blocks.iter().chain(dst_blocks).all(|l| l.windows(2).all(|w| w[0] < w[1])),
    };
    if let Err(e) = check_scenario(&scenario, true) {
        panic!("{e}");
    }
    per_dst
}

#[test]
fn p_tp2_into_d_tp4_each_consumer_has_one_producer() {
    let m = example_model(2, 4, None);
    let src = example_engine(&m, 2, 16, BlockOrder::Hnd, KvPlacement::Separate, 1 << 32);
    let dst = example_engine(&m, 4, 16, BlockOrder::Hnd, KvPlacement::Separate, 1 << 40);
    // 40 tokens: 3 blocks on each side.
    let per_dst = check_example(&src, &dst, &[vec![4, 5, 6]], &[vec![9, 10, 11]], 40);
    for (d, writers) in dst.iter().zip(&per_dst) {
        // D rank r holds head r, which P rank r / 2 holds as its local head r % 2.
        assert_eq!(writers.len(), 1, "D rank {}", d.parallel.tp_rank);
        assert_eq!(writers[0].0, d.parallel.tp_rank / 2);
        assert_eq!(d.head_range(), u32::from(d.parallel.tp_rank)..u32::from(d.parallel.tp_rank) + 1);
        // D's blocks hold one head and are contiguous, but P's hold two heads, so the head's tokens
        // jump from one P block to the next: one copy per block, layer and part.
        assert_eq!(writers[0].1.len(), 2 * 2 * 3);
    }
}

#[test]
fn p_tp4_into_d_tp2_each_consumer_has_two_producers() {
    let m = example_model(3, 8, Some(20));
    let src = example_engine(&m, 4, 8, BlockOrder::Nhd, KvPlacement::Joint, 1 << 32);
    let dst = example_engine(&m, 2, 8, BlockOrder::Nhd, KvPlacement::Separate, 1 << 40);
    // 30 tokens, 4 blocks; the destination's full group had a prefix hit of one block.
    let src_blocks = vec![vec![0, 1, 2, 3], vec![7, 6, 5, 4]];
    let dst_blocks = vec![vec![20, 21, 22], vec![3, 1, 2, 0]];
    let per_dst = check_example(&src, &dst, &src_blocks, &dst_blocks, 30);
    for (d, writers) in dst.iter().zip(&per_dst) {
        let r = d.parallel.tp_rank;
        let producers: Vec<u16> = writers.iter().map(|w| w.0).collect();
        assert_eq!(producers, vec![2 * r, 2 * r + 1]);
    }
}

#[test]
fn block_sizes_16_to_32_and_32_to_16() {
    let m = example_model(4, 2, Some(40));
    let n: u64 = 100;
    for (bts, btd) in [(16u32, 32u32), (32, 16)] {
        let src = example_engine(&m, 1, bts, BlockOrder::Hnd, KvPlacement::Separate, 1 << 32);
        let dst = example_engine(&m, 2, btd, BlockOrder::Hnd, KvPlacement::Separate, 1 << 40);
        let (full_s, full_d) = (n.div_ceil(u64::from(bts)) as u32, n.div_ceil(u64::from(btd)) as u32);
        // Full group: the destination lists its last two blocks (a prefix hit); window group: all.
        let src_blocks = vec![(3..3 + full_s).collect(), (10..10 + full_s).collect()];
        let dst_blocks = vec![(12..14).collect(), (0..full_d).collect()];
        let per_dst = check_example(&src, &dst, &src_blocks, &dst_blocks, n);
        for writers in &per_dst {
            // Each D rank receives its one head: the full group's listed tail and the window's last 40
            // tokens, two layers each, K and V.
            assert_eq!(writers.len(), 1);
            let bytes: u64 = writers[0].1.iter().map(|c| c.len).sum();
            let elem = 2 * 2;
            let full_tokens = n - (full_d as u64 - 2) * u64::from(btd);
            assert_eq!(bytes, (full_tokens * 2 + 40 * 2) * 2 * elem, "P {bts} / D {btd}");
        }
        // Into a destination with one head per block from a source with one head: one copy per layer
        // and part when ids are contiguous on both sides.
        let m1 = example_model(4, 1, Some(40));
        let src1 = example_engine(&m1, 1, bts, BlockOrder::Hnd, KvPlacement::Separate, 1 << 32);
        let dst1 = example_engine(&m1, 1, btd, BlockOrder::Hnd, KvPlacement::Separate, 1 << 40);
        let per_dst = check_example(&src1, &dst1, &src_blocks, &dst_blocks, n);
        assert_eq!(per_dst[0][0].1.len(), 4 * 2, "P {bts} / D {btd}");
    }
}
