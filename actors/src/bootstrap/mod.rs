//! The bootstrap actor, one per prefill node: where a request waits until decode has reserved
//! pages for it.
//!
//! Two halves meet here, in either order: the router's [`PrefillRequest`] and decode's
//! [`PreallocNotice`] for the same room. When both are in, the pair goes to the prefill worker
//! (`prefill.start`): P never computes a prompt whose KV has nowhere to land. A request that
//! waits past `bootstrap_timeout` fails with an error naming the phase; so does a notice
//! whose request never came (its pages were never written, so decode frees them at once).
//! Layout hellos are answered by the prefill worker, which holds the model.
//!
//! The rule of the meeting is [`rendezvous`] (sans-IO, shared with the simulator); this actor
//! is its shell: it decodes envelopes, starts prefills, sends failures and acknowledgements.

pub mod rendezvous;

use std::sync::Arc;
use std::time::{Duration, Instant};

use duet_runtime::context::NodeContext;
use duet_runtime::metrics as m;
use duet_runtime::services::Inbound;
use duet_runtime::telemetry::TraceHeaders;
use duet_runtime::wire::{self, Envelope};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::task::JoinHandle;

use crate::protocol::{
    Abort, AbortAck, Accepted, BOOTSTRAP_SERVICE, PREFILL_SERVICE, PreallocNotice, PrefillRequest,
    PrefillStart, ServingError, TransferFailed, WORKER_SERVICE, kinds,
};
use crate::settings::ServingConfig;
use rendezvous::{OnAbort, OnNotice, OnRequest, Rendezvous};

/// The bootstrap actor.
pub struct Bootstrap;

/// A request waiting for its notice.
struct Waiting {
    request: PrefillRequest,
    trace: TraceHeaders,
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
    /// Requests (with the router's trace context and the span of their wait here) and
    /// notices (with their decode node) waiting for each other.
    queue: Rendezvous<Waiting, (PreallocNotice, String)>,
    /// The queue's clock starts here.
    epoch: Instant,
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
            queue: Rendezvous::new(),
            epoch: Instant::now(),
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
        let waiting = state.queue.waiting();
        metrics::gauge!(m::BOOTSTRAP_QUEUE).set(waiting as f64);
        state
            .queued
            .store(waiting, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

impl BootstrapState {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

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
                let span = tracing::info_span!(
                    "bootstrap_wait",
                    room,
                    decode = %request.decode,
                    attempt = tracing::field::Empty
                );
                let trace = TraceHeaders::of(&envelope);
                duet_runtime::telemetry::follow(&span, &trace);
                let waiting = Waiting {
                    request,
                    trace,
                    span,
                };
                let now = self.now_ms();
                if let OnRequest::Met {
                    request,
                    notice: (notice, _),
                } = self.queue.request(room, waiting, now)
                {
                    self.start(request, 0, notice).await;
                }
            }
            kinds::PREALLOC => {
                let Ok(notice) = wire::decode_body::<PreallocNotice>(&inbound.envelope.body) else {
                    metrics::counter!(m::LINK_FRAME_ERRORS, "reason" => "malformed_body")
                        .increment(1);
                    return;
                };
                let (room, attempt) = (notice.room, notice.attempt);
                let now = self.now_ms();
                match self
                    .queue
                    .notice(room, attempt, (notice, from.clone()), now)
                {
                    OnNotice::Duplicate => {
                        metrics::counter!(m::STALE_MESSAGES, "kind" => "prealloc").increment(1);
                    }
                    OnNotice::Aborted => {
                        // Aborted already; nothing was written for it.
                        self.send(&from, kinds::ABORT_ACK, &AbortAck { room, attempt })
                            .await;
                    }
                    OnNotice::Met {
                        request,
                        waited_ms,
                        notice: (notice, _),
                    } => self.start(request, waited_ms, notice).await,
                    OnNotice::Queued => {}
                }
            }
            kinds::DRAIN_FENCE => self.forward(kinds::STOP, inbound),
            kinds::ABORT => {
                let Ok(abort) = wire::decode_body::<Abort>(&inbound.envelope.body) else {
                    return;
                };
                let now = self.now_ms();
                match self.queue.abort(abort.room, abort.attempt, now) {
                    // Caught before prefill started: nothing was written.
                    OnAbort::CaughtBeforeStart { acknowledge } => {
                        if let (true, Some(attempt)) = (acknowledge, abort.attempt) {
                            let ack = AbortAck {
                                room: abort.room,
                                attempt,
                            };
                            self.send(&from, kinds::ABORT_ACK, &ack).await;
                        }
                    }
                    // In flight (or finished): the prefill worker drains, then acknowledges.
                    OnAbort::InFlight => self.forward(kinds::STOP, inbound),
                    // The router's request has not arrived yet: it is dropped when it does.
                    OnAbort::Early => {}
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

    async fn start(&mut self, waiting: Waiting, waited_ms: u64, notice: PreallocNotice) {
        let Waiting {
            request,
            trace,
            span,
        } = waiting;
        metrics::histogram!(m::BOOTSTRAP_WAIT).record(waited_ms as f64 / 1e3);
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
            trace,
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
        let now = self.now_ms();
        let expired = self.queue.expire(now, limit.as_millis() as u64);
        for (
            room,
            Waiting {
                request: r, span, ..
            },
        ) in expired.requests
        {
            tracing::warn!(parent: &span, room, "no pages from decode in time");
            let error = format!(
                "bootstrap: no pages from decode {} within {limit:?}",
                r.decode
            );
            let failed = TransferFailed::new(room, None, &ServingError::Prefill(error));
            self.send(&r.decode, kinds::FAILED, &failed).await;
        }
        for (room, attempt, (_, decode)) in expired.notices {
            let failed = TransferFailed::new(
                room,
                Some(attempt),
                &ServingError::Prefill(format!(
                    "bootstrap: the router's request never arrived within {limit:?}"
                )),
            );
            self.send(&decode, kinds::FAILED, &failed).await;
        }
    }
}
