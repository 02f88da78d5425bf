//! A request's trace, fetched from Jaeger and printed: this example starts a Jaeger (built
//! from source by `tools/jaeger/install.sh`, cached after the first build), a cluster that
//! exports its spans to it over OTLP, sends one request carrying a W3C `traceparent`, then asks
//! Jaeger's query API for that trace and prints its spans under their parents.
//!
//! ```sh
//! cargo run --example fetch_trace
//! ```
//!
//! The nodes here share one process, so their spans come from one service (`duet-cluster`);
//! a cluster of processes (`duet up`) gives one service per node, and `duet trace ID` draws
//! the same trace as a waterfall.

mod common;

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Jaeger on loopback, stopped when dropped.
struct Jaeger {
    child: Child,
    query: u16,
    otlp: u16,
    _dir: tempfile::TempDir,
}

impl Drop for Jaeger {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_jaeger() -> Jaeger {
    let bin = duet_runtime::testing::pinned_tool(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tools/jaeger/install.sh"
    )));
    let ports = duet_runtime::testing::JaegerPorts::free();
    let (query, otlp) = (ports.query, ports.otlp_http);
    let config = duet_runtime::testing::jaeger_config(ports);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("jaeger.yaml");
    std::fs::write(&path, config).expect("jaeger.yaml");
    let child = Command::new(bin)
        .arg("--config")
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start Jaeger");
    Jaeger {
        child,
        query,
        otlp,
        _dir: dir,
    }
}

fn print_span(
    id: &str,
    spans: &HashMap<&str, &Value>,
    kids: &HashMap<&str, Vec<&str>>,
    depth: usize,
) {
    let s = spans[id];
    let name = format!(
        "{}{}",
        "  ".repeat(depth),
        s["operationName"].as_str().unwrap_or("?")
    );
    println!(
        "{name:<32} {:>9.2} ms",
        s["duration"].as_f64().unwrap_or(0.0) / 1e3
    );
    for k in kids.get(id).into_iter().flatten() {
        print_span(k, spans, kids, depth + 1);
    }
}

#[tokio::main]
async fn main() {
    let jaeger = start_jaeger();
    let query = std::net::SocketAddr::from(([127, 0, 0, 1], jaeger.query));
    let deadline = Instant::now() + Duration::from_secs(60);
    while common::get(query, "/api/services").is_err() {
        assert!(Instant::now() < deadline, "Jaeger did not start");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "Jaeger: query API http://{query}, OTLP http://127.0.0.1:{}",
        jaeger.otlp
    );
    let extra = format!(
        "disagg_threshold = 0\n\n[telemetry]\notlp_endpoint = \"http://127.0.0.1:{}\"\n\
         sampler = \"always_on\"\n",
        jaeger.otlp
    );
    let c = common::Cluster::start(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        &extra,
        2,
    )
    .await;
    // The export of this process (one for all its nodes), from the file's [telemetry].
    let _guard = duet_runtime::telemetry::init_node(&c.config.telemetry, "cluster", "warn")
        .expect("OTLP export");

    // One request whose trace id we choose, as a client with its own tracing would.
    let trace_id = format!("{:032x}", rand_id());
    let body =
        serde_json::json!({"model": "tiny", "prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 4});
    let body = body.to_string();
    let mut s = std::net::TcpStream::connect(c.http).expect("the router");
    use std::io::{Read, Write};
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\n\
         traceparent: 00-{trace_id}-00f067aa0ba902b7-01\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{body}",
        c.http,
        body.len()
    )
    .expect("send");
    let mut reply = String::new();
    s.read_to_string(&mut reply).expect("reply");
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    println!("sent a completion with trace id {trace_id}; waiting for its spans in Jaeger");

    let deadline = Instant::now() + Duration::from_secs(60);
    let trace = loop {
        let got = common::get(query, &format!("/api/traces/{trace_id}"))
            .ok()
            .and_then(|(_, b)| serde_json::from_str::<Value>(&b).ok())
            .and_then(|v| v["data"].get(0).cloned());
        let done = got.as_ref().is_some_and(|t| {
            t["spans"].as_array().is_some_and(|s| {
                s.iter().any(|s| s["operationName"] == "decoding")
                    && s.iter().any(|s| s["operationName"] == "prefill")
            })
        });
        if let (true, Some(t)) = (done, got) {
            break t;
        }
        assert!(
            Instant::now() < deadline,
            "the trace never reached Jaeger whole: {:?}",
            common::get(query, &format!("/api/traces/{trace_id}"))
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let list = trace["spans"].as_array().expect("spans");
    let spans: HashMap<&str, &Value> = list
        .iter()
        .filter_map(|s| Some((s["spanID"].as_str()?, s)))
        .collect();
    let mut kids: HashMap<&str, Vec<&str>> = HashMap::new();
    let mut roots = Vec::new();
    let mut ordered: Vec<&Value> = list.iter().collect();
    ordered.sort_by_key(|s| s["startTime"].as_u64());
    for s in ordered {
        let id = s["spanID"].as_str().unwrap_or_default();
        let parent = s["references"][0]["spanID"]
            .as_str()
            .filter(|p| spans.contains_key(p));
        match parent {
            Some(p) => kids.entry(p).or_default().push(id),
            None => roots.push(id),
        }
    }
    println!("\ntrace {trace_id}: {} spans", list.len());
    for r in roots {
        print_span(r, &spans, &kids, 1);
    }
}

/// A random 128-bit id (the clock and the process id are enough for an example).
fn rand_id() -> u128 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    t ^ (u128::from(std::process::id()) << 64) | 1
}
