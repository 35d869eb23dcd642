//! How the engine's threads wait to be woken (issue #18): every hop of a request's path to D's first
//! token is one of them waking up, so none may wait for more than the wake itself.

use std::time::Duration;

use kvpush::engine::Finished;
use kvpush::proto::{Key, Mode};
use kvpush_testkit::engines::wait_for;
use kvpush_testkit::stress::{Cluster, Setup, BLOCK_TOKENS, P_ENGINE};

/// `SCHED_OTHER` in /proc's `policy` field.
const SCHED_OTHER: u32 = 0;

/// The scheduling policy of each writer thread of this process: (thread id, policy).
fn writer_policies() -> Vec<(String, u32)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").expect("list /proc/self/task") {
        let dir = task.expect("a task").path();
        let (Ok(comm), Ok(stat)) =
            (std::fs::read_to_string(dir.join("comm")), std::fs::read_to_string(dir.join("stat")))
        else {
            continue; // the thread ended meanwhile
        };
        if !comm.starts_with("kvpush-writer") {
            continue;
        }
        // Fields after the parenthesized name start at field 3; `policy` is field 41.
        let fields: Vec<&str> = stat[stat.rfind(')').expect("comm") + 2..].split_whitespace().collect();
        let policy = fields[41 - 3].parse().expect("policy");
        out.push((dir.file_name().expect("tid").to_string_lossy().into_owned(), policy));
    }
    out
}

/// A woken `SCHED_BATCH` thread never preempts: on a busy core it waits for the scheduler's tick
/// (measured in docs/benchmarks.md, "Time to first token": P's hand-over to its writer took 6 ms
/// median, 1.2 s at worst). Writers that have handled a request keep the default policy.
#[test]
fn writer_threads_keep_the_default_scheduling_policy() {
    let c = Cluster::new(Setup::new(Mode::Push, 1, 1));
    // One request through both engines' writers: D drops it, P releases its blocks.
    let key = Key::new(0x18_0001, 1);
    c.d[0].engine.abort_producer(key, P_ENGINE).expect("told");
    c.p[0].engine.request_finished(key, vec![vec![3, 4]], 2 * u64::from(BLOCK_TOKENS)).expect("finished");
    let released = |f: &Finished| matches!(f, Finished::Sent { key: k, .. } if *k == key);
    wait_for(&c.p[0].engine, "released", Duration::from_secs(10), released);
    let writers = writer_policies();
    assert!(writers.len() >= 2, "P's and D's writer threads: {writers:?}");
    for (tid, policy) in &writers {
        assert_eq!(*policy, SCHED_OTHER, "writer thread {tid} runs under policy {policy}");
    }
}
