//! Unit packing, the GPU bench's own pipeline (benches/gpu_push.rs, its `staged` method): how a
//! request's scattered KV blocks are packed into a bounded, reused buffer, sent in pieces, and unpacked
//! on the other side, with both sides agreeing on the geometry in advance and no table on the wire.
//! Pure functions, no CUDA. (kvpush's engine stages through `device::stage` and the staging protocol
//! of `transport::staged`; this module is the bench's reference beside them.)
//!
//! Read [`UnitSpace`] and [`plan`] first. A request's KV is a set of *units*: one block of one
//! region (a region is one layer's K or V), all `unit_bytes` long. Units are numbered region-major —
//! unit `u` is request block `u % blocks` of region `u / blocks` — and packed densely in that order,
//! so the packed stream needs no table: both sides compute the same numbering from the same
//! geometry. The producer's gather kernel reads unit `u` at
//! `src_bases[u / blocks] + src_ids[u % blocks] * stride` and writes it at
//! `(u - piece.first_unit) * unit_bytes` in a staging slot; one WRITE moves the slot to the consumer's
//! slot of the same number, whose scatter kernel writes it at
//! `dst_bases[u / blocks] + dst_ids[u % blocks] * stride`.
//!
//! The staging buffer is `slots` slots of `slot_bytes` each; a request larger than that goes in
//! [`Piece`]s, piece `i` in slot `i % slots`, so memory is bounded however large the request. The
//! kernels in [`crate::kernels`] and the reference [`gather`]/[`scatter`] here follow the same plan;
//! [`pattern_fill`] and [`pattern_check`] give a verifiable pattern that depends on the unit's
//! *logical* position (region, request block index), not on where it lives, so the consumer can check
//! what landed in its own blocks.

use core::ops::Range;

/// Why a plan or a reference copy cannot be made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PackError {
    /// The geometry is unusable.
    #[error("invalid staging geometry: {0}")]
    Geometry(String),
    /// A unit's address lies outside the memory given to a reference copy.
    #[error(
        "unit {unit} (region {region}, block id {block}) at {addr:#x}+{len} lies outside memory {base:#x}+{mem_len}"
    )]
    OutOfBounds {
        /// Unit number.
        unit: u64,
        /// Its region.
        region: u32,
        /// Its block id on that side.
        block: u32,
        /// Its address.
        addr: u64,
        /// Its length.
        len: u64,
        /// Base of the memory given.
        base: u64,
        /// Length of the memory given.
        mem_len: u64,
    },
}

/// Alignment every unit address, size and staging offset must have (the kernels move 16 bytes per
/// access).
pub const ALIGN: u64 = 16;

/// The units of one request: `regions` regions (layers × K/V) × `blocks` request blocks, each
/// `unit_bytes` long.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct UnitSpace {
    /// Regions (one per layer and K/V part).
    pub regions: u32,
    /// Blocks of the request.
    pub blocks: u32,
    /// Bytes of one block of one region.
    pub unit_bytes: u64,
}

impl UnitSpace {
    /// Number of units.
    pub fn units(&self) -> u64 {
        u64::from(self.regions) * u64::from(self.blocks)
    }

    /// Bytes of the whole request.
    pub fn bytes(&self) -> u64 {
        self.units() * self.unit_bytes
    }

    /// (region, request block index) of unit `u`.
    #[inline]
    pub fn locate(&self, u: u64) -> (u32, u32) {
        let b = u64::from(self.blocks);
        ((u / b) as u32, (u % b) as u32)
    }

    fn check(&self) -> Result<(), PackError> {
        if self.regions == 0 || self.blocks == 0 {
            return Err(PackError::Geometry(format!(
                "{} regions × {} blocks: nothing to move",
                self.regions, self.blocks
            )));
        }
        if self.unit_bytes == 0 || !self.unit_bytes.is_multiple_of(ALIGN) {
            return Err(PackError::Geometry(format!(
                "unit of {} bytes: must be a non-zero multiple of {ALIGN}",
                self.unit_bytes
            )));
        }
        Ok(())
    }
}

/// Which way a piece moves between the units and its staging slot ([`gather`], [`scatter`],
/// [`crate::Kernels::pack`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pack {
    /// Units to slot, packed (the sender).
    Gather,
    /// Slot to the units' places (the receiver).
    Scatter,
}

/// One WRITE of a staged request: units `first_unit..first_unit + units`, packed from offset 0 of
/// slot `slot` on both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Piece {
    /// Position in the request (0, 1, ...).
    pub index: u32,
    /// Staging slot (`index % slots`).
    pub slot: u32,
    /// First unit.
    pub first_unit: u64,
    /// Units in this piece.
    pub units: u64,
    /// Bytes (`units * unit_bytes`).
    pub bytes: u64,
}

/// A request cut into pieces that each fit one staging slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackPlan {
    /// The request's units.
    pub space: UnitSpace,
    /// Bytes of one slot.
    pub slot_bytes: u64,
    /// Slots on each side.
    pub slots: u32,
    /// Pieces, in order.
    pub pieces: Vec<Piece>,
}

impl PackPlan {
    /// Staging memory each side needs: the slots actually used, each `slot_bytes`.
    pub fn staging_bytes(&self) -> u64 {
        let used = self.pieces.len().min(self.slots as usize) as u64;
        used * self.slot_bytes
    }
}

/// Cuts `space` into pieces of at most `slot_bytes` (whole units; the last piece may be shorter),
/// assigned round-robin to `slots` slots.
///
/// Errors: an empty or misaligned unit space, no slot, or a slot smaller than one unit or not a
/// multiple of [`ALIGN`].
pub fn plan(space: UnitSpace, slot_bytes: u64, slots: u32) -> Result<PackPlan, PackError> {
    space.check()?;
    if slots == 0 {
        return Err(PackError::Geometry("no staging slot".into()));
    }
    if slot_bytes < space.unit_bytes || !slot_bytes.is_multiple_of(ALIGN) {
        return Err(PackError::Geometry(format!(
            "slot of {slot_bytes} bytes: must hold at least one unit of {} bytes and be a multiple of {ALIGN}",
            space.unit_bytes
        )));
    }
    let per = slot_bytes / space.unit_bytes;
    let total = space.units();
    let n = total.div_ceil(per);
    let n32 = u32::try_from(n).map_err(|_| PackError::Geometry(format!("{n} pieces: too many")))?;
    let pieces = (0..n32)
        .map(|i| {
            let first_unit = u64::from(i) * per;
            let units = per.min(total - first_unit);
            Piece { index: i, slot: i % slots, first_unit, units, bytes: units * space.unit_bytes }
        })
        .collect();
    Ok(PackPlan { space, slot_bytes, slots, pieces })
}

/// One side of a staged copy: where each region starts, which block ids the request uses, and the
/// distance between consecutive blocks of a region.
#[derive(Clone, Copy, Debug)]
pub struct Side<'a> {
    /// Base address of each region (`space.regions` entries).
    pub bases: &'a [u64],
    /// Block id of each request block (`space.blocks` entries).
    pub ids: &'a [u32],
    /// Bytes from one block to the next within a region.
    pub stride: u64,
}

impl Side<'_> {
    /// Address of unit `u`.
    #[inline]
    pub fn unit_addr(&self, space: &UnitSpace, u: u64) -> u64 {
        let (r, j) = space.locate(u);
        self.bases[r as usize] + u64::from(self.ids[j as usize]) * self.stride
    }

    /// Checks that this side describes `space` and that every address is aligned for the kernels.
    pub fn check(&self, space: &UnitSpace) -> Result<(), PackError> {
        space.check()?;
        if self.bases.len() != space.regions as usize || self.ids.len() != space.blocks as usize {
            return Err(PackError::Geometry(format!(
                "{} region bases and {} block ids for {} regions × {} blocks",
                self.bases.len(),
                self.ids.len(),
                space.regions,
                space.blocks
            )));
        }
        if self.stride < space.unit_bytes || !self.stride.is_multiple_of(ALIGN) {
            return Err(PackError::Geometry(format!(
                "block stride {} must be ≥ the unit ({} bytes) and a multiple of {ALIGN}",
                self.stride, space.unit_bytes
            )));
        }
        if let Some(b) = self.bases.iter().find(|&&b| !b.is_multiple_of(ALIGN)) {
            return Err(PackError::Geometry(format!("region base {b:#x} is not {ALIGN}-byte aligned")));
        }
        Ok(())
    }

    fn locate_in(&self, space: &UnitSpace, u: u64, base: u64, len: usize) -> Result<usize, PackError> {
        let addr = self.unit_addr(space, u);
        let off = addr.wrapping_sub(base);
        if addr < base || off.checked_add(space.unit_bytes).is_none_or(|e| e > len as u64) {
            let (region, j) = space.locate(u);
            return Err(PackError::OutOfBounds {
                unit: u,
                region,
                block: self.ids[j as usize],
                addr,
                len: space.unit_bytes,
                base,
                mem_len: len as u64,
            });
        }
        Ok(off as usize)
    }
}

/// Reference gather: packs `piece`'s units from `mem` (whose first byte is at address `base`) into
/// `slot`. What the gather kernel does on the GPU.
pub fn gather(
    space: &UnitSpace,
    piece: &Piece,
    src: &Side<'_>,
    mem: &[u8],
    base: u64,
    slot: &mut [u8],
) -> Result<(), PackError> {
    each_unit(space, piece, src, base, mem.len(), slot.len(), |m, s| slot[s].copy_from_slice(&mem[m]))
}

/// Reference scatter: unpacks `piece`'s units from `slot` into `mem` (whose first byte is at
/// address `base`). What the scatter kernel does on the GPU.
pub fn scatter(
    space: &UnitSpace,
    piece: &Piece,
    dst: &Side<'_>,
    slot: &[u8],
    mem: &mut [u8],
    base: u64,
) -> Result<(), PackError> {
    each_unit(space, piece, dst, base, mem.len(), slot.len(), |m, s| mem[m].copy_from_slice(&slot[s]))
}

/// The walk [`gather`] and [`scatter`] share: checks `side` and the slot, then calls `copy` with the
/// byte ranges of each of `piece`'s units in `mem` (of `mem_len` bytes from `base`) and in the slot,
/// in order, stopping at the first unit outside `mem`.
fn each_unit(
    space: &UnitSpace,
    piece: &Piece,
    side: &Side<'_>,
    base: u64,
    mem_len: usize,
    slot_len: usize,
    mut copy: impl FnMut(Range<usize>, Range<usize>),
) -> Result<(), PackError> {
    side.check(space)?;
    check_slot(piece, slot_len)?;
    let ub = space.unit_bytes as usize;
    for k in 0..piece.units {
        let off = side.locate_in(space, piece.first_unit + k, base, mem_len)?;
        let at = k as usize * ub;
        copy(off..off + ub, at..at + ub);
    }
    Ok(())
}

fn check_slot(piece: &Piece, len: usize) -> Result<(), PackError> {
    if piece.bytes > len as u64 {
        return Err(PackError::Geometry(format!(
            "piece {} needs {} bytes, the slot has {len}",
            piece.index, piece.bytes
        )));
    }
    Ok(())
}

/// 64-bit finalizer (splitmix64): spreads every input bit over the output.
#[inline]
pub fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Seed of the pattern of the unit at logical position (`region`, request block `index`).
#[inline]
pub fn unit_seed(seed: u64, region: u32, index: u32) -> u64 {
    mix64(seed ^ (u64::from(region) << 32) ^ u64::from(index))
}

/// Word `w` (little-endian u32) of a unit whose seed is `h`.
#[inline]
pub fn pattern_word(h: u64, w: u64) -> u32 {
    (mix64(h.wrapping_add(w)) >> 16) as u32
}

/// Fills `out` (one unit) with the pattern of logical position (`region`, `index`).
pub fn pattern_fill(seed: u64, region: u32, index: u32, out: &mut [u8]) {
    let h = unit_seed(seed, region, index);
    for (w, chunk) in out.chunks_exact_mut(4).enumerate() {
        chunk.copy_from_slice(&pattern_word(h, w as u64).to_le_bytes());
    }
}

/// Index of the first word of `got` (one unit) that differs from the pattern of (`region`,
/// `index`), if any.
pub fn pattern_check(seed: u64, region: u32, index: u32, got: &[u8]) -> Option<usize> {
    let h = unit_seed(seed, region, index);
    got.chunks_exact(4)
        .enumerate()
        .position(|(w, c)| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) != pattern_word(h, w as u64))
}
