//! Fail closed (issue 16): no byte lands in a block after its owner was told the block is free, and
//! only the data path says that data landed. Each test drives one P and one D worker by hand on the
//! loopback transport and looks at the bytes in memory after an outcome.

use std::sync::Arc;
use std::time::Duration;

use kvpush::engine::side::{ConnId, Incarnation};
use kvpush::engine::{Finished, LocalHub, Staging};
use kvpush::proto::codec;
use kvpush::proto::msg::{Completion, Message};
use kvpush::proto::{Key, Mode};
use kvpush::transport::loopback::{Fabric, Fault, LoopbackStats};
use kvpush::transport::trust::DataKeys;
use kvpush_testkit::demo::pattern;
use kvpush_testkit::engines::{connect_as, connect_over, cut, cut_over, poll_until, wait_for, Worker};
use kvpush_testkit::stress::{build_side, outcome_key, Cluster, Setup, BLOCK_TOKENS, D_ENGINE, P_ENGINE};

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

/// What the engine logs while `f` runs on this thread, at warn level and above.
fn logged_by(f: impl FnOnce()) -> String {
    #[derive(Clone, Default)]
    struct Capture(Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Capture {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap_or_else(|e| e.into_inner()).extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let capture = Capture::default();
    let writer = capture.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    let bytes = capture.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// `Engine::shutdown` stops the writers and takes the regions out of the transport once: the drop
/// that ends `shutdown` does nothing more. (Before, it deregistered every region a second time and
/// logged an error per region, "cannot deregister KV memory at shutdown … is not registered".)
#[test]
fn shutdown_deregisters_each_region_once() {
    let mut c = Cluster::new(Setup::new(Mode::Push, 1, 1));
    let kvpush_testkit::engines::Worker { engine, transport, buffers } = c.p.remove(0);
    let logs = logged_by(|| {
        engine.shutdown();
    });
    assert!(!logs.contains("cannot deregister"), "{logs}");
    drop((transport, buffers));
}

/// A P and a D worker that know each other as side-channel processes (so either can be lost).
fn pair(setup: Setup) -> (Worker, Worker, Arc<LocalHub>, Fabric) {
    let (fabric, hub) = (Fabric::new(), LocalHub::new());
    let p = build_side(&setup, P_ENGINE, 1, &fabric, &hub).remove(0);
    let d = build_side(&setup, D_ENGINE, 1, &fabric, &hub).remove(0);
    connect_as(&p.engine, P_INC, &d.engine, D_INC);
    (p, d, hub, fabric)
}

const P_INC: Incarnation = Incarnation(0x9);
const D_INC: Incarnation = Incarnation(0xd);

/// A pull of `key` whose READ the data path holds: P finished `key` in blocks 3 and 4 (filled, seed
/// 0x5eed), D's transport delays its next transfer by `delay`, and D starts reading into blocks 10
/// and 11. Returns D's blocks and the token count.
fn delayed_pull(p: &Worker, d: &Worker, key: Key, delay: Duration) -> (Vec<Vec<u32>>, u64) {
    let (src, dst) = (vec![vec![3, 4]], vec![vec![10, 11]]);
    let tokens = 2 * u64::from(BLOCK_TOKENS);
    pattern::fill(p.engine.layout(), &p.buffers, &src, tokens, 0x5eed).expect("prefill");
    p.engine.request_finished(key, src.clone(), tokens).expect("finished");
    d.transport.inject_once(Fault::Delay(delay));
    d.engine.start_pull(key, P_ENGINE, src, dst.clone(), tokens).expect("pull starts");
    (dst, tokens)
}

/// Whether `s` saw one transfer or notification of `p`'s end: landed (its notification sent) or
/// refused (failed).
fn one_ended(s: &LoopbackStats) -> bool {
    s.failed_transfers + s.notifications_sent == 1
}

/// What the owner writes into blocks it was given back (and reuses).
const CANARY: u64 = 0xca9a;

/// The owner reuses `blocks` of `d` at once: the canary goes in.
fn reuse(d: &Worker, blocks: &[Vec<u32>], tokens: u64) {
    pattern::fill(d.engine.layout(), &d.buffers, blocks, tokens, CANARY).expect("reuse");
}

/// Nothing landed in `blocks` of `d` since [`reuse`]; `what` says what would have.
fn assert_untouched(d: &Worker, blocks: &[Vec<u32>], tokens: u64, what: &str) {
    let v = pattern::verify(d.engine.layout(), &d.buffers, blocks, tokens, CANARY).expect("reads");
    assert!(v.ok(), "{what}: {v:?}");
}

/// D registers `blocks` for `key` and P posts its WRITE, which the data path holds for `hold`.
fn write_held(p: &Worker, d: &Worker, key: Key, blocks: &[Vec<u32>], tokens: u64, hold: Duration) {
    d.engine.blocks_allocated(key, P_ENGINE, blocks.to_vec(), tokens).expect("registers");
    poll_until("P sees the registration", LIMIT, || p.engine.stats().counters.registrations, |n| *n == 1);
    p.transport.inject_once(Fault::Delay(hold));
    pattern::fill(p.engine.layout(), &p.buffers, blocks, tokens, 0xda7a).expect("prefill");
    p.engine.request_finished(key, blocks.to_vec(), tokens).expect("finished");
    poll_until("P posts its WRITE", LIMIT, || p.transport.stats().posts, |n| *n == 1);
}

/// Issue 16, window 1, a data path that can fence (loopback): the side channel is lost while P's
/// WRITE is still on its way (the data path is slow, not broken). D fences P's access and reports
/// the request failed at once; its owner reuses the blocks (a canary is written into them), and
/// P's WRITE must never land on top of it. P releases its sources only once its WRITE ended.
/// (Before the fix P released its sources while the WRITE was pending, and the WRITE then overwrote
/// the canary in D's reused blocks.)
#[test]
fn a_lost_peer_never_writes_into_blocks_given_back() {
    let (p, d, _hub, _fabric) = pair(Setup::new(Mode::Push, 1, 1));
    let key = Key::new(0x10_57, 1);
    let blocks = vec![vec![5, 6, 7]];
    let tokens = 3 * u64::from(BLOCK_TOKENS);
    write_held(&p, &d, key, &blocks, tokens, Duration::from_millis(300));
    cut(&p.engine, P_INC, &d.engine, D_INC);
    // D's outcome gives the blocks back: the owner reuses them at once.
    let out = wait_for(&d.engine, "an outcome", LIMIT, |f| f.key() == key);
    assert!(matches!(out, Finished::Failed { .. }), "a fenced peer's request fails plainly: {out:?}");
    reuse(&d, &blocks, tokens);
    // P's release: its WRITE must have ended by then (its handle released by the writer).
    wait_for(&p.engine, "P's release", LIMIT, |f| matches!(f, Finished::Sent { .. }));
    assert_eq!(p.transport.open_transfers(), 0, "P released its sources while its WRITE was in flight");
    poll_until("P's WRITE ends", LIMIT, || p.transport.stats(), one_ended);
    assert_untouched(&d, &blocks, tokens, &format!("a WRITE of the lost peer landed after D reported {out:?}"));
}

/// Issue 16, window 1, a data path that cannot fence (as NIXL over UCX): the side channel is lost
/// while P's WRITE is held in the data path. D must report the request's end in time (a killed P
/// must never hang D's requests), but must not give its blocks back while the WRITE can land: the
/// outcome is `Quarantined`, and the WRITE does land into the held blocks. The blocks come back
/// (`Released`) once P returns as a new process, and only then does the owner reuse them. (Before
/// the fix D reported `Failed` at once and the WRITE overwrote the reused blocks.)
#[test]
fn an_unfenceable_lost_peer_gets_its_requests_failed_in_time_and_their_blocks_quarantined() {
    let (p, d, _hub, _fabric) = pair(Setup::new(Mode::Push, 1, 1));
    d.transport.set_unfenceable(true);
    let key = Key::new(0x10_58, 1);
    let blocks = vec![vec![5, 6, 7]];
    let tokens = 3 * u64::from(BLOCK_TOKENS);
    write_held(&p, &d, key, &blocks, tokens, Duration::from_millis(300));
    reuse(&d, &blocks, tokens);
    let cut_at = std::time::Instant::now();
    cut(&p.engine, P_INC, &d.engine, D_INC);
    let out = wait_for(&d.engine, "an outcome", LIMIT, |f| f.key() == key);
    assert!(cut_at.elapsed() < Duration::from_millis(250), "the outcome waited for the WRITE: {:?}", cut_at.elapsed());
    match &out {
        Finished::Quarantined { failed, blocks: held, .. } => {
            assert!(*failed, "the request failed: {out:?}");
            assert_eq!(held, &blocks, "the quarantine names the request's blocks");
        }
        other => panic!("a lost, unfenced peer's blocks were given back: {other:?}"),
    }
    assert_eq!(d.engine.stats().counters.quarantined, 1, "the quarantine is counted");
    // The held WRITE lands into the quarantined blocks, which nobody reused.
    poll_until("P's WRITE ends", LIMIT, || p.transport.stats(), one_ended);
    let mut seen = Vec::new();
    d.engine.poll(&mut seen);
    assert!(seen.iter().all(|f| !matches!(f, Finished::Released { .. })), "released before a fence: {seen:?}");
    // P comes back as a new process: the old one is gone, the blocks are free again.
    connect_as(&p.engine, Incarnation(0xa), &d.engine, D_INC);
    wait_for(&d.engine, "the blocks released", LIMIT, |f| matches!(f, Finished::Released { key: k } if *k == key));
}

/// A P and a D worker ([`pair`] of `setup`), D's data path unable to fence: D registers `key`, P's
/// WRITE into it is held 3 s in the data path, and the side channel is cut, so D reports `key`
/// quarantined (checked).
fn quarantined_at_the_cut(setup: Setup, key: Key) -> (Worker, Worker, Arc<LocalHub>, Fabric) {
    let (p, d, hub, fabric) = pair(setup);
    d.transport.set_unfenceable(true);
    let tokens = 2 * u64::from(BLOCK_TOKENS);
    write_held(&p, &d, key, &[vec![5, 6]], tokens, Duration::from_secs(3));
    cut(&p.engine, P_INC, &d.engine, D_INC);
    let out = wait_for(&d.engine, "an outcome", LIMIT, |f| f.key() == key);
    assert!(matches!(out, Finished::Quarantined { .. }), "a lost, unfenced peer's blocks: {out:?}");
    (p, d, hub, fabric)
}

/// Issue 16, shutdown with quarantined blocks: D's request is quarantined (P lost without a fence
/// while its WRITE is held in the data path: over UCX shared memory, CMA, no deregistration stops
/// a peer process that still runs). `shutdown` must not return, saying the memory may be freed,
/// while that WRITE can land: it waits (up to `Config::shutdown_wait_us`) for the quarantine to
/// end, here P returning as a new process 300 ms in, and then reports everything fenced. (Before,
/// shutdown returned at once, deregistered, and the C API told the caller to free the memory.)
#[test]
fn shutdown_waits_for_quarantined_blocks_to_be_released() {
    let (p, d, _hub, _fabric) = quarantined_at_the_cut(Setup::new(Mode::Push, 1, 1), Key::new(0x16_0901, 1));
    // P comes back as a new process while D shuts down (as `connect_as` does on D's side).
    let d_side = d.engine.endpoint().upgrade().expect("D's endpoint");
    let p_handshake = p.engine.handshake().expect("handshake");
    let returns = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let keys = DataKeys { send: [0xa5; 32], recv: [0xb5; 32] };
        d_side.add_peer(&p_handshake, Incarnation(0xa), ConnId(0), keys).expect("P's new process accepted");
    });
    let Worker { engine, transport, buffers } = d;
    let started = std::time::Instant::now();
    let report = engine.shutdown();
    let waited = started.elapsed();
    returns.join().expect("P returned");
    assert!(report.fenced(), "the quarantine ended within the wait: {report:?}");
    assert!(waited >= Duration::from_millis(250), "shutdown returned after {waited:?}, before the quarantine ended");
    assert!(!one_ended(&p.transport.stats()), "P's WRITE ended meanwhile: the test proved nothing");
    drop((transport, buffers));
}

/// The same quarantine, P never returning within the wait (300 ms here): `shutdown` gives up at
/// the wait's end and reports the request whose blocks the lost peer may still write
/// (`ShutdownReport::quarantined`; the C API's destroy answers `KVPUSH_ERR_UNFENCED`), so the
/// caller keeps that memory. (Before, nothing was reported.)
#[test]
fn shutdown_reports_the_blocks_a_lost_peer_may_still_write() {
    let mut setup = Setup::new(Mode::Push, 1, 1);
    setup.shutdown_wait = Duration::from_millis(300);
    let key = Key::new(0x16_0902, 1);
    let (p, d, _hub, _fabric) = quarantined_at_the_cut(setup, key);
    let Worker { engine, transport, buffers } = d;
    let started = std::time::Instant::now();
    let report = engine.shutdown();
    let waited = started.elapsed();
    assert_eq!(report.quarantined, vec![key], "{report:?}");
    assert!(!report.fenced(), "{report:?}");
    assert!(waited >= Duration::from_millis(300), "shutdown gave up after {waited:?}, before its wait");
    assert!(!one_ended(&p.transport.stats()), "P's WRITE ended meanwhile: the test proved nothing");
    drop((transport, buffers));
}

/// Issue 17 (P TP 1 → D TP 2 over vLLM): D's first side-channel connection to P closed right
/// after D had handshaken again over a second one, under the same incarnation. The close of the
/// replaced connection is not a lost peer: neither side loses the other, and what D registers
/// over the new connection is served, every byte landing. (Before the fix P declared D lost at
/// the close, forgot the entry of the new connection, and dropped D's registrations as "from a
/// previous process of the peer"; D's request then failed at its timeout.)
#[test]
fn a_replaced_connection_closing_loses_no_peer_and_the_new_one_is_served() {
    let (p, d, _hub, _fabric) = pair(Setup::new(Mode::Push, 1, 1));
    // The same two processes handshake again over connection 1; then connection 0 closes.
    connect_over(&p.engine, P_INC, &d.engine, D_INC, ConnId(1));
    let (p_lost_d, d_lost_p) = cut_over(&p.engine, P_INC, &d.engine, D_INC, ConnId(0));
    assert!(!p_lost_d && !d_lost_p, "a replaced connection's close was taken as a loss: P {p_lost_d}, D {d_lost_p}");
    let key = Key::new(0x17_0001, 1);
    let blocks = vec![vec![2, 3]];
    let tokens = 2 * u64::from(BLOCK_TOKENS);
    d.engine.blocks_allocated(key, P_ENGINE, blocks.clone(), tokens).expect("registers");
    poll_until("P takes the registration", LIMIT, || p.engine.stats().counters.registrations, |n| *n == 1);
    pattern::fill(p.engine.layout(), &p.buffers, &blocks, tokens, 0x17).expect("prefill");
    p.engine.request_finished(key, blocks.clone(), tokens).expect("finished");
    let out = wait_for(&d.engine, "D's outcome", LIMIT, |f| f.key() == key);
    assert!(matches!(out, Finished::Received { .. }), "D's request over the new connection: {out:?}");
    let v = pattern::verify(d.engine.layout(), &d.buffers, &blocks, tokens, 0x17).expect("reads");
    assert!(v.ok(), "P's bytes in D's blocks: {v:?}");
    wait_for(&p.engine, "P's release", LIMIT, |f| matches!(f, Finished::Sent { key: k, .. } if *k == key));
    assert_eq!(p.engine.stats().failures.unknown_peer, 0, "P dropped a frame of D's live process");
    // The connection the peers are known by now is the one whose loss counts.
    let (p_lost_d, d_lost_p) = cut_over(&p.engine, P_INC, &d.engine, D_INC, ConnId(1));
    assert!(p_lost_d && d_lost_p, "the current connection's close is a loss: P {p_lost_d}, D {d_lost_p}");
}

/// Issue 16 with issue 17's reconnection: a producer lost while its WRITE may still land (an
/// unfenceable data path) that then reconnects as the *same* process has not gone away, and neither
/// has its WRITE: D's quarantine stays. Only P returning as a new process frees the blocks.
/// (Before the fix any handshake of the peer lifted the quarantine, the same process's included.)
#[test]
fn a_lost_peer_reconnecting_as_the_same_process_keeps_its_quarantine() {
    let (p, d, _hub, _fabric) = pair(Setup::new(Mode::Push, 1, 1));
    d.transport.set_unfenceable(true);
    let key = Key::new(0x17_0002, 1);
    let blocks = vec![vec![5, 6]];
    let tokens = 2 * u64::from(BLOCK_TOKENS);
    // Held long past what this test watches: its end (P's final word) would release the blocks.
    write_held(&p, &d, key, &blocks, tokens, Duration::from_secs(3));
    let (p_lost_d, d_lost_p) = cut_over(&p.engine, P_INC, &d.engine, D_INC, ConnId(0));
    assert!(p_lost_d && d_lost_p, "the only connection's close is a loss");
    let out = wait_for(&d.engine, "an outcome", LIMIT, |f| f.key() == key);
    assert!(matches!(out, Finished::Quarantined { .. }), "a lost, unfenced peer's blocks: {out:?}");
    // The same P process handshakes again: what it posted may still land.
    connect_over(&p.engine, P_INC, &d.engine, D_INC, ConnId(1));
    let mut seen = Vec::new();
    let watched = std::time::Instant::now();
    while watched.elapsed() < Duration::from_millis(500) {
        d.engine.poll(&mut seen);
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        seen.iter().all(|f| !matches!(f, Finished::Released { .. })),
        "the quarantine was lifted by the same process reconnecting: {seen:?}"
    );
    assert!(!one_ended(&p.transport.stats()), "P's WRITE ended while the test watched: the check proved nothing");
    // P comes back as a new process: the old one is gone, the blocks are free again.
    connect_over(&p.engine, Incarnation(0xa), &d.engine, D_INC, ConnId(2));
    wait_for(&d.engine, "the blocks released", LIMIT, |f| matches!(f, Finished::Released { key: k } if *k == key));
}

/// Issue 16, pull on P: the side channel to D is lost while D's READ of P's sources is held in the
/// data path, and P's data path cannot fence D (as NIXL). P must not give its sources back while
/// that READ can still read them (their owner would reuse them under it): the grant is quarantined,
/// and the sources come back only once D returns as a new process. (Before the fix P ended the
/// grant and released its sources at the cut.)
#[test]
fn a_lost_consumers_read_keeps_ps_sources_quarantined_until_it_returns() {
    let (p, d, _hub, _fabric) = pair(Setup::new(Mode::Pull, 1, 1));
    p.transport.set_unfenceable(true);
    let key = Key::new(0x9a47_0002, 1);
    delayed_pull(&p, &d, key, Duration::from_millis(400));
    poll_until("D posts its READ", LIMIT, || d.transport.stats().posts, |n| *n == 1);
    cut(&p.engine, P_INC, &d.engine, D_INC);
    let mut early = Vec::new();
    poll_until(
        "D's READ ends",
        LIMIT,
        || {
            p.engine.poll(&mut early);
            d.transport.stats()
        },
        one_ended,
    );
    p.engine.poll(&mut early);
    assert!(
        !early.iter().any(|f| matches!(f, Finished::Sent { key: k, .. } if *k == key)),
        "P released its sources while the lost consumer's READ could still read them: {early:?}"
    );
    assert_eq!(p.engine.stats().counters.quarantined, 1, "the quarantine is counted");
    // D comes back as a new process: the old one, and its READ, are gone.
    connect_as(&p.engine, P_INC, &d.engine, Incarnation(0xd2));
    wait_for(&p.engine, "P's release", LIMIT, |f| matches!(f, Finished::Sent { key: k, .. } if *k == key));
}

/// Issue 16, window 3: D gave up on a request (abort) while P's WRITE was held in the data path
/// past D's drain timeout. The outcome is due at the drain timeout, but the WRITE can still land:
/// the blocks must stay held until P's final word (its WRITE's end). The owner reuses them only at
/// `Released`, and nothing of P lands after that. (Before the fix D reported `Ended` at the drain
/// timeout and the WRITE overwrote the reused blocks.)
#[test]
fn the_drain_timeout_reports_in_time_but_holds_the_blocks_until_the_producer_ended() {
    let c = Cluster::new(Setup { drain_timeout: Duration::from_millis(100), ..Setup::new(Mode::Push, 1, 1) });
    let (p, d) = (&c.p[0], &c.d[0]);
    let key = Key::new(0xd4a1_0001, 1);
    let blocks = vec![vec![5, 6]];
    let tokens = 2 * u64::from(BLOCK_TOKENS);
    write_held(p, d, key, &blocks, tokens, Duration::from_millis(600));
    let aborted_at = std::time::Instant::now();
    d.engine.abort(key).expect("abort");
    let out = wait_for(&d.engine, "an outcome", LIMIT, |f| f.key() == key);
    assert!(aborted_at.elapsed() < Duration::from_millis(500), "the outcome waited for the WRITE");
    assert!(
        matches!(out, Finished::Quarantined { failed: false, .. }),
        "the drain timeout gave back blocks a WRITE can still land in: {out:?}"
    );
    wait_for(&d.engine, "the blocks released", LIMIT, |f| matches!(f, Finished::Released { key: k } if *k == key));
    assert!(aborted_at.elapsed() >= Duration::from_millis(550), "released before the WRITE ended");
    reuse(d, &blocks, tokens);
    wait_for(&p.engine, "P's release", LIMIT, |f| matches!(f, Finished::Sent { .. }));
    std::thread::sleep(Duration::from_millis(100));
    assert_untouched(d, &blocks, tokens, "a WRITE landed after the blocks were released");
}

/// Issue 16, window 3, the notification lost (`vllm48633_l1_liveness_random_faults` held some of
/// D's blocks for the 120 s bound): D gives up on a request while P's WRITE into it is in flight
/// (here queued behind another, held WRITE), so P does not answer D's abort; the WRITE then lands
/// but its notification, P's final word, is lost. P says on the control link that the WRITE ended,
/// and D releases the blocks then, not at the bound. (Before the fix D held them until the bound.)
#[test]
fn a_write_whose_notification_is_lost_after_the_abort_is_still_answered() {
    let c = Cluster::new(Setup { drain_timeout: Duration::from_millis(100), ..Setup::new(Mode::Push, 1, 1) });
    let (p, d) = (&c.p[0], &c.d[0]);
    let (first, key) = (Key::new(0x11a1_0001, 1), Key::new(0x11a1_0002, 1));
    let tokens = 2 * u64::from(BLOCK_TOKENS);
    let (held, blocks) = (vec![vec![3, 4]], vec![vec![5, 6]]);
    write_held(p, d, first, &held, tokens, Duration::from_millis(400));
    d.engine.blocks_allocated(key, P_ENGINE, blocks.clone(), tokens).expect("registers");
    poll_until("P sees the registration", LIMIT, || p.engine.stats().counters.registrations, |n| *n == 2);
    p.transport.inject_once(Fault::LoseNotification);
    p.engine.request_finished(key, blocks.clone(), tokens).expect("finished");
    poll_until("P posts its WRITE", LIMIT, || p.transport.stats().posts, |n| *n == 2);
    let aborted_at = std::time::Instant::now();
    d.engine.abort(key).expect("abort");
    let out = wait_for(&d.engine, "an outcome", LIMIT, |f| f.key() == key);
    assert!(matches!(out, Finished::Quarantined { failed: false, .. }), "{out:?}");
    wait_for(&d.engine, "the blocks released", LIMIT, |f| matches!(f, Finished::Released { key: k } if *k == key));
    assert!(aborted_at.elapsed() >= Duration::from_millis(300), "released before the WRITE ended");
    assert_eq!(d.engine.stats().failures.quarantine_expired, 0, "released by P's word, not the bound");
    wait_for(&p.engine, "P's release", LIMIT, |f| matches!(f, Finished::Sent { key: k, .. } if *k == key));
}

/// Issue 16, window 4: in a pull, P's grant expires while D's READ is held in the data path. P
/// tells D; D must not report the request (giving its blocks back) while its own READ can still
/// land in them: it cancels the READ and reports once the READ ended. The owner reuses the blocks
/// at the outcome, and the READ never overwrites them. (Before the fix D reported `Failed` at once
/// and the READ then copied P's bytes over the reused blocks.)
#[test]
fn a_pull_whose_grant_expires_reports_only_after_its_read_ended() {
    let key = Key::new(0x9a47_0001, 1);
    let (c, dst, tokens) = pull_past_its_read_timeout(key);
    let d = &c.d[0];
    let out = wait_for(&d.engine, "an outcome", LIMIT, |f| f.key() == key);
    assert!(matches!(out, Finished::Failed { .. }), "the read's grant expired: {out:?}");
    assert_eq!(d.transport.open_transfers(), 0, "D reported while its READ was in flight");
    reuse(d, &dst, tokens);
    poll_until("D's READ ends", LIMIT, || d.transport.stats(), one_ended);
    std::thread::sleep(Duration::from_millis(50));
    assert_untouched(d, &dst, tokens, &format!("D's READ landed after D reported {out:?}"));
}

/// A pull of `key` whose READ D's data path holds for 500 ms, past P's read timeout (100 ms): the
/// cluster, D's blocks and the tokens.
fn pull_past_its_read_timeout(key: Key) -> (Cluster, Vec<Vec<u32>>, u64) {
    let c = Cluster::new(Setup { pull_read_timeout: Duration::from_millis(100), ..Setup::new(Mode::Pull, 1, 1) });
    let (dst, tokens) = delayed_pull(&c.p[0], &c.d[0], key, Duration::from_millis(500));
    (c, dst, tokens)
}

/// Issue 16, window 4 on P: P's grant expires while D's READ of its sources is held in D's data
/// path. P tells D (which fails the request and cancels the READ), but must not give its sources
/// back while that READ can still read them: their owner reuses them at `Sent`, and a READ that
/// completes afterwards hands D other bytes (taken as its KV if it completes before P's failure
/// reaches D). P releases only once D said the READ ended. (Before the fix P released its sources
/// at the expiry, 400 ms before the READ ended.)
#[test]
fn a_pull_grant_that_expires_keeps_the_sources_until_the_read_ended() {
    let key = Key::new(0x9a47_0003, 1);
    let (c, _, _) = pull_past_its_read_timeout(key);
    let (p, d) = (&c.p[0], &c.d[0]);
    poll_until("D posts its READ", LIMIT, || d.transport.stats().posts, |n| *n == 1);
    let sent = wait_for(&p.engine, "P's release", LIMIT, |f| matches!(f, Finished::Sent { key: k, .. } if *k == key));
    // Ended: its notification went out (it completed) or it failed; D may not have polled it yet.
    assert!(one_ended(&d.transport.stats()), "P released its sources ({sent:?}) while D's READ could still read them");
    assert_eq!(p.engine.stats().failures.timeout, 1, "the expiry is counted");
    assert_eq!(p.engine.stats().failures.quarantine_expired, 0, "released by D's word, not the bound");
    let out = wait_for(&d.engine, "an outcome", LIMIT, |f| f.key() == key);
    assert!(matches!(out, Finished::Failed { .. }), "the read's grant expired: {out:?}");
}

/// The other side of holding an expired grant: D's READ completed (D received the request) but its
/// notification to P was lost, so P's grant expires with nothing of D's in flight. D answers P's
/// failure at once ("no read in flight") and P releases its sources then, not at the quarantine
/// bound (120 s). (Before that answer P held them for the bound.)
#[test]
fn an_expired_grant_whose_read_ended_unheard_is_released_at_ds_answer() {
    let mut setup = Setup::new(Mode::Pull, 1, 1);
    setup.pull_read_timeout = Duration::from_millis(100);
    let c = Cluster::new(setup);
    let (p, d) = (&c.p[0], &c.d[0]);
    let key = Key::new(0x9a47_0004, 1);
    let (src, dst) = (vec![vec![3, 4]], vec![vec![10, 11]]);
    let tokens = 2 * u64::from(BLOCK_TOKENS);
    pattern::fill(p.engine.layout(), &p.buffers, &src, tokens, 0x5eed).expect("prefill");
    p.engine.request_finished(key, src.clone(), tokens).expect("finished");
    d.transport.inject_once(Fault::LoseNotification);
    d.engine.start_pull(key, P_ENGINE, src, dst, tokens).expect("pull starts");
    let out = wait_for(&d.engine, "D's outcome", LIMIT, |f| f.key() == key);
    assert!(matches!(out, Finished::Received { .. }), "{out:?}");
    wait_for(&p.engine, "P's release", LIMIT, |f| matches!(f, Finished::Sent { key: k, .. } if *k == key));
    assert_eq!(p.engine.stats().failures.timeout, 1, "the grant expired");
    assert_eq!(p.engine.stats().failures.quarantine_expired, 0, "released by D's answer, not the bound");
}

/// Issue 16, window 3 with staging: D aborts while P's staged pieces queue behind a held one (one
/// receive slot), P never hears of the abort (its control link to D is gone, the data path runs
/// on), and the drain timeout passes. From then on nothing more of the request may be granted or
/// scattered into D's quarantined blocks: P writes only the piece already on the wire, learns that
/// the transfer failed, and its failure is the final word that releases D's blocks. (Before the
/// fix D's receiver kept granting and scattering the queued pieces, and P wrote every one of them.)
#[test]
fn after_the_drain_timeout_no_staged_piece_of_the_request_is_granted_or_scattered() {
    let mut setup = crate::engine_stress::staged(Setup::new(Mode::Push, 1, 1));
    if let Staging::On(c) = &mut setup.staging {
        c.slots = 1;
    }
    setup.drain_timeout = Duration::from_millis(100);
    let (p, d, hub, _fabric) = pair(setup);
    let key = Key::new(0xd4a1_5a9e, 1);
    let blocks = vec![(3..15).collect::<Vec<u32>>()];
    let tokens = 12 * u64::from(BLOCK_TOKENS);
    let hold = Duration::from_millis(500);
    write_held(&p, &d, key, &blocks, tokens, hold);
    hub.detach(p.engine.addr());
    let aborted_at = std::time::Instant::now();
    d.engine.abort(key).expect("abort");
    let out = wait_for(&d.engine, "an outcome", LIMIT, |f| f.key() == key);
    assert!(matches!(out, Finished::Quarantined { failed: false, .. }), "{out:?}");
    wait_for(&d.engine, "the blocks released", LIMIT, |f| matches!(f, Finished::Released { key: k } if *k == key));
    assert!(aborted_at.elapsed() < Duration::from_secs(5), "released only by a timeout");
    let sent = wait_for(&p.engine, "P's release", LIMIT, |f| matches!(f, Finished::Sent { key: k, .. } if *k == key));
    let pc = p.engine.staging_counts().expect("staged");
    let slot_bytes = 8192;
    assert!(pc.bytes > slot_bytes, "the request fits one piece, nothing could queue: {pc:?}");
    assert_eq!(pc.pieces, 1, "P wrote queued pieces after D's drain timeout ({sent:?}): {pc:?}");
    assert_eq!(pc.failed, 1, "{pc:?}");
    let dc = d.engine.staging_counts().expect("staged");
    assert_eq!(dc.received, 0, "D delivered the request after its drain timeout: {dc:?}");
}

/// Issue 16, window 2: staged receive slots. P's WRITE of a piece into D's only receive slot is held
/// in the data path when the side channel to P is lost, and D's data path cannot fence P (as NIXL).
/// The slot must not be granted to another sender while P's WRITE can still land in it (it would be
/// scattered into that sender's request): a second producer's request waits for the slot until the
/// quarantine bound, and is received intact after P's WRITE ended. (Before the fix the slot was
/// freed at once and granted to the second producer while P's WRITE was in flight.)
#[test]
fn a_staged_slot_granted_to_a_lost_sender_is_not_granted_again_while_its_write_can_land() {
    let mut setup = crate::engine_stress::staged(Setup::new(Mode::Push, 1, 1));
    let quarantine = Duration::from_millis(1200);
    if let Staging::On(c) = &mut setup.staging {
        c.slots = 1;
        c.quarantine = quarantine;
    }
    let (p, d, hub, fabric) = pair(setup.clone());
    let p2 = build_side(&setup, "prefill-b", 1, &fabric, &hub).remove(0);
    connect_as(&p2.engine, Incarnation(0xb), &d.engine, D_INC);
    d.transport.set_unfenceable(true);
    let tokens = 2 * u64::from(BLOCK_TOKENS);
    let lost = Key::new(0x57a6_0001, 1);
    let hold = Duration::from_millis(500);
    write_held(&p, &d, lost, &[vec![3, 4]], tokens, hold);
    let cut_at = std::time::Instant::now();
    cut(&p.engine, P_INC, &d.engine, D_INC);
    wait_for(&d.engine, "the lost request ends", LIMIT, |f| f.key() == lost);
    // Another producer's request wants D's only receive slot.
    let key = Key::new(0x57a6_0002, 1);
    let blocks = vec![vec![7, 8]];
    d.engine.blocks_allocated(key, "prefill-b", blocks.clone(), tokens).expect("registers");
    poll_until("P2 sees the registration", LIMIT, || p2.engine.stats().counters.registrations, |n| *n == 1);
    let seed = 0x5eedb;
    pattern::fill(p2.engine.layout(), &p2.buffers, &blocks, tokens, seed).expect("prefill");
    p2.engine.request_finished(key, blocks.clone(), tokens).expect("finished");
    let got = wait_for(&d.engine, "the second request", LIMIT, |f| f.key() == key);
    assert!(matches!(got, Finished::Received { .. }), "{got:?}");
    let waited = cut_at.elapsed();
    // P's WRITE was posted before the cut and held for `hold` < `quarantine`: a grant before the
    // quarantine ended is a grant while that WRITE could still land.
    assert!(
        waited >= quarantine,
        "the slot was granted again {waited:?} after the cut, while the lost sender's WRITE (held {hold:?}) could land"
    );
    let v = pattern::verify(d.engine.layout(), &d.buffers, &blocks, tokens, seed).expect("reads");
    assert!(v.ok(), "received but wrong: {v:?}");
    let counts = d.engine.staging_counts().expect("staged");
    assert_eq!(counts.slots_quarantined, 1, "{counts:?}");
}

/// Issue 16, window 8: an engine holding the secret that knows the transfer id registers it before
/// the real D. P names D as the request's consumer: D receives every byte, the intruder is told the
/// request failed and its blocks are never written. (Before the fix the key went to the first engine
/// that registered: the intruder received the KV and D was refused.)
#[test]
fn an_intruder_registering_first_gets_nothing_when_p_names_the_consumer() {
    let c = intruder_gets_nothing(|p, key, blocks, tokens| {
        p.request_finished_for(key, blocks, tokens, Some(D_ENGINE)).expect("finished");
    });
    // An empty consumer id is refused at the call, not taken for "no consumer".
    let other = Key::new(0x8_0002, 1);
    assert!(c.p[0].engine.request_finished_for(other, vec![vec![3, 4]], 32, Some("")).is_err());
    assert!(c.p[0].engine.layers_ready(other, vec![vec![3, 4]], 32, 0..1, Some("")).is_err());
}

/// As above, with P reporting the request layer by layer (issue 21: the vLLM connector's
/// `save_kv_layer`): the consumer named in the first report is the only one served. (Before, the
/// layer-wise path handed the blocks to the rendezvous with no consumer.)
#[test]
fn an_intruder_registering_first_gets_nothing_when_p_names_the_consumer_layer_by_layer() {
    intruder_gets_nothing(|p, key, blocks, tokens| {
        p.layers_ready(key, blocks.clone(), tokens, 0..1, Some(D_ENGINE)).expect("layer 0");
        p.layers_ready(key, blocks, tokens, 1..u32::MAX, Some(D_ENGINE)).expect("the other layers");
    });
}

/// The intruder case of window 8, with `finish` handing P's blocks over for consumer D. Returns the
/// cluster, its engines still running.
fn intruder_gets_nothing(finish: impl Fn(&kvpush::engine::Engine, Key, Vec<Vec<u32>>, u64)) -> Cluster {
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
    finish(&p.engine, key, blocks.clone(), tokens);
    wait_for(&d.engine, "D receives", LIMIT, |f| matches!(f, Finished::Received { key: k } if *k == key));
    let v = pattern::verify(d.engine.layout(), &d.buffers, &blocks, tokens, seed).expect("reads");
    assert!(v.ok(), "received but wrong: {v:?}");
    let told = wait_for(&x.engine, "the intruder is answered", LIMIT, |f| outcome_key(f) == key);
    assert!(matches!(told, Finished::Failed { .. }), "the intruder got {told:?}");
    let untouched = pattern::verify(x.engine.layout(), &x.buffers, &blocks, tokens, 0xd00d).expect("reads");
    assert!(untouched.ok(), "the intruder's blocks were written: {untouched:?}");
    wait_for(&p.engine, "sent", LIMIT, |f| matches!(f, Finished::Sent { key: k, .. } if *k == key));
    drop(intruders);
    c
}
