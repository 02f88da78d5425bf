//! The decode worker's engine thread: its state, its command loop, and the engine steps of
//! the continuous batch. Everything that touches pages (the scheduler, the prefix cache, the
//! transfer ledger) lives on this thread, so page bookkeeping needs no locks. The receiving
//! half of disaggregation (prealloc, transfers, their ends) is in `transfers.rs`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use duet_engine::Runner;
use duet_transport::{AbortReason, Endpoint};
use tokio::sync::mpsc;

use super::attempts::{Ack, Attempts};
use super::{Cmd, stale};
use crate::outbox::{Outbox, Outgoing};
use crate::protocol::{Generate, LoadReport, PrefillPeer, ServingError, TokenItem, TransferDone};

/// A request waiting for pages.
pub(super) struct Prealloc {
    pub(super) seq: u64,
    pub(super) router: String,
    pub(super) generate: Generate,
    pub(super) peer: PrefillPeer,
    pub(super) since: Instant,
}

/// A request whose KV is on its way (what decode keeps of it beside the attempt, its pages
/// and its progress, which [`Attempts`] holds).
#[derive(Debug)]
pub(super) struct Transfer {
    pub(super) seq: u64,
    pub(super) router: String,
    pub(super) generate: Generate,
    pub(super) peer: PrefillPeer,
    pub(super) bytes: u64,
}

/// The engine thread's state.
pub(super) struct DecodeCore {
    pub(super) runner: Runner,
    pub(super) out: mpsc::UnboundedSender<Vec<(String, TokenItem)>>,
    pub(super) outbox: Outbox,
    /// Control messages of this turn, handed to the outbox at its end.
    pub(super) sends: Vec<Outgoing>,
    pub(super) load: Arc<Mutex<LoadReport>>,
    pub(super) grants: super::recorded_grants::RecordedGrants,
    pub(super) endpoint: Endpoint,
    pub(super) incarnation: u64,
    pub(super) threshold: usize,
    pub(super) transfer_timeout: Duration,
    /// Check prefill's checksums before publishing.
    pub(super) checksum: bool,
    /// Bytes of landed KV checked per turn while sequences run (`serving.kv_verify_step_mib`).
    pub(super) verify_step_bytes: usize,
    /// Fenced transfers whose KV is being checked, oldest first.
    pub(super) checks: VecDeque<super::verify::Check>,
    /// How long an abort may go unacknowledged before decode asks again (drain fence).
    pub(super) drain_fence: Duration,
    /// How long an abort may stay unproven before decode raises the alarm (the pages stay
    /// quarantined: time is never proof).
    pub(super) forced_drain: Duration,
    pub(super) max_running: usize,
    pub(super) next_seq: u64,
    /// Local sequence id -> (router, router's request id), and back.
    pub(super) owners: HashMap<u64, (String, u64)>,
    pub(super) seqs: HashMap<(String, u64), u64>,
    pub(super) prealloc: VecDeque<Prealloc>,
    /// Transfers by (prefill node, room), from notice to their end, and the aborted attempts
    /// whose pages are quarantined until their revoke is proven (the sans-IO core the
    /// simulator runs too).
    pub(super) transfers: Attempts<String, Transfer>,
    /// Prefill nodes whose hello succeeded.
    pub(super) ready: HashSet<String>,
    pub(super) epoch: Instant,
    /// The time of this turn (see [`DecodeCore::turn`]).
    pub(super) now: Instant,
    /// Per sequence: its root span and the span of the phase it is in.
    pub(super) spans: HashMap<u64, (tracing::Span, tracing::Span)>,
    /// Sequences whose first token was already reported (as a span event).
    pub(super) first_tokens: HashSet<u64>,
    /// Fault injection (`DUET_FAULT_HOLD_DONE_MS`): a complete transfer waits this long
    /// before it is checked and published, so tests can kill decode between the end of a
    /// transfer and its first decode step.
    pub(super) hold_done: Duration,
    pub(super) held: Vec<(Instant, String, TransferDone)>,
    /// This node's name (for the transfer history).
    pub(super) node: String,
    /// Each prefill node's worker incarnation, from its heartbeats.
    pub(super) prefill_incarnations: HashMap<String, u64>,
    /// Each prefill node's engine steps, from its last heartbeat that held an attempt of ours.
    pub(super) prefill_steps: HashMap<String, u64>,
    /// One line per engine step, where `serving.step_log` asks for it.
    pub(super) step_log: crate::step_log::StepLog,
}

impl DecodeCore {
    pub(super) fn run(mut self, cmds: std_mpsc::Receiver<Cmd>) {
        loop {
            let idle = self.runner.scheduler.is_idle() && self.checks.is_empty();
            let first = if idle {
                // Nothing to compute: wake for a command, or to check transfer deadlines.
                match cmds.recv_timeout(Duration::from_millis(200)) {
                    Ok(c) => Some(c),
                    Err(std_mpsc::RecvTimeoutError::Timeout) => None,
                    Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
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
            let (items, sends) = self.turn(Instant::now(), batch);
            for message in sends {
                self.outbox.queue(message);
            }
            if !items.is_empty() && self.out.send(items).is_err() {
                return;
            }
        }
    }

    /// One turn of the engine thread at `now` (the only clock reading the logic sees): the
    /// commands that arrived, then waiting requests get pages, deadlines and quarantined
    /// attempts are checked, held transfers fenced, the turn's share of landed KV checked
    /// (and what passed published), one engine step runs and the load is reported. Returns the token items for the routers and the control messages for peers:
    /// the turn itself sends nothing.
    pub(super) fn turn(
        &mut self,
        now: Instant,
        cmds: Vec<Cmd>,
    ) -> (Vec<(String, TokenItem)>, Vec<Outgoing>) {
        self.now = self.now.max(now);
        let mut items = Vec::new();
        for cmd in cmds {
            self.command(cmd, &mut items);
        }
        self.preallocate(&mut items);
        self.expire(&mut items);
        let now = self.now;
        for (_, node, d) in self
            .held
            .extract_if(.., |(due, _, _)| *due <= now)
            .collect::<Vec<_>>()
        {
            self.done(node, d, &mut items);
        }
        self.check_landed(&mut items);
        if !self.runner.scheduler.is_idle() {
            self.step(&mut items);
        }
        self.apply_effects();
        self.publish_load();
        (items, std::mem::take(&mut self.sends))
    }

    /// Queues a control message for `service` on `node` (sent at the end of the turn).
    pub(super) fn send(
        &mut self,
        node: &str,
        service: &'static str,
        kind: &'static str,
        body: &impl serde::Serialize,
    ) {
        self.sends.push(Outgoing::new(node, service, kind, body));
    }

    /// Milliseconds since the thread started, at this turn.
    pub(super) fn now_ms(&self) -> u64 {
        self.now.duration_since(self.epoch).as_millis() as u64
    }

    pub(super) fn command(&mut self, cmd: Cmd, items: &mut Vec<(String, TokenItem)>) {
        match cmd {
            Cmd::Submit {
                router,
                generate,
                trace,
            } => {
                self.next_seq += 1;
                let seq = self.next_seq;
                if self.seqs.contains_key(&(router.clone(), generate.request)) {
                    return;
                }
                let root = tracing::info_span!(
                    "decode",
                    request = generate.request,
                    room = generate.prefill.as_ref().map(|p| p.room),
                    attempt = tracing::field::Empty,
                    prompt_tokens = generate.prompt.len(),
                );
                duet_runtime::telemetry::follow(&root, &trace);
                let phase = if generate.prefill.is_some() {
                    tracing::info_span!(parent: &root, "prealloc", request = generate.request)
                } else {
                    tracing::info_span!(
                        parent: &root,
                        "decoding",
                        request = generate.request,
                        local_prefill = true
                    )
                };
                self.spans.insert(seq, (root, phase));
                self.owners.insert(seq, (router.clone(), generate.request));
                self.seqs.insert((router.clone(), generate.request), seq);
                // A sequence that could never fit (the pool, even alone) is refused now,
                // rather than left waiting for pages that will never be free.
                let admissible = self.runner.scheduler.admissible(
                    generate.prompt.len(),
                    &generate.params,
                    generate.resume,
                    false,
                );
                if let (Err(e), Some(peer)) = (&admissible, &generate.prefill) {
                    self.drop_bootstrap_half(peer);
                    self.fail(seq, ServingError::Admission(e.to_string()), items);
                    return;
                }
                match generate.prefill.clone() {
                    Some(peer) => self.prealloc.push_back(Prealloc {
                        seq,
                        router,
                        generate,
                        peer,
                        since: self.now,
                    }),
                    None => self.submit_local(seq, router, generate, items),
                }
            }
            Cmd::Cancel { router, request } => {
                if let Some(seq) = self.seqs.remove(&(router, request)) {
                    self.owners.remove(&seq);
                    if let Some((_, phase)) = self.spans.remove(&seq) {
                        tracing::info!(parent: &phase, "cancelled by the client");
                    }
                    self.abort_seq(seq, AbortReason::ClientCancel);
                }
            }
            Cmd::PeerReady(node) => {
                self.ready.insert(node);
            }
            Cmd::PeerRefused(node, error) => {
                self.ready.remove(&node);
                let refused = self.take_prealloc(|p| p.peer.node == node);
                for p in refused {
                    self.fail(p.seq, ServingError::Prealloc(error.to_string()), items);
                    self.drop_bootstrap_half(&p.peer);
                }
            }
            Cmd::PeerGone(node, why) => self.lose_peer(&node, &why, false, items),
            Cmd::PrefillIncarnation(node, incarnation) => {
                self.prefill_incarnations.insert(node, incarnation);
            }
            Cmd::PeerDown(node, why) => self.lose_peer(&node, &why, true, items),
            Cmd::Chunk(node, c) => {
                let now = self.now_ms();
                match self.transfers.progress(&node, c.room, c.attempt, now) {
                    Some(t) => t.bytes = c.bytes,
                    None => stale("chunk"),
                }
            }
            Cmd::PrefillProgress {
                node,
                steps,
                holding,
            } => {
                let before = self.prefill_steps.insert(node.clone(), steps);
                if before.is_some_and(|b| steps > b) {
                    let now = self.now_ms();
                    self.transfers.stepping(&node, &holding, now);
                }
            }
            Cmd::Done(node, d) if !self.hold_done.is_zero() => {
                tracing::warn!(
                    room = d.room,
                    "fault injection: holding a complete transfer"
                );
                self.held.push((self.now + self.hold_done, node, d));
            }
            Cmd::Done(node, d) => self.done(node, d, items),
            Cmd::Failed(node, f) => {
                if let Some(attempt) = f.attempt {
                    // P's writes for it have drained: abort then close at once. A failure of
                    // another attempt in the same room must not take this one with it.
                    let (transfers, mut at) = self.attempts();
                    let ended = transfers.failed(&node, f.room, attempt, &mut at);
                    match ended {
                        Some(e) => {
                            self.ended(&e);
                            self.fail(e.item.seq, f.to_error(), items);
                        }
                        None => stale("failed"),
                    }
                } else {
                    let gone = self.take_prealloc(|p| p.peer.node == node && p.peer.room == f.room);
                    for p in gone {
                        self.fail(p.seq, f.to_error(), items);
                    }
                }
            }
            Cmd::AbortAck(node, a) => {
                // Prefill says its writes drained: a reason to ask the grant again now (the
                // revoke is the proof). Most acknowledgements come after the revoke was
                // already proven; only one for another peer's attempt is stale.
                let (transfers, mut at) = self.attempts();
                let ack = transfers.acknowledged(&node, a.attempt, &mut at);
                if ack == Ack::Stale {
                    stale("abort_ack");
                }
            }
            Cmd::ReceiverRestarted { tcp, carried } => {
                self.receiver_restarted(tcp, &carried, items);
            }
            Cmd::Shutdown => {}
        }
    }

    pub(super) fn submit_local(
        &mut self,
        seq: u64,
        router: String,
        generate: Generate,
        items: &mut Vec<(String, TokenItem)>,
    ) {
        let submitted =
            self.runner
                .submit_resumed(seq, generate.prompt, generate.params, generate.resume);
        if let Err(e) = submitted {
            self.owners.remove(&seq);
            self.seqs.remove(&(router.clone(), generate.request));
            items.push((
                router,
                TokenItem::failed(generate.request, &ServingError::Admission(e.to_string())),
            ));
        }
    }

    /// Fails a request to its router (if it still has one).
    pub(super) fn fail(
        &mut self,
        seq: u64,
        error: ServingError,
        items: &mut Vec<(String, TokenItem)>,
    ) {
        if let Some((root, phase)) = self.spans.remove(&seq) {
            tracing::warn!(parent: &phase, %error, "request failed");
            drop(root);
        }
        self.first_tokens.remove(&seq);
        if let Some((router, request)) = self.owners.remove(&seq) {
            self.seqs.remove(&(router.clone(), request));
            items.push((router, TokenItem::failed(request, &error)));
        }
    }

    pub(super) fn step(&mut self, items: &mut Vec<(String, TokenItem)>) {
        // Wall time for the metric only: the logic sees `self.now`.
        let clock = crate::step_clock::StepClock::start();
        let stepped = self.runner.step();
        crate::worker::record_step(
            "decode",
            &clock.stop(),
            self.runner.last_step,
            &mut self.step_log,
        );
        match stepped {
            Ok(events) => {
                for ev in events {
                    let Some((router, request)) = self.owners.get(&ev.seq).cloned() else {
                        continue;
                    };
                    if let Some((_, phase)) = self.spans.get(&ev.seq) {
                        if self.first_tokens.insert(ev.seq) {
                            tracing::debug!(parent: phase, token = ev.token, "first token");
                        }
                        if let Some(reason) = ev.finish {
                            tracing::debug!(parent: phase, reason = ?reason, "finished");
                        }
                    }
                    if ev.finish.is_some() {
                        self.owners.remove(&ev.seq);
                        self.seqs.remove(&(router.clone(), request));
                        self.spans.remove(&ev.seq);
                        self.first_tokens.remove(&ev.seq);
                    }
                    items.push((router, TokenItem::sampled(request, ev)));
                }
            }
            Err(e) => {
                // A step that cannot run fails every running request; transfers go on.
                tracing::error!(error = %e, "engine step failed");
                let running: Vec<u64> = self
                    .owners
                    .keys()
                    .copied()
                    .filter(|s| {
                        !self.prealloc.iter().any(|p| p.seq == *s)
                            && !self.transfers.iter().any(|(_, t)| t.item.seq == *s)
                    })
                    .collect();
                for seq in running {
                    let _ = self.runner.abort(seq);
                    self.fail(seq, ServingError::Engine(format!("step: {e}")), items);
                }
            }
        }
    }

    pub(super) fn publish_load(&self) {
        let runner = &self.runner;
        let stats = runner.engine.pool.alloc.stats();
        let (waiting, running) = runner.scheduler.queue_lengths();
        let mut l = self.load.lock().unwrap_or_else(|p| p.into_inner());
        l.queued_tokens = runner.scheduler.queued_tokens()
            + self
                .prealloc
                .iter()
                .map(|p| p.generate.prompt.len())
                .sum::<usize>();
        l.waiting = waiting + self.prealloc.len() + self.transfers.len();
        l.running = running;
        l.in_flight = self.seqs.len();
        l.free_pages = stats.free;
        l.pinned_pages = stats.pinned;
        l.cached_pages = runner.cache.evictable(&runner.engine.pool.alloc);
        l.quarantined_pages = self.transfers.quarantined_pages();
    }
}
