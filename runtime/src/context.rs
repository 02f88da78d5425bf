//! What every actor of a node shares: config, credentials, endpoint, links, services.

use std::sync::Arc;

use crate::config::{ClusterConfig, NodeConfig};
use crate::credentials::Credentials;
use crate::link::Links;
use crate::membership::MembershipView;
use crate::services::Services;

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
}
