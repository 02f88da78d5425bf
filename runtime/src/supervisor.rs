//! A supervisor actor with OTP-style restart intensity, built on ractor's supervision events.
//!
//! ractor's default reaction to a child's exit is to stop the supervisor; ours handles every
//! exit explicitly:
//!
//! - a child stopped on purpose (`duet stop`) stays stopped;
//! - any other exit (`duet kill`, a panic, an error, an unexpected clean exit) is a failure:
//!   the child is restarted from its [`ChildSpec`], unless it already failed `max_restarts`
//!   times within `within` (its kind's [`RestartPolicy`]); then this supervisor fails itself,
//!   which escalates to its parent, which applies *its* policy for kind `supervisor`.
//!
//! Restarts and escalations are logged and counted (`duet_actor_restarts_total`,
//! `duet_supervisor_escalations_total`). The tree is addressed by paths: a supervisor knows its
//! own path and resolves the rest of a path through its child supervisors.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{
    Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort, SpawnErr, SupervisionEvent,
};

use crate::config::{RestartPolicy, SupervisionConfig};
use crate::metrics as m;
use crate::tree::ActorInfo;

/// How long a supervisor waits for a child supervisor's part of the tree.
const TREE_TIMEOUT: Duration = Duration::from_secs(2);
/// Delay before retrying a child whose restart itself failed.
const RESPAWN_DELAY: Duration = Duration::from_millis(200);

type SpawnFuture = Pin<Box<dyn Future<Output = Result<ActorCell, SpawnErr>> + Send>>;
type StartFn = Arc<dyn Fn(ActorCell) -> SpawnFuture + Send + Sync>;

/// How to (re)start one child.
#[derive(Clone)]
pub struct ChildSpec {
    name: String,
    kind: &'static str,
    start: StartFn,
    is_supervisor: bool,
}

impl ChildSpec {
    /// A child actor; `make` builds a fresh actor and its arguments for every (re)start.
    pub fn actor<A, F>(name: &str, kind: &'static str, make: F) -> ChildSpec
    where
        A: Actor,
        F: Fn() -> (A, A::Arguments) + Send + Sync + 'static,
    {
        let make = Arc::new(make);
        ChildSpec {
            name: name.to_string(),
            kind,
            start: Arc::new(move |parent| {
                let (actor, args) = make();
                Box::pin(async move {
                    // Children are not registered by name in ractor's global registry: a
                    // restarted child would race its dying predecessor for the name.
                    A::spawn_linked(None, actor, args, parent)
                        .await
                        .map(|(r, _)| r.get_cell())
                })
            }),
            is_supervisor: false,
        }
    }

    /// A child supervisor with its own children.
    pub fn supervisor(
        name: &str,
        path: String,
        policies: Arc<SupervisionConfig>,
        children: Vec<ChildSpec>,
    ) -> ChildSpec {
        let mut spec = ChildSpec::actor(name, "supervisor", move || {
            (
                Supervisor,
                SupervisorArgs {
                    path: path.clone(),
                    policies: policies.clone(),
                    children: children.clone(),
                },
            )
        });
        spec.is_supervisor = true;
        spec
    }

    /// The child's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// The supervisor actor.
pub struct Supervisor;

/// What a supervisor is started with.
pub struct SupervisorArgs {
    /// This supervisor's path (`NODE/...`).
    pub path: String,
    /// Restart policies by kind.
    pub policies: Arc<SupervisionConfig>,
    /// Children, started in order.
    pub children: Vec<ChildSpec>,
}

/// What went wrong addressing an actor by path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TreeError {
    /// Nothing lives at that path.
    #[error("no actor at `{0}`")]
    NotFound(String),
    /// The actor exists but is stopped.
    #[error("`{0}` is stopped")]
    Stopped(String),
    /// A supervisor on the way did not answer.
    #[error("`{0}` did not answer: {1}")]
    Unavailable(String, String),
}

/// Messages a supervisor handles.
pub enum SupervisorMsg {
    /// This supervisor's subtree.
    Tree(RpcReplyPort<ActorInfo>),
    /// Kill the actor at the relative path (a crash, as far as its supervisor knows).
    Kill(Vec<String>, RpcReplyPort<Result<(), TreeError>>),
    /// Stop the actor at the relative path gracefully; it is not restarted.
    Stop(Vec<String>, RpcReplyPort<Result<(), TreeError>>),
    /// Retry starting child `name` (after a failed restart).
    Respawn(String),
    /// Start one more child under the supervisor at the relative path (empty: this one) and
    /// supervise it like the others (a link to a node that joined); nothing happens if a
    /// child of that name exists there.
    Add(Vec<String>, ChildSpec),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Running,
    Restarting,
    Stopped,
}

struct Child {
    spec: ChildSpec,
    cell: Option<ActorCell>,
    status: Status,
    restarts: u32,
    recent: VecDeque<Instant>,
    stop_requested: bool,
    last_exit: Option<String>,
}

impl Child {
    /// A child just started: running, no restart yet.
    fn started(spec: ChildSpec, cell: ActorCell) -> Child {
        Child {
            spec,
            cell: Some(cell),
            status: Status::Running,
            restarts: 0,
            recent: VecDeque::new(),
            stop_requested: false,
            last_exit: None,
        }
    }
}

/// A supervisor's children.
pub struct SupervisorState {
    path: String,
    policies: Arc<SupervisionConfig>,
    children: Vec<Child>,
}

impl SupervisorState {
    fn child_path(&self, name: &str) -> String {
        format!("{}/{name}", self.path)
    }

    fn index_of_cell(&self, cell: &ActorCell) -> Option<usize> {
        let id = cell.get_id();
        self.children
            .iter()
            .position(|c| c.cell.as_ref().is_some_and(|x| x.get_id() == id))
    }

    fn index_of_name(&self, name: &str) -> Option<usize> {
        self.children.iter().position(|c| c.spec.name == name)
    }
}

impl Actor for Supervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<SupervisorMsg>,
        args: SupervisorArgs,
    ) -> Result<SupervisorState, ActorProcessingErr> {
        let mut state = SupervisorState {
            path: args.path,
            policies: args.policies,
            children: Vec::with_capacity(args.children.len()),
        };
        for spec in args.children {
            let cell = (spec.start)(myself.get_cell())
                .await
                .map_err(|e| format!("{}: cannot start: {e}", state.child_path(&spec.name)))?;
            state.children.push(Child::started(spec, cell));
        }
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<SupervisorMsg>,
        msg: SupervisorMsg,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::Tree(reply) => {
                let tree = tree_of(state).await;
                let _ = reply.send(tree);
            }
            SupervisorMsg::Kill(path, reply) => {
                let result = act_on(state, path, Action::Kill).await;
                let _ = reply.send(result);
            }
            SupervisorMsg::Stop(path, reply) => {
                let result = act_on(state, path, Action::Stop).await;
                let _ = reply.send(result);
            }
            SupervisorMsg::Add(path, spec) => {
                if let Some((first, rest)) = path.split_first() {
                    let child = state.index_of_name(first).map(|i| &state.children[i]);
                    match child {
                        Some(c) if c.spec.is_supervisor => {
                            if let Some(cell) = c.cell.clone() {
                                let sup: ActorRef<SupervisorMsg> = cell.into();
                                let _ = sup.cast(SupervisorMsg::Add(rest.to_vec(), spec));
                            }
                        }
                        _ => tracing::error!(
                            supervisor = %state.child_path(first),
                            "cannot add a child: no such supervisor"
                        ),
                    }
                    return Ok(());
                }
                if state.index_of_name(&spec.name).is_some() {
                    return Ok(());
                }
                let path = state.child_path(&spec.name);
                match (spec.start)(myself.get_cell()).await {
                    Ok(cell) => state.children.push(Child::started(spec, cell)),
                    // Not this supervisor's failure: the child was never running.
                    Err(e) => tracing::error!(%path, error = %e, "cannot start an added child"),
                }
            }
            SupervisorMsg::Respawn(name) => {
                if let Some(i) = state.index_of_name(&name) {
                    respawn(&myself, state, i).await;
                }
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<SupervisorMsg>,
        event: SupervisionEvent,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, reason) = match event {
            SupervisionEvent::ActorTerminated(cell, old_state, reason) => {
                // The dead incarnation's state (ports it listened on, threads it ran) is
                // released before a successor starts, so the successor finds them free.
                drop(old_state);
                (cell, reason.unwrap_or_else(|| "exited".to_string()))
            }
            SupervisionEvent::ActorFailed(cell, err) => (cell, format!("failed: {err}")),
            _ => return Ok(()),
        };
        let Some(i) = state.index_of_cell(&cell) else {
            return Ok(()); // an old incarnation we already replaced
        };
        let path = state.child_path(&state.children[i].spec.name);
        let child = &mut state.children[i];
        child.cell = None;
        child.last_exit = Some(reason.clone());
        if child.stop_requested {
            child.status = Status::Stopped;
            tracing::info!(actor = %path, "stopped");
            return Ok(());
        }
        let kind = child.spec.kind;
        let policy = state.policies.policy(kind);
        if !allow_restart(&mut child.recent, policy, Instant::now()) {
            metrics::counter!(m::SUPERVISOR_ESCALATIONS, "kind" => kind).increment(1);
            tracing::error!(
                actor = %path, %reason, max_restarts = policy.max_restarts,
                within = ?policy.within, supervisor = %state.path,
                "restart intensity exceeded; escalating to the parent"
            );
            return Err(format!(
                "{path} failed more than {} times within {:?} (last: {reason})",
                policy.max_restarts, policy.within
            )
            .into());
        }
        child.restarts += 1;
        metrics::counter!(m::ACTOR_RESTARTS, "kind" => kind).increment(1);
        tracing::warn!(actor = %path, %reason, restarts = child.restarts, "restarting");
        respawn(&myself, state, i).await;
        Ok(())
    }
}

/// Records a failure at `now`; whether the policy still allows restarting.
fn allow_restart(recent: &mut VecDeque<Instant>, policy: RestartPolicy, now: Instant) -> bool {
    while recent
        .front()
        .is_some_and(|t| now.duration_since(*t) >= policy.within)
    {
        recent.pop_front();
    }
    if recent.len() >= policy.max_restarts as usize {
        return false;
    }
    recent.push_back(now);
    true
}

async fn respawn(myself: &ActorRef<SupervisorMsg>, state: &mut SupervisorState, i: usize) {
    let path = state.child_path(&state.children[i].spec.name);
    let child = &mut state.children[i];
    if child.cell.is_some() || child.stop_requested {
        return;
    }
    match (child.spec.start)(myself.get_cell()).await {
        Ok(cell) => {
            child.cell = Some(cell);
            child.status = Status::Running;
        }
        Err(e) => {
            // Starting can fail while what it needs is still coming back; keep trying, each
            // attempt counting against nothing but time, and show it as restarting.
            child.status = Status::Restarting;
            tracing::warn!(actor = %path, error = %e, "restart failed; retrying");
            let name = child.spec.name.clone();
            myself.send_after(RESPAWN_DELAY, move || SupervisorMsg::Respawn(name));
        }
    }
}

enum Action {
    Kill,
    Stop,
}

async fn act_on(
    state: &mut SupervisorState,
    path: Vec<String>,
    action: Action,
) -> Result<(), TreeError> {
    let Some((first, rest)) = path.split_first() else {
        return Err(TreeError::NotFound(state.path.clone()));
    };
    let full = state.child_path(first);
    let i = state.index_of_name(first).ok_or_else(|| {
        TreeError::NotFound(
            format!("{full}/{}", rest.join("/"))
                .trim_end_matches('/')
                .to_string(),
        )
    })?;
    let child = &mut state.children[i];
    let cell = child
        .cell
        .clone()
        .ok_or_else(|| TreeError::Stopped(full.clone()))?;
    if !rest.is_empty() {
        if !child.spec.is_supervisor {
            return Err(TreeError::NotFound(format!("{full}/{}", rest.join("/"))));
        }
        let sup: ActorRef<SupervisorMsg> = cell.into();
        let rest = rest.to_vec();
        let call = match action {
            Action::Kill => ractor::call_t!(
                sup,
                SupervisorMsg::Kill,
                TREE_TIMEOUT.as_millis() as u64,
                rest
            ),
            Action::Stop => ractor::call_t!(
                sup,
                SupervisorMsg::Stop,
                TREE_TIMEOUT.as_millis() as u64,
                rest
            ),
        };
        return call.map_err(|e| TreeError::Unavailable(full, e.to_string()))?;
    }
    match action {
        Action::Kill => {
            tracing::warn!(actor = %full, "killed on request");
            cell.kill();
        }
        Action::Stop => {
            tracing::info!(actor = %full, "stopping on request");
            child.stop_requested = true;
            cell.stop(Some("stopped on request".to_string()));
        }
    }
    Ok(())
}

async fn tree_of(state: &SupervisorState) -> ActorInfo {
    // The root supervisor's path is the bare node name; call it `root` among actors.
    let name = match state.path.rsplit_once('/') {
        Some((_, last)) => last.to_string(),
        None => "root".to_string(),
    };
    let mut me = ActorInfo {
        path: state.path.clone(),
        name,
        kind: "supervisor".to_string(),
        status: "running".to_string(),
        restarts: 0,
        last_exit: None,
        children: Vec::with_capacity(state.children.len()),
    };
    for c in &state.children {
        let status = match c.status {
            Status::Running => "running",
            Status::Restarting => "restarting",
            Status::Stopped => "stopped",
        };
        let mut info = ActorInfo {
            path: state.child_path(&c.spec.name),
            name: c.spec.name.clone(),
            kind: c.spec.kind.to_string(),
            status: status.to_string(),
            restarts: c.restarts,
            last_exit: c.last_exit.clone(),
            children: Vec::new(),
        };
        if let (true, Some(cell)) = (c.spec.is_supervisor, &c.cell) {
            let sup: ActorRef<SupervisorMsg> = cell.clone().into();
            match ractor::call_t!(sup, SupervisorMsg::Tree, TREE_TIMEOUT.as_millis() as u64) {
                Ok(sub) => info.children = sub.children,
                Err(e) => info.status = format!("unresponsive ({e})"),
            }
        }
        me.children.push(info);
    }
    me
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restart_intensity_is_a_sliding_window() {
        let policy = RestartPolicy {
            max_restarts: 2,
            within: Duration::from_secs(10),
        };
        let mut recent = VecDeque::new();
        let t0 = Instant::now();
        assert!(allow_restart(&mut recent, policy, t0));
        assert!(allow_restart(
            &mut recent,
            policy,
            t0 + Duration::from_secs(1)
        ));
        assert!(!allow_restart(
            &mut recent,
            policy,
            t0 + Duration::from_secs(2)
        ));
        // The first failure has left the window: one more restart is allowed.
        assert!(allow_restart(
            &mut recent,
            policy,
            t0 + Duration::from_secs(10)
        ));
    }

    #[test]
    fn zero_restarts_escalates_at_once() {
        let policy = RestartPolicy {
            max_restarts: 0,
            within: Duration::from_secs(1),
        };
        assert!(!allow_restart(&mut VecDeque::new(), policy, Instant::now()));
    }
}
