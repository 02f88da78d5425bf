//! One streaming completion against the router's OpenAI API, timed token by token.
//!
//! Plain HTTP/1.1 over a fresh loopback connection per request (hyper), the body read frame by
//! frame as it arrives; each SSE `data:` event with a choice is one token.

use std::net::SocketAddr;
use std::time::Instant;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use serde_json::{Value, json};

use super::stats::RequestRecord;

/// How a request samples (`duet bench --temperature`, `--top-p`); greedy by default.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0: greedy.
    pub temperature: f32,
    /// Nucleus (1: off).
    pub top_p: f32,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_p: 1.0,
        }
    }
}

/// What to send.
#[derive(Debug, Clone)]
pub struct Ask {
    /// Prompt token ids (exact lengths, whatever the tokenizer).
    pub prompt: Vec<u32>,
    /// Tokens to generate (EOS is ignored so the length is exact).
    pub max_tokens: usize,
    /// How it samples.
    pub sampling: Sampling,
    /// Workload class, carried into the record.
    pub class: &'static str,
    /// Stop reading at this instant and keep what arrived (closing the connection cancels the
    /// request): sequences meant to decode for the whole run.
    pub until: Option<Instant>,
}

/// Sends `ask` to the router at `addr`; `epoch` is the run's start (record times are relative
/// to it).
pub async fn stream_completion(addr: SocketAddr, ask: &Ask, epoch: Instant) -> RequestRecord {
    let sent = Instant::now();
    let mut rec = RequestRecord {
        sent_s: sent.duration_since(epoch).as_secs_f64(),
        prompt_tokens: ask.prompt.len(),
        class: ask.class,
        ..Default::default()
    };
    if let Err(e) = run(addr, ask, epoch, sent, &mut rec).await {
        rec.error = Some(e);
    }
    rec
}

/// A fresh HTTP/1.1 connection to `addr` (no Nagle delay: tokens are small writes), and the
/// task that drives it.
async fn connect(
    addr: SocketAddr,
) -> Result<
    (
        hyper::client::conn::http1::SendRequest<Full<Bytes>>,
        tokio::task::JoinHandle<hyper::Result<()>>,
    ),
    String,
> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    let _ = stream.set_nodelay(true);
    let (sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
    Ok((sender, tokio::spawn(conn)))
}

/// The model the router at `addr` serves (`/v1/models`), asked once per address: requests must
/// name it.
async fn served_model(addr: SocketAddr) -> Result<String, String> {
    static SEEN: std::sync::Mutex<Vec<(SocketAddr, String)>> = std::sync::Mutex::new(Vec::new());
    if let Some((_, m)) = SEEN
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .find(|(a, _)| *a == addr)
    {
        return Ok(m.clone());
    }
    let (mut sender, driver) = connect(addr).await?;
    let req = hyper::Request::get("/v1/models")
        .header("host", addr.to_string())
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| format!("/v1/models: {e}"))?;
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("/v1/models: {e}"))?
        .to_bytes();
    driver.abort();
    let v: Value = serde_json::from_slice(&body).map_err(|e| format!("/v1/models: {e}"))?;
    let model = v["data"][0]["id"]
        .as_str()
        .ok_or_else(|| format!("/v1/models names no model: {v}"))?
        .to_string();
    SEEN.lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((addr, model.clone()));
    Ok(model)
}

async fn run(
    addr: SocketAddr,
    ask: &Ask,
    epoch: Instant,
    sent: Instant,
    rec: &mut RequestRecord,
) -> Result<(), String> {
    let body = json!({
        "model": served_model(addr).await?,
        "prompt": ask.prompt,
        "max_tokens": ask.max_tokens,
        "temperature": ask.sampling.temperature,
        "top_p": ask.sampling.top_p,
        "ignore_eos": true,
        "stream": true,
    })
    .to_string();
    let (mut sender, driver) = connect(addr).await?;
    let req = hyper::Request::post("/v1/completions")
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| format!("request: {e}"))?;
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp
            .into_body()
            .collect()
            .await
            .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
            .unwrap_or_default();
        driver.abort();
        return Err(format!("HTTP {status}: {text}"));
    }
    let mut body = resp.into_body();
    let mut buf = String::new();
    let mut last: Option<Instant> = None;
    let mut done = false;
    let mut cut = false;
    while !done {
        let next = match ask.until {
            Some(until) => match tokio::time::timeout_at(until.into(), body.frame()).await {
                Ok(f) => f,
                Err(_) => {
                    cut = true; // the run is over: keep the partial record
                    break;
                }
            },
            None => body.frame().await,
        };
        let Some(frame) = next else {
            break;
        };
        let frame = frame.map_err(|e| format!("body: {e}"))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let now = Instant::now();
        buf.push_str(&String::from_utf8_lossy(&data));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            for line in event.lines() {
                let Some(payload) = line.strip_prefix("data:").map(str::trim) else {
                    continue;
                };
                if payload == "[DONE]" {
                    done = true;
                    continue;
                }
                let v: Value = serde_json::from_str(payload)
                    .map_err(|e| format!("bad SSE event `{payload}`: {e}"))?;
                if let Some(err) = v.get("error") {
                    return Err(format!("stream error: {err}"));
                }
                if !v["choices"][0].is_object() {
                    continue; // the usage chunk
                }
                rec.tokens += 1;
                if let Some(t) = v["choices"][0]["text"].as_str() {
                    rec.text.push_str(t);
                }
                match last {
                    None => rec.ttft_s = Some(now.duration_since(sent).as_secs_f64()),
                    Some(prev) => rec.itl.push((
                        now.duration_since(prev).as_secs_f64(),
                        now.duration_since(epoch).as_secs_f64(),
                    )),
                }
                last = Some(now);
            }
        }
    }
    driver.abort();
    if rec.tokens == 0 && !cut {
        return Err("the stream ended without a token".into());
    }
    rec.e2e_s = last.map(|l| l.duration_since(sent).as_secs_f64());
    Ok(())
}
