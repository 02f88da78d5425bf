//! The bootstrap actor, one per prefill node: where a request waits until decode has reserved
//! pages for it.
//!
//! Two halves meet here, in either order: the router's [`PrefillRequest`] and decode's
//! [`PreallocNotice`] for the same room. When both are in, the pair goes to the prefill worker
//! (`prefill.start`): P never computes a prompt whose KV has nowhere to land. A request that
//! waits past `bootstrap_timeout` fails with an error naming the phase; so does a notice
//! whose request never came (its pages were never written, so decode frees them at once).
//! Layout hellos are answered by the prefill worker, which holds the model.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use duet_runtime::context::NodeContext;
use duet_runtime::metrics as m;
use duet_runtime::services::Inbound;
use duet_runtime::wire::{self, Envelope};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::task::JoinHandle;

use crate::protocol::{
    Abort, AbortAck, Accepted, BOOTSTRAP_SERVICE, PREFILL_SERVICE, PreallocNotice, PrefillRequest,
    PrefillStart, ServingError, TransferFailed, WORKER_SERVICE, kinds,
};
use crate::settings::ServingConfig;

/// The bootstrap actor.
pub struct Bootstrap;

/// A request waiting for its notice.
struct Waiting {
    request: PrefillRequest,
    since: Instant,
    traceparent: Option<String>,
    span: tracing::Span,
}

/// Remote messages and the deadline tick.
#[derive(Debug)]
pub enum BootstrapMsg {
    /// From the router or a decode worker.
    Inbound(Inbound),
    /// Check deadlines.
    Tick,
}

duet_runtime::inbound_message!(enum BootstrapMsg::Inbound);

/// The queue.
pub struct BootstrapState {
    ctx: Arc<NodeContext>,
    settings: ServingConfig,
    host: String,
    /// Requests without a notice yet, by room, with the router's trace context and the span
    /// of their wait here.
    requests: HashMap<u64, Waiting>,
    /// Notices without a request yet, by room (with the decode node).
    notices: HashMap<u64, (PreallocNotice, String, Instant)>,
    /// Rooms aborted before both halves met (the late half is dropped on arrival).
    dropped: HashMap<u64, Instant>,
    /// Rooms whose halves met, with the attempt started: a duplicated notice is ignored
    /// instead of waiting for a request that will not come (and then failing a live attempt).
    started: HashMap<u64, (u64, Instant)>,
    ticker: JoinHandle<()>,
    /// Requests queued here, for the node's drain probe.
    queued: Arc<std::sync::atomic::AtomicUsize>,
}

impl Drop for BootstrapState {
    fn drop(&mut self) {
        self.ticker.abort();
    }
}

impl Actor for Bootstrap {
    type Msg = BootstrapMsg;
    type State = BootstrapState;
    type Arguments = Arc<NodeContext>;

    async fn pre_start(
        &self,
        myself: ActorRef<BootstrapMsg>,
        ctx: Arc<NodeContext>,
    ) -> Result<BootstrapState, ActorProcessingErr> {
        let settings = ServingConfig::for_node(&ctx.config, &ctx.me.name)?;
        let me = myself.clone();
        let ticker = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tick.tick().await;
                if me.cast(BootstrapMsg::Tick).is_err() {
                    return;
                }
            }
        });
        ctx.services.register(BOOTSTRAP_SERVICE, myself);
        let queued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let probe = queued.clone();
        ctx.drain.set_probe("bootstrap", move || {
            probe.load(std::sync::atomic::Ordering::Relaxed)
        });
        Ok(BootstrapState {
            queued,
            ctx,
            settings,
            host: duet_transport::host_id(),
            requests: HashMap::new(),
            notices: HashMap::new(),
            dropped: HashMap::new(),
            started: HashMap::new(),
            ticker,
        })
    }

    async fn post_stop(
        &self,
        myself: ActorRef<BootstrapMsg>,
        state: &mut BootstrapState,
    ) -> Result<(), ActorProcessingErr> {
        state
            .ctx
            .services
            .unregister(BOOTSTRAP_SERVICE, myself.get_id());
        // What waited here is lost with us: decode's deadlines fail those requests.
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<BootstrapMsg>,
        msg: BootstrapMsg,
        state: &mut BootstrapState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            BootstrapMsg::Inbound(inbound) => state.inbound(inbound).await,
            BootstrapMsg::Tick => state.expire().await,
        }
        metrics::gauge!(m::BOOTSTRAP_QUEUE).set(state.requests.len() as f64);
        state
            .queued
            .store(state.requests.len(), std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

impl BootstrapState {
    async fn inbound(&mut self, inbound: Inbound) {
        let kind = inbound.envelope.kind.clone();
        let from = inbound.envelope.sender_node().to_string();
        match kind.as_str() {
            kinds::HELLO => self.forward(kinds::HELLO, inbound),
            kinds::PREFILL => {
                let Inbound { envelope, reply } = inbound;
                let Some(reply) = reply else { return };
                let request = match wire::decode_body::<PrefillRequest>(&envelope.body) {
                    Ok(r) => r,
                    Err(e) => return reply.fail(format!("bootstrap: malformed prefill: {e}")),
                };
                reply.ok(wire::encode_body(&Accepted { incarnation: 0 }));
                let room = request.room;
                if self.dropped.remove(&room).is_some() {
                    return;
                }
                let span = tracing::info_span!(
                    "bootstrap_wait",
                    room,
                    decode = %request.decode,
                    attempt = tracing::field::Empty
                );
                duet_runtime::telemetry::follow(&span, envelope.traceparent.as_deref());
                let waiting = Waiting {
                    request,
                    since: Instant::now(),
                    traceparent: envelope.traceparent.clone(),
                    span,
                };
                match self.notices.remove(&room) {
                    Some((notice, _, _)) => self.start(waiting, notice).await,
                    None => {
                        self.requests.insert(room, waiting);
                    }
                }
            }
            kinds::PREALLOC => {
                let Ok(notice) = wire::decode_body::<PreallocNotice>(&inbound.envelope.body) else {
                    metrics::counter!(m::LINK_FRAME_ERRORS, "reason" => "malformed_body")
                        .increment(1);
                    return;
                };
                let room = notice.room;
                if self
                    .started
                    .get(&room)
                    .is_some_and(|(attempt, _)| *attempt == notice.attempt)
                {
                    metrics::counter!(m::STALE_MESSAGES, "kind" => "prealloc").increment(1);
                    return;
                }
                if self.dropped.contains_key(&room) {
                    // Aborted already; nothing was written for it.
                    self.send(
                        &from,
                        kinds::ABORT_ACK,
                        &AbortAck {
                            room,
                            attempt: notice.attempt,
                        },
                    )
                    .await;
                    return;
                }
                match self.requests.remove(&room) {
                    Some(waiting) => self.start(waiting, notice).await,
                    None => {
                        self.notices.insert(room, (notice, from, Instant::now()));
                    }
                }
            }
            kinds::DRAIN_FENCE => self.forward(kinds::STOP, inbound),
            kinds::ABORT => {
                let Ok(abort) = wire::decode_body::<Abort>(&inbound.envelope.body) else {
                    return;
                };
                let waiting = self.requests.remove(&abort.room).is_some();
                let noticed = self.notices.remove(&abort.room);
                if waiting || noticed.is_some() {
                    // Caught before prefill started: nothing was written.
                    if let Some(attempt) = abort.attempt {
                        self.send(
                            &from,
                            kinds::ABORT_ACK,
                            &AbortAck {
                                room: abort.room,
                                attempt,
                            },
                        )
                        .await;
                    }
                    if !waiting {
                        self.dropped.insert(abort.room, Instant::now());
                    }
                } else if abort.attempt.is_some() {
                    // In flight (or finished): the prefill worker drains, then acknowledges.
                    self.forward(kinds::STOP, inbound);
                } else {
                    // The router's request has not arrived yet: drop it when it does.
                    self.dropped.insert(abort.room, Instant::now());
                }
            }
            other => {
                if let Some(reply) = inbound.reply {
                    reply.fail(format!("bootstrap does not handle `{other}`"));
                }
            }
        }
    }

    /// Hands an envelope (and its reply slot) to the prefill worker on this node.
    fn forward(&self, kind: &str, inbound: Inbound) {
        let Inbound { envelope, reply } = inbound;
        let envelope = Envelope {
            kind: kind.to_string(),
            target: PREFILL_SERVICE.to_string(),
            ..envelope
        };
        if let Err(e) = self.ctx.services.dispatch(Inbound { envelope, reply }) {
            tracing::warn!(error = %e, "bootstrap cannot reach the prefill worker");
        }
    }

    async fn start(&mut self, waiting: Waiting, notice: PreallocNotice) {
        self.started
            .insert(notice.room, (notice.attempt, Instant::now()));
        let Waiting {
            request,
            since,
            traceparent,
            span,
        } = waiting;
        metrics::histogram!(m::BOOTSTRAP_WAIT).record(since.elapsed().as_secs_f64());
        span.record("attempt", notice.attempt);
        drop(span);
        let backend = self
            .settings
            .kv_transport
            .pick(&self.host, &notice.endpoint.host);
        let start = PrefillStart {
            request,
            notice,
            backend,
            traceparent,
        };
        let sender = format!("{}/{BOOTSTRAP_SERVICE}", self.ctx.me.name);
        let envelope = Envelope::one_way(
            kinds::START,
            &sender,
            PREFILL_SERVICE,
            wire::encode_body(&start),
        );
        if let Err(e) = self.ctx.services.dispatch(Inbound {
            envelope,
            reply: None,
        }) {
            // No prefill worker (restarting): nothing was written, so decode frees the pages
            // and the router may retry.
            tracing::warn!(error = %e, room = start.notice.room, "cannot start a prefill");
            let failed = TransferFailed::new(
                start.notice.room,
                Some(start.notice.attempt),
                &ServingError::Restart(format!("prefill bootstrap: {e}")),
            );
            self.send(&start.request.decode, kinds::FAILED, &failed)
                .await;
        }
    }

    async fn send(&self, node: &str, kind: &str, body: &impl serde::Serialize) {
        if let Ok(link) = self.ctx.links.get(node) {
            let _ = link
                .send(
                    kind,
                    BOOTSTRAP_SERVICE,
                    WORKER_SERVICE,
                    wire::encode_body(body),
                )
                .await;
        }
    }

    async fn expire(&mut self) {
        let limit = self.settings.bootstrap_timeout;
        let late: Vec<u64> = self
            .requests
            .iter()
            .filter(|(_, w)| w.since.elapsed() > limit)
            .map(|(room, _)| *room)
            .collect();
        for room in late {
            if let Some(Waiting {
                request: r, span, ..
            }) = self.requests.remove(&room)
            {
                tracing::warn!(parent: &span, room, "no pages from decode in time");
                let error = format!(
                    "bootstrap: no pages from decode {} within {limit:?}",
                    r.decode
                );
                let failed = TransferFailed::new(room, None, &ServingError::Prefill(error));
                self.send(&r.decode, kinds::FAILED, &failed).await;
            }
        }
        let late: Vec<u64> = self
            .notices
            .iter()
            .filter(|(_, (_, _, since))| since.elapsed() > limit)
            .map(|(room, _)| *room)
            .collect();
        for room in late {
            if let Some((n, decode, _)) = self.notices.remove(&room) {
                let failed = TransferFailed::new(
                    room,
                    Some(n.attempt),
                    &ServingError::Prefill(format!(
                        "bootstrap: the router's request never arrived within {limit:?}"
                    )),
                );
                self.send(&decode, kinds::FAILED, &failed).await;
            }
        }
        self.dropped.retain(|_, since| since.elapsed() <= limit);
        self.started
            .retain(|_, (_, since)| since.elapsed() <= limit);
    }
}
