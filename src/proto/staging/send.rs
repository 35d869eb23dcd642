//! The sending side of staged transfers: which piece goes into which send slot (a *lane*) and when,
//! when a gathered piece is written into the receive slot it was granted, and how a transfer ends.
//! `transport::staged` cuts transfers into pieces, fills their tables, runs the gathers and posts
//! the WRITEs this machine asks for; it decides nothing (read its module docs for the protocol).
//!
//! A piece moves [`Piece::Waiting`] → ([`Piece::Granted`]) → [`Piece::Gathering`] →
//! ([`Piece::Gathered`], ahead of its grant) → [`Piece::Writing`] → [`Piece::Written`]. The rules
//! the simulator (`tests/proto/sim_staging.rs`) checks after every event:
//!
//! * a lane is handed out again only after the gather into it and the WRITE out of it ended;
//! * CANCEL (which lets the receiver free and re-grant the transfer's slots) is sent only once no
//!   WRITE of the transfer is in flight, and a failure is reported only after CANCELLED, so the
//!   engine's own failure message never overtakes a piece (a lost peer ends its transfers at once:
//!   its receive slots are the receiver's to quarantine);
//! * every transfer ends with exactly one outcome, and is forgotten only once none of its pieces
//!   holds a lane.
//!
//! Inputs are `handle_*(now, …)`; outputs ([`Action`]) are drained with [`Sender::poll_action`]
//! after every input. No I/O, no clock, no `unsafe`.

use std::collections::{HashMap, VecDeque};

use super::frame::Frame;
use crate::proto::Instant;

/// Where one piece of an outgoing transfer stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Waiting for a grant (and a lane).
    Waiting,
    /// Granted receive slot `slot` at `addr`, waiting for a lane.
    Granted {
        /// The receive slot.
        slot: u32,
        /// Its address in the receiver's memory.
        addr: u64,
    },
    /// Being gathered into lane `lane`: with its grant, or ahead of it (`None`).
    Gathering {
        /// The send slot.
        lane: usize,
        /// The receive slot and its address, once granted.
        grant: Option<(u32, u64)>,
    },
    /// Gathered ahead of its grant into lane `lane`.
    Gathered {
        /// The send slot.
        lane: usize,
    },
    /// Being written from lane `lane`.
    Writing {
        /// The send slot.
        lane: usize,
    },
    /// Written, or given up (its transfer failed): holds no lane.
    Written,
}

impl Piece {
    /// The lane it holds, if any.
    pub fn lane(self) -> Option<usize> {
        match self {
            Piece::Gathering { lane, .. } | Piece::Gathered { lane } | Piece::Writing { lane } => Some(lane),
            Piece::Waiting | Piece::Granted { .. } | Piece::Written => None,
        }
    }
}

/// Where an outgoing transfer stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Its pieces are granted, gathered and written.
    Sending,
    /// Failed (a FAIL from the receiver, a gather or WRITE that failed, a cancel): nothing more is
    /// gathered or written; CANCEL goes out once none of its WRITEs is in flight.
    Failed {
        /// Why.
        why: String,
    },
    /// CANCEL sent: waiting for CANCELLED (nothing of it is in a receive slot any more).
    Cancelling {
        /// Why it failed.
        why: String,
    },
    /// Ended; the outcome is not reported yet.
    Finished {
        /// Done (the receiver delivered it), or why it failed.
        outcome: Result<(), String>,
    },
    /// Reported; kept only while a piece of it still holds a lane.
    Reported,
}

/// What the carrier does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send `frame` to `peer`.
    Send {
        /// The receiver.
        peer: String,
        /// What to send.
        frame: Frame,
    },
    /// Fill piece `piece` of transfer `tag`'s tables and start its gather into lane `lane`
    /// (`ahead`: before its grant); report the gather's end with [`Sender::handle_gathered`] (a
    /// gather that does not start ends at once, failed).
    Gather {
        /// The transfer.
        tag: u64,
        /// The piece.
        piece: u32,
        /// The send slot.
        lane: usize,
        /// Gathered ahead of its grant.
        ahead: bool,
    },
    /// Post the WRITE of lane `lane` (piece `piece` of transfer `tag`, gathered) into receive slot
    /// `slot` at `addr` of `peer`, with the piece's PIECE frame as its notification; report its end
    /// with [`Sender::handle_written`] (a post that fails ends at once, failed).
    Write {
        /// The receiver.
        peer: String,
        /// The transfer.
        tag: u64,
        /// The piece.
        piece: u32,
        /// The send slot.
        lane: usize,
        /// The receive slot.
        slot: u32,
        /// Its address.
        addr: u64,
    },
}

/// What [`Sender::handle_report`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Report {
    /// No such transfer (never posted, or its outcome was reported already).
    Unknown,
    /// Not finished yet.
    Pending,
    /// Its outcome, reported now and never again.
    Finished(Result<(), String>),
}

/// What the sender needs to know.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendConfig {
    /// Send slots (lanes).
    pub lanes: usize,
    /// A receiver that does not confirm a cancel within this long is given up on.
    pub stall_timeout_us: u64,
}

#[derive(Clone, Debug)]
struct Outgoing {
    peer: String,
    pieces: Vec<Piece>,
    written: usize,
    /// The receiver scattered every piece and delivered the notification (DONE).
    done: bool,
    phase: Phase,
    /// Last progress (a grant, a gather or WRITE started or ended, the cancel sent).
    moved: Instant,
}

impl Outgoing {
    fn failed(&self) -> bool {
        !matches!(self.phase, Phase::Sending | Phase::Finished { outcome: Ok(()) })
    }

    fn busy(&self) -> bool {
        self.pieces.iter().any(|p| p.lane().is_some())
    }

    fn open(&self) -> bool {
        matches!(self.phase, Phase::Sending | Phase::Failed { .. } | Phase::Cancelling { .. })
    }

    fn fail(&mut self, why: String) {
        if self.phase == Phase::Sending {
            self.phase = Phase::Failed { why };
        }
    }
}

/// Cumulative counts of [`Sender::counts`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendCounts {
    /// Transfers that ended failed.
    pub failed: u64,
    /// Frames that did not fit the state.
    pub malformed: u64,
}

/// The sending side of staged transfers. See the module docs.
#[derive(Debug)]
pub struct Sender {
    cfg: SendConfig,
    out: HashMap<u64, Outgoing>,
    /// Tags in post order (lanes are handed out in this order).
    order: VecDeque<u64>,
    /// Per lane, the piece that holds it: (tag, piece).
    lanes: Vec<Option<(u64, u32)>>,
    /// Pieces in [`Piece::Granted`] (waiting for a lane).
    granted: usize,
    /// Pieces holding a lane ahead of their grant ([`Piece::Gathering`] without a grant,
    /// [`Piece::Gathered`]).
    ahead: usize,
    /// Pieces the current turn may still gather ahead of their grants.
    ahead_budget: usize,
    actions: VecDeque<Action>,
    counts: SendCounts,
}

impl Sender {
    /// A sender with `cfg.lanes` free lanes.
    pub fn new(cfg: SendConfig) -> Sender {
        Sender {
            cfg,
            out: HashMap::new(),
            order: VecDeque::new(),
            lanes: vec![None; cfg.lanes],
            granted: 0,
            ahead: 0,
            ahead_budget: 0,
            actions: VecDeque::new(),
            counts: SendCounts::default(),
        }
    }

    // ---- getters ----

    /// The next thing to do.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// The earliest time [`Sender::handle_timeout`] has something to do: a cancel's stall bound.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let stall = self.cfg.stall_timeout_us;
        self.out
            .values()
            .filter(|o| matches!(o.phase, Phase::Cancelling { .. }))
            .map(|o| o.moved.plus_micros(stall + 1))
            .min()
    }

    /// Per lane, the piece that holds it: (tag, piece).
    pub fn lanes(&self) -> &[Option<(u64, u32)>] {
        &self.lanes
    }

    /// Piece `piece` of transfer `tag`.
    pub fn piece(&self, tag: u64, piece: u32) -> Option<Piece> {
        self.out.get(&tag)?.pieces.get(piece as usize).copied()
    }

    /// Transfer `tag`'s phase.
    pub fn phase(&self, tag: u64) -> Option<&Phase> {
        self.out.get(&tag).map(|o| &o.phase)
    }

    /// Transfer `tag`'s receiver.
    pub fn peer(&self, tag: u64) -> Option<&str> {
        self.out.get(&tag).map(|o| o.peer.as_str())
    }

    /// Pieces that will need a lane (waiting for a grant or granted) of transfers still sending,
    /// in the order lanes are handed out: (tag, piece).
    pub fn upcoming(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.order
            .iter()
            .filter_map(|t| self.out.get(t).filter(|o| o.phase == Phase::Sending).map(|o| (*t, o)))
            .flat_map(|(t, o)| {
                o.pieces
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| matches!(p, Piece::Waiting | Piece::Granted { .. }))
                    .map(move |(i, _)| (t, i as u32))
            })
    }

    /// Transfers not yet reported.
    pub fn open(&self) -> usize {
        self.out.values().filter(|o| o.phase != Phase::Reported).count()
    }

    /// Lanes in use.
    pub fn lanes_in_use(&self) -> usize {
        self.lanes.iter().filter(|l| l.is_some()).count()
    }

    /// Whether anything is tracked.
    pub fn busy(&self) -> bool {
        !self.out.is_empty()
    }

    /// Counts.
    pub fn counts(&self) -> SendCounts {
        self.counts
    }

    /// Pieces (granted, waiting for a lane; holding a lane ahead of their grant), as kept, and as
    /// counted afresh from the pieces: the two agree (the simulator checks it after every event).
    pub fn tallies(&self) -> ((usize, usize), (usize, usize)) {
        let pieces = || self.out.values().flat_map(|o| &o.pieces);
        let granted = pieces().filter(|p| matches!(p, Piece::Granted { .. })).count();
        let ahead =
            pieces().filter(|p| matches!(p, Piece::Gathering { grant: None, .. } | Piece::Gathered { .. })).count();
        ((self.granted, self.ahead), (granted, ahead))
    }

    // ---- inputs ----

    /// A new transfer of `pieces` pieces (at least 1) to `peer`, whose REQUEST the carrier sent.
    pub fn handle_post(&mut self, now: Instant, tag: u64, peer: &str, pieces: u32) {
        let o = Outgoing {
            peer: peer.to_owned(),
            pieces: vec![Piece::Waiting; pieces as usize],
            written: 0,
            done: false,
            phase: Phase::Sending,
            moved: now,
        };
        if self.out.insert(tag, o).is_none() {
            self.order.push_back(tag);
        }
        self.advance(now);
    }

    /// The carrier's turn: one piece may be gathered ahead of its grant before the next turn (so
    /// the carrier looks at its notifications, where grants arrive, between such gathers).
    pub fn handle_turn(&mut self, now: Instant) {
        self.ahead_budget = 1;
        self.advance(now);
    }

    /// A frame for the sending side from `from` (GRANT, FAIL, DONE, CANCELLED; others count as
    /// malformed).
    pub fn handle_frame(&mut self, now: Instant, from: &str, frame: Frame) {
        let tag = frame.tag();
        let Some(o) = self.out.get_mut(&tag).filter(|o| o.peer == from && o.phase != Phase::Reported) else {
            match frame {
                // A transfer we finished and forgot (its last notification was lost, say): nothing
                // of it is in flight here, so the receiver may free its slots.
                Frame::Fail { .. } => self.send(from, Frame::Cancel { tag }),
                Frame::Cancelled { .. } => {}
                _ => self.counts.malformed += 1,
            }
            return;
        };
        o.moved = now;
        match frame {
            Frame::Grant { piece, slot, addr, .. } => match o.pieces.get_mut(piece as usize) {
                Some(p @ Piece::Waiting) => {
                    if o.phase == Phase::Sending {
                        *p = Piece::Granted { slot, addr };
                        self.granted += 1;
                    } else {
                        *p = Piece::Written;
                    }
                }
                // Gathered ahead: written once its gather ended (a failed one frees its lane then).
                Some(p @ Piece::Gathering { grant: None, .. }) => {
                    let Piece::Gathering { lane, .. } = *p else { return };
                    *p = Piece::Gathering { lane, grant: Some((slot, addr)) };
                    self.ahead -= 1;
                }
                Some(p @ Piece::Gathered { .. }) => {
                    let Piece::Gathered { lane } = *p else { return };
                    *p = Piece::Writing { lane };
                    self.ahead -= 1;
                    let peer = o.peer.clone();
                    self.actions.push_back(Action::Write { peer, tag, piece, lane, slot, addr });
                }
                _ => self.counts.malformed += 1,
            },
            Frame::Fail { detail, .. } => {
                o.fail(format!("{from} failed the staged transfer: {detail}"));
                self.abandon(tag);
            }
            // (It may overtake the end of our last WRITE: the outcome waits for both.)
            Frame::Done { .. } => o.done = true,
            Frame::Cancelled { .. } => match &o.phase {
                Phase::Cancelling { why } => {
                    o.phase = Phase::Finished { outcome: Err(why.clone()) };
                    self.counts.failed += 1;
                }
                _ => self.counts.malformed += 1,
            },
            _ => self.counts.malformed += 1,
        }
        self.advance_one(now, tag);
    }

    /// The gather into lane `lane` ended (or did not start): `Err` carries why.
    pub fn handle_gathered(&mut self, now: Instant, lane: usize, result: Result<(), String>) {
        let Some(Some((tag, piece))) = self.lanes.get(lane).copied() else { return };
        let Some(o) = self.out.get_mut(&tag) else { return };
        let i = piece as usize;
        let Piece::Gathering { grant, .. } = o.pieces[i] else { return };
        o.moved = now;
        if grant.is_none() && (result.is_err() || o.failed()) {
            self.ahead -= 1;
        }
        match (result, grant) {
            (Err(why), _) => {
                o.pieces[i] = Piece::Written;
                self.lanes[lane] = None;
                o.fail(why);
            }
            (Ok(()), _) if o.failed() => {
                o.pieces[i] = Piece::Written;
                self.lanes[lane] = None;
            }
            (Ok(()), None) => o.pieces[i] = Piece::Gathered { lane },
            (Ok(()), Some((slot, addr))) => {
                o.pieces[i] = Piece::Writing { lane };
                let peer = o.peer.clone();
                self.actions.push_back(Action::Write { peer, tag, piece, lane, slot, addr });
            }
        }
        self.abandon_failed(tag);
        self.advance_one(now, tag);
    }

    /// The WRITE out of lane `lane` ended (or was not posted): `Err` carries why.
    pub fn handle_written(&mut self, now: Instant, lane: usize, result: Result<(), String>) {
        let Some(Some((tag, piece))) = self.lanes.get(lane).copied() else { return };
        let Some(o) = self.out.get_mut(&tag) else { return };
        let i = piece as usize;
        if !matches!(o.pieces[i], Piece::Writing { .. }) {
            return;
        }
        o.moved = now;
        o.pieces[i] = Piece::Written;
        self.lanes[lane] = None;
        match result {
            Ok(()) => o.written += 1,
            Err(why) => o.fail(why),
        }
        self.abandon_failed(tag);
        self.advance_one(now, tag);
    }

    /// The consumer gave up on transfer `tag`: nothing more is gathered or written, the receiver
    /// is told to drop what it holds (CANCEL once our WRITEs ended), then it fails. Returns whether
    /// it was still sending.
    pub fn handle_cancel(&mut self, now: Instant, tag: u64) -> bool {
        let Some(o) = self.out.get_mut(&tag).filter(|o| o.phase == Phase::Sending) else { return false };
        o.fail("cancelled: the consumer gave up on the request".into());
        self.abandon(tag);
        self.advance_one(now, tag);
        true
    }

    /// `peer` is gone: its transfers fail at once (its receive slots are the receiver's to
    /// quarantine); pieces being gathered or written keep their lanes until those end.
    pub fn handle_peer_lost(&mut self, now: Instant, peer: &str) {
        let tags: Vec<u64> =
            self.order.iter().copied().filter(|t| self.out.get(t).is_some_and(|o| o.peer == peer)).collect();
        for tag in tags {
            let Some(o) = self.out.get_mut(&tag).filter(|o| o.open()) else { continue };
            o.phase = Phase::Finished { outcome: Err(format!("peer {peer} lost during a staged transfer")) };
            self.abandon(tag);
        }
        self.advance(now);
    }

    /// The carrier asks for transfer `tag`'s outcome: reported once.
    pub fn handle_report(&mut self, now: Instant, tag: u64) -> Report {
        let Some(o) = self.out.get_mut(&tag) else { return Report::Unknown };
        let outcome = match &o.phase {
            Phase::Reported => return Report::Unknown,
            Phase::Finished { outcome } => outcome.clone(),
            _ => return Report::Pending,
        };
        o.phase = Phase::Reported;
        self.settle(now, tag);
        Report::Finished(outcome)
    }

    /// Time passed: a cancel the receiver never confirmed gives up on it.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.advance(now);
    }

    // ---- internals ----

    fn send(&mut self, peer: &str, frame: Frame) {
        self.actions.push_back(Action::Send { peer: peer.to_owned(), frame });
    }

    /// [`Sender::abandon`] if transfer `tag` failed.
    fn abandon_failed(&mut self, tag: u64) {
        if self.out.get(&tag).is_some_and(Outgoing::failed) {
            self.abandon(tag);
        }
    }

    /// A failed transfer's pieces with nothing in flight are done with: those waiting for a grant
    /// or a lane, and those gathered ahead of a grant (their lane is free again). Pieces being
    /// gathered or written keep their lanes until that ends.
    fn abandon(&mut self, tag: u64) {
        let Some(o) = self.out.get_mut(&tag) else { return };
        for p in &mut o.pieces {
            match *p {
                Piece::Waiting => *p = Piece::Written,
                Piece::Granted { .. } => {
                    self.granted -= 1;
                    *p = Piece::Written;
                }
                Piece::Gathered { lane } => {
                    self.lanes[lane] = None;
                    self.ahead -= 1;
                    *p = Piece::Written;
                }
                Piece::Gathering { .. } | Piece::Writing { .. } | Piece::Written => {}
            }
        }
    }

    /// Ends what is over (every transfer), forgets what was reported and holds no lane, then hands
    /// out free lanes.
    fn advance(&mut self, now: Instant) {
        for k in 0..self.order.len() {
            let tag = self.order[k];
            self.settle(now, tag);
        }
        self.order.retain(|t| self.out.contains_key(t));
        self.hand_out_lanes(now);
    }

    /// [`Sender::advance`] after an input that concerned transfer `tag` only.
    fn advance_one(&mut self, now: Instant, tag: u64) {
        self.settle(now, tag);
        self.hand_out_lanes(now);
    }

    /// Ends transfer `tag` if it is over; forgets it if reported and holding no lane.
    fn settle(&mut self, now: Instant, tag: u64) {
        let stall = self.cfg.stall_timeout_us;
        let Some(o) = self.out.get_mut(&tag) else { return };
        match &o.phase {
            Phase::Cancelling { why } if now.micros_since(o.moved) > stall => {
                // The receiver never confirmed the cancel: it is unresponsive; give up on it.
                // (Waiting for grants has no limit here: grants queue behind other transfers, a
                // receiver that went away is dropped by the side channel, and a lost piece is the
                // receiver's timeout.)
                let why = format!("{why}; {} never confirmed the cancel", o.peer);
                o.phase = Phase::Finished { outcome: Err(why) };
                self.counts.failed += 1;
            }
            Phase::Sending if o.done && o.written == o.pieces.len() => {
                o.phase = Phase::Finished { outcome: Ok(()) };
            }
            Phase::Failed { why } if !o.busy() => {
                // Nothing of ours is in flight any more: let the receiver drain and free its slots.
                o.phase = Phase::Cancelling { why: why.clone() };
                o.moved = now;
                let peer = o.peer.clone();
                self.send(&peer, Frame::Cancel { tag });
            }
            Phase::Reported if !o.busy() => {
                // (Its tag leaves `order` at the next full advance.)
                self.out.remove(&tag);
            }
            _ => {}
        }
    }

    /// Granted pieces take any free lane. A waiting piece is gathered ahead of its grant (so the
    /// grant finds it ready to write) only while, after it, at least one lane is not held by a
    /// piece waiting for a grant: granted pieces always find a lane (a free one, or one whose WRITE
    /// ends on its own), so no lane can be held up by every receiver at once.
    fn hand_out_lanes(&mut self, now: Instant) {
        let mut free = self.lanes.iter().filter(|l| l.is_none()).count();
        let ahead_ok = |budget: usize, held: usize| budget > 0 && held + 1 < self.cfg.lanes;
        if free == 0 || (self.granted == 0 && !ahead_ok(self.ahead_budget, self.ahead)) {
            return;
        }
        for k in 0..self.order.len() {
            let tag = self.order[k];
            let Some(o) = self.out.get_mut(&tag).filter(|o| o.phase == Phase::Sending) else { continue };
            for i in 0..o.pieces.len() {
                let grant = match o.pieces[i] {
                    Piece::Granted { slot, addr } => Some((slot, addr)),
                    Piece::Waiting if ahead_ok(self.ahead_budget, self.ahead) => None,
                    _ => continue,
                };
                let Some(lane) = self.lanes.iter().position(Option::is_none) else { return };
                o.pieces[i] = Piece::Gathering { lane, grant };
                o.moved = now;
                self.lanes[lane] = Some((tag, i as u32));
                free -= 1;
                if grant.is_some() {
                    self.granted -= 1;
                } else {
                    self.ahead_budget -= 1;
                    self.ahead += 1;
                }
                self.actions.push_back(Action::Gather { tag, piece: i as u32, lane, ahead: grant.is_none() });
                if free == 0 || (self.granted == 0 && !ahead_ok(self.ahead_budget, self.ahead)) {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(s: &mut Sender) -> Vec<Action> {
        std::iter::from_fn(|| s.poll_action()).collect()
    }

    /// A one-lane sender whose request (tag 1, `pieces` pieces, to "d") had its first piece granted
    /// and gathered, so that its WRITE is under way; and the actions it asked for until then.
    fn writing_the_first_piece(pieces: u32) -> (Sender, Vec<Action>) {
        let mut s = Sender::new(SendConfig { lanes: 1, stall_timeout_us: 1_000 });
        s.handle_post(Instant(0), 1, "d", pieces);
        s.handle_frame(Instant(1), "d", Frame::Grant { tag: 1, piece: 0, slot: 0, addr: 0 });
        let mut actions = drain(&mut s);
        s.handle_gathered(Instant(2), 0, Ok(()));
        actions.extend(drain(&mut s));
        (s, actions)
    }

    #[test]
    fn a_granted_piece_is_gathered_then_written_then_done() {
        let mut s = Sender::new(SendConfig { lanes: 2, stall_timeout_us: 1_000 });
        s.handle_post(Instant(0), 7, "d", 1);
        // The turn gathers the piece ahead of its grant (one lane stays for granted pieces).
        s.handle_turn(Instant(1));
        assert_eq!(drain(&mut s), [Action::Gather { tag: 7, piece: 0, lane: 0, ahead: true }]);
        s.handle_gathered(Instant(2), 0, Ok(()));
        assert_eq!(s.piece(7, 0), Some(Piece::Gathered { lane: 0 }));
        s.handle_frame(Instant(3), "d", Frame::Grant { tag: 7, piece: 0, slot: 3, addr: 0x100 });
        let w = Action::Write { peer: "d".into(), tag: 7, piece: 0, lane: 0, slot: 3, addr: 0x100 };
        assert_eq!(drain(&mut s), [w]);
        // DONE may overtake the WRITE's end: the outcome waits for both.
        s.handle_frame(Instant(4), "d", Frame::Done { tag: 7 });
        assert_eq!(s.handle_report(Instant(4), 7), Report::Pending);
        s.handle_written(Instant(5), 0, Ok(()));
        assert_eq!(s.handle_report(Instant(5), 7), Report::Finished(Ok(())));
        assert_eq!(s.handle_report(Instant(5), 7), Report::Unknown);
        assert!(!s.busy());
    }

    #[test]
    fn a_fail_cancels_only_after_the_write_in_flight_ended() {
        let (mut s, actions) = writing_the_first_piece(2);
        assert_eq!(actions[0], Action::Gather { tag: 1, piece: 0, lane: 0, ahead: false });
        assert!(matches!(actions[1..], [Action::Write { lane: 0, .. }]), "{actions:?}");
        s.handle_frame(Instant(3), "d", Frame::Fail { tag: 1, detail: "stop".into() });
        assert_eq!(drain(&mut s), [], "no CANCEL while the WRITE can still land");
        s.handle_written(Instant(4), 0, Ok(()));
        assert_eq!(drain(&mut s), [Action::Send { peer: "d".into(), frame: Frame::Cancel { tag: 1 } }]);
        assert_eq!(s.handle_report(Instant(5), 1), Report::Pending, "the failure waits for CANCELLED");
        s.handle_frame(Instant(6), "d", Frame::Cancelled { tag: 1 });
        assert!(matches!(s.handle_report(Instant(6), 1), Report::Finished(Err(why)) if why.contains("stop")));
        assert!(!s.busy());
    }

    #[test]
    fn a_lost_peer_fails_at_once_but_keeps_the_lane_until_the_write_ended() {
        let (mut s, _) = writing_the_first_piece(1);
        s.handle_peer_lost(Instant(3), "d");
        assert!(matches!(s.handle_report(Instant(3), 1), Report::Finished(Err(_))));
        s.handle_post(Instant(4), 2, "e", 1);
        s.handle_frame(Instant(5), "e", Frame::Grant { tag: 2, piece: 0, slot: 0, addr: 0 });
        assert!(!drain(&mut s).iter().any(|a| matches!(a, Action::Gather { tag: 2, .. })), "lane reused under a WRITE");
        s.handle_written(Instant(6), 0, Err("peer gone".into()));
        assert!(drain(&mut s).contains(&Action::Gather { tag: 2, piece: 0, lane: 0, ahead: false }));
    }
}
