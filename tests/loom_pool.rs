//! Loom models of the pool's hand-off primitives (`kvpush::pool::handoff`).
//!
//! Run with `RUSTFLAGS="--cfg kvpush_loom" cargo test --release --test loom_pool` (scripts/test.sh does);
//! without `--cfg kvpush_loom` this file compiles to nothing.
#![cfg(kvpush_loom)]

use kvpush::pool::handoff::{Inbox, Outbox, Pile, WakeFlag};
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;

/// The pushers of a model: a thread per list of `items`, pushing its items in order with `push`, and
/// the count of the pushes that returned true (a doorbell rung, a list started).
fn pushers<T: Send + Sync + 'static, V: Send + 'static>(
    shared: &Arc<T>,
    items: Vec<Vec<V>>,
    push: fn(&T, V) -> bool,
) -> (Vec<thread::JoinHandle<()>>, Arc<AtomicUsize>) {
    let trues = Arc::new(AtomicUsize::new(0));
    let threads = items
        .into_iter()
        .map(|list| {
            let (shared, trues) = (Arc::clone(shared), Arc::clone(&trues));
            thread::spawn(move || {
                for v in list {
                    if push(&shared, v) {
                        trues.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    (threads, trues)
}

/// Two producers push while the consumer drains concurrently: every item is delivered exactly once.
#[test]
fn outbox_delivers_every_item_exactly_once() {
    loom::model(|| {
        let o = Arc::new(Outbox::new());
        let producers: Vec<_> = (0..2)
            .map(|p| {
                let o = Arc::clone(&o);
                thread::spawn(move || o.push(p))
            })
            .collect();
        let mut got = Vec::new();
        let n1 = o.drain_into(&mut got);
        for p in producers {
            p.join().expect("producer");
        }
        // After every producer finished, one more drain sees the rest.
        let ready = o.maybe_ready();
        let n2 = o.drain_into(&mut got);
        got.sort_unstable();
        assert_eq!(got, vec![0, 1], "first drain {n1}, second {n2}, ready before second {ready}");
        let mut again = Vec::new();
        assert_eq!(o.drain_into(&mut again), 0);
    });
}

/// A ring is never lost: with a wake message already in flight (the flag set), the writer takes
/// it, clears the flag and looks for work while a ringer publishes work and rings. Either the writer
/// sees the work, or a new wake message is pending for it. `sent` counts wake messages in the channel.
#[test]
fn wake_flag_never_loses_a_ring() {
    loom::model(|| {
        let flag = Arc::new(WakeFlag::new());
        assert!(flag.ring());
        let sent = Arc::new(AtomicUsize::new(1));
        let work = Arc::new(AtomicUsize::new(0));
        let ringer = {
            let (flag, sent, work) = (Arc::clone(&flag), Arc::clone(&sent), Arc::clone(&work));
            thread::spawn(move || {
                work.fetch_add(1, Ordering::Relaxed); // publish work (the flag's ordering must carry it)
                if flag.ring() {
                    sent.fetch_add(1, Ordering::Relaxed);
                }
            })
        };
        // The writer: receives the pending wake, clears the flag, then looks for work.
        sent.fetch_sub(1, Ordering::Relaxed);
        flag.clear();
        let seen = work.load(Ordering::Relaxed);
        ringer.join().expect("ringer");
        if seen == 0 {
            assert!(sent.load(Ordering::Relaxed) >= 1, "work published without a wake the writer will see");
        }
    });
}

/// The inbox never strands an item: the engine pushes while the writer prepares to sleep; either the
/// writer's last look sees the item, or the push rings the doorbell (a wake message is sent).
#[test]
fn inbox_push_racing_sleep_is_seen_or_rung() {
    loom::model(|| {
        let inbox = Arc::new(Inbox::new());
        let (engine, rung) = pushers(&inbox, vec![vec![7u32]], |i, v| i.push(v));
        let mut got = Vec::new();
        inbox.drain_into(&mut got);
        let blocks = got.is_empty() && inbox.prepare_sleep();
        for e in engine {
            e.join().expect("engine");
        }
        if blocks {
            // The writer blocks: the item must have rung it awake.
            assert_eq!(rung.load(Ordering::Relaxed), 1, "item stranded with the writer asleep");
            inbox.woke();
        }
        inbox.drain_into(&mut got);
        assert_eq!(got, vec![7]);
    });
}

/// The pile under two pushers and a taker that runs concurrently: every item is taken exactly once
/// (no double take, none lost), each pusher's items in its push order, and the report of "was empty"
/// is true for exactly the pushes that found no list.
#[test]
fn pile_takes_every_item_exactly_once_in_push_order() {
    loom::model(|| {
        let pile = Arc::new(Pile::new());
        // Pusher 0 pushes 0 then 1, pusher 1 pushes 10.
        let (pushers, firsts) = pushers(&pile, vec![vec![0u32, 1], vec![10]], |p, v| p.push(v));
        let mut takes = Vec::new();
        let mut got = Vec::new();
        takes.push(pile.take_into(&mut got));
        for p in pushers {
            p.join().expect("pusher");
        }
        takes.push(pile.take_into(&mut got));
        assert!(pile.is_empty());
        assert_eq!(pile.take_into(&mut got), 0, "a second take of the same items");
        // Pusher 0 pushed 0 then 1: in that order whichever takes they fell into.
        let zeros: Vec<u32> = got.iter().copied().filter(|v| *v < 10).collect();
        assert_eq!(zeros, vec![0, 1], "order within one pusher; takes {takes:?}");
        let mut all = got.clone();
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 10], "every item exactly once; takes {takes:?}");
        // A push that found the pile empty starts a list; each non-empty take ends one.
        let lists = takes.iter().filter(|n| **n > 0).count();
        assert_eq!(firsts.load(Ordering::Relaxed), lists, "takes {takes:?}");
    });
}

/// The engine loop and a writer routing a notification both push while the inbox's writer parks:
/// no lost wake-up (if the writer parks with an item it has not seen, exactly one wake message is
/// sent, however many pushed), and after the wake every item is taken exactly once.
#[test]
fn inbox_two_pushers_racing_sleep_never_strand_an_item() {
    loom::model(|| {
        let inbox = Arc::new(Inbox::new());
        let (pushers, rung) = pushers(&inbox, vec![vec![0u32], vec![1]], |i, v| i.push(v));
        let mut got = Vec::new();
        inbox.drain_into(&mut got);
        let parks = got.len() < 2 && inbox.prepare_sleep();
        for p in pushers {
            p.join().expect("pusher");
        }
        let rings = rung.load(Ordering::Relaxed);
        assert!(rings <= 1, "the doorbell coalesces: {rings} wake messages");
        if parks {
            // Parked: whatever it had not seen must have rung it awake.
            if got.len() < 2 {
                assert_eq!(rings, 1, "item stranded with the writer parked (saw {got:?})");
            }
            inbox.woke();
        }
        // Not parked: a pusher may still have rung (it saw the writer's brief "asleep" before
        // `prepare_sleep` took it back); the writer then finds a spare wake message, which is harmless.
        inbox.drain_into(&mut got);
        got.sort_unstable();
        assert_eq!(got, vec![0, 1], "every item exactly once");
    });
}
