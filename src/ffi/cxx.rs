//! The cxx bridge: the declarations C++ sees (`kvpush::bridge` in the generated header
//! `kvpush/src/ffi/cxx.rs.h`).
//!
//! This file holds declarations only; the functions live in `src/ffi/cpp.rs`, and the public C++
//! API is the shim classes of `cpp/include/kvpush.hpp` (`kvpush::Engine`, `kvpush::Hub`), which wrap
//! these in RAII types and turn `rust::Error` into `kvpush::Error`. `build.rs` runs cxx-build on this
//! file, so editing it rebuilds the C++ side. Every fallible function returns `Result` (a C++
//! exception) and catches panics itself, so none reaches cxx's abort-on-panic guard.
//!
//! Statistics cross as the C ABI's own `kvpush_stats` (a trivial extern type, returned by value), so
//! the C++ API has no mirror of the counters to keep in step.

pub use self::bridge::{Completion, EngineSpec, GroupSpec, Key, LayoutSpec};
use super::capi::kvpush_stats;
use super::cpp::{new_hub, new_loopback_engine, new_nixl_engine, take_error_code, RustEngine, RustHub};

// SAFETY: `kvpush_stats` is `#[repr(C)]` and mirrors the C struct of the same name in `kvpush.h`
// field for field (`tests/ffi/ffi_c.rs` checks every field's name and offset against the header); it
// holds only `u64`s, so it has no destructor and no move constructor, and C++ may copy and move it
// as raw bytes, which is what `Trivial` promises. Its C++ name is `::kvpush_stats`.
unsafe impl ::cxx::ExternType for kvpush_stats {
    type Id = ::cxx::type_id!("kvpush_stats");
    type Kind = ::cxx::kind::Trivial;
}

// `start_pull` passes two flattened block lists: eight arguments.
#[allow(clippy::too_many_arguments)]
#[::cxx::bridge(namespace = "kvpush::bridge")]
mod bridge {
    /// `(transfer_id, attempt)`; the 128-bit transfer id in two halves.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    struct Key {
        id_hi: u64,
        id_lo: u64,
        attempt: u32,
    }

    /// One KV cache group (`window_tokens` 0: full attention).
    #[derive(Clone, Debug)]
    struct GroupSpec {
        window_tokens: u32,
        layers: Vec<u32>,
    }

    /// A worker's KV layout; codes as in `kvpush.h`.
    #[derive(Clone, Debug)]
    struct LayoutSpec {
        total_layers: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype: u32,
        kv_kind: u32,
        block_tokens: u32,
        num_blocks: u32,
        order: u32,
        placement: u32,
        tp_rank: u16,
        tp_size: u16,
        pp_rank: u16,
        pp_size: u16,
        block_stride: u64,
        groups: Vec<GroupSpec>,
        region_bases: Vec<u64>,
        region_lens: Vec<u64>,
    }

    /// An engine's configuration; empty strings take the default.
    #[derive(Clone, Debug)]
    struct EngineSpec {
        engine_id: String,
        mode: u32,
        device: String,
        writers: u32,
        lease_ms: u64,
        timeout_ms: u64,
        agent_name: String,
        nixl_backend: String,
        listen: String,
        secret: String,
    }

    /// One finished result.
    #[derive(Clone, Debug)]
    struct Completion {
        key: Key,
        outcome: u32,
        release: u32,
        message: String,
    }

    #[namespace = ""]
    unsafe extern "C++" {
        include!("kvpush.h");

        /// `kvpush_stats` of the C ABI, passed by value: the same struct in C, C++ and Rust.
        type kvpush_stats = crate::ffi::capi::kvpush_stats;
    }

    extern "Rust" {
        type RustHub;
        type RustEngine;

        fn new_hub() -> Box<RustHub>;
        /// # Safety
        ///
        /// The regions of `layout` obey `kvpush::Engine`'s memory contract (docs/ffi.md).
        unsafe fn new_loopback_engine(spec: &EngineSpec, layout: &LayoutSpec, hub: &RustHub)
            -> Result<Box<RustEngine>>;
        /// # Safety
        ///
        /// As `new_loopback_engine`.
        unsafe fn new_nixl_engine(spec: &EngineSpec, layout: &LayoutSpec) -> Result<Box<RustEngine>>;
        /// The status code of the last error this thread saw from the bridge (then reset to 0).
        fn take_error_code() -> i32;

        fn handshake(self: &RustEngine) -> Result<Vec<u8>>;
        fn add_peer(self: &RustEngine, handshake: &[u8]) -> Result<()>;
        fn connect(self: &RustEngine, other: &RustEngine) -> Result<()>;
        fn connect_addr(self: &RustEngine, addr: &str) -> Result<()>;
        fn listen_port(self: &RustEngine) -> Result<u16>;
        /// `consumer`: the decode engine the router chose, "" for the first engine to register.
        fn request_finished(
            self: &RustEngine,
            key: &Key,
            block_ids: &[u32],
            group_lens: &[usize],
            num_tokens: u64,
            consumer: &str,
        ) -> Result<()>;
        fn layers_ready(
            self: &RustEngine,
            key: &Key,
            block_ids: &[u32],
            group_lens: &[usize],
            num_tokens: u64,
            first_layer: u32,
            end_layer: u32,
        ) -> Result<()>;
        fn blocks_allocated(
            self: &RustEngine,
            key: &Key,
            producer: &str,
            block_ids: &[u32],
            group_lens: &[usize],
            num_tokens: u64,
        ) -> Result<()>;
        fn start_pull(
            self: &RustEngine,
            key: &Key,
            producer: &str,
            remote_ids: &[u32],
            remote_lens: &[usize],
            local_ids: &[u32],
            local_lens: &[usize],
            num_tokens: u64,
        ) -> Result<()>;
        fn abort(self: &RustEngine, key: &Key) -> Result<()>;
        fn poll(self: &RustEngine, out: &mut Vec<Completion>, max: usize) -> Result<usize>;
        fn stats(self: &RustEngine) -> Result<kvpush_stats>;
        fn stats_json(self: &RustEngine) -> Result<String>;
    }
}
