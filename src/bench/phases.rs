//! The interference run's steady gaps split by what the long prompts were doing when each
//! gap ended (being prefilled, joining decode's batch, neither): which of them a slow step
//! belongs to.

use super::stats::{self, RequestRecord};

/// The steady sequences' gaps split by what the long prompts were doing when each gap ended:
/// whether a step was slow because a long prompt was joining the batch, because one was being
/// prefilled (on the other core, or chunked into decode's own steps colocated), or with
/// neither.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct ItlByPhase {
    /// From a long prompt's send to 100 ms before its first token.
    pub prefilling: Phase,
    /// From then to its last token: its KV checked, it decodes in the batch.
    pub joining: Phase,
    /// Neither.
    pub quiet: Phase,
}

/// The gaps of one phase.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Phase {
    /// How many.
    pub gaps: usize,
    /// Their median, ms (0 when none).
    pub p50_ms: f64,
    /// Their p99, ms.
    pub p99_ms: f64,
    /// How many of the run's gaps at or above its p99 are in this phase.
    pub at_run_p99: usize,
}

impl ItlByPhase {
    /// `gaps` as `(gap, time it ended)` in s, `long` the long prompts' records.
    pub(super) fn of(gaps: &[(f64, f64)], long: &[RequestRecord]) -> ItlByPhase {
        // Each long prompt's (send, joining from, last token), in s since the run started.
        let spans: Vec<(f64, f64, f64)> = long
            .iter()
            .filter_map(|r| {
                let first = r.sent_s + r.ttft_s?;
                let last = r.sent_s + r.e2e_s.unwrap_or(r.ttft_s?);
                Some((r.sent_s, first - 0.1, last))
            })
            .collect();
        // Indices into `split` below; joining wins where one prompt's prefill overlaps
        // another's arrival.
        const PREFILLING: usize = 0;
        const JOINING: usize = 1;
        const QUIET: usize = 2;
        let phase = |t: f64| {
            if spans
                .iter()
                .any(|(_, from, last)| (*from..=*last).contains(&t))
            {
                JOINING
            } else if spans
                .iter()
                .any(|(sent, from, _)| (*sent..*from).contains(&t))
            {
                PREFILLING
            } else {
                QUIET
            }
        };
        let all: Vec<f64> = gaps.iter().map(|(g, _)| *g).collect();
        let p99 = stats::percentile(&all, 0.99).unwrap_or(f64::INFINITY);
        let mut split: [Vec<f64>; 3] = Default::default();
        for (g, t) in gaps {
            split[phase(*t)].push(*g);
        }
        let [prefilling, joining, quiet] = split.map(|v| {
            let ms = |q| stats::percentile(&v, q).map_or(0.0, |g| g * 1e3);
            Phase {
                gaps: v.len(),
                p50_ms: ms(0.5),
                p99_ms: ms(0.99),
                at_run_p99: v.iter().filter(|g| **g >= p99).count(),
            }
        });
        ItlByPhase {
            prefilling,
            joining,
            quiet,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn long(sent_s: f64, ttft_s: f64, e2e_s: f64) -> RequestRecord {
        RequestRecord {
            sent_s,
            ttft_s: Some(ttft_s),
            itl: Vec::new(),
            e2e_s: Some(e2e_s),
            tokens: 4,
            prompt_tokens: 1024,
            error: None,
            class: "long",
            text: String::new(),
        }
    }

    #[test]
    fn gaps_fall_in_the_phase_of_the_long_prompt_around_them() {
        // One long prompt: sent at 1 s, first token at 6 s, last at 6.2 s.
        let longs = [long(1.0, 5.0, 5.2)];
        let gaps: Vec<(f64, f64)> = [
            (0.030, 0.5),  // before it: quiet
            (0.040, 2.0),  // prefilling
            (0.041, 5.89), // prefilling, just before its check
            (0.060, 5.95), // joining: its check and first steps
            (0.080, 6.2),  // joining, its last token
            (0.031, 6.3),  // quiet again
        ]
        .into();
        let b = ItlByPhase::of(&gaps, &longs);
        assert_eq!((b.prefilling.gaps, b.joining.gaps, b.quiet.gaps), (2, 2, 2));
        assert_eq!((b.joining.p50_ms, b.joining.p99_ms), (60.0, 80.0));
        assert_eq!(b.quiet.p50_ms, 30.0);
        // The run's p99 of six gaps is its largest: while the long prompt joins.
        assert_eq!(
            (
                b.prefilling.at_run_p99,
                b.joining.at_run_p99,
                b.quiet.at_run_p99
            ),
            (0, 1, 0)
        );
    }
}
