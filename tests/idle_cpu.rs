//! An idle engine stays under 1% of a core: writer threads sleep on their queues, no thread spins.
//!
//! This binary holds one test so nothing else runs in the process while the CPU time of the whole
//! process (all its threads, from /proc/self/stat) is measured over 10 idle seconds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpush::device::{host::HostDevice, Device};
use kvpush::engine::{Config, LocalHub};
use kvpush::proto::layout::Parallel;
use kvpush::proto::Mode;
use kvpush::transport::loopback::Fabric;
use kvpush_testkit::engines::{self, Worker};
use kvpush_testkit::layouts;

/// An engine of two layers, one KV head of dimension 64, 64 blocks, on host memory.
fn engine(id: &str, dev: &Arc<dyn Device>, fabric: &Fabric, hub: &Arc<LocalHub>) -> Worker {
    let layout = layouts::separate(layouts::full_model(2, 1, 64), 64, Parallel::SINGLE);
    // SAFETY: (precondition 2) no request is ever made.
    unsafe { engines::loopback_worker(Config::new(id, Mode::Push), layout, dev, fabric, id, hub) }
}

#[test]
fn idle_engines_use_under_one_percent_of_a_core() {
    let dev: Arc<dyn Device> = Arc::new(HostDevice::new());
    let fabric = Fabric::new();
    let hub = LocalHub::new();
    let p = engine("p", &dev, &fabric, &hub);
    let d = engine("d", &dev, &fabric, &hub);
    engines::connect(&p.engine, &d.engine);
    std::thread::sleep(Duration::from_millis(300));
    let (c0, t0) = (engines::process_cpu_seconds(), Instant::now());
    std::thread::sleep(Duration::from_secs(10));
    let share = (engines::process_cpu_seconds() - c0) / t0.elapsed().as_secs_f64();
    println!("two idle engines used {:.3}% of a core", share * 100.0);
    assert!(share < 0.01, "idle engines used {:.2}% of a core", share * 100.0);
    drop((p, d));
}
