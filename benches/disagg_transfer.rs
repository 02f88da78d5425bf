//! Exposed transfer: how much of the KV transfer is left over once prefill's last chunk has
//! computed, on a real cluster (router, prefill, decode processes on loopback) serving the
//! real model. `cargo bench --bench disagg_transfer`.
//!
//! For each backend it sends prompts of 8 chunks (distinct, so no cache helps), one at a time,
//! and reads prefill's metrics: the time spent writing each request's KV (all its writes and
//! the final fence, mostly hidden behind the next chunk's compute), the exposed part (from the
//! end of the last chunk's compute to decode holding the complete KV), and the prefill time.

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::*;
use duet_engine::Model;
use duet_fetch as fetch;
use serde_json::json;

const CHUNK: usize = 256;
const CHUNKS: usize = 8;
const REQUESTS: usize = 4;

/// Sum and count of a summary in a metrics text.
fn summary(text: &str, name: &str) -> (f64, f64) {
    let value = |suffix: &str| {
        text.lines()
            .filter(|l| l.starts_with(&format!("{name}{suffix}")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    (value("_sum"), value("_count"))
}

async fn run(backend: &str, model_path: &std::path::Path, prompts: &[Vec<u32>]) {
    let http = free_ports(1)[0];
    let extra = format!(
        "[serving]\nmodel = \"{}\"\nhttp = \"127.0.0.1:{http}\"\nkv_pages = 640\n\
         max_batch_tokens = {CHUNK}\ndisagg_threshold = 0\nkv_transport = \"{backend}\"\n",
        model_path.display()
    );
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        &extra,
    );
    let _up = Running::up(&c.config).await;
    let token = c.token();
    router_ready(http, 2).await;
    for p in prompts {
        let body = json!({"model": "SmolLM2-135M-Instruct", "prompt": p, "max_tokens": 1, "temperature": 0});
        let out = tokio::process::Command::new("curl")
            .args([
                "-s",
                "--max-time",
                "600",
                "-H",
                "content-type: application/json",
            ])
            .arg("-d")
            .arg(body.to_string())
            .arg(format!("http://127.0.0.1:{http}/v1/completions"))
            .output()
            .await
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("\"choices\""), "{text}");
    }
    let text =
        duet_runtime::admin::client::metrics_text(c.admin("p0"), &token, Duration::from_secs(3))
            .await
            .expect("metrics");
    let (exposed, n) = summary(&text, "duet_transfer_exposed_seconds");
    let (write, _) = summary(&text, "duet_transfer_write_seconds");
    let (prefill, _) = summary(&text, "duet_prefill_seconds");
    let bytes = metric(c.admin("p0"), &token, "duet_kv_bytes_sent_total", "").await;
    let d0 =
        duet_runtime::admin::client::metrics_text(c.admin("d0"), &token, Duration::from_secs(3))
            .await
            .expect("metrics");
    let (verify, _) = summary(&d0, "duet_kv_verify_seconds");
    let n = n.max(1.0);
    println!(
        "  {backend:<4} {:>6.1} MB/request  prefill {:>7.1} ms  writing {:>6.2} ms ({:.2} GB/s)  \
         exposed {:>6.3} ms = {:>5.1}% of the writing, {:.3}% of the prefill; \
         decode's checksum check {:.2} ms ({:.1} GB/s)",
        bytes / n / 1e6,
        prefill / n * 1e3,
        write / n * 1e3,
        bytes / write.max(1e-9) / 1e9,
        exposed / n * 1e3,
        100.0 * exposed / write.max(1e-9),
        100.0 * exposed / prefill.max(1e-9),
        verify / n * 1e3,
        bytes / verify.max(1e-9) / 1e9,
    );
}

#[tokio::main]
async fn main() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(fetch::MODEL_FILE);
    let path = fetch::ensure_model(&path, &mut |_| {}).expect("the real model");
    let model = Model::open(&path).expect("model");
    let text = "Disaggregated serving moves the prompt's KV cache from the prefill worker to the \
                decode worker; the cost that matters is the part the client waits for. ";
    let ids = model.tokenizer.encode(&text.repeat(200));
    let len = CHUNK * CHUNKS;
    // Distinct prompts: each starts with a different token, so no prefix cache helps.
    let prompts: Vec<Vec<u32>> = (0..REQUESTS)
        .map(|i| {
            let mut p = ids[i * 7..i * 7 + len].to_vec();
            p[0] = 1000 + i as u32;
            p
        })
        .collect();
    println!(
        "Exposed KV transfer, prompts of {CHUNKS} chunks x {CHUNK} tokens, {REQUESTS} requests per backend:"
    );
    for backend in ["shm", "tcp"] {
        run(backend, &path, &prompts).await;
    }
}
