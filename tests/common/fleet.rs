//! Load and measurement for clusters spread over [`Hosts`]: clients that send cycled prompts
//! through the routers (curl on the routers' hosts) and check every answer against
//! `duet generate`, admin calls made from inside a host, and the per-scenario report.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::Mutex;

use super::hosts::Hosts;
use super::{generate_reference, poll};

/// Distinct prompts the load cycles through (each several prefill chunks). A decode pool of
/// 32 pages holds about two of them beside three running requests, so cycling through 24
/// (least recently used goes first) finds none in its prefix cache: every request crosses
/// hosts unless the router sends it to decode alone.
pub const PROMPTS: usize = 24;

pub fn prompt(salt: usize) -> String {
    format!(
        "Host test {salt}. Clusters span many machines: routers pair prefill and decode \
         workers, and the KV cache moves between them over the network. "
    )
    .repeat(3)
}

/// What `duet generate` answers for each prompt (8 tokens), two at a time (two cores; each
/// run loads the model on its own).
pub async fn references() -> Arc<Vec<String>> {
    let mut v = Vec::new();
    for pair in (0..PROMPTS).collect::<Vec<_>>().chunks(2) {
        let runs = pair
            .iter()
            .map(|&k| tokio::spawn(async move { generate_reference(&prompt(k), 8).await }));
        for r in runs.collect::<Vec<_>>() {
            v.push(r.await.expect("reference"));
        }
    }
    Arc::new(v)
}

/// A cluster's folder for a multi-host test: `toml` written as its cluster.toml, its
/// credentials made, a history folder (for `DUET_HISTORY_DIR`).
pub struct FleetDir {
    pub dir: tempfile::TempDir,
    pub config: String,
    pub token: String,
    pub history: String,
}

impl FleetDir {
    pub async fn new(toml: &str) -> FleetDir {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = dir.path().join("cluster.toml");
        std::fs::write(&config, toml).expect("cluster file");
        let config = super::path_str(&config).to_string();
        let out = super::duet(&["credentials", "--config", &config]).await;
        assert!(out.status.success(), "{}", out.stderr);
        let token = std::fs::read_to_string(dir.path().join(".duet/token"))
            .expect("token")
            .trim()
            .to_string();
        let history = dir.path().join("history");
        std::fs::create_dir_all(&history).expect("history folder");
        let history = super::path_str(&history).to_string();
        FleetDir {
            dir,
            config,
            token,
            history,
        }
    }
}

/// One completion through curl on `host`, to the router listening on its loopback `http`
/// port: the status and the body.
pub async fn complete_on(h: &Hosts, host: &str, http: u16, body: &Value) -> (u16, Value) {
    let mut body = body.clone();
    if let Some(o) = body.as_object_mut()
        && !o.contains_key("model")
    {
        let models = h
            .command(host, "curl")
            .args(["-s", "--max-time", "10"])
            .arg(format!("http://127.0.0.1:{http}/v1/models"))
            .output()
            .await
            .expect("curl");
        let v: Value = serde_json::from_slice(&models.stdout).unwrap_or(Value::Null);
        let model = v["data"][0]["id"].as_str().unwrap_or("unknown").to_string();
        o.insert("model".into(), Value::String(model));
    }
    let out = h
        .command(host, "curl")
        .args(["-s", "--max-time", "120", "-w", "\n%{http_code}", "-H"])
        .arg("content-type: application/json")
        .arg("-d")
        .arg(body.to_string())
        .arg(format!("http://127.0.0.1:{http}/v1/completions"))
        .output()
        .await
        .expect("curl");
    super::status_and_json(&out.stdout)
}

/// A GET on the admin API at `admin` (`IP:PORT`), made from `host`.
pub async fn admin_from(h: &Hosts, host: &str, admin: &str, token: &str, path: &str) -> String {
    let out = h
        .command(host, "curl")
        .args(["-s", "--max-time", "3", "-H"])
        .arg(format!("authorization: Bearer {token}"))
        .arg(format!("http://{admin}{path}"))
        .output()
        .await
        .expect("curl");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A counter or gauge in Prometheus text, summed over the label sets that contain `labels`.
pub fn metric_in(text: &str, name: &str, labels: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// What the clients saw in one scenario.
#[derive(Default, Debug)]
pub struct Tally {
    pub ok: usize,
    pub wrong: Vec<String>,
    pub failed: BTreeMap<String, usize>,
}

impl Tally {
    pub fn requests(&self) -> usize {
        self.ok + self.wrong.len() + self.failed.values().sum::<usize>()
    }
}

/// Clients that send the cycled prompts back to back, spread over `routers` (host, HTTP
/// port), until told to stop.
pub struct Load {
    stop: Arc<AtomicBool>,
    pub tally: Arc<Mutex<Tally>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    pub fn start(
        h: &Arc<Hosts>,
        refs: &Arc<Vec<String>>,
        routers: &[(&str, u16)],
        clients: usize,
        offset: usize,
    ) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(Mutex::new(Tally::default()));
        let routers: Arc<Vec<(String, u16)>> =
            Arc::new(routers.iter().map(|(h, p)| (h.to_string(), *p)).collect());
        let tasks = (0..clients)
            .map(|c| {
                let (h, refs, stop, tally) = (h.clone(), refs.clone(), stop.clone(), tally.clone());
                let routers = routers.clone();
                tokio::spawn(async move {
                    let mut i = offset + c;
                    while !stop.load(Ordering::Relaxed) {
                        let k = i % PROMPTS;
                        let (host, http) = &routers[i % routers.len()];
                        let body = json!({"prompt": prompt(k), "max_tokens": 8,
                                          "ignore_eos": true, "temperature": 0});
                        let (code, v) = complete_on(&h, host, *http, &body).await;
                        let mut t = tally.lock().await;
                        match code {
                            200 if v["choices"][0]["text"] == refs[k].as_str() => t.ok += 1,
                            200 => t.wrong.push(format!("prompt {k}: {v}")),
                            _ => {
                                let why = v["error"]["code"].as_str().unwrap_or("none");
                                *t.failed.entry(format!("{why} (HTTP {code})")).or_default() += 1;
                            }
                        }
                        i += clients;
                    }
                })
            })
            .collect();
        Load { stop, tally, tasks }
    }

    /// Waits until the clients have finished a request (the load is under way).
    pub async fn under_way(&self) {
        poll("the load under way", Duration::from_secs(60), || async {
            (self.tally.lock().await.requests() > 0).then_some(())
        })
        .await;
    }

    /// Stops the clients (each finishes its request: every request ends) and returns the tally.
    pub async fn finish(self) -> Tally {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            tokio::time::timeout(Duration::from_secs(150), t)
                .await
                .expect("every request ends")
                .expect("client task");
        }
        std::mem::take(&mut *self.tally.lock().await)
    }
}

/// Prints a scenario's line (requests, failures, what the counters say, a timing such as
/// the time from the fault's end to the first request served through the host hit) and
/// checks that nothing was answered wrong and something was served.
pub fn report(test: &str, scenario: &str, t: &Tally, counters: &str, timing: &str) {
    eprintln!(
        "[{test}] {scenario}: {} requests, {} ok, {} wrong, failures {:?}; {counters}; {timing}",
        t.requests(),
        t.ok,
        t.wrong.len(),
        t.failed,
    );
    assert!(
        t.wrong.is_empty(),
        "{scenario}: wrong answers: {:?}",
        t.wrong
    );
    assert!(t.ok > 0, "{scenario}: nothing served");
}
