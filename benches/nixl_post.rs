//! The fixed cost of one NIXL post, call by call (issues #21 and #22): two NIXL agents in one
//! process (UCX, no progress thread, as `kvpush::transport::nixl` creates them), each with one
//! registered pool of `--pool` units of `--len` bytes, host memory or (`--memory cuda`) VRAM of one
//! GPU. For each descriptor count (`--counts`) the same WRITE of that many one-unit descriptors, with
//! a notification, is made three ways, interleaved per iteration:
//!
//! * `built`: both descriptor lists built for the post and `createXferReq` (what kvpush does today
//!   for merged runs longer than a unit);
//! * `prepared`: `makeXferReq` by index from lists prepared once (`prepXferDlist`; what kvpush does
//!   for one-unit descriptors);
//! * `repost`: a request made once and posted again (the floor: no request set-up at all);
//!
//! then `postXferReq` (after `--gap-us` asleep, as a writer waiting for the next layer), then the status polled until it is done (`complete`, the receiver's
//! notifications drained meanwhile), then the request released. Each call is timed on its own
//! (`Instant`, µs, median and p90 over `--iters`).
//!
//! D's agent runs in a child process (this binary again, `--child`), as kvpush's peers do;
//! `--one-process` keeps both here (no model of the GPU path: UCX then moved VRAM through host copies).
//!
//! `cargo bench --bench nixl_post [-- --memory cuda --len 4194304]` measures (cargo passes `--bench`);
//! without `--bench` (as `cargo test --benches` runs it) it makes one small pass and checks that every
//! post finished and delivered its notification. NIXL must be loadable (`. scripts/nixl.sh`); under
//! `CI=true` its absence fails, otherwise it skips.

use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use crossbeam_channel::Receiver;
use kvpush::device::cuda::{CudaBuffer, CudaDevice};
use kvpush::device::host::{HostBuffer, HostDevice};
use kvpush::device::{Buffer, MemKind, MemRegion};
use kvpush_testkit::child::{hex, Channel, Child, Incoming};
use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, MemoryRegion, NixlDescriptor, OptArgs, RegistrationHandle, ThreadSync,
    XferDescList, XferDlistHandle, XferOp, XferRequest, XferStatus,
};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Memory {
    Host,
    Cuda,
}

#[derive(Parser, Debug)]
struct Args {
    /// Measure (without it: one small checked pass).
    #[arg(long)]
    bench: bool,
    #[arg(long, value_enum, default_value = "host")]
    memory: Memory,
    /// The GPU (with `--memory cuda`).
    #[arg(long, default_value_t = 0)]
    gpu: u32,
    /// Bytes of one unit (one descriptor); a comma-separated list runs each.
    #[arg(long, value_delimiter = ',', default_value = "4096,4194304")]
    len: Vec<u64>,
    /// Units in each agent's pool (at least twice the largest count).
    #[arg(long, default_value_t = 256)]
    pool: u64,
    #[arg(long, value_delimiter = ',', default_value = "1,2,16,128")]
    counts: Vec<u64>,
    #[arg(long, default_value_t = 200)]
    iters: u32,
    /// Sleep this long before each post, as a writer that waits for the next layer does.
    #[arg(long, default_value_t = 0)]
    gap_us: u64,
    /// Spend the gap spinning instead of asleep: a cold CPU (idle states, caches) against a driver
    /// or device that went idle.
    #[arg(long)]
    spin: bool,
    /// With --spin: ask P's agent for notifications (a UCX progress) every this many µs of the gap,
    /// as a writer that keeps polling its transport between layers does (0: never).
    #[arg(long, default_value_t = 0)]
    progress_us: u64,
    /// With --spin and --memory cuda: keep the GPU busy during the gap (8 MiB host-to-device copies
    /// back to back), as a prefill computing the next layer does.
    #[arg(long)]
    busy_gpu: bool,
    /// D's agent in this process too (without it D runs in a child process, as kvpush's peers do).
    #[arg(long)]
    one_process: bool,
    /// Internal: run as D's child process.
    #[arg(long, hide = true)]
    child: bool,
    /// Extra arguments cargo passes to benches.
    #[arg(hide = true, trailing_var_arg = true, allow_hyphen_values = true)]
    _rest: Vec<String>,
}

/// A pool as NIXL registers it (kvpush's own `RegionDesc` is private to `transport::nixl`).
#[derive(Debug)]
struct Registered {
    addr: u64,
    bytes: usize,
    kind: MemType,
    device: u64,
}

impl Registered {
    fn of(r: MemRegion) -> Self {
        Self { addr: r.addr, bytes: r.len as usize, kind: mem_type(r.kind), device: r.dev_id.into() }
    }
}

impl MemoryRegion for Registered {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as usize as *const u8
    }
    fn size(&self) -> usize {
        self.bytes
    }
}

impl NixlDescriptor for Registered {
    fn mem_type(&self) -> MemType {
        self.kind
    }
    fn device_id(&self) -> u64 {
        self.device
    }
}

fn mem_type(kind: MemKind) -> MemType {
    if kind == MemKind::Vram {
        MemType::Vram
    } else {
        MemType::Dram
    }
}

enum Pool {
    Host(HostBuffer),
    Cuda(CudaBuffer),
}

impl Pool {
    fn region(&self) -> MemRegion {
        match self {
            Pool::Host(b) => b.region(),
            Pool::Cuda(b) => b.region(),
        }
    }
}

struct Side {
    agent: Agent,
    backend: Backend,
    _reg: RegistrationHandle,
    region: MemRegion,
}

fn side(name: &str, pool: &Pool) -> Result<Side, String> {
    let cfg = AgentConfig { enable_prog_thread: false, thread_sync: ThreadSync::Rw, ..AgentConfig::default() };
    let agent = Agent::new_configured(name, &cfg).map_err(|e| format!("createAgent {name}: {e}"))?;
    let (_, params) = agent.get_plugin_params("UCX").map_err(|e| format!("UCX params: {e}"))?;
    let backend = agent.create_backend("UCX", &params).map_err(|e| format!("createBackend: {e}"))?;
    let region = pool.region();
    let reg = agent.register_memory(&Registered::of(region), None).map_err(|e| format!("registerMem: {e}"))?;
    Ok(Side { agent, backend, _reg: reg, region })
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Samples (µs) of one call for one way and count.
#[derive(Default)]
struct Calls {
    make: Vec<f64>,
    post: Vec<f64>,
    complete: Vec<f64>,
    release: Vec<f64>,
}

/// What D's child process sends: its memory and NIXL metadata, then (stdin closed) how many
/// notifications it took.
#[derive(Serialize, Deserialize)]
enum Reply {
    Ready { addr: u64, dev_id: u32, md: String },
    Notifs(u64),
    Error(String),
}

/// P's NIXL metadata, for D's child.
#[derive(Serialize, Deserialize)]
struct Hello {
    md: String,
}

/// D's agent: here, or in a child process that drains its own notifications.
enum Peer<'a> {
    Here(&'a Side),
    Child { proc: Child, rx: Receiver<((), Incoming<Reply>)> },
}

impl Peer<'_> {
    fn recv(&mut self) -> Result<Reply, String> {
        let Peer::Child { proc, rx } = self else { return Err("no child".into()) };
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(((), Incoming::Reply(Reply::Error(e)))) => Err(format!("D: {e}")),
            Ok(((), Incoming::Reply(r))) => Ok(r),
            Ok(((), Incoming::Garbled(why))) => Err(format!("D: garbled reply {why}")),
            _ => Err(format!("D's process ended: {:?}", proc.tail())),
        }
    }
}

/// D's child process: registers its pool, sends its metadata, loads P's, and takes notifications
/// until its stdin closes.
fn child_main(args: &Args) -> Result<(), String> {
    let mut out = Channel::open().map_err(|e| format!("channel: {e}"))?;
    let mut go = || -> Result<u64, String> {
        let pool = alloc(args, args.len[0])?;
        let d = side("bench-d", &pool)?;
        let md = d.agent.get_local_md().map_err(|e| format!("getLocalMD: {e}"))?;
        out.emit(&Reply::Ready { addr: d.region.addr, dev_id: d.region.dev_id, md: hex::encode(&md) });
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).map_err(|e| e.to_string())?;
        let hello: Hello = serde_json::from_str(&line).map_err(|e| e.to_string())?;
        let pmd = hex::decode(&hello.md).map_err(|e| e.to_string())?;
        d.agent.load_remote_md(&pmd).map_err(|e| format!("loadRemoteMD: {e}"))?;
        let open = Arc::new(AtomicBool::new(true));
        let o = Arc::clone(&open);
        std::thread::spawn(move || {
            let _ = std::io::stdin().read_line(&mut String::new());
            o.store(false, Ordering::Relaxed);
        });
        let mut n = 0;
        while open.load(Ordering::Relaxed) {
            n += drain(&d)?;
        }
        Ok(n + drain(&d)?)
    };
    match go() {
        Ok(n) => out.emit(&Reply::Notifs(n)),
        Err(e) => out.emit(&Reply::Error(e)),
    }
    Ok(())
}

/// Takes D's notifications; how many there were.
fn drain(d: &Side) -> Result<u64, String> {
    let mut map = nixl_sys::NotificationMap::new().map_err(|e| e.to_string())?;
    d.agent.get_notifications(&mut map, None).map_err(|e| format!("getNotifs: {e}"))?;
    let mut n = 0;
    for a in map.agents().filter_map(|a| a.ok()).map(str::to_owned).collect::<Vec<_>>() {
        n += map.get_notifications_size(&a).map_err(|e| e.to_string())? as u64;
    }
    Ok(n)
}

fn alloc(args: &Args, len: u64) -> Result<Pool, String> {
    let bytes = len * args.pool;
    Ok(match args.memory {
        Memory::Host => Pool::Host(HostDevice::new().alloc_anon(bytes).map_err(|e| e.to_string())?),
        Memory::Cuda => {
            let dev = CudaDevice::open(args.gpu).map_err(|e| e.to_string())?;
            Pool::Cuda(dev.alloc_cuda(bytes).map_err(|e| e.to_string())?)
        }
    })
}

struct Bench<'a> {
    p: &'a Side,
    d: Peer<'a>,
    /// D's pool.
    remote_region: MemRegion,
    len: u64,
    local: XferDlistHandle,
    remote: XferDlistHandle,
    notifs: u64,
}

impl Bench<'_> {
    fn args(&self, notif: &[u8]) -> Result<OptArgs, String> {
        let mut a = OptArgs::new().map_err(|e| e.to_string())?;
        a.add_backend(&self.p.backend).map_err(|e| e.to_string())?;
        a.set_notification_message(notif).map_err(|e| e.to_string())?;
        a.set_has_notification(true).map_err(|e| e.to_string())?;
        Ok(a)
    }

    /// The unit indices of `count` descriptors, every other unit (no two adjacent), shifted by `iter`.
    fn indices(&self, count: u64, iter: u32, pool: u64) -> Vec<i32> {
        (0..count).map(|k| ((2 * k + u64::from(iter % 2)) % pool) as i32).collect()
    }

    fn built(&self, idx: &[i32], args: &OptArgs) -> Result<XferRequest, String> {
        let mt = mem_type(self.p.region.kind);
        let mut l = XferDescList::new(mt).map_err(|e| e.to_string())?;
        let mut r = XferDescList::new(mt).map_err(|e| e.to_string())?;
        for &i in idx {
            let off = i as u64 * self.len;
            l.add_desc((self.p.region.addr + off) as usize, self.len as usize, u64::from(self.p.region.dev_id));
            r.add_desc(
                (self.remote_region.addr + off) as usize,
                self.len as usize,
                u64::from(self.remote_region.dev_id),
            );
        }
        self.p
            .agent
            .create_xfer_req(XferOp::Write, &l, &r, "bench-d", Some(args))
            .map_err(|e| format!("createXferReq: {e}"))
    }

    fn prepared(&self, idx: &[i32], args: &OptArgs) -> Result<XferRequest, String> {
        self.p
            .agent
            .make_xfer_req(XferOp::Write, &self.local, idx, &self.remote, idx, Some(args))
            .map_err(|e| format!("makeXferReq: {e}"))
    }

    /// Posts `req`, polls it to the end (draining D's notifications), returns (post, complete) µs.
    fn post(&mut self, req: &XferRequest, args: &OptArgs) -> Result<(f64, f64), String> {
        let t0 = Instant::now();
        self.p.agent.post_xfer_req(req, Some(args)).map_err(|e| format!("postXferReq: {e}"))?;
        let t1 = Instant::now();
        let deadline = t1 + std::time::Duration::from_secs(10);
        loop {
            match self.p.agent.get_xfer_status(req).map_err(|e| format!("getXferStatus: {e}"))? {
                XferStatus::Success => break,
                XferStatus::InProgress if Instant::now() < deadline => self.drain()?,
                XferStatus::InProgress => return Err("transfer not done in 10 s".into()),
            }
        }
        let t2 = Instant::now();
        self.drain()?;
        Ok(((t1 - t0).as_secs_f64() * 1e6, (t2 - t1).as_secs_f64() * 1e6))
    }

    /// In one process, D's notifications (D's worker progresses only when D calls into NIXL).
    fn drain(&mut self) -> Result<(), String> {
        if let Peer::Here(d) = self.d {
            self.notifs += drain(d)?;
        }
        Ok(())
    }
}

const WAYS: [&str; 3] = ["built", "prepared", "repost"];

fn run(args: &Args) -> Result<(), String> {
    let max_count = args.counts.iter().copied().max().unwrap_or(1);
    if args.pool < 2 * max_count {
        return Err(format!("--pool {} is less than twice the largest count {max_count}", args.pool));
    }
    println!(
        "memory {:?}, pool {} units, {} iterations per case, {} µs {} before each post, {}",
        args.memory,
        args.pool,
        args.iters,
        args.gap_us,
        if args.spin { "spinning" } else { "asleep" },
        if !args.one_process { "D in a child process" } else { "one process" }
    );
    println!("| unit | descriptors | way | make µs p50 / p90 | post µs p50 / p90 | complete µs p50 | release µs p50 |");
    println!("|---:|---:|---|---:|---:|---:|---:|");
    for &len in &args.len {
        let pp = alloc(args, len)?;
        let p = side("bench-p", &pp)?;
        let pmd = p.agent.get_local_md().map_err(|e| format!("getLocalMD: {e}"))?;
        let (dp, dside);
        let (peer, remote_region) = if !args.one_process {
            let exe = std::env::current_exe().map_err(|e| e.to_string())?;
            let mut cmd = Command::new(exe);
            cmd.args(["--child", "--memory", if args.memory == Memory::Cuda { "cuda" } else { "host" }]);
            cmd.args(["--gpu", &args.gpu.to_string(), "--len", &len.to_string(), "--pool", &args.pool.to_string()]);
            let (tx, rx) = crossbeam_channel::unbounded();
            let proc = Child::spawn(cmd, "d", (), tx, None).map_err(|e| format!("cannot start D: {e}"))?;
            let mut peer = Peer::Child { proc, rx };
            let Reply::Ready { addr, dev_id, md } = peer.recv()? else { return Err("D: no metadata".into()) };
            let md = hex::decode(&md).map_err(|e| e.to_string())?;
            p.agent.load_remote_md(&md).map_err(|e| format!("loadRemoteMD: {e}"))?;
            if let Peer::Child { proc, .. } = &mut peer {
                proc.send(&Hello { md: hex::encode(&pmd) }).map_err(|e| format!("to D: {e}"))?;
            }
            (peer, MemRegion { addr, len: len * args.pool, kind: p.region.kind, dev_id })
        } else {
            dp = alloc(args, len)?;
            dside = side("bench-d", &dp)?;
            let md = dside.agent.get_local_md().map_err(|e| format!("getLocalMD: {e}"))?;
            p.agent.load_remote_md(&md).map_err(|e| format!("loadRemoteMD: {e}"))?;
            dside.agent.load_remote_md(&pmd).map_err(|e| format!("loadRemoteMD: {e}"))?;
            (Peer::Here(&dside), dside.region)
        };
        let mt = mem_type(p.region.kind);
        let units = |r: MemRegion| -> Result<XferDescList<'static>, String> {
            let mut l = XferDescList::new(mt).map_err(|e| e.to_string())?;
            for i in 0..args.pool {
                l.add_desc((r.addr + i * len) as usize, len as usize, u64::from(r.dev_id));
            }
            Ok(l)
        };
        let mut pa = OptArgs::new().map_err(|e| e.to_string())?;
        pa.add_backend(&p.backend).map_err(|e| e.to_string())?;
        let local =
            p.agent.prepare_xfer_dlist("", &units(p.region)?, Some(&pa)).map_err(|e| format!("prep local: {e}"))?;
        let remote = p
            .agent
            .prepare_xfer_dlist("bench-d", &units(remote_region)?, Some(&pa))
            .map_err(|e| format!("prep remote: {e}"))?;
        let mut b = Bench { p: &p, d: peer, remote_region, len, local, remote, notifs: 0 };
        let busy = match (args.busy_gpu, args.memory) {
            (true, Memory::Cuda) => {
                let dev = CudaDevice::open(args.gpu).map_err(|e| e.to_string())?;
                Some(dev.alloc_cuda(8 << 20).map_err(|e| e.to_string())?)
            }
            _ => None,
        };
        let zeros = vec![0u8; 8 << 20];
        // Warm-up: connections, remote keys, cuda_ipc mappings.
        for iter in 0..4 {
            let idx = b.indices(max_count, iter, args.pool);
            let a = b.args(b"warm")?;
            let req = b.built(&idx, &a)?;
            b.post(&req, &a)?;
        }
        for &count in &args.counts {
            let mut calls: [Calls; 3] = Default::default();
            let a = b.args(b"repost")?;
            let reposted = b.prepared(&b.indices(count, 0, args.pool), &a)?;
            for iter in 0..args.iters {
                let idx = b.indices(count, iter, args.pool);
                for (w, c) in calls.iter_mut().enumerate() {
                    let a = b.args(b"note")?;
                    if args.gap_us > 0 && args.spin {
                        let until = Instant::now() + Duration::from_micros(args.gap_us);
                        let mut next = Instant::now();
                        while Instant::now() < until {
                            if args.progress_us > 0 && Instant::now() >= next {
                                let mut map = nixl_sys::NotificationMap::new().map_err(|e| e.to_string())?;
                                b.p.agent.get_notifications(&mut map, None).map_err(|e| format!("getNotifs: {e}"))?;
                                next = Instant::now() + Duration::from_micros(args.progress_us);
                            }
                            if let Some(buf) = &busy {
                                buf.write_at(0, &zeros).map_err(|e| e.to_string())?;
                            }
                            std::hint::spin_loop();
                        }
                    } else if args.gap_us > 0 {
                        std::thread::sleep(Duration::from_micros(args.gap_us));
                    }
                    let t0 = Instant::now();
                    let (req, a) = match w {
                        0 => (Some(b.built(&idx, &a)?), a),
                        1 => (Some(b.prepared(&idx, &a)?), a),
                        _ => (None, b.args(b"repost")?),
                    };
                    let make = t0.elapsed().as_secs_f64() * 1e6;
                    let (post, complete) = b.post(req.as_ref().unwrap_or(&reposted), &a)?;
                    let t1 = Instant::now();
                    drop(req);
                    c.make.push(make);
                    c.post.push(post);
                    c.complete.push(complete);
                    c.release.push(t1.elapsed().as_secs_f64() * 1e6);
                }
            }
            for (w, c) in calls.iter_mut().enumerate() {
                println!(
                    "| {} | {count} | {} | {:.1} / {:.1} | {:.1} / {:.1} | {:.1} | {:.1} |",
                    human(len),
                    WAYS[w],
                    percentile(&mut c.make, 0.5),
                    percentile(&mut c.make, 0.9),
                    percentile(&mut c.post, 0.5),
                    percentile(&mut c.post, 0.9),
                    percentile(&mut c.complete, 0.5),
                    percentile(&mut c.release, 0.5),
                );
            }
        }
        // Let the last notifications land, then check every post delivered one.
        let expected = 4 + u64::from(args.iters) * 3 * args.counts.len() as u64;
        let deadline = Instant::now() + Duration::from_secs(5);
        while b.notifs < expected && Instant::now() < deadline {
            if let Peer::Child { proc, .. } = &mut b.d {
                std::thread::sleep(Duration::from_millis(200));
                proc.close_stdin();
                let Reply::Notifs(n) = b.d.recv()? else { return Err("D: no count".into()) };
                b.notifs = n;
                break;
            }
            b.drain()?;
        }
        if b.notifs != expected {
            return Err(format!("{} notifications for {expected} posts", b.notifs));
        }
    }
    Ok(())
}

fn human(len: u64) -> String {
    match len {
        l if l >= 1 << 20 && l % (1 << 20) == 0 => format!("{} MiB", l >> 20),
        l if l >= 1 << 10 && l % (1 << 10) == 0 => format!("{} KiB", l >> 10),
        l => format!("{l} B"),
    }
}

fn main() -> ExitCode {
    let mut args = Args::parse();
    if args.child {
        return match child_main(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("nixl_post D: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if nixl_sys::is_stub() {
        let ci = std::env::var("CI").is_ok_and(|v| v == "true");
        eprintln!("nixl_post: libnixl_capi.so cannot be loaded (source scripts/nixl.sh)");
        return if ci { ExitCode::FAILURE } else { ExitCode::SUCCESS };
    }
    if !args.bench {
        args = Args { len: vec![4096], pool: 8, counts: vec![1, 4], iters: 3, ..args };
    }
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nixl_post: {e}");
            ExitCode::FAILURE
        }
    }
}
