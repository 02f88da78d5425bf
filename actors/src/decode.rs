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

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use duet_engine::sampling::Sampled;
use duet_engine::{Engine, EngineOptions, Model, Runner, fetch};
use duet_gpu::{KvPool, PageId};
use duet_runtime::config::Role;
use duet_runtime::context::NodeContext;
use duet_runtime::link::LinkError;
use duet_runtime::membership::MembershipEvent;
use duet_runtime::metrics as m;
use duet_runtime::services::Inbound;
use duet_runtime::wire;
use duet_transport::shm::ShmRegion;
use duet_transport::{
    AbortReason, ClaimTable, Endpoint, Grants, LocalRegistration, Revocation, Side, TransferLedger,
};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use rand::Rng;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::history;
use crate::outbox::{self, Outbox};
use crate::protocol::{
    Abort, AbortAck, Accepted, BOOTSTRAP_SERVICE, Cancel, ChunkWritten, FailureClass, Generate,
    Heartbeat, LayoutHello, LayoutInfo, LoadReport, PreallocNotice, PrefillPeer, ROUTER_SERVICE,
    TokenBatch, TokenItem, TransferDone, TransferFailed, WORKER_SERVICE, WorkerKind, kinds,
};
use crate::settings::ServingConfig;

mod receiver;

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
        traceparent: Option<String>,
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

/// Loads the model (fetching the default one if missing).
pub(crate) fn load_model(s: &ServingConfig) -> Result<Model, String> {
    let path = if s.model.exists() || !s.model.ends_with(fetch::MODEL_FILE) {
        s.model.clone()
    } else {
        fetch::ensure_model(&s.model, &mut |_| {}).map_err(|e| e.to_string())?
    };
    Model::open(&path).map_err(|e| format!("{}: {e}", path.display()))
}

/// The engine options of a worker.
pub(crate) fn engine_options(s: &ServingConfig, model: &Model) -> EngineOptions {
    EngineOptions {
        kv_dtype: s.kv_dtype,
        page_size: s.page_size,
        kv_pages: s.kv_pages,
        threads: s.threads,
        max_context: model.config.context_length,
    }
}

/// The layout a model and options give.
pub(crate) fn layout_info(model: &Model, o: &EngineOptions) -> LayoutInfo {
    LayoutInfo {
        layout: Engine::layout_for(model, o),
        fingerprint: model.fingerprint.clone(),
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
                load,
                grants,
                endpoint,
                incarnation,
                threshold: settings.disagg_threshold,
                transfer_timeout: settings.transfer_timeout,
                checksum: settings.kv_checksum,
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
                ledger: TransferLedger::new(Side::Destination),
                prealloc: VecDeque::new(),
                transfers: HashMap::new(),
                draining: HashMap::new(),
                stalled: HashSet::new(),
                ready: HashSet::new(),
                epoch: Instant::now(),
                last_fence_ms: 0,
                spans: HashMap::new(),
                first_tokens: HashSet::new(),
            };
            std::thread::Builder::new()
                .name(format!("duet-decode-{node}"))
                .spawn(move || core.run(cmd_rx))?;
        }
        let forwarder = tokio::spawn(forward_tokens(ctx.clone(), incarnation, out_rx));
        install_drain_probe(&ctx, "decode worker", &load, settings.shutdown_drain);
        let reporter = tokio::spawn(report_load(ctx.clone(), settings.load_interval, load));
        ctx.services.register(WORKER_SERVICE, myself.clone());
        ctx.membership
            .events
            .subscribe(myself, |e| Some(DecodeMsg::Membership(e)));
        tracing::info!(%node, incarnation, model = %settings.model.display(), "decode worker ready");
        Ok(DecodeState {
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
        let traceparent = envelope.traceparent.clone();
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
                            traceparent,
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

/// What prefill must hear of a transfer decode ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Prefill {
    /// Stop it (decode ended it: a cancel, a deadline, a lost peer, a restart).
    Stop,
    /// Nothing: prefill ended it itself (it reported a failure, or sent its done).
    Ended,
}

/// A request waiting for pages.
struct Prealloc {
    seq: u64,
    router: String,
    generate: Generate,
    peer: PrefillPeer,
    since: Instant,
}

/// A request whose KV is on its way.
struct Transfer {
    seq: u64,
    router: String,
    generate: Generate,
    peer: PrefillPeer,
    attempt: u64,
    prefix: Vec<PageId>,
    pages: Vec<PageId>,
    noticed: Instant,
    /// The last sign of progress: the notice, a chunk written, or prefill's engine stepping
    /// while it holds the attempt. The transfer deadline counts from here.
    progressed: Instant,
    bytes: u64,
}

/// The engine thread's state.
struct DecodeCore {
    runner: Runner,
    out: mpsc::UnboundedSender<Vec<(String, TokenItem)>>,
    outbox: Outbox,
    load: Arc<Mutex<LoadReport>>,
    grants: Grants,
    endpoint: Endpoint,
    incarnation: u64,
    threshold: usize,
    transfer_timeout: Duration,
    /// Check prefill's checksums before publishing.
    checksum: bool,
    /// How long an abort may go unacknowledged before decode asks again (drain fence).
    drain_fence: Duration,
    /// How long an abort may stay unproven before decode raises the alarm (the pages stay
    /// quarantined: time is never proof).
    forced_drain: Duration,
    max_running: usize,
    next_seq: u64,
    /// Local sequence id -> (router, router's request id), and back.
    owners: HashMap<u64, (String, u64)>,
    seqs: HashMap<(String, u64), u64>,
    ledger: TransferLedger,
    prealloc: VecDeque<Prealloc>,
    /// By (prefill node, room).
    transfers: HashMap<(String, u64), Transfer>,
    /// Aborted attempts whose pages are quarantined until their revoke is proven:
    /// attempt -> (prefill node, room).
    draining: HashMap<u64, (String, u64)>,
    /// Quarantined attempts already reported as past the backstop.
    stalled: HashSet<u64>,
    /// Prefill nodes whose hello succeeded.
    ready: HashSet<String>,
    epoch: Instant,
    last_fence_ms: u64,
    /// Per sequence: its root span and the span of the phase it is in.
    spans: HashMap<u64, (tracing::Span, tracing::Span)>,
    /// Sequences whose first token was already reported (as a span event).
    first_tokens: HashSet<u64>,
    /// Fault injection (`DUET_FAULT_HOLD_DONE_MS`): a complete transfer waits this long
    /// before it is checked and published, so tests can kill decode between the end of a
    /// transfer and its first decode step.
    hold_done: Duration,
    held: Vec<(Instant, String, TransferDone)>,
    /// This node's name (for the transfer history).
    node: String,
    /// Each prefill node's worker incarnation, from its heartbeats.
    prefill_incarnations: HashMap<String, u64>,
    /// Each prefill node's engine steps, from its last heartbeat that held an attempt of ours.
    prefill_steps: HashMap<String, u64>,
}

impl DecodeCore {
    fn run(mut self, cmds: std_mpsc::Receiver<Cmd>) {
        loop {
            let idle = self.runner.scheduler.is_idle();
            let first = if idle {
                // Nothing to compute: wake for a command, or to check transfer deadlines.
                match cmds.recv_timeout(Duration::from_millis(200)) {
                    Ok(c) => Some(c),
                    Err(std_mpsc::RecvTimeoutError::Timeout) => None,
                    Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
                }
            } else {
                None
            };
            let mut items = Vec::new();
            for cmd in first
                .into_iter()
                .chain(std::iter::from_fn(|| cmds.try_recv().ok()))
            {
                if matches!(cmd, Cmd::Shutdown) {
                    return;
                }
                self.command(cmd, &mut items);
            }
            self.preallocate(&mut items);
            self.expire(&mut items);
            let now = Instant::now();
            for (_, node, d) in self
                .held
                .extract_if(.., |(due, _, _)| *due <= now)
                .collect::<Vec<_>>()
            {
                self.done(node, d, &mut items);
            }
            if !self.runner.scheduler.is_idle() {
                self.step(&mut items);
            }
            self.publish_load();
            if !items.is_empty() && self.out.send(items).is_err() {
                return;
            }
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn command(&mut self, cmd: Cmd, items: &mut Vec<(String, TokenItem)>) {
        match cmd {
            Cmd::Submit {
                router,
                generate,
                traceparent,
            } => {
                self.next_seq += 1;
                let seq = self.next_seq;
                if self.seqs.contains_key(&(router.clone(), generate.request)) {
                    return;
                }
                let root = tracing::info_span!(
                    "decode",
                    request = generate.request,
                    room = generate.prefill.as_ref().map(|p| p.room),
                    attempt = tracing::field::Empty,
                    prompt_tokens = generate.prompt.len(),
                );
                duet_runtime::telemetry::follow(&root, traceparent.as_deref());
                let phase = if generate.prefill.is_some() {
                    tracing::info_span!(parent: &root, "prealloc", request = generate.request)
                } else {
                    tracing::info_span!(
                        parent: &root,
                        "decoding",
                        request = generate.request,
                        local_prefill = true
                    )
                };
                self.spans.insert(seq, (root, phase));
                self.owners.insert(seq, (router.clone(), generate.request));
                self.seqs.insert((router.clone(), generate.request), seq);
                // A sequence that could never fit (the pool, even alone) is refused now,
                // rather than left waiting for pages that will never be free.
                let admissible = self.runner.scheduler.admissible(
                    generate.prompt.len(),
                    &generate.params,
                    generate.resume,
                    false,
                );
                if let (Err(e), Some(peer)) = (&admissible, &generate.prefill) {
                    Self::drop_bootstrap_half(&self.outbox, peer);
                    self.fail(seq, format!("decode admission: {e}"), items);
                    return;
                }
                match generate.prefill.clone() {
                    Some(peer) => self.prealloc.push_back(Prealloc {
                        seq,
                        router,
                        generate,
                        peer,
                        since: Instant::now(),
                    }),
                    None => self.submit_local(seq, router, generate, items),
                }
            }
            Cmd::Cancel { router, request } => {
                if let Some(seq) = self.seqs.remove(&(router, request)) {
                    self.owners.remove(&seq);
                    if let Some((_, phase)) = self.spans.remove(&seq) {
                        tracing::info!(parent: &phase, "cancelled by the client");
                    }
                    self.abort_seq(seq, AbortReason::ClientCancel);
                }
            }
            Cmd::PeerReady(node) => {
                self.ready.insert(node);
            }
            Cmd::PeerRefused(node, error) => {
                self.ready.remove(&node);
                let refused = self.take_prealloc(|p| p.peer.node == node);
                for p in refused {
                    self.fail(p.seq, format!("decode prealloc: {error}"), items);
                    Self::drop_bootstrap_half(&self.outbox, &p.peer);
                }
            }
            Cmd::PeerGone(node, why) => self.lose_peer(&node, &why, false, items),
            Cmd::PrefillIncarnation(node, incarnation) => {
                self.prefill_incarnations.insert(node, incarnation);
            }
            Cmd::PeerDown(node, why) => self.lose_peer(&node, &why, true, items),
            Cmd::Chunk(node, c) => match self.transfers.get_mut(&(node, c.room)) {
                Some(t) if t.attempt == c.attempt => {
                    t.bytes = c.bytes;
                    t.progressed = Instant::now();
                }
                _ => stale("chunk"),
            },
            Cmd::PrefillProgress {
                node,
                steps,
                holding,
            } => {
                let before = self.prefill_steps.insert(node.clone(), steps);
                if before.is_some_and(|b| steps > b) {
                    let now = Instant::now();
                    for t in self.transfers.values_mut() {
                        if t.peer.node == node && holding.contains(&t.attempt) {
                            t.progressed = now;
                        }
                    }
                }
            }
            Cmd::Done(node, d) if !self.hold_done.is_zero() => {
                tracing::warn!(
                    room = d.room,
                    "fault injection: holding a complete transfer"
                );
                self.held.push((Instant::now() + self.hold_done, node, d));
            }
            Cmd::Done(node, d) => self.done(node, d, items),
            Cmd::Failed(node, f) => {
                if let Some(attempt) = f.attempt {
                    // P's writes for it have drained: abort then close at once. A failure of
                    // another attempt in the same room must not take this one with it.
                    let key = (node.clone(), f.room);
                    let current = self
                        .transfers
                        .get(&key)
                        .is_some_and(|t| t.attempt == attempt);
                    if let Some(t) = current.then(|| self.transfers.remove(&key)).flatten() {
                        self.end_transfer(&t, AbortReason::ProducerFailure, Prefill::Ended);
                        self.fail_as(t.seq, f.error, f.class, items);
                    } else if !self.settle(attempt) {
                        stale("failed");
                    }
                } else {
                    let gone = self.take_prealloc(|p| p.peer.node == node && p.peer.room == f.room);
                    for p in gone {
                        self.fail_as(p.seq, f.error.clone(), f.class, items);
                    }
                }
            }
            Cmd::AbortAck(node, a) => {
                // Prefill says its writes drained: a reason to ask the grant again now (the
                // revoke is the proof). Most acknowledgements come after the revoke was
                // already proven; only one for another peer's attempt is stale.
                match self.draining.get(&a.attempt) {
                    Some((n, _)) if *n == node => {
                        self.settle(a.attempt);
                    }
                    Some(_) => stale("abort_ack"),
                    None => {}
                }
            }
            Cmd::ReceiverRestarted { tcp, carried } => {
                self.receiver_restarted(tcp, &carried, items);
            }
            Cmd::Shutdown => {}
        }
    }

    /// The KV receiver was replaced: later notices carry its endpoint, and the transfers the
    /// old one carried fail. Their pages are free at once: every thread that could land a
    /// frame of theirs is joined, so their revoke is proven. Prefill is told to stop them.
    fn receiver_restarted(
        &mut self,
        tcp: Option<receiver::TcpEndpoint>,
        carried: &[u64],
        items: &mut Vec<(String, TokenItem)>,
    ) {
        self.endpoint.tcp = tcp;
        let keys: Vec<(String, u64)> = self
            .transfers
            .iter()
            .filter(|(_, t)| carried.contains(&t.attempt))
            .map(|(k, _)| k.clone())
            .collect();
        for k in keys {
            let Some(t) = self.transfers.remove(&k) else {
                continue;
            };
            self.end_transfer(&t, AbortReason::ConsumerFailure, Prefill::Stop);
            self.fail_as(
                t.seq,
                "decode transfer: the KV receiver restarted (its connections closed)".into(),
                FailureClass::Restart,
                items,
            );
        }
        for &attempt in carried {
            self.settle(attempt);
        }
        tracing::warn!(
            carried = carried.len(),
            tcp = ?self.endpoint.tcp,
            "KV receiver replaced"
        );
    }

    /// Tells prefill's bootstrap queue to drop the router's half of a request decode failed
    /// before its notice (else it waits there until its deadline). Retried while the link
    /// reconnects; a node that stays unreachable drops it at its own deadline.
    fn drop_bootstrap_half(outbox: &Outbox, peer: &PrefillPeer) {
        outbox.send(
            &peer.node,
            BOOTSTRAP_SERVICE,
            kinds::ABORT,
            &Abort {
                room: peer.room,
                attempt: None,
            },
        );
    }

    /// Tells prefill to abort its side of a transfer (it drains, then acknowledges).
    fn abort_at_prefill(outbox: &Outbox, t: &Transfer) {
        outbox.send(
            &t.peer.node,
            BOOTSTRAP_SERVICE,
            kinds::ABORT,
            &Abort {
                room: t.peer.room,
                attempt: Some(t.attempt),
            },
        );
    }

    /// Removes and returns the transfers with prefill node `node`.
    fn take_transfers(&mut self, node: &str) -> Vec<Transfer> {
        let keys: Vec<(String, u64)> = self
            .transfers
            .keys()
            .filter(|(n, _)| n == node)
            .cloned()
            .collect();
        keys.iter()
            .filter_map(|k| self.transfers.remove(k))
            .collect()
    }

    fn take_prealloc(&mut self, pred: impl Fn(&Prealloc) -> bool) -> VecDeque<Prealloc> {
        let (taken, kept) = std::mem::take(&mut self.prealloc)
            .into_iter()
            .partition(|p| pred(p));
        self.prealloc = kept;
        taken
    }

    fn submit_local(
        &mut self,
        seq: u64,
        router: String,
        generate: Generate,
        items: &mut Vec<(String, TokenItem)>,
    ) {
        let submitted =
            self.runner
                .submit_resumed(seq, generate.prompt, generate.params, generate.resume);
        if let Err(e) = submitted {
            self.owners.remove(&seq);
            self.seqs.remove(&(router.clone(), generate.request));
            items.push((
                router,
                TokenItem::failed(generate.request, format!("decode admission: {e}")),
            ));
        }
    }

    /// Reserves pages for waiting requests, in arrival order, while the pool allows; sends
    /// each its notice. A request whose uncached part is short is prefilled here instead.
    fn preallocate(&mut self, items: &mut Vec<(String, TokenItem)>) {
        while let Some(p) = self.prealloc.front() {
            if !self.ready.contains(&p.peer.node) {
                // Its hello is in flight; later requests for ready peers may still go
                // (order matters only among requests that can proceed).
                if let Some(i) = self
                    .prealloc
                    .iter()
                    .position(|q| self.ready.contains(&q.peer.node))
                {
                    let q = self.prealloc.remove(i);
                    if let Some(q) = q
                        && !self.try_prealloc(q, items)
                    {
                        break;
                    }
                    continue;
                }
                break;
            }
            let Some(p) = self.prealloc.pop_front() else {
                break;
            };
            if !self.try_prealloc(p, items) {
                break;
            }
        }
        metrics::gauge!(m::PREALLOC_QUEUE).set(self.prealloc.len() as f64);
    }

    /// Returns false (and puts the request back at the front) when the pool is short.
    fn try_prealloc(&mut self, p: Prealloc, items: &mut Vec<(String, TokenItem)>) -> bool {
        let ps = self.runner.engine.options().page_size;
        let prompt = &p.generate.prompt;
        let alloc = &mut self.runner.engine.pool.alloc;
        let prefix =
            match self
                .runner
                .cache
                .acquire(prompt, prompt.len().saturating_sub(1) / ps, alloc)
            {
                Ok(pages) => pages,
                Err(e) => {
                    self.fail(p.seq, format!("decode prealloc: {e}"), items);
                    return true;
                }
            };
        let cached = prefix.len() * ps;
        if prompt.len() - cached < self.threshold || prompt.is_empty() {
            // Cheaper to prefill the short uncached rest here than to pair for it.
            let _ = alloc.release_all(&prefix);
            Self::drop_bootstrap_half(&self.outbox, &p.peer);
            metrics::counter!(m::DECODE_LOCAL_PREFILLS, "reason" => "cached").increment(1);
            if let Some((root, phase)) = self.spans.get_mut(&p.seq) {
                *phase = tracing::info_span!(
                    parent: &*root,
                    "decoding",
                    request = p.generate.request,
                    local_prefill = true,
                    cached_tokens = cached
                );
            }
            let Prealloc {
                seq,
                router,
                mut generate,
                ..
            } = p;
            generate.prefill = None;
            self.submit_local(seq, router, generate, items);
            return true;
        }
        let need = prompt.len().div_ceil(ps) - prefix.len();
        let (waiting, running) = self.runner.scheduler.queue_lengths();
        let busy = waiting + running + self.transfers.len() >= self.max_running;
        if alloc.free_pages() < need {
            let short = need - alloc.free_pages();
            self.runner.cache.evict(short, alloc);
        }
        if busy || alloc.free_pages() < need {
            // Backpressure: no notice until every page can be reserved.
            let _ = alloc.release_all(&prefix);
            self.prealloc.push_front(p);
            return false;
        }
        let pages = match alloc.alloc(need) {
            Ok(pages) => pages,
            Err(e) => {
                let _ = alloc.release_all(&prefix);
                self.fail(p.seq, format!("decode prealloc: {e}"), items);
                return true;
            }
        };
        let attempt = match self
            .ledger
            .open(p.peer.room, &p.peer.node, pages.clone(), true, alloc)
        {
            Ok(k) => k,
            Err(e) => {
                let _ = alloc.release_all(&prefix);
                let _ = alloc.release_all(&pages);
                self.fail(p.seq, format!("decode prealloc: {e}"), items);
                Self::drop_bootstrap_half(&self.outbox, &p.peer);
                return true;
            }
        };
        history::record("open", &self.node, self.incarnation, attempt, &pages);
        let layout = *self.runner.engine.pool.layout();
        let grant = self.grants.grant(attempt, &layout, &pages);
        let notice = PreallocNotice {
            room: p.peer.room,
            attempt,
            pages: pages.clone(),
            decode_prefix_len: cached,
            incarnation: self.incarnation,
            endpoint: self.endpoint.clone(),
            claim_slot: grant.slot,
            prefill_incarnation: self.prefill_incarnations.get(&p.peer.node).copied(),
        };
        self.outbox
            .send(&p.peer.node, BOOTSTRAP_SERVICE, kinds::PREALLOC, &notice);
        if let Some((root, phase)) = self.spans.get_mut(&p.seq) {
            root.record("attempt", attempt);
            *phase = tracing::info_span!(
                parent: &*root,
                "transfer_wait",
                request = p.generate.request,
                room = p.peer.room,
                attempt,
                pages = need,
                decode_prefix_len = cached
            );
            tracing::debug!(parent: &*root, pages = need, cached, "notice sent");
        }
        self.transfers.insert(
            (p.peer.node.clone(), p.peer.room),
            Transfer {
                seq: p.seq,
                router: p.router,
                generate: p.generate,
                peer: p.peer,
                attempt,
                prefix,
                pages,
                noticed: Instant::now(),
                progressed: Instant::now(),
                bytes: 0,
            },
        );
        true
    }

    /// The KV is complete: publish it and start decoding with P's first token.
    fn done(&mut self, node: String, d: TransferDone, items: &mut Vec<(String, TokenItem)>) {
        let key = (node, d.room);
        let Some(t) = self.transfers.get(&key) else {
            stale("done");
            return; // aborted meanwhile, or a duplicate
        };
        if t.attempt != d.attempt {
            stale("done");
            return; // an old attempt's message never touches a newer one
        }
        let Some(t) = self.transfers.remove(&key) else {
            return;
        };
        // Revoked first (as everywhere): no write of the attempt can land once the pages are
        // checked and change hands. Prefill fenced before its done, so no claim is held; one
        // that is means a writer still copies into these pages: never published.
        if self.grants.revoke(t.attempt) == Revocation::Busy {
            tracing::error!(
                room = d.room,
                attempt = t.attempt,
                "a writer still holds a complete transfer's claim"
            );
            self.end_transfer(&t, AbortReason::ProducerFailure, Prefill::Stop);
            self.fail(
                t.seq,
                "decode transfer: a write was still landing after prefill's fence; not served"
                    .into(),
                items,
            );
            return;
        }
        if self.checksum
            && let Err(e) = self.verify(&t, &d)
        {
            // Corrupted or incomplete: never published. The grant is revoked, so the pages
            // are free at once; the router retries.
            metrics::counter!(m::KV_CHECKSUM_FAILURES).increment(1);
            tracing::error!(room = d.room, attempt = t.attempt, error = %e, "KV failed its checksum");
            self.end_transfer(&t, AbortReason::ProducerFailure, Prefill::Ended);
            self.fail(t.seq, format!("decode transfer: {e}; not served"), items);
            return;
        }
        let alloc = &mut self.runner.engine.pool.alloc;
        match self.ledger.complete(t.attempt, alloc) {
            Ok((duet_transport::Outcome::Applied, _)) => {
                history::record("publish", &self.node, self.incarnation, t.attempt, &[]);
            }
            other => {
                tracing::error!(
                    ?other,
                    attempt = t.attempt,
                    "a done that the ledger refused"
                );
                return;
            }
        }
        self.ledger.prune();
        let latency = t.noticed.elapsed().as_secs_f64();
        metrics::histogram!(m::TRANSFER_LATENCY).record(latency);
        metrics::counter!(m::TRANSFERS, "side" => "decode", "outcome" => "completed").increment(1);
        // What the client sees as cached: the larger of what D held and what P reused.
        let cached =
            (t.prefix.len() * self.runner.engine.options().page_size).max(d.prefill_cached);
        let mut pages = t.prefix;
        pages.extend_from_slice(&t.pages);
        let first = Sampled {
            token: d.token,
            logprob: d.logprob,
        };
        let tok = &self.runner.engine.model.tokenizer;
        match self.runner.scheduler.admit_transferred(
            t.seq,
            t.generate.prompt,
            t.generate.params,
            t.generate.resume,
            d.sampler,
            pages.clone(),
            first,
            cached,
            tok,
            &mut self.runner.engine.pool.alloc,
            &mut self.runner.cache,
        ) {
            Ok(ev) => {
                let finished = ev.finish.is_some();
                if let Some((root, phase)) = self.spans.get_mut(&t.seq) {
                    *phase = tracing::info_span!(
                        parent: &*root,
                        "decoding",
                        request = t.generate.request,
                        room = t.peer.room,
                        attempt = t.attempt,
                        local_prefill = false
                    );
                    tracing::info!(parent: &*phase, token = ev.token, kv_bytes = d.bytes, "first token");
                    self.first_tokens.insert(t.seq);
                    if let Some(reason) = ev.finish {
                        tracing::info!(parent: &*phase, reason = ?reason, "finished");
                    }
                }
                if finished {
                    self.spans.remove(&t.seq);
                    self.first_tokens.remove(&t.seq);
                }
                items.push((
                    t.router.clone(),
                    TokenItem {
                        request: t.generate.request,
                        token: Some(ev.token),
                        logprob: ev.logprob,
                        text: ev.text,
                        finish: ev.finish,
                        error: None,
                        cached_tokens: ev.cached_tokens,
                        class: FailureClass::Attempt,
                    },
                ));
                if finished {
                    self.owners.remove(&t.seq);
                    self.seqs.remove(&(t.router, t.generate.request));
                }
            }
            Err(e) => {
                let _ = self.runner.engine.pool.alloc.release_all(&pages);
                self.fail(t.seq, format!("decode admit: {e}"), items);
            }
        }
    }

    /// Checks that prefill's checksums cover every page of the transfer and match the bytes
    /// that landed here.
    fn verify(&self, t: &Transfer, d: &TransferDone) -> Result<(), String> {
        let start = Instant::now();
        let pool = &self.runner.engine.pool;
        let mut covered: Vec<PageId> = d.checksums.iter().flat_map(|c| c.pages.clone()).collect();
        covered.sort_unstable();
        let mut want = t.pages.clone();
        want.sort_unstable();
        if covered != want {
            return Err(format!(
                "checksums cover {} of the {} pages written",
                covered.len(),
                want.len()
            ));
        }
        for c in &d.checksums {
            let got = duet_transport::pages_crc(&pool.memory(), pool.layout(), &c.pages)
                .map_err(|e| e.to_string())?;
            if got != c.crc {
                return Err(format!(
                    "checksum mismatch on pages {:?}: prefill sent {:#010x}, decode holds {got:#010x}",
                    c.pages, c.crc
                ));
            }
        }
        metrics::histogram!(m::KV_VERIFY).record(start.elapsed().as_secs_f64());
        Ok(())
    }

    /// Ends a transfer that will not complete: aborted in the ledger (never published; the
    /// pins stay), prefill told to stop writing it (unless it reported the end itself), and
    /// its pages freed as soon as the revoke of its grant
    /// is proven ([`settle`](Self::settle)); until then they are quarantined.
    fn end_transfer(&mut self, t: &Transfer, reason: AbortReason, prefill: Prefill) {
        let now = self.now_ms();
        let alloc = &mut self.runner.engine.pool.alloc;
        let _ = self.ledger.abort(t.attempt, reason, now, alloc);
        let _ = alloc.release_all(&t.prefix);
        metrics::counter!(m::TRANSFERS, "side" => "decode", "outcome" => "aborted").increment(1);
        metrics::counter!(m::TRANSFER_ABORTS, "side" => "decode", "reason" => reason.name())
            .increment(1);
        if prefill == Prefill::Stop {
            Self::abort_at_prefill(&self.outbox, t);
        }
        self.draining
            .insert(t.attempt, (t.peer.node.clone(), t.peer.room));
        self.settle(t.attempt);
    }

    /// Frees an aborted attempt's pages if no write of it can land any more: its grant is
    /// revoked and no writer holds it (DESIGN rule 2; the only way pages of an aborted
    /// attempt come back). True when it closed the attempt; false while a writer holds its
    /// claim (asked again every turn, see [`expire`](Self::expire)), or when the attempt was
    /// not draining.
    fn settle(&mut self, attempt: u64) -> bool {
        if !self.draining.contains_key(&attempt) {
            return false;
        }
        if self.grants.revoke(attempt) == Revocation::Busy {
            return false;
        }
        self.draining.remove(&attempt);
        self.stalled.remove(&attempt);
        let drained = self
            .ledger
            .drained(attempt, &mut self.runner.engine.pool.alloc);
        if let Ok(duet_transport::Outcome::Applied) = drained {
            history::record("close", &self.node, self.incarnation, attempt, &[]);
        }
        self.ledger.prune();
        true
    }

    /// Stops a request wherever it is.
    fn abort_seq(&mut self, seq: u64, reason: AbortReason) {
        if let Some(i) = self.prealloc.iter().position(|p| p.seq == seq) {
            if let Some(p) = self.prealloc.remove(i) {
                Self::drop_bootstrap_half(&self.outbox, &p.peer);
            }
            return;
        }
        let key = self
            .transfers
            .iter()
            .find(|(_, t)| t.seq == seq)
            .map(|(k, _)| k.clone());
        if let Some(t) = key.and_then(|k| self.transfers.remove(&k)) {
            self.end_transfer(&t, reason, Prefill::Stop);
            return;
        }
        if let Err(e) = self.runner.abort(seq) {
            tracing::error!(error = %e, "abort left the pool inconsistent");
        }
    }

    /// A prefill node is unreachable (`forget_peer`: membership marked it down, so its layout
    /// hello is forgotten too) or its worker restarted: the transfers noticed to it fail (the
    /// router may retry them) and requests waiting for pages for it fail too. Their pages come
    /// back once each revoke is proven: at once for a writer that holds no claim, and for a
    /// paused one mid-copy only when it finishes that run or dies, however long that takes.
    fn lose_peer(
        &mut self,
        node: &str,
        why: &str,
        forget_peer: bool,
        items: &mut Vec<(String, TokenItem)>,
    ) {
        if forget_peer {
            self.ready.remove(node);
        }
        // A restarted worker's node stays ready: its layout hello holds for its next worker
        // incarnation (dropping it without the actor forgetting the hello stalled every later
        // request for this node until its bootstrap deadline).
        let phase = if forget_peer { "unreachable" } else { "lost" };
        for t in self.take_transfers(node) {
            self.end_transfer(&t, AbortReason::ProducerFailure, Prefill::Stop);
            self.fail(
                t.seq,
                format!("decode transfer: prefill {node} {phase}: {why}"),
                items,
            );
        }
        for p in self.take_prealloc(|p| p.peer.node == node) {
            self.fail(
                p.seq,
                format!("decode prealloc: prefill {node} {phase}: {why}"),
                items,
            );
            Self::drop_bootstrap_half(&self.outbox, &p.peer);
        }
    }

    /// Transfers past their deadline fail (and drain); quarantined attempts are asked again
    /// (a writer that held its claim may have finished); those still unproven get a drain
    /// fence (again each fence interval), and past the backstop an alert. Never a release.
    fn expire(&mut self, items: &mut Vec<(String, TokenItem)>) {
        let now = self.now_ms();
        let quarantined: Vec<u64> = self.draining.keys().copied().collect();
        for attempt in quarantined {
            self.settle(attempt);
        }
        for (attempt, node) in self
            .ledger
            .overdue(now, self.forced_drain.as_millis() as u64)
        {
            if self.stalled.insert(attempt) {
                let pages = self.ledger.pages(attempt);
                tracing::error!(
                    %node,
                    attempt,
                    pages,
                    backstop = ?self.forced_drain,
                    "a writer on {node} still holds an aborted transfer's claim past the backstop: \
                     its pages stay quarantined until it finishes its copy or its process dies"
                );
                metrics::counter!(m::QUARANTINE_STALLS, "peer" => node.clone()).increment(1);
            }
        }
        let backstop = self.drain_fence.as_millis() as u64;
        if now.saturating_sub(self.last_fence_ms) >= backstop {
            self.last_fence_ms = now;
            for (attempt, _) in self.ledger.overdue(now, backstop) {
                if let Some((node, room)) = self.draining.get(&attempt) {
                    tracing::warn!(%node, room, attempt, "abort unacknowledged: drain fence");
                    self.outbox.send(
                        node,
                        BOOTSTRAP_SERVICE,
                        kinds::DRAIN_FENCE,
                        &Abort {
                            room: *room,
                            attempt: Some(attempt),
                        },
                    );
                }
            }
        }
        // A transfer's deadline is on progress, not on its work: a long prompt that keeps
        // computing and writing never hits it; a stopped or wedged prefill does.
        let late: Vec<(String, u64)> = self
            .transfers
            .iter()
            .filter(|(_, t)| t.progressed.elapsed() > self.transfer_timeout)
            .map(|(k, _)| k.clone())
            .collect();
        for k in late {
            if let Some(t) = self.transfers.remove(&k) {
                self.end_transfer(&t, AbortReason::Timeout, Prefill::Stop);
                let limit = self.transfer_timeout;
                self.fail_as(
                    t.seq,
                    format!(
                        "decode transfer: no progress for {limit:?} (prefill {} computed and wrote nothing for it)",
                        t.peer.node
                    ),
                    FailureClass::Stalled,
                    items,
                );
            }
        }
        let late: Vec<u64> = self
            .prealloc
            .iter()
            .filter(|p| p.since.elapsed() > self.transfer_timeout)
            .map(|p| p.seq)
            .collect();
        for seq in late {
            self.abort_seq(seq, AbortReason::Timeout);
            let limit = self.transfer_timeout;
            self.fail(
                seq,
                format!("decode prealloc: no pages for the prompt within {limit:?}"),
                items,
            );
        }
    }

    /// Fails a request to its router (if it still has one).
    fn fail(&mut self, seq: u64, error: String, items: &mut Vec<(String, TokenItem)>) {
        self.fail_as(seq, error, FailureClass::Attempt, items);
    }

    /// [`fail`](Self::fail) with a failure class.
    fn fail_as(
        &mut self,
        seq: u64,
        error: String,
        class: FailureClass,
        items: &mut Vec<(String, TokenItem)>,
    ) {
        if let Some((root, phase)) = self.spans.remove(&seq) {
            tracing::warn!(parent: &phase, %error, "request failed");
            drop(root);
        }
        self.first_tokens.remove(&seq);
        if let Some((router, request)) = self.owners.remove(&seq) {
            self.seqs.remove(&(router.clone(), request));
            items.push((router, TokenItem::failed_as(request, error, class)));
        }
    }

    fn step(&mut self, items: &mut Vec<(String, TokenItem)>) {
        match self.runner.step() {
            Ok(events) => {
                for ev in events {
                    let Some((router, request)) = self.owners.get(&ev.seq).cloned() else {
                        continue;
                    };
                    if let Some((_, phase)) = self.spans.get(&ev.seq) {
                        if self.first_tokens.insert(ev.seq) {
                            tracing::info!(parent: phase, token = ev.token, "first token");
                        }
                        if let Some(reason) = ev.finish {
                            tracing::info!(parent: phase, reason = ?reason, "finished");
                        }
                    }
                    if ev.finish.is_some() {
                        self.owners.remove(&ev.seq);
                        self.seqs.remove(&(router.clone(), request));
                        self.spans.remove(&ev.seq);
                        self.first_tokens.remove(&ev.seq);
                    }
                    items.push((
                        router,
                        TokenItem {
                            request,
                            token: Some(ev.token),
                            logprob: ev.logprob,
                            text: ev.text,
                            finish: ev.finish,
                            error: None,
                            cached_tokens: ev.cached_tokens,
                            class: FailureClass::Attempt,
                        },
                    ));
                }
            }
            Err(e) => {
                // A step that cannot run fails every running request; transfers go on.
                tracing::error!(error = %e, "engine step failed");
                let running: Vec<u64> = self
                    .owners
                    .keys()
                    .copied()
                    .filter(|s| {
                        !self.prealloc.iter().any(|p| p.seq == *s)
                            && !self.transfers.values().any(|t| t.seq == *s)
                    })
                    .collect();
                for seq in running {
                    let _ = self.runner.abort(seq);
                    self.fail(seq, format!("decode step: {e}"), items);
                }
            }
        }
    }

    fn publish_load(&self) {
        let runner = &self.runner;
        let stats = runner.engine.pool.alloc.stats();
        let (waiting, running) = runner.scheduler.queue_lengths();
        let mut l = self.load.lock().unwrap_or_else(|p| p.into_inner());
        l.queued_tokens = runner.scheduler.queued_tokens()
            + self
                .prealloc
                .iter()
                .map(|p| p.generate.prompt.len())
                .sum::<usize>();
        l.waiting = waiting + self.prealloc.len() + self.transfers.len();
        l.running = running;
        l.in_flight = self.seqs.len();
        l.free_pages = stats.free;
        l.pinned_pages = stats.pinned;
        l.cached_pages = runner.cache.evictable(&runner.engine.pool.alloc);
        l.quarantined_pages = self.ledger.quarantined_pages();
    }
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

/// Lets a draining node wait for the requests this worker holds.
pub(crate) fn install_drain_probe(
    ctx: &NodeContext,
    name: &str,
    load: &Arc<Mutex<LoadReport>>,
    timeout: Duration,
) {
    let load = load.clone();
    ctx.drain.set_timeout(timeout);
    ctx.drain.set_probe(name, move || {
        load.lock().unwrap_or_else(|p| p.into_inner()).in_flight
    });
}

/// Counts a message about an attempt that is no longer current (duplicate, late, or of an
/// older attempt): ignored, never applied to a newer one.
fn stale(kind: &'static str) {
    metrics::counter!(m::STALE_MESSAGES, "kind" => kind).increment(1);
}

/// Tells every router this worker's load, every `interval`.
pub(crate) async fn report_load(
    ctx: Arc<NodeContext>,
    interval: Duration,
    load: Arc<Mutex<LoadReport>>,
) {
    let routers: Vec<String> = ctx
        .config
        .nodes
        .iter()
        .filter(|n| n.role == Role::Router && n.name != ctx.me.name)
        .map(|n| n.name.clone())
        .collect();
    let mut tick = tokio::time::interval(interval);
    loop {
        tick.tick().await;
        let mut report = load.lock().unwrap_or_else(|p| p.into_inner()).clone();
        report.draining = ctx.drain.is_draining();
        metrics::gauge!(m::KV_PAGES_TOTAL).set(report.total_pages as f64);
        metrics::gauge!(m::KV_PAGES_FREE).set(report.free_pages as f64);
        metrics::gauge!(m::KV_PAGES_CACHED).set(report.cached_pages as f64);
        metrics::gauge!(m::KV_PAGES_PINNED).set(report.pinned_pages as f64);
        metrics::gauge!(m::KV_PAGES_QUARANTINED).set(report.quarantined_pages as f64);
        metrics::gauge!(m::KV_PAGES_USED).set((report.total_pages - report.free_pages) as f64);
        metrics::gauge!(m::SEQS_RUNNING).set(report.running as f64);
        metrics::gauge!(m::SEQS_WAITING).set(report.waiting as f64);
        let body = wire::encode_body(&report);
        for r in &routers {
            if let Ok(link) = ctx.links.get(r) {
                let _ = link
                    .send(kinds::LOAD, WORKER_SERVICE, ROUTER_SERVICE, body.clone())
                    .await;
            }
        }
    }
}
