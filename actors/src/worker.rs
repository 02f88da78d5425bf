//! What the prefill and decode workers share: loading the model and the layout it gives, the
//! load reports every router routes by, and the probe a draining node waits on.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use duet_engine::scheduler::StepShape;
use duet_engine::{Engine, EngineOptions, Model};
use duet_fetch as fetch;
use duet_runtime::config::Role;
use duet_runtime::context::NodeContext;
use duet_runtime::metrics as m;
use duet_runtime::wire;

use crate::protocol::{LayoutInfo, LoadReport, ROUTER_SERVICE, WORKER_SERVICE, kinds};
use crate::settings::ServingConfig;
use crate::step_clock::StepTimes;
use crate::step_log::StepLog;

/// Records one engine step of a worker in `role`: its seconds and its size (the metrics an
/// operator reads a slow inter-token gap from: more tokens, longer contexts, or neither), the
/// CPU time its thread got and how long it waited for its core, and its line in the step log.
pub(crate) fn record_step(
    role: &'static str,
    times: &StepTimes,
    shape: StepShape,
    log: &mut StepLog,
) {
    if shape.tokens == 0 {
        return;
    }
    metrics::histogram!(m::ENGINE_STEP, "role" => role).record(times.wall.as_secs_f64());
    metrics::histogram!(m::ENGINE_STEP_TOKENS, "role" => role).record(shape.tokens as f64);
    metrics::histogram!(m::ENGINE_STEP_ATTENDED, "role" => role).record(shape.attended as f64);
    if let (Some(cpu), Some(waited)) = (times.on_cpu, times.waited) {
        metrics::histogram!(m::ENGINE_STEP_CPU, "role" => role).record(cpu.as_secs_f64());
        metrics::histogram!(m::ENGINE_STEP_WAIT, "role" => role).record(waited.as_secs_f64());
    }
    log.write(times, shape);
}

/// Loads the model (fetching the default one if missing).
pub(crate) fn load_model(s: &ServingConfig) -> Result<Model, String> {
    let path = if s.model.exists() || !s.model.ends_with(fetch::MODEL_FILE) {
        s.model.clone()
    } else {
        fetch::ensure_model(&s.model, &mut |_| {}).map_err(|e| e.to_string())?
    };
    // On 4 KB pages decode at long contexts lost up to a fifth of its speed to TLB misses on
    // a Zen 4 core (docs/engine.md, "Huge pages"): say once, at start, where an operator
    // looks, what the host allows.
    let huge = duet_gpu::huge::settings();
    if !huge.anonymous {
        tracing::warn!(
            "weights on 4 KB pages: /sys/kernel/mm/transparent_hugepage/enabled is `never`"
        );
    }
    if !huge.shared {
        tracing::info!(
            "a shared-memory KV pool is on 4 KB pages: /dev/shm is mounted without \
             huge=within_size (mount -o remount,huge=within_size /dev/shm)"
        );
    }
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
        kv_format: duet_engine::KV_FORMAT,
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

/// Tells every router this worker's load, every `interval`.
pub(crate) async fn report_load(
    ctx: Arc<NodeContext>,
    interval: Duration,
    load: Arc<Mutex<LoadReport>>,
    model_name: String,
) {
    let mut tick = tokio::time::interval(interval);
    loop {
        tick.tick().await;
        // Every router, those that joined since the start included.
        let routers: Vec<String> = ctx
            .roster
            .nodes()
            .into_iter()
            .filter(|n| n.role == Role::Router && n.name != ctx.me.name)
            .map(|n| n.name)
            .collect();
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
        // The same figures under the names vLLM and SGLang users chart first.
        let model = model_name.clone();
        metrics::gauge!(m::NUM_REQUESTS_RUNNING, "model_name" => model.clone())
            .set(report.running as f64);
        metrics::gauge!(m::NUM_REQUESTS_WAITING, "model_name" => model.clone())
            .set(report.waiting.saturating_sub(report.running) as f64);
        let used = report
            .total_pages
            .saturating_sub(report.free_pages + report.cached_pages);
        metrics::gauge!(m::KV_CACHE_USAGE, "model_name" => model)
            .set(used as f64 / report.total_pages.max(1) as f64);
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
