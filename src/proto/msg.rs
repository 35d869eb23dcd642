//! The messages of the protocol (see docs/protocol.md for the table).
//!
//! Every message that refers to blocks or ranks is range-checked when it is built or decoded:
//! a [`Registration`] can only exist if its block ids, group count and token count fit the layout of
//! the worker that sent it (parse, don't validate). Wire forms are private; the codec
//! ([`super::codec`]) turns bytes into these types or into a typed [`DecodeError`](super::codec::DecodeError).

use serde::{Deserialize, Serialize};

use super::bounce::MemoryOffer;
use super::ids::{EngineId, Key, Rank};
use super::layerwise::{LayerCompletion, LayerRangeError};
use super::layout::{KvLayout, LayoutError};

/// Largest engine id, in bytes.
pub const MAX_ENGINE_ID: usize = 256;
/// Largest free-text detail in a failure or abort, in bytes.
pub const MAX_DETAIL: usize = 1024;
/// Largest token count of one request.
pub const MAX_TOKENS: u64 = 1 << 26;
/// Largest opaque agent metadata (NIXL) in a handshake, in bytes.
pub const MAX_AGENT_METADATA: usize = 8 << 20;
/// Most block ids of one registration or grant, over all its groups: 4 MiB of ids, what the
/// decoder may allocate for one frame however few bytes its runs take (2^20 ids: 16M tokens in
/// 16-token blocks in each of the request's groups would exceed it).
pub const MAX_BLOCK_IDS: u64 = 1 << 20;

/// Transfer mode an engine runs in; both sides of a pair must agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Mode {
    /// The producer writes into blocks the consumer registered.
    Push,
    /// The consumer reads from the producer's blocks.
    Pull,
}

impl core::fmt::Display for Mode {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            Mode::Push => "push",
            Mode::Pull => "pull",
        })
    }
}

/// First message on a side channel, in both directions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handshake {
    /// Wire protocol version of the sender ([`super::codec::PROTOCOL_VERSION`]).
    pub protocol: u16,
    /// kvpush release of the sender (informational, e.g. `"0.1.0"`).
    pub software: String,
    /// The sender's engine id.
    pub engine_id: EngineId,
    /// Transfer mode.
    pub mode: Mode,
    /// Opaque transport metadata (a NIXL agent's metadata blob).
    pub agent_metadata: Vec<u8>,
    /// The sender's KV layout (validated on decode).
    pub layout: KvLayout,
    /// [`super::compat::compat_hash`] of the fields that must match (checked on decode).
    pub compat_hash: u64,
    /// The sender's memory offer ([`super::bounce`]), an optional extension after `compat_hash` on
    /// the wire (tag `01`, then the offer); `None` (no extension: an older peer) reads as
    /// [`MemoryOffer::DIRECT_ONLY`]. The codec writes it, not serde.
    #[serde(skip)]
    pub memory: Option<MemoryOffer>,
}

/// D → P: "write request `key` into these blocks of mine".
///
/// Fields are private: a value exists only if it fits the layout named at construction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    key: Key,
    engine_id: EngineId,
    rank: Rank,
    num_tokens: u64,
    block_ids: Vec<Vec<u32>>,
}

/// Why a [`Registration`] does not fit the layout it refers to.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RangeError {
    /// A number is outside its allowed range.
    #[error("`{field}` = {value} is out of range (limit {limit})")]
    OutOfRange {
        /// Field name.
        field: &'static str,
        /// The value.
        value: u64,
        /// The bound it breaks.
        limit: u64,
    },
    /// The group count differs from the layout's.
    #[error("{got} block lists for a layout with {expected} KV groups")]
    GroupCount {
        /// Lists given.
        got: usize,
        /// Groups in the layout.
        expected: usize,
    },
    /// A block id is not below the region's block count.
    #[error("group {group}: block id {block} is not below the {num_blocks} blocks of the layout")]
    BlockId {
        /// Group index.
        group: usize,
        /// Offending block id.
        block: u32,
        /// Blocks in the layout.
        num_blocks: u32,
    },
    /// More blocks than the token count needs.
    #[error("group {group}: {blocks} blocks for {tokens} tokens of {block_tokens} per block")]
    TooManyBlocks {
        /// Group index.
        group: usize,
        /// Blocks given.
        blocks: usize,
        /// Request tokens.
        tokens: u64,
        /// Block size.
        block_tokens: u32,
    },
    /// The rank does not match the layout's.
    #[error("message from rank {got} on a connection to rank {expected}")]
    Rank {
        /// Rank in the message.
        got: Rank,
        /// Rank of the layout.
        expected: Rank,
    },
    /// A string is longer than allowed.
    #[error("`{field}` is {len} bytes, more than {max}")]
    TooLong {
        /// Field name.
        field: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Block ids counted in blocks of `logical` tokens cannot be turned into blocks of `kernel`
    /// tokens: `kernel` does not divide `logical`.
    #[error("blocks of {logical} tokens are not whole blocks of {kernel} tokens")]
    BlockRatio {
        /// Tokens per block of the ids given.
        logical: u32,
        /// Tokens per block of the layout.
        kernel: u32,
    },
    /// The layout itself is invalid.
    #[error("invalid layout: {0}")]
    Layout(#[from] LayoutError),
    /// A layer notification's ranges do not fit the sender's layers.
    #[error("{0}")]
    Layers(#[from] LayerRangeError),
}

pub(crate) fn check_len(field: &'static str, len: usize, max: usize) -> Result<(), RangeError> {
    if len > max {
        Err(RangeError::TooLong { field, len, max })
    } else {
        Ok(())
    }
}

/// Blocks a request of `tokens` tokens needs at `block_tokens` per block.
pub fn blocks_for(tokens: u64, block_tokens: u32) -> u64 {
    tokens.div_ceil(u64::from(block_tokens.max(1)))
}

/// The tokens both sides of a transfer hold when each rounded the request up to its own whole blocks
/// (a producer and a consumer with different block sizes): `Some(the smaller count)` when the two
/// counts are two such roundings of one prompt — they differ by less than the larger block — else
/// `None` (two different requests under one key).
pub fn common_tokens(src: (u64, u32), dst: (u64, u32)) -> Option<u64> {
    let ((a, ba), (b, bb)) = (src, dst);
    (a.abs_diff(b) < u64::from(ba.max(bb))).then_some(a.min(b))
}

/// `block_ids` (lists for the last blocks of `num_tokens` tokens at `block_tokens` per block, as in a
/// registration) cut to the blocks that hold the first `to` tokens (`to <= num_tokens`): blocks a
/// list skips (a prefix hit) stay skipped, blocks past token `to` are dropped.
pub fn clip_block_lists(block_ids: &[Vec<u32>], num_tokens: u64, block_tokens: u32, to: u64) -> Vec<Vec<u32>> {
    let (all, keep) = (blocks_for(num_tokens, block_tokens), blocks_for(to, block_tokens));
    block_ids
        .iter()
        .map(|ids| {
            let skipped = all.saturating_sub(ids.len() as u64);
            let n = keep.saturating_sub(skipped).min(ids.len() as u64) as usize;
            ids[..n].to_vec()
        })
        .collect()
}

/// `block_ids` (lists for the last blocks of `num_tokens` tokens, as in a registration) named in
/// blocks of `logical_tokens` tokens — a serving engine's block ids, such as vLLM's, where its
/// attention kernel splits each block into smaller ones — as the layout's blocks of `kernel_tokens`:
/// block `b` is blocks `b·r … b·r + r − 1` (`r = logical_tokens / kernel_tokens`), and each list
/// loses the blocks of its last block past token `num_tokens` (its blocks are the request's last).
/// The connector's `expand_block_ids` (python/kvpush/_layouts.py) is the same map: a producer that
/// expanded its own ids with it pinned exactly what this returns for them.
pub fn kernel_block_lists(
    block_ids: &[Vec<u32>],
    logical_tokens: u32,
    kernel_tokens: u32,
    num_tokens: u64,
) -> Result<Vec<Vec<u32>>, RangeError> {
    if kernel_tokens == 0 || logical_tokens == 0 || !logical_tokens.is_multiple_of(kernel_tokens) {
        return Err(RangeError::BlockRatio { logical: logical_tokens, kernel: kernel_tokens });
    }
    let r = logical_tokens / kernel_tokens;
    // Kernel blocks the last logical block has past the request's last token.
    let unused =
        (blocks_for(num_tokens, logical_tokens) * u64::from(r)).saturating_sub(blocks_for(num_tokens, kernel_tokens));
    block_ids
        .iter()
        .map(|ids| {
            let mut out = Vec::with_capacity(ids.len() * r as usize);
            for &b in ids {
                let first = u64::from(b) * u64::from(r);
                let last = first + u64::from(r) - 1;
                if last > u64::from(u32::MAX) {
                    return Err(RangeError::OutOfRange {
                        field: "kernel block id",
                        value: last,
                        limit: u32::MAX.into(),
                    });
                }
                out.extend((first..=last).map(|k| k as u32));
            }
            out.truncate(out.len().saturating_sub(unused as usize));
            Ok(out)
        })
        .collect()
}

impl Registration {
    /// Builds a registration, checking it against `layout` (the registering worker's layout).
    ///
    /// `block_ids[g]` lists group `g`'s blocks for the *last* tokens of the request: a list shorter
    /// than the request needs means its first blocks are already present (a prefix-cache hit) or, for
    /// a sliding-window group, outside the window.
    pub fn new(
        key: Key,
        engine_id: EngineId,
        rank: Rank,
        num_tokens: u64,
        block_ids: Vec<Vec<u32>>,
        layout: &KvLayout,
    ) -> Result<Self, RangeError> {
        check_len("engine_id", engine_id.len(), MAX_ENGINE_ID)?;
        if num_tokens == 0 || num_tokens > MAX_TOKENS {
            return Err(RangeError::OutOfRange { field: "num_tokens", value: num_tokens, limit: MAX_TOKENS });
        }
        let expected = layout.parallel.rank();
        if rank != expected {
            return Err(RangeError::Rank { got: rank, expected });
        }
        check_block_lists(&block_ids, num_tokens, layout)?;
        Ok(Self { key, engine_id, rank, num_tokens, block_ids })
    }

    /// Which transfer and attempt.
    pub fn key(&self) -> Key {
        self.key
    }
    /// The consumer engine that registered.
    pub fn engine_id(&self) -> &str {
        &self.engine_id
    }
    /// The consumer rank that registered.
    pub fn rank(&self) -> Rank {
        self.rank
    }
    /// Tokens of the request (the prompt that prefill computes).
    pub fn num_tokens(&self) -> u64 {
        self.num_tokens
    }
    /// Block ids per KV group (tails; see [`Registration::new`]).
    pub fn block_ids(&self) -> &[Vec<u32>] {
        &self.block_ids
    }
    /// Gives the block lists back.
    pub fn into_block_ids(self) -> Vec<Vec<u32>> {
        self.block_ids
    }
}

/// Checks per-group block lists of a request against a layout: group count, ids, list lengths,
/// and at most [`MAX_BLOCK_IDS`] ids in all.
pub fn check_block_lists(block_ids: &[Vec<u32>], num_tokens: u64, layout: &KvLayout) -> Result<(), RangeError> {
    let groups = layout.model.groups.len();
    if block_ids.len() != groups {
        return Err(RangeError::GroupCount { got: block_ids.len(), expected: groups });
    }
    let max_blocks = blocks_for(num_tokens, layout.block_tokens);
    for (group, ids) in block_ids.iter().enumerate() {
        if ids.len() as u64 > max_blocks {
            return Err(RangeError::TooManyBlocks {
                group,
                blocks: ids.len(),
                tokens: num_tokens,
                block_tokens: layout.block_tokens,
            });
        }
        // The largest id first (a vectorized pass; a search for the first id out of range is not
        // vectorized), and that search only to name the id in the error.
        if ids.iter().max().is_some_and(|&b| b >= layout.num_blocks) {
            if let Some(&block) = ids.iter().find(|&&b| b >= layout.num_blocks) {
                return Err(RangeError::BlockId { group, block, num_blocks: layout.num_blocks });
            }
        }
    }
    check_block_count(block_ids)
}

/// Refuses lists of more than [`MAX_BLOCK_IDS`] ids in all.
pub(crate) fn check_block_count(block_ids: &[Vec<u32>]) -> Result<(), RangeError> {
    let total: u64 = block_ids.iter().map(|ids| ids.len() as u64).sum();
    if total > MAX_BLOCK_IDS {
        return Err(RangeError::OutOfRange { field: "block_ids", value: total, limit: MAX_BLOCK_IDS });
    }
    Ok(())
}

/// P → D (as the NIXL notification of a WRITE): "my part of `key` has landed in your blocks".
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Completion {
    /// Which transfer and attempt.
    pub key: Key,
    /// The producer rank whose part this is.
    pub rank: Rank,
}

/// P → D, pull mode, over the side channel: "my blocks of `key` are pinned for your read; these
/// are the blocks you may read". D reads exactly these (and fails the request where the ids it was
/// handed differ), so a stale or forged `remote_block_ids` reads nothing. The codec writes and
/// reads it by hand (its block lists as a registration's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// Which transfer and attempt.
    pub key: Key,
    /// The producer rank that pinned its blocks.
    pub rank: Rank,
    /// Tokens the blocks hold.
    pub num_tokens: u64,
    /// The pinned block ids per KV group (checked against the producer's layout on decode).
    pub block_ids: Vec<Vec<u32>>,
}

/// Why a transfer failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum FailureKind {
    /// The producer's lease on its blocks ran out before the registration came.
    LeaseExpired,
    /// Posting or completing the transfer failed; `status` is the transport's code.
    TransferFailed {
        /// Transport status code.
        status: i32,
    },
    /// The transfer could not be planned (layouts or block lists do not fit).
    PlanFailed,
    /// The producer refused the registration (too many pending, or a stale attempt).
    Refused,
    /// The request was aborted on the producer.
    Aborted,
    /// The peer went away.
    PeerLost,
}

impl core::fmt::Display for FailureKind {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            FailureKind::LeaseExpired => write!(f, "lease expired"),
            FailureKind::TransferFailed { status } => write!(f, "transfer failed (status {status})"),
            FailureKind::PlanFailed => write!(f, "planning failed"),
            FailureKind::Refused => write!(f, "refused"),
            FailureKind::Aborted => write!(f, "aborted"),
            FailureKind::PeerLost => write!(f, "peer lost"),
        }
    }
}

/// P → D: "`key` will not arrive from me" (explicit, so D fails at once instead of timing out).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// Which transfer and attempt.
    pub key: Key,
    /// The producer rank reporting.
    pub rank: Rank,
    /// What went wrong.
    pub kind: FailureKind,
    /// Human-readable context (bounded by [`MAX_DETAIL`]).
    pub detail: String,
}

/// D → P: "`key` waits in my serving engine's queue for blocks: keep holding yours for it". The
/// producer restarts the lease of a request it holds (it registers nothing, so it is not a
/// registration); a consumer sends it while the request stays queued, more often than the lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hold {
    /// Which transfer and attempt.
    pub key: Key,
    /// The sender's rank.
    pub rank: Rank,
}

/// Either direction: "forget `key`; release what you hold for it".
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Abort {
    /// Which transfer and attempt.
    pub key: Key,
    /// The sender's rank.
    pub rank: Rank,
    /// Human-readable reason (bounded by [`MAX_DETAIL`]).
    pub reason: String,
}

/// Either direction, periodically: proves the peer is alive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// Sender's sequence number.
    pub seq: u64,
}

/// Any protocol message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// See [`Handshake`].
    Handshake(Box<Handshake>),
    /// See [`Registration`].
    Registration(Registration),
    /// See [`Completion`].
    Completion(Completion),
    /// See [`Grant`].
    Grant(Grant),
    /// See [`Failure`].
    Failure(Failure),
    /// See [`Abort`].
    Abort(Abort),
    /// See [`Heartbeat`].
    Heartbeat(Heartbeat),
    /// See [`LayerCompletion`] (layer-wise push).
    Layers(LayerCompletion),
    /// See [`Hold`].
    Hold(Hold),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::testutil::small_layout;

    #[test]
    fn block_sizes_of_both_sides_meet_at_the_smaller_rounding() {
        // A 40-token prompt: P at 16 per block holds 48 tokens, D at 32 holds 64; both hold 48.
        assert_eq!(common_tokens((48, 16), (64, 32)), Some(48));
        assert_eq!(common_tokens((64, 32), (48, 16)), Some(48));
        // 64/128 and 128/64 (a 100-token prompt): both hold 128.
        assert_eq!(common_tokens((128, 64), (128, 128)), Some(128));
        // Counts a whole larger block apart are two different prompts.
        assert_eq!(common_tokens((48, 16), (80, 32)), None);
        assert_eq!(common_tokens((16, 16), (16, 16)), Some(16));
    }

    #[test]
    fn clipping_keeps_the_blocks_of_the_first_tokens() {
        // Full lists: 64 tokens at 32 per block cut to 48 keep both blocks; at 16 per block cut to 32
        // keep two of four.
        assert_eq!(clip_block_lists(&[vec![7, 8]], 64, 32, 48), vec![vec![7, 8]]);
        assert_eq!(clip_block_lists(&[vec![1, 2, 3, 4]], 64, 16, 32), vec![vec![1, 2]]);
        // A tail list (first block a prefix hit) stays a tail list of the shorter request.
        assert_eq!(clip_block_lists(&[vec![2, 3, 4]], 64, 16, 48), vec![vec![2, 3]]);
        // Per group; nothing past the list's end is invented.
        assert_eq!(clip_block_lists(&[vec![5], vec![6, 9]], 32, 16, 32), vec![vec![5], vec![6, 9]]);
    }

    #[test]
    fn logical_block_ids_expand_to_kernel_blocks_as_the_connector_does() {
        // 64-token blocks of 16-token kernel blocks, 70 tokens: blocks 3 and 9 are kernel blocks
        // 12..16 and 36..40, of which 70 tokens use 5 (37 to 39 hold nothing).
        assert_eq!(kernel_block_lists(&[vec![3, 9]], 64, 16, 70), Ok(vec![vec![12, 13, 14, 15, 36]]));
        // A tail list (sliding window, prefix hit) loses the same blocks at its end; per group.
        assert_eq!(
            kernel_block_lists(&[vec![3, 9], vec![9]], 64, 16, 128),
            Ok(vec![(12..16).chain(36..40).collect(), (36..40).collect()])
        );
        // Equal sizes: the ids as they are.
        assert_eq!(kernel_block_lists(&[vec![5, 1]], 16, 16, 17), Ok(vec![vec![5, 1]]));
        assert_eq!(kernel_block_lists(&[vec![1]], 48, 32, 8), Err(RangeError::BlockRatio { logical: 48, kernel: 32 }));
        assert_eq!(kernel_block_lists(&[vec![1]], 16, 0, 8), Err(RangeError::BlockRatio { logical: 16, kernel: 0 }));
        assert!(matches!(
            kernel_block_lists(&[vec![u32::MAX / 2]], 64, 16, 8),
            Err(RangeError::OutOfRange { field: "kernel block id", .. })
        ));
    }

    #[test]
    fn registration_is_range_checked() {
        let l = small_layout(); // 64 blocks of 16 tokens, 2 groups
        let key = Key::new(7, 1);
        let rank = l.parallel.rank();
        let ok = Registration::new(key, "d0".into(), rank, 40, vec![vec![1, 2, 3], vec![5]], &l);
        let r = ok.expect("fits");
        assert_eq!(r.num_tokens(), 40);
        assert_eq!(r.block_ids()[0], vec![1, 2, 3]);

        let e = Registration::new(key, "d0".into(), rank, 40, vec![vec![1, 2, 3]], &l).unwrap_err();
        assert_eq!(e, RangeError::GroupCount { got: 1, expected: 2 });
        let e = Registration::new(key, "d0".into(), rank, 40, vec![vec![1, 2, 64], vec![]], &l).unwrap_err();
        assert!(matches!(e, RangeError::BlockId { group: 0, block: 64, .. }));
        let e = Registration::new(key, "d0".into(), rank, 40, vec![vec![1, 2, 3, 4], vec![]], &l).unwrap_err();
        assert!(matches!(e, RangeError::TooManyBlocks { group: 0, blocks: 4, .. }));
        let e = Registration::new(key, "d0".into(), rank, 0, vec![vec![], vec![]], &l).unwrap_err();
        assert!(matches!(e, RangeError::OutOfRange { field: "num_tokens", .. }));
        let e = Registration::new(key, "x".repeat(300), rank, 4, vec![vec![], vec![]], &l).unwrap_err();
        assert!(matches!(e, RangeError::TooLong { field: "engine_id", .. }));
        let e = Registration::new(key, "d".into(), Rank::new(1, 0), 4, vec![vec![], vec![]], &l).unwrap_err();
        assert!(matches!(e, RangeError::Rank { .. }));
    }
}
