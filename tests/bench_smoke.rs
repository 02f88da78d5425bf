//! `duet bench --experiment interference --quick`: both clusters start and stop, the workload
//! runs against each, and the JSON has every field the experiment promises.

mod common;

use common::*;
use serde_json::Value;

#[tokio::test(flavor = "multi_thread")]
async fn the_interference_experiment_writes_every_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("interference.json");
    let plots = dir.path().join("plots");
    let out = duet(&[
        "bench",
        "--experiment",
        "interference",
        "--quick",
        "--json",
        path_str(&json),
        "--plots",
        path_str(&plots),
    ])
    .await;
    assert!(out.status.success(), "{}\n{}", out.stdout, out.stderr);
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("the JSON")).expect("JSON");
    for mode in ["colocated", "disaggregated"] {
        let m = &v[mode];
        for field in [
            "itl_p50_ms",
            "itl_p99_ms",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "throughput_tok_s",
        ] {
            assert!(m[field].is_f64(), "{mode}.{field} missing: {m}");
        }
        assert!(m["params"]["long_prompt"].is_u64(), "{mode}.params: {m}");
        assert_eq!(m["failed"], 0, "{mode}: requests failed: {m}");
        assert!(m["long_prompts"].as_u64() >= Some(1), "{mode}: {m}");
        assert!(m["throughput_tok_s"].as_f64() > Some(0.0), "{mode}: {m}");
    }
    for png in ["itl_histogram.png", "itl_over_time.png", "ttft_cdf.png"] {
        let bytes = std::fs::read(plots.join(png)).expect(png);
        assert!(bytes.starts_with(b"\x89PNG"), "{png} is not a PNG");
    }
}
