//! `duet bench`: a load generator against the router's OpenAI API, and the experiments built on
//! it.
//!
//! - a plain run: open-loop Poisson arrivals (`--rate`) or a fixed concurrency, prompt and output
//!   lengths from `N` or `A..B` (uniform, seeded), for `--duration` seconds; it records TTFT,
//!   every inter-token gap and end-to-end latency per request, and prints throughput, latency
//!   percentiles and goodput under `--slo-ttft-ms` and `--slo-itl-ms` (`--json` writes it all);
//! - `--experiment interference`: colocated against disaggregated on the same workload
//!   ([`experiment`]), with `--plots DIR`;
//! - `--experiment transfer`: the KV transfer micro-benchmark.

pub(crate) mod client;
mod clusters;
mod experiment;
mod host;
mod phases;
pub(crate) mod plots;
mod prom;
pub mod stats;
mod steps;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub use client::Ask;
use stats::{RequestRecord, Slo};

/// A length: fixed (`N`) or uniform over `A..B` (inclusive).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LenDist {
    /// Shortest.
    pub lo: usize,
    /// Longest.
    pub hi: usize,
}

impl FromStr for LenDist {
    type Err = String;
    fn from_str(s: &str) -> Result<LenDist, String> {
        let bad = || format!("`{s}` is not a length: expected N or A..B (tokens, at least 1)");
        let (lo, hi) = match s.split_once("..") {
            Some((a, b)) => (
                a.trim().parse().map_err(|_| bad())?,
                b.trim().parse().map_err(|_| bad())?,
            ),
            None => {
                let n = s.trim().parse().map_err(|_| bad())?;
                (n, n)
            }
        };
        if lo == 0 || hi < lo {
            return Err(bad());
        }
        Ok(LenDist { lo, hi })
    }
}

impl LenDist {
    fn draw(&self, rng: &mut StdRng) -> usize {
        rng.random_range(self.lo..=self.hi)
    }
}

/// Which experiment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Experiment {
    /// Colocated against disaggregated: ITL of running sequences while long prompts arrive.
    Interference,
    /// KV transfer throughput per backend beside memcpy and raw TCP.
    Transfer,
}

/// `duet bench` arguments.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// The router's base URL (plain runs). Also `--base-url`, as `vllm bench serve` names it.
    #[arg(long, alias = "base-url", default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// Open loop: Poisson arrivals at this many requests per second. Also `--request-rate`
    /// (`inf` there: every request at once, which here is the closed loop of --concurrency).
    #[arg(long, alias = "request-rate", value_parser = parse_rate)]
    pub rate: Option<f64>,
    /// Closed loop (without --rate): this many requests in flight. Also `--max-concurrency`.
    #[arg(long, alias = "max-concurrency", default_value_t = 4)]
    pub concurrency: usize,
    /// Prompt length in tokens: N or A..B. Also `--random-input-len`.
    #[arg(long, alias = "random-input-len", default_value = "128")]
    pub prompt_len: LenDist,
    /// Output length in tokens: N or A..B. Also `--random-output-len`.
    #[arg(long, alias = "random-output-len", default_value = "64")]
    pub output_len: LenDist,
    /// Send this many requests, then stop (instead of sending for --duration), as `vllm
    /// bench serve --num-prompts` does.
    #[arg(long)]
    pub num_prompts: Option<usize>,
    /// Run the load once per request rate of this list (`1,2,4,8`), --duration (or
    /// --num-prompts) each, and print throughput against latency per rate; with --plots, draw
    /// the curve into `sweep.png`.
    #[arg(long, value_delimiter = ',')]
    pub sweep: Vec<f64>,
    /// Sampling temperature of every request (0: greedy; 1 is what an OpenAI client that sets
    /// none gets). Also as `vllm bench serve` names it.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling of every request (1: off). Also as `vllm bench serve` names it.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Seed of the arrivals, lengths and prompts.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Seconds to send requests for.
    #[arg(long, default_value_t = 30.0)]
    pub duration: f64,
    /// Goodput: time to first token at most this (ms).
    #[arg(long, default_value_t = 2000.0)]
    pub slo_ttft_ms: f64,
    /// Goodput: every inter-token gap at most this (ms).
    #[arg(long, default_value_t = 200.0)]
    pub slo_itl_ms: f64,
    /// Write every figure as JSON here. Also `--result-filename`.
    #[arg(long, alias = "result-filename")]
    pub json: Option<PathBuf>,
    /// Run an experiment instead of a plain load.
    #[arg(long, value_enum)]
    pub experiment: Option<Experiment>,
    /// Write the experiment's plots (PNG) into this folder.
    #[arg(long)]
    pub plots: Option<PathBuf>,
    /// The GGUF the experiment's clusters serve (default: the real model, fetched if missing).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The experiment with tiny parameters and the tiny model (a smoke run, seconds).
    #[arg(long)]
    pub quick: bool,
    /// A shared-prefix workload: every prompt starts with one of this many system prompts
    /// (drawn uniformly; `--prefix-len` tokens each, the same for a seed), then its own
    /// `--prompt-len` tokens. 0: no shared prefix.
    #[arg(long, default_value_t = 0)]
    pub shared_prefixes: usize,
    /// Tokens of each shared system prompt.
    #[arg(long, default_value_t = 512)]
    pub prefix_len: usize,
    /// How the interference experiment's prefill worker writes decode's pages
    /// (`serving.kv_transport`: on one host `auto` is `shm`).
    #[arg(long, default_value = "auto", value_parser = ["auto", "shm", "tcp"])]
    pub kv_transport: String,
}

impl BenchArgs {
    /// How the load's requests sample.
    fn sampling(&self) -> client::Sampling {
        client::Sampling {
            temperature: self.temperature,
            top_p: self.top_p,
        }
    }
}

/// The prompts of a run: random tokens, after one of the shared system prompts if any.
#[derive(Debug, Clone)]
pub(crate) struct Prompts {
    systems: Arc<Vec<Vec<u32>>>,
}

impl Prompts {
    pub(crate) fn new(args: &BenchArgs) -> Prompts {
        let mut rng = StdRng::seed_from_u64(args.seed ^ 0x0051_57e3);
        let systems = (0..args.shared_prefixes)
            .map(|_| prompt(&mut rng, args.prefix_len))
            .collect();
        Prompts {
            systems: Arc::new(systems),
        }
    }

    /// A prompt of `n` own tokens (after a system prompt, when there are some).
    pub(crate) fn draw(&self, rng: &mut StdRng, n: usize) -> Vec<u32> {
        let mut p = if self.systems.is_empty() {
            Vec::with_capacity(n)
        } else {
            self.systems[rng.random_range(0..self.systems.len())].clone()
        };
        p.extend(prompt(rng, n));
        p
    }
}

/// Runs `duet bench`.
pub async fn run(args: BenchArgs) -> ExitCode {
    let result = match args.experiment {
        Some(Experiment::Interference) => experiment::interference(&args).await,
        Some(Experiment::Transfer) => experiment::transfer(&args),
        None if !args.sweep.is_empty() => sweep(&args).await,
        None => plain(&args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: bench: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A request rate: a positive number, or `inf` (vLLM's "all at once": the closed loop).
fn parse_rate(s: &str) -> Result<f64, String> {
    if s.eq_ignore_ascii_case("inf") {
        return Ok(f64::INFINITY);
    }
    match s.parse::<f64>() {
        Ok(r) if r > 0.0 => Ok(r),
        _ => Err(format!(
            "`{s}`: a rate is requests per second above 0, or inf"
        )),
    }
}

/// `http://HOST:PORT` to a socket address.
pub(crate) fn parse_url(url: &str) -> Result<SocketAddr, String> {
    let hostport = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("`{url}`: expected http://HOST:PORT"))?
        .trim_end_matches('/');
    let hostport = hostport.strip_suffix("/v1").unwrap_or(hostport);
    std::net::ToSocketAddrs::to_socket_addrs(hostport)
        .map_err(|e| format!("`{url}`: {e}"))?
        .next()
        .ok_or_else(|| format!("`{url}` resolves to nothing"))
}

/// Random prompt token ids (inside every vocabulary Duet ships, the tiny model's too).
pub(crate) fn prompt(rng: &mut StdRng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(20..250)).collect()
}

/// The plain load run.
async fn plain(args: &BenchArgs) -> Result<(), String> {
    let addr = parse_url(&args.url)?;
    let slo = Slo {
        ttft_ms: args.slo_ttft_ms,
        itl_ms: args.slo_itl_ms,
    };
    let (records, seconds) = load(addr, args, args.rate).await;
    let summary = stats::summarize(&records, seconds, slo);
    println!(
        "{} requests in {seconds:.1} s ({} failed): {:.1} output tok/s, {:.2} req/s, goodput {:.2} req/s ({:.0} % within TTFT <= {} ms and ITL <= {} ms)",
        summary.requests,
        summary.failed,
        summary.throughput_tok_s,
        summary.requests_per_s,
        summary.goodput_req_s,
        summary.slo_attainment * 100.0,
        slo.ttft_ms,
        slo.itl_ms
    );
    println!(
        "  TTFT p50 {:.1} ms p99 {:.1} ms | ITL p50 {:.1} ms p99 {:.1} ms | e2e p50 {:.1} ms p99 {:.1} ms",
        summary.ttft_p50_ms,
        summary.ttft_p99_ms,
        summary.itl_p50_ms,
        summary.itl_p99_ms,
        summary.e2e_p50_ms,
        summary.e2e_p99_ms
    );
    println!("  ms         mean      p50      p90      p95      p99");
    for (name, d) in [
        ("TTFT", summary.ttft_ms),
        ("TPOT", summary.tpot_ms),
        ("ITL", summary.itl_ms),
        ("E2E", summary.e2e_ms),
    ] {
        println!(
            "  {name:<6} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1}",
            d.mean, d.p50, d.p90, d.p95, d.p99
        );
    }
    if let Some(path) = &args.json {
        let out = serde_json::json!({
            "summary": summary,
            "slo": slo,
            "params": {
                "url": args.url, "rate": args.rate, "concurrency": args.concurrency,
                "prompt_len": format!("{}..{}", args.prompt_len.lo, args.prompt_len.hi),
                "output_len": format!("{}..{}", args.output_len.lo, args.output_len.hi),
                "seed": args.seed, "duration_s": args.duration,
                "shared_prefixes": args.shared_prefixes, "prefix_len": args.prefix_len,
            },
            "requests": records,
        });
        write_json(path, &out)?;
    }
    Ok(())
}

/// `--sweep`: one load per rate, then throughput against latency (a table, and a PNG with
/// --plots), as `vllm bench serve` runs over request rates.
async fn sweep(args: &BenchArgs) -> Result<(), String> {
    let addr = parse_url(&args.url)?;
    let slo = Slo {
        ttft_ms: args.slo_ttft_ms,
        itl_ms: args.slo_itl_ms,
    };
    let mut points = Vec::new();
    println!(
        "{:>8} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7}",
        "rate", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "failed"
    );
    for &rate in &args.sweep {
        let (records, seconds) = load(addr, args, Some(rate)).await;
        let s = stats::summarize(&records, seconds, slo);
        println!(
            "{rate:>8.2} {:>8.2} {:>10.1} {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>7}",
            s.requests_per_s,
            s.throughput_tok_s,
            s.ttft_p50_ms,
            s.ttft_p99_ms,
            s.itl_p50_ms,
            s.itl_p99_ms,
            s.failed
        );
        points.push((rate, s));
    }
    if let Some(dir) = &args.plots {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let path = dir.join("sweep.png");
        plots::sweep(&path, &points)?;
        println!("wrote {}", path.display());
    }
    if let Some(path) = &args.json {
        let out = serde_json::json!({
            "sweep": points.iter().map(|(rate, s)| serde_json::json!({"rate": rate, "summary": s})).collect::<Vec<_>>(),
            "slo": slo,
        });
        write_json(path, &out)?;
    }
    Ok(())
}

pub(crate) fn write_json(path: &std::path::Path, v: &serde_json::Value) -> Result<(), String> {
    let text = serde_json::to_string_pretty(v).map_err(|e| e.to_string())?;
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Sends the load for `args.duration` seconds; returns the records and the seconds it took.
async fn load(addr: SocketAddr, args: &BenchArgs, rate: Option<f64>) -> (Vec<RequestRecord>, f64) {
    let epoch = Instant::now();
    // With --num-prompts the count ends the run, not the clock.
    let end = epoch
        + match args.num_prompts {
            Some(_) => Duration::from_secs(24 * 3600),
            None => Duration::from_secs_f64(args.duration),
        };
    let left = Arc::new(std::sync::atomic::AtomicUsize::new(
        args.num_prompts.unwrap_or(usize::MAX),
    ));
    // One more request may be sent: false once the count is used up.
    let take = |left: &std::sync::atomic::AtomicUsize| {
        left.fetch_update(
            std::sync::atomic::Ordering::SeqCst,
            std::sync::atomic::Ordering::SeqCst,
            |n| n.checked_sub(1),
        )
        .is_ok()
    };
    let bar = progress(args.duration);
    let mut rng = StdRng::seed_from_u64(args.seed);
    let prompts = Prompts::new(args);
    let records = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    match rate {
        Some(rate) if rate > 0.0 && rate.is_finite() => {
            // Open loop: exponential gaps, whatever the server does.
            let mut next = epoch;
            while next < end && take(&left) {
                tokio::time::sleep_until(next.into()).await;
                let n = args.prompt_len.draw(&mut rng);
                let ask = Ask {
                    prompt: prompts.draw(&mut rng, n),
                    max_tokens: args.output_len.draw(&mut rng),
                    sampling: args.sampling(),
                    class: "load",
                    until: None,
                };
                let records = records.clone();
                tasks.push(tokio::spawn(async move {
                    let r = client::stream_completion(addr, &ask, epoch).await;
                    records.lock().unwrap_or_else(|p| p.into_inner()).push(r);
                }));
                let u: f64 = rng.random_range(f64::EPSILON..1.0);
                next += Duration::from_secs_f64(-u.ln() / rate);
                bar.set_position(epoch.elapsed().as_millis() as u64);
            }
        }
        _ => {
            for w in 0..args.concurrency.max(1) {
                let mut rng = StdRng::seed_from_u64(args.seed.wrapping_add(w as u64));
                let (records, prompt_len, output_len, sampling, prompts, left) = (
                    records.clone(),
                    args.prompt_len,
                    args.output_len,
                    args.sampling(),
                    prompts.clone(),
                    left.clone(),
                );
                tasks.push(tokio::spawn(async move {
                    while Instant::now() < end && take(&left) {
                        let n = prompt_len.draw(&mut rng);
                        let ask = Ask {
                            prompt: prompts.draw(&mut rng, n),
                            max_tokens: output_len.draw(&mut rng),
                            sampling,
                            class: "load",
                            until: None,
                        };
                        let r = client::stream_completion(addr, &ask, epoch).await;
                        records.lock().unwrap_or_else(|p| p.into_inner()).push(r);
                    }
                }));
            }
            while Instant::now() < end && !tasks.iter().all(|t| t.is_finished()) {
                bar.set_position(epoch.elapsed().as_millis() as u64);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    bar.set_message("waiting for the last requests");
    for t in tasks {
        let _ = t.await;
    }
    bar.finish_and_clear();
    let seconds = epoch.elapsed().as_secs_f64();
    let records = std::mem::take(&mut *records.lock().unwrap_or_else(|p| p.into_inner()));
    (records, seconds)
}

fn progress(seconds: f64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new((seconds * 1000.0) as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message("sending");
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_parse_and_draw_in_range() {
        assert_eq!("64".parse(), Ok(LenDist { lo: 64, hi: 64 }));
        let d: LenDist = "8..16".parse().expect("range");
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..100 {
            assert!((8..=16).contains(&d.draw(&mut rng)));
        }
        for bad in ["0", "16..8", "x", "1..y"] {
            assert!(bad.parse::<LenDist>().is_err(), "{bad}");
        }
    }

    #[test]
    fn urls_become_addresses() {
        assert_eq!(
            parse_url("http://127.0.0.1:8000/v1/"),
            Ok(SocketAddr::from(([127, 0, 0, 1], 8000)))
        );
        assert!(parse_url("https://example").is_err());
    }
}
