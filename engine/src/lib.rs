//! Duet's model engine. No network in here.
pub mod chat;
pub mod fetch;
pub mod gguf;
pub mod kernels;
pub mod tokenizer;
