//! Engines on host memory and the loopback transport, in this process: the fixture behind the
//! stress driver, the idle-CPU test and the engine-thread bench.
//!
//! [`loopback_worker`] allocates a layout's regions, opens a fabric endpoint and starts an engine
//! whose control link is a [`LocalHub`]; [`connect`] introduces two engines to each other;
//! [`wait_for`] polls an engine for one outcome against a deadline. Nothing here decides when a
//! block may be reused: that stays with the caller (see [`loopback_worker`]'s `# Safety`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpush::device::{host::HostDevice, Buffer, Device};
use kvpush::engine::side::{ConnId, Incarnation, SideChannel, SideConfig};
use kvpush::engine::{Config, Engine, Finished, LocalHub};
use kvpush::proto::layout::{KvLayout, Parallel};
use kvpush::proto::{Key, Mode};
use kvpush::transport::loopback::{Fabric, LoopbackTransport};
use kvpush::transport::trust::DataKeys;

use crate::layouts;

/// One worker: an engine, its loopback endpoint, and the memory its layout points at. Field order
/// is drop order: the engine (which deregisters its memory) goes first, the memory last.
#[derive(Debug)]
pub struct Worker {
    pub engine: Engine,
    pub transport: Arc<LoopbackTransport>,
    pub buffers: Vec<Box<dyn Buffer>>,
}

/// Starts an engine with `config` on `layout`, whose regions it allocates on `dev`, over an endpoint
/// of `fabric` named `endpoint` that copies `dev`'s memory, attached to `hub`.
///
/// # Safety
///
/// [`Engine::new`]'s precondition 1 holds by construction (the regions are the returned worker's
/// buffers, dropped after its engine). The caller guarantees precondition 2: a request's blocks are
/// not written while the engine reads them nor read or reused while peers write them, until the
/// request's [`Finished`] outcome.
pub unsafe fn loopback_worker(
    config: Config,
    mut layout: KvLayout,
    dev: &Arc<dyn Device>,
    fabric: &Fabric,
    endpoint: &str,
    hub: &Arc<LocalHub>,
) -> Worker {
    let buffers = layouts::allocate(&mut layout, dev.as_ref()).expect("host memory");
    // The endpoint knows the memory's device, so it copies device memory (GPU) the device's way.
    let transport = Arc::new(fabric.endpoint_on(endpoint, dev.clone()).expect("endpoint"));
    // SAFETY: precondition 1: the regions are `buffers`, allocated just above on `dev` and owned by
    // the returned `Worker`, which drops its engine first. Precondition 2 is the caller's (this
    // function's own precondition).
    let engine =
        unsafe { Engine::new(config, layout, dev.clone(), transport.clone(), hub.clone()) }.expect("engine starts");
    hub.attach(engine.addr().clone(), engine.sink());
    Worker { engine, transport, buffers }
}

/// One worker whose control link is a real TCP side channel. Field order is drop order: the engine
/// first, the memory last.
#[derive(Debug)]
pub struct SideWorker {
    pub engine: Engine,
    pub side: Arc<SideChannel>,
    pub buffers: Vec<Box<dyn Buffer>>,
}

/// Starts a worker of engine `id` in `mode` over a side channel bound with `side` and an endpoint of
/// `fabric` named `endpoint` (two processes of one engine, the old and the restarted, need two
/// endpoints): two layers, two KV heads of dimension 16, 64 blocks on host memory; completion timeout
/// and lease 3 s. Not yet connected to anyone.
///
/// # Safety
///
/// [`loopback_worker`]'s precondition 2: a request's blocks are not written while the engine reads
/// them nor read or reused while peers write them, until the request's outcome.
pub unsafe fn side_worker(id: &str, endpoint: &str, mode: Mode, fabric: &Fabric, side: SideConfig) -> SideWorker {
    let dev: Arc<dyn Device> = Arc::new(HostDevice::new());
    let mut l = layouts::separate(layouts::full_model(2, 2, 16), 64, Parallel::SINGLE);
    let buffers = layouts::allocate(&mut l, dev.as_ref()).expect("host memory");
    let side = Arc::new(SideChannel::bind(side).expect("bind"));
    let transport = Arc::new(fabric.endpoint(endpoint).expect("endpoint"));
    let mut config = Config::new(id, mode);
    config.completion.timeout_us = 3_000_000;
    config.rendezvous.lease_us = 3_000_000;
    // SAFETY: precondition 1: the regions are `buffers`, allocated just above and owned by the
    // returned worker, which drops its engine first. Precondition 2 is this function's own.
    let engine = unsafe { Engine::new(config, l, dev, transport, side.clone()) }.expect("engine");
    side.serve(engine.endpoint());
    SideWorker { engine, side, buffers }
}

/// Two small push engines, `p` and `d` (two layers, one KV head of dimension 64, 64 blocks each, on
/// host memory), over one loopback fabric and introduced to each other: the engines of the tests that
/// watch every thread of their process (tests/idle_cpu.rs, tests/writer_policy.rs). Field order is
/// drop order: the engines first.
#[derive(Debug)]
pub struct SmallPair {
    pub p: Worker,
    pub d: Worker,
    pub fabric: Fabric,
    pub hub: Arc<LocalHub>,
}

/// Starts a [`SmallPair`].
///
/// # Safety
///
/// [`loopback_worker`]'s precondition 2, for both engines: a request's blocks are not written while
/// an engine reads them nor read or reused while the peer writes them, until the request's outcome.
pub unsafe fn small_pair() -> SmallPair {
    let dev: Arc<dyn Device> = Arc::new(HostDevice::new());
    let fabric = Fabric::new();
    let hub = LocalHub::new();
    let worker = |id: &str| {
        let layout = layouts::separate(layouts::full_model(2, 1, 64), 64, Parallel::SINGLE);
        // SAFETY: precondition 2 is this function's own, passed on to its caller.
        unsafe { loopback_worker(Config::new(id, Mode::Push), layout, &dev, &fabric, id, &hub) }
    };
    let (p, d) = (worker("p"), worker("d"));
    connect(&p.engine, &d.engine);
    SmallPair { p, d, fabric, hub }
}

/// Introduces `a` and `b` to each other (each accepts the other's handshake).
pub fn connect(a: &Engine, b: &Engine) {
    b.add_peer(&a.handshake().expect("handshake")).expect("peer accepted");
    a.add_peer(&b.handshake().expect("handshake")).expect("peer accepted");
}

/// Introduces `a` and `b` to each other as the side channel does: `a` is the process
/// `a_incarnation`, `b` the process `b_incarnation`, so a later `peer_lost` of either names it.
pub fn connect_as(a: &Engine, a_incarnation: Incarnation, b: &Engine, b_incarnation: Incarnation) {
    connect_over(a, a_incarnation, b, b_incarnation, ConnId(0));
}

/// [`connect_as`] over the side-channel connection `conn` (each side knows the other by it): the
/// same processes connecting again over another `conn` is a reconnection.
pub fn connect_over(a: &Engine, a_incarnation: Incarnation, b: &Engine, b_incarnation: Incarnation, conn: ConnId) {
    let (ea, eb) = (a.endpoint().upgrade().expect("engine a"), b.endpoint().upgrade().expect("engine b"));
    // Each side's receive key, as the side channel's handshake agrees them.
    let (a_recv, b_recv) = ([0xa5; 32], [0xb5; 32]);
    let keys_of_a = DataKeys { send: a_recv, recv: b_recv };
    let keys_of_b = DataKeys { send: b_recv, recv: a_recv };
    eb.add_peer(&a.handshake().expect("handshake"), a_incarnation, conn, keys_of_a).expect("peer accepted");
    ea.add_peer(&b.handshake().expect("handshake"), b_incarnation, conn, keys_of_b).expect("peer accepted");
}

/// Cuts the connection between `a` and `b` (connected with [`connect_as`]) on both sides, as the side
/// channel reports a lost peer; their data path is left as it is.
pub fn cut(a: &Engine, a_incarnation: Incarnation, b: &Engine, b_incarnation: Incarnation) {
    cut_over(a, a_incarnation, b, b_incarnation, ConnId(0));
}

/// [`cut`] of the connection `conn` ([`connect_over`]); returns whether each side (`b`, then `a`)
/// took it as the other's loss (not if that process had connected again over another connection).
pub fn cut_over(
    a: &Engine,
    a_incarnation: Incarnation,
    b: &Engine,
    b_incarnation: Incarnation,
    conn: ConnId,
) -> (bool, bool) {
    let (ea, eb) = (a.endpoint().upgrade().expect("engine a"), b.endpoint().upgrade().expect("engine b"));
    let b_lost_a = eb.peer_lost(a.addr(), a_incarnation, conn, "cut by the test");
    let a_lost_b = ea.peer_lost(b.addr(), b_incarnation, conn, "cut by the test");
    (b_lost_a, a_lost_b)
}

/// Whether `f` releases `key` on a producer ([`Finished::Sent`], for any reason).
pub fn released(f: &Finished, key: Key) -> bool {
    matches!(f, Finished::Sent { key: k, .. } if *k == key)
}

/// Polls `engine` until `pred` accepts an outcome (returned; the others seen meanwhile are dropped)
/// or `limit` passes (a panic naming `what` and the outcomes seen).
pub fn wait_for(engine: &Engine, what: &str, limit: Duration, pred: impl Fn(&Finished) -> bool) -> Finished {
    let deadline = Instant::now() + limit;
    let mut out = Vec::new();
    let mut seen = Vec::new();
    loop {
        engine.poll(&mut out);
        if let Some(i) = out.iter().position(&pred) {
            return out.swap_remove(i);
        }
        seen.append(&mut out);
        assert!(Instant::now() < deadline, "{}: no {what} within {limit:?}; saw {seen:?}", engine.addr());
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Polls `cond` until it holds or `limit` passes (a panic naming `what` and `state()`, what was seen).
pub fn poll_until<S: std::fmt::Debug>(
    what: &str,
    limit: Duration,
    mut state: impl FnMut() -> S,
    cond: impl Fn(&S) -> bool,
) -> S {
    let deadline = Instant::now() + limit;
    loop {
        let s = state();
        if cond(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}; last seen {s:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// User + system CPU seconds this process has spent so far, all its threads (`/proc/self/stat`), for
/// the idle-CPU checks of the engines built here (`tests/idle_cpu.rs`, `benches/engine_thread.rs`).
pub fn process_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("read /proc/self/stat");
    // Fields after the parenthesized command name; utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().expect("utime") + f[12].parse::<f64>().expect("stime");
    ticks / 100.0 // USER_HZ is 100 on Linux
}
