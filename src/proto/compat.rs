//! Handshake compatibility: may these two workers exchange KV caches?
//!
//! Both sides send a [`Handshake`]; each calls [`check`] with its own and the peer's. The model shape,
//! the per-block element order, the transfer mode and the protocol version must match; block size,
//! K/V placement, region addresses and TP/PP sizes may differ (the planner maps between them). A
//! refusal names every differing field with both values, so an operator sees the whole mismatch at
//! once instead of fixing it one field per restart.
//!
//! Versions: a handshake frame of another wire version never gets here — `codec::decode` refuses it
//! by its header ("unsupported protocol version 1 (this build speaks 2)"), and the side channel
//! sends that text in its verdict. The `protocol` field is still compared (and hashed), so a
//! handshake whose frame and field disagree is refused too. docs/protocol.md §1 ("Versions") lists
//! what each version changed; 2 is the first with kinds 8 and 9 and block-id runs.

use core::fmt;

use super::layout::{BlockOrder, KvGroup, ModelShape};
use super::msg::{Handshake, Mode};

/// Hash of everything that must match between peers (model shape, block order, mode, protocol),
/// sent in the handshake so a mismatch is seen at a glance and a corrupted handshake is refused.
pub fn compat_hash(model: &ModelShape, order: BlockOrder, mode: Mode, protocol: u16) -> u64 {
    // postcard's encoding of these plain types is deterministic; FNV-1a over it is stable across
    // builds and platforms (unlike std's randomly seeded hasher).
    let bytes = postcard::to_allocvec(&(model, order, mode, protocol)).unwrap_or_default();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// One field that differs between the two handshakes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldDiff {
    /// Field name, as an operator would look it up in the config.
    pub field: &'static str,
    /// This side's value.
    pub local: String,
    /// The peer's value.
    pub remote: String,
}

/// The peer cannot exchange KV caches with this worker; lists every differing field.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct Incompatible {
    /// The local engine id.
    pub local_engine: String,
    /// The peer's engine id.
    pub remote_engine: String,
    /// Every differing field, in a fixed order.
    pub diffs: Vec<FieldDiff>,
}

impl fmt::Display for Incompatible {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "handshake between {} (local) and {} (remote) refused:", self.local_engine, self.remote_engine)?;
        for (i, d) in self.diffs.iter().enumerate() {
            let sep = if i == 0 { " " } else { "; " };
            write!(f, "{sep}{} differs (local {}, remote {})", d.field, d.local, d.remote)?;
        }
        Ok(())
    }
}

/// Renders groups as `[full: 0-3,5; sliding_window(4096): 4,6-9]`: equal text iff equal groups.
fn groups_text(groups: &[KvGroup]) -> String {
    let parts: Vec<String> = groups
        .iter()
        .map(|g| {
            let mut runs: Vec<String> = Vec::new();
            let mut i = 0;
            while i < g.layers.len() {
                let mut j = i;
                while j + 1 < g.layers.len() && g.layers[j + 1] == g.layers[j] + 1 {
                    j += 1;
                }
                runs.push(if i == j { g.layers[i].to_string() } else { format!("{}-{}", g.layers[i], g.layers[j]) });
                i = j + 1;
            }
            format!("{}: {}", g.kind, runs.join(","))
        })
        .collect();
    format!("[{}]", parts.join("; "))
}

/// Accepts the pair, or refuses it naming every field that differs and both values.
pub fn check(local: &Handshake, remote: &Handshake) -> Result<(), Incompatible> {
    let mut diffs = Vec::new();
    let mut diff = |field: &'static str, l: String, r: String| {
        if l != r {
            diffs.push(FieldDiff { field, local: l, remote: r });
        }
    };
    let (lm, rm) = (&local.layout.model, &remote.layout.model);
    diff("protocol version", local.protocol.to_string(), remote.protocol.to_string());
    diff("mode", local.mode.to_string(), remote.mode.to_string());
    diff("dtype", format!("{:?}", lm.dtype), format!("{:?}", rm.dtype));
    diff("head dim", lm.head_dim.to_string(), rm.head_dim.to_string());
    diff("layers", lm.total_layers.to_string(), rm.total_layers.to_string());
    diff("kv heads", lm.kv_heads.to_string(), rm.kv_heads.to_string());
    diff("kv kind", format!("{:?}", lm.kind), format!("{:?}", rm.kind));
    diff("kv groups", groups_text(&lm.groups), groups_text(&rm.groups));
    diff("layout order", format!("{:?}", local.layout.order), format!("{:?}", remote.layout.order));
    if diffs.is_empty() {
        Ok(())
    } else {
        Err(Incompatible { local_engine: local.engine_id.clone(), remote_engine: remote.engine_id.clone(), diffs })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::layout::{DType, GroupKind};
    use crate::proto::testutil::{handshake, small_layout};

    #[test]
    fn identical_models_with_different_block_sizes_are_accepted() {
        let p = handshake(small_layout(), Mode::Push);
        let mut dl = small_layout();
        dl.block_tokens = 32;
        dl.block_stride *= 2;
        let d = handshake(dl, Mode::Push);
        assert_eq!(check(&p, &d), Ok(()));
        assert_eq!(p.compat_hash, d.compat_hash);
    }

    #[test]
    fn a_version_1_handshake_is_refused_by_its_protocol_field() {
        // The fields a version-1 build sends (its frame would already fail to decode here).
        let local = handshake(small_layout(), Mode::Push);
        let mut old = handshake(small_layout(), Mode::Push);
        old.protocol = 1;
        old.compat_hash = compat_hash(&old.layout.model, old.layout.order, old.mode, 1);
        assert_eq!(local.protocol, 2);
        assert_ne!(old.compat_hash, local.compat_hash, "the version is part of the hash");
        let e = check(&local, &old).expect_err("versions 2 and 1 do not mix");
        assert_eq!(e.diffs.iter().map(|d| d.field).collect::<Vec<_>>(), vec!["protocol version"]);
        assert!(e.to_string().contains("protocol version differs (local 2, remote 1)"), "{e}");
    }

    #[test]
    fn refusal_names_every_field_and_both_values() {
        let p = handshake(small_layout(), Mode::Push);
        let mut dl = small_layout();
        dl.model.dtype = DType::F16;
        dl.model.head_dim = 64;
        dl.order = BlockOrder::Nhd;
        dl.model.groups[1].kind = GroupKind::SlidingWindow { window_tokens: 4096 };
        let mut d = handshake(dl, Mode::Pull);
        d.protocol = 3;
        d.engine_id = "decode-7".into();
        let e = check(&p, &d).expect_err("must refuse");
        let fields: Vec<&str> = e.diffs.iter().map(|d| d.field).collect();
        assert_eq!(fields, vec!["protocol version", "mode", "dtype", "head dim", "kv groups", "layout order"]);
        let text = e.to_string();
        for needle in ["mode differs (local push, remote pull)", "dtype differs (local Bf16, remote F16)", "decode-7"] {
            assert!(text.contains(needle), "{text}");
        }
        assert!(text.contains("sliding_window(4096)"), "{text}");
        assert_ne!(p.compat_hash, d.compat_hash);
    }
}
