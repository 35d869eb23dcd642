//! The receiving side of staged transfers: REQUESTs queue, free receive slots are granted in arrival
//! order, landed pieces are checked and scattered, and a transfer whose every piece was scattered is
//! delivered. A slot is never granted again while a WRITE into it can still land (issue 16,
//! window 2): a slot granted to a sender goes back only when its piece landed and was scattered,
//! when the sender cancelled (nothing of it is in flight), or, for a lost sender, when the transport
//! confirmed the fence; otherwise it stays [`Slot::Quarantined`] until its bound.
//!
//! Inputs are `handle_*(now, …)`; outputs ([`Output`]) are drained with [`Receiver::poll_output`]
//! after every input. The carrier (`transport::staged`) starts the scatters, sends the frames and
//! delivers the notifications; it decides nothing.

use std::collections::{HashMap, VecDeque};

use super::frame::Frame;
use crate::proto::Instant;

/// What the receiver needs to know.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvConfig {
    /// Receive slots.
    pub slots: usize,
    /// Data bytes of one slot.
    pub slot_bytes: u64,
    /// Table entries of one slot.
    pub max_entries: usize,
    /// A granted piece that has not landed for this long, while its sender delivered no other piece
    /// either, fails its transfer (the piece's notification was lost while the sender lives on).
    pub stall_timeout_us: u64,
    /// How long a slot granted to a sender lost without a confirmed fence stays out of use.
    pub quarantine_us: u64,
}

/// A receive slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// Free: the next grant may take it.
    Free,
    /// Granted to piece `piece` of transfer `xfer`: its WRITE may land here.
    Granted {
        /// The transfer (a key of the receiver's table).
        xfer: u64,
        /// The piece.
        piece: u32,
    },
    /// Holding a landed piece of `xfer` that is being scattered.
    Scattering {
        /// The transfer.
        xfer: u64,
    },
    /// Was granted to a sender lost without a confirmed fence: its WRITE may still land here, so
    /// the slot is neither granted nor scattered before `until`.
    Quarantined {
        /// When it may be granted again.
        until: Instant,
    },
}

/// Where an incoming transfer stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Slots are granted to it and its pieces scattered.
    Receiving,
    /// This side failed it (FAIL sent): no more grants or scatters; its sender's CANCEL ends it.
    Failed,
    /// Its sender cancelled it: CANCELLED is answered once nothing of it is in a slot.
    Cancelled,
    /// Its sender was lost: forgotten once nothing of it is in a slot.
    Gone,
}

/// One incoming staged transfer.
#[derive(Clone, Debug)]
struct Incoming {
    peer: String,
    tag: u64,
    pieces: u32,
    notif: Vec<u8>,
    granted: u32,
    scattered: u32,
    phase: Phase,
    /// Last progress (it arrived, a slot was granted to it, a piece landed or was scattered, or it
    /// failed). The stall bound runs from here: a transfer that queued for its grant longer than
    /// the bound is not failed the moment it is granted.
    moved: Instant,
}

/// What the carrier does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Output {
    /// Send `frame` to `peer`. A [`Frame::Grant`]'s `addr` is 0: the carrier puts the slot's address.
    Send {
        /// The sender of the transfer.
        peer: String,
        /// What to send.
        frame: Frame,
    },
    /// Every piece is in place: deliver the sender's notification.
    Deliver {
        /// The sender.
        peer: String,
        /// Its notification.
        notif: Vec<u8>,
    },
}

/// A PIECE notification's fields ([`Frame::Piece`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PieceNote {
    /// The transfer.
    pub tag: u64,
    /// The piece.
    pub piece: u32,
    /// The receive slot it was written into.
    pub slot: u32,
    /// Table entries.
    pub entries: u32,
    /// Data bytes.
    pub bytes: u64,
}

/// What a landed piece asks of the carrier ([`Receiver::handle_piece`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Landed {
    /// Check the table of slot `slot` and start scattering `entries` entries of `bytes` bytes; then
    /// report [`Receiver::handle_scatter_started`].
    Scatter {
        /// The receive slot.
        slot: usize,
        /// Table entries.
        entries: u32,
        /// Data bytes.
        bytes: u64,
    },
    /// Nothing to do (refused, or a piece of a transfer that no longer takes any: its slot is free).
    Nothing,
}

/// Cumulative counts, and the gauges of [`Receiver::counts`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecvCounts {
    /// Transfers delivered.
    pub received: u64,
    /// Transfers that ended without delivery.
    pub failed: u64,
    /// Frames that did not fit the state.
    pub malformed: u64,
    /// Slots quarantined (granted to a sender lost without a confirmed fence).
    pub slots_quarantined: u64,
    /// Pieces that landed after their transfer was failed, not scattered.
    pub dropped: u64,
    /// Incoming transfers tracked (gauge).
    pub incoming: u64,
    /// Slots not free (gauge).
    pub slots_in_use: u64,
}

/// The receiving side of staged transfers. See the module docs.
#[derive(Debug)]
pub struct Receiver {
    cfg: RecvConfig,
    slots: Vec<Slot>,
    incoming: HashMap<u64, Incoming>,
    /// The grant queue: transfers in arrival order.
    order: VecDeque<u64>,
    next_xfer: u64,
    /// When a piece last landed from each sender: a sender still delivering pieces is alive, and a
    /// granted slot of its that waits is queued behind its other work, not lost.
    landed: HashMap<String, Instant>,
    /// Lost peers whose access to our memory the transport confirmed cut.
    fenced: Vec<String>,
    out: VecDeque<Output>,
    counts: RecvCounts,
}

impl Receiver {
    /// A receiver with `cfg.slots` free slots.
    pub fn new(cfg: RecvConfig) -> Receiver {
        Receiver {
            cfg,
            slots: vec![Slot::Free; cfg.slots],
            incoming: HashMap::new(),
            order: VecDeque::new(),
            next_xfer: 0,
            landed: HashMap::new(),
            fenced: Vec::new(),
            out: VecDeque::new(),
            counts: RecvCounts::default(),
        }
    }

    // ---- getters ----

    /// The next thing to do.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.out.pop_front()
    }

    /// The earliest time [`Receiver::handle_timeout`] has something to do.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let quarantine = self.slots.iter().filter_map(|s| match *s {
            Slot::Quarantined { until } => Some(until),
            _ => None,
        });
        let stall =
            self.incoming.iter().filter(|(x, i)| i.phase == Phase::Receiving && self.waiting_for_sender(**x)).map(
                |(_, i)| {
                    let quiet = self.landed.get(&i.peer).map_or(i.moved, |&t| t.max(i.moved));
                    quiet.plus_micros(self.cfg.stall_timeout_us + 1)
                },
            );
        quarantine.chain(stall).min()
    }

    /// The slots.
    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// Whose piece slot `slot` is granted to or scattering: (sender, tag, piece; `None` while
    /// scattering).
    pub fn holder(&self, slot: usize) -> Option<(&str, u64, Option<u32>)> {
        let (xfer, piece) = match *self.slots.get(slot)? {
            Slot::Granted { xfer, piece } => (xfer, Some(piece)),
            Slot::Scattering { xfer } => (xfer, None),
            Slot::Free | Slot::Quarantined { .. } => return None,
        };
        self.incoming.get(&xfer).map(|i| (i.peer.as_str(), i.tag, piece))
    }

    /// Counts and gauges.
    pub fn counts(&self) -> RecvCounts {
        RecvCounts {
            incoming: self.incoming.len() as u64,
            slots_in_use: self.slots.iter().filter(|s| **s != Slot::Free).count() as u64,
            ..self.counts
        }
    }

    /// Whether anything is tracked (a transfer, or a slot not free).
    pub fn busy(&self) -> bool {
        !self.incoming.is_empty()
    }

    /// The phase of `peer`'s transfer `tag`, if tracked.
    pub fn phase(&self, peer: &str, tag: u64) -> Option<Phase> {
        self.find(peer, tag).map(|x| self.incoming[&x].phase)
    }

    fn find(&self, peer: &str, tag: u64) -> Option<u64> {
        self.incoming.iter().find(|(_, i)| i.peer == peer && i.tag == tag).map(|(x, _)| *x)
    }

    fn in_slot(&self, xfer: u64) -> bool {
        self.slots
            .iter()
            .any(|s| matches!(*s, Slot::Granted { xfer: x, .. } | Slot::Scattering { xfer: x } if x == xfer))
    }

    fn waiting_for_sender(&self, xfer: u64) -> bool {
        self.slots.iter().any(|s| matches!(*s, Slot::Granted { xfer: x, .. } if x == xfer))
    }

    // ---- inputs ----

    /// A frame for the receiving side from `from` (REQUEST, CANCEL; a PIECE goes to
    /// [`Receiver::handle_piece`]). Other frames count as malformed.
    pub fn handle_frame(&mut self, now: Instant, from: &str, frame: Frame) {
        match frame {
            Frame::Request { tag, pieces, notif } => {
                if pieces == 0 || self.find(from, tag).is_some() {
                    self.counts.malformed += 1;
                    return;
                }
                let xfer = self.next_xfer;
                self.next_xfer += 1;
                let i = Incoming {
                    peer: from.to_owned(),
                    tag,
                    pieces,
                    notif,
                    granted: 0,
                    scattered: 0,
                    phase: Phase::Receiving,
                    moved: now,
                };
                self.incoming.insert(xfer, i);
                self.order.push_back(xfer);
            }
            Frame::Cancel { tag } => {
                let Some(xfer) = self.find(from, tag) else {
                    // Nothing of it here (never requested, or already finished): confirm at once.
                    self.send(from, Frame::Cancelled { tag });
                    return;
                };
                if let Some(i) = self.incoming.get_mut(&xfer).filter(|i| i.phase != Phase::Gone) {
                    i.phase = Phase::Cancelled;
                }
                // Granted slots will receive nothing more from this sender.
                for s in &mut self.slots {
                    if matches!(*s, Slot::Granted { xfer: x, .. } if x == xfer) {
                        *s = Slot::Free;
                    }
                }
            }
            _ => self.counts.malformed += 1,
        }
        self.advance(now);
    }

    /// The WRITE of a piece from `from` landed (its PIECE notification, which the data path
    /// delivers after the data). Returns what the carrier does with the slot.
    pub fn handle_piece(&mut self, now: Instant, from: &str, note: PieceNote) -> Landed {
        let PieceNote { tag, piece, slot, entries, bytes } = note;
        let Some(xfer) = self.find(from, tag) else {
            self.counts.malformed += 1;
            return Landed::Nothing;
        };
        let s = slot as usize;
        if self.slots.get(s) != Some(&Slot::Granted { xfer, piece }) {
            self.counts.malformed += 1;
            self.fail(now, xfer, format!("piece {piece} landed in slot {slot}, not granted to it"));
            self.advance(now);
            return Landed::Nothing;
        }
        self.landed.insert(from.to_owned(), now);
        let phase = self.incoming.get(&xfer).map(|i| i.phase);
        if phase != Some(Phase::Receiving) {
            // Failed here (say the consumer gave up on its request): the WRITE has landed and
            // nothing more comes into this slot; it is not scattered into blocks the request may
            // no longer own.
            self.slots[s] = Slot::Free;
            self.counts.dropped += 1;
            self.advance(now);
            return Landed::Nothing;
        }
        if let Some(i) = self.incoming.get_mut(&xfer) {
            i.moved = now;
        }
        let n = entries as usize;
        if n == 0 || n > self.cfg.max_entries || bytes > self.cfg.slot_bytes {
            self.slots[s] = Slot::Free;
            self.fail(now, xfer, format!("piece {piece}: {n} entries and {bytes} bytes do not fit a slot"));
            self.advance(now);
            return Landed::Nothing;
        }
        self.slots[s] = Slot::Scattering { xfer };
        Landed::Scatter { slot: s, entries, bytes }
    }

    /// The carrier checked slot `slot`'s table and started its scatter (`Ok`), or refused it.
    pub fn handle_scatter_started(&mut self, now: Instant, slot: usize, result: Result<(), String>) {
        let Some(&Slot::Scattering { xfer }) = self.slots.get(slot) else { return };
        if let Err(why) = result {
            self.slots[slot] = Slot::Free;
            self.fail(now, xfer, why);
        }
        self.advance(now);
    }

    /// Slot `slot`'s scatter ended.
    pub fn handle_scatter_done(&mut self, now: Instant, slot: usize, result: Result<(), String>) {
        let Some(&Slot::Scattering { xfer }) = self.slots.get(slot) else { return };
        self.slots[slot] = Slot::Free;
        match result {
            Ok(()) => {
                if let Some(i) = self.incoming.get_mut(&xfer) {
                    i.scattered += 1;
                    i.moved = now;
                }
            }
            Err(why) => self.fail(now, xfer, format!("scatter: {why}")),
        }
        self.advance(now);
    }

    /// The transport confirmed that `peer`'s access to our memory is cut (its fence): when it is
    /// dropped, its granted slots are free at once.
    pub fn handle_fenced(&mut self, peer: &str) {
        if !self.fenced.iter().any(|p| p == peer) {
            self.fenced.push(peer.to_owned());
        }
    }

    /// `peer` is gone. Its granted slots may still receive its WRITE unless its fence was confirmed
    /// ([`Receiver::handle_fenced`]): then they are free; otherwise quarantined. Slots being
    /// scattered finish their scatter (our own copy).
    pub fn handle_peer_lost(&mut self, now: Instant, peer: &str) {
        self.landed.remove(peer);
        let fenced = self.fenced.iter().any(|p| p == peer);
        self.fenced.retain(|p| p != peer);
        let until = now.plus_micros(self.cfg.quarantine_us);
        let xfers: Vec<u64> = self.incoming.iter().filter(|(_, i)| i.peer == peer).map(|(x, _)| *x).collect();
        for xfer in xfers {
            for s in &mut self.slots {
                if matches!(*s, Slot::Granted { xfer: x, .. } if x == xfer) {
                    if fenced {
                        *s = Slot::Free;
                    } else {
                        *s = Slot::Quarantined { until };
                        self.counts.slots_quarantined += 1;
                    }
                }
            }
            if let Some(i) = self.incoming.get_mut(&xfer) {
                i.phase = Phase::Gone;
            }
        }
        self.advance(now);
    }

    /// Fails every transfer still receiving whose notification `matches` (the consumer gave up on
    /// the request it completes): no slot is granted to it and no piece of it is scattered any
    /// more; its sender is told (FAIL) and ends it with CANCEL. Returns how many.
    pub fn handle_stop(&mut self, now: Instant, why: &str, mut matches: impl FnMut(&str, &[u8]) -> bool) -> usize {
        let xfers: Vec<u64> = self
            .incoming
            .iter()
            .filter(|(_, i)| i.phase == Phase::Receiving && matches(&i.peer, &i.notif))
            .map(|(x, _)| *x)
            .collect();
        for &xfer in &xfers {
            self.fail(now, xfer, why.to_owned());
        }
        self.advance(now);
        xfers.len()
    }

    /// Time passed: stalled transfers fail, quarantined slots whose bound passed are free again.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.advance(now);
    }

    // ---- internals ----

    fn send(&mut self, peer: &str, frame: Frame) {
        self.out.push_back(Output::Send { peer: peer.to_owned(), frame });
    }

    fn fail(&mut self, now: Instant, xfer: u64, why: String) {
        let Some(i) = self.incoming.get_mut(&xfer).filter(|i| i.phase == Phase::Receiving) else { return };
        i.phase = Phase::Failed;
        i.moved = now;
        let (peer, tag) = (i.peer.clone(), i.tag);
        self.send(&peer, Frame::Fail { tag, detail: why });
    }

    /// Ends what is over, then grants free slots in arrival order.
    fn advance(&mut self, now: Instant) {
        let stall = self.cfg.stall_timeout_us;
        for xfer in self.order.clone() {
            let in_slot = self.in_slot(xfer);
            let waiting = self.waiting_for_sender(xfer);
            let Some(i) = self.incoming.get(&xfer) else { continue };
            let stalled = now.micros_since(i.moved) > stall;
            let quiet = self.landed.get(&i.peer).is_none_or(|&t| now.micros_since(t) > stall);
            if i.phase == Phase::Receiving && stalled && quiet && waiting {
                self.fail(now, xfer, format!("no piece landed for {stall} µs (a staging message was lost?)"));
                continue;
            }
            match i.phase {
                Phase::Receiving if i.scattered == i.pieces => {
                    let Some(i) = self.incoming.remove(&xfer) else { continue };
                    self.counts.received += 1;
                    // The sender's handle is done only now: a transfer this side failed (and whose
                    // notification it therefore never delivers) ends in a failure the sender reports.
                    self.send(&i.peer, Frame::Done { tag: i.tag });
                    self.out.push_back(Output::Deliver { peer: i.peer, notif: i.notif });
                }
                Phase::Cancelled | Phase::Gone if !in_slot => {
                    let Some(i) = self.incoming.remove(&xfer) else { continue };
                    self.counts.failed += 1;
                    if i.phase == Phase::Cancelled {
                        self.send(&i.peer, Frame::Cancelled { tag: i.tag });
                    }
                }
                _ => {}
            }
        }
        self.order.retain(|x| self.incoming.contains_key(x));
        // Quarantined slots come back once their bound passed.
        for s in &mut self.slots {
            if matches!(*s, Slot::Quarantined { until } if until <= now) {
                *s = Slot::Free;
            }
        }
        // Grants, in arrival order.
        while let Some(s) = self.slots.iter().position(|s| *s == Slot::Free) {
            let next =
                self.order.iter().copied().find(|x| {
                    self.incoming.get(x).is_some_and(|i| i.phase == Phase::Receiving && i.granted < i.pieces)
                });
            let Some(xfer) = next else { break };
            let Some(i) = self.incoming.get_mut(&xfer) else { break };
            let piece = i.granted;
            i.granted += 1;
            i.moved = now;
            self.slots[s] = Slot::Granted { xfer, piece };
            let (peer, tag) = (i.peer.clone(), i.tag);
            self.send(&peer, Frame::Grant { tag, piece, slot: s as u32, addr: 0 });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(r: &mut Receiver) -> Vec<Frame> {
        std::iter::from_fn(|| r.poll_output())
            .filter_map(|o| match o {
                Output::Send { frame, .. } => Some(frame),
                Output::Deliver { .. } => None,
            })
            .collect()
    }

    #[test]
    fn the_stall_bound_runs_from_the_grant_not_from_the_request() {
        let cfg =
            RecvConfig { slots: 1, slot_bytes: 4096, max_entries: 4, stall_timeout_us: 1_000, quarantine_us: 10_000 };
        let mut r = Receiver::new(cfg);
        let request = |tag| Frame::Request { tag, pieces: 1, notif: vec![] };
        r.handle_frame(Instant(0), "a", request(1));
        r.handle_frame(Instant(0), "b", request(2));
        assert_eq!(frames(&mut r), [Frame::Grant { tag: 1, piece: 0, slot: 0, addr: 0 }]);
        // a's piece holds the only slot far past the bound; b queues for it, landing nothing.
        let note = PieceNote { tag: 1, piece: 0, slot: 0, entries: 1, bytes: 4096 };
        assert!(matches!(r.handle_piece(Instant(100), "a", note), Landed::Scatter { slot: 0, .. }));
        r.handle_scatter_started(Instant(100), 0, Ok(()));
        r.handle_scatter_done(Instant(5_000), 0, Ok(()));
        assert_eq!(frames(&mut r), [Frame::Done { tag: 1 }, Frame::Grant { tag: 2, piece: 0, slot: 0, addr: 0 }]);
        // Just granted: b's sender has the whole bound to write it.
        r.handle_timeout(Instant(5_100));
        assert_eq!(frames(&mut r), [], "failed the moment it was granted");
        r.handle_timeout(Instant(6_001));
        assert!(matches!(&frames(&mut r)[..], [Frame::Fail { tag: 2, .. }]), "the bound still holds");
    }
}
