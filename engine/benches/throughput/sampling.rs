//! `throughput --sampling`: what sampling one token costs against the decode step it follows.

use std::time::Instant;

use duet_engine::sampling::Sampler;
use duet_engine::{Engine, EngineOptions, Model, SeqChunk};

/// What sampling one token costs against the decode step it follows: the real model's logits
/// after a prompt, sampled with greedy, the OpenAI default (temperature 1), nucleus and top-k
/// settings, each `SAMPLE_REPS` times (default 200); and one batch-1 decode step of the same
/// engine, so the cost reads as a fraction of a step. A worker samples every sequence of a
/// step on its engine thread after the step, so at batch B a step pays B of these.
pub fn run(path: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    let model = Model::open(path)?;
    let prompt = model
        .tokenizer
        .encode("The capital of France is Paris. The capital of Italy is");
    let mut e = Engine::new(model, EngineOptions::default())?;
    let pages = e.pool.alloc.alloc(8)?;
    fn chunk<'a>(tokens: &'a [u32], start_pos: usize, pages: &'a [u32]) -> SeqChunk<'a> {
        SeqChunk {
            tokens,
            start_pos,
            pages,
            want_logits: true,
        }
    }
    let logits = e.step(&[chunk(&prompt, 0, &pages)])?[0]
        .clone()
        .ok_or("the prompt's step gave no logits")?;
    let reps: usize = std::env::var("SAMPLE_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let mut step = f64::MAX;
    for i in 0..5 {
        let t = Instant::now();
        e.step(&[chunk(&prompt[..1], prompt.len() + i, &pages)])?;
        step = step.min(t.elapsed().as_secs_f64());
    }
    println!(
        "decode step, batch 1: {:.0} us (vocab {})",
        step * 1e6,
        logits.len()
    );
    let cases: [(&str, f32, f32, usize, usize, f32); 6] = [
        ("greedy", 0.0, 1.0, 0, 0, 0.0),
        ("temperature 1", 1.0, 1.0, 0, 0, 0.0),
        ("temperature 0.7, top_p 0.9", 0.7, 0.9, 0, 0, 0.0),
        ("temperature 0.8, top_k 40", 0.8, 1.0, 40, 0, 0.0),
        ("greedy, top_logprobs 5", 0.0, 1.0, 0, 5, 0.0),
        ("temperature 1, penalties, 256 made", 1.0, 1.0, 0, 0, 0.5),
    ];
    // The tokens a sequence has generated, for the penalties' case.
    let generated: Vec<u32> = (0..256u32).map(|i| i * 97 % 5000).collect();
    for (name, temperature, top_p, top_k, top_logprobs, penalty) in cases {
        let mut s = Sampler::new(duet_engine::SamplingParams {
            temperature,
            top_p,
            top_k,
            seed: Some(7),
            top_logprobs,
            penalties: duet_engine::sampling::Penalties {
                presence: penalty,
                frequency: penalty,
            },
            ..Default::default()
        });
        let best = best_per_call(3, reps, &mut || {
            std::hint::black_box(s.sample(&logits, None, &generated));
        });
        println!(
            "sample {name:<34}: {:>7.1} us per token = {:.3} of a batch-1 step",
            best * 1e6,
            best / step
        );
    }
    penalties_late(&logits, step);
    stop_strings(step);
    Ok(())
}

/// The penalties late in a long output, 16,000 tokens generated: counting every generated
/// token again for each new one (`penalize`, what the sampler did), against the sampler's
/// counts kept from token to token (each call counts only the new token).
fn penalties_late(logits: &[f32], step: f64) {
    use duet_engine::sampling::{Penalties, penalize};
    let p = Penalties {
        presence: 0.5,
        frequency: 0.5,
    };
    let mut generated: Vec<u32> = (0..16_000u32).map(|i| i * 97 % 5000).collect();
    let afresh = best_per_call(3, 50, &mut || {
        std::hint::black_box(penalize(logits, &generated, p));
    });
    let mut s = Sampler::new(duet_engine::SamplingParams {
        temperature: 1.0,
        seed: Some(7),
        penalties: p,
        ..Default::default()
    });
    s.sample(logits, None, &generated);
    let kept = best_per_call(3, 50, &mut || {
        let t = s.sample(logits, None, &generated).token;
        generated.push(t);
    });
    println!(
        "penalties after 16000 tokens: counted afresh {:>7.1} us (the count alone), kept counts {:>6.1} us per token (the whole sample) = {:.3} of a batch-1 step",
        afresh * 1e6,
        kept * 1e6,
        kept / step
    );
}

/// A token's stop-string check late in a long output: four stop strings a chat client might
/// send, none in the text, after 1,000 to 16,000 tokens of English (4 bytes a token); the
/// search of the whole text each token (what the scheduler did) against the search of the
/// token's own text and a stop string's length back (`find_stop_after`, what it does).
fn stop_strings(step: f64) {
    use duet_engine::sampling::{find_stop, find_stop_after};
    let stops: Vec<String> = ["\n\nUser:", "</s>", "###", "Observation:"]
        .map(String::from)
        .to_vec();
    let sentence = "The capital of France is Paris, and the capital of Italy is Rome. ";
    for tokens in [1_000, 4_000, 16_000] {
        let text = sentence.repeat(tokens * 4 / sentence.len());
        let new = text.len() - 4;
        let whole = best_per_call(5, 200, &mut || {
            std::hint::black_box(find_stop(std::hint::black_box(&text), &stops));
        });
        let tail = best_per_call(5, 200, &mut || {
            std::hint::black_box(find_stop_after(std::hint::black_box(&text), &stops, new));
        });
        println!(
            "stop strings after {tokens:>6} tokens: whole text {:>7.2} us = {:.4} of a batch-1 step, own text {:>5.3} us",
            whole * 1e6,
            whole / step,
            tail * 1e6
        );
    }
}

/// Seconds per call of `f`: the best of `rounds` rounds of `calls` calls.
fn best_per_call(rounds: usize, calls: usize, f: &mut dyn FnMut()) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..rounds {
        let t = Instant::now();
        for _ in 0..calls {
            f();
        }
        best = best.min(t.elapsed().as_secs_f64() / calls as f64);
    }
    best
}
