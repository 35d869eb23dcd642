//! The process scenarios of the fault suite: P and D as two `kvpush demo-worker` processes over real
//! NIXL (UCX), the side channel between them authenticated with a secret made for the run, as
//! `kvpush demo --transport nixl --processes 2` runs them.
//!
//! Read [`Traffic`]: it keeps `concurrency` requests in flight (D registers first, so P's WRITE
//! starts the moment its prefill ends), tracks both legs of each and, at the end, asks both
//! children for their block pools. The P child overwrites a request's blocks the moment its engine
//! releases them (`--scribble`), so a WRITE that still reads them delivers other bytes. The D child
//! checks every byte of a received request before it frees the blocks, and its pool hands out the
//! lowest free ids first, so a WRITE of an older request that lands in a reused block after D freed
//! it corrupts the next request there and is caught by that request's check.
//! Corrupt blocks are the blocks of requests received wrong; leaked blocks are blocks missing from a
//! child's pool at the end; hung requests are legs without an outcome within the outcome limit
//! (the legs a killed process held died with it and owe nothing).
//!
//! The scenarios: [`kill9_d_restart`] kills D with `SIGKILL` while WRITEs are in flight and starts a
//! new D under the same engine id; [`sigstop_p`] stops P past D's peer timeout and continues it;
//! [`pull_expiry_sigstop_d`] (pull) stops D past P's read timeout, so that P's grants expire while
//! D's READs are posted or about to be.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvpush::proto::msg::blocks_for;
use kvpush::proto::{Key, Mode};

use super::{Options, ScenarioReport};
use crate::demo::driver::Side;
use crate::demo::procs::{self, Command, Event, Incoming, Options as ProcsOptions, Pair, ProcsError, Role, WorkerSpec};
use crate::demo::{BlockLists, DemoError, Topology};
use crate::rng::Rng;

/// How long a leg may wait for its outcome (the children's timeouts below, plus a margin).
const OUTCOME_LIMIT: Duration = Duration::from_secs(20);

/// The children's flags: short peer timeout and heartbeats, leases and timeouts well under the
/// outcome limit, and P's Scribbler (its sources overwritten the moment they are released).
fn tweak(s: &mut WorkerSpec) {
    s.lease_ms = 5_000;
    s.timeout_ms = 5_000;
    s.heartbeat_ms = 200;
    s.peer_timeout_ms = 1_000;
    s.handshake_timeout_ms = 5_000;
    s.scribble = true;
}

/// The pull scenario's children: P's grants expire after 150 ms, and the peer timeout (3 s) stays
/// well above how long D is stopped, so that D is late, not lost.
fn tweak_pull(s: &mut WorkerSpec) {
    tweak(s);
    s.pull_read_timeout_ms = 150;
    s.peer_timeout_ms = 3_000;
}

fn topology() -> Topology {
    Topology { layers: 4, num_blocks: 2048, ..Topology::default() }
}

/// One request as the traffic tracks it.
struct Live {
    key: Key,
    seed: u64,
    tokens: u64,
    p_done: bool,
    d_done: bool,
    /// Given to a D process that was killed: its D leg died with it.
    d_gone: bool,
    at: Instant,
}

/// The pair, its requests and what they came to.
struct Traffic {
    pair: Pair,
    mode: Mode,
    /// Pull: P's blocks of requests whose prefill ended, for D to read (sent by [`Traffic::pump`]).
    to_read: Vec<(u64, BlockLists)>,
    t: Topology,
    rng: Rng,
    next: u64,
    live: HashMap<u64, Live>,
    p_ports: Vec<u16>,
    secret: String,
    requests: u64,
    received: u64,
    failed: u64,
    corrupt: u64,
    late: u64,
    notes: Vec<String>,
    /// A child killed on purpose: its exit is expected.
    killed: Option<Role>,
}

impl Traffic {
    fn start(opts: &Options, mode: Mode, tweak: &dyn Fn(&mut WorkerSpec)) -> Result<Traffic, ProcsError> {
        if !kvpush::transport::nixl::available() {
            return Err(DemoError::Config("NIXL is not available: run `. scripts/nixl.sh` first".into()).into());
        }
        let t = topology();
        let popts = ProcsOptions::bare(opts.exe.clone(), opts.log.clone());
        let (pair, secret, p_ports, _) = procs::start_with(&t, mode, &popts, tweak, None)?;
        Ok(Traffic {
            pair,
            mode,
            to_read: Vec::new(),
            t,
            rng: Rng::new(0x9f0c),
            next: 0,
            live: HashMap::new(),
            p_ports,
            secret,
            requests: 0,
            received: 0,
            failed: 0,
            corrupt: 0,
            late: 0,
            notes: Vec::new(),
            killed: None,
        })
    }

    /// Sends one more request. Push: D registers, then P prefills (no simulated delay). Pull: P
    /// prefills; D reads once P's blocks are known ([`Event::Ready`]).
    fn admit(&mut self) -> Result<(), ProcsError> {
        let req = self.next;
        self.next += 1;
        let tokens = self.rng.between(16, 512);
        let key = Key::new(u128::from(self.rng.next()) << 64 | u128::from(req), 1);
        let seed = self.rng.next() >> 1;
        if self.mode == Mode::Push {
            let decode = Command::Decode { req, key, tokens, seed, remote_blocks: None, hold_verify: false };
            self.pair.send(Role::Decode, &decode)?;
        }
        self.pair.send(Role::Prefill, &Command::Prefill { req, key, tokens, seed, delay_ns: Some(0) })?;
        self.live
            .insert(req, Live { key, seed, tokens, p_done: false, d_done: false, d_gone: false, at: Instant::now() });
        self.requests += 1;
        Ok(())
    }

    /// Handles the children's lines, keeping `concurrency` requests in flight until `total` were
    /// admitted (then it returns at once), or for `dur` when `total` is 0.
    fn pump(&mut self, dur: Duration, concurrency: usize, total: u64) -> Result<(), ProcsError> {
        let until = Instant::now() + dur;
        loop {
            while self.next < total && self.open() < concurrency {
                self.admit()?;
            }
            for (req, blocks) in std::mem::take(&mut self.to_read) {
                let Some(l) = self.live.get(&req) else { continue };
                let (key, tokens, seed) = (l.key, l.tokens, l.seed);
                let decode =
                    Command::Decode { req, key, tokens, seed, remote_blocks: Some(blocks), hold_verify: false };
                self.pair.send(Role::Decode, &decode)?;
            }
            if total > 0 && self.next >= total {
                // All admitted: the caller acts now, with the last ones in flight.
                return Ok(());
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(());
            }
            let Some((role, inc)) = self.pair.recv(left.min(Duration::from_millis(50))) else { continue };
            match inc {
                Incoming::Reply(ev) => self.on_event(role, ev),
                Incoming::Closed if self.killed == Some(role) => self.killed = None,
                Incoming::Closed => return Err(self.pair.fail(role, "exited unexpectedly".into())),
                Incoming::Garbled(g) => return Err(self.pair.fail(role, format!("garbled reply {g}"))),
            }
        }
    }

    /// Requests with a leg still owed.
    fn open(&self) -> usize {
        self.live.values().filter(|l| !(l.p_done && (l.d_done || l.d_gone))).count()
    }

    fn on_event(&mut self, role: Role, ev: Event) {
        let req = match &ev {
            Event::Sent { req, .. } | Event::Received { req, .. } | Event::Failed { req, .. } => *req,
            Event::Ready { req, blocks, .. } if self.mode == Mode::Pull => {
                self.to_read.push((*req, blocks.clone()));
                return;
            }
            Event::Ready { .. } | Event::Registered { .. } => return,
            Event::Error { message } => {
                // A command refused by a child (a registration to a lost peer): the request's leg ends
                // there; the child says which in its own outcome lines.
                if self.notes.len() < 8 {
                    self.notes.push(format!("{role}: {message}"));
                }
                return;
            }
            _ => return,
        };
        let Some(l) = self.live.get_mut(&req) else {
            self.notes.push(format!("{role}: outcome for unknown request {req}"));
            return;
        };
        let late = l.at.elapsed() > OUTCOME_LIMIT;
        match ev {
            Event::Sent { .. } => l.p_done = true,
            Event::Received { ok, detail, .. } => {
                l.d_done = true;
                self.received += 1;
                if !ok {
                    // Every block of the request counts (the child says what differed, not where).
                    self.corrupt += blocks_for(l.tokens, self.t.d_block);
                    if self.notes.len() < 8 {
                        self.notes.push(format!("request {req} received wrong: {}", detail.unwrap_or_default()));
                    }
                }
            }
            Event::Failed { .. } => {
                l.d_done = true;
                self.failed += 1;
            }
            _ => {}
        }
        if late {
            self.late += 1;
        }
    }

    /// Waits until every request has its outcomes, up to `limit`.
    fn drain(&mut self, limit: Duration) -> Result<(), ProcsError> {
        let deadline = Instant::now() + limit;
        while self.open() > 0 && Instant::now() < deadline {
            self.pump(Duration::from_millis(100), 0, 0)?;
        }
        Ok(())
    }

    /// `(free, total, quarantined)` of a child's pool: quarantined blocks are held by the child for
    /// requests its engine quarantined (`Finished::Quarantined`), neither free nor leaked.
    fn pool(&mut self, role: Role) -> Result<(usize, usize, usize), ProcsError> {
        self.pair.send(role, &Command::Pool)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            match self.pair.recv(Duration::from_millis(100)) {
                Some((r, Incoming::Reply(Event::Pool { free, total, quarantined }))) if r == role => {
                    return Ok((free, total, quarantined))
                }
                Some((r, Incoming::Reply(ev))) => self.on_event(r, ev),
                Some(_) | None => {}
            }
        }
        Err(self.pair.fail(role, "no pool answer".into()))
    }

    /// The children's block pools, the hung legs, and the line.
    fn finish(mut self, started: Instant) -> Result<ScenarioReport, ProcsError> {
        self.drain(OUTCOME_LIMIT)?;
        let (mut leaked, mut quarantined) = (0u64, 0u64);
        for role in [Role::Prefill, Role::Decode] {
            let (free, total, held) = self.pool(role)?;
            leaked += total.saturating_sub(free + held) as u64;
            quarantined += held as u64;
        }
        let hung = self.open() as u64 + self.late;
        for (req, l) in self.live.iter().filter(|(_, l)| !(l.p_done && (l.d_done || l.d_gone))).take(4) {
            self.notes.push(format!("request {req} has no outcome: P {} D {}", l.p_done, l.d_done));
        }
        self.pair.close();
        Ok(ScenarioReport {
            name: String::new(),
            requests: self.requests,
            corrupt_blocks: self.corrupt,
            leaked_blocks: leaked,
            hung,
            quarantined_max: quarantined,
            received: self.received,
            failed: self.failed,
            violations: 0,
            seconds: started.elapsed().as_secs_f64(),
            notes: self.notes,
        })
    }

    /// Has D say it lost P (its side-channel counter), up to `limit`.
    fn wait_d_lost_peer(&mut self, limit: Duration) -> Result<bool, ProcsError> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            self.pair.send(Role::Decode, &Command::Stats)?;
            let until = Instant::now() + Duration::from_millis(200);
            while Instant::now() < until {
                match self.pair.recv(Duration::from_millis(50)) {
                    Some((Role::Decode, Incoming::Reply(Event::Stats { side, .. }))) => {
                        if side.peers_lost > 0 {
                            return Ok(true);
                        }
                    }
                    Some((r, Incoming::Reply(ev))) => self.on_event(r, ev),
                    Some(_) | None => {}
                }
            }
        }
        Ok(false)
    }

    /// D dials P again (after a loss); true once its handshakes are done.
    fn reconnect_d(&mut self) -> Result<bool, ProcsError> {
        let deadline = Instant::now() + Duration::from_secs(30);
        self.pair.send(Role::Decode, &Command::Connect { ports: self.p_ports.clone() })?;
        while Instant::now() < deadline {
            match self.pair.recv(Duration::from_millis(100)) {
                Some((Role::Decode, Incoming::Reply(Event::Connected { .. }))) => return Ok(true),
                Some((Role::Decode, Incoming::Reply(Event::Error { message }))) => {
                    self.notes.push(format!("reconnect: {message}"));
                    return Ok(false);
                }
                Some((r, Incoming::Reply(ev))) => self.on_event(r, ev),
                Some((r, Incoming::Closed)) => return Err(self.pair.fail(r, "exited while reconnecting".into())),
                Some(_) | None => {}
            }
        }
        Ok(false)
    }
}

/// Plays the requests of the setting in `rounds + 1` parts with `fault` between two parts (given
/// the traffic and the round), then waits for every outcome and reports.
fn in_rounds(
    opts: &Options,
    mode: Mode,
    tweak: &dyn Fn(&mut WorkerSpec),
    mut fault: impl FnMut(&mut Traffic, u64) -> Result<(), ProcsError>,
) -> Result<ScenarioReport, ProcsError> {
    let started = Instant::now();
    let mut tr = Traffic::start(opts, mode, tweak)?;
    let (n, rounds) = if opts.ci { (60u64, 1) } else { (400, 3) };
    let per = n / (rounds + 1);
    for round in 0..rounds {
        // Returns once the part is admitted, its last requests in flight.
        tr.pump(Duration::from_secs(30), 24, per * (round + 1))?;
        fault(&mut tr, round)?;
    }
    tr.pump(Duration::from_secs(60), 24, n)?;
    tr.finish(started)
}

/// Kill -9 of D with WRITEs in flight, then a new D under the same engine id. P must release every
/// request of the dead D (no leak, no hang) and serve the new one, whose every byte is checked: a
/// WRITE P had addressed to the dead process must never land in the new one's blocks.
pub fn kill9_d_restart(opts: &Options) -> Result<ScenarioReport, ProcsError> {
    in_rounds(opts, Mode::Push, &tweak, |tr, round| {
        tr.killed = Some(Role::Decode);
        tr.pair.d.kill();
        for l in tr.live.values_mut().filter(|l| !l.d_done) {
            l.d_gone = true;
        }
        let mut spec = WorkerSpec::new(Role::Decode, Mode::Push, &tr.t);
        tweak(&mut spec);
        let env = [(kvpush::engine::side::SECRET_ENV.to_owned(), tr.secret.clone())];
        tr.pair.respawn(&opts.exe, &spec, &env, opts.log.clone())?;
        // Its hello, then the handshake with P under the same engine id.
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            match tr.pair.recv(Duration::from_millis(100)) {
                Some((Role::Decode, Incoming::Reply(Event::Hello { .. }))) => break,
                Some((Role::Decode, Incoming::Closed)) if tr.killed.is_some() => tr.killed = None,
                Some((r, Incoming::Reply(ev))) => tr.on_event(r, ev),
                Some((r, Incoming::Closed)) => return Err(tr.pair.fail(r, "exited during the restart".into())),
                Some(_) => {}
                None if Instant::now() > deadline => {
                    return Err(tr.pair.fail(Role::Decode, "the new D did not start".into()));
                }
                None => {}
            }
        }
        if !tr.reconnect_d()? {
            tr.notes.push(format!("round {round}: the new D could not handshake with P"));
        }
        Ok(())
    })
}

/// Runs `f` with the child process `pid` stopped: SIGSTOP before, SIGCONT after, whatever `f`
/// returns. `pid` is one of the pair's children ([`procs::WorkerProc::pid`]), spawned by this
/// process and not reaped while the pair lives.
fn while_stopped<T>(pid: u32, f: impl FnOnce() -> T) -> T {
    let pid = pid as libc::pid_t;
    // SAFETY: kill(2) takes no memory of ours; `pid` is a child this process spawned and has not
    // reaped (this function's contract), so the signal cannot reach a process that reused the id.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let out = f();
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    out
}

/// SIGSTOP of P with requests in flight, held past D's peer timeout (D fails P's requests and
/// reuses their blocks for new ones), then SIGCONT: whatever P had posted must not land in the
/// reused blocks. D then dials P again and the rest of the requests are served.
pub fn sigstop_p(opts: &Options) -> Result<ScenarioReport, ProcsError> {
    in_rounds(opts, Mode::Push, &tweak, |tr, round| {
        let (lost, served) = while_stopped(tr.pair.p.pid(), || {
            let lost = tr.wait_d_lost_peer(Duration::from_secs(10));
            // D keeps serving its side while P is stopped: new registrations fail at once and their
            // blocks (and those of the failed requests) are reused.
            let more = tr.next + 24;
            (lost, tr.pump(Duration::from_millis(500), 48, more))
        });
        if !lost? {
            tr.notes.push(format!("round {round}: D never reported P lost"));
        }
        served?;
        tr.pump(Duration::from_secs(2), 0, 0)?;
        if !tr.reconnect_d()? {
            tr.notes.push(format!("round {round}: D could not handshake with P again"));
        }
        Ok(())
    })
}

/// Issue 16, "pull grant expiry with a READ in flight": pull, P's read timeout 150 ms, and D stopped
/// (SIGSTOP) for 600 ms with requests in flight, three times. P's grants expire while D's READs are
/// posted (held: a stopped process moves no data) or about to be; P tells D, but must not release
/// its sources (which its Scribbler overwrites at once) until D's READ ended: D continues, cancels
/// or completes its READs, and every request D reports received is checked byte by byte.
pub fn pull_expiry_sigstop_d(opts: &Options) -> Result<ScenarioReport, ProcsError> {
    in_rounds(opts, Mode::Pull, &tweak_pull, |tr, _round| {
        while_stopped(tr.pair.d.pid(), || std::thread::sleep(Duration::from_millis(600)));
        tr.pump(Duration::from_secs(1), 0, 0)
    })
}
