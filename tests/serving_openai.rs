//! The router and colocated workers on real processes, exercised with the official `openai`
//! Python client (installed from PyPI into a virtual environment the test creates).

mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use common::*;

const MODEL: &str = "SmolLM2-135M-Instruct";

async fn run_python(python: &std::path::Path, script: &str, base: &str) -> String {
    let out = tokio::process::Command::new(python)
        .arg(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("tests/python")
                .join(script),
        )
        .args([base, MODEL])
        .stdin(Stdio::null())
        .output()
        .await
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{script} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn serving(model: &std::path::Path, http_port: u16) -> String {
    format!(
        "[serving]\nmodel = \"{}\"\nhttp = \"127.0.0.1:{http_port}\"\nkv_pages = 160\nmax_batch_tokens = 256\n",
        model.display()
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn openai_client_against_a_live_cluster() {
    let model = real_model();
    let python = openai_python().await;
    let http = free_ports(1)[0];
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        &serving(&model, http),
    );
    let up = Running::up(&c.config).await;
    let base = format!("http://127.0.0.1:{http}");
    assert!(
        up.first_line.starts_with(&format!("ready {base} ")),
        "{}",
        up.first_line
    );
    poll("two ready workers", Duration::from_secs(60), || async {
        let text = http_get(&format!("{base}/ready")).await?;
        text.contains("\"workers\":2").then_some(())
    })
    .await;

    let out = run_python(&python, "openai_client.py", &base).await;
    assert!(out.contains("all checks passed"), "{out}");

    let out = run_python(&python, "openai_load.py", &base).await;
    assert!(out.contains("32 concurrent streams match"), "{out}");
    // After the disconnect the cluster goes quiet: every worker's pool is whole again (free,
    // or held only by the prefix cache, which gives pages back on demand).
    let token = c.token();
    for worker in ["p0", "d0"] {
        poll(
            &format!("{worker}'s pool whole again"),
            Duration::from_secs(30),
            || async {
                let addr = c.admin(worker);
                let total = metric(addr, &token, "duet_kv_pages_total", "").await;
                let free = metric(addr, &token, "duet_kv_pages_free", "").await;
                let cached = metric(addr, &token, "duet_kv_pages_cached", "").await;
                let running = metric(addr, &token, "duet_sequences_running", "").await;
                (total > 0.0 && running == 0.0 && free + cached == total).then_some(())
            },
        )
        .await;
    }
}

/// GET `url` and return the body (the router's public endpoints need no token).
async fn http_get(url: &str) -> Option<String> {
    let out = tokio::process::Command::new("curl")
        .args(["-s", "--max-time", "2", url])
        .output()
        .await
        .ok()?;
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_worker_requests_are_retried_on_the_other() {
    let model = real_model();
    let python = openai_python().await;
    let http = free_ports(1)[0];
    // One running sequence per worker, so requests queue up behind it.
    let extra = format!("{}max_running = 1\n", serving(&model, http));
    let c = ClusterDir::new(
        &[("router", "router"), ("d0", "decode"), ("d1", "decode")],
        &extra,
    );
    let _up = Running::up(&c.config).await;
    let base = format!("http://127.0.0.1:{http}");
    poll("two ready workers", Duration::from_secs(60), || async {
        http_get(&format!("{base}/ready"))
            .await?
            .contains("\"workers\":2")
            .then_some(())
    })
    .await;
    let token = c.token();
    let burst = tokio::process::Command::new(&python)
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/openai_burst.py"))
        .args([base.as_str(), MODEL, "8"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("burst");
    // Kill d0's worker while requests wait in its queue.
    poll("requests queued on d0", Duration::from_secs(60), || async {
        (metric(c.admin("d0"), &token, "duet_sequences_waiting", "").await >= 1.0).then_some(())
    })
    .await;
    let out = duet(&["kill", "--config", path_str(&c.config), "d0/decode/worker"]).await;
    assert!(out.status.success(), "{}", out.stderr);
    let out = burst.wait_with_output().await.expect("burst output");
    let lines: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(lines.len(), 8, "{lines:?}");
    // None fails: those waiting are retried, the one producing tokens continues on d1.
    assert!(lines.iter().all(|l| l == "ok"), "{lines:?}");
    let retried = metric(c.admin("router"), &token, "duet_router_retries_total", "").await;
    let migrated = metric(
        c.admin("router"),
        &token,
        "duet_router_migrations_total",
        "outcome=\"started\"",
    )
    .await;
    assert!(
        retried + migrated >= 1.0,
        "no request was moved ({lines:?})"
    );
}
