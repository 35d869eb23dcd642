//! The loopback transport through its public API: what the engine relies on.
//!
//! Every test uses plain `Vec<u8>` host memory, registered by address; a buffer is only read or
//! written by the test while no transfer on it is in flight (the `register` contract).
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use kvpush::device::mock::MockDevice;
use kvpush::device::{Access, Buffer, CopyOp, Device, DeviceError, DeviceKind, MemKind, MemRegion};
use kvpush::transport::loopback::{Fabric, Fault, FaultRates, LoopbackStats, LoopbackTransport, STATUS_BACKEND};
use kvpush::transport::{Desc, Notification, Op, Transport, TransportError, XferId, XferState};
use kvpush_testkit::engines::poll_until;

const TIMEOUT: Duration = Duration::from_secs(20);

fn region(buf: &mut [u8]) -> MemRegion {
    MemRegion { addr: buf.as_mut_ptr() as u64, len: buf.len() as u64, kind: MemKind::Dram, dev_id: 0 }
}

fn addr(buf: &mut [u8]) -> u64 {
    buf.as_mut_ptr() as u64
}

/// A fabric with two endpoints that loaded each other's metadata.
fn pair() -> (Fabric, LoopbackTransport, LoopbackTransport) {
    let fabric = Fabric::new();
    let p = fabric.endpoint("prefill").unwrap();
    let d = fabric.endpoint("decode").unwrap();
    assert_eq!(p.load_remote(&d.local_metadata().unwrap()).unwrap(), "decode");
    assert_eq!(d.load_remote(&p.local_metadata().unwrap()).unwrap(), "prefill");
    (fabric, p, d)
}

/// Registers `src` with `p` and `dst` with `d`: the memory most tests move bytes between.
///
/// # Safety
///
/// 1. Both buffers are live and outlive the endpoints' use of them, and the test reads or writes
///    them only while no transfer on them is in flight (the `register` contract).
unsafe fn register_both(p: &LoopbackTransport, d: &LoopbackTransport, src: &mut [u8], dst: &mut [u8]) {
    // SAFETY: the caller's contract (1), for `src`.
    unsafe { p.register(&region(src)) }.unwrap();
    // SAFETY: the caller's contract (1), for `dst`.
    unsafe { d.register(&region(dst)) }.unwrap();
}

/// [`pair`] with `len` bytes of [`pattern`]`(len, seed)` registered at P and `len` zero bytes at D.
///
/// # Safety
///
/// 1. The caller keeps both buffers (their heap memory, which stays where it is when they move)
///    until no transfer on them is in flight, and reads or writes them only meanwhile.
#[allow(clippy::type_complexity)]
unsafe fn registered_pair(len: usize, seed: u8) -> (Fabric, LoopbackTransport, LoopbackTransport, Vec<u8>, Vec<u8>) {
    let (fabric, p, d) = pair();
    let (mut src, mut dst) = (pattern(len, seed), vec![0u8; len]);
    // SAFETY: the caller's contract (1).
    unsafe { register_both(&p, &d, &mut src, &mut dst) };
    (fabric, p, d, src, dst)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn wait(t: &LoopbackTransport, id: XferId) -> Result<XferState, TransportError> {
    let done = |s: &Result<XferState, TransportError>| !matches!(s, Ok(XferState::Pending));
    poll_until(&format!("transfer {id:?} completed"), TIMEOUT, || t.poll(id), done)
}

fn wait_notifications(t: &LoopbackTransport, n: usize) -> Vec<Notification> {
    let deadline = Instant::now() + TIMEOUT;
    let mut out = Vec::new();
    while out.len() < n {
        t.take_notifications(&mut out).unwrap();
        assert!(Instant::now() < deadline, "got {} of {n} notifications", out.len());
        thread::sleep(Duration::from_micros(100));
    }
    out
}

/// Descriptors for `count` blocks of `block` bytes, block `i` of `local` to block `perm(i)` of `remote`.
fn scattered(local: u64, remote: u64, block: u64, count: u64) -> Vec<Desc> {
    (0..count)
        .map(|i| Desc { local: local + i * block, remote: remote + ((i * 7) % count) * block, len: block })
        .collect()
}

#[test]
fn write_many_descriptors_lands_every_byte() {
    let (block, count) = (4096u64, 257u64);
    // SAFETY: the buffers live to the end of the test, after every transfer on them ended.
    let (_fabric, p, d, mut src, mut dst) = unsafe { registered_pair((block * count) as usize, 3) };
    let descs = scattered(addr(&mut src), addr(&mut dst), block, count);
    let id = p.post(Op::Write, "decode", &descs, Some(b"done")).unwrap();
    assert_eq!(wait(&p, id), Ok(XferState::Done));
    for i in 0..count as usize {
        let j = (i * 7) % count as usize;
        let b = block as usize;
        assert_eq!(dst[j * b..(j + 1) * b], src[i * b..(i + 1) * b], "block {i}");
    }
    // The handle is released by the poll that reported Done.
    assert_eq!(p.poll(id), Err(TransportError::UnknownXfer(id)));
    assert_eq!(p.open_transfers(), 0);
    let notes = wait_notifications(&d, 1);
    assert_eq!(notes, vec![Notification { from: "prefill".into(), msg: b"done".to_vec() }]);
    let stats = p.stats();
    assert_eq!((stats.posts, stats.descriptors, stats.bytes, stats.notifications_sent), (1, count, block * count, 1));
    assert_eq!(d.stats().notifications_received, 1);
}

#[test]
fn read_many_descriptors_and_the_peer_is_notified() {
    let (block, count) = (1000u64, 64u64);
    // SAFETY: the buffers live to the end of the test, after every transfer on them ended.
    let (_fabric, p, d, mut theirs, mut mine) = unsafe { registered_pair((block * count) as usize, 9) };
    // D pulls from P: local is D's memory, remote is P's.
    let descs: Vec<Desc> = (0..count)
        .map(|i| Desc { local: addr(&mut mine) + i * block, remote: addr(&mut theirs) + i * block, len: block })
        .collect();
    let id = d.post(Op::Read, "prefill", &descs, Some(b"read")).unwrap();
    assert_eq!(wait(&d, id), Ok(XferState::Done));
    assert_eq!(mine, theirs);
    // NIXL delivers a READ's notification to the remote agent: the producer learns its blocks were read.
    let notes = wait_notifications(&p, 1);
    assert_eq!(notes[0].from, "decode");
    assert_eq!(notes[0].msg, b"read");
}

#[test]
fn the_target_sees_the_data_when_it_sees_the_notification() {
    let (_fabric, p, d) = pair();
    let (block, count, rounds) = (64 * 1024u64, 128u64, 6u8);
    let len = (block * count) as usize;
    let mut src = vec![0u8; len];
    let mut dst = vec![0u8; len];
    // SAFETY: both are live buffers of this test that outlive the endpoints' use of them.
    unsafe { register_both(&p, &d, &mut src, &mut dst) };
    let (src_addr, dst_addr) = (addr(&mut src), addr(&mut dst));
    let (wake_tx, wake_rx) = crossbeam_channel::unbounded::<()>();
    d.set_waker(Arc::new(move || {
        let _ = wake_tx.send(());
    }));
    let (ack_tx, ack_rx) = crossbeam_channel::unbounded::<u8>();
    let d = Arc::new(d);
    let consumer = {
        let d = d.clone();
        thread::spawn(move || {
            let mut notes = Vec::new();
            for round in 0..rounds {
                while notes.is_empty() {
                    wake_rx.recv_timeout(TIMEOUT).expect("the target's waker was never called");
                    d.take_notifications(&mut notes).unwrap();
                }
                let n = notes.remove(0);
                assert_eq!(n.msg, [round]);
                // SAFETY: no transfer into `dst` is in flight: the producer waits for our ack before
                // it posts the next round, and this round's notification came after its data.
                let seen = unsafe { std::slice::from_raw_parts(dst_addr as *const u8, len) };
                assert!(seen.iter().all(|&x| x == round + 1), "round {round}: notification before the data");
                ack_tx.send(round).unwrap();
            }
        })
    };
    for round in 0..rounds {
        src.fill(round + 1);
        let descs: Vec<Desc> = (0..count)
            .map(|i| Desc { local: src_addr + i * block, remote: dst_addr + i * block, len: block })
            .collect();
        let id = p.post(Op::Write, "decode", &descs, Some(&[round])).unwrap();
        assert_eq!(ack_rx.recv_timeout(TIMEOUT).unwrap(), round);
        assert_eq!(wait(&p, id), Ok(XferState::Done));
    }
    consumer.join().unwrap();
    drop(dst);
}

#[test]
fn wakers_signal_completion_and_notification() {
    // SAFETY: the buffers live to the end of the test, after every transfer on them ended.
    let (_fabric, p, d, mut src, mut dst) = unsafe { registered_pair(8192, 1) };
    let (p_tx, p_rx) = crossbeam_channel::unbounded::<()>();
    let (d_tx, d_rx) = crossbeam_channel::unbounded::<()>();
    p.set_waker(Arc::new(move || {
        let _ = p_tx.send(());
    }));
    d.set_waker(Arc::new(move || {
        let _ = d_tx.send(());
    }));
    assert!(!p.needs_polling());
    let desc = Desc { local: addr(&mut src), remote: addr(&mut dst), len: 8192 };
    let id = p.post(Op::Write, "decode", &[desc], Some(b"n")).unwrap();
    // When the initiator's waker runs, the completion is already visible.
    p_rx.recv_timeout(TIMEOUT).unwrap();
    assert_eq!(p.poll(id), Ok(XferState::Done));
    // When the target's waker runs, the notification is already in its inbox.
    d_rx.recv_timeout(TIMEOUT).unwrap();
    let mut notes = Vec::new();
    assert_eq!(d.take_notifications(&mut notes).unwrap(), 1);
    // A bare notification wakes the target too (and not the sender: there is no completion).
    p.send_notification("decode", b"bare").unwrap();
    d_rx.recv_timeout(TIMEOUT).unwrap();
    assert_eq!(d.take_notifications(&mut notes).unwrap(), 1);
    assert_eq!(notes[1].msg, b"bare");
    assert_eq!(dst, src);
    assert!(p_rx.try_recv().is_err());
}

#[test]
fn descriptors_outside_registered_memory_are_rejected_and_copy_nothing() {
    // SAFETY: the buffers live to the end of the test, after every transfer on them ended.
    let (_fabric, p, d, mut src, mut dst) = unsafe { registered_pair(4096, 5) };
    let (s, t) = (addr(&mut src), addr(&mut dst));
    let mut descs: Vec<Desc> = (0..8).map(|i| Desc { local: s + i * 512, remote: t + i * 512, len: 512 }).collect();

    // Local side: descriptor 3 runs one byte past the end of the source (0..3 are fine).
    let mut bad_local = descs.clone();
    bad_local[3].local = s + 4096 - 511;
    assert_eq!(
        p.post(Op::Write, "decode", &bad_local, Some(b"x")),
        Err(TransportError::NotRegistered { index: 3, addr: s + 4096 - 511, len: 512, side: "local" })
    );
    // Remote side: descriptor 5 points into the initiator's memory, which the peer never registered.
    descs[5].remote = s;
    assert_eq!(
        p.post(Op::Write, "decode", &descs, Some(b"x")),
        Err(TransportError::NotRegistered { index: 5, addr: s, len: 512, side: "remote" })
    );
    // Reads check the same sides: local is still this endpoint's memory.
    assert!(matches!(
        d.post(Op::Read, "prefill", &[Desc { local: t, remote: s + 4000, len: 512 }], None),
        Err(TransportError::NotRegistered { index: 0, side: "remote", .. })
    ));
    // Wrapping ranges are errors, not panics.
    assert!(matches!(
        p.post(Op::Write, "decode", &[Desc { local: u64::MAX - 10, remote: t, len: 100 }], None),
        Err(TransportError::NotRegistered { index: 0, side: "local", .. })
    ));
    // A range running past the end of its region is outside, whatever else is registered.
    let mut second = vec![0u8; 4096];
    // SAFETY: the region is a live buffer of this test that outlives the endpoint's use of it.
    unsafe { d.register(&region(&mut second)) }.unwrap();
    assert!(p.post(Op::Write, "decode", &[Desc { local: s, remote: t + 4000, len: 200 }], None).is_err());
    // An empty descriptor list is refused.
    assert!(matches!(p.post(Op::Write, "decode", &[], Some(b"x")), Err(TransportError::Call { .. })));

    thread::sleep(Duration::from_millis(20));
    assert!(dst.iter().all(|&x| x == 0), "a rejected post copied bytes");
    assert_eq!(p.open_transfers(), 0);
    assert_eq!(p.stats(), LoopbackStats::default());
    let mut notes = Vec::new();
    assert_eq!(d.take_notifications(&mut notes).unwrap(), 0);
    assert!(!p.fabric().worker_watch().is_running(), "nothing was ever queued");
}

#[test]
fn unknown_peers_and_bad_metadata() {
    let (_fabric, p, d) = pair();
    let (mut src, mut dst) = (vec![1u8; 64], vec![0u8; 64]);
    // SAFETY: both are live buffers of this test that outlive the endpoints' use of them.
    unsafe { register_both(&p, &d, &mut src, &mut dst) };
    let desc = Desc { local: addr(&mut src), remote: addr(&mut dst), len: 64 };
    assert_eq!(p.post(Op::Write, "nobody", &[desc], None), Err(TransportError::UnknownPeer("nobody".into())));
    assert_eq!(p.send_notification("nobody", b"x"), Err(TransportError::UnknownPeer("nobody".into())));

    for garbage in [&b""[..], b"garbage", &[0u8; 64][..], &d.local_metadata().unwrap()[..20]] {
        assert!(matches!(p.load_remote(garbage), Err(TransportError::BadMetadata(_))), "{garbage:?}");
    }
    // Metadata of an endpoint on another fabric does not connect, even with a known name.
    let other = Fabric::new();
    let stranger = other.endpoint("decode").unwrap();
    assert!(matches!(p.load_remote(&stranger.local_metadata().unwrap()), Err(TransportError::BadMetadata(_))));

    // drop_peer forgets the peer; loading its metadata again restores it.
    p.drop_peer("decode");
    assert_eq!(p.post(Op::Write, "decode", &[desc], None), Err(TransportError::UnknownPeer("decode".into())));
    assert_eq!(p.send_notification("decode", b"x"), Err(TransportError::UnknownPeer("decode".into())));
    p.load_remote(&d.local_metadata().unwrap()).unwrap();
    let id = p.post(Op::Write, "decode", &[desc], None).unwrap();
    assert_eq!(wait(&p, id), Ok(XferState::Done));
    assert_eq!(p.poll(XferId(9999)), Err(TransportError::UnknownXfer(XferId(9999))));
}

#[test]
fn injected_post_error_copies_nothing_and_is_consumed() {
    // SAFETY: the buffers live to the end of the test, after every transfer on them ended.
    let (_fabric, p, d, mut src, mut dst) = unsafe { registered_pair(4096, 2) };
    let desc = Desc { local: addr(&mut src), remote: addr(&mut dst), len: 4096 };
    p.inject_once(Fault::PostError);
    match p.post(Op::Write, "decode", &[desc], Some(b"n")) {
        Err(e @ TransportError::Call { call: "post", status, .. }) => {
            assert!(status < 0);
            assert_eq!(e.status(), STATUS_BACKEND);
        }
        other => panic!("expected an injected post error, got {other:?}"),
    }
    thread::sleep(Duration::from_millis(20));
    assert!(dst.iter().all(|&x| x == 0));
    assert_eq!(p.open_transfers(), 0);
    let mut notes = Vec::new();
    assert_eq!(d.take_notifications(&mut notes).unwrap(), 0);
    assert_eq!((p.stats().posts, p.stats().post_errors), (0, 1));
    // The fault was one-shot.
    let id = p.post(Op::Write, "decode", &[desc], Some(b"n")).unwrap();
    assert_eq!(wait(&p, id), Ok(XferState::Done));
    assert_eq!(dst, src);
}

#[test]
fn injected_lost_notification_lands_the_data_but_never_notifies() {
    // SAFETY: the buffers live to the end of the test, after every transfer on them ended.
    let (_fabric, p, d, mut src, mut dst) = unsafe { registered_pair(4096, 4) };
    let desc = Desc { local: addr(&mut src), remote: addr(&mut dst), len: 4096 };
    p.inject_once(Fault::LoseNotification);
    let id = p.post(Op::Write, "decode", &[desc], Some(b"lost")).unwrap();
    assert_eq!(wait(&p, id), Ok(XferState::Done));
    assert_eq!(dst, src);
    // A later bare notification on the same pair is delivered: had the first one been merely late,
    // FIFO order would put it first.
    p.send_notification("decode", b"later").unwrap();
    let notes = wait_notifications(&d, 1);
    assert_eq!(notes.len(), 1);
    assert_eq!(notes[0].msg, b"later");
    assert_eq!((p.stats().notifications_lost, p.stats().notifications_sent), (1, 1));
}

#[test]
fn injected_partial_copies_a_prefix_and_fails() {
    let (_fabric, p, d) = pair();
    let (mut src, mut dst) = (pattern(8 * 1024, 6), vec![0u8; 8 * 1024]);
    // SAFETY: both are live buffers of this test that outlive the endpoints' use of them.
    unsafe { register_both(&p, &d, &mut src, &mut dst) };
    let descs: Vec<Desc> = (0..8)
        .map(|i| Desc { local: addr(&mut src) + i * 1024, remote: addr(&mut dst) + i * 1024, len: 1024 })
        .collect();
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    p.set_waker(Arc::new(move || {
        seen.fetch_add(1, Ordering::SeqCst);
    }));
    p.inject_once(Fault::Partial);
    let id = p.post(Op::Write, "decode", &descs, Some(b"n")).unwrap();
    match wait(&p, id) {
        Err(TransportError::Failed { id: failed, peer, status, detail }) => {
            assert_eq!((failed, peer.as_str(), status), (id, "decode", STATUS_BACKEND));
            assert!(detail.contains("4 of 8"), "{detail}");
        }
        other => panic!("expected a failed transfer, got {other:?}"),
    }
    assert_eq!(dst[..4096], src[..4096], "the prefix landed");
    assert!(dst[4096..].iter().all(|&x| x == 0), "only the prefix landed");
    assert_eq!(p.poll(id), Err(TransportError::UnknownXfer(id)), "the failure released the handle");
    assert!(calls.load(Ordering::SeqCst) >= 1, "the initiator was woken for the failure");
    thread::sleep(Duration::from_millis(20));
    let mut notes = Vec::new();
    assert_eq!(d.take_notifications(&mut notes).unwrap(), 0);
    assert_eq!(p.stats().failed_transfers, 1);
}

#[test]
fn injected_delay_completes_late_but_completes() {
    // SAFETY: the buffers live to the end of the test, after every transfer on them ended.
    let (_fabric, p, d, mut src, mut dst) = unsafe { registered_pair(4096, 8) };
    let desc = Desc { local: addr(&mut src), remote: addr(&mut dst), len: 4096 };
    let delay = Duration::from_millis(200);
    p.inject_once(Fault::Delay(delay));
    let t0 = Instant::now();
    let id = p.post(Op::Write, "decode", &[desc], Some(b"late")).unwrap();
    assert!(t0.elapsed() < delay, "post blocked");
    assert_eq!(p.poll(id), Ok(XferState::Pending));
    let mut notes = Vec::new();
    assert_eq!(d.take_notifications(&mut notes).unwrap(), 0);
    assert_eq!(wait(&p, id), Ok(XferState::Done));
    assert!(t0.elapsed() >= delay);
    assert_eq!(dst, src);
    assert_eq!(wait_notifications(&d, 1)[0].msg, b"late");
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Ok,
    PostError,
    Lost,
    Partial,
}

fn outcomes(seed: u64) -> Vec<Outcome> {
    // SAFETY: the buffers live to the end of the test, after every transfer on them ended.
    let (_fabric, p, d, mut src, mut dst) = unsafe { registered_pair(4096, 1) };
    p.set_fault_rates(FaultRates { post_error: 0.2, lose_notification: 0.2, partial: 0.2, seed });
    let descs: Vec<Desc> = (0..4)
        .map(|i| Desc { local: addr(&mut src) + i * 1024, remote: addr(&mut dst) + i * 1024, len: 1024 })
        .collect();
    let mut posted = Vec::new();
    let mut out = vec![Outcome::Ok; 200];
    for (i, o) in out.iter_mut().enumerate() {
        match p.post(Op::Write, "decode", &descs, Some(&(i as u32).to_le_bytes())) {
            Ok(id) => posted.push((i, id)),
            Err(_) => *o = Outcome::PostError,
        }
    }
    for &(i, id) in &posted {
        if wait(&p, id).is_err() {
            out[i] = Outcome::Partial;
        }
    }
    let mut notes = Vec::new();
    d.take_notifications(&mut notes).unwrap();
    let notified: BTreeSet<usize> =
        notes.iter().map(|n| u32::from_le_bytes(n.msg[..4].try_into().unwrap()) as usize).collect();
    for (i, o) in out.iter_mut().enumerate() {
        if *o == Outcome::Ok && !notified.contains(&i) {
            *o = Outcome::Lost;
        }
    }
    assert_eq!(p.open_transfers(), 0);
    out
}

#[test]
fn fault_rates_are_deterministic_for_a_seed() {
    let first = outcomes(7);
    assert_eq!(first, outcomes(7));
    assert_ne!(first, outcomes(8));
    for kind in [Outcome::Ok, Outcome::PostError, Outcome::Lost, Outcome::Partial] {
        let n = first.iter().filter(|&&o| o == kind).count();
        assert!((10..=120).contains(&n), "{kind:?}: {n} of 200");
    }
}

#[test]
fn many_threads_post_concurrently() {
    const THREADS: u64 = 8;
    const POSTS: u64 = 40;
    const DESCS: u64 = 4;
    const BLOCK: u64 = 256;
    let fabric = Fabric::new();
    let d = fabric.endpoint("decode").unwrap();
    let mut dst = vec![0u8; (THREADS * POSTS * DESCS * BLOCK) as usize];
    // SAFETY: the region is a live buffer of this test that outlives the endpoint's use of it.
    unsafe { d.register(&region(&mut dst)) }.unwrap();
    let dst_addr = addr(&mut dst);
    let d_md = d.local_metadata().unwrap();
    // Half the threads share one endpoint, the others have one each.
    let shared = Arc::new(fabric.endpoint("shared").unwrap());
    shared.load_remote(&d_md).unwrap();
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let own = (t % 2 == 1).then(|| {
                let e = fabric.endpoint(&format!("p{t}")).unwrap();
                e.load_remote(&d_md).unwrap();
                Arc::new(e)
            });
            let ep = own.unwrap_or_else(|| shared.clone());
            thread::spawn(move || {
                let mut src = pattern((POSTS * DESCS * BLOCK) as usize, t as u8);
                // SAFETY: the region is a live buffer of this test that outlives the endpoint's use of it.
                unsafe { ep.register(&region(&mut src)) }.unwrap();
                let base = addr(&mut src);
                let ids: Vec<XferId> = (0..POSTS)
                    .map(|i| {
                        let descs: Vec<Desc> = (0..DESCS)
                            .map(|k| {
                                let off = (i * DESCS + k) * BLOCK;
                                Desc {
                                    local: base + off,
                                    remote: dst_addr + t * POSTS * DESCS * BLOCK + off,
                                    len: BLOCK,
                                }
                            })
                            .collect();
                        ep.post(Op::Write, "decode", &descs, Some(&[t as u8, i as u8])).unwrap()
                    })
                    .collect();
                for id in ids {
                    assert_eq!(wait(&ep, id), Ok(XferState::Done));
                }
                ep.deregister(&region(&mut src)).unwrap();
                src
            })
        })
        .collect();
    let sources: Vec<Vec<u8>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let notes = wait_notifications(&d, (THREADS * POSTS) as usize);
    assert_eq!(notes.len(), (THREADS * POSTS) as usize);
    let distinct: BTreeSet<Vec<u8>> = notes.iter().map(|n| n.msg.clone()).collect();
    assert_eq!(distinct.len(), (THREADS * POSTS) as usize);
    // Per (initiator, target) pair, notifications keep posting order.
    for t in (1..THREADS).step_by(2) {
        let mine: Vec<u8> = notes.iter().filter(|n| n.from == format!("p{t}")).map(|n| n.msg[1]).collect();
        assert_eq!(mine, (0..POSTS as u8).collect::<Vec<_>>());
    }
    let chunk = (POSTS * DESCS * BLOCK) as usize;
    for (t, src) in sources.iter().enumerate() {
        assert_eq!(&dst[t * chunk..(t + 1) * chunk], &src[..], "thread {t}");
    }
    assert_eq!(d.stats().notifications_received, THREADS * POSTS);
    assert_eq!(shared.stats().posts, THREADS / 2 * POSTS);
}

#[test]
fn dropping_the_fabric_and_its_endpoints_stops_the_worker() {
    let (fabric, p, d) = pair();
    assert!(!fabric.worker_watch().is_running(), "the worker starts lazily");
    let (mut src, mut dst) = (pattern(1024, 1), vec![0u8; 1024]);
    // SAFETY: both are live buffers of this test that outlive the endpoints' use of them.
    unsafe { register_both(&p, &d, &mut src, &mut dst) };
    let desc = Desc { local: addr(&mut src), remote: addr(&mut dst), len: 1024 };
    let id = p.post(Op::Write, "decode", &[desc], None).unwrap();
    assert_eq!(wait(&p, id), Ok(XferState::Done));
    let watch = fabric.worker_watch();
    assert!(watch.is_running());
    // The endpoints keep the fabric (and its worker) alive after the Fabric handle is gone.
    drop(fabric);
    let id = p.post(Op::Write, "decode", &[desc], None).unwrap();
    assert_eq!(wait(&p, id), Ok(XferState::Done));
    assert!(watch.is_running());
    // Queued work does not keep it alive either.
    p.inject_once(Fault::Delay(Duration::from_secs(3600)));
    p.post(Op::Write, "decode", &[desc], None).unwrap();
    drop(p);
    assert!(watch.is_running());
    drop(d);
    // The last handle's drop joins the worker.
    assert!(!watch.is_running());
}

// ---- device memory ----

/// A device whose memory the CPU must not touch: host memory from a mock, reported as VRAM, that
/// says it is copied by the device ([`Access::Device`], or [`Access::None`]: no copy at all) and
/// counts the copies it is asked for.
#[derive(Debug)]
struct DeviceOnly {
    mock: MockDevice,
    access: Access,
    copies: AtomicUsize,
}

impl DeviceOnly {
    fn new(access: Access) -> Arc<DeviceOnly> {
        Arc::new(DeviceOnly { mock: MockDevice::new(), access, copies: AtomicUsize::new(0) })
    }
}

impl Device for DeviceOnly {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Mock
    }
    fn alloc(&self, len: u64) -> Result<Box<dyn Buffer>, DeviceError> {
        self.mock.alloc(len)
    }
    fn describe(&self, addr: u64, len: u64) -> Result<MemRegion, DeviceError> {
        self.mock.describe(addr, len)
    }
    fn access(&self) -> Access {
        self.access
    }
    unsafe fn copy(&self, ops: &[CopyOp]) -> Result<(), DeviceError> {
        for op in ops {
            self.copies.fetch_add(1, Ordering::Relaxed);
            // SAFETY: `Device::copy`'s contract: both ranges are valid memory (the mock's host memory)
            // for the whole call and nobody else touches them.
            unsafe { std::ptr::copy(op.src as usize as *const u8, op.dst as usize as *mut u8, op.len as usize) };
        }
        Ok(())
    }
}

fn status_of(e: TransportError) -> (i32, String) {
    match &e {
        TransportError::Call { status, .. } => (*status, e.to_string()),
        other => panic!("not a call error: {other:?}"),
    }
}

#[test]
fn device_memory_needs_an_endpoint_whose_device_copies_it() {
    let fabric = Fabric::new();
    let mock = Arc::new(MockDevice::new());
    let buf = mock.alloc(4096).unwrap();
    let r = buf.region();
    assert_eq!(r.kind, MemKind::Vram);
    // An endpoint for host memory only refuses device memory at once, naming it and the way out,
    // instead of letting the CPU load and store a device address later (a segfault on a GPU).
    let plain = fabric.endpoint("plain").unwrap();
    // SAFETY: refused before anything is recorded; nothing copies it.
    let (status, msg) = status_of(unsafe { plain.register(&r) }.unwrap_err());
    assert_eq!(status, kvpush::transport::loopback::STATUS_INVALID_PARAM, "{msg}");
    assert!(msg.contains("device memory") && msg.contains("endpoint_on"), "{msg}");
    // So does an endpoint whose device cannot copy in process.
    let none = fabric.endpoint_on("none", DeviceOnly::new(Access::None)).unwrap();
    // SAFETY: as above.
    let (_, msg) = status_of(unsafe { none.register(&r) }.unwrap_err());
    assert!(msg.contains("cannot copy it in process"), "{msg}");
    // The mock's memory is host memory: an endpoint on the mock copies it with the CPU.
    let on_mock = fabric.endpoint_on("mock", mock.clone()).unwrap();
    // SAFETY: `buf` outlives the endpoint's use of it; no transfer touches it.
    unsafe { on_mock.register(&r) }.unwrap();
    on_mock.deregister(&r).unwrap();
    // Host memory needs no device.
    let mut host = vec![0u8; 64];
    // SAFETY: a live buffer of this test; no transfer touches it.
    unsafe { plain.register(&region(&mut host)) }.unwrap();
}

#[test]
fn device_memory_is_copied_by_its_device_and_host_memory_by_the_cpu() {
    let dev = DeviceOnly::new(Access::Device);
    let fabric = Fabric::new();
    let p = fabric.endpoint_on("prefill", dev.clone()).unwrap();
    let d = fabric.endpoint_on("decode", dev.clone()).unwrap();
    p.load_remote(&d.local_metadata().unwrap()).unwrap();
    d.load_remote(&p.local_metadata().unwrap()).unwrap();
    let (src, dst) = (dev.alloc(1 << 16).unwrap(), dev.alloc(1 << 16).unwrap());
    let data = pattern(1 << 16, 7);
    src.write_at(0, &data).unwrap();
    let (mut host_src, mut host_dst) = (pattern(4096, 9), vec![0u8; 4096]);
    // SAFETY: the buffers are alive until the end of the test; the test touches them only while no
    // transfer is in flight.
    unsafe {
        p.register(&src.region()).unwrap();
        d.register(&dst.region()).unwrap();
        p.register(&region(&mut host_src)).unwrap();
        d.register(&region(&mut host_dst)).unwrap();
    }
    let (s, t) = (src.region().addr, dst.region().addr);
    let descs = [
        Desc { local: s, remote: t + 32768, len: 32768 },
        Desc { local: s + 32768, remote: t, len: 32768 },
        // Host to device and host to host.
        Desc { local: addr(&mut host_src), remote: t + 100, len: 16 },
        Desc { local: addr(&mut host_src), remote: addr(&mut host_dst), len: 4096 },
    ];
    let id = p.post(Op::Write, "decode", &descs, Some(b"landed")).unwrap();
    assert_eq!(wait(&p, id), Ok(XferState::Done));
    assert_eq!(wait_notifications(&d, 1)[0].msg, b"landed");
    assert_eq!(dev.copies.load(Ordering::Relaxed), 3, "every descriptor touching device memory went to the device");
    let mut got = vec![0u8; 1 << 16];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got[32768..], data[..32768]);
    assert_eq!(got[..100], data[32768..32868]);
    assert_eq!(got[100..116], host_src[..16]);
    assert_eq!(got[116..32768], data[32884..]);
    assert_eq!(host_dst, host_src);
    // A read pulls through the device too.
    let id = d.post(Op::Read, "prefill", &[Desc { local: t, remote: s, len: 1024 }], None).unwrap();
    assert_eq!(wait(&d, id), Ok(XferState::Done));
    assert_eq!(dev.copies.load(Ordering::Relaxed), 4);
    dst.read_at(0, &mut got[..1024]).unwrap();
    assert_eq!(got[..1024], data[..1024]);
    p.deregister(&src.region()).unwrap();
    d.deregister(&dst.region()).unwrap();
}
