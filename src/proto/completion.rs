//! Consumer-side completion counting: a request may decode once every producer rank's part landed.
//!
//! [`Completions`] is a deterministic state machine like [`super::rendezvous::Rendezvous`]. The
//! consumer calls [`Completions::handle_registered`] when it sends a registration (with the expected
//! notification count from [`super::layout::expected_notifications`]), then feeds it the producers'
//! [`Completion`] and [`Failure`] messages, local aborts and the clock. Each registered attempt ends
//! with exactly one [`Event`], drained with [`Completions::poll_event`]:
//!
//! * [`Event::Received`] once `expected` distinct producer ranks reported completion;
//! * [`Event::Failed`] on a failure message or the timeout — its blocks are to be reported invalid so
//!   the engine's failure policy (fail or recompute) applies at once;
//! * [`Event::Aborted`] after a local abort, [`Event::Superseded`] when a newer attempt registers.
//!
//! Duplicate notifications (same producer rank twice) and notifications for older attempts or
//! unknown keys are ignored and counted, never acted on.
//!
//! **Blocks are safe to reuse when the event is seen.** A request that ends without its data (a
//! producer's failure, a local abort, the timeout, a newer attempt) may still have writes of other
//! producer ranks in flight into its blocks. Such an attempt is *draining*: its event is held until
//! every producer rank it registered with has given its final word — a completion or a failure; a
//! producer answers every registration with one or the other — or until
//! [`CompletionConfig::drain_timeout_us`] passes (a producer that is gone). Only then is the event
//! emitted, so the engine never hands out blocks a late write could still land in.
//!
//! **Quarantine: the outcome in time, the blocks later.** Waiting for a final word that may never
//! come (a producer lost without a fence, or silent past the drain timeout) must not hold the
//! outcome: the request would hang. Such an attempt ends with [`Event::Quarantined`] instead — the
//! request failed, *but its blocks stay out of use* — and the blocks follow with exactly one
//! [`Event::Released`] once every producer rank gave its final word or had its access torn down
//! ([`Completions::handle_fenced`]), or once [`CompletionConfig::quarantine_us`] passed (the bound:
//! counted in [`CompletionStats::quarantine_expired`]). Quarantined attempts count against
//! [`CompletionConfig::max_pending`], so the quarantine is bounded in size too.

use std::collections::{HashMap, VecDeque};

use super::deadlines::Deadlines;
use super::ids::{Instant, Key, Rank, TransferId};
use super::layerwise::{Landed, LayerCompletion, LayerStats, LayerTracker};
use super::msg::{Completion, Failure, FailureKind, Registration};

/// Limits and durations of completion counting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompletionConfig {
    /// How long a registered request waits for all its parts (µs).
    pub timeout_us: u64,
    /// Most requests waiting at once (over it, `handle_registered` refuses).
    pub max_pending: usize,
    /// After a request fails, is aborted or superseded, how long to wait for the producer ranks
    /// that have not given their final word before reporting it anyway (µs). See [`Completions`].
    pub drain_timeout_us: u64,
    /// Longest time the blocks of a quarantined attempt ([`Event::Quarantined`]) are held for
    /// producer ranks that may still write into them (µs); then they are released anyway.
    pub quarantine_us: u64,
}

impl Default for CompletionConfig {
    fn default() -> Self {
        Self { timeout_us: 120_000_000, max_pending: 65_536, drain_timeout_us: 10_000_000, quarantine_us: 120_000_000 }
    }
}

/// Why a request failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FailReason {
    /// A producer rank reported a failure.
    Producer {
        /// The rank.
        rank: Rank,
        /// What went wrong.
        kind: FailureKind,
        /// The producer's detail text.
        detail: String,
    },
    /// Not every part arrived in time.
    Timeout {
        /// Parts received.
        received: u32,
        /// Parts expected.
        expected: u32,
    },
}

/// How a registered attempt ended: exactly one outcome (every variant but [`Event::Draining`] and
/// [`Event::Released`]) per `handle_registered` that returned `Ok`, possibly preceded by one
/// `Draining`; a [`Event::Quarantined`] outcome is followed by exactly one `Released`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Every part landed; the request may decode.
    Received {
        /// Which transfer and attempt.
        key: Key,
        /// Time from registration to the last part (µs).
        waited_us: u64,
    },
    /// The KV will not arrive; `invalid_blocks` (per KV group) must be reported invalid.
    Failed {
        /// Which transfer and attempt.
        key: Key,
        /// Why.
        reason: FailReason,
        /// The blocks that were registered.
        invalid_blocks: Vec<Vec<u32>>,
    },
    /// Aborted locally; the engine frees the blocks itself.
    Aborted {
        /// Which transfer and attempt.
        key: Key,
    },
    /// A newer attempt registered; this one's blocks are no longer written.
    Superseded {
        /// The older attempt.
        key: Key,
        /// Its blocks.
        invalid_blocks: Vec<Vec<u32>>,
    },
    /// Not an outcome: `key` ended without its data (failure, abort, timeout or a newer attempt) and
    /// some producer ranks have not answered yet. Tell them to stop (an abort); the outcome follows
    /// once they all answered or the drain timeout passed.
    Draining {
        /// The attempt that ended.
        key: Key,
    },
    /// The attempt ended without its data (`ended`: the [`Event::Failed`], [`Event::Aborted`] or
    /// [`Event::Superseded`] it would have been) while a producer rank that may still write into its
    /// blocks cannot give its final word in time (lost without a fence, or silent past the drain
    /// timeout). Report the request's end now, but keep `blocks` out of use until
    /// [`Event::Released`].
    Quarantined {
        /// The attempt.
        key: Key,
        /// The outcome it stands for.
        ended: Box<Event>,
        /// Its blocks (per KV group), held.
        blocks: Vec<Vec<u32>>,
        /// Why it could not wait.
        why: QuarantineCause,
    },
    /// Not an outcome: the blocks of a quarantined attempt may be reused (every producer rank gave
    /// its final word or was fenced, or the quarantine bound passed: `expired`).
    Released {
        /// The attempt.
        key: Key,
        /// Released by the time bound, without every producer's final word.
        expired: bool,
    },
}

impl Event {
    /// The attempt this event is about.
    pub fn key(&self) -> Key {
        match self {
            Event::Received { key, .. }
            | Event::Failed { key, .. }
            | Event::Aborted { key }
            | Event::Superseded { key, .. }
            | Event::Draining { key }
            | Event::Quarantined { key, .. }
            | Event::Released { key, .. } => *key,
        }
    }
}

/// Why an attempt was quarantined ([`Event::Quarantined`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuarantineCause {
    /// A producer rank was lost and its access to our memory could not be confirmed torn down.
    LostUnfenced(Rank),
    /// Some producer ranks had not answered by the drain timeout.
    DrainTimeout,
}

/// Refusal of [`Completions::handle_registered`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterError {
    /// Too many requests are waiting.
    #[error("{pending} requests already wait for their KV (limit {max})")]
    Full {
        /// Requests waiting.
        pending: usize,
        /// The limit.
        max: usize,
    },
    /// The key's attempt is older than (or equal to) one already registered.
    #[error("attempt {attempt} is not newer than the registered attempt {live}")]
    Stale {
        /// Attempt given.
        attempt: u32,
        /// Attempt already registered.
        live: u32,
    },
    /// Zero expected notifications cannot complete.
    #[error("expected notification count must be at least 1")]
    ZeroExpected,
}

/// Counters of completion counting (monotonic).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CompletionStats {
    /// Registrations accepted.
    pub registered: u64,
    /// Completion notifications counted.
    pub notifications: u64,
    /// Repeated notifications from the same producer rank.
    pub duplicates: u64,
    /// Notifications or failures for an older attempt.
    pub stale: u64,
    /// Notifications or failures for no known request.
    pub unknown: u64,
    /// Requests received.
    pub received: u64,
    /// Requests failed by a producer.
    pub failed: u64,
    /// Requests failed by the timeout.
    pub timed_out: u64,
    /// Ended requests reported by the drain timeout, without every producer's final word.
    pub drain_expired: u64,
    /// Attempts quarantined ([`Event::Quarantined`]).
    pub quarantined: u64,
    /// Quarantines released by the time bound ([`CompletionConfig::quarantine_us`]).
    pub quarantine_expired: u64,
}

#[derive(Debug)]
struct Waiting {
    attempt: u32,
    expected: u32,
    from: Vec<Rank>,
    registered_at: Instant,
    deadline: Instant,
    blocks: Vec<Vec<u32>>,
}

/// An attempt that ended without its data, held until its producers have all answered. Quarantined
/// attempts keep the same record (`event` then is the `Quarantined` already emitted).
#[derive(Debug)]
struct Draining {
    expected: u32,
    heard: Vec<Rank>,
    deadline: Instant,
    event: Event,
    blocks: Vec<Vec<u32>>,
}

/// The consumer's completion counter. See the module docs.
#[derive(Debug)]
pub struct Completions {
    config: CompletionConfig,
    waiting: HashMap<TransferId, Waiting>,
    draining: HashMap<Key, Draining>,
    /// Quarantined attempts: outcome reported, blocks held (see the module docs).
    quarantined: HashMap<Key, Draining>,
    /// Outcomes waiting for an older attempt of their transfer to finish draining ([`Completions::emit`]).
    behind: Vec<Event>,
    deadlines: Deadlines,
    events: VecDeque<Event>,
    stats: CompletionStats,
    /// Layer-wise push: layers landed per (key, producer rank) until the rank's part is complete.
    layers: LayerTracker,
}

impl Completions {
    /// An empty counter.
    pub fn new(config: CompletionConfig) -> Self {
        Self {
            config,
            waiting: HashMap::new(),
            draining: HashMap::new(),
            quarantined: HashMap::new(),
            behind: Vec::new(),
            deadlines: Deadlines::default(),
            events: VecDeque::new(),
            stats: CompletionStats::default(),
            layers: LayerTracker::default(),
        }
    }

    // ---- getters ----

    /// Requests waiting for parts, ended and waiting for their producers' final words, or
    /// quarantined (their blocks held).
    pub fn pending(&self) -> usize {
        self.waiting.len() + self.draining.len() + self.quarantined.len() + self.behind.len()
    }

    /// Attempts quarantined now (their outcome reported, their blocks held).
    pub fn quarantined(&self) -> usize {
        self.quarantined.len()
    }

    /// Whether `key` waits for parts or for its producers' final words (it owes its outcome).
    pub fn owes_outcome(&self, key: Key) -> bool {
        self.progress(key).is_some() || self.draining.contains_key(&key)
    }

    /// The attempts quarantined now.
    pub fn quarantined_keys(&self) -> impl Iterator<Item = Key> + '_ {
        self.quarantined.keys().copied()
    }

    /// Counters so far.
    pub fn stats(&self) -> CompletionStats {
        self.stats
    }

    /// `(received, expected)` parts of the live attempt of `key`, if it is registered.
    pub fn progress(&self, key: Key) -> Option<(u32, u32)> {
        self.waiting
            .get(&key.transfer_id)
            .filter(|w| w.attempt == key.attempt.0)
            .map(|w| (w.from.len() as u32, w.expected))
    }

    /// Every attempt that still owes its outcome (waiting for parts, draining, or with an outcome not
    /// yet polled), each once with the blocks it registered (empty where the counter no longer keeps
    /// them). A driver that can no longer run this counter (its thread panicked) fails exactly these.
    pub fn held(&self) -> Vec<(Key, Vec<Vec<u32>>)> {
        let blocks_of = |e: &Event| match e {
            Event::Failed { invalid_blocks, .. } | Event::Superseded { invalid_blocks, .. } => invalid_blocks.clone(),
            _ => Vec::new(),
        };
        let mut held: Vec<(Key, Vec<Vec<u32>>)> = self
            .waiting
            .iter()
            .map(|(id, w)| (Key { transfer_id: *id, attempt: super::ids::Attempt(w.attempt) }, w.blocks.clone()))
            .chain(self.draining.iter().map(|(k, d)| (*k, d.blocks.clone())))
            .chain(self.events.iter().chain(&self.behind).filter_map(|e| match e {
                Event::Draining { .. } | Event::Released { .. } => None,
                Event::Quarantined { key, blocks, .. } => Some((*key, blocks.clone())),
                Event::Received { key, .. }
                | Event::Failed { key, .. }
                | Event::Aborted { key }
                | Event::Superseded { key, .. } => Some((*key, blocks_of(e))),
            }))
            .collect();
        held.sort_by_key(|(k, _)| (k.transfer_id.0, k.attempt.0));
        held.dedup_by_key(|(k, _)| *k);
        held
    }

    // ---- outputs ----

    /// Counters of layer-wise notifications so far.
    pub fn layer_stats(&self) -> LayerStats {
        self.layers.stats()
    }

    /// Keys with layers landed and no outcome polled yet (memory held by layer-wise counting).
    pub fn layer_keys(&self) -> usize {
        self.layers.keys()
    }

    /// The next event, in order.
    pub fn poll_event(&mut self) -> Option<Event> {
        let event = self.events.pop_front()?;
        match &event {
            // A quarantined attempt's outcome is out; its late layers are stale from now on.
            Event::Draining { .. } | Event::Released { .. } => {}
            Event::Received { key, .. }
            | Event::Failed { key, .. }
            | Event::Aborted { key }
            | Event::Superseded { key, .. }
            | Event::Quarantined { key, .. } => self.layers.forget(*key),
        }
        Some(event)
    }

    /// The earliest time [`Completions::handle_timeout`] has something to do.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.deadlines.next()
    }

    // ---- inputs ----

    /// The consumer sent `registration` and now waits for `expected` completion notifications.
    pub fn handle_registered(
        &mut self,
        now: Instant,
        registration: &Registration,
        expected: u32,
    ) -> Result<(), RegisterError> {
        if expected == 0 {
            return Err(RegisterError::ZeroExpected);
        }
        let key = registration.key();
        let id = key.transfer_id;
        if let Some(w) = self.waiting.get(&id) {
            if w.attempt >= key.attempt.0 {
                return Err(RegisterError::Stale { attempt: key.attempt.0, live: w.attempt });
            }
            if let Some(old) = self.waiting.remove(&id) {
                let old_key = Key { transfer_id: id, attempt: super::ids::Attempt(old.attempt) };
                let heard = old.from.clone();
                let event = Event::Superseded { key: old_key, invalid_blocks: old.blocks.clone() };
                self.drain(now, old_key, (old.expected, heard), event, old.blocks);
            }
        } else if self.pending() >= self.config.max_pending {
            return Err(RegisterError::Full { pending: self.pending(), max: self.config.max_pending });
        }
        let deadline = now.plus_micros(self.config.timeout_us);
        self.deadlines.push(deadline, key);
        self.waiting.insert(
            id,
            Waiting {
                attempt: key.attempt.0,
                expected,
                from: Vec::with_capacity(expected.min(64) as usize),
                registered_at: now,
                deadline,
                blocks: registration.block_ids().to_vec(),
            },
        );
        self.stats.registered += 1;
        Ok(())
    }

    /// A producer rank's completion notification arrived.
    pub fn handle_completion(&mut self, now: Instant, c: &Completion) {
        if self.heard_while_draining(c.key, c.rank) {
            return;
        }
        let Some(w) = self.live(c.key) else { return };
        if w.from.contains(&c.rank) {
            self.stats.duplicates += 1;
            return;
        }
        w.from.push(c.rank);
        let done = w.from.len() as u32 >= w.expected;
        let waited_us = now.micros_since(w.registered_at);
        self.stats.notifications += 1;
        if done {
            self.waiting.remove(&c.key.transfer_id);
            self.stats.received += 1;
            self.emit(Event::Received { key: c.key, waited_us });
        }
    }

    /// A producer rank's layer notification arrived (layer-wise push; the caller checked its ranges
    /// against the producer's layout and that `part` is what the producer rank writes into this
    /// rank). The rank counts as a [`Completion`] once every layer of its part has landed; until then
    /// it has not given its final word, so a draining request keeps waiting for it.
    pub fn handle_layers(&mut self, now: Instant, c: &LayerCompletion) {
        let whole = Completion { key: c.key, rank: c.rank };
        let known = self.draining.contains_key(&c.key)
            || self.waiting.get(&c.key.transfer_id).is_some_and(|w| w.attempt == c.key.attempt.0);
        if !known {
            // Counted as stale or unknown, like a whole-request notification.
            self.handle_completion(now, &whole);
            return;
        }
        match self.layers.add(c) {
            Landed::Complete => self.handle_completion(now, &whole),
            Landed::Partial | Landed::Conflict => {}
            Landed::Duplicate => self.stats.duplicates += 1,
        }
    }

    /// A producer rank reported that its part will not arrive.
    pub fn handle_failure(&mut self, now: Instant, f: &Failure) {
        if self.heard_while_draining(f.key, f.rank) {
            return;
        }
        if self.live(f.key).is_none() {
            return;
        }
        if let Some(w) = self.waiting.remove(&f.key.transfer_id) {
            self.stats.failed += 1;
            let reason = FailReason::Producer { rank: f.rank, kind: f.kind, detail: f.detail.clone() };
            let mut heard = w.from;
            heard.push(f.rank);
            let event = Event::Failed { key: f.key, reason, invalid_blocks: w.blocks.clone() };
            self.drain(now, f.key, (w.expected, heard), event, w.blocks);
        }
    }

    /// The consumer engine aborted `key` (e.g. the client went away).
    pub fn handle_abort(&mut self, now: Instant, key: Key) {
        if self.waiting.get(&key.transfer_id).is_some_and(|w| w.attempt == key.attempt.0) {
            if let Some(w) = self.waiting.remove(&key.transfer_id) {
                self.drain(now, key, (w.expected, w.from), Event::Aborted { key }, w.blocks);
            }
        }
    }

    /// Fails every request whose deadline is at or before `now`, and reports every draining
    /// request whose drain deadline passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some((at, key)) = self.deadlines.pop_due(now) {
            let (id, attempt) = (key.transfer_id, key.attempt.0);
            if self.draining.get(&key).is_some_and(|d| d.deadline == at) {
                // Some producer rank never answered: it may still be writing. The outcome is due
                // now; the blocks are not.
                if let Some(d) = self.draining.remove(&key) {
                    self.stats.drain_expired += 1;
                    self.quarantine(now, key, d, QuarantineCause::DrainTimeout);
                }
                continue;
            }
            if self.quarantined.get(&key).is_some_and(|d| d.deadline == at) {
                if self.quarantined.remove(&key).is_some() {
                    self.stats.quarantine_expired += 1;
                    self.emit(Event::Released { key, expired: true });
                }
                continue;
            }
            let due = self.waiting.get(&id).is_some_and(|w| w.attempt == attempt && w.deadline == at);
            if !due {
                continue;
            }
            if let Some(w) = self.waiting.remove(&id) {
                self.stats.timed_out += 1;
                let reason = FailReason::Timeout { received: w.from.len() as u32, expected: w.expected };
                let event = Event::Failed { key, reason, invalid_blocks: w.blocks.clone() };
                self.drain(now, key, (w.expected, w.from), event, w.blocks);
            }
        }
    }

    /// Producer rank `rank` of the live or draining attempt `key` was lost. `fenced`: its access to
    /// our memory was torn down (nothing it posted can land any more), which is its final word;
    /// otherwise it may still write and will never answer, so the attempt ends now, quarantined.
    pub fn handle_lost(&mut self, now: Instant, key: Key, rank: Rank, fenced: bool, detail: &str) {
        if fenced {
            let f = Failure { key, rank, kind: FailureKind::PeerLost, detail: detail.to_owned() };
            return self.handle_failure(now, &f);
        }
        let cause = QuarantineCause::LostUnfenced(rank);
        if let Some(d) = self.draining.remove(&key) {
            return self.quarantine(now, key, d, cause);
        }
        if self.live(key).is_none() {
            return;
        }
        if let Some(w) = self.waiting.remove(&key.transfer_id) {
            self.stats.failed += 1;
            let reason = FailReason::Producer { rank, kind: FailureKind::PeerLost, detail: detail.to_owned() };
            let event = Event::Failed { key, reason, invalid_blocks: w.blocks.clone() };
            let d = Draining { expected: w.expected, heard: w.from, deadline: now, event, blocks: w.blocks };
            self.quarantine(now, key, d, cause);
        }
    }

    /// The access of a lost producer rank `rank` to our memory was torn down since (it came back as
    /// a new process): for a quarantined `key` it counts as that rank's final word.
    pub fn handle_fenced(&mut self, key: Key, rank: Rank) {
        self.heard_while_quarantined(key, rank);
    }

    /// Holds `event` until `expected` distinct producer ranks have given their final word (`heard`
    /// so far) or the drain timeout passes; emits it at once if all have.
    fn drain(
        &mut self,
        now: Instant,
        key: Key,
        (expected, mut heard): (u32, Vec<Rank>),
        event: Event,
        blocks: Vec<Vec<u32>>,
    ) {
        heard.sort_unstable();
        heard.dedup();
        if heard.len() as u32 >= expected {
            self.emit(event);
            return;
        }
        let deadline = now.plus_micros(self.config.drain_timeout_us);
        self.deadlines.push(deadline, key);
        self.draining.insert(key, Draining { expected, heard, deadline, event, blocks });
        self.events.push_back(Event::Draining { key });
    }

    /// Emits the outcome of the ended attempt `d` now, quarantined: its blocks stay held until its
    /// producers all answered or the quarantine bound passes.
    fn quarantine(&mut self, now: Instant, key: Key, mut d: Draining, why: QuarantineCause) {
        self.stats.quarantined += 1;
        let ended = Box::new(std::mem::replace(&mut d.event, Event::Released { key, expired: false }));
        let blocks = d.blocks.clone();
        self.quarantined.insert(key, Draining { deadline: now.plus_micros(self.config.quarantine_us), ..d });
        self.deadlines.push(now.plus_micros(self.config.quarantine_us), key);
        self.emit(Event::Quarantined { key, ended, blocks, why });
    }

    /// Queues outcome `event` — behind the outcome of an older attempt of the same transfer that is
    /// still draining: the owner sees one transfer's attempts end in order (a newer attempt is never
    /// reported while an older one may still write, possibly into the same blocks). Then hands out
    /// what no longer waits.
    fn emit(&mut self, event: Event) {
        self.behind.push(event);
        // Per transfer, older attempts first (stable: one attempt's events keep their order).
        self.behind.sort_by_key(|e| e.key().attempt.0);
        let mut i = 0;
        while i < self.behind.len() {
            let key = self.behind[i].key();
            let older_draining =
                self.draining.keys().any(|d| d.transfer_id == key.transfer_id && d.attempt.0 < key.attempt.0);
            let earlier_held = self.behind[..i].iter().any(|e| e.key().transfer_id == key.transfer_id);
            if older_draining || earlier_held {
                i += 1;
            } else {
                let e = self.behind.remove(i);
                self.events.push_back(e);
                i = 0;
            }
        }
    }

    /// Records a final word from `rank` for a draining or quarantined `key`; emits its event once all
    /// have spoken. Returns whether `key` was draining or quarantined.
    fn heard_while_draining(&mut self, key: Key, rank: Rank) -> bool {
        if self.heard_while_quarantined(key, rank) {
            return true;
        }
        let Some(d) = self.draining.get_mut(&key) else { return false };
        if !d.heard.contains(&rank) {
            d.heard.push(rank);
        }
        if d.heard.len() as u32 >= d.expected {
            if let Some(d) = self.draining.remove(&key) {
                self.emit(d.event);
            }
        }
        true
    }

    /// As [`Completions::heard_while_draining`], for a quarantined `key`: releases its blocks once
    /// every producer rank has spoken.
    fn heard_while_quarantined(&mut self, key: Key, rank: Rank) -> bool {
        let Some(d) = self.quarantined.get_mut(&key) else { return false };
        if !d.heard.contains(&rank) {
            d.heard.push(rank);
        }
        if d.heard.len() as u32 >= d.expected && self.quarantined.remove(&key).is_some() {
            self.emit(Event::Released { key, expired: false });
        }
        true
    }

    /// The live waiting attempt matching `key`, counting stale and unknown keys.
    fn live(&mut self, key: Key) -> Option<&mut Waiting> {
        match self.waiting.get_mut(&key.transfer_id) {
            Some(w) if w.attempt == key.attempt.0 => Some(w),
            Some(_) => {
                self.stats.stale += 1;
                None
            }
            None => {
                self.stats.unknown += 1;
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::testutil::small_layout;

    fn reg(id: u128, attempt: u32) -> Registration {
        let l = small_layout();
        Registration::new(Key::new(id, attempt), "d".into(), l.parallel.rank(), 32, vec![vec![1, 2], vec![3]], &l)
            .expect("fits")
    }

    /// Completions under `cfg` with the requests `(id, attempt, producer ranks)` registered at 0.
    fn registered(cfg: CompletionConfig, regs: &[(u128, u32, u32)]) -> Completions {
        let mut c = Completions::new(cfg);
        for &(id, attempt, producers) in regs {
            c.handle_registered(Instant(0), &reg(id, attempt), producers).expect("registers");
        }
        c
    }

    /// Timeouts of a test: `timeout_us`, drain 50 µs, quarantine 500 µs.
    fn short(timeout_us: u64, max_pending: usize) -> CompletionConfig {
        CompletionConfig { timeout_us, max_pending, drain_timeout_us: 50, quarantine_us: 500 }
    }

    fn done(id: u128, attempt: u32, tp: u16) -> Completion {
        Completion { key: Key::new(id, attempt), rank: Rank::new(tp, 0) }
    }

    #[test]
    fn counts_distinct_producers_and_ignores_duplicates_and_stale() {
        let mut c = registered(CompletionConfig::default(), &[(1, 2, 2)]);
        c.handle_completion(Instant(5), &done(1, 2, 0));
        c.handle_completion(Instant(6), &done(1, 2, 0));
        c.handle_completion(Instant(7), &done(1, 1, 1));
        c.handle_completion(Instant(7), &done(9, 1, 1));
        assert_eq!(c.poll_event(), None);
        assert_eq!(c.progress(Key::new(1, 2)), Some((1, 2)));
        c.handle_completion(Instant(10), &done(1, 2, 1));
        assert_eq!(c.poll_event(), Some(Event::Received { key: Key::new(1, 2), waited_us: 10 }));
        let s = c.stats();
        assert_eq!((s.duplicates, s.stale, s.unknown, s.received), (1, 1, 1, 1));
        // A late duplicate after completion is unknown, not a second event.
        c.handle_completion(Instant(11), &done(1, 2, 1));
        assert_eq!(c.poll_event(), None);
    }

    #[test]
    fn failure_and_timeout_report_blocks_invalid() {
        let mut c = registered(short(100, 8), &[(1, 1, 1), (2, 1, 2)]);
        let f =
            Failure { key: Key::new(1, 1), rank: Rank::new(0, 0), kind: FailureKind::LeaseExpired, detail: "x".into() };
        c.handle_failure(Instant(3), &f);
        match c.poll_event() {
            Some(Event::Failed { key, invalid_blocks, .. }) => {
                assert_eq!(key, Key::new(1, 1));
                assert_eq!(invalid_blocks, vec![vec![1, 2], vec![3]]);
            }
            other => panic!("expected failure, got {other:?}"),
        }
        c.handle_completion(Instant(4), &done(2, 1, 0));
        assert_eq!(c.poll_timeout(), Some(Instant(100)));
        c.handle_timeout(Instant(99));
        assert_eq!(c.poll_event(), None);
        // The timeout ends request 2, but producer rank 1 never answered: its write could still
        // land, so the event waits for its final word (or the drain timeout).
        c.handle_timeout(Instant(100));
        assert_eq!(c.poll_event(), Some(Event::Draining { key: Key::new(2, 1) }));
        assert_eq!(c.poll_event(), None);
        assert_eq!(c.pending(), 1);
        let late =
            Failure { key: Key::new(2, 1), rank: Rank::new(1, 0), kind: FailureKind::Aborted, detail: "".into() };
        c.handle_failure(Instant(120), &late);
        assert!(matches!(
            c.poll_event(),
            Some(Event::Failed { reason: FailReason::Timeout { received: 1, expected: 2 }, .. })
        ));
        assert_eq!(c.pending(), 0);
    }

    #[test]
    fn ended_requests_wait_for_every_producer_or_the_drain_timeout() {
        // Two producers; the first fails: the second may still be writing.
        let mut c = registered(short(1000, 8), &[(1, 1, 2)]);
        let f =
            Failure { key: Key::new(1, 1), rank: Rank::new(0, 0), kind: FailureKind::PlanFailed, detail: "".into() };
        c.handle_failure(Instant(1), &f);
        assert_eq!(c.poll_event(), Some(Event::Draining { key: Key::new(1, 1) }));
        assert_eq!(c.poll_event(), None);
        // Its write lands: now the blocks are quiet and the failure is reported.
        c.handle_completion(Instant(5), &done(1, 1, 1));
        assert!(matches!(c.poll_event(), Some(Event::Failed { .. })));
        assert_eq!(c.stats().received, 0);
        // A local abort with nobody heard from: reported at the drain timeout.
        c.handle_registered(Instant(10), &reg(2, 1), 2).expect("registers");
        c.handle_abort(Instant(11), Key::new(2, 1));
        assert_eq!(c.poll_event(), Some(Event::Draining { key: Key::new(2, 1) }));
        assert_eq!(c.poll_event(), None);
        c.handle_timeout(Instant(60));
        assert_eq!(c.poll_event(), None);
        // Reported at the drain timeout, but quarantined: nobody gave its final word.
        c.handle_timeout(Instant(61));
        assert!(
            matches!(c.poll_event(), Some(Event::Quarantined { ended, .. }) if *ended == Event::Aborted { key: Key::new(2, 1) })
        );
        assert_eq!(c.stats().drain_expired, 1);
        assert_eq!(c.pending(), 1);
        c.handle_timeout(Instant(561));
        assert_eq!(c.poll_event(), Some(Event::Released { key: Key::new(2, 1), expired: true }));
        assert_eq!(c.pending(), 0);
    }

    #[test]
    fn newer_attempt_supersedes_and_bounds_hold() {
        let mut c = registered(short(100, 2), &[(1, 1, 1), (3, 1, 1)]);
        assert_eq!(c.handle_registered(Instant(0), &reg(2, 1), 1), Err(RegisterError::Full { pending: 2, max: 2 }));
        assert!(matches!(c.handle_registered(Instant(0), &reg(1, 1), 1), Err(RegisterError::Stale { .. })));
        c.handle_registered(Instant(1), &reg(1, 2), 1).expect("newer attempt");
        // Attempt 1 drains until its producer answers (its write of attempt 1 may be in flight).
        assert_eq!(c.poll_event(), Some(Event::Draining { key: Key::new(1, 1) }));
        assert_eq!(c.poll_event(), None);
        assert_eq!(c.pending(), 3, "the draining attempt still holds its blocks");
        c.handle_completion(Instant(2), &done(1, 1, 0));
        assert!(matches!(c.poll_event(), Some(Event::Superseded { key, .. }) if key == Key::new(1, 1)));
        assert_eq!(c.stats().received, 0);
        c.handle_completion(Instant(3), &done(1, 2, 0));
        assert_eq!(c.poll_event(), Some(Event::Received { key: Key::new(1, 2), waited_us: 2 }));
        // Request 3 times out (its producer never answered), drains, and is reported at the drain
        // timeout; attempt 1's old deadline fires into nothing.
        c.handle_timeout(Instant(1000));
        assert_eq!(c.poll_event(), Some(Event::Draining { key: Key::new(3, 1) }));
        assert_eq!(c.poll_event(), None);
        c.handle_timeout(Instant(2000));
        assert!(matches!(c.poll_event(), Some(Event::Quarantined { key, ended, .. })
            if key == Key::new(3, 1) && matches!(*ended, Event::Failed { .. })));
        assert_eq!(c.poll_event(), None);
        c.handle_timeout(Instant(3000));
        assert!(matches!(c.poll_event(), Some(Event::Released { key, expired: true }) if key == Key::new(3, 1)));
        assert_eq!(c.pending(), 0);
    }

    /// Issue 16, window 3: a producer rank silent past the drain timeout may still be writing. The
    /// outcome is due (the request must not hang), but the blocks stay held until that rank's final
    /// word, or the quarantine bound.
    #[test]
    fn the_drain_timeout_reports_the_outcome_but_holds_the_blocks() {
        let mut c = registered(short(100, 8), &[(1, 1, 2), (2, 1, 1)]);
        c.handle_abort(Instant(1), Key::new(1, 1));
        c.handle_abort(Instant(1), Key::new(2, 1));
        assert_eq!(c.poll_event(), Some(Event::Draining { key: Key::new(1, 1) }));
        assert_eq!(c.poll_event(), Some(Event::Draining { key: Key::new(2, 1) }));
        c.handle_timeout(Instant(51));
        for id in [1, 2] {
            match c.poll_event() {
                Some(Event::Quarantined { key, ended, blocks, why }) => {
                    assert_eq!((key, why), (Key::new(id, 1), QuarantineCause::DrainTimeout));
                    assert_eq!(*ended, Event::Aborted { key });
                    assert_eq!(blocks, vec![vec![1, 2], vec![3]]);
                }
                other => panic!("expected the quarantined outcome of {id}, got {other:?}"),
            }
        }
        assert_eq!(c.poll_event(), None, "the blocks are not released with the outcome");
        assert_eq!((c.quarantined(), c.pending()), (2, 2));
        // One rank of request 1 speaks: one of two; request 2's only rank speaks: released.
        c.handle_completion(Instant(60), &done(1, 1, 0));
        c.handle_completion(Instant(60), &done(1, 1, 0));
        assert_eq!(c.poll_event(), None);
        let f = Failure { key: Key::new(2, 1), rank: Rank::new(0, 0), kind: FailureKind::Aborted, detail: "".into() };
        c.handle_failure(Instant(61), &f);
        assert_eq!(c.poll_event(), Some(Event::Released { key: Key::new(2, 1), expired: false }));
        // Request 1's second rank never speaks: released by the bound, counted.
        c.handle_timeout(Instant(550));
        assert_eq!(c.poll_event(), None);
        c.handle_timeout(Instant(551));
        assert_eq!(c.poll_event(), Some(Event::Released { key: Key::new(1, 1), expired: true }));
        let s = c.stats();
        assert_eq!((s.drain_expired, s.quarantined, s.quarantine_expired), (2, 2, 1));
        assert_eq!(c.pending(), 0);
    }

    /// A producer rank lost without a fence never answers: the attempt fails at once (no hang), its
    /// blocks quarantined until the rank is fenced (it came back as a new process).
    #[test]
    fn a_producer_lost_unfenced_fails_at_once_and_holds_the_blocks() {
        let mut c = registered(CompletionConfig::default(), &[(1, 1, 1), (2, 1, 1)]);
        c.handle_lost(Instant(5), Key::new(1, 1), Rank::new(0, 0), false, "cut");
        match c.poll_event() {
            Some(Event::Quarantined { key, ended, why, .. }) => {
                assert_eq!((key, why), (Key::new(1, 1), QuarantineCause::LostUnfenced(Rank::new(0, 0))));
                assert!(matches!(*ended, Event::Failed { .. }));
            }
            other => panic!("expected a quarantined failure, got {other:?}"),
        }
        assert_eq!(c.poll_event(), None);
        c.handle_fenced(Key::new(1, 1), Rank::new(0, 0));
        assert_eq!(c.poll_event(), Some(Event::Released { key: Key::new(1, 1), expired: false }));
        // Fenced at once: a plain failure, the blocks free with it.
        c.handle_lost(Instant(6), Key::new(2, 1), Rank::new(0, 0), true, "cut");
        assert!(matches!(c.poll_event(), Some(Event::Failed { key, .. }) if key == Key::new(2, 1)));
        assert_eq!(c.pending(), 0);
    }

    /// A newer attempt's outcome waits for the older attempt of the same transfer to finish
    /// draining: the owner never sees attempt 2 end while attempt 1 may still write.
    #[test]
    fn a_newer_attempt_is_reported_after_the_older_one_drained() {
        let mut c = registered(CompletionConfig::default(), &[(1, 1, 1)]);
        c.handle_registered(Instant(1), &reg(1, 2), 1).expect("newer attempt");
        assert_eq!(c.poll_event(), Some(Event::Draining { key: Key::new(1, 1) }));
        // Attempt 2's part lands before attempt 1's final word.
        c.handle_completion(Instant(2), &done(1, 2, 0));
        assert_eq!(c.poll_event(), None, "attempt 2 reported while attempt 1 drains");
        assert_eq!(c.pending(), 2);
        c.handle_completion(Instant(3), &done(1, 1, 0));
        assert!(matches!(c.poll_event(), Some(Event::Superseded { key, .. }) if key == Key::new(1, 1)));
        assert_eq!(c.poll_event(), Some(Event::Received { key: Key::new(1, 2), waited_us: 1 }));
        assert_eq!(c.pending(), 0);
    }
}
