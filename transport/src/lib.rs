//! Duet's KV data plane.
//!
//! - [`ledger`]: the sans-IO transfer ledger: rooms, attempts with increasing keys, source and
//!   destination pins, publication only on completion, quarantine until drained. Every backend
//!   goes through it.
//!
//! The backends (`local`, `shm`, `tcp`) that move runs of pages between pools come with the
//! disaggregation work; the ledger's rules are settled first, under property tests.

pub mod ledger;

pub use ledger::{
    AbortReason, AttemptKey, LedgerError, Outcome, Room, Side, State, TransferLedger,
};
