//! The cost model that stands in for the engine and the wire: how long a prefill chunk, a
//! decode step and a KV write take. Linear in what drives each cost (tokens computed, context
//! attended, sequences in the batch, bytes moved), with coefficients measured on real hardware
//! by `duet sim --calibrate` (the real engine and a memory copy on this machine) or read from a
//! profile file written for other hardware (a GPU: step times per batch and context, link
//! GB/s).

use std::path::Path;

use serde::{Deserialize, Serialize};

/// Coefficients, in microseconds unless named otherwise.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Where the numbers came from (a host and a date, or "default").
    #[serde(default)]
    pub source: String,
    /// Fixed cost of one prefill chunk (µs).
    pub prefill_base_us: f64,
    /// Fixed cost of one request on its prefill worker beyond the engine (µs): the HTTP and
    /// link hops, bootstrap, the notice, checksums. `--calibrate --url` measures it on a live
    /// cluster (time to first token alone minus the engine's prefill).
    #[serde(default)]
    pub prefill_request_us: f64,
    /// Cost per prompt token computed (µs).
    pub prefill_token_us: f64,
    /// Cost per (token computed × token attended) pair (µs): attention's quadratic part.
    pub prefill_attn_us: f64,
    /// Fixed cost of one decode step (µs).
    pub decode_base_us: f64,
    /// Cost per sequence in the decode batch (µs).
    pub decode_seq_us: f64,
    /// Cost per context token attended in a decode step, summed over the batch (µs).
    pub decode_ctx_us: f64,
    /// Measured decode steps, `[batch, context per sequence, µs]`, when the profile has
    /// them: a step is interpolated between the measured batch sizes (CPU and GPU steps are
    /// far from linear in the batch: small batches cost what reading the weights costs), and
    /// `decode_ctx_us` accounts for context beyond the measured one.
    #[serde(default)]
    pub decode_table: Vec<[f64; 3]>,
    /// When workers share one machine's cores and memory (`duet up` on one host), a prefill
    /// chunk computed while a decode step runs takes this many times longer.
    #[serde(default = "one")]
    pub shared_prefill_slowdown: f64,
    /// ... and a decode step run while a prefill chunk computes.
    #[serde(default = "one")]
    pub shared_decode_slowdown: f64,
    /// KV bytes per token (all layers, K and V).
    pub kv_bytes_per_token: u64,
    /// Transfer bandwidth between a prefill and a decode worker (GB/s).
    pub link_gbps: f64,
    /// One-way latency of a control message (µs).
    pub message_us: f64,
    /// Fixed cost of one KV write (µs): a claim, a syscall, a frame header.
    pub write_base_us: f64,
}

fn one() -> f64 {
    1.0
}

impl Default for CostModel {
    /// SmolLM2-135M Q4_1, one thread per worker, on the 2-vCPU x86 machine CI runs on
    /// (`duet sim --calibrate`, 2026-12-01, rounded): what the default cluster serves.
    fn default() -> CostModel {
        CostModel {
            source: "default: SmolLM2-135M Q4_1, 1 thread per worker, 2-vCPU x86 (calibrated \
                     2026-12-01)"
                .into(),
            prefill_base_us: 4_000.0,
            prefill_request_us: 0.0,
            prefill_token_us: 1_970.0,
            prefill_attn_us: 2.3,
            decode_base_us: 1_300.0,
            decode_seq_us: 3_020.0,
            decode_ctx_us: 4.3,
            decode_table: vec![
                [1.0, 138.0, 6_070.0],
                [2.0, 138.0, 7_400.0],
                [4.0, 138.0, 10_900.0],
                [8.0, 138.0, 36_800.0],
                [16.0, 138.0, 67_400.0],
                [32.0, 138.0, 121_200.0],
            ],
            shared_prefill_slowdown: 1.0,
            shared_decode_slowdown: 1.0,
            kv_bytes_per_token: 23_040,
            link_gbps: 45.0,
            message_us: 150.0,
            write_base_us: 20.0,
        }
    }
}

/// A profile file that could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CostError {
    /// Unreadable.
    #[error("cannot read cost profile {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// Not a profile (names the field or the line).
    #[error("cost profile {path} is not valid: {source}")]
    Parse {
        /// The file.
        path: String,
        /// What is wrong and where.
        source: serde_json::Error,
    },
    /// A coefficient that would make time run backwards or stand still.
    #[error("cost profile {path}: `{field}` must be a finite number >= 0 (link_gbps > 0)")]
    Value {
        /// The file.
        path: String,
        /// The key.
        field: &'static str,
    },
}

impl CostModel {
    /// Reads a profile (JSON, as `--calibrate` writes it).
    pub fn from_file(path: &Path) -> Result<CostModel, CostError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| CostError::Read {
            path: name.clone(),
            source,
        })?;
        let m: CostModel = serde_json::from_str(&text).map_err(|source| CostError::Parse {
            path: name.clone(),
            source,
        })?;
        m.check()
            .map_err(|field| CostError::Value { path: name, field })?;
        Ok(m)
    }

    fn check(&self) -> Result<(), &'static str> {
        let fields = [
            ("prefill_base_us", self.prefill_base_us),
            ("prefill_request_us", self.prefill_request_us),
            ("prefill_token_us", self.prefill_token_us),
            ("prefill_attn_us", self.prefill_attn_us),
            ("decode_base_us", self.decode_base_us),
            ("decode_seq_us", self.decode_seq_us),
            ("decode_ctx_us", self.decode_ctx_us),
            ("message_us", self.message_us),
            ("write_base_us", self.write_base_us),
        ];
        for (name, v) in [
            ("shared_prefill_slowdown", self.shared_prefill_slowdown),
            ("shared_decode_slowdown", self.shared_decode_slowdown),
        ] {
            if !v.is_finite() || v < 1.0 {
                return Err(name);
            }
        }
        for (name, v) in fields {
            if !v.is_finite() || v < 0.0 {
                return Err(name);
            }
        }
        let sorted = self.decode_table.windows(2).all(|w| w[0][0] < w[1][0]);
        let sane = self
            .decode_table
            .iter()
            .flatten()
            .all(|v| v.is_finite() && *v >= 0.0);
        if !sorted || !sane {
            return Err("decode_table");
        }
        if !self.link_gbps.is_finite() || self.link_gbps <= 0.0 {
            return Err("link_gbps");
        }
        Ok(())
    }

    /// A prefill chunk of `n` tokens after `ctx` already computed (µs).
    pub fn prefill_chunk_us(&self, n: usize, ctx: usize) -> u64 {
        let attended = n as f64 * (ctx as f64 + n as f64 / 2.0);
        (self.prefill_base_us + self.prefill_token_us * n as f64 + self.prefill_attn_us * attended)
            .round()
            .max(1.0) as u64
    }

    /// One prefill step over several prompts' chunks, `(tokens, context before them)` each:
    /// one fixed cost, each chunk's own.
    pub fn prefill_step_us(&self, chunks: &[(usize, usize)]) -> u64 {
        let own: u64 = chunks
            .iter()
            .map(|&(n, ctx)| self.prefill_chunk_us(n, ctx))
            .sum();
        let shared = self.prefill_base_us.round() as u64 * chunks.len().saturating_sub(1) as u64;
        own.saturating_sub(shared).max(1)
    }

    /// A decode step over `batch` sequences attending `ctx` tokens in all (µs).
    pub fn decode_step_us(&self, batch: usize, ctx: usize) -> u64 {
        let (b, ctx) = (batch as f64, ctx as f64);
        let us = match self.interpolate(b) {
            Some((us, ctx_each)) => us + self.decode_ctx_us * (ctx - b * ctx_each),
            None => self.decode_base_us + self.decode_seq_us * b + self.decode_ctx_us * ctx,
        };
        us.round().max(1.0) as u64
    }

    /// The table's step time at batch `b` (linear between measured batches, extrapolated
    /// by the last two beyond them), and the context per sequence it was measured at.
    fn interpolate(&self, b: f64) -> Option<(f64, f64)> {
        let t = &self.decode_table;
        match t.len() {
            0 => None,
            1 => Some((t[0][2], t[0][1])),
            n => {
                let i = t
                    .iter()
                    .position(|r| r[0] >= b)
                    .unwrap_or(n - 1)
                    .clamp(1, n - 1);
                let (lo, hi) = (t[i - 1], t[i]);
                let w = if hi[0] > lo[0] {
                    (b - lo[0]) / (hi[0] - lo[0])
                } else {
                    0.0
                };
                let ctx = lo[1] + w * (hi[1] - lo[1]);
                Some(((lo[2] + w * (hi[2] - lo[2])).max(1.0), ctx))
            }
        }
    }

    /// Moving the KV of `tokens` tokens (µs).
    pub fn write_us(&self, tokens: usize) -> u64 {
        let bytes = tokens as f64 * self.kv_bytes_per_token as f64;
        (self.write_base_us + bytes / (self.link_gbps * 1e3))
            .round()
            .max(1.0) as u64
    }

    /// A control message's flight (µs).
    pub fn message(&self) -> u64 {
        self.message_us.round().max(1.0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_grow_with_what_drives_them() {
        let c = CostModel::default();
        assert!(c.prefill_chunk_us(256, 0) > c.prefill_chunk_us(128, 0));
        assert!(c.prefill_chunk_us(128, 512) > c.prefill_chunk_us(128, 0));
        assert!(c.decode_step_us(8, 1000) > c.decode_step_us(1, 1000));
        assert!(c.decode_step_us(1, 5000) > c.decode_step_us(1, 100));
        assert!(c.write_us(1000) > c.write_us(10));
    }

    #[test]
    fn a_measured_table_is_interpolated_by_batch() {
        let c = CostModel {
            decode_ctx_us: 1.0,
            decode_table: vec![
                [1.0, 100.0, 1000.0],
                [4.0, 100.0, 1300.0],
                [8.0, 100.0, 2100.0],
            ],
            ..CostModel::default()
        };
        assert_eq!(c.decode_step_us(1, 100), 1000);
        assert_eq!(c.decode_step_us(2, 200), 1100);
        assert_eq!(c.decode_step_us(6, 600), 1700);
        assert_eq!(c.decode_step_us(16, 1600), 3700, "extrapolated");
        assert_eq!(c.decode_step_us(1, 600), 1500, "longer context costs more");
    }

    #[test]
    fn a_bad_profile_names_its_field() {
        let dir = std::env::temp_dir().join(format!("duet-sim-cost-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("p.json");
        let mut v = serde_json::to_value(CostModel::default()).expect("json");
        v["link_gbps"] = serde_json::json!(0.0);
        std::fs::write(&path, v.to_string()).expect("write");
        let e = CostModel::from_file(&path)
            .expect_err("refused")
            .to_string();
        assert!(e.contains("link_gbps"), "{e}");
        std::fs::write(&path, "{\"prefill_base_us\": 1,\n \"oops\": }").expect("write");
        let e = CostModel::from_file(&path)
            .expect_err("refused")
            .to_string();
        assert!(e.contains("line 2"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
