//! The writer pool's concurrency primitives.
//!
//! The writer threads themselves live in the engine (`engine::writer`); this module holds what they
//! share with the engine loop: the [`handoff`] primitives (lock-free piles for commands and results,
//! the inbox's parked bit and a coalescing wake flag), whose atomics go through [`sync`] so loom can
//! model-check them. Messages from other threads (the control link) reach a writer through its
//! crossbeam channel, which is also what a parked writer sleeps on.

pub mod handoff;
pub(crate) mod sync;
