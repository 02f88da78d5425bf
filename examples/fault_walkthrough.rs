//! A walk through a fault: a stream is running when its decode worker actor is killed (as if
//! it crashed). The supervisor restarts the worker; the router continues the stream on it from
//! the tokens the client already has (prefill re-sends the prompt's KV it kept); the client
//! sees one uninterrupted answer. The tree before and after shows the restart.
//!
//! ```sh
//! cargo run --example fault_walkthrough
//! ```
//!
//! Against a running cluster the same kill is `duet kill d0/decode/worker`, and the tree is
//! `duet tree`.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use duet_runtime::admin::client::{self, Method};
use duet_runtime::tree::ActorInfo;

async fn worker(c: &common::Cluster) -> ActorInfo {
    let tree = client::call(
        c.admin("d0"),
        &c.token,
        Method::GET,
        "/v1/tree",
        None,
        Duration::from_secs(5),
    )
    .await
    .expect("d0's admin API");
    let root: ActorInfo = serde_json::from_value(tree["root"].clone()).expect("a tree");
    root.find("d0/decode/worker")
        .cloned()
        .expect("d0's decode worker")
}

#[tokio::main]
async fn main() {
    duet_runtime::telemetry::init_logs("error");
    // The real model: at its pace the stream is still running when the kill comes.
    let c = common::Cluster::start_real(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        "disagg_threshold = 0",
        2,
    )
    .await;
    let before = worker(&c).await;
    println!(
        "\nbefore: d0/decode/worker is {}, {} restarts",
        before.status, before.restarts
    );

    // A long stream, on its own thread (the example's client is plain blocking I/O).
    let received = Arc::new(AtomicUsize::new(0));
    let (addr, seen) = (c.http, received.clone());
    let client = std::thread::spawn(move || {
        let body = serde_json::json!({
            "model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 200,
            "ignore_eos": true, "temperature": 0, "stream": true,
        });
        let mut finish = None;
        common::stream(addr, "/v1/completions", &body, |event| {
            if event["choices"][0]["text"].is_string() {
                seen.fetch_add(1, Ordering::SeqCst);
            }
            if let Some(f) = event["choices"][0]["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
            if event["error"].is_object() {
                finish = Some(format!("error: {}", event["error"]));
            }
        })
        .expect("the stream");
        finish
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while received.load(Ordering::SeqCst) < 20 {
        assert!(Instant::now() < deadline, "the stream did not start");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!(
        "the client has {} tokens; killing d0/decode/worker",
        received.load(Ordering::SeqCst)
    );
    client::call(
        c.admin("d0"),
        &c.token,
        Method::POST,
        "/v1/actors/kill",
        Some(serde_json::json!({"path": "d0/decode/worker"})),
        Duration::from_secs(5),
    )
    .await
    .expect("the kill");
    let finish = client.join().expect("the client thread");
    let after = worker(&c).await;
    println!(
        "after: the stream ended with {finish:?} after {} tokens; d0/decode/worker is {}, {} restarts (last exit: {})",
        received.load(Ordering::SeqCst),
        after.status,
        after.restarts,
        after.last_exit.as_deref().unwrap_or("-")
    );
    // The router's own count says the stream moved (a kill after the last token would not).
    let metrics = client::metrics_text(c.admin("router"), &c.token, Duration::from_secs(5))
        .await
        .expect("the router's metrics");
    let migrations: f64 = metrics
        .lines()
        .find(|l| l.starts_with("duet_router_migrations_total"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0);
    println!("the router continued {migrations} stream(s) on the restarted worker");
    assert_eq!(
        finish.as_deref(),
        Some("length"),
        "the stream did not survive"
    );
    assert_eq!(
        received.load(Ordering::SeqCst),
        200,
        "tokens were lost or repeated"
    );
    assert!(migrations >= 1.0, "the kill came after the stream ended");
    assert!(
        after.restarts > before.restarts,
        "the worker was not restarted"
    );
}
