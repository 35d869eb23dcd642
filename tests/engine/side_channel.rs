//! The TCP side channel between engines: handshake (compatibility, shared secret), control frames
//! over it, malformed frames, and peer loss; then what an attacker on the network can and cannot do
//! (docs/security.md): a relay that splices, injects, replays or reflects; a stranger who trickles,
//! sends oversized records or opens many connections; a peer that restarts. Data moves over the
//! loopback transport here; the two-process tests run the same side channel with real NIXL.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpush::device::{host::HostDevice, Device};
use kvpush::engine::side::{self, SideChannel, SideConfig, SideError, SideLimits, SideStats};
use kvpush::engine::{Config, Engine, Finished};
use kvpush::proto::layout::Parallel;
use kvpush::proto::{Key, Mode};
use kvpush::transport::loopback::Fabric;
use kvpush_testkit::demo::pattern;
use kvpush_testkit::engines::{self, poll_until};
use kvpush_testkit::layouts;

type Worker = engines::SideWorker;

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
    worker_with(id, id, mode, fabric, side_config(secret))
}

/// A push-mode producer "prefill" and a consumer "decode" in `d_mode` on `fabric`, each with its own
/// shared secret, not yet connected.
fn pair(fabric: &Fabric, d_mode: Mode, p_secret: Option<&[u8]>, d_secret: Option<&[u8]>) -> (Worker, Worker) {
    (worker("prefill", Mode::Push, fabric, p_secret), worker("decode", d_mode, fabric, d_secret))
}

/// A worker of engine `id` whose loopback endpoint is `endpoint` ([`engines::side_worker`]).
fn worker_with(id: &str, endpoint: &str, mode: Mode, fabric: &Fabric, side: SideConfig) -> Worker {
    // SAFETY: precondition 2: these tests write a request's blocks only before registering it or
    // after its outcome.
    unsafe { engines::side_worker(id, endpoint, mode, fabric, side) }
}

fn wait_for(w: &Worker, what: &str, pred: impl Fn(&Finished) -> bool) -> Finished {
    engines::wait_for(&w.engine, what, Duration::from_secs(10), pred)
}

#[test]
fn push_over_the_side_channel_with_a_shared_secret() {
    let fabric = Fabric::new();
    let (p, d) = pair(&fabric, Mode::Push, Some(b"s3cret"), Some(b"s3cret"));
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
    let (p, d) = pair(&fabric, Mode::Pull, None, None);
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
    let (p, wrong) = pair(&fabric, Mode::Push, Some(b"right"), Some(b"wrong"));
    let e = wrong.side.connect(p.side.local_addr()).expect_err("wrong secret");
    assert!(matches!(e, SideError::Auth { .. }), "{e}");
    assert!(e.to_string().contains("shared secrets differ"), "{e}");
    // No secret on loopback: a per-process key, which a peer with a configured secret does not have.
    let none = worker("decode2", Mode::Push, &fabric, None);
    let e = none.side.connect(p.side.local_addr()).expect_err("no secret");
    assert!(e.to_string().contains("no secret configured"), "{e}");
    assert!(p.side.peers().is_empty());
    let deadline = Instant::now() + Duration::from_secs(5);
    while p.side.stats().auth_failures < 2 {
        assert!(Instant::now() < deadline, "P did not count both failures: {:?}", p.side.stats());
        std::thread::sleep(Duration::from_millis(1));
    }
    // A raw TCP client speaking something else is refused too, and the listener keeps working.
    let mut raw = std::net::TcpStream::connect(p.side.local_addr()).expect("tcp");
    std::io::Write::write_all(&mut raw, b"GET / HTTP/1.1\r\n\r\n0123456").expect("write");
    let ok = worker("decode3", Mode::Push, &fabric, Some(b"right"));
    ok.side.connect(p.side.local_addr()).expect("right secret still works");
    until("P counted the handshake", || p.side.stats().handshakes == 1, stats_of(&p));
}

#[test]
fn a_malformed_frame_closes_the_connection_and_is_counted() {
    use kvpush::engine::ControlLink;
    let fabric = Fabric::new();
    let (p, d) = pair(&fabric, Mode::Push, None, None);
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
    let (p, d) = pair(&fabric, Mode::Push, None, None);
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

// ------------------------------------------------------------------------------------------------
// Attacks. The wire format the attackers speak is written from the module docs of
// `kvpush::engine::side`, not taken from its code.

const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

/// Polls `f` until it holds, failing with what `show` says after 10 s.
fn until(what: &str, mut f: impl FnMut() -> bool, show: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "{what}: not after 10 s ({})", show());
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn stats_of(w: &Worker) -> impl Fn() -> String + '_ {
    move || format!("{:?}", w.side.stats())
}

/// A greeting as the docs lay it out: magic, this build's version, role, auth, rank, engine id.
fn greeting(role: u8, auth: u8, id: &[u8], id_len: u16) -> Vec<u8> {
    greeting_of(side::SIDE_VERSION, role, auth, id, id_len)
}

/// A greeting of side-channel version `version`.
fn greeting_of(version: u16, role: u8, auth: u8, id: &[u8], id_len: u16) -> Vec<u8> {
    let mut g = b"KVPSIDE2".to_vec();
    g.extend_from_slice(&version.to_le_bytes());
    g.extend_from_slice(&[role, auth, 0, 0, 0, 0]);
    g.extend_from_slice(&id_len.to_le_bytes());
    g.extend_from_slice(id);
    g
}

/// Reads one greeting (18 bytes, then the engine id).
fn read_greeting(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut g = vec![0u8; 18];
    s.read_exact(&mut g)?;
    let n = usize::from(u16::from_le_bytes([g[16], g[17]]));
    let mut id = vec![0u8; n];
    s.read_exact(&mut id)?;
    g.extend_from_slice(&id);
    Ok(g)
}

/// Reads one record (u16 big-endian length, then the body), length included.
fn read_record(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 2];
    s.read_exact(&mut len)?;
    let mut r = len.to_vec();
    r.resize(2 + usize::from(u16::from_be_bytes(len)), 0);
    s.read_exact(&mut r[2..])?;
    Ok(r)
}

/// Everything the peer sends until it closes (or `limit` passes), and when it closed.
fn drain(s: &mut TcpStream, limit: Duration) -> (Vec<u8>, Option<Duration>) {
    let t0 = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    s.set_read_timeout(Some(Duration::from_millis(20))).expect("timeout");
    while t0.elapsed() < limit {
        match s.read(&mut buf) {
            Ok(0) => return (got, Some(t0.elapsed())),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return (got, Some(t0.elapsed())),
        }
    }
    (got, None)
}

/// A man in the middle between a dialer and `target`: forwards greetings and records both ways,
/// keeps a copy of each record, and lets the test write raw bytes towards the target.
struct Relay {
    addr: SocketAddr,
    to_target: Arc<Mutex<Option<TcpStream>>>,
    /// Set (under `to_target`'s lock) to stop forwarding the dialer's records to the target.
    held: Arc<std::sync::atomic::AtomicBool>,
    from_dialer: Arc<Mutex<Vec<Vec<u8>>>>,
    from_target: Arc<Mutex<Vec<Vec<u8>>>>,
}

impl Relay {
    fn start(target: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let relay = Relay {
            addr,
            to_target: Arc::new(Mutex::new(None)),
            held: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            from_dialer: Arc::new(Mutex::new(Vec::new())),
            from_target: Arc::new(Mutex::new(Vec::new())),
        };
        let (to_target, from_dialer, from_target, held) =
            (relay.to_target.clone(), relay.from_dialer.clone(), relay.from_target.clone(), relay.held.clone());
        std::thread::spawn(move || {
            let Ok((dialer, _)) = listener.accept() else { return };
            let Ok(target) = TcpStream::connect(target) else { return };
            *to_target.lock().expect("relay lock") = Some(target.try_clone().expect("clone"));
            let to_dialer = Arc::new(Mutex::new(Some(dialer.try_clone().expect("clone"))));
            let never = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let pump = |mut from: TcpStream,
                        to: Arc<Mutex<Option<TcpStream>>>,
                        seen: Arc<Mutex<Vec<Vec<u8>>>>,
                        held: Arc<std::sync::atomic::AtomicBool>| {
                std::thread::spawn(move || {
                    let forward = |bytes: &[u8]| {
                        let mut to = to.lock().expect("relay lock");
                        if held.load(std::sync::atomic::Ordering::SeqCst) {
                            return Some(Ok(())); // dropped: the test holds this direction
                        }
                        to.as_mut().map(|s| s.write_all(bytes))
                    };
                    let Ok(g) = read_greeting(&mut from) else { return };
                    forward(&g);
                    while let Ok(r) = read_record(&mut from) {
                        seen.lock().expect("relay lock").push(r.clone());
                        if !matches!(forward(&r), Some(Ok(()))) {
                            return;
                        }
                    }
                    if let Some(s) = to.lock().expect("relay lock").as_ref() {
                        let _ = s.shutdown(std::net::Shutdown::Both);
                    }
                })
            };
            pump(dialer, to_target, from_dialer, held);
            pump(target, to_dialer, from_target, never);
        });
        relay
    }

    /// Stops forwarding the dialer's records to the target (later ones are dropped).
    fn hold(&self) {
        let _guard = self.to_target.lock().expect("relay lock");
        self.held.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Writes `bytes` to the target, between two forwarded records.
    fn inject(&self, bytes: &[u8]) {
        self.to_target.lock().expect("relay lock").as_mut().expect("relay connected").write_all(bytes).expect("inject");
    }
}

/// A pair whose decode worker dials the prefill worker through a relay.
fn relayed_pair(fabric: &Fabric) -> (Worker, Worker, Relay) {
    // The tests hold D's heartbeats for a while: a long peer timeout keeps that from looking like a
    // lost peer.
    let patient = |id: &str| {
        let mut c = side_config(Some(SECRET));
        c.peer_timeout = Duration::from_secs(30);
        worker_with(id, id, Mode::Push, fabric, c)
    };
    let p = patient("prefill");
    let d = patient("decode");
    let relay = Relay::start(p.side.local_addr());
    d.side.connect(relay.addr).expect("a transparent relay passes the handshake");
    until("P connected", || !p.side.peers().is_empty(), stats_of(&p));
    (p, d, relay)
}

impl Relay {
    /// The last record seen of `records` once there are at least four (the handshake's, then a
    /// heartbeat at least).
    fn a_later_record(records: &Mutex<Vec<Vec<u8>>>, p: &Worker) -> Vec<u8> {
        until("a record after the handshake", || records.lock().expect("relay lock").len() >= 4, stats_of(p));
        records.lock().expect("relay lock").last().cloned().expect("a record")
    }
}

/// Builds a [`relayed_pair`], sends the record `attack` makes of it to P through the relay, and
/// checks that P refuses it, closes the connection, and hands no frame to its engine.
fn refused_through_a_relay(attack: impl FnOnce(&Worker, &Relay) -> Vec<u8>) {
    let fabric = Fabric::new();
    let (p, _d, relay) = relayed_pair(&fabric);
    let attack = attack(&p, &relay);
    // Hold D's own records (heartbeats), and wait until P has taken every one already on its way, so
    // that any frame P counts from here on can only be the attack.
    relay.hold();
    let mut last = p.side.stats().frames_in;
    let mut stable_since = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(5);
    while stable_since.elapsed() < Duration::from_millis(300) {
        assert!(Instant::now() < deadline, "P kept counting frames from a held relay: {}", stats_of(&p)());
        std::thread::sleep(Duration::from_millis(10));
        let now = p.side.stats().frames_in;
        if now != last {
            (last, stable_since) = (now, Instant::now());
        }
    }
    let before = p.side.stats();
    relay.inject(&attack);
    until("P refused the record", || p.side.stats().auth_failures == before.auth_failures + 1, stats_of(&p));
    until("P closed the connection", || p.side.peers().is_empty(), stats_of(&p));
    let after = p.side.stats();
    assert_eq!((after.frames_in, after.malformed), (before.frames_in, before.malformed), "it reached the engine");
}

#[test]
fn a_relay_cannot_inject_a_frame() {
    refused_through_a_relay(|_, _| {
        // An abort for a transfer, as a plaintext codec frame wrapped in a record: the old channel
        // took any frame after its handshake.
        let mut frame = b"KP\x01\x00\x63\x00\x00\x00\x00".to_vec();
        frame.splice(0..0, (frame.len() as u16).to_be_bytes());
        frame
    });
}

#[test]
fn a_replayed_record_is_refused() {
    refused_through_a_relay(|p, relay| Relay::a_later_record(&relay.from_dialer, p));
}

#[test]
fn a_reflected_record_is_refused() {
    refused_through_a_relay(|p, relay| Relay::a_later_record(&relay.from_target, p));
}

#[test]
fn a_relay_splicing_two_handshakes_gets_no_session() {
    let fabric = Fabric::new();
    let p = worker("prefill", Mode::Push, &fabric, Some(SECRET));
    let mut c1 = side_config(Some(SECRET));
    c1.handshake_timeout = Duration::from_secs(2);
    let d1 = worker_with("decode", "decode", Mode::Push, &fabric, c1.clone());
    let d2 = worker_with("decode2", "decode2", Mode::Push, &fabric, c1);
    // The relay answers both dialers with P's greeting, then hands P the first dialer's greeting
    // with the second dialer's first Noise message.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let relay = listener.local_addr().expect("addr");
    let mut to_p = TcpStream::connect(p.side.local_addr()).expect("connect P");
    let p_greeting = read_greeting(&mut to_p).expect("P's greeting");
    let dial = |w: &Worker| {
        let side = w.side.clone();
        std::thread::spawn(move || side.connect(relay))
    };
    let t1 = dial(&d1);
    let (mut s1, _) = listener.accept().expect("d1");
    let t2 = dial(&d2);
    let (mut s2, _) = listener.accept().expect("d2");
    let g1 = read_greeting(&mut s1).expect("d1 greeting");
    let g2 = read_greeting(&mut s2).expect("d2 greeting");
    assert_ne!(g1, g2);
    s1.write_all(&p_greeting).expect("to d1");
    s2.write_all(&p_greeting).expect("to d2");
    let _m1 = read_record(&mut s1).expect("d1 message");
    let m2 = read_record(&mut s2).expect("d2 message");
    let before = p.side.stats();
    to_p.write_all(&g1).expect("spliced greeting");
    to_p.write_all(&m2).expect("spliced message");
    let (answer, closed) = drain(&mut to_p, Duration::from_secs(5));
    assert!(answer.is_empty() && closed.is_some(), "P answered a spliced handshake: {} bytes", answer.len());
    until("P counted the failure", || p.side.stats().auth_failures == before.auth_failures + 1, stats_of(&p));
    assert!(p.side.peers().is_empty());
    drop((s1, s2));
    assert!(t1.join().expect("d1").is_err() && t2.join().expect("d2").is_err());
}

#[test]
fn nothing_but_the_greeting_reaches_a_stranger() {
    let fabric = Fabric::new();
    let p = worker("prefill", Mode::Push, &fabric, Some(SECRET));
    let expected = greeting(1, 1, b"prefill", 7);
    // A stranger speaking the previous protocol's greeting (which used to get the handshake, agent
    // metadata included, before any proof), then one speaking this one's with a made-up first
    // Noise message.
    let mut old = b"KVPSIDE1".to_vec();
    old.extend_from_slice(&[7u8; 16]);
    let mut new = greeting(0, 1, b"decode", 6);
    new.extend_from_slice(&48u16.to_be_bytes());
    new.extend_from_slice(&[0x5a; 48]);
    for hello in [old, new] {
        let mut s = TcpStream::connect(p.side.local_addr()).expect("tcp");
        s.write_all(&hello).expect("hello");
        let (got, closed) = drain(&mut s, Duration::from_secs(8));
        assert!(closed.is_some(), "P kept a stranger's connection open");
        assert_eq!(got, expected, "P sent a stranger more than its greeting");
    }
    until("P counted the failed proof", || p.side.stats().auth_failures == 1, stats_of(&p));
    assert!(p.side.peers().is_empty());
    assert_eq!(p.side.stats().handshakes, 0);
}

#[test]
fn a_trickled_greeting_times_out_at_the_handshake_deadline() {
    let fabric = Fabric::new();
    let mut c = side_config(Some(SECRET));
    c.handshake_timeout = Duration::from_millis(1000);
    let p = worker_with("prefill", "prefill", Mode::Push, &fabric, c);
    let mut s = TcpStream::connect(p.side.local_addr()).expect("tcp");
    read_greeting(&mut s).expect("P's greeting");
    // A greeting announcing the longest engine id, one byte every 50 ms: each read makes progress,
    // so only a deadline for the whole handshake ends it.
    let g = greeting(0, 1, &[b'x'; 256], 256);
    s.set_read_timeout(Some(Duration::from_millis(1))).expect("timeout");
    let t0 = Instant::now();
    let mut closed = None;
    for b in g.iter().cycle().take(200) {
        if s.write_all(std::slice::from_ref(b)).is_err() {
            closed = Some(t0.elapsed());
            break;
        }
        match s.read(&mut [0u8; 16]) {
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Ok(n) if n > 0 => panic!("P sent {n} bytes to a stranger that is still greeting"),
            _ => {
                closed = Some(t0.elapsed());
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let closed = closed.expect("P kept a trickling stranger for 10 s");
    assert!(closed >= Duration::from_millis(900), "closed after {closed:?}, before the deadline");
    assert!(closed < Duration::from_secs(4), "closed after {closed:?}: more than the 1 s deadline allows");
    until("P counted the timeout", || p.side.stats().timeouts == 1, stats_of(&p));
}

#[test]
fn an_oversized_record_before_authentication_is_refused_unread() {
    let fabric = Fabric::new();
    let p = worker("prefill", Mode::Push, &fabric, Some(SECRET));
    // Only the lengths are sent: a reader that tried to read (or allocate) the announced body
    // would wait for it until the handshake deadline (5 s) instead of closing at once.
    let mut long_id = greeting(0, 1, b"", u16::MAX);
    long_id.truncate(18);
    let mut long_record = greeting(0, 1, b"decode", 6);
    long_record.extend_from_slice(&u16::MAX.to_be_bytes());
    for (n, attack) in [long_id, long_record].into_iter().enumerate() {
        let mut s = TcpStream::connect(p.side.local_addr()).expect("tcp");
        read_greeting(&mut s).expect("P's greeting");
        s.write_all(&attack).expect("attack");
        let (_, closed) = drain(&mut s, Duration::from_secs(8));
        let closed = closed.expect("P kept the connection");
        assert!(closed < Duration::from_secs(2), "P waited {closed:?} for an oversized body");
        until("P counted it", || p.side.stats().oversized == n as u64 + 1, stats_of(&p));
    }
}

#[test]
fn connection_limits_hold_against_many_strangers() {
    let fabric = Fabric::new();
    let mut c = side_config(Some(SECRET));
    c.limits = SideLimits { max_handshakes: 4, max_handshakes_per_address: 2, ..SideLimits::default() };
    c.handshake_timeout = Duration::from_secs(3);
    let p = worker_with("prefill", "prefill", Mode::Push, &fabric, c);
    // Strangers that connect and say nothing: two hold a handshake slot, the rest are closed.
    let mut strangers: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(p.side.local_addr()).expect("tcp")).collect();
    until("P turned the extra ones away", || p.side.stats().over_limit == 6, stats_of(&p));
    let mut held = 0;
    for s in &mut strangers {
        let (got, closed) = drain(s, Duration::from_millis(300));
        match closed {
            Some(_) => assert!(got.is_empty(), "a stranger past the limit got {} bytes", got.len()),
            None => held += 1,
        }
    }
    assert_eq!(held, 2, "{:?}", p.side.stats());
    assert_eq!(p.side.stats().pending_handshakes, 2);
    // The slots come back when the strangers go; a real peer then connects.
    drop(strangers);
    until("the slots came back", || p.side.stats().pending_handshakes == 0, stats_of(&p));
    let d = worker("decode", Mode::Push, &fabric, Some(SECRET));
    d.side.connect(p.side.local_addr()).expect("a peer within the limits");
}

#[test]
fn a_restarted_consumer_does_not_inherit_its_previous_registrations() {
    let fabric = Fabric::new();
    let p = worker("prefill", Mode::Push, &fabric, Some(SECRET));
    let d = worker_with("decode", "decode-a", Mode::Push, &fabric, side_config(Some(SECRET)));
    d.side.connect(p.side.local_addr()).expect("handshake");
    let key = Key::new(9, 1);
    d.engine.blocks_allocated(key, "prefill", vec![vec![1, 2, 3]], 48).expect("register");
    until("P holds the registration", || p.side.stats().frames_in >= 1, stats_of(&p));
    // The same engine id comes back as a new process (its old connection still open): P must drop
    // what the old process registered, and never write into the new one's blocks 1..3.
    let d2 = worker_with("decode", "decode-b", Mode::Push, &fabric, side_config(Some(SECRET)));
    d2.side.connect(p.side.local_addr()).expect("handshake of the new process");
    until("P saw the restart", || p.side.stats().restarts == 1, stats_of(&p));
    let pb = vec![vec![4u32, 5, 6]];
    pattern::fill(p.engine.layout(), &p.buffers, &pb, 48, 9).expect("fill");
    let t0 = Instant::now();
    p.engine.request_finished(key, pb, 48).expect("ready");
    wait_for(&p, "released", |f| matches!(f, Finished::Sent { key: k, .. } if *k == key));
    assert!(t0.elapsed() < Duration::from_secs(2), "P held its blocks for {:?}", t0.elapsed());
    for b in &d2.buffers {
        let mut bytes = vec![0u8; b.region().len as usize];
        b.read_at(0, &mut bytes).expect("read");
        assert!(
            bytes.iter().all(|&x| x == 0),
            "P wrote into the new process's blocks: {:?} {:?}",
            p.side.stats(),
            p.engine.stats().counters
        );
    }
    // The old process learns its request failed.
    wait_for(&d, "failed", |f| matches!(f, Finished::Failed { key: k, .. } if *k == key));
}

#[test]
fn an_unsafe_secret_configuration_refuses_to_start() {
    let mut c = side_config(Some(b""));
    let e = SideChannel::bind(c.clone()).expect_err("empty secret");
    assert!(matches!(e, SideError::Config { .. }) && e.to_string().contains("empty"), "{e}");
    c.secret = Some(SECRET.to_vec());
    c.insecure = true;
    let e = SideChannel::bind(c.clone()).expect_err("secret and insecure");
    assert!(e.to_string().contains("choose one"), "{e}");
    c.secret = None;
    c.insecure = false;
    c.listen = "0.0.0.0:0".into();
    let e = SideChannel::bind(c.clone()).expect_err("no secret off loopback");
    assert!(e.to_string().contains("KVPUSH_INSECURE"), "{e}");
    c.insecure = true;
    SideChannel::bind(c).expect("explicitly insecure");
}

#[test]
fn insecure_and_authenticated_peers_do_not_mix() {
    let fabric = Fabric::new();
    let p = worker("prefill", Mode::Push, &fabric, Some(SECRET));
    let mut c = side_config(None);
    c.insecure = true;
    let d = worker_with("decode", "decode", Mode::Push, &fabric, c);
    let e = d.side.connect(p.side.local_addr()).expect_err("insecure dialer");
    assert!(e.to_string().contains("insecure mode"), "{e}");
    let s: SideStats = p.side.stats();
    assert_eq!(s.handshakes, 0);
}

/// A dialer of wire protocol 1 (the version before block-id runs; docs/protocol.md §1, Versions)
/// against this build, spoken by hand in insecure mode: greeting, Noise NN, then the hello of a
/// version-1 build (its handshake frame under version 1, `protocol: 1` and the hash of it). The
/// listener must refuse it in its verdict and say which versions met, and count it.
#[test]
fn a_peer_of_the_previous_protocol_version_is_refused_at_the_hello_and_told_why() {
    let fabric = Fabric::new();
    let insecure = || {
        let mut c = side_config(None);
        c.insecure = true;
        c
    };
    let p = worker_with("prefill", "prefill", Mode::Push, &fabric, insecure());
    // The handshake "decode" sends, as a version-1 build would have written it.
    let d = worker_with("decode", "decode", Mode::Push, &fabric, insecure());
    let mut hs = d.engine.endpoint().upgrade().expect("engine").local_handshake().expect("handshake");
    hs.protocol = 1;
    hs.compat_hash = kvpush::proto::compat::compat_hash(&hs.layout.model, hs.layout.order, hs.mode, 1);
    let mut frame = kvpush::proto::codec::to_vec(&kvpush::proto::msg::Message::Handshake(Box::new(hs))).expect("frame");
    frame[2..4].copy_from_slice(&1u16.to_le_bytes());

    let mut s = TcpStream::connect(p.side.local_addr()).expect("tcp");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let mine = greeting(0, 0, b"decode", 6);
    s.write_all(&mine).expect("greeting");
    let theirs = read_greeting(&mut s).expect("P's greeting");
    let mut prologue = b"kvpush side channel v3".to_vec();
    prologue.extend_from_slice(&mine);
    prologue.extend_from_slice(&theirs);
    let params: snow::params::NoiseParams = side::NOISE_INSECURE.parse().expect("params");
    let mut noise =
        snow::Builder::new(params).prologue(&prologue).expect("prologue").build_initiator().expect("initiator");
    let (mut buf, mut plain) = ([0u8; 65_600], [0u8; 65_600]);
    let n = noise.write_message(&[], &mut buf).expect("-> e");
    s.write_all(&(n as u16).to_be_bytes()).expect("record");
    s.write_all(&buf[..n]).expect("record");
    let r = read_record(&mut s).expect("<- e, ee");
    noise.read_message(&r[2..], &mut plain).expect("<- e, ee");
    let mut noise = noise.into_transport_mode().expect("transport");
    // Our hello: incarnation, data-path key, the frame; one record (flag 0: the message ends here).
    let mut msg = vec![0u8];
    msg.extend_from_slice(&[7u8; 16]);
    msg.extend_from_slice(&[9u8; 32]);
    msg.extend_from_slice(&frame);
    let n = noise.write_message(&msg, &mut buf).expect("seal");
    s.write_all(&(n as u16).to_be_bytes()).expect("record");
    s.write_all(&buf[..n]).expect("record");
    // P's hello, then its verdict.
    let mut open = |s: &mut TcpStream| {
        let r = read_record(s).expect("a record");
        let n = noise.read_message(&r[2..], &mut plain).expect("opens");
        assert_eq!(plain[0], 0, "one record per message here");
        plain[1..n].to_vec()
    };
    let _hello = open(&mut s);
    let verdict = open(&mut s);
    let text = String::from_utf8_lossy(&verdict[1..]).into_owned();
    assert_eq!(verdict[0], 1, "P accepted a version-1 peer: {text}");
    assert_eq!(text, "the peer's handshake is malformed: unsupported protocol version 1 (this build speaks 2)");
    // The version-1 side refuses P's hello in turn; P then gives up on the pair as refused.
    let mut ours = vec![0u8, 1];
    ours.extend_from_slice(b"unsupported protocol version 2 (this build speaks 1)");
    let n = noise.write_message(&ours, &mut buf).expect("seal");
    s.write_all(&(n as u16).to_be_bytes()).expect("record");
    s.write_all(&buf[..n]).expect("record");
    until("P counted the refusal", || p.side.stats().refused == 1, stats_of(&p));
    assert!(p.side.peers().is_empty());
}

/// Builds of side-channel version 2 (ChaCha20-Poly1305) and this one (3, AES-256-GCM) cannot share
/// a session: each must refuse the other at the greeting, before any Noise message, with an error
/// that names both versions, never a cipher failure later or a hang.
#[test]
fn a_peer_of_the_previous_side_channel_version_is_refused_at_the_greeting_with_both_versions() {
    assert_eq!(side::SIDE_VERSION, 3);
    let fabric = Fabric::new();
    // This build dials a version-2 listener (spoken by hand: its greeting, then nothing).
    let old = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = old.local_addr().expect("addr");
    let listener = std::thread::spawn(move || {
        let (mut s, _) = old.accept().expect("accept");
        s.write_all(&greeting_of(2, 1, 1, b"prefill", 7)).expect("greeting");
        s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        let theirs = read_greeting(&mut s).expect("the dialer's greeting");
        let (rest, closed) = drain(&mut s, Duration::from_secs(5));
        (theirs, rest, closed.is_some())
    });
    let d = worker("decode", Mode::Push, &fabric, Some(SECRET));
    let e = d.side.connect(addr).expect_err("a version-2 listener");
    assert!(e.to_string().contains("side-channel version 2, this side speaks 3"), "{e}");
    let (theirs, rest, closed) = listener.join().expect("listener");
    assert_eq!(u16::from_le_bytes([theirs[8], theirs[9]]), 3, "the dialer announced its version");
    assert!(rest.is_empty() && closed, "the dialer sent {} bytes after its greeting", rest.len());
    // A version-2 dialer: P answers with its greeting only (version 3, which a version-2 build
    // refuses with "side-channel version 3, this side speaks 2"), then closes.
    let p = worker("prefill", Mode::Push, &fabric, Some(SECRET));
    let mut s = TcpStream::connect(p.side.local_addr()).expect("tcp");
    s.write_all(&greeting_of(2, 0, 1, b"decode", 6)).expect("greeting");
    let (got, closed) = drain(&mut s, Duration::from_secs(8));
    assert!(closed.is_some(), "P kept a version-2 peer's connection open");
    assert_eq!(got, greeting(1, 1, b"prefill", 7), "P sent a version-2 peer more than its greeting");
    assert!(p.side.peers().is_empty());
    assert_eq!(p.side.stats().handshakes, 0);
}

// ------------------------------------------------------------------------------------------------
// The data path. NIXL's UCX backend takes a notification's sender name from the message itself
// (docs/security.md, "Data path"), so the wire can claim any agent. `Wire` stands for that: the
// transport an engine is given, delivering whatever the test injects under whatever name.

struct Wire {
    inner: kvpush::transport::loopback::LoopbackTransport,
    injected: Mutex<Vec<kvpush::transport::Notification>>,
    waker: Mutex<Option<kvpush::transport::Waker>>,
    /// While true, the engine's writer stops in its next look at the notifications.
    stalled: (Mutex<bool>, std::sync::Condvar),
}

impl std::fmt::Debug for Wire {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Wire")
    }
}

impl Wire {
    fn stall(&self, on: bool) {
        *self.stalled.0.lock().expect("lock") = on;
        self.stalled.1.notify_all();
    }

    /// Delivers `msg` as if agent `from` had sent it, and wakes the engine.
    fn inject(&self, from: &str, msg: Vec<u8>) {
        self.injected.lock().expect("lock").push(kvpush::transport::Notification { from: from.to_owned(), msg });
        let waker = self.waker.lock().expect("lock").clone();
        waker.expect("the engine installed its waker")();
    }
}

impl kvpush::transport::Transport for Wire {
    fn name(&self) -> &str {
        self.inner.name()
    }
    unsafe fn register(&self, region: &kvpush::device::MemRegion) -> Result<(), kvpush::transport::TransportError> {
        // SAFETY: passed on unchanged; the engine that calls this upholds `register`'s contract.
        unsafe { self.inner.register(region) }
    }
    fn deregister(&self, region: &kvpush::device::MemRegion) -> Result<(), kvpush::transport::TransportError> {
        self.inner.deregister(region)
    }
    fn local_metadata(&self) -> Result<Vec<u8>, kvpush::transport::TransportError> {
        self.inner.local_metadata()
    }
    fn load_remote(&self, metadata: &[u8]) -> Result<String, kvpush::transport::TransportError> {
        self.inner.load_remote(metadata)
    }
    fn drop_peer(&self, peer: &str) {
        self.inner.drop_peer(peer)
    }
    fn post(
        &self,
        op: kvpush::transport::Op,
        peer: &str,
        descs: &[kvpush::transport::Desc],
        notif: Option<&[u8]>,
    ) -> Result<kvpush::transport::XferId, kvpush::transport::TransportError> {
        self.inner.post(op, peer, descs, notif)
    }
    fn poll(
        &self,
        id: kvpush::transport::XferId,
    ) -> Result<kvpush::transport::XferState, kvpush::transport::TransportError> {
        self.inner.poll(id)
    }
    fn take_notifications(
        &self,
        out: &mut Vec<kvpush::transport::Notification>,
    ) -> Result<usize, kvpush::transport::TransportError> {
        let mut stalled = self.stalled.0.lock().expect("lock");
        while *stalled {
            stalled = self.stalled.1.wait(stalled).expect("lock");
        }
        drop(stalled);
        let mut injected = std::mem::take(&mut *self.injected.lock().expect("lock"));
        let n = injected.len() + self.inner.take_notifications(out)?;
        out.append(&mut injected);
        Ok(n)
    }
    fn send_notification(&self, peer: &str, msg: &[u8]) -> Result<(), kvpush::transport::TransportError> {
        self.inner.send_notification(peer, msg)
    }
    fn set_waker(&self, waker: kvpush::transport::Waker) {
        *self.waker.lock().expect("lock") = Some(waker.clone());
        self.inner.set_waker(waker)
    }
    fn needs_polling(&self) -> bool {
        self.inner.needs_polling()
    }
}

/// Stalls `wire`'s writer until the returned guard drops: a failed assertion must not leave the
/// writer stalled (dropping the engine joins it).
fn stalled(wire: &Wire) -> impl Drop + '_ {
    struct Unstall<'a>(&'a Wire);
    impl Drop for Unstall<'_> {
        fn drop(&mut self) {
            self.0.stall(false);
        }
    }
    wire.stall(true);
    Unstall(wire)
}

/// A worker of engine `id` with a secret whose transport is a [`Wire`] on `fabric`.
fn tapped(id: &str, fabric: &Fabric, configure: impl FnOnce(&mut Config)) -> (Worker, Arc<Wire>) {
    tapped_with(id, fabric, side_config(Some(SECRET)), configure)
}

/// [`tapped`] with the side channel configured by `side`.
fn tapped_with(
    id: &str,
    fabric: &Fabric,
    side: SideConfig,
    configure: impl FnOnce(&mut Config),
) -> (Worker, Arc<Wire>) {
    let dev: Arc<dyn Device> = Arc::new(HostDevice::new());
    let mut l = layouts::separate(layouts::full_model(2, 2, 16), 64, Parallel::SINGLE);
    let buffers = layouts::allocate(&mut l, dev.as_ref()).expect("host memory");
    let side = Arc::new(SideChannel::bind(side).expect("bind"));
    let wire = Arc::new(Wire {
        inner: fabric.endpoint(id).expect("endpoint"),
        injected: Mutex::new(Vec::new()),
        waker: Mutex::new(None),
        stalled: (Mutex::new(false), std::sync::Condvar::new()),
    });
    let mut config = Config::new(id, Mode::Push);
    config.completion.timeout_us = 10_000_000;
    config.rendezvous.lease_us = 10_000_000;
    configure(&mut config);
    // SAFETY: the regions are `buffers`, owned by the returned Worker, which drops the engine first.
    let engine = unsafe { Engine::new(config, l, dev, wire.clone(), side.clone()) }.expect("engine");
    side.serve(engine.endpoint());
    (Worker { engine, side, buffers }, wire)
}

#[test]
fn a_forged_notification_does_not_complete_a_request() {
    use kvpush::proto::codec;
    use kvpush::proto::msg::{Completion, Message};
    let fabric = Fabric::new();
    let p = worker("prefill", Mode::Push, &fabric, Some(SECRET));
    let (d, wire) = tapped("decode", &fabric, |_| {});
    d.side.connect(p.side.local_addr()).expect("handshake");

    let key = Key::new(21, 1);
    let (pb, db) = (vec![vec![7u32, 8]], vec![vec![3u32, 4]]);
    d.engine.blocks_allocated(key, "prefill", db.clone(), 32).expect("register");
    until("P holds the registration", || p.engine.stats().counters.registrations == 1, stats_of(&p));
    // P's rank says its part landed: once under P's agent name as the wire delivers it, once with a
    // tag that is not the one the handshake agreed, once from a name nobody loaded.
    let done = codec::to_vec(&Message::Completion(Completion { key, rank: p.engine.addr().rank })).expect("encode");
    let mut tagged = done.clone();
    tagged.extend_from_slice(&[0u8; 16]);
    wire.inject("prefill", done.clone());
    wire.inject("prefill", tagged);
    wire.inject("mallory", done);
    // Whichever comes first: the forgeries dropped, or an outcome for the request.
    let mut out = Vec::new();
    poll_until(
        "D dropped the three forgeries or reported the request",
        Duration::from_secs(5),
        || {
            d.engine.poll(&mut out);
            (d.engine.data_path_counts(), out.len())
        },
        |(c, n)| c.unauthenticated() == 3 || *n > 0,
    );
    assert!(out.is_empty(), "a forged completion reached the request: {out:?}");
    let c = d.engine.data_path_counts();
    assert_eq!((c.unknown_sender, c.bad_tag), (1, 2), "{c:?}");
    d.engine.poll(&mut out);
    assert!(out.is_empty(), "a forged completion reached the request: {out:?}");
    // The real transfer still completes it, with P's bytes, through tagged notifications.
    pattern::fill(p.engine.layout(), &p.buffers, &pb, 32, 21).expect("fill");
    p.engine.request_finished(key, pb, 32).expect("ready");
    wait_for(&d, "received", |f| matches!(f, Finished::Received { key: k } if *k == key));
    let v = pattern::verify(d.engine.layout(), &d.buffers, &db, 32, 21).expect("verify");
    assert!(v.ok() && v.bytes == 32 * 2 * 2 * 2 * 16 * 2, "{v:?}");
    assert_eq!(d.engine.data_path_counts(), c, "the real notifications verified");
}

#[test]
fn control_frames_wait_for_stalled_writers_instead_of_piling_up() {
    let fabric = Fabric::new();
    let (p, wire) = tapped("prefill", &fabric, |c| {
        c.control = kvpush::engine::ControlLimits { frames: 2, bytes: 1 << 20, wait: Duration::from_secs(20) };
    });
    let d = worker("decode", Mode::Push, &fabric, Some(SECRET));
    d.side.connect(p.side.local_addr()).expect("handshake");
    // P's writer stops; D registers 40 requests. The writer stalls at its next transport call, so
    // it may still take a few registrations first (a registration alone touches no transport); then
    // P's reader may fill the budget (2) and read one more, waiting for room, and must stop. So a
    // handful of registrations in, never the 40 D sends, plus the heartbeats D sent before them
    // (frames_in counts heartbeats too; D sends one every 100 ms).
    let before = p.side.stats().frames_in;
    let since = Instant::now();
    let _unstall = stalled(&wire);
    const N: u128 = 40;
    for i in 0..N {
        d.engine.blocks_allocated(Key::new(100 + i, 1), "prefill", vec![vec![i as u32]], 16).expect("register");
    }
    until("D sent them", || d.side.stats().frames_out >= N as u64, stats_of(&d));
    let heartbeats = since.elapsed().as_millis() as u64 / 100 + 1;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(500) {
        let s = p.side.stats();
        let read = s.frames_in - before;
        assert!(
            read <= 8 + heartbeats,
            "P read {read} frames ({heartbeats} heartbeats allowed) past its budget while its writer stalled: {s:?}"
        );
        std::thread::yield_now();
    }
    assert!(p.side.stats().frames_in >= before + 3, "{:?}", p.side.stats());
    // The writer goes on: every registration arrives, none was dropped, the connection held.
    wire.stall(false);
    until("P took all registrations", || p.engine.stats().counters.registrations == N as u64, stats_of(&p));
    let s = p.side.stats();
    assert_eq!((s.over_limit, s.peers_lost, s.malformed), (0, 0, 0), "{s:?}");
}

/// Threads of this process whose name is `name` (Linux keeps 15 bytes of it).
fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim_end() == name)
        .count()
}

#[test]
fn a_thousand_strangers_cost_a_bounded_number_of_threads() {
    let fabric = Fabric::new();
    let p = worker("prefill", Mode::Push, &fabric, Some(SECRET));
    let name = kvpush::engine::side::handshake_thread_name(p.side.local_addr().port());
    let limit = SideLimits::default().max_handshakes;
    // The oracle sees handshake threads at all: one silent stranger holds one.
    let first = TcpStream::connect(p.side.local_addr()).expect("tcp");
    poll_until("a handshake thread for the stranger", Duration::from_secs(5), || threads_named(&name), |n| *n == 1);
    drop(first);
    // A thousand strangers connect and say nothing, all at once.
    let mut max = 0;
    let mut strangers = Vec::with_capacity(1000);
    for _ in 0..1000 {
        strangers.push(TcpStream::connect(p.side.local_addr()).expect("tcp"));
        max = max.max(threads_named(&name));
    }
    until("P turned the rest away", || p.side.stats().over_limit >= 1000 - limit as u64, stats_of(&p));
    max = max.max(threads_named(&name));
    assert!(max <= limit, "{max} handshake threads for 1000 strangers (limit {limit}): {:?}", p.side.stats());
    // They hold no thread once they are gone.
    drop(strangers);
    poll_until("the handshake threads ended", Duration::from_secs(10), || threads_named(&name), |n| *n == 0);
    let d = worker("decode", Mode::Push, &fabric, Some(SECRET));
    d.side.connect(p.side.local_addr()).expect("a peer gets through afterwards");
}

#[test]
fn established_connections_are_limited_per_address() {
    let fabric = Fabric::new();
    let mut c = side_config(Some(SECRET));
    c.limits = SideLimits { max_connections_per_address: 1, ..SideLimits::default() };
    let p = worker_with("prefill", "prefill", Mode::Push, &fabric, c);
    let d1 = worker("decode1", Mode::Push, &fabric, Some(SECRET));
    let d2 = worker("decode2", Mode::Push, &fabric, Some(SECRET));
    d1.side.connect(p.side.local_addr()).expect("the first peer from 127.0.0.1");
    // A second engine from the same address is refused in P's verdict, and told why.
    let e = d2.side.connect(p.side.local_addr()).expect_err("one connection per address");
    assert!(matches!(e, SideError::Refused { .. }), "{e}");
    assert!(e.to_string().contains("too many connections with 127.0.0.1"), "{e}");
    assert_eq!(p.side.peers().len(), 1);
    // The first peer reconnecting replaces its own connection: it needs no room.
    d1.side.connect(p.side.local_addr()).expect("a reconnect of the same peer");
    until("P holds one connection", || p.side.peers().len() == 1, stats_of(&p));
}

#[test]
fn the_consumer_dials_only_what_its_allow_list_names() {
    use kvpush::engine::dial::DialPolicy;
    let fabric = Fabric::new();
    let p = worker("prefill", Mode::Push, &fabric, Some(b"s3cret"));
    let with = |id: &str, allow: &str| {
        let mut c = side_config(Some(b"s3cret"));
        c.dial_allow = Some(DialPolicy::parse(allow).expect("a valid list"));
        worker_with(id, id, Mode::Push, &fabric, c)
    };
    // A tripwire listener: a dial that opened a socket would sit in its accept queue once connect
    // returned. The check sees a connection when there is one.
    let trip = TcpListener::bind("127.0.0.1:0").expect("bind");
    trip.set_nonblocking(true).expect("nonblocking");
    let probe = TcpStream::connect(trip.local_addr().expect("addr")).expect("connect");
    assert!(trip.accept().is_ok(), "the tripwire sees a connection");
    drop(probe);

    // Not on the list (only 10.0.0.0/8 and a name): refused before any socket, counted, and the
    // error names the list and how to change it.
    let d = with("decode", "10.0.0.0/8,prefill-0.svc");
    for target in [p.side.local_addr(), trip.local_addr().expect("addr")] {
        let e = d.side.connect(target).expect_err("loopback is not on the list");
        assert!(matches!(e, SideError::NotAllowed { .. }), "{e}");
        let text = e.to_string();
        assert!(text.contains("10.0.0.0/8,prefill-0.svc") && text.contains("KVPUSH_DIAL_ALLOW"), "{text}");
    }
    assert!(
        matches!(trip.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "a refused dial opened a connection"
    );
    assert_eq!((d.side.stats().dial_refused, d.side.stats().handshakes), (2, 0));
    assert_eq!(p.side.stats(), SideStats::default(), "P saw nothing");
    assert!(d.side.peers().is_empty());

    // On the list, by network or by name: dialed and handshaken.
    let by_net = with("decode-net", "127.0.0.0/8");
    assert_eq!(by_net.side.connect(p.side.local_addr()).expect("allowed network").engine, "prefill");
    let by_name = with("decode-name", "localhost");
    let port = p.side.local_addr().port();
    assert_eq!(by_name.side.connect(format!("localhost:{port}")).expect("allowed name").engine, "prefill");
    assert_eq!(by_name.side.stats().dial_refused, 0);
}

/// Side-channel threads (accept, I/O, handshakes) of the listeners on `ports`.
fn side_threads(ports: &[u16]) -> usize {
    use kvpush::engine::side::{accept_thread_name, handshake_thread_name, io_thread_name};
    ports
        .iter()
        .map(|&p| [accept_thread_name(p), io_thread_name(p), handshake_thread_name(p)])
        .fold(0, |n, names| n + names.iter().map(|name| threads_named(name)).sum::<usize>())
}

#[test]
fn established_connections_cost_no_thread_each() {
    // One producer and 24 consumers, every consumer connected: each side channel keeps its accept
    // and its I/O thread, whatever its number of connections (one thread per connection would be
    // 2 × 24 more on P and 2 more on each consumer).
    const N: usize = 24;
    let fabric = Fabric::new();
    let p = worker("prefill", Mode::Push, &fabric, Some(SECRET));
    let ds: Vec<Worker> = (0..N).map(|i| worker(&format!("decode{i}"), Mode::Push, &fabric, Some(SECRET))).collect();
    let ports: Vec<u16> = std::iter::once(&p).chain(&ds).map(|w| w.side.local_addr().port()).collect();
    // The oracle sees the threads: two per side channel before any connection (a new thread names
    // itself once it runs, hence the wait).
    until(
        "two threads per side channel",
        || side_threads(&ports) == 2 * (N + 1),
        || format!("{}", side_threads(&ports)),
    );
    for d in &ds {
        d.side.connect(p.side.local_addr()).expect("handshake");
    }
    until("P holds every connection", || p.side.peers().len() == N, stats_of(&p));
    // The listener's handshake threads end with their handshakes; nothing else was started.
    until(
        "only accept and I/O threads",
        || side_threads(&ports) == 2 * (N + 1),
        || format!("{}", side_threads(&ports)),
    );
    // The one I/O thread serves them all: a registration from each consumer reaches P.
    for (i, d) in ds.iter().enumerate() {
        d.engine.blocks_allocated(Key::new(500 + i as u128, 1), "prefill", vec![vec![i as u32]], 16).expect("register");
    }
    until("P took every registration", || p.engine.stats().counters.registrations == N as u64, stats_of(&p));
    assert_eq!(side_threads(&ports), 2 * (N + 1));
    let s = p.side.stats();
    assert_eq!((s.handshakes, s.peers_lost, s.malformed), (N as u64, 0, 0), "{s:?}");
}

#[test]
fn records_read_past_a_turn_are_delivered_without_new_bytes() {
    // P's writer stalls with a budget of 100 frames, so P's I/O thread delivers 100 registrations,
    // parks the next and stops reading while D sends 300 in all. Once the writer goes on, P reads
    // what waited in its socket in a few large reads, more records than one turn of the I/O thread
    // delivers (64). D then sends nothing (its heartbeat is 30 s away): the records already read
    // must be delivered without a new byte making the socket readable (they were not: they waited
    // for D's next frame).
    const N: u128 = 300;
    let fabric = Fabric::new();
    let mut quiet = side_config(Some(SECRET));
    quiet.heartbeat = Duration::from_secs(30);
    quiet.peer_timeout = Duration::from_secs(60);
    let (p, wire) = tapped_with("prefill", &fabric, quiet.clone(), |c| {
        c.control = kvpush::engine::ControlLimits { frames: 100, bytes: 1 << 20, wait: Duration::from_secs(20) };
    });
    // Nothing of D's may make P's socket readable before the test's 10 s: no heartbeat, no timeout.
    let (d, _) = tapped_with("decode", &fabric, quiet, |c| c.completion.timeout_us = 60_000_000);
    d.side.connect(p.side.local_addr()).expect("handshake");
    let _unstall = stalled(&wire);
    for i in 0..N {
        d.engine.blocks_allocated(Key::new(700 + i, 1), "prefill", vec![vec![(i % 64) as u32]], 16).expect("register");
    }
    until("D sent them", || d.side.stats().frames_out >= N as u64, stats_of(&d));
    until("P parked a frame", || p.side.stats().frames_in >= 101, stats_of(&p));
    assert!(p.side.stats().frames_in < N as u64, "P read everything past a spent budget: {:?}", p.side.stats());
    wire.stall(false);
    until(
        "P took every registration",
        || p.engine.stats().counters.registrations == N as u64,
        || {
            format!(
                "{} registrations; P {:?}; D {:?}",
                p.engine.stats().counters.registrations,
                p.side.stats(),
                d.side.stats()
            )
        },
    );
    let s = p.side.stats();
    assert_eq!((s.over_limit, s.peers_lost, s.malformed), (0, 0, 0), "{s:?}");
    // Nothing is left behind on either side: all written, all opened.
    assert_eq!((d.side.stats().queued_out, s.unopened_in), (0, 0), "{s:?}");
}
