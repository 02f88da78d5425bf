//! OpenAI request bodies and error shapes.
//!
//! A field Duet does not implement but whose absence would change the answer (tools, a JSON
//! response format, logit biases, more than one choice, ...) is refused with a 400 naming it,
//! so a client never gets a plausible answer to a question it did not ask. Other fields
//! (`user`, `metadata`, vendor extensions) are ignored, as clients send many; the documented
//! ones among them must still have the shape the API gives them (a malformed `service_tier`
//! is a 400, as OpenAI answers it). `null` counts as absent, as the SDKs send it for unset
//! fields.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use duet_engine::sampling::MAX_TOP_LOGPROBS;
use serde::Deserialize;
use serde_json::{Value, json};

/// A chat message; `content` is a string or a list of text parts.
#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Value,
    /// The rest (`name`, `tool_calls`, ...).
    #[serde(flatten)]
    pub other: std::collections::BTreeMap<String, Value>,
}

/// Message fields that carry what only tool calling or audio output produce: a conversation
/// that holds them cannot be continued faithfully here.
const UNSUPPORTED_IN_MESSAGES: &[&str] = &["tool_calls", "function_call", "audio"];

impl ChatMessage {
    /// The text of the message (its role checked: one of [`ROLES`]).
    pub fn text(&self) -> Result<String, ApiError> {
        if !ROLES.contains(&self.role.as_str()) {
            return Err(ApiError::invalid(
                format!(
                    "a message's role is one of {}, not `{}`",
                    ROLES.join(", "),
                    self.role
                ),
                "messages",
            ));
        }
        for field in UNSUPPORTED_IN_MESSAGES {
            if self.other.get(*field).is_some_and(|v| !v.is_null()) {
                return Err(ApiError::invalid(
                    format!("messages with {field} are not supported by this server"),
                    "messages",
                )
                .code("unsupported_parameter"));
            }
        }
        if self
            .other
            .get("name")
            .is_some_and(|v| !v.is_string() && !v.is_null())
        {
            return Err(ApiError::invalid(
                "a message's name must be a string",
                "messages",
            ));
        }
        match &self.content {
            Value::String(s) => Ok(s.clone()),
            Value::Null => Ok(String::new()),
            Value::Array(parts) => parts
                .iter()
                .map(|p| match (p["type"].as_str(), p["text"].as_str()) {
                    (Some("text"), Some(t)) => Ok(t.to_string()),
                    _ => Err(ApiError::invalid(
                        "only text content parts are supported",
                        "messages",
                    )),
                })
                .collect(),
            _ => Err(ApiError::invalid(
                "message content must be a string or a list of parts",
                "messages",
            )),
        }
    }
}

/// `/v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub common: Common,
}

/// `/v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Value,
    #[serde(flatten)]
    pub common: Common,
}

/// Parameters both endpoints take.
#[derive(Debug, Default, Deserialize)]
pub struct Common {
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<Value>,
    pub stream: Option<bool>,
    pub n: Option<i64>,
    pub logprobs: Option<Value>,
    pub stream_options: Option<Value>,
    pub ignore_eos: Option<bool>,
    pub min_tokens: Option<i64>,
    pub best_of: Option<i64>,
    /// Duet extension: run on this pair, `PREFILL_NODE,DECODE_NODE` (operators and tests).
    pub duet_pair: Option<String>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub top_logprobs: Option<i64>,
    /// Everything else the client sent.
    #[serde(flatten)]
    pub other: std::collections::BTreeMap<String, Value>,
}

/// Fields Duet does not implement that change what a correct answer is: refused, named.
const UNSUPPORTED: &[(&str, &str)] = &[
    ("tools", "tool calling is not supported by this server"),
    (
        "tool_choice",
        "tool calling is not supported by this server",
    ),
    (
        "parallel_tool_calls",
        "tool calling is not supported by this server",
    ),
    (
        "functions",
        "function calling is not supported by this server",
    ),
    (
        "function_call",
        "function calling is not supported by this server",
    ),
    (
        "response_format",
        "response formats (JSON mode, schemas) are not supported by this server",
    ),
    ("logit_bias", "logit_bias is not supported by this server"),
    ("echo", "echo is not supported by this server"),
    (
        "suffix",
        "suffix (insertion) is not supported by this server",
    ),
    ("audio", "audio output is not supported by this server"),
    ("modalities", "only text output is supported by this server"),
    (
        "prediction",
        "predicted outputs are not supported by this server",
    ),
    (
        "reasoning_effort",
        "reasoning_effort is not supported by this server",
    ),
    (
        "web_search_options",
        "web search is not supported by this server",
    ),
    (
        "guided_json",
        "guided decoding is not supported by this server",
    ),
    (
        "guided_regex",
        "guided decoding is not supported by this server",
    ),
    (
        "guided_choice",
        "guided decoding is not supported by this server",
    ),
];

/// The shape of a documented field Duet reads no further.
enum Shape {
    Str,
    Bool,
    /// An object whose values are strings (`metadata`).
    Strings,
    OneOf(&'static [&'static str]),
}

impl Shape {
    fn admits(&self, v: &Value) -> bool {
        match self {
            Shape::Str => v.is_string(),
            Shape::Bool => v.is_boolean(),
            Shape::Strings => v
                .as_object()
                .is_some_and(|m| m.values().all(Value::is_string)),
            Shape::OneOf(names) => v.as_str().is_some_and(|s| names.contains(&s)),
        }
    }

    /// What a value of this shape is, for the error.
    fn describe(&self) -> String {
        match self {
            Shape::Str => "a string".into(),
            Shape::Bool => "a boolean".into(),
            Shape::Strings => "an object of strings".into(),
            Shape::OneOf(names) => format!("one of {}", names.join(", ")),
        }
    }
}

/// The most alternatives the legacy completions API gives per token (`logprobs: N`).
const MAX_LEGACY_LOGPROBS: i64 = 5;

/// Documented fields that change nothing here, and the shape the API gives each.
const IGNORED: &[(&str, Shape)] = &[
    ("user", Shape::Str),
    ("safety_identifier", Shape::Str),
    ("prompt_cache_key", Shape::Str),
    ("store", Shape::Bool),
    ("metadata", Shape::Strings),
    (
        "service_tier",
        Shape::OneOf(&["auto", "default", "flex", "scale", "priority"]),
    ),
    ("verbosity", Shape::OneOf(&["low", "medium", "high"])),
];

/// The roles a chat message may have.
pub const ROLES: &[&str] = &[
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

impl Common {
    /// Refuses a field Duet does not implement (see [`UNSUPPORTED`]) and a documented field it
    /// ignores whose value has not the documented shape (see [`IGNORED`]).
    pub fn refuse_unsupported(&self) -> Result<(), ApiError> {
        for (field, why) in UNSUPPORTED {
            if self.other.get(*field).is_some_and(|v| !v.is_null()) {
                return Err(ApiError::invalid(*why, field).code("unsupported_parameter"));
            }
        }
        for (field, shape) in IGNORED {
            if let Some(v) = self.other.get(*field).filter(|v| !v.is_null())
                && !shape.admits(v)
            {
                let want = shape.describe();
                return Err(ApiError::invalid(format!("{field} must be {want}"), field));
            }
        }
        if let Some(o) = self.stream_options.as_ref().filter(|v| !v.is_null()) {
            let flags_ok = o.as_object().is_some_and(|m| {
                ["include_usage", "include_obfuscation"]
                    .iter()
                    .all(|k| m.get(*k).is_none_or(|v| v.is_boolean() || v.is_null()))
            });
            if !flags_ok {
                return Err(ApiError::invalid(
                    "stream_options must be an object whose include_usage is a boolean",
                    "stream_options",
                ));
            }
        }
        Ok(())
    }

    /// How many of the likeliest alternatives to report per token: chat's `top_logprobs`
    /// (0 to [`MAX_TOP_LOGPROBS`], with `logprobs: true`, as OpenAI requires), the legacy
    /// completions' `logprobs: N` (0 to [`MAX_LEGACY_LOGPROBS`], OpenAI's limit there).
    pub fn top_logprobs(&self, chat: bool) -> Result<usize, ApiError> {
        if chat {
            if self
                .logprobs
                .as_ref()
                .is_some_and(|v| !v.is_boolean() && !v.is_null())
            {
                return Err(ApiError::invalid(
                    "logprobs must be a boolean in chat completions",
                    "logprobs",
                ));
            }
            return match self.top_logprobs {
                None | Some(0) => Ok(0),
                Some(n) if !(0..=MAX_TOP_LOGPROBS as i64).contains(&n) => Err(ApiError::invalid(
                    format!("top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}"),
                    "top_logprobs",
                )),
                Some(_) if !self.wants_logprobs() => Err(ApiError::invalid(
                    "top_logprobs requires logprobs: true",
                    "top_logprobs",
                )),
                Some(n) => Ok(n as usize),
            };
        }
        if self.top_logprobs.is_some_and(|n| n != 0) {
            return Err(ApiError::invalid(
                format!(
                    "the completions API asks for alternatives with logprobs: N (0 to {MAX_LEGACY_LOGPROBS})"
                ),
                "top_logprobs",
            ));
        }
        match &self.logprobs {
            Some(Value::Number(n)) => match n.as_i64() {
                Some(n) if (0..=MAX_LEGACY_LOGPROBS).contains(&n) => Ok(n as usize),
                _ => Err(ApiError::invalid(
                    format!("logprobs must be an integer between 0 and {MAX_LEGACY_LOGPROBS}"),
                    "logprobs",
                )),
            },
            _ => Ok(0),
        }
    }

    /// Stop strings (`stop` is a string or a list of strings).
    pub fn stops(&self) -> Result<Vec<String>, ApiError> {
        match &self.stop {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            Some(Value::Array(a)) if a.len() <= 4 => a
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| ApiError::invalid("stop must be strings", "stop"))
                })
                .collect(),
            Some(_) => Err(ApiError::invalid(
                "stop must be a string or a list of at most 4 strings",
                "stop",
            )),
        }
    }

    /// Whether the chosen tokens' logprobs are asked for.
    pub fn wants_logprobs(&self) -> bool {
        match &self.logprobs {
            Some(Value::Bool(b)) => *b,
            Some(Value::Number(n)) => n.as_i64().is_some_and(|n| n >= 0),
            _ => false,
        }
    }

    /// `stream_options.include_usage`.
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o["include_usage"].as_bool())
            .unwrap_or(false)
    }
}

/// An OpenAI-shaped error: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 invalid_request_error about `param`.
    pub fn invalid(message: impl Into<String>, param: &str) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_string()),
            code: None,
        }
    }

    /// With a machine-readable code.
    pub fn code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// A server-side failure (503 when no worker can serve, 500 otherwise).
    pub fn server(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }});
        (self.status, Json(body)).into_response()
    }
}
