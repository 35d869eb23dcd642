//! Layer-wise push on virtual time: producer ranks that each run a [`LayerSend`] per request, one
//! consumer rank with a [`Completions`], and a network that delays (so reorders) and sometimes
//! repeats messages.
//!
//! Each producer rank makes its layers final in random chunks at random times (prefill), the
//! consumer registers at a random time (before, between or after the layers become final), and the
//! schedule may abort the request on the consumer, fail a WRITE or let the consumer's timeout run
//! out. A producer rank posts each run of final layers once the registration is there (one batch for
//! what became final before it), and answers an abort — or its own failed WRITE — with a `Failure`
//! once nothing of its is in flight, as the engine's writer does.
//!
//! Invariants checked:
//!
//! * every accepted registration ends with exactly one outcome;
//! * `Received` only when every layer of every producer rank's part has landed in the consumer's
//!   blocks (the oracle marks layers when a WRITE ends, before its notification leaves);
//! * fail closed: when `Failed` or `Aborted` is emitted, no WRITE into the consumer's blocks is in
//!   flight;
//! * nothing lost: a request with no abort, failure or timeout is received;
//! * each layer is posted at most once per producer rank;
//! * at quiescence the consumer holds nothing (`pending() == 0`, no layer counts kept).

use std::collections::{BTreeMap, HashSet};
use std::ops::Range;

use kvpush::proto::completion::{CompletionConfig, Completions, Event};
use kvpush::proto::layerwise::{part_layers, LayerCompletion, LayerSend, LayerSet};
use kvpush::proto::layout::{expected_notifications, KvLayout, Parallel};
use kvpush::proto::msg::{Failure, FailureKind, Registration};
use kvpush::proto::{Instant, Key, Rank};
use kvpush_testkit::layouts;
use kvpush_testkit::rng::Rng;

const KEY: Key = Key::new(0x51, 1);
const TOKENS: u64 = 40;

/// The shape of one run.
#[derive(Clone, Copy, Debug)]
struct Shape {
    p_tp: u16,
    p_pp: u16,
    layers: u32,
}

/// A producer rank.
#[derive(Debug)]
struct Producer {
    rank: Rank,
    part: Range<u32>,
    /// Layers final so far, in the order prefill makes them final (chunks).
    chunks: Vec<Range<u32>>,
    send: Option<LayerSend>,
    /// Final before the registration came (the engine keeps them per key).
    final_before: Vec<Range<u32>>,
    aborted: bool,
    answered: bool,
    fail_next: bool,
}

#[derive(Clone, Debug)]
enum Ev {
    /// Prefill made `layers` of producer `p` final.
    Final { p: usize, layers: Range<u32> },
    /// The registration reaches producer `p`.
    Registration { p: usize },
    /// Producer `p`'s WRITE of `layers` ended.
    WriteDone { p: usize, layers: Range<u32>, ok: bool },
    /// A layer notification reaches the consumer.
    Layers(LayerCompletion),
    /// A failure reaches the consumer.
    Failure(Failure),
    /// The consumer's abort reaches producer `p`.
    Abort { p: usize },
    /// The consumer aborts the request.
    AbortD,
}

struct Sim {
    seed: u64,
    rng: Rng,
    now: Instant,
    queue: BTreeMap<(Instant, u64), Ev>,
    seq: u64,
    d: Completions,
    producers: Vec<Producer>,
    /// Oracle: layers landed in the consumer's blocks, per producer.
    landed: Vec<LayerSet>,
    /// Oracle: WRITEs in flight into the consumer's blocks.
    in_flight: u32,
    posted: Vec<HashSet<u32>>,
    outcomes: Vec<Event>,
    dirty: bool,
    dup_pct: u8,
}

impl Sim {
    fn new(seed: u64, shape: Shape, timeout_us: u64) -> Sim {
        let mut rng = Rng::new(seed);
        let model = layouts::full_model(shape.layers, 4, 8);
        let d = layouts::separate(model.clone(), 64, layouts::tp(0, 1));
        let mut producers = Vec::new();
        for pp in 0..shape.p_pp {
            for tp in 0..shape.p_tp {
                let par = Parallel { tp_rank: tp, tp_size: shape.p_tp, pp_rank: pp, pp_size: shape.p_pp };
                let l = KvLayout { parallel: par, ..d.clone() };
                let part = part_layers(&l, &d);
                // Prefill makes the part final in chunks of 1..=3 layers, in layer order.
                let mut chunks = Vec::new();
                let mut at = part.start;
                while at < part.end {
                    let n = (rng.between(1, 3) as u32).min(part.end - at);
                    chunks.push(at..at + n);
                    at += n;
                }
                producers.push(Producer {
                    rank: Rank::new(tp, pp),
                    part,
                    chunks,
                    send: None,
                    final_before: Vec::new(),
                    aborted: false,
                    answered: false,
                    fail_next: false,
                });
            }
        }
        let expected = expected_notifications(
            &model,
            Parallel { tp_rank: 0, tp_size: shape.p_tp, pp_rank: 0, pp_size: shape.p_pp },
            d.parallel,
        );
        assert_eq!(expected as usize, producers.len(), "every producer rank writes into the one consumer rank");
        let cfg =
            CompletionConfig { timeout_us, max_pending: 8, drain_timeout_us: 100_000_000, quarantine_us: 100_000_000 };
        let mut comp = Completions::new(cfg);
        let landed = producers.iter().map(|p| LayerSet::new(p.part.clone())).collect();
        let posted = producers.iter().map(|_| HashSet::new()).collect();
        let reg = Registration::new(KEY, "decode-0".into(), d.parallel.rank(), TOKENS, vec![vec![1, 2, 3]], &d)
            .expect("registration fits");
        // The consumer registers at time 0; its frames reach the producers later.
        comp.handle_registered(Instant(0), &reg, expected).expect("registration accepted");
        Sim {
            seed,
            rng,
            now: Instant(0),
            queue: BTreeMap::new(),
            seq: 0,
            d: comp,
            producers,
            landed,
            in_flight: 0,
            posted,
            outcomes: Vec::new(),
            dirty: false,
            dup_pct: 10,
        }
    }

    fn at(&mut self, after_us: u64, ev: Ev) {
        self.seq += 1;
        self.queue.insert((self.now.plus_micros(after_us), self.seq), ev);
    }

    fn net(&mut self, ev: Ev) {
        if self.rng.percent(self.dup_pct) {
            let d = self.rng.between(1, 400);
            self.at(d, ev.clone());
        }
        let d = self.rng.between(1, 400);
        self.at(d, ev);
    }

    /// Producer `p` posts whatever is final and not posted, and answers once its push has ended
    /// short (abort or failure) with nothing in flight.
    fn producer_step(&mut self, p: usize) {
        let Some(send) = self.producers[p].send.as_mut() else { return };
        let ranges = send.poll_ranges();
        for layers in ranges {
            for l in layers.clone() {
                assert!(self.posted[p].insert(l), "seed {}: layer {l} of producer {p} posted twice", self.seed);
            }
            let ok = !std::mem::take(&mut self.producers[p].fail_next);
            self.in_flight += 1;
            let d = self.rng.between(5, 300);
            self.at(d, Ev::WriteDone { p, layers, ok });
        }
        let outcome = self.producers[p].send.as_ref().and_then(LayerSend::outcome);
        if let Some(Err(kind)) = outcome {
            self.answer(p, kind);
        }
    }

    fn answer(&mut self, p: usize, kind: FailureKind) {
        if std::mem::replace(&mut self.producers[p].answered, true) {
            return;
        }
        let rank = self.producers[p].rank;
        self.net(Ev::Failure(Failure { key: KEY, rank, kind, detail: String::new() }));
    }

    fn deliver(&mut self, ev: Ev) {
        let now = self.now;
        match ev {
            Ev::Final { p, layers } => match self.producers[p].send.as_mut() {
                Some(s) => {
                    s.handle_final(layers);
                    self.producer_step(p);
                }
                None => self.producers[p].final_before.push(layers),
            },
            Ev::Registration { p } => {
                let pr = &mut self.producers[p];
                if pr.send.is_some() {
                    return; // a repeated registration frame
                }
                if pr.aborted {
                    // Aborted before the registration came: nothing was or will be posted.
                    self.answer(p, FailureKind::Aborted);
                    return;
                }
                let mut send = LayerSend::new(pr.part.clone());
                for l in pr.final_before.drain(..) {
                    send.handle_final(l);
                }
                pr.send = Some(send);
                self.producer_step(p);
            }
            Ev::WriteDone { p, layers, ok } => {
                self.in_flight -= 1;
                let result = if ok {
                    self.landed[p].insert(layers.clone());
                    let pr = &self.producers[p];
                    let c = LayerCompletion { key: KEY, rank: pr.rank, layers, part: pr.part.clone() };
                    self.net(Ev::Layers(c));
                    Ok(())
                } else {
                    Err(FailureKind::TransferFailed { status: -5 })
                };
                if let Some(s) = self.producers[p].send.as_mut() {
                    s.handle_done(result);
                }
                self.producer_step(p);
            }
            Ev::Layers(c) => self.d.handle_layers(now, &c),
            Ev::Failure(f) => self.d.handle_failure(now, &f),
            Ev::Abort { p } => {
                self.producers[p].aborted = true;
                match self.producers[p].send.as_mut() {
                    Some(s) => {
                        s.stop();
                        self.producer_step(p);
                    }
                    // No registration yet: nothing was or will be posted (a registration that comes
                    // later is answered the same way).
                    None => self.answer(p, FailureKind::Aborted),
                }
            }
            Ev::AbortD => {
                self.dirty = true;
                self.d.handle_abort(now, KEY);
            }
        }
        self.drain_d();
    }

    fn drain_d(&mut self) {
        while let Some(e) = self.d.poll_event() {
            match &e {
                Event::Draining { .. } => {
                    for p in 0..self.producers.len() {
                        self.net(Ev::Abort { p });
                    }
                }
                Event::Received { .. } => {
                    for (p, l) in self.landed.iter().enumerate() {
                        assert!(
                            l.is_full(),
                            "seed {}: received with producer {p}'s layers {:?} of {:?}",
                            self.seed,
                            l.runs(),
                            l.span()
                        );
                    }
                }
                Event::Failed { .. } | Event::Aborted { .. } | Event::Superseded { .. } => {
                    assert_eq!(self.in_flight, 0, "seed {}: {e:?} while WRITEs are in flight", self.seed);
                }
                // An outcome reported early with its blocks held (WRITEs may be in flight), and the
                // later release of those blocks.
                Event::Quarantined { .. } | Event::Released { .. } => {}
            }
            self.outcomes.push(e);
        }
    }

    fn run(&mut self) {
        let mut steps = 0;
        loop {
            let next_ev = self.queue.keys().next().map(|(t, _)| *t);
            let next_timeout = self.d.poll_timeout();
            let t = match (next_ev, next_timeout) {
                (None, None) => break,
                (a, b) => a.into_iter().chain(b).min().expect("one is some"),
            };
            self.now = t;
            if next_timeout.is_some_and(|d| d <= t) {
                self.d.handle_timeout(t);
                self.drain_d();
            }
            while let Some(entry) = self.queue.first_entry() {
                if entry.key().0 > t {
                    break;
                }
                let ev = entry.remove();
                self.deliver(ev);
            }
            steps += 1;
            assert!(steps < 100_000, "seed {}: stuck", self.seed);
        }
        assert_eq!(
            self.outcomes.iter().filter(|e| !matches!(e, Event::Draining { .. })).count(),
            1,
            "seed {}: {:?}",
            self.seed,
            self.outcomes
        );
        assert_eq!(self.d.pending(), 0, "seed {}", self.seed);
        assert_eq!(self.d.layer_keys(), 0, "seed {}: layer counts left behind", self.seed);
        assert_eq!(self.in_flight, 0);
    }

    fn outcome(&self) -> &Event {
        self.outcomes.iter().find(|e| !matches!(e, Event::Draining { .. })).expect("an outcome")
    }
}

/// What a schedule injects.
#[derive(Clone, Copy, Debug, Default)]
struct Faults {
    abort_at: Option<u64>,
    fail_write: Option<usize>,
}

/// Registration at `reg_us`, producer `p`'s chunk `i` final at `chunk_us[p][i]`.
fn schedule(sim: &mut Sim, reg_us: u64, chunk_us: &[Vec<u64>], faults: Faults) {
    for (p, times) in chunk_us.iter().enumerate() {
        let jitter = sim.rng.between(0, 200);
        sim.at(reg_us + jitter, Ev::Registration { p });
        for (c, &at) in sim.producers[p].chunks.clone().into_iter().zip(times) {
            sim.at(at, Ev::Final { p, layers: c });
        }
    }
    if let Some(at) = faults.abort_at {
        sim.at(at, Ev::AbortD);
    }
    if let Some(p) = faults.fail_write {
        sim.dirty = true;
        let n = sim.producers.len();
        sim.producers[p % n].fail_next = true;
    }
}

fn random_run(seed: u64) -> (Shape, Faults, Sim) {
    let mut rng = Rng::new(seed ^ 0x1a7e_5eed);
    let shapes = [
        Shape { p_tp: 1, p_pp: 1, layers: 8 },
        Shape { p_tp: 2, p_pp: 1, layers: 5 },
        Shape { p_tp: 1, p_pp: 2, layers: 7 },
        Shape { p_tp: 2, p_pp: 2, layers: 6 },
        Shape { p_tp: 1, p_pp: 1, layers: 70 },
    ];
    let shape = shapes[rng.below(shapes.len() as u64) as usize];
    // Sometimes the consumer's timeout cuts in (prefill takes up to ~15 ms at 70 layers).
    let timed_out = rng.percent(10);
    let timeout_us = if timed_out { rng.between(50, 3_000) } else { 1_000_000 };
    let mut sim = Sim::new(seed, shape, timeout_us);
    sim.dirty = timed_out;
    sim.dup_pct = rng.below(30) as u8;
    // Per-layer compute of 20..200 µs; any producer rank may start later than another.
    let chunk_us: Vec<Vec<u64>> = sim
        .producers
        .iter()
        .map(|p| {
            let mut t = rng.between(0, 500);
            let per = rng.between(20, 200);
            p.chunks
                .iter()
                .map(|c| {
                    t += per * c.len() as u64;
                    t
                })
                .collect()
        })
        .collect();
    let last = chunk_us.iter().flatten().copied().max().unwrap_or(0);
    // Registration before, during or after prefill.
    let reg_us = rng.between(0, last + 600);
    let faults = Faults {
        abort_at: rng.percent(25).then(|| rng.between(0, last + 800)),
        fail_write: rng.percent(20).then(|| rng.below(4) as usize),
    };
    schedule(&mut sim, reg_us, &chunk_us, faults);
    sim.run();
    (shape, faults, sim)
}

#[test]
fn random_layerwise_schedules_keep_every_invariant() {
    let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
    for seed in 0..3000u64 {
        let (_, _, sim) = random_run(seed);
        let kind = match sim.outcome() {
            Event::Received { .. } => "received",
            Event::Failed { .. } => "failed",
            Event::Aborted { .. } => "aborted",
            _ => "other",
        };
        if !sim.dirty {
            assert_eq!(kind, "received", "seed {seed}: a clean request was not received: {:?}", sim.outcomes);
        }
        *kinds.entry(kind).or_default() += 1;
    }
    // The schedules reach every outcome (so the checks above are not vacuous).
    for k in ["received", "failed", "aborted"] {
        assert!(kinds.get(k).is_some_and(|&n| n > 50), "too few `{k}`: {kinds:?}");
    }
}

/// Fixed timing: a chunk is final 100 µs per layer after its part starts (chunks as `Sim::new`
/// drew them); no repeated messages.
fn fixed(seed: u64, shape: Shape, reg_us: u64, faults: Faults) -> Sim {
    let mut sim = Sim::new(seed, shape, 1_000_000);
    sim.dup_pct = 0;
    let chunk_us: Vec<Vec<u64>> = sim
        .producers
        .iter()
        .map(|p| p.chunks.iter().map(|c| u64::from(c.end - p.part.start) * 100).collect())
        .collect();
    schedule(&mut sim, reg_us, &chunk_us, faults);
    sim.run();
    sim
}

#[test]
fn registration_after_every_layer_is_final_sends_one_batch() {
    let sim = fixed(7, Shape { p_tp: 1, p_pp: 1, layers: 8 }, 10_000, Faults::default());
    assert!(matches!(sim.outcome(), Event::Received { .. }), "{:?}", sim.outcomes);
    // Every layer final before the registration: one WRITE of the whole part.
    assert_eq!(sim.d.layer_stats().notifications, 1);
}

#[test]
fn registration_before_prefill_streams_every_chunk() {
    let sim = fixed(7, Shape { p_tp: 1, p_pp: 1, layers: 8 }, 0, Faults::default());
    assert!(matches!(sim.outcome(), Event::Received { .. }), "{:?}", sim.outcomes);
    // The registration reaches P within 200 µs; chunks final at 100 µs steps: most go one by one.
    let chunks = sim.producers[0].chunks.len() as u64;
    let n = sim.d.layer_stats().notifications;
    assert!(n >= chunks - 2 && n <= chunks, "{n} notifications for {chunks} chunks");
}

#[test]
fn tp_and_pp_producers_each_complete_their_part() {
    let sim = fixed(11, Shape { p_tp: 2, p_pp: 2, layers: 6 }, 150, Faults::default());
    assert!(matches!(sim.outcome(), Event::Received { .. }), "{:?}", sim.outcomes);
    let parts: Vec<Range<u32>> = sim.producers.iter().map(|p| p.part.clone()).collect();
    assert_eq!(parts, vec![0..3, 0..3, 3..6, 3..6]);
}

#[test]
fn abort_midway_ends_only_after_the_writes_in_flight() {
    // Abort at 150 µs; it reaches P by 550 µs, before layers 6..8 are final (600..800 µs).
    for seed in 0..20 {
        let sim =
            fixed(seed, Shape { p_tp: 1, p_pp: 1, layers: 8 }, 0, Faults { abort_at: Some(150), fail_write: None });
        assert!(matches!(sim.outcome(), Event::Aborted { .. }), "seed {seed}: {:?}", sim.outcomes);
        assert!(
            sim.outcomes.iter().any(|e| matches!(e, Event::Draining { .. })),
            "seed {seed}: the rank had not answered"
        );
        let posted = sim.posted[0].len();
        assert!(posted < 6, "seed {seed}: {posted} layers posted although the abort stopped the push");
    }
}

#[test]
fn a_failed_layer_write_fails_the_request_after_the_others_answer() {
    let sim = fixed(5, Shape { p_tp: 2, p_pp: 1, layers: 5 }, 0, Faults { abort_at: None, fail_write: Some(1) });
    match sim.outcome() {
        Event::Failed { reason, .. } => assert!(format!("{reason:?}").contains("TransferFailed"), "{reason:?}"),
        e => panic!("{e:?}"),
    }
}
