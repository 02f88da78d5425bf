//! Shared harness for the integration tests: real `duet` processes on loopback.
//!
//! Nothing here sleeps to wait for state: [`poll`] retries a probe until it holds or its
//! deadline passes, and every process is stopped when its guard drops.

#![allow(dead_code)] // each test binary uses a different part of the harness

pub mod fleet;
pub mod hosts;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use duet_runtime::admin::client::{self, Method};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// The real model (SmolLM2-135M Q4_1) under `models/`, fetched if missing.
pub fn real_model() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(duet_fetch::MODEL_FILE);
    duet_fetch::ensure_model(&path, &mut |_| {}).expect("the real model (duet fetch-model)")
}

/// The model the router on `http` serves, as `/v1/models` names it (every request must name
/// it, as the OpenAI API requires). Remembered per port; [`forget_model`] drops it (a later
/// cluster on the same port may serve another model).
pub fn served_model(http: u16) -> String {
    if let Some((_, m)) = SERVED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .find(|(p, _)| *p == http)
    {
        return m.clone();
    }
    // A router busy starting or restarting may not answer at once: ask a few times.
    for _ in 0..20 {
        let out = std::process::Command::new("curl")
            .args(["-s", "--max-time", "5"])
            .arg(format!("http://127.0.0.1:{http}/v1/models"))
            .output()
            .expect("curl");
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        if let Some(model) = v["data"][0]["id"].as_str() {
            SERVED
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((http, model.to_string()));
            return model.to_string();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    "unknown".to_string()
}

/// The models seen per router port.
static SERVED: std::sync::Mutex<Vec<(u16, String)>> = std::sync::Mutex::new(Vec::new());

/// Forgets the model remembered for `http`.
pub fn forget_model(http: u16) {
    SERVED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|(p, _)| *p != http);
}

/// What `curl -s -w "\n%{http_code}"` printed: the status and the body (`Null` when it is not
/// JSON).
pub fn status_and_json(stdout: &[u8]) -> (u16, Value) {
    let text = String::from_utf8_lossy(stdout).into_owned();
    let (json_text, code) = text.rsplit_once('\n').unwrap_or((&text, "0"));
    (
        code.trim().parse().unwrap_or(0),
        serde_json::from_str(json_text).unwrap_or(Value::Null),
    )
}

/// `body` naming the served model, unless it names one (or is not an object).
pub fn with_model(http: u16, body: &Value) -> Value {
    let mut body = body.clone();
    if let Some(o) = body.as_object_mut()
        && !o.contains_key("model")
    {
        o.insert("model".into(), Value::String(served_model(http)));
    }
    body
}

/// One `/v1/completions` request through curl (a real HTTP client): the status and the body
/// (`Null` when it is not JSON). The body names the served model unless it names one.
pub async fn curl_completion(http: u16, body: &Value) -> (u16, Value) {
    let named = body.get("model").is_some();
    let (code, v) = curl_completion_once(http, &with_model(http, body)).await;
    if !named && code == 404 && v["error"]["code"] == "model_not_found" {
        // The port's earlier cluster served another model: ask this one.
        forget_model(http);
        return curl_completion_once(http, &with_model(http, body)).await;
    }
    (code, v)
}

async fn curl_completion_once(http: u16, body: &Value) -> (u16, Value) {
    use tokio::io::AsyncWriteExt;
    // The body goes through stdin: a command-line argument is limited to 128 KiB.
    let mut curl = Command::new("curl")
        .args(["-s", "--max-time", "120", "-w", "\n%{http_code}", "-H"])
        .arg("content-type: application/json")
        .args(["--data-binary", "@-"])
        .arg(format!("http://127.0.0.1:{http}/v1/completions"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("curl");
    if let Some(mut stdin) = curl.stdin.take() {
        stdin
            .write_all(body.to_string().as_bytes())
            .await
            .expect("curl's stdin");
    }
    let out = curl.wait_with_output().await.expect("curl");
    status_and_json(&out.stdout)
}

/// A streaming `/v1/completions` request through curl (`-N`: no buffering), its body to
/// `stdout`; killed when dropped (a client that leaves).
pub fn curl_stream(http: u16, body: &Value, stdout: Stdio) -> Child {
    let body = with_model(http, body);
    Command::new("curl")
        .args(["-s", "-N", "--max-time", "600", "-H"])
        .arg("content-type: application/json")
        .arg("-d")
        .arg(body.to_string())
        .arg(format!("http://127.0.0.1:{http}/v1/completions"))
        .stdout(stdout)
        .kill_on_drop(true)
        .spawn()
        .expect("curl")
}

/// The `duet` binary under test.
pub fn duet_bin() -> &'static str {
    env!("CARGO_BIN_EXE_duet")
}

pub use duet_runtime::testing::free_loopback_ports as free_ports;

/// A cluster file in its own temporary folder.
pub struct ClusterDir {
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    pub nodes: Vec<(String, String, u16)>,
    /// The router's HTTP port (used when `extra` has no `[serving]` table of its own).
    pub http: u16,
}

impl ClusterDir {
    /// Nodes `(name, role)` on fresh ports, plus `extra` TOML before the node tables. Unless
    /// `extra` has its own `[serving]` table, the cluster serves the tiny model (written into
    /// the folder) on a fresh HTTP port: runtime tests get real serving actors that load in
    /// milliseconds.
    pub fn new(nodes: &[(&str, &str)], extra: &str) -> ClusterDir {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut ports = free_ports(nodes.len() + 1);
        let http = ports.pop().expect("a port");
        let nodes: Vec<(String, String, u16)> = nodes
            .iter()
            .zip(ports)
            .map(|((n, r), port)| (n.to_string(), r.to_string(), port))
            .collect();
        std::fs::write(
            dir.path().join("tiny.gguf"),
            duet_engine::tiny::tiny_model_bytes(1),
        )
        .expect("tiny model");
        let config = dir.path().join("cluster.toml");
        let me = ClusterDir {
            dir,
            config,
            nodes,
            http,
        };
        me.write("cluster.toml", extra);
        me
    }

    /// Nodes `(name, role)` serving the tiny model, with `keys` (TOML lines) in `[serving]`.
    pub fn tiny(nodes: &[(&str, &str)], keys: &str) -> ClusterDir {
        let mut c = ClusterDir::new(nodes, "");
        c.config = c.write("cluster.toml", &c.tiny_serving(keys));
        c
    }

    /// Writes another cluster file over the same nodes (for a node with other credentials).
    pub fn write(&self, file: &str, extra: &str) -> PathBuf {
        let serving = if extra.contains("[serving]") {
            String::new()
        } else {
            self.tiny_serving("")
        };
        let mut text = format!("[cluster]\nname = \"test\"\n{serving}{extra}\n");
        for (name, role, port) in &self.nodes {
            text.push_str(&format!(
                "[[node]]\nname = \"{name}\"\nrole = \"{role}\"\naddress = \"127.0.0.1:{port}\"\n\n"
            ));
        }
        let path = self.dir.path().join(file);
        std::fs::write(&path, text).expect("write cluster file");
        path
    }

    /// A `[serving]` table for the tiny model on this cluster's HTTP port (32 KV pages), with
    /// `keys` (TOML lines) added.
    pub fn tiny_serving(&self, keys: &str) -> String {
        format!(
            "[serving]\nmodel = \"tiny.gguf\"\nmodel_name = \"tiny\"\nhttp = \"127.0.0.1:{}\"\n\
             kv_pages = 32\n{keys}",
            self.http
        )
    }

    /// A cluster file (`wrong.toml`) with `extra` and the right certificate and key, but a
    /// wrong token: a node started from it must be refused.
    pub fn wrong_token(&self, extra: &str) -> PathBuf {
        std::fs::write(
            self.dir.path().join("wrong-token"),
            "0000000000000000000000000000000000\n",
        )
        .expect("write token");
        self.write(
            "wrong.toml",
            &format!("{extra}[credentials]\ntoken_file = \"wrong-token\"\n"),
        )
    }

    /// The admin address of `node`.
    pub fn admin(&self, node: &str) -> SocketAddr {
        let port = self
            .nodes
            .iter()
            .find(|(n, _, _)| n == node)
            .map(|(_, _, p)| *p)
            .expect("known node");
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    /// The cluster token (after credentials exist).
    pub fn token(&self) -> String {
        std::fs::read_to_string(self.dir.path().join(".duet/token"))
            .expect("token")
            .trim()
            .to_string()
    }

    /// Creates the credentials for `config` (`duet credentials`).
    pub async fn credentials(&self, config: &Path) {
        let out = duet(&["credentials", "--config", path_str(config)]).await;
        assert!(
            out.status.success(),
            "duet credentials failed: {}",
            out.stderr
        );
    }
}

pub fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// A finished CLI run.
pub struct Output {
    pub status: std::process::ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `duet ARGS` to completion.
pub async fn duet(args: &[&str]) -> Output {
    let out = Command::new(duet_bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .expect("run duet");
    Output {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A long-running `duet` process (`up` or `node`), stopped with SIGTERM on drop.
pub struct Running {
    pub child: Child,
    pub first_line: String,
}

impl Running {
    /// Starts `duet ARGS` and waits (with a deadline) for a stdout line starting with `marker`.
    pub async fn start(args: &[&str], marker: &str) -> Running {
        Running::start_env(args, marker, &[]).await
    }

    /// [`Running::start`] with extra environment variables (fault injection hooks).
    pub async fn start_env(args: &[&str], marker: &str, env: &[(&str, &str)]) -> Running {
        let mut cmd = Command::new(duet_bin());
        cmd.args(args).envs(env.iter().copied());
        Running::spawn(cmd, &format!("duet {}", args.join(" ")), marker).await
    }

    /// Starts a prepared command (a `duet` on another host, say) and waits (with a deadline)
    /// for a stdout line starting with `marker`; `what` names it in failures.
    pub async fn spawn(mut cmd: Command, what: &str, marker: &str) -> Running {
        // DUET_TEST_LOG sets the nodes' log filter when a test needs more detail.
        let log = std::env::var("DUET_TEST_LOG").unwrap_or_else(|_| "info".to_string());
        let mut child = cmd
            .env("DUET_LOG", log)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn duet");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let wait = async {
            while let Ok(Some(line)) = lines.next_line().await {
                if line.starts_with(marker) {
                    return Some(line);
                }
            }
            None
        };
        let line = tokio::time::timeout(Duration::from_secs(60), wait)
            .await
            .unwrap_or_else(|_| panic!("`{what}` printed no `{marker}` line in 60 s"))
            .unwrap_or_else(|| panic!("`{what}` exited before `{marker}`"));
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Running {
            child,
            first_line: line,
        }
    }

    /// `duet up --config CONFIG`, until its `ready` line.
    pub async fn up(config: &Path) -> Running {
        Running::start(&["up", "--config", path_str(config)], "ready").await
    }

    /// `duet node --config CONFIG --name NAME`, until it reports ready.
    pub async fn node(config: &Path, name: &str) -> Running {
        Running::start(
            &["node", "--config", path_str(config), "--name", name],
            duet_runtime::node::READY_MARKER,
        )
        .await
    }

    pub fn pid(&self) -> i32 {
        self.child.id().expect("running child") as i32
    }

    /// SIGKILL: the process vanishes without draining.
    pub async fn kill_hard(mut self) {
        self.child.kill().await.expect("kill");
    }

    /// SIGTERM and wait for the exit status.
    pub async fn terminate(mut self) -> std::process::ExitStatus {
        signal(self.pid(), nix::sys::signal::Signal::SIGTERM);
        tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("exit within 30 s after SIGTERM")
            .expect("wait")
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(pid) = self.child.id() {
            // Let `duet up` drain its nodes; kill_on_drop is the backstop.
            signal(pid as i32, nix::sys::signal::Signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

fn signal(pid: i32, sig: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
}

/// Retries `probe` until it returns `Some`, or panics with `what` after `deadline`.
pub async fn poll<T, F, Fut>(what: &str, deadline: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        if start.elapsed() > deadline {
            panic!("timed out after {deadline:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (15 s at most) until the node at `admin` has refused a link for `reason` (`tls`,
/// `token`, `version`...), as `duet_link_handshake_failures_total` counts.
pub async fn handshake_refused(admin: SocketAddr, token: &str, reason: &str) {
    let label = format!("reason=\"{reason}\"");
    poll(
        &format!("a link refused ({reason}) at {admin}"),
        Duration::from_secs(15),
        || async {
            let n = metric(admin, token, "duet_link_handshake_failures_total", &label).await;
            (n > 0.0).then_some(())
        },
    )
    .await;
}

/// GET a JSON admin endpoint.
pub async fn admin_get(addr: SocketAddr, token: &str, path: &str) -> Option<Value> {
    client::call(addr, token, Method::GET, path, None, Duration::from_secs(3))
        .await
        .ok()
}

/// A peer's membership state (`up`, `down`, `unknown`) as `node` sees it.
pub async fn peer_state(addr: SocketAddr, token: &str, peer: &str) -> Option<String> {
    let v = admin_get(addr, token, "/v1/membership").await?;
    v["peers"][peer]["state"].as_str().map(str::to_string)
}

/// The value of a counter in a node's /metrics (sum over the label sets that match).
pub async fn metric(addr: SocketAddr, token: &str, name: &str, labels: &str) -> f64 {
    let text = client::metrics_text(addr, token, Duration::from_secs(3))
        .await
        .unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `duet tree --json` for `config`.
pub async fn tree_json(config: &Path) -> Value {
    let out = duet(&["tree", "--config", path_str(config), "--json"]).await;
    assert!(out.status.success(), "duet tree failed: {}", out.stderr);
    serde_json::from_str(&out.stdout).expect("tree JSON")
}

/// The actor at `path` in a `duet tree --json` answer.
pub fn find<'a>(tree: &'a Value, path: &str) -> Option<&'a Value> {
    fn walk<'a>(a: &'a Value, path: &str) -> Option<&'a Value> {
        if a["path"] == path {
            return Some(a);
        }
        a["children"].as_array()?.iter().find_map(|c| walk(c, path))
    }
    tree.as_array()?.iter().find_map(|n| walk(&n["root"], path))
}

/// Waits (with a deadline) until the router on `http` reports `workers` ready workers.
pub async fn router_ready(http: u16, workers: usize) {
    router_ready_with(http, workers, || Command::new("curl")).await;
}

/// [`router_ready`] with curl started by `curl` (on another host, say).
pub async fn router_ready_with(http: u16, workers: usize, curl: impl Fn() -> Command) {
    let want = format!("\"workers\":{workers}");
    poll("the workers ready", Duration::from_secs(120), || async {
        let out = curl()
            .args(["-s", "--max-time", "2"])
            .arg(format!("http://127.0.0.1:{http}/ready"))
            .output()
            .await
            .ok()?;
        String::from_utf8_lossy(&out.stdout)
            .contains(&want)
            .then_some(())
    })
    .await;
}

/// A folder for the cluster's transfer history (`DUET_HISTORY_DIR`).
pub fn history_dir(c: &ClusterDir) -> String {
    let dir = c.dir.path().join("history");
    std::fs::create_dir_all(&dir).expect("history folder");
    dir.display().to_string()
}

/// Runs the independent checker over a history; returns its report. Fails the test on any
/// violation, or when nothing was recorded.
pub async fn check_history(dir: &str) -> Value {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/check_history.py");
    let out = tokio::process::Command::new("python3")
        .arg(script)
        .arg(dir)
        .output()
        .await
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: Value = serde_json::from_str(stdout.trim()).unwrap_or(Value::Null);
    assert!(
        out.status.success(),
        "the history checker found violations: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        report["attempts"].as_u64() > Some(0),
        "no history recorded: {report}"
    );
    report
}

/// One completion through curl: `Ok(text)` on HTTP 200, `Err(status and body)` otherwise.
pub async fn complete(http: u16, body: Value) -> Result<String, String> {
    match curl_completion(http, &body).await {
        (200, v) => Ok(v["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string()),
        (code, v) => Err(format!("HTTP {code}: {v}")),
    }
}

/// Everything in flight has drained on `nodes`: no queue, no sequence, no pinned or
/// quarantined page, every page free or held only by a prefix cache.
pub async fn assert_quiet(c: &ClusterDir, nodes: &[&str]) {
    const HELD: [&str; 6] = [
        "duet_kv_pages_pinned",
        "duet_kv_pages_quarantined",
        "duet_sequences_running",
        "duet_sequences_waiting",
        "duet_bootstrap_queue",
        "duet_prealloc_queue",
    ];
    let token = c.token();
    for &node in nodes {
        let addr = c.admin(node);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let mut held = Vec::new();
            for name in HELD {
                let v = metric(addr, &token, name, "").await;
                if v != 0.0 {
                    held.push(format!("{name}={v}"));
                }
            }
            let total = metric(addr, &token, "duet_kv_pages_total", "").await;
            let free = metric(addr, &token, "duet_kv_pages_free", "").await;
            let cached = metric(addr, &token, "duet_kv_pages_cached", "").await;
            if total == 0.0 || free + cached != total {
                held.push(format!("pages total={total} free={free} cached={cached}"));
            }
            if held.is_empty() {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{node} still holds after 30 s: {held:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// What `duet generate` (the engine alone, in its own process, one thread, greedy) answers
/// with `args`: its `--json` object.
pub async fn generate_json(args: &[&str]) -> Value {
    let mut all = vec!["generate"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--threads", "1", "--json"]);
    let out = duet(&all).await;
    assert!(out.status.success(), "{}", out.stderr);
    serde_json::from_str(out.stdout.trim()).expect("generate --json")
}

/// What `duet generate` answers, greedily, to `prompt`.
pub async fn generate_reference(prompt: &str, max_tokens: usize) -> String {
    let v = generate_json(&[
        "--prompt",
        prompt,
        "--max-tokens",
        &max_tokens.to_string(),
        "--ignore-eos",
    ])
    .await;
    v["text"].as_str().expect("text").to_string()
}

/// A virtual environment with the `openai` package, made once per target directory (and once
/// per test process: the tests of this file would otherwise race to create it).
pub async fn openai_python() -> PathBuf {
    static PYTHON: tokio::sync::OnceCell<PathBuf> = tokio::sync::OnceCell::const_new();
    PYTHON.get_or_init(make_openai_python).await.clone()
}

async fn make_openai_python() -> PathBuf {
    let venv = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
    let python = venv.join("bin/python");
    let ok = tokio::process::Command::new(&python)
        .args(["-c", "import openai"])
        .status()
        .await
        .is_ok_and(|s| s.success());
    if !ok {
        let made = tokio::process::Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .await
            .expect("python3 -m venv");
        assert!(made.success(), "cannot create the virtual environment");
        let pip = tokio::process::Command::new(venv.join("bin/pip"))
            .args([
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "openai",
            ])
            .status()
            .await
            .expect("pip install openai");
        assert!(pip.success(), "pip install openai failed");
    }
    python
}

/// Installs "another build" at `bin`: this binary started with `versions` as the wire
/// versions it speaks (`DUET_TEST_WIRE_VERSIONS`). Replaced atomically, as a package manager
/// does, so a running node is untouched and the next start runs it.
pub fn install_build(bin: &Path, real: &Path, versions: &str) {
    let next = bin.with_extension("next");
    let script = format!(
        "#!/bin/sh\nDUET_TEST_WIRE_VERSIONS={versions} exec {} \"$@\"\n",
        real.display()
    );
    std::fs::write(&next, script).expect("write the new build");
    std::fs::set_permissions(&next, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    std::fs::rename(&next, bin).expect("install the new build");
}
