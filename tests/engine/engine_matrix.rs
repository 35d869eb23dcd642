//! Every pairing of producer TP {1,2,4} x consumer TP {1,2,4} with P/D block sizes {16,32}, with a
//! sliding-window group, through the real engines (writer threads, loopback transport, control link),
//! every byte verified on D against the expected contents. Push for every pairing, pull for a subset.

use kvpush::proto::Mode;
use kvpush_testkit::demo::{self, Topology, Workload};

fn topology(p_tp: u16, d_tp: u16, p_block: u32, d_block: u32) -> Topology {
    // Topology::small's FIFO pool: scattered ids, so transfers exercise both merged and unmerged copies.
    Topology { layers: 4, p_block, d_block, window_every: 2, ..Topology::small(p_tp, d_tp) }
}

fn workload(seed: u64) -> Workload {
    Workload {
        requests: 12,
        min_tokens: 1,
        max_tokens: 300,
        concurrency: 6,
        prefill_ns_per_token: 1000,
        relay_us: 100,
        seed,
        ..Workload::default()
    }
}

fn check(t: &Topology, modes: &[Mode], seed: u64) {
    let report = demo::run(t, &workload(seed), modes, &|| {}).expect("demo runs");
    for (name, m) in [("push", report.push.as_ref()), ("pull", report.pull.as_ref())] {
        let Some(m) = m else { continue };
        let ctx = format!("{name} P TP {} -> D TP {}, blocks {}/{}", t.p_tp, t.d_tp, t.p_block, t.d_block);
        assert_eq!(m.verified, 12, "{ctx}: {m:?}");
        assert_eq!(m.failed, 0, "{ctx}: {m:?}");
        assert_eq!(m.verified_bytes, demo::expected_bytes(t, &workload(seed)), "{ctx}: {m:?}");
        assert!(m.descriptors_posted > 0 && m.descriptors_posted <= m.descriptors_unmerged, "{ctx}: {m:?}");
    }
}

#[test]
fn push_every_tp_pairing_and_block_size() {
    let mut seed = 1;
    for p_tp in [1u16, 2, 4] {
        for d_tp in [1u16, 2, 4] {
            for (pb, db) in [(16, 16), (16, 32), (32, 16), (32, 32)] {
                seed += 1;
                check(&topology(p_tp, d_tp, pb, db), &[Mode::Push], seed);
            }
        }
    }
}

#[test]
fn pull_heterogeneous_tp_and_block_sizes() {
    for (p_tp, d_tp, pb, db) in [(1, 1, 16, 16), (2, 4, 16, 32), (4, 2, 32, 16), (4, 1, 16, 16)] {
        check(&topology(p_tp, d_tp, pb, db), &[Mode::Pull], 99);
    }
}

#[test]
fn nhd_layout_with_head_slices() {
    let mut t = topology(4, 2, 16, 32);
    t.order = kvpush::proto::layout::BlockOrder::Nhd;
    check(&t, &[Mode::Push, Mode::Pull], 7);
}

#[test]
fn each_side_rounding_to_its_own_whole_blocks() {
    // The vLLM connector hands each engine the prompt rounded up to that side's whole blocks, so with
    // different block sizes P and D name different token counts: the tokens both hold move, every
    // byte checked, in both directions and both modes (16/32, 64/128, 128/64).
    for (pb, db) in [(16, 32), (32, 16), (64, 128), (128, 64)] {
        let mut t = topology(2, 1, pb, db);
        t.whole_blocks = true;
        // Full attention only: a sliding window counted back from a rounded-up count misses the
        // window's first real tokens, which is why the vLLM connector hands over exact counts (see
        // `windows_count_back_from_exact_counts_and_whole_blocks_move`).
        t.window_every = 0;
        check(&t, &[Mode::Push, Mode::Pull], 40 + u64::from(pb));
    }
}

#[test]
fn windows_count_back_from_exact_counts_and_whole_blocks_move() {
    // What the vLLM connector does: both sides hand their engine the exact prompt length, and where
    // the block sizes are equal the planner moves whole blocks (vLLM CPU packs a block's tokens by
    // block size). With sliding windows on, P fills and D checks every slot of every block that holds
    // the prompt or a window: the window's first real tokens (missed by a window counted back from a
    // count rounded up to whole blocks: 3 of 12 requests failed so) and the blocks' tail slots and
    // the head of a window's first block (missed by a copy of the exact tokens).
    for (p_tp, d_tp, block) in [(1, 1, 16), (2, 1, 16), (1, 2, 32), (2, 2, 64)] {
        let mut t = topology(p_tp, d_tp, block, block);
        t.whole_block_bytes = true;
        check(&t, &[Mode::Push, Mode::Pull], 70 + u64::from(block));
    }
}
