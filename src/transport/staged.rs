//! Staged WRITEs: a transport wrapper that sends a fragmented transfer through bounded, reused
//! staging slots — the sender gathers the pieces of KV memory into a contiguous slot, one WRITE moves
//! the slot into a slot of the receiver, and the receiver scatters it into its KV blocks before the
//! transfer's notification is delivered.
//!
//! Read [`Staged`] first. Per-descriptor cost, not bytes, limits a transfer of many small
//! descriptors (a fragmented request: one block per layer per K/V, 4 KiB each, cannot be merged);
//! staging trades it for two device-local copies at memory speed. The wrapper is transparent to the
//! engine: a post that qualifies ([`StagingConfig`]) returns a handle the wrapper drives itself, the
//! receiver's wrapper swallows the staging messages and delivers the sender's notification only after
//! every byte is in place. Everything else passes straight through to the inner transport.
//!
//! Staging is not always faster: a WRITE of few large merged descriptors can beat it severalfold
//! (P and D on one GPU). With [`PathChoice::Measured`] (the engine's `auto` setting) each WRITE that
//! could be staged goes the way its peer's [`PathChooser`] (in `proto::path`) predicts faster for
//! its shape; the wrapper times every such transfer from post to completion to teach it.
//!
//! The engine hands a push over as the planner's grid ([`Transport::post_grid`]): a layer's copies
//! and the layers they repeat over. Cutting works per row and a piece's tables are expanded only when
//! the piece is filled, so a 16k-token fragmented request (131072 copies) never exists as
//! descriptors. The sender does that work off the critical path where it can: a piece's tables are
//! built while the writer waits ([`Staged`]'s prefill), and pieces are gathered ahead of their grants
//! (the first while the REQUEST travels; a quarter slot when many follow), so a grant is answered by
//! a WRITE at once.
//!
//! Protocol (notifications carry frames starting with [`MAGIC`]; `tag` names one staged transfer of
//! one sender):
//!
//! ```text
//! sender (P)                                   receiver (D)
//!   post: cut into pieces ── REQUEST(tag, pieces, notification) ──▶ queue
//!   gather pieces into free send slots
//!   (table + data), ahead of their grants ◀── GRANT(tag, piece, slot, address) ── a free receive slot
//!   WRITE send slot → granted slot, with ── PIECE(tag, piece, slot, entries, bytes) ──▶
//!                                          read the table, check every entry lies in registered KV
//!                                          memory, scatter; the slot is free again (next GRANT)
//!                                          all pieces scattered: deliver the notification
//!   the handle is Done  ◀── DONE(tag) ───────
//! ```
//!
//! A failure on either side ends in a handshake that leaves nothing in flight: the receiver reports
//! `FAIL(tag)`; the sender stops, waits for its WRITEs of the transfer to end, sends `CANCEL(tag)`; the
//! receiver waits for its scatters of the transfer to end, frees its slots and answers
//! `CANCELLED(tag)`; only then does the sender's handle report the failure (so the engine's failure
//! message can never overtake a scatter into the consumer's blocks). A transfer the receiver failed
//! is never delivered, and its sender learns of it (DONE never comes; FAIL does), so the engine's own
//! failure message follows. A lost peer ends everything with it at once.
//!
//! No cycle between senders and receivers can form: grants are given in arrival order, and a sender
//! gathers a piece ahead of its grant only while at least one other send slot is not held that way,
//! so a granted piece always finds a send slot (a free one, or one whose WRITE ends on its own).
//!
//! Capabilities travel in the metadata: [`Transport::local_metadata`] is prefixed with [`MD_MAGIC`],
//! the receive slot geometry, then the inner transport's metadata; a peer without the prefix never
//! receives staged transfers.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{Desc, Fence, Notification, Op, Transport, TransportError, Units, Waker, XferId, XferState};
use crate::device::stage::{BadEntry, StageEntry, Stager, ENTRY_BYTES, STAGE_ALIGN};
use crate::device::{Buffer, Device, MemRegion, RegionSet};
use crate::proto::path::{Path, PathChooser, Shape};
use crate::proto::plan::Grid;
use crate::proto::staging::frame::Reader;
use crate::proto::staging::send::Phase as SendPhase;
use crate::proto::staging::{
    Action, Frame, Landed, Output, Piece, PieceNote, Receiver, RecvConfig, Report, SendConfig, Sender, Slot,
};
use crate::proto::Instant as ProtoInstant;
use crate::sync::lock;

pub use crate::proto::staging::MAGIC;
/// First bytes of metadata that carries staging capabilities.
pub const MD_MAGIC: [u8; 4] = *b"KSM1";
/// Handles of staged transfers have this bit set (inner transports count from 0).
const STAGED_BIT: u64 = 1 << 63;
/// Table area alignment inside a slot.
const TABLE_ALIGN: u64 = 256;

/// Slots per side of [`StagingConfig::host`].
pub const HOST_SLOTS: usize = 8;
/// Data bytes of a slot of [`StagingConfig::host`].
pub const HOST_SLOT_BYTES: u64 = 1 << 20;

/// When and how transfers are staged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagingConfig {
    /// Send slots and receive slots (each).
    pub slots: usize,
    /// Data bytes of one slot.
    pub slot_bytes: u64,
    /// Table entries of one slot (a piece closes when its data or its table is full).
    pub max_entries: usize,
    /// Longest entry: longer descriptors are cut (keeps the copy kernels' work balanced).
    pub max_entry_bytes: u64,
    /// Stage only WRITEs of at least this many descriptors...
    pub min_descs: usize,
    /// ...whose mean descriptor is at most this long.
    pub max_mean_desc: u64,
    /// A receiver fails a staged transfer whose granted piece has not landed for this long while
    /// its sender delivered no other piece either (the piece's notification was lost while the
    /// sender lives on), and a sender gives up on a receiver that does not confirm a cancel within
    /// it. A receiver never reuses a slot before the sender's cancel (a late WRITE could land in
    /// it); a peer that went away is dropped sooner by the side channel.
    pub stall_timeout: Duration,
    /// How long a receive slot granted to a sender that was lost without a confirmed fence
    /// ([`Transport::revoke_peer`]) stays out of use: its WRITE into the slot may still land, so
    /// the slot is not granted again (nor scattered) before this passes.
    pub quarantine: Duration,
    /// Whether a qualifying WRITE is always staged, or goes the way measured faster for its peer
    /// and shape ([`PathChoice::Measured`]).
    pub choice: PathChoice,
}

/// How a WRITE that could be staged picks its path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathChoice {
    /// Every qualifying WRITE is staged.
    Always,
    /// Each qualifying WRITE goes directly or staged, whichever [`PathChooser`] predicts faster
    /// for its peer and shape; the wrapper times every transfer (post to completion) to learn it.
    Measured,
}

impl Default for StagingConfig {
    fn default() -> Self {
        StagingConfig {
            slots: 4,
            slot_bytes: 32 << 20,
            max_entries: 16384,
            max_entry_bytes: 16 << 10,
            min_descs: 2,
            max_mean_desc: 16 << 20,
            stall_timeout: Duration::from_secs(10),
            quarantine: Duration::from_secs(120),
            choice: PathChoice::Always,
        }
    }
}

impl StagingConfig {
    /// The geometry for host memory (the engine's `auto` on a transport whose host descriptors are
    /// costly): small slots, many of them, so the gather of one piece, the WRITE of another and the
    /// receiver's scatter of a third overlap; entries as long as a slot (a host gather is a
    /// `memcpy` per entry, with no kernel to balance); and only WRITEs of descriptors short enough
    /// that their per-descriptor cost can outweigh two extra copies. Measured in docs/benchmarks.md
    /// ("FIFO pools on host memory").
    pub fn host() -> StagingConfig {
        StagingConfig {
            slots: HOST_SLOTS,
            slot_bytes: HOST_SLOT_BYTES,
            max_entries: 1024,
            max_entry_bytes: HOST_SLOT_BYTES,
            max_mean_desc: 256 << 10,
            ..StagingConfig::default()
        }
    }

    fn table_bytes(&self) -> u64 {
        (self.max_entries as u64 * ENTRY_BYTES as u64).div_ceil(TABLE_ALIGN) * TABLE_ALIGN
    }

    fn slot_stride(&self) -> u64 {
        self.table_bytes() + self.slot_bytes
    }

    /// Checks the geometry.
    pub fn validate(&self) -> Result<(), GeometryError> {
        if self.slots == 0 || self.slots > 1024 {
            return Err(GeometryError::Slots(self.slots));
        }
        if self.slot_bytes < 4096 || !self.slot_bytes.is_multiple_of(STAGE_ALIGN) || self.slot_bytes > u32::MAX as u64 {
            return Err(GeometryError::SlotBytes(self.slot_bytes));
        }
        if self.max_entries == 0 || self.max_entries > 1 << 24 {
            return Err(GeometryError::Entries(self.max_entries));
        }
        if self.max_entry_bytes < STAGE_ALIGN || !self.max_entry_bytes.is_multiple_of(STAGE_ALIGN) {
            return Err(GeometryError::EntryBytes(self.max_entry_bytes));
        }
        Ok(())
    }
}

/// Why a staging geometry ([`StagingConfig`]) was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GeometryError {
    /// The number of slots.
    #[error("staging slots {0}: must be 1 to 1024")]
    Slots(usize),
    /// The size of a slot.
    #[error("staging slot of {0} bytes: must be 4 KiB to 4 GiB, a multiple of 16")]
    SlotBytes(u64),
    /// Table entries per slot.
    #[error("{0} staging entries per slot: must be 1 to 2^24")]
    Entries(usize),
    /// The longest entry.
    #[error("longest staging entry {0}: must be a multiple of 16")]
    EntryBytes(u64),
}

/// What the staged transport did (cumulative).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StagingCounts {
    /// Transfers sent staged.
    pub transfers: u64,
    /// Of those, posted as a planner's grid ([`Transport::post_grid`]) rather than descriptors.
    pub grids: u64,
    /// Pieces gathered ahead of their grant (the first while the REQUEST travels, later ones while
    /// earlier pieces are on the wire).
    pub ahead: u64,
    /// Pieces whose tables were built ahead of their turn (while the writer waited).
    pub prefilled: u64,
    /// Pieces written (one WRITE each).
    pub pieces: u64,
    /// Table entries gathered.
    pub entries: u64,
    /// Bytes sent staged.
    pub bytes: u64,
    /// Transfers posted directly (not qualifying, a peer without staging, or measured faster).
    pub direct: u64,
    /// Of `direct`, transfers that could have been staged but were measured faster direct.
    pub chosen_direct: u64,
    /// Decisions that went against the prediction to keep the cost model current.
    pub explored: u64,
    /// Transfers received staged (all pieces scattered).
    pub received: u64,
    /// Staged transfers that failed (either side).
    pub failed: u64,
    /// Outgoing staged transfers cut short because their consumer gave up ([`Transport::cancel`]).
    pub cancelled: u64,
    /// Staging frames that could not be parsed or did not fit the state.
    pub malformed: u64,
    /// Receive slots quarantined: granted to a sender lost without a confirmed fence.
    pub slots_quarantined: u64,
    /// Outgoing staged transfers not yet reported finished (a gauge, not cumulative).
    pub open: u64,
    /// Incoming staged transfers still tracked (a gauge): waiting for slots, landing, scattering,
    /// or failed or cancelled with a piece still in a slot.
    pub incoming: u64,
    /// Staging slots in use, send and receive (a gauge): send slots holding a piece being gathered,
    /// gathered or written, receive slots granted or scattering.
    pub slots_in_use: u64,
}

// ---- State. ----

/// A peer's receive geometry (from its metadata).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PeerCaps {
    slot_bytes: u64,
    max_entries: usize,
    table_bytes: u64,
}

/// One piece of an outgoing transfer: where it starts in the transfer's descriptors and how much it
/// holds (where it stands is [`Sender`]'s). Its table is built only when its turn comes
/// ([`Staged::fill`]), so a large transfer's first piece goes out while the rest are still
/// descriptors.
#[derive(Clone, Copy, Debug)]
struct OutPiece {
    /// Descriptor the piece starts in...
    first: usize,
    /// ...and how many of its bytes earlier pieces took.
    skip: u64,
    /// Table entries.
    entries: u32,
    /// Data bytes.
    bytes: u64,
}

impl OutPiece {
    fn starting(first: usize, skip: u64) -> OutPiece {
        OutPiece { first, skip, entries: 0, bytes: 0 }
    }
}

/// How a transfer is cut: a piece's data bytes, its entries, and the longest entry; and where the
/// data starts in the receiver's slot (after its table area).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Cut {
    data: u64,
    /// Data bytes of the first piece (a fraction of `data`): it is gathered and on the wire sooner,
    /// so the link starts while the next, full pieces are being gathered.
    first: u64,
    max_entries: usize,
    chunk: u64,
    remote_table: u64,
}

/// What an outgoing transfer moves: descriptors, or a planner's grid, which is expanded only piece
/// by piece as pieces are filled (a fragmented request never exists as 131072 descriptors).
#[derive(Debug)]
enum Source {
    Descs(Vec<Desc>),
    Grid(Grid),
}

impl Source {
    fn bytes(&self) -> u64 {
        match self {
            Source::Descs(d) => d.iter().map(|d| d.len).sum(),
            Source::Grid(g) => g.bytes(),
        }
    }

    fn len(&self) -> usize {
        match self {
            Source::Descs(d) => d.len(),
            Source::Grid(g) => g.copies(),
        }
    }
}

/// Cuts descriptors into pieces, one descriptor at a time (see [`Staged::cut`]).
struct Cutter {
    cut: Cut,
    pieces: Vec<OutPiece>,
    cur: OutPiece,
}

impl Cutter {
    fn new(cut: Cut) -> Cutter {
        Cutter { cut, pieces: Vec::new(), cur: OutPiece::starting(0, 0) }
    }

    /// Data bytes the current piece may hold.
    #[inline]
    fn limit(&self) -> u64 {
        if self.pieces.is_empty() {
            self.cut.first
        } else {
            self.cut.data
        }
    }

    /// Descriptor number `k` of `len` bytes.
    #[inline]
    fn desc(&mut self, k: usize, len: u64) {
        let mut done = 0;
        while done < len {
            if self.cur.bytes == self.limit() || self.cur.entries as usize == self.cut.max_entries {
                self.pieces.push(std::mem::replace(&mut self.cur, OutPiece::starting(k, done)));
            }
            let n = (len - done).min(self.cut.chunk).min(self.limit() - self.cur.bytes);
            self.cur.entries += 1;
            self.cur.bytes += n;
            done += n;
        }
    }

    /// Whether `bytes` in `entries` more entries, from descriptor `k` on, fit the current piece
    /// without closing it early. A full piece is closed first (as [`Cutter::desc`] would at `k`).
    fn fits(&mut self, k: usize, bytes: u64, entries: u64) -> bool {
        if self.cur.bytes == self.limit() || self.cur.entries as usize == self.cut.max_entries {
            self.pieces.push(std::mem::replace(&mut self.cur, OutPiece::starting(k, 0)));
        }
        self.cur.bytes + bytes <= self.limit() && self.cur.entries as u64 + entries <= self.cut.max_entries as u64
    }

    fn finish(mut self) -> Vec<OutPiece> {
        if self.cur.entries > 0 {
            self.pieces.push(self.cur);
        }
        self.pieces
    }
}

/// What an outgoing transfer moves and how it is cut; where its pieces stand is [`Sender`]'s.
#[derive(Debug)]
struct Payload {
    src: Source,
    cut: Cut,
    pieces: Vec<OutPiece>,
}

/// What the carrier started in a send slot and polls for its end.
#[derive(Clone, Copy, Debug)]
enum LaneWork {
    Gather,
    Write(XferId),
}

struct State {
    stager: Box<dyn Stager>,
    /// Registered KV memory (what a receive table may point into). Shared with the checks of
    /// scatters a stager has not started yet, which must see a region deregistered meanwhile gone;
    /// never locked while taking `state`.
    regions: Arc<Mutex<RegionSet>>,
    peers: HashMap<String, PeerCaps>,
    /// Outgoing transfers' sources and pieces, while [`Sender`] tracks them.
    out: HashMap<u64, Payload>,
    /// The sending side: pieces, send slots, outcomes (`proto::staging::send`).
    tx: Sender,
    /// Per send slot, the gather or WRITE started in it and not yet seen to end.
    lanes: Vec<Option<LaneWork>>,
    /// The receiving side: receive slots, grants, incoming transfers (`proto::staging::recv`).
    rx: Receiver,
    /// When the receiver's clock started ([`State::now`]).
    epoch: Instant,
    delivered: Vec<Notification>,
    counts: StagingCounts,
    /// Pieces' tables built ahead of their turn, while the writer had nothing else to do (at most
    /// one per slot), and spare table buffers.
    prefilled: Vec<Prefilled>,
    spare: Vec<(Vec<u8>, Vec<u8>)>,
    /// Per peer, the learned choice between direct and staged ([`PathChoice::Measured`]).
    choosers: HashMap<String, PathChooser>,
    /// Transfers being timed for the choosers: handle → (peer, path, shape, posted at).
    timed: HashMap<u64, Timed>,
    /// A grid the chooser sent direct: the caller posts its expansion next, which goes direct too.
    grid_direct: Option<(String, Shape)>,
    /// Per peer, when its last timed transfer ended: a transfer posted before that waited behind
    /// others, and only its time after it counts ([`Staged::timed_end`]).
    served_until: HashMap<String, Instant>,
}

/// A transfer being timed for its peer's [`PathChooser`].
struct Timed {
    peer: String,
    path: Path,
    shape: Shape,
    posted: Instant,
}

impl State {
    /// The receiver's time.
    fn now(&self) -> ProtoInstant {
        ProtoInstant(self.epoch.elapsed().as_micros().min(u128::from(u64::MAX)) as u64)
    }
}

/// A piece's two tables (ours for the gather, the receiver's), built before its grant or send slot.
struct Prefilled {
    tag: u64,
    piece: u32,
    gather: Vec<u8>,
    table: Vec<u8>,
}

/// A transport that stages fragmented WRITEs. See the module docs.
pub struct Staged {
    inner: Arc<dyn Transport>,
    cfg: StagingConfig,
    send_buf: Box<dyn Buffer>,
    recv_buf: Box<dyn Buffer>,
    state: Mutex<State>,
    next: AtomicU64,
}

impl fmt::Debug for Staged {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Staged").field("inner", &self.inner).field("cfg", &self.cfg).finish_non_exhaustive()
    }
}

/// Where copy number `k` of `grid`'s expansion is: (group, row, cell), indices into its vectors.
fn grid_position(grid: &Grid, mut k: usize) -> (usize, usize, usize) {
    for (group, g) in grid.groups.iter().enumerate() {
        if k < g.copies() {
            let n = g.cells.len();
            return (group, g.rows.start + k / n, g.cells.start + k % n);
        }
        k -= g.copies();
    }
    (grid.groups.len(), 0, 0)
}

fn micros(d: Duration) -> u64 {
    d.as_micros().min(u128::from(u64::MAX)) as u64
}

fn failed(id: XferId, peer: &str, detail: String) -> TransportError {
    TransportError::Failed { id, peer: peer.to_owned(), status: -1, detail }
}

impl Staged {
    /// Wraps `inner`: allocates `cfg.slots` send and receive slots on `device` and registers them with
    /// `inner`. `Ok(None)` where `device` has no [`Stager`].
    pub fn new(
        inner: Arc<dyn Transport>,
        device: &dyn Device,
        cfg: StagingConfig,
    ) -> Result<Option<Staged>, TransportError> {
        let bad = |what: String| TransportError::Unavailable { transport: "staging", reason: what };
        cfg.validate().map_err(|e| bad(e.to_string()))?;
        let Some(stager) = device.stager(2 * cfg.slots, cfg.max_entries).map_err(|e| bad(e.to_string()))? else {
            return Ok(None);
        };
        let len = cfg.slot_stride() * cfg.slots as u64;
        let send_buf = device.alloc(len).map_err(|e| bad(format!("send slots: {e}")))?;
        let recv_buf = device.alloc(len).map_err(|e| bad(format!("receive slots: {e}")))?;
        // SAFETY: both buffers are owned by the returned value and deregistered (in Drop) before they
        // are freed; the wrapper's slot protocol ensures that nothing local touches a slot while a
        // transfer into or out of it is in flight (a send slot is reused only after its WRITE ended, a
        // receive slot only after its piece was scattered or its sender cancelled).
        unsafe { inner.register(&send_buf.region()) }?;
        // SAFETY: as above.
        if let Err(e) = unsafe { inner.register(&recv_buf.region()) } {
            let _ = inner.deregister(&send_buf.region());
            return Err(e);
        }
        tracing::debug!(slots = cfg.slots, slot_bytes = cfg.slot_bytes, kind = %stager.kind(), "staging slots registered");
        let state = State {
            stager,
            regions: Arc::default(),
            peers: HashMap::new(),
            out: HashMap::new(),
            tx: Sender::new(SendConfig { lanes: cfg.slots, stall_timeout_us: micros(cfg.stall_timeout) }),
            lanes: vec![None; cfg.slots],
            rx: Receiver::new(RecvConfig {
                slots: cfg.slots,
                slot_bytes: cfg.slot_bytes,
                max_entries: cfg.max_entries,
                stall_timeout_us: micros(cfg.stall_timeout),
                quarantine_us: micros(cfg.quarantine),
            }),
            epoch: Instant::now(),
            delivered: Vec::new(),
            counts: StagingCounts::default(),
            prefilled: Vec::new(),
            spare: Vec::new(),
            choosers: HashMap::new(),
            timed: HashMap::new(),
            grid_direct: None,
            served_until: HashMap::new(),
        };
        Ok(Some(Staged { inner, cfg, send_buf, recv_buf, state: Mutex::new(state), next: AtomicU64::new(0) }))
    }

    /// What has been staged so far.
    pub fn counts(&self) -> StagingCounts {
        let st = lock(&self.state);
        let (rx, tx) = (st.rx.counts(), st.tx.counts());
        StagingCounts {
            open: st.tx.open() as u64,
            incoming: rx.incoming,
            slots_in_use: st.tx.lanes_in_use() as u64 + rx.slots_in_use,
            received: rx.received,
            failed: tx.failed + rx.failed,
            malformed: st.counts.malformed + tx.malformed + rx.malformed,
            slots_quarantined: rx.slots_quarantined,
            ..st.counts
        }
    }

    fn send_slot(&self, lane: usize) -> u64 {
        self.send_buf.region().addr + lane as u64 * self.cfg.slot_stride()
    }

    fn recv_slot(&self, slot: usize) -> u64 {
        self.recv_buf.region().addr + slot as u64 * self.cfg.slot_stride()
    }

    fn send(&self, peer: &str, f: &Frame) {
        if let Err(e) = self.inner.send_notification(peer, &f.encode()) {
            tracing::warn!(peer, error = %e, frame = ?std::mem::discriminant(f), "staging frame not sent");
        }
    }

    /// Whether a WRITE of `descs` to `peer` can be staged: the peer's geometry and the bytes.
    fn qualifies(&self, st: &State, op: Op, peer: &str, descs: &[Desc]) -> Option<(PeerCaps, u64)> {
        if op != Op::Write || descs.len() < self.cfg.min_descs {
            return None;
        }
        let caps = *st.peers.get(peer)?;
        // One pass: the total, and every descriptor aligned, non-empty and in registered memory.
        let regions = lock(&st.regions);
        let (mut total, mut last) = (0u64, None::<&MemRegion>);
        for d in descs {
            if !(d.local | d.remote | d.len).is_multiple_of(STAGE_ALIGN) || d.len == 0 {
                return None;
            }
            if !last.is_some_and(|r| r.contains(d.local, d.len)) {
                last = Some(regions.find(d.local, d.len)?);
            }
            total += d.len;
        }
        (total / descs.len() as u64 <= self.cfg.max_mean_desc).then_some((caps, total))
    }

    /// Which path a qualifying WRITE of `shape` to `peer` takes.
    fn choose(&self, st: &mut State, peer: &str, shape: Shape) -> Path {
        match self.cfg.choice {
            PathChoice::Always => Path::Staged,
            PathChoice::Measured => {
                let chooser = st.choosers.entry(peer.to_owned()).or_default();
                let before = chooser.explored(Path::Direct) + chooser.explored(Path::Staged);
                let path = chooser.choose(shape);
                let explored = chooser.explored(Path::Direct) + chooser.explored(Path::Staged) - before;
                st.counts.explored += explored;
                tracing::debug!(
                    peer,
                    descs = shape.descs,
                    bytes = shape.bytes,
                    ?path,
                    explored = explored > 0,
                    direct_us = chooser.predict(Path::Direct, shape),
                    staged_us = chooser.predict(Path::Staged, shape),
                    "staging: path chosen"
                );
                path
            }
        }
    }

    /// Starts timing transfer `id` for `peer`'s chooser (measured choice only).
    fn time(&self, st: &mut State, id: XferId, peer: &str, path: Path, shape: Shape, posted: Instant) {
        if self.cfg.choice == PathChoice::Measured {
            st.timed.insert(id.0, Timed { peer: peer.to_owned(), path, shape, posted });
        }
    }

    /// Transfer `id` ended; a completed one teaches its peer's chooser how long its path took: from
    /// its post, or from the end of the transfer to the same peer that ended before it if that was
    /// later. Transfers to one peer are served mostly in post order (staged pieces by post order,
    /// one WRITE at a time on a `cma` link), so with many in flight the time since the post is
    /// mostly waiting behind the others, and counting it would make whichever path is queued
    /// behind more transfers look slow.
    fn timed_end(&self, st: &mut State, id: XferId, completed: bool) {
        let Some(t) = st.timed.remove(&id.0) else { return };
        let now = Instant::now();
        let from = st.served_until.get(&t.peer).map_or(t.posted, |&u| u.max(t.posted));
        st.served_until.insert(t.peer.clone(), now);
        if completed {
            let nanos = now.duration_since(from).as_nanos().min(u128::from(u64::MAX)) as u64;
            tracing::debug!(peer = %t.peer, path = ?t.path, descs = t.shape.descs, bytes = t.shape.bytes,
                us = nanos / 1000, "staging: path timed");
            st.choosers.entry(t.peer).or_default().observe(t.path, t.shape, nanos);
        }
    }

    /// How transfers to a peer of geometry `caps` are cut: pieces that fit both sides' slots.
    fn geometry(&self, caps: PeerCaps) -> Cut {
        let data = self.cfg.slot_bytes.min(caps.slot_bytes);
        Cut {
            data,
            first: (data / 4).next_multiple_of(STAGE_ALIGN).min(data),
            max_entries: self.cfg.max_entries.min(caps.max_entries),
            chunk: self.cfg.max_entry_bytes,
            remote_table: caps.table_bytes,
        }
    }

    /// Whether a WRITE of `grid` to `peer` is staged, and the peer's geometry: as
    /// [`Staged::qualifies`] for its expansion, checked per row (each row's part lies in one
    /// registered region) rather than per descriptor.
    fn qualifies_grid(&self, st: &State, peer: &str, grid: &Grid) -> Option<PeerCaps> {
        let copies = grid.copies();
        if copies < self.cfg.min_descs {
            return None;
        }
        let caps = *st.peers.get(peer)?;
        let aligned = |x: u64| x.is_multiple_of(STAGE_ALIGN);
        let regions = lock(&st.regions);
        let mut last = None::<&MemRegion>;
        for g in &grid.groups {
            let cells = &grid.cells[g.cells.clone()];
            // Each source part's extent, relative to its base.
            let mut ext = [(u64::MAX, 0u64); 2];
            for c in cells {
                if !aligned(c.src_addr | c.dst_addr | c.len) || c.len == 0 || c.src_region > 1 || c.dst_region > 1 {
                    return None;
                }
                let e = &mut ext[c.src_region as usize];
                *e = (e.0.min(c.src_addr), e.1.max(c.src_addr + c.len));
            }
            for r in &grid.rows[g.rows.clone()] {
                if !aligned(r.src[0] | r.src[1] | r.dst[0] | r.dst[1]) {
                    return None;
                }
                for (p, &(lo, hi)) in ext.iter().enumerate().filter(|(_, e)| e.0 < e.1) {
                    let (addr, len) = (r.src[p].checked_add(lo)?, hi - lo);
                    if !last.is_some_and(|m| m.contains(addr, len)) {
                        last = Some(regions.find(addr, len)?);
                    }
                }
            }
        }
        (grid.bytes() / copies as u64 <= self.cfg.max_mean_desc).then_some(caps)
    }

    /// Cuts `src` into pieces that fit both sides' slots: the pieces' bounds and sizes only, by
    /// arithmetic ([`Staged::fill`] builds a piece's tables). A grid's rows that fit the current
    /// piece whole are taken in one step, so cutting costs per row, not per descriptor.
    fn cut(cut: Cut, src: &Source) -> Vec<OutPiece> {
        let mut c = Cutter::new(cut);
        match src {
            Source::Descs(descs) => descs.iter().enumerate().for_each(|(k, d)| c.desc(k, d.len)),
            Source::Grid(grid) => {
                let mut k = 0;
                for g in &grid.groups {
                    let cells = &grid.cells[g.cells.clone()];
                    let bytes: u64 = cells.iter().map(|x| x.len).sum();
                    let entries: u64 = cells.iter().map(|x| x.len.div_ceil(cut.chunk)).sum();
                    for _ in g.rows.clone() {
                        if c.fits(k, bytes, entries) {
                            c.cur.bytes += bytes;
                            c.cur.entries += entries as u32;
                            k += cells.len();
                        } else {
                            for x in cells {
                                c.desc(k, x.len);
                                k += 1;
                            }
                        }
                    }
                }
            }
        }
        c.finish()
    }

    /// Builds piece `p`'s gather entries (local addresses) and its table for the receiver (remote
    /// addresses, table form), the same entries [`Staged::cut`] counted (an entry the cut shortened
    /// at the piece's end is shortened at `p.bytes` here).
    fn fill(cut: Cut, src: &Source, p: &OutPiece, gather: &mut Vec<u8>, table: &mut Vec<u8>) {
        let want = p.entries as usize;
        gather.resize(want * ENTRY_BYTES, 0);
        table.resize(want * ENTRY_BYTES, 0);
        let (mut gs, mut ts) = (gather.chunks_exact_mut(ENTRY_BYTES), table.chunks_exact_mut(ENTRY_BYTES));
        let mut bytes = 0u64;
        // One descriptor's entries from its byte `done` on; `false` once the piece is full.
        let mut put = |local: u64, remote: u64, len: u64, mut done: u64| {
            while done < len {
                let (Some(g), Some(t)) = (gs.next(), ts.next()) else { return false };
                let n = (len - done).min(cut.chunk).min(p.bytes - bytes);
                let (off, n32) = (bytes as u32, n as u32);
                g.copy_from_slice(&StageEntry { addr: local + done, off, len: n32 }.to_bytes());
                t.copy_from_slice(&StageEntry { addr: remote + done, off, len: n32 }.to_bytes());
                bytes += n;
                done += n;
            }
            true
        };
        let mut skip = p.skip;
        match src {
            Source::Descs(descs) => {
                for d in descs.get(p.first..).unwrap_or_default() {
                    if !put(d.local, d.remote, d.len, std::mem::take(&mut skip)) {
                        return;
                    }
                }
            }
            // The grid's rows and cells directly, from the piece's first copy on.
            Source::Grid(grid) => {
                let (group, mut row, mut cell) = grid_position(grid, p.first);
                for g in grid.groups.get(group..).unwrap_or_default() {
                    let cells = &grid.cells[g.cells.clone()];
                    for r in &grid.rows[row.max(g.rows.start)..g.rows.end] {
                        for c in &cells[cell.max(g.cells.start) - g.cells.start..] {
                            let c = grid.at(r, c);
                            if !put(c.src_addr, c.dst_addr, c.len, std::mem::take(&mut skip)) {
                                return;
                            }
                        }
                        cell = 0;
                    }
                    row = 0;
                }
            }
        }
    }

    /// Starts a staged transfer of `src`: cuts it, sends the REQUEST, and keeps it for the pumps.
    fn start(
        &self,
        mut st: MutexGuard<'_, State>,
        caps: PeerCaps,
        peer: &str,
        src: Source,
        notif: Option<&[u8]>,
        started: Instant,
    ) -> Result<XferId, TransportError> {
        let mut cut = self.geometry(caps);
        if src.bytes() <= 4 * cut.data {
            // A short first piece starts the link sooner only where many full pieces follow; a small
            // transfer would just pay one more round trip.
            cut.first = cut.data;
        }
        let pieces = Self::cut(cut, &src);
        let tag = self.next.fetch_add(1, Ordering::Relaxed);
        let request = Frame::Request { tag, pieces: pieces.len() as u32, notif: notif.unwrap_or_default().to_vec() };
        self.inner.send_notification(peer, &request.encode())?;
        tracing::trace!(
            tag,
            descs = src.len(),
            pieces = pieces.len(),
            us = started.elapsed().as_micros() as u64,
            "staging: requested"
        );
        st.counts.transfers += 1;
        st.counts.grids += u64::from(matches!(src, Source::Grid(_)));
        st.counts.bytes += src.bytes();
        let now = st.now();
        st.tx.handle_post(now, tag, peer, pieces.len() as u32);
        st.out.insert(tag, Payload { src, cut, pieces });
        Ok(XferId(STAGED_BIT | tag))
    }

    // ---- Sender. ----

    /// The sender's turn: carries out what [`Sender`] decided (gathers, WRITEs, frames) and feeds
    /// it the gathers and WRITEs that ended; then forgets what it forgot.
    fn pump_out(&self, st: &mut State) -> bool {
        let now = st.now();
        st.tx.handle_turn(now);
        let any = self.step_out(st);
        self.forget_out(st);
        // Tables built ahead for pieces that will never be gathered go back to the spares.
        let State { prefilled, tx, spare, .. } = st;
        prefilled.retain_mut(|f| {
            let keep = tx.phase(f.tag) == Some(&SendPhase::Sending)
                && matches!(tx.piece(f.tag, f.piece), Some(Piece::Waiting | Piece::Granted { .. }));
            if !keep {
                spare.push((std::mem::take(&mut f.gather), std::mem::take(&mut f.table)));
            }
            keep
        });
        spare.truncate(self.cfg.slots + 1);
        if !any {
            self.prefill(st);
        }
        any
    }

    /// Builds the tables of the next piece that will need them (the first waiting for a grant or a
    /// send slot, in post order), unless `slots` pieces' tables are built already: work the writer
    /// does while it waits, so a grant finds the piece's tables ready.
    fn prefill(&self, st: &mut State) {
        if st.prefilled.len() >= self.cfg.slots {
            return;
        }
        let next =
            st.tx.upcoming().find(|&(tag, piece)| !st.prefilled.iter().any(|f| f.tag == tag && f.piece == piece));
        let Some((tag, piece)) = next else { return };
        let Some(o) = st.out.get(&tag) else { return };
        let Some(p) = o.pieces.get(piece as usize) else { return };
        let (mut gather, mut table) = st.spare.pop().unwrap_or_default();
        Self::fill(o.cut, &o.src, p, &mut gather, &mut table);
        st.prefilled.push(Prefilled { tag, piece, gather, table });
    }

    /// Carries out the sender's actions and reports the gathers and WRITEs that ended, a few rounds
    /// (a host gather is done when it returns, so its WRITE follows in the same step).
    fn step_out(&self, st: &mut State) -> bool {
        let mut any = false;
        for _ in 0..4 {
            let mut moved = self.carry_out_tx(st);
            let now = st.now();
            for lane in 0..self.cfg.slots {
                let Some(work) = st.lanes[lane] else { continue };
                let piece = st.tx.lanes()[lane].map_or(0, |(_, p)| p);
                match work {
                    LaneWork::Gather => {
                        let done = match st.stager.is_done(lane) {
                            Ok(false) => continue,
                            Ok(true) => {
                                tracing::trace!(piece, lane, "staging: gathered");
                                Ok(())
                            }
                            Err(e) => Err(format!("gather of piece {piece}: {e}")),
                        };
                        st.lanes[lane] = None;
                        st.tx.handle_gathered(now, lane, done);
                    }
                    LaneWork::Write(inner) => {
                        let done = match self.inner.poll(inner) {
                            Ok(XferState::Pending) => continue,
                            Ok(XferState::Done) => {
                                st.counts.pieces += 1;
                                tracing::trace!(piece, lane, "staging: WRITE done");
                                Ok(())
                            }
                            Err(e) => Err(format!("WRITE of piece {piece}: {e}")),
                        };
                        st.lanes[lane] = None;
                        st.tx.handle_written(now, lane, done);
                    }
                }
                moved = true;
            }
            any |= moved;
            if !moved {
                break;
            }
        }
        any
    }

    /// Forgets the sources of transfers the sender forgot.
    fn forget_out(&self, st: &mut State) {
        let State { out, tx, .. } = st;
        out.retain(|tag, _| tx.phase(*tag).is_some());
    }

    /// Carries out what the sender decided: gathers into send slots, WRITEs, frames to send.
    fn carry_out_tx(&self, st: &mut State) -> bool {
        let mut any = false;
        while let Some(a) = st.tx.poll_action() {
            any = true;
            match a {
                Action::Send { peer, frame } => self.send(&peer, &frame),
                Action::Gather { tag, piece, lane, ahead } => {
                    let started = self.start_gather(st, tag, piece, lane);
                    match started {
                        Ok(()) => {
                            st.lanes[lane] = Some(LaneWork::Gather);
                            st.counts.ahead += u64::from(ahead);
                        }
                        Err(e) => {
                            let now = st.now();
                            st.tx.handle_gathered(now, lane, Err(format!("gather of piece {piece}: {e}")));
                        }
                    }
                }
                Action::Write { peer, tag, piece, lane, slot, addr } => {
                    let Some(p) = st.out.get(&tag).and_then(|o| o.pieces.get(piece as usize).map(|p| (o.cut, *p)))
                    else {
                        let now = st.now();
                        st.tx.handle_written(now, lane, Err(format!("piece {piece} of {tag} unknown")));
                        continue;
                    };
                    let (cut, p) = p;
                    let base = self.send_slot(lane);
                    let descs = [
                        Desc { local: base, remote: addr, len: u64::from(p.entries) * ENTRY_BYTES as u64 },
                        Desc { local: base + self.cfg.table_bytes(), remote: addr + cut.remote_table, len: p.bytes },
                    ];
                    let note = Frame::Piece { tag, piece, slot, entries: p.entries, bytes: p.bytes }.encode();
                    let posting = Instant::now();
                    match self.inner.post(Op::Write, &peer, &descs, Some(&note)) {
                        Ok(inner) => {
                            st.lanes[lane] = Some(LaneWork::Write(inner));
                            let us = posting.elapsed().as_micros() as u64;
                            tracing::trace!(tag, piece, us, "staging: WRITE posted");
                        }
                        Err(e) => {
                            let now = st.now();
                            st.tx.handle_written(now, lane, Err(format!("post of piece {piece}: {e}")));
                        }
                    }
                }
            }
        }
        any
    }

    /// Fills piece `piece` of `tag`'s tables (or takes those built ahead) and starts its gather
    /// into send slot `lane`.
    fn start_gather(&self, st: &mut State, tag: u64, piece: u32, lane: usize) -> Result<(), String> {
        let base = self.send_slot(lane);
        let filling = Instant::now();
        let (gather, table) = match st.prefilled.iter().position(|f| f.tag == tag && f.piece == piece) {
            Some(k) => {
                let f = st.prefilled.swap_remove(k);
                st.counts.prefilled += 1;
                (f.gather, f.table)
            }
            None => {
                let o = st.out.get(&tag).ok_or_else(|| format!("transfer {tag} unknown"))?;
                let p = o.pieces.get(piece as usize).ok_or_else(|| format!("piece {piece} unknown"))?;
                let (mut gather, mut table) = st.spare.pop().unwrap_or_default();
                Self::fill(o.cut, &o.src, p, &mut gather, &mut table);
                (gather, table)
            }
        };
        let filled = filling.elapsed();
        // SAFETY: the send slot `lane` is free (`Sender` hands a lane out only after the gather into
        // it and the WRITE out of it ended) and lies in `send_buf`, which this wrapper owns; the
        // table fits its table area (at most max_entries entries, checked when cutting) and the data
        // its data area; the gather's sources are registered KV memory of this device (checked in
        // `qualifies`), which the engine does not write while the transfer is in flight.
        let started =
            unsafe { st.stager.gather_with_table(lane, &gather, base + self.cfg.table_bytes(), base, &table) };
        st.counts.entries += (gather.len() / ENTRY_BYTES) as u64;
        st.spare.push((gather, table));
        tracing::trace!(
            tag,
            piece,
            lane,
            fill_us = filled.as_micros() as u64,
            us = filling.elapsed().as_micros() as u64,
            ok = started.is_ok(),
            "staging: gather queued"
        );
        started.map_err(|e| e.to_string())
    }

    // ---- Receiver. ----

    fn on_receiver_frame(&self, st: &mut State, from: &str, f: Frame) {
        let now = st.now();
        match f {
            Frame::Piece { tag, piece, slot, entries, bytes } => {
                let landed = st.rx.handle_piece(now, from, PieceNote { tag, piece, slot, entries, bytes });
                if let Landed::Scatter { slot, entries, bytes } = landed {
                    let scattering = Instant::now();
                    let started = self.start_scatter(st, slot, entries, bytes);
                    let us = scattering.elapsed().as_micros() as u64;
                    tracing::trace!(tag, piece, entries, us, ok = started.is_ok(), "staging: landed, scatter queued");
                    st.rx.handle_scatter_started(now, slot, started.map_err(|why| format!("piece {piece}: {why}")));
                }
            }
            f => {
                tracing::trace!(tag = f.tag(), frame = ?std::mem::discriminant(&f), "staging: frame received");
                st.rx.handle_frame(now, from, f);
            }
        }
    }

    /// Reads piece's table from receive slot `s`, checks it, starts the scatter.
    fn start_scatter(&self, st: &mut State, s: usize, entries: u32, bytes: u64) -> Result<(), String> {
        let n = entries as usize;
        let base = self.recv_slot(s);
        let State { stager, regions, .. } = st;
        // Every entry must name an aligned range of registered KV memory and a range of the piece.
        // The stager may run the check after this returns (once its snapshot is taken): it reads
        // the regions registered then.
        let regions = Arc::clone(regions);
        let check = move |table: &[u8]| -> Result<(), BadEntry> {
            let regions = lock(&regions);
            let mut last: Option<MemRegion> = None;
            for (k, c) in table.chunks_exact(ENTRY_BYTES).enumerate() {
                let mut b = [0u8; ENTRY_BYTES];
                b.copy_from_slice(c);
                let e = StageEntry::from_bytes(&b);
                let in_data = u64::from(e.off) + u64::from(e.len) <= bytes;
                let inside = last.is_some_and(|r| r.contains(e.addr, u64::from(e.len))) || {
                    last = regions.find(e.addr, u64::from(e.len)).copied();
                    last.is_some()
                };
                if !e.aligned() || !in_data || !inside {
                    return Err(BadEntry { index: k, addr: e.addr, len: e.len, off: e.off });
                }
            }
            Ok(())
        };
        // SAFETY: the table area of receive slot `s` lies in `recv_buf` (n ≤ max_entries: the
        // receiver checked it before asking for this scatter, `Receiver::handle_piece`) and the
        // sender's WRITE into it completed before its PIECE notification was delivered; the stager
        // scatters only a snapshot `check` accepted: every destination lies in KV memory registered
        // with this transport (whose owner lets transfers write a registered request's blocks until
        // it is received), and the slot's data area holds the landed piece, not written again until
        // this scatter is done and the slot granted anew.
        unsafe { stager.scatter_table(self.cfg.slots + s, base, n, base + self.cfg.table_bytes(), Box::new(check)) }
            .map_err(|e| format!("scatter: {e}"))
    }

    /// Finished scatters and the receiver's timers; then carries out what the receiver decided.
    fn pump_in(&self, st: &mut State) -> bool {
        let mut any = false;
        let now = st.now();
        for s in 0..self.cfg.slots {
            if let Some(Slot::Scattering { .. }) = st.rx.slots().get(s) {
                let done = match st.stager.is_done(self.cfg.slots + s) {
                    Ok(false) => continue,
                    Ok(true) => Ok(()),
                    Err(e) => Err(e.to_string()),
                };
                tracing::trace!(slot = s, ok = done.is_ok(), "staging: scattered");
                st.rx.handle_scatter_done(now, s, done);
                any = true;
            }
        }
        st.rx.handle_timeout(now);
        self.carry_out_rx(st) || any
    }

    /// Carries out what the receiver decided: frames to send, notifications to deliver.
    fn carry_out_rx(&self, st: &mut State) -> bool {
        let mut any = false;
        while let Some(o) = st.rx.poll_output() {
            any = true;
            match o {
                Output::Send { peer, frame: Frame::Grant { tag, piece, slot, .. } } => {
                    tracing::trace!(tag, piece, slot, "staging: granted");
                    let addr = self.recv_slot(slot as usize);
                    self.send(&peer, &Frame::Grant { tag, piece, slot, addr });
                }
                Output::Send { peer, frame } => {
                    if let Frame::Fail { tag, detail } = &frame {
                        tracing::warn!(%peer, tag, error = %detail, "staged transfer failed on the receiver");
                    }
                    self.send(&peer, &frame);
                }
                Output::Deliver { peer, notif } => {
                    tracing::trace!(%peer, "staging: delivered");
                    st.delivered.push(Notification { from: peer, msg: notif });
                }
            }
        }
        any
    }

    /// Takes the inner transport's notifications, handles staging frames, passes the rest on.
    fn pump(&self, st: &mut State, out: &mut Vec<Notification>) -> Result<usize, TransportError> {
        let mut raw = Vec::new();
        let mut n = self.inner.take_notifications(&mut raw)?;
        for note in raw {
            match Frame::decode(&note.msg) {
                None => out.push(note),
                Some(Err(e)) => {
                    st.counts.malformed += 1;
                    tracing::warn!(peer = %note.from, error = %e, "malformed staging frame");
                }
                Some(Ok(f)) if f.to_sender() => {
                    tracing::trace!(tag = f.tag(), frame = ?std::mem::discriminant(&f), "staging: frame for the sender");
                    let now = st.now();
                    st.tx.handle_frame(now, &note.from, f);
                }
                Some(Ok(f)) => self.on_receiver_frame(st, &note.from, f),
            }
        }
        if self.pump_in(st) {
            n += 1;
        }
        if self.pump_out(st) {
            n += 1;
        }
        Ok(n)
    }
}

impl Transport for Staged {
    fn name(&self) -> &str {
        self.inner.name()
    }

    unsafe fn register(&self, region: &MemRegion) -> Result<(), TransportError> {
        // SAFETY: forwarded; the caller's contract is the inner transport's.
        unsafe { self.inner.register(region) }?;
        let regions = Arc::clone(&lock(&self.state).regions);
        lock(&regions).insert(*region);
        Ok(())
    }

    fn deregister(&self, region: &MemRegion) -> Result<(), TransportError> {
        let regions = Arc::clone(&lock(&self.state).regions);
        lock(&regions).remove(region);
        self.inner.deregister(region)
    }

    fn local_metadata(&self) -> Result<Vec<u8>, TransportError> {
        let mut md = MD_MAGIC.to_vec();
        md.extend_from_slice(&self.cfg.slot_bytes.to_le_bytes());
        md.extend_from_slice(&(self.cfg.max_entries as u32).to_le_bytes());
        md.extend_from_slice(&self.cfg.table_bytes().to_le_bytes());
        md.extend_from_slice(&self.inner.local_metadata()?);
        Ok(md)
    }

    fn load_remote(&self, metadata: &[u8]) -> Result<String, TransportError> {
        let Some(rest) = metadata.strip_prefix(&MD_MAGIC[..]) else {
            return self.inner.load_remote(metadata);
        };
        let mut r = Reader(rest);
        let (Some(slot_bytes), Some(max_entries), Some(table_bytes)) = (r.u64(), r.u32(), r.u64()) else {
            return Err(TransportError::BadMetadata("staging capabilities cut short".into()));
        };
        if (max_entries as u64) * ENTRY_BYTES as u64 > table_bytes || slot_bytes == 0 || max_entries == 0 {
            return Err(TransportError::BadMetadata(format!(
                "staging capabilities: {max_entries} entries in {table_bytes} table bytes, {slot_bytes}-byte slots"
            )));
        }
        let name = self.inner.load_remote(r.0)?;
        lock(&self.state)
            .peers
            .insert(name.clone(), PeerCaps { slot_bytes, max_entries: max_entries as usize, table_bytes });
        Ok(name)
    }

    /// The inner transport's fence. Confirmed, the peer's granted receive slots are freed when it
    /// is dropped; otherwise they are quarantined ([`StagingConfig::quarantine`]).
    fn revoke_peer(&self, peer: &str) -> Fence {
        let fence = self.inner.revoke_peer(peer);
        if fence == Fence::Confirmed {
            lock(&self.state).rx.handle_fenced(peer);
        }
        fence
    }

    fn drop_peer(&self, peer: &str) {
        {
            let mut guard = lock(&self.state);
            let st = &mut *guard;
            st.peers.remove(peer);
            st.timed.retain(|_, t| t.peer != peer);
            st.served_until.remove(peer);
            // Outgoing: fails at once (the receiver is gone). Pieces being gathered or written keep
            // their send slots until those end (the next pumps).
            let now = st.now();
            st.tx.handle_peer_lost(now, peer);
            self.carry_out_tx(st);
            // Incoming: its granted slots may still receive its WRITE unless the inner transport
            // confirmed that the peer's access is cut; then they are quarantined, not granted again
            // (issue 16, window 2). Slots being scattered free themselves when done.
            let before = st.rx.counts().slots_quarantined;
            st.rx.handle_peer_lost(now, peer);
            let quarantined = st.rx.counts().slots_quarantined - before;
            if quarantined > 0 {
                tracing::warn!(%peer, quarantined, "staging: receive slots granted to a lost, unfenced sender are quarantined");
            }
        }
        self.inner.drop_peer(peer)
    }

    fn prepare(&self, peer: Option<&str>, units: &[Units]) -> Result<(), TransportError> {
        self.inner.prepare(peer, units)
    }

    fn post(&self, op: Op, peer: &str, descs: &[Desc], notif: Option<&[u8]>) -> Result<XferId, TransportError> {
        let started = Instant::now();
        let mut st = lock(&self.state);
        // The expansion of a grid the chooser already sent direct goes direct without deciding again.
        let from_grid = st.grid_direct.take().filter(|(p, s)| p == peer && s.descs == descs.len() as u64);
        let chosen = match (from_grid, self.qualifies(&st, op, peer, descs)) {
            (Some((_, shape)), _) => Some((Path::Direct, shape, None)),
            (None, None) => None,
            (None, Some((caps, bytes))) => {
                let shape = Shape { descs: descs.len() as u64, bytes };
                Some((self.choose(&mut st, peer, shape), shape, Some(caps)))
            }
        };
        match chosen {
            Some((Path::Staged, shape, Some(caps))) => {
                let id = self.start(st, caps, peer, Source::Descs(descs.to_vec()), notif, started)?;
                self.time(&mut lock(&self.state), id, peer, Path::Staged, shape, started);
                Ok(id)
            }
            Some((_, shape, _)) => {
                st.counts.direct += 1;
                st.counts.chosen_direct += 1;
                drop(st);
                let id = self.inner.post(op, peer, descs, notif)?;
                self.time(&mut lock(&self.state), id, peer, Path::Direct, shape, started);
                Ok(id)
            }
            None => {
                st.counts.direct += 1;
                drop(st);
                self.inner.post(op, peer, descs, notif)
            }
        }
    }

    fn post_grid(&self, peer: &str, grid: &Grid, notif: Option<&[u8]>) -> Option<Result<XferId, TransportError>> {
        let started = Instant::now();
        let mut st = lock(&self.state);
        // Not qualifying as a grid: the caller posts the expansion (`post` decides again).
        let caps = self.qualifies_grid(&st, peer, grid)?;
        let shape = Shape { descs: grid.copies() as u64, bytes: grid.bytes() };
        if self.choose(&mut st, peer, shape) == Path::Direct {
            st.grid_direct = Some((peer.to_owned(), shape));
            return None;
        }
        let r = self.start(st, caps, peer, Source::Grid(grid.clone()), notif, started);
        if let Ok(id) = r {
            self.time(&mut lock(&self.state), id, peer, Path::Staged, shape, started);
        }
        Some(r)
    }

    /// Stops the incoming staged transfers whose notification `completes` the request: the
    /// receiver fails them, so no slot is granted to them and no piece of theirs is scattered any
    /// more, and their senders end them (FAIL, CANCEL, CANCELLED).
    fn stop_incoming(&self, completes: &dyn Fn(&str, &[u8]) -> bool) -> usize {
        let mut guard = lock(&self.state);
        let st = &mut *guard;
        let now = st.now();
        let n = st.rx.handle_stop(now, "the consumer stopped waiting for the request", completes);
        self.carry_out_rx(st);
        self.inner.stop_incoming(completes) + n
    }

    fn cancel(&self, id: XferId) {
        if id.0 & STAGED_BIT == 0 {
            return self.inner.cancel(id);
        }
        let mut guard = lock(&self.state);
        let st = &mut *guard;
        // The usual failure path from here: nothing more is gathered or written, the receiver is
        // told to drop what it holds (CANCEL once our WRITEs ended), then the handle fails.
        let now = st.now();
        if st.tx.handle_cancel(now, id.0 & !STAGED_BIT) {
            st.counts.cancelled += 1;
        }
        self.carry_out_tx(st);
    }

    fn poll(&self, id: XferId) -> Result<XferState, TransportError> {
        if id.0 & STAGED_BIT == 0 {
            let r = self.inner.poll(id);
            if !matches!(r, Ok(XferState::Pending)) && self.cfg.choice == PathChoice::Measured {
                self.timed_end(&mut lock(&self.state), id, matches!(r, Ok(XferState::Done)));
            }
            return r;
        }
        let tag = id.0 & !STAGED_BIT;
        let mut guard = lock(&self.state);
        let st = &mut *guard;
        if matches!(
            st.tx.phase(tag),
            Some(SendPhase::Sending | SendPhase::Failed { .. } | SendPhase::Cancelling { .. })
        ) {
            self.step_out(st);
        }
        let peer = st.tx.peer(tag).unwrap_or_default().to_owned();
        let now = st.now();
        let outcome = match st.tx.handle_report(now, tag) {
            Report::Unknown => return Err(TransportError::UnknownXfer(id)),
            Report::Pending => return Ok(XferState::Pending),
            Report::Finished(outcome) => outcome,
        };
        if st.tx.phase(tag).is_none() {
            st.out.remove(&tag);
        }
        self.timed_end(st, id, outcome.is_ok());
        match outcome {
            Ok(()) => Ok(XferState::Done),
            Err(why) => Err(failed(id, &peer, why)),
        }
    }

    fn take_notifications(&self, out: &mut Vec<Notification>) -> Result<usize, TransportError> {
        let mut st = lock(&self.state);
        let n = self.pump(&mut st, out)?;
        let delivered = st.delivered.len();
        out.append(&mut st.delivered);
        Ok(n + delivered)
    }

    fn send_notification(&self, peer: &str, msg: &[u8]) -> Result<(), TransportError> {
        self.inner.send_notification(peer, msg)
    }

    fn set_waker(&self, waker: Waker) {
        self.inner.set_waker(waker)
    }

    fn needs_polling(&self) -> bool {
        self.inner.needs_polling() || self.busy()
    }

    fn busy(&self) -> bool {
        let st = lock(&self.state);
        st.tx.busy() || st.rx.busy()
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        // The slots are freed before the stager: no copy into or out of them may still run.
        let mut st = lock(&self.state);
        let t = Instant::now();
        for lane in 0..2 * self.cfg.slots {
            while matches!(st.stager.is_done(lane), Ok(false)) && t.elapsed() < self.cfg.stall_timeout {
                std::thread::yield_now();
            }
        }
        drop(st);
        let _ = self.inner.deregister(&self.send_buf.region());
        let _ = self.inner.deregister(&self.recv_buf.region());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::host::HostDevice;
    use crate::proto::plan::{GridGroup, GridRow};
    use crate::proto::Copy;
    use crate::transport::loopback::Fabric;

    #[test]
    fn config_is_validated() {
        assert!(StagingConfig::default().validate().is_ok());
        let bad = [
            StagingConfig { slots: 0, ..StagingConfig::default() },
            StagingConfig { slot_bytes: 1000, ..StagingConfig::default() },
            StagingConfig { slot_bytes: 4096 + 8, ..StagingConfig::default() },
            StagingConfig { max_entries: 0, ..StagingConfig::default() },
            StagingConfig { max_entry_bytes: 24, ..StagingConfig::default() },
        ];
        for c in bad {
            assert!(c.validate().is_err(), "{c:?}");
        }
        let fabric = Fabric::new();
        let inner = Arc::new(fabric.endpoint("x").unwrap());
        let e = Staged::new(inner, &HostDevice::new(), bad[0]).unwrap_err();
        assert!(e.to_string().contains("staging slots 0"), "{e}");
    }

    #[test]
    fn cutting_fills_both_sides_slots_and_splits_long_descriptors() {
        let fabric = Fabric::new();
        let inner = Arc::new(fabric.endpoint("p").unwrap());
        let cfg = StagingConfig { slot_bytes: 8192, max_entries: 4, max_entry_bytes: 2048, ..StagingConfig::default() };
        let s = Staged::new(inner, &HostDevice::new(), cfg).unwrap().unwrap();
        // The peer's slots are smaller: its geometry wins.
        let cut = s.geometry(PeerCaps { slot_bytes: 4096, max_entries: 8, table_bytes: 256 });
        assert_eq!(cut, Cut { data: 4096, first: 1024, max_entries: 4, chunk: 2048, remote_table: 256 });
        let descs = [
            Desc { local: 0x10000, remote: 0x90000, len: 5120 },
            Desc { local: 0x20000, remote: 0xa0000, len: 16 },
            Desc { local: 0x30000, remote: 0xb0000, len: 1024 },
            Desc { local: 0x40000, remote: 0xc0000, len: 48 },
            Desc { local: 0x50000, remote: 0xd0000, len: 32 },
        ];
        let src = Source::Descs(descs.to_vec());
        let pieces = Staged::cut(cut, &src);
        let total: u64 = pieces.iter().map(|p| p.bytes).sum();
        assert_eq!(total, descs.iter().map(|d| d.len).sum::<u64>());
        let (mut gather, mut table) = (Vec::new(), Vec::new());
        let mut covered = Vec::new();
        for p in &pieces {
            Staged::fill(cut, &src, p, &mut gather, &mut table);
            let gather = crate::device::stage::parse_table(&gather);
            assert_eq!(gather.len(), p.entries as usize, "{p:?}");
            assert!(p.bytes <= 4096 && gather.len() <= 4, "{p:?}");
            assert!(gather.iter().all(|e| e.len <= 2048), "{p:?}");
            // Entries pack the slot densely from 0, in order, on both sides alike.
            let mut off = 0;
            for (k, e) in gather.iter().enumerate() {
                assert_eq!(e.off, off);
                let mut b = [0u8; ENTRY_BYTES];
                b.copy_from_slice(&table[k * ENTRY_BYTES..(k + 1) * ENTRY_BYTES]);
                let r = StageEntry::from_bytes(&b);
                assert_eq!((r.off, r.len), (e.off, e.len));
                assert_eq!(r.addr - e.addr, 0x80000, "the table names the remote address of the same bytes");
                off += e.len;
                covered.push((e.addr, e.len));
            }
            assert_eq!(u64::from(off), p.bytes);
        }
        // Every byte of every descriptor exactly once, in order.
        let mut expect = Vec::new();
        for d in &descs {
            let mut at = 0;
            while at < d.len {
                let n = covered.iter().find(|c| c.0 == d.local + at).map(|c| c.1).expect("covered");
                expect.push((d.local + at, n));
                at += u64::from(n);
            }
        }
        assert_eq!(covered, expect);
        // The first piece is a quarter slot (1024 of the first descriptor); 2048 + 2048 fill the second
        // piece's data; 16 + 1024 + 48 + 32 are the third's four entries.
        assert_eq!(pieces.iter().map(|p| (p.entries, p.bytes)).collect::<Vec<_>>(), [(1, 1024), (2, 4096), (4, 1120)]);
    }

    /// A grid of `groups` (cells as (src part, dst part, length in 16-byte words), rows) at made-up
    /// bases: row `r`'s source part `p` at `SRC + r * 1 MiB + p * 256 KiB`, destination likewise.
    /// A test grid's group: cells (source part, destination part, 16-byte words) and a row count.
    type TestGroup = (Vec<(u32, u32, u64)>, usize);

    fn grid_of(groups: &[TestGroup]) -> Grid {
        const SRC: u64 = 0x1000_0000;
        const DST: u64 = 0x8000_0000;
        let mut grid = Grid::default();
        for (cells, rows) in groups {
            let (c0, r0) = (grid.cells.len(), grid.rows.len());
            for (i, &(sp, dp, words)) in cells.iter().enumerate() {
                let off = i as u64 * 8192;
                let len = words * 16;
                let (src_region, dst_region) = (sp, dp);
                grid.cells.push(Copy { src_region, dst_region, src_addr: off, dst_addr: off + 16, len });
            }
            for _ in 0..*rows {
                let r = grid.rows.len() as u64;
                let at = |base: u64, p: u64| base + r * (1 << 20) + p * (256 << 10);
                grid.rows.push(GridRow {
                    src_region: 2 * r as u32,
                    dst_region: 2 * r as u32,
                    src: [at(SRC, 0), at(SRC, 1)],
                    dst: [at(DST, 0), at(DST, 1)],
                });
            }
            grid.groups.push(GridGroup { cells: c0..grid.cells.len(), rows: r0..grid.rows.len() });
        }
        grid
    }

    fn expanded(grid: &Grid) -> Vec<Desc> {
        let mut descs = Vec::new();
        grid.for_each(|c| descs.push(Desc { local: c.src_addr, remote: c.dst_addr, len: c.len }));
        descs
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]
        /// A grid is cut and filled exactly as its expansion would be: the same pieces, the same
        /// tables, byte for byte (the grid's row-at-once cutting and lazy expansion change nothing).
        #[test]
        fn grids_cut_and_fill_as_their_expansion(
            groups in proptest::collection::vec(
                (proptest::collection::vec((0u32..2, 0u32..2, 1u64..300), 0..6), 0usize..4), 1..4),
            data_words in 64u64..600,
            first_words in 1u64..600,
            max_entries in 1usize..12,
        ) {
            let grid = grid_of(&groups);
            let (data, first) = (data_words * 16, first_words.min(data_words) * 16);
            let cut = Cut { data, first, max_entries, chunk: 2048, remote_table: 4096 };
            let (g, d) = (Source::Grid(grid.clone()), Source::Descs(expanded(&grid)));
            let key = |p: &OutPiece| (p.first, p.skip, p.entries, p.bytes);
            let (pg, pd) = (Staged::cut(cut, &g), Staged::cut(cut, &d));
            proptest::prop_assert_eq!(pg.iter().map(key).collect::<Vec<_>>(), pd.iter().map(key).collect::<Vec<_>>());
            proptest::prop_assert_eq!(pg.iter().map(|p| p.bytes).sum::<u64>(), grid.bytes());
            let fit = pg.iter().enumerate().all(|(i, p)| p.bytes <= if i == 0 { first } else { data });
            proptest::prop_assert!(fit, "a piece exceeds its limit");
            proptest::prop_assert_eq!(g.len(), d.len());
            let (mut ga, mut ta, mut gb, mut tb) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for p in &pg {
                Staged::fill(cut, &g, p, &mut ga, &mut ta);
                Staged::fill(cut, &d, p, &mut gb, &mut tb);
                proptest::prop_assert_eq!(&ga, &gb);
                proptest::prop_assert_eq!(&ta, &tb);
                proptest::prop_assert_eq!(ga.len(), p.entries as usize * ENTRY_BYTES);
            }
        }
    }

    #[test]
    fn grids_qualify_only_inside_registered_memory() {
        let fabric = Fabric::new();
        let cfg = StagingConfig { slots: 1, slot_bytes: 8192, max_entries: 4, ..StagingConfig::default() };
        let a = Staged::new(Arc::new(fabric.endpoint("a").unwrap()), &HostDevice::new(), cfg).unwrap().unwrap();
        let grid = grid_of(&[(vec![(0, 0, 4), (1, 1, 4), (0, 1, 8)], 3)]);
        let caps = PeerCaps { slot_bytes: 8192, max_entries: 4, table_bytes: 256 };
        let region = |addr, len| MemRegion { addr, len, kind: crate::device::MemKind::Dram, dev_id: 0 };
        {
            let mut st = lock(&a.state);
            // No staging capabilities: not staged.
            assert!(a.qualifies_grid(&st, "b", &grid).is_none());
            st.peers.insert("b".into(), caps);
            // Not registered memory.
            assert!(a.qualifies_grid(&st, "b", &grid).is_none());
            // Rows 0 and 1 registered, row 2 not.
            lock(&st.regions).insert(region(0x1000_0000, 2 << 20));
            assert!(a.qualifies_grid(&st, "b", &grid).is_none());
            lock(&st.regions).insert(region(0x1000_0000 + (2 << 20), 1 << 20));
            assert_eq!(a.qualifies_grid(&st, "b", &grid), Some(caps));
            assert!(a.qualifies(&st, Op::Write, "b", &expanded(&grid)).is_some(), "its expansion qualifies too");
            // A misaligned cell or base disqualifies it.
            let mut odd = grid.clone();
            odd.cells[1].len += 8;
            assert!(a.qualifies_grid(&st, "b", &odd).is_none());
            let mut odd = grid.clone();
            odd.rows[2].dst[1] += 8;
            assert!(a.qualifies_grid(&st, "b", &odd).is_none());
            // One copy is not staged (min_descs).
            assert!(a.qualifies_grid(&st, "b", &grid_of(&[(vec![(0, 0, 4)], 1)])).is_none());
        }
    }

    #[test]
    fn peers_with_bad_capabilities_are_refused_and_plain_metadata_means_no_staging() {
        let fabric = Fabric::new();
        let host = HostDevice::new();
        let cfg = StagingConfig { slots: 1, slot_bytes: 8192, max_entries: 4, ..StagingConfig::default() };
        let a = Staged::new(Arc::new(fabric.endpoint("a").unwrap()), &host, cfg).unwrap().unwrap();
        let b_inner = Arc::new(fabric.endpoint("b").unwrap());
        let plain = b_inner.local_metadata().unwrap();
        let b = Staged::new(b_inner, &host, cfg).unwrap().unwrap();
        let md = b.local_metadata().unwrap();
        let cut_short = &md[..MD_MAGIC.len() + 10];
        assert!(matches!(a.load_remote(cut_short), Err(TransportError::BadMetadata(m)) if m.contains("cut short")));
        // More entries than the table area holds.
        let mut lying = md.clone();
        lying[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(a.load_remote(&lying), Err(TransportError::BadMetadata(m)) if m.contains("table bytes")));
        // A peer without staging capabilities is loaded, and never receives staged transfers.
        assert_eq!(a.load_remote(&plain).unwrap(), "b");
        let descs = [Desc { local: 0, remote: 0, len: 16 }; 2];
        assert!(a.qualifies(&lock(&a.state), Op::Write, "b", &descs).is_none());
        assert_eq!(a.load_remote(&md).unwrap(), "b");
        assert!(lock(&a.state).peers.contains_key("b"));
    }

    #[test]
    fn staging_setting_parses() {
        use crate::engine::Staging;
        assert_eq!(Staging::parse("AUTO"), Ok(Staging::Auto));
        assert_eq!(Staging::parse("off"), Ok(Staging::Off));
        assert_eq!(Staging::parse("on"), Ok(Staging::On(StagingConfig::default())));
        assert!(Staging::parse("sometimes").unwrap_err().to_string().contains("auto, on or off"));
    }
}
