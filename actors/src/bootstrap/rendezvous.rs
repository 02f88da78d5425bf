//! The bootstrap queue's rule, sans-IO: where the router's half of a request (the prompt) and
//! decode's prealloc notice (the pages) meet, in either order, for one room. Time is an
//! argument; the actor (`mod.rs`) and the simulator both run this code.
//!
//! ```text
//!   request(room) ─┬─ room aborted before ──────────► Dropped
//!                  ├─ its notice is here ───────────► Met (start the prefill)
//!                  └─ else ─────────────────────────► Queued (until the bootstrap deadline)
//!   notice(room, attempt) ─┬─ that attempt started ─► Duplicate (ignored: nothing waits for it)
//!                          ├─ room aborted ─────────► Aborted (acknowledge: nothing written)
//!                          ├─ its request is here ──► Met
//!                          └─ else ─────────────────► Queued
//!   abort(room) ─┬─ a half waits here ──► CaughtBeforeStart (acknowledge; drop the late half)
//!                ├─ with an attempt ────► InFlight (the prefill worker drains, then acks)
//!                └─ else ───────────────► Early (drop the router's half when it comes)
//!   expire(now) ──► halves that waited past the deadline (their senders are told)
//! ```

use std::collections::BTreeMap;

/// The router's half arrived.
#[derive(Debug, PartialEq, Eq)]
pub enum OnRequest<R, N> {
    /// The room was aborted before: dropped.
    Dropped,
    /// Its notice was waiting: start.
    Met {
        /// The request.
        request: R,
        /// The notice.
        notice: N,
    },
    /// Waits for its notice.
    Queued,
}

/// Decode's notice arrived.
#[derive(Debug, PartialEq, Eq)]
pub enum OnNotice<R, N> {
    /// That attempt was already started here: a duplicate.
    Duplicate,
    /// The room was aborted before both halves met: acknowledge (nothing was written).
    Aborted,
    /// Its request was waiting: start.
    Met {
        /// The request.
        request: R,
        /// How long the request waited here (ms).
        waited_ms: u64,
        /// The notice.
        notice: N,
    },
    /// Waits for its request.
    Queued,
}

/// An abort arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnAbort {
    /// Caught while a half waited here: nothing was written. `acknowledge` when it named an
    /// attempt (decode waits for the acknowledgement).
    CaughtBeforeStart {
        /// Whether to acknowledge.
        acknowledge: bool,
    },
    /// The prefill may be under way: the worker stops it and acknowledges after its drain.
    InFlight,
    /// Before the router's half: it is dropped when it comes.
    Early,
}

/// Halves that waited past the deadline.
#[derive(Debug, PartialEq, Eq)]
pub struct Expired<R, N> {
    /// Requests whose notice never came, by room.
    pub requests: Vec<(u64, R)>,
    /// Notices whose request never came: (room, attempt, notice).
    pub notices: Vec<(u64, u64, N)>,
}

/// One prefill node's waiting halves.
#[derive(Debug)]
pub struct Rendezvous<R, N> {
    requests: BTreeMap<u64, (R, u64)>,
    notices: BTreeMap<u64, (N, u64, u64)>,
    /// Rooms aborted before both halves met (the late half is dropped on arrival).
    dropped: BTreeMap<u64, u64>,
    /// Rooms whose halves met, with the attempt started: a duplicated notice is ignored
    /// instead of waiting for a request that will not come (and then failing a live attempt).
    started: BTreeMap<u64, (u64, u64)>,
    forget_started: bool,
}

impl<R, N> Default for Rendezvous<R, N> {
    fn default() -> Self {
        Rendezvous {
            requests: BTreeMap::new(),
            notices: BTreeMap::new(),
            dropped: BTreeMap::new(),
            started: BTreeMap::new(),
            forget_started: false,
        }
    }
}

impl<R, N> Rendezvous<R, N> {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// A queue with the duplicated-notice fix reverted (started rooms are not remembered), only
    /// for proving that the simulator catches that bug.
    #[cfg(feature = "mutations")]
    pub fn with_reverted_duplicate_fix() -> Self {
        Rendezvous {
            forget_started: true,
            ..Self::default()
        }
    }

    /// The router's half for `room`.
    pub fn request(&mut self, room: u64, request: R, now_ms: u64) -> OnRequest<R, N> {
        if self.dropped.remove(&room).is_some() {
            return OnRequest::Dropped;
        }
        match self.notices.remove(&room) {
            Some((notice, attempt, _)) => {
                self.start(room, attempt, now_ms);
                OnRequest::Met { request, notice }
            }
            None => {
                self.requests.insert(room, (request, now_ms));
                OnRequest::Queued
            }
        }
    }

    /// Decode's notice of `attempt` for `room`.
    pub fn notice(&mut self, room: u64, attempt: u64, notice: N, now_ms: u64) -> OnNotice<R, N> {
        if self.started.get(&room).is_some_and(|(a, _)| *a == attempt) {
            return OnNotice::Duplicate;
        }
        if self.dropped.contains_key(&room) {
            return OnNotice::Aborted;
        }
        match self.requests.remove(&room) {
            Some((request, since)) => {
                self.start(room, attempt, now_ms);
                OnNotice::Met {
                    request,
                    waited_ms: now_ms.saturating_sub(since),
                    notice,
                }
            }
            None => {
                self.notices.insert(room, (notice, attempt, now_ms));
                OnNotice::Queued
            }
        }
    }

    fn start(&mut self, room: u64, attempt: u64, now_ms: u64) {
        if !self.forget_started {
            self.started.insert(room, (attempt, now_ms));
        }
    }

    /// An abort for `room` (of decode's `attempt`, or the router's, without one).
    pub fn abort(&mut self, room: u64, attempt: Option<u64>, now_ms: u64) -> OnAbort {
        let waiting = self.requests.remove(&room).is_some();
        let noticed = self.notices.remove(&room).is_some();
        if waiting || noticed {
            if !waiting {
                self.dropped.insert(room, now_ms);
            }
            OnAbort::CaughtBeforeStart {
                acknowledge: attempt.is_some(),
            }
        } else if attempt.is_some() {
            OnAbort::InFlight
        } else {
            self.dropped.insert(room, now_ms);
            OnAbort::Early
        }
    }

    /// Takes the halves that waited longer than `limit_ms`; forgets old aborts and starts.
    pub fn expire(&mut self, now_ms: u64, limit_ms: u64) -> Expired<R, N> {
        let late = |since: u64| now_ms.saturating_sub(since) > limit_ms;
        let rooms: Vec<u64> = self
            .requests
            .iter()
            .filter(|(_, (_, since))| late(*since))
            .map(|(r, _)| *r)
            .collect();
        let requests = rooms
            .into_iter()
            .filter_map(|r| self.requests.remove(&r).map(|(q, _)| (r, q)))
            .collect();
        let rooms: Vec<u64> = self
            .notices
            .iter()
            .filter(|(_, (_, _, since))| late(*since))
            .map(|(r, _)| *r)
            .collect();
        let notices = rooms
            .into_iter()
            .filter_map(|r| self.notices.remove(&r).map(|(n, a, _)| (r, a, n)))
            .collect();
        self.dropped.retain(|_, since| !late(*since));
        self.started.retain(|_, (_, since)| !late(*since));
        Expired { requests, notices }
    }

    /// Requests waiting for their notice.
    pub fn waiting(&self) -> usize {
        self.requests.len()
    }

    /// Whether no half waits here.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty() && self.notices.is_empty()
    }

    /// Notices waiting for their request.
    pub fn noticed(&self) -> usize {
        self.notices.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_meet_in_either_order_and_a_duplicate_notice_is_not_queued() {
        let mut q: Rendezvous<&str, &str> = Rendezvous::new();
        assert_eq!(q.request(1, "prompt", 0), OnRequest::Queued);
        assert_eq!(
            q.notice(1, 7, "pages", 40),
            OnNotice::Met {
                request: "prompt",
                waited_ms: 40,
                notice: "pages"
            }
        );
        assert_eq!(q.notice(1, 7, "pages", 41), OnNotice::Duplicate);
        assert_eq!(q.notice(2, 8, "pages", 50), OnNotice::Queued);
        assert_eq!(
            q.request(2, "prompt", 60),
            OnRequest::Met {
                request: "prompt",
                notice: "pages"
            }
        );
        assert!(q.is_empty());
    }

    #[test]
    fn aborts_are_caught_before_the_start_or_passed_to_the_worker() {
        let mut q: Rendezvous<&str, &str> = Rendezvous::new();
        assert_eq!(q.abort(3, None, 0), OnAbort::Early);
        assert_eq!(q.request(3, "late", 1), OnRequest::Dropped);
        assert_eq!(q.notice(4, 9, "pages", 0), OnNotice::Queued);
        assert_eq!(
            q.abort(4, Some(9), 1),
            OnAbort::CaughtBeforeStart { acknowledge: true }
        );
        assert_eq!(q.notice(4, 9, "again", 2), OnNotice::Aborted);
        assert_eq!(q.abort(5, Some(1), 0), OnAbort::InFlight);
    }

    #[test]
    fn halves_past_the_deadline_are_handed_back_once() {
        let mut q: Rendezvous<&str, &str> = Rendezvous::new();
        q.request(1, "prompt", 0);
        q.notice(2, 5, "pages", 500);
        let e = q.expire(1_000, 1_000);
        assert!(e.requests.is_empty() && e.notices.is_empty());
        let e = q.expire(1_001, 1_000);
        assert_eq!(e.requests, vec![(1, "prompt")]);
        assert!(e.notices.is_empty());
        let e = q.expire(1_501, 1_000);
        assert_eq!(e.notices, vec![(2, 5, "pages")]);
        assert!(q.is_empty());
    }
}
