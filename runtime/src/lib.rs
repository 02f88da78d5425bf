//! Duet's cluster plumbing. It knows nothing of prompts or pages: it could run any actor system.
//!
//! - [`config`]: `cluster.toml`, validated into types that cannot hold a broken cluster.
pub mod config;
pub mod wire;
