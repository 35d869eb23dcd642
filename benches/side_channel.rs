//! The side channel's cost per control frame: a registration is encoded, sealed (Noise, the
//! channel's own parameters: `side::NOISE_PSK`), written to a loopback TCP socket, read from its
//! peer socket, verified and decrypted, and decoded against the sender's layout — what one frame
//! costs between a consumer's writer and a producer's engine, without the thread hand-offs around it
//! (those are the engine's, measured by `benches/engine_thread.rs`).
//!
//! Three registrations: a 64-token request (4 blocks), and two 16k-token ones (1024 blocks): one
//! whose blocks are contiguous (a fresh pool: one run on the wire) and one whose blocks come from a
//! pool that served other requests first (vLLM's FIFO free queue: freed blocks go to its tail, each
//! request's in reverse, and are handed out from its head; [`fifo_blocks`]). The session is the real one ([`kvpush::engine::side::LoopbackSession`]: the `NNpsk0` handshake
//! with a secret, then the reader's and writer's own per-frame functions).
//!
//! `cargo bench --bench side_channel` (needs `. scripts/nixl.sh` for the build only). Besides
//! criterion's estimate it prints p50/p99 of individually timed round trips, and the p50 of each
//! stage of one on its own: encode, seal (in memory, the same Noise parameters and cipher), the `write` of the
//! sealed record and the `read` of it on a loopback TCP pair, open, decode. What a round trip spends
//! beyond their sum is the channel's buffers and bookkeeping.
//! Target: p50 ≤ 5 µs (issue #19); results in docs/benchmarks.md.

use std::collections::VecDeque;
use std::hint::black_box;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use criterion::{criterion_group, criterion_main, Criterion};
use kvpush::engine::cipher;
use kvpush::engine::side::{self, LoopbackSession};
use kvpush::proto::codec;
use kvpush::proto::layout::{KvLayout, Parallel};
use kvpush::proto::msg::{Message, Registration};
use kvpush::proto::Key;
use kvpush_testkit::layouts;
use kvpush_testkit::rng::Rng;

/// 16 layers, one KV head of dimension 128, 16-token blocks, 4096 blocks.
fn layout() -> KvLayout {
    layouts::separate(layouts::full_model(16, 1, 128), 4096, Parallel::SINGLE)
}

/// The next `n` blocks of a vLLM-like pool of `pool` blocks after it served requests of 1 to 64
/// blocks, 4 at a time, for a few rounds: a FIFO free queue, allocation from its head, and each
/// finished request's blocks freed to its tail in reverse order (as vLLM's `KVCacheManager.free`
/// does), finishing in random order.
fn fifo_blocks(pool: u32, n: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    let mut free: VecDeque<u32> = (0..pool).collect();
    let mut running: Vec<Vec<u32>> = Vec::new();
    for _ in 0..2000 {
        while running.len() < 4 {
            let want = rng.between(1, 64) as usize;
            running.push(free.drain(..want).collect());
        }
        let done = running.swap_remove(rng.below(running.len() as u64) as usize);
        free.extend(done.into_iter().rev());
    }
    free.drain(..n).collect()
}

/// Contiguous ids from 100 (a fresh pool), or the FIFO pool's.
fn block_ids(blocks: u32, fragmented: bool) -> Vec<u32> {
    if fragmented {
        fifo_blocks(4096, blocks as usize, 19)
    } else {
        (100..100 + blocks).collect()
    }
}

fn registration(l: &KvLayout, ids: Vec<u32>) -> Message {
    let ids = vec![ids];
    let tokens = ids[0].len() as u64 * 16;
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

/// A Noise transport pair with the side channel's parameters, handshaken in memory, its primitives
/// from `resolver` (the channel's: [`cipher::resolver`]).
fn noise_pair(resolver: fn() -> snow::resolvers::BoxedCryptoResolver) -> (snow::TransportState, snow::TransportState) {
    let params: snow::params::NoiseParams = side::NOISE_PSK.parse().expect("params");
    let psk = [7u8; 32];
    let build = || snow::Builder::with_resolver(params.clone(), resolver()).psk(0, &psk).expect("psk");
    let mut i = build().build_initiator().expect("initiator");
    let mut r = build().build_responder().expect("responder");
    let (mut m, mut p) = ([0u8; 128], [0u8; 128]);
    let n = i.write_message(&[], &mut m).expect("msg 1");
    r.read_message(&m[..n], &mut p).expect("msg 1");
    let n = r.write_message(&[], &mut m).expect("msg 2");
    i.read_message(&m[..n], &mut p).expect("msg 2");
    (i.into_transport_mode().expect("transport"), r.into_transport_mode().expect("transport"))
}

/// snow's own primitives (its AES-GCM builds the cipher again for every record).
fn snows_own() -> snow::resolvers::BoxedCryptoResolver {
    Box::new(snow::resolvers::DefaultResolver)
}

/// The p50 in ns of sealing `plain` as one record, and of opening it, with `resolver`'s cipher.
fn seal_open(plain: &[u8], n: usize, resolver: fn() -> snow::resolvers::BoxedCryptoResolver) -> (u64, u64) {
    let (mut tx, _) = noise_pair(resolver);
    let mut sealed = vec![0u8; plain.len() + 16];
    let mut opened = vec![0u8; plain.len()];
    let seal = p50_of(n, || {
        black_box(tx.write_message(black_box(plain), &mut sealed).expect("seals"));
    });
    // Open what was sealed, in order (each open needs the next nonce: seal one, time the open), on
    // a fresh pair (the sealing above used up the sender's nonces).
    let (mut tx, mut rx) = noise_pair(resolver);
    let mut ns = Vec::with_capacity(n);
    for _ in 0..n {
        let len = tx.write_message(plain, &mut sealed).expect("seals");
        let t = Instant::now();
        black_box(rx.read_message(black_box(&sealed[..len]), &mut opened).expect("opens"));
        ns.push(t.elapsed().as_nanos() as u64);
    }
    (seal, pct(&mut ns, 0.5))
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

/// A connected loopback TCP pair with Nagle off, as the side channel's sockets.
fn tcp_pair() -> (TcpStream, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let tx = TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
    let (rx, _) = listener.accept().expect("accept");
    for s in [&tx, &rx] {
        s.set_nodelay(true).expect("nodelay");
    }
    (tx, rx)
}

/// The p50 of each stage of a round trip on its own.
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
    let (seal, open) = seal_open(&plain, n, cipher::resolver);
    let (snow_seal, snow_open) = seal_open(&plain, n, snows_own);
    let sealed = vec![0u8; plain.len() + 16];
    // The sealed record's bytes through a socket: one `write`, then one `read` of what arrived
    // (timed apart; the write has returned, so the read finds the bytes there).
    let record = &sealed[..];
    let (mut tx, mut rx) = tcp_pair();
    let mut inbound = vec![0u8; 1 << 17];
    let (mut w, mut r) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n {
        let t = Instant::now();
        tx.write_all(black_box(record)).expect("writes");
        w.push(t.elapsed().as_nanos() as u64);
        let t = Instant::now();
        let mut got = 0;
        while got < record.len() {
            got += rx.read(&mut inbound[got..]).expect("reads");
        }
        r.push(t.elapsed().as_nanos() as u64);
    }
    let (write, read) = (pct(&mut w, 0.5), pct(&mut r, 0.5));
    let us = |ns: u64| ns as f64 / 1e3;
    format!(
        "encode {:.2} µs, seal {:.2} µs, write {:.2} µs, read {:.2} µs, open {:.2} µs, decode {:.2} µs (stages p50; sum {:.2} µs); snow's own AES-GCM: seal {:.2} µs, open {:.2} µs",
        us(encode),
        us(seal),
        us(write),
        us(read),
        us(open),
        us(decode),
        us(encode + seal + write + read + open + decode),
        us(snow_seal),
        us(snow_open)
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
    for (blocks, fragmented) in [(4u32, false), (1024, false), (1024, true)] {
        let ids = block_ids(blocks, fragmented);
        let runs = 1 + ids.windows(2).filter(|w| w[1].abs_diff(w[0]) != 1).count();
        let msg = registration(&l, ids);
        assert_eq!(round_trip(&mut s, &msg, &l, &mut frame), msg, "the frame survives the channel");
        let name = if fragmented { format!("{blocks}_blocks_fifo") } else { format!("{blocks}_blocks") };
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
            "side_channel/registration/{name}: {} bytes ({runs} runs of consecutive ids); per frame p50 {:.2} µs, p99 {:.2} µs ({n} timed); {}",
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
