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
//! Every step is linear or `n log n` in the text, whatever it holds: special tokens are found
//! in one pass, and merging keeps the candidate pairs in a heap (a 200 KB prompt of one
//! unbroken word encodes in milliseconds; merging by rescanning every pair after each merge,
//! as the textbook loop does, took minutes). Prompts come from the network.
//!
//! Decoding maps ids back to bytes; [`StreamDecoder`] releases text only at UTF-8 boundaries,
//! so a streamed reply never splits a character.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

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
    /// Merge `(left, right)` -> (rank, merged token), over token ids.
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// Merges of the file whose parts or result are not in the vocabulary (never applied).
    unusable_merges: usize,
    /// Each byte's token (its printable character's), if the vocabulary has it.
    byte_tokens: [Option<u32>; 256],
    /// The most bytes one ordinary token stands for.
    max_token_bytes: usize,
    specials: Vec<(String, u32)>,
    split_digits: bool,
    pattern: fancy_regex::Regex,
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
            .field("merges", &self.merges.len())
            .field("unusable_merges", &self.unusable_merges)
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
        let ids: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let merge_lines = g.strings("tokenizer.ggml.merges")?;
        let mut merges = HashMap::with_capacity(merge_lines.len());
        let mut unusable_merges = 0;
        for (i, m) in merge_lines.iter().enumerate() {
            let (a, b) = m.split_once(' ').ok_or_else(|| TokenizerError::BadMerge {
                index: i,
                merge: m.to_string(),
            })?;
            // A merge is usable only if both parts and the result are tokens (in every GPT-2
            // style vocabulary they are). A pair listed twice keeps its last rank.
            match (ids.get(a), ids.get(b), ids.get(&format!("{a}{b}"))) {
                (Some(&l), Some(&r), Some(&m)) => {
                    merges.insert((l, r), (i as u32, m));
                }
                _ => unusable_merges += 1,
            }
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
        let byte_tokens = std::array::from_fn(|b| ids.get(&byte_to_char[b].to_string()).copied());
        let max_token_bytes = tokens
            .iter()
            .enumerate()
            .filter(|(i, _)| !specials.iter().any(|(_, s)| *s as usize == *i))
            .map(|(_, t)| t.chars().count())
            .max()
            .unwrap_or(1)
            .max(1);
        Ok(Tokenizer {
            ids,
            tokens,
            merges,
            unusable_merges,
            byte_tokens,
            max_token_bytes,
            specials,
            split_digits: pre == "smollm",
            pattern: fancy_regex::Regex::new(GPT2_PATTERN)
                .map_err(|e| TokenizerError::Pattern(e.to_string()))?,
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

    /// The most bytes one ordinary token stands for: a text of `n` bytes encodes to at
    /// least `n / max_token_bytes` tokens, so a prompt too long for a context can be refused
    /// before it is encoded.
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    /// Encodes text (special tokens in it are recognised), without adding BOS.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut start = 0;
        let mut at = 0;
        let bytes = text.as_bytes();
        // One pass: at each byte that can begin a special token, the longest special that
        // starts there (specials are sorted longest first).
        while at < bytes.len() {
            let found = self.specials.iter().find(|(s, _)| {
                s.as_bytes()[0] == bytes[at] && bytes[at..].starts_with(s.as_bytes())
            });
            match found {
                Some((s, id)) => {
                    self.encode_ordinary(&text[start..at], &mut out);
                    out.push(*id);
                    at += s.len();
                    start = at;
                }
                None => at += 1,
            }
        }
        self.encode_ordinary(&text[start..], &mut out);
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

    /// Merges one piece, lowest rank first, leftmost first: the candidate pairs wait in a
    /// heap keyed by (rank, position), symbols form a linked list, and a pair made stale by an
    /// earlier merge is skipped when it comes up. `n log n` in the piece's bytes.
    fn bpe(&self, piece: &str, out: &mut Vec<u32>) {
        // A byte without a token (a vocabulary that lacks some) is dropped, as before.
        let mut sym: Vec<Symbol> = piece
            .bytes()
            .filter_map(|b| self.byte_tokens[b as usize])
            .enumerate()
            .map(|(i, id)| Symbol {
                id,
                prev: i.checked_sub(1),
                next: Some(i + 1),
                alive: true,
            })
            .collect();
        let Some(last) = sym.last_mut() else {
            return;
        };
        last.next = None;
        let mut heap = BinaryHeap::new();
        let candidate = |sym: &[Symbol], i: usize| {
            let j = sym[i].next?;
            let (rank, _) = self.merges.get(&(sym[i].id, sym[j].id))?;
            Some(Reverse((*rank, i, sym[i].id, sym[j].id)))
        };
        for i in 0..sym.len() {
            heap.extend(candidate(&sym, i));
        }
        while let Some(Reverse((_, i, left, right))) = heap.pop() {
            // Stale: the left symbol merged into its neighbour, or either side changed.
            let Some(j) = sym[i].next.filter(|_| sym[i].alive && sym[i].id == left) else {
                continue;
            };
            if sym[j].id != right {
                continue;
            }
            let Some(&(_, merged)) = self.merges.get(&(left, right)) else {
                continue;
            };
            sym[i].id = merged;
            sym[j].alive = false;
            sym[i].next = sym[j].next;
            if let Some(k) = sym[j].next {
                sym[k].prev = Some(i);
            }
            if let Some(p) = sym[i].prev {
                heap.extend(candidate(&sym, p));
            }
            heap.extend(candidate(&sym, i));
        }
        let mut at = Some(0);
        while let Some(i) = at {
            out.push(sym[i].id);
            at = sym[i].next;
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

/// A symbol of a piece being merged (a node of a linked list over the piece's bytes).
#[derive(Debug, Clone, Copy)]
struct Symbol {
    id: u32,
    prev: Option<usize>,
    next: Option<usize>,
    alive: bool,
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
