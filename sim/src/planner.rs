//! The capacity planner: the same simulated cluster without faults or timers, sized by the
//! user (`duet sim --prefill P --decode D --rate R`), reporting what a client would see
//! (TTFT, ITL, end to end, throughput, goodput within SLOs), and a sweep over P:D splits of a
//! fixed number of workers (DistServe's placement question, answered before buying hardware).

use crate::config::SimConfig;
use crate::stats::Summary;

/// Simulates `cfg` (seeded) and summarises it.
pub fn plan(cfg: &SimConfig, seed: u64) -> Summary {
    let r = crate::run(cfg.clone(), seed);
    Summary::of(&r.stats, cfg.prefill, cfg.decode, cfg.rate, cfg.requests)
}

/// Every split of `workers` into at least one prefill and one decode worker, best first:
/// the highest goodput, then the lowest TTFT p99.
pub fn sweep(base: &SimConfig, workers: usize, seed: u64) -> Vec<Summary> {
    let mut all: Vec<Summary> = (1..workers)
        .map(|p| {
            let cfg = SimConfig {
                prefill: p,
                decode: workers - p,
                ..base.clone()
            };
            plan(&cfg, seed)
        })
        .collect();
    all.sort_by(|a, b| {
        b.goodput_req_s
            .total_cmp(&a.goodput_req_s)
            .then(a.ttft_p99_ms.total_cmp(&b.ttft_p99_ms))
    });
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_load_than_capacity_shows_in_ttft_and_more_workers_fix_it() {
        let light = plan(&SimConfig::plan(1, 1, 0.5, 200), 1);
        let heavy = plan(&SimConfig::plan(1, 1, 8.0, 200), 1);
        let bigger = plan(&SimConfig::plan(4, 4, 8.0, 200), 1);
        assert!(
            heavy.ttft_p50_ms > 3.0 * light.ttft_p50_ms,
            "{heavy:?} vs {light:?}"
        );
        assert!(
            bigger.ttft_p50_ms < heavy.ttft_p50_ms / 3.0,
            "{bigger:?} vs {heavy:?}"
        );
        assert!(light.itl_p50_ms > 0.0 && light.throughput_tok_s > 0.0);
    }

    #[test]
    fn a_sweep_tries_every_split_and_ranks_by_goodput() {
        let mut base = SimConfig::plan(1, 1, 4.0, 200);
        base.slo_ttft_us = Some(2_000_000);
        let all = sweep(&base, 4, 3);
        assert_eq!(all.len(), 3);
        assert!(
            all.windows(2)
                .all(|w| w[0].goodput_req_s >= w[1].goodput_req_s)
        );
    }
}
