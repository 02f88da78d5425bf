//! `duet rollout --role ROLE`: restart every node of a role, one at a time, without failing a
//! request: drain it (it takes nothing new and finishes what it holds), restart it (it exits
//! with `EXIT_RESTART`, and its supervisor, `duet up` or Kubernetes, starts it again from the
//! binary installed now), wait until it is back as a new incarnation that every router sees
//! up, let it take requests, then the next. A rolling upgrade is: install the new binary,
//! `duet rollout --role decode`, then the other roles.
//!
//! A step that does not finish within `--wait` stops the rollout with an error naming the node
//! and the step; the nodes not reached yet are untouched, and one drained but not restarted is
//! resumed.

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use duet_runtime::admin::client::{self, AdminClientError, Method};
use duet_runtime::config::{NodeConfig, Role};
use serde_json::Value;

use crate::admin_cli::load;

/// How long one admin call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a step's state is polled.
const POLL: Duration = Duration::from_millis(200);

/// One node's admin API.
struct Admin<'a> {
    node: &'a NodeConfig,
    token: &'a str,
}

impl Admin<'_> {
    async fn call(&self, method: Method, path: &str) -> Result<Value, AdminClientError> {
        client::call(
            self.node.admin,
            self.token,
            method,
            path,
            None,
            CALL_TIMEOUT,
        )
        .await
    }

    /// This node's incarnation and its view of its peers.
    async fn membership(&self) -> Result<(u64, Value), AdminClientError> {
        let v = self.call(Method::GET, "/v1/membership").await?;
        let incarnation = v["incarnation"].as_u64().unwrap_or(0);
        Ok((incarnation, v["peers"].clone()))
    }
}

/// Polls `check` until it gives `Some`, at most `wait`; `Err` names what was waited for.
async fn until<T, F>(wait: Duration, what: &str, mut check: F) -> Result<T, String>
where
    F: AsyncFnMut() -> Option<T>,
{
    let deadline = Instant::now() + wait;
    loop {
        if let Some(t) = check().await {
            return Ok(t);
        }
        if Instant::now() >= deadline {
            return Err(format!("{what}: not within {wait:?}"));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Rolls one node; what it did, in one line.
async fn roll(
    all: &[NodeConfig],
    token: &str,
    node: &NodeConfig,
    wait: Duration,
) -> Result<String, String> {
    let name = &node.name;
    let admin = Admin { node, token };
    let start = Instant::now();
    let (before, _) = admin
        .membership()
        .await
        .map_err(|e| format!("{name} does not answer: {e}"))?;
    // 1. Drain: no new request; what it holds finishes.
    admin
        .call(Method::POST, "/v1/drain")
        .await
        .map_err(|e| format!("{name}: drain: {e}"))?;
    let drained = until(
        wait,
        &format!("{name} to finish what it holds"),
        async || {
            let v = admin.call(Method::GET, "/v1/drain").await.ok()?;
            v["empty"].as_bool().unwrap_or(false).then_some(())
        },
    )
    .await;
    if let Err(e) = drained {
        // Not restarted: it takes requests again rather than sit drained.
        let _ = admin.call(Method::POST, "/v1/resume").await;
        return Err(format!("{e} (resumed it; the rollout stops here)"));
    }
    let drain_secs = start.elapsed().as_secs_f64();
    // 2. Restart: it exits, and its supervisor starts the installed binary.
    admin
        .call(Method::POST, "/v1/restart")
        .await
        .map_err(|e| format!("{name}: restart: {e}"))?;
    let back = Instant::now();
    let after = until(wait, &format!("{name} to come back"), async || {
        let (incarnation, _) = admin.membership().await.ok()?;
        (incarnation != before).then_some(incarnation)
    })
    .await
    .map_err(|e| format!("{e} (is it run by `duet up` or another supervisor?)"))?;
    // 3. Ready: it sees every peer, and every router sees this incarnation.
    let routers: Vec<&NodeConfig> = all
        .iter()
        .filter(|n| n.role == Role::Router && n.name != *name)
        .collect();
    until(
        wait,
        &format!("{name} and the routers to see each other"),
        async || {
            let (_, peers) = admin.membership().await.ok()?;
            let all_up = peers
                .as_object()?
                .values()
                .all(|p| p["state"].as_str() == Some("up"));
            if !all_up {
                return None;
            }
            for r in &routers {
                let (_, seen) = Admin { node: r, token }.membership().await.ok()?;
                let p = &seen[name.as_str()];
                if p["state"].as_str() != Some("up") || p["incarnation"].as_u64() != Some(after) {
                    return None;
                }
            }
            Some(())
        },
    )
    .await?;
    // 4. Resume (a fresh process is not draining; this also covers a supervisor that kept
    // the old process's state).
    admin
        .call(Method::POST, "/v1/resume")
        .await
        .map_err(|e| format!("{name}: resume: {e}"))?;
    Ok(format!(
        "{name}: drained in {drain_secs:.1} s, restarted (incarnation {before} -> {after}), \
         back and seen by {} router(s) in {:.1} s",
        routers.len(),
        back.elapsed().as_secs_f64()
    ))
}

/// `duet rollout --role ROLE [--wait SECS]`.
pub async fn run(config_path: &Path, role: &str, wait: Duration) -> ExitCode {
    let (config, token) = match load(config_path) {
        Ok(x) => x,
        Err(code) => return code,
    };
    // The file's nodes and those that joined.
    let all = crate::admin_cli::with_joined(&config, &token).await;
    let nodes: Vec<&NodeConfig> = all.iter().filter(|n| n.role.as_str() == role).collect();
    if nodes.is_empty() {
        let roles: Vec<&str> = all.iter().map(|n| n.role.as_str()).collect();
        eprintln!(
            "error: no node of role `{role}` in {} (its roles: {})",
            config.path.display(),
            roles.join(", ")
        );
        return ExitCode::from(2);
    }
    let total = Instant::now();
    for (i, node) in nodes.iter().enumerate() {
        match roll(&all, &token, node, wait).await {
            Ok(line) => println!("[{}/{}] {line}", i + 1, nodes.len()),
            Err(e) => {
                eprintln!(
                    "error: rollout of role {role} stopped at {}: {e}",
                    node.name
                );
                return ExitCode::FAILURE;
            }
        }
    }
    println!(
        "rolled {} {role} node(s) in {:.1} s",
        nodes.len(),
        total.elapsed().as_secs_f64()
    );
    ExitCode::SUCCESS
}
