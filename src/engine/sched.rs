//! Scheduling hints for kvpush's own threads.
//!
//! Writer threads keep the default policy (`SCHED_OTHER`): every hop of a request's path to D's
//! first token is a writer waking up (P's blocks handed over, a registration routed in, a WRITE's
//! completion or notification polled), and a woken `SCHED_OTHER` thread may preempt a busy core at
//! once, where a `SCHED_BATCH` one (the policy writers had until issue #18's measurements) waits for
//! the next scheduler tick on a loaded host: docs/benchmarks.md, "Time to first token", measured it.
//! What a writer costs the engine loop it preempts is its handling of one command, microseconds.

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
