//! A client that streams a chat completion from a Duet router token by token, over the
//! OpenAI API's server-sent events, and reports the time to first token and the rate.
//!
//! ```sh
//! cargo run --example stream_client                              # a tiny cluster in this process
//! cargo run --example stream_client -- http://127.0.0.1:8000     # the router `duet up` started
//! ```
//!
//! Without a URL it starts a router, a prefill and a decode worker serving the tiny model
//! (every prompt prefilled by one and its KV streamed into the other's pages), so it runs
//! anywhere in seconds; with one it asks that router which model it serves.

mod common;

use std::io::Write;
use std::net::SocketAddr;
use std::time::Instant;

#[tokio::main]
async fn main() -> Result<(), String> {
    duet_runtime::telemetry::init_logs("warn");
    let (addr, _cluster): (SocketAddr, Option<common::Cluster>) = match std::env::args().nth(1) {
        Some(url) => {
            let host = url
                .trim_start_matches("http://")
                .trim_end_matches('/')
                .trim_end_matches("/v1");
            let addr = std::net::ToSocketAddrs::to_socket_addrs(host)
                .ok()
                .and_then(|mut a| a.next())
                .ok_or_else(|| format!("{url}: give http://HOST:PORT"))?;
            (addr, None)
        }
        None => {
            let c = common::Cluster::start(
                &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
                "disagg_threshold = 0",
                2,
            )
            .await;
            (c.http, Some(c))
        }
    };
    // What the router sends is data from the network: a clear error, never a panic.
    let (_, models) = common::get(addr, "/v1/models").map_err(|e| format!("http://{addr}: {e}"))?;
    let models: serde_json::Value = serde_json::from_str(&models)
        .map_err(|e| format!("http://{addr}/v1/models is not a model list: {e}"))?;
    let model = models["data"][0]["id"]
        .as_str()
        .ok_or_else(|| format!("http://{addr}/v1/models names no model: {models}"))?
        .to_string();
    println!(
        "streaming from http://{addr}/v1 (model {model}; the tiny model's random weights write noise):\n"
    );
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 32,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let start = Instant::now();
    let (mut first, mut pieces, mut usage) = (None, 0, serde_json::Value::Null);
    common::stream(addr, "/v1/chat/completions", &body, |event| {
        if let Some(text) = event["choices"][0]["delta"]["content"].as_str() {
            first.get_or_insert_with(|| start.elapsed());
            pieces += 1;
            print!("{text}");
            let _ = std::io::stdout().flush();
        }
        if !event["usage"].is_null() {
            usage = event["usage"].clone();
        }
    })
    .map_err(|e| format!("the stream from http://{addr}: {e}"))?;
    let total = start.elapsed();
    let first = first.ok_or_else(|| "the stream ended without a token".to_string())?;
    println!(
        "\n\n{pieces} chunks; first after {:.1} ms, all after {:.1} ms; usage {usage}",
        first.as_secs_f64() * 1e3,
        total.as_secs_f64() * 1e3
    );
    if usage["completion_tokens"].as_u64() > Some(0) {
        Ok(())
    } else {
        Err("the stream ended without its usage".into())
    }
}
