//! What tracing costs: one-token completions through a disaggregated cluster (router, prefill,
//! decode processes on loopback), with tracing off, on with every trace sampled, and on with
//! 1 % sampled, spans exported to a real Jaeger running on the same machine. Once with the tiny
//! model (the runtime, not the engine, is what is measured: the worst case for tracing) and
//! once with SmolLM2-135M. Each mode runs twice, interleaved; the best of the two counts.
//! `cargo bench --bench tracing_overhead`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use duet_runtime::admin::client::{Method, exchange};
use tokio::io::{AsyncBufReadExt, BufReader};

const REPS: usize = 300;
const CLIENTS: usize = 16;
const SECONDS: u64 = 5;

#[derive(Clone, Copy)]
enum Mode {
    Off,
    All,
    OnePercent,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Off => "tracing off",
            Mode::All => "tracing on, sampling 1.0",
            Mode::OnePercent => "tracing on, sampling 0.01",
        }
    }

    fn table(self, otlp: u16) -> String {
        match self {
            Mode::Off => String::new(),
            Mode::All => format!(
                "[telemetry]\notlp_endpoint = \"http://127.0.0.1:{otlp}\"\nsampler = \"always_on\"\n"
            ),
            Mode::OnePercent => format!(
                "[telemetry]\notlp_endpoint = \"http://127.0.0.1:{otlp}\"\n\
                 sampler = \"traceidratio\"\nsampler_arg = 0.01\n"
            ),
        }
    }
}

fn p50(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1e3
}

/// Starts a Jaeger (built by tools/jaeger/install.sh) on loopback; returns it and its OTLP port.
fn jaeger(dir: &Path) -> (std::process::Child, u16) {
    let bin = duet_runtime::testing::pinned_tool(
        &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tools/jaeger/install.sh"),
    );
    let ports = duet_runtime::testing::JaegerPorts::free();
    let path = dir.join("jaeger.yaml");
    std::fs::write(&path, duet_runtime::testing::jaeger_config(ports)).expect("jaeger config");
    let child = std::process::Command::new(bin)
        .arg("--config")
        .arg(path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start jaeger");
    (child, ports.otlp_http)
}

async fn run(model: &Path, mode: Mode, otlp: u16, reps: usize) -> (f64, f64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let ports = duet_runtime::testing::free_loopback_ports(4);
    let config = dir.path().join("cluster.toml");
    std::fs::write(
        &config,
        format!(
            "[serving]\nmodel = \"{}\"\nhttp = \"127.0.0.1:{}\"\nkv_pages = 256\n\
             disagg_threshold = 0\n{}\
             [[node]]\nname = \"router\"\nrole = \"router\"\naddress = \"127.0.0.1:{}\"\n\
             [[node]]\nname = \"p0\"\nrole = \"prefill\"\naddress = \"127.0.0.1:{}\"\n\
             [[node]]\nname = \"d0\"\nrole = \"decode\"\naddress = \"127.0.0.1:{}\"\n",
            model.display(),
            ports[0],
            mode.table(otlp),
            ports[1],
            ports[2],
            ports[3]
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
    let body = serde_json::json!({"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0});
    let call = move |body: serde_json::Value| async move {
        exchange(
            addr,
            "",
            Method::POST,
            "/v1/completions",
            Some(body),
            Duration::from_secs(30),
        )
        .await
        .is_ok_and(|(status, _)| status.is_success())
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    // Ready when a request goes through prefill and decode.
    while !call(body.clone()).await {
        assert!(Instant::now() < deadline, "the cluster never served");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut latencies = Vec::with_capacity(reps);
    for i in 0..reps + 20 {
        let start = Instant::now();
        assert!(call(body.clone()).await, "request failed");
        if i >= 20 {
            latencies.push(start.elapsed());
        }
    }
    let done = Arc::new(AtomicU64::new(0));
    let stop = Instant::now() + Duration::from_secs(SECONDS);
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (done, body) = (done.clone(), body.clone());
            tokio::spawn(async move {
                while Instant::now() < stop {
                    if call(body.clone()).await {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for c in clients {
        let _ = c.await;
    }
    if let Some(pid) = up.id() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
    let _ = tokio::time::timeout(Duration::from_secs(20), up.wait()).await;
    (
        done.load(Ordering::Relaxed) as f64 / SECONDS as f64,
        p50(latencies),
    )
}

fn main() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tiny = dir.path().join("tiny.gguf");
    std::fs::write(&tiny, duet_engine::tiny::tiny_model_bytes(1)).expect("tiny model");
    let (mut jaeger, otlp) = jaeger(dir.path());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let real = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(duet_fetch::MODEL_FILE);
    let real = duet_fetch::ensure_model(&real, &mut |_| {}).expect("the real model");
    let modes = [Mode::Off, Mode::All, Mode::OnePercent];
    for (model, label, reps) in [
        (tiny.as_path(), "tiny model", REPS),
        (real.as_path(), "SmolLM2-135M", REPS / 3),
    ] {
        let mut best = [(0.0f64, f64::MAX); 3];
        for _round in 0..2 {
            for (i, mode) in modes.iter().enumerate() {
                let (rps, p50) = runtime.block_on(run(model, *mode, otlp, reps));
                best[i] = (best[i].0.max(rps), best[i].1.min(p50));
            }
        }
        println!(
            "one-token completions through router + prefill + decode ({label}), best of 2 interleaved runs:"
        );
        let (off_rps, off_p50) = best[0];
        for (mode, (rps, p50)) in modes.iter().zip(best) {
            println!(
                "  {:<28} {rps:>7.0} requests/s ({:>5.1}% of off)   p50 {p50:>7.2} ms ({:+5.1}% vs off)",
                mode.name(),
                100.0 * rps / off_rps,
                100.0 * (p50 - off_p50) / off_p50,
            );
        }
    }
    let _ = jaeger.kill();
}
