//! Duet's KV data plane.
//!
//! - [`ledger`]: the sans-IO transfer ledger: rooms, attempts with increasing keys, source and
//!   destination pins, publication only on completion, quarantine until drained. Every backend
//!   goes through it.
//!
//! - [`backend`]: the [`KvTransport`] trait (connect to a decode pool's endpoint, write runs
//!   of pages, fence) and its backends `local`, `shm` and `tcp`.
//! - [`grants`]: decode's grants (which attempt may write which bytes) and the revoke that
//!   proves no write of an attempt can land any more; [`claims`]: the claim table through
//!   which decode fences writers that map its pool (a paused writer can never land a stale
//!   write).
//! - [`quarantine`]: the attempts decode aborted, freed only when the fence proves no write
//!   of them can land (sans-IO; the simulator explores it).
//! - [`receiver`]: decode's TCP receiver (stoppable: once stopped, nothing it accepted can
//!   land), checking every frame against the grants.
//! - [`rdma`]: the RDMA backend's sans-IO parts (work-request planning, the queue pair's states
//!   and drain, the fallback policy) and, with the `rdma` feature, the verbs.
//! - [`shm`]: shared-memory regions (same host: the decode pool mapped by prefill).
//! - [`tcp`]: runs of bytes over one TCP connection per pair, landing in place, with fences.

pub mod backend;
#[cfg(feature = "bench")]
pub mod bench;
pub mod claims;
pub mod grants;
pub mod ledger;
pub mod quarantine;
pub mod rdma;
pub mod receiver;
pub mod shm;
pub mod tcp;

pub use backend::{
    Backend, ByteCopy, Endpoint, KvTransport, LocalRegistration, PageRun, PagesCrc, TransportError,
    WriteStage, coalesce, connect, host_id, layer_copies, pages_crc, run_copies, unwatched,
};
pub use claims::{ClaimError, ClaimTable, Revocation, WriteGrant};
pub use grants::Grants;
pub use ledger::{
    AbortReason, AttemptKey, LedgerError, Outcome, Room, Side, State, TransferLedger,
};
pub use quarantine::{Fence, Quarantine, Settle};
pub use receiver::{FrameEvent, FrameObserver, TcpReceiver};
