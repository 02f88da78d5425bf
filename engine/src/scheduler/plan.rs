//! What a planned step computes: its items (a sequence, its positions, whether it samples)
//! and its shape (tokens and positions attended, what the step's time grows with).

use super::SeqId;

/// One piece of work in a planned step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanItem {
    /// The sequence.
    pub seq: SeqId,
    /// First position computed.
    pub start: usize,
    /// Tokens computed.
    pub len: usize,
    /// Whether the step's logits for the last token are needed (end of prompt, or decode).
    pub sample: bool,
}

/// What one step computes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// The work, decode tokens first.
    pub items: Vec<PlanItem>,
}

impl Plan {
    /// How much the step computes: what its time grows with.
    pub fn shape(&self) -> StepShape {
        let mut shape = StepShape::default();
        for it in &self.items {
            shape.tokens += it.len;
            // The token at position `p` attends over `p + 1` positions: `start + 1` up to
            // `start + len`.
            shape.attended += it.len * it.start + it.len * (it.len + 1) / 2;
        }
        shape
    }
}

/// The size of one step (for its metrics): a step's time is its weights' pass, which grows
/// with `tokens`, plus its attention, which grows with `attended`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepShape {
    /// Tokens computed: one per decoding sequence, a chunk's length per prompt.
    pub tokens: usize,
    /// KV positions the step's tokens attend over, summed.
    pub attended: usize,
}
