//! The receiving half of disaggregation on decode's engine thread: pages reserved for waiting
//! requests (prealloc, with backpressure), the notice, progress and deadlines of each transfer,
//! publication of a complete one, and the end of one that will not complete: its pages come
//! back only once the revoke of its grant is proven (see `duet_transport::grants`).

use std::collections::VecDeque;
use std::time::Instant;

use duet_engine::sampling::Sampled;
use duet_gpu::PageId;
use duet_runtime::metrics as m;
use duet_transport::{AbortReason, Revocation, Settle};

use super::engine_thread::{DecodeCore, Prealloc, Prefill, Transfer};
use super::{receiver, stale};
use crate::history;
use crate::protocol::{
    Abort, BOOTSTRAP_SERVICE, FailureClass, PreallocNotice, PrefillPeer, ServingError, TokenItem,
    TransferDone, kinds,
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
        let keys: Vec<(String, u64)> = self
            .transfers
            .iter()
            .filter(|(_, t)| carried.contains(&t.attempt))
            .map(|(k, _)| k.clone())
            .collect();
        for k in keys {
            let Some(t) = self.transfers.remove(&k) else {
                continue;
            };
            self.end_transfer(&t, AbortReason::ConsumerFailure, Prefill::Stop);
            let e = "decode transfer: the KV receiver restarted (its connections closed)";
            self.fail(t.seq, ServingError::Restart(e.into()), items);
        }
        for &attempt in carried {
            self.settle(attempt);
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

    /// Tells prefill to abort its side of a transfer (it drains, then acknowledges).
    pub(super) fn abort_at_prefill(&mut self, t: &Transfer) {
        self.send(
            &t.peer.node,
            BOOTSTRAP_SERVICE,
            kinds::ABORT,
            &Abort {
                room: t.peer.room,
                attempt: Some(t.attempt),
            },
        );
    }

    /// Removes and returns the transfers with prefill node `node`.
    pub(super) fn take_transfers(&mut self, node: &str) -> Vec<Transfer> {
        let keys: Vec<(String, u64)> = self
            .transfers
            .keys()
            .filter(|(n, _)| n == node)
            .cloned()
            .collect();
        keys.iter()
            .filter_map(|k| self.transfers.remove(k))
            .collect()
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
        let attempt = match self
            .ledger
            .open(p.peer.room, &p.peer.node, pages.clone(), true, alloc)
        {
            Ok(k) => k,
            Err(e) => {
                let _ = alloc.release_all(&prefix);
                let _ = alloc.release_all(&pages);
                self.fail(p.seq, ServingError::Prealloc(e.to_string()), items);
                self.drop_bootstrap_half(&p.peer);
                return true;
            }
        };
        history::record("open", &self.node, self.incarnation, attempt, &pages);
        let layout = *self.runner.engine.pool.layout();
        let grant = self.grants.grant(attempt, &layout, &pages);
        let notice = PreallocNotice {
            room: p.peer.room,
            attempt,
            pages: pages.clone(),
            decode_prefix_len: cached,
            incarnation: self.incarnation,
            endpoint: self.endpoint.clone(),
            claim_slot: grant.slot,
            prefill_incarnation: self.prefill_incarnations.get(&p.peer.node).copied(),
        };
        self.send(&p.peer.node, BOOTSTRAP_SERVICE, kinds::PREALLOC, &notice);
        if let Some((root, phase)) = self.spans.get_mut(&p.seq) {
            root.record("attempt", attempt);
            *phase = tracing::info_span!(
                parent: &*root,
                "transfer_wait",
                request = p.generate.request,
                room = p.peer.room,
                attempt,
                pages = need,
                decode_prefix_len = cached
            );
            tracing::debug!(parent: &*root, pages = need, cached, "notice sent");
        }
        self.transfers.insert(
            (p.peer.node.clone(), p.peer.room),
            Transfer {
                seq: p.seq,
                router: p.router,
                generate: p.generate,
                peer: p.peer,
                attempt,
                prefix,
                pages,
                noticed: self.now,
                progressed: self.now,
                bytes: 0,
            },
        );
        true
    }

    /// The KV is complete: publish it and start decoding with P's first token.
    pub(super) fn done(
        &mut self,
        node: String,
        d: TransferDone,
        items: &mut Vec<(String, TokenItem)>,
    ) {
        let key = (node, d.room);
        let Some(t) = self.transfers.get(&key) else {
            stale("done");
            return; // aborted meanwhile, or a duplicate
        };
        if t.attempt != d.attempt {
            stale("done");
            return; // an old attempt's message never touches a newer one
        }
        let Some(t) = self.transfers.remove(&key) else {
            return;
        };
        // Revoked first (as everywhere): no write of the attempt can land once the pages are
        // checked and change hands. Prefill fenced before its done, so no claim is held; one
        // that is means a writer still copies into these pages: never published.
        if self.grants.revoke(t.attempt) == Revocation::Busy {
            tracing::error!(
                room = d.room,
                attempt = t.attempt,
                "a writer still holds a complete transfer's claim"
            );
            self.end_transfer(&t, AbortReason::ProducerFailure, Prefill::Stop);
            let e = "a write was still landing after prefill's fence";
            self.fail(t.seq, ServingError::BadKv(e.into()), items);
            return;
        }
        if self.checksum
            && let Err(e) = self.verify(&t, &d)
        {
            // Corrupted or incomplete: never published. The grant is revoked, so the pages
            // are free at once; the router retries.
            metrics::counter!(m::KV_CHECKSUM_FAILURES).increment(1);
            tracing::error!(room = d.room, attempt = t.attempt, error = %e, "KV failed its checksum");
            self.end_transfer(&t, AbortReason::ProducerFailure, Prefill::Ended);
            self.fail(t.seq, ServingError::BadKv(e), items);
            return;
        }
        let alloc = &mut self.runner.engine.pool.alloc;
        match self.ledger.complete(t.attempt, alloc) {
            Ok((duet_transport::Outcome::Applied, _)) => {
                history::record("publish", &self.node, self.incarnation, t.attempt, &[]);
            }
            other => {
                tracing::error!(
                    ?other,
                    attempt = t.attempt,
                    "a done that the ledger refused"
                );
                return;
            }
        }
        self.ledger.prune();
        let latency = self.now.duration_since(t.noticed).as_secs_f64();
        metrics::histogram!(m::TRANSFER_LATENCY).record(latency);
        metrics::counter!(m::TRANSFERS, "side" => "decode", "outcome" => "completed").increment(1);
        // What the client sees as cached: the larger of what D held and what P reused.
        let cached =
            (t.prefix.len() * self.runner.engine.options().page_size).max(d.prefill_cached);
        let mut pages = t.prefix;
        pages.extend_from_slice(&t.pages);
        let first = Sampled {
            token: d.token,
            logprob: d.logprob,
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
                        attempt = t.attempt,
                        local_prefill = false
                    );
                    tracing::info!(parent: &*phase, token = ev.token, kv_bytes = d.bytes, "first token");
                    self.first_tokens.insert(t.seq);
                    if let Some(reason) = ev.finish {
                        tracing::info!(parent: &*phase, reason = ?reason, "finished");
                    }
                }
                if finished {
                    self.spans.remove(&t.seq);
                    self.first_tokens.remove(&t.seq);
                }
                items.push((
                    t.router.clone(),
                    TokenItem {
                        request: t.generate.request,
                        token: Some(ev.token),
                        logprob: ev.logprob,
                        text: ev.text,
                        finish: ev.finish,
                        error: None,
                        cached_tokens: ev.cached_tokens,
                        class: FailureClass::Attempt,
                        code: Default::default(),
                    },
                ));
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

    /// Checks that prefill's checksums cover every page of the transfer and match the bytes
    /// that landed here.
    pub(super) fn verify(&self, t: &Transfer, d: &TransferDone) -> Result<(), String> {
        let start = Instant::now();
        let pool = &self.runner.engine.pool;
        let mut covered: Vec<PageId> = d.checksums.iter().flat_map(|c| c.pages.clone()).collect();
        covered.sort_unstable();
        let mut want = t.pages.clone();
        want.sort_unstable();
        if covered != want {
            return Err(format!(
                "checksums cover {} of the {} pages written",
                covered.len(),
                want.len()
            ));
        }
        for c in &d.checksums {
            let got = duet_transport::pages_crc(&pool.memory(), pool.layout(), &c.pages)
                .map_err(|e| e.to_string())?;
            if got != c.crc {
                return Err(format!(
                    "checksum mismatch on pages {:?}: prefill sent {:#010x}, decode holds {got:#010x}",
                    c.pages, c.crc
                ));
            }
        }
        metrics::histogram!(m::KV_VERIFY).record(start.elapsed().as_secs_f64());
        Ok(())
    }

    /// Ends a transfer that will not complete: aborted in the ledger (never published; the
    /// pins stay), prefill told to stop writing it (unless it reported the end itself), and
    /// its pages freed as soon as the revoke of its grant
    /// is proven ([`settle`](Self::settle)); until then they are quarantined.
    pub(super) fn end_transfer(&mut self, t: &Transfer, reason: AbortReason, prefill: Prefill) {
        let now = self.now_ms();
        let alloc = &mut self.runner.engine.pool.alloc;
        let _ = self.ledger.abort(t.attempt, reason, now, alloc);
        let _ = alloc.release_all(&t.prefix);
        metrics::counter!(m::TRANSFERS, "side" => "decode", "outcome" => "aborted").increment(1);
        metrics::counter!(m::TRANSFER_ABORTS, "side" => "decode", "reason" => reason.name())
            .increment(1);
        if prefill == Prefill::Stop {
            self.abort_at_prefill(t);
        }
        self.quarantine
            .hold(t.attempt, &t.peer.node, t.peer.room, now);
        self.settle(t.attempt);
    }

    /// Frees an aborted attempt's pages if no write of it can land any more: its grant is
    /// revoked and no writer holds it (DESIGN rule 2; the only way pages of an aborted
    /// attempt come back). True when it closed the attempt; false while a writer holds its
    /// claim (asked again every turn, see [`expire`](Self::expire)), or when the attempt was
    /// not draining.
    pub(super) fn settle(&mut self, attempt: u64) -> bool {
        let now = self.now_ms();
        let settled = self.quarantine.settle(
            attempt,
            now,
            &mut self.grants,
            &mut self.ledger,
            &mut self.runner.engine.pool.alloc,
        );
        if settled == Settle::Closed {
            history::record("close", &self.node, self.incarnation, attempt, &[]);
        }
        settled == Settle::Closed
    }

    /// Stops a request wherever it is.
    pub(super) fn abort_seq(&mut self, seq: u64, reason: AbortReason) {
        if let Some(i) = self.prealloc.iter().position(|p| p.seq == seq) {
            if let Some(p) = self.prealloc.remove(i) {
                self.drop_bootstrap_half(&p.peer);
            }
            return;
        }
        let key = self
            .transfers
            .iter()
            .find(|(_, t)| t.seq == seq)
            .map(|(k, _)| k.clone());
        if let Some(t) = key.and_then(|k| self.transfers.remove(&k)) {
            self.end_transfer(&t, reason, Prefill::Stop);
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
        for t in self.take_transfers(node) {
            self.end_transfer(&t, AbortReason::ProducerFailure, Prefill::Stop);
            let e = ServingError::PeerLost {
                phase: "transfer",
                node: node.to_string(),
                how: phase,
                why: why.to_string(),
                restarted: !forget_peer,
            };
            self.fail(t.seq, e, items);
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

    /// Transfers past their deadline fail (and drain); quarantined attempts are asked again
    /// (a writer that held its claim may have finished); those still unproven get a drain
    /// fence (again each fence interval), and past the backstop an alert. Never a release.
    pub(super) fn expire(&mut self, items: &mut Vec<(String, TokenItem)>) {
        let now = self.now_ms();
        for attempt in self.quarantine.attempts() {
            self.settle(attempt);
        }
        for (attempt, node) in self
            .quarantine
            .alarms(now, self.forced_drain.as_millis() as u64)
        {
            let pages = self.ledger.pages(attempt);
            tracing::error!(
                %node,
                attempt,
                pages,
                backstop = ?self.forced_drain,
                "a writer on {node} still holds an aborted transfer's claim past the backstop: \
                 its pages stay quarantined until it finishes its copy or its process dies"
            );
            metrics::counter!(m::QUARANTINE_STALLS, "peer" => node.clone()).increment(1);
        }
        let fence = self.drain_fence.as_millis() as u64;
        for (attempt, node, room) in self.quarantine.ask_again(now, fence) {
            tracing::warn!(%node, room, attempt, "abort unacknowledged: drain fence");
            self.send(
                &node,
                BOOTSTRAP_SERVICE,
                kinds::DRAIN_FENCE,
                &Abort {
                    room,
                    attempt: Some(attempt),
                },
            );
        }
        // A transfer's deadline is on progress, not on its work: a long prompt that keeps
        // computing and writing never hits it; a stopped or wedged prefill does.
        let late: Vec<(String, u64)> = self
            .transfers
            .iter()
            .filter(|(_, t)| self.now.duration_since(t.progressed) > self.transfer_timeout)
            .map(|(k, _)| k.clone())
            .collect();
        for k in late {
            if let Some(t) = self.transfers.remove(&k) {
                self.end_transfer(&t, AbortReason::Timeout, Prefill::Stop);
                let limit = self.transfer_timeout;
                let e = ServingError::Stalled {
                    limit,
                    node: t.peer.node.clone(),
                };
                self.fail(t.seq, e, items);
            }
        }
        let late: Vec<u64> = self
            .prealloc
            .iter()
            .filter(|p| self.now.duration_since(p.since) > self.transfer_timeout)
            .map(|p| p.seq)
            .collect();
        for seq in late {
            self.abort_seq(seq, AbortReason::Timeout);
            let limit = self.transfer_timeout;
            self.fail(seq, ServingError::NoPages(limit), items);
        }
    }
}
