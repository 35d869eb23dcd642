//! Builds the fake libnrt (`tests/neuron_fake/fake_nrt.c`) with the C compiler (`$CC`, else `cc`):
//! the Neuron runtime of every test without Trainium (tests/neuron.rs, the C and C++ API tests in
//! tests/ffi). Read the fake's header comment for its behaviour, knobs and counters.
//!
//! The built library has no SONAME, so it is only ever found by path (`KVPUSH_LIBNRT`) and never
//! mistaken for the real `libnrt.so.1`. A missing or failing compiler panics: a test that needs the
//! fake fails, never skips. Never used by the library itself.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Which build of the fake.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    /// Every symbol.
    Full,
    /// Without `nrt_get_dmabuf_fd` (optional).
    NoDmabuf,
    /// Without `nrt_tensor_free` (required).
    NoTensorFree,
}

impl Variant {
    /// A short name, used in file names.
    pub fn tag(self) -> &'static str {
        match self {
            Variant::Full => "full",
            Variant::NoDmabuf => "no-dmabuf",
            Variant::NoTensorFree => "no-tensor-free",
        }
    }

    fn define(self) -> Option<&'static str> {
        match self {
            Variant::Full => None,
            Variant::NoDmabuf => Some("-DFAKE_NRT_NO_DMABUF"),
            Variant::NoTensorFree => Some("-DFAKE_NRT_NO_TENSOR_FREE"),
        }
    }
}

/// The fake's sources: `fake_nrt.c` and `include/nrt/*.h`.
pub fn source_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/neuron_fake")
}

/// Compiles `variant` into `dir/libfake_nrt-<tag>.so` and returns that path. Written under a name
/// unique to this call and renamed into place, so threads and processes building into one directory
/// never load a half-written file.
pub fn build(dir: &Path, variant: Variant) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    let root = source_dir();
    let out = dir.join(format!("libfake_nrt-{}.so", variant.tag()));
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!("libfake_nrt-{}.so.{}-{n}", variant.tag(), std::process::id()));
    let cc = std::env::var("CC").ok().filter(|s| !s.is_empty()).unwrap_or_else(|| "cc".into());
    let mut cmd = Command::new(&cc);
    cmd.args(["-shared", "-fPIC", "-O1", "-std=c11", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(root.join("include"))
        .args(variant.define())
        .arg(root.join("fake_nrt.c"))
        .arg("-o")
        .arg(&tmp)
        .arg("-lpthread");
    let res = cmd.output().unwrap_or_else(|e| panic!("cannot run the C compiler {cc:?} (set CC): {e}"));
    assert!(res.status.success(), "building the fake libnrt failed: {cmd:?}\n{}", String::from_utf8_lossy(&res.stderr));
    std::fs::rename(&tmp, &out).unwrap_or_else(|e| panic!("rename {} to {}: {e}", tmp.display(), out.display()));
    out
}
