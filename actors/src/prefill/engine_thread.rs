//! The prefill worker's engine thread: its flights (requests being prefilled for a decode
//! worker), the chunked prefill steps, and the jobs each step hands the KV sender.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use duet_engine::Runner;
use duet_gpu::PageId;
use duet_runtime::metrics as m;
use duet_transport::{AbortReason, PageRun, TransferLedger, coalesce};

use super::hub::SenderHub;
use super::sender::{Job, Target};
use super::{Cmd, Holding};
use crate::outbox::{Outbox, Outgoing};
use crate::protocol::{
    AbortAck, LoadReport, PrefillStart, ServingError, TransferDone, TransferFailed, WORKER_SERVICE,
    kinds,
};

/// One request being prefilled for a decode worker.
pub(super) struct Flight {
    pub(super) start: PrefillStart,
    pub(super) decode: String,
    /// This side's ledger key (source pins).
    pub(super) key: u64,
    /// Next page index of the sequence to send (starts past decode's cached prefix).
    pub(super) next_page: usize,
    /// Index of the first page decode does not hold (the notice's pages start there).
    pub(super) skip: usize,
    pub(super) matched: Instant,
    pub(super) first_chunk: Option<Instant>,
    /// Set once the flight is aborted, and shared with every job of it queued on the
    /// sender's lane: those jobs are skipped there instead of written (decode has revoked or
    /// will revoke the grant, so each would be dropped on arrival, after waiting its turn
    /// behind the others). The Drain queued by the abort still fences what was written before.
    pub(super) aborted: Arc<AtomicBool>,
    /// The request's span here (child of the router's), and its queue wait until the first
    /// chunk computes.
    pub(super) span: tracing::Span,
    pub(super) queue_wait: Option<tracing::Span>,
}

impl Flight {
    /// Whether the flight was aborted (its Drain is queued or done).
    pub(super) fn aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }
}

pub(super) struct PrefillCore {
    pub(super) runner: Runner,
    pub(super) ledger: TransferLedger,
    pub(super) jobs: Arc<SenderHub>,
    /// This worker's incarnation (its jobs go only to a sender thread built for it).
    pub(super) worker: u64,
    pub(super) outbox: Outbox,
    /// Control messages of this turn, handed to the outbox at its end.
    pub(super) sends: Vec<Outgoing>,
    pub(super) load: Arc<Mutex<LoadReport>>,
    /// What the heartbeats tell decode nodes (see [`Holding`]).
    pub(super) holding: Arc<Mutex<Holding>>,
    pub(super) flights: HashMap<u64, Flight>,
    /// (decode node, room) -> sequence.
    pub(super) rooms: HashMap<(String, u64), u64>,
    pub(super) next_seq: u64,
    pub(super) epoch: Instant,
    /// The time of this turn (see [`PrefillCore::turn`]).
    pub(super) now: Instant,
    pub(super) stop: Arc<std::sync::atomic::AtomicBool>,
    /// One line per engine step, where `serving.step_log` asks for it.
    pub(super) step_log: crate::step_log::StepLog,
}

impl PrefillCore {
    pub(super) fn run(mut self, cmds: std_mpsc::Receiver<Cmd>) {
        loop {
            if self.stop.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            let first = if self.runner.scheduler.is_idle() {
                match cmds.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return,
                }
            } else {
                None
            };
            let batch: Vec<Cmd> = first
                .into_iter()
                .chain(std::iter::from_fn(|| cmds.try_recv().ok()))
                .collect();
            if batch.iter().any(|c| matches!(c, Cmd::Shutdown)) {
                return;
            }
            for message in self.turn(Instant::now(), batch) {
                self.outbox.queue(message);
            }
        }
    }

    /// One turn of the engine thread at `now` (the only clock reading its logic sees; the
    /// engine step's own duration is measured for metrics): the commands that arrived, one
    /// prefill step (its pages handed to the KV sender), the load report. Returns the control
    /// messages for peers: the turn itself sends none.
    pub(super) fn turn(&mut self, now: Instant, cmds: Vec<Cmd>) -> Vec<Outgoing> {
        self.now = self.now.max(now);
        // The prefix cache's keep windows run on this thread's time.
        self.runner.cache.tick(self.now_ms());
        for cmd in cmds {
            self.command(cmd);
        }
        if !self.runner.scheduler.is_idle() {
            self.step();
        }
        self.publish_load();
        std::mem::take(&mut self.sends)
    }

    /// Milliseconds since the thread started, at this turn.
    fn now_ms(&self) -> u64 {
        self.now.duration_since(self.epoch).as_millis() as u64
    }

    /// Queues a control message (sent at the end of the turn).
    fn send(
        &mut self,
        node: &str,
        service: &'static str,
        kind: &'static str,
        body: &impl serde::Serialize,
    ) {
        self.sends.push(Outgoing::new(node, service, kind, body));
    }

    pub(super) fn target(f: &Flight) -> Target {
        Target {
            span: f.span.clone(),
            node: f.decode.clone(),
            incarnation: f.start.notice.incarnation,
            endpoint: f.start.notice.endpoint.clone(),
            backend: f.start.backend,
            room: f.start.notice.room,
            attempt: f.start.notice.attempt,
            grant: f.start.notice.grant(),
            aborted: f.aborted.clone(),
        }
    }

    pub(super) fn command(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Start(start) => {
                let start = *start;
                self.next_seq += 1;
                let seq = self.next_seq;
                let decode = start.request.decode.clone();
                let room = start.notice.room;
                let ps = self.runner.engine.options().page_size;
                let attempt = start.notice.attempt;
                let fail_with = |me: &mut Self, error: ServingError| {
                    let failed = TransferFailed::new(room, Some(attempt), &error);
                    me.send(&decode, WORKER_SERVICE, kinds::FAILED, &failed);
                };
                let fail =
                    |me: &mut Self, error: String| fail_with(me, ServingError::Prefill(error));
                if start
                    .notice
                    .prefill_incarnation
                    .is_some_and(|i| i != self.worker)
                {
                    // Decode closes what it noticed to an earlier worker when it hears of this
                    // one: writing it now could land in pages already given back.
                    let e = "prefill bootstrap: the notice was for an earlier prefill worker (it restarted)";
                    return fail_with(self, ServingError::Restart(e.into()));
                }
                let n = start.request.prompt.len();
                let skip = start.notice.decode_prefix_len / ps;
                if start.notice.decode_prefix_len % ps != 0
                    || skip + start.notice.pages.len() != n.div_ceil(ps)
                {
                    let e = format!(
                        "notice: its {} pages after a prefix of {} do not fit a prompt of {n} tokens",
                        start.notice.pages.len(),
                        start.notice.decode_prefix_len
                    );
                    return fail(self, e);
                }
                let alloc = &mut self.runner.engine.pool.alloc;
                let key = match self.ledger.open(room, &decode, Vec::new(), false, alloc) {
                    Ok(k) => k,
                    Err(e) => return fail(self, format!("ledger: {e}")),
                };
                if let Err(e) = self.runner.scheduler.submit_prefill(
                    seq,
                    start.request.prompt.clone(),
                    start.request.params.clone(),
                    start.request.resume,
                ) {
                    let _ = self
                        .ledger
                        .abort(key, AbortReason::ProducerFailure, 0, alloc);
                    let _ = self.ledger.drained(key, alloc);
                    return fail(self, format!("admission: {e}"));
                }
                self.rooms.insert((decode.clone(), room), seq);
                let span = tracing::info_span!(
                    "prefill",
                    room,
                    attempt = start.notice.attempt,
                    decode = %decode,
                    prompt_tokens = n,
                    decode_prefix_len = start.notice.decode_prefix_len,
                    backend = start.backend.name(),
                );
                duet_runtime::telemetry::follow(&span, &start.trace);
                let queue_wait = Some(tracing::info_span!(parent: &span, "queue_wait"));
                self.flights.insert(
                    seq,
                    Flight {
                        start,
                        decode,
                        key,
                        next_page: skip,
                        skip,
                        matched: self.now,
                        first_chunk: None,
                        aborted: Arc::default(),
                        span,
                        queue_wait,
                    },
                );
            }
            Cmd::Abort { decode, abort } => {
                let Some(attempt) = abort.attempt else { return };
                let seq = self.rooms.get(&(decode.clone(), abort.room)).copied();
                match seq.and_then(|s| self.flights.get(&s).map(|f| (s, f))) {
                    Some((seq, f)) if f.start.notice.attempt == attempt => {
                        self.abort_flight(seq, AbortReason::ConsumerFailure, None);
                    }
                    _ => {
                        // Finished or never started: no write of it is pending.
                        self.send(
                            &decode,
                            WORKER_SERVICE,
                            kinds::ABORT_ACK,
                            &AbortAck {
                                room: abort.room,
                                attempt,
                            },
                        );
                    }
                }
            }
            // Aborted after its Finish was queued: the Drain behind it releases the pins (a
            // completion here would be refused by the ledger, and the flight forgotten with
            // its pages pinned for good).
            Cmd::Sent { seq } if self.flights.get(&seq).is_some_and(Flight::aborted) => {}
            Cmd::Sent { seq } => {
                if let Some(f) = self.flights.remove(&seq) {
                    self.rooms.remove(&(f.decode.clone(), f.start.notice.room));
                    let _ = self
                        .ledger
                        .complete(f.key, &mut self.runner.engine.pool.alloc);
                    self.ledger.prune();
                    metrics::counter!(m::TRANSFERS, "side" => "prefill", "outcome" => "completed")
                        .increment(1);
                }
            }
            Cmd::Drained { seq } => {
                if let Some(f) = self.flights.remove(&seq) {
                    self.rooms.remove(&(f.decode.clone(), f.start.notice.room));
                    let _ = self
                        .ledger
                        .drained(f.key, &mut self.runner.engine.pool.alloc);
                    self.ledger.prune();
                }
            }
            Cmd::SendFailed { seq, error } => {
                let e = ServingError::Prefill(format!("transfer: {error}"));
                self.abort_flight(seq, AbortReason::ConsumerFailure, Some(e));
            }
            // Every flight may have had jobs in the lost queue: each drains through the new
            // thread (its fence covers what that thread wrote; the old one is joined).
            Cmd::SenderRestarted => self.fail_all(ServingError::Restart(
                "prefill transfer: the KV sender restarted".into(),
            )),
            Cmd::Shutdown => {}
        }
    }

    /// Stops computing a flight and has the sender drain it (then acknowledge, or report the
    /// failure, to decode).
    pub(super) fn abort_flight(
        &mut self,
        seq: u64,
        reason: AbortReason,
        failed: Option<ServingError>,
    ) {
        let now = self.now_ms();
        let Some(f) = self.flights.get_mut(&seq) else {
            return;
        };
        if f.aborted() {
            // Asked again (a drain fence, or the sender restarted and its queue was lost):
            // drain again; a second acknowledgement is ignored by decode.
            let to = Self::target(f);
            let _ = self.jobs.send(self.worker, Job::Drain { seq, to, failed });
            return;
        }
        f.aborted.store(true, Ordering::SeqCst);
        let key = f.key;
        let to = Self::target(f);
        let _ = self.runner.abort(seq);
        let _ = self
            .ledger
            .abort(key, reason, now, &mut self.runner.engine.pool.alloc);
        metrics::counter!(m::TRANSFERS, "side" => "prefill", "outcome" => "aborted").increment(1);
        metrics::counter!(m::TRANSFER_ABORTS, "side" => "prefill", "reason" => reason.name())
            .increment(1);
        let _ = self.jobs.send(self.worker, Job::Drain { seq, to, failed });
    }

    pub(super) fn step(&mut self) {
        let ps = self.runner.engine.options().page_size;
        let plan = match self
            .runner
            .scheduler
            .plan(&mut self.runner.engine.pool.alloc, &mut self.runner.cache)
        {
            Ok(p) => p,
            Err(e) => return self.fail_all(ServingError::Prefill(format!("plan: {e}"))),
        };
        if plan.items.is_empty() {
            return;
        }
        let clock = crate::step_clock::StepClock::start();
        let started = clock.started();
        let mut chunk_spans = Vec::with_capacity(plan.items.len());
        for it in &plan.items {
            if let Some(f) = self.flights.get_mut(&it.seq) {
                if f.first_chunk.is_none() {
                    f.first_chunk = Some(started);
                    f.queue_wait = None;
                    metrics::histogram!(m::PREFILL_QUEUE_WAIT)
                        .record(started.duration_since(f.matched).as_secs_f64());
                }
                chunk_spans.push(tracing::info_span!(
                    parent: &f.span,
                    "chunk",
                    tokens = it.len,
                    start = it.start,
                    last = it.sample,
                ));
            }
        }
        // The last chunk of a prompt streams layer by layer during its own compute, so what is
        // left once it ends is one layer's copy and the fence. Its pages are pinned first.
        let mut finals: Vec<(u64, Target, Arc<Vec<PageRun>>, usize)> = Vec::new();
        for it in plan.items.iter().filter(|it| it.sample) {
            let upto = (it.start + it.len).div_ceil(ps);
            if let Some((to, runs, pages_so_far)) = self.claim_pages(it.seq, upto) {
                finals.push((it.seq, to, Arc::new(runs), pages_so_far));
            }
        }
        let logits = {
            let chunks = self.runner.scheduler.chunks(&plan);
            let (jobs, worker) = (self.jobs.clone(), self.worker);
            let mut kv_done = |layer: usize| {
                for (seq, to, runs, pages_so_far) in &finals {
                    let _ = jobs.send(
                        worker,
                        Job::Layer {
                            seq: *seq,
                            to: to.clone(),
                            runs: runs.clone(),
                            layer,
                            pages_so_far: *pages_so_far,
                        },
                    );
                }
            };
            self.runner.engine.step_observed(&chunks, &mut kv_done)
        };
        let logits = match logits {
            Ok(l) => l,
            Err(e) => return self.fail_all(ServingError::Prefill(format!("step: {e}"))),
        };
        let compute_end = Instant::now();
        drop(chunk_spans);
        self.holding.lock().unwrap_or_else(|p| p.into_inner()).steps += 1;
        metrics::counter!(m::PREFILL_CHUNKS).increment(plan.items.len() as u64);
        // Ship the pages this step filled, before commit may end the sequence (the pins keep
        // them from reuse until the sender has read them).
        for it in plan.items.iter().filter(|it| !it.sample) {
            // Only full pages: the partial last one is rewritten by the next chunk.
            let upto = (it.start + it.len) / ps;
            if let Some((to, runs, pages_so_far)) = self.claim_pages(it.seq, upto) {
                let _ = self.jobs.send(
                    self.worker,
                    Job::Write {
                        seq: it.seq,
                        to,
                        runs,
                        pages_so_far,
                    },
                );
            }
        }
        let tok = &self.runner.engine.model.tokenizer;
        let events = match self.runner.scheduler.commit(
            &plan,
            &logits,
            tok,
            &mut self.runner.engine.pool.alloc,
            &mut self.runner.cache,
        ) {
            Ok(e) => e,
            Err(e) => return self.fail_all(ServingError::Prefill(format!("commit: {e}"))),
        };
        crate::worker::record_step("prefill", &clock.stop(), plan.shape(), &mut self.step_log);
        for ev in events {
            let (Some(sampler), Some(f)) = (ev.handoff, self.flights.get(&ev.seq)) else {
                continue;
            };
            if let Some(first) = f.first_chunk {
                metrics::histogram!(m::PREFILL_SECONDS)
                    .record(compute_end.duration_since(first).as_secs_f64());
            }
            let done = TransferDone {
                room: f.start.notice.room,
                attempt: f.start.notice.attempt,
                token: ev.token,
                logprob: ev.logprob,
                sampler,
                bytes: 0,
                prefill_cached: ev.cached_tokens,
                checksums: Vec::new(),
                top: ev.top,
            };
            let _ = self.jobs.send(
                self.worker,
                Job::Finish {
                    seq: ev.seq,
                    to: Self::target(f),
                    done,
                    compute_end,
                },
            );
        }
    }

    /// The next pages of `seq` up to page index `upto`, pinned at the source and paired with
    /// decode's pages: where they go, as runs, and how many of decode's pages they fill then.
    /// `None` when there is nothing new to send (or the flight was aborted).
    pub(super) fn claim_pages(
        &mut self,
        seq: u64,
        upto: usize,
    ) -> Option<(Target, Vec<PageRun>, usize)> {
        let f = self.flights.get_mut(&seq)?;
        let pages = self.runner.scheduler.pages(seq)?;
        if f.aborted() || upto <= f.next_page || pages.len() < upto {
            return None;
        }
        let src: Vec<PageId> = pages[f.next_page..upto].to_vec();
        let dst = &f.start.notice.pages[f.next_page - f.skip..upto - f.skip];
        let runs = coalesce(src.iter().copied().zip(dst.iter().copied()));
        if let Err(e) = self
            .ledger
            .extend(f.key, &src, &mut self.runner.engine.pool.alloc)
        {
            tracing::error!(error = %e, "cannot pin source pages");
            return None;
        }
        f.next_page = upto;
        Some((Self::target(f), runs, upto - f.skip))
    }

    /// Fails every flight with `error` (an engine step that cannot run, a sender restart).
    pub(super) fn fail_all(&mut self, error: ServingError) {
        tracing::error!(%error, "prefill failed");
        let seqs: Vec<u64> = self.flights.keys().copied().collect();
        for seq in seqs {
            self.abort_flight(seq, AbortReason::ProducerFailure, Some(error.clone()));
        }
    }

    pub(super) fn publish_load(&self) {
        let runner = &self.runner;
        let stats = runner.engine.pool.alloc.stats();
        let (waiting, running) = runner.scheduler.queue_lengths();
        let mut l = self.load.lock().unwrap_or_else(|p| p.into_inner());
        l.queued_tokens = runner.scheduler.queued_tokens();
        l.waiting = waiting;
        l.running = running;
        l.in_flight = self.flights.len() + waiting + running;
        l.free_pages = stats.free;
        l.pinned_pages = stats.pinned;
        l.cached_pages = runner.cache.evictable(&runner.engine.pool.alloc);
        l.quarantined_pages = self.ledger.quarantined_pages();
        metrics::gauge!(m::KV_PAGES_KEPT).set(runner.cache.kept() as f64);
        metrics::counter!(m::MIGRATION_KEEPS_BROKEN).absolute(runner.cache.keeps_broken);
        drop(l);
        let mut h = self.holding.lock().unwrap_or_else(|p| p.into_inner());
        h.by_decode.clear();
        for f in self.flights.values().filter(|f| !f.aborted()) {
            h.by_decode
                .entry(f.decode.clone())
                .or_default()
                .push(f.start.notice.attempt);
        }
    }
}
