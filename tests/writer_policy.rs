//! The writer threads' scheduling policy (src/engine/sched.rs, issue #18): `SCHED_BATCH` while a
//! writer only waits for the engine loop's commands (its wake must not cost the engine loop its core),
//! the default `SCHED_OTHER` while it polls the transport for a notification it expects (a woken batch
//! thread waits for the scheduler's tick on a busy core, and that poll is on the path to D's first
//! token).
//!
//! This binary holds one test, so every writer thread in the process is one of its two engines'
//! (named `kvpush-writer-p…` and `kvpush-writer-d…`).

use std::time::{Duration, Instant};

use kvpush::engine::Finished;
use kvpush::proto::Key;
use kvpush_testkit::engines::{self, wait_for};
use kvpush_testkit::layouts;

const LIMIT: Duration = Duration::from_secs(10);
/// /proc's `policy` values.
const SCHED_OTHER: u32 = 0;
const SCHED_BATCH: u32 = 3;

/// The policy of each writer thread of the engine whose id starts with `engine`: (thread id, policy).
fn writer_policies(engine: char) -> Vec<(String, u32)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").expect("list /proc/self/task") {
        let dir = task.expect("a task").path();
        let (Ok(comm), Ok(stat)) =
            (std::fs::read_to_string(dir.join("comm")), std::fs::read_to_string(dir.join("stat")))
        else {
            continue; // the thread ended meanwhile
        };
        if !comm.starts_with(&format!("kvpush-writer-{engine}")) {
            continue;
        }
        // Fields after the parenthesized name start at field 3; `policy` is field 41.
        let fields: Vec<&str> = stat[stat.rfind(')').expect("comm") + 2..].split_whitespace().collect();
        let policy = fields[41 - 3].parse().expect("policy");
        out.push((dir.file_name().expect("tid").to_string_lossy().into_owned(), policy));
    }
    out
}

/// Waits (up to `LIMIT`) until the writers of `engine` are under the policies `want` says.
fn until(engine: char, what: &str, want: impl Fn(&[(String, u32)]) -> bool) {
    let start = Instant::now();
    loop {
        let now = writer_policies(engine);
        if want(&now) {
            return;
        }
        assert!(start.elapsed() < LIMIT, "{what}: writers of {engine} are {now:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn writers_are_batch_while_idle_and_default_while_awaiting_a_transfer() {
    // SAFETY: (precondition 2) the one request's blocks are neither written nor reused before its
    // outcome: nothing else touches these buffers.
    let pair = unsafe { engines::small_pair() };
    let (p, d) = (&pair.p, &pair.d);
    let all = |policy: u32| move |w: &[(String, u32)]| !w.is_empty() && w.iter().all(|(_, p)| *p == policy);
    until('p', "idle", all(SCHED_BATCH));
    until('d', "idle", all(SCHED_BATCH));
    // D registers a request P has not finished: D's writer polls for its notification.
    let key = Key::new(0x18_0002, 1);
    let tokens = 2 * u64::from(layouts::BLOCK_TOKENS);
    d.engine.blocks_allocated(key, "p", vec![vec![5, 6]], tokens).expect("registered");
    until('d', "awaiting the notification", |w| w.iter().any(|(_, p)| *p == SCHED_OTHER));
    // P finishes it; once D has it, every writer only waits for commands again.
    p.engine.request_finished(key, vec![vec![3, 4]], tokens).expect("finished");
    wait_for(&d.engine, "received", LIMIT, |f| matches!(f, Finished::Received { key: k, .. } if *k == key));
    wait_for(&p.engine, "sent", LIMIT, |f| matches!(f, Finished::Sent { key: k, .. } if *k == key));
    until('p', "idle after the transfer", all(SCHED_BATCH));
    until('d', "idle after the transfer", all(SCHED_BATCH));
}
