//! Loom models of the pool's hand-off primitives (`kvpush::pool::handoff`).
//!
//! Run with `RUSTFLAGS="--cfg kvpush_loom" cargo test --release --test loom_pool` (scripts/test.sh does);
//! without `--cfg kvpush_loom` this file compiles to nothing.
#![cfg(kvpush_loom)]

use kvpush::pool::handoff::{Outbox, WakeFlag};
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;

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
    use kvpush::pool::handoff::Inbox;
    loom::model(|| {
        let inbox = Arc::new(Inbox::new());
        let rung = Arc::new(AtomicUsize::new(0));
        let engine = {
            let (inbox, rung) = (Arc::clone(&inbox), Arc::clone(&rung));
            thread::spawn(move || {
                if inbox.push(7u32) {
                    rung.fetch_add(1, Ordering::Relaxed);
                }
            })
        };
        let mut got = Vec::new();
        inbox.drain_into(&mut got);
        let blocks = got.is_empty() && inbox.prepare_sleep();
        engine.join().expect("engine");
        if blocks {
            // The writer blocks: the item must have rung it awake.
            assert_eq!(rung.load(Ordering::Relaxed), 1, "item stranded with the writer asleep");
            inbox.woke();
        }
        inbox.drain_into(&mut got);
        assert_eq!(got, vec![7]);
    });
}
