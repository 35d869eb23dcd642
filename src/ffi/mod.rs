//! Embedding kvpush in C and C++ engines: the C ABI ([`capi`]) and the cxx bridge ([`cxx`]), both thin
//! conversions onto the embedding facade ([`crate::embed`]). The public headers are
//! `cpp/include/kvpush.h` and `kvpush.hpp`; docs/ffi.md explains ownership and threading.

pub use crate::embed::{mode, outcome, release, status, transport};

pub mod capi;
mod cpp;
pub mod cxx;
