//! The engine's compute threads: a fixed team that every parallel region of a step shares.
//!
//! A decode step of SmolLM2 has about 150 parallel regions (five per layer), each a few tens of
//! microseconds long at batch 1. A general-purpose pool that parks its threads between regions
//! (rayon did) pays a futex wake-up per thread per region, which was most of the time a second
//! thread could save. Here the threads stay awake between regions: after a region each one
//! spins on the team's epoch for [`SPIN`] before it sleeps, so the next region of the same step
//! starts on every thread within a cache-line transfer, and a worker idle between requests
//! still gives its core back.
//!
//! The caller's thread is member 0 of the team: with `threads = 2` a region runs on the
//! caller and one worker. Two ways to share a region:
//!
//! - [`StepPool::for_each`]: items claimed one by one from a shared counter, so uneven items
//!   (attention, whose cost grows with the position, in a decode batch or a long prompt; row
//!   pieces of a product) balance themselves;
//! - [`StepPool::for_each_thread`]: part `i` on thread `i`. A long prefill chunk gives each
//!   thread the same range of tokens in every region but attention, so each reads the
//!   activations it wrote itself, from its own cache.
//!
//! Which thread runs an item never changes a bit of its result (see `kernels`).

#![allow(unsafe_code)]
// The job pointer's lifetime is erased for the workers; `run` states why that is sound.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a thread spins for the next region before it sleeps: longer than the serial
/// gap between two regions of a step (tens of microseconds at decode), short enough that a
/// worker idle between steps gives its core back soon (on a virtual machine a vCPU that
/// spins is a vCPU the host schedules less). 2 ms measured no faster on the engine benchmark.
pub const SPIN: Duration = Duration::from_micros(100);

/// The job of the current region, as the workers see it: a type-erased pointer to the
/// caller's closure, valid from the epoch's publication until the last worker reports done.
type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// Bumped once per region; a worker runs the job when it sees a new value.
    epoch: AtomicU64,
    /// Workers still inside the current region.
    busy: AtomicUsize,
    /// Workers asleep (or about to sleep) on `wake`.
    sleeping: AtomicUsize,
    stop: AtomicBool,
    job: Mutex<Option<SendJob>>,
    lock: Mutex<()>,
    wake: Condvar,
    /// The first panic a worker caught in this region, re-raised on the caller.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

#[derive(Clone, Copy)]
struct SendJob(Job);
// SAFETY: the pointee is `Sync` (so calling it from any thread is sound) and outlives every
// use: `StepPool::run` returns only after every worker has finished with it.
unsafe impl Send for SendJob {}

/// A team of `threads` compute threads (the caller plus `threads - 1` workers).
pub struct StepPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    threads: usize,
}

impl std::fmt::Debug for StepPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepPool")
            .field("threads", &self.threads)
            .finish()
    }
}

impl StepPool {
    /// A team of `threads` (at least 1); its workers are named `duet-compute-N`.
    pub fn new(threads: usize) -> std::io::Result<StepPool> {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            busy: AtomicUsize::new(0),
            sleeping: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            job: Mutex::new(None),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            panic: Mutex::new(None),
        });
        let mut workers = Vec::with_capacity(threads - 1);
        for i in 1..threads {
            let theirs = shared.clone();
            let handle = std::thread::Builder::new()
                .name(format!("duet-compute-{i}"))
                .spawn(move || worker(&theirs, i));
            match handle {
                Ok(h) => workers.push(h),
                Err(e) => {
                    // Stop the ones already started before reporting.
                    drop(StepPool {
                        shared,
                        workers,
                        threads: i,
                    });
                    return Err(e);
                }
            }
        }
        Ok(StepPool {
            shared,
            workers,
            threads,
        })
    }

    /// Threads in the team, the caller included.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Calls `f` once on every thread of the team (the caller included) and returns when all
    /// calls have returned. A panic in any call is re-raised here, after the others finish.
    fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.threads == 1 {
            return f(0);
        }
        let s = &*self.shared;
        // SAFETY (lifetime erasure): the pointer is published to the workers below and this
        // function does not return until `busy` is back to 0, that is, until every worker has
        // returned from its call; no worker reads the job of an epoch it has finished.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(SendJob(job));
        s.busy.store(self.threads - 1, Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        // Dekker with the worker's `sleeping` increment (both SeqCst): either we see it and
        // wake them, or the worker sees the new epoch before it waits.
        if s.sleeping.load(Ordering::SeqCst) > 0 {
            let _guard = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| f(0)));
        let mut spins = 0u32;
        while s.busy.load(Ordering::Acquire) != 0 {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) {
                // Only reached when a worker was descheduled: let it have the core.
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
        if let Err(p) = mine {
            resume_unwind(p);
        }
        if let Some(p) = s.panic.lock().unwrap_or_else(|e| e.into_inner()).take() {
            resume_unwind(p);
        }
    }

    /// Calls `f` on every item, spread over the team: each thread claims the next unclaimed
    /// item until none is left. Returns when all are done.
    pub fn for_each<T: Send>(&self, items: Vec<T>, f: impl Fn(T) + Sync) {
        self.for_each_init(items, || (), |(), item| f(item));
    }

    /// Calls `f(part)` for part `i` of `parts` on thread `i` of the team (the caller is 0), at
    /// most one part per thread. A long step gives every region the same token range per
    /// thread, so the activations a thread's part reads were written by that thread, in its
    /// own cache: claimed dynamically, a two-thread 512-token prefill scaled 1.2-1.45x instead
    /// of 1.5-1.9x, the threads reading each other's rows through the shared cache.
    pub fn for_each_thread<T: Send>(&self, parts: Vec<T>, f: impl Fn(T) + Sync) {
        assert!(parts.len() <= self.threads, "more parts than threads");
        if self.threads == 1 || parts.len() <= 1 {
            return parts.into_iter().for_each(f);
        }
        let slots: Vec<Mutex<Option<T>>> = parts.into_iter().map(|t| Mutex::new(Some(t))).collect();
        self.run(&|me| {
            let part = slots
                .get(me)
                .and_then(|slot| slot.lock().unwrap_or_else(|e| e.into_inner()).take());
            if let Some(part) = part {
                f(part);
            }
        });
    }

    /// [`for_each`](Self::for_each) with per-thread state made by `init` (scratch buffers),
    /// made once per thread that claims an item.
    pub fn for_each_init<T: Send, S>(
        &self,
        items: Vec<T>,
        init: impl Fn() -> S + Sync,
        f: impl Fn(&mut S, T) + Sync,
    ) {
        if items.is_empty() {
            return;
        }
        if self.threads == 1 || items.len() == 1 {
            let mut state = init();
            for item in items {
                f(&mut state, item);
            }
            return;
        }
        let slots: Vec<Mutex<Option<T>>> = items.into_iter().map(|t| Mutex::new(Some(t))).collect();
        let next = AtomicUsize::new(0);
        self.run(&|_| {
            let mut state = None;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(slot) = slots.get(i) else { break };
                // Each slot is claimed once (the counter hands out each index once), so the
                // lock is never contended; it only moves the item to this thread.
                let item = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
                if let Some(item) = item {
                    f(state.get_or_insert_with(&init), item);
                }
            }
        });
    }
}

impl Drop for StepPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _guard = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            // A worker only ends by seeing `stop`; its panics were caught per job.
            let _ = w.join();
        }
    }
}

fn worker(s: &Shared, me: usize) {
    let mut seen = 0u64;
    loop {
        // Spin for the next region, then sleep until woken.
        let started = Instant::now();
        let mut spins = 0u32;
        let epoch = loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen || s.stop.load(Ordering::Relaxed) {
                break e;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) && started.elapsed() > SPIN {
                s.sleeping.fetch_add(1, Ordering::SeqCst);
                let mut guard = s.lock.lock().unwrap_or_else(|e| e.into_inner());
                while s.epoch.load(Ordering::SeqCst) == seen && !s.stop.load(Ordering::SeqCst) {
                    guard = s.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
                }
                drop(guard);
                s.sleeping.fetch_sub(1, Ordering::SeqCst);
            } else {
                std::hint::spin_loop();
            }
        };
        if s.stop.load(Ordering::SeqCst) {
            return;
        }
        seen = epoch;
        let job = *s.job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(SendJob(job)) = job {
            // SAFETY: the caller of `run` keeps the closure alive until `busy` reaches 0,
            // which cannot happen before this call returns and we decrement it below.
            let result = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)(me) }));
            if let Err(p) = result {
                let mut first = s.panic.lock().unwrap_or_else(|e| e.into_inner());
                first.get_or_insert(p);
            }
        }
        s.busy.fetch_sub(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_runs_once_on_any_team_size() {
        for threads in [1, 2, 3, 5] {
            let pool = StepPool::new(threads).expect("pool");
            for round in 0..200 {
                let n = round % 17;
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.for_each((0..n).collect(), |i: usize| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn items_can_borrow_disjoint_parts_of_the_callers_buffer() {
        let pool = StepPool::new(3).expect("pool");
        let mut out = vec![0usize; 1000];
        pool.for_each(out.chunks_mut(7).enumerate().collect(), |(i, c)| c.fill(i));
        assert!(out.iter().enumerate().all(|(k, &v)| v == k / 7));
    }

    #[test]
    fn workers_that_slept_wake_for_the_next_region() {
        let pool = StepPool::new(2).expect("pool");
        let ran_on = Mutex::new(std::collections::HashSet::new());
        // Poll until both threads have been seen running items, past the spin window, so the
        // worker went to sleep in between and had to be woken.
        let deadline = Instant::now() + Duration::from_secs(20);
        while ran_on.lock().expect("lock").len() < 2 {
            assert!(Instant::now() < deadline, "the worker never ran an item");
            std::thread::sleep(SPIN * 3);
            pool.for_each((0..64).collect(), |_: usize| {
                let spin = Instant::now();
                while spin.elapsed() < Duration::from_micros(50) {}
                ran_on
                    .lock()
                    .expect("lock")
                    .insert(std::thread::current().id());
            });
        }
    }

    #[test]
    fn a_panic_in_a_worker_reaches_the_caller_and_the_team_survives() {
        let pool = StepPool::new(2).expect("pool");
        let caller = std::thread::current().id();
        let worker_took_one = AtomicBool::new(false);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.for_each((0..64).collect(), |i: usize| {
                if std::thread::current().id() != caller {
                    worker_took_one.store(true, Ordering::SeqCst);
                    panic!("item {i}");
                }
                // The caller waits (bounded) for the worker to claim an item, so the test
                // does not depend on the worker being scheduled in time.
                let deadline = Instant::now() + Duration::from_secs(20);
                while !worker_took_one.load(Ordering::SeqCst) && Instant::now() < deadline {
                    std::hint::spin_loop();
                }
            })
        }));
        assert!(r.is_err(), "the worker's panic was lost");
        let count = AtomicUsize::new(0);
        pool.for_each((0..10).collect(), |_: usize| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 10);
    }
}
