//! Duet's model engine: everything needed to run a Llama-family GGUF model over a paged KV
//! cache, with no network in it.
//!
//! ```text
//!   a GGUF ──► gguf ──► model (weights stay quantized) + tokenizer + chat template
//!                         │
//!   scheduler ──plans──► engine::step(chunks) ──► kernels (matmul, attention, ops)
//!      ▲                  │        reads/writes KV through page tables in duet_gpu::KvPool
//!      └── sampled tokens ◄── sampling (greedy, temperature, top-k, top-p, seed)
//! ```
//!
//! - [`gguf`]: file parsing (and a writer for the tiny test model).
//! - [`tokenizer`], [`chat`]: byte-level BPE and the Jinja chat template from the file.
//! - [`model`], [`engine`], [`kernels`]: weights, the step API, the exact CPU kernels.
//! - [`sampling`], [`prefix_cache`], [`scheduler`], [`runner`]: choosing tokens, reusing
//!   prompt pages, continuous batching with chunked prefill.

pub mod chat;
pub mod engine;
pub mod gguf;
pub mod kernels;
pub mod model;
pub mod prefix_cache;
pub mod runner;
pub mod sampling;
pub mod scheduler;
pub mod step_pool;
#[cfg(feature = "tiny")]
pub mod tiny;
pub mod tokenizer;

pub use engine::{Engine, EngineError, EngineOptions, SeqChunk};

/// The version of the numbers a KV page holds for a given model and layout. Bumped when a
/// change to the kernels changes those bits (not when it only makes them faster): pages move
/// between two workers only when both compute the same bits, so a continuation on another
/// worker equals a run on one (the batch invariance the tests check). Workers of builds with
/// different formats still serve, each on its own, during a rolling upgrade; the router does
/// not pair them.
pub const KV_FORMAT: u32 = 1;
pub use model::Model;
pub use runner::Runner;
pub use sampling::{FinishReason, SamplingParams};
