//! The ledger against the acceptance criteria for a backend adapter (pd-disaggregation
//! chapter): random interleavings checked by an independent oracle of who may touch which page.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::*;

#[test]
fn publishes_only_on_completion_and_fences_old_attempts() {
    let mut alloc = PageAllocator::new(8);
    let mut l = TransferLedger::new(Side::Destination);
    let pages = alloc.alloc(3).unwrap();
    let k1 = l.open(7, "p0", pages.clone(), true, &mut alloc).unwrap();
    assert_eq!(
        l.open(7, "p0", vec![], true, &mut alloc),
        Err(LedgerError::RoomLive(7))
    );
    // Abort, then a late completion: nothing is published.
    assert_eq!(
        l.abort(k1, AbortReason::Timeout, 0, &mut alloc),
        Ok(Outcome::Applied)
    );
    assert_eq!(
        l.complete(k1, &mut alloc).unwrap(),
        (Outcome::Ignored, vec![])
    );
    // Pinned while draining: the pages are not free although the request let go.
    assert_eq!(alloc.stats().free, 5);
    assert_eq!(l.overdue(5_000, 1_000), vec![(k1, "p0".to_string())]);
    assert_eq!(l.drained(k1, &mut alloc), Ok(Outcome::Applied));
    assert_eq!(alloc.stats().free, 8);
    // The room is reusable; an old attempt's callbacks cannot touch the new one.
    let pages2 = alloc.alloc(2).unwrap();
    let k2 = l.open(7, "p0", pages2.clone(), true, &mut alloc).unwrap();
    assert!(k2 > k1);
    assert_eq!(l.complete(k1, &mut alloc).unwrap().0, Outcome::Stale);
    assert_eq!(
        l.abort(k1, AbortReason::ClientCancel, 1, &mut alloc),
        Ok(Outcome::Stale)
    );
    assert_eq!(l.state(k2), Some(State::Active));
    let (o, published) = l.complete(k2, &mut alloc).unwrap();
    assert_eq!((o, published), (Outcome::Applied, pages2.clone()));
    assert_eq!(l.complete(k2, &mut alloc).unwrap().0, Outcome::Ignored);
    alloc.release_all(&pages2).unwrap();
    assert_eq!(alloc.stats().free, 8);
}

#[test]
fn failed_open_rolls_back_every_pin() {
    let mut alloc = PageAllocator::new(4);
    let mut l = TransferLedger::new(Side::Destination);
    let mut pages = alloc.alloc(2).unwrap();
    pages.push(99); // not in the pool: pinning fails midway
    assert!(l.open(1, "p0", pages.clone(), true, &mut alloc).is_err());
    assert_eq!(alloc.stats().pinned, 0);
    assert!(l.current(1).is_none());
    alloc.release_all(&pages[..2]).unwrap();
    assert_eq!(alloc.stats().free, 4);
}

#[test]
fn source_pages_survive_preemption_until_drained() {
    // P's request is preempted (its references dropped) while a transfer still reads its pages.
    let mut alloc = PageAllocator::new(4);
    let mut l = TransferLedger::new(Side::Source);
    let pages = alloc.alloc(2).unwrap();
    let k = l.open(3, "d0", pages.clone(), false, &mut alloc).unwrap();
    alloc.release_all(&pages).unwrap(); // preemption
    l.abort(k, AbortReason::ClientCancel, 10, &mut alloc)
        .unwrap();
    // Replay allocates: it must not get the pinned pages.
    let replay = alloc.alloc(2).unwrap();
    assert!(replay.iter().all(|p| !pages.contains(p)));
    assert!(alloc.alloc(1).is_err());
    l.drained(k, &mut alloc).unwrap();
    assert_eq!(
        alloc.alloc(2).unwrap().len(),
        2,
        "the drained pages are reusable"
    );
}

#[derive(Debug, Clone)]
enum Op {
    Open { room: u8, pages: u8 },
    Complete { pick: u8 },
    Abort { pick: u8, reason: u8 },
    Drained { pick: u8 },
    EndpointDestroyed { peer: u8 },
    ReleasePublished { pick: u8 },
    Tick { ms: u16 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..4, 1u8..5).prop_map(|(room, pages)| Op::Open { room, pages }),
        any::<u8>().prop_map(|pick| Op::Complete { pick }),
        (any::<u8>(), 0u8..4).prop_map(|(pick, reason)| Op::Abort { pick, reason }),
        any::<u8>().prop_map(|pick| Op::Drained { pick }),
        (0u8..2).prop_map(|peer| Op::EndpointDestroyed { peer }),
        any::<u8>().prop_map(|pick| Op::ReleasePublished { pick }),
        (0u16..2000).prop_map(|ms| Op::Tick { ms }),
    ]
}

/// The oracle's view of one attempt, kept without looking at the ledger's internals.
#[derive(Debug, Clone, PartialEq)]
enum Oracle {
    Live { aborted: bool },
    Published,
    Done,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(100_000))]

    /// Duplicate completions and cancellations, delayed drains, old-attempt callbacks after
    /// room reuse and allocation failures, in any order: a page a write may still touch is
    /// never free; only completed, never-aborted attempts publish; stale calls change nothing;
    /// and once everything drains and published KV is released, the pool is whole.
    #[test]
    fn interleavings_keep_every_page_safe(ops in proptest::collection::vec(op(), 1..60)) {
        let capacity = 12;
        let mut alloc = PageAllocator::new(capacity);
        let mut l = TransferLedger::new(Side::Destination);
        let mut now = 0u64;
        // Oracle: attempt -> (room, peer, pages, state); every key ever issued.
        let mut oracle: HashMap<AttemptKey, (u8, String, Vec<PageId>, Oracle)> = HashMap::new();
        let mut keys: Vec<AttemptKey> = Vec::new();
        let reasons = [AbortReason::ClientCancel, AbortReason::Timeout, AbortReason::ProducerFailure, AbortReason::ConsumerFailure];
        for op in ops {
            match op {
                Op::Open { room, pages } => {
                    let live = oracle.values().any(|(r, _, _, s)| *r == room && matches!(s, Oracle::Live { .. }));
                    let Ok(got) = alloc.alloc(pages as usize) else {
                        // Allocation failed midway: nothing was opened, nothing changed.
                        continue;
                    };
                    let peer = format!("p{}", room % 2);
                    match l.open(u64::from(room), &peer, got.clone(), true, &mut alloc) {
                        Ok(k) => {
                            prop_assert!(!live, "opened a live room");
                            prop_assert!(keys.iter().all(|old| *old < k), "keys increase");
                            oracle.insert(k, (room, peer, got, Oracle::Live { aborted: false }));
                            keys.push(k);
                        }
                        Err(LedgerError::RoomLive(_)) => {
                            prop_assert!(live);
                            alloc.release_all(&got).unwrap();
                        }
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Complete { pick } if !keys.is_empty() => {
                    let k = keys[pick as usize % keys.len()];
                    let current = l.current(u64::from(oracle[&k].0)) == Some(k);
                    let before = oracle[&k].3.clone();
                    let (outcome, published) = l.complete(k, &mut alloc).unwrap();
                    match (current, &before) {
                        (false, _) => prop_assert_eq!(outcome, Outcome::Stale),
                        (true, Oracle::Live { aborted: false }) => {
                            prop_assert_eq!(outcome, Outcome::Applied);
                            prop_assert_eq!(&published, &oracle[&k].2);
                            if let Some(e) = oracle.get_mut(&k) { e.3 = Oracle::Published; }
                        }
                        (true, _) => {
                            prop_assert_eq!(outcome, Outcome::Ignored);
                            prop_assert!(published.is_empty(), "published after an abort");
                        }
                    }
                }
                Op::Abort { pick, reason } if !keys.is_empty() => {
                    let k = keys[pick as usize % keys.len()];
                    let current = l.current(u64::from(oracle[&k].0)) == Some(k);
                    let outcome = l.abort(k, reasons[reason as usize], now, &mut alloc).unwrap();
                    let entry = oracle.get_mut(&k).unwrap();
                    match (current, &entry.3) {
                        (false, _) => prop_assert_eq!(outcome, Outcome::Stale),
                        (true, Oracle::Live { aborted: false }) => {
                            prop_assert_eq!(outcome, Outcome::Applied);
                            entry.3 = Oracle::Live { aborted: true };
                        }
                        (true, _) => prop_assert_eq!(outcome, Outcome::Ignored),
                    }
                }
                Op::Drained { pick } if !keys.is_empty() => {
                    // Delayed drain acknowledgements: may arrive for any attempt, in any order.
                    let k = keys[pick as usize % keys.len()];
                    let outcome = l.drained(k, &mut alloc).unwrap();
                    let entry = oracle.get_mut(&k).unwrap();
                    if entry.3 == (Oracle::Live { aborted: true }) {
                        prop_assert_eq!(outcome, Outcome::Applied);
                        entry.3 = Oracle::Done;
                    } else {
                        prop_assert_eq!(outcome, Outcome::Ignored);
                    }
                }
                Op::EndpointDestroyed { peer } => {
                    let peer = format!("p{peer}");
                    let closed = l.endpoint_destroyed(&peer, now, &mut alloc).unwrap();
                    for (k, e) in oracle.iter_mut() {
                        if e.1 == peer && matches!(e.3, Oracle::Live { .. }) {
                            prop_assert!(closed.contains(k));
                            e.3 = Oracle::Done;
                        }
                    }
                }
                Op::ReleasePublished { pick } if !keys.is_empty() => {
                    // Decode finished the request: it lets go of the published pages.
                    let k = keys[pick as usize % keys.len()];
                    if oracle[&k].3 == Oracle::Published {
                        alloc.release_all(&oracle[&k].2).unwrap();
                        oracle.get_mut(&k).unwrap().3 = Oracle::Done;
                    }
                }
                Op::Tick { ms } => now += u64::from(ms),
                _ => {}
            }
            // Who may touch which page: pages of live attempts may still be written, pages of
            // published attempts belong to decode. Neither may be free, and no page may be in
            // two of them at once.
            let mut seen = HashSet::new();
            for (_, _, pages, state) in oracle.values() {
                if matches!(state, Oracle::Live { .. } | Oracle::Published) {
                    for p in pages {
                        prop_assert!(seen.insert(*p), "page {p} held twice");
                        prop_assert!(alloc.refs(*p) > 0 || alloc.pins(*p) > 0, "page {p} free while in use");
                    }
                }
            }
            let live: HashSet<PageId> = oracle.values()
                .filter(|e| matches!(e.3, Oracle::Live { .. }))
                .flat_map(|e| e.2.iter().copied()).collect();
            let busy: HashSet<PageId> = l.busy_pages().into_iter().collect();
            prop_assert_eq!(&busy, &live);
            for p in &live {
                prop_assert!(alloc.pins(*p) > 0, "a page a write may touch is unpinned");
            }
            // Every overdue attempt is one the oracle still counts as live and aborted.
            for (k, _) in l.overdue(now, 1_000) {
                prop_assert_eq!(oracle[&k].3.clone(), Oracle::Live { aborted: true });
            }
        }
        // Recovery: destroy every endpoint, release what decode holds; the pool is whole.
        for peer in ["p0", "p1"] {
            l.endpoint_destroyed(peer, now, &mut alloc).unwrap();
        }
        for (_, _, pages, state) in oracle.values() {
            if *state == Oracle::Published {
                alloc.release_all(pages).unwrap();
            }
        }
        prop_assert_eq!(alloc.stats().free, capacity);
        prop_assert_eq!(alloc.stats().pinned, 0);
        l.prune();
        prop_assert!(l.busy_pages().is_empty());
    }
}

#[test]
fn a_source_attempt_grows_chunk_by_chunk_and_stops_growing_once_aborted() {
    let mut alloc = PageAllocator::new(6);
    let mut l = TransferLedger::new(Side::Source);
    let k = l.open(5, "d0", vec![], false, &mut alloc).unwrap();
    let first = alloc.alloc(2).unwrap();
    assert_eq!(l.extend(k, &first, &mut alloc), Ok(Outcome::Applied));
    let second = alloc.alloc(2).unwrap();
    assert_eq!(l.extend(k, &second, &mut alloc), Ok(Outcome::Applied));
    assert_eq!(alloc.stats().pinned, 4);
    // The request lets go (it finished on prefill); the pins keep every page until read.
    alloc.release_all(&first).unwrap();
    alloc.release_all(&second).unwrap();
    assert_eq!(alloc.stats().free, 2);
    l.abort(k, AbortReason::ConsumerFailure, 0, &mut alloc)
        .unwrap();
    let late = alloc.alloc(1).unwrap();
    assert_eq!(l.extend(k, &late, &mut alloc), Ok(Outcome::Ignored));
    assert_eq!(alloc.pins(late[0]), 0);
    l.drained(k, &mut alloc).unwrap();
    alloc.release_all(&late).unwrap();
    assert_eq!(alloc.stats().free, 6);
}
