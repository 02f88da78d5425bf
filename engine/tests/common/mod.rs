//! The real model and the reference fixture, for the engine's tests.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use duet_engine::fetch;
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
