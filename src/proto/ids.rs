//! Identities that every message carries: which transfer, which attempt of it, which rank.
//!
//! The router mints one [`TransferId`] per request and hands it to both legs; the [`Attempt`] number
//! grows when a request is retried or preempted, so a stale registration or notification never
//! matches a newer attempt. A [`Key`] is the pair of both and is what rendezvous and completion
//! counting are keyed by.

use core::fmt;

use serde::{Deserialize, Serialize};

/// 128-bit identifier the router mints per request (unguessable in practice).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TransferId(pub u128);

impl fmt::Debug for TransferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TransferId({:032x})", self.0)
    }
}

impl fmt::Display for TransferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// Attempt number of a transfer; a larger attempt supersedes every smaller one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Attempt(pub u32);

impl fmt::Display for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// `(transfer_id, attempt)`: the identity of one try at moving one request's KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Key {
    /// The router's id of the request.
    pub transfer_id: TransferId,
    /// Which try of it.
    pub attempt: Attempt,
}

impl Key {
    /// Builds a key from its raw parts.
    pub const fn new(transfer_id: u128, attempt: u32) -> Self {
        Self { transfer_id: TransferId(transfer_id), attempt: Attempt(attempt) }
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.transfer_id, self.attempt)
    }
}

/// The position of one worker in its engine's tensor- and pipeline-parallel grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Rank {
    /// Tensor-parallel rank.
    pub tp: u16,
    /// Pipeline-parallel rank.
    pub pp: u16,
}

impl Rank {
    /// Builds a rank from its TP and PP indices.
    pub const fn new(tp: u16, pp: u16) -> Self {
        Self { tp, pp }
    }
}

impl fmt::Display for Rank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tp{}/pp{}", self.tp, self.pp)
    }
}

/// Name of an engine instance (as vLLM's `engine_id`), bounded in length by the codec.
pub type EngineId = String;

/// Virtual or real time in microseconds, as passed into the state machines by their driver.
///
/// `proto` never reads a clock: every `handle_*` method takes the current time as an argument.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Instant(pub u64);

impl Instant {
    /// `self + micros`, saturating.
    pub const fn plus_micros(self, micros: u64) -> Self {
        Self(self.0.saturating_add(micros))
    }

    /// Microseconds from `earlier` to `self`, zero if `earlier` is later.
    pub const fn micros_since(self, earlier: Instant) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}
