//! Decode's end of the TCP backend: the [`TcpReceiver`] that accepts prefill connections and
//! lands their frames in the pool, each checked against the [`Grants`] first.
//!
//! A receiver can be *stopped*: the listener closes, every connection is shut down and its
//! thread joined. Once [`TcpReceiver::stop`] returns, no frame that receiver accepted can land
//! any more: for the attempts it carried, the transport endpoint that could write is destroyed,
//! so decode may free their pages without waiting for prefill's acknowledgement. The grants
//! remember which attempts landed bytes by TCP ([`Grants::tcp_attempts`]) so decode knows
//! which attempts a stopped receiver carried (an attempt uses one backend for all its writes).

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use duet_gpu::PoolMemory;

use crate::backend::{TransportError, rand_key};
use crate::grants::{Grants, Landing};
use crate::ledger::AttemptKey;
use crate::tcp::{self, Sink, TcpError};

/// How often a stopped receiver's accept loop notices: accepting polls, so stopping never
/// depends on waking a blocked `accept` (a wake-up connection can fail).
const ACCEPT_POLL: Duration = Duration::from_millis(20);

/// What a receiver tells its owner about each granted frame (metrics, the transfer history).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameEvent {
    /// A granted frame starts landing: bytes of it may be in the pool from now on.
    Landing {
        /// Its attempt.
        attempt: AttemptKey,
        /// Where in the pool.
        offset: u64,
        /// Its bytes.
        len: u32,
    },
    /// Its read ended (told before a revoke waiting for it can return): every byte landed
    /// (`ok`), or the read failed midway and no more of it will.
    Landed {
        /// Its attempt.
        attempt: AttemptKey,
        /// Where in the pool.
        offset: u64,
        /// Its bytes.
        len: u32,
        /// Whether all of them landed.
        ok: bool,
    },
    /// A frame of an attempt that holds no grant (revoked before the sender heard): read
    /// and dropped, nothing of it lands.
    Dropped {
        /// Its attempt.
        attempt: AttemptKey,
        /// Where in the pool it was meant for.
        offset: u64,
        /// Its bytes.
        len: u32,
    },
}

/// Told every [`FrameEvent`] of a receiver.
pub type FrameObserver = Arc<dyn Fn(FrameEvent) + Send + Sync>;

/// Lands granted frames of one connection in a pool.
struct PoolSink {
    memory: PoolMemory,
    grants: Grants,
    conn: Arc<TcpStream>,
    on_frame: FrameObserver,
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
        match self.grants.begin_landing(attempt, offset, len, &self.conn) {
            Landing::Granted => {}
            Landing::NoGrant => {
                // Decode revoked it while the sender, not told yet, kept writing: a race, not
                // an attack (the sender knew the secret). The frame is dropped and the
                // connection kept, so the live attempts behind it still land.
                (self.on_frame)(FrameEvent::Dropped {
                    attempt,
                    offset,
                    len,
                });
                return Err(TcpError::NoGrant {
                    attempt,
                    offset,
                    len,
                });
            }
            Landing::OutsideGrant => {
                return Err(TcpError::NotGranted {
                    attempt,
                    offset,
                    len,
                });
            }
        }
        // SAFETY: the range lies in pages granted to an active (or draining) attempt, and it
        // is registered as landing: decode revokes the grant before it reads, reuses or frees
        // those pages, and revoking waits for `landed`. In bounds: checked above.
        match unsafe { self.memory.slice_mut(offset as usize, len as usize) } {
            Ok(slice) => {
                (self.on_frame)(FrameEvent::Landing {
                    attempt,
                    offset,
                    len,
                });
                Ok(slice)
            }
            Err(_) => {
                self.grants.end_landing(attempt, &self.conn);
                Err(TcpError::OutOfBounds { offset, len, size })
            }
        }
    }

    fn landed(&mut self, attempt: u64, offset: u64, len: u32, ok: bool) {
        (self.on_frame)(FrameEvent::Landed {
            attempt,
            offset,
            len,
            ok,
        });
        self.grants.end_landing(attempt, &self.conn);
    }
}

/// One accepted connection: a handle to shut its socket down, and the thread reading it.
///
/// The handle is weak: a connection that ended (an error, the sender closed) is closed with
/// its thread, not kept open until the next accept prunes it. A connection ended with bytes
/// unread is then reset, so a sender blocked on a full window fails at once instead of
/// waiting out its stall (it would hold up its lane, and every transfer to this node behind
/// it, for that long).
struct Conn {
    socket: Weak<TcpStream>,
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
    /// Listens on `bind` (port 0 picks one) for writers into `memory`, telling `on_frame`
    /// of every granted frame.
    pub fn start(
        bind: SocketAddr,
        memory: PoolMemory,
        grants: Grants,
        on_frame: FrameObserver,
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
                        on_frame: on_frame.clone(),
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
            if let Some(socket) = c.socket.upgrade() {
                let _ = socket.shutdown(std::net::Shutdown::Both);
            }
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
            // The socket closes as the thread ends: its sink holds the last handle (a revoke
            // holds one only while a frame lands). A shutdown first would send a FIN; a close
            // with bytes left unread sends the reset a blocked sender needs.
            drop(sink);
        });
    let socket = Arc::downgrade(&socket);
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
pub(crate) mod tests {
    use std::io::Write;

    use duet_gpu::KvPool;

    use super::*;
    use crate::backend::tests::receiving;
    use crate::backend::{Backend, Endpoint, connect, host_id, unwatched};
    use crate::claims::WriteGrant;

    pub(crate) fn deadline_poll(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(std::time::Instant::now() < deadline, "timed out: {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// A source pool with one token in page 0, and a TCP transport into `rx`.
    fn writer(rx: &TcpReceiver) -> (KvPool, Box<dyn crate::backend::KvTransport>) {
        let endpoint = Endpoint {
            host: host_id(),
            local: None,
            shm: None,
            claims: None,
            tcp: Some(rx.endpoint()),
        };
        let mut src = KvPool::new(crate::backend::tests::layout(), 8).unwrap();
        src.write_token(0, 0, 0, &[1.0; 8], &[2.0; 8]);
        (src, connect(&endpoint, Backend::Tcp).unwrap())
    }

    #[test]
    fn a_revoked_attempts_frames_are_dropped_and_the_live_ones_behind_them_land() {
        let (l, dst, grants, rx) = receiving(7, &[1]);
        grants.grant(9, &l, &[2]);
        assert_eq!(grants.revoke(9), crate::claims::Revocation::Proven);
        let (src, mut t) = writer(&rx);
        // The sender has not heard of the revoke: attempt 9 writes on, then attempt 7.
        for (attempt, dst_page) in [(9, 2), (7, 1)] {
            let runs = crate::backend::coalesce([(0, dst_page)]);
            let grant = WriteGrant::unslotted(attempt);
            t.write(grant, &src.memory(), &l, &runs, &mut unwatched)
                .unwrap();
        }
        t.fence(7)
            .expect("the connection carried on past the dropped frames");
        let landed = |page| dst.copy_bytes(l.run_bytes(page, 1)).unwrap();
        assert_eq!(landed(1), src.copy_bytes(l.run_bytes(0, 1)).unwrap());
        assert!(landed(2).iter().all(|b| *b == 0), "a revoked frame landed");
        assert_eq!(grants.tcp_attempts(), vec![7]);
    }

    #[test]
    fn a_connection_ended_with_bytes_unread_is_reset() {
        // A frame outside its attempt's grant ends the connection with its payload unread. A
        // sender blocked on a full window would see no reset from a socket that was only shut
        // down (nothing new reaches it), and would wait out its stall.
        let (l, _dst, _grants, rx) = receiving(7, &[1]);
        let (addr, secret) = rx.endpoint();
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let mut frame = crate::grants::tests::header(4, secret, 0, 0);
        let page = l.run_bytes(3, 1);
        frame.extend(crate::grants::tests::header(1, 7, page.start as u64, 4096));
        frame.extend(vec![0xAB; 4096]);
        s.write_all(&frame).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut b = [0u8; 1];
        let got = std::io::Read::read(&mut s, &mut b);
        assert!(
            matches!(&got, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
            "{got:?}"
        );
    }

    #[test]
    fn a_stopped_receiver_lands_nothing_more_and_closes_its_connections() {
        let (l, _dst, grants, rx) = receiving(7, &[1]);
        let (src, mut t) = writer(&rx);
        let runs = crate::backend::coalesce([(0, 1)]);
        let grant = WriteGrant::unslotted(7);
        t.write(grant, &src.memory(), &l, &runs, &mut unwatched)
            .unwrap();
        t.fence(7).unwrap();
        assert_eq!(grants.tcp_attempts(), vec![7]);
        deadline_poll("the connection is registered", || rx.connections() == 1);
        let (addr, _) = rx.endpoint();
        rx.stop();
        // Its connection is closed: the next write or fence fails instead of landing.
        let failed = (0..50).any(|_| {
            t.write(grant, &src.memory(), &l, &runs, &mut unwatched)
                .is_err()
                || t.fence(7).is_err()
        });
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
