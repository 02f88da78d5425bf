//! Duet's serving actors, on top of the runtime (nodes, links, supervision), the engine and
//! the KV data plane.
//!
//! ```text
//!   router node                 prefill node                          decode node
//!   NODE/router/router ──────► NODE/prefill/bootstrap (queue) ◄─────── NODE/decode/worker
//!   (HTTP, OpenAI API,          NODE/prefill/worker (engine,   notice   (engine, batch,
//!    pairs P and D)              KvSender) ═══ KV pages ═══════════════► pool endpoint,
//!                               NODE/prefill/sender             NODE/decode/receiver (TCP))
//!          ◄──────────────────────── tokens, load reports ──────────────┘
//! ```
//!
//! - [`protocol`]: every message, with the request's state diagram.
//! - [`router`]: the router actor, its pair selection and its OpenAI-compatible HTTP front.
//! - [`bootstrap`]: prefill's bootstrap queue (requests wait for decode's pages there).
//! - [`prefill`]: the prefill worker and its KV sender.
//! - [`decode`]: the decode worker (continuous batch, local prefill of short prompts, the
//!   receiving side of transfers).
//! - [`error`]: typed failures: the code the wire carries, the class the router acts on.
//! - [`handoff`]: the supervised actor of the KV sender's and KV receiver's threads.
//! - [`outbox`]: ordered one-way messages from engine threads.
//! - [`history`]: the page-ownership event log that fault tests check independently.
//! - [`settings`]: the `[serving]` table of cluster.toml.
//! - [`step_log`]: one line per engine step (`serving.step_log`): its size, wall and CPU time,
//!   and how long its thread waited for its core ([`step_clock`]).

use std::sync::Arc;

use duet_runtime::config::Role;
use duet_runtime::context::NodeContext;
use duet_runtime::supervisor::ChildSpec;

pub mod bootstrap;
pub mod decode;
pub mod error;
pub mod handoff;
pub mod history;
pub mod outbox;
pub mod prefill;
pub mod protocol;
pub mod router;
pub mod settings;
pub(crate) mod step_clock;
pub mod step_log;
pub mod worker;

#[cfg(test)]
pub(crate) mod testing;

/// The serving actors a node of `role` runs under its role supervisor.
pub fn role_children(ctx: &Arc<NodeContext>) -> Vec<ChildSpec> {
    let c = ctx.clone();
    match ctx.me.role {
        Role::Router => {
            // Outlives the actor's restarts: the HTTP server and the streams it serves.
            let home = Arc::new(router::RouterHome::default());
            vec![ChildSpec::actor("router", "router", move || {
                (router::RouterActor, (c.clone(), home.clone()))
            })]
        }
        Role::Prefill => {
            let c2 = c.clone();
            // The worker and its KV sender share the sender thread's hand-off.
            let hub = Arc::new(prefill::SenderHub::default());
            let hub2 = hub.clone();
            vec![
                ChildSpec::actor("bootstrap", "bootstrap", move || {
                    (bootstrap::Bootstrap, c.clone())
                }),
                ChildSpec::actor("worker", "worker", move || {
                    (prefill::PrefillWorker, (c2.clone(), hub.clone()))
                }),
                ChildSpec::actor("sender", "kv_sender", move || {
                    (handoff::HandOffActor::default(), hub2.clone())
                }),
            ]
        }
        Role::Decode => {
            // The worker and its KV receiver share the receiver's hand-off.
            let hub = Arc::new(decode::ReceiverHub::default());
            let hub2 = hub.clone();
            vec![
                ChildSpec::actor("worker", "worker", move || {
                    (decode::DecodeWorker, (c.clone(), hub.clone()))
                }),
                ChildSpec::actor("receiver", "kv_receiver", move || {
                    (handoff::HandOffActor::default(), hub2.clone())
                }),
            ]
        }
    }
}
