//! What a run measured: request outcomes, fault counts, and latency histograms (log-bucketed,
//! about 1 % wide, so a million requests cost a few kilobytes).

use serde::Serialize;

/// A latency histogram over µs.
#[derive(Debug, Clone, Default)]
pub struct Histogram {
    buckets: Vec<u64>,
    count: u64,
    sum: f64,
}

/// Buckets per doubling: 2^(1/70) ≈ 1 % wide.
const PER_OCTAVE: f64 = 70.0;

impl Histogram {
    /// Records one value (µs).
    pub fn record(&mut self, us: u64) {
        let b = ((us as f64 + 1.0).log2() * PER_OCTAVE) as usize;
        if self.buckets.len() <= b {
            self.buckets.resize(b + 1, 0);
        }
        self.buckets[b] += 1;
        self.count += 1;
        self.sum += us as f64;
    }

    /// Values recorded.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The `q` quantile (0..=1) in ms; 0 when empty.
    pub fn quantile_ms(&self, q: f64) -> f64 {
        if self.count == 0 {
            return 0.0;
        }
        let rank = ((q * self.count as f64).ceil() as u64).clamp(1, self.count);
        let mut seen = 0;
        for (b, &n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                // The bucket's middle.
                let us = 2f64.powf((b as f64 + 0.5) / PER_OCTAVE) - 1.0;
                return us / 1e3;
            }
        }
        0.0
    }

    /// The mean in ms.
    pub fn mean_ms(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum / self.count as f64 / 1e3
        }
    }
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Every token arrived.
    Finished,
    /// It failed (an error to the client).
    Failed,
    /// The client left.
    Left,
}

/// Counts and latencies of one run.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    /// Requests that ended, by any outcome.
    pub ended: usize,
    /// Finished with every token.
    pub finished: usize,
    /// Failed.
    pub failed: usize,
    /// Left by their client.
    pub left: usize,
    /// Attempts started (first ones and retries).
    pub attempts: u64,
    /// Attempts that continued a stream elsewhere (migrations).
    pub migrations: u64,
    /// Transfers decode ended without their writer (aborts).
    pub aborts: u64,
    /// Writes refused because their grant was revoked.
    pub writes_refused: u64,
    /// Drains that stayed unproven past the backstop (the alarm; pages stayed quarantined).
    pub quarantine_stalls: u64,
    /// Fenced transfers whose check ended after a cancel had ended them (never published).
    pub checks_overtaken: u64,
    /// Fenced transfers whose writer's node was lost while decode checked them (published).
    pub checks_outlived_writer: u64,
    /// Requests decode prefilled itself.
    pub local_prefills: u64,
    /// Control messages lost, duplicated.
    pub messages_lost: u64,
    /// Control messages duplicated.
    pub messages_duplicated: u64,
    /// Node faults.
    pub pauses: u64,
    /// Crashes.
    pub crashes: u64,
    /// Partitions.
    pub partitions: u64,
    /// Output tokens delivered to clients.
    pub tokens: u64,
    /// Time to first token (finished requests).
    pub ttft: Histogram,
    /// Gaps between tokens.
    pub itl: Histogram,
    /// Arrival to last token (finished requests).
    pub e2e: Histogram,
    /// Finished requests within both SLOs (when set).
    pub good: usize,
    /// Virtual time at the end (µs).
    pub virtual_us: u64,
}

/// The planner's summary, as `--json` writes it.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// Prefill workers.
    pub prefill: usize,
    /// Decode workers.
    pub decode: usize,
    /// Offered arrivals per second.
    pub rate: f64,
    /// Requests simulated.
    pub requests: usize,
    /// TTFT p50 (ms).
    pub ttft_p50_ms: f64,
    /// TTFT p90 (ms).
    pub ttft_p90_ms: f64,
    /// TTFT p99 (ms).
    pub ttft_p99_ms: f64,
    /// ITL p50 (ms).
    pub itl_p50_ms: f64,
    /// ITL p90 (ms).
    pub itl_p90_ms: f64,
    /// ITL p99 (ms).
    pub itl_p99_ms: f64,
    /// End to end p50 (ms).
    pub e2e_p50_ms: f64,
    /// End to end p99 (ms).
    pub e2e_p99_ms: f64,
    /// Output tokens per second of virtual time.
    pub throughput_tok_s: f64,
    /// Requests per second within the SLOs (all finished ones when none is set).
    pub goodput_req_s: f64,
    /// Virtual seconds the run covered.
    pub virtual_s: f64,
}

impl Summary {
    /// The summary of a run.
    pub fn of(s: &Stats, prefill: usize, decode: usize, rate: f64, requests: usize) -> Summary {
        let secs = (s.virtual_us as f64 / 1e6).max(1e-9);
        Summary {
            prefill,
            decode,
            rate,
            requests,
            ttft_p50_ms: s.ttft.quantile_ms(0.5),
            ttft_p90_ms: s.ttft.quantile_ms(0.9),
            ttft_p99_ms: s.ttft.quantile_ms(0.99),
            itl_p50_ms: s.itl.quantile_ms(0.5),
            itl_p90_ms: s.itl.quantile_ms(0.9),
            itl_p99_ms: s.itl.quantile_ms(0.99),
            e2e_p50_ms: s.e2e.quantile_ms(0.5),
            e2e_p99_ms: s.e2e.quantile_ms(0.99),
            throughput_tok_s: s.tokens as f64 / secs,
            goodput_req_s: s.good as f64 / secs,
            virtual_s: secs,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_within_a_bucket() {
        let mut h = Histogram::default();
        for us in 1..=10_000u64 {
            h.record(us * 100);
        }
        let p50 = h.quantile_ms(0.5);
        let p99 = h.quantile_ms(0.99);
        assert!((p50 - 500.0).abs() / 500.0 < 0.02, "{p50}");
        assert!((p99 - 990.0).abs() / 990.0 < 0.02, "{p99}");
        assert!((h.mean_ms() - 500.05).abs() < 0.1);
    }
}
