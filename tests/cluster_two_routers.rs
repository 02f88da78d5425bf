//! Two routers serve the same workers (the tiny model, real processes under `duet up`): while
//! the official `openai` client streams through both, each router in turn is killed (SIGKILL).
//! The other keeps serving throughout, and the client, with its default retries, sees no
//! request fail before its stream started (`duet up` brings the killed router back within
//! those retries); a stream cut by its own router's death is the only failure allowed.

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

#[tokio::test(flavor = "multi_thread")]
async fn either_router_dies_and_the_other_serves_with_no_failed_start() {
    let python = openai_python().await;
    let mut c = ClusterDir::new(
        &[
            ("r0", "router"),
            ("r1", "router"),
            ("p0", "prefill"),
            ("d0", "decode"),
        ],
        "",
    );
    // r0 serves on the folder's HTTP port, r1 on another one no node uses.
    let a = c.http;
    let b = loop {
        let p = free_ports(1)[0];
        if p != a && c.nodes.iter().all(|n| n.2 != p) {
            break p;
        }
    };
    let serving = format!(
        "[serving]\nmodel = \"tiny.gguf\"\nmodel_name = \"tiny\"\nhttp = \"127.0.0.1:{a}\"\n\
         kv_pages = 64\ndisagg_threshold = 0\n\
         [serving.node.r1]\nhttp = \"127.0.0.1:{b}\"\n"
    );
    c.config = c.write("cluster.toml", &serving);
    let _up = Running::up(&c.config).await;
    router_ready(a, 2).await;
    router_ready(b, 2).await;
    let token = c.token();

    let stop = c.dir.path().join("stop");
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/openai_two_routers.py");
    let load = tokio::process::Command::new(&python)
        .arg(script)
        .args([
            format!("http://127.0.0.1:{a}"),
            format!("http://127.0.0.1:{b}"),
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

    for (dead, alive, alive_port) in [("r1", "r0", a), ("r0", "r1", b)] {
        tokio::time::sleep(Duration::from_secs(3)).await; // load runs before the kill
        let before = pid(&c, &token, dead).await.expect("the router's pid");
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(before),
            nix::sys::signal::Signal::SIGKILL,
        );
        // The other router serves while this one is gone.
        for i in 0..3 {
            let body = json!({"prompt": format!("while {dead} is down {i}"), "max_tokens": 4,
                              "temperature": 0});
            let answer = complete(alive_port, body).await;
            assert!(answer.is_ok(), "{alive} while {dead} is down: {answer:?}");
        }
        // And the dead one comes back (a new process) under `duet up`.
        poll(&format!("{dead} back"), Duration::from_secs(30), || {
            let (c, token) = (&c, &token);
            async move { pid(c, token, dead).await.filter(|p| *p != before) }
        })
        .await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await; // load on both again
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
    eprintln!("two routers, each killed once: {report}");
    for router in ["a", "b"] {
        let r = &report[router];
        assert_eq!(r["failed_before_stream"], 0, "{report}");
        assert!(r["completed"].as_u64() >= Some(5), "{report}");
        // A stream dies with its router at most once per kill, per client.
        assert!(r["failed_mid_stream"].as_u64() <= Some(2), "{report}");
    }
}
