//! Producer-side rendezvous: match a consumer's registration with the end of prefill, in either order.
//!
//! [`Rendezvous`] is a deterministic state machine in the style of quinn-proto's `Connection`:
//!
//! * inputs are `handle_*` methods, each taking the current time: [`Rendezvous::handle_blocks_ready`]
//!   (prefill finished; the producer's blocks are held from now on), [`Rendezvous::handle_registration`]
//!   (a consumer rank registered its target blocks), [`Rendezvous::handle_transfer_done`] (a transfer
//!   this machine asked for finished), [`Rendezvous::handle_abort`] and [`Rendezvous::handle_timeout`];
//! * outputs are [`Action`]s drained with [`Rendezvous::poll_action`] after every input, and the next
//!   deadline from [`Rendezvous::poll_timeout`];
//! * getters ([`Rendezvous::pending`], [`Rendezvous::stats`]) never change state.
//!
//! One transfer id has at most one live attempt. Its slot is a type per state — [`Slot::AwaitingRegistration`],
//! [`Slot::AwaitingBlocks`] or [`Slot::Active`] — and a matched pair leaves the slot as an
//! [`Action::Transfer`], so "registration and blocks both waiting" cannot be written. Guarantees, for
//! any order of inputs:
//!
//! * exactly one `Transfer` per `(key, consumer rank)`;
//! * every `handle_blocks_ready` is answered by exactly one [`Action::Release`] of those blocks, and
//!   never while a transfer reading them is in flight;
//! * every registration that will not be served is answered by an [`Action::Fail`], so the consumer
//!   fails at once instead of waiting for its timeout;
//! * the number of live transfer ids never exceeds [`RendezvousConfig::max_pending`] (over it: refusal);
//! * the registrations one consumer engine has waiting for prefill never cost more than
//!   [`RendezvousConfig::max_waiting_bytes_per_engine`] (over it: that registration is refused), so
//!   one peer cannot hold the producer's memory for everyone ([`registration_cost`]), and never
//!   number more than [`RendezvousConfig::max_waiting_per_engine`], so one peer cannot take all of
//!   `max_pending`'s transfer ids either.
//! * a key is served to one consumer engine only. Until prefill finishes, registrations of one key
//!   from several engines are held side by side (at most [`RendezvousConfig::max_engines_per_key`]
//!   engines; counted in [`RendezvousStats::contended`]); when the blocks come, the consumer the
//!   producer named ([`Rendezvous::handle_blocks_ready_for`]) is served, or — named none — the
//!   engine that registered first, and every other engine is refused ([`RendezvousStats::foreign`]).
//!   Once the blocks are held with a named consumer, or a transfer started, another engine's
//!   registration is refused at once.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use super::deadlines::Deadlines;
use super::ids::{EngineId, Instant, Key, Rank, TransferId};
use super::msg::{FailureKind, Registration};

/// Limits and durations of the rendezvous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RendezvousConfig {
    /// How long the producer holds finished blocks waiting for registrations (µs).
    pub lease_us: u64,
    /// How long a registration waits for prefill to finish (µs).
    pub registration_timeout_us: u64,
    /// Most transfer ids alive at once (waiting, or with transfers in flight).
    pub max_pending: usize,
    /// How long a finished transfer id is remembered, to answer late registrations at once (µs).
    pub tombstone_us: u64,
    /// Most remembered finished transfer ids.
    pub max_tombstones: usize,
    /// Most bytes ([`registration_cost`]) of one consumer engine's registrations waiting for
    /// prefill at once.
    pub max_waiting_bytes_per_engine: usize,
    /// Most registrations of one consumer engine waiting for prefill at once (a quarter of
    /// `max_pending` by default, so one engine cannot take every transfer id).
    pub max_waiting_per_engine: usize,
    /// Most consumer engines whose registrations of one key are held until prefill finishes
    /// (another engine's registration beyond them is refused and counted as foreign).
    pub max_engines_per_key: usize,
}

impl Default for RendezvousConfig {
    fn default() -> Self {
        Self {
            lease_us: 30_000_000,
            registration_timeout_us: 120_000_000,
            max_pending: 65_536,
            tombstone_us: 60_000_000,
            max_tombstones: 65_536,
            max_waiting_bytes_per_engine: 64 << 20,
            max_waiting_per_engine: 16_384,
            max_engines_per_key: 4,
        }
    }
}

/// What a registration waiting for prefill costs the producer, in bytes: the registration, its
/// engine id and its block ids as held in memory.
pub fn registration_cost(r: &Registration) -> usize {
    let ids: usize = r.block_ids().iter().map(|g| 24 + 4 * g.len()).sum();
    std::mem::size_of::<(Registration, Instant)>() + r.engine_id().len() + ids
}

/// The producer's blocks of one request: block ids per KV group and the token count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceBlocks {
    /// Block ids per KV group (the full prompt, or its tail for window groups).
    pub block_ids: Vec<Vec<u32>>,
    /// Tokens of the prompt.
    pub num_tokens: u64,
}

/// A consumer worker: engine and rank.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Target {
    /// Consumer engine id.
    pub engine: EngineId,
    /// Consumer rank.
    pub rank: Rank,
}

/// Which event came first for a matched transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// The registration waited for prefill.
    RegistrationFirst,
    /// The blocks waited for the registration.
    BlocksFirst,
}

/// Why blocks are released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseReason {
    /// Every consumer rank received its part.
    Sent,
    /// Some transfers failed; the rest finished.
    Failed,
    /// The lease ran out before every registration came.
    LeaseExpired,
    /// Aborted locally or by the consumer.
    Aborted,
    /// A newer attempt of the same transfer id arrived.
    Superseded,
    /// The blocks were for an attempt older than the live one.
    Stale,
    /// The same key was reported ready twice; the second set is released at once.
    Duplicate,
    /// Too many transfer ids pending.
    Refused,
}

/// What the driver must do, drained with [`Rendezvous::poll_action`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Plan and post the transfer of `key` into the registered consumer rank, then call
    /// [`Rendezvous::handle_transfer_done`] with its outcome.
    Transfer {
        /// Which transfer and attempt.
        key: Key,
        /// The consumer's registration (its blocks and rank).
        registration: Registration,
        /// The producer's blocks.
        blocks: Arc<SourceBlocks>,
        /// Which side waited.
        order: Order,
        /// How long it waited (µs).
        waited_us: u64,
    },
    /// Release the producer's blocks of `key` (exactly once per `handle_blocks_ready`).
    Release {
        /// Which transfer and attempt.
        key: Key,
        /// The blocks, as given to `handle_blocks_ready`.
        blocks: Arc<SourceBlocks>,
        /// Why.
        reason: ReleaseReason,
    },
    /// Tell a consumer rank that `key` will not arrive from this producer.
    Fail {
        /// Which transfer and attempt.
        key: Key,
        /// The consumer rank to tell.
        target: Target,
        /// What went wrong.
        kind: FailureKind,
    },
}

/// Counters of the rendezvous (monotonic).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RendezvousStats {
    /// Registrations received.
    pub registrations: u64,
    /// Blocks-ready events received.
    pub blocks_ready: u64,
    /// Transfers started.
    pub matches: u64,
    /// Registrations or blocks of an older attempt.
    pub stale: u64,
    /// Repeated registrations or blocks for the same key.
    pub duplicates: u64,
    /// Live attempts replaced by a newer one.
    pub superseded: u64,
    /// Leases or registration waits that ran out.
    pub expired: u64,
    /// Aborts that found something to abort.
    pub aborted: u64,
    /// Events refused because `max_pending` was reached.
    pub refused: u64,
    /// Registrations refused because their engine's waiting registrations were at
    /// `max_waiting_bytes_per_engine`.
    pub over_budget: u64,
    /// Registrations refused because their engine already had `max_waiting_per_engine` waiting.
    pub over_count: u64,
    /// Transfers that finished with an error.
    pub transfer_failures: u64,
    /// Registrations refused because the key is another consumer engine's: the one the producer
    /// named, the one that registered first when none was named, or the one already served; or
    /// because `max_engines_per_key` engines registered the key already.
    pub foreign: u64,
    /// Leases restarted by a consumer's hold (its request still queued for blocks).
    pub held: u64,
    /// Registrations held next to another consumer engine's registration of the same key while
    /// prefill runs (one of them is an intruder or a stale router's choice).
    pub contended: u64,
}

/// A transfer id's live attempt, by state.
#[derive(Debug)]
pub enum Slot {
    /// Prefill finished; no consumer rank registered yet.
    AwaitingRegistration(AwaitingRegistration),
    /// Consumer ranks registered; prefill still running.
    AwaitingBlocks(AwaitingBlocks),
    /// Blocks held and at least one transfer started.
    Active(Active),
}

/// See [`Slot::AwaitingRegistration`].
#[derive(Debug)]
pub struct AwaitingRegistration {
    blocks: Arc<SourceBlocks>,
    ready_at: Instant,
    lease_deadline: Instant,
    /// The consumer engine the producer named: only its registrations are served.
    consumer: Option<EngineId>,
}

/// See [`Slot::AwaitingBlocks`].
#[derive(Debug)]
pub struct AwaitingBlocks {
    /// Each registration, when it came, and the fan-out of its engine's layout.
    registrations: Vec<(Registration, Instant, u16)>,
    deadline: Instant,
}

/// See [`Slot::Active`].
#[derive(Debug)]
pub struct Active {
    blocks: Arc<SourceBlocks>,
    ready_at: Instant,
    lease_deadline: Instant,
    fan_out: u16,
    started: Vec<Target>,
    in_flight: u16,
    failed: bool,
}

#[derive(Debug)]
struct Entry {
    attempt: u32,
    slot: Slot,
}

/// Blocks of an attempt that ended while transfers still read them.
#[derive(Debug)]
struct Draining {
    blocks: Arc<SourceBlocks>,
    in_flight: u16,
    reason: ReleaseReason,
    /// How late events for the key are answered while it drains (see [`Rendezvous::ended`]).
    kind: FailureKind,
    served: Vec<Target>,
}

#[derive(Clone, Debug)]
struct Tomb {
    attempt: u32,
    kind: FailureKind,
    /// Consumer ranks whose transfer was started: that transfer's outcome answers them, so a
    /// repeated registration from one of them is a duplicate, not a registration to fail.
    served: Vec<Target>,
    /// Forgotten at this time: `tombstone_us` after it was made or last answered a registration
    /// (so a repeat of that registration, arriving later, still finds it).
    until: Instant,
}

/// What one consumer engine's registrations waiting for prefill cost.
#[derive(Clone, Copy, Debug, Default)]
struct Waiting {
    bytes: usize,
    count: usize,
}

/// The producer's rendezvous of registrations and finished prefills. See the module docs.
#[derive(Debug)]
pub struct Rendezvous {
    config: RendezvousConfig,
    entries: HashMap<TransferId, Entry>,
    draining: HashMap<Key, Draining>,
    deadlines: Deadlines,
    tombs: HashMap<TransferId, Tomb>,
    tomb_order: VecDeque<(Instant, TransferId, u32)>,
    actions: VecDeque<Action>,
    stats: RendezvousStats,
    /// Registrations waiting for prefill, per consumer engine (no entry: none).
    waiting: HashMap<EngineId, Waiting>,
}

impl Rendezvous {
    /// An empty rendezvous.
    pub fn new(config: RendezvousConfig) -> Self {
        Self {
            config,
            entries: HashMap::new(),
            draining: HashMap::new(),
            deadlines: Deadlines::default(),
            tombs: HashMap::new(),
            tomb_order: VecDeque::new(),
            actions: VecDeque::new(),
            stats: RendezvousStats::default(),
            waiting: HashMap::new(),
        }
    }

    // ---- getters ----

    /// Transfer ids alive (waiting, or with transfers in flight), including drained attempts.
    pub fn pending(&self) -> usize {
        self.entries.len() + self.draining.len()
    }

    /// Counters so far.
    pub fn stats(&self) -> RendezvousStats {
        self.stats
    }

    /// The state of a transfer id's live attempt, if any.
    pub fn slot(&self, id: TransferId) -> Option<(u32, &Slot)> {
        self.entries.get(&id).map(|e| (e.attempt, &e.slot))
    }

    /// Every attempt whose source blocks are still held (waiting for a registration, with transfers
    /// started, draining, or with a release not yet polled), each once, in no particular order. A
    /// driver that can no longer run this machine (its thread panicked) releases exactly these.
    pub fn held(&self) -> Vec<Key> {
        let mut keys: Vec<Key> = self
            .entries
            .iter()
            .filter(|(_, e)| !matches!(e.slot, Slot::AwaitingBlocks(_)))
            .map(|(id, e)| Key { transfer_id: *id, attempt: super::ids::Attempt(e.attempt) })
            .chain(self.draining.keys().copied())
            .chain(self.actions.iter().filter_map(|a| match a {
                Action::Release { key, .. } => Some(*key),
                _ => None,
            }))
            .collect();
        keys.sort_unstable_by_key(|k| (k.transfer_id.0, k.attempt.0));
        keys.dedup();
        keys
    }

    // ---- outputs ----

    /// The next action to perform, in order.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// The earliest time [`Rendezvous::handle_timeout`] has something to do.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let d = self.deadlines.next();
        let t = self.tomb_order.front().map(|t| t.0);
        match (d, t) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    // ---- inputs ----

    /// Prefill of `key` finished: the producer now holds `blocks` until this machine releases them.
    /// The consumer is whichever engine registered first ([`Rendezvous::handle_blocks_ready_for`]
    /// with `None`).
    pub fn handle_blocks_ready(&mut self, now: Instant, key: Key, blocks: SourceBlocks) {
        self.handle_blocks_ready_for(now, key, blocks, None);
    }

    /// Prefill of `key` finished, for consumer engine `consumer` (the one the router chose): only
    /// that engine's registrations are served, any other engine's are refused. `None`: the engine
    /// that registered first is served.
    pub fn handle_blocks_ready_for(
        &mut self,
        now: Instant,
        key: Key,
        blocks: SourceBlocks,
        consumer: Option<EngineId>,
    ) {
        self.stats.blocks_ready += 1;
        let blocks = Arc::new(blocks);
        let (id, attempt) = (key.transfer_id, key.attempt.0);
        if !self.admit(now, key) {
            self.release(key, blocks, ReleaseReason::Stale);
            return;
        }
        if let Some((kind, _)) = self.ended(key, None) {
            // This attempt already ended (aborted, or refused); nothing can be sent any more.
            let reason = match kind {
                FailureKind::Refused => ReleaseReason::Refused,
                FailureKind::LeaseExpired => ReleaseReason::LeaseExpired,
                _ => ReleaseReason::Aborted,
            };
            self.release(key, blocks, reason);
            return;
        }
        let Some(entry) = self.entries.remove(&id) else {
            if self.pending() >= self.config.max_pending {
                self.stats.refused += 1;
                self.bury(now, key, FailureKind::Refused);
                self.release(key, blocks, ReleaseReason::Refused);
                return;
            }
            let lease_deadline = now.plus_micros(self.config.lease_us);
            self.arm(lease_deadline, key);
            let slot =
                Slot::AwaitingRegistration(AwaitingRegistration { blocks, ready_at: now, lease_deadline, consumer });
            self.entries.insert(id, Entry { attempt, slot });
            return;
        };
        let slot = match entry.slot {
            Slot::AwaitingBlocks(w) => {
                let lease_deadline = now.plus_micros(self.config.lease_us);
                // The named consumer, or else the engine that registered first.
                let chosen =
                    consumer.clone().or_else(|| w.registrations.first().map(|(r, _, _)| r.engine_id().to_owned()));
                let fan_out = w
                    .registrations
                    .iter()
                    .find(|(r, _, _)| chosen.as_deref() == Some(r.engine_id()))
                    .map_or(1, |&(_, _, f)| f);
                let mut active = Active {
                    blocks,
                    ready_at: now,
                    lease_deadline,
                    fan_out,
                    started: Vec::new(),
                    in_flight: 0,
                    failed: false,
                };
                for (reg, at, _) in w.registrations {
                    self.refund(&reg);
                    if chosen.as_deref() == Some(reg.engine_id()) {
                        self.start(key, &mut active, reg, Order::RegistrationFirst, now.micros_since(at));
                    } else {
                        self.stats.foreign += 1;
                        let target = Target { engine: reg.engine_id().to_owned(), rank: reg.rank() };
                        self.actions.push_back(Action::Fail { key, target, kind: FailureKind::Refused });
                    }
                }
                if usize::from(active.fan_out) > active.started.len() {
                    self.arm(lease_deadline, key);
                }
                if active.started.is_empty() {
                    // Only other engines registered: the named consumer may still come.
                    let Active { blocks, .. } = active;
                    Slot::AwaitingRegistration(AwaitingRegistration { blocks, ready_at: now, lease_deadline, consumer })
                } else {
                    Slot::Active(active)
                }
            }
            other => {
                // Same attempt reported ready twice: keep the first blocks, hand the second back.
                self.stats.duplicates += 1;
                self.release(key, blocks, ReleaseReason::Duplicate);
                other
            }
        };
        self.entries.insert(id, Entry { attempt, slot });
    }

    /// A consumer rank registered its blocks for `registration.key()`. `fan_out` is the number of
    /// consumer ranks this producer rank writes into for this request (from both layouts); the
    /// producer's blocks are released once all of them are served.
    pub fn handle_registration(&mut self, now: Instant, registration: Registration, fan_out: u16) {
        self.stats.registrations += 1;
        let key = registration.key();
        let target = Target { engine: registration.engine_id().to_owned(), rank: registration.rank() };
        let (id, attempt) = (key.transfer_id, key.attempt.0);
        if !self.admit(now, key) {
            self.actions.push_back(Action::Fail { key, target, kind: FailureKind::Refused });
            return;
        }
        if let Some((kind, served)) = self.ended(key, Some(&target)) {
            self.touch(now, key);
            if served {
                self.stats.duplicates += 1;
            } else {
                self.actions.push_back(Action::Fail { key, target, kind });
            }
            return;
        }
        let fan_out = fan_out.max(1);
        let Some(entry) = self.entries.remove(&id) else {
            if self.pending() >= self.config.max_pending {
                self.stats.refused += 1;
                // Remembered, so the blocks of this attempt are handed back at once when prefill
                // finishes instead of being held for the lease of a request the consumer failed.
                self.bury(now, key, FailureKind::Refused);
                self.actions.push_back(Action::Fail { key, target, kind: FailureKind::Refused });
                return;
            }
            if !self.charge(&registration) {
                // As for `max_pending`: remembered, so this attempt's blocks come back at once.
                self.bury(now, key, FailureKind::Refused);
                self.actions.push_back(Action::Fail { key, target, kind: FailureKind::Refused });
                return;
            }
            let deadline = now.plus_micros(self.config.registration_timeout_us);
            self.arm(deadline, key);
            let slot =
                Slot::AwaitingBlocks(AwaitingBlocks { registrations: vec![(registration, now, fan_out)], deadline });
            self.entries.insert(id, Entry { attempt, slot });
            return;
        };
        let slot = match entry.slot {
            Slot::AwaitingRegistration(w) if w.consumer.as_ref().is_some_and(|c| *c != target.engine) => {
                // The producer named another consumer: this engine never receives the key's KV.
                self.stats.foreign += 1;
                self.actions.push_back(Action::Fail { key, target, kind: FailureKind::Refused });
                Slot::AwaitingRegistration(w)
            }
            Slot::AwaitingRegistration(w) => {
                let mut active = Active {
                    blocks: w.blocks,
                    ready_at: w.ready_at,
                    lease_deadline: w.lease_deadline,
                    fan_out,
                    started: Vec::new(),
                    in_flight: 0,
                    failed: false,
                };
                self.start(key, &mut active, registration, Order::BlocksFirst, now.micros_since(w.ready_at));
                Slot::Active(active)
            }
            Slot::AwaitingBlocks(mut w) => {
                // Several engines' registrations wait side by side: which one the key belongs to is
                // decided when the producer's blocks (and the consumer it names) arrive, not by
                // whoever registered first (an intruder holding the secret could race the real one).
                let mut engines: Vec<&str> = w.registrations.iter().map(|(r, _, _)| r.engine_id()).collect();
                engines.sort_unstable();
                engines.dedup();
                let known = engines.contains(&target.engine.as_str());
                let ranks = w.registrations.iter().filter(|(r, _, _)| r.engine_id() == target.engine).count();
                if w.registrations.iter().any(|(r, _, _)| r.engine_id() == target.engine && r.rank() == target.rank) {
                    self.stats.duplicates += 1;
                } else if !known && engines.len() >= self.config.max_engines_per_key.max(1) {
                    self.stats.foreign += 1;
                    self.actions.push_back(Action::Fail { key, target, kind: FailureKind::Refused });
                } else if ranks >= usize::from(fan_out) || !self.charge(&registration) {
                    self.actions.push_back(Action::Fail { key, target, kind: FailureKind::Refused });
                } else {
                    if !known {
                        // Another engine's registration came first: this engine's registrations
                        // wait their own registration timeout, no longer and no shorter (see
                        // `expire_engines`).
                        self.stats.contended += 1;
                    }
                    w.registrations.push((registration, now, fan_out));
                }
                Slot::AwaitingBlocks(w)
            }
            Slot::Active(mut a) => {
                if a.started.contains(&target) {
                    self.stats.duplicates += 1;
                } else if a.started.iter().any(|t| t.engine != target.engine) {
                    self.stats.foreign += 1;
                    self.actions.push_back(Action::Fail { key, target, kind: FailureKind::Refused });
                } else if a.started.len() >= usize::from(a.fan_out) {
                    self.actions.push_back(Action::Fail { key, target, kind: FailureKind::Refused });
                } else {
                    let waited = now.micros_since(a.ready_at);
                    self.start(key, &mut a, registration, Order::BlocksFirst, waited);
                }
                Slot::Active(a)
            }
        };
        self.entries.insert(id, Entry { attempt, slot });
        self.settle(now, key);
    }

    /// A transfer started by an [`Action::Transfer`] finished (`Ok`) or failed (`Err`, with the kind
    /// to report to the consumer).
    pub fn handle_transfer_done(&mut self, now: Instant, key: Key, target: &Target, result: Result<(), FailureKind>) {
        if let Err(kind) = result {
            self.stats.transfer_failures += 1;
            self.actions.push_back(Action::Fail { key, target: target.clone(), kind });
        }
        if let Some(d) = self.draining.get_mut(&key) {
            d.in_flight = d.in_flight.saturating_sub(1);
            if d.in_flight == 0 {
                if let Some(d) = self.draining.remove(&key) {
                    self.release(key, d.blocks, d.reason);
                }
            }
            return;
        }
        if let Some(Entry { attempt, slot: Slot::Active(a) }) = self.entries.get_mut(&key.transfer_id) {
            if *attempt == key.attempt.0 && a.started.contains(target) && a.in_flight > 0 {
                a.in_flight -= 1;
                a.failed |= result.is_err();
            }
        }
        self.settle(now, key);
    }

    /// Aborts `key` in whatever state it is: held blocks are released (once no transfer reads them),
    /// waiting registrations are failed. Unknown keys are remembered so a late event is answered.
    pub fn handle_abort(&mut self, now: Instant, key: Key) {
        if !self.admit(now, key) {
            return; // stale abort: the live attempt is newer
        }
        if self.entries.get(&key.transfer_id).is_some_and(|e| e.attempt == key.attempt.0) {
            self.stats.aborted += 1;
            self.end(now, key, ReleaseReason::Aborted, FailureKind::Aborted);
        } else if self.ended(key, None).is_none() {
            // Unknown: remembered. (An attempt that already ended keeps the answer it has.)
            self.bury(now, key, FailureKind::Aborted);
        }
    }

    /// A consumer still waits for blocks for `key` (it has not registered): the lease of blocks held
    /// for it restarts at `now`. Anything else (unknown, stale, already registered) is left as is.
    pub fn handle_hold(&mut self, now: Instant, key: Key) {
        let lease_deadline = now.plus_micros(self.config.lease_us);
        let held = match self.entries.get_mut(&key.transfer_id) {
            Some(Entry { attempt, slot: Slot::AwaitingRegistration(w) }) if *attempt == key.attempt.0 => w,
            _ => return,
        };
        if lease_deadline > held.lease_deadline {
            held.lease_deadline = lease_deadline;
            self.stats.held += 1;
            self.arm(lease_deadline, key);
        }
    }

    /// Expires leases and registration waits whose deadline is at or before `now`, and forgets old
    /// tombstones.
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some((at, key)) = self.deadlines.pop_due(now) {
            let (id, attempt) = (key.transfer_id, key.attempt.0);
            let live = match self.entries.get(&id) {
                Some(Entry { attempt: a, slot }) if *a == attempt => match slot {
                    Slot::AwaitingRegistration(w) => w.lease_deadline == at,
                    Slot::AwaitingBlocks(w) => w.deadline == at,
                    Slot::Active(w) => w.lease_deadline == at && usize::from(w.fan_out) > w.started.len(),
                },
                _ => false,
            };
            if live && !self.expire_engines(now, key) {
                self.stats.expired += 1;
                self.end(now, key, ReleaseReason::LeaseExpired, FailureKind::LeaseExpired);
            }
        }
        while let Some(&(at, id, attempt)) = self.tomb_order.front() {
            if at > now && self.tomb_order.len() <= self.config.max_tombstones {
                break;
            }
            self.tomb_order.pop_front();
            self.forget(at, id, attempt);
        }
    }

    // ---- internals ----

    /// Decides what an event for `key` means for the live attempt of its transfer id: `false` if it
    /// is stale (an older attempt); a newer attempt ends the live one first.
    fn admit(&mut self, now: Instant, key: Key) -> bool {
        let id = key.transfer_id;
        let live = self.entries.get(&id).map(|e| e.attempt).or_else(|| self.tombs.get(&id).map(|t| t.attempt));
        match live {
            Some(a) if a > key.attempt.0 => {
                self.stats.stale += 1;
                false
            }
            Some(a) if a < key.attempt.0 => {
                if self.entries.get(&id).is_some_and(|e| e.attempt == a) {
                    self.stats.superseded += 1;
                    let old = Key { transfer_id: id, attempt: super::ids::Attempt(a) };
                    self.end(now, old, ReleaseReason::Superseded, FailureKind::Refused);
                }
                self.tombs.remove(&id);
                true
            }
            _ => true,
        }
    }

    /// How an attempt that already ended answers a late event: the failure kind to report, and
    /// whether `target` was served (its transfer started, so its outcome is the answer). Its
    /// tombstone says, or — while its transfers still run, however old it is — its draining
    /// blocks, so a key is never live and draining at once.
    fn ended(&self, key: Key, target: Option<&Target>) -> Option<(FailureKind, bool)> {
        let served = |s: &[Target]| target.is_some_and(|t| s.contains(t));
        if let Some(t) = self.tombs.get(&key.transfer_id).filter(|t| t.attempt == key.attempt.0) {
            return Some((t.kind, served(&t.served)));
        }
        self.draining.get(&key).map(|d| (d.kind, served(&d.served)))
    }

    /// Registrations of several engines wait for `key`'s prefill and the deadline passed: each engine's
    /// registrations expire at its first registration's timeout, so one engine (an intruder) can make
    /// another wait neither longer nor shorter than its own timeout. Fails the engines that are due
    /// and re-arms for the rest; `false` (nothing changed) when every engine is due (the attempt
    /// ends) or `key` is not waiting for blocks.
    fn expire_engines(&mut self, now: Instant, key: Key) -> bool {
        let timeout = self.config.registration_timeout_us;
        if !matches!(self.entries.get(&key.transfer_id), Some(Entry { slot: Slot::AwaitingBlocks(_), .. })) {
            return false;
        }
        let Some(Entry { attempt, slot: Slot::AwaitingBlocks(mut w) }) = self.entries.remove(&key.transfer_id) else {
            return false; // just checked
        };
        let mut firsts: HashMap<&str, Instant> = HashMap::new();
        for (r, at, _) in &w.registrations {
            firsts.entry(r.engine_id()).or_insert(*at);
        }
        let due: Vec<String> =
            firsts.iter().filter(|(_, at)| at.plus_micros(timeout) <= now).map(|(e, _)| (*e).to_owned()).collect();
        let next = firsts.values().map(|at| at.plus_micros(timeout)).filter(|d| *d > now).min();
        let Some(next) = next.filter(|_| due.len() < firsts.len()) else {
            self.entries.insert(key.transfer_id, Entry { attempt, slot: Slot::AwaitingBlocks(w) });
            return false;
        };
        let (gone, kept): (Vec<_>, Vec<_>) =
            w.registrations.into_iter().partition(|(r, _, _)| due.iter().any(|e| e == r.engine_id()));
        for (r, _, _) in gone {
            self.refund(&r);
            self.stats.expired += 1;
            let target = Target { engine: r.engine_id().to_owned(), rank: r.rank() };
            self.actions.push_back(Action::Fail { key, target, kind: FailureKind::LeaseExpired });
        }
        w.registrations = kept;
        w.deadline = next;
        self.arm(next, key);
        self.entries.insert(key.transfer_id, Entry { attempt, slot: Slot::AwaitingBlocks(w) });
        true
    }

    /// Charges `r` to its engine's waiting registrations; `false` (counted, nothing charged) past the
    /// engine's byte or count budget.
    fn charge(&mut self, r: &Registration) -> bool {
        let cost = registration_cost(r);
        let held = self.waiting.get(r.engine_id()).copied().unwrap_or_default();
        if held.count >= self.config.max_waiting_per_engine {
            self.stats.over_count += 1;
            return false;
        }
        if held.bytes.saturating_add(cost) > self.config.max_waiting_bytes_per_engine {
            self.stats.over_budget += 1;
            return false;
        }
        let w = self.waiting.entry(r.engine_id().to_owned()).or_default();
        w.bytes += cost;
        w.count += 1;
        true
    }

    /// Gives back what [`Rendezvous::charge`] took for `r` (it stopped waiting).
    fn refund(&mut self, r: &Registration) {
        let cost = registration_cost(r);
        if let Some(held) = self.waiting.get_mut(r.engine_id()) {
            held.bytes = held.bytes.saturating_sub(cost);
            held.count = held.count.saturating_sub(1);
            if held.count == 0 {
                self.waiting.remove(r.engine_id());
            }
        }
    }

    /// Bytes of `engine`'s registrations waiting for prefill.
    pub fn waiting_bytes(&self, engine: &str) -> usize {
        self.waiting.get(engine).map_or(0, |w| w.bytes)
    }

    /// How many of `engine`'s registrations wait for prefill.
    pub fn waiting_count(&self, engine: &str) -> usize {
        self.waiting.get(engine).map_or(0, |w| w.count)
    }

    /// Ends the live attempt `key`: fails registrations still waiting, releases blocks (or hands
    /// them to `draining` while transfers read them), and remembers the outcome.
    fn end(&mut self, now: Instant, key: Key, reason: ReleaseReason, kind: FailureKind) {
        let Some(entry) = self.entries.remove(&key.transfer_id) else { return };
        let mut served = Vec::new();
        match entry.slot {
            Slot::AwaitingRegistration(w) => self.release(key, w.blocks, reason),
            Slot::AwaitingBlocks(w) => {
                for (r, _, _) in w.registrations {
                    self.refund(&r);
                    let target = Target { engine: r.engine_id().to_owned(), rank: r.rank() };
                    self.actions.push_back(Action::Fail { key, target, kind });
                }
            }
            Slot::Active(a) => {
                if a.in_flight == 0 {
                    self.release(key, a.blocks, reason);
                } else {
                    let served = a.started.clone();
                    let d = Draining { blocks: a.blocks, in_flight: a.in_flight, reason, kind, served };
                    self.draining.insert(key, d);
                }
                served = a.started;
            }
        }
        self.bury_served(now, key, kind, served);
    }

    /// Finishes an active attempt whose consumer ranks are all served.
    fn settle(&mut self, now: Instant, key: Key) {
        let done = matches!(
            self.entries.get(&key.transfer_id),
            Some(Entry { attempt, slot: Slot::Active(a) })
                if *attempt == key.attempt.0 && a.in_flight == 0 && a.started.len() >= usize::from(a.fan_out)
        );
        if done {
            if let Some(Entry { slot: Slot::Active(a), .. }) = self.entries.remove(&key.transfer_id) {
                let reason = if a.failed { ReleaseReason::Failed } else { ReleaseReason::Sent };
                self.release(key, a.blocks, reason);
                // A late registration for a finished key is answered, not left waiting (a repeat
                // from a served rank is a duplicate, as while the key was live).
                self.bury_served(now, key, FailureKind::Refused, a.started);
            }
        }
    }

    fn start(&mut self, key: Key, a: &mut Active, registration: Registration, order: Order, waited_us: u64) {
        self.stats.matches += 1;
        a.started.push(Target { engine: registration.engine_id().to_owned(), rank: registration.rank() });
        a.in_flight += 1;
        self.actions.push_back(Action::Transfer { key, registration, blocks: a.blocks.clone(), order, waited_us });
    }

    fn release(&mut self, key: Key, blocks: Arc<SourceBlocks>, reason: ReleaseReason) {
        self.actions.push_back(Action::Release { key, blocks, reason });
    }

    fn arm(&mut self, at: Instant, key: Key) {
        self.deadlines.push(at, key);
    }

    fn bury(&mut self, now: Instant, key: Key, kind: FailureKind) {
        self.bury_served(now, key, kind, Vec::new());
    }

    fn bury_served(&mut self, now: Instant, key: Key, kind: FailureKind, served: Vec<Target>) {
        let until = now.plus_micros(self.config.tombstone_us);
        self.tombs.insert(key.transfer_id, Tomb { attempt: key.attempt.0, kind, served, until });
        self.tomb_order.push_back((until, key.transfer_id, key.attempt.0));
        self.trim_tombs();
    }

    /// `key`'s tombstone (if it has one) answered a registration at `now`: it lives another
    /// `tombstone_us`. A registration the network repeats may reach us up to a network delay after
    /// the first copy, however long after the tombstone was made (an abort may precede the
    /// registration by any time); forgotten in between, the repeat would be taken for a new
    /// registration, and a later prefill of the same attempt written into blocks the consumer was
    /// told are free (found by `tests/proto/sim.rs`).
    fn touch(&mut self, now: Instant, key: Key) {
        let until = now.plus_micros(self.config.tombstone_us);
        let Some(t) = self.tombs.get_mut(&key.transfer_id).filter(|t| t.attempt == key.attempt.0) else { return };
        if t.until < until {
            t.until = until;
            self.tomb_order.push_back((until, key.transfer_id, key.attempt.0));
            self.trim_tombs();
        }
    }

    /// Forgets the oldest tombstones past the count bound.
    fn trim_tombs(&mut self) {
        while self.tomb_order.len() > self.config.max_tombstones {
            if let Some((at, id, attempt)) = self.tomb_order.pop_front() {
                self.forget(at, id, attempt);
            }
        }
    }

    /// The tombstone entry `(at, id, attempt)` left the queue: the tombstone goes unless a later
    /// entry of it is queued (it answered a registration since, [`Rendezvous::touch`]). Each kept
    /// tombstone has its latest entry queued, so the count bound holds for tombstones too.
    fn forget(&mut self, at: Instant, id: TransferId, attempt: u32) {
        if self.tombs.get(&id).is_some_and(|t| t.attempt == attempt && t.until == at) {
            self.tombs.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::layout::{KvLayout, Parallel};
    use crate::proto::testutil::small_layout;

    const LEASE: u64 = 100;
    const REG_TIMEOUT: u64 = 200;
    const TOMB: u64 = 1_000;

    fn config(max_pending: usize) -> RendezvousConfig {
        RendezvousConfig {
            lease_us: LEASE,
            registration_timeout_us: REG_TIMEOUT,
            max_pending,
            tombstone_us: TOMB,
            max_tombstones: 16,
            max_waiting_bytes_per_engine: usize::MAX,
            max_waiting_per_engine: usize::MAX,
            max_engines_per_key: 4,
        }
    }

    fn rdv() -> Rendezvous {
        Rendezvous::new(config(8))
    }

    fn t(us: u64) -> Instant {
        Instant(us)
    }

    /// The layout of consumer TP rank `tp_rank` of `tp_size` (PP 1).
    fn layout(tp_rank: u16, tp_size: u16) -> KvLayout {
        let mut l = small_layout();
        l.parallel = Parallel { tp_rank, tp_size, pp_rank: 0, pp_size: 1 };
        l.validate().expect("test layout is valid");
        l
    }

    /// A registration of consumer TP rank `tp_rank` of `tp_size`.
    fn reg_of(id: u128, attempt: u32, tp_rank: u16, tp_size: u16) -> Registration {
        let l = layout(tp_rank, tp_size);
        let blocks = vec![vec![1, 2, 3], vec![4 + u32::from(tp_rank)]];
        Registration::new(Key::new(id, attempt), "d".into(), l.parallel.rank(), 40, blocks, &l).expect("fits")
    }

    /// A registration of the single consumer rank (TP 1).
    fn reg(id: u128, attempt: u32) -> Registration {
        reg_of(id, attempt, 0, 1)
    }

    fn target(tp_rank: u16) -> Target {
        Target { engine: "d".into(), rank: Rank::new(tp_rank, 0) }
    }

    /// Producer blocks marked with `token`, so each set can be told apart.
    fn blocks(token: u32) -> SourceBlocks {
        SourceBlocks { block_ids: vec![vec![token, token + 1], vec![token + 2]], num_tokens: 40 }
    }

    fn drain(r: &mut Rendezvous) -> Vec<Action> {
        std::iter::from_fn(|| r.poll_action()).collect()
    }

    /// The single action of `r`, which must be a transfer to `to`; returns its blocks.
    fn expect_transfer(r: &mut Rendezvous, key: Key, to: &Target, order: Order, waited: u64) -> Arc<SourceBlocks> {
        match drain(r).as_slice() {
            [Action::Transfer { key: k, registration, blocks, order: o, waited_us }] => {
                assert_eq!((*k, *o, *waited_us), (key, order, waited));
                assert_eq!((registration.engine_id(), registration.rank()), (to.engine.as_str(), to.rank));
                blocks.clone()
            }
            other => panic!("expected one transfer of {key} to {to:?}, got {other:?}"),
        }
    }

    /// The single action of `r`, which must be a release of `key` for `reason`; returns its blocks.
    fn expect_release(r: &mut Rendezvous, key: Key, reason: ReleaseReason) -> Arc<SourceBlocks> {
        match drain(r).as_slice() {
            [Action::Release { key: k, blocks, reason: why }] => {
                assert_eq!((*k, *why), (key, reason));
                blocks.clone()
            }
            other => panic!("expected one release of {key} ({reason:?}), got {other:?}"),
        }
    }

    /// The single action of `r`, which must be a failure of `key` sent to `to` with `kind`.
    fn expect_fail(r: &mut Rendezvous, key: Key, to: &Target, kind: FailureKind) {
        let want = Action::Fail { key, target: to.clone(), kind };
        assert_eq!(drain(r), vec![want]);
    }

    #[test]
    fn registration_first_transfers_once_then_releases_sent() {
        let mut r = rdv();
        let key = Key::new(1, 1);
        r.handle_registration(t(10), reg(1, 1), 1);
        assert!(drain(&mut r).is_empty());
        assert!(matches!(r.slot(key.transfer_id), Some((1, Slot::AwaitingBlocks(_)))));
        assert_eq!(r.poll_timeout(), Some(t(10 + REG_TIMEOUT)));

        r.handle_blocks_ready(t(50), key, blocks(100));
        let sent = expect_transfer(&mut r, key, &target(0), Order::RegistrationFirst, 40);
        assert_eq!(*sent, blocks(100));
        assert!(matches!(r.slot(key.transfer_id), Some((1, Slot::Active(_)))));

        r.handle_transfer_done(t(70), key, &target(0), Ok(()));
        let released = expect_release(&mut r, key, ReleaseReason::Sent);
        assert!(Arc::ptr_eq(&sent, &released), "the released blocks are the transferred ones");
        assert_eq!(r.pending(), 0);
        // Nothing left to expire but the tombstone; it answers nothing on its own.
        r.handle_timeout(t(10_000));
        assert!(drain(&mut r).is_empty());
        assert_eq!(r.poll_timeout(), None);
        let s = r.stats();
        assert_eq!((s.registrations, s.blocks_ready, s.matches, s.expired), (1, 1, 1, 0));
    }

    /// A registration of key `(id, 1)` from engine `engine`, TP rank 0 of 1.
    fn reg_from(engine: &str, id: u128) -> Registration {
        let l = layout(0, 1);
        Registration::new(Key::new(id, 1), engine.into(), l.parallel.rank(), 40, vec![vec![9, 9, 9], vec![9]], &l)
            .expect("fits")
    }

    fn intruder() -> Target {
        Target { engine: "intruder".into(), rank: Rank::new(0, 0) }
    }

    /// Issue #16, window 8: with no consumer named, a key is bound to the first consumer engine that
    /// registered it, before and after the transfer started; another engine's registration is
    /// refused and moves nothing.
    #[test]
    fn a_key_belongs_to_the_first_consumer_engine_when_none_is_named() {
        for blocks_first in [false, true] {
            let mut r = rdv();
            let key = Key::new(7, 1);
            if blocks_first {
                r.handle_blocks_ready(t(1), key, blocks(100));
                assert!(drain(&mut r).is_empty());
            }
            r.handle_registration(t(2), reg(7, 1), 2);
            if blocks_first {
                expect_transfer(&mut r, key, &target(0), Order::BlocksFirst, 1);
            } else {
                assert!(drain(&mut r).is_empty());
            }
            // The fan-out (2) leaves room for one more rank, but not of another engine.
            r.handle_registration(t(3), reg_from("intruder", 7), 2);
            if blocks_first {
                expect_fail(&mut r, key, &intruder(), FailureKind::Refused);
            } else {
                // Held until prefill finishes, then refused: "d" registered first.
                assert!(drain(&mut r).is_empty());
                assert_eq!(r.stats().contended, 1);
                r.handle_blocks_ready(t(4), key, blocks(100));
                let actions = drain(&mut r);
                assert_eq!(actions.len(), 2, "{actions:?}");
                assert!(
                    matches!(&actions[0], Action::Transfer { registration, .. } if registration.engine_id() == "d"),
                    "{actions:?}"
                );
                assert_eq!(actions[1], Action::Fail { key, target: intruder(), kind: FailureKind::Refused });
            }
            assert_eq!(r.stats().foreign, 1);
        }
    }

    /// Issue #16, window 8 (fault scenario `w8_intruder`): an engine holding the secret registers the
    /// key before the real consumer. With the consumer named by the producer, the real one is served
    /// and the intruder is refused and never written to, whatever the order of the three events.
    #[test]
    fn the_named_consumer_is_served_even_when_an_intruder_registers_first() {
        let key = Key::new(8, 1);
        let named = || Some("d".to_owned());
        // Events: I = intruder registers, D = "d" registers, B = blocks ready naming "d".
        for order in ["IDB", "IBD", "BID"] {
            let mut r = rdv();
            let mut actions = Vec::new();
            for (i, ev) in order.chars().enumerate() {
                let now = t(i as u64 + 1);
                match ev {
                    'I' => r.handle_registration(now, reg_from("intruder", 8), 1),
                    'D' => r.handle_registration(now, reg(8, 1), 1),
                    _ => r.handle_blocks_ready_for(now, key, blocks(100), named()),
                }
                actions.extend(drain(&mut r));
            }
            let transfers: Vec<&str> = actions
                .iter()
                .filter_map(|a| match a {
                    Action::Transfer { registration, .. } => Some(registration.engine_id()),
                    _ => None,
                })
                .collect();
            assert_eq!(transfers, vec!["d"], "{order}: {actions:?}");
            let refused = Action::Fail { key, target: intruder(), kind: FailureKind::Refused };
            assert_eq!(actions.iter().filter(|a| **a == refused).count(), 1, "{order}: {actions:?}");
            assert_eq!(r.stats().foreign, 1, "{order}");
            // The transfer finishes; the intruder registering again is still refused.
            r.handle_transfer_done(t(10), key, &target(0), Ok(()));
            expect_release(&mut r, key, ReleaseReason::Sent);
            r.handle_registration(t(11), reg_from("intruder", 8), 1);
            expect_fail(&mut r, key, &intruder(), FailureKind::Refused);
        }
    }

    /// Each engine's registrations wait their own registration timeout: an intruder registering
    /// first neither cuts D's wait short nor (registering later) stretches it.
    #[test]
    fn each_engine_waits_its_own_registration_timeout() {
        let key = Key::new(10, 1);
        let mut r = rdv();
        r.handle_registration(t(0), reg_from("intruder", 10), 1);
        r.handle_registration(t(100), reg(10, 1), 1);
        r.handle_timeout(t(REG_TIMEOUT));
        expect_fail(&mut r, key, &intruder(), FailureKind::LeaseExpired);
        assert_eq!(r.poll_timeout(), Some(t(100 + REG_TIMEOUT)));
        r.handle_blocks_ready_for(t(REG_TIMEOUT + 50), key, blocks(100), Some("d".into()));
        expect_transfer(&mut r, key, &target(0), Order::RegistrationFirst, REG_TIMEOUT - 50);
        // D first, the intruder later: D's registration expires at D's own deadline.
        let mut r = rdv();
        r.handle_registration(t(0), reg(10, 1), 1);
        r.handle_registration(t(100), reg_from("intruder", 10), 1);
        r.handle_timeout(t(REG_TIMEOUT));
        expect_fail(&mut r, key, &target(0), FailureKind::LeaseExpired);
        r.handle_timeout(t(100 + REG_TIMEOUT));
        expect_fail(&mut r, key, &intruder(), FailureKind::LeaseExpired);
        assert_eq!(r.pending(), 0);
        assert_eq!(r.stats().expired, 2);
    }

    #[test]
    fn engines_held_per_key_are_bounded_and_the_rest_refused() {
        let mut r = Rendezvous::new(RendezvousConfig { max_engines_per_key: 2, ..config(8) });
        let key = Key::new(9, 1);
        r.handle_registration(t(1), reg_from("e1", 9), 1);
        r.handle_registration(t(2), reg_from("e2", 9), 1);
        assert!(drain(&mut r).is_empty());
        // A third engine is refused at once and never held; the named one, too, is now too late.
        r.handle_registration(t(3), reg(9, 1), 1);
        expect_fail(&mut r, key, &target(0), FailureKind::Refused);
        assert_eq!((r.stats().contended, r.stats().foreign), (1, 1));
        // Blocks naming "d": both held engines are refused, and the blocks wait for "d".
        r.handle_blocks_ready_for(t(4), key, blocks(100), Some("d".into()));
        let actions = drain(&mut r);
        assert_eq!(actions.len(), 2, "{actions:?}");
        assert!(actions.iter().all(|a| matches!(a, Action::Fail { kind: FailureKind::Refused, .. })), "{actions:?}");
        assert_eq!(r.stats().foreign, 3);
        assert!(matches!(r.slot(key.transfer_id), Some((1, Slot::AwaitingRegistration(_)))));
        assert_eq!(r.waiting_bytes("e1") + r.waiting_bytes("e2"), 0, "refused registrations are refunded");
        r.handle_registration(t(5), reg(9, 1), 1);
        expect_transfer(&mut r, key, &target(0), Order::BlocksFirst, 1);
        // No one came: the lease still runs out.
        let mut r = rdv();
        r.handle_registration(t(1), reg_from("intruder", 9), 1);
        r.handle_blocks_ready_for(t(2), key, blocks(100), Some("d".into()));
        expect_fail(&mut r, key, &intruder(), FailureKind::Refused);
        r.handle_timeout(t(2 + LEASE));
        expect_release(&mut r, key, ReleaseReason::LeaseExpired);
        assert_eq!(r.pending(), 0);
    }

    #[test]
    fn blocks_first_transfers_once_then_releases_sent() {
        let mut r = rdv();
        let key = Key::new(2, 1);
        r.handle_blocks_ready(t(5), key, blocks(100));
        assert!(drain(&mut r).is_empty());
        assert!(matches!(r.slot(key.transfer_id), Some((1, Slot::AwaitingRegistration(_)))));
        assert_eq!(r.poll_timeout(), Some(t(5 + LEASE)));

        r.handle_registration(t(30), reg(2, 1), 1);
        let sent = expect_transfer(&mut r, key, &target(0), Order::BlocksFirst, 25);
        // The lease does not run out under an in-flight transfer.
        r.handle_timeout(t(5 + LEASE));
        assert!(drain(&mut r).is_empty());

        r.handle_transfer_done(t(200), key, &target(0), Ok(()));
        let released = expect_release(&mut r, key, ReleaseReason::Sent);
        assert!(Arc::ptr_eq(&sent, &released));
        assert_eq!(r.pending(), 0);
        assert_eq!(r.stats().expired, 0);
    }

    #[test]
    fn fan_out_two_waits_for_both_ranks_blocks_first() {
        let mut r = rdv();
        let key = Key::new(3, 1);
        r.handle_blocks_ready(t(0), key, blocks(100));
        r.handle_registration(t(10), reg_of(3, 1, 0, 2), 2);
        expect_transfer(&mut r, key, &target(0), Order::BlocksFirst, 10);
        r.handle_transfer_done(t(20), key, &target(0), Ok(()));
        assert!(drain(&mut r).is_empty(), "rank 1 has not been served yet");
        assert_eq!(r.pending(), 1);

        r.handle_registration(t(30), reg_of(3, 1, 1, 2), 2);
        expect_transfer(&mut r, key, &target(1), Order::BlocksFirst, 30);
        r.handle_transfer_done(t(40), key, &target(1), Ok(()));
        expect_release(&mut r, key, ReleaseReason::Sent);
        assert_eq!(r.pending(), 0);
        assert_eq!(r.stats().matches, 2);
    }

    #[test]
    fn fan_out_two_waits_for_both_ranks_registration_first() {
        let mut r = rdv();
        let key = Key::new(4, 1);
        r.handle_registration(t(0), reg_of(4, 1, 1, 2), 2);
        r.handle_registration(t(5), reg_of(4, 1, 0, 2), 2);
        assert!(drain(&mut r).is_empty());
        r.handle_blocks_ready(t(50), key, blocks(100));
        let actions = drain(&mut r);
        let mut targets: Vec<_> = actions
            .iter()
            .map(|a| match a {
                Action::Transfer { key: k, registration, order: Order::RegistrationFirst, .. } if *k == key => {
                    registration.rank().tp
                }
                other => panic!("expected transfers, got {other:?}"),
            })
            .collect();
        targets.sort_unstable();
        assert_eq!(targets, vec![0, 1]);
        // Both ranks are served, so no lease runs any more.
        r.handle_timeout(t(50 + LEASE));
        assert!(drain(&mut r).is_empty());
        r.handle_transfer_done(t(300), key, &target(1), Ok(()));
        assert!(drain(&mut r).is_empty(), "rank 0's transfer still reads the blocks");
        r.handle_transfer_done(t(310), key, &target(0), Ok(()));
        expect_release(&mut r, key, ReleaseReason::Sent);
        assert_eq!(r.pending(), 0);
    }

    #[test]
    fn lease_expiry_releases_blocks_and_fails_a_late_registration() {
        let mut r = rdv();
        let key = Key::new(5, 1);
        r.handle_blocks_ready(t(0), key, blocks(100));
        r.handle_timeout(t(LEASE - 1));
        assert!(drain(&mut r).is_empty());
        r.handle_timeout(t(LEASE));
        expect_release(&mut r, key, ReleaseReason::LeaseExpired);
        assert_eq!(r.pending(), 0);
        assert_eq!(r.stats().expired, 1);

        r.handle_registration(t(LEASE + 50), reg(5, 1), 1);
        expect_fail(&mut r, key, &target(0), FailureKind::LeaseExpired);
        assert_eq!(r.pending(), 0);
    }

    #[test]
    fn lease_expiry_with_a_rank_missing_waits_for_the_transfer_in_flight() {
        let mut r = rdv();
        let key = Key::new(6, 1);
        r.handle_blocks_ready(t(0), key, blocks(100));
        r.handle_registration(t(10), reg_of(6, 1, 0, 2), 2);
        expect_transfer(&mut r, key, &target(0), Order::BlocksFirst, 10);
        r.handle_timeout(t(LEASE));
        assert!(drain(&mut r).is_empty(), "rank 0's transfer still reads the blocks");
        assert_eq!(r.pending(), 1);
        // Rank 1 comes too late: told at once.
        r.handle_registration(t(LEASE + 1), reg_of(6, 1, 1, 2), 2);
        expect_fail(&mut r, key, &target(1), FailureKind::LeaseExpired);
        r.handle_transfer_done(t(LEASE + 5), key, &target(0), Ok(()));
        expect_release(&mut r, key, ReleaseReason::LeaseExpired);
        assert_eq!(r.pending(), 0);
    }

    #[test]
    fn registration_timeout_fails_the_waiting_registration() {
        let mut r = rdv();
        let key = Key::new(7, 1);
        r.handle_registration(t(0), reg(7, 1), 1);
        r.handle_timeout(t(REG_TIMEOUT - 1));
        assert!(drain(&mut r).is_empty());
        r.handle_timeout(t(REG_TIMEOUT));
        expect_fail(&mut r, key, &target(0), FailureKind::LeaseExpired);
        assert_eq!(r.pending(), 0);
        // Prefill finishing late hands its blocks straight back.
        r.handle_blocks_ready(t(REG_TIMEOUT + 10), key, blocks(100));
        expect_release(&mut r, key, ReleaseReason::LeaseExpired);
        assert_eq!(r.pending(), 0);
    }

    #[test]
    fn abort_while_awaiting_registration() {
        let mut r = rdv();
        let key = Key::new(8, 1);
        r.handle_blocks_ready(t(0), key, blocks(100));
        r.handle_abort(t(10), key);
        expect_release(&mut r, key, ReleaseReason::Aborted);
        assert_eq!(r.pending(), 0);
        r.handle_registration(t(20), reg(8, 1), 1);
        expect_fail(&mut r, key, &target(0), FailureKind::Aborted);
        // The old lease deadline fires into nothing.
        r.handle_timeout(t(LEASE));
        assert!(drain(&mut r).is_empty());
        assert_eq!(r.stats().aborted, 1);
    }

    #[test]
    fn abort_while_awaiting_blocks() {
        let mut r = rdv();
        let key = Key::new(9, 1);
        r.handle_registration(t(0), reg(9, 1), 1);
        r.handle_abort(t(10), key);
        expect_fail(&mut r, key, &target(0), FailureKind::Aborted);
        assert_eq!(r.pending(), 0);
        r.handle_blocks_ready(t(20), key, blocks(100));
        expect_release(&mut r, key, ReleaseReason::Aborted);
        r.handle_timeout(t(REG_TIMEOUT));
        assert!(drain(&mut r).is_empty());
        assert_eq!(r.pending(), 0);
    }

    #[test]
    fn abort_while_a_transfer_is_in_flight_releases_only_after_it_is_done() {
        let mut r = rdv();
        let key = Key::new(10, 1);
        r.handle_blocks_ready(t(0), key, blocks(100));
        r.handle_registration(t(10), reg(10, 1), 1);
        let sent = expect_transfer(&mut r, key, &target(0), Order::BlocksFirst, 10);
        r.handle_abort(t(20), key);
        assert!(drain(&mut r).is_empty(), "blocks released under a transfer that still reads them");
        assert_eq!(r.pending(), 1);
        // Aborting again, or expiring, changes nothing.
        r.handle_abort(t(21), key);
        r.handle_timeout(t(LEASE + REG_TIMEOUT));
        assert!(drain(&mut r).is_empty());
        assert_eq!(r.pending(), 1);

        r.handle_transfer_done(t(500), key, &target(0), Ok(()));
        let released = expect_release(&mut r, key, ReleaseReason::Aborted);
        assert!(Arc::ptr_eq(&sent, &released));
        assert_eq!(r.pending(), 0);
        // A late duplicate report releases nothing a second time.
        r.handle_transfer_done(t(501), key, &target(0), Ok(()));
        assert!(drain(&mut r).is_empty());
    }

    #[test]
    fn abort_of_an_unknown_key_answers_its_late_events() {
        let mut r = rdv();
        let key = Key::new(11, 1);
        r.handle_abort(t(0), key);
        assert!(drain(&mut r).is_empty());
        assert_eq!(r.pending(), 0);
        r.handle_registration(t(1), reg(11, 1), 1);
        expect_fail(&mut r, key, &target(0), FailureKind::Aborted);
        r.handle_blocks_ready(t(2), key, blocks(100));
        expect_release(&mut r, key, ReleaseReason::Aborted);
        assert_eq!(r.pending(), 0);
    }

    #[test]
    fn newer_attempt_releases_older_blocks_as_superseded() {
        let mut r = rdv();
        r.handle_blocks_ready(t(0), Key::new(12, 1), blocks(100));
        r.handle_registration(t(10), reg(12, 2), 1);
        let old = expect_release(&mut r, Key::new(12, 1), ReleaseReason::Superseded);
        assert_eq!(*old, blocks(100));
        assert!(matches!(r.slot(TransferId(12)), Some((2, Slot::AwaitingBlocks(_)))));
        r.handle_blocks_ready(t(20), Key::new(12, 2), blocks(200));
        expect_transfer(&mut r, Key::new(12, 2), &target(0), Order::RegistrationFirst, 10);
        r.handle_transfer_done(t(30), Key::new(12, 2), &target(0), Ok(()));
        expect_release(&mut r, Key::new(12, 2), ReleaseReason::Sent);
        assert_eq!(r.pending(), 0);
        assert_eq!(r.stats().superseded, 1);
    }

    #[test]
    fn newer_attempt_fails_older_waiting_registrations() {
        let mut r = rdv();
        r.handle_registration(t(0), reg_of(13, 1, 0, 2), 2);
        r.handle_registration(t(1), reg_of(13, 1, 1, 2), 2);
        r.handle_blocks_ready(t(10), Key::new(13, 2), blocks(100));
        let mut fails = drain(&mut r);
        fails.sort_by_key(|a| match a {
            Action::Fail { target, .. } => target.rank,
            other => panic!("expected failures, got {other:?}"),
        });
        let old = Key::new(13, 1);
        let want: Vec<_> =
            (0..2).map(|tp| Action::Fail { key: old, target: target(tp), kind: FailureKind::Refused }).collect();
        assert_eq!(fails, want);
        assert!(matches!(r.slot(TransferId(13)), Some((2, Slot::AwaitingRegistration(_)))));
        assert_eq!(r.pending(), 1);
    }

    #[test]
    fn newer_attempt_waits_for_the_older_transfer_before_releasing_its_blocks() {
        let mut r = rdv();
        let old = Key::new(14, 1);
        r.handle_blocks_ready(t(0), old, blocks(100));
        r.handle_registration(t(1), reg(14, 1), 1);
        expect_transfer(&mut r, old, &target(0), Order::BlocksFirst, 1);
        r.handle_blocks_ready(t(2), Key::new(14, 2), blocks(200));
        assert!(drain(&mut r).is_empty(), "old blocks released under an in-flight transfer");
        assert_eq!(r.pending(), 2, "the draining attempt still counts");
        r.handle_transfer_done(t(3), old, &target(0), Err(FailureKind::TransferFailed { status: 5 }));
        let actions = drain(&mut r);
        assert_eq!(actions.len(), 2, "{actions:?}");
        assert_eq!(
            actions[0],
            Action::Fail { key: old, target: target(0), kind: FailureKind::TransferFailed { status: 5 } }
        );
        assert!(
            matches!(&actions[1], Action::Release { key, reason: ReleaseReason::Superseded, blocks: b } if *key == old && **b == blocks(100))
        );
        assert_eq!(r.pending(), 1);
    }

    #[test]
    fn stale_attempt_events_are_answered_at_once() {
        let mut r = rdv();
        r.handle_registration(t(0), reg(15, 3), 1);
        assert!(drain(&mut r).is_empty());
        r.handle_blocks_ready(t(1), Key::new(15, 2), blocks(100));
        let stale = expect_release(&mut r, Key::new(15, 2), ReleaseReason::Stale);
        assert_eq!(*stale, blocks(100));
        r.handle_registration(t(2), reg(15, 1), 1);
        expect_fail(&mut r, Key::new(15, 1), &target(0), FailureKind::Refused);
        r.handle_abort(t(3), Key::new(15, 2));
        assert!(drain(&mut r).is_empty());
        assert!(matches!(r.slot(TransferId(15)), Some((3, Slot::AwaitingBlocks(_)))), "live attempt untouched");
        assert_eq!(r.stats().stale, 3);

        // A finished attempt still makes older ones stale.
        r.handle_abort(t(4), Key::new(15, 3));
        expect_fail(&mut r, Key::new(15, 3), &target(0), FailureKind::Aborted);
        r.handle_blocks_ready(t(5), Key::new(15, 1), blocks(300));
        expect_release(&mut r, Key::new(15, 1), ReleaseReason::Stale);
        assert_eq!(r.pending(), 0);
    }

    #[test]
    fn one_engine_waiting_registrations_stay_within_its_byte_budget() {
        // Room for exactly two waiting registrations of engine "d" (costs computed independently:
        // the registration and its instant, the id "d", two groups of 3 and 1 block ids).
        let one = std::mem::size_of::<(Registration, Instant)>() + 1 + (24 + 4 * 3) + (24 + 4);
        assert_eq!(registration_cost(&reg(1, 1)), one);
        let mut r = Rendezvous::new(RendezvousConfig { max_waiting_bytes_per_engine: 2 * one, ..config(8) });
        r.handle_registration(t(0), reg(1, 1), 1);
        r.handle_registration(t(0), reg(2, 1), 1);
        assert!(drain(&mut r).is_empty());
        assert_eq!(r.waiting_bytes("d"), 2 * one);
        // The third is refused at once and never held; another engine has its own budget.
        r.handle_registration(t(0), reg(3, 1), 1);
        let k3 = Key::new(3, 1);
        assert_eq!(drain(&mut r), vec![Action::Fail { key: k3, target: target(0), kind: FailureKind::Refused }]);
        assert!(r.slot(TransferId(3)).is_none());
        assert_eq!((r.stats().over_budget, r.waiting_bytes("d")), (1, 2 * one));
        let l = layout(0, 1);
        let other =
            Registration::new(Key::new(4, 1), "e".into(), l.parallel.rank(), 40, vec![vec![1, 2, 3], vec![4]], &l)
                .expect("fits");
        r.handle_registration(t(0), other, 1);
        assert!(drain(&mut r).is_empty());
        assert_eq!(r.waiting_bytes("e"), one);
        // Refused prefill blocks of attempt 3 come back at once, as for `max_pending`.
        r.handle_blocks_ready(t(1), k3, blocks(30));
        assert!(
            matches!(drain(&mut r)[..], [Action::Release { key, reason: ReleaseReason::Refused, .. }] if key == k3)
        );
        // A registration that stops waiting gives its bytes back: matched with its blocks, or
        // expired.
        r.handle_blocks_ready(t(1), Key::new(1, 1), blocks(10));
        drain(&mut r);
        assert_eq!(r.waiting_bytes("d"), one);
        r.handle_timeout(t(REG_TIMEOUT));
        drain(&mut r);
        assert_eq!(r.waiting_bytes("d"), 0);
        r.handle_registration(t(REG_TIMEOUT), reg(5, 1), 1);
        assert!(drain(&mut r).is_empty(), "room again");
    }

    #[test]
    fn one_engine_waiting_registrations_stay_within_its_count_budget() {
        // Two waiting registrations per engine, bytes unbounded: the third of engine "d" is refused
        // at once (counted apart from the byte budget), while engine "e" keeps its own two.
        let mut r = Rendezvous::new(RendezvousConfig { max_waiting_per_engine: 2, ..config(8) });
        r.handle_registration(t(0), reg(1, 1), 1);
        r.handle_registration(t(0), reg(2, 1), 1);
        assert!(drain(&mut r).is_empty());
        assert_eq!(r.waiting_count("d"), 2);
        r.handle_registration(t(0), reg(3, 1), 1);
        let k3 = Key::new(3, 1);
        assert_eq!(drain(&mut r), vec![Action::Fail { key: k3, target: target(0), kind: FailureKind::Refused }]);
        assert!(r.slot(TransferId(3)).is_none(), "nothing of the refused registration is held");
        assert_eq!((r.stats().over_count, r.stats().over_budget, r.waiting_count("d")), (1, 0, 2));
        let l = layout(0, 1);
        for id in [4, 5] {
            let ids = vec![vec![1, 2, 3], vec![4]];
            let other = Registration::new(Key::new(id, 1), "e".into(), l.parallel.rank(), 40, ids, &l).expect("fits");
            r.handle_registration(t(0), other, 1);
        }
        assert!(drain(&mut r).is_empty(), "another engine has its own count");
        assert_eq!(r.waiting_count("e"), 2);
        // One that stops waiting (matched with its blocks) makes room for exactly one more.
        r.handle_blocks_ready(t(1), Key::new(1, 1), blocks(10));
        drain(&mut r);
        assert_eq!(r.waiting_count("d"), 1);
        r.handle_registration(t(1), reg(6, 1), 1);
        assert!(drain(&mut r).is_empty(), "room again");
        r.handle_registration(t(1), reg(7, 1), 1);
        assert!(matches!(drain(&mut r)[..], [Action::Fail { kind: FailureKind::Refused, .. }]));
        assert_eq!(r.stats().over_count, 2);
    }

    #[test]
    fn max_pending_refuses_new_ids_and_is_never_exceeded() {
        let mut r = Rendezvous::new(config(2));
        r.handle_registration(t(0), reg(20, 1), 1);
        r.handle_blocks_ready(t(0), Key::new(21, 1), blocks(100));
        assert_eq!(r.pending(), 2);
        assert!(drain(&mut r).is_empty());

        r.handle_registration(t(1), reg(22, 1), 1);
        expect_fail(&mut r, Key::new(22, 1), &target(0), FailureKind::Refused);
        r.handle_blocks_ready(t(1), Key::new(23, 1), blocks(200));
        expect_release(&mut r, Key::new(23, 1), ReleaseReason::Refused);
        assert_eq!(r.pending(), 2);
        // The refused blocks' key answers its registration at once.
        r.handle_registration(t(2), reg(23, 1), 1);
        expect_fail(&mut r, Key::new(23, 1), &target(0), FailureKind::Refused);
        assert_eq!(r.stats().refused, 2);

        // Events for live ids still go through, and an id that ends frees its place.
        r.handle_registration(t(3), reg(21, 1), 1);
        expect_transfer(&mut r, Key::new(21, 1), &target(0), Order::BlocksFirst, 3);
        // A newer attempt of a transfer still in flight does not fit next to its draining attempt.
        r.handle_blocks_ready(t(4), Key::new(21, 2), blocks(300));
        expect_release(&mut r, Key::new(21, 2), ReleaseReason::Refused);
        assert!(r.pending() <= 2);
        r.handle_transfer_done(t(5), Key::new(21, 1), &target(0), Ok(()));
        let released = drain(&mut r);
        assert!(
            matches!(released.as_slice(), [Action::Release { reason: ReleaseReason::Superseded, .. }]),
            "{released:?}"
        );
        assert_eq!(r.pending(), 1);
        r.handle_blocks_ready(t(6), Key::new(24, 1), blocks(400));
        assert!(drain(&mut r).is_empty());
        assert_eq!(r.pending(), 2);
    }

    #[test]
    fn duplicates_never_start_a_second_transfer() {
        let mut r = rdv();
        let key = Key::new(30, 1);
        r.handle_registration(t(0), reg(30, 1), 1);
        r.handle_registration(t(1), reg(30, 1), 1);
        assert!(drain(&mut r).is_empty());
        r.handle_blocks_ready(t(2), key, blocks(100));
        expect_transfer(&mut r, key, &target(0), Order::RegistrationFirst, 2);
        // Second prefill report of the same attempt: handed back at once.
        r.handle_blocks_ready(t(3), key, blocks(200));
        let dup = expect_release(&mut r, key, ReleaseReason::Duplicate);
        assert_eq!(*dup, blocks(200));
        // Registration repeated while the transfer runs: ignored.
        r.handle_registration(t(4), reg(30, 1), 1);
        assert!(drain(&mut r).is_empty());
        r.handle_transfer_done(t(5), key, &target(0), Ok(()));
        let sent = expect_release(&mut r, key, ReleaseReason::Sent);
        assert_eq!(*sent, blocks(100));
        // After the end: a repeated registration of the served rank is still a duplicate (its
        // notification may not have arrived yet: a failure must not overtake it), repeated blocks
        // are handed back, and a rank beyond the fan-out is refused.
        r.handle_registration(t(6), reg(30, 1), 1);
        assert!(drain(&mut r).is_empty());
        r.handle_blocks_ready(t(7), key, blocks(300));
        let late = expect_release(&mut r, key, ReleaseReason::Refused);
        assert_eq!(*late, blocks(300));
        r.handle_registration(t(8), reg_of(30, 1, 1, 2), 2);
        expect_fail(&mut r, key, &target(1), FailureKind::Refused);
        assert_eq!(r.stats().matches, 1);
        assert_eq!(r.stats().duplicates, 4);
        assert_eq!(r.pending(), 0);

        // Blocks first, reported twice before any registration.
        let key = Key::new(31, 1);
        r.handle_blocks_ready(t(10), key, blocks(500));
        r.handle_blocks_ready(t(11), key, blocks(600));
        expect_release(&mut r, key, ReleaseReason::Duplicate);
        r.handle_registration(t(12), reg(31, 1), 1);
        let sent = expect_transfer(&mut r, key, &target(0), Order::BlocksFirst, 2);
        assert_eq!(*sent, blocks(500));
    }

    #[test]
    fn served_rank_is_not_failed_by_a_repeated_registration_after_the_end() {
        // Rank 0 was served, then the attempt ends (lease, while rank 1 never came): a repeat of
        // rank 0's registration is a duplicate, rank 1 is told the lease expired.
        let mut r = rdv();
        let key = Key::new(33, 1);
        r.handle_blocks_ready(t(0), key, blocks(100));
        r.handle_registration(t(1), reg_of(33, 1, 0, 2), 2);
        expect_transfer(&mut r, key, &target(0), Order::BlocksFirst, 1);
        r.handle_transfer_done(t(2), key, &target(0), Ok(()));
        assert!(drain(&mut r).is_empty());
        r.handle_timeout(t(LEASE));
        expect_release(&mut r, key, ReleaseReason::LeaseExpired);
        r.handle_registration(t(LEASE + 1), reg_of(33, 1, 0, 2), 2);
        assert!(drain(&mut r).is_empty(), "a served rank was failed");
        r.handle_registration(t(LEASE + 2), reg_of(33, 1, 1, 2), 2);
        expect_fail(&mut r, key, &target(1), FailureKind::LeaseExpired);

        // Aborted while rank 0's transfer runs: the transfer's outcome answers rank 0, not a failure.
        let key = Key::new(34, 1);
        r.handle_registration(t(200), reg(34, 1), 1);
        r.handle_blocks_ready(t(201), key, blocks(200));
        expect_transfer(&mut r, key, &target(0), Order::RegistrationFirst, 1);
        r.handle_abort(t(202), key);
        r.handle_registration(t(203), reg(34, 1), 1);
        assert!(drain(&mut r).is_empty(), "a rank with a transfer in flight was failed");
        r.handle_transfer_done(t(204), key, &target(0), Ok(()));
        expect_release(&mut r, key, ReleaseReason::Aborted);
        assert_eq!(r.stats().duplicates, 2);
    }

    #[test]
    fn a_draining_attempt_is_not_revived_when_its_tombstone_is_forgotten() {
        let mut r = Rendezvous::new(RendezvousConfig { tombstone_us: 0, max_tombstones: 1, ..config(8) });
        let key = Key::new(35, 1);
        r.handle_blocks_ready(t(0), key, blocks(100));
        r.handle_registration(t(1), reg_of(35, 1, 0, 2), 2);
        let first = expect_transfer(&mut r, key, &target(0), Order::BlocksFirst, 1);
        // The lease runs out with rank 1 missing; the tombstone is forgotten at once.
        r.handle_timeout(t(LEASE));
        assert!(drain(&mut r).is_empty());
        assert_eq!(r.poll_timeout(), None);
        // The same attempt reported ready again, and rank 1 registering, are answered as ended:
        // no second live entry of the key next to the draining one.
        r.handle_blocks_ready(t(LEASE + 1), key, blocks(200));
        let again = expect_release(&mut r, key, ReleaseReason::LeaseExpired);
        assert_eq!(*again, blocks(200));
        r.handle_registration(t(LEASE + 2), reg_of(35, 1, 1, 2), 2);
        expect_fail(&mut r, key, &target(1), FailureKind::LeaseExpired);
        r.handle_registration(t(LEASE + 3), reg_of(35, 1, 0, 2), 2);
        assert!(drain(&mut r).is_empty(), "the served rank is answered by its transfer");
        assert_eq!(r.pending(), 1);
        r.handle_transfer_done(t(LEASE + 4), key, &target(0), Ok(()));
        let released = expect_release(&mut r, key, ReleaseReason::LeaseExpired);
        assert!(Arc::ptr_eq(&first, &released));
        assert_eq!(r.pending(), 0);
    }

    #[test]
    fn extra_consumer_rank_beyond_fan_out_is_refused() {
        let mut r = rdv();
        let key = Key::new(32, 1);
        r.handle_registration(t(0), reg_of(32, 1, 0, 2), 1);
        r.handle_registration(t(1), reg_of(32, 1, 1, 2), 1);
        expect_fail(&mut r, key, &target(1), FailureKind::Refused);
        r.handle_blocks_ready(t(2), key, blocks(100));
        expect_transfer(&mut r, key, &target(0), Order::RegistrationFirst, 2);
        r.handle_registration(t(3), reg_of(32, 1, 1, 2), 1);
        expect_fail(&mut r, key, &target(1), FailureKind::Refused);
        assert_eq!(r.stats().matches, 1);
    }

    #[test]
    fn failing_transfer_fails_its_consumer_and_releases_blocks_as_failed() {
        let mut r = rdv();
        let key = Key::new(40, 1);
        r.handle_blocks_ready(t(0), key, blocks(100));
        r.handle_registration(t(1), reg(40, 1), 1);
        expect_transfer(&mut r, key, &target(0), Order::BlocksFirst, 1);
        let kind = FailureKind::TransferFailed { status: -7 };
        r.handle_transfer_done(t(2), key, &target(0), Err(kind));
        let actions = drain(&mut r);
        assert_eq!(actions.len(), 2, "{actions:?}");
        assert_eq!(actions[0], Action::Fail { key, target: target(0), kind });
        assert!(matches!(&actions[1], Action::Release { key: k, reason: ReleaseReason::Failed, .. } if *k == key));
        assert_eq!(r.pending(), 0);
        assert_eq!(r.stats().transfer_failures, 1);
    }

    #[test]
    fn one_failing_rank_of_two_fails_only_that_rank() {
        let mut r = rdv();
        let key = Key::new(41, 1);
        r.handle_registration(t(0), reg_of(41, 1, 0, 2), 2);
        r.handle_registration(t(0), reg_of(41, 1, 1, 2), 2);
        r.handle_blocks_ready(t(1), key, blocks(100));
        assert_eq!(drain(&mut r).len(), 2);
        r.handle_transfer_done(t(2), key, &target(1), Err(FailureKind::PlanFailed));
        expect_fail(&mut r, key, &target(1), FailureKind::PlanFailed);
        r.handle_transfer_done(t(3), key, &target(0), Ok(()));
        expect_release(&mut r, key, ReleaseReason::Failed);
        assert_eq!(r.pending(), 0);
    }

    #[test]
    fn tombstones_are_forgotten_after_their_time() {
        let mut r = rdv();
        let key = Key::new(50, 1);
        r.handle_abort(t(0), key);
        assert_eq!(r.poll_timeout(), Some(t(TOMB)));
        r.handle_timeout(t(TOMB));
        assert_eq!(r.poll_timeout(), None);
        // Forgotten: a registration now waits like a fresh one.
        r.handle_registration(t(TOMB + 1), reg(50, 1), 1);
        assert!(drain(&mut r).is_empty());
        assert_eq!(r.pending(), 1);
    }

    /// A tombstone that answered a registration lives on for the repeat of that registration: the
    /// network may deliver it a delay after the first copy, however long after the abort that made
    /// the tombstone. (Before the fix the repeat found the tombstone forgotten, waited as a fresh
    /// registration, and a later prefill of the attempt was written into blocks the consumer had
    /// been told were free: `tests/proto/sim.rs`, "no WRITE after D handed blocks back".)
    #[test]
    fn a_tombstone_answering_a_registration_outlives_its_repeat() {
        let mut r = rdv();
        let key = Key::new(51, 1);
        r.handle_abort(t(0), key);
        r.handle_registration(t(TOMB - 100), reg(51, 1), 1);
        expect_fail(&mut r, key, &target(0), FailureKind::Aborted);
        r.handle_timeout(t(TOMB + 100));
        r.handle_registration(t(TOMB + 100), reg(51, 1), 1);
        expect_fail(&mut r, key, &target(0), FailureKind::Aborted);
        assert_eq!(r.pending(), 0, "the repeat waits as a fresh registration");
        r.handle_blocks_ready(t(TOMB + 200), key, blocks(100));
        expect_release(&mut r, key, ReleaseReason::Aborted);
        // Still forgotten in the end (bounded memory).
        r.handle_timeout(t(10 * TOMB));
        assert_eq!(r.poll_timeout(), None);
        r.handle_registration(t(10 * TOMB), reg(51, 1), 1);
        assert!(drain(&mut r).is_empty());
        assert_eq!(r.pending(), 1);
    }
}
