//! Sending one-way messages to peers from engine and sender threads.
//!
//! Engine threads never touch the async runtime: they push [`Outgoing`] messages into an
//! unbounded channel, and one task per worker sends them over the links in order. Order per
//! peer is what the protocol relies on (a chunk notice before the done that follows it).
//!
//! A link that is (re)connecting refuses a send; a lost `TransferDone` would strand a request
//! until its deadline, so a refused send is retried for [`RETRY_FOR`] before it is given up
//! (and the peer's deadlines take over).

use std::sync::Arc;

use duet_runtime::context::NodeContext;
use duet_runtime::wire;
use std::time::Duration;

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

impl Outgoing {
    /// `body` for `service` on `node`, encoded.
    pub fn new(
        node: &str,
        service: &'static str,
        kind: &'static str,
        body: &impl Serialize,
    ) -> Outgoing {
        Outgoing {
            node: node.to_string(),
            service,
            kind,
            body: wire::encode_body(body),
        }
    }
}

/// The sending half engine threads hold.
#[derive(Debug, Clone)]
pub struct Outbox {
    tx: mpsc::UnboundedSender<Outgoing>,
}

impl Outbox {
    /// Queues a message already encoded. Returns false when the outbox task is gone.
    pub fn queue(&self, message: Outgoing) -> bool {
        self.tx.send(message).is_ok()
    }

    /// Queues `body` for `service` on `node`. Returns false when the outbox task is gone
    /// (the worker is stopping).
    pub fn send(
        &self,
        node: &str,
        service: &'static str,
        kind: &'static str,
        body: &impl Serialize,
    ) -> bool {
        self.queue(Outgoing::new(node, service, kind, body))
    }
}

#[cfg(test)]
impl Outbox {
    /// An outbox whose messages a test reads from the receiver.
    pub(crate) fn channel() -> (Outbox, mpsc::UnboundedReceiver<Outgoing>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Outbox { tx }, rx)
    }
}

/// How long a message to a peer whose link is not up is retried.
pub const RETRY_FOR: Duration = Duration::from_secs(10);

/// Sends one message to `service` on `node`, retrying while the link is not up (for at most
/// [`RETRY_FOR`]). A message to this node itself is dispatched locally.
pub async fn send_reliably(
    ctx: &NodeContext,
    from: &str,
    node: &str,
    service: &str,
    kind: &str,
    body: Vec<u8>,
) -> Result<(), String> {
    let start = tokio::time::Instant::now();
    let mut wait = Duration::from_millis(10);
    loop {
        let sent = if node == ctx.me.name {
            let sender = format!("{}/{from}", ctx.me.name);
            let envelope = wire::Envelope::one_way(kind, &sender, service, body.clone());
            ctx.services
                .dispatch(duet_runtime::services::Inbound {
                    envelope,
                    reply: None,
                })
                .map_err(|e| e.to_string())
        } else {
            match ctx.links.get(node) {
                Ok(link) => link
                    .send(kind, from, service, body.clone())
                    .await
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            }
        };
        match sent {
            Ok(()) => return Ok(()),
            Err(e) if start.elapsed() >= RETRY_FOR => return Err(e),
            Err(_) => {
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_millis(200));
            }
        }
    }
}

/// Starts the task that delivers an outbox's messages, sent as `from` service.
pub fn start(ctx: Arc<NodeContext>, from: &'static str) -> (Outbox, JoinHandle<()>) {
    let (tx, mut rx) = mpsc::unbounded_channel::<Outgoing>();
    let task = tokio::spawn(async move {
        while let Some(m) = rx.recv().await {
            let sent = send_reliably(&ctx, from, &m.node, m.service, m.kind, m.body).await;
            if let Err(error) = sent {
                // The peer's own deadlines fail what this message was about.
                tracing::warn!(node = %m.node, kind = m.kind, %error, "cannot deliver");
            }
        }
    });
    (Outbox { tx }, task)
}
