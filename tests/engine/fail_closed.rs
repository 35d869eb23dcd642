//! Fail closed (issue 16): no byte lands in a block after its owner was told the block is free, and
//! only the data path says that data landed. Each test drives one P and one D worker by hand on the
//! loopback transport and looks at the bytes in memory after an outcome.

use std::sync::Arc;
use std::time::Duration;

use kvpush::engine::side::Incarnation;
use kvpush::engine::{Finished, LocalHub};
use kvpush::proto::codec;
use kvpush::proto::msg::{Completion, Message};
use kvpush::proto::{Key, Mode};
use kvpush::transport::loopback::{Fabric, Fault};
use kvpush_testkit::demo::pattern;
use kvpush_testkit::engines::{connect_as, cut, poll_until, wait_for, Worker};
use kvpush_testkit::stress::{build_side, Cluster, Setup, BLOCK_TOKENS, D_ENGINE, P_ENGINE};

const LIMIT: Duration = Duration::from_secs(10);

/// A completion frame on the control link claims P's part landed before P wrote a byte. D must not
/// report the request received: only the transport's notification, delivered after the data, says
/// so. (Before the fix D reported `Received` at once, over blocks holding nothing.)
#[test]
fn a_push_completion_on_the_control_link_is_not_data() {
    let c = Cluster::new(Setup::new(Mode::Push, 1, 1));
    let (p, d) = (&c.p[0], &c.d[0]);
    let key = Key::new(0x5c0_0001, 1);
    let blocks = vec![vec![3, 4]];
    let tokens = 2 * u64::from(BLOCK_TOKENS);
    d.engine.blocks_allocated(key, P_ENGINE, blocks.clone(), tokens).expect("registers");
    poll_until("P sees the registration", LIMIT, || p.engine.stats().counters.registrations, |n| *n == 1);
    let rank = p.engine.layout().parallel.rank();
    let forged = codec::to_vec(&Message::Completion(Completion { key, rank })).expect("encodes");
    d.engine.handle_frame(p.engine.addr(), &forged).expect("frame taken");
    let mut out = Vec::new();
    let (_, seen) = poll_until(
        "D acts on the control-link completion",
        LIMIT,
        || {
            d.engine.poll(&mut out);
            (d.engine.stats().failures.malformed, out.clone())
        },
        |(refused, seen)| *refused > 0 || !seen.is_empty(),
    );
    assert!(seen.is_empty(), "D reported {seen:?} before P wrote a byte");
    // P's prefill ends: its WRITE and then the data path's notification complete the request.
    let seed = 0x5eed;
    pattern::fill(p.engine.layout(), &p.buffers, &blocks, tokens, seed).expect("prefill");
    p.engine.request_finished(key, blocks.clone(), tokens).expect("finished");
    wait_for(&d.engine, "received", LIMIT, |f| matches!(f, Finished::Received { key: k } if *k == key));
    let v = pattern::verify(d.engine.layout(), &d.buffers, &blocks, tokens, seed).expect("reads");
    assert!(v.ok(), "received but wrong: {v:?}");
    wait_for(&p.engine, "sent", LIMIT, |f| matches!(f, Finished::Sent { key: k, .. } if *k == key));
}

/// A P and a D worker that know each other as side-channel processes (so either can be lost).
fn pair(setup: Setup) -> (Vec<Worker>, Vec<Worker>, Arc<LocalHub>, Fabric) {
    let (fabric, hub) = (Fabric::new(), LocalHub::new());
    let p = build_side(&setup, P_ENGINE, 1, &fabric, &hub);
    let d = build_side(&setup, D_ENGINE, 1, &fabric, &hub);
    connect_as(&p[0].engine, P_INC, &d[0].engine, D_INC);
    (p, d, hub, fabric)
}

const P_INC: Incarnation = Incarnation(0x9);
const D_INC: Incarnation = Incarnation(0xd);

/// Window 1: the side channel is lost while P's WRITE is still on its way (the data path is slow,
/// not broken). D reports the request failed at once and its owner reuses the blocks (a canary is
/// written into them); P's WRITE must never land on top of it. P may release its sources only once
/// its WRITE ended. (Before the fix P released its sources while the WRITE was pending, and the
/// WRITE then overwrote the canary in D's reused blocks.)
#[test]
fn a_lost_peer_never_writes_into_blocks_given_back() {
    let (p, d, _hub, _fabric) = pair(Setup::new(Mode::Push, 1, 1));
    let (p, d) = (&p[0], &d[0]);
    let key = Key::new(0x10_57, 1);
    let blocks = vec![vec![5, 6, 7]];
    let tokens = 3 * u64::from(BLOCK_TOKENS);
    d.engine.blocks_allocated(key, P_ENGINE, blocks.clone(), tokens).expect("registers");
    poll_until("P sees the registration", LIMIT, || p.engine.stats().counters.registrations, |n| *n == 1);
    p.transport.inject_once(Fault::Delay(Duration::from_millis(300)));
    pattern::fill(p.engine.layout(), &p.buffers, &blocks, tokens, 0xda7a).expect("prefill");
    p.engine.request_finished(key, blocks.clone(), tokens).expect("finished");
    poll_until("P posts its WRITE", LIMIT, || p.transport.stats().posts, |n| *n == 1);
    cut(&p.engine, P_INC, &d.engine, D_INC);
    // D's outcome gives the blocks back: the owner reuses them at once.
    let out = wait_for(&d.engine, "an outcome", LIMIT, |f| matches!(f, Finished::Failed { .. }));
    let canary = 0xca9a;
    pattern::fill(d.engine.layout(), &d.buffers, &blocks, tokens, canary).expect("reuse");
    // P's release: its WRITE must have ended by then (its handle released by the writer).
    wait_for(&p.engine, "P's release", LIMIT, |f| matches!(f, Finished::Sent { .. }));
    assert_eq!(p.transport.open_transfers(), 0, "P released its sources while its WRITE was in flight");
    // The WRITE ran (landed or refused) by now; the canary must be intact.
    let ended = |s: &kvpush::transport::loopback::LoopbackStats| s.failed_transfers + s.notifications_sent == 1;
    poll_until("P's WRITE ends", LIMIT, || p.transport.stats(), ended);
    let v = pattern::verify(d.engine.layout(), &d.buffers, &blocks, tokens, canary).expect("reads");
    assert!(v.ok(), "a WRITE of the lost peer landed after D reported {out:?}: {v:?}");
}
