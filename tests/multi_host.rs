//! A cluster spread over three hosts (network namespaces with their own address, hostname,
//! `/etc/hostname` and `/dev/shm`, joined by a bridge): router, prefill and decode each on its
//! own host, every node on the same port (7500) as pods in Kubernetes would be. Under load the
//! harness cuts the prefill host off for 6 s, cuts the prefill-decode pair only for 6 s, and
//! crashes the decode host and starts it again. Every request ends, every answer equals
//! `duet generate`'s, the transfer history checker finds nothing, and each scenario reports its
//! requests, failures and the time from the fault's end to the first request served through
//! both workers again.
//!
//! Needs root (CI runs as root); addresses are 198.18.0.0/24 inside the test's namespaces only.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::fleet::*;
use common::hosts::Hosts;
use common::*;
use serde_json::json;

/// Every node listens on this port on its own host.
const PORT: u16 = 7500;
/// The router's OpenAI port, on the router's host.
const HTTP: u16 = 8000;
/// The cluster file: three nodes on three hosts, one port, default (loopback) admin addresses.
fn cluster_toml(h: &Hosts) -> String {
    let model = real_model();
    let mut text = format!(
        "[cluster]\nname = \"hosts\"\n[serving]\nmodel = \"{}\"\nhttp = \"127.0.0.1:{HTTP}\"\n\
         kv_pages = 256\nmax_batch_tokens = 32\ndisagg_threshold = 16\nkv_transport = \"auto\"\n\
         request_timeout_secs = 60\nbootstrap_timeout_secs = 10\ntransfer_timeout_secs = 10\n\
         [serving.node.d0]\nkv_pages = 32\n[membership]\nheartbeat_interval_ms = 250\n\
         failure_threshold = 4\n",
        model.display()
    );
    for (name, role, host) in [
        ("router", "router", "hrouter"),
        ("p0", "prefill", "hprefill"),
        ("d0", "decode", "hdecode"),
    ] {
        text.push_str(&format!(
            "[[node]]\nname = \"{name}\"\nrole = \"{role}\"\naddress = \"{}:{PORT}\"\n",
            h.ip(host)
        ));
    }
    text
}

/// A GET on `node`'s admin API, from its own host (its admin listens on that host's loopback).
async fn admin_on(h: &Hosts, host: &str, token: &str, path: &str) -> String {
    admin_from(h, host, &format!("127.0.0.1:{PORT}"), token, path).await
}

/// A counter or gauge of `host`'s node, summed over the label sets that contain `labels`.
async fn metric_on(h: &Hosts, host: &str, token: &str, name: &str, labels: &str) -> f64 {
    metric_in(&admin_on(h, host, token, "/metrics").await, name, labels)
}

/// Waits until the router reports `workers` ready workers.
async fn router_ready_on(h: &Hosts, workers: usize) {
    router_ready_with(HTTP, workers, || h.command("hrouter", "curl")).await;
}

/// Completed transfers on decode (a request served through both workers).
async fn transfers_done(h: &Hosts, token: &str) -> f64 {
    metric_on(
        h,
        "hdecode",
        token,
        "duet_transfers_total",
        "outcome=\"completed\"",
    )
    .await
}

/// Time from now until decode completes one more transfer than `before` (the first request
/// served through prefill and decode after a fault ends).
async fn until_served_through_both(h: &Hosts, token: &str, before: f64) -> Duration {
    let start = Instant::now();
    poll(
        "a request served through both workers",
        Duration::from_secs(90),
        || async { (transfers_done(h, token).await > before).then_some(()) },
    )
    .await;
    start.elapsed()
}

async fn start_node(h: &Hosts, host: &str, config: &str, name: &str, history: &str) -> Running {
    let mut cmd = h.command(host, duet_bin());
    cmd.args(["node", "--config", config, "--name", name])
        .env("DUET_HISTORY_DIR", history);
    Running::spawn(
        cmd,
        &format!("duet node {name} on {host}"),
        duet_runtime::node::READY_MARKER,
    )
    .await
}

/// The router's and decode's counters a scenario reports the change of.
#[derive(Debug, Clone, Copy, Default)]
struct Counters {
    retries: f64,
    disaggregated: f64,
    decode_only: f64,
    transfers: f64,
}

impl Counters {
    async fn read(h: &Hosts, token: &str) -> Counters {
        let route = |path: &'static str| async move {
            let label = format!("path=\"{path}\"");
            metric_on(h, "hrouter", token, "duet_router_routes_total", &label).await
        };
        Counters {
            retries: metric_on(h, "hrouter", token, "duet_router_retries_total", "").await,
            disaggregated: route("disaggregated").await,
            decode_only: route("decode_only").await,
            transfers: transfers_done(h, token).await,
        }
    }

    fn since(self, before: Counters) -> Counters {
        Counters {
            retries: self.retries - before.retries,
            disaggregated: self.disaggregated - before.disaggregated,
            decode_only: self.decode_only - before.decode_only,
            transfers: self.transfers - before.transfers,
        }
    }
}

fn report_scenario(scenario: &str, t: &Tally, c: Counters, back: Duration) {
    let counters = format!(
        "router: {} retries, {} routed disaggregated, {} to decode alone; {} transfers completed",
        c.retries, c.disaggregated, c.decode_only, c.transfers
    );
    let timing = format!(
        "first request through both workers {:.1} s after the fault ended",
        back.as_secs_f64()
    );
    report("multi-host", scenario, t, &counters, &timing);
}

#[tokio::test(flavor = "multi_thread")]
async fn three_hosts_serve_right_through_cuts_and_a_crash() {
    let hosts = Hosts::new(&["hrouter", "hprefill", "hdecode"]);
    for host in ["hrouter", "hprefill", "hdecode"] {
        hosts.boot(host).await;
    }
    let FleetDir {
        dir: _dir,
        config,
        token,
        history,
    } = FleetDir::new(&cluster_toml(&hosts)).await;

    eprintln!("[multi-host] hosts up; references from duet generate");
    let refs = references().await;

    eprintln!("[multi-host] starting the nodes");
    let _router = start_node(&hosts, "hrouter", &config, "router", &history).await;
    let _p0 = start_node(&hosts, "hprefill", &config, "p0", &history).await;
    let d0 = start_node(&hosts, "hdecode", &config, "d0", &history).await;
    router_ready_on(&hosts, 2).await;

    eprintln!("[multi-host] cluster ready");
    // Each host has its own name and /dev/shm, so the pair chose TCP, not shared memory.
    let tree = admin_on(&hosts, "hdecode", &token, "/v1/tree").await;
    assert!(
        tree.contains("\"node\":\"d0\""),
        "d0's admin on its host: {tree}"
    );
    let out = hosts
        .command("hrouter", duet_bin())
        .args(["tree", "--config", &config, "--json"])
        .output()
        .await
        .expect("duet tree");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("node `router` answered there"),
        "the CLI on the router's host never shows its own node as d0: {text}"
    );

    // Served right on three hosts, before any fault.
    for k in 0..PROMPTS {
        let body = json!({"prompt": prompt(k), "max_tokens": 8, "ignore_eos": true,
                          "temperature": 0});
        let (code, v) = complete_on(&hosts, "hrouter", HTTP, &body).await;
        assert_eq!(code, 200, "{v}");
        assert_eq!(v["choices"][0]["text"], refs[k].as_str(), "prompt {k}");
    }
    assert!(transfers_done(&hosts, &token).await >= 1.0);
    let tcp = metric_on(
        &hosts,
        "hprefill",
        &token,
        "duet_kv_bytes_sent_total",
        "tcp",
    )
    .await;
    assert!(tcp > 0.0, "KV moved between hosts over TCP");

    let hosts = Arc::new(hosts);
    // 1. The prefill host cut off for 6 s under load.
    let start = Counters::read(&hosts, &token).await;
    let load = Load::start(&hosts, &refs, &[("hrouter", HTTP)], 3, 0);
    load.under_way().await;
    hosts.set_link("hprefill", false);
    tokio::time::sleep(Duration::from_secs(6)).await; // the fault's length
    hosts.set_link("hprefill", true);
    let before = transfers_done(&hosts, &token).await;
    let back = until_served_through_both(&hosts, &token, before).await;
    let tally = load.finish().await;
    let c = Counters::read(&hosts, &token).await.since(start);
    report_scenario("prefill host cut 6 s", &tally, c, back);

    // 2. Only the prefill-decode pair cut for 6 s: the router still reaches both.
    let start = Counters::read(&hosts, &token).await;
    let load = Load::start(&hosts, &refs, &[("hrouter", HTTP)], 3, 8);
    load.under_way().await;
    hosts.set_pair("hprefill", "hdecode", true);
    tokio::time::sleep(Duration::from_secs(6)).await; // the fault's length
    hosts.set_pair("hprefill", "hdecode", false);
    let before = transfers_done(&hosts, &token).await;
    let back = until_served_through_both(&hosts, &token, before).await;
    let tally = load.finish().await;
    let c = Counters::read(&hosts, &token).await.since(start);
    report_scenario("prefill-decode pair cut 6 s", &tally, c, back);

    // 3. The decode host crashes (every process on it, its /dev/shm gone) and boots again.
    hosts.crash("hdecode").await;
    drop(d0);
    hosts.boot("hdecode").await;
    let started = Instant::now();
    let _d0 = start_node(&hosts, "hdecode", &config, "d0", &history).await;
    router_ready_on(&hosts, 2).await;
    // Decode's counters start again from zero in its new process.
    let start = Counters::read(&hosts, &token).await;
    let load = Load::start(&hosts, &refs, &[("hrouter", HTTP)], 3, 16);
    until_served_through_both(&hosts, &token, start.transfers).await;
    let back = started.elapsed();
    // More load through the new decode process before the tally.
    poll(
        "six requests on the new decode",
        Duration::from_secs(60),
        || async { (load.tally.lock().await.ok >= 6).then_some(()) },
    )
    .await;
    let tally = load.finish().await;
    let c = Counters::read(&hosts, &token).await.since(start);
    report_scenario("decode host crashed and rebooted", &tally, c, back);

    let report = check_history(&history).await;
    eprintln!("[multi-host] history: {report}");
}
