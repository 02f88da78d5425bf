//! `duet tree`, `duet kill`, `duet stop`, `duet drain`, `duet resume`: clients of every node's
//! admin API.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use duet_runtime::admin::client::{self, AdminClientError, Method};
use duet_runtime::config::{ClusterConfig, Role};
use duet_runtime::credentials::Credentials;
use duet_runtime::tree::{self, NodeTree};
use serde_json::json;

/// How long a CLI call waits for one node.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

pub(crate) fn load(config: &Path) -> Result<(ClusterConfig, String), ExitCode> {
    let config = ClusterConfig::load(config).map_err(|e| {
        eprintln!("error: {e}");
        ExitCode::from(2)
    })?;
    let creds = Credentials::load(&config.credentials).map_err(|e| {
        eprintln!("error: {e}");
        ExitCode::from(2)
    })?;
    Ok((config, creds.token.expose().to_string()))
}

/// Prints every node's tree, merged, as text or JSON.
pub async fn tree(config: &Path, as_json: bool) -> ExitCode {
    let (config, token) = match load(config) {
        Ok(x) => x,
        Err(code) => return code,
    };
    let nodes = with_joined(&config, &token).await;
    let calls = nodes.iter().map(|n| {
        let token = token.clone();
        async move {
            let answer =
                client::call(n.admin, &token, Method::GET, "/v1/tree", None, CALL_TIMEOUT).await;
            // A loopback admin address of a node on another host reaches whichever node of
            // this host has that port: its answer names that node, never shown as this one.
            let checked = answer.and_then(|v| {
                let t = serde_json::from_value::<NodeTree>(v).map_err(|e| {
                    AdminClientError::BadAnswer {
                        addr: n.admin,
                        reason: e.to_string(),
                    }
                })?;
                if t.node != n.name {
                    return Err(AdminClientError::BadAnswer {
                        addr: n.admin,
                        reason: format!(
                            "node `{}` answered there: `{}` runs on host {} (give it an admin \
                             address this machine reaches, or run the command on its host)",
                            t.node, n.name, n.host
                        ),
                    });
                }
                Ok(t)
            });
            match checked {
                Ok(t) => t,
                Err(e) => NodeTree {
                    node: n.name.clone(),
                    role: n.role.to_string(),
                    status: "unreachable".into(),
                    error: Some(e.to_string()),
                    root: None,
                    pid: None,
                    process_restarts: 0,
                    device: None,
                },
            }
        }
    });
    let mut nodes = Vec::new();
    for call in calls {
        nodes.push(call.await);
    }
    if as_json {
        match serde_json::to_string_pretty(&nodes) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        print!("{}", tree::render(&nodes));
    }
    ExitCode::SUCCESS
}

/// The file's nodes, then the nodes that joined from outside it, as the first node of the
/// file that answers knows them.
pub(crate) async fn with_joined(
    config: &ClusterConfig,
    token: &str,
) -> Vec<duet_runtime::config::NodeConfig> {
    let mut nodes = config.nodes.clone();
    for n in &config.nodes {
        let Ok(v) = client::call(
            n.admin,
            token,
            Method::GET,
            "/v1/membership",
            None,
            CALL_TIMEOUT,
        )
        .await
        else {
            continue;
        };
        let joined: Vec<duet_runtime::config::NodeConfig> =
            serde_json::from_value(v["joined"].clone()).unwrap_or_default();
        nodes.extend(
            joined
                .into_iter()
                .filter(|j| config.node(&j.name).is_none()),
        );
        break;
    }
    nodes
}

/// Kills (`kill = true`) or stops the actor at `path`.
pub async fn act(config: &Path, path: &str, kill: bool) -> ExitCode {
    let (config, token) = match load(config) {
        Ok(x) => x,
        Err(code) => return code,
    };
    let node_name = path.split('/').next().unwrap_or_default();
    let Some(node) = find_node(
        &config,
        &token,
        node_name,
        " (paths start with a node name)",
    )
    .await
    else {
        return ExitCode::FAILURE;
    };
    let endpoint = if kill {
        "/v1/actors/kill"
    } else {
        "/v1/actors/stop"
    };
    let body = json!({ "path": path });
    match client::call(
        node.admin,
        &token,
        Method::POST,
        endpoint,
        Some(body),
        CALL_TIMEOUT,
    )
    .await
    {
        Ok(_) => {
            println!("{} {path}", if kill { "killed" } else { "stopped" });
            ExitCode::SUCCESS
        }
        Err(AdminClientError::Api {
            message, nearest, ..
        }) if !nearest.is_empty() => {
            eprintln!("error: {message}; nearest: {}", nearest.join(", "));
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The node named `name`, or an error naming the nearest ones.
/// Node `name`: of the file, or one that joined (as the cluster's members know it); `None`
/// after an error naming the nearest names.
async fn find_node(
    config: &ClusterConfig,
    token: &str,
    name: &str,
    hint: &str,
) -> Option<duet_runtime::config::NodeConfig> {
    if let Some(n) = config.node(name) {
        return Some(n.clone());
    }
    let all = with_joined(config, token).await;
    let node = all.iter().find(|n| n.name == name).cloned();
    if node.is_none() {
        let names = all.iter().map(|n| n.name.as_str());
        eprintln!(
            "error: no node `{name}` in {} or among the nodes that joined{hint}; nearest: {}",
            config.path.display(),
            tree::nearest(name, names, 3).join(", ")
        );
    }
    node
}

/// What a node's drain state says, in one line.
fn drain_line(v: &serde_json::Value) -> String {
    let node = v["node"].as_str().unwrap_or("?");
    if !v["draining"].as_bool().unwrap_or(false) {
        return format!("{node}: taking requests");
    }
    if v["empty"].as_bool().unwrap_or(false) {
        return format!("{node}: drained: holds no request (safe to restart)");
    }
    format!("{node}: draining: still holds {}", v["held"])
}

/// `duet drain NODE`: the node takes no new request and finishes what it holds; with `wait`,
/// returns once it holds nothing (or fails after `wait`).
pub async fn drain(config: &Path, name: &str, wait: Option<Duration>) -> ExitCode {
    let (config, token) = match load(config) {
        Ok(x) => x,
        Err(code) => return code,
    };
    let Some(node) = find_node(&config, &token, name, "").await else {
        return ExitCode::FAILURE;
    };
    let call =
        |method: Method| client::call(node.admin, &token, method, "/v1/drain", None, CALL_TIMEOUT);
    let mut state = match call(Method::POST).await {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("{}", drain_line(&state));
    let Some(wait) = wait else {
        return ExitCode::SUCCESS;
    };
    let deadline = tokio::time::Instant::now() + wait;
    while !state["empty"].as_bool().unwrap_or(false) {
        if tokio::time::Instant::now() >= deadline {
            eprintln!("error: {name} still holds {} after {wait:?}", state["held"]);
            return ExitCode::FAILURE;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        state = match call(Method::GET).await {
            Ok(v) => v,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        };
    }
    println!("{}", drain_line(&state));
    ExitCode::SUCCESS
}

/// `duet resume NODE`: the node takes new requests again.
pub async fn resume(config: &Path, name: &str) -> ExitCode {
    let (config, token) = match load(config) {
        Ok(x) => x,
        Err(code) => return code,
    };
    let Some(node) = find_node(&config, &token, name, "").await else {
        return ExitCode::FAILURE;
    };
    match client::call(
        node.admin,
        &token,
        Method::POST,
        "/v1/resume",
        None,
        CALL_TIMEOUT,
    )
    .await
    {
        Ok(v) => {
            println!("{}", drain_line(&v));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `duet status NODE [--alive]`: a probe (Kubernetes readiness and liveness). Exit 0 when the
/// node's admin API answers and, unless `alive`, it takes requests (not draining) and sees a
/// node of the role it serves with up: a router for a worker, a worker for a router.
pub async fn status(config: &Path, name: &str, alive: bool) -> ExitCode {
    let (config, token) = match load(config) {
        Ok(x) => x,
        Err(code) => return code,
    };
    let Some(node) = find_node(&config, &token, name, "").await else {
        return ExitCode::FAILURE;
    };
    let get = |path: &'static str| {
        client::call(node.admin, &token, Method::GET, path, None, CALL_TIMEOUT)
    };
    let drain = match get("/v1/drain").await {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: {name}: {e}");
            return ExitCode::FAILURE;
        }
    };
    if alive {
        println!("{name}: alive");
        return ExitCode::SUCCESS;
    }
    if drain["draining"].as_bool().unwrap_or(false) {
        println!("{}", drain_line(&drain));
        return ExitCode::FAILURE;
    }
    let membership = match get("/v1/membership").await {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: {name}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let nodes = with_joined(&config, &token).await;
    let wanted = |role: Role| {
        if node.role == Role::Router {
            role != Role::Router
        } else {
            role == Role::Router
        }
    };
    let up: Vec<&str> = nodes
        .iter()
        .filter(|n| wanted(n.role))
        .filter(|n| membership["peers"][n.name.as_str()]["state"] == "up")
        .map(|n| n.name.as_str())
        .collect();
    if up.is_empty() {
        println!(
            "{name}: not ready: sees no {} up",
            if node.role == Role::Router {
                "worker"
            } else {
                "router"
            }
        );
        return ExitCode::FAILURE;
    }
    println!("{name}: ready (sees {} up)", up.join(", "));
    ExitCode::SUCCESS
}
