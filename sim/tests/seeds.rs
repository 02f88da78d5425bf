//! The seed explorer as a test: a thousand seeds of a hundred requests each under every fault
//! the simulator draws, with no invariant broken; and each bug the checks exist for, switched
//! back on, found within those seeds.

use duet_sim::explore::explore;
use duet_sim::{Mutations, SimConfig, run};

const SEEDS: u64 = 1_000;

#[test]
fn a_thousand_seeds_under_faults_break_no_invariant() {
    let cfg = SimConfig::explore();
    let e = explore(&cfg, 0, SEEDS);
    if let Some(r) = &e.failure {
        panic!("{}", r.readable());
    }
    assert_eq!(e.seeds, SEEDS);
    assert!(e.requests >= SEEDS * 100);
    // The faults happened, and the machinery they exercise ran.
    assert!(e.faults > SEEDS, "{e:?}");
    assert!(e.aborts > 0 && e.migrations > 0 && e.left > 0, "{e:?}");
    assert!(
        e.quarantine_stalls > 0,
        "no writer ever stalled past the backstop: {e:?}"
    );
    assert!(
        e.checks_overtaken > 0 && e.checks_outlived_writer > 0,
        "no cancel or lost writer met a transfer decode was checking: {e:?}"
    );
    assert!(e.finished > e.requests / 2, "{e:?}");
    eprintln!("{e:?}");
}

#[test]
fn a_seed_is_one_run_bit_for_bit() {
    let a = run(SimConfig::explore(), 42);
    let b = run(SimConfig::explore(), 42);
    let c = run(SimConfig::explore(), 43);
    assert_eq!(a.fingerprint, b.fingerprint);
    assert_eq!(a.trace, b.trace);
    assert_ne!(a.fingerprint, c.fingerprint);
}

fn found(m: Mutations) -> duet_sim::Report {
    let cfg = SimConfig {
        mutations: m,
        ..SimConfig::explore()
    };
    let e = explore(&cfg, 0, SEEDS);
    match e.failure {
        Some(r) => {
            eprintln!("{m:?} found at seed {} of {SEEDS}", r.seed);
            r
        }
        None => panic!("{m:?} not found in {SEEDS} seeds: {e:?}"),
    }
}

#[test]
fn freeing_pages_on_the_backstop_is_found() {
    let r = found(Mutations {
        release_on_backstop: true,
        ..Mutations::default()
    });
    assert!(
        r.violations.iter().any(|v| v.contains("after its release")),
        "{}",
        r.readable()
    );
}

#[test]
fn an_abort_that_races_its_done_is_found() {
    let r = found(Mutations {
        publish_aborted: true,
        ..Mutations::default()
    });
    assert!(
        r.violations.iter().any(|v| v.contains("while Seq")),
        "{}",
        r.readable()
    );
}

#[test]
fn a_duplicated_prealloc_notice_is_found() {
    let r = found(Mutations {
        fail_duplicate_notice: true,
        ..Mutations::default()
    });
    assert!(
        r.violations
            .iter()
            .any(|v| v.contains("after finishing it") || v.contains("still sending it")),
        "{}",
        r.readable()
    );
}
