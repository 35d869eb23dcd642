//! The one rule for a test that needs something the machine may lack (CONTRIBUTING.md, "Tests that
//! can fail"): under `CI=true` the only allowed skip is "no GPU on this machine"; a missing library,
//! compiler or tool fails the test. Outside CI such a test may skip, and says so loudly.
//!
//! ```no_run
//! # fn nixl_available() -> bool { true }
//! fn writes_over_nixl() {
//!     if !kvpush_testkit::require("NIXL (libnixl_capi.so: `. scripts/nixl.sh`)", nixl_available()) {
//!         return;
//!     }
//!     // ...
//! }
//! ```
//!
//! Tests call [`require`] (or [`require_gpu`] for the one allowed exception) instead of reading `CI`
//! themselves, so the rule cannot drift between test files.

use std::fmt::Display;

/// Whether this run is CI: `CI` is `true` or `1` (`.ci/run` exports `CI=true`).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true") || v == "1")
}

/// `true` when `available`; otherwise panics under CI, and elsewhere prints a loud SKIP naming the
/// running test and `what` is missing, and returns `false` (the caller returns at once).
#[track_caller]
pub fn require(what: impl Display, available: bool) -> bool {
    if available {
        return true;
    }
    if in_ci() {
        panic!("{} needs {what}, which is missing (CI=true: a missing dependency fails the test)", test_name());
    }
    eprintln!("\n*** SKIPPED {} (not under CI): {what} is missing ***\n", test_name());
    false
}

/// Like [`require`] for a GPU (a CUDA driver and a device), the one thing CI machines may lack: never
/// panics, prints a loud SKIP when `available` is false.
pub fn require_gpu(what: impl Display, available: bool) -> bool {
    if !available {
        eprintln!("\n*** SKIPPED {} (no GPU on this machine): {what} ***\n", test_name());
    }
    available
}

/// libtest names each test's thread after the test; a bench's `main` has the thread name `main`.
fn test_name() -> String {
    std::thread::current().name().unwrap_or("this test").to_owned()
}
