//! Devices and memory for Duet's engine and transports.
//!
//! - [`device`]: where compute runs. CPU always; CUDA is detected at run time (the driver
//!   library is probed before anything touches it, so a machine without CUDA never panics).
//! - [`context`]: the compute context a worker owns for one incarnation (opened in the actor's
//!   start, drained and dropped in its stop), behind a trait so its lifecycle is unit-tested.
//! - [`cuda`]: CUDA through cudarc (loaded at run time): contexts and streams, device memory
//!   and the KV pool on the device, the kernels (NVRTC), staging copies out of device pages.
//! - [`staging`]: double-buffered copies of device pages through host buffers, so the copy of
//!   the next piece overlaps the send of this one, ordered after the chunk's "KV ready" event.
//! - [`huge`]: anonymous memory on transparent huge pages, for what the kernels stream
//!   through every step (weights, the KV pool).
//! - [`kv`]: the paged KV pool: one allocation made at start, cut into pages of `page_size`
//!   tokens that hold K and V of every layer, with an allocator that tracks reference counts
//!   and pins. The layout makes a page, or a run of consecutive pages, one contiguous byte
//!   range, so transports move KV with plain copies (see [`kv::KvLayout`]).

pub mod context;
pub mod cuda;
pub mod device;
pub mod huge;
pub mod kv;
pub mod staging;

pub use context::{ComputeContext, Devices, WorkerContext};
pub use device::{Device, DeviceError};
pub use kv::BlockView;
pub use kv::{
    KvDtype, KvLayout, KvMemory, KvPool, PageAllocator, PageId, PoolError, PoolMemory, PoolStats,
};
