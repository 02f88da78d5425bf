//! The engine step log (`serving.step_log = "DIR"`): one JSON line per engine step of a worker,
//! in `DIR/NODE.steps.jsonl`.
//!
//! The step histograms say how the steps' times spread; this says why one step was slow: its
//! size (tokens, positions attended) beside its wall time, the CPU time the engine thread got
//! and the time it waited for its core (see [`crate::step_clock`]), with the wall clock time it
//! started, so a step lines up with other nodes' logs and a client's token times.
//! `duet bench --experiment interference` reads it to split the decode steps' jitter into
//! what the batch's shape explains and what the machine added.
//!
//! Off by default. A line is written and flushed per step (one `write`, microseconds against a
//! step's milliseconds); a log that cannot be written is reported once and then skipped: the
//! engine does not stop for it.

use std::io::Write;
use std::path::{Path, PathBuf};

use duet_engine::scheduler::StepShape;
use serde::{Deserialize, Serialize};

use crate::step_clock::StepTimes;

/// One line of the log.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// When the step started, microseconds since the Unix epoch.
    pub at_us: u64,
    /// Its wall time, microseconds.
    pub wall_us: u64,
    /// CPU time the engine thread got during it (`null` where the kernel does not say).
    pub cpu_us: Option<u64>,
    /// Time the engine thread was runnable but another thread had its core.
    pub wait_us: Option<u64>,
    /// Tokens computed: one per decoding sequence, a chunk's length per prompt.
    pub tokens: usize,
    /// KV positions those tokens attended over, summed.
    pub attended: usize,
}

impl StepRecord {
    pub(crate) fn new(t: &StepTimes, shape: StepShape) -> StepRecord {
        let us = |d: std::time::Duration| d.as_micros().min(u64::MAX as u128) as u64;
        StepRecord {
            at_us: t.at.duration_since(std::time::UNIX_EPOCH).map_or(0, us),
            wall_us: us(t.wall),
            cpu_us: t.on_cpu.map(us),
            wait_us: t.waited.map(us),
            tokens: shape.tokens,
            attended: shape.attended,
        }
    }
}

/// The log file of one node.
pub fn path(dir: &Path, node: &str) -> PathBuf {
    dir.join(format!("{node}.steps.jsonl"))
}

/// An open step log, or nothing when it is off or broke.
pub(crate) struct StepLog {
    file: Option<(PathBuf, std::fs::File)>,
}

impl StepLog {
    /// Opens (appends to) `DIR/NODE.steps.jsonl` when `dir` is set.
    pub(crate) fn open(dir: Option<&Path>, node: &str) -> StepLog {
        let file = dir.and_then(|dir| {
            let p = path(dir, node);
            let opened = std::fs::create_dir_all(dir).and_then(|()| {
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&p)
            });
            match opened {
                Ok(f) => Some((p, f)),
                Err(e) => {
                    tracing::warn!(path = %p.display(), error = %e, "serving.step_log: cannot open the step log; steps go unlogged");
                    None
                }
            }
        });
        StepLog { file }
    }

    pub(crate) fn write(&mut self, t: &StepTimes, shape: StepShape) {
        let Some((p, f)) = &mut self.file else {
            return;
        };
        let mut line = serde_json::to_vec(&StepRecord::new(t, shape)).unwrap_or_default();
        line.push(b'\n');
        if let Err(e) = f.write_all(&line) {
            tracing::warn!(path = %p.display(), error = %e, "serving.step_log: cannot write the step log; steps go unlogged from now");
            self.file = None;
        }
    }
}

/// Reads a step log; lines that do not parse (a line cut by a kill) are skipped.
pub fn read(path: &Path) -> std::io::Result<Vec<StepRecord>> {
    Ok(std::fs::read_to_string(path)?
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime};

    #[test]
    fn a_step_written_is_read_back_and_a_cut_line_is_skipped() {
        let dir = std::env::temp_dir().join(format!("duet-step-log-{}", std::process::id()));
        let mut log = StepLog::open(Some(&dir), "d0");
        let t = StepTimes {
            at: SystemTime::UNIX_EPOCH + Duration::from_micros(1_700_000_000_000_123),
            wall: Duration::from_micros(31_500),
            on_cpu: Some(Duration::from_micros(30_000)),
            waited: Some(Duration::from_micros(900)),
        };
        let shape = StepShape {
            tokens: 4,
            attended: 2500,
        };
        log.write(&t, shape);
        log.write(
            &StepTimes {
                on_cpu: None,
                waited: None,
                ..t
            },
            shape,
        );
        let p = path(&dir, "d0");
        std::fs::OpenOptions::new()
            .append(true)
            .open(&p)
            .and_then(|mut f| f.write_all(b"{\"at_us\":17"))
            .expect("append a cut line");
        let read = read(&p).expect("read");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(read.len(), 2);
        assert_eq!(
            read[0],
            StepRecord {
                at_us: 1_700_000_000_000_123,
                wall_us: 31_500,
                cpu_us: Some(30_000),
                wait_us: Some(900),
                tokens: 4,
                attended: 2500
            }
        );
        assert_eq!((read[1].cpu_us, read[1].wait_us), (None, None));
    }

    #[test]
    fn no_directory_no_log() {
        let mut log = StepLog::open(None, "d0");
        assert!(log.file.is_none());
        log.write(
            &StepTimes {
                at: SystemTime::now(),
                wall: Duration::from_millis(1),
                on_cpu: None,
                waited: None,
            },
            StepShape {
                tokens: 1,
                attended: 1,
            },
        );
    }
}
