//! Choosing the next token: presence and frequency penalties, greedy, temperature, top-k,
//! top-p, with a seed; the likeliest alternatives and their log-probabilities when asked
//! for; and when to stop.

use rand::Rng;
use serde::ser::SerializeStruct;
use serde::{Deserialize, Serialize, Serializer};

use crate::kernels::{exp, softmax};

/// The most alternatives a request may ask for per token (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// How to sample and when to stop (the OpenAI parameters, plus the benchmark clients' ones).
///
/// The wire encoding is positional (MessagePack arrays): the trailing optional fields are
/// left out while they are off, so a message that uses none of them reads the same to a build
/// that predates them (see the `Serialize` impl).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct SamplingParams {
    /// 0 is greedy.
    pub temperature: f32,
    /// Nucleus: keep the most likely tokens whose probabilities sum to at least this (1 = off).
    pub top_p: f32,
    /// Keep only the k most likely tokens (0 = off).
    pub top_k: usize,
    /// Seed of the request's random stream; the same seed gives the same tokens.
    pub seed: Option<u64>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Fewest tokens to generate before EOS or a stop string may end the sequence.
    pub min_tokens: usize,
    /// Do not stop at EOS.
    pub ignore_eos: bool,
    /// Stop when the text contains any of these (the stop string is not returned).
    pub stop: Vec<String>,
    /// OpenAI's presence and frequency penalties (left out of the encoding when both are 0
    /// and nothing after them is set).
    #[serde(default)]
    pub penalties: Penalties,
    /// How many of the likeliest tokens to report, with their log-probabilities, at each
    /// position (OpenAI's `top_logprobs`; 0 = none, at most [`MAX_TOP_LOGPROBS`]).
    #[serde(default)]
    pub top_logprobs: usize,
}

impl Serialize for SamplingParams {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // Positional: a trailing field is written when it or one after it is set, so the
        // fields that are written are always a prefix of the struct's.
        let tail = if self.top_logprobs > 0 {
            2
        } else if !self.penalties.is_off() {
            1
        } else {
            0
        };
        let mut st = s.serialize_struct("SamplingParams", 8 + tail)?;
        st.serialize_field("temperature", &self.temperature)?;
        st.serialize_field("top_p", &self.top_p)?;
        st.serialize_field("top_k", &self.top_k)?;
        st.serialize_field("seed", &self.seed)?;
        st.serialize_field("max_tokens", &self.max_tokens)?;
        st.serialize_field("min_tokens", &self.min_tokens)?;
        st.serialize_field("ignore_eos", &self.ignore_eos)?;
        st.serialize_field("stop", &self.stop)?;
        if tail >= 1 {
            st.serialize_field("penalties", &self.penalties)?;
        } else {
            st.skip_field("penalties")?;
        }
        if tail >= 2 {
            st.serialize_field("top_logprobs", &self.top_logprobs)?;
        } else {
            st.skip_field("top_logprobs")?;
        }
        st.end()
    }
}

/// Penalties on the tokens a sequence has generated (OpenAI's, each -2 to 2).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Penalties {
    /// Subtracted from the logit of every token generated at least once (`presence_penalty`).
    pub presence: f32,
    /// Subtracted from a token's logit once per time it was generated (`frequency_penalty`).
    pub frequency: f32,
}

impl Penalties {
    /// Whether both are 0 (the logits do not depend on what was generated).
    pub fn is_off(&self) -> bool {
        self.presence == 0.0 && self.frequency == 0.0
    }
}

/// `logits` with OpenAI's penalties applied: for each token `j` generated `c[j]` times,
/// `logit[j] - c[j] * frequency - (c[j] > 0) * presence`. The prompt does not count, as in
/// OpenAI's definition.
pub fn penalize(logits: &[f32], generated: &[u32], p: Penalties) -> Vec<f32> {
    let mut out = logits.to_vec();
    let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
    for &t in generated {
        *counts.entry(t).or_default() += 1;
    }
    for (t, c) in counts {
        if let Some(l) = out.get_mut(t as usize) {
            *l -= c as f32 * p.frequency + p.presence;
        }
    }
    out
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            max_tokens: 16,
            min_tokens: 0,
            ignore_eos: false,
            stop: Vec::new(),
            penalties: Penalties::default(),
            top_logprobs: 0,
        }
    }
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// EOS or a stop string.
    Stop,
    /// `max_tokens` reached (or the context is full).
    Length,
}

/// The likeliest tokens at one position with their log-probabilities, likeliest first (ties
/// by lower id); empty unless the request asked for them.
pub type TopLogprobs = Vec<(u32, f32)>;

/// A sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// The token.
    pub token: u32,
    /// Its log-probability under the model's distribution (raw logits, temperature 1).
    pub logprob: f32,
    /// The `top_logprobs` likeliest tokens under the same distribution.
    pub top: TopLogprobs,
}

/// Where a sampler's random stream stands: its seed and how many draws it made. Draw `n` is
/// a pure function of `(seed, n)`, so this pair is the whole state: prefill samples the first
/// token and hands the pair to decode with it, and decode continues the very same stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    /// The request's seed (drawn from entropy when the request gave none).
    pub seed: u64,
    /// Draws made so far.
    pub draws: u64,
}

impl SamplerState {
    /// A uniform number in `[0, 1)`, the next of the stream.
    fn next_unit(&mut self) -> f64 {
        // SplitMix64 over (seed, draw index): a counter-based generator, so the state is two
        // integers rather than an opaque buffer.
        let mut z = self.seed.wrapping_add(
            self.draws
                .wrapping_add(1)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15),
        );
        self.draws += 1;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A request's sampler: its parameters and its random stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    state: SamplerState,
}

impl Sampler {
    /// A sampler seeded from `params.seed`, or from entropy when there is none.
    pub fn new(params: SamplingParams) -> Sampler {
        let seed = params.seed.unwrap_or_else(|| rand::rng().random());
        Sampler {
            params,
            state: SamplerState { seed, draws: 0 },
        }
    }

    /// A sampler that continues a stream another process started.
    pub fn resume(params: SamplingParams, state: SamplerState) -> Sampler {
        Sampler { params, state }
    }

    /// Where the random stream stands.
    pub fn state(&self) -> SamplerState {
        self.state
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Samples from `logits` after the penalties for the tokens the sequence has `generated`;
    /// `banned` tokens (EOS before `min_tokens`) are never chosen. The logprob reported is
    /// under the raw logits, as OpenAI's are.
    pub fn sample(&mut self, logits: &[f32], banned: Option<u32>, generated: &[u32]) -> Sampled {
        let token = self.choose(logits, banned, generated);
        // One pass for the normalizer, shared by the chosen token and its alternatives.
        let norm = LogSoftmax::of(logits);
        Sampled {
            token,
            logprob: norm.at(logits, token as usize),
            top: norm.top(logits, self.params.top_logprobs),
        }
    }

    /// The chosen token.
    fn choose(&mut self, logits: &[f32], banned: Option<u32>, generated: &[u32]) -> u32 {
        let raw = logits;
        let penalized;
        let logits = if !self.params.penalties.is_off() {
            penalized = penalize(raw, generated, self.params.penalties);
            &penalized[..]
        } else {
            raw
        };
        if self.params.temperature <= 0.0 {
            return argmax(logits, banned);
        }
        let inv_t = 1.0 / self.params.temperature;
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
            if self.params.top_k > 0 || self.params.top_p < 1.0 {
                return self.truncated(x, max);
            }
            // The whole distribution, walked in id order: no order is needed to draw from it.
            softmax::exp_shifted(x, max);
            let mut r = self.state.next_unit() * softmax::sum(x);
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
    fn truncated(&mut self, x: &[f32], max: f32) -> u32 {
        let order = |a: &(usize, f32), b: &(usize, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let prob = |v: f32| f64::from(exp::exp(v - max));
        let within = |depth: f32| -> Vec<(usize, f32)> {
            x.iter()
                .enumerate()
                .filter(|(_, v)| **v > f32::NEG_INFINITY && **v >= max - depth)
                .map(|(i, v)| (i, *v))
                .collect()
        };
        let (top_k, top_p) = (self.params.top_k, f64::from(self.params.top_p));
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
        let mut r = self.state.next_unit() * total;
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

/// The log-softmax of one row of logits, computed stably: its maximum and the log of its
/// normalizer (`kernels::softmax`: each term the engine's f32 `exp`, summed in f64), then any
/// entry in O(1). The library's f64 `exp` per logit cost ~330 us per token for SmolLM2's
/// 49,152 logits; this ~20.
#[derive(Debug, Clone, Copy)]
pub struct LogSoftmax {
    max: f32,
    log_sum: f64,
}

impl LogSoftmax {
    /// The normalizer of `logits`.
    pub fn of(logits: &[f32]) -> LogSoftmax {
        let max = softmax::max(logits);
        let sum = softmax::exp_sum(logits, max);
        LogSoftmax {
            max,
            log_sum: sum.ln(),
        }
    }

    /// `log softmax(logits)[i]` (`logits` the row this was made of).
    pub fn at(&self, logits: &[f32], i: usize) -> f32 {
        self.of_logit(logits[i])
    }

    fn of_logit(&self, l: f32) -> f32 {
        (f64::from(l - self.max) - self.log_sum) as f32
    }

    /// The `n` likeliest tokens of `logits` and their log-softmax, likeliest first, ties by
    /// lower id (as OpenAI reports them: the model's raw distribution, before penalties,
    /// temperature and truncation); NaN never counts ([`softmax::top_n`]).
    pub fn top(&self, logits: &[f32], n: usize) -> TopLogprobs {
        if n == 0 {
            return Vec::new();
        }
        let best = softmax::top_n(logits, n.min(MAX_TOP_LOGPROBS));
        best.into_iter()
            .map(|(t, l)| (t, self.of_logit(l)))
            .collect()
    }
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

/// `log softmax(logits)[i]` (see [`LogSoftmax`]).
pub fn log_softmax_at(logits: &[f32], i: usize) -> f32 {
    LogSoftmax::of(logits).at(logits, i)
}

/// The `n` likeliest tokens of `logits` and their log-softmax (see [`LogSoftmax::top`]).
pub fn top_logprobs(logits: &[f32], n: usize) -> TopLogprobs {
    LogSoftmax::of(logits).top(logits, n)
}

/// Where in `text` generation should stop, if a stop string appears: the byte index where the
/// earliest one starts.
pub fn find_stop(text: &str, stops: &[String]) -> Option<usize> {
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()))
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_argmax_and_reports_its_logprob() {
        let mut s = Sampler::new(SamplingParams::default());
        let out = s.sample(&[0.0, 2.0, 1.0], None, &[]);
        assert_eq!(out.token, 1);
        let expect = 2.0 - (1f64 + 2f64.exp() + 1f64.exp()).ln() as f32;
        assert!((out.logprob - expect).abs() < 1e-6);
        assert_eq!(s.sample(&[0.0, 2.0, 1.0], Some(1), &[]).token, 2);
    }

    #[test]
    fn a_seed_reproduces_the_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            top_k: 20,
            seed: Some(7),
            ..SamplingParams::default()
        };
        let run = || {
            let mut s = Sampler::new(params.clone());
            (0..20)
                .map(|_| s.sample(&logits, None, &[]).token)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
        // And top-k holds: only the 20 most likely can appear.
        let mut sorted: Vec<usize> = (0..50).collect();
        sorted.sort_by(|a, b| logits[*b].total_cmp(&logits[*a]));
        for t in run() {
            assert!(sorted[..20].contains(&(t as usize)));
        }
    }

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

    #[test]
    fn top_p_keeps_the_nucleus() {
        // One token has almost all the mass: top_p 0.5 must always pick it.
        let mut logits = vec![0.0f32; 10];
        logits[3] = 20.0;
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            seed: Some(1),
            ..SamplingParams::default()
        });
        assert!((0..100).all(|_| s.sample(&logits, None, &[]).token == 3));
    }

    #[test]
    fn penalties_follow_openais_formula_and_only_count_generated_tokens() {
        let params = SamplingParams {
            penalties: Penalties {
                presence: 0.5,
                frequency: 0.25,
            },
            ..SamplingParams::default()
        };
        let out = penalize(&[1.0, 1.0, 1.0, 1.0], &[2, 2, 0, 2, 9], params.penalties);
        // Token 2 three times: 1 - 3 * 0.25 - 0.5; token 0 once: 1 - 0.25 - 0.5; an id outside
        // the vocabulary is ignored.
        assert_eq!(out, vec![0.25, 1.0, -0.25, 1.0]);
        // Greedy moves off a repeated token once its penalty outweighs the margin, and the
        // logprob stays the raw distribution's.
        let logits = [0.0, 2.0, 1.5];
        let mut s = Sampler::new(params.clone());
        assert_eq!(s.sample(&logits, None, &[]).token, 1);
        let out = s.sample(&logits, None, &[1]);
        assert_eq!(out.token, 2);
        assert!((out.logprob - log_softmax_at(&logits, 2)).abs() < 1e-6);
        // Negative penalties favour repetition.
        let mut s = Sampler::new(SamplingParams {
            penalties: Penalties {
                presence: -1.0,
                frequency: 0.0,
            },
            ..SamplingParams::default()
        });
        assert_eq!(s.sample(&logits, None, &[2]).token, 2);
    }

    #[test]
    fn params_without_the_optional_tail_encode_as_before_it_existed() {
        #[derive(Serialize)]
        struct Before {
            temperature: f32,
            top_p: f32,
            top_k: usize,
            seed: Option<u64>,
            max_tokens: usize,
            min_tokens: usize,
            ignore_eos: bool,
            stop: Vec<String>,
        }
        let p = SamplingParams::default();
        let before = Before {
            temperature: p.temperature,
            top_p: p.top_p,
            top_k: p.top_k,
            seed: p.seed,
            max_tokens: p.max_tokens,
            min_tokens: p.min_tokens,
            ignore_eos: p.ignore_eos,
            stop: p.stop.clone(),
        };
        let bytes = rmp_serde::to_vec(&p).expect("encode");
        assert_eq!(bytes, rmp_serde::to_vec(&before).expect("encode"));
        let penalized = SamplingParams {
            penalties: Penalties {
                presence: 0.0,
                frequency: 1.0,
            },
            ..p.clone()
        };
        // Alternatives asked for without penalties: the penalties are written (as zeros) so
        // the positions hold.
        let top = SamplingParams {
            top_logprobs: 3,
            ..p.clone()
        };
        let both = SamplingParams {
            top_logprobs: 20,
            ..penalized.clone()
        };
        for with in [penalized, top, both] {
            let back: SamplingParams =
                rmp_serde::from_slice(&rmp_serde::to_vec(&with).expect("encode")).expect("decode");
            assert_eq!(back, with);
            let json: SamplingParams =
                serde_json::from_str(&serde_json::to_string(&with).expect("json")).expect("json");
            assert_eq!(json, with);
        }
        // A build before `top_logprobs` reads a penalized message as it always did.
        #[derive(Deserialize)]
        struct WithPenalties {
            _temperature: f32,
            _top_p: f32,
            _top_k: usize,
            _seed: Option<u64>,
            _max_tokens: usize,
            _min_tokens: usize,
            _ignore_eos: bool,
            _stop: Vec<String>,
            penalties: Penalties,
        }
        let old: WithPenalties = rmp_serde::from_slice(
            &rmp_serde::to_vec(&SamplingParams {
                penalties: Penalties {
                    presence: 1.5,
                    frequency: 0.0,
                },
                ..p
            })
            .expect("encode"),
        )
        .expect("decode");
        assert_eq!(old.penalties.presence, 1.5);
    }

    #[test]
    fn top_logprobs_are_the_likeliest_under_the_raw_distribution() {
        let logits = [0.5f32, 3.0, -1.0, 3.0, 2.0, f32::NEG_INFINITY];
        let top = top_logprobs(&logits, 3);
        // Ties by lower id; values are exactly log_softmax_at's.
        let ids: Vec<u32> = top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 4]);
        for (t, lp) in &top {
            assert_eq!(*lp, log_softmax_at(&logits, *t as usize));
        }
        assert!(top_logprobs(&logits, 0).is_empty());
        assert_eq!(top_logprobs(&logits, 50).len(), logits.len());
        // The sampler reports them whatever it chose, before penalties and temperature.
        let mut s = Sampler::new(SamplingParams {
            temperature: 0.7,
            seed: Some(3),
            top_logprobs: 2,
            penalties: Penalties {
                presence: 2.0,
                frequency: 2.0,
            },
            ..SamplingParams::default()
        });
        let out = s.sample(&logits, None, &[1, 1, 3]);
        assert_eq!(out.top, top_logprobs(&logits, 2));
        // Asking for alternatives does not change the token drawn.
        let mut plain = Sampler::new(SamplingParams {
            top_logprobs: 0,
            ..s.params().clone()
        });
        let mut again = Sampler::new(s.params().clone());
        for _ in 0..20 {
            assert_eq!(
                plain.sample(&logits, None, &[]).token,
                again.sample(&logits, None, &[]).token
            );
        }
    }

    #[test]
    fn stop_strings() {
        assert_eq!(
            find_stop("hello world", &["wor".into(), "xyz".into()]),
            Some(6)
        );
        assert_eq!(find_stop("hello", &["".into()]), None);
    }
}
