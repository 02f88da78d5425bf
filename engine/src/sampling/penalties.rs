//! OpenAI's presence and frequency penalties, from counts of a sequence's generated tokens
//! kept from token to token.

use super::Penalties;

/// `logits` with OpenAI's penalties applied: for each token `j` generated `c[j]` times,
/// `logit[j] - c[j] * frequency - (c[j] > 0) * presence`. The prompt does not count, as in
/// OpenAI's definition.
pub fn penalize(logits: &[f32], generated: &[u32], p: Penalties) -> Vec<f32> {
    let mut counts = Counts::default();
    counts.update(generated);
    let mut out = Vec::new();
    counts.penalize_into(logits, p, &mut out);
    out
}

thread_local! {
    /// The penalized row's scratch, one per thread that samples (as the draw's own row,
    /// `draw::ROW`): a fresh 196 KB row per token was an `mmap` and its page faults.
    static PENALIZED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// How often each token was generated, kept from token to token: a sequence's generated
/// tokens only grow, so each call counts the new ones. Counting all of them again for every
/// token made the penalties quadratic in the output's length (`throughput --sampling`, one
/// Zen 3 core: at 16,000 tokens generated the count took 0.36-0.63 ms a token; the whole
/// sample with kept counts takes 0.15-0.21).
#[derive(Debug, Clone, Default)]
pub(super) struct Counts {
    of: std::collections::HashMap<u32, u32>,
    /// How many tokens of the list are counted, and the last of them (a list that is not
    /// the counted one grown is counted afresh).
    counted: usize,
    last: Option<u32>,
}

impl Counts {
    pub(super) fn update(&mut self, generated: &[u32]) {
        let grown = self.counted <= generated.len()
            && (self.counted == 0 || generated.get(self.counted - 1).copied() == self.last);
        if !grown {
            *self = Counts::default();
        }
        for &t in &generated[self.counted..] {
            *self.of.entry(t).or_default() += 1;
        }
        self.counted = generated.len();
        self.last = generated.last().copied();
    }

    /// `f` of `logits` with the penalties of these counts applied (in this thread's scratch).
    pub(super) fn with_penalized<R>(
        &self,
        logits: &[f32],
        p: Penalties,
        f: impl FnOnce(&[f32]) -> R,
    ) -> R {
        PENALIZED.with_borrow_mut(|row| {
            self.penalize_into(logits, p, row);
            f(row)
        })
    }

    fn penalize_into(&self, logits: &[f32], p: Penalties, out: &mut Vec<f32>) {
        out.clear();
        out.extend_from_slice(logits);
        for (&t, &c) in &self.of {
            if let Some(l) = out.get_mut(t as usize) {
                *l -= c as f32 * p.frequency + p.presence;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The counts kept from call to call are the counts of the list given, as it grows, and
    /// a list that is not the counted one grown (another, or a shorter one) is counted
    /// afresh.
    #[test]
    fn kept_counts_are_the_fresh_counts_of_the_list_given() {
        let fresh = |list: &[u32]| {
            let mut c = Counts::default();
            c.update(list);
            c.of
        };
        let mut kept = Counts::default();
        let mut list = Vec::new();
        for i in 0..300u32 {
            list.push(i * 7 % 13);
            if i % 3 == 0 {
                kept.update(&list);
                assert_eq!(kept.of, fresh(&list));
            }
        }
        let mut other = list.clone();
        other[299] = 1000;
        kept.update(&other);
        assert_eq!(kept.of, fresh(&other), "same length, another last token");
        kept.update(&list[..10]);
        assert_eq!(kept.of, fresh(&list[..10]), "a shorter list");
        kept.update(&[]);
        assert!(kept.of.is_empty());
        assert_eq!(
            fresh(&[2, 2, 0, 2, 9]),
            [(2, 3), (0, 1), (9, 1)].into_iter().collect()
        );
    }
}
