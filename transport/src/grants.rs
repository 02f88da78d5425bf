//! Decode's grants: which attempt may write which bytes of its pool, and the revoke that
//! proves no write of an attempt can land any more.
//!
//! Decode grants an attempt its pages when it sends the notice, and revokes the grant before
//! it publishes or releases them, on every path. Each backend enforces the grant where decode
//! controls it:
//!
//! | backend      | checked where                    | a revoke is proven once                     |
//! |--------------|----------------------------------|---------------------------------------------|
//! | `tcp`        | decode's receiver, every frame   | no frame of the attempt is being read       |
//! | `shm`,`local`| the writer, under a claim lock   | no writer holds the attempt's claim slot    |
//!
//! Neither proof involves a clock: a writer paused for any length either holds nothing (the
//! revoke is proven and its next write is refused) or holds a claim (the revoke stays
//! unproven and the pages stay quarantined until it finishes that one run or dies).

use std::collections::HashMap;
use std::net::TcpStream;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use duet_gpu::{KvLayout, PageId};

use crate::backend::coalesce;
use crate::claims::{ClaimTable, Revocation, WriteGrant};
use crate::ledger::AttemptKey;

/// How long revoking waits for a frame of the attempt that is being read into the pool before
/// it shuts that frame's connection down (on loopback a frame lands in milliseconds; one that
/// takes longer has a stalled sender, and the read must end before the pages are reused).
const LANDING_GRACE: Duration = Duration::from_millis(200);

/// What [`Grants::begin_landing`] says of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Landing {
    /// Its attempt's grant covers it: it may land (and is registered as landing).
    Granted,
    /// Its attempt holds no grant (revoked, or never granted): it lands nowhere.
    NoGrant,
    /// Its attempt holds a grant that does not cover these bytes.
    OutsideGrant,
}

/// What an attempt may write, and whether any of it came by TCP.
#[derive(Debug)]
struct Grant {
    ranges: Vec<Range<usize>>,
    by_tcp: bool,
}

impl Grant {
    /// Whether the grant covers `len` bytes at `offset`.
    fn covers(&self, offset: u64, len: u32) -> bool {
        let Ok(start) = usize::try_from(offset) else {
            return false;
        };
        let Some(end) = start.checked_add(len as usize) else {
            return false;
        };
        self.ranges.iter().any(|r| r.start <= start && end <= r.end)
    }
}

#[derive(Debug, Default)]
struct GrantTable {
    grants: HashMap<AttemptKey, Grant>,
    /// Frames being read into the pool now, by attempt: the connection each comes on.
    landing: HashMap<AttemptKey, Vec<Arc<TcpStream>>>,
    /// The claim slots of writers that map the pool (none: TCP only).
    claims: Option<Slots>,
}

/// Decode's side of a claim table: which slot each attempt holds, and the free ones.
#[derive(Debug)]
struct Slots {
    table: ClaimTable,
    free: Vec<u32>,
    /// A slot stays taken from its grant until its revoke is proven.
    held: HashMap<AttemptKey, u32>,
}

/// The byte ranges of a decode pool that each active attempt may write, shared between the
/// decode worker (which grants when it opens an attempt and revokes before the attempt's
/// pages are published or released) and its TCP receiver (which checks every frame before
/// reading it). With a [`ClaimTable`], each grant also opens a claim slot for writers that
/// map the pool.
///
/// Revoking is decode's fence over every writer: once it is [`Revocation::Proven`], no write of
/// the attempt can land. For TCP it returns only once no frame of the attempt is being read
/// into the pool, so a write prefill gave up on (its connection dropped with bytes still in
/// flight) never lands in pages decode gives back afterwards; for a claim slot it is proven
/// once no writer holds the slot.
#[derive(Debug, Clone, Default)]
pub struct Grants(Arc<(Mutex<GrantTable>, Condvar)>);

impl Grants {
    /// Grants that also open claim slots in `table` (one slot per live attempt: a table with
    /// a slot per pool page never runs short, since every attempt holds a page).
    pub fn with_claims(table: ClaimTable) -> Grants {
        let free = (0..table.slots() as u32).rev().collect();
        let grants = Grants::default();
        grants.lock().claims = Some(Slots {
            table,
            free,
            held: HashMap::new(),
        });
        grants
    }

    /// Whether grants open claim slots (writers that map the pool can be fenced).
    pub fn has_claims(&self) -> bool {
        self.lock().claims.is_some()
    }

    fn lock(&self) -> MutexGuard<'_, GrantTable> {
        self.0.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lets `attempt` write `pages` of a pool of `layout`; what to tell the writer.
    pub fn grant(&self, attempt: AttemptKey, layout: &KvLayout, pages: &[PageId]) -> WriteGrant {
        let ranges = coalesce(pages.iter().map(|&p| (p, p)))
            .iter()
            .map(|r| layout.run_bytes(r.dst, r.n as usize))
            .collect();
        let mut table = self.lock();
        table.grants.insert(
            attempt,
            Grant {
                ranges,
                by_tcp: false,
            },
        );
        let slot = table.claims.as_mut().and_then(|c| {
            let slot = c.held.get(&attempt).copied().or_else(|| c.free.pop())?;
            c.table.open_slot(slot, attempt);
            c.held.insert(attempt, slot);
            Some(slot)
        });
        if slot.is_none() && table.claims.is_some() {
            // Cannot happen with a slot per page; a writer that maps the pool is refused.
            tracing::error!(
                attempt,
                "no free claim slot: shm writes of this attempt are refused"
            );
        }
        WriteGrant { attempt, slot }
    }

    /// Takes the grant back. Later frames of `attempt` are refused, and this waits until no
    /// frame of it is being read (shutting down the connection of one that stalls past
    /// [`LANDING_GRACE`]); later claims of its slot are refused, and the revoke is proven
    /// once no writer holds the slot. [`Revocation::Busy`] while one does (it is copying a
    /// run, or paused mid-copy): ask again later; until then the pages stay quarantined.
    /// Blocking, briefly (TCP); never on a claim.
    #[must_use]
    pub fn revoke(&self, attempt: AttemptKey) -> Revocation {
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
        let Some(claims) = table.claims.as_mut() else {
            return Revocation::Proven;
        };
        let Some(&slot) = claims.held.get(&attempt) else {
            return Revocation::Proven; // never granted a slot, or already proven
        };
        match claims.table.revoke(slot, attempt) {
            Ok(Revocation::Proven) => {
                claims.held.remove(&attempt);
                claims.free.push(slot);
                Revocation::Proven
            }
            Ok(Revocation::Busy) => Revocation::Busy,
            Err(e) => {
                // Not a proof: the slot stays taken and the pages quarantined.
                tracing::error!(attempt, slot, error = %e, "cannot revoke a claim slot");
                Revocation::Busy
            }
        }
    }

    /// Whether `attempt` may write `len` bytes at `offset`.
    pub fn allows(&self, attempt: AttemptKey, offset: u64, len: u32) -> bool {
        self.lock()
            .grants
            .get(&attempt)
            .is_some_and(|g| g.covers(offset, len))
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

    /// Whether a frame on `conn` may be read into the pool: [`Landing::Granted`] (and
    /// registered as landing until [`end_landing`](Self::end_landing)) when the attempt's
    /// grant covers it.
    pub(crate) fn begin_landing(
        &self,
        attempt: AttemptKey,
        offset: u64,
        len: u32,
        conn: &Arc<TcpStream>,
    ) -> Landing {
        let mut table = self.lock();
        let Some(g) = table.grants.get_mut(&attempt) else {
            return Landing::NoGrant;
        };
        if !g.covers(offset, len) {
            return Landing::OutsideGrant;
        }
        g.by_tcp = true;
        table.landing.entry(attempt).or_default().push(conn.clone());
        Landing::Granted
    }

    pub(crate) fn end_landing(&self, attempt: AttemptKey, conn: &Arc<TcpStream>) {
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

#[cfg(test)]
pub(crate) mod tests {
    use std::io::Write;
    use std::net::TcpListener;

    use super::*;
    use crate::backend::tests::{layout, receiving};
    use crate::claims::ClaimError;
    use crate::receiver::tests::deadline_poll;

    fn loopback_pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (a, l.accept().unwrap().0)
    }

    /// A frame header as a sender writes it (tests that write raw frames).
    pub(crate) fn header(kind: u32, attempt: u64, offset: u64, len: u32) -> Vec<u8> {
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
        assert_eq!(grants.revoke(7), Revocation::Proven);
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
        assert_eq!(g.begin_landing(1, at, 8, &conn), Landing::Granted);
        assert_eq!(
            g.begin_landing(2, at, 8, &conn),
            Landing::OutsideGrant,
            "outside its pages"
        );
        assert_eq!(g.begin_landing(3, at, 8, &conn), Landing::NoGrant);
        assert_eq!(g.tcp_attempts(), vec![1]);
        g.end_landing(1, &conn);
        assert_eq!(g.revoke(1), Revocation::Proven);
        assert!(g.tcp_attempts().is_empty());
    }

    #[test]
    fn claim_slots_are_handed_out_revoked_and_reused_only_once_proven() {
        let name = format!("grants-test-{}", std::process::id());
        let l = layout();
        let g = Grants::with_claims(ClaimTable::create(&name, 2).unwrap());
        let writer = ClaimTable::open(&name).unwrap();
        let a = g.grant(1, &l, &[0]);
        let b = g.grant(2, &l, &[1]);
        assert!(a.slot.is_some() && b.slot.is_some() && a.slot != b.slot);
        assert_eq!(g.grant(3, &l, &[2]).slot, None, "two slots only");
        let held = writer.claim(a).unwrap();
        assert_eq!(g.revoke(1), Revocation::Busy);
        assert_eq!(g.revoke(1), Revocation::Busy, "asking again stays unproven");
        // The busy slot is not handed out again; the proven one is.
        assert_eq!(g.revoke(2), Revocation::Proven);
        let c = g.grant(4, &l, &[1]);
        assert_eq!(c.slot, b.slot);
        drop(held);
        assert_eq!(g.revoke(1), Revocation::Proven);
        assert!(matches!(writer.claim(a), Err(ClaimError::Revoked { .. })));
        assert!(matches!(writer.claim(b), Err(ClaimError::Revoked { .. })));
        assert!(writer.claim(c).is_ok());
        assert_eq!(g.revoke(99), Revocation::Proven, "nothing granted");
    }
}
