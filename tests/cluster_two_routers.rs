//! Two routers serve the same workers from one address (the tiny model, real processes under
//! `duet up`): both bind the HTTP port with `http_reuse_port`, so the kernel spreads the
//! connections over the live ones. While the official `openai` client (its default retries)
//! streams through that address, each router in turn is killed (SIGKILL): the other serves
//! throughout, and no request fails before its stream started (a connection the dead router
//! held is retried by the client and lands on the live one); a stream cut by its own router's
//! death is the only failure allowed.

mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

/// The node's process id, from its admin API.
async fn pid(c: &ClusterDir, token: &str, node: &str) -> Option<i32> {
    admin_get(c.admin(node), token, "/v1/tree").await?["pid"]
        .as_u64()
        .and_then(|p| i32::try_from(p).ok())
}

/// Requests router `node` has taken since its process started.
async fn taken(c: &ClusterDir, token: &str, node: &str) -> f64 {
    metric(c.admin(node), token, "duet_router_requests_total", "").await
}

#[tokio::test(flavor = "multi_thread")]
async fn either_router_dies_and_the_other_serves_with_no_failed_start() {
    let python = openai_python().await;
    let c = ClusterDir::tiny(
        &[
            ("r0", "router"),
            ("r1", "router"),
            ("p0", "prefill"),
            ("d0", "decode"),
        ],
        "http_reuse_port = true\ndisagg_threshold = 0\n",
    );
    let http = c.http;
    let _up = Running::up(&c.config).await;
    router_ready(http, 2).await;
    let token = c.token();

    let stop = c.dir.path().join("stop");
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/openai_two_routers.py");
    let load = tokio::process::Command::new(&python)
        .arg(script)
        .args([
            format!("http://127.0.0.1:{http}"),
            "tiny".to_string(),
            "120".to_string(),
            stop.display().to_string(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the openai load");

    // Both routers take the shared address's connections.
    poll(
        "both routers taking requests",
        Duration::from_secs(30),
        || {
            let (c, token) = (&c, &token);
            async move {
                (taken(c, token, "r0").await > 0.0 && taken(c, token, "r1").await > 0.0)
                    .then_some(())
            }
        },
    )
    .await;
    for dead in ["r1", "r0"] {
        let before = pid(&c, &token, dead).await.expect("the router's pid");
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(before),
            nix::sys::signal::Signal::SIGKILL,
        );
        // The address keeps serving while this router is gone.
        for i in 0..3 {
            let body = json!({"prompt": format!("while {dead} is down {i}"), "max_tokens": 4,
                              "temperature": 0});
            let answer = complete(http, body).await;
            assert!(answer.is_ok(), "while {dead} is down: {answer:?}");
        }
        // And the dead one comes back (a new process) under `duet up`, taking requests again.
        poll(&format!("{dead} back"), Duration::from_secs(30), || {
            let (c, token) = (&c, &token);
            async move {
                let back = pid(c, token, dead).await.filter(|p| *p != before)?;
                (taken(c, token, dead).await > 0.0).then_some(back)
            }
        })
        .await;
    }
    std::fs::write(&stop, b"").expect("stop the load");
    let out = tokio::time::timeout(Duration::from_secs(90), load.wait_with_output())
        .await
        .expect("the load ends")
        .expect("the load's output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_str(stdout.trim()).expect("a JSON report");
    eprintln!("two routers on one address, each killed once: {report}");
    assert_eq!(report["failed_before_stream"], 0, "{report}");
    assert!(report["completed"].as_u64() >= Some(20), "{report}");
    // A stream dies with its router at most once per kill, per client.
    assert!(report["failed_mid_stream"].as_u64() <= Some(8), "{report}");
}
