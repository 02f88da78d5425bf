//! `duet drain NODE` and `duet resume NODE` on a live cluster (the tiny model, real processes):
//! a drained decode worker gets no new request while the other serves everything, says when it
//! is empty, shows as draining in `duet tree`, and takes traffic again after a resume; a
//! drained router answers 503 and is not ready; the calls need the token and name the node.

mod common;

use std::time::Duration;

use common::*;
use duet_runtime::admin::client::{self, Method};
use serde_json::json;

/// Requests decode worker `node` received through a transfer (every request here is
/// disaggregated: `disagg_threshold = 0`).
async fn served_by(c: &ClusterDir, token: &str, node: &str) -> f64 {
    metric(
        c.admin(node),
        token,
        "duet_transfers_total",
        "outcome=\"completed\"",
    )
    .await
}

async fn one_request(http: u16, i: usize) -> Result<String, String> {
    complete(
        http,
        json!({"prompt": format!("drain test {i}"), "max_tokens": 4, "ignore_eos": true,
               "temperature": 0}),
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_drained_worker_takes_nothing_new_until_resumed() {
    let c = ClusterDir::tiny(
        &[
            ("router", "router"),
            ("p0", "prefill"),
            ("d0", "decode"),
            ("d1", "decode"),
        ],
        "disagg_threshold = 0\n",
    );
    let http = c.http;
    let _up = Running::up(&c.config).await;
    router_ready(http, 3).await;
    let token = c.token();
    let config = path_str(&c.config);

    let out = duet(&["drain", "--config", config, "d0", "--wait", "30"]).await;
    assert!(out.status.success(), "duet drain: {}", out.stderr);
    assert!(
        out.stdout.contains("d0: drained: holds no request"),
        "{}",
        out.stdout
    );
    let tree = tree_json(&c.config).await;
    let d0 = tree
        .as_array()
        .and_then(|nodes| nodes.iter().find(|n| n["node"] == "d0"))
        .expect("d0 in the tree");
    assert_eq!(d0["status"], "draining", "{d0}");
    router_ready(http, 2).await; // d0 left the router's choices
    // The probe the Kubernetes chart uses: d0 is not ready (draining) but alive; d1 is ready.
    let out = duet(&["status", "--config", config, "d0"]).await;
    assert!(
        !out.status.success() && out.stdout.contains("d0: drain"),
        "{}",
        out.stdout
    );
    let out = duet(&["status", "--config", config, "--alive", "d0"]).await;
    assert!(out.status.success(), "{}{}", out.stdout, out.stderr);
    let out = duet(&["status", "--config", config, "d1"]).await;
    assert!(
        out.status.success() && out.stdout.contains("ready (sees router up)"),
        "{}{}",
        out.stdout,
        out.stderr
    );

    let (d0_before, d1_before) = (
        served_by(&c, &token, "d0").await,
        served_by(&c, &token, "d1").await,
    );
    for i in 0..6 {
        assert!(one_request(http, i).await.is_ok(), "request {i}");
    }
    assert_eq!(
        served_by(&c, &token, "d0").await,
        d0_before,
        "d0 got a request"
    );
    assert_eq!(served_by(&c, &token, "d1").await - d1_before, 6.0);

    let out = duet(&["resume", "--config", config, "d0"]).await;
    assert!(out.status.success(), "duet resume: {}", out.stderr);
    assert!(out.stdout.contains("d0: taking requests"), "{}", out.stdout);
    router_ready(http, 3).await;
    let mut i = 100;
    poll("d0 serving again", Duration::from_secs(30), || {
        i += 1;
        let c = &c;
        let token = &token;
        async move {
            assert!(one_request(http, i).await.is_ok(), "request {i}");
            (served_by(c, token, "d0").await > d0_before).then_some(())
        }
    })
    .await;

    // A drained router: not ready, new requests get 503; resumed, it serves again.
    let out = duet(&["drain", "--config", config, "router"]).await;
    assert!(out.status.success(), "{}", out.stderr);
    let refused = one_request(http, 200)
        .await
        .expect_err("a draining router refuses");
    assert!(refused.starts_with("HTTP 503"), "{refused}");
    let out = duet(&["resume", "--config", config, "router"]).await;
    assert!(out.status.success(), "{}", out.stderr);
    assert!(one_request(http, 201).await.is_ok());

    // The calls need the token, and an unknown node is named with the nearest ones.
    let denied = client::call(
        c.admin("d0"),
        "not-the-token",
        Method::POST,
        "/v1/drain",
        None,
        Duration::from_secs(3),
    )
    .await;
    assert!(denied.is_err(), "a drain without the token was accepted");
    let out = duet(&["drain", "--config", config, "d9"]).await;
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("no node `d9`") && out.stderr.contains("d0"),
        "{}",
        out.stderr
    );
}
