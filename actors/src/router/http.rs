//! The router's HTTP API: `/v1/chat/completions`, `/v1/completions` (streaming and not),
//! `/v1/models`, `/health`, `/ready`, `/metrics`. Streamed responses are built in `stream.rs`.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use duet_engine::chat::Message;
use duet_engine::sampling::Penalties;
use duet_engine::{FinishReason, SamplingParams};
use serde_json::{Value, json};

use super::RouterShared;
use super::access::{self, Access};
use super::generation::Generation;
use super::openai::{ApiError, ChatRequest, Common, CompletionRequest};
use super::spans::{self, request_span, traced};
use super::stream::{TokenLogprob, chat_logprobs, completion_logprobs, stream_response};

/// Largest request body accepted.
const MAX_BODY: usize = 4 << 20;

/// The router's HTTP application.
pub fn app(shared: Arc<RouterShared>) -> axum::Router {
    axum::Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{model}", get(model))
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .fallback(|req: Request| async move {
            ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!("no such endpoint: {} {}", req.method(), req.uri().path()),
                kind: "invalid_request_error",
                param: None,
                code: Some("not_found"),
            }
        })
        .method_not_allowed_fallback(|req: Request| async move {
            ApiError {
                status: StatusCode::METHOD_NOT_ALLOWED,
                message: format!("{} is not allowed on {}", req.method(), req.uri().path()),
                kind: "invalid_request_error",
                param: None,
                code: Some("method_not_allowed"),
            }
        })
        .layer(axum::middleware::from_fn_with_state(
            shared.clone(),
            api_key,
        ))
        // Outermost, so a refused key or an unknown path gets its line too.
        .layer(axum::middleware::from_fn_with_state(
            shared.clone(),
            access::layer,
        ))
        .with_state(shared)
}

/// With `[serving] api_keys`, every `/v1/` request needs `Authorization: Bearer KEY` with one
/// of them (401 otherwise, as OpenAI answers); `/health`, `/ready` and `/metrics` stay open
/// for probes and scrapers on the same port.
async fn api_key(
    State(s): State<Arc<RouterShared>>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    if s.settings.api_keys.is_empty() || !req.uri().path().starts_with("/v1/") {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let ok = given.is_some_and(|g| s.settings.api_keys.iter().any(|k| k.matches(g)));
    if ok {
        return next.run(req).await;
    }
    ApiError {
        status: StatusCode::UNAUTHORIZED,
        message: if given.is_some() {
            "Incorrect API key provided".into()
        } else {
            "You didn't provide an API key: send it as `Authorization: Bearer KEY`".into()
        },
        kind: "invalid_request_error",
        param: None,
        code: Some("invalid_api_key"),
    }
    .into_response()
}

async fn body_json<T: serde::de::DeserializeOwned>(req: Request) -> Result<T, ApiError> {
    let bytes = axum::body::to_bytes(req.into_body(), MAX_BODY)
        .await
        .map_err(|_| ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("the request body is larger than {MAX_BODY} bytes"),
            kind: "invalid_request_error",
            param: None,
            code: Some("body_too_large"),
        })?;
    serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::invalid(format!("malformed JSON body: {e}"), "body").code("invalid_json")
    })
}

/// The served model as OpenAI's Model object.
fn model_object(s: &RouterShared) -> Value {
    // `created`: when the model file was written (what the served model is), else when this
    // router started; `max_model_len` as vLLM gives it, what a sequence can hold here.
    let (max_len, _) = s.sequence_limit();
    json!({
        "id": s.settings.model_name, "object": "model", "created": s.created,
        "owned_by": "duet", "max_model_len": max_len,
    })
}

async fn models(State(s): State<Arc<RouterShared>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&s)]}))
}

/// `GET /v1/models/{model}`: the served model, or 404 `model_not_found`.
async fn model(
    State(s): State<Arc<RouterShared>>,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> Response {
    match check_model(&s, Some(&name)) {
        Ok(()) => Json(model_object(&s)).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn ready(State(s): State<Arc<RouterShared>>) -> Response {
    let workers = s.ready_workers().len();
    // A draining router is not ready: a load balancer (or Kubernetes) stops sending to it.
    let draining = s.ctx.drain.is_draining();
    let ready = workers > 0 && !draining;
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(json!({"ready": ready, "workers": workers, "draining": draining})),
    )
        .into_response()
}

async fn metrics() -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        duet_runtime::metrics::install().render(),
    )
        .into_response()
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Api {
    Chat,
    Completion,
}

async fn chat(State(s): State<Arc<RouterShared>>, req: Request) -> Response {
    let span = request_span(Api::Chat, "/v1/chat/completions", &req);
    traced(span, chat_inner(s, req)).await
}

async fn completions(State(s): State<Arc<RouterShared>>, req: Request) -> Response {
    let span = request_span(Api::Completion, "/v1/completions", &req);
    traced(span, completions_inner(s, req)).await
}

async fn chat_inner(s: Arc<RouterShared>, req: Request) -> Response {
    let access = req.extensions().get::<Access>().cloned();
    let result = async {
        let r: ChatRequest = body_json(req).await?;
        check_model(&s, r.model.as_deref())?;
        r.common.refuse_unsupported()?;
        if r.messages.is_empty() {
            return Err(ApiError::invalid("messages must not be empty", "messages"));
        }
        let messages = r
            .messages
            .iter()
            .map(|m| Ok(Message::new(&m.role, &m.text()?)))
            .collect::<Result<Vec<_>, ApiError>>()?;
        if s.chat.is_none() {
            return Err(ApiError::invalid(
                "the model has no chat template",
                "messages",
            ));
        }
        let bytes = messages.iter().map(|m| m.content.len()).sum();
        fits_context(&s, bytes, "messages")?;
        let shared = s.clone();
        let prompt = off_executor(move || {
            let template = shared
                .chat
                .as_ref()
                .ok_or_else(|| ApiError::invalid("the model has no chat template", "messages"))?;
            let text = template
                .render(&messages, true)
                .map_err(|e| ApiError::invalid(e.to_string(), "messages"))?;
            Ok(shared.tokenizer.encode(&text))
        })
        .await?;
        Ok((prompt, r.common))
    }
    .await;
    match result {
        Ok((prompt, common)) => serve(s, Api::Chat, prompt, common, access).await,
        Err(e) => e.into_response(),
    }
}

async fn completions_inner(s: Arc<RouterShared>, req: Request) -> Response {
    let access = req.extensions().get::<Access>().cloned();
    let result = async {
        let r: CompletionRequest = body_json(req).await?;
        check_model(&s, r.model.as_deref())?;
        r.common.refuse_unsupported()?;
        let prompt = match r.prompt {
            Value::String(t) => encode(&s, t).await?,
            Value::Array(items) if items.iter().all(Value::is_u64) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .filter(|id| (*id as usize) < s.tokenizer.vocab_size())
                        .map(|id| id as u32)
                        .ok_or_else(|| {
                            ApiError::invalid("prompt token id outside the vocabulary", "prompt")
                        })
                })
                .collect::<Result<Vec<_>, _>>()?,
            Value::Array(mut items) if items.len() == 1 && items[0].is_string() => {
                match items.pop() {
                    Some(Value::String(t)) => encode(&s, t).await?,
                    _ => Vec::new(),
                }
            }
            _ => {
                return Err(ApiError::invalid(
                    "prompt must be a string or a list of token ids (one prompt per request)",
                    "prompt",
                ));
            }
        };
        Ok((prompt, r.common))
    }
    .await;
    match result {
        Ok((prompt, common)) => serve(s, Api::Completion, prompt, common, access).await,
        Err(e) => e.into_response(),
    }
}

/// Refuses a prompt of `bytes` that cannot fit the context whatever it encodes to (a token
/// stands for at most `max_token_bytes` bytes), before any work is spent on it.
fn fits_context(s: &RouterShared, bytes: usize, param: &str) -> Result<(), ApiError> {
    let per_token = s.tokenizer.max_token_bytes();
    let at_least = bytes.div_ceil(per_token);
    if at_least > s.max_context {
        return Err(ApiError::invalid(
            format!(
                "the prompt is {bytes} bytes, so at least {at_least} tokens (a token is at most \
                 {per_token} bytes); the context is {} tokens",
                s.max_context
            ),
            param,
        )
        .code("context_length_exceeded"));
    }
    Ok(())
}

/// Encodes a completion prompt, off the async executor.
async fn encode(s: &Arc<RouterShared>, text: String) -> Result<Vec<u32>, ApiError> {
    fits_context(s, text.len(), "prompt")?;
    let shared = s.clone();
    off_executor(move || Ok(shared.tokenizer.encode(&text))).await
}

/// Runs CPU work on the blocking pool, so that a long prompt's tokenization never holds an
/// executor thread other requests' streams need.
async fn off_executor<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work).await.map_err(|e| {
        ApiError::server(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("router: tokenizing failed: {e}"),
        )
    })?
}

fn check_model(s: &RouterShared, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        None => Err(ApiError::invalid(
            "you must provide a model parameter",
            "model",
        )),
        Some(m) if m != s.settings.model_name => Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "the model `{m}` does not exist; this server serves `{}`",
                s.settings.model_name
            ),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }),
        _ => Ok(()),
    }
}

/// Turns the request parameters into sampling parameters, refusing bad values.
/// `prompt_param` names the request field that held the prompt (`messages` or `prompt`).
fn params(
    s: &RouterShared,
    prompt_len: usize,
    prompt_param: &str,
    c: &Common,
    chat: bool,
) -> Result<SamplingParams, ApiError> {
    if prompt_len == 0 {
        return Err(ApiError::invalid("the prompt is empty", prompt_param));
    }
    if c.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("only n = 1 is supported", "n"));
    }
    if c.best_of.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid(
            "only best_of = 1 is supported",
            "best_of",
        ));
    }
    let temperature = c.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            "temperature must be between 0 and 2",
            "temperature",
        ));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid("top_p must be in (0, 1]", "top_p"));
    }
    let penalty = |v: Option<f64>, field: &str| match v {
        None => Ok(0.0),
        Some(p) if (-2.0..=2.0).contains(&p) => Ok(p as f32),
        Some(_) => Err(ApiError::invalid(
            format!("{field} must be between -2 and 2"),
            field,
        )),
    };
    let penalties = Penalties {
        presence: penalty(c.presence_penalty, "presence_penalty")?,
        frequency: penalty(c.frequency_penalty, "frequency_penalty")?,
    };
    let top_logprobs = c.top_logprobs(chat)?;
    let (limit, what) = s.sequence_limit();
    let room = limit.saturating_sub(prompt_len);
    if room == 0 {
        return Err(ApiError::invalid(
            format!("the prompt has {prompt_len} tokens; {what}"),
            prompt_param,
        )
        .code("context_length_exceeded"));
    }
    let max_tokens = match c.max_completion_tokens.or(c.max_tokens) {
        None => room.min(4096),
        Some(m) if m >= 1 && (m as usize) <= room => m as usize,
        Some(m) => {
            return Err(ApiError::invalid(
                format!(
                    "max_tokens is {m}, but the prompt has {prompt_len} tokens and {what}: at most {room}"
                ),
                "max_tokens",
            )
            .code("context_length_exceeded"));
        }
    };
    let min_tokens = c.min_tokens.unwrap_or(0).clamp(0, max_tokens as i64) as usize;
    Ok(SamplingParams {
        temperature: temperature as f32,
        top_p: top_p as f32,
        top_k: c.top_k.unwrap_or(0).max(0) as usize,
        seed: c.seed.map(|v| v as u64),
        max_tokens,
        min_tokens,
        ignore_eos: c.ignore_eos.unwrap_or(false),
        stop: c.stops()?,
        penalties,
        top_logprobs,
    })
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(super) fn finish_str(f: Option<FinishReason>) -> Value {
    match f {
        Some(FinishReason::Stop) => json!("stop"),
        Some(FinishReason::Length) => json!("length"),
        None => Value::Null,
    }
}

async fn serve(
    s: Arc<RouterShared>,
    api: Api,
    prompt: Vec<u32>,
    c: Common,
    access: Option<Access>,
) -> Response {
    let endpoint = if api == Api::Chat {
        "chat"
    } else {
        "completions"
    };
    let response = serve_inner(s, api, prompt, c, access).await;
    let outcome = if response.status().is_success() {
        "ok"
    } else if response.status().is_client_error() {
        "client_error"
    } else {
        "server_error"
    };
    metrics::counter!(duet_runtime::metrics::ROUTER_REQUESTS, "endpoint" => endpoint, "outcome" => outcome)
        .increment(1);
    response
}

async fn serve_inner(
    s: Arc<RouterShared>,
    api: Api,
    prompt: Vec<u32>,
    c: Common,
    access: Option<Access>,
) -> Response {
    let prompt_param = match api {
        Api::Chat => "messages",
        Api::Completion => "prompt",
    };
    let params = match params(&s, prompt.len(), prompt_param, &c, api == Api::Chat) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let prompt_tokens = prompt.len();
    let model = s.settings.model_name.clone();
    let span = tracing::Span::current();
    spans::record_request(&span, &model, &params);
    let logprobs = c.wants_logprobs();
    let mut generation =
        match Generation::start(s.clone(), prompt, params, c.duet_pair.clone(), access).await {
            Ok(g) => g,
            Err(e) => return e.into_response(),
        };
    let id = match api {
        Api::Chat => format!("chatcmpl-{:016x}", rand::random::<u64>()),
        Api::Completion => format!("cmpl-{:016x}", rand::random::<u64>()),
    };
    span.record("gen_ai.response.id", id.as_str());
    let created = now();
    if c.stream.unwrap_or(false) {
        return stream_response(
            generation,
            api,
            id,
            model,
            created,
            prompt_tokens,
            logprobs,
            c.include_usage(),
        )
        .await;
    }
    let (mut text, mut finish, mut lps, mut count, mut cached) =
        (String::new(), None, Vec::new(), 0, 0);
    while let Some(item) = generation.next().await {
        match item {
            Ok(item) => {
                text.push_str(&item.text);
                cached += item.cached_tokens;
                if item.token.is_some() {
                    count += 1;
                    lps.push(TokenLogprob::of(&item, generation.tokenizer()));
                }
                finish = item.finish.or(finish);
            }
            Err(e) => {
                return ApiError::server(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
                    .code(e.code().name())
                    .into_response();
            }
        }
    }
    let usage = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": count,
        "total_tokens": prompt_tokens + count,
        "prompt_tokens_details": {"cached_tokens": cached},
    });
    let body = match api {
        Api::Chat => json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": null, "annotations": []},
                "logprobs": if logprobs { chat_logprobs(&lps) } else { Value::Null },
                "finish_reason": finish_str(finish),
            }],
            "usage": usage,
        }),
        Api::Completion => json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{
                "index": 0, "text": text,
                "logprobs": if logprobs { completion_logprobs(&lps, 0) } else { Value::Null },
                "finish_reason": finish_str(finish),
            }],
            "usage": usage,
        }),
    };
    Json(body).into_response()
}
