//! Batch invariance and paging on the tiny model: chunked prefill, page boundaries, batching
//! and position in the batch never change a single bit of the logits.

mod common;

use common::argmax;
use duet_engine::gguf::Gguf;
use duet_engine::{Engine, EngineOptions, Model, SeqChunk, tiny};
use duet_gpu::KvDtype;

fn engine(dtype: KvDtype, page_size: usize) -> Engine {
    let model =
        Model::from_gguf(Gguf::parse(tiny::tiny_model_bytes(7)).expect("gguf")).expect("model");
    Engine::new(
        model,
        EngineOptions {
            kv_dtype: dtype,
            page_size,
            kv_pages: 256,
            threads: 2,
            max_context: 512,
        },
    )
    .expect("engine")
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 3 + (i * 37 + salt * 11) % 250)
        .collect()
}

/// Logits after each of `decode` greedy steps, with the prompt prefilled in `chunk`-sized pieces.
fn run(e: &mut Engine, tokens: &[u32], chunk: usize, decode: usize) -> Vec<Vec<f32>> {
    let pages = e
        .pool
        .alloc
        .alloc(e.pool.layout().pages_for(tokens.len() + decode))
        .expect("pages");
    let first = common::prefill_chunked(e, tokens, &pages, chunk);
    let mut all = vec![first];
    for i in 0..decode {
        let next = argmax(all.last().expect("logits"));
        let out = e
            .step(&[SeqChunk {
                tokens: &[next],
                start_pos: tokens.len() + i,
                pages: &pages,
                want_logits: true,
            }])
            .expect("decode");
        all.push(out.into_iter().next().flatten().expect("logits"));
    }
    e.pool.alloc.release_all(&pages).expect("release");
    all
}

#[test]
fn chunked_prefill_and_page_boundaries_match_one_shot_bit_for_bit() {
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let mut e = engine(dtype, 4);
        let p = prompt(45, 1);
        let one_shot = run(&mut e, &p, p.len(), 12);
        for chunk in [1, 3, 4, 7, 16, 44] {
            assert_eq!(
                run(&mut e, &p, chunk, 12),
                one_shot,
                "{dtype}: chunk {chunk}"
            );
        }
    }
}

#[test]
fn a_long_prefill_split_over_the_threads_matches_short_chunks_bit_for_bit() {
    // 160 tokens on two threads: the products split by token (from 128) and the row-wise
    // operations with them; chunks of 16 and 40 split the products by row (four pieces a
    // thread from 16 tokens) and the row-wise operations evenly (from 16).
    let mut e = engine(KvDtype::F16, 16);
    let p = prompt(160, 2);
    let one_shot = run(&mut e, &p, p.len(), 2);
    for chunk in [16, 40, 100] {
        assert_eq!(run(&mut e, &p, chunk, 2), one_shot, "chunk {chunk}");
    }
}

#[test]
fn batched_decode_matches_each_sequence_alone() {
    let mut e = engine(KvDtype::F16, 4);
    let prompts: Vec<Vec<u32>> = (0..5).map(|i| prompt(9 + 6 * i, i as u32)).collect();
    let alone: Vec<Vec<Vec<f32>>> = prompts.iter().map(|p| run(&mut e, p, p.len(), 6)).collect();

    // All five together: prefill in one step, then decode in one batch per step, with the
    // batch order rotated every step so each sequence sits at every position.
    let tables: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            e.pool
                .alloc
                .alloc(e.pool.layout().pages_for(p.len() + 6))
                .expect("pages")
        })
        .collect();
    let chunks: Vec<SeqChunk> = prompts
        .iter()
        .zip(&tables)
        .map(|(p, t)| SeqChunk {
            tokens: p,
            start_pos: 0,
            pages: t,
            want_logits: true,
        })
        .collect();
    let mut last: Vec<Vec<f32>> = e
        .step(&chunks)
        .expect("prefill")
        .into_iter()
        .map(|l| l.expect("logits"))
        .collect();
    for (i, l) in last.iter().enumerate() {
        assert_eq!(*l, alone[i][0], "prefill of sequence {i} in a batch");
    }
    for step in 0..6 {
        let next: Vec<[u32; 1]> = last.iter().map(|l| [argmax(l)]).collect();
        let order: Vec<usize> = (0..5).map(|k| (k + step) % 5).collect();
        let chunks: Vec<SeqChunk> = order
            .iter()
            .map(|&i| SeqChunk {
                tokens: &next[i],
                start_pos: prompts[i].len() + step,
                pages: &tables[i],
                want_logits: true,
            })
            .collect();
        let out = e.step(&chunks).expect("decode");
        for (k, &i) in order.iter().enumerate() {
            last[i] = out[k].clone().expect("logits");
            assert_eq!(
                last[i],
                alone[i][step + 1],
                "sequence {i}, step {step}, batch position {k}"
            );
        }
    }
}

#[test]
fn bad_requests_are_errors_not_panics() {
    let mut e = engine(KvDtype::F16, 4);
    let pages = e.pool.alloc.alloc(1).expect("pages");
    let vocab = e.model.config.vocab as u32;
    let err = e.step(&[SeqChunk {
        tokens: &[vocab],
        start_pos: 0,
        pages: &pages,
        want_logits: true,
    }]);
    assert!(err.is_err());
    let err = e.step(&[SeqChunk {
        tokens: &[5; 5],
        start_pos: 0,
        pages: &pages,
        want_logits: true,
    }]);
    assert!(matches!(
        err,
        Err(duet_engine::EngineError::PagesTooFew { .. })
    ));
    let err = e.step(&[SeqChunk {
        tokens: &[5],
        start_pos: 600,
        pages: &pages,
        want_logits: true,
    }]);
    assert!(matches!(
        err,
        Err(duet_engine::EngineError::ContextExceeded { .. })
    ));
}
