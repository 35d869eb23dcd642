//! Shared pieces of kvpush's codec fuzzing: the fixed peer layout that the fuzz target, the corpus
//! generator (`examples/gen_corpus.rs`) and the replay test (`tests/proto/codec_corpus.rs` in the parent
//! crate) all decode against, the valid sample messages, and the naming of decode errors used in
//! `tests/corpus/codec/MANIFEST.tsv`.
//!
//! `tests/proto/codec_corpus.rs` cannot depend on this crate, so it defines [`peer_layout`],
//! [`peer_handshake`], [`valid_messages`], [`describe`] and [`fingerprint`] again, identically; the
//! manifest records [`fingerprint`] of the peer handshake so the test notices if the two drift.

use kvpush::proto::codec::{to_vec, DecodeError, PROTOCOL_VERSION};
use kvpush::proto::compat::compat_hash;
use kvpush::proto::ids::{Key, Rank};
use kvpush::proto::layout::{
    BlockOrder, DType, GroupKind, KvGroup, KvKind, KvLayout, KvPlacement, LayoutError, ModelShape, Parallel,
};
use kvpush::proto::msg::{
    Abort, Completion, Failure, FailureKind, Handshake, Heartbeat, Message, Mode, RangeError, Registration,
};

/// The sender's layout every non-handshake corpus entry is checked against: testutil's
/// `small_layout` (4 layers in two groups — full: 0, 2; sliding window 64: 1, 3 —, 2 KV heads of
/// dim 8, bf16, HND, K and V separate, 64 blocks of 16 tokens) but on TP rank 1 of 2, so its rank is
/// `tp1/pp0` and the all-zero rank is a wrong one. One KV head per rank: parts of 256 bytes.
pub fn peer_layout() -> KvLayout {
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
        parallel: Parallel { tp_rank: 1, tp_size: 2, pp_rank: 0, pp_size: 1 },
        region_bases: (0..8).map(|i| 0x1000_0000 + i * 0x10_0000).collect(),
    };
    l.block_stride = l.part_bytes();
    l
}

/// A handshake carrying `layout` with a correct compatibility hash.
pub fn handshake_for(layout: KvLayout, mode: Mode) -> Handshake {
    Handshake {
        protocol: PROTOCOL_VERSION,
        software: "0.1.0".into(),
        engine_id: "engine-a".into(),
        mode,
        agent_metadata: vec![1, 2, 3, 4],
        compat_hash: compat_hash(&layout.model, layout.order, mode, PROTOCOL_VERSION),
        layout,
    }
}

/// The peer's own handshake (push mode).
pub fn peer_handshake() -> Handshake {
    handshake_for(peer_layout(), Mode::Push)
}

/// The key every sample message uses.
pub const KEY: Key = Key::new(0xdead_beef, 3);

/// One valid message of each kind, all consistent with [`peer_layout`], named by kind.
pub fn valid_messages() -> Vec<(&'static str, Message)> {
    let l = peer_layout();
    let rank = l.parallel.rank();
    let reg = Registration::new(KEY, "decode-0".into(), rank, 33, vec![vec![4, 5, 6], vec![9]], &l)
        .expect("sample registration fits the peer layout");
    vec![
        ("handshake", Message::Handshake(Box::new(peer_handshake()))),
        ("registration", Message::Registration(reg)),
        ("completion", Message::Completion(Completion { key: KEY, rank })),
        (
            "failure",
            Message::Failure(Failure {
                key: KEY,
                rank,
                kind: FailureKind::TransferFailed { status: -3 },
                detail: "post failed".into(),
            }),
        ),
        ("abort", Message::Abort(Abort { key: KEY, rank, reason: "client went away".into() })),
        ("heartbeat", Message::Heartbeat(Heartbeat { seq: 42 })),
    ]
}

/// A rank other than the peer's.
pub const WRONG_RANKS: [Rank; 3] = [Rank::new(0, 0), Rank::new(1, 1), Rank::new(2, 0)];

/// FNV-1a over the encoded peer handshake: recorded in the manifest so that a replay with a
/// different peer layout fails loudly instead of checking the wrong thing.
pub fn fingerprint() -> u64 {
    let bytes = to_vec(&Message::Handshake(Box::new(peer_handshake()))).expect("peer handshake encodes");
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The manifest's name of a decode error: its variant, and a detail naming the inner error where
/// there is one (`-` otherwise). Example: `("Range", "Layout:OutOfRange:num_blocks")`.
pub fn describe(e: &DecodeError) -> (&'static str, String) {
    match e {
        DecodeError::Truncated { .. } => ("Truncated", "-".into()),
        DecodeError::TrailingBytes { .. } => ("TrailingBytes", "-".into()),
        DecodeError::BadMagic(_) => ("BadMagic", "-".into()),
        DecodeError::UnsupportedVersion { .. } => ("UnsupportedVersion", "-".into()),
        DecodeError::UnknownKind(_) => ("UnknownKind", "-".into()),
        DecodeError::TooLarge { .. } => ("TooLarge", "-".into()),
        DecodeError::Malformed { .. } => ("Malformed", "-".into()),
        DecodeError::NoPeerLayout { .. } => ("NoPeerLayout", "-".into()),
        DecodeError::Range { source, .. } => ("Range", range_detail(source)),
        DecodeError::HashMismatch { .. } => ("HashMismatch", "-".into()),
        _ => ("Unknown", format!("{e:?}")),
    }
}

fn range_detail(e: &RangeError) -> String {
    match e {
        RangeError::OutOfRange { field, .. } => format!("OutOfRange:{field}"),
        RangeError::GroupCount { .. } => "GroupCount".into(),
        RangeError::BlockId { .. } => "BlockId".into(),
        RangeError::TooManyBlocks { .. } => "TooManyBlocks".into(),
        RangeError::Rank { .. } => "Rank".into(),
        RangeError::TooLong { field, .. } => format!("TooLong:{field}"),
        RangeError::Layout(l) => format!("Layout:{}", layout_detail(l)),
        _ => format!("Unknown:{e:?}"),
    }
}

fn layout_detail(e: &LayoutError) -> String {
    match e {
        LayoutError::OutOfRange { field, .. } => format!("OutOfRange:{field}"),
        LayoutError::RankOutOfRange { what, .. } => format!("RankOutOfRange:{what}"),
        LayoutError::HeadsNotDivisible { .. } => "HeadsNotDivisible".into(),
        LayoutError::PlacementMismatch { .. } => "PlacementMismatch".into(),
        LayoutError::PlacementOrder { .. } => "PlacementOrder".into(),
        LayoutError::LatentHeads(_) => "LatentHeads".into(),
        LayoutError::StrideTooSmall { .. } => "StrideTooSmall".into(),
        LayoutError::RegionCount { .. } => "RegionCount".into(),
        LayoutError::BadRegion { .. } => "BadRegion".into(),
        LayoutError::Overlap { .. } => "Overlap".into(),
        LayoutError::Groups(_) => "Groups".into(),
        _ => format!("Unknown:{e:?}"),
    }
}
