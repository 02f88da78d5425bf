//! Every metric name Duet exports, in one place, with one prefix (`duet_`).
//!
//! Names are constants so a typo is a compile error; the test below rejects duplicates and
//! names without the prefix. The recorder is Prometheus', rendered by the admin API.

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Help text of the new operator-facing metrics comes from these doc comments as well: each
/// constant's doc comment is its `# HELP` line.
macro_rules! names {
    ($( $(#[doc = $doc:expr])+ pub const $name:ident: &str = $value:literal; )*) => {
        $( $(#[doc = $doc])+ pub const $name: &str = $value; )*
        /// Every name with its help text (its doc comment), for `# HELP` and the duplicate check.
        pub const ALL: &[(&str, &str)] = &[ $( ($value, concat!($($doc),+)) ),* ];
    };
}

names! {
/// Restarts performed by supervisors, by actor kind.
pub const ACTOR_RESTARTS: &str = "duet_actor_restarts_total";
/// Supervisors that gave up and escalated to their parent, by the failing child's kind.
pub const SUPERVISOR_ESCALATIONS: &str = "duet_supervisor_escalations_total";
/// Successful link handshakes, by peer.
pub const LINK_CONNECTS: &str = "duet_link_connects_total";
/// Inbound links refused, by reason (tls, token, cluster, node).
pub const LINK_HANDSHAKE_FAILURES: &str = "duet_link_handshake_failures_total";
/// Frames that failed to decode or broke the protocol, by peer and reason.
pub const LINK_FRAME_ERRORS: &str = "duet_link_frame_errors_total";
/// Envelopes written to a link, by peer.
pub const LINK_MESSAGES_SENT: &str = "duet_link_messages_sent_total";
/// Envelopes read from a link, by peer.
pub const LINK_MESSAGES_RECEIVED: &str = "duet_link_messages_received_total";
/// One-way envelopes that had no live local target, by peer.
pub const LINK_UNDELIVERED: &str = "duet_link_undelivered_total";
/// Answers that arrived after their request's deadline, by peer.
pub const LINK_LATE_ANSWERS: &str = "duet_link_late_answers_total";
/// 1 while a peer is up, 0 while down, by peer.
pub const PEER_UP: &str = "duet_peer_up";
/// Nodes not in cluster.toml this node admitted (from their hello or a peer's gossip).
pub const NODES_JOINED: &str = "duet_nodes_joined_total";
/// Up/down transitions seen by membership, by peer and new state.
pub const PEER_TRANSITIONS: &str = "duet_peer_transitions_total";
/// Admin API calls refused for a missing or wrong token.
pub const ADMIN_UNAUTHORIZED: &str = "duet_admin_unauthorized_total";
/// Requests the router retried on another worker (their worker was lost before a token).
pub const ROUTER_RETRIES: &str = "duet_router_retries_total";
/// Protocol messages ignored because their attempt is no longer current (by kind).
pub const STALE_MESSAGES: &str = "duet_stale_messages_total";
/// Drains that ended at their timeout with requests still in flight.
pub const DRAIN_TIMEOUTS: &str = "duet_drain_timeouts_total";
/// Streams continued on another decode worker after tokens were sent (by outcome).
pub const ROUTER_MIGRATIONS: &str = "duet_router_migrations_total";
/// Kept prompt pages that memory pressure evicted before their keep ended.
pub const MIGRATION_KEEPS_BROKEN: &str = "duet_migration_keeps_broken_total";
/// Pages prefill keeps for migrations (a subset of the cached pages).
pub const KV_PAGES_KEPT: &str = "duet_kv_pages_kept";
/// Requests the router finished, by endpoint and outcome.
pub const ROUTER_REQUESTS: &str = "duet_router_requests_total";
/// KV pages in a worker's pool.
pub const KV_PAGES_TOTAL: &str = "duet_kv_pages_total";
/// KV pages on the free list.
pub const KV_PAGES_FREE: &str = "duet_kv_pages_free";
/// KV pages held only by the prefix cache (reclaimable at once).
pub const KV_PAGES_CACHED: &str = "duet_kv_pages_cached";
/// KV pages pinned by transfers.
pub const KV_PAGES_PINNED: &str = "duet_kv_pages_pinned";
/// Sequences running on a worker.
pub const SEQS_RUNNING: &str = "duet_sequences_running";
/// Sequences waiting on a worker.
pub const SEQS_WAITING: &str = "duet_sequences_waiting";
/// Router routing decisions, by `path` (`disaggregated`, `decode_only`) and `reason`.
pub const ROUTER_ROUTES: &str = "duet_router_routes_total";
/// Cache-aware choices, by worker `kind` and `outcome` (`hit`: the worker holding the longest
/// cached prefix was chosen; `miss`: nobody held any, or load did not allow, so load chose).
pub const ROUTER_CACHE_ROUTES: &str = "duet_router_cache_routes_total";
/// Prompts decode prefilled itself although a prefill worker was assigned, by `reason`.
pub const DECODE_LOCAL_PREFILLS: &str = "duet_decode_local_prefills_total";
/// Requests in prefill's bootstrap queue (waiting for decode's pages).
pub const BOOTSTRAP_QUEUE: &str = "duet_bootstrap_queue";
/// Requests in decode's prealloc queue (waiting for free pages).
pub const PREALLOC_QUEUE: &str = "duet_prealloc_queue";
/// Seconds a request waited in the bootstrap queue.
pub const BOOTSTRAP_WAIT: &str = "duet_bootstrap_wait_seconds";
/// Seconds from the bootstrap match to the first chunk's compute (prefill's queue).
pub const PREFILL_QUEUE_WAIT: &str = "duet_prefill_queue_wait_seconds";
/// Seconds of prefill compute, first chunk to last.
pub const PREFILL_SECONDS: &str = "duet_prefill_seconds";
/// Seconds from decode's notice to the complete KV (decode's view of the transfer).
pub const TRANSFER_LATENCY: &str = "duet_transfer_latency_seconds";
/// Transfer throughput of one request, GB/s of KV written (time spent writing).
pub const TRANSFER_GBPS: &str = "duet_transfer_gbps";
/// Seconds from the end of the last chunk's compute to decode holding the complete KV.
pub const TRANSFER_EXPOSED: &str = "duet_transfer_exposed_seconds";
/// Router: seconds from a request's arrival to its first token (TTFT).
pub const ROUTER_TTFT: &str = "duet_router_ttft_seconds";
/// Router: seconds between consecutive tokens of a request (ITL).
pub const ROUTER_ITL: &str = "duet_router_itl_seconds";
/// Router: seconds from a request's arrival to its last token.
pub const ROUTER_E2E: &str = "duet_router_e2e_seconds";
/// KV pages whose transfer was aborted and whose writes are not yet proven drained.
pub const KV_PAGES_QUARANTINED: &str = "duet_kv_pages_quarantined";
/// Aborted transfers still unproven past the drain backstop (a writer holds its claim: paused
/// or stuck mid-copy), by the prefill `peer` that holds it. Their pages stay quarantined.
pub const QUARANTINE_STALLS: &str = "duet_kv_quarantine_stalls_total";
/// Prefill: runs of pages decode refused to take because it had revoked the attempt's grant
/// (a writer that woke after decode gave up on it; nothing of those runs was written).
pub const KV_WRITES_REFUSED: &str = "duet_kv_writes_refused_total";
/// KV pages in use (referenced or pinned).
pub const KV_PAGES_USED: &str = "duet_kv_pages_used";
/// Aborted transfers, by `side` and `reason`.
pub const TRANSFER_ABORTS: &str = "duet_transfer_aborts_total";
/// Transfers whose KV failed decode's checksum (never published).
pub const KV_CHECKSUM_FAILURES: &str = "duet_kv_checksum_failures_total";
/// Seconds decode spent checking one transfer's checksums (hashing, summed over its turns).
pub const KV_VERIFY: &str = "duet_kv_verify_seconds";
/// Engine turns decode's check of one transfer's checksums took: 1 unless it was spread over
/// steps while sequences ran (`serving.kv_verify_step_mib` a step).
pub const KV_VERIFY_TURNS: &str = "duet_kv_verify_turns";
/// Seconds prefill spent writing one request's KV (all its writes and the final fence).
pub const TRANSFER_WRITE: &str = "duet_transfer_write_seconds";
/// KV bytes written by prefill, by `backend`.
pub const KV_BYTES_SENT: &str = "duet_kv_bytes_sent_total";
/// KV bytes received by decode over TCP.
pub const KV_BYTES_RECEIVED: &str = "duet_kv_bytes_received_total";
/// Decode: frames that came over TCP for an attempt it had revoked (the sender had not heard
/// yet), read and dropped; the connection carries on.
pub const KV_FRAMES_DROPPED: &str = "duet_kv_frames_dropped_total";
/// Transfers, by `outcome` (`completed`, `aborted`, `failed`) and `side`.
pub const TRANSFERS: &str = "duet_transfers_total";
/// Prefill chunks computed on prefill workers.
pub const PREFILL_CHUNKS: &str = "duet_prefill_chunks_total";
/// Prompt tokens of the requests the router served, by `model_name` (vLLM's
/// `vllm:prompt_tokens_total`, SGLang's `sglang:prompt_tokens_total`).
pub const PROMPT_TOKENS: &str = "duet_prompt_tokens_total";
/// Tokens generated for the router's requests, by `model_name` (vLLM's
/// `vllm:generation_tokens_total`, SGLang's `sglang:generation_tokens_total`).
pub const GENERATION_TOKENS: &str = "duet_generation_tokens_total";
/// Prompt tokens looked up in a prefix cache, by `model_name` (vLLM's
/// `vllm:prefix_cache_queries_total`).
pub const PREFIX_CACHE_QUERIES: &str = "duet_prefix_cache_queries_total";
/// Prompt tokens found in a prefix cache, by `model_name` (vLLM's `vllm:prefix_cache_hits_total`).
pub const PREFIX_CACHE_HITS: &str = "duet_prefix_cache_hits_total";
/// Prompt tokens per finished request, by `model_name` (vLLM's `vllm:request_prompt_tokens`).
pub const REQUEST_PROMPT_TOKENS: &str = "duet_request_prompt_tokens";
/// Generated tokens per finished request, by `model_name` (vLLM's
/// `vllm:request_generation_tokens`).
pub const REQUEST_GENERATION_TOKENS: &str = "duet_request_generation_tokens";
/// Requests running on a worker, by `model_name` (vLLM's `vllm:num_requests_running`,
/// SGLang's `sglang:num_running_reqs`).
pub const NUM_REQUESTS_RUNNING: &str = "duet_num_requests_running";
/// Requests waiting on a worker, by `model_name` (vLLM's `vllm:num_requests_waiting`,
/// SGLang's `sglang:num_queue_reqs`).
pub const NUM_REQUESTS_WAITING: &str = "duet_num_requests_waiting";
/// Fraction of a worker's KV pages in use, 0 to 1, by `model_name` (vLLM's
/// `vllm:kv_cache_usage_perc`, SGLang's `sglang:token_usage`).
pub const KV_CACHE_USAGE: &str = "duet_kv_cache_usage_perc";
/// Seconds one engine step took on a worker (compute and sampling of every sequence in it),
/// by `role` (`decode`, `prefill`): a decode step is every running sequence's inter-token gap.
pub const ENGINE_STEP: &str = "duet_engine_step_seconds";
/// Tokens one engine step computed, by `role`: one per decoding sequence, a chunk per prompt
/// (vLLM's `vllm:iteration_tokens_total`).
pub const ENGINE_STEP_TOKENS: &str = "duet_engine_step_tokens";
/// KV positions one engine step's tokens attended over, summed, by `role`: the step's time
/// is its weights' pass (with the tokens) plus its attention (with these).
pub const ENGINE_STEP_ATTENDED: &str = "duet_engine_step_attended_tokens";
/// CPU time the engine thread got during one engine step, by `role`: a step whose wall time
/// is well above this one lost the rest to its thread waiting for the core
/// (`duet_engine_step_wait_seconds`) or to interrupts and the hypervisor. With more than one
/// compute thread this is the first one's (the engine thread's) time.
pub const ENGINE_STEP_CPU: &str = "duet_engine_step_cpu_seconds";
/// Time the engine thread was runnable during one engine step but another thread had its
/// core, by `role` (the kernel's run-queue delay): another process or thread pinned to the
/// worker's cores.
pub const ENGINE_STEP_WAIT: &str = "duet_engine_step_wait_seconds";
}

/// Histogram buckets for latencies, in seconds (sub-millisecond transfers to minute-long
/// requests).
const SECONDS_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0, 120.0,
];

/// Token counts (a request's prompt or output, a step's tokens or the positions it attends
/// over), powers of two.
const TOKENS_BUCKETS: &[f64] = &[
    1.0, 4.0, 16.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0,
    65536.0, 131072.0, 262144.0, 524288.0, 1048576.0,
];
/// Histogram buckets for per-token latencies (an engine step, the router's inter-token gap), in
/// seconds: about 10 % apart from 1 to 200 ms, so that a p99 over a p50 read from them (the
/// jitter a decode batch's users feel, a ratio near 1) is good to a few percent rather than
/// to the factor of 2-2.5 of the general latency buckets.
pub const TOKEN_LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.0035, 0.004, 0.0045, 0.005, 0.0055, 0.006,
    0.0065, 0.007, 0.0075, 0.008, 0.009, 0.01, 0.011, 0.012, 0.013, 0.014, 0.015, 0.0165, 0.018,
    0.02, 0.022, 0.024, 0.026, 0.028, 0.03, 0.033, 0.036, 0.04, 0.044, 0.048, 0.052, 0.056, 0.06,
    0.065, 0.07, 0.075, 0.08, 0.09, 0.1, 0.11, 0.12, 0.135, 0.15, 0.175, 0.2, 0.25, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 10.0,
];

/// Histogram buckets for throughputs, in GB/s.
const GBPS_BUCKETS: &[f64] = &[0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0];

/// Installs the process-wide Prometheus recorder (once) and returns its handle.
pub fn install() -> PrometheusHandle {
    static HANDLE: std::sync::OnceLock<PrometheusHandle> = std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            use metrics_exporter_prometheus::Matcher;
            // Histograms, not summaries: buckets aggregate across nodes and scrapes.
            // Token counts: the requests' lengths and the steps' sizes.
            let counts = [
                REQUEST_PROMPT_TOKENS,
                REQUEST_GENERATION_TOKENS,
                ENGINE_STEP_TOKENS,
                ENGINE_STEP_ATTENDED,
                KV_VERIFY_TURNS,
            ];
            let builder = counts.iter().fold(
                PrometheusBuilder::new()
                    .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
                    .and_then(|b| {
                        b.set_buckets_for_metric(Matcher::Suffix("_gbps".into()), GBPS_BUCKETS)
                    }),
                |b, name| {
                    b.and_then(|b| {
                        b.set_buckets_for_metric(Matcher::Full((*name).into()), TOKENS_BUCKETS)
                    })
                },
            );
            // A full name's buckets win over the `_seconds` suffix's.
            let builder =
                [ENGINE_STEP, ENGINE_STEP_CPU, ROUTER_ITL]
                    .iter()
                    .fold(builder, |b, name| {
                        b.and_then(|b| {
                            b.set_buckets_for_metric(
                                Matcher::Full((*name).into()),
                                TOKEN_LATENCY_BUCKETS,
                            )
                        })
                    });
            let recorder = match builder {
                Ok(b) => b.build_recorder(),
                Err(_) => PrometheusBuilder::new().build_recorder(),
            };
            let handle = recorder.handle();
            // Fails only if another recorder was installed first, in which case our handle
            // simply renders nothing; never fatal for a node.
            let _ = metrics::set_global_recorder(recorder);
            // `# HELP` for every metric: its constant's doc comment.
            for (name, help) in ALL {
                metrics::describe_gauge!(*name, help.trim());
            }
            handle
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn names_are_unique_and_prefixed() {
        let mut seen = HashSet::new();
        for (name, help) in ALL {
            assert!(name.starts_with("duet_"), "{name} lacks the duet_ prefix");
            assert!(seen.insert(name), "{name} is defined twice");
            assert!(help.trim().len() > 10, "{name} has no help text");
        }
    }

    #[test]
    fn latencies_and_token_counts_render_as_histograms_with_their_buckets() {
        let handle = install();
        metrics::histogram!(ENGINE_STEP, "role" => "decode").record(0.03);
        metrics::histogram!(ENGINE_STEP_TOKENS, "role" => "decode").record(4.0);
        metrics::histogram!(ENGINE_STEP_ATTENDED, "role" => "decode").record(1500.0);
        metrics::histogram!(ENGINE_STEP_CPU, "role" => "decode").record(0.029);
        metrics::histogram!(ENGINE_STEP_WAIT, "role" => "decode").record(0.0004);
        metrics::histogram!(ROUTER_ITL).record(0.034);
        metrics::histogram!(ROUTER_TTFT).record(0.034);
        let text = handle.render();
        for bucket in [
            // Per-token latencies: 10 % buckets.
            "duet_engine_step_seconds_bucket{role=\"decode\",le=\"0.028\"} 0",
            "duet_engine_step_seconds_bucket{role=\"decode\",le=\"0.03\"} 1",
            "duet_engine_step_cpu_seconds_bucket{role=\"decode\",le=\"0.028\"} 0",
            "duet_engine_step_cpu_seconds_bucket{role=\"decode\",le=\"0.03\"} 1",
            "duet_engine_step_wait_seconds_bucket{role=\"decode\",le=\"0.00025\"} 0",
            "duet_engine_step_wait_seconds_bucket{role=\"decode\",le=\"0.0005\"} 1",
            "duet_router_itl_seconds_bucket{le=\"0.033\"} 0",
            "duet_router_itl_seconds_bucket{le=\"0.036\"} 1",
            // Other latencies keep the wide ones.
            "duet_router_ttft_seconds_bucket{le=\"0.025\"} 0",
            "duet_router_ttft_seconds_bucket{le=\"0.05\"} 1",
            "duet_engine_step_tokens_bucket{role=\"decode\",le=\"4\"} 1",
            "duet_engine_step_attended_tokens_bucket{role=\"decode\",le=\"1024\"} 0",
            "duet_engine_step_attended_tokens_bucket{role=\"decode\",le=\"2048\"} 1",
        ] {
            assert!(text.contains(bucket), "no `{bucket}` in:\n{text}");
        }
    }
}
