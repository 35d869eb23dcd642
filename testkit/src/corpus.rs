//! The fixtures of kvpush's codec corpus: the fixed peer layout that the fuzz target, the corpus
//! generator (`fuzz/examples/gen_corpus.rs`) and the replay test (`tests/proto/codec_corpus.rs`) all
//! decode against, the valid sample messages, and the naming of decode errors used in
//! `tests/corpus/codec/MANIFEST.tsv`.
//!
//! Read [`peer_layout`] and [`describe`] first. The manifest records [`fingerprint`] of the peer
//! handshake, so a replay against a different peer layout than the corpus was written with fails
//! loudly. The handshake builder is the library's own `src/proto/testutil.rs`, included here so that
//! the unit tests and the corpus share one definition.

use kvpush::proto::codec::{to_vec, DecodeError};
use kvpush::proto::ids::{Key, Rank};
use kvpush::proto::layerwise::LayerCompletion;
use kvpush::proto::layout::{KvLayout, LayoutError};
use kvpush::proto::msg::{
    Abort, Completion, Failure, FailureKind, Handshake, Heartbeat, Message, Mode, RangeError, Registration,
};
// The modules `testutil` names through `super::`.
use kvpush::proto::{codec, compat, layout, msg};

#[path = "../../src/proto/testutil.rs"]
#[allow(dead_code)] // the library's unit tests use `small_layout`; the corpus uses `layouts::small`
mod testutil;

pub use testutil::handshake as handshake_for;

/// The sender's layout every non-handshake corpus entry is checked against: [`layouts::small`] on TP
/// rank 1 of 2 (4 layers in two groups — full: 0, 2; sliding window 64: 1, 3 —, 2 KV heads of dim 8,
/// bf16, HND, K and V separate, 64 blocks of 16 tokens), so its rank is `tp1/pp0` and the all-zero
/// rank is a wrong one. One KV head per rank: parts of 256 bytes. It equals testutil's
/// `small_layout` but for the rank.
///
/// [`layouts::small`]: crate::layouts::small
pub fn peer_layout() -> KvLayout {
    crate::layouts::small(1, 2)
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
        ("layers", Message::Layers(LayerCompletion { key: KEY, rank, layers: 1..3, part: 0..4 })),
    ]
}

/// Ranks other than the peer's.
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

/// Every variant name [`describe`] gives a `DecodeError`, in the enum's order.
pub const VARIANTS: [&str; 10] = [
    "Truncated",
    "TrailingBytes",
    "BadMagic",
    "UnsupportedVersion",
    "UnknownKind",
    "TooLarge",
    "Malformed",
    "NoPeerLayout",
    "Range",
    "HashMismatch",
];

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
        RangeError::Layers(_) => "Layers".into(),
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
        LayoutError::SharedWithinGroup { .. } => "SharedWithinGroup".into(),
        LayoutError::Groups(_) => "Groups".into(),
        _ => format!("Unknown:{e:?}"),
    }
}
