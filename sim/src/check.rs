//! The invariants, kept apart from the code under test: the checker follows who owns each
//! decode page by what the cluster does with it (reserve, publish, free) and judges every
//! write that lands and every publish against that, the way `check_history.py` judges a real
//! cluster's transfer history:
//!
//! - no write lands after its attempt's release (its pages freed or published);
//! - no write lands outside its attempt's grant;
//! - nothing is published while a write of its attempt may still land (the fence);
//! - a prefill worker never reports a transfer failed after finishing it, nor while it is
//!   still sending it;
//! - no page is held by two owners at once;
//! - every request ends within its deadline; tokens are the cost model's stream, in order,
//!   none twice, none missing; nothing is stranded once the faults stop (in `world.rs`).

use duet_gpu::PageId;

/// Who holds a decode page, as the checker sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// Nobody: in the free list.
    Free,
    /// A transfer attempt's grant: writes of that attempt may land.
    Attempt(u64),
    /// A sequence decoding (request, router attempt): no write may land.
    Seq(u64, u64),
}

/// Page ownership per decode worker, and the violations found.
#[derive(Debug, Default)]
pub struct Checker {
    pages: Vec<Vec<Owner>>,
    pub(crate) violations: Vec<String>,
    pub(crate) first_trace: Vec<String>,
    /// Transfers a prefill worker finished (sent their Done): (prefill, decode, room,
    /// attempt). None of them may be reported failed afterwards. (Attempt keys restart with a
    /// decode incarnation; rooms are drawn at random per attempt.)
    pub(crate) finished: std::collections::BTreeSet<(usize, usize, u64, u64)>,
}

impl Checker {
    pub(crate) fn new(decodes: usize, pages: usize) -> Checker {
        Checker {
            pages: vec![vec![Owner::Free; pages]; decodes],
            ..Checker::default()
        }
    }

    /// A decode worker restarted: its pool is new.
    pub(crate) fn reset(&mut self, d: usize) {
        self.pages[d].iter_mut().for_each(|o| *o = Owner::Free);
    }

    /// `pages` go from free to `to`; an error names a page someone else holds.
    pub(crate) fn take(&mut self, d: usize, pages: &[PageId], to: Owner) -> Result<(), String> {
        let mut clash = None;
        for &p in pages {
            let o = &mut self.pages[d][p as usize];
            if *o != Owner::Free && clash.is_none() {
                clash = Some(format!(
                    "d{d}: page {p} given to {to:?} while {o:?} holds it"
                ));
            }
            *o = to;
        }
        clash.map_or(Ok(()), Err)
    }

    /// `pages` pass from `from` to `to` (a publish), or back to free.
    pub(crate) fn pass(&mut self, d: usize, pages: &[PageId], from: Owner, to: Owner) {
        for &p in pages {
            let o = &mut self.pages[d][p as usize];
            if *o == from {
                *o = to;
            }
        }
    }

    /// A write of `attempt` lands on `pages` of decode `d`: each must be held by that attempt.
    pub(crate) fn landed(&self, d: usize, attempt: u64, pages: &[PageId]) -> Result<(), String> {
        for &p in pages {
            match self.pages[d].get(p as usize) {
                Some(Owner::Attempt(a)) if *a == attempt => {}
                Some(o) => {
                    return Err(format!(
                        "d{d}: a write of attempt {attempt} landed in page {p} after its \
                         release (page now {o:?})"
                    ));
                }
                None => return Err(format!("d{d}: attempt {attempt} wrote outside the pool")),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_landing_after_release_and_a_double_owner_are_caught() {
        let mut c = Checker::new(1, 4);
        c.take(0, &[0, 1], Owner::Attempt(7)).expect("free pages");
        assert!(c.landed(0, 7, &[0, 1]).is_ok());
        assert!(c.landed(0, 8, &[0]).is_err(), "another attempt's pages");
        c.pass(0, &[0, 1], Owner::Attempt(7), Owner::Free);
        assert!(c.landed(0, 7, &[0]).is_err(), "after the release");
        c.take(0, &[0], Owner::Seq(1, 1)).expect("free again");
        assert!(c.take(0, &[0], Owner::Attempt(9)).is_err(), "two owners");
        assert_eq!(c.pages[0][1], Owner::Free);
    }
}
