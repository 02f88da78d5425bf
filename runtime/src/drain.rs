//! Graceful drain: what a node does between SIGTERM and exit, and what an operator asks of a
//! live node (`duet drain NODE`, `duet resume NODE`).
//!
//! On SIGTERM (or `duet drain`) the node marks itself draining. Serving actors see the flag (workers put it in
//! their load reports, so routers stop sending them new requests; a router answers new HTTP
//! requests 503) and report, through probes, how much work they still hold. The node exits
//! once every probe has read zero for a quiet window (requests sent just before the routers
//! learned of the drain still arrive and are served), or when the drain timeout passes.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// How long every probe must read zero before the node counts as idle: several load-report
/// intervals, so that a request routed just before the drain was seen has arrived.
pub const QUIET_WINDOW: Duration = Duration::from_millis(600);

/// A probe: how many requests an actor still holds.
type Probe = Box<dyn Fn() -> usize + Send + Sync>;

/// A resume asked of a node that is shutting down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the node is shutting down: it drains to exit and cannot resume")]
pub struct ResumeRefused;

/// A node's drain state (one per node, in its context).
pub struct Drain {
    draining: AtomicBool,
    /// The node is on its way out (a signal or `/v1/shutdown`): a resume would be a lie.
    exiting: AtomicBool,
    /// When the drain started (for [`Drain::is_empty`]).
    since: Mutex<Option<std::time::Instant>>,
    timeout_ms: AtomicU64,
    probes: Mutex<BTreeMap<String, Probe>>,
}

impl Default for Drain {
    fn default() -> Self {
        Drain {
            draining: AtomicBool::new(false),
            exiting: AtomicBool::new(false),
            since: Mutex::new(None),
            timeout_ms: AtomicU64::new(30_000),
            probes: Mutex::new(BTreeMap::new()),
        }
    }
}

impl Drain {
    /// Whether the node is draining (admits nothing new).
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Starts draining (an operator's drain: the node stays up and may resume).
    pub fn start(&self) {
        let mut since = self.since.lock().unwrap_or_else(|p| p.into_inner());
        if !self.draining.swap(true, Ordering::SeqCst) {
            *since = Some(std::time::Instant::now());
        }
    }

    /// Draining, holding nothing, and long enough since the drain started that every router
    /// has heard of it (a request routed just before still arrives within [`QUIET_WINDOW`]).
    pub fn is_empty(&self) -> bool {
        let since = *self.since.lock().unwrap_or_else(|p| p.into_inner());
        self.is_draining()
            && since.is_some_and(|t| t.elapsed() >= QUIET_WINDOW)
            && self.busy().is_empty()
    }

    /// Starts the drain that ends in the node's exit.
    pub fn start_exit(&self) {
        self.exiting.store(true, Ordering::SeqCst);
        self.start();
    }

    /// Whether the node is draining to exit.
    pub fn is_exiting(&self) -> bool {
        self.exiting.load(Ordering::SeqCst)
    }

    /// Takes new work again after an operator's drain. Refused once the node is exiting.
    pub fn resume(&self) -> Result<(), ResumeRefused> {
        if self.is_exiting() {
            return Err(ResumeRefused);
        }
        let mut since = self.since.lock().unwrap_or_else(|p| p.into_inner());
        self.draining.store(false, Ordering::SeqCst);
        *since = None;
        Ok(())
    }

    /// The longest the node waits for its work (`serving.shutdown_drain_secs`, set by the
    /// serving actors; 30 s until then).
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    /// Sets the drain timeout.
    pub fn set_timeout(&self, timeout: Duration) {
        self.timeout_ms
            .store(timeout.as_millis() as u64, Ordering::Relaxed);
    }

    /// Installs (or replaces, for a restarted actor) the probe named `name`.
    pub fn set_probe(&self, name: &str, probe: impl Fn() -> usize + Send + Sync + 'static) {
        self.lock().insert(name.to_string(), Box::new(probe));
    }

    /// Work held now, by probe (only those holding some).
    pub fn busy(&self) -> BTreeMap<String, usize> {
        self.lock()
            .iter()
            .map(|(name, probe)| (name.clone(), probe()))
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// Waits until every probe has read zero for [`QUIET_WINDOW`], or the timeout passes;
    /// returns what was still held then (empty when the drain completed).
    pub async fn wait_idle(&self) -> BTreeMap<String, usize> {
        let deadline = tokio::time::Instant::now() + self.timeout();
        let mut quiet_since: Option<tokio::time::Instant> = None;
        loop {
            let now = tokio::time::Instant::now();
            let busy = self.busy();
            if busy.is_empty() {
                let since = *quiet_since.get_or_insert(now);
                if now.duration_since(since) >= QUIET_WINDOW {
                    return busy;
                }
            } else {
                quiet_since = None;
            }
            if now >= deadline {
                return busy;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Probe>> {
        self.probes.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    #[tokio::test]
    async fn waits_for_the_probes_then_a_quiet_window() {
        let drain = Drain::default();
        let held = Arc::new(AtomicUsize::new(2));
        let h = held.clone();
        drain.set_probe("worker", move || h.load(Ordering::SeqCst));
        let start = tokio::time::Instant::now();
        let release = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            held.store(0, Ordering::SeqCst);
        };
        let (left, ()) = tokio::join!(drain.wait_idle(), release);
        assert!(left.is_empty());
        assert!(start.elapsed() >= Duration::from_millis(200) + QUIET_WINDOW);
    }

    #[test]
    fn an_operators_drain_resumes_but_an_exit_does_not() {
        let drain = Drain::default();
        drain.start();
        assert!(drain.is_draining());
        assert_eq!(drain.resume(), Ok(()));
        assert!(!drain.is_draining());
        drain.start_exit();
        assert_eq!(drain.resume(), Err(ResumeRefused));
        assert!(drain.is_draining() && drain.is_exiting());
    }

    #[tokio::test]
    async fn gives_up_at_the_timeout_and_says_what_was_held() {
        let drain = Drain::default();
        drain.set_timeout(Duration::from_millis(300));
        drain.set_probe("worker", || 3);
        let left = drain.wait_idle().await;
        assert_eq!(left.get("worker"), Some(&3));
    }
}
