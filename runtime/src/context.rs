//! What every actor of a node shares: config, credentials, endpoint, links, services.

use std::sync::Arc;

use crate::config::{ClusterConfig, NodeConfig};
use crate::credentials::Credentials;
use crate::link::Links;
use crate::membership::MembershipView;
use crate::roster::{Admission, Roster};
use crate::services::Services;
use crate::supervisor::SupervisorMsg;
use ractor::ActorRef;

/// The node-wide context handed to actors as their arguments. It outlives every actor, so a
/// restarted actor finds the same links, services and membership view as its predecessor.
pub struct NodeContext {
    /// The whole cluster.
    pub config: Arc<ClusterConfig>,
    /// This node's entry.
    pub me: NodeConfig,
    /// The cluster credentials.
    pub credentials: Arc<Credentials>,
    /// The node's QUIC endpoint (server and client).
    pub endpoint: quinn::Endpoint,
    /// Remotely addressable local actors.
    pub services: Services,
    /// Handles to send to each peer.
    pub links: Links,
    /// Who is up, and the port to subscribe to changes.
    pub membership: Arc<MembershipView>,
    /// Random id of this process's life; peers see a new one after a restart.
    pub incarnation: u64,
    /// Graceful drain (SIGTERM): the flag actors check, and their work probes.
    pub drain: crate::drain::Drain,
    /// The file's nodes and the ones that joined since.
    pub roster: Roster,
    /// The root supervisor, once the tree runs (links to joined nodes start under it).
    pub root: std::sync::OnceLock<ActorRef<SupervisorMsg>>,
    /// The device this node's worker owns for its current incarnation (`cpu`, `cuda:N`):
    /// set when the worker starts, cleared when it stops; `duet tree` shows it.
    pub device: std::sync::Mutex<Option<String>>,
}

impl NodeContext {
    /// Records a node that joined (from its hello, or from a peer's gossip) and, if it is
    /// new, gives it a link (a supervised link actor) and a place in the membership view.
    /// Only called for nodes whose credentials were checked, or that a member vouched for.
    pub fn admit(self: &Arc<Self>, n: &NodeConfig) {
        match self.roster.admit(n) {
            Admission::Known => {}
            Admission::Moved => {
                tracing::info!(peer = %n.name, address = %n.address, "a joined node moved");
            }
            Admission::New => {
                tracing::info!(peer = %n.name, role = %n.role, address = %n.address, "a node joined");
                metrics::counter!(crate::metrics::NODES_JOINED).increment(1);
                self.links.add(&n.name);
                self.membership.add(&n.name);
                if let Some(root) = self.root.get() {
                    let spec = crate::node::link_spec(self, &n.name);
                    let _ = root.cast(SupervisorMsg::Add(vec!["links".into()], spec));
                }
            }
        }
    }
}
