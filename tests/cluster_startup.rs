//! `duet up` fails clearly: a bad config names file, line and key; a busy port names the node.

mod common;

use std::time::Duration;

use common::*;

#[tokio::test(flavor = "multi_thread")]
async fn bad_config_names_the_line_and_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("cluster.toml");
    std::fs::write(
        &path,
        "[[node]]\nname = \"a\"\nrole = \"router\"\naddress = \"127.0.0.1:notaport\"\n",
    )
    .expect("write");
    let out = duet(&["up", "--config", path_str(&path)]).await;
    assert_eq!(out.status.code(), Some(2));
    let expected = format!("{}:4: `node[0].address`", path.display());
    assert!(out.stderr.contains(&expected), "{}", out.stderr);
    assert!(out.stderr.contains("expected IP:PORT"), "{}", out.stderr);
}

#[tokio::test(flavor = "multi_thread")]
async fn busy_port_fails_the_start_and_names_the_node() {
    // p0's port, held by us for the whole test (a port another test took meanwhile is
    // busy for a while only: pick again until we hold one).
    let (c, _squatter) = poll("a port to squat", Duration::from_secs(30), || async {
        let c = ClusterDir::new(&[("router", "router"), ("p0", "prefill")], "");
        let squatter = std::net::UdpSocket::bind(("127.0.0.1", c.nodes[1].2)).ok()?;
        Some((c, squatter))
    })
    .await;
    // If p0 started after all, `duet up` would serve forever: bounded.
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        duet(&["up", "--config", path_str(&c.config)]),
    )
    .await
    .expect("`duet up` exits when a node cannot start");
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("error: node p0 failed to start"),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("address in use"), "{}", out.stderr);
    assert!(!out.stdout.contains("ready"), "{}", out.stdout);
    // The router that did start was stopped: its port is free again.
    let router_port = c.nodes[0].2;
    assert!(std::net::UdpSocket::bind(("127.0.0.1", router_port)).is_ok());
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_drains_every_node() {
    let c = ClusterDir::new(&[("router", "router"), ("p0", "prefill")], "");
    let up = Running::up(&c.config).await;
    let status = up.terminate().await;
    assert!(status.success(), "{status}");
    for (_, _, port) in &c.nodes {
        assert!(
            std::net::UdpSocket::bind(("127.0.0.1", *port)).is_ok(),
            "port {port} still bound"
        );
    }
}

/// Starts a tiny cluster with serving `keys` by `duet up` and `node` by `duet node`; both must
/// refuse at once (exit 2 for `up`, nothing ready, no panic). Their stderr.
async fn refused_at_start(keys: &str, node: &str) -> [String; 2] {
    let c = ClusterDir::tiny(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        keys,
    );
    let config = path_str(&c.config);
    let up = tokio::time::timeout(Duration::from_secs(60), duet(&["up", "--config", config]))
        .await
        .expect("`duet up` refuses at once");
    assert_eq!(up.status.code(), Some(2), "{}", up.stderr);
    assert!(!up.stdout.contains("ready"), "{}", up.stdout);
    let one = tokio::time::timeout(
        Duration::from_secs(60),
        duet(&["node", "--config", config, "--name", node]),
    )
    .await
    .expect("`duet node` refuses at once");
    assert!(!one.status.success());
    for out in [&up.stderr, &one.stderr] {
        assert!(out.contains(&format!("error: node {node}:")), "{out}");
        assert!(!out.contains("panicked"), "{out}");
    }
    [up.stderr, one.stderr]
}

/// `kv_transport = "rdma"` on a machine without an RDMA device (or a build without verbs) is
/// a configuration error at start naming the node and the key, as a CUDA device is.
#[tokio::test(flavor = "multi_thread")]
async fn rdma_without_a_device_fails_the_start_naming_the_node_and_key() {
    for out in refused_at_start("kv_transport = \"rdma\"\n", "p0").await {
        assert!(out.contains("`serving.kv_transport`"), "{out}");
        // The default build has no verbs; a build with them, on this machine, no device.
        assert!(
            out.contains("--features rdma") || out.contains("no RDMA device"),
            "{out}"
        );
    }
}

/// A worker asked to run on a CUDA device this machine cannot open (no driver here; with a
/// driver, a build without CUDA kernels) is a configuration error at start that names the node
/// and the key, from `duet up` and from `duet node` alike: nothing starts, nothing panics.
#[tokio::test(flavor = "multi_thread")]
async fn a_cuda_device_that_cannot_open_fails_the_start_naming_the_node_and_key() {
    for out in refused_at_start("[serving.node.d0]\ndevice = \"cuda:0\"\n", "d0").await {
        assert!(out.contains("`serving.node.d0.device`"), "{out}");
        assert!(
            out.contains("`cuda:0` cannot be used on this machine"),
            "{out}"
        );
    }
}

/// `duet serve --model FILE --port N`: one model on loopback without a cluster file, named by
/// the file, served through the OpenAI API until SIGTERM; a missing file is a clear error.
#[tokio::test(flavor = "multi_thread")]
async fn serve_runs_one_model_without_a_cluster_file() {
    let c = ClusterDir::tiny(&[("router", "router"), ("d0", "decode")], "");
    let model = c.dir.path().join("tiny.gguf");
    assert!(
        model.exists(),
        "the tiny model is written by ClusterDir::tiny"
    );
    let port = free_ports(1)[0];
    let port_s = port.to_string();
    let up = Running::start(
        &["serve", "--model", path_str(&model), "--port", &port_s],
        "ready",
    )
    .await;
    router_ready(port, 1).await;
    assert_eq!(served_model(port), "tiny");
    let (code, v) = curl_completion(
        port,
        &serde_json::json!({"prompt": [5, 6, 7], "max_tokens": 2}),
    )
    .await;
    assert_eq!(code, 200, "{v}");
    drop(up);
    let missing = duet(&["serve", "--model", "/nonexistent/x.gguf"]).await;
    assert_eq!(missing.status.code(), Some(2), "{}", missing.stderr);
    assert!(
        missing.stderr.contains("no such file"),
        "{}",
        missing.stderr
    );
}
