//! Decode's fence over its RDMA queue pairs: the proof the quarantine waits for.
//!
//! Every attempt written over RDMA is bound to the queue pair (one per prefill worker) whose
//! peer got the remote key for its pages. To end such an attempt without its writer's
//! acknowledgement, decode moves that queue pair to the error state and posts the drain
//! marker ([`QueuePair::to_error`]); until the marker's flush completion comes back the
//! revoke is [`Revocation::Busy`] (the pages stay quarantined however long that takes); after
//! it, or once the queue pair is destroyed, it is [`Revocation::Proven`]. The pair reconnects
//! with a fresh queue pair for its next attempts. Sans-IO: the backend posts the markers this
//! returns and feeds completions in.

use std::collections::HashMap;

use super::qp::{Completed, Completion, QueuePair};
use crate::claims::Revocation;
use crate::ledger::AttemptKey;
use crate::quarantine::Fence;

/// Decode's queue pairs by peer, and which attempt wrote through which.
#[derive(Debug, Default)]
pub struct QpFence {
    qps: HashMap<String, QueuePair>,
    attempts: HashMap<AttemptKey, String>,
    next_marker: u64,
    /// Drain markers to post, as (peer, wr_id): the backend posts each on the peer's queue
    /// pair's receive queue and feeds its completion to [`QpFence::complete`].
    pub to_post: Vec<(String, u64)>,
}

/// Marker ids live above every id the send path uses.
const MARKER_BASE: u64 = 1 << 63;

impl QpFence {
    /// No queue pairs yet.
    pub fn new() -> QpFence {
        QpFence {
            next_marker: MARKER_BASE,
            ..QpFence::default()
        }
    }

    /// The queue pair to `peer` (connected, ready): replaces a drained or destroyed one.
    pub fn connect(&mut self, peer: &str, qp: QueuePair) {
        self.qps.insert(peer.to_string(), qp);
    }

    /// The queue pair to `peer`, if any.
    pub fn qp(&self, peer: &str) -> Option<&QueuePair> {
        self.qps.get(peer)
    }

    /// `attempt`'s pages were granted to `peer` over its queue pair (the remote key went out).
    pub fn bind(&mut self, attempt: AttemptKey, peer: &str) {
        self.attempts.insert(attempt, peer.to_string());
    }

    /// The attempt closed by its writer's acknowledgement: nothing to drain for it.
    pub fn unbind(&mut self, attempt: AttemptKey) {
        self.attempts.remove(&attempt);
    }

    /// A completion from `peer`'s queue pair.
    pub fn complete(&mut self, peer: &str, c: Completion) -> Option<Completed> {
        self.qps.get_mut(peer).and_then(|qp| qp.complete(c).ok())
    }

    /// The receiving actor's restart: every queue pair is destroyed first, which proves every
    /// attempt on them quiet.
    pub fn destroy_all(&mut self) {
        for qp in self.qps.values_mut() {
            qp.destroy();
        }
    }
}

impl Fence for QpFence {
    fn revoke(&mut self, attempt: AttemptKey) -> Revocation {
        let Some(peer) = self.attempts.get(&attempt).cloned() else {
            // No remote key for its pages ever went out: nothing can write them.
            return Revocation::Proven;
        };
        let Some(qp) = self.qps.get_mut(&peer) else {
            // The queue pair is gone (destroyed and forgotten): nothing of it executes.
            self.attempts.remove(&attempt);
            return Revocation::Proven;
        };
        if qp.proven_quiet() {
            self.attempts.remove(&attempt);
            return Revocation::Proven;
        }
        let fresh = self.next_marker;
        // A new marker only on the first revoke; later ones find the drain under way.
        if let Some(marker) = qp.to_error(fresh)
            && marker == fresh
        {
            self.next_marker += 1;
            self.to_post.push((peer, marker));
        }
        Revocation::Busy
    }
}

#[cfg(test)]
mod tests {
    use duet_gpu::PageAllocator;

    use super::*;
    use crate::ledger::{AbortReason, Side, TransferLedger};
    use crate::quarantine::{Quarantine, Settle};
    use crate::rdma::qp::{QpState, WcStatus};

    fn ready() -> QueuePair {
        let mut qp = QueuePair::new(64);
        for s in [QpState::Init, QpState::ReadyToReceive, QpState::ReadyToSend] {
            qp.advance(s).expect("advance");
        }
        qp
    }

    #[test]
    fn an_aborted_rdma_attempt_keeps_its_pages_until_the_queue_pair_is_drained() {
        let mut alloc = PageAllocator::new(8);
        let mut ledger = TransferLedger::new(Side::Destination);
        let pages = alloc.alloc(3).expect("pages");
        let a = ledger.open(1, "p0", pages, true, &mut alloc).expect("open");
        let mut fence = QpFence::new();
        fence.connect("p0", ready());
        fence.bind(a, "p0");
        ledger
            .abort(a, AbortReason::Timeout, 0, &mut alloc)
            .expect("abort");
        let mut q = Quarantine::new();
        q.hold(a, "p0", 1, 0);
        // However long the writer stays silent, the pages wait for the drain.
        for now in [1, 60_000, 86_400_000] {
            assert_eq!(
                q.settle(a, now, &mut fence, &mut ledger, &mut alloc),
                Settle::Busy
            );
            assert_eq!(alloc.free_pages(), 5, "quarantined at {now} ms");
        }
        // The first revoke moved the queue pair to error and asked for one marker, once.
        assert_eq!(fence.qp("p0").map(QueuePair::state), Some(QpState::Error));
        assert_eq!(fence.to_post.len(), 1);
        let (peer, marker) = fence.to_post[0].clone();
        assert_eq!(peer, "p0");
        // A flush of some other request is not the proof.
        fence.complete(
            "p0",
            Completion {
                wr_id: 5,
                status: WcStatus::Flushed,
            },
        );
        assert_eq!(
            q.settle(a, 2, &mut fence, &mut ledger, &mut alloc),
            Settle::Busy
        );
        // The marker's flush is.
        let done = fence.complete(
            "p0",
            Completion {
                wr_id: marker,
                status: WcStatus::Flushed,
            },
        );
        assert_eq!(done, Some(Completed::Drained));
        assert_eq!(
            q.settle(a, 3, &mut fence, &mut ledger, &mut alloc),
            Settle::Closed
        );
        assert_eq!(alloc.free_pages(), 8);
    }

    #[test]
    fn a_restart_that_destroys_the_queue_pairs_proves_every_attempt_on_them() {
        let mut fence = QpFence::new();
        fence.connect("p0", ready());
        fence.connect("p1", ready());
        fence.bind(10, "p0");
        fence.bind(11, "p1");
        assert_eq!(fence.revoke(10), Revocation::Busy);
        fence.destroy_all();
        assert_eq!(fence.revoke(10), Revocation::Proven);
        assert_eq!(fence.revoke(11), Revocation::Proven);
        // An attempt whose key never went out is proven at once; one acknowledged is unbound.
        assert_eq!(fence.revoke(99), Revocation::Proven);
        fence.connect("p2", ready());
        fence.bind(12, "p2");
        fence.unbind(12);
        assert_eq!(fence.revoke(12), Revocation::Proven);
        assert_eq!(
            fence.qp("p2").map(QueuePair::state),
            Some(QpState::ReadyToSend)
        );
    }
}
