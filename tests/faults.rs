//! Fault scenarios of issue 8 on real processes with the real model: graceful drain under
//! load, a storm of cancellations, a prefill node stopped past its heartbeat deadline.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::*;
use serde_json::json;

/// One cluster at a time: three clusters on two cores turn timing into noise.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn serving(http: u16, extra: &str) -> String {
    format!(
        "[serving]\nmodel = \"{}\"\nhttp = \"127.0.0.1:{http}\"\nkv_pages = 256\n\
         max_batch_tokens = 32\ndisagg_threshold = 16\nrequest_timeout_secs = 60\n{extra}",
        real_model().display()
    )
}

/// A prompt of a few hundred tokens (several prefill chunks).
fn long_prompt(salt: usize) -> String {
    format!(
        "Request {salt}. The history of computing is a story of layers: transistors make gates, \
         gates make adders and memories, and those make processors that run compilers. "
    )
    .repeat(8)
}

/// A router + p0 + d0 cluster (`duet up`) on the real model with serving `extra`, its
/// workers recording the transfer history, with `env` in their environment. Returns the
/// cluster, the running `duet up`, the router's HTTP port and the history folder.
async fn pair_cluster(extra: &str, env: &[(&str, &str)]) -> (ClusterDir, Running, u16, String) {
    let http = free_ports(1)[0];
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        &serving(http, extra),
    );
    let history = history_dir(&c);
    let mut vars = env.to_vec();
    vars.push(("DUET_HISTORY_DIR", &history));
    let up = Running::start_env(&["up", "--config", path_str(&c.config)], "ready", &vars).await;
    router_ready(http, 2).await;
    (c, up, http, history)
}

/// The files of a cluster of `nodes` (config with serving `extra`, credentials) whose nodes
/// a test starts one by one; and the router's HTTP port.
async fn cluster_files(nodes: &[(&str, &str)], extra: &str) -> (ClusterDir, u16) {
    let http = free_ports(1)[0];
    let c = ClusterDir::new(nodes, &serving(http, extra));
    c.credentials(&c.config).await;
    (c, http)
}

/// SIGTERM on a prefill node under load (issue 8, test 11): the routers stop sending it new
/// requests, it finishes the ones it holds (no retry was needed for any of them), exits 0,
/// and no request fails.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_on_a_prefill_node_under_load_fails_nothing() {
    let _serial = SERIAL.lock().await;
    let (c, http) = cluster_files(
        &[
            ("router", "router"),
            ("p0", "prefill"),
            ("p1", "prefill"),
            ("d0", "decode"),
        ],
        "shutdown_drain_secs = 30\n",
    )
    .await;
    let mut nodes = Vec::new();
    for name in ["router", "p0", "d0"] {
        nodes.push(Running::node(&c.config, name).await);
    }
    let p1 = Running::node(&c.config, "p1").await;
    router_ready(http, 3).await;
    let token = c.token();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = Vec::new();
    for client in 0..4 {
        let stop = stop.clone();
        clients.push(tokio::spawn(async move {
            let mut results = Vec::new();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let body = json!({"prompt": long_prompt(client * 1000 + i), "max_tokens": 4,
                                  "temperature": 0});
                results.push(complete(http, body).await);
                i += 1;
            }
            results
        }));
    }
    // Signal p1 while it is computing a prompt.
    poll("p1 prefilling", Duration::from_secs(60), || async {
        (metric(c.admin("p1"), &token, "duet_sequences_running", "").await >= 1.0).then_some(())
    })
    .await;
    let served_before = metric(c.admin("p1"), &token, "duet_prefill_chunks_total", "").await;
    let started = std::time::Instant::now();
    let status = p1.terminate().await;
    let drain_took = started.elapsed();
    assert!(status.success(), "p1 exited with {status}");
    // The rest of the load runs on p0 alone.
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut results = Vec::new();
    for c in clients {
        results.extend(c.await.expect("client"));
    }
    let failed: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        failed.is_empty(),
        "{} of {} failed: {failed:?}",
        failed.len(),
        results.len()
    );
    assert!(results.len() >= 6, "too little load: {}", results.len());
    let retried = metric(c.admin("router"), &token, "duet_router_retries_total", "").await;
    assert_eq!(
        retried, 0.0,
        "a request p1 held was retried elsewhere instead of finished on p1"
    );
    eprintln!(
        "p1 drained in {drain_took:?} after {served_before} chunks; {} requests, none failed",
        results.len()
    );
}

/// Issue 8, item 6: a decode node started later with the cluster's config and credentials
/// joins the running cluster and takes traffic, with nothing restarted. Once d0 drains and
/// leaves, every request can only be served on the newcomer d1, and is (equal to `duet
/// generate`); no actor restarted anywhere, and the router and p0 never lost each other.
#[tokio::test(flavor = "multi_thread")]
async fn a_decode_node_started_later_joins_and_takes_traffic() {
    let _serial = SERIAL.lock().await;
    let (c, http) = cluster_files(
        &[
            ("router", "router"),
            ("p0", "prefill"),
            ("d0", "decode"),
            ("d1", "decode"),
        ],
        "",
    )
    .await;
    let _router = Running::node(&c.config, "router").await;
    let _p0 = Running::node(&c.config, "p0").await;
    let d0 = Running::node(&c.config, "d0").await;
    router_ready(http, 2).await;
    let token = c.token();
    let incarnation = |node: &'static str, peer: &'static str| {
        let (addr, token) = (c.admin(node), token.clone());
        async move {
            admin_get(addr, &token, "/v1/membership")
                .await
                .expect("membership")["peers"][peer]["incarnation"]
                .clone()
        }
    };
    let p0_seen = incarnation("router", "p0").await;
    let prompt = long_prompt(5100);
    let want = generate_reference(&prompt, 8).await;
    let body = json!({"prompt": prompt, "max_tokens": 8, "ignore_eos": true, "temperature": 0});
    assert_eq!(complete(http, body).await.as_deref(), Ok(want.as_str()));

    let _d1 = Running::node(&c.config, "d1").await;
    router_ready(http, 3).await;
    let status = d0.terminate().await;
    assert!(status.success(), "d0 exited with {status}");
    router_ready(http, 2).await; // p0 and d1
    let completed_on_d1 = || {
        metric(
            c.admin("d1"),
            &token,
            "duet_transfers_total",
            "outcome=\"completed\"",
        )
    };
    let before = completed_on_d1().await;
    for i in 0..3 {
        let prompt = long_prompt(5200 + i);
        let want = generate_reference(&prompt, 8).await;
        let body = json!({"prompt": prompt, "max_tokens": 8, "ignore_eos": true, "temperature": 0});
        assert_eq!(complete(http, body).await.as_deref(), Ok(want.as_str()));
    }
    assert_eq!(
        completed_on_d1().await - before,
        3.0,
        "every request after d0 left was served on d1"
    );
    for node in ["router", "p0", "d1"] {
        let restarts = metric(c.admin(node), &token, "duet_actor_restarts_total", "").await;
        assert_eq!(restarts, 0.0, "{node} restarted an actor");
    }
    assert_eq!(
        incarnation("router", "p0").await,
        p0_seen,
        "p0 was not restarted"
    );
    assert_quiet(&c, &["p0", "d1"]).await;
}

/// Issue 8, test 4 (and 3): 32 streaming clients leave at staggered moments, so they leave
/// while waiting for pages, during prefill, during the transfer and during decode. Then three
/// probes succeed and every queue, gauge and pool on both sides is back to idle.
#[tokio::test(flavor = "multi_thread")]
async fn a_storm_of_32_cancellations_leaves_nothing_behind() {
    let _serial = SERIAL.lock().await;
    let (c, _up, http, history) = pair_cluster("", &[]).await;
    let token = c.token();
    let mut curls = Vec::new();
    for i in 0..32 {
        let body = json!({"prompt": long_prompt(i), "max_tokens": 64, "ignore_eos": true,
                          "stream": true});
        curls.push(curl_stream(http, &body, std::process::Stdio::null()));
    }
    poll("prefill under way", Duration::from_secs(60), || async {
        (metric(c.admin("p0"), &token, "duet_prefill_chunks_total", "").await >= 1.0).then_some(())
    })
    .await;
    for mut curl in curls {
        tokio::time::sleep(Duration::from_millis(120)).await;
        curl.kill().await.expect("kill curl");
    }
    let aborted = metric(
        c.admin("d0"),
        &token,
        "duet_transfers_total",
        "outcome=\"aborted\"",
    )
    .await;
    for i in 0..3 {
        let probe = json!({"prompt": format!("Probe {i}: name a colour."), "max_tokens": 4});
        let answer = complete(http, probe).await;
        assert!(answer.is_ok(), "probe {i}: {answer:?}");
    }
    assert_quiet(&c, &["p0", "d0"]).await;
    let report = check_history(&history).await;
    eprintln!("{aborted} transfers aborted on decode; history: {report}");
}

/// Issue 8, test 9: a prefill node stopped (SIGSTOP) past its heartbeat deadline: the request
/// it held fails fast with a phase-named error; after SIGCONT it rejoins, serves again, and
/// the pages its stalled write could have touched come back only after it answered.
#[tokio::test(flavor = "multi_thread")]
async fn a_stopped_prefill_node_fails_its_rooms_fast_and_rejoins() {
    let _serial = SERIAL.lock().await;
    let http = free_ports(1)[0];
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        // A retry the router sent while p0 was stopped reaches p0's bootstrap queue after
        // SIGCONT, with its cancel and decode's failure lost to the links that were down: it
        // waits there for pages until the bootstrap deadline, which must come before the
        // quiet check gives up (30 s).
        &format!(
            "{}\n[membership]\nheartbeat_interval_ms = 100\nfailure_threshold = 10\n",
            serving(http, "bootstrap_timeout_secs = 10\n")
        ),
    );
    c.credentials(&c.config).await;
    let _router = Running::node(&c.config, "router").await;
    let _d0 = Running::node(&c.config, "d0").await;
    let p0 = Running::node(&c.config, "p0").await;
    router_ready(http, 2).await;
    let token = c.token();
    // With a 1 s heartbeat deadline, membership may flap while the links come up: wait until
    // the pair serves.
    let warm = json!({"prompt": long_prompt(6), "max_tokens": 1, "duet_pair": "p0,d0"});
    poll("p0,d0 serving", Duration::from_secs(60), || async {
        complete(http, warm.clone()).await.ok()
    })
    .await;
    let body = json!({"prompt": long_prompt(7).repeat(4), "max_tokens": 4, "duet_pair": "p0,d0"});
    let request = tokio::spawn(complete(http, body));
    poll("p0 prefilling", Duration::from_secs(60), || async {
        (metric(c.admin("p0"), &token, "duet_sequences_running", "").await >= 1.0).then_some(())
    })
    .await;
    let pid = nix::unistd::Pid::from_raw(p0.pid());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
    let stopped = std::time::Instant::now();
    let answer = request.await.expect("request");
    let took = stopped.elapsed();
    let error = answer.expect_err("the request held by a stopped node cannot succeed");
    assert!(error.contains("p0"), "{error}");
    // The heartbeat deadline is 1 s; the error must come well before any request timeout.
    assert!(took < Duration::from_secs(10), "the error took {took:?}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).expect("SIGCONT");
    router_ready(http, 2).await;
    let again = json!({"prompt": long_prompt(8), "max_tokens": 4, "duet_pair": "p0,d0"});
    let answer = poll("p0 serving again", Duration::from_secs(60), || async {
        complete(http, again.clone()).await.ok()
    })
    .await;
    assert!(!answer.is_empty());
    assert_quiet(&c, &["p0", "d0"]).await;
    eprintln!("the stopped node's request failed after {took:?}: {error}");
    drop(p0);
}

/// Issue 8, test 7: every run of pages fails with probability 5 % during a load run. Nothing
/// crashes; every request either completes (its failed attempts retried) or fails with a
/// phase-named error; no page leaks on either side.
#[tokio::test(flavor = "multi_thread")]
async fn transfers_failing_at_random_are_retried_or_failed_cleanly() {
    let _serial = SERIAL.lock().await;
    let (c, _up, http, history) =
        pair_cluster("", &[("DUET_FAULT_TRANSFER_FAIL_RATE", "0.05")]).await;
    let token = c.token();
    let mut clients = Vec::new();
    for client in 0..4 {
        clients.push(tokio::spawn(async move {
            let mut results = Vec::new();
            for i in 0..6 {
                let body = json!({"prompt": long_prompt(client * 100 + i), "max_tokens": 4,
                                  "temperature": 0});
                results.push(complete(http, body).await);
            }
            results
        }));
    }
    let mut results = Vec::new();
    for c in clients {
        results.extend(c.await.expect("client"));
    }
    for r in &results {
        if let Err(e) = r {
            assert!(
                e.contains("HTTP 503") && e.contains("transfer"),
                "not a clean failure: {e}"
            );
        }
    }
    let failed_runs = metric(
        c.admin("d0"),
        &token,
        "duet_transfers_total",
        "outcome=\"failed\"",
    )
    .await
        + metric(
            c.admin("d0"),
            &token,
            "duet_transfers_total",
            "outcome=\"aborted\"",
        )
        .await;
    assert!(
        failed_runs >= 1.0,
        "no transfer failed: the fault was not injected"
    );
    let ok = results.iter().filter(|r| r.is_ok()).count();
    assert_quiet(&c, &["p0", "d0"]).await;
    let report = check_history(&history).await;
    // The cluster still serves.
    router_ready(http, 2).await;
    eprintln!(
        "{ok} of {} requests completed; {failed_runs} transfers failed and were drained; \
         history: {report}",
        results.len()
    );
}

/// The decode worker holding a request in flight (it counts transfers as waiting).
async fn decode_holding(c: &ClusterDir, token: &str) -> Option<&'static str> {
    for d in ["d0", "d1"] {
        let held = metric(c.admin(d), token, "duet_sequences_waiting", "").await
            + metric(c.admin(d), token, "duet_sequences_running", "").await;
        if held >= 1.0 {
            return Some(d);
        }
    }
    None
}

/// Issue 8, test 2: kill decode during the KV transfer; kill decode after the transfer but
/// before its first decode step (the transfer is held complete and unpublished by a test
/// hook); kill prefill mid-prefill; kill prefill mid-transfer; kill prefill's KV sender actor
/// mid-transfer. Each request completes, through
/// another attempt, with the text `duet generate` gives; then both sides are idle.
#[tokio::test(flavor = "multi_thread")]
async fn killing_either_side_in_each_phase_loses_no_request() {
    let _serial = SERIAL.lock().await;
    let http = free_ports(1)[0];
    let c = ClusterDir::new(
        &[
            ("router", "router"),
            ("p0", "prefill"),
            ("d0", "decode"),
            ("d1", "decode"),
        ],
        &serving(http, ""),
    );
    let history = history_dir(&c);
    let _up = Running::start_env(
        &["up", "--config", path_str(&c.config)],
        "ready",
        &[
            ("DUET_FAULT_HOLD_DONE_MS", "3000"),
            ("DUET_HISTORY_DIR", &history),
        ],
    )
    .await;
    router_ready(http, 3).await;
    let token = c.token();
    let scenarios = [
        "decode during the transfer",
        "decode after the transfer, before its first step",
        "prefill mid-prefill",
        "prefill mid-transfer",
        "the KV sender mid-transfer",
    ];
    for (i, scenario) in scenarios.into_iter().enumerate() {
        let prompt = long_prompt(9000 + i);
        let want = generate_reference(&prompt, 16).await;
        let sent = |what: &'static str| metric(c.admin("p0"), &token, what, "");
        let bytes_before = sent("duet_kv_bytes_sent_total").await;
        let done_before = metric(
            c.admin("p0"),
            &token,
            "duet_transfers_total",
            "outcome=\"completed\"",
        )
        .await;
        let body = json!({"prompt": prompt, "max_tokens": 16, "ignore_eos": true,
                          "temperature": 0});
        let request = tokio::spawn(complete(http, body));
        let target = poll(scenario, Duration::from_secs(60), || async {
            let bytes = sent("duet_kv_bytes_sent_total").await;
            let done = metric(
                c.admin("p0"),
                &token,
                "duet_transfers_total",
                "outcome=\"completed\"",
            )
            .await;
            let prefilling =
                metric(c.admin("p0"), &token, "duet_sequences_running", "").await >= 1.0;
            let (streaming, complete) = (bytes > bytes_before, done > done_before);
            match i {
                0 if streaming && !complete => decode_holding(&c, &token)
                    .await
                    .map(|d| format!("{d}/decode/worker")),
                1 if complete => decode_holding(&c, &token)
                    .await
                    .map(|d| format!("{d}/decode/worker")),
                // The first look at a prompt being computed (pages may already stream).
                2 if prefilling && !complete => Some("p0/prefill/worker".to_string()),
                3 if streaming && !complete => Some("p0/prefill/worker".to_string()),
                4 if streaming && !complete => Some("p0/prefill/sender".to_string()),
                _ => None,
            }
        })
        .await;
        let out = duet(&["kill", "--config", path_str(&c.config), &target]).await;
        assert!(out.status.success(), "{}", out.stderr);
        let answer = request.await.expect("request");
        assert_eq!(answer.as_deref(), Ok(want.as_str()), "kill {scenario}");
        eprintln!("kill {scenario} ({target}): completed, equal to duet generate");
    }
    let moved = metric(c.admin("router"), &token, "duet_router_retries_total", "").await
        + metric(
            c.admin("router"),
            &token,
            "duet_router_migrations_total",
            "outcome=\"started\"",
        )
        .await;
    assert!(moved >= 5.0, "every killed attempt was retried: {moved}");
    assert_quiet(&c, &["p0", "d0", "d1"]).await;
    let report = check_history(&history).await;
    eprintln!("history: {report}");
}

/// Issue 8, item 3 for decode's KV receiver (TCP transfers): killing `d0/decode/receiver`
/// mid-transfer shuts its connections, its successor joins their threads, listens on a new
/// address and hands the worker the new endpoint; the transfer it carried fails (its pages
/// free at once: nothing that could write them is left) and is retried. Later requests reach
/// the new receiver (without the hand-off every later TCP transfer would fail). The history
/// records the receiver's stop and holds.
#[tokio::test(flavor = "multi_thread")]
async fn killing_the_kv_receiver_mid_transfer_retries_its_room_and_serves_on() {
    let _serial = SERIAL.lock().await;
    let (c, _up, http, history) = pair_cluster("kv_transport = \"tcp\"\n", &[]).await;
    let token = c.token();
    let prompt = long_prompt(4242);
    let want = generate_reference(&prompt, 16).await;
    let received = || metric(c.admin("d0"), &token, "duet_kv_bytes_received_total", "");
    let completed = || {
        metric(
            c.admin("d0"),
            &token,
            "duet_transfers_total",
            "outcome=\"completed\"",
        )
    };
    let (bytes_before, done_before) = (received().await, completed().await);
    let body = json!({"prompt": prompt, "max_tokens": 16, "ignore_eos": true, "temperature": 0});
    let request = tokio::spawn(complete(http, body.clone()));
    poll(
        "a TCP transfer in flight",
        Duration::from_secs(60),
        || async {
            (received().await > bytes_before && completed().await == done_before).then_some(())
        },
    )
    .await;
    let out = duet(&[
        "kill",
        "--config",
        path_str(&c.config),
        "d0/decode/receiver",
    ])
    .await;
    assert!(out.status.success(), "{}", out.stderr);
    let answer = request.await.expect("request");
    assert_eq!(
        answer.as_deref(),
        Ok(want.as_str()),
        "the killed room's request"
    );
    let restarts = metric(
        c.admin("d0"),
        &token,
        "duet_actor_restarts_total",
        "kind=\"kv_receiver\"",
    )
    .await;
    assert_eq!(restarts, 1.0, "the receiver was restarted once");
    let retried = metric(c.admin("router"), &token, "duet_router_retries_total", "").await;
    assert!(retried >= 1.0, "the carried room was retried: {retried}");
    // Served on through the new receiver, by TCP.
    let after = received().await;
    for i in 0..2 {
        let prompt = long_prompt(4300 + i);
        let want = generate_reference(&prompt, 8).await;
        let body = json!({"prompt": prompt, "max_tokens": 8, "ignore_eos": true, "temperature": 0});
        assert_eq!(complete(http, body).await.as_deref(), Ok(want.as_str()));
    }
    assert!(received().await > after, "later transfers came by TCP");
    let retried_after = metric(c.admin("router"), &token, "duet_router_retries_total", "").await;
    assert_eq!(retried_after, retried, "later requests needed no retry");
    assert_quiet(&c, &["p0", "d0"]).await;
    let report = check_history(&history).await;
    assert_eq!(report["receiver_stops"], 1, "{report}");
    eprintln!("receiver killed mid-transfer: retried {retried}; history: {report}");
}

/// The pool files of this decode process under `/dev/shm`.
fn pool_files(pid: i32) -> Vec<PathBuf> {
    let infix = format!("-d0-{pid}-");
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("duet-") && n.contains(&infix))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A decode process killed with SIGKILL cannot unlink its shared-memory pool and claim table;
/// the next decode process of that node removes them when it starts.
#[tokio::test(flavor = "multi_thread")]
async fn a_sigkilled_decode_pool_file_is_removed_by_its_successor() {
    let _serial = SERIAL.lock().await;
    let http = free_ports(1)[0];
    let c = ClusterDir::new(
        &[("router", "router"), ("d0", "decode")],
        &serving(http, ""),
    );
    c.credentials(&c.config).await;
    let d0 = Running::node(&c.config, "d0").await;
    let pid = d0.pid();
    let files = pool_files(pid);
    assert_eq!(
        files.len(),
        2,
        "d0's pool file and its claim table: {files:?}"
    );
    d0.kill_hard().await;
    assert!(
        files.iter().all(|f| f.exists()),
        "SIGKILL left the files behind"
    );
    let d0 = Running::node(&c.config, "d0").await;
    for f in &files {
        assert!(!f.exists(), "the successor removed {}", f.display());
    }
    assert_eq!(pool_files(d0.pid()).len(), 2);
}

/// Issue 8, test 6 (first half): control messages between prefill and decode duplicated and
/// delayed (so reordered) by a test hook in the link layer. Every request still completes
/// with `duet generate`'s text, the duplicates and late ones are ignored and counted, nothing
/// leaks, and the history holds.
#[tokio::test(flavor = "multi_thread")]
async fn duplicated_and_delayed_control_messages_change_nothing() {
    let _serial = SERIAL.lock().await;
    let (c, _up, http, history) = pair_cluster(
        "",
        &[(
            "DUET_FAULT_LINK",
            "dup=0.5,delay=0.2,delay_ms=150,kinds=decode.;bootstrap.",
        )],
    )
    .await;
    let token = c.token();
    // Distinct prompts: a repeated one would be served from decode's prefix cache, with no
    // transfer to disturb.
    let prompts: Vec<String> = (0..6).map(|i| long_prompt(500 + i)).collect();
    let mut want = Vec::new();
    for p in &prompts {
        want.push(generate_reference(p, 8).await);
    }
    let mut clients = Vec::new();
    for client in 0..3 {
        let (prompts, want) = (prompts.clone(), want.clone());
        clients.push(tokio::spawn(async move {
            for i in 0..2 {
                let k = client * 2 + i;
                let body = json!({"prompt": prompts[k], "max_tokens": 8, "ignore_eos": true,
                                  "temperature": 0});
                let got = complete(http, body).await;
                assert_eq!(got.as_deref(), Ok(want[k].as_str()), "client {client} #{i}");
            }
        }));
    }
    for c in clients {
        c.await.expect("client");
    }
    let stale = metric(c.admin("d0"), &token, "duet_stale_messages_total", "").await
        + metric(c.admin("p0"), &token, "duet_stale_messages_total", "").await;
    assert!(stale >= 1.0, "no duplicate was seen: the hook did nothing");
    assert_quiet(&c, &["p0", "d0"]).await;
    let report = check_history(&history).await;
    eprintln!("{stale} stale messages ignored; history: {report}");
}

/// Issue 8, test 6 (second half): the transfer path stalls for longer than decode's waiting
/// deadline. The attempt fails with an error naming the phase and the deadline, the router
/// retries it, the answer is right, and the stalled writes land before decode lets the pages
/// go (decode waits for prefill's drain).
#[tokio::test(flavor = "multi_thread")]
async fn a_transfer_path_stalled_past_the_waiting_deadline_is_retried_safely() {
    let _serial = SERIAL.lock().await;
    // The deadline counts from the last progress, and prefill's engine stepping on the prompt
    // is progress: the stall must outlast the prompt's compute (up to ~5 s in a debug build on
    // a slow core; it was 8 s, which a 4.4 s prefill outlasted) plus the deadline.
    let (c, _up, http, history) = pair_cluster(
        "transfer_timeout_secs = 5\n",
        &[("DUET_FAULT_STALL_TRANSFER_MS", "16000")],
    )
    .await;
    let token = c.token();
    let prompt = long_prompt(77);
    let want = generate_reference(&prompt, 8).await;
    let body = json!({"prompt": prompt, "max_tokens": 8, "ignore_eos": true, "temperature": 0});
    let got = complete(http, body).await;
    assert_eq!(got.as_deref(), Ok(want.as_str()));
    let timeouts = metric(
        c.admin("d0"),
        &token,
        "duet_transfer_aborts_total",
        "reason=\"timeout\"",
    )
    .await;
    assert_eq!(timeouts, 1.0, "the first attempt hit the waiting deadline");
    let retried = metric(c.admin("router"), &token, "duet_router_retries_total", "").await;
    assert_eq!(retried, 1.0);
    assert_quiet(&c, &["p0", "d0"]).await;
    let report = check_history(&history).await;
    eprintln!("history: {report}");
}
