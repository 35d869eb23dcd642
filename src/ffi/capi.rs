//! The C ABI: `extern "C"` functions over opaque handles, declared in `cpp/include/kvpush.h`.
//!
//! Read the header first; this file mirrors it. Every function returns a status code
//! ([`super::status`]) and leaves a message with context in a thread-local buffer that
//! [`kvpush_last_error`] returns. Every body runs inside [`guard`], which catches panics, so no
//! unwinding crosses into C: a caught panic is `KVPUSH_ERR_PANIC`. (The four getters that return a
//! value instead — version, ABI version, last error, status name — have no path that can panic.)
//!
//! Handles are not pointers to Rust objects: a `kvpush_engine *` or `kvpush_hub *` is a number that
//! names a slot of a fixed table and that slot's generation. It is checked before every use, so a
//! null, destroyed or made-up handle is answered with `KVPUSH_ERR_UNKNOWN_HANDLE` instead of undefined
//! behaviour, and a destroyed handle never becomes valid again. A call holds its slot's read lock for
//! its duration (one uncontended atomic, one cache line); [`kvpush_engine_destroy`] takes the write
//! lock, so it waits for calls in progress, then stops the engine: memory may be freed as soon as it
//! returns.
//!
//! Raw pointers from C (arrays, strings, out-parameters) are checked for null, alignment, length
//! and UTF-8 before they become Rust values; what cannot be checked (that they point to live memory
//! of the stated size) is each function's `# Safety` contract.

#![allow(non_camel_case_types)]

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::{self, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

use serde::Serialize;

use crate::embed::{
    key_of, key_parts, panic_message, status, EngineSpec, FfiEngine, FfiError, GroupSpec, Hub, LayoutSpec,
    TransportSpec,
};
use crate::engine::stats::{Counters, Failures, LatencySummary, StatsSnapshot};
use crate::proto::Key;

/// Version of this ABI (`KVPUSH_ABI_VERSION` in the header); grows when a struct or signature changes.
pub const ABI_VERSION: u32 = 1;
/// Bytes of [`kvpush_completion::message`], NUL included.
pub const MESSAGE_LEN: usize = 256;

/// Opaque handle of an engine worker.
#[repr(C)]
#[derive(Debug)]
pub struct kvpush_engine {
    _private: [u8; 0],
}

/// Opaque handle of an in-process hub (loopback transport and control link).
#[repr(C)]
#[derive(Debug)]
pub struct kvpush_hub {
    _private: [u8; 0],
}

/// `(transfer_id, attempt)`; the transfer id is 128 bits, split in two halves.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvpush_key {
    /// High 64 bits of the transfer id.
    pub id_hi: u64,
    /// Low 64 bits of the transfer id.
    pub id_lo: u64,
    /// Attempt number.
    pub attempt: u32,
}

impl kvpush_key {
    fn key(self) -> Key {
        key_of(self.id_hi, self.id_lo, self.attempt)
    }
}

/// Block ids of one KV group.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvpush_block_list {
    /// `len` block ids (may be null when `len` is 0).
    pub ids: *const u32,
    /// Number of ids.
    pub len: usize,
}

/// One KV cache group of a layout.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvpush_kv_group {
    /// 0: full attention; N: sliding window of N tokens.
    pub window_tokens: u32,
    /// Global layer indices, strictly increasing.
    pub layers: *const u32,
    /// Number of layers.
    pub num_layers: usize,
}

crate::embed::layout_struct! {
    /// A worker's KV layout. See [`LayoutSpec`] for each field. `Default` is
    /// [`kvpush_layout_init`]'s: everything zero, `tp_size` and `pp_size` 1.
    #[repr(C)]
    #[derive(Clone, Copy, Debug)]
    pub struct kvpush_layout {
        /// Tensor-parallel rank.
        pub tp_rank: u16 = 0,
        /// Tensor-parallel size.
        pub tp_size: u16 = 1,
        /// Pipeline-parallel rank.
        pub pp_rank: u16 = 0,
        /// Pipeline-parallel size.
        pub pp_size: u16 = 1,
        /// Bytes from one block to the next (0: packed).
        pub block_stride: u64 = 0,
        /// KV cache groups (null with 0: one full-attention group with every layer).
        pub groups: *const kvpush_kv_group = std::ptr::null(),
        /// Number of groups.
        pub num_groups: usize = 0,
        /// Region base addresses.
        pub region_bases: *const u64 = std::ptr::null(),
        /// Number of regions.
        pub num_regions: usize = 0,
        /// Bytes at each base (`num_regions` of them), or null: exactly `num_blocks × block_stride`.
        pub region_lens: *const u64 = std::ptr::null(),
    }
}

/// An engine's configuration. Strings are UTF-8, NUL-terminated; null or empty optional strings
/// take the default.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvpush_engine_config {
    /// Engine id (required).
    pub engine_id: *const c_char,
    /// `kvpush_mode`.
    pub mode: u32,
    /// `kvpush_transport`.
    pub transport: u32,
    /// Loopback: the hub (required); NIXL: null.
    pub hub: *mut kvpush_hub,
    /// Device backend (`host`, `mock`, `cuda`, `neuron`, `auto`); null: `KVPUSH_DEVICE` or auto.
    pub device: *const c_char,
    /// Writer threads (0: 1).
    pub writers: u32,
    /// Producer lease in ms (0: 30 s).
    pub lease_ms: u64,
    /// Consumer timeout in ms (0: 120 s).
    pub timeout_ms: u64,
    /// NIXL agent name (null: `"<engine_id>/<tp_rank>.<pp_rank>"`).
    pub agent_name: *const c_char,
    /// NIXL backend plugin (null: `"UCX"`).
    pub nixl_backend: *const c_char,
    /// Side-channel listen address (null: `0.0.0.0:<5600 + tp_rank>`; port 0 picks a free one).
    pub listen: *const c_char,
    /// Side-channel shared secret (null: none).
    pub secret: *const c_char,
}

/// One finished result.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvpush_completion {
    /// The request.
    pub key: kvpush_key,
    /// `kvpush_outcome`.
    pub outcome: u32,
    /// `kvpush_release` (producer outcomes), else 0.
    pub release: u32,
    /// What happened (failure reason, release reason), NUL-terminated, truncated to fit.
    pub message: [c_char; MESSAGE_LEN],
}

/// Counters of an engine: [`Counters`] itself, `#[repr(C)]` and all `u64` (`kvpush_counters`).
pub type kvpush_counters = Counters;

/// Failures by kind: [`Failures`] itself, `#[repr(C)]` and all `u64` (`kvpush_failures`).
pub type kvpush_failures = Failures;

/// Percentiles of a latency histogram (µs). `Serialize` names its fields for the ABI test
/// (`tests/ffi/ffi_c.rs`), as for [`Counters`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct kvpush_latency {
    /// Values recorded.
    pub count: u64,
    /// Median.
    pub p50_us: u64,
    /// 90th percentile.
    pub p90_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// Largest.
    pub max_us: u64,
}

impl From<LatencySummary> for kvpush_latency {
    fn from(l: LatencySummary) -> Self {
        Self { count: l.count, p50_us: l.p50_us, p90_us: l.p90_us, p99_us: l.p99_us, max_us: l.max_us }
    }
}

/// Counters, failures and latencies of an engine (see `crate::engine::stats`). C++ sees it as
/// `kvpush::Stats`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvpush_stats {
    /// Monotonic counters.
    pub counters: kvpush_counters,
    /// Failures by kind.
    pub failures: kvpush_failures,
    /// Producer: registration waiting for prefill.
    pub wait_registration_first: kvpush_latency,
    /// Producer: finished blocks waiting for the registration.
    pub wait_blocks_first: kvpush_latency,
    /// Time to post one transfer.
    pub post: kvpush_latency,
    /// Post to transfer done.
    pub transfer: kvpush_latency,
    /// Consumer: registration to every part received.
    pub receive: kvpush_latency,
}

impl From<StatsSnapshot> for kvpush_stats {
    fn from(s: StatsSnapshot) -> Self {
        Self {
            counters: s.counters,
            failures: s.failures,
            wait_registration_first: s.wait_registration_first.into(),
            wait_blocks_first: s.wait_blocks_first.into(),
            post: s.post.into(),
            transfer: s.transfer.into(),
            receive: s.receive.into(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Errors and the panic guard.

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(msg: String) {
    let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    // `try_with`: a call from a thread whose locals are being destroyed loses its message, never panics.
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = c);
}

/// Empties the message without allocating when it is empty already (the hot path).
fn clear_last_error() {
    let _ = LAST_ERROR.try_with(|e| {
        if !e.borrow().as_bytes().is_empty() {
            *e.borrow_mut() = CString::default();
        }
    });
}

/// Runs `f` for the C function `call`: catches panics, records the error message with the call's
/// name, returns the status code.
fn guard(call: &'static str, f: impl FnOnce() -> Result<(), FfiError>) -> c_int {
    let result = panic::catch_unwind(AssertUnwindSafe(f))
        .unwrap_or_else(|payload| Err(FfiError::Panic(panic_message(payload.as_ref()))));
    match result {
        Ok(()) => {
            clear_last_error();
            status::OK
        }
        Err(e) => {
            set_last_error(format!("{call}: {e}"));
            e.code()
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Handles.

/// What a slot holds.
enum Item {
    Hub(Arc<Hub>),
    Engine(FfiEngine),
}

impl Item {
    fn kind(&self) -> usize {
        match self {
            Item::Engine(_) => KIND_ENGINE,
            Item::Hub(_) => KIND_HUB,
        }
    }
}

/// One slot of the handle table: its generation (bumped when its handle is destroyed) and item.
/// Aligned to a cache line so a call touches one line of the table.
#[repr(align(64))]
#[derive(Default)]
struct Slot {
    state: RwLock<SlotState>,
}

#[derive(Default)]
struct SlotState {
    generation: usize,
    item: Option<Item>,
}

/// Most handles alive at once (engines and hubs together).
const MAX_HANDLES: usize = 1024;
const KIND_ENGINE: usize = 1;
const KIND_HUB: usize = 2;
const INDEX_SHIFT: u32 = 2;
const GENERATION_SHIFT: u32 = 16;

/// The handle table. A handle is `generation << 16 | index << 2 | kind`: never 0, never a valid
/// pointer by accident, and never valid again once destroyed (the slot's generation moves on).
struct Table {
    slots: Box<[Slot]>,
    free: Mutex<Vec<usize>>,
}

fn table() -> &'static Table {
    static TABLE: OnceLock<Table> = OnceLock::new();
    TABLE.get_or_init(|| Table {
        slots: (0..MAX_HANDLES).map(|_| Slot::default()).collect(),
        free: Mutex::new((0..MAX_HANDLES).rev().collect()),
    })
}

fn read(slot: &Slot) -> RwLockReadGuard<'_, SlotState> {
    slot.state.read().unwrap_or_else(|p| p.into_inner())
}

fn write(slot: &Slot) -> RwLockWriteGuard<'_, SlotState> {
    slot.state.write().unwrap_or_else(|p| p.into_inner())
}

/// Registers `item`; returns its handle.
fn insert(item: Item) -> Result<usize, FfiError> {
    let t = table();
    let index = t.free.lock().unwrap_or_else(|p| p.into_inner()).pop().ok_or_else(|| {
        FfiError::invalid("handles", format!("{MAX_HANDLES} kvpush handles are alive: destroy some first"))
    })?;
    let kind = item.kind();
    let mut st = write(&t.slots[index]);
    st.generation = (st.generation + 1) & (usize::MAX >> GENERATION_SHIFT);
    st.item = Some(item);
    Ok(st.generation << GENERATION_SHIFT | index << INDEX_SHIFT | kind)
}

/// The slot a handle names, if its number is well formed and of `kind`.
fn slot_of(handle: usize, kind: usize) -> Option<(&'static Slot, usize)> {
    let index = (handle >> INDEX_SHIFT) & ((1 << (GENERATION_SHIFT - INDEX_SHIFT)) - 1);
    (handle & ((1 << INDEX_SHIFT) - 1) == kind && index < MAX_HANDLES)
        .then(|| (&table().slots[index], handle >> GENERATION_SHIFT))
}

fn unknown(kind: usize, handle: usize) -> FfiError {
    let name = if kind == KIND_ENGINE { "engine" } else { "hub" };
    FfiError::UnknownHandle { kind: name, handle }
}

/// A live engine, borrowed for one call. While it exists the engine cannot be destroyed:
/// [`kvpush_engine_destroy`] waits for it.
struct EngineRef(RwLockReadGuard<'static, SlotState>);

impl std::ops::Deref for EngineRef {
    type Target = FfiEngine;
    fn deref(&self) -> &FfiEngine {
        match &self.0.item {
            Some(Item::Engine(e)) => e,
            // `engine_of` only builds an EngineRef over a slot holding an engine, and the read
            // guard keeps it there.
            _ => unreachable!("an EngineRef always guards an engine"),
        }
    }
}

fn engine_of(h: *const kvpush_engine) -> Result<EngineRef, FfiError> {
    if h.is_null() {
        return Err(FfiError::Null("engine"));
    }
    let handle = h as usize;
    let (slot, generation) = slot_of(handle, KIND_ENGINE).ok_or_else(|| unknown(KIND_ENGINE, handle))?;
    let st = read(slot);
    if st.generation != generation || !matches!(st.item, Some(Item::Engine(_))) {
        return Err(unknown(KIND_ENGINE, handle));
    }
    Ok(EngineRef(st))
}

fn hub_of(h: *const kvpush_hub) -> Result<Arc<Hub>, FfiError> {
    if h.is_null() {
        return Err(FfiError::Null("hub"));
    }
    let handle = h as usize;
    let (slot, generation) = slot_of(handle, KIND_HUB).ok_or_else(|| unknown(KIND_HUB, handle))?;
    match &*read(slot) {
        SlotState { generation: g, item: Some(Item::Hub(hub)) } if *g == generation => Ok(Arc::clone(hub)),
        _ => Err(unknown(KIND_HUB, handle)),
    }
}

/// Unregisters a handle of `kind` and returns its item. Takes the slot's write lock, so it waits
/// for calls in progress on the handle; later calls find it unknown.
fn remove(handle: usize, kind: usize) -> Result<Item, FfiError> {
    let (slot, generation) = slot_of(handle, kind).ok_or_else(|| unknown(kind, handle))?;
    let item = {
        let mut st = write(slot);
        if st.generation != generation || st.item.as_ref().map(Item::kind) != Some(kind) {
            return Err(unknown(kind, handle));
        }
        st.generation = (st.generation + 1) & (usize::MAX >> GENERATION_SHIFT);
        st.item.take()
    };
    table().free.lock().unwrap_or_else(|p| p.into_inner()).push((handle >> INDEX_SHIFT) & (MAX_HANDLES - 1));
    item.ok_or_else(|| unknown(kind, handle))
}

/// Makes `item` a handle and writes it through `out`: the last step of a `*_create` entry point.
///
/// # Safety
///
/// 1. `out` is null or valid for a write of a pointer.
unsafe fn put_handle<T>(out: *mut *mut T, item: Item) -> Result<(), FfiError> {
    let id = insert(item)?;
    // SAFETY: the caller's contract (1).
    unsafe { put("out", out, id as *mut T) }
}

/// A `*_destroy` entry point: refuses a null `handle` (the argument `arg`), else removes the handle
/// of `kind` and drops what it held.
fn destroy(call: &'static str, arg: &'static str, handle: usize, kind: usize) -> c_int {
    guard(call, || {
        if handle == 0 {
            return Err(FfiError::Null(arg));
        }
        remove(handle, kind).map(drop)
    })
}

// ---------------------------------------------------------------------------------------------
// Checked conversions of C arguments.

/// A slice from a C array; `ptr` may be null only when `len` is 0.
///
/// # Safety
///
/// 1. When `ptr` is not null, it points to `len` initialized values of `T` that stay valid and
///    unmodified for `'a`.
unsafe fn slice<'a, T>(arg: &'static str, ptr: *const T, len: usize) -> Result<&'a [T], FfiError> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(FfiError::Null(arg));
    }
    if !ptr.is_aligned() {
        return Err(FfiError::invalid(arg, format!("pointer {ptr:p} is not aligned for its element type")));
    }
    if len > isize::MAX as usize / std::mem::size_of::<T>().max(1) {
        return Err(FfiError::invalid(arg, format!("length {len} is too large")));
    }
    // SAFETY: non-null, aligned, length bounded; validity for `len` elements is the caller's
    // contract (1).
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// A required UTF-8 string.
///
/// # Safety
///
/// 1. When `ptr` is not null, it points to a NUL-terminated string that stays valid for `'a`.
unsafe fn required_str<'a>(arg: &'static str, ptr: *const c_char) -> Result<&'a str, FfiError> {
    if ptr.is_null() {
        return Err(FfiError::Null(arg));
    }
    // SAFETY: non-null; NUL termination and validity are the caller's contract (1).
    let c = unsafe { CStr::from_ptr(ptr) };
    c.to_str().map_err(|e| FfiError::invalid(arg, format!("is not valid UTF-8: {e}")))
}

/// An optional UTF-8 string: null or empty is `None`.
///
/// # Safety
///
/// As [`required_str`].
unsafe fn optional_str(arg: &'static str, ptr: *const c_char) -> Result<Option<String>, FfiError> {
    if ptr.is_null() {
        return Ok(None);
    }
    // SAFETY: forwarded contract.
    let s = unsafe { required_str(arg, ptr) }?;
    Ok((!s.is_empty()).then(|| s.to_owned()))
}

/// Block lists per KV group.
///
/// # Safety
///
/// 1. `groups` is null or points to `n` lists, each with `ids` valid for `len` elements.
unsafe fn block_lists(
    arg: &'static str,
    groups: *const kvpush_block_list,
    n: usize,
) -> Result<Vec<Vec<u32>>, FfiError> {
    // SAFETY: the caller's contract (1).
    let lists = unsafe { slice(arg, groups, n) }?;
    lists
        .iter()
        // SAFETY: each list's `ids` is valid for `len` elements, the caller's contract (1).
        .map(|l| unsafe { slice(arg, l.ids, l.len) }.map(<[u32]>::to_vec))
        .collect()
}

/// The engine behind `engine` and its block lists `groups` (per KV group), for the producer calls
/// that take one set of blocks.
///
/// # Safety
///
/// 1. `groups` is null or points to `num_groups` lists, each with `ids` valid for `len` elements.
unsafe fn engine_and_blocks(
    engine: *const kvpush_engine,
    groups: *const kvpush_block_list,
    num_groups: usize,
) -> Result<(EngineRef, Vec<Vec<u32>>), FfiError> {
    let e = engine_of(engine)?;
    // SAFETY: the caller's contract (1).
    let blocks = unsafe { block_lists("groups", groups, num_groups) }?;
    Ok((e, blocks))
}

/// # Safety
///
/// 1. Every pointer in `l` is null or valid for the number of elements its count field says.
unsafe fn layout_spec(l: &kvpush_layout) -> Result<LayoutSpec, FfiError> {
    // SAFETY: the caller's contract (1) for `groups`.
    let groups = unsafe { slice("layout.groups", l.groups, l.num_groups) }?;
    let groups = groups
        .iter()
        .map(|g| {
            // SAFETY: the caller's contract (1) for each group's `layers`.
            let layers = unsafe { slice("layout.groups[].layers", g.layers, g.num_layers) }?;
            Ok(GroupSpec { window_tokens: g.window_tokens, layers: layers.to_vec() })
        })
        .collect::<Result<Vec<_>, FfiError>>()?;
    if l.num_regions == 0 {
        return Err(FfiError::invalid("layout.num_regions", "is 0: a layout needs its region base addresses"));
    }
    // SAFETY: the caller's contract (1) for `region_bases`.
    let region_bases = unsafe { slice("layout.region_bases", l.region_bases, l.num_regions) }?.to_vec();
    let region_lens = if l.region_lens.is_null() {
        Vec::new()
    } else {
        // SAFETY: the caller's contract (1): `region_lens` holds `num_regions` lengths.
        unsafe { slice("layout.region_lens", l.region_lens, l.num_regions) }?.to_vec()
    };
    Ok(crate::embed::layout_spec_from_flat!(l, groups: groups, region_bases: region_bases, region_lens: region_lens))
}

/// Writes `value` through a required out-pointer.
///
/// # Safety
///
/// 1. `out` is null or valid for a write of `T`.
unsafe fn put<T>(arg: &'static str, out: *mut T, value: T) -> Result<(), FfiError> {
    if out.is_null() {
        return Err(FfiError::Null(arg));
    }
    if !out.is_aligned() {
        return Err(FfiError::invalid(arg, format!("pointer {out:p} is not aligned")));
    }
    // SAFETY: non-null and aligned; valid for a write by the caller's contract (1).
    unsafe { out.write(value) };
    Ok(())
}

/// Copies `bytes` into a caller's buffer of `cap` bytes and writes the length to `len`; a buffer
/// too small (or null) gets nothing but the needed length.
///
/// # Safety
///
/// 1. `buf` is null or valid for writes of `cap` bytes; `len` is valid for a write.
unsafe fn put_bytes(bytes: &[u8], nul: bool, buf: *mut u8, cap: usize, len: *mut usize) -> Result<(), FfiError> {
    // SAFETY: the caller's contract (1) for `len`.
    unsafe { put("len", len, bytes.len()) }?;
    let needed = bytes.len() + usize::from(nul);
    if buf.is_null() || cap < needed {
        return Err(FfiError::BufferTooSmall { needed, cap: if buf.is_null() { 0 } else { cap } });
    }
    // SAFETY: `buf` holds `cap >= needed` bytes (caller's contract (1)); the source is a Rust slice
    // that cannot overlap the caller's buffer.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, bytes.len());
        if nul {
            buf.add(bytes.len()).write(0);
        }
    }
    Ok(())
}

fn message_bytes(msg: &str) -> [c_char; MESSAGE_LEN] {
    let mut out = [0 as c_char; MESSAGE_LEN];
    let mut end = msg.len().min(MESSAGE_LEN - 1);
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    for (o, &b) in out.iter_mut().zip(&msg.as_bytes()[..end]) {
        *o = b as c_char;
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The functions of kvpush.h.

/// The kvpush version, a static NUL-terminated string.
#[no_mangle]
pub extern "C" fn kvpush_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// [`ABI_VERSION`]: compare it with `KVPUSH_ABI_VERSION` from the header you compiled against.
#[no_mangle]
pub extern "C" fn kvpush_abi_version() -> u32 {
    ABI_VERSION
}

/// The message of the last failed call on this thread ("" after a successful one). Valid until the
/// next kvpush call on this thread.
#[no_mangle]
pub extern "C" fn kvpush_last_error() -> *const c_char {
    LAST_ERROR.try_with(|e| e.borrow().as_ptr()).unwrap_or(c"thread is exiting".as_ptr())
}

/// The name of a status code (`"KVPUSH_ERR_LAYOUT"`), a static string.
#[no_mangle]
pub extern "C" fn kvpush_status_name(code: c_int) -> *const c_char {
    status_cstr(code).as_ptr()
}

fn status_cstr(code: c_int) -> &'static CStr {
    match code {
        status::OK => c"KVPUSH_OK",
        status::NULL => c"KVPUSH_ERR_NULL",
        status::INVALID_ARGUMENT => c"KVPUSH_ERR_INVALID_ARGUMENT",
        status::UNKNOWN_HANDLE => c"KVPUSH_ERR_UNKNOWN_HANDLE",
        status::LAYOUT => c"KVPUSH_ERR_LAYOUT",
        status::DEVICE => c"KVPUSH_ERR_DEVICE",
        status::TRANSPORT => c"KVPUSH_ERR_TRANSPORT",
        status::INCOMPATIBLE => c"KVPUSH_ERR_INCOMPATIBLE",
        status::BLOCKS => c"KVPUSH_ERR_BLOCKS",
        status::WRONG_MODE => c"KVPUSH_ERR_WRONG_MODE",
        status::SIDE_CHANNEL => c"KVPUSH_ERR_SIDE_CHANNEL",
        status::DECODE => c"KVPUSH_ERR_DECODE",
        status::BUFFER_TOO_SMALL => c"KVPUSH_ERR_BUFFER_TOO_SMALL",
        status::CLOSED => c"KVPUSH_ERR_CLOSED",
        status::PANIC => c"KVPUSH_ERR_PANIC",
        status::UNFENCED => c"KVPUSH_ERR_UNFENCED",
        _ => c"unknown status",
    }
}

/// 1 if the NIXL library can be loaded in this process, else 0 (never aborts).
#[no_mangle]
pub extern "C" fn kvpush_nixl_available() -> c_int {
    panic::catch_unwind(crate::transport::nixl::available).map(c_int::from).unwrap_or(0)
}

/// Fills `layout` with defaults: everything zero, `tp_size` and `pp_size` 1.
///
/// # Safety
///
/// 1. `layout` is null or valid for a write of a `kvpush_layout`.
#[no_mangle]
pub unsafe extern "C" fn kvpush_layout_init(layout: *mut kvpush_layout) -> c_int {
    guard("kvpush_layout_init", || {
        let l = kvpush_layout::default();
        // SAFETY: the caller's contract (1).
        unsafe { put("layout", layout, l) }
    })
}

/// Fills `config` with defaults: push mode, loopback, one writer, every string null.
///
/// # Safety
///
/// 1. `config` is null or valid for a write of a `kvpush_engine_config`.
#[no_mangle]
pub unsafe extern "C" fn kvpush_engine_config_init(config: *mut kvpush_engine_config) -> c_int {
    guard("kvpush_engine_config_init", || {
        let c = kvpush_engine_config {
            engine_id: std::ptr::null(),
            mode: super::mode::PUSH,
            transport: super::transport::LOOPBACK,
            hub: std::ptr::null_mut(),
            device: std::ptr::null(),
            writers: 1,
            lease_ms: 0,
            timeout_ms: 0,
            agent_name: std::ptr::null(),
            nixl_backend: std::ptr::null(),
            listen: std::ptr::null(),
            secret: std::ptr::null(),
        };
        // SAFETY: the caller's contract (1).
        unsafe { put("config", config, c) }
    })
}

/// Creates a hub: the medium loopback engines of this process share.
///
/// # Safety
///
/// 1. `out` is null or valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn kvpush_hub_create(out: *mut *mut kvpush_hub) -> c_int {
    guard("kvpush_hub_create", || {
        if out.is_null() {
            return Err(FfiError::Null("out"));
        }
        // SAFETY: the caller's contract (1).
        unsafe { put_handle(out, Item::Hub(Hub::new())) }
    })
}

/// Destroys a hub handle. Engines created on it keep what they need; it may go before them.
///
/// # Safety
///
/// None beyond the handle's being any value: unknown handles are answered with an error.
#[no_mangle]
pub unsafe extern "C" fn kvpush_hub_destroy(hub: *mut kvpush_hub) -> c_int {
    destroy("kvpush_hub_destroy", "hub", hub as usize, KIND_HUB)
}

/// Creates an engine worker: validates the layout, checks and registers its memory, starts the
/// writer threads (and, for NIXL, the agent and the side-channel listener).
///
/// # Safety
///
/// 1. `config` and `layout` are null or valid, with every pointer inside them null or valid for
///    its stated length (strings NUL-terminated); `out` is null or valid for a write.
/// 2. Every region of the layout is memory of the device, valid for reads and writes until
///    [`kvpush_engine_destroy`] returns.
/// 3. A request's blocks are not written by the caller while the engine reads them (producer: from
///    `kvpush_request_finished` until its `KVPUSH_OUTCOME_SENT`) nor read or reused while peers
///    write them (consumer: from `kvpush_blocks_allocated` / `kvpush_start_pull` until its outcome).
#[no_mangle]
pub unsafe extern "C" fn kvpush_engine_create(
    config: *const kvpush_engine_config,
    layout: *const kvpush_layout,
    out: *mut *mut kvpush_engine,
) -> c_int {
    guard("kvpush_engine_create", || {
        if out.is_null() {
            return Err(FfiError::Null("out"));
        }
        // SAFETY: the caller's contract (1).
        let c = unsafe { config.as_ref() }.ok_or(FfiError::Null("config"))?;
        // SAFETY: the caller's contract (1).
        let l = unsafe { layout.as_ref() }.ok_or(FfiError::Null("layout"))?;
        // SAFETY: the caller's contract (1) for every string of `config`.
        let (engine_id, device, agent_name, backend, listen, secret) = unsafe {
            (
                required_str("config.engine_id", c.engine_id)?.to_owned(),
                optional_str("config.device", c.device)?,
                optional_str("config.agent_name", c.agent_name)?,
                optional_str("config.nixl_backend", c.nixl_backend)?,
                optional_str("config.listen", c.listen)?,
                optional_str("config.secret", c.secret)?,
            )
        };
        let transport = match c.transport {
            super::transport::LOOPBACK => TransportSpec::Loopback(hub_of(c.hub).map_err(|e| match e {
                FfiError::Null(_) => FfiError::NullFor {
                    arg: "config.hub",
                    why: "a loopback engine needs the hub its peers share (kvpush_hub_create)",
                },
                e => e,
            })?),
            super::transport::NIXL => {
                if !c.hub.is_null() {
                    return Err(FfiError::invalid("config.hub", "must be null for a NIXL engine"));
                }
                TransportSpec::Nixl {
                    agent_name,
                    backend,
                    listen,
                    secret: secret.map(String::into_bytes),
                    // Insecure mode only through $KVPUSH_INSECURE=1 (see SideConfig::insecure).
                    insecure: false,
                    peer_timeout_ms: 0,
                    // The dial allow-list only through $KVPUSH_DIAL_ALLOW (see SideConfig::dial_allow).
                    dial_allow: None,
                }
            }
            other => {
                return Err(FfiError::invalid(
                    "config.transport",
                    format!("{other} is neither loopback (0) nor nixl (1)"),
                ))
            }
        };
        let spec = EngineSpec {
            engine_id,
            mode: c.mode,
            device,
            writers: c.writers,
            lease_ms: c.lease_ms,
            timeout_ms: c.timeout_ms,
            transport,
            staging: crate::engine::Staging::Auto,
            layerwise: crate::engine::Layerwise::AUTO,
            // The C and C++ configs carry no memory offer (yet): direct only.
            memory: None,
        };
        // SAFETY: the caller's contract (1) for the layout's arrays.
        let layout = unsafe { layout_spec(l) }?;
        // SAFETY: the caller's contracts (2) and (3) are `FfiEngine::new`'s.
        let engine = unsafe { FfiEngine::new(&spec, &layout) }?;
        // SAFETY: the caller's contract (1) for `out`.
        unsafe { put_handle(out, Item::Engine(engine)) }
    })
}

/// Destroys an engine: unregisters the handle, waits for calls in progress on it, stops it
/// ([`crate::engine::Engine::shutdown`]: a bounded wait for quarantined blocks, its own transfers
/// ended, the writer threads joined, the memory deregistered). `KVPUSH_ERR_UNFENCED` (the handle is
/// gone all the same) where the memory may still be touched afterwards; the last error names why.
///
/// # Safety
///
/// None beyond the handle's being any value: unknown handles are answered with an error.
#[no_mangle]
pub unsafe extern "C" fn kvpush_engine_destroy(engine: *mut kvpush_engine) -> c_int {
    guard("kvpush_engine_destroy", || {
        if engine.is_null() {
            return Err(FfiError::Null("engine"));
        }
        // The engine stops here, after the calls in progress on it ended (`remove` waits for them);
        // the handle is gone whatever the stop reports. `KVPUSH_ERR_UNFENCED`: a transfer or a lost
        // peer may still touch the memory.
        match remove(engine as usize, KIND_ENGINE)? {
            Item::Engine(mut e) => e.stop(),
            Item::Hub(_) => Ok(()),
        }
    })
}

/// Writes this worker's encoded handshake into `buf` (`cap` bytes) and its length into `*len`. With
/// a null or short buffer, only `*len` is written and `KVPUSH_ERR_BUFFER_TOO_SMALL` returned.
///
/// # Safety
///
/// 1. `buf` is null or valid for writes of `cap` bytes; `len` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn kvpush_engine_handshake(
    engine: *const kvpush_engine,
    buf: *mut u8,
    cap: usize,
    len: *mut usize,
) -> c_int {
    guard("kvpush_engine_handshake", || {
        let bytes = engine_of(engine)?.handshake()?;
        // SAFETY: the caller's contract (1).
        unsafe { put_bytes(&bytes, false, buf, cap, len) }
    })
}

/// Accepts a peer from its encoded handshake (loopback engines): checks compatibility, refusing
/// with every differing field named, and loads its transport metadata.
///
/// # Safety
///
/// 1. `handshake` is null or valid for reads of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvpush_engine_add_peer(engine: *mut kvpush_engine, handshake: *const u8, len: usize) -> c_int {
    guard("kvpush_engine_add_peer", || {
        let e = engine_of(engine)?;
        if len == 0 {
            return Err(FfiError::invalid("len", "is 0: a handshake is never empty"));
        }
        // SAFETY: the caller's contract (1).
        let bytes = unsafe { slice("handshake", handshake, len) }?;
        e.add_peer(bytes)
    })
}

/// Connects two engines of this process both ways (same hub for loopback; side channel for NIXL).
///
/// # Safety
///
/// None beyond the handles' being any value: unknown handles are answered with an error.
#[no_mangle]
pub unsafe extern "C" fn kvpush_engine_connect(a: *mut kvpush_engine, b: *mut kvpush_engine) -> c_int {
    guard("kvpush_engine_connect", || {
        if a == b && !a.is_null() {
            return Err(FfiError::invalid("b", "an engine cannot connect to itself"));
        }
        // Both handles' read locks, taken in one global order (by slot): two threads connecting
        // the same engines in opposite orders while each engine's destroy waits for its write lock
        // would otherwise wait on each other forever (a waiting writer blocks new readers).
        let a_first = locks_first(a, b);
        let (first, second) = if a_first { (a, b) } else { (b, a) };
        let (first, second) = (engine_of(first)?, engine_of(second)?);
        let (ea, eb) = if a_first { (&*first, &*second) } else { (&*second, &*first) };
        ea.connect(eb)
    })
}

/// Whether `a`'s handle lock is taken before `b`'s: by slot index, a handle that names no slot
/// (null, forged) first, so its error comes before any lock is held.
fn locks_first(a: *const kvpush_engine, b: *const kvpush_engine) -> bool {
    let index =
        |h: *const kvpush_engine| slot_of(h as usize, KIND_ENGINE).map(|(slot, _)| slot as *const Slot as usize);
    index(a) <= index(b)
}

/// NIXL: dials the side channel of a peer worker at `addr` (`"host:port"`) and handshakes both
/// ways. Blocks up to 10 s: call it off the engine loop.
///
/// # Safety
///
/// 1. `addr` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn kvpush_engine_connect_addr(engine: *mut kvpush_engine, addr: *const c_char) -> c_int {
    guard("kvpush_engine_connect_addr", || {
        let e = engine_of(engine)?;
        // SAFETY: the caller's contract (1).
        let addr = unsafe { required_str("addr", addr) }?;
        if addr.is_empty() {
            return Err(FfiError::invalid("addr", "is empty"));
        }
        e.connect_addr(addr).map(drop)
    })
}

/// NIXL: the port the side channel listens on (give it to peers). Loopback engines have none:
/// `KVPUSH_ERR_INVALID_ARGUMENT`.
///
/// # Safety
///
/// 1. `port` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn kvpush_engine_listen_port(engine: *const kvpush_engine, port: *mut u16) -> c_int {
    guard("kvpush_engine_listen_port", || {
        let p = engine_of(engine)?
            .listen_port()
            .ok_or_else(|| FfiError::invalid("engine", "a loopback engine has no side channel"))?;
        // SAFETY: the caller's contract (1).
        unsafe { put("port", port, p) }
    })
}

/// Producer: prefill of `key` finished; its KV is in `groups` (block ids per KV group) and stays
/// there until the request's `KVPUSH_OUTCOME_SENT`.
///
/// # Safety
///
/// 1. `groups` is null or points to `num_groups` lists, each valid for its `len` ids.
#[no_mangle]
pub unsafe extern "C" fn kvpush_request_finished(
    engine: *mut kvpush_engine,
    key: kvpush_key,
    groups: *const kvpush_block_list,
    num_groups: usize,
    num_tokens: u64,
) -> c_int {
    guard("kvpush_request_finished", || {
        // SAFETY: the caller's contract (1).
        let (e, blocks) = unsafe { engine_and_blocks(engine, groups, num_groups) }?;
        e.request_finished(key.key(), blocks, num_tokens, None)
    })
}

/// Producer: as [`kvpush_request_finished`], for consumer engine `consumer` (the decode engine the
/// router chose): only that engine receives the KV (push) or a grant to read it (pull); another
/// engine that registers `key` is refused. Null or empty `consumer`: the first engine to register.
///
/// # Safety
///
/// 1. `groups` as in [`kvpush_request_finished`].
/// 2. `consumer` is null or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvpush_request_finished_for(
    engine: *mut kvpush_engine,
    key: kvpush_key,
    groups: *const kvpush_block_list,
    num_groups: usize,
    num_tokens: u64,
    consumer: *const c_char,
) -> c_int {
    guard("kvpush_request_finished_for", || {
        // SAFETY: the caller's contracts (1) and (2).
        let ((e, blocks), consumer) =
            unsafe { (engine_and_blocks(engine, groups, num_groups)?, optional_str("consumer", consumer)?) };
        e.request_finished(key.key(), blocks, num_tokens, consumer.as_deref())
    })
}

/// Producer, push mode: layers `first_layer..end_layer` (global layer numbers) of `key` are final in
/// `groups` (the whole prompt's block ids per KV group, the same on every call); the first call holds
/// the blocks until the request's `KVPUSH_OUTCOME_SENT`, as [`kvpush_request_finished`] does. Each
/// range is written into the consumer as soon as its registration is there (engines created through
/// this API push layer by layer from 512 tokens, whole below).
///
/// # Safety
///
/// 1. `groups` is null or points to `num_groups` lists, each valid for its `len` ids.
#[no_mangle]
pub unsafe extern "C" fn kvpush_layers_ready(
    engine: *mut kvpush_engine,
    key: kvpush_key,
    groups: *const kvpush_block_list,
    num_groups: usize,
    num_tokens: u64,
    first_layer: u32,
    end_layer: u32,
) -> c_int {
    guard("kvpush_layers_ready", || {
        // SAFETY: the caller's contract (1).
        let (e, blocks) = unsafe { engine_and_blocks(engine, groups, num_groups) }?;
        e.layers_ready(key.key(), blocks, num_tokens, first_layer..end_layer, None)
    })
}

/// Consumer, push mode: blocks for `key` are allocated (`groups`, per KV group); registers them with
/// every worker of engine `producer` that writes into this one. `RECEIVED` or `FAILED` follows.
///
/// # Safety
///
/// 1. `producer` is null or NUL-terminated; `groups` as in [`kvpush_request_finished`].
#[no_mangle]
pub unsafe extern "C" fn kvpush_blocks_allocated(
    engine: *mut kvpush_engine,
    key: kvpush_key,
    producer: *const c_char,
    groups: *const kvpush_block_list,
    num_groups: usize,
    num_tokens: u64,
) -> c_int {
    guard("kvpush_blocks_allocated", || {
        let e = engine_of(engine)?;
        // SAFETY: the caller's contract (1).
        let (producer, blocks) =
            unsafe { (required_str("producer", producer)?, block_lists("groups", groups, num_groups)?) };
        e.blocks_allocated(key.key(), producer, blocks, num_tokens)
    })
}

/// Consumer, pull mode: read `key` from engine `producer`, whose blocks are `remote` (as the router
/// relayed them), into `local`.
///
/// # Safety
///
/// 1. `producer` is null or NUL-terminated; `remote` and `local` as `groups` in
///    [`kvpush_request_finished`].
#[no_mangle]
pub unsafe extern "C" fn kvpush_start_pull(
    engine: *mut kvpush_engine,
    key: kvpush_key,
    producer: *const c_char,
    remote: *const kvpush_block_list,
    num_remote: usize,
    local: *const kvpush_block_list,
    num_local: usize,
    num_tokens: u64,
) -> c_int {
    guard("kvpush_start_pull", || {
        let e = engine_of(engine)?;
        // SAFETY: the caller's contract (1).
        let (producer, remote, local) = unsafe {
            (
                required_str("producer", producer)?,
                block_lists("remote", remote, num_remote)?,
                block_lists("local", local, num_local)?,
            )
        };
        e.start_pull(key.key(), producer, remote, None, local, num_tokens)
    })
}

/// Aborts `key` on this worker, in whatever state it is; peers are told. Its outcome follows.
///
/// # Safety
///
/// None beyond the handle's being any value: unknown handles are answered with an error.
#[no_mangle]
pub unsafe extern "C" fn kvpush_abort(engine: *mut kvpush_engine, key: kvpush_key) -> c_int {
    guard("kvpush_abort", || engine_of(engine)?.abort(key.key()))
}

/// Moves at most `cap` finished results into `out` and their number into `*n`; the rest stay queued
/// for the next call. Cheap when there are none.
///
/// # Safety
///
/// 1. `out` is null (only with `cap` 0) or valid for writes of `cap` completions; `n` is valid for a
///    write.
#[no_mangle]
pub unsafe extern "C" fn kvpush_poll(
    engine: *mut kvpush_engine,
    out: *mut kvpush_completion,
    cap: usize,
    n: *mut usize,
) -> c_int {
    guard("kvpush_poll", || {
        let e = engine_of(engine)?;
        if n.is_null() {
            return Err(FfiError::Null("n"));
        }
        if cap > 0 && out.is_null() {
            return Err(FfiError::Null("out"));
        }
        if cap > 0 && !out.is_aligned() {
            return Err(FfiError::invalid("out", "is not aligned for kvpush_completion"));
        }
        let mut i = 0;
        let count = e.poll(cap, |o| {
            let (id_hi, id_lo, attempt) = key_parts(o.key);
            let c = kvpush_completion {
                key: kvpush_key { id_hi, id_lo, attempt },
                outcome: o.outcome,
                release: o.release,
                message: message_bytes(&o.message),
            };
            // SAFETY: `i < cap` (poll hands out at most `cap` results) and `out` is valid for `cap`
            // writes, the caller's contract (1).
            unsafe { out.add(i).write(c) };
            i += 1;
        });
        // SAFETY: the caller's contract (1) for `n`.
        unsafe { put("n", n, count) }
    })
}

/// Writes the engine's counters, failures and latency percentiles into `*out`.
///
/// # Safety
///
/// 1. `out` is null or valid for a write of a `kvpush_stats`.
#[no_mangle]
pub unsafe extern "C" fn kvpush_engine_stats(engine: *const kvpush_engine, out: *mut kvpush_stats) -> c_int {
    guard("kvpush_engine_stats", || {
        let v = kvpush_stats::from(engine_of(engine)?.stats());
        // SAFETY: the caller's contract (1).
        unsafe { put("out", out, v) }
    })
}

/// Writes the engine's statistics as JSON (NUL-terminated) into `buf` and the length without the
/// NUL into `*len`; a null or short buffer gets only `*len` and `KVPUSH_ERR_BUFFER_TOO_SMALL`.
///
/// # Safety
///
/// 1. `buf` is null or valid for writes of `cap` bytes; `len` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn kvpush_engine_stats_json(
    engine: *const kvpush_engine,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> c_int {
    guard("kvpush_engine_stats_json", || {
        let s = engine_of(engine)?.stats();
        let json = serde_json::to_string(&s).map_err(|e| FfiError::Panic(format!("serializing stats: {e}")))?;
        // SAFETY: the caller's contract (1).
        unsafe { put_bytes(json.as_bytes(), true, buf.cast(), cap, len) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last_error() -> String {
        // SAFETY: kvpush_last_error returns a valid NUL-terminated string owned by this thread.
        unsafe { CStr::from_ptr(kvpush_last_error()) }.to_string_lossy().into_owned()
    }

    #[test]
    fn unknown_and_null_handles_are_errors_not_crashes() {
        let fake = 0x1234usize as *mut kvpush_engine;
        // SAFETY: the handle is any value by contract.
        assert_eq!(unsafe { kvpush_abort(fake, kvpush_key::default()) }, status::UNKNOWN_HANDLE);
        assert!(last_error().contains("engine handle 0x1234 is unknown"), "{}", last_error());
        // SAFETY: as above.
        assert_eq!(unsafe { kvpush_engine_destroy(std::ptr::null_mut()) }, status::NULL);
        assert_eq!(last_error(), "kvpush_engine_destroy: argument `engine` is null");
    }

    #[test]
    fn hub_handles_are_not_engines_and_die_once() {
        let mut hub = std::ptr::null_mut();
        // SAFETY: `hub` is a valid out-pointer.
        assert_eq!(unsafe { kvpush_hub_create(&mut hub) }, status::OK);
        assert_eq!(last_error(), "");
        // SAFETY: any handle value is allowed.
        assert_eq!(unsafe { kvpush_abort(hub.cast(), kvpush_key::default()) }, status::UNKNOWN_HANDLE);
        // SAFETY: as above.
        assert_eq!(unsafe { kvpush_hub_destroy(hub) }, status::OK);
        // SAFETY: as above.
        assert_eq!(unsafe { kvpush_hub_destroy(hub) }, status::UNKNOWN_HANDLE);
    }

    #[test]
    fn messages_are_truncated_on_a_char_boundary() {
        let long = "é".repeat(200);
        let m = message_bytes(&long);
        let end = m.iter().position(|&c| c == 0).expect("NUL");
        assert!(end < MESSAGE_LEN);
        let bytes: Vec<u8> = m[..end].iter().map(|&c| c as u8).collect();
        assert!(std::str::from_utf8(&bytes).is_ok());
        assert_eq!(end % 2, 0);
    }

    /// A host-memory engine on `hub`: 1 layer, 1 KV head of 8, bf16, 4-token blocks, 4 blocks.
    fn small_engine(hub: *mut kvpush_hub, id: &CStr, mem: &mut [Vec<u8>; 2]) -> *mut kvpush_engine {
        let bases: Vec<u64> = mem.iter_mut().map(|m| m.as_mut_ptr() as u64).collect();
        let mut l = std::mem::MaybeUninit::<kvpush_layout>::uninit();
        // SAFETY: `l` is valid for a write.
        assert_eq!(unsafe { kvpush_layout_init(l.as_mut_ptr()) }, status::OK);
        // SAFETY: initialized by kvpush_layout_init.
        let mut l = unsafe { l.assume_init() };
        (l.total_layers, l.kv_heads, l.head_dim, l.dtype, l.block_tokens, l.num_blocks) = (1, 1, 8, 1, 4, 4);
        (l.region_bases, l.num_regions) = (bases.as_ptr(), bases.len());
        let mut c = std::mem::MaybeUninit::<kvpush_engine_config>::uninit();
        // SAFETY: `c` is valid for a write.
        assert_eq!(unsafe { kvpush_engine_config_init(c.as_mut_ptr()) }, status::OK);
        // SAFETY: initialized by kvpush_engine_config_init.
        let mut c = unsafe { c.assume_init() };
        (c.engine_id, c.hub, c.device) = (id.as_ptr(), hub, c"host".as_ptr());
        let mut e = std::ptr::null_mut();
        // SAFETY: every pointer is valid; the regions (`mem`, 256 bytes each) outlive the engine in
        // the callers, which destroy it before dropping `mem` and never touch the memory meanwhile.
        let rc = unsafe { kvpush_engine_create(&c, &l, &mut e) };
        assert_eq!(rc, status::OK, "{}", last_error());
        e
    }

    /// `kvpush_engine_connect(a, b)` and `(b, a)` take the two handle locks in the same order, so
    /// opposite connects racing with both engines' destroys cannot wait on each other; handles that
    /// name no engine come first (their error needs no lock).
    #[test]
    fn connect_locks_both_handles_in_one_order() {
        let mut hub = std::ptr::null_mut();
        // SAFETY: `hub` is a valid out-pointer.
        assert_eq!(unsafe { kvpush_hub_create(&mut hub) }, status::OK);
        for _ in 0..50 {
            let (mut ma, mut mb) = ([vec![0u8; 256], vec![0u8; 256]], [vec![0u8; 256], vec![0u8; 256]]);
            let (a, b) = (small_engine(hub, c"a", &mut ma), small_engine(hub, c"b", &mut mb));
            assert_ne!(locks_first(a, b), locks_first(b, a), "one order for both calls");
            let fake = 0x1234usize as *mut kvpush_engine;
            assert!(locks_first(fake, a) && !locks_first(a, fake));
            assert!(locks_first(std::ptr::null(), b));
            // Opposite connects racing with both destroys: all of them return.
            let (ha, hb) = (a as usize, b as usize);
            let (tx, rx) = std::sync::mpsc::channel();
            let calls: Vec<_> = [(ha, hb), (hb, ha)]
                .into_iter()
                .map(|(x, y)| {
                    let tx = tx.clone();
                    std::thread::spawn(move || {
                        for _ in 0..20 {
                            // SAFETY: any handle values are allowed (dead ones are errors).
                            let _ = unsafe { kvpush_engine_connect(x as *mut _, y as *mut _) };
                        }
                        let _ = tx.send(());
                    })
                })
                .collect();
            let destroys: Vec<_> = [ha, hb]
                .into_iter()
                .map(|h| {
                    let tx = tx.clone();
                    std::thread::spawn(move || {
                        // SAFETY: as above.
                        let _ = unsafe { kvpush_engine_destroy(h as *mut _) };
                        let _ = tx.send(());
                    })
                })
                .collect();
            for _ in 0..4 {
                rx.recv_timeout(std::time::Duration::from_secs(30)).expect("a connect or destroy never returned");
            }
            for t in calls.into_iter().chain(destroys) {
                let _ = t.join();
            }
        }
        // SAFETY: `hub` is live.
        assert_eq!(unsafe { kvpush_hub_destroy(hub) }, status::OK);
    }

    #[test]
    fn destroy_waits_for_calls_in_progress_and_the_handle_stays_dead() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let mut hub = std::ptr::null_mut();
        // SAFETY: `hub` is a valid out-pointer.
        assert_eq!(unsafe { kvpush_hub_create(&mut hub) }, status::OK);
        let mut mem = [vec![0u8; 256], vec![0u8; 256]];
        let handle = small_engine(hub, c"t", &mut mem) as usize;
        let ok = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let ok = Arc::clone(&ok);
                std::thread::spawn(move || loop {
                    let mut out = std::mem::MaybeUninit::<[kvpush_completion; 2]>::uninit();
                    let mut n = 0;
                    // SAFETY: `out` holds 2 completions, `n` is valid; the handle is any value.
                    match unsafe { kvpush_poll(handle as *mut _, out.as_mut_ptr().cast(), 2, &mut n) } {
                        status::OK => ok.fetch_add(1, Ordering::Relaxed),
                        status::UNKNOWN_HANDLE => return,
                        other => panic!("poll returned {other}: {}", last_error()),
                    };
                })
            })
            .collect();
        while ok.load(Ordering::Relaxed) < 1000 {
            std::thread::yield_now();
        }
        // SAFETY: any handle value is allowed.
        assert_eq!(unsafe { kvpush_engine_destroy(handle as *mut _) }, status::OK);
        for t in threads {
            t.join().expect("poller");
        }
        // The slot is reused by the next engine, the old handle stays unknown.
        let mut mem2 = [vec![0u8; 256], vec![0u8; 256]];
        let again = small_engine(hub, c"t2", &mut mem2);
        assert_ne!(again as usize, handle);
        // SAFETY: any handle value is allowed.
        unsafe {
            assert_eq!(kvpush_abort(handle as *mut _, kvpush_key::default()), status::UNKNOWN_HANDLE);
            assert_eq!(kvpush_abort(again, kvpush_key::default()), status::OK);
            assert_eq!(kvpush_engine_destroy(handle as *mut _), status::UNKNOWN_HANDLE);
            assert_eq!(kvpush_engine_destroy(again), status::OK);
            assert_eq!(kvpush_hub_destroy(hub), status::OK);
        }
    }
}
