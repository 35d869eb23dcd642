//! Descriptor merging: copies contiguous on both sides become one, never across a region.
//!
//! A [`Copy`](struct@Copy) moves `len` bytes from `src_addr` in source region `src_region` to `dst_addr` in
//! destination region `dst_region`. Two copies merge when they are in the same pair of regions and the
//! second starts exactly where the first ends on *both* sides. Region ids come from the layouts (one
//! per layer and part), so a merge can never cross a region boundary even when two regions happen to
//! be adjacent in memory: a NIXL descriptor must stay inside one registration.

/// One contiguous copy; what becomes a NIXL descriptor pair.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Copy {
    /// Source region id (index into the source layout's `region_bases`).
    pub src_region: u32,
    /// Destination region id (index into the destination layout's `region_bases`).
    pub dst_region: u32,
    /// Source address.
    pub src_addr: u64,
    /// Destination address.
    pub dst_addr: u64,
    /// Bytes.
    pub len: u64,
}

impl Copy {
    /// Whether `next` continues `self` on both sides within the same regions.
    #[inline]
    pub fn continued_by(&self, next: &Copy) -> bool {
        self.src_region == next.src_region
            && self.dst_region == next.dst_region
            && self.src_addr.wrapping_add(self.len) == next.src_addr
            && self.dst_addr.wrapping_add(self.len) == next.dst_addr
    }
}

/// Appends `c` to `out`, extending the last copy instead when `c` continues it. Returns whether it
/// merged. Streaming: only the last copy is considered, so callers emit in address order.
#[inline]
pub fn push_merged(out: &mut Vec<Copy>, c: Copy) -> bool {
    if let Some(last) = out.last_mut() {
        if last.continued_by(&c) {
            last.len += c.len;
            return true;
        }
    }
    out.push(c);
    false
}

/// Merges copies given in any order: sorts by (regions, source address), then merges every run
/// contiguous on both sides, in place. Zero-length copies are dropped.
pub fn merge_unordered(copies: &mut Vec<Copy>) {
    copies.retain(|c| c.len > 0);
    copies.sort_unstable_by_key(|c| (c.src_region, c.dst_region, c.src_addr, c.dst_addr));
    let mut w = 0usize;
    for r in 0..copies.len() {
        if w > 0 && copies[w - 1].continued_by(&copies[r]) {
            copies[w - 1].len += copies[r].len;
        } else {
            copies[w] = copies[r];
            w += 1;
        }
    }
    copies.truncate(w);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(sr: u32, dr: u32, s: u64, d: u64, len: u64) -> Copy {
        Copy { src_region: sr, dst_region: dr, src_addr: s, dst_addr: d, len }
    }

    #[test]
    fn merges_only_when_contiguous_on_both_sides() {
        let mut out = Vec::new();
        assert!(!push_merged(&mut out, c(0, 0, 100, 500, 10)));
        assert!(push_merged(&mut out, c(0, 0, 110, 510, 5)));
        // Contiguous on the source only.
        assert!(!push_merged(&mut out, c(0, 0, 115, 600, 5)));
        // Contiguous on both, but another destination region.
        assert!(!push_merged(&mut out, c(0, 1, 120, 605, 5)));
        assert_eq!(out, vec![c(0, 0, 100, 500, 15), c(0, 0, 115, 600, 5), c(0, 1, 120, 605, 5)]);
    }

    #[test]
    fn unordered_merge_sorts_and_drops_empties() {
        let mut v = vec![c(1, 1, 20, 20, 10), c(1, 1, 10, 10, 10), c(0, 0, 0, 0, 0), c(1, 1, 0, 0, 10)];
        merge_unordered(&mut v);
        assert_eq!(v, vec![c(1, 1, 0, 0, 30)]);
    }
}
