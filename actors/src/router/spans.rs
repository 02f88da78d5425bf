//! The router's span of a request: the root of its trace, named by the OpenTelemetry
//! conventions for HTTP servers and generative AI (`gen_ai.*`) where one fits.

use axum::extract::Request;
use axum::response::Response;
use duet_engine::SamplingParams;
use tracing::Instrument;

use super::http::Api;

/// The root span of a request's trace (continuing the client's, if it sent a `traceparent`,
/// and keeping its `tracestate`). Attributes follow the OpenTelemetry conventions for HTTP
/// servers and for generative AI (`gen_ai.*`) where one fits; `request`, `path`, `prefill`
/// and `decode` are Duet's own (the router's request id, the path taken, the workers chosen).
pub(super) fn request_span(api: Api, route: &str, req: &Request) -> tracing::Span {
    let span = tracing::info_span!(
        "request",
        otel.name = %format!("POST {route}"),
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        http.request.method = "POST",
        http.route = route,
        http.response.status_code = tracing::field::Empty,
        gen_ai.operation.name = match api {
            Api::Chat => "chat",
            Api::Completion => "text_completion",
        },
        gen_ai.request.model = tracing::field::Empty,
        gen_ai.request.max_tokens = tracing::field::Empty,
        gen_ai.request.temperature = tracing::field::Empty,
        gen_ai.request.top_p = tracing::field::Empty,
        gen_ai.request.top_k = tracing::field::Empty,
        gen_ai.request.seed = tracing::field::Empty,
        gen_ai.response.id = tracing::field::Empty,
        gen_ai.response.model = tracing::field::Empty,
        gen_ai.usage.input_tokens = tracing::field::Empty,
        gen_ai.usage.output_tokens = tracing::field::Empty,
        request = tracing::field::Empty,
        path = tracing::field::Empty,
        prefill = tracing::field::Empty,
        decode = tracing::field::Empty,
    );
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let remote = duet_runtime::telemetry::TraceHeaders {
        traceparent: header("traceparent"),
        tracestate: header("tracestate"),
    };
    duet_runtime::telemetry::follow(&span, &remote);
    span
}

/// Runs a request under its span and notes the answer's status on it. (Numbers go on spans
/// as i64: the OpenTelemetry layer exports unsigned ones as strings.)
pub(super) async fn traced(
    span: tracing::Span,
    answer: impl std::future::Future<Output = Response>,
) -> Response {
    let response = answer.instrument(span.clone()).await;
    let status = response.status();
    span.record("http.response.status_code", i64::from(status.as_u16()));
    if status.is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    response
}

/// Notes the request's model and sampling parameters on its span.
pub(super) fn record_request(span: &tracing::Span, model: &str, params: &SamplingParams) {
    span.record("gen_ai.request.model", model);
    span.record("gen_ai.response.model", model);
    span.record("gen_ai.request.max_tokens", params.max_tokens as i64);
    span.record("gen_ai.request.temperature", f64::from(params.temperature));
    span.record("gen_ai.request.top_p", f64::from(params.top_p));
    if params.top_k > 0 {
        span.record("gen_ai.request.top_k", params.top_k as i64);
    }
    if let Some(seed) = params.seed {
        span.record("gen_ai.request.seed", seed as i64);
    }
}
