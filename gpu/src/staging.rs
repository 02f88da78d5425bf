//! Sending device-resident KV through host staging buffers, double-buffered.
//!
//! The shm and TCP transports send host bytes. When the KV pool lives on a GPU, the sender
//! copies the pages it sends into page-locked host buffers first. With two buffers the copy of
//! piece `i + 1` runs on the device's copy engine while piece `i` is sent, so a transfer costs
//! about max(copy, send) instead of their sum:
//!
//! ```text
//! copy engine: [copy 0][copy 1]      [copy 2]      ...
//! sender:              [send 0]      [send 1]      [send 2]
//!                      ^ wait 0      ^ wait 1
//! ```
//!
//! A chunk's pages are copied only after the chunk's "KV ready" event (the compute stream
//! records it after the chunk's last KV write): [`CopyOut::after`] queues that wait on the
//! copy engine, so the host never blocks on compute and never reads KV still being written.
//!
//! [`stream_out`] is the pipeline; [`CopyOut`] is what it needs of the device. The CUDA
//! implementation is `cuda::staging::CudaStaging`; [`HostCopies`] stands in for the device with
//! host memory (tests, and a worker whose pool is on the CPU has no staging at all).

use std::ops::Range;

/// What the staging pipeline needs of a device: two staging slots it can fill asynchronously.
pub trait CopyOut {
    /// What marks a chunk's KV ready (a CUDA event).
    type Ready;
    /// The device's error.
    type Error;

    /// Bytes one staging slot holds.
    fn slot_bytes(&self) -> usize;

    /// Orders every later copy after `ready` (without blocking the caller).
    fn after(&mut self, ready: &Self::Ready) -> Result<(), Self::Error>;

    /// Starts copying device bytes `src` (at most `slot_bytes`) into slot `slot` (0 or 1);
    /// returns before the copy completes.
    fn start(&mut self, slot: usize, src: Range<usize>) -> Result<(), Self::Error>;

    /// Waits for slot `slot`'s copy and gives its bytes.
    fn finish(&mut self, slot: usize) -> Result<&[u8], Self::Error>;
}

/// Why a staged send stopped.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum StagingError<D, S> {
    /// The device failed a copy or a wait.
    #[error("staging copy failed: {0}")]
    Device(D),
    /// The sink (the transport) failed; the device's queued copy was waited for first.
    #[error("send failed: {0}")]
    Send(S),
    /// A slot of zero bytes cannot move anything.
    #[error("staging slots are empty")]
    NoSlots,
}

/// Sends device byte ranges `ranges` (in order) through the two staging slots of `dev`, after
/// `ready`. `send(offset, bytes)` gets each piece with its offset into the concatenation of
/// `ranges`. Returns the bytes sent.
///
/// On any error the pipeline still waits for a copy it started, so no copy into a slot is in
/// flight when it returns (the caller may drop or reuse the slots at once).
pub fn stream_out<C, S>(
    dev: &mut C,
    ready: Option<&C::Ready>,
    ranges: &[Range<usize>],
    mut send: impl FnMut(u64, &[u8]) -> Result<(), S>,
) -> Result<u64, StagingError<C::Error, S>>
where
    C: CopyOut,
{
    let slot_bytes = dev.slot_bytes();
    if slot_bytes == 0 {
        return Err(StagingError::NoSlots);
    }
    if let Some(r) = ready {
        dev.after(r).map_err(StagingError::Device)?;
    }
    let pieces: Vec<Range<usize>> = ranges
        .iter()
        .flat_map(|r| {
            (r.start..r.end)
                .step_by(slot_bytes)
                .map(move |s| s..(s + slot_bytes).min(r.end))
        })
        .collect();
    let Some(first) = pieces.first() else {
        return Ok(0);
    };
    dev.start(0, first.clone()).map_err(StagingError::Device)?;
    let mut sent = 0u64;
    for (i, _) in pieces.iter().enumerate() {
        // Queue the next copy into the other slot before sending this one: they overlap.
        if let Some(next) = pieces.get(i + 1)
            && let Err(e) = dev.start((i + 1) % 2, next.clone())
        {
            // Slot i % 2's copy is in flight: wait for it before reporting.
            let _ = dev.finish(i % 2);
            return Err(StagingError::Device(e));
        }
        let bytes = match dev.finish(i % 2) {
            Ok(b) => b,
            Err(e) => {
                if i + 1 < pieces.len() {
                    let _ = dev.finish((i + 1) % 2);
                }
                return Err(StagingError::Device(e));
            }
        };
        let n = bytes.len() as u64;
        if let Err(e) = send(sent, bytes) {
            if i + 1 < pieces.len() {
                let _ = dev.finish((i + 1) % 2);
            }
            return Err(StagingError::Send(e));
        }
        sent += n;
    }
    Ok(sent)
}

/// Host memory standing in for a device: copies happen at `finish` (as if the copy engine ran
/// then), and every call is logged, so a test sees what overlapped what.
#[derive(Debug)]
pub struct HostCopies {
    device: Vec<u8>,
    slots: [Vec<u8>; 2],
    pending: [Option<Range<usize>>; 2],
    slot_bytes: usize,
    /// What happened, in order: `after N`, `start S a..b`, `finish S`.
    pub log: Vec<String>,
    /// Which chunk events have fired; copying after an unfired one is the bug this catches.
    pub fired: Vec<u32>,
    waiting_for: Option<u32>,
}

/// Why the host double refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostCopyError {
    /// A copy of KV whose chunk event had not fired.
    #[error("copy of {0:?} before chunk {1} was ready")]
    NotReady(Range<usize>, u32),
    /// A range outside the device memory.
    #[error("range {0:?} is outside the device memory")]
    OutOfRange(Range<usize>),
    /// A slot started twice without a finish, or finished without a start.
    #[error("slot {0} misused: {1}")]
    Slot(usize, &'static str),
}

impl HostCopies {
    /// A "device" holding `device` bytes, with two slots of `slot_bytes`.
    pub fn new(device: Vec<u8>, slot_bytes: usize) -> HostCopies {
        HostCopies {
            device,
            slots: [Vec::new(), Vec::new()],
            pending: [None, None],
            slot_bytes,
            log: Vec::new(),
            fired: Vec::new(),
            waiting_for: None,
        }
    }
}

impl CopyOut for HostCopies {
    type Ready = u32;
    type Error = HostCopyError;

    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn after(&mut self, ready: &u32) -> Result<(), HostCopyError> {
        self.log.push(format!("after {ready}"));
        self.waiting_for = Some(*ready);
        Ok(())
    }

    fn start(&mut self, slot: usize, src: Range<usize>) -> Result<(), HostCopyError> {
        if src.end > self.device.len() || src.len() > self.slot_bytes {
            return Err(HostCopyError::OutOfRange(src));
        }
        if self.pending[slot].is_some() {
            return Err(HostCopyError::Slot(
                slot,
                "started while its copy is in flight",
            ));
        }
        self.log
            .push(format!("start {slot} {}..{}", src.start, src.end));
        self.pending[slot] = Some(src);
        Ok(())
    }

    fn finish(&mut self, slot: usize) -> Result<&[u8], HostCopyError> {
        let src = self.pending[slot]
            .take()
            .ok_or(HostCopyError::Slot(slot, "finished without a copy"))?;
        // The copy engine runs the queued copy only once the awaited event fired.
        if let Some(ev) = self.waiting_for
            && !self.fired.contains(&ev)
        {
            return Err(HostCopyError::NotReady(src, ev));
        }
        self.log.push(format!("finish {slot}"));
        self.slots[slot].clear();
        self.slots[slot].extend_from_slice(&self.device[src]);
        Ok(&self.slots[slot])
    }
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // one range is a transfer of one page run
mod tests {
    use super::*;

    fn device(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 % 251) as u8).collect()
    }

    #[test]
    fn pages_arrive_whole_and_in_order_with_each_copy_overlapping_the_previous_send() {
        let mem = device(10_000);
        let mut dev = HostCopies::new(mem.clone(), 1000);
        dev.fired.push(3);
        let ranges = [0..2500, 4000..4100, 6000..8000];
        let mut got = Vec::new();
        let mut sends = Vec::new();
        let sent = stream_out(&mut dev, Some(&3), &ranges, |off, b| {
            assert_eq!(off as usize, got.len(), "pieces arrive in order");
            got.extend_from_slice(b);
            sends.push(off);
            Ok::<_, ()>(())
        })
        .expect("sent");
        let want: Vec<u8> = ranges
            .iter()
            .flat_map(|r| mem[r.clone()].to_vec())
            .collect();
        assert_eq!(sent as usize, want.len());
        assert_eq!(got, want);
        // Pieces: 0..1000, 1000..2000, 2000..2500, 4000..4100, 6000..7000, 7000..8000.
        assert_eq!(sends.len(), 6);
        // The wait on the chunk's event comes first; every piece's copy starts before the
        // previous piece is handed out (finish), so the copy overlaps the send.
        assert_eq!(dev.log[0], "after 3");
        assert_eq!(
            &dev.log[1..4],
            ["start 0 0..1000", "start 1 1000..2000", "finish 0"]
        );
        for i in 1..6 {
            let start = dev
                .log
                .iter()
                .position(|l| l.starts_with(&format!("start {} ", i % 2)));
            assert!(start.is_some());
        }
        let finishes = dev.log.iter().filter(|l| l.starts_with("finish")).count();
        let starts = dev.log.iter().filter(|l| l.starts_with("start")).count();
        assert_eq!((starts, finishes), (6, 6));
        // The two slots alternate.
        let order: Vec<&str> = dev
            .log
            .iter()
            .filter(|l| l.starts_with("finish"))
            .map(String::as_str)
            .collect();
        assert_eq!(
            order,
            [
                "finish 0", "finish 1", "finish 0", "finish 1", "finish 0", "finish 1"
            ]
        );
    }

    #[test]
    fn kv_is_never_read_before_its_chunk_is_ready() {
        let mut dev = HostCopies::new(device(4096), 1024);
        let e = stream_out(&mut dev, Some(&9), &[0..2048], |_, _| Ok::<_, ()>(()))
            .expect_err("chunk 9 has not fired");
        assert_eq!(e, StagingError::Device(HostCopyError::NotReady(0..1024, 9)));
        // Nothing is left in flight after the error.
        assert!(dev.pending.iter().all(Option::is_none), "{:?}", dev.pending);
    }

    #[test]
    fn a_failed_send_leaves_no_copy_in_flight() {
        let mut dev = HostCopies::new(device(8192), 1024);
        let mut n = 0;
        let e = stream_out(&mut dev, None, &[0..8192], |_, _| {
            n += 1;
            if n == 3 { Err("peer closed") } else { Ok(()) }
        })
        .expect_err("send failed");
        assert_eq!(e, StagingError::Send("peer closed"));
        assert!(dev.pending.iter().all(Option::is_none), "{:?}", dev.pending);
    }

    #[test]
    fn a_range_off_the_device_is_an_error_and_empty_or_slotless_sends_are_clear() {
        let mut dev = HostCopies::new(device(1000), 512);
        let e = stream_out(&mut dev, None, &[0..512, 900..1100], |_, _| Ok::<_, ()>(()))
            .expect_err("past the end");
        assert!(
            matches!(e, StagingError::Device(HostCopyError::OutOfRange(_))),
            "{e:?}"
        );
        assert!(dev.pending.iter().all(Option::is_none));
        assert_eq!(
            stream_out(&mut dev, None, &[], |_, _| Ok::<_, ()>(())),
            Ok(0)
        );
        let mut none = HostCopies::new(device(10), 0);
        assert_eq!(
            stream_out(&mut none, None, &[0..10], |_, _| Ok::<_, ()>(())),
            Err(StagingError::NoSlots)
        );
    }
}
