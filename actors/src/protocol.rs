//! Messages between the router and the workers, and the state of a request.
//!
//! ```text
//!   router                                   worker (colocated scheduler)
//!     │── worker.generate {request, prompt} ──►│  (request; answered Accepted or a failure)
//!     │◄──────── router.events [TokenItem] ────│  (one-way, batched per engine step)
//!     │── worker.cancel {request} ────────────►│  (client gone: pages freed)
//!     │◄──────── router.load {LoadReport} ─────│  (one-way, every load interval)
//! ```
//!
//! A request ends with exactly one item carrying `finish` or `error`. A worker that restarts
//! reports a new incarnation; the router fails what the old one held (and retries a request
//! that had produced no token on another worker).

use duet_engine::{FinishReason, SamplingParams};
use serde::{Deserialize, Serialize};

/// Service name of the worker on prefill and decode nodes.
pub const WORKER_SERVICE: &str = "worker";
/// Service name of the router on router nodes.
pub const ROUTER_SERVICE: &str = "router";

/// Envelope kinds.
pub mod kinds {
    /// Router → worker request: [`super::Generate`].
    pub const GENERATE: &str = "worker.generate";
    /// Router → worker one-way: [`super::Cancel`].
    pub const CANCEL: &str = "worker.cancel";
    /// Worker → router one-way: [`super::TokenBatch`].
    pub const EVENTS: &str = "router.events";
    /// Worker → router one-way: [`super::LoadReport`].
    pub const LOAD: &str = "router.load";
}

/// Start generating for a request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Generate {
    /// The router's id for the request.
    pub request: u64,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Sampling and stopping.
    pub params: SamplingParams,
}

/// The worker took the request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Accepted {
    /// The worker's incarnation (changes when its actor restarts).
    pub incarnation: u64,
}

/// Stop a request; its pages are freed.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cancel {
    /// The router's id for the request.
    pub request: u64,
}

/// One step's output for one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenItem {
    /// The router's id for the request.
    pub request: u64,
    /// The token, if one was produced.
    pub token: Option<u32>,
    /// Its log-probability.
    pub logprob: f32,
    /// Text that is now final.
    pub text: String,
    /// Set on the last item of a finished request.
    pub finish: Option<FinishReason>,
    /// Set when the request failed; names the phase and the cause.
    pub error: Option<String>,
    /// Prompt tokens served from the prefix cache (first item only).
    pub cached_tokens: usize,
}

impl TokenItem {
    /// A failure item.
    pub fn failed(request: u64, error: String) -> TokenItem {
        TokenItem {
            request,
            token: None,
            logprob: 0.0,
            text: String::new(),
            finish: None,
            error: Some(error),
            cached_tokens: 0,
        }
    }
}

/// Items of one engine step, for one router.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TokenBatch {
    /// The worker's node.
    pub worker: String,
    /// Its incarnation.
    pub incarnation: u64,
    /// The items.
    pub items: Vec<TokenItem>,
}

/// A worker's load, for routing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadReport {
    /// The worker's node.
    pub worker: String,
    /// Its incarnation.
    pub incarnation: u64,
    /// Prompt tokens queued and not yet computed.
    pub queued_tokens: usize,
    /// Sequences waiting and running.
    pub waiting: usize,
    /// Sequences running.
    pub running: usize,
    /// Free KV pages.
    pub free_pages: usize,
    /// All KV pages.
    pub total_pages: usize,
    /// Pages with a pin (transfers in flight).
    pub pinned_pages: usize,
    /// Pages held only by the prefix cache (reclaimable at once).
    pub cached_pages: usize,
}
