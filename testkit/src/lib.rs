//! kvpush's test kit: the workload the demo plays (in one process over the loopback transport, or
//! P and D as two processes over NIXL), deterministic KV contents and their verification, the one
//! PRNG ([`rng`]), the shared layouts ([`layouts`]), host-memory engines ([`engines`]), the engine
//! stress driver ([`stress`]), the fault suite ([`faults`]), the fake libnrt ([`neuron_fake`]) and the
//! rule for tests whose prerequisites are missing ([`require`]).
//! Used by the `kvpush` command (`cli/`), the integration tests and the benches; never by the
//! library itself.

/// Adds each named field of `$src` to the same field of `$dst` (`$dst.f += $src.f`): how the
/// reports sum counters gathered per worker or per scenario, one list of names per sum. Defined
/// before the modules so that every module of the crate can use it.
macro_rules! add_fields {
    ($dst:expr, $src:expr; $($field:ident),+ $(,)?) => {{
        let (dst, src) = (&mut $dst, &$src);
        $(dst.$field += src.$field;)+
    }};
}

pub mod bounce;
pub mod child;
pub mod corpus;
pub mod demo;
pub mod engines;
pub mod faults;
pub mod hostile;
pub mod layouts;
pub mod neuron_fake;
pub mod require;
pub mod rng;
pub mod stress;

pub use require::{in_ci, require, require_gpu};
