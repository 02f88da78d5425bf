//! Unit tests of decode's transfer state machine ([`super::Attempts`]): a fence whose
//! writers the test sets, a pool of 8 pages, and every way a transfer ends.

use super::*;

/// A fence whose writers the test sets: `busy` attempts have a writer inside its claim.
#[derive(Default)]
struct Claims {
    busy: Vec<AttemptKey>,
    revoked: Vec<AttemptKey>,
}

impl Fence for Claims {
    fn revoke(&mut self, attempt: AttemptKey) -> Revocation {
        self.revoked.push(attempt);
        if self.busy.contains(&attempt) {
            Revocation::Busy
        } else {
            Revocation::Proven
        }
    }
}

type Decode = Attempts<String, &'static str>;

const LIMITS: Limits = Limits {
    timeout_ms: 1_000,
    fence_ms: 100,
    backstop_ms: 5_000,
};

fn at<'a>(now_ms: u64, fence: &'a mut Claims, alloc: &'a mut PageAllocator) -> At<'a> {
    At {
        now_ms,
        fence,
        alloc,
    }
}

fn p0() -> String {
    "p0".to_string()
}

/// A decode pool of 8 pages with one transfer of room 7 open on 2 granted + 1 held page.
fn one_open() -> (Decode, PageAllocator, AttemptKey) {
    let mut alloc = PageAllocator::new(8);
    let mut a = Decode::new();
    let grant = alloc.alloc(2).unwrap();
    let held = alloc.alloc(1).unwrap();
    let k = a
        .open((p0(), 7), grant, held, 100, "req", &mut alloc)
        .unwrap();
    (a, alloc, k)
}

#[test]
fn a_done_publishes_only_after_a_proven_revoke_and_hands_over_every_page() {
    let (mut a, mut alloc, k) = one_open();
    let mut fence = Claims::default();
    let done = a.done(&p0(), 7, k, &mut at(150, &mut fence, &mut alloc), |_| {
        Ok::<(), ()>(())
    });
    let Done::Published {
        item,
        pages,
        latency_ms,
        ..
    } = done
    else {
        panic!("{done:?}");
    };
    assert_eq!((item, latency_ms, pages.len()), ("req", 50, 3));
    assert_eq!(fence.revoked, vec![k], "revoked before publishing");
    assert_eq!(alloc.free_pages(), 5, "the sequence owns its 3 pages");
    assert!(a.is_empty() && a.take_effects().is_empty());
}

#[test]
fn a_done_while_a_writer_holds_its_claim_is_never_published_and_stays_quarantined() {
    let (mut a, mut alloc, k) = one_open();
    let mut fence = Claims {
        busy: vec![k],
        ..Claims::default()
    };
    let done = a.done(&p0(), 7, k, &mut at(150, &mut fence, &mut alloc), |_| {
        Ok::<(), ()>(())
    });
    assert!(matches!(done, Done::Landing(_)), "{done:?}");
    assert_eq!(
        alloc.free_pages(),
        6,
        "the held page is back, the grant is not"
    );
    assert!(a.is_draining(k));
    assert_eq!(
        a.take_effects(),
        vec![Effect::StopPrefill {
            prefill: p0(),
            room: 7,
            attempt: k
        }]
    );
    // Long past every deadline and the backstop, still unproven: the alarm, no release.
    let late = a.tend(LIMITS, &mut at(1_000_000, &mut fence, &mut alloc));
    assert!(late.is_empty());
    assert_eq!(alloc.free_pages(), 6);
    let effects = a.take_effects();
    assert!(
        effects
            .iter()
            .any(|e| matches!(e, Effect::Alarm { attempt, .. } if *attempt == k))
    );
    assert!(
        effects
            .iter()
            .any(|e| matches!(e, Effect::DrainFence { .. }))
    );
    // The writer finishes its copy: the next turn proves it.
    fence.busy.clear();
    a.tend(LIMITS, &mut at(1_000_001, &mut fence, &mut alloc));
    assert_eq!(alloc.free_pages(), 8);
    assert!(matches!(a.take_effects()[..], [Effect::Closed { attempt, .. }] if attempt == k));
}

#[test]
fn a_refused_check_frees_the_grant_at_once_without_telling_prefill() {
    let (mut a, mut alloc, k) = one_open();
    let mut fence = Claims::default();
    let done = a.done(&p0(), 7, k, &mut at(150, &mut fence, &mut alloc), |_| {
        Err("crc")
    });
    assert!(matches!(done, Done::Refused(_, "crc")), "{done:?}");
    assert_eq!(alloc.free_pages(), 8);
    let effects = a.take_effects();
    assert!(
        matches!(effects[..], [Effect::Closed { .. }]),
        "{effects:?}"
    );
}

#[test]
fn an_old_attempts_messages_never_touch_the_current_one() {
    let (mut a, mut alloc, k) = one_open();
    let mut fence = Claims::default();
    let old = k + 100;
    let done = a.done(&p0(), 7, old, &mut at(150, &mut fence, &mut alloc), |_| {
        Ok::<(), ()>(())
    });
    assert!(matches!(done, Done::Stale));
    assert!(
        a.failed(&p0(), 7, old, &mut at(150, &mut fence, &mut alloc))
            .is_none()
    );
    assert!(a.progress(&p0(), 7, old, 150).is_none());
    assert!(a.progress(&"p1".to_string(), 7, k, 150).is_none());
    assert_eq!(a.get(&p0(), 7).map(|o| o.attempt), Some(k));
    assert_eq!(alloc.free_pages(), 5);
}

#[test]
fn a_failure_reported_by_prefill_ends_the_attempt_without_an_abort_back() {
    let (mut a, mut alloc, k) = one_open();
    let mut fence = Claims::default();
    let ended = a
        .failed(&p0(), 7, k, &mut at(150, &mut fence, &mut alloc))
        .unwrap();
    assert_eq!(
        (ended.item, ended.reason),
        ("req", AbortReason::ProducerFailure)
    );
    assert!(
        !a.take_effects()
            .iter()
            .any(|e| matches!(e, Effect::StopPrefill { .. }))
    );
    assert_eq!(alloc.free_pages(), 8);
}

#[test]
fn the_deadline_counts_from_progress_and_ends_a_stalled_transfer_into_quarantine() {
    let (mut a, mut alloc, k) = one_open();
    let mut fence = Claims {
        busy: vec![k],
        ..Claims::default()
    };
    a.progress(&p0(), 7, k, 900);
    a.stepping(&p0(), &[k], 1_500);
    assert!(
        a.tend(LIMITS, &mut at(2_400, &mut fence, &mut alloc))
            .is_empty()
    );
    let late = a.tend(LIMITS, &mut at(2_600, &mut fence, &mut alloc));
    assert_eq!(late.len(), 1);
    assert_eq!(late[0].reason, AbortReason::Timeout);
    assert_eq!(
        alloc.free_pages(),
        6,
        "a writer in its claim: the grant stays"
    );
    // Its writer dies: the claim drops, the proof comes with the next look.
    fence.busy.clear();
    assert_eq!(
        a.acknowledged(&"p1".to_string(), k, &mut at(2_700, &mut fence, &mut alloc)),
        Ack::Stale
    );
    assert_eq!(
        alloc.free_pages(),
        6,
        "another writer's acknowledgement proves nothing"
    );
    assert!(
        a.lose(&p0(), &mut at(2_800, &mut fence, &mut alloc))
            .is_empty()
    );
    assert_eq!(alloc.free_pages(), 8);
    assert_eq!(a.draining(), 0);
}

#[test]
fn a_lost_prefill_ends_only_its_own_transfers() {
    let (mut a, mut alloc, k) = one_open();
    let g = alloc.alloc(2).unwrap();
    let other = a
        .open(("p1".into(), 8), g, vec![], 100, "other", &mut alloc)
        .unwrap();
    let mut fence = Claims::default();
    let ended = a.lose(&p0(), &mut at(200, &mut fence, &mut alloc));
    assert_eq!(ended.iter().map(|e| e.attempt).collect::<Vec<_>>(), vec![k]);
    assert_eq!(a.get(&"p1".to_string(), 8).map(|o| o.attempt), Some(other));
    assert_eq!(alloc.free_pages(), 6);
}

#[test]
fn a_fenced_attempt_waits_for_its_check_past_every_deadline_and_its_writers_loss() {
    let (mut a, mut alloc, k) = one_open();
    let mut fence = Claims::default();
    let fenced = a.fence(&p0(), 7, k, &mut at(150, &mut fence, &mut alloc));
    assert!(matches!(fenced, Fenced::Fenced), "{fenced:?}");
    assert_eq!(fence.revoked, vec![k], "revoked when fenced");
    // A duplicate Done neither revokes again nor publishes.
    let again = a.fence(&p0(), 7, k, &mut at(160, &mut fence, &mut alloc));
    assert!(matches!(again, Fenced::Stale), "{again:?}");
    // Decode's check takes long (a busy batch), and the writer's node goes away meanwhile:
    // its writes all landed before the proven revoke, so neither ends the transfer.
    let late = a.tend(LIMITS, &mut at(100_000, &mut fence, &mut alloc));
    assert!(late.is_empty(), "{late:?}");
    assert!(
        a.lose(&p0(), &mut at(100_001, &mut fence, &mut alloc))
            .is_empty()
    );
    assert_eq!(alloc.free_pages(), 5);
    let done = a.publish(
        &p0(),
        7,
        k,
        &mut at(100_002, &mut fence, &mut alloc),
        |_| Ok::<(), ()>(()),
    );
    assert!(matches!(done, Done::Published { .. }), "{done:?}");
    assert_eq!(alloc.free_pages(), 5, "the sequence owns its 3 pages");
    assert!(a.is_empty() && a.take_effects().is_empty());
}

#[test]
fn a_fenced_attempt_cancelled_while_checked_frees_its_pages_and_is_never_published() {
    let (mut a, mut alloc, k) = one_open();
    let mut fence = Claims::default();
    // Published before its Done is fenced: nothing.
    let early = a.publish(&p0(), 7, k, &mut at(120, &mut fence, &mut alloc), |_| {
        Ok::<(), ()>(())
    });
    assert!(matches!(early, Done::Stale), "{early:?}");
    assert_eq!(a.len(), 1);
    assert!(matches!(
        a.fence(&p0(), 7, k, &mut at(150, &mut fence, &mut alloc)),
        Fenced::Fenced
    ));
    let ended = a.end_where(
        |_, o| o.item == "req",
        AbortReason::ClientCancel,
        &mut at(160, &mut fence, &mut alloc),
    );
    assert_eq!(ended.len(), 1);
    assert_eq!(
        alloc.free_pages(),
        8,
        "revoked already: every page back at once"
    );
    assert!(!a.is_draining(k));
    let done = a.publish(&p0(), 7, k, &mut at(170, &mut fence, &mut alloc), |_| {
        Ok::<(), ()>(())
    });
    assert!(matches!(done, Done::Stale), "{done:?}");
    assert_eq!(alloc.free_pages(), 8);
}

#[test]
fn a_fenced_attempt_whose_check_fails_is_refused_with_its_pages_free() {
    let (mut a, mut alloc, k) = one_open();
    let mut fence = Claims::default();
    a.fence(&p0(), 7, k, &mut at(150, &mut fence, &mut alloc));
    let done = a.publish(&p0(), 7, k, &mut at(180, &mut fence, &mut alloc), |_| {
        Err("mismatch")
    });
    assert!(matches!(done, Done::Refused(_, "mismatch")), "{done:?}");
    assert_eq!(alloc.free_pages(), 8);
    assert!(a.is_empty());
}
