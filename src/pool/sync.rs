//! The synchronization primitives the pool's own atomic protocols use, swapped for loom's under
//! `--cfg kvpush_loom` so `tests/loom_pool.rs` can model-check every interleaving (tokio's `loom` module
//! does the same). Only [`super::handoff`] uses these; everything else uses crossbeam.

#[cfg(kvpush_loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicPtr, Ordering};

#[cfg(not(kvpush_loom))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicPtr, Ordering};
