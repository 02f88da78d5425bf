//! Prefill and decode on separate real processes with the real model: the KV streams page by
//! page from prefill into pages decode reserved, through each backend, and the output equals
//! the colocated engine's token for token.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use duet_engine::{Engine, EngineOptions, Model, Runner, SamplingParams};
use serde_json::{Value, json};

const PAGE: usize = 16;
const CHUNK: usize = 32;

fn serving(model: &Path, http: u16, extra: &str) -> String {
    format!(
        "[serving]\nmodel = \"{}\"\nhttp = \"127.0.0.1:{http}\"\nkv_pages = 64\npage_size = {PAGE}\n\
         max_batch_tokens = {CHUNK}\ndisagg_threshold = 0\nkv_dtype = \"f32\"\n\
         request_timeout_secs = 40\nbootstrap_timeout_secs = 20\ntransfer_timeout_secs = 30\n{extra}",
        model.display()
    )
}

/// Prompt token ids: the real tokenizer's ids of a long text, cut to `n`.
fn prompt_ids(model: &Model, n: usize) -> Vec<u32> {
    prompt_ids_from(model, 0, n)
}

/// Like [`prompt_ids`], starting `skip` tokens in (a prompt sharing no prefix with it).
fn prompt_ids_from(model: &Model, skip: usize, n: usize) -> Vec<u32> {
    let text = "The history of computing is a story of layers: transistors make gates, gates \
                make adders and memories, and those make processors that run compilers, which \
                in turn build operating systems, databases and the networks between them. ";
    let ids = model.tokenizer.encode(&text.repeat(12));
    ids[skip..skip + n].to_vec()
}

/// What the colocated engine says for these prompts (the reference).
fn colocated(model_path: &Path, prompts: &[Vec<u32>], params: &SamplingParams) -> Vec<String> {
    let model = Model::open(model_path).expect("model");
    let engine = Engine::new(
        model,
        EngineOptions {
            kv_dtype: duet_gpu::KvDtype::F32,
            page_size: PAGE,
            kv_pages: 64,
            threads: 1,
            max_context: 2048,
        },
    )
    .expect("engine");
    let mut runner = Runner::new(engine, CHUNK, 8);
    prompts
        .iter()
        .map(|p| {
            runner.submit(1, p.clone(), params.clone()).expect("submit");
            runner
                .run_to_completion()
                .expect("run")
                .into_iter()
                .map(|e| e.text)
                .collect()
        })
        .collect()
}

async fn complete(http: u16, body: Value) -> (u16, Value) {
    curl_completion(http, &body).await
}

fn text_of(v: &Value) -> String {
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

async fn ready(http: u16) {
    router_ready(http, 2).await;
}

/// Pools are whole when quiet: no pins, and every page free or held only by the prefix cache
/// (which gives it up at once).
async fn assert_pools_whole(c: &ClusterDir) {
    assert_pools_whole_on(c, &["p0", "d0"]).await;
}

async fn assert_pools_whole_on(c: &ClusterDir, nodes: &[&str]) {
    let token = c.token();
    for &node in nodes {
        let addr = c.admin(node);
        poll(
            &format!("{node}'s pool whole"),
            Duration::from_secs(10),
            || async {
                let total = metric(addr, &token, "duet_kv_pages_total", "").await;
                let free = metric(addr, &token, "duet_kv_pages_free", "").await;
                let cached = metric(addr, &token, "duet_kv_pages_cached", "").await;
                let pinned = metric(addr, &token, "duet_kv_pages_pinned", "").await;
                (total > 0.0 && pinned == 0.0 && free + cached == total).then_some(())
            },
        )
        .await;
    }
}

async fn greedy_and_seeded_equal_colocated(backend: &str) {
    let model_path = real_model();
    let model = Model::open(&model_path).expect("model");
    let lengths = [1, PAGE - 1, PAGE, PAGE + 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5];
    let prompts: Vec<Vec<u32>> = lengths.iter().map(|&n| prompt_ids(&model, n)).collect();
    let greedy = SamplingParams {
        max_tokens: 8,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let seeded = SamplingParams {
        temperature: 0.9,
        seed: Some(11),
        ..greedy.clone()
    };
    let want_greedy = colocated(&model_path, &prompts, &greedy);
    let want_seeded = colocated(&model_path, &prompts, &seeded);

    let http = free_ports(1)[0];
    let extra = format!("kv_transport = \"{backend}\"\n");
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        &serving(&model_path, http, &extra),
    );
    let _up = Running::up(&c.config).await;
    ready(http).await;
    let token = c.token();
    for (i, p) in prompts.iter().enumerate() {
        for (params, want) in [(&greedy, &want_greedy), (&seeded, &want_seeded)] {
            let mut body = json!({
                "prompt": p, "max_tokens": 8, "ignore_eos": true,
                "temperature": params.temperature,
            });
            if let Some(seed) = params.seed {
                body["seed"] = json!(seed);
            }
            let (code, v) = complete(http, body).await;
            assert_eq!(code, 200, "{backend}, {} tokens: {v}", p.len());
            assert_eq!(
                text_of(&v),
                want[i],
                "{backend}, prompt of {} tokens, temperature {}",
                p.len(),
                params.temperature
            );
        }
    }
    let done = metric(
        c.admin("d0"),
        &token,
        "duet_transfers_total",
        "outcome=\"completed\"",
    )
    .await;
    assert_eq!(
        done,
        (2 * prompts.len()) as f64,
        "every request went through a transfer"
    );
    let sent = metric(
        c.admin("p0"),
        &token,
        "duet_kv_bytes_sent_total",
        &format!("backend=\"{backend}\""),
    )
    .await;
    assert!(sent > 0.0, "no KV bytes over {backend}");
    assert_pools_whole(&c).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn shm_output_equals_colocated() {
    greedy_and_seeded_equal_colocated("shm").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn tcp_output_equals_colocated() {
    greedy_and_seeded_equal_colocated("tcp").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn decode_prefix_cache_sends_fewer_bytes() {
    let model_path = real_model();
    let model = Model::open(&model_path).expect("model");
    let http = free_ports(1)[0];
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        &serving(&model_path, http, ""),
    );
    let _up = Running::up(&c.config).await;
    ready(http).await;
    let token = c.token();
    let prompt = prompt_ids(&model, 4 * PAGE + 3);
    let body = json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let sent = || metric(c.admin("p0"), &token, "duet_kv_bytes_sent_total", "");
    let (code, first) = complete(http, body.clone()).await;
    assert_eq!(code, 200, "{first}");
    let cold = sent().await;
    let (code, second) = complete(http, body).await;
    assert_eq!(code, 200, "{second}");
    let warm = sent().await - cold;
    assert_eq!(text_of(&first), text_of(&second));
    assert!(
        cold > 0.0 && warm < cold,
        "warm transfer {warm} bytes, cold {cold}"
    );
    assert!(second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() >= Some(64));
    assert_pools_whole(&c).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_decode_pool_holds_prefill_back_until_pages_free() {
    let model_path = real_model();
    let model = Model::open(&model_path).expect("model");
    let http = free_ports(1)[0];
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        &serving(&model_path, http, "[serving.node.d0]\nkv_pages = 16\n"),
    );
    let _up = Running::up(&c.config).await;
    ready(http).await;
    let token = c.token();
    // A occupies 8 of the 16 pages and grows to 16 while it decodes; B (sharing no prefix
    // with A) needs 9.
    let a = json!({"prompt": prompt_ids(&model, 8 * PAGE), "max_tokens": 120, "temperature": 0, "ignore_eos": true});
    let b = json!({"prompt": prompt_ids_from(&model, 190, 9 * PAGE - 2), "max_tokens": 4, "temperature": 0, "ignore_eos": true});
    let first = tokio::spawn(complete(http, a));
    poll("A decoding on d0", Duration::from_secs(60), || async {
        (metric(c.admin("d0"), &token, "duet_sequences_running", "").await >= 1.0).then_some(())
    })
    .await;
    let chunks_for_a = metric(c.admin("p0"), &token, "duet_prefill_chunks_total", "").await;
    let second = tokio::spawn(complete(http, b));
    poll(
        "B waiting in p0's bootstrap queue",
        Duration::from_secs(30),
        || async {
            (metric(c.admin("p0"), &token, "duet_bootstrap_queue", "").await >= 1.0).then_some(())
        },
    )
    .await;
    // While B waits, prefill computed nothing for it.
    assert_eq!(
        metric(c.admin("p0"), &token, "duet_prefill_chunks_total", "").await,
        chunks_for_a,
        "prefill ran without pages to land in"
    );
    let (code_a, va) = first.await.expect("A");
    let (code_b, vb) = second.await.expect("B");
    assert_eq!((code_a, code_b), (200, 200), "{va} {vb}");
    assert!(metric(c.admin("p0"), &token, "duet_prefill_chunks_total", "").await > chunks_for_a);
    assert_pools_whole(&c).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn different_page_sizes_are_never_paired() {
    let model_path = real_model();
    let model = Model::open(&model_path).expect("model");
    let http = free_ports(1)[0];
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        &serving(&model_path, http, "[serving.node.p0]\npage_size = 32\n"),
    );
    let _up = Running::up(&c.config).await;
    ready(http).await;
    let token = c.token();
    let prompt = prompt_ids(&model, 40);
    let (code, v) = complete(
        http,
        json!({"prompt": prompt, "max_tokens": 4, "temperature": 0}),
    )
    .await;
    assert_eq!(code, 200, "served by decode alone: {v}");
    let unpaired = metric(
        c.admin("router"),
        &token,
        "duet_router_routes_total",
        "reason=\"no_compatible_prefill\"",
    )
    .await;
    assert!(unpaired >= 1.0);
    // Forcing the pair fails with an error that names both values.
    let (code, v) = complete(
        http,
        json!({"prompt": prompt, "max_tokens": 4, "temperature": 0, "duet_pair": "p0,d0"}),
    )
    .await;
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(code >= 400, "{v}");
    assert!(
        message.contains("page_size is 32 on p0 but 16 on d0"),
        "{message}"
    );
    assert_eq!(
        metric(c.admin("p0"), &token, "duet_prefill_chunks_total", "").await,
        0.0
    );
    assert_pools_whole(&c).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_gone_mid_transfer_drains_before_pages_free() {
    let model_path = real_model();
    let model = Model::open(&model_path).expect("model");
    let http = free_ports(1)[0];
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        &serving(&model_path, http, ""),
    );
    let _up = Running::up(&c.config).await;
    ready(http).await;
    let token = c.token();
    // A long prompt (many chunks): the client leaves while prefill streams it.
    let body = json!({"prompt": prompt_ids(&model, 420), "max_tokens": 4, "stream": true});
    let curl = curl_stream(http, &body, std::process::Stdio::null());
    poll(
        "prefill streaming pages",
        Duration::from_secs(60),
        || async {
            (metric(c.admin("p0"), &token, "duet_kv_bytes_sent_total", "").await > 0.0)
                .then_some(())
        },
    )
    .await;
    let mut curl = curl;
    curl.kill().await.expect("kill curl");
    poll(
        "the transfer aborted on both sides",
        Duration::from_secs(30),
        || async {
            let d = metric(
                c.admin("d0"),
                &token,
                "duet_transfers_total",
                "outcome=\"aborted\"",
            )
            .await;
            let p = metric(
                c.admin("p0"),
                &token,
                "duet_transfers_total",
                "outcome=\"aborted\"",
            )
            .await;
            (d >= 1.0 && p >= 1.0).then_some(())
        },
    )
    .await;
    assert_eq!(
        metric(
            c.admin("d0"),
            &token,
            "duet_transfers_total",
            "outcome=\"completed\""
        )
        .await,
        0.0,
        "an aborted transfer was published"
    );
    assert_pools_whole(&c).await;
    // The pair still serves.
    let (code, v) = complete(
        http,
        json!({"prompt": prompt_ids(&model, 40), "max_tokens": 4, "temperature": 0}),
    )
    .await;
    assert_eq!(code, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread")]
async fn short_or_cached_prompts_are_prefilled_on_decode() {
    let model_path = real_model();
    let model = Model::open(&model_path).expect("model");
    let http = free_ports(1)[0];
    // The default threshold (32 tokens) instead of the tests' 0.
    let config = serving(&model_path, http, "").replace("disagg_threshold = 0\n", "");
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        &config,
    );
    let _up = Running::up(&c.config).await;
    ready(http).await;
    let token = c.token();
    let ask =
        |n: usize| json!({"prompt": prompt_ids(&model, n), "max_tokens": 3, "temperature": 0});
    // Short: decode alone, decided by the router.
    let (code, v) = complete(http, ask(10)).await;
    assert_eq!(code, 200, "{v}");
    let short = metric(
        c.admin("router"),
        &token,
        "duet_router_routes_total",
        "reason=\"short_prompt\"",
    )
    .await;
    assert_eq!(short, 1.0);
    assert_eq!(
        metric(c.admin("p0"), &token, "duet_prefill_chunks_total", "").await,
        0.0
    );
    // Long: paired, prefilled on p0.
    let (code, v) = complete(http, ask(4 * PAGE + 3)).await;
    assert_eq!(code, 200, "{v}");
    let chunks = metric(c.admin("p0"), &token, "duet_prefill_chunks_total", "").await;
    assert!(chunks > 0.0);
    // The same long prompt again: decode caches all but 3 tokens, so the router (which sent
    // the prompt there, cache-aware) has decode prefill them itself.
    let (code, again) = complete(http, ask(4 * PAGE + 3)).await;
    assert_eq!(code, 200, "{again}");
    assert_eq!(text_of(&again), text_of(&v));
    let cached = metric(
        c.admin("router"),
        &token,
        "duet_router_routes_total",
        "reason=\"cached_prefix\"",
    )
    .await;
    assert_eq!(cached, 1.0);
    assert_eq!(
        metric(c.admin("p0"), &token, "duet_prefill_chunks_total", "").await,
        chunks,
        "prefill computed a prompt decode had cached"
    );
    assert_pools_whole(&c).await;
}

/// A prompt whose part decode has not cached is short is still prefilled on decode when the
/// router could not know (load-only routing): decode decides on its own cache.
#[tokio::test(flavor = "multi_thread")]
async fn decode_prefills_a_mostly_cached_prompt_itself_when_the_router_pairs_it() {
    let model_path = real_model();
    let model = Model::open(&model_path).expect("model");
    let http = free_ports(1)[0];
    let config =
        serving(&model_path, http, "routing = \"load\"\n").replace("disagg_threshold = 0\n", "");
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        &config,
    );
    let _up = Running::up(&c.config).await;
    ready(http).await;
    let token = c.token();
    let ask =
        json!({"prompt": prompt_ids(&model, 4 * PAGE + 3), "max_tokens": 3, "temperature": 0});
    let (code, v) = complete(http, ask.clone()).await;
    assert_eq!(code, 200, "{v}");
    let (code, again) = complete(http, ask).await;
    assert_eq!(code, 200, "{again}");
    assert_eq!(text_of(&again), text_of(&v));
    let local = metric(
        c.admin("d0"),
        &token,
        "duet_decode_local_prefills_total",
        "reason=\"cached\"",
    )
    .await;
    assert_eq!(local, 1.0);
    assert_pools_whole(&c).await;
}

/// Cache-aware routing (issue 19): requests sharing a long prefix (an 8-page system prompt)
/// go back to the decode worker that holds it, so only their new suffix's KV moves; the other
/// decode worker takes none of them while the load allows.
#[tokio::test(flavor = "multi_thread")]
async fn a_shared_prefix_goes_back_to_the_decode_worker_holding_it() {
    let model_path = real_model();
    let model = Model::open(&model_path).expect("model");
    let http = free_ports(1)[0];
    let c = ClusterDir::new(
        &[
            ("router", "router"),
            ("p0", "prefill"),
            ("d0", "decode"),
            ("d1", "decode"),
        ],
        &serving(&model_path, http, ""),
    );
    let _up = Running::up(&c.config).await;
    // Both decode workers ready before the first request (routing sees both).
    router_ready(http, 3).await;
    let token = c.token();
    let system = prompt_ids(&model, 8 * PAGE);
    let sent = || metric(c.admin("p0"), &token, "duet_kv_bytes_sent_total", "");
    let mut moved = Vec::new();
    for user in 0..6u32 {
        let mut prompt = system.clone();
        prompt.extend([100 + user, 200 + user, 300 + user]);
        let before = sent().await;
        let (code, v) = complete(
            http,
            json!({"prompt": prompt, "max_tokens": 3, "temperature": 0}),
        )
        .await;
        assert_eq!(code, 200, "{v}");
        moved.push(sent().await - before);
    }
    let completed = |d: &'static str| {
        let token = token.clone();
        let c = &c;
        async move {
            metric(
                c.admin(d),
                &token,
                "duet_transfers_total",
                "outcome=\"completed\"",
            )
            .await
        }
    };
    let (d0, d1) = (completed("d0").await, completed("d1").await);
    assert!(
        (d0, d1) == (6.0, 0.0) || (d0, d1) == (0.0, 6.0),
        "the shared prefix was spread: d0 {d0}, d1 {d1} transfers"
    );
    let hits = metric(
        c.admin("router"),
        &token,
        "duet_router_cache_routes_total",
        "kind=\"decode\",outcome=\"hit\"",
    )
    .await;
    assert_eq!(hits, 5.0);
    assert!(
        moved[1..].iter().all(|m| *m < moved[0] / 2.0),
        "KV bytes moved per request: {moved:?}"
    );
    assert_pools_whole_on(&c, &["p0", "d0", "d1"]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_corrupted_run_is_caught_by_the_checksum_and_never_served() {
    let model_path = real_model();
    let model = Model::open(&model_path).expect("model");
    let prompt = prompt_ids(&model, 3 * CHUNK + 5);
    let greedy = SamplingParams {
        max_tokens: 6,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let want = colocated(&model_path, std::slice::from_ref(&prompt), &greedy);
    let http = free_ports(1)[0];
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        &serving(&model_path, http, ""),
    );
    // Prefill corrupts one byte of the first run of its first transfer, after writing it.
    let _up = Running::start_env(
        &["up", "--config", path_str(&c.config)],
        "ready",
        &[("DUET_FAULT_CORRUPT_KV", "1")],
    )
    .await;
    ready(http).await;
    let token = c.token();
    let (code, v) = complete(
        http,
        json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true}),
    )
    .await;
    // The corrupted attempt failed its checksum on decode; the router retried on a new
    // attempt, and what the client got is the uncorrupted output.
    assert_eq!(code, 200, "{v}");
    assert_eq!(text_of(&v), want[0]);
    assert_eq!(
        metric(c.admin("d0"), &token, "duet_kv_checksum_failures_total", "").await,
        1.0
    );
    assert!(metric(c.admin("router"), &token, "duet_router_retries_total", "").await >= 1.0);
    assert_eq!(
        metric(
            c.admin("d0"),
            &token,
            "duet_transfers_total",
            "outcome=\"completed\""
        )
        .await,
        1.0,
        "only the clean attempt was published"
    );
    assert_pools_whole(&c).await;
}

/// A transfer's check spread over decode's steps: at 1 MiB a step (one f32 page here) while a
/// stream runs, the long prompt's 7 pages take 7 steps; its KV is published only once every
/// page passed, and both outputs are the colocated engine's.
#[tokio::test(flavor = "multi_thread")]
async fn a_check_spread_over_decode_steps_publishes_the_exact_kv() {
    let model_path = real_model();
    let model = Model::open(&model_path).expect("model");
    let steady = prompt_ids_from(&model, 200, 20);
    let long = prompt_ids(&model, 3 * CHUNK + 5);
    let params = |max_tokens| SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let want_steady = colocated(&model_path, std::slice::from_ref(&steady), &params(300));
    let want_long = colocated(&model_path, std::slice::from_ref(&long), &params(6));
    let http = free_ports(1)[0];
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        &serving(&model_path, http, "kv_verify_step_mib = 1\n"),
    );
    let _up = Running::up(&c.config).await;
    ready(http).await;
    let token = c.token();
    let body = json!({"prompt": steady, "max_tokens": 300, "temperature": 0,
                      "ignore_eos": true, "stream": true});
    let mut stream = Stream::open(http, body);
    stream.until(3).await;
    let (code, v) = complete(
        http,
        json!({"prompt": long, "max_tokens": 6, "temperature": 0, "ignore_eos": true}),
    )
    .await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(text_of(&v), want_long[0]);
    assert!(
        !stream.done,
        "the stream ended before the long prompt's check"
    );
    stream.until(usize::MAX).await;
    assert_eq!(stream.error, None);
    assert_eq!(stream.text, want_steady[0]);
    let d0 = c.admin("d0");
    let checks = metric(d0, &token, "duet_kv_verify_turns_count", "").await;
    let turns = metric(d0, &token, "duet_kv_verify_turns_sum", "").await;
    // The stream's own check ran with nothing else running: one turn, all at once.
    assert_eq!(
        (checks, turns),
        (2.0, 8.0),
        "checks, and the turns they took"
    );
    assert_pools_whole(&c).await;
}

/// A streamed completion read event by event: its text, its token count, and an error event
/// if one came.
struct Stream {
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    _curl: tokio::process::Child,
    text: String,
    /// Events with a choice (about one per token).
    tokens: usize,
    /// `usage.completion_tokens` of the last event.
    usage: Option<u64>,
    error: Option<String>,
    done: bool,
}

impl Stream {
    fn open(http: u16, body: Value) -> Stream {
        use tokio::io::AsyncBufReadExt;
        let mut curl = curl_stream(http, &body, std::process::Stdio::piped());
        let out = curl.stdout.take().expect("stdout");
        Stream {
            lines: tokio::io::BufReader::new(out).lines(),
            _curl: curl,
            text: String::new(),
            tokens: 0,
            usage: None,
            error: None,
            done: false,
        }
    }

    /// Reads until `tokens` tokens arrived or the stream ended.
    async fn until(&mut self, tokens: usize) {
        while self.tokens < tokens && !self.done {
            let line = tokio::time::timeout(Duration::from_secs(120), self.lines.next_line())
                .await
                .expect("the stream went silent");
            let Some(line) = line.expect("read") else {
                self.done = true;
                break;
            };
            let Some(data) = line.strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                self.done = true;
                break;
            }
            let v: Value = serde_json::from_str(data).expect("event json");
            if let Some(e) = v.get("error") {
                self.error = Some(e.to_string());
                continue;
            }
            if let Some(c) = v["choices"].get(0) {
                self.text.push_str(c["text"].as_str().unwrap_or_default());
                self.tokens += 1;
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                self.usage = Some(n);
            }
        }
    }
}

/// Kills the decode worker that is serving the one request in flight; returns its node.
async fn kill_serving_decode(c: &ClusterDir, decodes: &[&str]) -> String {
    let token = c.token();
    let serving = poll(
        "a decode worker running the request",
        Duration::from_secs(30),
        || async {
            for &d in decodes {
                if metric(c.admin(d), &token, "duet_sequences_running", "").await >= 1.0 {
                    return Some(d.to_string());
                }
            }
            None
        },
    )
    .await;
    let path = format!("{serving}/decode/worker");
    let out = duet(&["kill", "--config", path_str(&c.config), &path]).await;
    assert!(out.status.success(), "{}", out.stderr);
    serving
}

/// Migration (issue 8): decode dies after the client has tokens; the stream continues on the
/// other decode worker from those tokens, the prefill worker re-sends the prompt KV it kept
/// (one chunk computed, not the prompt's four), and the text equals the colocated engine's.
/// With migration off, the same fault ends the stream with an error naming the cause.
#[tokio::test(flavor = "multi_thread")]
async fn a_decode_killed_mid_stream_is_continued_on_another_without_recompute() {
    let model_path = real_model();
    let model = Model::open(&model_path).expect("model");
    let params = SamplingParams {
        max_tokens: 40,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let prompt = prompt_ids(&model, 101);
    let want = colocated(&model_path, std::slice::from_ref(&prompt), &params);
    for migration in [true, false] {
        let http = free_ports(1)[0];
        let c = ClusterDir::new(
            &[
                ("router", "router"),
                ("p0", "prefill"),
                ("d0", "decode"),
                ("d1", "decode"),
            ],
            &serving(&model_path, http, &format!("migration = {migration}\n")),
        );
        let _up = Running::up(&c.config).await;
        router_ready(http, 3).await;
        let token = c.token();
        let body = json!({"prompt": prompt, "max_tokens": 40, "temperature": 0,
                          "ignore_eos": true, "stream": true,
                          "stream_options": {"include_usage": true}});
        let mut stream = Stream::open(http, body);
        stream.until(5).await;
        assert!(!stream.done, "the stream ended before the fault");
        let chunks_before = metric(c.admin("p0"), &token, "duet_prefill_chunks_total", "").await;
        let killed = kill_serving_decode(&c, &["d0", "d1"]).await;
        stream.until(usize::MAX).await;
        if !migration {
            let error = stream.error.expect("an error event");
            assert!(error.contains(&killed), "{error}");
            assert!(
                want[0].starts_with(&stream.text),
                "what was sent is correct"
            );
            continue;
        }
        assert_eq!(stream.error, None, "the stream failed");
        assert_eq!(
            stream.text, want[0],
            "the continued text differs from the colocated engine's"
        );
        assert_eq!(stream.usage, Some(40), "tokens repeated or lost");
        let migrated = metric(
            c.admin("router"),
            &token,
            "duet_router_migrations_total",
            "outcome=\"started\"",
        )
        .await;
        assert_eq!(migrated, 1.0);
        let chunks = metric(c.admin("p0"), &token, "duet_prefill_chunks_total", "").await;
        assert_eq!(
            chunks - chunks_before,
            1.0,
            "prefill recomputed the prompt instead of re-sending what it kept"
        );
        assert_pools_whole_on(&c, &["p0", "d0", "d1"]).await;
    }
}
