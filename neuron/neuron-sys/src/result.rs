//! One `unsafe fn` per libnrt call kvpush makes, returning `Result`.
//!
//! Each function resolves its symbol from the [`Lib`] (a missing optional one is
//! [`Error::NotSupported`], never a panic), calls it, and turns a status other than `NRT_SUCCESS` into
//! [`Error::Status`] with the call's name and the arguments that matter. They stay `unsafe` where
//! libnrt's contract cannot be checked here (a tensor handle must be live, a runtime initialised);
//! [`crate::safe`] builds RAII types on top. Read [`tensor_allocate`] first.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::fd::{FromRawFd, OwnedFd};
use std::ptr::NonNull;

use crate::sys::{self, nrt_tensor_t};
use crate::{Error, Lib, Status, Version};

/// The function `$field` of `$lib`, or the right error when the library lacks it.
macro_rules! func {
    ($lib:expr, $field:ident) => {
        match &$lib.api().$field {
            Ok(f) => *f,
            Err(_) => return Err($lib.not_supported(stringify!($field))),
        }
    };
}

fn check(call: &'static str, status: sys::NRT_STATUS, detail: impl FnOnce() -> String) -> Result<(), Error> {
    if status == sys::NRT_SUCCESS {
        Ok(())
    } else {
        Err(Error::Status { call, status: Status(status), detail: detail() })
    }
}

/// Starts the runtime (`nrt_init`).
///
/// # Safety
///
/// 1. The runtime of `lib` must not be initialised already in this process (by us or by a
///    framework), and nothing may close it while anything started after this call still uses it.
pub unsafe fn init(
    lib: &Lib,
    framework: sys::nrt_framework_type_t,
    fw_version: &CStr,
    fal_version: &CStr,
) -> Result<(), Error> {
    let f = func!(lib, nrt_init);
    // SAFETY: both strings are NUL-terminated and outlive the call; the caller upholds the
    // once-per-process precondition.
    let status = unsafe { f(framework, fw_version.as_ptr(), fal_version.as_ptr()) };
    check("nrt_init", status, || format!("framework type {framework}"))
}

/// Closes the runtime (`nrt_close`): every device and tensor of it becomes unusable.
///
/// # Safety
///
/// 1. The caller initialised the runtime (with [`init`]) and no tensor of it is used afterwards.
pub unsafe fn close(lib: &Lib) -> Result<(), Error> {
    let f = func!(lib, nrt_close);
    // SAFETY: the caller owns the runtime and nothing uses it any more.
    unsafe { f() };
    Ok(())
}

/// NeuronCores of the instance (`nrt_get_total_nc_count`).
///
/// # Safety
///
/// None beyond `lib` being libnrt: the call is documented as valid at any time, before `nrt_init`
/// too. It is `unsafe` only for uniformity; [`Lib::total_nc_count`] is the safe form.
pub unsafe fn total_nc_count(lib: &Lib) -> Result<u32, Error> {
    let f = func!(lib, nrt_get_total_nc_count);
    let mut n = 0u32;
    // SAFETY: `n` is a valid out-parameter for the duration of the call.
    check("nrt_get_total_nc_count", unsafe { f(&mut n) }, String::new)?;
    Ok(n)
}

/// NeuronCores visible to this process (`nrt_get_visible_nc_count`).
///
/// # Safety
///
/// As [`total_nc_count`].
pub unsafe fn visible_nc_count(lib: &Lib) -> Result<u32, Error> {
    let f = func!(lib, nrt_get_visible_nc_count);
    let mut n = 0u32;
    // SAFETY: `n` is a valid out-parameter for the duration of the call.
    check("nrt_get_visible_nc_count", unsafe { f(&mut n) }, String::new)?;
    Ok(n)
}

/// The library's version (`nrt_get_version`, optional).
///
/// # Safety
///
/// As [`total_nc_count`].
pub unsafe fn version(lib: &Lib) -> Result<Version, Error> {
    let f = func!(lib, nrt_get_version);
    let mut v = sys::nrt_version_t::default();
    // SAFETY: `v` is a valid, zeroed out-struct of exactly the size passed.
    check("nrt_get_version", unsafe { f(&mut v, std::mem::size_of::<sys::nrt_version_t>()) }, String::new)?;
    Ok(Version {
        major: v.rt_major,
        minor: v.rt_minor,
        patch: v.rt_patch,
        maintenance: v.rt_maintenance,
        detail: c_chars_to_string(&v.rt_detail),
        git_hash: c_chars_to_string(&v.git_hash),
    })
}

/// Allocates a tensor of `size` bytes (`nrt_tensor_allocate`); `vnc` is the NeuronCore for device
/// placement and -1 for host placement. The tensor must be freed with [`tensor_free`].
///
/// # Safety
///
/// 1. For device placement the runtime must be initialised (libnrt answers `NRT_UNINITIALIZED`
///    otherwise, which is returned as an error, but the runtime must not be closed concurrently).
pub unsafe fn tensor_allocate(
    lib: &Lib,
    placement: sys::nrt_tensor_placement_t,
    vnc: c_int,
    size: usize,
    name: &CStr,
) -> Result<NonNull<nrt_tensor_t>, Error> {
    let f = func!(lib, nrt_tensor_allocate);
    let mut t: *mut nrt_tensor_t = std::ptr::null_mut();
    let detail = || format!("placement {placement}, core {vnc}, {size} bytes, name {name:?}");
    // SAFETY: `name` is NUL-terminated and outlives the call, `t` is a valid out-parameter; the
    // caller upholds the runtime's state.
    check("nrt_tensor_allocate", unsafe { f(placement, vnc, size, name.as_ptr(), &mut t) }, detail)?;
    NonNull::new(t).ok_or_else(|| Error::BadResult {
        call: "nrt_tensor_allocate",
        what: "a null tensor",
        detail: detail(),
    })
}

/// Frees a tensor (`nrt_tensor_free`).
///
/// # Safety
///
/// 1. `tensor` came from [`tensor_allocate`] of the same `lib`, has not been freed, and is not
///    used by anyone after this call (libnrt frees its memory).
pub unsafe fn tensor_free(lib: &Lib, tensor: NonNull<nrt_tensor_t>) -> Result<(), Error> {
    let f = func!(lib, nrt_tensor_free);
    let mut t = tensor.as_ptr();
    // SAFETY: `t` is a live tensor the caller gives up; libnrt frees it and nulls `t`.
    unsafe { f(&mut t) };
    Ok(())
}

/// Copies `out.len()` bytes at `offset` of the tensor into `out` (`nrt_tensor_read`).
///
/// # Safety
///
/// 1. `tensor` is a live tensor of `lib` (libnrt checks the range against its size).
pub unsafe fn tensor_read(
    lib: &Lib,
    tensor: NonNull<nrt_tensor_t>,
    offset: usize,
    out: &mut [u8],
) -> Result<(), Error> {
    let f = func!(lib, nrt_tensor_read);
    // SAFETY: `out` is valid for writes of its length; the caller vouches for the tensor.
    let status = unsafe { f(tensor.as_ptr(), out.as_mut_ptr().cast::<c_void>(), offset, out.len()) };
    check("nrt_tensor_read", status, || format!("{} bytes at offset {offset}", out.len()))
}

/// Copies `data` to `offset` of the tensor (`nrt_tensor_write`).
///
/// # Safety
///
/// 1. `tensor` is a live tensor of `lib` that may be written (libnrt checks the range).
pub unsafe fn tensor_write(lib: &Lib, tensor: NonNull<nrt_tensor_t>, offset: usize, data: &[u8]) -> Result<(), Error> {
    let f = func!(lib, nrt_tensor_write);
    // SAFETY: `data` is valid for reads of its length; the caller vouches for the tensor.
    let status = unsafe { f(tensor.as_ptr(), data.as_ptr().cast::<c_void>(), offset, data.len()) };
    check("nrt_tensor_write", status, || format!("{} bytes at offset {offset}", data.len()))
}

/// Sets `len` bytes at `offset` of the tensor to `value` (`nrt_tensor_memset`, optional).
///
/// # Safety
///
/// 1. `tensor` is a live tensor of `lib` that may be written.
pub unsafe fn tensor_memset(
    lib: &Lib,
    tensor: NonNull<nrt_tensor_t>,
    offset: u64,
    value: u8,
    len: usize,
) -> Result<(), Error> {
    let f = func!(lib, nrt_tensor_memset);
    // SAFETY: the caller vouches for the tensor; libnrt checks the range.
    let status = unsafe { f(tensor.as_ptr(), offset, c_int::from(value), len) };
    check("nrt_tensor_memset", status, || format!("{len} bytes at offset {offset}"))
}

/// The tensor's size in bytes (`nrt_tensor_get_size`).
///
/// # Safety
///
/// 1. `tensor` is a live tensor of `lib`.
pub unsafe fn tensor_size(lib: &Lib, tensor: NonNull<nrt_tensor_t>) -> Result<usize, Error> {
    let f = func!(lib, nrt_tensor_get_size);
    // SAFETY: the caller vouches for the tensor.
    Ok(unsafe { f(tensor.as_ptr()) })
}

/// The virtual address of the tensor's memory in this process (`nrt_tensor_get_va`), or `None`
/// where libnrt has not mapped it (device memory without `NEURON_RT_MAP_HBM=1`).
///
/// # Safety
///
/// 1. `tensor` is a live tensor of `lib`.
pub unsafe fn tensor_va(lib: &Lib, tensor: NonNull<nrt_tensor_t>) -> Result<Option<NonNull<c_void>>, Error> {
    let f = func!(lib, nrt_tensor_get_va);
    // SAFETY: the caller vouches for the tensor.
    Ok(NonNull::new(unsafe { f(tensor.as_ptr()) }))
}

/// The dma-buf file descriptor of the device range `[va, va + size)` (`nrt_get_dmabuf_fd`,
/// optional), as libfabric's EFA provider uses for peer-direct registration. Closed on drop.
///
/// # Safety
///
/// 1. The runtime of `lib` is initialised and the range belongs to a live device allocation (libnrt
///    checks this and fails otherwise, but the allocation must not be freed during the call).
pub unsafe fn dmabuf_fd(lib: &Lib, va: u64, size: u64) -> Result<OwnedFd, Error> {
    let f = func!(lib, nrt_get_dmabuf_fd);
    let mut fd: c_int = -1;
    let detail = || format!("range {va:#x}+{size}");
    // SAFETY: `fd` is a valid out-parameter; the caller vouches for the range.
    check("nrt_get_dmabuf_fd", unsafe { f(va, size, &mut fd) }, detail)?;
    if fd < 0 {
        return Err(Error::BadResult { call: "nrt_get_dmabuf_fd", what: "a negative fd", detail: detail() });
    }
    // SAFETY: libnrt returned a new descriptor that the caller now owns (dma-buf fds are installed
    // for the caller, who closes them).
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The PCI address (BDF) of the EFA device attached to the Neuron device holding `va`
/// (`nrt_get_attached_efa_bdf`, optional).
///
/// # Safety
///
/// 1. The runtime of `lib` is initialised and `va` lies in a live device allocation.
pub unsafe fn attached_efa_bdf(lib: &Lib, va: u64) -> Result<String, Error> {
    let f = func!(lib, nrt_get_attached_efa_bdf);
    let mut buf = [0 as c_char; 256];
    let mut len = buf.len();
    // SAFETY: `buf` is valid for `len` bytes, `len` is a valid in/out parameter; `va` is only used as
    // an address to look up, and the caller vouches for it.
    let status = unsafe { f(va as *const c_void, buf.as_mut_ptr(), &mut len) };
    check("nrt_get_attached_efa_bdf", status, || format!("address {va:#x}"))?;
    if len >= buf.len() {
        return Err(Error::BadResult {
            call: "nrt_get_attached_efa_bdf",
            what: "a length past its buffer",
            detail: format!("{len} for a buffer of {}", buf.len()),
        });
    }
    Ok(c_chars_to_string(&buf[..len]))
}

/// The text of a C character array up to its first NUL (or its end), lossily decoded.
fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
