//! `scripts/hostile.sh` (`kvpush hostile`): a P/D pair as two processes over real NIXL, with a secret
//! set, serving traffic whose every byte is verified, attacked from separate processes on loopback.
//!
//! Read [`run`] first, then [`attack`] (what each attacker process does on the wire). Every attack is a
//! real attempt against the real side-channel ports (or, for notifications and staged requests, through
//! a NIXL agent of the attacker's own that never handshook), made while the pair serves requests. What
//! an attack achieved is measured on the victims, never taken from the attacker's word: the counters
//! of both engines before and after the attack (handshakes, registrations, aborts, receptions, staged
//! transfers, failure notifications), the outcome of **bait** requests (registered by D, never prefilled
//! by P: any outcome for one while the pair runs is an attacker's doing), the real requests that failed
//! or arrived wrong, and the resident memory and thread count of both processes from `/proc`.
//!
//! Three attacks need a peer that holds the secret as a victim: the relay (man in the middle) and its
//! replayed and reflected frames sit between P and a third engine, `victim`, that dials P through the
//! attacker's relay; the restart is that third engine coming back under the same engine id while its
//! frozen previous process still looks alive. The pair's own connection is never touched, so the real
//! traffic measures what the attacks cost it.
//!
//! It must never report an attack as refused that it did not attempt: `attempts` is counted by the
//! attacker, `accepted` by the victims.

pub mod attack;

use std::collections::HashMap;
use std::io::BufRead;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError};
use serde::{Deserialize, Serialize};

use crate::child::LogFn;
use crate::demo::driver::Side;
use crate::demo::procs::{
    self, Command, EngineCounters, Event, Incoming, Options as ProcsOptions, Pair, ProcsError, Role, SideCounters,
    WorkerProc, WorkerSpec,
};
use crate::demo::{DemoError, StagingFlag, Topology};
use crate::rng::Rng;
use kvpush::proto::{Key, Mode};

/// Targets: what an attack may cost at most.
pub const MAX_RSS_GROWTH_MIB: f64 = 64.0;
/// Threads per process at most.
pub const MAX_THREADS: u64 = 64;

/// Real requests in flight during an attack.
const CONCURRENCY: usize = 8;
/// Bait requests registered on D at the start.
const BAIT: usize = 8;
/// First request index of bait requests (D) and of the restart's prefills (P).
const BAIT_BASE: u64 = 1 << 40;
/// Engine id of the third engine (relay victim, restarted peer).
pub const VICTIM: &str = "victim";

/// Every attack, in the order they run.
pub const ATTACKS: [&str; 13] = [
    "relay",
    "wrong_secret",
    "replayed_frames",
    "reflected_frames",
    "trickled_header",
    "connection_flood",
    "forged_registrations",
    "forged_aborts",
    "forged_completions",
    "forged_notifications",
    "forged_staged_requests",
    "oversized_registrations",
    "restart_same_engine_id",
];

/// How the probe runs.
#[derive(Clone)]
pub struct Options {
    /// The `kvpush` executable (children are `kvpush demo-worker` and `kvpush hostile-attack`).
    pub exe: PathBuf,
    /// Connections of the flood.
    pub connections: usize,
    /// Attempts of the attacks that repeat a handshake-sized exchange.
    pub rounds: usize,
    /// Where the children's stderr lines go (default: dropped, only kept for error messages).
    pub log: Option<LogFn>,
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options")
            .field("exe", &self.exe)
            .field("connections", &self.connections)
            .field("rounds", &self.rounds)
            .finish_non_exhaustive()
    }
}

/// One attack's line of the report.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AttackReport {
    /// The attack.
    pub name: String,
    /// Attack frames, connections or messages sent (counted by the attacker).
    pub attempts: u64,
    /// Of those, what the victims acted on (their counters and bait outcomes).
    pub accepted: u64,
    /// Real requests that failed or arrived wrong while the attack ran.
    pub served_failed: u64,
    /// Real requests served (verified) while the attack ran.
    pub served: u64,
    /// Largest growth of P's or D's resident memory during the attack (MiB).
    pub rss_growth_mib: f64,
    /// Most threads of P or D during the attack.
    pub threads_max: u64,
    /// What the victims' counters say, for a human.
    pub detail: String,
}

/// Sums over all attacks.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Totals {
    /// Attempts.
    pub attempts: u64,
    /// Accepted.
    pub accepted: u64,
    /// Real requests failed.
    pub served_failed: u64,
}

/// The JSON report.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Report {
    /// One line per attack.
    pub attacks: Vec<AttackReport>,
    /// Sums.
    pub totals: Totals,
}

impl Report {
    /// Targets missed, one line each (empty: all met).
    pub fn missed(&self) -> Vec<String> {
        let mut out = Vec::new();
        for a in &self.attacks {
            if a.attempts == 0 {
                out.push(format!("{}: no attempt was made", a.name));
            }
            if a.accepted > 0 {
                out.push(format!("{}: {} accepted ({})", a.name, a.accepted, a.detail));
            }
            if a.served_failed > 0 {
                out.push(format!("{}: {} real requests failed", a.name, a.served_failed));
            }
            if a.rss_growth_mib > MAX_RSS_GROWTH_MIB {
                out.push(format!("{}: RSS grew {:.1} MiB (> {MAX_RSS_GROWTH_MIB})", a.name, a.rss_growth_mib));
            }
            if a.threads_max > MAX_THREADS {
                out.push(format!("{}: {} threads (> {MAX_THREADS})", a.name, a.threads_max));
            }
        }
        out
    }
}

/// Both engines' counters at one moment.
#[derive(Clone, Copy, Debug, Default)]
struct Snapshot {
    registrations: u64,
    side: SideCounters,
    engine: EngineCounters,
}

/// What happened to the real traffic and the baits between two snapshots.
#[derive(Debug, Default)]
struct Window {
    served: u64,
    failed: u64,
    /// Outcomes of bait requests on D (none is legitimate): received, failed.
    bait_received: u64,
    bait_failed: u64,
    /// What the attacker saw.
    note: String,
    /// P's restart prefills that P wrote (into a process that never registered them).
    restart_written: u64,
    /// Handshakes and registrations the attack's legitimate victim made.
    legit_handshakes: u64,
    legit_registrations: u64,
}

/// A real request in flight.
struct Live {
    sent: bool,
    d_done: bool,
    failed: bool,
}

/// The pair, its real traffic and its baits.
struct Probe {
    pair: Pair,
    rng: Rng,
    next: u64,
    live: HashMap<u64, Live>,
    window: Window,
    p_ports: Vec<u16>,
    d_ports: Vec<u16>,
    d_agents: Vec<(String, String)>,
    baits: Vec<Key>,
    secret: String,
    pids: [u32; 2],
}

/// Runs every attack; `progress` is called with each attack's line as it ends.
pub fn run(opts: &Options, progress: &dyn Fn(&AttackReport)) -> Result<Report, ProcsError> {
    if !kvpush::transport::nixl::available() {
        return Err(DemoError::Config("NIXL is not available: run `. scripts/nixl.sh` first".into()).into());
    }
    let t = Topology { layers: 4, num_blocks: 1024, ..Topology::default() };
    let popts = ProcsOptions::bare(opts.exe.clone(), opts.log.clone());
    let (pair, secret, p_ports, d_ports) = procs::start_with(&t, Mode::Push, &popts, &tweak, None)?;
    let pids = [pair.p.pid(), pair.d.pid()];
    let mut probe = Probe {
        pair,
        rng: Rng::new(0x6b76_6873),
        next: 0,
        live: HashMap::new(),
        window: Window::default(),
        p_ports,
        d_ports,
        d_agents: Vec::new(),
        baits: Vec::new(),
        secret,
        pids,
    };
    probe.pair.send(Role::Decode, &Command::Metadata)?;
    probe.d_agents = probe.pair.expect(Role::Decode, "metadata", Duration::from_secs(30), |ev| match ev {
        Event::Metadata { agents } => Some(agents),
        _ => None,
    })?;
    let mut report = Report::default();
    for name in ATTACKS {
        let line = probe.attack(name, opts, &t)?;
        progress(&line);
        report.attacks.push(line);
    }
    probe.pair.close();
    for a in &report.attacks {
        report.totals.attempts += a.attempts;
        report.totals.accepted += a.accepted;
        report.totals.served_failed += a.served_failed;
    }
    Ok(report)
}

/// The flags of every engine of the probe: baits and the restart's registrations must outlive the run
/// (no lease or timeout ends them), and staging is on (small slots) so that D's staging receiver is
/// there to be attacked.
fn tweak(s: &mut WorkerSpec) {
    s.lease_ms = 600_000;
    s.timeout_ms = 600_000;
    s.staging = StagingFlag::On;
    s.staging_slots = 2;
    s.staging_slot_kib = 1024;
}

/// Samples `VmRSS` and `Threads` of the pair's processes every 20 ms until stopped.
struct Sampler {
    stop: Arc<AtomicBool>,
    result: Arc<Mutex<(f64, u64)>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// `(VmRSS in MiB, Threads)` of a process.
fn proc_status(pid: u32) -> Option<(f64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
    };
    Some((field("VmRSS:")? as f64 / 1024.0, field("Threads:")?))
}

impl Sampler {
    fn start(pids: [u32; 2]) -> Sampler {
        let base: Vec<f64> = pids.iter().map(|&p| proc_status(p).map_or(0.0, |s| s.0)).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let result = Arc::new(Mutex::new((0.0, 0)));
        let (s, r) = (Arc::clone(&stop), Arc::clone(&result));
        let thread = std::thread::Builder::new()
            .name("kvpush-hostile-sampler".into())
            .spawn(move || loop {
                for (i, &pid) in pids.iter().enumerate() {
                    if let Some((rss, threads)) = proc_status(pid) {
                        let mut g = r.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                        g.0 = f64::max(g.0, rss - base[i]);
                        g.1 = g.1.max(threads);
                    }
                }
                if s.load(Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            })
            .ok();
        Sampler { stop, result, thread }
    }

    /// `(largest RSS growth in MiB, most threads)`.
    fn finish(mut self) -> (f64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        *self.result.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// An attacker process (`kvpush hostile-attack`): its JSON lines arrive on a channel.
struct Attacker {
    child: std::process::Child,
    lines: Receiver<attack::Line>,
}

impl Attacker {
    fn spawn(exe: &std::path::Path, args: &attack::AttackArgs, log: Option<LogFn>) -> Result<Attacker, ProcsError> {
        let mut cmd = std::process::Command::new(exe);
        cmd.arg("hostile-attack").args(args.to_args()).stdin(Stdio::null()).stdout(Stdio::piped());
        cmd.stderr(Stdio::piped());
        let mut child = cmd.spawn().map_err(|source| ProcsError::Spawn {
            role: Role::Decode,
            exe: exe.display().to_string(),
            source,
        })?;
        let (tx, lines) = unbounded();
        if let Some(out) = child.stdout.take() {
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    match serde_json::from_str::<attack::Line>(&line) {
                        Ok(l) => {
                            if tx.send(l).is_err() {
                                return;
                            }
                        }
                        Err(_) => eprintln!("[attacker stdout] {line}"),
                    }
                }
            });
        }
        if let Some(err) = child.stderr.take() {
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(err).lines() {
                    let Ok(line) = line else { break };
                    if let Some(log) = &log {
                        log(&format!("[attacker] {line}"));
                    }
                }
            });
        }
        Ok(Attacker { child, lines })
    }
}

impl Drop for Attacker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A third engine (`victim`) beside the pair, with its own event stream.
struct Victim {
    proc: WorkerProc,
    rx: Receiver<(Role, Incoming)>,
}

impl Victim {
    /// Starts a consumer engine `engine_id` holding `secret`.
    fn spawn(
        exe: &std::path::Path,
        t: &Topology,
        engine_id: &str,
        secret: &str,
        log: Option<LogFn>,
    ) -> Result<Victim, ProcsError> {
        let (tx, rx) = unbounded();
        let mut spec = WorkerSpec::new(Role::Decode, Mode::Push, t);
        spec.engine_id = Some(engine_id.into());
        tweak(&mut spec);
        let env = [(kvpush::engine::side::SECRET_ENV.to_owned(), secret.to_owned())];
        let proc = WorkerProc::spawn(exe, &spec, &env, tx, Some(log.unwrap_or_else(|| Arc::new(|_: &str| {}))))
            .map_err(|source| ProcsError::Spawn { role: Role::Decode, exe: exe.display().to_string(), source })?;
        let mut v = Victim { proc, rx };
        v.wait(Duration::from_secs(120), "hello", |ev| matches!(ev, Event::Hello { .. }))?;
        Ok(v)
    }

    fn fail(&self, message: String) -> ProcsError {
        let tail = self.proc.stderr_tail();
        let n = tail.len().saturating_sub(10);
        ProcsError::Worker { role: Role::Decode, message: format!("victim: {message}"), tail: tail[n..].join("\n") }
    }

    /// Waits for an event `f` accepts (others are dropped); `Err` events are returned as `Ok(false)`.
    fn wait(&mut self, limit: Duration, what: &str, f: impl Fn(&Event) -> bool) -> Result<bool, ProcsError> {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok((_, Incoming::Reply(Event::Error { .. }))) => return Ok(false),
                Ok((_, Incoming::Reply(ev))) if f(&ev) => return Ok(true),
                Ok((_, Incoming::Reply(_))) => {}
                Ok((_, Incoming::Garbled(g))) => return Err(self.fail(format!("garbled reply {g}"))),
                Ok((_, Incoming::Closed)) => return Err(self.fail(format!("exited while waiting for {what}"))),
                Err(RecvTimeoutError::Timeout) => return Err(self.fail(format!("no {what} within {limit:?}"))),
                Err(RecvTimeoutError::Disconnected) => return Err(self.fail("event stream closed".into())),
            }
        }
    }

    fn send(&mut self, cmd: &Command) -> Result<(), ProcsError> {
        self.proc.send(cmd).map_err(|e| self.fail(format!("cannot send a command: {e}")))
    }

    /// Dials `port` (P, or the relay); whether the handshake succeeded.
    fn connect(&mut self, port: u16) -> Result<bool, ProcsError> {
        self.send(&Command::Connect { ports: vec![port] })?;
        self.wait(Duration::from_secs(30), "connected", |ev| matches!(ev, Event::Connected { .. }))
    }

    /// `(handshakes, registrations sent)` of the victim so far.
    fn counts(&mut self) -> Result<(u64, u64), ProcsError> {
        self.send(&Command::Stats)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok((_, Incoming::Reply(Event::Stats { registrations, side, .. }))) => {
                    return Ok((side.handshakes, registrations))
                }
                Ok((_, Incoming::Reply(_))) => {}
                Ok((_, other)) => return Err(self.fail(format!("while waiting for stats: {other:?}"))),
                Err(_) => return Err(self.fail("no stats within 30 s".into())),
            }
        }
    }

    /// Registers a bait request (index `req`) with P; whether the engine took it.
    fn register(&mut self, req: u64, key: Key) -> Result<bool, ProcsError> {
        let cmd = Command::Decode { req, key, tokens: 64, seed: req, remote_blocks: None, hold_verify: false };
        self.send(&cmd)?;
        self.wait(Duration::from_secs(30), "registered", |ev| matches!(ev, Event::Registered { .. }))
    }
}

impl Probe {
    fn key(&mut self) -> Key {
        Key::new(u128::from(self.rng.next()) << 64 | u128::from(self.rng.next()), 1)
    }

    /// Registers fresh bait requests on D (P never prefills them), replacing the previous ones.
    fn bait(&mut self) -> Result<(), ProcsError> {
        self.baits.clear();
        for _ in 0..BAIT {
            let (req, key) = (BAIT_BASE + self.next, self.key());
            self.next += 1;
            let cmd = Command::Decode { req, key, tokens: 64, seed: req, remote_blocks: None, hold_verify: false };
            self.pair.send(Role::Decode, &cmd)?;
            self.baits.push(key);
        }
        self.pump(Duration::from_millis(200))
    }

    /// Starts real requests up to the concurrency.
    fn admit(&mut self) -> Result<(), ProcsError> {
        while self.live.len() < CONCURRENCY {
            let req = self.next;
            self.next += 1;
            let key = self.key();
            let tokens = 32 + self.rng.next() % 480;
            let seed = self.rng.next();
            self.pair.send(Role::Prefill, &Command::Prefill { req, key, tokens, seed, delay_ns: Some(0) })?;
            let cmd = Command::Decode { req, key, tokens, seed, remote_blocks: None, hold_verify: false };
            self.pair.send(Role::Decode, &cmd)?;
            self.live.insert(req, Live { sent: false, d_done: false, failed: false });
        }
        Ok(())
    }

    /// Handles one event of the pair; a `Stats` event is returned to the caller.
    fn handle(&mut self, role: Role, ev: Event) -> Option<(Role, Event)> {
        let req = match &ev {
            Event::Ready { req, .. }
            | Event::Sent { req, .. }
            | Event::Received { req, .. }
            | Event::Failed { req, .. }
            | Event::Registered { req } => *req,
            _ => return Some((role, ev)),
        };
        if req >= BAIT_BASE {
            match (role, &ev) {
                (Role::Decode, Event::Received { .. }) => {
                    tracing::warn!(req, ?ev, "a bait request was received");
                    self.window.bait_received += 1;
                }
                (Role::Decode, Event::Failed { .. }) => {
                    tracing::warn!(req, ?ev, "a bait request failed");
                    self.window.bait_failed += 1;
                }
                (Role::Prefill, Event::Sent { reason, .. }) if reason == "Sent" => self.window.restart_written += 1,
                _ => {}
            }
            return None;
        }
        let r = self.live.get_mut(&req)?;
        match ev {
            Event::Sent { .. } => r.sent = true,
            Event::Received { ok, detail, .. } => {
                if !ok {
                    tracing::error!(req, detail = detail.as_deref().unwrap_or(""), "KV arrived wrong");
                }
                r.failed |= !ok;
                r.d_done = true;
            }
            Event::Failed { reason, .. } => {
                tracing::error!(req, %reason, "a real request failed");
                r.failed = true;
                r.d_done = true;
            }
            _ => {}
        }
        if r.sent && r.d_done {
            let failed = r.failed;
            self.live.remove(&req);
            if failed {
                self.window.failed += 1;
            } else {
                self.window.served += 1;
            }
        }
        None
    }

    /// Serves real traffic for `d`.
    fn pump(&mut self, d: Duration) -> Result<(), ProcsError> {
        let deadline = Instant::now() + d;
        loop {
            self.admit()?;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(());
            }
            if let Some((role, ev)) = self.pair.next(left.min(Duration::from_millis(50)))? {
                if let Some((role, ev)) = self.handle(role, ev) {
                    return Err(self.pair.fail(role, format!("unexpected event: {ev:?}")));
                }
            }
        }
    }

    /// Lets every real request in flight end (counting those that do not within 60 s as failed).
    fn drain(&mut self) -> Result<(), ProcsError> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.live.is_empty() && Instant::now() < deadline {
            if let Some((role, ev)) = self.pair.next(Duration::from_millis(50))? {
                if let Some((role, ev)) = self.handle(role, ev) {
                    return Err(self.pair.fail(role, format!("unexpected event: {ev:?}")));
                }
            }
        }
        self.window.failed += self.live.len() as u64;
        self.live.clear();
        Ok(())
    }

    /// Both engines' counters (traffic events meanwhile are handled).
    fn snapshot(&mut self) -> Result<[Snapshot; 2], ProcsError> {
        let mut out = [Snapshot::default(); 2];
        for (i, role) in [Role::Prefill, Role::Decode].into_iter().enumerate() {
            self.pair.send(role, &Command::Stats)?;
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let Some((r, ev)) = self.pair.next(deadline.saturating_duration_since(Instant::now()))? else {
                    return Err(self.pair.fail(role, "no stats within 30 s".into()));
                };
                match self.handle(r, ev) {
                    None => {}
                    Some((r, Event::Stats { registrations, side, engine, .. })) if r == role => {
                        out[i] = Snapshot { registrations, side, engine };
                        break;
                    }
                    Some((r, ev)) => return Err(self.pair.fail(r, format!("unexpected event: {ev:?}"))),
                }
            }
        }
        Ok(out)
    }

    fn attack_args(&self, name: &str, opts: &Options) -> attack::AttackArgs {
        attack::AttackArgs {
            attack: name.to_owned(),
            p_port: self.p_ports[0],
            d_port: self.d_ports[0],
            keys: self.baits.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
            d_agent: self.d_agents.first().map(|a| a.0.clone()).unwrap_or_default(),
            d_metadata: self.d_agents.first().map(|a| a.1.clone()).unwrap_or_default(),
            connections: opts.connections,
            rounds: opts.rounds,
        }
    }

    /// Runs one attack while the pair serves, and measures it on the victims.
    fn attack(&mut self, name: &str, opts: &Options, t: &Topology) -> Result<AttackReport, ProcsError> {
        self.bait()?;
        self.drain()?;
        let before = self.snapshot()?;
        self.window = Window::default();
        let sampler = Sampler::start(self.pids);
        let started = Instant::now();
        let attempts = match name {
            "wrong_secret" => self.wrong_secret(opts, t)?,
            "relay" | "replayed_frames" | "reflected_frames" => self.relayed(name, opts, t)?,
            "restart_same_engine_id" => self.restart(opts, t)?,
            _ => self.raw(name, opts)?,
        };
        // Serve a little longer: what an attack set off shows up in the traffic after it.
        self.pump(Duration::from_millis(500))?;
        self.drain()?;
        let (rss, threads) = sampler.finish();
        let after = self.snapshot()?;
        let w = std::mem::take(&mut self.window);
        let [p0, d0] = before;
        let [p1, d1] = after;
        let delta = |a: u64, b: u64| b.saturating_sub(a);
        let hs = delta(p0.side.handshakes, p1.side.handshakes) + delta(d0.side.handshakes, d1.side.handshakes);
        let forged_hs = hs.saturating_sub(w.legit_handshakes);
        let forged_regs = delta(p0.registrations, p1.registrations)
            .saturating_sub(delta(d0.registrations, d1.registrations) + w.legit_registrations);
        let aborts = delta(p0.engine.aborted, p1.engine.aborted) + delta(d0.engine.aborted, d1.engine.aborted);
        // A bait's outcome shows in D's counters too: count each act once.
        let received =
            delta(d0.engine.received, d1.engine.received).saturating_sub(w.served + w.failed + w.bait_received);
        let remote = delta(d0.engine.remote_failures, d1.engine.remote_failures).saturating_sub(w.bait_failed);
        // (Staged receptions are not counted: real requests arrive staged too. A forged staged request
        // acted on delivers its notification, a bait's completion, which the baits count. A slot D
        // grants to a forged request is granted to the agent the request claimed to be, P, which has no
        // such transfer and counts the grant as malformed: nothing else makes P's staging refuse a frame.)
        let staged = delta(d0.engine.staged_received, d1.engine.staged_received);
        let grants = delta(p0.engine.staged_malformed, p1.engine.staged_malformed);
        let baits = w.bait_received + w.bait_failed;
        let accepted = forged_hs + forged_regs + aborts + received + remote + baits + grants + w.restart_written;
        let detail = format!(
            "handshakes {hs} (legit {}), forged registrations {forged_regs}, aborts {aborts}, extra receptions \
             {received}, remote failures {remote}, staged receptions {staged} (real ones included), baits received {} failed {}, restart \
             writes {}, P saw restarts {}; P refused: auth {} timeout {} oversized {} over-limit {} malformed {}; D refused: auth {} \
             unknown-peer {} malformed {} staging-malformed {}; P got grants for forged staging requests {grants}; {:.1} s; \
             attacker: {}",
            w.legit_handshakes,
            w.bait_received,
            w.bait_failed,
            w.restart_written,
            delta(p0.side.restarts, p1.side.restarts),
            delta(p0.side.auth_failures, p1.side.auth_failures),
            delta(p0.side.timeouts, p1.side.timeouts),
            delta(p0.side.oversized, p1.side.oversized),
            delta(p0.side.over_limit, p1.side.over_limit),
            delta(p0.side.malformed, p1.side.malformed),
            delta(d0.side.auth_failures, d1.side.auth_failures),
            delta(d0.engine.unknown_peer, d1.engine.unknown_peer),
            delta(d0.engine.malformed, d1.engine.malformed),
            delta(d0.engine.staged_malformed, d1.engine.staged_malformed),
            started.elapsed().as_secs_f64(),
            w.note,
        );
        Ok(AttackReport {
            name: name.to_owned(),
            attempts,
            accepted,
            served_failed: w.failed,
            served: w.served,
            rss_growth_mib: (rss * 10.0).round() / 10.0,
            threads_max: threads,
            detail,
        })
    }

    /// An attacker process alone against the ports; serves traffic until it reports.
    fn raw(&mut self, name: &str, opts: &Options) -> Result<u64, ProcsError> {
        let args = self.attack_args(name, opts);
        let attacker = Attacker::spawn(&opts.exe, &args, opts.log.clone())?;
        self.until_done(&attacker, Duration::from_secs(120))
    }

    /// Serves traffic until the attacker's result line (its attempts).
    fn until_done(&mut self, attacker: &Attacker, limit: Duration) -> Result<u64, ProcsError> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            self.pump(Duration::from_millis(100))?;
            while let Ok(line) = attacker.lines.try_recv() {
                match line {
                    attack::Line::Done { attempts, note } => {
                        self.window.note = note;
                        return Ok(attempts);
                    }
                    attack::Line::Failed { message } => {
                        return Err(DemoError::Config(format!("attacker {}: {message}", attacker.child.id())).into())
                    }
                    attack::Line::Listening { .. } => {}
                }
            }
        }
        Err(DemoError::Stuck(format!("the attacker did not finish within {limit:?}")).into())
    }

    /// An engine with a wrong secret, claiming to be D, dials P again and again.
    fn wrong_secret(&mut self, opts: &Options, t: &Topology) -> Result<u64, ProcsError> {
        let wrong = kvpush::engine::side::random_secret()
            .map_err(|e| DemoError::Config(format!("no randomness for a secret: {e}")))?;
        let mut v = Victim::spawn(&opts.exe, t, Role::Decode.engine_id(), &wrong, opts.log.clone())?;
        let (mut attempts, mut refused) = (0, 0);
        for _ in 0..opts.rounds {
            refused += u64::from(!v.connect(self.p_ports[0])?);
            attempts += 1;
            self.pump(Duration::from_millis(20))?;
        }
        self.window.note = format!("{refused} of {attempts} handshakes failed on the attacker's side");
        v.proc.mute();
        v.proc.kill();
        Ok(attempts)
    }

    /// The relay attacks: the victim engine dials P through the attacker's relay, which tampers.
    fn relayed(&mut self, name: &str, opts: &Options, t: &Topology) -> Result<u64, ProcsError> {
        let mut v = Victim::spawn(&opts.exe, t, VICTIM, &self.secret, opts.log.clone())?;
        let rounds = opts.rounds.min(20);
        let mut args = self.attack_args(name, opts);
        args.rounds = rounds;
        let attacker = Attacker::spawn(&opts.exe, &args, opts.log.clone())?;
        let port = match attacker.lines.recv_timeout(Duration::from_secs(30)) {
            Ok(attack::Line::Listening { port }) => port,
            other => return Err(DemoError::Config(format!("the relay did not start: {other:?}")).into()),
        };
        for i in 0..rounds {
            if v.connect(port)? {
                // A registration for the relay to replay or tamper with.
                let key = self.key();
                v.register(BAIT_BASE * 2 + i as u64, key)?;
            }
            self.pump(Duration::from_millis(300))?;
        }
        // What the victim did itself is legitimate; the rest is the relay's.
        let (hs, regs) = v.counts()?;
        self.window.legit_handshakes += hs;
        self.window.legit_registrations += regs;
        drop(v);
        self.until_done(&attacker, Duration::from_secs(60))
    }

    /// The victim registers with P, freezes, and comes back as a new process under the same engine
    /// id; P then finishes the prefills the old process had registered for.
    fn restart(&mut self, opts: &Options, t: &Topology) -> Result<u64, ProcsError> {
        let mut old = Victim::spawn(&opts.exe, t, VICTIM, &self.secret, opts.log.clone())?;
        let mut new = Victim::spawn(&opts.exe, t, VICTIM, &self.secret, opts.log.clone())?;
        if !old.connect(self.p_ports[0])? {
            return Err(old.fail("the first incarnation could not handshake with P".into()));
        }
        let mut keys = Vec::new();
        for i in 0..BAIT as u64 {
            let key = self.key();
            if old.register(BAIT_BASE * 3 + i, key)? {
                keys.push((BAIT_BASE * 3 + i, key));
            }
        }
        self.pump(Duration::from_millis(300))?;
        let (hs, regs) = old.counts()?;
        self.window.legit_handshakes += hs;
        self.window.legit_registrations += regs;
        // The old process stops answering (its connection stays open), the new one dials at once.
        // SAFETY: kill(2) on the pid of a child this process spawned and has not reaped.
        unsafe { libc::kill(old.proc.pid() as i32, libc::SIGSTOP) };
        if !new.connect(self.p_ports[0])? {
            return Err(new.fail("the new incarnation could not handshake with P".into()));
        }
        let (hs, regs) = new.counts()?;
        self.window.legit_handshakes += hs;
        self.window.legit_registrations += regs;
        for &(req, key) in &keys {
            let cmd = Command::Prefill { req, key, tokens: 64, seed: req, delay_ns: Some(0) };
            self.pair.send(Role::Prefill, &cmd)?;
        }
        self.pump(Duration::from_secs(2))?;
        self.window.note = format!("{} registrations of the frozen process, then its prefills on P", keys.len());
        old.proc.mute();
        old.proc.kill();
        new.proc.mute();
        new.proc.kill();
        Ok(keys.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_missed_target_is_named() {
        let ok = AttackReport { name: "a".into(), attempts: 3, threads_max: 10, ..Default::default() };
        let mut r = Report { attacks: vec![ok.clone()], totals: Totals::default() };
        assert!(r.missed().is_empty());
        r.attacks.push(AttackReport { name: "none".into(), ..ok.clone() });
        r.attacks[1].attempts = 0;
        r.attacks.push(AttackReport { name: "acc".into(), accepted: 1, ..ok.clone() });
        r.attacks.push(AttackReport { name: "served".into(), served_failed: 2, ..ok.clone() });
        r.attacks.push(AttackReport { name: "rss".into(), rss_growth_mib: 64.5, ..ok.clone() });
        r.attacks.push(AttackReport { name: "threads".into(), threads_max: 65, ..ok });
        let m = r.missed();
        assert_eq!(m.len(), 5, "{m:?}");
        for (line, name) in m.iter().zip(["none", "acc", "served", "rss", "threads"]) {
            assert!(line.starts_with(name), "{line}");
        }
    }

    #[test]
    fn status_of_this_process_is_read() {
        let (rss, threads) = proc_status(std::process::id()).unwrap();
        assert!(rss > 0.0 && threads >= 1, "{rss} {threads}");
    }
}
