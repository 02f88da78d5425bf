//! One node process: bind the endpoint and admin API, start the supervision tree, report
//! ready, and drain on SIGTERM or Ctrl-C.
//!
//! ```text
//!   NODE                      root supervisor (path = node name)
//!   ├─ listener               accepts links that peers dial
//!   ├─ links                  supervisor
//!   │  └─ PEER ...            one link actor per peer
//!   ├─ membership             heartbeats, up/down events
//!   └─ ROLE                   supervisor (router, prefill or decode)
//!      └─ echo                link-layer echo (tests, benchmark, supervision drills)
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorRef};
use rand::Rng;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin::{self, AdminState};
use crate::config::{ClusterConfig, NodeConfig};
use crate::context::NodeContext;
use crate::credentials::{Credentials, CredentialsError};
use crate::echo::EchoActor;
use crate::link::listener::ListenerActor;
use crate::link::{LinkActor, LinkArgs, Links, tls};
use crate::membership::{MembershipActor, MembershipView};
use crate::services::Services;
use crate::supervisor::{ChildSpec, Supervisor, SupervisorArgs, SupervisorMsg};

/// The first word of the line a node prints on stdout once it serves; `duet up` waits for it.
pub const READY_MARKER: &str = "node-ready";
/// How many times `duet up` restarted this node's process after it died (set by `duet up` in
/// the environment of a restarted node; shown by `duet tree`).
pub const PROCESS_RESTARTS_ENV: &str = "DUET_NODE_RESTARTS";

/// This process's restarts by `duet up` (see [`PROCESS_RESTARTS_ENV`]).
pub fn process_restarts() -> u32 {
    std::env::var(PROCESS_RESTARTS_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}
/// How long a draining node waits for its actors to stop.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// A node that could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// `--name` is not in the config.
    #[error("no node `{name}` in {file}: the nodes are {known}")]
    UnknownNode {
        /// The name asked for.
        name: String,
        /// The config file.
        file: String,
        /// The names it has.
        known: String,
    },
    /// Credentials missing or unusable.
    #[error(transparent)]
    Credentials(#[from] CredentialsError),
    /// A listening address could not be bound.
    #[error("cannot bind the {what} address {addr}: {reason}")]
    Bind {
        /// `link (UDP)` or `admin (TCP)`.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// Why (for example "address in use").
        reason: String,
    },
    /// TLS configuration failed.
    #[error("TLS setup failed: {0}")]
    Tls(String),
    /// The supervision tree did not start.
    #[error("the supervision tree did not start: {0}")]
    Start(String),
    /// The test-only wire version override is malformed.
    #[error("{0}")]
    WireVersions(String),
}

/// A started node.
pub struct Node {
    ctx: Arc<NodeContext>,
    root: ActorRef<SupervisorMsg>,
    root_done: JoinHandle<()>,
    admin_server: JoinHandle<()>,
    shutdown: watch::Receiver<bool>,
    shutdown_tx: watch::Sender<bool>,
    restart: Arc<std::sync::atomic::AtomicBool>,
    signals: ShutdownSignals,
}

/// The exit code of a node that stopped to be started again (`POST /v1/restart`, as
/// `duet rollout` asks): `EX_TEMPFAIL`. `duet up` starts such a node again at once, without
/// counting it as a crash; Kubernetes restarts any container that exits.
pub const EXIT_RESTART: u8 = 75;

/// How a node's run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exit {
    /// Drained on request (signal or admin API).
    Drained,
    /// Drained to be started again (admin API): the process exits with [`EXIT_RESTART`].
    Restart,
    /// The root supervisor gave up: the restart intensity was exceeded all the way up.
    RootEscalated,
}

impl Node {
    /// Binds, starts the tree and the admin API. Returns once the node serves.
    pub async fn start(config: Arc<ClusterConfig>, name: &str) -> Result<Node, NodeError> {
        Node::start_with(config, name, &|_| Vec::new()).await
    }

    /// Like [`Node::start`], with more actors under the role supervisor (the serving actors,
    /// which this crate knows nothing of).
    pub async fn start_with(
        config: Arc<ClusterConfig>,
        name: &str,
        role_children: &dyn Fn(&Arc<NodeContext>) -> Vec<ChildSpec>,
    ) -> Result<Node, NodeError> {
        let me = config
            .node(name)
            .cloned()
            .ok_or_else(|| NodeError::UnknownNode {
                name: name.to_string(),
                file: config.path.display().to_string(),
                known: config
                    .nodes
                    .iter()
                    .map(|n| n.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            })?;
        Node::start_as(config, me, role_children).await
    }

    /// Starts node `me`: one of the file's, or one joining the cluster from outside the file
    /// (see [`ClusterConfig::joiner`] and [`crate::roster`]): it dials the file's nodes, whose
    /// hellos admit it, and learns the other joined nodes from their heartbeats.
    pub async fn start_as(
        config: Arc<ClusterConfig>,
        me: NodeConfig,
        role_children: &dyn Fn(&Arc<NodeContext>) -> Vec<ChildSpec>,
    ) -> Result<Node, NodeError> {
        let signals = ShutdownSignals::new();
        crate::wire::Versions::from_env().map_err(NodeError::WireVersions)?;
        let credentials = Arc::new(Credentials::load(&config.credentials)?);
        let membership = &config.membership;
        let (server, client) = tls::endpoint_configs(
            &credentials,
            membership.heartbeat_interval.min(Duration::from_secs(1)),
            membership.down_after().max(Duration::from_secs(3)),
        )
        .map_err(|e| NodeError::Tls(e.to_string()))?;
        let mut endpoint =
            quinn::Endpoint::server(server, me.address).map_err(|e| NodeError::Bind {
                what: "link (UDP)",
                addr: me.address,
                reason: bind_reason(&e),
            })?;
        endpoint.set_default_client_config(client);
        let admin_listener =
            tokio::net::TcpListener::bind(me.admin)
                .await
                .map_err(|e| NodeError::Bind {
                    what: "admin (TCP)",
                    addr: me.admin,
                    reason: bind_reason(&e),
                })?;

        let peers: Vec<String> = config.peers_of(&me.name).map(|n| n.name.clone()).collect();
        let ctx = Arc::new(NodeContext {
            links: Links::new(
                &me.name,
                peers.iter().map(String::as_str),
                config.link.max_frame_bytes,
            ),
            membership: Arc::new(MembershipView::new(peers.iter().map(String::as_str))),
            services: Services::default(),
            incarnation: rand::rng().random(),
            drain: crate::drain::Drain::default(),
            roster: crate::roster::Roster::new(config.clone(), &me),
            root: std::sync::OnceLock::new(),
            device: std::sync::Mutex::new(None),
            endpoint,
            credentials,
            me: me.clone(),
            config: config.clone(),
        });

        let (root, root_handle) = Actor::spawn(
            None,
            Supervisor,
            SupervisorArgs {
                path: me.name.clone(),
                policies: Arc::new(config.supervision.clone()),
                children: children(&ctx, &me, &peers, role_children(&ctx)),
            },
        )
        .await
        .map_err(|e| NodeError::Start(e.to_string()))?;
        // From now on a node that joins gets its link actor at once; the ones admitted while
        // the tree was starting get theirs here (adding is idempotent).
        let _ = ctx.root.set(root.clone());
        for n in ctx.roster.joined() {
            if n.name != ctx.me.name {
                let _ = root.cast(SupervisorMsg::Add(
                    vec!["links".into()],
                    link_spec(&ctx, &n.name),
                ));
            }
        }

        let (shutdown_tx, shutdown) = watch::channel(false);
        let restart = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let app = admin::router(AdminState {
            ctx: ctx.clone(),
            root: root.clone(),
            metrics: crate::metrics::install(),
            shutdown: shutdown_tx.clone(),
            restart: restart.clone(),
        });
        let mut stop_admin = shutdown.clone();
        let admin_server = tokio::spawn(async move {
            let serve = axum::serve(admin_listener, app).with_graceful_shutdown(async move {
                let _ = stop_admin.wait_for(|s| *s).await;
            });
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "admin API stopped");
            }
        });
        let root_done = tokio::spawn(async move {
            let _ = root_handle.await;
        });
        Ok(Node {
            ctx,
            root,
            root_done,
            admin_server,
            shutdown,
            shutdown_tx,
            restart,
            signals,
        })
    }

    /// This node's config entry.
    pub fn me(&self) -> &NodeConfig {
        &self.ctx.me
    }

    /// The shared context (links, services, membership).
    pub fn context(&self) -> &Arc<NodeContext> {
        &self.ctx
    }

    /// Runs until a signal, an admin shutdown, or the root supervisor giving up; then drains.
    pub async fn run(mut self) -> Exit {
        let exit = tokio::select! {
            _ = self.signals.recv() => Exit::Drained,
            _ = self.shutdown.wait_for(|s| *s) => {
                if self.restart.load(std::sync::atomic::Ordering::SeqCst) {
                    Exit::Restart
                } else {
                    Exit::Drained
                }
            }
            _ = &mut self.root_done => Exit::RootEscalated,
        };
        match exit {
            Exit::Drained | Exit::Restart => {
                // Admit nothing new, finish what is in flight (up to the drain timeout).
                let drain = &self.ctx.drain;
                drain.start_exit();
                tracing::info!(node = %self.ctx.me.name, timeout = ?drain.timeout(), "draining");
                let left = drain.wait_idle().await;
                if left.is_empty() {
                    tracing::info!(node = %self.ctx.me.name, "drained: no request in flight");
                } else {
                    metrics::counter!(crate::metrics::DRAIN_TIMEOUTS).increment(1);
                    tracing::warn!(node = %self.ctx.me.name, ?left, "drain timeout passed with requests in flight");
                }
            }
            Exit::RootEscalated => {
                tracing::error!(node = %self.ctx.me.name, "the root supervisor gave up; stopping the node")
            }
        }
        self.stop().await;
        exit
    }

    /// Stops the tree, closes links and the admin API.
    pub async fn stop(self) {
        let _ = self.shutdown_tx.send(true);
        if tokio::time::timeout(
            DRAIN_TIMEOUT,
            self.root.stop_and_wait(Some("node draining".into()), None),
        )
        .await
        .is_err()
        {
            tracing::warn!("actors did not stop within {DRAIN_TIMEOUT:?}; killing them");
            self.root.kill();
        }
        self.ctx
            .endpoint
            .close(crate::link::close_code::NORMAL.into(), b"node stopping");
        let _ = tokio::time::timeout(Duration::from_secs(1), self.ctx.endpoint.wait_idle()).await;
        let _ = tokio::time::timeout(Duration::from_secs(2), self.admin_server).await;
    }
}

/// The supervised link actor to `peer`.
pub(crate) fn link_spec(ctx: &Arc<NodeContext>, peer: &str) -> ChildSpec {
    let (ctx, peer) = (ctx.clone(), peer.to_string());
    ChildSpec::actor(&peer.clone(), "link", move || {
        (
            LinkActor,
            LinkArgs {
                ctx: ctx.clone(),
                peer: peer.clone(),
            },
        )
    })
}

fn children(
    ctx: &Arc<NodeContext>,
    me: &NodeConfig,
    peers: &[String],
    extra: Vec<ChildSpec>,
) -> Vec<ChildSpec> {
    let policies = Arc::new(ctx.config.supervision.clone());
    let links = peers.iter().map(|peer| link_spec(ctx, peer)).collect();
    let c = ctx.clone();
    let listener = ChildSpec::actor("listener", "listener", move || (ListenerActor, c.clone()));
    let c = ctx.clone();
    let membership = ChildSpec::actor("membership", "membership", move || {
        (MembershipActor, c.clone())
    });
    let c = ctx.clone();
    let echo = ChildSpec::actor("echo", "echo", move || (EchoActor, c.clone()));
    let role = me.role.as_str();
    let mut role_actors = vec![echo];
    role_actors.extend(extra);
    vec![
        listener,
        ChildSpec::supervisor(
            "links",
            format!("{}/links", me.name),
            policies.clone(),
            links,
        ),
        membership,
        ChildSpec::supervisor(role, format!("{}/{role}", me.name), policies, role_actors),
    ]
}

fn bind_reason(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::AddrInUse => {
            "address in use (is another node or cluster running?)".into()
        }
        std::io::ErrorKind::AddrNotAvailable => "address not available on this host".into(),
        std::io::ErrorKind::PermissionDenied => "permission denied".into(),
        _ => e.to_string(),
    }
}

/// SIGTERM and SIGINT (Ctrl-C), listened to from creation on.
///
/// Create it before the process announces itself: a signal that arrives while no listener
/// exists is lost once tokio's handler is installed, so a fresh listener per wait would drop a
/// SIGTERM sent right after "ready".
pub struct ShutdownSignals {
    term: Option<tokio::signal::unix::Signal>,
    int: Option<tokio::signal::unix::Signal>,
}

impl ShutdownSignals {
    /// Starts listening.
    pub fn new() -> ShutdownSignals {
        use tokio::signal::unix::{SignalKind, signal};
        ShutdownSignals {
            term: signal(SignalKind::terminate()).ok(),
            int: signal(SignalKind::interrupt()).ok(),
        }
    }

    /// Resolves on the next SIGTERM or SIGINT (including one that arrived since the last call).
    pub async fn recv(&mut self) {
        let term = async {
            match self.term.as_mut() {
                Some(s) => {
                    s.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        let int = async {
            match self.int.as_mut() {
                Some(s) => {
                    s.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = term => {}
            _ = int => {}
        }
    }
}

impl Default for ShutdownSignals {
    fn default() -> Self {
        ShutdownSignals::new()
    }
}
