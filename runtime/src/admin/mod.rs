//! The admin HTTP API every node serves (loopback by default; every call needs the token).
//!
//! | method | path | what |
//! |---|---|---|
//! | GET | `/v1/tree` | this node's live supervision tree ([`NodeTree`]) |
//! | GET | `/v1/membership` | this node's view of its peers |
//! | POST | `/v1/actors/kill` | `{"path": "NODE/a/b"}`: kill it (its supervisor restarts it) |
//! | POST | `/v1/actors/stop` | `{"path": ...}`: stop it gracefully (it stays stopped) |
//! | GET | `/v1/drain` | drain state: `draining`, `exiting`, work `held` per probe, `empty` |
//! | POST | `/v1/drain` | drain: take no new request, finish what is held; the node stays up |
//! | POST | `/v1/resume` | take new requests again (409 while the node shuts down) |
//! | POST | `/v1/shutdown` | drain and stop the node |
//! | POST | `/v1/restart` | drain and stop the node, exiting with [`crate::node::EXIT_RESTART`]: its supervisor (`duet up`, Kubernetes) starts it again at once, on the binary now installed (`duet rollout`) |
//! | GET | `/metrics` | Prometheus text |
//!
//! Authentication is `Authorization: Bearer <cluster token>`. Errors are JSON:
//! `{"error": {"type": ..., "message": ..., "nearest": [...]}}`.

pub mod client;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use ractor::ActorRef;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::watch;

use crate::context::NodeContext;
use crate::metrics as m;
use crate::supervisor::{SupervisorMsg, TreeError};
use crate::tree::{self, NodeTree};

/// How long the admin API waits on the supervision tree.
const TREE_CALL_MS: u64 = 5_000;

/// What the admin handlers share.
#[derive(Clone)]
pub struct AdminState {
    /// The node.
    pub ctx: Arc<NodeContext>,
    /// The node's root supervisor.
    pub root: ActorRef<SupervisorMsg>,
    /// Renders `/metrics`.
    pub metrics: PrometheusHandle,
    /// Set to true to ask the node to drain and stop.
    pub shutdown: watch::Sender<bool>,
    /// Set before `shutdown` when the stop is a restart.
    pub restart: Arc<std::sync::atomic::AtomicBool>,
}

/// Body of kill and stop.
#[derive(Debug, Serialize, Deserialize)]
pub struct PathBody {
    /// `NODE/actor/child/...`
    pub path: String,
}

/// The admin router.
pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/v1/tree", get(get_tree))
        .route("/v1/membership", get(get_membership))
        .route("/v1/actors/kill", post(kill))
        .route("/v1/actors/stop", post(stop))
        .route("/v1/drain", get(drain_state).post(drain))
        .route("/v1/resume", post(resume))
        .route("/v1/shutdown", post(shutdown))
        .route("/v1/restart", post(restart))
        .route("/metrics", get(get_metrics))
        .layer(middleware::from_fn_with_state(state.clone(), require_token))
        .with_state(state)
}

async fn require_token(State(state): State<AdminState>, req: Request, next: Next) -> Response {
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        Some(token) if state.ctx.credentials.token.matches(token) => next.run(req).await,
        _ => {
            metrics::counter!(m::ADMIN_UNAUTHORIZED).increment(1);
            error(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "the admin API needs `Authorization: Bearer <cluster token>`",
                vec![],
            )
        }
    }
}

fn error(status: StatusCode, kind: &str, message: &str, nearest: Vec<String>) -> Response {
    let body = json!({"error": {"type": kind, "message": message, "nearest": nearest}});
    (status, Json(body)).into_response()
}

async fn node_tree(state: &AdminState) -> Result<NodeTree, Response> {
    let root = ractor::call_t!(state.root, SupervisorMsg::Tree, TREE_CALL_MS).map_err(|e| {
        error(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            &format!("the root supervisor did not answer: {e}"),
            vec![],
        )
    })?;
    Ok(NodeTree {
        node: state.ctx.me.name.clone(),
        role: state.ctx.me.role.to_string(),
        status: if state.ctx.drain.is_draining() {
            "draining"
        } else {
            "up"
        }
        .to_string(),
        error: None,
        root: Some(root),
        pid: Some(std::process::id()),
        process_restarts: crate::node::process_restarts(),
        device: state
            .ctx
            .device
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone(),
    })
}

async fn get_tree(State(state): State<AdminState>) -> Response {
    match node_tree(&state).await {
        Ok(t) => Json(t).into_response(),
        Err(r) => r,
    }
}

async fn get_membership(State(state): State<AdminState>) -> Response {
    Json(json!({
        "node": state.ctx.me.name,
        "incarnation": state.ctx.incarnation,
        "down_after_ms": state.ctx.config.membership.down_after().as_millis() as u64,
        "peers": state.ctx.membership.snapshot(),
        // Nodes outside cluster.toml that joined (this one too, if it did).
        "joined": state.ctx.roster.joined(),
        "wire": crate::wire::Versions::spoken(),
        "build": crate::link::build(),
        // Per connected peer: the wire version its link negotiated and its build.
        "links": state
            .ctx
            .links
            .all()
            .iter()
            .filter_map(|l| l.peer_link().map(|p| (l.peer().to_string(), p)))
            .collect::<std::collections::BTreeMap<_, _>>(),
    }))
    .into_response()
}

async fn kill(State(state): State<AdminState>, Json(body): Json<PathBody>) -> Response {
    act(state, body.path, true).await
}

async fn stop(State(state): State<AdminState>, Json(body): Json<PathBody>) -> Response {
    act(state, body.path, false).await
}

async fn act(state: AdminState, path: String, kill: bool) -> Response {
    let me = &state.ctx.me.name;
    let mut segments = path.split('/').filter(|s| !s.is_empty());
    if segments.next() != Some(me.as_str()) {
        return error(
            StatusCode::NOT_FOUND,
            "not_found",
            &format!("`{path}` is not on node `{me}` (paths start with the node name)"),
            vec![],
        );
    }
    let rest: Vec<String> = segments.map(str::to_string).collect();
    if rest.is_empty() {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid",
            &format!(
                "`{me}` is the node's root supervisor: stop the node process (SIGTERM) instead"
            ),
            vec![],
        );
    }
    let call = if kill {
        ractor::call_t!(state.root, SupervisorMsg::Kill, TREE_CALL_MS, rest)
    } else {
        ractor::call_t!(state.root, SupervisorMsg::Stop, TREE_CALL_MS, rest)
    };
    match call {
        Ok(Ok(())) => Json(json!({"path": path, "action": if kill {"killed"} else {"stopped"}}))
            .into_response(),
        Ok(Err(TreeError::NotFound(_))) => {
            let known = match node_tree(&state).await {
                Ok(t) => t.root.map(|r| r.paths()).unwrap_or_default(),
                Err(_) => vec![],
            };
            let nearest = tree::nearest(&path, known.iter().map(String::as_str), 3);
            error(
                StatusCode::NOT_FOUND,
                "not_found",
                &format!("no actor at `{path}`"),
                nearest,
            )
        }
        Ok(Err(e @ TreeError::Stopped(_))) => {
            error(StatusCode::CONFLICT, "stopped", &e.to_string(), vec![])
        }
        Ok(Err(e)) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            &e.to_string(),
            vec![],
        ),
        Err(e) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            &format!("the root supervisor did not answer: {e}"),
            vec![],
        ),
    }
}

/// The node's drain state: routers stop sending a draining worker new requests; `empty` says
/// it holds none any more (safe to restart).
fn drain_json(state: &AdminState) -> serde_json::Value {
    let d = &state.ctx.drain;
    let held = d.busy();
    json!({
        "node": state.ctx.me.name,
        "draining": d.is_draining(),
        "exiting": d.is_exiting(),
        "held": held,
        "empty": d.is_empty(),
    })
}

async fn drain_state(State(state): State<AdminState>) -> Response {
    Json(drain_json(&state)).into_response()
}

async fn drain(State(state): State<AdminState>) -> Response {
    if !state.ctx.drain.is_draining() {
        tracing::info!(node = %state.ctx.me.name, "draining (admin): no new requests");
    }
    state.ctx.drain.start();
    Json(drain_json(&state)).into_response()
}

async fn resume(State(state): State<AdminState>) -> Response {
    match state.ctx.drain.resume() {
        Ok(()) => {
            tracing::info!(node = %state.ctx.me.name, "resumed (admin): taking new requests");
            Json(drain_json(&state)).into_response()
        }
        Err(e) => error(StatusCode::CONFLICT, "exiting", &e.to_string(), vec![]),
    }
}

async fn shutdown(State(state): State<AdminState>) -> Response {
    let _ = state.shutdown.send(true);
    Json(json!({"node": state.ctx.me.name, "action": "draining"})).into_response()
}

async fn restart(State(state): State<AdminState>) -> Response {
    tracing::info!(node = %state.ctx.me.name, "restart (admin): draining, then exiting to be started again");
    state
        .restart
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let _ = state.shutdown.send(true);
    Json(json!({"node": state.ctx.me.name, "action": "restarting", "incarnation": state.ctx.incarnation}))
        .into_response()
}

async fn get_metrics(State(state): State<AdminState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}
