//! An idle engine stays under 1% of a core: writer threads sleep on their queues, no thread spins.
//!
//! This binary holds one test so nothing else runs in the process while the CPU time of the whole
//! process (all its threads, from /proc/self/stat) is measured over a few idle seconds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpush::device::{host::HostDevice, Buffer, Device};
use kvpush::engine::{Config, Engine, LocalHub};
use kvpush::proto::layout::{
    BlockOrder, DType, GroupKind, KvGroup, KvKind, KvLayout, KvPlacement, ModelShape, Parallel,
};
use kvpush::proto::Mode;
use kvpush::transport::loopback::Fabric;

/// User + system CPU seconds of this process so far.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("read /proc/self/stat");
    // Fields after the parenthesized command name; utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().expect("utime") + f[12].parse::<f64>().expect("stime");
    ticks / 100.0 // USER_HZ is 100 on Linux
}

fn engine(id: &str, dev: &Arc<dyn Device>, fabric: &Fabric, hub: &Arc<LocalHub>) -> (Engine, Vec<Box<dyn Buffer>>) {
    let mut l = KvLayout {
        model: ModelShape {
            total_layers: 2,
            kv_heads: 1,
            head_dim: 64,
            dtype: DType::Bf16,
            kind: KvKind::KeyValue,
            groups: vec![KvGroup { kind: GroupKind::Full, layers: vec![0, 1] }],
        },
        block_tokens: 16,
        order: BlockOrder::Hnd,
        placement: KvPlacement::Separate,
        block_stride: 16 * 64 * 2,
        num_blocks: 64,
        parallel: Parallel::SINGLE,
        region_bases: Vec::new(),
    };
    let buffers: Vec<Box<dyn Buffer>> = (0..4).map(|_| dev.alloc(l.region_len()).expect("alloc")).collect();
    l.region_bases = buffers.iter().map(|b| b.region().addr).collect();
    let t = Arc::new(fabric.endpoint(id).expect("endpoint"));
    // SAFETY: the regions are `buffers`, returned with the engine and dropped after it by the test.
    let e = unsafe { Engine::new(Config::new(id, Mode::Push), l, dev.clone(), t, hub.clone()) }.expect("engine");
    hub.attach(e.addr().clone(), e.sink());
    (e, buffers)
}

#[test]
fn idle_engines_use_under_one_percent_of_a_core() {
    let dev: Arc<dyn Device> = Arc::new(HostDevice::new());
    let fabric = Fabric::new();
    let hub = LocalHub::new();
    let (p, _pb) = engine("p", &dev, &fabric, &hub);
    let (d, _db) = engine("d", &dev, &fabric, &hub);
    p.add_peer(&d.handshake().expect("hs")).expect("peer");
    d.add_peer(&p.handshake().expect("hs")).expect("peer");
    std::thread::sleep(Duration::from_millis(300));
    let (c0, t0) = (cpu_seconds(), Instant::now());
    std::thread::sleep(Duration::from_secs(5));
    let share = (cpu_seconds() - c0) / t0.elapsed().as_secs_f64();
    println!("two idle engines used {:.3}% of a core", share * 100.0);
    assert!(share < 0.01, "idle engines used {:.2}% of a core", share * 100.0);
    drop((p, d));
}
