//! The load generator's statistics: percentiles, histograms, goodput. Pure functions over the
//! recorded samples, tested on known inputs.

use serde::Serialize;

/// What one request recorded.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RequestRecord {
    /// Seconds since the run started, when it was sent.
    pub sent_s: f64,
    /// Seconds to its first token (`None` if it failed before one).
    pub ttft_s: Option<f64>,
    /// Seconds between consecutive tokens, with the time (since the run started) each gap
    /// ended.
    pub itl: Vec<(f64, f64)>,
    /// Seconds from send to the last token.
    pub e2e_s: Option<f64>,
    /// Tokens received.
    pub tokens: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// The error that ended it, if any.
    pub error: Option<String>,
    /// Which part of the workload it belongs to (`steady`, `long`, `load`).
    pub class: &'static str,
    /// The text received.
    #[serde(skip)]
    pub text: String,
}

/// The `q`-quantile (0..=1) of `values` by the nearest-rank method; `None` when empty.
pub fn percentile(values: &[f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let rank = (q.clamp(0.0, 1.0) * v.len() as f64).ceil() as usize;
    Some(v[rank.saturating_sub(1).min(v.len() - 1)])
}

/// Counts of `values` in `bins` equal bins over `[lo, hi)`; values outside go to the end bins.
pub fn histogram(values: &[f64], lo: f64, hi: f64, bins: usize) -> Vec<usize> {
    let mut counts = vec![0; bins.max(1)];
    let width = (hi - lo) / counts.len() as f64;
    for &x in values {
        let i = if width > 0.0 {
            ((x - lo) / width).floor().max(0.0) as usize
        } else {
            0
        };
        let last = counts.len() - 1;
        counts[i.min(last)] += 1;
    }
    counts
}

/// Service-level objectives a request must meet to count towards goodput.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Slo {
    /// Time to first token at most this, in ms.
    pub ttft_ms: f64,
    /// Every inter-token gap at most this, in ms.
    pub itl_ms: f64,
}

impl Slo {
    /// Whether a finished request met both objectives.
    pub fn met_by(&self, r: &RequestRecord) -> bool {
        r.error.is_none()
            && r.ttft_s.is_some_and(|t| t * 1e3 <= self.ttft_ms)
            && r.itl.iter().all(|(gap, _)| gap * 1e3 <= self.itl_ms)
    }
}

/// The summary `duet bench` prints and writes.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed.
    pub failed: usize,
    /// Output tokens received.
    pub output_tokens: usize,
    /// Output tokens per second of the run.
    pub throughput_tok_s: f64,
    /// Finished requests per second.
    pub requests_per_s: f64,
    /// Requests per second that met the SLO.
    pub goodput_req_s: f64,
    /// Share of requests that met the SLO.
    pub slo_attainment: f64,
    /// Time to first token, ms.
    pub ttft_p50_ms: f64,
    /// Time to first token, ms.
    pub ttft_p99_ms: f64,
    /// Inter-token latency, ms.
    pub itl_p50_ms: f64,
    /// Inter-token latency, ms.
    pub itl_p99_ms: f64,
    /// End-to-end latency, ms.
    pub e2e_p50_ms: f64,
    /// End-to-end latency, ms.
    pub e2e_p99_ms: f64,
    /// Mean and percentiles, ms, as `vllm bench serve` and SGLang's `bench_serving` report
    /// them: time to first token, time per output token (per request: the time after the first
    /// token over the tokens after it), inter-token latency (every gap), end to end.
    pub ttft_ms: Dist,
    /// See [`Summary::ttft_ms`].
    pub tpot_ms: Dist,
    /// See [`Summary::ttft_ms`].
    pub itl_ms: Dist,
    /// See [`Summary::ttft_ms`].
    pub e2e_ms: Dist,
}

/// Mean and percentiles of one latency, ms.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Dist {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Dist {
    /// Of `seconds` (in ms); zeros when empty.
    pub fn of(seconds: &[f64]) -> Dist {
        let v: Vec<f64> = seconds.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return Dist::default();
        }
        let q = |q| percentile(&v, q).map_or(0.0, |x| x * 1e3);
        Dist {
            mean: v.iter().sum::<f64>() / v.len() as f64 * 1e3,
            p50: q(0.5),
            p90: q(0.9),
            p95: q(0.95),
            p99: q(0.99),
        }
    }
}

/// Time per output token of a finished request: (last token - first token) / (tokens - 1).
pub fn tpot_s(r: &RequestRecord) -> Option<f64> {
    match (r.ttft_s, r.e2e_s) {
        (Some(first), Some(last)) if r.tokens > 1 && r.error.is_none() => {
            Some((last - first) / (r.tokens - 1) as f64)
        }
        _ => None,
    }
}

/// Summarises `records` of a run that lasted `seconds`.
pub fn summarize(records: &[RequestRecord], seconds: f64, slo: Slo) -> Summary {
    let ms = |v: Vec<f64>, q| percentile(&v, q).map_or(0.0, |x| x * 1e3);
    let ttft: Vec<f64> = records.iter().filter_map(|r| r.ttft_s).collect();
    let itl: Vec<f64> = records
        .iter()
        .flat_map(|r| r.itl.iter().map(|(g, _)| *g))
        .collect();
    let e2e: Vec<f64> = records.iter().filter_map(|r| r.e2e_s).collect();
    let failed = records.iter().filter(|r| r.error.is_some()).count();
    let finished = records.len() - failed;
    let good = records.iter().filter(|r| slo.met_by(r)).count();
    let output_tokens = records.iter().map(|r| r.tokens).sum();
    let per_s = |n: usize| {
        if seconds > 0.0 {
            n as f64 / seconds
        } else {
            0.0
        }
    };
    Summary {
        requests: records.len(),
        failed,
        output_tokens,
        throughput_tok_s: per_s(output_tokens),
        requests_per_s: per_s(finished),
        goodput_req_s: per_s(good),
        slo_attainment: if records.is_empty() {
            0.0
        } else {
            good as f64 / records.len() as f64
        },
        ttft_ms: Dist::of(&ttft),
        tpot_ms: Dist::of(&records.iter().filter_map(tpot_s).collect::<Vec<_>>()),
        itl_ms: Dist::of(&itl),
        e2e_ms: Dist::of(&e2e),
        ttft_p50_ms: ms(ttft.clone(), 0.5),
        ttft_p99_ms: ms(ttft, 0.99),
        itl_p50_ms: ms(itl.clone(), 0.5),
        itl_p99_ms: ms(itl, 0.99),
        e2e_p50_ms: ms(e2e.clone(), 0.5),
        e2e_p99_ms: ms(e2e, 0.99),
    }
}

/// Empirical CDF points `(value, fraction <= value)` of `values`, sorted.
pub fn cdf(values: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    v.into_iter()
        .enumerate()
        .map(|(i, x)| (x, (i + 1) as f64 / n))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), Some(50.0));
        assert_eq!(percentile(&v, 0.99), Some(99.0));
        assert_eq!(percentile(&v, 1.0), Some(100.0));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 0.5), Some(2.0));
        assert_eq!(percentile(&[], 0.5), None);
        assert_eq!(percentile(&[f64::NAN], 0.5), None);
    }

    #[test]
    fn histograms_count_every_value_once() {
        let h = histogram(&[0.0, 0.5, 1.0, 1.5, 9.9, 10.0, 42.0, -1.0], 0.0, 10.0, 10);
        assert_eq!(h, vec![3, 2, 0, 0, 0, 0, 0, 0, 0, 3]);
        assert_eq!(h.iter().sum::<usize>(), 8);
    }

    #[test]
    fn goodput_counts_requests_that_meet_both_objectives() {
        let ok = RequestRecord {
            ttft_s: Some(0.1),
            itl: vec![(0.02, 1.0), (0.03, 1.1)],
            e2e_s: Some(0.2),
            tokens: 3,
            ..Default::default()
        };
        let slow_first = RequestRecord {
            ttft_s: Some(0.9),
            ..ok.clone()
        };
        let one_stall = RequestRecord {
            itl: vec![(0.02, 1.0), (0.5, 1.5)],
            ..ok.clone()
        };
        let failed = RequestRecord {
            error: Some("boom".into()),
            ttft_s: None,
            itl: vec![],
            e2e_s: None,
            tokens: 0,
            ..ok.clone()
        };
        let slo = Slo {
            ttft_ms: 500.0,
            itl_ms: 100.0,
        };
        let s = summarize(&[ok, slow_first, one_stall, failed], 2.0, slo);
        assert_eq!(s.requests, 4);
        assert_eq!(s.failed, 1);
        assert_eq!(s.output_tokens, 9);
        assert_eq!(s.throughput_tok_s, 4.5);
        assert_eq!(s.requests_per_s, 1.5);
        assert_eq!(s.goodput_req_s, 0.5);
        assert_eq!(s.slo_attainment, 0.25);
        assert_eq!(s.ttft_p50_ms, 100.0);
        assert_eq!(s.itl_p99_ms, 500.0);
        // The distributions agree with the percentiles above; the mean ITL is over every gap.
        assert_eq!(s.ttft_ms.p50, 100.0);
        assert!(
            (s.itl_ms.mean - (0.02 + 0.03 + 0.02 + 0.03 + 0.02 + 0.5) / 6.0 * 1e3).abs() < 1e-9
        );
    }

    #[test]
    fn tpot_is_the_time_after_the_first_token_over_the_tokens_after_it() {
        let r = RequestRecord {
            ttft_s: Some(0.5),
            e2e_s: Some(1.5),
            tokens: 11,
            ..Default::default()
        };
        assert_eq!(tpot_s(&r), Some(0.1));
        assert_eq!(
            tpot_s(&RequestRecord {
                tokens: 1,
                ..r.clone()
            }),
            None
        );
        assert_eq!(
            tpot_s(&RequestRecord {
                error: Some("x".into()),
                ..r
            }),
            None
        );
        let d = Dist::of(&[0.001, 0.002, 0.003, 0.004]);
        assert_eq!(
            (d.mean, d.p50, d.p90, d.p95, d.p99),
            (2.5, 2.0, 4.0, 4.0, 4.0)
        );
    }

    #[test]
    fn cdf_ends_at_one() {
        let c = cdf(&[3.0, 1.0, 2.0, 2.0]);
        assert_eq!(c.first(), Some(&(1.0, 0.25)));
        assert_eq!(c.last(), Some(&(3.0, 1.0)));
    }
}
