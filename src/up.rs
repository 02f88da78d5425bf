//! `duet up`: every node of a cluster file as a child process of this one, supervised.
//!
//! Shows start-up progress, prints one line beginning with `ready` once every node reported
//! ready, forwards the nodes' logs (prefixed with the node name), and on Ctrl-C or SIGTERM
//! asks every node to drain (SIGTERM), killing those that outlive the drain timeout. If a
//! node fails to start, the others are stopped and `duet up` exits non-zero naming the node
//! and its reason.
//!
//! Once the cluster serves, `duet up` is the local cluster's process supervisor: a node whose
//! process dies (a crash, SIGKILL, a non-zero exit) is started again after a growing pause
//! (100 ms, doubling, at most 5 s), at most `[supervision.node]` `max_restarts` times within
//! `within_secs` (then it stays down, with an error naming it). A node that exits 0 drained on
//! purpose (SIGTERM) and is not restarted; one that exits with `EXIT_RESTART` (75) drained to be
//! restarted (`duet rollout`) and starts again at once, from the binary installed now.
//! `duet tree` shows each node's process restarts.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::process::{ExitCode, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use duet_runtime::config::{ClusterConfig, RestartPolicy};
use duet_runtime::credentials::Credentials;
use duet_runtime::node::{EXIT_RESTART, PROCESS_RESTARTS_ENV, READY_MARKER, ShutdownSignals};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::sync::mpsc;

/// How long nodes get to report ready.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long draining nodes get before they are killed.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(15);
/// Log lines kept per node to explain a failed start.
const KEPT_LINES: usize = 40;
/// The first pause before a dead node is started again, and the longest.
const RESTART_PAUSE: Duration = Duration::from_millis(100);
const RESTART_PAUSE_MAX: Duration = Duration::from_secs(5);

enum Event {
    Ready(String),
    /// A node process ended: its name, how, and which start of it that was.
    Exited(String, Result<ExitStatus, String>, u32),
    /// A dead node's pause is over: start it again.
    Restart(String),
}

struct Proc {
    name: String,
    pid: Option<u32>,
    running: bool,
    log: Arc<Mutex<VecDeque<String>>>,
    /// Times its process was started again after it died.
    restarts: u32,
    /// When those restarts happened (the restart intensity's window).
    recent: VecDeque<Instant>,
}

/// Starts node processes and watches them.
struct Launcher {
    exe: PathBuf,
    config: PathBuf,
    events: mpsc::UnboundedSender<Event>,
    progress: MultiProgress,
}

impl Launcher {
    /// Starts node `name` (its `restarts`-th restart), forwarding its logs and reporting its
    /// readiness and its end as events.
    fn spawn(&self, name: &str, restarts: u32) -> std::io::Result<Proc> {
        let mut child = Command::new(&self.exe)
            .arg("node")
            .arg("--config")
            .arg(&self.config)
            .arg("--name")
            .arg(name)
            .env(PROCESS_RESTARTS_ENV, restarts.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let log = Arc::new(Mutex::new(VecDeque::new()));
        if let Some(out) = child.stdout.take() {
            let (events, name) = (self.events.clone(), name.to_string());
            tokio::spawn(async move {
                let mut lines = BufReader::new(out).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if line.starts_with(READY_MARKER) {
                        let _ = events.send(Event::Ready(name.clone()));
                    }
                }
            });
        }
        if let Some(err) = child.stderr.take() {
            let (log, name, progress) = (log.clone(), name.to_string(), self.progress.clone());
            tokio::spawn(async move {
                let mut lines = BufReader::new(err).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    progress.suspend(|| eprintln!("[{name}] {line}"));
                    let mut log = log.lock().unwrap_or_else(|p| p.into_inner());
                    if log.len() == KEPT_LINES {
                        log.pop_front();
                    }
                    log.push_back(line);
                }
            });
        }
        let pid = child.id();
        let (events, n) = (self.events.clone(), name.to_string());
        tokio::spawn(async move {
            let status = child.wait().await.map_err(|e| e.to_string());
            let _ = events.send(Event::Exited(n, status, restarts));
        });
        Ok(Proc {
            name: name.to_string(),
            pid,
            running: true,
            log,
            restarts,
            recent: VecDeque::new(),
        })
    }
}

fn describe(status: &Result<ExitStatus, String>) -> String {
    match status {
        Ok(s) => s.to_string(),
        Err(e) => e.clone(),
    }
}

/// Runs `duet up`.
/// `duet serve`: writes a one-router, one-worker cluster file (loopback only, credentials
/// beside it) into a private temporary folder and runs it as `duet up` does.
pub async fn serve(model: Option<PathBuf>, port: u16, name: Option<String>) -> ExitCode {
    let model = match model {
        Some(m) => match std::path::absolute(&m) {
            Ok(m) if m.exists() => m,
            _ => {
                eprintln!("error: --model {}: no such file", m.display());
                return ExitCode::from(2);
            }
        },
        None => match std::path::absolute(PathBuf::from("models").join(duet_fetch::MODEL_FILE)) {
            Ok(m) => m,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    let name = name.unwrap_or_else(|| {
        if model.ends_with(duet_fetch::MODEL_FILE) {
            "SmolLM2-135M-Instruct".to_string()
        } else {
            model
                .file_stem()
                .map_or_else(|| "model".to_string(), |f| f.to_string_lossy().into_owned())
        }
    });
    let dir = match tempfile::Builder::new().prefix("duet-serve-").tempdir() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: cannot make a folder for the cluster file: {e}");
            return ExitCode::FAILURE;
        }
    };
    let ports = duet_runtime::testing::free_loopback_ports(2);
    // TOML strings: the path and name escaped as JSON strings are valid TOML basic strings.
    let quote = |s: &str| serde_json::Value::String(s.to_string()).to_string();
    let text = format!(
        "[cluster]\nname = \"duet-serve\"\n[serving]\nmodel = {}\nmodel_name = {}\n\
         http = \"127.0.0.1:{port}\"\n\
         [[node]]\nname = \"router\"\nrole = \"router\"\naddress = \"127.0.0.1:{}\"\n\
         [[node]]\nname = \"w0\"\nrole = \"decode\"\naddress = \"127.0.0.1:{}\"\n",
        quote(&model.to_string_lossy()),
        quote(&name),
        ports[0],
        ports[1],
    );
    let config = dir.path().join("cluster.toml");
    if let Err(e) = std::fs::write(&config, text) {
        eprintln!("error: {}: {e}", config.display());
        return ExitCode::FAILURE;
    }
    eprintln!(
        "serving {} as `{name}` (cluster file {})",
        model.display(),
        config.display()
    );
    run(&config).await
}

pub async fn run(config_path: &Path) -> ExitCode {
    let mut signals = ShutdownSignals::new();
    let config = match ClusterConfig::load(config_path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match Credentials::ensure(&config.credentials) {
        Ok((_, true)) => eprintln!(
            "created the cluster credentials (certificate, key, token) next to {}",
            config.credentials.token_file.display()
        ),
        Ok((_, false)) => {}
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    }
    // Every worker's device and KV transport open on this machine, or nothing starts: a
    // `cuda:0` without a driver, or `rdma` without a device, is a configuration error naming
    // the node, not a node that dies and restarts.
    for n in config
        .nodes
        .iter()
        .filter(|n| n.role != duet_runtime::config::Role::Router)
    {
        let device = duet_actors::settings::ServingConfig::for_node(&config, &n.name)
            .and_then(|s| s.check_start(&config));
        if let Err(e) = device {
            eprintln!("error: node {}: {e}", n.name);
            return ExitCode::from(2);
        }
    }
    // Fetch the model once here, with a progress bar, rather than in every node at once.
    let missing_model = duet_actors::settings::ServingConfig::from_cluster(&config)
        .ok()
        .map(|s| s.model)
        .filter(|m| !m.exists() && m.ends_with(duet_fetch::MODEL_FILE));
    if let Some(model) = missing_model
        && let Err(e) = crate::generate::fetch_into(&model)
    {
        eprintln!("error: cannot fetch the model: {e}");
        return ExitCode::FAILURE;
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("error: cannot find the duet executable: {e}");
            return ExitCode::FAILURE;
        }
    };

    let progress = MultiProgress::new();
    let style = ProgressStyle::with_template("{spinner} {prefix:>10} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    let (events, mut rx) = mpsc::unbounded_channel();
    let launcher = Launcher {
        exe,
        config: config.path.clone(),
        events,
        progress: progress.clone(),
    };
    let mut procs = Vec::new();
    let mut bars = HashMap::new();
    for node in &config.nodes {
        let bar = progress.add(ProgressBar::new_spinner());
        bar.set_style(style.clone());
        bar.set_prefix(node.name.clone());
        bar.set_message(format!("starting ({}, {})", node.role, node.address));
        bar.enable_steady_tick(Duration::from_millis(100));
        bars.insert(node.name.clone(), bar);
        match launcher.spawn(&node.name, 0) {
            Ok(p) => procs.push(p),
            Err(e) => {
                progress.suspend(|| eprintln!("error: cannot start node {}: {e}", node.name));
                stop_all(&mut procs, &mut rx).await;
                return ExitCode::FAILURE;
            }
        }
    }

    // Start-up: every node ready, or the first failure stops the rest.
    let mut ready = 0;
    let deadline = tokio::time::sleep(START_TIMEOUT);
    tokio::pin!(deadline);
    while ready < procs.len() {
        tokio::select! {
            event = rx.recv() => match event {
                Some(Event::Ready(name)) => {
                    ready += 1;
                    if let Some(bar) = bars.get(&name) {
                        bar.finish_with_message("ready");
                    }
                }
                Some(Event::Exited(name, status, _)) => {
                    mark_exited(&mut procs, &name);
                    // Give the stderr reader a moment to drain the last lines.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    let reason = failure_reason(&procs, &name, &describe(&status));
                    progress.clear().ok();
                    eprintln!("error: node {name} failed to start: {reason}");
                    stop_all(&mut procs, &mut rx).await;
                    return ExitCode::FAILURE;
                }
                Some(Event::Restart(_)) => {}
                None => return ExitCode::FAILURE,
            },
            _ = &mut deadline => {
                progress.clear().ok();
                let late: Vec<_> = procs.iter().filter(|p| !bars[&p.name].is_finished()).map(|p| p.name.clone()).collect();
                eprintln!("error: nodes {} did not report ready within {START_TIMEOUT:?}", late.join(", "));
                stop_all(&mut procs, &mut rx).await;
                return ExitCode::FAILURE;
            }
            _ = signals.recv() => {
                progress.clear().ok();
                stop_all(&mut procs, &mut rx).await;
                return ExitCode::SUCCESS;
            }
        }
    }
    progress.clear().ok();
    let admins: Vec<String> = config
        .nodes
        .iter()
        .map(|n| format!("{}=http://{}", n.name, n.admin))
        .collect();
    // The OpenAI-compatible base URL of the first router, when the cluster has one.
    let url = config
        .nodes
        .iter()
        .find(|n| n.role == duet_runtime::config::Role::Router)
        .and_then(|r| duet_actors::settings::ServingConfig::for_node(&config, &r.name).ok())
        .map(|s| format!("http://{} ", s.http))
        .unwrap_or_default();
    println!(
        "ready {url}cluster={} nodes={} admin={}",
        config.name,
        config.nodes.len(),
        admins.join(",")
    );

    // Serving: forward logs until a signal; start dead nodes again.
    let policy = config.supervision.policy("node");
    loop {
        tokio::select! {
            event = rx.recv() => match event {
                Some(Event::Exited(name, status, start)) => {
                    let Some(p) = procs.iter_mut().find(|p| p.name == name) else { continue };
                    if p.restarts != start {
                        continue; // an earlier process of the node, already replaced
                    }
                    p.running = false;
                    let how = describe(&status);
                    if status.as_ref().is_ok_and(ExitStatus::success) {
                        eprintln!("warning: node {name} exited ({how}): it drained; not restarting it");
                    } else if status.as_ref().is_ok_and(|s| s.code() == Some(i32::from(EXIT_RESTART))) {
                        // Asked to restart (`duet rollout`): at once, on the binary installed
                        // now, and not a crash (the restart intensity does not count it).
                        eprintln!("node {name} drained to restart; starting it again");
                        let _ = launcher.events.send(Event::Restart(name.clone()));
                    } else {
                        schedule_restart(p, &policy, &how, &launcher.events);
                    }
                    if procs.iter().all(|p| !p.running && p.recent.is_empty()) {
                        eprintln!("error: every node has exited");
                        return ExitCode::FAILURE;
                    }
                }
                Some(Event::Restart(name)) => {
                    let Some(i) = procs.iter().position(|p| p.name == name) else { continue };
                    let restarts = procs[i].restarts + 1;
                    match launcher.spawn(&name, restarts) {
                        Ok(mut fresh) => {
                            eprintln!("restarting node {name} (process restart {restarts})");
                            fresh.recent = std::mem::take(&mut procs[i].recent);
                            procs[i] = fresh;
                        }
                        Err(e) => eprintln!("error: cannot restart node {name}: {e}"),
                    }
                }
                Some(Event::Ready(name)) => {
                    if let Some(p) = procs.iter().find(|p| p.name == name && p.restarts > 0) {
                        eprintln!("node {name} is back (process restart {})", p.restarts);
                    }
                }
                None => return ExitCode::FAILURE,
            },
            _ = signals.recv() => {
                eprintln!("draining {} nodes", procs.iter().filter(|p| p.running).count());
                stop_all(&mut procs, &mut rx).await;
                return ExitCode::SUCCESS;
            }
        }
    }
}

/// A node's process died: start it again after a growing pause, unless it died more than
/// the policy allows within its window (then it stays down, and `recent` is cleared).
fn schedule_restart(
    p: &mut Proc,
    policy: &RestartPolicy,
    how: &str,
    events: &mpsc::UnboundedSender<Event>,
) {
    let now = Instant::now();
    while p
        .recent
        .front()
        .is_some_and(|t| now.duration_since(*t) > policy.within)
    {
        p.recent.pop_front();
    }
    if p.recent.len() >= policy.max_restarts as usize {
        eprintln!(
            "error: node {} died {} times within {:?} (it died again: {how}); not restarting it \
             ([supervision.node] allows {})",
            p.name,
            p.recent.len() + 1,
            policy.within,
            policy.max_restarts
        );
        p.recent.clear();
        return;
    }
    let pause = RESTART_PAUSE
        .saturating_mul(1 << p.recent.len().min(16))
        .min(RESTART_PAUSE_MAX);
    eprintln!(
        "warning: node {} died ({how}); starting it again in {pause:?}",
        p.name
    );
    p.recent.push_back(now);
    let (events, name) = (events.clone(), p.name.clone());
    tokio::spawn(async move {
        tokio::time::sleep(pause).await;
        let _ = events.send(Event::Restart(name));
    });
}

fn mark_exited(procs: &mut [Proc], name: &str) {
    if let Some(p) = procs.iter_mut().find(|p| p.name == name) {
        p.running = false;
    }
}

fn failure_reason(procs: &[Proc], name: &str, status: &str) -> String {
    let Some(p) = procs.iter().find(|p| p.name == name) else {
        return status.to_string();
    };
    let log = p.log.lock().unwrap_or_else(|p| p.into_inner());
    let line = log
        .iter()
        .rev()
        .find(|l| l.starts_with("error:"))
        .or_else(|| log.back());
    match line {
        Some(l) => format!("{} ({status})", l.trim_start_matches("error: ")),
        None => format!("crashed ({status})"),
    }
}

/// SIGTERM to every running node; SIGKILL to those still running after the drain timeout.
async fn stop_all(procs: &mut [Proc], rx: &mut mpsc::UnboundedReceiver<Event>) {
    let signal = |p: &Proc, sig| {
        if let Some(pid) = p.pid.and_then(|pid| i32::try_from(pid).ok()) {
            let _ = kill(Pid::from_raw(pid), sig);
        }
    };
    for p in procs.iter().filter(|p| p.running) {
        signal(p, Signal::SIGTERM);
    }
    let deadline = tokio::time::sleep(DRAIN_TIMEOUT);
    tokio::pin!(deadline);
    while procs.iter().any(|p| p.running) {
        tokio::select! {
            event = rx.recv() => match event {
                Some(Event::Exited(name, _, start)) => {
                    if procs.iter().any(|p| p.name == name && p.restarts == start) {
                        mark_exited(procs, &name);
                    }
                }
                Some(Event::Ready(_) | Event::Restart(_)) => {}
                None => break,
            },
            _ = &mut deadline => {
                for p in procs.iter().filter(|p| p.running) {
                    eprintln!("warning: node {} did not drain within {DRAIN_TIMEOUT:?}; killing it", p.name);
                    signal(p, Signal::SIGKILL);
                }
                break;
            }
        }
    }
}
