//! The simulated cluster: one queue of events on virtual time, the nodes, the network between
//! them and the faults drawn from the seed. Everything that happens is an event popped from
//! the queue in (time, order of scheduling) order, so a seed is one run, bit for bit.

use std::cmp::Ordering;
use std::collections::{BTreeSet, BinaryHeap, VecDeque};

use duet_gpu::PageId;

use crate::check::Checker;
use crate::config::SimConfig;
use crate::decode::DecodeNode;
use crate::prefill::PrefillNode;
use crate::rng::{Rng, mix};
use crate::router::RouterNode;
use crate::stats::Stats;

/// Virtual time, µs.
pub type Us = u64;

/// A node: routers first, then prefill, then decode workers.
pub type NodeId = usize;

/// A message between nodes.
#[derive(Debug, Clone)]
pub(crate) enum Msg {
    /// Router → decode: run this attempt.
    Generate(Generate),
    /// Router → decode: the attempt is over (client gone, retried, deadline).
    Cancel { req: u64, ratt: u64 },
    /// Router → prefill: the router's half of the bootstrap (the prompt).
    Half {
        room: u64,
        req: u64,
        prompt: usize,
        first_index: usize,
    },
    /// Router → prefill: drop the half.
    HalfCancel { room: u64 },
    /// Decode → prefill: pages are reserved, write there.
    Notice {
        room: u64,
        attempt: u64,
        pages: Vec<PageId>,
        dinc: u64,
    },
    /// Decode → prefill: stop writing this attempt, then acknowledge.
    Abort { room: u64, attempt: u64 },
    /// Prefill → decode: its writes drained.
    AbortAck { attempt: u64 },
    /// Prefill → decode: a chunk's KV landed (progress).
    Chunk { room: u64, attempt: u64 },
    /// Prefill → decode: every write landed; the first token.
    Done { room: u64, attempt: u64, first: u32 },
    /// Prefill → decode: the transfer failed (its writes drained).
    Failed { room: u64, attempt: Option<u64> },
    /// Decode → router: tokens.
    Tokens(Vec<Token>),
    /// Decode → router: the attempt failed.
    AttemptFailed {
        req: u64,
        ratt: u64,
        class: duet_actors::protocol::FailureClass,
    },
    /// The link layer: a peer's process died (its connection closed).
    PeerDown { node: NodeId },
}

/// Router → decode: one attempt of a request.
#[derive(Debug, Clone)]
pub(crate) struct Generate {
    /// The request.
    pub req: u64,
    /// The router's attempt number.
    pub ratt: u64,
    /// Its router.
    pub router: NodeId,
    /// The prefill worker, or none (decode prefills it).
    pub prefill: Option<NodeId>,
    /// The transfer's room.
    pub room: u64,
    /// Prompt tokens (a continuation: the prompt and the tokens the client has).
    pub prompt: usize,
    /// The index of the first token this attempt produces.
    pub first_index: usize,
    /// Tokens the request wants in all.
    pub max_tokens: usize,
}

/// One token to a router.
#[derive(Debug, Clone)]
pub(crate) struct Token {
    /// The request.
    pub req: u64,
    /// The router's attempt that produced it.
    pub ratt: u64,
    /// Its position in the output.
    pub index: usize,
    /// Its value.
    pub value: u32,
    /// The last one.
    pub finish: bool,
}

/// What happens.
#[derive(Debug, Clone)]
pub(crate) enum Ev {
    Arrive(u64),
    Leave(u64),
    StartAttempt(u64),
    Deliver {
        to: NodeId,
        inc: u64,
        from: NodeId,
        msg: Msg,
    },
    Tick(NodeId, u64),
    ChunkComputed(NodeId, u64, u64),
    Land(NodeId, u64, u64),
    Step(NodeId, u64),
    /// Decode (node, incarnation) finished checking a fenced transfer's KV: (prefill, room,
    /// attempt, first token).
    Checked(NodeId, u64, (NodeId, u64, u64, u32)),
    Fault,
    Resume(NodeId),
    Restart(NodeId),
    Heal(NodeId, NodeId),
}

struct Entry {
    at: Us,
    order: u64,
    ev: Ev,
}

impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.order) == (o.at, o.order)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    fn cmp(&self, o: &Self) -> Ordering {
        // A max-heap: the earliest (then the first scheduled) is the greatest.
        (o.at, o.order).cmp(&(self.at, self.order))
    }
}

/// A node's process.
pub(crate) struct Proc {
    pub(crate) name: String,
    /// Incarnation: bumped at every crash; events of an older one are dropped.
    pub(crate) inc: u64,
    pub(crate) alive: bool,
    pub(crate) paused_until: Us,
}

/// The simulated cluster.
pub struct World {
    pub(crate) cfg: SimConfig,
    pub(crate) seed: u64,
    pub(crate) now: Us,
    pub(crate) rng: Rng,
    queue: BinaryHeap<Entry>,
    order: u64,
    pub(crate) procs: Vec<Proc>,
    pub(crate) routers: Vec<RouterNode>,
    pub(crate) prefills: Vec<PrefillNode>,
    pub(crate) decodes: Vec<DecodeNode>,
    cuts: BTreeSet<(NodeId, NodeId)>,
    pub(crate) check: Checker,
    pub(crate) stats: Stats,
    trace: VecDeque<String>,
    /// The Poisson arrivals' running clock (µs).
    arrival_clock: f64,
    /// Prefill workers computing a chunk, decode workers running a step (for `one_host`).
    pub(crate) computing: (usize, usize),
}

/// What a run found.
#[derive(Debug, Clone)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// Broken invariants (empty: the run is clean).
    pub violations: Vec<String>,
    /// The last events before the first violation (or the end), readable.
    pub trace: Vec<String>,
    /// A hash of every event in order: equal for two runs of one seed.
    pub fingerprint: u64,
    /// Counts and latencies.
    pub stats: Stats,
}

impl World {
    /// A cluster for `cfg`, its chance drawn from `seed`.
    pub fn new(cfg: SimConfig, seed: u64) -> World {
        let mut procs = Vec::new();
        for i in 0..cfg.routers {
            procs.push(Proc::new(format!("r{i}")));
        }
        for i in 0..cfg.prefill {
            procs.push(Proc::new(format!("p{i}")));
        }
        for i in 0..cfg.decode {
            procs.push(Proc::new(format!("d{i}")));
        }
        let decodes = (0..cfg.decode).map(|_| DecodeNode::new(&cfg)).collect();
        let check = Checker::new(cfg.decode, cfg.decode_pages);
        World {
            routers: (0..cfg.routers).map(|_| RouterNode::default()).collect(),
            prefills: (0..cfg.prefill)
                .map(|_| PrefillNode::new(cfg.mutations.fail_duplicate_notice))
                .collect(),
            decodes,
            check,
            stats: Stats::default(),
            trace: VecDeque::new(),
            arrival_clock: 0.0,
            computing: (0, 0),
            rng: Rng::new(seed),
            seed,
            now: 0,
            queue: BinaryHeap::new(),
            order: 0,
            procs,
            cuts: BTreeSet::new(),
            cfg,
        }
    }

    pub(crate) fn prefill_id(&self, i: usize) -> NodeId {
        self.cfg.routers + i
    }
    pub(crate) fn decode_id(&self, i: usize) -> NodeId {
        self.cfg.routers + self.cfg.prefill + i
    }
    pub(crate) fn prefill_index(&self, n: NodeId) -> Option<usize> {
        n.checked_sub(self.cfg.routers)
            .filter(|&i| i < self.cfg.prefill)
    }
    pub(crate) fn decode_index(&self, n: NodeId) -> Option<usize> {
        n.checked_sub(self.cfg.routers + self.cfg.prefill)
            .filter(|&i| i < self.cfg.decode)
    }

    pub(crate) fn at(&mut self, at: Us, ev: Ev) {
        self.order += 1;
        self.queue.push(Entry {
            at,
            order: self.order,
            ev,
        });
    }

    /// Sends a control message: it may be lost, duplicated or delayed (faults), and never
    /// crosses a cut link or reaches a later incarnation of a node that crashed.
    pub(crate) fn send(&mut self, from: NodeId, to: NodeId, msg: Msg) {
        if self.cuts.contains(&(from.min(to), from.max(to))) {
            self.stats.messages_lost += 1;
            return;
        }
        let faulty = self.now < self.cfg.faults.until_us;
        let f = &self.cfg.faults;
        let (loss, dup, jitter) = (f.loss, f.duplicate, f.jitter_us);
        // Tokens ride an ordered stream: only a cut or a crash loses them.
        let stream = matches!(msg, Msg::Tokens(_) | Msg::PeerDown { .. });
        if faulty && !stream && self.rng.chance(loss) {
            self.stats.messages_lost += 1;
            return;
        }
        let copies = if faulty && !stream && self.rng.chance(dup) {
            2
        } else {
            1
        };
        let inc = self.procs[to].inc;
        for _ in 0..copies {
            let extra = if faulty && !stream && jitter > 0 {
                self.rng.below(jitter)
            } else {
                0
            };
            let at = self.now + self.cfg.cost.message() + extra;
            self.at(
                at,
                Ev::Deliver {
                    to,
                    inc,
                    from,
                    msg: msg.clone(),
                },
            );
        }
        if copies == 2 {
            self.stats.messages_duplicated += 1;
        }
    }

    /// Virtual milliseconds (what the real sans-IO cores take as time).
    pub(crate) fn now_ms(&self) -> u64 {
        self.now / 1000
    }

    /// Appends a line to the readable trace.
    pub(crate) fn note(&mut self, line: impl FnOnce() -> String) {
        if self.cfg.trace_events == 0 {
            return;
        }
        if self.trace.len() == self.cfg.trace_events {
            self.trace.pop_front();
        }
        let l = line();
        self.trace
            .push_back(format!("{:>10.3} ms  {l}", self.now as f64 / 1e3));
    }

    /// Records a broken invariant (the run goes on, so the trace shows what followed).
    pub(crate) fn violation(&mut self, what: String) {
        self.note(|| format!("VIOLATION: {what}"));
        if self.check.violations.is_empty() {
            self.check.first_trace = focus(&self.trace, &what);
        }
        self.check.violations.push(what);
    }

    /// The node an event is for (a paused node handles it when it resumes).
    fn target(&self, ev: &Ev) -> Option<NodeId> {
        match ev {
            Ev::Deliver { to, .. } => Some(*to),
            Ev::Tick(n, _)
            | Ev::ChunkComputed(n, _, _)
            | Ev::Land(n, _, _)
            | Ev::Step(n, _)
            | Ev::Checked(n, _, _) => Some(*n),
            _ => None,
        }
    }

    /// Runs every request to its end, then lets the cluster heal, then checks what is left.
    pub fn run(mut self) -> Report {
        self.next_arrival(0);
        if self.cfg.tick_us > 0 {
            for n in 0..self.procs.len() {
                let at = self.rng.below(self.cfg.tick_us);
                self.at(at, Ev::Tick(n, 0));
            }
        }
        if self.cfg.faults.node_fault_every_us > 0 {
            let at =
                self.rng
                    .exponential(self.cfg.faults.node_fault_every_us as f64) as u64;
            self.at(at, Ev::Fault);
        }
        let mut fingerprint = self.seed;
        let mut settled_at: Option<Us> = None;
        while let Some(Entry { at, ev, .. }) = self.queue.pop() {
            self.now = at;
            if let Some(n) = self.target(&ev)
                && self.procs[n].paused_until > at
            {
                let until = self.procs[n].paused_until;
                self.at(until, ev);
                continue;
            }
            fingerprint = mix(fingerprint ^ at ^ (discriminant(&ev) << 56));
            self.handle(ev);
            // Once every request has ended and the faults are over, the cluster gets a quiet
            // while to heal (drains finish, halves expire); then what is left is stranded.
            if self.stats.ended == self.cfg.requests && self.now >= self.cfg.faults.until_us {
                let quiet = (self.cfg.backstop_us.min(60_000_000) * 4).max(20_000_000);
                let since = *settled_at.get_or_insert(self.now);
                if self.healed() || self.now > since + quiet {
                    break;
                }
            }
        }
        self.final_checks();
        let violations = std::mem::take(&mut self.check.violations);
        let trace = if violations.is_empty() {
            self.trace.iter().cloned().collect()
        } else {
            std::mem::take(&mut self.check.first_trace)
        };
        self.stats.virtual_us = self.now;
        Report {
            seed: self.seed,
            violations,
            trace,
            fingerprint,
            stats: self.stats,
        }
    }

    /// Draws request `req` (or reads it from the trace), hands it to its router and schedules
    /// its arrival. Arrivals are drawn one at a time, as they come, so a million requests never
    /// sit in memory at once.
    fn next_arrival(&mut self, req: u64) {
        if req as usize >= self.cfg.requests {
            return;
        }
        let (at, prompt, output) = match &self.cfg.trace {
            Some(list) => list[req as usize % list.len()],
            None => {
                self.arrival_clock += self.rng.exponential(1e6 / self.cfg.rate);
                let (a, b) = self.cfg.prompt_tokens;
                let (c, d) = self.cfg.output_tokens;
                (
                    self.arrival_clock as u64,
                    self.rng.between(a as u64, b as u64) as usize,
                    self.rng.between(c as u64, d as u64) as usize,
                )
            }
        };
        let at = at.max(self.now);
        let router = (req as usize) % self.cfg.routers;
        self.routers[router].admit(req, at, prompt.max(1), output.max(1), &self.cfg);
        self.at(at, Ev::Arrive(req));
        if at < self.cfg.faults.until_us && self.rng.chance(self.cfg.faults.client_leaves) {
            let stay = self.rng.below(2_000_000 + output as u64 * 20_000);
            self.at(at + stay, Ev::Leave(req));
        }
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Arrive(req) => {
                self.next_arrival(req + 1);
                self.start_attempt(req);
            }
            Ev::StartAttempt(req) => self.start_attempt(req),
            Ev::Leave(req) => self.client_leaves(req),
            Ev::Deliver { to, inc, from, msg } => {
                if self.procs[to].inc != inc || !self.procs[to].alive {
                    // The connection this was sent on died with that incarnation.
                    return;
                }
                if let Some(i) = self.decode_index(to) {
                    self.decode_message(i, from, msg);
                } else if let Some(i) = self.prefill_index(to) {
                    self.prefill_message(i, from, msg);
                } else {
                    self.router_message(to, from, msg);
                }
            }
            Ev::Tick(n, inc) => {
                if self.procs[n].inc != inc || !self.procs[n].alive {
                    return;
                }
                if let Some(i) = self.decode_index(n) {
                    self.decode_tick(i);
                } else if let Some(i) = self.prefill_index(n) {
                    self.prefill_tick(i);
                } else {
                    self.router_tick(n);
                }
                let at = self.now + self.cfg.tick_us;
                self.at(at, Ev::Tick(n, inc));
            }
            Ev::ChunkComputed(n, inc, job) => {
                if self.procs[n].inc == inc
                    && let Some(i) = self.prefill_index(n)
                {
                    self.chunk_computed(i, job);
                }
            }
            Ev::Land(n, inc, write) => {
                if self.procs[n].inc == inc
                    && let Some(i) = self.prefill_index(n)
                {
                    self.land(i, write);
                }
            }
            Ev::Step(n, inc) => {
                if self.procs[n].inc == inc
                    && let Some(i) = self.decode_index(n)
                {
                    self.decode_step(i);
                }
            }
            Ev::Checked(n, inc, (prefill, room, attempt, first)) => {
                if self.procs[n].inc == inc
                    && let Some(i) = self.decode_index(n)
                {
                    self.finish_transfer(i, prefill, room, attempt, first);
                }
            }
            Ev::Fault => self.node_fault(),
            Ev::Resume(n) => {
                let name = self.procs[n].name.clone();
                self.note(|| format!("{name} resumes"));
            }
            Ev::Restart(n) => self.restart(n),
            Ev::Heal(a, b) => {
                self.cuts.remove(&(a, b));
            }
        }
    }

    /// A fault drawn from the seed: a pause, a crash or a partition.
    fn node_fault(&mut self) {
        let f = self.cfg.faults.clone();
        if self.now >= f.until_us {
            return;
        }
        let next = self.now + self.rng.exponential(f.node_fault_every_us as f64) as u64 + 1;
        self.at(next, Ev::Fault);
        // Routers are never paused or crashed here: they hold the clients' connections, and
        // their own takeover is tested on real processes.
        let workers = self.cfg.prefill + self.cfg.decode;
        let n = self.cfg.routers + self.rng.below(workers as u64) as usize;
        let name = self.procs[n].name.clone();
        match self.rng.below(3) {
            0 if self.procs[n].alive => {
                // Short pauses often, pauses past every deadline sometimes.
                let us = if self.rng.chance(0.5) {
                    self.rng.below(200_000)
                } else {
                    self.rng.below(f.max_pause_us)
                };
                let until = self.now + us;
                self.procs[n].paused_until = self.procs[n].paused_until.max(until);
                self.note(|| format!("{name} paused for {} ms", us / 1000));
                self.stats.pauses += 1;
                self.at(until, Ev::Resume(n));
            }
            1 if self.procs[n].alive => {
                let down = self.rng.below(f.max_down_us) + 1;
                self.crash(n);
                self.at(self.now + down, Ev::Restart(n));
            }
            _ => {
                let other = self.rng.below(self.procs.len() as u64) as usize;
                if other != n {
                    let us = self.rng.below(f.max_partition_us) + 1;
                    let pair = (n.min(other), n.max(other));
                    self.cuts.insert(pair);
                    let other_name = self.procs[other].name.clone();
                    self.note(|| format!("link {name} <-> {other_name} cut for {} ms", us / 1000));
                    self.stats.partitions += 1;
                    self.at(self.now + us, Ev::Heal(pair.0, pair.1));
                }
            }
        }
    }

    /// A process dies: its state is gone, its timers and connections with it; its peers see
    /// the connection close.
    fn crash(&mut self, n: NodeId) {
        let name = self.procs[n].name.clone();
        self.note(|| format!("{name} crashes"));
        self.stats.crashes += 1;
        if let Some(i) = self.prefill_index(n) {
            self.prefill_crashed(i);
        } else if let Some(i) = self.decode_index(n) {
            self.decode_crashed(i);
        }
        self.procs[n].alive = false;
        self.procs[n].inc += 1;
        self.procs[n].paused_until = 0;
        for peer in 0..self.procs.len() {
            if peer != n && self.procs[peer].alive {
                let at = self.now + self.cfg.cost.message();
                let inc = self.procs[peer].inc;
                self.at(
                    at,
                    Ev::Deliver {
                        to: peer,
                        inc,
                        from: n,
                        msg: Msg::PeerDown { node: n },
                    },
                );
            }
        }
    }

    fn restart(&mut self, n: NodeId) {
        let name = self.procs[n].name.clone();
        let inc = self.procs[n].inc;
        self.note(|| format!("{name} restarts (incarnation {inc})"));
        self.procs[n].alive = true;
        if self.cfg.tick_us > 0 {
            let inc = self.procs[n].inc;
            self.at(self.now + self.cfg.tick_us, Ev::Tick(n, inc));
        }
    }

    /// Nothing is left in flight anywhere.
    fn healed(&self) -> bool {
        self.decodes.iter().all(DecodeNode::is_empty)
            && self.prefills.iter().all(PrefillNode::is_empty)
    }

    /// What must hold once the faults stopped and the cluster had time to heal.
    fn final_checks(&mut self) {
        let mut found = Vec::new();
        for (i, d) in self.decodes.iter().enumerate() {
            if let Some(what) = d.stranded(&self.cfg) {
                found.push(format!("d{i}: {what} once the faults stopped"));
            }
        }
        for (i, p) in self.prefills.iter().enumerate() {
            if let Some(what) = p.stranded() {
                found.push(format!("p{i}: {what} once the faults stopped"));
            }
        }
        if self.stats.ended < self.cfg.requests {
            found.push(format!(
                "{} of {} requests never ended",
                self.cfg.requests - self.stats.ended,
                self.cfg.requests
            ));
        }
        for f in found {
            self.violation(f);
        }
    }
}

impl Proc {
    fn new(name: String) -> Proc {
        Proc {
            name,
            inc: 0,
            alive: true,
            paused_until: 0,
        }
    }
}

/// The events that explain a violation: every earlier one about the attempt it names and
/// every node fault, then the last few before it.
fn focus(trace: &VecDeque<String>, what: &str) -> Vec<String> {
    const LAST: usize = 30;
    let attempt = what
        .split("attempt ")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .filter(|n| !n.is_empty())
        .map(|n| format!("attempt {n} "));
    // Attempt keys are decode's (per decode worker); routers number their own attempts.
    let node = what.split(':').next().filter(|n| n.starts_with('d'));
    let about = |l: &str| {
        attempt.as_ref().is_some_and(|a| l.contains(a.as_str()))
            && !l.contains("request ")
            && node.is_none_or(|n| l.contains(&format!("{n}: ")) || l.contains(" p"))
    };
    let faults = [
        "paused", "resumes", "crashes", "restarts", "cut for", "stalls",
    ];
    let cut = trace.len().saturating_sub(LAST);
    let mut out: Vec<String> = trace
        .iter()
        .take(cut)
        .filter(|l| about(l) || faults.iter().any(|f| l.contains(f)))
        .cloned()
        .collect();
    if !out.is_empty() {
        out.push("   ...".into());
    }
    out.extend(trace.iter().skip(cut).cloned());
    out
}

fn discriminant(ev: &Ev) -> u64 {
    match ev {
        Ev::Arrive(r) | Ev::Leave(r) | Ev::StartAttempt(r) => 1 + (r << 4),
        Ev::Deliver { to, from, .. } => 2 + ((*to as u64) << 4) + ((*from as u64) << 20),
        Ev::Tick(n, _) => 3 + ((*n as u64) << 4),
        Ev::ChunkComputed(n, _, j) => 4 + ((*n as u64) << 4) + (j << 20),
        Ev::Land(n, _, w) => 5 + ((*n as u64) << 4) + (w << 20),
        Ev::Step(n, _) => 6 + ((*n as u64) << 4),
        Ev::Checked(n, _, (_, _, a, _)) => 11 + ((*n as u64) << 4) + (a << 20),
        Ev::Fault => 7,
        Ev::Resume(n) => 8 + ((*n as u64) << 4),
        Ev::Restart(n) => 9 + ((*n as u64) << 4),
        Ev::Heal(a, b) => 10 + ((*a as u64) << 4) + ((*b as u64) << 20),
    }
}

/// The token the cost model's engine produces at `index` of request `req`: what every attempt,
/// retry and migration must deliver, in order.
pub(crate) fn stream_token(seed: u64, req: u64, index: usize) -> u32 {
    (mix(seed ^ mix(req.wrapping_add(1)) ^ (index as u64).wrapping_mul(0x9E37_79B9)) % 49_152)
        as u32
}
