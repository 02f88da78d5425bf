//! Fault scenarios of issue 8 on real processes with the real model: graceful drain under
//! load, a storm of cancellations, a prefill node stopped past its heartbeat deadline.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::*;
use duet_engine::fetch;
use serde_json::{Value, json};

fn real_model() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(fetch::MODEL_FILE);
    fetch::ensure_model(&path, &mut |_| {}).expect("the real model (duet fetch-model)")
}

fn serving(http: u16, extra: &str) -> String {
    format!(
        "[serving]\nmodel = \"{}\"\nhttp = \"127.0.0.1:{http}\"\nkv_pages = 256\n\
         max_batch_tokens = 32\ndisagg_threshold = 16\nrequest_timeout_secs = 60\n{extra}",
        real_model().display()
    )
}

/// A prompt of a few hundred tokens (several prefill chunks).
fn long_prompt(salt: usize) -> String {
    format!(
        "Request {salt}. The history of computing is a story of layers: transistors make gates, \
         gates make adders and memories, and those make processors that run compilers. "
    )
    .repeat(8)
}

/// One completion through curl: `Ok(text)` on HTTP 200, `Err(status and body)` otherwise.
async fn complete(http: u16, body: Value) -> Result<String, String> {
    let out = tokio::process::Command::new("curl")
        .args(["-s", "--max-time", "120", "-w", "\n%{http_code}", "-H"])
        .arg("content-type: application/json")
        .arg("-d")
        .arg(body.to_string())
        .arg(format!("http://127.0.0.1:{http}/v1/completions"))
        .output()
        .await
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (json_text, code) = text.rsplit_once('\n').unwrap_or((&text, "0"));
    let v: Value = serde_json::from_str(json_text).unwrap_or(Value::Null);
    match code.trim() {
        "200" => Ok(v["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string()),
        other => Err(format!("HTTP {other}: {json_text}")),
    }
}

/// SIGTERM on a prefill node under load (issue 8, test 11): the routers stop sending it new
/// requests, it finishes the ones it holds (no retry was needed for any of them), exits 0,
/// and no request fails.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_on_a_prefill_node_under_load_fails_nothing() {
    let http = free_ports(1)[0];
    let c = ClusterDir::new(
        &[
            ("router", "router"),
            ("p0", "prefill"),
            ("p1", "prefill"),
            ("d0", "decode"),
        ],
        &serving(http, "shutdown_drain_secs = 30\n"),
    );
    c.credentials(&c.config).await;
    let mut nodes = Vec::new();
    for name in ["router", "p0", "d0"] {
        nodes.push(Running::node(&c.config, name).await);
    }
    let p1 = Running::node(&c.config, "p1").await;
    router_ready(http, 3).await;
    let token = c.token();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = Vec::new();
    for client in 0..4 {
        let stop = stop.clone();
        clients.push(tokio::spawn(async move {
            let mut results = Vec::new();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let body = json!({"prompt": long_prompt(client * 1000 + i), "max_tokens": 4,
                                  "temperature": 0});
                results.push(complete(http, body).await);
                i += 1;
            }
            results
        }));
    }
    // Signal p1 while it is computing a prompt.
    poll("p1 prefilling", Duration::from_secs(60), || async {
        (metric(c.admin("p1"), &token, "duet_sequences_running", "").await >= 1.0).then_some(())
    })
    .await;
    let served_before = metric(c.admin("p1"), &token, "duet_prefill_chunks_total", "").await;
    let started = std::time::Instant::now();
    let status = p1.terminate().await;
    let drain_took = started.elapsed();
    assert!(status.success(), "p1 exited with {status}");
    // The rest of the load runs on p0 alone.
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut results = Vec::new();
    for c in clients {
        results.extend(c.await.expect("client"));
    }
    let failed: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        failed.is_empty(),
        "{} of {} failed: {failed:?}",
        failed.len(),
        results.len()
    );
    assert!(results.len() >= 6, "too little load: {}", results.len());
    let retried = metric(c.admin("router"), &token, "duet_router_retries_total", "").await;
    assert_eq!(
        retried, 0.0,
        "a request p1 held was retried elsewhere instead of finished on p1"
    );
    eprintln!(
        "p1 drained in {drain_took:?} after {served_before} chunks; {} requests, none failed",
        results.len()
    );
}
