//! Running many seeds: the first failing one, with its trace, or a clean summary.

use crate::config::SimConfig;
use crate::world::Report;

/// What a batch of seeds found.
#[derive(Debug)]
pub struct Exploration {
    /// Seeds run.
    pub seeds: u64,
    /// The first failing seed's report.
    pub failure: Option<Report>,
    /// Totals over the clean seeds.
    pub requests: u64,
    /// Finished requests.
    pub finished: u64,
    /// Failed requests.
    pub failed: u64,
    /// Requests whose client left.
    pub left: u64,
    /// Crashes, pauses, partitions.
    pub faults: u64,
    /// Aborted transfers.
    pub aborts: u64,
    /// Writes refused by a revoked grant.
    pub writes_refused: u64,
    /// Drains left unproven past the backstop (pages kept).
    pub quarantine_stalls: u64,
    /// Checks of fenced transfers a cancel overtook.
    pub checks_overtaken: u64,
    /// Checks of fenced transfers whose writer's node was lost meanwhile.
    pub checks_outlived_writer: u64,
    /// Attempts continued on another decode worker.
    pub migrations: u64,
}

/// Runs seeds `first..first + count` of `cfg` (without a trace: fast), stopping at the first
/// violation, which is run again with its whole trace kept (a seed is one run, so the second
/// run is the first one, bit for bit, now readable).
pub fn explore(cfg: &SimConfig, first: u64, count: u64) -> Exploration {
    let quiet = SimConfig {
        trace_events: 0,
        ..cfg.clone()
    };
    let mut e = Exploration {
        seeds: 0,
        failure: None,
        requests: 0,
        finished: 0,
        failed: 0,
        left: 0,
        faults: 0,
        aborts: 0,
        writes_refused: 0,
        quarantine_stalls: 0,
        checks_overtaken: 0,
        checks_outlived_writer: 0,
        migrations: 0,
    };
    for seed in first..first + count {
        let r = crate::run(quiet.clone(), seed);
        e.seeds += 1;
        let s = &r.stats;
        e.requests += cfg.requests as u64;
        e.finished += s.finished as u64;
        e.failed += s.failed as u64;
        e.left += s.left as u64;
        e.faults += s.crashes + s.pauses + s.partitions;
        e.aborts += s.aborts;
        e.writes_refused += s.writes_refused;
        e.quarantine_stalls += s.quarantine_stalls;
        e.checks_overtaken += s.checks_overtaken;
        e.checks_outlived_writer += s.checks_outlived_writer;
        e.migrations += s.migrations;
        if !r.violations.is_empty() {
            let traced = SimConfig {
                trace_events: usize::MAX,
                ..cfg.clone()
            };
            let again = crate::run(traced, seed);
            assert_eq!(
                again.fingerprint, r.fingerprint,
                "seed {seed} ran differently the second time: the simulator is not deterministic"
            );
            e.failure = Some(again);
            break;
        }
    }
    e
}

impl Report {
    /// The report as people read it: the violations, then the events that led there.
    pub fn readable(&self) -> String {
        let mut s = format!(
            "seed {}: {} violation(s)\n",
            self.seed,
            self.violations.len()
        );
        for v in self.violations.iter().take(10) {
            s.push_str(&format!("  - {v}\n"));
        }
        s.push_str("last events before the first violation:\n");
        for l in &self.trace {
            s.push_str(&format!("  {l}\n"));
        }
        s
    }
}
