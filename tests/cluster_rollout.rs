//! `duet rollout` as a rolling upgrade under load (the tiny model, real processes under
//! `duet up`): the cluster starts as an older build (wire version 1 alone, through the
//! test-only `DUET_TEST_WIRE_VERSIONS`), the binary `duet up` runs is replaced on disk by this
//! build (versions 1 and 2: version 2 carries the tracestate), and the decode
//! nodes restart one by one through drain, restart, ready, resume. No request fails or is
//! answered differently; the new nodes talk version 2 to each other and version 1 to the old
//! router and prefill node. Then a build that shares no version with the cluster is rolled
//! out: its first node is refused by every peer (counted, named), the rollout stops there,
//! and the other decode node keeps serving.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use serde_json::{Value, json};
use tokio::process::Command;

const PROMPTS: usize = 4;

fn request(i: usize) -> Value {
    json!({"prompt": format!("rolling upgrade {}", i % PROMPTS), "max_tokens": 6,
           "ignore_eos": true, "temperature": 0})
}

/// The wire version node `node`'s link to `peer` uses.
async fn wire(c: &ClusterDir, token: &str, node: &str, peer: &str) -> Option<u64> {
    admin_get(c.admin(node), token, "/v1/membership").await?["links"][peer]["wire"].as_u64()
}

/// Which prompt a request sent, and its answer.
type Outcome = (usize, Result<String, String>);

/// Clients sending requests one after another until `stop`; every outcome.
fn load(
    http: u16,
    clients: usize,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Vec<Outcome>>> {
    (0..clients)
        .map(|k| {
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut outcomes = Vec::new();
                let mut i = k;
                while !stop.load(Ordering::SeqCst) {
                    outcomes.push((i % PROMPTS, complete(http, request(i)).await));
                    i += clients;
                }
                outcomes
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rolling_upgrade_of_the_decode_nodes_fails_no_request() {
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
    // `duet up` runs the binary at `bin`, which the upgrade replaces.
    let real = PathBuf::from(duet_bin());
    let bin = c.dir.path().join("duet");
    if std::fs::hard_link(&real, &bin).is_err() {
        std::fs::copy(&real, &bin).expect("copy the binary");
    }
    // The cluster starts as "an older build" that speaks wire version 1 alone (the nodes
    // inherit the variable; each later build sets its own).
    let mut up = Command::new(&bin);
    up.args(["up", "--config", path_str(&c.config)])
        .env(duet_runtime::wire::TEST_VERSIONS_ENV, "1-1");
    let _up = Running::spawn(up, "duet up", "ready").await;
    router_ready(http, 3).await;
    let token = c.token();
    let config = path_str(&c.config);

    // What each prompt answers before any change.
    let mut expected = Vec::new();
    for i in 0..PROMPTS {
        expected.push(complete(http, request(i)).await.expect("a first answer"));
    }
    assert_eq!(wire(&c, &token, "d0", "d1").await, Some(1));

    let stop = Arc::new(AtomicBool::new(false));
    let clients = load(http, 3, stop.clone());
    install_build(&bin, &real, "2");
    let out = duet(&[
        "rollout", "--config", config, "--role", "decode", "--wait", "60",
    ])
    .await;
    eprintln!("{}", out.stdout);
    assert!(out.status.success(), "duet rollout: {}", out.stderr);
    for node in ["[1/2] d0: drained", "[2/2] d1: drained"] {
        assert!(out.stdout.contains(node), "{}", out.stdout);
    }
    // Both decode nodes are the new build: version 2 between them, 1 with the old nodes.
    let seen = |node: &'static str, peer: &'static str, v: u64| {
        let (c, token) = (&c, &token);
        async move {
            poll(
                &format!("{node}'s link to {peer} on wire version {v}"),
                Duration::from_secs(20),
                || async move { (wire(c, token, node, peer).await == Some(v)).then_some(()) },
            )
            .await
        }
    };
    seen("d0", "d1", 2).await;
    seen("d1", "d0", 2).await;
    seen("d0", "router", 1).await;
    seen("router", "d1", 1).await;
    seen("p0", "d0", 1).await;
    // Traffic after the upgrade reaches both new decode nodes, through the old prefill node.
    let before: Vec<f64> = transfers_completed(&c, &token).await;
    for i in 0..8 {
        assert_eq!(
            complete(http, request(i)).await.as_deref(),
            Ok(expected[i % PROMPTS].as_str())
        );
    }

    // A build that shares no wire version with the cluster: refused, and the rollout stops.
    let refusals = |node: &'static str| {
        let (c, token) = (&c, &token);
        async move {
            metric(
                c.admin(node),
                token,
                "duet_link_handshake_failures_total",
                "reason=\"version\"",
            )
            .await
        }
    };
    let refused_before = refusals("router").await;
    install_build(&bin, &real, "3-3");
    let out = duet(&[
        "rollout", "--config", config, "--role", "decode", "--wait", "15",
    ])
    .await;
    eprintln!("{}", out.stderr);
    assert!(!out.status.success(), "{}", out.stdout);
    assert!(
        out.stderr.contains("stopped at d0") && out.stderr.contains("routers to see each other"),
        "{}",
        out.stderr
    );
    assert!(refusals("router").await > refused_before);
    // d1 was not touched and serves alone.
    let served: Vec<f64> = transfers_completed(&c, &token).await;
    assert!(
        served[1] > before[1],
        "d1 served after the upgrade: {before:?} -> {served:?}"
    );
    for i in 0..4 {
        assert_eq!(
            complete(http, request(i)).await.as_deref(),
            Ok(expected[i % PROMPTS].as_str())
        );
    }

    stop.store(true, Ordering::SeqCst);
    let mut outcomes = Vec::new();
    for client in clients {
        outcomes.extend(client.await.expect("a client"));
    }
    let failed: Vec<&Outcome> = outcomes.iter().filter(|(_, r)| r.is_err()).collect();
    let wrong = outcomes
        .iter()
        .filter(|(p, r)| r.as_ref().is_ok_and(|t| *t != expected[*p]))
        .count();
    eprintln!(
        "rolling upgrade under load: {} requests, {} failed, {} answered differently",
        outcomes.len(),
        failed.len(),
        wrong
    );
    assert!(outcomes.len() >= 10, "the load ran: {}", outcomes.len());
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    assert_eq!(wrong, 0);
}

/// Completed transfers on d0 and d1.
async fn transfers_completed(c: &ClusterDir, token: &str) -> Vec<f64> {
    let mut v = Vec::new();
    for node in ["d0", "d1"] {
        v.push(
            metric(
                c.admin(node),
                token,
                "duet_transfers_total",
                "outcome=\"completed\"",
            )
            .await,
        );
    }
    v
}
