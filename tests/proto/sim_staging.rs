//! The staging receiver ([`Receiver`]) and sender ([`Sender`]), and the producer's pull grants
//! ([`Grants`]), on virtual time, driven like `sim.rs`: a network that delays (so reorders) and
//! sometimes repeats frames, data transfers that take a random time, notifications that come late,
//! senders and consumers that are lost (with or without a confirmed fence) and come back, and a
//! consumer that stops waiting for a request (the drain timeout). The invariants are checked after every event.
//!
//! Staging (one receiver, up to three sender processes, each the real [`Sender`] with one to three
//! send slots; the simulator carries out their actions as `transport::staged` does: gathers and
//! WRITEs that take a random time, a gather or post that sometimes fails; a sender hears of a lost
//! receiver a little after the receiver lost it, and comes back either as a new process or as the
//! same process reconnected):
//!
//! * **a send slot is never gathered into while its WRITE runs, and a WRITE sends what was
//!   gathered** (the oracle tracks each slot); **CANCEL goes out only when no WRITE of the
//!   transfer can land**, and a failure is reported only then (unless the receiver was lost);
//! * every transfer of a live sender ends with exactly one outcome; done only if delivered; its
//!   counters agree with its pieces;
//! * **no slot is re-granted while a WRITE into it can still land**: when the receiver grants slot
//!   `s`, no WRITE into `s` is in flight; when a WRITE lands, its slot is still granted to its piece
//!   (or quarantined, its sender lost unfenced);
//! * a scatter reads what landed: the slot holds the piece its notification names;
//! * **fail closed**: nothing of a transfer is granted or scattered after the consumer stopped
//!   waiting for it (`handle_stop`), or after it was delivered;
//! * delivered once, with every piece scattered; at quiescence nothing is held on either side;
//! * pieces gathered ahead of their grants (the carrier's turns, frequent or rare, allow one each)
//!   never hold every lane of a sender;
//! * **liveness**: in a schedule without faults (a quarter of them: nothing lost, late or failed,
//!   every delay inside the stall bound) every transfer is delivered, however long it queued for
//!   its grant.
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
use kvpush::proto::staging::{
    Action, Frame, Landed, Output, Piece, PieceNote, Receiver, RecvConfig, Report, SendConfig, Sender, Slot,
};
use kvpush::proto::{Instant, Key};
use kvpush_testkit::rng::Rng;

const STALL_US: u64 = 5_000;
const QUARANTINE_US: u64 = 20_000;
const MAX_STEPS: usize = 200_000;

// ---------------------------------------------------------------------------------------------
// Staging

/// A connection as the receiver knows it: peer `peer`, incarnation `inc` (a new process, or the
/// same process after a reconnect: either way the receiver sees a new data-path agent).
type Proc = (usize, u32);

/// What the oracle knows a send slot (lane) of a sender process holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LaneO {
    Idle,
    /// A gather of (tag, piece) runs into it.
    Gathering(u64, u32),
    /// It holds (tag, piece), gathered.
    Holds(u64, u32),
    /// A WRITE of (tag, piece) runs out of it.
    Writing(u64, u32),
}

/// A sender process: the real [`Sender`] and what the oracle knows of it.
#[derive(Debug)]
struct SProc {
    peer: usize,
    /// The connection the receiver knows it by.
    conn: u32,
    tx: Sender,
    /// Killed (a new process took its place): it does nothing more, and nothing of it ends.
    dead: bool,
    /// It heard that the receiver was lost (its transfers fail at once).
    lost_heard: bool,
    lanes: Vec<LaneO>,
    /// A [`Ev::Turn`] of it is queued.
    turn_queued: bool,
    next_tag: u64,
    /// Per tag: the connection it was posted on, and its outcome once reported.
    posted: BTreeMap<u64, (u32, Option<bool>)>,
}

#[derive(Debug)]
enum Ev {
    /// A frame from connection `from` reaches the receiver.
    ToRecv { from: Proc, frame: Frame },
    /// A frame from the receiver reaches connection `to`.
    ToSender { to: Proc, frame: Frame },
    /// A WRITE of process `pid`'s piece (posted on connection `from`) lands in receive slot `slot`.
    Lands { pid: usize, from: Proc, tag: u64, piece: u32, slot: u32, lane: usize },
    /// Process `pid` sees its WRITE out of `lane` ended.
    WriteEnded { pid: usize, lane: usize, ok: bool },
    /// Process `pid`'s gather into `lane` ends.
    GatherDone { pid: usize, lane: usize },
    /// Process `pid`'s carrier takes its turn (`transport::staged` does on every pump of its
    /// notifications): the sender may gather a piece ahead of its grant.
    Turn { pid: usize },
    /// A scatter of `slot` ends.
    ScatterDone { slot: usize },
    /// A sender posts a new transfer of `pieces` pieces.
    Post { peer: usize, pieces: u32 },
    /// The side channel to `peer` is lost; `fenced`: the transport confirmed its fence.
    Lose { peer: usize, fenced: bool },
    /// Process `pid` hears that the receiver was lost.
    SenderLost { pid: usize },
    /// `peer` comes back: as a new process (`restart`), or the same process reconnected.
    Return { peer: usize, restart: bool },
    /// The consumer stops waiting for `peer`'s transfer number `nth` of its current connection.
    Stop { peer: usize, nth: u64 },
    /// `peer`'s current process gives up on its transfer `nth` (`Transport::cancel`).
    Cancel { peer: usize, nth: u64 },
}

#[derive(Debug)]
struct StagingSim {
    seed: u64,
    /// No faults (losses, stops, cancels, failures, lost or late frames): everything is delivered.
    clean: bool,
    rng: Rng,
    now: Instant,
    queue: BTreeMap<(Instant, u64), Ev>,
    seq: u64,
    rx: Receiver,
    /// Current incarnation of each peer, whether it is lost (not yet returned), its process.
    inc: Vec<u32>,
    lost: Vec<bool>,
    pid: Vec<usize>,
    procs: Vec<SProc>,
    /// Connections lost with a confirmed fence: nothing they post lands.
    fenced: HashSet<Proc>,
    dup_pct: u8,
    late_pct: u8,
    /// Percent of PIECE notifications and CANCELLED frames lost (the receiver's and the sender's
    /// stall timeouts end what waits for them).
    drop_pct: u8,
    net_us: (u64, u64),
    write_us: (u64, u64),
    /// Time between a sender's turns: often, or rare (a loaded host).
    turn_us: (u64, u64),
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
        let procs = (0..senders)
            .map(|peer| {
                let lanes = rng.between(1, 3) as usize;
                SProc::new(peer, 0, lanes)
            })
            .collect();
        let mut sim = StagingSim {
            seed,
            clean: false,
            now: Instant(0),
            queue: BTreeMap::new(),
            seq: 0,
            rx: Receiver::new(cfg),
            inc: vec![0; senders],
            lost: vec![false; senders],
            pid: (0..senders).collect(),
            procs,
            fenced: HashSet::new(),
            dup_pct: if rng.coin() { 0 } else { rng.between(1, 30) as u8 },
            late_pct: if rng.coin() { 0 } else { rng.between(1, 10) as u8 },
            drop_pct: if rng.percent(70) { 0 } else { rng.between(1, 10) as u8 },
            net_us: (net, net + rng.between(0, 800)),
            write_us: (rng.between(1, 200), rng.between(200, 3_000)),
            turn_us: if rng.coin() { (20, 300) } else { (300, rng.between(400, 4_000)) },
            content: vec![None; slots],
            in_flight: HashMap::new(),
            granted: vec![None; slots],
            scattered: HashMap::new(),
            delivered: HashSet::new(),
            stopped: HashSet::new(),
            steps: 0,
            stats: BTreeMap::new(),
            rng,
        };
        if sim.rng.percent(25) {
            // Nothing lost, late or failed, and every delay well inside the stall bound: every
            // transfer must be delivered, however the senders' turns fall.
            sim.clean = true;
            (sim.late_pct, sim.drop_pct) = (0, 0);
            sim.net_us = (sim.net_us.0.min(300), sim.net_us.0.min(300) + 100);
            sim.write_us = (sim.write_us.0, sim.write_us.0 + 300);
        }
        sim
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
                    if matches!(frame, Frame::Cancelled { .. }) && self.rng.percent(self.drop_pct) {
                        self.count("cancelled lost");
                        continue;
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

    // ---- the senders' actions (what `transport::staged` carries out) ----

    fn drain_tx(&mut self, pid: usize) {
        while let Some(a) = self.procs[pid].tx.poll_action() {
            let (seed, from) = (self.seed, (self.procs[pid].peer, self.procs[pid].conn));
            match a {
                Action::Send { peer, frame } => {
                    assert_eq!(peer, "d", "seed {seed}: a frame for {peer}");
                    if let Frame::Cancel { tag } = frame {
                        // CANCEL lets the receiver free the transfer's slots: no WRITE of it may
                        // still land.
                        let writing = self.in_flight.values().flatten().any(|w| w.0 == from && w.1 == tag);
                        let lane = self.procs[pid].lanes.iter().any(|l| matches!(*l, LaneO::Writing(t, _) if t == tag));
                        assert!(!writing && !lane, "seed {seed}: {from:?}/{tag} sent CANCEL while its WRITE can land");
                        self.count("cancel sent");
                    }
                    self.send(|| Ev::ToRecv { from, frame: frame.clone() });
                }
                Action::Gather { tag, piece, lane, ahead } => {
                    let l = self.procs[pid].lanes[lane];
                    assert!(
                        matches!(l, LaneO::Idle | LaneO::Holds(..)),
                        "seed {seed}: {from:?} gathers {tag}/{piece} into lane {lane} while it is {l:?}"
                    );
                    self.procs[pid].lanes[lane] = LaneO::Gathering(tag, piece);
                    let d = self.rng.between(1, 300);
                    self.at(d, Ev::GatherDone { pid, lane });
                    self.count(if ahead { "gather ahead" } else { "gather" });
                }
                Action::Write { tag, piece, lane, slot, .. } => {
                    let l = self.procs[pid].lanes[lane];
                    assert_eq!(
                        l,
                        LaneO::Holds(tag, piece),
                        "seed {seed}: {from:?} writes {tag}/{piece} from lane {lane}"
                    );
                    self.procs[pid].lanes[lane] = LaneO::Writing(tag, piece);
                    self.count("write");
                    if self.fenced.contains(&from) || self.procs[pid].lost_heard && self.rng.coin() {
                        // The transport refuses it (fenced), or the post fails: it ends at once.
                        self.at(1, Ev::WriteEnded { pid, lane, ok: false });
                        continue;
                    }
                    let d = self.rng.between(self.write_us.0, self.write_us.1);
                    self.in_flight.entry(slot).or_default().push((from, tag, piece));
                    self.at(d, Ev::Lands { pid, from, tag, piece, slot, lane });
                }
            }
        }
        self.report(pid);
        let (kept, fresh) = self.procs[pid].tx.tallies();
        assert_eq!(kept, fresh, "seed {}: the sender's tallies drifted: {:?}", self.seed, self.procs[pid].tx);
        // Pieces gathered ahead of their grants never hold every lane: a granted piece always
        // finds one (a free one, or one whose WRITE ends on its own).
        let tx = &self.procs[pid].tx;
        let ahead = tx
            .lanes()
            .iter()
            .flatten()
            .filter(|&&(tag, piece)| {
                matches!(tx.piece(tag, piece), Some(Piece::Gathering { grant: None, .. } | Piece::Gathered { .. }))
            })
            .count();
        assert!(ahead < tx.lanes().len(), "seed {}: every lane is held ahead of a grant: {tx:?}", self.seed);
        // The carrier takes turns while the sender has something to do.
        let p = &self.procs[pid];
        if !p.dead && !p.turn_queued && p.tx.busy() {
            self.procs[pid].turn_queued = true;
            let d = self.rng.between(self.turn_us.0, self.turn_us.1);
            self.at(d, Ev::Turn { pid });
        }
    }

    /// Asks process `pid` for the outcome of every transfer not reported yet (as the engine polls
    /// its handles), and checks what it says.
    fn report(&mut self, pid: usize) {
        let now = self.now;
        let tags: Vec<u64> = self.procs[pid].posted.iter().filter(|(_, (_, o))| o.is_none()).map(|(t, _)| *t).collect();
        for tag in tags {
            let r = self.procs[pid].tx.handle_report(now, tag);
            let p = &self.procs[pid];
            let (seed, conn, peer) = (self.seed, p.posted[&tag].0, p.peer);
            let from = (peer, conn);
            let ok = match r {
                Report::Pending => continue,
                Report::Unknown => panic!("seed {seed}: {from:?}/{tag} unknown before its outcome"),
                Report::Finished(Err(why)) if self.clean => {
                    panic!("seed {seed}: {from:?}/{tag} failed in a schedule without faults: {why}; {:?}", self.rx)
                }
                Report::Finished(r) => r.is_ok(),
            };
            if ok {
                assert!(self.delivered.contains(&(from, tag)), "seed {seed}: {from:?}/{tag} done, never delivered");
                self.count("sender done");
            } else if !p.lost_heard {
                // A failure is reported only once nothing of the transfer can land or be scattered.
                let writing = self.in_flight.values().flatten().any(|w| w.0 == from && w.1 == tag);
                assert!(!writing, "seed {seed}: {from:?}/{tag} reported failed while its WRITE can land");
                let scattering = (0..self.rx.slots().len())
                    .any(|s| self.current(from) && self.rx.holder(s) == Some((format!("p{peer}").as_str(), tag, None)));
                assert!(!scattering, "seed {seed}: {from:?}/{tag} reported failed while a piece of it is scattered");
                self.count("sender failed");
            }
            self.procs[pid].posted.get_mut(&tag).expect("posted").1 = Some(ok);
        }
        self.drain_tx_quiet(pid);
    }

    /// A report may let the sender forget a transfer; it asks nothing of the carrier then.
    fn drain_tx_quiet(&mut self, pid: usize) {
        assert!(self.procs[pid].tx.poll_action().is_none(), "seed {}: an action after a report", self.seed);
    }

    /// Process `pid` of connection `to` is the one that hears frames sent to `to`.
    fn pid_of(&self, to: Proc) -> Option<usize> {
        self.procs.iter().position(|p| !p.dead && p.peer == to.0 && p.conn == to.1)
    }

    // ---- events ----

    fn handle(&mut self, ev: Ev) {
        let now = self.now;
        match ev {
            Ev::Post { peer, pieces } => {
                if self.lost[peer] {
                    return;
                }
                let pid = self.pid[peer];
                let from = (peer, self.inc[peer]);
                let p = &mut self.procs[pid];
                let tag = p.next_tag;
                p.next_tag += 1;
                p.posted.insert(tag, (from.1, None));
                // The notification names the transfer (the oracle reads it back at delivery).
                let mut notif = tag.to_le_bytes().to_vec();
                notif.extend_from_slice(&pieces.to_le_bytes());
                notif.extend_from_slice(&from.1.to_le_bytes());
                self.send(|| Ev::ToRecv { from, frame: Frame::Request { tag, pieces, notif: notif.clone() } });
                self.procs[pid].tx.handle_post(now, tag, "d", pieces);
                self.drain_tx(pid);
            }
            Ev::ToRecv { from, frame } => {
                if !self.current(from) {
                    return;
                }
                self.rx.handle_frame(now, &format!("p{}", from.0), frame);
            }
            Ev::ToSender { to, frame } => {
                if let Some(pid) = self.pid_of(to).filter(|_| self.current(to)) {
                    self.procs[pid].tx.handle_frame(now, "d", frame);
                    self.drain_tx(pid);
                }
            }
            Ev::Lands { pid, from, tag, piece, slot, lane } => {
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
                self.at(1, Ev::WriteEnded { pid, lane, ok: true });
                if self.rng.percent(self.drop_pct) {
                    self.count("notification lost");
                    return;
                }
                let late = if self.rng.percent(self.late_pct) {
                    self.count("late notification");
                    self.rng.between(STALL_US, QUARANTINE_US / 2)
                } else {
                    self.rng.between(0, 50)
                };
                let note = Frame::Piece { tag, piece, slot, entries: 1, bytes: 4096 };
                self.at(late, Ev::ToRecv { from, frame: note });
            }
            Ev::WriteEnded { pid, lane, ok } => {
                if self.procs[pid].dead {
                    return;
                }
                let l = self.procs[pid].lanes[lane];
                assert!(matches!(l, LaneO::Writing(..)), "seed {}: a WRITE ended from lane {lane} ({l:?})", self.seed);
                self.procs[pid].lanes[lane] = LaneO::Idle;
                self.procs[pid].tx.handle_written(now, lane, if ok { Ok(()) } else { Err("refused".into()) });
                self.drain_tx(pid);
            }
            Ev::GatherDone { pid, lane } => {
                if self.procs[pid].dead {
                    return;
                }
                let LaneO::Gathering(tag, piece) = self.procs[pid].lanes[lane] else {
                    panic!("seed {}: a gather ended in lane {lane} ({:?})", self.seed, self.procs[pid].lanes[lane])
                };
                let fail = !self.clean && self.rng.percent(2);
                self.procs[pid].lanes[lane] = if fail { LaneO::Idle } else { LaneO::Holds(tag, piece) };
                self.procs[pid].tx.handle_gathered(now, lane, if fail { Err("injected".into()) } else { Ok(()) });
                self.drain_tx(pid);
            }
            Ev::Turn { pid } => {
                self.procs[pid].turn_queued = false;
                if self.procs[pid].dead {
                    return;
                }
                self.procs[pid].tx.handle_turn(now);
                self.count("turn");
                self.drain_tx(pid);
            }
            Ev::ScatterDone { slot } => {
                let c = self.content[slot].expect("a scatter of a landed piece");
                self.scattered.entry((c.0, c.1)).or_default().insert(c.2);
                let fail = !self.clean && self.rng.percent(2);
                self.rx.handle_scatter_done(now, slot, if fail { Err("injected".into()) } else { Ok(()) });
            }
            Ev::Lose { peer, fenced } => {
                if self.lost[peer] {
                    return;
                }
                self.lost[peer] = true;
                let name = format!("p{peer}");
                let conn = (peer, self.inc[peer]);
                if fenced {
                    // The transport confirmed: nothing the peer posted lands any more.
                    self.fenced.insert(conn);
                    self.cancel_writes(|p| p == conn, true);
                    self.rx.handle_fenced(&name);
                    self.count("lost fenced");
                } else {
                    self.count("lost unfenced");
                }
                self.rx.handle_peer_lost(now, &name);
                // The sender hears of it on its side a little later.
                let (pid, d) = (self.pid[peer], self.rng.between(0, 2_000));
                self.at(d, Ev::SenderLost { pid });
            }
            Ev::SenderLost { pid } => {
                let p = &mut self.procs[pid];
                if p.dead || p.lost_heard {
                    return;
                }
                p.lost_heard = true;
                p.tx.handle_peer_lost(now, "d");
                self.drain_tx(pid);
            }
            Ev::Return { peer, restart } => {
                if !self.lost[peer] {
                    return;
                }
                let old = self.pid[peer];
                if restart || !self.procs[old].lost_heard {
                    // The old process is gone (killed): its WRITEs can no longer land.
                    let conn = (peer, self.inc[peer]);
                    self.cancel_writes(|p| p == conn, false);
                    self.procs[old].dead = true;
                    let lanes = self.procs[old].lanes.len();
                    self.procs.push(SProc::new(peer, self.inc[peer] + 1, lanes));
                    self.pid[peer] = self.procs.len() - 1;
                    self.count("restarted");
                } else {
                    // The same process dials again: a new connection; what it posted before the
                    // loss may still land (or was refused, fenced).
                    let p = &mut self.procs[old];
                    p.conn += 1;
                    p.lost_heard = false;
                    self.count("reconnected");
                }
                self.inc[peer] += 1;
                self.lost[peer] = false;
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
            Ev::Cancel { peer, nth } => {
                let pid = self.pid[peer];
                if self.procs[pid].tx.handle_cancel(now, nth) {
                    self.count("sender cancel");
                }
                self.drain_tx(pid);
            }
        }
        self.drain_rx();
    }

    /// WRITEs of `gone` connections in flight never land: the process is gone (they never end
    /// either), or the fence is confirmed (they end, failed).
    fn cancel_writes(&mut self, gone: impl Fn(Proc) -> bool, end: bool) {
        let lands: Vec<(Instant, u64)> = self
            .queue
            .iter()
            .filter(|(_, e)| matches!(e, Ev::Lands { from, .. } if gone(*from)))
            .map(|(k, _)| *k)
            .collect();
        for k in lands {
            if let Some(Ev::Lands { pid, from, tag, piece, slot, lane }) = self.queue.remove(&k) {
                if let Some(w) = self.in_flight.get_mut(&slot) {
                    w.retain(|x| *x != (from, tag, piece));
                }
                if end {
                    self.at(1, Ev::WriteEnded { pid, lane, ok: false });
                }
            }
        }
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
                let refused = !self.clean && self.rng.percent(2);
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
        let tx = self.procs.iter().filter(|p| !p.dead).filter_map(|p| p.tx.poll_timeout());
        q.into_iter().chain(self.rx.poll_timeout()).chain(tx).min()
    }

    fn run(mut self) -> Self {
        // The schedule: posts, losses, returns, stops and cancels at random times.
        let senders = self.inc.len();
        for _ in 0..self.rng.between(1, 12) {
            let (t, peer, pieces) =
                (self.rng.between(0, 20_000), self.rng.below(senders as u64) as usize, self.rng.between(1, 6) as u32);
            self.at(t, Ev::Post { peer, pieces });
        }
        for _ in 0..if self.clean { 0 } else { self.rng.between(0, 4) } {
            let (t, peer) = (self.rng.between(0, 25_000), self.rng.below(senders as u64) as usize);
            let (fenced, nth, restart) = (self.rng.coin(), self.rng.below(4), self.rng.coin());
            match self.rng.below(4) {
                0 => self.at(t, Ev::Lose { peer, fenced }),
                1 => self.at(t, Ev::Return { peer, restart }),
                2 => self.at(t, Ev::Stop { peer, nth }),
                _ => self.at(t, Ev::Cancel { peer, nth }),
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
                    for pid in 0..self.procs.len() {
                        if !self.procs[pid].dead {
                            self.procs[pid].tx.handle_timeout(self.now);
                            self.drain_tx(pid);
                        }
                    }
                }
            }
        }
        self.check_quiescent();
        self
    }

    fn check_quiescent(&self) {
        let seed = self.seed;
        assert!(!self.rx.busy(), "seed {seed}: the receiver still tracks transfers: {:?}", self.rx);
        assert!(self.rx.slots().iter().all(|s| *s == Slot::Free), "seed {seed}: {:?}", self.rx.slots());
        for p in self.procs.iter().filter(|p| !p.dead) {
            // Every transfer of a live process ended with one outcome, and nothing is held.
            for (tag, (conn, outcome)) in &p.posted {
                assert!(outcome.is_some(), "seed {seed}: {}/{conn}/{tag} never ended: {:?}", p.peer, p.tx);
            }
            assert!(!p.tx.busy() && p.tx.lanes_in_use() == 0, "seed {seed}: a sender still holds: {:?}", p.tx);
            assert!(p.lanes.iter().all(|l| matches!(l, LaneO::Idle | LaneO::Holds(..))), "seed {seed}: {p:?}");
        }
    }
}

impl SProc {
    fn new(peer: usize, conn: u32, lanes: usize) -> SProc {
        SProc {
            peer,
            conn,
            tx: Sender::new(SendConfig { lanes, stall_timeout_us: STALL_US }),
            dead: false,
            lost_heard: false,
            lanes: vec![LaneO::Idle; lanes],
            turn_queued: false,
            next_tag: 0,
            posted: BTreeMap::new(),
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
        "gather",
        "gather ahead",
        "turn",
        "write",
        "landed",
        "scatter",
        "delivered",
        "lost fenced",
        "lost unfenced",
        "restarted",
        "reconnected",
        "stopped",
        "sender cancel",
        "cancel sent",
        "cancelled lost",
        "notification lost",
        "late notification",
        "sender done",
        "sender failed",
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
