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
