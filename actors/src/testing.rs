//! What this crate's unit tests share.

use duet_gpu::{KvDtype, KvLayout};

/// A KV layout small enough to fill and read by hand: 2 layers, 1 KV head of 8, 4 tokens a
/// page, f32.
pub(crate) fn small_layout() -> KvLayout {
    KvLayout {
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 8,
        page_size: 4,
        dtype: KvDtype::F32,
    }
}
