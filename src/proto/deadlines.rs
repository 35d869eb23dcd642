//! The deadline queue that rendezvous and completion counting share.
//!
//! Each state machine arms a deadline per request attempt and, on `handle_timeout`, takes the due
//! ones in time order. Entries are never removed early: the owner checks a popped entry against its
//! own state and skips stale ones. Like all of `proto`, this never reads a clock.

use core::cmp::Reverse;
use std::collections::BinaryHeap;

use super::ids::{Attempt, Instant, Key, TransferId};

/// Deadlines of request attempts, earliest first.
#[derive(Debug, Default)]
pub(crate) struct Deadlines(BinaryHeap<Reverse<(Instant, TransferId, u32)>>);

impl Deadlines {
    /// Arms a deadline at `at` for `key`.
    pub(crate) fn push(&mut self, at: Instant, key: Key) {
        self.0.push(Reverse((at, key.transfer_id, key.attempt.0)));
    }

    /// The earliest deadline armed, stale or not.
    pub(crate) fn next(&self) -> Option<Instant> {
        self.0.peek().map(|r| r.0 .0)
    }

    /// Removes and returns the earliest deadline if it is at or before `now`.
    pub(crate) fn pop_due(&mut self, now: Instant) -> Option<(Instant, Key)> {
        let Reverse((at, id, attempt)) = *self.0.peek()?;
        if at > now {
            return None;
        }
        self.0.pop();
        Some((at, Key { transfer_id: id, attempt: Attempt(attempt) }))
    }
}
