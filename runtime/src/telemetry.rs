//! Logs and traces for Duet processes.
//!
//! Logs: lines on stderr, filtered by `DUET_LOG` (or `RUST_LOG`), default `info`; text, or one
//! JSON object per line with `telemetry.log_format = "json"` (or `DUET_LOG_FORMAT=json`).
//! Fields of the spans a line is in (request, room, attempt) are on the line.
//!
//! Traces: off unless an OTLP endpoint is configured. Then every span at info level and above
//! goes over OTLP to that endpoint in batches, from a background thread, under the service
//! name `duet-NODE` (or `$OTEL_SERVICE_NAME-NODE`): as protobuf over HTTP (`/v1/traces`, port
//! 4318 when the URL names none) or over gRPC (port 4317), as `telemetry.otlp_protocol` says.
//! The standard variables win over `[telemetry]` (see [`export_target`]):
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, used as is),
//! `OTEL_EXPORTER_OTLP_PROTOCOL` (or `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`),
//! `OTEL_TRACES_EXPORTER=none`, `OTEL_SERVICE_NAME`, `OTEL_TRACES_SAMPLER` and
//! `OTEL_TRACES_SAMPLER_ARG`.
//!
//! The trace context crosses nodes in every envelope's W3C `traceparent` and `tracestate`:
//! [`traceparent`] and [`tracestate`] read the current span's, [`follow`] makes a span
//! continue a remote one (keeping the caller's tracestate, which every child span inherits).
//! When tracing is off they return at once (one atomic load), so the request path pays nothing.

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

use crate::config::{OtlpProtocol, TelemetryConfig};

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
        let Some(p) = self.0.take() else { return };
        // The last batch may go over gRPC, whose connection runs on the async runtime: when
        // dropped on one of its worker threads, let the others run while this one waits.
        let multi_thread = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        let flushed = if multi_thread {
            tokio::task::block_in_place(|| p.shutdown())
        } else {
            p.shutdown()
        };
        if let Err(e) = flushed {
            eprintln!("warning: traces not flushed: {e}");
        }
    }
}

/// Where spans are exported, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportTarget {
    /// The transport.
    pub protocol: OtlpProtocol,
    /// The full URL: `/v1/traces` included for HTTP, the collector's address for gRPC.
    pub url: String,
}

/// Where and how spans go, the environment (read through `env`) overriding the file: `None`
/// when no endpoint is configured or `OTEL_TRACES_EXPORTER=none`. An endpoint without a port
/// gets the protocol's usual one (4318 for HTTP, 4317 for gRPC); the per-signal variables
/// (`OTEL_EXPORTER_OTLP_TRACES_*`) win over the general ones, and a traces endpoint is used as
/// is. Empty variables count as unset, as the specification says.
pub fn export_target(
    config: &TelemetryConfig,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<ExportTarget>, String> {
    let var = |name: &str| env(name).filter(|v| !v.trim().is_empty());
    match var("OTEL_TRACES_EXPORTER").as_deref().map(str::trim) {
        None | Some("otlp") => {}
        Some("none") => return Ok(None),
        Some(other) => {
            return Err(format!(
                "OTEL_TRACES_EXPORTER=`{other}`: Duet exports traces over OTLP only (otlp or none)"
            ));
        }
    }
    let protocol = match [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ]
    .into_iter()
    .find_map(|name| var(name).map(|v| (name, v)))
    {
        Some((name, v)) => OtlpProtocol::parse(v.trim()).ok_or_else(|| {
            let names: Vec<&str> = OtlpProtocol::ALL.iter().map(|p| p.name()).collect();
            format!("{name}=`{v}`: expected one of {}", names.join(", "))
        })?,
        None => config.otlp_protocol,
    };
    let (name, url) = if let Some(url) = var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
        (
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            with_port(url.trim(), protocol),
        )
    } else {
        let Some((name, base)) = var("OTEL_EXPORTER_OTLP_ENDPOINT")
            .map(|v| ("OTEL_EXPORTER_OTLP_ENDPOINT", v))
            .or_else(|| {
                let e = config.otlp_endpoint.clone()?;
                Some(("telemetry.otlp_endpoint", e))
            })
        else {
            return Ok(None);
        };
        let base = with_port(base.trim().trim_end_matches('/'), protocol);
        let url = match protocol {
            OtlpProtocol::HttpProtobuf => format!("{base}/v1/traces"),
            OtlpProtocol::Grpc => base,
        };
        (name, url)
    };
    if !url.starts_with("http://") && !url.starts_with("https://") {
        return Err(format!(
            "{name}: `{url}` is not an OTLP collector URL: expected http://HOST[:PORT]"
        ));
    }
    Ok(Some(ExportTarget { protocol, url }))
}

/// `url` with `protocol`'s usual port when its authority names none.
fn with_port(url: &str, protocol: OtlpProtocol) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    // The port follows the last colon, after an IPv6 literal's closing bracket if any.
    let host_end = authority.rfind(']').map_or(0, |i| i + 1);
    if authority.is_empty() || authority[host_end..].contains(':') {
        return url.to_string();
    }
    format!("{scheme}://{authority}:{}{path}", protocol.default_port())
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
    let Some(target) = export_target(config, |name| std::env::var(name).ok())? else {
        let _ = tracing_subscriber::registry().with(fmt).try_init();
        return Ok(TelemetryGuard(None));
    };
    let service = format!(
        "{}-{node}",
        std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| "duet".to_string())
    );
    let url = target.url.clone();
    let exporter = match target.protocol {
        OtlpProtocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(url.clone())
            .build(),
        OtlpProtocol::Grpc => {
            // The gRPC client's connection lives on the async runtime; the batch thread hands
            // it each batch.
            if tokio::runtime::Handle::try_current().is_err() {
                return Err("OTLP over gRPC needs the async runtime; start the node in it".into());
            }
            opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(url.clone())
                .build()
        }
    }
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
    tracing::info!(%url, protocol = target.protocol.name(), "exporting traces over OTLP");
    Ok(TelemetryGuard(Some(provider)))
}

/// The current span's W3C trace context, if tracing is on and the span is sampled or valid.
pub fn traceparent() -> Option<String> {
    if !enabled() {
        return None;
    }
    span_traceparent(&tracing::Span::current())
}

/// The current span's W3C `tracestate` (the vendors' entries a client sent, which the
/// request's spans keep), if tracing is on and it has one.
pub fn tracestate() -> Option<String> {
    if !enabled() {
        return None;
    }
    span_tracestate(&tracing::Span::current())
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

/// A span's W3C `tracestate`; `None` when it is empty.
pub fn span_tracestate(span: &tracing::Span) -> Option<String> {
    if !enabled() {
        return None;
    }
    let cx = span.context();
    let header = cx.span().span_context().trace_state().header();
    (!header.is_empty()).then_some(header)
}

/// Sets a list-of-strings attribute on `span`'s exported span (such as
/// `gen_ai.response.finish_reasons`, an array in the conventions; `tracing` fields are scalars).
pub fn record_list(span: &tracing::Span, key: &'static str, values: &[&str]) {
    if !enabled() {
        return;
    }
    let values = values.iter().map(|v| v.to_string().into()).collect();
    span.set_attribute(
        key,
        opentelemetry::Value::Array(opentelemetry::Array::String(values)),
    );
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

/// The most of a `tracestate` a request carries on: the W3C recommendation's 512 characters,
/// whole entries only (the rightmost, least recently updated, go first).
pub const TRACESTATE_MAX: usize = 512;

/// Parses a W3C `tracestate` (`vendor=value,...`), keeping at most [`TRACESTATE_MAX`]
/// characters of whole entries. A malformed header is dropped whole, as the standard says
/// (the traceparent still counts); so is an empty one.
pub fn parse_tracestate(ts: &str) -> Option<TraceState> {
    let entries: Vec<(&str, &str)> = ts
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|e| e.split_once('='))
        .collect::<Option<_>>()?;
    let mut kept = Vec::new();
    let mut len = 0;
    for (k, v) in entries {
        let add = k.len() + 1 + v.len() + usize::from(!kept.is_empty());
        if len + add > TRACESTATE_MAX {
            break;
        }
        len += add;
        kept.push((k, v));
    }
    if kept.is_empty() {
        return None;
    }
    TraceState::from_key_value(kept).ok()
}

/// A remote span's W3C context as it travels between processes: the `traceparent` and
/// `tracestate` headers (in an HTTP request, an envelope, a message to a local worker).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TraceHeaders {
    /// `00-TRACE-SPAN-FLAGS`.
    pub traceparent: Option<String>,
    /// `vendor=value,...`.
    pub tracestate: Option<String>,
}

impl TraceHeaders {
    /// The context an envelope carries.
    pub fn of(envelope: &crate::wire::Envelope) -> TraceHeaders {
        TraceHeaders {
            traceparent: envelope.traceparent.clone(),
            tracestate: envelope.tracestate.clone(),
        }
    }

    /// The current span's context (nothing when tracing is off).
    pub fn current() -> TraceHeaders {
        TraceHeaders {
            traceparent: traceparent(),
            tracestate: tracestate(),
        }
    }
}

/// Makes `span` a child of the remote span `remote.traceparent` names, carrying on its
/// tracestate, which every child span inherits (a no-op when tracing is off or the
/// traceparent is absent or malformed; a malformed tracestate alone is dropped).
pub fn follow(span: &tracing::Span, remote: &TraceHeaders) {
    if !enabled() {
        return;
    }
    let Some(mut sc) = remote.traceparent.as_deref().and_then(parse_traceparent) else {
        return;
    };
    if let Some(state) = remote.tracestate.as_deref().and_then(parse_tracestate) {
        sc = SpanContext::new(sc.trace_id(), sc.span_id(), sc.trace_flags(), true, state);
    }
    let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(sc));
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
    fn tracestates_keep_whole_entries_up_to_the_limit_or_are_dropped() {
        let ts = parse_tracestate("congo=t61rcWkgMzE, rojo=00f067aa0ba902b7").unwrap();
        assert_eq!(ts.header(), "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7");
        assert_eq!(ts.get("rojo"), Some("00f067aa0ba902b7"));
        for bad in ["", " , ", "novalue", "UPPER=1", "a=1,b"] {
            assert!(parse_tracestate(bad).is_none(), "{bad}");
        }
        // 40 entries of 19 characters: only whole entries within 512 characters stay.
        let long: Vec<String> = (0..40)
            .map(|i| format!("vendor{i:02}=0123456789ab"))
            .collect();
        let ts = parse_tracestate(&long.join(",")).unwrap();
        let header = ts.header();
        assert!(header.len() <= TRACESTATE_MAX, "{}", header.len());
        assert!(header.starts_with("vendor00=") && header.ends_with("=0123456789ab"));
        assert_eq!(header.split(',').count(), (TRACESTATE_MAX + 1) / 22);
    }

    #[test]
    fn exports_go_where_the_environment_then_the_file_says() {
        fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
            let pairs: Vec<(String, String)> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            move |name| {
                pairs
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.clone())
            }
        }
        let mut file = TelemetryConfig::default();
        assert_eq!(export_target(&file, vars(&[])), Ok(None));
        file.otlp_endpoint = Some("http://jaeger".into());
        let t = export_target(&file, vars(&[])).unwrap().unwrap();
        assert_eq!(t.protocol, OtlpProtocol::HttpProtobuf);
        assert_eq!(t.url, "http://jaeger:4318/v1/traces");
        file.otlp_protocol = OtlpProtocol::Grpc;
        let t = export_target(&file, vars(&[])).unwrap().unwrap();
        assert_eq!(
            (t.protocol, t.url.as_str()),
            (OtlpProtocol::Grpc, "http://jaeger:4317")
        );
        // The standard variables win; the per-signal ones over the general ones.
        let t = export_target(
            &file,
            vars(&[
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
                ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://[::1]:9999/"),
            ]),
        );
        assert_eq!(
            t.unwrap().unwrap().url,
            "http://[::1]:9999/v1/traces",
            "a port is kept, the path added"
        );
        let t = export_target(
            &file,
            vars(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://ignored:1"),
                ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://[::1]"),
            ]),
        );
        assert_eq!(t.unwrap().unwrap().url, "http://[::1]:4317");
        let off = export_target(&file, vars(&[("OTEL_TRACES_EXPORTER", "none")]));
        assert_eq!(off, Ok(None));
        let empty = export_target(&file, vars(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "")]));
        assert_eq!(empty.unwrap().unwrap().protocol, OtlpProtocol::Grpc);
        for (k, v, says) in [
            (
                "OTEL_EXPORTER_OTLP_PROTOCOL",
                "http/json",
                "expected one of http/protobuf, grpc",
            ),
            ("OTEL_TRACES_EXPORTER", "zipkin", "OTLP only"),
            (
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                "jaeger:4317",
                "not an OTLP collector URL",
            ),
        ] {
            let e = export_target(&file, vars(&[(k, v)])).unwrap_err();
            assert!(e.contains(k) && e.contains(says), "{e}");
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
        assert_eq!(tracestate(), None);
    }
}
