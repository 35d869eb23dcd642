//! Versioned binary framing of [`Message`]s with a hard size limit.
//!
//! A frame is a fixed 9-byte header followed by a postcard-encoded payload (block-id lists, in
//! registrations and grants, in their own compact form: [`super::idlist`]):
//!
//! ```text
//! offset 0  2 bytes  magic "KP"
//! offset 2  2 bytes  protocol version, little endian (PROTOCOL_VERSION)
//! offset 4  1 byte   message kind (Kind)
//! offset 5  4 bytes  payload length, little endian (<= the kind's limit)
//! offset 9  payload  postcard (serde) encoding of the message's wire form; registrations and grants
//!                    written by hand in the same format, their block lists as runs or deltas
//! ```
//!
//! [`decode`] never panics and allocates in proportion to the frame it is given: the header's length
//! and the per-kind limit are checked before the payload is parsed, every list whose elements may be
//! empty is length-bounded before it is read (`bounded`), trailing bytes are refused, and the
//! decoded value is range-checked (a handshake's layout is validated and its compatibility hash
//! recomputed; a registration is checked against the sender's layout; ranks against its sizes).
//! Stream readers call [`frame_len`] on the first [`HEADER_LEN`] bytes to learn how much to read.

use super::compat::compat_hash;
use super::idlist::{self, ListError, Reader};
use super::ids::{Key, Rank};
use super::layerwise::LayerCompletion;
use super::layout::KvLayout;
use super::layout::MAX_GROUPS;
use super::msg::{
    check_block_count, check_block_lists, check_len, Abort, Completion, Failure, Grant, Handshake, Heartbeat, Hold,
    Message, RangeError, Registration, MAX_AGENT_METADATA, MAX_BLOCK_IDS, MAX_DETAIL, MAX_ENGINE_ID, MAX_TOKENS,
};

/// Version of the wire format; a peer speaking another version is refused (docs/protocol.md §1,
/// "Versions": 2 added the Layers and Hold kinds and block-id lists as runs or deltas).
pub const PROTOCOL_VERSION: u16 = 2;
/// Bytes of the frame header.
pub const HEADER_LEN: usize = 9;
/// Frame magic.
pub const MAGIC: [u8; 2] = *b"KP";
/// Largest payload of a handshake frame.
pub const MAX_HANDSHAKE_PAYLOAD: u32 = 16 << 20;
/// Largest payload of any other frame.
pub const MAX_PAYLOAD: u32 = 4 << 20;

/// The message kind byte of a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// [`Handshake`].
    Handshake = 1,
    /// [`Registration`].
    Registration = 2,
    /// [`Completion`].
    Completion = 3,
    /// [`Failure`].
    Failure = 4,
    /// [`Abort`].
    Abort = 5,
    /// [`Heartbeat`].
    Heartbeat = 6,
    /// [`Grant`].
    Grant = 7,
    /// [`LayerCompletion`].
    Layers = 8,
    /// [`Hold`].
    Hold = 9,
}

impl Kind {
    fn from_byte(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Handshake,
            2 => Kind::Registration,
            3 => Kind::Completion,
            4 => Kind::Failure,
            5 => Kind::Abort,
            6 => Kind::Heartbeat,
            7 => Kind::Grant,
            8 => Kind::Layers,
            9 => Kind::Hold,
            _ => return None,
        })
    }

    /// Largest payload this kind may carry.
    pub fn max_payload(self) -> u32 {
        match self {
            Kind::Handshake => MAX_HANDSHAKE_PAYLOAD,
            _ => MAX_PAYLOAD,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Handshake => "handshake",
            Kind::Registration => "registration",
            Kind::Completion => "completion",
            Kind::Failure => "failure",
            Kind::Abort => "abort",
            Kind::Heartbeat => "heartbeat",
            Kind::Grant => "grant",
            Kind::Layers => "layers",
            Kind::Hold => "hold",
        }
    }
}

/// Why bytes are not a valid message. Every malformed input maps to one of these, never a panic.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Fewer bytes than the header or its declared length.
    #[error("truncated frame: {got} bytes, {needed} needed")]
    Truncated {
        /// Bytes needed.
        needed: usize,
        /// Bytes present.
        got: usize,
    },
    /// More bytes than the declared length.
    #[error("{extra} trailing bytes after the {kind} frame")]
    TrailingBytes {
        /// Frame kind.
        kind: &'static str,
        /// Bytes beyond the frame (or beyond the payload's encoding).
        extra: usize,
    },
    /// The magic is not "KP".
    #[error("not a kvpush frame (magic {0:02x?})")]
    BadMagic([u8; 2]),
    /// The peer speaks another protocol version.
    #[error("unsupported protocol version {got} (this build speaks {supported})")]
    UnsupportedVersion {
        /// Version in the frame.
        got: u16,
        /// Version this build speaks.
        supported: u16,
    },
    /// The kind byte names no message.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// The declared length is above the kind's limit.
    #[error("{kind} frame of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Frame kind.
        kind: &'static str,
        /// Declared payload length.
        len: u64,
        /// The limit.
        max: u32,
    },
    /// The payload is not a valid encoding of the kind's wire form.
    #[error("malformed {kind} payload: {reason}")]
    Malformed {
        /// Frame kind.
        kind: &'static str,
        /// The parser's reason.
        reason: String,
    },
    /// A message that refers to the sender's layout arrived before its handshake.
    #[error("{kind} received before the peer's handshake")]
    NoPeerLayout {
        /// Frame kind.
        kind: &'static str,
    },
    /// A field is out of range for the layout it refers to.
    #[error("{kind} out of range: {source}")]
    Range {
        /// Frame kind.
        kind: &'static str,
        /// What is out of range.
        #[source]
        source: RangeError,
    },
    /// A handshake's compatibility hash does not match its own fields.
    #[error("handshake compatibility hash {declared:#018x} does not match its fields ({computed:#018x})")]
    HashMismatch {
        /// Hash the peer sent.
        declared: u64,
        /// Hash of the fields it sent.
        computed: u64,
    },
}

/// Why a message cannot be encoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// The encoded payload exceeds the kind's limit.
    #[error("{kind} payload of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Frame kind.
        kind: &'static str,
        /// Encoded length.
        len: usize,
        /// The limit.
        max: u32,
    },
    /// A field is out of range (it would be refused by the receiver).
    #[error("{kind} out of range: {source}")]
    Range {
        /// Frame kind.
        kind: &'static str,
        /// What is out of range.
        #[source]
        source: RangeError,
    },
    /// The serializer failed.
    #[error("cannot encode {kind}: {reason}")]
    Serialize {
        /// Frame kind.
        kind: &'static str,
        /// The serializer's reason.
        reason: String,
    },
}

fn kind_of(msg: &Message) -> Kind {
    match msg {
        Message::Handshake(_) => Kind::Handshake,
        Message::Registration(_) => Kind::Registration,
        Message::Completion(_) => Kind::Completion,
        Message::Failure(_) => Kind::Failure,
        Message::Abort(_) => Kind::Abort,
        Message::Heartbeat(_) => Kind::Heartbeat,
        Message::Grant(_) => Kind::Grant,
        Message::Layers(_) => Kind::Layers,
        Message::Hold(_) => Kind::Hold,
    }
}

/// Appends `msg` as one frame to `out` (which the caller owns and may reuse). On error `out` is
/// left as it was.
pub fn encode(msg: &Message, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    let kind = kind_of(msg);
    let name = kind.name();
    let range = |source| EncodeError::Range { kind: name, source };
    match msg {
        Message::Handshake(h) => check_handshake_fields(h).map_err(range)?,
        Message::Failure(f) => check_len("detail", f.detail.len(), MAX_DETAIL).map_err(range)?,
        Message::Abort(a) => check_len("reason", a.reason.len(), MAX_DETAIL).map_err(range)?,
        Message::Grant(g) => check_block_count(&g.block_ids).map_err(range)?,
        // A registration was checked when it was built.
        Message::Registration(_)
        | Message::Completion(_)
        | Message::Heartbeat(_)
        | Message::Layers(_)
        | Message::Hold(_) => {}
    }
    let start = out.len();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out.push(kind as u8);
    out.extend_from_slice(&[0; 4]);
    let serialized = match msg {
        // The frames that grow with the request: written directly, in postcard's format with
        // idlist's block lists, into room reserved from an upper bound of their size. Through serde
        // a 16k-token registration's 1024 block ids took 5.3 µs, 4× its decoding
        // (docs/benchmarks.md).
        Message::Registration(r) => {
            write_registration(r, out);
            Ok(())
        }
        Message::Grant(g) => {
            write_grant(g, out);
            Ok(())
        }
        Message::Handshake(h) => handshake_payload(h).map(|p| out.extend_from_slice(&p)),
        Message::Completion(c) => postcard::to_allocvec(c).map(|p| out.extend_from_slice(&p)),
        Message::Failure(f) => postcard::to_allocvec(f).map(|p| out.extend_from_slice(&p)),
        Message::Abort(a) => postcard::to_allocvec(a).map(|p| out.extend_from_slice(&p)),
        Message::Heartbeat(h) => postcard::to_allocvec(h).map(|p| out.extend_from_slice(&p)),
        Message::Layers(c) => postcard::to_allocvec(c).map(|p| out.extend_from_slice(&p)),
        Message::Hold(h) => postcard::to_allocvec(h).map(|p| out.extend_from_slice(&p)),
    };
    if let Err(e) = serialized {
        out.truncate(start);
        return Err(EncodeError::Serialize { kind: name, reason: e.to_string() });
    }
    let payload = out.len() - start - HEADER_LEN;
    let max = kind.max_payload();
    let Some(len) = u32::try_from(payload).ok().filter(|&l| l <= max) else {
        out.truncate(start);
        return Err(EncodeError::TooLarge { kind: name, len: payload, max });
    };
    out[start + 5..start + HEADER_LEN].copy_from_slice(&len.to_le_bytes());
    Ok(())
}

/// At least the bytes of a key, a rank, a token count and `lists` (varints of at most 19 bytes for
/// a u128, 10 for a u64 and lengths, 5 for a u32, 3 for a u16), plus `extra`.
fn bound(lists: &[Vec<u32>], extra: usize) -> usize {
    (19 + 5) + (3 + 3) + 10 + 10 + lists.iter().map(|l| idlist::bound(l)).sum::<usize>() + extra
}

fn write_key_rank(out: &mut Vec<u8>, key: Key, engine_id: Option<&str>, rank: Rank) {
    varint128(out, key.transfer_id.0);
    idlist::varint(out, key.attempt.0.into());
    if let Some(id) = engine_id {
        idlist::varint(out, id.len() as u64);
        out.extend_from_slice(id.as_bytes());
    }
    idlist::varint(out, rank.tp.into());
    idlist::varint(out, rank.pp.into());
}

fn write_block_lists(out: &mut Vec<u8>, lists: &[Vec<u32>]) {
    idlist::varint(out, lists.len() as u64);
    for ids in lists {
        idlist::write(out, ids);
    }
}

/// Appends `r`'s payload: key, engine id, rank and token count as postcard writes them (every
/// integer above a byte and every length a varint, the engine id's bytes after its length), then
/// the list count and each list in idlist's form.
fn write_registration(r: &Registration, out: &mut Vec<u8>) {
    out.reserve(bound(r.block_ids(), 10 + r.engine_id().len()));
    write_key_rank(out, r.key(), Some(r.engine_id()), r.rank());
    idlist::varint(out, r.num_tokens());
    write_block_lists(out, r.block_ids());
}

/// Appends `g`'s payload: key, rank, token count, then the lists as a registration's.
fn write_grant(g: &Grant, out: &mut Vec<u8>) {
    out.reserve(bound(&g.block_ids, 0));
    write_key_rank(out, g.key, None, g.rank);
    idlist::varint(out, g.num_tokens);
    write_block_lists(out, &g.block_ids);
}

/// Appends a u128 as postcard's varint.
fn varint128(out: &mut Vec<u8>, mut v: u128) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn read_key(r: &mut Reader<'_>) -> Result<Key, ListError> {
    let transfer_id = r.varint(128, "the transfer id")?;
    Ok(Key::new(transfer_id, r.u32("the attempt")?))
}

fn read_rank(r: &mut Reader<'_>) -> Result<Rank, ListError> {
    Ok(Rank::new(r.u16("the TP rank")?, r.u16("the PP rank")?))
}

/// The list count (at most [`MAX_GROUPS`]) and the lists, [`MAX_BLOCK_IDS`] ids in all at most:
/// what a frame can make the decoder allocate, however few bytes it has.
fn read_block_lists(r: &mut Reader<'_>) -> Result<Vec<Vec<u32>>, String> {
    let n = r.u64("the block list count").map_err(|e| e.to_string())?;
    if n > MAX_GROUPS as u64 {
        return Err(format!("{n} block lists, more than the {MAX_GROUPS} KV groups a layout may have"));
    }
    let mut lists = Vec::with_capacity(n as usize);
    let mut left = MAX_BLOCK_IDS;
    for _ in 0..n {
        let ids = r.list(left).map_err(|e| e.to_string())?;
        left -= ids.len() as u64;
        lists.push(ids);
    }
    Ok(lists)
}

/// Refuses bytes after a hand-read payload.
fn finish(kind: Kind, r: &Reader<'_>) -> Result<(), DecodeError> {
    match r.rest().len() {
        0 => Ok(()),
        extra => Err(DecodeError::TrailingBytes { kind: kind.name(), extra }),
    }
}

/// Encodes `msg` into a new buffer.
pub fn to_vec(msg: &Message) -> Result<Vec<u8>, EncodeError> {
    let mut out = Vec::new();
    encode(msg, &mut out)?;
    Ok(out)
}

/// Given at least [`HEADER_LEN`] bytes of a stream, the total length of the frame they start,
/// after checking magic, version, kind and the size limit. `Ok(None)` if fewer bytes are present.
pub fn frame_len(header: &[u8]) -> Result<Option<usize>, DecodeError> {
    if header.len() < HEADER_LEN {
        return Ok(None);
    }
    let (_, len) = parse_header(header)?;
    Ok(Some(HEADER_LEN + len))
}

fn parse_header(bytes: &[u8]) -> Result<(Kind, usize), DecodeError> {
    if bytes.len() < HEADER_LEN {
        return Err(DecodeError::Truncated { needed: HEADER_LEN, got: bytes.len() });
    }
    let magic = [bytes[0], bytes[1]];
    if magic != MAGIC {
        return Err(DecodeError::BadMagic(magic));
    }
    let version = u16::from_le_bytes([bytes[2], bytes[3]]);
    if version != PROTOCOL_VERSION {
        return Err(DecodeError::UnsupportedVersion { got: version, supported: PROTOCOL_VERSION });
    }
    let kind = Kind::from_byte(bytes[4]).ok_or(DecodeError::UnknownKind(bytes[4]))?;
    let len = u32::from_le_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]);
    if len > kind.max_payload() {
        return Err(DecodeError::TooLarge { kind: kind.name(), len: len.into(), max: kind.max_payload() });
    }
    Ok((kind, len as usize))
}

fn parse<'a, T: serde::Deserialize<'a>>(kind: Kind, payload: &'a [u8]) -> Result<T, DecodeError> {
    let (value, rest) = postcard::take_from_bytes::<T>(payload)
        .map_err(|e| DecodeError::Malformed { kind: kind.name(), reason: e.to_string() })?;
    if !rest.is_empty() {
        return Err(DecodeError::TrailingBytes { kind: kind.name(), extra: rest.len() });
    }
    Ok(value)
}

/// Tag of the memory-offer extension after a handshake's `compat_hash`.
const EXT_MEMORY_OFFER: u8 = 1;

/// A handshake's payload: its fields, then the memory offer's extension where it has one (an older
/// peer's handshake has none, so an offer-less handshake is byte for byte what it always was).
fn handshake_payload(h: &Handshake) -> Result<Vec<u8>, postcard::Error> {
    let mut out = postcard::to_allocvec(h)?;
    if let Some(offer) = &h.memory {
        out.push(EXT_MEMORY_OFFER);
        out.extend_from_slice(&postcard::to_allocvec(offer)?);
    }
    Ok(out)
}

/// Parses a handshake payload: the fields, then at most one extension (the memory offer). Bytes
/// after the fields that do not start with a known extension's tag are trailing bytes.
fn parse_handshake(payload: &[u8]) -> Result<Handshake, DecodeError> {
    let name = Kind::Handshake.name();
    let malformed = |reason: String| DecodeError::Malformed { kind: name, reason };
    let (mut h, rest) = postcard::take_from_bytes::<Handshake>(payload).map_err(|e| malformed(e.to_string()))?;
    match rest.split_first() {
        None => {}
        Some((&EXT_MEMORY_OFFER, offer)) => h.memory = Some(parse(Kind::Handshake, offer)?),
        // Not an extension this build knows: bytes after the handshake, as before extensions existed.
        Some(_) => return Err(DecodeError::TrailingBytes { kind: name, extra: rest.len() }),
    }
    Ok(h)
}

fn check_handshake_fields(h: &Handshake) -> Result<(), RangeError> {
    check_len("engine_id", h.engine_id.len(), MAX_ENGINE_ID)?;
    check_len("software", h.software.len(), MAX_ENGINE_ID)?;
    check_len("agent_metadata", h.agent_metadata.len(), MAX_AGENT_METADATA)?;
    h.layout.validate()?;
    Ok(())
}

fn check_rank(rank: Rank, peer: &KvLayout) -> Result<(), RangeError> {
    let expected = peer.parallel.rank();
    if rank != expected {
        return Err(RangeError::Rank { got: rank, expected });
    }
    Ok(())
}

/// Decodes exactly one frame. `peer` is the sender's layout from its handshake (`None` before it);
/// every message except a handshake or heartbeat is checked against it.
pub fn decode(bytes: &[u8], peer: Option<&KvLayout>) -> Result<Message, DecodeError> {
    let (kind, len) = parse_header(bytes)?;
    let total = HEADER_LEN + len;
    if bytes.len() < total {
        return Err(DecodeError::Truncated { needed: total, got: bytes.len() });
    }
    if bytes.len() > total {
        return Err(DecodeError::TrailingBytes { kind: kind.name(), extra: bytes.len() - total });
    }
    let payload = &bytes[HEADER_LEN..];
    let name = kind.name();
    let range = |source| DecodeError::Range { kind: name, source };
    let need_peer = || peer.ok_or(DecodeError::NoPeerLayout { kind: name });
    Ok(match kind {
        Kind::Handshake => {
            let h = parse_handshake(payload)?;
            check_handshake_fields(&h).map_err(range)?;
            let computed = compat_hash(&h.layout.model, h.layout.order, h.mode, h.protocol);
            if computed != h.compat_hash {
                return Err(DecodeError::HashMismatch { declared: h.compat_hash, computed });
            }
            Message::Handshake(Box::new(h))
        }
        Kind::Registration => {
            // The peer first: nothing is parsed for a peer that has not handshaken.
            let layout = need_peer()?;
            let malformed = |reason: String| DecodeError::Malformed { kind: name, reason };
            let mut r = Reader::new(payload);
            let key = read_key(&mut r).map_err(|e| malformed(e.to_string()))?;
            let engine_id = r.string("the engine id").map_err(|e| malformed(e.to_string()))?;
            let rank = read_rank(&mut r).map_err(|e| malformed(e.to_string()))?;
            let num_tokens = r.u64("the token count").map_err(|e| malformed(e.to_string()))?;
            let block_ids = read_block_lists(&mut r).map_err(malformed)?;
            finish(kind, &r)?;
            let r = Registration::new(key, engine_id, rank, num_tokens, block_ids, layout).map_err(range)?;
            Message::Registration(r)
        }
        Kind::Completion => {
            let c: Completion = parse(kind, payload)?;
            check_rank(c.rank, need_peer()?).map_err(range)?;
            Message::Completion(c)
        }
        Kind::Failure => {
            let f: Failure = parse(kind, payload)?;
            check_len("detail", f.detail.len(), MAX_DETAIL).map_err(range)?;
            check_rank(f.rank, need_peer()?).map_err(range)?;
            Message::Failure(f)
        }
        Kind::Abort => {
            let a: Abort = parse(kind, payload)?;
            check_len("reason", a.reason.len(), MAX_DETAIL).map_err(range)?;
            check_rank(a.rank, need_peer()?).map_err(range)?;
            Message::Abort(a)
        }
        Kind::Heartbeat => Message::Heartbeat(parse::<Heartbeat>(kind, payload)?),
        Kind::Hold => {
            let h: Hold = parse(kind, payload)?;
            check_rank(h.rank, need_peer()?).map_err(range)?;
            Message::Hold(h)
        }
        Kind::Grant => {
            let layout = need_peer()?;
            let malformed = |reason: String| DecodeError::Malformed { kind: name, reason };
            let mut r = Reader::new(payload);
            let key = read_key(&mut r).map_err(|e| malformed(e.to_string()))?;
            let rank = read_rank(&mut r).map_err(|e| malformed(e.to_string()))?;
            let num_tokens = r.u64("the token count").map_err(|e| malformed(e.to_string()))?;
            let block_ids = read_block_lists(&mut r).map_err(malformed)?;
            finish(kind, &r)?;
            let g = Grant { key, rank, num_tokens, block_ids };
            if g.num_tokens == 0 || g.num_tokens > MAX_TOKENS {
                let e = RangeError::OutOfRange { field: "num_tokens", value: g.num_tokens, limit: MAX_TOKENS };
                return Err(range(e));
            }
            check_rank(g.rank, layout).map_err(range)?;
            check_block_lists(&g.block_ids, g.num_tokens, layout).map_err(range)?;
            Message::Grant(g)
        }
        Kind::Layers => {
            let layout = need_peer()?;
            let c: LayerCompletion = parse(kind, payload)?;
            check_rank(c.rank, layout).map_err(range)?;
            c.check(layout).map_err(|e| range(e.into()))?;
            Message::Layers(c)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::layout::MAX_BLOCKS;
    use crate::proto::msg::{FailureKind, Mode};
    use crate::proto::testutil::{handshake, small_layout};

    fn all_messages() -> Vec<Message> {
        let l = small_layout();
        let rank = l.parallel.rank();
        let key = Key::new(0xdead_beef, 3);
        vec![
            Message::Handshake(Box::new(handshake(l.clone(), Mode::Push))),
            Message::Registration(
                Registration::new(key, "decode-0".into(), rank, 33, vec![vec![4, 5, 6], vec![9]], &l).expect("fits"),
            ),
            Message::Completion(Completion { key, rank }),
            Message::Grant(Grant { key, rank, num_tokens: 33, block_ids: vec![vec![4, 5, 6], vec![9]] }),
            Message::Failure(Failure {
                key,
                rank,
                kind: FailureKind::TransferFailed { status: -3 },
                detail: "post failed".into(),
            }),
            Message::Abort(Abort { key, rank, reason: "client went away".into() }),
            Message::Heartbeat(Heartbeat { seq: 42 }),
        ]
    }

    #[test]
    fn round_trip_every_message() {
        let l = small_layout();
        let mut buf = Vec::new();
        for m in all_messages() {
            buf.clear();
            encode(&m, &mut buf).expect("encodes");
            assert_eq!(frame_len(&buf).expect("header"), Some(buf.len()));
            let back = decode(&buf, Some(&l)).expect("decodes");
            assert_eq!(back, m);
        }
    }

    /// Block lists encoded as idlist writes them (checked against documented bytes there).
    fn lists_bytes(lists: &[Vec<u32>]) -> Vec<u8> {
        let mut out = vec![lists.len() as u8];
        for ids in lists {
            idlist::write(&mut out, ids);
        }
        out
    }

    #[test]
    fn registrations_and_grants_written_by_hand_are_postcards_fields_then_idlists() {
        // The widest values every varint can take: the hand-written encoder must write what postcard
        // writes for the fields before the lists, within the bound it reserves, and leave a reused
        // buffer's earlier bytes alone.
        let mut l = small_layout();
        l.num_blocks = u32::MAX;
        let id = "e".repeat(MAX_ENGINE_ID);
        // Block ids at every varint length (1 to 5 bytes) and its boundaries, and a run.
        let ids = vec![0, 127, 128, 16_383, 16_384, 2_097_152, u32::MAX - 1, 5, 6, 7];
        let tokens = ids.len() as u64 * u64::from(l.block_tokens);
        let blocks = vec![ids, vec![268_435_456, 300]];
        let key = Key::new(u128::MAX, u32::MAX);
        let rank = l.parallel.rank();
        let r = Registration::new(key, id.clone(), rank, tokens, blocks.clone(), &l).expect("fits");
        let mut expected = postcard::to_allocvec(&(key, &id, rank, tokens)).expect("postcard");
        expected.extend_from_slice(&lists_bytes(&blocks));
        let reserved = bound(&blocks, 10 + id.len());
        assert!(reserved >= expected.len(), "{reserved} < {}", expected.len());
        let mut buf = b"earlier".to_vec();
        encode(&Message::Registration(r.clone()), &mut buf).expect("encodes");
        assert_eq!(&buf[..7], b"earlier");
        assert_eq!(&buf[7 + 5..7 + HEADER_LEN], &(expected.len() as u32).to_le_bytes());
        assert_eq!(&buf[7 + HEADER_LEN..], &expected[..]);
        assert_eq!(decode(&buf[7..], Some(&l)).expect("decodes"), Message::Registration(r));

        let g = Grant { key, rank, num_tokens: tokens, block_ids: blocks.clone() };
        let mut expected = postcard::to_allocvec(&(key, rank, tokens)).expect("postcard");
        expected.extend_from_slice(&lists_bytes(&blocks));
        let buf = to_vec(&Message::Grant(g.clone())).expect("encodes");
        assert_eq!(&buf[HEADER_LEN..], &expected[..]);
        assert_eq!(decode(&buf, Some(&l)).expect("decodes"), Message::Grant(g));
    }

    #[test]
    fn a_frame_cannot_claim_more_block_ids_than_the_budget() {
        let mut l = small_layout();
        l.num_blocks = MAX_BLOCKS;
        let key = Key::new(1, 1);
        let rank = l.parallel.rank();
        let tokens = MAX_TOKENS;
        // At the budget: two runs of 2^19 ids each, a few bytes, decode to 2^20 ids.
        let half = (0..1u32 << 19).collect::<Vec<_>>();
        let ok = vec![half.clone(), half.clone()];
        let r = Registration::new(key, "d".into(), rank, tokens, ok.clone(), &l).expect("at the budget");
        let frame = to_vec(&Message::Registration(r)).expect("encodes");
        assert!(frame.len() < 40, "{} bytes", frame.len());
        let Ok(Message::Registration(back)) = decode(&frame, Some(&l)) else { panic!("decodes") };
        assert_eq!(back.block_ids(), &ok[..]);
        // One id more: refused when built, when a grant is encoded, and when a frame claims it
        // (before a byte of it is allocated).
        let over = vec![half.clone(), (0..(1u32 << 19) + 1).collect()];
        let e = Registration::new(key, "d".into(), rank, tokens, over.clone(), &l).expect_err("over");
        assert!(matches!(e, RangeError::OutOfRange { field: "block_ids", .. }), "{e:?}");
        let g = Message::Grant(Grant { key, rank, num_tokens: tokens, block_ids: over.clone() });
        assert!(matches!(to_vec(&g), Err(EncodeError::Range { .. })));
        let mut payload = postcard::to_allocvec(&(key, "d", rank, tokens)).expect("postcard");
        payload.extend_from_slice(&lists_bytes(&over));
        let mut frame = MAGIC.to_vec();
        frame.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        frame.push(Kind::Registration as u8);
        frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        frame.extend_from_slice(&payload);
        let e = decode(&frame, Some(&l)).expect_err("over the budget");
        assert!(
            matches!(&e, DecodeError::Malformed { reason, .. } if reason.contains("left of the frame's budget")),
            "{e}"
        );
        // More lists than groups can exist: refused on the count.
        let mut payload = postcard::to_allocvec(&(key, "d", rank, tokens)).expect("postcard");
        payload.push(65);
        frame.truncate(HEADER_LEN);
        frame[5..9].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        frame.extend_from_slice(&payload);
        assert!(matches!(decode(&frame, Some(&l)), Err(DecodeError::Malformed { .. })));
    }

    #[test]
    fn every_truncation_is_a_typed_error() {
        let l = small_layout();
        for m in all_messages() {
            let buf = to_vec(&m).expect("encodes");
            for cut in 0..buf.len() {
                let e = decode(&buf[..cut], Some(&l)).expect_err("truncated must fail");
                assert!(matches!(e, DecodeError::Truncated { .. }), "cut {cut} of {} gave {e:?}", buf.len());
            }
        }
    }

    #[test]
    fn header_faults() {
        let l = small_layout();
        let good = to_vec(&Message::Heartbeat(Heartbeat { seq: 1 })).expect("encodes");
        let mut b = good.clone();
        b[0] = b'X';
        assert!(matches!(decode(&b, None), Err(DecodeError::BadMagic(_))));
        let mut b = good.clone();
        b[2] = 9;
        assert!(matches!(decode(&b, None), Err(DecodeError::UnsupportedVersion { got: 9, supported: 2 })));
        let mut b = good.clone();
        b[4] = 77;
        assert_eq!(decode(&b, None), Err(DecodeError::UnknownKind(77)));
        let mut b = good.clone();
        b[5..9].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(decode(&b, None), Err(DecodeError::TooLarge { .. })));
        assert!(matches!(frame_len(&b), Err(DecodeError::TooLarge { .. })));
        let mut b = good.clone();
        b.push(0);
        assert!(matches!(decode(&b, None), Err(DecodeError::TrailingBytes { extra: 1, .. })));
        // A completion before the handshake has nothing to be checked against.
        let c = to_vec(&Message::Completion(Completion { key: Key::new(1, 1), rank: l.parallel.rank() })).unwrap();
        assert!(matches!(decode(&c, None), Err(DecodeError::NoPeerLayout { .. })));
    }

    #[test]
    fn grants_are_checked_against_the_producers_layout() {
        let l = small_layout(); // 64 blocks of 16 tokens, 2 groups
        let rank = l.parallel.rank();
        let grant = |num_tokens: u64, block_ids: Vec<Vec<u32>>| {
            to_vec(&Message::Grant(Grant { key: Key::new(3, 1), rank, num_tokens, block_ids })).expect("encodes")
        };
        assert!(decode(&grant(33, vec![vec![1, 2, 3], vec![4]]), Some(&l)).is_ok());
        let bad = [
            grant(33, vec![vec![1, 2, 3]]),           // one list for two groups
            grant(33, vec![vec![1, 2, 64], vec![4]]), // id beyond the pool
            grant(16, vec![vec![1, 2, 3], vec![4]]),  // more blocks than 16 tokens need
            grant(0, vec![vec![], vec![]]),           // no tokens
        ];
        for b in bad {
            assert!(matches!(decode(&b, Some(&l)), Err(DecodeError::Range { .. })), "{:?}", decode(&b, Some(&l)));
        }
        assert!(matches!(decode(&grant(33, vec![vec![1], vec![4]]), None), Err(DecodeError::NoPeerLayout { .. })));
    }

    #[test]
    fn forged_handshake_hash_is_refused() {
        let mut h = handshake(small_layout(), Mode::Pull);
        h.compat_hash ^= 1;
        let b = to_vec(&Message::Handshake(Box::new(h))).expect("encodes");
        assert!(matches!(decode(&b, None), Err(DecodeError::HashMismatch { .. })));
    }

    #[test]
    fn oversized_detail_is_refused_both_ways() {
        let l = small_layout();
        let f = Failure {
            key: Key::new(1, 1),
            rank: l.parallel.rank(),
            kind: FailureKind::Aborted,
            detail: "x".repeat(MAX_DETAIL + 1),
        };
        assert!(matches!(to_vec(&Message::Failure(f.clone())), Err(EncodeError::Range { .. })));
    }
}
