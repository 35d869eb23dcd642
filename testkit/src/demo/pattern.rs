//! Deterministic KV contents for verification.
//!
//! Every element — one head's `head_dim` values of one token in one layer and part — gets bytes that
//! depend only on the request's seed and the element's *logical* position (layer, part, global head,
//! token). The producer fills its blocks through its own layout; the consumer checks its blocks
//! through its own layout. Different TP sizes, block sizes and placements on the two sides therefore
//! verify exactly, byte for byte, with no data shipped out of band. A checksum of what arrived is
//! compared with the checksum of what should have arrived.

use kvpush::device::{Access, Buffer, Device, DeviceError, DeviceKind, StageEntry, Stager};
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
    position_bytes(seed, position(layer, part, head, token), out);
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

/// [`tokens_of`] widened to the whole blocks that hold them: every slot of those blocks, the tail of
/// the last one (past the request's tokens) and, in a sliding-window group, the head of the window's
/// first one. What the engine moves where both sides' blocks are the same size.
pub fn whole_tokens_of(l: &KvLayout, g: usize, listed: usize, n: u64) -> std::ops::Range<u64> {
    let tokens = tokens_of(l, g, listed, n);
    if tokens.is_empty() {
        return tokens;
    }
    let bt = u64::from(l.block_tokens);
    tokens.start / bt * bt..blocks_for(n, l.block_tokens) * bt
}

/// Calls `f(region, offset, position)` for every element of a request held in `blocks` (per group,
/// tails) on this worker, in logical order; `position` is the element's [`position`]. With `whole`,
/// every slot of the blocks that hold them ([`whole_tokens_of`]).
fn for_each_element(l: &KvLayout, blocks: &[Vec<u32>], n: u64, whole: bool, mut f: impl FnMut(usize, u64, u64)) {
    let layers = l.layer_range();
    let heads = l.head_range();
    let bt = u64::from(l.block_tokens);
    for (g, group) in l.model.groups.iter().enumerate() {
        let ids = &blocks[g];
        let skip = blocks_for(n, l.block_tokens) - ids.len() as u64;
        let tokens = if whole { whole_tokens_of(l, g, ids.len(), n) } else { tokens_of(l, g, ids.len(), n) };
        for &layer in group.layers.iter().filter(|x| layers.contains(x)) {
            let ll = layer - layers.start;
            for part in 0..l.parts() {
                for h in heads.clone() {
                    for t in tokens.clone() {
                        let block = ids[(t / bt - skip) as usize];
                        let (region, off) = locate(l, ll, part, block, t % bt, u64::from(h - heads.start));
                        f(region, off, position(layer, part, h, t));
                    }
                }
            }
        }
    }
}

/// The logical position of element (layer, part, global head, token): what its bytes derive from.
fn position(layer: u32, part: u32, head: u32, token: u64) -> u64 {
    (u64::from(layer) << 48) ^ (u64::from(part) << 44) ^ (u64::from(head) << 28) ^ token
}

/// [`element_bytes`] of the element at `position`.
fn position_bytes(seed: u64, position: u64, out: &mut [u8]) {
    let base = mix(seed ^ mix(position));
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let w = mix(base.wrapping_add(i as u64)).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// `len` bytes at `off` of region `region` are bytes `at..at + len` of an [`Image`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    region: usize,
    off: u64,
    len: u64,
    at: u64,
}

/// A request's expected contents on one worker, in address order: the elements sorted by (region,
/// offset) and merged into [`Run`]s of adjacent elements, so that the contents move in one copy per
/// run (or one bulk copy and one device scatter or gather, [`Mover`]) instead of one per element.
struct Image {
    elem: usize,
    /// Element positions in image order (element `i` is bytes `i * elem..`).
    positions: Vec<u64>,
    runs: Vec<Run>,
    bytes: Vec<u8>,
}

impl Image {
    /// The layout of the request's elements, without their bytes. (Copies check that each run lies
    /// in its buffer.)
    fn plan(l: &KvLayout, blocks: &[Vec<u32>], n: u64, whole: bool) -> Image {
        let elem = u64::from(l.model.head_dim) * l.model.dtype.size();
        let mut at: Vec<(usize, u64, u64)> = Vec::new();
        for_each_element(l, blocks, n, whole, |region, off, pos| at.push((region, off, pos)));
        at.sort_unstable();
        let mut runs: Vec<Run> = Vec::new();
        for (i, &(region, off, _)) in at.iter().enumerate() {
            match runs.last_mut() {
                Some(r) if r.region == region && r.off + r.len == off => r.len += elem,
                _ => runs.push(Run { region, off, len: elem, at: i as u64 * elem }),
            }
        }
        Image { elem: elem as usize, positions: at.into_iter().map(|(_, _, p)| p).collect(), runs, bytes: Vec::new() }
    }

    /// [`Image::plan`] with the expected bytes of request `seed`.
    fn expected(l: &KvLayout, blocks: &[Vec<u32>], n: u64, whole: bool, seed: u64) -> Image {
        let mut image = Image::plan(l, blocks, n, whole);
        image.bytes = vec![0u8; image.positions.len() * image.elem];
        if image.elem > 0 {
            for (chunk, &pos) in image.bytes.chunks_exact_mut(image.elem).zip(&image.positions) {
                position_bytes(seed, pos, chunk);
            }
        }
        image
    }

    /// Writes the image into the blocks, one copy per run.
    fn write_runs(&self, buffers: &[Box<dyn Buffer>]) -> Result<(), DeviceError> {
        for r in &self.runs {
            buffers[r.region].write_at(r.off, &self.bytes[r.at as usize..(r.at + r.len) as usize])?;
        }
        Ok(())
    }

    /// Reads the blocks back, one copy per run, and compares them with the image.
    fn read_runs(&self, buffers: &[Box<dyn Buffer>]) -> Result<Verified, DeviceError> {
        let mut got = vec![0u8; self.bytes.len()];
        for r in &self.runs {
            buffers[r.region].read_at(r.off, &mut got[r.at as usize..(r.at + r.len) as usize])?;
        }
        Ok(self.compare(&got))
    }

    /// Compares `got` (bytes in image order) with the expected bytes.
    fn compare(&self, got: &[u8]) -> Verified {
        let mut v = Verified { bytes: self.bytes.len() as u64, ..Verified::default() };
        if self.elem == 0 {
            return v;
        }
        for ((want, got), &pos) in
            self.bytes.chunks_exact(self.elem).zip(got.chunks_exact(self.elem)).zip(&self.positions)
        {
            let want_sum = fold(0, want, pos);
            v.expected = v.expected.wrapping_add(want_sum);
            if want == got {
                v.found = v.found.wrapping_add(want_sum);
            } else {
                v.found = fold(v.found, got, pos);
                v.mismatched_elements += 1;
            }
        }
        v
    }
}

/// Producer side: writes the request's contents into its blocks ("prefill"), one copy per run of
/// adjacent elements.
pub fn fill(
    l: &KvLayout,
    buffers: &[Box<dyn Buffer>],
    blocks: &[Vec<u32>],
    n: u64,
    seed: u64,
) -> Result<(), DeviceError> {
    Image::expected(l, blocks, n, false, seed).write_runs(buffers)
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

    /// Adds another worker's outcome of the same request.
    pub fn add(&mut self, v: Verified) {
        self.bytes += v.bytes;
        self.mismatched_elements += v.mismatched_elements;
        self.found = self.found.wrapping_add(v.found);
        self.expected = self.expected.wrapping_add(v.expected);
    }
}

/// The checksum of one element's bytes at `position`, added to `acc` (order-independent: a sum).
fn fold(acc: u64, bytes: &[u8], position: u64) -> u64 {
    let mut h = mix(position);
    for chunk in bytes.chunks(8) {
        let mut w = [0u8; 8];
        w[..chunk.len()].copy_from_slice(chunk);
        h = mix(h ^ u64::from_le_bytes(w));
    }
    acc.wrapping_add(h)
}

/// Consumer side: checks every byte of the request's blocks against the expected contents, reading
/// them one copy per run of adjacent elements.
pub fn verify(
    l: &KvLayout,
    buffers: &[Box<dyn Buffer>],
    blocks: &[Vec<u32>],
    n: u64,
    seed: u64,
) -> Result<Verified, DeviceError> {
    Image::expected(l, blocks, n, false, seed).read_runs(buffers)
}

/// Entries of one device scatter or gather at most (a table of 16 bytes each).
const MAX_ENTRIES: usize = 16384;
/// Bytes of one entry at most: a long run is split so that the device's copy warps share it.
const MAX_ENTRY_BYTES: u64 = 256 << 10;
/// Bytes of a [`Mover`]'s device scratch buffer: a request larger than this moves in several rounds.
pub const SCRATCH_BYTES: u64 = 64 << 20;

/// Fills and verifies requests on one worker's buffers in bulk, for memory the CPU must not touch
/// (GPU memory): a request's expected bytes are built in host memory in address order, copied to a
/// device scratch buffer in one copy and scattered into the blocks by one device operation
/// ([`Stager::scatter`]); verifying gathers the blocks into the scratch buffer and reads it back in
/// one copy. Without a stager, or for a request whose runs are not whole 16-byte words (elements of
/// 8 bytes, say), it falls back to one copy per run ([`fill`], [`verify`]).
pub struct Mover {
    staged: Option<(Box<dyn Stager>, Box<dyn Buffer>)>,
    /// Fill and verify every slot of the blocks that hold a request ([`whole_tokens_of`]).
    whole_blocks: bool,
}

impl std::fmt::Debug for Mover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mover").field("staged", &self.staged.is_some()).finish()
    }
}

impl Mover {
    /// The mover for buffers of `dev`: staged through the device where the CPU cannot touch its
    /// memory and the device has a stager; one copy per run otherwise (host memory, where a copy is
    /// a memcpy). A device that offers a stager but cannot make one is an error.
    pub fn new(dev: &dyn Device) -> Result<Mover, DeviceError> {
        if dev.access() == Access::Cpu {
            return Ok(Mover { staged: None, whole_blocks: false });
        }
        Self::staged(dev)
    }

    /// The mover that stages through `dev`'s stager whatever its memory (falls back to one copy per
    /// run only where the device has no stager).
    pub fn staged(dev: &dyn Device) -> Result<Mover, DeviceError> {
        let Some(stager) = dev.stager(1, MAX_ENTRIES)? else { return Ok(Mover { staged: None, whole_blocks: false }) };
        let scratch = dev.alloc(SCRATCH_BYTES)?;
        Ok(Mover { staged: Some((stager, scratch)), whole_blocks: false })
    }

    /// This mover filling and verifying every slot of the blocks that hold a request
    /// ([`whole_tokens_of`]) when `on`, only the request's tokens otherwise (the default).
    pub fn whole_blocks(mut self, on: bool) -> Mover {
        self.whole_blocks = on;
        self
    }

    /// Whether requests move through a device stager.
    pub fn is_staged(&self) -> bool {
        self.staged.is_some()
    }

    /// The stager, its scratch buffer and the rounds that move `image`; `None` where this mover
    /// has no stager or the image's runs do not suit it (see [`rounds`]).
    fn rounds(&mut self, image: &Image, buffers: &[Box<dyn Buffer>]) -> Result<Option<Staged<'_>>, DeviceError> {
        let Some((stager, scratch)) = self.staged.as_mut() else { return Ok(None) };
        Ok(rounds(stager.kind(), image, buffers)?.map(|r| (stager, &**scratch, r)))
    }

    /// Writes the request's contents into its blocks, as [`fill`].
    ///
    /// # Safety
    ///
    /// Nothing else reads or writes the request's blocks during the call (a producer's blocks before
    /// `request_finished`).
    pub unsafe fn fill(
        &mut self,
        l: &KvLayout,
        buffers: &[Box<dyn Buffer>],
        blocks: &[Vec<u32>],
        n: u64,
        seed: u64,
    ) -> Result<(), DeviceError> {
        let image = Image::expected(l, blocks, n, self.whole_blocks, seed);
        let Some((stager, scratch, rounds)) = self.rounds(&image, buffers)? else {
            return image.write_runs(buffers);
        };
        let slot = scratch.region().addr;
        for round in rounds {
            let data = &image.bytes[round.at as usize..(round.at + round.len) as usize];
            // SAFETY: `slot..slot + round.len` is the scratch buffer this mover owns (rounds fit
            // SCRATCH_BYTES) and nothing else uses; every entry's range lies inside one of `buffers`
            // (checked by `rounds`), alive for the call; no other thread touches the
            // request's blocks (this function's contract). The scatter is ordered after the write and
            // waited for before the next round reuses the scratch buffer.
            unsafe {
                stager.write(slot, data)?;
                stager.scatter(0, &round.entries, slot)?;
            }
            wait(stager.as_mut())?;
        }
        Ok(())
    }

    /// Checks every byte of the request's blocks, as [`verify`].
    ///
    /// # Safety
    ///
    /// Nothing writes the request's blocks during the call (a consumer's blocks after they were
    /// received and before they are freed).
    pub unsafe fn verify(
        &mut self,
        l: &KvLayout,
        buffers: &[Box<dyn Buffer>],
        blocks: &[Vec<u32>],
        n: u64,
        seed: u64,
    ) -> Result<Verified, DeviceError> {
        let image = Image::expected(l, blocks, n, self.whole_blocks, seed);
        let Some((stager, scratch, rounds)) = self.rounds(&image, buffers)? else {
            return image.read_runs(buffers);
        };
        let mut got = vec![0u8; image.bytes.len()];
        let slot = scratch.region().addr;
        for round in rounds {
            // SAFETY: as in `fill`, directions swapped: the entries' sources are the request's blocks
            // inside `buffers`, which nothing writes meanwhile (this function's contract); the
            // gather is waited for before the scratch buffer is read and reused.
            unsafe { stager.gather(0, &round.entries, slot)? };
            wait(stager.as_mut())?;
            // SAFETY: the scratch buffer holds `round.len` bytes the gather just wrote.
            unsafe { stager.read(slot, &mut got[round.at as usize..(round.at + round.len) as usize])? };
        }
        Ok(image.compare(&got))
    }
}

/// A [`Mover`]'s stager and scratch buffer, and the rounds that move one image through them.
type Staged<'a> = (&'a mut Box<dyn Stager>, &'a dyn Buffer, Vec<Round>);

/// One scatter or gather of a [`Mover`]: image bytes `at..at + len` and the entries placing them
/// (offsets relative to `at`).
struct Round {
    at: u64,
    len: u64,
    entries: Vec<StageEntry>,
}

/// Splits an image's runs into rounds of at most [`SCRATCH_BYTES`] and [`MAX_ENTRIES`] entries of at
/// most [`MAX_ENTRY_BYTES`] each; `None` where a run is not whole 16-byte words at a 16-byte aligned
/// address ([`StageEntry::aligned`]), which the stager cannot move. A run outside its buffer is an
/// error.
fn rounds(device: DeviceKind, image: &Image, buffers: &[Box<dyn Buffer>]) -> Result<Option<Vec<Round>>, DeviceError> {
    let mut out: Vec<Round> = Vec::new();
    for r in &image.runs {
        let region = buffers.get(r.region).map(|b| b.region());
        let Some(region) = region.filter(|g| r.off.checked_add(r.len).is_some_and(|end| end <= g.len)) else {
            return Err(DeviceError::Copy {
                device,
                offset: r.off,
                len: r.len,
                reason: format!("run outside region {} of {} buffers", r.region, buffers.len()),
            });
        };
        let base = region.addr;
        let mut done = 0;
        while done < r.len {
            let len = (r.len - done).min(MAX_ENTRY_BYTES);
            let at = r.at + done;
            let fits = out.last().is_some_and(|c| c.len + len <= SCRATCH_BYTES && c.entries.len() < MAX_ENTRIES);
            if !fits {
                out.push(Round { at, len: 0, entries: Vec::new() });
            }
            let Some(c) = out.last_mut() else { break };
            let e = StageEntry { addr: base + r.off + done, off: (at - c.at) as u32, len: len as u32 };
            if !e.aligned() {
                return Ok(None);
            }
            c.entries.push(e);
            c.len += len;
            done += len;
        }
    }
    Ok(Some(out))
}

/// Waits for the mover's one lane.
fn wait(stager: &mut dyn Stager) -> Result<(), DeviceError> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !stager.is_done(0)? {
        if std::time::Instant::now() > deadline {
            return Err(DeviceError::Copy {
                device: stager.kind(),
                offset: 0,
                len: 0,
                reason: "a staging operation did not finish in 60 s".into(),
            });
        }
        std::thread::sleep(std::time::Duration::from_micros(20));
    }
    Ok(())
}

/// Number of regions a layout has (one buffer each).
pub fn region_count(l: &KvLayout) -> usize {
    l.layer_range().len() * l.placement.regions_per_layer() as usize
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::demo::{worker_layout, Topology};
    use kvpush::device::mock::MockDevice;
    use kvpush::proto::layout::BlockOrder;

    /// Checks every element on its own (the demo's old per-element verification): how many differ.
    fn per_element(l: &KvLayout, buffers: &[Box<dyn Buffer>], blocks: &[Vec<u32>], n: u64, seed: u64) -> u64 {
        let elem = (u64::from(l.model.head_dim) * l.model.dtype.size()) as usize;
        let (mut got, mut want) = (vec![0u8; elem], vec![0u8; elem]);
        let mut bad = 0;
        for_each_element(l, blocks, n, false, |region, off, pos| {
            buffers[region].read_at(off, &mut got).unwrap();
            position_bytes(seed, pos, &mut want);
            bad += u64::from(got != want);
        });
        bad
    }

    fn topology(order: BlockOrder, head_dim: u32) -> Topology {
        Topology {
            layers: 4,
            kv_heads: 4,
            head_dim,
            num_blocks: 64,
            window_every: 2,
            window_tokens: 40,
            order,
            ..Topology::default()
        }
    }

    #[test]
    fn bulk_and_staged_moves_agree_with_the_per_element_pattern() {
        let dev = MockDevice::new();
        for order in [BlockOrder::Hnd, BlockOrder::Nhd] {
            // TP rank 1 of 2 (a head slice), 100 tokens over scattered and adjacent blocks.
            let (l, buffers) = worker_layout(&topology(order, 16), &dev, 1, 2, 16).unwrap();
            let ids = vec![9, 3, 4, 5, 20, 21, 40];
            let blocks: Vec<Vec<u32>> = l.model.groups.iter().map(|_| ids.clone()).collect();
            let (n, seed) = (100, 0x5eed);
            let mut staged = Mover::staged(&dev).unwrap();
            assert!(staged.is_staged());
            let mut direct = Mover::new(&dev).unwrap();
            assert!(!direct.is_staged(), "the mock's memory is host memory: plain copies");
            // SAFETY: no transfer touches these buffers.
            unsafe { staged.fill(&l, &buffers, &blocks, n, seed) }.unwrap();
            assert_eq!(per_element(&l, &buffers, &blocks, n, seed), 0, "{order:?}");
            // SAFETY: as above.
            let (a, b) = unsafe {
                (
                    staged.verify(&l, &buffers, &blocks, n, seed).unwrap(),
                    direct.verify(&l, &buffers, &blocks, n, seed).unwrap(),
                )
            };
            assert!(a.ok() && a == b && a == verify(&l, &buffers, &blocks, n, seed).unwrap(), "{a:?} {b:?}");
            // 4 layers x 2 parts x 2 local heads x 100 tokens of 32 bytes, minus the window layers'
            // tokens before the last 40.
            assert_eq!(a.bytes, (2 * 2 * 2 * 100 + 2 * 2 * 2 * 40) * 32, "{order:?}");
            // One flipped byte: one element differs, whichever way it is read.
            let (region, off) = locate(&l, 0, 1, 4, 3, 1);
            let mut byte = [0u8];
            buffers[region].read_at(off + 5, &mut byte).unwrap();
            buffers[region].write_at(off + 5, &[byte[0] ^ 0x10]).unwrap();
            // SAFETY: as above.
            let (a, b) = unsafe {
                (
                    staged.verify(&l, &buffers, &blocks, n, seed).unwrap(),
                    direct.verify(&l, &buffers, &blocks, n, seed).unwrap(),
                )
            };
            assert_eq!((a.mismatched_elements, b.mismatched_elements), (1, 1), "{order:?}");
            assert!(a.found != a.expected && a == b, "{a:?} {b:?}");
            // Another seed: the plain fill writes the same bytes as the staged one would.
            fill(&l, &buffers, &blocks, n, seed + 1).unwrap();
            assert_eq!(per_element(&l, &buffers, &blocks, n, seed + 1), 0, "{order:?}");
        }
    }

    #[test]
    fn a_request_larger_than_the_scratch_buffer_moves_in_rounds() {
        let dev = MockDevice::new();
        // 5 layers x 2 parts x 8 heads x 4096 tokens x 256 bytes = 80 MiB: past SCRATCH_BYTES, in runs
        // longer than MAX_ENTRY_BYTES.
        let t = Topology { layers: 5, kv_heads: 8, head_dim: 128, num_blocks: 300, ..Topology::default() };
        let (l, buffers) = worker_layout(&t, &dev, 0, 1, 16).unwrap();
        let blocks = vec![(10..266).collect::<Vec<u32>>()];
        let image = Image::plan(&l, &blocks, 4096, false);
        assert!(image.positions.len() as u64 * 256 > SCRATCH_BYTES);
        assert!(rounds(DeviceKind::Mock, &image, &buffers).unwrap().unwrap().len() >= 2);
        let mut staged = Mover::staged(&dev).unwrap();
        // SAFETY: no transfer touches these buffers.
        unsafe { staged.fill(&l, &buffers, &blocks, 4096, 7) }.unwrap();
        assert!(verify(&l, &buffers, &blocks, 4096, 7).unwrap().ok());
        // SAFETY: as above.
        assert!(unsafe { staged.verify(&l, &buffers, &blocks, 4096, 7) }.unwrap().ok());
    }

    #[test]
    fn runs_the_stager_cannot_move_fall_back_to_plain_copies() {
        let dev = MockDevice::new();
        // head_dim 4 in bf16: 8-byte elements; the last block's 5 tokens are 40 bytes.
        let (l, buffers) = worker_layout(&topology(BlockOrder::Hnd, 4), &dev, 0, 1, 16).unwrap();
        let blocks: Vec<Vec<u32>> = l.model.groups.iter().map(|_| vec![1, 7]).collect();
        let image = Image::plan(&l, &blocks, 21, false);
        assert!(rounds(DeviceKind::Mock, &image, &buffers).unwrap().is_none());
        let mut staged = Mover::staged(&dev).unwrap();
        // SAFETY: no transfer touches these buffers.
        unsafe { staged.fill(&l, &buffers, &blocks, 21, 1) }.unwrap();
        assert_eq!(per_element(&l, &buffers, &blocks, 21, 1), 0);
        // SAFETY: as above.
        assert!(unsafe { staged.verify(&l, &buffers, &blocks, 21, 1) }.unwrap().ok());
    }

    #[test]
    fn whole_tokens_are_the_blocks_that_hold_the_tokens() {
        // 16-token blocks; group 0 full attention, group 1 a 64-token window.
        let l = crate::layouts::small(0, 1);
        assert_eq!(l.block_tokens, 16);
        assert_eq!((tokens_of(&l, 0, 7, 100), whole_tokens_of(&l, 0, 7, 100)), (0..100, 0..112));
        // The window starts at token 36, inside block 2 (32..48): its whole block moves.
        assert_eq!((tokens_of(&l, 1, 7, 100), whole_tokens_of(&l, 1, 7, 100)), (36..100, 32..112));
        // A prefix hit of 3 blocks: the list covers tokens 48.., already whole blocks at the start.
        assert_eq!((tokens_of(&l, 0, 4, 100), whole_tokens_of(&l, 0, 4, 100)), (48..100, 48..112));
        // Nothing listed: nothing, widened or not.
        assert!(whole_tokens_of(&l, 0, 0, 100).is_empty());
    }
}
