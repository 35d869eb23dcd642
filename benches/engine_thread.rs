//! Engine-thread time per request: what the engine loop pays to hand a request to kvpush and collect
//! its result, in push mode, over the loopback transport.
//!
//! One P and one D engine in this process. For each request the bench times, on the calling thread,
//! D's `blocks_allocated`, P's `request_finished`, and every `poll` that returns the request's result
//! (a poll that returns several results is shared among them); empty polls are counted apart (they
//! cost one atomic load). Requests are issued one at a time with a short pause between them, so each
//! measures the steady-state path (writer threads asleep when the call arrives), not queueing.
//!
//! `cargo bench --bench engine_thread` (needs `. scripts/nixl.sh` for the build only).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpush::device::{host::HostDevice, Device};
use kvpush::engine::{Config, Finished, LocalHub};
use kvpush::proto::layout::Parallel;
use kvpush::proto::{Key, Mode};
use kvpush::transport::loopback::Fabric;
use kvpush_testkit::engines::{self, Worker};
use kvpush_testkit::layouts;

const REQUESTS: usize = 5000;

/// An engine of 16 layers, one KV head of dimension 128, 1024 blocks, on host memory.
fn engine(id: &str, dev: &Arc<dyn Device>, fabric: &Fabric, hub: &Arc<LocalHub>) -> Worker {
    let layout = layouts::separate(layouts::full_model(16, 1, 128), 1024, Parallel::SINGLE);
    // SAFETY: (precondition 2) block ids are reused only after the request's outcome.
    unsafe { engines::loopback_worker(Config::new(id, Mode::Push), layout, dev, fabric, id, hub) }
}

fn pct(v: &mut [f64], q: f64) -> f64 {
    v.sort_unstable_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("engine_thread: bench");
        return;
    }
    let quick = std::env::args().any(|a| a == "--test") || std::env::var("KVPUSH_BENCH_QUICK").is_ok();
    let n = if quick { 200 } else { REQUESTS };
    let dev: Arc<dyn Device> = Arc::new(HostDevice::new());
    let fabric = Fabric::new();
    let hub = LocalHub::new();
    let (pw, dw) = (engine("p", &dev, &fabric, &hub), engine("d", &dev, &fabric, &hub));
    engines::connect(&pw.engine, &dw.engine);
    let (p, d) = (&pw.engine, &dw.engine);

    let (mut p_side, mut d_side, mut total) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    let mut empty_polls = Vec::new();
    let (mut enq_p, mut enq_d, mut drains) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::new());
    let mut out = Vec::new();
    for i in 0..n {
        // 64 tokens (4 blocks); registration first, as a concurrent router makes it.
        let key = Key::new(i as u128 + 1, 1);
        let blocks = vec![(0..4).map(|b| (i as u32 * 4 + b) % 1024).collect::<Vec<u32>>()];
        let (d_ids, p_ids) = (blocks.clone(), blocks);
        let t = Instant::now();
        d.blocks_allocated(key, "p", d_ids, 64).expect("register");
        let mut d_ns = t.elapsed().as_nanos() as f64;
        enq_d.push(d_ns / 1000.0);
        std::thread::sleep(Duration::from_micros(200));
        let t = Instant::now();
        p.request_finished(key, p_ids, 64).expect("ready");
        let mut p_ns = t.elapsed().as_nanos() as f64;
        enq_p.push(p_ns / 1000.0);
        let (mut sent, mut received) = (false, false);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !(sent && received) {
            assert!(Instant::now() < deadline, "request {i} did not finish");
            for (side, e) in [(0, &p), (1, &d)] {
                out.clear();
                let t = Instant::now();
                let got = e.poll(&mut out);
                let ns = t.elapsed().as_nanos() as f64;
                if got == 0 {
                    empty_polls.push(ns);
                    continue;
                }
                drains.push(ns / 1000.0);
                for f in &out {
                    match f {
                        Finished::Sent { key: k, .. } if *k == key => sent = true,
                        Finished::Received { key: k } if *k == key => received = true,
                        other => panic!("unexpected {other:?}"),
                    }
                }
                if side == 0 {
                    p_ns += ns;
                } else {
                    d_ns += ns;
                }
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        p_side.push(p_ns / 1000.0);
        d_side.push(d_ns / 1000.0);
        total.push((p_ns + d_ns) / 1000.0);
    }
    println!("engine-thread time per request, push, loopback, {n} requests of 64 tokens x 16 layers:");
    for (name, v) in [
        ("producer (request_finished + polls)", &mut p_side),
        ("consumer (blocks_allocated + polls)", &mut d_side),
        ("both sides", &mut total),
    ] {
        println!("  {name:<38} p50 {:6.2} us   p99 {:6.2} us   max {:8.2} us", pct(v, 0.5), pct(v, 0.99), pct(v, 1.0));
    }
    println!(
        "  request_finished alone p50 {:.2} / p99 {:.2} us; blocks_allocated alone p50 {:.2} / p99 {:.2} us; a poll with results p50 {:.2} / p99 {:.2} us",
        pct(&mut enq_p, 0.5),
        pct(&mut enq_p, 0.99),
        pct(&mut enq_d, 0.5),
        pct(&mut enq_d, 0.99),
        pct(&mut drains, 0.5),
        pct(&mut drains, 0.99)
    );
    println!(
        "  empty poll                              p50 {:6.3} us   p99 {:6.3} us",
        pct(&mut empty_polls, 0.5) / 1000.0,
        pct(&mut empty_polls, 0.99) / 1000.0
    );
    // Right after the last request both engines go idle: their writers linger, then park. What the
    // process spends over the next 10 s (1 s under --test) is what idle engines cost.
    let idle = Duration::from_secs(if quick { 1 } else { 10 });
    let (c0, t0) = (engines::process_cpu_seconds(), Instant::now());
    std::thread::sleep(idle);
    let share = (engines::process_cpu_seconds() - c0) / t0.elapsed().as_secs_f64();
    println!("  idle after the requests: {:.3}% of a core over {} s (both engines)", share * 100.0, idle.as_secs());
    assert!(share < 0.01, "two idle engines used {:.2}% of a core", share * 100.0);
}
