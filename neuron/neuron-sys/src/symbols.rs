//! The libnrt symbols kvpush binds, split into those it needs and those it probes. The build
//! script includes this file too (`#[path]`), so bindgen's allowlist and the loader's checks are
//! one list.

/// Symbols kvpush cannot work without: opening a library that lacks one fails.
pub const REQUIRED: &[&str] = &[
    "nrt_init",
    "nrt_close",
    "nrt_get_total_nc_count",
    "nrt_get_visible_nc_count",
    "nrt_tensor_allocate",
    "nrt_tensor_free",
    "nrt_tensor_read",
    "nrt_tensor_write",
    "nrt_tensor_get_size",
    "nrt_tensor_get_va",
];

/// Symbols probed when the library is opened; calls through them fail with
/// [`Error::NotSupported`](crate::Error::NotSupported) where the library lacks them.
pub const OPTIONAL: &[&str] =
    &["nrt_tensor_memset", "nrt_get_dmabuf_fd", "nrt_get_attached_efa_bdf", "nrt_get_version"];
