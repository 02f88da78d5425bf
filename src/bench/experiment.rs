//! The experiments of `duet bench`.
//!
//! **Interference** (the reference chapter's claim): colocated chunked prefill makes every
//! running sequence's inter-token latency jump while a long prompt is prefilled;
//! disaggregation removes the jump. One invocation runs the same workload against two clusters
//! it starts and stops itself:
//!
//! - `colocated`: router + one decode worker computing with both cores (chunked prefill);
//! - `disaggregated`: router + a prefill worker pinned to core 0 + a decode worker pinned to
//!   core 1 (`taskset`), long prompts paired, short ones on decode alone.
//!
//! The workload: B steady sequences decoding for the whole run (short prompts, outputs long
//! enough to outlast it; cut at the end, and replaced if one ends early), plus a long prompt
//! arriving every `period`. ITL is measured on the steady sequences, TTFT on the long prompts.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_json::json;

use super::clusters::{Cluster, DecodeSteps, Mode, PrefillSteps, RouterItl, pinned};
use super::host::CpuTimes;
use super::phases::{ItlByPhase, Phase};
use super::stats::{self, RequestRecord};
use super::steps::StepSplit;
use super::{Ask, BenchArgs, client, plots, prompt, write_json};

/// The workload and cluster shape of one interference run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Params {
    /// The GGUF served.
    pub model: String,
    /// Steady decoding sequences.
    pub steady: usize,
    /// Their prompt tokens.
    pub steady_prompt: usize,
    /// Their output tokens (then a new one starts).
    pub steady_output: usize,
    /// Long prompt tokens.
    pub long_prompt: usize,
    /// Long prompts' output tokens.
    pub long_output: usize,
    /// Seconds between long prompts.
    pub period_s: f64,
    /// Seconds of load per mode.
    pub duration_s: f64,
    /// Tokens per engine step (the prefill chunk).
    pub max_batch_tokens: usize,
    /// Cores on this machine.
    pub cores: usize,
    /// Seed of the prompts.
    pub seed: u64,
    /// `serving.kv_transport` of both clusters (only the disaggregated one transfers).
    pub kv_transport: String,
}

/// What one mode measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ModeResult {
    /// ITL of the steady sequences, p50, ms.
    pub itl_p50_ms: f64,
    /// ITL of the steady sequences, p99, ms.
    pub itl_p99_ms: f64,
    /// ITL of the steady sequences, p99.9, ms. A colocated run's prefill stalls are a few
    /// dozen gaps of thousands (a 1024-token prompt every 8 s, 4 chunks each, 4 sequences
    /// waiting): once decode is fast enough they fall under 1 % of the gaps, and p99 no longer
    /// sees them.
    pub itl_p999_ms: f64,
    /// The longest ITL of the steady sequences, ms.
    pub itl_max_ms: f64,
    /// Gaps of the steady sequences longer than 100 ms.
    pub itl_over_100ms: usize,
    /// ITL p99 over the median ITL of the same 2-second window: the jitter, without the slow
    /// rise of ITL as the contexts grow.
    pub itl_p99_over_local_p50: f64,
    /// TTFT of the long prompts, p50, ms.
    pub ttft_p50_ms: f64,
    /// TTFT of the long prompts, p99, ms.
    pub ttft_p99_ms: f64,
    /// Output tokens per second, all requests.
    pub throughput_tok_s: f64,
    /// Requests that failed.
    pub failed: usize,
    /// Long prompts sent.
    pub long_prompts: usize,
    /// The decode worker's engine steps over the run, from its own metrics.
    pub decode_steps: DecodeSteps,
    /// The prefill worker's engine steps over the run (none colocated).
    pub prefill_steps: PrefillSteps,
    /// Every stream's gaps as the router forwarded them, from its own metrics.
    pub router_itl: RouterItl,
    /// The share of the cores' time the hypervisor stole during the load (0-1; `None` where
    /// the kernel does not say).
    pub host_steal: Option<f64>,
    /// The steady sequences' gaps by what the long prompts were doing when each ended.
    pub itl_by_phase: ItlByPhase,
    /// The decode steps' spread split into the batch's shape and jitter, from the decode
    /// worker's step log (`None` when it logged too few steps).
    pub step_split: Option<StepSplit>,
    /// The parameters used.
    pub params: Params,
}

/// Every record of one mode, for the plots.
pub struct ModeRun {
    pub name: &'static str,
    pub records: Vec<RequestRecord>,
    pub result: ModeResult,
}

fn params(args: &BenchArgs, model: &Path) -> Params {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if args.quick {
        Params {
            model: model.display().to_string(),
            steady: 2,
            steady_prompt: 8,
            steady_output: 400,
            long_prompt: 96,
            long_output: 2,
            period_s: 1.0,
            duration_s: args.duration.min(3.0),
            max_batch_tokens: 32,
            cores,
            seed: args.seed,
            kv_transport: args.kv_transport.clone(),
        }
    } else {
        Params {
            model: model.display().to_string(),
            steady: 4,
            steady_prompt: 32,
            steady_output: 3000,
            long_prompt: 1024,
            long_output: 4,
            period_s: 8.0,
            duration_s: args.duration,
            max_batch_tokens: 256,
            cores,
            seed: args.seed,
            kv_transport: args.kv_transport.clone(),
        }
    }
}

/// `--experiment interference`.
pub async fn interference(args: &BenchArgs) -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let model = match (&args.model, args.quick) {
        (Some(m), _) => m.clone(),
        (None, true) => {
            let p = dir.path().join("tiny.gguf");
            std::fs::write(&p, duet_engine::tiny::tiny_model_bytes(1))
                .map_err(|e| e.to_string())?;
            p
        }
        (None, false) => {
            let p = PathBuf::from("models").join(duet_fetch::MODEL_FILE);
            duet_fetch::ensure_model(&p, &mut |_| {}).map_err(|e| e.to_string())?
        }
    };
    let model = std::fs::canonicalize(&model).map_err(|e| format!("{}: {e}", model.display()))?;
    let p = params(args, &model);
    // What the long prompt costs the prefill worker's core with nothing else running: the
    // floor of its TTFT when disaggregated (the rest is queueing, transfer and the first
    // decode step). Measured before the runs and again after them: the host's speed drifts
    // over the minutes between (by a fifth on a shared guest), and the ratios take the
    // median of all six.
    let before = prefill_alone(&p).await?;
    eprintln!(
        "a {}-token prompt alone on core 0 (1 thread, the engine in its own process): {:.0} ms",
        p.long_prompt,
        median(&before)
    );
    let mut runs = Vec::new();
    for mode in [Mode::Colocated, Mode::Disaggregated] {
        eprintln!("{}: starting the cluster", mode.name());
        let cluster = Cluster::start(mode, &p, dir.path()).await?;
        eprintln!(
            "{}: {:.0} s of load ({} steady sequences, a {}-token prompt every {} s)",
            mode.name(),
            p.duration_s,
            p.steady,
            p.long_prompt,
            p.period_s
        );
        let before = CpuTimes::now();
        let (records, seconds) = workload(cluster.http, &p).await;
        let nodes = FromNodes {
            decode_steps: cluster.decode_steps().await,
            prefill_steps: cluster.prefill_steps().await,
            router_itl: cluster.router_itl().await,
            host_steal: before.zip(CpuTimes::now()).map(|(b, a)| b.steal_until(&a)),
            step_split: StepSplit::of(&cluster.steps("d0"), &cluster.steps("p0")),
        };
        cluster.stop().await;
        let steps = nodes.decode_steps;
        let result = result_of(&records, seconds, nodes, &p);
        eprintln!(
            "{}: ITL p50 {:.1} ms p99 {:.1} ms, long-prompt TTFT p50 {:.0} ms p99 {:.0} ms, {:.1} tok/s",
            mode.name(),
            result.itl_p50_ms,
            result.itl_p99_ms,
            result.ttft_p50_ms,
            result.ttft_p99_ms,
            result.throughput_tok_s
        );
        eprintln!(
            "{}: {} decode steps, mean {:.1} ms, {:.1} tokens and {:.0} KV positions attended per step",
            mode.name(),
            steps.steps,
            steps.mean_ms,
            steps.tokens_mean,
            steps.attended_mean
        );
        runs.push(ModeRun {
            name: mode.name(),
            records,
            result,
        });
    }
    let after = prefill_alone(&p).await?;
    let alone = Alone {
        before_ms: median(&before),
        after_ms: median(&after),
        ms: median(&[before, after].concat()),
    };
    let alone_ms = alone.ms;
    let (c, d) = (&runs[0].result, &runs[1].result);
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    println!(
        "interference, {} steady sequences, a {}-token prompt every {} s:",
        p.steady, p.long_prompt, p.period_s
    );
    for r in &runs {
        println!(
            "  {:<14} ITL p50 {:>7.1} ms  p99 {:>7.1} ms   TTFT(long) p50 {:>7.0} ms  p99 {:>7.0} ms   {:>6.1} tok/s",
            r.name,
            r.result.itl_p50_ms,
            r.result.itl_p99_ms,
            r.result.ttft_p50_ms,
            r.result.ttft_p99_ms,
            r.result.throughput_tok_s
        );
    }
    for r in &runs {
        println!(
            "  {:<14} ITL p99.9 {:>7.1} ms  max {:>7.1} ms   {} gaps over 100 ms",
            r.name, r.result.itl_p999_ms, r.result.itl_max_ms, r.result.itl_over_100ms
        );
    }
    for r in &runs {
        let d = r.result.decode_steps;
        println!(
            "  {:<14} decode steps: mean {:.1} ms over {} steps, {:.1} tokens and {:.0} KV positions attended per step",
            r.name, d.mean_ms, d.steps, d.tokens_mean, d.attended_mean
        );
    }
    println!(
        "  disaggregated ITL p99/p50 {:.2} (target <= 1.3; {:.2} against each 2 s window's median, colocated {:.2}); ITL p99 {:.2}x colocated (target <= 0.25); long-prompt TTFT p50 {:.2}x colocated",
        ratio(d.itl_p99_ms, d.itl_p50_ms),
        d.itl_p99_over_local_p50,
        c.itl_p99_over_local_p50,
        ratio(d.itl_p99_ms, c.itl_p99_ms),
        ratio(d.ttft_p50_ms, c.ttft_p50_ms)
    );
    println!(
        "  disaggregated ITL p99.9 {:.2}x colocated, max {:.2}x (the prefill stalls p99 misses once they are under 1 % of the gaps)",
        ratio(d.itl_p999_ms, c.itl_p999_ms),
        ratio(d.itl_max_ms, c.itl_max_ms)
    );
    for r in &runs {
        let (s, i, g) = (r.result.decode_steps, r.result.router_itl, &r.result);
        println!(
            "  {:<14} p99/p50: decode steps {:.2} ({:.1} / {:.1} ms), the router's gaps {:.2} ({:.1} / {:.1} ms), the clients' {:.2}; the host stole {}",
            r.name,
            ratio(s.step_p99_ms, s.step_p50_ms),
            s.step_p50_ms,
            s.step_p99_ms,
            ratio(i.p99_ms, i.p50_ms),
            i.p50_ms,
            i.p99_ms,
            ratio(g.itl_p99_ms, g.itl_p50_ms),
            g.host_steal.map_or("an unknown share".into(), |s| format!(
                "{:.1} % of the cores' time",
                s * 1e2
            ))
        );
    }
    for r in &runs {
        let b = r.result.itl_by_phase;
        let show = |p: Phase| {
            format!(
                "{:.1} / {:.1} ms ({} gaps, {} of the run's top 1 %)",
                p.p50_ms, p.p99_ms, p.gaps, p.at_run_p99
            )
        };
        println!(
            "  {:<14} ITL p50 / p99 while a long prompt is prefilled {}; while one joins the batch {}; otherwise {}",
            r.name,
            show(b.prefilling),
            show(b.joining),
            show(b.quiet)
        );
    }
    for r in &runs {
        let Some(s) = r.result.step_split else {
            continue;
        };
        let pct = |v: Option<f64>| v.map_or("?".into(), |v| format!("{:.1} %", v * 1e2));
        println!(
            "  {:<14} decode steps one by one ({} from the step log): p99/p50 {:.2}; their shape alone {:.2} (fit: {:.1} ms + {:.2} ms a token + {:.2} ms per 1000 positions attended); over the fit {:.2}, p50 / p99 {:.2} / {:.2} while the prefill worker computed ({} steps), {:.2} / {:.2} otherwise ({}); time on CPU {}, waiting for the core {}, elsewhere (interrupts, the host) {}",
            r.name,
            s.steps,
            s.wall_p99_over_p50,
            s.shape_p99_over_p50,
            s.fixed_ms,
            s.per_token_ms,
            s.per_1k_attended_ms,
            s.residual_p99_over_p50,
            s.while_prefilling.p50,
            s.while_prefilling.p99,
            s.while_prefilling.steps,
            s.otherwise.p50,
            s.otherwise.p99,
            s.otherwise.steps,
            pct(s.on_cpu),
            pct(s.waited),
            pct(s.elsewhere)
        );
    }
    println!(
        "  the long prompt alone on core 0: {:.0} ms before the runs, {:.0} ms after them ({:.2}x); the ratios below use the median of the six, {alone_ms:.0} ms",
        alone.before_ms,
        alone.after_ms,
        ratio(alone.after_ms, alone.before_ms)
    );
    println!(
        "  disaggregated long-prompt TTFT p50 {:.0} ms = {:.2}x its prefill alone on the prefill worker's core ({alone_ms:.0} ms; target <= 1.2); the other {:.0} ms are queueing, transfer and the first decode step",
        d.ttft_p50_ms,
        ratio(d.ttft_p50_ms, alone_ms),
        d.ttft_p50_ms - alone_ms
    );
    let in_cluster = d.prefill_steps.ms_for(p.long_prompt);
    println!(
        "  disaggregated prefill worker: {in_cluster:.0} ms of engine steps per {}-token prompt inside the cluster ({:.2}x alone: its steps' time over the prompt tokens they computed); the {:.0} ms left of TTFT p50 wait for the worker, finish the transfer, check it and take the first decode step",
        p.long_prompt,
        ratio(in_cluster, alone_ms),
        d.ttft_p50_ms - in_cluster
    );
    let k = d.decode_steps;
    println!(
        "  disaggregated decode checked {} transfers' KV: {:.2} ms hashing each over {:.1} engine turns (means; at most serving.kv_verify_step_mib a step while sequences run)",
        k.kv_checks, k.kv_check_ms_mean, k.kv_check_turns_mean
    );
    if let Some(path) = &args.json {
        let out = json!({
            "experiment": "interference",
            "colocated": c,
            "disaggregated": d,
            "ratios": {
                "disaggregated_itl_p99_over_p50": ratio(d.itl_p99_ms, d.itl_p50_ms),
                "itl_p99_disaggregated_over_colocated": ratio(d.itl_p99_ms, c.itl_p99_ms),
                "itl_p999_disaggregated_over_colocated": ratio(d.itl_p999_ms, c.itl_p999_ms),
                "itl_max_disaggregated_over_colocated": ratio(d.itl_max_ms, c.itl_max_ms),
                "ttft_p50_disaggregated_over_colocated": ratio(d.ttft_p50_ms, c.ttft_p50_ms),
                "ttft_p50_disaggregated_over_prefill_alone": ratio(d.ttft_p50_ms, alone_ms),
            },
            "prefill_alone_ms": alone_ms,
            "prefill_alone": alone,
            // Every request of each mode (as a plain run's `requests`): each gap with the
            // time it ended, to line the slow steps up with the long prompts' arrivals.
            "requests": {
                runs[0].name: runs[0].records,
                runs[1].name: runs[1].records,
            },
        });
        write_json(path, &out)?;
    }
    if let Some(dir) = &args.plots {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        plots::interference(dir, &runs, &p)?;
        println!("  plots in {}", dir.display());
    }
    Ok(())
}

/// The long prompt alone on the prefill worker's core, ms.
#[derive(Debug, Clone, Copy, serde::Serialize)]
struct Alone {
    /// The median of three before the runs.
    before_ms: f64,
    /// The median of three after them.
    after_ms: f64,
    /// The median of all six: what the ratios use.
    ms: f64,
}

/// The median of `v` (the lower middle when even); 0 when empty.
fn median(v: &[f64]) -> f64 {
    stats::percentile(v, 0.5).unwrap_or(0.0)
}

/// Three times the long prompt's time to first token in `duet generate`, pinned to core 0
/// (the disaggregated prefill worker's) with one thread, nothing else running.
async fn prefill_alone(p: &Params) -> Result<Vec<f64>, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut rng = StdRng::seed_from_u64(p.seed.wrapping_add(1000));
    let ids: Vec<String> = prompt(&mut rng, p.long_prompt)
        .iter()
        .map(u32::to_string)
        .collect();
    let mut times = Vec::new();
    for _ in 0..3 {
        let out = pinned(&exe, Some(0))
            .args([
                "generate",
                "--model",
                &p.model,
                "--prompt-ids",
                &ids.join(","),
            ])
            .args(["--max-tokens", "1", "--threads", "1", "--json"])
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(|e| format!("duet generate: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "duet generate: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)
            .map_err(|e| format!("duet generate --json: {e}"))?;
        times.push(
            v["ttft_ms"]
                .as_f64()
                .ok_or("duet generate gave no ttft_ms")?,
        );
    }
    Ok(times)
}

/// What a run read from its nodes and its host, beside what the clients measured.
struct FromNodes {
    decode_steps: DecodeSteps,
    prefill_steps: PrefillSteps,
    router_itl: RouterItl,
    host_steal: Option<f64>,
    step_split: Option<StepSplit>,
}

fn result_of(records: &[RequestRecord], seconds: f64, nodes: FromNodes, p: &Params) -> ModeResult {
    let steady: Vec<RequestRecord> = records
        .iter()
        .filter(|r| r.class == "steady")
        .cloned()
        .collect();
    let long: Vec<RequestRecord> = records
        .iter()
        .filter(|r| r.class == "long")
        .cloned()
        .collect();
    let slo = stats::Slo {
        ttft_ms: f64::INFINITY,
        itl_ms: f64::INFINITY,
    };
    let s = stats::summarize(&steady, seconds, slo);
    // Every gap of the steady sequences with the time it ended, s.
    let timed: Vec<(f64, f64)> = steady.iter().flat_map(|r| r.itl.iter().copied()).collect();
    let gaps: Vec<f64> = timed.iter().map(|(gap, _)| *gap).collect();
    let ms = |q: f64| stats::percentile(&gaps, q).map_or(0.0, |g| g * 1e3);
    let l = stats::summarize(&long, seconds, slo);
    let all = stats::summarize(records, seconds, slo);
    ModeResult {
        itl_p99_over_local_p50: local_jitter(&timed),
        itl_by_phase: ItlByPhase::of(&timed, &long),
        itl_p50_ms: s.itl_p50_ms,
        itl_p99_ms: s.itl_p99_ms,
        itl_p999_ms: ms(0.999),
        itl_max_ms: ms(1.0),
        itl_over_100ms: gaps.iter().filter(|g| **g > 0.1).count(),
        ttft_p50_ms: l.ttft_p50_ms,
        ttft_p99_ms: l.ttft_p99_ms,
        throughput_tok_s: all.throughput_tok_s,
        failed: all.failed,
        long_prompts: long.len(),
        decode_steps: nodes.decode_steps,
        prefill_steps: nodes.prefill_steps,
        router_itl: nodes.router_itl,
        host_steal: nodes.host_steal,
        step_split: nodes.step_split,
        params: p.clone(),
    }
}

/// p99 of each inter-token gap (`(gap, time it ended)`, s) divided by the median gap of its
/// 2-second window.
fn local_jitter(gaps: &[(f64, f64)]) -> f64 {
    let mut windows: std::collections::BTreeMap<u64, Vec<f64>> = Default::default();
    for (g, t) in gaps {
        windows.entry((t / 2.0) as u64).or_default().push(*g);
    }
    let medians: std::collections::BTreeMap<u64, f64> = windows
        .iter()
        .filter_map(|(w, v)| Some((*w, stats::percentile(v, 0.5)?)))
        .collect();
    let ratios: Vec<f64> = gaps
        .iter()
        .filter_map(|(g, t)| {
            let m = medians.get(&((t / 2.0) as u64))?;
            (*m > 0.0).then(|| g / m)
        })
        .collect();
    stats::percentile(&ratios, 0.99).unwrap_or(0.0)
}

/// Steady sequences plus periodic long prompts, for `p.duration_s`.
async fn workload(addr: std::net::SocketAddr, p: &Params) -> (Vec<RequestRecord>, f64) {
    let epoch = Instant::now();
    let end = epoch + Duration::from_secs_f64(p.duration_s);
    let records = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..p.steady {
        let (records, p) = (records.clone(), p.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(p.seed.wrapping_add(i as u64));
            while Instant::now() < end {
                let ask = Ask {
                    prompt: prompt(&mut rng, p.steady_prompt),
                    max_tokens: p.steady_output,
                    sampling: Default::default(),
                    class: "steady",
                    until: Some(end),
                };
                let r = client::stream_completion(addr, &ask, epoch).await;
                records.lock().unwrap_or_else(|e| e.into_inner()).push(r);
            }
        }));
    }
    // The first long prompt after the steady sequences are decoding.
    let mut rng = StdRng::seed_from_u64(p.seed.wrapping_add(1000));
    let mut at = epoch + Duration::from_secs_f64(p.period_s / 2.0);
    while at < end {
        tokio::time::sleep_until(at.into()).await;
        let ask = Ask {
            prompt: prompt(&mut rng, p.long_prompt),
            max_tokens: p.long_output,
            sampling: Default::default(),
            class: "long",
            until: None,
        };
        let records = records.clone();
        tasks.push(tokio::spawn(async move {
            let r = client::stream_completion(addr, &ask, epoch).await;
            records.lock().unwrap_or_else(|e| e.into_inner()).push(r);
        }));
        at += Duration::from_secs_f64(p.period_s);
    }
    for t in tasks {
        let _ = t.await;
    }
    let seconds = epoch.elapsed().as_secs_f64();
    let records = std::mem::take(&mut *records.lock().unwrap_or_else(|e| e.into_inner()));
    (records, seconds)
}

/// `--experiment transfer`.
pub fn transfer(args: &BenchArgs) -> Result<(), String> {
    let report = duet_transport::bench::measure();
    println!("{report}");
    if let Some(path) = &args.json {
        let v = serde_json::to_value(report).map_err(|e| e.to_string())?;
        write_json(path, &json!({"experiment": "transfer", "result": v}))?;
    }
    Ok(())
}
