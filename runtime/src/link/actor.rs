//! The supervised actor that owns the link to one peer: dial, authenticate, read answers,
//! reconnect with backoff.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use rand::Rng;
use tokio::task::JoinHandle;

use super::{
    Hello, LinkError, LinkHandle, PeerLink, ReadFailure, Session, Welcome, close_code,
    count_frame_error, kinds, read_frame, write_envelope,
};
use crate::context::NodeContext;
use crate::credentials::CLUSTER_SERVER_NAME;
use crate::metrics as m;
use crate::wire::{self, Envelope, Flow, HANDSHAKE_VERSION, Versions};

/// Owns the connection to one peer.
pub struct LinkActor;

/// What a link actor is started with.
pub struct LinkArgs {
    /// The node's shared context.
    pub ctx: Arc<NodeContext>,
    /// The peer's name.
    pub peer: String,
}

/// Messages the link actor handles.
#[derive(Debug)]
pub enum LinkMsg {
    /// Dial now.
    Connect,
    /// The session of `generation` ended.
    Disconnected {
        /// Which session ended; a stale notice for an older one is ignored.
        generation: u64,
        /// Why.
        reason: String,
    },
}

/// Live state. Dropping it (stop, kill or crash) tears the session down, so a killed link
/// never leaves a half-owned connection behind.
pub struct LinkState {
    ctx: Arc<NodeContext>,
    handle: LinkHandle,
    address: std::net::SocketAddr,
    backoff: Duration,
    generation: u64,
    /// The session this actor owns. The handle's slot may briefly hold a dead predecessor's
    /// session, so the actor never judges its own state by the slot.
    session: Option<Arc<Session>>,
    reader: Option<JoinHandle<()>>,
}

impl Drop for LinkState {
    fn drop(&mut self) {
        self.teardown("link actor stopped");
    }
}

impl LinkState {
    fn teardown(&mut self, reason: &str) {
        if let Some(reader) = self.reader.take() {
            reader.abort();
        }
        if let Some(session) = self.session.take() {
            self.handle.uninstall(&session);
            session
                .connection
                .close(close_code::NORMAL.into(), reason.as_bytes());
            session.fail_pending();
        }
    }

    fn next_backoff(&mut self) -> Duration {
        let link = &self.ctx.config.link;
        let current = self.backoff;
        self.backoff = (self.backoff * 2).min(link.reconnect_max);
        // Jitter keeps a restarted cluster from dialing in lockstep.
        current.mul_f64(rand::rng().random_range(0.8..1.2))
    }
}

impl Actor for LinkActor {
    type Msg = LinkMsg;
    type State = LinkState;
    type Arguments = LinkArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<LinkMsg>,
        args: LinkArgs,
    ) -> Result<LinkState, ActorProcessingErr> {
        let handle = args.ctx.links.get(&args.peer)?;
        let address = args
            .ctx
            .roster
            .node(&args.peer)
            .map(|n| n.address)
            .ok_or_else(|| LinkError::UnknownPeer(args.peer.clone()))?;
        // A killed predecessor's session may still sit in the slot until its state is dropped;
        // it has no owner any more, so close it rather than wait.
        if let Some(stale) = handle.install(None) {
            stale
                .connection
                .close(close_code::NORMAL.into(), b"link actor restarted");
            stale.fail_pending();
        }
        myself.cast(LinkMsg::Connect)?;
        Ok(LinkState {
            session: None,
            backoff: args.ctx.config.link.reconnect_min,
            ctx: args.ctx,
            handle,
            address,
            generation: 0,
            reader: None,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<LinkMsg>,
        msg: LinkMsg,
        state: &mut LinkState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            LinkMsg::Connect => {
                if state.session.is_some() {
                    return Ok(());
                }
                match dial(state).await {
                    Ok((session, recv)) => {
                        state.generation += 1;
                        let generation = state.generation;
                        let session = Arc::new(Session {
                            generation,
                            ..session
                        });
                        state.reader = Some(tokio::spawn(read_answers(
                            session.clone(),
                            recv,
                            state.ctx.config.link.max_frame_bytes,
                            myself.clone(),
                        )));
                        state.session = Some(session.clone());
                        let link = session.link.clone();
                        state.handle.install(Some(session));
                        state.backoff = state.ctx.config.link.reconnect_min;
                        metrics::counter!(m::LINK_CONNECTS, "peer" => state.handle.peer().to_string())
                            .increment(1);
                        tracing::info!(
                            peer = state.handle.peer(),
                            generation,
                            wire = link.wire,
                            build = %link.build,
                            "link up"
                        );
                    }
                    Err(e) => {
                        if matches!(e, LinkError::Refused { .. }) {
                            // A refusal (token, membership, incompatible build) lasts until
                            // someone changes a node: ask again at the slowest pace.
                            state.backoff = state.ctx.config.link.reconnect_max;
                        }
                        let delay = state.next_backoff();
                        if matches!(e, LinkError::Refused { .. }) {
                            tracing::error!(error = %e, retry_in = ?delay, "link refused");
                        } else {
                            tracing::debug!(error = %e, retry_in = ?delay, "link not up");
                        }
                        myself.send_after(delay, || LinkMsg::Connect);
                    }
                }
            }
            LinkMsg::Disconnected { generation, reason } => {
                if generation != state.generation {
                    return Ok(());
                }
                tracing::warn!(peer = state.handle.peer(), %reason, "link down");
                state.teardown(&reason);
                let delay = state.next_backoff();
                myself.send_after(delay, || LinkMsg::Connect);
            }
        }
        Ok(())
    }
}

/// Connects, opens the stream and completes the hello, all within the connect deadline.
async fn dial(state: &LinkState) -> Result<(Session, quinn::RecvStream), LinkError> {
    let ctx = &state.ctx;
    let peer = state.handle.peer().to_string();
    let connect_err = |reason: String| LinkError::Connect {
        peer: peer.clone(),
        reason,
    };
    // A joined node may come back at another address (its hello says so): dial the latest;
    // one the file names by DNS is resolved at every dial (a pod back with a new IP).
    let target = ctx.roster.node(&peer);
    let attempt = async {
        let address = match target.as_ref().and_then(|n| n.dial.clone()) {
            Some(name) => tokio::net::lookup_host(name.as_str())
                .await
                .ok()
                .and_then(|mut addrs| addrs.next())
                .ok_or_else(|| connect_err(format!("cannot resolve `{name}`")))?,
            None => target.as_ref().map_or(state.address, |n| n.address),
        };
        let connection = ctx
            .endpoint
            .connect(address, CLUSTER_SERVER_NAME)
            .map_err(|e| connect_err(e.to_string()))?
            .await
            .map_err(|e| connect_err(e.to_string()))?;
        let (mut send, mut recv) = connection
            .open_bi()
            .await
            .map_err(|e| connect_err(e.to_string()))?;
        let hello = Hello {
            cluster: ctx.config.name.clone(),
            node: ctx.me.name.clone(),
            token: ctx.credentials.token.expose().to_string(),
            wire: Versions::spoken(),
            build: super::build(),
            member: Some(ctx.me.clone()),
        };
        let mut env = Envelope::one_way(
            kinds::HELLO,
            &format!("{}/link", ctx.me.name),
            "link",
            wire::encode_body(&hello),
        );
        env.version = HANDSHAKE_VERSION;
        write_envelope(&mut send, &env)
            .await
            .map_err(|e| connect_err(e.to_string()))?;
        let answer = match read_frame(&mut recv, ctx.config.link.max_frame_bytes).await {
            Ok(Some(answer)) => answer,
            Ok(None) => return Err(connect_err("closed during the hello".into())),
            Err(ReadFailure::Closed(reason)) => {
                // A refusal closes the connection with the reason; report that, not "closed".
                let reason = match connection.close_reason() {
                    Some(quinn::ConnectionError::ApplicationClosed(c))
                        if c.error_code == close_code::REFUSED.into() =>
                    {
                        return Err(LinkError::Refused {
                            peer: peer.clone(),
                            reason: String::from_utf8_lossy(&c.reason).into_owned(),
                        });
                    }
                    _ => reason,
                };
                return Err(connect_err(reason));
            }
            Err(ReadFailure::Wire(error)) => {
                count_frame_error(&peer, &error);
                return Err(LinkError::Wire {
                    peer: peer.clone(),
                    error,
                });
            }
        };
        match answer.kind.as_str() {
            kinds::WELCOME => {
                // A welcome without a body comes from a build that speaks version 1 alone.
                let welcome = if answer.body.is_empty() {
                    Welcome {
                        wire: 1,
                        build: String::new(),
                    }
                } else {
                    wire::decode_body::<Welcome>(&answer.body).map_err(|error| LinkError::Wire {
                        peer: peer.clone(),
                        error,
                    })?
                };
                if !Versions::spoken().contains(welcome.wire) {
                    // The listener chose a version this node does not speak: a broken peer.
                    let reason = format!(
                        "it chose wire version {}, and this node speaks {}",
                        welcome.wire,
                        Versions::spoken()
                    );
                    connection.close(close_code::PROTOCOL.into(), reason.as_bytes());
                    return Err(connect_err(reason));
                }
                Ok((
                    Session {
                        peer: peer.clone(),
                        generation: 0,
                        connection,
                        send: tokio::sync::Mutex::new(send),
                        pending: Default::default(),
                        next_request: AtomicU64::new(1),
                        link: PeerLink {
                            wire: welcome.wire,
                            build: welcome.build,
                        },
                    },
                    recv,
                ))
            }
            kinds::REFUSED => Err(LinkError::Refused {
                peer: peer.clone(),
                reason: wire::decode_body::<String>(&answer.body)
                    .unwrap_or_else(|_| "no reason given".into()),
            }),
            other => Err(connect_err(format!(
                "unexpected `{other}` during the hello"
            ))),
        }
    };
    match tokio::time::timeout(ctx.config.link.connect_timeout, attempt).await {
        Ok(result) => result,
        Err(_) => Err(connect_err(format!(
            "no handshake within {:?}",
            ctx.config.link.connect_timeout
        ))),
    }
}

/// Reads the peer's answers and completes the matching requests until the stream ends.
async fn read_answers(
    session: Arc<Session>,
    mut recv: quinn::RecvStream,
    max: u32,
    link: ActorRef<LinkMsg>,
) {
    let reason = loop {
        match read_frame(&mut recv, max).await {
            Ok(Some(env)) if matches!(env.flow, Flow::Response | Flow::Failure) => {
                match session.pending().remove(&env.request_id) {
                    Some(waiter) => {
                        let _ = waiter.send(env);
                    }
                    // The requester's deadline passed first; the answer is late, not lost.
                    None => metrics::counter!(m::LINK_LATE_ANSWERS, "peer" => session.peer.clone())
                        .increment(1),
                }
            }
            Ok(Some(env)) => {
                let error = wire::WireError::Malformed(format!(
                    "`{}` ({:?}) on the answer stream",
                    env.kind, env.flow
                ));
                count_frame_error(&session.peer, &error);
                session
                    .connection
                    .close(close_code::PROTOCOL.into(), error.to_string().as_bytes());
                break error.to_string();
            }
            Ok(None) => break "peer finished the stream".to_string(),
            Err(ReadFailure::Closed(reason)) => break reason,
            Err(ReadFailure::Wire(error)) => {
                count_frame_error(&session.peer, &error);
                session
                    .connection
                    .close(close_code::PROTOCOL.into(), error.to_string().as_bytes());
                break error.to_string();
            }
        }
    };
    session.fail_pending();
    let _ = link.cast(LinkMsg::Disconnected {
        generation: session.generation,
        reason,
    });
}
