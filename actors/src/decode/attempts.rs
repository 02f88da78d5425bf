//! Decode's transfers from notice to their end, as a sans-IO state machine: which attempt is
//! current for each (prefill, room), its progress and deadline, what a Done, a failure, an
//! acknowledgement, a lost peer or a deadline does to it, and when its pages change hands.
//! Time is an argument (ms on the caller's clock), the proof that no write can land comes from
//! a [`Fence`], pages come from the caller's [`PageAllocator`], and what must be told to others
//! comes back as [`Effect`]s. Decode's engine thread and the simulator both run it, so the rules
//! a page's reuse hangs on are one piece of code, explored under every timing.
//!
//! ```text
//!  open ──► current ── Done: revoke proven ──► fenced ── check ok ──► published (to the batch)
//!             │   │          └─ busy ──► ended       │  └─ check failed ──► ended
//!             │   │                                  └─ cancel ──► ended (free at once)
//!             │   └─ chunk, prefill stepping: progress (the deadline counts from here)
//!             └─ failed, cancel, peer lost, receiver lost, no progress for the deadline
//!                   ──► ended: ledger aborted, quarantined ── revoke proven ──► closed, free
//! ```
//!
//! A fenced attempt's writer is done (its revoke is proven): what remains is decode's own check
//! of the landed bytes, which may take several turns ([`Attempts::fence`], then
//! [`Attempts::publish`]). Neither a deadline nor the writer's loss ends it meanwhile; a
//! cancel still does.
//!
//! DESIGN rules 2 and 5: a deadline starts recovery and raises alarms; only a proof frees a page.

use std::collections::BTreeMap;
use std::fmt::Display;

use duet_gpu::{PageAllocator, PageId};
use duet_transport::{
    AbortReason, AttemptKey, Fence, LedgerError, Outcome, Quarantine, Revocation, Room, Settle,
    Side, TransferLedger,
};

/// A transfer decode is receiving: the current attempt of its room.
#[derive(Debug)]
pub struct Open<T> {
    /// The attempt.
    pub attempt: AttemptKey,
    /// The pages prefill writes (its grant), in the notice's order.
    pub grant: Vec<PageId>,
    /// Pages the request holds beside the grant (a cached prefix, room to decode into): given
    /// back when the transfer ends, handed over with the grant when it is published.
    pub held: Vec<PageId>,
    /// When the notice went out (ms).
    pub noticed_ms: u64,
    /// The last sign of progress: the notice, a chunk written, or prefill's engine stepping
    /// while it holds the attempt (ms). The deadline counts from here.
    pub progressed_ms: u64,
    /// Prefill's Done came and the grant's revoke is proven: no byte of the attempt can land
    /// any more, and only decode's check stands between it and the batch.
    pub fenced: bool,
    /// What the caller keeps about the request.
    pub item: T,
}

/// A transfer that ended without being published.
#[derive(Debug)]
pub struct Ended<T> {
    /// What the caller kept about the request.
    pub item: T,
    /// The attempt (now quarantined until its revoke is proven, or closed already).
    pub attempt: AttemptKey,
    /// Why.
    pub reason: AbortReason,
    /// The grant (quarantined, or free if the revoke was proven at once).
    pub grant: Vec<PageId>,
    /// The pages the request held beside the grant, given back.
    pub released: Vec<PageId>,
}

/// What a Done of prefill's did.
#[derive(Debug)]
pub enum Done<T, E> {
    /// The current attempt, revoked with proof and checked: its grant is published. `pages`
    /// are the held pages followed by the grant, as the sequence owns them now.
    Published {
        /// What the caller kept about the request.
        item: T,
        /// The attempt.
        attempt: AttemptKey,
        /// The held pages, then the grant.
        pages: Vec<PageId>,
        /// How many of `pages` were held (the first ones).
        held: usize,
        /// From the notice to now (ms).
        latency_ms: u64,
    },
    /// The check refused the KV (a checksum): ended, never published. Prefill ended it itself.
    Refused(Ended<T>, E),
    /// A writer still holds the grant's claim although prefill fenced before its Done: never
    /// published; ended, and prefill is told to stop.
    Landing(Ended<T>),
    /// Not the current attempt of its room (aborted meanwhile, or a duplicate): nothing of the
    /// room changes; an aborted attempt is asked for its proof again.
    Stale,
}

/// What fencing on prefill's Done did.
#[derive(Debug)]
pub enum Fenced<T> {
    /// The current attempt, its revoke proven: no write of it can land any more. It waits for
    /// [`Attempts::publish`] (after decode's check of the landed bytes).
    Fenced,
    /// A writer still holds the grant's claim although prefill fenced before its Done: never
    /// published; ended, and prefill is told to stop.
    Landing(Ended<T>),
    /// Not the current attempt of its room, or fenced already: nothing of the room changes;
    /// an aborted attempt is asked for its proof again.
    Stale,
}

/// What decode must do for the state machine, besides answering the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect<P> {
    /// Tell prefill to stop writing the attempt (it drains, then acknowledges).
    StopPrefill {
        /// The writer.
        prefill: P,
        /// The room.
        room: Room,
        /// The attempt.
        attempt: AttemptKey,
    },
    /// An abort went unacknowledged for a drain fence: ask the writer again (an abort may have
    /// been lost with a connection).
    DrainFence {
        /// The writer.
        prefill: P,
        /// The room.
        room: Room,
        /// The attempt.
        attempt: AttemptKey,
    },
    /// An aborted attempt is still unproven past the backstop: the alarm, raised once. Its
    /// pages stay quarantined until its writer finishes its copy or dies.
    Alarm {
        /// The writer.
        prefill: P,
        /// The attempt.
        attempt: AttemptKey,
        /// Pages it keeps quarantined.
        pages: usize,
    },
    /// An aborted attempt's revoke was proven: closed, its pins dropped.
    Closed {
        /// The attempt.
        attempt: AttemptKey,
        /// Its writer.
        prefill: P,
        /// Its grant (free now unless something else holds a page).
        grant: Vec<PageId>,
    },
}

/// What an acknowledgement of an abort was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ack {
    /// Of an attempt of this writer that is quarantined: its proof was asked again.
    Asked(Settle),
    /// Of an attempt quarantined for another writer: ignored.
    Stale,
    /// Of an attempt not quarantined (proven already, or never ours).
    Unknown,
}

/// What every event of a transfer needs from decode besides the event itself: the time, the
/// proof that no write can land, and the pages.
pub struct At<'a> {
    /// Now, in ms on decode's clock.
    pub now_ms: u64,
    /// Revokes grants: proven when no writer can land a byte of the attempt any more.
    pub fence: &'a mut dyn Fence,
    /// Decode's pages.
    pub alloc: &'a mut PageAllocator,
}

/// The limits [`Attempts::tend`] applies, in ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// A transfer without progress this long ends (a deadline starts recovery).
    pub timeout_ms: u64,
    /// An abort unacknowledged this long is asked again.
    pub fence_ms: u64,
    /// An aborted attempt unproven this long raises the alarm (its pages stay quarantined).
    pub backstop_ms: u64,
}

/// An aborted attempt waiting for its proof, beside the quarantine's record of it.
#[derive(Debug)]
struct Draining<P> {
    prefill: P,
    grant: Vec<PageId>,
}

/// Decode's transfers, keyed by (prefill node, room).
#[derive(Debug)]
pub struct Attempts<P, T> {
    ledger: TransferLedger,
    open: BTreeMap<(P, Room), Open<T>>,
    quarantine: Quarantine,
    draining: BTreeMap<AttemptKey, Draining<P>>,
    effects: Vec<Effect<P>>,
}

impl<P: Ord + Clone + Display, T> Default for Attempts<P, T> {
    fn default() -> Self {
        Attempts::with_quarantine(Quarantine::new())
    }
}

impl<P: Ord + Clone + Display, T> Attempts<P, T> {
    /// No transfer yet.
    pub fn new() -> Self {
        Attempts::default()
    }

    /// No transfer yet, over `quarantine` (the simulator's mutation check passes one with a
    /// fix reverted).
    pub fn with_quarantine(quarantine: Quarantine) -> Self {
        Attempts {
            ledger: TransferLedger::new(Side::Destination),
            open: BTreeMap::new(),
            quarantine,
            draining: BTreeMap::new(),
            effects: Vec::new(),
        }
    }

    /// Opens an attempt for `room`, written by `prefill` into `grant` (allocated by the caller,
    /// one reference each, which the ledger takes over); `held` are the request's other pages.
    /// The caller then grants the attempt in its fence and sends the notice.
    pub fn open(
        &mut self,
        (prefill, room): (P, Room),
        grant: Vec<PageId>,
        held: Vec<PageId>,
        now_ms: u64,
        item: T,
        alloc: &mut PageAllocator,
    ) -> Result<AttemptKey, LedgerError> {
        let name = prefill.to_string();
        let attempt = self.ledger.open(room, &name, grant.clone(), true, alloc)?;
        self.open.insert(
            (prefill, room),
            Open {
                attempt,
                grant,
                held,
                noticed_ms: now_ms,
                progressed_ms: now_ms,
                fenced: false,
                item,
            },
        );
        Ok(attempt)
    }

    /// The current transfer of `room` from `prefill`.
    pub fn get(&self, prefill: &P, room: Room) -> Option<&Open<T>> {
        self.open.get(&(prefill.clone(), room))
    }

    /// Transfers under way, by (prefill, room).
    pub fn iter(&self) -> impl Iterator<Item = (&(P, Room), &Open<T>)> {
        self.open.iter()
    }

    /// How many transfers are under way.
    pub fn len(&self) -> usize {
        self.open.len()
    }

    /// Whether no transfer is under way.
    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// Whether `attempt` is aborted and waits for its proof.
    pub fn is_draining(&self, attempt: AttemptKey) -> bool {
        self.draining.contains_key(&attempt)
    }

    /// How many aborted attempts wait for their proof.
    pub fn draining(&self) -> usize {
        self.draining.len()
    }

    /// Pages held by aborted attempts waiting for their proof.
    pub fn quarantined_pages(&self) -> usize {
        self.ledger.quarantined_pages()
    }

    /// What decode must do, in order, since the last call.
    pub fn take_effects(&mut self) -> Vec<Effect<P>> {
        std::mem::take(&mut self.effects)
    }

    /// A chunk of the current attempt was written: progress. The caller's record of the
    /// transfer, or `None` for a stale report (another attempt, or none).
    pub fn progress(
        &mut self,
        prefill: &P,
        room: Room,
        attempt: AttemptKey,
        now_ms: u64,
    ) -> Option<&mut T> {
        let o = self.open.get_mut(&(prefill.clone(), room))?;
        if o.attempt != attempt {
            return None;
        }
        o.progressed_ms = o.progressed_ms.max(now_ms);
        Some(&mut o.item)
    }

    /// Prefill's engine stepped while it holds these attempts of ours: each has progressed (a
    /// prompt queued behind others on a busy prefill is not stalled).
    pub fn stepping(&mut self, prefill: &P, holding: &[AttemptKey], now_ms: u64) {
        for ((p, _), o) in self.open.iter_mut() {
            if p == prefill && holding.contains(&o.attempt) {
                o.progressed_ms = o.progressed_ms.max(now_ms);
            }
        }
    }

    /// Prefill says every write of `attempt` landed: [`Attempts::fence`], then
    /// [`Attempts::publish`] with `check`, in one call (a check that needs no time).
    pub fn done<E>(
        &mut self,
        prefill: &P,
        room: Room,
        attempt: AttemptKey,
        at: &mut At<'_>,
        check: impl FnOnce(&Open<T>) -> Result<(), E>,
    ) -> Done<T, E> {
        match self.fence(prefill, room, attempt, at) {
            Fenced::Fenced => self.publish(prefill, room, attempt, at, check),
            Fenced::Landing(e) => Done::Landing(e),
            Fenced::Stale => Done::Stale,
        }
    }

    /// Prefill says every write of `attempt` landed. The grant is revoked first (as on every
    /// end): no write can land once the pages are checked and change hands. A proven revoke
    /// leaves the attempt fenced, for [`Attempts::publish`] once decode has checked the
    /// landed KV; a writer still inside its claim ends it.
    pub fn fence(
        &mut self,
        prefill: &P,
        room: Room,
        attempt: AttemptKey,
        at: &mut At<'_>,
    ) -> Fenced<T> {
        let key = (prefill.clone(), room);
        match self.open.get(&key) {
            Some(o) if o.attempt == attempt && !o.fenced => {}
            // A duplicate Done of a fenced attempt changes nothing.
            Some(o) if o.attempt == attempt => return Fenced::Stale,
            _ => {
                // An old attempt's message never touches a newer one; a Done is as good a
                // reason as an acknowledgement to ask for an aborted attempt's proof again.
                self.settle(attempt, at);
                return Fenced::Stale;
            }
        }
        if at.fence.revoke(attempt) == Revocation::Busy {
            let ended = self.end_key(&key, AbortReason::ProducerFailure, true, at);
            return ended.map_or(Fenced::Stale, Fenced::Landing);
        }
        if let Some(o) = self.open.get_mut(&key) {
            o.fenced = true;
            o.progressed_ms = o.progressed_ms.max(at.now_ms);
        }
        Fenced::Fenced
    }

    /// Decode checked a fenced attempt's landed KV: `check` (checksums) decides whether its
    /// grant is published. `Stale` unless `attempt` is the room's current one and fenced (a
    /// cancel may have ended it while decode checked).
    pub fn publish<E>(
        &mut self,
        prefill: &P,
        room: Room,
        attempt: AttemptKey,
        at: &mut At<'_>,
        check: impl FnOnce(&Open<T>) -> Result<(), E>,
    ) -> Done<T, E> {
        let key = (prefill.clone(), room);
        if !self
            .open
            .get(&key)
            .is_some_and(|o| o.attempt == attempt && o.fenced)
        {
            return Done::Stale;
        }
        if let Some(Err(e)) = self.open.get(&key).map(check) {
            // Corrupted or incomplete: never published. The grant is revoked, so the pages
            // are free at once.
            let ended = self.end_key(&key, AbortReason::ProducerFailure, false, at);
            return ended.map_or(Done::Stale, |x| Done::Refused(x, e));
        }
        let Some(o) = self.open.remove(&key) else {
            return Done::Stale;
        };
        match self.ledger.complete(attempt, at.alloc) {
            Ok((Outcome::Applied, _)) => {}
            // The ledger holds every open attempt active until it ends here: only a bug gets
            // here. Nothing is published; the pages stay where the ledger has them.
            _ => return Done::Stale,
        }
        self.ledger.prune();
        let held = o.held.len();
        let mut pages = o.held;
        pages.extend_from_slice(&o.grant);
        Done::Published {
            item: o.item,
            attempt,
            pages,
            held,
            latency_ms: at.now_ms.saturating_sub(o.noticed_ms),
        }
    }

    /// Prefill reports it stopped the attempt (its writes of it drained): the current one ends
    /// (prefill needs no abort); another is asked for its proof. `None` unless it was current.
    pub fn failed(
        &mut self,
        prefill: &P,
        room: Room,
        attempt: AttemptKey,
        at: &mut At<'_>,
    ) -> Option<Ended<T>> {
        let key = (prefill.clone(), room);
        if self.open.get(&key).is_some_and(|o| o.attempt == attempt) {
            return self.end_key(&key, AbortReason::ProducerFailure, false, at);
        }
        self.settle(attempt, at);
        None
    }

    /// Prefill acknowledged an abort: a reason to ask the grant for its proof again (the
    /// revoke is the proof, the acknowledgement only a hint).
    pub fn acknowledged(&mut self, prefill: &P, attempt: AttemptKey, at: &mut At<'_>) -> Ack {
        match self.draining.get(&attempt) {
            Some(d) if d.prefill == *prefill => Ack::Asked(self.settle(attempt, at)),
            Some(_) => Ack::Stale,
            None => Ack::Unknown,
        }
    }

    /// Ends every transfer `which` picks, for `reason`; prefill is told to stop each.
    pub fn end_where(
        &mut self,
        which: impl Fn(&P, &Open<T>) -> bool,
        reason: AbortReason,
        at: &mut At<'_>,
    ) -> Vec<Ended<T>> {
        let keys: Vec<(P, Room)> = self
            .open
            .iter()
            .filter(|((p, _), o)| which(p, o))
            .map(|(k, _)| k.clone())
            .collect();
        keys.iter()
            .filter_map(|k| self.end_key(k, reason, true, at))
            .collect()
    }

    /// `prefill` is gone (unreachable, restarted, its process dead): its transfers end, and
    /// its aborted attempts are asked for their proof again (a dead writer's claims drop).
    /// A fenced attempt stays: its writer finished, and nothing of it can land any more.
    pub fn lose(&mut self, prefill: &P, at: &mut At<'_>) -> Vec<Ended<T>> {
        let ended = self.end_where(
            |p, o| p == prefill && !o.fenced,
            AbortReason::ProducerFailure,
            at,
        );
        let theirs: Vec<AttemptKey> = self
            .draining
            .iter()
            .filter(|(_, d)| d.prefill == *prefill)
            .map(|(a, _)| *a)
            .collect();
        for attempt in theirs {
            self.settle(attempt, at);
        }
        ended
    }

    /// The turn's bookkeeping: every aborted attempt is asked for its proof; those still
    /// unproven get a drain fence (again each `fence_ms`) and, past `backstop_ms`, the alarm;
    /// transfers without progress for `timeout_ms` end (returned). Never a release on a timer.
    pub fn tend(&mut self, limits: Limits, at: &mut At<'_>) -> Vec<Ended<T>> {
        let Limits {
            timeout_ms,
            fence_ms,
            backstop_ms,
        } = limits;
        let now_ms = at.now_ms;
        for attempt in self.quarantine.attempts() {
            self.settle(attempt, at);
        }
        for (attempt, _) in self.quarantine.alarms(now_ms, backstop_ms) {
            if let Some(d) = self.draining.get(&attempt) {
                self.effects.push(Effect::Alarm {
                    prefill: d.prefill.clone(),
                    attempt,
                    pages: self.ledger.pages(attempt),
                });
            }
        }
        for (attempt, _, room) in self.quarantine.ask_again(now_ms, fence_ms) {
            if let Some(d) = self.draining.get(&attempt) {
                self.effects.push(Effect::DrainFence {
                    prefill: d.prefill.clone(),
                    room,
                    attempt,
                });
            }
        }
        // A deadline on progress, not on the work: a long prompt that keeps computing and
        // writing never meets it; a stopped or wedged prefill does. A fenced attempt waits
        // for decode's own check only, which every turn advances.
        self.end_where(
            |_, o| !o.fenced && now_ms.saturating_sub(o.progressed_ms) > timeout_ms,
            AbortReason::Timeout,
            at,
        )
    }

    /// Frees an aborted attempt's pages if no write of it can land any more (its revoke is
    /// proven): the only way pages of an aborted attempt come back.
    pub fn settle(&mut self, attempt: AttemptKey, at: &mut At<'_>) -> Settle {
        let settled =
            self.quarantine
                .settle(attempt, at.now_ms, at.fence, &mut self.ledger, at.alloc);
        if settled == Settle::Closed
            && let Some(d) = self.draining.remove(&attempt)
        {
            self.effects.push(Effect::Closed {
                attempt,
                prefill: d.prefill,
                grant: d.grant,
            });
        }
        settled
    }

    /// Ends the transfer at `key`: aborted in the ledger (never published; its pins stay), the
    /// held pages given back, prefill told to stop unless it ended the attempt itself, and the
    /// grant quarantined until its revoke is proven (asked at once).
    fn end_key(
        &mut self,
        key: &(P, Room),
        reason: AbortReason,
        stop_prefill: bool,
        at: &mut At<'_>,
    ) -> Option<Ended<T>> {
        let o = self.open.remove(key)?;
        let (prefill, room) = key.clone();
        // Ignored: the attempt is active (opened here, ended once), so this applies.
        let _ = self.ledger.abort(o.attempt, reason, at.now_ms, at.alloc);
        // The request's own references on its other pages: they are not written by prefill.
        let _ = at.alloc.release_all(&o.held);
        if stop_prefill {
            self.effects.push(Effect::StopPrefill {
                prefill: prefill.clone(),
                room,
                attempt: o.attempt,
            });
        }
        self.quarantine
            .hold(o.attempt, &prefill.to_string(), room, at.now_ms);
        self.draining.insert(
            o.attempt,
            Draining {
                prefill,
                grant: o.grant.clone(),
            },
        );
        self.settle(o.attempt, at);
        Some(Ended {
            item: o.item,
            attempt: o.attempt,
            reason,
            grant: o.grant,
            released: o.held,
        })
    }
}

#[cfg(test)]
mod tests;
