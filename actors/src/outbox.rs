//! Sending one-way messages to peers from engine and sender threads.
//!
//! Engine threads never touch the async runtime: they push [`Outgoing`] messages into an
//! unbounded channel, and one task per worker sends them over the links in order. Order per
//! peer is what the protocol relies on (a chunk notice before the done that follows it).

use std::sync::Arc;

use duet_runtime::context::NodeContext;
use duet_runtime::wire;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// One message for a peer's service.
#[derive(Debug)]
pub struct Outgoing {
    /// The peer node.
    pub node: String,
    /// Its service.
    pub service: &'static str,
    /// The envelope kind.
    pub kind: &'static str,
    /// The encoded body.
    pub body: Vec<u8>,
}

/// The sending half engine threads hold.
#[derive(Debug, Clone)]
pub struct Outbox {
    tx: mpsc::UnboundedSender<Outgoing>,
}

impl Outbox {
    /// Queues `body` for `service` on `node`. Returns false when the outbox task is gone
    /// (the worker is stopping).
    pub fn send(
        &self,
        node: &str,
        service: &'static str,
        kind: &'static str,
        body: &impl Serialize,
    ) -> bool {
        self.tx
            .send(Outgoing {
                node: node.to_string(),
                service,
                kind,
                body: wire::encode_body(body),
            })
            .is_ok()
    }
}

/// Starts the task that delivers an outbox's messages, sent as `from` service.
pub fn start(ctx: Arc<NodeContext>, from: &'static str) -> (Outbox, JoinHandle<()>) {
    let (tx, mut rx) = mpsc::unbounded_channel::<Outgoing>();
    let task = tokio::spawn(async move {
        while let Some(m) = rx.recv().await {
            let sent = if m.node == ctx.me.name {
                let sender = format!("{}/{from}", ctx.me.name);
                let envelope = wire::Envelope::one_way(m.kind, &sender, m.service, m.body);
                ctx.services
                    .dispatch(duet_runtime::services::Inbound {
                        envelope,
                        reply: None,
                    })
                    .map_err(|e| e.to_string())
            } else {
                match ctx.links.get(&m.node) {
                    Ok(link) => link
                        .send(m.kind, from, m.service, m.body)
                        .await
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                }
            };
            if let Err(error) = sent {
                // The peer's own deadlines fail what this message was about.
                tracing::warn!(node = %m.node, kind = m.kind, %error, "cannot deliver");
            }
        }
    });
    (Outbox { tx }, task)
}
