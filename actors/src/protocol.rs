//! Every message between the router, prefill (P) and decode (D), and the states a request
//! goes through. All of them ride the runtime's links; bulk KV never does (it goes through a
//! `duet_transport` backend).
//!
//! ```text
//!   router                       D (decode worker)                 P (bootstrap + prefill worker)
//!     │── worker.generate ─────────►│ {request, prompt, prefill: P, room}
//!     │── bootstrap.prefill ────────┼──────────────────────────────►│ bootstrap queue
//!     │                             │── bootstrap.hello ───────────►│ (first contact: layouts
//!     │                             │◄─────────────── LayoutHello ──│  checked both ways)
//!     │                   prealloc  │  reserve every page or wait   │
//!     │                             │── bootstrap.prealloc ────────►│ PreallocNotice{room,
//!     │                             │                               │  attempt, pages, prefix}
//!     │                             │                               │ waiting ─► in flight:
//!     │                   transfer  │◄══ KV pages (shm/tcp/local) ══│ each chunk's full pages
//!     │                             │◄────────────── decode.chunk ──│ ChunkWritten
//!     │                             │◄══ last pages ════════════════│ fence
//!     │                             │◄─────────────── decode.done ──│ TransferDone{first token,
//!     │                   running   │ ledger: complete ─► publish   │  logprob, sampler state}
//!     │◄── router.events ───────────│ tokens                         │
//!
//!   abort (client gone, deadline, P unreachable or restarted, failure), from D:
//!     D: ledger abort (pins kept) ── bootstrap.abort ──► P: drop, or stop writing + fence
//!     D: revoke the attempt's grant: proven (no writer holds it) ─► ledger drained, pins drop
//!                                    busy (a run is being copied) ─► quarantined, asked again
//!     D ◄── decode.abort_ack ── P: a hint to ask again (the revoke is the proof)
//!   still unproven after the drain fence interval: D ── bootstrap.drain_fence ──► P (again);
//!   past the backstop: an error naming P, the pages stay quarantined (never freed on a clock)
//!   P fails a request it cannot prefill: ── decode.failed ──► D (after its writes drained)
//!   P ── decode.heartbeat {incarnation} ──► D, every load interval: a new incarnation ends
//!   the transfers D noticed to the old one (each released once its revoke is proven).
//! ```
//!
//! What D controls is what makes a revoke a proof, whatever P does meanwhile (paused, slow,
//! dead): a TCP frame lands only through D's receiver, which checks the grant first; a write
//! into D's shared-memory pool happens only under a claim of the attempt's slot in D's claim
//! table (`duet_transport::claims`), which D revokes. No deadline ever frees a page.
//!
//! Queues: P's bootstrap → waiting → in flight; D's prealloc → transfer → running. A request
//! ends with exactly one item carrying `finish` or `error`, the error naming the phase. A
//! worker that restarts reports a new incarnation; the router fails what the old one held
//! (and retries a request that had produced no token on another worker).

use duet_engine::sampling::{SamplerState, TopLogprobs};
use duet_engine::scheduler::{Resume, SeqEvent};
use duet_engine::{FinishReason, SamplingParams};
use duet_gpu::{KvLayout, PageId};
use duet_transport::{Backend, Endpoint, WriteGrant};
use serde::{Deserialize, Serialize};

pub use crate::error::{ErrorCode, ServingError};

mod load;
pub use load::{LoadReport, WorkerKind};

/// Service name of the worker on decode nodes.
pub const WORKER_SERVICE: &str = "worker";
/// Service name of the bootstrap actor on prefill nodes.
pub const BOOTSTRAP_SERVICE: &str = "bootstrap";
/// Service name of the prefill worker on prefill nodes (local messages from bootstrap).
pub const PREFILL_SERVICE: &str = "prefill";
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
    /// Router → P's bootstrap request: [`super::PrefillRequest`].
    pub const PREFILL: &str = "bootstrap.prefill";
    /// D → P's bootstrap request: [`super::LayoutHello`], answered with P's.
    pub const HELLO: &str = "bootstrap.hello";
    /// D → P's bootstrap one-way: [`super::PreallocNotice`].
    pub const PREALLOC: &str = "bootstrap.prealloc";
    /// D → P's bootstrap one-way: [`super::Abort`].
    pub const ABORT: &str = "bootstrap.abort";
    /// D → P's bootstrap one-way, for an abort whose acknowledgement is overdue: prove that
    /// every write of the attempt drained ([`super::Abort`] body; answered by `AbortAck`).
    pub const DRAIN_FENCE: &str = "bootstrap.drain_fence";
    /// Bootstrap → the prefill worker (same node): [`super::PrefillStart`].
    pub const START: &str = "prefill.start";
    /// Bootstrap → the prefill worker (same node): [`super::Abort`].
    pub const STOP: &str = "prefill.abort";
    /// P → D one-way: [`super::ChunkWritten`].
    pub const CHUNK: &str = "decode.chunk";
    /// P → D one-way: [`super::TransferDone`].
    pub const DONE: &str = "decode.done";
    /// P → D one-way: [`super::TransferFailed`].
    pub const FAILED: &str = "decode.failed";
    /// P → D one-way: [`super::AbortAck`].
    pub const ABORT_ACK: &str = "decode.abort_ack";
    /// P → D one-way: [`super::Heartbeat`].
    pub const HEARTBEAT: &str = "decode.heartbeat";
}

/// Where D's prompt KV comes from, when the router disaggregates.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillPeer {
    /// P's node.
    pub node: String,
    /// The transfer's room (random 63-bit).
    pub room: u64,
}

/// Router → P: prefill a prompt for D.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrefillRequest {
    /// The room D will name in its notice.
    pub room: u64,
    /// D's node.
    pub decode: String,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Sampling (P samples the first token).
    pub params: SamplingParams,
    /// A migrated stream: the end of `prompt` was generated before.
    #[serde(default)]
    pub resume: Resume,
}

/// What a worker's KV looks like; two workers exchange pages only if these are equal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutInfo {
    /// Pool layout: layers, KV heads, head dim, page size, dtype.
    pub layout: KvLayout,
    /// Hash of the GGUF's metadata and tensor table.
    pub fingerprint: String,
    /// The engine's [`duet_engine::KV_FORMAT`]: the version of the bits a page holds.
    #[serde(default)]
    pub kv_format: u32,
}

impl LayoutInfo {
    /// Why two layouts cannot exchange pages, naming both values; `None` if they can.
    pub fn mismatch(&self, other: &LayoutInfo, mine: &str, theirs: &str) -> Option<String> {
        let (a, b) = (&self.layout, &other.layout);
        let diff = |what: &str, x: String, y: String| {
            Some(format!(
                "incompatible KV layouts: {what} is {x} on {mine} but {y} on {theirs}"
            ))
        };
        if a.page_size != b.page_size {
            return diff(
                "page_size",
                a.page_size.to_string(),
                b.page_size.to_string(),
            );
        }
        if a.dtype != b.dtype {
            return diff("kv_dtype", a.dtype.to_string(), b.dtype.to_string());
        }
        if self.kv_format != other.kv_format {
            return diff(
                "the engine's KV format",
                self.kv_format.to_string(),
                other.kv_format.to_string(),
            );
        }
        if self.fingerprint != other.fingerprint {
            return diff(
                "the model fingerprint",
                self.fingerprint.clone(),
                other.fingerprint.clone(),
            );
        }
        if a.n_layers != b.n_layers {
            return diff("layers", a.n_layers.to_string(), b.n_layers.to_string());
        }
        if a.n_kv_heads != b.n_kv_heads {
            return diff(
                "kv heads",
                a.n_kv_heads.to_string(),
                b.n_kv_heads.to_string(),
            );
        }
        if a.head_dim != b.head_dim {
            return diff("head_dim", a.head_dim.to_string(), b.head_dim.to_string());
        }
        None
    }
}

/// D → P on first contact, and P's answer: both layouts, each side checks.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LayoutHello {
    /// The sender's node.
    pub node: String,
    /// Its worker's incarnation.
    pub incarnation: u64,
    /// Its KV layout.
    pub layout: LayoutInfo,
}

/// D → P: pages are reserved; write the prompt's KV from `decode_prefix_len` on into them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreallocNotice {
    /// The room.
    pub room: u64,
    /// D's attempt key (fences every later message about this transfer).
    pub attempt: u64,
    /// D's pages for positions `decode_prefix_len..`, in order.
    pub pages: Vec<PageId>,
    /// Prompt tokens D already holds (whole pages of its prefix cache); P sends the rest.
    pub decode_prefix_len: usize,
    /// D's worker incarnation.
    pub incarnation: u64,
    /// Where D's pool can be written.
    pub endpoint: Endpoint,
    /// The slot of D's claim table a writer that maps the pool (`shm`, `local`) claims for
    /// each run: D revokes it to stop every write of this attempt (`None`: TCP only).
    #[serde(default)]
    pub claim_slot: Option<u32>,
    /// The prefill worker incarnation D last heard from (its heartbeat). A worker of another
    /// incarnation refuses the notice: D closes the transfers it noticed to an earlier
    /// incarnation as soon as it hears of the restart, so a later one must never write them.
    #[serde(default)]
    pub prefill_incarnation: Option<u64>,
}

impl PreallocNotice {
    /// What every write of this attempt carries.
    pub fn grant(&self) -> WriteGrant {
        WriteGrant {
            attempt: self.attempt,
            slot: self.claim_slot,
        }
    }
}

/// Bootstrap → prefill worker: a request with its notice, ready to compute.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrefillStart {
    /// The router's request.
    pub request: PrefillRequest,
    /// D's notice.
    pub notice: PreallocNotice,
    /// The backend to use.
    pub backend: Backend,
    /// The router's span (W3C trace context), for the prefill spans.
    pub trace: duet_runtime::telemetry::TraceHeaders,
}

/// Stop a transfer. From D to P; `attempt` is `None` when D never sent a notice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Abort {
    /// The room.
    pub room: u64,
    /// D's attempt.
    pub attempt: Option<u64>,
}

/// P → D: no write of this attempt can land any more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbortAck {
    /// The room.
    pub room: u64,
    /// D's attempt.
    pub attempt: u64,
}

/// P → D: a chunk's pages were written (progress, for metrics and traces).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkWritten {
    /// The room.
    pub room: u64,
    /// D's attempt.
    pub attempt: u64,
    /// Pages written so far.
    pub pages: usize,
    /// Bytes written so far.
    pub bytes: u64,
}

/// P → D: every page is written and fenced; here is the first token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransferDone {
    /// The room.
    pub room: u64,
    /// D's attempt.
    pub attempt: u64,
    /// The first sampled token.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The sampler's stream after the first token.
    pub sampler: SamplerState,
    /// Bytes written.
    pub bytes: u64,
    /// Prompt tokens P took from its own prefix cache.
    pub prefill_cached: usize,
    /// CRC-32 of every run written, over D's pages in the order listed (empty when
    /// `kv_checksum` is off): D checks them before it publishes.
    pub checksums: Vec<RunChecksum>,
    /// The first token's likeliest alternatives (`top_logprobs`). Last, and left out when
    /// empty, so a request without them reads the same to a build before them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub top: TopLogprobs,
}

/// The checksum of the pages one write covered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunChecksum {
    /// D's pages, in the order hashed.
    pub pages: Vec<PageId>,
    /// CRC-32 of their bytes.
    pub crc: u32,
}

/// Why an attempt failed, as the router's retry budget sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum FailureClass {
    /// The attempt failed (a deadline, a worker that died holding it, bad KV): a retry
    /// spends one of the request's `serving.retries`.
    #[default]
    Attempt,
    /// Serving machinery restarted under it (a KV sender or receiver, a service between two
    /// actor incarnations): never the request's doing, so a retry is free (after a short
    /// pause, a bounded number of times).
    Restart,
    /// The attempt made no progress for its deadline (`transfer_timeout_secs`): its prefill
    /// worker computed nothing and wrote no KV for it. The same pair would likely stall
    /// again, so a retry (which spends one of `serving.retries`) avoids that prefill worker.
    Stalled,
    /// The router's own actor restarted under the attempt (its successor takes the request
    /// over): a retry is free and immediate. Never sent by a worker.
    RouterRestart,
    /// No retry can help (the request's own deadline passed): the request fails with this
    /// error.
    Fatal,
}

/// P → D: the prefill failed (its writes, if any, have drained).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferFailed {
    /// The room.
    pub room: u64,
    /// D's attempt.
    pub attempt: Option<u64>,
    /// Names the phase and the cause (for people).
    pub error: String,
    /// What kind of failure it is (decode passes it on to the router).
    #[serde(default)]
    pub class: FailureClass,
    /// Which failure it is.
    #[serde(default)]
    pub code: ErrorCode,
}

impl TransferFailed {
    /// Prefill's report of `error` for `room` (and decode's `attempt`, when it had one).
    pub fn new(room: u64, attempt: Option<u64>, error: &ServingError) -> TransferFailed {
        TransferFailed {
            room,
            attempt,
            error: error.to_string(),
            class: error.class(),
            code: error.code(),
        }
    }

    /// The failure as decode passes it on.
    pub fn to_error(&self) -> ServingError {
        ServingError::Remote {
            code: self.code,
            class: self.class,
            message: self.error.clone(),
        }
    }
}

/// P → D, every load interval.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// P's prefill worker incarnation.
    pub incarnation: u64,
    /// The attempts (D's keys) P holds for this D: queued, computing or being written.
    #[serde(default)]
    pub holding: Vec<u64>,
    /// P's engine steps so far. D counts an attempt P holds as progressing while this grows
    /// (a prompt waiting behind others in a busy prefill is not stuck; one in a stopped or
    /// wedged prefill is).
    #[serde(default)]
    pub steps: u64,
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
    /// Set when P prefills and D decodes.
    pub prefill: Option<PrefillPeer>,
    /// A migrated stream: the end of `prompt` was generated before (not sent again).
    #[serde(default)]
    pub resume: Resume,
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
    /// With `error`: what the router does about it.
    #[serde(default)]
    pub class: FailureClass,
    /// With `error`: which failure it is.
    #[serde(default)]
    pub code: ErrorCode,
    /// The likeliest tokens at this position, when the request asked for `top_logprobs`.
    /// Last, and left out when empty (a build before them reads the rest as ever).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub top: TopLogprobs,
}

impl TokenItem {
    /// The item of a token the engine sampled for the router's request `request`.
    pub fn sampled(request: u64, ev: SeqEvent) -> TokenItem {
        TokenItem {
            request,
            token: Some(ev.token),
            logprob: ev.logprob,
            text: ev.text,
            finish: ev.finish,
            error: None,
            cached_tokens: ev.cached_tokens,
            class: FailureClass::Attempt,
            code: Default::default(),
            top: ev.top,
        }
    }

    /// The failure item of `error`.
    pub fn failed(request: u64, error: &ServingError) -> TokenItem {
        TokenItem {
            request,
            token: None,
            logprob: 0.0,
            text: String::new(),
            finish: None,
            error: Some(error.to_string()),
            cached_tokens: 0,
            top: Vec::new(),
            class: error.class(),
            code: error.code(),
        }
    }

    /// The failure an item reports, if any.
    pub fn failure(&self) -> Option<ServingError> {
        self.error.as_ref().map(|message| ServingError::Remote {
            code: self.code,
            class: self.class,
            message: message.clone(),
        })
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

#[cfg(test)]
mod tests {
    use duet_gpu::{KvDtype, KvLayout};

    use super::LayoutInfo;

    #[test]
    fn pages_move_only_between_equal_layouts_models_and_kv_formats() {
        let a = LayoutInfo {
            layout: KvLayout {
                n_layers: 30,
                n_kv_heads: 3,
                head_dim: 64,
                page_size: 16,
                dtype: KvDtype::F32,
            },
            fingerprint: "abc".into(),
            kv_format: duet_engine::KV_FORMAT,
        };
        assert_eq!(a.mismatch(&a.clone(), "p0", "d0"), None);
        // A build whose kernels compute other KV bits: named, with both values.
        let later = LayoutInfo {
            kv_format: a.kv_format + 1,
            ..a.clone()
        };
        let why = a.mismatch(&later, "p0", "d0").expect("a mismatch");
        assert!(
            why.contains("KV format") && why.contains("p0") && why.contains("d0"),
            "{why}"
        );
        let other_model = LayoutInfo {
            fingerprint: "def".into(),
            ..a.clone()
        };
        assert!(a.mismatch(&other_model, "p0", "d0").is_some());
    }
}
