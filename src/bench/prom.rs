//! Reading a node's Prometheus text (its admin API's `/metrics`): a series' value, and a
//! quantile of a histogram the way Prometheus's `histogram_quantile` computes it.

/// The sum of the series `name{labels}` (`labels` as rendered, without braces: `role="decode"`;
/// empty for a series without labels) in a node's Prometheus text; zero when there is none.
pub(super) fn labelled(text: &str, name: &str, labels: &str) -> f64 {
    let series = match labels {
        "" => format!("{name} "),
        l => format!("{name}{{{l}}} "),
    };
    text.lines()
        .filter_map(|l| l.strip_prefix(&series)?.trim().parse::<f64>().ok())
        .sum::<f64>()
}

/// The `q` quantile (0-1) of histogram `name` whose other labels are `labels` (`role="decode"`,
/// or empty for none), interpolated linearly inside the bucket it falls in; `None` without
/// observations. A quantile in the `+Inf` bucket is the last finite bound.
pub(super) fn quantile(text: &str, name: &str, labels: &str, q: f64) -> Option<f64> {
    let prefix = match labels {
        "" => format!("{name}_bucket{{le=\""),
        l => format!("{name}_bucket{{{l},le=\""),
    };
    let mut buckets: Vec<(f64, f64)> = text
        .lines()
        .filter_map(|l| {
            let (le, count) = l.strip_prefix(&prefix)?.split_once("\"} ")?;
            Some((le.parse::<f64>().ok()?, count.trim().parse::<f64>().ok()?))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total;
    let (mut lower, mut below) = (0.0, 0.0);
    for (le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some(lower);
            }
            let share = if count > below {
                (rank - below) / (count - below)
            } else {
                0.0
            };
            return Some(lower + (le - lower) * share);
        }
        (lower, below) = (le, count);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
duet_engine_step_seconds_bucket{role=\"decode\",le=\"0.01\"} 0
duet_engine_step_seconds_bucket{role=\"decode\",le=\"0.02\"} 50
duet_engine_step_seconds_bucket{role=\"decode\",le=\"0.04\"} 98
duet_engine_step_seconds_bucket{role=\"decode\",le=\"+Inf\"} 100
duet_engine_step_seconds_sum{role=\"decode\"} 2.5
duet_engine_step_seconds_count{role=\"decode\"} 100
duet_engine_step_seconds_bucket{role=\"prefill\",le=\"0.01\"} 7
duet_engine_step_seconds_bucket{role=\"prefill\",le=\"+Inf\"} 7
duet_router_itl_seconds_bucket{le=\"0.03\"} 0
duet_router_itl_seconds_bucket{le=\"0.06\"} 4
duet_router_itl_seconds_bucket{le=\"+Inf\"} 4
";

    #[test]
    fn a_quantile_interpolates_inside_its_bucket_for_the_labels_asked() {
        let q = |name, labels, q| quantile(TEXT, name, labels, q).map(|v| (v * 1e4).round());
        let step = "duet_engine_step_seconds";
        // Rank 50 of 100 is the 0.02 bucket's top; rank 75 is 25/48 of the way up the next.
        assert_eq!(q(step, "role=\"decode\"", 0.5), Some(200.0));
        assert_eq!(q(step, "role=\"decode\"", 0.75), Some(304.0));
        // Rank 99 falls past the last finite bound.
        assert_eq!(q(step, "role=\"decode\"", 0.99), Some(400.0));
        // Another role's buckets are another histogram.
        assert_eq!(q(step, "role=\"prefill\"", 0.5), Some(50.0));
        // No other labels.
        assert_eq!(q("duet_router_itl_seconds", "", 0.5), Some(450.0));
        assert_eq!(q("duet_router_ttft_seconds", "", 0.5), None);
    }

    #[test]
    fn a_series_sums_only_its_own_labels() {
        let count = "duet_engine_step_seconds_count";
        assert_eq!(labelled(TEXT, count, "role=\"decode\""), 100.0);
        assert_eq!(labelled(TEXT, count, "role=\"prefill\""), 0.0);
        // No labels: the series written bare, not a labelled one of the same name.
        let text = "duet_kv_verify_seconds_count 3\nduet_kv_verify_seconds_count{x=\"y\"} 5\n";
        assert_eq!(labelled(text, "duet_kv_verify_seconds_count", ""), 3.0);
    }
}
