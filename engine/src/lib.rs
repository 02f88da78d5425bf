//! Duet's model engine. No network in here.
pub mod gguf;
