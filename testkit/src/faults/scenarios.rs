//! The in-process scenarios of the fault suite, one function each, named in [`super::SCENARIOS`].
//!
//! Each builds a [`Rig`] with the timeouts its fault needs, writes every request's script (random
//! lengths, orders and delays from the one PRNG, seeded per scenario) and reports what the rig
//! measured. A scenario's comment says which failure it provokes and what would be counted if a
//! block were given back too early.

use std::net::TcpStream;
use std::time::Duration;

use kvpush::proto::Mode;
use kvpush::transport::loopback::{Fault, FaultRates};

use super::rig::{Cond, Params, Rig, Script, Step, Who};
use super::{Options, ScenarioReport};
use crate::demo::procs::ProcsError;
use crate::rng::Rng;

type Outcome = Result<ScenarioReport, ProcsError>;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A random sleep of up to `max` ms.
fn nap(rng: &mut Rng, max: u64) -> Step {
    Step::Sleep(Duration::from_micros(rng.below(max * 1000 + 1)))
}

/// 1 to 200 tokens (1 to 13 blocks).
fn tokens(rng: &mut Rng) -> u64 {
    rng.between(1, 200)
}

/// Both legs of attempt `a` in a random order (push), with small random gaps; pull always finishes
/// P first (D needs P's block ids).
fn both(rng: &mut Rng, a: u32, mode: Mode) -> Vec<Step> {
    if mode == Mode::Push && rng.coin() {
        vec![nap(rng, 2), Step::DAlloc(a), nap(rng, 2), Step::PFinish(a)]
    } else {
        vec![nap(rng, 2), Step::PFinish(a), nap(rng, 2), Step::DAlloc(a)]
    }
}

/// Plays `scripts` on a rig of `params`, at most `limit`, and reports.
fn play(params: Params, scripts: Vec<Script>, limit: Duration) -> Outcome {
    let mut rig = Rig::new(params);
    rig.play(scripts, limit);
    Ok(rig.finish(""))
}

/// Plays `n` requests labelled `label` on a rig of `params`, at most two minutes, and reports: the
/// steps of request `i` are `steps(rng, i)`, its length is drawn after them ([`tokens`]), all from
/// the one PRNG seeded with `seed`.
fn requests(
    params: Params,
    seed: u64,
    n: usize,
    label: &'static str,
    mut steps: impl FnMut(&mut Rng, usize) -> Vec<Step>,
) -> Outcome {
    let mut rng = Rng::new(seed);
    let scripts = (0..n)
        .map(|i| {
            let s = steps(&mut rng, i);
            Script::new(label, tokens(&mut rng), s)
        })
        .collect();
    play(params, scripts, Duration::from_secs(120))
}

/// D registers attempt 1, P's WRITE of it is held 10 to 100 ms in the data path (set the rig's
/// `max_delay` to 100 ms), P finishes it, then a random sleep of up to `nap_ms` ms.
fn held_write(rng: &mut Rng, nap_ms: u64) -> Vec<Step> {
    vec![
        Step::DAlloc(1),
        Step::Inject(Who::P, 0, Fault::Delay(ms(rng.between(10, 100)))),
        Step::PFinish(1),
        nap(rng, nap_ms),
    ]
}

/// Staging on with small slots, so that every WRITE goes through them in pieces.
fn staged(p: &mut Params, slots: usize) {
    p.engines.staging = crate::stress::small_staging(slots);
}

/// Requests, a third of whose WRITEs are delayed, D registered first, while a control script cuts the side
/// channel and restores it every `period` ms. On a cut D fails its requests at once and P releases
/// the sources; the delayed WRITEs still land (the data path is not the side channel): into D's
/// blocks, already reused and canaried, unless D holds them until the data path said nothing more
/// can land.
fn cut_while_delayed(opts: &Options, seed: u64, n: usize, mut p: Params, period: u64) -> Outcome {
    let mut rng = Rng::new(seed);
    p.max_delay = ms(200);
    let mut scripts = Vec::new();
    let cuts = (n / 40).max(2);
    let mut control = Vec::new();
    for _ in 0..cuts {
        control.extend([Step::Sleep(ms(period)), Step::Cut, Step::Sleep(ms(20)), Step::Reconnect]);
    }
    scripts.push(Script::new("control", 0, control));
    for i in 0..opts.n(n) {
        let t = tokens(&mut rng);
        let mut steps = vec![Step::DAlloc(1)];
        // A third of the WRITEs are held (and hold back those queued behind them on their pair).
        if i % 3 == 0 {
            let w = rng.below(u64::from(p.engines.p_tp)) as usize;
            steps.push(Step::Inject(Who::P, w, Fault::Delay(ms(rng.between(20, 200)))));
        }
        steps.extend([nap(&mut rng, 2), Step::PFinish(1)]);
        scripts.push(Script::new("delayed", t, steps));
    }
    play(p, scripts, Duration::from_secs(120))
}

/// Window 1, one request at a time: D registers, P's WRITE is held 150 ms in the data path, the
/// side channel is cut while it is in flight, and restored once both sides gave their outcome.
pub fn w1_lost_side_channel(opts: &Options) -> Outcome {
    let mut rng = Rng::new(0xf1);
    let mut p = Params::new(Mode::Push, 1, 1);
    p.concurrency = 1;
    p.max_delay = ms(150);
    let scripts = (0..opts.n(200) / 4)
        .map(|_| {
            Script::new(
                "cut mid-WRITE",
                tokens(&mut rng),
                vec![
                    // The previous request's WRITE, still held, must not pass for this one's.
                    Step::Wait(Cond::Idle(Who::P)),
                    Step::DAlloc(1),
                    Step::Inject(Who::P, 0, Fault::Delay(ms(150))),
                    Step::PFinish(1),
                    Step::Wait(Cond::InFlight(Who::P)),
                    Step::Cut,
                    Step::Wait(Cond::DOut(1)),
                    Step::Wait(Cond::PDone(1)),
                    Step::Reconnect,
                ],
            )
        })
        .collect();
    play(p, scripts, Duration::from_secs(120))
}

/// Window 2: as window 1 under load with staging on (two slots): D's staging receiver frees its
/// slots on the cut while P's pieces into them are still on the wire, and grants them again to
/// requests served between cuts (every 400 ms), whose received bytes are checked.
pub fn w2_staged_slots(opts: &Options) -> Outcome {
    let mut p = Params::new(Mode::Push, 1, 1);
    staged(&mut p, 2);
    // Few at once: staged pieces through two slots are slow, and requests should end between cuts.
    p.concurrency = 8;
    cut_while_delayed(opts, 0xf2, 400, p, 400)
}

/// Window 3: D aborts while P's staged pieces queue behind a delayed one; the drain timeout (150
/// ms) passes before P's final word, and D's outcome frees blocks the queued pieces are still
/// granted and scattered into.
pub fn w3_drain_timeout(opts: &Options) -> Outcome {
    let mut p = Params::new(Mode::Push, 1, 1);
    staged(&mut p, 1);
    p.engines.drain_timeout = ms(150);
    p.max_delay = ms(400);
    requests(p, 0xf3, opts.n(400), "abort, drain times out", |rng, _| {
        let mut s = vec![Step::DAlloc(1), Step::Inject(Who::P, 0, Fault::Delay(ms(rng.between(200, 400))))];
        s.extend([Step::PFinish(1), nap(rng, 30), Step::DAbort(1)]);
        s
    })
}

/// Window 4: pull; D's READ is held 400 ms in the data path while P's grant (lease and read
/// timeout 150 ms) expires. P releases its sources (overwritten at once) and D may fail while its
/// READ still lands in its blocks.
pub fn w4_pull_grant_expiry(opts: &Options) -> Outcome {
    let mut p = Params::new(Mode::Pull, 1, 1);
    p.engines.lease = ms(150);
    p.engines.pull_read_timeout = ms(150);
    p.max_delay = ms(400);
    requests(p, 0xf4, opts.n(400), "READ outlives the grant", |rng, i| {
        let mut s = vec![Step::PFinish(1)];
        if i % 2 == 0 {
            s.push(Step::Inject(Who::D, 0, Fault::Delay(ms(rng.between(200, 400)))));
        }
        s.push(Step::DAlloc(1));
        s
    })
}

/// Window 5: a completion frame on D's control link claims P's part landed before P wrote a byte;
/// D must wait for the data path's notification. A `Received` on the forged word is checked against
/// blocks holding only canaries.
pub fn w5_control_link_completion(opts: &Options) -> Outcome {
    let mut rng = Rng::new(0xf5);
    let scripts = (0..opts.n(400))
        .map(|_| {
            let s = vec![Step::DAlloc(1), Step::ForgeCompletion(1), nap(&mut rng, 10), Step::PFinish(1)];
            Script::new("forged completion", tokens(&mut rng), s)
        })
        .collect();
    play(Params::new(Mode::Push, 1, 1), scripts, Duration::from_secs(120))
}

/// Window 6 (the engine's part; the connector's is in tests/python): attempt 1's WRITE is held in
/// flight, D aborts it and registers attempt 2 at once, P finishes attempt 2. Attempt 1's outcome
/// must not complete attempt 2, nor its bytes land in attempt 2's (or reused) blocks.
pub fn w6_attempts(opts: &Options) -> Outcome {
    let mut p = Params::new(Mode::Push, 1, 1);
    p.max_delay = ms(100);
    requests(p, 0xf6, opts.n(400), "reissue over a stale WRITE", |rng, _| {
        let mut s = held_write(rng, 5);
        s.extend([Step::DAbort(1), Step::DAlloc(2), nap(rng, 3), Step::PFinish(2)]);
        s
    })
}

/// Window 7: pulls naming other P blocks than P pinned (holding another request's KV), mixed with
/// honest pulls. A pull of the wrong blocks must read nothing; a `Received` is checked byte by byte.
pub fn w7_forged_pull(opts: &Options) -> Outcome {
    let mut rng = Rng::new(0xf7);
    let scripts = (0..opts.n(400))
        .map(|i| {
            let t = tokens(&mut rng);
            let n = t.div_ceil(16) as usize;
            let s = if i % 2 == 0 {
                vec![Step::PFinish(1), nap(&mut rng, 2), Step::DPullForged(1, n)]
            } else {
                vec![Step::PFinish(1), nap(&mut rng, 2), Step::DAlloc(1)]
            };
            Script::new("forged remote ids", t, s)
        })
        .collect();
    play(Params::new(Mode::Pull, 1, 1), scripts, Duration::from_secs(120))
}

/// Window 8: an intruder engine (another consumer with the secret) registers the keys D registered,
/// before or after D. Any KV it receives is counted as corrupt blocks.
pub fn w8_intruder(opts: &Options) -> Outcome {
    let mut p = Params::new(Mode::Push, 1, 1);
    p.intruder = true;
    requests(p, 0xf8, opts.n(400), "intruder registers the key", |rng, _| {
        if rng.coin() {
            vec![Step::DAlloc(1), Step::XAlloc(1), nap(rng, 2), Step::PFinish(1)]
        } else {
            vec![Step::XAlloc(1), Step::DAlloc(1), nap(rng, 2), Step::PFinish(1)]
        }
    })
}

/// Requests with delayed WRITEs while a control script shuts `who` down after 300 ms. When the
/// shutdown returns the owner frees (here: canaries) every block of that side; no transfer may
/// touch them afterwards.
fn shutdown_mid_write(opts: &Options, seed: u64, who: Who) -> Outcome {
    let mut rng = Rng::new(seed);
    let mut p = Params::new(Mode::Push, 1, 1);
    p.max_delay = ms(300);
    let mut scripts = vec![Script::new("control", 0, vec![Step::Sleep(ms(300)), Step::Shutdown(who)])];
    for _ in 0..opts.n(300) {
        let mut s = vec![nap(&mut rng, 400), Step::DAlloc(1)];
        if rng.coin() {
            s.push(Step::Inject(Who::P, 0, Fault::Delay(ms(rng.between(50, 300)))));
        }
        s.push(Step::PFinish(1));
        scripts.push(Script::new("shutdown mid-WRITE", tokens(&mut rng), s));
    }
    p.concurrency = scripts.len();
    play(p, scripts, Duration::from_secs(120))
}

/// Window 9, producer: P's engine is shut down with WRITEs in flight (reading P's memory).
pub fn w9_producer_shutdown(opts: &Options) -> Outcome {
    shutdown_mid_write(opts, 0xf9, Who::P)
}

/// Window 9, consumer: D's engine is shut down with P's WRITEs in flight into D's memory.
pub fn w9_consumer_shutdown(opts: &Options) -> Outcome {
    shutdown_mid_write(opts, 0xf9d, Who::D)
}

/// Window 10: P's writer panics under load (its shard's requests must fail closed), and later the
/// side channel is cut for good: requests queued behind the lost peer must fail, not wait forever.
pub fn w10_no_silent_hang(opts: &Options) -> Outcome {
    let mut rng = Rng::new(0xfa);
    let mut p = Params::new(Mode::Push, 1, 1);
    p.engines.completion_timeout = Duration::from_secs(2);
    p.engines.lease = Duration::from_secs(2);
    let mut scripts =
        vec![Script::new("control", 0, vec![Step::Sleep(ms(200)), Step::Inject(Who::P, 0, Fault::Panic)])];
    scripts.push(Script::new("control", 0, vec![Step::Sleep(ms(600)), Step::Cut]));
    for _ in 0..opts.n(300) {
        let mut s = vec![nap(&mut rng, 1000)];
        s.extend(both(&mut rng, 1, Mode::Push));
        scripts.push(Script::new("behind a panic or a lost peer", tokens(&mut rng), s));
    }
    p.concurrency = scripts.len();
    play(p, scripts, Duration::from_secs(120))
}

/// The side channel cut every 100 ms under load while WRITEs are delayed, P and D with two workers.
pub fn cut_under_load(opts: &Options) -> Outcome {
    let mut p = Params::new(Mode::Push, 2, 2);
    // Requests whose registration a cut swallowed wait for D's timeout: many at once keep it short.
    p.concurrency = 128;
    cut_while_delayed(opts, 0xc07, 800, p, 100)
}

/// D registers late (0 to 400 ms after P finished) with a 150 ms lease: many registrations come
/// after P released the sources (overwritten at once); D must fail those, never receive.
pub fn lease_expiry_slow_d(opts: &Options) -> Outcome {
    let mut p = Params::new(Mode::Push, 1, 1);
    p.engines.lease = ms(150);
    p.engines.completion_timeout = ms(1000);
    requests(p, 0x1ea5, opts.n(600), "slow D", |rng, _| vec![Step::PFinish(1), nap(rng, 400), Step::DAlloc(1)])
}

/// An abort on P or D at a random stage of a random request (before either leg, between them,
/// right after, while the WRITE or READ is held in flight), P and D with two workers.
fn aborts(opts: &Options, seed: u64, mode: Mode) -> Outcome {
    let mut p = Params::new(mode, 2, 2);
    p.max_delay = ms(30);
    p.engines.completion_timeout = Duration::from_secs(3);
    p.engines.lease = Duration::from_secs(3);
    requests(p, seed, opts.n(1000), "abort", |rng, _| {
        let mut s = Vec::new();
        if rng.percent(30) {
            let who = if mode == Mode::Push { Who::P } else { Who::D };
            s.push(Step::Inject(who, rng.below(2) as usize, Fault::Delay(ms(rng.below(30)))));
        }
        let legs = both(rng, 1, mode);
        let abort = if rng.coin() { Step::PAbort(1) } else { Step::DAbort(1) };
        // Where the abort goes among the legs' steps (0: before all, 4: after all).
        let at = rng.below(5) as usize;
        s.extend(legs[..at].iter().cloned());
        s.push(abort);
        s.extend(legs[at..].iter().cloned());
        if rng.percent(30) {
            s.extend([nap(rng, 5), Step::PAbort(1), Step::DAbort(1)]);
        }
        s
    })
}

pub fn aborts_push(opts: &Options) -> Outcome {
    aborts(opts, 0xab0, Mode::Push)
}

pub fn aborts_pull(opts: &Options) -> Outcome {
    aborts(opts, 0xab1, Mode::Pull)
}

/// vLLM #48633 C1: D aborts right after registering (0 to 5 ms), with P's WRITE delayed half the
/// time; D's blocks go back (canaried) with its `Ended`, so a WRITE that lands later is counted.
pub fn c1_d_aborts_after_registering(opts: &Options) -> Outcome {
    let mut p = Params::new(Mode::Push, 1, 1);
    p.max_delay = ms(50);
    requests(p, 0xc1, opts.n(800), "D aborts after registering", |rng, _| {
        let mut s = vec![Step::DAlloc(1)];
        if rng.coin() {
            s.push(Step::Inject(Who::P, 0, Fault::Delay(ms(rng.between(5, 50)))));
        }
        if rng.coin() {
            s.extend([Step::PFinish(1), nap(rng, 5), Step::DAbort(1)]);
        } else {
            s.extend([nap(rng, 5), Step::DAbort(1), nap(rng, 5), Step::PFinish(1)]);
        }
        s
    })
}

/// vLLM #48633 C3: D already holds the first blocks of the prompt (a prefix-cache hit, holding the
/// request's own KV) and registers only the rest. Every block, prefix included, is checked.
pub fn c3_partial_prefix_hit(opts: &Options) -> Outcome {
    let mut rng = Rng::new(0xc3);
    let scripts = (0..opts.n(800))
        .map(|_| {
            let t = rng.between(17, 200);
            let skip = rng.below(t.div_ceil(16)) as usize;
            let s = vec![Step::DAllocTail(1, skip), nap(&mut rng, 2), Step::PFinish(1)];
            Script::new("prefix hit", t, s)
        })
        .collect();
    play(Params::new(Mode::Push, 1, 1), scripts, Duration::from_secs(120))
}

/// vLLM #48633 L1 (liveness): random post errors, lost notifications and partial transfers on P's
/// workers under load; every request must end, by a failure or the 1 s completion timeout.
pub fn l1_liveness(opts: &Options) -> Outcome {
    let mut rng = Rng::new(0x11);
    let mut p = Params::new(Mode::Push, 2, 1);
    p.engines.completion_timeout = ms(1000);
    p.engines.lease = ms(2000);
    p.concurrency = 64;
    let scripts: Vec<Script> = (0..opts.n(1500))
        .map(|_| {
            let s = both(&mut rng, 1, Mode::Push);
            Script::new("random faults", tokens(&mut rng), s)
        })
        .collect();
    let mut rig = Rig::new(p);
    rig.fault_rates(Who::P, FaultRates { post_error: 0.03, lose_notification: 0.03, partial: 0.03, seed: 0x11 });
    rig.play(scripts, Duration::from_secs(120));
    Ok(rig.finish(""))
}

/// vLLM #48633 S2: three connections to each P worker's side channel that never finish their
/// handshake (one under the side channel's per-address limit of four, so that the legitimate D on
/// the same loopback address is not refused by that limit), while D serves and re-handshakes (a cut
/// and a reconnect every 200 ms). The stalled handshakes must block nobody.
pub fn s2_slow_handshake(opts: &Options) -> Outcome {
    let mut rng = Rng::new(0x52);
    let p = Params::new(Mode::Push, 2, 1);
    let mut rig = Rig::new(p);
    for i in 0..6 {
        let addr = rig.p[i % 2].side.local_addr();
        if let Ok(mut s) = TcpStream::connect(addr) {
            // One byte of a greeting, then nothing.
            let _ = std::io::Write::write_all(&mut s, &[0x6b]);
            rig.stalled.push(s);
        }
    }
    let mut scripts = Vec::new();
    let n = opts.n(800);
    let mut control = Vec::new();
    for _ in 0..(n / 100).max(2) {
        control.extend([Step::Sleep(ms(200)), Step::Cut, Step::Sleep(ms(20)), Step::Reconnect]);
    }
    scripts.push(Script::new("control", 0, control));
    for _ in 0..n {
        let s = both(&mut rng, 1, Mode::Push);
        scripts.push(Script::new("behind stalled handshakes", tokens(&mut rng), s));
    }
    rig.play(scripts, Duration::from_secs(120));
    Ok(rig.finish(""))
}

/// vLLM #50754: every third WRITE fails to post (on one of P's two workers); the request must fail
/// at once on both sides, every block back.
pub fn post_failures(opts: &Options) -> Outcome {
    let mut rng = Rng::new(0x50754);
    let scripts = (0..opts.n(800))
        .map(|i| {
            let mut s = Vec::new();
            if i % 3 == 0 {
                s.push(Step::Inject(Who::P, rng.below(2) as usize, Fault::PostError));
            }
            s.extend(both(&mut rng, 1, Mode::Push));
            Script::new("post fails", tokens(&mut rng), s)
        })
        .collect();
    play(Params::new(Mode::Push, 2, 1), scripts, Duration::from_secs(120))
}

/// vLLM #53095: D registers just before P's lease (200 ms) runs out, and the WRITE it triggers is
/// held past the lease: P must keep the sources until the WRITE ended (they are overwritten the
/// moment P releases them).
pub fn lease_renewal(opts: &Options) -> Outcome {
    let mut p = Params::new(Mode::Push, 1, 1);
    p.engines.lease = ms(200);
    p.max_delay = ms(300);
    requests(p, 0x53095, opts.n(400), "registration at the lease's end", |rng, _| {
        vec![
            Step::PFinish(1),
            Step::Sleep(ms(rng.between(120, 190))),
            Step::Inject(Who::P, 0, Fault::Delay(ms(rng.between(100, 300)))),
            Step::DAlloc(1),
        ]
    })
}

/// vLLM #55470: P's request ends (abort) while its WRITE is held in flight: P's sources are
/// overwritten the moment P releases them, so a WRITE that reads them afterwards delivers canaries,
/// which D's check of a `Received` catches.
pub fn write_after_p_ended(opts: &Options) -> Outcome {
    let mut p = Params::new(Mode::Push, 1, 1);
    p.max_delay = ms(100);
    requests(p, 0x55470, opts.n(600), "P ends mid-WRITE", |rng, _| {
        let mut s = held_write(rng, 20);
        s.push(Step::PAbort(1));
        s
    })
}

/// vLLM #56104 / #58188: P and D with two workers, so every request has several transfer handles;
/// one handle of a third of them fails half way or is held, while the others complete.
pub fn several_handles(opts: &Options) -> Outcome {
    let mut p = Params::new(Mode::Push, 2, 2);
    p.max_delay = ms(50);
    requests(p, 0x56104, opts.n(800), "several handles", |rng, i| {
        let mut s = Vec::new();
        match i % 3 {
            0 => s.push(Step::Inject(Who::P, rng.below(2) as usize, Fault::Partial)),
            1 => s.push(Step::Inject(Who::P, rng.below(2) as usize, Fault::Delay(ms(rng.between(5, 50))))),
            _ => {}
        }
        s.extend(both(rng, 1, Mode::Push));
        s
    })
}
