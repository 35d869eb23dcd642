//! Stress and fault-injection tests of real engines: a producer (P) and a consumer (D) engine with 1 or
//! 2 TP workers each, on host memory, the loopback transport and a [`LocalHub`] control link, played by
//! the scripted driver of `kvpush_testkit::stress` (what it checks for every key and worker is in its
//! module doc). This file holds the workloads and the tests.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use kvpush::engine::{Finished, LocalHub, Staging};
use kvpush::proto::rendezvous::ReleaseReason;
use kvpush::proto::{Key, Mode};
use kvpush::transport::loopback::{Fabric, Fault, FaultRates};
use kvpush::transport::staged::PathChoice;
use kvpush_testkit::demo::pattern;
use kvpush_testkit::engines::{self, poll_until, wait_for};
use kvpush_testkit::rng::Rng;
use kvpush_testkit::stress::*;

use ReleaseReason as R;

// ---------------------------------------------------------------------------------------------
// 1. Many concurrent requests, every byte verified.

/// One `#[test]` per line, `name => call;`: the cases of a parameterized driver of this file.
macro_rules! cases {
    ($($name:ident => $call:expr;)+) => {
        $(
            #[test]
            fn $name() {
                $call;
            }
        )+
    };
}

/// Plays `n` requests on a driver of `setup` within `bound`, request `i` as `plan` writes it from
/// the PRNG seeded with `seed`; checks every outcome and prints the summary under `what`.
fn play(
    setup: Setup,
    n: usize,
    seed: u64,
    bound: Bound,
    what: &str,
    mut plan: impl FnMut(&mut Rng, usize) -> Req,
) -> Driver {
    let mut rng = Rng(seed);
    let mut d = Driver::new(setup);
    let reqs = (0..n).map(|i| plan(&mut rng, i)).collect();
    d.run_bounded(reqs, bound);
    d.check();
    eprintln!("{what}: {}", d.summary());
    d
}

fn stress(setup: Setup, requests: usize, seed: u64) -> Driver {
    stress_within(setup, requests, seed, Bound::Total(Duration::from_secs(90)))
}

fn stress_within(setup: Setup, requests: usize, seed: u64, bound: Bound) -> Driver {
    play(setup, requests, seed, bound, "stress", |rng, i| {
        let registration_first = rng.coin();
        let steps = legs(rng, 1, registration_first, 20);
        Req::new("normal", rng.id(i), rng.tokens(), steps, vec![(1, OK)])
    })
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
    play(s, 300, 0x9011, Bound::Total(Duration::from_secs(30)), "pull", |rng, i| {
        let steps = legs(rng, 1, false, 10);
        Req::new("pull", rng.id(i), rng.tokens(), steps, vec![(1, OK)])
    });
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
    // Lease expiries (8 s) are the longest quiet stretches of a healthy run.
    let bound = Bound::Stalled(Duration::from_secs(30));
    play(setup, requests, seed, bound, "aborts", |rng, i| abort_plan(rng, i, mode))
}

/// The abort tests' engines. What they check of an abort's latency (the driver's `margin`: P
/// releases an aborted request's blocks, and D reports a request it aborted, within it) is that the
/// abort path answered, not a timeout that would also have ended the request: the drain timeout (D
/// waiting for a producer's final word), staging's stall bound (P waiting for a CANCEL's answer) and
/// D's completion timeout. So those are set well above the margin (the drain and the stall bound
/// 60 s, the completion timeout 20 s), and the margin (10 s, not 3 s) leaves a loaded host room:
/// at a load average near 20 on 2 cores, 3 s was outrun by the driver's own polling. The lease
/// (8 s) leaves the driver, which fills P's blocks itself, room to give a request's second leg late.
fn abort_setup(mode: Mode, p_tp: u16, d_tp: u16, writers: usize) -> Setup {
    let mut s = Setup::new(mode, p_tp, d_tp);
    s.writers = writers;
    s.num_blocks = 8192;
    s.lease = Duration::from_secs(8);
    s.registration_timeout = Duration::from_secs(10);
    s.completion_timeout = Duration::from_secs(20);
    s.pull_read_timeout = Duration::from_secs(20);
    s.drain_timeout = Duration::from_secs(60);
    s.margin = Duration::from_secs(10);
    s
}

cases! {
    push_aborts_at_every_stage_p1_d2 => aborts(abort_setup(Mode::Push, 1, 2, 2), 400, 0xab01);
    push_aborts_at_every_stage_p2_d1 => aborts(abort_setup(Mode::Push, 2, 1, 1), 400, 0xab02);
    push_aborts_at_every_stage_p2_d2 => aborts(abort_setup(Mode::Push, 2, 2, 2), 300, 0xab03);
    pull_aborts_at_every_stage => aborts(abort_setup(Mode::Pull, 2, 1, 2), 300, 0xab04);
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

/// Request `id` of 150 tokens: D registers, every write P posts for it is delayed by `delay`, P
/// finishes, and once every write is in flight `abort` runs; P must end it as aborted, D as one of
/// `d_out`.
fn abort_in_flight(
    c: &Cluster,
    delay: Duration,
    id: u128,
    label: &'static str,
    abort: &[Step],
    d_out: &'static [DKind],
) -> Req {
    let mut steps = vec![Step::DAlloc(1)];
    steps.extend(delay_every_write(c, delay));
    steps.push(Step::PFinish(1));
    steps.extend(wait_every_write(c));
    steps.extend(abort.iter().cloned());
    Req::new(label, id, 150, steps, vec![(1, Expect { p: Some(&[R::Aborted]), d: Some(d_out) })])
}

/// Every P worker released the request `t` no sooner than `delay` after it was handed over: not
/// before its delayed write ended.
fn assert_released_after(t: &Track, delay: Duration) {
    let given = t.p_given_at.expect("given");
    for (w, s) in t.p_sent.iter().enumerate() {
        assert!(
            s[0].1 - given >= delay,
            "P[{w}] released {:?} after request_finished, under its delayed write",
            s[0].1 - given
        );
    }
}

fn aborts_in_flight(p_tp: u16, d_tp: u16, writers: usize) {
    aborts_in_flight_in(Setup::new(Mode::Push, p_tp, d_tp), writers);
}

fn aborts_in_flight_in(mut s: Setup, writers: usize) {
    let delay = Duration::from_millis(250);
    let (p_tp, d_tp) = (s.p_tp, s.d_tp);
    s.writers = writers;
    // The follow-up request below reuses D's blocks right after D ended (quarantine is off).
    let mut d = Driver::new(s);
    let mut rng = Rng(u64::from(p_tp) << 8 | u64::from(d_tp));

    // P aborts while its writes are in flight: the data still lands and verifies; P's blocks come
    // back (once) only after the writes are done.
    let id = rng.id(0);
    let req = abort_in_flight(&d.c, delay, id, "P abort in flight", &[Step::PAbort(1)], &[DKind::Received]);
    d.run(vec![req], Duration::from_secs(20));
    let t = d.get(id, 1);
    assert_released_after(t, delay);

    // D aborts while P's writes are in flight: D ends at once, P releases after its writes.
    let id = rng.id(1);
    let req = abort_in_flight(
        &d.c,
        delay,
        id,
        "D abort in flight",
        &[Step::DAbort(1), Step::Wait(Cond::DAll(1))],
        &[DKind::Ended],
    );
    // As soon as D ended, a second request takes D's freed blocks (the pool is LIFO) while the first
    // one's write is still in flight; it must verify.
    let next = rng.id(2);
    let mut steps = vec![Step::Wait(Cond::OtherDAll(id, 1))];
    steps.extend(legs(&mut rng, 1, true, 1));
    let follow = Req::new("reuses D blocks", next, 150, steps, vec![(1, OK)]);
    d.run(vec![req, follow], Duration::from_secs(20));
    let t = d.get(id, 1);
    assert_released_after(t, delay);
    let sorted = |b: &Option<Vec<Vec<u32>>>| b.as_ref().map(|b| b.iter().flatten().copied().collect::<HashSet<u32>>());
    assert_eq!(sorted(&d.get(next, 1).d_blocks), sorted(&t.d_blocks), "the freed blocks were not handed out again");
    d.check();
}

cases! {
    aborts_while_in_flight_p1_d2 => aborts_in_flight(1, 2, 2);
    aborts_while_in_flight_p2_d1 => aborts_in_flight(2, 1, 1);
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

cases! {
    reissue_with_stale_write_in_flight_p1_d1 => reissue(1, 1, 2);
    reissue_with_stale_write_in_flight_p2_d1 => reissue(2, 1, 1);
    reissue_with_stale_write_in_flight_p1_d2 => reissue(1, 2, 2);
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

cases! {
    post_failures_and_partial_transfers_fail_at_once_p1_d1 => faults_one_by_one(1, 1);
    post_failures_and_partial_transfers_fail_at_once_p2_d1 => faults_one_by_one(2, 1);
    post_failures_and_partial_transfers_fail_at_once_p1_d2 => faults_one_by_one(1, 2);
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

/// Post errors, lost notifications and partial transfers, each at `rate`, from the transport's PRNG
/// seeded with `seed`.
fn fault_rates(rate: f64, seed: u64) -> FaultRates {
    FaultRates { post_error: rate, lose_notification: rate, partial: rate, seed }
}

/// Random post errors, lost notifications and partial transfers under load: every request ends as
/// the fault it met dictates, and the counts match the transport's exactly (one post per request).
#[test]
fn random_faults_under_load_p1_d1() {
    let mut s = Setup::new(Mode::Push, 1, 1);
    s.writers = 2;
    s.completion_timeout = Duration::from_secs(1);
    let mut d = Driver::new(s);
    d.c.p[0].transport.set_fault_rates(fault_rates(0.08, 42));
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
        w.transport.set_fault_rates(fault_rates(0.05, 7 + i as u64));
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

cases! {
    lease_expiry_p1_d2 => leases(1, 2);
    lease_expiry_p2_d1 => leases(2, 1);
}

// ---------------------------------------------------------------------------------------------
// Block reuse while a producer still writes (fixed by the consumer's drain): D once reported a request
// over (Ended on abort or when superseded, Failed on a timeout or on one producer's failure) while
// another producer's write into its blocks was still in flight or not even posted, so the engine
// reused blocks that were still written. The loopback transport runs the jobs of one (initiator,
// target) pair in order, which hides this while the next owner of the blocks is fed by the same
// producer worker; it shows when the next owner is fed by another producer engine (below), or by the
// same worker's other writer thread that posts first (the randomized abort tests, which reuse D's
// blocks at once). D now holds such an outcome until every producer gave its final word.

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

pub(crate) fn staged(mut s: Setup) -> Setup {
    s.staging = kvpush_testkit::stress::small_staging(2);
    s
}

/// [`staged`] for the abort tests: a stalled piece is failed after 60 s, far above the abort
/// tests' margin, so an abort answered only by that bound fails them ([`abort_setup`]).
fn staged_aborts(s: Setup) -> Setup {
    let mut s = staged(s);
    if let Staging::On(c) = &mut s.staging {
        c.stall_timeout = Duration::from_secs(60);
    }
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

/// [`stress`] with staging on, P TP `p_tp` and D TP `d_tp`, `writers` per worker; then
/// [`assert_staged`].
///
/// Every request is registered within 40 ms of the start and then queues for 2 receive slots of
/// 8 KiB, each piece a chain of thread wake-ups: the last request waits for all the others, so how
/// long that takes is the host's load, not the protocol (at a load average near 20 on 2 cores, 600
/// requests took 50 to 65 s). Hence D's completion timeout grows with the queue, 1 s a request
/// (about 10 times what one costs at that load), and the run is bounded by progress: it fails once
/// 30 s pass without any outcome, which a stuck transfer (or a lost wake-up) makes happen.
fn staged_stress(p_tp: u16, d_tp: u16, writers: usize, requests: usize, seed: u64) -> Driver {
    let mut s = staged(Setup::new(Mode::Push, p_tp, d_tp));
    s.writers = writers;
    s.num_blocks = 30_000;
    s.completion_timeout = s.completion_timeout.max(Duration::from_secs(requests as u64));
    let d = stress_within(s, requests, seed, Bound::Stalled(Duration::from_secs(30)));
    assert_staged(&d, &format!("P TP {p_tp}, D TP {d_tp}"));
    d
}

#[test]
fn staged_push_concurrent_requests_p2_d1() {
    let d = staged_stress(2, 1, 2, 600, 0x5a9e);
    let c = d.c.p[0].engine.staging_counts().expect("on");
    assert_eq!(c.direct, 0, "every WRITE qualifies: {c:?}");
}

/// Measured path choice: every byte arrives whichever way each WRITE went, and both ways were
/// taken (the chooser tries the path it does not predict faster while it has few samples of it).
#[test]
fn measured_path_choice_moves_every_byte_both_ways_p2_d1() {
    let mut s = staged(Setup::new(Mode::Push, 2, 1));
    if let Staging::On(c) = &mut s.staging {
        c.choice = PathChoice::Measured;
    }
    s.num_blocks = 30_000;
    let d = stress(s, 400, 0x5aa0);
    for (i, w) in d.c.p.iter().enumerate() {
        let c = w.engine.staging_counts().expect("staging is on");
        assert!(c.transfers > 0 && c.chosen_direct > 0, "P[{i}] took one path only: {c:?}");
        assert!(c.explored > 0, "P[{i}] never explored: {c:?}");
        assert_eq!(c.malformed, 0, "P[{i}] {c:?}");
    }
}

cases! {
    staged_push_concurrent_requests_p1_d2 => staged_stress(1, 2, 1, 300, 0x5a9f);
}

#[test]
fn staged_push_aborts_at_every_stage_p2_d2() {
    let d = aborts(staged_aborts(abort_setup(Mode::Push, 2, 2, 2)), 300, 0x5ab3);
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
    // 3 s, not 1: the 40 plain requests after the faults queue for the staging slots, and on two
    // loaded cores (CI runs this binary's tests in parallel) 1 s timed some of them out.
    s.completion_timeout = Duration::from_secs(3);
    if let Staging::On(c) = &mut s.staging {
        // A lost piece frees its receive slot soon (the request itself times out after 3 s).
        c.stall_timeout = Duration::from_millis(500);
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let mut d = Driver::new(s);
    d.c.p[0].transport.set_fault_rates(fault_rates(0.02, 43));
    let mut rng = Rng(0x5a7e);
    // A lost piece holds its receive slot until the stall timeout, so requests queued behind it may
    // time out on D too, and D then aborts them on P: the same outcomes as with two producers.
    d.run(faulty_requests(&mut rng, 200, "random faults, staged"), Duration::from_secs(40));
    let lb = d.c.p[0].transport.stats();
    assert!(lb.post_errors > 0 && lb.notifications_lost > 0 && lb.failed_transfers > 0, "some fault never hit: {lb:?}");
    // Faults off: once the staging slots all came back (stalled transfers failed after the stall
    // timeout and their slots freed), plain requests go through.
    d.c.p[0].transport.set_fault_rates(FaultRates::default());
    let staging = |side: &[engines::Worker]| side[0].engine.staging_counts().expect("staging is on");
    let (p, d_counts) = (staging(&d.c.p), staging(&d.c.d));
    eprintln!("staged random faults: right after the faulty requests: P {p:?}; D {d_counts:?}");
    let idle = Instant::now();
    let (p, d_counts) = poll_until(
        "the staging slots all free on P and D",
        Duration::from_secs(20),
        || (staging(&d.c.p), staging(&d.c.d)),
        |(p, d)| p.open == 0 && p.slots_in_use == 0 && d.incoming == 0 && d.slots_in_use == 0,
    );
    eprintln!("staged random faults: idle after {:?}: P {p:?}; D {d_counts:?}", idle.elapsed());
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
