//! The prefill worker and its `KvSender`: chunked prefill whose finished pages stream into
//! decode's reserved pages while the next chunk computes.
//!
//! ```text
//!   engine thread                                  sender thread (KvSender)
//!   plan ─ step(chunk k) ─ pin chunk k's full pages ──Write──► write runs into D's pages
//!   plan ─ step(chunk k+1) ...                                 ChunkWritten ──► D
//!   last chunk: pin the rest (partial page too), commit: first token + sampler state
//!                                      ──Finish──► fence; TransferDone ──► D
//!   ◄────────────────────────────────── Sent ───── (source pins drop: ledger complete)
//!   abort: stop computing; ──Drain──► fence; AbortAck ──► D; ◄── Drained (pins drop)
//! ```
//!
//! Non-final writes carry only full pages (the partial last page is rewritten by the next
//! chunk), so every write is page-aligned. The sender runs jobs in order, so a Finish or
//! Drain fence covers every write queued before it. The source pins (the transfer ledger,
//! source side) keep a page from reuse while a write may still read it, even after the
//! sequence itself has ended on this side.

use std::collections::HashMap;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use duet_engine::{Engine, Runner};
use duet_gpu::{PageId, PoolMemory};
use duet_runtime::config::Role;
use duet_runtime::context::NodeContext;
use duet_runtime::metrics as m;
use duet_runtime::services::Inbound;
use duet_runtime::wire;
use duet_transport::{
    AbortReason, Backend, ClaimError, Endpoint, KvTransport, PageRun, Side, TransferLedger,
    TransportError, WriteGrant, WriteStage, coalesce,
};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use rand::Rng;
use tokio::task::JoinHandle;

use crate::decode::{engine_options, install_drain_probe, layout_info, load_model, report_load};
use crate::handoff::HandOff;
use crate::history;
use crate::outbox::{self, Outbox};
use crate::protocol::{
    Abort, AbortAck, ChunkWritten, FailureClass, Heartbeat, LayoutHello, LayoutInfo, LoadReport,
    PREFILL_SERVICE, PrefillStart, RunChecksum, TransferDone, TransferFailed, WORKER_SERVICE,
    WorkerKind, kinds,
};
use crate::settings::ServingConfig;

/// The prefill worker actor.
pub struct PrefillWorker;

/// Local messages from the bootstrap actor.
#[derive(Debug)]
pub struct PrefillMsg(Inbound);

duet_runtime::inbound_message!(struct PrefillMsg);

enum Cmd {
    Start(Box<PrefillStart>),
    Abort {
        decode: String,
        abort: Abort,
    },
    Sent {
        seq: u64,
    },
    Drained {
        seq: u64,
    },
    SendFailed {
        seq: u64,
        error: String,
    },
    /// The KV sender actor restarted: the old thread is joined, jobs queued to it are lost.
    SenderRestarted,
    Shutdown,
}

/// The running worker. Dropping it stops the engine thread; the sender thread stops between
/// jobs, and the next incarnation joins it before announcing itself to decode workers.
pub struct PrefillState {
    ctx: Arc<NodeContext>,
    incarnation: u64,
    layout: LayoutInfo,
    cmds: std_mpsc::Sender<Cmd>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    tasks: Vec<JoinHandle<()>>,
    hub: Arc<SenderHub>,
}

impl Drop for PrefillState {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        // The sender thread stops between jobs; the next worker joins it before it starts.
        self.hub.retire(self.incarnation);
        let _ = self.cmds.send(Cmd::Shutdown);
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Actor for PrefillWorker {
    type Msg = PrefillMsg;
    type State = PrefillState;
    type Arguments = (Arc<NodeContext>, Arc<SenderHub>);

    async fn pre_start(
        &self,
        myself: ActorRef<PrefillMsg>,
        (ctx, hub): (Arc<NodeContext>, Arc<SenderHub>),
    ) -> Result<PrefillState, ActorProcessingErr> {
        let settings = ServingConfig::for_node(&ctx.config, &ctx.me.name)?;
        let runner = {
            let s = settings.clone();
            let hub = hub.clone();
            tokio::task::spawn_blocking(move || {
                // Once the previous incarnation's sender thread is joined, nothing of it can
                // write into a decode pool.
                hub.replace_thread(None).map_err(|e| e.to_string())?;
                let model = load_model(&s)?;
                let options = engine_options(&s, &model);
                let engine = Engine::new(model, options).map_err(|e| e.to_string())?;
                let mut runner = Runner::new(engine, s.max_batch_tokens, s.max_running);
                // A finished prompt's KV stays for a while: a stream whose decode worker dies
                // continues from it instead of recomputing it.
                if s.migration {
                    runner.cache.set_keep(s.migration_keep);
                }
                Ok::<_, String>(runner)
            })
            .await??
        };
        let layout = layout_info(&runner.engine.model, runner.engine.options());
        let incarnation: u64 = rand::rng().random();
        let node = ctx.me.name.clone();
        let load = Arc::new(Mutex::new(LoadReport::idle(
            node.clone(),
            WorkerKind::Prefill,
            layout.clone(),
            incarnation,
            runner.engine.pool.capacity(),
        )));
        let holding = Arc::new(Mutex::new(Holding::default()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (cmd_tx, cmd_rx) = std_mpsc::channel();
        let (outbox, outbox_task) = outbox::start(ctx.clone(), WORKER_SERVICE);
        let parts = SenderParts {
            memory: runner.engine.pool.memory(),
            layout: *runner.engine.pool.layout(),
            outbox: outbox.clone(),
            done: cmd_tx.clone(),
            checksum: settings.kv_checksum,
            id: incarnation,
            node: node.clone(),
        };
        let h = hub.clone();
        tokio::task::spawn_blocking(move || h.replace_thread(Some(parts))).await??;
        {
            let core = PrefillCore {
                runner,
                ledger: TransferLedger::new(Side::Source),
                jobs: hub.clone(),
                worker: incarnation,
                outbox,
                load: load.clone(),
                holding: holding.clone(),
                flights: HashMap::new(),
                rooms: HashMap::new(),
                next_seq: 0,
                epoch: Instant::now(),
                stop: stop.clone(),
            };
            std::thread::Builder::new()
                .name(format!("duet-prefill-{node}"))
                .spawn(move || core.run(cmd_rx))?;
        }
        install_drain_probe(&ctx, "prefill worker", &load, settings.shutdown_drain);
        let reporter = tokio::spawn(report_load(ctx.clone(), settings.load_interval, load));
        let heartbeat = tokio::spawn(heartbeats(
            ctx.clone(),
            settings.load_interval,
            incarnation,
            holding,
        ));
        ctx.services.register(PREFILL_SERVICE, myself);
        tracing::info!(%node, incarnation, "prefill worker ready");
        Ok(PrefillState {
            ctx,
            incarnation,
            layout,
            cmds: cmd_tx,
            stop,
            tasks: vec![reporter, heartbeat, outbox_task],
            hub,
        })
    }

    async fn post_stop(
        &self,
        myself: ActorRef<PrefillMsg>,
        state: &mut PrefillState,
    ) -> Result<(), ActorProcessingErr> {
        state
            .ctx
            .services
            .unregister(PREFILL_SERVICE, myself.get_id());
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<PrefillMsg>,
        PrefillMsg(inbound): PrefillMsg,
        state: &mut PrefillState,
    ) -> Result<(), ActorProcessingErr> {
        let Inbound { envelope, reply } = inbound;
        let from = envelope.sender_node().to_string();
        match (envelope.kind.as_str(), reply) {
            (kinds::HELLO, Some(reply)) => match wire::decode_body::<LayoutHello>(&envelope.body) {
                Ok(theirs) => {
                    let me = state.ctx.me.name.clone();
                    match state.layout.mismatch(&theirs.layout, &me, &theirs.node) {
                        Some(e) => reply.fail(e),
                        None => reply.ok(wire::encode_body(&LayoutHello {
                            node: me,
                            incarnation: state.incarnation,
                            layout: state.layout.clone(),
                        })),
                    }
                }
                Err(e) => reply.fail(format!("prefill: malformed hello: {e}")),
            },
            (kinds::START, None) => {
                if let Ok(start) = wire::decode_body::<PrefillStart>(&envelope.body) {
                    let _ = state.cmds.send(Cmd::Start(Box::new(start)));
                }
            }
            (kinds::STOP, None) => {
                if let Ok(abort) = wire::decode_body::<Abort>(&envelope.body) {
                    let _ = state.cmds.send(Cmd::Abort {
                        decode: from,
                        abort,
                    });
                }
            }
            (other, Some(reply)) => reply.fail(format!("prefill does not handle `{other}`")),
            (other, None) => tracing::warn!(kind = other, "prefill ignored a message"),
        }
        Ok(())
    }
}

/// What the engine thread holds, for the heartbeats: its steps so far and, per decode node,
/// the attempts it holds.
#[derive(Debug, Default)]
struct Holding {
    steps: u64,
    by_decode: HashMap<String, Vec<u64>>,
}

/// Tells every decode node this worker's incarnation, the attempts it holds for that node and
/// how far its engine got, every `interval`.
async fn heartbeats(
    ctx: Arc<NodeContext>,
    interval: Duration,
    incarnation: u64,
    holding: Arc<Mutex<Holding>>,
) {
    let decoders: Vec<String> = ctx
        .config
        .nodes
        .iter()
        .filter(|n| n.role == Role::Decode)
        .map(|n| n.name.clone())
        .collect();
    let mut tick = tokio::time::interval(interval);
    loop {
        tick.tick().await;
        let bodies: Vec<(&String, Vec<u8>)> = {
            let h = holding.lock().unwrap_or_else(|p| p.into_inner());
            decoders
                .iter()
                .map(|d| {
                    let beat = Heartbeat {
                        incarnation,
                        holding: h.by_decode.get(d).cloned().unwrap_or_default(),
                        steps: h.steps,
                    };
                    (d, wire::encode_body(&beat))
                })
                .collect()
        };
        for (d, body) in bodies {
            if let Ok(link) = ctx.links.get(d) {
                let _ = link
                    .send(kinds::HEARTBEAT, PREFILL_SERVICE, WORKER_SERVICE, body)
                    .await;
            }
        }
    }
}

/// One request being prefilled for a decode worker.
struct Flight {
    start: PrefillStart,
    decode: String,
    /// This side's ledger key (source pins).
    key: u64,
    /// Next page index of the sequence to send (starts past decode's cached prefix).
    next_page: usize,
    /// Index of the first page decode does not hold (the notice's pages start there).
    skip: usize,
    matched: Instant,
    first_chunk: Option<Instant>,
    aborted: bool,
    /// The request's span here (child of the router's), and its queue wait until the first
    /// chunk computes.
    span: tracing::Span,
    queue_wait: Option<tracing::Span>,
}

enum Job {
    Write {
        seq: u64,
        to: Target,
        runs: Vec<PageRun>,
        pages_so_far: usize,
    },
    /// One layer of the last chunk's pages, sent while the later layers compute.
    Layer {
        seq: u64,
        to: Target,
        runs: Arc<Vec<PageRun>>,
        layer: usize,
        pages_so_far: usize,
    },
    Finish {
        seq: u64,
        to: Target,
        done: TransferDone,
        compute_end: Instant,
    },
    Drain {
        seq: u64,
        to: Target,
        failed: Option<(String, FailureClass)>,
    },
}

#[derive(Clone)]
struct Target {
    /// The request's prefill span (parent of the write spans).
    span: tracing::Span,
    node: String,
    incarnation: u64,
    endpoint: Endpoint,
    backend: Backend,
    room: u64,
    attempt: u64,
    /// What every write of the attempt carries (decode revokes it to stop them).
    grant: WriteGrant,
}

/// Which decode pool a transport writes, and how: its node, worker incarnation, backend, and
/// (for TCP) the receiver's address and secret.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct LinkKey {
    node: String,
    incarnation: u64,
    backend: Backend,
    tcp: Option<(std::net::SocketAddr, u64)>,
}

impl LinkKey {
    fn of(to: &Target) -> LinkKey {
        LinkKey {
            node: to.node.clone(),
            incarnation: to.incarnation,
            backend: to.backend,
            tcp: (to.backend == Backend::Tcp)
                .then_some(to.endpoint.tcp)
                .flatten(),
        }
    }
}

struct PrefillCore {
    runner: Runner,
    ledger: TransferLedger,
    jobs: Arc<SenderHub>,
    /// This worker's incarnation (its jobs go only to a sender thread built for it).
    worker: u64,
    outbox: Outbox,
    load: Arc<Mutex<LoadReport>>,
    /// What the heartbeats tell decode nodes (see [`Holding`]).
    holding: Arc<Mutex<Holding>>,
    flights: HashMap<u64, Flight>,
    /// (decode node, room) -> sequence.
    rooms: HashMap<(String, u64), u64>,
    next_seq: u64,
    epoch: Instant,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl PrefillCore {
    fn run(mut self, cmds: std_mpsc::Receiver<Cmd>) {
        loop {
            if self.stop.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            let first = if self.runner.scheduler.is_idle() {
                match cmds.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return,
                }
            } else {
                None
            };
            for cmd in first
                .into_iter()
                .chain(std::iter::from_fn(|| cmds.try_recv().ok()))
            {
                if matches!(cmd, Cmd::Shutdown) {
                    return;
                }
                self.command(cmd);
            }
            if !self.runner.scheduler.is_idle() {
                self.step();
            }
            self.publish_load();
        }
    }

    fn target(f: &Flight) -> Target {
        Target {
            span: f.span.clone(),
            node: f.decode.clone(),
            incarnation: f.start.notice.incarnation,
            endpoint: f.start.notice.endpoint.clone(),
            backend: f.start.backend,
            room: f.start.notice.room,
            attempt: f.start.notice.attempt,
            grant: f.start.notice.grant(),
        }
    }

    fn command(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Start(start) => {
                let start = *start;
                self.next_seq += 1;
                let seq = self.next_seq;
                let decode = start.request.decode.clone();
                let room = start.notice.room;
                let ps = self.runner.engine.options().page_size;
                let fail_as = |me: &Self, error: String, class: FailureClass| {
                    me.outbox.send(
                        &decode,
                        WORKER_SERVICE,
                        kinds::FAILED,
                        &TransferFailed {
                            room,
                            attempt: Some(start.notice.attempt),
                            error,
                            class,
                        },
                    );
                };
                let fail = |me: &Self, error: String| fail_as(me, error, FailureClass::Attempt);
                if start
                    .notice
                    .prefill_incarnation
                    .is_some_and(|i| i != self.worker)
                {
                    // Decode closes what it noticed to an earlier worker when it hears of this
                    // one: writing it now could land in pages already given back.
                    return fail_as(
                        self,
                        "prefill bootstrap: the notice was for an earlier prefill worker (it restarted)"
                            .into(),
                        FailureClass::Restart,
                    );
                }
                let n = start.request.prompt.len();
                let skip = start.notice.decode_prefix_len / ps;
                if start.notice.decode_prefix_len % ps != 0
                    || skip + start.notice.pages.len() != n.div_ceil(ps)
                {
                    let e = format!(
                        "prefill: the notice's {} pages after a prefix of {} do not fit a prompt of {n} tokens",
                        start.notice.pages.len(),
                        start.notice.decode_prefix_len
                    );
                    return fail(self, e);
                }
                let alloc = &mut self.runner.engine.pool.alloc;
                let key = match self.ledger.open(room, &decode, Vec::new(), false, alloc) {
                    Ok(k) => k,
                    Err(e) => return fail(self, format!("prefill: {e}")),
                };
                if let Err(e) = self.runner.scheduler.submit_prefill(
                    seq,
                    start.request.prompt.clone(),
                    start.request.params.clone(),
                    start.request.resume,
                ) {
                    let _ = self
                        .ledger
                        .abort(key, AbortReason::ProducerFailure, 0, alloc);
                    let _ = self.ledger.drained(key, alloc);
                    return fail(self, format!("prefill admission: {e}"));
                }
                self.rooms.insert((decode.clone(), room), seq);
                let span = tracing::info_span!(
                    "prefill",
                    room,
                    attempt = start.notice.attempt,
                    decode = %decode,
                    prompt_tokens = n,
                    decode_prefix_len = start.notice.decode_prefix_len,
                    backend = start.backend.name(),
                );
                duet_runtime::telemetry::follow(&span, start.traceparent.as_deref());
                let queue_wait = Some(tracing::info_span!(parent: &span, "queue_wait"));
                self.flights.insert(
                    seq,
                    Flight {
                        start,
                        decode,
                        key,
                        next_page: skip,
                        skip,
                        matched: Instant::now(),
                        first_chunk: None,
                        aborted: false,
                        span,
                        queue_wait,
                    },
                );
            }
            Cmd::Abort { decode, abort } => {
                let Some(attempt) = abort.attempt else { return };
                let seq = self.rooms.get(&(decode.clone(), abort.room)).copied();
                match seq.and_then(|s| self.flights.get(&s).map(|f| (s, f))) {
                    Some((seq, f)) if f.start.notice.attempt == attempt => {
                        self.abort_flight(seq, AbortReason::ConsumerFailure, None);
                    }
                    _ => {
                        // Finished or never started: no write of it is pending.
                        self.outbox.send(
                            &decode,
                            WORKER_SERVICE,
                            kinds::ABORT_ACK,
                            &AbortAck {
                                room: abort.room,
                                attempt,
                            },
                        );
                    }
                }
            }
            // Aborted after its Finish was queued: the Drain behind it releases the pins (a
            // completion here would be refused by the ledger, and the flight forgotten with
            // its pages pinned for good).
            Cmd::Sent { seq } if self.flights.get(&seq).is_some_and(|f| f.aborted) => {}
            Cmd::Sent { seq } => {
                if let Some(f) = self.flights.remove(&seq) {
                    self.rooms.remove(&(f.decode.clone(), f.start.notice.room));
                    let _ = self
                        .ledger
                        .complete(f.key, &mut self.runner.engine.pool.alloc);
                    self.ledger.prune();
                    metrics::counter!(m::TRANSFERS, "side" => "prefill", "outcome" => "completed")
                        .increment(1);
                }
            }
            Cmd::Drained { seq } => {
                if let Some(f) = self.flights.remove(&seq) {
                    self.rooms.remove(&(f.decode.clone(), f.start.notice.room));
                    let _ = self
                        .ledger
                        .drained(f.key, &mut self.runner.engine.pool.alloc);
                    self.ledger.prune();
                }
            }
            Cmd::SendFailed { seq, error } => {
                self.abort_flight(
                    seq,
                    AbortReason::ConsumerFailure,
                    Some((error, FailureClass::Attempt)),
                );
            }
            // Every flight may have had jobs in the lost queue: each drains through the new
            // thread (its fence covers what that thread wrote; the old one is joined).
            Cmd::SenderRestarted => self.fail_all_as(
                "prefill transfer: the KV sender restarted".into(),
                FailureClass::Restart,
            ),
            Cmd::Shutdown => {}
        }
    }

    /// Stops computing a flight and has the sender drain it (then acknowledge, or report the
    /// failure, to decode).
    fn abort_flight(
        &mut self,
        seq: u64,
        reason: AbortReason,
        failed: Option<(String, FailureClass)>,
    ) {
        let now = self.epoch.elapsed().as_millis() as u64;
        let Some(f) = self.flights.get_mut(&seq) else {
            return;
        };
        if f.aborted {
            // Asked again (a drain fence, or the sender restarted and its queue was lost):
            // drain again; a second acknowledgement is ignored by decode.
            let to = Self::target(f);
            let _ = self.jobs.send(self.worker, Job::Drain { seq, to, failed });
            return;
        }
        f.aborted = true;
        let key = f.key;
        let to = Self::target(f);
        let _ = self.runner.abort(seq);
        let _ = self
            .ledger
            .abort(key, reason, now, &mut self.runner.engine.pool.alloc);
        metrics::counter!(m::TRANSFERS, "side" => "prefill", "outcome" => "aborted").increment(1);
        metrics::counter!(m::TRANSFER_ABORTS, "side" => "prefill", "reason" => reason.name())
            .increment(1);
        let _ = self.jobs.send(self.worker, Job::Drain { seq, to, failed });
    }

    fn step(&mut self) {
        let ps = self.runner.engine.options().page_size;
        let plan = match self
            .runner
            .scheduler
            .plan(&mut self.runner.engine.pool.alloc, &mut self.runner.cache)
        {
            Ok(p) => p,
            Err(e) => return self.fail_all(format!("prefill plan: {e}")),
        };
        if plan.items.is_empty() {
            return;
        }
        let started = Instant::now();
        let mut chunk_spans = Vec::with_capacity(plan.items.len());
        for it in &plan.items {
            if let Some(f) = self.flights.get_mut(&it.seq) {
                if f.first_chunk.is_none() {
                    f.first_chunk = Some(started);
                    f.queue_wait = None;
                    metrics::histogram!(m::PREFILL_QUEUE_WAIT)
                        .record(started.duration_since(f.matched).as_secs_f64());
                }
                chunk_spans.push(tracing::info_span!(
                    parent: &f.span,
                    "chunk",
                    tokens = it.len,
                    start = it.start,
                    last = it.sample,
                ));
            }
        }
        // The last chunk of a prompt streams layer by layer during its own compute, so what is
        // left once it ends is one layer's copy and the fence. Its pages are pinned first.
        let mut finals: Vec<(u64, Target, Arc<Vec<PageRun>>, usize)> = Vec::new();
        for it in plan.items.iter().filter(|it| it.sample) {
            let upto = (it.start + it.len).div_ceil(ps);
            if let Some((to, runs, pages_so_far)) = self.claim_pages(it.seq, upto) {
                finals.push((it.seq, to, Arc::new(runs), pages_so_far));
            }
        }
        let logits = {
            let chunks = self.runner.scheduler.chunks(&plan);
            let (jobs, worker) = (self.jobs.clone(), self.worker);
            let mut kv_done = |layer: usize| {
                for (seq, to, runs, pages_so_far) in &finals {
                    let _ = jobs.send(
                        worker,
                        Job::Layer {
                            seq: *seq,
                            to: to.clone(),
                            runs: runs.clone(),
                            layer,
                            pages_so_far: *pages_so_far,
                        },
                    );
                }
            };
            self.runner.engine.step_observed(&chunks, &mut kv_done)
        };
        let logits = match logits {
            Ok(l) => l,
            Err(e) => return self.fail_all(format!("prefill step: {e}")),
        };
        let compute_end = Instant::now();
        drop(chunk_spans);
        self.holding.lock().unwrap_or_else(|p| p.into_inner()).steps += 1;
        metrics::counter!(m::PREFILL_CHUNKS).increment(plan.items.len() as u64);
        // Ship the pages this step filled, before commit may end the sequence (the pins keep
        // them from reuse until the sender has read them).
        for it in plan.items.iter().filter(|it| !it.sample) {
            // Only full pages: the partial last one is rewritten by the next chunk.
            let upto = (it.start + it.len) / ps;
            if let Some((to, runs, pages_so_far)) = self.claim_pages(it.seq, upto) {
                let _ = self.jobs.send(
                    self.worker,
                    Job::Write {
                        seq: it.seq,
                        to,
                        runs,
                        pages_so_far,
                    },
                );
            }
        }
        let tok = &self.runner.engine.model.tokenizer;
        let events = match self.runner.scheduler.commit(
            &plan,
            &logits,
            tok,
            &mut self.runner.engine.pool.alloc,
            &mut self.runner.cache,
        ) {
            Ok(e) => e,
            Err(e) => return self.fail_all(format!("prefill commit: {e}")),
        };
        for ev in events {
            let (Some(sampler), Some(f)) = (ev.handoff, self.flights.get(&ev.seq)) else {
                continue;
            };
            if let Some(first) = f.first_chunk {
                metrics::histogram!(m::PREFILL_SECONDS)
                    .record(compute_end.duration_since(first).as_secs_f64());
            }
            let done = TransferDone {
                room: f.start.notice.room,
                attempt: f.start.notice.attempt,
                token: ev.token,
                logprob: ev.logprob,
                sampler,
                bytes: 0,
                prefill_cached: ev.cached_tokens,
                checksums: Vec::new(),
            };
            let _ = self.jobs.send(
                self.worker,
                Job::Finish {
                    seq: ev.seq,
                    to: Self::target(f),
                    done,
                    compute_end,
                },
            );
        }
    }

    /// The next pages of `seq` up to page index `upto`, pinned at the source and paired with
    /// decode's pages: where they go, as runs, and how many of decode's pages they fill then.
    /// `None` when there is nothing new to send (or the flight was aborted).
    fn claim_pages(&mut self, seq: u64, upto: usize) -> Option<(Target, Vec<PageRun>, usize)> {
        let f = self.flights.get_mut(&seq)?;
        let pages = self.runner.scheduler.pages(seq)?;
        if f.aborted || upto <= f.next_page || pages.len() < upto {
            return None;
        }
        let src: Vec<PageId> = pages[f.next_page..upto].to_vec();
        let dst = &f.start.notice.pages[f.next_page - f.skip..upto - f.skip];
        let runs = coalesce(src.iter().copied().zip(dst.iter().copied()));
        if let Err(e) = self
            .ledger
            .extend(f.key, &src, &mut self.runner.engine.pool.alloc)
        {
            tracing::error!(error = %e, "cannot pin source pages");
            return None;
        }
        f.next_page = upto;
        Some((Self::target(f), runs, upto - f.skip))
    }

    fn fail_all(&mut self, error: String) {
        self.fail_all_as(error, FailureClass::Attempt);
    }

    fn fail_all_as(&mut self, error: String, class: FailureClass) {
        tracing::error!(%error, "prefill failed");
        let seqs: Vec<u64> = self.flights.keys().copied().collect();
        for seq in seqs {
            self.abort_flight(
                seq,
                AbortReason::ProducerFailure,
                Some((error.clone(), class)),
            );
        }
    }

    fn publish_load(&self) {
        let runner = &self.runner;
        let stats = runner.engine.pool.alloc.stats();
        let (waiting, running) = runner.scheduler.queue_lengths();
        let mut l = self.load.lock().unwrap_or_else(|p| p.into_inner());
        l.queued_tokens = runner.scheduler.queued_tokens();
        l.waiting = waiting;
        l.running = running;
        l.in_flight = self.flights.len() + waiting + running;
        l.free_pages = stats.free;
        l.pinned_pages = stats.pinned;
        l.cached_pages = runner.cache.evictable(&runner.engine.pool.alloc);
        l.quarantined_pages = self.ledger.quarantined_pages();
        metrics::gauge!(m::KV_PAGES_KEPT).set(runner.cache.kept() as f64);
        metrics::counter!(m::MIGRATION_KEEPS_BROKEN).absolute(runner.cache.keeps_broken);
        drop(l);
        let mut h = self.holding.lock().unwrap_or_else(|p| p.into_inner());
        h.by_decode.clear();
        for f in self.flights.values().filter(|f| !f.aborted) {
            h.by_decode
                .entry(f.decode.clone())
                .or_default()
                .push(f.start.notice.attempt);
        }
    }
}

/// The sending half: runs jobs in order over one transport per decode worker incarnation.
/// What a sender thread is built from (set by each worker incarnation).
#[derive(Clone)]
struct SenderParts {
    memory: PoolMemory,
    layout: duet_gpu::KvLayout,
    outbox: Outbox,
    done: std_mpsc::Sender<Cmd>,
    checksum: bool,
    /// The worker incarnation.
    id: u64,
    node: String,
}

/// The hand-off between a prefill worker and its KV sender actor (`NODE/prefill/sender`, a
/// sibling under the prefill supervisor, so `duet kill` reaches it). The worker sets what a
/// sender thread needs and starts one; a restarted sender actor replaces the thread. A
/// replacement stops and joins the old thread first (once joined, nothing of it can write),
/// under one lock so two replacements never overlap. Jobs carry the worker incarnation that
/// queued them and are delivered only to a thread built for that incarnation: a dying worker's
/// core can never have a successor's thread write for it. After a sender restart the worker
/// aborts every flight, each draining through the new thread.
#[derive(Default)]
pub struct SenderHub {
    inner: Mutex<HubInner>,
    /// Sender actor starts so far (the first one finds the worker's thread running).
    actor_starts: std::sync::atomic::AtomicU64,
}

#[derive(Default)]
struct HubInner {
    parts: Option<SenderParts>,
    jobs: Option<std_mpsc::Sender<Job>>,
    thread: Option<(
        Arc<std::sync::atomic::AtomicBool>,
        std::thread::JoinHandle<()>,
    )>,
}

impl SenderHub {
    fn lock(&self) -> std::sync::MutexGuard<'_, HubInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a job of worker incarnation `worker` for the sender thread; false when no
    /// thread of that incarnation runs (its flights are aborted when the next one starts).
    fn send(&self, worker: u64, job: Job) -> bool {
        let inner = self.lock();
        inner.parts.as_ref().is_some_and(|p| p.id == worker)
            && inner.jobs.as_ref().is_some_and(|tx| tx.send(job).is_ok())
    }

    /// Worker incarnation `worker` is gone: its thread stops after its current job (not
    /// waited for; the next replacement joins it) and nothing is built from its parts again.
    fn retire(&self, worker: u64) {
        let mut inner = self.lock();
        if inner.parts.as_ref().is_some_and(|p| p.id == worker) {
            inner.parts = None;
        }
        inner.jobs = None;
        if let Some((stop, _)) = inner.thread.as_ref() {
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// Stops and joins the sender thread, then starts a new one from `parts` (or from the
    /// current parts when `None`; none when there are none). Blocking.
    fn replace_thread(&self, parts: Option<SenderParts>) -> std::io::Result<()> {
        let mut inner = self.lock();
        inner.jobs = None;
        if let Some((stop, handle)) = inner.thread.take() {
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
            let _ = handle.join();
        }
        if parts.is_some() {
            inner.parts = parts;
        }
        let Some(p) = inner.parts.clone() else {
            return Ok(());
        };
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (tx, rx) = std_mpsc::channel();
        let env = |k: &str| std::env::var(k).ok();
        let sender = KvSender {
            memory: p.memory,
            layout: p.layout,
            outbox: p.outbox,
            done: p.done,
            stop: stop.clone(),
            links: HashMap::new(),
            progress: HashMap::new(),
            layer_spans: HashMap::new(),
            checksum: p.checksum,
            corrupt: env("DUET_FAULT_CORRUPT_KV")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            fail_rate: env("DUET_FAULT_TRANSFER_FAIL_RATE")
                .and_then(|v| v.parse::<f64>().ok())
                .filter(|p| (0.0..=1.0).contains(p))
                .unwrap_or(0.0),
            id: p.id,
            stall_once: env("DUET_FAULT_STALL_TRANSFER_MS")
                .and_then(|v| v.parse().ok())
                .map(Duration::from_millis),
            stall_mid_write: env("DUET_FAULT_STALL_MID_WRITE_MS")
                .and_then(|v| v.parse().ok())
                .map(Duration::from_millis),
        };
        let handle = std::thread::Builder::new()
            .name(format!("duet-kv-sender-{}", p.node))
            .spawn(move || sender.run(rx))?;
        inner.jobs = Some(tx);
        inner.thread = Some((stop, handle));
        Ok(())
    }
}

/// The KV sender as a supervised actor (`NODE/prefill/sender`): killing it stops the sender
/// thread after its current write; its successor starts a new one and has the worker fail the
/// rooms the old one held (their pages stay pinned until they drain through the new thread).
impl HandOff for SenderHub {
    const WHAT: &'static str = "KV sender";

    fn actor_starts(&self) -> &std::sync::atomic::AtomicU64 {
        &self.actor_starts
    }

    fn halt(&self) {
        let mut inner = self.lock();
        inner.jobs = None;
        if let Some((stop, _)) = inner.thread.as_ref() {
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    fn replace(&self) -> Result<(), String> {
        self.replace_thread(None).map_err(|e| e.to_string())?;
        if let Some(p) = self.lock().parts.as_ref() {
            let _ = p.done.send(Cmd::SenderRestarted);
        }
        Ok(())
    }
}

struct KvSender {
    memory: PoolMemory,
    layout: duet_gpu::KvLayout,
    outbox: Outbox,
    done: std_mpsc::Sender<Cmd>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    links: HashMap<LinkKey, Box<dyn KvTransport>>,
    /// Per attempt: bytes written, seconds spent writing, or the error that ended it.
    progress: HashMap<u64, Progress>,
    /// The span of a last chunk being written layer by layer, and its bytes so far.
    layer_spans: HashMap<u64, (tracing::Span, u64)>,
    /// Whether each written run gets a checksum for decode to check.
    checksum: bool,
    /// Fault injection (`DUET_FAULT_CORRUPT_KV=N`): corrupt one byte of the first run of the
    /// next N transfers after writing it, to prove decode's check catches it.
    corrupt: u32,
    /// Fault injection (`DUET_FAULT_TRANSFER_FAIL_RATE=P`): each run of pages fails with
    /// probability P after its bytes were written (a transport that broke mid-transfer).
    fail_rate: f64,
    /// The worker incarnation this sender belongs to (for the transfer history).
    id: u64,
    /// Fault injection (`DUET_FAULT_STALL_TRANSFER_MS=N`): the sender's first write waits N
    /// ms first, a partition of the transfer path that outlasts decode's waiting deadline.
    stall_once: Option<Duration>,
    /// Fault injection (`DUET_FAULT_STALL_MID_WRITE_MS=N`): the sender's first write stops
    /// for N ms halfway through its first copy, holding its claim (for TCP: a frame half
    /// sent), as a writer paused mid-copy would.
    stall_mid_write: Option<Duration>,
}

#[derive(Default)]
struct Progress {
    bytes: u64,
    secs: f64,
    error: Option<String>,
    checksums: Vec<RunChecksum>,
}

impl KvSender {
    fn run(mut self, jobs: std_mpsc::Receiver<Job>) {
        let id = self.id;
        self.run_jobs(jobs);
        // Its transports close with it: no write of this sender can land from here on.
        drop(self);
        history::record_with(
            "sender_stopped",
            "",
            0,
            0,
            &[],
            serde_json::json!({ "sender": format!("{id:016x}") }),
        );
    }

    /// Records a transfer-history event of this sender about `to`'s attempt.
    fn record(&self, event: &str, to: &Target, pages: &[PageId]) {
        record_write(self.id, event, to, pages);
    }

    fn run_jobs(&mut self, jobs: std_mpsc::Receiver<Job>) {
        while let Ok(job) = jobs.recv() {
            if self.stop.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            match job {
                Job::Write {
                    seq,
                    to,
                    runs,
                    pages_so_far,
                } => {
                    if self.progress_of(to.attempt).error.is_some() {
                        continue;
                    }
                    let span = tracing::info_span!(
                        parent: &to.span,
                        "kv_write",
                        backend = to.backend.name(),
                        pages = runs.iter().map(|r| r.n as usize).sum::<usize>(),
                        bytes = tracing::field::Empty,
                    );
                    let t = Instant::now();
                    match self.write(&to, &runs, None) {
                        Ok(n) => {
                            span.record("bytes", n);
                            if let Err(error) = self.after_write(&to, &runs) {
                                self.failed(seq, to.attempt, error);
                                continue;
                            }
                            let bytes = self.account(&to, n, t);
                            self.chunk_written(&to, pages_so_far, bytes);
                        }
                        Err(error) => self.failed(seq, to.attempt, error),
                    }
                }
                Job::Layer {
                    seq,
                    to,
                    runs,
                    layer,
                    pages_so_far,
                } => {
                    if self.progress_of(to.attempt).error.is_some() {
                        continue;
                    }
                    if layer == 0 {
                        let span = tracing::info_span!(
                            parent: &to.span,
                            "kv_write",
                            backend = to.backend.name(),
                            pages = runs.iter().map(|r| r.n as usize).sum::<usize>(),
                            layer_by_layer = true,
                            bytes = tracing::field::Empty,
                        );
                        self.layer_spans.insert(to.attempt, (span, 0));
                    }
                    let t = Instant::now();
                    match self.write(&to, &runs, Some(layer)) {
                        Ok(n) => {
                            let bytes = self.account(&to, n, t);
                            if let Some((_, b)) = self.layer_spans.get_mut(&to.attempt) {
                                *b += n;
                            }
                            if layer + 1 == self.layout.n_layers {
                                if let Some((span, b)) = self.layer_spans.remove(&to.attempt) {
                                    span.record("bytes", b);
                                }
                                if let Err(error) = self.after_write(&to, &runs) {
                                    self.failed(seq, to.attempt, error);
                                    continue;
                                }
                                self.chunk_written(&to, pages_so_far, bytes);
                            }
                        }
                        Err(error) => self.failed(seq, to.attempt, error),
                    }
                }
                Job::Finish {
                    seq,
                    to,
                    mut done,
                    compute_end,
                } => {
                    if self.progress_of(to.attempt).error.is_some() {
                        continue; // the engine aborts it and a Drain follows
                    }
                    let fence_span = tracing::info_span!(parent: &to.span, "fence");
                    let fence_start = Instant::now();
                    if let Err(error) = fence_span.in_scope(|| self.fence(&to)) {
                        self.failed(seq, to.attempt, error);
                        continue;
                    }
                    let exposed = compute_end.elapsed().as_secs_f64();
                    let mut p = self.progress.remove(&to.attempt).unwrap_or_default();
                    p.secs += fence_start.elapsed().as_secs_f64();
                    metrics::histogram!(m::TRANSFER_EXPOSED).record(exposed);
                    metrics::histogram!(m::TRANSFER_WRITE).record(p.secs);
                    if p.secs > 0.0 {
                        metrics::histogram!(m::TRANSFER_GBPS).record(p.bytes as f64 / p.secs / 1e9);
                    }
                    done.bytes = p.bytes;
                    done.checksums = p.checksums;
                    drop(fence_span);
                    tracing::info!(
                        parent: &to.span,
                        bytes = p.bytes,
                        exposed_ms = exposed * 1e3,
                        "transfer done"
                    );
                    self.outbox
                        .send(&to.node, WORKER_SERVICE, kinds::DONE, &done);
                    let _ = self.done.send(Cmd::Sent { seq });
                }
                Job::Drain { seq, to, failed } => {
                    let _drain = tracing::info_span!(parent: &to.span, "drain").entered();
                    self.layer_spans.remove(&to.attempt);
                    let broken = self.progress_of(to.attempt).error.is_some();
                    // A broken connection was dropped: nothing of it can land any more. Else
                    // the fence proves every earlier write landed.
                    let fenced = broken || self.fence(&to).is_ok();
                    if !fenced {
                        self.drop_link(&to);
                    }
                    self.progress.remove(&to.attempt);
                    match failed {
                        Some((error, class)) => self.outbox.send(
                            &to.node,
                            WORKER_SERVICE,
                            kinds::FAILED,
                            &TransferFailed {
                                room: to.room,
                                attempt: Some(to.attempt),
                                error: format!("prefill transfer: {error}"),
                                class,
                            },
                        ),
                        None => self.outbox.send(
                            &to.node,
                            WORKER_SERVICE,
                            kinds::ABORT_ACK,
                            &AbortAck {
                                room: to.room,
                                attempt: to.attempt,
                            },
                        ),
                    };
                    let _ = self.done.send(Cmd::Drained { seq });
                }
            }
        }
    }

    /// Marks an attempt failed (its later jobs are skipped) and tells the engine thread.
    fn failed(&mut self, seq: u64, attempt: u64, error: String) {
        self.progress_of(attempt).error = Some(error.clone());
        let _ = self.done.send(Cmd::SendFailed { seq, error });
    }

    /// Counts `n` bytes written since `started`; returns the attempt's bytes so far.
    fn account(&mut self, to: &Target, n: u64, started: Instant) -> u64 {
        metrics::counter!(m::KV_BYTES_SENT, "backend" => to.backend.name()).increment(n);
        let p = self.progress_of(to.attempt);
        p.bytes += n;
        p.secs += started.elapsed().as_secs_f64();
        p.bytes
    }

    /// Tells decode how far the transfer is.
    fn chunk_written(&self, to: &Target, pages: usize, bytes: u64) {
        self.outbox.send(
            &to.node,
            WORKER_SERVICE,
            kinds::CHUNK,
            &ChunkWritten {
                room: to.room,
                attempt: to.attempt,
                pages,
                bytes,
            },
        );
    }

    /// Once a run's pages are all written: its checksum, and the fault injection if asked.
    fn after_write(&mut self, to: &Target, runs: &[PageRun]) -> Result<(), String> {
        let src: Vec<PageId> = runs.iter().flat_map(|r| r.src..r.src + r.n).collect();
        let dst: Vec<PageId> = runs.iter().flat_map(|r| r.dst..r.dst + r.n).collect();
        if self.checksum {
            let crc = duet_transport::pages_crc(&self.memory, &self.layout, &src)
                .map_err(|e| e.to_string())?;
            self.progress_of(to.attempt).checksums.push(RunChecksum {
                pages: dst.clone(),
                crc,
            });
        }
        if self.corrupt > 0
            && let (Some(&s), Some(&d)) = (src.first(), dst.first())
        {
            self.corrupt -= 1;
            let at = self.layout.run_bytes(s, 1).start;
            // SAFETY: the page is pinned at the source (a queued write holds it).
            #[allow(unsafe_code)]
            let byte = unsafe { self.memory.slice(at, 1) }.map_err(|e| e.to_string())?[0];
            let dst_at = self.layout.run_bytes(d, 1).start;
            tracing::warn!(
                attempt = to.attempt,
                page = d,
                "fault injection: corrupting a KV byte"
            );
            self.link(to)?
                .inject(to.grant, dst_at, &[byte ^ 0xFF])
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    fn progress_of(&mut self, attempt: u64) -> &mut Progress {
        self.progress.entry(attempt).or_default()
    }

    fn link(&mut self, to: &Target) -> Result<&mut Box<dyn KvTransport>, String> {
        let key = LinkKey::of(to);
        if !self.links.contains_key(&key) {
            // A decode worker that restarted has a new pool, and a restarted KV receiver a
            // new address: forget links to older ones.
            self.links.retain(|k, _| k.node != to.node);
            let t = duet_transport::connect(&to.endpoint, to.backend)
                .map_err(|e| format!("connecting to {} by {}: {e}", to.node, to.backend.name()))?;
            self.links.insert(key.clone(), t);
        }
        self.links
            .get_mut(&key)
            .ok_or_else(|| "no transport".to_string())
    }

    /// Writes whole pages of `runs`, or one layer of them; a failed transport is dropped.
    fn write(
        &mut self,
        to: &Target,
        runs: &[PageRun],
        layer: Option<usize>,
    ) -> Result<u64, String> {
        let (memory, layout) = (self.memory.clone(), self.layout);
        if let Some(stall) = self.stall_once.take() {
            tracing::warn!(
                ?stall,
                attempt = to.attempt,
                "fault injection: the transfer path stalls"
            );
            std::thread::sleep(stall);
        }
        let (id, mid_stall) = (self.id, self.stall_mid_write.take());
        let dst: Vec<PageId> = if history::enabled() {
            runs.iter().flat_map(|r| r.dst..r.dst + r.n).collect()
        } else {
            Vec::new()
        };
        // The history marks a write begun once its grant held (a refused claim wrote nothing)
        // and ended before its claim is let go, so the checker can order it against decode's
        // release.
        let mut watch = |stage: WriteStage| match stage {
            WriteStage::Started => record_write(id, "write_begin", to, &dst),
            WriteStage::Midway => {
                if let Some(stall) = mid_stall {
                    tracing::warn!(
                        ?stall,
                        attempt = to.attempt,
                        "fault injection: the writer stops mid-copy"
                    );
                    std::thread::sleep(stall);
                }
            }
            WriteStage::Copied => record_write(id, "write_end", to, &[]),
        };
        let link = self.link(to)?;
        let written = match layer {
            None => link.write(to.grant, &memory, &layout, runs, &mut watch),
            Some(l) => link.write_layer(to.grant, &memory, &layout, runs, l, &mut watch),
        };
        if let Err(TransportError::Claim(e @ ClaimError::Revoked { .. })) = &written {
            // Decode took the grant back (it aborted the attempt): nothing was written and
            // the transport is fine for other attempts.
            metrics::counter!(m::KV_WRITES_REFUSED, "backend" => to.backend.name()).increment(1);
            tracing::warn!(attempt = to.attempt, node = %to.node, "decode refused a write: it had revoked the grant");
            return Err(format!("decode stopped the transfer: {e}"));
        }
        let mut result = written.map_err(|e| e.to_string());
        // Once per run: a layer-by-layer run draws at its first layer only.
        if self.fail_rate > 0.0
            && result.is_ok()
            && layer.is_none_or(|l| l == 0)
            && rand::random::<f64>() < self.fail_rate
        {
            tracing::warn!(
                attempt = to.attempt,
                "fault injection: a run of pages failed"
            );
            result = Err("fault injection: the transport failed mid-run".to_string());
        }
        if result.is_err() {
            self.drop_link(to);
        }
        result
    }

    fn fence(&mut self, to: &Target) -> Result<(), String> {
        let result = self.link(to)?.fence(to.attempt).map_err(|e| e.to_string());
        if result.is_err() {
            self.drop_link(to);
        } else {
            self.record("fenced", to, &[]);
        }
        result
    }

    /// Tears down the transport to `to`'s decode worker: nothing sent on it lands later.
    fn drop_link(&mut self, to: &Target) {
        self.links.remove(&LinkKey::of(to));
        self.record("dropped", to, &[]);
    }
}

/// Records a transfer-history event of sender `id` about `to`'s attempt.
fn record_write(id: u64, event: &str, to: &Target, pages: &[PageId]) {
    if history::enabled() {
        history::record_with(
            event,
            &to.node,
            to.incarnation,
            to.attempt,
            pages,
            serde_json::json!({
                "sender": format!("{id:016x}"),
                "backend": to.backend.name(),
                // Which receiver a TCP write goes to (decode records when it stops one).
                "via": (to.backend == Backend::Tcp)
                    .then(|| to.endpoint.tcp.map(|(addr, _)| addr.to_string()))
                    .flatten(),
            }),
        );
    }
}
