//! A fleet on six hosts (network namespaces, see `common::hosts`): two routers, two prefill
//! and two decode workers, each on its own host and the same port, under load through both
//! routers. In turn: a prefill host cut off for 6 s, a decode host cut off for 6 s, one
//! prefill-decode pair cut for 6 s, a decode host crashed and booted again, a decode worker
//! on a seventh host joining from outside cluster.toml (it serves alone while the others are
//! drained), and a rolling upgrade of every decode worker (`duet rollout`, run on a router's
//! host, with a later build installed). Every request ends, none is answered other than
//! `duet generate` answers, the history checker finds nothing; each scenario reports its
//! requests, failures, retries and the time from the fault's end to the first request served
//! through the host that was hit.
//!
//! Each node runs under a small supervisor loop on its host (as a pod under its kubelet): it
//! starts the binary installed at one path again when the node exits to be restarted.
//! Needs root (CI runs as root); addresses are 198.18.0.0/24 inside the test's namespaces only.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::fleet::*;
use common::hosts::Hosts;
use common::*;
use serde_json::{Value, json};

/// Every node's link port on its own host.
const PORT: u16 = 7500;
/// Every node's admin port, on its host's bridge address (so `duet rollout` on one host
/// reaches them all).
const ADMIN: u16 = 7600;
/// The routers' OpenAI port, on their hosts' loopback.
const HTTP: u16 = 8000;
const TEST: &str = "six-hosts";

/// (node, role, host) of the file.
const NODES: [(&str, &str, &str); 6] = [
    ("r0", "router", "hr0"),
    ("r1", "router", "hr1"),
    ("p0", "prefill", "hp0"),
    ("p1", "prefill", "hp1"),
    ("d0", "decode", "hd0"),
    ("d1", "decode", "hd1"),
];
const ROUTERS: [(&str, u16); 2] = [("hr0", HTTP), ("hr1", HTTP)];

fn cluster_toml(h: &Hosts) -> String {
    let model = real_model();
    let mut text = format!(
        "[cluster]\nname = \"fleet\"\n[serving]\nmodel = \"{}\"\nhttp = \"127.0.0.1:{HTTP}\"\n\
         kv_pages = 256\nmax_batch_tokens = 32\ndisagg_threshold = 16\nkv_transport = \"auto\"\n\
         request_timeout_secs = 60\nbootstrap_timeout_secs = 10\ntransfer_timeout_secs = 10\n\
         [serving.node.d0]\nkv_pages = 32\n[serving.node.d1]\nkv_pages = 32\n\
         [membership]\nheartbeat_interval_ms = 250\nfailure_threshold = 4\n",
        model.display()
    );
    for (name, role, host) in NODES {
        let ip = h.ip(host);
        text.push_str(&format!(
            "[[node]]\nname = \"{name}\"\nrole = \"{role}\"\naddress = \"{ip}:{PORT}\"\n\
             admin = \"{ip}:{ADMIN}\"\n"
        ));
    }
    text
}

/// The fleet's shared state: hosts, file, token, history folder, installed binary.
struct Fleet {
    hosts: Arc<Hosts>,
    config: String,
    token: String,
    history: String,
    bin: String,
}

impl Fleet {
    /// A GET on `host`'s node admin API (from the first router's host).
    async fn admin(&self, host: &str, path: &str) -> String {
        let admin = format!("{}:{ADMIN}", self.hosts.ip(host));
        admin_from(&self.hosts, "hr0", &admin, &self.token, path).await
    }

    async fn metric(&self, host: &str, name: &str, labels: &str) -> f64 {
        metric_in(&self.admin(host, "/metrics").await, name, labels)
    }

    /// Router retries, both routers.
    async fn retries(&self) -> f64 {
        self.metric("hr0", "duet_router_retries_total", "").await
            + self.metric("hr1", "duet_router_retries_total", "").await
    }

    /// Completed transfers on the decode node of `host`.
    async fn transfers(&self, host: &str) -> f64 {
        self.metric(host, "duet_transfers_total", "outcome=\"completed\"")
            .await
    }

    /// Time until `probe` exceeds `before`: the first request served through the host that
    /// was hit, after its fault ended.
    async fn until_above(&self, what: &str, before: f64, probe: impl AsyncFn() -> f64) -> Duration {
        let start = Instant::now();
        poll(what, Duration::from_secs(90), || async {
            (probe().await > before).then_some(())
        })
        .await;
        start.elapsed()
    }

    /// `duet ARGS` run on the first router's host; its stdout, and whether it succeeded.
    async fn duet_on(&self, args: &[&str]) -> (bool, String, String) {
        let out = self
            .hosts
            .command("hr0", duet_bin())
            .args(args)
            .output()
            .await
            .expect("duet");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Node `name` on `host` under a supervisor loop that starts the installed binary again
    /// when the node exits to be restarted (exit 75); `extra` are more `duet node` arguments.
    async fn start(&self, host: &str, name: &str, extra: &str) -> Running {
        let script = format!(
            "while :; do \"{}\" node --config \"{}\" --name {name} {extra}; rc=$?; \
             [ $rc -eq 75 ] || exit $rc; done",
            self.bin, self.config
        );
        let mut cmd = self.hosts.command(host, "sh");
        cmd.args(["-c", &script])
            .env("DUET_HISTORY_DIR", &self.history);
        Running::spawn(
            cmd,
            &format!("duet node {name} on {host}"),
            duet_runtime::node::READY_MARKER,
        )
        .await
    }

    /// Whether both routers count `workers` ready workers.
    async fn routers_ready(&self, workers: usize) {
        for (host, http) in ROUTERS {
            router_ready_with(http, workers, || self.hosts.command(host, "curl")).await;
        }
    }
}

/// Runs one cut scenario: load, `fault` for 6 s then `heal`, the time until `probe` grows.
async fn cut(
    f: &Fleet,
    refs: &Arc<Vec<String>>,
    scenario: &str,
    offset: usize,
    fault: impl Fn(&Hosts),
    heal: impl Fn(&Hosts),
    probe: impl AsyncFn() -> f64,
) {
    let retries = f.retries().await;
    let load = Load::start(&f.hosts, refs, &ROUTERS, 4, offset);
    load.under_way().await;
    fault(&f.hosts);
    tokio::time::sleep(Duration::from_secs(6)).await; // the fault's length
    heal(&f.hosts);
    let before = probe().await;
    let back = f.until_above(scenario, before, &probe).await;
    let tally = load.finish().await;
    let counters = format!("{} retries", f.retries().await - retries);
    let timing = format!(
        "first request through the host hit {:.1} s after the fault ended",
        back.as_secs_f64()
    );
    report(TEST, scenario, &tally, &counters, &timing);
}

#[tokio::test(flavor = "multi_thread")]
async fn six_hosts_serve_through_cuts_crashes_a_join_and_a_rolling_upgrade() {
    let names: Vec<&str> = NODES.iter().map(|n| n.2).chain(["hd7"]).collect();
    let hosts = Hosts::new(&names);
    for host in &names {
        hosts.boot(host).await;
    }
    let FleetDir {
        dir,
        config,
        token,
        history,
    } = FleetDir::new(&cluster_toml(&hosts)).await;
    // The binary every host runs, replaced by the rolling upgrade.
    let real = std::path::PathBuf::from(duet_bin());
    let bin = dir.path().join("duet");
    // Every host starts on "an older build": this one, speaking wire version 1 alone.
    install_build(&bin, &real, "1-1");

    eprintln!("[{TEST}] references from duet generate");
    let refs = references().await;
    let f = Fleet {
        hosts: Arc::new(hosts),
        config: config.clone(),
        token,
        history,
        bin: path_str(&bin).to_string(),
    };
    eprintln!("[{TEST}] starting six nodes on six hosts");
    let mut nodes = Vec::new();
    for (name, _, host) in NODES {
        nodes.push((name, f.start(host, name, "").await));
    }
    f.routers_ready(4).await;
    for k in 0..4 {
        let body = json!({"prompt": prompt(k), "max_tokens": 8, "ignore_eos": true,
                          "temperature": 0});
        let (code, v) = complete_on(&f.hosts, ROUTERS[k % 2].0, HTTP, &body).await;
        assert_eq!(
            (code, v["choices"][0]["text"].as_str()),
            (200, Some(refs[k].as_str()))
        );
    }

    // 1-3: cuts.
    cut(
        &f,
        &refs,
        "prefill host hp0 cut 6 s",
        0,
        |h| h.set_link("hp0", false),
        |h| h.set_link("hp0", true),
        async || f.metric("hp0", "duet_prefill_seconds_count", "").await,
    )
    .await;
    cut(
        &f,
        &refs,
        "decode host hd0 cut 6 s",
        4,
        |h| h.set_link("hd0", false),
        |h| h.set_link("hd0", true),
        async || f.transfers("hd0").await,
    )
    .await;
    cut(
        &f,
        &refs,
        "pair hp0-hd0 cut 6 s",
        8,
        |h| h.set_pair("hp0", "hd0", true),
        |h| h.set_pair("hp0", "hd0", false),
        async || f.transfers("hd0").await,
    )
    .await;

    // 4: a decode host crashes (every process on it, its /dev/shm) under load and boots.
    {
        let retries = f.retries().await;
        let load = Load::start(&f.hosts, &refs, &ROUTERS, 4, 12);
        load.under_way().await;
        f.hosts.crash("hd1").await;
        nodes.retain(|(n, _)| *n != "d1"); // its supervisor died with the host
        f.hosts.boot("hd1").await;
        let started = Instant::now();
        nodes.push(("d1", f.start("hd1", "d1", "").await));
        // The new process counts from zero: the first transfer it completes.
        f.until_above("d1 serving again", 0.0, async || f.transfers("hd1").await)
            .await;
        let back = started.elapsed();
        let tally = load.finish().await;
        let counters = format!("{} retries", f.retries().await - retries);
        report(
            TEST,
            "decode host hd1 crashed and booted",
            &tally,
            &counters,
            &format!(
                "first request through d1 {:.1} s after the host booted (model load included)",
                back.as_secs_f64()
            ),
        );
    }

    // 5: a decode worker joins from a seventh host, not in the file, and takes traffic: with
    // d0 and d1 drained it serves everything.
    {
        let ip = f.hosts.ip("hd7");
        let extra = format!("--role decode --address {ip}:{PORT} --admin {ip}:{ADMIN}");
        nodes.push(("d7", f.start("hd7", "d7", &extra).await));
        f.routers_ready(5).await;
        for node in ["d0", "d1"] {
            let (ok, _, err) = f
                .duet_on(&["drain", "--config", &f.config, node, "--wait", "60"])
                .await;
            assert!(ok, "drain {node}: {err}");
        }
        f.routers_ready(3).await;
        let retries = f.retries().await;
        let load = Load::start(&f.hosts, &refs, &ROUTERS, 4, 16);
        let back = f
            .until_above("d7 serving", 0.0, async || f.transfers("hd7").await)
            .await;
        poll(
            "six requests while only d7 decodes",
            Duration::from_secs(60),
            || async { (load.tally.lock().await.ok >= 6).then_some(()) },
        )
        .await;
        let tally = load.finish().await;
        let counters = format!(
            "{} retries, {} transfers on d7",
            f.retries().await - retries,
            f.transfers("hd7").await
        );
        report(
            TEST,
            "d7 joined from outside the file, d0 and d1 drained",
            &tally,
            &counters,
            &format!(
                "first request through d7 {:.1} s after the load began",
                back.as_secs_f64()
            ),
        );
        assert!(tally.failed.is_empty(), "{:?}", tally.failed);
        for node in ["d0", "d1"] {
            let (ok, _, err) = f.duet_on(&["resume", "--config", &f.config, node]).await;
            assert!(ok, "resume {node}: {err}");
        }
        f.routers_ready(5).await;
    }

    // 6: a rolling upgrade of every decode worker (d7 included) to a later build.
    {
        install_build(std::path::Path::new(&f.bin), &real, "2");
        let retries = f.retries().await;
        let load = Load::start(&f.hosts, &refs, &ROUTERS, 4, 20);
        load.under_way().await;
        let started = Instant::now();
        let (ok, out, err) = f
            .duet_on(&[
                "rollout", "--config", &f.config, "--role", "decode", "--wait", "90",
            ])
            .await;
        eprintln!("[{TEST}] {out}");
        assert!(ok, "duet rollout: {err}");
        let took = started.elapsed();
        let tally = load.finish().await;
        let counters = format!(
            "{} retries; rollout took {:.1} s",
            f.retries().await - retries,
            took.as_secs_f64()
        );
        report(TEST, "rolling upgrade of d0, d1, d7", &tally, &counters, "");
        assert!(tally.failed.is_empty(), "{:?}", tally.failed);
        // The new builds talk version 2 to each other, 1 to the old routers and prefill.
        let links: Value =
            serde_json::from_str(&f.admin("hd0", "/v1/membership").await).unwrap_or(Value::Null);
        assert_eq!(links["links"]["d1"]["wire"], 2, "{links}");
        assert_eq!(links["links"]["r0"]["wire"], 1, "{links}");
    }

    let report = check_history(&f.history).await;
    eprintln!("[{TEST}] history: {report}");
    drop(nodes);
}
