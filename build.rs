//! Build script of kvpush: builds the cxx bridge and the C++ shims in `cpp/` — nothing else.
//!
//! cxx-build generates the C++ half of `src/ffi/cxx.rs` and compiles it, the shim classes of
//! `cpp/src/kvpush.cc` (`kvpush::Engine`, `kvpush::Hub`) and cxx's C++ runtime (`cxx.cc`) into one
//! static library, `libkvpush_cxx.a`. The Rust crate does not link it (no Rust code calls into C++);
//! a C++ program links it together with `libkvpush.so`, which holds the Rust side of the bridge.
//! The archive's path reaches the crate's tests as `KVPUSH_CXX_LIB`, and a copy is put next to
//! `libkvpush.so` (`target/<profile>/libkvpush_cxx.a`) for C++ builds outside cargo.
//!
//! It reruns only when the bridge file, `cpp/src` or `cpp/include` change.

use std::env;
use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/ffi/cxx.rs");
    println!("cargo:rerun-if-changed=cpp/src");
    println!("cargo:rerun-if-changed=cpp/include");

    // cxx's own C++ runtime (rust::String, rust::Error, ...), from the cxx crate this build uses:
    // its build script exports the path of its header (`links = "cxxbridge1"`).
    let header = env::var_os("DEP_CXXBRIDGE1_HEADER")
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("DEP_CXXBRIDGE1_HEADER is not set: the cxx crate must be a dependency of kvpush"));
    let runtime = header
        .parent()
        .and_then(Path::parent)
        .map(|dir| dir.join("src").join("cxx.cc"))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| panic!("cxx.cc not found next to the cxx header {}", header.display()));

    cxx_build::bridge("src/ffi/cxx.rs")
        .file("cpp/src/kvpush.cc")
        .file(&runtime)
        .include("cpp/include")
        .std("c++17")
        .cargo_metadata(false)
        .compile("kvpush_cxx");

    let out_dir = PathBuf::from(env::var_os("OUT_DIR").unwrap_or_else(|| panic!("cargo sets OUT_DIR")));
    let archive = out_dir.join("libkvpush_cxx.a");
    println!("cargo:rustc-env=KVPUSH_CXX_LIB={}", archive.display());

    // OUT_DIR is target/<profile>/build/kvpush-<hash>/out: copy the archive to target/<profile>,
    // atomically (another build may read it meanwhile).
    if let Some(profile_dir) = out_dir.ancestors().nth(3) {
        let tmp = profile_dir.join(format!(".libkvpush_cxx.a.{}", std::process::id()));
        let copied =
            std::fs::copy(&archive, &tmp).and_then(|_| std::fs::rename(&tmp, profile_dir.join("libkvpush_cxx.a")));
        if let Err(e) = copied {
            println!("cargo:warning=could not copy libkvpush_cxx.a to {}: {e}", profile_dir.display());
            let _ = std::fs::remove_file(&tmp);
        }
    }
}
