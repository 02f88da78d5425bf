//! A reliable-connected queue pair's states, its send queue's bookkeeping, and the drain that
//! proves no write of it can land any more.
//!
//! Sans-IO: the ibverbs backend applies each transition to the NIC and feeds completions in;
//! unit tests (and the simulator) drive it directly.
//!
//! ```text
//! Reset ─► Init ─► ReadyToReceive ─► ReadyToSend ─┬─ post / complete ─┐
//!                                                 │◄──────────────────┘
//!  any state ── to_error (decode's drain, or a failed completion) ─► Error
//!  Error ── the drain marker's flush completion ─► Drained   (the proof)
//!  any state ── destroy ─► Destroyed                         (a proof too: no QP, no writes)
//! ```
//!
//! DESIGN rule 2: once a queue pair is in the error state and a work request posted after the
//! transition has completed (flushed), the NIC has stopped executing this queue pair's
//! requests: no WRITE of it can land. That flush, not a timeout, is what lets decode reuse
//! the pages of every attempt that used the queue pair (as Linux's `ib_drain_qp` does).

/// Where a queue pair is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// Created, not configured.
    Reset,
    /// Port and access flags set.
    Init,
    /// Connected to the peer's QP number (can receive).
    ReadyToReceive,
    /// Can send.
    ReadyToSend,
    /// Moved to error: outstanding requests flush; waiting for the drain marker.
    Error,
    /// The drain marker flushed: nothing of this queue pair executes any more.
    Drained,
    /// Destroyed.
    Destroyed,
}

/// A completion as the CQ reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The work request it completes.
    pub wr_id: u64,
    /// Whether it succeeded.
    pub status: WcStatus,
}

/// A completion's status, as far as the protocol cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcStatus {
    /// Done.
    Success,
    /// Flushed: the queue pair was in error; the request did not execute.
    Flushed,
    /// Failed (remote access error, retry exceeded, ...): the NIC moves the QP to error.
    Failed,
}

/// Misuse of the queue pair (a bug in the caller, never a network event).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QpError {
    /// A transition the verbs forbid.
    #[error("cannot move a queue pair from {from:?} to {to:?}")]
    Transition {
        /// From.
        from: QpState,
        /// To.
        to: QpState,
    },
    /// Posting outside ReadyToSend.
    #[error("cannot post in {0:?}")]
    NotReady(QpState),
    /// More outstanding requests than the send queue holds.
    #[error("send queue full: {outstanding} outstanding + {posting} > depth {depth}")]
    QueueFull {
        /// Outstanding.
        outstanding: usize,
        /// Asked to post.
        posting: usize,
        /// Depth.
        depth: usize,
    },
    /// A completion for nothing outstanding.
    #[error("completion for unknown work request {0}")]
    Unknown(u64),
    /// Ids must increase.
    #[error("work request ids must increase: {0} after {1}")]
    Order(u64, u64),
}

/// What a completion did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Completed {
    /// These work requests are done (a signalled one retires the unsignalled before it).
    Retired(Vec<u64>),
    /// A request failed: the queue pair is in error (the attempts on it fail; drain it).
    Failed(u64),
    /// The drain marker flushed: the queue pair is drained (the proof).
    Drained,
}

/// A queue pair's bookkeeping.
#[derive(Debug, Clone)]
pub struct QueuePair {
    state: QpState,
    depth: usize,
    /// Posted and not retired, in order: (wr_id, signalled).
    outstanding: std::collections::VecDeque<(u64, bool)>,
    last_id: Option<u64>,
    marker: Option<u64>,
    /// Transitions so far (for metrics and spans).
    pub transitions: u32,
}

impl QueuePair {
    /// A new queue pair whose send queue holds `depth` requests.
    pub fn new(depth: usize) -> QueuePair {
        QueuePair {
            state: QpState::Reset,
            depth,
            outstanding: Default::default(),
            last_id: None,
            marker: None,
            transitions: 0,
        }
    }

    /// Where it is.
    pub fn state(&self) -> QpState {
        self.state
    }

    /// Requests posted and not retired.
    pub fn outstanding(&self) -> usize {
        self.outstanding.len()
    }

    fn go(&mut self, to: QpState) -> Result<(), QpError> {
        use QpState::*;
        let ok = matches!(
            (self.state, to),
            (Reset, Init) | (Init, ReadyToReceive) | (ReadyToReceive, ReadyToSend)
        );
        if !ok {
            return Err(QpError::Transition {
                from: self.state,
                to,
            });
        }
        self.state = to;
        self.transitions += 1;
        Ok(())
    }

    /// Reset → Init → ReadyToReceive → ReadyToSend, one step per call (as `ibv_modify_qp`).
    pub fn advance(&mut self, to: QpState) -> Result<(), QpError> {
        self.go(to)
    }

    /// Posts requests (ids increasing). Refused whole outside ReadyToSend or past the depth;
    /// the last of a batch must be signalled, or nothing would ever retire it.
    pub fn post(&mut self, wrs: &[(u64, bool)]) -> Result<(), QpError> {
        if self.state != QpState::ReadyToSend {
            return Err(QpError::NotReady(self.state));
        }
        if self.outstanding.len() + wrs.len() > self.depth {
            return Err(QpError::QueueFull {
                outstanding: self.outstanding.len(),
                posting: wrs.len(),
                depth: self.depth,
            });
        }
        let mut last = self.last_id;
        for (id, _) in wrs {
            if let Some(l) = last
                && *id <= l
            {
                return Err(QpError::Order(*id, l));
            }
            last = Some(*id);
        }
        self.last_id = last;
        self.outstanding.extend(wrs.iter().copied());
        Ok(())
    }

    /// Feeds a completion from the CQ.
    pub fn complete(&mut self, c: Completion) -> Result<Completed, QpError> {
        if Some(c.wr_id) == self.marker {
            self.outstanding.clear();
            self.marker = None;
            if self.state == QpState::Error {
                self.state = QpState::Drained;
                self.transitions += 1;
            }
            return Ok(Completed::Drained);
        }
        let Some(pos) = self.outstanding.iter().position(|(id, _)| *id == c.wr_id) else {
            // After a drain, late flushes of retired ids are expected noise.
            if matches!(self.state, QpState::Error | QpState::Drained) {
                return Ok(Completed::Retired(Vec::new()));
            }
            return Err(QpError::Unknown(c.wr_id));
        };
        match c.status {
            WcStatus::Success => {
                // In order: a completion retires every earlier request of the send queue.
                let retired: Vec<u64> = self.outstanding.drain(..=pos).map(|(id, _)| id).collect();
                Ok(Completed::Retired(retired))
            }
            WcStatus::Flushed | WcStatus::Failed => {
                self.outstanding.remove(pos);
                if matches!(
                    self.state,
                    QpState::ReadyToSend | QpState::ReadyToReceive | QpState::Init
                ) {
                    self.state = QpState::Error;
                    self.transitions += 1;
                }
                Ok(Completed::Failed(c.wr_id))
            }
        }
    }

    /// Decode's drain (or the sender's, on restart): moves the queue pair to error and returns
    /// the id of the marker to post after the transition; its flush completion is the proof.
    /// Asking again while draining returns the same marker.
    pub fn to_error(&mut self, marker_id: u64) -> Option<u64> {
        match self.state {
            QpState::Drained | QpState::Destroyed => None,
            _ => {
                if self.state != QpState::Error {
                    self.state = QpState::Error;
                    self.transitions += 1;
                }
                Some(*self.marker.get_or_insert(marker_id))
            }
        }
    }

    /// Destroyed (the owning actor's restart destroys its queue pairs first): the NIC frees
    /// the QP; nothing of it executes any more.
    pub fn destroy(&mut self) {
        if self.state != QpState::Destroyed {
            self.state = QpState::Destroyed;
            self.transitions += 1;
            self.outstanding.clear();
            self.marker = None;
        }
    }

    /// Whether no write of this queue pair can land any more: drained or destroyed.
    pub fn proven_quiet(&self) -> bool {
        matches!(self.state, QpState::Drained | QpState::Destroyed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready(depth: usize) -> QueuePair {
        let mut qp = QueuePair::new(depth);
        for s in [QpState::Init, QpState::ReadyToReceive, QpState::ReadyToSend] {
            qp.advance(s).expect("advance");
        }
        qp
    }

    fn ok(id: u64) -> Completion {
        Completion {
            wr_id: id,
            status: WcStatus::Success,
        }
    }

    #[test]
    fn transitions_go_in_the_verbs_order_only() {
        let mut qp = QueuePair::new(8);
        assert!(qp.advance(QpState::ReadyToSend).is_err());
        assert_eq!(
            qp.post(&[(1, true)]),
            Err(QpError::NotReady(QpState::Reset))
        );
        qp.advance(QpState::Init).expect("init");
        qp.advance(QpState::ReadyToReceive).expect("rtr");
        qp.advance(QpState::ReadyToSend).expect("rts");
        assert_eq!(qp.transitions, 3);
        assert!(qp.advance(QpState::Init).is_err());
    }

    #[test]
    fn a_signalled_completion_retires_the_unsignalled_requests_before_it() {
        let mut qp = ready(8);
        qp.post(&[(1, false), (2, false), (3, true), (4, false), (5, true)])
            .expect("post");
        assert_eq!(qp.complete(ok(3)), Ok(Completed::Retired(vec![1, 2, 3])));
        assert_eq!(qp.outstanding(), 2);
        assert_eq!(qp.complete(ok(5)), Ok(Completed::Retired(vec![4, 5])));
        assert_eq!(qp.outstanding(), 0);
        assert_eq!(qp.complete(ok(9)), Err(QpError::Unknown(9)));
    }

    #[test]
    fn the_send_queue_depth_counts_unsignalled_requests_until_retired() {
        let mut qp = ready(4);
        qp.post(&[(1, false), (2, false), (3, true)]).expect("post");
        assert!(matches!(
            qp.post(&[(4, false), (5, true)]),
            Err(QpError::QueueFull { .. })
        ));
        assert_eq!(qp.post(&[(2, true)]), Err(QpError::Order(2, 3)));
        qp.complete(ok(3)).expect("complete");
        qp.post(&[(4, false), (5, true)]).expect("room again");
    }

    #[test]
    fn pages_are_proven_free_only_when_the_drain_marker_flushes() {
        let mut qp = ready(8);
        qp.post(&[(1, false), (2, true)]).expect("post");
        let marker = qp.to_error(1000).expect("marker");
        assert_eq!(qp.state(), QpState::Error);
        // Asking again (every turn, while busy) gives the same marker.
        assert_eq!(qp.to_error(2000), Some(marker));
        // Outstanding writes flushing is not the proof yet; a write may still be executing.
        let flushed = Completion {
            wr_id: 2,
            status: WcStatus::Flushed,
        };
        assert_eq!(qp.complete(flushed), Ok(Completed::Failed(2)));
        assert!(!qp.proven_quiet());
        assert_eq!(
            qp.post(&[(3, true)]),
            Err(QpError::NotReady(QpState::Error))
        );
        // The marker's flush is.
        let m = Completion {
            wr_id: marker,
            status: WcStatus::Flushed,
        };
        assert_eq!(qp.complete(m), Ok(Completed::Drained));
        assert!(qp.proven_quiet());
        assert_eq!(qp.state(), QpState::Drained);
        // Late flushes of retired requests are ignored.
        assert_eq!(
            qp.complete(Completion {
                wr_id: 1,
                status: WcStatus::Flushed
            }),
            Ok(Completed::Retired(vec![]))
        );
        assert_eq!(qp.to_error(3000), None);
    }

    #[test]
    fn a_failed_write_puts_the_queue_pair_in_error_and_destroy_is_a_proof() {
        let mut qp = ready(8);
        qp.post(&[(1, true), (2, true)]).expect("post");
        let bad = Completion {
            wr_id: 1,
            status: WcStatus::Failed,
        };
        assert_eq!(qp.complete(bad), Ok(Completed::Failed(1)));
        assert_eq!(qp.state(), QpState::Error);
        assert!(
            !qp.proven_quiet(),
            "in error but not drained: request 2 may be executing"
        );
        qp.destroy();
        assert!(qp.proven_quiet());
        assert_eq!(qp.outstanding(), 0);
    }
}
