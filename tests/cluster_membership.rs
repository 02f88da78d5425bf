//! Killing a node process: its peers mark it down within the heartbeat deadline, and it
//! rejoins (as a new incarnation) when restarted.

mod common;

use std::time::{Duration, Instant};

use common::*;

#[tokio::test(flavor = "multi_thread")]
async fn killed_node_is_marked_down_then_rejoins() {
    // down_after = 100 ms x 5 = 500 ms.
    let extra = "[membership]\nheartbeat_interval_ms = 100\nfailure_threshold = 5\n";
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        extra,
    );
    c.credentials(&c.config).await;
    let token = c.token();
    let router = Running::node(&c.config, "router").await;
    let p0 = Running::node(&c.config, "p0").await;
    let d0 = Running::node(&c.config, "d0").await;

    for (node, peer) in [
        ("router", "p0"),
        ("d0", "p0"),
        ("router", "d0"),
        ("p0", "router"),
    ] {
        poll(
            &format!("{peer} up on {node}"),
            Duration::from_secs(15),
            || async { (peer_state(c.admin(node), &token, peer).await? == "up").then_some(()) },
        )
        .await;
    }
    let before = admin_get(c.admin("router"), &token, "/v1/membership")
        .await
        .expect("membership");
    let old_incarnation = before["peers"]["p0"]["incarnation"]
        .as_u64()
        .expect("incarnation");

    p0.kill_hard().await;
    let killed = Instant::now();
    for node in ["router", "d0"] {
        poll(
            &format!("p0 down on {node}"),
            Duration::from_secs(10),
            || async { (peer_state(c.admin(node), &token, "p0").await? == "down").then_some(()) },
        )
        .await;
    }
    let detected = killed.elapsed();
    // The deadline is 500 ms of silence; allow heartbeat phase, polling and a loaded CI host.
    assert!(
        detected < Duration::from_millis(500 + 2_500),
        "took {detected:?}"
    );
    // The survivors still see each other.
    assert_eq!(
        peer_state(c.admin("router"), &token, "d0").await.as_deref(),
        Some("up")
    );

    let p0 = Running::node(&c.config, "p0").await;
    for node in ["router", "d0"] {
        poll(
            &format!("p0 back up on {node}"),
            Duration::from_secs(15),
            || async { (peer_state(c.admin(node), &token, "p0").await? == "up").then_some(()) },
        )
        .await;
    }
    let after = admin_get(c.admin("router"), &token, "/v1/membership")
        .await
        .expect("membership");
    assert_ne!(
        after["peers"]["p0"]["incarnation"].as_u64(),
        Some(old_incarnation)
    );
    assert_eq!(after["peers"]["p0"]["downs"], 1);
    drop((router, p0, d0));
}
