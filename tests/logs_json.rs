//! `log_format = "json"`: every log line of a node is one JSON object, and a line about a
//! request carries the request id (from the span it belongs to).

mod common;

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};

#[tokio::test(flavor = "multi_thread")]
async fn json_log_lines_carry_the_request() {
    let c = ClusterDir::new(
        &[("router", "router"), ("d0", "decode")],
        "[telemetry]\nlog_format = \"json\"\n",
    );
    c.credentials(&c.config).await;
    let _router = Running::node(&c.config, "router").await;
    let mut d0 = tokio::process::Command::new(duet_bin())
        .args(["node", "--config", path_str(&c.config), "--name", "d0"])
        .env("DUET_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn d0");
    let lines = Arc::new(Mutex::new(Vec::<String>::new()));
    {
        let lines = lines.clone();
        let mut stderr = BufReader::new(d0.stderr.take().expect("stderr")).lines();
        tokio::spawn(async move {
            while let Ok(Some(l)) = stderr.next_line().await {
                lines.lock().expect("lines").push(l);
            }
        });
    }
    let http = c.http;
    router_ready(http, 1).await;
    let out = tokio::process::Command::new("curl")
        .args([
            "-s",
            "--max-time",
            "30",
            "-H",
            "content-type: application/json",
            "-d",
        ])
        .arg(
            with_model(
                http,
                &serde_json::json!({"prompt": [1, 2, 3], "max_tokens": 2}),
            )
            .to_string(),
        )
        .arg(format!("http://127.0.0.1:{http}/v1/completions"))
        .output()
        .await
        .expect("curl");
    let reply: Value = serde_json::from_slice(&out.stdout).expect("a JSON reply");
    assert!(reply["choices"][0]["text"].is_string(), "{reply}");
    let line = poll(
        "d0's line about the request",
        Duration::from_secs(10),
        || {
            let lines = lines.clone();
            async move {
                let lines = lines.lock().ok()?;
                lines.iter().find(|l| l.contains("first token")).cloned()
            }
        },
    )
    .await;
    let v: Value = serde_json::from_str(&line).expect("a JSON object");
    assert_eq!(v["fields"]["message"], "first token", "{v}");
    assert!(
        v["span"]["request"].as_u64().is_some(),
        "the line names its request: {v}"
    );
    let _ = d0.start_kill();
    // Every line the node printed is JSON.
    for l in lines.lock().expect("lines").iter() {
        assert!(serde_json::from_str::<Value>(l).is_ok(), "not JSON: {l}");
    }
}
