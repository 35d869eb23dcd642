//! An idle engine stays under 1% of a core: writer threads sleep on their queues, no thread spins.
//!
//! This binary holds one test so nothing else runs in the process while the CPU time of the whole
//! process (all its threads, from /proc/self/stat) is measured over 10 idle seconds.

use std::time::{Duration, Instant};

use kvpush_testkit::engines;

#[test]
fn idle_engines_use_under_one_percent_of_a_core() {
    // SAFETY: (precondition 2) no request is ever made.
    let pair = unsafe { engines::small_pair() };
    std::thread::sleep(Duration::from_millis(300));
    let (c0, t0) = (engines::process_cpu_seconds(), Instant::now());
    std::thread::sleep(Duration::from_secs(10));
    let share = (engines::process_cpu_seconds() - c0) / t0.elapsed().as_secs_f64();
    println!("two idle engines used {:.3}% of a core", share * 100.0);
    assert!(share < 0.01, "idle engines used {:.2}% of a core", share * 100.0);
    drop(pair);
}
