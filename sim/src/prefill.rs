//! A prefill worker in the simulator: its bootstrap queue (the real [`Rendezvous`]: the
//! router's half of a request meets decode's prealloc notice), its engine (steps costed by the
//! model) and
//! its KV sender (each chunk's pages written while the next chunk computes). Every write
//! passes decode's fence at its start and holds it until it lands, as a claim does on the real
//! shm backend; a crashed writer's claims drop with it.

use std::collections::{BTreeMap, VecDeque};

use duet_actors::bootstrap::rendezvous::{OnAbort, OnNotice, OnRequest, Rendezvous};
use duet_gpu::PageId;

use crate::world::{Ev, Msg, NodeId, World, stream_token};

pub(crate) struct PrefillNode {
    /// The bootstrap queue: halves and notices waiting for each other.
    bootstrap: Rendezvous<Half, Notice>,
    /// Jobs waiting for the engine, in order.
    queue: VecDeque<u64>,
    pub(crate) jobs: BTreeMap<u64, Job>,
    /// The engine step under way: its id and (job, tokens) per prompt in it.
    computing: Option<(u64, Vec<(u64, usize)>)>,
    writes: BTreeMap<u64, Write>,
    next_id: u64,
}

/// The router's half of a request.
struct Half {
    req: u64,
    prompt: usize,
    first_index: usize,
}

/// Decode's prealloc notice.
struct Notice {
    decode: NodeId,
    dinc: u64,
    attempt: u64,
    pages: Vec<PageId>,
}

impl PrefillNode {
    pub(crate) fn new(reverted_duplicate_fix: bool) -> PrefillNode {
        PrefillNode {
            bootstrap: if reverted_duplicate_fix {
                Rendezvous::with_reverted_duplicate_fix()
            } else {
                Rendezvous::new()
            },
            queue: VecDeque::new(),
            jobs: BTreeMap::new(),
            computing: None,
            writes: BTreeMap::new(),
            next_id: 0,
        }
    }
}

pub(crate) struct Job {
    pub(crate) decode: NodeId,
    dinc: u64,
    pub(crate) room: u64,
    pub(crate) attempt: u64,
    pages: Vec<PageId>,
    req: u64,
    prompt: usize,
    first_index: usize,
    computed: usize,
    in_flight: u32,
    pub(crate) aborted: bool,
}

struct Write {
    job: u64,
    decode: NodeId,
    dinc: u64,
    attempt: u64,
    pages: Vec<PageId>,
}

impl PrefillNode {
    pub(crate) fn is_empty(&self) -> bool {
        self.jobs.is_empty() && self.bootstrap.is_empty()
    }

    pub(crate) fn stranded(&self) -> Option<String> {
        if !self.jobs.is_empty() {
            Some(format!("{} transfers still open", self.jobs.len()))
        } else if !self.bootstrap.is_empty() {
            Some(format!(
                "{} notices and {} bootstrap halves still queued",
                self.bootstrap.noticed(),
                self.bootstrap.waiting()
            ))
        } else {
            None
        }
    }
}

impl World {
    fn pnode(&self, i: usize) -> NodeId {
        self.prefill_id(i)
    }

    pub(crate) fn prefill_message(&mut self, i: usize, from: NodeId, msg: Msg) {
        match msg {
            Msg::Half {
                room,
                req,
                prompt,
                first_index,
            } => {
                let half = Half {
                    req,
                    prompt,
                    first_index,
                };
                let now = self.now_ms();
                if let OnRequest::Met { request, notice } =
                    self.prefills[i].bootstrap.request(room, half, now)
                {
                    self.start_job(i, room, request, notice);
                }
            }
            Msg::HalfCancel { room } => {
                // The router's abort: a half caught here is dropped (decode hears of it from
                // the router, or from its own deadline).
                let now = self.now_ms();
                self.prefills[i].bootstrap.abort(room, None, now);
            }
            Msg::Notice {
                room,
                attempt,
                pages,
                dinc,
            } => {
                let notice = Notice {
                    decode: from,
                    dinc,
                    attempt,
                    pages,
                };
                let now = self.now_ms();
                match self.prefills[i]
                    .bootstrap
                    .notice(room, attempt, notice, now)
                {
                    OnNotice::Duplicate | OnNotice::Queued => {}
                    OnNotice::Aborted => {
                        let me = self.pnode(i);
                        self.send(me, from, Msg::AbortAck { attempt });
                    }
                    OnNotice::Met {
                        request, notice, ..
                    } => self.start_job(i, room, request, notice),
                }
            }
            Msg::Abort { room, attempt } => {
                let me = self.pnode(i);
                let now = self.now_ms();
                match self.prefills[i].bootstrap.abort(room, Some(attempt), now) {
                    OnAbort::CaughtBeforeStart { .. } | OnAbort::Early => {
                        self.send(me, from, Msg::AbortAck { attempt });
                        return;
                    }
                    OnAbort::InFlight => {}
                }
                let p = &mut self.prefills[i];
                let hit: Vec<u64> = p
                    .jobs
                    .iter()
                    .filter(|(_, j)| j.decode == from && j.room == room && j.attempt == attempt)
                    .map(|(k, _)| *k)
                    .collect();
                for id in &hit {
                    if let Some(j) = p.jobs.get_mut(id) {
                        j.aborted = true;
                    }
                }
                let drained: Vec<u64> = hit
                    .into_iter()
                    .filter(|id| p.jobs.get(id).is_some_and(|j| j.in_flight == 0))
                    .collect();
                for id in drained {
                    self.end_job(i, id);
                }
                // Acknowledged now when nothing is in flight; else at the last landing.
                let busy = self.prefills[i]
                    .jobs
                    .values()
                    .any(|j| j.decode == from && j.attempt == attempt && j.in_flight > 0);
                if !busy {
                    self.send(me, from, Msg::AbortAck { attempt });
                }
            }
            Msg::PeerDown { node } => {
                let p = &mut self.prefills[i];
                let gone: Vec<u64> = p
                    .jobs
                    .iter()
                    .filter(|(_, j)| j.decode == node)
                    .map(|(k, _)| *k)
                    .collect();
                for id in gone {
                    let j = self.prefills[i].jobs.get_mut(&id).expect("listed");
                    j.aborted = true;
                    if j.in_flight == 0 {
                        self.end_job(i, id);
                    }
                }
            }
            other => {
                let from = self.procs[from].name.clone();
                self.violation(format!("prefill got an unexpected {other:?} from {from}"));
            }
        }
        self.kick_prefill(i);
    }

    fn start_job(&mut self, i: usize, room: u64, h: Half, n: Notice) {
        let p = &mut self.prefills[i];
        p.next_id += 1;
        let id = p.next_id;
        let attempt = n.attempt;
        let job = Job {
            decode: n.decode,
            dinc: n.dinc,
            room,
            attempt,
            pages: n.pages,
            req: h.req,
            prompt: h.prompt,
            first_index: h.first_index,
            computed: 0,
            in_flight: 0,
            aborted: false,
        };
        p.jobs.insert(id, job);
        p.queue.push_back(id);
        self.note(|| format!("p{i}: transfer of room {room} attempt {attempt} queued"));
        self.kick_prefill(i);
    }

    /// Starts the next engine step when the engine is free: like the real scheduler, it fills
    /// `chunk_tokens` (`serving.max_batch_tokens`) with the queued prompts in order, a chunk of
    /// each (so two short prompts share one step and both wait for it).
    fn kick_prefill(&mut self, i: usize) {
        let node = self.prefill_id(i);
        let inc = self.procs[node].inc;
        let p = &mut self.prefills[i];
        if p.computing.is_some() {
            return;
        }
        let jobs = &p.jobs;
        p.queue.retain(|id| {
            jobs.get(id)
                .is_some_and(|j| !j.aborted && j.computed < j.prompt)
        });
        let mut budget = self.cfg.chunk_tokens;
        let mut batch = Vec::new();
        let mut chunks = Vec::new();
        let mut new_requests = 0;
        for id in &p.queue {
            if budget == 0 {
                break;
            }
            let j = &p.jobs[id];
            let n = budget.min(j.prompt - j.computed);
            budget -= n;
            chunks.push((n, j.computed));
            new_requests += usize::from(j.computed == 0);
            batch.push((*id, n));
        }
        if batch.is_empty() {
            return;
        }
        let mut cost = self.cfg.cost.prefill_step_us(&chunks)
            + (self.cfg.cost.prefill_request_us * new_requests as f64).round() as u64;
        if self.cfg.one_host && self.computing.1 > 0 {
            cost = (cost as f64 * self.cfg.cost.shared_prefill_slowdown) as u64;
        }
        p.next_id += 1;
        let step = p.next_id;
        p.computing = Some((step, batch));
        self.computing.0 += 1;
        self.at(self.now + cost, Ev::ChunkComputed(node, inc, step));
    }

    /// An engine step ends: each prompt in it has one more chunk computed, whose full pages
    /// are written to decode while the next step computes.
    pub(crate) fn chunk_computed(&mut self, i: usize, step: u64) {
        let ps = self.cfg.page_size;
        let p = &mut self.prefills[i];
        if p.computing.as_ref().is_none_or(|(s, _)| *s != step) {
            return; // Not this engine's step (its process restarted since).
        }
        let Some((_, batch)) = p.computing.take() else {
            return;
        };
        self.computing.0 -= 1;
        for (id, n) in batch {
            let Some(j) = self.prefills[i].jobs.get_mut(&id) else {
                continue;
            };
            if j.aborted {
                continue;
            }
            let start = j.computed;
            j.computed = (start + n).min(j.prompt);
            let (first, last) = (start / ps, (j.computed - 1) / ps);
            let pages = j.pages.get(first..=last).map(<[PageId]>::to_vec);
            let tokens = j.computed - start;
            match pages {
                Some(pages) => self.start_write(i, id, pages, tokens),
                None => {
                    let what = format!(
                        "p{i}: room {} attempt {} would write pages {first}..={last} outside \
                         its grant of {} pages",
                        j.room,
                        j.attempt,
                        j.pages.len()
                    );
                    self.violation(what);
                }
            }
        }
        self.kick_prefill(i);
    }

    /// A write passes decode's fence (refused once the attempt is revoked) and holds it until
    /// it lands.
    fn start_write(&mut self, i: usize, id: u64, pages: Vec<PageId>, tokens: usize) {
        let Some(j) = self.prefills[i].jobs.get(&id) else {
            return;
        };
        let (decode, dinc, attempt, room) = (j.decode, j.dinc, j.attempt, j.room);
        let live = self.procs[decode].inc == dinc;
        if live && let Some(d) = self.decode_index(decode) {
            match self.decodes[d].fence.get_mut(&attempt) {
                Some(slot) if !slot.revoked => slot.writers += 1,
                _ => {
                    self.stats.writes_refused += 1;
                    self.note(|| format!("p{i}: write of attempt {attempt} refused (revoked)"));
                    let me = self.pnode(i);
                    self.send(
                        me,
                        decode,
                        Msg::Failed {
                            room,
                            attempt: Some(attempt),
                        },
                    );
                    let j = self.prefills[i].jobs.get_mut(&id).expect("present");
                    j.aborted = true;
                    if j.in_flight == 0 {
                        self.end_job(i, id);
                    }
                    return;
                }
            }
        }
        let f = &self.cfg.faults;
        let stall = if self.now < f.until_us && self.rng.chance(f.write_stall) {
            let us = self.rng.below(f.max_write_stall_us);
            self.note(|| {
                format!(
                    "p{i}: write of attempt {attempt} stalls mid-run for {} ms",
                    us / 1000
                )
            });
            us
        } else {
            0
        };
        let p = &mut self.prefills[i];
        p.next_id += 1;
        let wid = p.next_id;
        p.writes.insert(
            wid,
            Write {
                job: id,
                decode,
                dinc,
                attempt,
                pages,
            },
        );
        if let Some(j) = p.jobs.get_mut(&id) {
            j.in_flight += 1;
        }
        let at = self.now + self.cfg.cost.write_us(tokens) + stall;
        let node = self.pnode(i);
        let inc = self.procs[node].inc;
        self.at(at, Ev::Land(node, inc, wid));
    }

    /// A write's bytes are in decode's pages.
    pub(crate) fn land(&mut self, i: usize, wid: u64) {
        let Some(w) = self.prefills[i].writes.remove(&wid) else {
            return;
        };
        if self.procs[w.decode].inc == w.dinc
            && let Some(d) = self.decode_index(w.decode)
        {
            if let Err(e) = self.check.landed(d, w.attempt, &w.pages) {
                self.violation(e);
            }
            if let Some(slot) = self.decodes[d].fence.get_mut(&w.attempt) {
                slot.writers = slot.writers.saturating_sub(1);
            }
        }
        let me = self.pnode(i);
        let Some(j) = self.prefills[i].jobs.get_mut(&w.job) else {
            return;
        };
        j.in_flight -= 1;
        let (room, attempt, decode) = (j.room, j.attempt, j.decode);
        if j.aborted {
            if j.in_flight == 0 {
                self.end_job(i, w.job);
                self.send(me, decode, Msg::AbortAck { attempt });
            }
            return;
        }
        let complete =
            (j.computed == j.prompt && j.in_flight == 0).then_some((j.req, j.first_index));
        self.send(me, decode, Msg::Chunk { room, attempt });
        if let Some((req, first_index)) = complete {
            let first = stream_token(self.seed, req, first_index);
            self.end_job(i, w.job);
            self.check.finished.insert((me, decode, room, attempt));
            self.send(
                me,
                decode,
                Msg::Done {
                    room,
                    attempt,
                    first,
                },
            );
        }
    }

    /// A transfer is over (done, aborted or refused).
    fn end_job(&mut self, i: usize, id: u64) {
        let p = &mut self.prefills[i];
        p.jobs.remove(&id);
        p.queue.retain(|q| *q != id);
        // A chunk of it being computed finishes anyway (the engine's step is under way).
    }

    /// Notices and halves that waited past the bootstrap deadline: a notice's decode is told
    /// (nothing was written for it); a request's half is dropped (decode's own deadline fails
    /// its attempt).
    pub(crate) fn prefill_tick(&mut self, i: usize) {
        let now = self.now_ms();
        let me = self.pnode(i);
        let limit = self.cfg.bootstrap_timeout_us / 1000;
        let expired = self.prefills[i].bootstrap.expire(now, limit);
        for (room, attempt, n) in expired.notices {
            self.send(
                me,
                n.decode,
                Msg::Failed {
                    room,
                    attempt: Some(attempt),
                },
            );
        }
    }

    /// The process died: the kernel drops its claims (its writes in flight never land).
    pub(crate) fn prefill_crashed(&mut self, i: usize) {
        let fresh = PrefillNode::new(self.cfg.mutations.fail_duplicate_notice);
        let p = std::mem::replace(&mut self.prefills[i], fresh);
        if p.computing.is_some() {
            self.computing.0 -= 1;
        }
        for w in p.writes.values() {
            if self.procs[w.decode].inc == w.dinc
                && let Some(d) = self.decode_index(w.decode)
                && let Some(slot) = self.decodes[d].fence.get_mut(&w.attempt)
            {
                slot.writers = slot.writers.saturating_sub(1);
            }
        }
    }
}
