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
//! * [`Inbox`]: the engine loop's commands to a writer. A push costs a lock and a fence, and rings
//!   the writer's doorbell only when the writer is asleep: while it works or lingers after work it
//!   finds the commands itself, so the engine loop pays no wake-up (a futex call) on the hot path.
//!
//! | `Inbox` | `awake` | the writer, when it wakes | the writer, before it blocks | it will look at the inbox again without a doorbell |
//!
//! All three are model-checked with loom in `tests/loom_pool.rs` (`RUSTFLAGS="--cfg kvpush_loom"`).

use super::sync::{fence, lock, AtomicBool, Mutex, Ordering};

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

/// Commands from the engine loop to one writer, with a doorbell rung only when the writer sleeps.
///
/// Protocol (a store-buffering pair closed by two `SeqCst` fences): the pusher stores its item, then
/// fences, then reads `awake`; the writer clears `awake`, then fences, then looks at the items. At
/// least one of them sees the other's store, so an item pushed while the writer goes to sleep is
/// either seen by the writer's last look or answered by a ring.
#[derive(Debug)]
pub struct Inbox<T> {
    items: Outbox<T>,
    awake: AtomicBool,
    flag: WakeFlag,
}

impl<T> Default for Inbox<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Inbox<T> {
    /// An empty inbox whose writer counts as awake (it looks before it first blocks).
    pub fn new() -> Self {
        Self { items: Outbox::new(), awake: AtomicBool::new(true), flag: WakeFlag::new() }
    }

    /// Engine loop: hands `item` over; returns `true` if the caller must send the wake message.
    pub fn push(&self, item: T) -> bool {
        self.items.push(item);
        // Pairs with the fence in `prepare_sleep`: the item is visible to the writer's last look, or
        // the writer's "asleep" is visible here (loom: the model fails without this fence).
        fence(Ordering::SeqCst);
        if self.awake.load(Ordering::Relaxed) {
            return false;
        }
        self.flag.ring()
    }

    /// Writer: moves every pushed item into `out`; returns how many.
    pub fn drain_into(&self, out: &mut Vec<T>) -> usize {
        self.items.drain_into(out)
    }

    /// Writer, before blocking: marks itself asleep; returns `false` if items arrived meanwhile (then
    /// it must not block, and counts as awake again).
    pub fn prepare_sleep(&self) -> bool {
        self.awake.store(false, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        if self.items.maybe_ready() {
            self.awake.store(true, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Writer, after waking: marks itself awake and clears the doorbell (before looking for work).
    pub fn woke(&self) {
        self.awake.store(true, Ordering::Relaxed);
        self.flag.clear();
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
    fn inbox_rings_only_a_sleeping_writer() {
        let i = Inbox::new();
        assert!(!i.push(1), "an awake writer needs no doorbell");
        assert!(!i.prepare_sleep(), "items arrived: the writer must not block");
        let mut out = Vec::new();
        assert_eq!(i.drain_into(&mut out), 1);
        assert!(i.prepare_sleep());
        assert!(i.push(2), "a sleeping writer is rung");
        assert!(!i.push(3), "once");
        i.woke();
        assert_eq!(i.drain_into(&mut out), 2);
        assert_eq!(out, vec![1, 2, 3]);
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
