//! Supervised actors for threads a worker's data path runs on: prefill's KV sender and
//! decode's KV receiver.
//!
//! The threads belong to a *hub* the worker and the actor share (the worker builds them for
//! its pool when it starts). The actor exists so `duet kill` and its supervisor reach them:
//! when the actor stops, the hub halts its threads without waiting for them; when the
//! supervisor starts a successor, the hub replaces them (joining the old ones first, so
//! nothing of theirs can still write) and tells the worker what the restart cost. The first
//! start finds the worker's threads running and does nothing.

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ractor::{Actor, ActorProcessingErr, ActorRef};

/// What a hub does for its actor.
pub trait HandOff: Send + Sync + 'static {
    /// For logs: what the threads are.
    const WHAT: &'static str;

    /// Actor starts so far (the hub outlives the actor's incarnations).
    fn actor_starts(&self) -> &AtomicU64;

    /// The actor stopped or was killed: stop the threads, without blocking (the successor
    /// joins them).
    fn halt(&self);

    /// A successor started: replace the threads and tell the worker. Blocking.
    fn replace(&self) -> Result<(), String>;
}

/// The supervised actor of a [`HandOff`] hub.
pub struct HandOffActor<H>(PhantomData<fn() -> H>);

impl<H> Default for HandOffActor<H> {
    fn default() -> Self {
        HandOffActor(PhantomData)
    }
}

/// The actor's state: dropping it (the actor stopped, or was killed) halts the hub.
pub struct HandOffState<H: HandOff> {
    hub: Arc<H>,
}

impl<H: HandOff> Drop for HandOffState<H> {
    fn drop(&mut self) {
        self.hub.halt();
    }
}

impl<H: HandOff> Actor for HandOffActor<H> {
    type Msg = ();
    type State = HandOffState<H>;
    type Arguments = Arc<H>;

    async fn pre_start(
        &self,
        _myself: ActorRef<()>,
        hub: Arc<H>,
    ) -> Result<HandOffState<H>, ActorProcessingErr> {
        let first = hub.actor_starts().fetch_add(1, Ordering::SeqCst) == 0;
        if !first {
            let h = hub.clone();
            tokio::task::spawn_blocking(move || h.replace()).await??;
            tracing::warn!(what = H::WHAT, "restarted; what it carried fails");
        }
        Ok(HandOffState { hub })
    }
}
