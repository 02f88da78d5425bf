//! The [`KvTransport`] trait and its three backends.
//!
//! A decode worker *registers* its pool: it advertises an [`Endpoint`] in its layout hello
//! (a shared-memory name, a TCP address and secret, or an in-process key). A prefill worker
//! *connects* to that endpoint ([`connect`]) and *writes runs* of pages from its pool into the
//! decode pool's pages, then *fences*: once `fence` returns, every earlier write has landed.
//! Dropping the transport is the *teardown*. Which pages a write may read or touch is the
//! ledger's business; a transport moves bytes.
//!
//! | backend | where        | how a page moves                                             |
//! |---------|--------------|--------------------------------------------------------------|
//! | `local` | same process | one memcpy from pool to pool                                 |
//! | `shm`   | same host    | one memcpy into the decode pool, mapped from `/dev/shm`      |
//! | `tcp`   | any host     | one framed run per write, read by decode straight into pages |

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{LazyLock, Mutex};

use duet_gpu::{KvLayout, PageId, PoolMemory};
use serde::{Deserialize, Serialize};

use crate::ledger::AttemptKey;
use crate::shm::{ShmError, ShmRegion};
use crate::tcp::{TcpError, TcpSender};

/// Which backend moves the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Same process.
    Local,
    /// Same host, shared memory.
    Shm,
    /// Any host, TCP.
    Tcp,
}

impl Backend {
    /// Its name in cluster.toml and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Local => "local",
            Backend::Shm => "shm",
            Backend::Tcp => "tcp",
        }
    }
}

/// Where a decode pool can be written, as its owner advertises it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    /// The host the pool lives on (shared memory works only there).
    pub host: String,
    /// The pool's in-process key (local backend; meaningful only in the same process).
    pub local: Option<u64>,
    /// The shared-memory region holding the pool.
    pub shm: Option<String>,
    /// The TCP receiver and the secret a connection must open with.
    pub tcp: Option<(SocketAddr, u64)>,
}

/// A transfer failed.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// Shared memory.
    #[error(transparent)]
    Shm(#[from] ShmError),
    /// TCP.
    #[error(transparent)]
    Tcp(#[from] TcpError),
    /// A page range outside a pool.
    #[error(transparent)]
    Pool(#[from] duet_gpu::PoolError),
    /// The endpoint does not offer the backend asked for.
    #[error("the decode endpoint offers no `{0}` backend")]
    Unavailable(&'static str),
    /// The in-process pool is gone.
    #[error("no pool is registered in this process under key {0}")]
    NoLocalPool(u64),
}

/// `n` consecutive pages from `src` in the sending pool to `dst` in the receiving pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageRun {
    /// First source page.
    pub src: PageId,
    /// First destination page.
    pub dst: PageId,
    /// Pages.
    pub n: u32,
}

/// One contiguous copy: `len` bytes at `src` in the sending pool to `dst` in the receiving one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteCopy {
    /// Source offset.
    pub src: usize,
    /// Destination offset.
    pub dst: usize,
    /// Bytes.
    pub len: usize,
}

/// The copies that move whole runs of pages.
pub fn run_copies(layout: &KvLayout, runs: &[PageRun]) -> Vec<ByteCopy> {
    runs.iter()
        .map(|r| {
            let from = layout.run_bytes(r.src, r.n as usize);
            ByteCopy {
                src: from.start,
                dst: layout.run_bytes(r.dst, r.n as usize).start,
                len: from.len(),
            }
        })
        .collect()
}

/// The copies that move one layer of every page of `runs`.
pub fn layer_copies(layout: &KvLayout, runs: &[PageRun], layer: usize) -> Vec<ByteCopy> {
    runs.iter()
        .flat_map(|r| (0..r.n).map(move |i| (r.src + i, r.dst + i)))
        .map(|(s, d)| {
            let from = layout.layer_bytes(s, layer);
            ByteCopy {
                src: from.start,
                dst: layout.layer_bytes(d, layer).start,
                len: from.len(),
            }
        })
        .collect()
}

/// Groups `(src, dst)` page pairs into runs consecutive on both sides (one copy or frame each).
pub fn coalesce(pairs: impl IntoIterator<Item = (PageId, PageId)>) -> Vec<PageRun> {
    let mut runs: Vec<PageRun> = Vec::new();
    for (src, dst) in pairs {
        match runs.last_mut() {
            Some(r) if r.src + r.n == src && r.dst + r.n == dst => r.n += 1,
            _ => runs.push(PageRun { src, dst, n: 1 }),
        }
    }
    runs
}

/// Moves runs of pages from a local pool into a remote one.
pub trait KvTransport: Send {
    /// The backend.
    fn backend(&self) -> Backend;

    /// Copies byte ranges of `attempt` from `src` into the destination pool; returns the bytes
    /// written. The caller holds source pins on the pages the ranges lie in, and the
    /// destination pages are granted to `attempt`.
    fn write_bytes(
        &mut self,
        attempt: AttemptKey,
        src: &PoolMemory,
        copies: &[ByteCopy],
    ) -> Result<u64, TransportError>;

    /// Writes whole pages: `runs` of `attempt` from `src` (one copy per run).
    fn write(
        &mut self,
        attempt: AttemptKey,
        src: &PoolMemory,
        layout: &KvLayout,
        runs: &[PageRun],
    ) -> Result<u64, TransportError> {
        self.write_bytes(attempt, src, &run_copies(layout, runs))
    }

    /// Writes one layer (K and V) of every page of `runs` (one copy per page): the last
    /// chunk's KV goes layer by layer while the later layers compute.
    fn write_layer(
        &mut self,
        attempt: AttemptKey,
        src: &PoolMemory,
        layout: &KvLayout,
        runs: &[PageRun],
        layer: usize,
    ) -> Result<u64, TransportError> {
        self.write_bytes(attempt, src, &layer_copies(layout, runs, layer))
    }

    /// Returns once every earlier write has landed in the destination.
    fn fence(&mut self, attempt: AttemptKey) -> Result<(), TransportError>;

    /// Writes `bytes` at `dst` of the destination: fault injection only (a corrupted run, to
    /// prove decode's checksum catches it).
    fn inject(
        &mut self,
        attempt: AttemptKey,
        dst: usize,
        bytes: &[u8],
    ) -> Result<(), TransportError>;
}

/// CRC-32 of whole pages of a pool, in the order given (what prefill sends and decode checks
/// before it publishes a transfer).
pub fn pages_crc(
    memory: &PoolMemory,
    layout: &KvLayout,
    pages: &[PageId],
) -> Result<u32, TransportError> {
    let mut h = crc32fast::Hasher::new();
    for r in coalesce(pages.iter().map(|&p| (p, p))) {
        let range = layout.run_bytes(r.src, r.n as usize);
        // SAFETY: the caller holds the pages (source pins on prefill; on decode, a completed
        // attempt's pages that nothing writes any more).
        #[allow(unsafe_code)]
        let bytes = unsafe { memory.slice(range.start, range.len())? };
        h.update(bytes);
    }
    Ok(h.finalize())
}

/// Connects to `endpoint` with `backend`.
pub fn connect(
    endpoint: &Endpoint,
    backend: Backend,
) -> Result<Box<dyn KvTransport>, TransportError> {
    Ok(match backend {
        Backend::Local => {
            let key = endpoint.local.ok_or(TransportError::Unavailable("local"))?;
            let dst = local_pools()
                .get(&key)
                .cloned()
                .ok_or(TransportError::NoLocalPool(key))?;
            Box::new(LocalTransport { dst })
        }
        Backend::Shm => {
            let name = endpoint
                .shm
                .as_deref()
                .ok_or(TransportError::Unavailable("shm"))?;
            Box::new(ShmTransport {
                dst: ShmRegion::open(name)?,
            })
        }
        Backend::Tcp => {
            let (addr, secret) = endpoint.tcp.ok_or(TransportError::Unavailable("tcp"))?;
            Box::new(TcpTransport {
                sender: TcpSender::connect(addr, secret)?,
            })
        }
    })
}

/// The source bytes of a copy.
///
/// # Safety
///
/// The caller holds source pins on the pages the range lies in, and the engine does not write
/// the range meanwhile (a finished layer of a page, or a finished page).
#[allow(unsafe_code)]
unsafe fn source<'a>(src: &'a PoolMemory, c: &ByteCopy) -> Result<&'a [u8], TransportError> {
    // SAFETY: the caller's promise.
    Ok(unsafe { src.slice(c.src, c.len)? })
}

/// Same process: pool to pool.
struct LocalTransport {
    dst: PoolMemory,
}

impl KvTransport for LocalTransport {
    fn backend(&self) -> Backend {
        Backend::Local
    }

    #[allow(unsafe_code)]
    fn write_bytes(
        &mut self,
        _attempt: AttemptKey,
        src: &PoolMemory,
        copies: &[ByteCopy],
    ) -> Result<u64, TransportError> {
        let mut bytes = 0;
        for c in copies {
            // SAFETY: source pins (the trait's contract); the destination pages are granted to
            // this attempt, which decode does not read before publication.
            let (from, to) = unsafe { (source(src, c)?, self.dst.slice_mut(c.dst, c.len)?) };
            to.copy_from_slice(from);
            bytes += c.len as u64;
        }
        Ok(bytes)
    }

    fn fence(&mut self, _attempt: AttemptKey) -> Result<(), TransportError> {
        Ok(()) // copies are synchronous
    }

    #[allow(unsafe_code)]
    fn inject(&mut self, _: AttemptKey, dst: usize, bytes: &[u8]) -> Result<(), TransportError> {
        // SAFETY: fault injection into a granted destination range, like a write.
        unsafe { self.dst.slice_mut(dst, bytes.len())? }.copy_from_slice(bytes);
        Ok(())
    }
}

/// Same host: into the decode pool's shared-memory region.
struct ShmTransport {
    dst: ShmRegion,
}

impl KvTransport for ShmTransport {
    fn backend(&self) -> Backend {
        Backend::Shm
    }

    #[allow(unsafe_code)]
    fn write_bytes(
        &mut self,
        _attempt: AttemptKey,
        src: &PoolMemory,
        copies: &[ByteCopy],
    ) -> Result<u64, TransportError> {
        let mut bytes = 0;
        for c in copies {
            // SAFETY: source pins (the trait's contract).
            let from = unsafe { source(src, c)? };
            self.dst.write(c.dst, from)?;
            bytes += c.len as u64;
        }
        Ok(bytes)
    }

    fn fence(&mut self, _attempt: AttemptKey) -> Result<(), TransportError> {
        // The copies are done when `write` returns; the control message that follows them
        // (over the link) is ordered after them by the happens-before of the syscall.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    fn inject(&mut self, _: AttemptKey, dst: usize, bytes: &[u8]) -> Result<(), TransportError> {
        Ok(self.dst.write(dst, bytes)?)
    }
}

/// Any host: framed runs over one connection.
struct TcpTransport {
    sender: TcpSender,
}

impl KvTransport for TcpTransport {
    fn backend(&self) -> Backend {
        Backend::Tcp
    }

    #[allow(unsafe_code)]
    fn write_bytes(
        &mut self,
        attempt: AttemptKey,
        src: &PoolMemory,
        copies: &[ByteCopy],
    ) -> Result<u64, TransportError> {
        let mut bytes = 0;
        for c in copies {
            // SAFETY: source pins (the trait's contract).
            let from = unsafe { source(src, c)? };
            self.sender.write(attempt, c.dst as u64, from)?;
            bytes += c.len as u64;
        }
        Ok(bytes)
    }

    fn fence(&mut self, attempt: AttemptKey) -> Result<(), TransportError> {
        Ok(self.sender.fence(attempt)?)
    }

    fn inject(
        &mut self,
        attempt: AttemptKey,
        dst: usize,
        bytes: &[u8],
    ) -> Result<(), TransportError> {
        Ok(self.sender.write(attempt, dst as u64, bytes)?)
    }
}

fn local_pools() -> std::sync::MutexGuard<'static, HashMap<u64, PoolMemory>> {
    static POOLS: LazyLock<Mutex<HashMap<u64, PoolMemory>>> = LazyLock::new(Default::default);
    POOLS.lock().unwrap_or_else(|p| p.into_inner())
}

/// A pool registered for in-process writers; unregistered on drop.
#[derive(Debug)]
pub struct LocalRegistration(u64);

impl LocalRegistration {
    /// Registers `memory` under a fresh key.
    pub fn new(memory: PoolMemory) -> LocalRegistration {
        let mut pools = local_pools();
        let mut key = rand_key();
        while pools.contains_key(&key) {
            key = rand_key();
        }
        pools.insert(key, memory);
        LocalRegistration(key)
    }

    /// The key writers connect with.
    pub fn key(&self) -> u64 {
        self.0
    }
}

impl Drop for LocalRegistration {
    fn drop(&mut self) {
        local_pools().remove(&self.0);
    }
}

pub(crate) fn rand_key() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}

/// This host's identity, for choosing shared memory when both sides share it.
pub fn host_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let name = std::fs::read_to_string("/etc/hostname").unwrap_or_default();
    format!("{}/{}", name.trim(), boot.trim())
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Arc;

    use duet_gpu::{KvDtype, KvPool};

    use super::*;
    use crate::receiver::{Grants, TcpReceiver};

    /// A small layout for transport tests.
    pub(crate) fn layout() -> KvLayout {
        KvLayout {
            n_layers: 2,
            n_kv_heads: 1,
            head_dim: 8,
            page_size: 4,
            dtype: KvDtype::F32,
        }
    }

    /// A receiver into an 8-page pool where `attempt` may write `pages`.
    pub(crate) fn receiving(
        attempt: AttemptKey,
        pages: &[PageId],
    ) -> (KvLayout, KvPool, Grants, TcpReceiver) {
        let l = layout();
        let dst = KvPool::new(l, 8).unwrap();
        let grants = Grants::default();
        grants.grant(attempt, &l, pages);
        let rx = TcpReceiver::start(
            "127.0.0.1:0".parse().unwrap(),
            dst.memory(),
            grants.clone(),
            Arc::new(|_| {}),
        )
        .unwrap();
        (l, dst, grants, rx)
    }

    #[test]
    fn runs_are_consecutive_on_both_sides() {
        let runs = coalesce([(1, 7), (2, 8), (3, 9), (5, 10), (6, 2)]);
        assert_eq!(
            runs,
            vec![
                PageRun {
                    src: 1,
                    dst: 7,
                    n: 3
                },
                PageRun {
                    src: 5,
                    dst: 10,
                    n: 1
                },
                PageRun {
                    src: 6,
                    dst: 2,
                    n: 1
                },
            ]
        );
    }

    fn filled(l: KvLayout) -> KvPool {
        let mut src = KvPool::new(l, 8).unwrap();
        for page in 0..8 {
            for slot in 0..4 {
                let x = (page * 10 + slot) as f32;
                src.write_token(page, 1, slot as usize, &[x; 8], &[-x; 8]);
            }
        }
        src
    }

    fn check_backend(backend: Backend, dst: &KvPool, endpoint: &Endpoint) {
        let l = layout();
        let src = filled(l);
        let mut t = connect(endpoint, backend).unwrap();
        let runs = coalesce([(2, 5), (3, 6), (7, 0)]);
        let n = t.write(9, &src.memory(), &l, &runs).unwrap();
        t.fence(9).unwrap();
        assert_eq!(n as usize, 3 * l.page_bytes());
        for (s, d) in [(2, 5), (3, 6), (7, 0)] {
            let want = src.copy_bytes(l.run_bytes(s, 1)).unwrap();
            assert_eq!(
                dst.copy_bytes(l.run_bytes(d, 1)).unwrap(),
                want,
                "{backend:?}"
            );
        }
        assert!(
            dst.copy_bytes(l.run_bytes(1, 1))
                .unwrap()
                .iter()
                .all(|b| *b == 0)
        );
    }

    #[test]
    fn layer_by_layer_writes_make_whole_pages() {
        let l = layout();
        let src = filled(l);
        let dst = KvPool::new(l, 8).unwrap();
        let reg = LocalRegistration::new(dst.memory());
        let endpoint = Endpoint {
            host: host_id(),
            local: Some(reg.key()),
            shm: None,
            tcp: None,
        };
        let mut t = connect(&endpoint, Backend::Local).unwrap();
        let runs = coalesce([(2, 5), (3, 6)]);
        let mut bytes = 0;
        for layer in 0..l.n_layers {
            bytes += t.write_layer(1, &src.memory(), &l, &runs, layer).unwrap();
        }
        assert_eq!(bytes as usize, 2 * l.page_bytes());
        for (s, d) in [(2, 5), (3, 6)] {
            assert_eq!(
                dst.copy_bytes(l.run_bytes(d, 1)).unwrap(),
                src.copy_bytes(l.run_bytes(s, 1)).unwrap()
            );
        }
    }

    #[test]
    fn every_backend_lands_runs_in_the_destination_pages() {
        let l = layout();
        // local
        let dst = KvPool::new(l, 8).unwrap();
        let reg = LocalRegistration::new(dst.memory());
        let endpoint = Endpoint {
            host: host_id(),
            local: Some(reg.key()),
            shm: None,
            tcp: None,
        };
        check_backend(Backend::Local, &dst, &endpoint);
        assert!(matches!(
            connect(&endpoint, Backend::Shm),
            Err(TransportError::Unavailable("shm"))
        ));
        drop(reg);
        assert!(matches!(
            connect(&endpoint, Backend::Local),
            Err(TransportError::NoLocalPool(_))
        ));

        // shm
        let name = format!("backend-test-{}", std::process::id());
        let region = ShmRegion::create(&name, l.page_bytes() * 8).unwrap();
        let dst = KvPool::with_memory(l, 8, Arc::new(region)).unwrap();
        let endpoint = Endpoint {
            host: host_id(),
            local: None,
            shm: Some(name),
            tcp: None,
        };
        check_backend(Backend::Shm, &dst, &endpoint);

        // tcp, with grants
        let (_, dst, _grants, rx) = receiving(9, &[5, 6, 0]);
        let endpoint = Endpoint {
            host: host_id(),
            local: None,
            shm: None,
            tcp: Some(rx.endpoint()),
        };
        check_backend(Backend::Tcp, &dst, &endpoint);

        // A write outside the grant closes the connection and lands nothing.
        let src = filled(l);
        let mut t = connect(&endpoint, Backend::Tcp).unwrap();
        let runs = coalesce([(2, 3)]);
        let _ = t.write(9, &src.memory(), &l, &runs);
        assert!(t.fence(9).is_err(), "the receiver hangs up");
        assert!(
            dst.copy_bytes(l.run_bytes(3, 1))
                .unwrap()
                .iter()
                .all(|b| *b == 0)
        );
    }
}
