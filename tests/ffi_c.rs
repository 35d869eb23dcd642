//! The C API from C: compiles `cpp/tests/c_api_test.c` with the system C compiler (`cc`, or `$CC`,
//! with `-Wall -Wextra -Werror -pedantic`) against the `libkvpush.so` built for this test run, and
//! runs it: push and pull transfers between a producer and a consumer in one process over the
//! loopback transport with every byte verified, aborts, and every error path the header promises
//! (bad layouts, null and non-UTF-8 arguments, unknown handles, incompatible peers); the same push
//! over real NIXL and the TCP side channel; and a check that the C structs have Rust's layout.

use std::mem::{offset_of, size_of};
use std::path::PathBuf;
use std::sync::OnceLock;

use kvpush::ffi::capi::{
    kvpush_block_list, kvpush_completion, kvpush_engine_config, kvpush_key, kvpush_kv_group, kvpush_layout,
    kvpush_stats,
};

mod ffi_support;
use ffi_support::{build, cdylib, nixl_or_skip, root, run_ok, stage};

/// The test program, built once per test binary.
fn program() -> &'static PathBuf {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let dir = stage("ffi-c", &[cdylib()]);
        build(&dir, "c_api_test", &root().join("cpp/tests/c_api_test.c"), &[])
    })
}

#[test]
fn loopback_push_pull_aborts_and_error_paths() {
    let out = run_ok(program(), &["loopback"], "all C API checks passed");
    assert!(out.contains("push ok: 6 requests"), "{out}");
    assert!(out.contains("pull ok:"), "{out}");
    assert_eq!(out.matches("error ok: KVPUSH_ERR_LAYOUT").count(), 4, "{out}");
    assert!(out.contains("error ok: KVPUSH_ERR_INCOMPATIBLE"), "{out}");
}

#[test]
fn nixl_push_through_the_side_channel() {
    if !nixl_or_skip() {
        return;
    }
    let out = run_ok(program(), &["nixl"], "all NIXL checks passed");
    assert!(out.contains("push ok: 4 requests"), "{out}");
}

#[test]
fn bench_mode_measures_every_request() {
    // A short run of the engine-thread bench (docs/benchmarks.md has the full one): each request
    // must finish (the program checks every outcome) and every figure must be printed.
    let out = run_ok(program(), &["bench", "50"], "bench done");
    for line in ["producer (request_finished + polls)", "consumer (blocks_allocated + polls)", "empty poll"] {
        assert!(out.contains(line), "{line} missing: {out}");
    }
}

#[test]
fn c_structs_have_the_rust_layout() {
    let out = run_ok(program(), &["abi"], "kvpush_stats ");
    let rust: Vec<(&str, usize, usize)> = vec![
        ("kvpush_key", size_of::<kvpush_key>(), offset_of!(kvpush_key, attempt)),
        ("kvpush_block_list", size_of::<kvpush_block_list>(), offset_of!(kvpush_block_list, len)),
        ("kvpush_kv_group", size_of::<kvpush_kv_group>(), offset_of!(kvpush_kv_group, num_layers)),
        ("kvpush_layout", size_of::<kvpush_layout>(), offset_of!(kvpush_layout, block_stride)),
        ("kvpush_layout.pp_size", 2, offset_of!(kvpush_layout, pp_size)),
        ("kvpush_layout.region_lens", size_of::<usize>(), offset_of!(kvpush_layout, region_lens)),
        ("kvpush_engine_config", size_of::<kvpush_engine_config>(), offset_of!(kvpush_engine_config, lease_ms)),
        ("kvpush_engine_config.secret", size_of::<usize>(), offset_of!(kvpush_engine_config, secret)),
        ("kvpush_completion", size_of::<kvpush_completion>(), offset_of!(kvpush_completion, message)),
        ("kvpush_stats", size_of::<kvpush_stats>(), offset_of!(kvpush_stats, receive)),
    ];
    let c: Vec<(String, usize, usize)> = out
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0].to_owned(), f[1].parse().expect("size"), f[2].parse().expect("offset"))
        })
        .collect();
    assert_eq!(c.len(), rust.len(), "{out}");
    for ((cn, cs, co), (rn, rs, ro)) in c.iter().zip(&rust) {
        assert_eq!((cn.as_str(), *cs, *co), (*rn, *rs, *ro), "C and Rust disagree on {rn} (size, offset)");
    }
}
