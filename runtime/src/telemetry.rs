//! Logs and traces for Duet processes.
//!
//! Logs: lines on stderr, filtered by `DUET_LOG` (or `RUST_LOG`), default `info`; text, or one
//! JSON object per line with `telemetry.log_format = "json"` (or `DUET_LOG_FORMAT=json`).
//! Fields of the spans a line is in (request, room, attempt) are on the line.
//!
//! Traces: off unless an OTLP endpoint is configured. Then every span at info level and above
//! goes over OTLP/HTTP (protobuf) to that endpoint in batches, from a background thread, under
//! the service name `duet-NODE` (or `$OTEL_SERVICE_NAME-NODE`). The standard variables win over
//! `[telemetry]`: `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, used
//! as is), `OTEL_SERVICE_NAME`, `OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG`.
//!
//! The trace context crosses nodes in every envelope's W3C `traceparent`: [`traceparent`]
//! reads the current span's, [`follow`] makes a span continue a remote one. When tracing is
//! off both return at once (one atomic load), so the request path pays nothing.

use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState, TracerProvider,
};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::config::TelemetryConfig;

/// Environment variable that sets the log filter (`RUST_LOG` syntax).
pub const LOG_ENV: &str = "DUET_LOG";
/// Environment variable that selects JSON logs (`json`) or text (`text`).
pub const LOG_FORMAT_ENV: &str = "DUET_LOG_FORMAT";

static TRACING: AtomicBool = AtomicBool::new(false);

/// Whether spans are exported (an OTLP endpoint is configured).
pub fn enabled() -> bool {
    TRACING.load(Ordering::Relaxed)
}

fn log_filter(default_filter: &str) -> EnvFilter {
    std::env::var(LOG_ENV)
        .or_else(|_| std::env::var("RUST_LOG"))
        .ok()
        .and_then(|f| EnvFilter::try_new(f).ok())
        .unwrap_or_else(|| EnvFilter::new(default_filter))
}

fn json_logs(config: Option<&TelemetryConfig>) -> bool {
    match std::env::var(LOG_FORMAT_ENV).as_deref() {
        Ok("json") => true,
        Ok("text") => false,
        _ => config.is_some_and(|c| c.json_logs),
    }
}

/// Installs the process-wide subscriber with logs only; a second call is a no-op.
pub fn init_logs(default_filter: &str) {
    let filter = log_filter(default_filter);
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(false);
    let fmt = if json_logs(None) {
        fmt.json().with_filter(filter).boxed()
    } else {
        fmt.with_filter(filter).boxed()
    };
    let _ = tracing_subscriber::registry().with(fmt).try_init();
}

/// Flushes and stops the trace exporter when dropped (at the end of a node's life).
#[must_use = "dropping the guard stops the trace exporter"]
pub struct TelemetryGuard(Option<SdkTracerProvider>);

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take()
            && let Err(e) = p.shutdown()
        {
            eprintln!("warning: traces not flushed: {e}");
        }
    }
}

/// Where traces go, after the environment overrides the file.
fn otlp_traces_url(config: &TelemetryConfig) -> Option<String> {
    if let Ok(url) = std::env::var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        && !url.is_empty()
    {
        return Some(url);
    }
    let base = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
        .ok()
        .filter(|u| !u.is_empty())
        .or_else(|| config.otlp_endpoint.clone())?;
    Some(format!("{}/v1/traces", base.trim_end_matches('/')))
}

/// The sampler the environment or the file asks for.
pub fn sampler(config: &TelemetryConfig) -> Result<Sampler, String> {
    let name = std::env::var("OTEL_TRACES_SAMPLER").unwrap_or_else(|_| config.sampler.clone());
    let arg = match std::env::var("OTEL_TRACES_SAMPLER_ARG") {
        Ok(a) => a
            .parse::<f64>()
            .ok()
            .filter(|r| (0.0..=1.0).contains(r))
            .ok_or_else(|| {
                format!("OTEL_TRACES_SAMPLER_ARG=`{a}`: expected a ratio from 0 to 1")
            })?,
        Err(_) => config.sampler_arg,
    };
    Ok(match name.as_str() {
        "always_on" => Sampler::AlwaysOn,
        "always_off" => Sampler::AlwaysOff,
        "traceidratio" => Sampler::TraceIdRatioBased(arg),
        "parentbased_always_on" => Sampler::ParentBased(Box::new(Sampler::AlwaysOn)),
        "parentbased_always_off" => Sampler::ParentBased(Box::new(Sampler::AlwaysOff)),
        "parentbased_traceidratio" => {
            Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(arg)))
        }
        other => {
            return Err(format!(
                "OTEL_TRACES_SAMPLER=`{other}` is not one of {}",
                crate::config::SAMPLERS.join(", ")
            ));
        }
    })
}

/// Installs logs and, when an OTLP endpoint is configured, trace export for node `node`.
pub fn init_node(
    config: &TelemetryConfig,
    node: &str,
    default_filter: &str,
) -> Result<TelemetryGuard, String> {
    let filter = log_filter(default_filter);
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(false);
    let fmt = if json_logs(Some(config)) {
        fmt.json().with_filter(filter).boxed()
    } else {
        fmt.with_filter(filter).boxed()
    };
    let Some(url) = otlp_traces_url(config) else {
        let _ = tracing_subscriber::registry().with(fmt).try_init();
        return Ok(TelemetryGuard(None));
    };
    let service = format!(
        "{}-{node}",
        std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| "duet".to_string())
    );
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(url.clone())
        .build()
        .map_err(|e| format!("OTLP exporter for {url}: {e}"))?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_sampler(sampler(config)?)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(service)
                .build(),
        )
        .build();
    let tracer = provider.tracer("duet");
    // Spans and events of Duet's own crates at debug and above (a request's per-phase events,
    // "first token", "finished", "transfer done", are debug on the console: the access log
    // has one line per request); dependencies stay out of traces.
    let spans = Targets::new()
        .with_default(LevelFilter::OFF)
        .with_target("duet", LevelFilter::DEBUG)
        .with_target("duet_runtime", LevelFilter::DEBUG)
        .with_target("duet_actors", LevelFilter::DEBUG);
    let otel = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(spans);
    let _ = tracing_subscriber::registry()
        .with(fmt)
        .with(otel)
        .try_init();
    TRACING.store(true, Ordering::Relaxed);
    tracing::info!(%url, "exporting traces over OTLP");
    Ok(TelemetryGuard(Some(provider)))
}

/// The current span's W3C trace context, if tracing is on and the span is sampled or valid.
pub fn traceparent() -> Option<String> {
    if !enabled() {
        return None;
    }
    span_traceparent(&tracing::Span::current())
}

/// A span's W3C trace context.
pub fn span_traceparent(span: &tracing::Span) -> Option<String> {
    if !enabled() {
        return None;
    }
    let cx = span.context();
    let s = cx.span();
    let sc = s.span_context();
    sc.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        )
    })
}

/// Parses a W3C `traceparent` (`00-TRACE-SPAN-FLAGS`).
pub fn parse_traceparent(tp: &str) -> Option<SpanContext> {
    let mut parts = tp.trim().split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version.len() != 2 || trace.len() != 32 || span.len() != 16 || flags.len() != 2 {
        return None;
    }
    let trace = TraceId::from_hex(trace).ok()?;
    let span = SpanId::from_hex(span).ok()?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    let sc = SpanContext::new(
        trace,
        span,
        TraceFlags::new(flags),
        true,
        TraceState::default(),
    );
    sc.is_valid().then_some(sc)
}

/// Makes `span` a child of the remote span `traceparent` names (a no-op when tracing is off
/// or the header is absent or malformed).
pub fn follow(span: &tracing::Span, traceparent: Option<&str>) {
    if !enabled() {
        return;
    }
    if let Some(sc) = traceparent.and_then(parse_traceparent) {
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(sc));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_parse_or_are_refused() {
        let sc =
            parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
        assert!(sc.is_sampled() && sc.is_remote());
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-xyz-00f067aa0ba902b7-01",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn samplers_follow_the_names_of_the_standard() {
        let mut c = TelemetryConfig::default();
        assert!(matches!(sampler(&c), Ok(Sampler::ParentBased(_))));
        c.sampler = "traceidratio".into();
        c.sampler_arg = 0.25;
        assert!(matches!(sampler(&c), Ok(Sampler::TraceIdRatioBased(r)) if r == 0.25));
        c.sampler = "sometimes".into();
        assert!(sampler(&c).is_err());
    }

    #[test]
    fn tracing_off_costs_one_load() {
        assert!(!enabled());
        assert_eq!(traceparent(), None);
    }
}
