//! What can end a request's attempt on a worker, typed: each failure has a [`ErrorCode`] that
//! travels on the wire (in [`TokenItem`] and [`TransferFailed`]) and a [`FailureClass`] the
//! router's attempt policy acts on (retry free, retry with budget, retry elsewhere, or fail
//! the request). The message stays for people (logs, the client's error text); no decision is
//! ever taken by reading it.
//!
//! | code          | class     | router does                                        |
//! |---------------|-----------|----------------------------------------------------|
//! | `admission`   | `Attempt` | retries on another worker (pools differ per node)  |
//! | `prealloc`    | `Attempt` | retries elsewhere, one of `serving.retries`        |
//! | `peer_lost`   | `Attempt` | retries (or migrates: the client has tokens); `Restart` when the prefill worker restarted |
//! | `stalled`     | `Stalled` | retries around the prefill worker that stalled     |
//! | `bad_kv`      | `Attempt` | retries; the KV was never served                   |
//! | `restart`     | `Restart` | retries free (bounded): machinery restarted        |
//! | `bootstrap`   | `Attempt` | retries: prefill's queue dropped it                |
//! | `engine`      | `Attempt` | retries elsewhere                                  |
//! | `worker_lost` | `Attempt` | retries (or migrates); `Restart` when the worker restarted |
//! | `router_restart` | `RouterRestart` | retries free and at once               |
//! | `timeout`     | `Fatal`   | fails the request: its own deadline passed         |
//!
//! [`TokenItem`]: crate::protocol::TokenItem
//! [`TransferFailed`]: crate::protocol::TransferFailed

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::protocol::FailureClass;

/// A failure's kind, as the wire carries it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// From a peer of an older build that sent no code.
    #[default]
    Unknown,
    /// The request can never fit this worker (its pool or context too small).
    Admission,
    /// Decode could not reserve pages for the prompt.
    Prealloc,
    /// The other worker of the pair went away.
    PeerLost,
    /// The transfer made no progress for its deadline.
    Stalled,
    /// The KV failed a check (checksum, a write still landing): never served.
    BadKv,
    /// Serving machinery restarted under the attempt.
    Restart,
    /// Prefill's bootstrap queue dropped the request.
    Bootstrap,
    /// An engine step failed.
    Engine,
    /// The worker holding the attempt went away (seen by the router).
    WorkerLost,
    /// The router's own actor restarted under the attempt.
    RouterRestart,
    /// The request's own deadline passed.
    Timeout,
}

impl ErrorCode {
    /// Its name in metrics, logs and the client's error `code`.
    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::Unknown => "unknown",
            ErrorCode::Admission => "admission",
            ErrorCode::Prealloc => "prealloc",
            ErrorCode::PeerLost => "peer_lost",
            ErrorCode::Stalled => "stalled",
            ErrorCode::BadKv => "bad_kv",
            ErrorCode::Restart => "restart",
            ErrorCode::Bootstrap => "bootstrap",
            ErrorCode::Engine => "engine",
            ErrorCode::WorkerLost => "worker_lost",
            ErrorCode::RouterRestart => "router_restart",
            ErrorCode::Timeout => "timeout",
        }
    }
}

/// A failure of a request's attempt on a worker or in the router.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServingError {
    /// The request can never be served by this worker (another's pool may be larger).
    #[error("decode admission: {0}")]
    Admission(String),
    /// Decode could not reserve pages.
    #[error("decode prealloc: {0}")]
    Prealloc(String),
    /// No pages came free for the prompt in time.
    #[error("decode prealloc: no pages for the prompt within {0:?}")]
    NoPages(Duration),
    /// The prefill worker of the pair is gone (`how`: lost, unreachable).
    #[error("decode {phase}: prefill {node} {how}: {why}")]
    PeerLost {
        /// `prealloc` or `transfer`.
        phase: &'static str,
        /// The prefill node.
        node: String,
        /// `lost` or `unreachable`.
        how: &'static str,
        /// The cause.
        why: String,
        /// The prefill worker restarted (a new incarnation is proven: its node is up), as
        /// opposed to its node being unreachable.
        restarted: bool,
    },
    /// The transfer made no progress for its deadline.
    #[error(
        "decode transfer: no progress for {limit:?} (prefill {node} computed and wrote nothing for it)"
    )]
    Stalled {
        /// The deadline.
        limit: Duration,
        /// The prefill node.
        node: String,
    },
    /// The KV that arrived is not served.
    #[error("decode transfer: {0}; not served")]
    BadKv(String),
    /// Machinery restarted under the attempt (names what).
    #[error("{0}")]
    Restart(String),
    /// Prefill's bootstrap queue or engine dropped the request.
    #[error("prefill {0}")]
    Prefill(String),
    /// An engine step or the admission of transferred KV failed (names which).
    #[error("decode {0}")]
    Engine(String),
    /// The worker holding the attempt is gone.
    #[error("worker {worker} lost: {cause}")]
    WorkerLost {
        /// The worker.
        worker: String,
        /// Why the router thinks so.
        cause: String,
        /// Its load report came from a new incarnation: it restarted and is back.
        restarted: bool,
    },
    /// The request's own deadline (`serving.request_timeout_secs`) passed.
    #[error("decode: no token within the request timeout of {0:?}")]
    Timeout(Duration),
    /// The router's actor restarted under the attempt; its successor takes it over.
    #[error("router: the router actor restarted")]
    RouterRestart,
    /// A failure a peer reported on the wire.
    #[error("{message}")]
    Remote {
        /// Its code.
        code: ErrorCode,
        /// Its class.
        class: FailureClass,
        /// Its text.
        message: String,
    },
}

impl ServingError {
    /// The code the wire carries.
    pub fn code(&self) -> ErrorCode {
        match self {
            ServingError::Admission(_) => ErrorCode::Admission,
            ServingError::Prealloc(_) | ServingError::NoPages(_) => ErrorCode::Prealloc,
            ServingError::PeerLost { .. } => ErrorCode::PeerLost,
            ServingError::Stalled { .. } => ErrorCode::Stalled,
            ServingError::BadKv(_) => ErrorCode::BadKv,
            ServingError::Restart(_) => ErrorCode::Restart,
            ServingError::Prefill(_) => ErrorCode::Bootstrap,
            ServingError::Engine(_) => ErrorCode::Engine,
            ServingError::WorkerLost { .. } => ErrorCode::WorkerLost,
            ServingError::Timeout(_) => ErrorCode::Timeout,
            ServingError::RouterRestart => ErrorCode::RouterRestart,
            ServingError::Remote { code, .. } => *code,
        }
    }

    /// What the router does about it.
    pub fn class(&self) -> FailureClass {
        match self {
            ServingError::Timeout(_) => FailureClass::Fatal,
            ServingError::RouterRestart => FailureClass::RouterRestart,
            ServingError::Stalled { .. } => FailureClass::Stalled,
            ServingError::Restart(_) => FailureClass::Restart,
            // A restart proven by a new incarnation is machinery restarting, like a KV sender's
            // (retried free, bounded); a worker that vanished costs an attempt.
            ServingError::WorkerLost {
                restarted: true, ..
            }
            | ServingError::PeerLost {
                restarted: true, ..
            } => FailureClass::Restart,
            ServingError::Remote { class, .. } => *class,
            _ => FailureClass::Attempt,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_classes_travel_and_words_do_not_decide() {
        let e = ServingError::Stalled {
            limit: Duration::from_secs(2),
            node: "p0".into(),
        };
        assert_eq!(
            (e.code(), e.class()),
            (ErrorCode::Stalled, FailureClass::Stalled)
        );
        assert!(e.to_string().contains("no progress for 2s"));
        let wire = serde_json::to_string(&e.code()).expect("json");
        assert_eq!(wire, "\"stalled\"");
        let back: ErrorCode = serde_json::from_str(&wire).expect("json");
        assert_eq!(back, ErrorCode::Stalled);
        let fatal = ServingError::Timeout(Duration::from_secs(600));
        assert_eq!(
            (fatal.code(), fatal.class()),
            (ErrorCode::Timeout, FailureClass::Fatal)
        );
        // A restart proven by a new incarnation is retried free (bounded); a worker that
        // vanished costs an attempt.
        let lost = |restarted| ServingError::WorkerLost {
            worker: "d0".into(),
            cause: "it restarted".into(),
            restarted,
        };
        assert_eq!(lost(true).class(), FailureClass::Restart);
        assert_eq!(lost(false).class(), FailureClass::Attempt);
        assert_eq!(lost(true).code(), ErrorCode::WorkerLost);
        let elsewhere = ServingError::Admission("the pool holds 4096 tokens".into());
        assert_eq!(elsewhere.class(), FailureClass::Attempt);
        // A peer's own text never changes what the router does; its class does.
        let remote = ServingError::Remote {
            code: ErrorCode::Restart,
            class: FailureClass::Restart,
            message: "stalled fatal admission".into(),
        };
        assert_eq!(
            (remote.code(), remote.class()),
            (ErrorCode::Restart, FailureClass::Restart)
        );
    }

    #[test]
    fn a_failure_crosses_the_wire_with_its_code_and_class() {
        use crate::protocol::{TokenItem, TransferFailed};
        use duet_runtime::wire::{decode_body, encode_body};
        let e = ServingError::Stalled {
            limit: Duration::from_secs(3),
            node: "p1".into(),
        };
        let item: TokenItem = decode_body(&encode_body(&TokenItem::failed(9, &e))).expect("item");
        let back = item.failure().expect("a failure");
        assert_eq!(
            (back.code(), back.class()),
            (ErrorCode::Stalled, FailureClass::Stalled)
        );
        assert_eq!(back.to_string(), e.to_string());
        let f: TransferFailed =
            decode_body(&encode_body(&TransferFailed::new(4, Some(2), &e))).expect("failed");
        assert_eq!(f.to_error().code(), ErrorCode::Stalled);
        // A peer of an older build sends no code: it reads as unknown, its class still counts.
        #[derive(serde::Serialize)]
        struct Old {
            room: u64,
            attempt: Option<u64>,
            error: String,
            class: FailureClass,
        }
        let old = Old {
            room: 4,
            attempt: None,
            error: "x".into(),
            class: FailureClass::Restart,
        };
        let f: TransferFailed = decode_body(&encode_body(&old)).expect("old peer");
        assert_eq!(
            (f.code, f.class),
            (ErrorCode::Unknown, FailureClass::Restart)
        );
    }
}
