//! The embedding facade: one engine worker as a foreign caller sees it, shared by the C ABI and the
//! cxx bridge ([`crate::ffi`]) and by the Python module (`src/python`, feature `python`).
//!
//! Read [`FfiEngine`] first: it is built from plain values ([`EngineSpec`], [`LayoutSpec`]) instead of
//! Rust types, connected to its peers through an in-process [`Hub`] (loopback transport) or a TCP side
//! channel (NIXL), with completions buffered so a caller can drain them into an array of any size.
//! Every front end converts its arguments into these types, calls the same methods and turns a
//! [`FfiError`] into an error code and message (C), an exception (C++) or a Python exception. The
//! numeric codes ([`status`], [`mode`], [`transport`], [`outcome`], [`release`]) are the C ABI's
//! (`cpp/include/kvpush.h`); docs/ffi.md explains ownership and threading.
//!
//! This module only calls [`crate::engine`]; it must never let a panic cross the boundary (each front
//! end catches them) nor trust a number from the caller before checking it.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::device::{self, DeviceError};
use crate::engine::dial::DialPolicy;
use crate::engine::side::{SideChannel, SideConfig, SideError};
use crate::engine::{
    Config, Engine, EngineError, Finished, Layerwise, LocalHub, ShutdownReport, Staging, StatsSnapshot,
};
use crate::proto::codec::{self, DecodeError, EncodeError};
use crate::proto::layout::{
    BlockOrder, DType, GroupKind, KvGroup, KvKind, KvLayout, KvPlacement, LayoutError, ModelShape, Parallel,
};
use crate::proto::msg::{Message, Mode};
use crate::proto::rendezvous::ReleaseReason;
use crate::proto::Key;
use crate::sync::lock;
use crate::transport::loopback::Fabric;
use crate::transport::nixl::{NixlConfig, NixlTransport};
use crate::transport::TransportError;

/// Error codes shared by the C ABI and the C++ exceptions (`kvpush_status` in `kvpush.h`).
pub mod status {
    /// Success.
    pub const OK: i32 = 0;
    /// A required pointer argument is null.
    pub const NULL: i32 = 1;
    /// An argument is malformed: zero length, invalid UTF-8, unknown enum value, not a handshake.
    pub const INVALID_ARGUMENT: i32 = 2;
    /// The handle was never created or is already destroyed.
    pub const UNKNOWN_HANDLE: i32 = 3;
    /// The KV layout is invalid (or does not fit the memory given).
    pub const LAYOUT: i32 = 4;
    /// The device rejected the memory or is not available.
    pub const DEVICE: i32 = 5;
    /// A transport call failed (or NIXL is missing).
    pub const TRANSPORT: i32 = 6;
    /// The peer's handshake is incompatible (the message names every differing field).
    pub const INCOMPATIBLE: i32 = 7;
    /// A block list does not fit the layout.
    pub const BLOCKS: i32 = 8;
    /// The call does not fit the engine's mode (push or pull).
    pub const WRONG_MODE: i32 = 9;
    /// The side channel failed (listen, connect, handshake refused).
    pub const SIDE_CHANNEL: i32 = 10;
    /// Bytes from a peer could not be decoded.
    pub const DECODE: i32 = 11;
    /// The caller's buffer is too small; the needed size was written back.
    pub const BUFFER_TOO_SMALL: i32 = 12;
    /// The engine has shut down.
    pub const CLOSED: i32 = 13;
    /// An internal error: a Rust panic was caught at the boundary.
    pub const PANIC: i32 = 14;
    /// The engine was destroyed, but its memory may still be touched (a transfer it posted did not
    /// end, or blocks stayed quarantined for a peer lost without a fence): keep the regions
    /// allocated until those peers are gone.
    pub const UNFENCED: i32 = 15;

    /// The name of a status code, as `kvpush.h` spells it.
    pub fn name(code: i32) -> &'static str {
        match code {
            OK => "KVPUSH_OK",
            NULL => "KVPUSH_ERR_NULL",
            INVALID_ARGUMENT => "KVPUSH_ERR_INVALID_ARGUMENT",
            UNKNOWN_HANDLE => "KVPUSH_ERR_UNKNOWN_HANDLE",
            LAYOUT => "KVPUSH_ERR_LAYOUT",
            DEVICE => "KVPUSH_ERR_DEVICE",
            TRANSPORT => "KVPUSH_ERR_TRANSPORT",
            INCOMPATIBLE => "KVPUSH_ERR_INCOMPATIBLE",
            BLOCKS => "KVPUSH_ERR_BLOCKS",
            WRONG_MODE => "KVPUSH_ERR_WRONG_MODE",
            SIDE_CHANNEL => "KVPUSH_ERR_SIDE_CHANNEL",
            DECODE => "KVPUSH_ERR_DECODE",
            BUFFER_TOO_SMALL => "KVPUSH_ERR_BUFFER_TOO_SMALL",
            CLOSED => "KVPUSH_ERR_CLOSED",
            PANIC => "KVPUSH_ERR_PANIC",
            UNFENCED => "KVPUSH_ERR_UNFENCED",
            _ => "unknown status",
        }
    }
}

/// What went wrong in a call from C or C++. [`FfiError::code`] is the status the caller sees.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FfiError {
    /// A required pointer is null.
    #[error("argument `{0}` is null")]
    Null(&'static str),
    /// A required pointer is null; `why` says what it is needed for.
    #[error("argument `{arg}` is null: {why}")]
    NullFor {
        /// The argument.
        arg: &'static str,
        /// What it is needed for.
        why: &'static str,
    },
    /// An argument is malformed.
    #[error("argument `{arg}`: {reason}")]
    Invalid {
        /// The argument.
        arg: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A handle that is not (or no longer) live.
    #[error("{kind} handle {handle:#x} is unknown (never created, or already destroyed)")]
    UnknownHandle {
        /// `"engine"` or `"hub"`.
        kind: &'static str,
        /// The handle's value.
        handle: usize,
    },
    /// The layout description cannot describe the caller's memory.
    #[error("invalid KV layout: {0}")]
    Layout(String),
    /// An engine call failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The device could not be selected.
    #[error("device: {0}")]
    Device(#[from] DeviceError),
    /// The transport could not be created.
    #[error("transport: {0}")]
    Transport(#[from] TransportError),
    /// The side channel failed.
    #[error("side channel: {0}")]
    Side(#[from] SideError),
    /// Handshake bytes could not be decoded.
    #[error("handshake bytes: {0}")]
    Decode(#[from] DecodeError),
    /// The handshake could not be encoded.
    #[error("handshake: {0}")]
    Encode(#[from] EncodeError),
    /// A caller's buffer is too small.
    #[error("buffer of {cap} bytes is too small: {needed} bytes needed")]
    BufferTooSmall {
        /// Bytes needed.
        needed: usize,
        /// Bytes given.
        cap: usize,
    },
    /// A panic was caught at the boundary.
    #[error("internal error (panic): {0}")]
    Panic(String),
    /// The engine stopped, but its memory may still be touched ([`ShutdownReport::fenced`]).
    #[error("the engine stopped, but its memory may still be touched: {0}; keep its regions allocated until those peers are gone")]
    Unfenced(ShutdownReport),
}

impl From<LayoutError> for FfiError {
    fn from(e: LayoutError) -> Self {
        FfiError::Layout(e.to_string())
    }
}

impl FfiError {
    /// The status code of this error ([`status`]).
    pub fn code(&self) -> i32 {
        match self {
            FfiError::Null(_) | FfiError::NullFor { .. } => status::NULL,
            FfiError::Invalid { .. } => status::INVALID_ARGUMENT,
            FfiError::UnknownHandle { .. } => status::UNKNOWN_HANDLE,
            FfiError::Layout(_) => status::LAYOUT,
            FfiError::Engine(e) => match e {
                EngineError::Layout(_) => status::LAYOUT,
                EngineError::Device { .. } => status::DEVICE,
                EngineError::Transport(_) => status::TRANSPORT,
                EngineError::Incompatible(_) | EngineError::NoDataPath { .. } => status::INCOMPATIBLE,
                EngineError::Blocks { .. } => status::BLOCKS,
                EngineError::ConsumerId { .. } => status::INVALID_ARGUMENT,
                EngineError::Decode { .. } | EngineError::StalePeer { .. } => status::DECODE,
                EngineError::WrongMode { .. } => status::WRONG_MODE,
                EngineError::Closed(_) => status::CLOSED,
                // The control link's budget: the same family as the side channel's limits.
                EngineError::Overloaded { .. } => status::SIDE_CHANNEL,
            },
            FfiError::Device(_) => status::DEVICE,
            FfiError::Transport(_) => status::TRANSPORT,
            FfiError::Side(SideError::Refused { .. }) => status::INCOMPATIBLE,
            FfiError::Side(_) => status::SIDE_CHANNEL,
            FfiError::Decode(_) | FfiError::Encode(_) => status::DECODE,
            FfiError::BufferTooSmall { .. } => status::BUFFER_TOO_SMALL,
            FfiError::Panic(_) => status::PANIC,
            FfiError::Unfenced(_) => status::UNFENCED,
        }
    }

    pub(crate) fn invalid(arg: &'static str, reason: impl Into<String>) -> Self {
        FfiError::Invalid { arg, reason: reason.into() }
    }
}

pub(crate) use crate::sync::panic_message;

/// Transfer mode codes (`kvpush_mode`).
pub mod mode {
    /// Push (the default).
    pub const PUSH: u32 = 0;
    /// Pull.
    pub const PULL: u32 = 1;
}

/// Transport codes (`kvpush_transport`).
pub mod transport {
    /// In-process loopback through a hub.
    pub const LOOPBACK: u32 = 0;
    /// NIXL with a TCP side channel.
    pub const NIXL: u32 = 1;
}

/// Completion outcome codes (`kvpush_outcome`).
pub mod outcome {
    /// Producer: the blocks may be freed ([`super::release`] says why).
    pub const SENT: u32 = 0;
    /// Consumer: every part landed; the request may decode.
    pub const RECEIVED: u32 = 1;
    /// Consumer: the KV will not arrive; the blocks registered for it are invalid.
    pub const FAILED: u32 = 2;
    /// Consumer: ended without data (aborted locally or superseded); the blocks are no longer written.
    pub const ENDED: u32 = 3;
    /// Consumer: failed or ended without data, but a lost or silent producer may still write into
    /// its blocks: they stay out of use until [`RELEASED`] for the same request.
    pub const QUARANTINED: u32 = 4;
    /// Consumer: the blocks of a [`QUARANTINED`] request may be reused.
    pub const RELEASED: u32 = 5;
}

/// Why a producer released its blocks (`kvpush_release`); `NONE` on consumer outcomes.
pub mod release {
    /// Not a producer outcome.
    pub const NONE: u32 = 0;
    /// Every consumer rank received its part.
    pub const SENT: u32 = 1;
    /// Some transfers failed.
    pub const FAILED: u32 = 2;
    /// The lease ran out before every registration came.
    pub const LEASE_EXPIRED: u32 = 3;
    /// Aborted locally or by the consumer.
    pub const ABORTED: u32 = 4;
    /// A newer attempt of the same transfer id arrived.
    pub const SUPERSEDED: u32 = 5;
    /// The blocks were for an attempt older than the live one.
    pub const STALE: u32 = 6;
    /// The same key was reported ready twice; the second set is released at once.
    pub const DUPLICATE: u32 = 7;
    /// Too many transfer ids pending.
    pub const REFUSED: u32 = 8;
}

/// The code and the text of a release reason.
fn release_of(r: ReleaseReason) -> (u32, &'static str) {
    match r {
        ReleaseReason::Sent => (release::SENT, "sent"),
        ReleaseReason::Failed => (release::FAILED, "some transfers failed"),
        ReleaseReason::LeaseExpired => (release::LEASE_EXPIRED, "lease expired before every registration came"),
        ReleaseReason::Aborted => (release::ABORTED, "aborted"),
        ReleaseReason::Superseded => (release::SUPERSEDED, "superseded by a newer attempt"),
        ReleaseReason::Stale => (release::STALE, "stale attempt"),
        ReleaseReason::Duplicate => (release::DUPLICATE, "duplicate blocks-ready for this key"),
        ReleaseReason::Refused => (release::REFUSED, "refused: too many transfers pending"),
    }
}

/// A finished result flattened for foreign callers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// The request.
    pub key: Key,
    /// One of [`outcome`].
    pub outcome: u32,
    /// One of [`release`] (producer outcomes), else [`release::NONE`].
    pub release: u32,
    /// What happened, for logs: the failure reason, or the release reason (static text: polling
    /// allocates only for failures).
    pub message: Cow<'static, str>,
}

impl From<Finished> for Outcome {
    fn from(f: Finished) -> Self {
        let (key, outcome, release, message) = match f {
            Finished::Sent { key, reason } => {
                let (code, text) = release_of(reason);
                (key, outcome::SENT, code, Cow::Borrowed(text))
            }
            Finished::Received { key } => (key, outcome::RECEIVED, release::NONE, Cow::Borrowed("")),
            Finished::Failed { key, reason, .. } => (key, outcome::FAILED, release::NONE, Cow::Owned(reason)),
            Finished::Ended { key } => {
                (key, outcome::ENDED, release::NONE, Cow::Borrowed("ended without data (aborted or superseded)"))
            }
            Finished::Quarantined { key, reason, .. } => (key, outcome::QUARANTINED, release::NONE, Cow::Owned(reason)),
            Finished::Released { key } => {
                (key, outcome::RELEASED, release::NONE, Cow::Borrowed("quarantined blocks may be reused"))
            }
        };
        Outcome { key, outcome, release, message }
    }
}

/// One KV cache group as a caller describes it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupSpec {
    /// 0: full attention; N: sliding window of N tokens.
    pub window_tokens: u32,
    /// Global layer indices, strictly increasing.
    pub layers: Vec<u32>,
}

/// Declares a layout struct: the nine numbers every binding's layout starts with (`total_layers`
/// to `placement`, in this order, each a `u32` code or count), then the fields given, each with
/// its default value; and `Default`, those numbers 0 and each given field its value. The C ABI's
/// `kvpush_layout` ([`crate::ffi::capi`]) and [`LayoutSpec`] are declared through it, so their
/// shared fields and defaults have one source; the C struct's field order (its ABI) is the order
/// written here, checked against `kvpush.h` by `tests/ffi/ffi_c.rs`.
macro_rules! layout_struct {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $($(#[$fmeta:meta])* pub $field:ident: $ty:ty = $default:expr),* $(,)?
        }
    ) => {
        $(#[$meta])*
        pub struct $name {
            /// Layers of the whole model.
            pub total_layers: u32,
            /// KV heads of the whole model (1 for a latent cache).
            pub kv_heads: u32,
            /// Elements per head.
            pub head_dim: u32,
            /// Element type (`kvpush_dtype`): 0 f16, 1 bf16, 2 f32, 3 f8e4m3, 4 f8e5m2, 5 u8.
            pub dtype: u32,
            /// `kvpush_kv_kind`: 0 keys and values, 1 latent (MLA).
            pub kv_kind: u32,
            /// Tokens per block.
            pub block_tokens: u32,
            /// Blocks in every region.
            pub num_blocks: u32,
            /// `kvpush_block_order`: 0 HND (`[heads, tokens, head_dim]`), 1 NHD.
            pub order: u32,
            /// `kvpush_placement`: 0 separate K and V regions, 1 joint (K then V in each block),
            /// 2 single (latent), 3 K then V per head in each block (vLLM's CPU layout), 4 K then V
            /// in each (head, token) cell.
            pub placement: u32,
            $($(#[$fmeta])* pub $field: $ty,)*
        }

        impl Default for $name {
            fn default() -> Self {
                Self {
                    total_layers: 0,
                    kv_heads: 0,
                    head_dim: 0,
                    dtype: 0,
                    kv_kind: 0,
                    block_tokens: 0,
                    num_blocks: 0,
                    order: 0,
                    placement: 0,
                    $($field: $default,)*
                }
            }
        }
    };
}
pub(crate) use layout_struct;

layout_struct! {
    /// A worker's KV layout as plain numbers (`kvpush_layout` in C). Enum fields are codes, checked.
    /// `Default`: every number 0 (codes: f16, keys and values, HND, separate), one worker (TP 1, PP 1).
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct LayoutSpec {
        /// TP and PP position.
        pub parallel: Parallel = Parallel::SINGLE,
        /// Bytes from one block to the next (0: the bytes a block holds).
        pub block_stride: u64 = 0,
        /// KV cache groups; empty: one full-attention group with every layer.
        pub groups: Vec<GroupSpec> = Vec::new(),
        /// Region base addresses: per local layer, K then V (separate) or one (joint, single).
        pub region_bases: Vec<u64> = Vec::new(),
        /// Bytes available at each base (checked to hold `num_blocks × block_stride`); empty: exactly that.
        pub region_lens: Vec<u64> = Vec::new(),
    }
}

/// Builds a [`LayoutSpec`] from a binding's flat layout `$l` — the C ABI's `kvpush_layout` or the cxx
/// bridge's `LayoutSpec`, whose scalar fields and TP/PP fields carry these names — and the lists the
/// binding converted itself. One place maps the flat fields, so the bindings cannot disagree.
macro_rules! layout_spec_from_flat {
    ($l:expr, groups: $groups:expr, region_bases: $bases:expr, region_lens: $lens:expr $(,)?) => {{
        let l = $l;
        $crate::embed::LayoutSpec {
            total_layers: l.total_layers,
            kv_heads: l.kv_heads,
            head_dim: l.head_dim,
            dtype: l.dtype,
            kv_kind: l.kv_kind,
            block_tokens: l.block_tokens,
            num_blocks: l.num_blocks,
            order: l.order,
            placement: l.placement,
            parallel: $crate::proto::layout::Parallel {
                tp_rank: l.tp_rank,
                tp_size: l.tp_size,
                pp_rank: l.pp_rank,
                pp_size: l.pp_size,
            },
            block_stride: l.block_stride,
            groups: $groups,
            region_bases: $bases,
            region_lens: $lens,
        }
    }};
}
pub(crate) use layout_spec_from_flat;

fn code<T: Copy>(field: &'static str, value: u32, table: &[T]) -> Result<T, FfiError> {
    table.get(value as usize).copied().ok_or_else(|| {
        FfiError::Layout(format!("`{field}` = {value} is not a known code (0..={})", table.len().saturating_sub(1)))
    })
}

impl LayoutSpec {
    /// Builds and validates the layout; checks the regions' lengths when given.
    pub fn build(&self) -> Result<KvLayout, FfiError> {
        let dtype =
            code("dtype", self.dtype, &[DType::F16, DType::Bf16, DType::F32, DType::F8E4M3, DType::F8E5M2, DType::U8])?;
        let kind = code("kv_kind", self.kv_kind, &[KvKind::KeyValue, KvKind::Latent])?;
        let order = code("order", self.order, &[BlockOrder::Hnd, BlockOrder::Nhd])?;
        let placement = code(
            "placement",
            self.placement,
            &[
                KvPlacement::Separate,
                KvPlacement::Joint,
                KvPlacement::Single,
                KvPlacement::HeadJoint,
                KvPlacement::CellJoint,
            ],
        )?;
        let groups = if self.groups.is_empty() {
            vec![KvGroup {
                kind: GroupKind::Full,
                layers: (0..self.total_layers.min(crate::proto::layout::MAX_LAYERS)).collect(),
            }]
        } else {
            self.groups
                .iter()
                .map(|g| KvGroup {
                    kind: match g.window_tokens {
                        0 => GroupKind::Full,
                        n => GroupKind::SlidingWindow { window_tokens: n },
                    },
                    layers: g.layers.clone(),
                })
                .collect()
        };
        let mut layout = KvLayout {
            model: ModelShape {
                total_layers: self.total_layers,
                kv_heads: self.kv_heads,
                head_dim: self.head_dim,
                dtype,
                kind,
                groups,
            },
            block_tokens: self.block_tokens,
            order,
            placement,
            block_stride: self.block_stride,
            num_blocks: self.num_blocks,
            parallel: self.parallel,
            region_bases: self.region_bases.clone(),
        };
        if layout.block_stride == 0 {
            let parts = u64::from(placement.parts_in_block());
            layout.block_stride = layout.part_bytes().saturating_mul(parts);
        }
        layout.validate()?;
        if !self.region_lens.is_empty() {
            if self.region_lens.len() != self.region_bases.len() {
                return Err(FfiError::Layout(format!(
                    "{} region lengths given for {} region bases",
                    self.region_lens.len(),
                    self.region_bases.len()
                )));
            }
            let need = layout.region_len();
            if let Some((i, &len)) = self.region_lens.iter().enumerate().find(|(_, &len)| len < need) {
                return Err(FfiError::Layout(format!(
                    "region {i} at {:#x} has {len} bytes, the layout needs {need} (num_blocks {} x block_stride {})",
                    self.region_bases[i], layout.num_blocks, layout.block_stride
                )));
            }
        }
        Ok(layout)
    }
}

/// How an engine reaches its peers.
#[derive(Clone, Debug)]
pub enum TransportSpec {
    /// In-process loopback transport; control frames through the hub.
    Loopback(Arc<Hub>),
    /// NIXL, control frames over a TCP side channel.
    Nixl {
        /// Agent name (default `"<engine_id>/<tp_rank>.<pp_rank>"`).
        agent_name: Option<String>,
        /// Backend plugin (default `"UCX"`).
        backend: Option<String>,
        /// Side-channel listen address (default `0.0.0.0:<5600 + tp_rank>`; port 0 picks one).
        listen: Option<String>,
        /// Side-channel shared secret (default `$KVPUSH_SECRET`; empty is an error; see
        /// [`SideConfig::secret`] for what unset means).
        secret: Option<Vec<u8>>,
        /// No side-channel authentication (default `$KVPUSH_INSECURE=1`); warned at every start.
        insecure: bool,
        /// A peer silent this long is lost (0: the default, 5 s). Heartbeats go every fifth of it, at
        /// most every second.
        peer_timeout_ms: u64,
        /// Which producers the side channel may dial: comma-separated networks and host names
        /// (default `$KVPUSH_DIAL_ALLOW`, else loopback and the private networks; see
        /// [`crate::engine::dial`]).
        dial_allow: Option<String>,
    },
}

/// An engine's configuration as plain values (`kvpush_engine_config` in C).
#[derive(Clone, Debug)]
pub struct EngineSpec {
    /// Engine id (shared by all workers of the engine).
    pub engine_id: String,
    /// One of [`mode`].
    pub mode: u32,
    /// Device backend name (`host`, `mock`, `cuda`, `neuron`, `auto`); `None`: `KVPUSH_DEVICE` or auto.
    pub device: Option<String>,
    /// Writer threads (0: 1).
    pub writers: u32,
    /// Producer lease (ms, 0: default).
    pub lease_ms: u64,
    /// Consumer timeout (ms, 0: default).
    pub timeout_ms: u64,
    /// Transport and control link.
    pub transport: TransportSpec,
    /// Staging of fragmented WRITEs ([`Staging::Auto`]: measured per WRITE for GPU memory, and for host memory over NIXL).
    pub staging: Staging,
    /// How [`FfiEngine::layers_ready`] pushes ([`Layerwise::AUTO`]: layer by layer above a size).
    pub layerwise: Layerwise,
    /// The memory offer in this engine's handshakes ([`crate::engine::Config::memory`]; `None`: no
    /// offer, read as direct only).
    pub memory: Option<crate::proto::bounce::MemoryOffer>,
}

/// In-process medium for loopback engines: the transport fabric and the control-link hub.
#[derive(Debug, Default)]
pub struct Hub {
    fabric: Fabric,
    link: Arc<LocalHub>,
}

impl Hub {
    /// A new, empty hub.
    pub fn new() -> Arc<Hub> {
        Arc::new(Hub { fabric: Fabric::new(), link: LocalHub::new() })
    }
}

/// What connects an engine to its peers.
enum Medium {
    Loopback(Arc<Hub>),
    Nixl(Arc<SideChannel>),
}

/// Finished results not yet handed to the caller.
#[derive(Default)]
struct Pending {
    queue: VecDeque<Finished>,
    scratch: Vec<Finished>,
}

/// One engine worker for a foreign caller. See the module docs.
pub struct FfiEngine {
    // Dropped first: stops the writers and deregisters memory before the medium goes.
    engine: Engine,
    medium: Medium,
    pending: Mutex<Pending>,
}

impl fmt::Debug for FfiEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FfiEngine").field("addr", self.engine.addr()).finish_non_exhaustive()
    }
}

impl FfiEngine {
    /// Builds the layout, selects the device, creates the transport and starts the engine.
    ///
    /// # Safety
    ///
    /// [`Engine::new`]'s contract for the regions of `layout`: every region is memory of the device,
    /// valid for reads and writes until this engine is dropped, and a request's blocks are left alone
    /// while the engine or its peers use them (producer: from `request_finished` until its `SENT`
    /// outcome; consumer: from `blocks_allocated` / `start_pull` until its outcome).
    pub unsafe fn new(spec: &EngineSpec, layout: &LayoutSpec) -> Result<FfiEngine, FfiError> {
        let mode = match spec.mode {
            mode::PUSH => Mode::Push,
            mode::PULL => Mode::Pull,
            other => return Err(FfiError::invalid("mode", format!("{other} is neither push (0) nor pull (1)"))),
        };
        if spec.engine_id.is_empty() || spec.engine_id.len() > crate::proto::msg::MAX_ENGINE_ID {
            return Err(FfiError::invalid(
                "engine_id",
                format!("must be 1 to {} bytes, got {}", crate::proto::msg::MAX_ENGINE_ID, spec.engine_id.len()),
            ));
        }
        let layout = layout.build()?;
        let device = match &spec.device {
            Some(name) => device::select(name)?,
            None => device::from_env()?,
        };
        let mut config = Config::new(spec.engine_id.clone(), mode);
        config.writers = (spec.writers as usize).max(1);
        config.staging = spec.staging;
        config.layerwise = spec.layerwise;
        config.memory = spec.memory;
        if spec.lease_ms > 0 {
            config.rendezvous.lease_us = spec.lease_ms.saturating_mul(1000);
        }
        if spec.timeout_ms > 0 {
            config.completion.timeout_us = spec.timeout_ms.saturating_mul(1000);
        }
        let p = layout.parallel;
        let default_name = format!("{}/{}.{}", spec.engine_id, p.tp_rank, p.pp_rank);
        let (engine, medium) = match &spec.transport {
            TransportSpec::Loopback(hub) => {
                let transport = Arc::new(hub.fabric.endpoint_on(&default_name, device.clone())?);
                // SAFETY: forwarded from this function's contract, which is `Engine::new`'s.
                let engine = unsafe { Engine::new(config, layout, device, transport, hub.link.clone()) }?;
                hub.link.attach(engine.addr().clone(), engine.sink());
                (engine, Medium::Loopback(Arc::clone(hub)))
            }
            TransportSpec::Nixl { agent_name, backend, listen, secret, insecure, peer_timeout_ms, dial_allow } => {
                let nixl = NixlConfig {
                    agent_name: agent_name.clone().unwrap_or(default_name),
                    backend: backend.clone().unwrap_or_else(|| "UCX".to_owned()),
                    params: Vec::new(),
                };
                let transport = Arc::new(NixlTransport::new(&nixl)?);
                let mut side = SideConfig::for_rank(p.tp_rank);
                if let Some(l) = listen {
                    side.listen = l.clone();
                }
                if secret.is_some() {
                    side.secret = secret.clone();
                }
                side.insecure |= *insecure;
                if let Some(list) = dial_allow {
                    side.dial_allow =
                        Some(DialPolicy::parse(list).map_err(|e| FfiError::invalid("dial_allow", e.to_string()))?);
                }
                if *peer_timeout_ms > 0 {
                    side.peer_timeout = Duration::from_millis(*peer_timeout_ms);
                    side.heartbeat = side.heartbeat.min(side.peer_timeout / 5);
                }
                let side = Arc::new(SideChannel::bind(side)?);
                // SAFETY: forwarded from this function's contract, which is `Engine::new`'s.
                let engine = unsafe { Engine::new(config, layout, device, transport, side.clone()) }?;
                side.serve(engine.endpoint());
                (engine, Medium::Nixl(side))
            }
        };
        Ok(FfiEngine { engine, medium, pending: Mutex::new(Pending::default()) })
    }

    /// The engine behind this handle.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// This worker's handshake, encoded (what a peer's [`FfiEngine::add_peer`] takes).
    pub fn handshake(&self) -> Result<Vec<u8>, FfiError> {
        Ok(codec::to_vec(&Message::Handshake(Box::new(self.engine.handshake()?)))?)
    }

    /// Accepts a peer from its encoded handshake (loopback engines; NIXL engines handshake over their
    /// side channel, [`FfiEngine::connect_addr`]).
    pub fn add_peer(&self, handshake: &[u8]) -> Result<(), FfiError> {
        if handshake.is_empty() {
            return Err(FfiError::invalid("handshake", "is empty"));
        }
        if let Medium::Nixl(_) = self.medium {
            return Err(FfiError::invalid(
                "engine",
                "a NIXL engine learns its peers over its side channel (control frames travel there): call \
                 kvpush_engine_connect_addr / Engine::connect instead of add_peer",
            ));
        }
        match codec::decode(handshake, None)? {
            Message::Handshake(h) => {
                self.engine.add_peer(&h)?;
                Ok(())
            }
            other => Err(FfiError::invalid("handshake", format!("is a {} frame, not a handshake", kind_name(&other)))),
        }
    }

    /// Connects two engines of this process both ways: through their common hub (loopback) or
    /// by dialing `other`'s side channel (NIXL).
    pub fn connect(&self, other: &FfiEngine) -> Result<(), FfiError> {
        if std::ptr::eq(self, other) {
            return Err(FfiError::invalid("peer", "an engine cannot connect to itself"));
        }
        match (&self.medium, &other.medium) {
            (Medium::Loopback(a), Medium::Loopback(b)) => {
                if !Arc::ptr_eq(a, b) {
                    return Err(FfiError::invalid(
                        "peer",
                        format!(
                            "{} and {} were created on different hubs; loopback engines reach each other only \
                             through a common hub",
                            self.engine.addr(),
                            other.engine.addr()
                        ),
                    ));
                }
                self.engine.add_peer(&other.engine.handshake()?)?;
                other.engine.add_peer(&self.engine.handshake()?)?;
                Ok(())
            }
            (Medium::Nixl(_), Medium::Nixl(theirs)) => {
                self.connect_addr(&dialable(theirs.local_addr()).to_string())?;
                Ok(())
            }
            _ => Err(FfiError::invalid(
                "peer",
                format!(
                    "{} and {} use different transports (loopback and NIXL)",
                    self.engine.addr(),
                    other.engine.addr()
                ),
            )),
        }
    }

    /// NIXL: dials a peer worker's side channel at `addr` (`host:port`) and handshakes both ways.
    /// Blocks up to the handshake timeout (10 s): call it off the engine loop.
    pub fn connect_addr(&self, addr: &str) -> Result<String, FfiError> {
        match &self.medium {
            Medium::Nixl(side) => Ok(side.connect(addr)?.to_string()),
            Medium::Loopback(_) => Err(FfiError::invalid(
                "engine",
                "a loopback engine has no side channel: connect it to an engine of the same hub",
            )),
        }
    }

    /// The side channel's port (NIXL), `None` for loopback engines.
    pub fn listen_port(&self) -> Option<u16> {
        match &self.medium {
            Medium::Nixl(side) => Some(side.local_addr().port()),
            Medium::Loopback(_) => None,
        }
    }

    /// See [`Engine::request_finished_for`] (`consumer`: `None` for [`Engine::request_finished`]).
    pub fn request_finished(
        &self,
        key: Key,
        block_ids: Vec<Vec<u32>>,
        num_tokens: u64,
        consumer: Option<&str>,
    ) -> Result<(), FfiError> {
        Ok(self.engine.request_finished_for(key, block_ids, num_tokens, consumer)?)
    }

    /// See [`Engine::layers_ready`].
    pub fn layers_ready(
        &self,
        key: Key,
        block_ids: Vec<Vec<u32>>,
        num_tokens: u64,
        layers: std::ops::Range<u32>,
        consumer: Option<&str>,
    ) -> Result<(), FfiError> {
        if layers.start > layers.end {
            return Err(FfiError::invalid("layers", format!("{}..{} ends before it starts", layers.start, layers.end)));
        }
        Ok(self.engine.layers_ready(key, block_ids, num_tokens, layers, consumer)?)
    }

    /// See [`Engine::blocks_allocated`].
    pub fn blocks_allocated(
        &self,
        key: Key,
        producer: &str,
        block_ids: Vec<Vec<u32>>,
        num_tokens: u64,
    ) -> Result<(), FfiError> {
        check_producer(producer)?;
        Ok(self.engine.blocks_allocated(key, producer, block_ids, num_tokens)?)
    }

    /// See [`Engine::start_pull`]; with `remote_block_tokens`, [`Engine::start_pull_logical`].
    pub fn start_pull(
        &self,
        key: Key,
        producer: &str,
        remote_blocks: Vec<Vec<u32>>,
        remote_block_tokens: Option<u32>,
        local_blocks: Vec<Vec<u32>>,
        num_tokens: u64,
    ) -> Result<(), FfiError> {
        check_producer(producer)?;
        let e = &self.engine;
        Ok(match remote_block_tokens {
            None => e.start_pull(key, producer, remote_blocks, local_blocks, num_tokens),
            Some(bt) => e.start_pull_logical(key, producer, remote_blocks, bt, local_blocks, num_tokens),
        }?)
    }

    /// See [`Engine::abort`].
    pub fn abort(&self, key: Key) -> Result<(), FfiError> {
        Ok(self.engine.abort(key)?)
    }

    /// See [`Engine::hold`].
    pub fn hold(&self, key: Key, producer: &str) -> Result<(), FfiError> {
        check_producer(producer)?;
        Ok(self.engine.hold(key, producer)?)
    }

    /// See [`Engine::abort_producer`].
    pub fn abort_producer(&self, key: Key, producer: &str) -> Result<(), FfiError> {
        check_producer(producer)?;
        Ok(self.engine.abort_producer(key, producer)?)
    }

    /// Hands at most `max` finished results to `sink`, oldest first; returns how many. Results beyond
    /// `max` stay queued for the next call.
    pub fn poll(&self, max: usize, mut sink: impl FnMut(Outcome)) -> usize {
        let mut p = lock(&self.pending);
        if p.queue.len() < max {
            let Pending { queue, scratch } = &mut *p;
            if self.engine.poll(scratch) > 0 {
                queue.extend(scratch.drain(..));
            }
        }
        let n = max.min(p.queue.len());
        for f in p.queue.drain(..n) {
            sink(f.into());
        }
        n
    }

    /// See [`Engine::take_transfers`].
    pub fn take_transfers(&self, out: &mut Vec<crate::engine::stats::TransferRecord>) -> usize {
        self.engine.take_transfers(out)
    }

    /// See [`Engine::stats`].
    pub fn stats(&self) -> StatsSnapshot {
        self.engine.stats()
    }

    /// Stops the engine ([`Engine::shutdown`]): `Err(FfiError::Unfenced)` where its memory may still
    /// be touched afterwards. Dropping it then does nothing more to the engine.
    pub fn stop(&mut self) -> Result<(), FfiError> {
        let report = self.engine.stop();
        if report.fenced() {
            Ok(())
        } else {
            Err(FfiError::Unfenced(report))
        }
    }
}

impl Drop for FfiEngine {
    fn drop(&mut self) {
        if let Medium::Loopback(hub) = &self.medium {
            hub.link.detach(self.engine.addr());
        }
    }
}

fn check_producer(producer: &str) -> Result<(), FfiError> {
    if producer.is_empty() || producer.len() > crate::proto::msg::MAX_ENGINE_ID {
        return Err(FfiError::invalid(
            "producer",
            format!("must be an engine id of 1 to {} bytes, got {}", crate::proto::msg::MAX_ENGINE_ID, producer.len()),
        ));
    }
    Ok(())
}

fn kind_name(m: &Message) -> &'static str {
    match m {
        Message::Handshake(_) => "handshake",
        Message::Registration(_) => "registration",
        Message::Completion(_) => "completion",
        Message::Failure(_) => "failure",
        Message::Abort(_) => "abort",
        Message::Heartbeat(_) => "heartbeat",
        Message::Grant(_) => "grant",
        Message::Layers(_) => "layers",
        Message::Hold(_) => "hold",
    }
}

/// A listening address made dialable from this host (an unspecified IP becomes loopback).
fn dialable(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), addr.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(Ipv6Addr::LOCALHOST.into(), addr.port()),
        _ => addr,
    }
}

/// The side-channel port of the worker at `parallel` of the data-parallel engine `dp_index`, whose
/// rank 0 of engine 0 listens on `base`: each DP engine of a host takes a block of TP × PP ports
/// (vLLM's `data_parallel_index`), each rank `pp_rank × TP + tp_rank` of it. Port 0 (any free port)
/// stays 0 on every rank.
pub fn rank_port(base: u32, dp_index: u32, parallel: Parallel) -> Result<u16, FfiError> {
    if base == 0 {
        return Ok(0);
    }
    let ranks = u64::from(parallel.tp_size.max(1)) * u64::from(parallel.pp_size.max(1));
    let rank = u64::from(parallel.pp_rank) * u64::from(parallel.tp_size.max(1)) + u64::from(parallel.tp_rank);
    let port = u64::from(base) + u64::from(dp_index) * ranks + rank;
    u16::try_from(port).map_err(|_| {
        let why = format!("{base} + dp_index {dp_index} x {ranks} + rank {rank} = {port} is above 65535");
        FfiError::invalid("side_channel_port", why)
    })
}

/// Where a producer engine's ranks listen, as a request names it.
#[derive(Clone, Copy, Debug)]
pub struct ProducerAt<'a> {
    /// Host of rank 0 (and of every rank `ranks` does not name).
    pub host: &'a str,
    /// Side-channel port of rank 0.
    pub port: u16,
    /// The producer's TP size.
    pub tp: u16,
    /// The producer's PP size.
    pub pp: u16,
    /// Each rank's `host:port`, indexed `pp_rank * tp + tp_rank`, as the producer published them
    /// (vLLM's handshake metadata); empty: rank `r` listens on `host:port + r`.
    pub ranks: &'a [String],
}

/// The side-channel addresses of the producer ranks a consumer worker at `me` dials: those writing
/// into it (TP sources × overlapping PP stages), and on its engine's first worker (TP 0, PP 0) every
/// rank, so that ranks writing into no worker of the engine (replicated heads) can be told to
/// release. A rank's address is the one the producer published (`at.ranks`), else `port + r` on
/// `host` for rank `r = pp_rank * tp + tp_rank` (the side channel's default rule).
pub fn producer_addrs(model: &ModelShape, me: Parallel, at: &ProducerAt<'_>) -> Result<Vec<String>, FfiError> {
    use crate::proto::layout::{pp_sources, tp_sources};
    if at.tp == 0 || at.pp == 0 {
        return Err(FfiError::invalid("remote tp_size and pp_size", format!("are {} and {}", at.tp, at.pp)));
    }
    let all = usize::from(at.tp) * usize::from(at.pp);
    if !at.ranks.is_empty() && at.ranks.len() != all {
        let why = format!("name {} ranks, the producer has {all} (TP {} x PP {})", at.ranks.len(), at.tp, at.pp);
        return Err(FfiError::invalid("remote ranks", why));
    }
    let ranks: Vec<(u16, u16)> = if me.tp_rank == 0 && me.pp_rank == 0 {
        (0..at.pp).flat_map(|p| (0..at.tp).map(move |t| (t, p))).collect()
    } else {
        let tps = tp_sources(model, at.tp, me.tp_size, me.tp_rank);
        let pps = pp_sources(model.total_layers, at.pp, me.pp_size, me.pp_rank);
        tps.iter().flat_map(|s| pps.iter().map(move |&p| (s.tp_rank, p))).collect()
    };
    let host =
        if at.host.contains(':') && !at.host.starts_with('[') { format!("[{}]", at.host) } else { at.host.to_owned() };
    ranks
        .iter()
        .map(|&(t, p)| {
            let r = usize::from(p) * usize::from(at.tp) + usize::from(t);
            if let Some(addr) = at.ranks.get(r) {
                return Ok(addr.clone());
            }
            let port = usize::from(at.port) + r;
            u16::try_from(port)
                .map(|port| format!("{host}:{port}"))
                .map_err(|_| FfiError::invalid("remote_port", format!("{} + rank {r} > 65535", at.port)))
        })
        .collect()
}

/// A transfer key from its C parts.
pub fn key_of(id_hi: u64, id_lo: u64, attempt: u32) -> Key {
    Key::new(u128::from(id_hi) << 64 | u128::from(id_lo), attempt)
}

/// The C parts of a key: high and low 64 bits of the transfer id, attempt.
pub fn key_parts(key: Key) -> (u64, u64, u32) {
    let id = key.transfer_id.0;
    ((id >> 64) as u64, id as u64, key.attempt.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(bases: Vec<u64>) -> LayoutSpec {
        LayoutSpec {
            total_layers: 2,
            kv_heads: 2,
            head_dim: 8,
            dtype: 1,
            block_tokens: 4,
            num_blocks: 4,
            parallel: Parallel::SINGLE,
            region_bases: bases,
            ..LayoutSpec::default()
        }
    }

    #[test]
    fn layout_defaults_to_packed_stride_and_one_full_group() {
        let l = spec(vec![0x1000, 0x2000, 0x3000, 0x4000]).build().expect("valid");
        assert_eq!(l.block_stride, 4 * 2 * 8 * 2);
        assert_eq!(l.model.groups.len(), 1);
        assert_eq!(l.model.groups[0].layers, vec![0, 1]);
    }

    #[test]
    fn layout_errors_name_the_field() {
        let mut s = spec(vec![0x1000, 0x2000, 0x3000, 0x4000]);
        s.dtype = 9;
        let e = s.build().expect_err("bad dtype");
        assert_eq!(e.code(), status::LAYOUT);
        assert!(e.to_string().contains("`dtype` = 9"), "{e}");
        let mut s = spec(vec![0x1000, 0x2000, 0x3000, 0x4000]);
        s.region_lens = vec![1024, 1024, 1024, 100];
        let e = s.build().expect_err("short region");
        assert!(e.to_string().contains("region 3 at 0x4000 has 100 bytes"), "{e}");
        let e = spec(vec![0x1000]).build().expect_err("too few bases");
        assert!(e.to_string().contains("1 region bases given, 4 expected"), "{e}");
    }

    fn model(layers: u32, kv_heads: u32) -> ModelShape {
        ModelShape {
            total_layers: layers,
            kv_heads,
            head_dim: 8,
            dtype: DType::Bf16,
            kind: KvKind::KeyValue,
            groups: vec![KvGroup { kind: GroupKind::Full, layers: (0..layers).collect() }],
        }
    }

    fn at<'a>(tp: u16, pp: u16, ranks: &'a [String]) -> ProducerAt<'a> {
        ProducerAt { host: "10.0.0.1", port: 5600, tp, pp, ranks }
    }

    fn rank(tp_rank: u16, tp_size: u16, pp_rank: u16, pp_size: u16) -> Parallel {
        Parallel { tp_rank, tp_size, pp_rank, pp_size }
    }

    #[test]
    fn consumers_dial_the_producer_ranks_that_write_into_them_and_rank_0_dials_all() {
        // P TP 2 over one KV head (replicated) -> D TP 1: D's only worker reads head 0 from P rank
        // 0, yet dials rank 1 as well (it is told to release).
        let one_head = model(4, 1);
        assert_eq!(
            producer_addrs(&one_head, rank(0, 1, 0, 1), &at(2, 1, &[])).expect("addrs"),
            ["10.0.0.1:5600", "10.0.0.1:5601"]
        );
        // P TP 1 -> D TP 2 over two heads: D rank 1 dials only P's one rank.
        let two_heads = model(4, 2);
        assert_eq!(producer_addrs(&two_heads, rank(1, 2, 0, 1), &at(1, 1, &[])).expect("addrs"), ["10.0.0.1:5600"]);
        // P TP 2 x PP 2 -> D TP 2 x PP 1: D rank 1 holds head 1 of every layer, from P's TP rank 1 of
        // both stages: ranks pp*2 + tp = 1 and 3.
        assert_eq!(
            producer_addrs(&two_heads, rank(1, 2, 0, 1), &at(2, 2, &[])).expect("addrs"),
            ["10.0.0.1:5601", "10.0.0.1:5603"]
        );
        // ... and D rank 0 dials all four.
        assert_eq!(producer_addrs(&two_heads, rank(0, 2, 0, 1), &at(2, 2, &[])).expect("addrs").len(), 4);
        // D TP 1 x PP 2 (layers 0-1, 2-3) from P PP 2 (the same split): D's stage 1 dials P's stage 1.
        assert_eq!(producer_addrs(&two_heads, rank(0, 1, 1, 2), &at(1, 2, &[])).expect("addrs"), ["10.0.0.1:5601"]);
    }

    #[test]
    fn data_parallel_engines_take_a_block_of_ports_each() {
        // TP 2 x PP 2: rank pp*2 + tp; DP engine 1 starts after engine 0's four ports.
        assert_eq!(rank_port(5600, 0, rank(1, 2, 1, 2)).expect("port"), 5603);
        assert_eq!(rank_port(5600, 1, rank(0, 2, 0, 2)).expect("port"), 5604);
        assert_eq!(rank_port(5600, 3, rank(1, 2, 0, 1)).expect("port"), 5607);
        assert_eq!(rank_port(0, 3, rank(1, 2, 0, 1)).expect("any port"), 0);
        let e = rank_port(65535, 0, rank(1, 2, 0, 1)).expect_err("past 65535");
        assert!(e.to_string().contains("65535 + dp_index 0 x 2 + rank 1 = 65536 is above 65535"), "{e}");
    }

    #[test]
    fn published_rank_addresses_replace_the_port_rule() {
        let published: Vec<String> = ["a.example:7000", "b.example:7100", "c.example:7200", "[fd00::4]:7300"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let m = model(4, 2);
        assert_eq!(
            producer_addrs(&m, rank(1, 2, 0, 1), &at(2, 2, &published)).expect("addrs"),
            ["b.example:7100", "[fd00::4]:7300"]
        );
        let e = producer_addrs(&m, rank(0, 1, 0, 1), &at(2, 2, &published[..3])).expect_err("3 of 4");
        assert!(e.to_string().contains("name 3 ranks, the producer has 4 (TP 2 x PP 2)"), "{e}");
        let e = producer_addrs(&m, rank(0, 1, 0, 1), &at(0, 1, &[])).expect_err("TP 0");
        assert!(e.to_string().contains("are 0 and 1"), "{e}");
        let far = ProducerAt { port: 65535, ..at(2, 1, &[]) };
        let e = producer_addrs(&m, rank(0, 1, 0, 1), &far).expect_err("port overflow");
        assert!(e.to_string().contains("65535 + rank 1 > 65535"), "{e}");
        let v6 = ProducerAt { host: "fd00::1", ..at(1, 1, &[]) };
        assert_eq!(producer_addrs(&m, rank(0, 1, 0, 1), &v6).expect("addrs"), ["[fd00::1]:5600"]);
    }

    #[test]
    fn keys_round_trip_through_their_parts() {
        let k = key_of(0xdead_beef, 0x1234, 7);
        assert_eq!(key_parts(k), (0xdead_beef, 0x1234, 7));
        assert_eq!(k.transfer_id.0, 0xdead_beef_u128 << 64 | 0x1234);
    }
}
