//! `duet kill` and `duet stop` against a live cluster: restarts, escalation, graceful stop.

mod common;

use std::time::Duration;

use common::*;

async fn restarts(c: &ClusterDir, path: &str) -> Option<(u64, String)> {
    let tree = tree_json(&c.config).await;
    let a = find(&tree, path)?;
    Some((a["restarts"].as_u64()?, a["status"].as_str()?.to_string()))
}

async fn kill(c: &ClusterDir, path: &str) {
    let out = duet(&["kill", "--config", path_str(&c.config), path]).await;
    assert!(out.status.success(), "duet kill {path}: {}", out.stderr);
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_actor_is_restarted_and_counted() {
    let c = ClusterDir::new(&[("router", "router"), ("p0", "prefill")], "");
    let _up = Running::up(&c.config).await;
    let token = c.token();

    kill(&c, "p0/prefill/echo").await;
    poll("echo restarted once", Duration::from_secs(10), || async {
        (restarts(&c, "p0/prefill/echo").await? == (1, "running".into())).then_some(())
    })
    .await;
    let counted = metric(
        c.admin("p0"),
        &token,
        "duet_actor_restarts_total",
        "kind=\"echo\"",
    )
    .await;
    assert_eq!(counted, 1.0);

    // A link actor too: it restarts, and the link (so membership) comes back.
    kill(&c, "router/links/p0").await;
    poll("link restarted", Duration::from_secs(10), || async {
        (restarts(&c, "router/links/p0").await? == (1, "running".into())).then_some(())
    })
    .await;
    poll(
        "p0 up again from the router",
        Duration::from_secs(10),
        || async { (peer_state(c.admin("router"), &token, "p0").await? == "up").then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn exceeding_the_restart_intensity_escalates_to_the_parent() {
    let extra = "[supervision.echo]\nmax_restarts = 2\nwithin_secs = 60\n";
    let c = ClusterDir::new(&[("router", "router"), ("p0", "prefill")], extra);
    let _up = Running::up(&c.config).await;
    let token = c.token();

    for n in 1..=2 {
        kill(&c, "p0/prefill/echo").await;
        poll("echo restarted", Duration::from_secs(10), || async {
            (restarts(&c, "p0/prefill/echo").await?.0 == n).then_some(())
        })
        .await;
    }
    // The third failure within the window exceeds max_restarts = 2: the prefill supervisor
    // gives up, the root restarts it, and it starts a fresh echo.
    kill(&c, "p0/prefill/echo").await;
    poll(
        "prefill supervisor restarted by the root",
        Duration::from_secs(10),
        || async {
            let sup = restarts(&c, "p0/prefill").await?;
            let echo = restarts(&c, "p0/prefill/echo").await?;
            (sup == (1, "running".into()) && echo == (0, "running".into())).then_some(())
        },
    )
    .await;
    let escalations = metric(
        c.admin("p0"),
        &token,
        "duet_supervisor_escalations_total",
        "kind=\"echo\"",
    )
    .await;
    assert_eq!(escalations, 1.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn stopped_actor_stays_stopped() {
    let c = ClusterDir::new(&[("router", "router"), ("d0", "decode")], "");
    let _up = Running::up(&c.config).await;

    let out = duet(&["stop", "--config", path_str(&c.config), "d0/decode/echo"]).await;
    assert!(out.status.success(), "{}", out.stderr);
    poll("echo stopped", Duration::from_secs(10), || async {
        (restarts(&c, "d0/decode/echo").await? == (0, "stopped".into())).then_some(())
    })
    .await;
    let out = duet(&["kill", "--config", path_str(&c.config), "d0/decode/echo"]).await;
    assert!(!out.status.success());
    assert!(out.stderr.contains("is stopped"), "{}", out.stderr);
    // Still stopped after the attempt: nothing restarted it.
    assert_eq!(
        restarts(&c, "d0/decode/echo").await,
        Some((0, "stopped".into()))
    );
}
