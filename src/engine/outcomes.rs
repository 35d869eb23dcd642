//! The engine's finished results on their way to the serving engine: the lock-free
//! [`Outbox`] the writers push into and the engine loop drains, plus a bounded wait for a caller
//! that has nothing else to do until a result comes.
//!
//! The wait exists for vLLM's decode engine: while its only requests are waiting for their KV,
//! vLLM steps about once a millisecond just to ask the connector whether anything landed (and, on
//! its CPU build, each step is a round trip to a worker process that spins while it waits). The
//! connector's worker half waits here instead, for at most a few milliseconds, so an idle step
//! costs one sleep and the step after a landing comes at once. Pushing stays one atomic swap and
//! one fence when nobody waits; it never blocks a writer for longer than a notify.

use std::sync::atomic::{fence, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::pool::handoff::Outbox;
use crate::sync::lock;

/// A multi-producer, single-consumer outbox of `T` with [`Outcomes::wait`].
#[derive(Debug)]
pub(crate) struct Outcomes<T> {
    items: Outbox<T>,
    /// Callers inside [`Outcomes::wait`]; a push notifies only when this is non-zero.
    waiting: AtomicUsize,
    lock: Mutex<()>,
    ready: Condvar,
}

impl<T> Outcomes<T> {
    /// Empty, nobody waiting.
    pub(crate) fn new() -> Self {
        Self { items: Outbox::new(), waiting: AtomicUsize::new(0), lock: Mutex::new(()), ready: Condvar::new() }
    }

    /// Hands `item` to the drainer and wakes a caller blocked in [`Outcomes::wait`].
    pub(crate) fn push(&self, item: T) {
        self.items.push(item);
        // Pairs with the fence in `wait`: either this load sees the waiter's increment, or the
        // waiter's check after its increment sees this item (Dekker's pattern, both sides SeqCst).
        fence(Ordering::SeqCst);
        if self.waiting.load(Ordering::Relaxed) > 0 {
            // Taken so the notify cannot fall between the waiter's last check and its sleep: the
            // waiter holds this lock from its check until the condition variable releases it.
            let _held = lock(&self.lock);
            self.ready.notify_all();
        }
    }

    /// Moves every item pushed so far into `out` (in push order); returns how many.
    pub(crate) fn drain_into(&self, out: &mut Vec<T>) -> usize {
        self.items.drain_into(out)
    }

    /// Blocks until an item is there to drain or `timeout` has passed; returns whether one is.
    /// Returns at once when an item is already there (or `timeout` is zero).
    pub(crate) fn wait(&self, timeout: Duration) -> bool {
        if self.items.maybe_ready() || timeout.is_zero() {
            return self.items.maybe_ready();
        }
        let deadline = Instant::now() + timeout;
        let mut held = lock(&self.lock);
        self.waiting.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let ready = loop {
            if self.items.maybe_ready() {
                break true;
            }
            let now = Instant::now();
            if now >= deadline {
                break false;
            }
            held = match self.ready.wait_timeout(held, deadline - now) {
                Ok((g, _)) => g,
                // A writer that panicked while holding `lock` left nothing half-done: it guards no data.
                Err(e) => PoisonError::into_inner(e).0,
            };
        };
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        drop(held);
        ready
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn wait_times_out_when_nothing_comes_and_returns_at_once_when_something_is_there() {
        let o: Outcomes<u32> = Outcomes::new();
        let t0 = Instant::now();
        assert!(!o.wait(Duration::from_millis(30)));
        assert!(t0.elapsed() >= Duration::from_millis(30), "waited {:?}", t0.elapsed());
        o.push(7);
        let t0 = Instant::now();
        assert!(o.wait(Duration::from_secs(10)));
        assert!(t0.elapsed() < Duration::from_secs(5));
        let mut out = Vec::new();
        assert_eq!(o.drain_into(&mut out), 1);
        assert_eq!(out, [7]);
        assert!(!o.wait(Duration::ZERO));
    }

    #[test]
    fn a_push_from_another_thread_ends_the_wait_long_before_its_timeout() {
        // Many rounds, so a push landing between the waiter's check and its sleep is exercised: a lost
        // wake-up would show as a wait that runs to its 20 s timeout.
        let o = Arc::new(Outcomes::<u32>::new());
        for round in 0..2000u32 {
            let p = Arc::clone(&o);
            let pusher = std::thread::spawn(move || {
                if round % 2 == 0 {
                    std::thread::yield_now();
                }
                p.push(round);
            });
            let t0 = Instant::now();
            assert!(o.wait(Duration::from_secs(20)), "round {round}: the push was not seen");
            assert!(t0.elapsed() < Duration::from_secs(10), "round {round}: woke only after {:?}", t0.elapsed());
            pusher.join().expect("pusher");
            let mut out = Vec::new();
            o.drain_into(&mut out);
            assert_eq!(out, [round]);
        }
        assert_eq!(o.waiting.load(Ordering::SeqCst), 0);
    }
}
