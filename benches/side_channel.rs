//! The side channel's cost per control frame: a registration is encoded, sealed (Noise,
//! ChaCha20-Poly1305), written to a loopback TCP socket, read from its peer socket, verified and
//! decrypted, and decoded against the sender's layout — what one frame costs between a consumer's
//! writer and a producer's engine, without the thread hand-offs around it (those are the engine's,
//! measured by `benches/engine_thread.rs`).
//!
//! Two sizes: a 64-token request (4 blocks) and a 16k-token one (1024 blocks, a 4 KiB block list).
//! The session is the real one ([`kvpush::engine::side::LoopbackSession`]: the `NNpsk0` handshake
//! with a secret, then the reader's and writer's own per-frame functions).
//!
//! `cargo bench --bench side_channel` (needs `. scripts/nixl.sh` for the build only). Besides
//! criterion's estimate it prints p50/p99 of individually timed round trips. Target: p50 ≤ 5 µs
//! (issue #19); results in docs/benchmarks.md.

use std::hint::black_box;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, Criterion};
use kvpush::engine::side::LoopbackSession;
use kvpush::proto::codec;
use kvpush::proto::layout::{KvLayout, Parallel};
use kvpush::proto::msg::{Message, Registration};
use kvpush::proto::Key;
use kvpush_testkit::layouts;

/// 16 layers, one KV head of dimension 128, 16-token blocks, 4096 blocks.
fn layout() -> KvLayout {
    layouts::separate(layouts::full_model(16, 1, 128), 4096, Parallel::SINGLE)
}

fn registration(l: &KvLayout, blocks: u32) -> Message {
    let ids = vec![(0..blocks).map(|b| (b * 7) % l.num_blocks).collect::<Vec<u32>>()];
    let tokens = u64::from(blocks) * 16;
    let r = Registration::new(Key::new(0x1234_5678_9abc, 1), "decode-0".into(), l.parallel.rank(), tokens, ids, l)
        .expect("the bench's registration fits its layout");
    Message::Registration(r)
}

/// One frame through the channel: encode, seal + write, read + open, decode.
fn round_trip(s: &mut LoopbackSession, msg: &Message, l: &KvLayout, frame: &mut Vec<u8>) -> Message {
    frame.clear();
    codec::encode(msg, frame).expect("encodes");
    s.send(frame).expect("sends");
    let got = s.recv().expect("receives");
    codec::decode(got, Some(l)).expect("decodes")
}

fn pct(v: &mut [u64], q: f64) -> u64 {
    v.sort_unstable();
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn bench(c: &mut Criterion) {
    let l = layout();
    let mut s = LoopbackSession::new(b"0123456789abcdef0123456789abcdef").expect("handshake on loopback");
    let mut frame = Vec::new();
    let mut group = c.benchmark_group("side_channel/registration");
    for blocks in [4u32, 1024] {
        let msg = registration(&l, blocks);
        assert_eq!(round_trip(&mut s, &msg, &l, &mut frame), msg, "the frame survives the channel");
        let name = format!("{blocks}_blocks");
        group.bench_function(&name, |b| b.iter(|| black_box(round_trip(&mut s, black_box(&msg), &l, &mut frame))));
        let n = if std::env::args().any(|a| a == "--test") { 100 } else { 100_000 };
        let mut ns: Vec<u64> = (0..n)
            .map(|_| {
                let t = Instant::now();
                black_box(round_trip(&mut s, &msg, &l, &mut frame));
                t.elapsed().as_nanos() as u64
            })
            .collect();
        let (p50, p99) = (pct(&mut ns, 0.5), pct(&mut ns, 0.99));
        eprintln!(
            "side_channel/registration/{name}: {} bytes; per frame p50 {:.2} µs, p99 {:.2} µs ({n} timed)",
            frame.len(),
            p50 as f64 / 1e3,
            p99 as f64 / 1e3
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
