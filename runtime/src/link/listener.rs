//! Accepts links that peers dial, authenticates them, and delivers their envelopes locally.

use std::sync::Arc;
use std::time::Duration;

use quinn::Incoming;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

use super::{
    Hello, ReadFailure, Welcome, close_code, count_frame_error, kinds, read_frame, write_envelope,
};
use crate::context::NodeContext;
use crate::metrics as m;
use crate::services::{Inbound, Reply};
use crate::wire::{self, Envelope, Flow, HANDSHAKE_VERSION, RemoteFailure, Versions, WireError};

/// Owns the accept loop of the node's endpoint.
pub struct ListenerActor;

/// The accept loop; aborted when the actor's state is dropped (also on kill).
pub struct ListenerState {
    accept: JoinHandle<()>,
}

impl Drop for ListenerState {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl Actor for ListenerActor {
    type Msg = ();
    type State = ListenerState;
    type Arguments = Arc<NodeContext>;

    async fn pre_start(
        &self,
        _myself: ActorRef<()>,
        ctx: Arc<NodeContext>,
    ) -> Result<ListenerState, ActorProcessingErr> {
        let accept = tokio::spawn(async move {
            while let Some(incoming) = ctx.endpoint.accept().await {
                tokio::spawn(serve(ctx.clone(), incoming));
            }
        });
        Ok(ListenerState { accept })
    }
}

/// Why an inbound connection was refused; also the metric label.
fn refuse_label(reason: &str) -> &'static str {
    if reason.starts_with("incompatible builds") {
        "version"
    } else if reason.contains("token") {
        "token"
    } else if reason.contains("cluster") {
        "cluster"
    } else {
        "node"
    }
}

async fn serve(ctx: Arc<NodeContext>, incoming: Incoming) {
    let remote = incoming.remote_address();
    let connection = match incoming.await {
        Ok(c) => c,
        Err(e) => {
            metrics::counter!(m::LINK_HANDSHAKE_FAILURES, "reason" => "tls").increment(1);
            tracing::warn!(%remote, error = %e, "refused a link: TLS handshake failed");
            return;
        }
    };
    let timeout = ctx.config.link.connect_timeout;
    let max = ctx.config.link.max_frame_bytes;
    let Ok(Ok((mut send, mut recv))) = tokio::time::timeout(timeout, connection.accept_bi()).await
    else {
        connection.close(close_code::PROTOCOL.into(), b"no stream opened");
        return;
    };
    let hello = match tokio::time::timeout(timeout, read_frame(&mut recv, max)).await {
        Ok(Ok(Some(env))) if env.kind == kinds::HELLO => {
            wire::decode_body::<Hello>(&env.body).map_err(|e| format!("malformed hello: {e}"))
        }
        Ok(Ok(Some(env))) => Err(format!("expected a hello, got `{}`", env.kind)),
        Ok(Ok(None)) | Ok(Err(ReadFailure::Closed(_))) => return,
        Ok(Err(ReadFailure::Wire(e))) => Err(format!("bad hello frame: {e}")),
        Err(_) => Err(format!("no hello within {timeout:?}")),
    };
    let member = hello.as_ref().ok().and_then(|h| h.member.clone());
    let verdict = hello.and_then(|h| {
        if h.cluster != ctx.config.name {
            Err(format!(
                "cluster `{}` is not this cluster (`{}`)",
                h.cluster, ctx.config.name
            ))
        } else if !ctx.credentials.token.matches(&h.token) {
            Err("wrong cluster token".to_string())
        } else if h.node == ctx.me.name {
            Err(format!("node `{}` is this node", h.node))
        } else if ctx.roster.node(&h.node).is_none()
            && h.member.as_ref().is_none_or(|m| m.name != h.node)
        {
            Err(format!(
                "node `{}` is not in cluster.toml and did not say how to reach it",
                h.node
            ))
        } else {
            // Two builds link when they share a wire version (a rolling upgrade); otherwise
            // the dialer is told both ranges instead of failing on its first message.
            let mine = Versions::spoken();
            match mine.negotiate(h.wire) {
                Some(version) => Ok((h.node, version, h.build)),
                None => Err(format!(
                    "incompatible builds: `{}` ({}) speaks wire version {}, `{}` ({}) speaks {}",
                    h.node,
                    if h.build.is_empty() {
                        "an older build"
                    } else {
                        &h.build
                    },
                    h.wire,
                    ctx.me.name,
                    super::build(),
                    mine
                )),
            }
        }
    });
    let (peer, version, build) = match verdict {
        Ok(accepted) => {
            // Credentials checked: a node outside the file joins (or says where it is now).
            if let Some(m) = member.filter(|m| m.name == accepted.0) {
                ctx.admit(&m);
            }
            accepted
        }
        Err(reason) => {
            metrics::counter!(m::LINK_HANDSHAKE_FAILURES, "reason" => refuse_label(&reason))
                .increment(1);
            tracing::warn!(%remote, %reason, "refused a link");
            let mut env = reply_to("link", kinds::REFUSED, 0, wire::encode_body(&reason), &ctx);
            env.version = HANDSHAKE_VERSION;
            let _ = write_envelope(&mut send, &env).await;
            connection.close(close_code::REFUSED.into(), reason.as_bytes());
            return;
        }
    };
    let body = wire::encode_body(&Welcome {
        wire: version,
        build: super::build(),
    });
    let mut welcome = reply_to("link", kinds::WELCOME, 0, body, &ctx);
    welcome.version = HANDSHAKE_VERSION;
    if write_envelope(&mut send, &welcome).await.is_err() {
        return;
    }
    tracing::info!(%peer, %remote, wire = version, %build, "accepted a link");
    let send = Arc::new(Mutex::new(send));
    loop {
        let env = match read_frame(&mut recv, max).await {
            Ok(Some(env)) => env,
            Ok(None) | Err(ReadFailure::Closed(_)) => break,
            Err(ReadFailure::Wire(error)) => {
                protocol_error(&connection, &peer, error);
                break;
            }
        };
        if env.sender_node() != peer {
            let error =
                WireError::Malformed(format!("sender `{}` on the link of `{peer}`", env.sender));
            protocol_error(&connection, &peer, error);
            break;
        }
        metrics::counter!(m::LINK_MESSAGES_RECEIVED, "peer" => peer.clone()).increment(1);
        match env.flow {
            Flow::OneWay => {
                if let Err(e) = ctx.services.dispatch(Inbound {
                    envelope: env,
                    reply: None,
                }) {
                    // One-way messages have nobody to answer to: count and log each one.
                    metrics::counter!(m::LINK_UNDELIVERED, "peer" => peer.clone()).increment(1);
                    tracing::warn!(%peer, error = %e, "undeliverable one-way message");
                }
            }
            Flow::Request { deadline_ms } => {
                let (reply, answer) = Reply::channel();
                let request_id = env.request_id;
                let kind = env.kind.clone();
                let target = env.target.clone();
                let _ = ctx.services.dispatch(Inbound {
                    envelope: env,
                    reply: Some(reply),
                });
                let send = send.clone();
                let ctx = ctx.clone();
                let deadline = Duration::from_millis(u64::from(deadline_ms));
                tokio::spawn(async move {
                    let (flow, body) = match tokio::time::timeout(deadline, answer).await {
                        Ok(Ok(Ok(body))) => (Flow::Response, body),
                        Ok(Ok(Err(refused))) => (Flow::Failure, wire::encode_body(&refused)),
                        Ok(Err(_)) => (
                            Flow::Failure,
                            failure(format!("`{target}` dropped the request `{kind}`")),
                        ),
                        // The requester has given up too; answering helps nobody.
                        Err(_) => return,
                    };
                    let mut env = reply_to(&target, &kind, request_id, body, &ctx);
                    env.flow = flow;
                    env.version = version;
                    let _ = write_envelope(&mut *send.lock().await, &env).await;
                });
            }
            Flow::Response | Flow::Failure => {
                let error = WireError::Malformed("an answer on a request stream".into());
                protocol_error(&connection, &peer, error);
                break;
            }
        }
    }
}

fn failure(message: String) -> Vec<u8> {
    wire::encode_body(&RemoteFailure {
        message,
        unavailable: false,
    })
}

fn reply_to(from: &str, kind: &str, request_id: u64, body: Vec<u8>, ctx: &NodeContext) -> Envelope {
    Envelope {
        version: HANDSHAKE_VERSION,
        kind: kind.to_string(),
        flow: Flow::Response,
        sender: format!("{}/{from}", ctx.me.name),
        target: String::new(),
        request_id,
        traceparent: None,
        tracestate: None,
        body,
    }
}

fn protocol_error(connection: &quinn::Connection, peer: &str, error: WireError) {
    count_frame_error(peer, &error);
    tracing::warn!(%peer, %error, "closing a link after a bad frame");
    connection.close(close_code::PROTOCOL.into(), error.to_string().as_bytes());
}
