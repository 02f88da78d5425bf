//! Write claims: what decode holds over a writer that maps its pool (`shm` from another
//! process on the host, `local` from its own), so that a writer paused for any length can
//! never land a stale write in a page decode has reused.
//!
//! A [`ClaimTable`] is a small shared-memory file of slots, one 8-byte word each, next to the
//! pool. Decode opens a slot for each attempt it grants pages to (the slot goes to prefill in
//! the notice, as a [`WriteGrant`]), and revokes it before the attempt's pages are published
//! or released. Every run of pages a writer copies is one *claim* of that slot:
//!
//! ```text
//!   writer, per run:  lock(slot) ── word == OPEN(attempt)? ── yes: copy the run ── unlock
//!                                                          └─ no: unlock; Revoked, nothing copied
//!   decode, revoke:   word := REVOKED(attempt) ── try lock(slot) ── got it: unlock ── proven
//!                                                               └─ held: a copy is under way
//! ```
//!
//! The lock is an OFD (open file description) lock on the slot's bytes, taken by `fcntl`.
//! Why a successful revoke is a proof, with no clock anywhere in it:
//!
//! - once decode holds the lock after marking the word revoked, no writer is between its
//!   check and its unlock; every writer that locks later sees the revoked word and copies
//!   nothing;
//! - the kernel drops a process's OFD locks only when the last descriptor of that open file
//!   closes, which for a killed process is after every thread of it is gone: a dead writer
//!   counts as finished, and nothing of it can land any more;
//! - a *paused* writer (SIGSTOP, a frozen cgroup, a debugger, a VM migration) keeps its lock,
//!   so decode's revoke stays unproven and the pages stay quarantined until it finishes the one
//!   run it was copying, or dies. A writer paused between runs holds no lock: decode's revoke
//!   succeeds at once, and the writer's next claim is refused when it wakes.
//!
//! A slot's word is `attempt << 2 | 1` while open and `attempt << 2 | 2` once revoked (zero
//! is an empty slot); attempt keys increase, so a writer holding a grant of an earlier attempt
//! of a reused slot never matches a later one.

#![allow(unsafe_code)] // the mapping and fcntl; the safety argument is on each `unsafe` block

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::MmapMut;
use serde::{Deserialize, Serialize};

use crate::ledger::AttemptKey;
use crate::shm::{map_shared, shm_path};

/// Bytes per slot.
const SLOT_BYTES: usize = 8;

/// A slot's word while `attempt` may claim it.
fn open_word(attempt: AttemptKey) -> u64 {
    attempt << 2 | 1
}

/// A slot's word once `attempt`'s grant is revoked.
fn revoked_word(attempt: AttemptKey) -> u64 {
    attempt << 2 | 2
}

/// How long a writer waits for a slot whose lock decode holds. Decode holds it for two system
/// calls, so only a paused decode process makes a writer wait this long; the write then fails
/// having copied nothing (a writer's deadline frees nothing, it only gives up).
const CLAIM_WAIT: Duration = Duration::from_secs(2);

/// What decode grants an attempt, sent to prefill in the notice: the attempt's key and, where
/// decode keeps a claim table, the slot a writer that maps the pool must claim for each run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WriteGrant {
    /// The attempt (decode's ledger key).
    pub attempt: AttemptKey,
    /// Its slot in decode's claim table (`None` when decode has none: TCP only).
    pub slot: Option<u32>,
}

impl WriteGrant {
    /// A grant with no claim slot (backends that check grants on decode's side: TCP).
    pub fn unslotted(attempt: AttemptKey) -> WriteGrant {
        WriteGrant {
            attempt,
            slot: None,
        }
    }
}

/// A claim was refused or the table could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// Creating, opening, mapping or locking the table failed.
    #[error("claim table {path}: {source}")]
    Io {
        /// The table's file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// Decode revoked the attempt's grant (it aborted or finished the attempt): nothing of
    /// this write was copied.
    #[error("attempt {attempt}: decode revoked its write grant; nothing was written")]
    Revoked {
        /// The attempt.
        attempt: AttemptKey,
    },
    /// The grant names no slot, or one outside the table.
    #[error("attempt {attempt}: no claim slot {slot:?} in a table of {slots}")]
    NoSlot {
        /// The attempt.
        attempt: AttemptKey,
        /// The slot it named.
        slot: Option<u32>,
        /// The table's slots.
        slots: usize,
    },
    /// The slot's lock stayed held by decode for [`CLAIM_WAIT`] (a paused decode process):
    /// nothing was written.
    #[error("attempt {attempt}: its claim slot stayed locked for {waited:?}; nothing was written")]
    Busy {
        /// The attempt.
        attempt: AttemptKey,
        /// How long the writer waited.
        waited: Duration,
    },
}

/// A claim table: decode creates it (and removes the file when it drops); writers open it
/// by name. Each opening is its own open file description, so its locks are its own.
pub struct ClaimTable {
    path: PathBuf,
    file: File,
    map: MmapMut,
    slots: usize,
    owner: bool,
}

impl std::fmt::Debug for ClaimTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimTable")
            .field("path", &self.path)
            .field("slots", &self.slots)
            .finish()
    }
}

/// A writer's claim on a slot: held while it copies one run; released on drop.
#[derive(Debug)]
pub struct Claim<'a> {
    table: &'a ClaimTable,
    slot: u32,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        // The copies happen before the unlock (the system call orders them for the next
        // holder; the fence states it).
        std::sync::atomic::fence(Ordering::SeqCst);
        if let Err(e) = self.table.lock(self.slot, Lock::Release) {
            // Closing the descriptor (dropping the transport) releases it too.
            tracing::error!(error = %e, slot = self.slot, "cannot release a write claim");
        }
    }
}

/// What decode's revoke found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Revocation {
    /// No write of the attempt can land any more.
    Proven,
    /// A writer holds the slot: it is copying a run now (or is paused mid-copy). Ask again.
    Busy,
}

#[derive(Clone, Copy)]
enum Lock {
    Try,
    Release,
}

impl ClaimTable {
    /// Creates a table of `slots` empty slots named `name` (under `/dev/shm`, removed when
    /// this owner drops).
    pub fn create(name: &str, slots: usize) -> Result<ClaimTable, ClaimError> {
        Self::map(name, Some(slots.max(1) * SLOT_BYTES))
    }

    /// Opens the table another side created.
    pub fn open(name: &str) -> Result<ClaimTable, ClaimError> {
        Self::map(name, None)
    }

    fn map(name: &str, create: Option<usize>) -> Result<ClaimTable, ClaimError> {
        let path = shm_path(name);
        let (file, map) = map_shared(&path, create).map_err(|source| ClaimError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Ok(ClaimTable {
            path,
            file,
            slots: map.len() / SLOT_BYTES,
            map,
            owner: create.is_some(),
        })
    }

    /// Slots in the table.
    pub fn slots(&self) -> usize {
        self.slots
    }

    fn word(&self, slot: u32) -> Option<&AtomicU64> {
        let i = slot as usize;
        if i >= self.slots {
            return None;
        }
        // SAFETY: in bounds (checked), 8-byte aligned (the mapping is page-aligned and slots
        // are 8 bytes), and every process touches these bytes only as atomics; the reference
        // lives no longer than the mapping (`&self`).
        Some(unsafe { &*(self.map.as_ptr().add(i * SLOT_BYTES) as *const AtomicU64) })
    }

    /// Decode: `slot` is `attempt`'s now; writers holding this grant may claim it.
    pub fn open_slot(&self, slot: u32, attempt: AttemptKey) -> bool {
        match self.word(slot) {
            Some(w) => {
                w.store(open_word(attempt), Ordering::SeqCst);
                true
            }
            None => false,
        }
    }

    /// Decode: takes `attempt`'s grant back. [`Revocation::Proven`] once no writer holds the
    /// slot (a later claim sees the revoked word); [`Revocation::Busy`] while one copies.
    /// Asking again is how a busy revoke completes. Never blocks.
    pub fn revoke(&self, slot: u32, attempt: AttemptKey) -> Result<Revocation, ClaimError> {
        let Some(w) = self.word(slot) else {
            return Ok(Revocation::Proven); // never handed out
        };
        if w.load(Ordering::SeqCst) == open_word(attempt) {
            w.store(revoked_word(attempt), Ordering::SeqCst);
        }
        if self.lock(slot, Lock::Try)? {
            self.lock(slot, Lock::Release)?;
            Ok(Revocation::Proven)
        } else {
            Ok(Revocation::Busy)
        }
    }

    /// Writer: claims `grant`'s slot for one run of copies; refused once decode revoked it.
    pub fn claim(&self, grant: WriteGrant) -> Result<Claim<'_>, ClaimError> {
        let attempt = grant.attempt;
        let (slot, word) = match grant.slot.and_then(|s| Some((s, self.word(s)?))) {
            Some(sw) => sw,
            None => {
                return Err(ClaimError::NoSlot {
                    attempt,
                    slot: grant.slot,
                    slots: self.slots,
                });
            }
        };
        let start = Instant::now();
        while !self.lock(slot, Lock::Try)? {
            if start.elapsed() >= CLAIM_WAIT {
                return Err(ClaimError::Busy {
                    attempt,
                    waited: start.elapsed(),
                });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let claim = Claim { table: self, slot };
        if word.load(Ordering::SeqCst) != open_word(attempt) {
            return Err(ClaimError::Revoked { attempt }); // the claim's drop unlocks
        }
        Ok(claim)
    }

    /// Takes (without waiting) or releases the slot's lock; `Ok(false)`: another open file
    /// description holds it.
    fn lock(&self, slot: u32, how: Lock) -> Result<bool, ClaimError> {
        // SAFETY: `flock` is plain data; all-zero is a valid value, then filled in below.
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = match how {
            Lock::Try => libc::F_WRLCK,
            Lock::Release => libc::F_UNLCK,
        } as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        fl.l_start = (slot as usize * SLOT_BYTES) as libc::off_t;
        fl.l_len = SLOT_BYTES as libc::off_t;
        fl.l_pid = 0; // required for OFD locks
        // SAFETY: a valid descriptor we own and a valid `flock`; F_OFD_SETLK does not block.
        let r = unsafe { libc::fcntl(self.file.as_raw_fd(), libc::F_OFD_SETLK, &fl) };
        if r == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::EACCES) => Ok(false),
            _ => Err(ClaimError::Io {
                path: self.path.display().to_string(),
                source: e,
            }),
        }
    }
}

impl Drop for ClaimTable {
    fn drop(&mut self) {
        if self.owner {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;

    fn table(tag: &str) -> (ClaimTable, ClaimTable) {
        let name = format!("claims-test-{tag}-{}", std::process::id());
        let owner = ClaimTable::create(&name, 4).unwrap();
        let writer = ClaimTable::open(&name).unwrap();
        (owner, writer)
    }

    fn grant(attempt: AttemptKey, slot: u32) -> WriteGrant {
        WriteGrant {
            attempt,
            slot: Some(slot),
        }
    }

    #[test]
    fn a_writer_claims_an_open_slot_and_not_a_revoked_one() {
        let (decode, writer) = table("open");
        assert!(
            matches!(writer.claim(grant(0, 0)), Err(ClaimError::Revoked { .. })),
            "an empty slot is no grant"
        );
        assert!(decode.open_slot(1, 7));
        drop(writer.claim(grant(7, 1)).expect("open"));
        assert!(matches!(
            writer.claim(grant(6, 1)),
            Err(ClaimError::Revoked { attempt: 6 })
        ));
        assert_eq!(decode.revoke(1, 7).unwrap(), Revocation::Proven);
        assert!(matches!(
            writer.claim(grant(7, 1)),
            Err(ClaimError::Revoked { .. })
        ));
        // A later attempt in the same slot: the earlier grant stays refused.
        assert!(decode.open_slot(1, 9));
        assert!(writer.claim(grant(9, 1)).is_ok());
        assert!(writer.claim(grant(7, 1)).is_err());
        assert!(matches!(
            writer.claim(grant(9, 4)),
            Err(ClaimError::NoSlot { .. })
        ));
    }

    #[test]
    fn a_revoke_is_unproven_while_a_claim_is_held_and_proven_after() {
        let (decode, writer) = table("held");
        decode.open_slot(2, 3);
        let claim = writer.claim(grant(3, 2)).unwrap();
        // However long the holder stays (a paused writer), decode cannot prove the drain.
        for _ in 0..3 {
            assert_eq!(decode.revoke(2, 3).unwrap(), Revocation::Busy);
        }
        // Other slots are independent.
        decode.open_slot(0, 4);
        assert_eq!(decode.revoke(0, 4).unwrap(), Revocation::Proven);
        drop(claim);
        assert_eq!(decode.revoke(2, 3).unwrap(), Revocation::Proven);
        assert!(matches!(
            writer.claim(grant(3, 2)),
            Err(ClaimError::Revoked { .. })
        ));
    }

    #[test]
    fn a_dead_writers_claim_is_released_by_the_kernel() {
        // A writer process that dies holding a claim: a child `sleep` inherits nothing of
        // ours, so model the death by closing the writer's only open file description.
        let (decode, writer) = table("dead");
        decode.open_slot(1, 5);
        let claim = writer.claim(grant(5, 1)).unwrap();
        assert_eq!(decode.revoke(1, 5).unwrap(), Revocation::Busy);
        std::mem::forget(claim); // never unlocked by the writer
        drop(writer); // its descriptor closes, as at process exit
        assert_eq!(decode.revoke(1, 5).unwrap(), Revocation::Proven);
    }

    #[test]
    fn a_writer_checks_under_the_lock_so_no_copy_straddles_a_proven_revoke() {
        // Race many claims against a revoke: whenever revoke reports Proven, no claim taken
        // before it is still held, and none taken after it succeeds.
        let (decode, writer) = table("race");
        for attempt in 1..100u64 {
            decode.open_slot(3, attempt);
            let (tx, rx) = mpsc::channel();
            let w = &writer;
            let rx = &rx;
            std::thread::scope(|s| {
                s.spawn(move || {
                    for _ in 0..20 {
                        if let Ok(c) = w.claim(grant(attempt, 3)) {
                            tx.send(true).unwrap();
                            std::hint::black_box(&c);
                            tx.send(false).unwrap();
                        }
                    }
                });
                let mut held = 0i32;
                loop {
                    match decode.revoke(3, attempt).unwrap() {
                        Revocation::Proven => {
                            while let Ok(b) = rx.try_recv() {
                                held += if b { 1 } else { -1 };
                            }
                            assert_eq!(held, 0, "revoke proven while a claim was held");
                            break;
                        }
                        Revocation::Busy => std::thread::yield_now(),
                    }
                }
            });
            // No claim succeeded after the proof, and later ones are refused.
            assert!(
                rx.try_iter().next().is_none(),
                "a claim after a proven revoke"
            );
            assert!(writer.claim(grant(attempt, 3)).is_err());
        }
    }
}
