//! `duet up`: every node of a cluster file as a child process of this one.
//!
//! Shows start-up progress, prints one line beginning with `ready` once every node reported
//! ready, forwards the nodes' logs (prefixed with the node name), and on Ctrl-C or SIGTERM
//! asks every node to drain (SIGTERM), killing those that outlive the drain timeout. If a
//! node fails to start, the others are stopped and `duet up` exits non-zero naming the node
//! and its reason.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::process::{ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use duet_runtime::config::ClusterConfig;
use duet_runtime::credentials::Credentials;
use duet_runtime::node::{READY_MARKER, ShutdownSignals};
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

enum Event {
    Ready(String),
    Exited(String, String),
}

struct Proc {
    name: String,
    pid: Option<u32>,
    running: bool,
    log: Arc<Mutex<VecDeque<String>>>,
}

/// Runs `duet up`.
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
    // Fetch the model once here, with a progress bar, rather than in every node at once.
    let missing_model = duet_actors::settings::ServingConfig::from_cluster(&config)
        .ok()
        .map(|s| s.model)
        .filter(|m| !m.exists() && m.ends_with(duet_engine::fetch::MODEL_FILE));
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
    let mut procs = Vec::new();
    let mut bars = HashMap::new();
    for node in &config.nodes {
        let bar = progress.add(ProgressBar::new_spinner());
        bar.set_style(style.clone());
        bar.set_prefix(node.name.clone());
        bar.set_message(format!("starting ({}, {})", node.role, node.address));
        bar.enable_steady_tick(Duration::from_millis(100));
        bars.insert(node.name.clone(), bar);
        let spawned = Command::new(&exe)
            .arg("node")
            .arg("--config")
            .arg(&config.path)
            .arg("--name")
            .arg(&node.name)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                progress.suspend(|| eprintln!("error: cannot start node {}: {e}", node.name));
                stop_all(&mut procs, &mut rx).await;
                return ExitCode::FAILURE;
            }
        };
        let log = Arc::new(Mutex::new(VecDeque::new()));
        if let Some(out) = child.stdout.take() {
            let (events, name) = (events.clone(), node.name.clone());
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
            let (log, name, progress) = (log.clone(), node.name.clone(), progress.clone());
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
        let (events, name) = (events.clone(), node.name.clone());
        tokio::spawn(async move {
            let status = match child.wait().await {
                Ok(s) => s.to_string(),
                Err(e) => e.to_string(),
            };
            let _ = events.send(Event::Exited(name, status));
        });
        procs.push(Proc {
            name: node.name.clone(),
            pid,
            running: true,
            log,
        });
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
                Some(Event::Exited(name, status)) => {
                    mark_exited(&mut procs, &name);
                    // Give the stderr reader a moment to drain the last lines.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    let reason = failure_reason(&procs, &name, &status);
                    progress.clear().ok();
                    eprintln!("error: node {name} failed to start: {reason}");
                    stop_all(&mut procs, &mut rx).await;
                    return ExitCode::FAILURE;
                }
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
    // The OpenAI-compatible base URL, when the cluster has a router.
    let url = duet_actors::settings::ServingConfig::from_cluster(&config)
        .ok()
        .filter(|_| {
            config
                .nodes
                .iter()
                .any(|n| n.role == duet_runtime::config::Role::Router)
        })
        .map(|s| format!("http://{} ", s.http))
        .unwrap_or_default();
    println!(
        "ready {url}cluster={} nodes={} admin={}",
        config.name,
        config.nodes.len(),
        admins.join(",")
    );

    // Serving: forward logs until a signal; report nodes that exit.
    loop {
        tokio::select! {
            event = rx.recv() => match event {
                Some(Event::Exited(name, status)) => {
                    mark_exited(&mut procs, &name);
                    eprintln!("warning: node {name} exited ({status})");
                    if procs.iter().all(|p| !p.running) {
                        eprintln!("error: every node has exited");
                        return ExitCode::FAILURE;
                    }
                }
                Some(Event::Ready(_)) => {}
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
                Some(Event::Exited(name, _)) => mark_exited(procs, &name),
                Some(Event::Ready(_)) => {}
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
