//! Build script of kvpush. Its one job will be the cxx bridge and the C++ shims in `cpp/` (they
//! arrive with the C/C++ embedding work); until then it only tells cargo it has no inputs, so it
//! never reruns.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
}
