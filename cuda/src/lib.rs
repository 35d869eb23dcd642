//! kvpush's CUDA backend: the driver API opened at run time (through cudarc's `dynamic-loading`),
//! validation of KV tensor pointers, and gather/scatter kernels that stage fragmented KV blocks
//! through a contiguous buffer.
//!
//! Read [`Gpu`] first (device, primary context, the "make current before NIXL" hook), then
//! [`pointer::validate`] (is this range device memory of the claimed device, inside one allocation?)
//! and [`unitpack`] (the GPU bench's pure plans: how a request's blocks are packed into bounded slots
//! and sent in pieces). [`Kernels`] runs those plans, and the engine's table-driven gather and
//! scatter, on the GPU with NVRTC-compiled kernels.
//!
//! Nothing here needs CUDA to build, and the pure parts ([`pointer`] against any
//! [`pointer::PointerQueries`], [`unitpack`]) run without it. Without a driver, [`Gpu::open`] answers
//! [`CudaError::Unavailable`]; it never panics. This crate does not depend on `kvpush` (kvpush's
//! `device::cuda` adapter depends on it), and no cudarc type appears in its API.

mod driver;
mod error;
pub mod kernels;
pub mod pointer;
pub mod unitpack;

pub use driver::{device_count, driver_available, nvrtc_available, DeviceMem, Event, Gpu, PinnedHost, Stream};
pub use error::{CudaError, DriverStatus};
pub use kernels::{compile_ptx, Kernels, UnitTable};
pub use pointer::{MemoryType, PointerInfo, PointerQueries};
