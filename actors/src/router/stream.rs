//! Streamed responses (server-sent events) of `/v1/chat/completions` and `/v1/completions`:
//! one chunk per token batch, the usage chunk when asked for, `[DONE]`; and the log
//! probabilities both APIs report, streamed or not.

use std::convert::Infallible;
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};
use serde_json::{Value, json};

use super::generation::Generation;
use super::http::{Api, finish_str};
use super::openai::ApiError;
use crate::protocol::{ServingError, TokenItem};
use duet_engine::tokenizer::Tokenizer;

/// One generated token as both logprobs objects report it: the text it made final, its
/// log-probability, and the likeliest alternatives at its position (each token's own bytes,
/// from the tokenizer, and log-probability; empty unless asked for).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct TokenLogprob {
    pub text: String,
    pub logprob: f32,
    pub top: Vec<(Vec<u8>, f32)>,
}

impl TokenLogprob {
    /// `item`'s token (the caller checked it has one), alternatives spelled by `tok`.
    pub(super) fn of(item: &TokenItem, tok: &Tokenizer) -> TokenLogprob {
        TokenLogprob {
            text: item.text.clone(),
            logprob: item.logprob,
            top: item
                .top
                .iter()
                .map(|&(id, lp)| (tok.token_bytes(id), lp))
                .collect(),
        }
    }
}

/// How an alternative token is spelled: its text, or, when its bytes are not UTF-8 by
/// themselves (a token that ends inside a character), `bytes:` and each byte as `\xNN`, as
/// OpenAI spells them, so two such tokens never share a spelling (the legacy object is keyed
/// by it).
fn spell(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) => s.to_string(),
        Err(_) => {
            let hex: String = bytes.iter().map(|b| format!("\\x{b:02x}")).collect();
            format!("bytes:{hex}")
        }
    }
}

/// The chat logprobs object: per token its text, bytes, log-probability and `top_logprobs`
/// (an alternative's text as [`spell`] writes it, its `bytes` exact).
pub(super) fn chat_logprobs(lps: &[TokenLogprob]) -> Value {
    let entry =
        |text: &str, bytes: &[u8], lp: f32| json!({"token": text, "logprob": lp, "bytes": bytes});
    json!({"content": lps.iter().map(|t| {
        let mut e = entry(&t.text, t.text.as_bytes(), t.logprob);
        e["top_logprobs"] = t
            .top
            .iter()
            .map(|(b, lp)| entry(&spell(b), b, *lp))
            .collect();
        e
    }).collect::<Vec<_>>(), "refusal": null})
}

/// The legacy completions' logprobs object. `offset` is the characters of completion text
/// before the first of `lps` (a stream's chunks continue the count); each token's
/// `text_offset` is where its text starts. `top_logprobs` (per token, alternative text to
/// log-probability) is there when the request asked for alternatives (`logprobs: N`, N > 0);
/// otherwise it is left out, as a list of the chosen tokens would claim they were the
/// likeliest.
pub(super) fn completion_logprobs(lps: &[TokenLogprob], offset: usize) -> Value {
    let offsets: Vec<usize> = lps
        .iter()
        .scan(offset, |at, t| {
            let start = *at;
            *at += t.text.chars().count();
            Some(start)
        })
        .collect();
    let mut v = json!({
        "tokens": lps.iter().map(|t| t.text.clone()).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "text_offset": offsets,
    });
    if lps.iter().any(|t| !t.top.is_empty()) {
        v["top_logprobs"] = lps
            .iter()
            .map(|t| {
                t.top
                    .iter()
                    .map(|(b, lp)| (spell(b), json!(lp)))
                    .collect::<serde_json::Map<_, _>>()
            })
            .collect();
    }
    v
}

/// A streamed response. Its headers wait for the first item: until then nothing has reached
/// the client, so a request that fails before its first token (every attempt the router may
/// make spent) is a plain HTTP error, and a router that dies meanwhile closes a connection
/// with no response; both are what clients retry (the `openai` client does, by default). A
/// 200 sent at once would leave them a stream that ends before it starts, which none retries.
#[allow(clippy::too_many_arguments)]
pub(super) async fn stream_response(
    mut generation: Generation,
    api: Api,
    id: String,
    model: String,
    created: u64,
    prompt_tokens: usize,
    logprobs: bool,
    include_usage: bool,
) -> Response {
    let first = generation.next().await;
    if let Some(Err(e)) = first {
        return ApiError::server(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
            .code(e.code().name())
            .into_response();
    }
    struct St {
        g: Generation,
        /// The first item, taken before the headers went out.
        pending: Option<Option<Result<TokenItem, ServingError>>>,
        first: bool,
        done: bool,
        count: usize,
        /// Prompt tokens served from a prefix cache (the usage chunk reports them).
        cached: usize,
        /// Characters of completion text sent so far (the logprobs' `text_offset`).
        chars: usize,
    }
    let chunk = move |choice: Value, usage: Value| -> Event {
        let object = if api == Api::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        // No `system_fingerprint`: the schema wants a string when present, and Duet has none.
        let mut v = json!({"id": id, "object": object, "created": created, "model": model,
            "choices": [choice]});
        if choice_is_empty(&v) {
            v["choices"] = json!([]);
        }
        if !usage.is_null() {
            v["usage"] = usage;
        }
        Event::default().data(v.to_string())
    };
    let events = stream::unfold(
        St {
            g: generation,
            pending: Some(first),
            first: true,
            done: false,
            count: 0,
            cached: 0,
            chars: 0,
        },
        move |mut st| {
            let chunk = chunk.clone();
            async move {
                if st.done {
                    return None;
                }
                let mut out: Vec<Result<Event, Infallible>> = Vec::new();
                if st.first && api == Api::Chat {
                    st.first = false;
                    out.push(Ok(chunk(
                        json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}),
                        Value::Null,
                    )));
                }
                let next = match st.pending.take() {
                    Some(first) => first,
                    None => st.g.next().await,
                };
                match next {
                    Some(Ok(item)) => {
                        if item.token.is_some() {
                            st.count += 1;
                        }
                        st.cached += item.cached_tokens;
                        let lp = if logprobs && item.token.is_some() {
                            let one = [TokenLogprob::of(&item, st.g.tokenizer())];
                            if api == Api::Chat {
                                chat_logprobs(&one)
                            } else {
                                completion_logprobs(&one, st.chars)
                            }
                        } else {
                            Value::Null
                        };
                        st.chars += item.text.chars().count();
                        let choice = match api {
                            Api::Chat => {
                                json!({"index": 0, "delta": {"content": item.text}, "logprobs": lp, "finish_reason": finish_str(item.finish)})
                            }
                            Api::Completion => {
                                json!({"index": 0, "text": item.text, "logprobs": lp, "finish_reason": finish_str(item.finish)})
                            }
                        };
                        out.push(Ok(chunk(choice, Value::Null)));
                        if item.finish.is_some() {
                            if include_usage {
                                let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": st.count, "total_tokens": prompt_tokens + st.count,
                                    "prompt_tokens_details": {"cached_tokens": st.cached}});
                                out.push(Ok(chunk(Value::Null, usage)));
                            }
                            out.push(Ok(Event::default().data("[DONE]")));
                            st.done = true;
                        }
                    }
                    Some(Err(cause)) => {
                        let err = json!({"error": {"message": cause.to_string(), "type": "server_error", "param": null, "code": cause.code().name()}});
                        out.push(Ok(Event::default().event("error").data(err.to_string())));
                        out.push(Ok(Event::default().data("[DONE]")));
                        st.done = true;
                    }
                    None => {
                        out.push(Ok(Event::default().data("[DONE]")));
                        st.done = true;
                    }
                }
                Some((stream::iter(out), st))
            }
        },
    );
    let flat = futures_util::StreamExt::flatten(events);
    sse(flat)
}

fn choice_is_empty(v: &Value) -> bool {
    v["choices"]
        .as_array()
        .is_some_and(|c| c.len() == 1 && c[0].is_null())
}

fn sse<S>(events: S) -> Response
where
    S: Stream<Item = Result<Event, Infallible>> + Send + 'static,
{
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}
