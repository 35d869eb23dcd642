//! Stress and fault-injection tests of real engines: a producer (P) and a consumer (D) engine with 1 or
//! 2 TP workers each, on host memory, the loopback transport and a [`LocalHub`] control link, driven by
//! a scripted driver loop that plays both engine loops.
//!
//! Every request is a script of steps (fill P's blocks and call `request_finished`, allocate D's blocks
//! and call `blocks_allocated` or `start_pull`, abort on either side, inject a transport fault, wait
//! for an outcome, sleep). The driver runs all scripts concurrently, polls both engines, releases
//! P's blocks once every P worker reported `Finished::Sent`, frees D's blocks once every D worker
//! reported its outcome (after checking every byte with `pattern::verify` when all of them received),
//! and checks, for every key and every worker:
//!
//! * P reports exactly one `Sent` per worker for each key it was given, D exactly one outcome per
//!   worker for each key it was given, and nothing at all for keys never given;
//! * the outcome is one the script allows (e.g. an abort before the data came ends with `Ended`);
//! * a D outcome never comes later than the completion timeout (plus a margin) after registration,
//!   and a lease never expires before the lease time;
//! * every block handed to an engine comes back exactly once and both pools end full (the pools are
//!   LIFO, so a late write into freed blocks corrupts the next request and fails its verification);
//! * the engines' counters agree with what the driver saw.
//!
//! One known issue is documented by an ignored test at the end (D reuses blocks a producer may still
//! write); the driver keeps such blocks out of its pool until P released the request.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpush::device::host::HostDevice;
use kvpush::device::Device;
use kvpush::engine::{Config, Finished, LocalHub, Staging, StatsSnapshot};
use kvpush::proto::completion::CompletionConfig;
use kvpush::proto::msg::blocks_for;
use kvpush::proto::rendezvous::{ReleaseReason, RendezvousConfig};
use kvpush::proto::{Key, Mode};
use kvpush::transport::loopback::{Fabric, Fault, FaultRates};
use kvpush::transport::staged::StagingConfig;
use kvpush_testkit::demo::pattern;
use kvpush_testkit::engines::{self, wait_for, Worker};
use kvpush_testkit::layouts;
use kvpush_testkit::rng::Rng;

const BLOCK_TOKENS: u32 = layouts::BLOCK_TOKENS;
const P_ENGINE: &str = "prefill";
const D_ENGINE: &str = "decode";

use ReleaseReason as R;

// ---------------------------------------------------------------------------------------------
// Setup: two engines on one fabric.

#[derive(Clone, Debug)]
struct Setup {
    mode: Mode,
    p_tp: u16,
    d_tp: u16,
    writers: usize,
    num_blocks: u32,
    lease: Duration,
    registration_timeout: Duration,
    completion_timeout: Duration,
    pull_read_timeout: Duration,
    /// How late after `completion_timeout` a D outcome may still come (scheduling on a loaded machine).
    margin: Duration,
    /// Staging of P's WRITEs.
    staging: Staging,
}

impl Setup {
    fn new(mode: Mode, p_tp: u16, d_tp: u16) -> Self {
        Setup {
            mode,
            p_tp,
            d_tp,
            writers: 1,
            num_blocks: 4096,
            // Long enough that no request of a loaded machine's slow driver runs into them; tests of
            // the timeouts themselves set short ones.
            lease: Duration::from_secs(60),
            registration_timeout: Duration::from_secs(60),
            completion_timeout: Duration::from_secs(60),
            pull_read_timeout: Duration::from_secs(60),
            margin: Duration::from_secs(3),
            staging: Staging::Off,
        }
    }

    fn config(&self, engine_id: &str) -> Config {
        let mut c = Config::new(engine_id, self.mode);
        c.writers = self.writers;
        c.rendezvous = RendezvousConfig {
            lease_us: self.lease.as_micros() as u64,
            registration_timeout_us: self.registration_timeout.as_micros() as u64,
            ..RendezvousConfig::default()
        };
        c.completion = CompletionConfig { timeout_us: self.completion_timeout.as_micros() as u64, ..c.completion };
        c.pull_read_timeout_us = self.pull_read_timeout.as_micros() as u64;
        c.staging = self.staging;
        c
    }
}

struct Cluster {
    setup: Setup,
    p: Vec<Worker>,
    d: Vec<Worker>,
    _hub: Arc<LocalHub>,
    _fabric: Fabric,
}

/// The engines of one side: `tp` workers of two layers, two KV heads of dimension 8 (bf16).
fn build_side(setup: &Setup, engine_id: &str, tp: u16, fabric: &Fabric, hub: &Arc<LocalHub>) -> Vec<Worker> {
    let device: Arc<dyn Device> = Arc::new(HostDevice::new());
    (0..tp)
        .map(|r| {
            let layout = layouts::separate(layouts::full_model(2, 2, 8), setup.num_blocks, layouts::tp(r, tp));
            // SAFETY: (precondition 2) the driver follows the block ownership rules: P's blocks return
            // to the pool (and are refilled) only after `Finished::Sent` from every P worker, D's are
            // read (verified) and reused only after every D worker reported the request's outcome.
            unsafe {
                engines::loopback_worker(
                    setup.config(engine_id),
                    layout,
                    &device,
                    fabric,
                    &format!("{engine_id}/{r}"),
                    hub,
                )
            }
        })
        .collect()
}

impl Cluster {
    fn new(setup: Setup) -> Cluster {
        let fabric = Fabric::new();
        let hub = LocalHub::new();
        let p = build_side(&setup, P_ENGINE, setup.p_tp, &fabric, &hub);
        let d = build_side(&setup, D_ENGINE, setup.d_tp, &fabric, &hub);
        for a in &p {
            for b in &d {
                engines::connect(&a.engine, &b.engine);
            }
        }
        Cluster { setup, p, d, _hub: hub, _fabric: fabric }
    }

    /// How many D workers P worker `i` writes into (their KV heads overlap).
    fn p_fan_out(&self, i: usize) -> usize {
        let mine = self.p[i].engine.layout().head_range();
        self.d
            .iter()
            .filter(|d| {
                let theirs = d.engine.layout().head_range();
                mine.start < theirs.end && theirs.start < mine.end
            })
            .count()
    }
}

// ---------------------------------------------------------------------------------------------
// Block pools: every block handed out must come back exactly once.

struct Pool {
    name: &'static str,
    total: u32,
    free: Vec<u32>,
    out: HashSet<u32>,
}

impl Pool {
    fn new(name: &'static str, total: u32) -> Pool {
        // LIFO: a freed block is the next one handed out, so a late write into a freed block lands in
        // the next request's data and fails its verification.
        Pool { name, total, free: (0..total).rev().collect(), out: HashSet::new() }
    }

    fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.free.len() < n {
            return None;
        }
        let ids: Vec<u32> = (0..n).filter_map(|_| self.free.pop()).collect();
        for &b in &ids {
            assert!(self.out.insert(b), "{} pool: block {b} handed out twice", self.name);
        }
        Some(ids)
    }

    fn give(&mut self, ids: &[u32], errors: &mut Vec<String>, what: &str) {
        for &b in ids {
            if self.out.remove(&b) {
                self.free.push(b);
            } else {
                errors.push(format!("{} pool: block {b} released but not handed out ({what})", self.name));
            }
        }
    }

    fn check_full(&self) {
        assert!(self.out.is_empty(), "{} pool: {} blocks never came back", self.name, self.out.len());
        assert_eq!(self.free.len(), self.total as usize, "{} pool is not full", self.name);
    }
}

// ---------------------------------------------------------------------------------------------
// Scripts.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cond {
    /// Every D worker reported an outcome for the attempt.
    DAll(u32),
    /// At least one D worker reported an outcome for the attempt.
    DAny(u32),
    /// Every P worker released the attempt.
    PAll(u32),
    /// Every D worker reported an outcome for another request's key.
    OtherDAll(u128, u32),
    /// P worker `w` has a transfer open on its transport (posted, not yet polled as done) for each D
    /// worker it writes into.
    PInFlight(usize),
}

#[derive(Clone, Debug)]
enum Step {
    Sleep(Duration),
    /// Fill P's blocks for the attempt and call `request_finished` on every P worker.
    PFinish(u32),
    /// `request_finished` on P worker `.1` only (the first call fills the blocks of every worker; a
    /// script must give the attempt to every worker in the end).
    PFinishOn(u32, usize),
    /// Abort the attempt on every P worker.
    PAbort(u32),
    /// Allocate D's blocks for the attempt and call `blocks_allocated` (push) or `start_pull` (pull).
    DAlloc(u32),
    /// Register attempt `.0` on D into the blocks of attempt `.1` (the retry reuses the allocation; the
    /// blocks now belong to the new attempt).
    DAllocReuse(u32, u32),
    /// Abort the attempt on every D worker.
    DAbort(u32),
    /// Queue a one-shot fault on P worker `w`'s transport.
    Inject(usize, Fault),
    Wait(Cond),
}

/// What a D worker reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DKind {
    Received,
    Ended,
    /// Failed by a producer's failure notification (explicit).
    Failed,
    /// Failed by the completion timeout.
    TimedOut,
}

/// The outcomes an attempt may have. `None`: that side must never hear of the key.
#[derive(Clone, Copy, Debug)]
struct Expect {
    p: Option<&'static [ReleaseReason]>,
    d: Option<&'static [DKind]>,
}

const OK: Expect = Expect { p: Some(&[R::Sent]), d: Some(&[DKind::Received]) };

#[derive(Clone, Debug)]
struct Req {
    label: &'static str,
    id: u128,
    tokens: u64,
    script: VecDeque<Step>,
    expect: Vec<(u32, Expect)>,
}

impl Req {
    fn new(label: &'static str, id: u128, tokens: u64, steps: Vec<Step>, expect: Vec<(u32, Expect)>) -> Req {
        Req { label, id, tokens, script: steps.into(), expect }
    }
}

/// The contents of an attempt's KV.
fn seed_of(key: Key) -> u64 {
    let id = key.transfer_id.0;
    (id as u64) ^ ((id >> 64) as u64).rotate_left(17) ^ u64::from(key.attempt.0).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// What the driver saw of one key.
#[derive(Debug)]
struct Track {
    req: usize,
    tokens: u64,
    p_blocks: Option<Vec<Vec<u32>>>,
    /// Per P worker: whether it was given the key (`request_finished`).
    p_given: Vec<bool>,
    p_given_at: Option<Instant>,
    /// Per P worker: release reasons and when they were seen.
    p_sent: Vec<Vec<(ReleaseReason, Instant)>>,
    p_done: bool,
    d_blocks: Option<Vec<Vec<u32>>>,
    /// Whether this key's D blocks go back to the pool with its outcome (not handed to a retry).
    d_owned: bool,
    /// Keys that held these D blocks before (to name the suspect when data arrives wrong).
    d_prev_owners: Vec<Key>,
    d_given_at: Option<Instant>,
    /// Per D worker: outcomes, when they were seen, and their sequence number on that worker.
    d_out: Vec<Vec<(DKind, Instant, u64, String)>>,
    d_done: bool,
    verified: Option<bool>,
    /// D's blocks wait for P's release before they go back to the pool (see `Driver::quarantine`).
    d_quarantined: bool,
    /// First abort that concerns a leg given to an engine (P abort; D abort once D has the key).
    aborted_at: Option<Instant>,
    /// When the driver called `abort` on D.
    d_aborted_at: Option<Instant>,
}

// ---------------------------------------------------------------------------------------------
// The driver.

struct Driver {
    c: Cluster,
    p_pool: Pool,
    d_pool: Pool,
    reqs: Vec<Req>,
    tracks: HashMap<Key, Track>,
    errors: Vec<String>,
    /// Legs given to an engine and not yet answered by every worker, and the most at once.
    open_legs: usize,
    max_open_legs: usize,
    /// Per P worker: `request_finished` calls. Per D worker: `blocks_allocated`/`start_pull` calls.
    p_calls: Vec<u64>,
    d_calls: Vec<u64>,
    /// `abort` calls per worker of each side.
    p_aborts: u64,
    d_aborts: u64,
    /// Per D worker: outcomes by kind (received, failed incl. timed out, ended).
    d_counts: Vec<[u64; 3]>,
    /// Sequence number of D reports, per worker.
    d_seq: Vec<u64>,
    /// The last key each D block was handed to.
    d_owner: HashMap<u32, Key>,
    /// Keep the D blocks of a request that did not arrive (ended, failed, timed out) out of the pool
    /// until P released the request: D reports such a request over while a P write into its blocks
    /// may still be in flight (the known issue at the end of this file), so reusing them at once can
    /// corrupt the next request. On by default.
    quarantine: bool,
    verified_bytes: u64,
    started: Instant,
}

fn outcome_key(f: &Finished) -> Key {
    match f {
        Finished::Sent { key, .. }
        | Finished::Received { key }
        | Finished::Failed { key, .. }
        | Finished::Ended { key } => *key,
    }
}

impl Driver {
    fn new(setup: Setup) -> Driver {
        let c = Cluster::new(setup);
        let n = c.setup.num_blocks;
        let (pn, dn) = (c.p.len(), c.d.len());
        Driver {
            c,
            p_pool: Pool::new("P", n),
            d_pool: Pool::new("D", n),
            reqs: Vec::new(),
            tracks: HashMap::new(),
            errors: Vec::new(),
            open_legs: 0,
            max_open_legs: 0,
            p_calls: vec![0; pn],
            d_calls: vec![0; dn],
            p_aborts: 0,
            d_aborts: 0,
            d_counts: vec![[0; 3]; dn],
            d_seq: vec![0; dn],
            d_owner: HashMap::new(),
            quarantine: true,
            verified_bytes: 0,
            started: Instant::now(),
        }
    }

    fn track(&mut self, req: usize, key: Key) -> &mut Track {
        let tokens = self.reqs[req].tokens;
        let (pn, dn) = (self.c.p.len(), self.c.d.len());
        self.tracks.entry(key).or_insert_with(|| Track {
            req,
            tokens,
            p_blocks: None,
            p_given: vec![false; pn],
            p_given_at: None,
            p_sent: vec![Vec::new(); pn],
            p_done: false,
            d_blocks: None,
            d_owned: false,
            d_prev_owners: Vec::new(),
            d_given_at: None,
            d_out: vec![Vec::new(); dn],
            d_done: false,
            verified: None,
            d_quarantined: false,
            aborted_at: None,
            d_aborted_at: None,
        })
    }

    fn cond(&self, req: usize, cond: Cond) -> bool {
        let id = self.reqs[req].id;
        match cond {
            Cond::DAll(a) => self.tracks.get(&Key::new(id, a)).is_some_and(|t| t.d_out.iter().all(|o| !o.is_empty())),
            Cond::DAny(a) => self.tracks.get(&Key::new(id, a)).is_some_and(|t| t.d_out.iter().any(|o| !o.is_empty())),
            Cond::OtherDAll(other, a) => {
                self.tracks.get(&Key::new(other, a)).is_some_and(|t| t.d_out.iter().all(|o| !o.is_empty()))
            }
            Cond::PAll(a) => self.tracks.get(&Key::new(id, a)).is_some_and(|t| t.p_done),
            Cond::PInFlight(w) => match self.c.p[w].engine.staging_counts() {
                // Staged: every transfer is open in the staging layer and a piece is on the wire.
                Some(c) => c.open as usize >= self.c.p_fan_out(w) && self.c.p[w].transport.open_transfers() > 0,
                None => self.c.p[w].transport.open_transfers() >= self.c.p_fan_out(w),
            },
        }
    }

    /// Runs the steps of request `i` that are due; returns when it sleeps, waits, or is done.
    fn advance(&mut self, i: usize, heap: &mut BinaryHeap<Reverse<(Instant, usize)>>, parked: &mut Vec<usize>) {
        while let Some(step) = self.reqs[i].script.front().cloned() {
            let id = self.reqs[i].id;
            let tokens = self.reqs[i].tokens;
            match step {
                Step::Sleep(d) => {
                    self.reqs[i].script.pop_front();
                    if !d.is_zero() {
                        heap.push(Reverse((Instant::now() + d, i)));
                        return;
                    }
                }
                Step::Wait(cond) => {
                    if !self.cond(i, cond) {
                        parked.push(i);
                        return;
                    }
                    self.reqs[i].script.pop_front();
                }
                Step::PFinish(a) | Step::PFinishOn(a, _) => {
                    let key = Key::new(id, a);
                    if self.tracks.get(&key).is_none_or(|t| t.p_blocks.is_none()) {
                        let n = blocks_for(tokens, BLOCK_TOKENS) as usize;
                        let Some(ids) = self.p_pool.take(n) else {
                            heap.push(Reverse((Instant::now() + Duration::from_millis(1), i)));
                            return;
                        };
                        let blocks = vec![ids];
                        for w in &self.c.p {
                            pattern::fill(w.engine.layout(), &w.buffers, &blocks, tokens, seed_of(key))
                                .expect("prefill");
                        }
                        let t = self.track(i, key);
                        t.p_blocks = Some(blocks);
                        t.p_given_at = Some(Instant::now());
                        self.open_legs += 1;
                        self.max_open_legs = self.max_open_legs.max(self.open_legs);
                    }
                    let workers: Vec<usize> = match step {
                        Step::PFinishOn(_, w) => vec![w],
                        _ => (0..self.c.p.len()).collect(),
                    };
                    let t = self.tracks.get_mut(&key).expect("tracked");
                    let blocks = t.p_blocks.clone().expect("filled");
                    for w in workers {
                        assert!(!t.p_given[w], "script error: {key} finished twice on P[{w}]");
                        t.p_given[w] = true;
                        self.c.p[w].engine.request_finished(key, blocks.clone(), tokens).expect("request_finished");
                        self.p_calls[w] += 1;
                    }
                    self.reqs[i].script.pop_front();
                }
                Step::DAlloc(_) | Step::DAllocReuse(..) => {
                    let (a, blocks) = match step {
                        Step::DAllocReuse(a, from) => {
                            let old = self.tracks.get_mut(&Key::new(id, from)).expect("script error: nothing to reuse");
                            assert!(old.d_owned && !old.d_done, "script error: blocks of {from} not held");
                            old.d_owned = false;
                            (a, old.d_blocks.clone().expect("script error: nothing to reuse"))
                        }
                        Step::DAlloc(a) => {
                            let n = blocks_for(tokens, BLOCK_TOKENS) as usize;
                            let Some(ids) = self.d_pool.take(n) else {
                                heap.push(Reverse((Instant::now() + Duration::from_millis(1), i)));
                                return;
                            };
                            (a, vec![ids])
                        }
                        _ => unreachable!(),
                    };
                    let key = Key::new(id, a);
                    let mut prev: Vec<Key> =
                        blocks[0].iter().filter_map(|b| self.d_owner.insert(*b, key)).filter(|k| *k != key).collect();
                    prev.sort();
                    prev.dedup();
                    let mode = self.c.setup.mode;
                    let t = self.track(i, key);
                    t.d_prev_owners = prev;
                    assert!(t.d_blocks.is_none(), "script error: {key} allocated twice");
                    let remote = t.p_blocks.clone();
                    t.d_blocks = Some(blocks.clone());
                    t.d_owned = true;
                    t.d_given_at = Some(Instant::now());
                    for (w, d) in self.c.d.iter().enumerate() {
                        match mode {
                            Mode::Push => d.engine.blocks_allocated(key, P_ENGINE, blocks.clone(), tokens),
                            Mode::Pull => {
                                let remote = remote.clone().expect("script error: pull before P finished");
                                d.engine.start_pull(key, P_ENGINE, remote, blocks.clone(), tokens)
                            }
                        }
                        .expect("consumer call");
                        self.d_calls[w] += 1;
                    }
                    self.open_legs += 1;
                    self.max_open_legs = self.max_open_legs.max(self.open_legs);
                    self.reqs[i].script.pop_front();
                }
                Step::PAbort(a) => {
                    let t = self.track(i, Key::new(id, a));
                    t.aborted_at.get_or_insert(Instant::now());
                    for p in &self.c.p {
                        p.engine.abort(Key::new(id, a)).expect("abort");
                    }
                    self.p_aborts += 1;
                    self.reqs[i].script.pop_front();
                }
                Step::DAbort(a) => {
                    let t = self.track(i, Key::new(id, a));
                    let now = Instant::now();
                    if t.d_blocks.is_some() {
                        t.aborted_at.get_or_insert(now);
                    }
                    t.d_aborted_at = Some(now);
                    for d in &self.c.d {
                        d.engine.abort(Key::new(id, a)).expect("abort");
                    }
                    self.d_aborts += 1;
                    self.reqs[i].script.pop_front();
                }
                Step::Inject(w, fault) => {
                    self.c.p[w].transport.inject_once(fault);
                    self.reqs[i].script.pop_front();
                }
            }
        }
    }

    /// Drains both engines; returns the number of results.
    fn poll(&mut self) -> usize {
        let mut got = Vec::new();
        let mut out = Vec::new();
        for (side, workers) in [(0, &self.c.p), (1, &self.c.d)] {
            for (w, worker) in workers.iter().enumerate() {
                worker.engine.poll(&mut out);
                got.extend(out.drain(..).map(|f| (side, w, f)));
            }
        }
        let now = Instant::now();
        let n = got.len();
        for (side, w, f) in got {
            if side == 0 {
                self.on_p(w, f, now);
            } else {
                self.on_d(w, f, now);
            }
        }
        n
    }

    fn on_p(&mut self, w: usize, f: Finished, now: Instant) {
        let key = outcome_key(&f);
        let Finished::Sent { reason, .. } = f else {
            self.errors.push(format!("P[{w}] reported a consumer outcome: {f:?}"));
            return;
        };
        let pn = self.c.p.len();
        let (lease, margin) = (self.c.setup.lease, self.c.setup.margin);
        let Some(t) = self.tracks.get_mut(&key).filter(|t| t.p_given[w]) else {
            self.errors.push(format!("P[{w}] released {key} ({reason:?}), which it was never given"));
            return;
        };
        t.p_sent[w].push((reason, now));
        if t.p_sent[w].len() > 1 {
            self.errors.push(format!("P[{w}] released {key} more than once: {:?}", t.p_sent[w]));
            return;
        }
        let given = t.p_given_at.unwrap_or(now);
        if reason == R::LeaseExpired && t.d_given_at.is_none() && now - given < lease {
            self.errors.push(format!("P[{w}] expired the lease of {key} after {:?} < {lease:?}", now - given));
        }
        if let Some(aborted) = t.aborted_at.filter(|_| reason == R::Aborted) {
            // An aborted key's blocks come back once the transfers reading them are done, not later.
            let held = now - aborted.max(given);
            if held > margin {
                self.errors.push(format!("P[{w}] released aborted {key} only {held:?} after the abort"));
            }
        }
        if t.p_sent.iter().filter(|s| !s.is_empty()).count() == pn {
            t.p_done = true;
            let blocks = t.p_blocks.clone().unwrap_or_default();
            let quarantined = std::mem::take(&mut t.d_quarantined).then(|| t.d_blocks.clone()).flatten();
            self.open_legs -= 1;
            self.p_pool.give(&blocks[0], &mut self.errors, &format!("P blocks of {key}"));
            if let Some(d_blocks) = quarantined {
                self.d_pool.give(&d_blocks[0], &mut self.errors, &format!("D blocks of {key}"));
            }
        }
    }

    fn on_d(&mut self, w: usize, f: Finished, now: Instant) {
        let key = outcome_key(&f);
        let (kind, text) = match &f {
            Finished::Received { .. } => (DKind::Received, String::new()),
            Finished::Ended { .. } => (DKind::Ended, String::new()),
            Finished::Failed { reason, invalid_blocks, .. } => {
                let registered = self.tracks.get(&key).and_then(|t| t.d_blocks.as_ref());
                if registered.is_some_and(|b| b != invalid_blocks) {
                    self.errors.push(format!("D[{w}] failed {key} with blocks {invalid_blocks:?} != {registered:?}"));
                }
                let kind = if reason.contains("timed out") { DKind::TimedOut } else { DKind::Failed };
                (kind, reason.clone())
            }
            Finished::Sent { .. } => {
                self.errors.push(format!("D[{w}] reported a producer release: {f:?}"));
                return;
            }
        };
        self.d_seq[w] += 1;
        let seq = self.d_seq[w];
        self.d_counts[w][match kind {
            DKind::Received => 0,
            DKind::Failed | DKind::TimedOut => 1,
            DKind::Ended => 2,
        }] += 1;
        let margin = self.c.setup.margin;
        let limit = self.c.setup.completion_timeout + margin;
        let Some(t) = self.tracks.get_mut(&key).filter(|t| t.d_blocks.is_some()) else {
            self.errors.push(format!("D[{w}] reported {kind:?} for {key}, which it was never given {text}"));
            return;
        };
        t.d_out[w].push((kind, now, seq, text));
        if t.d_out[w].len() > 1 {
            self.errors.push(format!("D[{w}] reported {key} more than once: {:?}", t.d_out[w]));
            return;
        }
        let waited = now - t.d_given_at.unwrap_or(now);
        if waited > limit {
            self.errors.push(format!("D[{w}] reported {kind:?} for {key} {waited:?} after registration (> {limit:?})"));
        }
        if let Some(aborted) = t.d_aborted_at.filter(|&a| now - a > margin) {
            self.errors.push(format!("D[{w}] reported {kind:?} for {key} {:?} after its abort", now - aborted));
        }
        if t.d_out.iter().all(|o| !o.is_empty()) {
            t.d_done = true;
            self.open_legs -= 1;
            let blocks = t.d_blocks.clone().unwrap_or_default();
            let owned = t.d_owned;
            let received = t.d_out.iter().all(|o| o[0].0 == DKind::Received);
            let p_busy = t.p_given.iter().any(|&g| g) && !t.p_done;
            let quarantine = owned && !received && p_busy && self.quarantine;
            t.d_quarantined = quarantine;
            if owned && received {
                let (tokens, seed) = (t.tokens, seed_of(key));
                let mut ok = true;
                for (j, d) in self.c.d.iter().enumerate() {
                    match pattern::verify(d.engine.layout(), &d.buffers, &blocks, tokens, seed) {
                        Ok(v) if v.ok() => self.verified_bytes += v.bytes,
                        Ok(v) => {
                            ok = false;
                            let e = format!("D[{j}]: {key} arrived wrong: {v:?}; {}", self.explain(j, key));
                            self.errors.push(e);
                        }
                        Err(e) => {
                            ok = false;
                            self.errors.push(format!("D[{j}]: cannot verify {key}: {e}"));
                        }
                    }
                }
                if let Some(t) = self.tracks.get_mut(&key) {
                    t.verified = Some(ok);
                }
            }
            if owned && !quarantine {
                self.d_pool.give(&blocks[0], &mut self.errors, &format!("D blocks of {key}"));
            }
        }
    }

    /// Which keys' contents sit in the elements of `key` that arrived wrong on D worker `j` (the same
    /// token slot of a block another key held on D, or of the P block it was read from), and what
    /// happened to the keys that held its D blocks before.
    fn explain(&self, j: usize, key: Key) -> String {
        let t = &self.tracks[&key];
        let before: Vec<String> = t
            .d_prev_owners
            .iter()
            .map(|k| {
                let p = &self.tracks[k];
                let d: Vec<_> = p.d_out.iter().map(|o| o.first().map(|x| x.0)).collect();
                let s: Vec<_> = p.p_sent.iter().map(|s| s.first().map(|x| x.0)).collect();
                format!("{k} ({}: D {d:?}, P {s:?})", self.reqs[p.req].label)
            })
            .collect();
        let d = &self.c.d[j];
        let l = d.engine.layout();
        let (layers, heads) = (l.layer_range(), l.head_range());
        let blocks = &t.d_blocks.as_ref().expect("registered")[0];
        let elem = (u64::from(l.model.head_dim) * l.model.dtype.size()) as usize;
        let (mut got, mut want) = (vec![0u8; elem], vec![0u8; elem]);
        let mut found: HashMap<String, u64> = HashMap::new();
        let bt = u64::from(BLOCK_TOKENS);
        for layer in layers.clone() {
            for part in 0..l.parts() {
                for h in heads.clone() {
                    for tok in 0..t.tokens {
                        let (bi, slot) = ((tok / bt) as usize, tok % bt);
                        let b = blocks[bi];
                        let head = u64::from(h - heads.start);
                        let (region, off) = pattern::locate(l, layer - layers.start, part, b, slot, head);
                        d.buffers[region].read_at(off, &mut got).expect("read");
                        pattern::element_bytes(seed_of(key), layer, part, h, tok, &mut want);
                        if got == want {
                            continue;
                        }
                        let mut who = if got.iter().all(|&x| x == 0) { "zeros".to_owned() } else { "?".to_owned() };
                        for (k, o) in &self.tracks {
                            let label = self.reqs[o.req].label;
                            let mut check = |ids: &Option<Vec<Vec<u32>>>, b: u32, side: &str| {
                                let i = ids.as_ref().and_then(|ids| ids[0].iter().position(|&x| x == b))?;
                                pattern::element_bytes(seed_of(*k), layer, part, h, i as u64 * bt + slot, &mut want);
                                (got == want).then(|| format!("{side} {k} ({label})"))
                            };
                            let p_block = t.p_blocks.as_ref().map(|p| p[0][bi]);
                            if let Some(w) = check(&o.d_blocks, b, "D")
                                .or_else(|| p_block.and_then(|pb| check(&o.p_blocks, pb, "P")))
                            {
                                who = w;
                                break;
                            }
                        }
                        *found.entry(who).or_default() += 1;
                    }
                }
            }
        }
        format!("its D blocks were held before by {before:?}; the wrong elements hold the data of {found:?}")
    }

    /// Plays every request's script to its end and waits until every leg given to an engine is
    /// answered by every worker. Panics with a summary after `limit`.
    fn run(&mut self, reqs: Vec<Req>, limit: Duration) {
        let base = self.reqs.len();
        self.reqs.extend(reqs);
        let mut heap = BinaryHeap::new();
        let now = Instant::now();
        for i in base..self.reqs.len() {
            heap.push(Reverse((now, i)));
        }
        let mut parked: Vec<usize> = Vec::new();
        let deadline = Instant::now() + limit;
        loop {
            // A few due steps at a time (filling P's blocks costs time), then the engines' results,
            // so that results are seen (and blocks freed) soon after they come.
            let now = Instant::now();
            let mut budget = 16;
            while let Some(&Reverse((at, i))) = heap.peek() {
                if at > now || budget == 0 {
                    break;
                }
                budget -= 1;
                heap.pop();
                self.advance(i, &mut heap, &mut parked);
            }
            let n = self.poll();
            if !parked.is_empty() {
                for i in std::mem::take(&mut parked) {
                    self.advance(i, &mut heap, &mut parked);
                }
            }
            let scripts_done = heap.is_empty() && parked.is_empty();
            if scripts_done && self.open_legs == 0 {
                break;
            }
            if Instant::now() > deadline {
                panic!("{}", self.stuck_report(limit));
            }
            if n == 0 && budget > 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        // Anything reported late (a second outcome, a key never given) shows up here.
        let grace = Instant::now() + Duration::from_millis(50);
        while Instant::now() < grace {
            self.poll();
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn stuck_report(&self, limit: Duration) -> String {
        let mut s = format!("requests did not finish within {limit:?}; {} legs still open", self.open_legs);
        let mut stuck: Vec<_> = self
            .tracks
            .iter()
            .filter(|(_, t)| (t.p_blocks.is_some() && !t.p_done) || (t.d_blocks.is_some() && !t.d_done))
            .collect();
        stuck.sort_by_key(|(k, _)| **k);
        for (k, t) in stuck.iter().take(8) {
            let r = &self.reqs[t.req];
            s += &format!(
                "\n  {k} ({}, {} tokens): P {:?}, D {:?}, script left {:?}",
                r.label,
                r.tokens,
                t.p_sent.iter().map(|v| v.iter().map(|x| x.0).collect::<Vec<_>>()).collect::<Vec<_>>(),
                t.d_out.iter().map(|v| v.iter().map(|x| x.0).collect::<Vec<_>>()).collect::<Vec<_>>(),
                r.script
            );
        }
        s += &format!("\n  errors so far: {:?}", self.errors.iter().take(8).collect::<Vec<_>>());
        s
    }

    /// Checks every expectation, the pools and the engines' counters.
    fn check(&mut self) {
        for r in &self.reqs {
            assert!(r.script.is_empty(), "request {} ({}) did not finish its script", r.id, r.label);
            for &(a, e) in &r.expect {
                let key = Key::new(r.id, a);
                let t = self.tracks.get(&key);
                let at = |i: Option<Instant>| i.map(|i| i.saturating_duration_since(self.started));
                let ctx = format!(
                    "{key} ({}, {} tokens; P given at {:?}, D given at {:?})",
                    r.label,
                    r.tokens,
                    at(t.and_then(|t| t.p_given_at)),
                    at(t.and_then(|t| t.d_given_at))
                );
                match (e.p, t.and_then(|t| t.p_blocks.as_ref().map(|_| t))) {
                    (None, Some(_)) => self.errors.push(format!("{ctx}: P was given the key, the script says not")),
                    (Some(_), None) => self.errors.push(format!("{ctx}: P was never given the key")),
                    (Some(allowed), Some(t)) => {
                        for (w, s) in t.p_sent.iter().enumerate() {
                            if !t.p_given[w] {
                                self.errors.push(format!("{ctx}: P[{w}] was never given the key"));
                            } else if s.len() != 1 || !allowed.contains(&s[0].0) {
                                let got: Vec<_> = s.iter().map(|x| x.0).collect();
                                self.errors
                                    .push(format!("{ctx}: P[{w}] released {got:?}, expected one of {allowed:?}"));
                            }
                        }
                    }
                    (None, None) => {}
                }
                match (e.d, t.and_then(|t| t.d_blocks.as_ref().map(|_| t))) {
                    (None, Some(_)) => self.errors.push(format!("{ctx}: D was given the key, the script says not")),
                    (Some(_), None) => self.errors.push(format!("{ctx}: D was never given the key")),
                    (Some(allowed), Some(t)) => {
                        for (w, o) in t.d_out.iter().enumerate() {
                            if o.len() != 1 || !allowed.contains(&o[0].0) {
                                let got: Vec<_> = o.iter().map(|x| (x.0, x.3.clone())).collect();
                                self.errors
                                    .push(format!("{ctx}: D[{w}] reported {got:?}, expected one of {allowed:?}"));
                            }
                        }
                        if t.d_owned
                            && t.d_out.iter().all(|o| o.first().is_some_and(|x| x.0 == DKind::Received))
                            && t.verified != Some(true)
                        {
                            self.errors.push(format!("{ctx}: received but not verified"));
                        }
                    }
                    (None, None) => {}
                }
            }
        }
        self.assert_no_errors();
        self.p_pool.check_full();
        self.d_pool.check_full();
        // No transfer handle is left open (in-flight transfers of aborted requests end too).
        let deadline = Instant::now() + Duration::from_secs(10);
        for w in self.c.p.iter().chain(&self.c.d) {
            while w.transport.open_transfers() > 0 {
                assert!(Instant::now() < deadline, "{}: transfer handles left open", w.engine.addr());
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        self.check_stats();
    }

    fn assert_no_errors(&self) {
        assert!(
            self.errors.is_empty(),
            "{} violations, first ones:\n  {}",
            self.errors.len(),
            self.errors.iter().take(20).cloned().collect::<Vec<_>>().join("\n  ")
        );
    }

    /// The engines' counters agree with what the driver saw.
    fn check_stats(&self) {
        let n_d_keys = self.tracks.values().filter(|t| t.d_blocks.is_some()).count() as u64;
        for (w, p) in self.c.p.iter().enumerate() {
            let s: StatsSnapshot = p.engine.stats();
            let c = s.counters;
            let ctx = format!("P[{w}] stats {c:?} {:?}", s.failures);
            assert_eq!(c.released, self.p_calls[w], "{ctx}: released != request_finished calls");
            assert_eq!(c.aborted, self.p_aborts, "{ctx}: aborts handled");
            if self.c.setup.mode == Mode::Push {
                let lb = p.transport.stats();
                if let Some(st) = p.engine.staging_counts() {
                    // Staged: the transport sees one WRITE per piece; posting itself never fails
                    // (a piece's failure is the transfer's).
                    assert_eq!(c.posts, st.transfers + st.direct, "{ctx}: posts disagree with staging's {st:?}");
                    assert!(lb.posts >= st.pieces, "{ctx}: fewer WRITEs than pieces written: {lb:?} {st:?}");
                } else {
                    assert_eq!(c.posts, lb.posts, "{ctx}: posts disagree with the transport's {lb:?}");
                    assert_eq!(
                        s.failures.post, lb.post_errors,
                        "{ctx}: post errors disagree with the transport's {lb:?}"
                    );
                }
                assert_eq!(c.matches, c.posts + s.failures.post, "{ctx}: every matched transfer is posted or failed");
                assert!(c.descriptors_posted <= c.descriptors_unmerged, "{ctx}");
                // Every D worker this P worker feeds registers every key D was given with it.
                assert_eq!(c.registrations, n_d_keys * self.c.p_fan_out(w) as u64, "{ctx}: registrations received");
            }
        }
        for (w, d) in self.c.d.iter().enumerate() {
            let c = d.engine.stats().counters;
            let [received, failed, _ended] = self.d_counts[w];
            assert_eq!(c.received, received, "D[{w}] stats {c:?}: received");
            assert_eq!(c.failed, failed, "D[{w}] stats {c:?}: failed");
            assert_eq!(c.registrations, self.d_calls[w], "D[{w}] stats {c:?}: registrations sent");
            assert_eq!(c.aborted, self.d_aborts, "D[{w}] stats {c:?}: aborts handled");
        }
    }

    fn get(&self, id: u128, attempt: u32) -> &Track {
        self.tracks.get(&Key::new(id, attempt)).expect("key was played")
    }

    fn summary(&self) -> String {
        format!(
            "{} keys, {} bytes verified, at most {} legs open at once, in {:.2?}",
            self.tracks.len(),
            self.verified_bytes,
            self.max_open_legs,
            self.started.elapsed()
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Workload generation.

/// What a script draws from the one PRNG.
trait Draw {
    /// A sleep of up to `max` ms.
    fn ms(&mut self, max: u64) -> Step;
    /// A random transfer id whose low bits are `i` (unique within a run).
    fn id(&mut self, i: usize) -> u128;
    /// A prompt length of 1 to 200 tokens.
    fn tokens(&mut self) -> u64;
}

impl Draw for Rng {
    fn ms(&mut self, max: u64) -> Step {
        Step::Sleep(Duration::from_micros(self.below(max * 1000 + 1)))
    }
    fn id(&mut self, i: usize) -> u128 {
        (u128::from(self.next()) << 64) | (u128::from(self.next() >> 32) << 32) | i as u128
    }
    fn tokens(&mut self) -> u64 {
        1 + self.below(200)
    }
}

/// Both legs of attempt `a`, registration or blocks first, with random delays before and between.
fn legs(rng: &mut Rng, a: u32, registration_first: bool, max_ms: u64) -> Vec<Step> {
    let (first, second) =
        if registration_first { (Step::DAlloc(a), Step::PFinish(a)) } else { (Step::PFinish(a), Step::DAlloc(a)) };
    vec![rng.ms(max_ms), first, rng.ms(max_ms), second]
}

// ---------------------------------------------------------------------------------------------
// 1. Many concurrent requests, every byte verified.

fn stress(setup: Setup, requests: usize, seed: u64) -> Driver {
    let mut rng = Rng(seed);
    let mut d = Driver::new(setup);
    let reqs = (0..requests)
        .map(|i| {
            let registration_first = rng.coin();
            let steps = legs(&mut rng, 1, registration_first, 20);
            Req::new("normal", rng.id(i), rng.tokens(), steps, vec![(1, OK)])
        })
        .collect();
    d.run(reqs, Duration::from_secs(90));
    d.check();
    eprintln!("stress: {}", d.summary());
    d
}

#[test]
fn push_2000_concurrent_requests_p2_d1() {
    let mut s = Setup::new(Mode::Push, 2, 1);
    s.writers = 2;
    s.num_blocks = 30_000;
    let d = stress(s, 2000, 0x2000);
    // Both legs of every request are due within 40 ms of the start: most of the 2000 requests are
    // in flight together (the first ones finish while the driver still fills the last ones).
    assert!(d.max_open_legs >= 1000, "only {} legs were open at once", d.max_open_legs);
}

#[test]
fn push_concurrent_requests_p1_d2() {
    let mut s = Setup::new(Mode::Push, 1, 2);
    s.num_blocks = 30_000;
    stress(s, 800, 0x800);
}

#[test]
fn pull_concurrent_requests_p2_d2() {
    let mut s = Setup::new(Mode::Pull, 2, 2);
    s.writers = 2;
    s.num_blocks = 8192;
    // Pull: D reads after the router relayed P's block ids, so P always finishes first.
    let mut rng = Rng(0x9011);
    let mut d = Driver::new(s);
    let reqs = (0..300)
        .map(|i| {
            let steps = legs(&mut rng, 1, false, 10);
            Req::new("pull", rng.id(i), rng.tokens(), steps, vec![(1, OK)])
        })
        .collect();
    d.run(reqs, Duration::from_secs(30));
    d.check();
    eprintln!("pull: {}", d.summary());
}

// ---------------------------------------------------------------------------------------------
// 2. Aborts at every stage on either side.

const D_EXPLICIT: &[DKind] = &[DKind::Failed];
const D_ENDED_OR_FAILED: &[DKind] = &[DKind::Ended, DKind::Failed];
const D_ANY_BUT_TIMEOUT: &[DKind] = &[DKind::Received, DKind::Ended, DKind::Failed];

/// One request with an abort (or none) at a random stage. Needs a lease short enough for the test.
fn abort_plan(rng: &mut Rng, i: usize, mode: Mode) -> Req {
    let id = rng.id(i);
    let tokens = rng.tokens();
    let reg_first = mode == Mode::Push && rng.coin();
    // Requests start 0.5 ms apart (dozens in flight at once), so that the driver, which fills P's
    // blocks itself, gives the second leg of every request well within the lease even when slow.
    let mut steps = vec![Step::Sleep(Duration::from_micros(500 * i as u64))];
    // A random post of P worker 0 is delayed now and then, to keep transfers in flight longer.
    if rng.below(4) == 0 {
        steps.push(Step::Inject(0, Fault::Delay(Duration::from_millis(rng.below(20)))));
    }
    let plan = rng.below(11);
    let (label, expect) = match plan {
        0 => {
            steps.extend(legs(rng, 1, reg_first, 5));
            ("no abort", OK)
        }
        1 => {
            // P aborts before prefill ends, then reports the blocks anyway; D registers before or after.
            if mode == Mode::Push && rng.coin() {
                steps.extend([Step::DAlloc(1), rng.ms(2), Step::PAbort(1), rng.ms(3), Step::PFinish(1)]);
            } else {
                steps.extend([Step::PAbort(1), rng.ms(3), Step::PFinish(1), rng.ms(3), Step::DAlloc(1)]);
            }
            ("P abort before request_finished", Expect { p: Some(&[R::Aborted]), d: Some(D_EXPLICIT) })
        }
        2 if mode == Mode::Push => {
            // P aborts and never reports blocks: D is told at once.
            steps.extend([rng.ms(3), Step::PAbort(1), rng.ms(3), Step::DAlloc(1)]);
            ("P abort, never finished", Expect { p: None, d: Some(D_EXPLICIT) })
        }
        3 => {
            steps.extend([Step::PFinish(1), rng.ms(3), Step::PAbort(1), rng.ms(3), Step::DAlloc(1)]);
            (
                "P abort after request_finished, before registration",
                Expect { p: Some(&[R::Aborted]), d: Some(D_EXPLICIT) },
            )
        }
        4 => {
            // The transfer may be in flight when P aborts: the data still lands (D received, verified)
            // or D is told; P's blocks come back once, never under the transfer.
            steps.extend(legs(rng, 1, reg_first, 2));
            steps.extend([rng.ms(2), Step::PAbort(1)]);
            (
                "P abort while in flight",
                Expect { p: Some(&[R::Sent, R::Aborted]), d: Some(&[DKind::Received, DKind::Failed]) },
            )
        }
        5 => {
            // D aborts before allocating: it never registers; P's blocks expire with the lease.
            if rng.coin() {
                steps.extend([Step::DAbort(1), rng.ms(3), Step::PFinish(1)]);
            } else {
                steps.extend([Step::PFinish(1), rng.ms(3), Step::DAbort(1)]);
            }
            ("D abort before blocks_allocated", Expect { p: Some(&[R::LeaseExpired]), d: None })
        }
        6 if mode == Mode::Pull => {
            // Pull: D aborts right after asking for the read (maybe before P granted it).
            steps.extend([Step::PFinish(1), rng.ms(3), Step::DAlloc(1), rng.ms(1), Step::DAbort(1)]);
            ("D abort right after start_pull", Expect { p: Some(&[R::Sent, R::Aborted]), d: Some(D_ANY_BUT_TIMEOUT) })
        }
        6 => {
            // D aborts after registering, before any data: D ends, P (finishing later) releases as aborted.
            let a = [Step::DAlloc(1), rng.ms(3), Step::DAbort(1), Step::Wait(Cond::DAll(1))];
            steps.extend(a);
            steps.extend([rng.ms(3), Step::PFinish(1)]);
            ("D abort after registration, before data", Expect { p: Some(&[R::Aborted]), d: Some(D_ENDED_OR_FAILED) })
        }
        7 => {
            // D aborts after every part arrived: nothing changes.
            steps.extend(legs(rng, 1, reg_first, 3));
            steps.extend([Step::Wait(Cond::DAll(1)), rng.ms(2), Step::DAbort(1)]);
            ("D abort after data", OK)
        }
        8 => {
            // D aborts at a random moment around the transfer.
            steps.extend(legs(rng, 1, reg_first, 2));
            steps.extend([rng.ms(2), Step::DAbort(1)]);
            ("D abort racing the transfer", Expect { p: Some(&[R::Sent, R::Aborted]), d: Some(D_ANY_BUT_TIMEOUT) })
        }
        9 => {
            // D aborts once the first worker has its part.
            steps.extend(legs(rng, 1, reg_first, 2));
            steps.extend([Step::Wait(Cond::DAny(1)), Step::DAbort(1)]);
            ("D abort after the first part", Expect { p: Some(&[R::Sent, R::Aborted]), d: Some(D_ANY_BUT_TIMEOUT) })
        }
        _ => {
            // P aborts after D has its data: nothing changes for D.
            steps.extend(legs(rng, 1, reg_first, 3));
            steps.extend([Step::Wait(Cond::DAll(1)), Step::PAbort(1)]);
            ("P abort after data", Expect { p: Some(&[R::Sent, R::Aborted]), d: Some(&[DKind::Received]) })
        }
    };
    Req::new(label, id, tokens, steps, vec![(1, expect)])
}

fn aborts(setup: Setup, requests: usize, seed: u64) -> Driver {
    let mode = setup.mode;
    let mut rng = Rng(seed);
    let mut d = Driver::new(setup);
    let reqs = (0..requests).map(|i| abort_plan(&mut rng, i, mode)).collect();
    d.run(reqs, Duration::from_secs(40));
    d.check();
    eprintln!("aborts: {}", d.summary());
    d
}

fn abort_setup(mode: Mode, p_tp: u16, d_tp: u16, writers: usize) -> Setup {
    let mut s = Setup::new(mode, p_tp, d_tp);
    s.writers = writers;
    s.num_blocks = 8192;
    s.lease = Duration::from_secs(4);
    s.registration_timeout = Duration::from_secs(10);
    s.completion_timeout = Duration::from_secs(20);
    s.pull_read_timeout = Duration::from_secs(20);
    s
}

#[test]
fn push_aborts_at_every_stage_p1_d2() {
    aborts(abort_setup(Mode::Push, 1, 2, 2), 400, 0xab01);
}

#[test]
fn push_aborts_at_every_stage_p2_d1() {
    aborts(abort_setup(Mode::Push, 2, 1, 1), 400, 0xab02);
}

#[test]
fn push_aborts_at_every_stage_p2_d2() {
    aborts(abort_setup(Mode::Push, 2, 2, 2), 300, 0xab03);
}

#[test]
fn pull_aborts_at_every_stage() {
    aborts(abort_setup(Mode::Pull, 2, 1, 2), 300, 0xab04);
}

// ---------------------------------------------------------------------------------------------
// Targeted: aborts while a (delayed) transfer is in flight.

/// Steps that delay every write P is about to post for one request.
fn delay_every_write(c: &Cluster, delay: Duration) -> Vec<Step> {
    (0..c.p.len()).flat_map(|w| (0..c.p_fan_out(w)).map(move |_| Step::Inject(w, Fault::Delay(delay)))).collect()
}

fn wait_every_write(c: &Cluster) -> Vec<Step> {
    (0..c.p.len()).map(|w| Step::Wait(Cond::PInFlight(w))).collect()
}

fn aborts_in_flight(p_tp: u16, d_tp: u16, writers: usize) {
    aborts_in_flight_in(Setup::new(Mode::Push, p_tp, d_tp), writers);
}

fn aborts_in_flight_in(mut s: Setup, writers: usize) {
    let delay = Duration::from_millis(250);
    let (p_tp, d_tp) = (s.p_tp, s.d_tp);
    s.writers = writers;
    let mut d = Driver::new(s);
    // The follow-up request below reuses D's blocks right after D ended: safe here because the late
    // write was posted before it, on the same (P worker, D worker) pair, which runs in order.
    d.quarantine = false;
    let mut rng = Rng(u64::from(p_tp) << 8 | u64::from(d_tp));

    // P aborts while its writes are in flight: the data still lands and verifies; P's blocks come
    // back (once) only after the writes are done.
    let id = rng.id(0);
    let mut steps = vec![Step::DAlloc(1)];
    steps.extend(delay_every_write(&d.c, delay));
    steps.push(Step::PFinish(1));
    steps.extend(wait_every_write(&d.c));
    steps.push(Step::PAbort(1));
    let req = Req::new(
        "P abort in flight",
        id,
        150,
        steps,
        vec![(1, Expect { p: Some(&[R::Aborted]), d: Some(&[DKind::Received]) })],
    );
    d.run(vec![req], Duration::from_secs(20));
    let t = d.get(id, 1);
    let given = t.p_given_at.expect("given");
    for (w, s) in t.p_sent.iter().enumerate() {
        assert!(
            s[0].1 - given >= delay,
            "P[{w}] released {:?} after request_finished, under its delayed write",
            s[0].1 - given
        );
    }

    // D aborts while P's writes are in flight: D ends at once, P releases after its writes.
    let id = rng.id(1);
    let mut steps = vec![Step::DAlloc(1)];
    steps.extend(delay_every_write(&d.c, delay));
    steps.push(Step::PFinish(1));
    steps.extend(wait_every_write(&d.c));
    steps.extend([Step::DAbort(1), Step::Wait(Cond::DAll(1))]);
    let req = Req::new(
        "D abort in flight",
        id,
        150,
        steps,
        vec![(1, Expect { p: Some(&[R::Aborted]), d: Some(&[DKind::Ended]) })],
    );
    // As soon as D ended, a second request takes D's freed blocks (the pool is LIFO) while the first
    // one's write is still in flight; it must verify.
    let next = rng.id(2);
    let mut steps = vec![Step::Wait(Cond::OtherDAll(id, 1))];
    steps.extend(legs(&mut rng, 1, true, 1));
    let follow = Req::new("reuses D blocks", next, 150, steps, vec![(1, OK)]);
    d.run(vec![req, follow], Duration::from_secs(20));
    let t = d.get(id, 1);
    let given = t.p_given_at.expect("given");
    for (w, s) in t.p_sent.iter().enumerate() {
        assert!(
            s[0].1 - given >= delay,
            "P[{w}] released {:?} after request_finished, under its delayed write",
            s[0].1 - given
        );
    }
    let sorted = |b: &Option<Vec<Vec<u32>>>| b.as_ref().map(|b| b.iter().flatten().copied().collect::<HashSet<u32>>());
    assert_eq!(sorted(&d.get(next, 1).d_blocks), sorted(&t.d_blocks), "the freed blocks were not handed out again");
    d.check();
}

#[test]
fn aborts_while_in_flight_p1_d2() {
    aborts_in_flight(1, 2, 2);
}

#[test]
fn aborts_while_in_flight_p2_d1() {
    aborts_in_flight(2, 1, 1);
}

// ---------------------------------------------------------------------------------------------
// 3. Reissued attempts while a stale write of the old attempt is in flight.

#[derive(Clone, Copy, Debug)]
enum Reissue {
    /// D aborts attempt 1, then registers attempt 2 (new blocks), P finishes attempt 2.
    AbortThenRegister,
    /// D registers attempt 2 (new blocks) without aborting attempt 1 (it is superseded).
    Supersede,
    /// D registers attempt 2 into attempt 1's blocks: the stale write must land before the new one.
    SupersedeSameBlocks,
    /// P finishes attempt 2 first (superseding attempt 1 on P), then D registers it.
    ProducerFirst,
}

fn reissue(p_tp: u16, d_tp: u16, writers: usize) {
    let delay = Duration::from_millis(250);
    let mut s = Setup::new(Mode::Push, p_tp, d_tp);
    s.writers = writers;
    let mut d = Driver::new(s);
    let mut rng = Rng(0x7e15 ^ u64::from(p_tp) << 8 ^ u64::from(d_tp));
    let variants =
        [Reissue::AbortThenRegister, Reissue::Supersede, Reissue::SupersedeSameBlocks, Reissue::ProducerFirst];
    for (i, v) in variants.into_iter().enumerate() {
        let id = rng.id(i);
        let mut steps = vec![Step::DAlloc(1)];
        steps.extend(delay_every_write(&d.c, delay));
        steps.push(Step::PFinish(1));
        steps.extend(wait_every_write(&d.c));
        match v {
            Reissue::AbortThenRegister => {
                steps.extend([Step::DAbort(1), Step::DAlloc(2), rng.ms(2), Step::PFinish(2)]);
            }
            Reissue::Supersede => steps.extend([Step::DAlloc(2), rng.ms(2), Step::PFinish(2)]),
            Reissue::SupersedeSameBlocks => steps.extend([Step::DAllocReuse(2, 1), rng.ms(2), Step::PFinish(2)]),
            Reissue::ProducerFirst => steps.extend([Step::PFinish(2), rng.ms(2), Step::DAlloc(2)]),
        }
        let old = Expect { p: Some(&[R::Aborted, R::Superseded]), d: Some(&[DKind::Ended, DKind::Failed]) };
        let req = Req::new("reissue", id, 1 + rng.below(200), steps, vec![(1, old), (2, OK)]);
        d.run(vec![req], Duration::from_secs(20));

        let (t1, t2) = (d.get(id, 1), d.get(id, 2));
        let ctx = format!("{v:?} (P TP {p_tp}, D TP {d_tp})");
        let finished1 = t1.p_given_at.expect("attempt 1 finished");
        let registered2 = t2.d_given_at.expect("attempt 2 registered");
        // Attempt 2 registered while attempt 1's writes were still held back (unless this machine
        // stalled the driver for longer than the delay).
        let in_time = registered2 - finished1 < delay;
        for w in 0..d.c.d.len() {
            // Attempt 1 ended before attempt 2's outcome, on every worker; never received.
            let (o1, o2) = (&t1.d_out[w][0], &t2.d_out[w][0]);
            assert!(o1.2 < o2.2, "{ctx}: D[{w}] reported attempt 2 before attempt 1");
            assert!(o1.0 != DKind::Received || !in_time, "{ctx}: D[{w}] received the stale attempt");
        }
        for (w, s) in t1.p_sent.iter().enumerate() {
            let held = s[0].1 - finished1;
            assert!(held >= delay, "{ctx}: P[{w}] released attempt 1 {held:?} after request_finished, under its write");
        }
    }
    d.check();
    eprintln!("reissue: {}", d.summary());
}

#[test]
fn reissue_with_stale_write_in_flight_p1_d1() {
    reissue(1, 1, 2);
}

#[test]
fn reissue_with_stale_write_in_flight_p2_d1() {
    reissue(2, 1, 1);
}

#[test]
fn reissue_with_stale_write_in_flight_p1_d2() {
    reissue(1, 2, 2);
}

/// Many reissues at once, with random stale writes in flight, mixed with plain requests.
#[test]
fn reissues_concurrent_p2_d2() {
    let mut s = Setup::new(Mode::Push, 2, 2);
    s.writers = 2;
    let mut d = Driver::new(s);
    let mut rng = Rng(0x5eed);
    let mut reqs = Vec::new();
    for i in 0..300 {
        let id = rng.id(i);
        let tokens = rng.tokens();
        let mut steps = Vec::new();
        if rng.below(3) == 0 {
            steps.push(Step::Inject(rng.below(2) as usize, Fault::Delay(Duration::from_millis(rng.below(30)))));
        }
        let reg_first = rng.coin();
        steps.extend(legs(&mut rng, 1, reg_first, 3));
        match rng.below(3) {
            0 => steps.extend([rng.ms(3), Step::DAbort(1), Step::DAlloc(2), rng.ms(3), Step::PFinish(2)]),
            1 => steps.extend([rng.ms(3), Step::DAlloc(2), rng.ms(3), Step::PFinish(2)]),
            _ => steps.extend([rng.ms(3), Step::PFinish(2), rng.ms(3), Step::DAlloc(2)]),
        }
        let old = Expect {
            p: Some(&[R::Sent, R::Aborted, R::Superseded]),
            d: Some(&[DKind::Received, DKind::Ended, DKind::Failed]),
        };
        reqs.push(Req::new("concurrent reissue", id, tokens, steps, vec![(1, old), (2, OK)]));
    }
    d.run(reqs, Duration::from_secs(30));
    for r in &d.reqs {
        let (t1, t2) = (d.get(r.id, 1), d.get(r.id, 2));
        for w in 0..d.c.d.len() {
            assert!(t1.d_out[w][0].2 < t2.d_out[w][0].2, "{}: D[{w}] reported attempt 2 before attempt 1", r.id);
        }
    }
    d.check();
    eprintln!("concurrent reissues: {}", d.summary());
}

// ---------------------------------------------------------------------------------------------
// 4. Post failures, partial transfers and lost notifications.

fn faults_one_by_one(p_tp: u16, d_tp: u16) {
    faults_one_by_one_in(Setup::new(Mode::Push, p_tp, d_tp));
}

fn faults_one_by_one_in(mut s: Setup) {
    let (p_tp, d_tp) = (s.p_tp, s.d_tp);
    s.writers = 2;
    s.completion_timeout = Duration::from_secs(2);
    let mut d = Driver::new(s);
    let mut rng = Rng(0xfa17 ^ u64::from(p_tp) << 4 ^ u64::from(d_tp));
    let mut n = 0;
    for w in 0..d.c.p.len() {
        for fault in [Fault::PostError, Fault::Partial] {
            for reg_first in [true, false] {
                let id = rng.id(n);
                n += 1;
                let mut steps = vec![Step::Inject(w, fault)];
                steps.extend(legs(&mut rng, 1, reg_first, 2));
                // P workers other than the faulty one finish (Sent) or are told by D (Aborted).
                let e =
                    Expect { p: Some(&[R::Failed, R::Sent, R::Aborted]), d: Some(&[DKind::Failed, DKind::Received]) };
                d.run(vec![Req::new("fault", id, rng.tokens(), steps, vec![(1, e)])], Duration::from_secs(20));
                let t = d.get(id, 1);
                let ctx = format!("{fault:?} on P[{w}] (P TP {p_tp}, D TP {d_tp}, registration first: {reg_first})");
                // Failed; or aborted where D's failure came back before P's other writes were done.
                let reason = t.p_sent[w][0].0;
                assert!(matches!(reason, R::Failed | R::Aborted), "{ctx}: P[{w}] released {reason:?}");
                let failed: Vec<_> = t.d_out.iter().map(|o| &o[0]).filter(|o| o.0 == DKind::Failed).collect();
                assert!(!failed.is_empty(), "{ctx}: no D worker failed: {:?}", t.d_out);
                let registered = t.d_given_at.expect("registered");
                for o in failed {
                    // Explicit (a failure notification, not the timeout) and well before the timeout.
                    assert!(
                        o.1 - registered < d.c.setup.completion_timeout,
                        "{ctx}: failed only after {:?}",
                        o.1 - registered
                    );
                }
                // The engines keep working: a plain request right after.
                let id = rng.id(n);
                n += 1;
                let steps = legs(&mut rng, 1, reg_first, 2);
                d.run(vec![Req::new("after fault", id, rng.tokens(), steps, vec![(1, OK)])], Duration::from_secs(20));
            }
        }
    }
    d.check();
}

#[test]
fn post_failures_and_partial_transfers_fail_at_once_p1_d1() {
    faults_one_by_one(1, 1);
}

#[test]
fn post_failures_and_partial_transfers_fail_at_once_p2_d1() {
    faults_one_by_one(2, 1);
}

#[test]
fn post_failures_and_partial_transfers_fail_at_once_p1_d2() {
    faults_one_by_one(1, 2);
}

#[test]
fn lost_notifications_fail_by_the_timeout() {
    for (p_tp, d_tp) in [(1, 1), (2, 1), (1, 2)] {
        let mut s = Setup::new(Mode::Push, p_tp, d_tp);
        s.completion_timeout = Duration::from_millis(300);
        s.margin = Duration::from_secs(2);
        let timeout = s.completion_timeout;
        let mut d = Driver::new(s);
        let mut rng = Rng(0x1057 ^ u64::from(p_tp) << 4 ^ u64::from(d_tp));
        for w in 0..d.c.p.len() {
            let id = rng.id(w);
            // Blocks first, so that D's short timeout covers only the engines' work.
            let mut steps = vec![Step::Inject(w, Fault::LoseNotification)];
            steps.extend(legs(&mut rng, 1, false, 2));
            // The data landed and P released normally; D cannot know and times out.
            let e = Expect { p: Some(&[R::Sent]), d: Some(&[DKind::TimedOut, DKind::Received]) };
            d.run(vec![Req::new("lost notification", id, rng.tokens(), steps, vec![(1, e)])], Duration::from_secs(20));
            let t = d.get(id, 1);
            let registered = t.d_given_at.expect("registered");
            let timed_out: Vec<_> = t.d_out.iter().map(|o| &o[0]).filter(|o| o.0 == DKind::TimedOut).collect();
            assert!(!timed_out.is_empty(), "P TP {p_tp}, D TP {d_tp}: no D worker timed out: {:?}", t.d_out);
            for o in timed_out {
                // Not before the timeout (the driver registered before the engine started its clock);
                // not after it either beyond the margin (checked for every outcome by the driver).
                assert!(o.1 - registered >= timeout, "timed out after only {:?}", o.1 - registered);
            }
        }
        d.check();
    }
}

/// D fails a request (one producer worker's post failed, or its notification was lost and D timed
/// out) before another producer worker even finished prefill: that worker is told, releases its
/// blocks at once as aborted, and never writes into D's blocks, which D freed with its outcome.
#[test]
fn consumer_failure_stops_the_other_producers() {
    for fault in [Fault::PostError, Fault::Partial, Fault::LoseNotification] {
        let mut s = Setup::new(Mode::Push, 2, 1);
        s.completion_timeout = Duration::from_millis(300);
        s.margin = Duration::from_secs(2);
        let mut d = Driver::new(s);
        let mut rng = Rng(0xfa11);
        let id = rng.id(0);
        let steps = vec![
            Step::DAlloc(1),
            Step::Inject(1, fault),
            Step::PFinishOn(1, 1),
            Step::Wait(Cond::DAll(1)),
            Step::PFinishOn(1, 0),
        ];
        let e = Expect {
            p: Some(&[R::Failed, R::Sent, R::Aborted]),
            d: Some(if fault == Fault::LoseNotification { &[DKind::TimedOut] } else { &[DKind::Failed] }),
        };
        d.run(vec![Req::new("other producer late", id, 100, steps, vec![(1, e)])], Duration::from_secs(20));
        let t = d.get(id, 1);
        assert_eq!(t.p_sent[0][0].0, R::Aborted, "{fault:?}: P[0] released {:?}", t.p_sent[0]);
        assert_eq!(d.c.p[0].transport.stats().posts, 0, "{fault:?}: P[0] wrote into blocks D had freed");
        // The blocks D freed serve the next request intact.
        let steps = legs(&mut rng, 1, true, 1);
        d.run(vec![Req::new("next", rng.id(1), 100, steps, vec![(1, OK)])], Duration::from_secs(20));
        d.check();
    }
}

/// Random post errors, lost notifications and partial transfers under load: every request ends as
/// the fault it met dictates, and the counts match the transport's exactly (one post per request).
#[test]
fn random_faults_under_load_p1_d1() {
    let mut s = Setup::new(Mode::Push, 1, 1);
    s.writers = 2;
    s.completion_timeout = Duration::from_secs(1);
    let mut d = Driver::new(s);
    d.c.p[0].transport.set_fault_rates(FaultRates {
        post_error: 0.08,
        lose_notification: 0.08,
        partial: 0.08,
        seed: 42,
    });
    let mut rng = Rng(0x4a7e);
    let reqs = (0..300)
        .map(|i| {
            // Blocks first: D's timeout then covers only the engines' work, never the driver's
            // filling of P's blocks, which a loaded machine may slow down past the short timeout.
            let mut steps = vec![Step::Sleep(Duration::from_millis(2 * i as u64))];
            steps.extend(legs(&mut rng, 1, false, 10));
            let e =
                Expect { p: Some(&[R::Sent, R::Failed]), d: Some(&[DKind::Received, DKind::Failed, DKind::TimedOut]) };
            Req::new("random faults", rng.id(i), rng.tokens(), steps, vec![(1, e)])
        })
        .collect();
    d.run(reqs, Duration::from_secs(30));
    d.check();
    let lb = d.c.p[0].transport.stats();
    let count = |k: DKind| d.tracks.values().filter(|t| t.d_out[0][0].0 == k).count() as u64;
    let (received, failed, timed_out) = (count(DKind::Received), count(DKind::Failed), count(DKind::TimedOut));
    let ctx = format!("received {received}, failed {failed}, timed out {timed_out}; transport {lb:?}");
    assert!(lb.post_errors > 0 && lb.notifications_lost > 0 && lb.failed_transfers > 0, "{ctx}: some fault never hit");
    assert_eq!(timed_out, lb.notifications_lost, "{ctx}: only lost notifications time out");
    assert_eq!(failed, lb.post_errors + lb.failed_transfers, "{ctx}: failed posts and partial transfers fail at once");
    assert_eq!(received, lb.posts - lb.notifications_lost - lb.failed_transfers, "{ctx}");
    let p_failed = d.tracks.values().filter(|t| t.p_sent[0][0].0 == R::Failed).count() as u64;
    assert_eq!(p_failed, lb.post_errors + lb.failed_transfers, "{ctx}: P releases failed transfers as failed");
    eprintln!("random faults: {ctx}; {}", d.summary());
}

/// `n` requests, blocks first, 2 ms apart, each allowed to end in any way a fault can make it end
/// (D's timeout then covers only the engines' work, never the driver's filling of P's blocks, which a
/// loaded machine may slow down past a short timeout).
fn faulty_requests(rng: &mut Rng, n: usize, what: &'static str) -> Vec<Req> {
    (0..n)
        .map(|i| {
            let mut steps = vec![Step::Sleep(Duration::from_millis(2 * i as u64))];
            steps.extend(legs(rng, 1, false, 10));
            let e = Expect {
                p: Some(&[R::Sent, R::Failed, R::Aborted]),
                d: Some(&[DKind::Received, DKind::Failed, DKind::TimedOut]),
            };
            Req::new(what, rng.id(i), rng.tokens(), steps, vec![(1, e)])
        })
        .collect()
}

/// The same with two workers on each side and faults on both producer workers.
#[test]
fn random_faults_under_load_p2_d2() {
    let mut s = Setup::new(Mode::Push, 2, 2);
    s.completion_timeout = Duration::from_secs(1);
    let mut d = Driver::new(s);
    for (i, w) in d.c.p.iter().enumerate() {
        let rates = FaultRates { post_error: 0.05, lose_notification: 0.05, partial: 0.05, seed: 7 + i as u64 };
        w.transport.set_fault_rates(rates);
    }
    let mut rng = Rng(0x4a7f);
    d.run(faulty_requests(&mut rng, 200, "random faults"), Duration::from_secs(30));
    d.check();
    let lost: u64 = d.c.p.iter().map(|w| w.transport.stats().notifications_lost).sum();
    let timed_out = d.tracks.values().flat_map(|t| &t.d_out).filter(|o| o[0].0 == DKind::TimedOut).count() as u64;
    assert!(timed_out <= lost, "{timed_out} D outcomes timed out, only {lost} notifications were lost");
}

// ---------------------------------------------------------------------------------------------
// 6. Lease expiry and registration-wait expiry.

fn leases(p_tp: u16, d_tp: u16) {
    let mut s = Setup::new(Mode::Push, p_tp, d_tp);
    s.lease = Duration::from_millis(300);
    s.registration_timeout = Duration::from_millis(300);
    s.completion_timeout = Duration::from_secs(5);
    let (lease, timeout) = (s.lease, s.completion_timeout);
    let mut d = Driver::new(s);
    let mut rng = Rng(0x1ea5e);
    let expired = rng.id(0);
    let waited = rng.id(1);
    let late_blocks = rng.id(2);
    let reqs = vec![
        // Prefill finished, D never registers in time: P releases after the lease; the registration
        // that comes after that fails at once.
        Req::new(
            "late registration",
            expired,
            rng.tokens(),
            vec![Step::PFinish(1), Step::Wait(Cond::PAll(1)), Step::DAlloc(1)],
            vec![(1, Expect { p: Some(&[R::LeaseExpired]), d: Some(&[DKind::Failed]) })],
        ),
        // D registered, prefill never finishes: D is told when the registration wait runs out.
        Req::new(
            "prefill never finishes",
            waited,
            rng.tokens(),
            vec![Step::DAlloc(1)],
            vec![(1, Expect { p: None, d: Some(&[DKind::Failed]) })],
        ),
        // Prefill finishes after the registration wait ran out: its blocks come back at once (as
        // expired, or as aborted where D's failure reached a P worker before its own wait ran out).
        Req::new(
            "prefill too late",
            late_blocks,
            rng.tokens(),
            vec![Step::DAlloc(1), Step::Wait(Cond::DAll(1)), Step::PFinish(1)],
            vec![(1, Expect { p: Some(&[R::LeaseExpired, R::Aborted]), d: Some(&[DKind::Failed]) })],
        ),
    ];
    d.run(reqs, Duration::from_secs(20));
    let ctx = format!("P TP {p_tp}, D TP {d_tp}");
    let t = d.get(expired, 1);
    let registered = t.d_given_at.expect("registered");
    for (w, o) in t.d_out.iter().enumerate() {
        let after = o[0].1 - registered;
        assert!(after < timeout / 2, "{ctx}: D[{w}] failed the late registration only after {after:?}");
        assert!(o[0].3.contains("lease expired"), "{ctx}: D[{w}] failed for {:?}", o[0].3);
    }
    for key in [waited, late_blocks] {
        let t = d.get(key, 1);
        let registered = t.d_given_at.expect("registered");
        for (w, o) in t.d_out.iter().enumerate() {
            let after = o[0].1 - registered;
            assert!(after >= lease && after < timeout / 2, "{ctx}: D[{w}] failed after {after:?}");
        }
    }
    let t = d.get(late_blocks, 1);
    for (w, s) in t.p_sent.iter().enumerate() {
        let held = s[0].1 - t.p_given_at.expect("given");
        assert!(held < timeout / 2, "{ctx}: P[{w}] held blocks of an expired key for {held:?}");
    }
    d.check();
}

#[test]
fn lease_expiry_p1_d2() {
    leases(1, 2);
}

#[test]
fn lease_expiry_p2_d1() {
    leases(2, 1);
}

// ---------------------------------------------------------------------------------------------
// Known issue: D reports a request over (Ended on abort or when superseded, Failed on a timeout or on
// one producer's failure) while another producer's write into its blocks may still be in flight or not
// even posted yet, so the engine reuses blocks that are still written. The loopback transport runs the
// jobs of one (initiator, target) pair in order, which hides this while the next owner of the blocks
// is fed by the same producer worker and its write is posted later; it shows when the next owner is
// fed by another producer engine (below), or by the same worker's other writer thread that posts
// first (the randomized abort tests saw that without the driver's quarantine).

#[test]
fn consumer_abort_while_another_producer_writes_keeps_reused_blocks_intact() {
    let setup = Setup::new(Mode::Push, 1, 1);
    let fabric = Fabric::new();
    let hub = LocalHub::new();
    let p1 = build_side(&setup, "prefill-a", 1, &fabric, &hub).remove(0);
    let p2 = build_side(&setup, "prefill-b", 1, &fabric, &hub).remove(0);
    let d = build_side(&setup, D_ENGINE, 1, &fabric, &hub).remove(0);
    for p in [&p1, &p2] {
        engines::connect(&p.engine, &d.engine);
    }
    let tokens = 64;
    let blocks = vec![vec![10, 11, 12, 13]];
    let (a, b) = (Key::new(0xa, 1), Key::new(0xb, 1));
    let (la, lb) = (p1.engine.layout(), p2.engine.layout());
    pattern::fill(la, &p1.buffers, &[vec![1, 2, 3, 4]], tokens, seed_of(a)).expect("prefill a");
    pattern::fill(lb, &p2.buffers, &[vec![1, 2, 3, 4]], tokens, seed_of(b)).expect("prefill b");

    // Request A: P1's write into D's blocks is held back on the wire; D aborts it meanwhile.
    d.engine.blocks_allocated(a, "prefill-a", blocks.clone(), tokens).expect("register a");
    p1.transport.inject_once(Fault::Delay(Duration::from_millis(300)));
    p1.engine.request_finished(a, vec![vec![1, 2, 3, 4]], tokens).expect("finished a");
    let deadline = Instant::now() + Duration::from_secs(20);
    while p1.transport.open_transfers() == 0 {
        assert!(Instant::now() < deadline, "P1 never posted");
        std::thread::sleep(Duration::from_millis(1));
    }
    d.engine.abort(a).expect("abort a");
    wait_for(&d.engine, "end of a", Duration::from_secs(20), |f| matches!(f, Finished::Ended { key } if *key == a));

    // A is over on D: the engine hands the same blocks to request B, fed by the other producer.
    d.engine.blocks_allocated(b, "prefill-b", blocks.clone(), tokens).expect("register b");
    p2.engine.request_finished(b, vec![vec![1, 2, 3, 4]], tokens).expect("finished b");
    wait_for(
        &d.engine,
        "receipt of b",
        Duration::from_secs(20),
        |f| matches!(f, Finished::Received { key } if *key == b),
    );
    // Once A's late write is done (nothing writes any more), B must still be intact.
    wait_for(
        &p1.engine,
        "release of a",
        Duration::from_secs(20),
        |f| matches!(f, Finished::Sent { key, .. } if *key == a),
    );
    let v = pattern::verify(d.engine.layout(), &d.buffers, &blocks, tokens, seed_of(b)).expect("verify");
    assert!(v.ok(), "request b's KV was overwritten by aborted request a's late write: {v:?}");
}

// ---------------------------------------------------------------------------------------------
// Staged WRITEs: the same engines with every push going through tiny staging slots (many pieces per
// request, slots reused constantly), under load, aborts and faults.

fn staged(mut s: Setup) -> Setup {
    s.staging = Staging::On(StagingConfig {
        slots: 2,
        slot_bytes: 8192,
        max_entries: 16,
        max_entry_bytes: 1024,
        min_descs: 1,
        max_mean_desc: u64::MAX,
        stall_timeout: Duration::from_secs(10),
    });
    s
}

/// Every P worker staged transfers in pieces, every D worker received staged transfers, and no
/// staging frame was malformed.
fn assert_staged(d: &Driver, ctx: &str) {
    for (i, w) in d.c.p.iter().enumerate() {
        let c = w.engine.staging_counts().expect("staging is on");
        assert!(c.transfers > 0 && c.pieces > c.transfers, "{ctx}: P[{i}] staged {c:?}");
        // The engine hands its plans over in grid form; none was expanded to be staged.
        assert_eq!(c.grids, c.transfers, "{ctx}: P[{i}] staged descriptors: {c:?}");
        assert!(c.ahead > 0, "{ctx}: P[{i}] never gathered a piece ahead of its grant: {c:?}");
        assert!(c.prefilled > 0, "{ctx}: P[{i}] never built a piece's tables ahead: {c:?}");
        assert_eq!(c.malformed, 0, "{ctx}: P[{i}] {c:?}");
    }
    for (i, w) in d.c.d.iter().enumerate() {
        let c = w.engine.staging_counts().expect("staging is on");
        assert!(c.received > 0, "{ctx}: D[{i}] received nothing staged: {c:?}");
        assert_eq!(c.malformed, 0, "{ctx}: D[{i}] {c:?}");
    }
}

#[test]
fn staged_push_concurrent_requests_p2_d1() {
    let mut s = staged(Setup::new(Mode::Push, 2, 1));
    s.writers = 2;
    s.num_blocks = 30_000;
    let d = stress(s, 600, 0x5a9e);
    assert_staged(&d, "P TP 2, D TP 1");
    let c = d.c.p[0].engine.staging_counts().expect("on");
    assert_eq!(c.direct, 0, "every WRITE qualifies: {c:?}");
}

#[test]
fn staged_push_concurrent_requests_p1_d2() {
    let mut s = staged(Setup::new(Mode::Push, 1, 2));
    s.num_blocks = 30_000;
    let d = stress(s, 300, 0x5a9f);
    assert_staged(&d, "P TP 1, D TP 2");
}

#[test]
fn staged_push_aborts_at_every_stage_p2_d2() {
    let d = aborts(staged(abort_setup(Mode::Push, 2, 2, 2)), 300, 0x5ab3);
    // Aborts that reached P while its staged WRITE was in flight cut the transfer short.
    let cancelled: u64 = d.c.p.iter().map(|w| w.engine.staging_counts().expect("on").cancelled).sum();
    assert!(cancelled > 0, "no staged transfer was cancelled by an abort");
}

#[test]
fn staged_post_failures_and_partial_pieces_fail_at_once_p2_d1() {
    faults_one_by_one_in(staged(Setup::new(Mode::Push, 2, 1)));
}

#[test]
fn staged_aborts_while_in_flight_p1_d2() {
    aborts_in_flight_in(staged(Setup::new(Mode::Push, 1, 2)), 1);
}

/// Random faults on the pieces' WRITEs: every request ends (received, failed, or timed out where a
/// piece's notification was lost), both pools end full, and staging keeps working afterwards.
#[test]
fn staged_random_faults_under_load_p1_d1() {
    let mut s = staged(Setup::new(Mode::Push, 1, 1));
    s.writers = 2;
    s.completion_timeout = Duration::from_secs(1);
    if let Staging::On(c) = &mut s.staging {
        // A lost piece frees its receive slot soon (the request itself times out after 1 s).
        c.stall_timeout = Duration::from_millis(500);
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let mut d = Driver::new(s);
    d.c.p[0].transport.set_fault_rates(FaultRates {
        post_error: 0.02,
        lose_notification: 0.02,
        partial: 0.02,
        seed: 43,
    });
    let mut rng = Rng(0x5a7e);
    // A lost piece holds its receive slot until the stall timeout, so requests queued behind it may
    // time out on D too, and D then aborts them on P: the same outcomes as with two producers.
    d.run(faulty_requests(&mut rng, 200, "random faults, staged"), Duration::from_secs(40));
    let lb = d.c.p[0].transport.stats();
    assert!(lb.post_errors > 0 && lb.notifications_lost > 0 && lb.failed_transfers > 0, "some fault never hit: {lb:?}");
    // Faults off: the staging slots all came back (stalled transfers were failed and their slots
    // freed), so plain requests go through.
    d.c.p[0].transport.set_fault_rates(FaultRates::default());
    std::thread::sleep(Duration::from_millis(2500));
    let reqs = (0..40)
        .map(|i| {
            let steps = legs(&mut rng, 1, false, 5);
            Req::new("after faults, staged", rng.id(1000 + i), rng.tokens(), steps, vec![(1, OK)])
        })
        .collect();
    d.run(reqs, Duration::from_secs(40));
    d.check();
    let count = |k: DKind| d.tracks.values().filter(|t| t.d_out[0][0].0 == k).count();
    eprintln!(
        "staged random faults: received {}, failed {}, timed out {}; transport {lb:?}; P {:?}; D {:?}",
        count(DKind::Received),
        count(DKind::Failed),
        count(DKind::TimedOut),
        d.c.p[0].engine.staging_counts(),
        d.c.d[0].engine.staging_counts()
    );
}
