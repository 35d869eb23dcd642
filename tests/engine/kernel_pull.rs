//! Pull where the serving engines name blocks larger than their engines' (issue 17: vLLM's kernel
//! blocks). D names P's blocks by P's serving-engine ids and their size (`start_pull_logical`, as
//! the vLLM connector relays `remote_block_ids` and `remote_block_size`); D's engine expands them to
//! P's kernel blocks with the block size P published at the handshake, and P's grant must still name
//! exactly those blocks (issue 16): anything else reads nothing.

use std::sync::Arc;
use std::time::Duration;

use kvpush::device::host::HostDevice;
use kvpush::device::Device;
use kvpush::engine::{Finished, LocalHub};
use kvpush::proto::msg::kernel_block_lists;
use kvpush::proto::{Key, KvLayout, Mode};
use kvpush::transport::loopback::Fabric;
use kvpush_testkit::demo::pattern;
use kvpush_testkit::engines::{self, wait_for, Worker};
use kvpush_testkit::layouts;
use kvpush_testkit::stress::{Setup, D_ENGINE, P_ENGINE};

const LIMIT: Duration = Duration::from_secs(10);
/// P's serving engine (vLLM) blocks: 64 tokens, each four of P's 16-token kernel blocks.
const P_LOGICAL: u32 = 64;
const P_KERNEL: u32 = 16;
/// D's engine blocks: 32 tokens (a ratio of its own, which D expands before its engine).
const D_KERNEL: u32 = 32;

/// One worker of `engine_id` whose engine blocks hold `block_tokens` tokens.
fn worker(engine_id: &str, block_tokens: u32, fabric: &Fabric, hub: &Arc<LocalHub>) -> Worker {
    let device: Arc<dyn Device> = Arc::new(HostDevice::new());
    let mut layout: KvLayout = layouts::separate(layouts::full_model(2, 2, 8), 256, layouts::tp(0, 1));
    layout.block_tokens = block_tokens;
    layout.block_stride = layout.part_bytes();
    // SAFETY: (precondition 2) each test reads D's blocks only after D's outcome, and writes P's
    // only before handing them to the engine.
    unsafe {
        engines::loopback_worker(
            Setup::new(Mode::Pull, 1, 1).config(engine_id),
            layout,
            &device,
            fabric,
            engine_id,
            hub,
        )
    }
}

/// The failure D reports for `key`, after which nothing of P's landed in `local` (D's marker is
/// intact) and P released its blocks at once.
fn refused(p: &Worker, d: &Worker, key: Key, local: &[Vec<u32>], tokens: u64) -> String {
    let f = wait_for(
        &d.engine,
        "the pull's outcome",
        LIMIT,
        |f| matches!(f, Finished::Failed { key: k, .. } | Finished::Received { key: k } if *k == key),
    );
    let Finished::Failed { reason, .. } = f else { panic!("D read blocks P did not grant as named: {f:?}") };
    wait_for(&p.engine, "P releases at once", LIMIT, |f| matches!(f, Finished::Sent { key: k, .. } if *k == key));
    let v = pattern::verify(d.engine.layout(), &d.buffers, local, tokens, MARK).expect("reads");
    assert!(v.ok(), "D's blocks were written by a refused read: {v:?}");
    reason
}

const MARK: u64 = 0xd00d;

#[test]
fn a_pull_names_ps_serving_engine_blocks_and_reads_its_kernel_blocks() {
    let (fabric, hub) = (Fabric::new(), LocalHub::new());
    let p = worker(P_ENGINE, P_KERNEL, &fabric, &hub);
    let d = worker(D_ENGINE, D_KERNEL, &fabric, &hub);
    engines::connect(&p.engine, &d.engine);
    // 100 tokens in P's vLLM blocks 5 and 2: kernel blocks 20..24 and 8..11 (the last vLLM block's
    // fourth kernel block holds nothing and is not pinned), as the connector's expand_block_ids gives.
    let tokens = 100;
    let named = vec![vec![5, 2]];
    let pinned = kernel_block_lists(&named, P_LOGICAL, P_KERNEL, tokens).expect("expands");
    assert_eq!(pinned, vec![vec![20, 21, 22, 23, 8, 9, 10]]);
    let seed = 0x5eed;
    pattern::fill(p.engine.layout(), &p.buffers, &pinned, tokens, seed).expect("prefill");
    let local = vec![vec![10, 3, 7, 1]];

    // The ids without their size (a producer's params relayed without remote_block_size): taken as
    // P's kernel blocks, they are not what P pinned, and the failure says what is missing.
    let bare = Key::new(0x6b01, 1);
    pattern::fill(d.engine.layout(), &d.buffers, &local, tokens, MARK).expect("D's blocks marked");
    p.engine.request_finished(bare, pinned.clone(), tokens).expect("finished");
    d.engine.start_pull(bare, P_ENGINE, named.clone(), local.clone(), tokens).expect("pull starts");
    let why = refused(&p, &d, bare, &local, tokens);
    assert!(why.contains("remote_block_size"), "the failure does not name the missing size: {why}");

    // A size P's kernel blocks do not divide.
    let odd = Key::new(0x6b02, 1);
    p.engine.request_finished(odd, pinned.clone(), tokens).expect("finished");
    d.engine.start_pull_logical(odd, P_ENGINE, named.clone(), 24, local.clone(), tokens).expect("pull starts");
    let why = refused(&p, &d, odd, &local, tokens);
    assert!(why.contains("24 tokens") && why.contains("16 tokens"), "{why}");

    // Other vLLM blocks than P pinned (stale or forged ids): still refused after the expansion.
    let forged = Key::new(0x6b03, 1);
    p.engine.request_finished(forged, pinned.clone(), tokens).expect("finished");
    d.engine
        .start_pull_logical(forged, P_ENGINE, vec![vec![5, 3]], P_LOGICAL, local.clone(), tokens)
        .expect("pull starts");
    let why = refused(&p, &d, forged, &local, tokens);
    assert!(why.contains("pinned other blocks"), "{why}");

    // Named right: P's kernel blocks land in D's 32-token blocks, every byte checked.
    let good = Key::new(0x6b04, 1);
    p.engine.request_finished(good, pinned.clone(), tokens).expect("finished");
    d.engine.start_pull_logical(good, P_ENGINE, named, P_LOGICAL, local.clone(), tokens).expect("pull starts");
    wait_for(&d.engine, "received", LIMIT, |f| matches!(f, Finished::Received { key } if *key == good));
    let v = pattern::verify(d.engine.layout(), &d.buffers, &local, tokens, seed).expect("reads");
    assert!(v.ok() && v.bytes > 0, "received but wrong: {v:?}");
    wait_for(&p.engine, "sent", LIMIT, |f| matches!(f, Finished::Sent { key, .. } if *key == good));
}
