//! The C and C++ APIs from C and C++ programs built against the library of this test run, and their
//! structs against the public header. One test binary (tests/README.md maps features to tests).

mod ffi_c;
mod ffi_cpp;
mod ffi_support;
