//! The router's HTTP access log: one line per request, at info under the log target
//! `duet::access`, written when the request is over (for a stream, when its last event is
//! sent or the client leaves), with what an operator reads first: method, path, status,
//! prompt, cached and completion tokens, time to first token, total time, finish reason and
//! Duet's request id. Probes (`/health`, `/ready`) and scrapes (`/metrics`) get none.
//!
//! The middleware puts an [`Access`] in the request's extensions; the generation behind the
//! request keeps a clone and fills it in; the line goes out when the last clone drops. Turned
//! off with `[serving] access_log = false` (or the filter `duet::access=off`).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::Response;

use super::shared::RouterShared;

/// Log target of the access lines.
pub const TARGET: &str = "duet::access";

/// One request's line, shared by the middleware and the generation serving it.
#[derive(Clone)]
pub(super) struct Access(Arc<Entry>);

struct Entry {
    method: String,
    path: String,
    started: Instant,
    line: Mutex<Line>,
}

#[derive(Default)]
struct Line {
    status: u16,
    request: Option<u64>,
    prompt_tokens: usize,
    cached_tokens: usize,
    completion_tokens: usize,
    ttft: Option<f64>,
    finish: Option<String>,
    error: Option<String>,
}

impl Access {
    fn edit(&self, f: impl FnOnce(&mut Line)) {
        f(&mut self.0.line.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// The request Duet serves it as, and its prompt.
    pub fn started(&self, request: u64, prompt_tokens: usize) {
        self.edit(|l| {
            l.request = Some(request);
            l.prompt_tokens = prompt_tokens;
        });
    }

    /// A token reached the client's stream (the first one sets the TTFT).
    pub fn token(&self, cached_tokens: usize) {
        let since = self.0.started.elapsed().as_secs_f64();
        self.edit(|l| {
            l.completion_tokens += 1;
            l.cached_tokens += cached_tokens;
            l.ttft.get_or_insert(since);
        });
    }

    /// The generation finished with `reason`.
    pub fn finished(&self, reason: &str) {
        self.edit(|l| l.finish = Some(reason.to_string()));
    }

    /// The request failed after its status was sent (a stream that broke): the line says why.
    pub fn failed(&self, error: &str) {
        self.edit(|l| l.error = Some(error.to_string()));
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        let l = self.line.get_mut().unwrap_or_else(|e| e.into_inner());
        let ms = |s: f64| (s * 1e4).round() / 10.0;
        // Token counts only for a request that reached a worker.
        let tokens = |n: usize| l.request.map(|_| n);
        tracing::info!(
            target: TARGET,
            method = %self.method,
            path = %self.path,
            status = l.status,
            request = l.request,
            prompt_tokens = tokens(l.prompt_tokens),
            cached_tokens = tokens(l.cached_tokens),
            completion_tokens = tokens(l.completion_tokens),
            ttft_ms = l.ttft.map(ms),
            total_ms = ms(self.started.elapsed().as_secs_f64()),
            finish_reason = l.finish.as_deref(),
            error = l.error.as_deref(),
            "{} {} {}",
            self.method,
            self.path,
            l.status
        );
    }
}

/// The middleware: an [`Access`] for every request when the log is on.
pub(super) async fn layer(
    State(s): State<Arc<RouterShared>>,
    mut req: Request,
    next: axum::middleware::Next,
) -> Response {
    // Probes and scrapers ask every few seconds: their lines would drown the requests'.
    let probe = matches!(req.uri().path(), "/health" | "/ready" | "/metrics");
    if !s.settings.access_log || probe {
        return next.run(req).await;
    }
    let access = Access(Arc::new(Entry {
        method: req.method().to_string(),
        path: req.uri().path().to_string(),
        started: Instant::now(),
        line: Mutex::new(Line::default()),
    }));
    req.extensions_mut().insert(access.clone());
    let response = next.run(req).await;
    let status: StatusCode = response.status();
    access.edit(|l| l.status = status.as_u16());
    response
}
