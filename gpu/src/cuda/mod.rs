//! CUDA through cudarc's driver API, loaded at run time.
//!
//! cudarc is built with dynamic loading, so every machine builds Duet; but cudarc panics when
//! the driver library is missing, so every entry here probes it first
//! ([`crate::device::cuda_driver_present`]) and answers a [`DeviceError`] instead.
//!
//! - [`CudaContextHandle`]: a worker's context (the device's primary context), a compute
//!   stream and a copy stream, for one incarnation ([`crate::context`]).
//! - [`memory`]: device memory from plain `cuMemAlloc` (never managed memory, never the
//!   stream-ordered pool, whose cached blocks would hide a leak from `cuMemGetInfo`), the KV pool
//!   on the device in the CPU pool's layout, and page-locked host buffers for staging.
//! - [`check`]: `duet gpu-check`, this build's parts on a real GPU against the CPU.
//! - [`kernels`]: the engine's kernels as CUDA C, compiled by NVRTC at start.
//! - [`staging`]: the CUDA side of the double-buffered copy-out of device pages
//!   ([`crate::staging`]), ordered after the chunk's "KV ready" event.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DriverError};

use crate::context::ComputeContext;
use crate::device::{Device, DeviceError, cuda_driver_present};

pub mod check;
pub mod kernels;
pub mod memory;
pub mod staging;

impl From<DriverError> for DeviceError {
    fn from(e: DriverError) -> DeviceError {
        DeviceError::Driver(e.to_string())
    }
}

/// The CUDA devices this machine has: an error when there is no driver (never a panic).
pub fn device_count() -> Result<usize, DeviceError> {
    cuda_driver_present()?;
    let n = CudaContext::device_count()?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Checks that `cuda:ordinal` exists, without creating a context (the supervisor checks the
/// configuration before starting nodes; only the worker that owns the device opens it).
pub fn check_ordinal(ordinal: usize) -> Result<(), DeviceError> {
    let n = device_count()?;
    if ordinal >= n {
        return Err(DeviceError::NoSuchDevice { ordinal, count: n });
    }
    Ok(())
}

/// A worker's CUDA context for one incarnation: the device's primary context and two streams,
/// one for compute and one for copies out of the KV pool, so transfers overlap the next chunk.
pub struct CudaContextHandle {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    ordinal: usize,
}

impl std::fmt::Debug for CudaContextHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaContextHandle")
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

impl CudaContextHandle {
    /// Opens `cuda:ordinal`: probes the driver, checks the ordinal, retains the primary
    /// context and makes the two streams.
    pub fn open(ordinal: usize) -> Result<CudaContextHandle, DeviceError> {
        check_ordinal(ordinal)?;
        let ctx = CudaContext::new(ordinal)?;
        let compute = ctx.new_stream()?;
        let copy = ctx.new_stream()?;
        Ok(CudaContextHandle {
            ctx,
            compute,
            copy,
            ordinal,
        })
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream kernels run on.
    pub fn compute(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    /// The stream copies of KV pages out of (and into) the pool run on.
    pub fn copy(&self) -> &Arc<CudaStream> {
        &self.copy
    }

    /// The device's name, as the driver gives it.
    pub fn name(&self) -> Result<String, DeviceError> {
        Ok(self.ctx.name()?)
    }
}

impl ComputeContext for CudaContextHandle {
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    fn drain(&mut self) -> Result<(), DeviceError> {
        self.compute.synchronize()?;
        self.copy.synchronize()?;
        self.ctx.synchronize()?;
        Ok(())
    }

    fn memory_in_use(&self) -> Result<Option<usize>, DeviceError> {
        let (free, total) = self.ctx.mem_get_info()?;
        Ok(Some(total.saturating_sub(free)))
    }
}
