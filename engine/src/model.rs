//! A Llama-family model loaded from GGUF: hyperparameters, weights (kept quantized in the
//! file's buffer), tokenizer and chat template, and a fingerprint that identifies it.

use std::ops::Range;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::chat::{ChatError, ChatTemplate};
use crate::gguf::{Gguf, GgufError, TensorInfo};
use crate::kernels::{Format, QRef, repack};
use crate::tokenizer::{Tokenizer, TokenizerError};

/// Hyperparameters from `llama.*` metadata.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelConfig {
    /// Transformer blocks.
    pub n_layers: usize,
    /// Hidden size.
    pub dim: usize,
    /// Feed-forward size.
    pub ffn_dim: usize,
    /// Query heads.
    pub n_heads: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Dimension per head.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Longest sequence the model was trained for.
    pub context_length: usize,
    /// RoPE frequency base.
    pub rope_base: f32,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
}

/// Why a model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file itself.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// The tokenizer metadata.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// The chat template.
    #[error(transparent)]
    Chat(#[from] ChatError),
    /// No memory for the weights.
    #[error("cannot map memory for the weights: {0}")]
    Memory(String),
    /// A tensor of the wrong shape.
    #[error("tensor `{tensor}` has shape {got:?}, expected {expected:?}")]
    Shape {
        /// The tensor.
        tensor: String,
        /// Its dimensions.
        got: Vec<usize>,
        /// What the hyperparameters imply.
        expected: Vec<usize>,
    },
    /// A hyperparameter that makes no sense.
    #[error("metadata `{key}` = {value} is invalid: {reason}")]
    BadHyperparameter {
        /// The key.
        key: &'static str,
        /// Its value.
        value: u64,
        /// Why.
        reason: &'static str,
    },
}

/// A weight matrix: where its blocks are in the model's weight arena.
#[derive(Debug, Clone)]
pub struct Matrix {
    ty: Format,
    rows: usize,
    cols: usize,
    range: Range<usize>,
}

/// One transformer block's weights.
#[derive(Debug, Clone)]
pub struct Layer {
    /// Pre-attention RMSNorm weight.
    pub attn_norm: Vec<f32>,
    /// Pre-FFN RMSNorm weight.
    pub ffn_norm: Vec<f32>,
    /// Query projection.
    pub wq: Matrix,
    /// Key projection.
    pub wk: Matrix,
    /// Value projection.
    pub wv: Matrix,
    /// Attention output projection.
    pub wo: Matrix,
    /// FFN gate.
    pub w_gate: Matrix,
    /// FFN up.
    pub w_up: Matrix,
    /// FFN down.
    pub w_down: Matrix,
}

/// A loaded model.
pub struct Model {
    /// Every weight matrix, repacked for the kernels (still 4- and 8-bit), on huge pages
    /// where the system allows: every decode step streams all of it (see `duet_gpu::huge`).
    arena: duet_gpu::huge::HugeBuffer,
    /// Hyperparameters.
    pub config: ModelConfig,
    /// Token embeddings (also the output projection when tied).
    pub embed: Matrix,
    /// Output projection, when not tied to the embeddings.
    pub output: Option<Matrix>,
    /// Final RMSNorm weight.
    pub output_norm: Vec<f32>,
    /// The blocks.
    pub layers: Vec<Layer>,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template, if the file has one.
    pub chat: Option<ChatTemplate>,
    /// SHA-256 of the file's header (metadata and tensor table), lowercase hex.
    pub fingerprint: String,
    /// The file's size in bytes.
    pub file_bytes: usize,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("config", &self.config)
            .field("fingerprint", &self.fingerprint)
            .finish_non_exhaustive()
    }
}

impl Model {
    /// Loads a GGUF file.
    pub fn open(path: &Path) -> Result<Model, ModelError> {
        Model::from_gguf(Gguf::open(path)?)
    }

    /// Builds the model from a parsed file (which it takes over).
    pub fn from_gguf(g: Gguf) -> Result<Model, ModelError> {
        let arch = g.str("general.architecture")?;
        if arch != "llama" {
            return Err(GgufError::UnsupportedArchitecture(arch.to_string()).into());
        }
        let u = |key: &'static str| -> Result<usize, ModelError> {
            let v = g.u64(key)?;
            if v == 0 || v > 1 << 24 {
                return Err(ModelError::BadHyperparameter {
                    key,
                    value: v,
                    reason: "expected 1 to 2^24",
                });
            }
            Ok(v as usize)
        };
        let n_heads = u("llama.attention.head_count")?;
        let dim = u("llama.embedding_length")?;
        let n_kv_heads = g
            .u64("llama.attention.head_count_kv")
            .map(|v| v as usize)
            .unwrap_or(n_heads);
        if dim % n_heads != 0 || n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
            return Err(ModelError::BadHyperparameter {
                key: "llama.attention.head_count_kv",
                value: n_kv_heads as u64,
                reason: "heads must divide the embedding and the KV heads must divide the heads",
            });
        }
        let tokens = g.strings("tokenizer.ggml.tokens")?.len();
        let config = ModelConfig {
            n_layers: u("llama.block_count")?,
            dim,
            ffn_dim: u("llama.feed_forward_length")?,
            n_heads,
            n_kv_heads,
            head_dim: dim / n_heads,
            vocab: g
                .u64("llama.vocab_size")
                .map(|v| v as usize)
                .unwrap_or(tokens),
            context_length: u("llama.context_length")?,
            rope_base: g.f64("llama.rope.freq_base").unwrap_or(10_000.0) as f32,
            rms_eps: g
                .f64("llama.attention.layer_norm_rms_epsilon")
                .unwrap_or(1e-5) as f32,
        };
        let c = config;
        let kv = c.n_kv_heads * c.head_dim;
        let arena = std::cell::RefCell::new(Vec::with_capacity(g.bytes().len() * 6 / 5));
        let matrix = |name: &str, rows: usize, cols: usize| -> Result<Matrix, ModelError> {
            let t = g.tensor(name)?;
            check_shape(t, &[cols, rows])?;
            let (ty, bytes) = repack(t.ty, g.tensor_bytes(t), cols);
            let mut arena = arena.borrow_mut();
            let start = arena.len();
            arena.extend_from_slice(&bytes);
            Ok(Matrix {
                ty,
                rows,
                cols,
                range: start..arena.len(),
            })
        };
        let vector = |name: &str, n: usize| -> Result<Vec<f32>, ModelError> {
            let t = g.tensor(name)?;
            check_shape(t, &[n])?;
            let m = Matrix {
                ty: Format::Gguf(t.ty),
                rows: 1,
                cols: n,
                range: t.range.clone(),
            };
            let mut out = vec![0f32; n];
            m.view(g.bytes()).dequantize_row(0, &mut out);
            Ok(out)
        };
        let mut layers = Vec::with_capacity(c.n_layers);
        for i in 0..c.n_layers {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(Layer {
                attn_norm: vector(&p("attn_norm"), c.dim)?,
                ffn_norm: vector(&p("ffn_norm"), c.dim)?,
                wq: matrix(&p("attn_q"), c.dim, c.dim)?,
                wk: matrix(&p("attn_k"), kv, c.dim)?,
                wv: matrix(&p("attn_v"), kv, c.dim)?,
                wo: matrix(&p("attn_output"), c.dim, c.dim)?,
                w_gate: matrix(&p("ffn_gate"), c.ffn_dim, c.dim)?,
                w_up: matrix(&p("ffn_up"), c.ffn_dim, c.dim)?,
                w_down: matrix(&p("ffn_down"), c.dim, c.ffn_dim)?,
            });
        }
        let embed = matrix("token_embd.weight", c.vocab, c.dim)?;
        let output = match g.tensors.contains_key("output.weight") {
            true => Some(matrix("output.weight", c.vocab, c.dim)?),
            false => None,
        };
        let output_norm = vector("output_norm.weight", c.dim)?;
        let tokenizer = Tokenizer::from_gguf(&g)?;
        let chat = match ChatTemplate::from_gguf(&g) {
            Ok(t) => Some(t),
            Err(ChatError::NoTemplate) => None,
            Err(e) => return Err(e.into()),
        };
        let fingerprint = Sha256::digest(g.header())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let file_bytes = g.bytes().len();
        drop(g);
        let arena = duet_gpu::huge::HugeBuffer::copy_of(&arena.into_inner())
            .map_err(|e| ModelError::Memory(e.to_string()))?;
        Ok(Model {
            file_bytes,
            arena,
            config,
            embed,
            output,
            output_norm,
            layers,
            tokenizer,
            chat,
            fingerprint,
        })
    }

    /// A weight matrix ready for the kernels.
    pub fn w(&self, m: &Matrix) -> QRef<'_> {
        m.view(&self.arena)
    }

    /// Bytes of weights held in memory.
    pub fn weight_bytes(&self) -> usize {
        self.arena.len()
    }

    /// The output projection (the embeddings when tied).
    pub fn lm_head(&self) -> QRef<'_> {
        self.w(self.output.as_ref().unwrap_or(&self.embed))
    }
}

impl Matrix {
    fn view<'a>(&self, data: &'a [u8]) -> QRef<'a> {
        QRef {
            ty: self.ty,
            rows: self.rows,
            cols: self.cols,
            bytes: &data[self.range.clone()],
        }
    }
}

fn check_shape(t: &TensorInfo, expected: &[usize]) -> Result<(), ModelError> {
    if t.dims != expected {
        return Err(ModelError::Shape {
            tensor: t.name.clone(),
            got: t.dims.clone(),
            expected: expected.to_vec(),
        });
    }
    Ok(())
}
