//! Planning the work requests of one write: page runs into as few RDMA WRITEs as the layout
//! allows, each checked against what decode granted, signalled every N, and closed by a
//! WRITE_WITH_IMM whose immediate names the attempt.
//!
//! Sans-IO: the same plan is posted by the ibverbs backend and checked in unit tests.
//!
//! ```text
//! copies (ByteCopy: src, dst, len)  ── merge where both sides continue ──► extents
//! extents ── split at max_write ──► WRITEs (remote addr = region base + dst)
//!   every signal_every-th WRITE is signalled (its completion retires the ones before it)
//! last:  WRITE_WITH_IMM of 0 bytes, imm = the attempt's tag, always signalled
//! ```
//!
//! Every WRITE must lie inside one of the attempt's granted destination ranges, under the
//! region's remote key: a plan that would touch a byte outside the grant is refused whole,
//! before anything is posted.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::backend::ByteCopy;

/// Decode's registered pool, as the prealloc notice gives it to the attempt's writer (over
/// the authenticated link only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteRegion {
    /// The pool's first byte in decode's address space (the memory region's address).
    pub addr: u64,
    /// The pool's bytes.
    pub len: u64,
    /// The memory region's remote key.
    pub rkey: u32,
}

/// What one attempt may write: byte ranges of decode's pool (its granted pages), and the tag
/// its completion carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteGrant {
    /// The region the ranges lie in.
    pub region: RemoteRegion,
    /// Granted byte ranges of the pool (offsets from its first byte), sorted, disjoint.
    pub ranges: Vec<Range<u64>>,
    /// The immediate of the closing WRITE_WITH_IMM: decode's tag for this attempt on this
    /// queue pair (32 bits, as the verbs carry).
    pub imm: u32,
}

/// Limits of the NIC and the queue pair the plan is posted on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WrLimits {
    /// Largest single WRITE (a NIC's message limit is 2^31; smaller writes interleave better
    /// with other pairs' traffic).
    pub max_write: u64,
    /// Signal every Nth WRITE; the others complete silently and are retired by the next
    /// signalled one (a completion per WR would cost a CQ poll per page run).
    pub signal_every: usize,
}

impl Default for WrLimits {
    fn default() -> WrLimits {
        WrLimits {
            max_write: 1 << 30,
            signal_every: 16,
        }
    }
}

/// What a work request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrKind {
    /// RDMA WRITE of `len` bytes from the local pool at `local` to `remote`.
    Write,
    /// The zero-byte WRITE_WITH_IMM that completes the attempt on decode's receive queue.
    WriteWithImm(u32),
}

/// One work request, ready to post.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkRequest {
    /// Its id (increasing on the queue pair; completions name it).
    pub wr_id: u64,
    /// What it does.
    pub kind: WrKind,
    /// Offset in the local (registered) pool.
    pub local: u64,
    /// Remote address (region base plus offset).
    pub remote: u64,
    /// Remote key.
    pub rkey: u32,
    /// Bytes.
    pub len: u64,
    /// Whether it produces a completion.
    pub signaled: bool,
}

/// Why a plan was refused (nothing was posted).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// A copy would write outside the attempt's granted ranges.
    #[error("bytes {start}..{end} of decode's pool are outside the attempt's grant")]
    OutsideGrant {
        /// First byte.
        start: u64,
        /// One past the last.
        end: u64,
    },
    /// A grant range outside the region (a malformed notice).
    #[error("granted range {0:?} is outside decode's region of {1} bytes")]
    OutsideRegion(Range<u64>, u64),
    /// Limits of zero.
    #[error("unusable limits: {0}")]
    Limits(&'static str),
}

/// Byte copies merged where both the source and the destination continue.
pub fn merge(copies: &[ByteCopy]) -> Vec<ByteCopy> {
    let mut out: Vec<ByteCopy> = Vec::with_capacity(copies.len());
    for c in copies.iter().filter(|c| c.len > 0) {
        match out.last_mut() {
            Some(l) if l.src + l.len == c.src && l.dst + l.len == c.dst => l.len += c.len,
            _ => out.push(*c),
        }
    }
    out
}

/// Checks a grant's ranges against its region (decode made them; prefill checks them, since a
/// malformed notice must not send writes past the pool).
pub fn check_grant(grant: &RemoteGrant) -> Result<(), PlanError> {
    for r in &grant.ranges {
        if r.start > r.end || r.end > grant.region.len {
            return Err(PlanError::OutsideRegion(r.clone(), grant.region.len));
        }
    }
    Ok(())
}

/// Whether `[start, end)` lies inside one granted range.
fn granted(grant: &RemoteGrant, start: u64, end: u64) -> bool {
    // Ranges are sorted: the last one starting at or before `start` is the only candidate.
    let i = grant.ranges.partition_point(|r| r.start <= start);
    i > 0 && grant.ranges[i - 1].end >= end
}

/// The work requests that write `copies` under `grant`, ids from `first_wr_id`.
pub fn plan(
    copies: &[ByteCopy],
    grant: &RemoteGrant,
    limits: WrLimits,
    first_wr_id: u64,
) -> Result<Vec<WorkRequest>, PlanError> {
    if limits.max_write == 0 || limits.signal_every == 0 {
        return Err(PlanError::Limits(
            "max_write and signal_every must be positive",
        ));
    }
    check_grant(grant)?;
    let mut wrs = Vec::new();
    let mut id = first_wr_id;
    for c in merge(copies) {
        let (start, end) = (c.dst as u64, (c.dst + c.len) as u64);
        if !granted(grant, start, end) {
            return Err(PlanError::OutsideGrant { start, end });
        }
        let mut off = 0u64;
        while off < c.len as u64 {
            let len = (c.len as u64 - off).min(limits.max_write);
            wrs.push(WorkRequest {
                wr_id: id,
                kind: WrKind::Write,
                local: c.src as u64 + off,
                remote: grant.region.addr + start + off,
                rkey: grant.region.rkey,
                len,
                signaled: false,
            });
            id += 1;
            off += len;
        }
    }
    for (i, w) in wrs.iter_mut().enumerate() {
        w.signaled = (i + 1) % limits.signal_every == 0;
    }
    wrs.push(WorkRequest {
        wr_id: id,
        kind: WrKind::WriteWithImm(grant.imm),
        local: 0,
        remote: grant.region.addr,
        rkey: grant.region.rkey,
        len: 0,
        signaled: true,
    });
    Ok(wrs)
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // one granted range is a grant of one page run
mod tests {
    use super::*;

    fn grant(ranges: Vec<Range<u64>>) -> RemoteGrant {
        RemoteGrant {
            region: RemoteRegion {
                addr: 0x7f00_0000_0000,
                len: 1 << 20,
                rkey: 0xabc,
            },
            ranges,
            imm: 42,
        }
    }

    fn copy(src: usize, dst: usize, len: usize) -> ByteCopy {
        ByteCopy { src, dst, len }
    }

    #[test]
    fn runs_contiguous_on_both_sides_become_one_write_and_the_imm_closes_the_plan() {
        // Four page copies of 4 KiB: pages 0-1 -> 10-11 (contiguous both sides), 2 -> 20,
        // 3 -> 21 (contiguous both sides again).
        let p = 4096;
        let copies = [
            copy(0, 10 * p, p),
            copy(p, 11 * p, p),
            copy(2 * p, 20 * p, p),
            copy(3 * p, 21 * p, p),
        ];
        let g = grant(vec![
            (10 * p) as u64..(12 * p) as u64,
            (20 * p) as u64..(22 * p) as u64,
        ]);
        let wrs = plan(&copies, &g, WrLimits::default(), 100).expect("plan");
        assert_eq!(wrs.len(), 3, "{wrs:?}");
        assert_eq!(
            (wrs[0].local, wrs[0].remote - g.region.addr, wrs[0].len),
            (0, 10 * p as u64, 2 * p as u64)
        );
        assert_eq!(
            (wrs[1].local, wrs[1].remote - g.region.addr, wrs[1].len),
            (2 * p as u64, 20 * p as u64, 2 * p as u64)
        );
        assert_eq!(wrs[2].kind, WrKind::WriteWithImm(42));
        assert!(wrs[2].signaled && wrs[2].len == 0);
        assert_eq!(
            wrs.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
            [100, 101, 102]
        );
        assert!(wrs.iter().all(|w| w.rkey == 0xabc));
    }

    #[test]
    fn big_extents_split_at_the_limit_and_every_nth_write_is_signalled() {
        let g = grant(vec![0..1 << 20]);
        let limits = WrLimits {
            max_write: 1000,
            signal_every: 3,
        };
        let wrs = plan(&[copy(0, 0, 10_500)], &g, limits, 0).expect("plan");
        let writes: Vec<_> = wrs.iter().filter(|w| w.kind == WrKind::Write).collect();
        assert_eq!(writes.len(), 11);
        assert_eq!(writes.iter().map(|w| w.len).sum::<u64>(), 10_500);
        assert_eq!(writes.last().map(|w| w.len), Some(500));
        let signalled: Vec<u64> = writes
            .iter()
            .filter(|w| w.signaled)
            .map(|w| w.wr_id)
            .collect();
        assert_eq!(signalled, [2, 5, 8]);
        // Consecutive pieces continue on both sides.
        for pair in writes.windows(2) {
            assert_eq!(pair[0].local + pair[0].len, pair[1].local);
            assert_eq!(pair[0].remote + pair[0].len, pair[1].remote);
        }
    }

    #[test]
    fn a_write_outside_the_grant_refuses_the_whole_plan() {
        let g = grant(vec![4096..8192, 16384..20480]);
        // Straddles the end of the first range.
        let e = plan(
            &[copy(0, 4096, 4096), copy(4096, 8192, 10)],
            &g,
            WrLimits::default(),
            0,
        );
        assert_eq!(
            e,
            Err(PlanError::OutsideGrant {
                start: 4096,
                end: 8202
            })
        );
        // Entirely outside.
        let e = plan(&[copy(0, 0, 1)], &g, WrLimits::default(), 0);
        assert_eq!(e, Err(PlanError::OutsideGrant { start: 0, end: 1 }));
        // Spanning two granted ranges with a hole between is outside too.
        let e = plan(&[copy(0, 4096, 16384)], &g, WrLimits::default(), 0);
        assert!(matches!(e, Err(PlanError::OutsideGrant { .. })), "{e:?}");
        // A malformed notice: a range past the region.
        let bad = grant(vec![0..(2 << 20)]);
        assert!(matches!(
            plan(&[], &bad, WrLimits::default(), 0),
            Err(PlanError::OutsideRegion(..))
        ));
        let zero = WrLimits {
            max_write: 0,
            signal_every: 1,
        };
        assert!(matches!(plan(&[], &g, zero, 0), Err(PlanError::Limits(_))));
    }

    #[test]
    fn an_empty_write_still_completes_with_its_immediate() {
        let wrs = plan(&[copy(0, 0, 0)], &grant(vec![]), WrLimits::default(), 7).expect("plan");
        assert_eq!(wrs.len(), 1);
        assert_eq!((wrs[0].wr_id, wrs[0].kind), (7, WrKind::WriteWithImm(42)));
    }
}
