//! Nodes that cluster.toml does not list join a live cluster (the tiny model, real processes):
//! `duet node --name d7 --role decode --address IP:PORT` dials the file's nodes with the
//! cluster credentials and is admitted by each; a second joiner (p7, prefill) learns of d7 from
//! the members' heartbeats (no central registry) and links to it; both appear in every
//! member's membership and in `duet tree`, and take traffic: with the file's workers drained,
//! requests run p7 -> d7 and answer what they answered before; `duet drain` and `duet resume`
//! find them by name. A joiner with the wrong token is refused and never becomes a member.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};

async fn one_request(http: u16, i: usize) -> Result<String, String> {
    complete(
        http,
        json!({"prompt": format!("join test {}", i % 3), "max_tokens": 4, "ignore_eos": true,
               "temperature": 0}),
    )
    .await
}

/// A port no node of the file uses.
fn spare_port(c: &ClusterDir, taken: &[u16]) -> u16 {
    loop {
        let p = free_ports(1)[0];
        if p != c.http && c.nodes.iter().all(|n| n.2 != p) && !taken.contains(&p) {
            return p;
        }
    }
}

/// `duet node` for a node outside the file, until it reports ready.
async fn join(config: &std::path::Path, name: &str, role: &str, port: u16) -> Running {
    let address = format!("127.0.0.1:{port}");
    Running::start(
        &[
            "node",
            "--config",
            path_str(config),
            "--name",
            name,
            "--role",
            role,
            "--address",
            &address,
        ],
        duet_runtime::node::READY_MARKER,
    )
    .await
}

/// Whether `node` (at `admin`) sees `peer` up.
async fn sees_up(admin: std::net::SocketAddr, token: &str, peer: &str) -> Option<()> {
    (peer_state(admin, token, peer).await? == "up").then_some(())
}

#[tokio::test(flavor = "multi_thread")]
async fn nodes_outside_the_file_join_spread_and_take_traffic() {
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        "",
    );
    let serving = c.tiny_serving("disagg_threshold = 0\n");
    let config = c.write("cluster.toml", &serving);
    let _up = Running::up(&config).await;
    router_ready(c.http, 2).await;
    let token = c.token();
    let before: Vec<String> = {
        let mut v = Vec::new();
        for i in 0..3 {
            v.push(
                one_request(c.http, i)
                    .await
                    .expect("an answer from the file's nodes"),
            );
        }
        v
    };

    // d7 joins: every node of the file admits it, the router routes to it.
    let d7_port = spare_port(&c, &[]);
    let _d7 = join(&config, "d7", "decode", d7_port).await;
    let d7_admin: std::net::SocketAddr = ([127, 0, 0, 1], d7_port).into();
    for node in ["router", "p0", "d0"] {
        poll(
            &format!("{node} sees d7 up"),
            Duration::from_secs(20),
            || sees_up(c.admin(node), &token, "d7"),
        )
        .await;
    }
    router_ready(c.http, 3).await;

    // p7 joins too, and links to d7 without anyone listing it: the members' heartbeats carry
    // the nodes that joined.
    let p7_port = spare_port(&c, &[d7_port]);
    let _p7 = join(&config, "p7", "prefill", p7_port).await;
    let p7_admin: std::net::SocketAddr = ([127, 0, 0, 1], p7_port).into();
    poll("p7 sees d7 up", Duration::from_secs(20), || {
        sees_up(p7_admin, &token, "d7")
    })
    .await;
    poll("d7 sees p7 up", Duration::from_secs(20), || {
        sees_up(d7_admin, &token, "p7")
    })
    .await;
    router_ready(c.http, 4).await;
    let membership = admin_get(c.admin("router"), &token, "/v1/membership")
        .await
        .expect("the router's membership");
    let joined: Vec<&str> = membership["joined"]
        .as_array()
        .map(|a| a.iter().filter_map(|n| n["name"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(joined, ["d7", "p7"], "{membership}");

    // `duet tree` shows them.
    let tree = tree_json(&config).await;
    let names: Vec<&str> = tree
        .as_array()
        .map(|a| a.iter().filter_map(|n| n["node"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(names, ["router", "p0", "d0", "d7", "p7"], "{tree}");
    let d7_tree = tree
        .as_array()
        .and_then(|a| a.iter().find(|n| n["node"] == "d7"))
        .expect("d7 in the tree");
    assert_eq!(d7_tree["status"], "up", "{d7_tree}");

    // With the file's workers drained, the joined ones serve everything, same answers.
    for node in ["p0", "d0"] {
        let out = duet(&["drain", "--config", path_str(&config), node, "--wait", "30"]).await;
        assert!(out.status.success(), "drain {node}: {}", out.stderr);
    }
    let p7_before = metric(p7_admin, &token, "duet_prefill_seconds_count", "").await;
    // The router learns of the drain through the next load report.
    poll(
        "the router to stop choosing the drained workers",
        Duration::from_secs(10),
        || async {
            let v: Value = ready_json(c.http).await?;
            (v["workers"].as_u64() == Some(2)).then_some(())
        },
    )
    .await;
    for i in 0..6 {
        assert_eq!(
            one_request(c.http, i).await.as_deref(),
            Ok(before[i % 3].as_str()),
            "request {i} through p7 and d7"
        );
    }
    let served = metric(
        d7_admin,
        &token,
        "duet_transfers_total",
        "outcome=\"completed\"",
    )
    .await;
    assert!(served >= 6.0, "d7 completed {served} transfers");
    let p7_after = metric(p7_admin, &token, "duet_prefill_seconds_count", "").await;
    assert!(
        p7_after >= p7_before + 6.0,
        "p7 prefilled {p7_before} -> {p7_after}"
    );

    // The admin commands find a joined node by name.
    let out = duet(&["drain", "--config", path_str(&config), "d7", "--wait", "30"]).await;
    assert!(out.status.success(), "drain d7: {}", out.stderr);
    assert!(out.stdout.contains("d7: drained"), "{}", out.stdout);
    let out = duet(&["resume", "--config", path_str(&config), "d7"]).await;
    assert!(out.status.success(), "resume d7: {}", out.stderr);

    // A joiner with the wrong token is refused, and never a member.
    let wrong = c.wrong_token(&serving);
    let x_port = spare_port(&c, &[d7_port, p7_port]);
    let _x = join(&wrong, "x9", "decode", x_port).await;
    handshake_refused(c.admin("router"), &token, "token").await;
    let membership = admin_get(c.admin("router"), &token, "/v1/membership")
        .await
        .expect("the router's membership");
    assert!(membership["peers"].get("x9").is_none(), "{membership}");
}

/// The router's `/ready` answer.
async fn ready_json(http: u16) -> Option<Value> {
    let out = tokio::process::Command::new("curl")
        .args(["-s", &format!("http://127.0.0.1:{http}/ready")])
        .output()
        .await
        .ok()?;
    serde_json::from_slice(&out.stdout).ok()
}

/// A file that names its nodes by DNS (as a Kubernetes chart does, one stable name per pod):
/// each node binds what its name resolves to, peers resolve the names at every dial, and the
/// cluster serves.
#[tokio::test(flavor = "multi_thread")]
async fn nodes_named_by_dns_serve() {
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        "",
    );
    let mut text = format!(
        "[cluster]\nname = \"test\"\n[serving]\nmodel = \"tiny.gguf\"\nmodel_name = \"tiny\"\n\
         http = \"127.0.0.1:{}\"\nkv_pages = 32\ndisagg_threshold = 0\n",
        c.http
    );
    for (name, role, port) in &c.nodes {
        text.push_str(&format!(
            "[[node]]\nname = \"{name}\"\nrole = \"{role}\"\naddress = \"localhost:{port}\"\n"
        ));
    }
    let config = c.dir.path().join("dns.toml");
    std::fs::write(&config, text).expect("write the file");
    let _up = Running::up(&config).await;
    router_ready(c.http, 2).await;
    let answer = one_request(c.http, 0).await;
    assert!(answer.is_ok(), "{answer:?}");
    let token = c.token();
    let links = admin_get(c.admin("router"), &token, "/v1/membership")
        .await
        .expect("membership");
    for peer in ["p0", "d0"] {
        assert_eq!(links["peers"][peer]["state"], "up", "{links}");
    }
}
