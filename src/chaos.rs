//! `duet chaos`: load through the router while a random serving actor is killed at an
//! interval, then a report of what the cluster did with every request.
//!
//! With `--pause` and `--crash`, whole worker processes are faulted too (on this host: the
//! node's pid comes from its admin API): SIGSTOP for a random `--pause-secs` (then SIGCONT),
//! and SIGKILL (the cluster's `duet up` starts the node again). Faults deal from a shuffled
//! deck of every target, so each is hit once per round.
//!
//! Each request is a greedy completion of one of a few fixed prompts whose output the engine
//! computes in this process first (what `duet generate` prints), so an answer that differs is
//! counted as corrupted. After the load the command waits for the cluster to go quiet and counts
//! the pages that did not come back (pinned, quarantined, or neither free nor cached).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use duet_actors::settings::ServingConfig;
use duet_engine::{Engine, EngineOptions, Model, Runner, SamplingParams};
use duet_runtime::admin::client::{self, Method};
use duet_runtime::config::Role;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::bench::client::{Ask, stream_completion};

mod report;

use report::summary;

/// `duet chaos` arguments.
#[derive(Debug, clap::Args)]
pub struct ChaosArgs {
    /// The cluster file (the cluster must be running).
    #[arg(long, default_value = "cluster.toml")]
    pub config: PathBuf,
    /// Seconds of load.
    #[arg(long, default_value_t = 60.0)]
    pub duration: f64,
    /// Seconds between kills.
    #[arg(long, default_value_t = 2.0)]
    pub kill_every: f64,
    /// Requests in flight.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Seed of the prompts and the kills.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Tokens per request.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Also stop worker node processes (SIGSTOP, then SIGCONT after `--pause-secs`).
    #[arg(long)]
    pub pause: bool,
    /// How long a pause lasts: a random number of seconds in this range (`MIN..MAX`).
    #[arg(long, default_value = "1..10", value_parser = parse_range)]
    pub pause_secs: (f64, f64),
    /// Also kill worker node processes (SIGKILL; `duet up` starts them again).
    #[arg(long)]
    pub crash: bool,
}

fn parse_range(text: &str) -> Result<(f64, f64), String> {
    let (a, b) = text
        .split_once("..")
        .ok_or_else(|| format!("`{text}` is not a range: expected MIN..MAX seconds"))?;
    let parse = |v: &str| {
        v.trim()
            .parse::<f64>()
            .ok()
            .filter(|x| x.is_finite() && *x >= 0.0)
            .ok_or_else(|| format!("`{v}` is not a number of seconds"))
    };
    let (a, b) = (parse(a)?, parse(b)?);
    if a > b {
        return Err(format!("`{text}`: MIN is larger than MAX"));
    }
    Ok((a, b))
}

/// One fault of the deck.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Fault {
    /// `duet kill` of an actor (its path).
    Kill(String),
    /// SIGSTOP a node's process, SIGCONT later.
    Pause(String),
    /// SIGKILL a node's process.
    Crash(String),
}

/// A request that got no answer within this is counted unfinished.
const REQUEST_DEADLINE: Duration = Duration::from_secs(120);

/// Runs `duet chaos`.
pub async fn run(args: ChaosArgs) -> ExitCode {
    match chaos(&args).await {
        Ok(report) => {
            if args.json {
                println!("{report}");
            } else {
                print!("{}", summary(&report));
            }
            let bad = ["unfinished", "corrupted", "stranded_pages"]
                .iter()
                .any(|k| report[k].as_u64() != Some(0));
            if bad {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("error: chaos: {e}");
            ExitCode::from(2)
        }
    }
}

/// Every fault to deal: the serving actors of each node (by the paths `duet kill` takes) and,
/// if asked, the worker node processes.
fn targets(config: &duet_runtime::config::ClusterConfig, args: &ChaosArgs) -> Vec<Fault> {
    let mut out = Vec::new();
    for n in &config.nodes {
        let actors: &[&str] = match n.role {
            Role::Router => &["router/router"],
            Role::Prefill => &["prefill/bootstrap", "prefill/worker", "prefill/sender"],
            Role::Decode => &["decode/worker", "decode/receiver"],
        };
        out.extend(
            actors
                .iter()
                .map(|a| Fault::Kill(format!("{}/{a}", n.name))),
        );
        // The router is the cluster's one front door: stopping it stops every stream.
        if n.role != Role::Router {
            if args.pause {
                out.push(Fault::Pause(n.name.clone()));
            }
            if args.crash {
                out.push(Fault::Crash(n.name.clone()));
            }
        }
    }
    out
}

/// Fails within a few seconds, naming what it tried, if the cluster is not running: the
/// router's HTTP port and every node's admin API must answer.
async fn reachable(
    config: &duet_runtime::config::ClusterConfig,
    token: &str,
    http: std::net::SocketAddr,
) -> Result<(), String> {
    let health = tokio::time::timeout(Duration::from_secs(2), async {
        let mut s = tokio::net::TcpStream::connect(http).await?;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(b"GET /health HTTP/1.1\r\nHost: duet\r\nConnection: close\r\n\r\n")
            .await?;
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).await?;
        Ok::<_, std::io::Error>(answer.starts_with(b"HTTP/1.1 200"))
    })
    .await;
    match health {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => return Err(format!("the router at http://{http} is not healthy")),
        Ok(Err(e)) => {
            return Err(format!(
                "no router answers at http://{http}: {e} (is the cluster running? `duet up`)"
            ));
        }
        Err(_) => {
            return Err(format!(
                "the router at http://{http} did not answer within 2 s"
            ));
        }
    }
    for n in &config.nodes {
        client::call(
            n.admin,
            token,
            Method::GET,
            "/v1/tree",
            None,
            Duration::from_secs(2),
        )
        .await
        .map_err(|e| format!("node {} (admin http://{}): {e}", n.name, n.admin))?;
    }
    Ok(())
}

/// A node's process id, from its admin API.
async fn node_pid(n: &duet_runtime::config::NodeConfig, token: &str) -> Option<i32> {
    let tree = client::call(
        n.admin,
        token,
        Method::GET,
        "/v1/tree",
        None,
        Duration::from_secs(3),
    )
    .await
    .ok()?;
    tree["pid"].as_u64().and_then(|p| i32::try_from(p).ok())
}

/// Node processes this run stopped: continued when dropped, whatever ends the run.
#[derive(Default)]
struct Paused(Arc<Mutex<BTreeMap<String, i32>>>);

impl Paused {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, i32>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        for pid in self.lock().values() {
            let _ = kill(Pid::from_raw(*pid), Signal::SIGCONT);
        }
    }
}

async fn chaos(args: &ChaosArgs) -> Result<serde_json::Value, String> {
    let (config, token) =
        crate::admin_cli::load(&args.config).map_err(|_| "cannot load the cluster".to_string())?;
    let serving = ServingConfig::from_cluster(&config).map_err(|e| e.to_string())?;
    reachable(&config, &token, serving.http).await?;
    // The reference: greedy outputs of a few prompts, from the engine in this process.
    let mut rng = StdRng::seed_from_u64(args.seed);
    let prompts: Vec<Vec<u32>> = [12usize, 40, 90, 200, 300]
        .iter()
        .map(|&n| crate::bench::prompt(&mut rng, n))
        .collect();
    let expected = {
        let (s, prompts, max_tokens) = (serving.clone(), prompts.clone(), args.max_tokens);
        tokio::task::spawn_blocking(move || reference(&s, &prompts, max_tokens))
            .await
            .map_err(|e| e.to_string())??
    };
    let addr = serving.http;
    let epoch = Instant::now();
    let end = epoch + Duration::from_secs_f64(args.duration);
    let outcomes = Arc::new(Mutex::new(Vec::<Outcome>::new()));
    let mut workers = Vec::new();
    for w in 0..args.concurrency.max(1) {
        let (outcomes, prompts, expected) = (outcomes.clone(), prompts.clone(), expected.clone());
        let max_tokens = args.max_tokens;
        let mut rng = StdRng::seed_from_u64(args.seed.wrapping_add(100 + w as u64));
        workers.push(tokio::spawn(async move {
            while Instant::now() < end {
                let i = rng.random_range(0..prompts.len());
                let ask = Ask {
                    prompt: prompts[i].clone(),
                    max_tokens,
                    sampling: Default::default(),
                    class: "chaos",
                    until: None,
                };
                let outcome = match tokio::time::timeout(
                    REQUEST_DEADLINE,
                    stream_completion(addr, &ask, epoch),
                )
                .await
                {
                    Err(_) => Outcome::Unfinished,
                    Ok(r) => match r.error {
                        Some(e) => Outcome::Failed(e),
                        None if r.text == expected[i] => Outcome::Succeeded,
                        None => Outcome::Corrupted,
                    },
                };
                if matches!(outcome, Outcome::Failed(_)) {
                    // A worker restarting: give it a moment instead of spinning on errors.
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                outcomes
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(outcome);
            }
        }));
    }
    // The killer.
    // Kills deal from a shuffled deck of every target: random order, yet each kind is hit
    // once per round (a short run still reaches every actor).
    let targets = targets(&config, args);
    let mut deck: Vec<Fault> = Vec::new();
    let mut kills: BTreeMap<String, u64> = BTreeMap::new();
    let (mut pauses, mut crashes): (BTreeMap<String, u64>, BTreeMap<String, u64>) =
        Default::default();
    let paused = Paused::default();
    let mut next = epoch + Duration::from_secs_f64(args.kill_every);
    let progress = tokio::spawn(progress(outcomes.clone(), epoch, args.duration));
    while next < end {
        tokio::time::sleep_until(next.into()).await;
        next += Duration::from_secs_f64(args.kill_every);
        if deck.is_empty() {
            deck = targets.clone();
            deck.shuffle(&mut rng);
        }
        let Some(fault) = deck.pop() else { break };
        let node = match &fault {
            Fault::Kill(path) => path.split('/').next().unwrap_or_default(),
            Fault::Pause(node) | Fault::Crash(node) => node.as_str(),
        };
        let Some(n) = config.node(node) else { continue };
        if paused.lock().contains_key(node) {
            continue; // a stopped node answers nothing: this turn passes
        }
        match &fault {
            Fault::Kill(path) => {
                let killed = client::call(
                    n.admin,
                    &token,
                    Method::POST,
                    "/v1/actors/kill",
                    Some(json!({ "path": path })),
                    Duration::from_secs(5),
                )
                .await;
                if killed.is_ok() {
                    let kind = path.rsplit('/').next().unwrap_or_default().to_string();
                    *kills.entry(kind).or_default() += 1;
                }
            }
            Fault::Pause(node) => {
                let Some(pid) = node_pid(n, &token).await else {
                    continue;
                };
                let (lo, hi) = args.pause_secs;
                let secs = if hi > lo {
                    rng.random_range(lo..=hi)
                } else {
                    lo
                };
                if kill(Pid::from_raw(pid), Signal::SIGSTOP).is_ok() {
                    paused.lock().insert(node.clone(), pid);
                    *pauses.entry(node.clone()).or_default() += 1;
                    let (all, node) = (paused.0.clone(), node.clone());
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_secs_f64(secs)).await;
                        let mut all = all.lock().unwrap_or_else(|p| p.into_inner());
                        if let Some(pid) = all.remove(&node) {
                            let _ = kill(Pid::from_raw(pid), Signal::SIGCONT);
                        }
                    });
                }
            }
            Fault::Crash(node) => {
                let Some(pid) = node_pid(n, &token).await else {
                    continue;
                };
                if kill(Pid::from_raw(pid), Signal::SIGKILL).is_ok() {
                    *crashes.entry(node.clone()).or_default() += 1;
                }
            }
        }
    }
    for w in workers {
        let _ = w.await;
    }
    progress.abort();
    // Nothing stays stopped past the load.
    drop(paused);
    let load_seconds = epoch.elapsed().as_secs_f64();
    // Quiet: every pool whole on every worker, or the deadline.
    let deadline = Instant::now() + Duration::from_secs(120);
    let stranded = loop {
        let stranded = stranded_pages(&config, &token).await;
        if stranded == Some(0) || Instant::now() > deadline {
            break stranded;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let mut restarts: BTreeMap<String, f64> = BTreeMap::new();
    for n in &config.nodes {
        if let Ok(text) = client::metrics_text(n.admin, &token, Duration::from_secs(3)).await {
            for line in text
                .lines()
                .filter(|l| l.starts_with("duet_actor_restarts_total{"))
            {
                let kind = line
                    .split("kind=\"")
                    .nth(1)
                    .and_then(|r| r.split('"').next())
                    .unwrap_or("?")
                    .to_string();
                let v: f64 = line
                    .rsplit(' ')
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0.0);
                *restarts.entry(kind).or_default() += v;
            }
        }
    }
    let outcomes = outcomes.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let count = |f: &dyn Fn(&Outcome) -> bool| outcomes.iter().filter(|o| f(o)).count();
    let mut by_phase: BTreeMap<String, usize> = BTreeMap::new();
    // A few whole messages, so a failure can be read without the cluster's logs.
    let mut errors: Vec<String> = Vec::new();
    for o in &outcomes {
        if let Outcome::Failed(e) = o {
            *by_phase.entry(phase_of(e)).or_default() += 1;
            let e: String = e.chars().take(300).collect();
            if errors.len() < 8 && !errors.contains(&e) {
                errors.push(e);
            }
        }
    }
    let requests = outcomes.len();
    let succeeded = count(&|o| matches!(o, Outcome::Succeeded));
    Ok(json!({
        "requests": requests,
        "succeeded": succeeded,
        "failed": count(&|o| matches!(o, Outcome::Failed(_))),
        "unfinished": count(&|o| matches!(o, Outcome::Unfinished)),
        "corrupted": count(&|o| matches!(o, Outcome::Corrupted)),
        "stranded_pages": stranded.map_or(-1, |s| s as i64),
        "success_rate": if requests > 0 { succeeded as f64 / requests as f64 } else { 0.0 },
        "failed_by_phase": by_phase,
        "errors": errors,
        "kills": kills,
        "pauses": pauses,
        "crashes": crashes,
        "restarts_by_kind": restarts,
        "load_seconds": load_seconds,
    }))
}

/// A line on stderr every few seconds while the load runs: a long run shows it is alive and
/// how it goes (stdout keeps only the report).
async fn progress(outcomes: Arc<Mutex<Vec<Outcome>>>, epoch: Instant, duration: f64) {
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    tick.tick().await;
    loop {
        tick.tick().await;
        let (mut ok, mut failed, mut other) = (0, 0, 0);
        for o in outcomes.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            match o {
                Outcome::Succeeded => ok += 1,
                Outcome::Failed(_) => failed += 1,
                Outcome::Unfinished | Outcome::Corrupted => other += 1,
            }
        }
        eprintln!(
            "chaos: {:.0}/{duration:.0} s, {} requests: {ok} succeeded, {failed} failed, {other} unfinished or wrong",
            epoch.elapsed().as_secs_f64(),
            ok + failed + other
        );
    }
}

#[derive(Debug, Clone)]
enum Outcome {
    Succeeded,
    Failed(String),
    Unfinished,
    Corrupted,
}

/// The phase an error names: its text up to the first colon (`decode transfer`, `HTTP 503`...).
fn phase_of(error: &str) -> String {
    // The router's errors arrive inside an HTTP or SSE wrapper; the phase is in its message.
    let message = error
        .split("\"message\":\"")
        .nth(1)
        .unwrap_or(error)
        .to_string();
    message
        .split([':', '"'])
        .next()
        .unwrap_or("unknown")
        .trim()
        .chars()
        .take(60)
        .collect()
}

/// Pages not back in their pools, over every worker; `None` if a node did not answer.
async fn stranded_pages(config: &duet_runtime::config::ClusterConfig, token: &str) -> Option<u64> {
    let mut stranded = 0.0;
    for n in config.nodes.iter().filter(|n| n.role != Role::Router) {
        let text = client::metrics_text(n.admin, token, Duration::from_secs(3))
            .await
            .ok()?;
        let get = |name: &str| -> f64 {
            text.lines()
                .filter(|l| l.split([' ', '{']).next() == Some(name))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        let (total, free, cached) = (
            get("duet_kv_pages_total"),
            get("duet_kv_pages_free"),
            get("duet_kv_pages_cached"),
        );
        if total == 0.0 {
            return None; // not reported yet (restarting)
        }
        stranded += (total - free - cached).max(0.0)
            + get("duet_kv_pages_pinned")
            + get("duet_kv_pages_quarantined");
    }
    Some(stranded as u64)
}

/// What the engine alone answers for each prompt, greedily.
fn reference(
    s: &ServingConfig,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> Result<Vec<String>, String> {
    let path = duet_fetch::ensure_model(&s.model, &mut |_| {}).map_err(|e| e.to_string())?;
    let model = Model::open(&path).map_err(|e| e.to_string())?;
    let max_context = model.config.context_length;
    let engine = Engine::new(
        model,
        EngineOptions {
            kv_dtype: s.kv_dtype,
            page_size: s.page_size,
            kv_pages: 256,
            threads: 1,
            max_context,
        },
    )
    .map_err(|e| e.to_string())?;
    let mut runner = Runner::new(engine, s.max_batch_tokens, 8);
    let params = SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    prompts
        .iter()
        .map(|p| {
            runner
                .submit(1, p.clone(), params.clone())
                .map_err(|e| e.to_string())?;
            Ok(runner
                .run_to_completion()
                .map_err(|e| e.to_string())?
                .into_iter()
                .map(|e| e.text)
                .collect())
        })
        .collect()
}
