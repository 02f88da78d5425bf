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
//!
//! Files: this one is the actor (the shell: remote messages, hellos, heartbeats, the engine
//! thread's start); `engine_thread.rs` is the thread's flights and chunked prefill steps;
//! `sender.rs` the KV sender thread and its supervised actor's hand-off.

use std::collections::HashMap;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use duet_engine::{Engine, Runner};
use duet_gpu::{Devices, WorkerContext};
use duet_runtime::config::Role;
use duet_runtime::context::NodeContext;
use duet_runtime::services::Inbound;
use duet_runtime::wire;
use duet_transport::{Side, TransferLedger};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use rand::Rng;
use tokio::task::JoinHandle;

use crate::outbox;
use crate::protocol::{
    Abort, Heartbeat, LayoutHello, LayoutInfo, LoadReport, PREFILL_SERVICE, PrefillStart,
    WORKER_SERVICE, WorkerKind, kinds,
};
use crate::settings::ServingConfig;
use crate::worker::{engine_options, install_drain_probe, layout_info, load_model, report_load};

mod engine_thread;
mod hub;
mod sender;

use engine_thread::PrefillCore;
pub use hub::SenderHub;
use hub::SenderParts;

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
    /// The compute context this incarnation owns: opened in pre_start, drained and dropped in
    /// post_stop, so a restart really rebuilds it (gpu::context).
    device: WorkerContext,
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
        // The worker owns its device for this incarnation (checked at node start too).
        let device = settings.open_device(&ctx.config)?;
        settings.open_kv_transport(&ctx.config)?;
        let device = WorkerContext::open(&Devices, device)?;
        *ctx.device.lock().unwrap_or_else(|p| p.into_inner()) = Some(device.device().to_string());
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
                sends: Vec::new(),
                load: load.clone(),
                holding: holding.clone(),
                flights: HashMap::new(),
                rooms: HashMap::new(),
                next_seq: 0,
                epoch: Instant::now(),
                now: Instant::now(),
                stop: stop.clone(),
                step_log: crate::step_log::StepLog::open(settings.step_log.as_deref(), &node),
            };
            std::thread::Builder::new()
                .name(format!("duet-prefill-{node}"))
                .spawn(move || core.run(cmd_rx))?;
        }
        install_drain_probe(&ctx, "prefill worker", &load, settings.shutdown_drain);
        let reporter = tokio::spawn(report_load(
            ctx.clone(),
            settings.load_interval,
            load,
            settings.model_name.clone(),
        ));
        let heartbeat = tokio::spawn(heartbeats(
            ctx.clone(),
            settings.load_interval,
            incarnation,
            holding,
        ));
        ctx.services.register(PREFILL_SERVICE, myself);
        tracing::info!(%node, incarnation, "prefill worker ready");
        Ok(PrefillState {
            device,
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
        *state.ctx.device.lock().unwrap_or_else(|p| p.into_inner()) = None;
        // Last: nothing of this incarnation computes in the context once it is closed.
        if let Err(e) = state.device.close() {
            tracing::warn!(error = %e, "the worker's device context did not drain before it was dropped");
        }
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
    let mut tick = tokio::time::interval(interval);
    loop {
        tick.tick().await;
        // Every decode node, those that joined since the start included.
        let decoders: Vec<String> = ctx
            .roster
            .nodes()
            .into_iter()
            .filter(|n| n.role == Role::Decode)
            .map(|n| n.name)
            .collect();
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
