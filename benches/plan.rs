//! Plan + merge for one request of the Qwen3-32B shape at P TP 8 → D TP 8.
//!
//! 64 layers, 8 KV heads (1 per rank), head dim 128, bf16, 16-token blocks, K and V in separate
//! regions, 16384 tokens = 1024 blocks per layer. Two block-id patterns:
//!
//! * `plan/qwen3_32b_tp8_16k/contiguous`: the same run of 1024 consecutive ids on both sides;
//! * `plan/qwen3_32b_tp8_16k/fragmented`: independent random permutations on each side.
//!
//! Run with `cargo bench --bench plan`; targets and results are in docs/benchmarks.md.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use kvpush::proto::layout::KvLayout;
use kvpush::proto::plan::{PlanInput, Planner};
use kvpush_testkit::layouts;
use kvpush_testkit::rng::Rng;

const LAYERS: u32 = 64;
const BLOCKS: u32 = 4096;
const TOKENS: u64 = 16384;

fn layout(base: u64) -> KvLayout {
    let mut l = layouts::separate(layouts::qwen3_32b(), BLOCKS, layouts::tp(0, 8));
    // vLLM's per-layer `[2, num_blocks, ...]` tensor: K region then V region, layers 1 GiB apart.
    let region = l.region_len();
    l.region_bases = (0..LAYERS as u64).flat_map(|i| [base + (i << 30), base + (i << 30) + region]).collect();
    l.validate().expect("bench layout is valid");
    l
}

fn bench(c: &mut Criterion) {
    let (src, dst) = (layout(1 << 40), layout(1 << 44));
    let blocks = (TOKENS / 16) as usize;
    let contiguous: Vec<u32> = (100..100 + blocks as u32).collect();
    let cases = [
        ("contiguous", contiguous.clone(), contiguous),
        (
            "fragmented",
            Rng(0x9e37_79b9_7f4a_7c15).permutation(BLOCKS, blocks),
            Rng(0xd1b5_4a32_d192_ed03).permutation(BLOCKS, blocks),
        ),
    ];
    let mut group = c.benchmark_group("plan/qwen3_32b_tp8_16k");
    for (name, s, d) in cases {
        let (sb, db) = (vec![s], vec![d]);
        let input = PlanInput { src: &src, dst: &dst, src_blocks: &sb, dst_blocks: &db, num_tokens: TOKENS };
        let mut planner = Planner::new();
        let mut out = Vec::new();
        let stats = planner.plan(&input, &mut out).expect("plans");
        eprintln!(
            "{name}: {} copies before merging, {} after ({:.2} per layer), {} MiB",
            stats.unmerged,
            stats.merged,
            stats.merged as f64 / f64::from(LAYERS),
            stats.bytes >> 20
        );
        group.bench_function(name, |b| {
            b.iter(|| {
                let stats = planner.plan(black_box(&input), &mut out).expect("plans");
                black_box(stats.merged)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
