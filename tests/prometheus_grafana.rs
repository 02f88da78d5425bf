//! A real Prometheus (built from source, `tools/prometheus/install.sh`) scrapes every node of
//! a disaggregated cluster on its admin address with the cluster token while `duet bench`
//! loads it. PromQL over what it stored answers what an operator asks first (generation
//! tokens per second, TTFT p99, KV usage per worker), and every query of the Grafana
//! dashboard (`deploy/grafana/duet-pd.json`) returns data.

mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use common::*;
use serde_json::Value;

fn prometheus_bin() -> PathBuf {
    duet_runtime::testing::pinned_tool(
        &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tools/prometheus/install.sh"),
    )
}

/// `GET path` of Prometheus's HTTP API with `query` (url-encoded), as JSON.
async fn api(port: u16, path: &str, query: Option<&str>) -> Option<Value> {
    let mut cmd = tokio::process::Command::new("curl");
    cmd.args(["-s", "--max-time", "5", "-G"]);
    if let Some(q) = query {
        cmd.arg("--data-urlencode").arg(format!("query={q}"));
    }
    let out = cmd
        .arg(format!("http://127.0.0.1:{port}{path}"))
        .output()
        .await
        .ok()?;
    serde_json::from_slice(&out.stdout).ok()
}

/// The instant vector `q` evaluates to: `(labels, value)` per series, NaN samples left out.
async fn query(port: u16, q: &str) -> Vec<(Value, f64)> {
    let Some(v) = api(port, "/api/v1/query", Some(q)).await else {
        return vec![];
    };
    v["data"]["result"]
        .as_array()
        .map(|r| {
            r.iter()
                .filter_map(|s| {
                    let x: f64 = s["value"][1].as_str()?.parse().ok()?;
                    (!x.is_nan()).then(|| (s["metric"].clone(), x))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A dashboard query as Grafana would send it over the last minute, all models selected.
fn as_grafana_sends(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$__range", "5m")
        .replace("\"$model\"", "\".*\"")
}

#[tokio::test(flavor = "multi_thread")]
async fn prometheus_scrapes_every_node_and_every_dashboard_panel_has_data() {
    let prometheus = prometheus_bin();
    let c = ClusterDir::tiny(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        "disagg_threshold = 0\n",
    );
    c.credentials(&c.config).await;
    let _up = Running::up(&c.config).await;
    router_ready(c.http, 2).await;

    let token_file = c.dir.path().join(".duet/token");
    let targets: String = ["router", "p0", "d0"]
        .iter()
        .zip(["router", "prefill", "decode"])
        .map(|(node, role)| {
            format!(
                "      - targets: [\"{}\"]\n        labels: {{node: {node}, role: {role}}}\n",
                c.admin(node)
            )
        })
        .collect();
    let config = c.dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  \
             - job_name: duet\n    authorization:\n      credentials_file: {}\n    \
             static_configs:\n{targets}",
            token_file.display()
        ),
    )
    .expect("prometheus.yml");
    let port = free_ports(1)[0];
    let _prometheus = tokio::process::Command::new(&prometheus)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            c.dir.path().join("tsdb").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start Prometheus");

    // Every node scraped with the token (a refused token would read "401" here).
    poll("three targets up", Duration::from_secs(60), || async move {
        let t = api(port, "/api/v1/targets", None).await?;
        let active = t["data"]["activeTargets"].as_array()?;
        (active.len() == 3 && active.iter().all(|a| a["health"] == "up")).then_some(())
    })
    .await;

    let url = format!("http://127.0.0.1:{}", c.http);
    let bench = duet(&[
        "bench",
        "--url",
        &url,
        "--duration",
        "10",
        "--concurrency",
        "2",
        "--prompt-len",
        "40",
        "--output-len",
        "8",
    ])
    .await;
    assert!(bench.status.success(), "{}", bench.stderr);

    // What an operator asks first.
    let tokens_per_s = poll(
        "generation tokens per second",
        Duration::from_secs(30),
        || async move {
            let r = query(port, "sum(rate(duet_generation_tokens_total[1m]))").await;
            r.first().map(|(_, v)| *v).filter(|v| *v > 0.0)
        },
    )
    .await;
    let ttft_p99 = query(
        port,
        "histogram_quantile(0.99, sum by (le) (rate(duet_router_ttft_seconds_bucket[1m])))",
    )
    .await;
    assert!(
        ttft_p99
            .first()
            .is_some_and(|(_, v)| *v > 0.0 && v.is_finite()),
        "TTFT p99: {ttft_p99:?}"
    );
    let usage = query(port, "duet_kv_cache_usage_perc").await;
    let nodes: Vec<&str> = usage
        .iter()
        .filter_map(|(m, _)| m["node"].as_str())
        .collect();
    assert!(
        nodes.contains(&"p0") && nodes.contains(&"d0"),
        "KV usage per worker: {usage:?}"
    );
    assert!(
        usage.iter().all(|(_, v)| (0.0..=1.0).contains(v)),
        "{usage:?}"
    );
    eprintln!(
        "generation {tokens_per_s:.1} tok/s, TTFT p99 {:.3} s",
        ttft_p99[0].1
    );

    // Every panel of the dashboard.
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy/grafana/duet-pd.json");
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("the dashboard"))
            .expect("the dashboard is JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(panels.len() >= 10, "a dashboard of {} panels", panels.len());
    let mut empty = Vec::new();
    for p in panels {
        let title = p["title"].as_str().unwrap_or("?");
        let targets = p["targets"].as_array().cloned().unwrap_or_default();
        assert!(!targets.is_empty(), "panel {title} has no query");
        for t in targets {
            let expr = as_grafana_sends(t["expr"].as_str().unwrap_or_default());
            if query(port, &expr).await.is_empty() {
                empty.push(format!("{title}: {expr}"));
            }
        }
    }
    assert!(
        empty.is_empty(),
        "queries that returned nothing:\n{}",
        empty.join("\n")
    );
}
