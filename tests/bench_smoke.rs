//! `duet bench --experiment interference --quick`: both clusters start and stop, the workload
//! runs against each, and the JSON has every field the experiment promises (the decode worker's
//! step metrics and every request's record too).

mod common;

use common::*;
use serde_json::Value;

#[tokio::test(flavor = "multi_thread")]
async fn the_interference_experiment_writes_every_field() {
    let v = quick_run(&[]).await;
    // Both workers on this host: the KV went through shared memory, none over TCP.
    assert_eq!(v["disaggregated"]["params"]["kv_transport"], "auto");
    assert_eq!(v["disaggregated"]["decode_steps"]["kv_tcp_bytes"], 0, "{v}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_interference_experiment_moves_kv_over_tcp_when_asked() {
    let v = quick_run(&["--kv-transport", "tcp"]).await;
    // Every long prompt's KV came over the decode worker's socket.
    let bytes = v["disaggregated"]["decode_steps"]["kv_tcp_bytes"].as_u64();
    assert!(bytes > Some(0), "{v}");
    let wrong = duet(&[
        "bench",
        "--experiment",
        "interference",
        "--quick",
        "--kv-transport",
        "rdma",
    ])
    .await;
    assert!(!wrong.status.success() && wrong.stderr.contains("--kv-transport"));
}

/// `duet bench --experiment interference --quick` with `extra` flags: its JSON, checked for
/// every field (and its plots).
async fn quick_run(extra: &[&str]) -> Value {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("interference.json");
    let plots = dir.path().join("plots");
    let mut args = vec!["bench", "--experiment", "interference", "--quick"];
    args.extend_from_slice(extra);
    args.extend(["--json", path_str(&json), "--plots", path_str(&plots)]);
    let out = duet(&args).await;
    assert!(out.status.success(), "{}\n{}", out.stdout, out.stderr);
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("the JSON")).expect("JSON");
    every_field(&v, &plots);
    v
}

/// The fields every interference run's JSON holds, and its plots.
fn every_field(v: &Value, plots: &std::path::Path) {
    for mode in ["colocated", "disaggregated"] {
        let m = &v[mode];
        for field in [
            "itl_p50_ms",
            "itl_p99_ms",
            "itl_p999_ms",
            "itl_max_ms",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "throughput_tok_s",
        ] {
            assert!(m[field].is_f64(), "{mode}.{field} missing: {m}");
        }
        // The tail in order, and the longest gap a real one.
        let tail = ["itl_p50_ms", "itl_p99_ms", "itl_p999_ms", "itl_max_ms"]
            .map(|f| m[f].as_f64().unwrap_or(f64::NAN));
        assert!(
            tail.windows(2).all(|w| w[0] <= w[1]) && tail[3] > 0.0,
            "{mode}: ITL tail out of order: {tail:?}"
        );
        assert!(m["itl_over_100ms"].is_u64(), "{mode}: {m}");
        assert!(m["params"]["long_prompt"].is_u64(), "{mode}.params: {m}");
        assert_eq!(m["failed"], 0, "{mode}: requests failed: {m}");
        assert!(m["long_prompts"].as_u64() >= Some(1), "{mode}: {m}");
        assert!(m["throughput_tok_s"].as_f64() > Some(0.0), "{mode}: {m}");
        // The decode worker's own step metrics, read from its admin API: the steady
        // sequences decoded for seconds, so steps were counted, and every step computed a
        // token and attended over at least that token's own position.
        let steps = &m["decode_steps"];
        assert!(
            steps["steps"].as_u64() > Some(10),
            "{mode}.decode_steps: {steps}"
        );
        assert!(steps["mean_ms"].as_f64() > Some(0.0), "{mode}: {steps}");
        assert!(
            steps["tokens_mean"].as_f64() >= Some(1.0),
            "{mode}: {steps}"
        );
        assert!(
            steps["attended_mean"].as_f64() >= steps["tokens_mean"].as_f64(),
            "{mode}: {steps}"
        );
        // The step times' quantiles from the decode worker's histogram, and the router's
        // gaps from its own: in order, and the router's no shorter than a real gap.
        let (p50, p99) = (steps["step_p50_ms"].as_f64(), steps["step_p99_ms"].as_f64());
        assert!(p50 > Some(0.0) && p99 >= p50, "{mode}: {steps}");
        let router = &m["router_itl"];
        let (r50, r99) = (router["p50_ms"].as_f64(), router["p99_ms"].as_f64());
        assert!(r50 > Some(0.0) && r99 >= r50, "{mode}: {router}");
        // The host's steal, a share, where the kernel says it (every Linux CI runner).
        if std::path::Path::new("/proc/stat").exists() {
            let steal = m["host_steal"].as_f64();
            assert!(steal >= Some(0.0) && steal < Some(1.0), "{mode}: {m}");
        }
        // Disaggregated decode checked every transfer's KV, each in one turn or more, and
        // the colocated one received none.
        let checks = steps["kv_checks"].as_u64();
        if mode == "disaggregated" {
            assert!(
                checks > Some(0) && checks >= m["long_prompts"].as_u64(),
                "{mode}: {steps}"
            );
            assert!(
                steps["kv_check_turns_mean"].as_f64() >= Some(1.0),
                "{steps}"
            );
            assert!(steps["kv_check_ms_mean"].as_f64() > Some(0.0), "{steps}");
        } else {
            assert_eq!(checks, Some(0), "{mode}: {steps}");
        }
        // The prefill worker computed every long prompt (colocated has none).
        let prefill = &m["prefill_steps"];
        let long_tokens = m["long_prompts"]
            .as_u64()
            .zip(m["params"]["long_prompt"].as_u64());
        let want = long_tokens.map(|(n, len)| n * len);
        match mode {
            "disaggregated" => {
                assert!(prefill["tokens"].as_u64() >= want, "{prefill}");
                assert!(prefill["busy_ms"].as_f64() > Some(0.0), "{prefill}");
            }
            _ => assert_eq!(prefill["tokens"].as_u64(), Some(0), "{prefill}"),
        }
        // Every request, each gap with its time: the series the plots draw.
        let requests = v["requests"][mode].as_array().expect("requests per mode");
        // Every steady gap is in exactly one phase of the long prompts'.
        let steady_gaps: usize = requests
            .iter()
            .filter(|r| r["class"] == "steady")
            .filter_map(|r| r["itl"].as_array().map(Vec::len))
            .sum();
        let phases = &m["itl_by_phase"];
        let in_phases: u64 = ["prefilling", "joining", "quiet"]
            .iter()
            .filter_map(|p| phases[p]["gaps"].as_u64())
            .sum();
        assert_eq!(in_phases, steady_gaps as u64, "{mode}: {phases}");
        // The decode worker's step log, one line per step: at least the steps its histogram
        // had counted when it was scraped (just before), each step either while the prefill
        // worker computed or not, and its thread on CPU or waiting for its core.
        let split = &m["step_split"];
        let logged = split["steps"].as_u64();
        assert!(logged >= steps["steps"].as_u64(), "{mode}: {split} {steps}");
        let parts = split["while_prefilling"]["steps"]
            .as_u64()
            .zip(split["otherwise"]["steps"].as_u64());
        assert_eq!(parts.map(|(a, b)| a + b), logged, "{mode}: {split}");
        if mode == "colocated" {
            assert_eq!(split["while_prefilling"]["steps"], 0, "{split}");
        }
        if std::path::Path::new("/proc/thread-self/schedstat").exists() {
            let (cpu, waited) = (split["on_cpu"].as_f64(), split["waited"].as_f64());
            assert!(cpu > Some(0.0) && cpu <= Some(1.0), "{mode}: {split}");
            assert!(waited >= Some(0.0) && waited < Some(1.0), "{mode}: {split}");
        }
        assert!(
            requests.iter().any(|r| r["class"] == "steady"),
            "{mode}: no steady request"
        );
    }
    // The disaggregated TTFT's floor: the long prompt's prefill alone, and the ratio to it.
    assert!(v["prefill_alone_ms"].as_f64() > Some(0.0), "{v}");
    // Measured before the runs and after them; the ratios use the median of both sets.
    let alone = &v["prefill_alone"];
    let (b, a) = (alone["before_ms"].as_f64(), alone["after_ms"].as_f64());
    assert!(b > Some(0.0) && a > Some(0.0), "{alone}");
    assert_eq!(alone["ms"], v["prefill_alone_ms"], "{alone}");
    assert!(
        v["ratios"]["ttft_p50_disaggregated_over_prefill_alone"].as_f64() > Some(0.0),
        "{v}"
    );
    for png in ["itl_histogram.png", "itl_over_time.png", "ttft_cdf.png"] {
        let bytes = std::fs::read(plots.join(png)).expect(png);
        assert!(bytes.starts_with(b"\x89PNG"), "{png} is not a PNG");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn vllm_flag_names_num_prompts_and_a_rate_sweep() {
    let c = ClusterDir::tiny(&[("router", "router"), ("d0", "decode")], "");
    c.credentials(&c.config).await;
    let _up = Running::up(&c.config).await;
    router_ready(c.http, 1).await;
    let url = format!("http://127.0.0.1:{}", c.http);
    let dir = tempfile::tempdir().expect("tempdir");
    // `vllm bench serve`'s names: the request count ends the run, not the clock.
    let result = dir.path().join("result.json");
    let out = duet(&[
        "bench",
        "--base-url",
        &url,
        "--request-rate",
        "inf",
        "--max-concurrency",
        "3",
        "--random-input-len",
        "24",
        "--random-output-len",
        "4",
        "--num-prompts",
        "7",
        "--temperature",
        "1",
        "--top-p",
        "0.9",
        "--result-filename",
        path_str(&result),
    ])
    .await;
    assert!(out.status.success(), "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout.starts_with("7 requests in") && out.stdout.contains("(0 failed)"),
        "{}",
        out.stdout
    );
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(&result).expect("result")).expect("JSON");
    assert_eq!(v["requests"].as_array().map(Vec::len), Some(7), "{v}");
    // A sweep over two rates: a row each, and the curve.
    let plots = dir.path().join("plots");
    let out = duet(&[
        "bench",
        "--url",
        &url,
        "--sweep",
        "2,8",
        "--num-prompts",
        "6",
        "--prompt-len",
        "24",
        "--output-len",
        "4",
        "--plots",
        path_str(&plots),
    ])
    .await;
    assert!(out.status.success(), "{}\n{}", out.stdout, out.stderr);
    let rows: Vec<&str> = out.stdout.lines().skip(1).take(2).collect();
    assert!(rows[0].trim_start().starts_with("2.00"), "{}", out.stdout);
    assert!(rows[1].trim_start().starts_with("8.00"), "{}", out.stdout);
    let png = std::fs::read(plots.join("sweep.png")).expect("sweep.png");
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    // The sampling flags reach every request: out of OpenAI's ranges (a temperature of 2.5, a
    // top_p of 0), the router refuses each of the two.
    for sampling in [
        &["--temperature", "2.5"][..],
        &["--temperature", "1", "--top-p", "0"],
    ] {
        let mut args = vec![
            "bench",
            "--url",
            &url,
            "--num-prompts",
            "2",
            "--prompt-len",
            "24",
            "--output-len",
            "4",
        ];
        args.extend_from_slice(sampling);
        let out = duet(&args).await;
        assert!(
            out.stdout.contains("(2 failed)"),
            "{sampling:?}: {}\n{}",
            out.stdout,
            out.stderr
        );
    }
    let bad = duet(&["bench", "--url", &url, "--request-rate", "0"]).await;
    assert!(!bad.status.success());
    assert!(
        bad.stderr.contains("a rate is requests per second"),
        "{}",
        bad.stderr
    );
}
