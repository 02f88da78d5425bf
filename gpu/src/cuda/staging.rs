//! The CUDA side of [`crate::staging`]: two page-locked slots filled by the copy stream.
//!
//! Each slot has an event recorded after its copy; `finish` waits on that event alone, so the
//! other slot's copy keeps running while the sender sends this one. `after` makes the copy
//! stream wait on a chunk's "KV ready" event (recorded on the compute stream after the chunk's
//! last KV write), a device-side wait that never blocks the sending thread.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaStream};

use super::memory::{DeviceBytes, PinnedBuffer};
use crate::device::DeviceError;
use crate::staging::CopyOut;

/// Copies out of one device allocation (the KV pool) through two pinned slots.
pub struct CudaStaging<'a> {
    src: &'a DeviceBytes,
    stream: Arc<CudaStream>,
    slots: [PinnedBuffer; 2],
    done: [CudaEvent; 2],
    lens: [usize; 2],
}

impl std::fmt::Debug for CudaStaging<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaStaging")
            .field("slot_bytes", &self.slots[0].len())
            .finish()
    }
}

impl<'a> CudaStaging<'a> {
    /// Two slots of `slot_bytes` for copies of `src` on `stream` (the context's copy stream).
    pub fn new(
        src: &'a DeviceBytes,
        stream: Arc<CudaStream>,
        slot_bytes: usize,
    ) -> Result<CudaStaging<'a>, DeviceError> {
        let ctx = stream.context().clone();
        let slots = [
            PinnedBuffer::new(&ctx, slot_bytes)?,
            PinnedBuffer::new(&ctx, slot_bytes)?,
        ];
        let done = [ctx.new_event(None)?, ctx.new_event(None)?];
        Ok(CudaStaging {
            src,
            stream,
            slots,
            done,
            lens: [0, 0],
        })
    }
}

impl CopyOut for CudaStaging<'_> {
    type Ready = CudaEvent;
    type Error = DeviceError;

    fn slot_bytes(&self) -> usize {
        self.slots[0].len()
    }

    fn after(&mut self, ready: &CudaEvent) -> Result<(), DeviceError> {
        Ok(self.stream.wait(ready)?)
    }

    fn start(&mut self, slot: usize, src: Range<usize>) -> Result<(), DeviceError> {
        let len = src.len();
        let buf = self
            .slots
            .get_mut(slot)
            .ok_or(DeviceError::Driver(format!("no staging slot {slot}")))?;
        let capacity = buf.len();
        let dst = buf
            .as_mut_slice()
            .get_mut(..len)
            .ok_or(DeviceError::OutOfRange {
                range: src.clone(),
                len: capacity,
            })?;
        // SAFETY: `dst` is page-locked and owned by self; `finish` waits for this copy's event
        // before anything reads the slot, and `start` on the slot comes only after `finish`.
        #[allow(unsafe_code)]
        unsafe {
            self.src.read_async(src, dst, &self.stream)?
        };
        self.done[slot].record(&self.stream)?;
        self.lens[slot] = len;
        Ok(())
    }

    fn finish(&mut self, slot: usize) -> Result<&[u8], DeviceError> {
        self.done[slot].synchronize()?;
        let len = self.lens[slot];
        Ok(&self.slots[slot].as_slice()[..len])
    }
}
