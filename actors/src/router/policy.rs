//! The router's attempt policy, as a pure state machine: how many attempts a request may still
//! spend, which failures cost nothing, where the next attempt goes (a retry elsewhere, or a
//! migration that continues from the tokens the client has), when a start is waited for and
//! when the request gives up. No clock (time is an argument), no I/O, no locks: the request's
//! shell (`http.rs`) sleeps, starts attempts and streams; this decides.
//!
//! ```text
//!   failed(class, tokens so far) ──► Retry { pause, placement, migration }  or  GiveUp
//!     free:  the router's own restart; a restart under the attempt (at most 50, 100 ms apart);
//!            an attempt that streamed tokens (it made progress)
//!     never: a fatal failure (the request can never be served): it ends at once
//!     costs: anything else, one of `serving.retries` (a request that kills every worker it
//!            meets is bounded); a stalled prefill worker is avoided from then on
//!   start_failed(unavailable, now, deadline) ──► Wait(pause) | Retry(pause) | GiveUp
//!     unavailable (no worker ready, a link down, a service restarting): waited for, free,
//!     until the request's deadline (never for a pair the client forced); refused: costs one
//! ```

use std::time::{Duration, Instant};

pub use super::Placement;
use crate::protocol::FailureClass;

/// Free retries of class [`FailureClass::Restart`] per request: a service that stays down is a
/// failure like any other.
const MAX_REFUSALS: usize = 50;
/// The pause before a retry after a restart under the attempt (the restart takes a moment).
const REFUSAL_PAUSE: Duration = Duration::from_millis(100);
/// The first and the longest pause between starts that failed.
const START_PAUSE: Duration = Duration::from_millis(100);
const START_PAUSE_MAX: Duration = Duration::from_secs(1);

/// One request's attempts so far.
#[derive(Debug, Clone)]
pub struct AttemptPolicy {
    /// Attempts left that cost (none for a pair the client forced).
    budget: usize,
    /// Free retries of class `Restart` so far.
    refusals: usize,
    /// Tokens the client had when the current attempt started.
    progress_mark: usize,
    /// Workers tried so far (later retries avoid them while there are others).
    tried: Vec<String>,
    /// Prefill workers an attempt stalled on: never used again for this request.
    stalled_on: Vec<String>,
    /// The pair the client forced.
    forced: Option<String>,
    /// Whether a stream that has tokens may continue on another decode worker.
    migration: bool,
    /// The pause before the next start, if the one under way fails.
    start_pause: Duration,
}

/// What to do after an attempt failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterFailure {
    /// Start another attempt after `pause`, placed by `placement`. `migration`: the client has
    /// tokens, and the next attempt continues from them.
    Retry {
        /// How long to wait first.
        pause: Duration,
        /// Where it may go.
        placement: Placement,
        /// Whether it continues a stream that has tokens.
        migration: bool,
    },
    /// The request ends with the failed attempt's error.
    GiveUp,
}

/// What to do after a start failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterStartFailure {
    /// No worker could take it now: ask again after the pause, free.
    Wait(Duration),
    /// A worker refused it: ask again after the pause, one attempt spent.
    Retry(Duration),
    /// No attempt left: the request fails with the start's error.
    GiveUp,
}

impl AttemptPolicy {
    /// A request's policy: `retries` attempts may be spent (none when the client forced a
    /// pair, which is never swapped for another behind its back).
    pub fn new(retries: usize, forced: Option<String>, migration: bool) -> AttemptPolicy {
        AttemptPolicy {
            budget: if forced.is_some() { 0 } else { retries },
            refusals: 0,
            progress_mark: 0,
            tried: Vec::new(),
            stalled_on: Vec::new(),
            forced,
            migration,
            start_pause: START_PAUSE,
        }
    }

    /// Where the first attempt goes.
    pub fn first_placement(&self) -> Placement {
        Placement {
            forced: self.forced.clone(),
            ..Placement::default()
        }
    }

    /// An attempt started on `worker` (and `prefill`).
    pub fn started(&mut self, worker: &str, prefill: Option<&str>) {
        self.tried
            .extend(prefill.into_iter().chain([worker]).map(str::to_string));
        self.start_pause = START_PAUSE;
    }

    /// The attempt on `worker` (and `prefill`) failed with `class`, the client having
    /// `generated` tokens of the request so far.
    pub fn failed(
        &mut self,
        class: FailureClass,
        generated: usize,
        worker: &str,
        prefill: Option<&str>,
    ) -> AfterFailure {
        let migrating = generated > 0;
        if class == FailureClass::Fatal || (migrating && !self.migration) {
            return AfterFailure::GiveUp;
        }
        let refused = class == FailureClass::Restart && self.refusals < MAX_REFUSALS;
        let progressed = generated > self.progress_mark;
        let free = class == FailureClass::RouterRestart || refused || progressed;
        if !free {
            if self.budget == 0 {
                return AfterFailure::GiveUp;
            }
            self.budget -= 1;
        }
        if refused {
            self.refusals += 1;
        }
        self.progress_mark = generated;
        if class == FailureClass::Stalled
            && let Some(p) = prefill
        {
            // Not blindly again: the next attempts go around the prefill worker that stalled.
            self.stalled_on.push(p.to_string());
        }
        let placement = Placement {
            // The decode worker that failed is avoided; a continuation goes back to the
            // prefill worker that keeps the prompt's KV.
            exclude: if migrating {
                vec![worker.to_string()]
            } else {
                self.tried.clone()
            },
            forced: None,
            prefer_prefill: if migrating {
                prefill.map(str::to_string)
            } else {
                None
            },
            avoid_prefill: self.stalled_on.clone(),
        };
        AfterFailure::Retry {
            pause: if refused {
                REFUSAL_PAUSE
            } else {
                Duration::ZERO
            },
            placement,
            migration: migrating,
        }
    }

    /// A start failed at `now`; `unavailable` when no worker could take it (none ready, a link
    /// down, its service restarting) rather than one refusing it. The request's `deadline`
    /// bounds the waiting.
    pub fn start_failed(
        &mut self,
        unavailable: bool,
        now: Instant,
        deadline: Instant,
    ) -> AfterStartFailure {
        let pause = self.start_pause;
        self.start_pause = (pause * 2).min(START_PAUSE_MAX);
        // A pair the client named is not waited for: it asked for those workers, now.
        if unavailable && self.forced.is_none() && now + pause < deadline {
            return AfterStartFailure::Wait(pause);
        }
        if self.budget == 0 {
            return AfterStartFailure::GiveUp;
        }
        self.budget -= 1;
        AfterStartFailure::Retry(pause)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn retry(a: AfterFailure) -> (Duration, Placement, bool) {
        match a {
            AfterFailure::Retry {
                pause,
                placement,
                migration,
            } => (pause, placement, migration),
            AfterFailure::GiveUp => panic!("gave up"),
        }
    }

    #[test]
    fn failures_without_progress_spend_the_budget_and_then_give_up() {
        let mut p = AttemptPolicy::new(2, None, true);
        p.started("d0", Some("p0"));
        for _ in 0..2 {
            let (pause, placement, migration) =
                retry(p.failed(FailureClass::Attempt, 0, "d0", Some("p0")));
            assert_eq!((pause, migration), (Duration::ZERO, false));
            assert_eq!(
                placement.exclude,
                ["p0", "d0"],
                "a retry avoids what was tried"
            );
            assert!(placement.avoid_prefill.is_empty());
        }
        assert_eq!(
            p.failed(FailureClass::Attempt, 0, "d0", Some("p0")),
            AfterFailure::GiveUp
        );
    }

    #[test]
    fn a_fatal_failure_is_never_retried() {
        let mut p = AttemptPolicy::new(5, None, true);
        p.started("d0", Some("p0"));
        assert_eq!(
            p.failed(FailureClass::Fatal, 0, "d0", Some("p0")),
            AfterFailure::GiveUp
        );
        assert_eq!(
            p.failed(FailureClass::Fatal, 3, "d0", Some("p0")),
            AfterFailure::GiveUp,
            "nor migrated"
        );
    }

    #[test]
    fn restarts_under_the_attempt_are_free_but_bounded_and_paced() {
        let mut p = AttemptPolicy::new(0, None, true);
        for _ in 0..MAX_REFUSALS {
            let (pause, _, _) = retry(p.failed(FailureClass::Restart, 0, "d0", None));
            assert_eq!(pause, REFUSAL_PAUSE);
        }
        // A service that stays down is a failure like any other (and the budget is 0).
        assert_eq!(
            p.failed(FailureClass::Restart, 0, "d0", None),
            AfterFailure::GiveUp
        );
        // The router's own restart is never the request's doing.
        let (pause, _, _) = retry(p.failed(FailureClass::RouterRestart, 0, "d0", None));
        assert_eq!(pause, Duration::ZERO);
    }

    #[test]
    fn a_stream_with_tokens_migrates_for_free_back_to_the_prefill_that_keeps_its_kv() {
        let mut p = AttemptPolicy::new(0, None, true);
        p.started("d0", Some("p0"));
        let (_, placement, migration) = retry(p.failed(FailureClass::Attempt, 5, "d0", Some("p0")));
        assert!(migration);
        assert_eq!(placement.exclude, ["d0"]);
        assert_eq!(placement.prefer_prefill.as_deref(), Some("p0"));
        // No new token since: that one costs, and the budget is 0.
        assert_eq!(
            p.failed(FailureClass::Attempt, 5, "d1", Some("p0")),
            AfterFailure::GiveUp
        );
        // Without migration, a stream with tokens cannot continue.
        let mut off = AttemptPolicy::new(5, None, false);
        assert_eq!(
            off.failed(FailureClass::Attempt, 1, "d0", None),
            AfterFailure::GiveUp
        );
    }

    #[test]
    fn a_stalled_prefill_worker_is_avoided_from_then_on_and_the_stall_costs() {
        let mut p = AttemptPolicy::new(1, None, true);
        p.started("d0", Some("p0"));
        let (_, placement, _) = retry(p.failed(FailureClass::Stalled, 0, "d0", Some("p0")));
        assert_eq!(placement.avoid_prefill, ["p0"]);
        p.started("d0", Some("p1"));
        assert_eq!(
            p.failed(FailureClass::Stalled, 0, "d0", Some("p1")),
            AfterFailure::GiveUp,
            "one attempt was spent"
        );
    }

    #[test]
    fn a_forced_pair_is_neither_swapped_nor_waited_for() {
        let mut p = AttemptPolicy::new(5, Some("p0,d0".into()), true);
        assert_eq!(p.first_placement().forced.as_deref(), Some("p0,d0"));
        let now = Instant::now();
        let later = now + Duration::from_secs(60);
        assert_eq!(p.start_failed(true, now, later), AfterStartFailure::GiveUp);
        assert_eq!(
            p.failed(FailureClass::Attempt, 0, "d0", Some("p0")),
            AfterFailure::GiveUp
        );
    }

    #[test]
    fn unavailable_starts_are_waited_for_free_until_the_deadline_then_cost() {
        let mut p = AttemptPolicy::new(1, None, true);
        let t0 = Instant::now();
        let deadline = t0 + Duration::from_secs(3);
        // Pauses double to a second; nothing is spent while the deadline allows.
        let mut now = t0;
        let mut pauses = Vec::new();
        while let AfterStartFailure::Wait(pause) = p.start_failed(true, now, deadline) {
            pauses.push(pause.as_millis());
            now += pause;
        }
        assert_eq!(pauses, [100, 200, 400, 800, 1000]);
        // Past it, the one attempt left goes, then the request gives up.
        assert_eq!(
            p.start_failed(true, now, deadline),
            AfterStartFailure::GiveUp
        );
        // A refusal costs at once.
        let mut q = AttemptPolicy::new(1, None, true);
        assert!(matches!(
            q.start_failed(false, t0, deadline),
            AfterStartFailure::Retry(_)
        ));
        assert_eq!(
            q.start_failed(false, t0, deadline),
            AfterStartFailure::GiveUp
        );
        // A start that succeeds resets the pause.
        q.started("d0", None);
        assert_eq!(q.start_pause, START_PAUSE);
    }
}
