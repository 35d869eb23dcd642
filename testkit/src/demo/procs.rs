//! `kvpush demo --transport nixl --processes 2`: P and D as two processes over real NIXL.
//!
//! Read [`run`] (the parent) and then [`worker_main`] (a child). The parent is the router and
//! orchestrator: it spawns two children of its own executable, `kvpush demo-worker --role prefill`
//! and `--role decode` (a hidden subcommand, flags in [`WorkerSpec`]), and talks to each over its
//! stdin and stdout, one JSON object per line ([`Command`] down, [`Event`] up; children log to stderr
//! only). Each child builds its engine's workers (TP ranks) with memory of the device
//! `KVPUSH_DEVICE` selects, one [`NixlTransport`] agent (`"prefill/0"`, …) and one [`SideChannel`]
//! (127.0.0.1, port 0) per worker, the side channel serving as the engine's control link. The decode
//! child dials every prefill worker from every one of its workers (the parent relays the ports); the
//! handshakes on the side channel load NIXL metadata both ways.
//!
//! The parent then plays the workload with the driver the in-process demo uses (`driver.rs`: the same
//! requests, keys, seeds and orders), as a router would: it sends `prefill` commands (P allocates blocks, fills them
//! with [`pattern::fill`], calls `request_finished` after the simulated prefill time and reports
//! `ready` with a wall-clock timestamp) and `decode` commands (D allocates, registers in push mode or
//! starts the read with P's relayed block ids in pull mode, and verifies every byte that arrives with
//! [`pattern::verify`]). Latency is D's `received` minus P's `ready` on the wall clock both processes
//! share; a request's engine time is the sum of both children's engine-thread time for it.
//!
//! After the workload of a mode the parent measures two references for the docs, side by side in
//! [`BANDWIDTH_ROUNDS`] interleaved rounds: `ceiling_gbps`, one single-descriptor NIXL WRITE of the
//! bytes the mode moved (capped at 1 GiB) between two extra agents, and, in push mode, `push_gbps`:
//! the same requests pushed with every one ready at once. Each is the median of its rounds; every
//! round's figure is kept in the report.
//!
//! A child's work is done by a `WorkerState`, which the in-process demo runs too (one per engine,
//! its events queued instead of written to stdout).
//!
//! Children exit when their stdin closes (the parent exited or died); the parent kills and reaps them
//! on any error ([`WorkerProc`] does so when dropped).

use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};
use serde::{Deserialize, Serialize};

pub use crate::child::LogFn;
use crate::child::{self, Channel, Child};

use super::driver::{self, Side};
use super::{pattern, requests, BlockLists, DemoError, ModeReport, Pool, Report, Rng, Topology, Workload};
use kvpush::device::{self, Buffer, Device, MemRegion};
use kvpush::engine::side::{SideChannel, SideConfig};
use kvpush::engine::{Config, Engine, Finished};
use kvpush::proto::layout::BlockOrder;
use kvpush::proto::msg::{blocks_for, Mode};
use kvpush::proto::Key;
use kvpush::transport::nixl::{self, NixlConfig, NixlTransport};
use kvpush::transport::{Desc, Op, Transport, XferState};

/// Rounds of the bandwidth references (a ceiling WRITE, then a push of the workload, per round).
pub const BANDWIDTH_ROUNDS: usize = 5;

/// Largest buffer of the single-descriptor reference.
pub const CEILING_MAX_BYTES: u64 = 1 << 30;

// ---------------------------------------------------------------------------------------------------
// Worker flags and the line protocol.

/// Which engine a child runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The producer (P).
    Prefill,
    /// The consumer (D).
    Decode,
}

impl Role {
    /// The engine id of the role.
    pub fn engine_id(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.engine_id())
    }
}

/// `--mode` of a child.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeFlag {
    /// Push.
    Push,
    /// Pull.
    Pull,
}

/// `--order` of a child.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OrderFlag {
    /// `[heads, tokens, head_dim]`.
    Hnd,
    /// `[tokens, heads, head_dim]`.
    Nhd,
}

/// The flags of `kvpush demo-worker` (hidden): one child's role, mode, topology and timeouts.
#[derive(Clone, Debug, clap::Args)]
pub struct WorkerSpec {
    /// Engine this child runs.
    #[arg(long, value_enum)]
    pub role: Role,
    /// Transfer mode of this engine (a test may give the two children different modes).
    #[arg(long, value_enum, default_value = "push")]
    pub mode: ModeFlag,
    /// Model layers.
    #[arg(long, default_value_t = 16)]
    pub layers: u32,
    /// KV heads of the model.
    #[arg(long, default_value_t = 1)]
    pub kv_heads: u32,
    /// Head dimension.
    #[arg(long, default_value_t = 128)]
    pub head_dim: u32,
    /// Producer TP size.
    #[arg(long, default_value_t = 1)]
    pub p_tp: u16,
    /// Consumer TP size.
    #[arg(long, default_value_t = 1)]
    pub d_tp: u16,
    /// Producer block size (tokens).
    #[arg(long, default_value_t = 16)]
    pub p_block: u32,
    /// Consumer block size (tokens).
    #[arg(long, default_value_t = 16)]
    pub d_block: u32,
    /// Blocks per worker.
    #[arg(long, default_value_t = 4096)]
    pub num_blocks: u32,
    /// Every n-th layer is a sliding-window layer (0: none).
    #[arg(long, default_value_t = 0)]
    pub window_every: u32,
    /// Sliding window (tokens).
    #[arg(long, default_value_t = 1024)]
    pub window_tokens: u32,
    /// Element order inside a block.
    #[arg(long, value_enum, default_value = "hnd")]
    pub order: OrderFlag,
    /// Writer threads per worker.
    #[arg(long, default_value_t = 1)]
    pub writers: usize,
    /// Staging of fragmented WRITEs.
    #[arg(long, value_enum, default_value = "auto")]
    pub staging: super::StagingFlag,
    /// Staging slots per side (0: the default).
    #[arg(long, default_value_t = 0)]
    pub staging_slots: usize,
    /// Staging slot size in KiB (0: the default).
    #[arg(long, default_value_t = 0)]
    pub staging_slot_kib: u64,
    /// How the block pool hands out ids.
    #[arg(long, value_enum, default_value = "runs")]
    pub allocator: super::AllocatorFlag,
    /// Producer lease: how long finished blocks wait for their registrations (ms).
    #[arg(long, default_value_t = 30_000)]
    pub lease_ms: u64,
    /// Consumer completion timeout: how long a registered request waits for its data (ms).
    #[arg(long, default_value_t = 120_000)]
    pub timeout_ms: u64,
    /// Producer, pull: how long a granted READ may take before its grant expires (ms).
    #[arg(long, default_value_t = 60_000)]
    pub pull_read_timeout_ms: u64,
    /// Side-channel heartbeat interval on idle connections (ms).
    #[arg(long, default_value_t = 1_000)]
    pub heartbeat_ms: u64,
    /// A side-channel peer silent for this long is lost (ms).
    #[arg(long, default_value_t = 5_000)]
    pub peer_timeout_ms: u64,
    /// Side-channel connect and handshake limit (ms).
    #[arg(long, default_value_t = 10_000)]
    pub handshake_timeout_ms: u64,
    /// Address the side channels listen on and dial (ports are picked by the system).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// NIXL backend plugin.
    #[arg(long, default_value = "UCX")]
    pub backend: String,
    /// Engine id, instead of the role's (`prefill`, `decode`): a third engine beside the pair.
    #[arg(long)]
    pub engine_id: Option<String>,
    /// Hand the engine each request's tokens rounded up to this side's whole blocks
    /// ([`Topology::whole_blocks`]).
    #[arg(long)]
    pub whole_blocks: bool,
    /// P's engine setting for requests reported layer by layer ([`Topology::layerwise`]).
    #[arg(long, value_enum, default_value = "auto")]
    pub layerwise: super::LayerwiseFlag,
    /// Fill and verify every slot of a request's blocks ([`Topology::whole_block_bytes`]).
    #[arg(long)]
    pub whole_block_bytes: bool,
    /// P overwrites a request's blocks the moment its engine released them (the fault suite's
    /// Scribbler), so that a transfer still reading them delivers other bytes, which D's check sees.
    #[arg(long)]
    pub scribble: bool,
    /// P keeps its GPU busy for its whole life ([`GpuBusy`]), as a real prefill's next layer would
    /// while the writer posts the last one; the demo's per-layer compute is a sleep.
    #[arg(long)]
    pub gpu_busy: bool,
}

impl WorkerSpec {
    /// A child of `role` in `mode` for topology `t`, with the engines' default timeouts.
    pub fn new(role: Role, mode: Mode, t: &Topology) -> Self {
        Self {
            role,
            mode: match mode {
                Mode::Push => ModeFlag::Push,
                Mode::Pull => ModeFlag::Pull,
            },
            layers: t.layers,
            kv_heads: t.kv_heads,
            head_dim: t.head_dim,
            p_tp: t.p_tp,
            d_tp: t.d_tp,
            p_block: t.p_block,
            d_block: t.d_block,
            num_blocks: t.num_blocks,
            window_every: t.window_every,
            window_tokens: t.window_tokens,
            order: match t.order {
                BlockOrder::Hnd => OrderFlag::Hnd,
                BlockOrder::Nhd => OrderFlag::Nhd,
            },
            writers: t.writers,
            staging: t.staging,
            staging_slots: t.staging_slots,
            staging_slot_kib: t.staging_slot_bytes >> 10,
            allocator: t.allocator,
            whole_blocks: t.whole_blocks,
            layerwise: t.layerwise,
            whole_block_bytes: t.checks_whole_blocks(),
            lease_ms: 30_000,
            timeout_ms: 120_000,
            pull_read_timeout_ms: 60_000,
            heartbeat_ms: 1_000,
            peer_timeout_ms: 5_000,
            handshake_timeout_ms: 10_000,
            host: "127.0.0.1".into(),
            backend: "UCX".into(),
            engine_id: None,
            scribble: false,
            gpu_busy: false,
        }
    }

    /// The engine mode.
    pub fn engine_mode(&self) -> Mode {
        match self.mode {
            ModeFlag::Push => Mode::Push,
            ModeFlag::Pull => Mode::Pull,
        }
    }

    /// The topology these flags describe.
    pub fn topology(&self) -> Topology {
        Topology {
            layers: self.layers,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            p_tp: self.p_tp,
            d_tp: self.d_tp,
            p_block: self.p_block,
            d_block: self.d_block,
            num_blocks: self.num_blocks,
            window_every: self.window_every,
            window_tokens: self.window_tokens,
            order: match self.order {
                OrderFlag::Hnd => BlockOrder::Hnd,
                OrderFlag::Nhd => BlockOrder::Nhd,
            },
            writers: self.writers,
            staging: self.staging,
            staging_slots: self.staging_slots,
            staging_slot_bytes: self.staging_slot_kib << 10,
            allocator: self.allocator,
            whole_blocks: self.whole_blocks,
            layerwise: self.layerwise,
            whole_block_bytes: self.whole_block_bytes,
        }
    }

    /// The command line after `kvpush demo-worker`.
    pub fn to_args(&self) -> Vec<String> {
        let flag = |v: &mut Vec<String>, name: &str, value: String| {
            v.push(format!("--{name}"));
            v.push(value);
        };
        let mut v = Vec::new();
        flag(&mut v, "role", self.role.engine_id().into());
        flag(&mut v, "mode", self.engine_mode().to_string());
        flag(&mut v, "layers", self.layers.to_string());
        flag(&mut v, "kv-heads", self.kv_heads.to_string());
        flag(&mut v, "head-dim", self.head_dim.to_string());
        flag(&mut v, "p-tp", self.p_tp.to_string());
        flag(&mut v, "d-tp", self.d_tp.to_string());
        flag(&mut v, "p-block", self.p_block.to_string());
        flag(&mut v, "d-block", self.d_block.to_string());
        flag(&mut v, "num-blocks", self.num_blocks.to_string());
        flag(&mut v, "window-every", self.window_every.to_string());
        flag(&mut v, "window-tokens", self.window_tokens.to_string());
        flag(&mut v, "order", if self.order == OrderFlag::Nhd { "nhd" } else { "hnd" }.into());
        flag(&mut v, "writers", self.writers.to_string());
        flag(&mut v, "staging", self.staging.as_str().into());
        flag(&mut v, "staging-slots", self.staging_slots.to_string());
        flag(&mut v, "staging-slot-kib", self.staging_slot_kib.to_string());
        flag(&mut v, "allocator", self.allocator.as_str().into());
        flag(&mut v, "lease-ms", self.lease_ms.to_string());
        flag(&mut v, "timeout-ms", self.timeout_ms.to_string());
        flag(&mut v, "pull-read-timeout-ms", self.pull_read_timeout_ms.to_string());
        flag(&mut v, "heartbeat-ms", self.heartbeat_ms.to_string());
        flag(&mut v, "peer-timeout-ms", self.peer_timeout_ms.to_string());
        flag(&mut v, "handshake-timeout-ms", self.handshake_timeout_ms.to_string());
        flag(&mut v, "host", self.host.clone());
        flag(&mut v, "backend", self.backend.clone());
        if let Some(id) = &self.engine_id {
            flag(&mut v, "engine-id", id.clone());
        }
        if self.whole_blocks {
            v.push("--whole-blocks".into());
        }
        flag(&mut v, "layerwise", self.layerwise.as_str().into());
        if self.whole_block_bytes {
            v.push("--whole-block-bytes".into());
        }
        if self.scribble {
            v.push("--scribble".into());
        }
        if self.gpu_busy {
            v.push("--gpu-busy".into());
        }
        v
    }
}

/// Parent → child, one JSON object per line (`{"cmd": "prefill", ...}`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum Command {
    /// D: dial every prefill worker (these side-channel ports) from every worker of this engine.
    Connect {
        /// The prefill workers' side-channel ports.
        ports: Vec<u16>,
    },
    /// P: answer [`Event::Peers`] once every worker has `per_worker` handshaken peers (or at the limit).
    AwaitPeers {
        /// Peers each worker should see.
        per_worker: usize,
        /// How long to wait (ms).
        timeout_ms: u64,
    },
    /// P: allocate blocks for request `req`, fill them, and call `request_finished` `delay_ns` after the
    /// fill (`None`: hold the request, report [`Event::Filled`], and wait for [`Command::Go`]).
    Prefill {
        /// The router's index of the request.
        req: u64,
        /// Its key (`"<transfer id, 32 hex digits>#<attempt>"`).
        #[serde(with = "key_text")]
        key: Key,
        /// Prompt tokens.
        tokens: u64,
        /// Seed of its contents.
        seed: u64,
        /// Simulated prefill time after the fill (ns).
        delay_ns: Option<u64>,
    },
    /// P: as [`Command::Prefill`], then simulate `layer_ns` of compute per layer: layer `l` is final
    /// `delay_ns + (l + 1) · layer_ns` after the fill. `layerwise`: report each layer as it is final
    /// (`layers_ready`); else finish the request after the last. [`Event::Ready`] comes at the last
    /// layer either way.
    PrefillLayers {
        /// The router's index of the request.
        req: u64,
        /// Its key (`"<transfer id, 32 hex digits>#<attempt>"`).
        #[serde(with = "key_text")]
        key: Key,
        /// Prompt tokens.
        tokens: u64,
        /// Seed of its contents.
        seed: u64,
        /// Simulated prefill time after the fill, before the first layer (ns).
        delay_ns: u64,
        /// Simulated compute per layer (ns).
        layer_ns: u64,
        /// Report layer by layer.
        layerwise: bool,
    },
    /// P: once the engine received `registrations` registrations in all (or at the limit), call
    /// `request_finished` for every held request, back to back.
    Go {
        /// Registrations received so far to wait for (the engine's counter).
        registrations: u64,
        /// How long to wait for them (ms).
        timeout_ms: u64,
    },
    /// D: allocate blocks for request `req` and register them (push) or read P's `remote_blocks`
    /// (pull); verify every byte once it arrived.
    Decode {
        /// The router's index of the request.
        req: u64,
        /// Its key (`"<transfer id, 32 hex digits>#<attempt>"`).
        #[serde(with = "key_text")]
        key: Key,
        /// Prompt tokens.
        tokens: u64,
        /// Seed of its contents.
        seed: u64,
        /// Pull: P's block ids, as relayed by the router.
        remote_blocks: Option<BlockLists>,
        /// Verify only once every request sent with this flag has an outcome (bandwidth waves, so
        /// verification does not compete with the transfers for the CPU).
        hold_verify: bool,
    },
    /// Report [`Event::Stats`].
    Stats,
    /// Report [`Event::Metadata`]: each worker's NIXL agent metadata, as a peer loads it.
    Metadata,
    /// Report [`Event::Pool`].
    Pool,
    /// Create one more NIXL agent with one buffer of `bytes` (the single-descriptor reference).
    CeilingSetup {
        /// Bytes of the buffer.
        bytes: u64,
    },
    /// D: load P's reference agent (hex metadata) and keep the reference agent progressing.
    CeilingServe {
        /// P's reference agent metadata, hex.
        metadata: String,
    },
    /// P: time single-descriptor WRITEs of `bytes` into the peer's buffer; report the best.
    CeilingRun {
        /// D's reference agent metadata, hex.
        metadata: String,
        /// D's buffer address.
        remote_addr: u64,
        /// Bytes per WRITE.
        bytes: u64,
        /// WRITEs to time.
        repeats: u32,
    },
    /// Drop the reference agent and its buffer.
    CeilingEnd,
}

/// Side-channel counters of a child (all its workers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SideCounters {
    /// Handshakes completed.
    pub handshakes: u64,
    /// Handshakes refused (either side).
    pub refused: u64,
    /// Malformed frames.
    pub malformed: u64,
    /// Peers lost.
    pub peers_lost: u64,
    /// Connections whose handshake or a record failed authentication.
    #[serde(default)]
    pub auth_failures: u64,
    /// Handshakes past their deadline.
    #[serde(default)]
    pub timeouts: u64,
    /// Records or messages over their state's size limit.
    #[serde(default)]
    pub oversized: u64,
    /// Connections closed at once over a connection limit.
    #[serde(default)]
    pub over_limit: u64,
    /// Frames received from authenticated peers.
    #[serde(default)]
    pub frames_in: u64,
    /// Known peers that came back with a new incarnation.
    #[serde(default)]
    pub restarts: u64,
}

/// Engine counters of a child beyond those the demo reports (all its workers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineCounters {
    /// D: requests received.
    pub received: u64,
    /// D: requests failed.
    pub failed: u64,
    /// Aborts handled.
    pub aborted: u64,
    /// Transfers posted.
    pub posts: u64,
    /// D: failure notifications received from a peer.
    pub remote_failures: u64,
    /// Frames or transfers concerning unknown peers.
    pub unknown_peer: u64,
    /// Frames that could not be decoded.
    pub malformed: u64,
    /// Staged transfers received (all pieces scattered).
    pub staged_received: u64,
    /// Staging frames refused.
    pub staged_malformed: u64,
}

/// Child → parent, one JSON object per line (`{"event": "ready", ...}`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// The child is up: its workers listen on `ports`.
    Hello {
        /// Its role.
        role: Role,
        /// Its process id.
        pid: u32,
        /// Side-channel ports, by TP rank.
        ports: Vec<u16>,
        /// Blocks per worker.
        num_blocks: u32,
    },
    /// D: every side channel handshook every prefill worker.
    Connected {
        /// Handshakes made.
        handshakes: usize,
    },
    /// P: handshaken peers per worker.
    Peers {
        /// Per worker.
        peers: Vec<usize>,
    },
    /// D: the engine took the request (registration or read sent).
    Registered {
        /// The request.
        req: u64,
    },
    /// P: a held request is filled and waits for [`Command::Go`].
    Filled {
        /// The request.
        req: u64,
    },
    /// P: `request_finished` was called for the request.
    Ready {
        /// The request.
        req: u64,
        /// When (µs since the UNIX epoch), just before the call.
        at_us: u64,
        /// Engine-thread time spent for it so far (ns).
        engine_ns: u64,
        /// Its blocks (per KV group), for the router to relay in pull mode.
        blocks: BlockLists,
    },
    /// P: every worker released the request's blocks; they are free again.
    Sent {
        /// The request.
        req: u64,
        /// Why they were released (`Sent`, `LeaseExpired`, ...).
        reason: String,
        /// Engine-thread time since [`Event::Ready`] (ns).
        engine_ns: u64,
        /// When the last worker released them (µs since the UNIX epoch).
        #[serde(default)]
        at_us: u64,
    },
    /// D: every worker received the request, and it was verified; its blocks are free again.
    Received {
        /// The request.
        req: u64,
        /// When the last worker reported it (µs since the UNIX epoch).
        at_us: u64,
        /// Bytes compared.
        verified_bytes: u64,
        /// Whether every byte matched.
        ok: bool,
        /// What did not match.
        detail: Option<String>,
        /// Engine-thread time spent for it (ns).
        engine_ns: u64,
    },
    /// D: the request failed (or ended) on some worker; its blocks are free again.
    Failed {
        /// The request.
        req: u64,
        /// When the last worker reported (µs since the UNIX epoch).
        at_us: u64,
        /// The first failure's reason.
        reason: String,
        /// Engine-thread time spent for it (ns).
        engine_ns: u64,
    },
    /// Engine counters of all workers.
    Stats {
        /// Bytes posted.
        bytes: u64,
        /// Copies before merging.
        descriptors_unmerged: u64,
        /// Descriptors posted.
        descriptors_posted: u64,
        /// Registrations sent (D) or received (P).
        registrations: u64,
        /// Staged pieces written (P; 0 where staging is off).
        #[serde(default)]
        staged_pieces: u64,
        /// Side-channel counters.
        side: SideCounters,
        /// More engine counters.
        #[serde(default)]
        engine: EngineCounters,
    },
    /// Each worker's NIXL agent: its name and metadata (hex).
    Metadata {
        /// `(agent name, metadata hex)` by rank.
        agents: Vec<(String, String)>,
    },
    /// Free blocks of the child's pool.
    Pool {
        /// Free.
        free: usize,
        /// All.
        total: usize,
        /// Held for requests the engine quarantined (`Finished::Quarantined`), until released.
        quarantined: usize,
    },
    /// The reference agent is up.
    CeilingReady {
        /// Its name.
        agent: String,
        /// Its metadata, hex.
        metadata: String,
        /// Its buffer's address.
        addr: u64,
    },
    /// D: the reference agent loaded P's and is progressing.
    CeilingServing,
    /// P: the timed WRITEs.
    CeilingResult {
        /// Best bandwidth (GB/s).
        gbps: f64,
        /// Seconds of each WRITE.
        seconds: Vec<f64>,
    },
    /// The reference agent is gone; `landed`: D found P's bytes at both ends of its buffer.
    CeilingClosed {
        /// D: whether the written bytes arrived (P: always true).
        landed: bool,
    },
    /// Something went wrong; the child keeps running (the parent decides).
    Error {
        /// What.
        message: String,
    },
}

/// Keys as text (`Key`'s `Display`): the tagged JSON enums cannot carry a `u128` number.
mod key_text {
    use serde::{Deserialize, Deserializer, Serializer};

    use kvpush::proto::Key;

    pub(super) fn serialize<S: Serializer>(k: &Key, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(k)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
        let s = String::deserialize(d)?;
        let bad = || serde::de::Error::custom(format!("bad key {s:?} (expected <32 hex digits>#<attempt>)"));
        let (id, attempt) = s.split_once('#').ok_or_else(bad)?;
        let id = u128::from_str_radix(id, 16).map_err(|_| bad())?;
        let attempt = attempt.parse::<u32>().map_err(|_| bad())?;
        Ok(Key::new(id, attempt))
    }
}

// ---------------------------------------------------------------------------------------------------
// The parent's handle on a child.

/// What a child's reader thread passes on: its [`Event`]s, as [`child::Incoming`] replies.
pub type Incoming = child::Incoming<Event>;

/// A running child (`kvpush demo-worker`) on the shared harness ([`Child`]). Dropping it kills and
/// reaps the process.
#[derive(Debug)]
pub struct WorkerProc {
    role: Role,
    child: Child,
}

impl WorkerProc {
    /// Starts `exe demo-worker <spec>` with `env` added; its events go to `tx` tagged with its role,
    /// its log lines to `log` (or this process's stderr), prefixed with the role.
    pub fn spawn(
        exe: &Path,
        spec: &WorkerSpec,
        env: &[(String, String)],
        tx: Sender<(Role, Incoming)>,
        log: Option<LogFn>,
    ) -> std::io::Result<WorkerProc> {
        let mut cmd = std::process::Command::new(exe);
        cmd.arg("demo-worker").args(spec.to_args());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = Child::spawn(cmd, spec.role.engine_id(), spec.role, tx, log)?;
        Ok(WorkerProc { role: spec.role, child })
    }

    /// The child's role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// Sends one command line.
    pub fn send(&mut self, cmd: &Command) -> std::io::Result<()> {
        self.child.send(cmd)
    }

    /// Stops forwarding the child's log lines (they are still kept for [`WorkerProc::stderr_tail`]):
    /// for a normal shutdown, where each side logs the other's side channel closing.
    pub fn mute(&self) {
        self.child.mute();
    }

    /// The last lines the child wrote to stderr (and stray stdout lines).
    pub fn stderr_tail(&self) -> Vec<String> {
        self.child.tail()
    }

    /// Its exit status, if it exited.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child.try_wait()
    }

    /// Kills the child at once (SIGKILL) and reaps it.
    pub fn kill(&mut self) -> Option<ExitStatus> {
        self.child.kill()
    }

    /// Closes the child's stdin: it exits. [`WorkerProc::close`] then waits for it.
    pub fn close_stdin(&mut self) {
        self.child.close_stdin();
    }

    /// Closes the child's stdin (it exits), waits up to `grace`, then kills it; reaps it either way.
    pub fn close(&mut self, grace: Duration) -> Option<ExitStatus> {
        self.child.close(grace)
    }
}

/// What can stop the two-process demo.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProcsError {
    /// Configuration, device or engine errors shared with the in-process demo.
    #[error(transparent)]
    Demo(#[from] DemoError),
    /// A child could not be started.
    #[error("cannot start the {role} worker ({exe}): {source}")]
    Spawn {
        /// Which.
        role: Role,
        /// The executable.
        exe: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A child failed, exited or did not answer.
    #[error("{role} worker: {message}{tail}")]
    Worker {
        /// Which.
        role: Role,
        /// What happened.
        message: String,
        /// Its last stderr lines.
        tail: String,
    },
}

/// Both children of one mode and their event stream.
pub(crate) struct Pair {
    pub(crate) p: WorkerProc,
    pub(crate) d: WorkerProc,
    rx: Receiver<(Role, Incoming)>,
    /// The stream's sender, for a child started in place of one that died ([`Pair::respawn`]).
    tx: Sender<(Role, Incoming)>,
}

impl Pair {
    fn proc(&mut self, role: Role) -> &mut WorkerProc {
        match role {
            Role::Prefill => &mut self.p,
            Role::Decode => &mut self.d,
        }
    }

    /// The next line of either child as it came (a child's exit included), waiting up to `timeout`:
    /// for a caller that kills a child on purpose and must see what the other says meanwhile.
    pub(crate) fn recv(&mut self, timeout: Duration) -> Option<(Role, Incoming)> {
        self.rx.recv_timeout(timeout).ok()
    }

    /// Starts `exe demo-worker <spec>` with `env` in place of the child of `spec.role` (which the
    /// caller killed and reaped), its lines on the same stream.
    pub(crate) fn respawn(
        &mut self,
        exe: &Path,
        spec: &WorkerSpec,
        env: &[(String, String)],
        log: Option<LogFn>,
    ) -> Result<(), ProcsError> {
        let proc = WorkerProc::spawn(exe, spec, env, self.tx.clone(), log).map_err(|source| ProcsError::Spawn {
            role: spec.role,
            exe: exe.display().to_string(),
            source,
        })?;
        *self.proc(spec.role) = proc;
        Ok(())
    }

    /// Closes both children's stdin and reaps them (killing one that lingers).
    pub(crate) fn close(mut self) {
        self.p.mute();
        self.d.mute();
        self.p.close_stdin();
        self.d.close_stdin();
        self.p.close(Duration::from_secs(10));
        self.d.close(Duration::from_secs(10));
    }
}

impl Side for Pair {
    type Error = ProcsError;

    fn send(&mut self, role: Role, cmd: &Command) -> Result<(), ProcsError> {
        match self.proc(role).send(cmd) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.fail(role, format!("cannot send a command: {e}"))),
        }
    }

    fn next(&mut self, timeout: Duration) -> Result<Option<(Role, Event)>, ProcsError> {
        match self.rx.recv_timeout(timeout) {
            Ok((role, Incoming::Reply(Event::Error { message }))) => Err(self.fail(role, message)),
            Ok((role, Incoming::Reply(ev))) => Ok(Some((role, ev))),
            Ok((role, Incoming::Garbled(why))) => Err(self.fail(role, format!("garbled reply {why}"))),
            Ok((role, Incoming::Closed)) => Err(self.fail(role, "exited unexpectedly".into())),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(self.fail(Role::Prefill, "event stream closed".into())),
        }
    }

    fn fail(&mut self, role: Role, message: String) -> ProcsError {
        let proc = self.proc(role);
        // Give a dying child a moment, so its status and last words are in the message.
        std::thread::sleep(Duration::from_millis(100));
        let status = proc.try_wait().map(|s| format!(" ({s})")).unwrap_or_default();
        let lines = proc.stderr_tail();
        let tail = if lines.is_empty() {
            String::new()
        } else {
            let n = lines.len().saturating_sub(20);
            format!("\n  last lines of its stderr:\n    {}", lines[n..].join("\n    "))
        };
        ProcsError::Worker { role, message: format!("{message}{status}"), tail }
    }
}

/// How the parent starts its children.
#[derive(Clone)]
pub struct Options {
    /// The `kvpush` executable (the parent's own: `std::env::current_exe()`).
    pub exe: PathBuf,
    /// NIXL backend plugin.
    pub backend: String,
    /// Where the children's stderr lines go (default: this process's stderr).
    pub log: Option<LogFn>,
    /// Measure `ceiling_gbps` and `push_gbps` after the workload.
    pub references: bool,
    /// Run the children with their engines' timelines on, in a fresh directory per mode under this
    /// one (removed once read), and report each mode's stage split ([`ModeReport::stages`],
    /// [`super::stages`]).
    pub stages: Option<PathBuf>,
    /// P's child keeps its GPU busy ([`WorkerSpec::gpu_busy`]).
    pub prefill_gpu_busy: bool,
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options").field("exe", &self.exe).field("backend", &self.backend).finish_non_exhaustive()
    }
}

impl Options {
    /// This executable, UCX, stderr, with the references.
    pub fn new() -> Result<Self, ProcsError> {
        let exe = std::env::current_exe()
            .map_err(|e| DemoError::Config(format!("cannot find this executable to start the workers: {e}")))?;
        Ok(Self { exe, backend: "UCX".into(), log: None, references: true, stages: None, prefill_gpu_busy: false })
    }

    /// `exe` over UCX with its children's log lines to `log`, without the references or the stage
    /// split: for harnesses that drive a pair of children themselves.
    pub fn bare(exe: PathBuf, log: Option<LogFn>) -> Self {
        Self { exe, backend: "UCX".into(), log, references: false, stages: None, prefill_gpu_busy: false }
    }
}

/// Runs the demo with P and D as two child processes over NIXL: each mode in `modes` on the same
/// workload, a fresh pair of children per mode. `tick` is called once per finished request.
pub fn run(t: &Topology, w: &Workload, modes: &[Mode], opts: &Options, tick: &dyn Fn()) -> Result<Report, ProcsError> {
    if !nixl::available() {
        return Err(DemoError::Config(
            "NIXL is not available: libnixl_capi.so cannot be loaded. Run `. scripts/nixl.sh` (it sets \
             LD_LIBRARY_PATH and NIXL_PLUGIN_DIR) or install NIXL; `kvpush doctor` shows what was found"
                .into(),
        )
        .into());
    }
    let mut report = Report::default();
    for &mode in modes {
        let r = run_mode(t, w, mode, opts, tick)?;
        match mode {
            Mode::Push => report.push = Some(r),
            Mode::Pull => report.pull = Some(r),
        }
    }
    Ok(report)
}

/// Starts P and D, with `tweak` applied to both children's flags and their engines' timelines in
/// `timeline` (when given); also returns the run's secret (for a third engine that is to join the
/// pair) and P's and D's side-channel ports.
pub(crate) fn start_with(
    t: &Topology,
    mode: Mode,
    opts: &Options,
    tweak: &dyn Fn(&mut WorkerSpec),
    timeline: Option<&Path>,
) -> Result<(Pair, String, Vec<u16>, Vec<u16>), ProcsError> {
    let (tx, rx) = unbounded();
    // The two children authenticate each other with a secret made for this run.
    let secret = kvpush::engine::side::random_secret().map_err(|e| ProcsError::Spawn {
        role: Role::Prefill,
        exe: opts.exe.display().to_string(),
        source: std::io::Error::other(e.to_string()),
    })?;
    let mut env = vec![(kvpush::engine::side::SECRET_ENV.to_owned(), secret.clone())];
    if let Some(dir) = timeline {
        env.push((kvpush::engine::timeline::ENV.to_owned(), dir.display().to_string()));
    }
    let spawn =
        |role: Role| {
            let mut spec = WorkerSpec::new(role, mode, t);
            spec.backend = opts.backend.clone();
            tweak(&mut spec);
            WorkerProc::spawn(&opts.exe, &spec, &env, tx.clone(), opts.log.clone())
                .map_err(|source| ProcsError::Spawn { role, exe: opts.exe.display().to_string(), source })
        };
    // Both start at once (engine and NIXL start-up overlap); a failure of either kills both.
    let p = spawn(Role::Prefill)?;
    let d = spawn(Role::Decode)?;
    let mut pair = Pair { p, d, rx, tx };
    let limit = Duration::from_secs(120);
    let (mut p_ports, mut d_ports) = (None, None);
    while p_ports.is_none() || d_ports.is_none() {
        match pair.next(limit)? {
            Some((Role::Prefill, Event::Hello { ports, .. })) => p_ports = Some(ports),
            Some((Role::Decode, Event::Hello { ports, .. })) => d_ports = Some(ports),
            Some((role, ev)) => return Err(pair.fail(role, format!("expected hello, got {ev:?}"))),
            None => {
                let role = if p_ports.is_none() { Role::Prefill } else { Role::Decode };
                return Err(pair.fail(role, format!("did not start within {limit:?}")));
            }
        }
    }
    let (p_ports, d_ports) = (p_ports.unwrap_or_default(), d_ports.unwrap_or_default());
    pair.send(Role::Decode, &Command::Connect { ports: p_ports.clone() })?;
    pair.expect(Role::Decode, "connected", Duration::from_secs(60), |ev| {
        matches!(ev, Event::Connected { .. }).then_some(())
    })?;
    pair.send(Role::Prefill, &Command::AwaitPeers { per_worker: usize::from(t.d_tp), timeout_ms: 10_000 })?;
    let peers = pair.expect(Role::Prefill, "peers", Duration::from_secs(30), |ev| match ev {
        Event::Peers { peers } => Some(peers),
        _ => None,
    })?;
    if peers.iter().any(|&n| n < usize::from(t.d_tp)) {
        return Err(pair.fail(Role::Prefill, format!("handshaken decode workers per prefill worker: {peers:?}")));
    }
    Ok((pair, secret, p_ports, d_ports))
}

fn run_mode(t: &Topology, w: &Workload, mode: Mode, opts: &Options, tick: &dyn Fn()) -> Result<ModeReport, ProcsError> {
    let timeline = opts.stages.as_deref().map(|base| timeline_dir(base, mode));
    let busy = |s: &mut WorkerSpec| s.gpu_busy = opts.prefill_gpu_busy && s.role == Role::Prefill;
    let mut pair = start_with(t, mode, opts, &busy, timeline.as_deref()).map(|(pair, ..)| pair)?;
    let mut report = driver::play(&mut pair, t, w, mode, tick)?;
    if let Some(dir) = &timeline {
        report.stages = Some(stage_split(dir, &pair, &report));
        // The timelines were only for the split; one that cannot be removed is left behind.
        let _ = std::fs::remove_dir_all(dir);
    }
    let bytes = report.bytes.min(CEILING_MAX_BYTES);
    if opts.references && bytes > 0 {
        // Interleaved, so that both references see the same machine: a ceiling WRITE, then (push)
        // the workload pushed all ready, per round.
        let target = ceiling_open(&mut pair, bytes)?;
        for round in 0..BANDWIDTH_ROUNDS {
            report.ceiling_gbps_rounds.push(ceiling_once(&mut pair, &target, bytes)?);
            if mode == Mode::Push {
                let (gbps, descriptors, pieces) = bandwidth(&mut pair, t, w, round)?;
                report.push_gbps_rounds.push(gbps);
                report.push_descriptors_rounds.push(descriptors);
                report.push_pieces_rounds.push(pieces);
            }
        }
        ceiling_close(&mut pair)?;
        report.ceiling_gbps = super::median(&report.ceiling_gbps_rounds);
        report.push_gbps = super::median(&report.push_gbps_rounds);
    }
    pair.close();
    Ok(report)
}

/// A fresh directory for one mode's timelines, under `base`.
fn timeline_dir(base: &Path, mode: Mode) -> PathBuf {
    static RUN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    base.join(format!("kvpush-stages-{}-{mode}-{n}", std::process::id()))
}

/// The stage split of the requests `report` received, from the timelines P and D wrote to `dir`
/// (requests whose timeline lacks a stage are left out; a timeline that cannot be read counts as
/// empty, and is logged).
fn stage_split(dir: &Path, pair: &Pair, report: &ModeReport) -> super::stages::StageSplit {
    let read = |pid: u32| {
        super::stages::Timeline::read(dir, pid).unwrap_or_else(|e| {
            tracing::warn!(dir = %dir.display(), pid, error = %e, "cannot read an engine's timeline");
            super::stages::Timeline::default()
        })
    };
    let (p, d) = (read(pair.p.pid()), read(pair.d.pid()));
    // The demo's marks are on the monotonic clock ([`child::now_us`]), the timelines on the wall
    // clock; both are the host's, so one offset, taken here, maps the first onto the second.
    let offset = super::stages::wall_offset_us(child::now_us);
    let split: Vec<_> = report
        .ends
        .iter()
        .filter_map(|&(key, ready, outcome)| super::stages::split(&p, &d, key, ready + offset, outcome + offset))
        .collect();
    super::stages::summarize(&split)
}

/// Where the single-descriptor reference writes: D's reference agent (metadata, hex) and buffer.
struct CeilingTarget {
    metadata: String,
    addr: u64,
}

/// Sets up the single-descriptor reference: one fresh agent and buffer of `bytes` on each side, D
/// serving P's.
fn ceiling_open(pair: &mut Pair, bytes: u64) -> Result<CeilingTarget, ProcsError> {
    let ready = |ev: Event| match ev {
        Event::CeilingReady { metadata, addr, .. } => Some((metadata, addr)),
        _ => None,
    };
    let limit = Duration::from_secs(60);
    pair.send(Role::Prefill, &Command::CeilingSetup { bytes })?;
    let (p_md, _) = pair.expect(Role::Prefill, "ceiling_ready", limit, ready)?;
    pair.send(Role::Decode, &Command::CeilingSetup { bytes })?;
    let (metadata, addr) = pair.expect(Role::Decode, "ceiling_ready", limit, ready)?;
    pair.send(Role::Decode, &Command::CeilingServe { metadata: p_md })?;
    pair.expect(Role::Decode, "ceiling_serving", limit, |ev| matches!(ev, Event::CeilingServing).then_some(()))?;
    // A first WRITE faults D's fresh buffer in; it is not a measurement.
    ceiling_once(pair, &CeilingTarget { metadata: metadata.clone(), addr }, bytes)?;
    Ok(CeilingTarget { metadata, addr })
}

/// One single-descriptor NIXL WRITE of `bytes`, P → D (GB/s).
fn ceiling_once(pair: &mut Pair, target: &CeilingTarget, bytes: u64) -> Result<f64, ProcsError> {
    let run = Command::CeilingRun { metadata: target.metadata.clone(), remote_addr: target.addr, bytes, repeats: 1 };
    pair.send(Role::Prefill, &run)?;
    let (gbps, seconds) = pair.expect(Role::Prefill, "ceiling_result", Duration::from_secs(300), |ev| match ev {
        Event::CeilingResult { gbps, seconds } => Some((gbps, seconds)),
        _ => None,
    })?;
    tracing::info!(bytes, gbps, ?seconds, "single-descriptor NIXL WRITE");
    Ok(gbps)
}

/// Tears the reference down; fails if its WRITEs did not land on D.
fn ceiling_close(pair: &mut Pair) -> Result<(), ProcsError> {
    let mut landed = true;
    for role in [Role::Prefill, Role::Decode] {
        pair.send(role, &Command::CeilingEnd)?;
        landed &= pair.expect(role, "ceiling_closed", Duration::from_secs(60), |ev| match ev {
            Event::CeilingClosed { landed } => Some(landed),
            _ => None,
        })?;
    }
    if !landed {
        return Err(pair.fail(Role::Decode, "the single-descriptor reference WRITE did not land".into()));
    }
    Ok(())
}

/// `push_gbps`: the workload's requests again, every one ready at once, in as few waves as the pools
/// allow; total bytes over the summed first-ready → last-received windows, and the descriptors posted.
fn bandwidth(pair: &mut Pair, t: &Topology, w: &Workload, round: usize) -> Result<(f64, u64, u64), ProcsError> {
    let groups = super::model(t).groups.len();
    let specs = requests(w);
    // Fresh request numbers and keys every round.
    let mut rng = Rng(w.seed ^ 0xba4d_0000 ^ ((round as u64) << 40));
    let base = (specs.len() * (round + 1)) as u64;
    let (mut bytes, mut window_us, mut descriptors, mut pieces) = (0u64, 0u64, 0u64, 0u64);
    let limit = Duration::from_secs(120);
    let mut i = 0;
    while i < specs.len() {
        let (mut p_left, mut d_left) = (t.num_blocks as usize, t.num_blocks as usize);
        let mut wave = Vec::new();
        while i < specs.len() {
            let tokens = specs[i].0;
            let p_need = blocks_for(tokens, t.p_block) as usize * groups;
            let d_need = blocks_for(tokens, t.d_block) as usize * groups;
            if p_need > p_left || d_need > d_left {
                break;
            }
            p_left -= p_need;
            d_left -= d_need;
            wave.push((base + i as u64, Key::new(u128::from(rng.next()) << 64 | (base + i as u64) as u128, 1), tokens));
            i += 1;
        }
        if wave.is_empty() {
            return Err(DemoError::Config(format!(
                "a request of {} tokens needs more blocks than a pool of {} holds",
                specs[i].0, t.num_blocks
            ))
            .into());
        }
        let (bytes_before, _, posted_before, regs_before, pieces_before) = pair.stats(Role::Prefill)?;
        // Registrations first: D registers every request of the wave.
        for &(req, key, tokens) in &wave {
            let seed = rng.next();
            pair.send(
                Role::Decode,
                &Command::Decode { req, key, tokens, seed, remote_blocks: None, hold_verify: true },
            )?;
            pair.send(Role::Prefill, &Command::Prefill { req, key, tokens, seed, delay_ns: None })?;
        }
        let (mut registered, mut filled) = (0, 0);
        while registered < wave.len() || filled < wave.len() {
            match pair.next(limit)? {
                Some((_, Event::Registered { .. })) => registered += 1,
                Some((_, Event::Filled { .. })) => filled += 1,
                Some((role, ev)) => {
                    return Err(pair.fail(role, format!("unexpected event in a bandwidth wave: {ev:?}")))
                }
                None => return Err(pair.fail(Role::Prefill, format!("bandwidth wave not set up after {limit:?}"))),
            }
        }
        // Every request ready at once.
        let expected = regs_before + (wave.len() * usize::from(t.d_tp)) as u64;
        pair.send(Role::Prefill, &Command::Go { registrations: expected, timeout_ms: 10_000 })?;
        let (mut first_ready, mut last_received, mut last_sent) = (u64::MAX, 0u64, 0u64);
        let (mut sent, mut outcomes) = (0, 0);
        while sent < wave.len() || outcomes < wave.len() {
            match pair.next(limit)? {
                Some((_, Event::Ready { at_us, .. })) => first_ready = first_ready.min(at_us),
                Some((_, Event::Sent { at_us, .. })) => {
                    sent += 1;
                    last_sent = last_sent.max(at_us);
                }
                Some((_, Event::Received { at_us, ok, detail, .. })) => {
                    if !ok {
                        let d = detail.unwrap_or_default();
                        return Err(pair.fail(Role::Decode, format!("bandwidth wave: KV arrived wrong: {d}")));
                    }
                    last_received = last_received.max(at_us);
                    outcomes += 1;
                }
                Some((_, Event::Failed { reason, .. })) => {
                    return Err(pair.fail(Role::Decode, format!("bandwidth wave: request failed: {reason}")))
                }
                Some((role, ev)) => {
                    return Err(pair.fail(role, format!("unexpected event in a bandwidth wave: {ev:?}")))
                }
                None => return Err(pair.fail(Role::Decode, format!("bandwidth wave not finished after {limit:?}"))),
            }
        }
        let (bytes_after, _, posted_after, _, pieces_after) = pair.stats(Role::Prefill)?;
        bytes += bytes_after - bytes_before;
        descriptors += posted_after - posted_before;
        pieces += pieces_after - pieces_before;
        window_us += last_received.saturating_sub(first_ready).max(1);
        tracing::info!(
            requests = wave.len(),
            bytes = bytes_after - bytes_before,
            received_us = last_received.saturating_sub(first_ready),
            sent_us = last_sent.saturating_sub(first_ready),
            "bandwidth wave"
        );
    }
    Ok((bytes as f64 / (window_us as f64 / 1e6) / 1e9, descriptors, pieces))
}

// ---------------------------------------------------------------------------------------------------
// The child, and the engine host it shares with the in-process demo.

/// One worker of an engine: its engine, its side channel (child processes only; the in-process demo
/// links its engines through a `LocalHub`) and its memory, dropped in this order.
pub(super) struct Worker {
    pub(super) engine: Engine,
    pub(super) side: Option<Arc<SideChannel>>,
    pub(super) buffers: Vec<Box<dyn Buffer>>,
    /// The engine's NIXL agent, where it has one (for [`Command::Metadata`]).
    pub(super) transport: Option<Arc<NixlTransport>>,
}

/// A request as a child tracks it.
struct Req {
    key: Key,
    tokens: u64,
    seed: u64,
    blocks: BlockLists,
    delay_ns: Option<u64>,
    /// P: simulated compute per layer (ns) and whether each layer is reported as it is final.
    layers: Option<(u64, bool)>,
    /// Engine-thread time not reported yet.
    engine_ns: u64,
    /// P: workers that released the blocks.
    released: usize,
    /// D: workers whose call succeeded (outcomes expected).
    expected: usize,
    /// D: outcomes so far.
    reported: usize,
    /// D: first failure.
    failure: Option<String>,
    /// D: verify with the wave.
    hold_verify: bool,
    /// D: workers that reported it quarantined (`Finished::Quarantined`): its blocks wait for as
    /// many `Finished::Released`.
    quarantined: usize,
}

impl Req {
    /// A request with nothing reported, released or expected yet.
    fn new(key: Key, tokens: u64, seed: u64, blocks: BlockLists) -> Req {
        Req {
            key,
            tokens,
            seed,
            blocks,
            delay_ns: None,
            layers: None,
            engine_ns: 0,
            released: 0,
            expected: 0,
            reported: 0,
            failure: None,
            hold_verify: false,
            quarantined: 0,
        }
    }
}

/// The single-descriptor reference agent.
struct Ceiling {
    transport: NixlTransport,
    region: MemRegion,
    buffer: Box<dyn Buffer>,
    serving: bool,
}

/// A fill or verification job: request, blocks, tokens, seed.
type Job = (u64, BlockLists, u64, u64);

/// Where a host's events go: a child's protocol channel, or a queue the in-process side drains.
enum Out {
    Line(Channel),
    Queue(VecDeque<Event>),
}

impl Out {
    fn emit(&mut self, ev: &Event) {
        match self {
            Out::Line(c) => c.emit(ev),
            Out::Queue(q) => q.push_back(ev.clone()),
        }
    }

    fn broken(&self) -> bool {
        matches!(self, Out::Line(c) if c.broken())
    }
}

/// The workers of one engine (P or D) serving [`Command`]s and emitting [`Event`]s: a child's whole
/// work ([`worker_main`]), and each engine of the in-process demo (`super::run`, which hands it the
/// commands and drains its events itself).
pub(super) struct WorkerState {
    role: Role,
    mode: Mode,
    spec: WorkerSpec,
    dev: Arc<dyn Device>,
    workers: Arc<Vec<Worker>>,
    pool: Pool,
    total_blocks: usize,
    groups: usize,
    reqs: HashMap<u64, Req>,
    by_key: HashMap<Key, u64>,
    /// D: blocks of failed requests that engine workers hold quarantined, and how many workers
    /// still have to release them.
    quarantine: HashMap<Key, (usize, BlockLists)>,
    due: BinaryHeap<std::cmp::Reverse<(Instant, u64)>>,
    /// P: layers of requests with simulated per-layer compute, when each is final.
    layer_due: BinaryHeap<std::cmp::Reverse<(Instant, u64, u32)>>,
    held: Vec<u64>,
    /// D: hold-verify requests without an outcome, and those received waiting for the wave.
    hold_open: usize,
    hold_done: Vec<(u64, u64)>,
    /// D: when each received request arrived (µs since the epoch), until verified.
    arrived: HashMap<u64, u64>,
    jobs: Sender<Job>,
    results: Receiver<(u64, Result<pattern::Verified, String>)>,
    helper: Option<JoinHandle<()>>,
    finished: Vec<Finished>,
    ceiling: Option<Ceiling>,
    /// P (`--gpu-busy`): the thread keeping the GPU busy.
    busy: Option<GpuBusy>,
    out: Out,
}

/// Runs `kvpush demo-worker`: builds the engine, says hello on stdout, and serves commands from stdin
/// until it closes. Returns the process exit code.
pub fn worker_main(spec: &WorkerSpec) -> i32 {
    // Standard output is the protocol from here on; what libraries print goes to stderr.
    let mut out = match Channel::open() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cannot set up the protocol channel on stdout: {e}");
            return 1;
        }
    };
    let (cmd_tx, cmd_rx) = unbounded::<Result<Command, String>>();
    let reader = std::thread::Builder::new().name("kvpush-worker-stdin".into()).spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if line.trim().is_empty() {
                continue;
            }
            let cmd = serde_json::from_str::<Command>(&line).map_err(|e| format!("bad command {line:?}: {e}"));
            if cmd_tx.send(cmd).is_err() {
                return;
            }
        }
        drop(cmd_tx);
        // The parent is gone or done: never outlive it by more than a grace period.
        std::thread::sleep(Duration::from_secs(10));
        tracing::error!("still running 10 s after stdin closed; exiting");
        std::process::exit(3);
    });
    if let Err(e) = reader {
        out.emit(&Event::Error { message: format!("cannot start the stdin reader: {e}") });
        return 1;
    }
    let built = device::from_env()
        .map_err(|e| format!("device: {e}"))
        .and_then(|dev| Ok((nixl_workers(spec, &dev)?, dev)))
        .and_then(|(workers, dev)| WorkerState::new(spec, dev, workers));
    let mut state = match built {
        Ok(s) => s,
        Err(message) => {
            tracing::error!(role = %spec.role, "{message}");
            out.emit(&Event::Error { message });
            return 1;
        }
    };
    if spec.gpu_busy {
        match GpuBusy::start(&state.dev) {
            Ok(b) => state.busy = Some(b),
            Err(message) => {
                tracing::error!(role = %spec.role, "{message}");
                out.emit(&Event::Error { message });
                return 1;
            }
        }
    }
    state.out = Out::Line(out);
    let ports = state.workers.iter().filter_map(|w| w.side.as_ref()).map(|s| s.local_addr().port()).collect();
    state.out.emit(&Event::Hello { role: spec.role, pid: std::process::id(), ports, num_blocks: spec.num_blocks });
    state.serve(&cmd_rx);
    state.shutdown();
    0
}

/// P (`--gpu-busy`): a thread that copies 8 MiB from host to GPU memory back to back until dropped,
/// so that the device and its driver are never idle. The demo's per-layer compute is a sleep, which
/// leaves the GPU idle between layers; a real prefill keeps it busy with the next layer while the
/// writer posts the last one, and a post after the device sat idle for milliseconds costs several
/// times more (docs/benchmarks.md, "The fixed cost of one NIXL post").
struct GpuBusy {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<JoinHandle<Result<u64, String>>>,
}

impl GpuBusy {
    const BYTES: usize = 8 << 20;

    fn start(dev: &Arc<dyn Device>) -> Result<Self, String> {
        if dev.kind() != device::DeviceKind::Cuda {
            return Err(format!(
                "--gpu-busy keeps a GPU busy: it needs GPU memory (KVPUSH_DEVICE=cuda:N), not {}",
                dev.kind()
            ));
        }
        let buf = dev.alloc(Self::BYTES as u64).map_err(|e| format!("--gpu-busy: {e}"))?;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let until = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("kvpush-gpu-busy".into())
            .spawn(move || {
                let src = vec![0u8; Self::BYTES];
                let mut copies = 0u64;
                while !until.load(std::sync::atomic::Ordering::Relaxed) {
                    buf.write_at(0, &src).map_err(|e| format!("--gpu-busy: copy {copies}: {e}"))?;
                    copies += 1;
                }
                Ok(copies)
            })
            .map_err(|e| format!("--gpu-busy: cannot start its thread: {e}"))?;
        Ok(Self { stop, thread: Some(thread) })
    }
}

impl Drop for GpuBusy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(Ok(copies))) => tracing::info!(copies, "--gpu-busy: stopped"),
            Some(Ok(Err(e))) => tracing::error!("{e}"),
            Some(Err(_)) => tracing::error!("--gpu-busy: its thread panicked"),
            None => {}
        }
    }
}

/// Writes zeros over `buffers` so their pages are resident before anything is timed.
fn pretouch(buffers: &[Box<dyn Buffer>], byte: u8) -> Result<(), String> {
    const CHUNK: usize = 4 << 20;
    let chunk = vec![byte; CHUNK];
    for b in buffers {
        let len = b.region().len;
        let mut off = 0u64;
        while off < len {
            let n = (len - off).min(CHUNK as u64) as usize;
            b.write_at(off, &chunk[..n]).map_err(|e| e.to_string())?;
            off += n as u64;
        }
    }
    Ok(())
}

/// A child's workers: engines on NIXL, each with a side channel as its control link.
fn nixl_workers(spec: &WorkerSpec, dev: &Arc<dyn Device>) -> Result<Vec<Worker>, String> {
    let t = spec.topology();
    let role = spec.role;
    let mode = spec.engine_mode();
    let (tp, block) = match role {
        Role::Prefill => (t.p_tp, t.p_block),
        Role::Decode => (t.d_tp, t.d_block),
    };
    let engine_id = spec.engine_id.as_deref().unwrap_or(role.engine_id());
    let mut workers = Vec::new();
    for r in 0..tp {
        let (layout, buffers) =
            super::worker_layout(&t, dev.as_ref(), r, tp, block).map_err(|e| format!("rank {r}: {e}"))?;
        pretouch(&buffers, 0)?;
        let nixl = NixlConfig { agent_name: format!("{engine_id}/{r}"), backend: spec.backend.clone(), params: vec![] };
        let transport = Arc::new(NixlTransport::new(&nixl).map_err(|e| format!("rank {r}: {e}"))?);
        let mut sc = SideConfig::for_rank(r);
        sc.listen = format!("{}:0", spec.host);
        sc.heartbeat = Duration::from_millis(spec.heartbeat_ms.max(1));
        sc.peer_timeout = Duration::from_millis(spec.peer_timeout_ms.max(1));
        sc.handshake_timeout = Duration::from_millis(spec.handshake_timeout_ms.max(1));
        let side = Arc::new(SideChannel::bind(sc).map_err(|e| format!("rank {r}: {e}"))?);
        let mut config = Config::new(engine_id, mode);
        config.writers = t.writers;
        config.staging = t.staging.engine(t.staging_slots, t.staging_slot_bytes);
        config.layerwise = t.layerwise.engine();
        config.rendezvous.lease_us = spec.lease_ms * 1000;
        config.completion.timeout_us = spec.timeout_ms * 1000;
        config.pull_read_timeout_us = spec.pull_read_timeout_ms * 1000;
        // SAFETY: the regions are `buffers`, allocated just above and owned by the same `Worker`
        // as the engine; `Worker` drops its engine before its buffers. This child follows the
        // block ownership rules: P's blocks return to the pool only after `Finished::Sent` from
        // every worker, D's only after every worker reported the request's outcome (and after
        // verification, which only reads them).
        let engine = unsafe { Engine::new(config, layout, dev.clone(), transport.clone(), side.clone()) }
            .map_err(|e| format!("rank {r}: {e}"))?;
        side.serve(engine.endpoint());
        workers.push(Worker { engine, side: Some(side), buffers, transport: Some(transport) });
    }
    Ok(workers)
}

impl WorkerState {
    /// Starts hosting `workers` (the engine of `spec.role`, on `dev`), its events queued until a
    /// child points them at its protocol channel.
    pub(super) fn new(spec: &WorkerSpec, dev: Arc<dyn Device>, workers: Vec<Worker>) -> Result<Self, String> {
        let role = spec.role;

        let workers = Arc::new(workers);
        let groups = workers[0].engine.layout().model.groups.len();
        // Helper thread: fills P's blocks (the accelerator's prefill) or verifies D's.
        let (jobs, job_rx) = unbounded::<Job>();
        let (res_tx, results) = unbounded();
        let ws = Arc::clone(&workers);
        let hdev = Arc::clone(&dev);
        let whole = spec.whole_block_bytes;
        let helper = std::thread::Builder::new()
            .name(format!("kvpush-{role}-{}", if role == Role::Prefill { "fill" } else { "verify" }))
            .spawn(move || {
                // Bulk copies (through the device for GPU memory), one mover per worker.
                let mut movers = super::movers(hdev.as_ref(), ws.len(), whole);
                for (req, blocks, n, seed) in job_rx {
                    let mut total = pattern::Verified::default();
                    let mut res = Ok(());
                    for (k, wk) in ws.iter().enumerate() {
                        let (l, b) = (wk.engine.layout(), &wk.buffers);
                        let m = match movers.as_mut() {
                            Ok(m) => &mut m[k],
                            Err(e) => {
                                res = Err(e.clone());
                                continue;
                            }
                        };
                        match role {
                            Role::Prefill => {
                                // SAFETY: the request's P blocks are not in flight: `request_finished`
                                // comes only after this fill reported back.
                                if let Err(e) = unsafe { m.fill(l, b, &blocks, n, seed) } {
                                    res = Err(e.to_string());
                                }
                            }
                            // SAFETY: every D worker reported the request received, and its blocks
                            // return to the pool only after this check: nothing writes them meanwhile.
                            Role::Decode => match unsafe { m.verify(l, b, &blocks, n, seed) } {
                                Ok(v) => total.add(v),
                                Err(e) => res = Err(e.to_string()),
                            },
                        }
                    }
                    if res_tx.send((req, res.map(|()| total))).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| format!("cannot start a helper thread: {e}"))?;
        Ok(Self {
            role,
            mode: spec.engine_mode(),
            spec: spec.clone(),
            dev,
            workers,
            pool: Pool::new(spec.num_blocks, spec.allocator),
            total_blocks: spec.num_blocks as usize,
            groups,
            reqs: HashMap::new(),
            by_key: HashMap::new(),
            quarantine: HashMap::new(),
            due: BinaryHeap::new(),
            layer_due: BinaryHeap::new(),
            held: Vec::new(),
            hold_open: 0,
            hold_done: Vec::new(),
            arrived: HashMap::new(),
            jobs,
            results,
            helper: Some(helper),
            finished: Vec::new(),
            ceiling: None,
            busy: None,
            out: Out::Queue(VecDeque::new()),
        })
    }

    fn error(&mut self, message: String) {
        tracing::error!(role = %self.role, "{message}");
        self.out.emit(&Event::Error { message });
    }

    fn serve(&mut self, cmds: &Receiver<Result<Command, String>>) {
        loop {
            let busy = !self.reqs.is_empty() || self.ceiling.as_ref().is_some_and(|c| c.serving);
            let mut wait = if busy { Duration::from_micros(20) } else { Duration::from_millis(50) };
            if let Some(std::cmp::Reverse((at, _))) = self.due.peek() {
                wait = wait.min(at.saturating_duration_since(Instant::now()));
            }
            if let Some(std::cmp::Reverse((at, _, _))) = self.layer_due.peek() {
                wait = wait.min(at.saturating_duration_since(Instant::now()));
            }
            let mut next = match cmds.recv_timeout(wait) {
                Ok(c) => Some(c),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return,
            };
            while let Some(c) = next {
                match c {
                    Ok(cmd) => self.command(cmd),
                    Err(e) => self.error(e),
                }
                next = cmds.try_recv().ok();
            }
            self.step();
            if self.out.broken() {
                return;
            }
        }
    }

    /// Carries out one command.
    pub(super) fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Connect { ports } => self.connect(&ports),
            Command::AwaitPeers { per_worker, timeout_ms } => {
                let deadline = Instant::now() + Duration::from_millis(timeout_ms);
                let peers = loop {
                    let peers: Vec<usize> =
                        self.workers.iter().map(|w| w.side.as_ref().map_or(0, |s| s.peers().len())).collect();
                    if peers.iter().all(|&n| n >= per_worker) || Instant::now() > deadline {
                        break peers;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                };
                self.out.emit(&Event::Peers { peers });
            }
            Command::Prefill { req, key, tokens, seed, delay_ns } => self.prefill(req, key, tokens, seed, delay_ns),
            Command::PrefillLayers { req, key, tokens, seed, delay_ns, layer_ns, layerwise } => {
                self.prefill(req, key, tokens, seed, Some(delay_ns));
                if let Some(r) = self.reqs.get_mut(&req) {
                    r.layers = Some((layer_ns, layerwise));
                }
            }
            Command::Go { registrations, timeout_ms } => self.go(registrations, timeout_ms),
            Command::Decode { req, key, tokens, seed, remote_blocks, hold_verify } => {
                self.decode(req, key, tokens, seed, remote_blocks, hold_verify)
            }
            Command::Stats => {
                let (mut bytes, mut descriptors_unmerged, mut descriptors_posted, mut registrations) = (0, 0, 0, 0);
                let mut staged_pieces = 0;
                let mut side = SideCounters::default();
                let mut engine = EngineCounters::default();
                for w in self.workers.iter() {
                    let st = w.engine.stats();
                    let c = st.counters;
                    add_fields!(engine, c; received, failed, aborted, posts);
                    engine.remote_failures += st.failures.remote;
                    engine.unknown_peer += st.failures.unknown_peer;
                    engine.malformed += st.failures.malformed;
                    if let Some(sc) = w.engine.staging_counts() {
                        engine.staged_received += sc.received;
                        engine.staged_malformed += sc.malformed;
                    }
                    bytes += c.bytes;
                    descriptors_unmerged += c.descriptors_unmerged;
                    descriptors_posted += c.descriptors_posted;
                    registrations += c.registrations;
                    staged_pieces += w.engine.staging_counts().map_or(0, |c| c.pieces);
                    if let Some(s) = w.side.as_ref().map(|s| s.stats()) {
                        add_fields!(side, s; handshakes, refused, malformed, peers_lost, auth_failures, timeouts,
                            oversized, over_limit, frames_in, restarts);
                    }
                }
                let ev = Event::Stats {
                    bytes,
                    descriptors_unmerged,
                    descriptors_posted,
                    registrations,
                    staged_pieces,
                    side,
                    engine,
                };
                self.out.emit(&ev);
            }
            Command::Metadata => {
                let mut agents = Vec::new();
                for w in self.workers.iter() {
                    let Some(transport) = &w.transport else {
                        return self.error("metadata: this engine has no NIXL agent".into());
                    };
                    match transport.local_metadata() {
                        Ok(md) => agents.push((transport.name().to_owned(), child::hex::encode(&md))),
                        Err(e) => return self.error(format!("metadata: {e}")),
                    }
                }
                self.out.emit(&Event::Metadata { agents });
            }
            Command::Pool => {
                let quarantined = self.quarantine.values().map(|(_, b)| b.iter().map(Vec::len).sum::<usize>()).sum();
                let ev = Event::Pool { free: self.pool.free(), total: self.total_blocks, quarantined };
                self.out.emit(&ev);
            }
            Command::CeilingSetup { bytes } => match self.ceiling_setup(bytes) {
                Ok(ev) => self.out.emit(&ev),
                Err(e) => self.error(format!("single-descriptor reference: {e}")),
            },
            Command::CeilingServe { metadata } => {
                let r = match self.ceiling.as_mut() {
                    Some(c) => child::hex::decode(&metadata)
                        .map_err(|e| e.to_string())
                        .and_then(|md| c.transport.load_remote(&md).map_err(|e| e.to_string())),
                    None => Err("no reference agent (ceiling_setup first)".into()),
                };
                match r {
                    Ok(_) => {
                        if let Some(c) = self.ceiling.as_mut() {
                            c.serving = true;
                        }
                        self.out.emit(&Event::CeilingServing);
                    }
                    Err(e) => self.error(format!("single-descriptor reference: {e}")),
                }
            }
            Command::CeilingRun { metadata, remote_addr, bytes, repeats } => {
                match self.ceiling_run(&metadata, remote_addr, bytes, repeats) {
                    Ok(ev) => self.out.emit(&ev),
                    Err(e) => self.error(format!("single-descriptor reference: {e}")),
                }
            }
            Command::CeilingEnd => {
                let mut landed = true;
                if let Some(c) = self.ceiling.take() {
                    if self.role == Role::Decode {
                        let len = c.region.len;
                        let (mut a, mut b) = ([0u8; 1], [0u8; 1]);
                        landed = c.buffer.read_at(0, &mut a).is_ok()
                            && c.buffer.read_at(len - 1, &mut b).is_ok()
                            && a[0] == CEILING_BYTE
                            && b[0] == CEILING_BYTE;
                    }
                    let _ = c.transport.deregister(&c.region);
                    drop(c.transport);
                    drop(c.buffer);
                }
                self.out.emit(&Event::CeilingClosed { landed });
            }
        }
    }

    fn connect(&mut self, ports: &[u16]) {
        if self.role != Role::Decode {
            return self.error("connect: only the decode worker dials".into());
        }
        let mut errors = Vec::new();
        let mut handshakes = 0;
        for (r, w) in self.workers.iter().enumerate() {
            for &port in ports {
                let addr = format!("{}:{port}", self.spec.host);
                let Some(side) = w.side.as_ref() else {
                    errors.push(format!("decode worker {r} has no side channel"));
                    continue;
                };
                match side.connect(addr.as_str()) {
                    Ok(peer) => {
                        tracing::info!(rank = r, %peer, %addr, "handshake done");
                        handshakes += 1;
                    }
                    Err(e) => errors.push(format!("decode worker {r} -> {addr}: {e}")),
                }
            }
        }
        if errors.is_empty() {
            self.out.emit(&Event::Connected { handshakes });
        } else {
            self.error(errors.join("; "));
        }
    }

    fn prefill(&mut self, req: u64, key: Key, tokens: u64, seed: u64, delay_ns: Option<u64>) {
        if self.role != Role::Prefill {
            return self.error("prefill: this is the decode worker".into());
        }
        let Some(blocks) = self.take_blocks(req, tokens, self.spec.p_block) else { return };
        let _ = self.jobs.send((req, blocks.clone(), tokens, seed));
        let r = Req { delay_ns, expected: self.workers.len(), ..Req::new(key, tokens, seed, blocks) };
        self.track(req, r);
    }

    /// Takes the blocks of a `tokens`-token request (`block_tokens` a block) in every group from
    /// the pool; `None` after reporting the error if the pool has too few.
    fn take_blocks(&mut self, req: u64, tokens: u64, block_tokens: u32) -> Option<BlockLists> {
        let n = blocks_for(tokens, block_tokens) as usize;
        if self.pool.free() < n * self.groups {
            let free = self.pool.free();
            self.error(format!("request {req}: {} blocks needed, {free} free", n * self.groups));
            return None;
        }
        Some((0..self.groups).filter_map(|_| self.pool.take(n)).collect())
    }

    /// Starts tracking request `req` (and its key).
    fn track(&mut self, req: u64, r: Req) {
        self.by_key.insert(r.key, req);
        self.reqs.insert(req, r);
    }

    /// P: `request_finished` on every worker; returns the ready timestamp.
    fn finish(&mut self, req: u64) -> Option<Event> {
        self.hand_over(req, None, true)
    }

    /// P: layer `layer` of request `req` is computed. Layer by layer, `layers_ready` on every
    /// worker; the last layer reports [`Event::Ready`] (whole: `request_finished` first).
    fn layer_final(&mut self, req: u64, layer: u32) -> Option<Event> {
        let last = layer + 1 == self.spec.layers;
        let (_, layerwise) = self.reqs.get(&req)?.layers?;
        match (layerwise, last) {
            (true, _) => self.hand_over(req, Some(layer), last),
            (false, true) => self.finish(req),
            (false, false) => None,
        }
    }

    /// P: `request_finished` (`layer` `None`) or `layers_ready` of `layer` on every worker; the
    /// ready event (timestamped just before the calls) when `ready`.
    fn hand_over(&mut self, req: u64, layer: Option<u32>, ready: bool) -> Option<Event> {
        let r = self.reqs.get_mut(&req)?;
        // The lists are built before the clock starts: an engine hands over lists it owns.
        let lists: Vec<BlockLists> = self.workers.iter().map(|_| r.blocks.clone()).collect();
        let at_us = child::now_us();
        let tokens = super::side_tokens(&self.spec.topology(), r.tokens, self.spec.p_block);
        let t0 = Instant::now();
        let mut err = None;
        for (w, ids) in self.workers.iter().zip(lists) {
            let (call, result) = match layer {
                None => ("request_finished", w.engine.request_finished(r.key, ids, tokens)),
                Some(l) => ("layers_ready", w.engine.layers_ready(r.key, ids, tokens, l..l + 1, None)),
            };
            if let Err(e) = result {
                err = Some(format!("request {req}: {call}: {e}"));
            }
        }
        r.engine_ns += t0.elapsed().as_nanos() as u64;
        if let Some(e) = err {
            self.error(e);
            return None;
        }
        if !ready {
            return None;
        }
        let engine_ns = std::mem::take(&mut r.engine_ns);
        Some(Event::Ready { req, at_us, engine_ns, blocks: r.blocks.clone() })
    }

    fn go(&mut self, registrations: u64, timeout_ms: u64) {
        let count = |s: &Self| s.workers.iter().map(|w| w.engine.stats().counters.registrations).sum::<u64>();
        let deadline = Instant::now() + Duration::from_millis(timeout_ms);
        while count(self) < registrations && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        // Registrations to more ranks than counted may still be on their way: let them settle.
        let mut last = count(self);
        loop {
            std::thread::sleep(Duration::from_millis(2));
            let now = count(self);
            if now == last || Instant::now() > deadline {
                break;
            }
            last = now;
        }
        let held = std::mem::take(&mut self.held);
        let events: Vec<Event> = held.into_iter().filter_map(|req| self.finish(req)).collect();
        for ev in &events {
            self.out.emit(ev);
        }
    }

    fn decode(
        &mut self,
        req: u64,
        key: Key,
        tokens: u64,
        seed: u64,
        remote_blocks: Option<BlockLists>,
        hold_verify: bool,
    ) {
        if self.role != Role::Decode {
            return self.error("decode: this is the prefill worker".into());
        }
        let Some(blocks) = self.take_blocks(req, tokens, self.spec.d_block) else { return };
        let lists: Vec<(BlockLists, Option<BlockLists>)> =
            self.workers.iter().map(|_| (blocks.clone(), remote_blocks.clone())).collect();
        let side = super::side_tokens(&self.spec.topology(), tokens, self.spec.d_block);
        let t0 = Instant::now();
        let (mut expected, mut failure) = (0, None);
        for (w, (local, remote)) in self.workers.iter().zip(lists) {
            let r = match (self.mode, remote) {
                (Mode::Push, _) => w.engine.blocks_allocated(key, "prefill", local, side),
                (Mode::Pull, Some(remote)) => w.engine.start_pull(key, "prefill", remote, local, side),
                (Mode::Pull, None) => {
                    failure = Some("pull mode needs the prefill block ids".to_string());
                    continue;
                }
            };
            match r {
                Ok(()) => expected += 1,
                Err(e) => failure = Some(format!("{}: {e}", w.engine.addr())),
            }
        }
        let engine_ns = t0.elapsed().as_nanos() as u64;
        self.track(req, Req { engine_ns, expected, failure, hold_verify, ..Req::new(key, tokens, seed, blocks) });
        if hold_verify {
            self.hold_open += 1;
        }
        self.out.emit(&Event::Registered { req });
        if expected == 0 {
            self.d_outcome(req);
        }
    }

    /// P (`--scribble`): overwrites released blocks with the request's contents under another seed.
    fn scribble(&mut self, blocks: &BlockLists, tokens: u64, seed: u64) {
        let mut failed = None;
        for w in self.workers.iter() {
            if let Err(e) = pattern::fill(w.engine.layout(), &w.buffers, blocks, tokens, !seed) {
                failed = Some(format!("scribble: {e}"));
            }
        }
        if let Some(m) = failed {
            self.error(m);
        }
    }

    /// D: every worker reported the request; verify it or report the failure.
    fn d_outcome(&mut self, req: u64) {
        let at_us = child::now_us();
        let Some(r) = self.reqs.get(&req) else { return };
        if r.hold_verify {
            self.hold_open -= 1;
        }
        if let Some(reason) = r.failure.clone() {
            let r = self.reqs.remove(&req).expect("present");
            self.by_key.remove(&r.key);
            let engine_ns = r.engine_ns;
            if r.quarantined > 0 {
                // Reported now; the blocks wait for the workers' releases.
                self.quarantine.insert(r.key, (r.quarantined, r.blocks));
            } else {
                self.pool.give(r.blocks.into_iter().flatten());
            }
            self.out.emit(&Event::Failed { req, at_us, reason, engine_ns });
        } else if r.hold_verify {
            self.hold_done.push((req, at_us));
        } else {
            self.arrived.insert(req, at_us);
            let _ = self.jobs.send((req, r.blocks.clone(), r.tokens, r.seed));
        }
        if self.hold_open == 0 && !self.hold_done.is_empty() {
            for (req, at) in std::mem::take(&mut self.hold_done) {
                if let Some(r) = self.reqs.get(&req) {
                    self.arrived.insert(req, at);
                    let _ = self.jobs.send((req, r.blocks.clone(), r.tokens, r.seed));
                }
            }
        }
    }

    /// Timed events, engine results, helper results, reference progress.
    pub(super) fn step(&mut self) {
        // Fills (P) and verifications (D).
        while let Ok((req, res)) = self.results.try_recv() {
            match self.role {
                Role::Prefill => {
                    if let Err(e) = res {
                        self.error(format!("prefill of request {req} failed: {e}"));
                        continue;
                    }
                    match self.reqs.get(&req).map(|r| r.delay_ns) {
                        Some(Some(ns)) => {
                            self.due.push(std::cmp::Reverse((Instant::now() + Duration::from_nanos(ns), req)))
                        }
                        Some(None) => {
                            self.held.push(req);
                            self.out.emit(&Event::Filled { req });
                        }
                        None => {}
                    }
                }
                Role::Decode => {
                    let Some(r) = self.reqs.remove(&req) else { continue };
                    self.by_key.remove(&r.key);
                    let at_us = self.arrived.remove(&req).unwrap_or_else(child::now_us);
                    self.pool.give(r.blocks.into_iter().flatten());
                    let ev = match res {
                        Ok(v) => Event::Received {
                            req,
                            at_us,
                            verified_bytes: v.bytes,
                            ok: v.ok(),
                            detail: (!v.ok()).then(|| {
                                format!(
                                    "{} of the elements differ (checksum {:#x}, expected {:#x})",
                                    v.mismatched_elements, v.found, v.expected
                                )
                            }),
                            engine_ns: r.engine_ns,
                        },
                        Err(e) => Event::Received {
                            req,
                            at_us,
                            verified_bytes: 0,
                            ok: false,
                            detail: Some(format!("cannot verify: {e}")),
                            engine_ns: r.engine_ns,
                        },
                    };
                    self.out.emit(&ev);
                }
            }
        }
        // Prefills whose time came.
        while let Some(std::cmp::Reverse((at, req))) = self.due.peek().copied() {
            if at > Instant::now() {
                break;
            }
            self.due.pop();
            match self.reqs.get(&req).and_then(|r| r.layers) {
                // Per-layer compute starts now.
                Some((ns, _)) => {
                    let start = Instant::now();
                    for l in 0..self.spec.layers {
                        let at = start + Duration::from_nanos(ns * u64::from(l + 1));
                        self.layer_due.push(std::cmp::Reverse((at, req, l)));
                    }
                }
                None => {
                    if let Some(ev) = self.finish(req) {
                        self.out.emit(&ev);
                    }
                }
            }
        }
        // Layers whose compute is done.
        while let Some(std::cmp::Reverse((at, req, layer))) = self.layer_due.peek().copied() {
            if at > Instant::now() {
                break;
            }
            self.layer_due.pop();
            if let Some(ev) = self.layer_final(req, layer) {
                self.out.emit(&ev);
            }
        }
        // Engine results.
        let workers = Arc::clone(&self.workers);
        for w in workers.iter() {
            self.finished.clear();
            let t0 = Instant::now();
            let n = w.engine.poll(&mut self.finished);
            if n == 0 {
                continue;
            }
            let share = t0.elapsed().as_nanos() as u64 / n as u64;
            for f in std::mem::take(&mut self.finished) {
                self.finished_one(f, share);
            }
        }
        // The reference agent, while D serves it (no progress thread: it must be polled).
        if let Some(c) = self.ceiling.as_ref().filter(|c| c.serving) {
            let mut v = Vec::new();
            let _ = c.transport.take_notifications(&mut v);
        }
    }

    fn finished_one(&mut self, f: Finished, share: u64) {
        let key = f.key();
        if let Finished::Released { .. } = f {
            if let Some((left, _)) = self.quarantine.get_mut(&key) {
                *left -= 1;
                if *left == 0 {
                    let (_, blocks) = self.quarantine.remove(&key).expect("present");
                    self.pool.give(blocks.into_iter().flatten());
                }
            } else if let Some(r) = self.by_key.get(&key).and_then(|req| self.reqs.get_mut(req)) {
                r.quarantined -= 1; // released before every worker reported
            }
            return;
        }
        let Some(&req) = self.by_key.get(&key) else {
            tracing::debug!(%key, "result for an unknown request");
            return;
        };
        let workers = self.workers.len();
        let Some(r) = self.reqs.get_mut(&req) else { return };
        r.engine_ns += share;
        match f {
            Finished::Sent { reason, .. } if self.role == Role::Prefill => {
                r.released += 1;
                if r.released == workers {
                    let r = self.reqs.remove(&req).expect("present");
                    self.by_key.remove(&key);
                    if self.spec.scribble {
                        self.scribble(&r.blocks, r.tokens, r.seed);
                    }
                    self.pool.give(r.blocks.into_iter().flatten());
                    self.out.emit(&Event::Sent {
                        req,
                        reason: format!("{reason:?}"),
                        engine_ns: r.engine_ns,
                        at_us: child::now_us(),
                    });
                }
            }
            Finished::Received { .. } if self.role == Role::Decode => {
                r.reported += 1;
                if r.reported == r.expected {
                    self.d_outcome(req);
                }
            }
            Finished::Failed { reason, .. } if self.role == Role::Decode => {
                r.reported += 1;
                r.failure.get_or_insert(reason);
                if r.reported == r.expected {
                    self.d_outcome(req);
                }
            }
            Finished::Ended { .. } if self.role == Role::Decode => {
                r.reported += 1;
                r.failure.get_or_insert_with(|| "ended without data".into());
                if r.reported == r.expected {
                    self.d_outcome(req);
                }
            }
            Finished::Quarantined { reason, .. } if self.role == Role::Decode => {
                r.reported += 1;
                r.quarantined += 1;
                r.failure.get_or_insert(reason);
                if r.reported == r.expected {
                    self.d_outcome(req);
                }
            }
            other => tracing::warn!(role = %self.role, ?other, "unexpected engine result"),
        }
    }

    fn ceiling_setup(&mut self, bytes: u64) -> Result<Event, String> {
        if bytes == 0 || bytes > CEILING_MAX_BYTES {
            return Err(format!("{bytes} bytes: must be 1..={CEILING_MAX_BYTES}"));
        }
        if let Some(c) = self.ceiling.take() {
            let _ = c.transport.deregister(&c.region);
        }
        let agent = format!("{}/ceiling", self.role.engine_id());
        let cfg = NixlConfig { agent_name: agent.clone(), backend: self.spec.backend.clone(), params: vec![] };
        let transport = NixlTransport::new(&cfg).map_err(|e| e.to_string())?;
        let buffer = self.dev.alloc(bytes).map_err(|e| e.to_string())?;
        // Resident pages on both sides, and P's bytes recognisable on D.
        let byte = if self.role == Role::Prefill { CEILING_BYTE } else { 0 };
        pretouch(std::slice::from_ref(&buffer), byte)?;
        let region = self.dev.describe(buffer.region().addr, bytes).map_err(|e| e.to_string())?;
        // SAFETY: `buffer` is owned by the `Ceiling` that also owns `transport`; `CeilingEnd` (and
        // `shutdown`) deregister the region before the buffer is dropped. Only the reference WRITE
        // touches it while it is registered.
        unsafe { transport.register(&region) }.map_err(|e| e.to_string())?;
        let metadata = child::hex::encode(&transport.local_metadata().map_err(|e| e.to_string())?);
        self.ceiling = Some(Ceiling { transport, region, buffer, serving: false });
        Ok(Event::CeilingReady { agent, metadata, addr: region.addr })
    }

    fn ceiling_run(&mut self, metadata: &str, remote_addr: u64, bytes: u64, repeats: u32) -> Result<Event, String> {
        let c = self.ceiling.as_ref().ok_or("no reference agent (ceiling_setup first)")?;
        if bytes > c.region.len {
            return Err(format!("{bytes} bytes asked, the buffer has {}", c.region.len));
        }
        let peer = c
            .transport
            .load_remote(&child::hex::decode(metadata).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
        let desc = [Desc { local: c.region.addr, remote: remote_addr, len: bytes }];
        let mut seconds = Vec::new();
        for i in 0..repeats.max(1) {
            let t0 = Instant::now();
            let id = c.transport.post(Op::Write, &peer, &desc, Some(b"kvpush-ceiling")).map_err(|e| e.to_string())?;
            loop {
                match c.transport.poll(id).map_err(|e| e.to_string())? {
                    XferState::Done => break,
                    XferState::Pending => {}
                }
                if t0.elapsed() > Duration::from_secs(120) {
                    return Err(format!("WRITE {i} of {bytes} bytes did not finish in 120 s"));
                }
                std::hint::spin_loop();
            }
            seconds.push(t0.elapsed().as_secs_f64());
        }
        let best = seconds.iter().copied().fold(f64::INFINITY, f64::min);
        Ok(Event::CeilingResult { gbps: bytes as f64 / best / 1e9, seconds })
    }

    /// The oldest event not taken yet, in-process (a child's events go to its channel at once).
    pub(super) fn pop(&mut self) -> Option<Event> {
        match &mut self.out {
            Out::Queue(q) => q.pop_front(),
            Out::Line(_) => None,
        }
    }

    /// Stops the helper thread and the engines.
    pub(super) fn shutdown(mut self) {
        drop(self.busy.take());
        if let Some(c) = self.ceiling.take() {
            let _ = c.transport.deregister(&c.region);
        }
        let (tx, _) = unbounded();
        drop(std::mem::replace(&mut self.jobs, tx));
        if let Some(h) = self.helper.take() {
            let _ = h.join();
        }
        // Engines stop (writer threads joined, memory deregistered) before their buffers are unmapped.
        drop(self.workers);
    }
}

/// The byte P's reference buffer holds (D checks it arrived).
const CEILING_BYTE: u8 = 0xa5;
