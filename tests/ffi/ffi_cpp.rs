//! The C++ API from C++: compiles `cpp/tests/cpp_api_test.cc` with the system C++ compiler (`c++`,
//! or `$CXX`, `-std=c++17 -Wall -Wextra -Werror`) against `libkvpush_cxx.a` (the cxx bridge and the
//! `kvpush::Engine` shims that build.rs compiles) and the `libkvpush.so` built for this test run,
//! and runs it: push transfers between a producer and a consumer in one process with every byte
//! verified, an abort, and Rust errors arriving as `kvpush::Error` exceptions with their status and
//! message; then the same push over real NIXL and the TCP side channel; and a push between engines
//! whose regions are framework memory of the fake libnrt (tests/neuron_fake), every byte verified.

use std::path::PathBuf;
use std::sync::OnceLock;

use crate::ffi_support;
use ffi_support::{build, build_neuron, cdylib, root, run_nixl_ok, run_ok, stage};

/// The test program, built once per test binary.
fn program() -> &'static PathBuf {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let dir = stage("ffi-cpp", &[cdylib(), PathBuf::from(env!("KVPUSH_CXX_LIB"))]);
        build(&dir, "cpp_api_test", &root().join("cpp/tests/cpp_api_test.cc"), &["libkvpush_cxx.a"])
    })
}

#[test]
fn loopback_push_abort_and_exceptions() {
    let out = run_ok(program(), &["loopback"], "all C++ API checks passed");
    assert!(out.contains("push ok: 4 requests"), "{out}");
    assert!(out.contains("error ok: bad layout: status 4"), "{out}");
    assert!(out.contains("error ok: incompatible peer: status 7"), "{out}");
}

#[test]
fn nixl_push_through_the_side_channel() {
    let Some(out) = run_nixl_ok(program, "all C++ NIXL checks passed") else { return };
    assert!(out.contains("push ok: 3 requests"), "{out}");
}

/// Framework memory through the C++ API: the program starts the (fake) Neuron runtime and allocates
/// every KV region as a device tensor; kvpush, attached, accepts them by address and moves every
/// byte, and refuses host memory as Neuron memory.
#[test]
fn neuron_framework_memory_push() {
    let files = [cdylib(), PathBuf::from(env!("KVPUSH_CXX_LIB"))];
    let (exe, lib) = build_neuron("ffi-cpp-neuron", "cpp/tests/cpp_api_test.cc", &files, &["libkvpush_cxx.a"]);
    let out = run_ok(&exe, &["neuron", lib.to_str().unwrap()], "all C++ Neuron checks passed");
    assert!(out.contains("push ok: 4 requests"), "{out}");
    assert!(out.contains("error ok: host memory on device neuron: status 5"), "{out}");
}
