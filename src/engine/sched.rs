//! Scheduling hints for kvpush's own threads.
//!
//! A writer thread sleeps most of the time and is woken by the engine loop's calls. On Linux, a
//! freshly woken thread with little CPU history preempts the thread that woke it, so the engine loop
//! could lose its core in the middle of a `request_finished` for as long as the writer runs. A writer
//! that only waits for commands is therefore `SCHED_BATCH` (no privilege needed): it does not preempt
//! on wakeup, it runs on an idle core or when the running thread's slice ends, and the engine loop's
//! call returns in microseconds. But a woken batch thread waits for the scheduler's tick wherever no
//! core is idle, so while a writer polls the transport for a transfer of its own or a notification it
//! expects (every such poll is a wait on a request's path to D's first token) it runs under the
//! default policy: issue #18's measurements, docs/benchmarks.md, "Time to first token". Other
//! platforms keep their default policy.

/// Puts the calling thread under `SCHED_BATCH` (`batch`) or back under the default `SCHED_OTHER`
/// (Linux); returns whether the policy was applied.
#[cfg(target_os = "linux")]
pub(crate) fn set_batch(batch: bool) -> bool {
    let param = libc::sched_param { sched_priority: 0 };
    let policy = if batch { libc::SCHED_BATCH } else { libc::SCHED_OTHER };
    // SAFETY: `sched_setscheduler` with pid 0 changes only the calling thread's policy; `param` is a
    // valid, initialized `sched_param` that outlives the call, and priority 0 is what SCHED_BATCH and
    // SCHED_OTHER require. Failure is reported through the return value, never undefined behaviour.
    let rc = unsafe { libc::sched_setscheduler(0, policy, &param) };
    rc == 0
}

/// Asks for 1 µs timer slack on the calling thread (Linux), so the writer's short lingering sleeps
/// last about what they ask for instead of the default 50 µs more.
#[cfg(target_os = "linux")]
pub(crate) fn fine_timer_slack() {
    // SAFETY: PR_SET_TIMERSLACK takes one integer argument (nanoseconds) and only changes the calling
    // thread's timer slack; the unused arguments are ignored. Failure leaves the default slack.
    let _ = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong, 0, 0, 0) };
}

/// Asks for fine timer slack (no-op off Linux).
#[cfg(not(target_os = "linux"))]
pub(crate) fn fine_timer_slack() {}

/// Scheduling policies are left as they are (no-op off Linux).
#[cfg(not(target_os = "linux"))]
pub(crate) fn set_batch(_batch: bool) -> bool {
    false
}

#[cfg(test)]
mod tests {
    #[test]
    fn batch_policy_applies_to_a_thread_and_goes_back() {
        let applied = std::thread::spawn(|| (super::set_batch(true), super::set_batch(false))).join().expect("thread");
        #[cfg(target_os = "linux")]
        {
            assert_eq!(applied, (true, true), "SCHED_BATCH and SCHED_OTHER need no privilege on Linux");
        }
        let _ = applied;
    }
}
