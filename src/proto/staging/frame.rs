//! The staging frames: what a staged transfer's two sides say to each other over the data path's
//! notifications (docs in `transport::staged`). Every frame starts with [`MAGIC`], then its kind
//! byte and the transfer's tag (u64, little endian), then its kind's fields.
//!
//! Decoding is bounded: a REQUEST's notification and a FAIL's detail have fixed maxima, checked
//! before anything is copied, and a fixed-size frame with bytes after its last field is refused.

use crate::proto::msg::MAX_DETAIL;

/// First bytes of every staging notification (engine frames start with `KP`).
pub const MAGIC: [u8; 2] = *b"KS";

/// Longest notification a REQUEST carries (an engine frame: a completion or a layer range).
pub const MAX_NOTIF: usize = 64 << 10;

const REQUEST: u8 = 1;
const GRANT: u8 = 2;
const PIECE: u8 = 3;
const FAIL: u8 = 4;
const CANCEL: u8 = 5;
const CANCELLED: u8 = 6;
const DONE: u8 = 7;

/// A staging frame. `tag` names one staged transfer of one sender.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// Sender → receiver: a transfer of `pieces` pieces; `notif` is delivered once all landed.
    Request {
        /// The transfer.
        tag: u64,
        /// How many pieces (at least 1).
        pieces: u32,
        /// The sender's notification, delivered after the last scatter.
        notif: Vec<u8>,
    },
    /// Receiver → sender: piece `piece` may be written into receive slot `slot` at `addr`.
    Grant {
        /// The transfer.
        tag: u64,
        /// The piece.
        piece: u32,
        /// The receive slot.
        slot: u32,
        /// The slot's address in the receiver's memory.
        addr: u64,
    },
    /// Sender → receiver (the WRITE's own notification): piece `piece` landed in `slot`.
    Piece {
        /// The transfer.
        tag: u64,
        /// The piece.
        piece: u32,
        /// The receive slot it was written into.
        slot: u32,
        /// Table entries.
        entries: u32,
        /// Data bytes.
        bytes: u64,
    },
    /// Receiver → sender: the receiver failed the transfer.
    Fail {
        /// The transfer.
        tag: u64,
        /// Why (at most [`MAX_DETAIL`] bytes).
        detail: String,
    },
    /// Sender → receiver: nothing of the transfer is in flight any more; free its slots.
    Cancel {
        /// The transfer.
        tag: u64,
    },
    /// Receiver → sender: the cancel is done; nothing of the transfer is in a slot.
    Cancelled {
        /// The transfer.
        tag: u64,
    },
    /// Receiver → sender: every piece scattered, the notification delivered.
    Done {
        /// The transfer.
        tag: u64,
    },
}

/// Why a staging frame (magic `KS`) was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// Shorter than its kind's fixed fields.
    #[error("staging frame of kind {kind} is cut short")]
    Truncated {
        /// The frame's kind byte.
        kind: u8,
    },
    /// A kind this version does not know.
    #[error("unknown staging frame kind {0}")]
    UnknownKind(u8),
    /// Bytes after a fixed-size frame's last field.
    #[error("staging frame of kind {kind} has {extra} trailing bytes")]
    Trailing {
        /// The frame's kind byte.
        kind: u8,
        /// How many.
        extra: usize,
    },
    /// A variable-length field longer than its maximum.
    #[error("staging frame of kind {kind}: {field} of {len} bytes, at most {max}")]
    TooLong {
        /// The frame's kind byte.
        kind: u8,
        /// Which field.
        field: &'static str,
        /// Its length.
        len: usize,
        /// Its maximum.
        max: usize,
    },
    /// A REQUEST of no pieces.
    #[error("staging REQUEST of 0 pieces")]
    NoPieces,
}

/// Reads little-endian fields off the front of a byte string.
pub(crate) struct Reader<'a>(pub(crate) &'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }

    /// A u32, or `None` when fewer than 4 bytes are left.
    pub(crate) fn u32(&mut self) -> Option<u32> {
        self.take(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A u64, or `None` when fewer than 8 bytes are left.
    pub(crate) fn u64(&mut self) -> Option<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Some(u64::from_le_bytes(a))
    }

    /// Everything left, at most `max` bytes.
    fn rest(&mut self, kind: u8, field: &'static str, max: usize) -> Result<&'a [u8], FrameError> {
        let len = self.0.len();
        if len > max {
            return Err(FrameError::TooLong { kind, field, len, max });
        }
        Ok(std::mem::take(&mut self.0))
    }
}

fn header(kind: u8, tag: u64, extra: usize) -> Vec<u8> {
    let mut f = Vec::with_capacity(11 + extra);
    f.extend_from_slice(&MAGIC);
    f.push(kind);
    f.extend_from_slice(&tag.to_le_bytes());
    f
}

/// `s` cut to at most `max` bytes at a character boundary.
fn clip(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl Frame {
    /// The frame's bytes. A FAIL's detail is cut to [`MAX_DETAIL`] bytes; a REQUEST's notification
    /// must be at most [`MAX_NOTIF`] bytes (the receiver refuses a longer one).
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Frame::Request { tag, pieces, notif } => {
                let mut f = header(REQUEST, *tag, 4 + notif.len());
                f.extend_from_slice(&pieces.to_le_bytes());
                f.extend_from_slice(notif);
                f
            }
            Frame::Grant { tag, piece, slot, addr } => {
                let mut f = header(GRANT, *tag, 16);
                f.extend_from_slice(&piece.to_le_bytes());
                f.extend_from_slice(&slot.to_le_bytes());
                f.extend_from_slice(&addr.to_le_bytes());
                f
            }
            Frame::Piece { tag, piece, slot, entries, bytes } => {
                let mut f = header(PIECE, *tag, 20);
                f.extend_from_slice(&piece.to_le_bytes());
                f.extend_from_slice(&slot.to_le_bytes());
                f.extend_from_slice(&entries.to_le_bytes());
                f.extend_from_slice(&bytes.to_le_bytes());
                f
            }
            Frame::Fail { tag, detail } => {
                let detail = clip(detail, MAX_DETAIL);
                let mut f = header(FAIL, *tag, detail.len());
                f.extend_from_slice(detail.as_bytes());
                f
            }
            Frame::Cancel { tag } => header(CANCEL, *tag, 0),
            Frame::Cancelled { tag } => header(CANCELLED, *tag, 0),
            Frame::Done { tag } => header(DONE, *tag, 0),
        }
    }

    /// `None`: not a staging frame (no [`MAGIC`]). `Some(Err)`: a malformed one.
    pub fn decode(msg: &[u8]) -> Option<Result<Frame, FrameError>> {
        if msg.len() < 3 || msg[..2] != MAGIC {
            return None;
        }
        let kind = msg[2];
        let mut r = Reader(&msg[3..]);
        let truncated = FrameError::Truncated { kind };
        let parsed = (|| {
            let tag = r.u64().ok_or(truncated)?;
            let f = match kind {
                REQUEST => {
                    let pieces = r.u32().ok_or(truncated)?;
                    let notif = r.rest(kind, "notification", MAX_NOTIF)?.to_vec();
                    if pieces == 0 {
                        return Err(FrameError::NoPieces);
                    }
                    Frame::Request { tag, pieces, notif }
                }
                GRANT => Frame::Grant {
                    tag,
                    piece: r.u32().ok_or(truncated)?,
                    slot: r.u32().ok_or(truncated)?,
                    addr: r.u64().ok_or(truncated)?,
                },
                PIECE => Frame::Piece {
                    tag,
                    piece: r.u32().ok_or(truncated)?,
                    slot: r.u32().ok_or(truncated)?,
                    entries: r.u32().ok_or(truncated)?,
                    bytes: r.u64().ok_or(truncated)?,
                },
                FAIL => {
                    let detail = String::from_utf8_lossy(r.rest(kind, "detail", MAX_DETAIL)?).into_owned();
                    Frame::Fail { tag, detail }
                }
                CANCEL => Frame::Cancel { tag },
                CANCELLED => Frame::Cancelled { tag },
                DONE => Frame::Done { tag },
                _ => return Err(FrameError::UnknownKind(kind)),
            };
            match r.0.len() {
                0 => Ok(f),
                extra => Err(FrameError::Trailing { kind, extra }),
            }
        })();
        Some(parsed)
    }

    /// The transfer the frame is about.
    pub fn tag(&self) -> u64 {
        match self {
            Frame::Request { tag, .. }
            | Frame::Grant { tag, .. }
            | Frame::Piece { tag, .. }
            | Frame::Fail { tag, .. }
            | Frame::Cancel { tag }
            | Frame::Cancelled { tag }
            | Frame::Done { tag } => *tag,
        }
    }

    /// Whether the frame goes to a transfer's sender (from its receiver).
    pub fn to_sender(&self) -> bool {
        matches!(self, Frame::Grant { .. } | Frame::Fail { .. } | Frame::Cancelled { .. } | Frame::Done { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Expected bytes written from the layout above, not from `encode`.
    #[test]
    fn frames_have_their_documented_bytes() {
        let tag7 = [7, 0, 0, 0, 0, 0, 0, 0];
        let mut grant = b"KS\x02".to_vec();
        grant.extend_from_slice(&tag7);
        grant.extend_from_slice(&[2, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0xad, 0xde, 0, 0, 0, 0]);
        assert_eq!(Frame::Grant { tag: 7, piece: 2, slot: 1, addr: 0xdead_0000 }.encode(), grant);
        let mut req = b"KS\x01".to_vec();
        req.extend_from_slice(&tag7);
        req.extend_from_slice(&[3, 0, 0, 0]);
        req.extend_from_slice(b"KPx");
        assert_eq!(Frame::Request { tag: 7, pieces: 3, notif: b"KPx".to_vec() }.encode(), req);
        let mut done = b"KS\x07".to_vec();
        done.extend_from_slice(&tag7);
        assert_eq!(Frame::decode(&done), Some(Ok(Frame::Done { tag: 7 })));
    }

    #[test]
    fn frames_round_trip_and_malformed_ones_are_refused() {
        let frames = [
            Frame::Request { tag: 7, pieces: 3, notif: b"KP-completion".to_vec() },
            Frame::Grant { tag: 7, piece: 2, slot: 1, addr: 0xdead_0000 },
            Frame::Piece { tag: 7, piece: 2, slot: 1, entries: 99, bytes: 4096 * 99 },
            Frame::Fail { tag: 7, detail: "entry 3 outside registered memory".into() },
            Frame::Cancel { tag: 7 },
            Frame::Cancelled { tag: 7 },
            Frame::Done { tag: 7 },
        ];
        for f in frames {
            let b = f.encode();
            assert_eq!(Frame::decode(&b), Some(Ok(f.clone())));
            assert_eq!(Frame::decode(&b).and_then(Result::ok).map(|g| g.tag()), Some(7));
            // Cut short: malformed (frames with a free-form tail only once the fixed part is cut).
            let fixed = match f {
                Frame::Request { .. } => 15,
                Frame::Fail { .. } => 11,
                _ => b.len(),
            };
            assert!(matches!(Frame::decode(&b[..fixed - 1]), Some(Err(FrameError::Truncated { .. }))), "{b:?}");
        }
        assert_eq!(Frame::decode(b"KP\x01rest"), None, "engine frames pass through");
        assert_eq!(Frame::decode(b"KS\x09\0\0\0\0\0\0\0\0"), Some(Err(FrameError::UnknownKind(9))), "unknown kind");
        let mut long = Frame::Cancel { tag: 1 }.encode();
        long.push(0);
        assert!(matches!(Frame::decode(&long), Some(Err(FrameError::Trailing { extra: 1, .. }))), "trailing bytes");
    }

    #[test]
    fn long_fields_are_refused_before_they_are_copied_and_cut_when_sent() {
        let huge = Frame::Request { tag: 1, pieces: 1, notif: vec![0; MAX_NOTIF + 1] }.encode();
        let want = FrameError::TooLong { kind: REQUEST, field: "notification", len: MAX_NOTIF + 1, max: MAX_NOTIF };
        assert_eq!(Frame::decode(&huge), Some(Err(want)));
        let none = Frame::Request { tag: 1, pieces: 0, notif: vec![] }.encode();
        assert_eq!(Frame::decode(&none), Some(Err(FrameError::NoPieces)));
        // A detail over the bound is cut at a character boundary when encoded ("é" is 2 bytes).
        let f = Frame::Fail { tag: 1, detail: "é".repeat(MAX_DETAIL) }.encode();
        assert_eq!(f.len(), 11 + MAX_DETAIL);
        let mut raw = f[..11].to_vec();
        raw.extend(std::iter::repeat_n(b'x', MAX_DETAIL + 1));
        assert!(matches!(Frame::decode(&raw), Some(Err(FrameError::TooLong { field: "detail", .. }))));
    }
}
