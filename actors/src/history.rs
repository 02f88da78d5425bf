//! The transfer history: with `DUET_HISTORY_DIR` set, each worker process appends one JSON
//! line per page-ownership event to `DIR/PID.jsonl`, for an independent checker
//! (`tests/python/check_history.py`) to verify after a fault run:
//!
//! - decode: `open` (an attempt reserved these pages), `publish` (its KV went live),
//!   `close` (its pages returned: abort drained, or the writer proven gone);
//! - prefill: `write_begin` / `write_end` (bytes into decode's pages), `done` (every write of
//!   the attempt fenced, the first token sent), `failed`.
//!
//! Times are the host's wall clock in nanoseconds (every process of a test shares the host).
//! Off (one relaxed load per event) unless the variable is set.

use std::io::Write;
use std::sync::{Mutex, OnceLock};

use duet_gpu::PageId;
use serde_json::{Value, json};

static LOG: OnceLock<Option<Mutex<std::fs::File>>> = OnceLock::new();

fn log() -> Option<&'static Mutex<std::fs::File>> {
    LOG.get_or_init(|| {
        let dir = std::env::var_os("DUET_HISTORY_DIR")?;
        let path = std::path::Path::new(&dir).join(format!("{}.jsonl", std::process::id()));
        match std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
        {
            Ok(f) => Some(Mutex::new(f)),
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "cannot write the history");
                None
            }
        }
    })
    .as_ref()
}

/// Whether events are recorded.
pub fn enabled() -> bool {
    log().is_some()
}

/// One page-ownership event of `attempt` (decode's ledger key) on decode node `node`'s
/// worker incarnation `incarnation`.
pub fn record(event: &str, node: &str, incarnation: u64, attempt: u64, pages: &[PageId]) {
    record_with(event, node, incarnation, attempt, pages, Value::Null);
}

/// [`record`] with extra fields.
pub fn record_with(
    event: &str,
    node: &str,
    incarnation: u64,
    attempt: u64,
    pages: &[PageId],
    extra: Value,
) {
    let Some(log) = log() else { return };
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut line = json!({
        "t": t, "event": event, "decode": node, "inc": format!("{incarnation:016x}"),
        "attempt": attempt, "pages": pages,
    });
    if let (Some(l), Value::Object(x)) = (line.as_object_mut(), extra) {
        l.extend(x);
    }
    let mut text = line.to_string();
    text.push('\n');
    let mut f = log.lock().unwrap_or_else(|p| p.into_inner());
    let _ = f.write_all(text.as_bytes());
}
