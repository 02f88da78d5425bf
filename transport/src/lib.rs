//! Duet's KV data plane.
//!
//! - [`ledger`]: the sans-IO transfer ledger: rooms, attempts with increasing keys, source and
//!   destination pins, publication only on completion, quarantine until drained. Every backend
//!   goes through it.
//!
//! - [`shm`]: shared-memory regions (same host: the decode pool mapped by prefill).
//! - [`tcp`]: runs of bytes over one TCP connection per pair, landing in place, with fences.
//!
//! The `KvTransport` trait that puts pools behind these comes with the disaggregation actors.

pub mod ledger;
pub mod shm;
pub mod tcp;

pub use ledger::{
    AbortReason, AttemptKey, LedgerError, Outcome, Room, Side, State, TransferLedger,
};
