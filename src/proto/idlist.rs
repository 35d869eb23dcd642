//! Block-id lists on the wire: runs of consecutive ids where the list has them, zig-zag deltas
//! where it is fragmented (docs/protocol.md §1, "Block-id lists").
//!
//! A list is a head varint, `count << 1 | form`, then its body:
//!
//! - form 0, **runs**: runs until `count` ids are read, each a zig-zag varint of `first − prev`
//!   (`prev`: the last id of the previous run, 0 before the first) and a varint of
//!   `(len − 1) << 1 | descending`. A run is `first, first + 1, …` or, descending, `first, first − 1, …`.
//! - form 1, **deltas**: `count` zig-zag varints, each `id − prev` (`prev`: the previous id, 0 before
//!   the first).
//!
//! [`write`] cuts the list into maximal runs (greedily, left to right) and writes whichever form is
//! shorter (runs on a tie); [`read`] accepts either form and any cut into runs that adds up to the
//! count. vLLM hands out a fresh pool's blocks in ascending runs and reuses freed blocks in the
//! order they were freed, a request's own in reverse: descending runs.
//!
//! Reading is bounded: the count is checked against the caller's budget before anything is
//! allocated, a deltas body cannot claim more ids than it has bytes, a run cannot pass the end of
//! the count or leave `u32`, and the list is allocated once, at its count. This module never
//! panics on any input and does no range check against a layout (the caller's job).

/// Why bytes are not a block-id list (or a field around one).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ListError {
    /// The bytes end inside a field.
    #[error("{0} runs past the end of the payload")]
    Truncated(&'static str),
    /// A varint is longer than its type allows, or its value does not fit the type.
    #[error("{0} does not fit its type")]
    Overflow(&'static str),
    /// A list claims more ids than the budget left for the frame.
    #[error("a block list claims {count} ids, more than the {left} left of the frame's budget")]
    OverBudget {
        /// Ids the list claims.
        count: u64,
        /// Ids the frame may still carry.
        left: u64,
    },
    /// A deltas body claims more ids than it has bytes (each id takes at least one).
    #[error("a block list claims {count} deltas with {bytes} bytes left")]
    ShortBody {
        /// Ids the list claims.
        count: u64,
        /// Bytes left in the payload.
        bytes: usize,
    },
    /// A run passes the end of the list's count.
    #[error("a run of {len} ids passes the list's count by {over}")]
    RunPastCount {
        /// The run's length.
        len: u64,
        /// Ids beyond the count.
        over: u64,
    },
    /// An id (a run's end, a delta's sum) is outside `0..=u32::MAX`.
    #[error("block id {0} is outside 0..=u32::MAX")]
    IdOutOfU32(i128),
    /// A string field is not UTF-8.
    #[error("{0} is not UTF-8")]
    NotUtf8(&'static str),
}

/// A cursor over a payload, reading postcard's varints and the lists above.
#[derive(Debug)]
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes }
    }

    /// Bytes not read yet.
    pub(crate) fn rest(&self) -> &'a [u8] {
        self.bytes
    }

    /// A postcard varint of a type of `bits` bits (16, 32, 64 or 128): at most `ceil(bits / 7)`
    /// bytes, and a value that fits.
    pub(crate) fn varint(&mut self, bits: u32, what: &'static str) -> Result<u128, ListError> {
        let mut v: u128 = 0;
        for shift in (0..bits).step_by(7) {
            let Some((&b, rest)) = self.bytes.split_first() else {
                return Err(ListError::Truncated(what));
            };
            self.bytes = rest;
            let group = u128::from(b & 0x7f);
            // The last byte may only carry the bits the type has left.
            if bits - shift < 7 && group >> (bits - shift) != 0 {
                return Err(ListError::Overflow(what));
            }
            v |= group << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(ListError::Overflow(what))
    }

    pub(crate) fn u16(&mut self, what: &'static str) -> Result<u16, ListError> {
        self.varint(16, what).map(|v| v as u16)
    }

    pub(crate) fn u32(&mut self, what: &'static str) -> Result<u32, ListError> {
        self.varint(32, what).map(|v| v as u32)
    }

    pub(crate) fn u64(&mut self, what: &'static str) -> Result<u64, ListError> {
        // Most of a list's varints are one or two bytes (a delta of a fragmented list, a run's
        // first id and length): read in u64, without the general loop's 128-bit arithmetic. The
        // same rules as `varint(64, …)`: at most 10 bytes, the tenth carrying one bit.
        if let Some((&b, rest)) = self.bytes.split_first().filter(|(&b, _)| b < 0x80) {
            self.bytes = rest;
            return Ok(b.into());
        }
        let bytes = self.bytes;
        let mut v = 0u64;
        for (k, &b) in bytes.iter().take(10).enumerate() {
            v |= u64::from(b & 0x7f) << (7 * k);
            if b < 0x80 {
                if k == 9 && b > 1 {
                    break;
                }
                self.bytes = &bytes[k + 1..];
                return Ok(v);
            }
        }
        Err(if bytes.len() < 10 { ListError::Truncated(what) } else { ListError::Overflow(what) })
    }

    /// A length-prefixed UTF-8 string.
    pub(crate) fn string(&mut self, what: &'static str) -> Result<String, ListError> {
        let len = self.u64(what)?;
        let Some(len) = usize::try_from(len).ok().filter(|&l| l <= self.bytes.len()) else {
            return Err(ListError::Truncated(what));
        };
        let (s, rest) = self.bytes.split_at(len);
        self.bytes = rest;
        core::str::from_utf8(s).map(str::to_owned).map_err(|_| ListError::NotUtf8(what))
    }

    /// A zig-zag encoded `i64` varint.
    fn zigzag(&mut self, what: &'static str) -> Result<i64, ListError> {
        let v = self.u64(what)?;
        Ok((v >> 1) as i64 ^ -((v & 1) as i64))
    }

    /// One block-id list of at most `left` ids.
    pub(crate) fn list(&mut self, left: u64) -> Result<Vec<u32>, ListError> {
        let head = self.u64("a block list's head")?;
        let (count, deltas) = (head >> 1, head & 1 == 1);
        if count > left {
            return Err(ListError::OverBudget { count, left });
        }
        if deltas && count > self.bytes.len() as u64 {
            return Err(ListError::ShortBody { count, bytes: self.bytes.len() });
        }
        let count = count as usize; // at most `left`, the caller's budget of ids in memory
        let id = |v: i128| u32::try_from(v).map_err(|_| ListError::IdOutOfU32(v));
        if deltas {
            let mut ids = vec![0u32; count];
            // Sums in i128: a delta is any i64, so none of this overflows.
            let mut prev: i128 = 0;
            for slot in &mut ids {
                let next = id(prev + i128::from(self.zigzag("a block id delta")?))?;
                *slot = next;
                prev = next.into();
            }
            return Ok(ids);
        }
        // Room for a run's last block of lanes past the last id, cut off at the end.
        let mut ids = vec![0u32; count + SHORT_RUN];
        let (mut prev, mut got) = (0u32, 0usize);
        while got < count {
            let left = count - got;
            // Nearly every run of a reused pool's list is a one- or two-byte jump and a one-byte
            // length: read without a branch on those lengths; anything else (a longer field, an
            // error, the list's last bytes) takes the general reader from the same place.
            let (first, len, descending) = match self.short_run(prev, left) {
                Some(run) => run,
                None => self.run(prev, left)?,
            };
            // Every id from `first` to the run's last is in u32 (checked by either reader), so
            // `k < len <= 2^32` gives the run's ids exactly. A run is written as whole blocks of
            // lanes, the same stores whatever its length (the lanes past it are overwritten by the
            // next run or cut off at the end): no branch on the length but the loop's, taken once
            // for a run of at most 16 ids.
            let step = if descending { u32::MAX } else { 1 };
            for start in (0..len).step_by(SHORT_RUN) {
                // `got + start < count`, so the block ends within `count + SHORT_RUN`.
                if let Some(lanes) = ids.get_mut(got + start..).and_then(|s| s.first_chunk_mut::<SHORT_RUN>()) {
                    for (k, slot) in lanes.iter_mut().enumerate() {
                        *slot = first.wrapping_add(((start + k) as u32).wrapping_mul(step));
                    }
                }
            }
            prev = run_last(first, len, descending);
            got += len;
        }
        ids.truncate(count);
        Ok(ids)
    }

    /// The next run of a runs body, `(first, len, descending)`, when its two fields are one or two
    /// bytes each and at least 8 bytes are left: read from one 8-byte word, the fields' lengths
    /// taken from their continuation bits without a branch. `None` (nothing consumed) when that
    /// does not hold, or when the run is not valid (its ids leave u32, it passes `left`): then
    /// [`Reader::run`] reads it, and names the error.
    #[inline(always)]
    fn short_run(&mut self, prev: u32, left: usize) -> Option<(u32, usize, bool)> {
        let w = u64::from_le_bytes(*self.bytes.first_chunk::<8>()?);
        let (jump, jump_bytes, jump_long) = two_byte_varint(w);
        let (lens, lens_bytes, lens_long) = two_byte_varint(w >> (8 * jump_bytes));
        if jump_long | lens_long {
            return None;
        }
        // Under 2^14 each: the sums below are far from i64's ends.
        let delta = (jump >> 1) as i64 ^ -((jump & 1) as i64);
        let first = u32::try_from(i64::from(prev) + delta).ok()?;
        let (len, descending) = ((lens >> 1) as usize + 1, lens & 1 == 1);
        let span = (len - 1) as i64;
        let last = i64::from(first) + if descending { -span } else { span };
        if len > left || u32::try_from(last).is_err() {
            return None;
        }
        self.bytes = &self.bytes[(jump_bytes + lens_bytes) as usize..];
        Some((first, len, descending))
    }

    /// The next run of a runs body, `(first, len, descending)`, any varint lengths, every field
    /// checked: ids within u32, at most `left` ids.
    fn run(&mut self, prev: u32, left: usize) -> Result<(u32, usize, bool), ListError> {
        let id = |v: i128| u32::try_from(v).map_err(|_| ListError::IdOutOfU32(v));
        // Sums in i128: a delta is any i64, so none of this overflows.
        let first = id(i128::from(prev) + i128::from(self.zigzag("a run's first id")?))?;
        let lens = self.u64("a run's length")?;
        let (len, descending) = ((lens >> 1) + 1, lens & 1 == 1);
        let left = left as u64;
        if len > left {
            return Err(ListError::RunPastCount { len, over: len - left });
        }
        let span = i128::from(len - 1);
        id(if descending { i128::from(first) - span } else { i128::from(first) + span })?;
        // At most `left`, a usize.
        Ok((first, len as usize, descending))
    }
}

/// The varint at the low end of `w` if it is one or two bytes: `(value, bytes, longer)`, where
/// `longer` says it is three bytes or more (and the other two are then meaningless). No branch.
#[inline(always)]
fn two_byte_varint(w: u64) -> (u64, u64, bool) {
    let more = (w >> 7) & 1;
    let longer = (w >> 15) & more == 1;
    // The second byte's 7 bits, at bits 7..14, kept only when the first byte continues.
    let v = (w & 0x7f) | ((w >> 1) & 0x3f80 & more.wrapping_neg());
    (v, 1 + more, longer)
}

/// The lanes a run of at most this many ids is read into at once.
const SHORT_RUN: usize = 16;

/// Appends `v` as postcard's varint: 7 bits a byte, lowest first, the high bit set on all but the
/// last.
pub(crate) fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

#[cfg(test)]
fn varint_len(v: u64) -> usize {
    // 1 byte up to 7 bits, one more per 7 bits above.
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

fn zigzag(d: i64) -> u64 {
    ((d << 1) ^ (d >> 63)) as u64
}

/// The run's length field: `(len − 1) << 1 | descending`.
fn run_len(len: usize, descending: bool) -> u64 {
    ((len as u64 - 1) << 1) | u64::from(descending)
}

/// How many ids `ids` starts with that go on from `ids[0]` by `step` (`1`, or `u32::MAX` for −1)
/// without leaving `u32`: the run `ids[0]` starts. The first few ids are compared one at a time (a
/// reused pool's runs are a few ids long); past those, 16 at a time, which the compiler turns into
/// vector instructions, so a long run costs a fraction of a nanosecond an id.
fn run_from(ids: &[u32], step: u32) -> usize {
    let Some(&first) = ids.first() else { return 0 };
    // The longest run that stays in u32 from `first`: within it the wrapping sums below are exact.
    let room = if step == 1 { u32::MAX - first } else { first };
    let ids = &ids[..ids.len().min(usize::try_from(room).map_or(usize::MAX, |r| r.saturating_add(1)))];
    let at = |k: usize| first.wrapping_add((k as u32).wrapping_mul(step));
    const SHORT: usize = 8;
    let mut len = 1;
    while len < SHORT && ids.get(len).is_some_and(|&id| id == at(len)) {
        len += 1;
    }
    if len < SHORT {
        return len;
    }
    while let Some(chunk) = ids.get(len..len + LANES) {
        let base = at(len);
        let mut differ = 0;
        for (k, &id) in chunk.iter().enumerate() {
            differ |= id ^ base.wrapping_add((k as u32).wrapping_mul(step));
        }
        if differ != 0 {
            break;
        }
        len += LANES;
    }
    while ids.get(len).is_some_and(|&id| id == at(len)) {
        len += 1;
    }
    len
}

/// The next maximal run of `ids` (greedily from its start): `(len, descending)`.
///
/// Not found with one vector compare of the next 16 ids and a bit count: without AVX2 at compile
/// time that compare builds its mask from SSE2 shuffles, and a reused pool's list took 5.4 µs to
/// write instead of 1.5 µs (measured, docs/benchmarks.md).
///
/// One branch on the direction: the step from the first id to the second is +1 or −1 (`u32::MAX`)
/// or no run starts there. A step that wraps (`u32::MAX` then 0, or 0 then `u32::MAX`) finds no
/// room in [`run_from`]: a run of one, not descending.
fn next_run(ids: &[u32]) -> (usize, bool) {
    match ids {
        // `step + 1` is 2 for +1 and 0 for −1.
        [a, b, ..] if b.wrapping_sub(*a).wrapping_add(1) & !2 == 0 => {
            let step = b.wrapping_sub(*a);
            let len = run_from(ids, step);
            (len, step == u32::MAX && len > 1)
        }
        _ => (1, false),
    }
}

/// The last id of a run.
fn run_last(first: u32, len: usize, descending: bool) -> u32 {
    // `len` ids from `first` stay in u32 (next_run's runs, and ones read back after their check).
    let span = (len - 1) as u32;
    if descending {
        first - span
    } else {
        first + span
    }
}

/// Appends the deltas body of `ids`.
fn write_deltas(out: &mut Vec<u8>, ids: &[u32]) {
    let mut prev = 0i64;
    for &id in ids {
        varint(out, zigzag(i64::from(id) - prev));
        prev = id.into();
    }
}

/// Ids compared at once when looking for the end of a run.
const LANES: usize = 16;

/// Writes `v` as a varint at `buf[at..]`, which has room for it; returns the index after it.
///
/// A value under 2^14 (a reused pool's jumps and run lengths) is written as two bytes without a
/// branch on its length: the second is 0 when the varint is one byte, and is overwritten by the
/// next field or cut off with the room after the last one.
#[inline(always)]
fn put(buf: &mut [u8], mut at: usize, mut v: u64) -> usize {
    if v < 1 << 14 {
        if let Some(two) = buf.get_mut(at..at + 2) {
            let more = u8::from(v >= 0x80);
            two[0] = (v as u8 & 0x7f) | (more << 7);
            two[1] = (v >> 7) as u8;
            return at + 1 + usize::from(more);
        }
    }
    while v >= 0x80 {
        buf[at] = v as u8 | 0x80;
        v >>= 7;
        at += 1;
    }
    buf[at] = v as u8;
    at + 1
}

/// The most bytes one run takes: two varints of under 2^33 (a zig-zag `u32` difference, a length
/// field), 5 bytes each.
const MAX_RUN_BYTES: usize = 10;

/// At least the bytes [`write`] appends for `ids`.
pub(crate) fn bound(ids: &[u32]) -> usize {
    // Head, then at most 5 bytes a delta (a delta of a u32 zig-zags to under 2^33).
    10 + 5 * ids.len()
}

/// Appends `ids` as one list, in the shorter form (runs on a tie).
///
/// One pass over the ids: runs are found (a few ids compared one at a time, then 16 at a time) and
/// written as they are found, straight into `out`, and the deltas body's length is counted beside
/// them at no cost: inside a run every delta is ±1, one byte, and a run's first delta is its first
/// id's difference, which the runs form writes too. So a list is written once, and written again
/// as deltas only when those come out shorter (a list of mostly single ids). Byte for byte what
/// measuring both forms first wrote (`tests::the_one_pass_writer_writes_what_measuring_both_did`).
pub(crate) fn write(out: &mut Vec<u8>, ids: &[u32]) {
    let count = ids.len() as u64;
    if ids.is_empty() {
        out.push(0);
        return;
    }
    let head = out.len();
    // The deltas form's head differs in its lowest bit only: the same length, set below if chosen.
    varint(out, count << 1);
    let body = out.len();
    // Written by index into room made ahead (a few runs at a time), not pushed byte by byte.
    let mut at = body;
    let (mut i, mut prev, mut deltas_len) = (0, 0i64, 0usize);
    while i < ids.len() {
        if out.len() - at < MAX_RUN_BYTES {
            out.resize(out.len() + MAX_RUN_BYTES * (ids.len() - i).min(64), 0);
        }
        let first = ids[i];
        let (len, descending) = next_run(&ids[i..]);
        let jump = zigzag(i64::from(first) - prev);
        let jump_at = at;
        at = put(out, at, jump);
        deltas_len += (at - jump_at) + (len - 1);
        at = put(out, at, run_len(len, descending));
        prev = run_last(first, len, descending).into();
        i += len;
    }
    out.truncate(at);
    if deltas_len < at - body {
        out.truncate(body);
        out[head] |= 1;
        out.reserve(deltas_len);
        write_deltas(out, ids);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The maximal runs of `ids`, greedily from the left, `(first, len, descending)`, found one id
    /// at a time: the reference [`write`]'s runs are checked against.
    fn runs(ids: &[u32]) -> impl Iterator<Item = (u32, usize, bool)> + '_ {
        let mut i = 0;
        core::iter::from_fn(move || {
            let &first = ids.get(i)?;
            let next = ids.get(i + 1).copied();
            let descending = next.is_some() && next == first.checked_sub(1);
            let step = |a: u32| if descending { a.checked_sub(1) } else { a.checked_add(1) };
            let mut len = 1;
            while ids.get(i + len).is_some_and(|&b| Some(b) == step(ids[i + len - 1])) {
                len += 1;
            }
            i += len;
            Some((first, len, descending && len > 1))
        })
    }

    /// Bytes of the deltas body of `ids`.
    fn deltas_len(ids: &[u32]) -> usize {
        let mut prev = 0i64;
        ids.iter()
            .map(|&id| {
                let d = varint_len(zigzag(i64::from(id) - prev));
                prev = id.into();
                d
            })
            .sum()
    }

    /// Bytes of the two bodies of `ids`, (runs, deltas), measured apart.
    fn body_lens(ids: &[u32]) -> (usize, usize) {
        let (mut prev, mut runs_len) = (0i64, 0);
        for (first, len, descending) in runs(ids) {
            runs_len += varint_len(zigzag(i64::from(first) - prev)) + varint_len(run_len(len, descending));
            prev = run_last(first, len, descending).into();
        }
        (runs_len, deltas_len(ids))
    }

    /// The list as the module's description says, from [`runs`] and [`body_lens`]: both forms
    /// measured, then the shorter written (runs on a tie).
    fn write_measuring_both(ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::new();
        let count = ids.len() as u64;
        if ids.is_empty() {
            return vec![0];
        }
        let (runs_len, deltas_len) = body_lens(ids);
        if deltas_len < runs_len {
            varint(&mut out, count << 1 | 1);
            write_deltas(&mut out, ids);
            return out;
        }
        varint(&mut out, count << 1);
        let mut prev = 0i64;
        for (first, len, descending) in runs(ids) {
            varint(&mut out, zigzag(i64::from(first) - prev));
            varint(&mut out, run_len(len, descending));
            prev = run_last(first, len, descending).into();
        }
        out
    }

    /// A list read, or why not, and the bytes after it.
    type ListRead<'a> = (Result<Vec<u32>, ListError>, &'a [u8]);

    /// A runs-form list as read before the one-word fast path (session 12): one run at a time,
    /// every field through the general varint reader, sums in i128; `None` for a deltas-form list
    /// (its reader did not change). The reference [`Reader::list`] is checked against, error for
    /// error, with the bytes left after a list.
    fn runs_one_at_a_time(bytes: &[u8], left: u64) -> Option<ListRead<'_>> {
        let mut r = Reader::new(bytes);
        let head = match r.u64("a block list's head") {
            Ok(head) if head & 1 == 1 => return None,
            Ok(head) => head,
            Err(e) => return Some((Err(e), r.rest())),
        };
        let count = head >> 1;
        if count > left {
            return Some((Err(ListError::OverBudget { count, left }), r.rest()));
        }
        let id = |v: i128| u32::try_from(v).map_err(|_| ListError::IdOutOfU32(v));
        let mut body = || {
            let (mut ids, mut prev) = (Vec::new(), 0i128);
            while (ids.len() as u64) < count {
                let first = id(prev + i128::from(r.zigzag("a run's first id")?))?;
                let lens = r.u64("a run's length")?;
                let (len, descending) = ((lens >> 1) + 1, lens & 1 == 1);
                let left = count - ids.len() as u64;
                if len > left {
                    return Err(ListError::RunPastCount { len, over: len - left });
                }
                let span = i128::from(len - 1);
                let last = id(if descending { i128::from(first) - span } else { i128::from(first) + span })?;
                for k in 0..len as u32 {
                    ids.push(if descending { first - k } else { first + k });
                }
                prev = last.into();
            }
            Ok(ids)
        };
        let ids = body();
        Some((ids, r.rest()))
    }

    /// [`Reader::list`] reads what [`runs_one_at_a_time`] reads.
    fn reads_as_before(bytes: &[u8], left: u64) -> Result<(), TestCaseError> {
        let Some((want, want_rest)) = runs_one_at_a_time(bytes, left) else { return Ok(()) };
        let mut r = Reader::new(bytes);
        let got = r.list(left);
        prop_assert_eq!(&got, &want, "{:02x?}", bytes);
        if got.is_ok() {
            prop_assert_eq!(r.rest(), want_rest);
        }
        Ok(())
    }

    /// A runs body of `(jump, length field)` pairs written as raw varints, for the fast path's
    /// edges: fields of one, two and three or more bytes, errors at every place.
    fn runs_body(count: u64, fields: &[(u64, u64)]) -> Vec<u8> {
        let mut out = Vec::new();
        varint(&mut out, count << 1);
        for &(jump, lens) in fields {
            varint(&mut out, jump);
            varint(&mut out, lens);
        }
        out
    }

    fn enc(ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::new();
        write(&mut out, ids);
        assert!(out.len() <= bound(ids), "{} > bound {}", out.len(), bound(ids));
        out
    }

    fn dec(bytes: &[u8], left: u64) -> Result<Vec<u32>, ListError> {
        let mut r = Reader::new(bytes);
        let ids = r.list(left)?;
        assert!(r.rest().is_empty(), "{} bytes left after the list", r.rest().len());
        Ok(ids)
    }

    /// Encodings written from the module's description, not from `write`.
    #[test]
    fn documented_encodings() {
        let cases: &[(&[u32], &[u8])] = &[
            (&[], &[0x00]),
            // One id: a delta (head 3) of +7 (zig-zag 14); as a run it would take a length byte more.
            (&[7], &[0x03, 0x0e]),
            // 1024 ascending from 0: head 2048 = 80 10, first 0, (1023 << 1) = 2046 = fe 0f.
            (&(0..1024).collect::<Vec<_>>(), &[0x80, 0x10, 0x00, 0xfe, 0x0f]),
            // 5, 4, 3 then 100, 101: runs (head 10): 5 (0a), 3 descending ((2 << 1) | 1 = 05), then
            // 100 − 3 = 97 (zig-zag 194 = c2 01), 2 ascending (02).
            (&[5, 4, 3, 100, 101], &[0x0a, 0x0a, 0x05, 0xc2, 0x01, 0x02]),
            // 9, 2, 4: deltas are shorter (head 7): +9 (12), −7 (13), +2 (04); runs would be 6 bytes.
            (&[9, 2, 4], &[0x07, 0x12, 0x0d, 0x04]),
            // u32::MAX: a delta, zig-zag 2^33 − 2 = fe ff ff ff 1f.
            (&[u32::MAX], &[0x03, 0xfe, 0xff, 0xff, 0xff, 0x1f]),
            // Descending 10 to 7: a run of 4 from 10 (14), ((4 − 1) << 1) | 1 = 07.
            (&[10, 9, 8, 7], &[0x08, 0x14, 0x07]),
            // Duplicates: 3, 3 are two runs (3 then +0) or two deltas (+3, +0): deltas on 2 < 4.
            (&[3, 3], &[0x05, 0x06, 0x00]),
        ];
        for (ids, bytes) in cases {
            assert_eq!(enc(ids), *bytes, "{ids:?}");
            assert_eq!(dec(bytes, u64::MAX).as_deref(), Ok(*ids), "{bytes:02x?}");
        }
    }

    #[test]
    fn other_cuts_and_forms_decode_to_the_same_list() {
        // 1, 2, 3 as three runs of one, and as deltas: not what write picks, still the list.
        assert_eq!(dec(&[0x06, 0x02, 0x00, 0x02, 0x00, 0x02, 0x00], 3), Ok(vec![1, 2, 3]));
        assert_eq!(dec(&[0x07, 0x02, 0x02, 0x02], 3), Ok(vec![1, 2, 3]));
        // A run of one marked descending is still one id.
        assert_eq!(dec(&[0x02, 0x0e, 0x01], 1), Ok(vec![7]));
    }

    #[test]
    fn hostile_lists_are_refused_before_they_are_allocated() {
        // 2^31 ids in one run of 5 bytes: over any budget below it, refused on the head alone.
        let huge = [0x80, 0x80, 0x80, 0x80, 0x10, 0x00, 0xfe, 0xff, 0xff, 0xff, 0x0f];
        assert_eq!(dec(&huge, 1 << 20), Err(ListError::OverBudget { count: 1 << 31, left: 1 << 20 }));
        // 1000 deltas with 3 bytes of body.
        assert_eq!(dec(&[0xd1, 0x0f, 0x02, 0x02, 0x02], 5000), Err(ListError::ShortBody { count: 1000, bytes: 3 }));
        // A run of 4 in a list of 3.
        assert_eq!(dec(&[0x06, 0x02, 0x06], 10), Err(ListError::RunPastCount { len: 4, over: 1 }));
        // Ascending past u32::MAX: u32::MAX then a run of 2.
        let past = [0x04, 0xfe, 0xff, 0xff, 0xff, 0x1f, 0x02];
        assert_eq!(dec(&past, 10), Err(ListError::IdOutOfU32(1 << 32)));
        // Descending below 0: 1, 0, −1.
        assert_eq!(dec(&[0x06, 0x02, 0x05], 10), Err(ListError::IdOutOfU32(-1)));
        // A first id below 0 (delta −1) and a delta sum past u32::MAX.
        assert_eq!(dec(&[0x02, 0x01, 0x00], 10), Err(ListError::IdOutOfU32(-1)));
        assert_eq!(dec(&[0x05, 0xfe, 0xff, 0xff, 0xff, 0x1f, 0x02], 10), Err(ListError::IdOutOfU32(1 << 32)));
        // A delta beyond i64's zig-zag range is a u64 varint that runs on: refused as an overflow.
        let long = [0x03, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f];
        assert_eq!(dec(&long, 10), Err(ListError::Overflow("a block id delta")));
        // Cut anywhere: truncated, never a panic.
        let good = enc(&[5, 4, 3, 100, 101]);
        for cut in 0..good.len() {
            assert!(matches!(dec(&good[..cut], 10), Err(ListError::Truncated(_))), "cut {cut}");
        }
    }

    #[test]
    fn varints_are_bounded_by_their_type() {
        assert_eq!(Reader::new(&[0xff, 0xff, 0x03]).u16("x"), Ok(u16::MAX));
        assert_eq!(Reader::new(&[0xff, 0xff, 0x04]).u16("x"), Err(ListError::Overflow("x")));
        assert_eq!(Reader::new(&[0x80, 0x80, 0x80]).u16("x"), Err(ListError::Overflow("x")));
        assert_eq!(Reader::new(&[0xff, 0xff, 0xff, 0xff, 0x0f]).u32("x"), Ok(u32::MAX));
        assert_eq!(Reader::new(&[0xff, 0xff, 0xff, 0xff, 0x10]).u32("x"), Err(ListError::Overflow("x")));
        assert_eq!(Reader::new(&[0x80]).u32("x"), Err(ListError::Truncated("x")));
        let mut max = vec![0xff; 18];
        max.push(0x03);
        assert_eq!(Reader::new(&max).varint(128, "x"), Ok(u128::MAX));
    }

    fn fifo_like() -> impl Strategy<Value = Vec<u32>> {
        // Pieces of ascending or descending runs at random places, as a reused pool hands them out.
        // Starts anywhere, and near both ends of u32, where a run must stop rather than wrap.
        let at = prop_oneof![any::<u32>(), 0u32..40, u32::MAX - 40..=u32::MAX];
        prop::collection::vec((at, 1usize..40, any::<bool>()), 0..30).prop_map(|pieces| {
            let mut ids = Vec::new();
            for (at, len, down) in pieces {
                let at = u64::from(at);
                for k in 0..len as u64 {
                    let id = if down { at.checked_sub(k) } else { Some(at + k).filter(|&v| v <= u32::MAX.into()) };
                    ids.extend(id.map(|v| v as u32));
                }
            }
            ids
        })
    }

    /// Lists a block pool would never hand out, for the writer and reader's edges: long descending
    /// runs, repeated ids, gaps of most of u32, and both ends of it next to each other.
    fn adversarial() -> impl Strategy<Value = Vec<u32>> {
        let piece = prop_oneof![
            // A descending run, possibly down to 0.
            (any::<u32>(), 1u32..100).prop_map(|(at, n)| (0..n.min(at.saturating_add(1))).map(|k| at - k).collect()),
            // One id repeated.
            (any::<u32>(), 1usize..20).prop_map(|(id, n)| vec![id; n]),
            // Alternating ends of u32: the largest gaps there are.
            (1usize..10).prop_map(|n| (0..n).map(|k| if k % 2 == 0 { 0 } else { u32::MAX }).collect()),
            // u32::MAX and its neighbours, up and down.
            Just(vec![u32::MAX - 2, u32::MAX - 1, u32::MAX, u32::MAX - 1, 0, 1, 0]),
        ];
        prop::collection::vec(piece, 0..12).prop_map(|p| p.concat())
    }

    proptest! {
        #[test]
        fn adversarial_lists_round_trip_as_measuring_both_writes_them(ids in adversarial()) {
            let b = enc(&ids);
            prop_assert_eq!(&b, &write_measuring_both(&ids));
            prop_assert_eq!(dec(&b, ids.len() as u64), Ok(ids));
        }

        #[test]
        fn the_u64_fast_path_reads_what_the_general_varint_reads(bytes in prop::collection::vec(any::<u8>(), 0..12)) {
            let (mut fast, mut general) = (Reader::new(&bytes), Reader::new(&bytes));
            let got = fast.u64("x");
            prop_assert_eq!(&got, &general.varint(64, "x").map(|v| v as u64));
            if got.is_ok() {
                prop_assert_eq!(fast.rest(), general.rest());
            }
        }

        #[test]
        fn arbitrary_bytes_are_a_list_or_an_error_within_the_budget(
            bytes in prop::collection::vec(any::<u8>(), 0..64), left in 0u64..5000
        ) {
            // Never a panic; a list that reads is within the budget, and its deltas came from bytes.
            let mut r = Reader::new(&bytes);
            if let Ok(ids) = r.list(left) {
                prop_assert!(ids.len() as u64 <= left);
                let mut again = Vec::new();
                write(&mut again, &ids);
                prop_assert_eq!(dec(&again, left), Ok(ids));
            }
        }

    }

    /// A varint field for [`runs_body`]: one byte, two, either side of the two-byte limit (2^14),
    /// or anything.
    fn field() -> impl Strategy<Value = u64> {
        prop_oneof![0u64..0x80, 0x80u64..0x4000, 0x3ff0u64..0x4010, any::<u64>(), Just(u64::MAX)]
    }

    #[test]
    fn the_fast_path_reads_fields_at_the_two_byte_limit_and_the_end_of_the_bytes() {
        // Jumps and lengths of 1, 2 and 3 bytes, with the list ending at once (fewer than 8 bytes
        // after a run: the general reader) or followed by padding (the one-word reader).
        for jump in [0u64, 0x7e, 0x7f, 0x80, 0x3ffe, 0x3fff, 0x4000, 0x4001] {
            for lens in [0u64, 1, 0x7f, 0x80, 0x3fff, 0x4000] {
                for pad in [0usize, 1, 7, 8, 16] {
                    let mut bytes = runs_body((lens >> 1) + 1, &[(jump, lens)]);
                    bytes.resize(bytes.len() + pad, 0);
                    let run = runs_one_at_a_time(&bytes, u64::MAX);
                    let (want, want_rest) = run.expect("a runs-form list");
                    let mut r = Reader::new(&bytes);
                    let got = r.list(u64::MAX);
                    assert_eq!(got, want, "{jump:#x} {lens:#x} +{pad}");
                    if got.is_ok() {
                        assert_eq!(r.rest(), want_rest);
                    }
                }
            }
        }
    }

    proptest! {
        #[test]
        fn runs_bodies_read_as_one_run_at_a_time_did(
            count in prop_oneof![0u64..64, 0u64..5000],
            fields in prop::collection::vec((field(), field()), 0..40),
            cut in any::<prop::sample::Index>(),
            pad in 0usize..12,
            left in prop_oneof![0u64..64, 0u64..5000, Just(u64::MAX)],
        ) {
            // The body as written, cut anywhere, and with bytes after it (the fast path reads 8 at a
            // time): the same ids, or the same error, as the general reader.
            let body = runs_body(count, &fields);
            let cut = cut.index(body.len() + 1);
            reads_as_before(&body[..cut], left)?;
            let mut padded = body.clone();
            padded.resize(body.len() + pad, 0x80);
            reads_as_before(&padded, left)?;
        }

        #[test]
        fn fifo_like_lists_read_as_one_run_at_a_time_did(ids in fifo_like(), pad in 0usize..12) {
            let mut bytes = enc(&ids);
            reads_as_before(&bytes, u64::MAX)?;
            bytes.resize(bytes.len() + pad, 0xff);
            reads_as_before(&bytes, ids.len() as u64)?;
        }
    }

    proptest! {
        #[test]
        fn any_list_round_trips(ids in prop::collection::vec(any::<u32>(), 0..200)) {
            let b = enc(&ids);
            prop_assert_eq!(dec(&b, ids.len() as u64), Ok(ids.clone()));
            // One id fewer in the budget refuses a non-empty list.
            if !ids.is_empty() {
                let over = matches!(dec(&b, ids.len() as u64 - 1), Err(ListError::OverBudget { .. }));
                prop_assert!(over, "a budget of one id fewer was accepted");
            }
        }

        #[test]
        fn small_ids_with_duplicates_round_trip(ids in prop::collection::vec(0u32..8, 0..200)) {
            prop_assert_eq!(dec(&enc(&ids), 200), Ok(ids));
        }

        #[test]
        fn the_one_pass_writer_writes_what_measuring_both_did(
            ids in prop_oneof![prop::collection::vec(any::<u32>(), 0..200), prop::collection::vec(0u32..8, 0..200), fifo_like()]
        ) {
            prop_assert_eq!(enc(&ids), write_measuring_both(&ids));
        }

        #[test]
        fn run_shaped_lists_round_trip_and_are_no_longer_than_deltas(ids in fifo_like()) {
            let b = enc(&ids);
            prop_assert_eq!(dec(&b, u64::MAX), Ok(ids.clone()));
            let (runs_len, deltas_len) = body_lens(&ids);
            prop_assert_eq!(b.len(), varint_len((ids.len() as u64) << 1) + runs_len.min(deltas_len));
        }
    }
}
