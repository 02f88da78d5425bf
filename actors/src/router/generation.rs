//! One request's attempts, as the router's HTTP handlers drive them: the shell around the
//! pure [`AttemptPolicy`]. It starts an attempt (waiting for a worker while none can take
//! it), streams its tokens, and on a failure asks the policy whether and where to try again
//! (a retry, or a migration that continues from the tokens the client has). Dropping a
//! generation (the client left) cancels its attempt on the worker.

use std::sync::Arc;

use axum::http::StatusCode;
use duet_engine::SamplingParams;
use duet_engine::scheduler::Resume;
use duet_runtime::metrics as m;

use super::access::Access;
use super::openai::ApiError;
use super::policy::{AfterFailure, AfterStartFailure, AttemptPolicy};
use super::{Placement, RouterShared, Started};
use crate::protocol::{ServingError, TokenItem};

/// One request in flight. When its worker fails it gets another attempt, as its
/// [`AttemptPolicy`] decides: before the first token a plain retry on other workers; after it,
/// with `serving.migration` on, a continuation on another decode worker from the tokens the
/// client already has, prefilled by the worker that keeps the prompt's KV. Dropping it (client
/// gone) cancels it on the worker.
pub(super) struct Generation {
    shared: Arc<RouterShared>,
    prompt: Vec<u32>,
    params: SamplingParams,
    current: Option<Started>,
    policy: AttemptPolicy,
    /// Tokens the client has, and the bytes of their text.
    generated: Vec<u32>,
    emitted: usize,
    finished: bool,
    /// The request's span: it ends when the generation does (the end of an SSE stream).
    span: tracing::Span,
    arrived: std::time::Instant,
    last_token: Option<std::time::Instant>,
    /// Prompt tokens a prefix cache served (the operator metrics count them at the end).
    cached: usize,
    /// `duet_generation_tokens_total` for this model: looked up once per request, not per token.
    tokens_out: metrics::Counter,
    /// The request's access-log line, when the log is on.
    access: Option<Access>,
}

/// Starts an attempt, asking again while the policy says so: waiting (free) while no worker
/// can take it, until the request's `deadline`; spending an attempt when a worker refused it.
async fn start_attempt(
    shared: &Arc<RouterShared>,
    prompt: &[u32],
    params: &SamplingParams,
    resume: Resume,
    placement: &Placement,
    policy: &mut AttemptPolicy,
    deadline: std::time::Instant,
) -> Result<Started, String> {
    loop {
        let e = match shared
            .start(prompt.to_vec(), params.clone(), resume, placement.clone())
            .await
        {
            Ok(s) => {
                policy.started(&s.worker, s.prefill.as_deref());
                return Ok(s);
            }
            Err(e) => e,
        };
        let pause = match policy.start_failed(e.unavailable, std::time::Instant::now(), deadline) {
            AfterStartFailure::Wait(pause) => {
                tracing::warn!(error = %e, "no worker can take the request yet; waiting");
                pause
            }
            AfterStartFailure::Retry(pause) => {
                tracing::warn!(error = %e, "could not start an attempt; trying again");
                metrics::counter!(m::ROUTER_RETRIES).increment(1);
                pause
            }
            AfterStartFailure::GiveUp => return Err(e.message),
        };
        tokio::time::sleep(pause).await;
    }
}

impl Generation {
    /// The served model's tokenizer (to spell the alternatives a token item names by id).
    pub(super) fn tokenizer(&self) -> &duet_engine::tokenizer::Tokenizer {
        &self.shared.tokenizer
    }

    pub(super) async fn start(
        shared: Arc<RouterShared>,
        prompt: Vec<u32>,
        params: SamplingParams,
        forced: Option<String>,
        access: Option<Access>,
    ) -> Result<Generation, ApiError> {
        let arrived = std::time::Instant::now();
        if shared.ctx.drain.is_draining() {
            return Err(ApiError::server(
                StatusCode::SERVICE_UNAVAILABLE,
                "router: this router is draining; send the request to another".to_string(),
            ));
        }
        let mut policy =
            AttemptPolicy::new(shared.settings.retries, forced, shared.settings.migration);
        let deadline = arrived + shared.settings.request_timeout;
        let started = start_attempt(
            &shared,
            &prompt,
            &params,
            Resume::default(),
            &policy.first_placement(),
            &mut policy,
            deadline,
        )
        .await
        .map_err(|e| ApiError::server(StatusCode::SERVICE_UNAVAILABLE, e))?;
        shared
            .open
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if let Some(a) = &access {
            a.started(started.request, prompt.len());
        }
        let tokens_out = metrics::counter!(
            m::GENERATION_TOKENS,
            "model_name" => shared.settings.model_name.clone()
        );
        Ok(Generation {
            policy,
            current: Some(started),
            shared,
            prompt,
            params,
            generated: Vec::new(),
            emitted: 0,
            finished: false,
            span: tracing::Span::current(),
            arrived,
            last_token: None,
            cached: 0,
            tokens_out,
            access,
        })
    }

    /// Starts the next attempt after `error` (of `class`) ended the current one; `Err` when
    /// there is none.
    async fn next_attempt(&mut self, error: ServingError) -> Result<(), ServingError> {
        let Some(old) = self.current.as_ref() else {
            return Err(error);
        };
        let decision = self.policy.failed(
            error.class(),
            self.generated.len(),
            &old.worker,
            old.prefill.as_deref(),
        );
        let AfterFailure::Retry {
            pause,
            placement,
            migration,
        } = decision
        else {
            return Err(error);
        };
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
        if let Some(old) = self.current.take() {
            // The old attempt may still be running (the router restarted, not the worker).
            self.shared.cancel(old.request);
        }
        let mut prompt = self.prompt.clone();
        prompt.extend_from_slice(&self.generated);
        let resume = Resume {
            generated: self.generated.len(),
            emitted: self.emitted,
        };
        let kind = if migration { "migration" } else { "retry" };
        tracing::warn!(
            %error,
            kind,
            tokens_sent = resume.generated,
            "starting another attempt"
        );
        // The failure that ended the last attempt (a worker down) is often what the next
        // start runs into: it waits for a worker as the first start does. The deadline
        // measures lack of progress, as `request_timeout_secs` says: a long stream whose
        // decode worker is paused or restarting waits as long as a new request would, from
        // its last token, not from when it arrived.
        let progress = self.last_token.unwrap_or(self.arrived);
        let deadline = progress + self.shared.settings.request_timeout;
        let started = start_attempt(
            &self.shared,
            &prompt,
            &self.params,
            resume,
            &placement,
            &mut self.policy,
            deadline,
        )
        .await
        .map_err(|e| ServingError::Remote {
            code: error.code(),
            class: error.class(),
            message: format!("{error}; another attempt failed: {e}"),
        })?;
        if migration {
            metrics::counter!(m::ROUTER_MIGRATIONS, "outcome" => "started").increment(1);
        } else {
            metrics::counter!(m::ROUTER_RETRIES).increment(1);
        }
        self.current = Some(started);
        Ok(())
    }

    /// The next item; `Err` ends the request with that cause.
    pub(super) async fn next(&mut self) -> Option<Result<TokenItem, ServingError>> {
        if self.finished {
            return None;
        }
        let timeout = self.shared.settings.request_timeout;
        loop {
            let started = self.current.as_mut()?;
            let item = match tokio::time::timeout(timeout, started.rx.recv()).await {
                Ok(Some(item)) => item,
                Ok(None) => TokenItem::failed(
                    started.request,
                    &ServingError::WorkerLost {
                        worker: started.worker.clone(),
                        cause: "its stream closed".into(),
                        restarted: false,
                    },
                ),
                Err(_) => {
                    self.finished = true;
                    let request = started.request;
                    self.shared.cancel(request);
                    return Some(Err(self.failed(ServingError::Timeout(timeout))));
                }
            };
            if let Some(error) = item.failure() {
                match self.next_attempt(error).await {
                    Ok(()) => continue,
                    Err(e) => {
                        self.finished = true;
                        return Some(Err(self.failed(e)));
                    }
                }
            }
            self.cached += item.cached_tokens;
            if let Some(token) = item.token {
                self.generated.push(token);
                self.emitted += item.text.len();
                self.tokens_out.increment(1);
                if let Some(a) = &self.access {
                    a.token(item.cached_tokens);
                }
                let now = std::time::Instant::now();
                match self.last_token {
                    None => {
                        let ttft = now.duration_since(self.arrived).as_secs_f64();
                        metrics::histogram!(m::ROUTER_TTFT).record(ttft);
                        self.span.in_scope(|| tracing::debug!(ttft, "first token"));
                    }
                    Some(last) => {
                        metrics::histogram!(m::ROUTER_ITL)
                            .record(now.duration_since(last).as_secs_f64());
                    }
                }
                self.last_token = Some(now);
            }
            if let Some(reason) = item.finish {
                self.finished = true;
                metrics::histogram!(m::ROUTER_E2E).record(self.arrived.elapsed().as_secs_f64());
                let model = self.shared.settings.model_name.clone();
                let prompt = self.prompt.len() as u64;
                metrics::counter!(m::PROMPT_TOKENS, "model_name" => model.clone())
                    .increment(prompt);
                metrics::counter!(m::PREFIX_CACHE_QUERIES, "model_name" => model.clone())
                    .increment(prompt);
                metrics::counter!(m::PREFIX_CACHE_HITS, "model_name" => model.clone())
                    .increment(self.cached.min(self.prompt.len()) as u64);
                metrics::histogram!(m::REQUEST_PROMPT_TOKENS, "model_name" => model.clone())
                    .record(prompt as f64);
                metrics::histogram!(m::REQUEST_GENERATION_TOKENS, "model_name" => model)
                    .record(self.generated.len() as f64);
                self.span
                    .record("gen_ai.usage.output_tokens", self.generated.len() as i64);
                let reason = format!("{reason:?}").to_lowercase();
                if let Some(a) = &self.access {
                    a.finished(&reason);
                }
                duet_runtime::telemetry::record_list(
                    &self.span,
                    "gen_ai.response.finish_reasons",
                    &[&reason],
                );
            }
            return Some(Ok(item));
        }
    }
}

impl Generation {
    /// Notes on the access line why the request ended early, and passes the error on.
    fn failed(&self, e: ServingError) -> ServingError {
        if let Some(a) = &self.access {
            a.failed(&e.to_string());
        }
        e
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        self.shared
            .open
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        if let (false, Some(s)) = (self.finished, &self.current) {
            self.shared.cancel(s.request);
        }
    }
}
