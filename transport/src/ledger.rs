//! The transfer ledger: who may touch which KV page, per (room, attempt). Sans-IO: no sockets,
//! no clocks (time is an argument), no threads. Every backend goes through it.
//!
//! ```text
//!              open(room, pages)            complete(key)
//!   (none) ───────────────────► Active ───────────────────► Completed ──► (room reusable)
//!                                 │  (destination: published to decode; pins dropped)
//!                                 │ abort(key, reason)
//!                                 ▼
//!                              Draining ── drained(key) / endpoint_destroyed(peer) ──► Closed
//!                     (not published; pins kept: a write may still land)
//! ```
//!
//! Rules it keeps (DESIGN.md 1–3 and 5):
//! - pages are pinned from `open` until the attempt completes or its drain is proven (an
//!   acknowledged fence, or the destruction of the transport endpoint that could write);
//! - only a completed attempt that was never aborted publishes its destination pages;
//! - attempt keys increase monotonically; a callback that names an old key never changes a newer
//!   attempt of the same room (it is ignored and counted);
//! - a room is live at most once: opening a live room is refused;
//! - every drain has a deadline ([`TransferLedger::overdue`]); the recovery path is to destroy the
//!   endpoint, after which the pins drop.

use std::collections::{BTreeMap, HashMap};

use duet_gpu::{PageAllocator, PageId, PoolError};

/// A request's transfer channel, chosen by the router (a random 63-bit number).
pub type Room = u64;

/// One attempt at moving a room's KV; increases monotonically per ledger.
pub type AttemptKey = u64;

/// Which side of the transfer this ledger keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Prefill: the pages are read (source pins keep them stable).
    Source,
    /// Decode: the pages are written (destination pins keep them from reuse).
    Destination,
}

/// Why an attempt was aborted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AbortReason {
    /// The client went away.
    ClientCancel,
    /// A deadline passed.
    Timeout,
    /// The producer (prefill) failed.
    ProducerFailure,
    /// The consumer (decode) failed.
    ConsumerFailure,
}

impl AbortReason {
    /// Its name in metrics and logs.
    pub fn name(self) -> &'static str {
        match self {
            AbortReason::ClientCancel => "client_cancel",
            AbortReason::Timeout => "timeout",
            AbortReason::ProducerFailure => "producer_failure",
            AbortReason::ConsumerFailure => "consumer_failure",
        }
    }
}

/// Where an attempt stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Writes may be in flight; not published.
    Active,
    /// Aborted; writes may still land; pins kept until drained.
    Draining {
        /// Why.
        reason: AbortReason,
        /// When the abort happened (caller's clock, milliseconds).
        since_ms: u64,
    },
    /// Every page arrived; destination pages published; pins dropped.
    Completed,
    /// Drained after an abort; pins dropped.
    Closed,
}

/// What a call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The attempt changed state.
    Applied,
    /// A duplicate or late call; nothing changed.
    Ignored,
    /// The key names an older attempt than the room's current one; nothing changed.
    Stale,
}

/// A refused call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    /// The room already has a live attempt.
    #[error("room {0} already has a live attempt")]
    RoomLive(Room),
    /// No attempt has that key.
    #[error("no attempt {0}")]
    UnknownAttempt(AttemptKey),
    /// The page allocator refused (a bug in the caller's bookkeeping).
    #[error(transparent)]
    Pool(#[from] PoolError),
}

#[derive(Debug, Clone)]
struct Attempt {
    room: Room,
    peer: String,
    pages: Vec<PageId>,
    state: State,
    /// Whether the ledger holds the request's reference on the pages (released at abort).
    owns_refs: bool,
}

/// Counters for metrics and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LedgerStats {
    /// Callbacks that named an old attempt.
    pub stale: u64,
    /// Duplicate or late calls.
    pub ignored: u64,
    /// Attempts published.
    pub published: u64,
    /// Attempts aborted.
    pub aborted: u64,
}

/// The ledger of one side of one node.
#[derive(Debug)]
pub struct TransferLedger {
    side: Side,
    next_key: AttemptKey,
    attempts: BTreeMap<AttemptKey, Attempt>,
    /// The newest attempt of each room.
    rooms: HashMap<Room, AttemptKey>,
    /// Counters.
    pub stats: LedgerStats,
}

impl TransferLedger {
    /// An empty ledger for `side`.
    pub fn new(side: Side) -> TransferLedger {
        TransferLedger {
            side,
            next_key: 1,
            attempts: BTreeMap::new(),
            rooms: HashMap::new(),
            stats: LedgerStats::default(),
        }
    }

    /// Starts an attempt for `room` with `peer` over `pages` (already allocated by the caller,
    /// who holds one reference on each). The pages are pinned. With `owns_refs`, the ledger
    /// takes over the caller's reference and drops it when the attempt is aborted (the request
    /// no longer wants the pages) or hands it back on completion.
    pub fn open(
        &mut self,
        room: Room,
        peer: &str,
        pages: Vec<PageId>,
        owns_refs: bool,
        alloc: &mut PageAllocator,
    ) -> Result<AttemptKey, LedgerError> {
        let live = self
            .rooms
            .get(&room)
            .and_then(|k| self.attempts.get(k))
            .is_some_and(|a| matches!(a.state, State::Active | State::Draining { .. }));
        if live {
            return Err(LedgerError::RoomLive(room));
        }
        pin_all(&pages, alloc)?;
        let key = self.next_key;
        self.next_key += 1;
        self.rooms.insert(room, key);
        self.attempts.insert(
            key,
            Attempt {
                room,
                peer: peer.to_string(),
                pages,
                state: State::Active,
                owns_refs,
            },
        );
        Ok(key)
    }

    /// Pins `pages` too, for an active attempt (a source attempt grows chunk by chunk as
    /// prefill fills pages). Refused for an attempt that is no longer active.
    pub fn extend(
        &mut self,
        key: AttemptKey,
        pages: &[PageId],
        alloc: &mut PageAllocator,
    ) -> Result<Outcome, LedgerError> {
        let a = match self.live_active(key)? {
            Ok(a) => a,
            Err(o) => return Ok(o),
        };
        pin_all(pages, alloc)?;
        a.pages.extend_from_slice(pages);
        Ok(Outcome::Applied)
    }

    /// The state of an attempt.
    pub fn state(&self, key: AttemptKey) -> Option<State> {
        self.attempts.get(&key).map(|a| a.state)
    }

    /// How many pages an attempt holds (0 for an unknown one).
    pub fn pages(&self, key: AttemptKey) -> usize {
        self.attempts.get(&key).map_or(0, |a| a.pages.len())
    }

    /// The newest attempt of a room.
    pub fn current(&self, room: Room) -> Option<AttemptKey> {
        self.rooms.get(&room).copied()
    }

    /// Whether a call about `key` concerns the room's current attempt.
    fn classify(&mut self, key: AttemptKey) -> Result<Option<Outcome>, LedgerError> {
        let a = self
            .attempts
            .get(&key)
            .ok_or(LedgerError::UnknownAttempt(key))?;
        if self.rooms.get(&a.room) != Some(&key) {
            self.stats.stale += 1;
            return Ok(Some(Outcome::Stale));
        }
        Ok(None)
    }

    /// The attempt `key`, if it is its room's current one and still active; otherwise what the
    /// call amounts to (stale or ignored, counted).
    fn live_active(
        &mut self,
        key: AttemptKey,
    ) -> Result<Result<&mut Attempt, Outcome>, LedgerError> {
        if let Some(o) = self.classify(key)? {
            return Ok(Err(o));
        }
        let a = self
            .attempts
            .get_mut(&key)
            .ok_or(LedgerError::UnknownAttempt(key))?;
        if a.state != State::Active {
            self.stats.ignored += 1;
            return Ok(Err(Outcome::Ignored));
        }
        Ok(Ok(a))
    }

    /// Every page of the attempt arrived (destination) or was read (source). A destination
    /// attempt publishes its pages; the pins drop. After an abort this publishes nothing.
    /// Returns the published pages (destination, first completion only).
    pub fn complete(
        &mut self,
        key: AttemptKey,
        alloc: &mut PageAllocator,
    ) -> Result<(Outcome, Vec<PageId>), LedgerError> {
        let side = self.side;
        let a = match self.live_active(key)? {
            Ok(a) => a,
            Err(o) => return Ok((o, Vec::new())),
        };
        a.state = State::Completed;
        for &p in &a.pages {
            alloc.unpin(p)?;
        }
        let published = if side == Side::Destination {
            a.pages.clone()
        } else {
            Vec::new()
        };
        if a.owns_refs && side == Side::Source {
            // A source attempt that owned the request's references gives them up once read.
            alloc.release_all(&a.pages)?;
        }
        if side == Side::Destination {
            self.stats.published += 1;
        }
        Ok((Outcome::Applied, published))
    }

    /// Aborts an attempt: never published; pins kept until the drain is proven. If the ledger
    /// holds the request's references, they are dropped now (the pages free once drained).
    pub fn abort(
        &mut self,
        key: AttemptKey,
        reason: AbortReason,
        now_ms: u64,
        alloc: &mut PageAllocator,
    ) -> Result<Outcome, LedgerError> {
        let a = match self.live_active(key)? {
            Ok(a) => a,
            Err(o) => return Ok(o),
        };
        a.state = State::Draining {
            reason,
            since_ms: now_ms,
        };
        if a.owns_refs {
            alloc.release_all(&a.pages)?;
            a.owns_refs = false;
        }
        self.stats.aborted += 1;
        Ok(Outcome::Applied)
    }

    /// The transport proved that no write of this attempt can still land: the pins drop.
    /// Old keys are honoured too (a drain of an old attempt frees its pages); a drain of an
    /// attempt that was not aborted changes nothing.
    pub fn drained(
        &mut self,
        key: AttemptKey,
        alloc: &mut PageAllocator,
    ) -> Result<Outcome, LedgerError> {
        let a = self
            .attempts
            .get_mut(&key)
            .ok_or(LedgerError::UnknownAttempt(key))?;
        if !matches!(a.state, State::Draining { .. }) {
            self.stats.ignored += 1;
            return Ok(Outcome::Ignored);
        }
        a.state = State::Closed;
        for &p in &a.pages {
            alloc.unpin(p)?;
        }
        Ok(Outcome::Applied)
    }

    /// The transport endpoint to `peer` is gone (torn down, or the peer restarted): nothing
    /// can write any more, so every draining attempt with it closes. Active attempts with it are
    /// aborted first (as a failure of the other side) and closed at once.
    pub fn endpoint_destroyed(
        &mut self,
        peer: &str,
        now_ms: u64,
        alloc: &mut PageAllocator,
    ) -> Result<Vec<AttemptKey>, LedgerError> {
        let reason = match self.side {
            Side::Source => AbortReason::ConsumerFailure,
            Side::Destination => AbortReason::ProducerFailure,
        };
        let keys = self.live_with(peer);
        for &k in &keys {
            if self.state(k) == Some(State::Active) {
                // Even an old attempt (room reused) must stop being Active before it closes.
                let a = self
                    .attempts
                    .get_mut(&k)
                    .ok_or(LedgerError::UnknownAttempt(k))?;
                a.state = State::Draining {
                    reason,
                    since_ms: now_ms,
                };
                self.stats.aborted += 1;
                if a.owns_refs {
                    alloc.release_all(&a.pages)?;
                    a.owns_refs = false;
                }
            }
            self.drained(k, alloc)?;
        }
        Ok(keys)
    }

    /// The attempts with `peer` that still hold pages (active or draining): those
    /// [`endpoint_destroyed`](Self::endpoint_destroyed) would close.
    pub fn live_with(&self, peer: &str) -> Vec<AttemptKey> {
        self.attempts
            .iter()
            .filter(|(_, a)| {
                a.peer == peer && matches!(a.state, State::Active | State::Draining { .. })
            })
            .map(|(k, _)| *k)
            .collect()
    }

    /// Draining attempts whose abort is older than `backstop_ms`: their acknowledgement is
    /// overdue, and the recovery path is to destroy the endpoint to their peer.
    pub fn overdue(&self, now_ms: u64, backstop_ms: u64) -> Vec<(AttemptKey, String)> {
        self.attempts
            .iter()
            .filter_map(|(k, a)| match a.state {
                State::Draining { since_ms, .. }
                    if now_ms.saturating_sub(since_ms) >= backstop_ms =>
                {
                    Some((*k, a.peer.clone()))
                }
                _ => None,
            })
            .collect()
    }

    /// Pages of aborted attempts whose writes are not yet proven drained (quarantined: no
    /// request holds them, but they cannot be reused).
    pub fn quarantined_pages(&self) -> usize {
        self.attempts
            .values()
            .filter(|a| matches!(a.state, State::Draining { .. }))
            .map(|a| a.pages.len())
            .sum()
    }

    /// Pages a write of some attempt may still touch (active or draining attempts).
    pub fn busy_pages(&self) -> Vec<PageId> {
        self.attempts
            .values()
            .filter(|a| matches!(a.state, State::Active | State::Draining { .. }))
            .flat_map(|a| a.pages.iter().copied())
            .collect()
    }

    /// Forgets finished attempts (completed or closed) that are no longer their room's current
    /// one, bounding the ledger's memory.
    pub fn prune(&mut self) {
        let rooms = &self.rooms;
        self.attempts.retain(|k, a| {
            matches!(a.state, State::Active | State::Draining { .. })
                || rooms.get(&a.room) == Some(k)
        });
    }
}

/// Pins every page, or none: the pins taken before a failure are rolled back, so nothing
/// half-pinned stays behind.
fn pin_all(pages: &[PageId], alloc: &mut PageAllocator) -> Result<(), LedgerError> {
    for (i, &p) in pages.iter().enumerate() {
        if let Err(e) = alloc.pin(p) {
            for &q in &pages[..i] {
                let _ = alloc.unpin(q);
            }
            return Err(e.into());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
