//! The NIXL transport over real NIXL (UCX, host memory), two agents in one process.
//!
//! Needs `libnixl_capi.so` (scripts/nixl.sh provides it; scripts/test.sh sources it). Under CI
//! (`CI=true`) a missing NIXL fails these tests; elsewhere they say so loudly and return.

use std::time::{Duration, Instant};

use kvpush::device::{Buffer, MemKind, MemRegion};
use kvpush::transport::nixl::PostCounts;
use kvpush::transport::nixl::{self, NixlConfig, NixlTransport};
use kvpush::transport::{Desc, Notification, Op, Transport, TransportError, Units, XferState};
use kvpush_testkit::bounce;

fn nixl_or_skip() -> bool {
    kvpush_testkit::require(
        "NIXL (libnixl_capi.so: run `. scripts/nixl.sh` first; scripts/test.sh does)",
        nixl::available(),
    )
}

/// The error text of an agent `agent` on `backend`, which must fail to start (`why` says why), or
/// `None` where NIXL is not available (see [`nixl_or_skip`]).
fn refused_backend(agent: &str, backend: &str, why: &str) -> Option<String> {
    if !nixl_or_skip() {
        return None;
    }
    let mut c = NixlConfig::new(agent);
    c.backend = backend.into();
    Some(NixlTransport::new(&c).expect_err(why).to_string())
}

/// Two UCX agents named `a` and `b`, or `None` where NIXL is not available (see [`nixl_or_skip`]).
fn agents(a: &str, b: &str) -> Option<(NixlTransport, NixlTransport)> {
    if !nixl_or_skip() {
        return None;
    }
    let agent = |name: &str| NixlTransport::new(&NixlConfig::new(name)).unwrap_or_else(|e| panic!("agent {name}: {e}"));
    Some((agent(a), agent(b)))
}

fn region(buf: &mut [u8]) -> MemRegion {
    MemRegion { addr: buf.as_mut_ptr() as u64, len: buf.len() as u64, kind: MemKind::Dram, dev_id: 0 }
}

/// Polls `t` until transfer `id` is done, progressing the peer too (no progress threads); the peer's
/// notifications seen meanwhile are kept in `seen`.
fn wait_done(
    t: &NixlTransport,
    id: kvpush::transport::XferId,
    peer_side: &NixlTransport,
    seen: &mut Vec<Notification>,
) -> Result<(), TransportError> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match t.poll(id)? {
            XferState::Done => return Ok(()),
            XferState::Pending => {}
        }
        peer_side.take_notifications(seen)?;
        assert!(Instant::now() < deadline, "transfer did not finish");
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Waits for `t`'s next notification, progressing `other` too (no progress threads).
fn wait_notif(t: &NixlTransport, other: &NixlTransport, seen: &mut Vec<Notification>) -> Notification {
    let deadline = Instant::now() + Duration::from_secs(20);
    let out = seen;
    loop {
        if !out.is_empty() {
            return out.remove(0);
        }
        t.take_notifications(out).expect("getNotifs");
        let mut others = Vec::new();
        other.take_notifications(&mut others).expect("getNotifs");
        assert!(others.is_empty(), "unexpected notification on the other side: {others:?}");
        assert!(Instant::now() < deadline, "no notification");
        std::thread::sleep(Duration::from_micros(50));
    }
}

#[test]
fn write_and_read_with_notifications_over_ucx() {
    let Some((p, d)) = agents("t-prefill", "t-decode") else { return };
    let mut src: Vec<u8> = (0..1 << 20).map(|i| (i * 7 % 251) as u8).collect();
    let mut dst = vec![0u8; 1 << 20];
    // SAFETY: both buffers live until the end of the test, after the agents are dropped; the test
    // touches them only when no transfer is in flight.
    unsafe {
        p.register(&region(&mut src)).expect("register src");
        d.register(&region(&mut dst)).expect("register dst");
    }
    let name_d = p.load_remote(&d.local_metadata().expect("md")).expect("load d");
    let name_p = d.load_remote(&p.local_metadata().expect("md")).expect("load p");
    assert_eq!((name_d.as_str(), name_p.as_str()), ("t-decode", "t-prefill"));

    // WRITE of 3 descriptors (two merged-style runs and a scattered one) with a notification.
    let (s, t) = (src.as_ptr() as u64, dst.as_ptr() as u64);
    let descs = [
        Desc { local: s, remote: t + 4096, len: 65536 },
        Desc { local: s + 65536, remote: t, len: 4096 },
        Desc { local: s + 500_000, remote: t + 700_000, len: 12345 },
    ];
    let mut seen = Vec::new();
    let id = p.post(Op::Write, &name_d, &descs, Some(b"done-1")).expect("post write");
    wait_done(&p, id, &d, &mut seen).expect("write completes");
    let n = wait_notif(&d, &p, &mut seen);
    assert_eq!((n.from.as_str(), n.msg.as_slice()), ("t-prefill", b"done-1".as_slice()));
    assert_eq!(&dst[4096..4096 + 65536], &src[..65536]);
    assert_eq!(&dst[..4096], &src[65536..65536 + 4096]);
    assert_eq!(&dst[700_000..700_000 + 12345], &src[500_000..500_000 + 12345]);

    // READ back from D into another part of P's buffer; the notification goes to D.
    let id = p
        .post(Op::Read, &name_d, &[Desc { local: s + 900_000, remote: t, len: 4096 }], Some(b"read-1"))
        .expect("post read");
    wait_done(&p, id, &d, &mut seen).expect("read completes");
    assert_eq!(wait_notif(&d, &p, &mut seen).msg, b"read-1");
    assert_eq!(&src[900_000..904_096], &src[65536..65536 + 4096]);

    // A bare notification.
    p.send_notification(&name_d, b"hello").expect("genNotif");
    assert_eq!(wait_notif(&d, &p, &mut seen).msg, b"hello");

    // Errors carry the call, the status and the peer.
    let e = p.post(Op::Write, "nobody", &descs, None).expect_err("unknown peer");
    assert!(matches!(e, TransportError::UnknownPeer(_)), "{e}");
    let outside = [Desc { local: 0x10, remote: t, len: 8 }];
    let e = p.post(Op::Write, &name_d, &outside, None).expect_err("unregistered local memory");
    assert!(matches!(e, TransportError::NotRegistered { side: "local", .. }), "{e}");
    let e = d.load_remote(b"garbage").expect_err("bad metadata");
    assert!(e.to_string().contains("loadRemoteMD"), "{e}");
}

/// Descriptor lists prepared once: single-unit descriptors go by index, merged runs are built per
/// post, a restarted peer's old list is never used, and the bytes land either way.
#[test]
fn prepared_lists_post_single_units_by_index() {
    const UNIT: u64 = 4096;
    let Some((p, d)) = agents("t-prep-p", "t-prep-d") else { return };
    let mut src: Vec<u8> = (0..64 * UNIT as usize).map(|i| (i * 13 % 253) as u8).collect();
    let mut dst = vec![0u8; 64 * UNIT as usize];
    // SAFETY: both buffers outlive the agents (dropped at the end of the test, before the buffers);
    // the test reads them only when no transfer is in flight.
    unsafe {
        p.register(&region(&mut src)).expect("register src");
        d.register(&region(&mut dst)).expect("register dst");
    }
    let (s, t) = (src.as_ptr() as u64, dst.as_ptr() as u64);
    // Two spans per side (like a layer's K and V regions), 32 units each.
    let spans =
        |base: u64| [Units { base, unit: UNIT, count: 32 }, Units { base: base + 32 * UNIT, unit: UNIT, count: 32 }];
    p.prepare(None, &spans(s)).expect("prepare local");
    let name_d = p.load_remote(&d.local_metadata().expect("md")).expect("load d");
    d.load_remote(&p.local_metadata().expect("md")).expect("load p");
    p.prepare(Some(&name_d), &spans(t)).expect("prepare remote");

    // Scattered single units across both spans: by index.
    let singles: Vec<Desc> = [(3, 40), (40, 3), (63, 0), (0, 63), (17, 17)]
        .iter()
        .map(|&(a, b)| Desc { local: s + a * UNIT, remote: t + b * UNIT, len: UNIT })
        .collect();
    let mut seen = Vec::new();
    let id = p.post(Op::Write, &name_d, &singles, Some(b"prepped")).expect("post by index");
    wait_done(&p, id, &d, &mut seen).expect("write completes");
    assert_eq!(wait_notif(&d, &p, &mut seen).msg, b"prepped");
    assert_eq!(p.post_counts(), PostCounts { prepared: 1, built: 0 });
    for d in &singles {
        let (a, b) = ((d.local - s) as usize, (d.remote - t) as usize);
        assert_eq!(&dst[b..b + UNIT as usize], &src[a..a + UNIT as usize], "unit {a} -> {b}");
    }

    // A merged run (4 units) and an unaligned piece: built for the post.
    let merged = [
        Desc { local: s + 4 * UNIT, remote: t + 8 * UNIT, len: 4 * UNIT },
        Desc { local: s + 100, remote: t + 60 * UNIT, len: 10 },
    ];
    let id = p.post(Op::Write, &name_d, &merged, Some(b"built")).expect("post built");
    wait_done(&p, id, &d, &mut seen).expect("write completes");
    assert_eq!(wait_notif(&d, &p, &mut seen).msg, b"built");
    assert_eq!(p.post_counts(), PostCounts { prepared: 1, built: 1 });
    assert_eq!(&dst[8 * UNIT as usize..12 * UNIT as usize], &src[4 * UNIT as usize..8 * UNIT as usize]);
    assert_eq!(&dst[60 * UNIT as usize..60 * UNIT as usize + 10], &src[100..110]);

    // Reloading the peer's metadata (a restart) drops its prepared list: built again until re-prepared.
    p.load_remote(&d.local_metadata().expect("md")).expect("reload d");
    let id = p.post(Op::Write, &name_d, &singles[..1], None).expect("post after reload");
    wait_done(&p, id, &d, &mut seen).expect("write completes");
    assert_eq!(p.post_counts(), PostCounts { prepared: 1, built: 2 });

    // Bad spans are refused with the call named.
    let e = p
        .prepare(None, &[Units { base: s, unit: UNIT, count: 8 }, Units { base: s + 4 * UNIT, unit: UNIT, count: 8 }])
        .expect_err("overlap");
    assert!(e.to_string().contains("prepXferDlist") && e.to_string().contains("overlap"), "{e}");
    let e = p.prepare(None, &[Units { base: 0x1000, unit: UNIT, count: 8 }]).expect_err("unregistered");
    assert!(matches!(e, TransportError::NotRegistered { side: "local", .. }), "{e}");
}

#[test]
fn unknown_backend_is_a_clear_error() {
    let Some(text) = refused_backend("t-bad-backend", "NOPE", "no such plugin") else { return };
    assert!(text.contains("getPluginParams") && text.contains("NOPE"), "{text}");
}

/// The metadata names the agent's device; a staged WRITE of many small descriptors goes over real
/// NIXL in pieces through both sides' staging slots, lands byte for byte, and its notification is
/// delivered only once every piece is scattered.
#[test]
fn staged_write_over_ucx_lands_every_byte() {
    use kvpush::device::host::HostDevice;
    use kvpush::transport::staged::{Staged, StagingConfig};
    if !nixl_or_skip() {
        return;
    }
    let host = HostDevice::new();
    let cfg = StagingConfig { slots: 2, slot_bytes: 64 << 10, max_entries: 64, ..StagingConfig::default() };
    let stage = |name: &str| {
        let inner = std::sync::Arc::new(NixlTransport::new(&NixlConfig::new(name)).expect("agent"));
        Staged::new(inner, &host, cfg).expect("staging slots").expect("host memory stages")
    };
    let (p, d) = (stage("s-prefill"), stage("s-decode"));
    let mut src = host.alloc_anon(1 << 20).expect("src");
    let mut dst = host.alloc_anon(1 << 20).expect("dst");
    for (i, b) in src.as_mut_slice().iter_mut().enumerate() {
        *b = (i * 13 % 251) as u8;
    }
    // SAFETY: both buffers outlive the transports (declared before them is not enough: they are
    // dropped explicitly at the end, after the transports); the test reads them only when no
    // transfer is in flight.
    unsafe {
        p.register(&src.region()).expect("register src");
        d.register(&dst.region()).expect("register dst");
    }
    let md = p.local_metadata().expect("md");
    assert_eq!(&md[..4], b"KSM1", "staging capabilities come first");
    assert!(md.windows(4).any(|w| w == nixl::MD_MAGIC_V2), "then the NIXL agent's metadata with its devices");
    let name_d = p.load_remote(&d.local_metadata().expect("md")).expect("load d");
    let name_p = d.load_remote(&md).expect("load p");
    assert_eq!((name_d.as_str(), name_p.as_str()), ("s-decode", "s-prefill"));
    // 200 scattered 4 KiB descriptors (a fragmented request): ~12 pieces of 64 KiB.
    let (s, t) = (src.region().addr, dst.region().addr);
    let descs = bounce::scattered(&src.region(), &dst.region(), 200, 256);
    let id = p.post(Op::Write, &name_d, &descs, Some(b"staged-1")).expect("post");
    assert_eq!(p.counts().open, 1, "posted, not finished: {:?}", p.counts());
    let deadline = Instant::now() + Duration::from_secs(20);
    // D's gauges while the transfer lands: it needs more than one D pump (2 slots, ~12 pieces, each
    // grant answered by P), so the gauges are seen up at least once.
    let (mut incoming, mut in_use) = (0, 0);
    let seen = bounce::pump(&p, &d, id, deadline, |_, d| {
        let dc = d.counts();
        (incoming, in_use) = (incoming.max(dc.incoming), in_use.max(dc.slots_in_use));
    });
    assert_eq!((incoming, in_use), (1, 2), "D tracked one transfer in both its slots at some point");
    // Then every slot comes back, and nothing stays tracked.
    let idle = |p: &Staged, d: &Staged| {
        let (pc, dc) = (p.counts(), d.counts());
        (pc.open, pc.incoming, pc.slots_in_use, dc.open, dc.incoming, dc.slots_in_use)
    };
    while idle(&p, &d) != (0, 0, 0, 0, 0, 0) {
        let mut mine = Vec::new();
        p.take_notifications(&mut mine).expect("P pumps");
        d.take_notifications(&mut mine).expect("D pumps");
        assert!(Instant::now() < deadline, "staging not idle after the transfer: {:?}", idle(&p, &d));
    }
    assert_eq!((seen[0].from.as_str(), seen[0].msg.as_slice()), ("s-prefill", b"staged-1".as_slice()));
    let (a, b) = (src.as_mut_slice().to_vec(), dst.as_mut_slice().to_vec());
    for dsc in &descs {
        let (l, r) = ((dsc.local - s) as usize, (dsc.remote - t) as usize);
        assert_eq!(b[r..r + 4096], a[l..l + 4096], "descriptor {dsc:?}");
    }
    let (pc, dc) = (p.counts(), d.counts());
    assert_eq!((pc.transfers, dc.received, pc.entries), (1, 1, 200), "{pc:?} {dc:?}");
    assert!(pc.pieces >= 12, "200 × 4 KiB through 64 KiB slots: {pc:?}");
    // A descriptor of unregistered memory is not staged: it goes to NIXL, which refuses it.
    let e = p.post(Op::Write, &name_d, &[Desc { local: 0x1000, remote: t, len: 4096 }; 2], None).expect_err("outside");
    assert!(matches!(e, TransportError::NotRegistered { .. }), "{e}");
    drop((p, d));
    drop((src, dst));
}

/// kvpush's NIXL metadata starts with its regions and their devices; cut short, it is refused before
/// NIXL sees it.
#[test]
fn metadata_names_the_device_and_a_cut_short_prefix_is_refused() {
    let Some((a, b)) = agents("md-a", "md-b") else { return };
    let md = b.local_metadata().expect("md");
    assert_eq!((&md[..4], &md[4..8]), (&nixl::MD_MAGIC_V2[..], &[0u8, 0, 0, 0][..]), "no region registered yet");
    let mut buf = vec![0u8; 4096];
    let r = MemRegion { addr: buf.as_mut_ptr() as u64, len: 4096, kind: MemKind::Dram, dev_id: 0 };
    // SAFETY: `buf` outlives `b` (dropped at the end of the test after it); nothing transfers into it.
    unsafe { b.register(&r) }.expect("register");
    let md = b.local_metadata().expect("md");
    let entry = [&r.addr.to_le_bytes()[..], &4096u64.to_le_bytes(), &[0, 0, 0, 0]].concat();
    assert_eq!((&md[4..8], &md[8..28]), (&[1u8, 0, 0, 0][..], &entry[..]), "one region, on device 0");
    let e = a.load_remote(&md[..6]).expect_err("cut short");
    assert!(matches!(&e, TransportError::BadMetadata(m) if m.contains("cut short")), "{e}");
    assert_eq!(a.load_remote(&md).expect("whole"), "md-b");
    drop((a, b));
    drop(buf);
}

/// The wheel's LIBFABRIC plugin cannot load on these machines (docs/deployment.md, "LIBFABRIC on a
/// machine without EFA": it needs libfabric's FABRIC_1.10 symbols, libcuda.so.1 and hwloc). Asking
/// for it must be an error that names the backend and where plugins come from, never an abort or a
/// silent fallback to UCX.
#[test]
fn a_libfabric_plugin_that_cannot_load_is_a_clear_error() {
    let Some(msg) = refused_backend("t-libfabric", "LIBFABRIC", "the LIBFABRIC plugin has no libfabric here") else {
        return;
    };
    assert!(msg.contains("LIBFABRIC") && msg.contains("NIXL_PLUGIN_DIR"), "{msg}");
    // The same agent name with UCX works: the failure is the plugin's, not NIXL's.
    assert!(NixlTransport::new(&NixlConfig::new("t-libfabric")).is_ok());
}
