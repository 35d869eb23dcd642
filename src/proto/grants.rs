//! Pull grants on the producer: which consumer may READ which request's source blocks, until when,
//! and when those blocks may go back to their owner.
//!
//! Read [`Grants`] first. The rendezvous decides that a consumer may read a request's blocks; the
//! engine sends the grant (naming the blocks) and records it here. A grant ends when the consumer
//! says its READ ended (a completion or a failure), or when the consumer is lost. Only then does the
//! engine tell the rendezvous that the read ended ([`Event::Ended`]), which may release the sources.
//!
//! A grant the consumer has not answered within the read timeout **expires**
//! ([`Event::Expired`]): the engine tells the consumer that the request failed, and the consumer
//! cancels its READ. The sources are not released then: the consumer's READ may still be running
//! (posted, held in its data path), and a READ that completes after the sources were reused hands
//! the consumer other bytes — received as its KV if it completes before our failure reaches it. An
//! expired grant ([`Grant::Expired`]) waits for the consumer's word, which a live consumer always
//! gives once its READ ended (the READ's own notification, or its failure), bounded by the
//! quarantine bound.
//!
//! The invariant (issue 16): a source block goes back only after every READ that could touch it has
//! ended or is confirmed fenced. A lost consumer's READ, posted by its own data path, cannot be
//! waited for; where the transport confirmed the fence it can no longer read, otherwise its grants
//! are **quarantined** ([`Grant::Quarantined`]): the sources stay held until the consumer comes
//! back as a new process (its old one is gone), or the bound passes.
//!
//! Sans I/O like the rest of `proto`: inputs are `handle_*(now, …)`, outputs are drained with
//! [`Grants::poll_event`], deadlines come from [`Grants::poll_timeout`]; no clock, no I/O.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

use crate::proto::msg::FailureKind;
use crate::proto::{Instant, Key};

/// The two bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrantConfig {
    /// A granted READ the consumer has not reported ended within this long expires.
    pub read_timeout_us: u64,
    /// How long the sources of a lost, unfenced consumer's grants stay held at most.
    pub quarantine_us: u64,
}

/// One grant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grant {
    /// The consumer may be reading; it expires at `deadline`.
    Reading {
        /// When it expires.
        deadline: Instant,
    },
    /// It expired: the consumer was told that the request failed, and its READ may still be running
    /// (it cancels it). Held until the consumer says the READ ended, it is lost, or `until`.
    Expired {
        /// The bound.
        until: Instant,
    },
    /// The consumer was lost without a confirmed fence: its READ may still be running. Held until
    /// the consumer returns as a new process, or `until`.
    Quarantined {
        /// The bound.
        until: Instant,
    },
}

/// Why a grant ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// The consumer said its READ ended.
    Read,
    /// It expired (the consumer did not say so in time) and then the bound passed without the
    /// consumer's word (logged: as a quarantine's bound).
    Expired,
    /// The consumer was lost and the transport confirmed the fence.
    LostFenced,
    /// A quarantined grant's consumer came back as a new process.
    Returned,
    /// A quarantined grant's bound passed (logged: the one place liveness wins).
    QuarantineExpired,
}

/// What the engine does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event<C> {
    /// The READ of `key` by `consumer` has ended (or can no longer touch the sources): hand
    /// `result` to the rendezvous.
    Ended {
        /// The request.
        key: Key,
        /// The consumer.
        consumer: C,
        /// What the rendezvous hears.
        result: Result<(), FailureKind>,
        /// Why.
        cause: Cause,
    },
    /// The grant of `key` to `consumer` expired: tell the consumer the request failed (it cancels
    /// its READ). The sources stay held until its READ ended ([`Grant::Expired`]).
    Expired {
        /// The request.
        key: Key,
        /// The consumer.
        consumer: C,
    },
    /// The consumer was lost unfenced: the grant is held (counted, logged), its sources too.
    Quarantined {
        /// The request.
        key: Key,
        /// The consumer.
        consumer: C,
    },
}

/// The producer's pull grants. See the module docs.
#[derive(Debug)]
pub struct Grants<C> {
    cfg: GrantConfig,
    grants: HashMap<(Key, C), Grant>,
    events: VecDeque<Event<C>>,
}

impl<C: Clone + Eq + Hash> Grants<C> {
    /// No grants.
    pub fn new(cfg: GrantConfig) -> Self {
        Grants { cfg, grants: HashMap::new(), events: VecDeque::new() }
    }

    // ---- getters ----

    /// Whether `consumer` may be reading `key` now and its word ends the grant (a grant reading or
    /// expired, not quarantined): its completion or failure is the end of that READ.
    pub fn is_reading(&self, key: Key, consumer: &C) -> bool {
        matches!(self.grants.get(&(key, consumer.clone())), Some(Grant::Reading { .. } | Grant::Expired { .. }))
    }

    /// The grant of `key` to `consumer`.
    pub fn get(&self, key: Key, consumer: &C) -> Option<Grant> {
        self.grants.get(&(key, consumer.clone())).copied()
    }

    /// Grants held (reading or quarantined).
    pub fn pending(&self) -> usize {
        self.grants.len()
    }

    /// Grants quarantined.
    pub fn quarantined(&self) -> usize {
        self.grants.values().filter(|g| matches!(g, Grant::Quarantined { .. })).count()
    }

    /// The requests of the grants whose consumer may still be reading without our word to come
    /// first: quarantined ones, and expired ones (the consumer was told, its READ may still run).
    pub fn held_keys(&self) -> impl Iterator<Item = Key> + '_ {
        self.grants
            .iter()
            .filter(|(_, g)| matches!(g, Grant::Expired { .. } | Grant::Quarantined { .. }))
            .map(|((key, _), _)| *key)
    }

    /// The earliest deadline.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.grants
            .values()
            .map(|g| match *g {
                Grant::Reading { deadline } => deadline,
                Grant::Expired { until } | Grant::Quarantined { until } => until,
            })
            .min()
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<Event<C>> {
        self.events.pop_front()
    }

    // ---- inputs ----

    /// The engine granted `consumer` the READ of `key`'s sources. A grant it already holds is not
    /// renewed (a quarantined one stays quarantined).
    pub fn handle_granted(&mut self, now: Instant, key: Key, consumer: C) {
        let deadline = now.plus_micros(self.cfg.read_timeout_us);
        self.grants.entry((key, consumer)).or_insert(Grant::Reading { deadline });
    }

    /// `consumer` says its READ of `key` ended (`Ok`: it read everything, before it heard of the
    /// expiry if the grant expired). Ignored unless the grant is [`Grant::Reading`] or
    /// [`Grant::Expired`]. Returns whether it ended a grant.
    pub fn handle_read_done(&mut self, key: Key, consumer: &C, result: Result<(), FailureKind>) -> bool {
        if !self.is_reading(key, consumer) {
            return false;
        }
        self.end(key, consumer.clone(), result, Cause::Read);
        true
    }

    /// `consumer` is lost. `fenced`: the transport confirmed that nothing it posted can touch our
    /// memory any more; its grants end at once. Otherwise they are quarantined.
    pub fn handle_peer_lost(&mut self, now: Instant, consumer: &C, fenced: bool) {
        let until = now.plus_micros(self.cfg.quarantine_us);
        let keys: Vec<Key> = self
            .grants
            .iter()
            .filter(|((_, c), g)| c == consumer && matches!(g, Grant::Reading { .. } | Grant::Expired { .. }))
            .map(|((k, _), _)| *k)
            .collect();
        for key in keys {
            if fenced {
                self.end(key, consumer.clone(), Err(FailureKind::PeerLost), Cause::LostFenced);
            } else {
                self.grants.insert((key, consumer.clone()), Grant::Quarantined { until });
                self.events.push_back(Event::Quarantined { key, consumer: consumer.clone() });
            }
        }
    }

    /// `consumer` was added again as a new process: its previous process is gone (its kernel
    /// closed its connections and unmapped its memory), so its READs can no longer run.
    pub fn handle_peer_returned(&mut self, consumer: &C) {
        let keys: Vec<Key> = self
            .grants
            .iter()
            .filter(|((_, c), g)| c == consumer && matches!(g, Grant::Quarantined { .. }))
            .map(|((k, _), _)| *k)
            .collect();
        for key in keys {
            self.end(key, consumer.clone(), Err(FailureKind::PeerLost), Cause::Returned);
        }
    }

    /// Time passed: grants past their deadline expire (the consumer is told; the sources stay held
    /// until it answers), expired and quarantined grants past their bound end.
    pub fn handle_timeout(&mut self, now: Instant) {
        let until = now.plus_micros(self.cfg.quarantine_us);
        let due: Vec<((Key, C), Grant)> = self
            .grants
            .iter()
            .filter(|(_, g)| match **g {
                Grant::Reading { deadline } => deadline <= now,
                Grant::Expired { until } | Grant::Quarantined { until } => until <= now,
            })
            .map(|(k, g)| (k.clone(), *g))
            .collect();
        for ((key, consumer), g) in due {
            match g {
                Grant::Reading { .. } => {
                    self.grants.insert((key, consumer.clone()), Grant::Expired { until });
                    self.events.push_back(Event::Expired { key, consumer });
                }
                Grant::Expired { .. } => self.end(key, consumer, Err(FailureKind::PeerLost), Cause::Expired),
                Grant::Quarantined { .. } => {
                    self.end(key, consumer, Err(FailureKind::PeerLost), Cause::QuarantineExpired)
                }
            }
        }
    }

    fn end(&mut self, key: Key, consumer: C, result: Result<(), FailureKind>, cause: Cause) {
        if self.grants.remove(&(key, consumer.clone())).is_some() {
            self.events.push_back(Event::Ended { key, consumer, result, cause });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CFG: GrantConfig = GrantConfig { read_timeout_us: 100, quarantine_us: 1_000 };

    fn ended(g: &mut Grants<u16>) -> Vec<(Key, u16, Cause)> {
        let mut v = Vec::new();
        while let Some(e) = g.poll_event() {
            if let Event::Ended { key, consumer, cause, .. } = e {
                v.push((key, consumer, cause));
            }
        }
        v
    }

    #[test]
    fn a_read_ends_by_the_consumers_word_or_expires() {
        let mut g = Grants::new(CFG);
        let (a, b) = (Key::new(1, 1), Key::new(2, 1));
        g.handle_granted(Instant(0), a, 7);
        g.handle_granted(Instant(10), b, 7);
        assert_eq!(g.poll_timeout(), Some(Instant(100)));
        assert!(g.handle_read_done(a, &7, Ok(())));
        assert!(!g.handle_read_done(a, &7, Ok(())), "a second word ends nothing");
        assert!(!g.handle_read_done(b, &8, Ok(())), "another consumer's word ends nothing");
        g.handle_timeout(Instant(109));
        assert_eq!(ended(&mut g), [(a, 7, Cause::Read)]);
        g.handle_timeout(Instant(110));
        assert_eq!(ended(&mut g), [], "expired, but the consumer's READ may still run");
        assert_eq!(g.get(b, &7), Some(Grant::Expired { until: Instant(1_110) }));
        assert!(g.handle_read_done(b, &7, Err(FailureKind::Aborted)), "the consumer's word ends it");
        assert_eq!(ended(&mut g), [(b, 7, Cause::Read)]);
        assert_eq!((g.pending(), g.poll_timeout()), (0, None));
    }

    /// Issue 16's pull window on P: when a grant expires the consumer is told (it cancels its READ),
    /// but the sources are not released while that READ can still run: only the consumer's word
    /// (its READ's notification or failure), its loss (fenced; unfenced it is quarantined), or the
    /// bound ends the grant. (Before, the grant ended at the expiry and the sources went back while
    /// the READ ran.)
    #[test]
    fn an_expired_grant_holds_the_sources_until_the_consumers_read_ended() {
        let mut g = Grants::new(CFG);
        let (a, b, c, d) = (Key::new(1, 1), Key::new(2, 1), Key::new(3, 1), Key::new(4, 1));
        for k in [a, b, c, d] {
            g.handle_granted(Instant(0), k, 7);
        }
        g.handle_timeout(Instant(100));
        let mut told = Vec::new();
        while let Some(e) = g.poll_event() {
            match e {
                Event::Expired { key, consumer } => told.push((key.transfer_id.0, consumer)),
                other => panic!("ended at the expiry: {other:?}"),
            }
        }
        told.sort_unstable();
        assert_eq!(told, [(1, 7), (2, 7), (3, 7), (4, 7)], "each consumer is told once");
        g.handle_timeout(Instant(200));
        assert_eq!(g.poll_event(), None, "told once, and nothing ends while the READs may run");
        assert_eq!((g.pending(), g.quarantined()), (4, 0));
        // The READ completed before the consumer heard of the expiry: it read held sources.
        assert!(g.handle_read_done(a, &7, Ok(())));
        assert!(
            matches!(g.poll_event(), Some(Event::Ended { key, result: Ok(()), cause: Cause::Read, .. }) if key == a)
        );
        // Cancelled: its failure.
        assert!(g.handle_read_done(b, &7, Err(FailureKind::TransferFailed { status: -1 })));
        assert_eq!(ended(&mut g), [(b, 7, Cause::Read)]);
        // Lost unfenced: quarantined, not ended; then it returns as a new process.
        g.handle_peer_lost(Instant(300), &7, false);
        assert_eq!(ended(&mut g), []);
        assert_eq!(g.quarantined(), 2);
        g.handle_peer_returned(&7);
        let mut got = ended(&mut g);
        got.sort_by_key(|e| e.0.transfer_id.0);
        assert_eq!(got, [(c, 7, Cause::Returned), (d, 7, Cause::Returned)]);
        // Never answered: the bound, counted as an expiry.
        g.handle_granted(Instant(2_000), a, 8);
        g.handle_timeout(Instant(2_100));
        assert!(matches!(g.poll_event(), Some(Event::Expired { .. })));
        assert_eq!(g.poll_timeout(), Some(Instant(3_100)));
        g.handle_timeout(Instant(3_099));
        assert_eq!(ended(&mut g), []);
        g.handle_timeout(Instant(3_100));
        assert_eq!(ended(&mut g), [(a, 8, Cause::Expired)]);
        // Lost fenced after the expiry: at once.
        g.handle_granted(Instant(4_000), b, 9);
        g.handle_timeout(Instant(4_100));
        g.handle_peer_lost(Instant(4_100), &9, true);
        assert_eq!(ended(&mut g), [(b, 9, Cause::LostFenced)]);
        assert_eq!(g.pending(), 0);
    }

    /// The fix of issue 16's pull window on P: a lost consumer's READ may still read the sources;
    /// unfenced, the grant is held (its sources too) until the consumer returns as a new process
    /// or the bound passes, never ended at once.
    #[test]
    fn a_lost_unfenced_consumers_grants_hold_the_sources_until_it_returns_or_the_bound() {
        let mut g = Grants::new(CFG);
        let (a, b, c) = (Key::new(1, 1), Key::new(2, 1), Key::new(3, 1));
        g.handle_granted(Instant(0), a, 7);
        g.handle_granted(Instant(0), b, 7);
        g.handle_granted(Instant(0), c, 8);
        g.handle_peer_lost(Instant(50), &7, false);
        assert_eq!(ended(&mut g), [], "ended while the lost consumer's READ may run");
        assert_eq!(g.quarantined(), 2);
        assert!(!g.is_reading(a, &7));
        assert!(!g.handle_read_done(a, &7, Ok(())), "a quarantined grant is not ended by a word");
        g.handle_timeout(Instant(200));
        assert_eq!(ended(&mut g), [], "the quarantined grants do not expire as reads");
        assert_eq!(g.get(c, &8), Some(Grant::Expired { until: Instant(1_200) }), "the live consumer's grant expired");
        assert!(g.handle_read_done(c, &8, Err(FailureKind::Aborted)));
        assert_eq!(ended(&mut g), [(c, 8, Cause::Read)]);
        g.handle_peer_returned(&7);
        let mut got = ended(&mut g);
        got.sort_by_key(|e| e.0.transfer_id.0);
        assert_eq!(got, [(a, 7, Cause::Returned), (b, 7, Cause::Returned)]);
        // The bound.
        g.handle_granted(Instant(300), a, 9);
        g.handle_peer_lost(Instant(300), &9, false);
        assert_eq!(g.poll_timeout(), Some(Instant(1_300)));
        g.handle_timeout(Instant(1_299));
        assert_eq!(ended(&mut g), []);
        g.handle_timeout(Instant(1_300));
        assert_eq!(ended(&mut g), [(a, 9, Cause::QuarantineExpired)]);
        // Fenced: at once.
        g.handle_granted(Instant(2_000), b, 9);
        g.handle_peer_lost(Instant(2_000), &9, true);
        assert_eq!(ended(&mut g), [(b, 9, Cause::LostFenced)]);
        assert_eq!(g.pending(), 0);
    }
}
