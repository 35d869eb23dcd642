//! An idle engine stays under 1% of a core: writer threads sleep on their queues, no thread spins.
//!
//! This binary holds one test so nothing else runs in the process while the CPU time of the whole
//! process (all its threads, from /proc/self/stat) is measured over a few idle seconds.

use std::time::{Duration, Instant};

use kvpush_testkit::engines;

/// User + system CPU seconds of this process so far.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("read /proc/self/stat");
    // Fields after the parenthesized command name; utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().expect("utime") + f[12].parse::<f64>().expect("stime");
    ticks / 100.0 // USER_HZ is 100 on Linux
}

#[test]
fn idle_engines_use_under_one_percent_of_a_core() {
    // SAFETY: (precondition 2) no request is ever made.
    let pair = unsafe { engines::small_pair() };
    std::thread::sleep(Duration::from_millis(300));
    let (c0, t0) = (cpu_seconds(), Instant::now());
    std::thread::sleep(Duration::from_secs(5));
    let share = (cpu_seconds() - c0) / t0.elapsed().as_secs_f64();
    println!("two idle engines used {:.3}% of a core", share * 100.0);
    assert!(share < 0.01, "idle engines used {:.2}% of a core", share * 100.0);
    drop(pair);
}
