//! The side channel's cost per control frame: a registration is encoded, sealed (Noise, the
//! channel's own parameters: `side::NOISE_PSK`), written to a loopback TCP socket, read from its
//! peer socket, verified and decrypted, and decoded against the sender's layout — what one frame
//! costs between a consumer's writer and a producer's engine, without the thread hand-offs around it
//! (those are the engine's, measured by `benches/engine_thread.rs`).
//!
//! Two sizes: a 64-token request (4 blocks) and a 16k-token one (1024 blocks, a 4 KiB block list).
//! The session is the real one ([`kvpush::engine::side::LoopbackSession`]: the `NNpsk0` handshake
//! with a secret, then the reader's and writer's own per-frame functions).
//!
//! `cargo bench --bench side_channel` (needs `. scripts/nixl.sh` for the build only). Besides
//! criterion's estimate it prints p50/p99 of individually timed round trips, and the p50 of each
//! part of one on its own (encode, decode, seal and open in memory with the same Noise session
//! parameters): what a round trip spends outside them is the two system calls and the buffers.
//! Target: p50 ≤ 5 µs (issue #19); results in docs/benchmarks.md.

use std::hint::black_box;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, Criterion};
use kvpush::engine::side::{self, LoopbackSession};
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

/// A Noise transport pair with the side channel's parameters, handshaken in memory.
fn noise_pair() -> (snow::TransportState, snow::TransportState) {
    let params: snow::params::NoiseParams = side::NOISE_PSK.parse().expect("params");
    let psk = [7u8; 32];
    let build = || snow::Builder::new(params.clone()).psk(0, &psk).expect("psk");
    let mut i = build().build_initiator().expect("initiator");
    let mut r = build().build_responder().expect("responder");
    let (mut m, mut p) = ([0u8; 128], [0u8; 128]);
    let n = i.write_message(&[], &mut m).expect("msg 1");
    r.read_message(&m[..n], &mut p).expect("msg 1");
    let n = r.write_message(&[], &mut m).expect("msg 2");
    i.read_message(&m[..n], &mut p).expect("msg 2");
    (i.into_transport_mode().expect("transport"), r.into_transport_mode().expect("transport"))
}

/// p50 in ns of `f` over `n` individually timed calls.
fn p50_of(n: usize, mut f: impl FnMut()) -> u64 {
    let mut ns: Vec<u64> = (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_nanos() as u64
        })
        .collect();
    pct(&mut ns, 0.5)
}

/// The p50 of each part of a round trip on its own.
fn breakdown(msg: &Message, l: &KvLayout, n: usize) -> String {
    let mut frame = Vec::new();
    codec::encode(msg, &mut frame).expect("encodes");
    let encode = p50_of(n, || {
        let mut f = Vec::new();
        codec::encode(black_box(msg), &mut f).expect("encodes");
        black_box(f);
    });
    let decode = p50_of(n, || {
        black_box(codec::decode(black_box(&frame), Some(l)).expect("decodes"));
    });
    // One record: the continuation flag and the frame, as the channel seals it.
    let mut plain = vec![0u8];
    plain.extend_from_slice(&frame);
    let (mut tx, _) = noise_pair();
    let mut sealed = vec![0u8; plain.len() + 16];
    let mut opened = vec![0u8; plain.len()];
    let seal = p50_of(n, || {
        black_box(tx.write_message(black_box(&plain), &mut sealed).expect("seals"));
    });
    // Open what was sealed, in order (each open needs the next nonce: seal one, time the open), on
    // a fresh pair (the sealing above used up the sender's nonces).
    let (mut tx, mut rx) = noise_pair();
    let mut ns = Vec::with_capacity(n);
    for _ in 0..n {
        let len = tx.write_message(&plain, &mut sealed).expect("seals");
        let t = Instant::now();
        black_box(rx.read_message(black_box(&sealed[..len]), &mut opened).expect("opens"));
        ns.push(t.elapsed().as_nanos() as u64);
    }
    let open = pct(&mut ns, 0.5);
    let us = |ns: u64| ns as f64 / 1e3;
    format!(
        "encode {:.2} µs, decode {:.2} µs, seal {:.2} µs, open {:.2} µs (parts p50)",
        us(encode),
        us(decode),
        us(seal),
        us(open)
    )
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
            "side_channel/registration/{name}: {} bytes; per frame p50 {:.2} µs, p99 {:.2} µs ({n} timed); {}",
            frame.len(),
            p50 as f64 / 1e3,
            p99 as f64 / 1e3,
            breakdown(&msg, &l, n.min(20_000))
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
