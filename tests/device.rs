//! The device layer from the outside: backend selection (`select`, `KVPUSH_DEVICE`), host buffers
//! (anonymous and file-backed) and host range validation, and the mock device's attribution and
//! fault injection.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use kvpush::device::host::HostDevice;
use kvpush::device::mock::{MockDevice, MockFaults};
use kvpush::device::{from_env, select, Buffer, Device, DeviceError, DeviceKind, MemKind};

/// A fresh path in the temp directory, removed on drop.
struct TempPath(PathBuf);

impl TempPath {
    fn new(tag: &str) -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        TempPath(std::env::temp_dir().join(format!("kvpush-device-{}-{tag}-{n}", std::process::id())))
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

// ---- selection ----

/// What `auto` must pick on this machine: the first of Neuron, CUDA and host that opens (CI machines
/// have neither libnrt nor a GPU, so host; the GPU machine, CUDA).
fn auto_expected() -> DeviceKind {
    if select("neuron").is_ok() {
        DeviceKind::Neuron
    } else if select("cuda").is_ok() {
        DeviceKind::Cuda
    } else {
        DeviceKind::Host
    }
}

#[test]
fn select_names() {
    assert_eq!(select("host").unwrap().kind(), DeviceKind::Host);
    assert_eq!(select("HOST").unwrap().kind(), DeviceKind::Host);
    assert_eq!(select(" Mock ").unwrap().kind(), DeviceKind::Mock);
    let auto = auto_expected();
    assert_eq!(select("auto").unwrap().kind(), auto);
    assert_eq!(select("").unwrap().kind(), auto);
}

#[test]
fn select_unknown_lists_valid_values() {
    let err = select("bogus").unwrap_err();
    assert_eq!(err, DeviceError::Unknown { value: "bogus".into() });
    let msg = err.to_string();
    for name in ["auto", "neuron", "cuda", "host", "mock", "bogus"] {
        assert!(msg.contains(name), "{msg:?} does not mention {name}");
    }
}

#[test]
fn select_unavailable_names_what_was_tried() {
    for name in ["cuda", "neuron"] {
        let err = match select(name) {
            // A machine with this backend (the GPU machine has CUDA): nothing to refuse.
            Ok(dev) => {
                assert_eq!(dev.kind().to_string(), name);
                continue;
            }
            Err(err) => err,
        };
        let DeviceError::Unavailable { requested, tried } = &err else { panic!("{name}: {err:?}") };
        assert_eq!(requested, name);
        assert_eq!(tried.len(), 1, "an explicit backend never falls back: {tried:?}");
        assert_eq!(tried[0].0, name);
        // Both backends are built in; this machine has neither library, and the error names it.
        let why = &tried[0].1;
        let library = if name == "neuron" { "libnrt" } else { "libcuda" };
        assert!(why.contains("not part of this build") || why.contains(library), "{why:?}");
        let msg = err.to_string();
        assert!(msg.contains(name) && msg.contains(why.as_str()), "{msg}");
    }
}

/// The only test that touches the environment (it is process-wide and tests run in parallel threads).
#[test]
fn from_env_honors_kvpush_device() {
    let saved = std::env::var_os("KVPUSH_DEVICE");
    std::env::set_var("KVPUSH_DEVICE", "mock");
    assert_eq!(from_env().unwrap().kind(), DeviceKind::Mock);
    std::env::set_var("KVPUSH_DEVICE", "Host");
    assert_eq!(from_env().unwrap().kind(), DeviceKind::Host);
    std::env::set_var("KVPUSH_DEVICE", "bogus");
    assert!(matches!(from_env(), Err(DeviceError::Unknown { value }) if value == "bogus"));
    std::env::set_var("KVPUSH_DEVICE", "cuda");
    match select("cuda") {
        Ok(_) => assert_eq!(from_env().unwrap().kind(), DeviceKind::Cuda),
        Err(_) => assert!(matches!(from_env(), Err(DeviceError::Unavailable { .. }))),
    }
    std::env::remove_var("KVPUSH_DEVICE");
    assert_eq!(from_env().unwrap().kind(), auto_expected(), "unset means auto");
    if let Some(v) = saved {
        std::env::set_var("KVPUSH_DEVICE", v);
    }
}

// ---- host ----

#[test]
fn host_alloc_read_write() {
    let dev = select("host").unwrap();
    let buf = dev.alloc(1 << 16).unwrap();
    let r = buf.region();
    assert_eq!((r.kind, r.dev_id, r.len), (MemKind::Dram, 0, 1 << 16));
    let data: Vec<u8> = (0..=255).collect();
    buf.write_at(1000, &data).unwrap();
    let mut out = vec![0; 256];
    buf.read_at(1000, &mut out).unwrap();
    assert_eq!(out, data);
    let err = buf.read_at((1 << 16) - 255, &mut out).unwrap_err();
    assert!(matches!(err, DeviceError::Copy { device: DeviceKind::Host, len: 256, .. }), "{err}");
    assert!(matches!(dev.alloc(0), Err(DeviceError::Alloc { .. })));
}

#[test]
fn host_slices_fill_and_checksum() {
    let mut buf = HostDevice::new().alloc_anon(4096).unwrap();
    for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let sum: u64 = buf.as_slice().iter().map(|&b| u64::from(b)).sum();
    let expected: u64 = (0..4096u64).map(|i| i % 251).sum();
    assert_eq!(sum, expected);
    let mut out = [0u8; 4];
    buf.read_at(251, &mut out).unwrap();
    assert_eq!(out, [0, 1, 2, 3]);
}

#[test]
fn host_describe() {
    let dev = HostDevice::new();
    let buf = dev.alloc(1 << 20).unwrap();
    let r = buf.region();
    assert_eq!(dev.describe(r.addr, r.len).unwrap(), r);
    assert!(dev.describe(r.addr + 123, 4567).is_ok());

    // Memory the process did not get from kvpush: a Vec and a stack variable.
    let v = vec![1u8; 10_000];
    assert_eq!(dev.describe(v.as_ptr() as u64, v.len() as u64).unwrap().kind, MemKind::Dram);
    let local = [0u64; 8];
    assert!(dev.describe(local.as_ptr() as u64, 64).is_ok());

    let err = dev.describe(0, 4096).unwrap_err();
    assert!(matches!(err, DeviceError::NotDeviceMemory { device: DeviceKind::Host, addr: 0, .. }), "{err}");
    assert!(dev.describe(r.addr, 0).is_err());
    assert!(dev.describe(u64::MAX - 100, 4096).is_err());
    if cfg!(target_os = "linux") {
        let err = dev.describe(0x7fff_ffff_0000_0000, 4096).unwrap_err();
        assert!(err.to_string().contains("not mapped"), "{err}");
        // Page 0 is never mapped.
        assert!(dev.describe(16, 16).is_err());
    }
}

#[test]
fn host_file_mapping_persists() {
    let tmp = TempPath::new("persist");
    let dev = HostDevice::new();
    {
        let mut buf = dev.alloc_file(&tmp.0, 8192).unwrap();
        assert_eq!(buf.path(), Some(tmp.0.as_path()));
        assert_eq!(buf.as_slice(), &[0u8; 8192][..], "a new file reads as zeros");
        buf.as_mut_slice()[..5].copy_from_slice(b"hello");
        buf.write_at(8187, b"world").unwrap();
        let r = buf.region();
        assert_eq!(dev.describe(r.addr, r.len).unwrap(), r);
        buf.flush().unwrap();
    }
    let bytes = std::fs::read(&tmp.0).unwrap();
    assert_eq!(bytes.len(), 8192);
    assert_eq!(&bytes[..5], b"hello");
    assert_eq!(&bytes[8187..], b"world");

    // Mapping it again (even shorter) sees the data; a longer map extends the file.
    let mut again = dev.alloc_file(&tmp.0, 4096).unwrap();
    assert_eq!(&again.as_slice()[..5], b"hello");
    drop(again);
    assert_eq!(std::fs::metadata(&tmp.0).unwrap().len(), 8192, "a shorter map does not truncate");
    let mut longer = dev.alloc_file(&tmp.0, 16384).unwrap();
    assert_eq!(&longer.as_slice()[8187..8192], b"world");
    assert_eq!(std::fs::metadata(&tmp.0).unwrap().len(), 16384);
}

#[test]
fn host_file_mapping_errors_name_the_path() {
    let dev = HostDevice::new();
    let missing = std::env::temp_dir().join("kvpush-no-such-dir").join("kv.bin");
    let err = dev.alloc_file(&missing, 4096).unwrap_err();
    assert!(matches!(err, DeviceError::Alloc { device: DeviceKind::Host, len: 4096, .. }), "{err}");
    assert!(err.to_string().contains("kvpush-no-such-dir"), "{err}");
    let tmp = TempPath::new("zero");
    assert!(matches!(dev.alloc_file(&tmp.0, 0), Err(DeviceError::Alloc { len: 0, .. })));
}

// ---- mock ----

#[test]
fn mock_describe_inside_outside_straddling() {
    let dev = MockDevice::new();
    let a = dev.alloc(4096).unwrap();
    let ra = a.region();
    assert_eq!((ra.kind, ra.dev_id), (MemKind::Vram, 0));
    assert_eq!(dev.describe(ra.addr, ra.len).unwrap(), ra);
    assert_eq!(dev.describe(ra.addr + 100, 200).unwrap().len, 200);

    // Outside: host memory, and another mock's memory.
    let host = HostDevice::new().alloc_anon(4096).unwrap();
    let err = dev.describe(host.region().addr, 16).unwrap_err();
    assert!(matches!(err, DeviceError::NotDeviceMemory { device: DeviceKind::Mock, .. }), "{err}");
    assert!(err.to_string().contains("not allocated by this device"), "{err}");
    let other = MockDevice::new();
    let b = other.alloc(4096).unwrap();
    assert!(dev.describe(b.region().addr, 1).is_err());
    assert!(other.describe(b.region().addr, 1).is_ok());

    // Straddling the end, and starting before the start.
    let err = dev.describe(ra.addr + 4000, 200).unwrap_err();
    assert!(err.to_string().contains("past the end"), "{err}");
    assert!(dev.describe(ra.addr - 1, 2).is_err());
    assert!(dev.describe(ra.addr, 0).is_err());
}

#[test]
fn mock_claimed_device_must_match() {
    let dev = MockDevice::with_dev_id(2);
    let buf = dev.alloc(1024).unwrap();
    let r = buf.region();
    assert_eq!(r.dev_id, 2);
    assert_eq!(dev.describe_on(r.addr, r.len, 2).unwrap(), r);
    let err = dev.describe_on(r.addr, r.len, 1).unwrap_err();
    assert!(matches!(err, DeviceError::NotDeviceMemory { device: DeviceKind::Mock, .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("mock device 2") && msg.contains("claimed device 1"), "{msg}");
}

#[test]
fn mock_frees_and_untracks_on_drop() {
    let dev = MockDevice::new();
    let a = dev.alloc(4096).unwrap();
    let b = dev.alloc(100).unwrap();
    assert_eq!((dev.live_allocations(), dev.live_bytes()), (2, 4196));
    let ra = a.region();
    drop(a);
    assert_eq!((dev.live_allocations(), dev.live_bytes()), (1, 100));
    let err = dev.describe(ra.addr, 1).unwrap_err();
    assert!(err.to_string().contains("not allocated by this device"), "{err}");
    drop(b);
    let stats = dev.stats();
    assert_eq!((stats.allocs, stats.frees, stats.live_allocations, stats.live_bytes), (2, 2, 0, 0));
}

#[test]
fn mock_injected_faults() {
    let dev = MockDevice::new();

    dev.fail_next_allocs(2);
    for _ in 0..2 {
        assert_eq!(dev.alloc(64).unwrap_err(), DeviceError::Injected { device: DeviceKind::Mock, what: "alloc" });
    }
    let buf = dev.alloc(64).unwrap();
    assert_eq!(dev.stats().allocs, 1, "failed allocations are not counted");

    dev.fail_describe(true);
    let err = dev.describe(buf.region().addr, 8).unwrap_err();
    assert_eq!(err, DeviceError::Injected { device: DeviceKind::Mock, what: "describe" });
    assert!(err.to_string().contains("injected"), "{err}");
    assert!(dev.describe(buf.region().addr, 8).is_err(), "every describe fails while set");
    assert!(dev.describe_on(buf.region().addr, 8, 0).is_err());
    dev.fail_describe(false);
    assert!(dev.describe(buf.region().addr, 8).is_ok());

    dev.fail_next_copies(2);
    assert!(matches!(buf.write_at(0, b"x"), Err(DeviceError::Injected { what: "write", .. })));
    let mut out = [0u8; 1];
    assert!(matches!(buf.read_at(0, &mut out), Err(DeviceError::Injected { what: "read", .. })));
    buf.write_at(0, b"x").unwrap();
    buf.read_at(0, &mut out).unwrap();
    assert_eq!(&out, b"x");

    // Everything at once through set_faults, read back through faults().
    let faults = MockFaults { fail_allocs: 1, fail_describe: true, fail_copies: 3 };
    dev.set_faults(faults);
    assert_eq!(dev.faults(), faults);
    assert!(dev.alloc(64).is_err());
    assert_eq!(dev.faults().fail_allocs, 0);
    dev.set_faults(MockFaults::default());
    assert!(dev.alloc(64).is_ok());
    buf.write_at(0, b"y").unwrap();
}

#[test]
fn buffers_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<kvpush::device::host::HostBuffer>();
    check::<kvpush::device::mock::MockBuffer>();
    check::<HostDevice>();
    check::<MockDevice>();

    let dev = MockDevice::new();
    let buf = dev.alloc(4 * 256).unwrap();
    std::thread::scope(|s| {
        for t in 0..4u8 {
            let buf = &buf;
            s.spawn(move || buf.write_at(u64::from(t) * 256, &[t; 256]).unwrap());
        }
    });
    let mut out = vec![0u8; 1024];
    buf.read_at(0, &mut out).unwrap();
    assert!(out.chunks(256).enumerate().all(|(i, c)| c.iter().all(|&b| usize::from(b) == i)));
}
