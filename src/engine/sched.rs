//! Scheduling hints for kvpush's own threads.
//!
//! A writer thread sleeps most of the time and is woken by the engine loop's calls. On Linux, a
//! freshly woken thread with little CPU history preempts the thread that woke it, so the engine loop
//! could lose its core in the middle of a `request_finished` for as long as the writer runs. Marking
//! the writer threads `SCHED_BATCH` (no privilege needed) tells the scheduler not to let them preempt
//! on wakeup: they run on an idle core, or when the engine loop's time slice ends, and the engine
//! loop's call returns in microseconds. Other platforms keep their default policy.

/// Marks the calling thread as a batch thread (Linux); returns whether the hint was applied.
#[cfg(target_os = "linux")]
pub(crate) fn batch_current_thread() -> bool {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `sched_setscheduler` with pid 0 changes only the calling thread's policy; `param` is a
    // valid, initialized `sched_param` that outlives the call, and priority 0 is what SCHED_BATCH
    // requires. Failure is reported through the return value, never undefined behaviour.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
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

/// Marks the calling thread as a batch thread (no-op off Linux).
#[cfg(not(target_os = "linux"))]
pub(crate) fn batch_current_thread() -> bool {
    false
}

#[cfg(test)]
mod tests {
    #[test]
    fn batch_policy_applies_to_a_thread() {
        let applied = std::thread::spawn(super::batch_current_thread).join().expect("thread");
        #[cfg(target_os = "linux")]
        {
            assert!(applied, "SCHED_BATCH needs no privilege on Linux");
        }
        let _ = applied;
    }
}
