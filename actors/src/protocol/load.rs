//! What a worker tells the router about itself, for routing: which half of the pair it is,
//! its KV layout, its queues and its pages (`router.load`, every `load_interval_ms`).

use serde::{Deserialize, Serialize};

use super::LayoutInfo;

/// Which half of the pair a worker is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerKind {
    /// Computes prompts, streams KV.
    Prefill,
    /// Decodes (and prefills short or cached prompts itself).
    Decode,
}

impl WorkerKind {
    /// `prefill` or `decode` (metric labels).
    pub fn name(self) -> &'static str {
        match self {
            WorkerKind::Prefill => "prefill",
            WorkerKind::Decode => "decode",
        }
    }
}

/// A worker's load, for routing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadReport {
    /// The worker's node.
    pub worker: String,
    /// Prefill or decode.
    pub kind: WorkerKind,
    /// Its KV layout (the router pairs only equal ones).
    pub layout: LayoutInfo,
    /// Requests in P's bootstrap queue (waiting for D's pages).
    pub bootstrap_queue: usize,
    /// Its incarnation.
    pub incarnation: u64,
    /// Prompt tokens queued and not yet computed.
    pub queued_tokens: usize,
    /// Sequences waiting and running.
    pub waiting: usize,
    /// Sequences running.
    pub running: usize,
    /// Requests the worker holds in any state (what a graceful drain waits for).
    #[serde(default)]
    pub in_flight: usize,
    /// The node is draining: route nothing new to it.
    #[serde(default)]
    pub draining: bool,
    /// Free KV pages.
    pub free_pages: usize,
    /// All KV pages.
    pub total_pages: usize,
    /// Pages with a pin (transfers in flight).
    pub pinned_pages: usize,
    /// Pages held only by the prefix cache (reclaimable at once).
    pub cached_pages: usize,
    /// Pages of aborted transfers not yet proven drained.
    pub quarantined_pages: usize,
}

impl LoadReport {
    /// An idle worker's report.
    pub fn idle(
        worker: String,
        kind: WorkerKind,
        layout: LayoutInfo,
        incarnation: u64,
        total_pages: usize,
    ) -> LoadReport {
        LoadReport {
            worker,
            kind,
            layout,
            bootstrap_queue: 0,
            incarnation,
            queued_tokens: 0,
            waiting: 0,
            running: 0,
            free_pages: total_pages,
            total_pages,
            pinned_pages: 0,
            cached_pages: 0,
            quarantined_pages: 0,
            in_flight: 0,
            draining: false,
        }
    }
}
