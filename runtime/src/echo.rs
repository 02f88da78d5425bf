//! The echo actor: answers requests with their body and counts one-way messages.
//!
//! It exists so the link layer can be exercised and benchmarked between real nodes
//! (`echo.ping` round trips; `echo.count` after a burst of one-way `echo.note`s), and so
//! operators have a harmless actor to kill when trying supervision.

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::context::NodeContext;
use crate::services::Inbound;
use crate::wire;

/// Service name of the echo actor.
pub const SERVICE: &str = "echo";
/// Request: answered with the same body.
pub const PING: &str = "echo.ping";
/// One-way: counted.
pub const NOTE: &str = "echo.note";
/// Request: answered with the number of notes received so far (a `u64`).
pub const COUNT: &str = "echo.count";

/// The echo actor.
pub struct EchoActor;

/// Only remote messages.
#[derive(Debug)]
pub struct EchoMsg(Inbound);

crate::inbound_message!(struct EchoMsg);

/// Notes received since this actor (re)started.
pub struct EchoState {
    ctx: Arc<NodeContext>,
    notes: u64,
}

impl Actor for EchoActor {
    type Msg = EchoMsg;
    type State = EchoState;
    type Arguments = Arc<NodeContext>;

    async fn pre_start(
        &self,
        myself: ActorRef<EchoMsg>,
        ctx: Arc<NodeContext>,
    ) -> Result<EchoState, ActorProcessingErr> {
        ctx.services.register(SERVICE, myself);
        Ok(EchoState { ctx, notes: 0 })
    }

    async fn post_stop(
        &self,
        myself: ActorRef<EchoMsg>,
        state: &mut EchoState,
    ) -> Result<(), ActorProcessingErr> {
        state.ctx.services.unregister(SERVICE, myself.get_id());
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<EchoMsg>,
        EchoMsg(inbound): EchoMsg,
        state: &mut EchoState,
    ) -> Result<(), ActorProcessingErr> {
        let Inbound { envelope, reply } = inbound;
        match (envelope.kind.as_str(), reply) {
            (PING, Some(reply)) => reply.ok(envelope.body),
            (COUNT, Some(reply)) => reply.ok(wire::encode_body(&state.notes)),
            (NOTE, None) => state.notes += 1,
            (other, Some(reply)) => reply.fail(format!("echo does not handle `{other}`")),
            (other, None) => {
                tracing::warn!(kind = other, "echo ignored an unknown one-way message")
            }
        }
        Ok(())
    }
}
