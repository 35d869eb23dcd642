//! kvpush moves the KV cache of a request from a prefill engine (P) to a decode engine (D) by
//! **push**: D registers where the KV must land while P still computes it, and P writes it there the
//! moment its blocks are ready.
//!
//! The crate is layered (docs/architecture.md): [`proto`] is the sans-IO protocol core every other
//! layer drives. This crate is the library only (the cdylib that vLLM and C/C++ engines load): the
//! `kvpush` command lives in `cli/`, the router in `router/` and the demo's workload driver in
//! `testkit/`.

pub mod device;
pub mod embed;
pub mod engine;
pub mod ffi;
pub mod pool;
pub mod proto;
#[cfg(feature = "python")]
pub mod python;
mod sync;
pub mod transport;
