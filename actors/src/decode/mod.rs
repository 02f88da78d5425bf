//! The decode worker: one engine, its continuous batch, and the receiving half of
//! disaggregation (the `KvReceiver` role: the pool's endpoint, the TCP receiver, the grants).
//!
//! Requests arrive from the router in two shapes. Without a prefill peer, or when the prompt's
//! uncached part is under `disagg_threshold`, the worker prefills the prompt itself (the
//! colocated path). With one, the request walks D's queues:
//!
//! ```text
//!   prealloc ──(every page reserved; PreallocNotice sent)──► transfer ──(TransferDone and
//!      │ (waits, in order, while the pool is short:              │   the ledger publishes)
//!      │  backpressure lands on P's bootstrap queue)             ▼
//!      └─ cancel: Abort{attempt: None}                        running (the scheduler's batch)
//!   transfer ── cancel / deadline / P failed ──► draining (pins kept) ── revoke proven ──► pages free
//! ```
//!
//! An aborted transfer's pages are freed only on proof that no write of it can land: the
//! attempt's grant revoked with no writer holding it (see `duet_transport::grants`). A writer
//! that holds its claim (copying a run, or paused mid-copy for any length) keeps the pages
//! quarantined; no deadline frees them.
//!
//! The engine computes on a thread of its own; the actor is its front for remote messages.
//! Everything that touches pages (the scheduler, the prefix cache, the transfer ledger) lives
//! on that thread, so page bookkeeping needs no locks. Only the TCP receiver runs elsewhere,
//! and it writes nothing the ledger has not granted.
//!
//! Files: this one is the actor (the shell: remote messages, hellos, heartbeats, the
//! engine thread's start); `engine_thread.rs` is the thread's state and command loop;
//! `transfers.rs` the receiving half of disaggregation on it; `receiver.rs` the KV receiver
//! actor (TCP).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use duet_engine::{Engine, Runner};
use duet_gpu::KvPool;
use duet_gpu::{Devices, WorkerContext};
use duet_runtime::context::NodeContext;
use duet_runtime::link::LinkError;
use duet_runtime::membership::MembershipEvent;
use duet_runtime::metrics as m;
use duet_runtime::services::Inbound;
use duet_runtime::wire;
use duet_transport::shm::ShmRegion;
use duet_transport::{ClaimTable, Endpoint, Grants, LocalRegistration};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use rand::Rng;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::outbox::{self};
use crate::protocol::{
    AbortAck, Accepted, BOOTSTRAP_SERVICE, Cancel, ChunkWritten, Generate, Heartbeat, LayoutHello,
    LayoutInfo, LoadReport, PrefillPeer, ROUTER_SERVICE, TokenBatch, TokenItem, TransferDone,
    TransferFailed, WORKER_SERVICE, WorkerKind, kinds,
};
use crate::settings::ServingConfig;
use crate::worker::{engine_options, install_drain_probe, layout_info, load_model, report_load};

pub mod attempts;
mod engine_thread;
mod receiver;
mod recorded_grants;
mod transfers;
mod verify;

use engine_thread::DecodeCore;

pub use receiver::ReceiverHub;

/// The decode worker actor.
pub struct DecodeWorker;

/// Remote messages, and membership changes.
#[derive(Debug)]
pub enum DecodeMsg {
    /// From the router or a prefill worker.
    Inbound(Inbound),
    /// A peer went up or down.
    Membership(MembershipEvent),
    /// A hello to a prefill worker finished.
    Hello {
        /// The prefill node.
        node: String,
        /// Its layout, or why pairing is refused.
        result: Result<(), String>,
    },
}

duet_runtime::inbound_message!(enum DecodeMsg::Inbound);

/// What the engine thread is told.
enum Cmd {
    Submit {
        router: String,
        generate: Generate,
        /// The router's span, for this request's spans here.
        trace: duet_runtime::telemetry::TraceHeaders,
    },
    Cancel {
        router: String,
        request: u64,
    },
    PeerReady(String),
    PeerRefused(String, String),
    /// The prefill worker's writers are proven gone (a new incarnation).
    PeerGone(String, String),
    /// A prefill node's worker incarnation, as its heartbeat says (first seen or changed).
    PrefillIncarnation(String, u64),
    /// A prefill node's heartbeat: its engine steps so far, and the attempts it holds for us.
    PrefillProgress {
        node: String,
        steps: u64,
        holding: Vec<u64>,
    },
    /// The prefill node is unreachable (membership): abort and drain, pins kept.
    PeerDown(String, String),
    Chunk(String, ChunkWritten),
    Done(String, TransferDone),
    Failed(String, TransferFailed),
    AbortAck(String, AbortAck),
    /// The KV receiver actor restarted: its new endpoint, and the attempts the old receiver
    /// carried (its connection threads are joined, so none of their writes can land).
    ReceiverRestarted {
        tcp: Option<receiver::TcpEndpoint>,
        carried: Vec<u64>,
    },
    Shutdown,
}

/// The running worker. Dropping it stops the engine thread, the receiver and the tasks.
pub struct DecodeState {
    ctx: Arc<NodeContext>,
    /// The compute context this incarnation owns: opened in pre_start, drained and dropped in
    /// post_stop, so a restart really rebuilds it (gpu::context).
    device: WorkerContext,
    incarnation: u64,
    layout: LayoutInfo,
    cmds: std_mpsc::Sender<Cmd>,
    tasks: Vec<JoinHandle<()>>,
    /// Prefill nodes whose layout matched, and the incarnation of their prefill worker.
    hellos: HashMap<String, HelloState>,
    /// The last heartbeat's incarnation of each prefill worker.
    prefill_incarnations: HashMap<String, u64>,
    receivers: Arc<ReceiverHub>,
    _local: LocalRegistration,
}

enum HelloState {
    InFlight,
    Done,
}

impl Drop for DecodeState {
    fn drop(&mut self) {
        self.receivers.retire(self.incarnation);
        let _ = self.cmds.send(Cmd::Shutdown);
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Actor for DecodeWorker {
    type Msg = DecodeMsg;
    type State = DecodeState;
    type Arguments = (Arc<NodeContext>, Arc<ReceiverHub>);

    async fn pre_start(
        &self,
        myself: ActorRef<DecodeMsg>,
        (ctx, receivers): (Arc<NodeContext>, Arc<ReceiverHub>),
    ) -> Result<DecodeState, ActorProcessingErr> {
        let settings = ServingConfig::for_node(&ctx.config, &ctx.me.name)?;
        // The worker owns its device for this incarnation (checked at node start too).
        let device = settings.open_device(&ctx.config)?;
        settings.open_kv_transport(&ctx.config)?;
        let device = WorkerContext::open(&Devices, device)?;
        *ctx.device.lock().unwrap_or_else(|p| p.into_inner()) = Some(device.device().to_string());
        let incarnation: u64 = rand::rng().random();
        // The pid in the name lets the next process on this host remove a pool whose owner
        // was SIGKILLed (it never unlinked it).
        let shm_prefix = format!("{}-{}", ctx.config.name, ctx.me.name);
        let stale = ShmRegion::remove_stale(&shm_prefix);
        if stale > 0 {
            tracing::warn!(
                removed = stale,
                "removed pool files of dead decode processes"
            );
        }
        let shm_name = format!("{shm_prefix}-{}-{incarnation:016x}", std::process::id());
        let (runner, shm) = {
            let s = settings.clone();
            let name = shm_name.clone();
            tokio::task::spawn_blocking(move || build_decode_runner(&s, &name)).await??
        };
        let layout = layout_info(&runner.engine.model, runner.engine.options());
        // Writers that map the pool (shm, local) write only under a claim decode can revoke:
        // one slot per page, so every live attempt has one.
        let claims_name = format!("{shm_name}-claims");
        let grants = match shm
            .then(|| ClaimTable::create(&claims_name, runner.engine.pool.capacity()))
            .transpose()
        {
            Ok(Some(table)) => Grants::with_claims(table),
            Ok(None) => Grants::default(),
            Err(e) => {
                tracing::warn!(error = %e, "no claim table: no shared-memory transfers");
                Grants::default()
            }
        };
        let shm = shm && grants.has_claims();
        let memory = runner.engine.pool.memory();
        // The receiver listens on this node's host only (loopback unless the operator put
        // the node elsewhere); a connection must open with the secret in our endpoint.
        let (cmd_tx, cmd_rx) = std_mpsc::channel();
        let parts = receiver::ReceiverParts {
            bind: std::net::SocketAddr::new(ctx.me.address.ip(), 0),
            memory: memory.clone(),
            grants: grants.clone(),
            cmds: cmd_tx.clone(),
            worker: incarnation,
            node: ctx.me.name.clone(),
            page_bytes: runner.engine.pool.layout().page_bytes(),
        };
        let tcp = {
            let hub = receivers.clone();
            tokio::task::spawn_blocking(move || hub.install(parts)).await?
        };
        let local = LocalRegistration::new(memory);
        let endpoint = Endpoint {
            host: duet_transport::host_id(),
            local: Some(local.key()),
            shm: shm.then(|| shm_name.clone()),
            claims: grants.has_claims().then_some(claims_name),
            tcp,
        };
        let node = ctx.me.name.clone();
        let load = Arc::new(Mutex::new(LoadReport::idle(
            node.clone(),
            WorkerKind::Decode,
            layout.clone(),
            incarnation,
            runner.engine.pool.capacity(),
        )));
        let (out_tx, out_rx) = mpsc::unbounded_channel();
        let (outbox, outbox_task) = outbox::start(ctx.clone(), WORKER_SERVICE);
        {
            let load = load.clone();
            let core = DecodeCore {
                runner,
                out: out_tx,
                outbox,
                sends: Vec::new(),
                load,
                grants: recorded_grants::RecordedGrants::new(grants, &ctx.me.name, incarnation),
                endpoint,
                incarnation,
                threshold: settings.disagg_threshold,
                transfer_timeout: settings.transfer_timeout,
                checksum: settings.kv_checksum,
                verify_step_bytes: settings.kv_verify_step_bytes,
                checks: VecDeque::new(),
                hold_done: Duration::from_millis(
                    std::env::var("DUET_FAULT_HOLD_DONE_MS")
                        .ok()
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(0),
                ),
                held: Vec::new(),
                node: ctx.me.name.clone(),
                prefill_incarnations: HashMap::new(),
                prefill_steps: HashMap::new(),
                drain_fence: settings.drain_fence,
                forced_drain: settings.drain_backstop,
                max_running: settings.max_running,
                next_seq: 0,
                owners: HashMap::new(),
                seqs: HashMap::new(),
                prealloc: VecDeque::new(),
                transfers: attempts::Attempts::new(),
                ready: HashSet::new(),
                epoch: Instant::now(),
                now: Instant::now(),
                spans: HashMap::new(),
                first_tokens: HashSet::new(),
                step_log: crate::step_log::StepLog::open(settings.step_log.as_deref(), &node),
            };
            std::thread::Builder::new()
                .name(format!("duet-decode-{node}"))
                .spawn(move || core.run(cmd_rx))?;
        }
        let forwarder = tokio::spawn(forward_tokens(ctx.clone(), incarnation, out_rx));
        install_drain_probe(&ctx, "decode worker", &load, settings.shutdown_drain);
        let reporter = tokio::spawn(report_load(
            ctx.clone(),
            settings.load_interval,
            load,
            settings.model_name.clone(),
        ));
        ctx.services.register(WORKER_SERVICE, myself.clone());
        ctx.membership
            .events
            .subscribe(myself, |e| Some(DecodeMsg::Membership(e)));
        tracing::info!(%node, incarnation, model = %settings.model.display(), "decode worker ready");
        Ok(DecodeState {
            device,
            ctx,
            incarnation,
            layout,
            cmds: cmd_tx,
            tasks: vec![forwarder, reporter, outbox_task],
            hellos: HashMap::new(),
            prefill_incarnations: HashMap::new(),
            receivers,
            _local: local,
        })
    }

    async fn post_stop(
        &self,
        myself: ActorRef<DecodeMsg>,
        state: &mut DecodeState,
    ) -> Result<(), ActorProcessingErr> {
        state
            .ctx
            .services
            .unregister(WORKER_SERVICE, myself.get_id());
        *state.ctx.device.lock().unwrap_or_else(|p| p.into_inner()) = None;
        // Last: nothing of this incarnation computes in the context once it is closed.
        if let Err(e) = state.device.close() {
            tracing::warn!(error = %e, "the worker's device context did not drain before it was dropped");
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<DecodeMsg>,
        msg: DecodeMsg,
        state: &mut DecodeState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            DecodeMsg::Inbound(inbound) => state.inbound(&myself, inbound),
            DecodeMsg::Hello { node, result } => {
                let cmd = match result {
                    Ok(()) => {
                        state.hellos.insert(node.clone(), HelloState::Done);
                        Cmd::PeerReady(node)
                    }
                    Err(e) => {
                        // Refused now; a later request tries again (the peer may be fixed).
                        state.hellos.remove(&node);
                        Cmd::PeerRefused(node, e)
                    }
                };
                let _ = state.cmds.send(cmd);
            }
            DecodeMsg::Membership(MembershipEvent::Down { peer }) => {
                state.hellos.remove(&peer);
                let _ = state.cmds.send(Cmd::PeerDown(
                    peer,
                    "membership marked the prefill node down".into(),
                ));
            }
            DecodeMsg::Membership(MembershipEvent::Up { .. }) => {}
        }
        Ok(())
    }
}

impl DecodeState {
    fn inbound(&mut self, myself: &ActorRef<DecodeMsg>, inbound: Inbound) {
        let Inbound { envelope, reply } = inbound;
        let from = envelope.sender_node().to_string();
        let body = &envelope.body;
        let trace = duet_runtime::telemetry::TraceHeaders::of(&envelope);
        let cmd = match (envelope.kind.as_str(), reply) {
            (kinds::GENERATE, Some(reply)) => match wire::decode_body::<Generate>(body) {
                Ok(generate) => {
                    if let Some(PrefillPeer { node, .. }) = &generate.prefill {
                        self.ensure_hello(myself, node);
                    }
                    if self
                        .cmds
                        .send(Cmd::Submit {
                            router: from,
                            generate,
                            trace,
                        })
                        .is_err()
                    {
                        reply.fail("decode: the engine has stopped");
                    } else {
                        reply.ok(wire::encode_body(&Accepted {
                            incarnation: self.incarnation,
                        }));
                    }
                    return;
                }
                Err(e) => {
                    reply.fail(format!("decode: malformed generate: {e}"));
                    return;
                }
            },
            (kinds::CANCEL, None) => wire::decode_body::<Cancel>(body).ok().map(|c| Cmd::Cancel {
                router: from,
                request: c.request,
            }),
            (kinds::CHUNK, None) => wire::decode_body(body).ok().map(|c| Cmd::Chunk(from, c)),
            (kinds::DONE, None) => wire::decode_body(body).ok().map(|d| Cmd::Done(from, d)),
            (kinds::FAILED, None) => wire::decode_body(body).ok().map(|f| Cmd::Failed(from, f)),
            (kinds::ABORT_ACK, None) => {
                wire::decode_body(body).ok().map(|a| Cmd::AbortAck(from, a))
            }
            (kinds::HEARTBEAT, None) => {
                if let Ok(h) = wire::decode_body::<Heartbeat>(body) {
                    self.heartbeat(&from, h);
                }
                None
            }
            (other, Some(reply)) => {
                reply.fail(format!("decode worker does not handle `{other}`"));
                None
            }
            (other, None) => {
                tracing::warn!(kind = other, "decode worker ignored a one-way message");
                None
            }
        };
        match cmd {
            Some(cmd) => {
                let _ = self.cmds.send(cmd);
            }
            None if !matches!(envelope.kind.as_str(), kinds::HEARTBEAT | kinds::GENERATE) => {
                metrics::counter!(m::LINK_FRAME_ERRORS, "reason" => "malformed_body").increment(1);
            }
            None => {}
        }
    }

    /// A new prefill worker incarnation proves the old one's writers are gone (its sender
    /// thread is joined before it stops), so transfers with it end and their pins drop.
    fn heartbeat(&mut self, from: &str, h: Heartbeat) {
        if !h.holding.is_empty() {
            let _ = self.cmds.send(Cmd::PrefillProgress {
                node: from.to_string(),
                steps: h.steps,
                holding: h.holding.clone(),
            });
        }
        let known = self
            .prefill_incarnations
            .insert(from.to_string(), h.incarnation);
        if known != Some(h.incarnation) {
            let _ = self
                .cmds
                .send(Cmd::PrefillIncarnation(from.to_string(), h.incarnation));
        }
        if known.is_some_and(|k| k != h.incarnation) {
            let _ = self.cmds.send(Cmd::PeerGone(
                from.to_string(),
                "the prefill worker restarted".into(),
            ));
        }
    }

    /// First contact with a prefill node: exchange layouts; refuse a mismatch naming both.
    fn ensure_hello(&mut self, myself: &ActorRef<DecodeMsg>, node: &str) {
        if self.hellos.contains_key(node) {
            return;
        }
        self.hellos.insert(node.to_string(), HelloState::InFlight);
        let hello = LayoutHello {
            node: self.ctx.me.name.clone(),
            incarnation: self.incarnation,
            layout: self.layout.clone(),
        };
        let (ctx, me, node) = (self.ctx.clone(), myself.clone(), node.to_string());
        tokio::spawn(async move {
            // A link that is still (re)connecting is waited for, as the outbox does; a refusal
            // from the peer (a layout mismatch) is final at once.
            let deadline = tokio::time::Instant::now() + outbox::RETRY_FOR;
            let answer = loop {
                let sent = match ctx.links.get(&node) {
                    Ok(link) => {
                        link.request(
                            kinds::HELLO,
                            WORKER_SERVICE,
                            BOOTSTRAP_SERVICE,
                            wire::encode_body(&hello),
                            Duration::from_secs(10),
                        )
                        .await
                    }
                    Err(e) => Err(e),
                };
                // So is one whose worker is being restarted (nothing there to answer yet).
                match sent {
                    Err(
                        LinkError::NotConnected { .. }
                        | LinkError::Disconnected { .. }
                        | LinkError::Remote {
                            unavailable: true, ..
                        },
                    ) if tokio::time::Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    other => break other.map_err(|e| e.to_string()),
                }
            };
            let result = answer
                .and_then(|b| wire::decode_body::<LayoutHello>(&b).map_err(|e| e.to_string()))
                .and_then(|theirs| {
                    match hello
                        .layout
                        .mismatch(&theirs.layout, &hello.node, &theirs.node)
                    {
                        Some(e) => Err(e),
                        None => Ok(()),
                    }
                });
            let _ = me.cast(DecodeMsg::Hello { node, result });
        });
    }
}

/// Builds the decode engine with its pool in shared memory when the host allows (so a prefill
/// worker on this host can write it directly); otherwise on the heap (TCP and local only).
fn build_decode_runner(s: &ServingConfig, shm_name: &str) -> Result<(Runner, bool), String> {
    let model = load_model(s)?;
    let options = engine_options(s, &model);
    let layout = layout_info(&model, &options).layout;
    let bytes = layout.page_bytes() * options.kv_pages;
    let (pool, shm) = match ShmRegion::create(shm_name, bytes) {
        Ok(region) => (
            KvPool::with_memory(layout, options.kv_pages, Arc::new(region))
                .map_err(|e| e.to_string())?,
            true,
        ),
        Err(e) => {
            tracing::warn!(error = %e, "decode pool on the heap: no shared-memory transfers");
            (
                KvPool::new(layout, options.kv_pages).map_err(|e| e.to_string())?,
                false,
            )
        }
    };
    let engine = Engine::with_pool(model, options, pool).map_err(|e| e.to_string())?;
    Ok((Runner::new(engine, s.max_batch_tokens, s.max_running), shm))
}

/// Sends each step's items to the routers that own them, one envelope per router per step.
pub(crate) async fn forward_tokens(
    ctx: Arc<NodeContext>,
    incarnation: u64,
    mut steps: mpsc::UnboundedReceiver<Vec<(String, TokenItem)>>,
) {
    while let Some(items) = steps.recv().await {
        let mut by_router: HashMap<String, Vec<TokenItem>> = HashMap::new();
        for (router, item) in items {
            by_router.entry(router).or_default().push(item);
        }
        for (router, items) in by_router {
            let batch = TokenBatch {
                worker: ctx.me.name.clone(),
                incarnation,
                items,
            };
            let sent = outbox::send_reliably(
                &ctx,
                WORKER_SERVICE,
                &router,
                ROUTER_SERVICE,
                kinds::EVENTS,
                wire::encode_body(&batch),
            )
            .await;
            if let Err(e) = sent {
                // The router is gone; its requests fail there on its own deadline.
                tracing::warn!(%router, error = %e, "cannot deliver tokens");
            }
        }
    }
}

/// Counts a message about an attempt that is no longer current (duplicate, late, or of an
/// older attempt): ignored, never applied to a newer one.
fn stale(kind: &'static str) {
    metrics::counter!(m::STALE_MESSAGES, "kind" => kind).increment(1);
}
