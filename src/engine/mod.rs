//! Producer and consumer engines: the thin layer that drives `proto` with writer threads, a
//! transport, a device and a control link.
//!
//! Read [`Engine`] first. One `Engine` is one worker (one rank) of a serving engine. Its methods are
//! what the engine loop calls — the vLLM connector and the C ABI call exactly these — and each of
//! them only validates its input and enqueues a command for a writer thread, or drains finished
//! results ([`Engine::poll`]): none waits on the network, on planning or on the transport.
//!
//! Writer threads (`writer`, [`Config::writers`] of them) own the protocol state: transfers are
//! sharded by transfer id, each shard has its own rendezvous ([`crate::proto::rendezvous`]),
//! completion counter ([`crate::proto::completion`]) and planner. They post transfers, poll the
//! transport (or sleep until its waker rings), expire leases and hand results back through an
//! outbox (`outcomes`; [`Engine::wait`] blocks on it for a caller with nothing else to do). An
//! idle engine's writers sleep on their queue: no thread spins.
//!
//! A worker can produce (P: [`Engine::request_finished`]), consume (D: [`Engine::blocks_allocated`]
//! in push mode, [`Engine::start_pull`] in pull mode), or both. Peers are added with
//! [`Engine::add_peer`] from their [`Handshake`]; frames from peers arrive through
//! [`Engine::handle_frame`] (called by the control link) and notifications through the transport.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;

use crossbeam_channel::{unbounded, Sender};

use crate::device::{Device, DeviceError, DeviceKind, MemRegion};
use crate::pool::handoff::{Inbox, WakeFlag};
use crate::proto::bounce::{self, MemoryKind, MemoryOffer, Refusal, Route};
use crate::proto::codec::{self, DecodeError, PROTOCOL_VERSION};
use crate::proto::compat::{self, compat_hash, Incompatible};
use crate::proto::completion::CompletionConfig;
use crate::proto::layout::{KvLayout, LayoutError};
use crate::proto::msg::{check_block_lists, Handshake, Message, Mode, RangeError};
use crate::proto::rendezvous::{ReleaseReason, RendezvousConfig, SourceBlocks};
use crate::proto::{Key, Rank};
use crate::transport::bounce::host_bounce;
use crate::transport::staged::{PathChoice, Staged, StagingConfig, StagingCounts};
use crate::transport::trust::{DataKeys, DataPathCounts, Trusted};
use crate::transport::{Transport, TransportError, Units};
use budget::{ControlBudget, Credit};

pub mod budget;
pub mod cipher;
pub mod dial;
pub mod link;
mod outcomes;
mod sched;
pub mod side;
pub mod stats;
pub mod timeline;
mod writer;

pub use budget::ControlLimits;
pub use link::{ControlLink, FrameSink, LinkError, LocalHub, PeerAddr};
pub use stats::{Stats, StatsSnapshot};

/// Engine configuration.
#[derive(Clone, Debug)]
pub struct Config {
    /// This engine's id (shared by all its workers).
    pub engine_id: String,
    /// Push or pull.
    pub mode: Mode,
    /// Writer threads of this worker (transfers are sharded over them by transfer id).
    pub writers: usize,
    /// Producer lease, registration wait, pending bound.
    pub rendezvous: RendezvousConfig,
    /// Consumer timeout and pending bound.
    pub completion: CompletionConfig,
    /// Pull mode, producer side: how long a granted read may take before the blocks are released (µs).
    pub pull_read_timeout_us: u64,
    /// Whether fragmented WRITEs go through staging slots ([`crate::transport::staged`]).
    pub staging: Staging,
    /// Control frames and bytes peers may have queued for the writers at once ([`budget`]).
    pub control: ControlLimits,
    /// Whether [`Engine::layers_ready`] pushes each layer range as it becomes final.
    pub layerwise: Layerwise,
    /// This worker's memory offer in its handshake ([`crate::proto::bounce`]): `None` sends none,
    /// which peers read as "direct only". In push mode, an offer of device memory that the NIC
    /// cannot WRITE from or into puts every WRITE of this worker's KV through host slots
    /// ([`crate::transport::bounce`], the staging setting's geometry or the default); its peer must
    /// stage too (a D: staging on; a P writing into a bouncing D: [`crate::transport::bounce::bounce_geometry`]).
    pub memory: Option<MemoryOffer>,
    /// How long [`Engine::shutdown`] (and the drop) waits for quarantined blocks to be released
    /// before it stops the writers (µs): a lost peer's final word, its return as a new process, or
    /// the quarantine's bound may come within it. What is still quarantined then is reported
    /// ([`ShutdownReport::quarantined`]).
    pub shutdown_wait_us: u64,
}

/// Whether a producer pushes a request layer by layer ([`Engine::layers_ready`]) or whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layerwise {
    /// Layer by layer for requests of at least this many tokens, whole below (where one WRITE
    /// after the last layer costs less than one per range). [`Layerwise::AUTO`] is the default.
    Auto {
        /// Smallest request (tokens) pushed layer by layer.
        min_tokens: u64,
    },
    /// Every request layer by layer.
    On,
    /// Every request whole: [`Engine::layers_ready`] only collects layers, and the request goes
    /// once all of this rank's layers are final.
    Off,
}

/// A layer-wise setting that is none of `auto`, `on` or `off`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("layerwise {0:?}: expected auto, on or off")]
pub struct ParseLayerwiseError(pub String);

impl Layerwise {
    /// `auto` with the default threshold: below it one WRITE after the last layer is not slower.
    /// A constant for now (docs/benchmarks.md, layer-wise push, has the measurement to set it by).
    pub const AUTO: Layerwise = Layerwise::Auto { min_tokens: 512 };

    /// Parses `auto`, `on` or `off`.
    pub fn parse(s: &str) -> Result<Layerwise, ParseLayerwiseError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(Layerwise::AUTO),
            "on" | "1" | "true" => Ok(Layerwise::On),
            "off" | "0" | "false" => Ok(Layerwise::Off),
            other => Err(ParseLayerwiseError(other.to_owned())),
        }
    }

    /// Whether a request of `num_tokens` goes layer by layer.
    pub fn applies(self, num_tokens: u64) -> bool {
        match self {
            Layerwise::Auto { min_tokens } => num_tokens >= min_tokens,
            Layerwise::On => true,
            Layerwise::Off => false,
        }
    }
}

/// Whether an engine stages fragmented WRITEs through bounded slots on its device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Staging {
    /// On with the default geometry where the device is a GPU (CUDA), and with
    /// [`StagingConfig::host`] on host memory where the transport's descriptors are costly
    /// ([`Transport::costly_host_descriptors`]: NIXL between processes); off elsewhere. Each WRITE
    /// that could be staged goes directly or staged, whichever is measured faster for its peer and
    /// shape ([`PathChoice::Measured`]).
    Auto,
    /// As [`Staging::Auto`], with this geometry where it is on.
    AutoWith(StagingConfig),
    /// Never: every transfer is posted as merged descriptors.
    Off,
    /// On with this geometry (where the device can stage; Neuron cannot yet); the geometry's
    /// [`StagingConfig::choice`] says whether every qualifying WRITE is staged (the default).
    On(StagingConfig),
}

/// A staging setting that is none of `auto`, `on` or `off`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("staging {0:?}: expected auto, on or off")]
pub struct ParseStagingError(pub String);

impl Staging {
    /// Parses `auto`, `off` or `on` (`on` takes the default geometry).
    pub fn parse(s: &str) -> Result<Staging, ParseStagingError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(Staging::Auto),
            "off" | "0" | "false" => Ok(Staging::Off),
            "on" | "1" | "true" => Ok(Staging::On(StagingConfig::default())),
            other => Err(ParseStagingError(other.to_owned())),
        }
    }

    /// This setting with geometry `c` where it stages (`Off` stays off).
    pub fn with_geometry(self, c: StagingConfig) -> Staging {
        match self {
            Staging::Auto | Staging::AutoWith(_) => Staging::AutoWith(c),
            Staging::On(_) => Staging::On(c),
            Staging::Off => Staging::Off,
        }
    }

    /// The staging an engine on `device` runs, if any. `costly_host_descriptors`: the transport's
    /// [`Transport::costly_host_descriptors`] (NIXL between processes), where a fragmented WRITE of
    /// host memory can be faster gathered into slots than posted descriptor by descriptor.
    fn resolve(self, device: DeviceKind, costly_host_descriptors: bool) -> Option<StagingConfig> {
        // Auto: each WRITE takes the path measured faster for its peer and shape; `on` stages all.
        let measured = |c: StagingConfig| Some(StagingConfig { choice: PathChoice::Measured, ..c });
        let host = device == DeviceKind::Host && costly_host_descriptors;
        match self {
            Staging::Auto if device == DeviceKind::Cuda => measured(StagingConfig::default()),
            Staging::Auto if host => measured(StagingConfig::host()),
            Staging::AutoWith(c) if device == DeviceKind::Cuda || host => measured(c),
            Staging::Auto | Staging::AutoWith(_) | Staging::Off => None,
            Staging::On(c) => Some(c),
        }
    }
}

impl Config {
    /// Defaults for an engine with id `engine_id` in `mode`.
    pub fn new(engine_id: impl Into<String>, mode: Mode) -> Self {
        Self {
            engine_id: engine_id.into(),
            mode,
            writers: 1,
            rendezvous: RendezvousConfig::default(),
            completion: CompletionConfig::default(),
            pull_read_timeout_us: 60_000_000,
            staging: Staging::Auto,
            control: ControlLimits::default(),
            layerwise: Layerwise::AUTO,
            memory: None,
            shutdown_wait_us: 5_000_000,
        }
    }
}

/// Whether a push worker with `offer` runs its KV through a host bounce: its KV is device memory its
/// NIC cannot WRITE from (bounce on P) or be the target of a WRITE into (bounce on D).
fn needs_bounce(offer: &MemoryOffer) -> bool {
    offer.kind != MemoryKind::Host && !(offer.device.write && offer.device.target)
}

/// What went wrong in an engine call. Each variant names the peer, request or call concerned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The KV layout is invalid.
    #[error("invalid KV layout: {0}")]
    Layout(#[from] LayoutError),
    /// A KV region is not memory of the selected device.
    #[error("KV region {index} cannot be registered: {source}")]
    Device {
        /// Region index in the layout.
        index: usize,
        /// The device's error.
        #[source]
        source: DeviceError,
    },
    /// A transport call failed.
    #[error("transport: {0}")]
    Transport(#[from] TransportError),
    /// The peer's handshake is incompatible.
    #[error(transparent)]
    Incompatible(#[from] Incompatible),
    /// The two workers' memory offers leave no way to move bytes in either direction, even through
    /// host memory on one side, with what kvpush runs ([`crate::proto::bounce::decide_built`]);
    /// refused at the handshake.
    #[error("peer {peer}: no data path, neither with this worker as P ({as_producer}) nor as D ({as_consumer})")]
    NoDataPath {
        /// The peer's engine id.
        peer: String,
        /// Why this worker cannot be P to the peer's D.
        as_producer: Refusal,
        /// Why this worker cannot be D to the peer's P.
        as_consumer: Refusal,
    },
    /// A block list does not fit this worker's layout.
    #[error("request {key}: {source}")]
    Blocks {
        /// The request.
        key: Key,
        /// What does not fit.
        #[source]
        source: RangeError,
    },
    /// The consumer engine id named for a request is empty or longer than an engine id can be.
    #[error("request {key}: consumer engine id of {len} bytes (1 to {max} allowed)", max = crate::proto::msg::MAX_ENGINE_ID)]
    ConsumerId {
        /// The request.
        key: Key,
        /// The id's length in bytes.
        len: usize,
    },
    /// A frame from a peer could not be decoded.
    #[error("frame from {peer}: {source}")]
    Decode {
        /// The sender.
        peer: PeerAddr,
        /// Why.
        #[source]
        source: DecodeError,
    },
    /// The call does not fit this engine's mode.
    #[error("{call} is not available in {mode} mode")]
    WrongMode {
        /// The call.
        call: &'static str,
        /// The engine's mode.
        mode: Mode,
    },
    /// A frame came from a previous process of a peer that has since handshaken again as a new
    /// one; it was dropped.
    #[error("frame from {peer}: it comes from a previous incarnation of the peer, which restarted")]
    StalePeer {
        /// The sender.
        peer: PeerAddr,
    },
    /// Peers have more control frames queued for this engine's writers than its budget allows
    /// ([`Config::control`]); the frame was not taken.
    #[error("frame from {peer}: the writers are behind ({frames} frames, {bytes} bytes queued)")]
    Overloaded {
        /// The sender.
        peer: PeerAddr,
        /// Frames queued when it was refused.
        frames: usize,
        /// Their bytes.
        bytes: usize,
    },
    /// The engine has shut down.
    #[error("engine {0} has shut down")]
    Closed(String),
}

/// A result handed back to the engine loop by [`Engine::poll`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finished {
    /// Producer: the blocks of `key` are no longer needed and may be freed.
    Sent {
        /// The request.
        key: Key,
        /// Why they were released.
        reason: ReleaseReason,
    },
    /// Consumer: every part of `key` landed; the request may decode.
    Received {
        /// The request.
        key: Key,
    },
    /// Consumer: the KV of `key` will not arrive; `invalid_blocks` (per KV group) must be reported
    /// invalid so the failure policy (fail or recompute) applies.
    Failed {
        /// The request.
        key: Key,
        /// What went wrong, for logs and the user.
        reason: String,
        /// The blocks that were registered for it.
        invalid_blocks: Vec<Vec<u32>>,
    },
    /// Consumer: `key` ended without data because it was aborted locally or superseded by a newer
    /// attempt; its blocks are no longer written.
    Ended {
        /// The request.
        key: Key,
    },
    /// Consumer: `key` ended without its data — failed (`failed`; as [`Finished::Failed`]) or
    /// aborted or superseded (as [`Finished::Ended`]) — but a producer that was lost without a
    /// confirmed fence, or that did not answer in time, may still write into its blocks. The end is
    /// reported now (the request must not wait); **the blocks are not given back**: keep `blocks` out
    /// of use until [`Finished::Released`] for `key` (docs/reliability.md).
    Quarantined {
        /// The request.
        key: Key,
        /// Whether it failed (else it was aborted or superseded).
        failed: bool,
        /// What happened, for logs and the user.
        reason: String,
        /// The blocks that were registered for it (per KV group), held.
        blocks: Vec<Vec<u32>>,
    },
    /// Consumer: the blocks of the quarantined `key` ([`Finished::Quarantined`]) may be reused.
    Released {
        /// The request.
        key: Key,
    },
}

impl Finished {
    /// The request this outcome is for.
    pub fn key(&self) -> Key {
        match self {
            Finished::Sent { key, .. }
            | Finished::Received { key }
            | Finished::Failed { key, .. }
            | Finished::Ended { key }
            | Finished::Quarantined { key, .. }
            | Finished::Released { key } => *key,
        }
    }
}

/// A peer worker known from its handshake.
#[derive(Debug)]
pub(crate) struct Peer {
    pub(crate) addr: PeerAddr,
    pub(crate) layout: Arc<KvLayout>,
    pub(crate) agent: String,
    /// The peer process's incarnation, where the side channel told it (`None` for in-process links).
    pub(crate) incarnation: Option<side::Incarnation>,
    /// The side-channel connection its handshake came over (`None` for in-process links): one
    /// incarnation may reconnect, and the loss of a connection it replaced is not its loss.
    pub(crate) conn: Option<side::ConnId>,
}

/// Peers by address and by transport agent name.
#[derive(Debug, Default)]
pub(crate) struct Peers {
    pub(crate) by_addr: HashMap<PeerAddr, Arc<Peer>>,
    pub(crate) by_agent: HashMap<String, Arc<Peer>>,
}

/// Commands from the engine loop, the control link and other shards to a writer.
#[derive(Debug)]
pub(crate) enum Cmd {
    BlocksReady {
        key: Key,
        blocks: SourceBlocks,
        /// The consumer engine the router chose (only it is served); `None`: the first to register.
        consumer: Option<crate::proto::ids::EngineId>,
    },
    /// Producer: layers `layers` of `key` are final in `blocks`; `layerwise`: push them now (else
    /// only once every layer of this rank is).
    LayersReady {
        key: Key,
        blocks: SourceBlocks,
        layers: std::ops::Range<u32>,
        layerwise: bool,
        /// As in `BlocksReady`; the first report's counts.
        consumer: Option<crate::proto::ids::EngineId>,
    },
    Register {
        key: Key,
        producer: String,
        block_ids: Vec<Vec<u32>>,
        num_tokens: u64,
    },
    Pull {
        key: Key,
        producer: String,
        remote_blocks: Vec<Vec<u32>>,
        /// Tokens per block of the ids in `remote_blocks` where they are not the producer's own
        /// blocks ([`Engine::start_pull_logical`]); None: they are.
        remote_block_tokens: Option<u32>,
        local_blocks: Vec<Vec<u32>>,
        num_tokens: u64,
    },
    Abort {
        key: Key,
    },
    /// Consumer: `key` waits for blocks; tell `producer`'s ranks to keep holding theirs.
    Hold {
        key: Key,
        producer: String,
    },
    /// Consumer: `key` was dropped before it registered anything; tell `producer`'s ranks.
    AbortProducer {
        key: Key,
        producer: String,
    },
    /// `incarnation`: the sender's process, where the side channel told it. `via`: which path
    /// carried it (only the data path may say that data landed). `credit`: its room in the control
    /// budget (control frames), given back when the command is dropped.
    Msg {
        from: PeerAddr,
        incarnation: Option<side::Incarnation>,
        msg: Message,
        via: Via,
        credit: Option<Credit>,
    },
    /// `incarnation`: only that process of the peer is lost (`None`: whichever is known); `conn`:
    /// only as known over that connection (`None`: whichever), so that a loss never forgets the
    /// entry of a reconnection of the same process. `fenced`: the transport confirmed that nothing the peer posted can touch our memory any
    /// more ([`crate::transport::Fence::Confirmed`]); otherwise what it could touch is quarantined.
    PeerLost {
        peer: PeerAddr,
        incarnation: Option<side::Incarnation>,
        conn: Option<side::ConnId>,
        reason: String,
        fenced: bool,
    },
    /// A peer was (re)added as `incarnation`: a previous process of it, lost without a fence, is
    /// gone, and what was quarantined for it may go back to its owner.
    PeerAdded {
        peer: PeerAddr,
        incarnation: Option<side::Incarnation>,
    },
    Wake,
    Stop,
}

/// The path a peer's message came by.
///
/// A push's completion counts as "landed" only when it came by [`Via::Data`]: the transport
/// delivers a transfer's notification after every byte of the transfer (NIXL orders a WRITE's
/// notification after its data), while the control link is a separate connection that says
/// nothing about what the data path did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Via {
    /// The control link (side channel, or the in-process hub).
    Control,
    /// The transport's notifications, ordered after the data they follow.
    Data,
}

/// A writer shard as the rest of the engine sees it.
#[derive(Debug)]
pub(crate) struct ShardHandle {
    pub(crate) tx: Sender<Cmd>,
    /// The engine loop's commands (no wake-up while the writer works or lingers).
    pub(crate) inbox: Arc<Inbox<Cmd>>,
    pub(crate) wake: Arc<WakeFlag>,
    pub(crate) stats: Arc<Mutex<Stats>>,
    /// Requests whose blocks this shard holds quarantined now: a peer lost without a fence (or, in
    /// pull mode, a consumer whose grant expired) may still write into them or read them. The
    /// writer keeps it current; [`Engine::shutdown`] waits for it to empty and reports what is left.
    pub(crate) held: Arc<Mutex<Vec<Key>>>,
}

impl ShardHandle {
    fn ring(&self) {
        if self.wake.ring() {
            let _ = self.tx.send(Cmd::Wake);
        }
    }
}

/// State shared by the engine handle, its writers and the control link.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) config: Config,
    pub(crate) me: PeerAddr,
    pub(crate) layout: Arc<KvLayout>,
    pub(crate) peers: RwLock<Peers>,
    pub(crate) shards: Vec<ShardHandle>,
    pub(crate) outbox: outcomes::Outcomes<Finished>,
    pub(crate) transport: Arc<dyn Transport>,
    /// The data-path trust wrapper (under staging): which agents' notifications count.
    pub(crate) trusted: Arc<Trusted>,
    /// The staging wrapper around the transport, where staging is on.
    pub(crate) staged: Option<Arc<Staged>>,
    pub(crate) link: Arc<dyn ControlLink>,
    pub(crate) regions: Vec<MemRegion>,
    /// Control frames queued for the writers.
    pub(crate) control: Arc<ControlBudget>,
    /// Held by a writer while it takes the transport's notifications and routes those of other
    /// shards into their inboxes: a shard then never handles a notification it took before one
    /// that arrived earlier and was taken (and is being routed) by another writer. Per request,
    /// notifications are handled in the order the data path delivered them (an old attempt's
    /// final word before a newer attempt's completion).
    pub(crate) notif_order: Mutex<()>,
}

impl Shared {
    pub(crate) fn shard_of(&self, key: Key) -> usize {
        let id = key.transfer_id.0;
        ((id ^ (id >> 64)) as u64 % self.shards.len() as u64) as usize
    }

    pub(crate) fn send(&self, key: Key, cmd: Cmd) -> Result<(), EngineError> {
        self.shards[self.shard_of(key)].tx.send(cmd).map_err(|_| EngineError::Closed(self.config.engine_id.clone()))
    }

    /// Hands an engine-loop command to the shard owning `key`: into its inbox, waking the writer
    /// only if it sleeps.
    pub(crate) fn send_local(&self, key: Key, cmd: Cmd) -> Result<(), EngineError> {
        let shard = &self.shards[self.shard_of(key)];
        if shard.inbox.push(cmd) {
            shard.tx.send(Cmd::Wake).map_err(|_| EngineError::Closed(self.config.engine_id.clone()))?;
        }
        Ok(())
    }

    pub(crate) fn peer_by_addr(&self, addr: &PeerAddr) -> Option<Arc<Peer>> {
        self.peers.read().unwrap_or_else(|p| p.into_inner()).by_addr.get(addr).cloned()
    }

    pub(crate) fn peer_by_agent(&self, agent: &str) -> Option<Arc<Peer>> {
        self.peers.read().unwrap_or_else(|p| p.into_inner()).by_agent.get(agent).cloned()
    }

    /// Any known worker of engine `engine` (for its TP/PP sizes).
    pub(crate) fn any_peer_of(&self, engine: &str) -> Option<Arc<Peer>> {
        self.peers.read().unwrap_or_else(|p| p.into_inner()).by_addr.values().find(|p| p.addr.engine == engine).cloned()
    }

    /// Routes a decoded message to the shard owning its transfer (with its control-budget credit,
    /// which a message that is not queued gives back at once).
    pub(crate) fn route(
        &self,
        from: PeerAddr,
        incarnation: Option<side::Incarnation>,
        msg: Message,
        via: Via,
        credit: Option<Credit>,
    ) -> Result<(), EngineError> {
        let Some(key) = message_key(&msg) else { return Ok(()) };
        self.send(key, Cmd::Msg { from, incarnation, msg, via, credit })
    }

    /// As [`Shared::route`], for a data-path notification a writer took for another shard: into
    /// that shard's inbox, which its writer empties before it handles notifications it took itself
    /// later (see [`Shared::notif_order`]).
    pub(crate) fn route_local(
        &self,
        from: PeerAddr,
        incarnation: Option<side::Incarnation>,
        msg: Message,
    ) -> Result<(), EngineError> {
        let Some(key) = message_key(&msg) else { return Ok(()) };
        self.send_local(key, Cmd::Msg { from, incarnation, msg, via: Via::Data, credit: None })
    }
}

/// The request a message is about (none for handshakes and heartbeats).
pub(crate) fn message_key(msg: &Message) -> Option<Key> {
    match msg {
        Message::Registration(r) => Some(r.key()),
        Message::Completion(c) => Some(c.key),
        Message::Layers(c) => Some(c.key),
        Message::Grant(g) => Some(g.key),
        Message::Failure(f) => Some(f.key),
        Message::Abort(a) => Some(a.key),
        Message::Hold(h) => Some(h.key),
        Message::Handshake(_) | Message::Heartbeat(_) => None,
    }
}

impl Shared {
    /// This worker's handshake.
    pub(crate) fn handshake(&self) -> Result<Handshake, EngineError> {
        let layout = (*self.layout).clone();
        let mode = self.config.mode;
        Ok(Handshake {
            protocol: PROTOCOL_VERSION,
            software: env!("CARGO_PKG_VERSION").to_owned(),
            engine_id: self.config.engine_id.clone(),
            mode,
            agent_metadata: self.transport.local_metadata()?,
            compat_hash: compat_hash(&layout.model, layout.order, mode, PROTOCOL_VERSION),
            layout,
            memory: self.config.memory,
        })
    }

    /// See [`Engine::add_peer`]. `keys`: the data-path keys of an authenticated handshake (`None`
    /// where the application added the peer itself). `conn`: the side-channel connection it came
    /// over (`None` for in-process links).
    pub(crate) fn add_peer(
        &self,
        peer: &Handshake,
        incarnation: Option<side::Incarnation>,
        conn: Option<side::ConnId>,
        keys: Option<DataKeys>,
    ) -> Result<PeerAddr, EngineError> {
        let mine = self.handshake()?;
        compat::check(&mine, peer)?;
        // The handshake says no role: a pair is refused when bytes can move neither way (with what
        // kvpush runs: no bounce in pull mode).
        let (mode, (m, p)) = (mine.mode, (mine.memory.as_ref(), peer.memory.as_ref()));
        match (bounce::decide_built(mode, m, p), bounce::decide_built(mode, p, m)) {
            (Route::Refused(as_producer), Route::Refused(as_consumer)) => {
                return Err(EngineError::NoDataPath { peer: peer.engine_id.clone(), as_producer, as_consumer });
            }
            (as_p, as_d) if (&as_p, &as_d) != (&Route::Direct, &Route::Direct) => {
                tracing::info!(worker = %self.me, peer = %peer.engine_id, ?as_p, ?as_d, "memory offers: route as P, as D");
            }
            _ => {}
        }
        peer.layout.validate()?;
        let addr = PeerAddr { engine: peer.engine_id.clone(), rank: peer.layout.parallel.rank() };
        // One write lock from here to the new entry: a loss of this peer (`peer_lost`, writer 0
        // forgetting it and dropping its transport agent) lands wholly before this handshake's
        // agent is loaded, or finds this entry and leaves it (a reconnection of the same process).
        let mut peers = self.peers.write().unwrap_or_else(|p| p.into_inner());
        // A peer that comes back as another process restarted: everything in flight with its
        // previous process fails now (fail-closed), before the new one can send a frame; the
        // shards see this ahead of any frame of the new connection.
        // Its entry goes first, so the shard that forgets lost peers finds nothing of it to forget
        // once the new process is known (its agent may have the same name).
        if let Some(old) = peers.by_addr.get(&addr).filter(|p| p.incarnation.is_some() && incarnation.is_some()) {
            if old.incarnation != incarnation {
                let old = Arc::clone(old);
                peers.by_addr.remove(&addr);
                peers.by_agent.remove(&old.agent);
                self.lose_peer(&addr, old.incarnation, old.conn, Some(&old.agent), "restarted (new incarnation)");
                tracing::warn!(worker = %self.me, peer = %addr, old = ?old.incarnation, "peer restarted: failed what was in flight with its previous process");
                self.transport.drop_peer(&old.agent);
            }
        }
        let agent = self.transport.load_remote(&peer.agent_metadata)?;
        self.trusted.trust(&agent, keys);
        if let Err(e) = self.transport.prepare(Some(&agent), &units(&peer.layout)) {
            tracing::warn!(worker = %self.me, peer = %agent, error = %e, "cannot prepare the peer's descriptor list");
        }
        let p = Arc::new(Peer {
            addr: addr.clone(),
            layout: Arc::new(peer.layout.clone()),
            agent: agent.clone(),
            incarnation,
            conn,
        });
        if let Some(old) = peers.by_addr.insert(addr.clone(), Arc::clone(&p)) {
            if old.agent != agent {
                peers.by_agent.remove(&old.agent);
            }
        }
        peers.by_agent.insert(agent, p);
        for s in &self.shards {
            let _ = s.tx.send(Cmd::PeerAdded { peer: addr.clone(), incarnation });
        }
        tracing::debug!(worker = %self.me, peer = %addr, "peer added");
        Ok(addr)
    }

    /// Tells every shard that `incarnation` of `peer` is gone, after revoking the data-path access
    /// of its transport agent `agent` (where it is still known).
    fn lose_peer(
        &self,
        peer: &PeerAddr,
        incarnation: Option<side::Incarnation>,
        conn: Option<side::ConnId>,
        agent: Option<&str>,
        reason: &str,
    ) {
        let fenced = agent.is_some_and(|a| self.transport.revoke_peer(a) == crate::transport::Fence::Confirmed);
        if !fenced {
            tracing::warn!(worker = %self.me, %peer, "the transport cannot confirm that the lost peer's transfers stopped: what they could touch is quarantined");
        }
        for s in &self.shards {
            let reason = reason.to_owned();
            let _ = s.tx.send(Cmd::PeerLost { peer: peer.clone(), incarnation, conn, reason, fenced });
        }
    }

    /// Decodes a control frame from `from` against its handshake layout and routes it, within the
    /// control budget: a spent budget refuses the frame at once ([`EngineError::Overloaded`]).
    pub(crate) fn handle_frame(
        &self,
        from: &PeerAddr,
        incarnation: Option<side::Incarnation>,
        frame: &[u8],
    ) -> Result<(), EngineError> {
        // Before the peers' lock: a writer may need it to make the progress that frees room.
        let credit = self.control.acquire(frame.len()).map_err(|spent| EngineError::Overloaded {
            peer: from.clone(),
            frames: spent.frames,
            bytes: spent.bytes,
        })?;
        // The peers' read lock is held until the frame is queued: a restart of this peer (which
        // takes the write lock to drop its previous process) then queues its failure either after
        // this frame, so it fails it too, or before the lookup, so the frame is refused as stale.
        let peers = self.peers.read().unwrap_or_else(|p| p.into_inner());
        let peer = peers
            .by_addr
            .get(from)
            .ok_or_else(|| EngineError::Transport(TransportError::UnknownPeer(from.to_string())))?;
        if incarnation.is_some() && peer.incarnation != incarnation {
            return Err(EngineError::StalePeer { peer: from.clone() });
        }
        let msg = codec::decode(frame, Some(&peer.layout)).map_err(|source| {
            if let Ok(mut s) = self.shards[0].stats.lock() {
                s.failures.malformed += 1;
            }
            EngineError::Decode { peer: from.clone(), source }
        })?;
        if let Message::Registration(r) = &msg {
            // The side channel's reader has it; `eng_registration_recv` is when the writer does.
            timeline::record("eng_registration_read", r.key());
        }
        let routed = self.route(from.clone(), incarnation, msg, Via::Control, Some(credit));
        drop(peers);
        routed
    }
}

impl side::Endpoint for Shared {
    fn me(&self) -> PeerAddr {
        self.me.clone()
    }
    fn local_handshake(&self) -> Result<Handshake, EngineError> {
        self.handshake()
    }
    fn add_peer(
        &self,
        peer: &Handshake,
        incarnation: side::Incarnation,
        conn: side::ConnId,
        keys: DataKeys,
    ) -> Result<PeerAddr, EngineError> {
        Shared::add_peer(self, peer, Some(incarnation), Some(conn), Some(keys))
    }
    fn deliver(&self, from: &PeerAddr, incarnation: side::Incarnation, frame: &[u8]) -> Result<(), EngineError> {
        // The side channel's I/O thread serves every connection: it never waits here, it parks the
        // frame and stops reading that peer instead.
        self.handle_frame(from, Some(incarnation), frame)
    }
    fn control_wait(&self) -> std::time::Duration {
        self.control.limits().wait
    }
    fn peer_lost(&self, peer: &PeerAddr, incarnation: side::Incarnation, conn: side::ConnId, reason: &str) -> bool {
        // Under the write lock: a handshake of the same peer (`add_peer`) is wholly before or after.
        let peers = self.peers.write().unwrap_or_else(|p| p.into_inner());
        let known = peers.by_addr.get(peer);
        if let Some(p) = known.filter(|p| p.incarnation == Some(incarnation) && p.conn.is_some_and(|c| c != conn)) {
            // The same process handshook again over another connection: the one that closed was
            // replaced, nothing of the peer went away, and what it registered since stays.
            tracing::info!(worker = %self.me, %peer, %reason, closed = conn.0, current = ?p.conn, "a replaced connection of the peer closed; the peer stays");
            return false;
        }
        tracing::warn!(worker = %self.me, %peer, %reason, "peer lost");
        let agent = known.filter(|p| p.incarnation.is_none_or(|i| i == incarnation)).map(|p| p.agent.as_str());
        self.lose_peer(peer, Some(incarnation), Some(conn), agent, reason);
        true
    }
}

impl FrameSink for Shared {
    fn deliver(&self, from: &PeerAddr, frame: &[u8]) -> Result<(), EngineError> {
        self.handle_frame(from, None, frame)
    }
}

/// The blocks of every distinct region of `layout`, as a transport prepares them (a region shared
/// by layers of several KV groups once: transports find a unit by its address).
fn units(layout: &KvLayout) -> Vec<Units> {
    layout
        .distinct_regions()
        .into_iter()
        .map(|i| Units { base: layout.region_bases[i], unit: layout.block_stride, count: u64::from(layout.num_blocks) })
        .collect()
}

/// One worker of a producer and/or consumer engine. See the module docs.
#[derive(Debug)]
pub struct Engine {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Engine {
    /// Starts a worker: validates `layout`, checks every KV region with `device` and registers it
    /// with `transport`, then starts the writer threads.
    ///
    /// # Safety
    ///
    /// The engine and its peers write into and read from the layout's regions (`region_bases`, each
    /// `layout.region_len()` bytes) behind Rust's back. The caller guarantees that
    ///
    /// 1. every region is memory of `device`, valid for reads and writes, until the engine is
    ///    dropped or [`Engine::shutdown`] returns;
    /// 2. the blocks of a request are not written while the engine reads them (producer: from
    ///    [`Engine::request_finished`] until [`Finished::Sent`]) nor read or reused while peers
    ///    write them (consumer: from [`Engine::blocks_allocated`] or [`Engine::start_pull`] until
    ///    the request's [`Finished`] outcome).
    pub unsafe fn new(
        config: Config,
        layout: KvLayout,
        device: Arc<dyn Device>,
        transport: Arc<dyn Transport>,
        link: Arc<dyn ControlLink>,
    ) -> Result<Engine, EngineError> {
        layout.validate()?;
        // Notifications are attributed below staging, so staging's own messages are covered too.
        let trusted = Arc::new(Trusted::new(transport));
        let transport: Arc<dyn Transport> = trusted.clone();
        // Staging wraps the transport before anything is registered, so it knows the KV regions.
        let mut staged = None;
        let transport = match config.staging.resolve(device.kind(), transport.costly_host_descriptors()) {
            // This worker's NIC cannot WRITE from or into its device memory: every WRITE of its KV
            // goes through host slots (a host bounce, `proto::bounce`), whatever the staging setting.
            cfg if config.mode == Mode::Push && config.memory.is_some_and(|m| needs_bounce(&m)) => {
                let s = Arc::new(host_bounce(Arc::clone(&transport), Arc::clone(&device), cfg.unwrap_or_default())?);
                staged = Some(Arc::clone(&s));
                s as Arc<dyn Transport>
            }
            Some(cfg) if config.mode == Mode::Push => {
                match Staged::new(Arc::clone(&transport), device.as_ref(), cfg)? {
                    Some(s) => {
                        let s = Arc::new(s);
                        staged = Some(Arc::clone(&s));
                        s as Arc<dyn Transport>
                    }
                    None => transport,
                }
            }
            _ => transport,
        };
        // A region shared by layers of several KV groups is registered once.
        let distinct = layout.distinct_regions();
        let mut regions = Vec::with_capacity(distinct.len());
        for index in distinct {
            let base = layout.region_bases[index];
            let region =
                device.describe(base, layout.region_len()).map_err(|source| EngineError::Device { index, source })?;
            // SAFETY: the caller's contract (1) and (2) above is exactly `register`'s contract for
            // this region, which `describe` also checked is memory of `device`.
            unsafe { transport.register(&region) }?;
            regions.push(region);
        }
        if let Err(e) = transport.prepare(None, &units(&layout)) {
            // Posts still work from lists built per post.
            tracing::warn!(error = %e, "cannot prepare the local descriptor list");
        }
        let me = PeerAddr { engine: config.engine_id.clone(), rank: layout.parallel.rank() };
        let writers = config.writers.max(1);
        let mut receivers = Vec::with_capacity(writers);
        let mut shards = Vec::with_capacity(writers);
        for _ in 0..writers {
            let (tx, rx) = unbounded();
            receivers.push(rx);
            shards.push(ShardHandle {
                tx,
                inbox: Arc::new(Inbox::new()),
                wake: Arc::new(WakeFlag::new()),
                stats: Arc::new(Mutex::new(Stats::default())),
                held: Arc::new(Mutex::new(Vec::new())),
            });
        }
        let config_control = config.control;
        let shared = Arc::new(Shared {
            config,
            me,
            layout: Arc::new(layout),
            peers: RwLock::new(Peers::default()),
            shards,
            outbox: outcomes::Outcomes::new(),
            transport,
            trusted,
            staged,
            link,
            regions,
            control: ControlBudget::new(config_control),
            notif_order: Mutex::new(()),
        });
        let weak = Arc::downgrade(&shared);
        shared.transport.set_waker(Arc::new(move || {
            if let Some(s) = weak.upgrade() {
                s.shards.iter().for_each(ShardHandle::ring);
            }
        }));
        let mut threads = Vec::with_capacity(writers);
        for (index, rx) in receivers.into_iter().enumerate() {
            let w = writer::Writer::new(index, Arc::clone(&shared), rx);
            let name = format!("kvpush-writer-{}-{index}", shared.me);
            let handle = std::thread::Builder::new()
                .name(name)
                .spawn(move || w.run())
                .map_err(|e| EngineError::Closed(format!("cannot start writer thread: {e}")))?;
            threads.push(handle);
        }
        tracing::info!(worker = %shared.me, mode = %shared.config.mode, writers, "kvpush engine started");
        Ok(Engine { shared, threads })
    }

    /// This worker's address.
    pub fn addr(&self) -> &PeerAddr {
        &self.shared.me
    }

    /// This worker's KV layout.
    pub fn layout(&self) -> &KvLayout {
        &self.shared.layout
    }

    /// The frame sink the control link delivers this worker's frames to (for [`LocalHub::attach`]).
    pub fn sink(&self) -> std::sync::Weak<dyn FrameSink> {
        let s: Arc<dyn FrameSink> = self.shared.clone();
        Arc::downgrade(&s)
    }

    /// This worker's handshake, to send to peers.
    pub fn handshake(&self) -> Result<Handshake, EngineError> {
        self.shared.handshake()
    }

    /// Accepts a peer worker from its handshake: checks compatibility (refusing with every differing
    /// field) and loads its transport metadata. A peer that was known already is replaced (restart).
    /// The caller vouches for it: its notifications count by the agent name they claim (peers met
    /// over the side channel are authenticated instead; docs/security.md).
    pub fn add_peer(&self, peer: &Handshake) -> Result<PeerAddr, EngineError> {
        self.shared.add_peer(peer, None, None, None)
    }

    /// The endpoint a [`side::SideChannel`] serves for this worker (held weakly by it).
    pub fn endpoint(&self) -> std::sync::Weak<dyn side::Endpoint> {
        let s: Arc<dyn side::Endpoint> = self.shared.clone();
        Arc::downgrade(&s)
    }

    /// Takes one frame a peer sent over the control link.
    pub fn handle_frame(&self, from: &PeerAddr, frame: &[u8]) -> Result<(), EngineError> {
        self.shared.handle_frame(from, None, frame)
    }

    /// Producer: prefill of `key` finished; its KV is in `block_ids` (per KV group) and stays there
    /// until [`Finished::Sent`] for `key` comes out of [`Engine::poll`].
    /// The KV goes to the first consumer engine that registers `key`; [`Engine::request_finished_for`]
    /// names the consumer instead.
    pub fn request_finished(&self, key: Key, block_ids: Vec<Vec<u32>>, num_tokens: u64) -> Result<(), EngineError> {
        self.request_finished_for(key, block_ids, num_tokens, None)
    }

    /// As [`Engine::request_finished`], for consumer engine `consumer` (the decode engine the router
    /// chose): only that engine's workers receive `key`'s KV (push) or a grant to read it (pull);
    /// another engine that registers `key` is refused. `None`: the first engine to register.
    pub fn request_finished_for(
        &self,
        key: Key,
        block_ids: Vec<Vec<u32>>,
        num_tokens: u64,
        consumer: Option<&str>,
    ) -> Result<(), EngineError> {
        self.check_blocks(key, &block_ids, num_tokens)?;
        check_consumer(key, consumer)?;
        let blocks = SourceBlocks { block_ids, num_tokens };
        self.shared.send_local(key, Cmd::BlocksReady { key, blocks, consumer: consumer.map(str::to_owned) })
    }

    /// Producer, push mode: layers `layers` (global layer numbers, end exclusive; layers this worker
    /// does not hold are ignored) of `key` are final in `block_ids` (per KV group, the whole
    /// prompt's blocks) for `num_tokens` tokens. Call it as prefill's last chunk computes each layer
    /// (or range), with the same blocks and token count each time; the first call holds the
    /// blocks as [`Engine::request_finished`] does, until [`Finished::Sent`]. With chunked prefill,
    /// earlier chunks call nothing: only the last chunk's layers make the request's layers final.
    ///
    /// Per [`Config::layerwise`], each range is written into the consumer at once (when its
    /// registration is there; otherwise everything final goes in one batch when it comes), or the
    /// request goes whole once every layer this worker holds is final. Until [`Finished::Sent`]
    /// the caller must not write the blocks (of the layers already reported or not).
    ///
    /// `consumer`: as in [`Engine::request_finished_for`] (only that engine's workers receive
    /// `key`'s KV; `None`: the first engine to register); the first call's counts.
    pub fn layers_ready(
        &self,
        key: Key,
        block_ids: Vec<Vec<u32>>,
        num_tokens: u64,
        layers: std::ops::Range<u32>,
        consumer: Option<&str>,
    ) -> Result<(), EngineError> {
        self.check_mode("layers_ready", Mode::Push)?;
        self.check_blocks(key, &block_ids, num_tokens)?;
        check_consumer(key, consumer)?;
        let layerwise = self.shared.config.layerwise.applies(num_tokens);
        let blocks = SourceBlocks { block_ids, num_tokens };
        let consumer = consumer.map(str::to_owned);
        self.shared.send_local(key, Cmd::LayersReady { key, blocks, layers, layerwise, consumer })
    }

    /// Consumer, push mode: blocks for `key` are allocated; registers them with every worker of
    /// engine `producer` that writes into this worker. [`Finished::Received`] or
    /// [`Finished::Failed`] follows.
    pub fn blocks_allocated(
        &self,
        key: Key,
        producer: &str,
        block_ids: Vec<Vec<u32>>,
        num_tokens: u64,
    ) -> Result<(), EngineError> {
        self.check_mode("blocks_allocated", Mode::Push)?;
        self.check_blocks(key, &block_ids, num_tokens)?;
        self.shared.send_local(key, Cmd::Register { key, producer: producer.to_owned(), block_ids, num_tokens })
    }

    /// Consumer, pull mode: read `key` from engine `producer`, whose blocks (per KV group, as the
    /// router relayed them) are `remote_blocks`, into `local_blocks`.
    pub fn start_pull(
        &self,
        key: Key,
        producer: &str,
        remote_blocks: Vec<Vec<u32>>,
        local_blocks: Vec<Vec<u32>>,
        num_tokens: u64,
    ) -> Result<(), EngineError> {
        self.pull(key, producer, remote_blocks, None, local_blocks, num_tokens)
    }

    /// As [`Engine::start_pull`], with `remote_blocks` named in blocks of `remote_block_tokens`
    /// tokens — the serving engine's block ids, as vLLM's `remote_block_ids` are — rather than in
    /// the producer's own: where the producer's layout has smaller (kernel) blocks, each id becomes
    /// the kernel blocks it holds ([`crate::proto::msg::kernel_block_lists`]), with the producer's
    /// block size learned at the handshake, as the producer expanded its own ids. Its grant must
    /// still name exactly those blocks; a size its blocks do not divide fails the request.
    pub fn start_pull_logical(
        &self,
        key: Key,
        producer: &str,
        remote_blocks: Vec<Vec<u32>>,
        remote_block_tokens: u32,
        local_blocks: Vec<Vec<u32>>,
        num_tokens: u64,
    ) -> Result<(), EngineError> {
        self.pull(key, producer, remote_blocks, Some(remote_block_tokens), local_blocks, num_tokens)
    }

    fn pull(
        &self,
        key: Key,
        producer: &str,
        remote_blocks: Vec<Vec<u32>>,
        remote_block_tokens: Option<u32>,
        local_blocks: Vec<Vec<u32>>,
        num_tokens: u64,
    ) -> Result<(), EngineError> {
        self.check_mode("start_pull", Mode::Pull)?;
        self.check_blocks(key, &local_blocks, num_tokens)?;
        let producer = producer.to_owned();
        let cmd = Cmd::Pull { key, producer, remote_blocks, remote_block_tokens, local_blocks, num_tokens };
        self.shared.send_local(key, cmd)
    }

    /// Aborts `key` on this worker, in whatever state it is; peers are told.
    pub fn abort(&self, key: Key) -> Result<(), EngineError> {
        self.shared.send_local(key, Cmd::Abort { key })
    }

    /// Refuses a call made for the other mode (`call` names it in the error).
    fn check_mode(&self, call: &'static str, mode: Mode) -> Result<(), EngineError> {
        if self.shared.config.mode != mode {
            return Err(EngineError::WrongMode { call, mode: self.shared.config.mode });
        }
        Ok(())
    }

    /// Checks `key`'s block lists against this worker's layout for `num_tokens` tokens.
    fn check_blocks(&self, key: Key, block_ids: &[Vec<u32>], num_tokens: u64) -> Result<(), EngineError> {
        check_block_lists(block_ids, num_tokens, &self.shared.layout)
            .map_err(|source| EngineError::Blocks { key, source })
    }

    /// Consumer: `key` ended here before this worker registered (push) or read (pull) anything for
    /// it — the serving engine dropped the request while it waited for blocks — so every rank of
    /// engine `producer` that writes into this worker is told to release its blocks now rather than
    /// hold them until the lease runs out. No outcome follows on this side (nothing was handed to
    /// the engine); a producer not handshaken with this worker is not told (its lease ends it).
    pub fn abort_producer(&self, key: Key, producer: &str) -> Result<(), EngineError> {
        self.shared.send_local(key, Cmd::AbortProducer { key, producer: producer.to_owned() })
    }

    /// Consumer: `key` is still waiting in the serving engine's queue for blocks (nothing registered
    /// yet): every rank of engine `producer` that writes into this worker restarts its lease of the
    /// request's blocks now, so a request that queues longer than the lease is not dropped by P while
    /// D still means to take it. Call it more often than the producer's lease while the request
    /// waits; nothing follows on this side.
    pub fn hold(&self, key: Key, producer: &str) -> Result<(), EngineError> {
        self.shared.send_local(key, Cmd::Hold { key, producer: producer.to_owned() })
    }

    /// Moves finished results into `out`; returns how many. Costs one atomic load when there are none.
    pub fn poll(&self, out: &mut Vec<Finished>) -> usize {
        self.shared.outbox.drain_into(out)
    }

    /// Blocks until [`Engine::poll`] has something to return or `timeout` has passed; returns
    /// whether it has. For a caller with nothing else to do until a transfer ends (vLLM's decode
    /// engine while its only requests wait for their KV): it wakes as soon as a result comes, and
    /// costs no CPU until then. Returns at once when a result is already there.
    pub fn wait(&self, timeout: std::time::Duration) -> bool {
        self.shared.outbox.wait(timeout)
    }

    /// Whether some worker of engine `engine_id` is handshaken with this worker now (peers that were
    /// lost are forgotten until they handshake again).
    pub fn knows_engine(&self, engine_id: &str) -> bool {
        self.shared.any_peer_of(engine_id).is_some()
    }

    /// Notifications dropped because no authenticated peer sent them (see
    /// [`crate::transport::trust`]).
    pub fn data_path_counts(&self) -> DataPathCounts {
        self.shared.trusted.counts()
    }

    /// What staging did (`None` where staging is off).
    pub fn staging_counts(&self) -> Option<StagingCounts> {
        self.shared.staged.as_ref().map(|s| s.counts())
    }

    /// Moves the transfers finished since the last call (each writer keeps at most
    /// [`stats::Recent::CAP`]) into `out`; returns how many.
    pub fn take_transfers(&self, out: &mut Vec<stats::TransferRecord>) -> usize {
        let before = out.len();
        for s in &self.shared.shards {
            crate::sync::lock(&s.stats).recent.take_into(out);
        }
        out.len() - before
    }

    /// Counters and latency histograms of all writer shards.
    pub fn stats(&self) -> StatsSnapshot {
        let mut total = Stats::default();
        for s in &self.shared.shards {
            if let Ok(s) = s.stats.lock() {
                total.add(&s);
            }
        }
        total.snapshot()
    }

    /// Stops the engine and says what it could not fence. In order:
    ///
    /// 1. It waits, at most [`Config::shutdown_wait_us`], until no blocks are quarantined any more
    ///    (a lost producer's final word, its return as a new process, or the bound releases them;
    ///    the writers keep serving meanwhile, so a `Released` that comes is queued, though no one
    ///    polls it any more).
    /// 2. Each writer ends every transfer it posted: cancelled where the transport can cut it short,
    ///    then polled until it ends, at most 5 s; one still pending is counted
    ///    (`failures.shutdown_unfenced`) and logged.
    /// 3. The writers stop and the memory leaves the transport.
    ///
    /// After it returns, nothing this engine posted touches the memory. What a *peer* posted is
    /// another matter: a peer lost without a fence (NIXL over UCX: its remote keys stay valid until
    /// the memory is deregistered, and over shared memory (CMA) not even that stops a peer process
    /// that still runs) may still write into the blocks of [`ShutdownReport::quarantined`] requests
    /// (consumer) or read them (producer, pull). While that list is not empty, keep the memory of
    /// those blocks allocated and unused (in practice: do not free the regions) until the peers
    /// concerned are known to be gone; [`ShutdownReport::fenced`] says whether the regions may be
    /// freed at once.
    pub fn shutdown(mut self) -> ShutdownReport {
        self.stop()
    }

    /// [`Engine::shutdown`] in place (for an owner that cannot give the engine up, the C API's
    /// destroy); a second call finds it stopped and reports nothing.
    pub(crate) fn stop(&mut self) -> ShutdownReport {
        if self.threads.is_empty() {
            // Stopped already (`shutdown`, then `drop`): the regions left the transport then.
            return ShutdownReport::default();
        }
        let wait = std::time::Duration::from_micros(self.shared.config.shutdown_wait_us);
        let deadline = std::time::Instant::now() + wait;
        while self.quarantined().next().is_some() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        for s in &self.shared.shards {
            let _ = s.tx.send(Cmd::Stop);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // The writers ended (or gave up on, counted and logged) every transfer they posted; now the
        // memory leaves the transport, so nothing new can reach it.
        for r in &self.shared.regions {
            if let Err(e) = self.shared.transport.deregister(r) {
                tracing::error!(worker = %self.shared.me, region = ?r, error = %e, "cannot deregister KV memory at shutdown");
            }
        }
        let mut quarantined: Vec<Key> = self.quarantined().collect();
        quarantined.sort();
        quarantined.dedup();
        let report = ShutdownReport { unfenced_transfers: self.stats().failures.shutdown_unfenced, quarantined };
        if !report.quarantined.is_empty() {
            tracing::error!(worker = %self.shared.me, keys = ?report.quarantined, "stopped with blocks still quarantined: a lost peer may still touch them; keep their memory");
        }
        report
    }

    /// The requests whose blocks some writer holds quarantined now.
    fn quarantined(&self) -> impl Iterator<Item = Key> + '_ {
        self.shared.shards.iter().flat_map(|s| crate::sync::lock(&s.held).clone())
    }
}

/// What [`Engine::shutdown`] could not fence: where it is not [`ShutdownReport::fenced`], memory of
/// the engine may still be touched after the engine stopped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Transfers this engine posted that had not ended when its fence gave up
    /// (`failures.shutdown_unfenced`; each logged with its request and peer).
    pub unfenced_transfers: u64,
    /// Requests whose blocks were still quarantined when the wait ended: a peer lost without a
    /// fence may still write into them (consumer) or read them (producer, pull).
    pub quarantined: Vec<Key>,
}

impl ShutdownReport {
    /// Whether nothing can touch the engine's memory any more: it may be freed.
    pub fn fenced(&self) -> bool {
        self.unfenced_transfers == 0 && self.quarantined.is_empty()
    }
}

impl std::fmt::Display for ShutdownReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} transfer(s) it posted had not ended, and the blocks of {} request(s) stayed quarantined ({:?})",
            self.unfenced_transfers,
            self.quarantined.len(),
            self.quarantined
        )
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// Refuses a consumer engine id that no handshake could carry.
fn check_consumer(key: Key, consumer: Option<&str>) -> Result<(), EngineError> {
    match consumer {
        Some(c) if c.is_empty() || c.len() > crate::proto::msg::MAX_ENGINE_ID => {
            Err(EngineError::ConsumerId { key, len: c.len() })
        }
        _ => Ok(()),
    }
}

/// The rank of `addr` as a rendezvous target.
pub(crate) fn target_of(addr: &PeerAddr) -> crate::proto::rendezvous::Target {
    crate::proto::rendezvous::Target { engine: addr.engine.clone(), rank: addr.rank }
}

/// The address of a rendezvous target.
pub(crate) fn addr_of(t: &crate::proto::rendezvous::Target) -> PeerAddr {
    PeerAddr { engine: t.engine.clone(), rank: t.rank }
}

/// Producer ranks of a peer engine that write into `me` (TP sources × overlapping PP stages).
pub(crate) fn producer_ranks(model_src: &KvLayout, me: &KvLayout) -> Vec<Rank> {
    use crate::proto::layout::{pp_sources, tp_sources};
    let sp = model_src.parallel;
    let dp = me.parallel;
    let tps = tp_sources(&me.model, sp.tp_size, dp.tp_size, dp.tp_rank);
    let pps = pp_sources(me.model.total_layers, sp.pp_size, dp.pp_size, dp.pp_rank);
    let mut out = Vec::with_capacity(tps.len() * pps.len());
    for t in &tps {
        for &p in &pps {
            out.push(Rank::new(t.tp_rank, p));
        }
    }
    out
}

/// Ranks of a producer engine (laid out as `src`, any of its ranks) that write into no worker of the
/// consumer engine `me` belongs to: with more producer TP ranks than KV heads, the replicas no
/// consumer rank reads. Nothing but a word from the consumer releases their blocks before the lease.
pub(crate) fn idle_producer_ranks(src: &KvLayout, me: &KvLayout) -> Vec<Rank> {
    use crate::proto::layout::{pp_sources, tp_targets};
    let (sp, dp) = (src.parallel, me.parallel);
    let mut out = Vec::new();
    for pp in 0..sp.pp_size.max(1) {
        for tp in 0..sp.tp_size.max(1) {
            let tps = tp_targets(&me.model, sp.tp_size, tp, dp.tp_size).len();
            let pps = pp_sources(me.model.total_layers, dp.pp_size, sp.pp_size, pp).len();
            if tps * pps == 0 {
                out.push(Rank::new(tp, pp));
            }
        }
    }
    out
}

/// Consumer ranks a producer worker writes into, for a consumer engine whose sizes `dst` has.
pub(crate) fn fan_out(me: &KvLayout, dst: &KvLayout) -> u16 {
    use crate::proto::layout::{pp_sources, tp_targets};
    let sp = me.parallel;
    let dp = dst.parallel;
    let tps = tp_targets(&me.model, sp.tp_size, sp.tp_rank, dp.tp_size).len();
    let pps = pp_sources(me.model.total_layers, dp.pp_size, sp.pp_size, sp.pp_rank).len();
    u16::try_from(tps * pps).unwrap_or(u16::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_staging_measures_host_memory_only_where_descriptors_are_costly() {
        let measured = |c: StagingConfig| Some(StagingConfig { choice: PathChoice::Measured, ..c });
        // Host memory over NIXL: the host geometry, each WRITE the path measured faster.
        assert_eq!(Staging::Auto.resolve(DeviceKind::Host, true), measured(StagingConfig::host()));
        assert!(StagingConfig::host().validate().is_ok());
        // In-process copies (loopback) and the mock device: no staging unless asked for.
        assert_eq!(Staging::Auto.resolve(DeviceKind::Host, false), None);
        assert_eq!(Staging::Auto.resolve(DeviceKind::Mock, true), None);
        // GPU memory as before: the default geometry, measured, whatever the transport.
        assert_eq!(Staging::Auto.resolve(DeviceKind::Cuda, false), measured(StagingConfig::default()));
        // A geometry given with auto is kept; `on` always stages, `off` never.
        let c = StagingConfig { slot_bytes: 2 << 20, ..StagingConfig::host() };
        assert_eq!(Staging::AutoWith(c).resolve(DeviceKind::Host, true), measured(c));
        assert_eq!(Staging::AutoWith(c).resolve(DeviceKind::Host, false), None);
        assert_eq!(Staging::On(c).resolve(DeviceKind::Host, false), Some(c));
        assert_eq!(Staging::Off.resolve(DeviceKind::Host, true), None);
    }
}
