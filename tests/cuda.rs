//! The CUDA backend without a GPU: pointer validation against a mock of the driver queries, staging
//! plans and the reference gather/scatter they drive, and the errors a machine without CUDA gives.
//!
//! What needs a GPU (the kernels, the real driver's answers) runs in benches/gpu_push.rs on the GPU
//! machine; its driver-validation answers are recorded in benches/results/gpu-h200x2.json. The CUDA
//! stager's tests at the end, and the loopback transport and the one-process demo on GPU memory,
//! run here where a CUDA driver loads (device 0), and return at once where none does (every CI
//! machine). scripts/gpu_check.sh runs them on the GPU machine.

use std::collections::HashSet;

use kvpush::device::cuda::{CudaBuffer, CudaDevice};
use kvpush::device::{select, BadEntry, Buffer, Device, DeviceError, DeviceKind, StageEntry, Stager};
use kvpush_cuda::pointer::{validate, MemoryType, PointerQueries};
use kvpush_cuda::unitpack::{self as unitpack, PackError, Piece, Side, UnitSpace};
use kvpush_cuda::{CudaError, DriverStatus, Gpu};
use kvpush_testkit::rng::Rng;
use proptest::prelude::*;

// ---- a mock of the driver's pointer queries ----

#[derive(Clone, Debug)]
struct Alloc {
    base: u64,
    len: u64,
    device: i32,
    kind: MemoryType,
    managed: bool,
}

/// Answers like the driver: an address inside a known allocation gets its attributes, any other
/// address `CUDA_ERROR_INVALID_VALUE`. `fail` makes every query fail with that status instead.
#[derive(Default)]
struct MockDriver {
    allocs: Vec<Alloc>,
    fail: Option<(i32, &'static str)>,
    fail_range: bool,
}

impl MockDriver {
    fn find(&self, addr: u64) -> Result<&Alloc, DriverStatus> {
        if let Some((code, name)) = self.fail {
            return Err(DriverStatus::new(code, name));
        }
        self.allocs
            .iter()
            .find(|a| addr >= a.base && addr < a.base + a.len)
            .ok_or_else(|| DriverStatus::new(DriverStatus::INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"))
    }
}

impl PointerQueries for MockDriver {
    fn memory_type(&self, addr: u64) -> Result<MemoryType, DriverStatus> {
        self.find(addr).map(|a| a.kind)
    }
    fn is_managed(&self, addr: u64) -> Result<bool, DriverStatus> {
        self.find(addr).map(|a| a.managed)
    }
    fn device_ordinal(&self, addr: u64) -> Result<i32, DriverStatus> {
        self.find(addr).map(|a| a.device)
    }
    fn address_range(&self, addr: u64) -> Result<(u64, u64), DriverStatus> {
        if self.fail_range {
            return Err(DriverStatus::new(201, "CUDA_ERROR_INVALID_CONTEXT"));
        }
        self.find(addr).map(|a| (a.base, a.len))
    }
}

fn device_alloc(base: u64, len: u64, device: i32) -> Alloc {
    Alloc { base, len, device, kind: MemoryType::Device, managed: false }
}

fn two_gpus() -> MockDriver {
    MockDriver {
        allocs: vec![
            device_alloc(0x7f00_0000_0000, 1 << 30, 0),
            device_alloc(0x7f10_0000_0000, 1 << 20, 1),
            Alloc { base: 0x7f20_0000_0000, len: 1 << 20, device: 0, kind: MemoryType::Host, managed: false },
            Alloc { base: 0x7f30_0000_0000, len: 1 << 20, device: 0, kind: MemoryType::Device, managed: true },
            Alloc { base: 0x7f40_0000_0000, len: 1 << 20, device: 0, kind: MemoryType::Array, managed: false },
        ],
        ..MockDriver::default()
    }
}

#[test]
fn accepts_device_memory_of_the_claimed_device_and_attributes_it() {
    let d = two_gpus();
    let info = validate(&d, 0x7f00_0000_1000, 4096, 0).unwrap();
    assert_eq!((info.device, info.alloc_base, info.alloc_len), (0, 0x7f00_0000_0000, 1 << 30));
    assert_eq!((info.addr, info.len), (0x7f00_0000_1000, 4096));
    // The whole allocation, exactly.
    assert!(validate(&d, 0x7f00_0000_0000, 1 << 30, 0).is_ok());
    let info = validate(&d, 0x7f10_0000_0000, 1 << 20, 1).unwrap();
    assert_eq!(info.device, 1);
}

#[test]
fn another_devices_memory_is_refused_naming_both_devices() {
    let d = two_gpus();
    let err = validate(&d, 0x7f10_0000_0000, 4096, 0).unwrap_err();
    assert_eq!(err, CudaError::WrongDevice { addr: 0x7f10_0000_0000, len: 4096, claimed: 0, actual: 1 });
    let msg = err.to_string();
    assert!(msg.contains("device 1") && msg.contains("not of device 0") && msg.contains("0x7f1000000000"), "{msg}");
}

#[test]
fn memory_that_is_not_device_memory_is_refused_with_what_it_is() {
    let d = two_gpus();
    let cases = [
        (0x1234_5000u64, "does not know this address"),
        (0x7f20_0000_0000, "page-locked host memory"),
        (0x7f30_0000_0000, "managed"),
        (0x7f40_0000_0000, "CUDA array"),
    ];
    for (addr, why) in cases {
        let err = validate(&d, addr, 4096, 0).unwrap_err();
        let CudaError::NotDeviceMemory { addr: a, len, reason } = &err else { panic!("{addr:#x}: {err:?}") };
        assert_eq!((*a, *len), (addr, 4096));
        assert!(reason.contains(why), "{addr:#x}: {reason}");
        assert!(err.to_string().contains("is not CUDA device memory"), "{err}");
    }
}

#[test]
fn a_range_running_past_its_allocation_is_refused() {
    let d = two_gpus();
    let end = 0x7f00_0000_0000 + (1u64 << 30);
    let err = validate(&d, end - 2048, 4096, 0).unwrap_err();
    assert_eq!(
        err,
        CudaError::OutsideAllocation {
            addr: end - 2048,
            len: 4096,
            alloc_base: 0x7f00_0000_0000,
            alloc_len: 1 << 30,
            device: 0
        }
    );
    assert!(err.to_string().contains("runs past the end of its CUDA allocation"), "{err}");
    // One byte less fits.
    assert!(validate(&d, end - 2048, 2048, 0).is_ok());
}

#[test]
fn null_empty_and_wrapping_ranges_are_refused_before_asking_the_driver() {
    // A driver that fails every query: these must be refused without a query.
    let d = MockDriver { fail: Some((999, "CUDA_ERROR_UNKNOWN")), ..MockDriver::default() };
    for (addr, len, why) in [(0, 16, "null"), (0x1000, 0, "empty"), (u64::MAX - 8, 16, "wraps")] {
        let err = validate(&d, addr, len, 0).unwrap_err();
        assert!(matches!(&err, CudaError::InvalidRange { reason, .. } if reason.contains(why)), "{err:?}");
    }
}

#[test]
fn driver_failures_name_the_call_and_status() {
    let d = MockDriver { fail: Some((DriverStatus::NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED")), ..two_gpus() };
    let err = validate(&d, 0x7f00_0000_0000, 16, 0).unwrap_err();
    let CudaError::Driver { call, status, .. } = &err else { panic!("{err:?}") };
    assert_eq!((*call, status.code), ("cuPointerGetAttribute(MEMORY_TYPE)", 3));
    assert!(err.to_string().contains("CUDA_ERROR_NOT_INITIALIZED (3)"), "{err}");

    let d = MockDriver { fail_range: true, ..two_gpus() };
    let err = validate(&d, 0x7f00_0000_0000, 16, 0).unwrap_err();
    assert!(matches!(&err, CudaError::Driver { call: "cuMemGetAddressRange", device: Some(0), .. }), "{err:?}");
    assert!(err.to_string().contains("on CUDA device 0"), "{err}");
}

proptest! {
    /// Against a model: a range is accepted iff it lies in one device allocation of the claimed
    /// device; otherwise the error says which of the reasons applies.
    #[test]
    fn validation_matches_the_model(
        allocs in prop::collection::vec((0u64..64, 1u64..8, 0i32..3, 0u8..4), 1..6),
        offset in 0u64..(80 << 12),
        len in 1u64..(12 << 12),
        claimed in 0u32..3,
    ) {
        // Allocations in 4 KiB pages at distinct page offsets (overlaps dropped, like a real driver's).
        let mut d = MockDriver::default();
        let mut used = HashSet::new();
        for (page, pages, device, k) in allocs {
            if (page..page + pages).any(|p| used.contains(&p)) {
                continue;
            }
            used.extend(page..page + pages);
            let (kind, managed) = match k { 0 | 1 => (MemoryType::Device, false), 2 => (MemoryType::Host, false), _ => (MemoryType::Device, true) };
            d.allocs.push(Alloc { base: 0x10_0000 + (page << 12), len: pages << 12, device, kind, managed });
        }
        let addr = 0x10_0000 + offset;
        let holder = d.allocs.iter().find(|a| addr >= a.base && addr < a.base + a.len).cloned();
        let r = validate(&d, addr, len, claimed);
        match holder {
            None => prop_assert!(matches!(r, Err(CudaError::NotDeviceMemory { .. })), "{:?}", r),
            Some(a) if a.kind != MemoryType::Device || a.managed => {
                prop_assert!(matches!(r, Err(CudaError::NotDeviceMemory { .. })), "{:?}", r)
            }
            Some(a) if a.device as u32 != claimed => {
                prop_assert!(matches!(r, Err(CudaError::WrongDevice { .. })), "{:?}", r)
            }
            Some(a) if addr + len > a.base + a.len => {
                prop_assert!(matches!(r, Err(CudaError::OutsideAllocation { .. })), "{:?}", r)
            }
            Some(a) => {
                let info = r.unwrap();
                prop_assert_eq!((info.alloc_base, info.alloc_len, info.device), (a.base, a.len, claimed));
            }
        }
    }
}

// ---- staging plans ----

const UNIT: u64 = 4096;

fn qwen_16k() -> UnitSpace {
    UnitSpace { regions: 128, blocks: 1024, unit_bytes: UNIT }
}

#[test]
fn a_16k_request_goes_through_bounded_slots_in_pieces() {
    let plan = unitpack::plan(qwen_16k(), 32 << 20, 4).unwrap();
    assert_eq!(plan.space.bytes(), 512 << 20);
    assert_eq!(plan.pieces.len(), 16, "512 MiB in 32 MiB pieces");
    for (i, p) in plan.pieces.iter().enumerate() {
        assert_eq!(
            *p,
            Piece { index: i as u32, slot: i as u32 % 4, first_unit: i as u64 * 8192, units: 8192, bytes: 32 << 20 }
        );
    }
    assert_eq!(plan.staging_bytes(), 128 << 20, "4 slots of 32 MiB, reused 4 times each");
    // A request smaller than one slot: one piece, one slot used.
    let small = unitpack::plan(UnitSpace { regions: 128, blocks: 64, unit_bytes: UNIT }, 32 << 20, 4).unwrap();
    assert_eq!(small.pieces.len(), 1);
    assert_eq!((small.pieces[0].units, small.pieces[0].bytes, small.staging_bytes()), (8192, 32 << 20, 32 << 20));
}

#[test]
fn the_last_piece_carries_the_remainder() {
    let plan = unitpack::plan(UnitSpace { regions: 3, blocks: 5, unit_bytes: 64 }, 4 * 64 + 16, 2).unwrap();
    let units: Vec<u64> = plan.pieces.iter().map(|p| p.units).collect();
    assert_eq!(units, [4, 4, 4, 3], "15 units, 4 per slot (a slot holds whole units only)");
    let slots: Vec<u32> = plan.pieces.iter().map(|p| p.slot).collect();
    assert_eq!(slots, [0, 1, 0, 1]);
    assert_eq!(plan.pieces[3].first_unit, 12);
}

#[test]
fn unusable_geometry_is_refused() {
    let s = qwen_16k();
    let bad = [
        unitpack::plan(s, 32 << 20, 0),
        unitpack::plan(s, 2048, 4),
        unitpack::plan(s, (32 << 20) + 8, 4),
        unitpack::plan(UnitSpace { unit_bytes: 4100, ..s }, 32 << 20, 4),
        unitpack::plan(UnitSpace { blocks: 0, ..s }, 32 << 20, 4),
    ];
    let whys = ["no staging slot", "at least one unit", "multiple of 16", "multiple of 16", "nothing to move"];
    for (r, why) in bad.into_iter().zip(whys) {
        let err = r.unwrap_err();
        assert!(matches!(&err, PackError::Geometry(m) if m.contains(why)), "{why}: {err}");
    }
}

proptest! {
    /// Pieces cover every unit exactly once, in order, each within a slot, slots round-robin.
    #[test]
    fn pieces_partition_the_request(
        regions in 1u32..40, blocks in 1u32..300, unit16 in 1u64..300, slot_units in 1u64..500, extra in 0u64..16, slots in 1u32..6,
    ) {
        let space = UnitSpace { regions, blocks, unit_bytes: unit16 * 16 };
        let slot_bytes = slot_units * space.unit_bytes + extra * 16;
        let plan = unitpack::plan(space, slot_bytes, slots).unwrap();
        let per = slot_bytes / space.unit_bytes;
        prop_assert!(per >= slot_units);
        let mut next = 0u64;
        for (i, p) in plan.pieces.iter().enumerate() {
            prop_assert_eq!(p.index as usize, i);
            prop_assert_eq!(p.slot, i as u32 % slots);
            prop_assert_eq!(p.first_unit, next);
            prop_assert!(p.units >= 1 && p.bytes == p.units * space.unit_bytes && p.bytes <= slot_bytes);
            if i + 1 < plan.pieces.len() {
                prop_assert_eq!(p.units, per, "only the last piece may be short");
            }
            next += p.units;
        }
        prop_assert_eq!(next, space.units());
        prop_assert!(plan.staging_bytes() <= u64::from(slots) * slot_bytes);
    }
}

/// Runs a whole staged transfer with the reference gather/scatter: P's blocks (filled with the
/// pattern) → P slot → D slot → D's blocks, slots reused; then checks every unit on D and that no
/// other block of D changed.
fn staged_round_trip(regions: u32, pool: u32, blocks: u32, unit: u64, slot_bytes: u64, slots: u32, seed: u64) {
    let space = UnitSpace { regions, blocks, unit_bytes: unit };
    let region_len = u64::from(pool) * unit;
    let (p_base, d_base) = (0x1000_0000u64, 0x9000_0000u64);
    let p_bases: Vec<u64> = (0..u64::from(regions)).map(|r| p_base + r * region_len).collect();
    let d_bases: Vec<u64> = (0..u64::from(regions)).map(|r| d_base + r * region_len).collect();
    let mut rng = Rng(seed);
    let p_ids = rng.permutation(pool, blocks as usize);
    let d_ids = rng.permutation(pool, blocks as usize);
    let p = Side { bases: &p_bases, ids: &p_ids, stride: unit };
    let d = Side { bases: &d_bases, ids: &d_ids, stride: unit };
    let mut p_mem = vec![0u8; (region_len * u64::from(regions)) as usize];
    let mut d_mem = vec![0xa5u8; p_mem.len()];
    for u in 0..space.units() {
        let (r, j) = space.locate(u);
        let off = (p.unit_addr(&space, u) - p_base) as usize;
        unitpack::pattern_fill(seed, r, j, &mut p_mem[off..off + unit as usize]);
    }
    let plan = unitpack::plan(space, slot_bytes, slots).expect("plan");
    let mut p_slots = vec![vec![0u8; slot_bytes as usize]; slots as usize];
    let mut d_slots = vec![vec![0u8; slot_bytes as usize]; slots as usize];
    for piece in &plan.pieces {
        let s = piece.slot as usize;
        unitpack::gather(&space, piece, &p, &p_mem, p_base, &mut p_slots[s]).expect("gather");
        d_slots[s][..piece.bytes as usize].copy_from_slice(&p_slots[s][..piece.bytes as usize]); // the WRITE
        unitpack::scatter(&space, piece, &d, &d_slots[s], &mut d_mem, d_base).expect("scatter");
    }
    let mut touched = vec![false; (u64::from(regions) * u64::from(pool)) as usize];
    for u in 0..space.units() {
        let (r, j) = space.locate(u);
        let off = (d.unit_addr(&space, u) - d_base) as usize;
        assert_eq!(
            unitpack::pattern_check(seed, r, j, &d_mem[off..off + unit as usize]),
            None,
            "unit {u} (r {r}, j {j})"
        );
        touched[off / unit as usize] = true;
    }
    for (b, chunk) in d_mem.chunks(unit as usize).enumerate() {
        if !touched[b] {
            assert!(chunk.iter().all(|&x| x == 0xa5), "D block {b} outside the request was written");
        }
    }
}

#[test]
fn staged_transfer_reassembles_every_unit_in_place() {
    // 8 regions × 40 of 64 pool blocks, 4 KiB units, 3 slots of 5 units: 64 pieces, each slot reused.
    staged_round_trip(8, 64, 40, UNIT, 5 * UNIT, 3, 0x1234);
    // One slot only: strictly sequential reuse.
    staged_round_trip(4, 32, 32, 256, 256 * 7, 1, 77);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn staged_transfer_any_geometry(
        regions in 1u32..6, pool in 1u32..40, take in 1u32..40, unit16 in 1u64..20, slot_units in 1u64..9, slots in 1u32..4, seed in any::<u64>(),
    ) {
        staged_round_trip(regions, pool, take.min(pool), unit16 * 16, slot_units * unit16 * 16, slots, seed);
    }
}

#[test]
fn reference_copies_refuse_units_outside_memory() {
    let space = UnitSpace { regions: 1, blocks: 2, unit_bytes: 64 };
    let bases = [0x1000u64];
    let ids = [0u32, 9];
    let side = Side { bases: &bases, ids: &ids, stride: 64 };
    let plan = unitpack::plan(space, 128, 1).unwrap();
    let mem = vec![0u8; 8 * 64];
    let mut slot = vec![0u8; 128];
    let err = unitpack::gather(&space, &plan.pieces[0], &side, &mem, 0x1000, &mut slot).unwrap_err();
    assert!(
        matches!(
            err,
            PackError::OutOfBounds { unit: 1, region: 0, block: 9, addr: 0x1240, len: 64, base: 0x1000, mem_len: 512 }
        ),
        "{err:?}"
    );
    // Misaligned region base.
    let bases = [0x1008u64];
    let side = Side { bases: &bases, ids: &[0, 1], stride: 64 };
    let err = unitpack::gather(&space, &plan.pieces[0], &side, &mem, 0x1000, &mut slot).unwrap_err();
    assert!(matches!(&err, PackError::Geometry(m) if m.contains("not 16-byte aligned")), "{err}");
}

#[test]
fn the_pattern_tells_units_apart_and_catches_a_flipped_bit() {
    let mut a = vec![0u8; 4096];
    unitpack::pattern_fill(7, 3, 100, &mut a);
    assert_eq!(unitpack::pattern_check(7, 3, 100, &a), None);
    // Another region, block, or seed does not match.
    assert_eq!(unitpack::pattern_check(7, 4, 100, &a), Some(0));
    assert_eq!(unitpack::pattern_check(7, 3, 101, &a), Some(0));
    assert_eq!(unitpack::pattern_check(8, 3, 100, &a), Some(0));
    a[2049] ^= 0x10;
    assert_eq!(unitpack::pattern_check(7, 3, 100, &a), Some(512));
    // Not a constant or a short cycle: words of a unit are distinct.
    unitpack::pattern_fill(7, 3, 100, &mut a);
    let words: HashSet<&[u8]> = a.chunks(4).collect();
    assert!(words.len() > 1000, "{} distinct words of 1024", words.len());
}

// ---- machines without CUDA: clear errors, never a panic ----

/// Held by the tests that read `KVPUSH_CUDA_DEVICE` (through `select("cuda")`) or set it: tests run in
/// parallel threads of one process, which share the environment.
static ENV: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn env_lock() -> std::sync::MutexGuard<'static, ()> {
    ENV.lock().unwrap_or_else(|p| p.into_inner())
}

#[test]
fn kvpush_device_cuda_without_a_driver_is_a_clear_error() {
    let _env = env_lock();
    match kvpush_cuda::driver_available() {
        Err(e) => {
            assert!(matches!(&e, CudaError::Unavailable { library, .. } if library.contains("CUDA driver")), "{e:?}");
            let err = select("cuda").unwrap_err();
            let DeviceError::Unavailable { requested, tried } = &err else { panic!("{err:?}") };
            assert_eq!((requested.as_str(), tried.len(), tried[0].0.as_str()), ("cuda", 1, "cuda"));
            assert!(tried[0].1.contains("libcuda.so") && tried[0].1.contains("LD_LIBRARY_PATH"), "{}", tried[0].1);
            let err = Gpu::open(0).unwrap_err();
            assert!(matches!(err, CudaError::Unavailable { .. }), "{err:?}");
            // auto falls through to the host.
            assert_eq!(select("auto").unwrap().kind(), kvpush::device::DeviceKind::Host);
        }
        // On a GPU machine the same call opens device 0 (or says why not, e.g. no device visible).
        Ok(()) => match select("cuda") {
            Ok(dev) => assert_eq!(dev.kind(), kvpush::device::DeviceKind::Cuda),
            Err(e) => assert!(e.to_string().contains("cuda"), "{e}"),
        },
    }
}

#[test]
fn cuda_with_an_ordinal_opens_that_device_or_says_why_not() {
    // `cuda:<n>` is what the vLLM connector passes: the GPU a rank's KV cache is on.
    for spec in ["cuda:x", "cuda:", "cuda:-1"] {
        assert_eq!(select(spec).unwrap_err(), DeviceError::Unknown { value: spec.into() }, "{spec}");
    }
    match kvpush_cuda::driver_available() {
        Err(_) => {
            let err = select("CUDA:3").unwrap_err();
            let DeviceError::Unavailable { requested, tried } = &err else { panic!("{err:?}") };
            assert_eq!((requested.as_str(), tried.len(), tried[0].0.as_str()), ("cuda:3", 1, "cuda:3"));
            assert!(tried[0].1.contains("libcuda.so"), "{}", tried[0].1);
        }
        Ok(()) => {
            let dev = select("cuda:0").expect("device 0 on a GPU machine");
            assert_eq!(dev.kind(), kvpush::device::DeviceKind::Cuda);
            // An ordinal past the last GPU is refused, never mapped to another device.
            assert!(select("cuda:4096").is_err());
        }
    }
}

/// The only test here that changes the environment (under [`ENV`]).
#[test]
fn kvpush_cuda_device_must_be_an_ordinal() {
    let _env = env_lock();
    std::env::set_var("KVPUSH_CUDA_DEVICE", "first");
    let err = select("cuda").unwrap_err();
    std::env::remove_var("KVPUSH_CUDA_DEVICE");
    let DeviceError::Unavailable { tried, .. } = &err else { panic!("{err:?}") };
    assert!(tried[0].1.contains("KVPUSH_CUDA_DEVICE=\"first\" is not a device ordinal"), "{}", tried[0].1);
}

/// Every kernel of the staging source compiles to PTX through NVRTC, which needs no GPU and no driver:
/// CI provides NVRTC (scripts/nvrtc.sh, sourced by scripts/test.sh), so under `CI=true` a missing
/// NVRTC fails this test. Elsewhere a missing NVRTC must be a clear error, and the test says it skipped.
#[test]
fn every_kernel_compiles_to_ptx_through_nvrtc() {
    // The kernels, read from the source itself, so a new kernel is checked without editing this test.
    let decl = "extern \"C\" __global__ void ";
    let kernels: Vec<&str> = kvpush_cuda::kernels::SOURCE
        .match_indices(decl)
        .map(|(at, _)| {
            let rest = &kvpush_cuda::kernels::SOURCE[at + decl.len()..];
            &rest[..rest.find('(').expect("a kernel declaration has parameters")]
        })
        .collect();
    assert_eq!(kernels.len(), 5, "kernels found in SOURCE: {kernels:?}");
    match kvpush_cuda::compile_ptx("compute_90") {
        Ok(ptx) => {
            for k in &kernels {
                assert!(ptx.contains(&format!(".entry {k}(")), "{k} missing from the PTX");
            }
        }
        Err(e) => {
            assert!(kvpush_cuda::nvrtc_available().is_err(), "NVRTC loads but compiling failed: {e}");
            assert!(matches!(&e, CudaError::Unavailable { library, .. } if library.contains("NVRTC")), "{e:?}");
            assert!(e.to_string().contains("LD_LIBRARY_PATH"), "{e}");
            kvpush_testkit::require(format!("NVRTC (`. scripts/nvrtc.sh`): {e}"), false);
        }
    }
}

// ---- the CUDA stager (needs a GPU; on a machine without a CUDA driver, CI's among them, it says so and returns) ----

/// Device 0, or `None` where no CUDA driver loads (as the tests above: a machine with a driver must
/// open device 0).
fn gpu_or_skip() -> Option<kvpush::device::cuda::CudaDevice> {
    match kvpush_cuda::driver_available() {
        Err(e) => {
            kvpush_testkit::require_gpu(format!("no CUDA driver ({e})"), false);
            None
        }
        Ok(()) => Some(kvpush::device::cuda::CudaDevice::open(0).expect("device 0 on a GPU machine")),
    }
}

/// Polls the lane until its operation finished (at most 30 s).
fn wait_lane(st: &mut dyn Stager, lane: usize) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !st.is_done(lane).expect("lane status") {
        assert!(std::time::Instant::now() < deadline, "lane {lane} not done after 30 s");
        std::thread::yield_now();
    }
}

/// Device 0 (or `None`, the test skipped) with a 16 MiB cache and a 4 MiB staging slot: the
/// stager tests' memory.
fn gpu_cache_and_slot() -> Option<(CudaDevice, CudaBuffer, CudaBuffer)> {
    let dev = gpu_or_skip()?;
    let cache = dev.alloc_cuda(CACHE_LEN).expect("a 16 MiB cache");
    let slot = dev.alloc_cuda(SLOT_LEN).expect("a 4 MiB slot");
    Some((dev, cache, slot))
}

/// Bytes of [`gpu_cache_and_slot`]'s cache and slot.
const CACHE_LEN: u64 = 16 << 20;
const SLOT_LEN: u64 = 4 << 20;

/// Every byte of `buf` (a synchronous copy).
fn contents(buf: &dyn Buffer) -> Vec<u8> {
    let mut got = vec![0u8; buf.region().len as usize];
    buf.read_at(0, &mut got).expect("reads back");
    got
}

/// Panics at the first byte of `what` where `got` differs from `want`, saying `why` it should not.
fn assert_same_bytes(what: &str, got: &[u8], want: &[u8], why: &str) {
    assert_eq!(got.len(), want.len(), "{what}'s length");
    if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
        panic!("{what} byte {i} is {:#x}, expected {:#x}{why}", got[i], want[i]);
    }
}

/// A byte pattern in which every 4-byte word differs from its neighbours and from other offsets.
fn word_pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len / 4).flat_map(|w| (unitpack::mix64(seed ^ w as u64) as u32).to_le_bytes()).collect()
}

/// ~1000 entries over non-overlapping, 16-byte aligned ranges of a `cache_len`-byte cache (mostly
/// 4 KiB, some 16 B, a few 64 KiB), packed into a slot of `slot_len` bytes with 0..3 granules of gap
/// between them. Returns (offset in the cache, offset in the slot, length) per entry.
fn random_entries(cache_len: u64, slot_len: u64, mut s: u64) -> Vec<(u64, u32, u32)> {
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut used = vec![false; (cache_len / 16) as usize];
    let (mut out, mut off) = (Vec::new(), 0u64);
    while out.len() < 1000 {
        let len: u64 = match next() % 100 {
            0 => 64 << 10,
            1..=25 => 16,
            _ => 4 << 10,
        };
        let gap = (next() % 4) * 16;
        if off + gap + len > slot_len {
            break;
        }
        let granules = (len / 16) as usize;
        let at = loop {
            let g = (next() % (cache_len / 16 - granules as u64 + 1)) as usize;
            if !used[g..g + granules].iter().any(|&u| u) {
                used[g..g + granules].iter_mut().for_each(|u| *u = true);
                break g as u64 * 16;
            }
        };
        out.push((at, (off + gap) as u32, len as u32));
        off += gap + len;
    }
    out
}

#[test]
fn cuda_stager_gathers_and_scatters_every_byte() {
    let Some((dev, cache, slot)) = gpu_cache_and_slot() else { return };
    let (cache_len, slot_len) = (CACHE_LEN, SLOT_LEN);
    let cache2 = dev.alloc_cuda(cache_len).unwrap();
    let mut host = word_pattern(cache_len as usize, 0x5eed);
    cache.write_at(0, &host).unwrap();
    let picks = random_entries(cache_len, slot_len, 0x1234_5678_9abc_def1);
    assert!(picks.len() >= 900, "{} entries", picks.len());
    assert!(picks.iter().any(|p| p.2 == 16) && picks.iter().any(|p| p.2 == 64 << 10), "every length occurs");

    let mut st = dev.stager(4, 1024).unwrap().expect("the CUDA device has a stager");
    assert_eq!(st.kind(), DeviceKind::Cuda);
    assert!((0..4).all(|l| st.is_done(l).unwrap()), "lanes never used are done");
    let (c, s, c2) = (cache.region().addr, slot.region().addr, cache2.region().addr);

    // A write through the stager, queued before the gather, is seen by it: overwrite the first
    // entry's source without waiting.
    let (at0, _, len0) = picks[0];
    let fresh = word_pattern(len0 as usize, 0xf00d);
    // SAFETY: the range lies in `cache`, which nothing else accesses meanwhile.
    unsafe { st.write(c + at0, &fresh) }.unwrap();
    host[at0 as usize..(at0 + u64::from(len0)) as usize].copy_from_slice(&fresh);

    let gather: Vec<StageEntry> = picks.iter().map(|&(at, off, len)| StageEntry { addr: c + at, off, len }).collect();
    // SAFETY: sources lie in `cache`, destinations in `slot` (disjoint, inside it); all three buffers
    // outlive the operation, which is waited for before anything else touches them.
    unsafe { st.gather(0, &gather, s) }.unwrap();
    wait_lane(st.as_mut(), 0);
    let mut want = vec![0u8; slot_len as usize];
    for &(at, off, len) in &picks {
        want[off as usize..(off + len) as usize].copy_from_slice(&host[at as usize..(at + u64::from(len)) as usize]);
    }
    assert_same_bytes("slot", &contents(&slot), &want, " (gaps between entries stay zero)");
    // The stager's own read sees the same bytes.
    let mut head = vec![0u8; 4096];
    // SAFETY: the first 4 KiB of `slot`, which no operation is writing.
    unsafe { st.read(s, &mut head) }.unwrap();
    assert_eq!(head, want[..4096]);

    let scatter: Vec<StageEntry> = gather.iter().map(|e| StageEntry { addr: c2 + (e.addr - c), ..*e }).collect();
    // SAFETY: sources lie in `slot`, destinations in `cache2`, disjoint from each other; waited for.
    unsafe { st.scatter(1, &scatter, s) }.unwrap();
    wait_lane(st.as_mut(), 1);
    let mut want = vec![0u8; cache_len as usize];
    for &(at, _, len) in &picks {
        let r = at as usize..(at + u64::from(len)) as usize;
        want[r.clone()].copy_from_slice(&host[r]);
    }
    assert_same_bytes("cache", &contents(&cache2), &want, " (bytes outside the entries stay zero)");
    assert!(st.is_done(0).unwrap() && st.is_done(1).unwrap() && st.is_done(2).unwrap());
}

#[test]
fn cuda_stager_refuses_misaligned_entries_and_unknown_lanes() {
    let Some(dev) = gpu_or_skip() else { return };
    let buf = dev.alloc_cuda(1 << 20).unwrap();
    let slot = dev.alloc_cuda(1 << 16).unwrap();
    let (b, s) = (buf.region().addr, slot.region().addr);
    let mut st = dev.stager(2, 8).unwrap().expect("the CUDA device has a stager");
    let good = StageEntry { addr: b, off: 0, len: 4096 };
    let misaligned = [
        StageEntry { addr: b + 8, ..good },
        StageEntry { off: 4, ..good },
        StageEntry { len: 100, ..good },
        StageEntry { len: 0, ..good },
    ];
    for bad in misaligned {
        // SAFETY: refused before anything is queued.
        let err = unsafe { st.gather(0, &[good, bad], s) }.unwrap_err();
        assert!(err.to_string().contains("aligned"), "{bad:?}: {err}");
        // SAFETY: as above.
        let err = unsafe { st.scatter(1, &[bad], s) }.unwrap_err();
        assert!(err.to_string().contains("aligned"), "{bad:?}: {err}");
    }
    // SAFETY: refused before anything is queued.
    let err = unsafe { st.gather(0, &[good; 9], s) }.unwrap_err();
    assert!(err.to_string().contains("at most 8"), "{err}");
    for lane in [2, 99, usize::MAX] {
        // SAFETY: refused before anything is queued.
        let err = unsafe { st.gather(lane, &[good], s) }.unwrap_err();
        assert!(err.to_string().contains(&format!("lane {lane} does not exist")), "{err}");
        // SAFETY: as above.
        let err = unsafe { st.scatter(lane, &[good], s) }.unwrap_err();
        assert!(err.to_string().contains(&format!("lane {lane}")), "{err}");
        let err = st.is_done(lane).unwrap_err();
        assert!(err.to_string().contains(&format!("lane {lane}")), "{err}");
    }
    // A slot that is not 16-byte aligned is refused by the launch, naming the kernel.
    // SAFETY: refused before the kernel is queued (the table copy writes only the lane's table).
    let err = unsafe { st.gather(0, &[good], s + 8) }.unwrap_err();
    assert!(err.to_string().contains("kvp_gather_table"), "{err}");
    // The lanes still work.
    // SAFETY: `buf`'s first 4 KiB into `slot`'s first 4 KiB; waited for below.
    unsafe { st.gather(1, &[good], s) }.unwrap();
    wait_lane(st.as_mut(), 1);
}

/// The checked scatter: the peer's table in device memory is snapshotted, the check sees it whole,
/// a refused table scatters nothing (the lane reports the refusal), an accepted one scatters every
/// byte, and the kernel scatters the snapshot the check saw: a table rewritten while the check runs
/// changes nothing.
#[test]
fn cuda_stager_scatters_a_checked_snapshot_of_a_device_table() {
    let Some((dev, cache, slot)) = gpu_cache_and_slot() else { return };
    let (cache_len, slot_len) = (CACHE_LEN, SLOT_LEN);
    let table = std::sync::Arc::new(dev.alloc_cuda(1024 * 16).unwrap());
    let data = word_pattern(slot_len as usize, 0xab5e);
    slot.write_at(0, &data).unwrap();
    let picks = random_entries(cache_len, slot_len, 0x7ab1e);
    let picks = &picks[..picks.len().min(1024)];
    let (s, c, t) = (slot.region().addr, cache.region().addr, table.region().addr);
    let bytes: Vec<u8> =
        picks.iter().flat_map(|&(at, off, len)| StageEntry { addr: c + at, off, len }.to_bytes()).collect();
    table.write_at(0, &bytes).unwrap();
    let mut st = dev.stager(2, 1024).unwrap().expect("the CUDA device has a stager");
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let saw = std::sync::Arc::clone(&seen);
    // SAFETY: refused by the check; nothing is scattered.
    let queued = unsafe {
        st.scatter_table(
            0,
            t,
            picks.len(),
            s,
            Box::new(move |tb: &[u8]| {
                *saw.lock().unwrap() = tb.to_vec();
                Err(BadEntry { index: 0, addr: 0, len: 16, off: 0 })
            }),
        )
    };
    // The stager may check at once or once its snapshot is taken: then the lane reports it.
    let err = queued.and_then(|()| loop {
        if st.is_done(0)? {
            break Ok(());
        }
    });
    let err = err.unwrap_err();
    assert!(err.to_string().contains("entry 0 (0x0+16 from offset 0)"), "{err}");
    assert_eq!(*seen.lock().unwrap(), bytes, "the check sees the table as written");
    // The check rewrites the peer's table before accepting it: the kernel must still scatter the
    // snapshot the check saw.
    let peer_table = std::sync::Arc::clone(&table);
    let zeros = vec![0u8; bytes.len()];
    // SAFETY: every entry lies in `cache` (destinations) and `slot` (sources); waited for below.
    unsafe {
        st.scatter_table(
            1,
            t,
            picks.len(),
            s,
            Box::new(move |_: &[u8]| {
                peer_table.write_at(0, &zeros).unwrap();
                Ok(())
            }),
        )
    }
    .unwrap();
    wait_lane(st.as_mut(), 1);
    let mut want = vec![0u8; cache_len as usize];
    for &(at, off, len) in picks {
        want[at as usize..(at + u64::from(len)) as usize].copy_from_slice(&data[off as usize..(off + len) as usize]);
    }
    assert_same_bytes("cache", &contents(&cache), &want, "");
}

// ---- GPU memory in one process: the loopback transport and the demo (need a GPU, as above) ----

/// The loopback transport between two GPU buffers: an endpoint for host memory only refuses them
/// (the CPU must never load or store a device address: that was the one-process demo's segfault),
/// an endpoint on the CUDA device copies them through the device, every byte.
#[test]
fn loopback_copies_gpu_memory_through_the_device() {
    use kvpush::transport::loopback::Fabric;
    use kvpush::transport::{Desc, Op, Transport, XferState};
    let Some(dev) = gpu_or_skip() else { return };
    let dev: std::sync::Arc<dyn Device> = std::sync::Arc::new(dev);
    let len = 8usize << 20;
    let (src, dst) = (dev.alloc(len as u64).unwrap(), dev.alloc(len as u64).unwrap());
    let data = word_pattern(len, 0x100b);
    src.write_at(0, &data).unwrap();
    let fabric = Fabric::new();
    let plain = fabric.endpoint("plain").unwrap();
    // SAFETY: refused before anything is recorded.
    let err = unsafe { plain.register(&src.region()) }.unwrap_err();
    assert!(err.to_string().contains("device memory"), "{err}");
    let p = fabric.endpoint_on("prefill", dev.clone()).unwrap();
    let d = fabric.endpoint_on("decode", dev.clone()).unwrap();
    p.load_remote(&d.local_metadata().unwrap()).unwrap();
    d.load_remote(&p.local_metadata().unwrap()).unwrap();
    // SAFETY: both buffers live until the end of the test, which reads them only after the transfer.
    unsafe {
        p.register(&src.region()).unwrap();
        d.register(&dst.region()).unwrap();
    }
    let (s, t) = (src.region().addr, dst.region().addr);
    // 1024 descriptors of 4 KiB in reverse order, then one of the remaining 4 MiB.
    let mut descs: Vec<Desc> =
        (0..1024u64).map(|i| Desc { local: s + i * 4096, remote: t + (1023 - i) * 4096, len: 4096 }).collect();
    descs.push(Desc { local: s + (4 << 20), remote: t + (4 << 20), len: 4 << 20 });
    let id = p.post(Op::Write, "decode", &descs, Some(b"landed")).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while p.poll(id).unwrap() == XferState::Pending {
        assert!(std::time::Instant::now() < deadline, "transfer never completed");
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
    let got = contents(&*dst);
    for i in 0..1024 {
        let (g, w) = ((1023 - i) * 4096, i * 4096);
        assert!(got[g..g + 4096] == data[w..w + 4096], "block {i} arrived wrong");
    }
    assert!(got[4 << 20..] == data[4 << 20..], "the large descriptor arrived wrong");
    p.deregister(&src.region()).unwrap();
    d.deregister(&dst.region()).unwrap();
}

/// The host bounce on GPU memory (docs/deployment.md §4): the GPU side's NIC is an endpoint for host
/// memory only, so its KV crosses through host slots, copied device ↔ slot by the device
/// (`Device::copy`; the CPU never touches a device address). GPU P into host D (bounce on P), then host
/// P into GPU D (bounce on D): 300 scattered 4 KiB blocks each, every byte checked.
#[test]
fn host_bounce_moves_gpu_memory_through_host_slots() {
    use kvpush::device::host::HostDevice;
    use kvpush::transport::loopback::Fabric;
    use kvpush::transport::staged::StagingConfig;
    use kvpush::transport::Transport;
    use kvpush_testkit::bounce;
    use std::sync::Arc;
    let Some(gpu) = gpu_or_skip() else { return };
    let gpu: Arc<dyn Device> = Arc::new(gpu);
    let host: Arc<dyn Device> = Arc::new(HostDevice::new());
    let geometry = StagingConfig { slots: 2, slot_bytes: 256 << 10, max_entries: 128, ..StagingConfig::default() };
    for (round, (p_dev, d_dev)) in [(&gpu, &host), (&host, &gpu)].into_iter().enumerate() {
        let fabric = Fabric::new();
        let (p, d) = bounce::pair(&fabric, ("prefill", p_dev), ("decode", d_dev), DeviceKind::Cuda, geometry);
        let len = 2usize << 20;
        let (src, dst) = (p_dev.alloc(len as u64).unwrap(), d_dev.alloc(len as u64).unwrap());
        let data = word_pattern(len, 0xb0 + round as u64);
        src.write_at(0, &data).unwrap();
        let (rs, rd) = (src.region(), dst.region());
        // SAFETY: both buffers live until after the transports are dropped; the test reads them only
        // after the transfer ended.
        unsafe {
            p.register(&rs).unwrap();
            d.register(&rd).unwrap();
        }
        let descs = bounce::scattered(&rs, &rd, 300, 512);
        let seen = bounce::push(&p, &d, &descs, b"bounced", std::time::Duration::from_secs(30));
        assert_eq!(seen[0].msg, b"bounced");
        let got = contents(&*dst);
        for dsc in &descs {
            let (l, r) = ((dsc.local - rs.addr) as usize, (dsc.remote - rd.addr) as usize);
            assert!(got[r..r + 4096] == data[l..l + 4096], "round {round}: descriptor {dsc:?}");
        }
        assert!(p.counts().pieces >= 5, "round {round}: 1.2 MB through 256 KiB slots: {:?}", p.counts());
        drop((p, d));
        drop((src, dst));
    }
}

/// `KVPUSH_DEVICE=cuda:0 kvpush demo` in one process (loopback), staging off and on (auto), run and
/// FIFO block pools: every request verified. Before the loopback copied GPU memory through the
/// device, this crashed the process with a segmentation fault.
#[test]
fn demo_in_one_process_on_the_gpu_verifies_every_byte() {
    use kvpush_testkit::demo::{self, AllocatorFlag, StagingFlag, Topology, Workload};
    if gpu_or_skip().is_none() {
        return;
    }
    let _env = env_lock();
    let saved = std::env::var_os("KVPUSH_DEVICE");
    std::env::set_var("KVPUSH_DEVICE", "cuda:0");
    let w = Workload { requests: 24, concurrency: 8, ..Workload::default() };
    let mut outcomes = Vec::new();
    for (staging, allocator) in [
        (StagingFlag::Off, AllocatorFlag::Runs),
        (StagingFlag::Auto, AllocatorFlag::Fifo),
        (StagingFlag::On, AllocatorFlag::Runs),
    ] {
        let t = Topology { staging, allocator, num_blocks: 2048, ..Topology::default() };
        let r = demo::run(&t, &w, &[kvpush::proto::Mode::Push, kvpush::proto::Mode::Pull], &|| {});
        outcomes.push((staging, allocator, r));
    }
    match saved {
        Some(v) => std::env::set_var("KVPUSH_DEVICE", v),
        None => std::env::remove_var("KVPUSH_DEVICE"),
    }
    for (staging, allocator, r) in outcomes {
        let ctx = format!("staging {staging:?}, allocator {allocator:?}");
        let r = r.unwrap_or_else(|e| panic!("{ctx}: {e}"));
        for m in [r.push.as_ref().expect("push"), r.pull.as_ref().expect("pull")] {
            assert_eq!((m.requests, m.failed), (24, 0), "{ctx}: {m:?}");
            assert_eq!(m.verified_bytes, m.bytes, "{ctx}: every byte moved was verified: {m:?}");
        }
    }
}
