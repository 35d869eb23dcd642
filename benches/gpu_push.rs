//! GPU push bench: P and D as two processes, one GPU each, a KV cache in VRAM of the Qwen3-32B
//! per-rank shape (TP 8: 64 layers, 1 KV head, head dim 128, bf16, 16-token blocks; K and V in
//! separate regions, 4 KiB per block per region), requests pushed over NIXL (UCX) and verified on D.
//!
//! For each request size (1k, 4k, 16k tokens) and block-id pattern — (a) contiguous ids, (b)
//! fragmented ids (independent random permutations of the block pool on both sides) — it measures,
//! with `blocks-ready → received` timed from P filling its blocks to D holding every byte (one
//! `CLOCK_MONOTONIC`, both processes on one host):
//!
//! * `direct`: kvpush's planner merges runs contiguous on both sides and posts one WRITE of the
//!   merged descriptors (128 descriptors for a contiguous request: one per layer and K/V);
//! * `per_block`: the reference a per-block connector posts, one descriptor per block per layer per
//!   K/V (131072 at 16k tokens), from NIXL prepared lists;
//! * `staged`: gather kernel on P packs the request's blocks into a bounded staging buffer (`--slots`
//!   slots of `--slot-mib`), one WRITE per slot-sized piece into D's staging slot of the same number,
//!   scatter kernel on D unpacks; D returns a credit per slot, so a request larger than the staging
//!   buffer streams through it (see `kvpush_cuda::unitpack`);
//! * `engine`: kvpush itself, end to end — each side runs a [`kvpush::engine::Engine`] (P `prefill`,
//!   D `decode`, push mode, one worker) over the same KV cache with its own NIXL agent and a
//!   [`SideChannel`] on 127.0.0.1 as its control link, and with the engine's own staging
//!   ([`Staging::On`] with `--slots` × `--slot-mib`: `kvpush::transport::staged` over the device's
//!   stager, `CudaStager` on a GPU, `HostStager` in host memory). Per iteration D registers its
//!   blocks (`blocks_allocated`) while it prepares, so the registration is normally at P before P's
//!   blocks are ready (registration first; the time then is the push alone), P calls
//!   `request_finished` at blocks-ready and polls until `Finished::Sent`, D polls until
//!   `Finished::Received`. The engine decides what it stages (a contiguous request's merged
//!   descriptors qualify too); the JSON records, per case, P's `descriptors_posted` and the staging
//!   counters (pieces, entries) of the last iteration. A failing engine case is recorded with its
//!   error and the remaining engine cases are skipped; the other methods go on;
//!
//! and, in the same run, the ceiling: one `--ceiling-mib` single-descriptor WRITE between the same two
//! processes. The JSON (`--json`) carries every sample and, for 16k tokens, `contiguous_ratio` and
//! `fragmented_ratio`: kvpush's engine (the `engine` method; where it did not run, the best of the
//! bench's own methods) over the ceiling, medians; `engine_contiguous_ratio` and
//! `engine_fragmented_ratio` repeat the engine's; `pipeline` holds the best of the bench's own
//! pipelines (`direct`, `staged`) beside it.
//!
//! Process model: this binary is the orchestrator; it starts itself twice (`--role p`, `--role d`)
//! and drives both in lock step over their stdin/stdout (JSON lines prefixed `@@kvp `; anything else a
//! child prints goes to stderr). With `--visible split` (default) each child sees only its GPU
//! (`CUDA_VISIBLE_DEVICES`), so both are device 0; with `--visible all` both see both GPUs and P
//! uses device 0, D device 1 (each agent's metadata names its device for the peer's descriptors).
//! `--memory host` runs the same code over host memory with CPU gather/scatter (for machines without
//! a GPU).
//!
//! `cargo bench --bench gpu_push -- --json out.json` runs the measurement (needs two GPUs, NIXL and
//! NVRTC: scripts/gpu_bench.sh sets them up). Without `--bench` (as `cargo test` runs it) it runs a
//! small host-memory pass over real NIXL and checks every byte.

use std::collections::VecDeque;
use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use crossbeam_channel::{Receiver, RecvTimeoutError};
use kvpush::device::cuda::{CudaBuffer, CudaDevice};
use kvpush::device::host::{HostBuffer, HostDevice};
use kvpush::device::{Buffer, Device, MemRegion};
use kvpush::engine::side::{SideChannel, SideConfig};
use kvpush::engine::{Config as EngineConfig, Engine, Finished, Staging};
use kvpush::proto::layout::{
    BlockOrder, DType, GroupKind, KvGroup, KvKind, KvLayout, KvPlacement, ModelShape, Parallel,
};
use kvpush::proto::plan::{PlanInput, Planner};
use kvpush::proto::rendezvous::ReleaseReason;
use kvpush::proto::{Key, Mode};
use kvpush::transport::nixl::{NixlConfig, NixlTransport};
use kvpush::transport::staged::{PathChoice, StagingConfig};
use kvpush::transport::{Desc, Op, Transport, Units, XferId, XferState};
use kvpush_cuda::unitpack::{self as unitpack, Pack, PackPlan, Piece, Side, UnitSpace};
use kvpush_cuda::{Event, Kernels, Stream, UnitTable};
use kvpush_testkit::child::{self, Channel, Child, Incoming};
use kvpush_testkit::rng::Rng;
use serde::{Deserialize, Serialize};

const POISON: u8 = 0xa5;
const STEP_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
enum MemoryKind {
    Cuda,
    Host,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
enum Visible {
    /// Each process sees only its GPU (`CUDA_VISIBLE_DEVICES`): both use device 0.
    Split,
    /// Both processes see every GPU; P uses `--gpus[0]`, D `--gpus[1]`. Each side's NIXL metadata
    /// names its device, so remote descriptors carry the peer's own ordinal.
    All,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
enum Role {
    P,
    D,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Method {
    Direct,
    PerBlock,
    Staged,
    /// kvpush's `Engine` on both sides, staging on (see the file's documentation).
    Engine,
    Ceiling,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Pattern {
    Contiguous,
    Fragmented,
}

/// How the engine method's WRITEs pick their path (`--engine-path`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum EnginePath {
    Measured,
    Staged,
}

/// GPU push bench (see the file's documentation).
#[derive(Parser, Debug, Clone, Serialize, Deserialize)]
#[command(name = "gpu_push")]
struct Args {
    /// Run the measurement (cargo bench passes this). Without it: a small host-memory self-test.
    #[arg(long)]
    bench: bool,
    /// Memory of the KV caches.
    #[arg(long, value_enum, default_value = "cuda")]
    memory: MemoryKind,
    /// Request sizes in tokens.
    #[arg(long, value_delimiter = ',', default_value = "1024,4096,16384")]
    tokens: Vec<u64>,
    /// Methods to measure.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "direct,per-block,staged,engine")]
    methods: Vec<Method>,
    /// Model layers (each has a K and a V region).
    #[arg(long, default_value_t = 64)]
    layers: u32,
    /// Blocks in each side's pool (every region holds this many).
    #[arg(long, default_value_t = 2048)]
    pool_blocks: u32,
    /// Bytes of the ceiling WRITE, MiB (≤ the KV cache).
    #[arg(long, default_value_t = 512)]
    ceiling_mib: u64,
    /// Staging slot size, MiB (fractions allowed via --slot-kib).
    #[arg(long, default_value_t = 32)]
    slot_mib: u64,
    /// Staging slot size in KiB; overrides --slot-mib when set.
    #[arg(long)]
    slot_kib: Option<u64>,
    /// Staging slots per side.
    #[arg(long, default_value_t = 4)]
    slots: u32,
    /// Untimed iterations per case.
    #[arg(long, default_value_t = 2)]
    warmup: u32,
    /// Timed iterations per case.
    #[arg(long, default_value_t = 5)]
    reps: u32,
    /// Timed iterations for the per-block reference (slow: one descriptor per 4 KiB).
    #[arg(long, default_value_t = 3)]
    per_block_reps: u32,
    /// Where to write the JSON results.
    #[arg(long)]
    json: Option<PathBuf>,
    /// How the two processes see the GPUs.
    #[arg(long, value_enum, default_value = "split")]
    visible: Visible,
    /// Physical GPU of P and of D.
    #[arg(long, value_delimiter = ',', default_value = "0,1")]
    gpus: Vec<u32>,
    /// NIXL backend.
    #[arg(long, default_value = "UCX")]
    backend: String,
    /// Seed of block-id permutations and data patterns.
    #[arg(long, default_value_t = 0x5eed_cafe)]
    seed: u64,
    /// How the engine method picks each WRITE's path: `measured` (the engine's default on GPUs:
    /// direct or staged, whichever it measured faster for the shape) or `staged` (always staged).
    #[arg(long, value_enum, default_value = "measured")]
    engine_path: EnginePath,
    /// PTX of the staging kernels, loaded when NVRTC is not available (made by `--emit-ptx`).
    #[arg(long)]
    ptx: Option<PathBuf>,
    /// Compile the staging kernels with NVRTC for `--arch`, write the PTX here and exit (no GPU needed).
    #[arg(long)]
    emit_ptx: Option<PathBuf>,
    /// Architecture for `--emit-ptx`.
    #[arg(long, default_value = "compute_90")]
    arch: String,
    /// Internal: run as the P or D process.
    #[arg(long, value_enum, hide = true)]
    role: Option<Role>,
}

impl Args {
    fn slot_bytes(&self) -> u64 {
        self.slot_kib.map(|k| k << 10).unwrap_or(self.slot_mib << 20)
    }
    fn regions(&self) -> u32 {
        2 * self.layers
    }
}

/// Bytes of one block of one region: 16 tokens × 1 head × 128 × bf16.
const UNIT: u64 = 16 * 128 * 2;

// ---------------------------------------------------------------------------------------------
// Messages between the orchestrator and the P/D processes.

#[derive(Clone, Debug, Serialize, Deserialize)]
struct SideInfo {
    agent: String,
    metadata_hex: String,
    cache_base: u64,
    cache_len: u64,
    region_len: u64,
    slot_addrs: Vec<u64>,
    slot_bytes: u64,
    device: String,
    /// What the real driver answered to bad pointers (CUDA only).
    validation: Vec<String>,
    /// The `engine` method: the engine's side-channel address, or why the engine did not start.
    engine: Option<Result<String, String>>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Case {
    tokens: u64,
    pattern: Pattern,
    method: Method,
    p_ids: Vec<u32>,
    d_ids: Vec<u32>,
    /// Ceiling only: bytes of the single descriptor.
    bytes: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
enum Cmd {
    Peer(SideInfo),
    Prepare { case: Case, iter: u32, seed: u64 },
    Run,
    Verify,
    Quit,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
enum Reply {
    Hello(SideInfo),
    Ok,
    /// To `Peer`: `engine_error` says why the `engine` method cannot run (if it was selected).
    Peered {
        engine_error: Option<String>,
    },
    Sent {
        t_ready: u64,
        t_done: u64,
        descriptors: u64,
        posts: u64,
        bytes: u64,
        engine: Option<EngineCounts>,
    },
    Received {
        t_received: u64,
        pieces: u64,
        engine: Option<EngineCounts>,
    },
    Verified {
        units: u64,
        bad_units: u64,
        untouched_bytes: u64,
        bad_untouched: u64,
        first_error: Option<String>,
    },
    Error(String),
}

/// What one side's engine did during one iteration (differences of its cumulative counters).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
struct EngineCounts {
    /// `stats().counters`: posts of the planner's merged descriptors to the (staging) transport.
    posts: u64,
    /// Descriptors the planner produced before merging, and those it posted after.
    descriptors_unmerged: u64,
    descriptors_posted: u64,
    /// Bytes the engine posted.
    bytes: u64,
    /// `staging_counts()` (all zero where staging is off): transfers sent staged, slot-sized pieces
    /// written (one WRITE each), table entries gathered, transfers posted unstaged, transfers
    /// received staged (all pieces scattered), staged transfers that failed.
    staged_transfers: u64,
    /// Staged transfers the engine handed over in grid form (the rest as descriptors).
    #[serde(default)]
    grids: u64,
    /// First pieces gathered ahead of their grant.
    #[serde(default)]
    ahead: u64,
    /// Pieces whose tables were built ahead of their turn.
    #[serde(default)]
    prefilled: u64,
    pieces: u64,
    entries: u64,
    direct: u64,
    /// Of `direct`, WRITEs that could have been staged and went direct because measured faster.
    #[serde(default)]
    chosen_direct: u64,
    received: u64,
    failed: u64,
    /// Whether the engine runs with a staging wrapper at all.
    staging: bool,
}

impl EngineCounts {
    fn read(engine: &Engine) -> EngineCounts {
        let c = engine.stats().counters;
        let s = engine.staging_counts();
        let st = s.unwrap_or_default();
        EngineCounts {
            posts: c.posts,
            descriptors_unmerged: c.descriptors_unmerged,
            descriptors_posted: c.descriptors_posted,
            bytes: c.bytes,
            staged_transfers: st.transfers,
            grids: st.grids,
            ahead: st.ahead,
            prefilled: st.prefilled,
            pieces: st.pieces,
            entries: st.entries,
            direct: st.direct,
            chosen_direct: st.chosen_direct,
            received: st.received,
            failed: st.failed,
            staging: s.is_some(),
        }
    }

    fn since(self, before: EngineCounts) -> EngineCounts {
        EngineCounts {
            posts: self.posts.saturating_sub(before.posts),
            descriptors_unmerged: self.descriptors_unmerged.saturating_sub(before.descriptors_unmerged),
            descriptors_posted: self.descriptors_posted.saturating_sub(before.descriptors_posted),
            bytes: self.bytes.saturating_sub(before.bytes),
            staged_transfers: self.staged_transfers.saturating_sub(before.staged_transfers),
            grids: self.grids.saturating_sub(before.grids),
            ahead: self.ahead.saturating_sub(before.ahead),
            prefilled: self.prefilled.saturating_sub(before.prefilled),
            pieces: self.pieces.saturating_sub(before.pieces),
            entries: self.entries.saturating_sub(before.entries),
            direct: self.direct.saturating_sub(before.direct),
            chosen_direct: self.chosen_direct.saturating_sub(before.chosen_direct),
            received: self.received.saturating_sub(before.received),
            failed: self.failed.saturating_sub(before.failed),
            staging: self.staging,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The P and D processes.

/// A side's memory: the KV cache and the staging slots, on the GPU or in host memory.
enum Memory {
    Cuda {
        dev: CudaDevice,
        cache: CudaBuffer,
        slots: Vec<CudaBuffer>,
        kernels: Kernels,
        stream: Stream,
        table: UnitTable,
        events: Vec<Event>,
    },
    Host {
        cache: HostBuffer,
        slots: Vec<HostBuffer>,
    },
}

impl Memory {
    fn cache_region(&self) -> MemRegion {
        match self {
            Memory::Cuda { cache, .. } => cache.region(),
            Memory::Host { cache, .. } => cache.region(),
        }
    }

    fn slot_regions(&self) -> Vec<MemRegion> {
        match self {
            Memory::Cuda { slots, .. } => slots.iter().map(|s| s.region()).collect(),
            Memory::Host { slots, .. } => slots.iter().map(|s| s.region()).collect(),
        }
    }

    /// Loads one side's unit addressing for the kernels (CUDA) — the block ids of the request.
    fn load(&mut self, space: UnitSpace, side: &Side<'_>) -> Result<(), String> {
        match self {
            Memory::Cuda { table, .. } => table.load(space, side).map_err(|e| e.to_string()),
            Memory::Host { .. } => side.check(&space).map_err(|e| e.to_string()),
        }
    }

    /// Writes the pattern of `seed` into every unit of the loaded side and waits.
    fn fill(&mut self, space: UnitSpace, side: &Side<'_>, seed: u64) -> Result<(), String> {
        match self {
            Memory::Cuda { kernels, stream, table, .. } => {
                // SAFETY: the table holds units of this process's KV cache (checked by `load`), which
                // nothing else touches during the fill; we wait for it below.
                unsafe { kernels.fill(stream, table, seed) }.map_err(|e| e.to_string())?;
                stream.synchronize().map_err(|e| e.to_string())
            }
            Memory::Host { cache, .. } => {
                let base = cache.region().addr;
                let mem = cache.as_mut_slice();
                let ub = space.unit_bytes as usize;
                for u in 0..space.units() {
                    let (r, j) = space.locate(u);
                    let off = (side.unit_addr(&space, u) - base) as usize;
                    unitpack::pattern_fill(seed, r, j, &mut mem[off..off + ub]);
                }
                Ok(())
            }
        }
    }

    fn poison(&mut self) -> Result<(), String> {
        match self {
            Memory::Cuda { cache, .. } => cache.mem().memset(POISON).map_err(|e| e.to_string()),
            Memory::Host { cache, .. } => {
                cache.as_mut_slice().fill(POISON);
                Ok(())
            }
        }
    }

    /// Starts packing `piece` into slot `piece.slot` (`Pack::Gather`, the loaded side is the source)
    /// or unpacking it from there (`Pack::Scatter`, the loaded side is the destination).
    fn start_pack(&mut self, pack: Pack, space: UnitSpace, side: &Side<'_>, piece: &Piece) -> Result<(), String> {
        match self {
            Memory::Cuda { kernels, stream, table, slots, events, .. } => {
                let (first, units, slot) = (piece.first_unit, piece.units, slots[piece.slot as usize].mem());
                // SAFETY: gather: the units are this process's KV cache blocks of a ready request (not
                // written while in flight); the slot is not read until its event completes, and not
                // written by NIXL since its previous WRITE completed (the caller's slot state).
                // Scatter: the slot holds the landed piece (its notification arrived after the data)
                // and is not written again before we credit it; the destination blocks are registered
                // for this request and nothing reads them before it is received.
                unsafe { kernels.pack(pack, stream, table, first, units, slot, 0) }.map_err(|e| e.to_string())?;
                events[piece.slot as usize].record(stream).map_err(|e| e.to_string())
            }
            Memory::Host { cache, slots } => {
                let base = cache.region().addr;
                let (mem, slot) = (cache.as_mut_slice(), slots[piece.slot as usize].as_mut_slice());
                match pack {
                    Pack::Gather => unitpack::gather(&space, piece, side, mem, base, slot),
                    Pack::Scatter => unitpack::scatter(&space, piece, side, slot, mem, base),
                }
                .map_err(|e| e.to_string())
            }
        }
    }

    fn slot_done(&self, slot: u32) -> Result<bool, String> {
        match self {
            Memory::Cuda { events, .. } => events[slot as usize].is_done().map_err(|e| e.to_string()),
            Memory::Host { .. } => Ok(true),
        }
    }

    fn read_cache(&mut self) -> Result<Vec<u8>, String> {
        match self {
            Memory::Cuda { cache, .. } => {
                let mut v = vec![0u8; cache.region().len as usize];
                cache.read_at(0, &mut v).map_err(|e| e.to_string())?;
                Ok(v)
            }
            Memory::Host { cache, .. } => Ok(cache.as_mut_slice().to_vec()),
        }
    }
}

/// The `engine` method's worker: a kvpush engine over this side's KV cache, with its own NIXL agent
/// and side channel. Field order matters: the engine stops its writers and deregisters its regions
/// before the side channel goes.
struct EngineSide {
    engine: Engine,
    side: Arc<SideChannel>,
    /// D: the counters before the open request was registered.
    before: EngineCounts,
}

impl EngineSide {
    /// Polls the engine until it reports a result, and hands the last one reported, the time it was
    /// taken and the others reported with it to `answer`; after `deadline`, aborts `key` and fails
    /// saying it was not `done` ("sent", "received") in time.
    fn await_finished(
        &self,
        key: Key,
        deadline: Instant,
        done: &str,
        answer: impl FnOnce(Finished, u64, &[Finished]) -> Result<Reply, String>,
    ) -> Result<Reply, String> {
        let mut finished = Vec::new();
        loop {
            self.engine.poll(&mut finished);
            if let Some(f) = finished.pop() {
                let t = child::now_ns();
                return answer(f, t, &finished);
            }
            if Instant::now() > deadline {
                let _ = self.engine.abort(key);
                return Err(format!("engine: request {key} not {done} within {STEP_TIMEOUT:?}"));
            }
            std::thread::yield_now();
        }
    }
}

/// One side. Field order matters: `engine` (deregistering its regions, dropping its NIXL agent) and
/// then `nixl` (deregistering everything) drop before `mem` frees the memory they registered.
struct Node {
    engine: Option<EngineSide>,
    /// Why the `engine` method cannot run on this side (it did not start, or did not connect).
    engine_error: Option<String>,
    args: Args,
    role: Role,
    nixl: NixlTransport,
    mem: Memory,
    info: SideInfo,
    peer: Option<SideInfo>,
    case: Option<(Case, u32, u64)>,
    planner: Planner,
    notifs: Vec<kvpush::transport::Notification>,
}

fn open_memory(args: &Args, role: Role) -> Result<Memory, String> {
    let cache_len = u64::from(args.regions()) * u64::from(args.pool_blocks) * UNIT;
    let slot_bytes = args.slot_bytes();
    match args.memory {
        MemoryKind::Cuda => {
            let ordinal = match args.visible {
                Visible::Split => 0,
                Visible::All => args.gpus[if role == Role::P { 0 } else { 1 }],
            };
            let dev = CudaDevice::open(ordinal).map_err(|e| e.to_string())?;
            let cache = dev.alloc_cuda(cache_len).map_err(|e| e.to_string())?;
            let slots = (0..args.slots)
                .map(|_| dev.alloc_cuda(slot_bytes).map_err(|e| e.to_string()))
                .collect::<Result<_, _>>()?;
            let gpu = dev.gpu();
            let kernels = match (Kernels::load(gpu), &args.ptx) {
                (Ok(k), _) => k,
                (Err(kvpush_cuda::CudaError::Unavailable { .. }), Some(path)) => {
                    eprintln!("NVRTC not available: loading the staging kernels from {}", path.display());
                    let ptx = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
                    Kernels::from_ptx(gpu, &ptx).map_err(|e| e.to_string())?
                }
                (Err(e), _) => return Err(e.to_string()),
            };
            let stream = Stream::new(gpu).map_err(|e| e.to_string())?;
            let table = UnitTable::new(gpu, args.regions(), args.pool_blocks).map_err(|e| e.to_string())?;
            let events =
                (0..args.slots).map(|_| Event::new(gpu).map_err(|e| e.to_string())).collect::<Result<_, _>>()?;
            Ok(Memory::Cuda { dev, cache, slots, kernels, stream, table, events })
        }
        MemoryKind::Host => {
            let host = HostDevice::new();
            let cache = host.alloc_anon(cache_len).map_err(|e| e.to_string())?;
            let slots = (0..args.slots)
                .map(|_| host.alloc_anon(slot_bytes).map_err(|e| e.to_string()))
                .collect::<Result<_, _>>()?;
            Ok(Memory::Host { cache, slots })
        }
    }
}

/// Asks the real driver about pointers that must be refused; records its answers.
fn validation_checks(mem: &Memory) -> Vec<String> {
    let Memory::Cuda { dev, cache, .. } = mem else { return Vec::new() };
    let r = cache.region();
    let host = vec![0u8; 4096];
    let cases =
        [("host memory", host.as_ptr() as u64, 4096u64), ("past the allocation's end", r.addr + r.len - 2048, 4096)];
    let mut out: Vec<String> = cases
        .iter()
        .map(|(what, a, l)| match dev.describe(*a, *l) {
            Ok(m) => format!("{what}: ACCEPTED (unexpected) as {m:?}"),
            Err(e) => format!("{what}: refused: {e}"),
        })
        .collect();
    let wrong = dev.ordinal() + 1;
    out.push(match kvpush_cuda::pointer::validate(dev.gpu().as_ref(), r.addr, 4096, wrong) {
        Ok(_) => format!("claimed device {wrong}: ACCEPTED (unexpected)"),
        Err(e) => format!("claimed device {wrong}: refused: {e}"),
    });
    out.push(match dev.describe(r.addr, r.len) {
        Ok(m) => format!("own cache: accepted as {:?} device {}", m.kind, m.dev_id),
        Err(e) => format!("own cache: REFUSED (unexpected): {e}"),
    });
    out
}

impl Node {
    fn start(args: Args, role: Role) -> Result<Node, String> {
        let mem = open_memory(&args, role)?;
        // The hook: the CUDA context must be current before the NIXL backend is created (UCX's CUDA
        // transports bind to it), and on this thread, which posts every transfer.
        if let Memory::Cuda { dev, .. } = &mem {
            dev.make_current().map_err(|e| e.to_string())?;
        }
        let agent = format!("gpu_push/{role:?}/{}", std::process::id());
        let mut config = NixlConfig::new(agent.clone());
        config.backend = args.backend.clone();
        let nixl = NixlTransport::new(&config).map_err(|e| e.to_string())?;
        let mut regions = vec![mem.cache_region()];
        regions.extend(mem.slot_regions());
        for r in &mut regions {
            if let Memory::Cuda { dev, .. } = &mem {
                // Registered memory is validated with the driver first (device memory of this device,
                // inside one allocation).
                *r = dev.describe(r.addr, r.len).map_err(|e| e.to_string())?;
            }
            // SAFETY: the regions are live allocations owned by `mem`, which `Node` drops after `nixl`;
            // the peer writes into them only in the bench's lock step (D's cache and slots while D waits
            // for the request, never while D poisons or verifies them; P's memory is only read).
            unsafe { nixl.register(r) }.map_err(|e| e.to_string())?;
        }
        let cache = mem.cache_region();
        let region_len = u64::from(args.pool_blocks) * UNIT;
        let units: Vec<Units> = (0..u64::from(args.regions()))
            .map(|r| Units { base: cache.addr + r * region_len, unit: UNIT, count: u64::from(args.pool_blocks) })
            .collect();
        nixl.prepare(None, &units).map_err(|e| e.to_string())?;
        let device = match &mem {
            Memory::Cuda { dev, .. } => {
                let g = dev.gpu();
                format!(
                    "{} (ordinal {}, compute {}.{}, {} SMs, CUDA_VISIBLE_DEVICES={})",
                    g.name(),
                    g.ordinal(),
                    g.compute_capability().0,
                    g.compute_capability().1,
                    g.multiprocessors(),
                    std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "(unset)".into())
                )
            }
            Memory::Host { .. } => "host memory".into(),
        };
        let info = SideInfo {
            agent: agent.clone(),
            metadata_hex: child::hex::encode(&nixl.local_metadata().map_err(|e| e.to_string())?),
            cache_base: cache.addr,
            cache_len: cache.len,
            region_len,
            slot_addrs: mem.slot_regions().iter().map(|r| r.addr).collect(),
            slot_bytes: args.slot_bytes(),
            device,
            validation: validation_checks(&mem),
            engine: None,
        };
        let mut node = Node {
            engine: None,
            engine_error: None,
            args,
            role,
            nixl,
            mem,
            info,
            peer: None,
            case: None,
            planner: Planner::new(),
            notifs: Vec::new(),
        };
        if node.args.methods.contains(&Method::Engine) {
            match node.start_engine(&agent) {
                Ok(e) => {
                    node.info.engine = Some(Ok(e.side.local_addr().to_string()));
                    node.engine = Some(e);
                }
                Err(e) => {
                    let e = format!("{role:?}'s engine did not start: {e}");
                    eprintln!("{e}");
                    node.info.engine = Some(Err(e.clone()));
                    node.engine_error = Some(e);
                }
            }
        }
        Ok(node)
    }

    /// Builds this side's kvpush engine over the KV cache (the `engine` method): P is engine
    /// `prefill`, D `decode`, push mode, staging on with the bench's slot geometry, a NIXL agent of
    /// its own (`<agent>-engine`, so the other methods keep the bench's agent to themselves) and a
    /// side channel on 127.0.0.1 that D dials when it learns P's address.
    fn start_engine(&self, agent: &str) -> Result<EngineSide, String> {
        let device: Arc<dyn Device> = match &self.mem {
            Memory::Cuda { dev, .. } => Arc::new(dev.clone()),
            Memory::Host { .. } => Arc::new(HostDevice::new()),
        };
        let mut nixl = NixlConfig::new(format!("{agent}-engine"));
        nixl.backend = self.args.backend.clone();
        let transport = Arc::new(NixlTransport::new(&nixl).map_err(|e| e.to_string())?);
        let mut sc = SideConfig::for_rank(0);
        sc.listen = "127.0.0.1:0".into();
        let side = Arc::new(SideChannel::bind(sc).map_err(|e| e.to_string())?);
        let id = match self.role {
            Role::P => "prefill",
            Role::D => "decode",
        };
        let mut config = EngineConfig::new(id, Mode::Push);
        config.staging = Staging::On(StagingConfig {
            slots: self.args.slots as usize,
            slot_bytes: self.args.slot_bytes(),
            choice: match self.args.engine_path {
                EnginePath::Measured => PathChoice::Measured,
                EnginePath::Staged => PathChoice::Always,
            },
            ..StagingConfig::default()
        });
        let layout = self.layout(&self.info);
        // SAFETY: (1) the layout's regions are this side's KV cache, owned by `self.mem`, which `Node`
        // drops after its `engine` field (field order), so they outlive the engine. (2) The bench's
        // lock step keeps its own accesses off the blocks of an open engine request: P fills them in
        // `Prepare`, before `request_finished` in `Run`, and again only in a later `Prepare`, after
        // `Finished::Sent`; D poisons its cache before `blocks_allocated` and reads it (`Verify`)
        // only after `Finished::Received`; the other methods never run while an engine request is
        // open. The exception is an iteration that times out: its request is aborted and no engine
        // case runs after it, but a transfer of it may still be in flight while later cases use the
        // memory (a late write into D's cache would fail their verification; nothing else reads it).
        let engine =
            unsafe { Engine::new(config, layout, device, transport, side.clone()) }.map_err(|e| e.to_string())?;
        side.serve(engine.endpoint());
        let before = EngineCounts::read(&engine);
        Ok(EngineSide { engine, side, before })
    }

    fn peer_name(&self) -> Result<String, String> {
        self.peer.as_ref().map(|p| p.agent.clone()).ok_or_else(|| "no peer".to_owned())
    }

    fn bases(info: &SideInfo, regions: u32) -> Vec<u64> {
        (0..u64::from(regions)).map(|r| info.cache_base + r * info.region_len).collect()
    }

    fn handle(&mut self, cmd: Cmd) -> Result<Option<Reply>, String> {
        match cmd {
            Cmd::Peer(info) => {
                let name = self
                    .nixl
                    .load_remote(&child::hex::decode(&info.metadata_hex).map_err(|e| e.to_string())?)
                    .map_err(|e| e.to_string())?;
                if name != info.agent {
                    return Err(format!("peer metadata names agent {name}, expected {}", info.agent));
                }
                let units: Vec<Units> = Self::bases(&info, self.args.regions())
                    .into_iter()
                    .map(|b| Units { base: b, unit: UNIT, count: u64::from(self.args.pool_blocks) })
                    .collect();
                self.nixl.prepare(Some(&name), &units).map_err(|e| e.to_string())?;
                if self.role == Role::D && self.engine.is_some() {
                    if let Err(e) = self.connect_engine(&info) {
                        eprintln!("{e}");
                        self.engine = None;
                        self.engine_error = Some(e);
                    }
                }
                self.peer = Some(info);
                Ok(Some(Reply::Peered { engine_error: self.engine_error.clone() }))
            }
            Cmd::Prepare { case, iter, seed } => {
                let space = self.space(&case);
                let bases = Self::bases(&self.info, self.args.regions());
                match self.role {
                    Role::P if case.method != Method::Ceiling => {
                        let side = Side { bases: &bases, ids: &case.p_ids, stride: UNIT };
                        self.mem.load(space, &side)?;
                        self.mem.fill(space, &side, seed)?;
                    }
                    Role::D => {
                        self.mem.poison()?;
                        if case.method != Method::Ceiling {
                            let side = Side { bases: &bases, ids: &case.d_ids, stride: UNIT };
                            self.mem.load(space, &side)?;
                        }
                        if case.method == Method::Engine {
                            // Registration first: D's blocks are registered with P while P prepares.
                            let eng = self.engine.as_mut().ok_or("the engine is not running")?;
                            eng.before = EngineCounts::read(&eng.engine);
                            eng.engine
                                .blocks_allocated(
                                    engine_key(seed, iter),
                                    "prefill",
                                    vec![case.d_ids.clone()],
                                    case.tokens,
                                )
                                .map_err(|e| format!("engine: {e}"))?;
                        }
                    }
                    Role::P => {}
                }
                self.case = Some((case, iter, seed));
                Ok(Some(Reply::Ok))
            }
            Cmd::Run => {
                let (case, iter, seed) = self.case.clone().ok_or("run before prepare")?;
                match self.role {
                    Role::P if case.method == Method::Engine => {
                        self.send_engine(&case, engine_key(seed, iter)).map(Some)
                    }
                    Role::D if case.method == Method::Engine => self.receive_engine(engine_key(seed, iter)).map(Some),
                    Role::P => self.send(&case, iter).map(Some),
                    Role::D => self.receive(&case, iter).map(Some),
                }
            }
            Cmd::Verify => {
                let (case, _, seed) = self.case.clone().ok_or("verify before prepare")?;
                self.verify(&case, seed).map(Some)
            }
            Cmd::Quit => Ok(None),
        }
    }

    fn space(&self, case: &Case) -> UnitSpace {
        UnitSpace { regions: self.args.regions(), blocks: case.d_ids.len() as u32, unit_bytes: UNIT }
    }

    fn layout(&self, info: &SideInfo) -> KvLayout {
        let model = ModelShape {
            total_layers: self.args.layers,
            kv_heads: 8,
            head_dim: 128,
            dtype: DType::Bf16,
            kind: KvKind::KeyValue,
            groups: vec![KvGroup { kind: GroupKind::Full, layers: (0..self.args.layers).collect() }],
        };
        KvLayout {
            model,
            block_tokens: 16,
            order: BlockOrder::Hnd,
            placement: KvPlacement::Separate,
            block_stride: UNIT,
            num_blocks: self.args.pool_blocks,
            parallel: Parallel { tp_rank: 0, tp_size: 8, pp_rank: 0, pp_size: 1 },
            region_bases: Self::bases(info, self.args.regions()),
        }
    }

    fn wait_xfer(&self, id: XferId, deadline: Instant) -> Result<(), String> {
        loop {
            match self.nixl.poll(id).map_err(|e| e.to_string())? {
                XferState::Done => return Ok(()),
                XferState::Pending if Instant::now() > deadline => return Err(format!("transfer {id:?} timed out")),
                XferState::Pending => {}
            }
        }
    }

    /// P: push the prepared request; returns when every WRITE completed locally.
    fn send(&mut self, case: &Case, iter: u32) -> Result<Reply, String> {
        let peer_info = self.peer.clone().ok_or("no peer")?;
        let peer = peer_info.agent.clone();
        let deadline = Instant::now() + STEP_TIMEOUT;
        let done_msg = [b"kvpD".as_slice(), &iter.to_le_bytes()].concat();
        let t_ready = child::now_ns();
        let (descriptors, posts, bytes) = match case.method {
            Method::Ceiling => {
                let d = Desc { local: self.info.cache_base, remote: peer_info.cache_base, len: case.bytes };
                let id = self.nixl.post(Op::Write, &peer, &[d], Some(&done_msg)).map_err(|e| e.to_string())?;
                self.wait_xfer(id, deadline)?;
                (1, 1, case.bytes)
            }
            Method::Direct => {
                let (src, dst) = (self.layout(&self.info), self.layout(&peer_info));
                let (sb, db) = (vec![case.p_ids.clone()], vec![case.d_ids.clone()]);
                let input =
                    PlanInput { src: &src, dst: &dst, src_blocks: &sb, dst_blocks: &db, num_tokens: case.tokens };
                let mut copies = Vec::new();
                let stats = self.planner.plan(&input, &mut copies).map_err(|e| e.to_string())?;
                let descs: Vec<Desc> =
                    copies.iter().map(|c| Desc { local: c.src_addr, remote: c.dst_addr, len: c.len }).collect();
                let id = self.nixl.post(Op::Write, &peer, &descs, Some(&done_msg)).map_err(|e| e.to_string())?;
                self.wait_xfer(id, deadline)?;
                (stats.merged, 1, stats.bytes)
            }
            Method::PerBlock => {
                let (pb, db) =
                    (Self::bases(&self.info, self.args.regions()), Self::bases(&peer_info, self.args.regions()));
                let mut descs = Vec::with_capacity(pb.len() * case.p_ids.len());
                for (pr, dr) in pb.iter().zip(&db) {
                    for (p, d) in case.p_ids.iter().zip(&case.d_ids) {
                        descs.push(Desc {
                            local: pr + u64::from(*p) * UNIT,
                            remote: dr + u64::from(*d) * UNIT,
                            len: UNIT,
                        });
                    }
                }
                let id = self.nixl.post(Op::Write, &peer, &descs, Some(&done_msg)).map_err(|e| e.to_string())?;
                self.wait_xfer(id, deadline)?;
                (descs.len() as u64, 1, descs.len() as u64 * UNIT)
            }
            Method::Staged => self.send_staged(case, iter, &peer_info, deadline)?,
            Method::Engine => return Err("the engine method is sent by send_engine".into()),
        };
        Ok(Reply::Sent { t_ready, t_done: child::now_ns(), descriptors, posts, bytes, engine: None })
    }

    /// D: dials P's engine over the side channel (the handshake loads each engine's NIXL metadata
    /// into the other) and checks that P's engine is known.
    fn connect_engine(&self, p: &SideInfo) -> Result<(), String> {
        let addr = match &p.engine {
            Some(Ok(addr)) => addr,
            Some(Err(e)) => return Err(e.clone()),
            None => return Err("P runs no engine".into()),
        };
        let eng = self.engine.as_ref().ok_or("the engine is not running")?;
        eng.side.connect(addr.as_str()).map_err(|e| format!("D's engine cannot connect to P's ({addr}): {e}"))?;
        if !eng.engine.knows_engine("prefill") {
            return Err(format!("D's engine connected to {addr} but does not know engine prefill"));
        }
        Ok(())
    }

    /// P, engine: blocks ready → `request_finished`; returns at `Finished::Sent`.
    fn send_engine(&mut self, case: &Case, key: Key) -> Result<Reply, String> {
        let eng = self.engine.as_ref().ok_or("the engine is not running")?;
        let deadline = Instant::now() + STEP_TIMEOUT;
        let before = EngineCounts::read(&eng.engine);
        let t_ready = child::now_ns();
        tracing::trace!(target: "kvpush::bench", %key, "blocks ready");
        eng.engine.request_finished(key, vec![case.p_ids.clone()], case.tokens).map_err(|e| format!("engine: {e}"))?;
        eng.await_finished(key, deadline, "sent", |f, t_done, others| match f {
            Finished::Sent { key: k, reason: ReleaseReason::Sent } if k == key && others.is_empty() => {
                let c = EngineCounts::read(&eng.engine).since(before);
                let posts = if c.pieces > 0 { c.pieces } else { c.posts };
                Ok(Reply::Sent {
                    t_ready,
                    t_done,
                    descriptors: c.descriptors_posted,
                    posts,
                    bytes: c.bytes,
                    engine: Some(c),
                })
            }
            Finished::Sent { key: k, reason } if k == key => {
                Err(format!("engine: request {key} released with reason {reason:?}"))
            }
            other => Err(format!("engine: unexpected result {other:?} (others: {others:?}) while sending {key}")),
        })
    }

    /// D, engine: waits for `Finished::Received` of the request registered in `Prepare`.
    fn receive_engine(&mut self, key: Key) -> Result<Reply, String> {
        let eng = self.engine.as_ref().ok_or("the engine is not running")?;
        let deadline = Instant::now() + STEP_TIMEOUT;
        eng.await_finished(key, deadline, "received", |f, t_received, others| match f {
            Finished::Received { key: k } if k == key && others.is_empty() => {
                tracing::trace!(target: "kvpush::bench", %key, "received");
                let c = EngineCounts::read(&eng.engine).since(eng.before);
                // D's staging counts transfers, not pieces: P's Sent carries those.
                Ok(Reply::Received { t_received, pieces: 0, engine: Some(c) })
            }
            Finished::Failed { key: k, reason, .. } if k == key => {
                Err(format!("engine: request {key} failed: {reason}"))
            }
            other => Err(format!("engine: unexpected result {other:?} (others: {others:?}) while receiving {key}")),
        })
    }

    fn plan(&self, case: &Case) -> Result<PackPlan, String> {
        unitpack::plan(self.space(case), self.args.slot_bytes(), self.args.slots).map_err(|e| e.to_string())
    }

    /// P, staged: gather → WRITE slot → (D scatters, credits the slot) → reuse.
    fn send_staged(
        &mut self,
        case: &Case,
        iter: u32,
        peer: &SideInfo,
        deadline: Instant,
    ) -> Result<(u64, u64, u64), String> {
        let plan = self.plan(case)?;
        let space = plan.space;
        let bases = Self::bases(&self.info, self.args.regions());
        let side = Side { bases: &bases, ids: &case.p_ids, stride: UNIT };
        // The block ids are known now (blocks ready): the table upload is part of the transfer.
        self.mem.load(space, &side)?;
        let n = plan.pieces.len();
        let slots = self.args.slots as usize;
        let mut local_free = vec![true; slots];
        let mut remote_free = vec![true; slots];
        let mut gathered: VecDeque<usize> = VecDeque::new();
        let mut in_flight: VecDeque<(usize, XferId)> = VecDeque::new();
        let (mut next_gather, mut posted, mut completed) = (0usize, 0usize, 0usize);
        while completed < n {
            if next_gather < n && local_free[plan.pieces[next_gather].slot as usize] {
                let p = plan.pieces[next_gather];
                self.mem.start_pack(Pack::Gather, space, &side, &p)?;
                local_free[p.slot as usize] = false;
                gathered.push_back(next_gather);
                next_gather += 1;
            }
            if let Some(&k) = gathered.front() {
                let p = plan.pieces[k];
                if remote_free[p.slot as usize] && self.mem.slot_done(p.slot)? {
                    let msg = [b"kvpS".as_slice(), &iter.to_le_bytes(), &p.index.to_le_bytes()].concat();
                    let d = Desc {
                        local: self.info.slot_addrs[p.slot as usize],
                        remote: peer.slot_addrs[p.slot as usize],
                        len: p.bytes,
                    };
                    let id = self.nixl.post(Op::Write, &peer.agent, &[d], Some(&msg)).map_err(|e| e.to_string())?;
                    remote_free[p.slot as usize] = false;
                    in_flight.push_back((k, id));
                    gathered.pop_front();
                    posted += 1;
                }
            }
            let mut i = 0;
            while i < in_flight.len() {
                let (k, id) = in_flight[i];
                match self.nixl.poll(id).map_err(|e| e.to_string())? {
                    XferState::Done => {
                        local_free[plan.pieces[k].slot as usize] = true;
                        completed += 1;
                        in_flight.remove(i);
                    }
                    XferState::Pending => i += 1,
                }
            }
            // Credits: D scattered piece k out of its slot, which may take piece k + slots.
            self.notifs.clear();
            self.nixl.take_notifications(&mut self.notifs).map_err(|e| e.to_string())?;
            for note in &self.notifs {
                let (tag, it, piece) = parse_note(&note.msg)?;
                if tag != *b"kvpC" || it != iter {
                    return Err(format!("unexpected notification {:?} in iteration {iter}", note.msg));
                }
                remote_free[(piece as usize) % slots] = true;
            }
            if Instant::now() > deadline {
                return Err(format!("staged send timed out: {completed}/{n} pieces completed, {posted} posted"));
            }
        }
        Ok((n as u64, n as u64, space.bytes()))
    }

    /// D: wait until the request is in the KV cache.
    fn receive(&mut self, case: &Case, iter: u32) -> Result<Reply, String> {
        let deadline = Instant::now() + STEP_TIMEOUT;
        let peer = self.peer_name()?;
        if case.method != Method::Staged {
            loop {
                self.notifs.clear();
                self.nixl.take_notifications(&mut self.notifs).map_err(|e| e.to_string())?;
                if let Some(note) = self.notifs.first() {
                    let t_received = child::now_ns();
                    let (tag, it, _) = parse_note(&note.msg)?;
                    if tag != *b"kvpD" || it != iter || self.notifs.len() != 1 {
                        return Err(format!("unexpected notifications in iteration {iter}: {:?}", self.notifs));
                    }
                    return Ok(Reply::Received { t_received, pieces: 1, engine: None });
                }
                if Instant::now() > deadline {
                    return Err(format!("no completion notification within {STEP_TIMEOUT:?}"));
                }
            }
        }
        let plan = self.plan(case)?;
        let space = plan.space;
        let bases = Self::bases(&self.info, self.args.regions());
        let ids = case.d_ids.clone();
        let side = Side { bases: &bases, ids: &ids, stride: UNIT };
        let n = plan.pieces.len();
        let slots = self.args.slots as usize;
        let mut scattering: VecDeque<usize> = VecDeque::new();
        let mut landed: VecDeque<usize> = VecDeque::new();
        let mut done = 0usize;
        loop {
            self.notifs.clear();
            self.nixl.take_notifications(&mut self.notifs).map_err(|e| e.to_string())?;
            for note in &self.notifs {
                let (tag, it, piece) = parse_note(&note.msg)?;
                if tag != *b"kvpS" || it != iter || piece as usize >= n {
                    return Err(format!("unexpected notification {:?} in iteration {iter}", note.msg));
                }
                landed.push_back(piece as usize);
            }
            // One scatter per slot in flight; pieces of one slot arrive in order (credits).
            while let Some(k) = landed.pop_front() {
                self.mem.start_pack(Pack::Scatter, space, &side, &plan.pieces[k])?;
                scattering.push_back(k);
            }
            while let Some(&k) = scattering.front() {
                if !self.mem.slot_done(plan.pieces[k].slot)? {
                    break;
                }
                scattering.pop_front();
                done += 1;
                if k + slots < n {
                    let msg = [b"kvpC".as_slice(), &iter.to_le_bytes(), &(k as u32).to_le_bytes()].concat();
                    self.nixl.send_notification(&peer, &msg).map_err(|e| e.to_string())?;
                }
            }
            if done == n {
                return Ok(Reply::Received { t_received: child::now_ns(), pieces: n as u64, engine: None });
            }
            if Instant::now() > deadline {
                return Err(format!("staged receive timed out: {done}/{n} pieces scattered"));
            }
        }
    }

    /// D: copy the KV cache back to the host and check every byte of the request's blocks against
    /// P's pattern, and every other block against the poison.
    fn verify(&mut self, case: &Case, seed: u64) -> Result<Reply, String> {
        let data = self.mem.read_cache()?;
        let regions = self.args.regions();
        let region_len = self.info.region_len as usize;
        let pool = self.args.pool_blocks as usize;
        if case.method == Method::Ceiling {
            return Ok(Reply::Verified {
                units: 0,
                bad_units: 0,
                untouched_bytes: 0,
                bad_untouched: 0,
                first_error: None,
            });
        }
        let mut in_request = vec![u32::MAX; pool];
        for (j, &id) in case.d_ids.iter().enumerate() {
            in_request[id as usize] = j as u32;
        }
        let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(16);
        let per = (regions as usize).div_ceil(threads);
        let results: Vec<(u64, u64, u64, u64, Option<String>)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let (data, in_request) = (&data, &in_request);
                    s.spawn(move || {
                        let (mut units, mut bad, mut untouched, mut bad_untouched, mut first) = (0, 0, 0, 0, None);
                        for r in (t * per)..((t + 1) * per).min(regions as usize) {
                            for (b, &j) in in_request.iter().enumerate() {
                                let off = r * region_len + b * UNIT as usize;
                                let unit = &data[off..off + UNIT as usize];
                                if j == u32::MAX {
                                    untouched += UNIT;
                                    if unit.iter().any(|&x| x != POISON) {
                                        bad_untouched += 1;
                                        first.get_or_insert_with(|| {
                                            format!("region {r} block {b} (not in the request) was written")
                                        });
                                    }
                                } else {
                                    units += 1;
                                    if let Some(w) = unitpack::pattern_check(seed, r as u32, j, unit) {
                                        bad += 1;
                                        first.get_or_insert_with(|| {
                                            format!("region {r} request block {j} (D block {b}): word {w} differs")
                                        });
                                    }
                                }
                            }
                        }
                        (units, bad, untouched, bad_untouched, first)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or((0, 1, 0, 0, Some("verifier panicked".into())))).collect()
        });
        let mut v = (0, 0, 0, 0, None);
        for (a, b, c, d, e) in results {
            v = (v.0 + a, v.1 + b, v.2 + c, v.3 + d, v.4.or(e));
        }
        Ok(Reply::Verified { units: v.0, bad_units: v.1, untouched_bytes: v.2, bad_untouched: v.3, first_error: v.4 })
    }
}

/// The engine's key of iteration `iter` of the case whose data seed is `seed`: seeds are distinct per
/// case and iteration (`mix64` is a bijection of distinct inputs), so every iteration has a fresh key.
fn engine_key(seed: u64, iter: u32) -> Key {
    Key::new((u128::from(seed) << 32) | u128::from(iter), 0)
}

fn parse_note(m: &[u8]) -> Result<([u8; 4], u32, u32), String> {
    if m.len() < 8 {
        return Err(format!("short notification {m:?}"));
    }
    let tag = [m[0], m[1], m[2], m[3]];
    let it = u32::from_le_bytes([m[4], m[5], m[6], m[7]]);
    let piece = if m.len() >= 12 { u32::from_le_bytes([m[8], m[9], m[10], m[11]]) } else { 0 };
    Ok((tag, it, piece))
}

fn child_main(args: Args, role: Role) -> Result<(), String> {
    let mut out = Channel::open().map_err(|e| format!("cannot set up the protocol channel: {e}"))?;
    // The engine logs through tracing (KVPUSH_LOG, default warnings) to stderr.
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVPUSH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    let mut node = match Node::start(args, role) {
        Ok(n) => n,
        Err(e) => {
            out.emit(&Reply::Error(e.clone()));
            return Err(e);
        }
    };
    out.emit(&Reply::Hello(node.info.clone()));
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        let cmd: Cmd = serde_json::from_str(&line).map_err(|e| format!("bad command {line:?}: {e}"))?;
        match node.handle(cmd) {
            Ok(Some(r)) => out.emit(&r),
            Ok(None) => return Ok(()),
            Err(e) => out.emit(&Reply::Error(e)),
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The orchestrator.

/// A worker process on testkit's harness, with its own queue of replies.
struct Proc {
    child: Child,
    rx: Receiver<((), Incoming<Reply>)>,
}

impl Proc {
    fn spawn(name: &'static str, args: &Args, role: Role) -> Result<Proc, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(exe);
        cmd.args(child_args(args, role));
        // P and D authenticate their side channel with one secret made for this run.
        static RUN_SECRET: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let secret = match RUN_SECRET.get() {
            Some(s) => s.clone(),
            None => {
                let s = kvpush::engine::side::random_secret().map_err(|e| e.to_string())?;
                RUN_SECRET.get_or_init(|| s).clone()
            }
        };
        cmd.env(kvpush::engine::side::SECRET_ENV, secret);
        if args.memory == MemoryKind::Cuda && args.visible == Visible::Split {
            let gpu = args.gpus[if role == Role::P { 0 } else { 1 }];
            cmd.env("CUDA_VISIBLE_DEVICES", gpu.to_string());
        }
        // The engine's CUDA stager loads the same kernels; without NVRTC it reads them from this file.
        if let (Some(ptx), None) = (&args.ptx, std::env::var_os(kvpush::device::cuda::PTX_ENV)) {
            cmd.env(kvpush::device::cuda::PTX_ENV, ptx);
        }
        let (tx, rx) = crossbeam_channel::unbounded();
        let child =
            Child::spawn(cmd, name, (), tx, None).map_err(|e| format!("cannot start the {name} process: {e}"))?;
        Ok(Proc { child, rx })
    }

    fn send(&mut self, cmd: &Cmd) -> Result<(), String> {
        self.child.send(cmd).map_err(|e| format!("{}: {e}", self.child.name()))
    }

    fn recv(&mut self, timeout: Duration) -> Result<Reply, String> {
        let name = self.child.name().to_owned();
        match self.rx.recv_timeout(timeout) {
            Ok(((), Incoming::Reply(Reply::Error(e)))) => Err(format!("{name}: {e}")),
            Ok(((), Incoming::Reply(r))) => Ok(r),
            Ok(((), Incoming::Garbled(why))) => Err(format!("{name}: garbled reply {why}")),
            Err(RecvTimeoutError::Timeout) => Err(format!("{name}: no answer within {timeout:?}")),
            Ok(((), Incoming::Closed)) | Err(RecvTimeoutError::Disconnected) => {
                let status = self.child.close(Duration::from_secs(10)).map(|s| s.to_string()).unwrap_or_default();
                Err(format!("{name} exited ({status}): {}", self.child.tail().join("\n")))
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.send(&Cmd::Quit);
        self.child.close(Duration::from_secs(10));
    }
}

fn child_args(a: &Args, role: Role) -> Vec<String> {
    let list = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    let mut out = vec![
        "--role".into(),
        format!("{role:?}").to_lowercase(),
        "--memory".into(),
        format!("{:?}", a.memory).to_lowercase(),
        "--layers".into(),
        a.layers.to_string(),
        "--pool-blocks".into(),
        a.pool_blocks.to_string(),
        "--slot-kib".into(),
        (a.slot_bytes() >> 10).to_string(),
        "--slots".into(),
        a.slots.to_string(),
        "--visible".into(),
        format!("{:?}", a.visible).to_lowercase(),
        "--gpus".into(),
        list(&a.gpus.iter().map(|&g| u64::from(g)).collect::<Vec<_>>()),
        "--backend".into(),
        a.backend.clone(),
        "--engine-path".into(),
        format!("{:?}", a.engine_path).to_lowercase(),
    ];
    if let Some(ptx) = &a.ptx {
        out.push("--ptx".into());
        out.push(ptx.display().to_string());
    }
    out.push("--tokens".into());
    out.push(list(&a.tokens));
    // The children start the engine only when its method is selected.
    let methods: Vec<String> =
        a.methods.iter().filter_map(|m| m.to_possible_value().map(|v| v.get_name().to_owned())).collect();
    out.push("--methods".into());
    out.push(methods.join(","));
    out
}

#[derive(Debug, Serialize)]
struct Sample {
    ready_to_received_ms: f64,
    p_post_to_done_ms: f64,
}

#[derive(Debug, Serialize)]
struct CaseResult {
    tokens: u64,
    pattern: Option<Pattern>,
    method: Method,
    bytes: u64,
    descriptors: u64,
    posts: u64,
    staging: Option<serde_json::Value>,
    /// The `engine` method: what P's and D's engines counted in the last iteration.
    engine: Option<serde_json::Value>,
    /// Why the case did not complete (engine cases only: the others end the run).
    error: Option<String>,
    gbps_median: f64,
    gbps_best: f64,
    ready_to_received_ms_median: f64,
    ready_to_received_ms_min: f64,
    ready_to_received_ms_max: f64,
    samples: Vec<Sample>,
    verified: bool,
    verification: serde_json::Value,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// P's and D's answers to one command, or both errors.
fn both(p: Result<Reply, String>, d: Result<Reply, String>) -> Result<(Reply, Reply), String> {
    match (p, d) {
        (Ok(p), Ok(d)) => Ok((p, d)),
        (Err(p), Err(d)) => Err(format!("{p}; {d}")),
        (Err(e), _) | (_, Err(e)) => Err(e),
    }
}

fn run_case(p: &mut Proc, d: &mut Proc, args: &Args, case: &Case, index: u64) -> Result<CaseResult, String> {
    let t = Duration::from_secs(120);
    // One descriptor per 4 KiB unit (the reference, and direct posts of fragmented ids, which merge
    // to the same thing) is slow: fewer iterations.
    let slow =
        case.method == Method::PerBlock || (case.method == Method::Direct && case.pattern == Pattern::Fragmented);
    let reps = if slow { args.per_block_reps } else { args.reps }.max(1);
    let warmup = if slow { args.warmup.min(1) } else { args.warmup };
    let total = warmup + reps;
    let mut samples = Vec::new();
    let mut verification = serde_json::Value::Null;
    let mut verified = case.method == Method::Ceiling;
    let (mut descriptors, mut posts, mut bytes) = (0, 0, 0);
    let mut engine = None;
    for iter in 0..total {
        let seed = unitpack::mix64(args.seed ^ (index << 32) ^ u64::from(iter));
        let prep = Cmd::Prepare { case: case.clone(), iter, seed };
        d.send(&prep)?;
        p.send(&prep)?;
        // Both answers are read before either error is returned, so a failed engine case leaves
        // both processes in lock step for the cases after it.
        both(p.recv(t), d.recv(t))?;
        d.send(&Cmd::Run)?;
        p.send(&Cmd::Run)?;
        let (rp, rd) = both(p.recv(t), d.recv(t))?;
        let Reply::Sent { t_ready, t_done, descriptors: n, posts: k, bytes: b, engine: pe } = rp else {
            return Err("P: unexpected reply to Run".into());
        };
        let Reply::Received { t_received, engine: de, .. } = rd else {
            return Err("D: unexpected reply to Run".into());
        };
        (descriptors, posts, bytes) = (n, k, b);
        if let (Some(pe), Some(de)) = (pe, de) {
            engine = Some(serde_json::json!({ "iteration": iter, "p": pe, "d": de }));
        }
        if iter >= warmup {
            samples.push(Sample {
                ready_to_received_ms: t_received.saturating_sub(t_ready) as f64 / 1e6,
                p_post_to_done_ms: t_done.saturating_sub(t_ready) as f64 / 1e6,
            });
        }
        if iter + 1 == total && case.method != Method::Ceiling {
            d.send(&Cmd::Verify)?;
            let Reply::Verified { units, bad_units, untouched_bytes, bad_untouched, first_error } = d.recv(t)? else {
                return Err("D: unexpected reply to Verify".into());
            };
            verified =
                bad_units == 0 && bad_untouched == 0 && units == u64::from(args.regions()) * case.d_ids.len() as u64;
            verification = serde_json::json!({
                "iteration": iter, "units_checked": units, "bad_units": bad_units,
                "untouched_bytes_checked": untouched_bytes, "bad_untouched_blocks": bad_untouched,
                "first_error": first_error,
            });
        }
    }
    let mut ms: Vec<f64> = samples.iter().map(|s| s.ready_to_received_ms).collect();
    let med = median(&mut ms);
    let best = ms.first().copied().unwrap_or(f64::NAN);
    let staging = match case.method {
        Method::Staged => Some(serde_json::json!({ "slot_bytes": args.slot_bytes(), "slots": args.slots,
            "staging_bytes_per_side": args.slot_bytes() * u64::from(args.slots) })),
        // The engine's slots also hold a table of up to `max_entries` 16-byte entries each.
        Method::Engine => Some(serde_json::json!({ "slot_bytes": args.slot_bytes(), "slots": args.slots,
            "max_entries": StagingConfig::default().max_entries })),
        _ => None,
    };
    Ok(CaseResult {
        tokens: case.tokens,
        pattern: (case.method != Method::Ceiling).then_some(case.pattern),
        method: case.method,
        bytes,
        descriptors,
        posts,
        staging,
        engine,
        error: None,
        gbps_median: bytes as f64 / (med * 1e6),
        gbps_best: bytes as f64 / (best * 1e6),
        ready_to_received_ms_median: med,
        ready_to_received_ms_min: best,
        ready_to_received_ms_max: ms.last().copied().unwrap_or(f64::NAN),
        samples,
        verified,
        verification,
    })
}

/// An engine case that did not run to the end.
fn failed_case(case: &Case, error: String) -> CaseResult {
    CaseResult {
        tokens: case.tokens,
        pattern: Some(case.pattern),
        method: case.method,
        bytes: 0,
        descriptors: 0,
        posts: 0,
        staging: None,
        engine: None,
        error: Some(error),
        gbps_median: f64::NAN,
        gbps_best: f64::NAN,
        ready_to_received_ms_median: f64::NAN,
        ready_to_received_ms_min: f64::NAN,
        ready_to_received_ms_max: f64::NAN,
        samples: Vec::new(),
        verified: false,
        verification: serde_json::Value::Null,
    }
}

fn orchestrate(args: &Args) -> Result<serde_json::Value, String> {
    if args.gpus.len() != 2 {
        return Err("--gpus takes two GPUs (P's, D's)".into());
    }
    let cache_len = u64::from(args.regions()) * u64::from(args.pool_blocks) * UNIT;
    let ceiling = (args.ceiling_mib << 20).min(cache_len);
    let started = Instant::now();
    let mut p = Proc::spawn("P", args, Role::P)?;
    let mut d = Proc::spawn("D", args, Role::D)?;
    let setup = Duration::from_secs(90);
    let Reply::Hello(pi) = p.recv(setup)? else { return Err("P: no hello".into()) };
    let Reply::Hello(di) = d.recv(setup)? else { return Err("D: no hello".into()) };
    p.send(&Cmd::Peer(di.clone()))?;
    d.send(&Cmd::Peer(pi.clone()))?;
    let (rp, rd) = (p.recv(setup)?, d.recv(setup)?);
    // Why the engine method cannot run, if it was selected (the other methods run regardless).
    let mut engine_error = None;
    for r in [rp, rd] {
        match r {
            Reply::Peered { engine_error: e } => engine_error = engine_error.or(e),
            other => return Err(format!("unexpected reply to Peer: {other:?}")),
        }
    }
    eprintln!("P: {}\nD: {}", pi.device, di.device);
    for v in pi.validation.iter().chain(&di.validation) {
        eprintln!("driver validation: {v}");
    }

    let mut results = Vec::new();
    let mut index = 0u64;
    let ceiling_case = |tokens| Case {
        tokens,
        pattern: Pattern::Contiguous,
        method: Method::Ceiling,
        p_ids: vec![0],
        d_ids: vec![0],
        bytes: ceiling,
    };
    let c = run_case(&mut p, &mut d, args, &ceiling_case(0), index)?;
    eprintln!(
        "ceiling: {} MiB in {:.3} ms median: {:.1} GB/s",
        c.bytes >> 20,
        c.ready_to_received_ms_median,
        c.gbps_median
    );
    let ceiling_gbps = c.gbps_median;
    results.push(c);
    for &tokens in &args.tokens {
        let n = tokens.div_ceil(16) as u32;
        if n > args.pool_blocks {
            return Err(format!("{tokens} tokens need {n} blocks, the pool has {}", args.pool_blocks));
        }
        let start = 100.min(args.pool_blocks - n);
        let contiguous: Vec<u32> = (start..start + n).collect();
        let patterns = [
            (Pattern::Contiguous, contiguous.clone(), contiguous),
            (
                Pattern::Fragmented,
                Rng::new(args.seed ^ 0x9e37_79b9_7f4a_7c15 ^ tokens).permutation(args.pool_blocks, n as usize),
                Rng::new(args.seed ^ 0xd1b5_4a32_d192_ed03 ^ tokens).permutation(args.pool_blocks, n as usize),
            ),
        ];
        for (pattern, p_ids, d_ids) in patterns {
            for &method in &args.methods {
                if method == Method::Ceiling {
                    continue;
                }
                index += 1;
                let case = Case { tokens, pattern, method, p_ids: p_ids.clone(), d_ids: d_ids.clone(), bytes: 0 };
                if let (Method::Engine, Some(e)) = (method, &engine_error) {
                    eprintln!("{tokens:>6} tokens {pattern:?} {method:?}: not run: {e}");
                    results.push(failed_case(&case, format!("not run: {e}")));
                    continue;
                }
                let r = match run_case(&mut p, &mut d, args, &case, index) {
                    Ok(r) => r,
                    Err(e) if method == Method::Engine => {
                        eprintln!("{tokens:>6} tokens {pattern:?} {method:?}: FAILED: {e}");
                        engine_error =
                            Some(format!("an earlier engine case failed ({tokens} tokens {pattern:?}): {e}"));
                        results.push(failed_case(&case, e));
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                let pieces = match &r.engine {
                    Some(e) => format!(", {} pieces, {} entries", e["p"]["pieces"], e["p"]["entries"]),
                    None => String::new(),
                };
                eprintln!(
                    "{tokens:>6} tokens {pattern:?} {method:?}: {} descriptors{pieces}, {:.3} ms median ready→received, {:.1} GB/s ({:.0}% of ceiling), verified {}",
                    r.descriptors,
                    r.ready_to_received_ms_median,
                    r.gbps_median,
                    100.0 * r.gbps_median / ceiling_gbps,
                    r.verified
                );
                results.push(r);
            }
        }
    }
    // A second ceiling at the end shows drift over the run.
    index += 1;
    let c2 = run_case(&mut p, &mut d, args, &ceiling_case(1), index)?;
    eprintln!("ceiling (end of run): {:.1} GB/s", c2.gbps_median);
    let end_ceiling = c2.gbps_median;
    results.push(c2);

    // kvpush's figure is the engine method's (what a user of kvpush gets); where it did not run, the
    // best of the bench's own pipelines. The best pipeline is reported beside it either way.
    let best = |tokens: u64, pattern: Pattern, engine: bool| {
        results
            .iter()
            .filter(|r| r.tokens == tokens && r.pattern == Some(pattern) && r.method != Method::PerBlock && r.verified)
            .filter(|r| (r.method == Method::Engine) == engine)
            .max_by(|a, b| a.gbps_median.total_cmp(&b.gbps_median))
            .map(|r| (r.method, r.gbps_median))
    };
    let largest = args.tokens.iter().copied().max().unwrap_or(0);
    let summary = |pattern: Pattern, target: f64, engine: bool| {
        let per_block = results
            .iter()
            .find(|r| r.tokens == largest && r.pattern == Some(pattern) && r.method == Method::PerBlock)
            .map(|r| r.gbps_median);
        let found =
            best(largest, pattern, engine).or_else(|| if engine { best(largest, pattern, false) } else { None });
        match found {
            Some((m, g)) => serde_json::json!({
                "method": m, "gbps": g, "ratio": g / ceiling_gbps, "target": target, "met": g / ceiling_gbps >= target,
                "per_block_gbps": per_block, "per_block_ratio": per_block.map(|p| p / ceiling_gbps),
            }),
            None => serde_json::Value::Null,
        }
    };
    let contiguous = summary(Pattern::Contiguous, 0.8, true);
    let fragmented = summary(Pattern::Fragmented, 0.4, true);
    let pipeline = serde_json::json!({
        "contiguous": summary(Pattern::Contiguous, 0.8, false),
        "fragmented": summary(Pattern::Fragmented, 0.4, false),
    });
    let engine_ratio = |pattern: Pattern| {
        results
            .iter()
            .find(|r| r.tokens == largest && r.pattern == Some(pattern) && r.method == Method::Engine && r.verified)
            .map(|r| r.gbps_median / ceiling_gbps)
    };
    // Per case, the engine against the better of the direct WRITE and the bench's staged pipeline:
    // the engine's path choice should never cost more than a few percent.
    let method_gbps = |tokens: u64, pattern: Pattern, m: Method| {
        results
            .iter()
            .find(|r| r.tokens == tokens && r.pattern == Some(pattern) && r.method == m && r.verified)
            .map(|r| r.gbps_median)
    };
    let mut engine_vs_best = Vec::new();
    for &tokens in &args.tokens {
        for pattern in [Pattern::Contiguous, Pattern::Fragmented] {
            let engine = method_gbps(tokens, pattern, Method::Engine);
            let direct = method_gbps(tokens, pattern, Method::Direct);
            let staged = method_gbps(tokens, pattern, Method::Staged);
            let best = direct.into_iter().chain(staged).reduce(f64::max);
            if let (Some(e), Some(b)) = (engine, best) {
                engine_vs_best.push(serde_json::json!({
                    "tokens": tokens, "pattern": pattern, "engine_gbps": e, "direct_gbps": direct,
                    "staged_gbps": staged, "engine_vs_best": e / b,
                }));
            }
        }
    }
    let engine_vs_best_min = engine_vs_best.iter().filter_map(|c| c["engine_vs_best"].as_f64()).reduce(f64::min);
    let all_verified = results.iter().all(|r| r.verified);
    Ok(serde_json::json!({
        "bench": "gpu_push",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "p_device": pi.device,
        "d_device": di.device,
        "driver_validation": { "p": pi.validation, "d": di.validation },
        "config": args,
        "shape": { "layers": args.layers, "regions": args.regions(), "kv_heads_per_rank": 1, "head_dim": 128,
                   "dtype": "bf16", "block_tokens": 16, "bytes_per_block_per_region": UNIT,
                   "bytes_per_token": u64::from(args.regions()) * UNIT / 16 },
        "ceiling": { "bytes": ceiling, "gbps_median": ceiling_gbps, "gbps_median_end_of_run": end_ceiling },
        "tokens_for_ratios": largest,
        "contiguous_ratio": contiguous.get("ratio").cloned().unwrap_or(serde_json::Value::Null),
        "fragmented_ratio": fragmented.get("ratio").cloned().unwrap_or(serde_json::Value::Null),
        "engine_contiguous_ratio": engine_ratio(Pattern::Contiguous),
        "engine_fragmented_ratio": engine_ratio(Pattern::Fragmented),
        "engine_error": engine_error,
        "engine_vs_best_min": engine_vs_best_min,
        "engine_vs_best": engine_vs_best,
        "contiguous": contiguous,
        "fragmented": fragmented,
        "pipeline": pipeline,
        "all_verified": all_verified,
        "wall_s": started.elapsed().as_secs_f64(),
        "cases": results,
    }))
}

fn print_table(v: &serde_json::Value) {
    println!(
        "\n{:>6} {:<11} {:<10} {:>9} {:>10} {:>9} {:>7} {:>8}",
        "tokens", "pattern", "method", "descs", "ms (med)", "GB/s", "ceil%", "verified"
    );
    let ceil = v["ceiling"]["gbps_median"].as_f64().unwrap_or(f64::NAN);
    for c in v["cases"].as_array().into_iter().flatten() {
        let g = c["gbps_median"].as_f64().unwrap_or(f64::NAN);
        println!(
            "{:>6} {:<11} {:<10} {:>9} {:>10.3} {:>9.1} {:>6.0}% {:>8}{}",
            c["tokens"].as_u64().unwrap_or(0),
            c["pattern"].as_str().unwrap_or("-"),
            c["method"].as_str().unwrap_or("-"),
            c["descriptors"].as_u64().unwrap_or(0),
            c["ready_to_received_ms_median"].as_f64().unwrap_or(f64::NAN),
            g,
            100.0 * g / ceil,
            c["verified"].as_bool().unwrap_or(false),
            match (&c["engine"]["p"], &c["error"]) {
                (_, serde_json::Value::String(e)) => format!("  error: {e}"),
                (p, _) if p.is_object() => format!("  pieces {} entries {}", p["pieces"], p["entries"]),
                _ => String::new(),
            }
        );
    }
    println!(
        "contiguous_ratio {} (target 0.8, {}), fragmented_ratio {} (target 0.4, {}), all verified: {}",
        v["contiguous_ratio"],
        v["contiguous"]["method"],
        v["fragmented_ratio"],
        v["fragmented"]["method"],
        v["all_verified"]
    );
    println!(
        "engine_contiguous_ratio {}, engine_fragmented_ratio {}; the bench's own pipelines: {} ({}), {} ({})",
        v["engine_contiguous_ratio"],
        v["engine_fragmented_ratio"],
        v["pipeline"]["contiguous"]["ratio"],
        v["pipeline"]["contiguous"]["method"],
        v["pipeline"]["fragmented"]["ratio"],
        v["pipeline"]["fragmented"]["method"]
    );
}

/// `cargo test` runs benches without `--bench`: a small pass over host memory and real NIXL.
fn self_test() -> Result<(), String> {
    let what = "NIXL for the gpu_push self-test (libnixl_capi.so: source scripts/nixl.sh)";
    if !kvpush_testkit::require(what, kvpush::transport::nixl::available()) {
        return Ok(());
    }
    let args = Args::parse_from([
        "gpu_push",
        "--memory",
        "host",
        "--tokens",
        "64,256",
        "--layers",
        "4",
        "--pool-blocks",
        "64",
        "--ceiling-mib",
        "1",
        "--slot-kib",
        "48",
        "--slots",
        "2",
        "--warmup",
        "0",
        "--reps",
        "2",
        "--per-block-reps",
        "1",
    ]);
    let v = orchestrate(&args)?;
    print_table(&v);
    let list = v["cases"].as_array().cloned().unwrap_or_default();
    let cases = list.len();
    let methods = args.methods.iter().filter(|&&m| m != Method::Ceiling).count();
    if v["all_verified"] != serde_json::Value::Bool(true) || cases != 2 + 2 * args.tokens.len() * methods {
        return Err(format!("self-test failed: {cases} cases, all verified: {}", v["all_verified"]));
    }
    // Each engine case's last iteration took one of the two paths: staged through the engine's
    // staging (HostStager here) on both sides, or direct because it measured faster.
    let engine: Vec<&serde_json::Value> = list.iter().filter(|c| c["method"] == "engine").collect();
    let one_path = |c: &&serde_json::Value| {
        let e = &c["engine"];
        let staged =
            e["p"]["staged_transfers"] == 1 && e["p"]["pieces"].as_u64().unwrap_or(0) > 0 && e["d"]["received"] == 1;
        let direct = e["p"]["chosen_direct"] == 1 && e["p"]["staged_transfers"] == 0;
        staged != direct
    };
    if engine.len() != 2 * args.tokens.len() || !engine.iter().all(one_path) {
        return Err(format!("self-test failed: engine cases took no single path: {engine:?}"));
    }
    if v["engine_vs_best_min"].as_f64().is_none_or(|r| !r.is_finite() || r <= 0.0) {
        return Err(format!("self-test failed: no engine_vs_best_min: {}", v["engine_vs_best_min"]));
    }
    eprintln!("gpu_push self-test (host memory, NIXL): {cases} cases, every byte verified, engine on one path each");
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(path) = &args.emit_ptx {
        return match kvpush_cuda::compile_ptx(&args.arch).and_then(|ptx| {
            std::fs::write(path, ptx)
                .map_err(|e| kvpush_cuda::CudaError::Bounds { what: "writing PTX", detail: e.to_string() })
        }) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("gpu_push: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let result = match args.role {
        Some(role) => child_main(args, role),
        None if !args.bench && args.json.is_none() => self_test(),
        None => orchestrate(&args).and_then(|v| {
            print_table(&v);
            if let Some(path) = &args.json {
                let text = serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?;
                std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
                eprintln!("wrote {}", path.display());
            }
            if v["all_verified"] == serde_json::Value::Bool(true) {
                Ok(())
            } else {
                Err("some transfers did not verify".into())
            }
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu_push: {e}");
            ExitCode::FAILURE
        }
    }
}
