//! The router's shell in the simulator: it pairs workers (least outstanding attempts, as the
//! real router's load score does when loads are equal), streams tokens to the client, and asks
//! the real [`AttemptPolicy`] what to do when an attempt fails or cannot start.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use duet_actors::protocol::FailureClass;
use duet_actors::router::policy::{AfterFailure, AfterStartFailure, AttemptPolicy, Placement};

use crate::config::SimConfig;
use crate::stats::Outcome;
use crate::world::{Ev, Generate, Msg, NodeId, Us, World, stream_token};

/// One router's requests.
#[derive(Default)]
pub(crate) struct RouterNode {
    reqs: BTreeMap<u64, Req>,
    /// Attempts under way per node.
    load: Vec<usize>,
}

struct Req {
    arrival: Us,
    prompt: usize,
    max_tokens: usize,
    policy: AttemptPolicy,
    placement: Placement,
    delivered: usize,
    ratt: u64,
    cur: Option<Cur>,
    first_at: Option<Us>,
    last_at: Us,
    started: bool,
}

struct Cur {
    decode: NodeId,
    prefill: Option<NodeId>,
    room: u64,
    progress: Us,
}

impl RouterNode {
    pub(crate) fn admit(&mut self, req: u64, at: Us, prompt: usize, out: usize, cfg: &SimConfig) {
        let policy = AttemptPolicy::new(cfg.retries, None, true);
        self.reqs.insert(
            req,
            Req {
                arrival: at,
                prompt,
                max_tokens: out,
                placement: policy.first_placement(),
                policy,
                delivered: 0,
                ratt: 0,
                cur: None,
                first_at: None,
                last_at: at,
                started: false,
            },
        );
    }
}

/// The policy takes `Instant`s; only their differences matter, so any base will do.
fn instant(base: Instant, us: Us) -> Instant {
    base + Duration::from_micros(us.min(u64::MAX / 8))
}

impl World {
    fn router_of(&self, req: u64) -> NodeId {
        (req as usize) % self.cfg.routers
    }

    /// Starts the request's next attempt on the workers its placement allows.
    pub(crate) fn start_attempt(&mut self, req: u64) {
        let r = self.router_of(req);
        let Some(q) = self.routers[r].reqs.get_mut(&req) else {
            return;
        };
        if q.cur.is_some() {
            return;
        }
        q.started = true;
        let placement = q.placement.clone();
        let prompt = q.prompt + q.delivered;
        let deadline = q.arrival.saturating_add(self.cfg.request_timeout_us);
        let decodes: Vec<NodeId> = (0..self.cfg.decode).map(|i| self.decode_id(i)).collect();
        let Some(decode) = self.pick(r, &decodes, &placement.exclude, &[], None) else {
            let base = Instant::now();
            let q = self.routers[r].reqs.get_mut(&req).expect("present");
            let after =
                q.policy
                    .start_failed(true, instant(base, self.now), instant(base, deadline));
            match after {
                AfterStartFailure::Wait(p) | AfterStartFailure::Retry(p) => {
                    let at = self.now + p.as_micros() as u64;
                    self.at(at, Ev::StartAttempt(req));
                }
                AfterStartFailure::GiveUp => self.end(r, req, Outcome::Failed),
            }
            return;
        };
        let prefill = if prompt >= self.cfg.local_threshold {
            let prefills: Vec<NodeId> = (0..self.cfg.prefill).map(|i| self.prefill_id(i)).collect();
            let prefer = placement
                .prefer_prefill
                .as_ref()
                .and_then(|n| self.procs.iter().position(|p| &p.name == n));
            self.pick(
                r,
                &prefills,
                &placement.exclude,
                &placement.avoid_prefill,
                prefer,
            )
        } else {
            None
        };
        let room = self.rng.next_u64() >> 1;
        let dname = self.procs[decode].name.clone();
        let pname = prefill.map(|p| self.procs[p].name.clone());
        let q = self.routers[r].reqs.get_mut(&req).expect("present");
        q.policy.started(&dname, pname.as_deref());
        q.ratt += 1;
        let g = Generate {
            req,
            ratt: q.ratt,
            router: r,
            prefill,
            room,
            prompt,
            first_index: q.delivered,
            max_tokens: q.max_tokens,
        };
        q.cur = Some(Cur {
            decode,
            prefill,
            room,
            progress: self.now,
        });
        if q.delivered > 0 {
            self.stats.migrations += 1;
        }
        self.stats.attempts += 1;
        let nodes = self.procs.len();
        let load = &mut self.routers[r].load;
        load.resize(nodes, 0);
        for n in [Some(decode), prefill].into_iter().flatten() {
            load[n] += 1;
        }
        self.note(|| {
            format!(
                "r{r}: request {req} attempt {} -> {dname} + {} (room {room}, prompt {prompt}, from token {})",
                g.ratt,
                pname.as_deref().unwrap_or("local"),
                g.first_index
            )
        });
        if let Some(p) = prefill {
            self.send(
                r,
                p,
                Msg::Half {
                    room,
                    req,
                    prompt,
                    first_index: g.first_index,
                },
            );
        }
        self.send(r, decode, Msg::Generate(g));
    }

    /// The least loaded live worker of `pool` that the placement allows (`exclude` only while
    /// there is another), or `prefer` when it is live and allowed.
    fn pick(
        &self,
        r: NodeId,
        pool: &[NodeId],
        exclude: &[String],
        never: &[String],
        prefer: Option<NodeId>,
    ) -> Option<NodeId> {
        let allowed = |n: &NodeId| self.procs[*n].alive && !never.contains(&self.procs[*n].name);
        if let Some(p) = prefer.filter(|p| pool.contains(p) && allowed(p)) {
            return Some(p);
        }
        let load = |n: &NodeId| self.routers[r].load.get(*n).copied().unwrap_or(0);
        let fresh = pool
            .iter()
            .filter(|n| allowed(n) && !exclude.contains(&self.procs[**n].name))
            .min_by_key(|n| load(n));
        fresh
            .or_else(|| pool.iter().filter(|n| allowed(n)).min_by_key(|n| load(n)))
            .copied()
    }

    pub(crate) fn router_message(&mut self, r: NodeId, from: NodeId, msg: Msg) {
        match msg {
            Msg::Tokens(list) => {
                for t in list {
                    self.token(r, t);
                }
            }
            Msg::AttemptFailed { req, ratt, class } => {
                let current = self.routers[r]
                    .reqs
                    .get(&req)
                    .is_some_and(|q| q.ratt == ratt && q.cur.is_some());
                if current {
                    self.fail_attempt(r, req, class);
                }
            }
            Msg::PeerDown { node } => {
                let hit: Vec<u64> = self.routers[r]
                    .reqs
                    .iter()
                    .filter(|(_, q)| q.cur.as_ref().is_some_and(|c| c.decode == node))
                    .map(|(k, _)| *k)
                    .collect();
                for req in hit {
                    self.fail_attempt(r, req, FailureClass::Attempt);
                }
            }
            other => {
                let from = self.procs[from].name.clone();
                self.violation(format!("router got an unexpected {other:?} from {from}"));
            }
        }
    }

    fn token(&mut self, r: NodeId, t: crate::world::Token) {
        let seed = self.seed;
        let now = self.now;
        let Some(q) = self.routers[r].reqs.get_mut(&t.req) else {
            return;
        };
        if q.ratt != t.ratt || q.cur.is_none() || t.index < q.delivered {
            return; // An older attempt's, or one already delivered.
        }
        if t.index > q.delivered {
            // A gap: tokens were lost with a connection.
            let req = t.req;
            self.fail_attempt(r, req, FailureClass::Attempt);
            return;
        }
        let expected = stream_token(seed, t.req, t.index);
        let last = t.index + 1 == q.max_tokens;
        let mut wrong = None;
        if t.value != expected {
            wrong = Some(format!(
                "request {} token {} is {} but the stream says {expected}",
                t.req, t.index, t.value
            ));
        } else if t.finish != last {
            wrong = Some(format!(
                "request {} token {} of {}: finish={}",
                t.req, t.index, q.max_tokens, t.finish
            ));
        }
        q.delivered += 1;
        if q.delivered == 1 {
            q.first_at = Some(now);
        } else {
            self.stats.itl.record(now - q.last_at);
        }
        q.last_at = now;
        if let Some(c) = q.cur.as_mut() {
            c.progress = now;
        }
        self.stats.tokens += 1;
        if let Some(w) = wrong {
            self.violation(w);
        }
        if t.finish || last {
            self.end(r, t.req, Outcome::Finished);
        }
    }

    /// The current attempt failed: its workers are told, the policy decides what comes next.
    fn fail_attempt(&mut self, r: NodeId, req: u64, class: FailureClass) {
        let Some(q) = self.routers[r].reqs.get_mut(&req) else {
            return;
        };
        let Some(c) = q.cur.take() else {
            return;
        };
        let ratt = q.ratt;
        let delivered = q.delivered;
        let dname = self.procs[c.decode].name.clone();
        let pname = c.prefill.map(|p| self.procs[p].name.clone());
        let after = q.policy.failed(class, delivered, &dname, pname.as_deref());
        self.release_load(r, &c);
        self.note(|| format!("r{r}: request {req} attempt {ratt} failed ({class:?})"));
        self.send(r, c.decode, Msg::Cancel { req, ratt });
        if let Some(p) = c.prefill {
            self.send(r, p, Msg::HalfCancel { room: c.room });
        }
        match after {
            AfterFailure::Retry {
                pause, placement, ..
            } => {
                if let Some(q) = self.routers[r].reqs.get_mut(&req) {
                    q.placement = placement;
                }
                let at = self.now + pause.as_micros() as u64;
                self.at(at, Ev::StartAttempt(req));
            }
            AfterFailure::GiveUp => self.end(r, req, Outcome::Failed),
        }
    }

    fn release_load(&mut self, r: NodeId, c: &Cur) {
        for n in [Some(c.decode), c.prefill].into_iter().flatten() {
            if let Some(l) = self.routers[r].load.get_mut(n) {
                *l = l.saturating_sub(1);
            }
        }
    }

    /// Deadlines: the request's own, and an attempt that delivers nothing.
    pub(crate) fn router_tick(&mut self, r: NodeId) {
        let now = self.now;
        let timeout = self.cfg.request_timeout_us;
        let stuck = self.cfg.attempt_timeout_us;
        let mut late = Vec::new();
        let mut stalled = Vec::new();
        for (k, q) in &self.routers[r].reqs {
            if !q.started {
                continue;
            }
            if now >= q.arrival.saturating_add(timeout) {
                late.push(*k);
            } else if q
                .cur
                .as_ref()
                .is_some_and(|c| now.saturating_sub(c.progress) > stuck)
            {
                stalled.push(*k);
            }
        }
        for req in stalled {
            self.fail_attempt(r, req, FailureClass::Attempt);
        }
        for req in late {
            self.note(|| format!("r{r}: request {req} ran out of time"));
            self.end(r, req, Outcome::Failed);
        }
    }

    pub(crate) fn client_leaves(&mut self, req: u64) {
        let r = self.router_of(req);
        if self.routers[r].reqs.contains_key(&req) {
            self.note(|| format!("r{r}: the client of request {req} leaves"));
            self.end(r, req, Outcome::Left);
        }
    }

    /// The request is over: its attempt is cancelled, the outcome counted and its deadline
    /// checked.
    fn end(&mut self, r: NodeId, req: u64, outcome: Outcome) {
        let Some(q) = self.routers[r].reqs.remove(&req) else {
            return;
        };
        if let Some(c) = &q.cur {
            self.release_load(r, c);
            if outcome != Outcome::Finished {
                self.send(r, c.decode, Msg::Cancel { req, ratt: q.ratt });
                if let Some(p) = c.prefill {
                    self.send(r, p, Msg::HalfCancel { room: c.room });
                }
            }
        }
        self.stats.ended += 1;
        match outcome {
            Outcome::Finished => {
                self.stats.finished += 1;
                let first = q.first_at.unwrap_or(q.last_at);
                let ttft = first - q.arrival;
                self.stats.ttft.record(ttft);
                self.stats.e2e.record(q.last_at - q.arrival);
                let tpot = (q.last_at - first) / (q.delivered.max(2) as u64 - 1);
                let ok_ttft = self.cfg.slo_ttft_us.is_none_or(|s| ttft <= s);
                let ok_itl = self.cfg.slo_itl_us.is_none_or(|s| tpot <= s);
                if ok_ttft && ok_itl {
                    self.stats.good += 1;
                }
            }
            Outcome::Failed => self.stats.failed += 1,
            Outcome::Left => self.stats.left += 1,
        }
        let limit = q
            .arrival
            .saturating_add(self.cfg.request_timeout_us)
            .saturating_add(2 * self.cfg.tick_us + self.cfg.cost.message());
        if self.cfg.tick_us > 0 && self.now > limit {
            self.violation(format!(
                "request {req} ended at {} ms, past its deadline ({} ms)",
                self.now / 1000,
                limit / 1000
            ));
        }
        self.note(|| {
            format!(
                "r{r}: request {req} ends: {outcome:?} ({} tokens)",
                q.delivered
            )
        });
    }
}
