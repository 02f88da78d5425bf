//! The two ends of a disaggregated pair: a prompt only prefilled here (its first token and
//! the sampler's state go to decode), and a prompt whose KV arrived from prefill (decode
//! continues it from that first token).

use duet_gpu::{PageAllocator, PageId};

use super::{AdmitError, Resume, Scheduler, Seq, SeqEvent, SeqId, SubmitError};
use crate::prefix_cache::PrefixCache;
use crate::sampling::{Sampled, Sampler, SamplerState, SamplingParams};
use crate::tokenizer::{StreamDecoder, Tokenizer};

impl Scheduler {
    /// Queues a prompt that is only prefilled here: its first token is sampled and the
    /// sequence ends, reporting the token and the sampler's state in [`SeqEvent::handoff`]
    /// (prefill in a disaggregated pair). Its pages stay in the prefix cache.
    pub fn submit_prefill(
        &mut self,
        id: SeqId,
        prompt: Vec<u32>,
        params: SamplingParams,
        resume: Resume,
    ) -> Result<(), SubmitError> {
        // Prefill samples only the next token: it needs the sampler's position and the
        // min_tokens count, not the text.
        let generated = resume.generated;
        self.queue(id, prompt, params, resume, None, true)?;
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.prefill_only = true;
            seq.generated = generated;
        }
        Ok(())
    }

    /// Starts decoding a sequence whose prompt KV arrived from elsewhere: `pages` (one
    /// reference each, handed over) hold the whole prompt, `first` was sampled by prefill and
    /// `sampler` is the stream's state after it. A migrated stream's `resume` says which
    /// prompt tokens were generated before. Returns the first token's event.
    #[allow(clippy::too_many_arguments)]
    pub fn admit_transferred(
        &mut self,
        id: SeqId,
        prompt: Vec<u32>,
        params: SamplingParams,
        resume: Resume,
        sampler: SamplerState,
        pages: Vec<PageId>,
        first: Sampled,
        cached_tokens: usize,
        tok: &Tokenizer,
        alloc: &mut PageAllocator,
        cache: &mut PrefixCache,
    ) -> Result<SeqEvent, AdmitError> {
        let ps = self.cfg.page_size;
        if self.seqs.contains_key(&id) {
            return Err(AdmitError::Submit(SubmitError::Duplicate(id)));
        }
        if prompt.is_empty()
            || resume.generated >= prompt.len()
            || pages.len() != prompt.len().div_ceil(ps)
        {
            return Err(AdmitError::PagesMismatch {
                tokens: prompt.len(),
                pages: pages.len(),
            });
        }
        let full = prompt.len() / ps;
        cache.insert(&prompt[..full * ps], &pages[..full], alloc)?;
        self.admissions += 1;
        let mut seq = Seq {
            prompt_len: prompt.len(),
            computed: prompt.len(),
            tokens: prompt,
            pages,
            sampler: Sampler::resume(params, sampler),
            decoder: StreamDecoder::default(),
            text: String::new(),
            emitted: 0,
            generated: 0,
            cached_tokens,
            admitted: self.admissions,
            prefill_only: false,
        };
        seq.resume(resume, tok);
        self.seqs.insert(id, seq);
        self.running.push(id);
        Ok(self.accept(id, first, tok, alloc)?)
    }
}
