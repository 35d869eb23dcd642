//! Requests at the borders of a transfer's life (issue 17, item 7), while D's serving engine still
//! queues them for blocks and so has registered nothing: D drops one (P must free the prompt's blocks
//! at once instead of holding them until its lease runs out), or keeps one queued longer than P's
//! lease (P must keep holding while D says so). Leases are 60 s unless a test sets them, so only a
//! drop can answer within `LIMIT`.

use std::time::{Duration, Instant};

use kvpush::engine::Finished;
use kvpush::proto::rendezvous::ReleaseReason;
use kvpush::proto::{Key, Mode};
use kvpush_testkit::demo::pattern;
use kvpush_testkit::engines::{released, wait_for};
use kvpush_testkit::stress::{Cluster, Setup, BLOCK_TOKENS, P_ENGINE};

const LIMIT: Duration = Duration::from_secs(10);

#[test]
fn a_request_dropped_on_d_before_allocation_frees_p_at_once() {
    for mode in [Mode::Push, Mode::Pull] {
        // P TP 2 -> D TP 1: both P ranks write into D's one rank, and both must hear of it.
        let c = Cluster::new(Setup::new(mode, 2, 1));
        let d = &c.d[0];
        let tokens = 2 * u64::from(BLOCK_TOKENS);
        // P finished first and holds the blocks; D drops the request.
        for f in c.dropped_by_d(Key::new(0xd209_0001, 1), &[vec![3, 4]], tokens, LIMIT) {
            assert!(matches!(f, Finished::Sent { reason: ReleaseReason::Aborted, .. }), "{mode:?}: {f:?}");
        }
        // D drops it before P's prefill finished: P releases the blocks as soon as it has them.
        let early = Key::new(0xd209_0002, 1);
        d.engine.abort_producer(early, P_ENGINE).expect("told");
        std::thread::sleep(Duration::from_millis(200));
        for p in &c.p {
            p.engine.request_finished(early, vec![vec![5, 6]], tokens).expect("finished");
            let f = wait_for(&p.engine, "released", LIMIT, |f| released(f, early));
            assert!(!matches!(f, Finished::Sent { reason: ReleaseReason::Sent, .. }), "{mode:?}: {f:?}");
        }
        // D owes no outcome for a request it never handed over, and P's answers ("nothing in flight")
        // are not counted as failures.
        let mut out = Vec::new();
        d.engine.poll(&mut out);
        assert!(out.is_empty(), "{mode:?}: {out:?}");
        let s = d.engine.stats();
        assert_eq!((s.failures.remote, s.counters.failed, s.counters.aborted), (0, 0, 2), "{mode:?}: {s:?}");
    }
}

#[test]
fn holds_from_d_keep_p_holding_past_its_lease_while_d_queues() {
    let mut setup = Setup::new(Mode::Push, 1, 1);
    setup.lease = Duration::from_millis(1500);
    let c = Cluster::new(setup);
    let (p, d) = (&c.p[0], &c.d[0]);
    let tokens = 2 * u64::from(BLOCK_TOKENS);
    let (held, unheld) = (Key::new(0x401d_0001, 1), Key::new(0x401d_0002, 1));
    let blocks = vec![vec![3, 4]];
    let seed = 0x401d;
    pattern::fill(p.engine.layout(), &p.buffers, &blocks, tokens, seed).expect("prefill");
    p.engine.request_finished(held, blocks.clone(), tokens).expect("finished");
    p.engine.request_finished(unheld, vec![vec![5, 6]], tokens).expect("finished");
    // D queues both for more than two leases and says so for one of them, every 300 ms.
    let start = Instant::now();
    let mut out = Vec::new();
    while start.elapsed() < Duration::from_millis(3500) {
        d.engine.hold(held, P_ENGINE).expect("told");
        std::thread::sleep(Duration::from_millis(300));
        p.engine.poll(&mut out);
    }
    assert!(
        out.iter().any(|f| matches!(f, Finished::Sent { key, reason: ReleaseReason::LeaseExpired } if *key == unheld)),
        "the request D did not hold outlived its lease: {out:?}"
    );
    assert!(!out.iter().any(|f| released(f, held)), "P let go of a request D held: {out:?}");
    // D finally has blocks: the transfer happens, every byte checked.
    d.engine.blocks_allocated(held, P_ENGINE, vec![vec![7, 8]], tokens).expect("registers");
    wait_for(&d.engine, "received", LIMIT, |f| matches!(f, Finished::Received { key } if *key == held));
    let v = pattern::verify(d.engine.layout(), &d.buffers, &[vec![7, 8]], tokens, seed).expect("reads");
    assert!(v.ok(), "{v:?}");
    let f = wait_for(&p.engine, "sent", LIMIT, |f| released(f, held));
    assert!(matches!(f, Finished::Sent { reason: ReleaseReason::Sent, .. }), "{f:?}");
}
