//! Sending one-way messages to peers from engine and sender threads.
//!
//! Engine threads never touch the async runtime: they push [`Outgoing`] messages into an
//! unbounded channel, and the worker's outbox task hands each to its peer's queue, where one
//! task per peer sends them over the link in order. Order per peer is what the protocol relies
//! on (a chunk notice before the done that follows it); across peers nothing is ordered.
//!
//! A link that is (re)connecting refuses a send; a lost `TransferDone` would strand a request
//! until its deadline, so a refused send is retried for [`RETRY_FOR`] before it is given up
//! (and the peer's deadlines take over). That wait is why each peer has its own queue: with
//! one queue for all, each message to a node that had gone away held every later message,
//! to healthy nodes too, for up to 10 s, long enough for their transfers to miss their
//! no-progress deadline.

use std::collections::HashMap;
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

/// Starts the task that delivers an outbox's messages, sent as `from` service. Aborting it
/// stops every peer's delivery.
pub fn start(ctx: Arc<NodeContext>, from: &'static str) -> (Outbox, JoinHandle<()>) {
    let (tx, rx) = mpsc::unbounded_channel::<Outgoing>();
    let task = tokio::spawn(deliver_by_peer(rx, move |m: Outgoing| {
        let ctx = ctx.clone();
        async move {
            let sent = send_reliably(&ctx, from, &m.node, m.service, m.kind, m.body).await;
            if let Err(error) = sent {
                // The peer's own deadlines fail what this message was about.
                tracing::warn!(node = %m.node, kind = m.kind, %error, "cannot deliver");
            }
        }
    }));
    (Outbox { tx }, task)
}

/// Delivers each message of `rx` with `deliver`, in order per peer node, one peer's
/// deliveries never waiting for another's. Returns once `rx` is closed and every queue is
/// delivered; dropped (aborted), it stops every peer's task with it.
async fn deliver_by_peer<F, Fut>(mut rx: mpsc::UnboundedReceiver<Outgoing>, deliver: F)
where
    F: Fn(Outgoing) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let mut peers: HashMap<String, mpsc::UnboundedSender<Outgoing>> = HashMap::new();
    let mut deliveries = tokio::task::JoinSet::new();
    while let Some(m) = rx.recv().await {
        let queue = peers.entry(m.node.clone()).or_insert_with(|| {
            let (tx, mut queue) = mpsc::unbounded_channel::<Outgoing>();
            let deliver = deliver.clone();
            deliveries.spawn(async move {
                while let Some(m) = queue.recv().await {
                    deliver(m).await;
                }
            });
            tx
        });
        let _ = queue.send(m);
    }
    drop(peers);
    while deliveries.join_next().await.is_some() {}
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// The next delivery, within a deadline (one that never comes fails the test).
    async fn next(seen: &mut mpsc::UnboundedReceiver<(String, String)>) -> (String, String) {
        tokio::time::timeout(Duration::from_secs(30), seen.recv())
            .await
            .expect("a message delivered")
            .expect("the outbox runs")
    }

    #[tokio::test]
    async fn a_peer_that_cannot_be_reached_holds_up_only_its_own_messages() {
        let (outbox, rx) = Outbox::channel();
        let (delivered, mut seen) = mpsc::unbounded_channel::<(String, String)>();
        let gone = Arc::new(tokio::sync::Notify::new());
        let link_back = gone.clone();
        let task = tokio::spawn(deliver_by_peer(rx, move |m: Outgoing| {
            let (delivered, link_back) = (delivered.clone(), link_back.clone());
            async move {
                if m.node == "d1" {
                    // Retrying for as long as its link stays down.
                    link_back.notified().await;
                }
                let _ = delivered.send((m.node, m.kind.to_string()));
            }
        }));
        outbox.send("d1", "worker", "done", &1u32);
        outbox.send("d0", "worker", "chunk", &2u32);
        outbox.send("d0", "worker", "done", &3u32);
        outbox.send("d1", "worker", "abort_ack", &4u32);
        assert_eq!(next(&mut seen).await, ("d0".into(), "chunk".into()));
        assert_eq!(next(&mut seen).await, ("d0".into(), "done".into()));
        gone.notify_one();
        assert_eq!(next(&mut seen).await, ("d1".into(), "done".into()));
        gone.notify_one();
        assert_eq!(next(&mut seen).await, ("d1".into(), "abort_ack".into()));
        drop(outbox);
        task.await
            .expect("the outbox ends once its senders are gone");
    }
}
