//! A writer thread: owns one shard of the protocol state and drives it.
//!
//! Loop: wait for a command (or the next deadline, or — only while transfers are in flight on a
//! transport that needs polling — a backoff interval), handle every queued command, make transport
//! progress (poll in-flight transfers, take notifications), expire deadlines, then turn the state
//! machines' actions and events into posts, control frames and [`Finished`] results. It never spins:
//! with nothing in flight it sleeps on its queue until the next deadline.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant as StdInstant};

use crossbeam_channel::{Receiver, RecvTimeoutError};

use super::side::{ConnId, Incarnation};
use super::stats::TransferRecord;
use super::timeline;
use super::{
    addr_of, fan_out, idle_producer_ranks, producer_ranks, target_of, Cmd, Finished, PeerAddr, Shared, Stats, Via,
};
use crate::pool::handoff::Inbox;
use crate::proto::codec;
use crate::proto::completion::{Completions, Event, FailReason, QuarantineCause};
use crate::proto::grants::{Cause as GrantCause, Event as GrantEvent, GrantConfig, Grants};
use crate::proto::ids::Instant;
use crate::proto::layerwise::{part_layers, restrict_grid, LayerCompletion, LayerSend, LayerSet};
use crate::proto::layout::KvLayout;
use crate::proto::msg::{
    clip_block_lists, common_tokens, kernel_block_lists, Abort, Completion, Failure, FailureKind, Grant, Hold, Message,
    Mode, Registration,
};
use crate::proto::plan::{Grid, PlanInput, PlanStats, Planner};
use crate::proto::rendezvous::{Action, Order, ReleaseReason, Rendezvous, Slot, SourceBlocks};
use crate::proto::{Copy, Key, Rank};
use crate::transport::{Desc, Notification, Op, XferId, XferState};

/// Longest sleep when idle (bounds the reaction to a missed wake to this).
const IDLE_WAIT: Duration = Duration::from_millis(100);
/// First polling interval while waiting for a peer on a polled transport.
const POLL_MIN: Duration = Duration::from_micros(10);
/// How long a writer keeps polling its transport after work before it sleeps for real.
const LINGER: Duration = Duration::from_millis(2);
/// How often a lingering writer looks at its inbox and polls its transport (the engine loop does
/// not ring a lingering writer, so this bounds how long a command waits then).
const LINGER_TICK: Duration = Duration::from_micros(50);
/// Longest polling interval while only waiting for a peer's notification (a polled transport).
const POLL_WAITING_MAX: Duration = Duration::from_micros(200);
/// Longest polling interval while a request pushed layer by layer is landing here (some of its
/// layers arrived, the rest are on their way): its next notification is due within one layer's
/// compute, and the last one is on the path to the first token (issue #21: at 200 µs the wait for
/// it was a third of the time left after P's last layer).
const POLL_LANDING_MAX: Duration = Duration::from_micros(20);
/// How long shutdown waits for the transfers a writer posted to end ([`Writer::fence`]).
const SHUTDOWN_FENCE: Duration = Duration::from_secs(5);
/// Dropped requests whose producers' answers a writer waits for at most (answers that never come,
/// from a producer lost meanwhile, are forgotten past this).
const MAX_DROPPED: usize = 4096;
/// How long after its last progress a writer with transfers in flight polls back to back. A transfer
/// that has not finished by then is waiting on something else (a peer that is not scheduled, a slow
/// link): the writer then polls at growing intervals, sleeping between polls, so a stalled transfer
/// never keeps a core busy (on a small host a spinning writer can starve the very peer it waits for).
const SPIN_WINDOW: Duration = Duration::from_millis(5);

/// What a posted transfer is for.
#[derive(Debug)]
struct InFlight {
    key: Key,
    peer: PeerAddr,
    op: Op,
    posted_at: Instant,
    /// Bytes and descriptors of the plan, and the time to post it (µs), for its [`TransferRecord`].
    plan: PlanStats,
    post_us: u64,
    /// The peer was lost and the transfer cancelled: it ends as a failure, reported only when the
    /// transport says it ended (until then it may still read our sources or fill our blocks).
    lost: bool,
}

/// Producer: a request reported with [`super::Engine::layers_ready`].
#[derive(Debug)]
struct Layered {
    /// Its blocks, until they are handed to the rendezvous (layer-wise: at the first call; whole:
    /// once every layer of this worker is final).
    blocks: Option<SourceBlocks>,
    /// Layers of this worker final so far.
    final_layers: LayerSet,
    /// Pushed range by range (else whole).
    layerwise: bool,
    /// The consumer engine the router chose, until the blocks reach the rendezvous.
    consumer: Option<String>,
    /// Layer-wise pushes under way, per consumer worker.
    pushes: HashMap<PeerAddr, LayerPush>,
    /// Whole: when blocks still collecting here (their last layer never reported) are released, the
    /// producer lease counted from the first report (the rendezvous's lease starts only once they
    /// reach it).
    lease_until: Instant,
}

/// Producer: the layer-wise push of one request into one consumer worker.
#[derive(Debug)]
struct LayerPush {
    send: LayerSend,
    /// The whole request's plan, cut per range when it is posted.
    grid: Grid,
    agent: String,
}

/// Consumer, pull mode: a read waiting for grants from its producer ranks.
#[derive(Debug)]
struct PullReq {
    /// The producer's blocks, in blocks of `remote_block_tokens` tokens where that is set (the
    /// serving engine's block ids; expanded to the producer's own at its first grant).
    remote_blocks: Vec<Vec<u32>>,
    remote_block_tokens: Option<u32>,
    local_blocks: Vec<Vec<u32>>,
    num_tokens: u64,
}

pub(super) struct Writer {
    index: usize,
    shared: Arc<Shared>,
    rx: Receiver<Cmd>,
    stats: Arc<Mutex<Stats>>,
    start: StdInstant,
    rdv: Rendezvous,
    comp: Completions,
    planner: Planner,
    copies: Vec<Copy>,
    /// A push's plan in grid form (see [`Writer::post`]).
    grid: Grid,
    descs: Vec<Desc>,
    frame: Vec<u8>,
    notifs: Vec<Notification>,
    inflight: HashMap<XferId, InFlight>,
    /// Producer, pull mode: granted reads, their expiry and a lost consumer's quarantine
    /// (`proto::grants`).
    grants: Grants<PeerAddr>,
    /// Consumer, pull mode.
    pulls: HashMap<Key, PullReq>,
    /// Consumer: which producer engine each waiting request reads from (for aborts).
    producers: HashMap<Key, String>,
    /// Producer: requests reported layer by layer ([`super::Engine::layers_ready`]).
    layered: HashMap<Key, Layered>,
    /// Consumer: producer ranks told to let a request go (it was dropped before it registered, or
    /// they write nothing into this engine) that have not answered yet ([`Writer::answered_drop`]).
    dropped: HashMap<Key, Vec<Rank>>,
    /// Producer: which consumer workers registered each live request (for peer loss).
    registered_by: HashMap<Key, Vec<(PeerAddr, Option<Incarnation>)>>,
    /// Consumer: outcomes of requests whose own READ was still in flight when they ended; each goes
    /// out once its READs ended (cancelled on the way), never before (issue 16, window 4).
    owed: Vec<Finished>,
    /// Producer: consumers that gave up on a request while our WRITE into them was in flight. The
    /// WRITE's notification is their word that it ended; should it be lost, they would hold their
    /// blocks until their quarantine bound, so its end is also said on the control link.
    abort_heard: HashSet<(Key, PeerAddr)>,
    /// Consumer: quarantined requests and the producer engine that may still write into them.
    quarantined: HashMap<Key, String>,
    /// The process each peer worker was last lost as: only another process of it coming back says
    /// the lost one is gone ([`Writer::peer_added`]); the same one reconnecting says nothing.
    lost_as: HashMap<PeerAddr, Incarnation>,
    /// Whether what this shard holds quarantined changed since it was last published in its
    /// `ShardHandle::held` ([`Writer::publish_held`]).
    held_changed: bool,
    poll_interval: Duration,
    /// When this writer last did work (for lingering).
    last_active: StdInstant,
    /// Whether this thread runs `SCHED_BATCH` now ([`super::sched`]: batch while it waits for
    /// commands, the default policy while it polls the transport for its transfers).
    batch: bool,
}

/// How a writer waits for its next command ([`Writer::sleep_for_command`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Park {
    /// Asleep until a command or the timeout: the engine loop's pushes ring it.
    Parked,
    /// Right after work: a short sleep the engine loop's pushes do not interrupt (no wake-up on the
    /// engine thread); the inbox is looked at when it ends.
    Lingering,
}

/// What a writer on a polled transport waits for, most urgent first ([`polled_wait`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expecting {
    /// Transfers of its own (not cancelled for a lost peer) in flight.
    OwnTransfers,
    /// A request pushed layer by layer landing here: some of its layers arrived.
    Landing,
    /// A peer's notification, read or answer (a registered request, a cancelled transfer, a grant).
    Peer,
    /// Nothing.
    Nothing,
}

/// How long a writer on a polled transport (NIXL without a progress thread: it moves data and
/// delivers notifications only when asked) sleeps before its next poll, given the sleep its
/// deadlines allow (`wait`), whether it made progress within [`SPIN_WINDOW`] (`spinning`) and its
/// backed-off interval (`interval`, from [`POLL_MIN`] doubling up to [`POLL_WAITING_MAX`] while
/// nothing happens).
///
/// Its own transfers: back to back while they move (each poll is what moves a large transfer along;
/// measured: a 25 µs gap between polls halves the bandwidth), then at the interval. A request
/// landing layer by layer: at most [`POLL_LANDING_MAX`] (its next layer is due within a layer's
/// compute; the last one's notification is on the path to the first token). Any other peer: the
/// interval. Nothing: no poll at all, only the deadlines (idle CPU stays near zero).
fn polled_wait(wait: Duration, expecting: Expecting, spinning: bool, interval: Duration) -> Duration {
    match expecting {
        Expecting::OwnTransfers if spinning => Duration::ZERO,
        Expecting::OwnTransfers | Expecting::Peer => wait.min(interval),
        Expecting::Landing => wait.min(interval.min(POLL_LANDING_MAX)),
        Expecting::Nothing => wait,
    }
}

/// The channel from the engine loop is closed: the engine is gone and the writer stops.
#[derive(Debug)]
struct Hangup;

impl Writer {
    pub(super) fn new(index: usize, shared: Arc<Shared>, rx: Receiver<Cmd>) -> Self {
        let stats = Arc::clone(&shared.shards[index].stats);
        let rdv = Rendezvous::new(shared.config.rendezvous);
        let comp = Completions::new(shared.config.completion);
        let grants = Grants::new(grant_config(&shared.config));
        Self {
            index,
            shared,
            rx,
            stats,
            start: StdInstant::now(),
            rdv,
            comp,
            planner: Planner::new(),
            copies: Vec::new(),
            grid: Grid::default(),
            descs: Vec::new(),
            frame: Vec::new(),
            notifs: Vec::new(),
            inflight: HashMap::new(),
            grants,
            pulls: HashMap::new(),
            producers: HashMap::new(),
            layered: HashMap::new(),
            dropped: HashMap::new(),
            registered_by: HashMap::new(),
            owed: Vec::new(),
            abort_heard: HashSet::new(),
            quarantined: HashMap::new(),
            lost_as: HashMap::new(),
            held_changed: false,
            poll_interval: POLL_MIN,
            last_active: StdInstant::now(),
            batch: false,
        }
    }

    fn now(&self) -> Instant {
        Instant(self.start.elapsed().as_micros() as u64)
    }

    fn stats(&self) -> std::sync::MutexGuard<'_, Stats> {
        self.stats.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn run(mut self) {
        super::sched::fine_timer_slack();
        // A panic must not leave this shard's requests waiting forever: catch it, fail closed, and
        // keep answering the shard's commands until the engine stops. The state may be mid-update;
        // `fail_closed` reads only what the state machines still hold and decides nothing new.
        if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.serve())) {
            self.fail_closed(crate::sync::panic_message(panic.as_ref()));
        }
    }

    /// The writer's loop (see the module docs); returns when the engine stops.
    fn serve(&mut self) {
        let inbox = Arc::clone(&self.shared.shards[self.index].inbox);
        let mut commands = Vec::new();
        loop {
            let mut wait = self.next_wait();
            self.set_policy();
            // Right after work the writer lingers: it looks at its inbox and polls its transport at
            // least every LINGER_TICK (the engine loop's next call and a peer's next frame are likely
            // soon). A lingering writer does not count as parked, so the engine loop's pushes never
            // ring it: the engine loop pays no wake-up (a futex call) while its writers are busy or
            // have just been, only a command that arrives after LINGER of idleness does.
            let lingering = self.last_active.elapsed() < LINGER;
            if lingering {
                wait = wait.min(LINGER_TICK);
            }
            let first = if wait.is_zero() {
                // Our transfers are moving on a polled transport: every poll moves them along, so
                // poll back to back (yielding the core) until they finish; never when idle.
                std::thread::yield_now();
                match self.rx.try_recv() {
                    Ok(cmd) => Some(cmd),
                    Err(crossbeam_channel::TryRecvError::Empty) => None,
                    Err(crossbeam_channel::TryRecvError::Disconnected) => return,
                }
            } else {
                let park = if lingering { Park::Lingering } else { Park::Parked };
                let Ok(cmd) = self.sleep_for_command(&inbox, wait, park) else { return };
                cmd
            };
            // Awake: the engine loop's pushes no longer ring until we prepare to sleep again.
            inbox.woke();
            // Clear before looking for work: a completion after this point rings again.
            self.shared.shards[self.index].wake.clear();
            let mut progressed = false;
            commands.clear();
            inbox.drain_into(&mut commands);
            for cmd in commands.drain(..) {
                progressed = true;
                self.handle(cmd);
            }
            let mut next = first;
            let mut budget = 4096;
            while let Some(cmd) = next {
                if matches!(cmd, Cmd::Stop) {
                    self.fence();
                    self.publish_held();
                    return;
                }
                progressed |= !matches!(cmd, Cmd::Wake);
                // Keep causal order between the two queues: whatever the engine loop pushed before this
                // message was sent (say an abort, before the call that made a peer send it) is
                // handled first.
                inbox.drain_into(&mut commands);
                for c in commands.drain(..) {
                    self.handle(c);
                }
                self.handle(cmd);
                budget -= 1;
                next = if budget > 0 { self.rx.try_recv().ok() } else { None };
            }
            progressed |= self.progress();
            let now = self.now();
            self.rdv.handle_timeout(now);
            self.comp.handle_timeout(now);
            self.grants.handle_timeout(now);
            self.expire_unstarted(now);
            self.drain_grants(now);
            self.drain_outputs();
            if self.held_changed {
                self.publish_held();
            }
            self.poll_interval = if progressed { POLL_MIN } else { (self.poll_interval * 2).min(POLL_WAITING_MAX) };
            if progressed {
                self.last_active = StdInstant::now();
            }
        }
    }

    /// `SCHED_BATCH` while the writer only waits for commands (the engine loop that wakes it must not
    /// lose its core to it), the default policy while it polls the transport for a transfer of its
    /// own or a notification it expects (the poll's wake is then on a request's path: a batch thread
    /// waits for the scheduler's tick on a busy core). A system call only when that changes.
    fn set_policy(&mut self) {
        let batch = self.inflight.is_empty() && self.comp.pending() == 0;
        if batch != self.batch {
            self.batch = batch;
            if !super::sched::set_batch(batch) {
                tracing::debug!(worker = %self.shared.me, batch, "writer thread's scheduling policy not changed");
            }
        }
    }

    /// Sleeps up to `wait` for the next command on the writer's channel. Parked, the engine loop's
    /// pushes ring it, and it does not sleep at all if commands reached the inbox while it was about
    /// to (then it looks at those); lingering, the inbox is looked at when the sleep ends. `Err` when
    /// the engine loop is gone: the writer stops.
    fn sleep_for_command(&self, inbox: &Inbox<Cmd>, wait: Duration, park: Park) -> Result<Option<Cmd>, Hangup> {
        if park == Park::Parked && !inbox.prepare_sleep() {
            return Ok(None);
        }
        match self.rx.recv_timeout(wait) {
            Ok(cmd) => Ok(Some(cmd)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(Hangup),
        }
    }

    /// After a panic in [`Writer::serve`]: reports it, fails every request this shard holds, and then
    /// answers each command with a failure until the engine stops. A request with a transfer still
    /// posted gets its outcome only once the transport says that transfer ended (fail closed: its
    /// blocks are not handed back while a WRITE or READ can still touch them).
    fn fail_closed(&mut self, panic: String) {
        let me = self.shared.me.clone();
        self.stats().failures.writer_panic += 1;
        tracing::error!(worker = %me, shard = self.index, panic = %panic, "writer thread panicked: failing its requests");
        let reason = format!("{me}: writer {} panicked: {panic}", self.index);
        let mut owed: Vec<Finished> = Vec::new();
        for (key, invalid_blocks) in self.comp.held() {
            owed.push(Finished::Failed { key, reason: reason.clone(), invalid_blocks });
        }
        for key in self.rdv.held() {
            owed.push(Finished::Sent { key, reason: ReleaseReason::Failed });
        }
        // Requests reported layer by layer whose blocks never reached the rendezvous.
        for (key, l) in &self.layered {
            if l.blocks.is_some() {
                owed.push(Finished::Sent { key: *key, reason: ReleaseReason::Failed });
            }
        }
        let mut layered: HashSet<Key> = self.layered.keys().copied().collect();
        // Consumers that registered (with P's blocks or still without) are told at once rather than
        // left to their own timeout.
        let registered: Vec<Key> = self.registered_by.keys().copied().collect();
        for key in registered {
            self.tell_consumers(key, &reason);
        }
        self.pulls.clear();
        self.grants = Grants::new(grant_config(&self.shared.config));
        let inbox = Arc::clone(&self.shared.shards[self.index].inbox);
        let mut commands = Vec::new();
        loop {
            // Transfers posted before the panic: only their end frees their requests' blocks.
            let ids: Vec<XferId> = self.inflight.keys().copied().collect();
            for id in ids {
                if !matches!(self.shared.transport.poll(id), Ok(XferState::Pending)) {
                    self.inflight.remove(&id);
                }
            }
            let (ready, later): (Vec<_>, Vec<_>) =
                owed.drain(..).partition(|f| !self.inflight.values().any(|x| x.key == finished_key(f)));
            owed = later;
            for f in ready {
                match f {
                    Finished::Sent { .. } => self.stats().counters.released += 1,
                    _ => self.stats().counters.failed += 1,
                }
                self.shared.outbox.push(f);
            }
            let wait = if self.inflight.is_empty() { IDLE_WAIT } else { POLL_WAITING_MAX };
            let Ok(first) = self.sleep_for_command(&inbox, wait, Park::Parked) else { return };
            inbox.woke();
            self.shared.shards[self.index].wake.clear();
            inbox.drain_into(&mut commands);
            commands.extend(first);
            commands.extend(self.rx.try_iter());
            for cmd in commands.drain(..) {
                match cmd {
                    Cmd::Stop => {
                        self.fence();
                        self.publish_held();
                        return;
                    }
                    Cmd::BlocksReady { key, .. } => owed.push(Finished::Sent { key, reason: ReleaseReason::Failed }),
                    // Once per request: its first report holds the blocks, later ones add layers.
                    Cmd::LayersReady { key, .. } => {
                        if layered.insert(key) {
                            owed.push(Finished::Sent { key, reason: ReleaseReason::Failed });
                        }
                    }
                    Cmd::Register { key, block_ids: invalid_blocks, .. }
                    | Cmd::Pull { key, local_blocks: invalid_blocks, .. } => {
                        owed.push(Finished::Failed { key, reason: reason.clone(), invalid_blocks })
                    }
                    Cmd::Msg { from, msg: Message::Registration(r), .. } => {
                        let detail = reason.clone();
                        let f = Failure { key: r.key(), rank: me.rank, kind: FailureKind::Aborted, detail };
                        self.send_frame(&from, &Message::Failure(f));
                    }
                    // Everything this shard held was failed above; nothing else is waited for.
                    Cmd::Abort { .. }
                    | Cmd::AbortProducer { .. }
                    | Cmd::Hold { .. }
                    | Cmd::Msg { .. }
                    | Cmd::PeerLost { .. }
                    | Cmd::PeerAdded { .. }
                    | Cmd::Wake => {}
                }
            }
        }
    }

    /// Shutdown: ends every transfer this writer posted before the engine deregisters its memory
    /// (the caller may free it once `stop` returns). Each is cancelled where the transport can cut
    /// it short, then polled until it reports its end, for at most [`SHUTDOWN_FENCE`]; one still
    /// pending then is counted (`failures.shutdown_unfenced`) and logged with its request and peer.
    fn fence(&mut self) {
        if self.inflight.is_empty() {
            return;
        }
        for id in self.inflight.keys() {
            self.shared.transport.cancel(*id);
        }
        let deadline = StdInstant::now() + SHUTDOWN_FENCE;
        while !self.inflight.is_empty() && StdInstant::now() < deadline {
            let ids: Vec<XferId> = self.inflight.keys().copied().collect();
            for id in ids {
                if !matches!(self.shared.transport.poll(id), Ok(XferState::Pending)) {
                    self.inflight.remove(&id);
                }
            }
            // A staged transfer moves (and ends) only while its transport is pumped.
            self.notifs.clear();
            let _ = self.shared.transport.take_notifications(&mut self.notifs);
            if !self.inflight.is_empty() {
                std::thread::sleep(POLL_MIN);
            }
        }
        for f in self.inflight.values() {
            tracing::error!(worker = %self.shared.me, key = %f.key, peer = %f.peer, "transfer still in flight at shutdown: its memory may be touched after stop");
        }
        let left = self.inflight.len() as u64;
        self.stats().failures.shutdown_unfenced += left;
    }

    /// Publishes the requests whose blocks this shard holds quarantined (consumer: a producer lost
    /// unfenced or silent past the drain may still write into them; producer, pull: a consumer lost
    /// unfenced, or whose grant expired, may still read them) for [`super::Engine::shutdown`].
    fn publish_held(&mut self) {
        self.held_changed = false;
        let mut keys: Vec<Key> = self.quarantined.keys().copied().collect();
        keys.extend(self.grants.held_keys());
        *crate::sync::lock(&self.shared.shards[self.index].held) = keys;
    }

    /// Producer: tells every consumer worker that registered `key` that it will not arrive.
    fn tell_consumers(&mut self, key: Key, reason: &str) {
        let rank = self.shared.me.rank;
        for (peer, _) in self.registered_by.remove(&key).unwrap_or_default() {
            let f = Failure { key, rank, kind: FailureKind::Aborted, detail: reason.to_owned() };
            self.send_frame(&peer, &Message::Failure(f));
        }
    }

    /// How long to sleep: until the next deadline, capped; short while polled transfers are in flight.
    fn next_wait(&self) -> Duration {
        let now = self.now();
        let mut wait = IDLE_WAIT;
        let deadlines =
            [self.rdv.poll_timeout(), self.comp.poll_timeout(), self.grants.poll_timeout(), self.unstarted_deadline()];
        for d in deadlines.into_iter().flatten() {
            wait = wait.min(Duration::from_micros(d.micros_since(now)));
        }
        if self.shared.transport.busy() {
            // Staged pieces move only while we poll (gathers, WRITEs, scatters, grants).
            wait = if self.last_active.elapsed() < SPIN_WINDOW { Duration::ZERO } else { wait.min(self.poll_interval) };
        } else if self.shared.transport.needs_polling() {
            let expecting = if self.inflight.values().any(|f| !f.lost) {
                Expecting::OwnTransfers
            } else if self.comp.layer_keys() > 0 {
                Expecting::Landing
            } else if !self.inflight.is_empty() || self.comp.pending() > 0 || self.grants.pending() > 0 {
                Expecting::Peer
            } else {
                Expecting::Nothing
            };
            wait = polled_wait(wait, expecting, self.last_active.elapsed() < SPIN_WINDOW, self.poll_interval);
        }
        wait
    }

    fn handle(&mut self, cmd: Cmd) {
        let now = self.now();
        match cmd {
            // A request reported layer by layer and then finished as a whole: every layer is final.
            Cmd::BlocksReady { key, blocks, consumer } if self.layered.contains_key(&key) => {
                self.layers_ready(now, key, blocks, 0..u32::MAX, true, consumer)
            }
            Cmd::BlocksReady { key, blocks, consumer } => {
                self.supersede_unstarted(key);
                self.blocks_ready(now, key, blocks, consumer)
            }
            Cmd::LayersReady { key, blocks, layers, layerwise, consumer } => {
                self.layers_ready(now, key, blocks, layers, layerwise, consumer)
            }
            Cmd::Register { key, producer, block_ids, num_tokens } => {
                self.register(now, key, producer, block_ids, num_tokens)
            }
            Cmd::Pull { key, producer, remote_blocks, remote_block_tokens, local_blocks, num_tokens } => {
                let ids = local_blocks.clone();
                self.pulls.insert(key, PullReq { remote_blocks, remote_block_tokens, local_blocks, num_tokens });
                self.register(now, key, producer, ids, num_tokens);
            }
            Cmd::Abort { key } => {
                self.forget_unstarted(key);
                self.abort(now, key)
            }
            Cmd::Hold { key, producer } => {
                if let Some(any) = self.shared.any_peer_of(&producer) {
                    let msg = Message::Hold(Hold { key, rank: self.shared.me.rank });
                    for rank in producer_ranks(&any.layout, &self.shared.layout) {
                        self.send_frame(&PeerAddr { engine: producer.clone(), rank }, &msg);
                    }
                }
            }
            Cmd::AbortProducer { key, producer } => {
                if self.producers.contains_key(&key) {
                    // Registered after all (the two calls raced): the ordinary abort tells them.
                    self.abort(now, key);
                } else {
                    self.stats().counters.aborted += 1;
                    let told =
                        self.abort_producers(key, &producer, "the consumer dropped the request before allocating");
                    self.await_answers(key, told);
                }
            }
            Cmd::Msg { from, incarnation, msg, via, credit } => {
                // Taken off the queue: its room in the control budget is free again.
                drop(credit);
                self.message(now, from, incarnation, msg, via)
            }
            Cmd::PeerLost { peer, incarnation, conn, reason, fenced } => {
                self.peer_lost(now, &peer, (incarnation, conn), &reason, fenced)
            }
            Cmd::PeerAdded { peer, incarnation } => self.peer_added(&peer, incarnation),
            Cmd::Wake | Cmd::Stop => {}
        }
        self.drain_outputs();
    }

    /// Producer: prefill of `key` finished (or, layer-wise, started): its blocks go to the rendezvous.
    fn blocks_ready(&mut self, now: Instant, key: Key, blocks: SourceBlocks, consumer: Option<String>) {
        timeline::record("eng_blocks_ready", key);
        self.rdv.handle_blocks_ready_for(now, key, blocks, consumer);
        if self.feeds_no_consumer() {
            // With more TP ranks than KV heads some ranks write nothing into any known
            // consumer: release at once instead of holding the blocks for the lease.
            self.rdv.handle_abort(now, key);
        }
    }

    /// Producer: layers `layers` of `key` are final. Layer-wise, the first call hands the blocks to
    /// the rendezvous and every call posts what became final to the consumers already matched
    /// (the rest is posted when they match, in [`Writer::push`]); whole, the blocks go once every
    /// layer of this worker is final.
    fn layers_ready(
        &mut self,
        now: Instant,
        key: Key,
        blocks: SourceBlocks,
        layers: Range<u32>,
        layerwise: bool,
        consumer: Option<String>,
    ) {
        timeline::record("eng_layers_ready", key);
        self.supersede_unstarted(key);
        let mine = self.shared.layout.layer_range();
        let lease_until = Instant(now.0.saturating_add(self.shared.config.rendezvous.lease_us));
        let l = self.layered.entry(key).or_insert_with(|| Layered {
            blocks: Some(blocks),
            final_layers: LayerSet::new(mine),
            layerwise,
            consumer,
            pushes: HashMap::new(),
            lease_until,
        });
        let added = l.final_layers.insert(layers.clone());
        let start = l.blocks.is_some() && (l.layerwise || l.final_layers.is_full());
        if start {
            if let Some(b) = l.blocks.take() {
                let consumer = l.consumer.take();
                self.blocks_ready(now, key, b, consumer);
            }
            return;
        }
        if added == 0 {
            return;
        }
        let peers: Vec<PeerAddr> = l.pushes.keys().cloned().collect();
        for peer in peers {
            if let Some(p) = self.layered.get_mut(&key).and_then(|l| l.pushes.get_mut(&peer)) {
                p.send.handle_final(layers.clone());
            }
            self.post_layers(now, key, &peer);
        }
    }

    /// Producer: requests collected whole whose last layer was not reported within the lease (the
    /// serving engine lost them mid-prefill): their blocks come back, as the rendezvous's lease
    /// returns those of a request whose consumer never registered. Nothing was posted from them.
    fn expire_unstarted(&mut self, now: Instant) {
        let due: Vec<Key> =
            self.layered.iter().filter(|(_, l)| l.blocks.is_some() && l.lease_until <= now).map(|(k, _)| *k).collect();
        for key in due {
            self.layered.remove(&key);
            let mut st = self.stats();
            st.counters.released += 1;
            st.failures.lease_expired += 1;
            drop(st);
            tracing::warn!(worker = %self.shared.me, %key, "layers of a request never all reported within the lease: its blocks are released");
            self.shared.outbox.push(Finished::Sent { key, reason: ReleaseReason::LeaseExpired });
        }
    }

    /// The earliest lease of a request still collecting its layers ([`Writer::expire_unstarted`]).
    fn unstarted_deadline(&self) -> Option<Instant> {
        self.layered.values().filter(|l| l.blocks.is_some()).map(|l| l.lease_until).min()
    }

    /// Producer: a request reported whole-by-layers whose blocks never reached the rendezvous is
    /// aborted: its blocks are released here.
    fn forget_unstarted(&mut self, key: Key) {
        if self.layered.get(&key).is_some_and(|l| l.blocks.is_some()) {
            self.layered.remove(&key);
            self.stats().counters.released += 1;
            self.shared.outbox.push(Finished::Sent { key, reason: ReleaseReason::Aborted });
        }
    }

    /// Producer: an older attempt of `key`'s transfer whose blocks never reached the rendezvous
    /// (collected whole, its last layer not yet final) is superseded by `key`: its blocks come back.
    fn supersede_unstarted(&mut self, key: Key) {
        let older: Vec<Key> = self
            .layered
            .iter()
            .filter(|(k, l)| k.transfer_id == key.transfer_id && k.attempt.0 < key.attempt.0 && l.blocks.is_some())
            .map(|(k, _)| *k)
            .collect();
        for k in older {
            self.layered.remove(&k);
            self.stats().counters.released += 1;
            self.shared.outbox.push(Finished::Sent { key: k, reason: ReleaseReason::Superseded });
        }
    }

    /// Producer, layer-wise: posts the ranges of `key` final and not yet posted into `to`, one
    /// WRITE (and one Layers notification) per range.
    fn post_layers(&mut self, now: Instant, key: Key, to: &PeerAddr) {
        let Some(p) = self.layered.get_mut(&key).and_then(|l| l.pushes.get_mut(to)) else { return };
        let ranges = p.send.poll_ranges();
        let started = StdInstant::now();
        for layers in ranges {
            let Some(p) = self.layered.get(&key).and_then(|l| l.pushes.get(to)) else { return };
            if let Some(kind) = p.send.failed() {
                // An earlier range failed: this one is not posted and ends here.
                self.write_done(now, key, to.clone(), Err(kind));
                continue;
            }
            let (part, agent) = (p.send.part(), p.agent.clone());
            let stats = restrict_grid(&p.grid, &self.shared.layout, layers.clone(), &mut self.grid);
            self.descs.clear();
            let notif = Message::Layers(LayerCompletion { key, rank: self.shared.me.rank, layers, part });
            self.post(now, key, &agent, to.clone(), Op::Write, &notif, stats, started);
        }
    }

    /// Producer: a WRITE of `key` into `peer` ended (or will not be posted). A layer-wise push ends
    /// in the rendezvous only once its last range has.
    fn write_done(&mut self, now: Instant, key: Key, peer: PeerAddr, result: Result<(), FailureKind>) {
        match self.layered.get_mut(&key).and_then(|l| l.pushes.get_mut(&peer)) {
            Some(p) => {
                p.send.handle_done(result);
                self.finish_layers(now, key, &peer);
            }
            None => self.rdv.handle_transfer_done(now, key, &target_of(&peer), result),
        }
    }

    /// Producer, layer-wise: reports the push of `key` into `peer` to the rendezvous once it ended.
    fn finish_layers(&mut self, now: Instant, key: Key, peer: &PeerAddr) {
        let outcome = self.layered.get(&key).and_then(|l| l.pushes.get(peer)).and_then(|p| p.send.outcome());
        if let Some(result) = outcome {
            if let Some(l) = self.layered.get_mut(&key) {
                l.pushes.remove(peer);
            }
            self.rdv.handle_transfer_done(now, key, &target_of(peer), result);
        }
    }

    /// Producer, layer-wise: pushes whose attempt is no longer active in the rendezvous (aborted,
    /// lease expired, superseded) post nothing more, and end once their WRITEs in flight have.
    fn stop_ended_layers(&mut self, now: Instant) {
        let ended: Vec<(Key, PeerAddr)> = self
            .layered
            .iter()
            .filter(
                |(key, _)| !matches!(self.rdv.slot(key.transfer_id), Some((a, Slot::Active(_))) if a == key.attempt.0),
            )
            .flat_map(|(key, l)| l.pushes.keys().map(|p| (*key, p.clone())))
            .collect();
        for (key, peer) in ended {
            if let Some(p) = self.layered.get_mut(&key).and_then(|l| l.pushes.get_mut(&peer)) {
                p.send.stop();
            }
            self.finish_layers(now, key, &peer);
        }
    }

    /// Whether this worker is known to write into no consumer worker at all (every known peer
    /// engine gets its heads from other producer ranks). False while no peer is known.
    fn feeds_no_consumer(&self) -> bool {
        let peers = self.shared.peers.read().unwrap_or_else(|p| p.into_inner());
        !peers.by_addr.is_empty() && peers.by_addr.values().all(|p| fan_out(&self.shared.layout, &p.layout) == 0)
    }

    /// Consumer: registers `key` with every producer rank that writes into this worker.
    fn register(&mut self, now: Instant, key: Key, producer: String, block_ids: Vec<Vec<u32>>, num_tokens: u64) {
        let me = &self.shared.me;
        let fail = |this: &mut Self, reason: String, blocks: Vec<Vec<u32>>| {
            this.pulls.remove(&key);
            this.stats().counters.failed += 1;
            this.shared.outbox.push(Finished::Failed { key, reason, invalid_blocks: blocks });
        };
        let Some(any) = self.shared.any_peer_of(&producer) else {
            let reason = format!("{me}: request {key}: no handshake with producer engine {producer}");
            self.stats().failures.unknown_peer += 1;
            return fail(self, reason, block_ids);
        };
        let ranks = producer_ranks(&any.layout, &self.shared.layout);
        let mut peers = Vec::with_capacity(ranks.len());
        for rank in &ranks {
            let addr = PeerAddr { engine: producer.clone(), rank: *rank };
            match self.shared.peer_by_addr(&addr) {
                Some(p) => peers.push(p),
                None => {
                    let reason = format!("{me}: request {key}: no handshake with producer worker {addr}");
                    self.stats().failures.unknown_peer += 1;
                    return fail(self, reason, block_ids);
                }
            }
        }
        let reg = match Registration::new(
            key,
            me.engine.clone(),
            me.rank,
            num_tokens,
            block_ids.clone(),
            &self.shared.layout,
        ) {
            Ok(r) => r,
            Err(e) => return fail(self, format!("{me}: request {key}: {e}"), block_ids),
        };
        if let Err(e) = self.comp.handle_registered(now, &reg, peers.len() as u32) {
            return fail(self, format!("{me}: request {key}: {e}"), block_ids);
        }
        self.producers.insert(key, producer.clone());
        self.stats().counters.registrations += 1;
        let frame = match codec::to_vec(&Message::Registration(reg)) {
            Ok(f) => f,
            Err(e) => {
                let f = Failure { key, rank: me.rank, kind: FailureKind::PlanFailed, detail: e.to_string() };
                self.comp.handle_failure(now, &f);
                return;
            }
        };
        // Stamped as the frame is handed to the link: the side channel's I/O thread may deliver it,
        // and P read it, before `send` returns here.
        timeline::record("eng_register_sent", key);
        for p in peers {
            if let Err(e) = self.shared.link.send(&self.shared.me, &p.addr, frame.clone()) {
                self.stats().failures.link += 1;
                let detail = format!("registration to {}: {e}", p.addr);
                let f = Failure { key, rank: p.addr.rank, kind: FailureKind::PeerLost, detail };
                self.comp.handle_failure(now, &f);
            }
        }
        let told = self.release_idle_producers(key, &producer, &any.layout, "writes into no rank of this consumer");
        self.await_answers(key, told);
    }

    /// A peer worker went away: everything with it fails on this side, in time, but a block goes
    /// back to its owner only once nothing of the peer can touch it. Our own transfers with it are
    /// cancelled and fail when the transport says they ended (P's sources, D's READ targets). The
    /// peer's transfers into our memory stopped if the transport confirmed the fence (`fenced`,
    /// [`crate::transport::Transport::revoke_peer`]); otherwise the requests they could write into
    /// end now *quarantined*: reported, with their blocks held ([`Finished::Quarantined`]).
    /// `lost`: the peer's process and the connection it was known by (`None`: whichever).
    fn peer_lost(
        &mut self,
        now: Instant,
        peer: &PeerAddr,
        lost: (Option<Incarnation>, Option<ConnId>),
        reason: &str,
        fenced: bool,
    ) {
        let (incarnation, conn) = lost;
        if let Some(i) = incarnation {
            self.lost_as.insert(peer.clone(), i);
        }
        let detail = format!("peer {peer} lost: {reason}");
        // Producer side: registrations from the lost consumer, and reads it was granted.
        let keys: Vec<Key> = self
            .registered_by
            .iter()
            .filter(|(_, peers)| peers.iter().any(|(p, i)| p == peer && (incarnation.is_none() || *i == incarnation)))
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            self.rdv.handle_abort(now, key);
        }
        // (Its WRITEs in flight end as lost: no word of their end goes to it.)
        self.abort_heard.retain(|(_, p)| p != peer);
        // Its READs of our sources: fenced, they ended; otherwise they may still run, and the
        // sources stay quarantined until it returns as a new process (or the bound).
        self.grants.handle_peer_lost(now, peer, fenced);
        self.drain_grants(now);
        // Our transfers in flight with it will not complete usefully: cut them short where the
        // transport can. They stay in the table until the transport reports them ended, and only
        // then is their failure handed to the state machines (a WRITE's sources, a READ's targets
        // are not given back while the transfer may still touch them).
        for f in self.inflight.values_mut().filter(|f| &f.peer == peer && !f.lost) {
            f.lost = true;
        }
        let ids: Vec<XferId> = self.inflight.iter().filter(|(_, f)| &f.peer == peer).map(|(id, _)| *id).collect();
        for id in ids {
            self.shared.transport.cancel(id);
        }
        // Consumer side: requests that wait for parts from the lost producer's engine. Unfenced,
        // each ends now with its blocks quarantined (the outcome never waits for the lost peer).
        let waiting: Vec<Key> = self.producers.iter().filter(|(_, e)| **e == peer.engine).map(|(k, _)| *k).collect();
        for key in waiting {
            self.comp.handle_lost(now, key, peer.rank, fenced, &detail);
        }
        if self.index == 0 {
            // The peer may have come back already, as a new process or over a new connection of
            // the same one: forget only the entry that was lost. Its agent is dropped under the
            // lock, so a handshake loading the same agent again (`Shared::add_peer`) comes after.
            let mut peers = self.shared.peers.write().unwrap_or_else(|p| p.into_inner());
            let same = |p: &Arc<super::Peer>| {
                (incarnation.is_none() || p.incarnation == incarnation) && (conn.is_none() || p.conn == conn)
            };
            if let Some(old) = peers.by_addr.get(peer).filter(|p| same(p)).map(Arc::clone) {
                peers.by_addr.remove(peer);
                peers.by_agent.remove(&old.agent);
                self.shared.transport.drop_peer(&old.agent);
            }
        }
    }

    /// A peer worker was (re)added as `incarnation`: a previous process of it is gone (its kernel
    /// closed its connections and unmapped its memory), so whatever it could still have written into
    /// our quarantined blocks can no longer land.
    fn peer_added(&mut self, peer: &PeerAddr, incarnation: Option<Incarnation>) {
        let Some(new) = incarnation else {
            return; // an in-process link: nothing says an earlier process ended
        };
        if self.lost_as.get(peer) == Some(&new) {
            // The process that was lost reconnected: it is alive, and so is whatever of it could
            // still touch our memory. What is quarantined stays so.
            tracing::info!(worker = %self.shared.me, %peer, "a lost peer reconnected as the same process: its quarantine stays");
            return;
        }
        self.lost_as.remove(peer);
        let keys: Vec<Key> =
            self.quarantined.iter().filter(|(_, engine)| **engine == peer.engine).map(|(k, _)| *k).collect();
        for key in keys {
            self.comp.handle_fenced(key, peer.rank);
        }
        // Producer: a returned consumer's old READs of our sources cannot run any more.
        self.grants.handle_peer_returned(peer);
        let now = self.now();
        self.drain_grants(now);
    }

    fn abort(&mut self, now: Instant, key: Key) {
        self.stats().counters.aborted += 1;
        self.rdv.handle_abort(now, key);
        if self.comp.progress(key).is_some() {
            // The producers are told when the tracker reports the request draining (or not at all
            // when every one of them has already answered).
            self.comp.handle_abort(now, key);
        }
    }

    /// Consumer: tells every producer rank of `producer` that writes into this worker — and, from
    /// this engine's first worker, every rank that writes into none of its workers — that `key` is
    /// over here, so they release its blocks now and write nothing more into ours.
    /// Returns the ranks told.
    fn abort_producers(&mut self, key: Key, producer: &str, reason: &str) -> Vec<Rank> {
        let Some(any) = self.shared.any_peer_of(producer) else { return Vec::new() };
        let msg = Message::Abort(Abort { key, rank: self.shared.me.rank, reason: reason.into() });
        let ranks = producer_ranks(&any.layout, &self.shared.layout);
        for rank in &ranks {
            self.send_frame(&PeerAddr { engine: producer.to_owned(), rank: *rank }, &msg);
        }
        let mut told = ranks;
        told.extend(self.release_idle_producers(key, producer, &any.layout, reason));
        told
    }

    /// Consumer, on this engine's first worker (TP 0, PP 0) only: tells the ranks of `producer` that
    /// write into no worker of this engine — with more producer TP ranks than KV heads, the replicas
    /// no consumer rank reads — that `key` needs nothing from them, so they release its blocks now
    /// rather than when their lease runs out. Each answers with an `Aborted` failure
    /// ([`Writer::answered_drop`]). A rank not handshaken is skipped (its lease ends it).
    /// Returns the ranks told.
    fn release_idle_producers(&mut self, key: Key, producer: &str, layout: &KvLayout, why: &str) -> Vec<Rank> {
        if self.shared.me.rank != Rank::new(0, 0) {
            return Vec::new();
        }
        let idle = idle_producer_ranks(layout, &self.shared.layout);
        if idle.is_empty() {
            return idle;
        }
        let msg = Message::Abort(Abort { key, rank: self.shared.me.rank, reason: why.into() });
        let mut told = Vec::with_capacity(idle.len());
        for rank in idle {
            let addr = PeerAddr { engine: producer.to_owned(), rank };
            if self.shared.peer_by_addr(&addr).is_none() {
                tracing::debug!(worker = %self.shared.me, peer = %addr, %key, "idle producer rank not handshaken; its lease releases it");
                continue;
            }
            self.send_frame(&addr, &msg);
            told.push(rank);
        }
        told
    }

    /// Remembers that the producer ranks `told` owe an answer about `key` (an `Aborted` failure that
    /// must not fail the request here).
    fn await_answers(&mut self, key: Key, told: Vec<Rank>) {
        if told.is_empty() {
            return;
        }
        if self.dropped.len() >= MAX_DROPPED {
            // Answers that never came (a producer lost meanwhile): forget them.
            self.dropped.clear();
        }
        self.dropped.entry(key).or_default().extend(told);
    }

    /// Whether a failure for `key` from producer rank `rank` answers a word this worker sent it
    /// ([`Engine::abort_producer`](super::Engine::abort_producer), or a release of an idle rank):
    /// each rank told answers once.
    fn answered_drop(&mut self, key: Key, rank: Rank) -> bool {
        let Some(left) = self.dropped.get_mut(&key) else { return false };
        let Some(i) = left.iter().position(|r| *r == rank) else { return false };
        left.swap_remove(i);
        if left.is_empty() {
            self.dropped.remove(&key);
        }
        true
    }

    fn message(&mut self, now: Instant, from: PeerAddr, incarnation: Option<Incarnation>, msg: Message, via: Via) {
        let mode = self.shared.config.mode;
        // A message queued by a peer's previous process before it restarted: the engine loop's
        // commands overtake queued messages, so the restart's failure may not have been handled
        // yet, but the peers table already names the new process. Never act on it.
        if incarnation.is_some() && self.shared.peer_by_addr(&from).is_none_or(|p| p.incarnation != incarnation) {
            self.stats().failures.unknown_peer += 1;
            tracing::warn!(worker = %self.shared.me, peer = %from, "message from a previous process of the peer dropped");
            return;
        }
        match msg {
            Message::Registration(reg) => {
                timeline::record("eng_registration_recv", reg.key());
                self.stats().counters.registrations += 1;
                let Some(peer) = self.shared.peer_by_addr(&from) else {
                    self.stats().failures.unknown_peer += 1;
                    return;
                };
                if reg.engine_id() != from.engine {
                    // A worker may only register blocks of its own engine.
                    self.stats().failures.malformed += 1;
                    tracing::warn!(worker = %self.shared.me, peer = %from, claimed = reg.engine_id(), "registration for another engine refused");
                    return;
                }
                let n = fan_out(&self.shared.layout, &peer.layout);
                self.registered_by.entry(reg.key()).or_default().push((from.clone(), incarnation));
                self.rdv.handle_registration(now, reg, n);
            }
            Message::Completion(c) => {
                if self.grants.is_reading(c.key, &from) {
                    // Producer side of a pull: the consumer finished reading our blocks.
                    self.read_done(now, c.key, from, Ok(()));
                } else if mode == Mode::Pull {
                    // A producer grants a read with a Grant, never with a Completion.
                    self.stats().failures.malformed += 1;
                    tracing::warn!(worker = %self.shared.me, peer = %from, key = %c.key, "pull completion for no granted read refused");
                } else if via == Via::Data {
                    timeline::record("eng_notified", c.key);
                    self.comp.handle_completion(now, &c);
                } else {
                    // Push: a completion on the control link says nothing about the data path (the
                    // two fail separately, and a control frame may overtake a WRITE). Only the
                    // transport's notification, delivered after the data, counts.
                    self.stats().failures.malformed += 1;
                    tracing::warn!(worker = %self.shared.me, peer = %from, key = %c.key, "push completion on the control link refused");
                }
            }
            Message::Grant(g) => {
                if mode != Mode::Pull {
                    self.stats().failures.malformed += 1;
                    tracing::warn!(worker = %self.shared.me, peer = %from, key = %g.key, "grant in push mode refused");
                } else {
                    match self.granted(g.key, &from, &g.block_ids) {
                        // Consumer side of a pull: a producer rank pinned exactly the blocks we read.
                        Ok(()) => self.post_read(now, g.key, from),
                        // A grant for a read this worker no longer wants (aborted, failed or
                        // superseded before the grant came), or for other blocks than the request
                        // named (stale or forged ids): nothing is read, the producer releases now
                        // instead of at its read timeout, and the request fails.
                        Err((kind, detail)) => {
                            if kind != FailureKind::Aborted {
                                self.stats().failures.plan += 1;
                                tracing::warn!(worker = %self.shared.me, peer = %from, key = %g.key, %detail, "grant refused; nothing read");
                            }
                            let f = Failure { key: g.key, rank: self.shared.me.rank, kind, detail: detail.clone() };
                            self.send_frame(&from, &Message::Failure(f));
                            // And this producer rank has given its final word: nothing of it will land.
                            let heard = Failure { key: g.key, rank: from.rank, kind, detail };
                            self.comp.handle_failure(now, &heard);
                        }
                    }
                }
            }
            Message::Failure(f) => {
                if self.grants.is_reading(f.key, &from) {
                    self.read_done(now, f.key, from, Err(f.kind));
                } else if mode == Mode::Pull && f.kind == FailureKind::PeerLost && !self.reading_from(f.key, &from) {
                    // A producer's grant expired (`proto::grants`): it holds its sources until our
                    // READ ended. None of ours runs (it ended, and its notification may have been
                    // lost, or it never started): say so, or the producer waits for its bound.
                    let detail = "no read in flight".into();
                    let answer = Failure { key: f.key, rank: self.shared.me.rank, kind: FailureKind::Aborted, detail };
                    self.send_frame(&from, &Message::Failure(answer));
                    self.stats().failures.remote += 1;
                    self.comp.handle_failure(now, &f);
                } else if f.kind == FailureKind::Aborted && self.answered_drop(f.key, from.rank) {
                    // A producer rank's answer to `abort_producer`: nothing of ours waited for it.
                } else {
                    self.stats().failures.remote += 1;
                    self.comp.handle_failure(now, &f);
                }
            }
            Message::Abort(a) => {
                self.rdv.handle_abort(now, a.key);
                let ours: Vec<XferId> = self
                    .inflight
                    .iter()
                    .filter(|(_, f)| f.key == a.key && f.peer == from && !f.lost)
                    .map(|(id, _)| *id)
                    .collect();
                // The consumer gave up: a transfer still in flight into its blocks is cut short where
                // the transport can (its end, a failure, is then our final word sooner).
                for id in &ours {
                    self.shared.transport.cancel(*id);
                }
                let writing = !ours.is_empty();
                if writing && ours.iter().any(|id| self.inflight.get(id).is_some_and(|f| f.op == Op::Write)) {
                    self.abort_heard.insert((a.key, from.clone()));
                }
                let granted = self.grants.get(a.key, &from).is_some();
                if self.registered_by.get(&a.key).is_none_or(|peers| !peers.iter().any(|(p, _)| *p == from))
                    && !writing
                    && !granted
                {
                    // A consumer that gave up waits for each producer's final word before it reuses
                    // its blocks. Nothing of ours is (or will be) in flight into them: say so now. (A
                    // transfer still in flight answers with its own notification or failure.)
                    let f = Failure {
                        key: a.key,
                        rank: self.shared.me.rank,
                        kind: FailureKind::Aborted,
                        detail: "nothing in flight".into(),
                    };
                    self.send_frame(&from, &Message::Failure(f));
                }
                if self.comp.progress(a.key).is_some() {
                    let f = Failure { key: a.key, rank: a.rank, kind: FailureKind::Aborted, detail: a.reason };
                    self.comp.handle_failure(now, &f);
                }
            }
            Message::Layers(c) => self.layers_landed(now, &from, c, via),
            Message::Hold(h) => self.rdv.handle_hold(now, h.key),
            Message::Handshake(_) | Message::Heartbeat(_) => {}
        }
    }

    /// Consumer, layer-wise push: a producer rank's layers landed. Counted only from the data path
    /// (like a whole-request completion) and only when it names the part that rank writes here.
    fn layers_landed(&mut self, now: Instant, from: &PeerAddr, c: LayerCompletion, via: Via) {
        let part = self.shared.peer_by_addr(from).map(|p| part_layers(&p.layout, &self.shared.layout));
        if self.shared.config.mode != Mode::Push || via != Via::Data || part.as_ref() != Some(&c.part) {
            self.stats().failures.malformed += 1;
            tracing::warn!(worker = %self.shared.me, peer = %from, key = %c.key, layers = ?c.layers, part = ?c.part, "layer notification refused");
            return;
        }
        timeline::record("eng_layers_notified", c.key);
        self.comp.handle_layers(now, &c);
    }

    /// Consumer, pull mode: whether our READ of `key` from `peer` is in flight.
    fn reading_from(&self, key: Key, peer: &PeerAddr) -> bool {
        self.inflight.values().any(|x| x.key == key && x.op == Op::Read && x.peer == *peer)
    }

    /// Producer, pull mode: a granted read ended.
    fn read_done(&mut self, now: Instant, key: Key, from: PeerAddr, result: Result<(), FailureKind>) {
        if self.grants.handle_read_done(key, &from, result) {
            self.drain_grants(now);
        }
    }

    /// Producer, pull mode: grants that ended go to the rendezvous (which may release the sources).
    fn drain_grants(&mut self, now: Instant) {
        while let Some(event) = self.grants.poll_event() {
            match event {
                GrantEvent::Ended { key, consumer, result, cause } => {
                    self.held_changed = true;
                    match cause {
                        GrantCause::Expired => {
                            self.stats().failures.quarantine_expired += 1;
                            tracing::error!(worker = %self.shared.me, %key, %consumer, "sources of an expired read released by the time bound, without the consumer's word");
                        }
                        GrantCause::QuarantineExpired => {
                            self.stats().failures.quarantine_expired += 1;
                            tracing::error!(worker = %self.shared.me, %key, %consumer, "sources of a lost consumer's read released by the time bound, without a fence");
                        }
                        GrantCause::Read | GrantCause::LostFenced | GrantCause::Returned => {}
                    }
                    self.rdv.handle_transfer_done(now, key, &target_of(&consumer), result);
                }
                GrantEvent::Expired { key, consumer } => {
                    self.publish_held();
                    // The consumer fails the request and cancels its READ; the sources stay held
                    // until it says the READ ended (its notification or its failure).
                    self.stats().failures.timeout += 1;
                    let kind = FailureKind::PeerLost;
                    let detail = format!("{} reports: the read's grant expired", self.shared.me);
                    self.send_frame(
                        &consumer,
                        &Message::Failure(Failure { key, rank: self.shared.me.rank, kind, detail }),
                    );
                }
                GrantEvent::Quarantined { key, consumer } => {
                    self.publish_held();
                    self.stats().counters.quarantined += 1;
                    tracing::warn!(worker = %self.shared.me, %key, %consumer, "a lost consumer may still read: its sources stay quarantined");
                }
            }
        }
    }

    /// Polls in-flight transfers and takes notifications. Returns whether anything happened.
    fn progress(&mut self) -> bool {
        let mut any = false;
        if !self.inflight.is_empty() {
            let ids: Vec<XferId> = self.inflight.keys().copied().collect();
            for id in ids {
                let state = self.shared.transport.poll(id);
                if matches!(state, Ok(XferState::Pending)) {
                    continue;
                }
                any = true;
                let Some(f) = self.inflight.remove(&id) else { continue };
                let now = self.now();
                let transfer_us = now.micros_since(f.posted_at);
                let record = TransferRecord {
                    bytes: f.plan.bytes,
                    descriptors: f.plan.merged,
                    post_us: f.post_us,
                    transfer_us,
                    ok: state.is_ok(),
                };
                let mut st = self.stats();
                st.transfer.record(transfer_us);
                st.recent.push(record);
                drop(st);
                let result = match state {
                    // Its peer was lost: whatever the transport says, the request failed here.
                    _ if f.lost => Err(FailureKind::PeerLost),
                    Ok(_) => Ok(()),
                    Err(e) => {
                        self.stats().failures.transfer += 1;
                        tracing::warn!(worker = %self.shared.me, key = %f.key, peer = %f.peer, error = %e, "transfer failed");
                        Err(FailureKind::TransferFailed { status: e.status() })
                    }
                };
                timeline::record(if f.op == Op::Write { "eng_write_done" } else { "eng_read_done" }, f.key);
                if f.op == Op::Write && !f.lost && self.abort_heard.remove(&(f.key, f.peer.clone())) {
                    // The consumer gave up while this WRITE ran and waits for its end: the WRITE
                    // ended (the transport says so), so nothing more of it lands; say it.
                    let detail = "the write in flight at the abort ended".into();
                    let done = Failure { key: f.key, rank: self.shared.me.rank, kind: FailureKind::Aborted, detail };
                    self.send_frame(&f.peer, &Message::Failure(done));
                }
                match f.op {
                    Op::Write => self.write_done(now, f.key, f.peer, result),
                    Op::Read => self.read_finished(now, f.key, f.peer, result),
                }
            }
        }
        self.notifs.clear();
        let mut mine = Vec::new();
        {
            // Take and route as one step (see `Shared::notif_order`).
            let _order = crate::sync::lock(&self.shared.notif_order);
            if let Ok(n) = self.shared.transport.take_notifications(&mut self.notifs) {
                any |= n > 0;
            }
            let notifs = std::mem::take(&mut self.notifs);
            for n in &notifs {
                let Some(peer) = self.shared.peer_by_agent(&n.from) else {
                    self.stats().failures.unknown_peer += 1;
                    continue;
                };
                match codec::decode(&n.msg, Some(&peer.layout)) {
                    Ok(msg) => match super::message_key(&msg) {
                        Some(key) if self.shared.shard_of(key) == self.index => {
                            mine.push((peer.addr.clone(), peer.incarnation, msg))
                        }
                        Some(_) => {
                            let _ = self.shared.route_local(peer.addr.clone(), peer.incarnation, msg);
                        }
                        None => {}
                    },
                    Err(e) => {
                        self.stats().failures.malformed += 1;
                        tracing::warn!(worker = %self.shared.me, peer = %peer.addr, error = %e, "malformed notification");
                    }
                }
            }
            self.notifs = notifs;
        }
        if !mine.is_empty() {
            // What other writers took before us and routed here is older: handle it first.
            let inbox = Arc::clone(&self.shared.shards[self.index].inbox);
            let mut routed = Vec::new();
            inbox.drain_into(&mut routed);
            for cmd in routed {
                self.handle(cmd);
            }
            for (from, incarnation, msg) in mine {
                let now = self.now();
                self.message(now, from, incarnation, msg, Via::Data);
            }
        }
        any
    }

    /// Consumer, pull mode: our read of `key` from producer worker `peer` ended.
    fn read_finished(&mut self, now: Instant, key: Key, peer: PeerAddr, result: Result<(), FailureKind>) {
        match result {
            Ok(()) => self.comp.handle_completion(now, &Completion { key, rank: peer.rank }),
            Err(kind) => {
                // Tell the producer, so it releases its blocks now.
                let f = Failure { key, rank: self.shared.me.rank, kind, detail: "read failed".into() };
                self.send_frame(&peer, &Message::Failure(f));
                let f = Failure { key, rank: peer.rank, kind, detail: format!("read from {peer} failed") };
                self.comp.handle_failure(now, &f);
            }
        }
    }

    /// Consumer, pull mode: whether producer worker `from`'s grant of `key`, pinning `pinned`,
    /// names exactly the blocks the request named (in the producer's own blocks: ids the request
    /// gave in larger blocks are expanded here once, with the block size of `from`'s layout). Else
    /// the failure to report.
    fn granted(&mut self, key: Key, from: &PeerAddr, pinned: &[Vec<u32>]) -> Result<(), (FailureKind, String)> {
        let src_bt = self.shared.peer_by_addr(from).map(|p| p.layout.block_tokens);
        let Some(req) = self.pulls.get_mut(&key) else {
            return Err((FailureKind::Aborted, "read no longer wanted".into()));
        };
        let sized = req.remote_block_tokens;
        if let (Some(logical), Some(kernel)) = (sized, src_bt) {
            let blocks = kernel_block_lists(&req.remote_blocks, logical, kernel, req.num_tokens).map_err(|e| {
                (FailureKind::Refused, format!("the request's producer block ids do not map to {from}'s blocks: {e}"))
            })?;
            // Now in the producer's own blocks: expanding again (logical = kernel) changes nothing.
            (req.remote_blocks, req.remote_block_tokens) = (blocks, Some(kernel));
        }
        if req.remote_blocks == pinned {
            return Ok(());
        }
        let mut detail = String::from("the producer pinned other blocks than the request named");
        if sized.is_none() && pinned.iter().map(Vec::len).sum::<usize>() > req.remote_blocks.iter().map(Vec::len).sum()
        {
            // A producer whose serving engine splits blocks, and a request that did not say in which
            // block size it named them (a router or a consumer that drops `remote_block_size`).
            detail.push_str(
                "; it pinned more blocks than were named, and the request gave no block size for its producer \
                 block ids (remote_block_size), so they were taken as the producer's own blocks",
            );
        }
        Err((FailureKind::Refused, detail))
    }

    /// Consumer, pull mode: producer worker `from` granted the read of `key`.
    fn post_read(&mut self, now: Instant, key: Key, from: PeerAddr) {
        timeline::record("eng_grant_recv", key);
        let Some(peer) = self.shared.peer_by_addr(&from) else { return };
        let Some(req) = self.pulls.get(&key) else { return };
        // The producer's lists are whole (from token 0) and each side rounded the request up to its
        // own whole blocks: the tokens both hold move.
        let src_bt = peer.layout.block_tokens;
        let src_tokens = req.remote_blocks.iter().map(|g| g.len() as u64).max().unwrap_or(0) * u64::from(src_bt);
        let dst_bt = self.shared.layout.block_tokens;
        let n = common_tokens((src_tokens, src_bt), (req.num_tokens, dst_bt)).unwrap_or(req.num_tokens);
        let clipped;
        let (src_blocks, dst_blocks) = if n == src_tokens && n == req.num_tokens {
            (&req.remote_blocks[..], &req.local_blocks[..])
        } else {
            clipped = (
                clip_block_lists(&req.remote_blocks, src_tokens, src_bt, n),
                clip_block_lists(&req.local_blocks, req.num_tokens, dst_bt, n),
            );
            (&clipped.0[..], &clipped.1[..])
        };
        let input = PlanInput { src: &peer.layout, dst: &self.shared.layout, src_blocks, dst_blocks, num_tokens: n };
        let started = StdInstant::now();
        let planned = self.planner.plan(&input, &mut self.copies);
        let stats = match planned {
            Ok(s) => s,
            Err(e) => {
                self.stats().failures.plan += 1;
                let f = Failure { key, rank: from.rank, kind: FailureKind::PlanFailed, detail: e.to_string() };
                self.send_frame(&from, &Message::Failure(Failure { rank: self.shared.me.rank, ..f.clone() }));
                self.comp.handle_failure(now, &f);
                return;
            }
        };
        self.descs.clear();
        self.descs.extend(self.copies.iter().map(|c| Desc { local: c.dst_addr, remote: c.src_addr, len: c.len }));
        self.grid.clear();
        let notif = Message::Completion(Completion { key, rank: self.shared.me.rank });
        self.post(now, key, &peer.agent, from, Op::Read, &notif, stats, started);
    }

    /// Plans and posts a push WRITE for a matched transfer.
    fn push(&mut self, now: Instant, key: Key, reg: &Registration, blocks: &SourceBlocks) {
        let to = PeerAddr { engine: reg.engine_id().to_owned(), rank: reg.rank() };
        let Some(peer) = self.shared.peer_by_addr(&to) else {
            self.stats().failures.unknown_peer += 1;
            self.rdv.handle_transfer_done(now, key, &target_of(&to), Err(FailureKind::PeerLost));
            return;
        };
        // Registered by a previous process of the peer, which restarted since: its blocks are not
        // the new process's to write (the restart's failure may still be queued behind the engine
        // loop's command that made this match).
        let registered = self.registered_by.get(&key).and_then(|v| v.iter().find(|(p, _)| *p == to)).map(|(_, i)| *i);
        if registered.is_some_and(|i| i.is_some() && i != peer.incarnation) {
            self.stats().failures.unknown_peer += 1;
            tracing::warn!(worker = %self.shared.me, %key, peer = %to, "registration of a previous process of the peer not served");
            self.rdv.handle_transfer_done(now, key, &target_of(&to), Err(FailureKind::PeerLost));
            return;
        }
        // Each side rounded the request up to its own whole blocks: with different block sizes the
        // counts differ, and the tokens both hold move.
        let src_bt = self.shared.layout.block_tokens;
        let Some(n) = common_tokens((blocks.num_tokens, src_bt), (reg.num_tokens(), peer.layout.block_tokens)) else {
            self.stats().failures.plan += 1;
            tracing::warn!(worker = %self.shared.me, %key, peer = %to, ours = blocks.num_tokens, theirs = reg.num_tokens(), "token counts of the two sides differ");
            self.rdv.handle_transfer_done(now, key, &target_of(&to), Err(FailureKind::PlanFailed));
            return;
        };
        let clipped;
        let (src_blocks, dst_blocks) = if n == blocks.num_tokens && n == reg.num_tokens() {
            (&blocks.block_ids[..], reg.block_ids())
        } else {
            clipped = (
                clip_block_lists(&blocks.block_ids, blocks.num_tokens, src_bt, n),
                clip_block_lists(reg.block_ids(), reg.num_tokens(), peer.layout.block_tokens, n),
            );
            (&clipped.0[..], &clipped.1[..])
        };
        let input = PlanInput { src: &self.shared.layout, dst: &peer.layout, src_blocks, dst_blocks, num_tokens: n };
        let started = StdInstant::now();
        // The plan stays in grid form unless the transport wants descriptors (`post`).
        let stats = match self.planner.plan_grid(&input, &mut self.grid) {
            Ok(s) => s,
            Err(e) => {
                self.stats().failures.plan += 1;
                tracing::warn!(worker = %self.shared.me, %key, peer = %to, error = %e, "cannot plan transfer");
                self.rdv.handle_transfer_done(now, key, &target_of(&to), Err(FailureKind::PlanFailed));
                return;
            }
        };
        self.descs.clear();
        tracing::trace!(%key, descs = stats.merged, us = started.elapsed().as_micros() as u64, "push planned");
        if self.layered.get(&key).is_some_and(|l| l.layerwise) {
            // Layer-wise: what is final goes now, in one batch; the rest as it becomes final.
            self.stats().counters.descriptors_unmerged += stats.unmerged;
            let grid = std::mem::take(&mut self.grid);
            if let Some(l) = self.layered.get_mut(&key) {
                let mut send = LayerSend::new(part_layers(&self.shared.layout, &peer.layout));
                for r in l.final_layers.runs() {
                    send.handle_final(r);
                }
                l.pushes.insert(to.clone(), LayerPush { send, grid, agent: peer.agent.clone() });
            }
            self.post_layers(now, key, &to);
            return;
        }
        let notif = Message::Completion(Completion { key, rank: self.shared.me.rank });
        self.post(now, key, &peer.agent, to, Op::Write, &notif, stats, started);
    }

    /// Posts the planned transfer: `self.descs`, or (when they are empty) the grid in `self.grid`,
    /// which goes to the transport as is if it takes grids and expanded otherwise.
    #[allow(clippy::too_many_arguments)]
    fn post(
        &mut self,
        now: Instant,
        key: Key,
        agent: &str,
        peer: PeerAddr,
        op: Op,
        notif: &Message,
        plan: PlanStats,
        started: StdInstant,
    ) {
        self.frame.clear();
        if let Err(e) = codec::encode(notif, &mut self.frame) {
            tracing::error!(%key, error = %e, "cannot encode notification");
        }
        let transport = &self.shared.transport;
        let result = if self.descs.is_empty() && self.grid.copies() == 0 {
            // Nothing to move (everything cached on the consumer): just notify.
            transport.send_notification(agent, &self.frame).map(|()| None)
        } else if !self.descs.is_empty() {
            transport.post(op, agent, &self.descs, Some(&self.frame)).map(Some)
        } else if let Some(r) = transport.post_grid(agent, &self.grid, Some(&self.frame)) {
            r.map(Some)
        } else {
            let descs = &mut self.descs;
            descs.reserve(self.grid.copies());
            self.grid.for_each(|c| descs.push(Desc { local: c.src_addr, remote: c.dst_addr, len: c.len }));
            transport.post(op, agent, &self.descs, Some(&self.frame)).map(Some)
        };
        timeline::record(if op == Op::Write { "eng_write_post" } else { "eng_read_post" }, key);
        let mut st = self.stats();
        let post_us = started.elapsed().as_micros() as u64;
        st.post.record(post_us);
        match result {
            Ok(id) => {
                st.counters.posts += 1;
                st.counters.descriptors_unmerged += plan.unmerged;
                st.counters.descriptors_posted += plan.merged;
                st.counters.bytes += plan.bytes;
                drop(st);
                match id {
                    Some(id) => {
                        let f = InFlight { key, peer, op, posted_at: now, plan, post_us, lost: false };
                        self.inflight.insert(id, f);
                    }
                    None if op == Op::Write => self.write_done(now, key, peer, Ok(())),
                    None => self.read_finished(now, key, peer, Ok(())),
                }
            }
            Err(e) => {
                st.failures.post += 1;
                drop(st);
                tracing::warn!(worker = %self.shared.me, %key, %peer, error = %e, "post failed");
                let kind = FailureKind::TransferFailed { status: e.status() };
                match op {
                    Op::Write => self.write_done(now, key, peer, Err(kind)),
                    Op::Read => self.read_finished(now, key, peer, Err(kind)),
                }
            }
        }
    }

    fn send_frame(&mut self, to: &PeerAddr, msg: &Message) {
        match codec::to_vec(msg) {
            Ok(frame) => {
                if let Err(e) = self.shared.link.send(&self.shared.me, to, frame) {
                    self.stats().failures.link += 1;
                    tracing::warn!(worker = %self.shared.me, peer = %to, error = %e, "control frame not delivered");
                }
            }
            Err(e) => tracing::error!(error = %e, "cannot encode control frame"),
        }
    }

    /// Hands a consumer outcome to the owner — unless our own READ into the request's blocks is still
    /// in flight (pull: the producer's grant expired, a failure or a timeout ended the request while
    /// the READ runs). Then the READ is cancelled and the outcome waits for its end
    /// ([`Writer::pay_owed`]): the blocks go back only once nothing of ours can land in them.
    fn finish(&mut self, f: Finished) {
        let key = f.key();
        let reading: Vec<XferId> =
            self.inflight.iter().filter(|(_, x)| x.key == key && x.op == Op::Read).map(|(id, _)| *id).collect();
        if reading.is_empty() && !self.owed.iter().any(|o| o.key() == key) {
            self.shared.outbox.push(f);
            return;
        }
        for id in reading {
            self.shared.transport.cancel(id);
        }
        tracing::debug!(worker = %self.shared.me, %key, "outcome held until the request's READ ended");
        self.owed.push(f);
    }

    /// Hands out the held outcomes ([`Writer::finish`]) whose READs have ended, in order.
    fn pay_owed(&mut self) {
        if self.owed.is_empty() {
            return;
        }
        let owed = std::mem::take(&mut self.owed);
        for f in owed {
            let key = f.key();
            let blocked = self.inflight.values().any(|x| x.key == key && x.op == Op::Read)
                || self.owed.iter().any(|o| o.key() == key);
            if blocked {
                self.owed.push(f);
            } else {
                self.shared.outbox.push(f);
            }
        }
    }

    /// Turns rendezvous actions and completion events into work and results.
    fn drain_outputs(&mut self) {
        loop {
            let mut did = false;
            if !self.layered.is_empty() {
                let now = self.now();
                self.stop_ended_layers(now);
            }
            while let Some(action) = self.rdv.poll_action() {
                did = true;
                let now = self.now();
                match action {
                    Action::Transfer { key, registration, blocks, order, waited_us } => {
                        timeline::record("eng_rendezvous", key);
                        {
                            let mut st = self.stats();
                            st.counters.matches += 1;
                            match order {
                                Order::RegistrationFirst => st.wait_registration_first.record(waited_us),
                                Order::BlocksFirst => st.wait_blocks_first.record(waited_us),
                            }
                        }
                        if self.shared.config.mode == Mode::Push {
                            self.push(now, key, &registration, &blocks);
                        } else {
                            // Pull: pin the blocks for this consumer and let it read.
                            let to =
                                PeerAddr { engine: registration.engine_id().to_owned(), rank: registration.rank() };
                            self.grants.handle_granted(now, key, to.clone());
                            // The grant names the pinned blocks: D reads these or nothing.
                            let grant = Message::Grant(Grant {
                                key,
                                rank: self.shared.me.rank,
                                num_tokens: blocks.num_tokens,
                                block_ids: blocks.block_ids.clone(),
                            });
                            self.send_frame(&to, &grant);
                        }
                    }
                    Action::Release { key, reason, .. } => {
                        self.registered_by.remove(&key);
                        self.layered.remove(&key);
                        self.stats().counters.released += 1;
                        timeline::record("eng_released", key);
                        self.shared.outbox.push(Finished::Sent { key, reason });
                    }
                    Action::Fail { key, target, kind } => {
                        let addr = addr_of(&target);
                        if let Some(peers) = self.registered_by.get_mut(&key) {
                            peers.retain(|(p, _)| *p != addr);
                            if peers.is_empty() {
                                self.registered_by.remove(&key);
                            }
                        }
                        if kind == FailureKind::LeaseExpired {
                            self.stats().failures.lease_expired += 1;
                        }
                        let detail = format!("{} reports: {kind}", self.shared.me);
                        let msg = Message::Failure(Failure { key, rank: self.shared.me.rank, kind, detail });
                        self.send_frame(&addr_of(&target), &msg);
                    }
                }
            }
            while let Some(event) = self.comp.poll_event() {
                did = true;
                match event {
                    Event::Received { key, waited_us } => {
                        self.producers.remove(&key);
                        self.pulls.remove(&key);
                        let mut st = self.stats();
                        st.counters.received += 1;
                        st.receive.record(waited_us);
                        drop(st);
                        timeline::record("eng_received", key);
                        self.finish(Finished::Received { key });
                    }
                    Event::Draining { key } => {
                        // The request ended without its data while some producer ranks have not
                        // answered: they may still hold its blocks or be about to write into ours.
                        // Tell them to stop; the outcome follows once they all answered.
                        self.pulls.remove(&key);
                        if let Some(producer) = self.producers.get(&key).cloned() {
                            self.abort_producers(key, &producer, "ended on the consumer");
                        }
                    }
                    Event::Failed { key, reason, invalid_blocks } => {
                        self.producers.remove(&key);
                        self.pulls.remove(&key);
                        let text = match &reason {
                            FailReason::Producer { rank, kind, detail } => {
                                format!("producer rank {rank} reported {kind}: {detail}")
                            }
                            FailReason::Timeout { received, expected } => {
                                self.stats().failures.timeout += 1;
                                format!("timed out with {received} of {expected} parts received")
                            }
                        };
                        self.stats().counters.failed += 1;
                        let reason = format!("{}: request {key}: {text}", self.shared.me);
                        self.finish(Finished::Failed { key, reason, invalid_blocks });
                    }
                    Event::Aborted { key } | Event::Superseded { key, .. } => {
                        self.producers.remove(&key);
                        self.pulls.remove(&key);
                        self.finish(Finished::Ended { key });
                    }
                    Event::Quarantined { key, ended, blocks, why } => {
                        self.pulls.remove(&key);
                        // The producers were told to stop when it began draining (or are lost); the
                        // blocks stay held until `Released`.
                        let producer = self.producers.remove(&key).unwrap_or_default();
                        self.quarantined.insert(key, producer.clone());
                        // Published before the outcome goes out: a shutdown that follows the
                        // outcome waits for these blocks.
                        self.publish_held();
                        let failed = matches!(*ended, Event::Failed { .. });
                        let cause = match why {
                            QuarantineCause::LostUnfenced(rank) => {
                                format!("producer {producer} rank {rank} lost; its data path could not be fenced")
                            }
                            QuarantineCause::DrainTimeout => "producer ranks silent past the drain timeout".to_owned(),
                        };
                        if why == QuarantineCause::DrainTimeout {
                            // Nothing more of the silent producers is taken: staged pieces of the
                            // key still queued are neither granted nor scattered (window 3).
                            let shared = &self.shared;
                            let completes = |agent: &str, notif: &[u8]| {
                                let Some(peer) = shared.peer_by_agent(agent) else { return false };
                                codec::decode(notif, Some(&peer.layout))
                                    .is_ok_and(|m| super::message_key(&m) == Some(key))
                            };
                            let stopped = shared.transport.stop_incoming(&completes);
                            tracing::debug!(worker = %self.shared.me, %key, stopped, "incoming transfers stopped");
                        }
                        let reason = format!(
                            "{}: request {key}: {} ({cause}); its blocks stay quarantined",
                            self.shared.me,
                            if failed { "failed" } else { "ended" }
                        );
                        tracing::warn!(worker = %self.shared.me, %key, %reason, "blocks quarantined");
                        {
                            let mut st = self.stats();
                            st.counters.quarantined += 1;
                            if failed {
                                st.counters.failed += 1;
                            }
                        }
                        self.finish(Finished::Quarantined { key, failed, reason, blocks });
                    }
                    Event::Released { key, expired } => {
                        self.quarantined.remove(&key);
                        self.held_changed = true;
                        if expired {
                            self.stats().failures.quarantine_expired += 1;
                            tracing::error!(worker = %self.shared.me, %key, "quarantined blocks released by the time bound, without a fence");
                        }
                        self.finish(Finished::Released { key });
                    }
                }
            }
            if !did {
                break;
            }
        }
        self.pay_owed();
    }
}

/// The pull grants' bounds: the read timeout, and the quarantine bound consumers use too.
fn grant_config(config: &super::Config) -> GrantConfig {
    GrantConfig { read_timeout_us: config.pull_read_timeout_us, quarantine_us: config.completion.quarantine_us }
}

/// The key an outcome is for.
fn finished_key(f: &Finished) -> Key {
    f.key()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_landing_request_caps_the_poll_interval_and_nothing_expected_never_polls() {
        let backed_off = POLL_WAITING_MAX;
        let us = Duration::from_micros;
        // Layers landing: the next poll at most POLL_LANDING_MAX away, however long the backoff grew,
        // and never later than a deadline or the interval itself.
        assert_eq!(polled_wait(IDLE_WAIT, Expecting::Landing, false, backed_off), POLL_LANDING_MAX);
        assert_eq!(polled_wait(IDLE_WAIT, Expecting::Landing, false, POLL_MIN), POLL_MIN);
        assert_eq!(polled_wait(us(5), Expecting::Landing, false, backed_off), us(5));
        assert!(POLL_LANDING_MAX < POLL_WAITING_MAX);
        // Any other peer: the backed-off interval.
        assert_eq!(polled_wait(IDLE_WAIT, Expecting::Peer, false, backed_off), backed_off);
        // Own transfers: back to back while they move, then the interval.
        assert_eq!(polled_wait(IDLE_WAIT, Expecting::OwnTransfers, true, backed_off), Duration::ZERO);
        assert_eq!(polled_wait(IDLE_WAIT, Expecting::OwnTransfers, false, backed_off), backed_off);
        // Nothing expected: only the deadlines wake it (idle CPU).
        assert_eq!(polled_wait(IDLE_WAIT, Expecting::Nothing, true, POLL_MIN), IDLE_WAIT);
    }
}
