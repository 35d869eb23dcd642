//! Which path a WRITE takes to a peer: its merged descriptors posted directly, or staged through
//! bounded slots (gather, one WRITE per slot-sized piece, scatter).
//!
//! Neither path wins everywhere. Measured on one H200 with P and D on the same GPU, a direct WRITE
//! of a contiguous 16k-token request (128 merged descriptors) moved ~600 GB/s and staging ~100 GB/s;
//! on two H200s over NVLink the direct WRITE paid ~4 µs per descriptor, so a fragmented request
//! (131,072 descriptors) took 500 ms direct and 1.5 ms staged. The right answer depends on the peer,
//! the memory and the request's shape, so [`PathChooser`] learns it: per path it fits
//! `time = fixed + per_descriptor × descriptors + per_byte × bytes` to the transfers it has seen
//! (recursive least squares with forgetting, so the fit follows a machine whose load changes), and
//! a request goes the way predicted faster.
//!
//! Exploration is bounded: a path is tried against the prediction only while it has few samples in
//! the shape's class or on one decision in [`EXPLORE_EVERY`], and never when it is predicted more
//! than [`EXPLORE_MAX_RATIO`] times slower — so a fragmented request is not sent down a path expected
//! to take 300 times longer just to check. The one exception is a path's second sample in a class,
//! which it gets whatever its first said (a first transfer pays one-off costs).
//!
//! Like all of `proto`, this reads no clock: the caller measures a transfer (post to completion)
//! and hands the duration in.

/// A way to move a WRITE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Path {
    /// The merged descriptors, posted as one transfer.
    Direct,
    /// Through the staging slots.
    Staged,
}

impl Path {
    fn index(self) -> usize {
        match self {
            Path::Direct => 0,
            Path::Staged => 1,
        }
    }

    fn other(self) -> Path {
        match self {
            Path::Direct => Path::Staged,
            Path::Staged => Path::Direct,
        }
    }
}

/// What a transfer moves, as the cost model sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Descriptors (after merging).
    pub descs: u64,
    /// Bytes.
    pub bytes: u64,
}

/// A path is explored against the prediction on one eligible decision in this many.
pub const EXPLORE_EVERY: u64 = 32;
/// A path predicted more than this many times slower than the other is never explored.
pub const EXPLORE_MAX_RATIO: f64 = 3.0;
/// Samples a path needs in a shape class before only the prediction (and periodic exploration)
/// picks it there.
pub const WARM_SAMPLES: u32 = 2;
/// Samples a shape class remembers per path; its estimate is the best of them.
const CLASS_WINDOW: usize = 4;
/// Shape classes remembered per chooser (the oldest is forgotten beyond this).
const MAX_CLASSES: usize = 256;

/// The features of a shape: a constant, thousands of descriptors, MiB.
fn features(s: Shape) -> [f64; 3] {
    [1.0, s.descs as f64 / 1024.0, s.bytes as f64 / (1u64 << 20) as f64]
}

/// A shape's class: transfers within a factor of two in descriptors and in bytes.
fn class(s: Shape) -> (u32, u32) {
    (s.descs.max(1).ilog2(), s.bytes.max(1).ilog2())
}

/// One path's cost over all shapes, fitted by least squares (µs per feature). It predicts shapes
/// never seen on this path; a shape class seen recently uses its own [`Recent`] estimate, since one
/// line cannot follow every machine (a direct WRITE's per-descriptor cost is only visible when
/// descriptor counts vary).
#[derive(Clone, Debug)]
struct Fit {
    theta: [f64; 3],
    /// Covariance of the estimate (how much a new sample may move each coefficient).
    p: [[f64; 3]; 3],
    samples: u32,
}

impl Fit {
    fn new(prior: [f64; 3]) -> Fit {
        // Loose around the prior: a handful of transfers outweigh it.
        let diag = [1e4, 1e6, 1e4];
        let p = core::array::from_fn(|i| core::array::from_fn(|j| if i == j { diag[i] } else { 0.0 }));
        Fit { theta: prior, p, samples: 0 }
    }

    fn predict(&self, s: Shape) -> f64 {
        let x = features(s);
        (0..3).map(|i| self.theta[i] * x[i]).sum::<f64>().max(0.1)
    }

    fn observe(&mut self, s: Shape, micros: f64) {
        let x = features(s);
        let px: [f64; 3] = core::array::from_fn(|i| (0..3).map(|j| self.p[i][j] * x[j]).sum());
        let denom = 1.0 + (0..3).map(|i| x[i] * px[i]).sum::<f64>();
        if !(denom.is_finite() && denom > 0.0 && micros.is_finite()) {
            return;
        }
        let k: [f64; 3] = core::array::from_fn(|i| px[i] / denom);
        let err = micros - (0..3).map(|i| self.theta[i] * x[i]).sum::<f64>();
        for (theta, k) in self.theta.iter_mut().zip(k) {
            // Costs are never negative: a coefficient pushed below zero by noise is clamped.
            *theta = (*theta + k * err).max(0.0);
        }
        for (row, k) in self.p.iter_mut().zip(k) {
            for (p, px) in row.iter_mut().zip(px) {
                *p -= k * px;
            }
        }
        self.samples = self.samples.saturating_add(1);
    }
}

/// A path's recent cost in one shape class, in µs per MiB-and-descriptor unit, scaled back to the
/// shape asked about. The estimate is the best of the last [`CLASS_WINDOW`] samples: a path's first
/// transfers pay one-off costs (connections, kernel loads) and a busy moment slows one transfer, and
/// neither should keep a path from being chosen; the window still follows a machine that slowed.
#[derive(Clone, Copy, Debug, Default)]
struct Recent {
    /// Observed µs ÷ the shape's size (MiB + descriptors/1024 + 1), newest at `samples % WINDOW`.
    window: [f64; CLASS_WINDOW],
    samples: u32,
}

fn units(s: Shape) -> f64 {
    let x = features(s);
    x[0] + x[1] + x[2]
}

impl Recent {
    fn observe(&mut self, s: Shape, micros: f64) {
        self.window[self.samples as usize % CLASS_WINDOW] = micros / units(s);
        self.samples = self.samples.saturating_add(1);
    }

    fn per_unit(&self) -> f64 {
        let n = (self.samples as usize).min(CLASS_WINDOW);
        self.window[..n].iter().copied().fold(f64::INFINITY, f64::min)
    }
}

/// The learned choice between [`Path::Direct`] and [`Path::Staged`] for one peer.
#[derive(Clone, Debug)]
pub struct PathChooser {
    fits: [Fit; 2],
    /// Per shape class, each path's recent estimate; oldest class first.
    classes: Vec<((u32, u32), [Recent; 2])>,
    decisions: u64,
    explored: [u64; 2],
}

impl Default for PathChooser {
    fn default() -> Self {
        Self::new()
    }
}

impl PathChooser {
    /// A chooser with no samples. The priors (a direct descriptor costs ~1 µs, staging ~100 GB/s
    /// with ~20 ns per descriptor) only order the first decisions; samples replace them quickly.
    pub fn new() -> PathChooser {
        PathChooser {
            fits: [Fit::new([10.0, 1000.0, 5.0]), Fit::new([30.0, 20.0, 10.0])],
            classes: Vec::new(),
            decisions: 0,
            explored: [0; 2],
        }
    }

    fn recent(&self, path: Path, shape: Shape) -> Recent {
        let c = class(shape);
        self.classes.iter().find(|(k, _)| *k == c).map(|(_, r)| r[path.index()]).unwrap_or_default()
    }

    /// The predicted time of `shape` on `path`, in µs: the shape class's recent cost where this
    /// path has moved such shapes, the fit over all shapes otherwise.
    pub fn predict(&self, path: Path, shape: Shape) -> f64 {
        let r = self.recent(path, shape);
        if r.samples > 0 {
            (r.per_unit() * units(shape)).max(0.1)
        } else {
            self.fits[path.index()].predict(shape)
        }
    }

    /// Samples seen on `path` (all shapes).
    pub fn samples(&self, path: Path) -> u32 {
        self.fits[path.index()].samples
    }

    /// Decisions that went against the prediction to keep both estimates current, per path.
    pub fn explored(&self, path: Path) -> u64 {
        self.explored[path.index()]
    }

    /// Which path a WRITE of `shape` takes (both are possible for it).
    pub fn choose(&mut self, shape: Shape) -> Path {
        self.decisions += 1;
        let (d, s) = (self.predict(Path::Direct, shape), self.predict(Path::Staged, shape));
        let best = if d <= s { Path::Direct } else { Path::Staged };
        let other = best.other();
        let ratio = d.max(s) / d.min(s);
        let seen = self.recent(other, shape).samples;
        let due = self.decisions.is_multiple_of(EXPLORE_EVERY);
        // A path tried once here gets its second sample whatever the first said: the first may have
        // paid a one-off cost, and it was plausible enough to be tried at all.
        let second = seen > 0 && seen < WARM_SAMPLES;
        if second || (ratio <= EXPLORE_MAX_RATIO && (seen < WARM_SAMPLES || due)) {
            self.explored[other.index()] += 1;
            return other;
        }
        best
    }

    /// A transfer of `shape` on `path` took `nanos` from post to completion.
    pub fn observe(&mut self, path: Path, shape: Shape, nanos: u64) {
        let micros = nanos as f64 / 1000.0;
        if !micros.is_finite() || micros > 3.6e9 {
            return;
        }
        self.fits[path.index()].observe(shape, micros);
        let c = class(shape);
        let i = match self.classes.iter().position(|(k, _)| *k == c) {
            Some(i) => i,
            None => {
                if self.classes.len() == MAX_CLASSES {
                    self.classes.remove(0);
                }
                self.classes.push((c, [Recent::default(); 2]));
                self.classes.len() - 1
            }
        };
        self.classes[i].1[path.index()].observe(shape, micros);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A machine: each path's true cost (µs fixed, µs per descriptor, GB/s).
    struct World {
        direct: (f64, f64, f64),
        staged: (f64, f64, f64),
    }

    impl World {
        fn cost(&self, path: Path, s: Shape) -> f64 {
            let (fixed, per_desc, gbps) = match path {
                Path::Direct => self.direct,
                Path::Staged => self.staged,
            };
            fixed + per_desc * s.descs as f64 + s.bytes as f64 / (gbps * 1e3)
        }
    }

    /// The shapes of gpu_push: 1k/4k/16k tokens, contiguous (128 merged descriptors) and
    /// fragmented (8 descriptors per token), 64 KiB per token.
    fn shapes() -> Vec<Shape> {
        let mut v = Vec::new();
        for tokens in [1024u64, 4096, 16384] {
            let bytes = tokens * 65536;
            v.push(Shape { descs: 128, bytes });
            v.push(Shape { descs: tokens * 8, bytes });
        }
        v
    }

    /// Plays `rounds` passes over the shapes with `jitter` noise; returns, over the last half,
    /// the total time taken divided by the total time of the better path each time.
    fn regret(world: &World, rounds: usize, jitter: f64) -> f64 {
        let mut c = PathChooser::new();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let (mut taken, mut best) = (0.0, 0.0);
        for round in 0..rounds {
            for s in shapes() {
                let p = c.choose(s);
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let noise = 1.0 + jitter * ((seed % 1000) as f64 / 1000.0 - 0.5);
                let t = world.cost(p, s) * noise;
                c.observe(p, s, (t * 1000.0) as u64);
                if round >= rounds / 2 {
                    taken += world.cost(p, s);
                    best += world.cost(Path::Direct, s).min(world.cost(Path::Staged, s));
                }
            }
        }
        taken / best
    }

    #[test]
    fn one_gpu_world_goes_direct_when_contiguous_and_staged_when_fragmented() {
        // P and D on one GPU: direct descriptors are cheap and fast, staging tops out lower.
        let world = World { direct: (15.0, 0.3, 650.0), staged: (40.0, 0.002, 100.0) };
        let mut c = PathChooser::new();
        for _ in 0..40 {
            for s in shapes() {
                let p = c.choose(s);
                c.observe(p, s, (world.cost(p, s) * 1000.0) as u64);
            }
        }
        let contiguous = Shape { descs: 128, bytes: 16384 * 65536 };
        let fragmented = Shape { descs: 16384 * 8, bytes: 16384 * 65536 };
        assert!(c.predict(Path::Direct, contiguous) < c.predict(Path::Staged, contiguous));
        assert!(c.predict(Path::Staged, fragmented) < c.predict(Path::Direct, fragmented));
        assert!(regret(&world, 200, 0.0) < 1.05, "regret {}", regret(&world, 200, 0.0));
    }

    #[test]
    fn nvlink_world_stages_everything_and_never_explores_the_slow_path_much() {
        // Two GPUs: every direct descriptor costs ~4 µs; staging is near the link's ceiling.
        let world = World { direct: (20.0, 4.0, 300.0), staged: (40.0, 0.002, 350.0) };
        let r = regret(&world, 200, 0.1);
        assert!(r < 1.05, "regret {r}");
        let mut c = PathChooser::new();
        let fragmented = Shape { descs: 16384 * 8, bytes: 16384 * 65536 };
        for _ in 0..100 {
            let p = c.choose(fragmented);
            c.observe(p, fragmented, (world.cost(p, fragmented) * 1000.0) as u64);
        }
        // The prior already puts direct far behind: it is never tried on this shape.
        assert_eq!(c.samples(Path::Direct), 0);
    }

    #[test]
    fn host_world_with_jitter_stays_within_five_percent() {
        // Host memory: descriptors are cheap either way, staging costs an extra copy.
        let world = World { direct: (8.0, 0.05, 20.0), staged: (25.0, 0.001, 12.0) };
        let r = regret(&world, 300, 0.2);
        assert!(r < 1.05, "regret {r}");
    }

    #[test]
    fn host_memory_between_processes_stages_fifo_requests_and_keeps_runs_direct() {
        // UCX's cma: ~2.5 µs per descriptor at ~5 GB/s; staging (gather, one WRITE per slot, scatter,
        // overlapped) a little below the link's rate, with a round trip up front.
        let world = World { direct: (15.0, 2.5, 5.0), staged: (80.0, 0.02, 4.6) };
        // The demo's workload (8 KiB of KV per token, 32 descriptors per request when merged into
        // one run), as FIFO pools cut it (runs of 1–4 blocks of 4 KiB per layer and K/V) and as runs.
        let fifo = |tokens: u64, blocks_per_run: u64| Shape {
            descs: 32 * tokens.div_ceil(16).div_ceil(blocks_per_run),
            bytes: tokens * 8192,
        };
        let runs = |tokens: u64| Shape { descs: 32, bytes: tokens * 8192 };
        let mut shapes = Vec::new();
        for tokens in [64u64, 512, 1024, 4096] {
            shapes.extend([fifo(tokens, 1), fifo(tokens, 4), runs(tokens)]);
        }
        let mut c = PathChooser::new();
        let (mut taken, mut best) = (0.0, 0.0);
        for round in 0..100 {
            for &s in &shapes {
                let p = c.choose(s);
                c.observe(p, s, (world.cost(p, s) * 1000.0) as u64);
                if round >= 50 {
                    taken += world.cost(p, s);
                    best += world.cost(Path::Direct, s).min(world.cost(Path::Staged, s));
                }
            }
        }
        assert!(taken / best < 1.05, "regret {}", taken / best);
        for tokens in [1024u64, 4096] {
            let (f, r) = (fifo(tokens, 1), runs(tokens));
            assert!(c.predict(Path::Staged, f) < c.predict(Path::Direct, f), "{tokens} tokens, FIFO");
            assert!(c.predict(Path::Direct, r) < c.predict(Path::Staged, r), "{tokens} tokens, one run");
        }
    }

    #[test]
    fn a_machine_that_changes_is_followed() {
        let fast_direct = World { direct: (15.0, 0.3, 650.0), staged: (40.0, 0.002, 100.0) };
        let slow_direct = World { direct: (15.0, 0.3, 50.0), staged: (40.0, 0.002, 100.0) };
        let mut c = PathChooser::new();
        let s = Shape { descs: 128, bytes: 16384 * 65536 };
        for _ in 0..100 {
            let p = c.choose(s);
            c.observe(p, s, (fast_direct.cost(p, s) * 1000.0) as u64);
        }
        assert_eq!(c.choose(s), Path::Direct);
        for _ in 0..400 {
            let p = c.choose(s);
            c.observe(p, s, (slow_direct.cost(p, s) * 1000.0) as u64);
        }
        let mut staged = 0;
        for _ in 0..64 {
            staged += usize::from(c.choose(s) == Path::Staged);
        }
        assert!(staged >= 60, "staged {staged} of 64 after direct slowed down");
    }

    #[test]
    fn a_slow_first_transfer_does_not_lock_a_path_out() {
        // Staging's first transfer pays a one-off 50 ms (connection, kernel load); it is then 3x
        // faster than direct for this shape.
        let s = Shape { descs: 128, bytes: 64 << 20 };
        let mut c = PathChooser::new();
        let mut staged_seen = 0;
        let mut last = Vec::new();
        for i in 0..40 {
            let p = c.choose(s);
            let t = match p {
                Path::Direct => 1100.0,
                Path::Staged if staged_seen == 0 => 50_000.0,
                Path::Staged => 350.0,
            };
            staged_seen += usize::from(p == Path::Staged);
            c.observe(p, s, (t * 1000.0) as u64);
            if i >= 30 {
                last.push(p);
            }
        }
        assert!(last.iter().all(|&p| p == Path::Staged), "{last:?}");
    }

    #[test]
    fn garbage_samples_do_not_poison_the_fit() {
        let mut c = PathChooser::new();
        let s = Shape { descs: 1, bytes: 0 };
        c.observe(Path::Direct, s, u64::MAX);
        c.observe(Path::Direct, Shape { descs: 0, bytes: 0 }, 0);
        let p = c.predict(Path::Direct, Shape { descs: 128, bytes: 1 << 30 });
        assert!(p.is_finite() && p > 0.0);
    }
}
