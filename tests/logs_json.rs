//! Logs: with `log_format = "json"` every line of a node is one JSON object and a line about
//! a request carries the request id (from the span it belongs to); the router's access log
//! has one line per HTTP request, and none with `access_log = false`.

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
    // The per-request events of the workers are debug (the router's access log has the info
    // line).
    let (mut d0, lines) = node_capturing(&c.config, "d0", "info,duet_actors=debug");
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

/// Starts node `name` with `DUET_LOG=filter`, collecting its stderr lines.
fn node_capturing(
    config: &std::path::Path,
    name: &str,
    filter: &str,
) -> (tokio::process::Child, Arc<Mutex<Vec<String>>>) {
    let mut child = tokio::process::Command::new(duet_bin())
        .args(["node", "--config", path_str(config), "--name", name])
        .env("DUET_LOG", filter)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn node");
    let lines = Arc::new(Mutex::new(Vec::<String>::new()));
    let theirs = lines.clone();
    let mut stderr = BufReader::new(child.stderr.take().expect("stderr")).lines();
    tokio::spawn(async move {
        while let Ok(Some(l)) = stderr.next_line().await {
            theirs.lock().expect("lines").push(l);
        }
    });
    (child, lines)
}

async fn curl(args: &[&str]) -> String {
    let out = tokio::process::Command::new("curl")
        .args(["-s", "--max-time", "30"])
        .args(args)
        .output()
        .await
        .expect("curl");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_router_logs_one_access_line_per_request_unless_turned_off() {
    for on in [true, false] {
        let extra = if on { "" } else { "access_log = false\n" };
        let c = ClusterDir::new(&[("router", "router"), ("d0", "decode")], extra);
        c.credentials(&c.config).await;
        // Debug for the router's own per-request event ("first token"), written before the
        // access line of its request would be: the proof, with the log off, that no line
        // was merely not read yet.
        let (_router, lines) = node_capturing(&c.config, "router", "info,duet_actors=debug");
        let _d0 = Running::node(&c.config, "d0").await;
        let http = c.http;
        router_ready(http, 1).await;
        let body = with_model(
            http,
            &serde_json::json!({"prompt": [1, 2, 3], "max_tokens": 2}),
        );
        let url = format!("http://127.0.0.1:{http}/v1/completions");
        let reply = curl(&[
            "-H",
            "content-type: application/json",
            "-d",
            &body.to_string(),
            &url,
        ])
        .await;
        assert!(reply.contains("\"choices\""), "{reply}");
        // A request refused at once (no model) and one for no endpoint.
        curl(&[
            "-H",
            "content-type: application/json",
            "-d",
            r#"{"prompt": "x"}"#,
            &url,
        ])
        .await;
        curl(&[&format!("http://127.0.0.1:{http}/v1/nothing")]).await;
        let access = |lines: &Arc<Mutex<Vec<String>>>| -> Vec<String> {
            lines
                .lock()
                .expect("lines")
                .iter()
                .filter(|l| l.contains("duet::access"))
                .cloned()
                .collect()
        };
        if !on {
            // A last request whose line, were the log on, would follow the others: once
            // /v1/models answered, every line before it has been written.
            curl(&[&format!("http://127.0.0.1:{http}/v1/models")]).await;
            let all = lines.lock().expect("lines").join("\n");
            assert!(
                access(&lines).is_empty(),
                "access lines with the log off:\n{all}"
            );
            continue;
        }
        let got = poll("three access lines", Duration::from_secs(10), || {
            let got = access(&lines);
            async move { (got.len() >= 3).then_some(got) }
        })
        .await;
        let ok = got
            .iter()
            .find(|l| l.contains("POST /v1/completions 200"))
            .unwrap_or_else(|| panic!("no line for the completion: {got:?}"));
        for field in [
            "status=200",
            "prompt_tokens=3",
            "completion_tokens=2",
            "ttft_ms=",
            "total_ms=",
            "finish_reason=",
            "request=",
        ] {
            assert!(ok.contains(field), "{field} missing: {ok}");
        }
        assert!(
            got.iter().any(|l| l.contains("POST /v1/completions 400")),
            "{got:?}"
        );
        assert!(
            got.iter().any(|l| l.contains("GET /v1/nothing 404")),
            "{got:?}"
        );
    }
}
