//! The transports behind the `Transport` trait: the in-process loopback (completion, faults) and real
//! NIXL over UCX. One test binary (tests/README.md maps features to tests).

mod loopback;
mod nixl_transport;
