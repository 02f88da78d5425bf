//! The step API: one forward pass over prefill chunks and decode tokens of many sequences.
//!
//! A step takes [`SeqChunk`]s: a sequence's new tokens, the position of the first one, and
//! the sequence's page table. A decode token is a chunk of one token; a prefill chunk is a run
//! of prompt tokens. All tokens of the step go through each matrix product together (the
//! weights are read once per step), each token's K and V land in its own page slot, and each
//! token attends to its own sequence through the page table. The step returns the logits of
//! the last token of every chunk that asks for them.

use duet_gpu::{KvDtype, KvLayout, KvPool, PageId, PoolError};

use crate::kernels::attention::{AttnScratch, AttnShape, attend};
use crate::kernels::ops::{Rope, add_assign, rms_norm, silu_mul};
use crate::kernels::{Lines, QRef, matmul, matmul_group, token_split};
use crate::model::Model;
use crate::step_pool::StepPool;

/// How an engine is set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineOptions {
    /// KV element type.
    pub kv_dtype: KvDtype,
    /// Tokens per KV page.
    pub page_size: usize,
    /// Pages in the pool (allocated once, at start).
    pub kv_pages: usize,
    /// Compute threads.
    pub threads: usize,
    /// Longest sequence served (at most the model's context length).
    pub max_context: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            kv_dtype: KvDtype::F16,
            page_size: 16,
            kv_pages: 1024,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            max_context: 8192,
        }
    }
}

/// New tokens of one sequence for one step.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    /// The tokens to compute.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]` (tokens before it are already in the pages).
    pub start_pos: usize,
    /// The sequence's page table; must cover `start_pos + tokens.len()` positions.
    pub pages: &'a [PageId],
    /// Whether to return the logits of the last token.
    pub want_logits: bool,
}

/// A step that cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// The KV pool refused.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// A token id outside the vocabulary.
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        /// The id.
        token: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// The page table does not cover the chunk.
    #[error("the page table has {have} pages but positions up to {last} need {need}")]
    PagesTooFew {
        /// Pages given.
        have: usize,
        /// Pages needed.
        need: usize,
        /// Last position.
        last: usize,
    },
    /// A page id outside the pool.
    #[error("page {0} is outside the pool")]
    PageOutOfRange(PageId),
    /// A position beyond the context.
    #[error("position {pos} is beyond the context of {max} tokens")]
    ContextExceeded {
        /// The position.
        pos: usize,
        /// The maximum.
        max: usize,
    },
    /// The thread pool could not start.
    #[error("cannot start {0} compute threads")]
    Threads(usize),
}

/// Counters, for tests and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Steps run.
    pub steps: u64,
    /// Tokens computed (prefill and decode).
    pub tokens: u64,
}

/// A model, its KV pool and its threads.
pub struct Engine {
    /// The model.
    pub model: Model,
    /// The paged KV pool.
    pub pool: KvPool,
    rope: Rope,
    options: EngineOptions,
    team: StepPool,
    /// Counters.
    pub stats: EngineStats,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("model", &self.model)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// The pool layout `model` needs under `options`.
    pub fn layout_for(model: &Model, options: &EngineOptions) -> KvLayout {
        let c = model.config;
        KvLayout {
            n_layers: c.n_layers,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            page_size: options.page_size,
            dtype: options.kv_dtype,
        }
    }

    /// An engine for `model` with a freshly allocated pool.
    pub fn new(model: Model, options: EngineOptions) -> Result<Engine, EngineError> {
        let pool = KvPool::new(Self::layout_for(&model, &options), options.kv_pages)?;
        Self::with_pool(model, options, pool)
    }

    /// An engine over a pool made elsewhere (in shared memory, say); its layout must be the
    /// one [`Engine::layout_for`] gives.
    pub fn with_pool(
        model: Model,
        options: EngineOptions,
        pool: KvPool,
    ) -> Result<Engine, EngineError> {
        let want = Self::layout_for(&model, &options);
        if *pool.layout() != want {
            return Err(EngineError::Pool(PoolError::BadMemory(format!(
                "the pool's layout {:?} is not the model's {want:?}",
                pool.layout()
            ))));
        }
        let c = model.config;
        let max_context = options.max_context.min(c.context_length);
        let team =
            StepPool::new(options.threads).map_err(|_| EngineError::Threads(options.threads))?;
        Ok(Engine {
            rope: Rope::new(c.head_dim, c.rope_base, max_context),
            options: EngineOptions {
                max_context,
                ..options
            },
            model,
            pool,
            team,
            stats: EngineStats::default(),
        })
    }

    /// The options in force.
    pub fn options(&self) -> &EngineOptions {
        &self.options
    }

    /// Runs one step; returns, per chunk, the last token's logits if asked for.
    pub fn step(&mut self, chunks: &[SeqChunk<'_>]) -> Result<Vec<Option<Vec<f32>>>, EngineError> {
        self.step_observed(chunks, &mut |_| {})
    }

    /// [`Engine::step`], calling `kv_done(layer)` as soon as every token of the step has its
    /// K and V of `layer` in the pool (before the layer's attention runs). Prefill uses it to
    /// start copying the last chunk's KV layer by layer while the later layers compute.
    pub fn step_observed(
        &mut self,
        chunks: &[SeqChunk<'_>],
        kv_done: &mut (dyn FnMut(usize) + Send),
    ) -> Result<Vec<Option<Vec<f32>>>, EngineError> {
        self.validate(chunks)?;
        let out = forward(
            &self.model,
            &mut self.pool,
            &self.rope,
            chunks,
            &self.team,
            kv_done,
        );
        self.stats.steps += 1;
        self.stats.tokens += chunks.iter().map(|c| c.tokens.len() as u64).sum::<u64>();
        Ok(out)
    }

    fn validate(&self, chunks: &[SeqChunk<'_>]) -> Result<(), EngineError> {
        let vocab = self.model.config.vocab;
        let ps = self.options.page_size;
        let capacity = self.pool.capacity();
        for c in chunks {
            if let Some(&token) = c.tokens.iter().find(|t| **t as usize >= vocab) {
                return Err(EngineError::TokenOutOfRange { token, vocab });
            }
            if c.tokens.is_empty() {
                continue;
            }
            let last = c.start_pos + c.tokens.len() - 1;
            if last >= self.options.max_context {
                return Err(EngineError::ContextExceeded {
                    pos: last,
                    max: self.options.max_context,
                });
            }
            let need = last / ps + 1;
            if c.pages.len() < need {
                return Err(EngineError::PagesTooFew {
                    have: c.pages.len(),
                    need,
                    last,
                });
            }
            if let Some(&p) = c.pages[..need].iter().find(|p| **p as usize >= capacity) {
                return Err(EngineError::PageOutOfRange(p));
            }
        }
        Ok(())
    }
}

/// Where each token of the step belongs.
struct TokenRef {
    chunk: usize,
    pos: usize,
}

/// Tokens from which the row-wise operations (norms, SiLU, residual adds, rotary embedding)
/// are split between the threads where the products split by row. Below, they take a few
/// microseconds on the caller; at batch 32 on two threads they had been ~4 % of the caller's
/// samples, the other thread spinning meanwhile. Batch-32 decode on 2 threads of a Zen 4
/// guest, 10 pairs alternating (the first 5 without the rotary embedding's split): 524-627 ->
/// 531-633 tok/s, medians 593 -> 621 (7 pairs of 10 faster).
const ROW_OPS_SPLIT_FROM: usize = 16;

/// The tokens of each thread's range for the row-wise operations of a step of `tokens`, or
/// `None` to run them on the caller: the step's own split by token ([`token_split`]), or from
/// [`ROW_OPS_SPLIT_FROM`] tokens an even one (the products, split by row there, do not care).
fn row_split(tokens: usize, team: &StepPool) -> Option<usize> {
    token_split(tokens, team).or_else(|| {
        (team.threads() > 1 && tokens >= ROW_OPS_SPLIT_FROM)
            .then(|| tokens.div_ceil(team.threads()))
    })
}

/// `f(input rows, output rows)` over `tokens` rows of `width`: on each thread for its own
/// range of tokens where [`row_split`] splits the step (in a 512-token prefill these were a
/// tenth of the step, serial while the other threads spun); otherwise on the caller. The
/// operations are row-wise, so the split changes no bit.
fn by_rows(
    team: &StepPool,
    tokens: usize,
    width: usize,
    input: &[f32],
    output: &mut [f32],
    f: impl Fn(&[f32], &mut [f32]) + Sync,
) {
    match row_split(tokens, team) {
        Some(per) => team.for_each_thread(
            input
                .chunks(per * width)
                .zip(output.chunks_mut(per * width))
                .collect(),
            |(i, o)| f(i, o),
        ),
        None => f(input, output),
    }
}

fn forward(
    model: &Model,
    pool: &mut KvPool,
    rope: &Rope,
    chunks: &[SeqChunk<'_>],
    team: &StepPool,
    kv_done: &mut (dyn FnMut(usize) + Send),
) -> Vec<Option<Vec<f32>>> {
    let c = model.config;
    let kv_dim = c.n_kv_heads * c.head_dim;
    let ps = pool.layout().page_size;
    let toks: Vec<TokenRef> = chunks
        .iter()
        .enumerate()
        .flat_map(|(i, ch)| {
            (0..ch.tokens.len()).map(move |j| TokenRef {
                chunk: i,
                pos: ch.start_pos + j,
            })
        })
        .collect();
    let ids: Vec<u32> = chunks
        .iter()
        .flat_map(|ch| ch.tokens.iter().copied())
        .collect();
    let t = ids.len();
    let mut results = vec![None; chunks.len()];
    if t == 0 {
        return results;
    }

    let embed = model.w(&model.embed);
    let mut x = vec![0f32; t * c.dim];
    for (row, id) in x.chunks_exact_mut(c.dim).zip(&ids) {
        embed.dequantize_row(*id as usize, row);
    }
    // The products' inputs (`h`, `attn`, `gate`) start on cache lines (`Lines`), so the
    // products read them in place.
    let mut h = Lines::zeros(t * c.dim);
    let mut q = vec![0f32; t * c.dim];
    let mut k = vec![0f32; t * kv_dim];
    let mut v = vec![0f32; t * kv_dim];
    let mut attn = Lines::zeros(t * c.dim);
    let mut o = vec![0f32; t * c.dim];
    let mut gate = Lines::zeros(t * c.ffn_dim);
    let mut up = vec![0f32; t * c.ffn_dim];
    let shape = AttnShape {
        n_heads: c.n_heads,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
    };
    let mm = |w: QRef<'_>, input: &[f32], out: &mut [f32]| matmul(w, input, t, out, team);

    for (li, layer) in model.layers.iter().enumerate() {
        by_rows(team, t, c.dim, &x, &mut h, |x, h| {
            rms_norm(x, &layer.attn_norm, c.rms_eps, h)
        });
        matmul_group(
            &[model.w(&layer.wq), model.w(&layer.wk), model.w(&layer.wv)],
            &h,
            t,
            &mut [&mut q, &mut k, &mut v],
            team,
        );
        // Rotary embedding on each thread's own tokens ([`row_split`]), then the K and V rows
        // into the pool.
        let rotate = |(q, k, toks): (&mut [f32], &mut [f32], &[TokenRef])| {
            for ((q, k), tr) in q
                .chunks_exact_mut(c.dim)
                .zip(k.chunks_exact_mut(kv_dim))
                .zip(toks)
            {
                rope.apply(q, c.head_dim, tr.pos);
                rope.apply(k, c.head_dim, tr.pos);
            }
        };
        match row_split(t, team) {
            Some(per) => team.for_each_thread(
                q.chunks_mut(per * c.dim)
                    .zip(k.chunks_mut(per * kv_dim))
                    .zip(toks.chunks(per))
                    .map(|((q, k), toks)| (q, k, toks))
                    .collect(),
                rotate,
            ),
            None => rotate((&mut q, &mut k, &toks)),
        }
        for (i, tr) in toks.iter().enumerate() {
            let page = chunks[tr.chunk].pages[tr.pos / ps];
            pool.write_token(
                page,
                li,
                tr.pos % ps,
                &k[i * kv_dim..(i + 1) * kv_dim],
                &v[i * kv_dim..(i + 1) * kv_dim],
            );
        }
        kv_done(li);
        // One work item per token and all its KV heads, where there are tokens enough to keep
        // every thread busy (or one thread); per (token, KV head) where there are not, so a
        // single decode token still spreads its heads over the threads. The bits do not depend
        // on the split.
        //
        // Whole tokens because a page's K and V rows hold every KV head side by side: an
        // item per head swept the sequence's pages once per head, each sweep using a third of
        // every line it brought in, and only the first prefetching (the others found the
        // same page table and layer, so expected them in cache, where a 500 KB sweep at a
        // 660-token context no longer fits a 512 KB L2).
        let pool_ref: &KvPool = pool;
        let heads_per_item = if team.threads() == 1 || t >= 2 * team.threads() {
            c.n_kv_heads
        } else {
            1
        };
        let items_per_token = c.n_kv_heads / heads_per_item;
        let item_width = heads_per_item * (c.n_heads / c.n_kv_heads) * c.head_dim;
        let attend_one = |scratch: &mut AttnScratch, (i, out): (usize, &mut [f32])| {
            let (tok, g) = (i / items_per_token, i % items_per_token * heads_per_item);
            let tr = &toks[tok];
            let qt = &q[tok * c.dim..(tok + 1) * c.dim];
            attend(
                pool_ref,
                li,
                shape,
                g..g + heads_per_item,
                qt,
                tr.pos,
                chunks[tr.chunk].pages,
                out,
                scratch,
            );
        };
        // Claimed one by one, latest position first: a token's attention costs in proportion
        // to its position, so the contiguous token ranges the other regions of a long chunk
        // use (`token_split`) gave the second thread three times the first's attention, and
        // the first waited (2-thread prefill of 512 tokens, `--prefill-only`: 552-555 tok/s
        // before, 582-601 after, on an AVX2 EPYC).
        // Longest first leaves the short items to even out the end.
        let items: Vec<(usize, &mut [f32])> =
            attn.chunks_mut(item_width).enumerate().rev().collect();
        team.for_each_init(items, AttnScratch::default, attend_one);
        mm(model.w(&layer.wo), &attn, &mut o);
        by_rows(team, t, c.dim, &o, &mut x, |o, x| add_assign(x, o));

        by_rows(team, t, c.dim, &x, &mut h, |x, h| {
            rms_norm(x, &layer.ffn_norm, c.rms_eps, h)
        });
        matmul_group(
            &[model.w(&layer.w_gate), model.w(&layer.w_up)],
            &h,
            t,
            &mut [&mut gate, &mut up],
            team,
        );
        by_rows(team, t, c.ffn_dim, &up, &mut gate, |up, gate| {
            silu_mul(gate, up)
        });
        mm(model.w(&layer.w_down), &gate, &mut o);
        by_rows(team, t, c.dim, &o, &mut x, |o, x| add_assign(x, o));
    }

    // Logits only where asked: the last token of each such chunk.
    let mut last_rows = Vec::new();
    let mut owners = Vec::new();
    let mut offset = 0;
    for (i, ch) in chunks.iter().enumerate() {
        offset += ch.tokens.len();
        if ch.want_logits && !ch.tokens.is_empty() {
            last_rows.extend_from_slice(&x[(offset - 1) * c.dim..offset * c.dim]);
            owners.push(i);
        }
    }
    if owners.is_empty() {
        return results;
    }
    let mut normed = Lines::zeros(last_rows.len());
    rms_norm(&last_rows, &model.output_norm, c.rms_eps, &mut normed);
    let head = model.lm_head();
    let mut logits = vec![0f32; owners.len() * head.rows];
    matmul(head, &normed, owners.len(), &mut logits, team);
    for (j, owner) in owners.into_iter().enumerate() {
        results[owner] = Some(logits[j * head.rows..(j + 1) * head.rows].to_vec());
    }
    results
}
