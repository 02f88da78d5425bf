//! The colocated scheduler: continuous batching with chunked prefill under a token budget.
//!
//! Sans-IO: no threads, no clocks, no sockets. [`Scheduler::plan`] decides what the next step
//! computes and reserves the pages for it; the caller runs the step; [`Scheduler::commit`]
//! takes the logits back, samples, and reports events. Each step:
//!
//! 1. every decoding sequence gets its next token (one page more when it crosses a page);
//! 2. sequences part-way through their prompt get their next chunk;
//! 3. waiting sequences are admitted in arrival order while the budget, the batch limit and
//!    the pages last; an admitted prompt first reuses the prefix cache's pages.
//!
//! When a decoding sequence needs a page and none is free (after evicting the prefix cache),
//! the most recently admitted sequence is preempted: its pages are freed and it goes back to
//! the front of the queue to recompute later (vLLM's recompute preemption).

use std::collections::{HashMap, VecDeque};

use duet_gpu::{PageAllocator, PageId, PoolError};

use crate::engine::SeqChunk;
use crate::prefix_cache::PrefixCache;
use crate::sampling::{FinishReason, Sampler, SamplerState, SamplingParams, TopLogprobs};
use crate::tokenizer::{StreamDecoder, Tokenizer};

mod commit;
mod handoff;
mod plan;

pub use plan::{Plan, PlanItem, StepShape};

/// Identifies a sequence.
pub type SeqId = u64;

/// Scheduler limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Tokens computed per step at most (decode tokens plus prefill chunks).
    pub max_batch_tokens: usize,
    /// Sequences running at once at most.
    pub max_running: usize,
    /// Longest sequence (prompt plus output).
    pub max_context: usize,
    /// Tokens per page (the pool's).
    pub page_size: usize,
    /// Tokens the whole KV pool holds: no sequence can outgrow it (one that would is refused
    /// at once rather than left waiting for pages that can never be free).
    pub pool_tokens: usize,
}

/// A request the scheduler cannot take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The prompt is empty.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// Prompt plus `max_tokens` do not fit the context.
    #[error(
        "the prompt has {prompt} tokens and max_tokens is {max_tokens}: more than the context of {context}"
    )]
    TooLong {
        /// Prompt tokens.
        prompt: usize,
        /// Requested output tokens.
        max_tokens: usize,
        /// The limit.
        context: usize,
    },
    /// The sequence could never fit the KV pool, even alone.
    #[error(
        "the sequence needs {needed} tokens of KV (prompt {prompt} plus output); the whole pool holds {pool} tokens"
    )]
    PoolTooSmall {
        /// Prompt tokens.
        prompt: usize,
        /// Tokens of KV the sequence needs at most.
        needed: usize,
        /// The pool's capacity in tokens.
        pool: usize,
    },
    /// The id is already in use.
    #[error("sequence {0} already exists")]
    Duplicate(SeqId),
}

/// A transferred sequence the scheduler cannot take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// As for a new request.
    #[error(transparent)]
    Submit(#[from] SubmitError),
    /// The pages do not cover the prompt.
    #[error("{pages} pages cannot hold a prompt of {tokens} tokens exactly")]
    PagesMismatch {
        /// Prompt tokens.
        tokens: usize,
        /// Pages given.
        pages: usize,
    },
    /// Page bookkeeping failed.
    #[error(transparent)]
    Pool(#[from] PoolError),
}

/// Something that happened to a sequence in a step.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqEvent {
    /// The sequence.
    pub seq: SeqId,
    /// The sampled token.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The likeliest tokens at this position (when the request asked for `top_logprobs`).
    pub top: TopLogprobs,
    /// Text that is now final (never splits a character or shows a stop string).
    pub text: String,
    /// Set when the sequence ended.
    pub finish: Option<FinishReason>,
    /// Prompt tokens served from the prefix cache (on the first token only).
    pub cached_tokens: usize,
    /// For a prefill-only sequence, which ends at its first token: the sampler's state after
    /// it, for decode to continue the stream.
    pub handoff: Option<SamplerState>,
}

/// A stream that continues where another worker left it (migration): the last `generated`
/// tokens of the prompt were already generated and streamed, and the client holds the first
/// `emitted` bytes of their text. The sequence counts them toward `max_tokens`/`min_tokens`,
/// matches stop strings across them, and never emits their text again.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Resume {
    /// Tokens at the end of the prompt that were generated before.
    pub generated: usize,
    /// Bytes of their text the client already has.
    pub emitted: usize,
}

#[derive(Debug)]
struct Seq {
    tokens: Vec<u32>,
    prompt_len: usize,
    computed: usize,
    pages: Vec<PageId>,
    sampler: Sampler,
    decoder: StreamDecoder,
    text: String,
    emitted: usize,
    generated: usize,
    cached_tokens: usize,
    admitted: u64,
    /// Ends after its first token (prefill of a disaggregated pair).
    prefill_only: bool,
}

impl Seq {
    fn decoding(&self) -> bool {
        self.computed + 1 == self.tokens.len() && self.generated > 0
    }

    /// Takes the end of the prompt as already generated: its text is rebuilt (so stop strings
    /// match across the seam) and what the client has is not sent again.
    fn resume(&mut self, resume: Resume, tok: &Tokenizer) {
        let from = self.tokens.len() - resume.generated;
        for &t in &self.tokens[from..] {
            self.text.push_str(&self.decoder.push(tok, t));
        }
        self.generated = resume.generated;
        self.emitted = commit::floor_char_boundary(&self.text, resume.emitted.min(self.text.len()));
    }
}

/// The scheduler's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Preemptions so far.
    pub preemptions: u64,
    /// Prompt tokens not computed thanks to the prefix cache.
    pub cached_tokens: u64,
}

/// The colocated scheduler.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    seqs: HashMap<SeqId, Seq>,
    waiting: VecDeque<SeqId>,
    running: Vec<SeqId>,
    admissions: u64,
    /// Counters.
    pub stats: SchedulerStats,
}

impl Scheduler {
    /// An idle scheduler.
    pub fn new(cfg: SchedulerConfig) -> Scheduler {
        Scheduler {
            cfg,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            admissions: 0,
            stats: SchedulerStats::default(),
        }
    }

    /// The limits.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Queues a request.
    pub fn submit(
        &mut self,
        id: SeqId,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<(), SubmitError> {
        self.submit_resumed(id, prompt, params, Resume::default(), None)
    }

    /// Queues a request whose last `resume.generated` prompt tokens were generated elsewhere
    /// (see [`Resume`]); `tok` rebuilds their text, and may be `None` only when nothing is
    /// resumed.
    pub fn submit_resumed(
        &mut self,
        id: SeqId,
        prompt: Vec<u32>,
        params: SamplingParams,
        resume: Resume,
        tok: Option<&Tokenizer>,
    ) -> Result<(), SubmitError> {
        self.queue(id, prompt, params, resume, tok, false)
    }

    /// Whether a sequence of `prompt_len` tokens (the last `resume.generated` of them
    /// generated before) could ever run here: it fits the context and, even alone, the KV
    /// pool. `prefill_only`: only its prompt is computed here.
    pub fn admissible(
        &self,
        prompt_len: usize,
        params: &SamplingParams,
        resume: Resume,
        prefill_only: bool,
    ) -> Result<(), SubmitError> {
        if prompt_len == 0 || resume.generated >= prompt_len {
            return Err(SubmitError::EmptyPrompt);
        }
        let output = params.max_tokens.saturating_sub(resume.generated);
        if prompt_len + output > self.cfg.max_context {
            return Err(SubmitError::TooLong {
                prompt: prompt_len,
                max_tokens: params.max_tokens,
                context: self.cfg.max_context,
            });
        }
        // Prefill holds the prompt only (its first token's KV is decode's to compute).
        let needed = if prefill_only {
            prompt_len
        } else {
            prompt_len + output
        };
        if needed > self.cfg.pool_tokens {
            return Err(SubmitError::PoolTooSmall {
                prompt: prompt_len,
                needed,
                pool: self.cfg.pool_tokens,
            });
        }
        Ok(())
    }

    fn queue(
        &mut self,
        id: SeqId,
        prompt: Vec<u32>,
        params: SamplingParams,
        resume: Resume,
        tok: Option<&Tokenizer>,
        prefill_only: bool,
    ) -> Result<(), SubmitError> {
        self.admissible(prompt.len(), &params, resume, prefill_only)?;
        if self.seqs.contains_key(&id) {
            return Err(SubmitError::Duplicate(id));
        }
        let mut sampler = Sampler::new(params);
        if sampler.params().temperature > 0.0 {
            // One draw per sampled token: the stream continues where it stood.
            let seed = sampler.state().seed;
            sampler = Sampler::resume(
                sampler.params().clone(),
                SamplerState {
                    seed,
                    draws: resume.generated as u64,
                },
            );
        }
        let mut seq = Seq {
            prompt_len: prompt.len(),
            tokens: prompt,
            computed: 0,
            pages: Vec::new(),
            sampler,
            decoder: StreamDecoder::default(),
            text: String::new(),
            emitted: 0,
            generated: 0,
            cached_tokens: 0,
            admitted: 0,
            prefill_only: false,
        };
        if let Some(tok) = tok {
            seq.resume(resume, tok);
        }
        self.seqs.insert(id, seq);
        self.waiting.push_back(id);
        Ok(())
    }

    /// Whether nothing is queued or running.
    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Sequences waiting and running.
    pub fn queue_lengths(&self) -> (usize, usize) {
        (self.waiting.len(), self.running.len())
    }

    /// Prompt tokens queued but not yet computed.
    pub fn queued_tokens(&self) -> usize {
        self.waiting
            .iter()
            .filter_map(|id| self.seqs.get(id))
            .map(|s| s.tokens.len() - s.computed)
            .sum()
    }

    /// Ends a sequence early (client gone); its pages are released.
    pub fn abort(&mut self, id: SeqId, alloc: &mut PageAllocator) -> Result<bool, PoolError> {
        let Some(seq) = self.seqs.remove(&id) else {
            return Ok(false);
        };
        self.waiting.retain(|s| *s != id);
        self.running.retain(|s| *s != id);
        alloc.release_all(&seq.pages)?;
        Ok(true)
    }

    /// Plans the next step and reserves its pages.
    pub fn plan(
        &mut self,
        alloc: &mut PageAllocator,
        cache: &mut PrefixCache,
    ) -> Result<Plan, PoolError> {
        let ps = self.cfg.page_size;
        let mut budget = self.cfg.max_batch_tokens;
        let mut items = Vec::new();

        // 1. Decode tokens, oldest admission first; preempt the newest when pages run out.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(seq) = self.seqs.get(&id) else {
                i += 1;
                continue;
            };
            if !seq.decoding() {
                i += 1;
                continue;
            }
            if seq.pages.len() * ps <= seq.computed {
                match self.take_pages(1, alloc, cache, Some(id))? {
                    Some(mut p) => {
                        if let Some(seq) = self.seqs.get_mut(&id) {
                            seq.pages.append(&mut p);
                        }
                    }
                    // Preempted itself: nothing else could give way.
                    None => continue,
                }
            }
            if let Some(seq) = self.seqs.get(&id) {
                items.push(PlanItem {
                    seq: id,
                    start: seq.computed,
                    len: 1,
                    sample: true,
                });
                budget -= 1;
            }
            i += 1;
        }

        // 2. Prompt chunks: running sequences first, then admissions in arrival order.
        let prefilling: Vec<SeqId> = self
            .running
            .iter()
            .copied()
            .filter(|id| self.seqs.get(id).is_some_and(|s| !s.decoding()))
            .filter(|id| !items.iter().any(|it| it.seq == *id))
            .collect();
        for id in prefilling {
            if budget == 0 {
                break;
            }
            if let Some(item) = self.chunk(id, budget, alloc, cache)? {
                budget -= item.len;
                items.push(item);
            }
        }
        while budget > 0 && self.running.len() < self.cfg.max_running {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            self.admit(id, alloc, cache)?;
            match self.chunk(id, budget, alloc, cache)? {
                Some(item) => {
                    self.waiting.pop_front();
                    self.running.push(id);
                    budget -= item.len;
                    items.push(item);
                }
                None => {
                    // No page for even one token: give back what admission took, wait.
                    if let Some(seq) = self.seqs.get_mut(&id) {
                        alloc.release_all(&seq.pages)?;
                        seq.pages.clear();
                        seq.computed = 0;
                        seq.cached_tokens = 0;
                    }
                    break;
                }
            }
        }
        Ok(Plan { items })
    }

    /// Reuses cached prompt pages for a sequence being admitted.
    fn admit(
        &mut self,
        id: SeqId,
        alloc: &mut PageAllocator,
        cache: &mut PrefixCache,
    ) -> Result<(), PoolError> {
        let ps = self.cfg.page_size;
        self.admissions += 1;
        let order = self.admissions;
        let Some(seq) = self.seqs.get_mut(&id) else {
            return Ok(());
        };
        seq.admitted = order;
        if seq.computed == 0 && seq.pages.is_empty() {
            // At least the last token must be computed: its logits give the first output.
            let max_pages = (seq.tokens.len() - 1) / ps;
            let pages = cache.acquire(&seq.tokens, max_pages, alloc)?;
            seq.computed = pages.len() * ps;
            seq.cached_tokens = seq.computed;
            self.stats.cached_tokens += seq.computed as u64;
            seq.pages = pages;
        }
        Ok(())
    }

    /// The next prompt chunk of `id`, at most `budget` tokens, with its pages reserved.
    fn chunk(
        &mut self,
        id: SeqId,
        budget: usize,
        alloc: &mut PageAllocator,
        cache: &mut PrefixCache,
    ) -> Result<Option<PlanItem>, PoolError> {
        let ps = self.cfg.page_size;
        let Some(seq) = self.seqs.get(&id) else {
            return Ok(None);
        };
        let remaining = seq.tokens.len() - seq.computed;
        let mut len = remaining.min(budget);
        let have = seq.pages.len();
        let need = (seq.computed + len).div_ceil(ps).saturating_sub(have);
        if need > 0 {
            let free = alloc.free_pages();
            if free < need {
                cache.evict(need - free, alloc);
            }
            let free = alloc.free_pages();
            if free < need {
                // Take what fits: whole pages beyond those already held.
                len = ((have + free) * ps).saturating_sub(seq.computed).min(len);
            }
            if len == 0 {
                return Ok(None);
            }
            let need = (seq.computed + len).div_ceil(ps).saturating_sub(have);
            let mut pages = alloc.alloc(need)?;
            if let Some(seq) = self.seqs.get_mut(&id) {
                seq.pages.append(&mut pages);
            }
        }
        let Some(seq) = self.seqs.get(&id) else {
            return Ok(None);
        };
        Ok(Some(PlanItem {
            seq: id,
            start: seq.computed,
            len,
            sample: seq.computed + len == seq.tokens.len(),
        }))
    }

    /// `n` pages for `for_seq`, evicting the cache and then preempting newer sequences.
    /// `None` if `for_seq` itself had to be preempted.
    fn take_pages(
        &mut self,
        n: usize,
        alloc: &mut PageAllocator,
        cache: &mut PrefixCache,
        for_seq: Option<SeqId>,
    ) -> Result<Option<Vec<PageId>>, PoolError> {
        loop {
            if alloc.free_pages() < n {
                cache.evict(n - alloc.free_pages(), alloc);
            }
            if alloc.free_pages() >= n {
                return alloc.alloc(n).map(Some);
            }
            let victim = self
                .running
                .iter()
                .copied()
                .max_by_key(|id| self.seqs.get(id).map_or(0, |s| s.admitted));
            let Some(victim) = victim else {
                return Err(PoolError::OutOfPages {
                    wanted: n,
                    free: alloc.free_pages(),
                });
            };
            self.preempt(victim, alloc)?;
            if Some(victim) == for_seq {
                return Ok(None);
            }
        }
    }

    fn preempt(&mut self, id: SeqId, alloc: &mut PageAllocator) -> Result<(), PoolError> {
        self.running.retain(|s| *s != id);
        if let Some(seq) = self.seqs.get_mut(&id) {
            alloc.release_all(&seq.pages)?;
            seq.pages.clear();
            seq.computed = 0;
            self.stats.preemptions += 1;
            tracing::debug!(
                seq = id,
                tokens = seq.tokens.len(),
                "preempted; will recompute"
            );
        }
        self.waiting.push_front(id);
        Ok(())
    }

    /// The engine's view of a plan: token slices and page tables.
    pub fn chunks<'a>(&'a self, plan: &'a Plan) -> Vec<SeqChunk<'a>> {
        plan.items
            .iter()
            .filter_map(|it| {
                let seq = self.seqs.get(&it.seq)?;
                Some(SeqChunk {
                    tokens: &seq.tokens[it.start..it.start + it.len],
                    start_pos: it.start,
                    pages: &seq.pages,
                    want_logits: it.sample,
                })
            })
            .collect()
    }

    /// The page table of a sequence.
    pub fn pages(&self, id: SeqId) -> Option<&[PageId]> {
        self.seqs.get(&id).map(|s| s.pages.as_slice())
    }

    fn finish(&mut self, id: SeqId, alloc: &mut PageAllocator) -> Result<(), PoolError> {
        self.running.retain(|s| *s != id);
        if let Some(seq) = self.seqs.remove(&id) {
            alloc.release_all(&seq.pages)?;
        }
        Ok(())
    }
}
