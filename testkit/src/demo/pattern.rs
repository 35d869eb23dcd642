//! Deterministic KV contents for verification.
//!
//! Every element — one head's `head_dim` values of one token in one layer and part — gets bytes that
//! depend only on the request's seed and the element's *logical* position (layer, part, global head,
//! token). The producer fills its blocks through its own layout; the consumer checks its blocks
//! through its own layout. Different TP sizes, block sizes and placements on the two sides therefore
//! verify exactly, byte for byte, with no data shipped out of band. A checksum of what arrived is
//! compared with the checksum of what should have arrived.

use kvpush::device::{Buffer, DeviceError};
use kvpush::proto::layout::{BlockOrder, GroupKind, KvLayout};
use kvpush::proto::msg::blocks_for;

/// splitmix64: a fast, well-mixed 64-bit hash step.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Writes the expected bytes of element (layer, part, head, token) of request `seed` into `out`.
pub fn element_bytes(seed: u64, layer: u32, part: u32, head: u32, token: u64, out: &mut [u8]) {
    let base = mix(seed ^ mix((u64::from(layer) << 48) ^ (u64::from(part) << 44) ^ (u64::from(head) << 28) ^ token));
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let w = mix(base.wrapping_add(i as u64)).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// Byte offset of element (local layer, part, block, token in block, local head) and its region index.
pub fn locate(l: &KvLayout, local_layer: u32, part: u32, block: u32, tok: u64, head: u64) -> (usize, u64) {
    let (region, part_off) = l.part_location(local_layer, part);
    let elem = u64::from(l.model.head_dim) * l.model.dtype.size();
    let bt = u64::from(l.block_tokens);
    let within = match l.order {
        BlockOrder::Hnd => (head * bt + tok) * elem,
        BlockOrder::Nhd => (tok * u64::from(l.local_heads()) + head) * elem,
    };
    (region as usize, u64::from(block) * l.block_stride + part_off + within)
}

/// The tokens of group `g` present in a tail list of `listed` blocks for a request of `n` tokens,
/// cut to the window for sliding-window groups.
pub fn tokens_of(l: &KvLayout, g: usize, listed: usize, n: u64) -> std::ops::Range<u64> {
    let bt = u64::from(l.block_tokens);
    let mut start = (blocks_for(n, l.block_tokens) - listed as u64) * bt;
    if let GroupKind::SlidingWindow { window_tokens } = l.model.groups[g].kind {
        start = start.max(n.saturating_sub(window_tokens.into()));
    }
    start.min(n)..n
}

/// Calls `f(region, offset, layer, part, global head, token)` for every element of a request held in
/// `blocks` (per group, tails) on this worker, in logical order.
fn for_each_element(
    l: &KvLayout,
    blocks: &[Vec<u32>],
    n: u64,
    mut f: impl FnMut(usize, u64, u32, u32, u32, u64) -> Result<(), DeviceError>,
) -> Result<(), DeviceError> {
    let layers = l.layer_range();
    let heads = l.head_range();
    let bt = u64::from(l.block_tokens);
    for (g, group) in l.model.groups.iter().enumerate() {
        let ids = &blocks[g];
        let skip = blocks_for(n, l.block_tokens) - ids.len() as u64;
        let tokens = tokens_of(l, g, ids.len(), n);
        for &layer in group.layers.iter().filter(|x| layers.contains(x)) {
            let ll = layer - layers.start;
            for part in 0..l.parts() {
                for h in heads.clone() {
                    for t in tokens.clone() {
                        let block = ids[(t / bt - skip) as usize];
                        let (region, off) = locate(l, ll, part, block, t % bt, u64::from(h - heads.start));
                        f(region, off, layer, part, h, t)?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// Producer side: writes the request's contents into its blocks ("prefill").
pub fn fill(
    l: &KvLayout,
    buffers: &[Box<dyn Buffer>],
    blocks: &[Vec<u32>],
    n: u64,
    seed: u64,
) -> Result<(), DeviceError> {
    let elem = (u64::from(l.model.head_dim) * l.model.dtype.size()) as usize;
    let mut buf = vec![0u8; elem];
    for_each_element(l, blocks, n, |region, off, layer, part, head, t| {
        element_bytes(seed, layer, part, head, t, &mut buf);
        buffers[region].write_at(off, &buf)
    })
}

/// Outcome of [`verify`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Verified {
    /// Bytes checked.
    pub bytes: u64,
    /// Checksum of the bytes found.
    pub found: u64,
    /// Checksum of the bytes expected.
    pub expected: u64,
    /// Elements that differ.
    pub mismatched_elements: u64,
}

impl Verified {
    /// Whether every byte matched.
    pub fn ok(&self) -> bool {
        self.mismatched_elements == 0 && self.found == self.expected
    }
}

fn fold(acc: u64, bytes: &[u8], position: u64) -> u64 {
    let mut h = mix(position);
    for chunk in bytes.chunks(8) {
        let mut w = [0u8; 8];
        w[..chunk.len()].copy_from_slice(chunk);
        h = mix(h ^ u64::from_le_bytes(w));
    }
    acc.wrapping_add(h)
}

/// Consumer side: checks every byte of the request's blocks against the expected contents.
pub fn verify(
    l: &KvLayout,
    buffers: &[Box<dyn Buffer>],
    blocks: &[Vec<u32>],
    n: u64,
    seed: u64,
) -> Result<Verified, DeviceError> {
    let elem = (u64::from(l.model.head_dim) * l.model.dtype.size()) as usize;
    let (mut got, mut want) = (vec![0u8; elem], vec![0u8; elem]);
    let mut v = Verified::default();
    for_each_element(l, blocks, n, |region, off, layer, part, head, t| {
        buffers[region].read_at(off, &mut got)?;
        element_bytes(seed, layer, part, head, t, &mut want);
        let pos = (u64::from(layer) << 48) ^ (u64::from(part) << 44) ^ (u64::from(head) << 28) ^ t;
        v.found = fold(v.found, &got, pos);
        v.expected = fold(v.expected, &want, pos);
        v.mismatched_elements += u64::from(got != want);
        v.bytes += elem as u64;
        Ok(())
    })?;
    Ok(v)
}

/// Number of regions a layout has (one buffer each).
pub fn region_count(l: &KvLayout) -> usize {
    l.layer_range().len() * l.placement.regions_per_layer() as usize
}
