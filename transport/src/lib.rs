//! Duet's KV data plane.
//!
//! - [`ledger`]: the sans-IO transfer ledger: rooms, attempts with increasing keys, source and
//!   destination pins, publication only on completion, quarantine until drained. Every backend
//!   goes through it.
//!
//! - [`backend`]: the [`KvTransport`] trait (connect to a decode pool's endpoint, write runs
//!   of pages, fence) and its backends `local`, `shm` and `tcp`.
//! - [`receiver`]: decode's TCP receiver (stoppable: once stopped, nothing it accepted can
//!   land) and the grants it checks every frame against.
//! - [`shm`]: shared-memory regions (same host: the decode pool mapped by prefill).
//! - [`tcp`]: runs of bytes over one TCP connection per pair, landing in place, with fences.

pub mod backend;
pub mod bench;
pub mod ledger;
pub mod receiver;
pub mod shm;
pub mod tcp;

pub use backend::{
    Backend, ByteCopy, Endpoint, KvTransport, LocalRegistration, PageRun, TransportError, coalesce,
    connect, host_id, layer_copies, pages_crc, run_copies,
};
pub use ledger::{
    AbortReason, AttemptKey, LedgerError, Outcome, Room, Side, State, TransferLedger,
};
pub use receiver::{Grants, TcpReceiver};
