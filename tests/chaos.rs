//! `duet chaos` against a live disaggregated cluster with the real model: a serving actor
//! killed every 2 s under load; nothing unfinished, nothing corrupted, no page stranded, and
//! at least 99 % of the requests succeed. Once with the default transport (shared memory on
//! one host), once over TCP (where decode's KV receiver carries the transfers it is killed
//! with).

mod common;

use std::path::PathBuf;

use common::*;
use serde_json::Value;

/// One cluster at a time: two on two cores turn timing into noise.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread")]
async fn chaos_under_load_loses_nothing() {
    run_chaos("", 60, &[]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn chaos_over_tcp_loses_nothing() {
    run_chaos("kv_transport = \"tcp\"\n", 30, &[]).await;
}

/// Issue 14: worker processes stopped (SIGSTOP for 1 to 10 s, past a 3 s drain backstop) and
/// killed (SIGKILL; `duet up` starts them again) among the actor kills. The shorter CI
/// version of the 10-minute run in the closing note.
///
/// The request timeout is 60 s here, not 30: a request waits for a worker up to that long
/// after its last token, and this run can take the only prefill and the only decode worker
/// out back to back (a 10 s pause of one, then of the other, a crash on top) for 25 s and
/// more. At 30 s, requests caught in such a stretch failed by their deadline (in CI, 5 of 38),
/// which is the deadline doing its job, not a request lost; this test measures loss.
#[tokio::test(flavor = "multi_thread")]
async fn chaos_with_paused_and_crashed_workers_loses_nothing() {
    run_chaos(
        "drain_fence_secs = 1\ndrain_backstop_secs = 3\nrequest_timeout_secs = 60\n",
        60,
        &["--pause", "--crash", "--pause-secs", "1..10"],
    )
    .await;
}

/// A router + p0 + d0 cluster with serving `extra`, `duet chaos` for `secs` (with `flags`),
/// its report and the history checked.
async fn run_chaos(extra: &str, secs: u64, flags: &[&str]) {
    let _serial = SERIAL.lock().await;
    let model = real_model();
    let http = free_ports(1)[0];
    // 30 s unless the variant sets its own.
    let timeout = if extra.contains("request_timeout_secs") {
        ""
    } else {
        "request_timeout_secs = 30\n"
    };
    let extra = format!(
        "[serving]\nmodel = \"{}\"\nhttp = \"127.0.0.1:{http}\"\nkv_pages = 256\n\
         max_batch_tokens = 64\ndisagg_threshold = 16\n{timeout}\
         bootstrap_timeout_secs = 10\ntransfer_timeout_secs = 15\n{extra}\n\
         [supervision.default]\nmax_restarts = 1000\nwithin_secs = 60\n\
         [supervision.node]\nmax_restarts = 1000\nwithin_secs = 60\n",
        model.display()
    );
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        &extra,
    );
    let history = c.dir.path().join("history");
    std::fs::create_dir_all(&history).expect("history folder");
    let _up = Running::start_env(
        &["up", "--config", path_str(&c.config)],
        "ready",
        &[("DUET_HISTORY_DIR", &history.display().to_string())],
    )
    .await;
    router_ready(http, 2).await;
    let secs_arg = secs.to_string();
    let mut args = vec![
        "chaos",
        "--config",
        path_str(&c.config),
        "--duration",
        &secs_arg,
        "--kill-every",
        "2",
        "--concurrency",
        "8",
        "--json",
    ];
    args.extend_from_slice(flags);
    let out = duet(&args).await;
    eprintln!("{}", out.stdout);
    // Progress on stderr every 5 s while the load runs; stdout keeps only the report.
    assert!(
        secs < 10 || out.stderr.contains(" requests: "),
        "no progress line: {}",
        out.stderr
    );
    let report: Value = serde_json::from_str(out.stdout.trim()).expect("a JSON report");
    assert_eq!(report["unfinished"], 0, "{report}");
    assert_eq!(report["corrupted"], 0, "{report}");
    assert_eq!(report["stranded_pages"], 0, "{report}");
    // Retries, migration and the router's restart without losing streams: at least 99 %.
    let rate = report["success_rate"].as_f64().unwrap_or(0.0);
    assert!(rate >= 0.99, "success rate {rate}: {report}");
    let faults: u64 = ["kills", "pauses", "crashes"]
        .iter()
        .filter_map(|k| report[k].as_object())
        .flat_map(|k| k.values().filter_map(Value::as_u64))
        .sum();
    assert!(faults >= secs / 3, "faults were dealt: {report}");
    // Every serving actor kind was hit (kills deal from a deck of all of them).
    for kind in ["router", "bootstrap", "worker", "sender", "receiver"] {
        assert!(
            report["kills"][kind].as_u64() >= Some(1),
            "no {kind} killed: {report}"
        );
    }
    // And every worker process, when asked.
    for (flag, what) in [("--pause", "pauses"), ("--crash", "crashes")] {
        if flags.contains(&flag) {
            for node in ["p0", "d0"] {
                assert!(
                    report[what][node].as_u64() >= Some(1),
                    "no {what} of {node}: {report}"
                );
            }
        }
    }
    assert!(out.status.success(), "{}", out.stderr);
    // Every page ownership event of the run, checked by an independent checker.
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/check_history.py");
    let check = tokio::process::Command::new("python3")
        .arg(script)
        .arg(&history)
        .output()
        .await
        .expect("python3");
    let verdict = String::from_utf8_lossy(&check.stdout);
    eprintln!("history: {verdict}");
    assert!(check.status.success(), "history violations: {verdict}");
    // Decode recorded its proofs (every end of a transfer revokes its grant first).
    let summary: Value = serde_json::from_str(verdict.trim()).expect("the checker's JSON");
    assert!(
        summary["revokes"].as_u64() >= Some(1),
        "no proven revoke recorded: {verdict}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn chaos_without_a_cluster_fails_at_once_naming_the_router() {
    let c = ClusterDir::new(&[("router", "router"), ("p0", "prefill")], "");
    c.credentials(&c.config).await;
    let start = std::time::Instant::now();
    let out = duet(&["chaos", "--config", path_str(&c.config), "--duration", "60"]).await;
    let took = start.elapsed();
    assert_eq!(out.status.code(), Some(2), "{}", out.stderr);
    let url = format!("http://127.0.0.1:{}", c.http);
    assert!(
        out.stderr.contains("no router answers") && out.stderr.contains(&url),
        "{}",
        out.stderr
    );
    assert!(took < std::time::Duration::from_secs(5), "took {took:?}");
}
