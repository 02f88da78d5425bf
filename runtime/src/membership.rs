//! Membership: which peers are up, from heartbeats over the links.
//!
//! Every `heartbeat_interval` the membership actor pings each peer's membership actor with a
//! request whose deadline is one interval. A peer that answers is up; a peer that has not
//! answered for `failure_threshold` intervals (`down_after`) is marked down. Transitions are
//! logged, counted, published on [`MembershipView::events`] (a ractor output port local actors
//! subscribe to), and visible in the admin API. An answer carries the peer's incarnation, so a
//! restarted peer is recognised as new even if it came back between two pings.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, OutputPort};
use serde::{Deserialize, Serialize};

use crate::context::NodeContext;
use crate::metrics as m;
use crate::services::Inbound;
use crate::wire;

/// Service name of the membership actor on every node.
pub const SERVICE: &str = "membership";
/// Envelope kind of a heartbeat.
pub const PING: &str = "membership.ping";

/// A peer's state as this node sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PeerState {
    /// Not heard from since this node started (and not yet past the deadline).
    Unknown,
    /// Answering heartbeats.
    Up,
    /// Silent for longer than `down_after`.
    Down,
}

/// What the admin API shows per peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerStatus {
    /// Up, down or unknown.
    pub state: PeerState,
    /// Round trip of the last answered heartbeat, in microseconds.
    pub rtt_us: Option<u64>,
    /// The peer's current incarnation.
    pub incarnation: Option<u64>,
    /// How many times it went from up to down.
    pub downs: u32,
}

/// A change in a peer's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MembershipEvent {
    /// The peer answers (first time, after being down, or as a new incarnation).
    Up {
        /// The peer.
        peer: String,
        /// Its incarnation.
        incarnation: u64,
    },
    /// The peer stopped answering.
    Down {
        /// The peer.
        peer: String,
    },
}

/// The node's view of its peers, shared with the admin API and subscribers.
pub struct MembershipView {
    peers: RwLock<BTreeMap<String, PeerStatus>>,
    /// Up/down events; subscribe with `events.subscribe(actor, |e| Some(Msg::from(e)))`.
    pub events: OutputPort<MembershipEvent>,
}

impl MembershipView {
    /// A view where every peer is unknown.
    pub fn new<'a>(peers: impl Iterator<Item = &'a str>) -> MembershipView {
        MembershipView {
            peers: RwLock::new(
                peers
                    .map(|p| {
                        (
                            p.to_string(),
                            PeerStatus {
                                state: PeerState::Unknown,
                                rtt_us: None,
                                incarnation: None,
                                downs: 0,
                            },
                        )
                    })
                    .collect(),
            ),
            events: OutputPort::default(),
        }
    }

    /// A peer that joined: unknown until it answers.
    pub fn add(&self, peer: &str) {
        let mut peers = self.peers.write().unwrap_or_else(|p| p.into_inner());
        peers.entry(peer.to_string()).or_insert(PeerStatus {
            state: PeerState::Unknown,
            rtt_us: None,
            incarnation: None,
            downs: 0,
        });
    }

    /// A copy of every peer's status.
    pub fn snapshot(&self) -> BTreeMap<String, PeerStatus> {
        self.peers.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Whether `peer` is up.
    pub fn is_up(&self, peer: &str) -> bool {
        self.snapshot()
            .get(peer)
            .is_some_and(|s| s.state == PeerState::Up)
    }

    fn update(&self, peer: &str, f: impl FnOnce(&mut PeerStatus)) {
        let mut peers = self.peers.write().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = peers.get_mut(peer) {
            f(s);
        }
    }
}

#[derive(Serialize, Deserialize)]
struct Pong {
    incarnation: u64,
    /// The nodes outside cluster.toml the answering node knows (itself, if it joined): the
    /// gossip that spreads a join to every member (see [`crate::roster`]).
    #[serde(default)]
    joined: Vec<crate::config::NodeConfig>,
}

/// A heartbeat's answer: the peer's incarnation, the round trip, the joined nodes it knows.
type Answered = Result<(u64, Duration, Vec<crate::config::NodeConfig>), String>;

/// The membership actor.
pub struct MembershipActor;

/// Messages the membership actor handles.
#[derive(Debug)]
pub enum MembershipMsg {
    /// Time to ping every peer.
    Tick,
    /// A ping finished.
    Answer {
        /// The peer pinged.
        peer: String,
        /// Its incarnation and the round trip, or why it failed.
        result: Answered,
    },
    /// A ping from a peer, to answer.
    Inbound(Inbound),
}

crate::inbound_message!(enum MembershipMsg::Inbound);

/// The actor's state: last answer per peer and pings in flight.
pub struct MembershipState {
    ctx: Arc<NodeContext>,
    started: Instant,
    last_ok: BTreeMap<String, Instant>,
    in_flight: HashSet<String>,
}

impl Actor for MembershipActor {
    type Msg = MembershipMsg;
    type State = MembershipState;
    type Arguments = Arc<NodeContext>;

    async fn pre_start(
        &self,
        myself: ActorRef<MembershipMsg>,
        ctx: Arc<NodeContext>,
    ) -> Result<MembershipState, ActorProcessingErr> {
        ctx.services.register(SERVICE, myself.clone());
        myself.send_interval(ctx.config.membership.heartbeat_interval, || {
            MembershipMsg::Tick
        });
        myself.cast(MembershipMsg::Tick)?;
        Ok(MembershipState {
            ctx,
            started: Instant::now(),
            last_ok: BTreeMap::new(),
            in_flight: HashSet::new(),
        })
    }

    async fn post_stop(
        &self,
        myself: ActorRef<MembershipMsg>,
        state: &mut MembershipState,
    ) -> Result<(), ActorProcessingErr> {
        state.ctx.services.unregister(SERVICE, myself.get_id());
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<MembershipMsg>,
        msg: MembershipMsg,
        state: &mut MembershipState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            MembershipMsg::Inbound(Inbound { reply, .. }) => {
                if let Some(reply) = reply {
                    reply.ok(wire::encode_body(&Pong {
                        incarnation: state.ctx.incarnation,
                        joined: state.ctx.roster.joined(),
                    }));
                }
            }
            MembershipMsg::Tick => tick(&myself, state),
            MembershipMsg::Answer { peer, result } => {
                state.in_flight.remove(&peer);
                answer(state, &peer, result);
            }
        }
        Ok(())
    }
}

fn tick(myself: &ActorRef<MembershipMsg>, state: &mut MembershipState) {
    let interval = state.ctx.config.membership.heartbeat_interval;
    let down_after = state.ctx.config.membership.down_after();
    let now = Instant::now();
    for link in state.ctx.links.all() {
        let peer = link.peer().to_string();
        let silent_since = state.last_ok.get(&peer).copied().unwrap_or(state.started);
        if now.duration_since(silent_since) >= down_after {
            mark_down(&state.ctx, &peer);
        }
        if !state.in_flight.insert(peer.clone()) {
            continue;
        }
        let me = myself.clone();
        tokio::spawn(async move {
            let sent = Instant::now();
            let result = link
                .request(PING, SERVICE, SERVICE, Vec::new(), interval)
                .await
                .map_err(|e| e.to_string())
                .and_then(|body| {
                    wire::decode_body::<Pong>(&body)
                        .map(|p| (p.incarnation, sent.elapsed(), p.joined))
                        .map_err(|e| e.to_string())
                });
            let _ = me.cast(MembershipMsg::Answer { peer, result });
        });
    }
}

fn answer(state: &mut MembershipState, peer: &str, result: Answered) {
    let ctx = &state.ctx;
    match result {
        Ok((incarnation, rtt, joined)) => {
            // A member vouches for the nodes it admitted: link to the ones this node lacks.
            for n in &joined {
                ctx.admit(n);
            }
            state.last_ok.insert(peer.to_string(), Instant::now());
            let mut event = None;
            ctx.membership.update(peer, |s| {
                let new_life = s.incarnation.is_some_and(|i| i != incarnation);
                if s.state != PeerState::Up || new_life {
                    tracing::info!(%peer, incarnation, restarted = new_life, "peer up");
                    event = Some(MembershipEvent::Up {
                        peer: peer.to_string(),
                        incarnation,
                    });
                }
                s.state = PeerState::Up;
                s.rtt_us = Some(rtt.as_micros() as u64);
                s.incarnation = Some(incarnation);
            });
            if let Some(event) = event {
                metrics::gauge!(m::PEER_UP, "peer" => peer.to_string()).set(1.0);
                metrics::counter!(m::PEER_TRANSITIONS, "peer" => peer.to_string(), "state" => "up")
                    .increment(1);
                ctx.membership.events.send(event);
            }
        }
        Err(reason) => {
            tracing::debug!(%peer, %reason, "heartbeat missed");
            let down_after = ctx.config.membership.down_after();
            let silent_since = state.last_ok.get(peer).copied().unwrap_or(state.started);
            if silent_since.elapsed() >= down_after {
                mark_down(ctx, peer);
            }
        }
    }
}

fn mark_down(ctx: &NodeContext, peer: &str) {
    let mut changed = false;
    ctx.membership.update(peer, |s| {
        if s.state != PeerState::Down {
            changed = true;
            if s.state == PeerState::Up {
                s.downs += 1;
            }
            s.state = PeerState::Down;
            s.rtt_us = None;
        }
    });
    if changed {
        tracing::warn!(%peer, after = ?ctx.config.membership.down_after(), "peer down");
        metrics::gauge!(m::PEER_UP, "peer" => peer.to_string()).set(0.0);
        metrics::counter!(m::PEER_TRANSITIONS, "peer" => peer.to_string(), "state" => "down")
            .increment(1);
        ctx.membership.events.send(MembershipEvent::Down {
            peer: peer.to_string(),
        });
    }
}
