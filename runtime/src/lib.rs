//! Duet's cluster plumbing. It knows nothing of prompts or pages: it could run any actor system.
//!
//! A cluster is a set of node processes described by one `cluster.toml`. Each node runs a
//! ractor supervision tree and talks to its peers over QUIC links:
//!
//! ```text
//!   router ◄──────── QUIC + TLS 1.3 (pinned cluster cert, token) ────────► p0, d0
//!     │
//!     root supervisor (restart intensity per actor kind, escalation to the parent)
//!     ├─ listener      accepts peers' links, delivers envelopes to local services
//!     ├─ links/PEER    one supervised link actor per peer, reconnecting with backoff
//!     ├─ membership    heartbeats; peers up/down; events for local subscribers
//!     └─ ROLE/...      the role's actors (later: router, prefill and decode workers)
//!   admin HTTP API (loopback, bearer token): tree, kill, stop, membership, metrics
//! ```
//!
//! Modules, from the outside in:
//! - [`config`]: `cluster.toml`, validated into types that cannot hold a broken cluster.
//! - [`credentials`]: the cluster certificate, key and token.
//! - [`node`]: one node process from start to drain.
//! - [`supervisor`] and [`tree`]: restart policies, escalation, the tree as data.
//! - [`link`], [`wire`] and [`services`]: envelopes between nodes and their local delivery.
//! - [`membership`]: heartbeats and up/down events; [`roster`]: the nodes that joined.
//! - [`admin`]: the admin API and its client.
//! - [`metrics`] and [`telemetry`]: metric names, the Prometheus recorder, log setup.
//!
//! `docs/runtime-semantics.md` states the guarantees: ordering, delivery, restarts, deadlines.

pub mod admin;
pub mod config;
pub mod context;
pub mod credentials;
pub mod drain;
pub mod echo;
pub mod link;
pub mod membership;
pub mod metrics;
pub mod node;
pub mod roster;
pub mod services;
pub mod supervisor;
pub mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tree;
pub mod wire;
