//! Decode's end of the TCP backend: the [`Grants`] every frame is checked against, and the
//! [`TcpReceiver`] that accepts prefill connections and lands their frames in the pool.
//!
//! A receiver can be *stopped*: the listener closes, every connection is shut down and its
//! thread joined. Once [`TcpReceiver::stop`] returns, no frame that receiver accepted can land
//! any more: for the attempts it carried, the transport endpoint that could write is destroyed,
//! so decode may free their pages without waiting for prefill's acknowledgement. The grants
//! remember which attempts landed bytes by TCP ([`Grants::tcp_attempts`]) so decode knows
//! which attempts a stopped receiver carried (an attempt uses one backend for all its writes).

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use duet_gpu::{KvLayout, PageId, PoolMemory};

use crate::backend::{TransportError, coalesce, rand_key};
use crate::ledger::AttemptKey;
use crate::tcp::{self, Sink, TcpError};

/// How often a stopped receiver's accept loop notices: accepting polls, so stopping never
/// depends on waking a blocked `accept` (a wake-up connection can fail).
const ACCEPT_POLL: Duration = Duration::from_millis(20);

/// How long revoking waits for a frame of the attempt that is being read into the pool before
/// it shuts that frame's connection down (on loopback a frame lands in milliseconds; one that
/// takes longer has a stalled sender, and the read must end before the pages are reused).
const LANDING_GRACE: Duration = Duration::from_millis(200);

/// What an attempt may write, and whether any of it came by TCP.
#[derive(Debug)]
struct Grant {
    ranges: Vec<Range<usize>>,
    by_tcp: bool,
}

#[derive(Debug, Default)]
struct GrantTable {
    grants: HashMap<AttemptKey, Grant>,
    /// Frames being read into the pool now, by attempt: the connection each comes on.
    landing: HashMap<AttemptKey, Vec<Arc<TcpStream>>>,
}

/// The byte ranges of a decode pool that each active attempt may write, shared between the
/// decode worker (which grants when it opens an attempt and revokes once the attempt
/// completes or drains) and its TCP receiver (which checks every frame before reading it).
///
/// Revoking is the receiving side's fence: it returns only once no frame of the attempt is
/// being read into the pool, so a TCP write prefill gave up on (its connection dropped with
/// bytes still in flight) can never land in pages decode gives back afterwards. Decode revokes
/// before it releases an attempt's pages.
#[derive(Debug, Clone, Default)]
pub struct Grants(Arc<(Mutex<GrantTable>, Condvar)>);

impl Grants {
    fn lock(&self) -> MutexGuard<'_, GrantTable> {
        self.0.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lets `attempt` write `pages` of a pool of `layout`.
    pub fn grant(&self, attempt: AttemptKey, layout: &KvLayout, pages: &[PageId]) {
        let ranges = coalesce(pages.iter().map(|&p| (p, p)))
            .iter()
            .map(|r| layout.run_bytes(r.dst, r.n as usize))
            .collect();
        self.lock().grants.insert(
            attempt,
            Grant {
                ranges,
                by_tcp: false,
            },
        );
    }

    /// Takes the grant back: later frames of `attempt` are refused, and this waits until no
    /// frame of it is being read (shutting down the connection of one that stalls past
    /// [`LANDING_GRACE`]). Blocking, briefly.
    pub fn revoke(&self, attempt: AttemptKey) {
        let mut table = self.lock();
        table.grants.remove(&attempt);
        let since = Instant::now();
        let mut cut = false;
        while let Some(conns) = table.landing.get(&attempt) {
            if !cut && since.elapsed() >= LANDING_GRACE {
                tracing::warn!(
                    attempt,
                    "a frame of a revoked attempt stalled mid-read: its connection is closed"
                );
                for c in conns {
                    let _ = c.shutdown(std::net::Shutdown::Both);
                }
                cut = true;
            }
            table = match self.0.1.wait_timeout(table, Duration::from_millis(20)) {
                Ok((t, _)) => t,
                Err(p) => p.into_inner().0,
            };
        }
    }

    /// Whether `attempt` may write `len` bytes at `offset`.
    pub fn allows(&self, attempt: AttemptKey, offset: u64, len: u32) -> bool {
        Self::covers(&self.lock(), attempt, offset, len)
    }

    /// The granted attempts that have landed bytes by TCP.
    pub fn tcp_attempts(&self) -> Vec<AttemptKey> {
        let mut keys: Vec<AttemptKey> = self
            .lock()
            .grants
            .iter()
            .filter(|(_, g)| g.by_tcp)
            .map(|(k, _)| *k)
            .collect();
        keys.sort_unstable();
        keys
    }

    fn covers(table: &GrantTable, attempt: AttemptKey, offset: u64, len: u32) -> bool {
        let Ok(start) = usize::try_from(offset) else {
            return false;
        };
        let Some(end) = start.checked_add(len as usize) else {
            return false;
        };
        table
            .grants
            .get(&attempt)
            .is_some_and(|g| g.ranges.iter().any(|r| r.start <= start && end <= r.end))
    }

    /// A frame on `conn` may be read into the pool: true (and registered as landing until
    /// [`end_landing`](Self::end_landing)) when the grant covers it.
    fn begin_landing(
        &self,
        attempt: AttemptKey,
        offset: u64,
        len: u32,
        conn: &Arc<TcpStream>,
    ) -> bool {
        let mut table = self.lock();
        if !Self::covers(&table, attempt, offset, len) {
            return false;
        }
        if let Some(g) = table.grants.get_mut(&attempt) {
            g.by_tcp = true;
        }
        table.landing.entry(attempt).or_default().push(conn.clone());
        true
    }

    fn end_landing(&self, attempt: AttemptKey, conn: &Arc<TcpStream>) {
        let mut table = self.lock();
        if let Some(conns) = table.landing.get_mut(&attempt) {
            if let Some(i) = conns.iter().position(|c| Arc::ptr_eq(c, conn)) {
                conns.swap_remove(i);
            }
            if conns.is_empty() {
                table.landing.remove(&attempt);
            }
        }
        drop(table);
        self.0.1.notify_all();
    }
}

/// Lands granted frames of one connection in a pool.
struct PoolSink {
    memory: PoolMemory,
    grants: Grants,
    conn: Arc<TcpStream>,
    on_bytes: Arc<dyn Fn(u64) + Send + Sync>,
}

impl Sink for PoolSink {
    #[allow(unsafe_code)]
    fn landing(&mut self, attempt: u64, offset: u64, len: u32) -> Result<&mut [u8], TcpError> {
        let size = self.memory.len();
        let in_bounds = usize::try_from(offset)
            .ok()
            .and_then(|o| o.checked_add(len as usize))
            .is_some_and(|end| end <= size);
        if !in_bounds {
            return Err(TcpError::OutOfBounds { offset, len, size });
        }
        if !self.grants.begin_landing(attempt, offset, len, &self.conn) {
            return Err(TcpError::NotGranted {
                attempt,
                offset,
                len,
            });
        }
        // SAFETY: the range lies in pages granted to an active (or draining) attempt, and it
        // is registered as landing: decode revokes the grant before it reads, reuses or frees
        // those pages, and revoking waits for `landed`. In bounds: checked above.
        match unsafe { self.memory.slice_mut(offset as usize, len as usize) } {
            Ok(slice) => Ok(slice),
            Err(_) => {
                self.grants.end_landing(attempt, &self.conn);
                Err(TcpError::OutOfBounds { offset, len, size })
            }
        }
    }

    fn landed(&mut self, attempt: u64, _offset: u64, len: u32, ok: bool) {
        self.grants.end_landing(attempt, &self.conn);
        if ok {
            (self.on_bytes)(u64::from(len));
        }
    }
}

/// One accepted connection: a handle to shut its socket down, and the thread reading it.
struct Conn {
    socket: Arc<TcpStream>,
    thread: JoinHandle<()>,
}

/// The connections of a receiver, and whether it still takes new ones (one lock, so a
/// connection accepted as the receiver stops is either registered, and then shut down and
/// joined, or refused).
#[derive(Default)]
struct Conns {
    stopped: bool,
    open: Vec<Conn>,
}

/// Decode's TCP receiver: accepts prefill connections that open with the secret and lands
/// their granted frames in the pool, one thread per connection. Dropping it stops it.
pub struct TcpReceiver {
    addr: SocketAddr,
    secret: u64,
    conns: Arc<Mutex<Conns>>,
    accept: Option<JoinHandle<()>>,
    stop_accepting: Arc<AtomicBool>,
}

impl std::fmt::Debug for TcpReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpReceiver")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

fn lock_conns(conns: &Mutex<Conns>) -> MutexGuard<'_, Conns> {
    conns.lock().unwrap_or_else(|p| p.into_inner())
}

impl TcpReceiver {
    /// Listens on `bind` (port 0 picks one) for writers into `memory`.
    pub fn start(
        bind: SocketAddr,
        memory: PoolMemory,
        grants: Grants,
        on_bytes: Arc<dyn Fn(u64) + Send + Sync>,
    ) -> Result<TcpReceiver, TransportError> {
        let listener = TcpListener::bind(bind).map_err(TcpError::from)?;
        let addr = listener.local_addr().map_err(TcpError::from)?;
        listener.set_nonblocking(true).map_err(TcpError::from)?;
        let secret = rand_key();
        let conns = Arc::new(Mutex::new(Conns::default()));
        let stop_accepting = Arc::new(AtomicBool::new(false));
        let (flag, registry) = (stop_accepting.clone(), conns.clone());
        let accept = std::thread::Builder::new()
            .name("duet-kv-receiver".into())
            .spawn(move || {
                while !flag.load(Ordering::SeqCst) {
                    let stream = match listener.accept() {
                        Ok((stream, _)) => stream,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(ACCEPT_POLL);
                            continue;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "kv receiver: accept failed");
                            std::thread::sleep(ACCEPT_POLL);
                            continue;
                        }
                    };
                    serve(&registry, stream, secret, |conn| PoolSink {
                        memory: memory.clone(),
                        grants: grants.clone(),
                        conn,
                        on_bytes: on_bytes.clone(),
                    });
                }
            })
            .map_err(TcpError::from)?;
        Ok(TcpReceiver {
            addr,
            secret,
            conns,
            accept: Some(accept),
            stop_accepting,
        })
    }

    /// The address and secret to advertise.
    pub fn endpoint(&self) -> (SocketAddr, u64) {
        (self.addr, self.secret)
    }

    /// Connections open now.
    pub fn connections(&self) -> usize {
        let mut conns = lock_conns(&self.conns);
        conns.open.retain(|c| !c.thread.is_finished());
        conns.open.len()
    }

    /// Stops taking connections and shuts every open one down, without waiting for their
    /// threads (a frame being read may still land until [`stop`](Self::stop) joins them).
    pub fn halt(&self) {
        self.stop_accepting.store(true, Ordering::SeqCst);
        let mut conns = lock_conns(&self.conns);
        conns.stopped = true;
        for c in &conns.open {
            let _ = c.socket.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Halts, then joins every thread: when this returns, nothing this receiver accepted
    /// can write into the pool any more. Blocking (each connection ends at its next read,
    /// which the shutdown fails at once).
    pub fn stop(mut self) {
        self.join();
    }

    fn join(&mut self) {
        self.halt();
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        let open = std::mem::take(&mut lock_conns(&self.conns).open);
        for c in open {
            let _ = c.thread.join();
        }
    }
}

/// Registers and starts a connection, unless the receiver stopped meanwhile.
fn serve(
    registry: &Mutex<Conns>,
    stream: TcpStream,
    secret: u64,
    sink: impl FnOnce(Arc<TcpStream>) -> PoolSink,
) {
    // Accepted sockets may inherit the listener's non-blocking mode on some systems.
    if let Err(e) = stream.set_nonblocking(false) {
        tracing::warn!(error = %e, "kv receiver: cannot use a connection");
        return;
    }
    let socket = match stream.try_clone() {
        Ok(s) => Arc::new(s),
        Err(e) => {
            tracing::warn!(error = %e, "kv receiver: cannot use a connection");
            return;
        }
    };
    let mut conns = lock_conns(registry);
    if conns.stopped {
        return; // dropped: closed before any frame was read
    }
    conns.open.retain(|c| !c.thread.is_finished());
    let mut sink = sink(socket.clone());
    let spawned = std::thread::Builder::new()
        .name("duet-kv-conn".into())
        .spawn(move || {
            if let Err(e) = tcp::receive(stream, secret, &mut sink) {
                tracing::warn!(error = %e, "kv connection closed");
            }
            // The registry holds a duplicate of the socket: close the connection itself, or
            // the sender would wait on it (a fence) until the receiver stops.
            let _ = sink.conn.shutdown(std::net::Shutdown::Both);
        });
    match spawned {
        Ok(thread) => conns.open.push(Conn { socket, thread }),
        Err(e) => tracing::error!(error = %e, "cannot serve a kv connection"),
    }
}

impl Drop for TcpReceiver {
    fn drop(&mut self) {
        self.join();
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::TcpListener;

    use duet_gpu::KvPool;

    use super::*;
    use crate::backend::tests::{layout, receiving};
    use crate::backend::{Backend, Endpoint, connect, host_id};

    fn deadline_poll(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(std::time::Instant::now() < deadline, "timed out: {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn loopback_pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (a, l.accept().unwrap().0)
    }

    fn header(kind: u32, attempt: u64, offset: u64, len: u32) -> Vec<u8> {
        let mut h = kind.to_le_bytes().to_vec();
        h.extend(attempt.to_le_bytes());
        h.extend(offset.to_le_bytes());
        h.extend(len.to_le_bytes());
        h
    }

    #[test]
    fn revoking_waits_out_a_frame_being_read_and_cuts_one_that_stalls() {
        let (l, dst, grants, rx) = receiving(7, &[1]);
        let (addr, secret) = rx.endpoint();
        let mut s = TcpStream::connect(addr).unwrap();
        let page = l.run_bytes(1, 1);
        let half = page.len() / 2;
        s.write_all(&header(4, secret, 0, 0)).unwrap();
        s.write_all(&header(1, 7, page.start as u64, page.len() as u32))
            .unwrap();
        s.write_all(&vec![0xAB; half]).unwrap();
        deadline_poll("the frame is being read", || {
            grants.lock().landing.contains_key(&7)
        });
        let start = Instant::now();
        grants.revoke(7);
        let took = start.elapsed();
        assert!(took >= LANDING_GRACE, "revoke returned mid-frame: {took:?}");
        assert!(took < Duration::from_secs(5), "revoke hung: {took:?}");
        assert!(grants.lock().landing.is_empty());
        // The rest of the frame never lands: its connection is gone.
        let _ = s.write_all(&vec![0xCD; page.len() - half]);
        let bytes = dst.copy_bytes(page).unwrap();
        assert!(
            bytes[half..].iter().all(|b| *b != 0xCD),
            "a byte landed after revoke"
        );
    }

    #[test]
    fn grants_remember_attempts_that_landed_by_tcp() {
        let l = layout();
        let g = Grants::default();
        g.grant(1, &l, &[2, 3]);
        g.grant(2, &l, &[5]);
        let at = l.run_bytes(2, 1).start as u64;
        assert!(g.allows(1, at, 8));
        assert!(g.tcp_attempts().is_empty(), "a check alone is no landing");
        let conn = Arc::new(loopback_pair().0);
        assert!(g.begin_landing(1, at, 8, &conn));
        assert!(!g.begin_landing(2, at, 8, &conn), "outside its pages");
        assert_eq!(g.tcp_attempts(), vec![1]);
        g.end_landing(1, &conn);
        g.revoke(1);
        assert!(g.tcp_attempts().is_empty());
    }

    #[test]
    fn a_stopped_receiver_lands_nothing_more_and_closes_its_connections() {
        let (l, _dst, grants, rx) = receiving(7, &[1]);
        let endpoint = Endpoint {
            host: host_id(),
            local: None,
            shm: None,
            tcp: Some(rx.endpoint()),
        };
        let mut src = KvPool::new(l, 8).unwrap();
        src.write_token(0, 0, 0, &[1.0; 8], &[2.0; 8]);
        let runs = crate::backend::coalesce([(0, 1)]);
        let mut t = connect(&endpoint, Backend::Tcp).unwrap();
        t.write(7, &src.memory(), &l, &runs).unwrap();
        t.fence(7).unwrap();
        assert_eq!(grants.tcp_attempts(), vec![7]);
        deadline_poll("the connection is registered", || rx.connections() == 1);
        let (addr, _) = rx.endpoint();
        rx.stop();
        // Its connection is closed: the next write or fence fails instead of landing.
        let failed =
            (0..50).any(|_| t.write(7, &src.memory(), &l, &runs).is_err() || t.fence(7).is_err());
        assert!(failed, "a write through a stopped receiver succeeded");
        // And it takes no new connection.
        let refused = match std::net::TcpStream::connect(addr) {
            Err(_) => true,
            Ok(mut s) => {
                let _ = s.write_all(&[0u8; 24]);
                let mut b = [0u8; 1];
                matches!(std::io::Read::read(&mut s, &mut b), Ok(0) | Err(_))
            }
        };
        assert!(refused, "a stopped receiver accepted a connection");
    }
}
