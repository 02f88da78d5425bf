//! KV over TCP between hosts: runs of pages on one connection per (prefill, decode) pair,
//! landing directly in the destination region (no intermediate buffer).
//!
//! Frames: a 24-byte header (`kind u32, attempt u64, offset u64, len u32`, little-endian) then
//! `len` payload bytes for data frames. The first frame is a hello carrying the receiver's
//! secret (handed out over the authenticated control link), so nothing else can write into a
//! pool. A fence frame is answered with one byte once every earlier frame has landed, which is
//! what lets the ledger drop pins after an abort. Where a data frame lands is the [`Sink`]'s
//! decision, made before a byte is read (the decode side checks the ledger's grants). A frame
//! of an attempt that holds no grant (decode revoked it, and the sender had not heard yet) is
//! read and dropped, and the connection goes on: the frames of live attempts queued behind it
//! on the same connection still land. Anything out of bounds, outside a live grant or unknown
//! is a typed error and ends the connection.

use std::io::{IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Frame kinds.
const DATA: u32 = 1;
const FENCE: u32 = 2;
const CLOSE: u32 = 3;
const HELLO: u32 = 4;
/// Header bytes.
const HEADER: usize = 24;
/// The fence acknowledgement.
const ACK: u8 = 0xA5;

/// The longest a sender's connect, send or fence waits without a byte moving. A fence waits
/// for one byte with nothing of its own left to send: when its peer's socket is gone and the
/// reset was lost (a host cut off, crashed or rebooted), nothing would ever arrive, and the
/// sender's lane, with every later transfer to that decode node behind it, would wait for
/// ever. Past this the connection fails like any broken one: the sender drops it and
/// reconnects for the next attempt. Nothing is freed on it: what the connection carried
/// lands only under a grant decode still holds. A decode worker that keeps reading never
/// lets it pass.
pub const STALL: Duration = Duration::from_secs(10);

/// A TCP transfer failed.
#[derive(Debug, thiserror::Error)]
pub enum TcpError {
    /// Socket error.
    #[error("kv over tcp: {0}")]
    Io(#[from] std::io::Error),
    /// A data frame outside the destination region.
    #[error("a frame of {len} bytes at {offset} does not fit the destination of {size} bytes")]
    OutOfBounds {
        /// Where.
        offset: u64,
        /// How much.
        len: u32,
        /// The destination's size.
        size: usize,
    },
    /// The first frame was not a hello with the right secret.
    #[error("the connection did not open with the receiver's secret")]
    BadHello,
    /// A data frame of an attempt that holds no grant (revoked, or never granted): its bytes
    /// are read and dropped, and the connection goes on ([`receive`] never returns it).
    #[error("attempt {attempt} holds no grant: its {len} bytes at {offset} are dropped")]
    NoGrant {
        /// The attempt.
        attempt: u64,
        /// Where.
        offset: u64,
        /// How much.
        len: u32,
    },
    /// A data frame for bytes outside its attempt's live grant.
    #[error("attempt {attempt} may not write {len} bytes at {offset}")]
    NotGranted {
        /// The attempt.
        attempt: u64,
        /// Where.
        offset: u64,
        /// How much.
        len: u32,
    },
    /// An unknown frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u32),
    /// Nothing moved on the connection for [`STALL`] (or the test's limit).
    #[error("kv over tcp: no byte moved for {0:?}; the connection is given up")]
    Stalled(Duration),
    /// A fence answered with something else.
    #[error("bad fence acknowledgement {0:#x}")]
    BadAck(u8),
}

/// The sending side of one pair's connection.
#[derive(Debug)]
pub struct TcpSender {
    stream: TcpStream,
    stall: Duration,
}

impl TcpSender {
    /// Connects to a receiver and introduces itself with the receiver's `secret`.
    pub fn connect(addr: SocketAddr, secret: u64) -> Result<TcpSender, TcpError> {
        Self::connect_with(addr, secret, STALL)
    }

    /// [`connect`](Self::connect), giving up on any wait without progress after `stall`.
    pub fn connect_with(
        addr: SocketAddr,
        secret: u64,
        stall: Duration,
    ) -> Result<TcpSender, TcpError> {
        let stalled = |e| Self::stalled(e, stall);
        let mut stream = TcpStream::connect_timeout(&addr, stall).map_err(stalled)?;
        stream.set_nodelay(true)?;
        // Each send or receive call returns an error once it has waited `stall` for a byte.
        stream.set_write_timeout(Some(stall))?;
        stream.set_read_timeout(Some(stall))?;
        stream
            .write_all(&Self::header(HELLO, secret, 0, 0))
            .map_err(stalled)?;
        Ok(TcpSender { stream, stall })
    }

    /// A socket error, naming a wait that timed out for what it is.
    fn stalled(e: std::io::Error, stall: Duration) -> TcpError {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                TcpError::Stalled(stall)
            }
            _ => TcpError::Io(e),
        }
    }

    fn header(kind: u32, attempt: u64, offset: u64, len: u32) -> [u8; HEADER] {
        let mut h = [0u8; HEADER];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[4..12].copy_from_slice(&attempt.to_le_bytes());
        h[12..20].copy_from_slice(&offset.to_le_bytes());
        h[20..24].copy_from_slice(&len.to_le_bytes());
        h
    }

    /// Sends `bytes` to land at `offset` of the destination, for `attempt`.
    pub fn write(&mut self, attempt: u64, offset: u64, bytes: &[u8]) -> Result<(), TcpError> {
        self.write_watched(attempt, offset, bytes, &mut || {})
    }

    /// [`write`](Self::write), calling `midway` once half of the first frame's payload is
    /// sent (fault hooks stop a writer there: the receiver is mid-read).
    pub fn write_watched(
        &mut self,
        attempt: u64,
        offset: u64,
        bytes: &[u8],
        midway: &mut dyn FnMut(),
    ) -> Result<(), TcpError> {
        let stall = self.stall;
        self.send(attempt, offset, bytes, midway)
            .map_err(|e| Self::stalled(e, stall))
    }

    fn send(
        &mut self,
        attempt: u64,
        offset: u64,
        bytes: &[u8],
        midway: &mut dyn FnMut(),
    ) -> std::io::Result<()> {
        for (i, chunk) in bytes.chunks(u32::MAX as usize).enumerate() {
            let at = offset + (i as u64) * u64::from(u32::MAX);
            let header = Self::header(DATA, attempt, at, chunk.len() as u32);
            // The header goes out in the same system call as the payload it heads: on its own,
            // with NODELAY set, it was a 24-byte segment per run.
            if i == 0 {
                let (first, rest) = chunk.split_at(chunk.len() / 2);
                write_all_vectored(
                    &mut self.stream,
                    &mut [IoSlice::new(&header), IoSlice::new(first)],
                )?;
                midway();
                self.stream.write_all(rest)?;
            } else {
                write_all_vectored(
                    &mut self.stream,
                    &mut [IoSlice::new(&header), IoSlice::new(chunk)],
                )?;
            }
        }
        Ok(())
    }

    /// Returns once every earlier write has landed in the destination.
    pub fn fence(&mut self, attempt: u64) -> Result<(), TcpError> {
        let stall = self.stall;
        let stalled = |e| Self::stalled(e, stall);
        self.stream
            .write_all(&Self::header(FENCE, attempt, 0, 0))
            .map_err(stalled)?;
        let mut ack = [0u8; 1];
        self.stream.read_exact(&mut ack).map_err(stalled)?;
        match ack[0] {
            ACK => Ok(()),
            other => Err(TcpError::BadAck(other)),
        }
    }

    /// Ends the connection in order.
    pub fn close(mut self) -> Result<(), TcpError> {
        let stall = self.stall;
        self.stream
            .write_all(&Self::header(CLOSE, 0, 0, 0))
            .map_err(|e| Self::stalled(e, stall))
    }
}

/// What a receiver took in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Received {
    /// Payload bytes written into the destination.
    pub bytes: u64,
    /// Data frames.
    pub frames: u64,
    /// Fences answered.
    pub fences: u64,
    /// Data frames of attempts that held no grant, read and dropped.
    pub dropped: u64,
}

/// Where data frames land.
pub trait Sink {
    /// The bytes a frame of `len` bytes at `offset` for `attempt` lands in, or why it may not.
    fn landing(&mut self, attempt: u64, offset: u64, len: u32) -> Result<&mut [u8], TcpError>;
    /// Called once the frame's read ended, after every [`landing`](Sink::landing) that
    /// succeeded: `ok` when its bytes are all in place, false when the read failed midway
    /// (some may have landed; no more will).
    fn landed(&mut self, _attempt: u64, _offset: u64, _len: u32, _ok: bool) {}
}

/// A plain buffer takes any in-bounds frame (benchmarks and tests).
impl Sink for &mut [u8] {
    fn landing(&mut self, _attempt: u64, offset: u64, len: u32) -> Result<&mut [u8], TcpError> {
        let size = self.len();
        let range = usize::try_from(offset)
            .ok()
            .and_then(|o| o.checked_add(len as usize).map(|e| o..e))
            .filter(|r| r.end <= size)
            .ok_or(TcpError::OutOfBounds { offset, len, size })?;
        Ok(&mut self[range])
    }
}

/// Writes every byte of `bufs`, in order (`Write::write_all_vectored` is not stable).
fn write_all_vectored(stream: &mut TcpStream, mut bufs: &mut [IoSlice<'_>]) -> std::io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match stream.write_vectored(bufs) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads `len` bytes of a frame that lands nowhere.
fn skip(stream: &mut TcpStream, len: u32) -> std::io::Result<()> {
    let n = std::io::copy(
        &mut Read::by_ref(stream).take(u64::from(len)),
        &mut std::io::sink(),
    )?;
    if n < u64::from(len) {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// Serves one connection, reading every data frame straight into where `sink` says, until the
/// sender closes. The connection must open with a hello carrying `secret`.
pub fn receive(
    mut stream: TcpStream,
    secret: u64,
    sink: &mut impl Sink,
) -> Result<Received, TcpError> {
    stream.set_nodelay(true)?;
    let mut got = Received::default();
    let mut h = [0u8; HEADER];
    let mut greeted = false;
    loop {
        match stream.read_exact(&mut h) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && greeted => return Ok(got),
            Err(e) => return Err(e.into()),
        }
        let word = |r: std::ops::Range<usize>| {
            let mut b = [0u8; 8];
            b[..r.len()].copy_from_slice(&h[r]);
            u64::from_le_bytes(b)
        };
        let (kind, attempt, offset, len) = (
            word(0..4) as u32,
            word(4..12),
            word(12..20),
            word(20..24) as u32,
        );
        if !greeted {
            if kind != HELLO || attempt != secret {
                return Err(TcpError::BadHello);
            }
            greeted = true;
            continue;
        }
        match kind {
            DATA => {
                let read = match sink.landing(attempt, offset, len) {
                    Ok(dst) => stream.read_exact(dst),
                    Err(TcpError::NoGrant { .. }) => {
                        skip(&mut stream, len)?;
                        got.dropped += 1;
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                sink.landed(attempt, offset, len, read.is_ok());
                read?;
                got.bytes += u64::from(len);
                got.frames += 1;
            }
            FENCE => {
                stream.write_all(&[ACK])?;
                got.fences += 1;
            }
            CLOSE => return Ok(got),
            other => return Err(TcpError::UnknownKind(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    #[test]
    fn runs_land_in_place_and_fences_wait_for_them() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let receiver = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut dest = vec![0u8; 1 << 20];
            let got = receive(stream, 42, &mut dest.as_mut_slice()).unwrap();
            (dest, got)
        });
        let mut s = TcpSender::connect(addr, 42).unwrap();
        s.write(7, 4096, &[1u8; 8192]).unwrap();
        s.write(7, 65536, &[2u8; 100]).unwrap();
        s.fence(7).unwrap();
        s.close().unwrap();
        let (dest, got) = receiver.join().unwrap();
        assert_eq!(
            got,
            Received {
                bytes: 8292,
                frames: 2,
                fences: 1,
                dropped: 0,
            }
        );
        assert!(dest[4096..12288].iter().all(|b| *b == 1));
        assert!(dest[65536..65636].iter().all(|b| *b == 2));
        assert_eq!(dest[4095], 0);
    }

    #[test]
    fn a_fence_nobody_answers_fails_after_the_stall() {
        // A peer that takes every byte and never acknowledges: a decode host whose socket
        // is gone while its reset was lost looks the same to the sender.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let silent = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut sink = Vec::new();
            let _ = stream.read_to_end(&mut sink);
        });
        let stall = Duration::from_millis(200);
        let mut s = TcpSender::connect_with(addr, 1, stall).unwrap();
        s.write(1, 0, &[3u8; 4096]).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(s.fence(1));
        });
        // Without the stall the fence would wait for ever: the deadline is what fails then.
        let r = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the fence returned");
        assert!(
            matches!(r, Err(TcpError::Stalled(d)) if d == stall),
            "{r:?}"
        );
        drop(rx);
        silent.join().unwrap();
    }

    #[test]
    fn out_of_bounds_frames_are_errors() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let receiver = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut dest = vec![0u8; 1024];
            receive(stream, 1, &mut dest.as_mut_slice())
        });
        let mut s = TcpSender::connect(addr, 1).unwrap();
        let _ = s.write(1, 1000, &[9u8; 100]);
        assert!(matches!(
            receiver.join().unwrap(),
            Err(TcpError::OutOfBounds { .. })
        ));
    }

    #[test]
    fn a_connection_without_the_secret_writes_nothing() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let receiver = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut dest = vec![0u8; 1024];
            let r = receive(stream, 7, &mut dest.as_mut_slice());
            (r, dest)
        });
        let mut s = TcpSender::connect(addr, 8).unwrap();
        let _ = s.write(1, 0, &[9u8; 100]);
        let (r, dest) = receiver.join().unwrap();
        assert!(matches!(r, Err(TcpError::BadHello)), "{r:?}");
        assert!(dest.iter().all(|b| *b == 0));
    }
}
