//! The staging receiver ([`Receiver`]) and the producer's pull grants ([`Grants`]) on virtual time,
//! driven like `sim.rs`: a network that delays (so reorders) and sometimes repeats frames, data
//! transfers that take a random time, notifications that come late, senders and consumers that are
//! lost (with or without a confirmed fence) and come back as new processes, and a consumer that
//! stops waiting for a request (the drain timeout). The invariants are checked after every event.
//!
//! Staging (one receiver, up to three senders, modelled as `transport::staged`'s sender behaves:
//! a granted piece is written at once; after a FAIL it writes nothing more, waits for its WRITEs and
//! sends CANCEL):
//!
//! * **no slot is re-granted while a WRITE into it can still land**: when the receiver grants slot
//!   `s`, no WRITE into `s` is in flight; when a WRITE lands, its slot is still granted to its piece
//!   (or quarantined, its sender lost unfenced);
//! * a scatter reads what landed: the slot holds the piece its notification names;
//! * **fail closed**: nothing of a transfer is granted or scattered after the consumer stopped
//!   waiting for it (`handle_stop`), or after it was delivered;
//! * delivered once, with every piece scattered; at quiescence nothing is held.
//!
//! Pull grants (one producer, three consumers): **no READ runs on a source after its grant ended**
//! ([`GrantEvent::Ended`] is what releases the sources), except at the quarantine bound (where
//! liveness wins, by design). At expiry the consumer is told (late, like any frame) and cancels its
//! READ if it still runs; the sources wait for the READ's end, reported as any other.
//!
//! Modelling choices: a sender's WRITE takes less than the quarantine bound and a notification is
//! late by less than it (past the bound the receiver trades fail-closed for liveness, by design);
//! frames between the receiver and a lost sender's process are dropped once the peer was dropped
//! (a new process is a new data-path agent), while the lost process's WRITEs still land unless the
//! fence was confirmed.

use std::collections::{BTreeMap, HashMap, HashSet};

use kvpush::proto::grants::{Cause, Event as GrantEvent, GrantConfig, Grants};
use kvpush::proto::msg::FailureKind;
use kvpush::proto::staging::{Frame, Landed, Output, PieceNote, Receiver, RecvConfig, Slot};
use kvpush::proto::{Instant, Key};
use kvpush_testkit::rng::Rng;

const STALL_US: u64 = 5_000;
const QUARANTINE_US: u64 = 20_000;
const MAX_STEPS: usize = 200_000;

// ---------------------------------------------------------------------------------------------
// Staging

/// A sender process: peer `peer`, incarnation `inc`.
type Proc = (usize, u32);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OutPiece {
    Waiting,
    Writing,
    Written,
}

#[derive(Debug)]
struct OutXfer {
    pieces: Vec<OutPiece>,
    failed: bool,
    cancel_sent: bool,
    ended: bool,
}

#[derive(Debug)]
enum Ev {
    /// A frame from process `from` reaches the receiver.
    ToRecv { from: Proc, frame: Frame },
    /// A frame from the receiver reaches process `to`.
    ToSender { to: Proc, frame: Frame },
    /// A WRITE of `from`'s piece lands in receive slot `slot`.
    Lands { from: Proc, tag: u64, piece: u32, slot: u32 },
    /// The sender sees its WRITE ended.
    WriteEnded { from: Proc, tag: u64, piece: u32 },
    /// A scatter of `slot` ends.
    ScatterDone { slot: usize },
    /// A sender posts a new transfer of `pieces` pieces.
    Post { peer: usize, pieces: u32 },
    /// The side channel to `peer` is lost; `fenced`: the transport confirmed its fence.
    Lose { peer: usize, fenced: bool },
    /// `peer` comes back as a new process.
    Return { peer: usize },
    /// The consumer stops waiting for `peer`'s transfer number `nth` of its current process.
    Stop { peer: usize, nth: u64 },
}

#[derive(Debug)]
struct StagingSim {
    seed: u64,
    rng: Rng,
    now: Instant,
    queue: BTreeMap<(Instant, u64), Ev>,
    seq: u64,
    rx: Receiver,
    /// Current incarnation of each peer, and whether it is lost (not yet returned).
    inc: Vec<u32>,
    lost: Vec<bool>,
    out: HashMap<Proc, HashMap<u64, OutXfer>>,
    next_tag: HashMap<Proc, u64>,
    dup_pct: u8,
    late_pct: u8,
    net_us: (u64, u64),
    write_us: (u64, u64),
    // ---- oracle ----
    /// Per slot: the piece whose data it holds (landed last).
    content: Vec<Option<(Proc, u64, u32)>>,
    /// WRITEs in flight, by slot.
    in_flight: HashMap<u32, Vec<(Proc, u64, u32)>>,
    /// What each slot was last granted to.
    granted: Vec<Option<(Proc, u64, u32)>>,
    /// Pieces scattered per transfer; delivered and stopped transfers.
    scattered: HashMap<(Proc, u64), HashSet<u32>>,
    delivered: HashSet<(Proc, u64)>,
    stopped: HashSet<(Proc, u64)>,
    steps: usize,
    stats: BTreeMap<&'static str, usize>,
}

impl StagingSim {
    fn new(seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let slots = rng.between(1, 3) as usize;
        let senders = rng.between(1, 3) as usize;
        let cfg = RecvConfig {
            slots,
            slot_bytes: 1 << 20,
            max_entries: 64,
            stall_timeout_us: STALL_US,
            quarantine_us: QUARANTINE_US,
        };
        let net = rng.between(0, 300);
        StagingSim {
            seed,
            now: Instant(0),
            queue: BTreeMap::new(),
            seq: 0,
            rx: Receiver::new(cfg),
            inc: vec![0; senders],
            lost: vec![false; senders],
            out: HashMap::new(),
            next_tag: HashMap::new(),
            dup_pct: if rng.coin() { 0 } else { rng.between(1, 30) as u8 },
            late_pct: if rng.coin() { 0 } else { rng.between(1, 10) as u8 },
            net_us: (net, net + rng.between(0, 800)),
            write_us: (rng.between(1, 200), rng.between(200, 3_000)),
            content: vec![None; slots],
            in_flight: HashMap::new(),
            granted: vec![None; slots],
            scattered: HashMap::new(),
            delivered: HashSet::new(),
            stopped: HashSet::new(),
            steps: 0,
            stats: BTreeMap::new(),
            rng,
        }
    }

    fn at(&mut self, after_us: u64, ev: Ev) {
        self.seq += 1;
        self.queue.insert((self.now.plus_micros(after_us), self.seq), ev);
    }

    fn net(&mut self) -> u64 {
        self.rng.between(self.net_us.0, self.net_us.1)
    }

    /// Sends over the network: after a delay, sometimes twice.
    fn send(&mut self, ev: impl Fn() -> Ev) {
        if self.rng.percent(self.dup_pct) {
            let d = self.net();
            self.at(d, ev());
        }
        let d = self.net();
        self.at(d, ev());
    }

    fn count(&mut self, what: &'static str) {
        *self.stats.entry(what).or_default() += 1;
    }

    fn current(&self, p: Proc) -> bool {
        self.inc[p.0] == p.1 && !self.lost[p.0]
    }

    // ---- the receiver's outputs ----

    fn drain_rx(&mut self) {
        while let Some(o) = self.rx.poll_output() {
            match o {
                Output::Send { peer, frame } => {
                    let p: usize = peer[1..].parse().expect("peer name");
                    let to = (p, self.inc[p]);
                    if let Frame::Grant { tag, piece, slot, .. } = frame {
                        let s = slot as usize;
                        assert!(
                            self.in_flight.get(&slot).is_none_or(Vec::is_empty),
                            "seed {}: slot {s} granted to {to:?}/{tag}/{piece} while WRITEs into it can land: {:?}",
                            self.seed,
                            self.in_flight.get(&slot)
                        );
                        assert!(
                            !self.stopped.contains(&(to, tag)) && !self.delivered.contains(&(to, tag)),
                            "seed {}: {to:?}/{tag} granted a slot after the consumer stopped waiting or it was delivered",
                            self.seed
                        );
                        self.granted[s] = Some((to, tag, piece));
                        self.count("grant");
                    }
                    if !self.lost[p] {
                        self.send(|| Ev::ToSender { to, frame: frame.clone() });
                    }
                }
                Output::Deliver { peer, notif } => {
                    let p: usize = peer[1..].parse().expect("peer name");
                    let tag = u64::from_le_bytes(notif[..8].try_into().expect("tag"));
                    let pieces = u32::from_le_bytes(notif[8..12].try_into().expect("pieces"));
                    let from = (p, u32::from_le_bytes(notif[12..16].try_into().expect("inc")));
                    assert!(self.delivered.insert((from, tag)), "seed {}: {from:?}/{tag} delivered twice", self.seed);
                    assert!(!self.stopped.contains(&(from, tag)), "seed {}: delivered after the stop", self.seed);
                    let got = self.scattered.get(&(from, tag)).map_or(0, HashSet::len);
                    assert_eq!(got, pieces as usize, "seed {}: {from:?}/{tag} delivered with {got} pieces", self.seed);
                    self.count("delivered");
                }
            }
        }
    }

    // ---- the sender model ----

    fn sender_frame(&mut self, to: Proc, frame: Frame) {
        if !self.current(to) {
            return; // a lost process hears nothing more
        }
        let tag = frame.tag();
        let Some(o) = self.out.get_mut(&to).and_then(|m| m.get_mut(&tag)) else { return };
        if o.ended {
            return;
        }
        match frame {
            Frame::Grant { piece, slot, .. } => {
                let Some(p) = o.pieces.get_mut(piece as usize) else { return };
                if *p != OutPiece::Waiting {
                    return; // a repeated grant
                }
                if o.failed {
                    *p = OutPiece::Written;
                } else {
                    *p = OutPiece::Writing;
                    let d = self.rng.between(self.write_us.0, self.write_us.1);
                    self.in_flight.entry(slot).or_default().push((to, tag, piece));
                    self.at(d, Ev::Lands { from: to, tag, piece, slot });
                }
            }
            Frame::Fail { .. } => {
                o.failed = true;
                for p in &mut o.pieces {
                    if *p == OutPiece::Waiting {
                        *p = OutPiece::Written;
                    }
                }
            }
            Frame::Done { .. } => {
                o.ended = true;
                self.count("sender done");
            }
            Frame::Cancelled { .. } if o.cancel_sent => {
                o.ended = true;
                self.count("sender cancelled");
            }
            _ => {}
        }
        self.maybe_cancel(to, tag);
    }

    /// A failed transfer with nothing in flight sends CANCEL (once).
    fn maybe_cancel(&mut self, from: Proc, tag: u64) {
        let Some(o) = self.out.get_mut(&from).and_then(|m| m.get_mut(&tag)) else { return };
        if o.failed && !o.cancel_sent && !o.ended && !o.pieces.contains(&OutPiece::Writing) {
            o.cancel_sent = true;
            self.send(|| Ev::ToRecv { from, frame: Frame::Cancel { tag } });
        }
    }

    // ---- events ----

    fn handle(&mut self, ev: Ev) {
        let now = self.now;
        match ev {
            Ev::Post { peer, pieces } => {
                if self.lost[peer] {
                    return;
                }
                let from = (peer, self.inc[peer]);
                let tag = *self.next_tag.entry(from).and_modify(|t| *t += 1).or_insert(0);
                let o = OutXfer {
                    pieces: vec![OutPiece::Waiting; pieces as usize],
                    failed: false,
                    cancel_sent: false,
                    ended: false,
                };
                self.out.entry(from).or_default().insert(tag, o);
                // The notification names the transfer (the oracle reads it back at delivery).
                let mut notif = tag.to_le_bytes().to_vec();
                notif.extend_from_slice(&pieces.to_le_bytes());
                notif.extend_from_slice(&from.1.to_le_bytes());
                self.send(|| Ev::ToRecv { from, frame: Frame::Request { tag, pieces, notif: notif.clone() } });
            }
            Ev::ToRecv { from, frame } => {
                if !self.current(from) {
                    return;
                }
                self.rx.handle_frame(now, &format!("p{}", from.0), frame);
            }
            Ev::ToSender { to, frame } => self.sender_frame(to, frame),
            Ev::Lands { from, tag, piece, slot } => {
                let s = slot as usize;
                let w = self.in_flight.get_mut(&slot).expect("in flight");
                w.retain(|x| *x != (from, tag, piece));
                let name = format!("p{}", from.0);
                let holder = self.rx.holder(s);
                let quarantined = matches!(self.rx.slots()[s], Slot::Quarantined { .. });
                assert!(
                    quarantined || holder == Some((name.as_str(), tag, Some(piece))),
                    "seed {}: a WRITE of {from:?}/{tag}/{piece} landed in slot {s}, now {:?} ({holder:?})",
                    self.seed,
                    self.rx.slots()[s]
                );
                assert_eq!(self.granted[s], Some((from, tag, piece)), "seed {}: slot {s} was granted again", self.seed);
                self.content[s] = Some((from, tag, piece));
                self.count("landed");
                // The sender's completion, and the data path's notification (after the data).
                self.at(1, Ev::WriteEnded { from, tag, piece });
                let late = if self.rng.percent(self.late_pct) {
                    self.count("late notification");
                    self.rng.between(STALL_US, QUARANTINE_US / 2)
                } else {
                    self.rng.between(0, 50)
                };
                let note = Frame::Piece { tag, piece, slot, entries: 1, bytes: 4096 };
                self.at(late, Ev::ToRecv { from, frame: note });
            }
            Ev::WriteEnded { from, tag, piece } => {
                if !self.current(from) {
                    return;
                }
                if let Some(o) = self.out.get_mut(&from).and_then(|m| m.get_mut(&tag)) {
                    o.pieces[piece as usize] = OutPiece::Written;
                }
                self.maybe_cancel(from, tag);
            }
            Ev::ScatterDone { slot } => {
                let c = self.content[slot].expect("a scatter of a landed piece");
                self.scattered.entry((c.0, c.1)).or_default().insert(c.2);
                let fail = self.rng.percent(2);
                self.rx.handle_scatter_done(now, slot, if fail { Err("injected".into()) } else { Ok(()) });
            }
            Ev::Lose { peer, fenced } => {
                if self.lost[peer] {
                    return;
                }
                self.lost[peer] = true;
                let name = format!("p{peer}");
                if fenced {
                    // The transport confirmed: nothing the peer posted lands any more.
                    let proc_ = (peer, self.inc[peer]);
                    self.cancel_writes(|p| p == proc_);
                    self.rx.handle_fenced(&name);
                    self.count("lost fenced");
                } else {
                    self.count("lost unfenced");
                }
                self.rx.handle_peer_lost(now, &name);
            }
            Ev::Return { peer } => {
                if !self.lost[peer] {
                    return;
                }
                // The old process is gone: its WRITEs can no longer land.
                let old = (peer, self.inc[peer]);
                self.cancel_writes(|p| p == old);
                self.inc[peer] += 1;
                self.lost[peer] = false;
                self.count("returned");
            }
            Ev::Stop { peer, nth } => {
                let from = (peer, self.inc[peer]);
                let name = format!("p{peer}");
                let want = nth.to_le_bytes();
                let inc = from.1.to_le_bytes();
                let n = self.rx.handle_stop(now, "the consumer stopped waiting", |p, notif| {
                    p == name && notif[..8] == want && notif[12..16] == inc
                });
                if n > 0 {
                    self.stopped.insert((from, nth));
                    self.count("stopped");
                }
            }
        }
        self.after_input(now);
    }

    fn cancel_writes(&mut self, gone: impl Fn(Proc) -> bool) {
        let lands: Vec<(Instant, u64)> = self
            .queue
            .iter()
            .filter(|(_, e)| matches!(e, Ev::Lands { from, .. } if gone(*from)))
            .map(|(k, _)| *k)
            .collect();
        for k in lands {
            if let Some(Ev::Lands { from, tag, piece, slot }) = self.queue.remove(&k) {
                if let Some(w) = self.in_flight.get_mut(&slot) {
                    w.retain(|x| *x != (from, tag, piece));
                }
            }
        }
    }

    /// Carries out what the receiver asks (a landed piece's scatter comes back through here).
    fn after_input(&mut self, now: Instant) {
        self.drain_rx();
        let _ = now;
    }

    fn piece_note(&mut self, from: Proc, frame: Frame) {
        let Frame::Piece { tag, piece, slot, entries, bytes } = frame else { unreachable!() };
        let name = format!("p{}", from.0);
        match self.rx.handle_piece(self.now, &name, PieceNote { tag, piece, slot, entries, bytes }) {
            Landed::Scatter { slot: s, .. } => {
                assert_eq!(
                    self.content[s],
                    Some((from, tag, piece)),
                    "seed {}: slot {s} scattered as {from:?}/{tag}/{piece} but holds {:?}",
                    self.seed,
                    self.content[s]
                );
                assert!(
                    !self.stopped.contains(&(from, tag)),
                    "seed {}: {from:?}/{tag} scattered after the consumer stopped waiting for it",
                    self.seed
                );
                let refused = self.rng.percent(2);
                self.rx.handle_scatter_started(self.now, s, if refused { Err("bad table".into()) } else { Ok(()) });
                if !refused {
                    let d = self.rng.between(1, 300);
                    self.at(d, Ev::ScatterDone { slot: s });
                    self.count("scatter");
                }
            }
            Landed::Nothing => self.count("piece not scattered"),
        }
        self.drain_rx();
    }

    fn next_time(&self) -> Option<Instant> {
        let q = self.queue.keys().next().map(|k| k.0);
        q.into_iter().chain(self.rx.poll_timeout()).min()
    }

    fn run(mut self) -> Self {
        // The schedule: posts, losses, returns and stops at random times.
        let senders = self.inc.len();
        for _ in 0..self.rng.between(1, 12) {
            let (t, peer, pieces) =
                (self.rng.between(0, 20_000), self.rng.below(senders as u64) as usize, self.rng.between(1, 6) as u32);
            self.at(t, Ev::Post { peer, pieces });
        }
        for _ in 0..self.rng.between(0, 3) {
            let (t, peer) = (self.rng.between(0, 25_000), self.rng.below(senders as u64) as usize);
            let (fenced, nth) = (self.rng.coin(), self.rng.below(4));
            match self.rng.below(3) {
                0 => self.at(t, Ev::Lose { peer, fenced }),
                1 => self.at(t, Ev::Return { peer }),
                _ => self.at(t, Ev::Stop { peer, nth }),
            }
        }
        while let Some(t) = self.next_time() {
            self.steps += 1;
            assert!(self.steps < MAX_STEPS, "seed {}: no quiescence", self.seed);
            self.now = self.now.max(t);
            match self.queue.first_key_value().map(|(k, _)| *k) {
                Some(k) if k.0 <= self.now => {
                    let ev = self.queue.remove(&k).expect("just seen");
                    match ev {
                        Ev::ToRecv { from, frame: f @ Frame::Piece { .. } } => {
                            if self.current(from) {
                                self.piece_note(from, f);
                            }
                        }
                        ev => self.handle(ev),
                    }
                }
                _ => {
                    self.rx.handle_timeout(self.now);
                    self.drain_rx();
                }
            }
        }
        self.check_quiescent();
        self
    }

    fn check_quiescent(&self) {
        assert!(!self.rx.busy(), "seed {}: the receiver still tracks transfers: {:?}", self.seed, self.rx);
        assert!(self.rx.slots().iter().all(|s| *s == Slot::Free), "seed {}: {:?}", self.seed, self.rx.slots());
        for (p, m) in &self.out {
            for (tag, o) in m {
                // A live process's transfers all ended (done, or failed and cancelled).
                if self.current(*p) {
                    assert!(o.ended, "seed {}: {p:?}/{tag} never ended: {o:?}", self.seed);
                }
            }
        }
    }
}

#[test]
fn random_staging_schedules_keep_every_invariant() {
    let mut total: BTreeMap<&'static str, usize> = BTreeMap::new();
    for seed in 0..3_000u64 {
        let sim = std::panic::catch_unwind(|| StagingSim::new(seed).run())
            .unwrap_or_else(|e| panic!("staging simulation failed with seed {seed}: {e:?}"));
        for (k, n) in sim.stats {
            *total.entry(k).or_default() += n;
        }
    }
    // The schedules reach what the invariants are about (so they cannot pass vacuously).
    for what in [
        "grant",
        "landed",
        "scatter",
        "delivered",
        "lost fenced",
        "lost unfenced",
        "returned",
        "stopped",
        "late notification",
        "sender cancelled",
        "piece not scattered",
    ] {
        assert!(total.get(what).copied().unwrap_or(0) > 0, "no {what} in any schedule: {total:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Pull grants

/// A consumer's READ of one key's sources.
#[derive(Debug)]
struct Read {
    key: Key,
    consumer: u16,
    inc: u32,
}

#[derive(Debug)]
enum PullEv {
    Grant {
        key: Key,
        consumer: u16,
    },
    /// The READ (posted by the consumer's process `inc`) ends; its notification follows.
    ReadEnds {
        key: Key,
        consumer: u16,
        inc: u32,
    },
    /// The producer's failure (the grant expired) reaches the consumer's process `inc`: it cancels
    /// its READ if it still runs.
    Told {
        key: Key,
        consumer: u16,
        inc: u32,
    },
    /// The notification of a READ's end reaches the producer.
    Word {
        key: Key,
        consumer: u16,
        inc: u32,
        result: Result<(), FailureKind>,
    },
    Lose {
        consumer: u16,
        fenced: bool,
    },
    Return {
        consumer: u16,
    },
}

fn pull_run(seed: u64) -> BTreeMap<&'static str, usize> {
    let mut rng = Rng::new(seed ^ 0x9a11_5eed);
    let cfg = GrantConfig { read_timeout_us: rng.between(200, 5_000), quarantine_us: QUARANTINE_US };
    let mut g: Grants<u16> = Grants::new(cfg);
    let mut queue: BTreeMap<(Instant, u64), PullEv> = BTreeMap::new();
    let mut seq = 0u64;
    let mut now = Instant(0);
    let mut put = |q: &mut BTreeMap<(Instant, u64), PullEv>, at: Instant, e: PullEv| {
        seq += 1;
        q.insert((at, seq), e);
    };
    let mut inc = [0u32; 3];
    let mut lost = [false; 3];
    let mut reads: Vec<Read> = Vec::new();
    let mut expired_at: HashMap<(Key, u16), Instant> = HashMap::new();
    let mut stats: BTreeMap<&'static str, usize> = BTreeMap::new();
    for i in 0..rng.between(1, 10) {
        let (t, consumer) = (rng.between(0, 10_000), rng.below(3) as u16);
        put(&mut queue, Instant(t), PullEv::Grant { key: Key::new(u128::from(i), 1), consumer });
    }
    for _ in 0..rng.between(0, 3) {
        let (t, consumer) = (rng.between(0, 12_000), rng.below(3) as u16);
        let e = if rng.coin() { PullEv::Lose { consumer, fenced: rng.coin() } } else { PullEv::Return { consumer } };
        put(&mut queue, Instant(t), e);
    }
    let dup = rng.percent(50);
    let mut steps = 0;
    loop {
        let next = queue.keys().next().map(|k| k.0).into_iter().chain(g.poll_timeout()).min();
        let Some(t) = next else { break };
        steps += 1;
        assert!(steps < MAX_STEPS, "seed {seed}: no quiescence");
        now = now.max(t);
        match queue.first_key_value().map(|(k, _)| *k) {
            Some(k) if k.0 <= now => match queue.remove(&k).expect("just seen") {
                PullEv::Grant { key, consumer } => {
                    let c = usize::from(consumer);
                    if lost[c] || g.get(key, &consumer).is_some() {
                        continue;
                    }
                    g.handle_granted(now, key, consumer);
                    // The grant travels; the consumer's READ runs for less than the bound.
                    let took = rng.between(50, QUARANTINE_US / 2);
                    reads.push(Read { key, consumer, inc: inc[c] });
                    put(&mut queue, now.plus_micros(took), PullEv::ReadEnds { key, consumer, inc: inc[c] });
                }
                PullEv::ReadEnds { key, consumer, inc: i } => {
                    let running = |r: &Read| r.key == key && r.consumer == consumer && r.inc == i;
                    if !reads.iter().any(running) {
                        continue; // ended already (cancelled, or its process is gone)
                    }
                    reads.retain(|r| !running(r));
                    let result = if rng.percent(10) { Err(FailureKind::TransferFailed { status: -5 }) } else { Ok(()) };
                    let late = if rng.percent(10) { rng.between(1_000, 10_000) } else { rng.between(0, 300) };
                    put(&mut queue, now.plus_micros(late), PullEv::Word { key, consumer, inc: i, result });
                    if dup {
                        put(
                            &mut queue,
                            now.plus_micros(late + rng.between(0, 500)),
                            PullEv::Word { key, consumer, inc: i, result },
                        );
                    }
                }
                PullEv::Told { key, consumer, inc: i } => {
                    let c = usize::from(consumer);
                    let running = reads.iter().any(|r| r.key == key && r.consumer == consumer && r.inc == i);
                    if i == inc[c] && !lost[c] && running {
                        // Cancelled: it ends soon (it may still complete; either way it is reported).
                        *stats.entry("cancelled").or_default() += 1;
                        put(
                            &mut queue,
                            now.plus_micros(rng.between(0, 1_000)),
                            PullEv::ReadEnds { key, consumer, inc: i },
                        );
                    }
                }
                PullEv::Word { key, consumer, inc: i, result } => {
                    let c = usize::from(consumer);
                    // Only the consumer's live process is heard (a new process is a new peer).
                    if i == inc[c] && !lost[c] && g.handle_read_done(key, &consumer, result) {
                        *stats.entry("read done").or_default() += 1;
                    }
                }
                PullEv::Lose { consumer, fenced } => {
                    let c = usize::from(consumer);
                    if lost[c] {
                        continue;
                    }
                    lost[c] = true;
                    if fenced {
                        // Confirmed: its READs of our memory stopped.
                        reads.retain(|r| r.consumer != consumer);
                        *stats.entry("lost fenced").or_default() += 1;
                    } else {
                        *stats.entry("lost unfenced").or_default() += 1;
                    }
                    g.handle_peer_lost(now, &consumer, fenced);
                }
                PullEv::Return { consumer } => {
                    let c = usize::from(consumer);
                    if !lost[c] {
                        continue;
                    }
                    // The old process is gone, and its READs with it.
                    reads.retain(|r| !(r.consumer == consumer && r.inc == inc[c]));
                    inc[c] += 1;
                    lost[c] = false;
                    g.handle_peer_returned(&consumer);
                    *stats.entry("returned").or_default() += 1;
                }
            },
            _ => g.handle_timeout(now),
        }
        while let Some(e) = g.poll_event() {
            match e {
                GrantEvent::Ended { key, consumer, cause, .. } => {
                    let running = reads.iter().any(|r| r.key == key && r.consumer == consumer);
                    // The two bounds: a lost consumer's quarantine, an expired grant never answered.
                    let exempt = matches!(cause, Cause::QuarantineExpired | Cause::Expired);
                    let expired = expired_at.remove(&(key, consumer));
                    if cause == Cause::Expired {
                        let at = expired.unwrap_or_else(|| panic!("seed {seed}: {key} ended expired, never expired"));
                        assert!(
                            now.micros_since(at) >= QUARANTINE_US,
                            "seed {seed}: the sources of {key} went back {} µs after the expiry",
                            now.micros_since(at)
                        );
                    }
                    assert!(
                        exempt || !running,
                        "seed {seed}: the sources of {key} went back ({cause:?}) while consumer {consumer}'s READ runs"
                    );
                    *stats
                        .entry(match cause {
                            Cause::Read => "ended read",
                            Cause::Expired => "ended expired",
                            Cause::LostFenced => "ended fenced",
                            Cause::Returned => "ended returned",
                            Cause::QuarantineExpired => "ended bound",
                        })
                        .or_default() += 1;
                }
                GrantEvent::Expired { key, consumer } => {
                    *stats.entry("expired").or_default() += 1;
                    assert!(expired_at.insert((key, consumer), now).is_none(), "seed {seed}: {key} expired twice");
                    let c = usize::from(consumer);
                    let late = rng.between(0, 2_000);
                    put(&mut queue, now.plus_micros(late), PullEv::Told { key, consumer, inc: inc[c] });
                }
                GrantEvent::Quarantined { .. } => *stats.entry("quarantined").or_default() += 1,
            }
        }
    }
    assert_eq!(g.pending(), 0, "seed {seed}: grants left");
    stats
}

#[test]
fn random_pull_grant_schedules_never_release_sources_under_a_read() {
    let mut total: BTreeMap<&'static str, usize> = BTreeMap::new();
    for seed in 0..3_000u64 {
        let s = std::panic::catch_unwind(|| pull_run(seed))
            .unwrap_or_else(|e| panic!("pull grant simulation failed with seed {seed}: {e:?}"));
        for (k, n) in s {
            *total.entry(k).or_default() += n;
        }
    }
    for what in ["ended read", "expired", "cancelled", "ended fenced", "ended returned", "quarantined", "lost unfenced"]
    {
        assert!(total.get(what).copied().unwrap_or(0) > 0, "no {what} in any schedule: {total:?}");
    }
}
