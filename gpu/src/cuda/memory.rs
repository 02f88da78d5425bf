//! Device memory, the KV pool on the device, and page-locked host buffers.
//!
//! Every allocation is plain `cuMemAlloc` / `cuMemFree`: never managed memory (its pages
//! migrate under the NIC and the copy engine) and never cudarc's stream-ordered pool (freed
//! blocks stay reserved in the pool, so `cuMemGetInfo` could not show that a restarted worker
//! gave its memory back). Each allocation keeps its context alive and frees itself in it.

#![allow(unsafe_code)]

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaContext, CudaStream, result};

use crate::device::DeviceError;
use crate::kv::{KvLayout, PageAllocator, PageId, PoolError};

/// `len` bytes of device memory from `cuMemAlloc`.
pub struct DeviceBytes {
    ctx: Arc<CudaContext>,
    ptr: CUdeviceptr,
    len: usize,
}

impl std::fmt::Debug for DeviceBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBytes")
            .field("len", &self.len)
            .finish()
    }
}

// SAFETY: a device pointer is an address in the device's space, usable from any thread that
// binds the context (every method binds it first).
unsafe impl Send for DeviceBytes {}
// SAFETY: as above; the methods taking `&self` only read through the driver.
unsafe impl Sync for DeviceBytes {}

impl DeviceBytes {
    /// Allocates `len` bytes (at least one) and zeroes them.
    pub fn zeroed(ctx: &Arc<CudaContext>, len: usize) -> Result<DeviceBytes, DeviceError> {
        ctx.bind_to_thread()?;
        let len = len.max(1);
        // SAFETY: the context is bound to this thread; the pointer is freed once, in Drop.
        let ptr = unsafe { result::malloc_sync(len) }?;
        let mem = DeviceBytes {
            ctx: ctx.clone(),
            ptr,
            len,
        };
        // SAFETY: `ptr` is a live allocation of `len` bytes.
        unsafe { result::memset_d8_sync(ptr, 0, len) }?;
        Ok(mem)
    }

    /// Bytes allocated.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never: allocations are at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of byte `offset`, if `range` lies inside the allocation.
    pub fn address(&self, range: &Range<usize>) -> Result<CUdeviceptr, DeviceError> {
        if range.start > range.end || range.end > self.len {
            return Err(DeviceError::OutOfRange {
                range: range.clone(),
                len: self.len,
            });
        }
        Ok(self.ptr + range.start as u64)
    }

    /// Copies `src` into the device at `offset`, synchronously.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), DeviceError> {
        let dst = self.address(&(offset..offset + src.len()))?;
        self.ctx.bind_to_thread()?;
        // SAFETY: the range was checked against the allocation.
        unsafe { result::memcpy_htod_sync(dst, src) }?;
        Ok(())
    }

    /// Copies the device's `range` into `dst` (of the same length), synchronously.
    pub fn read(&self, range: Range<usize>, dst: &mut [u8]) -> Result<(), DeviceError> {
        if dst.len() != range.len() {
            return Err(DeviceError::OutOfRange {
                range,
                len: dst.len(),
            });
        }
        let src = self.address(&range)?;
        self.ctx.bind_to_thread()?;
        // SAFETY: the range was checked against the allocation and `dst` has its length.
        unsafe { result::memcpy_dtoh_sync(dst, src) }?;
        Ok(())
    }

    /// Queues a copy of the device's `range` into `dst` on `stream`; `dst` must stay alive and
    /// untouched until the stream passes an event recorded after it (see [`super::staging`]).
    ///
    /// # Safety
    /// `dst` must be page-locked memory (or the copy is synchronous anyway) that outlives the
    /// copy, and nothing may read or write it before the copy completes.
    pub(crate) unsafe fn read_async(
        &self,
        range: Range<usize>,
        dst: &mut [u8],
        stream: &CudaStream,
    ) -> Result<(), DeviceError> {
        let src = self.address(&range)?;
        if dst.len() != range.len() {
            return Err(DeviceError::OutOfRange {
                range,
                len: dst.len(),
            });
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: checked range; the caller keeps `dst` alive and untouched until completion.
        unsafe { result::memcpy_dtoh_async(dst, src, stream.cu_stream()) }?;
        Ok(())
    }
}

impl Drop for DeviceBytes {
    fn drop(&mut self) {
        // A free fails only if the context is already broken; its memory goes with it.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_sync, freed exactly once, here.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// The KV pool in device memory: the CPU pool's layout ([`KvLayout`]), so a page, a run of
/// pages and one layer of a page are contiguous device ranges, and the same page allocator.
#[derive(Debug)]
pub struct DeviceKvPool {
    layout: KvLayout,
    capacity: usize,
    memory: DeviceBytes,
    /// Reference counts and pins, as on the CPU: a page is reused only when nothing refers to
    /// it and no transfer may still write it.
    pub alloc: PageAllocator,
}

impl DeviceKvPool {
    /// Allocates `n_pages` pages of `layout` on the context's device, zeroed.
    pub fn new(
        ctx: &Arc<CudaContext>,
        layout: KvLayout,
        n_pages: usize,
    ) -> Result<DeviceKvPool, DeviceError> {
        let bytes = layout
            .page_bytes()
            .checked_mul(n_pages)
            .ok_or(DeviceError::Pool(PoolError::TooLarge {
                pages: n_pages,
                page_bytes: layout.page_bytes(),
            }))?;
        Ok(DeviceKvPool {
            layout,
            capacity: n_pages,
            memory: DeviceBytes::zeroed(ctx, bytes)?,
            alloc: PageAllocator::new(n_pages),
        })
    }

    /// The layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Pages in the pool.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The device memory (for kernels and copies).
    pub fn memory(&self) -> &DeviceBytes {
        &self.memory
    }

    /// The bytes of `n` pages from `first`, copied to the host (tests and the CPU fallback).
    pub fn read_run(&self, first: PageId, n: usize) -> Result<Vec<u8>, DeviceError> {
        let range = self.layout.run_bytes(first, n);
        let mut out = vec![0u8; range.len()];
        self.memory.read(range, &mut out)?;
        Ok(out)
    }

    /// Writes `bytes` over `n` pages from `first` (a transfer landing from a host buffer).
    pub fn write_run(&self, first: PageId, bytes: &[u8]) -> Result<(), DeviceError> {
        let n = bytes.len() / self.layout.page_bytes().max(1);
        let range = self.layout.run_bytes(first, n);
        if range.len() != bytes.len() {
            return Err(DeviceError::OutOfRange {
                range,
                len: bytes.len(),
            });
        }
        self.memory.write(range.start, bytes)
    }
}

/// Page-locked host memory for staging copies out of the device. Plain `cuMemHostAlloc` with
/// no flags: cudarc's default is write-combined, which the CPU reads ~10x slower (the sender
/// reads every staged byte to send it).
pub struct PinnedBuffer {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    len: usize,
}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("len", &self.len)
            .finish()
    }
}

// SAFETY: the buffer is plain host memory owned by this value.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocates `len` bytes (at least one) of page-locked memory.
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<PinnedBuffer, DeviceError> {
        ctx.bind_to_thread()?;
        let len = len.max(1);
        // SAFETY: a fresh allocation, freed once in Drop.
        let ptr = unsafe { result::malloc_host(len, 0) }?.cast::<u8>();
        if ptr.is_null() {
            return Err(DeviceError::Driver("cuMemHostAlloc returned null".into()));
        }
        // SAFETY: `ptr` points to `len` bytes we own; zero them so no read sees garbage.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(PinnedBuffer {
            ctx: ctx.clone(),
            ptr,
            len,
        })
    }

    /// The buffer's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The buffer's bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Bytes in the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_host, freed exactly once, here.
            let _ = unsafe { result::free_host(self.ptr.cast()) };
        }
    }
}
