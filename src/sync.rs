//! The crate's one way to take a lock, and to read what a panicking thread said.
//!
//! Every mutex in kvpush guards data that is valid between any two statements (queues, maps,
//! counters), and nothing panics while holding one on purpose. A thread that does panic (a user's
//! waker, a bug) must not turn every later call into a second panic — across the C ABI or inside
//! vLLM's scheduler that would be a crash — so poisoning is ignored and the data recovered.
//! `pool::sync` switches this for loom's mutex under `--cfg kvpush_loom`.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, recovering the data if a holder panicked.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The message of a caught panic's payload (a `&str` or a `String`; anything else is named as such).
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-text payload".to_owned()
    }
}
