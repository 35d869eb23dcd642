//! The demo's one workload driver: it plays the requests of a [`Workload`] against a P engine and a
//! D engine as a router would, whether the engines run in this process ([`super::run`]) or as two
//! child processes ([`super::procs::run`]).
//!
//! Read [`play`], then the [`Side`] trait. The driver speaks the child protocol ([`Command`] down,
//! [`Event`] up) to both engines through a [`Side`]: the child-process side writes the commands to
//! the children's stdin; the in-process side hands them to the same engine hosts
//! ([`super::procs::WorkerState`]) in this process and steps them while it waits. The driver owns
//! the workload and never touches an engine: admission under the block pools' limits (it counts
//! each side's free blocks; the hosts own the pools and their ids), the simulated prefill delay
//! (carried in [`Command::Prefill`]), registration-first vs blocks-first requests, the relay delay
//! before the consumer leg, its retry while D has no room, the accounting of verified bytes,
//! failures, latencies and engine time, the no-progress limit ([`DemoError::Stuck`]), the progress
//! tick and the [`ModeReport`].

use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use kvpush::proto::msg::{blocks_for, Mode};
use kvpush::proto::Key;

use super::procs::{Command, Event, Role};
use super::{model, requests, BlockLists, DemoError, ModeReport, Rng, Topology, Workload};

/// How long the driver waits without any event before it gives up on the workload.
const NO_PROGRESS_LIMIT: Duration = Duration::from_secs(120);

/// A P and a D engine the driver plays a workload on.
pub(crate) trait Side {
    /// What stops this side: a [`DemoError`] of the driver's own, or the side's.
    type Error: From<DemoError>;

    /// Sends `cmd` to the engine of `role`.
    fn send(&mut self, role: Role, cmd: &Command) -> Result<(), Self::Error>;

    /// The next event of either engine, waiting up to `wait` (`None` after that); an
    /// [`Event::Error`] or a lost engine is an error.
    fn next(&mut self, wait: Duration) -> Result<Option<(Role, Event)>, Self::Error>;

    /// The error for `message` about the engine of `role` (with what the side knows of it).
    fn fail(&mut self, role: Role, message: String) -> Self::Error;

    /// Waits for the event of `role` that `f` accepts; other events are errors (setup is sequential).
    fn expect<T>(
        &mut self,
        role: Role,
        what: &str,
        timeout: Duration,
        f: impl FnOnce(Event) -> Option<T>,
    ) -> Result<T, Self::Error> {
        match self.next(timeout)? {
            Some((r, ev)) if r == role => {
                let text = format!("{ev:?}");
                f(ev).ok_or_else(|| self.fail(role, format!("expected {what}, got {text}")))
            }
            Some((r, ev)) => Err(self.fail(r, format!("unexpected event while waiting for {what}: {ev:?}"))),
            None => Err(self.fail(role, format!("no {what} after {timeout:?}"))),
        }
    }

    /// The engine counters of `role`: bytes, descriptors before merging, descriptors posted,
    /// registrations, staged pieces.
    fn stats(&mut self, role: Role) -> Result<(u64, u64, u64, u64, u64), Self::Error> {
        self.send(role, &Command::Stats)?;
        self.expect(role, "stats", Duration::from_secs(30), |ev| match ev {
            Event::Stats { bytes, descriptors_unmerged, descriptors_posted, registrations, staged_pieces, .. } => {
                Some((bytes, descriptors_unmerged, descriptors_posted, registrations, staged_pieces))
            }
            _ => None,
        })
    }
}

/// Transfers the engine of `role` posted (WRITEs and READs; a layer-wise push posts one per
/// range).
fn posts<S: Side>(side: &mut S, role: Role) -> Result<u64, S::Error> {
    side.send(role, &Command::Stats)?;
    side.expect(role, "stats", Duration::from_secs(30), |ev| match ev {
        Event::Stats { engine, .. } => Some(engine.posts),
        _ => None,
    })
}

/// A request as the driver tracks it.
struct Tracked {
    key: Key,
    tokens: u64,
    seed: u64,
    registration_first: bool,
    p_need: usize,
    d_need: usize,
    ready_us: Option<u64>,
    /// D's received time, until the latency is taken (P's ready event may come after it).
    received_us: Option<u64>,
    p_blocks: Option<BlockLists>,
    engine_ns: u64,
    sent: bool,
    d_done: bool,
    failed: bool,
    done: bool,
}

/// Plays the workload `w` in `mode` on `side` and reports it. `tick` is called once per finished
/// request.
///
/// Latency is D's [`Event::Received`] minus P's [`Event::Ready`] (both on [`crate::child::now_us`]'s
/// clock); a request's engine time is the sum of the engine-thread time both engines report for it.
pub(crate) fn play<S: Side>(
    side: &mut S,
    t: &Topology,
    w: &Workload,
    mode: Mode,
    tick: &dyn Fn(),
) -> Result<ModeReport, S::Error> {
    let groups = model(t).groups.len();
    let specs = requests(w);
    let mut rng = Rng(w.seed ^ 0x5eed);
    let (mut p_free, mut d_free) = (t.num_blocks as usize, t.num_blocks as usize);
    let mut reqs: Vec<Tracked> = Vec::with_capacity(specs.len());
    let mut due: BinaryHeap<std::cmp::Reverse<(Instant, usize)>> = BinaryHeap::new();
    let (mut next, mut in_flight, mut finished) = (0usize, 0usize, 0usize);
    let mut latencies = Vec::with_capacity(specs.len());
    let mut exposed = Vec::with_capacity(specs.len());
    let mut ends = Vec::with_capacity(specs.len());
    let (mut verified_bytes, mut verified, mut failed) = (0u64, 0u64, 0u64);
    let mut last_progress = Instant::now();
    let started = Instant::now();

    while finished < specs.len() {
        // Admit.
        while next < specs.len() && in_flight < w.concurrency {
            let (tokens, registration_first) = specs[next];
            let registration_first = registration_first || w.registration_first;
            let p_need = blocks_for(tokens, t.p_block) as usize * groups;
            let d_need = blocks_for(tokens, t.d_block) as usize * groups;
            let d_now = mode == Mode::Push && registration_first;
            if p_free < p_need || (d_now && d_free < d_need) {
                if p_need > t.num_blocks as usize || d_need > t.num_blocks as usize {
                    return Err(DemoError::Config(format!(
                        "a request of {tokens} tokens needs more blocks than a pool of {} holds",
                        t.num_blocks
                    ))
                    .into());
                }
                break;
            }
            let key = Key::new(u128::from(rng.next()) << 64 | next as u128, 1);
            let seed = rng.next();
            p_free -= p_need;
            let delay_ns = tokens * w.prefill_ns_per_token;
            let cmd = if w.prefill_ns_per_layer > 0 {
                let (layer_ns, layerwise) = (w.prefill_ns_per_layer, w.layerwise);
                Command::PrefillLayers { req: next as u64, key, tokens, seed, delay_ns, layer_ns, layerwise }
            } else {
                Command::Prefill { req: next as u64, key, tokens, seed, delay_ns: Some(delay_ns) }
            };
            side.send(Role::Prefill, &cmd)?;
            if d_now {
                d_free -= d_need;
                let cmd =
                    Command::Decode { req: next as u64, key, tokens, seed, remote_blocks: None, hold_verify: false };
                side.send(Role::Decode, &cmd)?;
            }
            reqs.push(Tracked {
                key,
                tokens,
                seed,
                registration_first,
                p_need,
                d_need,
                ready_us: None,
                received_us: None,
                p_blocks: None,
                engine_ns: 0,
                sent: false,
                d_done: false,
                failed: false,
                done: false,
            });
            next += 1;
            in_flight += 1;
        }
        // The consumer legs that are due (the router relays after `relay_us`); retried shortly while
        // D has no room.
        while let Some(std::cmp::Reverse((at, i))) = due.peek().copied() {
            if at > Instant::now() {
                break;
            }
            due.pop();
            let r = &mut reqs[i];
            if d_free < r.d_need {
                due.push(std::cmp::Reverse((Instant::now() + Duration::from_micros(100), i)));
                break;
            }
            d_free -= r.d_need;
            let remote_blocks = if mode == Mode::Pull { r.p_blocks.take() } else { None };
            let cmd = Command::Decode {
                req: i as u64,
                key: r.key,
                tokens: r.tokens,
                seed: r.seed,
                remote_blocks,
                hold_verify: false,
            };
            side.send(Role::Decode, &cmd)?;
        }
        // Events.
        let wait = due
            .peek()
            .map(|std::cmp::Reverse((at, _))| at.saturating_duration_since(Instant::now()))
            .unwrap_or(Duration::from_millis(100))
            .min(Duration::from_millis(100));
        let mut got = side.next(wait)?;
        if got.is_none() && last_progress.elapsed() > NO_PROGRESS_LIMIT {
            let stuck: Vec<String> = reqs.iter().filter(|r| !r.done).take(5).map(|r| r.key.to_string()).collect();
            return Err(DemoError::Stuck(format!(
                "{mode}: no progress for {NO_PROGRESS_LIMIT:?}; {} requests unfinished, e.g. {stuck:?}",
                specs.len() - finished
            ))
            .into());
        }
        while let Some((role, ev)) = got.take() {
            last_progress = Instant::now();
            let i = match &ev {
                Event::Ready { req, .. }
                | Event::Sent { req, .. }
                | Event::Received { req, .. }
                | Event::Failed { req, .. }
                | Event::Registered { req } => *req as usize,
                other => return Err(side.fail(role, format!("unexpected event during the workload: {other:?}"))),
            };
            if i >= reqs.len() {
                return Err(side.fail(role, format!("event for unknown request {i}: {ev:?}")));
            }
            let r = &mut reqs[i];
            match ev {
                Event::Ready { at_us, engine_ns, blocks, .. } => {
                    r.ready_us = Some(at_us);
                    r.engine_ns += engine_ns;
                    if !(mode == Mode::Push && r.registration_first) {
                        r.p_blocks = Some(blocks);
                        due.push(std::cmp::Reverse((Instant::now() + Duration::from_micros(w.relay_us), i)));
                    }
                }
                Event::Sent { engine_ns, .. } => {
                    r.engine_ns += engine_ns;
                    r.sent = true;
                    p_free += r.p_need;
                }
                Event::Received { at_us, verified_bytes: v, ok, detail, engine_ns, .. } => {
                    r.engine_ns += engine_ns;
                    r.received_us = Some(at_us);
                    if ok {
                        verified_bytes += v;
                        verified += 1;
                    } else {
                        tracing::error!(key = %r.key, detail = detail.as_deref().unwrap_or(""), "KV arrived wrong");
                        r.failed = true;
                    }
                    r.d_done = true;
                    d_free += r.d_need;
                }
                Event::Failed { reason, engine_ns, .. } => {
                    tracing::warn!(key = %r.key, %reason, "request failed");
                    r.engine_ns += engine_ns;
                    r.failed = true;
                    r.d_done = true;
                    d_free += r.d_need;
                }
                _ => {}
            }
            // The two engines report separately: P's ready may reach the driver after D's received
            // (layer by layer, D can have the request just after P's last layer).
            if let (Some(ready), Some(at_us)) = (r.ready_us, r.received_us) {
                r.received_us = None;
                latencies.push(at_us.saturating_sub(ready));
                if !r.failed {
                    exposed.push((i, r.tokens, at_us.saturating_sub(ready)));
                    ends.push((r.key, ready, at_us));
                }
            }
            if r.sent && r.d_done && !r.done {
                r.done = true;
                failed += u64::from(r.failed);
                finished += 1;
                in_flight -= 1;
                tick();
            }
            got = side.next(Duration::ZERO)?;
        }
    }
    let wall = started.elapsed().as_secs_f64();
    let mut counters = Vec::new();
    for role in [Role::Prefill, Role::Decode] {
        let (bytes, unmerged, posted, _, _) = side.stats(role)?;
        counters.push((bytes, unmerged, posted));
    }
    let mut report = ModeReport::new(specs.len() as u64, verified_bytes, verified, failed, wall, counters);
    report.summarize(latencies, reqs.iter().map(|r| r.engine_ns));
    report.producer_posts = posts(side, Role::Prefill)?;
    report.exposed = exposed;
    report.ends = ends;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use kvpush::proto::msg::Mode;

    use super::super::{run, DemoError, Topology, Workload};

    /// A request that can never fit a pool is refused at once, in-process too (it used to wait for the
    /// no-progress limit there).
    #[test]
    fn a_request_larger_than_a_pool_is_a_configuration_error() {
        let t = Topology { layers: 2, num_blocks: 4, ..Topology::default() };
        // 100 tokens in 16-token blocks: 7 blocks per group, the pools hold 4.
        let w = Workload { requests: 3, min_tokens: 100, max_tokens: 100, ..Workload::default() };
        match run(&t, &w, &[Mode::Push], &|| {}) {
            Err(DemoError::Config(m)) => {
                assert!(m.contains("100 tokens needs more blocks than a pool of 4 holds"), "{m}")
            }
            other => panic!("expected the configuration error, got {other:?}"),
        }
    }
}
