//! Decode's check of a fenced transfer's landed KV against prefill's checksums, a few pages a
//! turn.
//!
//! The check is a CRC-32 over every byte that landed: SmolLM2's 1,024-token prompt is 23.6 MB
//! of KV, 3-6 ms of hashing on one core, and a 70B model's long prompt is gigabytes. Checked
//! in one turn, every running sequence's next token waits that long. So while decode has
//! sequences running, a turn hashes at most `serving.kv_verify_step_mib` of it before its
//! step, and the transfer is published in the turn its last page passes; with nothing running
//! the whole check runs at once (nobody waits on the step).
//!
//! The attempt is fenced first ([`super::attempts::Attempts::fence`]: its revoke proven, so
//! no byte of it can land any more), which is what makes a check spread over turns a check of
//! the bytes that get published. A check whose attempt ended meanwhile (a cancel) is dropped
//! before it reads another page: those pages may be another sequence's by then.

use std::time::{Duration, Instant};

use duet_gpu::{KvLayout, PageId, PoolMemory};
use duet_transport::PagesCrc;

use crate::protocol::TransferDone;

/// A fenced transfer's check under way.
#[derive(Debug)]
pub(super) struct Check {
    /// The prefill node that wrote it.
    pub(super) node: String,
    /// Prefill's Done: the attempt, its checksums, the first token.
    pub(super) done: TransferDone,
    /// The checksum run being hashed, and how many of its pages are.
    run: usize,
    page: usize,
    crc: PagesCrc,
    /// Time spent hashing, over every turn (the `duet_kv_verify_seconds` figure).
    pub(super) spent: Duration,
    /// Turns it has taken so far.
    pub(super) turns: u32,
}

/// Where a check stands after a turn's share.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Pages remain: the next turn goes on.
    Pending,
    /// Every run matched prefill's checksum.
    Passed,
    /// A run did not (or its pages could not be read): never published.
    Failed(String),
}

/// Checks that prefill's checksums cover every page of the grant, each once: a run left out
/// would be published unchecked.
pub(super) fn covers(grant: &[PageId], d: &TransferDone) -> Result<(), String> {
    let mut covered: Vec<PageId> = d.checksums.iter().flat_map(|c| c.pages.clone()).collect();
    covered.sort_unstable();
    let mut want = grant.to_vec();
    want.sort_unstable();
    if covered != want {
        return Err(format!(
            "checksums cover {} of the {} pages written",
            covered.len(),
            want.len()
        ));
    }
    Ok(())
}

impl Check {
    /// A check of `done`'s runs from the first page (their coverage checked by [`covers`]).
    pub(super) fn new(node: String, done: TransferDone) -> Check {
        Check {
            node,
            done,
            run: 0,
            page: 0,
            crc: PagesCrc::default(),
            spent: Duration::ZERO,
            turns: 0,
        }
    }

    /// Hashes up to `budget` pages (taking what it uses from it), in the runs' order, each
    /// run's CRC compared with prefill's as its last page passes.
    pub(super) fn advance(
        &mut self,
        memory: &PoolMemory,
        layout: &KvLayout,
        budget: &mut usize,
    ) -> Verdict {
        let start = Instant::now();
        self.turns += 1;
        let verdict = self.hash(memory, layout, budget);
        self.spent += start.elapsed();
        verdict
    }

    fn hash(&mut self, memory: &PoolMemory, layout: &KvLayout, budget: &mut usize) -> Verdict {
        loop {
            let Some(c) = self.done.checksums.get(self.run) else {
                return Verdict::Passed;
            };
            let n = (c.pages.len() - self.page).min(*budget);
            if n == 0 && self.page < c.pages.len() {
                return Verdict::Pending;
            }
            let pages = &c.pages[self.page..self.page + n];
            if let Err(e) = self.crc.update(memory, layout, pages) {
                return Verdict::Failed(e.to_string());
            }
            self.page += n;
            *budget -= n;
            if self.page == c.pages.len() {
                let got = std::mem::take(&mut self.crc).finish();
                if got != c.crc {
                    return Verdict::Failed(format!(
                        "checksum mismatch on pages {:?}: prefill sent {:#010x}, decode holds \
                         {got:#010x}",
                        c.pages, c.crc
                    ));
                }
                self.run += 1;
                self.page = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use duet_engine::sampling::SamplerState;
    use duet_gpu::KvPool;

    use super::*;
    use crate::protocol::RunChecksum;
    use crate::testing::small_layout as layout;

    /// A pool whose 8 pages all differ, and a Done whose runs are `runs` with their CRCs.
    fn landed(runs: &[&[PageId]]) -> (KvPool, TransferDone) {
        let mut pool = KvPool::new(layout(), 8).expect("pool");
        for page in 0..8 {
            for slot in 0..4 {
                let x = (page * 10 + slot) as f32;
                pool.write_token(page, 1, slot as usize, &[x; 8], &[-x; 8]);
            }
        }
        let memory = pool.memory();
        let checksums = runs
            .iter()
            .map(|pages| RunChecksum {
                pages: pages.to_vec(),
                crc: duet_transport::pages_crc(&memory, &layout(), pages).expect("crc"),
            })
            .collect();
        let done = TransferDone {
            room: 1,
            attempt: 1,
            token: 0,
            logprob: 0.0,
            sampler: SamplerState { seed: 0, draws: 0 },
            bytes: 0,
            prefill_cached: 0,
            checksums,
            top: Vec::new(),
        };
        (pool, done)
    }

    /// Runs `check` with `per_turn` pages a turn until it decides: the verdict and the turns.
    fn run(check: &mut Check, pool: &KvPool, per_turn: usize) -> (Verdict, u32) {
        loop {
            let mut budget = per_turn;
            match check.advance(&pool.memory(), &layout(), &mut budget) {
                Verdict::Pending => assert_eq!(budget, 0, "a pending turn uses its share"),
                v => return (v, check.turns),
            }
        }
    }

    #[test]
    fn a_check_spread_over_turns_passes_what_one_turn_passes_and_takes_its_share_each_turn() {
        let runs: &[&[PageId]] = &[&[5, 6, 0], &[1], &[7, 2, 3, 4]];
        for (per_turn, turns) in [(usize::MAX, 1), (8, 1), (3, 3), (2, 4), (1, 8)] {
            let (pool, done) = landed(runs);
            let mut check = Check::new("p0".into(), done);
            assert_eq!(
                run(&mut check, &pool, per_turn),
                (Verdict::Passed, turns),
                "{per_turn} pages a turn"
            );
        }
    }

    #[test]
    fn a_page_changed_in_any_run_fails_the_check_at_that_run() {
        let runs: &[&[PageId]] = &[&[5, 6, 0], &[1], &[7, 2, 3, 4]];
        for (bad, per_turn) in [(6, 1), (1, 2), (4, 3), (0, usize::MAX)] {
            let (mut pool, done) = landed(runs);
            pool.write_token(bad, 0, 2, &[9.0; 8], &[9.0; 8]);
            let mut check = Check::new("p0".into(), done);
            let (verdict, _) = run(&mut check, &pool, per_turn);
            let Verdict::Failed(why) = verdict else {
                panic!("page {bad} changed and passed ({per_turn} a turn)");
            };
            assert!(why.contains(&format!("{bad}")), "{why}");
        }
    }

    #[test]
    fn checksums_that_leave_a_page_out_or_name_one_twice_do_not_cover_the_grant() {
        let (_, done) = landed(&[&[5, 6], &[0]]);
        assert_eq!(covers(&[0, 5, 6], &done), Ok(()));
        assert!(covers(&[0, 5, 6, 7], &done).is_err(), "page 7 unchecked");
        let (_, twice) = landed(&[&[5, 6], &[6]]);
        assert!(
            covers(&[5, 6], &twice).is_err(),
            "page 6 twice, 5 and 6 once"
        );
    }
}
