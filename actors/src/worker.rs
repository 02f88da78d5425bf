//! The colocated worker: one engine on its node, driven by the colocated scheduler.
//!
//! The engine computes on a thread of its own (a step is milliseconds of CPU, never run on the
//! async runtime). The actor is its front: it takes `worker.generate` and `worker.cancel` from
//! routers over the links and hands them to the engine thread; a forwarder task sends each
//! step's tokens back to the router that asked, batched per step; a reporter task sends the
//! load to every router. If the actor dies, its state's `Drop` stops the engine thread and the
//! tasks; the supervisor starts a new worker with a new incarnation, and routers fail (or
//! retry) what the old one held.

use std::collections::HashMap;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};

use duet_engine::{Engine, EngineOptions, Model, Runner, fetch};
use duet_runtime::config::Role;
use duet_runtime::context::NodeContext;
use duet_runtime::metrics as m;
use duet_runtime::services::Inbound;
use duet_runtime::wire;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use rand::Rng;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::protocol::{
    Accepted, Cancel, Generate, LoadReport, ROUTER_SERVICE, TokenBatch, TokenItem, WORKER_SERVICE,
    kinds,
};
use crate::settings::ServingConfig;

/// The worker actor.
pub struct WorkerActor;

/// Remote messages only.
#[derive(Debug)]
pub struct WorkerMsg(Inbound);

duet_runtime::inbound_message!(struct WorkerMsg);

enum EngineCmd {
    Submit { router: String, generate: Generate },
    Cancel { router: String, request: u64 },
    Shutdown,
}

/// The running worker. Dropping it (stop, kill or crash) stops the engine thread and tasks.
pub struct WorkerState {
    ctx: Arc<NodeContext>,
    incarnation: u64,
    cmds: std_mpsc::Sender<EngineCmd>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for WorkerState {
    fn drop(&mut self) {
        let _ = self.cmds.send(EngineCmd::Shutdown);
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Actor for WorkerActor {
    type Msg = WorkerMsg;
    type State = WorkerState;
    type Arguments = Arc<NodeContext>;

    async fn pre_start(
        &self,
        myself: ActorRef<WorkerMsg>,
        ctx: Arc<NodeContext>,
    ) -> Result<WorkerState, ActorProcessingErr> {
        let settings = ServingConfig::from_cluster(&ctx.config)?;
        let runner = {
            let s = settings.clone();
            tokio::task::spawn_blocking(move || load_runner(&s)).await??
        };
        let incarnation: u64 = rand::rng().random();
        let node = ctx.me.name.clone();
        let load = Arc::new(Mutex::new(LoadReport {
            worker: node.clone(),
            incarnation,
            queued_tokens: 0,
            waiting: 0,
            running: 0,
            free_pages: runner.engine.pool.alloc.free_pages(),
            total_pages: runner.engine.pool.capacity(),
            pinned_pages: 0,
            cached_pages: 0,
        }));
        let (cmd_tx, cmd_rx) = std_mpsc::channel();
        let (out_tx, out_rx) = mpsc::unbounded_channel();
        {
            let load = load.clone();
            std::thread::Builder::new()
                .name(format!("duet-engine-{node}"))
                .spawn(move || engine_loop(runner, cmd_rx, out_tx, load))?;
        }
        let forwarder = tokio::spawn(forward_tokens(ctx.clone(), incarnation, out_rx));
        let reporter = tokio::spawn(report_load(ctx.clone(), settings.load_interval, load));
        ctx.services.register(WORKER_SERVICE, myself);
        tracing::info!(%node, incarnation, model = %settings.model.display(), "worker ready");
        Ok(WorkerState {
            ctx,
            incarnation,
            cmds: cmd_tx,
            tasks: vec![forwarder, reporter],
        })
    }

    async fn post_stop(
        &self,
        myself: ActorRef<WorkerMsg>,
        state: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        state
            .ctx
            .services
            .unregister(WORKER_SERVICE, myself.get_id());
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<WorkerMsg>,
        WorkerMsg(inbound): WorkerMsg,
        state: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        let Inbound { envelope, reply } = inbound;
        let router = envelope.sender_node().to_string();
        match (envelope.kind.as_str(), reply) {
            (kinds::GENERATE, Some(reply)) => match wire::decode_body::<Generate>(&envelope.body) {
                Ok(generate) => {
                    if state
                        .cmds
                        .send(EngineCmd::Submit { router, generate })
                        .is_err()
                    {
                        reply.fail("worker: the engine has stopped");
                    } else {
                        reply.ok(wire::encode_body(&Accepted {
                            incarnation: state.incarnation,
                        }));
                    }
                }
                Err(e) => reply.fail(format!("worker: malformed generate: {e}")),
            },
            (kinds::CANCEL, None) => {
                if let Ok(c) = wire::decode_body::<Cancel>(&envelope.body) {
                    let _ = state.cmds.send(EngineCmd::Cancel {
                        router,
                        request: c.request,
                    });
                }
            }
            (other, Some(reply)) => reply.fail(format!("worker does not handle `{other}`")),
            (other, None) => tracing::warn!(kind = other, "worker ignored a one-way message"),
        }
        Ok(())
    }
}

/// Loads the model (fetching the default one if missing) and builds the runner.
fn load_runner(s: &ServingConfig) -> Result<Runner, String> {
    let path = if s.model.exists() || !s.model.ends_with(fetch::MODEL_FILE) {
        s.model.clone()
    } else {
        fetch::ensure_model(&s.model, &mut |_| {}).map_err(|e| e.to_string())?
    };
    let model = Model::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let max_context = model.config.context_length;
    let engine = Engine::new(
        model,
        EngineOptions {
            kv_dtype: s.kv_dtype,
            page_size: s.page_size,
            kv_pages: s.kv_pages,
            threads: s.threads,
            max_context,
        },
    )
    .map_err(|e| e.to_string())?;
    Ok(Runner::new(engine, s.max_batch_tokens, s.max_running))
}

/// The engine thread: take commands, step while there is work, hand tokens to the forwarder.
fn engine_loop(
    mut runner: Runner,
    cmds: std_mpsc::Receiver<EngineCmd>,
    out: mpsc::UnboundedSender<Vec<(String, TokenItem)>>,
    load: Arc<Mutex<LoadReport>>,
) {
    let mut next_seq = 0u64;
    // Local sequence id -> (router, router's request id), and back.
    let mut owners: HashMap<u64, (String, u64)> = HashMap::new();
    let mut seqs: HashMap<(String, u64), u64> = HashMap::new();
    loop {
        let first = if runner.scheduler.is_idle() {
            match cmds.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            }
        } else {
            None
        };
        let mut failed = Vec::new();
        for cmd in first
            .into_iter()
            .chain(std::iter::from_fn(|| cmds.try_recv().ok()))
        {
            match cmd {
                EngineCmd::Submit { router, generate } => {
                    next_seq += 1;
                    let id = next_seq;
                    match runner.submit(id, generate.prompt, generate.params) {
                        Ok(()) => {
                            owners.insert(id, (router.clone(), generate.request));
                            seqs.insert((router, generate.request), id);
                        }
                        Err(e) => failed.push((
                            router,
                            TokenItem::failed(generate.request, format!("worker admission: {e}")),
                        )),
                    }
                }
                EngineCmd::Cancel { router, request } => {
                    if let Some(id) = seqs.remove(&(router, request)) {
                        owners.remove(&id);
                        if let Err(e) = runner.abort(id) {
                            tracing::error!(error = %e, "abort left the pool inconsistent");
                        }
                    }
                }
                EngineCmd::Shutdown => return,
            }
        }
        if !failed.is_empty() && out.send(failed).is_err() {
            return;
        }
        if runner.scheduler.is_idle() {
            publish_load(&runner, &load);
            continue;
        }
        let items = match runner.step() {
            Ok(events) => events
                .into_iter()
                .filter_map(|ev| {
                    let (router, request) = owners.get(&ev.seq)?.clone();
                    if ev.finish.is_some() {
                        owners.remove(&ev.seq);
                        seqs.remove(&(router.clone(), request));
                    }
                    Some((
                        router,
                        TokenItem {
                            request,
                            token: Some(ev.token),
                            logprob: ev.logprob,
                            text: ev.text,
                            finish: ev.finish,
                            error: None,
                            cached_tokens: ev.cached_tokens,
                        },
                    ))
                })
                .collect::<Vec<_>>(),
            Err(e) => {
                // A step that cannot run fails every request the engine holds; the engine
                // itself stays up for new ones.
                tracing::error!(error = %e, "engine step failed");
                let all: Vec<_> = owners.drain().collect();
                seqs.clear();
                all.into_iter()
                    .map(|(id, (router, request))| {
                        let _ = runner.abort(id);
                        (
                            router,
                            TokenItem::failed(request, format!("worker step: {e}")),
                        )
                    })
                    .collect()
            }
        };
        publish_load(&runner, &load);
        if !items.is_empty() && out.send(items).is_err() {
            return;
        }
    }
}

fn publish_load(runner: &Runner, load: &Mutex<LoadReport>) {
    let stats = runner.engine.pool.alloc.stats();
    let (waiting, running) = runner.scheduler.queue_lengths();
    let mut l = load.lock().unwrap_or_else(|p| p.into_inner());
    l.queued_tokens = runner.scheduler.queued_tokens();
    l.waiting = waiting;
    l.running = running;
    l.free_pages = stats.free;
    l.pinned_pages = stats.pinned;
    l.cached_pages = runner.cache.evictable(&runner.engine.pool.alloc);
}

/// Sends each step's items to the routers that own them, one envelope per router per step.
async fn forward_tokens(
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
            let sent = match ctx.links.get(&router) {
                Ok(link) => {
                    link.send(
                        kinds::EVENTS,
                        WORKER_SERVICE,
                        ROUTER_SERVICE,
                        wire::encode_body(&batch),
                    )
                    .await
                }
                Err(e) => Err(e),
            };
            if let Err(e) = sent {
                // The router is gone; its requests fail there on its own deadline.
                tracing::warn!(%router, error = %e, "cannot deliver tokens");
            }
        }
    }
}

/// Tells every router this worker's load, every `interval`.
async fn report_load(
    ctx: Arc<NodeContext>,
    interval: std::time::Duration,
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
        let report = load.lock().unwrap_or_else(|p| p.into_inner()).clone();
        metrics::gauge!(m::KV_PAGES_TOTAL).set(report.total_pages as f64);
        metrics::gauge!(m::KV_PAGES_FREE).set(report.free_pages as f64);
        metrics::gauge!(m::KV_PAGES_CACHED).set(report.cached_pages as f64);
        metrics::gauge!(m::KV_PAGES_PINNED).set(report.pinned_pages as f64);
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
