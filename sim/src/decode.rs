//! A decode worker in the simulator, on the real [`TransferLedger`] and the real
//! [`PageAllocator`]: pages are reserved before prefill writes (the notice names them), an
//! attempt that ends without its writer's Done is aborted (quarantined) and its pages are freed
//! only when the revoke of its grant is proven (no write in flight, or the writer dead: a claim
//! the kernel dropped); a deadline only starts recovery and, past the backstop, raises the
//! alarm. The continuous batch steps on the cost model's time.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use duet_actors::protocol::FailureClass;
use duet_gpu::{PageAllocator, PageId};
use duet_transport::{
    AbortReason, Fence, Outcome as LedgerOutcome, Quarantine, Revocation, Settle, Side,
    TransferLedger,
};

use crate::check::Owner;
use crate::config::SimConfig;
use crate::world::{Ev, Generate, Msg, NodeId, Token, Us, World, stream_token};

/// A grant's slot in decode's fence (the claim table): revoked by decode, held by each write
/// between its check and its landing.
#[derive(Debug, Default)]
pub(crate) struct Slot {
    pub(crate) revoked: bool,
    pub(crate) writers: u32,
}

pub(crate) struct DecodeNode {
    alloc: PageAllocator,
    ledger: TransferLedger,
    pub(crate) fence: BTreeMap<u64, Slot>,
    prealloc: VecDeque<(Generate, Us)>,
    transfers: BTreeMap<(NodeId, u64), Transfer>,
    draining: BTreeMap<u64, Drain>,
    /// Done of a transfer whose revoke was not proven yet: (prefill, room, first token).
    held: Vec<(NodeId, u64, u32)>,
    running: BTreeMap<SeqKey, Run>,
    /// The batch of the step under way, and the prompt tokens it prefills per sequence.
    step: Option<Vec<(SeqKey, usize)>>,
    seen: BTreeSet<SeqKey>,
    /// The real quarantine: aborted attempts freed only on a proven revoke.
    quarantine: Quarantine,
}

struct Transfer {
    g: Generate,
    attempt: u64,
    grant: Vec<PageId>,
    extra: Vec<PageId>,
    progress: Us,
}

/// What the simulator keeps beside the quarantine about an aborted attempt: its writer and
/// its pages (for the checker).
struct Drain {
    prefill: NodeId,
    grant: Vec<PageId>,
}

/// Decode's fence in the simulator (the claim table): a revoke marks the slot and is proven
/// when no write holds it.
struct SlotFence<'a>(&'a mut BTreeMap<u64, Slot>);

impl Fence for SlotFence<'_> {
    fn revoke(&mut self, attempt: u64) -> Revocation {
        let slot = self.0.entry(attempt).or_default();
        slot.revoked = true;
        if slot.writers == 0 {
            Revocation::Proven
        } else {
            Revocation::Busy
        }
    }
}

struct Run {
    g: Generate,
    pages: Vec<PageId>,
    next: usize,
    ctx: usize,
    /// Prompt tokens still to prefill here (a local prefill).
    to_prefill: usize,
}

impl DecodeNode {
    pub(crate) fn new(cfg: &SimConfig) -> DecodeNode {
        DecodeNode {
            alloc: PageAllocator::new(cfg.decode_pages),
            ledger: TransferLedger::new(Side::Destination),
            fence: BTreeMap::new(),
            prealloc: VecDeque::new(),
            transfers: BTreeMap::new(),
            draining: BTreeMap::new(),
            held: Vec::new(),
            running: BTreeMap::new(),
            step: None,
            seen: BTreeSet::new(),
            quarantine: if cfg.mutations.release_on_backstop {
                // The paused-writer fix reverted in the real quarantine.
                Quarantine::with_reverted_backstop_fix(cfg.backstop_us / 1000)
            } else {
                Quarantine::new()
            },
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.prealloc.is_empty()
            && self.transfers.is_empty()
            && self.draining.is_empty()
            && self.running.is_empty()
    }

    pub(crate) fn stranded(&self, cfg: &SimConfig) -> Option<String> {
        let free = self.alloc.free_pages();
        if free != cfg.decode_pages || !self.is_empty() {
            Some(format!(
                "{} of {} pages not free ({} quarantined; {} waiting, {} transfers, {} draining, \
                 {} running)",
                cfg.decode_pages - free,
                cfg.decode_pages,
                self.ledger.quarantined_pages(),
                self.prealloc.len(),
                self.transfers.len(),
                self.draining.len(),
                self.running.len()
            ))
        } else {
            None
        }
    }
}

/// A sequence on decode: (router, request, router's attempt).
type SeqKey = (NodeId, u64, u64);

fn key(g: &Generate) -> SeqKey {
    (g.router, g.req, g.ratt)
}

impl World {
    fn dnode(&self, d: usize) -> NodeId {
        self.decode_id(d)
    }

    pub(crate) fn decode_message(&mut self, d: usize, from: NodeId, msg: Msg) {
        match msg {
            Msg::Generate(g) => {
                if !self.decodes[d].seen.insert(key(&g)) {
                    return; // A duplicate.
                }
                let ps = self.cfg.page_size;
                let total = (g.prompt + g.max_tokens - g.first_index).div_ceil(ps);
                if total > self.cfg.decode_pages {
                    self.fail_to_router(d, &g, FailureClass::Attempt);
                    return;
                }
                let now = self.now;
                self.decodes[d].prealloc.push_back((g, now));
                self.preallocate(d);
            }
            Msg::Cancel { req, ratt } => self.cancel(d, from, req, ratt),
            Msg::Chunk { room, attempt } => {
                let now = self.now;
                if let Some(t) = self.decodes[d].transfers.get_mut(&(from, room))
                    && t.attempt == attempt
                {
                    t.progress = now;
                }
            }
            Msg::Done {
                room,
                attempt,
                first,
            } => {
                let current = self.decodes[d]
                    .transfers
                    .get(&(from, room))
                    .is_some_and(|t| t.attempt == attempt);
                if current {
                    self.finish_transfer(d, from, room, first);
                } else if self.decodes[d].draining.contains_key(&attempt)
                    && self.cfg.mutations.publish_aborted
                {
                    self.publish_aborted(d, attempt);
                } else if self.decodes[d].draining.contains_key(&attempt) {
                    self.settle(d, attempt);
                }
            }
            Msg::Failed { room, attempt } => {
                let me = self.dnode(d);
                if let Some(a) = attempt
                    && self.check.finished.contains(&(from, me, room, a))
                {
                    let who = self.procs[from].name.clone();
                    self.violation(format!(
                        "{who} reported room {room} attempt {a} failed after finishing it"
                    ));
                }
                let current = self.decodes[d]
                    .transfers
                    .get(&(from, room))
                    .is_some_and(|t| Some(t.attempt) == attempt);
                if current {
                    // A failure names an attempt its sender stopped running.
                    let me = self.dnode(d);
                    let lie = self.prefill_index(from).is_some_and(|p| {
                        self.prefills[p].jobs.values().any(|j| {
                            j.decode == me
                                && j.room == room
                                && Some(j.attempt) == attempt
                                && !j.aborted
                        })
                    });
                    if lie {
                        let who = self.procs[from].name.clone();
                        self.violation(format!(
                            "{who} reported room {room} attempt {attempt:?} failed while it is \
                             still sending it"
                        ));
                    }
                    let t = self.decodes[d]
                        .transfers
                        .remove(&(from, room))
                        .expect("present");
                    self.end_transfer(d, t, AbortReason::ProducerFailure, false);
                } else if let Some(a) = attempt {
                    self.settle(d, a);
                }
            }
            Msg::AbortAck { attempt } => {
                if self.decodes[d].draining.contains_key(&attempt) {
                    self.settle(d, attempt);
                }
            }
            Msg::PeerDown { node } => {
                if self.prefill_index(node).is_some() {
                    // Its process is gone: nothing of it can write any more.
                    let lost: Vec<(NodeId, u64)> = self.decodes[d]
                        .transfers
                        .keys()
                        .filter(|(p, _)| *p == node)
                        .copied()
                        .collect();
                    for k in lost {
                        let t = self.decodes[d].transfers.remove(&k).expect("listed");
                        self.end_transfer(d, t, AbortReason::ProducerFailure, false);
                    }
                    let draining: Vec<u64> = self.decodes[d]
                        .draining
                        .iter()
                        .filter(|(_, x)| x.prefill == node)
                        .map(|(a, _)| *a)
                        .collect();
                    for a in draining {
                        self.settle(d, a);
                    }
                }
            }
            other => {
                let from = self.procs[from].name.clone();
                self.violation(format!("decode got an unexpected {other:?} from {from}"));
            }
        }
    }

    /// Waiting requests get their pages, first come first served.
    fn preallocate(&mut self, d: usize) {
        let ps = self.cfg.page_size;
        let me = self.dnode(d);
        let dinc = self.procs[me].inc;
        while let Some((g, _)) = self.decodes[d].prealloc.front() {
            let total = (g.prompt + g.max_tokens - g.first_index).div_ceil(ps);
            if self.decodes[d].alloc.free_pages() < total {
                return;
            }
            let (g, _) = self.decodes[d].prealloc.pop_front().expect("front");
            let dn = &mut self.decodes[d];
            let Ok(mut pages) = dn.alloc.alloc(total) else {
                return;
            };
            let owner = Owner::Seq(g.req, g.ratt);
            let Some(prefill) = g.prefill else {
                if let Err(e) = self.check.take(d, &pages, owner) {
                    self.violation(e);
                }
                self.stats.local_prefills += 1;
                let run = Run {
                    next: g.first_index,
                    ctx: 0,
                    to_prefill: g.prompt,
                    pages,
                    g,
                };
                self.decodes[d].running.insert(key(&run.g), run);
                self.kick_step(d);
                continue;
            };
            let extra = pages.split_off(g.prompt.div_ceil(ps));
            let grant = pages;
            let pname = self.procs[prefill].name.clone();
            let dn = &mut self.decodes[d];
            let attempt = match dn
                .ledger
                .open(g.room, &pname, grant.clone(), true, &mut dn.alloc)
            {
                Ok(a) => a,
                Err(e) => {
                    self.violation(format!("d{d}: the ledger refused a fresh room: {e}"));
                    return;
                }
            };
            dn.fence.insert(attempt, Slot::default());
            for (pages, o) in [(&grant, Owner::Attempt(attempt)), (&extra, owner)] {
                if let Err(e) = self.check.take(d, pages, o) {
                    self.violation(e);
                }
            }
            let room = g.room;
            self.note(|| format!("d{d}: room {room} attempt {attempt} granted pages {grant:?}"));
            self.send(
                me,
                prefill,
                Msg::Notice {
                    room,
                    attempt,
                    pages: grant.clone(),
                    dinc,
                },
            );
            let now = self.now;
            self.decodes[d].transfers.insert(
                (prefill, room),
                Transfer {
                    g,
                    attempt,
                    grant,
                    extra,
                    progress: now,
                },
            );
        }
    }

    fn cancel(&mut self, d: usize, router: NodeId, req: u64, ratt: u64) {
        let k = (router, req, ratt);
        self.decodes[d].prealloc.retain(|(g, _)| key(g) != k);
        let t = self.decodes[d]
            .transfers
            .iter()
            .find(|(_, t)| key(&t.g) == k)
            .map(|(k, _)| *k);
        if let Some(tk) = t {
            let t = self.decodes[d].transfers.remove(&tk).expect("found");
            self.end_transfer(d, t, AbortReason::ClientCancel, true);
        }
        if let Some(run) = self.decodes[d].running.remove(&k) {
            self.free_run(d, run);
        }
    }

    fn free_run(&mut self, d: usize, run: Run) {
        let dn = &mut self.decodes[d];
        if let Err(e) = dn.alloc.release_all(&run.pages) {
            self.violation(format!("d{d}: {e}"));
        }
        let free: Vec<PageId> = run
            .pages
            .iter()
            .copied()
            .filter(|p| self.decodes[d].alloc.refs(*p) == 0 && self.decodes[d].alloc.pins(*p) == 0)
            .collect();
        self.check
            .pass(d, &free, Owner::Seq(run.g.req, run.g.ratt), Owner::Free);
        self.preallocate(d);
    }

    /// Every write landed and prefill said so: the grant is revoked (proven: no write is in
    /// flight) before the pages are published to the batch.
    fn finish_transfer(&mut self, d: usize, prefill: NodeId, room: u64, first: u32) {
        let dn = &mut self.decodes[d];
        let Some(t) = dn.transfers.get(&(prefill, room)) else {
            return;
        };
        let attempt = t.attempt;
        let slot = dn.fence.entry(attempt).or_default();
        slot.revoked = true;
        if slot.writers > 0 {
            // Not proven: published when it is (asked again every turn).
            dn.held.push((prefill, room, first));
            return;
        }
        let t = dn.transfers.remove(&(prefill, room)).expect("present");
        dn.fence.remove(&attempt);
        let published = match dn.ledger.complete(attempt, &mut dn.alloc) {
            Ok((LedgerOutcome::Applied, pages)) => pages,
            other => {
                self.violation(format!("d{d}: complete({attempt}) gave {other:?}"));
                return;
            }
        };
        let owner = Owner::Seq(t.g.req, t.g.ratt);
        self.check
            .pass(d, &published, Owner::Attempt(attempt), owner);
        self.note(|| format!("d{d}: room {room} attempt {attempt} published"));
        let mut pages = t.grant;
        pages.extend(t.extra);
        let run = Run {
            next: t.g.first_index + 1,
            ctx: t.g.prompt + 1,
            to_prefill: 0,
            pages,
            g: t.g,
        };
        self.emit(d, &run, run.g.first_index, first);
        if run.g.first_index + 1 >= run.g.max_tokens {
            self.free_run(d, run);
        } else {
            self.decodes[d].running.insert(key(&run.g), run);
            self.kick_step(d);
        }
    }

    /// The mutation `publish_aborted`: a Done for an attempt already aborted is taken as a
    /// completion (the pages were given back at the abort).
    fn publish_aborted(&mut self, d: usize, attempt: u64) {
        let Some(x) = self.decodes[d].draining.remove(&attempt) else {
            return;
        };
        let dn = &mut self.decodes[d];
        dn.fence.remove(&attempt);
        let _ = dn.ledger.drained(attempt, &mut dn.alloc);
        self.check.pass(
            d,
            &x.grant,
            Owner::Attempt(attempt),
            Owner::Seq(u64::MAX, attempt),
        );
    }

    /// Ends a transfer without its Done: aborted (pages quarantined), prefill told (`stop`),
    /// the router told, and the pages freed when the revoke is proven.
    fn end_transfer(&mut self, d: usize, t: Transfer, reason: AbortReason, stop: bool) {
        let now_ms = self.now_ms();
        let me = self.dnode(d);
        let dn = &mut self.decodes[d];
        let attempt = t.attempt;
        if let Err(e) = dn.ledger.abort(attempt, reason, now_ms, &mut dn.alloc) {
            self.violation(format!("d{d}: abort({attempt}): {e}"));
        }
        let dn = &mut self.decodes[d];
        if let Err(e) = dn.alloc.release_all(&t.extra) {
            self.violation(format!("d{d}: {e}"));
        }
        self.check
            .pass(d, &t.extra, Owner::Seq(t.g.req, t.g.ratt), Owner::Free);
        dn_held_drop(&mut self.decodes[d], t.g.room);
        let prefill = t.g.prefill.unwrap_or(me);
        let pname = self.procs[prefill].name.clone();
        let dn = &mut self.decodes[d];
        dn.quarantine.hold(attempt, &pname, t.g.room, now_ms);
        dn.draining.insert(
            attempt,
            Drain {
                prefill,
                grant: t.grant,
            },
        );
        self.stats.aborts += 1;
        let room = t.g.room;
        self.note(|| {
            format!(
                "d{d}: room {room} attempt {attempt} aborted ({})",
                reason.name()
            )
        });
        if stop {
            self.send(me, prefill, Msg::Abort { room, attempt });
        }
        if reason != AbortReason::ClientCancel {
            let class = if reason == AbortReason::Timeout {
                FailureClass::Stalled
            } else {
                FailureClass::Attempt
            };
            self.fail_to_router(d, &t.g, class);
        }
        self.settle(d, attempt);
    }

    /// Tells the router its attempt failed here.
    fn fail_to_router(&mut self, d: usize, g: &Generate, class: FailureClass) {
        let me = self.dnode(d);
        let failed = Msg::AttemptFailed {
            req: g.req,
            ratt: g.ratt,
            class,
        };
        self.send(me, g.router, failed);
    }

    /// Asks the real quarantine to settle an aborted attempt: its pages come back only when
    /// the revoke is proven (no write between its check and its landing, or the writer dead).
    fn settle(&mut self, d: usize, attempt: u64) -> bool {
        let now_ms = self.now_ms();
        let dn = &mut self.decodes[d];
        let mut fence = SlotFence(&mut dn.fence);
        let settled =
            dn.quarantine
                .settle(attempt, now_ms, &mut fence, &mut dn.ledger, &mut dn.alloc);
        if settled != Settle::Closed {
            return false;
        }
        if dn.fence.get(&attempt).is_some_and(|s| s.writers == 0) {
            dn.fence.remove(&attempt);
        }
        let Some(x) = dn.draining.remove(&attempt) else {
            return true;
        };
        let dn = &self.decodes[d];
        let free: Vec<PageId> = x
            .grant
            .iter()
            .copied()
            .filter(|p| dn.alloc.refs(*p) == 0 && dn.alloc.pins(*p) == 0)
            .collect();
        self.check
            .pass(d, &free, Owner::Attempt(attempt), Owner::Free);
        self.note(|| format!("d{d}: attempt {attempt} drained, pages {free:?} free"));
        self.preallocate(d);
        true
    }

    /// Deadlines (waiting, no progress), drains asked again, held transfers published.
    pub(crate) fn decode_tick(&mut self, d: usize) {
        let now = self.now;
        let me = self.dnode(d);
        let late: Vec<Generate> = {
            let dn = &mut self.decodes[d];
            let limit = self.cfg.prealloc_timeout_us;
            let (late, keep): (Vec<_>, Vec<_>) = dn
                .prealloc
                .drain(..)
                .partition(|(_, since)| now.saturating_sub(*since) > limit);
            dn.prealloc = keep.into_iter().collect();
            late.into_iter().map(|(g, _)| g).collect()
        };
        for g in late {
            self.fail_to_router(d, &g, FailureClass::Attempt);
        }
        let stuck: Vec<(NodeId, u64)> = self.decodes[d]
            .transfers
            .iter()
            .filter(|(_, t)| now.saturating_sub(t.progress) > self.cfg.transfer_timeout_us)
            .map(|(k, _)| *k)
            .collect();
        for k in stuck {
            let t = self.decodes[d].transfers.remove(&k).expect("listed");
            self.end_transfer(d, t, AbortReason::Timeout, true);
        }
        for a in self.decodes[d].quarantine.attempts() {
            self.settle(d, a);
        }
        let now_ms = self.now_ms();
        let backstop_ms = self.cfg.backstop_us / 1000;
        for (a, _) in self.decodes[d].quarantine.alarms(now_ms, backstop_ms) {
            self.stats.quarantine_stalls += 1;
            self.note(|| format!("d{d}: attempt {a} unproven past the backstop"));
        }
        let fence_ms = self.cfg.drain_fence_us / 1000;
        for (a, _, room) in self.decodes[d].quarantine.ask_again(now_ms, fence_ms) {
            if let Some(x) = self.decodes[d].draining.get(&a) {
                let p = x.prefill;
                self.send(me, p, Msg::Abort { room, attempt: a });
            }
        }
        for (p, room, first) in std::mem::take(&mut self.decodes[d].held) {
            self.finish_transfer(d, p, room, first);
        }
        self.decodes[d].ledger.prune();
        self.preallocate(d);
    }

    fn emit(&mut self, d: usize, run: &Run, index: usize, value: u32) {
        let me = self.dnode(d);
        let t = Token {
            req: run.g.req,
            ratt: run.g.ratt,
            index,
            value,
            finish: index + 1 >= run.g.max_tokens,
        };
        self.send(me, run.g.router, Msg::Tokens(vec![t]));
    }

    /// Starts the next step of the batch (up to `max_running` sequences; a local prefill
    /// computes a chunk of its prompt in the same step).
    fn kick_step(&mut self, d: usize) {
        let dn = &mut self.decodes[d];
        if dn.step.is_some() || dn.running.is_empty() {
            return;
        }
        let mut batch = Vec::new();
        let (mut seqs, mut ctx, mut prefill_cost) = (0usize, 0usize, 0u64);
        for (k, r) in dn.running.iter().take(self.cfg.max_running) {
            if r.to_prefill > 0 {
                let n = r.to_prefill.min(self.cfg.chunk_tokens);
                prefill_cost += self.cfg.cost.prefill_chunk_us(n, r.ctx);
                batch.push((*k, n));
            } else {
                seqs += 1;
                ctx += r.ctx;
                batch.push((*k, 0));
            }
        }
        let mut cost = if seqs > 0 {
            self.cfg.cost.decode_step_us(seqs, ctx)
        } else {
            0
        } + prefill_cost;
        if self.cfg.one_host && self.computing.0 > 0 {
            cost = (cost as f64 * self.cfg.cost.shared_decode_slowdown) as u64;
        }
        dn.step = Some(batch);
        self.computing.1 += 1;
        let me = self.dnode(d);
        let inc = self.procs[me].inc;
        self.at(self.now + cost.max(1), Ev::Step(me, inc));
    }

    /// A step ends: each sequence's token goes to its router (one message per router).
    pub(crate) fn decode_step(&mut self, d: usize) {
        let Some(batch) = self.decodes[d].step.take() else {
            return;
        };
        self.computing.1 -= 1;
        let seed = self.seed;
        let mut out: BTreeMap<NodeId, Vec<Token>> = BTreeMap::new();
        let mut done = Vec::new();
        for (k, n) in batch {
            let Some(r) = self.decodes[d].running.get_mut(&k) else {
                continue; // Cancelled during the step.
            };
            if n > 0 {
                r.to_prefill -= n;
                r.ctx += n;
                if r.to_prefill > 0 {
                    continue;
                }
            }
            let index = r.next;
            r.next += 1;
            r.ctx += 1;
            let finish = index + 1 >= r.g.max_tokens;
            out.entry(r.g.router).or_default().push(Token {
                req: r.g.req,
                ratt: r.g.ratt,
                index,
                value: stream_token(seed, r.g.req, index),
                finish,
            });
            if finish {
                done.push(k);
            }
        }
        let me = self.dnode(d);
        for (router, tokens) in out {
            self.send(me, router, Msg::Tokens(tokens));
        }
        for k in done {
            if let Some(run) = self.decodes[d].running.remove(&k) {
                self.free_run(d, run);
            }
        }
        self.kick_step(d);
    }

    /// The process died: its pool, its ledger and its fence are gone with it.
    pub(crate) fn decode_crashed(&mut self, d: usize) {
        if self.decodes[d].step.is_some() {
            self.computing.1 -= 1;
        }
        self.decodes[d] = DecodeNode::new(&self.cfg);
        self.check.reset(d);
    }
}

fn dn_held_drop(dn: &mut DecodeNode, room: u64) {
    dn.held.retain(|(_, r, _)| *r != room);
}
