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
//! * the number of live transfer ids never exceeds [`RendezvousConfig::max_pending`] (over it: refusal).

use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;

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
}

impl Default for RendezvousConfig {
    fn default() -> Self {
        Self {
            lease_us: 30_000_000,
            registration_timeout_us: 120_000_000,
            max_pending: 65_536,
            tombstone_us: 60_000_000,
            max_tombstones: 65_536,
        }
    }
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
    /// Transfers that finished with an error.
    pub transfer_failures: u64,
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
}

/// See [`Slot::AwaitingBlocks`].
#[derive(Debug)]
pub struct AwaitingBlocks {
    registrations: Vec<(Registration, Instant)>,
    fan_out: u16,
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
}

#[derive(Clone, Copy, Debug)]
struct Tomb {
    attempt: u32,
    kind: FailureKind,
}

/// The producer's rendezvous of registrations and finished prefills. See the module docs.
#[derive(Debug)]
pub struct Rendezvous {
    config: RendezvousConfig,
    entries: HashMap<TransferId, Entry>,
    draining: HashMap<Key, Draining>,
    deadlines: BinaryHeap<core::cmp::Reverse<(Instant, TransferId, u32)>>,
    tombs: HashMap<TransferId, Tomb>,
    tomb_order: VecDeque<(Instant, TransferId, u32)>,
    actions: VecDeque<Action>,
    stats: RendezvousStats,
}

impl Rendezvous {
    /// An empty rendezvous.
    pub fn new(config: RendezvousConfig) -> Self {
        Self {
            config,
            entries: HashMap::new(),
            draining: HashMap::new(),
            deadlines: BinaryHeap::new(),
            tombs: HashMap::new(),
            tomb_order: VecDeque::new(),
            actions: VecDeque::new(),
            stats: RendezvousStats::default(),
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

    // ---- outputs ----

    /// The next action to perform, in order.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// The earliest time [`Rendezvous::handle_timeout`] has something to do.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let d = self.deadlines.peek().map(|r| r.0 .0);
        let t = self.tomb_order.front().map(|t| t.0);
        match (d, t) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    // ---- inputs ----

    /// Prefill of `key` finished: the producer now holds `blocks` until this machine releases them.
    pub fn handle_blocks_ready(&mut self, now: Instant, key: Key, blocks: SourceBlocks) {
        self.stats.blocks_ready += 1;
        let blocks = Arc::new(blocks);
        let (id, attempt) = (key.transfer_id, key.attempt.0);
        if !self.admit(now, key) {
            self.release(key, blocks, ReleaseReason::Stale);
            return;
        }
        if let Some(t) = self.tombs.get(&id).copied().filter(|t| t.attempt == attempt) {
            // This attempt already ended (aborted, or refused); nothing can be sent any more.
            let reason = match t.kind {
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
            let slot = Slot::AwaitingRegistration(AwaitingRegistration { blocks, ready_at: now, lease_deadline });
            self.entries.insert(id, Entry { attempt, slot });
            return;
        };
        let slot = match entry.slot {
            Slot::AwaitingBlocks(w) => {
                let lease_deadline = now.plus_micros(self.config.lease_us);
                let mut active = Active {
                    blocks,
                    ready_at: now,
                    lease_deadline,
                    fan_out: w.fan_out,
                    started: Vec::new(),
                    in_flight: 0,
                    failed: false,
                };
                for (reg, at) in w.registrations {
                    self.start(key, &mut active, reg, Order::RegistrationFirst, now.micros_since(at));
                }
                if usize::from(active.fan_out) > active.started.len() {
                    self.arm(lease_deadline, key);
                }
                Slot::Active(active)
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
        if let Some(t) = self.tombs.get(&id).copied().filter(|t| t.attempt == attempt) {
            self.actions.push_back(Action::Fail { key, target, kind: t.kind });
            return;
        }
        let fan_out = fan_out.max(1);
        let Some(entry) = self.entries.remove(&id) else {
            if self.pending() >= self.config.max_pending {
                self.stats.refused += 1;
                self.actions.push_back(Action::Fail { key, target, kind: FailureKind::Refused });
                return;
            }
            let deadline = now.plus_micros(self.config.registration_timeout_us);
            self.arm(deadline, key);
            let slot =
                Slot::AwaitingBlocks(AwaitingBlocks { registrations: vec![(registration, now)], fan_out, deadline });
            self.entries.insert(id, Entry { attempt, slot });
            return;
        };
        let slot = match entry.slot {
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
                if w.registrations.iter().any(|(r, _)| r.engine_id() == target.engine && r.rank() == target.rank) {
                    self.stats.duplicates += 1;
                } else if w.registrations.len() >= usize::from(w.fan_out) {
                    self.actions.push_back(Action::Fail { key, target, kind: FailureKind::Refused });
                } else {
                    w.registrations.push((registration, now));
                }
                Slot::AwaitingBlocks(w)
            }
            Slot::Active(mut a) => {
                if a.started.contains(&target) {
                    self.stats.duplicates += 1;
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
        } else {
            self.bury(now, key, FailureKind::Aborted);
        }
    }

    /// Expires leases and registration waits whose deadline is at or before `now`, and forgets old
    /// tombstones.
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some(core::cmp::Reverse((at, id, attempt))) = self.deadlines.peek().copied() {
            if at > now {
                break;
            }
            self.deadlines.pop();
            let key = Key { transfer_id: id, attempt: super::ids::Attempt(attempt) };
            let live = match self.entries.get(&id) {
                Some(Entry { attempt: a, slot }) if *a == attempt => match slot {
                    Slot::AwaitingRegistration(w) => w.lease_deadline == at,
                    Slot::AwaitingBlocks(w) => w.deadline == at,
                    Slot::Active(w) => w.lease_deadline == at && usize::from(w.fan_out) > w.started.len(),
                },
                _ => false,
            };
            if live {
                self.stats.expired += 1;
                self.end(now, key, ReleaseReason::LeaseExpired, FailureKind::LeaseExpired);
            }
        }
        while let Some(&(at, id, attempt)) = self.tomb_order.front() {
            if at > now && self.tomb_order.len() <= self.config.max_tombstones {
                break;
            }
            self.tomb_order.pop_front();
            if self.tombs.get(&id).is_some_and(|t| t.attempt == attempt) {
                self.tombs.remove(&id);
            }
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

    /// Ends the live attempt `key`: fails registrations still waiting, releases blocks (or hands
    /// them to `draining` while transfers read them), and remembers the outcome.
    fn end(&mut self, now: Instant, key: Key, reason: ReleaseReason, kind: FailureKind) {
        let Some(entry) = self.entries.remove(&key.transfer_id) else { return };
        match entry.slot {
            Slot::AwaitingRegistration(w) => self.release(key, w.blocks, reason),
            Slot::AwaitingBlocks(w) => {
                for (r, _) in w.registrations {
                    let target = Target { engine: r.engine_id().to_owned(), rank: r.rank() };
                    self.actions.push_back(Action::Fail { key, target, kind });
                }
            }
            Slot::Active(a) => {
                if a.in_flight == 0 {
                    self.release(key, a.blocks, reason);
                } else {
                    self.draining.insert(key, Draining { blocks: a.blocks, in_flight: a.in_flight, reason });
                }
            }
        }
        self.bury(now, key, kind);
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
                // A late duplicate registration for a finished key is answered, not left waiting.
                self.bury(now, key, FailureKind::Refused);
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
        self.deadlines.push(core::cmp::Reverse((at, key.transfer_id, key.attempt.0)));
    }

    fn bury(&mut self, now: Instant, key: Key, kind: FailureKind) {
        self.tombs.insert(key.transfer_id, Tomb { attempt: key.attempt.0, kind });
        self.tomb_order.push_back((now.plus_micros(self.config.tombstone_us), key.transfer_id, key.attempt.0));
        while self.tomb_order.len() > self.config.max_tombstones {
            if let Some((_, id, attempt)) = self.tomb_order.pop_front() {
                if self.tombs.get(&id).is_some_and(|t| t.attempt == attempt) {
                    self.tombs.remove(&id);
                }
            }
        }
    }
}
