//! A small client of the admin API, used by `duet tree`, `duet kill` and the tests.

use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper::body::Bytes;
pub use hyper::{Method, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::Value;

/// A failed admin call.
#[derive(Debug, thiserror::Error)]
pub enum AdminClientError {
    /// Nothing answered at the address.
    #[error("cannot reach the admin API at {addr}: {reason}")]
    Unreachable {
        /// The admin address.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
    /// The node answered with an error.
    #[error("{message}")]
    Api {
        /// HTTP status.
        status: StatusCode,
        /// The error's `type`.
        kind: String,
        /// The error's message.
        message: String,
        /// Nearest existing paths, for not-found errors.
        nearest: Vec<String>,
    },
    /// The answer was not JSON.
    #[error("the admin API at {addr} answered something that is not JSON: {reason}")]
    BadAnswer {
        /// The admin address.
        addr: SocketAddr,
        /// The parse error.
        reason: String,
    },
}

/// Calls `method path` on the admin API at `addr` with the cluster token; a JSON answer.
pub async fn call(
    addr: SocketAddr,
    token: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
    timeout: Duration,
) -> Result<Value, AdminClientError> {
    let (status, raw) = exchange(addr, token, method, path, body, timeout).await?;
    let value: Value = serde_json::from_slice(&raw).map_err(|e| AdminClientError::BadAnswer {
        addr,
        reason: e.to_string(),
    })?;
    if status.is_success() {
        return Ok(value);
    }
    let err = &value["error"];
    Err(AdminClientError::Api {
        status,
        kind: err["type"].as_str().unwrap_or("unknown").to_string(),
        message: err["message"].as_str().unwrap_or("no message").to_string(),
        nearest: err["nearest"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default(),
    })
}

/// `GET /metrics` as text.
pub async fn metrics_text(
    addr: SocketAddr,
    token: &str,
    timeout: Duration,
) -> Result<String, AdminClientError> {
    let (status, raw) = exchange(addr, token, Method::GET, "/metrics", None, timeout).await?;
    if !status.is_success() {
        return Err(AdminClientError::Api {
            status,
            kind: "http".into(),
            message: String::from_utf8_lossy(&raw).into_owned(),
            nearest: vec![],
        });
    }
    Ok(String::from_utf8_lossy(&raw).into_owned())
}

/// One request and its whole answer, within `timeout` (`token` empty: no credentials sent).
pub async fn exchange(
    addr: SocketAddr,
    token: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
    timeout: Duration,
) -> Result<(StatusCode, Bytes), AdminClientError> {
    match tokio::time::timeout(timeout, exchange_inner(addr, token, method, path, body)).await {
        Ok(r) => r,
        Err(_) => Err(AdminClientError::Unreachable {
            addr,
            reason: format!("no answer within {timeout:?}"),
        }),
    }
}

async fn exchange_inner(
    addr: SocketAddr,
    token: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> Result<(StatusCode, Bytes), AdminClientError> {
    let unreachable = |reason: String| AdminClientError::Unreachable { addr, reason };
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    tokio::spawn(conn);
    let bytes = body.map(|b| b.to_string()).unwrap_or_default();
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json");
    // No token, no header: the same client asks servers that are not Duet's (Jaeger's query
    // API), which must never see the cluster's credentials.
    if !token.is_empty() {
        req = req.header("authorization", format!("Bearer {token}"));
    }
    let req = req
        .body(Full::new(Bytes::from(bytes)))
        .map_err(|e| unreachable(e.to_string()))?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    let status = resp.status();
    let raw = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| unreachable(e.to_string()))?
        .to_bytes();
    Ok((status, raw))
}
