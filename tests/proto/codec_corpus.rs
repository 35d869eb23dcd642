//! Replays the malformed-frame corpus `tests/corpus/codec/` through the codec: every file must fail
//! with exactly the `DecodeError` (and inner error) its `MANIFEST.tsv` line names, and `frame_len`
//! must agree. Also flips every bit of one valid frame of each kind, and builds the inputs too large
//! to commit (payloads over the frame limits, agent metadata over its limit) at run time.
//!
//! The corpus is written by `fuzz/examples/gen_corpus.rs` (see `fuzz/README.md`). Entries marked
//! `peer` are decoded with [`peer_layout`], the generator's own (`kvpush_testkit::corpus`); the
//! manifest's `peer_fingerprint` line catches a corpus written with another.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use kvpush::proto::bounce::{MemoryKind, MemoryOffer, RdmaOps};
use kvpush::proto::codec::{
    decode, frame_len, to_vec, DecodeError, HEADER_LEN, MAGIC, MAX_HANDSHAKE_PAYLOAD, MAX_PAYLOAD, PROTOCOL_VERSION,
};
use kvpush::proto::layout::KvLayout;
use kvpush::proto::msg::{
    Abort, Failure, FailureKind, Handshake, Heartbeat, Message, Mode, Registration, MAX_AGENT_METADATA, MAX_DETAIL,
    MAX_ENGINE_ID, MAX_TOKENS,
};
use kvpush_testkit::corpus::{
    describe, fingerprint, handshake_for, peer_handshake, peer_layout, valid_messages, KEY, VARIANTS,
};

// ---- The corpus. ----

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/codec")
}

struct Entry {
    file: String,
    variant: String,
    peer: bool,
    detail: String,
    desc: String,
}

/// The manifest's entries and its recorded peer fingerprint.
fn manifest() -> (Vec<Entry>, Option<u64>) {
    let path = corpus_dir().join("MANIFEST.tsv");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut entries = Vec::new();
    let mut fp = None;
    for (n, line) in text.lines().enumerate() {
        if let Some(v) = line.strip_prefix("# peer_fingerprint\t") {
            let hex = v.trim().trim_start_matches("0x");
            fp = Some(u64::from_str_radix(hex, 16).unwrap_or_else(|e| panic!("line {}: fingerprint: {e}", n + 1)));
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let cols: Vec<&str> = line.split('\t').collect();
        assert_eq!(cols.len(), 5, "MANIFEST.tsv line {}: want 5 tab-separated columns: {line:?}", n + 1);
        let peer = match cols[2] {
            "peer" => true,
            "none" => false,
            other => panic!("MANIFEST.tsv line {}: peer column is {other:?}, want peer or none", n + 1),
        };
        entries.push(Entry {
            file: cols[0].to_string(),
            variant: cols[1].to_string(),
            peer,
            detail: cols[3].to_string(),
            desc: cols[4].to_string(),
        });
    }
    (entries, fp)
}

#[test]
fn peer_layout_matches_the_generator() {
    let (_, fp) = manifest();
    assert_eq!(
        fp,
        Some(fingerprint()),
        "the peer layout here differs from the one tests/corpus/codec was generated with (kvpush_testkit::corpus)"
    );
    peer_layout().validate().expect("peer layout is valid");
    let peer = peer_layout();
    for (name, m) in valid_messages() {
        let bytes = to_vec(&m).expect("encodes");
        assert_eq!(decode(&bytes, Some(&peer)).as_ref(), Ok(&m), "{name} round trip");
    }
}

#[test]
fn manifest_lists_exactly_the_files() {
    let (entries, _) = manifest();
    let mut listed = BTreeSet::new();
    for e in &entries {
        assert!(listed.insert(e.file.clone()), "{} is listed twice", e.file);
    }
    let mut present = BTreeSet::new();
    for ent in std::fs::read_dir(corpus_dir()).expect("corpus folder") {
        let ent = ent.expect("folder entry");
        let name = ent.file_name().into_string().expect("UTF-8 file name");
        if name != "MANIFEST.tsv" {
            assert!(ent.file_type().expect("file type").is_file(), "{name} is not a plain file");
            present.insert(name);
        }
    }
    let unlisted: Vec<_> = present.difference(&listed).collect();
    let missing: Vec<_> = listed.difference(&present).collect();
    assert!(unlisted.is_empty() && missing.is_empty(), "not in MANIFEST.tsv: {unlisted:?}; missing files: {missing:?}");
    assert!(entries.len() >= 100, "corpus has only {} entries", entries.len());
}

#[test]
fn every_corpus_file_gives_its_error() {
    let (entries, _) = manifest();
    let peer = peer_layout();
    let mut failures = Vec::new();
    let mut seen = BTreeSet::new();
    for e in &entries {
        let bytes = std::fs::read(corpus_dir().join(&e.file)).unwrap_or_else(|err| panic!("{}: {err}", e.file));
        let header = frame_len(&bytes);
        let got = decode(&bytes, e.peer.then_some(&peer));
        match &got {
            Ok(m) => failures.push(format!("{}: decoded to {m:?} ({})", e.file, e.desc)),
            Err(err) => {
                let (v, d) = describe(err);
                seen.insert(v);
                if v != e.variant || d != e.detail {
                    failures.push(format!(
                        "{}: got {v} {d} ({err}); manifest says {} {} ({})",
                        e.file, e.variant, e.detail, e.desc
                    ));
                }
                // frame_len reads the same header: a header fault is the same error from both.
                match header {
                    Ok(None) => assert!(bytes.len() < HEADER_LEN, "{}", e.file),
                    Ok(Some(len)) => assert!(len >= HEADER_LEN, "{}", e.file),
                    Err(h) => assert_eq!(&h, err, "{}: frame_len and decode disagree", e.file),
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} corpus files misbehave:\n{}",
        failures.len(),
        entries.len(),
        failures.join("\n")
    );
    let missing: Vec<_> = VARIANTS.iter().filter(|v| !seen.contains(*v)).collect();
    assert!(missing.is_empty(), "the corpus shows no {missing:?}");
}

/// Decodes `bytes` both ways; whatever decodes must re-encode to a frame decoding to the same message.
fn decode_round_trips(bytes: &[u8], peer: &KvLayout) -> usize {
    let _ = frame_len(bytes);
    let mut ok = 0;
    for p in [None, Some(peer)] {
        if let Ok(m) = decode(bytes, p) {
            ok += 1;
            assert_eq!(frame_len(bytes), Ok(Some(bytes.len())));
            let again = to_vec(&m).unwrap_or_else(|e| panic!("decoded {m:?} does not re-encode: {e}"));
            assert_eq!(decode(&again, p).as_ref(), Ok(&m), "re-encoded message differs");
        }
    }
    ok
}

#[test]
fn every_single_bit_flip_of_every_message_decodes_or_errs() {
    let peer = peer_layout();
    let mut flips = 0;
    let mut accepted = 0;
    let mut messages = valid_messages();
    messages.push(("pull_handshake", Message::Handshake(Box::new(handshake_for(peer_layout(), Mode::Pull)))));
    messages.push(("max_heartbeat", Message::Heartbeat(Heartbeat { seq: u64::MAX })));
    let offer = MemoryOffer { kind: MemoryKind::Neuron, device: RdmaOps::NONE, host: RdmaOps::ALL };
    let with_offer = Handshake { memory: Some(offer), ..handshake_for(peer_layout(), Mode::Push) };
    messages.push(("handshake_with_offer", Message::Handshake(Box::new(with_offer))));
    for (name, m) in messages {
        let good = to_vec(&m).expect("valid message encodes");
        assert_eq!(decode(&good, Some(&peer)).as_ref(), Ok(&m), "{name}");
        for byte in 0..good.len() {
            for bit in 0..8 {
                let mut f = good.clone();
                f[byte] ^= 1 << bit;
                flips += 1;
                accepted += decode_round_trips(&f, &peer);
            }
        }
        // And every truncation, and every byte replaced by each interesting value.
        for cut in 0..good.len() {
            assert!(matches!(decode(&good[..cut], Some(&peer)), Err(DecodeError::Truncated { .. })), "{name} at {cut}");
        }
        for byte in 0..good.len() {
            for v in [0x00, 0x01, 0x7f, 0x80, 0xff] {
                let mut f = good.clone();
                f[byte] = v;
                decode_round_trips(&f, &peer);
            }
        }
    }
    assert!(flips > 1000 && accepted > 0, "{flips} flips, {accepted} accepted");
}

// ---- Inputs too large to commit, built here. ----

fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(HEADER_LEN + payload.len());
    f.extend_from_slice(&MAGIC);
    f.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    f.push(kind);
    f.extend_from_slice(&u32::try_from(payload.len()).expect("fits u32").to_le_bytes());
    f.extend_from_slice(payload);
    f
}

#[test]
fn payloads_over_the_limits_are_too_large() {
    let peer = peer_layout();
    for (kind, max) in [(1u8, MAX_HANDSHAKE_PAYLOAD), (2, MAX_PAYLOAD), (3, MAX_PAYLOAD), (6, MAX_PAYLOAD)] {
        let f = frame(kind, &vec![0u8; max as usize + 1]);
        assert!(matches!(decode(&f, Some(&peer)), Err(DecodeError::TooLarge { .. })), "kind {kind}");
        assert!(matches!(frame_len(&f), Err(DecodeError::TooLarge { .. })), "kind {kind}");
    }
    // A payload of exactly the limit passes the header check; a heartbeat then has trailing bytes.
    let mut p = vec![0u8; MAX_PAYLOAD as usize];
    p[0] = 7;
    let f = frame(6, &p);
    assert_eq!(frame_len(&f), Ok(Some(f.len())));
    assert!(matches!(
        decode(&f, None),
        Err(DecodeError::TrailingBytes { extra, .. }) if extra == MAX_PAYLOAD as usize - 1
    ));
}

/// The encoding of `h` with its agent metadata (a run of 0xab bytes, found in the payload) replaced
/// by `len` bytes of 0xab. Postcard writes a byte vector as a varint length and the bytes.
fn handshake_with_metadata(len: usize) -> Vec<u8> {
    let mut h = peer_handshake();
    h.agent_metadata = vec![0xab; 4];
    let good = to_vec(&Message::Handshake(Box::new(h))).expect("encodes");
    let payload = &good[HEADER_LEN..];
    let at = payload.windows(5).position(|w| w == [4, 0xab, 0xab, 0xab, 0xab]).expect("metadata in payload");
    let mut p = payload[..at].to_vec();
    let mut n = len;
    while n >= 0x80 {
        p.push((n as u8 & 0x7f) | 0x80);
        n >>= 7;
    }
    p.push(n as u8);
    p.resize(p.len() + len, 0xab);
    p.extend_from_slice(&payload[at + 5..]);
    frame(1, &p)
}

#[test]
fn agent_metadata_over_its_limit_is_refused() {
    let at_limit = handshake_with_metadata(MAX_AGENT_METADATA);
    match decode(&at_limit, None) {
        Ok(Message::Handshake(h)) => assert_eq!(h.agent_metadata.len(), MAX_AGENT_METADATA),
        other => panic!("metadata at the limit: {other:?}"),
    }
    let over = handshake_with_metadata(MAX_AGENT_METADATA + 1);
    let e = decode(&over, None).expect_err("metadata over the limit");
    assert_eq!(describe(&e), ("Range", "TooLong:agent_metadata".to_string()), "{e}");
}

#[test]
fn limits_are_inclusive() {
    let peer = peer_layout();
    let rank = peer.parallel.rank();
    let r = Registration::new(KEY, "e".repeat(MAX_ENGINE_ID), rank, MAX_TOKENS, vec![vec![63], vec![0]], &peer)
        .expect("engine id and token count at their limits");
    let m = Message::Registration(r);
    assert_eq!(decode(&to_vec(&m).expect("encodes"), Some(&peer)), Ok(m));
    let f = Message::Failure(Failure { key: KEY, rank, kind: FailureKind::PeerLost, detail: "d".repeat(MAX_DETAIL) });
    assert_eq!(decode(&to_vec(&f).expect("encodes"), Some(&peer)), Ok(f));
    let a = Message::Abort(Abort { key: KEY, rank, reason: "r".repeat(MAX_DETAIL) });
    assert_eq!(decode(&to_vec(&a).expect("encodes"), Some(&peer)), Ok(a));
    let mut h = peer_handshake();
    h.engine_id = "e".repeat(MAX_ENGINE_ID);
    h.software = "s".repeat(MAX_ENGINE_ID);
    let h = Message::Handshake(Box::new(h));
    assert_eq!(decode(&to_vec(&h).expect("encodes"), None), Ok(h));
}
