//! Topologies seen from the producer ranks that write nothing (issue 17, item 4): with more P TP
//! ranks than KV heads, some P ranks hold replicas no rank of a given D reads. Every P rank must
//! still hear from D about every request — a release when D registers or drops it — and not keep
//! the prompt's blocks until its lease runs out (60 s here, so only a word from D answers within
//! `LIMIT`).

use std::time::Duration;

use kvpush::engine::Finished;
use kvpush::proto::rendezvous::ReleaseReason;
use kvpush::proto::{Key, Mode};
use kvpush_testkit::demo::pattern;
use kvpush_testkit::engines::{released, wait_for};
use kvpush_testkit::stress::{Cluster, Setup, BLOCK_TOKENS, P_ENGINE};

const LIMIT: Duration = Duration::from_secs(10);

/// P TP 4 over two KV heads (each head on two ranks) → D TP 1, with a second consumer engine of TP 4
/// known to P as well (so a P rank cannot tell from its peers alone that it feeds no one: rank 1
/// writes into the wide consumer, never into D).
#[test]
fn p_ranks_holding_replicated_heads_are_released_by_d() {
    for mode in [Mode::Push, Mode::Pull] {
        let c = Cluster::new(Setup::new(mode, 4, 1));
        let wide = c.extra_consumer("decode-wide", 4);
        let (d, tokens) = (&c.d[0], 2 * u64::from(BLOCK_TOKENS));
        let blocks = vec![vec![3, 4]];
        let key = Key::new(0x7e91_0001, 1);
        let seed = 0x7e91;
        for p in &c.p {
            pattern::fill(p.engine.layout(), &p.buffers, &blocks, tokens, seed).expect("prefill");
            p.engine.request_finished(key, blocks.clone(), tokens).expect("finished");
        }
        let local = vec![vec![9, 10]];
        match mode {
            Mode::Push => d.engine.blocks_allocated(key, P_ENGINE, local.clone(), tokens).expect("registers"),
            Mode::Pull => d.engine.start_pull(key, P_ENGINE, blocks.clone(), local.clone(), tokens).expect("reads"),
        }
        wait_for(&d.engine, "received", LIMIT, |f| matches!(f, Finished::Received { key: k } if *k == key));
        let v = pattern::verify(d.engine.layout(), &d.buffers, &local, tokens, seed).expect("reads back");
        assert!(v.ok(), "{mode:?}: {v:?}");
        // Ranks 0 and 2 wrote (or were read); 1 and 3 hold the replicas and were told to let go.
        let mut reasons = Vec::new();
        for p in &c.p {
            let f = wait_for(&p.engine, "released", LIMIT, |f| released(f, key));
            let Finished::Sent { reason, .. } = f else { unreachable!() };
            reasons.push(reason);
        }
        use ReleaseReason::{Aborted, Sent};
        assert_eq!(reasons, [Sent, Aborted, Sent, Aborted], "{mode:?}");
        // D owes nothing more and counted no failure: the idle ranks' answers were expected.
        std::thread::sleep(Duration::from_millis(200));
        let mut out = Vec::new();
        d.engine.poll(&mut out);
        assert!(out.is_empty(), "{mode:?}: {out:?}");
        let s = d.engine.stats();
        assert_eq!((s.failures.remote, s.counters.failed), (0, 0), "{mode:?}: {s:?}");

        // The wide consumer needs every P rank: the replicas D let go of are still sent to it.
        let key2 = Key::new(0x7e91_0002, 1);
        for p in &c.p {
            pattern::fill(p.engine.layout(), &p.buffers, &blocks, tokens, seed + 1).expect("prefill");
            p.engine.request_finished(key2, blocks.clone(), tokens).expect("finished");
        }
        for w in &wide {
            match mode {
                Mode::Push => w.engine.blocks_allocated(key2, P_ENGINE, local.clone(), tokens).expect("registers"),
                Mode::Pull => {
                    w.engine.start_pull(key2, P_ENGINE, blocks.clone(), local.clone(), tokens).expect("reads")
                }
            }
        }
        for w in &wide {
            wait_for(&w.engine, "received", LIMIT, |f| matches!(f, Finished::Received { key: k } if *k == key2));
            let v = pattern::verify(w.engine.layout(), &w.buffers, &local, tokens, seed + 1).expect("reads back");
            assert!(v.ok(), "{mode:?}: {v:?}");
        }
        for p in &c.p {
            let f = wait_for(&p.engine, "sent", LIMIT, |f| released(f, key2));
            assert!(matches!(f, Finished::Sent { reason: Sent, .. }), "{mode:?}: {f:?}");
        }

        // D drops a request before allocating: the replicas are released too.
        for f in c.dropped_by_d(Key::new(0x7e91_0003, 1), &[vec![5, 6]], tokens, LIMIT) {
            assert!(matches!(f, Finished::Sent { reason: Aborted, .. }), "{mode:?}: {f:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
        d.engine.poll(&mut out);
        assert!(out.is_empty(), "{mode:?}: {out:?}");
        let s = d.engine.stats();
        assert_eq!((s.failures.remote, s.counters.failed), (0, 0), "{mode:?}: {s:?}");
        drop(wide);
    }
}
