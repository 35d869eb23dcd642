//! The writer pool's concurrency primitives.
//!
//! The writer threads themselves live in the engine (`engine::writer`); this module holds what they
//! share with the engine loop: the [`handoff`] primitives (an outbox for results and a coalescing
//! wake flag), whose atomics go through [`sync`] so loom can model-check them. Queues into the writers
//! are crossbeam channels.

pub mod handoff;
pub(crate) mod sync;
