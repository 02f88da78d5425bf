//! The real model and the reference fixture, for the engine's tests.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use duet_engine::{Engine, SeqChunk};
use duet_fetch as fetch;
use serde_json::Value;

/// The real model's path, fetched on first use (as every command that needs it does).
pub fn model_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let path = std::env::var_os(fetch::MODEL_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                    .join("../models")
                    .join(fetch::MODEL_FILE)
            });
        fetch::ensure_model(&path, &mut |_| {}).expect("the real model (duet fetch-model)")
    })
    .clone()
}

/// The reference outputs of SmolLM2-135M from an independent fp32 implementation (HF
/// transformers on the dequantized GGUF), copied from the project's shared fixtures.
pub fn fixture() -> Value {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2-reference.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read the reference fixture {}: {e}", path.display()));
    serde_json::from_str(&text).expect("fixture JSON")
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// Prefills `tokens` from position 0 in pieces of `chunk`; the last token's logits.
pub fn prefill_chunked(e: &mut Engine, tokens: &[u32], pages: &[u32], chunk: usize) -> Vec<f32> {
    let mut last = None;
    let mut pos = 0;
    while pos < tokens.len() {
        let end = (pos + chunk).min(tokens.len());
        let out = e
            .step(&[SeqChunk {
                tokens: &tokens[pos..end],
                start_pos: pos,
                pages,
                want_logits: end == tokens.len(),
            }])
            .expect("prefill step");
        last = out.into_iter().next().flatten();
        pos = end;
    }
    last.expect("logits of the last prompt token")
}

/// The greedy token (lowest id on ties).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}
