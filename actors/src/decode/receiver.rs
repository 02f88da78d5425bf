//! Decode's KV receiver as a supervised actor (`NODE/decode/receiver`, kind `kv_receiver`).
//!
//! The TCP receiver (the listener, and one thread per prefill connection landing frames in
//! the pool) belongs to the [`ReceiverHub`], which the decode worker and this actor share, as
//! prefill's worker and KV sender share theirs. The worker installs a receiver for its pool
//! when it starts. Killing this actor halts the receiver: its connections shut down at once,
//! so prefill's writes on them fail. The successor stops it for good (joins every connection
//! thread: from then on nothing it accepted can land), starts a new one on a new port with a
//! new secret, and tells the worker, which advertises the new endpoint in later notices and
//! fails the transfers the old receiver carried, freeing their pages at once (the endpoint
//! that could write them is destroyed) and telling prefill to stop them.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex, MutexGuard};

use duet_gpu::PoolMemory;
use duet_runtime::metrics as m;
use duet_transport::{FrameEvent, FrameObserver, Grants, TcpReceiver};

use super::Cmd;
use crate::handoff::HandOff;
use crate::history;

/// What a receiver is built from (set by each decode worker incarnation).
#[derive(Clone)]
pub(super) struct ReceiverParts {
    /// Where to listen (this node's host, any port).
    pub bind: SocketAddr,
    pub memory: PoolMemory,
    pub grants: Grants,
    /// The worker's engine thread, told when a restart replaced the receiver.
    pub cmds: std_mpsc::Sender<Cmd>,
    /// The worker incarnation (its pool), for the transfer history.
    pub worker: u64,
    pub node: String,
    /// The pool's bytes per page (the history names the pages a frame lands in).
    pub page_bytes: usize,
}

/// Counts landed bytes, and records where each frame lands in the transfer history: decode's
/// receiver is the only way TCP bytes reach the pool, so its records are what the checker
/// holds TCP writes to.
fn observe_frames(p: &ReceiverParts) -> FrameObserver {
    let (node, worker, page_bytes) = (p.node.clone(), p.worker, p.page_bytes.max(1));
    Arc::new(move |event| {
        let (name, attempt, offset, len) = match event {
            FrameEvent::Landing {
                attempt,
                offset,
                len,
            } => ("land_begin", attempt, offset, len),
            FrameEvent::Landed {
                attempt,
                offset,
                len,
                ok,
            } => {
                if ok {
                    metrics::counter!(m::KV_BYTES_RECEIVED).increment(u64::from(len));
                }
                ("land_end", attempt, offset, len)
            }
            FrameEvent::Dropped {
                attempt,
                offset,
                len,
            } => {
                // Nothing of it lands, so the transfer history has nothing to check.
                metrics::counter!(m::KV_FRAMES_DROPPED).increment(1);
                tracing::debug!(attempt, offset, len, "dropped a frame of a revoked attempt");
                return;
            }
        };
        if history::enabled() {
            let first = offset / page_bytes as u64;
            let last = (offset + u64::from(len).max(1) - 1) / page_bytes as u64;
            let pages: Vec<u32> = (first..=last).map(|p| p as u32).collect();
            let pages = if name == "land_begin" {
                pages
            } else {
                Vec::new()
            };
            history::record_with(
                name,
                &node,
                worker,
                attempt,
                &pages,
                serde_json::json!({ "offset": offset }),
            );
        }
    })
}

/// The hand-off between a decode worker and its KV receiver actor.
#[derive(Default)]
pub struct ReceiverHub {
    inner: Mutex<HubInner>,
    /// Receiver actor starts so far (the first finds the worker's receiver running).
    actor_starts: AtomicU64,
}

#[derive(Default)]
struct HubInner {
    parts: Option<ReceiverParts>,
    receiver: Option<TcpReceiver>,
}

/// The address and secret prefill connects with.
pub(super) type TcpEndpoint = (SocketAddr, u64);

impl ReceiverHub {
    fn lock(&self) -> MutexGuard<'_, HubInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A worker incarnation starts: stops any earlier receiver (joined) and starts one for
    /// its pool. `None` when the host gives no TCP listener (prefill can then write by shm or
    /// in process only). Blocking.
    pub(super) fn install(&self, parts: ReceiverParts) -> Option<TcpEndpoint> {
        let mut inner = self.lock();
        if let Some(old) = inner.receiver.take() {
            old.stop();
        }
        inner.parts = Some(parts);
        Self::start(&mut inner)
    }

    /// Worker incarnation `worker` is gone: its receiver halts (connections shut down; the
    /// next install or restart joins them) and nothing is built from its parts again.
    pub(super) fn retire(&self, worker: u64) {
        let mut inner = self.lock();
        if inner.parts.as_ref().is_some_and(|p| p.worker == worker) {
            inner.parts = None;
        }
        if let Some(r) = inner.receiver.as_ref() {
            r.halt();
        }
    }

    /// The receiver actor restarted: stop the old receiver for good, start a new one, and
    /// tell the worker which attempts the old one carried. Blocking.
    fn replace_receiver(&self) {
        let mut inner = self.lock();
        let old = inner.receiver.take();
        let Some(parts) = inner.parts.clone() else {
            if let Some(old) = old {
                old.stop();
            }
            return; // no worker now: its next incarnation installs one
        };
        // The new one listens before the old one closes, so their addresses differ: a write
        // meant for the old one can never reach the new one (nor could it pass its secret).
        // Nobody knows the new endpoint yet, so every attempt with TCP bytes is the old one's.
        let tcp = Self::start(&mut inner);
        if let Some(old) = old {
            let (addr, _) = old.endpoint();
            old.stop();
            // Every connection thread is joined: no frame of these attempts can land any more.
            let carried = parts.grants.tcp_attempts();
            history::record_with(
                "receiver_stopped",
                &parts.node,
                parts.worker,
                0,
                &[],
                serde_json::json!({ "via": addr.to_string(), "carried": carried }),
            );
            let _ = parts.cmds.send(Cmd::ReceiverRestarted { tcp, carried });
        } else {
            let _ = parts.cmds.send(Cmd::ReceiverRestarted {
                tcp,
                carried: Vec::new(),
            });
        }
    }

    fn start(inner: &mut HubInner) -> Option<TcpEndpoint> {
        let p = inner.parts.as_ref()?;
        match TcpReceiver::start(
            p.bind,
            p.memory.clone(),
            p.grants.clone(),
            observe_frames(p),
        ) {
            Ok(r) => {
                let endpoint = r.endpoint();
                inner.receiver = Some(r);
                Some(endpoint)
            }
            Err(e) => {
                tracing::warn!(error = %e, "no TCP receiver: prefill can write only by shm");
                None
            }
        }
    }
}

/// The KV receiver as a supervised actor (`NODE/decode/receiver`): stopping it halts the
/// receiver; its successor replaces it and has the worker fail the transfers the old one
/// carried.
impl HandOff for ReceiverHub {
    const WHAT: &'static str = "KV receiver";

    fn actor_starts(&self) -> &AtomicU64 {
        &self.actor_starts
    }

    fn halt(&self) {
        if let Some(r) = self.lock().receiver.as_ref() {
            r.halt();
        }
    }

    fn replace(&self) -> Result<(), String> {
        self.replace_receiver();
        Ok(())
    }
}
