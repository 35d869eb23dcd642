//! Layouts and handshakes shared by the unit tests of `proto`.
//!
//! `kvpush-testkit`'s `corpus` module includes this file too (`#[path]`), for the codec corpus's
//! handshakes: keep it to `super::` paths (the including module provides `codec`, `compat`,
//! `layout` and `msg`) and to what both sides can build.

use super::codec::PROTOCOL_VERSION;
use super::compat::compat_hash;
use super::layout::{BlockOrder, DType, GroupKind, KvGroup, KvKind, KvLayout, KvPlacement, ModelShape, Parallel};
use super::msg::{Handshake, Mode};

/// 4 layers in two groups (full: 0, 2; window 64: 1, 3), 2 KV heads, 64 blocks of 16 tokens.
pub fn small_layout() -> KvLayout {
    let model = ModelShape {
        total_layers: 4,
        kv_heads: 2,
        head_dim: 8,
        dtype: DType::Bf16,
        kind: KvKind::KeyValue,
        groups: vec![
            KvGroup { kind: GroupKind::Full, layers: vec![0, 2] },
            KvGroup { kind: GroupKind::SlidingWindow { window_tokens: 64 }, layers: vec![1, 3] },
        ],
    };
    let mut l = KvLayout {
        model,
        block_tokens: 16,
        order: BlockOrder::Hnd,
        placement: KvPlacement::Separate,
        block_stride: 0,
        num_blocks: 64,
        parallel: Parallel::SINGLE,
        region_bases: (0..8).map(|i| 0x1000_0000 + i * 0x10_0000).collect(),
    };
    l.block_stride = l.part_bytes();
    l
}

/// A handshake for `layout` with a correct compatibility hash.
pub fn handshake(layout: KvLayout, mode: Mode) -> Handshake {
    Handshake {
        protocol: PROTOCOL_VERSION,
        software: "0.1.0".into(),
        engine_id: "engine-a".into(),
        mode,
        agent_metadata: vec![1, 2, 3, 4],
        compat_hash: compat_hash(&layout.model, layout.order, mode, PROTOCOL_VERSION),
        layout,
        memory: None,
    }
}
