//! What the host took from this machine's cores while a benchmark ran: the hypervisor's steal
//! time (Linux's `/proc/stat`). A guest's figures move with it, and a run that names it can
//! be told apart from one whose code got slower.

/// The machine's CPU time counters, all cores together, in clock ticks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct CpuTimes {
    /// Every state's ticks (user to steal; guest time is inside user).
    total: u64,
    /// Ticks the hypervisor ran something else while this guest wanted the core.
    steal: u64,
}

impl CpuTimes {
    /// Now; `None` where `/proc/stat` is missing or unreadable (not Linux).
    pub(super) fn now() -> Option<CpuTimes> {
        parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    /// The share of the cores' time stolen between `self` and `later`, 0-1.
    pub(super) fn steal_until(&self, later: &CpuTimes) -> f64 {
        let total = later.total.saturating_sub(self.total);
        match total {
            0 => 0.0,
            t => later.steal.saturating_sub(self.steal) as f64 / t as f64,
        }
    }
}

/// The first line, `cpu  user nice system idle iowait irq softirq steal guest guest_nice`;
/// `guest` and `guest_nice` are already counted in `user` and `nice`.
fn parse(stat: &str) -> Option<CpuTimes> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    Some(CpuTimes {
        total: ticks.iter().sum(),
        steal: *ticks.get(7)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steal_is_its_share_of_every_state_but_guest_time() {
        let before = parse("cpu  100 0 50 800 0 0 0 50 40 0\ncpu0 1 2 3\n").expect("parses");
        let after = parse("cpu  200 0 100 1500 0 0 0 200 90 0\n").expect("parses");
        // 1000 ticks passed (guest's 50 are inside user's 100), 150 of them stolen.
        assert_eq!(before.steal_until(&after), 0.15);
        assert_eq!(after.steal_until(&after), 0.0);
    }

    #[test]
    fn a_kernel_without_a_steal_column_gives_none() {
        assert_eq!(parse("cpu  100 0 50 800\n"), None);
        assert_eq!(parse("intr 5\n"), None);
    }
}
