//! The TCP side channel between engines: handshake (compatibility, shared secret), control frames
//! over it, malformed frames, and peer loss. Data moves over the loopback transport here; the
//! two-process tests run the same side channel with real NIXL.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpush::device::{host::HostDevice, Buffer, Device};
use kvpush::engine::side::{SideChannel, SideConfig, SideError};
use kvpush::engine::{Config, Engine, Finished};
use kvpush::proto::layout::Parallel;
use kvpush::proto::{Key, Mode};
use kvpush::transport::loopback::Fabric;
use kvpush_testkit::demo::pattern;
use kvpush_testkit::engines::{self, poll_until};
use kvpush_testkit::layouts;

struct Worker {
    engine: Engine,
    side: Arc<SideChannel>,
    buffers: Vec<Box<dyn Buffer>>,
}

fn side_config(secret: Option<&[u8]>) -> SideConfig {
    let mut c = SideConfig::for_rank(0);
    c.listen = "127.0.0.1:0".into();
    c.secret = secret.map(<[u8]>::to_vec);
    c.heartbeat = Duration::from_millis(100);
    c.peer_timeout = Duration::from_millis(600);
    c.handshake_timeout = Duration::from_secs(5);
    c
}

fn worker(id: &str, mode: Mode, fabric: &Fabric, secret: Option<&[u8]>) -> Worker {
    let dev: Arc<dyn Device> = Arc::new(HostDevice::new());
    // Two layers, two KV heads of dimension 16, 64 blocks.
    let mut l = layouts::separate(layouts::full_model(2, 2, 16), 64, Parallel::SINGLE);
    let buffers = layouts::allocate(&mut l, dev.as_ref()).expect("host memory");
    let side = Arc::new(SideChannel::bind(side_config(secret)).expect("bind"));
    let transport = Arc::new(fabric.endpoint(id).expect("endpoint"));
    let mut config = Config::new(id, mode);
    config.completion.timeout_us = 3_000_000;
    config.rendezvous.lease_us = 3_000_000;
    // SAFETY: the regions are `buffers`, owned by the returned Worker, which drops the engine first.
    let engine = unsafe { Engine::new(config, l, dev, transport, side.clone()) }.expect("engine");
    side.serve(engine.endpoint());
    Worker { engine, side, buffers }
}

fn wait_for(w: &Worker, what: &str, pred: impl Fn(&Finished) -> bool) -> Finished {
    engines::wait_for(&w.engine, what, Duration::from_secs(10), pred)
}

#[test]
fn push_over_the_side_channel_with_a_shared_secret() {
    let fabric = Fabric::new();
    let p = worker("prefill", Mode::Push, &fabric, Some(b"s3cret"));
    let d = worker("decode", Mode::Push, &fabric, Some(b"s3cret"));
    let peer = d.side.connect(p.side.local_addr()).expect("handshake");
    assert_eq!(peer.engine, "prefill");
    // The producer side learned the consumer too.
    poll_until("P registered the connection", Duration::from_secs(5), || p.side.peers(), |p| !p.is_empty());
    for (i, tokens) in [(1u128, 40u64), (2, 64), (3, 1)] {
        let key = Key::new(i, 1);
        let n = tokens.div_ceil(16) as u32;
        let pb = vec![(10 * i as u32..10 * i as u32 + n).collect::<Vec<u32>>()];
        let db = vec![(5 * i as u32..5 * i as u32 + n).rev().collect::<Vec<u32>>()];
        pattern::fill(p.engine.layout(), &p.buffers, &pb, tokens, i as u64).expect("fill");
        d.engine.blocks_allocated(key, "prefill", db.clone(), tokens).expect("register");
        p.engine.request_finished(key, pb, tokens).expect("ready");
        wait_for(&d, "received", |f| matches!(f, Finished::Received { key: k } if *k == key));
        wait_for(&p, "sent", |f| matches!(f, Finished::Sent { key: k, .. } if *k == key));
        let v = pattern::verify(d.engine.layout(), &d.buffers, &db, tokens, i as u64).expect("verify");
        // Every token of 2 layers × K and V × 2 heads × 16 elements of 2 bytes.
        assert!(v.ok(), "{v:?}");
        assert_eq!(v.bytes, tokens * 2 * 2 * 2 * 16 * 2, "{v:?}");
    }
    let s = d.side.stats();
    assert_eq!(s.handshakes, 1);
    assert!(s.frames_out >= 3, "{s:?}");
}

#[test]
fn mode_mismatch_is_refused_on_both_sides_with_the_compatibility_message() {
    let fabric = Fabric::new();
    let p = worker("prefill", Mode::Push, &fabric, None);
    let d = worker("decode", Mode::Pull, &fabric, None);
    let e = d.side.connect(p.side.local_addr()).expect_err("must refuse");
    let text = e.to_string();
    assert!(matches!(e, SideError::Refused { .. }), "{text}");
    assert!(text.contains("mode differs (local pull, remote push)"), "{text}");
    poll_until("P counted the refusal", Duration::from_secs(5), || p.side.stats(), |s| s.refused == 1);
    assert!(p.side.peers().is_empty() && d.side.peers().is_empty());
}

#[test]
fn strangers_without_the_secret_are_refused() {
    let fabric = Fabric::new();
    let p = worker("prefill", Mode::Push, &fabric, Some(b"right"));
    let wrong = worker("decode", Mode::Push, &fabric, Some(b"wrong"));
    let e = wrong.side.connect(p.side.local_addr()).expect_err("wrong secret");
    assert!(e.to_string().contains("shared secrets differ"), "{e}");
    let none = worker("decode2", Mode::Push, &fabric, None);
    let e = none.side.connect(p.side.local_addr()).expect_err("no secret");
    assert!(e.to_string().contains("requires a shared secret"), "{e}");
    assert!(p.side.peers().is_empty());
    // A raw TCP client speaking something else is refused too, and the listener keeps working.
    let mut raw = std::net::TcpStream::connect(p.side.local_addr()).expect("tcp");
    std::io::Write::write_all(&mut raw, b"GET / HTTP/1.1\r\n\r\n0123456").expect("write");
    let ok = worker("decode3", Mode::Push, &fabric, Some(b"right"));
    ok.side.connect(p.side.local_addr()).expect("right secret still works");
}

#[test]
fn a_malformed_frame_closes_the_connection_and_is_counted() {
    use kvpush::engine::ControlLink;
    let fabric = Fabric::new();
    let p = worker("prefill", Mode::Push, &fabric, None);
    let d = worker("decode", Mode::Push, &fabric, None);
    let peer = d.side.connect(p.side.local_addr()).expect("handshake");
    d.side.send(d.engine.addr(), &peer, b"KP\x01\x00\x63\x00\x00\x00\x00".to_vec()).expect("queued");
    poll_until(
        "P counted the frame and closed",
        Duration::from_secs(5),
        || (p.side.stats(), p.side.peers()),
        |(s, p)| s.malformed == 1 && p.is_empty(),
    );
    // D notices the close and can handshake afresh.
    poll_until("D dropped the dead connection", Duration::from_secs(5), || d.side.peers(), |p| p.is_empty());
    d.side.connect(p.side.local_addr()).expect("reconnect");
}

#[test]
fn a_lost_consumer_releases_the_producer_blocks_and_a_lost_producer_fails_the_consumer() {
    let fabric = Fabric::new();
    let p = worker("prefill", Mode::Push, &fabric, None);
    let d = worker("decode", Mode::Push, &fabric, None);
    d.side.connect(p.side.local_addr()).expect("handshake");
    // D registers, then disappears before P's prefill finishes: P must drop the registration, and
    // the blocks it reports ready come back at once, not after the lease.
    let key = Key::new(7, 1);
    d.engine.blocks_allocated(key, "prefill", vec![vec![1, 2]], 32).expect("register");
    poll_until(
        "P received the registration",
        Duration::from_secs(5),
        || p.engine.stats().counters,
        |c| c.registrations == 1,
    );
    let Worker { engine, side, buffers } = d;
    drop(side);
    drop(engine);
    drop(buffers);
    poll_until("P noticed D's loss", Duration::from_secs(5), || p.side.stats(), |s| s.peers_lost == 1);
    let t0 = Instant::now();
    p.engine.request_finished(key, vec![vec![3, 4]], 32).expect("ready");
    wait_for(&p, "released", |f| matches!(f, Finished::Sent { key: k, .. } if *k == key));
    assert!(t0.elapsed() < Duration::from_secs(2), "P held its blocks for {:?}", t0.elapsed());

    // Now the other way: P goes away while D waits; D fails at once (peer loss), not at its timeout.
    let p2 = worker("prefill2", Mode::Push, &fabric, None);
    let d2 = worker("decode2", Mode::Push, &fabric, None);
    d2.side.connect(p2.side.local_addr()).expect("handshake");
    let key = Key::new(8, 1);
    d2.engine.blocks_allocated(key, "prefill2", vec![vec![5]], 10).expect("register");
    let t0 = Instant::now();
    drop(p2);
    match wait_for(&d2, "failed", |f| matches!(f, Finished::Failed { key: k, .. } if *k == key)) {
        Finished::Failed { reason, invalid_blocks, .. } => {
            assert_eq!(invalid_blocks, vec![vec![5]]);
            assert!(reason.contains("lost"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(2), "D waited {:?}", t0.elapsed());
}
