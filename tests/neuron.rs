//! The Neuron backend and neuron-sys against a fake libnrt (tests/neuron_fake/fake_nrt.c), which
//! this test builds with the C compiler (`kvpush_testkit::neuron_fake`) into cargo's temporary
//! directory.
//!
//! Every test loads its own copy of the fake (a distinct file is a distinct library, so each test
//! has its own "runtime" and counters), controls it with `fake_nrt_set` and reads its counters with
//! `fake_nrt_get`. Tests that need environment variables (`KVPUSH_DEVICE`, `KVPUSH_LIBNRT`, the
//! fake's `FAKE_NRT_*` knobs read at load time) run as child processes of this test binary, so no
//! test changes the environment of this process.
//!
//! Covered: loading (explicit path, the default search and its error), symbol probing (optional
//! missing: "not supported"; required missing: named), runtime ownership (own: one init, one close;
//! attach: none), tensor allocation and frees (no leak), `describe` (inside, outside, other core,
//! registered framework tensors), telling a running runtime without nrt_init, the device-address check (NEURON_RT_MAP_HBM), the dma-buf path and
//! its failure, selection through `KVPUSH_DEVICE`, loopback transfers between two fake tensors, the
//! demo's engines on fake Neuron memory, and the host bounce (Neuron KV through DRAM slots on P or
//! on D, over transports and engines, and a pair the memory offers leave no data path refused). Registering Neuron memory with NIXL is not covered: UCX
//! on this CPU machine has no Neuron memory type (see neuron/README.md).

#![allow(clippy::unwrap_used)]

use std::ffi::{c_char, c_int, c_long, c_void, CString};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use kvpush::device::host::HostDevice;
use kvpush::device::neuron::{NeuronConfig, NeuronDevice, NeuronError, RuntimeMode};
use kvpush::device::{select, Buffer, Device, DeviceError, DeviceKind, MemKind};
use kvpush::proto::bounce::{decide, MemoryKind, MemoryOffer, RdmaOps, Route};
use kvpush::proto::Mode;
use kvpush::transport::bounce::bounce_geometry;
use kvpush::transport::loopback::Fabric;
use kvpush::transport::staged::StagingConfig;
use kvpush::transport::{Desc, Op, Transport, TransportError, XferState};
use kvpush_testkit::bounce;
use kvpush_testkit::neuron_fake::{self, Variant};
use neuron_sys::{Lib, Placement, Runtime};

// ---- the fake ----

/// Where fakes are built and copied (shared by test processes: every file name written here is
/// either unique to this process or replaced atomically).
fn work_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("neuron-fake");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Compiles `variant` once per process; a missing or failing compiler fails the test.
fn built(variant: Variant) -> &'static Path {
    static BUILT: [OnceLock<PathBuf>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    BUILT[variant as usize].get_or_init(|| neuron_fake::build(&work_dir(), variant))
}

/// A private copy of the fake, with a handle on its test controls. A copy made by [`Fake::new`] is
/// removed on drop.
struct Fake {
    path: PathBuf,
    handle: *mut c_void,
    owns_file: bool,
}

impl Fake {
    fn new(variant: Variant) -> Fake {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = work_dir().join(format!("libnrt-{}-{}-{n}.so", variant.tag(), std::process::id()));
        std::fs::copy(built(variant), &path).unwrap();
        Fake { handle: dlopen(&path), path, owns_file: true }
    }

    /// The controls of a copy another process made (child processes).
    fn existing(path: PathBuf) -> Fake {
        Fake { handle: dlopen(&path), path, owns_file: false }
    }

    fn symbol(&self, name: &str) -> *mut c_void {
        let c = CString::new(name).unwrap();
        // SAFETY: `handle` is a live dlopen handle; dlsym only looks the name up.
        let f = unsafe { libc::dlsym(self.handle, c.as_ptr()) };
        assert!(!f.is_null(), "the fake has no {name}");
        f
    }

    /// Sets a knob of this copy (`FAKE_NRT_*`).
    fn set(&self, knob: &str, value: c_long) {
        let k = CString::new(knob).unwrap();
        // SAFETY: fake_nrt_set has this C signature (tests/neuron_fake/fake_nrt.c).
        let f: extern "C" fn(*const c_char, c_long) -> c_int =
            unsafe { std::mem::transmute(self.symbol("fake_nrt_set")) };
        assert_eq!(f(k.as_ptr(), value), 0, "unknown knob {knob}");
    }

    /// Reads a counter (or knob) of this copy.
    fn get(&self, counter: &str) -> c_long {
        let k = CString::new(counter).unwrap();
        // SAFETY: fake_nrt_get has this C signature (tests/neuron_fake/fake_nrt.c).
        let f: extern "C" fn(*const c_char) -> c_long = unsafe { std::mem::transmute(self.symbol("fake_nrt_get")) };
        let v = f(k.as_ptr());
        assert!(v >= 0 || counter.starts_with("FAKE_NRT_VISIBLE"), "unknown counter {counter}");
        v
    }

    /// A full fake with `knob` set to `value`, and the error opening it in own mode gives.
    fn refusing(knob: &str, value: c_long) -> (Fake, NeuronError) {
        let fake = Fake::new(Variant::Full);
        fake.set(knob, value);
        let err = fake.open(RuntimeMode::Own).unwrap_err();
        (fake, err)
    }

    fn config(&self, mode: RuntimeMode) -> NeuronConfig {
        NeuronConfig { library: Some(self.path.clone()), mode, core: 0 }
    }

    fn open(&self, mode: RuntimeMode) -> Result<NeuronDevice, NeuronError> {
        NeuronDevice::open(&self.config(mode))
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        // SAFETY: `handle` came from dlopen and is closed once; the library stays loaded while a `Lib`
        // still holds it.
        unsafe { libc::dlclose(self.handle) };
        if self.owns_file {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// A dlopen handle of the fake at `path`.
fn dlopen(path: &Path) -> *mut c_void {
    let c = CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: loads a fake built by this test (its constructor only reads environment variables).
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!handle.is_null(), "cannot dlopen {}", path.display());
    handle
}

// ---- loading and symbols ----

#[test]
fn loads_from_a_path_and_reports_what_it_found() {
    let fake = Fake::new(Variant::Full);
    let lib = Lib::open_path(&fake.path).unwrap();
    assert_eq!(lib.path(), std::fs::canonicalize(&fake.path).unwrap(), "the file the loader mapped");
    assert!(lib.missing_optional().is_empty(), "{:?}", lib.missing_optional());
    assert_eq!(lib.total_nc_count().unwrap(), 2);
    fake.set("FAKE_NRT_VISIBLE_NC", 1);
    assert_eq!(lib.visible_nc_count().unwrap(), 1);
    let v = lib.version().unwrap();
    assert_eq!((v.major, v.minor, v.patch), (2, 99, 7));
    assert_eq!(v.to_string(), "2.99.7.0 (fake libnrt for kvpush tests)");
    assert_eq!(fake.get("init_calls"), 0, "loading and queries never start the runtime");
}

#[test]
fn default_search_lists_every_path_tried() {
    // No test in this process sets KVPUSH_LIBNRT; the machine has no libnrt.
    let candidates = Lib::candidates();
    let err = match Lib::open() {
        Err(e) => e,
        Ok(lib) => {
            // A machine with the Neuron runtime installed: nothing to test about a missing one.
            assert!(std::env::var_os("CI").is_none(), "CI machines have no libnrt, yet {lib:?} loaded");
            eprintln!("a real libnrt is installed ({lib:?}): the missing-library path is not checked here");
            return;
        }
    };
    let neuron_sys::Error::Load { tried } = &err else { panic!("{err:?}") };
    assert_eq!(tried.iter().map(|(p, _)| p.clone()).collect::<Vec<_>>(), candidates);
    if std::env::var_os("KVPUSH_LIBNRT").is_none() {
        assert_eq!(candidates, ["libnrt.so.1", "/opt/aws/neuron/lib/libnrt.so.1"]);
    }
    let msg = err.to_string();
    for (path, why) in tried {
        assert!(msg.contains(path.as_str()) && msg.contains(why.as_str()), "{msg}");
        assert!(!why.is_empty(), "the loader's message is kept");
    }

    // Selection: an explicit neuron is an error naming the paths; auto falls back quietly.
    let err = select("neuron").unwrap_err();
    let DeviceError::Unavailable { tried, .. } = &err else { panic!("{err:?}") };
    assert_eq!(tried.len(), 1);
    assert!(tried[0].1.contains(candidates[0].as_str()), "{err}");
    assert_ne!(select("auto").unwrap().kind(), DeviceKind::Neuron);
}

#[test]
fn a_missing_optional_symbol_is_not_supported() {
    let fake = Fake::new(Variant::NoDmabuf);
    let lib = Lib::open_path(&fake.path).unwrap();
    assert_eq!(lib.missing_optional(), ["nrt_get_dmabuf_fd"]);
    assert!(!lib.supports("nrt_get_dmabuf_fd") && lib.supports("nrt_tensor_free"));
    let dev = fake.open(RuntimeMode::Own).unwrap();
    assert_eq!(dev.info().missing_optional, ["nrt_get_dmabuf_fd"]);
    let buf = dev.alloc_tensor(4096).unwrap();
    let r = buf.region();
    let err = dev.dmabuf_fd(r.addr, r.len).unwrap_err();
    assert!(matches!(err, NeuronError::NotSupported { symbol: "nrt_get_dmabuf_fd", .. }), "{err:?}");
    assert!(err.to_string().contains("nrt_get_dmabuf_fd is not supported by this libnrt"), "{err}");
    // Everything else still works.
    buf.write_at(0, b"still fine").unwrap();
    let mut out = [0u8; 10];
    buf.read_at(0, &mut out).unwrap();
    assert_eq!(&out, b"still fine");
}

#[test]
fn a_missing_required_symbol_is_named() {
    let fake = Fake::new(Variant::NoTensorFree);
    let err = Lib::open_path(&fake.path).unwrap_err();
    assert!(matches!(err, neuron_sys::Error::MissingSymbol { symbol: "nrt_tensor_free", .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("required libnrt symbol nrt_tensor_free is missing"), "{msg}");
    assert!(msg.contains(fake.path.file_name().unwrap().to_str().unwrap()), "names the library: {msg}");
    let err = fake.open(RuntimeMode::Own).unwrap_err();
    assert!(matches!(&err, NeuronError::Library { reason } if reason.contains("nrt_tensor_free")), "{err:?}");
    assert_eq!(fake.get("init_calls"), 0, "nothing is called on a library that failed the check");
}

// ---- runtime ownership ----

#[test]
fn own_mode_inits_once_and_closes_after_the_last_buffer() {
    let fake = Fake::new(Variant::Full);
    let dev = fake.open(RuntimeMode::Own).unwrap();
    assert_eq!(dev.mode(), RuntimeMode::Own);
    assert_eq!((fake.get("init_calls"), fake.get("initialized")), (1, 1));
    // A second owner of the same runtime is refused before it calls nrt_init: the runtime runs.
    let err = fake.open(RuntimeMode::Own).unwrap_err();
    assert!(matches!(err, NeuronError::FrameworkOwnsRuntime { .. }), "{err:?}");
    assert!(err.to_string().contains("KVPUSH_NEURON_RUNTIME=attach"), "{err}");
    assert_eq!(fake.get("init_calls"), 1);

    let buf = dev.alloc(8192).unwrap();
    drop(dev);
    assert_eq!(fake.get("close_calls"), 0, "a live buffer keeps the runtime open");
    buf.write_at(0, &[1, 2, 3]).unwrap();
    drop(buf);
    assert_eq!((fake.get("close_calls"), fake.get("initialized")), (1, 0));
    assert_eq!(fake.get("live_tensors"), 0);
    assert_eq!(fake.get("allocs"), fake.get("frees"));
    // The runtime can be owned again once closed.
    let again = fake.open(RuntimeMode::Own).unwrap();
    drop(again);
    assert_eq!((fake.get("init_calls"), fake.get("close_calls")), (2, 2));
}

#[test]
fn attach_mode_never_inits_or_closes() {
    let fake = Fake::new(Variant::Full);
    // Before the framework started the runtime: a clear error, and still no init.
    let err = fake.open(RuntimeMode::Attach).unwrap_err();
    assert!(matches!(err, NeuronError::NotRunning { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("NRT_UNINITIALIZED (13)") && msg.contains("KVPUSH_NEURON_RUNTIME=own"), "{msg}");
    assert_eq!(fake.get("init_calls"), 0);

    // The framework starts it (here: through neuron-sys, as torch-neuronx would through libnrt).
    let framework = Runtime::init(Lib::open_path(&fake.path).unwrap()).unwrap();
    assert_eq!(fake.get("init_calls"), 1);
    let dev = fake.open(RuntimeMode::Attach).unwrap();
    assert_eq!(dev.mode(), RuntimeMode::Attach);
    let buf = dev.alloc(4096).unwrap();
    buf.write_at(4095, &[9]).unwrap();
    drop(buf);
    drop(dev);
    assert_eq!((fake.get("init_calls"), fake.get("close_calls")), (1, 0), "attach never inits nor closes");
    assert_eq!(fake.get("initialized"), 1);
    assert_eq!(fake.get("live_tensors"), 0, "kvpush's tensors are freed even when attached");
    drop(framework);
    assert_eq!(fake.get("close_calls"), 1);

    // After the framework closed the runtime, attaching says so.
    let err = fake.open(RuntimeMode::Attach).unwrap_err();
    assert!(err.to_string().contains("NRT_CLOSED (14)"), "{err}");
}

/// Own mode never relies on a second `nrt_init` failing (unverified on the real runtime): here the
/// fake's second `nrt_init` succeeds, and only the probe's status decides.
#[test]
fn own_mode_tells_a_running_runtime_without_nrt_init() {
    let fake = Fake::new(Variant::Full);
    fake.set("FAKE_NRT_REINIT_OK", 1);
    let framework = Runtime::init(Lib::open_path(&fake.path).unwrap()).unwrap();
    let err = fake.open(RuntimeMode::Own).unwrap_err();
    assert!(matches!(err, NeuronError::FrameworkOwnsRuntime { .. }), "{err:?}");
    assert_eq!(fake.get("init_calls"), 1);
    // A running runtime that refuses the probe (out of device memory) is not "stopped": kvpush
    // cannot tell, says so, and still does not call nrt_init.
    fake.set("FAKE_NRT_FAIL_ALLOCS", 1);
    let err = fake.open(RuntimeMode::Own).unwrap_err();
    assert!(matches!(err, NeuronError::Init { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("cannot tell whether the runtime already runs") && msg.contains("NRT_RESOURCE (4)"), "{msg}");
    assert_eq!((fake.get("init_calls"), fake.get("FAKE_NRT_FAIL_ALLOCS")), (1, 0), "one probe, no nrt_init");
    // Closed by the framework: NRT_CLOSED means stopped, and own mode starts it.
    drop(framework);
    let dev = fake.open(RuntimeMode::Own).unwrap();
    assert_eq!((dev.mode(), fake.get("init_calls")), (RuntimeMode::Own, 2));
    drop(dev);
    assert_eq!((fake.get("close_calls"), fake.get("live_tensors")), (2, 0));
}

#[test]
fn a_failing_nrt_init_is_reported_with_its_status() {
    let (fake, err) = Fake::refusing("FAKE_NRT_FAIL_INIT", 1);
    assert!(matches!(err, NeuronError::Init { .. }), "{err:?}");
    assert!(err.to_string().contains("nrt_init failed with NRT_FAILURE (1)"), "{err}");
    assert_eq!((fake.get("init_calls"), fake.get("close_calls")), (1, 0), "nothing to close after a failed init");
    fake.set("FAKE_NRT_FAIL_INIT", 0);
    drop(fake.open(RuntimeMode::Own).unwrap());
    assert_eq!(fake.get("close_calls"), 1);
}

#[test]
fn no_device_and_bad_cores_are_refused() {
    let (fake, err) = Fake::refusing("FAKE_NRT_NC_COUNT", 0);
    assert!(matches!(err, NeuronError::NoDevice { .. }) && err.is_absent(), "{err:?}");
    assert!(err.to_string().contains("0 NeuronCores"), "{err}");
    fake.set("FAKE_NRT_NC_COUNT", 2);
    let err = NeuronDevice::open(&NeuronConfig { core: 2, ..fake.config(RuntimeMode::Own) }).unwrap_err();
    assert_eq!(err, NeuronError::BadCore { core: 2, visible: 2, total: 2 });
    assert!(!err.is_absent(), "a Neuron machine with a wrong core is not 'no Neuron'");
    assert_eq!(fake.get("init_calls"), 0, "refused before starting anything");
    let dev = NeuronDevice::open(&NeuronConfig { core: 1, ..fake.config(RuntimeMode::Own) }).unwrap();
    assert_eq!(dev.alloc(64).unwrap().region().dev_id, 1);
}

// ---- tensors ----

#[test]
fn tensors_are_zeroed_copied_and_freed() {
    let fake = Fake::new(Variant::Full);
    let dev = fake.open(RuntimeMode::Own).unwrap();
    let probe_allocs = fake.get("allocs");
    assert_eq!(probe_allocs, 1, "one probe tensor at open");
    assert_eq!(fake.get("live_tensors"), 0, "and it is freed");

    let bufs: Vec<Box<dyn Buffer>> = (1..=4).map(|i| dev.alloc(i * 10_000).unwrap()).collect();
    assert_eq!(fake.get("live_tensors"), 4);
    assert_eq!(fake.get("live_bytes"), 100_000);
    assert_eq!(dev.stats().allocated, 4);
    assert_eq!(fake.get("memsets"), 4, "alloc zeroes with nrt_tensor_memset");
    for (i, b) in bufs.iter().enumerate() {
        let r = b.region();
        assert_eq!((r.kind, r.dev_id, r.len), (MemKind::Vram, 0, (i as u64 + 1) * 10_000));
        let mut out = vec![0xffu8; r.len as usize];
        b.read_at(0, &mut out).unwrap();
        assert!(out.iter().all(|&x| x == 0), "zeroed");
        let data: Vec<u8> = (0..1000u32).map(|x| (x * 7 + i as u32) as u8).collect();
        b.write_at(r.len - 1000, &data).unwrap();
        let mut back = vec![0u8; 1000];
        b.read_at(r.len - 1000, &mut back).unwrap();
        assert_eq!(back, data);
    }
    // Out of range: refused before libnrt is called.
    let writes = fake.get("writes");
    let err = bufs[0].write_at(9_999, &[1, 2]).unwrap_err();
    assert!(matches!(err, DeviceError::Copy { device: DeviceKind::Neuron, offset: 9_999, len: 2, .. }), "{err:?}");
    assert!(err.to_string().contains("10000 bytes"), "{err}");
    assert_eq!(fake.get("writes"), writes);

    // An allocation libnrt refuses: the status in the error, nothing leaked.
    fake.set("FAKE_NRT_FAIL_ALLOCS", 1);
    let err = dev.alloc(4096).unwrap_err();
    assert!(matches!(err, DeviceError::Alloc { device: DeviceKind::Neuron, len: 4096, .. }), "{err:?}");
    assert!(err.to_string().contains("nrt_tensor_allocate failed with NRT_RESOURCE (4)"), "{err}");
    assert!(matches!(dev.alloc(0), Err(DeviceError::Alloc { len: 0, .. })));

    drop(bufs);
    assert_eq!(fake.get("live_tensors"), 0);
    assert_eq!(fake.get("live_bytes"), 0);
    assert_eq!(fake.get("allocs"), fake.get("frees"));
    assert_eq!(dev.stats().allocated, 0);
}

#[test]
fn describe_accepts_known_tensors_only_and_attributes_their_core() {
    let fake = Fake::new(Variant::Full);
    let framework = Runtime::init(Lib::open_path(&fake.path).unwrap()).unwrap();
    let dev = fake.open(RuntimeMode::Attach).unwrap();
    let buf = dev.alloc(1 << 16).unwrap();
    let r = buf.region();

    // Inside a tensor kvpush allocated.
    assert_eq!(dev.describe(r.addr, r.len).unwrap(), r);
    let inner = dev.describe(r.addr + 100, 200).unwrap();
    assert_eq!((inner.addr, inner.len, inner.kind, inner.dev_id), (r.addr + 100, 200, MemKind::Vram, 0));
    assert!(dev.describe(r.addr + r.len - 10, 11).unwrap_err().to_string().contains("runs past the end"));
    assert!(dev.describe(r.addr, 0).is_err());
    assert!(dev.describe(u64::MAX - 4, 10).unwrap_err().to_string().contains("wraps"));
    // Host memory, and memory next to the tensor, are refused.
    let host = vec![0u8; 4096];
    let err = dev.describe(host.as_ptr() as u64, 16).unwrap_err();
    assert!(matches!(err, DeviceError::NotDeviceMemory { device: DeviceKind::Neuron, .. }), "{err:?}");
    assert!(err.to_string().contains("not inside any Neuron tensor this device knows (1 allocated"), "{err}");
    assert!(dev.describe(r.addr + r.len, 1).is_err());
    // Another core than claimed.
    assert_eq!(dev.describe_on(r.addr, 8, 0).unwrap().dev_id, 0);
    let err = dev.describe_on(r.addr, 8, 1).unwrap_err();
    assert!(err.to_string().contains("on NeuronCore 0, not on the claimed NeuronCore 1"), "{err}");

    // A framework tensor on core 1: unknown until registered, then attributed to core 1.
    let kv = framework.allocate(Placement::Device, 1, 32 << 10, "framework-kv").unwrap();
    let va = kv.va().unwrap().unwrap();
    // Framework mode: libnrt maps it, so it is accepted, on the device's own core until registered.
    assert_eq!(dev.describe(va, 64).unwrap().dev_id, 0);
    let handle = NonNull::new(kv.as_raw().as_ptr().cast::<c_void>()).unwrap();
    // SAFETY: `kv` is a live tensor of this libnrt on core 1 and outlives the registration.
    let reg = unsafe { dev.register_tensor(handle, 1) }.unwrap();
    assert_eq!((reg.region().addr, reg.region().len, reg.region().dev_id), (va, 32 << 10, 1));
    assert_eq!(dev.describe(va + 64, 64).unwrap().dev_id, 1);
    assert!(dev.describe_on(va, 64, 0).unwrap_err().to_string().contains("on NeuronCore 1"));
    assert_eq!(dev.stats().registered, 1);
    // SAFETY: as above.
    let err = unsafe { dev.register_tensor(handle, 1) }.unwrap_err();
    assert!(err.to_string().contains("overlaps the known tensor"), "{err}");
    // SAFETY: as above (refused before libnrt is asked anything).
    let err = unsafe { dev.register_tensor(handle, 7) }.unwrap_err();
    assert!(matches!(err, NeuronError::BadCore { core: 7, .. }), "{err:?}");
    drop(reg);
    assert_eq!(dev.describe(va, 64).unwrap().dev_id, 0, "the registration's core is forgotten once dropped");
    drop(buf);
    assert!(dev.describe(r.addr, 8).is_err(), "forgotten once the buffer is freed");
    drop(kv);
    drop(dev);
    drop(framework);
    assert_eq!((fake.get("live_tensors"), fake.get("close_calls")), (0, 1));
}

/// vllm-neuron's worker: the framework starts the runtime with NEURON_RT_MAP_HBM=1, allocates one
/// KV tensor per layer shaped `(2, blocks, heads, block_size, head_dim)` and hands kvpush each
/// tensor's `data_ptr()`, never an `nrt_tensor_t*`. kvpush accepts exactly what libnrt maps.
#[test]
fn framework_mode_accepts_what_libnrt_maps_and_nothing_else() {
    let fake = Fake::new(Variant::Full);
    fake.set("FAKE_NRT_NC_COUNT", 4); // two Neuron devices (cores 0-1, 2-3), one EFA device each
    let framework = Runtime::init(Lib::open_path(&fake.path).unwrap()).unwrap();
    // Own mode sees the framework's runtime without a second nrt_init.
    let err = fake.open(RuntimeMode::Own).unwrap_err();
    assert!(matches!(err, NeuronError::FrameworkOwnsRuntime { .. }), "{err:?}");
    assert_eq!(fake.get("init_calls"), 1, "detection never calls nrt_init");
    let dev = fake.open(RuntimeMode::Attach).unwrap();

    let (blocks, heads, block_size, head_dim, elem) = (8u64, 2u64, 16u64, 64u64, 2u64);
    let layer_bytes = 2 * blocks * heads * block_size * head_dim * elem;
    let layers: Vec<_> = (0..3)
        .map(|l| framework.allocate(Placement::Device, 0, layer_bytes as usize, &format!("layer{l}")).unwrap())
        .collect();
    for t in &layers {
        let va = t.va().unwrap().unwrap();
        let before = fake.get("dmabuf_calls");
        let r = dev.describe(va, layer_bytes).unwrap();
        assert_eq!((r.addr, r.len, r.kind, r.dev_id), (va, layer_bytes, MemKind::Vram, 0));
        assert_eq!(fake.get("dmabuf_calls"), before + 1, "validated through nrt_get_dmabuf_fd");
        // The V half of block 3 alone.
        let v3 = va + layer_bytes / 2 + 3 * heads * block_size * head_dim * elem;
        assert_eq!(dev.describe(v3, heads * block_size * head_dim * elem).unwrap().addr, v3);
        let err = dev.describe(va + 8, layer_bytes).unwrap_err().to_string();
        assert!(err.contains("libnrt does not map it as Neuron device memory"), "{err}");
    }
    // Host memory is not mapped device memory.
    let host = vec![0u8; 4096];
    let err = dev.describe(host.as_ptr() as u64, 64).unwrap_err().to_string();
    assert!(err.contains("nrt_get_dmabuf_fd failed with NRT_INVALID"), "{err}");
    // A tensor on the other Neuron device: libnrt names another EFA device.
    let other = framework.allocate(Placement::Device, 2, 4096, "other-device").unwrap();
    let err = dev.describe(other.va().unwrap().unwrap(), 64).unwrap_err().to_string();
    assert!(err.contains("EFA 0000:11:1c.0, not on NeuronCore 0's (EFA 0000:10:1c.0)"), "{err}");
    // libnrt refusing the dma-buf refuses the range.
    let va0 = layers[0].va().unwrap().unwrap();
    fake.set("FAKE_NRT_FAIL_DMABUF", 1);
    assert!(dev.describe(va0, 64).is_err());
    fake.set("FAKE_NRT_FAIL_DMABUF", 0);
    // Freed memory is refused.
    drop(layers);
    assert!(dev.describe(va0, 64).is_err(), "a freed tensor is no longer mapped");
    drop((other, dev, framework));
    assert_eq!(fake.get("live_tensors"), 0);
}

// ---- device addresses, dma-buf, EFA ----

#[test]
fn unmapped_device_addresses_fail_clearly() {
    let (fake, err) = Fake::refusing("FAKE_NRT_NO_MAP_HBM", 1);
    assert!(matches!(err, NeuronError::AddressesNotMapped { core: 0, .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("nrt_tensor_get_va returned NULL") && msg.contains("set NEURON_RT_MAP_HBM=1"), "{msg}");
    assert_eq!(fake.get("live_tensors"), 0, "the probe is freed");
    assert_eq!((fake.get("init_calls"), fake.get("close_calls")), (1, 1), "the owned runtime is closed again");

    // A framework tensor registered while device memory is not mapped.
    fake.set("FAKE_NRT_NO_MAP_HBM", 0);
    let framework = Runtime::init(Lib::open_path(&fake.path).unwrap()).unwrap();
    let dev = fake.open(RuntimeMode::Attach).unwrap();
    let kv = framework.allocate(Placement::Device, 0, 4096, "kv").unwrap();
    fake.set("FAKE_NRT_NO_MAP_HBM", 1);
    assert_eq!(kv.va().unwrap(), None);
    let handle = NonNull::new(kv.as_raw().as_ptr().cast::<c_void>()).unwrap();
    // SAFETY: `kv` is a live tensor of this libnrt on core 0 and outlives the call.
    let err = unsafe { dev.register_tensor(handle, 0) }.unwrap_err();
    assert!(err.to_string().contains("NEURON_RT_MAP_HBM=1"), "{err}");
    assert!(matches!(dev.alloc(64), Err(DeviceError::Alloc { reason, .. }) if reason.contains("NEURON_RT_MAP_HBM")));
    assert_eq!(dev.stats(), Default::default(), "nothing half-registered");
}

#[test]
fn dmabuf_fd_and_its_failure() {
    let fake = Fake::new(Variant::Full);
    let dev = fake.open(RuntimeMode::Own).unwrap();
    let buf = dev.alloc_tensor(1 << 20).unwrap();
    let r = buf.region();
    let fd = dev.dmabuf_fd(r.addr + 4096, 8192).unwrap();
    let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
    assert!(link.to_string_lossy().contains("fake-nrt-dmabuf"), "{link:?}");
    let whole = buf.dmabuf_fd().unwrap();
    assert_ne!(whole.as_raw_fd(), fd.as_raw_fd());
    assert_eq!(fake.get("dmabuf_calls"), 2);

    // Unknown ranges are refused before libnrt is asked.
    let err = dev.dmabuf_fd(r.addr + r.len - 10, 20).unwrap_err();
    assert!(matches!(err, NeuronError::Range { .. }) && err.to_string().contains("runs past the end"), "{err}");
    assert_eq!(fake.get("dmabuf_calls"), 2);

    // libnrt refusing: the call and its status, as text and number.
    fake.set("FAKE_NRT_FAIL_DMABUF", 1);
    let err = dev.dmabuf_fd(r.addr, r.len).unwrap_err();
    assert!(matches!(err, NeuronError::Call { call: "nrt_get_dmabuf_fd", status: Some(1), .. }), "{err:?}");
    assert!(err.to_string().contains("nrt_get_dmabuf_fd failed with NRT_FAILURE (1)"), "{err}");
    assert!(err.to_string().contains(&format!("{:#x}", r.addr)), "names the range: {err}");
    drop((fd, whole));
}

#[test]
fn efa_device_and_info() {
    let fake = Fake::new(Variant::Full);
    let dev = NeuronDevice::open(&NeuronConfig { core: 1, ..fake.config(RuntimeMode::Own) }).unwrap();
    let buf = dev.alloc(4096).unwrap();
    assert_eq!(dev.attached_efa_bdf(buf.region().addr + 10).unwrap(), "0000:10:1c.0");
    assert!(dev.attached_efa_bdf(buf.region().addr + 4096).is_err(), "outside known memory");
    let info = dev.info();
    assert_eq!((info.mode, info.core, info.total_cores, info.visible_cores), (RuntimeMode::Own, 1, 2, 2));
    assert_eq!(info.library, std::fs::canonicalize(&fake.path).unwrap());
    assert!(info.version.as_deref().unwrap().starts_with("2.99.7.0"), "{info:?}");
    assert!(format!("{dev:?}").contains("Own"));
}

// ---- transports ----

#[test]
fn loopback_moves_bytes_between_two_neuron_tensors() {
    let fake = Fake::new(Variant::Full);
    let dev = std::sync::Arc::new(fake.open(RuntimeMode::Own).unwrap());
    let src = dev.alloc(1 << 20).unwrap();
    let dst = dev.alloc(1 << 20).unwrap();
    let data: Vec<u8> = (0..256 * 1024u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    src.write_at(4096, &data).unwrap();

    let fabric = Fabric::new();
    // Endpoints for the device's memory: an endpoint for host memory only refuses it.
    let p = fabric.endpoint_on("prefill", dev.clone()).unwrap();
    let d = fabric.endpoint_on("decode", dev.clone()).unwrap();
    p.load_remote(&d.local_metadata().unwrap()).unwrap();
    d.load_remote(&p.local_metadata().unwrap()).unwrap();
    let (rs, rd) = (dev.describe(src.region().addr, src.region().len).unwrap(), dst.region());
    assert_eq!((rs.kind, rd.kind), (MemKind::Vram, MemKind::Vram));
    // SAFETY: both regions are device tensors alive until after `deregister` below; the test reads and
    // writes them only while no transfer is in flight.
    unsafe {
        p.register(&rs).unwrap();
        d.register(&rd).unwrap();
    }
    let descs = [
        Desc { local: rs.addr + 4096, remote: rd.addr, len: 128 * 1024 },
        Desc { local: rs.addr + 4096 + 128 * 1024, remote: rd.addr + 512 * 1024, len: 128 * 1024 },
    ];
    let id = p.post(Op::Write, "decode", &descs, Some(b"kv landed")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while p.poll(id).unwrap() == XferState::Pending {
        assert!(Instant::now() < deadline, "transfer never completed");
        std::thread::sleep(Duration::from_micros(200));
    }
    let mut got = vec![0u8; 128 * 1024];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, data[..128 * 1024]);
    dst.read_at(512 * 1024, &mut got).unwrap();
    assert_eq!(got, data[128 * 1024..]);
    let mut notes = Vec::new();
    while notes.is_empty() {
        assert!(Instant::now() < deadline, "no notification");
        d.take_notifications(&mut notes).unwrap();
    }
    assert_eq!(notes[0].msg, b"kv landed");
    p.deregister(&rs).unwrap();
    d.deregister(&rd).unwrap();
}

// ---- selection and the engines, in child processes (they need environment variables) ----

/// Runs the ignored test `name` of this binary in a child process with `env`; returns its output.
fn child(name: &str, env: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", name, "--ignored", "--test-threads=1", "--nocapture"]);
    for var in ["KVPUSH_DEVICE", "KVPUSH_LIBNRT", "KVPUSH_NEURON_RUNTIME", "KVPUSH_NEURON_CORE", "NEURON_RT_MAP_HBM"] {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied());
    let out = cmd.output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("1 passed"), "child {name} with {env:?} failed:\n{text}");
    text
}

#[test]
fn kvpush_device_selects_neuron_and_auto_prefers_it() {
    let fake = Fake::new(Variant::Full);
    let lib = fake.path.to_str().unwrap();
    child("child_select", &[("KVPUSH_LIBNRT", lib), ("KVPUSH_NEURON_RUNTIME", "own"), ("EXPECT", "neuron")]);
    child(
        "child_select",
        &[("KVPUSH_LIBNRT", lib), ("KVPUSH_NEURON_RUNTIME", "own"), ("FAKE_NRT_NC_COUNT", "0"), ("EXPECT", "absent")],
    );
    child("child_select", &[("KVPUSH_LIBNRT", lib), ("EXPECT", "not-running")]);
    child("child_select", &[("KVPUSH_LIBNRT", lib), ("KVPUSH_NEURON_RUNTIME", "bogus"), ("EXPECT", "bad-config")]);
    child(
        "child_select",
        &[
            ("KVPUSH_LIBNRT", lib),
            ("KVPUSH_NEURON_RUNTIME", "own"),
            ("FAKE_NRT_FAIL_DMABUF", "1"),
            ("EXPECT", "env-knob"),
        ],
    );
}

#[test]
#[ignore = "run by kvpush_device_selects_neuron_and_auto_prefers_it in a child process"]
fn child_select() {
    let expect = std::env::var("EXPECT").expect("run by the parent test, which sets EXPECT");
    match expect.as_str() {
        "neuron" => {
            for spec in ["neuron", "auto", " Neuron "] {
                let dev = select(spec).unwrap();
                assert_eq!(dev.kind(), DeviceKind::Neuron, "{spec}");
                let buf = dev.alloc(4096).unwrap();
                assert_eq!(dev.describe(buf.region().addr, 4096).unwrap().kind, MemKind::Vram);
            }
        }
        "absent" => {
            let err = select("neuron").unwrap_err();
            assert!(err.to_string().contains("no Neuron device"), "{err}");
            assert_ne!(select("auto").unwrap().kind(), DeviceKind::Neuron, "auto falls back");
        }
        "not-running" => {
            // Attach (the default) without a framework: explicit selection says what to do.
            let err = select("neuron").unwrap_err();
            assert!(err.to_string().contains("KVPUSH_NEURON_RUNTIME=own"), "{err}");
        }
        "bad-config" => {
            let err = select("neuron").unwrap_err();
            assert!(err.to_string().contains("KVPUSH_NEURON_RUNTIME=\"bogus\" is not valid"), "{err}");
        }
        "env-knob" => {
            // FAKE_NRT_FAIL_DMABUF=1 in the environment reaches the fake when it loads.
            let dev = NeuronDevice::from_env().unwrap();
            let buf = dev.alloc_tensor(4096).unwrap();
            let err = buf.dmabuf_fd().unwrap_err();
            assert!(err.to_string().contains("NRT_FAILURE (1)"), "{err}");
        }
        other => panic!("unknown EXPECT={other}"),
    }
}

#[test]
fn demo_engines_run_on_fake_neuron_memory() {
    let fake = Fake::new(Variant::Full);
    let out = child(
        "child_demo",
        &[
            ("KVPUSH_DEVICE", "neuron"),
            ("KVPUSH_LIBNRT", fake.path.to_str().unwrap()),
            ("KVPUSH_NEURON_RUNTIME", "own"),
        ],
    );
    assert!(out.contains("bytes verified on fake Neuron memory"), "{out}");
    for line in out.lines().filter(|l| l.contains("verified on fake Neuron")) {
        println!("child: {line}");
    }
}

#[test]
#[ignore = "run by demo_engines_run_on_fake_neuron_memory in a child process"]
fn child_demo() {
    use kvpush_testkit::demo::{self, Topology, Workload};

    let lib = std::env::var("KVPUSH_LIBNRT").expect("run by the parent test, which sets KVPUSH_LIBNRT");
    assert_eq!(std::env::var("KVPUSH_DEVICE").as_deref(), Ok("neuron"));
    // Loaded before the demo and kept, so its counters survive the demo's own unloading.
    let fake = Fake::existing(PathBuf::from(lib));
    let t = Topology {
        layers: 2,
        kv_heads: 2,
        head_dim: 16,
        p_tp: 2,
        d_tp: 1,
        p_block: 16,
        d_block: 32,
        num_blocks: 128,
        ..Topology::default()
    };
    let w = Workload {
        requests: 8,
        min_tokens: 1,
        max_tokens: 200,
        concurrency: 4,
        prefill_ns_per_token: 1000,
        relay_us: 100,
        seed: 11,
        ..Workload::default()
    };
    let report = demo::run(&t, &w, &[Mode::Push, Mode::Pull], &|| {}).unwrap();
    for (name, m) in [("push", report.push.as_ref().unwrap()), ("pull", report.pull.as_ref().unwrap())] {
        assert_eq!((m.verified, m.failed), (8, 0), "{name}: {m:?}");
        // 2 layers x K and V x 2 heads x 16 dims x 2 bytes per token, for the workload's token counts.
        let expected: u64 = demo::requests(&w).iter().map(|&(n, _)| n * 2 * 2 * 2 * 16 * 2).sum();
        assert_eq!(m.verified_bytes, expected, "{name}: {m:?}");
        println!("{name}: {} requests, {} bytes verified on fake Neuron memory", m.requests, m.verified_bytes);
    }
    // The demo's device (an owned runtime) is gone: one init, one close, no tensor left.
    assert_eq!((fake.get("init_calls"), fake.get("close_calls")), (1, 1));
    assert_eq!(fake.get("live_tensors"), 0);
    assert!(fake.get("writes") > 0 && fake.get("reads") > 0);
}

// ---- the host bounce (Trainium P → GPU D, docs/deployment.md §4) ----

/// A Neuron worker's offer: its NIC performs `device` on Neuron memory, everything on host memory.
fn trn_offer(device: RdmaOps) -> MemoryOffer {
    MemoryOffer { kind: MemoryKind::Neuron, device, host: RdmaOps::ALL }
}

/// A host-memory worker's offer (on a GPU D, host memory stands in for CUDA memory here).
const HOST_OFFER: MemoryOffer = MemoryOffer { kind: MemoryKind::Host, device: RdmaOps::ALL, host: RdmaOps::ALL };

/// Pushes 200 scattered 4 KiB blocks from P to D on the route both offers give, one side's KV in fake
/// Neuron memory and the other's in host memory, and checks every byte. Each side's NIC is a loopback
/// endpoint for host memory only (it refuses device memory), so the Neuron side's KV can cross only
/// through its host slots: the bounce side runs [`host_bounce`], the other plain staging with the
/// bounce's policy (every WRITE staged).
fn push_through_the_bounce(p_offer: MemoryOffer, d_offer: MemoryOffer, expected: Route) {
    let route = decide(Mode::Push, Some(&p_offer), Some(&d_offer));
    assert_eq!(route, expected, "P {p_offer}, D {d_offer}");
    let fake = Fake::new(Variant::Full);
    let neuron: Arc<dyn Device> = Arc::new(fake.open(RuntimeMode::Own).unwrap());
    let host: Arc<dyn Device> = Arc::new(HostDevice::new());
    let (p_dev, d_dev) = match route {
        Route::BounceOnP => (&neuron, &host),
        Route::BounceOnD => (&host, &neuron),
        other => panic!("not a bounce: {other:?}"),
    };
    let geometry = StagingConfig { slots: 2, slot_bytes: 64 << 10, max_entries: 64, ..StagingConfig::default() };
    let fabric = Fabric::new();
    let (p, d) = bounce::pair(&fabric, ("b-prefill", p_dev), ("b-decode", d_dev), DeviceKind::Neuron, geometry);
    let (src, dst) = (p_dev.alloc(1 << 20).unwrap(), d_dev.alloc(1 << 20).unwrap());
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    src.write_at(0, &data).unwrap();
    let (rs, rd) = (src.region(), dst.region());
    let neuron_kv = if route == Route::BounceOnP { rs } else { rd };
    assert_eq!(neuron_kv.kind, MemKind::Vram, "the bouncing side's KV is device memory");
    // SAFETY: both regions are buffers alive until after the transports are dropped (below); the test
    // reads them only when no transfer is in flight.
    unsafe {
        p.register(&rs).unwrap();
        d.register(&rd).unwrap();
    }
    let descs = bounce::scattered(&rs, &rd, 200, 256);
    let seen = bounce::push(&p, &d, &descs, b"bounced", Duration::from_secs(20));
    assert_eq!(seen[0].msg, b"bounced");
    let mut got = vec![0u8; 1 << 20];
    dst.read_at(0, &mut got).unwrap();
    for dsc in &descs {
        let (l, r) = ((dsc.local - rs.addr) as usize, (dsc.remote - rd.addr) as usize);
        assert_eq!(got[r..r + 4096], data[l..l + 4096], "descriptor {dsc:?}");
    }
    let untouched = (0..256u64).filter(|b| !descs.iter().any(|d| d.remote == rd.addr + b * 4096));
    for b in untouched {
        assert!(got[(b * 4096) as usize..][..4096].iter().all(|&x| x == 0), "block {b} was never a destination");
    }
    let (pc, dc) = (p.counts(), d.counts());
    assert_eq!((pc.transfers, pc.entries, dc.received), (1, 200, 1), "{pc:?} {dc:?}");
    assert!(pc.pieces >= 13, "800 KiB through 64 KiB slots (less their tables): {pc:?}");
    // The Neuron KV never reached the NIC: a transfer naming it directly is refused as unregistered.
    let (who, direct) = if route == Route::BounceOnP {
        (&p, Desc { local: rs.addr, remote: rd.addr, len: 4096 })
    } else {
        (&d, Desc { local: rd.addr, remote: rs.addr, len: 4096 })
    };
    let peer = if route == Route::BounceOnP { "b-decode" } else { "b-prefill" };
    let e = who.post(Op::Read, peer, &[direct], None).unwrap_err();
    assert!(matches!(e, TransportError::NotRegistered { side: "local", .. }), "{e}");
    drop((p, d));
    drop((src, dst));
}

#[test]
fn neuron_p_bounces_through_its_host_slots_into_host_d() {
    let no_write = RdmaOps { write: false, ..RdmaOps::ALL };
    push_through_the_bounce(trn_offer(no_write), HOST_OFFER, Route::BounceOnP);
}

#[test]
fn host_p_writes_into_neuron_d_through_its_host_slots() {
    let not_a_target = RdmaOps { target: false, ..RdmaOps::ALL };
    push_through_the_bounce(HOST_OFFER, trn_offer(not_a_target), Route::BounceOnD);
}

/// Engines whose offers leave no way to move bytes either way refuse each other at the handshake,
/// naming both offers; a pair that can move bytes one way (through a bounce) is accepted.
#[test]
fn a_pair_with_no_data_path_is_refused_at_the_handshake() {
    use kvpush::engine::{Config, EngineError, LocalHub, Staging};
    use kvpush_testkit::{engines, layouts};
    let (fabric, hub) = (Fabric::new(), LocalHub::new());
    let host: Arc<dyn Device> = Arc::new(HostDevice::new());
    let worker = |id: &str, memory: MemoryOffer| {
        let config = Config { memory: Some(memory), ..Config::new(id, Mode::Push) };
        // SAFETY: no request is ever started on these engines, so no block is read or written.
        unsafe { engines::loopback_worker(config, layouts::small(0, 1), &host, &fabric, id, &hub) }
    };
    let dead = MemoryOffer { kind: MemoryKind::Neuron, device: RdmaOps::NONE, host: RdmaOps::NONE };
    let gpu = MemoryOffer { kind: MemoryKind::Cuda, device: RdmaOps::NONE, host: RdmaOps::ALL };
    let (a, b) = (worker("trn-p", dead), worker("gpu-d", gpu));
    let err = b.engine.add_peer(&a.engine.handshake().unwrap()).unwrap_err();
    assert!(matches!(err, EngineError::NoDataPath { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains("peer trn-p: no data path"), "{text}");
    assert!(text.contains("neuron memory, NIC on it: none, on host memory: none"), "{text}");
    assert!(text.contains("cuda memory, NIC on it: none, on host memory: write+read+target"), "{text}");
    let err = a.engine.add_peer(&b.engine.handshake().unwrap()).unwrap_err();
    assert!(matches!(err, EngineError::NoDataPath { .. }), "both sides refuse: {err}");
    // A Neuron P whose NIC cannot WRITE from HBM, and an older D (no offer): a bounce on P.
    let (c, d) = (worker("trn-p2", trn_offer(RdmaOps { write: false, ..RdmaOps::ALL })), {
        // A D that stages (what a P running a bounce needs of its peer), with no offer.
        let config = Config { staging: Staging::On(StagingConfig::default()), ..Config::new("old-d", Mode::Push) };
        // SAFETY: as above.
        unsafe { engines::loopback_worker(config, layouts::small(0, 1), &host, &fabric, "old-d", &hub) }
    });
    assert_eq!(d.engine.handshake().unwrap().memory, None, "no offer sent without one configured");
    engines::connect(&c.engine, &d.engine);
}

/// Engines end to end on the route `decide` gives: the Neuron side's NIC cannot reach its HBM (its
/// endpoint is for host memory only, and its offer says so), so its engine runs its KV through host
/// slots; the host side stages every WRITE (a D receiving from a bouncing P needs staging on; a P
/// writing into a bouncing D, the bounce's policy). One request, every byte of its blocks checked.
fn engines_push_through_the_bounce(p_offer: Option<MemoryOffer>, d_offer: Option<MemoryOffer>, expected: Route) {
    use kvpush::engine::{Config, Finished, LocalHub, Staging};
    use kvpush::proto::layout::Parallel;
    use kvpush::proto::Key;
    use kvpush_testkit::{engines, layouts};
    assert_eq!(decide(Mode::Push, p_offer.as_ref(), d_offer.as_ref()), expected);
    let fake = Fake::new(Variant::Full);
    let neuron: Arc<dyn Device> = Arc::new(fake.open(RuntimeMode::Own).unwrap());
    let host: Arc<dyn Device> = Arc::new(HostDevice::new());
    let (fabric, hub) = (Fabric::new(), LocalHub::new());
    let layout = layouts::separate(layouts::full_model(2, 1, 64), 64, Parallel::SINGLE);
    let (p_dev, d_dev, p_staging) = match expected {
        Route::BounceOnP => (&neuron, &host, Staging::Auto),
        Route::BounceOnD => (&host, &neuron, Staging::On(bounce_geometry(StagingConfig::default()))),
        other => panic!("not a bounce: {other:?}"),
    };
    let p_cfg = Config { memory: p_offer, staging: p_staging, ..Config::new("bp", Mode::Push) };
    let d_cfg =
        Config { memory: d_offer, staging: Staging::On(StagingConfig::default()), ..Config::new("bd", Mode::Push) };
    // SAFETY: (precondition 2) P's blocks are written before `request_finished` and read after its
    // outcome; D's are read only after its outcome.
    let p = unsafe { engines::loopback_worker(p_cfg, layout.clone(), p_dev, &fabric, "bp", &hub) };
    // SAFETY: as above.
    let d = unsafe { engines::loopback_worker(d_cfg, layout.clone(), d_dev, &fabric, "bd", &hub) };
    engines::connect(&p.engine, &d.engine);
    let bouncer = if expected == Route::BounceOnP { &p } else { &d };
    assert_eq!(bouncer.buffers[0].region().kind, MemKind::Vram, "the bouncing side's KV is Neuron memory");
    let len = layout.region_len() as usize;
    for (r, b) in p.buffers.iter().enumerate() {
        let bytes: Vec<u8> = (0..len).map(|i| ((i * 7 + r * 131) % 251) as u8 + 1).collect();
        b.write_at(0, &bytes).unwrap();
    }
    let (src, dst) = ([3u32, 9, 10, 40, 41, 63], [5u32, 6, 60, 1, 2, 30]);
    let tokens = u64::from(layout.block_tokens) * src.len() as u64;
    let key = Key::new(0xb0, 1);
    p.engine.request_finished(key, vec![src.to_vec()], tokens).unwrap();
    d.engine.blocks_allocated(key, "bp", vec![dst.to_vec()], tokens).unwrap();
    let limit = Duration::from_secs(20);
    let got = engines::wait_for(&d.engine, "received", limit, |f| !matches!(f, Finished::Ended { .. }));
    assert!(matches!(got, Finished::Received { .. }), "{got:?}");
    let sent = engines::wait_for(&p.engine, "sent", limit, |f| !matches!(f, Finished::Ended { .. }));
    assert!(matches!(sent, Finished::Sent { .. }), "{sent:?}");
    let stride = layout.block_stride;
    let part = layout.part_bytes() as usize;
    let (mut a, mut b) = (vec![0u8; part], vec![0u8; part]);
    for (r, (pb, db)) in p.buffers.iter().zip(&d.buffers).enumerate() {
        for (&s, &t) in src.iter().zip(&dst) {
            pb.read_at(u64::from(s) * stride, &mut a).unwrap();
            db.read_at(u64::from(t) * stride, &mut b).unwrap();
            assert_eq!(a, b, "region {r}: P block {s} → D block {t}");
        }
        db.read_at(0, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 0), "region {r}: D block 0 was not a destination");
    }
    let (pc, dc) = (p.engine.staging_counts().expect("P stages"), d.engine.staging_counts().expect("D stages"));
    assert!(pc.pieces > 0 && pc.transfers == 1 && dc.received == 1, "through the slots: {pc:?} {dc:?}");
    drop((p, d));
}

#[test]
fn engines_push_from_neuron_p_through_the_host_bounce() {
    let offer = trn_offer(RdmaOps { write: false, ..RdmaOps::ALL });
    engines_push_through_the_bounce(Some(offer), None, Route::BounceOnP);
}

#[test]
fn engines_push_into_neuron_d_through_the_host_bounce() {
    let offer = trn_offer(RdmaOps { target: false, ..RdmaOps::ALL });
    engines_push_through_the_bounce(None, Some(offer), Route::BounceOnD);
}
