//! Fail closed (issue 16): no byte lands in a block after its owner was told the block is free, and
//! only the data path says that data landed. Each test drives one P and one D worker by hand on the
//! loopback transport and looks at the bytes in memory after an outcome.

use std::time::Duration;

use kvpush::engine::Finished;
use kvpush::proto::codec;
use kvpush::proto::msg::{Completion, Message};
use kvpush::proto::{Key, Mode};
use kvpush::transport::loopback::Fault;
use kvpush_testkit::demo::pattern;
use kvpush_testkit::engines::{poll_until, wait_for};
use kvpush_testkit::stress::{outcome_key, Cluster, Setup, BLOCK_TOKENS, D_ENGINE, P_ENGINE};

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

/// A panic in P's writer thread (injected into its transport's post, which runs on that thread) must
/// not leave the shard's requests hanging: every request P held gets `Sent` (its sources may be
/// reused: nothing was posted), D's registered request gets `Failed` from P's word, a request that
/// reaches the shard afterwards is answered at once, and the panic is counted. Leases and D's timeout
/// are 60 s, so only the panic path can answer within `LIMIT`. (Before the fix the writer thread died
/// and none of these outcomes ever came.)
#[test]
fn a_writer_panic_fails_its_shard_closed() {
    let c = Cluster::new(Setup::new(Mode::Push, 1, 1));
    let (p, d) = (&c.p[0], &c.d[0]);
    let tokens = 2 * u64::from(BLOCK_TOKENS);
    // Held by P, waiting for registrations that never come.
    let waiting: Vec<Key> = (0..3).map(|i| Key::new(0x9a1c_0000 + i, 1)).collect();
    for (i, key) in waiting.iter().enumerate() {
        let b = 2 * i as u32;
        p.engine.request_finished(*key, vec![vec![b, b + 1]], tokens).expect("finished");
    }
    // The request whose WRITE panics: D registers, P's prefill ends, P's writer posts.
    p.transport.inject_once(Fault::Panic);
    let met = Key::new(0x9a1c_0100, 1);
    d.engine.blocks_allocated(met, P_ENGINE, vec![vec![8, 9]], tokens).expect("registers");
    poll_until("P sees the registration", LIMIT, || p.engine.stats().counters.registrations, |n| *n == 1);
    p.engine.request_finished(met, vec![vec![8, 9]], tokens).expect("finished");
    let mut expect_sent: Vec<Key> = waiting.clone();
    expect_sent.push(met);
    expect_sent.sort_by_key(|k| k.transfer_id.0);
    let mut out = Vec::new();
    let sent = poll_until(
        "every request P held is released",
        LIMIT,
        || {
            p.engine.poll(&mut out);
            let mut keys: Vec<Key> =
                out.iter().filter_map(|f| if let Finished::Sent { key, .. } = f { Some(*key) } else { None }).collect();
            keys.sort_by_key(|k| k.transfer_id.0);
            keys
        },
        |keys| keys.len() >= expect_sent.len(),
    );
    assert_eq!(sent, expect_sent, "P's outcomes: {out:?}");
    // After the panic: a new prefill on the dead shard is answered at once.
    let late = Key::new(0x9a1c_0200, 1);
    p.engine.request_finished(late, vec![vec![10, 11]], tokens).expect("taken");
    wait_for(
        &p.engine,
        "the late request released",
        LIMIT,
        |f| matches!(f, Finished::Sent { key, .. } if *key == late),
    );
    wait_for(&d.engine, "D's request failed", LIMIT, |f| matches!(f, Finished::Failed { key, .. } if *key == met));
    assert_eq!(p.engine.stats().failures.writer_panic, 1, "the panic is counted once");
}

/// Issue 16, window 7: a pull reads only the blocks P pinned for it. D names other blocks than P
/// pinned (a stale or forged `remote_block_ids`): P's grant carries its pinned ids, D reads nothing,
/// the request fails, and P releases at once instead of at its read timeout (60 s). Then a pull
/// that names the pinned blocks reads them, every byte checked. (Before the fix D read the blocks
/// it was handed, whatever P had pinned.)
#[test]
fn a_pull_reads_only_the_blocks_the_producer_pinned() {
    let c = Cluster::new(Setup::new(Mode::Pull, 1, 1));
    let (p, d) = (&c.p[0], &c.d[0]);
    let tokens = 2 * u64::from(BLOCK_TOKENS);
    let (pinned, other) = (vec![vec![3, 4]], vec![vec![5, 6]]);
    // P's blocks 3 and 4 hold the request; 5 and 6 hold another request's KV.
    pattern::fill(p.engine.layout(), &p.buffers, &other, tokens, 0xbad).expect("other request");
    let seed = 0x5eed;
    pattern::fill(p.engine.layout(), &p.buffers, &pinned, tokens, seed).expect("prefill");
    let stale = Key::new(0x7a11_0001, 1);
    p.engine.request_finished(stale, pinned.clone(), tokens).expect("finished");
    let local = vec![vec![10, 11]];
    pattern::fill(d.engine.layout(), &d.buffers, &local, tokens, 0xd00d).expect("D's blocks marked");
    d.engine.start_pull(stale, P_ENGINE, other.clone(), local.clone(), tokens).expect("pull starts");
    let failed = wait_for(
        &d.engine,
        "the mismatched pull fails",
        LIMIT,
        |f| matches!(f, Finished::Failed { key, .. } | Finished::Received { key } if *key == stale),
    );
    assert!(matches!(failed, Finished::Failed { .. }), "D read blocks P did not pin: {failed:?}");
    wait_for(&p.engine, "P releases at once", LIMIT, |f| matches!(f, Finished::Sent { key, .. } if *key == stale));
    let untouched = pattern::verify(d.engine.layout(), &d.buffers, &local, tokens, 0xd00d).expect("reads");
    assert!(untouched.ok(), "D's blocks were written by a refused read: {untouched:?}");
    // The same blocks, named right, in a new request.
    let good = Key::new(0x7a11_0002, 1);
    p.engine.request_finished(good, pinned.clone(), tokens).expect("finished");
    d.engine.start_pull(good, P_ENGINE, pinned.clone(), local.clone(), tokens).expect("pull starts");
    wait_for(&d.engine, "received", LIMIT, |f| matches!(f, Finished::Received { key } if *key == good));
    let v = pattern::verify(d.engine.layout(), &d.buffers, &local, tokens, seed).expect("reads");
    assert!(v.ok(), "received but wrong: {v:?}");
    wait_for(&p.engine, "sent", LIMIT, |f| matches!(f, Finished::Sent { key, .. } if *key == good));
}

/// Issue 16, window 9: an engine's shutdown ends the transfers it posted before it returns, so the
/// caller may free its memory then. P's WRITE is held 1.5 s in the transport when P's engine is
/// dropped: the drop waits for it, and once it returns no transfer of P's is open. (Before the fix
/// the drop returned at once with the WRITE still reading P's memory.)
#[test]
fn shutdown_ends_the_transfers_it_posted() {
    let mut c = Cluster::new(Setup::new(Mode::Push, 1, 1));
    let key = Key::new(0x5d0_0001, 1);
    let blocks = vec![vec![3, 4]];
    let tokens = 2 * u64::from(BLOCK_TOKENS);
    c.d[0].engine.blocks_allocated(key, P_ENGINE, blocks.clone(), tokens).expect("registers");
    let p = c.p.remove(0);
    poll_until("P sees the registration", LIMIT, || p.engine.stats().counters.registrations, |n| *n == 1);
    let hold = Duration::from_millis(1500);
    p.transport.inject_once(Fault::Delay(hold));
    p.engine.request_finished(key, blocks, tokens).expect("finished");
    poll_until("P posts its WRITE", LIMIT, || p.engine.stats().counters.posts, |n| *n == 1);
    assert_eq!(p.transport.open_transfers(), 1, "the WRITE is in flight");
    let started = std::time::Instant::now();
    let kvpush_testkit::engines::Worker { engine, transport, buffers } = p;
    drop(engine);
    assert_eq!(transport.open_transfers(), 0, "shutdown returned with a transfer still open");
    assert!(started.elapsed() < hold + Duration::from_secs(3), "shutdown waited past the transfer's end");
    drop(buffers);
}

/// Issue 16, window 8: an engine holding the secret that knows the transfer id registers it before
/// the real D. P names D as the request's consumer: D receives every byte, the intruder is told the
/// request failed and its blocks are never written. (Before the fix the key went to the first engine
/// that registered: the intruder received the KV and D was refused.)
#[test]
fn an_intruder_registering_first_gets_nothing_when_p_names_the_consumer() {
    let c = Cluster::new(Setup::new(Mode::Push, 1, 1));
    let intruders = c.extra_consumer("intruder", 1);
    let (p, d, x) = (&c.p[0], &c.d[0], &intruders[0]);
    let key = Key::new(0x8_0001, 1);
    let tokens = 2 * u64::from(BLOCK_TOKENS);
    let blocks = vec![vec![3, 4]];
    pattern::fill(x.engine.layout(), &x.buffers, &blocks, tokens, 0xd00d).expect("intruder's blocks marked");
    x.engine.blocks_allocated(key, P_ENGINE, blocks.clone(), tokens).expect("intruder registers");
    poll_until("P sees the intruder", LIMIT, || p.engine.stats().counters.registrations, |n| *n == 1);
    d.engine.blocks_allocated(key, P_ENGINE, blocks.clone(), tokens).expect("D registers");
    poll_until("P sees D", LIMIT, || p.engine.stats().counters.registrations, |n| *n == 2);
    let seed = 0x5eed;
    pattern::fill(p.engine.layout(), &p.buffers, &blocks, tokens, seed).expect("prefill");
    p.engine.request_finished_for(key, blocks.clone(), tokens, Some(D_ENGINE)).expect("finished");
    wait_for(&d.engine, "D receives", LIMIT, |f| matches!(f, Finished::Received { key: k } if *k == key));
    let v = pattern::verify(d.engine.layout(), &d.buffers, &blocks, tokens, seed).expect("reads");
    assert!(v.ok(), "received but wrong: {v:?}");
    let told = wait_for(&x.engine, "the intruder is answered", LIMIT, |f| outcome_key(f) == key);
    assert!(matches!(told, Finished::Failed { .. }), "the intruder got {told:?}");
    let untouched = pattern::verify(x.engine.layout(), &x.buffers, &blocks, tokens, 0xd00d).expect("reads");
    assert!(untouched.ok(), "the intruder's blocks were written: {untouched:?}");
    wait_for(&p.engine, "sent", LIMIT, |f| matches!(f, Finished::Sent { key: k, .. } if *k == key));
    // An empty consumer id is refused at the call, not taken for "no consumer".
    let other = Key::new(0x8_0002, 1);
    assert!(p.engine.request_finished_for(other, blocks, tokens, Some("")).is_err());
}
