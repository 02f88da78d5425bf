//! Engine throughput on the real model: prefill of a 512-token prompt, decode at batch 1, 8
//! and 32, with 1 and 2 threads. Prints tokens per second. `cargo bench -p duet-engine`.
//!
//! `benches/engine_vs_llamacpp.sh` runs this beside llama.cpp on the same GGUF.

use std::time::Instant;

use duet_engine::{Engine, EngineOptions, Model, SeqChunk};
use duet_fetch as fetch;
use duet_gpu::KvDtype;

#[path = "throughput/sampling.rs"]
mod sampling;

fn main() {
    let path = std::env::var_os(fetch::MODEL_ENV)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../models")
                .join(fetch::MODEL_FILE)
        });
    let path = fetch::ensure_model(&path, &mut |_| {}).expect("model");
    let args: Vec<String> = std::env::args().collect();
    let threads_list: Vec<usize> = match args.iter().position(|a| a == "--threads") {
        Some(i) => args[i + 1]
            .split(',')
            .filter_map(|s| s.parse().ok())
            .collect(),
        None => vec![1, 2],
    };
    let quick = args.iter().any(|a| a == "--quick");
    if args.iter().any(|a| a == "--attention") {
        // The attention kernel alone (`ATTN_CTX`, `ATTN_SEQS`, `ATTN_PAGE` set its shape).
        let model = Model::open(&path).expect("model");
        attention_kernel(&model);
        return;
    }
    if args.iter().any(|a| a == "--sampling") {
        if let Err(e) = sampling::run(&path) {
            eprintln!("throughput --sampling: {e}");
            std::process::exit(1);
        }
        return;
    }
    if args.iter().any(|a| a == "--kernels") {
        kernels(&path);
        return;
    }
    let as_json = args.iter().any(|a| a == "--json");
    if args.iter().any(|a| a == "--decode-profile") {
        let model = Model::open(&path).expect("model");
        let prompt = model.tokenizer.encode(&"The quick brown fox. ".repeat(120));
        let mut e = Engine::new(
            model,
            EngineOptions {
                kv_pages: 512,
                threads: std::env::var("THREADS")
                    .ok()
                    .and_then(|t| t.parse().ok())
                    .unwrap_or(1),
                ..EngineOptions::default()
            },
        )
        .expect("engine");
        // BATCH=32 profiles the batch-32 step instead; CTX=448 decodes after a long context.
        let env = |name: &str, default: usize| {
            std::env::var(name)
                .ok()
                .and_then(|t| t.parse().ok())
                .unwrap_or(default)
        };
        // STEPS sets the steps decoded (the context grows by one per step).
        let (batch, ctx) = (env("BATCH", 1), env("CTX", 32));
        let steps = env("STEPS", 300 / batch.max(1) * 4);
        println!(
            "decode b{batch} ctx {ctx}: {:.1} tok/s",
            decode(&mut e, &prompt, batch, ctx, steps)
        );
        return;
    }
    for threads in threads_list {
        let model = Model::open(&path).expect("model");
        let gguf_mb = model.file_bytes as f64 / 1e6;
        let prompt: Vec<u32> = model
            .tokenizer
            .encode(&"The quick brown fox jumps over the lazy dog. ".repeat(60))
            .into_iter()
            .take(512)
            .collect();
        let mut e = Engine::new(
            model,
            EngineOptions {
                kv_dtype: KvDtype::F16,
                kv_pages: 32 * 40 + 64,
                threads,
                ..EngineOptions::default()
            },
        )
        .expect("engine");
        let kv_pool_mb = (e.pool.capacity() * e.pool.layout().page_bytes()) as f64 / 1e6;
        let rss_after_load_mb = rss_mb();
        let runs = if quick { 1 } else { 3 };
        // Prefill: the whole prompt in one step.
        let pages = e.pool.alloc.alloc(33).expect("pages");
        let mut best = f64::MAX;
        for _ in 0..runs {
            let start = Instant::now();
            e.step(&[SeqChunk {
                tokens: &prompt,
                start_pos: 0,
                pages: &pages,
                want_logits: true,
            }])
            .expect("prefill");
            best = best.min(start.elapsed().as_secs_f64());
        }
        let prefill_tok_s = prompt.len() as f64 / best;
        if args.iter().any(|a| a == "--prefill-only") {
            println!("threads {threads}: prefill {prefill_tok_s:.1} tok/s");
            continue;
        }
        e.pool.alloc.release_all(&pages).expect("release");
        let steps = if quick { 8 } else { 64 };
        let decode_b1_after_512_tok_s = decode(&mut e, &prompt, 1, 448, steps);
        let decode_b1_tok_s = (0..runs)
            .map(|_| decode(&mut e, &prompt, 1, 32, steps))
            .fold(0.0, f64::max);
        let decode_b8_tok_s = decode(&mut e, &prompt, 8, 32, steps / 2);
        let decode_b32_tok_s = decode(&mut e, &prompt, 32, 32, steps / 4);
        // The batch-32 step's multiply-adds against the core's f32 FMA peak, both measured in
        // this run (the peak once per thread count, right after the step it is compared with).
        let b32_gmac_s = decode_b32_tok_s * macs_per_token(&e.model) / 1e9;
        let peak_gmac_s = fma_peak_gmac_s() * threads as f64;
        // Batch 1 streams every weight once per token: its weight bytes per second against
        // what `threads` cores read now cycling through as many bytes, sequentially, with
        // nothing to compute.
        let weight_bytes = weight_bytes_per_token(&e.model);
        let b1_weight_gb_s = decode_b1_tok_s * weight_bytes / 1e9;
        let read_gb_s = memory_read_gb_s(threads, weight_bytes as usize);
        if as_json {
            println!(
                "{{\"engine\": \"duet\", \"threads\": {threads}, \"prefill_tok_s\": {prefill_tok_s:.2}, \"decode_b1_tok_s\": {decode_b1_tok_s:.2}, \"decode_b1_after_512_tok_s\": {decode_b1_after_512_tok_s:.2}, \"decode_b8_tok_s\": {decode_b8_tok_s:.2}, \"decode_b32_tok_s\": {decode_b32_tok_s:.2}, \"b32_gmac_s\": {b32_gmac_s:.2}, \"fma_peak_gmac_s\": {peak_gmac_s:.2}, \"b1_weight_gb_s\": {b1_weight_gb_s:.2}, \"memory_read_gb_s\": {read_gb_s:.2}, \"rss_after_load_mb\": {rss_after_load_mb:.1}, \"gguf_mb\": {gguf_mb:.1}, \"kv_pool_mb\": {kv_pool_mb:.1}}}"
            );
        } else {
            println!(
                "threads {threads}: prefill {} tokens          {prefill_tok_s:>8.1} tok/s",
                prompt.len()
            );
            println!(
                "threads {threads}: decode batch  1 (ctx 32)     {decode_b1_tok_s:>8.1} tok/s"
            );
            println!(
                "threads {threads}: decode batch  1 (ctx 480)    {decode_b1_after_512_tok_s:>8.1} tok/s"
            );
            println!(
                "threads {threads}: decode batch  8              {decode_b8_tok_s:>8.1} tok/s"
            );
            println!(
                "threads {threads}: decode batch 32              {decode_b32_tok_s:>8.1} tok/s"
            );
            println!(
                "threads {threads}: batch 32 = {b32_gmac_s:.1} GMAC/s = {:.0} % of the f32 FMA peak ({peak_gmac_s:.1} GMAC/s on {threads} core(s), measured now)",
                100.0 * b32_gmac_s / peak_gmac_s
            );
            println!(
                "threads {threads}: batch 1 reads its weights at {b1_weight_gb_s:.1} GB/s = {:.0} % of what {threads} core(s) read cycling through as many bytes ({read_gb_s:.1} GB/s, measured now)",
                100.0 * b1_weight_gb_s / read_gb_s
            );
            println!(
                "threads {threads}: resident after load {rss_after_load_mb:.0} MB (GGUF {gguf_mb:.0} MB, KV pool {kv_pool_mb:.0} MB)"
            );
        }
    }
}

/// Decode tokens per second for `batch` sequences that each start from `ctx` prompt tokens.
fn decode(e: &mut Engine, prompt: &[u32], batch: usize, ctx: usize, steps: usize) -> f64 {
    let pages_each = e.pool.layout().pages_for(ctx + steps);
    let seqs: Vec<Vec<u32>> = (0..batch)
        .map(|_| e.pool.alloc.alloc(pages_each).expect("pages"))
        .collect();
    let chunks: Vec<SeqChunk> = seqs
        .iter()
        .map(|p| SeqChunk {
            tokens: &prompt[..ctx],
            start_pos: 0,
            pages: p,
            want_logits: false,
        })
        .collect();
    e.step(&chunks).expect("context");
    let token = [prompt[40]];
    let start = Instant::now();
    for s in 0..steps {
        let chunks: Vec<SeqChunk> = seqs
            .iter()
            .map(|p| SeqChunk {
                tokens: &token,
                start_pos: ctx + s,
                pages: p,
                want_logits: true,
            })
            .collect();
        e.step(&chunks).expect("decode");
    }
    let rate = (batch * steps) as f64 / start.elapsed().as_secs_f64();
    for p in seqs {
        e.pool.alloc.release_all(&p).expect("release");
    }
    rate
}

/// Multiply-adds of the matrix products per decoded token (every layer's projections and
/// the LM head; attention over a short context is left out, so the fraction is a floor).
fn macs_per_token(m: &Model) -> f64 {
    let layer: usize = m
        .layers
        .iter()
        .map(|l| {
            [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                .iter()
                .map(|w| {
                    let q = m.w(w);
                    q.rows * q.cols
                })
                .sum::<usize>()
        })
        .sum();
    let head = m.lm_head();
    (layer + head.rows * head.cols) as f64
}

/// Bytes of weights one decode token reads: every layer's matrices and the LM head, as the
/// kernels hold them (repacked).
fn weight_bytes_per_token(m: &Model) -> f64 {
    let layer: usize = m
        .layers
        .iter()
        .map(|l| {
            [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                .iter()
                .map(|w| m.w(w).bytes.len())
                .sum::<usize>()
        })
        .sum();
    (layer + m.lm_head().bytes.len()) as f64
}

/// What `threads` cores read per second cycling through a buffer of `bytes` (the weights'
/// size: the working set batch-1 decode cycles through): each sums its share with the
/// widest loads this process computes with (AVX-512's read 14.5 GB/s on one Sapphire Rapids
/// core where AVX2's read 13 and a portable loop 11), four independent chains, best of five
/// passes after one to warm. Where the last-level cache holds part of the buffer, that part
/// counts as it does for decode: a 256 MB buffer, used before, read slower than batch-1
/// decode read its 111 MB of weights on a guest with a 480 MB L3 (decode at 111-121 % of it).
#[allow(unsafe_code)] // target_feature functions, called after the ISA was detected
fn memory_read_gb_s(threads: usize, bytes: usize) -> f64 {
    fn portable(part: &[f32]) -> f32 {
        let mut acc = [0f32; 16];
        for c in part.chunks_exact(16) {
            for (a, w) in acc.iter_mut().zip(c) {
                *a += *w;
            }
        }
        acc.iter().sum()
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn avx512(part: &[f32]) -> f32 {
        use std::arch::x86_64::*;
        let mut acc = [_mm512_setzero_ps(); 4];
        for c in part.chunks_exact(64) {
            for (k, a) in acc.iter_mut().enumerate() {
                // SAFETY: 16 floats from `16 * k` are inside the 64 of `c`.
                *a = _mm512_add_ps(*a, unsafe { _mm512_loadu_ps(c.as_ptr().add(16 * k)) });
            }
        }
        acc.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn avx2(part: &[f32]) -> f32 {
        use std::arch::x86_64::*;
        let mut acc = [_mm256_setzero_ps(); 4];
        for c in part.chunks_exact(32) {
            for (k, a) in acc.iter_mut().enumerate() {
                // SAFETY: 8 floats from `8 * k` are inside the 32 of `c`.
                *a = _mm256_add_ps(*a, unsafe { _mm256_loadu_ps(c.as_ptr().add(8 * k)) });
            }
        }
        let mut out = [0f32; 8];
        for v in acc {
            // SAFETY: `out` has room for the 8 lanes.
            unsafe {
                _mm256_storeu_ps(
                    out.as_mut_ptr(),
                    _mm256_add_ps(v, _mm256_loadu_ps(out.as_ptr())),
                )
            };
        }
        out.iter().sum()
    }
    let sum: fn(&[f32]) -> f32 = match duet_engine::kernels::isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: isa() reported the feature.
        duet_engine::kernels::Isa::Avx512 => |p| unsafe { avx512(p) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: isa() reported the feature.
        duet_engine::kernels::Isa::Avx2 | duet_engine::kernels::Isa::Avx2NoF16c => {
            |p| unsafe { avx2(p) }
        }
        _ => portable,
    };
    let words = vec![1f32; (bytes / 4).div_ceil(64 * threads.max(1)) * 64 * threads.max(1)];
    let share = words.len() / threads.max(1);
    let mut best = f64::INFINITY;
    for pass in 0..6 {
        let start = Instant::now();
        std::thread::scope(|s| {
            let parts: Vec<_> = std::hint::black_box(&words)
                .chunks(share)
                .map(|part| s.spawn(move || std::hint::black_box(sum(part))))
                .collect();
            for p in parts {
                let _ = p.join();
            }
        });
        if pass > 0 {
            best = best.min(start.elapsed().as_secs_f64());
        }
    }
    (words.len() * 4) as f64 / best / 1e9
}

/// One core's f32 fused multiply-add peak in GMAC/s: twelve independent accumulator chains
/// of the widest vector this process computes with, no memory traffic (each chain long enough
/// to hide the FMA latency). The kernels' own loops cannot beat it.
#[allow(unsafe_code)] // target_feature functions, called after the ISA was detected
fn fma_peak_gmac_s() -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        const CHAINS: usize = 12;
        const ITERS: usize = 4_000_000;
        #[target_feature(enable = "avx512f")]
        unsafe fn avx512() -> f32 {
            let a = _mm512_set1_ps(0.999_999);
            let b = _mm512_set1_ps(1e-7);
            let mut acc = [_mm512_set1_ps(1.0); CHAINS];
            for _ in 0..ITERS {
                for c in acc.iter_mut() {
                    *c = _mm512_fmadd_ps(*c, a, b);
                }
            }
            acc.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2() -> f32 {
            let a = _mm256_set1_ps(0.999_999);
            let b = _mm256_set1_ps(1e-7);
            let mut acc = [_mm256_set1_ps(1.0); CHAINS];
            for _ in 0..ITERS {
                for c in acc.iter_mut() {
                    *c = _mm256_fmadd_ps(*c, a, b);
                }
            }
            let mut out = [0f32; 8];
            for v in acc {
                // SAFETY: `out` has room for the 8 lanes.
                unsafe {
                    _mm256_storeu_ps(
                        out.as_mut_ptr(),
                        _mm256_add_ps(v, _mm256_loadu_ps(out.as_ptr())),
                    )
                };
            }
            out.iter().sum()
        }
        let (lanes, run): (usize, fn() -> f32) = match duet_engine::kernels::isa() {
            // SAFETY: isa() reported the feature.
            duet_engine::kernels::Isa::Avx512 => (16, || unsafe { avx512() }),
            duet_engine::kernels::Isa::Avx2 | duet_engine::kernels::Isa::Avx2NoF16c => {
                // SAFETY: isa() reported the feature.
                (8, || unsafe { avx2() })
            }
            _ => return f64::NAN,
        };
        let best = (0..3)
            .map(|_| {
                let t = Instant::now();
                std::hint::black_box(run());
                t.elapsed().as_secs_f64()
            })
            .fold(f64::MAX, f64::min);
        (CHAINS * ITERS * lanes) as f64 / best / 1e9
    }
    #[cfg(not(target_arch = "x86_64"))]
    f64::NAN
}

/// Resident set size of this process, in MB.
fn rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1e3)
}

/// Times one matrix product of each shape of the model at 1 token and 32 tokens.
fn kernels(path: &std::path::Path) {
    let model = Model::open(path).expect("model");
    let one = duet_engine::step_pool::StepPool::new(1).expect("team");
    let l = &model.layers[0];
    // `KERNEL_TOKENS=32` (or `1,32`...) times only those token counts.
    let counts: Vec<usize> = std::env::var("KERNEL_TOKENS")
        .ok()
        .map(|v| v.split(',').filter_map(|t| t.parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 2, 3, 4, 6, 32]);
    for (name, m) in [
        ("attn_q", &l.wq),
        ("attn_k", &l.wk),
        ("ffn_up", &l.w_up),
        ("ffn_down", &l.w_down),
    ] {
        let w = model.w(m);
        for &tokens in &counts {
            let x = vec![0.5f32; tokens * w.cols];
            let mut out = vec![0f32; tokens * w.rows];
            let reps = 2000 / tokens;
            let start = Instant::now();
            for _ in 0..reps {
                duet_engine::kernels::matmul(w, &x, tokens, &mut out, &one);
            }
            let per = start.elapsed().as_secs_f64() / reps as f64;
            let macs = (w.rows * w.cols * tokens) as f64;
            println!(
                "{name:>9} {}x{} tokens {tokens:>2}: {:>8.1} us  {:>6.2} GMAC/s",
                w.rows,
                w.cols,
                per * 1e6,
                macs / per / 1e9
            );
        }
    }
    attention_kernel(&model);
    println!("f32 FMA peak, one core: {:.1} GMAC/s", fma_peak_gmac_s());
    let head = model.lm_head();
    let x = vec![0.5f32; head.cols];
    let mut out = vec![0f32; head.rows];
    let start = Instant::now();
    for _ in 0..50 {
        duet_engine::kernels::matmul(head, &x, 1, &mut out, &one);
    }
    println!(
        "  lm_head 1 token: {:.1} us",
        start.elapsed().as_secs_f64() / 50.0 * 1e6
    );
}

/// One decode step's attention over every layer for `ATTN_SEQS` sequences (default 1) at an
/// `ATTN_CTX`-position context (default 480; f16 KV, the model's heads, pages of
/// `ATTN_PAGE`, default 16; `ATTN_REPS` steps per round), alone: its time per position and KV head, and the KV bytes it
/// reads per second. Two ways, alternated in the same process: each token's KV heads in one
/// call (`whole`), and one call per KV head (`per head`, how a step split its heads over
/// threads), each head's call right after the last.
fn attention_kernel(model: &Model) {
    use duet_engine::kernels::attention::{AttnScratch, AttnShape, attend};
    let c = model.config;
    let env = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let layout = duet_gpu::KvLayout {
        n_layers: c.n_layers,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
        page_size: env("ATTN_PAGE", 16),
        dtype: KvDtype::F16,
    };
    let (ctx, seqs) = (env("ATTN_CTX", 480), env("ATTN_SEQS", 1));
    let per_seq = layout.pages_for(ctx);
    let mut pool = duet_gpu::KvPool::new(layout, per_seq * seqs).expect("pool");
    // Interleaved and backwards: a sequence's pages are not in order in a real pool.
    let tables: Vec<Vec<u32>> = (0..seqs)
        .map(|s| (0..per_seq).rev().map(|i| (i * seqs + s) as u32).collect())
        .collect();
    let row: Vec<f32> = (0..layout.kv_dim()).map(|i| (i % 7) as f32 * 0.1).collect();
    for pages in &tables {
        for layer in 0..c.n_layers {
            for j in 0..ctx {
                let (page, slot) = (pages[j / layout.page_size], j % layout.page_size);
                pool.write_token(page, layer, slot, &row, &row);
            }
        }
    }
    let shape = AttnShape {
        n_heads: c.n_heads,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
    };
    let q = vec![0.01f32; c.n_heads * c.head_dim];
    let mut out = vec![0f32; c.n_heads * c.head_dim];
    let group_width = c.n_heads / c.n_kv_heads * c.head_dim;
    let mut scratch = AttnScratch::default();
    // `ATTN_REPS` longer, for a profiler's samples.
    let reps = env("ATTN_REPS", (9600 / (ctx * seqs)).max(4));
    let units = (c.n_layers * c.n_kv_heads * ctx * seqs) as f64;
    let bytes = units * 2.0 * (c.head_dim * 2) as f64;
    let mut best = [f64::MAX; 2];
    for round in 0..6 {
        let split = round % 2 == 1;
        let start = Instant::now();
        for _ in 0..reps {
            for layer in 0..c.n_layers {
                for pages in &tables {
                    if split {
                        for (g, o) in out.chunks_mut(group_width).enumerate() {
                            let (kv, pos) = (g..g + 1, ctx - 1);
                            attend(&pool, layer, shape, kv, &q, pos, pages, o, &mut scratch);
                        }
                    } else {
                        let (kv, pos) = (0..c.n_kv_heads, ctx - 1);
                        attend(
                            &pool,
                            layer,
                            shape,
                            kv,
                            &q,
                            pos,
                            pages,
                            &mut out,
                            &mut scratch,
                        );
                    }
                }
            }
        }
        let per_step = start.elapsed().as_secs_f64() / reps as f64;
        best[split as usize] = best[split as usize].min(per_step);
    }
    for (name, per_step) in [("whole", best[0]), ("per head", best[1])] {
        println!(
            "attention ctx {ctx} x {seqs} seqs, {name:<8}: {:>8.1} us per step  {:>6.1} ns per position and KV head  {:>5.1} GB/s of KV",
            per_step * 1e6,
            per_step / units * 1e9,
            bytes / per_step / 1e9
        );
    }
}
