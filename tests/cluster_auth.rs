//! Credentials: a node with the wrong certificate or token cannot join; the admin API needs
//! the token.

mod common;

use std::time::Duration;

use common::*;
use duet_runtime::admin::client::{self, AdminClientError, Method, StatusCode};

const FAST: &str = "[membership]\nheartbeat_interval_ms = 100\nfailure_threshold = 5\n";

#[tokio::test(flavor = "multi_thread")]
async fn node_with_another_certificate_is_refused() {
    let c = ClusterDir::new(&[("router", "router"), ("d0", "decode")], FAST);
    c.credentials(&c.config).await;
    let token = c.token();
    // The same cluster file, but credentials of its own (another certificate and token).
    let other = c.write(
        "other.toml",
        &format!("{FAST}[credentials]\ndir = \"other\"\n"),
    );
    c.credentials(&other).await;

    let _router = Running::node(&c.config, "router").await;
    let _intruder = Running::node(&other, "d0").await;
    handshake_refused(c.admin("router"), &token, "tls").await;
    // Past the membership deadline, the intruder is still not a member.
    poll(
        "d0 marked down on the router",
        Duration::from_secs(10),
        || async { (peer_state(c.admin("router"), &token, "d0").await? == "down").then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn node_with_the_wrong_token_is_refused() {
    let c = ClusterDir::new(&[("router", "router"), ("d0", "decode")], FAST);
    c.credentials(&c.config).await;
    let token = c.token();
    // The right certificate and key, the wrong token.
    let wrong = c.wrong_token(FAST);

    let _router = Running::node(&c.config, "router").await;
    let _d0 = Running::node(&wrong, "d0").await;
    handshake_refused(c.admin("router"), &token, "token").await;
    poll(
        "d0 marked down on the router",
        Duration::from_secs(10),
        || async { (peer_state(c.admin("router"), &token, "d0").await? == "down").then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn admin_calls_need_the_token() {
    let c = ClusterDir::new(&[("router", "router")], "");
    let _up = Running::up(&c.config).await;
    let addr = c.admin("router");
    let t = Duration::from_secs(3);

    for token in ["", "not-the-token"] {
        for (method, path) in [
            (Method::GET, "/v1/tree"),
            (Method::POST, "/v1/shutdown"),
            (Method::GET, "/metrics"),
        ] {
            let err = client::call(addr, token, method, path, Some(serde_json::json!({})), t).await;
            match err {
                Err(AdminClientError::Api { status, .. }) => {
                    assert_eq!(status, StatusCode::UNAUTHORIZED, "{path}")
                }
                other => panic!("{path} with token `{token}`: {other:?}"),
            }
        }
    }
    let ok = client::call(addr, &c.token(), Method::GET, "/v1/tree", None, t).await;
    assert!(ok.is_ok(), "{ok:?}");
}
