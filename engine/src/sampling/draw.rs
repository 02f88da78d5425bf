//! The draw itself: greedy, or a token from the temperature-scaled distribution, whole or cut
//! by top-k and top-p, at memory speed over a vocabulary's row (`kernels::softmax`).
//!
//! With the library's f64 `exp` per logit and a sort of the whole row, temperature sampling
//! cost ~3 ms a token for SmolLM2's 49,152 logits, a quarter of a batch-1 decode step
//! (`throughput --sampling`); a worker samples every sequence of a step on its engine thread.

use super::SamplingParams;
use crate::kernels::{exp, softmax};

/// The token drawn from `logits` (penalties already applied) for `params`, `banned` never;
/// `unit` gives the stream's next uniform number, asked for only where a draw is made.
pub(super) fn draw(
    logits: &[f32],
    banned: Option<u32>,
    params: &SamplingParams,
    unit: impl FnOnce() -> f64,
) -> u32 {
    if params.temperature <= 0.0 {
        return argmax(logits, banned);
    }
    let inv_t = 1.0 / params.temperature;
    ROW.with_borrow_mut(|x| {
        // The scaled logits, `-inf` where a token may not be chosen: its term is then 0.
        // (A select per element, then the banned one: the loop stays vectorized.)
        x.clear();
        x.extend(logits.iter().map(|l| {
            if l.is_finite() {
                l * inv_t
            } else {
                f32::NEG_INFINITY
            }
        }));
        if let Some(v) = banned.and_then(|b| x.get_mut(b as usize)) {
            *v = f32::NEG_INFINITY;
        }
        let max = softmax::max(x);
        if max == f32::NEG_INFINITY {
            return argmax(logits, None);
        }
        if max == f32::INFINITY {
            // A finite logit overflowed under a tiny temperature: in that limit sampling
            // is greedy (the first +inf of the scaled row need not be the largest logit).
            return argmax(logits, banned);
        }
        if params.top_k > 0 || params.top_p < 1.0 {
            return truncated(x, max, params, unit);
        }
        // The whole distribution, walked in id order: no order is needed to draw from it.
        let mut r = unit() * softmax::exp_shifted(x, max);
        let mut chosen = 0;
        for (i, p) in x.iter().enumerate().filter(|(_, p)| **p > 0.0) {
            chosen = i;
            if r < f64::from(*p) {
                break;
            }
            r -= f64::from(*p);
        }
        chosen as u32
    })
}

/// Top-k and top-p over the scaled logits `x` (`-inf` for tokens that may not be chosen)
/// whose largest is `max`: the candidates most likely first, ties by lower id; the first
/// `top_k`; then the shortest prefix whose probabilities reach `top_p`; a draw from what
/// is left in that order.
///
/// Only the tokens within a depth of `max` are sorted (8, then 32, then all): every token
/// outside lies below every token inside, so the window's first k, and its prefix that
/// reaches `top_p` of the whole row's mass (top-p alone) or of the k's (with top-k), are
/// the full sort's. Sorting the whole row cost ~3 ms a token for SmolLM2.
fn truncated(x: &[f32], max: f32, params: &SamplingParams, unit: impl FnOnce() -> f64) -> u32 {
    let order = |a: &(usize, f32), b: &(usize, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let prob = |v: f32| f64::from(exp::exp(v - max));
    let within = |depth: f32| -> Vec<(usize, f32)> {
        x.iter()
            .enumerate()
            .filter(|(_, v)| **v > f32::NEG_INFINITY && **v >= max - depth)
            .map(|(i, v)| (i, *v))
            .collect()
    };
    let (top_k, top_p) = (params.top_k, f64::from(params.top_p));
    // The row's mass, which top-p alone measures its share of.
    let row = (top_k == 0).then(|| softmax::exp_sum(x, max));
    let mut depth = 8.0;
    let (cands, probs) = loop {
        let mut cands = if top_k > 0 && top_k <= TOP_N_UP_TO {
            // The k directly, one pass: the window's depth does not matter then.
            depth = f32::INFINITY;
            let mut k = softmax::top_n(x, top_k);
            k.retain(|(_, v)| *v > f32::NEG_INFINITY);
            k.into_iter().map(|(i, v)| (i as usize, v)).collect()
        } else {
            within(depth)
        };
        let whole = depth == f32::INFINITY;
        let deeper = if depth < 32.0 { 32.0 } else { f32::INFINITY };
        if top_k > 0 && cands.len() < top_k && !whole {
            // Fewer than k this close to the max: the k reach deeper.
            depth = deeper;
            continue;
        }
        if top_k > 0 && cands.len() > top_k {
            cands.select_nth_unstable_by(top_k - 1, order);
            cands.truncate(top_k);
        }
        cands.sort_by(order);
        let mut probs: Vec<f64> = cands.iter().map(|(_, v)| prob(*v)).collect();
        let total = row.unwrap_or_else(|| probs.iter().sum());
        match nucleus(&probs, total, top_p) {
            Some(keep) => probs.truncate(keep),
            // With top-k the k are all there are: keep them all, as the full sort would.
            None if top_k == 0 && !whole => {
                depth = deeper;
                continue;
            }
            None => {}
        }
        break (cands, probs);
    };
    let total: f64 = probs.iter().sum();
    let mut r = unit() * total;
    let mut chosen = cands[probs.len() - 1].0;
    for (i, p) in probs.iter().enumerate() {
        if r < *p {
            chosen = cands[i].0;
            break;
        }
        r -= p;
    }
    chosen as u32
}

/// How many of `probs` (most likely first) top-p keeps: the shortest prefix whose share of
/// `total` reaches `top_p`; `None` when the whole of `probs` does not (then a longer list
/// must be tried, or, when it is the whole row, all of it kept).
fn nucleus(probs: &[f64], total: f64, top_p: f64) -> Option<usize> {
    if top_p >= 1.0 {
        return Some(probs.len());
    }
    let mut cum = 0.0;
    for (i, p) in probs.iter().enumerate() {
        cum += p / total;
        if cum >= top_p {
            return Some(i + 1);
        }
    }
    None
}

/// The largest top-k found by one pass keeping the k ([`softmax::top_n`], insertion into k);
/// a larger one sorts a window.
const TOP_N_UP_TO: usize = 256;

thread_local! {
    /// A row's scratch for [`Sampler::choose`], one per thread that samples rather than one
    /// per sequence (196 KB for SmolLM2's vocabulary; allocated per token it was an `mmap`
    /// and its page faults each time).
    static ROW: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The first index of the largest of `logits` other than `banned` (NaN never counts; the
/// first allowed index when nothing is above `-inf`): the max found eight lanes at a time,
/// then its first place.
fn argmax(logits: &[f32], banned: Option<u32>) -> u32 {
    let skip = banned.map_or(logits.len(), |b| b as usize);
    let (head, tail) = logits.split_at(skip.min(logits.len()));
    let max = softmax::max(head).max(softmax::max(tail.get(1..).unwrap_or(&[])));
    let first_allowed = usize::from(skip == 0);
    if max == f32::NEG_INFINITY {
        return first_allowed.min(logits.len().saturating_sub(1)) as u32;
    }
    let at = logits
        .iter()
        .enumerate()
        .position(|(i, l)| *l == max && i != skip)
        .unwrap_or(first_allowed);
    at as u32
}

#[cfg(test)]
mod tests {
    use super::super::{Sampler, SamplerState};
    use super::*;

    /// The truncations as they were specified before the windows: every candidate sorted
    /// (most likely first, ties by lower id), the first `top_k`, the prefix reaching `top_p`
    /// (of the k's mass with top-k, else of the row's), a draw at `u` in that order.
    fn full_sort(logits: &[f32], p: &SamplingParams, banned: Option<u32>, u: f64) -> u32 {
        let inv_t = 1.0 / p.temperature;
        let x: Vec<f32> = logits
            .iter()
            .enumerate()
            .map(|(i, l)| {
                if banned != Some(i as u32) && l.is_finite() {
                    l * inv_t
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        let max = softmax::max(&x);
        let mut cands: Vec<(usize, f32)> = x
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, v)| *v > f32::NEG_INFINITY)
            .collect();
        cands.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            cands.truncate(p.top_k);
        }
        let mut probs: Vec<f64> = cands
            .iter()
            .map(|(_, v)| f64::from(exp::exp(v - max)))
            .collect();
        let total = if p.top_k > 0 {
            probs.iter().sum()
        } else {
            softmax::exp_sum(&x, max)
        };
        let keep = nucleus(&probs, total, f64::from(p.top_p)).unwrap_or(probs.len());
        probs.truncate(keep);
        let mut r = u * probs.iter().sum::<f64>();
        for (i, q) in probs.iter().enumerate() {
            if r < *q {
                return cands[i].0 as u32;
            }
            r -= q;
        }
        cands[keep - 1].0 as u32
    }

    /// Rows whose nucleus and top k lie at every depth the windows try: a peaked row, a flat
    /// one, one whose mass is 10 and one whose mass is 40 below its max (past the first and
    /// the second window), with ties, a banned token, NaN and infinities.
    fn rows() -> Vec<Vec<f32>> {
        let n = 3000;
        let mut peaked: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32) * -0.2).collect();
        peaked[77] = 5.0;
        peaked[78] = 5.0;
        let flat: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * 0.01).collect();
        let mut deep10 = vec![-10.0f32; n];
        deep10[5] = 0.0;
        deep10[9] = f32::NAN;
        deep10[11] = f32::INFINITY;
        let mut deep40 = vec![-40.0f32; n];
        deep40[2999] = 0.0;
        deep40[0] = f32::NEG_INFINITY;
        for (i, v) in deep40.iter_mut().enumerate().skip(1000) {
            *v -= (i % 3) as f32;
        }
        vec![peaked, flat, deep10, deep40]
    }

    #[test]
    fn windows_choose_what_the_full_sort_chooses() {
        let cases = [
            (1.0, 1.0, 1),
            (1.0, 1.0, 5),
            (0.7, 1.0, 40),
            (1.0, 0.9, 40),
            (1.0, 1.0, 2500),
            (1.0, 1.0, 5000),
            (1.0, 0.5, 0),
            (0.8, 0.9, 0),
            (1.0, 0.99, 0),
            (2.0, 0.95, 0),
        ];
        for (r, logits) in rows().iter().enumerate() {
            for (temperature, top_p, top_k) in cases {
                for seed in 0..40 {
                    let params = SamplingParams {
                        temperature,
                        top_p,
                        top_k,
                        seed: Some(seed),
                        ..SamplingParams::default()
                    };
                    let banned = (seed % 2 == 0).then_some(77);
                    let u = SamplerState { seed, draws: 0 }.next_unit();
                    let want = full_sort(logits, &params, banned, u);
                    let got = Sampler::new(params).sample(logits, banned, &[]).token;
                    assert_eq!(
                        got, want,
                        "row {r}, temperature {temperature}, top_p {top_p}, top_k {top_k}, seed {seed}"
                    );
                }
            }
        }
    }

    #[test]
    fn temperature_alone_draws_from_the_softmax() {
        // Four tokens with probabilities 0.1, 0.2, 0.3, 0.4 at temperature 1, one banned and
        // the rest unreachable.
        let mut logits = vec![f32::NEG_INFINITY; 100];
        for (i, p) in [(3, 0.1f32), (40, 0.2), (41, 0.3), (99, 0.4)] {
            logits[i] = p.ln();
        }
        logits[50] = 30.0;
        logits[60] = f32::NAN;
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: Some(3),
            ..SamplingParams::default()
        });
        let draws = 20_000;
        let mut counts = std::collections::HashMap::new();
        for _ in 0..draws {
            *counts
                .entry(s.sample(&logits, Some(50), &[]).token)
                .or_insert(0) += 1;
        }
        assert_eq!(counts.len(), 4, "{counts:?}");
        for (t, p) in [(3, 0.1), (40, 0.2), (41, 0.3), (99, 0.4)] {
            let share = f64::from(counts[&t]) / f64::from(draws);
            // Five standard deviations of a binomial share at 20,000 draws.
            let sd = (p * (1.0 - p) / f64::from(draws)).sqrt();
            assert!(
                (share - p).abs() < 5.0 * sd,
                "token {t}: {share} against {p}"
            );
        }
    }

    #[test]
    fn a_temperature_that_overflows_the_logits_is_greedy() {
        let mut logits = vec![1.0f32; 30];
        logits[20] = 2.5;
        logits[25] = 2.0;
        let mut s = Sampler::new(SamplingParams {
            temperature: 1e-39,
            seed: Some(5),
            ..SamplingParams::default()
        });
        assert_eq!(s.sample(&logits, None, &[]).token, 20);
        assert_eq!(s.sample(&logits, Some(20), &[]).token, 25);
    }

    #[test]
    fn greedy_skips_the_banned_token_and_nan() {
        let mut logits = vec![0.5f32; 20];
        logits[0] = f32::NAN;
        logits[7] = 3.0;
        logits[12] = 3.0;
        logits[15] = 9.0;
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&logits, None, &[]).token, 15);
        assert_eq!(
            s.sample(&logits, Some(15), &[]).token,
            7,
            "the first of a tie"
        );
        assert_eq!(argmax(&[f32::NEG_INFINITY; 3], Some(0)), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0], Some(1)), 0);
    }
}
