//! `duet sim`: the deterministic cluster simulator from the command line.
//!
//! - the planner (default): `duet sim --prefill P --decode D --rate R` prints what clients
//!   would see (TTFT, ITL, end to end, throughput, goodput); `--sweep N` tries every P:D split
//!   of N workers and prints the best first;
//! - `--explore --seeds N`: runs N seeds under every fault and prints the first failing one's
//!   trace (a seed reproduces bit for bit: `--first-seed S --seeds 1`);
//! - `--calibrate`: measures this machine's engine step times and copy bandwidth with the
//!   real model and writes the cost profile the planner reads (`--profile`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::Args;
use duet_sim::explore::explore;
use duet_sim::planner::{plan, sweep};
use duet_sim::stats::Summary;
use duet_sim::{CostModel, Mutations, SimConfig};

use crate::bench::LenDist;

mod calibrate;

use calibrate::{calibrate, measure_request_cost};

/// Options of `duet sim`.
#[derive(Args)]
pub struct SimArgs {
    /// Prefill workers.
    #[arg(long, default_value_t = 1)]
    prefill: usize,
    /// Decode workers.
    #[arg(long, default_value_t = 1)]
    decode: usize,
    /// Arrivals per second (Poisson).
    #[arg(long, default_value_t = 1.0)]
    rate: f64,
    /// Requests to simulate.
    #[arg(long, default_value_t = 1000)]
    requests: usize,
    /// Prompt length in tokens: N or A..B.
    #[arg(long, default_value = "128")]
    prompt_len: LenDist,
    /// Output length in tokens: N or A..B.
    #[arg(long, default_value = "64")]
    output_len: LenDist,
    /// Requests from a file instead (JSON lines: arrival_ms, prompt_tokens, output_tokens).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// The cost profile (`--calibrate` writes one; default: this project's CI machine).
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Goodput counts requests whose time to first token is at most this (ms).
    #[arg(long)]
    slo_ttft_ms: Option<f64>,
    /// ... and whose mean time per output token is at most this (ms).
    #[arg(long)]
    slo_itl_ms: Option<f64>,
    /// Every worker runs on this one machine (as `duet up` starts them): prefill and decode
    /// computing at once slow each other by the profile's measured factors.
    #[arg(long)]
    one_host: bool,
    /// Write the summary (or the sweep) as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Try every prefill:decode split of this many workers; print the best first.
    #[arg(long)]
    sweep: Option<usize>,
    /// The seed of arrivals and lengths (or the first seed explored).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Explore seeds under faults instead of planning.
    #[arg(long)]
    explore: bool,
    /// Seeds to explore.
    #[arg(long, default_value_t = 1000)]
    seeds: u64,
    /// Switch a fixed bug back on while exploring (to see the checks catch it):
    /// release-on-backstop, publish-aborted, fail-duplicate-notice.
    #[arg(long)]
    mutation: Option<String>,
    /// Measure this machine's cost profile with the real model and write it (`--out`).
    #[arg(long)]
    calibrate: bool,
    /// Where `--calibrate` writes the profile.
    #[arg(long, default_value = "sim-profile.json")]
    out: PathBuf,
    /// The GGUF `--calibrate` measures (default: the real model, fetched if missing).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Compute threads per worker for `--calibrate` (`serving.threads`).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// With `--calibrate`: a running cluster's router, to measure a request's fixed cost
    /// beyond the engine (sequential requests, nothing else running).
    #[arg(long)]
    url: Option<String>,
}

/// Runs `duet sim`.
pub async fn run(args: SimArgs) -> ExitCode {
    let result = if args.calibrate {
        match tokio::task::block_in_place(|| calibrate(&args)) {
            Ok(cost) => measure_request_cost(&args, cost).await,
            Err(e) => Err(e),
        }
    } else if args.explore {
        run_explore(&args)
    } else {
        run_plan(&args)
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: sim: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run_explore(args: &SimArgs) -> Result<ExitCode, String> {
    let mut mutations = Mutations::default();
    match args.mutation.as_deref() {
        None => {}
        Some("release-on-backstop") => mutations.release_on_backstop = true,
        Some("publish-aborted") => mutations.publish_aborted = true,
        Some("fail-duplicate-notice") => mutations.fail_duplicate_notice = true,
        Some(other) => {
            return Err(format!(
                "--mutation `{other}`: expected release-on-backstop, publish-aborted or \
                 fail-duplicate-notice"
            ));
        }
    }
    let cfg = SimConfig {
        mutations,
        ..SimConfig::explore()
    };
    let start = Instant::now();
    let e = explore(&cfg, args.seed, args.seeds);
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{} seeds x {} requests in {secs:.1} s: {} finished, {} failed, {} left by their \
         client; {} node faults, {} aborted transfers, {} writes refused, {} drains past the \
         backstop kept quarantined, {} migrations",
        e.seeds,
        cfg.requests,
        e.finished,
        e.failed,
        e.left,
        e.faults,
        e.aborts,
        e.writes_refused,
        e.quarantine_stalls,
        e.migrations
    );
    match e.failure {
        None => {
            println!("no invariant broken");
            Ok(ExitCode::SUCCESS)
        }
        Some(r) => {
            println!("{}", r.readable());
            println!(
                "reproduce: duet sim --explore --seed {} --seeds 1{}",
                r.seed,
                args.mutation
                    .as_deref()
                    .map(|m| format!(" --mutation {m}"))
                    .unwrap_or_default()
            );
            Ok(ExitCode::FAILURE)
        }
    }
}

fn plan_config(args: &SimArgs) -> Result<SimConfig, String> {
    if args.prefill == 0 || args.decode == 0 {
        return Err("--prefill and --decode need at least one worker each".into());
    }
    if !(args.rate.is_finite() && args.rate > 0.0) {
        return Err("--rate must be a positive number of requests per second".into());
    }
    let mut cfg = SimConfig::plan(args.prefill, args.decode, args.rate, args.requests.max(1));
    cfg.prompt_tokens = (args.prompt_len.lo, args.prompt_len.hi);
    cfg.output_tokens = (args.output_len.lo, args.output_len.hi);
    if let Some(p) = &args.profile {
        cfg.cost = CostModel::from_file(p).map_err(|e| e.to_string())?;
    }
    if let Some(t) = &args.trace {
        let list = read_trace(t)?;
        cfg.requests = list.len();
        cfg.trace = Some(list);
    }
    cfg.one_host = args.one_host;
    cfg.slo_ttft_us = args.slo_ttft_ms.map(|ms| (ms * 1e3) as u64);
    cfg.slo_itl_us = args.slo_itl_ms.map(|ms| (ms * 1e3) as u64);
    let longest = cfg.prompt_tokens.1 + cfg.output_tokens.1;
    if longest.div_ceil(cfg.page_size) > cfg.decode_pages {
        return Err(format!(
            "a request of {longest} tokens does not fit a decode worker's pool of {} pages",
            cfg.decode_pages
        ));
    }
    Ok(cfg)
}

/// Reads `--trace`: one JSON object per line with `arrival_ms`, `prompt_tokens` and
/// `output_tokens`.
fn read_trace(path: &Path) -> Result<Vec<(u64, usize, usize)>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read --trace {}: {e}", path.display()))?;
    let mut list = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = |what: &str| format!("--trace {} line {}: {what}", path.display(), i + 1);
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| at(&format!("not JSON ({e})")))?;
        let num = |key: &str| {
            v.get(key)
                .and_then(serde_json::Value::as_f64)
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| at(&format!("`{key}` must be a number >= 0")))
        };
        let arrival = (num("arrival_ms")? * 1e3) as u64;
        let prompt = num("prompt_tokens")? as usize;
        let output = num("output_tokens")? as usize;
        if prompt == 0 || output == 0 {
            return Err(at("prompt_tokens and output_tokens must be at least 1"));
        }
        list.push((arrival, prompt, output));
    }
    if list.is_empty() {
        return Err(format!("--trace {} has no requests", path.display()));
    }
    list.sort_by_key(|r| r.0);
    Ok(list)
}

fn run_plan(args: &SimArgs) -> Result<ExitCode, String> {
    let cfg = plan_config(args)?;
    let start = Instant::now();
    println!(
        "cost profile: {} (prefill {:.0} µs/token, decode step {:.1} ms at batch 1)",
        cfg.cost.source,
        cfg.cost.prefill_token_us,
        cfg.cost.decode_step_us(1, 128) as f64 / 1e3
    );
    let json = if let Some(workers) = args.sweep {
        if workers < 2 {
            return Err("--sweep needs at least 2 workers (one of each role)".into());
        }
        let all = sweep(&cfg, workers, args.seed);
        println!(
            "{workers} workers at {} req/s, {} requests, best split first:",
            cfg.rate, cfg.requests
        );
        header();
        for s in &all {
            row(s);
        }
        if let Some(best) = all.first() {
            println!(
                "best: {} prefill : {} decode ({} s on one core)",
                best.prefill,
                best.decode,
                fmt_secs(start)
            );
        }
        serde_json::to_value(&all).map_err(|e| e.to_string())?
    } else {
        let s = plan(&cfg, args.seed);
        header();
        row(&s);
        println!(
            "TTFT p50/p90/p99 {:.1}/{:.1}/{:.1} ms, ITL p50/p90/p99 {:.1}/{:.1}/{:.1} ms, \
             e2e p50/p99 {:.0}/{:.0} ms over {:.0} virtual s ({} s on one core)",
            s.ttft_p50_ms,
            s.ttft_p90_ms,
            s.ttft_p99_ms,
            s.itl_p50_ms,
            s.itl_p90_ms,
            s.itl_p99_ms,
            s.e2e_p50_ms,
            s.e2e_p99_ms,
            s.virtual_s,
            fmt_secs(start)
        );
        serde_json::to_value(&s).map_err(|e| e.to_string())?
    };
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

fn fmt_secs(start: Instant) -> String {
    format!("{:.1}", start.elapsed().as_secs_f64())
}

fn header() {
    println!(
        "{:>4} {:>4} {:>8} {:>10} {:>10} {:>9} {:>9} {:>11} {:>10}",
        "P", "D", "rate", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "tok/s", "goodput"
    );
}

fn row(s: &Summary) {
    println!(
        "{:>4} {:>4} {:>8.2} {:>10.1} {:>10.1} {:>9.1} {:>9.1} {:>11.1} {:>10.2}",
        s.prefill,
        s.decode,
        s.rate,
        s.ttft_p50_ms,
        s.ttft_p99_ms,
        s.itl_p50_ms,
        s.itl_p99_ms,
        s.throughput_tok_s,
        s.goodput_req_s
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_names_its_bad_line() {
        let dir = tempfile::tempdir().expect("temp dir");
        let p = dir.path().join("t.jsonl");
        std::fs::write(
            &p,
            "{\"arrival_ms\": 0, \"prompt_tokens\": 10, \"output_tokens\": 5}\n{\"arrival_ms\": 1}\n",
        )
        .expect("write");
        let e = read_trace(&p).expect_err("refused");
        assert!(e.contains("line 2") && e.contains("prompt_tokens"), "{e}");
    }
}
