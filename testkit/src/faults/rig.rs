//! The in-process rig of the fault suite: a producer engine (P) and a consumer engine (D), each with
//! 1 or 2 TP workers on host memory, the loopback data path (real threads, faults injected per
//! endpoint) and a real TCP side channel per worker (authenticated, heartbeats, peer timeout), so a
//! cut control link and a data path that still lands can happen separately, as with RDMA and TCP.
//!
//! Read [`Rig::play`], then [`Rig::finish`]. Every request is a script of [`Step`]s (fill P's blocks
//! and call `request_finished`, allocate D's blocks and register or pull, abort on either side, inject
//! a transport fault, cut or restore the side channel, shut an engine down, wait). The rig plays up
//! to `concurrency` scripts at once and keeps the owner's side of the block contract through two
//! [`Scribbler`]s: blocks go back to their pool, canaried, the moment the outcome that frees them is
//! seen (P: `Sent`, with any reason; D: any outcome), and D's received requests are checked byte by
//! byte before that. An optional third engine, the intruder, registers keys that belong to D.
//!
//! It measures, never asserts: corrupt blocks (canaries overwritten, received requests wrong, KV
//! delivered to the intruder), leaked blocks (not back with their owner at the end), hung requests
//! (no outcome from some worker by [`Params::outcome_limit`] after the leg was given), protocol
//! violations (a second outcome, an outcome for a key never given) and the most blocks held at once
//! by engines for requests already doomed (aborted, faulted, or failed on the other side).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpush::device::host::HostDevice;
use kvpush::device::{Buffer, Device};
use kvpush::engine::side::{SideChannel, SideConfig};
use kvpush::engine::{Engine, Finished, Staging};
use kvpush::proto::codec;
use kvpush::proto::layout::KvLayout;
use kvpush::proto::msg::{blocks_for, Completion, Message};
use kvpush::proto::rendezvous::ReleaseReason;
use kvpush::proto::{Key, Mode};
use kvpush::transport::loopback::{Fabric, Fault, FaultRates, LoopbackTransport};

use super::scribbler::{Memory, Scribbler};
use super::ScenarioReport;
use crate::demo::pattern;
use crate::layouts::{self, BLOCK_TOKENS};
use crate::stress::{seed_of, Setup, D_ENGINE, P_ENGINE};

/// The intruder's engine id (issue 16, window 8).
pub const X_ENGINE: &str = "intruder";

/// The shared secret of the rig's side channels.
const SECRET: &[u8] = b"fault-suite-secret-0123456789abc";

/// Engines, timeouts and load of one scenario.
#[derive(Clone, Debug)]
pub struct Params {
    /// Mode, TP sizes, writers, pool size, timeouts and staging: the engine stress driver's setup
    /// (its `margin` is not used here).
    pub engines: Setup,
    pub heartbeat: Duration,
    pub peer_timeout: Duration,
    /// Scripts played at once.
    pub concurrency: usize,
    /// Whether an intruder engine (a second consumer) is started.
    pub intruder: bool,
    /// Longest fault delay a scenario injects (added to the outcome limit).
    pub max_delay: Duration,
}

impl Params {
    /// Timeouts short enough that a scenario's faults resolve in seconds (3 s), long enough that a
    /// loaded two-core machine does not hit them on healthy requests (which take milliseconds).
    pub fn new(mode: Mode, p_tp: u16, d_tp: u16) -> Params {
        Params {
            engines: Setup {
                writers: 1,
                num_blocks: 2048,
                lease: Duration::from_secs(3),
                registration_timeout: Duration::from_secs(3),
                completion_timeout: Duration::from_secs(3),
                drain_timeout: Duration::from_secs(3),
                pull_read_timeout: Duration::from_secs(3),
                staging: Staging::Off,
                ..Setup::new(mode, p_tp, d_tp)
            },
            heartbeat: Duration::from_millis(100),
            peer_timeout: Duration::from_millis(1500),
            concurrency: 32,
            intruder: false,
            max_delay: Duration::ZERO,
        }
    }

    /// How long after a leg is given an outcome may come at most: the longest timeout that can end
    /// it, the drain, the longest injected delay and a margin of 5 s for a loaded machine.
    pub fn outcome_limit(&self) -> Duration {
        let e = &self.engines;
        let waits = e.lease.max(e.completion_timeout).max(e.pull_read_timeout).max(self.peer_timeout);
        waits + e.drain_timeout + self.max_delay + Duration::from_secs(5)
    }
}

/// One worker: its engine (gone after a shutdown), side channel, loopback endpoint, layout and
/// memory. Field order is drop order: the engine first, the memory last.
#[derive(Debug)]
pub struct Node {
    pub engine: Option<Engine>,
    pub side: Arc<SideChannel>,
    pub transport: Arc<LoopbackTransport>,
    pub layout: KvLayout,
    pub buffers: Vec<Box<dyn Buffer>>,
}

impl Node {
    fn start(params: &Params, fabric: &Fabric, engine_id: &str, rank: u16, tp: u16) -> Node {
        let dev: Arc<dyn Device> = Arc::new(HostDevice::new());
        let mut layout =
            layouts::separate(layouts::full_model(2, 2, 8), params.engines.num_blocks, layouts::tp(rank, tp));
        let buffers = layouts::allocate(&mut layout, dev.as_ref()).expect("host memory");
        let mut sc = SideConfig::for_rank(rank);
        sc.listen = "127.0.0.1:0".into();
        sc.secret = Some(SECRET.to_vec());
        sc.heartbeat = params.heartbeat;
        sc.peer_timeout = params.peer_timeout;
        sc.handshake_timeout = Duration::from_secs(5);
        let side = Arc::new(SideChannel::bind(sc).expect("side channel binds"));
        let transport = Arc::new(fabric.endpoint(&format!("{engine_id}/{rank}")).expect("endpoint"));
        // SAFETY: precondition 1: the regions are `buffers`, allocated above and owned by the
        // returned node, which drops its engine first (field order). Precondition 2: the rig reuses,
        // reads or rewrites a request's blocks only after the outcome that frees them (the Scribbler
        // is given blocks from `Rig::on_p` / `Rig::on_d` only) or after the engine was shut down.
        let engine = unsafe {
            Engine::new(params.engines.config(engine_id), layout.clone(), dev, transport.clone(), side.clone())
        }
        .expect("engine starts");
        side.serve(engine.endpoint());
        Node { engine: Some(engine), side, transport, layout, buffers }
    }

    fn engine(&self) -> Option<&Engine> {
        self.engine.as_ref()
    }
}

fn mem(nodes: &[Node]) -> Memory<'_> {
    nodes.iter().map(|n| (&n.layout, &n.buffers[..])).collect()
}

/// Which engine a step concerns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Who {
    P,
    D,
}

/// What a script waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cond {
    /// Every D worker reported an outcome for the attempt.
    DOut(u32),
    /// Every P worker released the attempt.
    PDone(u32),
    /// Worker 0 of that side has a transfer open on its endpoint.
    InFlight(Who),
    /// No worker of that side has a transfer open (so a later `InFlight` is a new transfer's).
    Idle(Who),
    /// P's worker 0 has seen at least this many registrations in all.
    PRegistrations(u64),
}

/// One step of a request's script. Attempts are numbered; the key is `(script id, attempt)`.
#[derive(Clone, Debug)]
pub enum Step {
    Sleep(Duration),
    /// Fill P's blocks for the attempt and call `request_finished` on every P worker.
    PFinish(u32),
    /// Allocate D's blocks for the attempt; register them (push) or pull P's blocks (pull).
    DAlloc(u32),
    /// Push: D holds the first `.1` blocks already (a prefix-cache hit, filled with the request's
    /// own KV) and registers only the rest.
    DAllocTail(u32, usize),
    /// Pull naming other P blocks than P pinned (`.1` blocks taken from P's pool, filled with
    /// another request's KV): a stale or forged `remote_block_ids`.
    DPullForged(u32, usize),
    /// The intruder registers the attempt's key into blocks of its own.
    XAlloc(u32),
    /// A completion frame for the attempt on D's control link, as if from P's worker 0, before any
    /// data (issue 16, window 5: only the data path may say that data landed).
    ForgeCompletion(u32),
    PAbort(u32),
    DAbort(u32),
    /// A one-shot fault on worker `.1` of that side's endpoint.
    Inject(Who, usize, Fault),
    Wait(Cond),
    /// Closes every side-channel connection between D (and the intruder) and P.
    Cut,
    /// Dials P again from every D worker (and the intruder).
    Reconnect,
    /// Shuts that side's engines down; its blocks go back to their owner when that returns.
    Shutdown(Who),
}

impl Step {
    /// Whether the step gives a leg of a request to P or D.
    fn is_leg(&self) -> bool {
        matches!(self, Step::PFinish(_) | Step::DAlloc(_) | Step::DAllocTail(..) | Step::DPullForged(..))
    }
}

/// A request's script.
#[derive(Clone, Debug)]
pub struct Script {
    pub label: &'static str,
    pub tokens: u64,
    pub steps: Vec<Step>,
}

impl Script {
    pub fn new(label: &'static str, tokens: u64, steps: Vec<Step>) -> Script {
        Script { label, tokens, steps }
    }
}

/// What a D worker reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DOut {
    Received,
    Failed,
    Ended,
    /// The engine refused the call (the leg never started).
    Refused,
    /// The engine was shut down with the leg open.
    Shutdown,
}

/// What the rig saw of one key.
#[derive(Debug)]
struct Leg {
    tokens: u64,
    p_blocks: Option<Vec<u32>>,
    p_given_at: Option<Instant>,
    p_out: Vec<Option<ReleaseReason>>,
    p_done: bool,
    /// Every block D holds for it (a prefix hit included) and how many lead blocks D already had.
    d_blocks: Option<Vec<u32>>,
    d_prefix: usize,
    /// P blocks a forged pull named (they go back to P's pool with D's outcome).
    forged: Option<Vec<u32>>,
    d_given_at: Option<Instant>,
    d_out: Vec<Option<DOut>>,
    d_done: bool,
    /// D workers that reported it `Finished::Quarantined` and have not released it yet: its blocks
    /// go back to D's pool only once this is 0.
    d_held: usize,
    /// Its D blocks went back to D's pool.
    d_returned: bool,
    x_blocks: Option<Vec<u32>>,
    x_out: Option<DOut>,
    /// Aborted, faulted or failed on one side: its blocks still held count as quarantined.
    doomed: bool,
}

/// One side of a [`Leg`]: its blocks (`None`: never given to that side) and each worker's outcome.
type Side<'a, T> = (&'a Option<Vec<u32>>, &'a mut Vec<Option<T>>);

impl Leg {
    /// P's blocks for it (`None`: never given to P) and each P worker's release.
    fn p_side(&mut self) -> Side<'_, ReleaseReason> {
        (&self.p_blocks, &mut self.p_out)
    }

    /// D's blocks for it (`None`: never given to D) and each D worker's outcome.
    fn d_side(&mut self) -> Side<'_, DOut> {
        (&self.d_blocks, &mut self.d_out)
    }
}

/// A script being played.
struct Playing {
    id: u128,
    script: Script,
    at: usize,
    /// Since when it has been waiting on its current `Wait` step.
    waiting_since: Option<Instant>,
    keys: Vec<Key>,
}

/// The rig. See the module docs.
#[derive(Debug)]
pub struct Rig {
    pub params: Params,
    pub p: Vec<Node>,
    pub d: Vec<Node>,
    pub x: Vec<Node>,
    p_pool: Scribbler,
    d_pool: Scribbler,
    x_pool: Option<Scribbler>,
    legs: HashMap<Key, Leg>,
    /// Keys given to an engine whose outcome has not come from every worker.
    open: HashSet<Key>,
    requests: u64,
    received: u64,
    failed: u64,
    corrupt_received: u64,
    intruder_received: u64,
    violations: Vec<String>,
    late: u64,
    quarantined_max: u64,
    waits_given_up: Vec<String>,
    /// The first few distinct reasons D gave for failures, for the report.
    reasons: Vec<String>,
    /// Raw connections held open to P's side channel (a slow handshake, vLLM S2).
    pub stalled: Vec<TcpStream>,
    _fabric: Fabric,
    started: Instant,
    next_id: u128,
}

impl Rig {
    /// Starts P, D (and the intruder) and handshakes every D worker with every P worker.
    pub fn new(params: Params) -> Rig {
        let fabric = Fabric::new();
        let p: Vec<Node> =
            (0..params.engines.p_tp).map(|r| Node::start(&params, &fabric, P_ENGINE, r, params.engines.p_tp)).collect();
        let d: Vec<Node> =
            (0..params.engines.d_tp).map(|r| Node::start(&params, &fabric, D_ENGINE, r, params.engines.d_tp)).collect();
        let x: Vec<Node> = if params.intruder {
            (0..params.engines.d_tp).map(|r| Node::start(&params, &fabric, X_ENGINE, r, params.engines.d_tp)).collect()
        } else {
            Vec::new()
        };
        let n = params.engines.num_blocks;
        let p_pool = Scribbler::new("P", n, &mem(&p));
        let d_pool = Scribbler::new("D", n, &mem(&d));
        let x_pool = (!x.is_empty()).then(|| Scribbler::new("X", n, &mem(&x)));
        let mut rig = Rig {
            params,
            p,
            d,
            x,
            p_pool,
            d_pool,
            x_pool,
            legs: HashMap::new(),
            open: HashSet::new(),
            requests: 0,
            received: 0,
            failed: 0,
            corrupt_received: 0,
            intruder_received: 0,
            violations: Vec::new(),
            late: 0,
            quarantined_max: 0,
            waits_given_up: Vec::new(),
            reasons: Vec::new(),
            stalled: Vec::new(),
            _fabric: fabric,
            started: Instant::now(),
            next_id: 0x5ca1_0000_0000,
        };
        rig.reconnect();
        rig
    }

    /// Dials every P worker from every D worker and intruder worker.
    fn reconnect(&mut self) {
        for c in self.d.iter().chain(&self.x) {
            for p in &self.p {
                if let Err(e) = c.side.connect(p.side.local_addr()) {
                    self.violations.push(format!("cannot (re)connect to P: {e}"));
                }
            }
        }
    }

    fn cut(&self) {
        for c in self.d.iter().chain(&self.x) {
            for peer in c.side.peers() {
                c.side.disconnect(&peer);
            }
        }
    }

    /// Sets pseudo-random fault rates on every worker of `who`.
    pub fn fault_rates(&self, who: Who, rates: FaultRates) {
        for (i, n) in self.side(who).iter().enumerate() {
            n.transport.set_fault_rates(FaultRates { seed: rates.seed ^ i as u64, ..rates });
        }
    }

    fn side(&self, who: Who) -> &[Node] {
        match who {
            Who::P => &self.p,
            Who::D => &self.d,
        }
    }

    fn leg(&mut self, key: Key, tokens: u64) -> &mut Leg {
        let (pn, dn) = (self.p.len(), self.d.len());
        self.legs.entry(key).or_insert_with(|| Leg {
            tokens,
            p_blocks: None,
            p_given_at: None,
            p_out: vec![None; pn],
            p_done: false,
            d_blocks: None,
            d_prefix: 0,
            forged: None,
            d_given_at: None,
            d_out: vec![None; dn],
            d_done: false,
            d_held: 0,
            d_returned: false,
            x_blocks: None,
            x_out: None,
            doomed: false,
        })
    }

    /// Plays every script (at most `concurrency` at once) and waits for every leg's outcome, up to
    /// `limit` in all.
    pub fn play(&mut self, scripts: Vec<Script>, limit: Duration) {
        let deadline = Instant::now() + limit;
        let mut pending: std::collections::VecDeque<Script> = scripts.into();
        let mut live: Vec<Playing> = Vec::new();
        let mut timers: BinaryHeap<Reverse<(Instant, u128)>> = BinaryHeap::new();
        let mut asleep: HashSet<u128> = HashSet::new();
        loop {
            while live.len() < self.params.concurrency {
                let Some(script) = pending.pop_front() else { break };
                self.requests += u64::from(script.steps.iter().any(Step::is_leg));
                self.next_id += 1;
                live.push(Playing { id: self.next_id, script, at: 0, waiting_since: None, keys: Vec::new() });
            }
            let now = Instant::now();
            while let Some(&Reverse((at, id))) = timers.peek() {
                if at > now {
                    break;
                }
                timers.pop();
                asleep.remove(&id);
            }
            for pl in live.iter_mut() {
                if asleep.contains(&pl.id) {
                    continue;
                }
                if let Some(wake) = self.advance(pl) {
                    timers.push(Reverse((wake, pl.id)));
                    asleep.insert(pl.id);
                }
            }
            let got = self.poll();
            live.retain(|pl| pl.at < pl.script.steps.len() || pl.keys.iter().any(|k| self.open.contains(k)));
            if live.is_empty() && pending.is_empty() {
                break;
            }
            if Instant::now() > deadline {
                break;
            }
            if got == 0 {
                std::thread::sleep(Duration::from_micros(300));
            }
        }
    }

    /// Runs the due steps of `pl`; returns when it should run again if it sleeps.
    fn advance(&mut self, pl: &mut Playing) -> Option<Instant> {
        while let Some(step) = pl.script.steps.get(pl.at).cloned() {
            let tokens = pl.script.tokens;
            let key_of = |a: u32| Key::new(pl.id, a);
            match step {
                Step::Sleep(d) => {
                    pl.at += 1;
                    if !d.is_zero() {
                        return Some(Instant::now() + d);
                    }
                }
                Step::Wait(c) => {
                    if !self.cond(pl.id, c) {
                        let since = *pl.waiting_since.get_or_insert_with(Instant::now);
                        // A condition that never comes (the engine ended the request first) must not
                        // hang the suite: the script moves on, and it is counted for the report.
                        if since.elapsed() > Duration::from_secs(5) {
                            self.waits_given_up.push(format!("{c:?} of {} ({})", pl.id, pl.script.label));
                        } else {
                            return None;
                        }
                    }
                    pl.waiting_since = None;
                    pl.at += 1;
                }
                Step::PFinish(a) => {
                    let key = key_of(a);
                    if !self.p_finish(key, tokens) {
                        return Some(Instant::now() + Duration::from_millis(1));
                    }
                    pl.keys.push(key);
                    pl.at += 1;
                }
                Step::DAlloc(a) | Step::DAllocTail(a, _) | Step::DPullForged(a, _) => {
                    let key = key_of(a);
                    if !self.d_alloc(key, tokens, &step) {
                        return Some(Instant::now() + Duration::from_millis(1));
                    }
                    pl.keys.push(key);
                    pl.at += 1;
                }
                Step::XAlloc(a) => {
                    let key = key_of(a);
                    if !self.x_alloc(key, tokens) {
                        return Some(Instant::now() + Duration::from_millis(1));
                    }
                    pl.at += 1;
                }
                Step::PAbort(a) | Step::DAbort(a) => {
                    let key = key_of(a);
                    let nodes = if matches!(step, Step::PAbort(_)) { &self.p } else { &self.d };
                    for n in nodes.iter().filter_map(Node::engine) {
                        if let Err(e) = n.abort(key) {
                            self.violations.push(format!("abort of {key} refused: {e}"));
                        }
                    }
                    self.leg(key, tokens).doomed = true;
                    pl.at += 1;
                }
                Step::ForgeCompletion(a) => {
                    self.forge_completion(key_of(a));
                    pl.at += 1;
                }
                Step::Inject(who, w, fault) => {
                    self.side(who)[w].transport.inject_once(fault);
                    pl.at += 1;
                }
                Step::Cut => {
                    self.cut();
                    for k in self.open.clone() {
                        self.legs.entry(k).and_modify(|l| l.doomed = true);
                    }
                    pl.at += 1;
                }
                Step::Reconnect => {
                    self.reconnect();
                    pl.at += 1;
                }
                Step::Shutdown(who) => {
                    self.shutdown(who);
                    pl.at += 1;
                }
            }
        }
        None
    }

    fn cond(&self, id: u128, c: Cond) -> bool {
        match c {
            Cond::DOut(a) => self.legs.get(&Key::new(id, a)).is_some_and(|l| l.d_out.iter().all(Option::is_some)),
            Cond::PDone(a) => self.legs.get(&Key::new(id, a)).is_some_and(|l| l.p_done),
            Cond::InFlight(who) => self.side(who)[0].transport.open_transfers() > 0,
            Cond::Idle(who) => self.side(who).iter().all(|n| n.transport.open_transfers() == 0),
            Cond::PRegistrations(n) => self.p[0].engine().is_some_and(|e| e.stats().counters.registrations >= n),
        }
    }

    fn p_finish(&mut self, key: Key, tokens: u64) -> bool {
        let n = blocks_for(tokens, BLOCK_TOKENS) as usize;
        let Some(ids) = self.p_pool.take(n, &mem(&self.p)) else { return false };
        let blocks = vec![ids.clone()];
        for node in &self.p {
            pattern::fill(&node.layout, &node.buffers, &blocks, tokens, seed_of(key)).expect("prefill");
        }
        let l = self.leg(key, tokens);
        l.p_blocks = Some(ids);
        l.p_given_at = Some(Instant::now());
        self.open.insert(key);
        let mut refused = Vec::new();
        // With an intruder about, P names D as the consumer, as kvpush router does (window 8).
        let consumer = self.params.intruder.then_some(D_ENGINE);
        for (w, node) in self.p.iter().enumerate() {
            match node.engine() {
                Some(e) => {
                    if let Err(err) = e.request_finished_for(key, blocks.clone(), tokens, consumer) {
                        refused.push((w, err.to_string()));
                    }
                }
                None => refused.push((w, "shut down".into())),
            }
        }
        for (w, _why) in refused {
            // A refused call hands nothing to the engine: the blocks are the owner's at once.
            self.on_p(w, key, ReleaseReason::Refused);
        }
        true
    }

    fn d_alloc(&mut self, key: Key, tokens: u64, step: &Step) -> bool {
        let n = blocks_for(tokens, BLOCK_TOKENS) as usize;
        let Some(ids) = self.d_pool.take(n, &mem(&self.d)) else { return false };
        let (prefix, forged_n) = match *step {
            Step::DAllocTail(_, k) => (k.min(n.saturating_sub(1)), 0),
            Step::DPullForged(_, k) => (0, k),
            _ => (0, 0),
        };
        let forged = if forged_n > 0 {
            let Some(f) = self.p_pool.take(forged_n, &mem(&self.p)) else {
                self.d_pool.give(&ids, &mem(&self.d), "forged pull retried");
                return false;
            };
            for node in &self.p {
                pattern::fill(
                    &node.layout,
                    &node.buffers,
                    std::slice::from_ref(&f),
                    tokens.min(f.len() as u64 * 16),
                    0x0bad,
                )
                .expect("another request's KV");
            }
            Some(f)
        } else {
            None
        };
        if prefix > 0 {
            // The prefix D already holds: the request's own KV, as a prefix cache keeps it.
            for node in &self.d {
                pattern::fill(&node.layout, &node.buffers, std::slice::from_ref(&ids), tokens, seed_of(key))
                    .expect("prefix");
            }
        }
        let mode = self.params.engines.mode;
        let l = self.leg(key, tokens);
        l.d_blocks = Some(ids.clone());
        l.d_prefix = prefix;
        l.forged = forged.clone();
        l.d_given_at = Some(Instant::now());
        let remote = forged.or_else(|| l.p_blocks.clone());
        self.open.insert(key);
        let listed = vec![ids[prefix..].to_vec()];
        let mut refused = Vec::new();
        for (w, node) in self.d.iter().enumerate() {
            let Some(e) = node.engine() else {
                refused.push(w);
                continue;
            };
            let r = match (mode, &remote) {
                (Mode::Push, _) => e.blocks_allocated(key, P_ENGINE, listed.clone(), tokens),
                (Mode::Pull, Some(remote)) => e.start_pull(key, P_ENGINE, vec![remote.clone()], listed.clone(), tokens),
                (Mode::Pull, None) => {
                    self.violations.push(format!("script error: pull of {key} before P finished"));
                    refused.push(w);
                    continue;
                }
            };
            if r.is_err() {
                refused.push(w);
            }
        }
        for w in refused {
            self.on_d(w, key, DOut::Refused);
        }
        true
    }

    fn x_alloc(&mut self, key: Key, tokens: u64) -> bool {
        let n = blocks_for(tokens, BLOCK_TOKENS) as usize;
        let Some(pool) = self.x_pool.as_mut() else {
            self.violations.push("script error: no intruder".into());
            return true;
        };
        let Some(ids) = pool.take(n, &mem(&self.x)) else { return false };
        let l = self.leg(key, tokens);
        l.x_blocks = Some(ids.clone());
        let mut refused = false;
        for node in self.x.iter().filter_map(Node::engine) {
            refused |= node.blocks_allocated(key, P_ENGINE, vec![ids.clone()], tokens).is_err();
        }
        if refused {
            self.on_x(key, DOut::Refused);
        }
        true
    }

    fn forge_completion(&mut self, key: Key) {
        let Some(p) = self.p[0].engine() else { return };
        let rank = p.layout().parallel.rank();
        let frame = codec::to_vec(&Message::Completion(Completion { key, rank })).expect("a completion encodes");
        for d in self.d.iter().filter_map(Node::engine) {
            // Refused (counted as malformed) or ignored is right; acting on it is what is measured.
            let _ = d.handle_frame(p.addr(), &frame);
        }
    }

    /// Shuts `who`'s engines down. When that returns the caller may free their memory: every open
    /// leg's blocks go back to their owner (and are canaried) at once.
    fn shutdown(&mut self, who: Who) {
        let nodes = match who {
            Who::P => &mut self.p,
            Who::D => &mut self.d,
        };
        for n in nodes.iter_mut() {
            if let Some(e) = n.engine.take() {
                e.shutdown();
            }
            // The process that shut down closes its side channel too.
            for peer in n.side.peers() {
                n.side.disconnect(&peer);
            }
        }
        for key in self.open.clone() {
            let l = &self.legs[&key];
            match who {
                Who::P => {
                    let open: Vec<usize> = (0..l.p_out.len()).filter(|&w| l.p_out[w].is_none()).collect();
                    if l.p_blocks.is_some() {
                        for w in open {
                            self.on_p(w, key, ReleaseReason::Aborted);
                        }
                    }
                }
                Who::D => {
                    let open: Vec<usize> = (0..l.d_out.len()).filter(|&w| l.d_out[w].is_none()).collect();
                    if l.d_blocks.is_some() {
                        for w in open {
                            self.on_d(w, key, DOut::Shutdown);
                        }
                    }
                }
            }
        }
    }

    /// Drains every engine; returns the number of outcomes.
    fn poll(&mut self) -> usize {
        let mut got = Vec::new();
        let mut out = Vec::new();
        for (side, nodes) in [(0, &self.p), (1, &self.d), (2, &self.x)] {
            for (w, n) in nodes.iter().enumerate() {
                if let Some(e) = n.engine() {
                    e.poll(&mut out);
                    got.extend(out.drain(..).map(|f| (side, w, f)));
                }
            }
        }
        let n = got.len();
        for (side, w, f) in got {
            match (side, f) {
                (0, Finished::Sent { key, reason }) => self.on_p(w, key, reason),
                (1, Finished::Received { key }) => self.on_d(w, key, DOut::Received),
                (1, Finished::Failed { key, reason, .. }) => {
                    let head: String = reason.chars().take(24).collect();
                    if self.reasons.len() < 3 && !self.reasons.iter().any(|r| r.starts_with(&head)) {
                        self.reasons.push(reason);
                    }
                    self.on_d(w, key, DOut::Failed)
                }
                (1, Finished::Ended { key }) => self.on_d(w, key, DOut::Ended),
                (1, Finished::Quarantined { key, failed, .. }) => {
                    // The end, reported in time; the blocks stay out of the pool until Released.
                    if let Some(l) = self.legs.get_mut(&key) {
                        l.d_held += 1;
                    }
                    self.on_d(w, key, if failed { DOut::Failed } else { DOut::Ended })
                }
                (1, Finished::Released { key }) => self.on_d_released(w, key),
                (2, Finished::Received { key }) => self.on_x(key, DOut::Received),
                (2, Finished::Failed { key, .. }) => self.on_x(key, DOut::Failed),
                (2, Finished::Ended { key }) => self.on_x(key, DOut::Ended),
                (s, f) => self.violations.push(format!("engine {s} worker {w} reported {f:?}")),
            }
        }
        if n > 0 {
            self.track_quarantine();
        }
        n
    }

    /// Blocks held by engines for doomed requests right now; keeps the most.
    fn track_quarantine(&mut self) {
        let mut held = 0u64;
        for k in &self.open {
            let l = &self.legs[k];
            if l.doomed {
                if !l.p_done {
                    held += l.p_blocks.as_ref().map_or(0, |b| b.len() as u64);
                }
                if !l.d_done {
                    held += l.d_blocks.as_ref().map_or(0, |b| b.len() as u64);
                }
            }
        }
        self.quarantined_max = self.quarantined_max.max(held);
    }

    fn check_late(&mut self, key: Key, given: Option<Instant>, who: &str) {
        let limit = self.params.outcome_limit();
        if let Some(g) = given.filter(|g| g.elapsed() > limit) {
            self.late += 1;
            self.violations.push(format!("{who} outcome of {key} came {:?} after the leg (> {limit:?})", g.elapsed()));
        }
    }

    /// The leg of `key`, with worker `w`'s outcome `out` recorded in the slots `side` picks (the
    /// side's blocks, `None` if that side was never given `key`, and one outcome slot per worker;
    /// `who` names the side in violations). `None`, with a violation, if the side was never given
    /// `key` or `w` reported it before. The leg is doomed unless `out` is `ok`.
    fn report<T: Copy + PartialEq + std::fmt::Debug>(
        &mut self,
        (who, w): (&str, usize),
        key: Key,
        (out, ok): (T, T),
        side: fn(&mut Leg) -> Side<'_, T>,
    ) -> Option<&mut Leg> {
        if !self.legs.get_mut(&key).is_some_and(|l| side(l).0.is_some()) {
            self.violations.push(format!("{who}[{w}] reported {out:?} for {key}, never given"));
            return None;
        }
        let l = self.legs.get_mut(&key)?; // there: checked above
        let slot = &mut side(l).1[w];
        if slot.is_some() {
            self.violations.push(format!("{who}[{w}] reported {key} twice ({out:?})"));
            return None;
        }
        *slot = Some(out);
        l.doomed |= out != ok;
        Some(l)
    }

    fn on_p(&mut self, w: usize, key: Key, reason: ReleaseReason) {
        let Some(l) = self.report(("P", w), key, (reason, ReleaseReason::Sent), Leg::p_side) else { return };
        if l.p_out.iter().all(Option::is_some) {
            l.p_done = true;
            let given = l.p_given_at;
            let blocks = l.p_blocks.clone().unwrap_or_default();
            self.p_pool.give(&blocks, &mem(&self.p), "P's release");
            self.check_late(key, given, "P");
            self.close_if_done(key);
        }
    }

    fn on_d(&mut self, w: usize, key: Key, out: DOut) {
        let Some(l) = self.report(("D", w), key, (out, DOut::Received), Leg::d_side) else { return };
        if !l.d_out.iter().all(Option::is_some) {
            return;
        }
        l.d_done = true;
        let (tokens, given) = (l.tokens, l.d_given_at);
        let blocks = l.d_blocks.clone().unwrap_or_default();
        let forged = l.forged.take();
        if l.d_out.iter().all(|o| *o == Some(DOut::Received)) {
            self.received += 1;
            let mut wrong = false;
            for n in &self.d {
                let v = pattern::verify(&n.layout, &n.buffers, std::slice::from_ref(&blocks), tokens, seed_of(key))
                    .expect("read");
                wrong |= !v.ok();
            }
            if wrong {
                self.corrupt_received += blocks.len() as u64;
                if self.violations.len() < 50 {
                    self.violations.push(format!("D received {key} with wrong bytes"));
                }
            }
        } else {
            self.failed += 1;
        }
        if let Some(f) = forged {
            self.p_pool.give(&f, &mem(&self.p), "forged pull's blocks");
        }
        self.check_late(key, given, "D");
        self.return_d_blocks(key);
    }

    /// A quarantined request's blocks released by one D worker.
    fn on_d_released(&mut self, w: usize, key: Key) {
        match self.legs.get_mut(&key) {
            Some(l) if l.d_held > 0 => l.d_held -= 1,
            _ => {
                self.violations.push(format!("D[{w}] released {key}, never quarantined"));
                return;
            }
        }
        self.return_d_blocks(key);
    }

    /// D's blocks back to its pool once every worker reported and none holds them quarantined.
    fn return_d_blocks(&mut self, key: Key) {
        let Some(l) = self.legs.get_mut(&key) else { return };
        if !l.d_done || l.d_held > 0 || l.d_returned {
            return;
        }
        l.d_returned = true;
        let blocks = l.d_blocks.clone().unwrap_or_default();
        self.d_pool.give(&blocks, &mem(&self.d), "D's outcome");
        self.close_if_done(key);
    }

    fn on_x(&mut self, key: Key, out: DOut) {
        let Some(l) = self.legs.get_mut(&key).filter(|l| l.x_blocks.is_some() && l.x_out.is_none()) else {
            self.violations.push(format!("the intruder reported {out:?} for {key} twice or never given"));
            return;
        };
        l.x_out = Some(out);
        let blocks = l.x_blocks.clone().unwrap_or_default();
        if out == DOut::Received {
            // Another engine's KV delivered to the intruder: every block of it is a breach.
            self.intruder_received += blocks.len() as u64;
        }
        if let Some(pool) = self.x_pool.as_mut() {
            pool.give(&blocks, &mem(&self.x), "intruder's outcome");
        }
    }

    fn close_if_done(&mut self, key: Key) {
        let l = &self.legs[&key];
        if (l.p_blocks.is_none() || l.p_done) && (l.d_blocks.is_none() || l.d_returned) {
            self.open.remove(&key);
        }
    }

    /// Waits for the transports to go idle, checks every free block's canary, and reports.
    pub fn finish(mut self, name: &str) -> ScenarioReport {
        let idle_by = Instant::now() + self.params.max_delay + Duration::from_secs(5);
        while Instant::now() < idle_by {
            let busy = self.p.iter().chain(&self.d).chain(&self.x).any(|n| n.transport.open_transfers() > 0);
            self.poll();
            if !busy {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        // Delayed jobs of ended requests (loopback runs them at their time even when no handle waits).
        std::thread::sleep(Duration::from_millis(100) + self.params.max_delay.min(Duration::from_secs(2)));
        self.poll();
        self.p_pool.sweep(&mem(&self.p));
        self.d_pool.sweep(&mem(&self.d));
        if let Some(x) = self.x_pool.as_mut() {
            x.sweep(&mem(&self.x));
        }
        // Requests that ended in time but whose blocks a quarantine still holds: neither hung nor
        // leaked (the engine releases them within its bound), counted as quarantined.
        let held: Vec<Key> =
            self.open.iter().copied().filter(|k| self.legs[k].d_done && self.legs[k].d_held > 0).collect();
        let held_blocks: u64 = held.iter().map(|k| self.legs[k].d_blocks.as_ref().map_or(0, Vec::len) as u64).sum();
        for k in &held {
            self.open.remove(k);
        }
        self.quarantined_max = self.quarantined_max.max(held_blocks);
        let hung = self.open.len() as u64 + self.late;
        let leaked = (self.p_pool.outstanding() + self.d_pool.outstanding()).saturating_sub(held_blocks)
            + self.x_pool.as_ref().map_or(0, Scribbler::outstanding);
        let corrupt = self.p_pool.corrupt()
            + self.d_pool.corrupt()
            + self.x_pool.as_ref().map_or(0, Scribbler::corrupt)
            + self.corrupt_received
            + self.intruder_received;
        let mut notes: Vec<String> = self.p_pool.notes().chain(self.d_pool.notes()).cloned().collect();
        if let Some(x) = &self.x_pool {
            notes.extend(x.notes().cloned());
        }
        let bad = self.p_pool.bad_releases() + self.d_pool.bad_releases();
        for k in self.open.iter().take(4) {
            let l = &self.legs[k];
            notes.push(format!("{k} has no outcome: P {:?}, D {:?}", l.p_out, l.d_out));
        }
        if self.intruder_received > 0 {
            notes.push(format!("the intruder received {} blocks of D's KV", self.intruder_received));
        }
        if !self.waits_given_up.is_empty() {
            let n = self.waits_given_up.len();
            notes.push(format!("{n} waits gave up after 5 s, e.g. {:?}", &self.waits_given_up[..n.min(3)]));
        }
        notes.extend(self.violations.iter().take(8).cloned());
        notes.extend(self.reasons.iter().map(|r| format!("D failed, e.g.: {r}")));
        ScenarioReport {
            name: name.to_owned(),
            requests: self.requests,
            corrupt_blocks: corrupt,
            leaked_blocks: leaked,
            hung,
            quarantined_max: self.quarantined_max,
            received: self.received,
            failed: self.failed,
            violations: self.violations.len() as u64 + bad,
            seconds: self.started.elapsed().as_secs_f64(),
            notes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Healthy requests all arrive, every block comes back, nothing is corrupt; a byte written into a
    /// free D block afterwards (a late WRITE) is then counted by the final sweep.
    #[test]
    fn healthy_traffic_is_clean_and_a_late_write_is_caught() {
        let mut rig = Rig::new(Params::new(Mode::Push, 1, 1));
        let scripts =
            (0..40u64).map(|i| Script::new("ok", 1 + i * 5, vec![Step::DAlloc(1), Step::PFinish(1)])).collect();
        rig.play(scripts, Duration::from_secs(60));
        assert_eq!((rig.received, rig.failed, rig.open.len()), (40, 0, 0), "{:?}", rig.violations);
        // Block 7 is free now (every request ended); a late transfer writes into it.
        pattern::fill(&rig.d[0].layout, &rig.d[0].buffers, &[vec![7]], 3, 99).expect("late write");
        let r = rig.finish("t");
        assert_eq!((r.requests, r.leaked_blocks, r.hung, r.violations), (40, 0, 0, 0), "{r:?}");
        assert_eq!(r.corrupt_blocks, 1, "{r:?}");
    }
}
