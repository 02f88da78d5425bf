//! An engine driven by the colocated scheduler: what a colocated worker and `duet generate`
//! run. One call to [`Runner::step`] plans, computes and samples one step.

use duet_gpu::PoolError;

use crate::engine::{Engine, EngineError};
use crate::prefix_cache::PrefixCache;
use crate::sampling::SamplingParams;
use crate::scheduler::{
    Resume, Scheduler, SchedulerConfig, SeqEvent, SeqId, StepShape, SubmitError,
};

/// Engine, scheduler and prefix cache together.
#[derive(Debug)]
pub struct Runner {
    /// The engine (model, pool, threads).
    pub engine: Engine,
    /// The scheduler.
    pub scheduler: Scheduler,
    /// The prefix cache over the engine's pool.
    pub cache: PrefixCache,
    /// What the last [`Runner::step`] computed (all zero when it had nothing to do).
    pub last_step: StepShape,
}

/// A step that failed.
#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    /// The engine refused the step.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Page bookkeeping failed (a bug: reported, not hidden).
    #[error(transparent)]
    Pool(#[from] PoolError),
}

impl Runner {
    /// A runner whose scheduler computes at most `max_batch_tokens` tokens per step.
    pub fn new(engine: Engine, max_batch_tokens: usize, max_running: usize) -> Runner {
        let o = *engine.options();
        Runner {
            scheduler: Scheduler::new(SchedulerConfig {
                max_batch_tokens,
                max_running,
                max_context: o.max_context,
                page_size: o.page_size,
                pool_tokens: engine.pool.capacity() * o.page_size,
            }),
            cache: PrefixCache::new(o.page_size),
            engine,
            last_step: StepShape::default(),
        }
    }

    /// Queues a request.
    pub fn submit(
        &mut self,
        id: SeqId,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<(), SubmitError> {
        self.scheduler.submit(id, prompt, params)
    }

    /// Queues a stream that continues where another worker left it (see [`Resume`]).
    pub fn submit_resumed(
        &mut self,
        id: SeqId,
        prompt: Vec<u32>,
        params: SamplingParams,
        resume: Resume,
    ) -> Result<(), SubmitError> {
        let tok = &self.engine.model.tokenizer;
        self.scheduler
            .submit_resumed(id, prompt, params, resume, Some(tok))
    }

    /// Cancels a request and frees its pages.
    pub fn abort(&mut self, id: SeqId) -> Result<bool, PoolError> {
        self.scheduler.abort(id, &mut self.engine.pool.alloc)
    }

    /// Plans, computes and samples one step. Empty when idle.
    pub fn step(&mut self) -> Result<Vec<SeqEvent>, RunnerError> {
        let plan = self
            .scheduler
            .plan(&mut self.engine.pool.alloc, &mut self.cache)?;
        self.last_step = plan.shape();
        if plan.items.is_empty() {
            return Ok(Vec::new());
        }
        let logits = {
            let chunks = self.scheduler.chunks(&plan);
            self.engine.step(&chunks)?
        };
        let tok = &self.engine.model.tokenizer;
        Ok(self.scheduler.commit(
            &plan,
            &logits,
            tok,
            &mut self.engine.pool.alloc,
            &mut self.cache,
        )?)
    }

    /// Runs until every queued request has finished; returns all events in order.
    pub fn run_to_completion(&mut self) -> Result<Vec<SeqEvent>, RunnerError> {
        let mut all = Vec::new();
        while !self.scheduler.is_idle() {
            let events = self.step()?;
            all.extend(events);
        }
        Ok(all)
    }
}
