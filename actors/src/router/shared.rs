//! What the router's HTTP handlers and its actor share: the workers' load reports, the
//! requests in flight and their token channels, and the routing itself: picking a decode
//! worker (and a prefill worker, for a disaggregated prompt) by load, starting an attempt on
//! them, delivering the workers' token batches, cancelling, and failing the requests a lost
//! worker held.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use duet_engine::SamplingParams;
use duet_engine::chat::ChatTemplate;
use duet_engine::scheduler::Resume;
use duet_engine::tokenizer::Tokenizer;
use duet_runtime::context::NodeContext;
use duet_runtime::link::LinkError;
use duet_runtime::wire;
use rand::Rng;
use tokio::sync::mpsc;

use super::affinity::{self, Candidate, PrefixIndex, PromptBlocks};
use crate::protocol::{
    Abort, Accepted, BOOTSTRAP_SERVICE, Cancel, Generate, LoadReport, PrefillPeer, PrefillRequest,
    ROUTER_SERVICE, ServingError, TokenBatch, TokenItem, WORKER_SERVICE, WorkerKind, kinds,
};
use crate::settings::{Routing, ServingConfig};

/// A load report older than this no longer counts: the worker is not routed to.
const LOAD_STALE: Duration = Duration::from_secs(3);

/// What the router's handlers and actor share.
pub struct RouterShared {
    pub(super) ctx: Arc<NodeContext>,
    pub(super) settings: ServingConfig,
    pub(super) tokenizer: Tokenizer,
    pub(super) chat: Option<ChatTemplate>,
    pub(super) max_context: usize,
    pub(super) workers: Mutex<HashMap<String, (LoadReport, Instant)>>,
    pub(super) pending: Mutex<HashMap<u64, Pending>>,
    pub(super) next_id: AtomicU64,
    /// Requests being answered (what a graceful drain waits for).
    pub(super) open: std::sync::atomic::AtomicUsize,
    /// When the served model was made (its file's modification time, else the router's
    /// start), as Unix seconds: `/v1/models` `created`.
    pub(super) created: u64,
    /// The router's estimate of each worker's prefix cache (cache-aware routing).
    pub(super) prefixes: Mutex<PrefixIndex>,
}

pub(super) struct Pending {
    pub(super) tx: mpsc::UnboundedSender<TokenItem>,
    pub(super) worker: String,
    pub(super) incarnation: Option<u64>,
}

/// A worker's queued work in prompt tokens: what it still has to compute, and a prefill
/// chunk's worth for each sequence waiting for a slot or for pages.
fn load_tokens(r: &LoadReport) -> usize {
    r.queued_tokens + 16 * (r.waiting + r.bootstrap_queue)
}

impl RouterShared {
    pub(super) fn lock_workers(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, (LoadReport, Instant)>> {
        self.workers.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn lock_pending(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Pending>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Workers that can take traffic: up in membership, with a fresh load report.
    pub fn ready_workers(&self) -> Vec<LoadReport> {
        let now = Instant::now();
        self.lock_workers()
            .values()
            .filter(|(r, seen)| {
                now.duration_since(*seen) < LOAD_STALE
                    && !r.draining
                    && self.ctx.membership.is_up(&r.worker)
            })
            .map(|(r, _)| r.clone())
            .collect()
    }

    /// The longest sequence (prompt plus output) the cluster can hold, and what sets it: the
    /// model's context, or the largest ready decode worker's KV pool when that is smaller (a
    /// sequence that outgrows every pool could never finish).
    pub fn sequence_limit(&self) -> (usize, String) {
        let largest_pool = self
            .ready_workers()
            .into_iter()
            .filter(|r| r.kind == WorkerKind::Decode)
            .map(|r| (r.total_pages * r.layout.layout.page_size, r))
            .max_by_key(|(tokens, _)| *tokens);
        match largest_pool {
            Some((tokens, r)) if tokens < self.max_context => (
                tokens,
                format!(
                    "the largest decode KV pool holds {tokens} tokens ({} pages of {} on {})",
                    r.total_pages, r.layout.layout.page_size, r.worker
                ),
            ),
            _ => (
                self.max_context,
                format!("the context is {} tokens", self.max_context),
            ),
        }
    }

    /// Power of two choices among ready workers that pass `keep`: the less loaded wins.
    pub(super) fn pick(&self, keep: impl Fn(&LoadReport) -> bool) -> Option<LoadReport> {
        let ready: Vec<LoadReport> = self.ready_workers().into_iter().filter(keep).collect();
        match ready.len() {
            0 => None,
            1 => ready.into_iter().next(),
            n => {
                let mut rng = rand::rng();
                let a = rng.random_range(0..n);
                let b = (a + rng.random_range(1..n)) % n;
                let key = |r: &LoadReport| (load_tokens(r), usize::MAX - r.free_pages);
                let best = if key(&ready[a]) <= key(&ready[b]) {
                    a
                } else {
                    b
                };
                ready.into_iter().nth(best)
            }
        }
    }

    /// Chooses where a request runs: a decode worker (not one of `exclude`) and, unless the
    /// prompt is short, mostly cached on that decode worker, or no compatible prefill worker
    /// is ready, a prefill worker for it. With `routing = "cache_aware"` each worker is the
    /// one holding the longest cached prefix of the prompt when load allows
    /// ([`affinity`]); otherwise, and when nobody holds any of it, the less loaded of two.
    /// `forced` names a pair (`PREFILL,DECODE`) for operators and tests; it skips the layout
    /// filter, so decode's own check answers a mismatch.
    pub(super) fn route(
        &self,
        prompt: &[u32],
        exclude: &[String],
        forced: Option<&str>,
        prefer_prefill: Option<&str>,
        avoid_prefill: &[String],
    ) -> Result<(String, Option<String>), RouteError> {
        if let Some(pair) = forced {
            let (p, d) = pair
                .split_once(',')
                .ok_or_else(|| RouteError::NotAPair(pair.to_string()))?;
            return Ok((d.trim().to_string(), Some(p.trim().to_string())));
        }
        let prompt_len = prompt.len();
        let cache_aware = self.settings.routing == Routing::CacheAware;
        let mut blocks = PromptBlocks::new(prompt);
        // A retry avoids the workers already tried, unless they are all there is (a restarted
        // worker is a new incarnation and may well serve it).
        let (decode, cached) = self
            .pick_cached(&mut blocks, cache_aware, |r| {
                r.kind == WorkerKind::Decode && !exclude.contains(&r.worker)
            })
            .or_else(|| self.pick(|r| r.kind == WorkerKind::Decode).map(|r| (r, 0)))
            .ok_or(RouteError::NoDecodeReady)?;
        self.sent(
            &decode,
            prompt_len - cached.min(prompt_len),
            cache_aware.then_some(&mut blocks),
        );
        if prompt_len < self.settings.disagg_threshold {
            metrics::counter!(duet_runtime::metrics::ROUTER_ROUTES, "path" => "decode_only", "reason" => "short_prompt").increment(1);
            return Ok((decode.worker, None));
        }
        // Conditional disaggregation on what decode would have to compute: a prompt mostly
        // cached there is finished there, with no transfer.
        if prompt_len.saturating_sub(cached) < self.settings.disagg_threshold {
            metrics::counter!(duet_runtime::metrics::ROUTER_ROUTES, "path" => "decode_only", "reason" => "cached_prefix").increment(1);
            return Ok((decode.worker, None));
        }
        // A prefill worker whose pool cannot hold the prompt would fail it: not a candidate.
        let compatible = |r: &LoadReport| {
            r.kind == WorkerKind::Prefill
                && r.layout == decode.layout
                && r.total_pages * r.layout.layout.page_size > prompt_len
                && !avoid_prefill.contains(&r.worker)
        };
        // A continuation goes back to the prefill worker that keeps its prompt's KV.
        let prefill = prefer_prefill
            .and_then(|p| {
                self.pick(|r| compatible(r) && r.worker == p)
                    .map(|r| (r, 0))
            })
            .or_else(|| {
                self.pick_cached(&mut blocks, cache_aware, |r| {
                    compatible(r) && !exclude.contains(&r.worker)
                })
            })
            .or_else(|| self.pick(compatible).map(|r| (r, 0)));
        match prefill {
            Some((p, held)) => {
                self.sent(
                    &p,
                    prompt_len - held.min(prompt_len),
                    cache_aware.then_some(&mut blocks),
                );
                metrics::counter!(duet_runtime::metrics::ROUTER_ROUTES, "path" => "disaggregated", "reason" => "paired").increment(1);
                Ok((decode.worker, Some(p.worker)))
            }
            None => {
                metrics::counter!(duet_runtime::metrics::ROUTER_ROUTES, "path" => "decode_only", "reason" => "no_compatible_prefill").increment(1);
                Ok((decode.worker, None))
            }
        }
    }

    /// A request was sent to `worker`, which must compute `tokens` of its prompt (those it does
    /// not hold). That work, and a sequence, counts in the router's copy of the worker's load
    /// until the worker's next report replaces it: a burst of requests arriving between two
    /// reports (every `load_interval_ms`) would otherwise all see the same, stale, load. With
    /// `blocks` (cache-aware routing) the worker will hold the prompt's blocks too.
    fn sent(&self, worker: &LoadReport, tokens: usize, blocks: Option<&mut PromptBlocks<'_>>) {
        if let Some((r, _)) = self.lock_workers().get_mut(&worker.worker) {
            r.queued_tokens += tokens;
            r.waiting += 1;
        }
        if let Some(b) = blocks {
            let hashes = b.of(worker.layout.layout.page_size);
            self.prefixes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .record(
                    &worker.worker,
                    worker.incarnation,
                    hashes,
                    worker.total_pages,
                );
        }
    }

    /// The worker passing `keep` that holds the longest cached prefix of `prompt` when load
    /// allows (with the tokens it holds), else the less loaded of two (holding none, as far
    /// as the router knows, or what it holds).
    fn pick_cached(
        &self,
        blocks: &mut PromptBlocks<'_>,
        cache_aware: bool,
        keep: impl Fn(&LoadReport) -> bool,
    ) -> Option<(LoadReport, usize)> {
        if !cache_aware {
            return self.pick(keep).map(|r| (r, 0));
        }
        let ready: Vec<LoadReport> = self
            .ready_workers()
            .into_iter()
            .filter(|r| keep(r))
            .collect();
        let index = self.prefixes.lock().unwrap_or_else(|p| p.into_inner());
        let candidates: Vec<Candidate> = ready
            .iter()
            .map(|r| {
                let page = r.layout.layout.page_size;
                Candidate {
                    worker: r.worker.clone(),
                    load: load_tokens(r),
                    matched_tokens: index.matched(&r.worker, r.incarnation, blocks.of(page)) * page,
                }
            })
            .collect();
        drop(index);
        match affinity::choose(&candidates, blocks.len()) {
            Some(best) => {
                let tokens = best.matched_tokens;
                let r = ready.into_iter().find(|r| r.worker == best.worker)?;
                metrics::counter!(duet_runtime::metrics::ROUTER_CACHE_ROUTES, "kind" => r.kind.name(), "outcome" => "hit").increment(1);
                Some((r, tokens))
            }
            None => {
                let r = self.pick(keep)?;
                metrics::counter!(duet_runtime::metrics::ROUTER_CACHE_ROUTES, "kind" => r.kind.name(), "outcome" => "miss").increment(1);
                Some((r, 0))
            }
        }
    }

    /// Starts an attempt (on workers not in `placement.exclude` when there are others); its
    /// items arrive on the receiver.
    ///
    /// The start runs to its end even if the caller goes away (a client that disconnects
    /// while its halves are being sent): stopping halfway could leave one half on a worker
    /// that nobody would cancel before its deadline. An attempt started for nobody is
    /// cancelled at once.
    pub(super) async fn start(
        self: &Arc<Self>,
        prompt: Vec<u32>,
        params: SamplingParams,
        resume: Resume,
        placement: Placement,
    ) -> Result<Started, StartError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let shared = self.clone();
        let task = async move {
            let started = shared.start_now(&prompt, &params, resume, &placement).await;
            if let Err(Ok(s)) = tx.send(started) {
                shared.cancel(s.request);
            }
        };
        tokio::spawn(tracing::Instrument::instrument(
            task,
            tracing::Span::current(),
        ));
        rx.await.map_err(|_| StartError {
            unavailable: false,
            message: "router: the attempt's start was lost".to_string(),
        })?
    }

    pub(super) async fn start_now(
        &self,
        prompt: &[u32],
        params: &SamplingParams,
        resume: Resume,
        placement: &Placement,
    ) -> Result<Started, StartError> {
        let (worker, prefill) = self
            .route(
                prompt,
                &placement.exclude,
                placement.forced.as_deref(),
                placement.prefer_prefill.as_deref(),
                &placement.avoid_prefill,
            )
            .map_err(|e| StartError {
                unavailable: e == RouteError::NoDecodeReady,
                message: e.to_string(),
            })?;
        let request = self.next_id.fetch_add(1, Ordering::Relaxed);
        let span = tracing::Span::current();
        span.record("request", request);
        span.record("gen_ai.usage.input_tokens", prompt.len() as i64);
        span.record("decode", worker.as_str());
        span.record(
            "path",
            if prefill.is_some() {
                "disaggregated"
            } else {
                "decode_only"
            },
        );
        if let Some(p) = &prefill {
            span.record("prefill", p.as_str());
        }
        let peer = prefill.map(|node| PrefillPeer {
            node,
            room: rand::rng().random::<u64>() >> 1,
        });
        let (tx, rx) = mpsc::unbounded_channel();
        self.lock_pending().insert(
            request,
            Pending {
                tx,
                worker: worker.clone(),
                incarnation: None,
            },
        );
        let body = wire::encode_body(&Generate {
            request,
            prompt: prompt.to_vec(),
            params: params.clone(),
            prefill: peer.clone(),
            resume,
        });
        let to_decode = self.ask(&worker, kinds::GENERATE, WORKER_SERVICE, body);
        let to_prefill = async {
            match &peer {
                Some(p) => {
                    let body = wire::encode_body(&PrefillRequest {
                        room: p.room,
                        decode: worker.clone(),
                        prompt: prompt.to_vec(),
                        params: params.clone(),
                        resume,
                    });
                    self.ask(&p.node, kinds::PREFILL, BOOTSTRAP_SERVICE, body)
                        .await
                        .map(|_| ())
                        .map_err(|e| {
                            StartError::from_link(e, &format!("prefill worker {}", p.node))
                        })
                }
                None => Ok(()),
            }
        };
        // Both halves at once: decode reserves pages while prefill's bootstrap queues it.
        let (answer, prefilled) = tokio::join!(to_decode, to_prefill);
        if let Err(e) = prefilled {
            // Decode's half is cancelled (it tells prefill); the caller may retry.
            if answer.is_ok() {
                self.lock_pending().remove(&request);
                self.send_cancel(worker.clone(), request);
            }
            self.lock_pending().remove(&request);
            return Err(e);
        }
        let answer = answer.map_err(|e| StartError::from_link(e, &format!("worker {worker}")));
        let accepted = answer.and_then(|b| {
            wire::decode_body::<Accepted>(&b).map_err(|e| StartError {
                unavailable: false,
                message: format!("worker {worker}: a malformed answer: {e}"),
            })
        });
        match accepted {
            Ok(accepted) => {
                if let Some(p) = self.lock_pending().get_mut(&request) {
                    p.incarnation = Some(accepted.incarnation);
                }
                Ok(Started {
                    request,
                    worker,
                    prefill: peer.map(|p| p.node),
                    rx,
                })
            }
            Err(e) => {
                self.lock_pending().remove(&request);
                if let Some(p) = &peer {
                    // Decode will send no notice: prefill's bootstrap drops its half now
                    // rather than at its deadline.
                    let body = wire::encode_body(&Abort {
                        room: p.room,
                        attempt: None,
                    });
                    if let Ok(link) = self.ctx.links.get(&p.node) {
                        let _ = link
                            .send(kinds::ABORT, ROUTER_SERVICE, BOOTSTRAP_SERVICE, body)
                            .await;
                    }
                }
                Err(e)
            }
        }
    }

    pub(super) async fn ask(
        &self,
        node: &str,
        kind: &str,
        service: &str,
        body: Vec<u8>,
    ) -> Result<Vec<u8>, LinkError> {
        self.ctx
            .links
            .get(node)?
            .request(kind, ROUTER_SERVICE, service, body, Duration::from_secs(10))
            .await
    }

    /// Tells the worker to drop a request (client gone) and forgets it here.
    pub(super) fn cancel(self: &Arc<Self>, request: u64) {
        let Some(p) = self.lock_pending().remove(&request) else {
            return;
        };
        self.send_cancel(p.worker, request);
    }

    pub(super) fn send_cancel(&self, worker: String, request: u64) {
        let ctx = self.ctx.clone();
        tokio::spawn(async move {
            if let Ok(link) = ctx.links.get(&worker) {
                let body = wire::encode_body(&Cancel { request });
                let _ = link
                    .send(kinds::CANCEL, ROUTER_SERVICE, WORKER_SERVICE, body)
                    .await;
            }
        });
    }

    pub(super) fn deliver(&self, batch: TokenBatch) {
        let mut pending = self.lock_pending();
        for item in batch.items {
            let done = item.finish.is_some() || item.error.is_some();
            let request = item.request;
            let Some(p) = pending.get(&request) else {
                continue;
            };
            if p.worker != batch.worker || p.incarnation.is_some_and(|i| i != batch.incarnation) {
                continue; // from an old incarnation: never mixed into a newer attempt
            }
            let _ = p.tx.send(item);
            if done {
                pending.remove(&request);
            }
        }
    }

    /// Ends every attempt in flight with a cause that makes its request start another: what
    /// was sent to the router while no actor listened is gone.
    pub(super) fn resync(&self) {
        let lost: Vec<(u64, Pending)> = self.lock_pending().drain().collect();
        for (request, p) in lost {
            let _ =
                p.tx.send(TokenItem::failed(request, &ServingError::RouterRestart));
            self.send_cancel(p.worker, request);
        }
    }

    /// Fails every request `worker` holds (it is down, or `restarted`: back as a new
    /// incarnation).
    pub(super) fn fail_worker(&self, worker: &str, cause: &str, restarted: bool) {
        let mut pending = self.lock_pending();
        let lost: Vec<u64> = pending
            .iter()
            .filter(|(_, p)| p.worker == worker)
            .map(|(id, _)| *id)
            .collect();
        for id in lost {
            if let Some(p) = pending.remove(&id) {
                let lost = ServingError::WorkerLost {
                    worker: worker.to_string(),
                    cause: cause.to_string(),
                    restarted,
                };
                let _ = p.tx.send(TokenItem::failed(id, &lost));
            }
        }
    }
}

/// Where an attempt may go.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Workers already tried (avoided while there are others).
    pub exclude: Vec<String>,
    /// A pair the client named (`PREFILL,DECODE`).
    pub forced: Option<String>,
    /// The prefill worker that keeps this prompt's KV (a continuation).
    pub prefer_prefill: Option<String>,
    /// Prefill workers never to use for this request (an attempt stalled on them: the same
    /// pair would stall again). Without another, decode prefills the prompt itself.
    pub avoid_prefill: Vec<String>,
}

/// Why no worker could be chosen for an attempt.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RouteError {
    /// The client's forced pair is not `PREFILL,DECODE` (its error: never waited for).
    #[error("`{0}` is not a pair: expected PREFILL_NODE,DECODE_NODE")]
    NotAPair(String),
    /// No decode worker is ready (worth waiting for).
    #[error("no decode worker is ready to serve")]
    NoDecodeReady,
}

/// Why an attempt could not start.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub(crate) struct StartError {
    /// No worker could take it now (none ready, a link down or dropped, no answer in time):
    /// not the request's doing, and worth waiting for; otherwise a worker refused it.
    pub unavailable: bool,
    /// Names the worker and the cause.
    pub message: String,
}

impl StartError {
    /// A link failure asking `who`.
    pub(super) fn from_link(e: LinkError, who: &str) -> StartError {
        let unavailable = matches!(
            e,
            LinkError::NotConnected { .. }
                | LinkError::Disconnected { .. }
                | LinkError::DeadlineExceeded { .. }
                | LinkError::Remote {
                    unavailable: true,
                    ..
                }
        );
        let message = match e {
            LinkError::Remote { message, .. } => format!("{who} refused the request: {message}"),
            other => format!("{who}: {other}"),
        };
        StartError {
            unavailable,
            message,
        }
    }
}

pub(crate) struct Started {
    pub(super) request: u64,
    pub(super) worker: String,
    /// The prefill worker, when disaggregated.
    pub(super) prefill: Option<String>,
    pub(super) rx: mpsc::UnboundedReceiver<TokenItem>,
}
