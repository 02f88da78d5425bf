//! Duet's deterministic cluster simulator.
//!
//! A run is one seed: routers, prefill and decode workers exchange the protocol's messages
//! over a simulated network (latency, loss, duplication, reordering, partitions), compute on a
//! cost model instead of the engine, and write KV that takes time to land, all on virtual time
//! from one event queue. Faults come from the same seed: nodes pause for any length, crash and
//! restart with a new incarnation, writers stall in the middle of a write, clients leave in
//! every phase. A failing seed reproduces bit for bit.
//!
//! What is real here: the transfer ledger and page allocator on every decode worker
//! (`duet-transport`, `duet-gpu`) and the router's attempt policy (`duet-actors`). The
//! workers' and router's shells around them follow the real ones message for message, but are
//! written for virtual time (the actors' engine threads still read a clock).
//!
//! ```text
//!   config.rs  cluster, load, deadlines, faults, mutations     cost.rs   the cost model
//!   world.rs   event queue, network, faults, the run loop      stats.rs  outcomes, latencies
//!   router.rs  pairing, streaming, AttemptPolicy               check.rs  the invariants
//!   prefill.rs bootstrap, chunked compute, writes              decode.rs ledger, fence, batch
//!   explore.rs many seeds; planner.rs: capacity planning at scale
//! ```
//!
//! The invariants (checked as events happen, and once the faults have stopped) are in
//! [`check`]. `cargo test -p duet-sim` runs a thousand seeds; `duet sim --explore` runs more;
//! `duet sim` without `--explore` is the capacity planner.

pub mod check;
pub mod config;
pub mod cost;
mod decode;
pub mod explore;
pub mod planner;
mod prefill;
pub mod rng;
mod router;
mod slots;
pub mod stats;
pub mod world;

pub use config::{Faults, Mutations, SimConfig};
pub use cost::CostModel;
pub use world::{Report, World};

/// Runs one seed.
pub fn run(cfg: SimConfig, seed: u64) -> Report {
    World::new(cfg, seed).run()
}
