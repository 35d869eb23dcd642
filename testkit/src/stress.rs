//! The engine stress driver: a producer (P) and a consumer (D) engine with 1 or 2 TP workers each, on
//! host memory, the loopback transport and a [`LocalHub`] control link, driven by a scripted loop that
//! plays both engine loops. The tests are in `tests/engine/engine_stress.rs`; read [`Driver::run`] and
//! [`Driver::check`] first. Never used by the library itself.
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
//! D's blocks go back to the pool the moment every D worker reported the request's outcome, as an
//! engine loop reuses them: the consumer holds back an outcome until every producer it registered
//! with gave its final word (see `kvpush::proto::completion`), so a late write into reused blocks is
//! a bug the verification of the next owner catches. [`Driver::quarantine`] turns that off for
//! debugging; no test sets it.

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
use kvpush::transport::loopback::{Fabric, Fault};
use kvpush::transport::staged::{PathChoice, StagingConfig};

use crate::demo::pattern;
use crate::engines::{self, Worker};
use crate::layouts;
use crate::rng::Rng;

/// Tokens per block of every worker.
pub const BLOCK_TOKENS: u32 = layouts::BLOCK_TOKENS;
/// The producer engine's id.
pub const P_ENGINE: &str = "prefill";
/// The consumer engine's id.
pub const D_ENGINE: &str = "decode";

use ReleaseReason as R;

// ---------------------------------------------------------------------------------------------
// Setup: two engines on one fabric.

#[derive(Clone, Debug)]
pub struct Setup {
    pub mode: Mode,
    pub p_tp: u16,
    pub d_tp: u16,
    pub writers: usize,
    pub num_blocks: u32,
    pub lease: Duration,
    pub registration_timeout: Duration,
    pub completion_timeout: Duration,
    pub pull_read_timeout: Duration,
    /// How long D waits for a producer's final word after a request ended without its data.
    pub drain_timeout: Duration,
    /// How late after `completion_timeout` a D outcome may still come (scheduling on a loaded machine).
    pub margin: Duration,
    /// Staging of P's WRITEs.
    pub staging: Staging,
    /// How long an engine's shutdown waits for its quarantined blocks (`Config::shutdown_wait_us`).
    pub shutdown_wait: Duration,
}

impl Setup {
    pub fn new(mode: Mode, p_tp: u16, d_tp: u16) -> Self {
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
            drain_timeout: Duration::from_micros(CompletionConfig::default().drain_timeout_us),
            margin: Duration::from_secs(3),
            staging: Staging::Off,
            shutdown_wait: Duration::from_micros(Config::new("", mode).shutdown_wait_us),
        }
    }

    pub fn config(&self, engine_id: &str) -> Config {
        let mut c = Config::new(engine_id, self.mode);
        c.writers = self.writers;
        c.rendezvous = RendezvousConfig {
            lease_us: self.lease.as_micros() as u64,
            registration_timeout_us: self.registration_timeout.as_micros() as u64,
            ..RendezvousConfig::default()
        };
        c.completion = CompletionConfig {
            timeout_us: self.completion_timeout.as_micros() as u64,
            drain_timeout_us: self.drain_timeout.as_micros() as u64,
            ..c.completion
        };
        c.pull_read_timeout_us = self.pull_read_timeout.as_micros() as u64;
        c.staging = self.staging;
        c.shutdown_wait_us = self.shutdown_wait.as_micros() as u64;
        c
    }
}

#[derive(Debug)]
pub struct Cluster {
    pub setup: Setup,
    pub p: Vec<Worker>,
    pub d: Vec<Worker>,
    _hub: Arc<LocalHub>,
    _fabric: Fabric,
}

/// The engines of one side: `tp` workers of two layers, two KV heads of dimension 8 (bf16).
pub fn build_side(setup: &Setup, engine_id: &str, tp: u16, fabric: &Fabric, hub: &Arc<LocalHub>) -> Vec<Worker> {
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
    pub fn new(setup: Setup) -> Cluster {
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

    /// Another consumer engine `engine_id` of `tp` workers on the same hub and fabric, connected to
    /// every P worker (an intruder holding the secret, or a second D). Drop it before the cluster.
    pub fn extra_consumer(&self, engine_id: &str, tp: u16) -> Vec<Worker> {
        let x = build_side(&self.setup, engine_id, tp, &self._fabric, &self._hub);
        for a in &self.p {
            for b in &x {
                engines::connect(&a.engine, &b.engine);
            }
        }
        x
    }

    /// Every P worker finished `key` (its KV in `blocks`, `tokens` tokens) and holds it; then D worker 0
    /// drops it before allocating anything (`abort_producer`). Returns each P worker's release of `key`,
    /// in worker order (a panic if one does not come within `limit`).
    pub fn dropped_by_d(&self, key: Key, blocks: &[Vec<u32>], tokens: u64, limit: Duration) -> Vec<Finished> {
        for p in &self.p {
            p.engine.request_finished(key, blocks.to_vec(), tokens).expect("finished");
        }
        self.d[0].engine.abort_producer(key, P_ENGINE).expect("told");
        self.p.iter().map(|p| engines::wait_for(&p.engine, "released", limit, |f| engines::released(f, key))).collect()
    }

    /// How many D workers P worker `i` writes into (their KV heads overlap).
    pub fn p_fan_out(&self, i: usize) -> usize {
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

/// Staging always on, in `slots` small slots (8 KiB, 16 entries of at most 1 KiB), so that every
/// WRITE of the small test layouts goes through the slots in several pieces.
pub fn small_staging(slots: usize) -> Staging {
    Staging::On(StagingConfig {
        slots,
        slot_bytes: 8192,
        max_entries: 16,
        max_entry_bytes: 1024,
        min_descs: 1,
        max_mean_desc: u64::MAX,
        stall_timeout: Duration::from_secs(10),
        quarantine: Duration::from_secs(120),
        choice: PathChoice::Always,
    })
}

// ---------------------------------------------------------------------------------------------
// Block pools: every block handed out must come back exactly once.

#[derive(Debug)]
pub struct Pool {
    pub name: &'static str,
    pub total: u32,
    pub free: Vec<u32>,
    pub out: HashSet<u32>,
}

impl Pool {
    pub fn new(name: &'static str, total: u32) -> Pool {
        // LIFO: a freed block is the next one handed out, so a late write into a freed block lands in
        // the next request's data and fails its verification.
        Pool { name, total, free: (0..total).rev().collect(), out: HashSet::new() }
    }

    pub fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.free.len() < n {
            return None;
        }
        let ids: Vec<u32> = (0..n).filter_map(|_| self.free.pop()).collect();
        for &b in &ids {
            assert!(self.out.insert(b), "{} pool: block {b} handed out twice", self.name);
        }
        Some(ids)
    }

    pub fn give(&mut self, ids: &[u32], errors: &mut Vec<String>, what: &str) {
        for &b in ids {
            if self.out.remove(&b) {
                self.free.push(b);
            } else {
                errors.push(format!("{} pool: block {b} released but not handed out ({what})", self.name));
            }
        }
    }

    pub fn check_full(&self) {
        assert!(self.out.is_empty(), "{} pool: {} blocks never came back", self.name, self.out.len());
        assert_eq!(self.free.len(), self.total as usize, "{} pool is not full", self.name);
    }
}

// ---------------------------------------------------------------------------------------------
// Scripts.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cond {
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
pub enum Step {
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
pub enum DKind {
    Received,
    Ended,
    /// Failed by a producer's failure notification (explicit).
    Failed,
    /// Failed by the completion timeout.
    TimedOut,
}

/// The outcomes an attempt may have. `None`: that side must never hear of the key.
#[derive(Clone, Copy, Debug)]
pub struct Expect {
    pub p: Option<&'static [ReleaseReason]>,
    pub d: Option<&'static [DKind]>,
}

pub const OK: Expect = Expect { p: Some(&[R::Sent]), d: Some(&[DKind::Received]) };

#[derive(Clone, Debug)]
pub struct Req {
    pub label: &'static str,
    pub id: u128,
    pub tokens: u64,
    pub script: VecDeque<Step>,
    pub expect: Vec<(u32, Expect)>,
}

impl Req {
    pub fn new(label: &'static str, id: u128, tokens: u64, steps: Vec<Step>, expect: Vec<(u32, Expect)>) -> Req {
        Req { label, id, tokens, script: steps.into(), expect }
    }
}

/// The contents of an attempt's KV.
pub fn seed_of(key: Key) -> u64 {
    let id = key.transfer_id.0;
    (id as u64) ^ ((id >> 64) as u64).rotate_left(17) ^ u64::from(key.attempt.0).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// What the driver saw of one key.
#[derive(Debug)]
pub struct Track {
    pub req: usize,
    pub tokens: u64,
    pub p_blocks: Option<Vec<Vec<u32>>>,
    /// Per P worker: whether it was given the key (`request_finished`).
    pub p_given: Vec<bool>,
    pub p_given_at: Option<Instant>,
    /// Per P worker: release reasons and when they were seen.
    pub p_sent: Vec<Vec<(ReleaseReason, Instant)>>,
    pub p_done: bool,
    pub d_blocks: Option<Vec<Vec<u32>>>,
    /// Whether this key's D blocks go back to the pool with its outcome (not handed to a retry).
    pub d_owned: bool,
    /// Keys that held these D blocks before (to name the suspect when data arrives wrong).
    pub d_prev_owners: Vec<Key>,
    pub d_given_at: Option<Instant>,
    /// Per D worker: outcomes, when they were seen, and their sequence number on that worker.
    pub d_out: Vec<Vec<(DKind, Instant, u64, String)>>,
    pub d_done: bool,
    pub verified: Option<bool>,
    /// D's blocks wait for P's release before they go back to the pool (see `Driver::quarantine`).
    pub d_quarantined: bool,
    /// D workers that reported the key quarantined (`Finished::Quarantined`) and have not released
    /// its blocks yet: they go back to the pool only after the last `Finished::Released`.
    pub d_engine_held: usize,
    /// First abort that concerns a leg given to an engine (P abort; D abort once D has the key).
    pub aborted_at: Option<Instant>,
    /// When the driver called `abort` on D.
    pub d_aborted_at: Option<Instant>,
}

// ---------------------------------------------------------------------------------------------
// The driver.

#[derive(Debug)]
pub struct Driver {
    pub c: Cluster,
    pub p_pool: Pool,
    pub d_pool: Pool,
    pub reqs: Vec<Req>,
    pub tracks: HashMap<Key, Track>,
    pub errors: Vec<String>,
    /// Legs given to an engine and not yet answered by every worker, and the most at once.
    pub open_legs: usize,
    pub max_open_legs: usize,
    /// Per P worker: `request_finished` calls. Per D worker: `blocks_allocated`/`start_pull` calls.
    pub p_calls: Vec<u64>,
    pub d_calls: Vec<u64>,
    /// `abort` calls per worker of each side.
    pub p_aborts: u64,
    pub d_aborts: u64,
    /// Per D worker: outcomes by kind (received, failed incl. timed out, ended).
    pub d_counts: Vec<[u64; 3]>,
    /// Sequence number of D reports, per worker.
    pub d_seq: Vec<u64>,
    /// The last key each D block was handed to.
    pub d_owner: HashMap<u32, Key>,
    /// Debugging knob, off by default: keep the D blocks of a request that did not arrive (ended,
    /// failed, timed out) out of the pool until P released the request. It hides writes that land
    /// after D's outcome (block reuse while a producer still writes), which the consumer's drain rules
    /// out and these tests exist to catch; turn it on only to tell such a failure from another.
    pub quarantine: bool,
    pub verified_bytes: u64,
    pub started: Instant,
}

pub fn outcome_key(f: &Finished) -> Key {
    f.key()
}

impl Driver {
    pub fn new(setup: Setup) -> Driver {
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
            quarantine: false,
            verified_bytes: 0,
            started: Instant::now(),
        }
    }

    pub fn track(&mut self, req: usize, key: Key) -> &mut Track {
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
            d_engine_held: 0,
            aborted_at: None,
            d_aborted_at: None,
        })
    }

    pub fn cond(&self, req: usize, cond: Cond) -> bool {
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
    pub fn advance(&mut self, i: usize, heap: &mut BinaryHeap<Reverse<(Instant, usize)>>, parked: &mut Vec<usize>) {
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
    pub fn poll(&mut self) -> usize {
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

    pub fn on_p(&mut self, w: usize, f: Finished, now: Instant) {
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

    pub fn on_d(&mut self, w: usize, f: Finished, now: Instant) {
        let key = outcome_key(&f);
        let (kind, text) = match &f {
            Finished::Received { .. } => (DKind::Received, String::new()),
            Finished::Ended { .. } => (DKind::Ended, String::new()),
            Finished::Quarantined { failed, reason, .. } => {
                if let Some(t) = self.tracks.get_mut(&key) {
                    t.d_engine_held += 1;
                }
                (if *failed { DKind::Failed } else { DKind::Ended }, reason.clone())
            }
            Finished::Released { .. } => {
                let Some(t) = self.tracks.get_mut(&key).filter(|t| t.d_engine_held > 0) else {
                    self.errors.push(format!("D[{w}] released {key}, which it never quarantined"));
                    return;
                };
                t.d_engine_held -= 1;
                if t.d_engine_held == 0 && t.d_done && t.d_owned && !t.d_quarantined {
                    let blocks = t.d_blocks.clone().unwrap_or_default();
                    self.d_pool.give(&blocks[0], &mut self.errors, &format!("D blocks of {key}"));
                }
                return;
            }
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
            let engine_held = t.d_engine_held;
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
            if owned && !quarantine && engine_held == 0 {
                self.d_pool.give(&blocks[0], &mut self.errors, &format!("D blocks of {key}"));
            }
        }
    }

    /// Which keys' contents sit in the elements of `key` that arrived wrong on D worker `j` (the same
    /// token slot of a block another key held on D, or of the P block it was read from), and what
    /// happened to the keys that held its D blocks before.
    pub fn explain(&self, j: usize, key: Key) -> String {
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
    pub fn run(&mut self, reqs: Vec<Req>, limit: Duration) {
        self.run_bounded(reqs, Bound::Total(limit));
    }

    /// [`Driver::run`] under `bound`: a total time, or a time without any outcome.
    pub fn run_bounded(&mut self, reqs: Vec<Req>, bound: Bound) {
        let (limit, stalled) = match bound {
            Bound::Total(limit) => (limit, false),
            Bound::Stalled(limit) => (limit, true),
        };
        let base = self.reqs.len();
        self.reqs.extend(reqs);
        let mut heap = BinaryHeap::new();
        let now = Instant::now();
        for i in base..self.reqs.len() {
            heap.push(Reverse((now, i)));
        }
        let mut parked: Vec<usize> = Vec::new();
        let mut deadline = Instant::now() + limit;
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
            if stalled && n > 0 {
                deadline = Instant::now() + limit;
            }
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

    pub fn stuck_report(&self, limit: Duration) -> String {
        let mut s = format!(
            "requests did not finish within {limit:?} (of the run, or since the last outcome); {} legs still open",
            self.open_legs
        );
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
    pub fn check(&mut self) {
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

    pub fn assert_no_errors(&self) {
        assert!(
            self.errors.is_empty(),
            "{} violations, first ones:\n  {}",
            self.errors.len(),
            self.errors.iter().take(20).cloned().collect::<Vec<_>>().join("\n  ")
        );
    }

    /// The engines' counters agree with what the driver saw.
    pub fn check_stats(&self) {
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

    pub fn get(&self, id: u128, attempt: u32) -> &Track {
        self.tracks.get(&Key::new(id, attempt)).expect("key was played")
    }

    pub fn summary(&self) -> String {
        format!(
            "{} keys, {} bytes verified, at most {} legs open at once, in {:.2?}",
            self.tracks.len(),
            self.verified_bytes,
            self.max_open_legs,
            self.started.elapsed()
        )
    }
}

/// How long [`Driver::run_bounded`] may take before it fails.
#[derive(Clone, Copy, Debug)]
pub enum Bound {
    /// In all.
    Total(Duration),
    /// Without any outcome from either engine: for workloads whose length a loaded host stretches
    /// (a slow run is no bug, a stuck one is; the engines' own timeouts bound each request).
    Stalled(Duration),
}

// ---------------------------------------------------------------------------------------------
// Workload generation.

/// What a script draws from the one PRNG.
pub trait Draw {
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
pub fn legs(rng: &mut Rng, a: u32, registration_first: bool, max_ms: u64) -> Vec<Step> {
    let (first, second) =
        if registration_first { (Step::DAlloc(a), Step::PFinish(a)) } else { (Step::PFinish(a), Step::DAlloc(a)) };
    vec![rng.ms(max_ms), first, rng.ms(max_ms), second]
}
