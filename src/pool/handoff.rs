//! The two hand-off primitives between the engine loop and a writer thread.
//!
//! * [`Outbox`]: the writer pushes results (finished sends, finished receives, invalid blocks); the
//!   engine loop drains them. An empty drain costs one atomic load and never takes the lock, so the
//!   engine loop's `poll` stays cheap when nothing finished.
//! * [`WakeFlag`]: coalesces wake-ups of a writer thread. Many threads may ring; only the ring that
//!   flips the flag sends a wake message, and the writer clears the flag *before* it looks for work,
//!   so a ring is never lost.
//!
//! State bits (who may touch what, as tokio's `oneshot` documents them):
//!
//! | primitive | bit | set by | cleared by | meaning when set |
//! |---|---|---|---|---|
//! | `Outbox` | `ready` | pusher, after its item is in the queue | drainer, before it takes the queue | the queue may hold items |
//! | `WakeFlag` | `rung` | a ringer (the one that flips it sends the wake) | the writer, before it looks for work | a wake message is in flight |
//!
//! Both are model-checked with loom in `tests/loom_pool.rs` (`RUSTFLAGS="--cfg kvpush_loom"`).

use super::sync::{lock, AtomicBool, Mutex, Ordering};

/// A multi-producer, single-consumer hand-off queue with a lock-free empty check.
#[derive(Debug)]
pub struct Outbox<T> {
    ready: AtomicBool,
    items: Mutex<Vec<T>>,
}

impl<T> Default for Outbox<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Outbox<T> {
    /// An empty outbox.
    pub fn new() -> Self {
        Self { ready: AtomicBool::new(false), items: Mutex::new(Vec::new()) }
    }

    /// Hands `item` to the drainer.
    pub fn push(&self, item: T) {
        lock(&self.items).push(item);
        // Release: the item is in the queue before `ready` can be seen set. Every access to the
        // bits is a read-modify-write (never a plain store): RMWs on one atomic form a single chain,
        // which is what the hand-off relies on, and exactly what loom models (tokio-rs/loom#254).
        self.ready.swap(true, Ordering::AcqRel);
    }

    /// Moves every item pushed so far into `out` (in push order); returns how many.
    pub fn drain_into(&self, out: &mut Vec<T>) -> usize {
        // Acquire pairs with `push`'s Release. Clearing before taking the lock means a push that
        // lands after our take sets `ready` again, so it is seen by the next drain.
        if !self.ready.swap(false, Ordering::AcqRel) {
            return 0;
        }
        let mut items = lock(&self.items);
        let n = items.len();
        out.append(&mut items);
        n
    }

    /// Whether a drain might find items (a hint; exact when no push runs concurrently).
    pub fn maybe_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }
}

/// Coalesced wake-ups of one writer thread.
#[derive(Debug, Default)]
pub struct WakeFlag {
    rung: AtomicBool,
}

impl WakeFlag {
    /// A cleared flag.
    pub fn new() -> Self {
        Self { rung: AtomicBool::new(false) }
    }

    /// Rings; returns `true` if the caller must send the wake message (the flag was clear).
    pub fn ring(&self) -> bool {
        // Always a write, even when already set: the writer's `clear` must acquire *this* ring's
        // release to see the work published before it (a failed compare-exchange would not release).
        !self.rung.swap(true, Ordering::AcqRel)
    }

    /// Clears the flag; the writer calls it before looking for work, so any later ring sends a new
    /// wake message.
    pub fn clear(&self) {
        // A read-modify-write, not a store: its Acquire half synchronizes with the Release half of
        // the ring it clears, so the writer sees every piece of work published before that ring.
        self.rung.swap(false, Ordering::AcqRel);
    }
}

#[cfg(all(test, not(kvpush_loom)))]
mod tests {
    use super::*;

    #[test]
    fn outbox_hands_over_in_order_and_empty_drain_is_free() {
        let o = Outbox::new();
        let mut out = Vec::new();
        assert_eq!(o.drain_into(&mut out), 0);
        o.push(1);
        o.push(2);
        assert!(o.maybe_ready());
        assert_eq!(o.drain_into(&mut out), 2);
        assert_eq!(out, vec![1, 2]);
        assert!(!o.maybe_ready());
        assert_eq!(o.drain_into(&mut out), 0);
    }

    #[test]
    fn wake_flag_coalesces_until_cleared() {
        let w = WakeFlag::new();
        assert!(w.ring());
        assert!(!w.ring());
        w.clear();
        assert!(w.ring());
    }
}
