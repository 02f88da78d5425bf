//! The OpenAI API as strict clients and conformance checkers read it (issue 20), on a real
//! cluster (the tiny model: router, prefill, decode) through curl:
//!
//! - no `null` where the schema wants a string (`system_fingerprint` is omitted);
//! - `model` is required (400 naming it); a field Duet does not implement (`tools`,
//!   `response_format`, `logit_bias`, `echo`, ...) is a 400 naming the field, at once,
//!   not a request run to the context limit; `null` counts as absent; presence and frequency
//!   penalties are applied (and checked to be within -2..2);
//! - `top_logprobs` (chat) and `logprobs: N` (completions) report the likeliest alternatives,
//!   the engine's own figures (`duet generate --top-logprobs`), the first token's included
//!   (prefill samples it and hands them over with the last KV write);
//! - streamed usage carries `prompt_tokens_details.cached_tokens`;
//! - `/v1/models` gives `max_model_len` and a real `created`; `/v1/models/{model}` the same
//!   object (404 `model_not_found` for another name);
//! - 404 and 405 are OpenAI-shaped;
//! - with `api_keys`, the public API needs `Authorization: Bearer KEY` (401 otherwise) while
//!   `/health`, `/ready` and `/metrics` stay open.

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

/// One request through curl: status and body (JSON, or `Null`).
async fn request(
    http: u16,
    method: &str,
    path: &str,
    body: Option<&Value>,
    key: Option<&str>,
) -> (u16, Value) {
    let mut cmd = tokio::process::Command::new("curl");
    cmd.args([
        "-s",
        "--max-time",
        "60",
        "-w",
        "\n%{http_code}",
        "-X",
        method,
    ])
    .arg("-H")
    .arg("content-type: application/json");
    if let Some(k) = key {
        cmd.arg("-H").arg(format!("authorization: Bearer {k}"));
    }
    if let Some(b) = body {
        cmd.arg("-d").arg(b.to_string());
    }
    let out = cmd
        .arg(format!("http://127.0.0.1:{http}{path}"))
        .output()
        .await
        .expect("curl");
    status_and_json(&out.stdout)
}

/// The JSON chunks of a server-sent event stream (without the final `[DONE]`).
fn sse_chunks(body: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(body)
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("a JSON chunk"))
        .collect()
}

fn assert_openai_error(v: &Value, param: Option<&str>) {
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    if let Some(p) = param {
        assert_eq!(e["param"], p, "{v}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn responses_fields_and_errors_follow_the_openai_schema() {
    let c = ClusterDir::tiny(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        "",
    );
    let _up = Running::up(&c.config).await;
    let http = c.http;
    router_ready(http, 2).await;
    let model = served_model(http);

    // No null system_fingerprint, in either endpoint, streamed or not.
    let ok = json!({"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 3});
    let (code, v) = request(http, "POST", "/v1/completions", Some(&ok), None).await;
    assert_eq!(code, 200, "{v}");
    assert!(v.get("system_fingerprint").is_none(), "{v}");
    let chat =
        json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3});
    let (code, v) = request(http, "POST", "/v1/chat/completions", Some(&chat), None).await;
    assert_eq!(code, 200, "{v}");
    assert!(v.get("system_fingerprint").is_none(), "{v}");
    assert!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64(),
        "{v}"
    );

    // Streamed usage has the cached tokens (a prompt sent twice is cached the second time).
    let long: Vec<u32> = (0..40).map(|i| 20 + i).collect();
    let streamed = json!({"model": model, "prompt": long, "max_tokens": 2, "stream": true,
                          "stream_options": {"include_usage": true}});
    let mut cached = Vec::new();
    for _ in 0..2 {
        let child = curl_stream(http, &streamed, Stdio::piped());
        let out = child.wait_with_output().await.expect("curl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let chunks = sse_chunks(&out.stdout);
        assert!(
            chunks.iter().all(|c| c.get("system_fingerprint").is_none()),
            "{text}"
        );
        let usage = chunks
            .iter()
            .find(|c| !c["usage"].is_null())
            .map(|c| c["usage"].clone())
            .unwrap_or_else(|| panic!("no usage chunk: {text}"));
        cached.push(
            usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or_else(|| panic!("no cached_tokens in {usage}")),
        );
    }
    assert!(cached[1] > cached[0], "cached tokens {cached:?}");

    // `model` is required; a wrong one is 404 model_not_found.
    let (code, v) = request(
        http,
        "POST",
        "/v1/completions",
        Some(&json!({"prompt": "x"})),
        None,
    )
    .await;
    assert_eq!(code, 400, "{v}");
    assert_openai_error(&v, Some("model"));
    let (code, v) = request(
        http,
        "POST",
        "/v1/completions",
        Some(&json!({"model": "gpt-4", "prompt": "x"})),
        None,
    )
    .await;
    assert_eq!(code, 404, "{v}");
    assert_eq!(v["error"]["code"], "model_not_found", "{v}");

    // Unimplemented fields: 400 naming each, at once (never a generation to the limit).
    let tool = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    for (field, value, path) in [
        ("tools", tool.clone(), "/v1/chat/completions"),
        ("tool_choice", json!("auto"), "/v1/chat/completions"),
        (
            "response_format",
            json!({"type": "json_object"}),
            "/v1/chat/completions",
        ),
        ("logit_bias", json!({"5": 10}), "/v1/completions"),
        ("echo", json!(true), "/v1/completions"),
        // Alternatives without `logprobs: true`, or out of range.
        ("top_logprobs", json!(3), "/v1/chat/completions"),
        ("top_logprobs", json!(21), "/v1/chat/completions"),
        ("logprobs", json!(6), "/v1/completions"),
        ("top_logprobs", json!(2), "/v1/completions"),
        // Documented fields Duet ignores must still have their documented shape.
        ("service_tier", json!("turbo"), "/v1/chat/completions"),
        ("metadata", json!({"k": 1}), "/v1/completions"),
        ("user", json!(5), "/v1/chat/completions"),
        ("logprobs", json!(3), "/v1/chat/completions"),
        (
            "stream_options",
            json!({"include_usage": "yes"}),
            "/v1/completions",
        ),
        // Out of OpenAI's range.
        ("presence_penalty", json!(2.5), "/v1/completions"),
        ("frequency_penalty", json!(-3), "/v1/chat/completions"),
    ] {
        let mut body = if path == "/v1/completions" {
            ok.clone()
        } else {
            chat.clone()
        };
        body[field] = value;
        body["max_tokens"] = json!(100_000);
        let t = Instant::now();
        let (code, v) = request(http, "POST", path, Some(&body), None).await;
        assert_eq!(code, 400, "{field}: {v}");
        assert_openai_error(&v, Some(field));
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{field} took {:?}",
            t.elapsed()
        );
    }
    // A message's role is one the API knows.
    let mut wizard = chat.clone();
    wizard["messages"] = json!([{"role": "wizard", "content": "hi"}]);
    let (code, v) = request(http, "POST", "/v1/chat/completions", Some(&wizard), None).await;
    assert_eq!(code, 400, "{v}");
    assert_openai_error(&v, Some("messages"));
    // A conversation that holds tool calls cannot be continued without tool calling.
    wizard["messages"] = json!([{"role": "user", "content": "hi"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}]}]);
    let (code, v) = request(http, "POST", "/v1/chat/completions", Some(&wizard), None).await;
    assert_eq!(code, 400, "{v}");
    assert_openai_error(&v, Some("messages"));
    // null and zero mean "not set": served.
    let mut unset = chat.clone();
    unset["tools"] = Value::Null;
    unset["presence_penalty"] = json!(0);
    unset["user"] = json!("someone");
    unset["service_tier"] = json!("auto");
    unset["metadata"] = json!({"team": "a"});
    let (code, v) = request(http, "POST", "/v1/chat/completions", Some(&unset), None).await;
    assert_eq!(code, 200, "{v}");

    // Presence and frequency penalties change what greedy decoding repeats, on the
    // disaggregated path (prefill samples the first token, decode the rest).
    let greedy = json!({"model": ok["model"], "prompt": [9, 10, 11], "max_tokens": 24,
                        "temperature": 0, "ignore_eos": true});
    let text = |v: &Value| {
        v["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let (code, plain) = request(http, "POST", "/v1/completions", Some(&greedy), None).await;
    assert_eq!(code, 200, "{plain}");
    let mut penalized = greedy.clone();
    penalized["frequency_penalty"] = json!(2.0);
    penalized["presence_penalty"] = json!(2.0);
    let (code, pen) = request(http, "POST", "/v1/completions", Some(&penalized), None).await;
    assert_eq!(code, 200, "{pen}");
    assert_ne!(text(&plain), text(&pen), "the penalties changed nothing");
    let (_, again) = request(http, "POST", "/v1/completions", Some(&penalized), None).await;
    assert_eq!(
        text(&pen),
        text(&again),
        "penalized greedy decoding is deterministic"
    );

    top_logprobs_are_the_engines(&c, http, &model).await;

    // /v1/models: max_model_len and a real created.
    let (code, v) = request(http, "GET", "/v1/models", None, None).await;
    assert_eq!(code, 200, "{v}");
    let m = &v["data"][0];
    assert!(m["max_model_len"].as_u64().is_some_and(|n| n > 0), "{v}");
    assert!(
        m["created"].as_u64().is_some_and(|t| t > 1_600_000_000),
        "{v}"
    );
    // One model by name: the same object; another name is 404 model_not_found.
    let path = format!("/v1/models/{}", m["id"].as_str().unwrap_or_default());
    let (code, one) = request(http, "GET", &path, None, None).await;
    assert_eq!((code, &one), (200, m), "{one}");
    let (code, none) = request(http, "GET", "/v1/models/gpt-4", None, None).await;
    assert_eq!(code, 404, "{none}");
    assert_eq!(none["error"]["code"], "model_not_found", "{none}");

    // Metrics an operator charts first, under vLLM's names (duet_ prefixed), with model_name,
    // `# HELP` on every family, `_total` on counters only.
    let out = tokio::process::Command::new("curl")
        .args(["-s", &format!("http://127.0.0.1:{http}/metrics")])
        .output()
        .await
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    for name in [
        "duet_prompt_tokens_total",
        "duet_generation_tokens_total",
        "duet_prefix_cache_queries_total",
        "duet_prefix_cache_hits_total",
        "duet_request_prompt_tokens_bucket",
    ] {
        assert!(
            text.lines()
                .any(|l| l.starts_with(name) && l.contains(&format!("model_name=\"{model}\""))),
            "no {name} with model_name in:\n{text}"
        );
    }
    let helped: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# HELP "))
        .filter_map(|l| l.split(' ').next())
        .collect();
    for l in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
        let mut it = l.split(' ');
        let (name, kind) = (it.next().unwrap_or(""), it.next().unwrap_or(""));
        assert!(helped.contains(&name), "{name} has no # HELP");
        assert_eq!(
            kind == "counter",
            name.ends_with("_total"),
            "{name} is a {kind}"
        );
    }

    // 404 and 405, OpenAI-shaped.
    let (code, v) = request(http, "GET", "/v1/nothing", None, None).await;
    assert_eq!(code, 404, "{v}");
    assert_openai_error(&v, None);
    let (code, v) = request(http, "GET", "/v1/completions", None, None).await;
    assert_eq!(code, 405, "{v}");
    assert_openai_error(&v, None);
}

#[tokio::test(flavor = "multi_thread")]
async fn api_keys_guard_the_public_api_and_leave_probes_open() {
    let key = "sk-duet-test-0123456789abcdef";
    let c = ClusterDir::tiny(
        &[("router", "router"), ("d0", "decode")],
        &format!("api_keys = [\"{key}\"]\n"),
    );
    let _up = Running::up(&c.config).await;
    let http = c.http;
    router_ready(http, 1).await;
    let body = json!({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2});
    let (code, v) = request(http, "POST", "/v1/completions", Some(&body), None).await;
    assert_eq!(code, 401, "{v}");
    assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
    let (code, v) = request(
        http,
        "POST",
        "/v1/completions",
        Some(&body),
        Some("sk-wrong-wrong-wrong-wrong"),
    )
    .await;
    assert_eq!(code, 401, "{v}");
    let (code, v) = request(http, "GET", "/v1/models", None, None).await;
    assert_eq!(code, 401, "{v}");
    let (code, v) = request(http, "POST", "/v1/completions", Some(&body), Some(key)).await;
    assert_eq!(code, 200, "{v}");
    for probe in ["/health", "/ready"] {
        let (code, v) = request(http, "GET", probe, None, None).await;
        assert_eq!(code, 200, "{probe}: {v}");
    }
}

/// `top_logprobs` on the disaggregated pair (`duet_pair`), streamed and not, in both APIs:
/// each token's alternatives are the engine's (`duet generate --top-logprobs` on the same ids
/// in its own process: same ids, same figures), likeliest first, the chosen one first under
/// greedy decoding; the first token's come from prefill with the last KV write.
async fn top_logprobs_are_the_engines(c: &ClusterDir, http: u16, model: &str) {
    const N: usize = 4;
    const TOKENS: usize = 6;
    let ids: Vec<u32> = (0..24).map(|i| 30 + 7 * i).collect();
    let csv: Vec<String> = ids.iter().map(u32::to_string).collect();
    let model_file = c.dir.path().join("tiny.gguf");
    let reference = generate_json(&[
        "--model",
        path_str(&model_file),
        "--prompt-ids",
        &csv.join(","),
        "--max-tokens",
        &TOKENS.to_string(),
        "--ignore-eos",
        "--top-logprobs",
        &N.to_string(),
    ])
    .await;
    let expect: Vec<Vec<(u32, f64)>> = reference["top_logprobs"]
        .as_array()
        .expect("top_logprobs")
        .iter()
        .map(|pos| {
            pos.as_array()
                .expect("a position")
                .iter()
                .map(|p| {
                    (
                        p[0].as_u64().expect("id") as u32,
                        p[1].as_f64().expect("logprob"),
                    )
                })
                .collect()
        })
        .collect();
    assert_eq!(expect.len(), TOKENS, "{reference}");
    assert!(expect.iter().all(|p| p.len() == N), "{reference}");
    let chosen: Vec<u64> = reference["token_ids"]
        .as_array()
        .expect("token_ids")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    // Greedy: the chosen token is the likeliest.
    for (pos, id) in expect.iter().zip(&chosen) {
        assert_eq!(u64::from(pos[0].0), *id, "{reference}");
    }
    // What the router reports per position: (text, logprob) of each alternative.
    let close = |a: f64, b: f64| (a - b).abs() < 1e-4;
    let check = |got: &[Vec<(String, f64)>], chosen_lps: &[f64], what: &str| {
        assert_eq!(got.len(), TOKENS, "{what}: {got:?}");
        for (i, (pos, want)) in got.iter().zip(&expect).enumerate() {
            assert_eq!(pos.len(), N, "{what} token {i}: {pos:?}");
            for ((text, lp), (_, want_lp)) in pos.iter().zip(want) {
                assert!(
                    close(*lp, *want_lp),
                    "{what} token {i}: {pos:?} vs {want:?}"
                );
                assert!(!text.is_empty() || *lp < 0.0, "{what} token {i}: {pos:?}");
            }
            assert!(close(chosen_lps[i], pos[0].1), "{what} token {i}");
        }
    };
    let base = json!({"model": model, "prompt": ids, "max_tokens": TOKENS,
                      "temperature": 0, "ignore_eos": true, "duet_pair": "p0,d0"});
    // Completions: logprobs N, whole and streamed.
    let mut legacy = base.clone();
    legacy["logprobs"] = json!(N);
    let (code, v) = request(http, "POST", "/v1/completions", Some(&legacy), None).await;
    assert_eq!(code, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let per_token = |top: &Value| -> Vec<(String, f64)> {
        let mut pairs: Vec<(String, f64)> = top
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_f64().unwrap_or(f64::NAN)))
                    .collect()
            })
            .unwrap_or_default();
        pairs.sort_by(|a, b| b.1.total_cmp(&a.1));
        pairs
    };
    let got: Vec<Vec<(String, f64)>> = lp["top_logprobs"]
        .as_array()
        .map(|a| a.iter().map(per_token).collect())
        .unwrap_or_default();
    let chosen_lps: Vec<f64> = lp["token_logprobs"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default();
    check(&got, &chosen_lps, "completions");
    legacy["stream"] = json!(true);
    let child = curl_stream(http, &legacy, Stdio::piped());
    let out = child.wait_with_output().await.expect("curl");
    let chunks = sse_chunks(&out.stdout);
    let (mut got, mut chosen_lps) = (Vec::new(), Vec::new());
    for ch in &chunks {
        let lp = &ch["choices"][0]["logprobs"];
        for top in lp["top_logprobs"].as_array().into_iter().flatten() {
            got.push(per_token(top));
        }
        chosen_lps.extend(
            lp["token_logprobs"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_f64),
        );
    }
    check(&got, &chosen_lps, "completions streamed");
    // Chat: logprobs true with top_logprobs N (the chat template wraps the prompt, so the
    // figures differ from the reference's: their shape and order are checked).
    let chat = json!({"model": model, "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": TOKENS, "temperature": 0, "ignore_eos": true,
                      "logprobs": true, "top_logprobs": N, "duet_pair": "p0,d0"});
    let (code, v) = request(http, "POST", "/v1/chat/completions", Some(&chat), None).await;
    assert_eq!(code, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(content.len(), TOKENS, "{v}");
    for e in &content {
        let top = e["top_logprobs"].as_array().cloned().unwrap_or_default();
        assert_eq!(top.len(), N, "{e}");
        let lps: Vec<f64> = top.iter().filter_map(|t| t["logprob"].as_f64()).collect();
        assert!(lps.windows(2).all(|w| w[0] >= w[1]), "{e}");
        assert!(
            lps.iter().map(|l| l.exp()).sum::<f64>() <= 1.0 + 1e-4,
            "{e}"
        );
        assert!(
            close(e["logprob"].as_f64().unwrap_or(f64::NAN), lps[0]),
            "{e}"
        );
        for t in &top {
            let bytes: Vec<u8> = t["bytes"]
                .as_array()
                .map(|b| {
                    b.iter()
                        .filter_map(|x| x.as_u64().map(|x| x as u8))
                        .collect()
                })
                .unwrap_or_default();
            let token = t["token"].as_str().unwrap_or("?");
            match std::str::from_utf8(&bytes) {
                Ok(text) => assert_eq!(text, token, "{t}"),
                Err(_) => assert!(token.starts_with("bytes:\\x"), "{t}"),
            }
        }
    }
}
