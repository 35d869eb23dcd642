//! The model shapes and KV layouts the tests, benches and the demo share.
//!
//! Read [`separate`] first: every layout here is vLLM's default (HND, K and V in separate regions,
//! blocks packed back to back), and only the model, the block count and the rank vary. Regions are
//! either fake addresses ([`at_fake_addresses`], for protocol-level tests that never touch memory) or
//! allocated on a device ([`allocate`]). The library's own unit tests cannot use this crate; they have
//! `src/proto/testutil.rs`, which builds [`small`] at TP 1 by hand.

use kvpush::device::{Buffer, Device, DeviceError};
use kvpush::proto::layout::{
    BlockOrder, DType, GroupKind, KvGroup, KvKind, KvLayout, KvPlacement, ModelShape, Parallel,
};

/// Tokens per block of every shared layout (vLLM's default).
pub const BLOCK_TOKENS: u32 = 16;

/// 4 layers in two groups (full attention: 0, 2; sliding window of 64 tokens: 1, 3), 2 KV heads of
/// dimension 8, bf16. Small enough to check byte by byte, with two groups to exercise grouping.
pub fn two_group_model() -> ModelShape {
    let mut m = full_model(4, 2, 8);
    m.groups = vec![
        KvGroup { kind: GroupKind::Full, layers: vec![0, 2] },
        KvGroup { kind: GroupKind::SlidingWindow { window_tokens: 64 }, layers: vec![1, 3] },
    ];
    m
}

/// `layers` layers in one full-attention group, `kv_heads` KV heads of dimension `head_dim`, bf16.
pub fn full_model(layers: u32, kv_heads: u32, head_dim: u32) -> ModelShape {
    ModelShape {
        total_layers: layers,
        kv_heads,
        head_dim,
        dtype: DType::Bf16,
        kind: KvKind::KeyValue,
        groups: vec![KvGroup { kind: GroupKind::Full, layers: (0..layers).collect() }],
    }
}

/// Qwen3-32B's KV shape: 64 layers, 8 KV heads of dimension 128, bf16, all full attention.
pub fn qwen3_32b() -> ModelShape {
    full_model(64, 8, 128)
}

/// TP rank `tp_rank` of `tp_size` (PP 1).
pub fn tp(tp_rank: u16, tp_size: u16) -> Parallel {
    Parallel { tp_rank, tp_size, pp_rank: 0, pp_size: 1 }
}

/// `model` on one rank: [`BLOCK_TOKENS`]-token blocks, HND, K and V in separate regions, blocks
/// packed (stride = one part), `num_blocks` blocks. No regions yet (`region_bases` is empty).
pub fn separate(model: ModelShape, num_blocks: u32, parallel: Parallel) -> KvLayout {
    let mut l = KvLayout {
        model,
        block_tokens: BLOCK_TOKENS,
        order: BlockOrder::Hnd,
        placement: KvPlacement::Separate,
        block_stride: 0,
        num_blocks,
        parallel,
        region_bases: Vec::new(),
    };
    l.block_stride = l.part_bytes();
    l
}

/// How many regions `l` has (one per layer of its rank, times two where K and V are apart).
pub fn region_count(l: &KvLayout) -> usize {
    l.layer_range().len() * l.placement.regions_per_layer() as usize
}

/// `l` with its regions at fake addresses, 1 MiB apart from 256 MiB: for tests that plan or encode
/// but never read or write memory. Panics if the result is invalid (a fixture bug).
pub fn at_fake_addresses(mut l: KvLayout) -> KvLayout {
    l.region_bases = (0..region_count(&l) as u64).map(|i| 0x1000_0000 + i * 0x10_0000).collect();
    l.validate().expect("fixture layout is valid");
    l
}

/// The small two-group layout of the protocol tests: [`two_group_model`], 64 blocks, on TP rank
/// `tp_rank` of `tp_size`, at fake addresses.
pub fn small(tp_rank: u16, tp_size: u16) -> KvLayout {
    at_fake_addresses(separate(two_group_model(), 64, tp(tp_rank, tp_size)))
}

/// Allocates every region of `l` on `dev` and points `l.region_bases` at them. Keep the buffers
/// alive for as long as anything (an engine) uses the layout.
pub fn allocate(l: &mut KvLayout, dev: &dyn Device) -> Result<Vec<Box<dyn Buffer>>, DeviceError> {
    let mut buffers = Vec::with_capacity(region_count(l));
    l.region_bases.clear();
    for _ in 0..region_count(l) {
        let b = dev.alloc(l.region_len())?;
        l.region_bases.push(b.region().addr);
        buffers.push(b);
    }
    Ok(buffers)
}
