//! One request, one trace, in a real Jaeger: the router's span is the root, prefill and
//! decode spans hang under it from their own services, with one span per prefill chunk; the
//! client's tracestate stays on every span; spans arrive over OTLP/HTTP and over OTLP/gRPC.

mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use common::*;
use duet_engine::Model;
use serde_json::{Value, json};

const CHUNK: usize = 32;

/// The Jaeger binary (built once by tools/jaeger/install.sh).
fn jaeger_bin() -> PathBuf {
    duet_runtime::testing::pinned_tool(
        &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tools/jaeger/install.sh"),
    )
}

/// A Jaeger on loopback with in-memory storage; killed on drop.
struct Jaeger {
    child: tokio::process::Child,
    query: u16,
    otlp: u16,
    otlp_grpc: u16,
    _dir: tempfile::TempDir,
}

impl Jaeger {
    async fn start() -> Jaeger {
        let bin = jaeger_bin();
        let dir = tempfile::tempdir().expect("tempdir");
        let ports = duet_runtime::testing::JaegerPorts::free();
        let config = duet_runtime::testing::jaeger_config(ports);
        let path = dir.path().join("jaeger.yaml");
        std::fs::write(&path, config).expect("jaeger config");
        let child = tokio::process::Command::new(bin)
            .arg("--config")
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start jaeger");
        let j = Jaeger {
            child,
            query: ports.query,
            otlp: ports.otlp_http,
            otlp_grpc: ports.otlp_grpc,
            _dir: dir,
        };
        poll("Jaeger's query API", Duration::from_secs(60), || async {
            j.get("/api/services").await.map(|_| ())
        })
        .await;
        j
    }

    async fn get(&self, path: &str) -> Option<Value> {
        let out = tokio::process::Command::new("curl")
            .args(["-sf", "--max-time", "3"])
            .arg(format!("http://127.0.0.1:{}{path}", self.query))
            .output()
            .await
            .ok()?;
        if !out.status.success() {
            return None;
        }
        serde_json::from_slice(&out.stdout).ok()
    }
}

impl Drop for Jaeger {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

fn service_of<'a>(trace: &'a Value, span: &Value) -> &'a str {
    let pid = span["processID"].as_str().unwrap_or_default();
    trace["processes"][pid]["serviceName"]
        .as_str()
        .unwrap_or_default()
}

fn parent_of(span: &Value) -> Option<&str> {
    span["references"]
        .as_array()?
        .iter()
        .find(|r| r["refType"] == "CHILD_OF")?["spanID"]
        .as_str()
}

fn spans_named<'a>(trace: &'a Value, name: &str) -> Vec<&'a Value> {
    trace["spans"]
        .as_array()
        .map(|s| s.iter().filter(|s| s["operationName"] == name).collect())
        .unwrap_or_default()
}

/// The value of a span's tag `key`, as Jaeger shows it.
fn tag<'a>(span: &'a Value, key: &str) -> Option<&'a Value> {
    span["tags"]
        .as_array()?
        .iter()
        .find(|t| t["key"] == key)
        .map(|t| &t["value"])
}

/// The tracestate a client sends along with its traceparent: two vendors' entries.
const TRACESTATE: &str = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7";

/// Every span of every service in `services` carries the client's tracestate (Jaeger shows
/// an OTLP span's trace_state as the tag `w3c.tracestate`).
fn assert_tracestate_everywhere(trace: &Value, services: &[&str]) {
    for service in services {
        let spans: Vec<&Value> = trace["spans"]
            .as_array()
            .map(|s| {
                s.iter()
                    .filter(|s| service_of(trace, s) == *service)
                    .collect()
            })
            .unwrap_or_default();
        assert!(!spans.is_empty(), "no spans from {service}");
        for s in spans {
            assert_eq!(
                tag(s, "w3c.tracestate").and_then(Value::as_str),
                Some(TRACESTATE),
                "{service}: {s}"
            );
        }
    }
}

/// The trace `trace_id` once every service has flushed its part, down to decode's
/// `decoding` span and at least `chunks` prefill chunks.
async fn whole_trace(jaeger: &Jaeger, trace_id: &str, chunks: usize) -> Value {
    poll("the trace in Jaeger", Duration::from_secs(60), || async {
        let t = jaeger.get(&format!("/api/traces/{trace_id}")).await?;
        let trace = t["data"].get(0)?.clone();
        let services: Vec<&str> = trace["spans"]
            .as_array()?
            .iter()
            .map(|s| service_of(&trace, s))
            .collect();
        (["duet-router", "duet-p0", "duet-d0"]
            .iter()
            .all(|s| services.contains(s))
            && !spans_named(&trace, "decoding").is_empty()
            && spans_named(&trace, "chunk").len() >= chunks)
            .then_some(trace)
    })
    .await
}

async fn completion(http: u16, body: &Value, traceparent: &str) -> Value {
    let body = &with_model(http, body);
    let out = tokio::process::Command::new("curl")
        .args([
            "-s",
            "--max-time",
            "120",
            "-H",
            "content-type: application/json",
        ])
        .arg("-H")
        .arg(format!("traceparent: {traceparent}"))
        .arg("-H")
        .arg(format!("tracestate: {TRACESTATE}"))
        .arg("-d")
        .arg(body.to_string())
        .arg(format!("http://127.0.0.1:{http}/v1/completions"))
        .output()
        .await
        .expect("curl");
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

#[tokio::test(flavor = "multi_thread")]
async fn one_request_is_one_trace_across_router_prefill_and_decode() {
    let jaeger = Jaeger::start().await;
    let model_path = real_model();
    let model = Model::open(&model_path).expect("model");
    let http = free_ports(1)[0];
    let extra = format!(
        "[serving]\nmodel = \"{}\"\nhttp = \"127.0.0.1:{http}\"\nkv_pages = 64\n\
         max_batch_tokens = {CHUNK}\ndisagg_threshold = 0\n\n\
         [telemetry]\notlp_endpoint = \"http://127.0.0.1:{}\"\nsampler = \"always_on\"\n",
        model_path.display(),
        jaeger.otlp
    );
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        &extra,
    );
    let _up = Running::up(&c.config).await;
    router_ready(http, 2).await;
    // A client's own trace continues into Duet: its traceparent names the trace.
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let text = "Tracing shows where a request spends its time, across every process it visits. ";
    let prompt: Vec<u32> = model.tokenizer.encode(&text.repeat(8))[..3 * CHUNK + 5].to_vec();
    let chunks = prompt.len().div_ceil(CHUNK);
    let body = json!({"prompt": prompt, "max_tokens": 4, "temperature": 0});
    let v = completion(http, &body, &format!("00-{trace_id}-{client_span}-01")).await;
    assert!(v["choices"][0]["text"].is_string(), "{v}");

    let trace = whole_trace(&jaeger, trace_id, chunks).await;
    let dump = || serde_json::to_string_pretty(&trace).unwrap_or_default();

    let request = spans_named(&trace, "POST /v1/completions");
    assert_eq!(request.len(), 1, "{}", dump());
    let request = request[0];
    assert_eq!(service_of(&trace, request), "duet-router");
    assert_eq!(
        parent_of(request),
        Some(client_span),
        "continues the client's span"
    );
    let request_id = request["spanID"].as_str().unwrap_or_default();
    // Named by the OpenTelemetry conventions for HTTP servers and generative AI.
    for (key, want) in [
        ("http.request.method", json!("POST")),
        ("http.route", json!("/v1/completions")),
        ("http.response.status_code", json!(200)),
        ("gen_ai.operation.name", json!("text_completion")),
        ("gen_ai.request.model", v["model"].clone()),
        ("gen_ai.response.model", v["model"].clone()),
        ("gen_ai.response.id", v["id"].clone()),
        ("gen_ai.request.max_tokens", json!(4)),
        ("gen_ai.request.temperature", json!(0)),
        ("gen_ai.usage.input_tokens", json!(prompt.len())),
        ("gen_ai.usage.output_tokens", json!(4)),
    ] {
        assert_eq!(tag(request, key), Some(&want), "{key}: {request}");
    }
    let reasons = tag(request, "gen_ai.response.finish_reasons").and_then(Value::as_str);
    assert!(
        reasons.is_some_and(|r| r.contains("length")),
        "finish reasons: {request}"
    );
    assert_tracestate_everywhere(&trace, &["duet-router", "duet-p0", "duet-d0"]);

    let prefill = spans_named(&trace, "prefill");
    assert_eq!(prefill.len(), 1, "{}", dump());
    assert_eq!(service_of(&trace, prefill[0]), "duet-p0");
    assert_eq!(parent_of(prefill[0]), Some(request_id));
    let prefill_id = prefill[0]["spanID"].as_str().unwrap_or_default();

    let chunk_spans = spans_named(&trace, "chunk");
    assert_eq!(chunk_spans.len(), chunks, "one span per prefill chunk");
    for s in &chunk_spans {
        assert_eq!(parent_of(s), Some(prefill_id));
    }
    let writes = spans_named(&trace, "kv_write");
    assert!(!writes.is_empty(), "{}", dump());
    for w in &writes {
        assert_eq!(parent_of(w), Some(prefill_id));
        let tags = w["tags"].as_array().cloned().unwrap_or_default();
        assert!(
            tags.iter()
                .any(|t| t["key"] == "backend" && t["value"] == "shm"),
            "{w}"
        );
        assert!(tags.iter().any(|t| t["key"] == "bytes"), "{w}");
    }
    let waits = spans_named(&trace, "bootstrap_wait");
    assert_eq!(waits.len(), 1);
    assert_eq!(service_of(&trace, waits[0]), "duet-p0");
    assert_eq!(parent_of(waits[0]), Some(request_id));
    assert_eq!(spans_named(&trace, "queue_wait").len(), 1);

    let decode = spans_named(&trace, "decode");
    assert_eq!(decode.len(), 1, "{}", dump());
    assert_eq!(service_of(&trace, decode[0]), "duet-d0");
    assert_eq!(parent_of(decode[0]), Some(request_id));
    let decode_id = decode[0]["spanID"].as_str().unwrap_or_default();
    for phase in ["prealloc", "transfer_wait", "decoding"] {
        let s = spans_named(&trace, phase);
        assert_eq!(s.len(), 1, "{phase}: {}", dump());
        assert_eq!(parent_of(s[0]), Some(decode_id), "{phase}");
    }
    let decoding = spans_named(&trace, "decoding")[0];
    let events: Vec<String> = decoding["logs"]
        .as_array()
        .map(|logs| {
            logs.iter()
                .flat_map(|l| l["fields"].as_array().cloned().unwrap_or_default())
                .filter(|f| f["key"] == "event")
                .filter_map(|f| f["value"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    assert!(events.iter().any(|e| e == "first token"), "{events:?}");
    assert!(events.iter().any(|e| e == "finished"), "{events:?}");

    // `duet trace` draws the same trace from the query API: a row per span, under its parent.
    let png = c.dir.path().join("trace.png");
    let query = format!("http://127.0.0.1:{}", jaeger.query);
    let out = duet(&[
        "trace",
        trace_id,
        "--jaeger",
        &query,
        "--png",
        path_str(&png),
    ])
    .await;
    assert!(out.status.success(), "{}", out.stderr);
    let span_count = trace["spans"].as_array().map_or(0, Vec::len);
    assert!(
        out.stdout
            .starts_with(&format!("trace {trace_id}: {span_count} spans, 3 services")),
        "{}",
        out.stdout
    );
    let rows: Vec<&str> = out.stdout.lines().skip(2).collect();
    assert_eq!(rows.len(), span_count, "{}", out.stdout);
    assert!(rows[0].contains("POST /v1/completions"), "{}", out.stdout);
    assert!(
        rows.iter()
            .any(|r| r.starts_with("duet-d0") && r.contains("    decoding")),
        "decoding two levels under the request: {}",
        out.stdout
    );
    let image = std::fs::read(&png).expect("the PNG");
    assert!(image.starts_with(b"\x89PNG"), "not a PNG");
    let missing = duet(&[
        "trace",
        "0123456789abcdef0123456789abcdef",
        "--jaeger",
        &query,
    ])
    .await;
    assert!(!missing.status.success());
    assert!(
        missing.stderr.contains("error: trace:"),
        "{}",
        missing.stderr
    );

    // The same request in the metrics: latency histograms on the router, pages on decode.
    let token = c.token();
    let router = duet_runtime::admin::client::metrics_text(
        c.admin("router"),
        &token,
        Duration::from_secs(3),
    )
    .await
    .expect("router metrics");
    for name in [
        "duet_router_ttft_seconds_bucket",
        "duet_router_itl_seconds_bucket",
        "duet_router_e2e_seconds_count",
    ] {
        assert!(
            router.contains(name),
            "{name} missing from the router's /metrics"
        );
    }
    let d0 =
        duet_runtime::admin::client::metrics_text(c.admin("d0"), &token, Duration::from_secs(3))
            .await
            .expect("d0 metrics");
    for name in [
        "duet_kv_pages_used",
        "duet_kv_pages_quarantined",
        "duet_transfer_latency_seconds_bucket",
        "duet_prealloc_queue",
    ] {
        assert!(d0.contains(name), "{name} missing from d0's /metrics");
    }
}

/// The nodes export over OTLP/gRPC when the standard variables say so: the only endpoint
/// they are given is Jaeger's gRPC receiver (the tiny model: what is checked is the
/// transport, and that the trace and its tracestate cross the nodes).
#[tokio::test(flavor = "multi_thread")]
async fn spans_go_over_otlp_grpc_when_the_environment_asks() {
    let jaeger = Jaeger::start().await;
    let c = ClusterDir::tiny(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        "disagg_threshold = 0\n",
    );
    let endpoint = format!("http://127.0.0.1:{}", jaeger.otlp_grpc);
    let _up = Running::start_env(
        &["up", "--config", path_str(&c.config)],
        "ready",
        &[
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_TRACES_SAMPLER", "always_on"),
        ],
    )
    .await;
    router_ready(c.http, 2).await;
    let trace_id = "5cf92f3577b34da6a3ce929d0e0e4737";
    let body = json!({"prompt": "traces over grpc", "max_tokens": 3, "temperature": 0,
                      "ignore_eos": true});
    let v = completion(c.http, &body, &format!("00-{trace_id}-00f067aa0ba902b7-01")).await;
    assert!(v["choices"][0]["text"].is_string(), "{v}");
    let trace = whole_trace(&jaeger, trace_id, 1).await;
    assert_eq!(spans_named(&trace, "POST /v1/completions").len(), 1);
    assert_tracestate_everywhere(&trace, &["duet-router", "duet-p0", "duet-d0"]);
}
