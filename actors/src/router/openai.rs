//! OpenAI request bodies and error shapes. Unknown fields are ignored, as clients send many.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

/// A chat message; `content` is a string or a list of text parts.
#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Value,
}

impl ChatMessage {
    /// The text of the message.
    pub fn text(&self) -> Result<String, ApiError> {
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
}

impl Common {
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
