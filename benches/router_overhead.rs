//! What the router adds: one-token completions through a real cluster (router + one colocated
//! worker, separate processes, HTTP and QUIC on loopback) beside the same completion run by the
//! engine in this process (what `duet generate` does), and the rate of one-token completions
//! the router sustains with concurrent clients. `cargo bench --bench router_overhead`.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use duet_engine::{Engine, EngineOptions, Model, Runner, SamplingParams};
use duet_fetch as fetch;
use duet_runtime::admin::client::{Method, exchange};
use tokio::io::{AsyncBufReadExt, BufReader};

const PROMPT: &str = "The capital of France is";
const REPS: usize = 300;

fn percentiles(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let at = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e3;
    (at(0.5), at(0.99))
}

fn main() {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(fetch::MODEL_FILE);
    let model = fetch::ensure_model(&model, &mut |_| {}).expect("model");
    let in_process = in_process(&model);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (router, rps) = runtime.block_on(through_router(&model, "SmolLM2-135M-Instruct"));
    // The router's own ceiling, with an engine so small that it is not the bottleneck.
    let tiny_dir = tempfile::tempdir().expect("tempdir");
    let tiny = tiny_dir.path().join("tiny.gguf");
    std::fs::write(&tiny, duet_engine::tiny::tiny_model_bytes(1)).expect("tiny model");
    let (_, tiny_rps) = runtime.block_on(through_router(&tiny, "tiny"));
    let (a50, a99) = percentiles(in_process);
    let (r50, r99) = percentiles(router);
    println!("one-token completion, {REPS} sequential requests, prompt {PROMPT:?}:");
    println!("  engine in process (duet generate path)  p50 {a50:>7.2} ms   p99 {a99:>7.2} ms");
    println!("  through the router (HTTP + QUIC)        p50 {r50:>7.2} ms   p99 {r99:>7.2} ms");
    println!(
        "  added by the router                     p50 {:>7.2} ms   p99 {:>7.2} ms",
        r50 - a50,
        r99 - a99
    );
    println!(
        "  sustained one-token completions, 16 concurrent clients: {rps:.0} requests/s (SmolLM2: engine-bound)"
    );
    println!(
        "  the same with the tiny model (router-bound):              {tiny_rps:.0} requests/s"
    );
}

fn in_process(model: &std::path::Path) -> Vec<Duration> {
    let engine = Engine::new(
        Model::open(model).expect("model"),
        EngineOptions {
            kv_pages: 64,
            threads: 1,
            ..EngineOptions::default()
        },
    )
    .expect("engine");
    let mut runner = Runner::new(engine, 256, 64);
    let prompt = runner.engine.model.tokenizer.encode(PROMPT);
    let params = SamplingParams {
        max_tokens: 1,
        ..SamplingParams::default()
    };
    let mut out = Vec::with_capacity(REPS);
    for i in 0..REPS + 20 {
        let start = Instant::now();
        runner
            .submit(i as u64, prompt.clone(), params.clone())
            .expect("submit");
        runner.run_to_completion().expect("run");
        if i >= 20 {
            out.push(start.elapsed());
        }
    }
    out
}

async fn through_router(model: &std::path::Path, name: &str) -> (Vec<Duration>, f64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let ports = duet_runtime::testing::free_loopback_ports(3);
    let config = dir.path().join("cluster.toml");
    std::fs::write(
        &config,
        format!(
            "[serving]\nmodel = \"{}\"\nmodel_name = \"{name}\"\nhttp = \"127.0.0.1:{}\"\nkv_pages = 256\n\
             [[node]]\nname = \"router\"\nrole = \"router\"\naddress = \"127.0.0.1:{}\"\n\
             [[node]]\nname = \"w0\"\nrole = \"decode\"\naddress = \"127.0.0.1:{}\"\n",
            model.display(),
            ports[0],
            ports[1],
            ports[2]
        ),
    )
    .expect("config");
    let mut up = tokio::process::Command::new(env!("CARGO_BIN_EXE_duet"))
        .args(["up", "--config"])
        .arg(&config)
        .env("DUET_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("duet up");
    let mut lines = BufReader::new(up.stdout.take().expect("stdout")).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if line.starts_with("ready") {
            break;
        }
    }
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], ports[0]));
    let body =
        serde_json::json!({"model": name, "prompt": PROMPT, "max_tokens": 1, "temperature": 0});
    let call = || async {
        exchange(
            addr,
            "",
            Method::POST,
            "/v1/completions",
            Some(body.clone()),
            Duration::from_secs(30),
        )
        .await
        .map(|(status, _)| status.is_success())
        .unwrap_or(false)
    };
    // Wait (with a deadline) until the worker has reported and requests go through.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !call().await {
        assert!(Instant::now() < deadline, "the cluster never served");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut out = Vec::with_capacity(REPS);
    for i in 0..REPS + 20 {
        let start = Instant::now();
        assert!(call().await, "request failed");
        if i >= 20 {
            out.push(start.elapsed());
        }
    }
    let done = Arc::new(AtomicU64::new(0));
    let stop = Instant::now() + Duration::from_secs(5);
    let clients: Vec<_> = (0..16)
        .map(|_| {
            let (done, body) = (done.clone(), body.clone());
            tokio::spawn(async move {
                while Instant::now() < stop {
                    let ok = exchange(
                        addr,
                        "",
                        Method::POST,
                        "/v1/completions",
                        Some(body.clone()),
                        Duration::from_secs(30),
                    )
                    .await
                    .is_ok_and(|(s, _)| s.is_success());
                    if ok {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for c in clients {
        let _ = c.await;
    }
    let rps = done.load(Ordering::Relaxed) as f64 / 5.0;
    if let Some(pid) = up.id() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
    let _ = tokio::time::timeout(Duration::from_secs(20), up.wait()).await;
    (out, rps)
}
