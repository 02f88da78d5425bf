//! The decode worker's engine steps one by one, from its step log (`serving.step_log`): how much
//! of their spread the batch's shape explains, and what the machine added.
//!
//! A decode step's time is its weights' pass, which grows with the tokens in the batch, plus
//! its attention, which grows with the positions attended. Over a run both change: sequences
//! join, contexts grow from tens to over a thousand tokens. So the steps' p99 over p50 mixes
//! two things: the workload's shape, which no scheduler removes, and jitter, a step slower
//! than its shape says. A least-squares fit of wall time on (1, tokens, positions attended)
//! separates them: the fit's own p99/p50 is the shape's; the steps' times over the fit's are
//! the jitter, split by whether the prefill worker was computing at the time. The kernel's
//! per-thread counters split the wall time too: on CPU, waiting for the core, and the rest
//! (interrupts, the hypervisor).

use duet_actors::step_log::StepRecord;

use super::stats::percentile;

/// What the step log says about a run's decode steps.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct StepSplit {
    /// Steps in the log that computed something.
    pub steps: usize,
    /// The steps' wall time p99 over p50.
    pub wall_p99_over_p50: f64,
    /// The fit: wall ms = `fixed_ms` + `per_token_ms` x tokens + `per_1k_attended_ms` x
    /// positions attended / 1000.
    pub fixed_ms: f64,
    pub per_token_ms: f64,
    pub per_1k_attended_ms: f64,
    /// p99 over p50 of the fit's times: the spread the batch's shape alone gives.
    pub shape_p99_over_p50: f64,
    /// Each step's wall time over the fit's, while the prefill worker computed a step...
    pub while_prefilling: Residual,
    /// ...and while it did not (all steps when there is no prefill worker).
    pub otherwise: Residual,
    /// p99 over p50 of wall time over the fit's, all steps: the jitter.
    pub residual_p99_over_p50: f64,
    /// Shares of the steps' wall time the engine thread was on CPU, waited for its core, and
    /// neither (`None` where the kernel does not say).
    pub on_cpu: Option<f64>,
    pub waited: Option<f64>,
    pub elsewhere: Option<f64>,
}

/// Quantiles of wall time over the fit's time for a set of steps.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Residual {
    pub steps: usize,
    pub p50: f64,
    pub p99: f64,
}

impl StepSplit {
    /// `None` when the log has too few steps to fit (fewer than 10).
    pub fn of(decode: &[StepRecord], prefill: &[StepRecord]) -> Option<StepSplit> {
        let steps: Vec<&StepRecord> = decode.iter().filter(|s| s.tokens > 0).collect();
        if steps.len() < 10 {
            return None;
        }
        let wall: Vec<f64> = steps.iter().map(|s| s.wall_us as f64 / 1e3).collect();
        let shape: Vec<[f64; 3]> = steps
            .iter()
            .map(|s| [1.0, s.tokens as f64, s.attended as f64 / 1e3])
            .collect();
        let coef = fit(&shape, &wall)?;
        let predicted: Vec<f64> = shape
            .iter()
            .map(|x| x.iter().zip(&coef).map(|(x, c)| x * c).sum::<f64>())
            .collect();
        let residual: Vec<f64> = wall
            .iter()
            .zip(&predicted)
            .map(|(w, p)| if *p > 0.0 { w / p } else { f64::NAN })
            .collect();
        // Prefill steps as (start, end) in µs; a decode step is "while prefilling" when its
        // midpoint falls inside one.
        let busy: Vec<(u64, u64)> = prefill
            .iter()
            .filter(|s| s.tokens > 0)
            .map(|s| (s.at_us, s.at_us + s.wall_us))
            .collect();
        let prefilling: Vec<bool> = steps
            .iter()
            .map(|s| {
                let mid = s.at_us + s.wall_us / 2;
                busy.iter().any(|(a, b)| (*a..=*b).contains(&mid))
            })
            .collect();
        let pick = |want: bool| -> Residual {
            let r: Vec<f64> = residual
                .iter()
                .zip(&prefilling)
                .filter(|(_, p)| **p == want)
                .map(|(r, _)| *r)
                .collect();
            Residual {
                steps: r.len(),
                p50: percentile(&r, 0.5).unwrap_or(f64::NAN),
                p99: percentile(&r, 0.99).unwrap_or(f64::NAN),
            }
        };
        let spread = |v: &[f64]| match (percentile(v, 0.99), percentile(v, 0.5)) {
            (Some(hi), Some(mid)) if mid > 0.0 => hi / mid,
            _ => f64::NAN,
        };
        let timed: Vec<&&StepRecord> = steps
            .iter()
            .filter(|s| s.cpu_us.is_some() && s.wait_us.is_some())
            .collect();
        let total: u64 = timed.iter().map(|s| s.wall_us).sum();
        let share = |f: &dyn Fn(&StepRecord) -> u64| {
            (total > 0).then(|| timed.iter().map(|s| f(s)).sum::<u64>() as f64 / total as f64)
        };
        let on_cpu = share(&|s| s.cpu_us.unwrap_or(0));
        let waited = share(&|s| s.wait_us.unwrap_or(0));
        Some(StepSplit {
            steps: steps.len(),
            wall_p99_over_p50: spread(&wall),
            fixed_ms: coef[0],
            per_token_ms: coef[1],
            per_1k_attended_ms: coef[2],
            shape_p99_over_p50: spread(&predicted),
            while_prefilling: pick(true),
            otherwise: pick(false),
            residual_p99_over_p50: spread(&residual),
            on_cpu,
            waited,
            elsewhere: on_cpu.zip(waited).map(|(c, w)| (1.0 - c - w).max(0.0)),
        })
    }
}

/// Least squares of `y` on the rows `x` (normal equations, partial pivoting). A column that
/// never varies apart from the constant one (every step at batch 4) is dropped rather than
/// left singular: its coefficient is 0.
fn fit(x: &[[f64; 3]], y: &[f64]) -> Option<[f64; 3]> {
    for keep in [
        [true, true, true],
        [true, false, true],
        [true, true, false],
        [true, false, false],
    ] {
        let cols: Vec<usize> = (0..3).filter(|c| keep[*c]).collect();
        let n = cols.len();
        // [A | b] with A = XᵀX, b = Xᵀy over the kept columns.
        let mut m = vec![vec![0.0; n + 1]; n];
        for (row, yi) in x.iter().zip(y) {
            for (i, ci) in cols.iter().enumerate() {
                for (j, cj) in cols.iter().enumerate() {
                    m[i][j] += row[*ci] * row[*cj];
                }
                m[i][n] += row[*ci] * yi;
            }
        }
        if let Some(solved) = solve(m) {
            let mut coef = [0.0; 3];
            for (i, c) in cols.iter().enumerate() {
                coef[*c] = solved[i];
            }
            return Some(coef);
        }
    }
    None
}

/// Gaussian elimination of an augmented n x (n+1) system; `None` when it is (nearly) singular.
fn solve(mut m: Vec<Vec<f64>>) -> Option<Vec<f64>> {
    let n = m.len();
    let scale = m
        .iter()
        .flat_map(|r| r[..n].iter())
        .fold(0.0f64, |a, v| a.max(v.abs()));
    for col in 0..n {
        let pivot = (col..n).max_by(|a, b| m[*a][col].abs().total_cmp(&m[*b][col].abs()))?;
        if m[pivot][col].abs() <= scale * 1e-12 {
            return None;
        }
        m.swap(col, pivot);
        let pivot_row = m[col].clone();
        for (r, row) in m.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / pivot_row[col];
                for (x, p) in row[col..].iter_mut().zip(&pivot_row[col..]) {
                    *x -= f * p;
                }
            }
        }
    }
    Some((0..n).map(|i| m[i][n] / m[i][i]).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(at_ms: u64, tokens: usize, attended: usize, slow: f64) -> StepRecord {
        let ms = (5.0 + 3.0 * tokens as f64 + 4.0 * attended as f64 / 1e3) * slow;
        let wall_us = (ms * 1e3) as u64;
        StepRecord {
            at_us: at_ms * 1000,
            wall_us,
            cpu_us: Some(wall_us * 9 / 10),
            wait_us: Some(wall_us / 20),
            tokens,
            attended,
        }
    }

    #[test]
    fn the_shape_is_fitted_and_a_slow_patch_shows_as_jitter_where_it_was() {
        // Four sequences whose contexts grow, a fifth joining now and then; steps 200-219 run
        // 1.5x slower, inside a prefill step.
        let decode: Vec<StepRecord> = (0..1000)
            .map(|i| {
                let tokens = if i % 50 == 0 { 5 } else { 4 };
                let slow = if (200..220).contains(&i) { 1.5 } else { 1.0 };
                step(i * 40, tokens, 4 * (100 + i as usize), slow)
            })
            .collect();
        let prefill = vec![StepRecord {
            at_us: 190 * 40_000,
            wall_us: 40 * 40_000,
            cpu_us: None,
            wait_us: None,
            tokens: 256,
            attended: 32_896,
        }];
        let s = StepSplit::of(&decode, &prefill).expect("enough steps");
        assert_eq!(s.steps, 1000);
        // The fit sees through the slow patch (2 % of the steps) to about the true shape.
        assert!((s.per_1k_attended_ms - 4.0).abs() < 0.3, "{s:?}");
        assert!((s.per_token_ms - 3.0).abs() < 1.5, "{s:?}");
        // Contexts growing tenfold spread the steps by their shape alone.
        assert!(s.shape_p99_over_p50 > 1.2, "{s:?}");
        // The slow steps are all while prefilling, none otherwise.
        assert_eq!(s.while_prefilling.steps + s.otherwise.steps, 1000);
        assert!(s.while_prefilling.p99 > 1.35, "{s:?}");
        assert!(s.otherwise.p99 < 1.1, "{s:?}");
        let (c, w, e) = (s.on_cpu.unwrap(), s.waited.unwrap(), s.elsewhere.unwrap());
        assert!((c - 0.9).abs() < 0.01 && (w - 0.05).abs() < 0.01 && (e - 0.05).abs() < 0.02);
    }

    #[test]
    fn a_batch_that_never_changes_size_still_fits_and_a_short_log_does_not() {
        let decode: Vec<StepRecord> = (0..100)
            .map(|i| step(i * 40, 4, 400 + 8 * i as usize, 1.0))
            .collect();
        let s = StepSplit::of(&decode, &[]).expect("fits without the tokens column");
        assert_eq!(s.per_token_ms, 0.0);
        assert!((s.per_1k_attended_ms - 4.0).abs() < 0.05, "{s:?}");
        assert!((s.residual_p99_over_p50 - 1.0).abs() < 0.01, "{s:?}");
        assert_eq!(s.while_prefilling.steps, 0);
        assert!(StepSplit::of(&decode[..9], &[]).is_none());
    }
}
