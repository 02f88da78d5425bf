//! `duet sim --calibrate`: this machine's engine step times (prefill chunks and decode steps
//! at several sizes, alone and beside a second engine) and copy bandwidth with the real
//! model, fitted into the cost profile the planner reads; then one real request's cost.

use std::process::ExitCode;
use std::time::Instant;

use duet_engine::{Engine, EngineOptions, Model, Runner, SamplingParams};
use duet_sim::CostModel;

use super::SimArgs;

/// One timed engine step: (tokens computed in it, context before them, sequences, µs).
type Sample = (f64, f64, f64, f64);

/// Measures the engine (prefill chunks and decode steps at several sizes) and a memory
/// copy, fits the cost model's coefficients, and writes the profile.
pub(super) fn calibrate(args: &SimArgs) -> Result<CostModel, String> {
    let path = crate::generate::resolve_model(args.model.as_deref())?;
    let threads = args.threads.max(1);
    let open = |max_batch_tokens: usize| -> Result<Runner, String> {
        let model = Model::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let options = EngineOptions {
            kv_pages: 1024,
            threads,
            ..EngineOptions::default()
        };
        let engine = Engine::new(model, options).map_err(|e| e.to_string())?;
        Ok(Runner::new(engine, max_batch_tokens, 64))
    };
    let prompt = |len: usize, salt: usize| -> Vec<u32> {
        (0..len)
            .map(|i| 100 + ((i * 7919 + salt * 104_729) % 20_000) as u32)
            .collect()
    };
    let params = |max_tokens: usize| SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let kv_bytes_per_token = {
        let r = open(16)?;
        Engine::layout_for(&r.engine.model, r.engine.options()).token_bytes() as u64
    };
    // Prefill: one sequence, chunks of n tokens after ctx computed ones.
    let mut prefill: Vec<Sample> = Vec::new();
    for (len, chunk) in [
        (32, 32),
        (64, 64),
        (128, 128),
        (256, 256),
        (512, 128),
        (768, 256),
    ] {
        for rep in 0..2 {
            let mut r = open(chunk)?;
            r.submit(0, prompt(len, rep), params(1))
                .map_err(|e| e.to_string())?;
            let mut ctx = 0;
            while ctx < len {
                let n = chunk.min(len - ctx);
                let t = Instant::now();
                r.step().map_err(|e| e.to_string())?;
                prefill.push((n as f64, ctx as f64, 1.0, t.elapsed().as_secs_f64() * 1e6));
                ctx += n;
            }
        }
    }
    // Decode: batches of B sequences at a context of about ctx tokens.
    let mut decode: Vec<Sample> = Vec::new();
    for (batch, ctx) in [
        (1, 128),
        (2, 128),
        (4, 128),
        (8, 128),
        (16, 128),
        (32, 128),
        (1, 1024),
        (8, 512),
    ] {
        let mut r = open(4096)?;
        for s in 0..batch {
            r.submit(s as u64, prompt(ctx, s), params(24))
                .map_err(|e| e.to_string())?;
        }
        // The prompts (one step), then the first decode steps are warm-up.
        for _ in 0..3 {
            r.step().map_err(|e| e.to_string())?;
        }
        let mut times = Vec::new();
        for _ in 0..16 {
            let t = Instant::now();
            r.step().map_err(|e| e.to_string())?;
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        decode.push((
            batch as f64,
            (batch * (ctx + 10)) as f64,
            batch as f64,
            median,
        ));
    }
    let (shared_prefill, shared_decode) = contention(&open, &prompt)?;
    let gbps = copy_gbps();
    let [p_base, p_tok, p_attn] = fit(&prefill, |&(n, ctx, _, _)| [1.0, n, n * (ctx + n / 2.0)]);
    let [d_base, d_seq, d_fit_ctx] = fit(&decode, |&(b, ctx, _, _)| [1.0, b, ctx]);
    // The cost of context alone: the same batch at a short and a long context.
    let pairs: Vec<f64> = decode
        .iter()
        .filter(|long| long.1 / long.0 >= 200.0)
        .filter_map(|long| {
            let short = decode.iter().find(|s| s.0 == long.0 && s.1 / s.0 < 200.0)?;
            Some((long.3 - short.3) / (long.1 - short.1))
        })
        .collect();
    let d_ctx = if pairs.is_empty() {
        d_fit_ctx
    } else {
        pairs.iter().sum::<f64>() / pairs.len() as f64
    };
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let cost = CostModel {
        source: format!(
            "duet sim --calibrate on {} ({} cores, {threads} thread(s) per worker), {}",
            host.trim(),
            std::thread::available_parallelism().map_or(1, |n| n.get()),
            path.file_name()
                .map_or_else(String::new, |f| f.to_string_lossy().into_owned())
        ),
        prefill_base_us: p_base.max(0.0),
        prefill_token_us: p_tok.max(0.0),
        prefill_attn_us: p_attn.max(0.0),
        decode_base_us: d_base.max(0.0),
        decode_seq_us: d_seq.max(0.0),
        decode_ctx_us: d_ctx.max(0.0),
        decode_table: decode
            .iter()
            .filter(|d| d.1 / d.0 < 200.0)
            .map(|&(b, ctx, _, us)| [b, ctx / b, us])
            .collect(),
        shared_prefill_slowdown: shared_prefill.max(1.0),
        shared_decode_slowdown: shared_decode.max(1.0),
        kv_bytes_per_token,
        link_gbps: gbps,
        ..CostModel::default()
    };
    println!("prefill chunks (tokens, context, measured ms, model ms):");
    for &(n, ctx, _, us) in &prefill {
        let m = cost.prefill_chunk_us(n as usize, ctx as usize) as f64;
        println!("  {n:>5} {ctx:>6} {:>9.1} {:>9.1}", us / 1e3, m / 1e3);
    }
    println!("decode steps (batch, context in all, measured ms, model ms):");
    for &(b, ctx, _, us) in &decode {
        let m = cost.decode_step_us(b as usize, ctx as usize) as f64;
        println!("  {b:>5} {ctx:>6} {:>9.1} {:>9.1}", us / 1e3, m / 1e3);
    }
    println!(
        "on one machine at once: prefill chunks x{shared_prefill:.2}, decode steps \
         x{shared_decode:.2} (each measured beside the other)"
    );
    println!("memory copy: {gbps:.1} GB/s; KV {kv_bytes_per_token} bytes per token");
    Ok(cost)
}

/// How much a prefill chunk (128 tokens) and a decode step (batch 4) slow each other down
/// when they run at once on this machine, as a prefill and a decode worker of `duet up` do:
/// (prefill with decode running / alone, decode with prefill running / alone).
fn contention(
    open: &(dyn Fn(usize) -> Result<Runner, String> + Sync),
    prompt: &(dyn Fn(usize, usize) -> Vec<u32> + Sync),
) -> Result<(f64, f64), String> {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let median = |mut v: Vec<f64>| -> f64 {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let prefill_once = |salt: usize| -> Result<f64, String> {
        let mut r = open(128)?;
        let params = SamplingParams {
            max_tokens: 1,
            ignore_eos: true,
            ..SamplingParams::default()
        };
        r.submit(0, prompt(128, salt), params)
            .map_err(|e| e.to_string())?;
        let t = Instant::now();
        r.step().map_err(|e| e.to_string())?;
        Ok(t.elapsed().as_secs_f64())
    };
    let alone_p = median((0..5).map(prefill_once).collect::<Result<_, _>>()?);
    let (stop, beside, warm) = (
        AtomicBool::new(false),
        AtomicBool::new(false),
        AtomicUsize::new(0),
    );
    let mut decoder = open(4096)?;
    let params = SamplingParams {
        max_tokens: 2_000,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    for s in 0..4 {
        decoder
            .submit(s, prompt(128, s as usize + 50), params.clone())
            .map_err(|e| e.to_string())?;
    }
    let (shared_p, alone_d, shared_d) = std::thread::scope(|scope| {
        let decoding = scope.spawn(|| {
            let (mut alone, mut shared) = (Vec::new(), Vec::new());
            while !stop.load(Ordering::Relaxed) {
                let during = beside.load(Ordering::Relaxed);
                let t = Instant::now();
                if decoder.step().is_err() {
                    break;
                }
                let dt = t.elapsed().as_secs_f64();
                // The first steps prefill the prompts and warm up.
                if warm.fetch_add(1, Ordering::Relaxed) >= 4 {
                    if during && beside.load(Ordering::Relaxed) {
                        shared.push(dt);
                    } else if !during {
                        alone.push(dt);
                    }
                }
            }
            (alone, shared)
        });
        while warm.load(Ordering::Relaxed) < 24 {
            std::thread::yield_now();
        }
        beside.store(true, Ordering::Relaxed);
        let shared_p: Result<Vec<f64>, String> = (5..10).map(prefill_once).collect();
        beside.store(false, Ordering::Relaxed);
        let seen = warm.load(Ordering::Relaxed);
        while warm.load(Ordering::Relaxed) < seen + 20 {
            std::thread::yield_now();
        }
        stop.store(true, Ordering::Relaxed);
        let (alone, shared) = decoding.join().unwrap_or_default();
        (shared_p, alone, shared)
    });
    let shared_p = median(shared_p?);
    let (alone_d, shared_d) = (median(alone_d), median(shared_d));
    if alone_p <= 0.0 || alone_d <= 0.0 || shared_d <= 0.0 {
        return Ok((1.0, 1.0));
    }
    Ok((shared_p / alone_p, shared_d / alone_d))
}

/// With `--url`: a request's fixed cost beyond the engine, from the median time to first
/// token of sequential 128-token prompts on the live cluster; then writes the profile.
pub(super) async fn measure_request_cost(
    args: &SimArgs,
    mut cost: CostModel,
) -> Result<ExitCode, String> {
    if let Some(url) = &args.url {
        let addr = crate::bench::parse_url(url)?;
        let epoch = Instant::now();
        let mut ttfts = Vec::new();
        for i in 0..12u32 {
            let ask = crate::bench::client::Ask {
                prompt: (0..128).map(|t| 20 + (t * 31 + i * 7) % 230).collect(),
                max_tokens: 2,
                sampling: Default::default(),
                class: "calibrate",
                until: None,
            };
            let rec = crate::bench::client::stream_completion(addr, &ask, epoch).await;
            if let Some(e) = rec.error {
                return Err(format!("--url {url}: {e}"));
            }
            // The first two warm the path up.
            if i >= 2
                && let Some(t) = rec.ttft_s
            {
                ttfts.push(t * 1e6);
            }
        }
        ttfts.sort_by(f64::total_cmp);
        let median = ttfts.get(ttfts.len() / 2).copied().unwrap_or(0.0);
        let engine = cost.prefill_chunk_us(128, 0) as f64;
        cost.prefill_request_us = (median - engine).max(0.0);
        println!(
            "request path: time to first token {:.1} ms alone, engine prefill {:.1} ms: {:.1} ms \
             per request beyond the engine",
            median / 1e3,
            engine / 1e3,
            cost.prefill_request_us / 1e3
        );
    }
    let text = serde_json::to_string_pretty(&cost).map_err(|e| e.to_string())?;
    std::fs::write(&args.out, text + "\n")
        .map_err(|e| format!("cannot write {}: {e}", args.out.display()))?;
    println!("wrote {}", args.out.display());
    Ok(ExitCode::SUCCESS)
}

/// Copy bandwidth of this machine (64 MiB, best of five): what the shm backend reaches.
fn copy_gbps() -> f64 {
    let src = vec![7u8; 64 << 20];
    let mut dst = vec![0u8; 64 << 20];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (64 << 20) as f64 / best / 1e9
}

/// Least squares for y = c · features(x), three coefficients (normal equations).
fn fit<F: Fn(&Sample) -> [f64; 3]>(samples: &[Sample], features: F) -> [f64; 3] {
    let mut a = [[0.0f64; 3]; 3];
    let mut b = [0.0f64; 3];
    for s in samples {
        let f = features(s);
        for i in 0..3 {
            for j in 0..3 {
                a[i][j] += f[i] * f[j];
            }
            b[i] += f[i] * s.3;
        }
    }
    solve3(a, b).unwrap_or([0.0; 3])
}

/// Gaussian elimination with partial pivoting; None when singular.
fn solve3(mut a: [[f64; 3]; 3], mut b: [f64; 3]) -> Option<[f64; 3]> {
    for col in 0..3 {
        let pivot = (col..3).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        for row in col + 1..3 {
            let k = a[row][col] / a[col][col];
            let pivot_row = a[col];
            for (x, p) in a[row].iter_mut().zip(pivot_row).skip(col) {
                *x -= k * p;
            }
            b[row] -= k * b[col];
        }
    }
    let mut x = [0.0; 3];
    for row in (0..3).rev() {
        let s: f64 = (row + 1..3).map(|c| a[row][c] * x[c]).sum();
        x[row] = (b[row] - s) / a[row][row];
    }
    Some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_recovers_known_coefficients() {
        let samples: Vec<Sample> = [(1.0, 10.0), (2.0, 50.0), (4.0, 30.0), (8.0, 200.0)]
            .iter()
            .map(|&(b, c)| (b, c, b, 100.0 + 7.0 * b + 0.5 * c))
            .collect();
        let [x, y, z] = fit(&samples, |&(b, c, _, _)| [1.0, b, c]);
        assert!((x - 100.0).abs() < 1e-6 && (y - 7.0).abs() < 1e-6 && (z - 0.5).abs() < 1e-6);
    }
}
