//! What one simulated run is: the cluster, the load, the deadlines (the same knobs as
//! `[serving]` in cluster.toml), the faults drawn from the seed, and the mutations a test
//! build may switch on to prove the checks can fail.

use crate::cost::CostModel;

/// Faults, as rates drawn from the run's seed.
#[derive(Debug, Clone, PartialEq)]
pub struct Faults {
    /// Control messages dropped (the link's loss, or a message lost with a connection).
    pub loss: f64,
    /// Control messages delivered twice (a resend after a reconnect).
    pub duplicate: f64,
    /// Extra delay of a message, up to this many µs (uniform): reorders messages.
    pub jitter_us: u64,
    /// Mean µs between node faults (pause, crash, partition), cluster-wide; 0 = none.
    pub node_fault_every_us: u64,
    /// Longest pause of a node (µs); pauses are drawn up to it, many past every deadline.
    pub max_pause_us: u64,
    /// Longest a crashed node stays down before its new incarnation starts (µs).
    pub max_down_us: u64,
    /// Longest partition between two nodes (µs).
    pub max_partition_us: u64,
    /// Probability that a KV write stalls mid-run (its writer stopped inside the copy).
    pub write_stall: f64,
    /// Longest such stall (µs).
    pub max_write_stall_us: u64,
    /// Longest decode takes to check a fenced transfer's KV before it publishes it (µs,
    /// uniform; the real check spreads over turns while a batch runs, so cancels, deadlines
    /// and a lost writer meet transfers that are fenced and not yet published). 0: at once.
    pub max_check_us: u64,
    /// Probability that a client leaves before its request ends (at a uniformly drawn
    /// moment: waiting for pages, during the transfer, while decoding).
    pub client_leaves: f64,
    /// Faults stop at this virtual time (µs); afterwards everything must heal.
    pub until_us: u64,
}

impl Faults {
    /// No faults at all (the planner).
    pub fn none() -> Faults {
        Faults {
            loss: 0.0,
            duplicate: 0.0,
            jitter_us: 0,
            node_fault_every_us: 0,
            max_pause_us: 0,
            max_down_us: 0,
            max_partition_us: 0,
            write_stall: 0.0,
            max_write_stall_us: 0,
            max_check_us: 0,
            client_leaves: 0.0,
            until_us: 0,
        }
    }

    /// Every kind of fault, often: what the seed explorer runs.
    pub fn chaos() -> Faults {
        Faults {
            loss: 0.02,
            duplicate: 0.05,
            jitter_us: 3_000,
            node_fault_every_us: 400_000,
            max_pause_us: 12_000_000,
            max_down_us: 500_000,
            max_partition_us: 4_000_000,
            write_stall: 0.02,
            max_write_stall_us: 10_000_000,
            max_check_us: 2_000_000,
            client_leaves: 0.1,
            until_us: 8_000_000,
        }
    }
}

/// Bugs the checks must catch, switched on only to prove they do (each reverts a fix).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Mutations {
    /// Decode frees a quarantined attempt's pages once the backstop passes, without a proof
    /// that its writer is done (the paused-writer bug: time taken as proof).
    pub release_on_backstop: bool,
    /// Decode takes a complete transfer's Done for an attempt it already aborted as a
    /// completion (an abort that races its Finish).
    pub publish_aborted: bool,
    /// Prefill's bootstrap queue forgets which attempts it started, so a duplicated prealloc
    /// notice waits for a request that never comes and then fails its attempt, live or not
    /// (the real `Rendezvous` with its fix reverted).
    pub fail_duplicate_notice: bool,
}

impl Mutations {
    /// Whether any is on.
    pub fn any(&self) -> bool {
        self.release_on_backstop || self.publish_aborted || self.fail_duplicate_notice
    }
}

/// One run.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Routers.
    pub routers: usize,
    /// Prefill workers.
    pub prefill: usize,
    /// Decode workers.
    pub decode: usize,
    /// Requests in all.
    pub requests: usize,
    /// Arrivals per second (Poisson).
    pub rate: f64,
    /// Prompt lengths, drawn uniformly (tokens).
    pub prompt_tokens: (usize, usize),
    /// Output lengths, drawn uniformly (tokens).
    pub output_tokens: (usize, usize),
    /// A fixed list of (arrival µs, prompt, output) instead of drawn ones (`--trace`).
    pub trace: Option<Vec<(u64, usize, usize)>>,
    /// Tokens per page.
    pub page_size: usize,
    /// Pages per decode worker's pool.
    pub decode_pages: usize,
    /// Sequences a decode worker runs at once.
    pub max_running: usize,
    /// Tokens per prefill chunk.
    pub chunk_tokens: usize,
    /// Prompts shorter than this are prefilled on decode (`serving.local_prefill_threshold`).
    pub local_threshold: usize,
    /// `serving.retries`.
    pub retries: usize,
    /// `serving.request_timeout_secs` (µs).
    pub request_timeout_us: u64,
    /// `serving.transfer_timeout_secs`: no progress for this long ends a transfer (µs).
    pub transfer_timeout_us: u64,
    /// `serving.bootstrap_timeout_secs`: how long a half waits for the other (µs).
    pub bootstrap_timeout_us: u64,
    /// How long a request may wait for decode pages (µs).
    pub prealloc_timeout_us: u64,
    /// The router gives up on an attempt that delivered nothing for this long (µs): the
    /// simulator's stand-in for a link the router sees drop.
    pub attempt_timeout_us: u64,
    /// An unacknowledged abort is asked again after this long (µs).
    pub drain_fence_us: u64,
    /// `serving.drain_backstop_secs`: an unproven drain raises the alarm after it (µs).
    pub backstop_us: u64,
    /// Nodes' timer turns (µs); 0 = no timers (the planner, which has no faults).
    pub tick_us: u64,
    /// The engine and the wire.
    pub cost: CostModel,
    /// Every worker shares one machine (as `duet up` runs a cluster): prefill and decode
    /// computing at once slow each other down (the profile's `shared_*_slowdown`).
    pub one_host: bool,
    /// Faults.
    pub faults: Faults,
    /// Bugs switched back on (tests only).
    pub mutations: Mutations,
    /// Goodput counts requests whose TTFT is within this (µs), when set.
    pub slo_ttft_us: Option<u64>,
    /// ... and whose mean time per output token is within this (µs), when set.
    pub slo_itl_us: Option<u64>,
    /// Keep a readable trace of the last events (printed for a failing seed).
    pub trace_events: usize,
}

impl SimConfig {
    /// The seed explorer's cluster: 2 routers, 2 prefill and 2 decode workers, 100 requests
    /// under [`Faults::chaos`], small pools so pages are reused often.
    pub fn explore() -> SimConfig {
        SimConfig {
            routers: 2,
            prefill: 2,
            decode: 2,
            requests: 100,
            rate: 25.0,
            prompt_tokens: (4, 200),
            output_tokens: (1, 24),
            trace: None,
            page_size: 16,
            decode_pages: 96,
            max_running: 8,
            chunk_tokens: 64,
            local_threshold: 16,
            retries: 3,
            request_timeout_us: 30_000_000,
            transfer_timeout_us: 2_000_000,
            bootstrap_timeout_us: 5_000_000,
            prealloc_timeout_us: 10_000_000,
            attempt_timeout_us: 6_000_000,
            drain_fence_us: 500_000,
            backstop_us: 3_000_000,
            tick_us: 20_000,
            cost: CostModel {
                // Faster than a CPU so a run of 100 requests takes seconds of virtual time.
                prefill_token_us: 60.0,
                prefill_attn_us: 0.1,
                decode_base_us: 2_000.0,
                decode_seq_us: 300.0,
                decode_table: Vec::new(),
                link_gbps: 10.0,
                ..CostModel::default()
            },
            one_host: false,
            faults: Faults::chaos(),
            mutations: Mutations::default(),
            slo_ttft_us: None,
            slo_itl_us: None,
            trace_events: 400,
        }
    }

    /// The planner's cluster: the default `[serving]` settings, no faults, no timers.
    pub fn plan(prefill: usize, decode: usize, rate: f64, requests: usize) -> SimConfig {
        SimConfig {
            routers: 1,
            prefill,
            decode,
            requests,
            rate,
            prompt_tokens: (128, 128),
            output_tokens: (64, 64),
            trace: None,
            // The defaults of `[serving]`.
            page_size: 16,
            decode_pages: 512,
            max_running: 64,
            chunk_tokens: 256,
            local_threshold: 32,
            retries: 3,
            request_timeout_us: u64::MAX / 4,
            transfer_timeout_us: u64::MAX / 4,
            bootstrap_timeout_us: u64::MAX / 4,
            prealloc_timeout_us: u64::MAX / 4,
            attempt_timeout_us: u64::MAX / 4,
            drain_fence_us: u64::MAX / 4,
            backstop_us: u64::MAX / 4,
            tick_us: 0,
            cost: CostModel::default(),
            one_host: false,
            faults: Faults::none(),
            mutations: Mutations::default(),
            slo_ttft_us: None,
            slo_itl_us: None,
            trace_events: 0,
        }
    }
}
