//! Decode's quarantine: the attempts it aborted, whose pages wait for a proof that no write of
//! them can land any more. Sans-IO (time is an argument; the proof comes from a [`Fence`]),
//! shared by the decode worker and the simulator, so the rule every page's reuse hangs on is
//! one piece of code, explored under every timing.
//!
//! ```text
//!   hold(attempt) ──► held ── settle: fence.revoke() == Proven ──► ledger.drained ──► pages free
//!                      │  └── Busy (a writer holds its claim: copying, or paused mid-copy)
//!                      │        asked again every turn; never freed on a timer
//!                      ├── past the backstop: the alarm, once (pages stay quarantined)
//!                      └── unacknowledged for a drain fence: ask the writer again
//! ```
//!
//! DESIGN rules 2 and 5: a deadline starts recovery and raises alarms; only a proof frees a page.

use std::collections::BTreeMap;

use duet_gpu::PageAllocator;

use crate::claims::Revocation;
use crate::grants::Grants;
use crate::ledger::{AttemptKey, Room, TransferLedger};

/// What proves that no write of an attempt can land any more.
pub trait Fence {
    /// Revokes the attempt's grant: [`Revocation::Proven`] when no writer can land a byte of
    /// it any more, [`Revocation::Busy`] while one may (ask again later).
    fn revoke(&mut self, attempt: AttemptKey) -> Revocation;
}

impl Fence for Grants {
    fn revoke(&mut self, attempt: AttemptKey) -> Revocation {
        Grants::revoke(self, attempt)
    }
}

/// An aborted attempt waiting for its proof.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// The writer's node.
    pub peer: String,
    /// The room.
    pub room: Room,
    /// When it was aborted (caller's clock, ms).
    pub since_ms: u64,
    /// When its writer was last asked to stop (ms).
    pub asked_ms: u64,
    /// Whether the alarm for it was raised.
    pub alarmed: bool,
}

/// What a settle did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// Proven: the attempt is closed and its pages are back (unless something else holds them).
    Closed,
    /// Not proven yet: the pages stay quarantined.
    Busy,
    /// The attempt was not held.
    NotHeld,
}

/// The attempts decode aborted and has not proven drained.
#[derive(Debug, Default)]
pub struct Quarantine {
    held: BTreeMap<AttemptKey, Held>,
    /// A reverted fix, for the simulator's mutation check only: frees an unproven attempt's
    /// pages once it is this old (ms): time taken as proof, the paused-writer bug.
    reverted_backstop_ms: Option<u64>,
}

impl Quarantine {
    /// An empty quarantine.
    pub fn new() -> Quarantine {
        Quarantine::default()
    }

    /// A quarantine with the paused-writer fix reverted: an attempt older than `backstop_ms`
    /// is freed without a proof. Only for proving that the simulator catches that bug.
    #[cfg(feature = "mutations")]
    pub fn with_reverted_backstop_fix(backstop_ms: u64) -> Quarantine {
        Quarantine {
            reverted_backstop_ms: Some(backstop_ms),
            ..Quarantine::default()
        }
    }

    /// Holds an attempt the ledger just aborted, written by `peer`.
    pub fn hold(&mut self, attempt: AttemptKey, peer: &str, room: Room, now_ms: u64) {
        self.held.entry(attempt).or_insert(Held {
            peer: peer.to_string(),
            room,
            since_ms: now_ms,
            asked_ms: now_ms,
            alarmed: false,
        });
    }

    /// Whether `attempt` is held.
    pub fn contains(&self, attempt: AttemptKey) -> bool {
        self.held.contains_key(&attempt)
    }

    /// The held attempt.
    pub fn get(&self, attempt: AttemptKey) -> Option<&Held> {
        self.held.get(&attempt)
    }

    /// Held attempts.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// The held attempts, oldest key first.
    pub fn attempts(&self) -> Vec<AttemptKey> {
        self.held.keys().copied().collect()
    }

    /// The held attempts written by `peer`.
    pub fn of_peer(&self, peer: &str) -> Vec<AttemptKey> {
        self.held
            .iter()
            .filter(|(_, h)| h.peer == peer)
            .map(|(a, _)| *a)
            .collect()
    }

    /// Asks the fence for the proof: proven → the ledger closes the attempt (its pins drop)
    /// and it leaves the quarantine; busy → it stays.
    pub fn settle(
        &mut self,
        attempt: AttemptKey,
        now_ms: u64,
        fence: &mut dyn Fence,
        ledger: &mut TransferLedger,
        alloc: &mut PageAllocator,
    ) -> Settle {
        let Some(h) = self.held.get(&attempt) else {
            return Settle::NotHeld;
        };
        let proven = fence.revoke(attempt) == Revocation::Proven;
        let timed_out = self
            .reverted_backstop_ms
            .is_some_and(|b| now_ms.saturating_sub(h.since_ms) >= b);
        if !proven && !timed_out {
            return Settle::Busy;
        }
        self.held.remove(&attempt);
        // Ignored or unknown: already closed (an endpoint torn down), nothing more to free.
        let _ = ledger.drained(attempt, alloc);
        ledger.prune();
        Settle::Closed
    }

    /// Held attempts past the backstop whose alarm was not raised yet, with their writer: each
    /// is reported once. Their pages stay quarantined.
    pub fn alarms(&mut self, now_ms: u64, backstop_ms: u64) -> Vec<(AttemptKey, String)> {
        self.held
            .iter_mut()
            .filter(|(_, h)| !h.alarmed && now_ms.saturating_sub(h.since_ms) >= backstop_ms)
            .map(|(a, h)| {
                h.alarmed = true;
                (*a, h.peer.clone())
            })
            .collect()
    }

    /// Held attempts whose writer was last asked to stop `fence_ms` ago or more: ask again
    /// (an abort may have been lost with a connection). Returns (attempt, writer, room).
    pub fn ask_again(&mut self, now_ms: u64, fence_ms: u64) -> Vec<(AttemptKey, String, Room)> {
        self.held
            .iter_mut()
            .filter(|(_, h)| now_ms.saturating_sub(h.asked_ms) >= fence_ms)
            .map(|(a, h)| {
                h.asked_ms = now_ms;
                (*a, h.peer.clone(), h.room)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{AbortReason, Side};

    /// A writer that holds the claim until told it is done.
    struct Writer {
        busy: bool,
    }

    impl Fence for Writer {
        fn revoke(&mut self, _: AttemptKey) -> Revocation {
            if self.busy {
                Revocation::Busy
            } else {
                Revocation::Proven
            }
        }
    }

    #[test]
    fn pages_come_back_only_on_a_proof_however_long_it_takes() {
        let mut alloc = PageAllocator::new(4);
        let mut ledger = TransferLedger::new(Side::Destination);
        let pages = alloc.alloc(2).expect("pages");
        let a = ledger.open(7, "p0", pages, true, &mut alloc).expect("open");
        ledger
            .abort(a, AbortReason::Timeout, 0, &mut alloc)
            .expect("abort");
        let mut q = Quarantine::new();
        q.hold(a, "p0", 7, 0);
        let mut w = Writer { busy: true };
        for now in [1, 1_000, 3_000, 60_000, 86_400_000] {
            assert_eq!(
                q.settle(a, now, &mut w, &mut ledger, &mut alloc),
                Settle::Busy
            );
            assert_eq!(alloc.free_pages(), 2, "quarantined at {now} ms");
        }
        assert_eq!(q.alarms(2_999, 3_000), vec![]);
        assert_eq!(q.alarms(3_000, 3_000), vec![(a, "p0".to_string())]);
        assert_eq!(q.alarms(9_000, 3_000), vec![], "once");
        assert_eq!(q.ask_again(500, 1_000), vec![]);
        assert_eq!(q.ask_again(1_000, 1_000), vec![(a, "p0".to_string(), 7)]);
        w.busy = false;
        assert_eq!(
            q.settle(a, 86_400_001, &mut w, &mut ledger, &mut alloc),
            Settle::Closed
        );
        assert_eq!(alloc.free_pages(), 4);
        assert!(q.is_empty());
        assert_eq!(
            q.settle(a, 0, &mut w, &mut ledger, &mut alloc),
            Settle::NotHeld
        );
    }
}
