//! The clusters the interference experiment starts and stops itself, one `duet node`
//! process per node (workers pinned to a core each where `taskset` is installed), and what it
//! reads from them before they stop: the decode worker's engine steps and KV checks, and the
//! prefill worker's engine time.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};

use duet_runtime::metrics as m;

use super::experiment::Params;
use super::prom::{labelled, quantile};

/// The workers' series' labels.
const DECODE: &str = "role=\"decode\"";
const PREFILL: &str = "role=\"prefill\"";

/// The decode worker's engine steps over one run (its `duet_engine_step_*` metrics, read
/// from its admin API before the cluster stops): what a steady sequence's gap is made of.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct DecodeSteps {
    /// Steps computed.
    pub steps: u64,
    /// Their mean time, ms.
    pub mean_ms: f64,
    /// Tokens per step, mean (the batch, with any prompt chunk computed on decode).
    pub tokens_mean: f64,
    /// KV positions attended per step, mean (what the attention grows with).
    pub attended_mean: f64,
    /// Step time, p50, ms (from the histogram's 10 % buckets).
    pub step_p50_ms: f64,
    /// Step time, p99, ms: over the p50, the jitter the engine itself shows, beside the gaps
    /// the clients saw.
    pub step_p99_ms: f64,
    /// Transfers whose KV decode checked against prefill's checksums.
    pub kv_checks: u64,
    /// Time one check spent hashing, mean, ms (summed over its turns).
    pub kv_check_ms_mean: f64,
    /// Engine turns one check was spread over, mean (`serving.kv_verify_step_mib` a step).
    pub kv_check_turns_mean: f64,
    /// KV bytes that came over TCP (zero when prefill wrote through shared memory).
    pub kv_tcp_bytes: u64,
}

impl DecodeSteps {
    /// From a node's Prometheus text (zero where the node computed nothing).
    fn from_metrics(text: &str) -> DecodeSteps {
        let value = |name: &str| labelled(text, name, DECODE);
        // The worker's own series (no role label).
        let unlabelled = |name: &str| labelled(text, name, "");
        let steps = value(&format!("{}_count", m::ENGINE_STEP));
        let per = |total: f64, n: f64| if n > 0.0 { total / n } else { 0.0 };
        let checks = unlabelled(&format!("{}_count", m::KV_VERIFY));
        let step_ms = |q| quantile(text, m::ENGINE_STEP, DECODE, q).map_or(0.0, |s| s * 1e3);
        DecodeSteps {
            steps: steps as u64,
            mean_ms: per(value(&format!("{}_sum", m::ENGINE_STEP)) * 1e3, steps),
            tokens_mean: per(value(&format!("{}_sum", m::ENGINE_STEP_TOKENS)), steps),
            attended_mean: per(value(&format!("{}_sum", m::ENGINE_STEP_ATTENDED)), steps),
            step_p50_ms: step_ms(0.5),
            step_p99_ms: step_ms(0.99),
            kv_checks: checks as u64,
            kv_check_ms_mean: per(unlabelled(&format!("{}_sum", m::KV_VERIFY)) * 1e3, checks),
            kv_check_turns_mean: per(unlabelled(&format!("{}_sum", m::KV_VERIFY_TURNS)), checks),
            kv_tcp_bytes: unlabelled(m::KV_BYTES_RECEIVED) as u64,
        }
    }
}

/// The gaps between a stream's tokens as the router forwarded them, every stream's
/// (`duet_router_itl_seconds`): the decode step plus the hop to the router, without the HTTP
/// hop to the client.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct RouterItl {
    /// p50, ms.
    pub p50_ms: f64,
    /// p99, ms.
    pub p99_ms: f64,
}

impl RouterItl {
    fn from_metrics(text: &str) -> RouterItl {
        let ms = |q| quantile(text, m::ROUTER_ITL, "", q).map_or(0.0, |s| s * 1e3);
        RouterItl {
            p50_ms: ms(0.5),
            p99_ms: ms(0.99),
        }
    }
}

/// The prefill worker's engine steps over one run (zero when there is none: colocated):
/// what a prompt's prefill costs inside the cluster, beside the same prompt alone.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct PrefillSteps {
    /// Steps computed.
    pub steps: u64,
    /// Their time, summed, ms.
    pub busy_ms: f64,
    /// Prompt tokens they computed.
    pub tokens: u64,
}

impl PrefillSteps {
    fn from_metrics(text: &str) -> PrefillSteps {
        let value = |name: &str| labelled(text, name, PREFILL);
        PrefillSteps {
            steps: value(&format!("{}_count", m::ENGINE_STEP)) as u64,
            busy_ms: value(&format!("{}_sum", m::ENGINE_STEP)) * 1e3,
            tokens: value(&format!("{}_sum", m::ENGINE_STEP_TOKENS)) as u64,
        }
    }

    /// What `tokens` prompt tokens took on average inside the cluster, ms.
    pub fn ms_for(&self, tokens: usize) -> f64 {
        match self.tokens {
            0 => 0.0,
            n => self.busy_ms / n as f64 * tokens as f64,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    Colocated,
    Disaggregated,
}

impl Mode {
    pub(super) fn name(self) -> &'static str {
        match self {
            Mode::Colocated => "colocated",
            Mode::Disaggregated => "disaggregated",
        }
    }
}

/// A cluster this command started: one `duet node` process per node.
pub(super) struct Cluster {
    pub(super) http: std::net::SocketAddr,
    nodes: Vec<tokio::process::Child>,
    /// Its `cluster.toml`.
    config: PathBuf,
}

impl Cluster {
    pub(super) async fn start(mode: Mode, p: &Params, dir: &Path) -> Result<Cluster, String> {
        let ports = duet_runtime::testing::free_loopback_ports(4);
        let http = std::net::SocketAddr::from(([127, 0, 0, 1], ports[0]));
        let folder = dir.join(mode.name());
        std::fs::create_dir_all(&folder).map_err(|e| e.to_string())?;
        let two = p.cores >= 2;
        let (workers, tables) = match mode {
            Mode::Colocated => (
                vec![("d0", "decode", ports[2], None)],
                format!("[serving.node.d0]\nthreads = {}\n", p.cores.clamp(1, 2)),
            ),
            Mode::Disaggregated => (
                vec![
                    ("p0", "prefill", ports[2], two.then_some(0)),
                    ("d0", "decode", ports[3], two.then_some(1)),
                ],
                "[serving.node.p0]\nthreads = 1\n[serving.node.d0]\nthreads = 1\n".to_string(),
            ),
        };
        // Every prompt, the steady sequences' replacements too, is prefilled on the prefill
        // worker when there is one: a replacement prefilled on decode would stall the batch
        // exactly as colocated prefill does.
        let threshold = (p.steady_prompt / 2).max(1);
        let mut text = format!(
            "[cluster]\nname = \"bench-{}\"\n\n[serving]\nmodel = \"{}\"\nhttp = \"{http}\"\n\
             kv_pages = 1024\nmax_batch_tokens = {}\nmax_running = 64\ndisagg_threshold = {threshold}\nkv_transport = \"{}\"\nstep_log = \"steps\"\n{tables}\n\
             [[node]]\nname = \"router\"\nrole = \"router\"\naddress = \"127.0.0.1:{}\"\n",
            mode.name(),
            p.model,
            p.max_batch_tokens,
            p.kv_transport,
            ports[1]
        );
        for (name, role, port, _) in &workers {
            text.push_str(&format!(
                "[[node]]\nname = \"{name}\"\nrole = \"{role}\"\naddress = \"127.0.0.1:{port}\"\n"
            ));
        }
        let config = folder.join("cluster.toml");
        std::fs::write(&config, text).map_err(|e| e.to_string())?;
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let status = tokio::process::Command::new(&exe)
            .args(["credentials", "--config"])
            .arg(&config)
            .stdout(Stdio::null())
            .status()
            .await
            .map_err(|e| e.to_string())?;
        if !status.success() {
            return Err("cannot create the cluster credentials".into());
        }
        let mut nodes = Vec::new();
        let mut all: Vec<(&str, Option<usize>)> = vec![("router", None)];
        all.extend(workers.iter().map(|(n, _, _, cpu)| (*n, *cpu)));
        for (name, cpu) in all {
            let mut child = pinned(&exe, cpu)
                .args(["node", "--config"])
                .arg(&config)
                .args(["--name", name])
                .env("DUET_LOG", "warn")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| format!("start {name}: {e}"))?;
            let stdout = child.stdout.take().ok_or("no stdout")?;
            let mut lines = BufReader::new(stdout).lines();
            let ready = tokio::time::timeout(Duration::from_secs(120), async {
                while let Ok(Some(line)) = lines.next_line().await {
                    if line.starts_with(duet_runtime::node::READY_MARKER) {
                        return true;
                    }
                }
                false
            })
            .await
            .unwrap_or(false);
            if !ready {
                return Err(format!("node {name} did not start"));
            }
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
            nodes.push(child);
        }
        let cluster = Cluster {
            http,
            nodes,
            config,
        };
        // Ready when every worker reported to the router.
        let want = format!("\"workers\":{}", workers.len());
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok((_, body)) = duet_runtime::admin::client::exchange(
                http,
                "",
                duet_runtime::admin::client::Method::GET,
                "/ready",
                None,
                Duration::from_secs(2),
            )
            .await
                && String::from_utf8_lossy(&body).contains(&want)
            {
                return Ok(cluster);
            }
            if Instant::now() > deadline {
                cluster.stop().await;
                return Err(format!("the {} cluster never became ready", mode.name()));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The decode worker's steps so far (zero if its metrics cannot be read: the run's other
    /// figures stand without them).
    pub(super) async fn decode_steps(&self) -> DecodeSteps {
        use duet_runtime::config::Role;
        self.metrics_of(Role::Decode)
            .await
            .map_or_else(DecodeSteps::default, |t| DecodeSteps::from_metrics(&t))
    }

    /// The router's inter-token gaps so far (zero if its metrics cannot be read).
    pub(super) async fn router_itl(&self) -> RouterItl {
        use duet_runtime::config::Role;
        self.metrics_of(Role::Router)
            .await
            .map_or_else(RouterItl::default, |t| RouterItl::from_metrics(&t))
    }

    /// The prefill worker's steps so far (zero without one, or if its metrics cannot be read).
    pub(super) async fn prefill_steps(&self) -> PrefillSteps {
        use duet_runtime::config::Role;
        self.metrics_of(Role::Prefill)
            .await
            .map_or_else(PrefillSteps::default, |t| PrefillSteps::from_metrics(&t))
    }

    /// The Prometheus text of the cluster's first node of `role`, from its admin API.
    async fn metrics_of(&self, role: duet_runtime::config::Role) -> Option<String> {
        use duet_runtime::config::ClusterConfig;
        let config = ClusterConfig::load(&self.config).ok()?;
        let node = config.nodes.iter().find(|n| n.role == role)?;
        let creds = duet_runtime::credentials::Credentials::load(&config.credentials).ok()?;
        let token = creds.token.expose();
        duet_runtime::admin::client::metrics_text(node.admin, token, Duration::from_secs(5))
            .await
            .ok()
    }

    /// Node `name`'s engine steps, from its step log (empty when it logged none).
    pub(super) fn steps(&self, name: &str) -> Vec<duet_actors::step_log::StepRecord> {
        let dir = self.config.parent().unwrap_or(Path::new(".")).join("steps");
        duet_actors::step_log::read(&duet_actors::step_log::path(&dir, name)).unwrap_or_default()
    }

    pub(super) async fn stop(mut self) {
        for n in &self.nodes {
            if let Some(pid) = n.id() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
        }
        for n in &mut self.nodes {
            if tokio::time::timeout(Duration::from_secs(15), n.wait())
                .await
                .is_err()
            {
                let _ = n.kill().await;
            }
        }
    }
}

/// A command running `exe`, on core `cpu` when one is given and `taskset` is installed.
pub(super) fn pinned(exe: &Path, cpu: Option<usize>) -> tokio::process::Command {
    match cpu.filter(|_| which("taskset")) {
        Some(cpu) => {
            let mut c = tokio::process::Command::new("taskset");
            c.arg("-c").arg(cpu.to_string()).arg(exe);
            c
        }
        None => tokio::process::Command::new(exe),
    }
}

fn which(program: &str) -> bool {
    std::process::Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}
