//! The control budget: how many control frames, and how many of their bytes, peers may have queued
//! for this engine's writers at once.
//!
//! Read [`ControlBudget`]. A frame takes a [`Credit`] before it is decoded and routed; the credit
//! travels with the command to the writer shard and is given back when the command is dropped
//! (handled, or thrown away by a stopping writer). A frame that finds the budget spent is refused at
//! once: an in-process sender gets the error; the side channel's I/O thread parks the frame on its
//! connection and stops reading that socket until the frame fits (TCP's window fills, the peer's
//! bounded send queue fills, and the peer's sends fail with [`super::LinkError::Full`]), closing the
//! connection as overloaded after [`ControlLimits::wait`]. Memory behind the writer queues is
//! therefore bounded by the budget, whatever peers send.
//!
//! What it must never do: block a writer thread (writers only give credits back), or be taken while
//! the peers' lock is held (a writer may need that lock to make progress).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::sync::lock;

/// Limits of the control budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ControlLimits {
    /// Control frames queued for the writers at once.
    pub frames: usize,
    /// Bytes of those frames (as received) at once. One frame larger than this alone is let through
    /// when nothing else is queued.
    pub bytes: usize,
    /// How long a side-channel frame waits for room before its connection is closed as overloaded.
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
}

/// Control frames and bytes queued for the writers, against [`ControlLimits`].
#[derive(Debug)]
pub(crate) struct ControlBudget {
    limits: ControlLimits,
    queued: Mutex<Queued>,
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
        Arc::new(Self { limits, queued: Mutex::new(Queued::default()) })
    }

    /// Room for a frame of `bytes` now, or what is queued.
    pub(crate) fn acquire(self: &Arc<Self>, bytes: usize) -> Result<Credit, Spent> {
        let mut q = lock(&self.queued);
        let fits =
            q.frames == 0 || (q.frames < self.limits.frames && q.bytes.saturating_add(bytes) <= self.limits.bytes);
        if !fits {
            return Err(Spent { frames: q.frames, bytes: q.bytes });
        }
        q.frames += 1;
        q.bytes += bytes;
        Ok(Credit { budget: Arc::clone(self), bytes })
    }

    /// The limits it keeps.
    pub(crate) fn limits(&self) -> ControlLimits {
        self.limits
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
        let c1 = b.acquire(40).expect("room");
        let c2 = b.acquire(40).expect("room");
        // 40 more bytes would make 120 > 100.
        assert_eq!(b.acquire(40).map(|_| ()), Err(Spent { frames: 2, bytes: 80 }));
        let c3 = b.acquire(20).expect("exactly the byte limit");
        // Three frames: the frame limit, whatever the size.
        assert_eq!(b.acquire(0).map(|_| ()), Err(Spent { frames: 3, bytes: 100 }));
        drop(c2);
        assert_eq!(b.queued(), (2, 60));
        let c4 = b.acquire(40).expect("room again");
        drop((c1, c3, c4));
        assert_eq!(b.queued(), (0, 0));
        // A frame larger than the byte limit passes alone, never next to others.
        let big = b.acquire(1000).expect("alone");
        assert!(b.acquire(1).is_err());
        drop(big);
        assert_eq!(b.queued(), (0, 0));
    }
}
