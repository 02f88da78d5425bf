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

/// The node's entry in `duet tree --json`: its pid and process restarts, once it answers.
async fn node_process(c: &ClusterDir, node: &str) -> Option<(u64, u64)> {
    let tree = tree_json(&c.config).await;
    let n = tree.as_array()?.iter().find(|n| n["node"] == node)?;
    Some((n["pid"].as_u64()?, n["process_restarts"].as_u64()?))
}

#[tokio::test(flavor = "multi_thread")]
async fn duet_up_restarts_a_node_process_that_died_within_its_intensity() {
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill")],
        "[supervision.node]\nmax_restarts = 1\nwithin_secs = 600\n",
    );
    let _up = Running::up(&c.config).await;
    let (pid, restarts) = poll("p0 in the tree", Duration::from_secs(30), || {
        node_process(&c, "p0")
    })
    .await;
    assert_eq!(restarts, 0);
    let sigkill = |pid: u64| {
        let pid = nix::unistd::Pid::from_raw(pid as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).expect("SIGKILL p0");
    };
    sigkill(pid);
    let (again, restarts) = poll("p0 started again", Duration::from_secs(60), || async {
        node_process(&c, "p0").await.filter(|(p, _)| *p != pid)
    })
    .await;
    assert_eq!(restarts, 1, "duet tree shows the process restart");
    let text = duet(&["tree", "--config", path_str(&c.config)]).await;
    assert!(
        text.stdout
            .contains("p0 (prefill, up, device cpu, process restarted once)"),
        "{}",
        text.stdout
    );
    // A second death within the window exceeds the intensity: p0 stays down, and the rest
    // of the cluster keeps serving.
    sigkill(again);
    poll("p0 down", Duration::from_secs(30), || async {
        node_process(&c, "p0").await.is_none().then_some(())
    })
    .await;
    // Past the longest restart pause (5 s) with room to spare, it has not come back.
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert_eq!(
        node_process(&c, "p0").await,
        None,
        "restarted past its intensity"
    );
    assert!(
        node_process(&c, "router").await.is_some(),
        "the router serves on"
    );
}
