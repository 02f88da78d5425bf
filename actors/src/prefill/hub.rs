//! The hand-off between a prefill worker and its KV senders: one sender thread (a lane) per
//! decode node, started by the first job for that node, all stopped and joined together when
//! the sender actor restarts. See `sender.rs` for what a lane does and why there is one per
//! decode node.

use std::collections::HashMap;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use duet_gpu::PoolMemory;

use super::Cmd;
use super::sender::{Job, KvSender};
use crate::handoff::HandOff;
use crate::outbox::Outbox;

/// The sending half: runs jobs in order over one transport per decode worker incarnation.
/// What a sender thread is built from (set by each worker incarnation).
#[derive(Clone)]
pub(super) struct SenderParts {
    pub(super) memory: PoolMemory,
    pub(super) layout: duet_gpu::KvLayout,
    pub(super) outbox: Outbox,
    pub(super) done: std_mpsc::Sender<Cmd>,
    pub(super) checksum: bool,
    /// The worker incarnation.
    pub(super) id: u64,
    pub(super) node: String,
}

/// The hand-off between a prefill worker and its KV sender actor (`NODE/prefill/sender`, a
/// sibling under the prefill supervisor, so `duet kill` reaches it). The worker sets what a
/// sender thread needs and starts one; a restarted sender actor replaces the thread. A
/// replacement stops and joins the old thread first (once joined, nothing of it can write),
/// under one lock so two replacements never overlap. Jobs carry the worker incarnation that
/// queued them and are delivered only to a thread built for that incarnation: a dying worker's
/// core can never have a successor's thread write for it. After a sender restart the worker
/// aborts every flight, each draining through the new thread.
#[derive(Default)]
pub struct SenderHub {
    pub(super) inner: Mutex<HubInner>,
    /// Sender actor starts so far (the first one finds the worker's thread running).
    pub(super) actor_starts: std::sync::atomic::AtomicU64,
}

#[derive(Default)]
pub(super) struct HubInner {
    pub(super) parts: Option<SenderParts>,
    /// Whether lanes may be started (false once halted or retired, until the next replace).
    pub(super) open: bool,
    /// One sender thread per decode node, started by its first job.
    pub(super) lanes: HashMap<String, Lane>,
}

/// One decode node's sender thread: its queue, its stop flag, its handle.
pub(super) struct Lane {
    jobs: Option<std_mpsc::Sender<Job>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    handle: std::thread::JoinHandle<()>,
}

impl HubInner {
    /// Stops every lane after its current job (not waited for) and takes no job until the
    /// next replace.
    fn close(&mut self) {
        self.open = false;
        for lane in self.lanes.values_mut() {
            lane.jobs = None;
            lane.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// A lane to decode node `node`, started from `p` if there is none running.
    fn lane(&mut self, node: &str) -> std::io::Result<&mut Lane> {
        let Some(p) = self.parts.clone() else {
            return Err(std::io::Error::other("no sender parts"));
        };
        let alive = self.lanes.get(node).is_some_and(|l| l.jobs.is_some());
        if !alive {
            if let Some(old) = self.lanes.remove(node) {
                // A closed lane of an earlier incarnation: it stopped or is stopping.
                old.stop.store(true, std::sync::atomic::Ordering::SeqCst);
                let _ = old.handle.join();
            }
            let lane = start_lane(p, node)?;
            self.lanes.insert(node.to_string(), lane);
        }
        self.lanes
            .get_mut(node)
            .ok_or_else(|| std::io::Error::other("lane vanished"))
    }
}

/// Starts the sender thread of one decode node's lane.
fn start_lane(p: SenderParts, decode: &str) -> std::io::Result<Lane> {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (tx, rx) = std_mpsc::channel();
    let env = |k: &str| std::env::var(k).ok();
    let sender = KvSender {
        memory: p.memory,
        layout: p.layout,
        outbox: p.outbox,
        done: p.done,
        stop: stop.clone(),
        links: HashMap::new(),
        progress: HashMap::new(),
        layer_spans: HashMap::new(),
        checksum: p.checksum,
        corrupt: env("DUET_FAULT_CORRUPT_KV")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
        fail_rate: env("DUET_FAULT_TRANSFER_FAIL_RATE")
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|p| (0.0..=1.0).contains(p))
            .unwrap_or(0.0),
        id: p.id,
        stall_once: env("DUET_FAULT_STALL_TRANSFER_MS")
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis),
        stall_mid_write: env("DUET_FAULT_STALL_MID_WRITE_MS")
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis),
    };
    let handle = std::thread::Builder::new()
        .name(format!("duet-kv-{}-{decode}", p.node))
        .spawn(move || sender.run(rx))?;
    Ok(Lane {
        jobs: Some(tx),
        stop,
        handle,
    })
}

impl SenderHub {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, HubInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a job of worker incarnation `worker` on its decode node's lane (starting the
    /// lane if needed); false when no sender of that incarnation runs (its flights are
    /// aborted when the next one starts).
    pub(super) fn send(&self, worker: u64, job: Job) -> bool {
        let mut inner = self.lock();
        if !inner.open || inner.parts.as_ref().is_none_or(|p| p.id != worker) {
            return false;
        }
        let node = job.target().node.clone();
        match inner.lane(&node) {
            Ok(lane) => lane.jobs.as_ref().is_some_and(|tx| tx.send(job).is_ok()),
            Err(e) => {
                tracing::error!(decode = %node, error = %e, "cannot start a KV sender lane");
                false
            }
        }
    }

    /// Worker incarnation `worker` is gone: its lanes stop after their current job (not
    /// waited for; the next replacement joins them) and nothing is built from its parts again.
    pub(super) fn retire(&self, worker: u64) {
        let mut inner = self.lock();
        if inner.parts.as_ref().is_some_and(|p| p.id == worker) {
            inner.parts = None;
        }
        inner.close();
    }

    /// Stops and joins every lane, then takes jobs again from `parts` (or from the current
    /// parts when `None`); lanes start with their first job. Blocking.
    pub(super) fn replace_thread(&self, parts: Option<SenderParts>) -> std::io::Result<()> {
        let mut inner = self.lock();
        inner.close();
        for (_, lane) in inner.lanes.drain() {
            let _ = lane.handle.join();
        }
        if parts.is_some() {
            inner.parts = parts;
        }
        inner.open = inner.parts.is_some();
        Ok(())
    }
}

/// The KV sender as a supervised actor (`NODE/prefill/sender`): killing it stops the sender
/// thread after its current write; its successor starts a new one and has the worker fail the
/// rooms the old one held (their pages stay pinned until they drain through the new thread).
impl HandOff for SenderHub {
    const WHAT: &'static str = "KV sender";

    fn actor_starts(&self) -> &std::sync::atomic::AtomicU64 {
        &self.actor_starts
    }

    fn halt(&self) {
        self.lock().close();
    }

    fn replace(&self) -> Result<(), String> {
        self.replace_thread(None).map_err(|e| e.to_string())?;
        if let Some(p) = self.lock().parts.as_ref() {
            let _ = p.done.send(Cmd::SenderRestarted);
        }
        Ok(())
    }
}
