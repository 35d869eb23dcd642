//! kvpush's test kit: the workload the demo plays (in one process over the loopback transport, or
//! P and D as two processes over NIXL), deterministic KV contents and their verification, the one
//! PRNG ([`rng`]), the shared layouts ([`layouts`]), host-memory engines ([`engines`]) and the engine
//! stress driver ([`stress`]). Used by the `kvpush` command (`cli/`), the integration tests and the
//! benches; never by the library itself.

pub mod demo;
pub mod engines;
pub mod layouts;
pub mod rng;
pub mod stress;
