//! The sans-IO protocol core of kvpush: messages, compatibility, the host-bounce route, rendezvous,
//! completion counting, planning and merging.
//!
//! Read [`layout`] first (what a KV cache looks like), then [`msg`] and [`codec`] (what crosses the
//! side channel), then the two state machines — [`rendezvous`] on the producer, [`completion`] on the
//! consumer — and finally [`plan`] and [`merge`] (block ids to copies).
//!
//! This module must never do I/O, start threads, read a clock (time is an argument, see
//! [`ids::Instant`]), use `unsafe` or name a vendor type. Everything here is deterministic, so it is
//! tested with property tests and a P/D simulation on virtual time (`tests/`).

#![forbid(unsafe_code)]

pub mod bounce;
mod bounded;
pub mod codec;
pub mod compat;
pub mod completion;
mod deadlines;
pub mod grants;
mod idlist;
pub mod ids;
pub mod layerwise;
pub mod layout;
pub mod merge;
pub mod msg;
pub mod path;
pub mod plan;
pub mod rendezvous;
pub mod staging;

#[cfg(test)]
pub(crate) mod testutil;

pub use ids::{Attempt, EngineId, Instant, Key, Rank, TransferId};
pub use layout::KvLayout;
pub use merge::Copy;
pub use msg::{Message, Mode};
