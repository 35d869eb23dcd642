//! Byte-exact encodings of every message of the wire protocol, written by hand from
//! docs/protocol.md (§1 Frames, §2 Messages, §3.1 Fields, §4 Compatibility) and checked both ways:
//! `to_vec(value)` must give exactly these bytes and `decode(bytes)` exactly this value.
//!
//! The oracle is the document, not the encoder: every hex string below was derived field by field
//! from the spec (postcard varints, zigzag, length prefixes, variant indices in declaration order)
//! and annotated with the field it encodes. If one of these tests fails, either the code changed the
//! wire format (a new `PROTOCOL_VERSION` and a doc change are due) or the doc is wrong. Never fix a
//! failure by pasting `to_vec`'s output here.
//!
//! The staging frames of `transport::staged` (REQUEST, GRANT, PIECE, ...) are not specified in
//! docs/protocol.md and have no golden encodings here.

use kvpush::proto::bounce::{MemoryKind, MemoryOffer, RdmaOps};
use kvpush::proto::codec::{decode, frame_len, to_vec, DecodeError, HEADER_LEN};
use kvpush::proto::ids::{Key, Rank};
use kvpush::proto::layerwise::LayerCompletion;
use kvpush::proto::layout::{
    BlockOrder, DType, GroupKind, KvGroup, KvKind, KvLayout, KvPlacement, ModelShape, Parallel,
};
use kvpush::proto::msg::{
    Abort, Completion, Failure, FailureKind, Grant, Handshake, Heartbeat, Hold, Message, Mode, RangeError, Registration,
};

/// Parses hex bytes; on each line, `--` starts a comment (the field the bytes encode).
fn hex(s: &str) -> Vec<u8> {
    s.lines()
        .flat_map(|l| l.split_once("--").map_or(l, |(bytes, _)| bytes).split_whitespace())
        .map(|t| u8::from_str_radix(t, 16).unwrap_or_else(|e| panic!("bad hex byte {t:?}: {e}")))
        .collect()
}

/// The layout of every golden message: 2 layers in two groups (full: layer 0; sliding window of 128
/// tokens: layer 1), 1 KV head of dim 4 in f16, 300 blocks of 16 tokens, HND, joint K/V placement
/// (one region per layer), block stride 256, TP 1 / PP 1, regions at 1 MiB and 2 MiB.
fn layout() -> KvLayout {
    KvLayout {
        model: ModelShape {
            total_layers: 2,
            kv_heads: 1,
            head_dim: 4,
            dtype: DType::F16,
            kind: KvKind::KeyValue,
            groups: vec![
                KvGroup { kind: GroupKind::Full, layers: vec![0] },
                KvGroup { kind: GroupKind::SlidingWindow { window_tokens: 128 }, layers: vec![1] },
            ],
        },
        block_tokens: 16,
        order: BlockOrder::Hnd,
        placement: KvPlacement::Joint,
        block_stride: 256,
        num_blocks: 300,
        parallel: Parallel { tp_rank: 0, tp_size: 1, pp_rank: 0, pp_size: 1 },
        region_bases: vec![0x10_0000, 0x20_0000],
    }
}

/// `ModelShape` of [`layout`], in wire order (§3.1).
const MODEL_HEX: &str = "
    02  -- total_layers 2
    01  -- kv_heads 1
    04  -- head_dim 4
    00  -- dtype F16 (variant 0)
    00  -- kind KeyValue (variant 0)
    02  -- groups: 2
    00 01 00  -- Full (variant 0), layers: 1 list entry, layer 0
    01 80 01  -- SlidingWindow (variant 1), window_tokens 128 = varint 80 01
    01 01  -- layers: 1 entry, layer 1
";

/// The rest of [`layout`] after its model, in wire order (§3.1).
const LAYOUT_REST_HEX: &str = "
    10  -- block_tokens 16
    00  -- order Hnd (variant 0)
    01  -- placement Joint (variant 1)
    80 02  -- block_stride 256 (u64 varint: 0 with continuation, then 2)
    ac 02  -- num_blocks 300 = 0x12c: low 7 bits 0x2c | 0x80, then 2
    00 01 00 01  -- parallel: tp_rank 0, tp_size 1, pp_rank 0, pp_size 1
    02  -- region_bases: 2
    80 80 40  -- 0x100000 = 2^20: two zero groups, then 2^20 >> 14 = 0x40
    80 80 80 01  -- 0x200000 = 2^21: three zero groups, then 1
";

/// §4: FNV-1a 64 (offset basis 0xcbf29ce484222325, prime 0x100000001b3) over the concatenated
/// postcard encodings of model, order, mode and protocol. Written here from the doc, not called.
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// `compat_hash` of [`layout`] in push mode, protocol 2: FNV-1a of MODEL_HEX ‖ `00` (Hnd) ‖ `00`
/// (Push) ‖ `02` (protocol 2). [`hash_matches_the_documented_recipe`] checks this constant.
const PUSH_HASH: u64 = 0x1267_27e8_b877_c763;
/// The same in pull mode (mode byte `01`).
const PULL_HASH: u64 = 0x1263_c5e8_b874_eb06;

fn handshake(mode: Mode, compat_hash: u64) -> Handshake {
    Handshake {
        protocol: 2,
        software: "0.1.0".into(),
        engine_id: "p0".into(),
        mode,
        agent_metadata: vec![0xde, 0xad],
        layout: layout(),
        compat_hash,
        memory: None,
    }
}

/// The handshake frame for `mode`: 9-byte header, then the payload of 56 (0x38) bytes.
fn handshake_hex(mode_byte: &str, hash_varint: &str) -> String {
    format!(
        "4b 50 02 00 01 38 00 00 00  -- magic, version 2, kind 1 (Handshake), length 56
         02  -- protocol 2
         05 30 2e 31 2e 30  -- software \"0.1.0\"
         02 70 30  -- engine_id \"p0\"
         {mode_byte}  -- mode
         02 de ad  -- agent_metadata: 2 bytes
         {MODEL_HEX} {LAYOUT_REST_HEX}  -- layout
         {hash_varint}  -- compat_hash, u64 varint"
    )
}

struct Golden {
    name: &'static str,
    bytes: Vec<u8>,
    msg: Message,
    /// Decoded with [`layout`] as the sender's layout (every kind but Handshake and Heartbeat needs it).
    peer: bool,
}

fn goldens() -> Vec<Golden> {
    let l = layout();
    let rank = Rank::new(0, 0);
    let reg = Registration::new(Key::new(0x1234, 2), "d0".into(), rank, 80, vec![vec![5, 6, 7, 8, 200], vec![299]], &l)
        .expect("the golden registration fits its layout");
    // The header's magic and version are the same in every frame: "KP", then 2 as a u16 LE.
    vec![
        Golden {
            name: "handshake push",
            bytes: hex(&handshake_hex("00", "e3 8e df c3 8b fd c9 b3 12")),
            msg: Message::Handshake(Box::new(handshake(Mode::Push, PUSH_HASH))),
            peer: false,
        },
        Golden {
            name: "handshake push with a memory offer",
            bytes: hex(&format!(
                "{}  -- the offer-less frame, its length 56 + 8 = 64 (0x40)
                 01  -- extension tag 1: memory offer
                 02  -- kind Neuron
                 00 01 01  -- its device memory: no WRITE, READ, target
                 01 01 01  -- host memory: WRITE, READ, target",
                handshake_hex("00", "e3 8e df c3 8b fd c9 b3 12").replacen("01 38 00 00 00", "01 40 00 00 00", 1)
            )),
            msg: Message::Handshake(Box::new(Handshake {
                memory: Some(MemoryOffer {
                    kind: MemoryKind::Neuron,
                    device: RdmaOps { write: false, read: true, target: true },
                    host: RdmaOps::ALL,
                }),
                ..handshake(Mode::Push, PUSH_HASH)
            })),
            peer: false,
        },
        Golden {
            name: "handshake pull",
            bytes: hex(&handshake_hex("01", "86 d6 d3 c3 8b bd f1 b1 12")),
            msg: Message::Handshake(Box::new(handshake(Mode::Pull, PULL_HASH))),
            peer: false,
        },
        Golden {
            name: "registration",
            bytes: hex("4b 50 02 00 02 13 00 00 00  -- kind 2 (Registration), length 19
                 b4 24 02  -- key: transfer_id 0x1234 (varint b4 24), attempt 2
                 02 64 30  -- engine_id \"d0\"
                 00 00  -- rank tp0/pp0
                 50  -- num_tokens 80
                 02  -- block_ids: 2 lists
                 0a  -- group 0: head 5 << 1 | 0: 5 ids as runs
                 0a 06  -- run: first 5 - 0 (zig-zag 10), (4 - 1) << 1 | ascending = 6: 5, 6, 7, 8
                 80 03 00  -- run: first 200 - 8 = 192 (zig-zag 384 = varint 80 03), length 1: 200
                 03 d6 04  -- group 1: head 1 << 1 | 1: 1 id as deltas: +299 (zig-zag 598 = d6 04)"),
            msg: Message::Registration(reg),
            peer: true,
        },
        Golden {
            // The example of docs/protocol.md §1, byte for byte.
            name: "completion",
            bytes: hex("4b 50 02 00 03 05 00 00 00  b4 24 02 00 00"),
            msg: Message::Completion(Completion { key: Key::new(0x1234, 2), rank }),
            peer: true,
        },
        Golden {
            name: "layers",
            bytes: hex("4b 50 02 00 08 09 00 00 00  -- kind 8 (Layers), length 9
                 b4 24 02  -- key 0x1234#2
                 00 00  -- rank tp0/pp0 (P's)
                 01 02  -- layers 1..2 (start, end)
                 00 02  -- part 0..2 (start, end)"),
            msg: Message::Layers(LayerCompletion { key: Key::new(0x1234, 2), rank, layers: 1..2, part: 0..2 }),
            peer: true,
        },
        Golden {
            name: "grant",
            bytes: hex("4b 50 02 00 07 10 00 00 00  -- kind 7 (Grant), length 16
                 b4 24 02  -- key 0x1234#2
                 00 00  -- rank tp0/pp0 (P's)
                 28  -- num_tokens 40
                 02  -- block_ids: 2 lists
                 06 90 03 05  -- group 0: 3 ids as runs: first 200 (zig-zag 400 = 90 03), (3 - 1) << 1 | descending = 5: 200, 199, 198
                 05 d6 04 bd 04  -- group 1: 2 ids as deltas: +299 (d6 04), 12 - 299 = -287 (zig-zag 573 = bd 04)"),
            msg: Message::Grant(Grant {
                key: Key::new(0x1234, 2),
                rank,
                num_tokens: 40,
                block_ids: vec![vec![200, 199, 198], vec![299, 12]],
            }),
            peer: true,
        },
        Golden {
            name: "failure transfer failed",
            bytes: hex("4b 50 02 00 04 1b 00 00 00  -- kind 4 (Failure), length 27
                 80 80 80 80 80 80 80 80 80 02  -- transfer_id 2^64: nine zero groups, then 2 (bit 64)
                 01  -- attempt 1
                 00 00  -- rank tp0/pp0
                 01 05  -- kind TransferFailed (variant 1), status -3 zigzag = 5
                 0b 70 6f 73 74 20 66 61 69 6c 65 64  -- detail \"post failed\" (11 bytes)"),
            msg: Message::Failure(Failure {
                key: Key::new(1 << 64, 1),
                rank,
                kind: FailureKind::TransferFailed { status: -3 },
                detail: "post failed".into(),
            }),
            peer: true,
        },
        Golden {
            name: "failure peer lost",
            bytes: hex("4b 50 02 00 04 07 00 00 00  -- kind 4 (Failure), length 7
                 b4 24 02 00 00  -- key 0x1234#2, rank tp0/pp0
                 05  -- kind PeerLost (variant 5, no fields)
                 00  -- detail \"\""),
            msg: Message::Failure(Failure {
                key: Key::new(0x1234, 2),
                rank,
                kind: FailureKind::PeerLost,
                detail: String::new(),
            }),
            peer: true,
        },
        Golden {
            name: "failure status 100",
            bytes: hex("4b 50 02 00 04 09 00 00 00  -- kind 4 (Failure), length 9
                 b4 24 02 00 00  -- key 0x1234#2, rank tp0/pp0
                 01 c8 01  -- kind TransferFailed, status 100 zigzag = 200 (varint c8 01)
                 00  -- detail \"\""),
            msg: Message::Failure(Failure {
                key: Key::new(0x1234, 2),
                rank,
                kind: FailureKind::TransferFailed { status: 100 },
                detail: String::new(),
            }),
            peer: true,
        },
        Golden {
            name: "abort",
            bytes: hex("4b 50 02 00 05 09 00 00 00  -- kind 5 (Abort), length 9
                 b4 24 03  -- key 0x1234#3
                 00 00  -- rank tp0/pp0
                 03 62 79 65  -- reason \"bye\""),
            msg: Message::Abort(Abort { key: Key::new(0x1234, 3), rank, reason: "bye".into() }),
            peer: true,
        },
        Golden {
            name: "hold",
            bytes: hex("4b 50 02 00 09 05 00 00 00  -- kind 9 (Hold), length 5
                 b4 24 03  -- key 0x1234#3
                 00 00  -- rank tp0/pp0"),
            msg: Message::Hold(Hold { key: Key::new(0x1234, 3), rank }),
            peer: true,
        },
        Golden {
            // The example of docs/protocol.md §1, byte for byte.
            name: "heartbeat 1",
            bytes: hex("4b 50 02 00 06 01 00 00 00 01"),
            msg: Message::Heartbeat(Heartbeat { seq: 1 }),
            peer: false,
        },
        Golden {
            name: "heartbeat u64::MAX",
            bytes: hex("4b 50 02 00 06 0a 00 00 00  -- kind 6 (Heartbeat), length 10
                 ff ff ff ff ff ff ff ff ff 01  -- seq 2^64 - 1: nine groups of seven ones, then 1"),
            msg: Message::Heartbeat(Heartbeat { seq: u64::MAX }),
            peer: false,
        },
    ]
}

#[test]
fn every_message_encodes_to_its_documented_bytes() {
    let mut wrong = Vec::new();
    for g in goldens() {
        match to_vec(&g.msg) {
            Ok(b) if b == g.bytes => {}
            Ok(b) => wrong.push(format!("{}:\n  doc  {:02x?}\n  code {:02x?}", g.name, g.bytes, b)),
            Err(e) => wrong.push(format!("{}: does not encode: {e}", g.name)),
        }
    }
    assert!(wrong.is_empty(), "encodings differ from docs/protocol.md:\n{}", wrong.join("\n"));
}

#[test]
fn every_documented_frame_decodes_to_its_message() {
    let l = layout();
    for g in goldens() {
        // The header's length field is the payload's length: the frame is exactly what frame_len says.
        assert_eq!(frame_len(&g.bytes[..HEADER_LEN]), Ok(Some(g.bytes.len())), "{}: frame_len", g.name);
        let got = decode(&g.bytes, g.peer.then_some(&l));
        assert_eq!(got.as_ref(), Ok(&g.msg), "{}", g.name);
        if g.peer {
            // And without the sender's layout these kinds are refused before they are parsed or checked.
            assert!(matches!(decode(&g.bytes, None), Err(DecodeError::NoPeerLayout { .. })), "{}", g.name);
        }
    }
}

/// A handshake's extension is the memory offer (tag 1) or nothing: another tag (trailing bytes, as
/// before extensions existed), a short or invalid offer, or a byte beyond it is refused, never skipped.
#[test]
fn handshake_extensions_other_than_one_whole_offer_are_refused() {
    let with_len = |len: &str, tail: &str| {
        hex(&format!(
            "{}\n{tail}",
            handshake_hex("00", "e3 8e df c3 8b fd c9 b3 12").replacen(
                "01 38 00 00 00",
                &format!("01 {len} 00 00 00"),
                1
            )
        ))
    };
    let malformed = |b: &[u8]| matches!(decode(b, None), Err(DecodeError::Malformed { kind: "handshake", .. }));
    assert!(
        matches!(
            decode(&with_len("40", "02 02 00 01 01 01 01 01"), None),
            Err(DecodeError::TrailingBytes { kind: "handshake", extra: 8 })
        ),
        "unknown tag 2"
    );
    assert!(malformed(&with_len("3f", "01 02 00 01 01 01 01")), "an offer one byte short");
    assert!(malformed(&with_len("40", "01 04 00 01 01 01 01 01")), "an unknown memory kind");
    assert!(malformed(&with_len("40", "01 02 00 02 01 01 01 01")), "a bool that is not 0 or 1");
    assert!(
        matches!(
            decode(&with_len("41", "01 02 00 01 01 01 01 01 00"), None),
            Err(DecodeError::TrailingBytes { kind: "handshake", extra: 1 })
        ),
        "a byte after the offer"
    );
}

#[test]
fn layer_notifications_outside_the_senders_layers_are_refused() {
    // Written from docs/protocol.md §2 (Layers): `layers` non-empty and inside `part`, `part` inside
    // the sender's layers (the golden layout holds 0..2).
    let l = layout();
    for (what, body) in [
        ("empty layers 1..1", "b4 24 02 00 00 01 01 00 02"),
        ("layers 0..2 outside part 1..2", "b4 24 02 00 00 00 02 01 02"),
        ("part 0..3 past the sender's 2 layers", "b4 24 02 00 00 00 01 00 03"),
        ("reversed layers 2..1", "b4 24 02 00 00 02 01 00 02"),
    ] {
        let mut frame = hex("4b 50 02 00 08 09 00 00 00");
        frame.extend(hex(body));
        let got = decode(&frame, Some(&l));
        assert!(
            matches!(got, Err(DecodeError::Range { kind: "layers", source: RangeError::Layers(_) })),
            "{what}: {got:?}"
        );
    }
    // Another rank than the connection's.
    let frame = hex("4b 50 02 00 08 09 00 00 00 b4 24 02 01 00 00 01 00 02");
    assert!(matches!(decode(&frame, Some(&l)), Err(DecodeError::Range { source: RangeError::Rank { .. }, .. })));
}

#[test]
fn the_golden_layout_is_valid() {
    layout().validate().expect("the golden layout is valid");
}

#[test]
fn hash_matches_the_documented_recipe() {
    let model = hex(MODEL_HEX);
    let mut push = model.clone();
    push.extend_from_slice(&hex("00 00 02")); // order Hnd, mode Push, protocol 2
    let mut pull = model;
    pull.extend_from_slice(&hex("00 01 02")); // order Hnd, mode Pull, protocol 2
    assert_eq!(fnv1a(&push), PUSH_HASH);
    assert_eq!(fnv1a(&pull), PULL_HASH);
    let l = layout();
    assert_eq!(kvpush::proto::compat::compat_hash(&l.model, l.order, Mode::Push, 2), PUSH_HASH);
    assert_eq!(kvpush::proto::compat::compat_hash(&l.model, l.order, Mode::Pull, 2), PULL_HASH);
}

#[test]
fn the_hash_varints_encode_the_hash_constants() {
    // Decoded by hand per §1 (7 bits per byte, least significant group first): independent of
    // postcard, so a typo in either the constant or the frame's bytes shows up here.
    fn unvarint(b: &[u8]) -> u64 {
        b.iter().rev().fold(0u64, |acc, &x| (acc << 7) | u64::from(x & 0x7f))
    }
    assert_eq!(unvarint(&hex("e3 8e df c3 8b fd c9 b3 12")), PUSH_HASH);
    assert_eq!(unvarint(&hex("86 d6 d3 c3 8b bd f1 b1 12")), PULL_HASH);
}

#[test]
fn a_version_1_frame_is_refused_by_its_version() {
    // Version 1 (docs/protocol.md §1, Versions) wrote block lists as plain id varints: this is its
    // registration of 5, 6, 200 and 299 and its heartbeat. A version-2 build refuses both on the
    // header, before reading the payload, and says which versions met.
    let old_registration =
        hex("4b 50 01 00 02 12 00 00 00  b4 24 02  02 64 30  00 00  28  02  03 05 06 c8 01  01 ab 02");
    let old_heartbeat = hex("4b 50 01 00 06 01 00 00 00 01");
    for frame in [old_registration, old_heartbeat] {
        let e = decode(&frame, Some(&layout())).expect_err("version 1 is refused");
        assert_eq!(e, DecodeError::UnsupportedVersion { got: 1, supported: 2 });
        assert_eq!(e.to_string(), "unsupported protocol version 1 (this build speaks 2)");
        assert_eq!(frame_len(&frame[..HEADER_LEN]), Err(e));
    }
}
