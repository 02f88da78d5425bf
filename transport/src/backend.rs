//! The [`KvTransport`] trait and its three backends.
//!
//! A decode worker *registers* its pool: it advertises an [`Endpoint`] in its layout hello
//! (a shared-memory name and its claim table, a TCP address and secret, or an in-process key).
//! A prefill worker *connects* to that endpoint ([`connect`]) and *writes runs* of pages from
//! its pool into the decode pool's pages, then *fences*: once `fence` returns, every earlier
//! write has landed. Dropping the transport is the *teardown*. Which pages a write may read or
//! touch is the ledger's business; every write carries the attempt's [`WriteGrant`], which
//! decode can revoke (see [`crate::grants`]): a transport moves bytes only under a live grant.
//!
//! | backend | where        | how a page moves                                   | grant checked |
//! |---------|--------------|----------------------------------------------------|---------------|
//! | `local` | same process | one memcpy from pool to pool                       | claim slot    |
//! | `shm`   | same host    | one memcpy into the decode pool (`/dev/shm`)       | claim slot    |
//! | `tcp`   | any host     | one framed run per write, read straight into pages | every frame   |

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{LazyLock, Mutex};

use duet_gpu::{KvLayout, PageId, PoolMemory};
use serde::{Deserialize, Serialize};

use crate::claims::{ClaimError, ClaimTable, WriteGrant};
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
    /// Any host on one RDMA fabric: RDMA WRITE into decode's registered pool (see
    /// [`crate::rdma`]).
    Rdma,
}

impl Backend {
    /// Its name in cluster.toml and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Local => "local",
            Backend::Shm => "shm",
            Backend::Tcp => "tcp",
            Backend::Rdma => "rdma",
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
    /// The claim table a writer that maps the pool (`shm`, `local`) claims each run in.
    #[serde(default)]
    pub claims: Option<String>,
    /// The TCP receiver and the secret a connection must open with.
    pub tcp: Option<(SocketAddr, u64)>,
}

/// A transfer failed.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// Shared memory.
    #[error(transparent)]
    Shm(#[from] ShmError),
    /// A write claim (refused once decode revoked the grant: nothing was written).
    #[error(transparent)]
    Claim(#[from] ClaimError),
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

/// Where a write stands, told to the caller's watcher while the write runs: the transfer
/// history records when bytes may start landing and when they all have, and fault hooks pause
/// a writer mid-copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteStage {
    /// The grant was checked and holds until [`Copied`](WriteStage::Copied) (a claim is held,
    /// or the first frame is about to go): bytes may land from here on.
    Started,
    /// About half of the first copy is out (for TCP: a frame half sent).
    Midway,
    /// Every byte is copied (`shm`, `local`) or handed to the socket (`tcp`); a claim is still
    /// held.
    Copied,
}

/// A watcher that ignores every stage.
pub fn unwatched(_: WriteStage) {}

/// Moves runs of pages from a local pool into a remote one.
pub trait KvTransport: Send {
    /// The backend.
    fn backend(&self) -> Backend;

    /// Copies byte ranges from `src` into the destination pool under `grant`; returns the
    /// bytes written. The caller holds source pins on the pages the ranges lie in. Refused,
    /// with nothing written, once decode revoked the grant (`shm`, `local`: before the first
    /// byte; `tcp`: decode closes the connection at the first refused frame).
    fn write_bytes(
        &mut self,
        grant: WriteGrant,
        src: &PoolMemory,
        copies: &[ByteCopy],
        watch: &mut dyn FnMut(WriteStage),
    ) -> Result<u64, TransportError>;

    /// Writes whole pages: `runs` from `src` (one copy per run).
    fn write(
        &mut self,
        grant: WriteGrant,
        src: &PoolMemory,
        layout: &KvLayout,
        runs: &[PageRun],
        watch: &mut dyn FnMut(WriteStage),
    ) -> Result<u64, TransportError> {
        self.write_bytes(grant, src, &run_copies(layout, runs), watch)
    }

    /// Writes one layer (K and V) of every page of `runs` (one copy per page): the last
    /// chunk's KV goes layer by layer while the later layers compute.
    fn write_layer(
        &mut self,
        grant: WriteGrant,
        src: &PoolMemory,
        layout: &KvLayout,
        runs: &[PageRun],
        layer: usize,
        watch: &mut dyn FnMut(WriteStage),
    ) -> Result<u64, TransportError> {
        self.write_bytes(grant, src, &layer_copies(layout, runs, layer), watch)
    }

    /// Returns once every earlier write has landed in the destination.
    fn fence(&mut self, attempt: AttemptKey) -> Result<(), TransportError>;

    /// Writes `bytes` at `dst` of the destination under `grant`: fault injection only (a
    /// corrupted run, to prove decode's checksum catches it).
    fn inject(&mut self, grant: WriteGrant, dst: usize, bytes: &[u8])
    -> Result<(), TransportError>;
}

/// CRC-32 of whole pages of a pool, in the order given (what prefill sends and decode checks
/// before it publishes a transfer).
pub fn pages_crc(
    memory: &PoolMemory,
    layout: &KvLayout,
    pages: &[PageId],
) -> Result<u32, TransportError> {
    let mut crc = PagesCrc::default();
    crc.update(memory, layout, pages)?;
    Ok(crc.finish())
}

/// A [`pages_crc`] taken a few pages at a time: decode checks a long transfer's pages over
/// several turns so that no engine step waits for all of them at once. The pages given to
/// successive [`PagesCrc::update`] calls, in order, hash as one [`pages_crc`] over them all.
#[derive(Debug, Clone, Default)]
pub struct PagesCrc(crc32fast::Hasher);

impl PagesCrc {
    /// Hashes `pages` after the ones given before.
    pub fn update(
        &mut self,
        memory: &PoolMemory,
        layout: &KvLayout,
        pages: &[PageId],
    ) -> Result<(), TransportError> {
        for r in coalesce(pages.iter().map(|&p| (p, p))) {
            let range = layout.run_bytes(r.src, r.n as usize);
            // SAFETY: the caller holds the pages (source pins on prefill; on decode, a
            // completed attempt's pages that nothing writes any more).
            #[allow(unsafe_code)]
            let bytes = unsafe { memory.slice(range.start, range.len())? };
            self.0.update(bytes);
        }
        Ok(())
    }

    /// The CRC-32 of every page given.
    pub fn finish(self) -> u32 {
        self.0.finalize()
    }
}

/// Connects to `endpoint` with `backend`.
pub fn connect(
    endpoint: &Endpoint,
    backend: Backend,
) -> Result<Box<dyn KvTransport>, TransportError> {
    Ok(match backend {
        Backend::Local => {
            let key = endpoint.local.ok_or(TransportError::Unavailable("local"))?;
            let claims = claim_table(endpoint, "local")?;
            let dst = local_pools()
                .get(&key)
                .cloned()
                .ok_or(TransportError::NoLocalPool(key))?;
            Box::new(LocalTransport { dst, claims })
        }
        Backend::Shm => {
            let name = endpoint
                .shm
                .as_deref()
                .ok_or(TransportError::Unavailable("shm"))?;
            Box::new(ShmTransport {
                claims: claim_table(endpoint, "shm")?,
                dst: ShmRegion::open(name)?,
            })
        }
        Backend::Tcp => {
            let (addr, secret) = endpoint.tcp.ok_or(TransportError::Unavailable("tcp"))?;
            Box::new(TcpTransport {
                sender: TcpSender::connect(addr, secret)?,
            })
        }
        // No decode endpoint advertises a registered region yet: the verbs data path waits for
        // a machine with an RDMA device to be tested on (the RDMA issue's note).
        Backend::Rdma => return Err(TransportError::Unavailable("rdma")),
    })
}

/// The claim table of an endpoint, for a backend that maps the pool (it writes only under a
/// claim decode can revoke, so an endpoint without one is not writable that way).
fn claim_table(endpoint: &Endpoint, backend: &'static str) -> Result<ClaimTable, TransportError> {
    let name = endpoint
        .claims
        .as_deref()
        .ok_or(TransportError::Unavailable(backend))?;
    Ok(ClaimTable::open(name)?)
}

/// Copies `copies` from `src` with `put(dst offset, bytes)`, telling `watch` each stage
/// (the first copy goes in two halves, with [`WriteStage::Midway`] between them).
fn copy_watched(
    src: &PoolMemory,
    copies: &[ByteCopy],
    watch: &mut dyn FnMut(WriteStage),
    mut put: impl FnMut(usize, &[u8]) -> Result<(), TransportError>,
) -> Result<u64, TransportError> {
    watch(WriteStage::Started);
    let mut bytes = 0;
    for (i, c) in copies.iter().enumerate() {
        // SAFETY: source pins (the trait's contract).
        #[allow(unsafe_code)]
        let from = unsafe { source(src, c)? };
        let half = if i == 0 { from.len() / 2 } else { 0 };
        if i == 0 {
            put(c.dst, &from[..half])?;
            watch(WriteStage::Midway);
        }
        put(c.dst + half, &from[half..])?;
        bytes += c.len as u64;
    }
    watch(WriteStage::Copied);
    Ok(bytes)
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

/// Same process: pool to pool, each run under a claim of the attempt's slot.
struct LocalTransport {
    dst: PoolMemory,
    claims: ClaimTable,
}

impl LocalTransport {
    #[allow(unsafe_code)]
    fn put(&self, dst: usize, bytes: &[u8]) -> Result<(), TransportError> {
        // SAFETY: the destination range lies in pages granted to the attempt whose claim the
        // caller holds; decode reads them only after it revoked the grant (proven: no claim
        // held), and reuses them only after that too.
        unsafe { self.dst.slice_mut(dst, bytes.len())? }.copy_from_slice(bytes);
        Ok(())
    }
}

impl KvTransport for LocalTransport {
    fn backend(&self) -> Backend {
        Backend::Local
    }

    fn write_bytes(
        &mut self,
        grant: WriteGrant,
        src: &PoolMemory,
        copies: &[ByteCopy],
        watch: &mut dyn FnMut(WriteStage),
    ) -> Result<u64, TransportError> {
        let _claim = self.claims.claim(grant)?;
        copy_watched(src, copies, watch, |dst, bytes| self.put(dst, bytes))
    }

    fn fence(&mut self, _attempt: AttemptKey) -> Result<(), TransportError> {
        Ok(()) // copies are synchronous
    }

    fn inject(
        &mut self,
        grant: WriteGrant,
        dst: usize,
        bytes: &[u8],
    ) -> Result<(), TransportError> {
        let _claim = self.claims.claim(grant)?;
        self.put(dst, bytes)
    }
}

/// Same host: into the decode pool's shared-memory region, each run under a claim of the
/// attempt's slot.
struct ShmTransport {
    dst: ShmRegion,
    claims: ClaimTable,
}

impl KvTransport for ShmTransport {
    fn backend(&self) -> Backend {
        Backend::Shm
    }

    fn write_bytes(
        &mut self,
        grant: WriteGrant,
        src: &PoolMemory,
        copies: &[ByteCopy],
        watch: &mut dyn FnMut(WriteStage),
    ) -> Result<u64, TransportError> {
        let _claim = self.claims.claim(grant)?;
        let dst = &mut self.dst;
        copy_watched(src, copies, watch, |at, bytes| Ok(dst.write(at, bytes)?))
    }

    fn fence(&mut self, _attempt: AttemptKey) -> Result<(), TransportError> {
        // The copies are done when `write` returns; the control message that follows them
        // (over the link) is ordered after them by the happens-before of the syscall.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    fn inject(
        &mut self,
        grant: WriteGrant,
        dst: usize,
        bytes: &[u8],
    ) -> Result<(), TransportError> {
        let _claim = self.claims.claim(grant)?;
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
        grant: WriteGrant,
        src: &PoolMemory,
        copies: &[ByteCopy],
        watch: &mut dyn FnMut(WriteStage),
    ) -> Result<u64, TransportError> {
        watch(WriteStage::Started);
        let mut bytes = 0;
        for (i, c) in copies.iter().enumerate() {
            // SAFETY: source pins (the trait's contract).
            let from = unsafe { source(src, c)? };
            if i == 0 {
                let midway = &mut || watch(WriteStage::Midway);
                self.sender
                    .write_watched(grant.attempt, c.dst as u64, from, midway)?;
            } else {
                self.sender.write(grant.attempt, c.dst as u64, from)?;
            }
            bytes += c.len as u64;
        }
        watch(WriteStage::Copied);
        Ok(bytes)
    }

    fn fence(&mut self, attempt: AttemptKey) -> Result<(), TransportError> {
        Ok(self.sender.fence(attempt)?)
    }

    fn inject(
        &mut self,
        grant: WriteGrant,
        dst: usize,
        bytes: &[u8],
    ) -> Result<(), TransportError> {
        Ok(self.sender.write(grant.attempt, dst as u64, bytes)?)
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
    use crate::claims::{ClaimError, Revocation};
    use crate::grants::Grants;
    use crate::receiver::TcpReceiver;

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

    /// Decode's grants with a claim table named after `tag`, and the table's name.
    fn claimed(tag: &str) -> (Grants, String) {
        let name = format!("backend-claims-{tag}-{}", std::process::id());
        let grants = Grants::with_claims(ClaimTable::create(&name, 8).unwrap());
        (grants, name)
    }

    fn endpoint(local: Option<u64>, shm: Option<String>, claims: Option<String>) -> Endpoint {
        Endpoint {
            host: host_id(),
            local,
            shm,
            claims,
            tcp: None,
        }
    }

    fn check_backend(backend: Backend, dst: &KvPool, endpoint: &Endpoint, grant: WriteGrant) {
        let l = layout();
        let src = filled(l);
        let mut t = connect(endpoint, backend).unwrap();
        let runs = coalesce([(2, 5), (3, 6), (7, 0)]);
        let mut stages = Vec::new();
        let n = t
            .write(grant, &src.memory(), &l, &runs, &mut |s| stages.push(s))
            .unwrap();
        t.fence(grant.attempt).unwrap();
        assert_eq!(n as usize, 3 * l.page_bytes());
        assert_eq!(
            stages,
            [WriteStage::Started, WriteStage::Midway, WriteStage::Copied],
            "{backend:?}"
        );
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
        let (grants, claims) = claimed("layers");
        let grant = grants.grant(1, &l, &[5, 6]);
        let mut t = connect(
            &endpoint(Some(reg.key()), None, Some(claims)),
            Backend::Local,
        )
        .unwrap();
        let runs = coalesce([(2, 5), (3, 6)]);
        let mut bytes = 0;
        for layer in 0..l.n_layers {
            bytes += t
                .write_layer(grant, &src.memory(), &l, &runs, layer, &mut unwatched)
                .unwrap();
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
    fn pages_hashed_a_few_at_a_time_hash_as_all_at_once() {
        let l = layout();
        let pool = filled(l);
        let memory = pool.memory();
        let pages = [5, 6, 0, 1, 7, 2];
        let whole = pages_crc(&memory, &l, &pages).unwrap();
        for cut in [vec![1, 2, 3], vec![4, 2], vec![1, 1, 1, 1, 1, 1], vec![6]] {
            let mut crc = PagesCrc::default();
            let mut at = 0;
            for n in cut {
                crc.update(&memory, &l, &pages[at..at + n]).unwrap();
                at += n;
            }
            assert_eq!(crc.finish(), whole);
        }
        // The order counts: a piece hashed out of turn is another checksum.
        let mut crc = PagesCrc::default();
        crc.update(&memory, &l, &pages[3..]).unwrap();
        crc.update(&memory, &l, &pages[..3]).unwrap();
        assert_ne!(crc.finish(), whole);
    }

    #[test]
    fn every_backend_lands_runs_in_the_destination_pages() {
        let l = layout();
        // local
        let dst = KvPool::new(l, 8).unwrap();
        let reg = LocalRegistration::new(dst.memory());
        let (grants, claims) = claimed("every-local");
        let grant = grants.grant(9, &l, &[5, 6, 0]);
        let local = endpoint(Some(reg.key()), None, Some(claims));
        check_backend(Backend::Local, &dst, &local, grant);
        assert!(matches!(
            connect(&local, Backend::Shm),
            Err(TransportError::Unavailable("shm"))
        ));
        assert!(
            matches!(
                connect(&endpoint(Some(reg.key()), None, None), Backend::Local),
                Err(TransportError::Unavailable("local"))
            ),
            "no claim table, no local writes"
        );
        drop(reg);
        assert!(matches!(
            connect(&local, Backend::Local),
            Err(TransportError::NoLocalPool(_))
        ));

        // shm
        let name = format!("backend-test-{}", std::process::id());
        let region = ShmRegion::create(&name, l.page_bytes() * 8).unwrap();
        let dst = KvPool::with_memory(l, 8, Arc::new(region)).unwrap();
        let (grants, claims) = claimed("every-shm");
        let grant = grants.grant(9, &l, &[5, 6, 0]);
        check_backend(
            Backend::Shm,
            &dst,
            &endpoint(None, Some(name), Some(claims)),
            grant,
        );

        // tcp, with grants
        let (_, dst, _grants, rx) = receiving(9, &[5, 6, 0]);
        let endpoint = Endpoint {
            tcp: Some(rx.endpoint()),
            ..endpoint(None, None, None)
        };
        check_backend(Backend::Tcp, &dst, &endpoint, WriteGrant::unslotted(9));

        // A write outside the grant closes the connection and lands nothing.
        let src = filled(l);
        let mut t = connect(&endpoint, Backend::Tcp).unwrap();
        let runs = coalesce([(2, 3)]);
        let _ = t.write(
            WriteGrant::unslotted(9),
            &src.memory(),
            &l,
            &runs,
            &mut unwatched,
        );
        assert!(t.fence(9).is_err(), "the receiver hangs up");
        assert!(
            dst.copy_bytes(l.run_bytes(3, 1))
                .unwrap()
                .iter()
                .all(|b| *b == 0)
        );
    }

    #[test]
    fn a_writer_stopped_mid_copy_keeps_its_pages_quarantined_and_then_writes_nothing_more() {
        // Decode's side and a shm writer, the writer stopped halfway through a run (as a
        // SIGSTOP would stop it): decode cannot prove the drain however often it asks; once
        // the run ends the revoke is proven, and the writer's next run lands nothing.
        let l = layout();
        let name = format!("backend-pause-{}", std::process::id());
        let region = ShmRegion::create(&name, l.page_bytes() * 8).unwrap();
        let dst = KvPool::with_memory(l, 8, Arc::new(region)).unwrap();
        let (grants, claims) = claimed("pause");
        let grant = grants.grant(3, &l, &[4, 5]);
        let src = filled(l);
        let mut t = connect(&endpoint(None, Some(name), Some(claims)), Backend::Shm).unwrap();
        let runs = coalesce([(2, 4), (3, 5)]);
        let mut asked = 0;
        t.write(grant, &src.memory(), &l, &runs, &mut |stage| {
            if stage == WriteStage::Midway {
                for _ in 0..5 {
                    assert_eq!(grants.revoke(3), Revocation::Busy, "proven mid-copy");
                    asked += 1;
                }
            }
        })
        .unwrap();
        assert_eq!(asked, 5);
        assert_eq!(grants.revoke(3), Revocation::Proven);
        // Decode reuses the pages: zero them as a new request's KV would overwrite them.
        let zero = vec![0u8; 2 * l.page_bytes()];
        let memory = dst.memory();
        // SAFETY (test): the revoke is proven, so nothing else writes these pages.
        #[allow(unsafe_code)]
        unsafe { memory.slice_mut(l.run_bytes(4, 2).start, zero.len()) }
            .unwrap()
            .copy_from_slice(&zero);
        let mut started = false;
        let late = t.write(grant, &src.memory(), &l, &runs, &mut |_| started = true);
        assert!(matches!(
            late,
            Err(TransportError::Claim(ClaimError::Revoked { attempt: 3 }))
        ));
        assert!(!started, "a refused write never starts");
        assert!(
            dst.copy_bytes(l.run_bytes(4, 2))
                .unwrap()
                .iter()
                .all(|b| *b == 0),
            "a stale write landed in reused pages"
        );
        assert!(t.inject(grant, l.run_bytes(4, 1).start, &[1]).is_err());
    }
}
