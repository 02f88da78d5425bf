//! Duet's serving actors, on top of the runtime (nodes, links, supervision) and the engine.
//!
//! ```text
//!   router node                               prefill / decode nodes
//!   NODE/router/router  (HTTP, OpenAI API) ──► NODE/ROLE/worker  (engine + colocated scheduler)
//!          ◄── tokens, load reports ──────────┘
//! ```
//!
//! - [`protocol`]: the messages between router and workers.
//! - [`router`]: the router actor and its OpenAI-compatible HTTP front.
//! - [`worker`]: the colocated worker actor.
//! - [`settings`]: the `[serving]` table of cluster.toml.

use std::sync::Arc;

use duet_runtime::config::Role;
use duet_runtime::context::NodeContext;
use duet_runtime::supervisor::ChildSpec;

pub mod protocol;
pub mod router;
pub mod settings;
pub mod worker;

/// The serving actors a node of `role` runs under its role supervisor.
pub fn role_children(ctx: &Arc<NodeContext>) -> Vec<ChildSpec> {
    let c = ctx.clone();
    match ctx.me.role {
        Role::Router => vec![ChildSpec::actor("router", "router", move || {
            (router::RouterActor, c.clone())
        })],
        Role::Prefill | Role::Decode => {
            vec![ChildSpec::actor("worker", "worker", move || {
                (worker::WorkerActor, c.clone())
            })]
        }
    }
}
