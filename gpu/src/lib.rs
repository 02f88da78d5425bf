//! Devices and memory for Duet's engine and transports.
//!
//! - [`device`]: where compute runs. CPU always; CUDA is detected at run time (the driver
//!   library is probed before anything touches it, so a machine without CUDA never panics).
//! - [`kv`]: the paged KV pool: one allocation made at start, cut into pages of `page_size`
//!   tokens that hold K and V of every layer, with an allocator that tracks reference counts
//!   and pins. The layout makes a page, or a run of consecutive pages, one contiguous byte
//!   range, so transports move KV with plain copies (see [`kv::KvLayout`]).

pub mod device;
pub mod kv;

pub use device::{Device, DeviceError};
pub use kv::BlockView;
pub use kv::{
    KvDtype, KvLayout, KvMemory, KvPool, PageAllocator, PageId, PoolError, PoolMemory, PoolStats,
};
