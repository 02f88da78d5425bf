//! Links between nodes: Duet's own thin layer over quinn.
//!
//! Each node runs one QUIC endpoint (server and client on the node's `address`). For every
//! peer, a supervised [`LinkActor`] dials it, authenticates (TLS 1.3 with the pinned cluster
//! certificate, then a hello carrying the cluster token) and keeps one bidirectional stream
//! open. Everything this node sends to that peer goes down that stream, in order; the peer
//! answers requests on the same stream. What the peer sends to us arrives on the connection
//! *it* dialed, which the [`listener`] serves. So each direction has its own ordered stream
//! and no connection is shared between two owners.
//!
//! ```text
//!   node A                                   node B
//!   LinkActor(B) --dial--> [stream A->B] --> listener: dispatch to B's services
//!        ^                                   |   (requests answered on the same stream)
//!        +------------- responses -----------+
//!   listener <-- [stream B->A] <--dial-- LinkActor(A)
//! ```
//!
//! Senders use a [`LinkHandle`], which writes straight onto the live session (no mailbox hop
//! on the hot path); the actor owns the session's lifecycle: dial, reconnect with backoff,
//! tear down. A write to a peer that is not connected fails at once with
//! [`LinkError::NotConnected`]: nothing is queued or dropped silently.

mod actor;
mod fault;
pub mod listener;
pub mod tls;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use quinn::{RecvStream, SendStream};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

pub use actor::{LinkActor, LinkArgs};

use crate::metrics as m;
use crate::wire::{self, Envelope, FRAME_HEADER_LEN, Flow, RemoteFailure, Versions, WireError};

/// QUIC application close codes.
pub mod close_code {
    /// Orderly shutdown of a link.
    pub const NORMAL: u32 = 0;
    /// The hello was refused (token, cluster name or unknown node).
    pub const REFUSED: u32 = 1;
    /// The peer sent a frame that could not be decoded or broke the protocol.
    pub const PROTOCOL: u32 = 2;
}

/// Envelope kinds of the handshake.
pub mod kinds {
    /// Dialer -> listener, first frame: [`super::Hello`].
    pub const HELLO: &str = "link.hello";
    /// Listener -> dialer: accepted.
    pub const WELCOME: &str = "link.welcome";
    /// Listener -> dialer: refused, body is the reason (a string).
    pub const REFUSED: &str = "link.refused";
}

/// The first frame on a new link.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hello {
    /// Cluster name from cluster.toml; two clusters never join by mistake.
    pub cluster: String,
    /// The dialing node.
    pub node: String,
    /// The cluster token.
    pub token: String,
    /// The wire versions the dialer speaks (absent from builds before versions were
    /// negotiated: they speak version 1 alone).
    #[serde(default = "Versions::legacy")]
    pub wire: Versions,
    /// The dialer's build, for people (`duet tree`, the membership API).
    #[serde(default)]
    pub build: String,
    /// The dialer's entry (role, addresses): how a node outside cluster.toml joins. The
    /// listener records it only once the credentials are checked, and only for a node the
    /// file does not list (the file wins).
    #[serde(default)]
    pub member: Option<crate::config::NodeConfig>,
}

/// The listener's answer to an accepted [`Hello`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Welcome {
    /// The version both sides use on this link from now on.
    pub wire: u16,
    /// The listener's build.
    pub build: String,
}

/// This build, as a hello names it.
pub fn build() -> String {
    format!("duet {}", env!("CARGO_PKG_VERSION"))
}

/// What is known of a connected peer: the version its link uses and its build.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerLink {
    /// The wire version in use.
    pub wire: u16,
    /// The peer's build.
    pub build: String,
}

/// Why a link operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    /// The peer is not in cluster.toml.
    #[error("unknown peer `{0}`")]
    UnknownPeer(String),
    /// No live connection to the peer right now (it is down or reconnecting).
    #[error("no link to `{peer}`: not connected")]
    NotConnected {
        /// The peer.
        peer: String,
    },
    /// The connection dropped while the request was outstanding.
    #[error("link to `{peer}` dropped: {reason}")]
    Disconnected {
        /// The peer.
        peer: String,
        /// What closed it.
        reason: String,
    },
    /// No answer within the request's deadline.
    #[error("`{peer}` did not answer `{kind}` within {deadline:?}")]
    DeadlineExceeded {
        /// The peer.
        peer: String,
        /// The request's kind.
        kind: String,
        /// The deadline that passed.
        deadline: Duration,
    },
    /// The peer answered with a failure.
    #[error("`{peer}` failed `{kind}`: {message}")]
    Remote {
        /// The peer.
        peer: String,
        /// The request's kind.
        kind: String,
        /// The failure it reported.
        message: String,
        /// Nothing on the peer could take the request (its target is not running: being
        /// restarted); asking again shortly is likely to work.
        unavailable: bool,
    },
    /// The peer refused our hello.
    #[error("`{peer}` refused the link: {reason}")]
    Refused {
        /// The peer.
        peer: String,
        /// The reason it gave.
        reason: String,
    },
    /// Dialing or the handshake failed.
    #[error("cannot connect to `{peer}`: {reason}")]
    Connect {
        /// The peer.
        peer: String,
        /// The cause.
        reason: String,
    },
    /// A frame could not be decoded.
    #[error("bad frame from `{peer}`: {error}")]
    Wire {
        /// The peer.
        peer: String,
        /// The decoding error.
        error: WireError,
    },
}

impl LinkError {
    /// Whether retrying the same call later may succeed (the peer may come back).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            LinkError::NotConnected { .. }
                | LinkError::Disconnected { .. }
                | LinkError::DeadlineExceeded { .. }
                | LinkError::Connect { .. }
        )
    }

    /// A short label for metrics.
    pub fn error_type(&self) -> &'static str {
        match self {
            LinkError::UnknownPeer(_) => "unknown_peer",
            LinkError::NotConnected { .. } => "not_connected",
            LinkError::Disconnected { .. } => "disconnected",
            LinkError::DeadlineExceeded { .. } => "deadline",
            LinkError::Remote { .. } => "remote",
            LinkError::Refused { .. } => "refused",
            LinkError::Connect { .. } => "connect",
            LinkError::Wire { .. } => "wire",
        }
    }
}

type Pending = Mutex<HashMap<u64, oneshot::Sender<Envelope>>>;

/// A live, authenticated connection to one peer.
pub(crate) struct Session {
    peer: String,
    generation: u64,
    connection: quinn::Connection,
    send: tokio::sync::Mutex<SendStream>,
    pending: Pending,
    next_request: AtomicU64,
    /// The negotiated wire version and the peer's build.
    link: PeerLink,
}

impl Session {
    async fn write(&self, env: &Envelope) -> Result<(), LinkError> {
        let frame = wire::encode_frame(env);
        let mut send = self.send.lock().await;
        send.write_all(&frame)
            .await
            .map_err(|e| LinkError::Disconnected {
                peer: self.peer.clone(),
                reason: e.to_string(),
            })
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, HashMap<u64, oneshot::Sender<Envelope>>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fails every outstanding request (their receivers see the sender dropped).
    fn fail_pending(&self) {
        self.pending().clear();
    }
}

/// The way to send to one peer. Cheap to clone; stays valid across reconnects and restarts
/// of the peer's link actor.
#[derive(Clone)]
pub struct LinkHandle {
    peer: String,
    local_node: String,
    max_frame: u32,
    slot: Arc<RwLock<Option<Arc<Session>>>>,
}

impl LinkHandle {
    fn new(peer: &str, local_node: &str, max_frame: u32) -> LinkHandle {
        LinkHandle {
            peer: peer.to_string(),
            local_node: local_node.to_string(),
            max_frame,
            slot: Arc::default(),
        }
    }

    /// The peer's name.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Whether a session is live right now.
    pub fn is_connected(&self) -> bool {
        self.session().is_some()
    }

    /// The version and build of the live session's peer; `None` when not connected.
    pub fn peer_link(&self) -> Option<PeerLink> {
        self.session().map(|s| s.link.clone())
    }

    fn session(&self) -> Option<Arc<Session>> {
        self.slot.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn install(&self, session: Option<Arc<Session>>) -> Option<Arc<Session>> {
        std::mem::replace(
            &mut *self.slot.write().unwrap_or_else(|p| p.into_inner()),
            session,
        )
    }

    /// Clears the slot if it still holds `session`.
    fn uninstall(&self, session: &Arc<Session>) {
        let mut slot = self.slot.write().unwrap_or_else(|p| p.into_inner());
        if slot.as_ref().is_some_and(|s| Arc::ptr_eq(s, session)) {
            *slot = None;
        }
    }

    fn envelope(
        &self,
        session: &Session,
        kind: &str,
        from: &str,
        target: &str,
        flow: Flow,
        body: Vec<u8>,
    ) -> Envelope {
        // The current span's context, so the peer's spans join the same trace (the
        // tracestate only where the peer reads it; `encode_frame` drops it otherwise).
        let trace = crate::telemetry::TraceHeaders::current();
        Envelope {
            version: session.link.wire,
            kind: kind.to_string(),
            flow,
            sender: format!("{}/{from}", self.local_node),
            target: target.to_string(),
            request_id: 0,
            traceparent: trace.traceparent,
            body,
            tracestate: trace.tracestate,
        }
    }

    /// Sends a one-way message from local actor `from` to service `target` on the peer.
    /// `Ok` means it was written to the link, in order after everything sent before it.
    pub async fn send(
        &self,
        kind: &str,
        from: &str,
        target: &str,
        body: Vec<u8>,
    ) -> Result<(), LinkError> {
        let session = self.session().ok_or_else(|| self.not_connected())?;
        let env = self.envelope(&session, kind, from, target, Flow::OneWay, body);
        self.check_size(&env)?;
        match fault::draw(kind) {
            fault::Fault::Pass => session.write(&env).await?,
            fault::Fault::Duplicate => {
                session.write(&env).await?;
                session.write(&env).await?;
            }
            fault::Fault::Delay(after) => {
                tokio::spawn(async move {
                    tokio::time::sleep(after).await;
                    let _ = session.write(&env).await;
                });
            }
        }
        metrics::counter!(m::LINK_MESSAGES_SENT, "peer" => self.peer.clone()).increment(1);
        Ok(())
    }

    /// Sends a request and waits for its answer, at most `deadline`.
    pub async fn request(
        &self,
        kind: &str,
        from: &str,
        target: &str,
        body: Vec<u8>,
        deadline: Duration,
    ) -> Result<Vec<u8>, LinkError> {
        let session = self.session().ok_or_else(|| self.not_connected())?;
        let deadline_ms = u32::try_from(deadline.as_millis()).unwrap_or(u32::MAX);
        let mut env = self.envelope(
            &session,
            kind,
            from,
            target,
            Flow::Request { deadline_ms },
            body,
        );
        env.request_id = session.next_request.fetch_add(1, Ordering::Relaxed);
        self.check_size(&env)?;
        let id = env.request_id;
        let (tx, rx) = oneshot::channel();
        session.pending().insert(id, tx);
        let answer = tokio::time::timeout(deadline, async {
            session.write(&env).await?;
            metrics::counter!(m::LINK_MESSAGES_SENT, "peer" => self.peer.clone()).increment(1);
            rx.await.map_err(|_| LinkError::Disconnected {
                peer: self.peer.clone(),
                reason: "connection closed before the answer".into(),
            })
        })
        .await;
        let answer = match answer {
            Ok(result) => result,
            Err(_) => {
                session.pending().remove(&id);
                return Err(LinkError::DeadlineExceeded {
                    peer: self.peer.clone(),
                    kind: kind.to_string(),
                    deadline,
                });
            }
        };
        let reply = match answer {
            Ok(reply) => reply,
            Err(e) => {
                session.pending().remove(&id);
                return Err(e);
            }
        };
        match reply.flow {
            Flow::Response => Ok(reply.body),
            _ => {
                let failure = wire::decode_body::<RemoteFailure>(&reply.body).unwrap_or_else(|e| {
                    RemoteFailure {
                        message: format!("undecodable failure: {e}"),
                        unavailable: false,
                    }
                });
                Err(LinkError::Remote {
                    peer: self.peer.clone(),
                    kind: kind.to_string(),
                    message: failure.message,
                    unavailable: failure.unavailable,
                })
            }
        }
    }

    fn check_size(&self, env: &Envelope) -> Result<(), LinkError> {
        // Refuse locally what the peer would refuse, so the error lands on the caller.
        if env.body.len() + 512 > self.max_frame as usize {
            return Err(LinkError::Wire {
                peer: self.peer.clone(),
                error: WireError::Oversized {
                    len: env.body.len() as u64,
                    max: self.max_frame,
                },
            });
        }
        Ok(())
    }

    fn not_connected(&self) -> LinkError {
        LinkError::NotConnected {
            peer: self.peer.clone(),
        }
    }
}

/// One [`LinkHandle`] per peer of this node: the file's nodes, and nodes that joined.
#[derive(Clone)]
pub struct Links {
    local_node: String,
    max_frame: u32,
    handles: Arc<RwLock<BTreeMap<String, LinkHandle>>>,
}

impl Links {
    /// Handles for `peers`, sending as `local_node`.
    pub fn new<'a>(
        local_node: &str,
        peers: impl Iterator<Item = &'a str>,
        max_frame: u32,
    ) -> Links {
        Links {
            local_node: local_node.to_string(),
            max_frame,
            handles: Arc::new(RwLock::new(
                peers
                    .map(|p| (p.to_string(), LinkHandle::new(p, local_node, max_frame)))
                    .collect(),
            )),
        }
    }

    fn map(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, LinkHandle>> {
        self.handles.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The handle for `peer`.
    pub fn get(&self, peer: &str) -> Result<LinkHandle, LinkError> {
        self.map()
            .get(peer)
            .cloned()
            .ok_or_else(|| LinkError::UnknownPeer(peer.to_string()))
    }

    /// Every handle, by peer name.
    pub fn all(&self) -> Vec<LinkHandle> {
        self.map().values().cloned().collect()
    }

    /// A handle for a peer that joined (nothing if there is one).
    pub fn add(&self, peer: &str) {
        let mut handles = self.handles.write().unwrap_or_else(|p| p.into_inner());
        handles
            .entry(peer.to_string())
            .or_insert_with(|| LinkHandle::new(peer, &self.local_node, self.max_frame));
    }
}

/// Reads one frame. `Ok(None)` is a clean end of stream at a frame boundary.
pub(crate) async fn read_frame(
    recv: &mut RecvStream,
    max: u32,
) -> Result<Option<Envelope>, ReadFailure> {
    let mut header = [0u8; FRAME_HEADER_LEN];
    match recv.read_exact(&mut header).await {
        Ok(()) => {}
        Err(quinn::ReadExactError::FinishedEarly(0)) => return Ok(None),
        Err(quinn::ReadExactError::FinishedEarly(got)) => {
            return Err(ReadFailure::Wire(WireError::Truncated {
                expected: FRAME_HEADER_LEN,
                got,
            }));
        }
        Err(quinn::ReadExactError::ReadError(e)) => return Err(ReadFailure::Closed(e.to_string())),
    }
    let len = wire::frame_len(header, max).map_err(ReadFailure::Wire)?;
    let mut payload = vec![0u8; len];
    match recv.read_exact(&mut payload).await {
        Ok(()) => {}
        Err(quinn::ReadExactError::FinishedEarly(got)) => {
            return Err(ReadFailure::Wire(WireError::Truncated {
                expected: len,
                got,
            }));
        }
        Err(quinn::ReadExactError::ReadError(e)) => return Err(ReadFailure::Closed(e.to_string())),
    }
    wire::decode_payload(&payload)
        .map(Some)
        .map_err(ReadFailure::Wire)
}

/// Why reading a stream stopped.
#[derive(Debug)]
pub(crate) enum ReadFailure {
    /// The peer sent something undecodable: count it and close the stream.
    Wire(WireError),
    /// The connection went away.
    Closed(String),
}

/// Writes one envelope on a raw stream (handshake and listener replies).
pub(crate) async fn write_envelope(
    send: &mut SendStream,
    env: &Envelope,
) -> Result<(), quinn::WriteError> {
    send.write_all(&wire::encode_frame(env)).await
}

/// Counts a frame error from `peer` (one place, so the label set stays consistent).
pub(crate) fn count_frame_error(peer: &str, error: &WireError) {
    metrics::counter!(m::LINK_FRAME_ERRORS, "peer" => peer.to_string(), "reason" => error.reason())
        .increment(1);
}
