//! Local delivery of envelopes that arrived over a link.
//!
//! An actor that peers may address registers itself here under a service name (its `target`
//! on the wire) when it starts. Registration survives nothing: a restarted actor registers
//! again, replacing the entry of its dead predecessor, so remote senders never hold a stale
//! reference. Delivery is a `cast` into the actor's mailbox; a request carries a [`Reply`]
//! that the actor answers exactly once (dropping it answers with a failure).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use ractor::{ActorId, ActorRef, Message};
use tokio::sync::oneshot;

use crate::wire::{Envelope, RemoteFailure};

/// An envelope delivered to a local actor, with the way to answer it if it is a request.
#[derive(Debug)]
pub struct Inbound {
    /// The envelope as received (sender already authenticated).
    pub envelope: Envelope,
    /// Present for requests.
    pub reply: Option<Reply>,
}

/// The answer slot of one request.
#[derive(Debug)]
pub struct Reply(oneshot::Sender<Result<Vec<u8>, RemoteFailure>>);

impl Reply {
    /// A reply slot and the receiver the link waits on.
    pub fn channel() -> (Reply, oneshot::Receiver<Result<Vec<u8>, RemoteFailure>>) {
        let (tx, rx) = oneshot::channel();
        (Reply(tx), rx)
    }

    /// Answers with a body.
    pub fn ok(self, body: Vec<u8>) {
        // The requester may have given up (deadline); nothing to do then.
        let _ = self.0.send(Ok(body));
    }

    /// Answers with a failure the requester sees as a remote error.
    pub fn fail(self, message: impl Into<String>) {
        let _ = self.0.send(Err(RemoteFailure {
            message: message.into(),
            unavailable: false,
        }));
    }

    /// Answers that nothing could take the request now (see [`RemoteFailure::unavailable`]).
    fn unavailable(self, message: impl Into<String>) {
        let _ = self.0.send(Err(RemoteFailure {
            message: message.into(),
            unavailable: true,
        }));
    }
}

/// Why an inbound envelope could not be handed to a local actor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DispatchError {
    /// No actor is registered under the target name.
    #[error("no service `{0}` on this node")]
    UnknownTarget(String),
    /// The registered actor has stopped (it is being restarted).
    #[error("service `{0}` is not running")]
    TargetDown(String),
}

type Deliver = Box<dyn Fn(Inbound) -> Result<(), Option<Box<Inbound>>> + Send + Sync>;

/// The node's table of remotely addressable actors.
#[derive(Clone, Default)]
pub struct Services {
    inner: Arc<RwLock<HashMap<String, (ActorId, Deliver)>>>,
}

impl Services {
    /// Routes envelopes for `name` to `actor`, replacing any previous registration.
    pub fn register<M>(&self, name: &str, actor: ActorRef<M>)
    where
        M: Message + From<Inbound> + IntoInbound,
    {
        let id = actor.get_id();
        let deliver: Deliver = Box::new(move |inbound| {
            actor.cast(M::from(inbound)).map_err(|e| match e {
                ractor::MessagingErr::SendErr(m) => m.into_inbound().map(Box::new),
                // The message is gone with the mailbox; a dropped Reply answers the request.
                _ => None,
            })
        });
        self.write().insert(name.to_string(), (id, deliver));
    }

    /// Removes `name` if it still belongs to `actor` (a successor may have replaced it).
    pub fn unregister(&self, name: &str, actor: ActorId) {
        let mut map = self.write();
        if map.get(name).is_some_and(|(id, _)| *id == actor) {
            map.remove(name);
        }
    }

    /// Hands `inbound` to its target; on failure the request (if any) is answered with the
    /// reason, so a remote caller never waits for a message nobody will read.
    pub fn dispatch(&self, inbound: Inbound) -> Result<(), DispatchError> {
        let target = inbound.envelope.target.clone();
        let map = self.inner.read().unwrap_or_else(|p| p.into_inner());
        let (error, back) = match map.get(&target) {
            None => (
                DispatchError::UnknownTarget(target),
                Some(Box::new(inbound)),
            ),
            Some((_, deliver)) => match deliver(inbound) {
                Ok(()) => return Ok(()),
                Err(back) => (DispatchError::TargetDown(target), back),
            },
        };
        drop(map);
        if let Some(reply) = back.and_then(|b| b.reply) {
            reply.unavailable(error.to_string());
        }
        Err(error)
    }

    /// Names currently registered (sorted).
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        names.sort();
        names
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, (ActorId, Deliver)>> {
        // A panic while holding this lock leaves the map itself consistent (single inserts).
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// Messages that wrap an [`Inbound`] must give it back when the mailbox is closed, so the
/// dispatcher can answer the request instead of dropping it.
pub trait IntoInbound {
    /// Returns the inbound envelope this message carries, if it carries one.
    fn into_inbound(self) -> Option<Inbound>;
}

/// Implements `From<Inbound>` and [`IntoInbound`] for an actor message that carries remote
/// envelopes: `inbound_message!(struct EchoMsg)` for a newtype around [`Inbound`], or
/// `inbound_message!(enum RouterMsg::Inbound)` for one variant of an enum.
#[macro_export]
macro_rules! inbound_message {
    (struct $ty:ident) => {
        impl From<$crate::services::Inbound> for $ty {
            fn from(i: $crate::services::Inbound) -> Self {
                $ty(i)
            }
        }
        impl $crate::services::IntoInbound for $ty {
            fn into_inbound(self) -> Option<$crate::services::Inbound> {
                Some(self.0)
            }
        }
    };
    (enum $ty:ident :: $variant:ident) => {
        impl From<$crate::services::Inbound> for $ty {
            fn from(i: $crate::services::Inbound) -> Self {
                $ty::$variant(i)
            }
        }
        impl $crate::services::IntoInbound for $ty {
            fn into_inbound(self) -> Option<$crate::services::Inbound> {
                match self {
                    $ty::$variant(i) => Some(i),
                    #[allow(unreachable_patterns)]
                    _ => None,
                }
            }
        }
    };
}
