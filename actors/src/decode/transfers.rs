//! The receiving half of disaggregation on decode's engine thread: pages reserved for waiting
//! requests (prealloc, with backpressure), the notice, progress and deadlines of each transfer,
//! publication of a complete one, and the end of one that will not complete: its pages come
//! back only once the revoke of its grant is proven (see `duet_transport::grants`).

use std::collections::VecDeque;

use duet_engine::sampling::Sampled;
use duet_runtime::metrics as m;
use duet_transport::AbortReason;

use super::attempts::{At, Attempts, Done, Effect, Ended, Fenced, Limits};
use super::engine_thread::{DecodeCore, Prealloc, Transfer};
use super::verify::{self, Verdict};
use super::{receiver, stale};
use crate::history;
use crate::protocol::{
    Abort, BOOTSTRAP_SERVICE, PreallocNotice, PrefillPeer, ServingError, TokenItem, TransferDone,
    kinds,
};

impl DecodeCore {
    /// The KV receiver was replaced: later notices carry its endpoint, and the transfers the
    /// old one carried fail. Their pages are free at once: every thread that could land a
    /// frame of theirs is joined, so their revoke is proven. Prefill is told to stop them.
    pub(super) fn receiver_restarted(
        &mut self,
        tcp: Option<receiver::TcpEndpoint>,
        carried: &[u64],
        items: &mut Vec<(String, TokenItem)>,
    ) {
        self.endpoint.tcp = tcp;
        let (transfers, mut at) = self.attempts();
        let ended = transfers.end_where(
            |_, o| carried.contains(&o.attempt),
            AbortReason::ConsumerFailure,
            &mut at,
        );
        for e in ended {
            self.ended(&e);
            let why = "decode transfer: the KV receiver restarted (its connections closed)";
            self.fail(e.item.seq, ServingError::Restart(why.into()), items);
        }
        for &attempt in carried {
            let (transfers, mut at) = self.attempts();
            transfers.settle(attempt, &mut at);
        }
        tracing::warn!(
            carried = carried.len(),
            tcp = ?self.endpoint.tcp,
            "KV receiver replaced"
        );
    }

    /// Tells prefill's bootstrap queue to drop the router's half of a request decode failed
    /// before its notice (else it waits there until its deadline). Retried while the link
    /// reconnects; a node that stays unreachable drops it at its own deadline.
    pub(super) fn drop_bootstrap_half(&mut self, peer: &PrefillPeer) {
        self.send(
            &peer.node,
            BOOTSTRAP_SERVICE,
            kinds::ABORT,
            &Abort {
                room: peer.room,
                attempt: None,
            },
        );
    }

    /// The transfers' state machine, and what its events need from this thread: the turn's
    /// time, the grants (the proof), the pool's pages.
    pub(super) fn attempts(&mut self) -> (&mut Attempts<String, Transfer>, At<'_>) {
        let now_ms = self.now_ms();
        let at = At {
            now_ms,
            fence: &mut self.grants,
            alloc: &mut self.runner.engine.pool.alloc,
        };
        (&mut self.transfers, at)
    }

    /// Does what the transfers' state machine asked for this turn: aborts and drain fences to
    /// prefill, alarms, and the history of closed attempts.
    pub(super) fn apply_effects(&mut self) {
        for effect in self.transfers.take_effects() {
            match effect {
                Effect::StopPrefill {
                    prefill,
                    room,
                    attempt,
                } => self.abort_at_prefill(&prefill, room, attempt, kinds::ABORT),
                Effect::DrainFence {
                    prefill,
                    room,
                    attempt,
                } => {
                    tracing::warn!(node = %prefill, room, attempt, "abort unacknowledged: drain fence");
                    self.abort_at_prefill(&prefill, room, attempt, kinds::DRAIN_FENCE);
                }
                Effect::Alarm {
                    prefill,
                    attempt,
                    pages,
                } => {
                    tracing::error!(
                        node = %prefill,
                        attempt,
                        pages,
                        backstop = ?self.forced_drain,
                        "a writer on {prefill} still holds an aborted transfer's claim past the \
                         backstop: its pages stay quarantined until it finishes its copy or its \
                         process dies"
                    );
                    metrics::counter!(m::QUARANTINE_STALLS, "peer" => prefill).increment(1);
                }
                Effect::Closed { attempt, .. } => {
                    history::record("close", &self.node, self.incarnation, attempt, &[]);
                }
            }
        }
    }

    /// Tells prefill to abort its side of a transfer (`kind`: the abort, or a drain fence that
    /// asks again); it drains, then acknowledges.
    fn abort_at_prefill(&mut self, prefill: &str, room: u64, attempt: u64, kind: &'static str) {
        let abort = Abort {
            room,
            attempt: Some(attempt),
        };
        self.send(prefill, BOOTSTRAP_SERVICE, kind, &abort);
    }

    /// Counts a transfer that ended unpublished.
    pub(super) fn ended(&self, e: &Ended<Transfer>) {
        metrics::counter!(m::TRANSFERS, "side" => "decode", "outcome" => "aborted").increment(1);
        metrics::counter!(m::TRANSFER_ABORTS, "side" => "decode", "reason" => e.reason.name())
            .increment(1);
    }

    pub(super) fn take_prealloc(&mut self, pred: impl Fn(&Prealloc) -> bool) -> VecDeque<Prealloc> {
        let (taken, kept) = std::mem::take(&mut self.prealloc)
            .into_iter()
            .partition(|p| pred(p));
        self.prealloc = kept;
        taken
    }

    /// Reserves pages for waiting requests, in arrival order, while the pool allows; sends
    /// each its notice. A request whose uncached part is short is prefilled here instead.
    pub(super) fn preallocate(&mut self, items: &mut Vec<(String, TokenItem)>) {
        // The history must record every proven close before a page is reserved again.
        self.apply_effects();
        while let Some(p) = self.prealloc.front() {
            if !self.ready.contains(&p.peer.node) {
                // Its hello is in flight; later requests for ready peers may still go
                // (order matters only among requests that can proceed).
                if let Some(i) = self
                    .prealloc
                    .iter()
                    .position(|q| self.ready.contains(&q.peer.node))
                {
                    let q = self.prealloc.remove(i);
                    if let Some(q) = q
                        && !self.try_prealloc(q, items)
                    {
                        break;
                    }
                    continue;
                }
                break;
            }
            let Some(p) = self.prealloc.pop_front() else {
                break;
            };
            if !self.try_prealloc(p, items) {
                break;
            }
        }
        metrics::gauge!(m::PREALLOC_QUEUE).set(self.prealloc.len() as f64);
    }

    /// Returns false (and puts the request back at the front) when the pool is short.
    pub(super) fn try_prealloc(
        &mut self,
        p: Prealloc,
        items: &mut Vec<(String, TokenItem)>,
    ) -> bool {
        let now = self.now_ms();
        let ps = self.runner.engine.options().page_size;
        let prompt = &p.generate.prompt;
        let alloc = &mut self.runner.engine.pool.alloc;
        let prefix =
            match self
                .runner
                .cache
                .acquire(prompt, prompt.len().saturating_sub(1) / ps, alloc)
            {
                Ok(pages) => pages,
                Err(e) => {
                    self.fail(p.seq, ServingError::Prealloc(e.to_string()), items);
                    return true;
                }
            };
        let cached = prefix.len() * ps;
        if prompt.len() - cached < self.threshold || prompt.is_empty() {
            // Cheaper to prefill the short uncached rest here than to pair for it.
            let _ = alloc.release_all(&prefix);
            self.drop_bootstrap_half(&p.peer);
            metrics::counter!(m::DECODE_LOCAL_PREFILLS, "reason" => "cached").increment(1);
            if let Some((root, phase)) = self.spans.get_mut(&p.seq) {
                *phase = tracing::info_span!(
                    parent: &*root,
                    "decoding",
                    request = p.generate.request,
                    local_prefill = true,
                    cached_tokens = cached
                );
            }
            let Prealloc {
                seq,
                router,
                mut generate,
                ..
            } = p;
            generate.prefill = None;
            self.submit_local(seq, router, generate, items);
            return true;
        }
        let need = prompt.len().div_ceil(ps) - prefix.len();
        let (waiting, running) = self.runner.scheduler.queue_lengths();
        let busy = waiting + running + self.transfers.len() >= self.max_running;
        if alloc.free_pages() < need {
            let short = need - alloc.free_pages();
            self.runner.cache.evict(short, alloc);
        }
        if busy || alloc.free_pages() < need {
            // Backpressure: no notice until every page can be reserved.
            let _ = alloc.release_all(&prefix);
            self.prealloc.push_front(p);
            return false;
        }
        let pages = match alloc.alloc(need) {
            Ok(pages) => pages,
            Err(e) => {
                let _ = alloc.release_all(&prefix);
                self.fail(p.seq, ServingError::Prealloc(e.to_string()), items);
                return true;
            }
        };
        let (seq, peer) = (p.seq, p.peer.clone());
        let request = p.generate.request;
        let transfer = Transfer {
            seq: p.seq,
            router: p.router,
            generate: p.generate,
            peer: p.peer,
            bytes: 0,
        };
        let opened = self.transfers.open(
            (peer.node.clone(), peer.room),
            pages.clone(),
            prefix.clone(),
            now,
            transfer,
            alloc,
        );
        let attempt = match opened {
            Ok(k) => k,
            Err(e) => {
                let _ = alloc.release_all(&prefix);
                let _ = alloc.release_all(&pages);
                self.fail(seq, ServingError::Prealloc(e.to_string()), items);
                self.drop_bootstrap_half(&peer);
                return true;
            }
        };
        history::record("open", &self.node, self.incarnation, attempt, &pages);
        let layout = *self.runner.engine.pool.layout();
        let grant = self.grants.grant(attempt, &layout, &pages);
        let notice = PreallocNotice {
            room: peer.room,
            attempt,
            pages: pages.clone(),
            decode_prefix_len: cached,
            incarnation: self.incarnation,
            endpoint: self.endpoint.clone(),
            claim_slot: grant.slot,
            prefill_incarnation: self.prefill_incarnations.get(&peer.node).copied(),
        };
        self.send(&peer.node, BOOTSTRAP_SERVICE, kinds::PREALLOC, &notice);
        if let Some((root, phase)) = self.spans.get_mut(&seq) {
            root.record("attempt", attempt);
            *phase = tracing::info_span!(
                parent: &*root,
                "transfer_wait",
                request = request,
                room = peer.room,
                attempt,
                pages = need,
                decode_prefix_len = cached
            );
            tracing::debug!(parent: &*root, pages = need, cached, "notice sent");
        }
        true
    }

    /// Prefill's Done: every write landed. The attempt is fenced (its revoke proven) and its
    /// KV checked against prefill's checksums, at once or over the next turns
    /// ([`super::verify`]); then it is published and decoding starts with P's first token.
    pub(super) fn done(
        &mut self,
        node: String,
        d: TransferDone,
        items: &mut Vec<(String, TokenItem)>,
    ) {
        let (transfers, mut at) = self.attempts();
        // Revoked first (as everywhere): no write of the attempt can land once the pages are
        // checked and change hands. Prefill fenced before its done, so no claim is held; one
        // that is means a writer still copies into these pages: never published.
        match transfers.fence(&node, d.room, d.attempt, &mut at) {
            Fenced::Fenced => {}
            Fenced::Stale => return stale("done"), // aborted meanwhile, or a duplicate
            Fenced::Landing(e) => {
                tracing::error!(
                    room = d.room,
                    attempt = e.attempt,
                    "a writer still holds a complete transfer's claim"
                );
                self.ended(&e);
                let why = "a write was still landing after prefill's fence";
                return self.fail(e.item.seq, ServingError::BadKv(why.into()), items);
            }
        }
        if !self.checksum {
            return self.publish(node, d, Ok(()), items);
        }
        let grant = self
            .transfers
            .get(&node, d.room)
            .map(|o| o.grant.as_slice());
        match grant.map(|g| verify::covers(g, &d)) {
            Some(Err(why)) => self.publish(node, d, Err(why), items),
            _ => self.checks.push_back(verify::Check::new(node, d)),
        }
    }

    /// Checks the fenced transfers' KV, oldest first: all of it when nothing runs, else up to
    /// the turn's share (`serving.kv_verify_step_mib`) before the step. Each one that passes
    /// or fails is published or refused.
    pub(super) fn check_landed(&mut self, items: &mut Vec<(String, TokenItem)>) {
        let pool = &self.runner.engine.pool;
        let (memory, layout) = (pool.memory(), *pool.layout());
        let mut budget = match self.runner.scheduler.is_idle() {
            true => usize::MAX,
            false => (self.verify_step_bytes / layout.page_bytes()).max(1),
        };
        while let Some(c) = self.checks.front_mut() {
            // A cancel ended it: its pages may be another sequence's already.
            let current = self
                .transfers
                .get(&c.node, c.done.room)
                .is_some_and(|o| o.attempt == c.done.attempt && o.fenced);
            if !current {
                self.checks.pop_front();
                stale("check");
                continue;
            }
            let verdict = c.advance(&memory, &layout, &mut budget);
            if verdict == Verdict::Pending {
                return;
            }
            let Some(c) = self.checks.pop_front() else {
                return;
            };
            metrics::histogram!(m::KV_VERIFY).record(c.spent.as_secs_f64());
            metrics::histogram!(m::KV_VERIFY_TURNS).record(c.turns as f64);
            tracing::debug!(
                room = c.done.room,
                attempt = c.done.attempt,
                turns = c.turns,
                ms = c.spent.as_secs_f64() * 1e3,
                "KV checked"
            );
            let result = match verdict {
                Verdict::Failed(why) => Err(why),
                _ => Ok(()),
            };
            self.publish(c.node, c.done, result, items);
        }
    }

    /// A fenced transfer whose check is `checked`: publish it and start decoding with P's
    /// first token, or refuse it.
    fn publish(
        &mut self,
        node: String,
        d: TransferDone,
        checked: Result<(), String>,
        items: &mut Vec<(String, TokenItem)>,
    ) {
        let (transfers, mut at) = self.attempts();
        let done = transfers.publish(&node, d.room, d.attempt, &mut at, |_| checked);
        let (t, pages, held, attempt, latency_ms) = match done {
            Done::Published {
                item,
                attempt,
                pages,
                held,
                latency_ms,
            } => (item, pages, held, attempt, latency_ms),
            Done::Stale => {
                stale("done");
                return; // aborted meanwhile, or a duplicate
            }
            Done::Landing(e) => {
                // `publish` never revokes; kept for the type's sake.
                self.ended(&e);
                let why = "a write was still landing after prefill's fence";
                self.fail(e.item.seq, ServingError::BadKv(why.into()), items);
                return;
            }
            Done::Refused(e, why) => {
                // Corrupted or incomplete: never published. The grant is revoked, so the
                // pages are free at once; the router retries.
                metrics::counter!(m::KV_CHECKSUM_FAILURES).increment(1);
                tracing::error!(room = d.room, attempt = e.attempt, error = %why, "KV failed its checksum");
                self.ended(&e);
                self.fail(e.item.seq, ServingError::BadKv(why), items);
                return;
            }
        };
        history::record("publish", &self.node, self.incarnation, attempt, &[]);
        metrics::histogram!(m::TRANSFER_LATENCY).record(latency_ms as f64 / 1e3);
        metrics::counter!(m::TRANSFERS, "side" => "decode", "outcome" => "completed").increment(1);
        // What the client sees as cached: the larger of what D held and what P reused.
        let ps = self.runner.engine.options().page_size;
        let cached = (held * ps).max(d.prefill_cached);
        let first = Sampled {
            token: d.token,
            logprob: d.logprob,
            top: d.top,
        };
        let tok = &self.runner.engine.model.tokenizer;
        match self.runner.scheduler.admit_transferred(
            t.seq,
            t.generate.prompt,
            t.generate.params,
            t.generate.resume,
            d.sampler,
            pages.clone(),
            first,
            cached,
            tok,
            &mut self.runner.engine.pool.alloc,
            &mut self.runner.cache,
        ) {
            Ok(ev) => {
                let finished = ev.finish.is_some();
                if let Some((root, phase)) = self.spans.get_mut(&t.seq) {
                    *phase = tracing::info_span!(
                        parent: &*root,
                        "decoding",
                        request = t.generate.request,
                        room = t.peer.room,
                        attempt,
                        local_prefill = false
                    );
                    tracing::debug!(parent: &*phase, token = ev.token, kv_bytes = d.bytes, "first token");
                    self.first_tokens.insert(t.seq);
                    if let Some(reason) = ev.finish {
                        tracing::debug!(parent: &*phase, reason = ?reason, "finished");
                    }
                }
                if finished {
                    self.spans.remove(&t.seq);
                    self.first_tokens.remove(&t.seq);
                }
                items.push((t.router.clone(), TokenItem::sampled(t.generate.request, ev)));
                if finished {
                    self.owners.remove(&t.seq);
                    self.seqs.remove(&(t.router, t.generate.request));
                }
            }
            Err(e) => {
                let _ = self.runner.engine.pool.alloc.release_all(&pages);
                self.fail(t.seq, ServingError::Engine(format!("admit: {e}")), items);
            }
        }
    }

    /// Stops a request wherever it is.
    pub(super) fn abort_seq(&mut self, seq: u64, reason: AbortReason) {
        if let Some(i) = self.prealloc.iter().position(|p| p.seq == seq) {
            if let Some(p) = self.prealloc.remove(i) {
                self.drop_bootstrap_half(&p.peer);
            }
            return;
        }
        let (transfers, mut at) = self.attempts();
        let ended = transfers.end_where(|_, o| o.item.seq == seq, reason, &mut at);
        if !ended.is_empty() {
            ended.iter().for_each(|e| self.ended(e));
            return;
        }
        if let Err(e) = self.runner.abort(seq) {
            tracing::error!(error = %e, "abort left the pool inconsistent");
        }
    }

    /// A prefill node is unreachable (`forget_peer`: membership marked it down, so its layout
    /// hello is forgotten too) or its worker restarted: the transfers noticed to it fail (the
    /// router may retry them) and requests waiting for pages for it fail too. Their pages come
    /// back once each revoke is proven: at once for a writer that holds no claim, and for a
    /// paused one mid-copy only when it finishes that run or dies, however long that takes.
    pub(super) fn lose_peer(
        &mut self,
        node: &str,
        why: &str,
        forget_peer: bool,
        items: &mut Vec<(String, TokenItem)>,
    ) {
        if forget_peer {
            self.ready.remove(node);
        }
        // A restarted worker's node stays ready: its layout hello holds for its next worker
        // incarnation (dropping it without the actor forgetting the hello stalled every later
        // request for this node until its bootstrap deadline).
        let phase = if forget_peer { "unreachable" } else { "lost" };
        let node_name = node.to_string();
        let (transfers, mut at) = self.attempts();
        for e in transfers.lose(&node_name, &mut at) {
            self.ended(&e);
            let error = ServingError::PeerLost {
                phase: "transfer",
                node: node.to_string(),
                how: phase,
                why: why.to_string(),
                restarted: !forget_peer,
            };
            self.fail(e.item.seq, error, items);
        }
        for p in self.take_prealloc(|p| p.peer.node == node) {
            let e = ServingError::PeerLost {
                phase: "prealloc",
                node: node.to_string(),
                how: phase,
                why: why.to_string(),
                restarted: !forget_peer,
            };
            self.fail(p.seq, e, items);
            self.drop_bootstrap_half(&p.peer);
        }
    }

    /// Transfers without progress for their deadline fail (and drain); quarantined attempts
    /// are asked again (a writer that held its claim may have finished); those still unproven
    /// get a drain fence (again each fence interval), and past the backstop an alarm. Never a
    /// release. Requests waiting for pages past the deadline fail.
    pub(super) fn expire(&mut self, items: &mut Vec<(String, TokenItem)>) {
        let limit = self.transfer_timeout;
        let limits = Limits {
            timeout_ms: limit.as_millis() as u64,
            fence_ms: self.drain_fence.as_millis() as u64,
            backstop_ms: self.forced_drain.as_millis() as u64,
        };
        let (transfers, mut at) = self.attempts();
        let late = transfers.tend(limits, &mut at);
        for e in late {
            self.ended(&e);
            let error = ServingError::Stalled {
                limit,
                node: e.item.peer.node.clone(),
            };
            self.fail(e.item.seq, error, items);
        }
        let late: Vec<u64> = self
            .prealloc
            .iter()
            .filter(|p| self.now.duration_since(p.since) > self.transfer_timeout)
            .map(|p| p.seq)
            .collect();
        for seq in late {
            self.abort_seq(seq, AbortReason::Timeout);
            self.fail(seq, ServingError::NoPages(limit), items);
        }
    }
}
