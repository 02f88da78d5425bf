//! What one engine step cost the thread that ran it, beyond its wall time.
//!
//! A slow inter-token gap has three causes an operator must tell apart: the step had more
//! work (more tokens, longer contexts: `duet_engine_step_tokens` and `_attended_tokens`), the
//! engine thread waited for its core while another thread ran there, or the core ran the
//! thread slower or not at all (interrupts, the hypervisor, another tenant's cache and memory
//! traffic). The kernel keeps, per thread, the CPU time it got (`CLOCK_THREAD_CPUTIME_ID`)
//! and the time it spent runnable but waiting (`/proc/thread-self/schedstat`); reading both
//! before and after a step splits its wall time into *on CPU*, *waited for the core*, and the
//! rest.
//!
//! The CPU time comes from the clock, not from schedstat's first field: for a running thread
//! that field is only brought up to date at the scheduler's next tick or switch, and a step
//! that starts just after a switch (fresh) and ends mid-tick (stale) read about half a tick
//! (2 ms at 250 Hz) short every time. Each thread opens its schedstat once and rereads it in
//! place: a `pread` measured 1.7 µs here against 25 µs to open and read it, twice a step, a
//! sizeable share of a small model's sub-millisecond steps. Where either cannot be read (not
//! Linux, `CONFIG_SCHED_INFO` off) the split is `None` and only the wall time counts.

use std::time::{Duration, Instant, SystemTime};

/// A step being timed: [`StepClock::start`] before it, [`StepClock::stop`] after.
pub(crate) struct StepClock {
    started: Instant,
    at: SystemTime,
    sched: Option<Sched>,
}

/// What a step cost its thread.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct StepTimes {
    /// When it started (wall clock, for logs read beside other processes' records).
    pub(crate) at: SystemTime,
    pub(crate) wall: Duration,
    /// CPU time the thread got during the step.
    pub(crate) on_cpu: Option<Duration>,
    /// Time the thread was runnable but another thread had its core.
    pub(crate) waited: Option<Duration>,
}

/// A thread's cumulative CPU time and run-queue wait, in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sched {
    on_cpu: u64,
    waited: u64,
}

impl StepClock {
    /// When the step started (the wall clock's side of it).
    pub(crate) fn started(&self) -> Instant {
        self.started
    }

    pub(crate) fn start() -> StepClock {
        // The wall clock brackets the counters' reads, so the CPU time read is never more
        // than the wall time (the reads, a few microseconds, count as the step's).
        let started = Instant::now();
        let at = SystemTime::now();
        StepClock {
            sched: read_sched(),
            started,
            at,
        }
    }

    pub(crate) fn stop(self) -> StepTimes {
        let after = read_sched();
        let wall = self.started.elapsed();
        let split = match (self.sched, after) {
            (Some(a), Some(b)) => {
                let on_cpu = Duration::from_nanos(b.on_cpu.saturating_sub(a.on_cpu)).min(wall);
                // The kernel adds a wait when it ends: one that began before the step (the
                // thread preempted as it started) counts whole; only the step's part is its.
                let waited =
                    Duration::from_nanos(b.waited.saturating_sub(a.waited)).min(wall - on_cpu);
                Some((on_cpu, waited))
            }
            _ => None,
        };
        StepTimes {
            at: self.at,
            wall,
            on_cpu: split.map(|s| s.0),
            waited: split.map(|s| s.1),
        }
    }
}

fn read_sched() -> Option<Sched> {
    use nix::time::{ClockId, clock_gettime};
    let waited = SCHEDSTAT.with(|file| {
        let file = file.as_ref()?;
        let mut buf = [0u8; 128];
        let n = std::os::unix::fs::FileExt::read_at(file, &mut buf, 0).ok()?;
        parse_schedstat(std::str::from_utf8(&buf[..n]).ok()?)
    })?;
    let cpu = clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID).ok()?;
    let on_cpu =
        u64::try_from(cpu.tv_sec()).ok()? * 1_000_000_000 + u64::try_from(cpu.tv_nsec()).ok()?;
    Some(Sched { on_cpu, waited })
}

thread_local! {
    /// This thread's schedstat, opened by the thread itself (`thread-self` names the thread
    /// that opens it) the first time it times a step; `None` where there is none.
    static SCHEDSTAT: Option<std::fs::File> =
        std::fs::File::open("/proc/thread-self/schedstat").ok();
}

/// The run-queue wait of `/proc/<pid>/task/<tid>/schedstat` (nanoseconds on CPU, nanoseconds
/// waiting on a run queue, timeslices run).
fn parse_schedstat(text: &str) -> Option<u64> {
    let mut fields = text.split_whitespace().map(|f| f.parse::<u64>().ok());
    let _on_cpu = fields.next()??;
    fields.next()?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedstat_gives_the_wait_and_refuses_anything_else() {
        assert_eq!(parse_schedstat("1234567 89 12\n"), Some(89));
        assert_eq!(parse_schedstat(""), None);
        assert_eq!(parse_schedstat("12"), None);
        assert_eq!(parse_schedstat("12 x 3"), None);
    }

    #[test]
    fn a_step_that_computes_is_on_cpu_or_waiting_for_it_for_its_whole_wall_time() {
        if read_sched().is_none() {
            assert!(!std::path::Path::new("/proc/thread-self/schedstat").exists());
            return;
        }
        // Short steps that start just after a switch: where the CPU time was read from
        // schedstat (updated only at ticks and switches) they came out up to a tick short.
        let (mut wall, mut accounted) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..20 {
            std::thread::yield_now();
            let clock = StepClock::start();
            let mut x = 0u64;
            let until = Instant::now() + Duration::from_millis(3);
            while Instant::now() < until {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
            let t = clock.stop();
            let (cpu, waited) = (t.on_cpu.expect("cpu"), t.waited.expect("wait"));
            // The two are parts of the wall time.
            assert!(cpu + waited <= t.wall, "{t:?}");
            wall += t.wall;
            accounted += cpu + waited;
        }
        // A busy thread is on its core or waiting for it; only interrupts and the
        // hypervisor take the rest, a few percent.
        assert!(
            accounted.as_secs_f64() >= 0.85 * wall.as_secs_f64(),
            "{accounted:?} of {wall:?}"
        );
    }
}
