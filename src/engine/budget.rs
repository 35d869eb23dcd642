//! The control budget: how many control frames, and how many of their bytes, peers may have queued
//! for this engine's writers at once.
//!
//! Read [`ControlBudget`]. A frame takes a [`Credit`] before it is decoded and routed; the credit
//! travels with the command to the writer shard and is given back when the command is dropped
//! (handled, or thrown away by a stopping writer). A side-channel reader that finds the budget spent
//! waits (so it stops reading its socket: TCP's window fills, the peer's bounded send queue fills, and
//! the peer's sends fail with [`super::LinkError::Full`]); an in-process sender is refused at once.
//! Memory behind the writer queues is therefore bounded by the budget, whatever peers send.
//!
//! What it must never do: block a writer thread (writers only give credits back), or be taken while
//! the peers' lock is held (a writer may need that lock to make progress).

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::sync::lock;

/// Limits of the control budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ControlLimits {
    /// Control frames queued for the writers at once.
    pub frames: usize,
    /// Bytes of those frames (as received) at once. One frame larger than this alone is let through
    /// when nothing else is queued.
    pub bytes: usize,
    /// How long a side-channel reader waits for room before it closes its connection as overloaded.
    pub wait: Duration,
}

impl Default for ControlLimits {
    fn default() -> Self {
        Self { frames: 4096, bytes: 64 << 20, wait: Duration::from_secs(5) }
    }
}

#[derive(Debug, Default)]
struct Queued {
    frames: usize,
    bytes: usize,
    waiters: usize,
}

/// Control frames and bytes queued for the writers, against [`ControlLimits`].
#[derive(Debug)]
pub(crate) struct ControlBudget {
    limits: ControlLimits,
    queued: Mutex<Queued>,
    freed: Condvar,
}

/// Room for one queued control frame; given back when dropped.
#[derive(Debug)]
pub(crate) struct Credit {
    budget: Arc<ControlBudget>,
    bytes: usize,
}

impl Drop for Credit {
    fn drop(&mut self) {
        let mut q = lock(&self.budget.queued);
        q.frames -= 1;
        q.bytes -= self.bytes;
        // Only a reader that waits needs the (system-call) wake-up.
        if q.waiters > 0 {
            self.budget.freed.notify_all();
        }
    }
}

/// The budget stayed spent: what was queued when the frame gave up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Spent {
    pub(crate) frames: usize,
    pub(crate) bytes: usize,
}

impl ControlBudget {
    pub(crate) fn new(limits: ControlLimits) -> Arc<Self> {
        Arc::new(Self { limits, queued: Mutex::new(Queued::default()), freed: Condvar::new() })
    }

    /// Room for a frame of `bytes`: at once, or (with `wait`) as soon as the writers free it, up to
    /// [`ControlLimits::wait`].
    pub(crate) fn acquire(self: &Arc<Self>, bytes: usize, wait: bool) -> Result<Credit, Spent> {
        let fits = |q: &Queued| {
            q.frames == 0 || (q.frames < self.limits.frames && q.bytes.saturating_add(bytes) <= self.limits.bytes)
        };
        let mut q = lock(&self.queued);
        if !fits(&q) && wait {
            let deadline = Instant::now() + self.limits.wait;
            q.waiters += 1;
            while !fits(&q) {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                q = self.freed.wait_timeout(q, left).unwrap_or_else(|p| p.into_inner()).0;
            }
            q.waiters -= 1;
        }
        if !fits(&q) {
            return Err(Spent { frames: q.frames, bytes: q.bytes });
        }
        q.frames += 1;
        q.bytes += bytes;
        Ok(Credit { budget: Arc::clone(self), bytes })
    }

    /// Frames and bytes queued now.
    #[cfg(test)]
    fn queued(&self) -> (usize, usize) {
        let q = lock(&self.queued);
        (q.frames, q.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(frames: usize, bytes: usize) -> Arc<ControlBudget> {
        ControlBudget::new(ControlLimits { frames, bytes, wait: Duration::from_secs(5) })
    }

    #[test]
    fn frames_and_bytes_are_bounded_and_come_back_when_credits_drop() {
        let b = budget(3, 100);
        let c1 = b.acquire(40, false).expect("room");
        let c2 = b.acquire(40, false).expect("room");
        // 40 more bytes would make 120 > 100.
        assert_eq!(b.acquire(40, false).map(|_| ()), Err(Spent { frames: 2, bytes: 80 }));
        let c3 = b.acquire(20, false).expect("exactly the byte limit");
        // Three frames: the frame limit, whatever the size.
        assert_eq!(b.acquire(0, false).map(|_| ()), Err(Spent { frames: 3, bytes: 100 }));
        drop(c2);
        assert_eq!(b.queued(), (2, 60));
        let c4 = b.acquire(40, false).expect("room again");
        drop((c1, c3, c4));
        assert_eq!(b.queued(), (0, 0));
        // A frame larger than the byte limit passes alone, never next to others.
        let big = b.acquire(1000, false).expect("alone");
        assert!(b.acquire(1, false).is_err());
        drop(big);
        assert_eq!(b.queued(), (0, 0));
    }

    #[test]
    fn a_waiting_reader_gets_room_when_a_writer_frees_it_and_gives_up_at_the_limit() {
        let b = ControlBudget::new(ControlLimits { frames: 1, bytes: 100, wait: Duration::from_millis(300) });
        let held = b.acquire(10, false).expect("room");
        let t0 = Instant::now();
        assert!(b.acquire(10, true).is_err(), "no room was freed");
        assert!(t0.elapsed() >= Duration::from_millis(300), "gave up after {:?}", t0.elapsed());
        let b2 = Arc::clone(&b);
        let waiter = std::thread::spawn(move || b2.acquire(10, true).map(|c| c.bytes));
        // Poll until the waiter is parked, then free the room it waits for.
        let deadline = Instant::now() + Duration::from_secs(5);
        while lock(&b.queued).waiters == 0 {
            assert!(Instant::now() < deadline, "the reader never waited");
            std::thread::yield_now();
        }
        drop(held);
        assert_eq!(waiter.join().expect("join"), Ok(10));
        assert_eq!(b.queued(), (0, 0));
    }
}
