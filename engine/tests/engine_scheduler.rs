//! The colocated scheduler and the prefix cache on the tiny model.

mod common;

use duet_engine::gguf::Gguf;
use duet_engine::sampling::FinishReason;
use duet_engine::scheduler::SeqEvent;
use duet_engine::{Engine, EngineOptions, Model, Runner, SamplingParams, tiny};
use duet_gpu::KvDtype;

fn runner(pages: usize, budget: usize) -> Runner {
    let model =
        Model::from_gguf(Gguf::parse(tiny::tiny_model_bytes(3)).expect("gguf")).expect("model");
    let engine = Engine::new(
        model,
        EngineOptions {
            kv_dtype: KvDtype::F16,
            page_size: 4,
            kv_pages: pages,
            threads: 1,
            max_context: 512,
        },
    )
    .expect("engine");
    Runner::new(engine, budget, 16)
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

fn tokens_of(events: &[SeqEvent], seq: u64) -> Vec<u32> {
    events
        .iter()
        .filter(|e| e.seq == seq)
        .map(|e| e.token)
        .collect()
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 3 + (i * 31 + salt * 7) % 250)
        .collect()
}

#[test]
fn prefix_cache_computes_only_the_suffix_and_gives_the_same_tokens() {
    let shared = prompt(40, 1);
    let mut second = shared.clone();
    second.extend([9, 10, 11, 12, 13]);

    // Without a cached prefix.
    let mut cold = runner(128, 64);
    cold.submit(2, second.clone(), greedy(8)).expect("submit");
    let cold_events = cold.run_to_completion().expect("run");

    let mut r = runner(128, 64);
    r.submit(1, shared.clone(), greedy(8)).expect("submit");
    r.run_to_completion().expect("first");
    let before = r.engine.stats.tokens;
    r.submit(2, second.clone(), greedy(8)).expect("submit");
    let events = r.run_to_completion().expect("second");
    let computed = r.engine.stats.tokens - before;
    // 40 shared tokens = 10 full pages of 4, all cached: only the 5-token suffix is computed,
    // plus the 7 decode steps after the first token.
    assert_eq!(computed, 5 + 7, "tokens computed for the second request");
    assert_eq!(events[0].cached_tokens, 40);
    assert_eq!(tokens_of(&events, 2), tokens_of(&cold_events, 2));
}

#[test]
fn small_page_budget_preempts_and_every_request_finishes() {
    // 24 pages of 4 tokens for 8 requests of 20 + 24 tokens: they cannot all fit at once.
    let mut r = runner(24, 32);
    let mut solo = Vec::new();
    for i in 0..8u64 {
        let mut alone = runner(64, 32);
        alone
            .submit(i, prompt(20, i as u32), greedy(24))
            .expect("submit");
        solo.push(tokens_of(&alone.run_to_completion().expect("solo"), i));
        r.submit(i, prompt(20, i as u32), greedy(24))
            .expect("submit");
    }
    let events = r.run_to_completion().expect("run");
    for i in 0..8u64 {
        let finished: Vec<_> = events
            .iter()
            .filter(|e| e.seq == i && e.finish.is_some())
            .collect();
        assert_eq!(finished.len(), 1, "request {i} finished once");
        assert_eq!(finished[0].finish, Some(FinishReason::Length));
        // Preemption recomputes; greedy output is unchanged.
        assert_eq!(tokens_of(&events, i), solo[i as usize], "request {i}");
    }
    assert!(
        r.scheduler.stats.preemptions > 0,
        "the budget forced preemption"
    );
    r.cache.clear(&mut r.engine.pool.alloc);
    let stats = r.engine.pool.alloc.stats();
    assert_eq!(stats.free, stats.capacity, "every page is back");
}

#[test]
fn stop_conditions_and_aborts() {
    let mut r = runner(64, 64);
    // Greedy run to learn the text, then stop at a piece of it.
    r.submit(1, prompt(10, 3), greedy(12)).expect("submit");
    let events = r.run_to_completion().expect("run");
    let text: String = events.iter().map(|e| e.text.as_str()).collect();
    let cut = text.char_indices().nth(4).map_or(text.len(), |(i, _)| i);
    let stop = text[cut..].chars().take(2).collect::<String>();
    if !stop.is_empty() {
        let params = SamplingParams {
            stop: vec![stop.clone()],
            ..greedy(12)
        };
        r.submit(2, prompt(10, 3), params).expect("submit");
        let events = r.run_to_completion().expect("run");
        let got: String = events.iter().map(|e| e.text.as_str()).collect();
        assert_eq!(
            events.last().and_then(|e| e.finish),
            Some(FinishReason::Stop)
        );
        assert!(
            !got.contains(&stop),
            "the stop string is not returned: {got:?}"
        );
        assert!(text.starts_with(&got));
    }
    // An aborted request frees its pages at once.
    r.submit(3, prompt(30, 5), greedy(50)).expect("submit");
    r.step().expect("step");
    assert!(r.abort(3).expect("abort"));
    r.cache.clear(&mut r.engine.pool.alloc);
    assert_eq!(r.engine.pool.alloc.stats().free, 64);
    // A prompt that cannot fit the context is refused up front.
    assert!(r.submit(4, prompt(500, 1), greedy(100)).is_err());
}

/// A stop string that appears only before `min_tokens` never ends the stream (vLLM's rule):
/// the stream runs to its length. Each token's stop check searches only its own text and a
/// stop string's length back, so an earlier match is not found again once `min_tokens` is
/// reached (the whole-text search had ended the stream there). The real model: the tiny
/// one's text is one token over and over.
#[test]
fn a_stop_string_before_min_tokens_does_not_end_the_stream_later() {
    let model = Model::open(&common::model_path()).expect("model");
    let engine = Engine::new(
        model,
        EngineOptions {
            kv_dtype: KvDtype::F16,
            page_size: 16,
            kv_pages: 8,
            threads: 1,
            ..EngineOptions::default()
        },
    )
    .expect("engine");
    let mut r = Runner::new(engine, 64, 2);
    let ids = r.engine.model.tokenizer.encode("The capital of France is");
    r.submit(1, ids.clone(), greedy(16)).expect("submit");
    let events = r.run_to_completion().expect("run");
    let pieces: Vec<&str> = events.iter().map(|e| e.text.as_str()).collect();
    let text: String = pieces.concat();
    let (early, late) = (pieces[..3].concat(), pieces[3..].concat());
    // The shortest piece of the first three tokens' text found nowhere after them.
    let bounds: Vec<usize> = (0..=early.len())
        .filter(|i| early.is_char_boundary(*i))
        .collect();
    let mut candidates: Vec<&str> = Vec::new();
    for (a, i) in bounds.iter().enumerate() {
        for j in &bounds[a + 1..] {
            candidates.push(&early[*i..*j]);
        }
    }
    let stop = candidates
        .into_iter()
        .filter(|s| text.matches(*s).count() == 1 && !late.contains(*s))
        .min_by_key(|s| s.len())
        .map(str::to_string);
    let Some(stop) = stop else {
        panic!("no piece of {early:?} is absent from the rest of {text:?}");
    };
    let params = SamplingParams {
        stop: vec![stop.clone()],
        min_tokens: 8,
        ..greedy(16)
    };
    r.submit(2, ids.clone(), params).expect("submit");
    let got = r.run_to_completion().expect("run");
    assert_eq!(got.len(), 16, "{stop:?} before min_tokens ended the stream");
    assert_eq!(
        got.last().and_then(|e| e.finish),
        Some(FinishReason::Length)
    );
    assert_eq!(
        got.iter().map(|e| e.text.as_str()).collect::<String>(),
        text
    );
    // Without min_tokens the same string ends the stream in its first three tokens.
    let params = SamplingParams {
        stop: vec![stop.clone()],
        ..greedy(16)
    };
    r.submit(3, ids, params).expect("submit");
    let got = r.run_to_completion().expect("run");
    assert_eq!(got.last().and_then(|e| e.finish), Some(FinishReason::Stop));
    assert!(
        got.len() <= 3,
        "{stop:?} ended the stream at token {}",
        got.len()
    );
}

/// A stream cut after `cut` tokens and resumed from prompt + those tokens (migration) gives
/// the same tokens and, together with what was sent before the cut, the same text.
#[test]
fn a_resumed_stream_continues_exactly_where_it_was_cut() {
    use duet_engine::scheduler::Resume;
    let mut r = runner(128, 64);
    let seeded = SamplingParams {
        temperature: 0.9,
        seed: Some(11),
        ..greedy(16)
    };
    for params in [greedy(16), seeded] {
        r.submit(1, prompt(13, 2), params.clone()).expect("submit");
        let whole = r.run_to_completion().expect("run");
        let text: String = whole.iter().map(|e| e.text.as_str()).collect();
        for cut in [1, 5, 15] {
            let sent: String = whole[..cut].iter().map(|e| e.text.as_str()).collect();
            let mut resumed_prompt = prompt(13, 2);
            resumed_prompt.extend(whole[..cut].iter().map(|e| e.token));
            let resume = Resume {
                generated: cut,
                emitted: sent.len(),
            };
            r.submit_resumed(2, resumed_prompt, params.clone(), resume)
                .expect("submit");
            let rest = r.run_to_completion().expect("run");
            assert_eq!(rest.len(), 16 - cut, "max_tokens counts what came before");
            assert_eq!(tokens_of(&rest, 2), tokens_of(&whole, 1)[cut..].to_vec());
            let got: String = rest.iter().map(|e| e.text.as_str()).collect();
            assert_eq!(format!("{sent}{got}"), text, "cut at {cut}");
        }
    }
}

#[test]
fn each_step_reports_the_tokens_it_computed_and_the_positions_they_attended() {
    use duet_engine::scheduler::StepShape;
    // A 10-token budget: the 25-token prompt goes in chunks of 10, 10 and 5, then one token
    // per decode step, each attending over one more position.
    let mut r = runner(64, 10);
    r.submit(1, prompt(25, 2), greedy(3)).expect("submit");
    let mut shapes = Vec::new();
    while !r.scheduler.is_idle() {
        r.step().expect("step");
        shapes.push(r.last_step);
    }
    let chunk = |start: usize, len: usize| StepShape {
        tokens: len,
        attended: (start + 1..=start + len).sum(),
    };
    assert_eq!(
        shapes,
        vec![
            chunk(0, 10),
            chunk(10, 10),
            chunk(20, 5),
            chunk(25, 1),
            chunk(26, 1)
        ],
        "three prompt chunks (the last samples the first token), then two decode steps"
    );
    // Idle: nothing computed, and the last shape says so.
    r.step().expect("idle step");
    assert_eq!(r.last_step, StepShape::default());
}
