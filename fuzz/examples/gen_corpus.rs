//! Writes the malformed-frame corpus `tests/corpus/codec/` (one `.bin` per frame plus `MANIFEST.tsv`)
//! and valid seed frames for the fuzzer (`fuzz/corpus/codec/`, git-ignored).
//!
//! ```text
//! cd fuzz && cargo run --example gen_corpus             # (re)write both
//! cd fuzz && cargo run --example gen_corpus -- --check  # exit 1 if the committed corpus is stale
//! ```
//!
//! Every entry's expected error is written here by hand from docs/protocol.md (the header rules of
//! §1, the field encodings of §1–§3, the checks of §2 and §3.1), including the bit flips
//! ([`header_flip_expectation`], [`PAYLOAD_FLIPS`]): nothing is recorded from what `decode()`
//! returns. Every entry is decoded before it is written, and the generator refuses to write anything
//! (and `--check` fails) if one does not fail with the variant (and inner error) it is meant to
//! show: a mismatch is either a codec regression or a wrong expectation, and must be looked at.
//! Output is deterministic.
//!
//! Out-of-range messages cannot be built with kvpush's checked constructors, and `to_vec` refuses to
//! encode them, so their payloads are serialized with postcard directly: public wire types where
//! kvpush exposes them (`Handshake`, `Completion`, `Failure`, `Abort`, `Heartbeat`). Registrations
//! and grants are written here from docs/protocol.md: postcard for the fields before the block
//! lists, then the lists in the documented runs-or-deltas form ([`list_bytes`]); the mirror is
//! checked against the real encoding of a valid registration at start.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use kvpush::proto::codec::{
    decode, frame_len, to_vec, Kind, HEADER_LEN, MAGIC, MAX_HANDSHAKE_PAYLOAD, MAX_PAYLOAD, PROTOCOL_VERSION,
};
use kvpush::proto::ids::{Key, Rank};
use kvpush::proto::layout::{
    GroupKind, KvGroup, KvKind, KvLayout, KvPlacement, MAX_BLOCKS, MAX_BLOCK_TOKENS, MAX_GROUPS, MAX_HEAD_DIM,
    MAX_KV_HEADS, MAX_LAYERS, MAX_PARALLEL,
};
use kvpush::proto::msg::{
    Abort, Completion, Failure, FailureKind, Handshake, Heartbeat, Message, Mode, MAX_DETAIL, MAX_ENGINE_ID, MAX_TOKENS,
};
use kvpush_testkit::corpus::{
    describe, fingerprint, handshake_for, peer_handshake, peer_layout, valid_messages, KEY, VARIANTS, WRONG_RANKS,
};
use serde::Serialize;

// The kind bytes (docs/protocol.md §1) as kvpush numbers them: one list of kinds, the codec's.
const HANDSHAKE: u8 = Kind::Handshake as u8;
const REGISTRATION: u8 = Kind::Registration as u8;
const COMPLETION: u8 = Kind::Completion as u8;
const FAILURE: u8 = Kind::Failure as u8;
const ABORT: u8 = Kind::Abort as u8;
const HEARTBEAT: u8 = Kind::Heartbeat as u8;
const GRANT: u8 = Kind::Grant as u8;
const LAYERS: u8 = Kind::Layers as u8;
const HOLD: u8 = Kind::Hold as u8;

/// A registration's fields in wire order (docs/protocol.md §2), encoded by [`reg_bytes`].
#[derive(Clone)]
struct RegWire {
    key: Key,
    engine_id: String,
    rank: Rank,
    num_tokens: u64,
    block_ids: Vec<Vec<u32>>,
}

fn valid_reg() -> RegWire {
    RegWire {
        key: KEY,
        engine_id: "decode-0".into(),
        rank: peer_layout().parallel.rank(),
        num_tokens: 33,
        block_ids: vec![vec![4, 5, 6], vec![9]],
    }
}

/// A block-id list as docs/protocol.md §1 ("Block-id lists") writes it: the head `count << 1 |
/// form`, then maximal runs (form 0) or zig-zag deltas (form 1), whichever is shorter, runs on a tie.
fn list_bytes(ids: &[u32]) -> Vec<u8> {
    let zz = |d: i64| ((d << 1) ^ (d >> 63)) as u64;
    let mut deltas = Vec::new();
    let mut prev = 0i64;
    for &id in ids {
        deltas.extend_from_slice(&pc(&zz(i64::from(id) - prev)));
        prev = id.into();
    }
    let mut runs = Vec::new();
    let (mut i, mut prev) = (0, 0i64);
    while i < ids.len() {
        let first = i64::from(ids[i]);
        let step = if ids.get(i + 1).map(|&b| i64::from(b)) == Some(first - 1) { -1 } else { 1 };
        let mut len = 1;
        while ids.get(i + len).map(|&b| i64::from(b)) == Some(first + step * len as i64) {
            len += 1;
        }
        runs.extend_from_slice(&pc(&zz(first - prev)));
        runs.extend_from_slice(&pc(&(((len as u64 - 1) << 1) | u64::from(step < 0 && len > 1))));
        prev = first + step * (len as i64 - 1);
        i += len;
    }
    let (form, body) = if ids.is_empty() || runs.len() <= deltas.len() { (0, runs) } else { (1, deltas) };
    let mut out = pc(&((ids.len() as u64) << 1 | form));
    out.extend_from_slice(&body);
    out
}

/// A registration payload: postcard for key, engine id, rank and token count, then the list count
/// and each list.
fn reg_bytes(w: &RegWire) -> Vec<u8> {
    let mut out = pc(&(w.key, &w.engine_id, w.rank, w.num_tokens, w.block_ids.len()));
    for ids in &w.block_ids {
        out.extend_from_slice(&list_bytes(ids));
    }
    out
}

fn pc<T: Serialize + ?Sized>(v: &T) -> Vec<u8> {
    postcard::to_allocvec(v).expect("postcard serializes")
}

fn header(magic: [u8; 2], version: u16, kind: u8, len: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER_LEN);
    h.extend_from_slice(&magic);
    h.extend_from_slice(&version.to_le_bytes());
    h.push(kind);
    h.extend_from_slice(&len.to_le_bytes());
    h
}

/// A frame with a correct header around `payload`.
fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).expect("small payload");
    let mut f = header(MAGIC, PROTOCOL_VERSION, kind, len);
    f.extend_from_slice(payload);
    f
}

fn with_len(mut f: Vec<u8>, len: u32) -> Vec<u8> {
    f[5..9].copy_from_slice(&len.to_le_bytes());
    f
}

fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).position(|w| w == needle).expect("needle present")
}

/// A handshake carrying `l` whose hash is correct for its (possibly invalid) fields.
fn hs_with(l: KvLayout) -> Handshake {
    handshake_for(l, Mode::Push)
}

fn hs_frame(h: &Handshake) -> Vec<u8> {
    frame(HANDSHAKE, &pc(h))
}

struct Entry {
    name: String,
    bytes: Vec<u8>,
    peer: bool,
    variant: &'static str,
    detail: String,
    desc: String,
}

#[derive(Default)]
struct Corpus {
    entries: Vec<Entry>,
}

impl Corpus {
    fn add(&mut self, name: impl Into<String>, bytes: Vec<u8>, peer: bool, expect: &str, desc: impl Into<String>) {
        let (variant, detail) = match expect.split_once(' ') {
            Some((v, d)) => (v, d.to_string()),
            None => (expect, "-".to_string()),
        };
        let variant = VARIANTS.iter().copied().find(|v| *v == variant).expect("known variant name");
        self.entries.push(Entry { name: name.into(), bytes, peer, variant, detail, desc: desc.into() });
    }
}

fn kind_byte(name: &str) -> u8 {
    match name {
        "handshake" => HANDSHAKE,
        "registration" => REGISTRATION,
        "completion" => COMPLETION,
        "failure" => FAILURE,
        "abort" => ABORT,
        "heartbeat" => HEARTBEAT,
        "grant" => GRANT,
        "layers" => LAYERS,
        "hold" => HOLD,
        _ => unreachable!("kind {name}"),
    }
}

fn header_faults(c: &mut Corpus, valid: &[(&'static str, Vec<u8>)]) {
    let hb = &valid.iter().find(|(k, _)| *k == "heartbeat").expect("heartbeat").1;
    let hs = &valid.iter().find(|(k, _)| *k == "handshake").expect("handshake").1;
    for (tag, magic) in [("XP", *b"XP"), ("kp", *b"kp"), ("PK", *b"PK"), ("K_only", *b"K\0"), ("zero", [0, 0])] {
        let mut f = hb.clone();
        f[..2].copy_from_slice(&magic);
        c.add(format!("hdr_bad_magic_{tag}.bin"), f, false, "BadMagic", format!("heartbeat with magic {magic:02x?}"));
    }
    c.add("hdr_bad_magic_all_zero_header.bin", vec![0; HEADER_LEN], false, "BadMagic", "nine zero bytes");
    c.add("hdr_bad_magic_short.bin", b"XP".to_vec(), false, "Truncated", "two bytes of bad magic: too short to judge");
    c.add("hdr_empty.bin", Vec::new(), false, "Truncated", "no bytes at all");
    let mut f = hs.clone();
    f[..2].copy_from_slice(b"{\"");
    c.add("hdr_bad_magic_json.bin", f, false, "BadMagic", "handshake whose magic is the start of a JSON object");

    for v in [0u16, 1, 3, 0x0200, 0xffff] {
        let mut f = hb.clone();
        f[2..4].copy_from_slice(&v.to_le_bytes());
        c.add(format!("hdr_version_{v}.bin"), f, false, "UnsupportedVersion", format!("heartbeat of version {v}"));
    }
    let mut f = hs.clone();
    f[2..4].copy_from_slice(&1u16.to_le_bytes());
    c.add("hdr_version_1_handshake.bin", f, false, "UnsupportedVersion", "valid handshake payload, version 1");

    for k in [0u8, HOLD + 1, 0x80, 0xff] {
        let mut f = hb.clone();
        f[4] = k;
        c.add(format!("hdr_kind_{k}.bin"), f, false, "UnknownKind", format!("heartbeat payload under kind byte {k}"));
    }

    // Declared lengths above each kind's limit: refused from the header alone.
    for (name, bytes) in valid {
        let k = kind_byte(name);
        let max = if k == HANDSHAKE { MAX_HANDSHAKE_PAYLOAD } else { MAX_PAYLOAD };
        let f = header(MAGIC, PROTOCOL_VERSION, k, max + 1);
        c.add(
            format!("len_{name}_max_plus_1.bin"),
            f,
            true,
            "TooLarge",
            format!("{name} header declaring {}", max + 1),
        );
        let f = with_len(bytes.clone(), u32::MAX);
        c.add(format!("len_{name}_u32_max.bin"), f, true, "TooLarge", format!("valid {name} declaring u32::MAX bytes"));
    }
    let mut f = header(MAGIC, PROTOCOL_VERSION, HEARTBEAT, MAX_PAYLOAD + 1);
    f.extend(std::iter::repeat_n(0u8, 1024));
    c.add("len_heartbeat_oversized_with_payload.bin", f, false, "TooLarge", "4 MiB + 1 declared, 1 KiB present");
    // A handshake may be larger than other kinds: over the general limit, under its own, is fine
    // from the header's point of view and only short.
    let f = header(MAGIC, PROTOCOL_VERSION, HANDSHAKE, MAX_PAYLOAD + 1);
    c.add(
        "len_handshake_over_general_limit.bin",
        f,
        false,
        "Truncated",
        "handshake declaring 4 MiB + 1: allowed, absent",
    );
    let f = header(MAGIC, PROTOCOL_VERSION, HANDSHAKE, MAX_HANDSHAKE_PAYLOAD);
    c.add("len_handshake_at_limit.bin", f, false, "Truncated", "handshake declaring exactly 16 MiB, absent");
    let f = header(MAGIC, PROTOCOL_VERSION, COMPLETION, MAX_PAYLOAD);
    c.add("len_completion_at_limit.bin", f, true, "Truncated", "completion declaring exactly 4 MiB, absent");
    let f = with_len(hb.clone(), 0);
    c.add("len_heartbeat_zero.bin", f, false, "TrailingBytes", "heartbeat declaring 0 bytes, 1 present");

    // Bytes beyond the frame, and a declared payload longer than its encoding.
    for (name, bytes) in valid {
        let mut f = bytes.clone();
        f.push(0);
        c.add(format!("trail_{name}_one_byte.bin"), f, true, "TrailingBytes", format!("valid {name} + 1 byte"));
        let mut f = bytes.clone();
        f.extend_from_slice(&bytes[..]);
        c.add(format!("trail_{name}_twice.bin"), f, true, "TrailingBytes", format!("two {name} frames in one buffer"));
        let mut f = bytes.clone();
        f.extend_from_slice(&[0xaa; 3]);
        let len = u32::try_from(f.len() - HEADER_LEN).expect("small");
        c.add(
            format!("pad_{name}_payload_3.bin"),
            with_len(f, len),
            true,
            "TrailingBytes",
            format!("{name} payload followed by 3 bytes inside the declared length"),
        );
    }
}

fn truncations(c: &mut Corpus, valid: &[(&'static str, Vec<u8>)]) {
    for (name, bytes) in valid {
        let n = bytes.len();
        let mut cuts = vec![0, 1, 2, 4, 5, 8, 9, HEADER_LEN + (n - HEADER_LEN) / 2, n - 1];
        cuts.sort_unstable();
        cuts.dedup();
        for cut in cuts.into_iter().filter(|&k| k < n) {
            c.add(
                format!("trunc_{name}_at_{cut:03}.bin"),
                bytes[..cut].to_vec(),
                true,
                "Truncated",
                format!("{name} frame of {n} bytes cut to {cut}"),
            );
        }
        // The header agrees with the cut, but the payload ends inside the encoding.
        let mut cuts = vec![HEADER_LEN, HEADER_LEN + (n - HEADER_LEN) / 2, n - 1];
        cuts.dedup();
        for cut in cuts {
            let len = u32::try_from(cut - HEADER_LEN).expect("small");
            c.add(
                format!("short_{name}_payload_{:03}.bin", cut - HEADER_LEN),
                with_len(bytes[..cut].to_vec(), len),
                true,
                "Malformed",
                format!("{name} payload cut to {} of {} bytes, header consistent", cut - HEADER_LEN, n - HEADER_LEN),
            );
        }
    }
}

/// The header bits flipped in every valid frame; the expected error follows from §1 alone.
const HEADER_FLIP_BITS: [u8; 3] = [0, 6, 7];

/// What docs/protocol.md §1 says a frame of kind `kind` with `payload` bytes must give when bit
/// `bit` of header byte `byte` is flipped: the header is checked field by field (magic, version,
/// kind, length against the kind's limit, length against the bytes present) before the payload is
/// looked at. `None` where the flipped kind byte names another valid kind: then the payload is
/// parsed as that kind, and the outcome is written by hand in [`PAYLOAD_FLIPS`].
fn header_flip_expectation(kind: u8, payload: usize, byte: usize, bit: u8) -> Option<(&'static str, String)> {
    let mask = 1u32 << bit;
    Some(match byte {
        0 | 1 => ("BadMagic", format!("magic byte {byte} no longer {:?}", MAGIC[byte] as char)),
        2 | 3 => {
            ("UnsupportedVersion", format!("version {}", u32::from(PROTOCOL_VERSION) ^ (mask << (8 * (byte - 2)))))
        }
        4 => {
            let k = kind ^ (1 << bit);
            if (HANDSHAKE..=HOLD).contains(&k) {
                return None;
            }
            ("UnknownKind", format!("kind byte {k}"))
        }
        5..=8 => {
            let len = u32::try_from(payload).expect("small payload");
            let flipped = len ^ (mask << (8 * (byte - 5)));
            let max = if kind == HANDSHAKE { MAX_HANDSHAKE_PAYLOAD } else { MAX_PAYLOAD };
            if flipped > max {
                ("TooLarge", format!("declared length {flipped} > limit {max}"))
            } else if flipped > len {
                ("Truncated", format!("declared length {flipped}, {len} present"))
            } else {
                ("TrailingBytes", format!("declared length {flipped}, {len} present"))
            }
        }
        _ => unreachable!("header byte {byte}"),
    })
}

/// Single bit flips inside valid frames (and of the kind byte into another valid kind), each with
/// the error worked out by hand from docs/protocol.md §1–§3 for the frames of `valid_messages()`
/// (peer layout: `kvpush_testkit::corpus`). `(frame, byte, bit, expected, why)`; the byte is the index in
/// the whole frame (the payload starts at 9).
///
/// The frames, for reference (key 0xdeadbeef#3 = `ef fd b6 f5 0d 03`, peer rank tp1/pp0 = `01 00`):
/// registration `.. | key | 08 "decode-0" | 01 00 | 21 | 02 | 06 08 04 | 03 12` (group 0: 3 ids as
/// runs, one run from 4 ascending of length 3; group 1: 1 id as a delta, +9),
/// completion `.. | key | 01 00`, failure `.. | key | 01 00 | 01 05 | 0b "post failed"`,
/// abort `.. | key | 01 00 | 10 "client went away"`, heartbeat `.. | 2a`; handshake: 9 protocol
/// `01`, 10 `05 "0.1.0"`, 16 `08 "engine-a"`, 25 mode `00`, 26 `04 01 02 03 04`, 31 total_layers 4,
/// 32 kv_heads 2, 33 head_dim 8, 34 dtype `01` (Bf16), 35 kind `00`, 36 groups `02 | 00 02 00 02 |
/// 01 40 02 01 03`, 46 block_tokens 16, 47 order, 48 placement, 49 stride `80 02`, 51 num_blocks
/// 64, 52 parallel `01 02 00 01`, 56 region count 8, 57..97 eight 5-byte bases, 97..107 the hash (a
/// 10-byte varint ending in `01`).
const PAYLOAD_FLIPS: &[(&str, usize, u8, &str, &str)] = &[
    // The kind byte naming another valid kind: the payload is parsed as that kind.
    (
        "handshake",
        4,
        1,
        "TrailingBytes",
        "kind 3: read as a completion (tid 1, attempt 5, rank tp48/pp46), 94 bytes left",
    ),
    ("handshake", 4, 2, "Malformed", "kind 5: read as an abort whose 49-byte reason holds byte 0x80, not UTF-8"),
    ("registration", 4, 0, "TrailingBytes", "kind 3: read as a completion (rank tp8/pp100), the rest left over"),
    ("registration", 4, 2, "TrailingBytes", "kind 6: read as a heartbeat (seq = the transfer id), the rest left over"),
    ("completion", 4, 0, "Malformed", "kind 2: read as a registration whose engine id is 1 byte, then no rank"),
    ("completion", 4, 1, "Malformed", "kind 1: read as a handshake whose protocol varint overflows u16"),
    ("failure", 4, 0, "TrailingBytes", "kind 5: read as an abort with a 1-byte reason, 12 bytes left"),
    ("failure", 4, 1, "TrailingBytes", "kind 6: read as a heartbeat (seq = the transfer id), the rest left over"),
    ("abort", 4, 0, "Malformed", "kind 4: read as a failure whose FailureKind is 16"),
    ("abort", 4, 2, "Malformed", "kind 1: read as a handshake whose protocol varint overflows u16"),
    ("heartbeat", 4, 1, "Malformed", "kind 4: read as a failure that ends after its transfer id"),
    ("heartbeat", 4, 2, "Malformed", "kind 2: read as a registration that ends after its transfer id"),
    // Registration.
    ("registration", 13, 7, "Malformed", "transfer id varint runs on; engine id then claims 100 bytes"),
    ("registration", 14, 7, "Malformed", "attempt varint runs on; engine id then claims 100 bytes"),
    ("registration", 15, 0, "Malformed", "engine id of 9 bytes shifts the rest: the lists run past the end"),
    ("registration", 16, 7, "Malformed", "engine id starts with 0xe4 then 'e': not UTF-8"),
    ("registration", 24, 1, "Range Rank", "rank tp3/pp0 from peer tp1/pp0"),
    ("registration", 25, 0, "Range Rank", "rank tp1/pp1 from peer tp1/pp0"),
    ("registration", 26, 5, "Range TooManyBlocks", "num_tokens 1: group 0's 3 blocks are more than 1"),
    ("registration", 26, 7, "Malformed", "num_tokens varint takes the list count; the lists then run past the end"),
    ("registration", 27, 0, "Malformed", "3 block lists, 2 present"),
    ("registration", 27, 1, "TrailingBytes", "0 block lists, the 5 bytes of the lists left over"),
    ("registration", 28, 0, "Malformed", "group 0 read as 3 deltas (4, 6, 4); group 1's head 0x12 then claims 9 ids"),
    ("registration", 28, 1, "Malformed", "group 0 claims 2 ids, its run has 3"),
    ("registration", 29, 0, "Malformed", "group 0's run starts at 0 - 5"),
    ("registration", 29, 7, "Malformed", "group 0's first id takes the run length; its last run has no length"),
    ("registration", 30, 1, "Malformed", "group 0's run of 4 passes its count of 3"),
    ("registration", 31, 1, "TrailingBytes", "group 1 empty, its delta left over"),
    ("registration", 31, 2, "Malformed", "group 1 claims 3 deltas with 1 byte left"),
    ("registration", 32, 0, "Malformed", "group 1's delta -10 takes its id below 0"),
    ("registration", 32, 7, "Malformed", "group 1's delta varint runs past the end"),
    // Completion.
    ("completion", 13, 7, "Malformed", "transfer id varint takes the attempt; rank.pp missing"),
    ("completion", 14, 7, "Malformed", "attempt varint takes rank.tp; rank.pp missing"),
    ("completion", 15, 0, "Range Rank", "rank tp0/pp0 from peer tp1/pp0"),
    ("completion", 15, 7, "Malformed", "rank.tp varint takes rank.pp; rank.pp missing"),
    ("completion", 16, 0, "Range Rank", "rank tp1/pp1 from peer tp1/pp0"),
    ("completion", 16, 7, "Malformed", "rank.pp varint runs past the end"),
    // Failure.
    ("failure", 15, 0, "Range Rank", "rank tp0/pp0 from peer tp1/pp0"),
    ("failure", 17, 2, "TrailingBytes", "kind 5 (PeerLost, no status): detail is 5 bytes, 7 left over"),
    ("failure", 17, 3, "Malformed", "FailureKind 9"),
    ("failure", 18, 7, "Malformed", "status varint takes the detail length; detail then claims 112 bytes"),
    ("failure", 19, 0, "TrailingBytes", "detail length 10 of 11: 1 byte left over"),
    ("failure", 19, 4, "Malformed", "detail claims 27 bytes, has 11"),
    ("failure", 20, 7, "Malformed", "detail starts with 0xf0 then 'o': not UTF-8"),
    ("failure", 30, 7, "Malformed", "detail ends with 0xe4: a cut UTF-8 sequence"),
    // Abort.
    ("abort", 15, 0, "Range Rank", "rank tp0/pp0 from peer tp1/pp0"),
    ("abort", 16, 1, "Range Rank", "rank tp1/pp2 from peer tp1/pp0"),
    ("abort", 17, 0, "Malformed", "reason claims 17 bytes, has 16"),
    ("abort", 17, 4, "TrailingBytes", "reason length 0: its 16 bytes left over"),
    ("abort", 17, 5, "Malformed", "reason claims 48 bytes, has 16"),
    ("abort", 18, 7, "Malformed", "reason starts with 0xe3 then 'l': not UTF-8"),
    ("abort", 33, 7, "Malformed", "reason ends with 0xf9, never valid in UTF-8"),
    // Heartbeat.
    ("heartbeat", 9, 7, "Malformed", "seq varint 0xaa runs past the end"),
    // Handshake: parse, then lengths and layout.validate(), then the hash.
    ("handshake", 9, 0, "HashMismatch", "protocol 0: valid, but the hash covers the protocol"),
    ("handshake", 10, 7, "Malformed", "software length varint 85 30 claims 6149 bytes"),
    ("handshake", 17, 7, "Malformed", "engine id starts with 0xe5 then 'n': not UTF-8"),
    ("handshake", 25, 0, "HashMismatch", "mode Pull under the push hash"),
    ("handshake", 25, 1, "Malformed", "Mode 2"),
    ("handshake", 31, 2, "Range Layout:OutOfRange:total_layers", "total_layers 0"),
    ("handshake", 32, 0, "Range Layout:HeadsNotDivisible", "3 KV heads over TP 2"),
    ("handshake", 32, 1, "Range Layout:OutOfRange:kv_heads", "kv_heads 0"),
    ("handshake", 34, 0, "HashMismatch", "dtype F16: a valid layout, but the hash covers the dtype"),
    ("handshake", 34, 3, "Malformed", "DType 9"),
    ("handshake", 35, 0, "Range Layout:PlacementMismatch", "Latent with placement Separate"),
    ("handshake", 35, 1, "Malformed", "KvKind 2"),
    ("handshake", 40, 0, "Range Layout:Groups", "group 0 holds layers 0, 3: layer 3 twice, layer 2 in none"),
    ("handshake", 42, 6, "Range Layout:Groups", "sliding window of 0 tokens"),
    (
        "handshake",
        42,
        7,
        "Range Layout:Groups",
        "window varint takes the layer count: group 1 is SW(320) [3], layer 1 in none",
    ),
    ("handshake", 46, 4, "Range Layout:OutOfRange:block_tokens", "block_tokens 0"),
    ("handshake", 47, 0, "HashMismatch", "order Nhd: a valid layout, but the hash covers the order"),
    ("handshake", 47, 1, "Malformed", "BlockOrder 2"),
    ("handshake", 48, 0, "Range Layout:StrideTooSmall", "placement Joint needs a stride of 2 parts, has 1"),
    ("handshake", 48, 1, "Range Layout:PlacementMismatch", "keys and values with placement Single"),
    ("handshake", 48, 2, "Range Layout:StrideTooSmall", "placement CellJoint needs a stride of 2 parts, has 1"),
    ("handshake", 51, 6, "Range Layout:OutOfRange:num_blocks", "num_blocks 0"),
    ("handshake", 52, 1, "Range Layout:RankOutOfRange:tp", "tp_rank 3 of 2"),
    ("handshake", 53, 0, "Range Layout:HeadsNotDivisible", "2 KV heads over TP 3"),
    ("handshake", 53, 1, "Range Layout:OutOfRange:tp_size", "tp_size 0"),
    ("handshake", 54, 0, "Range Layout:RankOutOfRange:pp", "pp_rank 1 of 1"),
    ("handshake", 55, 0, "Range Layout:OutOfRange:pp_size", "pp_size 0"),
    ("handshake", 56, 0, "Malformed", "9 region bases: the 9th is the hash, then the hash is missing"),
    ("handshake", 56, 3, "TrailingBytes", "0 region bases: the first base is read as the hash, the rest left over"),
    ("handshake", 97, 0, "HashMismatch", "hash with its lowest bit flipped"),
    ("handshake", 106, 0, "HashMismatch", "hash's 10th varint byte 00: bit 63 cleared"),
    ("handshake", 106, 1, "Malformed", "hash's 10th varint byte 03: above u64"),
    ("handshake", 106, 7, "Malformed", "hash varint with 11 bytes"),
];

fn bit_flips(c: &mut Corpus, valid: &[(&'static str, Vec<u8>)]) {
    for (name, bytes) in valid {
        let kind = bytes[4];
        for byte in 0..HEADER_LEN {
            for bit in HEADER_FLIP_BITS {
                let Some((variant, why)) = header_flip_expectation(kind, bytes.len() - HEADER_LEN, byte, bit) else {
                    continue;
                };
                add_flip(
                    c,
                    name,
                    bytes,
                    byte,
                    bit,
                    variant,
                    &format!("header bit {bit} of byte {byte} flipped: {why}"),
                );
            }
        }
    }
    for &(name, byte, bit, expect, why) in PAYLOAD_FLIPS {
        let bytes = &valid.iter().find(|(k, _)| *k == name).expect("a valid frame of that name").1;
        assert!(byte < bytes.len(), "{name} has no byte {byte}");
        add_flip(c, name, bytes, byte, bit, expect, &format!("bit {bit} of byte {byte} flipped: {why}"));
    }
}

/// Adds `bytes` (the valid `name` frame) with bit `bit` of byte `byte` flipped, expecting `expect`.
fn add_flip(c: &mut Corpus, name: &str, bytes: &[u8], byte: usize, bit: u8, expect: &str, what: &str) {
    let mut f = bytes.to_vec();
    f[byte] ^= 1 << bit;
    c.add(format!("flip_{name}_byte{byte:03}_bit{bit}.bin"), f, true, expect, format!("{name} frame, {what}"));
}

fn registrations(c: &mut Corpus) {
    let reg = |name: &str, w: &RegWire, peer: bool, expect: &str, desc: &str| {
        (format!("reg_{name}.bin"), frame(REGISTRATION, &reg_bytes(w)), peer, expect.to_string(), desc.to_string())
    };
    let mut out = Vec::new();
    out.push(reg("no_peer", &valid_reg(), false, "NoPeerLayout", "valid registration before the handshake"));
    let mut w = valid_reg();
    w.block_ids = vec![vec![4, 5, 64], vec![9]];
    out.push(reg("block_id_eq_num_blocks", &w, true, "Range BlockId", "group 0 names block 64 of 64"));
    out.push(reg("block_id_no_peer", &w, false, "NoPeerLayout", "out-of-range block id, but no peer layout yet"));
    w.block_ids = vec![vec![4], vec![u32::MAX]];
    out.push(reg("block_id_max_group1", &w, true, "Range BlockId", "group 1 names block u32::MAX"));
    for (n, lists) in [(0usize, vec![]), (1, vec![vec![4]]), (3, vec![vec![4], vec![], vec![1]])] {
        let mut w = valid_reg();
        w.block_ids = lists;
        out.push(reg(&format!("groups_{n}"), &w, true, "Range GroupCount", &format!("{n} block lists for 2 groups")));
    }
    let mut w = valid_reg();
    w.block_ids = vec![vec![]; MAX_GROUPS + 1];
    out.push(reg(
        "groups_65",
        &w,
        true,
        "Malformed",
        "65 empty block lists: refused by the MAX_GROUPS bound on the list count before they are read",
    ));
    let mut w = valid_reg();
    w.block_ids = vec![vec![1, 2, 3, 4], vec![9]];
    out.push(reg("too_many_blocks_g0", &w, true, "Range TooManyBlocks", "4 blocks for 33 tokens of 16 (group 0)"));
    w.block_ids = vec![vec![1], vec![1, 2, 3, 4]];
    out.push(reg("too_many_blocks_g1", &w, true, "Range TooManyBlocks", "4 blocks for 33 tokens of 16 (group 1)"));
    w.num_tokens = 1;
    w.block_ids = vec![vec![1, 2], vec![]];
    out.push(reg("too_many_blocks_1_token", &w, true, "Range TooManyBlocks", "2 blocks for 1 token"));
    let mut w = valid_reg();
    w.num_tokens = 0;
    w.block_ids = vec![vec![], vec![]];
    out.push(reg("num_tokens_zero", &w, true, "Range OutOfRange:num_tokens", "num_tokens 0"));
    w.num_tokens = MAX_TOKENS + 1;
    w.block_ids = vec![vec![1], vec![2]];
    out.push(reg("num_tokens_over_max", &w, true, "Range OutOfRange:num_tokens", "num_tokens MAX_TOKENS + 1"));
    w.num_tokens = u64::MAX;
    out.push(reg("num_tokens_u64_max", &w, true, "Range OutOfRange:num_tokens", "num_tokens u64::MAX"));
    let mut w = valid_reg();
    w.engine_id = "d".repeat(MAX_ENGINE_ID + 1);
    out.push(reg("engine_id_257", &w, true, "Range TooLong:engine_id", "engine id of MAX_ENGINE_ID + 1 bytes"));
    w.engine_id = "\u{e9}".repeat(MAX_ENGINE_ID / 2 + 1);
    out.push(reg("engine_id_258_utf8", &w, true, "Range TooLong:engine_id", "engine id of 129 two-byte chars"));
    for r in WRONG_RANKS {
        let mut w = valid_reg();
        w.rank = r;
        out.push(reg(
            &format!("rank_tp{}_pp{}", r.tp, r.pp),
            &w,
            true,
            "Range Rank",
            &format!("rank {r}, peer tp1/pp0"),
        ));
    }
    for (name, bytes, peer, expect, desc) in out {
        c.add(name, bytes, peer, &expect, desc);
    }

    // Encodings the parser refuses.
    let p = reg_bytes(&valid_reg());
    let mut bad = p.clone();
    bad[find(&p, b"decode-0")] = 0xff;
    c.add("reg_engine_id_bad_utf8.bin", frame(REGISTRATION, &bad), true, "Malformed", "engine id not UTF-8");
    c.add(
        "reg_engine_id_bad_utf8_no_peer.bin",
        frame(REGISTRATION, &bad),
        false,
        "NoPeerLayout",
        "engine id not UTF-8, no peer: the peer check comes first, nothing is parsed",
    );
    let prefix = pc(&(KEY, "decode-0", peer_layout().parallel.rank(), 33u64));
    let mut huge = prefix.clone();
    huge.extend_from_slice(&pc(&1_000_000usize));
    c.add("reg_block_lists_claim_1m.bin", frame(REGISTRATION, &huge), true, "Malformed", "claims 1e6 lists, has none");
    // Block lists whose head or body the list reader refuses (docs/protocol.md §1, "Block-id
    // lists"); each is group 0 of two, with group 1 empty where the reader would get that far.
    let lists = |body: &[u8]| {
        let mut p = prefix.clone();
        p.push(2);
        p.extend_from_slice(body);
        p.push(0);
        frame(REGISTRATION, &p)
    };
    let mut claim = pc(&(u64::from(u32::MAX) << 1 | 1));
    claim.extend_from_slice(&[0x02; 8]);
    c.add("reg_block_ids_claim_4g.bin", lists(&claim), true, "Malformed", "deltas claiming 2^32-1 ids, 8 present");
    let mut claim = pc(&(1000u64 << 1 | 1));
    claim.extend_from_slice(&[0x02; 999]);
    c.add(
        "reg_deltas_one_short.bin",
        lists(&claim),
        true,
        "Malformed",
        "1000 deltas claimed, 999 present: group 1's head is read as the last",
    );
    // A run of 2^20 + 1 ids in 7 bytes: over the frame's MAX_BLOCK_IDS budget, refused on its head.
    let mut run = pc(&(((1u64 << 20) + 1) << 1));
    run.extend_from_slice(&pc(&0u64));
    run.extend_from_slice(&pc(&((1u64 << 20) << 1)));
    c.add("reg_run_over_budget.bin", lists(&run), true, "Malformed", "one run of 2^20 + 1 ids: over MAX_BLOCK_IDS");
    // Two lists of 2^19 + 1 ids each: within the budget one by one, over it together.
    let mut p = prefix.clone();
    p.push(2);
    for _ in 0..2 {
        p.extend_from_slice(&pc(&(((1u64 << 19) + 1) << 1)));
        p.extend_from_slice(&pc(&0u64));
        p.extend_from_slice(&pc(&((1u64 << 19) << 1)));
    }
    c.add("reg_runs_over_budget_together.bin", frame(REGISTRATION, &p), true, "Malformed", "2 x (2^19 + 1) ids");
    // Exactly the budget, but for 33 tokens: read, then refused by the layout check.
    let mut run = pc(&((1u64 << 20) << 1));
    run.extend_from_slice(&pc(&0u64));
    run.extend_from_slice(&pc(&(((1u64 << 20) - 1) << 1)));
    c.add(
        "reg_run_at_budget_too_many_blocks.bin",
        lists(&run),
        true,
        "Range TooManyBlocks",
        "one run of 2^20 ids (the budget) for 33 tokens",
    );
    let cases: [(&str, &[u8], &str); 6] = [
        ("reg_run_past_count.bin", &[0x06, 0x08, 0x06], "3 ids claimed, a run of 4 from 4"),
        ("reg_run_past_u32.bin", &[0x04, 0xfe, 0xff, 0xff, 0xff, 0x1f, 0x02], "a run of 2 from u32::MAX"),
        ("reg_run_below_zero.bin", &[0x06, 0x02, 0x05], "a descending run of 3 from 1"),
        ("reg_delta_below_zero.bin", &[0x03, 0x01], "one delta of -1 from 0"),
        ("reg_delta_past_u32.bin", &[0x05, 0xfe, 0xff, 0xff, 0xff, 0x1f, 0x02], "u32::MAX, then +1"),
        (
            "reg_delta_varint_overflow.bin",
            &[0x03, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f],
            "a delta varint past 64 bits",
        ),
    ];
    for (name, body, desc) in cases {
        c.add(name, lists(body), true, "Malformed", desc);
    }
    // The same list bytes carry ids beyond the peer's 64 blocks in either form: a range error.
    c.add("reg_run_beyond_num_blocks.bin", lists(&[0x04, 0x7e, 0x02]), true, "Range BlockId", "run 63, 64");
    c.add("reg_delta_beyond_num_blocks.bin", lists(&[0x03, 0x80, 0x01]), true, "Range BlockId", "one delta to 64");
    // A grant's lists are read the same way, before its checks.
    let mut g = pc(&(KEY, peer_layout().parallel.rank(), 33u64));
    g.push(2);
    g.extend_from_slice(&run);
    g.push(0);
    c.add(
        "grant_run_at_budget_too_many_blocks.bin",
        frame(GRANT, &g),
        true,
        "Range TooManyBlocks",
        "2^20 ids, 33 tokens",
    );
    let mut g = pc(&(KEY, peer_layout().parallel.rank(), 33u64));
    g.push(2);
    g.extend_from_slice(&[0x06, 0x08, 0x06, 0x00]);
    c.add("grant_run_past_count.bin", frame(GRANT, &g), true, "Malformed", "3 ids claimed, a run of 4 from 4");
    let mut over = prefix.clone();
    over.extend_from_slice(&[0xff; 10]);
    over.push(0x7f);
    c.add(
        "reg_block_lists_len_overflow.bin",
        frame(REGISTRATION, &over),
        true,
        "Malformed",
        "list count varint > 64 bits",
    );
    let mut over = pc(&KEY);
    over.extend_from_slice(&pc("decode-0"));
    over.extend_from_slice(&pc(&peer_layout().parallel.rank()));
    over.extend_from_slice(&[0xff; 10]);
    over.push(0x01);
    c.add("reg_num_tokens_varint_overflow.bin", frame(REGISTRATION, &over), true, "Malformed", "11-byte u64 varint");
}

fn per_rank_messages(c: &mut Corpus) {
    let rank = peer_layout().parallel.rank();
    let completion = |r| Completion { key: KEY, rank: r };
    let failure = |r, detail: String| Failure { key: KEY, rank: r, kind: FailureKind::Refused, detail };
    let abort = |r, reason: String| Abort { key: KEY, rank: r, reason };
    for r in WRONG_RANKS {
        let tag = format!("tp{}_pp{}", r.tp, r.pp);
        let what = format!("rank {r}, peer tp1/pp0");
        c.add(format!("cmp_rank_{tag}.bin"), frame(COMPLETION, &pc(&completion(r))), true, "Range Rank", &what);
        let f = failure(r, "x".into());
        c.add(format!("fail_rank_{tag}.bin"), frame(FAILURE, &pc(&f)), true, "Range Rank", &what);
        let a = abort(r, "x".into());
        c.add(format!("abort_rank_{tag}.bin"), frame(ABORT, &pc(&a)), true, "Range Rank", &what);
    }
    let cmp = frame(COMPLETION, &pc(&completion(rank)));
    c.add("cmp_no_peer.bin", cmp, false, "NoPeerLayout", "valid completion before the handshake");
    let cmp = frame(COMPLETION, &pc(&completion(Rank::new(0, 0))));
    c.add("cmp_rank_no_peer.bin", cmp, false, "NoPeerLayout", "wrong rank, but no peer layout yet");
    let mut p = vec![0xff; 18];
    p.push(0x7f);
    c.add("cmp_transfer_id_overflow.bin", frame(COMPLETION, &p), true, "Malformed", "19-byte u128 varint");
    let mut p = pc(&KEY.transfer_id);
    p.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x7f]);
    c.add("cmp_attempt_overflow.bin", frame(COMPLETION, &p), true, "Malformed", "attempt varint > 32 bits");
    let mut p = pc(&KEY);
    p.extend_from_slice(&[0xff, 0xff, 0x7f, 0x00]);
    c.add("cmp_rank_tp_overflow.bin", frame(COMPLETION, &p), true, "Malformed", "rank.tp varint > 16 bits");

    let long = "x".repeat(MAX_DETAIL + 1);
    let f = frame(FAILURE, &pc(&failure(rank, long.clone())));
    c.add("fail_detail_1025.bin", f.clone(), true, "Range TooLong:detail", "detail of MAX_DETAIL + 1 bytes");
    c.add(
        "fail_detail_1025_no_peer.bin",
        f,
        false,
        "Range TooLong:detail",
        "over-long detail is refused even before the handshake",
    );
    let f = frame(FAILURE, &pc(&failure(Rank::new(0, 0), "x".repeat(MAX_DETAIL))));
    c.add("fail_detail_1024_wrong_rank.bin", f, true, "Range Rank", "detail exactly MAX_DETAIL (fine), wrong rank");
    let f = frame(FAILURE, &pc(&failure(rank, "ok".into())));
    c.add("fail_no_peer.bin", f, false, "NoPeerLayout", "valid failure before the handshake");
    let good = pc(&failure(rank, "detail".into()));
    let at = pc(&(KEY, rank)).len();
    for (d, why) in [(6u8, "unknown FailureKind 6"), (0x7f, "unknown FailureKind 127")] {
        let mut p = good.clone();
        p[at] = d;
        c.add(format!("fail_kind_{d}.bin"), frame(FAILURE, &p), true, "Malformed", why);
    }
    let mut p = pc(&(KEY, rank, 1u32));
    p.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x1f]);
    c.add("fail_status_overflow.bin", frame(FAILURE, &p), true, "Malformed", "TransferFailed status varint > 32 bits");
    let mut p = good.clone();
    let i = find(&p, b"detail");
    p[i] = 0xc0;
    c.add("fail_detail_bad_utf8.bin", frame(FAILURE, &p), true, "Malformed", "detail not UTF-8");
    let mut p = pc(&(KEY, rank, FailureKind::Aborted));
    p.extend_from_slice(&pc(&100usize));
    p.extend_from_slice(b"short");
    c.add("fail_detail_len_past_end.bin", frame(FAILURE, &p), true, "Malformed", "detail claims 100 bytes, has 5");

    let a = frame(ABORT, &pc(&abort(rank, long.clone())));
    c.add("abort_reason_1025.bin", a.clone(), true, "Range TooLong:reason", "reason of MAX_DETAIL + 1 bytes");
    c.add("abort_reason_1025_no_peer.bin", a, false, "Range TooLong:reason", "over-long reason before the handshake");
    let a = frame(ABORT, &pc(&abort(rank, "bye".into())));
    c.add("abort_no_peer.bin", a, false, "NoPeerLayout", "valid abort before the handshake");
    let mut p = pc(&abort(rank, "bye".into()));
    let i = find(&p, b"bye");
    p[i + 1] = 0x80;
    c.add("abort_reason_bad_utf8.bin", frame(ABORT, &p), true, "Malformed", "reason not UTF-8");

    c.add("hb_empty_payload.bin", frame(HEARTBEAT, &[]), false, "Malformed", "heartbeat with no payload");
    let mut p = vec![0xff; 9];
    p.push(0x02);
    c.add("hb_seq_overflow.bin", frame(HEARTBEAT, &p), false, "Malformed", "10-byte varint above u64::MAX");
    c.add("hb_seq_unterminated.bin", frame(HEARTBEAT, &[0x80; 10]), false, "Malformed", "varint never ends");
    let mut p = pc(&Heartbeat { seq: 1 });
    p.push(0);
    c.add("hb_payload_extra.bin", frame(HEARTBEAT, &p), false, "TrailingBytes", "seq then one extra byte");
}

fn handshakes(c: &mut Corpus) {
    let h = peer_handshake();
    let mut f = h.clone();
    f.compat_hash ^= 1;
    c.add("hs_hash_forged.bin", hs_frame(&f), false, "HashMismatch", "compat hash with its low bit flipped");
    c.add(
        "hs_hash_forged_with_peer.bin",
        hs_frame(&f),
        true,
        "HashMismatch",
        "forged hash; a known peer changes nothing",
    );
    f.compat_hash = 0;
    c.add("hs_hash_zero.bin", hs_frame(&f), false, "HashMismatch", "compat hash 0");
    let mut f = h.clone();
    f.mode = Mode::Pull;
    c.add("hs_hash_of_other_mode.bin", hs_frame(&f), false, "HashMismatch", "pull mode under the push hash");
    let mut f = h.clone();
    f.protocol = PROTOCOL_VERSION + 1;
    c.add("hs_hash_of_other_protocol.bin", hs_frame(&f), false, "HashMismatch", "protocol field 2 under the v1 hash");
    let mut f = h.clone();
    f.layout.model.dtype = kvpush::proto::layout::DType::F16;
    c.add("hs_hash_stale_model.bin", hs_frame(&f), false, "HashMismatch", "dtype changed to f16, hash of bf16 kept");
    let mut f = h.clone();
    f.layout.order = kvpush::proto::layout::BlockOrder::Nhd;
    c.add("hs_hash_stale_order.bin", hs_frame(&f), false, "HashMismatch", "order changed to NHD, hash of HND kept");

    let mut f = h.clone();
    f.engine_id = "e".repeat(MAX_ENGINE_ID + 1);
    c.add("hs_engine_id_257.bin", hs_frame(&f), false, "Range TooLong:engine_id", "engine id of 257 bytes");
    let mut f = h.clone();
    f.software = "s".repeat(MAX_ENGINE_ID + 1);
    c.add("hs_software_257.bin", hs_frame(&f), false, "Range TooLong:software", "software of 257 bytes");
    // agent_metadata over MAX_AGENT_METADATA needs an 8 MiB file: tests/proto/codec_corpus.rs builds it.

    // Every LayoutError the codec can reach, each the only fault, each with a correct hash.
    let base = peer_layout();
    {
        let mut l = base.clone();
        l.model.groups = (0..65).map(|i| KvGroup { kind: GroupKind::Full, layers: vec![i] }).collect();
        let desc = "65 KV groups: refused by the MAX_GROUPS length bound before the layout is checked";
        c.add("hs_layout_groups_65.bin", hs_frame(&hs_with(l)), false, "Malformed", desc);
    }
    let mut layout_case = |name: &str, expect: &str, desc: &str, edit: &dyn Fn(&mut KvLayout)| {
        let mut l = base.clone();
        edit(&mut l);
        assert!(l.validate().is_err(), "layout case {name} is valid");
        c.add(format!("hs_layout_{name}.bin"), hs_frame(&hs_with(l)), false, &format!("Range Layout:{expect}"), desc);
    };
    let regions = |l: &mut KvLayout, n: u64| {
        l.region_bases = (0..n).map(|i| 0x1000_0000 + i * 0x10_0000).collect();
    };
    layout_case("total_layers_0", "OutOfRange:total_layers", "total_layers 0", &|l| l.model.total_layers = 0);
    layout_case("total_layers_over", "OutOfRange:total_layers", "total_layers MAX_LAYERS + 1", &|l| {
        l.model.total_layers = MAX_LAYERS + 1
    });
    layout_case("kv_heads_0", "OutOfRange:kv_heads", "kv_heads 0", &|l| l.model.kv_heads = 0);
    layout_case("kv_heads_over", "OutOfRange:kv_heads", "kv_heads MAX_KV_HEADS + 1", &|l| {
        l.model.kv_heads = MAX_KV_HEADS + 1
    });
    layout_case("head_dim_0", "OutOfRange:head_dim", "head_dim 0", &|l| l.model.head_dim = 0);
    layout_case("head_dim_over", "OutOfRange:head_dim", "head_dim MAX_HEAD_DIM + 1", &|l| {
        l.model.head_dim = MAX_HEAD_DIM + 1
    });
    layout_case("block_tokens_0", "OutOfRange:block_tokens", "block_tokens 0", &|l| l.block_tokens = 0);
    layout_case("block_tokens_over", "OutOfRange:block_tokens", "block_tokens MAX_BLOCK_TOKENS + 1", &|l| {
        l.block_tokens = MAX_BLOCK_TOKENS + 1
    });
    layout_case("num_blocks_0", "OutOfRange:num_blocks", "num_blocks 0", &|l| l.num_blocks = 0);
    layout_case("num_blocks_over", "OutOfRange:num_blocks", "num_blocks MAX_BLOCKS + 1", &|l| {
        l.num_blocks = MAX_BLOCKS + 1
    });
    layout_case("tp_size_0", "OutOfRange:tp_size", "tp_size 0 (tp_rank 0)", &|l| {
        l.parallel.tp_size = 0;
        l.parallel.tp_rank = 0;
    });
    layout_case("tp_size_over", "OutOfRange:tp_size", "tp_size MAX_PARALLEL + 1", &|l| {
        l.parallel.tp_size = MAX_PARALLEL + 1
    });
    layout_case("pp_size_0", "OutOfRange:pp_size", "pp_size 0", &|l| l.parallel.pp_size = 0);
    layout_case("pp_size_over_layers", "OutOfRange:pp_size", "pp_size 5 for 4 layers", &|l| l.parallel.pp_size = 5);
    layout_case("pp_size_over_max", "OutOfRange:pp_size", "pp_size MAX_PARALLEL + 1 (4096 layers)", &|l| {
        l.model.total_layers = MAX_LAYERS;
        l.model.groups = vec![KvGroup { kind: GroupKind::Full, layers: (0..MAX_LAYERS).collect() }];
        l.parallel.pp_size = MAX_PARALLEL + 1;
    });
    layout_case("groups_0", "OutOfRange:groups", "no KV groups", &|l| l.model.groups.clear());
    layout_case("tp_rank_eq_size", "RankOutOfRange:tp", "tp_rank 2 of 2", &|l| l.parallel.tp_rank = 2);
    layout_case("pp_rank_eq_size", "RankOutOfRange:pp", "pp_rank 1 of 1", &|l| l.parallel.pp_rank = 1);
    layout_case("heads_2_over_tp_3", "HeadsNotDivisible", "2 KV heads over TP 3", &|l| l.parallel.tp_size = 3);
    layout_case("heads_3_over_tp_2", "HeadsNotDivisible", "3 KV heads over TP 2", &|l| l.model.kv_heads = 3);
    layout_case("kv_single", "PlacementMismatch", "keys and values with placement Single", &|l| {
        l.placement = KvPlacement::Single;
        regions(l, 4);
    });
    layout_case("latent_separate", "PlacementMismatch", "latent with placement Separate", &|l| {
        l.model.kind = KvKind::Latent;
        l.model.kv_heads = 1;
        l.parallel.tp_rank = 0;
        l.parallel.tp_size = 1;
    });
    layout_case("latent_joint", "PlacementMismatch", "latent with placement Joint", &|l| {
        l.model.kind = KvKind::Latent;
        l.model.kv_heads = 1;
        l.placement = KvPlacement::Joint;
        l.parallel.tp_rank = 0;
        l.parallel.tp_size = 1;
        regions(l, 4);
    });
    layout_case("latent_2_heads", "LatentHeads", "latent declaring 2 KV heads", &|l| {
        l.model.kind = KvKind::Latent;
        l.placement = KvPlacement::Single;
        regions(l, 4);
    });
    layout_case("head_joint_nhd", "PlacementOrder", "placement HeadJoint with order Nhd", &|l| {
        l.placement = KvPlacement::HeadJoint;
        l.order = kvpush::proto::layout::BlockOrder::Nhd;
        l.block_stride *= 2;
        regions(l, 4);
    });
    layout_case("stride_short", "StrideTooSmall", "block stride one byte short", &|l| l.block_stride -= 1);
    layout_case("stride_joint", "StrideTooSmall", "joint placement with a one-part stride", &|l| {
        l.placement = KvPlacement::Joint;
        regions(l, 4);
    });
    layout_case("regions_7", "RegionCount", "7 region bases for 8", &|l| {
        l.region_bases.pop();
    });
    layout_case("regions_0", "RegionCount", "no region bases", &|l| l.region_bases.clear());
    layout_case("regions_9", "RegionCount", "9 region bases for 8", &|l| regions(l, 9));
    layout_case("region_base_0", "BadRegion", "region 3 at address 0", &|l| l.region_bases[3] = 0);
    layout_case("region_wraps", "BadRegion", "region 7 wraps the address space", &|l| {
        l.region_bases[7] = u64::MAX - 100
    });
    layout_case("region_len_overflow", "BadRegion", "stride x blocks overflows u64", &|l| {
        l.block_stride = u64::MAX / 32
    });
    layout_case("regions_equal", "SharedWithinGroup", "regions 0 and 5 (layers of one group) at one address", &|l| {
        l.region_bases[5] = l.region_bases[0]
    });
    layout_case("regions_touching_minus_1", "Overlap", "region 1 starts one byte inside region 0", &|l| {
        l.region_bases[1] = l.region_bases[0] + l.region_len() - 1
    });
    layout_case("group_empty", "Groups", "a third, empty group", &|l| {
        l.model.groups.push(KvGroup { kind: GroupKind::Full, layers: vec![] })
    });
    layout_case("group_window_0", "Groups", "sliding window of 0 tokens", &|l| {
        l.model.groups[1].kind = GroupKind::SlidingWindow { window_tokens: 0 }
    });
    layout_case("group_layer_past_end", "Groups", "group names layer 4 of 4", &|l| {
        l.model.groups[1].layers = vec![1, 3, 4]
    });
    layout_case("group_unsorted", "Groups", "layers 2, 0", &|l| l.model.groups[0].layers = vec![2, 0]);
    layout_case("group_repeated_layer", "Groups", "layers 0, 0, 2", &|l| l.model.groups[0].layers = vec![0, 0, 2]);
    layout_case("group_shared_layer", "Groups", "layer 2 in both groups", &|l| {
        l.model.groups[1].layers = vec![1, 2, 3]
    });
    layout_case("group_missing_layer", "Groups", "layer 3 in no group", &|l| l.model.groups[1].layers = vec![1]);

    // Encodings the parser refuses. Field offsets are the encoded length of the fields before them.
    let p = pc(&h);
    let m = &h.layout.model;
    let mode_at = pc(&(h.protocol, &h.software, &h.engine_id)).len();
    let dtype_at =
        pc(&(h.protocol, &h.software, &h.engine_id, h.mode, &h.agent_metadata, m.total_layers, m.kv_heads, m.head_dim))
            .len();
    let group_at = dtype_at + pc(&(m.dtype, m.kind, m.groups.len())).len();
    let order_at =
        pc(&(h.protocol, &h.software, &h.engine_id, h.mode, &h.agent_metadata, m, h.layout.block_tokens)).len();
    for (at, value, name, desc) in [
        (mode_at, 2u8, "mode_2", "unknown Mode 2"),
        (dtype_at, 6, "dtype_6", "unknown DType 6"),
        (dtype_at + 1, 2, "kv_kind_2", "unknown KvKind 2"),
        (group_at, 2, "group_kind_2", "unknown GroupKind 2"),
        (order_at, 2, "order_2", "unknown BlockOrder 2"),
        (order_at + 1, 5, "placement_5", "unknown KvPlacement 5"),
    ] {
        let mut b = p.clone();
        b[at] = value;
        c.add(format!("hs_enum_{name}.bin"), frame(HANDSHAKE, &b), false, "Malformed", desc);
    }
    let mut b = p.clone();
    b[find(&p, b"engine-a")] = 0xfe;
    c.add("hs_engine_id_bad_utf8.bin", frame(HANDSHAKE, &b), false, "Malformed", "engine id not UTF-8");
    let mut b = p.clone();
    let i = find(&p, b"0.1.0");
    b[i..i + 2].copy_from_slice(&[0xed, 0xa0]);
    c.add("hs_software_surrogate.bin", frame(HANDSHAKE, &b), false, "Malformed", "software holds a UTF-16 surrogate");
    let mut b = pc(&(h.protocol, &h.software, &h.engine_id, h.mode));
    b.extend_from_slice(&pc(&(1usize << 31)));
    b.extend_from_slice(&[1, 2, 3, 4]);
    c.add("hs_metadata_claims_2g.bin", frame(HANDSHAKE, &b), false, "Malformed", "agent metadata claims 2 GiB, has 4");
    let mut b = vec![0xff, 0xff, 0x04];
    b.extend_from_slice(&p[1..]);
    c.add("hs_protocol_overflow.bin", frame(HANDSHAKE, &b), false, "Malformed", "protocol varint above u16::MAX");
    let mut b = pc(&(h.protocol, &h.software, &h.engine_id, h.mode, &h.agent_metadata, m));
    b.extend_from_slice(&pc(&(h.layout.block_tokens, h.layout.order, h.layout.placement, h.layout.block_stride)));
    b.extend_from_slice(&pc(&(h.layout.num_blocks, h.layout.parallel)));
    b.extend_from_slice(&pc(&100_000usize));
    c.add(
        "hs_regions_claim_100k.bin",
        frame(HANDSHAKE, &b),
        false,
        "Malformed",
        "claims 100000 region bases, has none",
    );
    let mut b = pc(&(h.protocol, &h.software, &h.engine_id, h.mode, &h.agent_metadata, m.total_layers, m.kv_heads));
    b.extend_from_slice(&pc(&(m.head_dim, m.dtype, m.kind)));
    b.extend_from_slice(&pc(&usize::MAX));
    c.add("hs_groups_claim_usize_max.bin", frame(HANDSHAKE, &b), false, "Malformed", "claims usize::MAX groups");
    c.add("hs_empty_payload.bin", frame(HANDSHAKE, &[]), false, "Malformed", "handshake with no payload");
}

fn build() -> (Corpus, Vec<(&'static str, Vec<u8>)>) {
    let valid: Vec<(&'static str, Vec<u8>)> =
        valid_messages().into_iter().map(|(n, m)| (n, to_vec(&m).expect("valid message encodes"))).collect();
    // The registration mirror must encode exactly as kvpush does.
    let reg = &valid.iter().find(|(k, _)| *k == "registration").expect("registration").1;
    assert_eq!(&frame(REGISTRATION, &reg_bytes(&valid_reg())), reg, "reg_bytes no longer writes what kvpush writes");
    let mut c = Corpus::default();
    header_faults(&mut c, &valid);
    truncations(&mut c, &valid);
    bit_flips(&mut c, &valid);
    registrations(&mut c);
    per_rank_messages(&mut c);
    handshakes(&mut c);
    (c, valid)
}

/// Decodes every entry and returns the ones that do not give their expected error.
fn verify(c: &Corpus) -> Vec<String> {
    let peer = peer_layout();
    let mut bad = Vec::new();
    let mut names = std::collections::BTreeSet::new();
    for e in &c.entries {
        if !names.insert(e.name.as_str()) {
            bad.push(format!("{}: duplicate name", e.name));
        }
        let _ = frame_len(&e.bytes);
        match decode(&e.bytes, e.peer.then_some(&peer)) {
            Ok(m) => bad.push(format!("{}: decoded to {m:?}, expected {} {}", e.name, e.variant, e.detail)),
            Err(err) => {
                let (v, d) = describe(&err);
                if v != e.variant || d != e.detail {
                    bad.push(format!("{}: got {v} {d} ({err}), expected {} {}", e.name, e.variant, e.detail));
                }
            }
        }
    }
    bad
}

fn manifest(c: &Corpus) -> String {
    let mut s = String::new();
    s.push_str("# kvpush codec corpus: malformed frames and the DecodeError each must give.\n");
    s.push_str("# Generated by fuzz/examples/gen_corpus.rs (see fuzz/README.md); do not edit by hand.\n");
    s.push_str("# Each expectation is written in the generator from docs/protocol.md, never recorded from decode().\n");
    s.push_str("# peer = decoded with the peer layout of kvpush_testkit::corpus; none = without.\n");
    s.push_str("# detail = the inner RangeError / LayoutError where there is one, else '-'.\n");
    s.push_str(&format!("# peer_fingerprint\t{:#018x}\n", fingerprint()));
    s.push_str("# file\tvariant\tpeer\tdetail\tdescription\n");
    for e in &c.entries {
        let peer = if e.peer { "peer" } else { "none" };
        assert!(!e.desc.contains(['\t', '\n']), "description of {} has a tab or newline", e.name);
        s.push_str(&format!("{}\t{}\t{peer}\t{}\t{}\n", e.name, e.variant, e.detail, e.desc));
    }
    s
}

fn write_dir(dir: &Path, files: &[(String, Vec<u8>)], check: bool, stale: &mut Vec<String>) {
    if !check {
        std::fs::create_dir_all(dir).expect("create output folder");
    }
    let wanted: BTreeMap<&str, &[u8]> = files.iter().map(|(n, b)| (n.as_str(), b.as_slice())).collect();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for ent in rd {
            let ent = ent.expect("read folder");
            let name = ent.file_name().to_string_lossy().into_owned();
            if !wanted.contains_key(name.as_str()) {
                if check {
                    stale.push(format!("{}: not generated", ent.path().display()));
                } else {
                    std::fs::remove_file(ent.path()).expect("remove stale file");
                }
            }
        }
    }
    for (name, bytes) in files {
        let path = dir.join(name);
        if check {
            if std::fs::read(&path).ok().as_deref() != Some(bytes.as_slice()) {
                stale.push(format!("{}: missing or different", path.display()));
            }
        } else {
            std::fs::write(&path, bytes).expect("write corpus file");
        }
    }
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut out = root.join("../tests/corpus/codec");
    let mut seeds = Some(root.join("corpus/codec"));
    let mut check = false;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--check" => check = true,
            "--out" => out = PathBuf::from(args.next().expect("--out DIR")),
            "--seeds" => seeds = Some(PathBuf::from(args.next().expect("--seeds DIR"))),
            "--no-seeds" => seeds = None,
            _ => {
                eprintln!("usage: gen_corpus [--check] [--out DIR] [--seeds DIR | --no-seeds]");
                return ExitCode::from(2);
            }
        }
    }
    let (c, valid) = build();
    let bad = verify(&c);
    if !bad.is_empty() {
        eprintln!("{} corpus entries do not decode as expected (codec bug or wrong expectation):", bad.len());
        for b in &bad {
            eprintln!("  {b}");
        }
        return ExitCode::FAILURE;
    }
    let mut files: Vec<(String, Vec<u8>)> = c.entries.iter().map(|e| (e.name.clone(), e.bytes.clone())).collect();
    files.push(("MANIFEST.tsv".into(), manifest(&c).into_bytes()));
    let mut stale = Vec::new();
    write_dir(&out, &files, check, &mut stale);
    if check {
        if stale.is_empty() {
            eprintln!("{}: {} files up to date", out.display(), c.entries.len());
            return ExitCode::SUCCESS;
        }
        eprintln!("corpus is stale; rerun `cargo run --example gen_corpus`:");
        for s in &stale {
            eprintln!("  {s}");
        }
        return ExitCode::FAILURE;
    }
    let bytes: usize = c.entries.iter().map(|e| e.bytes.len()).sum();
    eprintln!("wrote {} frames ({bytes} bytes) and MANIFEST.tsv to {}", c.entries.len(), out.display());
    if let Some(dir) = seeds {
        std::fs::create_dir_all(&dir).expect("create seed folder");
        for (name, bytes) in &valid {
            std::fs::write(dir.join(format!("valid_{name}.bin")), bytes).expect("write seed");
        }
        let extra = [
            ("pull_handshake", Message::Handshake(Box::new(handshake_for(peer_layout(), Mode::Pull)))),
            ("heartbeat_max", Message::Heartbeat(Heartbeat { seq: u64::MAX })),
        ];
        for (name, m) in extra {
            std::fs::write(dir.join(format!("valid_{name}.bin")), to_vec(&m).expect("encodes")).expect("write seed");
        }
        eprintln!("wrote {} valid seed frames to {}", valid.len() + 2, dir.display());
    }
    ExitCode::SUCCESS
}
