//! AWS Neuron (Trainium, Inferentia) device memory through libnrt, loaded at run time by neuron-sys.
//!
//! Read [`NeuronDevice`] first. It uses the process's Neuron runtime in one of two ways
//! ([`RuntimeMode`]): *attach* to the runtime the framework (torch-neuronx, vLLM's Neuron worker)
//! already started, never initialising nor closing it, or *own* one (benches, the demo): `nrt_init` on
//! creation, `nrt_close` once the device and every buffer of it are gone.
//!
//! Like the CUDA backend attributes a pointer to its allocation, this backend knows exactly which
//! device memory is whose: every tensor it allocated ([`Device::alloc`], [`NeuronDevice::alloc_tensor`])
//! and every framework tensor registered with [`NeuronDevice::register_tensor`] (its address and size
//! queried from libnrt). [`Device::describe`] accepts only ranges inside one of them and attributes
//! them to their NeuronCore (`MemRegion { kind: Vram, dev_id: core }`), which is how a transport
//! registers them (NIXL: VRAM for the LIBFABRIC backend, over EFA with libfabric's FI_HMEM_NEURON).
//!
//! Device addresses are only usable by a NIC if libnrt maps device memory into the process
//! (`NEURON_RT_MAP_HBM=1` before the runtime starts); otherwise `nrt_tensor_get_va` returns NULL.
//! Opening the device allocates a small probe tensor to check exactly that (and, when attaching, that
//! the framework did start the runtime) and fails with [`NeuronError::AddressesNotMapped`] saying what
//! to set.
//!
//! Configuration ([`NeuronConfig::from_env`]): `KVPUSH_LIBNRT` (the library; default `libnrt.so.1`,
//! then `/opt/aws/neuron/lib/libnrt.so.1`), `KVPUSH_NEURON_RUNTIME=attach|own` (default attach),
//! `KVPUSH_NEURON_CORE` (the NeuronCore kvpush allocates on; default 0).
//!
//! When the framework owns the runtime (attach mode), [`Device::describe`] also accepts device
//! ranges the framework allocated and kvpush never saw, as vLLM's Neuron worker hands them over
//! (`tensor.data_ptr()` on device `neuron`), once libnrt proves them mapped (`nrt_get_dmabuf_fd`)
//! and on the right Neuron device (`nrt_get_attached_efa_bdf`). Own mode never asks `nrt_init` to
//! tell whether a framework started the runtime: it asks the runtime first ([`NeuronError::FrameworkOwnsRuntime`]).
//!
//! This module must never accept memory it cannot attribute, never close a runtime it attached to,
//! and never let a libnrt type or status code out other than as text and numbers.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::fmt;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use neuron_sys::{result, Lib, Placement, Runtime, Tensor};

use super::{Buffer, Device, DeviceError, DeviceKind, MemKind, MemRegion};

/// Environment variable choosing how the runtime is used: `attach` (default) or `own`.
pub const ENV_RUNTIME: &str = "KVPUSH_NEURON_RUNTIME";
/// Environment variable naming the NeuronCore kvpush allocates on (default 0).
pub const ENV_CORE: &str = "KVPUSH_NEURON_CORE";
/// Environment variable naming the libnrt to load (see [`NeuronConfig::library`]).
pub const ENV_LIBNRT: &str = neuron_sys::ENV_LIBNRT;
/// The Neuron runtime's switch that maps device memory (HBM) into the process.
pub const ENV_MAP_HBM: &str = "NEURON_RT_MAP_HBM";

/// Bytes of the probe tensor allocated when the device opens.
const PROBE_BYTES: usize = 4096;

/// How kvpush uses the process's Neuron runtime.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RuntimeMode {
    /// The framework started the runtime; kvpush never initialises nor closes it.
    Attach,
    /// kvpush starts the runtime and closes it when the device and its buffers are gone.
    Own,
}

impl fmt::Display for RuntimeMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RuntimeMode::Attach => "attach",
            RuntimeMode::Own => "own",
        })
    }
}

/// What [`NeuronDevice::open`] needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NeuronConfig {
    /// The libnrt to load; `None` searches `$KVPUSH_LIBNRT`, `libnrt.so.1`, then the SDK's path.
    pub library: Option<PathBuf>,
    /// Attach to the framework's runtime or own one.
    pub mode: RuntimeMode,
    /// The NeuronCore kvpush allocates on (and probes).
    pub core: u32,
}

impl NeuronConfig {
    /// Library search as documented, core 0.
    pub fn new(mode: RuntimeMode) -> Self {
        NeuronConfig { library: None, mode, core: 0 }
    }

    /// From `KVPUSH_NEURON_RUNTIME` and `KVPUSH_NEURON_CORE` (the library search reads
    /// `KVPUSH_LIBNRT` itself).
    pub fn from_env() -> Result<Self, NeuronError> {
        let mode = match std::env::var(ENV_RUNTIME) {
            Err(_) => RuntimeMode::Attach,
            Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
                "" | "attach" => RuntimeMode::Attach,
                "own" => RuntimeMode::Own,
                _ => return Err(NeuronError::Config { var: ENV_RUNTIME, value: v, expected: "attach or own" }),
            },
        };
        let core = match std::env::var(ENV_CORE) {
            Err(_) => 0,
            Ok(v) => v.trim().parse().map_err(|_| NeuronError::Config {
                var: ENV_CORE,
                value: v.clone(),
                expected: "a NeuronCore index (0, 1, ...)",
            })?,
        };
        Ok(NeuronConfig { library: None, mode, core })
    }
}

/// What went wrong with the Neuron backend.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NeuronError {
    /// libnrt could not be loaded, or lacks a function kvpush needs.
    #[error("{reason}")]
    Library {
        /// Every path tried with the loader's message, or the missing symbol.
        reason: String,
    },
    /// libnrt loaded but reports no NeuronCore.
    #[error("no Neuron device: {reason} ({})", .library.display())]
    NoDevice {
        /// The library.
        library: PathBuf,
        /// What libnrt said.
        reason: String,
    },
    /// Attach mode, but nobody started the runtime (or it was closed).
    #[error(
        "the Neuron runtime is not running in this process ({status} from {}): attach mode needs the framework to \
         call nrt_init first; set {ENV_RUNTIME}=own to let kvpush start it",
        .library.display()
    )]
    NotRunning {
        /// The library.
        library: PathBuf,
        /// The status libnrt answered with.
        status: String,
    },
    /// Own mode, but the runtime already runs in this process: a framework (or another owner) started it.
    #[error(
        "the Neuron runtime of {} already runs in this process (a framework, or another kvpush device, \
         started it): use {ENV_RUNTIME}=attach",
        .library.display()
    )]
    FrameworkOwnsRuntime {
        /// The library.
        library: PathBuf,
    },
    /// Own mode, but the runtime could not be started.
    #[error("cannot start the Neuron runtime ({}): {reason}", .library.display())]
    Init {
        /// The library.
        library: PathBuf,
        /// Why (`nrt_init`'s status, or another owner in this process).
        reason: String,
    },
    /// libnrt does not map device memory into this process, so no NIC can use its addresses.
    #[error(
        "device addresses of NeuronCore {core} are not usable: nrt_tensor_get_va returned NULL for {what} ({}); \
         set {ENV_MAP_HBM}=1 before the Neuron runtime starts ({ENV_MAP_HBM} is {})",
        .library.display(),
        .map_hbm.as_deref().map(|v| format!("{v:?}")).unwrap_or_else(|| "unset".into())
    )]
    AddressesNotMapped {
        /// The library.
        library: PathBuf,
        /// The NeuronCore.
        core: u32,
        /// Which tensor.
        what: String,
        /// The value of `NEURON_RT_MAP_HBM` in this process.
        map_hbm: Option<String>,
    },
    /// The NeuronCore asked for is not visible to this process.
    #[error("NeuronCore {core} is not visible to this process ({visible} visible, {total} in the instance)")]
    BadCore {
        /// The core asked for.
        core: u32,
        /// Cores visible to the process.
        visible: u32,
        /// Cores of the instance.
        total: u32,
    },
    /// An optional libnrt function is missing from this library.
    #[error("{symbol} is not supported by this libnrt ({})", .library.display())]
    NotSupported {
        /// The library.
        library: PathBuf,
        /// The function.
        symbol: &'static str,
    },
    /// A libnrt call failed.
    #[error("{message}")]
    Call {
        /// The libnrt function.
        call: &'static str,
        /// Its `NRT_STATUS`, where it returned one.
        status: Option<u32>,
        /// The full message (call, status name and number, arguments).
        message: String,
    },
    /// A range is not memory this device knows, or overlaps memory it knows.
    #[error("range {addr:#x}+{len}: {reason}")]
    Range {
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
        /// Why.
        reason: String,
    },
    /// An environment variable has a value this backend cannot use.
    #[error("{var}={value:?} is not valid (expected {expected})")]
    Config {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What would be valid.
        expected: &'static str,
    },
}

impl NeuronError {
    /// Whether this says that the machine has no Neuron runtime or device at all (as opposed to a
    /// Neuron machine that is misconfigured); `auto` selection skips such a backend quietly.
    pub fn is_absent(&self) -> bool {
        matches!(self, NeuronError::Library { .. } | NeuronError::NoDevice { .. })
    }
}

/// Turns a neuron-sys error into this module's, keeping the call and status.
fn nrt_error(e: neuron_sys::Error) -> NeuronError {
    let message = e.to_string();
    match e {
        neuron_sys::Error::Load { .. } | neuron_sys::Error::MissingSymbol { .. } => {
            NeuronError::Library { reason: message }
        }
        neuron_sys::Error::NotSupported { library, symbol } => NeuronError::NotSupported { library, symbol },
        neuron_sys::Error::Status { call, status, .. } => NeuronError::Call { call, status: Some(status.0), message },
        neuron_sys::Error::BadResult { call, .. } | neuron_sys::Error::BadArgument { call, .. } => {
            NeuronError::Call { call, status: None, message }
        }
        _ => NeuronError::Call { call: "libnrt", status: None, message },
    }
}

/// Facts about an open [`NeuronDevice`] (for `kvpush doctor` and logs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NeuronInfo {
    /// The library loaded.
    pub library: PathBuf,
    /// Attached or owned runtime.
    pub mode: RuntimeMode,
    /// The NeuronCore kvpush allocates on.
    pub core: u32,
    /// NeuronCores of the instance.
    pub total_cores: u32,
    /// NeuronCores visible to this process.
    pub visible_cores: u32,
    /// The library's version, where it can tell.
    pub version: Option<String>,
    /// The runtime's major and minor version numbers, where it can tell (`nrt_get_version`).
    pub version_number: Option<(u64, u64)>,
    /// Optional libnrt functions this library lacks.
    pub missing_optional: Vec<&'static str>,
}

/// Counters of a [`NeuronDevice`], for tests and logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NeuronStats {
    /// Tensors allocated by this device and alive now.
    pub allocated: usize,
    /// Framework tensors registered and not yet unregistered.
    pub registered: usize,
    /// Bytes of both.
    pub known_bytes: u64,
}

/// Neuron device memory (see the module docs).
pub struct NeuronDevice {
    rt: Arc<Runtime>,
    core: u32,
    total: u32,
    visible: u32,
    shared: Arc<Shared>,
    /// The EFA device attached to the Neuron device of [`Self::core`] (from the probe tensor), where
    /// libnrt can tell: a framework range on another Neuron device is refused (framework mode).
    efa_bdf: Option<String>,
}

impl NeuronDevice {
    /// Opens the device as `KVPUSH_LIBNRT`, `KVPUSH_NEURON_RUNTIME` and `KVPUSH_NEURON_CORE` say.
    pub fn from_env() -> Result<Self, NeuronError> {
        Self::open(&NeuronConfig::from_env()?)
    }

    /// Loads libnrt, checks that it sees a Neuron device and that `cfg.core` is visible, starts the
    /// runtime in own mode, and probes one small allocation on `cfg.core` to check that the runtime
    /// runs and that device addresses are mapped ([`NeuronError::AddressesNotMapped`] otherwise).
    pub fn open(cfg: &NeuronConfig) -> Result<Self, NeuronError> {
        let lib = match &cfg.library {
            Some(p) => Lib::open_path(p),
            None => Lib::open(),
        }
        .map_err(nrt_error)?;
        let no_device = |reason: String| NeuronError::NoDevice { library: lib.path().to_owned(), reason };
        let total = lib.total_nc_count().map_err(|e| no_device(e.to_string()))?;
        if total == 0 {
            return Err(no_device("libnrt reports 0 NeuronCores (nrt_get_total_nc_count)".into()));
        }
        let visible = lib.visible_nc_count().map_err(nrt_error)?;
        if cfg.core >= visible {
            return Err(NeuronError::BadCore { core: cfg.core, visible, total });
        }
        let rt = match cfg.mode {
            RuntimeMode::Attach => Runtime::attach(Arc::clone(&lib)),
            RuntimeMode::Own => {
                // Never rely on a second nrt_init failing: ask the runtime whether it already runs.
                match runtime_state(&lib, cfg.core) {
                    RuntimeState::Stopped => {}
                    RuntimeState::Running => {
                        return Err(NeuronError::FrameworkOwnsRuntime { library: lib.path().to_owned() })
                    }
                    RuntimeState::Unknown(reason) => {
                        return Err(NeuronError::Init {
                            library: lib.path().to_owned(),
                            reason: format!(
                                "cannot tell whether the runtime already runs, so nrt_init is not called: \
                                 the probe allocation answered {reason} (neither a tensor nor \
                                 NRT_UNINITIALIZED/NRT_CLOSED)"
                            ),
                        })
                    }
                }
                Runtime::init(Arc::clone(&lib))
                    .map_err(|e| NeuronError::Init { library: lib.path().to_owned(), reason: e.to_string() })?
            }
        };
        let mut dev =
            NeuronDevice { rt, core: cfg.core, total, visible, shared: Arc::new(Shared::default()), efa_bdf: None };
        dev.efa_bdf = dev.probe()?;
        tracing::debug!(library = %lib.path().display(), mode = %cfg.mode, core = cfg.core, total, visible, "neuron: device open");
        Ok(dev)
    }

    /// Allocates and frees one small tensor on the device's core: the runtime runs and maps device
    /// memory. Returns the EFA device attached to the core's Neuron device, where libnrt tells.
    fn probe(&self) -> Result<Option<String>, NeuronError> {
        let probe =
            self.rt.allocate(Placement::Device, self.core, PROBE_BYTES, "kvpush-probe").map_err(|e| match e {
                neuron_sys::Error::Status { status, .. } if neuron_sys::safe::is_not_running(status) => {
                    NeuronError::NotRunning { library: self.library().to_owned(), status: status.to_string() }
                }
                e => nrt_error(e),
            })?;
        match probe.va().map_err(nrt_error)? {
            Some(_) => Ok(probe.attached_efa_bdf().ok()),
            None => Err(self.not_mapped(self.core, format!("a {PROBE_BYTES}-byte probe tensor"))),
        }
    }

    /// Framework mode: accepts `[addr, addr + len)` that kvpush never saw if libnrt maps it as device
    /// memory, which `nrt_get_dmabuf_fd` proves (the Neuron driver hands out a dma-buf only for a
    /// range inside one mapped device allocation; the fd is closed at once), and, where libnrt names
    /// the EFA device of an address, only if that is the EFA device of this device's NeuronCore.
    /// libnrt has no call that names the NeuronCore of an address: the range is attributed to the
    /// core this device was opened for (`KVPUSH_NEURON_CORE`, the worker's core; vLLM's Neuron
    /// worker sees exactly one).
    fn describe_mapped(&self, addr: u64, len: u64) -> Result<MemRegion, String> {
        if self.mode() != RuntimeMode::Attach {
            return Err("kvpush owns the Neuron runtime here, so no framework memory can exist".into());
        }
        match self.rt.dmabuf_fd(addr, len) {
            Ok(fd) => drop(fd),
            Err(e) => return Err(format!("libnrt does not map it as Neuron device memory ({e})")),
        }
        if let Some(ours) = &self.efa_bdf {
            match self.rt.attached_efa_bdf(addr) {
                Ok(theirs) if &theirs != ours => {
                    return Err(format!(
                        "it is on the Neuron device attached to EFA {theirs}, not on NeuronCore {}'s (EFA {ours})",
                        self.core
                    ))
                }
                Ok(_) => {}
                Err(e) => return Err(format!("libnrt cannot name its EFA device ({e})")),
            }
        }
        Ok(MemRegion { addr, len, kind: MemKind::Vram, dev_id: self.core })
    }

    fn not_mapped(&self, core: u32, what: String) -> NeuronError {
        NeuronError::AddressesNotMapped {
            library: self.library().to_owned(),
            core,
            what,
            map_hbm: std::env::var(ENV_MAP_HBM).ok(),
        }
    }

    /// The library loaded.
    pub fn library(&self) -> &Path {
        self.rt.lib().path()
    }

    /// Attached or owned runtime.
    pub fn mode(&self) -> RuntimeMode {
        if self.rt.is_owned() {
            RuntimeMode::Own
        } else {
            RuntimeMode::Attach
        }
    }

    /// The NeuronCore kvpush allocates on.
    pub fn core(&self) -> u32 {
        self.core
    }

    /// Facts about the device and library.
    pub fn info(&self) -> NeuronInfo {
        let lib = self.rt.lib();
        let version = lib.version().ok();
        NeuronInfo {
            library: lib.path().to_owned(),
            mode: self.mode(),
            core: self.core,
            total_cores: self.total,
            visible_cores: self.visible,
            version: version.as_ref().map(|v| v.to_string()),
            version_number: version.as_ref().map(|v| (v.major, v.minor)),
            missing_optional: lib.missing_optional(),
        }
    }

    /// Counters of known memory.
    pub fn stats(&self) -> NeuronStats {
        self.shared.stats()
    }

    /// Allocates `len` zeroed bytes of device memory on the device's core, returning the concrete
    /// buffer.
    pub fn alloc_tensor(&self, len: u64) -> Result<NeuronBuffer, NeuronError> {
        let size = usize::try_from(len).ok().filter(|&n| n > 0).ok_or_else(|| NeuronError::Range {
            addr: 0,
            len,
            reason: "cannot allocate an empty or oversized tensor".into(),
        })?;
        let tensor = self.rt.allocate(Placement::Device, self.core, size, "kvpush-kv").map_err(nrt_error)?;
        let addr = match tensor.va().map_err(nrt_error)? {
            Some(va) => va,
            None => return Err(self.not_mapped(self.core, format!("a {len}-byte tensor"))),
        };
        tensor.zero().map_err(nrt_error)?;
        let region = MemRegion { addr, len, kind: MemKind::Vram, dev_id: self.core };
        self.shared.insert(addr, Known { len: tensor.size() as u64, core: self.core, origin: Origin::Allocated })?;
        Ok(NeuronBuffer { booked: Booked { region, shared: Arc::clone(&self.shared) }, tensor })
    }

    /// Registers a tensor the framework allocated, so that [`Device::describe`] accepts its memory:
    /// its address and size are queried from libnrt (`nrt_tensor_get_va`, `nrt_tensor_get_size`).
    /// The memory is known until the returned registration is dropped.
    ///
    /// # Safety
    ///
    /// 1. `handle` is a live `nrt_tensor_t*` of the runtime this device uses (same libnrt), allocated
    ///    on NeuronCore `core`;
    /// 2. the tensor stays allocated until the returned [`TensorRegistration`] is dropped (and any
    ///    transport registration of its memory is removed before that).
    pub unsafe fn register_tensor(
        &self,
        handle: NonNull<c_void>,
        core: u32,
    ) -> Result<TensorRegistration, NeuronError> {
        if core >= self.visible {
            return Err(NeuronError::BadCore { core, visible: self.visible, total: self.total });
        }
        let lib = self.rt.lib();
        let raw = handle.cast::<neuron_sys::sys::nrt_tensor_t>();
        // SAFETY: the caller guarantees that `handle` is a live tensor of this library.
        let size = unsafe { result::tensor_size(lib, raw) }.map_err(nrt_error)?;
        // SAFETY: as above.
        let va = unsafe { result::tensor_va(lib, raw) }.map_err(nrt_error)?;
        let Some(va) = va else {
            return Err(self.not_mapped(core, format!("the registered tensor {:p}", handle.as_ptr())));
        };
        let addr = va.as_ptr() as u64;
        if size == 0 {
            return Err(NeuronError::Range { addr, len: 0, reason: "libnrt reports the tensor as empty".into() });
        }
        let len = size as u64;
        self.shared.insert(addr, Known { len, core, origin: Origin::Registered })?;
        tracing::debug!(addr = format_args!("{addr:#x}"), len, core, "neuron: tensor registered");
        let region = MemRegion { addr, len, kind: MemKind::Vram, dev_id: core };
        Ok(TensorRegistration(Booked { region, shared: Arc::clone(&self.shared) }))
    }

    /// Like [`Device::describe`], and also checks that the memory is on NeuronCore `claimed_core`, as
    /// the framework says its tensor is.
    pub fn describe_on(&self, addr: u64, len: u64, claimed_core: u32) -> Result<MemRegion, DeviceError> {
        let region = self.describe(addr, len)?;
        if region.dev_id != claimed_core {
            return Err(DeviceError::NotDeviceMemory {
                device: DeviceKind::Neuron,
                addr,
                len,
                reason: format!(
                    "memory is on NeuronCore {}, not on the claimed NeuronCore {claimed_core}",
                    region.dev_id
                ),
            });
        }
        Ok(region)
    }

    /// The dma-buf fd of `[addr, addr + len)` (`nrt_get_dmabuf_fd`), for EFA peer-direct
    /// registration; the range must be known to this device. Closed on drop.
    pub fn dmabuf_fd(&self, addr: u64, len: u64) -> Result<OwnedFd, NeuronError> {
        self.describe(addr, len).map_err(|e| NeuronError::Range { addr, len, reason: e.to_string() })?;
        self.rt.dmabuf_fd(addr, len).map_err(nrt_error)
    }

    /// The EFA device (PCI address) attached to the Neuron device of each visible NeuronCore, as
    /// libnrt names it for a small probe tensor on that core (`nrt_get_attached_efa_bdf`): NIXL's
    /// LIBFABRIC backend registers each Neuron device's memory on that NIC (`kvpush doctor` checks
    /// one per device).
    pub fn efa_per_core(&self) -> Vec<(u32, Result<String, NeuronError>)> {
        (0..self.visible)
            .map(|core| {
                let efa = self
                    .rt
                    .allocate(Placement::Device, core, PROBE_BYTES, "kvpush-efa?")
                    .and_then(|probe| probe.attached_efa_bdf())
                    .map_err(nrt_error);
                (core, efa)
            })
            .collect()
    }

    /// The PCI address of the EFA device attached to the Neuron device holding `addr`
    /// (`nrt_get_attached_efa_bdf`); `addr` must be known to this device.
    pub fn attached_efa_bdf(&self, addr: u64) -> Result<String, NeuronError> {
        self.describe(addr, 1).map_err(|e| NeuronError::Range { addr, len: 1, reason: e.to_string() })?;
        self.rt.attached_efa_bdf(addr).map_err(nrt_error)
    }
}

impl Device for NeuronDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Neuron
    }

    /// Opening the device checked that libnrt maps device memory into the process
    /// (`NEURON_RT_MAP_HBM=1`): the addresses it describes are that mapping, which the CPU loads and
    /// stores.
    fn access(&self) -> super::Access {
        super::Access::Cpu
    }

    fn alloc(&self, len: u64) -> Result<Box<dyn Buffer>, DeviceError> {
        self.alloc_tensor(len).map(|b| Box::new(b) as Box<dyn Buffer>).map_err(|e| DeviceError::Alloc {
            device: DeviceKind::Neuron,
            len,
            reason: e.to_string(),
        })
    }

    /// Accepts `[addr, addr + len)` if it lies entirely inside one tensor this device allocated or had
    /// registered (attributed to that tensor's NeuronCore), or, when the framework owns the runtime,
    /// if libnrt proves it mapped device memory (see `describe_mapped`).
    fn describe(&self, addr: u64, len: u64) -> Result<MemRegion, DeviceError> {
        let reject = |reason: String| DeviceError::NotDeviceMemory { device: DeviceKind::Neuron, addr, len, reason };
        let end = super::range_end(DeviceKind::Neuron, addr, len)?;
        let books = self.shared.books();
        match books.range(..=addr).next_back() {
            Some((&start, k)) if addr < start + k.len => {
                if end > start + k.len {
                    return Err(reject(format!(
                        "range runs past the end of its tensor {start:#x}+{} on NeuronCore {}",
                        k.len, k.core
                    )));
                }
                Ok(MemRegion { addr, len, kind: MemKind::Vram, dev_id: k.core })
            }
            _ => {
                let (allocated, registered) = books.counts();
                drop(books);
                self.describe_mapped(addr, len).map_err(|why| {
                    reject(format!(
                        "not inside any Neuron tensor this device knows ({allocated} allocated by kvpush, \
                         {registered} registered), and {why}"
                    ))
                })
            }
        }
    }
}

impl fmt::Debug for NeuronDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NeuronDevice")
            .field("library", &self.library())
            .field("mode", &self.mode())
            .field("core", &self.core)
            .field("stats", &self.stats())
            .finish()
    }
}

/// Whether the runtime of a library runs in this process, as [`runtime_state`] tells.
#[derive(Debug)]
enum RuntimeState {
    /// A device allocation succeeded: someone (a framework, another owner) started it.
    Running,
    /// libnrt answered `NRT_UNINITIALIZED` or `NRT_CLOSED`: nobody started it, or it was closed.
    Stopped,
    /// Any other answer (`NRT_RESOURCE`, `NRT_INVALID`, ...): a running runtime that refused this
    /// allocation, or a library kvpush does not understand; either way not a reason to call `nrt_init`.
    Unknown(String),
}

/// Asks the runtime of `lib` whether it already runs in this process, without `nrt_init` and
/// without relying on a second `nrt_init` failing (whether it does on the real runtime is
/// unverified): a one-byte device allocation through an attached handle. libnrt's status header
/// reserves `NRT_UNINITIALIZED` (13) and `NRT_CLOSED` (14) for calls made outside
/// `nrt_init`..`nrt_close`, so those two, and only those, mean "not running".
fn runtime_state(lib: &Arc<Lib>, core: u32) -> RuntimeState {
    match Runtime::attach(Arc::clone(lib)).allocate(Placement::Device, core, 1, "kvpush-running?") {
        Ok(_) => RuntimeState::Running,
        Err(neuron_sys::Error::Status { status, .. }) if neuron_sys::safe::is_not_running(status) => {
            RuntimeState::Stopped
        }
        Err(e) => RuntimeState::Unknown(e.to_string()),
    }
}

/// Opens the backend for [`super::select`]: a machine without libnrt or without a Neuron device is
/// told quietly (debug log); a Neuron machine where opening fails is warned about, since `auto`
/// then falls back to another backend.
pub(super) fn open_for_select() -> Result<Arc<dyn Device>, String> {
    match NeuronDevice::from_env() {
        Ok(d) => Ok(Arc::new(d)),
        Err(e) if e.is_absent() => {
            tracing::debug!(error = %e, "neuron: not available");
            Err(e.to_string())
        }
        Err(e) => {
            tracing::warn!(error = %e, "neuron: a Neuron runtime is present but the device cannot be used");
            Err(e.to_string())
        }
    }
}

/// Device memory kvpush allocated; freed (and forgotten by the device) on drop.
pub struct NeuronBuffer {
    /// Declared before `tensor`, so it drops first: the memory is forgotten before the tensor is
    /// freed, and no describe can succeed for freed memory.
    booked: Booked,
    tensor: Tensor,
}

impl NeuronBuffer {
    /// The dma-buf fd of the whole buffer (`nrt_get_dmabuf_fd`).
    pub fn dmabuf_fd(&self) -> Result<OwnedFd, NeuronError> {
        self.tensor.runtime().dmabuf_fd(self.booked.region.addr, self.booked.region.len).map_err(nrt_error)
    }

    /// The raw `nrt_tensor_t*`, valid while the buffer lives (for handing to other libnrt users).
    pub fn raw_handle(&self) -> NonNull<c_void> {
        self.tensor.as_raw().cast()
    }
}

impl Buffer for NeuronBuffer {
    fn region(&self) -> MemRegion {
        self.booked.region
    }

    fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        self.check(offset, out.len())?;
        self.tensor.read_at(offset, out).map_err(|e| copy_error(offset, out.len(), e))
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.check(offset, data.len())?;
        self.tensor.write_at(offset, data).map_err(|e| copy_error(offset, data.len(), e))
    }
}

impl NeuronBuffer {
    /// Keeps copies inside the region (the tensor may be larger than asked for).
    fn check(&self, offset: u64, len: usize) -> Result<(), DeviceError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.booked.region.len => Ok(()),
            _ => Err(DeviceError::Copy {
                device: DeviceKind::Neuron,
                offset,
                len: len as u64,
                reason: format!("out of range: the buffer holds {} bytes", self.booked.region.len),
            }),
        }
    }
}

fn copy_error(offset: u64, len: usize, e: neuron_sys::Error) -> DeviceError {
    DeviceError::Copy { device: DeviceKind::Neuron, offset, len: len as u64, reason: e.to_string() }
}

impl fmt::Debug for NeuronBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.booked.debug(f, "NeuronBuffer")
    }
}

/// Memory in a [`NeuronDevice`]'s books (allocated or registered), forgotten when this drops.
struct Booked {
    region: MemRegion,
    shared: Arc<Shared>,
}

impl Booked {
    /// Formats the handle `name` that holds this as its region: address, length and NeuronCore.
    fn debug(&self, f: &mut fmt::Formatter<'_>, name: &str) -> fmt::Result {
        f.debug_struct(name)
            .field("addr", &format_args!("{:#x}", self.region.addr))
            .field("len", &self.region.len)
            .field("core", &self.region.dev_id)
            .finish()
    }
}

impl Drop for Booked {
    fn drop(&mut self) {
        self.shared.remove(self.region.addr);
    }
}

/// A framework tensor known to a [`NeuronDevice`]; forgotten on drop.
pub struct TensorRegistration(Booked);

impl TensorRegistration {
    /// The tensor's memory, as libnrt reported it.
    pub fn region(&self) -> MemRegion {
        self.0.region
    }
}

impl fmt::Debug for TensorRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.debug(f, "TensorRegistration")
    }
}

/// Where a known tensor came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    Allocated,
    Registered,
}

/// One known tensor.
#[derive(Clone, Copy, Debug)]
struct Known {
    len: u64,
    core: u32,
    origin: Origin,
}

/// The device's knowledge of memory, shared with its buffers and registrations.
#[derive(Default)]
struct Shared {
    /// Start address → tensor, for every allocated or registered tensor (disjoint).
    books: Mutex<BTreeMap<u64, Known>>,
}

/// The books, with counting helpers.
struct Books<'a>(MutexGuard<'a, BTreeMap<u64, Known>>);

impl std::ops::Deref for Books<'_> {
    type Target = BTreeMap<u64, Known>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl Books<'_> {
    fn counts(&self) -> (usize, usize) {
        let allocated = self.0.values().filter(|k| k.origin == Origin::Allocated).count();
        (allocated, self.0.len() - allocated)
    }
}

impl Shared {
    /// The books. Every update completes without panicking, so a poisoned lock still guards
    /// consistent data and is entered anyway (which also keeps `Drop` panic-free).
    fn books(&self) -> Books<'_> {
        Books(self.books.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Records `[addr, addr + k.len)`, refusing overlap with a known tensor.
    fn insert(&self, addr: u64, k: Known) -> Result<(), NeuronError> {
        let mut books = self.books.lock().unwrap_or_else(PoisonError::into_inner);
        let end = addr.saturating_add(k.len);
        let overlap = books
            .range(..end)
            .next_back()
            .filter(|(&start, other)| start.saturating_add(other.len) > addr)
            .map(|(&start, other)| (start, *other));
        if let Some((start, other)) = overlap {
            return Err(NeuronError::Range {
                addr,
                len: k.len,
                reason: format!(
                    "overlaps the known tensor {start:#x}+{} on NeuronCore {} (each tensor is registered once)",
                    other.len, other.core
                ),
            });
        }
        books.insert(addr, k);
        Ok(())
    }

    fn remove(&self, addr: u64) {
        self.books.lock().unwrap_or_else(PoisonError::into_inner).remove(&addr);
    }

    fn stats(&self) -> NeuronStats {
        let books = self.books();
        let (allocated, registered) = books.counts();
        NeuronStats { allocated, registered, known_bytes: books.values().map(|k| k.len).sum() }
    }
}
