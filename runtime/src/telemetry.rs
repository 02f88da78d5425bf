//! Log setup for Duet processes: human-readable lines on stderr, filtered by `DUET_LOG`
//! (or `RUST_LOG`), default `info`.

use tracing_subscriber::EnvFilter;

/// Environment variable that sets the log filter (`RUST_LOG` syntax).
pub const LOG_ENV: &str = "DUET_LOG";

/// Installs the process-wide subscriber; a second call is a no-op.
pub fn init_logs(default_filter: &str) {
    let filter = std::env::var(LOG_ENV)
        .or_else(|_| std::env::var("RUST_LOG"))
        .ok()
        .and_then(|f| EnvFilter::try_new(f).ok())
        .unwrap_or_else(|| EnvFilter::new(default_filter));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}
