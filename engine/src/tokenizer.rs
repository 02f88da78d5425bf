//! Byte-level BPE from the GGUF metadata (`tokenizer.ggml.*`), as GPT-2 and SmolLM2 use it.
//!
//! Encoding, in order:
//! 1. special tokens (control and user-defined tokens of the vocabulary, such as
//!    `<|im_start|>`) are matched in the raw text and map to their ids;
//! 2. for the `smollm` pre-tokenizer every digit is its own piece;
//! 3. the rest is split with GPT-2's pattern
//!    (`'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`);
//! 4. each piece's bytes are mapped to GPT-2's printable byte alphabet and merged by the
//!    file's merge ranks, lowest rank first, leftmost first.
//!
//! Decoding maps ids back to bytes; [`StreamDecoder`] releases text only at UTF-8 boundaries,
//! so a streamed reply never splits a character.

use std::collections::HashMap;

use crate::gguf::{Gguf, GgufError};

/// GPT-2's pre-tokenization pattern.
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Token types of `tokenizer.ggml.token_type`.
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;

/// Why a tokenizer could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// Metadata missing or malformed.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A tokenizer model other than byte-level BPE.
    #[error("tokenizer model `{0}` is not supported (gpt2 byte-level BPE is)")]
    UnsupportedModel(String),
    /// A merge line that is not two tokens.
    #[error("merge #{index} `{merge}` is not two space-separated tokens")]
    BadMerge {
        /// Its position.
        index: usize,
        /// The text.
        merge: String,
    },
    /// The pattern did not compile (a bug, reported rather than panicking).
    #[error("pre-tokenizer pattern: {0}")]
    Pattern(String),
}

/// A byte-level BPE tokenizer.
pub struct Tokenizer {
    tokens: Vec<String>,
    ids: HashMap<String, u32>,
    ranks: HashMap<(String, String), u32>,
    specials: Vec<(String, u32)>,
    split_digits: bool,
    pattern: fancy_regex::Regex,
    byte_to_char: [char; 256],
    char_to_byte: HashMap<char, u8>,
    /// Beginning-of-sequence id, if the vocabulary names one.
    pub bos: Option<u32>,
    /// End-of-sequence id (generation stops here by default).
    pub eos: Option<u32>,
    /// Whether the model expects BOS prepended to a prompt.
    pub add_bos: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.tokens.len())
            .field("merges", &self.ranks.len())
            .field("specials", &self.specials.len())
            .finish()
    }
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's metadata.
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer, TokenizerError> {
        let model = g.str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(model.to_string()));
        }
        let tokens: Vec<String> = g
            .strings("tokenizer.ggml.tokens")?
            .into_iter()
            .map(str::to_string)
            .collect();
        let types = g.ints("tokenizer.ggml.token_type").unwrap_or_default();
        let merges = g.strings("tokenizer.ggml.merges")?;
        let mut ranks = HashMap::with_capacity(merges.len());
        for (i, m) in merges.iter().enumerate() {
            let (a, b) = m.split_once(' ').ok_or_else(|| TokenizerError::BadMerge {
                index: i,
                merge: m.to_string(),
            })?;
            ranks.insert((a.to_string(), b.to_string()), i as u32);
        }
        let mut specials: Vec<(String, u32)> = types
            .iter()
            .enumerate()
            .filter(|(_, t)| **t == TYPE_CONTROL || **t == TYPE_USER_DEFINED)
            .filter_map(|(i, _)| Some((tokens.get(i)?.clone(), i as u32)))
            .filter(|(s, _)| !s.is_empty())
            .collect();
        // Longest first, so `<|im_start|>` wins over any shorter special that prefixes it.
        specials.sort_by_key(|s| std::cmp::Reverse(s.0.len()));
        let id = |key: &str| g.u64(key).ok().map(|v| v as u32);
        let pre = g.str("tokenizer.ggml.pre").unwrap_or("default");
        let (byte_to_char, char_to_byte) = byte_alphabet();
        Ok(Tokenizer {
            ids: tokens
                .iter()
                .enumerate()
                .map(|(i, t)| (t.clone(), i as u32))
                .collect(),
            tokens,
            ranks,
            specials,
            split_digits: pre == "smollm",
            pattern: fancy_regex::Regex::new(GPT2_PATTERN)
                .map_err(|e| TokenizerError::Pattern(e.to_string()))?,
            byte_to_char,
            char_to_byte,
            bos: id("tokenizer.ggml.bos_token_id"),
            eos: id("tokenizer.ggml.eos_token_id"),
            add_bos: matches!(
                g.metadata.get("tokenizer.ggml.add_bos_token"),
                Some(crate::gguf::Value::Bool(true))
            ),
        })
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The id of a token's text, if it is in the vocabulary.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    /// Encodes text (special tokens in it are recognised), without adding BOS.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let next_special = self
                .specials
                .iter()
                .filter_map(|(s, id)| rest.find(s.as_str()).map(|at| (at, s.len(), *id)))
                .min_by_key(|(at, len, _)| (*at, usize::MAX - len));
            match next_special {
                Some((at, len, id)) => {
                    self.encode_ordinary(&rest[..at], &mut out);
                    out.push(id);
                    rest = &rest[at + len..];
                }
                None => {
                    self.encode_ordinary(rest, &mut out);
                    break;
                }
            }
        }
        out
    }

    /// Encodes text in which special-token strings are plain text.
    fn encode_ordinary(&self, text: &str, out: &mut Vec<u32>) {
        if !self.split_digits {
            return self.encode_pieces(text, out);
        }
        let mut start = 0;
        for (i, c) in text.char_indices() {
            if c.is_numeric() {
                self.encode_pieces(&text[start..i], out);
                self.encode_pieces(&text[i..i + c.len_utf8()], out);
                start = i + c.len_utf8();
            }
        }
        self.encode_pieces(&text[start..], out);
    }

    fn encode_pieces(&self, text: &str, out: &mut Vec<u32>) {
        for piece in self.pattern.find_iter(text) {
            // The pattern matches every character (its last branch is `\s+` and the others
            // cover the rest), so an error can only be the backtrack limit; fall back to the
            // whole remaining text as one piece rather than dropping it.
            match piece {
                Ok(m) => self.bpe(m.as_str(), out),
                Err(_) => {
                    self.bpe(text, out);
                    return;
                }
            }
        }
    }

    fn bpe(&self, piece: &str, out: &mut Vec<u32>) {
        let mut symbols: Vec<String> = piece
            .bytes()
            .map(|b| self.byte_to_char[b as usize].to_string())
            .collect();
        loop {
            let best = symbols
                .windows(2)
                .enumerate()
                .filter_map(|(i, w)| {
                    self.ranks
                        .get(&(w[0].clone(), w[1].clone()))
                        .map(|r| (*r, i))
                })
                .min();
            let Some((_, i)) = best else { break };
            let right = symbols.remove(i + 1);
            symbols[i].push_str(&right);
        }
        for s in symbols {
            match self.ids.get(&s) {
                Some(id) => out.push(*id),
                // Not in the vocabulary: fall back to its single-byte tokens.
                None => out.extend(
                    s.chars()
                        .filter_map(|c| self.ids.get(&c.to_string()).copied()),
                ),
            }
        }
    }

    /// The bytes a token stands for (special tokens give their text).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(text) = self.tokens.get(id as usize) else {
            return Vec::new();
        };
        if self.specials.iter().any(|(_, s)| *s == id) {
            return text.as_bytes().to_vec();
        }
        text.chars()
            .map(|c| self.char_to_byte.get(&c).copied().unwrap_or(b'?'))
            .collect()
    }

    /// Decodes ids to text (invalid UTF-8 becomes U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().flat_map(|id| self.token_bytes(*id)).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Turns a stream of ids into text pieces that never split a UTF-8 character.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// Adds one token; returns the text that is now complete.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        self.pending.extend(tok.token_bytes(id));
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            // Invalid bytes (not just incomplete): emit them lossily rather than hold forever.
            Err(_) => self.pending.len(),
        };
        let done: Vec<u8> = self.pending.drain(..valid).collect();
        String::from_utf8_lossy(&done).into_owned()
    }

    /// Whatever is left at the end of the stream.
    pub fn finish(&mut self) -> String {
        let rest = std::mem::take(&mut self.pending);
        String::from_utf8_lossy(&rest).into_owned()
    }
}

/// GPT-2's map from bytes to printable characters, and back.
fn byte_alphabet() -> ([char; 256], HashMap<char, u8>) {
    let mut map = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        map[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(256 + n).unwrap_or('?');
            n += 1;
            c
        };
    }
    let back = map.iter().enumerate().map(|(b, c)| (*c, b as u8)).collect();
    (map, back)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_is_a_bijection() {
        let (fwd, back) = byte_alphabet();
        assert_eq!(back.len(), 256);
        assert_eq!(fwd[b' ' as usize], 'Ġ');
        assert_eq!(fwd[b'\n' as usize], 'Ċ');
        for b in 0..=255u8 {
            assert_eq!(back[&fwd[b as usize]], b);
        }
    }
}
