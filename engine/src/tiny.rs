//! A tiny random-weight Llama GGUF of the real model's architecture (2 layers, dim 64, GQA,
//! tied embeddings, Q4_1 matrices, a Q8_0 embedding, a byte-level BPE vocabulary with a few
//! merges and ChatML specials). Fast tests load it through the same loader as the real model.

use crate::gguf::TensorType;
use crate::gguf::writer::{GgufWriter, WValue};

/// Hyperparameters of the tiny model.
pub const LAYERS: usize = 2;
/// Hidden size.
pub const DIM: usize = 64;
/// Feed-forward size.
pub const FFN: usize = 128;
/// Query heads.
pub const HEADS: usize = 4;
/// KV heads.
pub const KV_HEADS: usize = 2;
/// Context length.
pub const CONTEXT: usize = 512;

const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const MERGES: [(&str, &str); 10] = [
    ("Ġ", "t"),
    ("h", "e"),
    ("i", "n"),
    ("Ġ", "a"),
    ("e", "r"),
    ("o", "n"),
    ("Ġt", "he"),
    ("r", "e"),
    ("a", "n"),
    ("e", "n"),
];
const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// A deterministic stream of values in [-scale, scale).
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// The tiny model's GGUF bytes for `seed`.
pub fn tiny_model_bytes(seed: u64) -> Vec<u8> {
    let mut tokens: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    let mut types = vec![3i32; SPECIALS.len()];
    for b in 0..=255u8 {
        tokens.push(byte_char(b).to_string());
        types.push(1);
    }
    for (a, b) in MERGES {
        tokens.push(format!("{a}{b}"));
        types.push(1);
    }
    let vocab = tokens.len();

    let mut w = GgufWriter::new();
    let kv = |w: &mut GgufWriter, k: &str, v: WValue| w.kv(k, v);
    kv(&mut w, "general.architecture", WValue::Str("llama".into()));
    kv(&mut w, "general.name", WValue::Str("duet-tiny".into()));
    kv(&mut w, "llama.block_count", WValue::U32(LAYERS as u32));
    kv(&mut w, "llama.context_length", WValue::U32(CONTEXT as u32));
    kv(&mut w, "llama.embedding_length", WValue::U32(DIM as u32));
    kv(&mut w, "llama.feed_forward_length", WValue::U32(FFN as u32));
    kv(
        &mut w,
        "llama.attention.head_count",
        WValue::U32(HEADS as u32),
    );
    kv(
        &mut w,
        "llama.attention.head_count_kv",
        WValue::U32(KV_HEADS as u32),
    );
    kv(&mut w, "llama.rope.freq_base", WValue::F32(10_000.0));
    kv(
        &mut w,
        "llama.attention.layer_norm_rms_epsilon",
        WValue::F32(1e-5),
    );
    kv(&mut w, "llama.vocab_size", WValue::U32(vocab as u32));
    kv(&mut w, "tokenizer.ggml.model", WValue::Str("gpt2".into()));
    kv(&mut w, "tokenizer.ggml.pre", WValue::Str("smollm".into()));
    kv(&mut w, "tokenizer.ggml.tokens", WValue::StrArray(tokens));
    kv(&mut w, "tokenizer.ggml.token_type", WValue::I32Array(types));
    kv(
        &mut w,
        "tokenizer.ggml.merges",
        WValue::StrArray(MERGES.iter().map(|(a, b)| format!("{a} {b}")).collect()),
    );
    kv(&mut w, "tokenizer.ggml.bos_token_id", WValue::U32(1));
    kv(&mut w, "tokenizer.ggml.eos_token_id", WValue::U32(2));
    kv(&mut w, "tokenizer.ggml.add_bos_token", WValue::Bool(false));
    kv(
        &mut w,
        "tokenizer.chat_template",
        WValue::Str(CHATML.into()),
    );

    let head_dim = DIM / HEADS;
    let kv_dim = KV_HEADS * head_dim;
    let mut n = seed;
    let mut next = || {
        n += 1;
        n
    };
    w.tensor_quantized(
        "token_embd.weight",
        &[DIM, vocab],
        TensorType::Q8_0,
        &values(DIM * vocab, next(), 1.0),
    );
    for l in 0..LAYERS {
        let p = |s: &str| format!("blk.{l}.{s}.weight");
        let norm: Vec<f32> = values(DIM, next(), 0.1).iter().map(|v| 1.0 + v).collect();
        w.tensor_f32(&p("attn_norm"), &[DIM], &norm);
        w.tensor_f32(&p("ffn_norm"), &[DIM], &norm);
        let s = 1.0 / (DIM as f32).sqrt();
        let mut q = |name: &str, cols: usize, rows: usize, scale: f32| {
            w.tensor_quantized(
                &p(name),
                &[cols, rows],
                TensorType::Q4_1,
                &values(cols * rows, next(), scale),
            );
        };
        q("attn_q", DIM, DIM, s * 2.0);
        q("attn_k", DIM, kv_dim, s * 2.0);
        q("attn_v", DIM, kv_dim, s);
        q("attn_output", DIM, DIM, s);
        q("ffn_gate", DIM, FFN, s);
        q("ffn_up", DIM, FFN, s);
        q("ffn_down", FFN, DIM, 1.0 / (FFN as f32).sqrt());
    }
    w.tensor_f32("output_norm.weight", &[DIM], &vec![1.0; DIM]);
    w.finish()
}

/// GPT-2's printable stand-in for a byte.
fn byte_char(b: u8) -> char {
    let mut n = 0u32;
    for x in 0..=255u8 {
        let printable = matches!(x, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        if x == b {
            return if printable {
                char::from(x)
            } else {
                char::from_u32(256 + n).unwrap_or('?')
            };
        }
        if !printable {
            n += 1;
        }
    }
    '?'
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::Gguf;
    use crate::model::Model;

    #[test]
    fn loads_and_tokenizes() {
        let model = Model::from_gguf(Gguf::parse(tiny_model_bytes(1)).unwrap()).unwrap();
        assert_eq!(model.config.n_layers, LAYERS);
        assert_eq!(model.config.head_dim, DIM / HEADS);
        let tok = &model.tokenizer;
        let ids = tok.encode("<|im_start|>the cat in the hat<|im_end|>");
        assert_eq!(ids[0], 1);
        assert_eq!(*ids.last().unwrap(), 2);
        assert!(ids.contains(&tok.token_id("Ġthe").unwrap()));
        assert_eq!(tok.decode(&ids), "<|im_start|>the cat in the hat<|im_end|>");
    }
}
