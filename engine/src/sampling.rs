//! Choosing the next token: presence and frequency penalties, greedy, temperature, top-k,
//! top-p, with a seed; the likeliest alternatives and their log-probabilities when asked
//! for; and when to stop.

use rand::Rng;
use serde::ser::SerializeStruct;
use serde::{Deserialize, Serialize, Serializer};

use crate::kernels::softmax;

mod draw;
mod penalties;
mod stop;

use penalties::Counts;
pub use penalties::penalize;
pub use stop::{find_stop, find_stop_after};

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
    /// The penalties' counts of the sequence's generated tokens.
    counts: Counts,
}

impl Sampler {
    /// A sampler seeded from `params.seed`, or from entropy when there is none.
    pub fn new(params: SamplingParams) -> Sampler {
        let seed = params.seed.unwrap_or_else(|| rand::rng().random());
        Sampler {
            params,
            state: SamplerState { seed, draws: 0 },
            counts: Counts::default(),
        }
    }

    /// A sampler that continues a stream another process started.
    pub fn resume(params: SamplingParams, state: SamplerState) -> Sampler {
        Sampler {
            params,
            state,
            counts: Counts::default(),
        }
    }

    /// Where the random stream stands.
    pub fn state(&self) -> SamplerState {
        self.state
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Samples from `logits` after the penalties for the tokens the sequence has `generated`
    /// (a list that grows from call to call: the counts of its earlier tokens are kept);
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
        let (params, state) = (&self.params, &mut self.state);
        if params.penalties.is_off() {
            return draw::draw(logits, banned, params, || state.next_unit());
        }
        self.counts.update(generated);
        self.counts
            .with_penalized(logits, params.penalties, |logits| {
                draw::draw(logits, banned, params, || state.next_unit())
            })
    }
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

/// `log softmax(logits)[i]` (see [`LogSoftmax`]).
pub fn log_softmax_at(logits: &[f32], i: usize) -> f32 {
    LogSoftmax::of(logits).at(logits, i)
}

/// The `n` likeliest tokens of `logits` and their log-softmax (see [`LogSoftmax::top`]).
pub fn top_logprobs(logits: &[f32], n: usize) -> TopLogprobs {
    LogSoftmax::of(logits).top(logits, n)
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
}
