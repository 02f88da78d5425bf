//! A decode worker in the simulator. Its transfers run on the real decode worker's state
//! machine ([`Attempts`]: the ledger, the quarantine, what a Done, a failure, an
//! acknowledgement, a lost peer or a deadline does) over the real [`PageAllocator`]: pages are
//! reserved before prefill writes (the notice names them), an attempt that ends without its
//! writer's Done is aborted (quarantined) and its pages are freed only when the revoke of its
//! grant is proven (no write in flight, or the writer dead: a claim the kernel dropped); a
//! deadline only starts recovery and, past the backstop, raises the alarm. What is the
//! simulator's own: the message plumbing, the claim slots, and the continuous batch stepping on
//! the cost model's time.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use duet_actors::decode::attempts::{At, Attempts, Done, Effect, Ended, Fenced, Limits};
use duet_actors::protocol::FailureClass;
use duet_gpu::{PageAllocator, PageId};
use duet_transport::{AbortReason, Fence, Quarantine, Revocation};

use crate::check::Owner;
use crate::config::SimConfig;
use crate::slots::{Slot, Slots};
use crate::world::{Ev, Generate, Msg, NodeId, Token, Us, World, stream_token};

pub(crate) struct DecodeNode {
    alloc: PageAllocator,
    pub(crate) fence: Slots,
    prealloc: VecDeque<(Generate, Us)>,
    /// The real decode worker's transfers, by (prefill, room): the request it carries, its
    /// grant and, held beside it, the pages the sequence decodes into.
    attempts: Attempts<NodeId, Generate>,
    running: BTreeMap<SeqKey, Run>,
    /// The batch of the step under way, and the prompt tokens it prefills per sequence.
    step: Option<Vec<(SeqKey, usize)>>,
    seen: BTreeSet<SeqKey>,
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
        let quarantine = if cfg.mutations.release_on_backstop {
            // The paused-writer fix reverted in the real quarantine.
            Quarantine::with_reverted_backstop_fix(cfg.backstop_us / 1000)
        } else {
            Quarantine::new()
        };
        DecodeNode {
            alloc: PageAllocator::new(cfg.decode_pages),
            fence: Slots::default(),
            prealloc: VecDeque::new(),
            attempts: Attempts::with_quarantine(quarantine),
            running: BTreeMap::new(),
            step: None,
            seen: BTreeSet::new(),
        }
    }

    /// The transfers' state machine, and what its events need: the time, the fence, the pages.
    fn at(&mut self, now_ms: u64) -> (&mut Attempts<NodeId, Generate>, At<'_>) {
        let at = At {
            now_ms,
            fence: &mut self.fence,
            alloc: &mut self.alloc,
        };
        (&mut self.attempts, at)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.prealloc.is_empty()
            && self.attempts.is_empty()
            && self.attempts.draining() == 0
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
                self.attempts.quarantined_pages(),
                self.prealloc.len(),
                self.attempts.len(),
                self.attempts.draining(),
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
        let now_ms = self.now_ms();
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
                self.decodes[d]
                    .attempts
                    .progress(&from, room, attempt, now_ms);
            }
            Msg::Done {
                room,
                attempt,
                first,
            } => {
                if self.cfg.mutations.publish_aborted
                    && self.decodes[d].attempts.is_draining(attempt)
                {
                    self.publish_aborted(d, attempt);
                } else {
                    self.fence_transfer(d, from, room, attempt, first);
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
                    .attempts
                    .get(&from, room)
                    .is_some_and(|o| Some(o.attempt) == attempt);
                if current {
                    // A failure names an attempt its sender stopped running.
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
                }
                if let Some(a) = attempt {
                    let (attempts, mut at) = self.decodes[d].at(now_ms);
                    let ended = attempts.failed(&from, room, a, &mut at);
                    if let Some(e) = ended {
                        self.on_ended(d, e);
                    }
                }
            }
            Msg::AbortAck { attempt } => {
                let (attempts, mut at) = self.decodes[d].at(now_ms);
                attempts.acknowledged(&from, attempt, &mut at);
            }
            Msg::PeerDown { node } => {
                if self.prefill_index(node).is_some() {
                    // Its process is gone: nothing of it can write any more.
                    let attempts = &self.decodes[d].attempts;
                    let checking = attempts.iter().filter(|((p, _), o)| *p == node && o.fenced);
                    self.stats.checks_outlived_writer += checking.count() as u64;
                    let (attempts, mut at) = self.decodes[d].at(now_ms);
                    let lost = attempts.lose(&node, &mut at);
                    for e in lost {
                        self.on_ended(d, e);
                    }
                }
            }
            other => {
                let from = self.procs[from].name.clone();
                self.violation(format!("decode got an unexpected {other:?} from {from}"));
            }
        }
        self.preallocate(d);
    }

    /// Waiting requests get their pages, first come first served (after the effects of the
    /// transfers' state machine: pages it freed are known free first).
    fn preallocate(&mut self, d: usize) {
        self.decode_effects(d);
        let ps = self.cfg.page_size;
        let me = self.dnode(d);
        let dinc = self.procs[me].inc;
        let now_ms = self.now_ms();
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
            let room = g.room;
            let dn = &mut self.decodes[d];
            let attempt = match dn.attempts.open(
                (prefill, room),
                grant.clone(),
                extra.clone(),
                now_ms,
                g,
                &mut dn.alloc,
            ) {
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
            self.note(|| format!("d{d}: room {room} attempt {attempt} granted pages {grant:?}"));
            self.send(
                me,
                prefill,
                Msg::Notice {
                    room,
                    attempt,
                    pages: grant,
                    dinc,
                },
            );
        }
    }

    fn cancel(&mut self, d: usize, router: NodeId, req: u64, ratt: u64) {
        let k = (router, req, ratt);
        let now_ms = self.now_ms();
        self.decodes[d].prealloc.retain(|(g, _)| key(g) != k);
        let (attempts, mut at) = self.decodes[d].at(now_ms);
        let ended =
            attempts.end_where(|_, o| key(&o.item) == k, AbortReason::ClientCancel, &mut at);
        for e in ended {
            self.on_ended(d, e);
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

    /// Prefill says every write of the attempt landed: the real decode's rule decides (the
    /// grant revoked with proof before anything else; a writer still inside its claim means
    /// the transfer is never published). Decode's check of the landed KV then takes up to
    /// `max_check_us`, during which the fenced transfer meets whatever else happens.
    fn fence_transfer(&mut self, d: usize, prefill: NodeId, room: u64, attempt: u64, first: u32) {
        let now_ms = self.now_ms();
        let (attempts, mut at) = self.decodes[d].at(now_ms);
        match attempts.fence(&prefill, room, attempt, &mut at) {
            Fenced::Fenced => {}
            Fenced::Landing(e) => {
                self.note(|| format!("d{d}: attempt {attempt} done while a write still lands"));
                self.on_ended(d, e);
                return;
            }
            Fenced::Stale => return,
        }
        let max = self.cfg.faults.max_check_us;
        if max == 0 {
            return self.finish_transfer(d, prefill, room, attempt, first);
        }
        let us = self.rng.below(max);
        let me = self.dnode(d);
        let inc = self.procs[me].inc;
        self.note(|| format!("d{d}: room {room} attempt {attempt} fenced, checked in {us} us"));
        self.at(
            self.now + us,
            Ev::Checked(me, inc, (prefill, room, attempt, first)),
        );
    }

    /// Decode checked a fenced transfer: it is published to the batch (unless it ended
    /// meanwhile: a cancel).
    pub(crate) fn finish_transfer(
        &mut self,
        d: usize,
        prefill: NodeId,
        room: u64,
        attempt: u64,
        first: u32,
    ) {
        let now_ms = self.now_ms();
        let (attempts, mut at) = self.decodes[d].at(now_ms);
        let done = attempts.publish(&prefill, room, attempt, &mut at, |_| Ok::<(), ()>(()));
        let (g, pages, held) = match done {
            Done::Published {
                item, pages, held, ..
            } => (item, pages, held),
            Done::Landing(e) | Done::Refused(e, _) => {
                self.on_ended(d, e);
                return;
            }
            Done::Stale => {
                self.stats.checks_overtaken += 1;
                return;
            }
        };
        if self.decodes[d]
            .fence
            .get(&attempt)
            .is_some_and(|s| s.writers == 0)
        {
            self.decodes[d].fence.remove(&attempt);
        }
        let owner = Owner::Seq(g.req, g.ratt);
        self.check
            .pass(d, &pages[held..], Owner::Attempt(attempt), owner);
        self.note(|| format!("d{d}: room {room} attempt {attempt} published"));
        let run = Run {
            next: g.first_index + 1,
            ctx: g.prompt + 1,
            to_prefill: 0,
            pages,
            g,
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
    /// completion (its pages given back as if published, while its writes may still land).
    fn publish_aborted(&mut self, d: usize, attempt: u64) {
        /// Says every revoke is proven: the reverted fix.
        struct Trusting;
        impl Fence for Trusting {
            fn revoke(&mut self, _: u64) -> Revocation {
                Revocation::Proven
            }
        }
        let now_ms = self.now_ms();
        let dn = &mut self.decodes[d];
        let mut at = At {
            now_ms,
            fence: &mut Trusting,
            alloc: &mut dn.alloc,
        };
        dn.attempts.settle(attempt, &mut at);
        for effect in self.decodes[d].attempts.take_effects() {
            match effect {
                Effect::Closed {
                    attempt: a, grant, ..
                } if a == attempt => {
                    self.decodes[d].fence.remove(&attempt);
                    let phantom = Owner::Seq(u64::MAX, attempt);
                    self.check.pass(d, &grant, Owner::Attempt(attempt), phantom);
                }
                other => self.decode_effect(d, other),
            }
        }
        self.preallocate(d);
    }

    /// A transfer ended without being published: the request's other pages are back, the
    /// router is told (unless its client left), and the grant waits for its proof.
    fn on_ended(&mut self, d: usize, e: Ended<Generate>) {
        let Ended {
            item: g,
            attempt,
            reason,
            released,
            ..
        } = e;
        self.check
            .pass(d, &released, Owner::Seq(g.req, g.ratt), Owner::Free);
        self.stats.aborts += 1;
        let room = g.room;
        self.note(|| {
            format!(
                "d{d}: room {room} attempt {attempt} aborted ({})",
                reason.name()
            )
        });
        if reason != AbortReason::ClientCancel {
            let class = if reason == AbortReason::Timeout {
                FailureClass::Stalled
            } else {
                FailureClass::Attempt
            };
            self.fail_to_router(d, &g, class);
        }
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

    /// Does what decode's transfer state machine asked for. Run before any page is allocated,
    /// so that every page it freed is known free to the checker first.
    fn decode_effects(&mut self, d: usize) {
        for effect in self.decodes[d].attempts.take_effects() {
            self.decode_effect(d, effect);
        }
    }

    fn decode_effect(&mut self, d: usize, effect: Effect<NodeId>) {
        let me = self.dnode(d);
        match effect {
            Effect::StopPrefill {
                prefill,
                room,
                attempt,
            }
            | Effect::DrainFence {
                prefill,
                room,
                attempt,
            } => self.send(me, prefill, Msg::Abort { room, attempt }),
            Effect::Alarm { attempt, .. } => {
                self.stats.quarantine_stalls += 1;
                self.note(|| format!("d{d}: attempt {attempt} unproven past the backstop"));
            }
            Effect::Closed { attempt, grant, .. } => {
                // Proven: no write of it can land. Its slot goes once no writer holds it.
                let dn = &mut self.decodes[d];
                if dn.fence.get(&attempt).is_some_and(|s| s.writers == 0) {
                    dn.fence.remove(&attempt);
                }
                let free: Vec<PageId> = grant
                    .iter()
                    .copied()
                    .filter(|p| dn.alloc.refs(*p) == 0 && dn.alloc.pins(*p) == 0)
                    .collect();
                self.check
                    .pass(d, &free, Owner::Attempt(attempt), Owner::Free);
                self.note(|| format!("d{d}: attempt {attempt} drained, pages {free:?} free"));
            }
        }
    }

    /// Deadlines (waiting, no progress), aborted attempts asked for their proof, drains asked
    /// again, alarms.
    pub(crate) fn decode_tick(&mut self, d: usize) {
        let now = self.now;
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
        let now_ms = self.now_ms();
        let limits = Limits {
            timeout_ms: self.cfg.transfer_timeout_us / 1000,
            fence_ms: self.cfg.drain_fence_us / 1000,
            backstop_ms: self.cfg.backstop_us / 1000,
        };
        let (attempts, mut at) = self.decodes[d].at(now_ms);
        let stuck = attempts.tend(limits, &mut at);
        for e in stuck {
            self.on_ended(d, e);
        }
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
