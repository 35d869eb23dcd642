//! The hand-off primitives between the engine loop and a writer thread. None takes a lock.
//!
//! * [`Outbox`]: the writers push results (finished sends, finished receives, invalid blocks); the
//!   engine loop drains them. An empty drain costs one atomic load.
//! * [`WakeFlag`]: coalesces wake-ups of a writer thread. Many threads may ring; only the ring that
//!   flips the flag sends a wake message, and the writer clears the flag *before* it looks for work,
//!   so a ring is never lost.
//! * [`Inbox`]: the engine loop's commands to a writer. A push is one compare-and-swap and a fence,
//!   and rings the writer's doorbell only when the writer is parked: while it works or lingers after
//!   work it finds the commands itself, so the engine loop pays no wake-up (a futex call) then.
//!
//! Both queues are a [`Pile`]: a multi-producer list that its one consumer takes whole. A push links
//! a finished node in with one compare-and-swap; the take swaps the head for null. So neither side
//! ever waits for the other — a writer preempted in the middle of a push (writers run `SCHED_BATCH`)
//! cannot hold up the engine loop's `poll`, and the engine loop preempted mid-push cannot hold up a
//! writer — which a mutex-guarded vector (before) or a slot queue (crossbeam's list channel and
//! `SegQueue` make a consumer wait for a producer that claimed a slot but has not written it yet)
//! cannot promise. There is no ABA: nodes are never popped one by one, only the whole list.
//!
//! State (who may touch what, as tokio's `oneshot` documents it):
//!
//! | primitive | state | set by | cleared by | meaning when set |
//! |---|---|---|---|---|
//! | `Pile` | `head` non-null | a pusher (its node, linked before the CAS that publishes it) | the taker's swap | the pile holds items |
//! | `WakeFlag` | `rung` | a ringer (the one that flips it sends the wake) | the writer, before it looks for work | a wake message is in flight |
//! | `Inbox` | `awake` | the writer, when it wakes | the writer, before it parks | it will look at the inbox again without a doorbell |
//!
//! All of them are model-checked with loom in `tests/loom_pool.rs` (`RUSTFLAGS="--cfg kvpush_loom"`):
//! every interleaving of their atomics, with the pile's own (no lost item, no double take, order).

use std::ptr;

use super::sync::{fence, AtomicBool, AtomicPtr, Ordering};

/// A node of a [`Pile`]: written whole by its pusher before the CAS that publishes it.
struct Node<T> {
    item: T,
    next: *mut Node<T>,
}

/// A lock-free multi-producer list taken whole by a single consumer (a Treiber stack without pop).
pub struct Pile<T> {
    head: AtomicPtr<Node<T>>,
}

// SAFETY: a `Pile` owns its items (each node is reachable from `head` only until one `take_into`
// moves it out), so sending or sharing the pile sends items across threads: sound when `T: Send`.
// Every access to a node goes through the AcqRel operations on `head` described on `push`/`take_into`.
unsafe impl<T: Send> Send for Pile<T> {}
// SAFETY: as above; `&Pile` only allows `push` (hands an item over) and `take_into` (takes items
// out), never a shared reference to an item, so `T: Sync` is not needed.
unsafe impl<T: Send> Sync for Pile<T> {}

impl<T> std::fmt::Debug for Pile<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pile").field("empty", &self.is_empty()).finish()
    }
}

impl<T> Default for Pile<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Pile<T> {
    /// An empty pile.
    pub fn new() -> Self {
        Self { head: AtomicPtr::new(ptr::null_mut()) }
    }

    /// Adds `item`; returns whether the pile was empty before. Lock-free: one allocation and a CAS
    /// that fails only when another push landed meanwhile.
    pub fn push(&self, item: T) -> bool {
        let node = Box::into_raw(Box::new(Node { item, next: ptr::null_mut() }));
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            // SAFETY: `node` came from `Box::into_raw` above and is not published yet (the CAS
            // below has not succeeded), so this thread is its only user.
            unsafe { (*node).next = head };
            // Release: the node's fields are written before it can be seen. Acquire (on success it is
            // an RMW in head's single modification order) keeps the chain of pushes one release
            // sequence, so the taker's Acquire sees every node below this one too.
            match self.head.compare_exchange_weak(head, node, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return head.is_null(),
                Err(now) => head = now,
            }
        }
    }

    /// Moves every item pushed so far into `out`, oldest first; returns how many.
    pub fn take_into(&self, out: &mut Vec<T>) -> usize {
        // Acquire pairs with each push's Release. A push after this swap starts a new list, seen by
        // the next take.
        let mut node = self.head.swap(ptr::null_mut(), Ordering::AcqRel);
        let start = out.len();
        while !node.is_null() {
            // SAFETY: the swap made this thread the only owner of the whole list: every node in it was
            // made by `Box::into_raw` in `push`, fully written before its publishing CAS (which the
            // swap's Acquire synchronizes with), and is reachable from nowhere else now.
            let boxed = unsafe { Box::from_raw(node) };
            node = boxed.next;
            out.push(boxed.item);
        }
        out[start..].reverse();
        out.len() - start
    }

    /// Whether a take might find items (a hint; exact when no push runs concurrently).
    pub fn is_empty(&self) -> bool {
        self.head.load(Ordering::Acquire).is_null()
    }
}

impl<T> Drop for Pile<T> {
    fn drop(&mut self) {
        let mut rest = Vec::new();
        self.take_into(&mut rest);
    }
}

/// A multi-producer, single-consumer hand-off queue whose empty check is one atomic load.
#[derive(Debug)]
pub struct Outbox<T> {
    items: Pile<T>,
}

impl<T> Default for Outbox<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Outbox<T> {
    /// An empty outbox.
    pub fn new() -> Self {
        Self { items: Pile::new() }
    }

    /// Hands `item` to the drainer.
    pub fn push(&self, item: T) {
        self.items.push(item);
    }

    /// Moves every item pushed so far into `out` (in push order); returns how many.
    pub fn drain_into(&self, out: &mut Vec<T>) -> usize {
        if self.items.is_empty() {
            return 0;
        }
        self.items.take_into(out)
    }

    /// Whether a drain might find items (a hint; exact when no push runs concurrently).
    pub fn maybe_ready(&self) -> bool {
        !self.items.is_empty()
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

/// Commands from the engine loop to one writer, with a doorbell rung only when the writer is parked.
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
    fn pile_reports_empty_starts_keeps_order_and_frees_what_it_holds() {
        let p = Pile::new();
        assert!(p.is_empty());
        assert!(p.push(1), "first push onto an empty pile");
        assert!(!p.push(2));
        let mut out = vec![0];
        assert_eq!(p.take_into(&mut out), 2);
        assert_eq!(out, vec![0, 1, 2], "appended oldest first after what `out` held");
        assert!(p.push(3), "empty again after a take");
        // Items still in the pile are dropped with it.
        let item = std::sync::Arc::new(());
        let q = Pile::new();
        q.push(std::sync::Arc::clone(&item));
        q.push(std::sync::Arc::clone(&item));
        assert_eq!(std::sync::Arc::strong_count(&item), 3);
        drop(q);
        assert_eq!(std::sync::Arc::strong_count(&item), 1);
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
