//! `kvpush demo`: a producer and a consumer engine in one process, pushing (and pulling) a workload
//! over the loopback transport, every byte verified.
//!
//! Read [`run`]. It builds a P engine and a D engine (each with `tp` workers) on the device
//! `KVPUSH_DEVICE` selects (host by default) and an in-process [`Fabric`], then plays one workload per
//! mode with the workload driver (`driver.rs`), the same one that drives the two-process demo
//! ([`procs`]). Each engine runs in the host a child process runs (`procs::WorkerState`): it takes
//! blocks from its engine's block pool, calls the engine API and polls results, timing every call
//! made on a request's behalf (the engine-thread time); a helper thread writes each request's KV into
//! P's blocks (standing in for the accelerator) or checks every byte that arrived on D against the
//! expected contents ([`pattern`]) before D's blocks are freed. Here the driver's commands go to the
//! hosts directly, and the hosts are stepped while the driver waits for an event.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use kvpush::device::{self, Buffer, Device};
use kvpush::engine::{Config, Engine, EngineError, Layerwise, LocalHub, Staging};
use kvpush::proto::layout::{
    BlockOrder, DType, GroupKind, KvGroup, KvKind, KvLayout, KvPlacement, ModelShape, Parallel,
};
use kvpush::proto::msg::Mode;
use kvpush::transport::loopback::Fabric;

// The workload's random source; `procs` seeds its own from the workload's seed too.
pub(crate) use crate::rng::Rng;

pub(crate) mod driver;
pub mod layerwise;
pub mod pattern;
pub mod procs;
pub mod stages;

use procs::{Role, Worker, WorkerSpec, WorkerState};

/// The model and parallel layout of the demo.
#[derive(Clone, Debug, Serialize)]
pub struct Topology {
    /// Layers of the model.
    pub layers: u32,
    /// KV heads of the model.
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Producer TP size.
    pub p_tp: u16,
    /// Consumer TP size.
    pub d_tp: u16,
    /// Producer block size (tokens).
    pub p_block: u32,
    /// Consumer block size (tokens).
    pub d_block: u32,
    /// Blocks per worker on each side.
    pub num_blocks: u32,
    /// Every n-th layer is a sliding-window layer (0: none).
    pub window_every: u32,
    /// Sliding window length in tokens.
    pub window_tokens: u32,
    /// Block order.
    pub order: BlockOrder,
    /// Writer threads per worker.
    pub writers: usize,
    /// Whether P stages fragmented WRITEs through bounded slots.
    pub staging: StagingFlag,
    /// Staging slots per side (0: the default).
    pub staging_slots: usize,
    /// Bytes of one staging slot (0: the default).
    pub staging_slot_bytes: u64,
    /// How the block pools hand out ids.
    pub allocator: AllocatorFlag,
    /// Each side hands its engine the request's tokens rounded up to its own whole blocks (what the
    /// vLLM connector does), rather than the exact count.
    pub whole_blocks: bool,
    /// P fills and D checks every slot of the blocks that hold a request (the tail of its last block,
    /// the head of a window's first block), not only its tokens: what the engine moves where both
    /// sides' blocks are the same size, and what vLLM CPU's packed blocks need. Only meaningful with
    /// `p_block == d_block`.
    pub whole_block_bytes: bool,
    /// P's engine setting for requests reported layer by layer ([`Workload::prefill_ns_per_layer`]).
    pub layerwise: LayerwiseFlag,
}

impl Topology {
    /// Whether P fills and D checks every slot of the blocks that hold a request, not only its tokens:
    /// when [`Topology::whole_block_bytes`] asks for it, and always where both sides' blocks are the
    /// same size, because the planner then moves whole blocks ([`kvpush::proto::plan::whole_blocks`])
    /// and every byte moved must be a byte checked.
    pub fn checks_whole_blocks(&self) -> bool {
        self.whole_block_bytes || self.p_block == self.d_block
    }

    /// A small P TP `p_tp` → D TP `d_tp` pair for the engine tests: 4 KV heads of 16 elements,
    /// 512 blocks a worker, sliding windows of 40 tokens (on no layer until `window_every` is set),
    /// and vLLM's FIFO pool, whose scattered ids exercise both merged and unmerged copies; the rest
    /// as [`Topology::default`]. Tests set the layers, block sizes and windows they vary.
    pub fn small(p_tp: u16, d_tp: u16) -> Self {
        Self {
            kv_heads: 4,
            head_dim: 16,
            p_tp,
            d_tp,
            num_blocks: 512,
            window_tokens: 40,
            allocator: AllocatorFlag::Fifo,
            ..Self::default()
        }
    }
}

/// `--layerwise` of an engine: [`Layerwise`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LayerwiseFlag {
    /// Layer by layer above the engine's size threshold, whole below.
    #[default]
    Auto,
    /// Always layer by layer.
    On,
    /// Always whole.
    Off,
}

impl LayerwiseFlag {
    /// The engine setting.
    pub fn engine(self) -> Layerwise {
        match self {
            LayerwiseFlag::Auto => Layerwise::AUTO,
            LayerwiseFlag::On => Layerwise::On,
            LayerwiseFlag::Off => Layerwise::Off,
        }
    }

    /// The flag's value on a command line.
    pub fn as_str(self) -> &'static str {
        match self {
            LayerwiseFlag::Auto => "auto",
            LayerwiseFlag::On => "on",
            LayerwiseFlag::Off => "off",
        }
    }
}

/// `--staging`: whether the engines stage fragmented WRITEs ([`Staging`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum StagingFlag {
    /// Measured per WRITE for GPU memory and for host memory over NIXL (two processes), off elsewhere.
    #[default]
    Auto,
    /// Always (the default geometry: 4 slots of 32 MiB per side).
    On,
    /// Never.
    Off,
}

impl StagingFlag {
    /// The engine setting; `slots` and `slot_bytes` (0: the default) shape the slots when on.
    pub fn engine(self, slots: usize, slot_bytes: u64) -> Staging {
        let mut c = kvpush::transport::staged::StagingConfig::default();
        if slots > 0 {
            c.slots = slots;
        }
        if slot_bytes > 0 {
            c.slot_bytes = slot_bytes;
        }
        let setting = match self {
            StagingFlag::Auto => Staging::Auto,
            StagingFlag::On => Staging::On(c),
            StagingFlag::Off => Staging::Off,
        };
        if c == kvpush::transport::staged::StagingConfig::default() {
            setting
        } else {
            setting.with_geometry(c)
        }
    }

    /// The flag's value on a command line.
    pub fn as_str(self) -> &'static str {
        match self {
            StagingFlag::Auto => "auto",
            StagingFlag::On => "on",
            StagingFlag::Off => "off",
        }
    }
}

impl Default for Topology {
    /// One TP-8 rank of Qwen3-32B (1 KV head of 8, head dim 128, bf16, 16-token blocks) over 16 of its
    /// 64 layers: 8 KiB of KV per token.
    fn default() -> Self {
        Self {
            layers: 16,
            kv_heads: 1,
            head_dim: 128,
            p_tp: 1,
            d_tp: 1,
            p_block: 16,
            d_block: 16,
            num_blocks: 4096,
            window_every: 0,
            window_tokens: 1024,
            order: BlockOrder::Hnd,
            writers: 1,
            staging: StagingFlag::Auto,
            staging_slots: 0,
            staging_slot_bytes: 0,
            allocator: AllocatorFlag::Runs,
            whole_blocks: false,
            layerwise: LayerwiseFlag::Auto,
            whole_block_bytes: false,
        }
    }
}

/// The token count one side hands its engine for a request of `tokens` tokens (see
/// [`Topology::whole_blocks`]).
pub(crate) fn side_tokens(t: &Topology, tokens: u64, block: u32) -> u64 {
    if t.whole_blocks {
        kvpush::proto::msg::blocks_for(tokens, block) * u64::from(block)
    } else {
        tokens
    }
}

/// The requests of the demo.
#[derive(Clone, Debug, Serialize)]
pub struct Workload {
    /// Number of requests.
    pub requests: usize,
    /// Shortest prompt (tokens).
    pub min_tokens: u64,
    /// Longest prompt (tokens); lengths are log-uniform in between.
    pub max_tokens: u64,
    /// Requests in flight at once at most.
    pub concurrency: usize,
    /// Simulated prefill time per token (ns).
    pub prefill_ns_per_token: u64,
    /// Router delay between the two legs (µs): pull relays P's block ids to D after it; in push, a
    /// blocks-first request's registration comes this late.
    pub relay_us: u64,
    /// Seed of lengths, orders and contents.
    pub seed: u64,
    /// P's simulated compute per layer (ns), after the per-token time: layer `l` is final
    /// `(l + 1) ×` this after it. 0: no per-layer compute (the request is finished at once).
    pub prefill_ns_per_layer: u64,
    /// P reports each layer as it is final ([`kvpush::engine::Engine::layers_ready`]; the engine's
    /// [`Topology::layerwise`] decides how it goes) rather than the whole request after the last.
    pub layerwise: bool,
    /// Every push request registration-first (D registers when the request is admitted, as a push
    /// router sends both legs at once), instead of half of them blocks-first.
    pub registration_first: bool,
}

impl Default for Workload {
    fn default() -> Self {
        Self {
            requests: 200,
            min_tokens: 32,
            max_tokens: 4096,
            concurrency: 32,
            prefill_ns_per_token: 250,
            relay_us: 200,
            seed: 0x6b76_7075_7368,
            prefill_ns_per_layer: 0,
            layerwise: false,
            registration_first: false,
        }
    }
}

/// Results of one mode, as printed and written to JSON.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ModeReport {
    /// Requests played.
    pub requests: u64,
    /// Bytes moved (as planned).
    pub bytes: u64,
    /// Bytes checked on D.
    pub verified_bytes: u64,
    /// Requests whose every byte on D was checked and matched (counted from the checks, not from the
    /// workload).
    pub verified: u64,
    /// Requests that failed or arrived wrong.
    pub failed: u64,
    /// Copies before merging.
    pub descriptors_unmerged: u64,
    /// Descriptors posted.
    pub descriptors_posted: u64,
    /// Transfers P's engine posted (one WRITE per rank pair and request; layer-wise, per range).
    pub producer_posts: u64,
    /// Median time from blocks-ready on P to received on D (µs).
    ///
    /// With per-layer compute ([`Workload::prefill_ns_per_layer`]) blocks-ready is P's last layer
    /// computed, so this is the time the transfer adds after prefill (its "exposed" time).
    pub latency_us_p50: u64,
    /// 99th percentile of the same (µs).
    pub latency_us_p99: u64,
    /// Median engine-thread time per request (µs, all API calls made for it on both sides).
    pub engine_us_p50: f64,
    /// 99th percentile of the same (µs).
    pub engine_us_p99: f64,
    /// Wall time of the mode (s).
    pub wall_s: f64,
    /// Bytes moved over wall time (GB/s).
    pub gbps: f64,
    /// Two-process NIXL runs: one single-descriptor NIXL WRITE of the bytes this mode moved (capped at
    /// 1 GiB), the median of the rounds (GB/s) — the ceiling through NIXL on this machine.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ceiling_gbps: Option<f64>,
    /// Each round's ceiling WRITE (GB/s), interleaved with `push_gbps_rounds`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ceiling_gbps_rounds: Vec<f64>,
    /// Two-process NIXL runs, push: the same requests pushed with every one ready at once (registrations
    /// first, no simulated prefill, as many in flight as the pools hold): bytes over the time from the
    /// first blocks-ready to the last received, summed over the waves the pools allow; the median of
    /// the rounds (GB/s).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub push_gbps: Option<f64>,
    /// Each round's push bandwidth (GB/s), interleaved with `ceiling_gbps_rounds`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub push_gbps_rounds: Vec<f64>,
    /// Each push round's descriptors posted (after merging): how fragmented the pools were.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub push_descriptors_rounds: Vec<u64>,
    /// Each push round's staged pieces (one WRITE each; 0 where staging is off).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub push_pieces_rounds: Vec<u64>,
    /// Per received request: `(request index, tokens, latency µs)` (what [`layerwise::compare`]
    /// pairs; not in the JSON).
    #[serde(skip)]
    pub exposed: Vec<(usize, u64, u64)>,
    /// Per received request: `(key, P's ready µs, D's outcome µs)` on the shared wall clock, for
    /// [`stages::split`] (not in the JSON).
    #[serde(skip)]
    pub ends: Vec<(kvpush::proto::Key, u64, u64)>,
    /// Two-process runs with the engines' timelines on (`--layerwise compare`): where the time from
    /// P's ready to D's outcome went, per stage ([`stages`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stages: Option<stages::StageSplit>,
}

/// Results of the demo: one report per mode played.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    /// Push mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub push: Option<ModeReport>,
    /// Pull mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pull: Option<ModeReport>,
    /// `--layerwise compare`: the push run (layer by layer) against the same requests pushed whole.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layerwise: Option<layerwise::LayerwiseReport>,
}

/// What can stop the demo.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DemoError {
    /// The device could not be selected or allocated.
    #[error("device: {0}")]
    Device(#[from] device::DeviceError),
    /// An engine call failed.
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
    /// The transport could not be set up.
    #[error("transport: {0}")]
    Transport(#[from] kvpush::transport::TransportError),
    /// The configuration cannot work.
    #[error("configuration: {0}")]
    Config(String),
    /// An engine of the in-process demo reported an error.
    #[error("{role} engine: {message}")]
    Host {
        /// Which.
        role: Role,
        /// What.
        message: String,
    },
    /// Requests did not finish in time.
    #[error("{0}")]
    Stuck(String),
}

/// The model shape of topology `t`: every `window_every`-th layer a sliding-window layer.
pub fn model(t: &Topology) -> ModelShape {
    let (mut full, mut window) = (Vec::new(), Vec::new());
    for l in 0..t.layers {
        if t.window_every > 0 && l % t.window_every == t.window_every - 1 {
            window.push(l);
        } else {
            full.push(l);
        }
    }
    let mut groups = vec![KvGroup { kind: GroupKind::Full, layers: full }];
    if !window.is_empty() {
        groups.push(KvGroup { kind: GroupKind::SlidingWindow { window_tokens: t.window_tokens }, layers: window });
    }
    ModelShape {
        total_layers: t.layers,
        kv_heads: t.kv_heads,
        head_dim: t.head_dim,
        dtype: DType::Bf16,
        kind: KvKind::KeyValue,
        groups,
    }
}

/// Allocates one worker's KV memory and describes it.
pub(crate) fn worker_layout(
    t: &Topology,
    dev: &dyn Device,
    tp_rank: u16,
    tp: u16,
    block: u32,
) -> Result<(KvLayout, Vec<Box<dyn Buffer>>), DemoError> {
    let mut l = KvLayout {
        model: model(t),
        block_tokens: block,
        order: t.order,
        placement: KvPlacement::Separate,
        block_stride: 0,
        num_blocks: t.num_blocks,
        parallel: Parallel { tp_rank, tp_size: tp, pp_rank: 0, pp_size: 1 },
        region_bases: Vec::new(),
    };
    l.block_stride = l.part_bytes();
    let buffers = crate::layouts::allocate(&mut l, dev)?;
    l.validate().map_err(|e| DemoError::Config(e.to_string()))?;
    Ok((l, buffers))
}

/// `--allocator`: how the demo's block pools hand out block ids.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum AllocatorFlag {
    /// A request's blocks as one run of consecutive ids where a free run is long enough (first
    /// fit), else the lowest free ids: transfers merge into a few descriptors per layer.
    #[default]
    Runs,
    /// A FIFO free queue, like vLLM's block pool: after some churn a request's ids are scattered, and
    /// transfers post about one descriptor per block per layer.
    Fifo,
}

impl AllocatorFlag {
    /// The flag's value on a command line.
    pub fn as_str(self) -> &'static str {
        match self {
            AllocatorFlag::Runs => "runs",
            AllocatorFlag::Fifo => "fifo",
        }
    }
}

/// A block pool shared by the workers of one engine (they share the block table, as in vLLM).
pub(crate) struct Pool {
    kind: AllocatorFlag,
    /// FIFO: the free ids in queue order.
    queue: VecDeque<u32>,
    /// Runs: whether each id is free.
    is_free: Vec<bool>,
    free: usize,
}

impl Pool {
    pub(crate) fn new(n: u32, kind: AllocatorFlag) -> Self {
        let (queue, is_free) = match kind {
            AllocatorFlag::Fifo => ((0..n).collect(), Vec::new()),
            AllocatorFlag::Runs => (VecDeque::new(), vec![true; n as usize]),
        };
        Self { kind, queue, is_free, free: n as usize }
    }

    /// Free blocks.
    pub(crate) fn free(&self) -> usize {
        self.free
    }

    pub(crate) fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.free < n {
            return None;
        }
        self.free -= n;
        if self.kind == AllocatorFlag::Fifo {
            return Some(self.queue.drain(..n).collect());
        }
        // First fit: the first run of `n` free ids; failing that, the lowest free ids.
        let mut run = 0;
        let end = self.is_free.iter().position(|&f| {
            run = if f { run + 1 } else { 0 };
            run == n
        });
        let ids: Vec<u32> = match end {
            Some(end) => (end + 1 - n..=end).map(|i| i as u32).collect(),
            None => self.is_free.iter().enumerate().filter(|(_, &f)| f).map(|(i, _)| i as u32).take(n).collect(),
        };
        for &i in &ids {
            self.is_free[i as usize] = false;
        }
        Some(ids)
    }

    pub(crate) fn give(&mut self, ids: impl IntoIterator<Item = u32>) {
        for i in ids {
            self.free += 1;
            match self.kind {
                AllocatorFlag::Fifo => self.queue.push_back(i),
                AllocatorFlag::Runs => self.is_free[i as usize] = true,
            }
        }
    }
}

/// Block ids per KV group.
pub(crate) type BlockLists = Vec<Vec<u32>>;

/// A row of the table: label and how to render it from a mode's report.
type Row = (&'static str, fn(&ModeReport) -> String);

/// Prompt lengths and orders of the workload (log-uniform lengths).
pub fn requests(w: &Workload) -> Vec<(u64, bool)> {
    let mut rng = Rng(w.seed);
    let (lo, hi) = ((w.min_tokens.max(1)) as f64, (w.max_tokens.max(w.min_tokens.max(1))) as f64);
    (0..w.requests)
        .map(|_| {
            let tokens = (lo.ln() + rng.unit() * (hi.ln() - lo.ln())).exp().round() as u64;
            (tokens.clamp(lo as u64, hi as u64), rng.next() & 1 == 0)
        })
        .collect()
}

impl ModeReport {
    /// A mode's report from its outcome counts, its wall time (s) and each worker's engine counters
    /// (bytes, descriptors before merging, descriptors posted), summed.
    pub(crate) fn new(
        requests: u64,
        verified_bytes: u64,
        verified: u64,
        failed: u64,
        wall_s: f64,
        counters: impl IntoIterator<Item = (u64, u64, u64)>,
    ) -> Self {
        let mut report = ModeReport { requests, verified_bytes, verified, failed, wall_s, ..Default::default() };
        for (bytes, unmerged, posted) in counters {
            report.bytes += bytes;
            report.descriptors_unmerged += unmerged;
            report.descriptors_posted += posted;
        }
        report
    }

    /// Fills the percentiles from the requests' latencies (µs) and engine-thread times (ns), and the
    /// bandwidth from `bytes` over `wall_s`.
    pub(crate) fn summarize(&mut self, mut latencies_us: Vec<u64>, engine_ns: impl Iterator<Item = u64>) {
        latencies_us.sort_unstable();
        self.latency_us_p50 = pct(&latencies_us, 0.5);
        self.latency_us_p99 = pct(&latencies_us, 0.99);
        let mut engine_us: Vec<f64> = engine_ns.map(|ns| ns as f64 / 1000.0).collect();
        engine_us.sort_unstable_by(f64::total_cmp);
        self.engine_us_p50 = pct(&engine_us, 0.5);
        self.engine_us_p99 = pct(&engine_us, 0.99);
        self.gbps = self.bytes as f64 / self.wall_s / 1e9;
    }
}

/// Percentile of a sorted slice.
pub(crate) fn pct<T: Copy + Default>(sorted: &[T], q: f64) -> T {
    if sorted.is_empty() {
        return T::default();
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// The median of `values` (the mean of the middle two for an even count); `None` when empty.
pub(crate) fn median(values: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 })
}

/// The bytes D must hold after workload `w` on topology `t`, from the two alone: every token of the
/// full-attention layers and the last `window_tokens` tokens of the sliding-window layers, K and V of
/// every head, in bf16; with [`Topology::whole_block_bytes`], every slot of the blocks holding those
/// tokens.
pub fn expected_bytes(t: &Topology, w: &Workload) -> u64 {
    let per_token_layer = 2 * u64::from(t.kv_heads) * u64::from(t.head_dim) * 2; // K and V, bf16
    let window_layers =
        (0..t.layers).filter(|l| t.window_every > 0 && l % t.window_every == t.window_every - 1).count() as u64;
    let full_layers = u64::from(t.layers) - window_layers;
    requests(w)
        .iter()
        .map(|&(n, _)| {
            let window = n.min(u64::from(t.window_tokens));
            let (full, window) = if t.checks_whole_blocks() {
                // Whole blocks: up to the end of the last block, from the start of the window's first.
                let bt = u64::from(t.d_block);
                let end = n.div_ceil(bt) * bt;
                (end, end - (n - window) / bt * bt)
            } else {
                (n, window)
            };
            per_token_layer * (full_layers * full + window_layers * window)
        })
        .sum()
}

/// Runs the demo: each mode in `modes` on the same workload. `tick` is called once per finished
/// request (for a progress bar).
pub fn run(t: &Topology, w: &Workload, modes: &[Mode], tick: &dyn Fn()) -> Result<Report, DemoError> {
    let dev = device::from_env()?;
    let mut report = Report::default();
    for &mode in modes {
        let r = run_mode(t, w, mode, dev.clone(), tick)?;
        match mode {
            Mode::Push => report.push = Some(r),
            Mode::Pull => report.pull = Some(r),
        }
    }
    Ok(report)
}

/// One [`pattern::Mover`] per worker of an engine on `dev` (whole blocks: see
/// [`Topology::whole_block_bytes`]), or why they cannot be made.
pub(crate) fn movers(dev: &dyn Device, workers: usize, whole: bool) -> Result<Vec<pattern::Mover>, String> {
    (0..workers)
        .map(|_| {
            pattern::Mover::new(dev)
                .map(|m| m.whole_blocks(whole))
                .map_err(|e| format!("demo fill/verify on {}: {e}", dev.kind()))
        })
        .collect()
}

/// What the workers of one engine share.
struct Medium<'a> {
    dev: &'a Arc<dyn Device>,
    fabric: &'a Fabric,
    hub: &'a Arc<LocalHub>,
}

fn build(
    t: &Topology,
    mode: Mode,
    m: &Medium<'_>,
    engine_id: &str,
    tp: u16,
    block: u32,
) -> Result<Vec<Worker>, DemoError> {
    let Medium { dev, fabric, hub } = *m;
    let mut workers = Vec::new();
    for r in 0..tp {
        let (layout, buffers) = worker_layout(t, dev.as_ref(), r, tp, block)?;
        // The endpoint copies the device's memory as the device says (through the GPU for CUDA).
        let transport = Arc::new(fabric.endpoint_on(&format!("{engine_id}/{r}"), dev.clone())?);
        let mut config = Config::new(engine_id, mode);
        config.writers = t.writers;
        config.staging = t.staging.engine(t.staging_slots, t.staging_slot_bytes);
        config.layerwise = t.layerwise.engine();
        // SAFETY: the regions are `buffers`, allocated just above and owned by the same `Worker`
        // as the engine; `Worker` drops its engine before its buffers. The engine's host
        // (`WorkerState`) follows the block ownership rules: P's blocks return to the pool only
        // after `Finished::Sent` from every worker, D's only after every worker reported the
        // request's outcome (and after verification, which only reads them).
        let engine = unsafe { Engine::new(config, layout, dev.clone(), transport, hub.clone()) }?;
        hub.attach(engine.addr().clone(), engine.sink());
        workers.push(Worker { engine, side: None, buffers, transport: None });
    }
    Ok(workers)
}

fn run_mode(
    t: &Topology,
    w: &Workload,
    mode: Mode,
    dev: Arc<dyn Device>,
    tick: &dyn Fn(),
) -> Result<ModeReport, DemoError> {
    let fabric = Fabric::new();
    let hub = LocalHub::new();
    let medium = Medium { dev: &dev, fabric: &fabric, hub: &hub };
    let p = build(t, mode, &medium, "prefill", t.p_tp, t.p_block)?;
    let d = build(t, mode, &medium, "decode", t.d_tp, t.d_block)?;
    for a in &p {
        for b in &d {
            b.engine.add_peer(&a.engine.handshake()?)?;
            a.engine.add_peer(&b.engine.handshake()?)?;
        }
    }
    let host = |role: Role, workers| {
        WorkerState::new(&WorkerSpec::new(role, mode, t), Arc::clone(&dev), workers)
            .map_err(|message| DemoError::Host { role, message })
    };
    let mut local = Local { p: host(Role::Prefill, p)?, d: host(Role::Decode, d)? };
    let report = driver::play(&mut local, t, w, mode, tick);
    local.p.shutdown();
    local.d.shutdown();
    report
}

/// Both engines in this process: the driver's commands go straight to their hosts, which are
/// stepped while the driver waits for an event.
struct Local {
    p: WorkerState,
    d: WorkerState,
}

impl Local {
    fn pop(&mut self) -> Result<Option<(Role, procs::Event)>, DemoError> {
        for (role, host) in [(Role::Prefill, &mut self.p), (Role::Decode, &mut self.d)] {
            match host.pop() {
                Some(procs::Event::Error { message }) => return Err(DemoError::Host { role, message }),
                Some(ev) => return Ok(Some((role, ev))),
                None => {}
            }
        }
        Ok(None)
    }
}

impl driver::Side for Local {
    type Error = DemoError;

    fn send(&mut self, role: Role, cmd: &procs::Command) -> Result<(), DemoError> {
        // What the command emits (an error too) comes out of `next`.
        match role {
            Role::Prefill => self.p.command(cmd.clone()),
            Role::Decode => self.d.command(cmd.clone()),
        }
        Ok(())
    }

    fn next(&mut self, wait: Duration) -> Result<Option<(Role, procs::Event)>, DemoError> {
        let deadline = Instant::now() + wait;
        loop {
            if let Some(ev) = self.pop()? {
                return Ok(Some(ev));
            }
            self.p.step();
            self.d.step();
            if let Some(ev) = self.pop()? {
                return Ok(Some(ev));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    fn fail(&mut self, role: Role, message: String) -> DemoError {
        DemoError::Host { role, message }
    }
}

/// Renders the report as a table.
pub fn table(r: &Report) -> String {
    let modes: Vec<(&str, &ModeReport)> = [("push", r.push.as_ref()), ("pull", r.pull.as_ref())]
        .into_iter()
        .filter_map(|(n, m)| m.map(|m| (n, m)))
        .collect();
    let mut s = format!("{:<34}", "");
    for (n, _) in &modes {
        s += &format!("{n:>16}");
    }
    s.push('\n');
    let rows: [Row; 13] = [
        ("requests", |m| m.requests.to_string()),
        ("failed", |m| m.failed.to_string()),
        ("bytes moved", |m| format!("{:.1} MiB", m.bytes as f64 / 1048576.0)),
        ("requests verified", |m| m.verified.to_string()),
        ("bytes verified", |m| format!("{:.1} MiB", m.verified_bytes as f64 / 1048576.0)),
        ("descriptors before merging", |m| m.descriptors_unmerged.to_string()),
        ("descriptors posted", |m| m.descriptors_posted.to_string()),
        ("blocks-ready -> received p50", |m| format!("{} us", m.latency_us_p50)),
        ("blocks-ready -> received p99", |m| format!("{} us", m.latency_us_p99)),
        ("engine-thread time/request p50", |m| format!("{:.1} us", m.engine_us_p50)),
        ("engine-thread time/request p99", |m| format!("{:.1} us", m.engine_us_p99)),
        ("wall time", |m| format!("{:.2} s", m.wall_s)),
        ("throughput", |m| format!("{:.2} GB/s", m.gbps)),
    ];
    for (name, f) in rows {
        s += &format!("{name:<34}");
        for (_, m) in &modes {
            s += &format!("{:>16}", f(m));
        }
        s.push('\n');
    }
    fn gbps(v: Option<f64>) -> String {
        v.map(|g| format!("{g:.2} GB/s")).unwrap_or_else(|| "-".into())
    }
    let optional: [(Row, bool); 3] = [
        (
            ("NIXL 1-descriptor WRITE (ceiling)", |m| gbps(m.ceiling_gbps)),
            modes.iter().any(|(_, m)| m.ceiling_gbps.is_some()),
        ),
        (("push bandwidth, all ready", |m| gbps(m.push_gbps)), modes.iter().any(|(_, m)| m.push_gbps.is_some())),
        (
            ("push bandwidth / ceiling", |m| match (m.push_gbps, m.ceiling_gbps) {
                (Some(p), Some(c)) if c > 0.0 => format!("{:.0} %", 100.0 * p / c),
                _ => "-".into(),
            }),
            modes.iter().any(|(_, m)| m.push_gbps.is_some() && m.ceiling_gbps.is_some()),
        ),
    ];
    for ((name, f), shown) in optional {
        if !shown {
            continue;
        }
        s += &format!("{name:<34}");
        for (_, m) in &modes {
            s += &format!("{:>16}", f(m));
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::{median, AllocatorFlag, Pool};

    #[test]
    fn run_pools_hand_out_runs_first_fit_and_fifo_pools_in_queue_order() {
        let mut p = Pool::new(16, AllocatorFlag::Runs);
        assert_eq!(p.take(4), Some(vec![0, 1, 2, 3]));
        assert_eq!(p.take(4), Some(vec![4, 5, 6, 7]));
        assert_eq!(p.take(4), Some(vec![8, 9, 10, 11]));
        // Holes of 2 (ids 1, 2) and 4 (ids 8..12): a request of 3 takes the first hole that fits.
        p.give([1, 2]);
        p.give([8, 9, 10, 11]);
        assert_eq!(p.free(), 10);
        assert_eq!(p.take(3), Some(vec![8, 9, 10]));
        // No run of 7 is free (1, 2, 11, 12..16): the lowest free ids.
        assert_eq!(p.take(7), Some(vec![1, 2, 11, 12, 13, 14, 15]));
        assert_eq!((p.free(), p.take(1)), (0, None));
        p.give([5]);
        assert_eq!(p.take(1), Some(vec![5]));

        let mut f = Pool::new(8, AllocatorFlag::Fifo);
        assert_eq!(f.take(3), Some(vec![0, 1, 2]));
        f.give([1, 0]);
        assert_eq!(f.take(6), Some(vec![3, 4, 5, 6, 7, 1]));
        assert_eq!((f.free(), f.take(2)), (1, None));
    }

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[f64::NAN, 5.0]), Some(5.0));
        assert_eq!(median(&[]), None);
    }
}
