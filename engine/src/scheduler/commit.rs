//! What a step's logits become: a sampled token per sequence, the text that is now final
//! (never a character split or a stop string shown), and the sequence's end (EOS, a stop
//! string, its length) with its pages released.

use duet_gpu::{PageAllocator, PoolError};

use super::{Plan, Scheduler, SeqEvent, SeqId};
use crate::prefix_cache::PrefixCache;
use crate::sampling::{FinishReason, Sampled, find_stop_after};
use crate::tokenizer::Tokenizer;

impl Scheduler {
    /// Takes a step's logits (one entry per plan item), samples, and finishes sequences.
    pub fn commit(
        &mut self,
        plan: &Plan,
        logits: &[Option<Vec<f32>>],
        tok: &Tokenizer,
        alloc: &mut PageAllocator,
        cache: &mut PrefixCache,
    ) -> Result<Vec<SeqEvent>, PoolError> {
        let ps = self.cfg.page_size;
        let mut events = Vec::new();
        for (item, logits) in plan.items.iter().zip(logits) {
            let Some(seq) = self.seqs.get_mut(&item.seq) else {
                continue;
            };
            seq.computed += item.len;
            let Some(logits) = logits.as_ref().filter(|_| item.sample) else {
                continue;
            };
            if seq.computed == seq.prompt_len {
                // The prompt is computed: its full pages can serve later requests.
                let full = seq.prompt_len / ps;
                cache.insert(
                    &seq.tokens[..full * ps],
                    &seq.pages[..full.min(seq.pages.len())],
                    alloc,
                )?;
            }
            let params = seq.sampler.params();
            let eos = tok.eos.filter(|_| !params.ignore_eos);
            let banned = eos.filter(|_| seq.generated < params.min_tokens);
            let generated = &seq.tokens[seq.tokens.len() - seq.generated.min(seq.tokens.len())..];
            let s = seq.sampler.sample(logits, banned, generated);
            if seq.prefill_only {
                // Prefill's part ends here: the token and the sampler's state go to decode,
                // which does the text and the stopping.
                events.push(SeqEvent {
                    seq: item.seq,
                    token: s.token,
                    logprob: s.logprob,
                    top: s.top,
                    text: String::new(),
                    finish: None,
                    cached_tokens: seq.cached_tokens,
                    handoff: Some(seq.sampler.state()),
                });
                self.finish(item.seq, alloc)?;
                continue;
            }
            events.push(self.accept(item.seq, s, tok, alloc)?);
        }
        Ok(events)
    }

    /// Appends a sampled token: stop strings, EOS, length, the text that is now final.
    pub(super) fn accept(
        &mut self,
        id: SeqId,
        s: Sampled,
        tok: &Tokenizer,
        alloc: &mut PageAllocator,
    ) -> Result<SeqEvent, PoolError> {
        let max_context = self.cfg.max_context.min(self.cfg.pool_tokens);
        let Some(seq) = self.seqs.get_mut(&id) else {
            return Err(PoolError::NotAllocated(0));
        };
        let params = seq.sampler.params();
        let eos = tok.eos.filter(|_| !params.ignore_eos);
        seq.tokens.push(s.token);
        seq.generated += 1;
        let mut finish = None;
        let new = seq.text.len();
        if Some(s.token) == eos {
            finish = Some(FinishReason::Stop);
        } else {
            seq.text.push_str(&seq.decoder.push(tok, s.token));
        }
        // Stop strings count from `min_tokens` on, and only those that reach into this
        // token's text: an earlier one either stopped the stream or came before
        // `min_tokens` (vLLM's rule).
        let may_stop = seq.generated >= params.min_tokens;
        let mut visible = seq.text.len();
        let stop = may_stop
            .then(|| find_stop_after(&seq.text, &params.stop, new))
            .flatten();
        if let Some(at) = stop {
            visible = at;
            finish = Some(FinishReason::Stop);
        }
        if finish.is_none()
            && (seq.generated >= params.max_tokens || seq.tokens.len() >= max_context)
        {
            finish = Some(FinishReason::Length);
        }
        if finish.is_none() {
            // Hold back what could still turn out to be the start of a stop string.
            let hold = params
                .stop
                .iter()
                .map(|s| s.len().saturating_sub(1))
                .max()
                .unwrap_or(0);
            visible = floor_char_boundary(&seq.text, seq.text.len().saturating_sub(hold));
        } else if finish == Some(FinishReason::Length) {
            seq.text.push_str(&seq.decoder.finish());
            visible = seq.text.len();
        }
        let visible = visible.max(seq.emitted);
        let text = seq.text[seq.emitted..visible].to_string();
        seq.emitted = visible;
        let cached_tokens = if seq.generated == 1 {
            seq.cached_tokens
        } else {
            0
        };
        let event = SeqEvent {
            seq: id,
            token: s.token,
            logprob: s.logprob,
            top: s.top,
            text,
            finish,
            cached_tokens,
            handoff: None,
        };
        if finish.is_some() {
            self.finish(id, alloc)?;
        }
        Ok(event)
    }
}

/// The largest character boundary of `s` at or below `i`.
pub(super) fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}
