//! A prefill writer paused past every deadline never lands KV in pages decode has reused
//! (issue 14, item 1; DESIGN rule 2: time is never proof).
//!
//! Each scenario runs a router, p0 and d0 as separate real processes with a small drain
//! backstop (3 s), sends a long prompt, and stops p0 while it writes that prompt's KV: with
//! SIGSTOP between two runs of pages, with SIGSTOP in the middle of a copy (a test hook holds
//! the writer halfway through its first copy), or with the transfer path stalled past decode's
//! deadline and the backstop. While p0 is stopped, membership marks it down, decode aborts the
//! transfer, and six short requests decode on d0 in pages the long prompt's attempt could
//! have touched. Then p0 resumes. Every answer must equal `duet generate`'s, the pools must be
//! whole, and the independent history checker must find nothing written after its release.

mod common;

use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::json;

/// One cluster at a time: three clusters on two cores turn timing into noise.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How p0 is stopped while it writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pause {
    /// SIGSTOP after a few chunks: most likely between two runs of pages (no claim held).
    Sigstop,
    /// SIGSTOP while the writer is halfway through a copy (held there by a test hook).
    SigstopMidCopy,
    /// No signal: the transfer path stalls longer than decode's deadline and the backstop.
    StallHook,
}

const BACKSTOP_SECS: u64 = 3;

/// About 630 tokens: 40 of d0's 64 pages.
fn long_prompt() -> String {
    "The history of the city of Paris is filled with kings, revolutions, writers and \
     engineers who rebuilt its streets, bridges and sewers over many centuries. "
        .repeat(18)
}

fn short_prompt(i: usize) -> String {
    format!("Story {i}: a lighthouse keeper finds a message in a bottle and")
}

async fn paused_writer(kv_transport: &str, pause: Pause) {
    let _serial = SERIAL.lock().await;
    let http = free_ports(1)[0];
    let timeout = if pause == Pause::StallHook { 5 } else { 30 };
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        &format!(
            "[serving]\nmodel = \"{}\"\nhttp = \"127.0.0.1:{http}\"\nkv_pages = 64\n\
             max_batch_tokens = 32\ndisagg_threshold = 16\nkv_transport = \"{kv_transport}\"\n\
             transfer_timeout_secs = {timeout}\ndrain_fence_secs = 1\n\
             drain_backstop_secs = {BACKSTOP_SECS}\n",
            real_model().display()
        ),
    );
    c.credentials(&c.config).await;
    let token = c.token();
    let history = history_dir(&c);
    // What the engine alone answers (greedy), before any cluster runs.
    let long = long_prompt();
    let long_want = generate_reference(&long, 8).await;
    let mut short_want = Vec::new();
    for i in 0..6 {
        short_want.push(generate_reference(&short_prompt(i), 120).await);
    }

    let config = path_str(&c.config);
    let node = |name: &'static str, env: Vec<(&'static str, String)>| {
        let history = history.clone();
        async move {
            let mut env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
            env.push(("DUET_HISTORY_DIR", &history));
            Running::start_env(
                &["node", "--config", config, "--name", name],
                duet_runtime::node::READY_MARKER,
                &env,
            )
            .await
        }
    };
    let hook = match pause {
        Pause::Sigstop => vec![],
        Pause::SigstopMidCopy => vec![("DUET_FAULT_STALL_MID_WRITE_MS", "8000".to_string())],
        // Past the deadline, which counts from prefill's last step on the prompt (its ~470
        // tokens take up to ~8 s in a debug build on a slow core; 12 s was outlasted there).
        Pause::StallHook => vec![("DUET_FAULT_STALL_TRANSFER_MS", "20000".to_string())],
    };
    let _router = node("router", vec![]).await;
    let _d0 = node("d0", vec![]).await;
    let p0 = node("p0", hook).await;
    router_ready(http, 2).await;

    let body = json!({"prompt": long, "max_tokens": 8, "ignore_eos": true, "temperature": 0});
    let long_request = tokio::spawn(complete(http, body));
    poll(
        "p0 prefilling the long prompt",
        Duration::from_secs(60),
        || async {
            (metric(c.admin("p0"), &token, "duet_prefill_chunks_total", "").await >= 2.0)
                .then_some(())
        },
    )
    .await;
    let p0_pid = Pid::from_raw(p0.pid());
    if pause != Pause::StallHook {
        kill(p0_pid, Signal::SIGSTOP).expect("SIGSTOP p0");
    }
    let paused = Instant::now();
    poll(
        "d0 aborting the transfer",
        Duration::from_secs(30),
        || async {
            (metric(c.admin("d0"), &token, "duet_transfer_aborts_total", "").await >= 1.0)
                .then_some(())
        },
    )
    .await;
    let quarantined = || metric(c.admin("d0"), &token, "duet_kv_pages_quarantined", "");
    if pause == Pause::SigstopMidCopy && kv_transport == "shm" {
        // The writer holds its claim: no proof, so the pages stay quarantined, past the
        // backstop too (an alert, never a release).
        poll("the quarantine alert", Duration::from_secs(30), || async {
            (metric(c.admin("d0"), &token, "duet_kv_quarantine_stalls_total", "").await >= 1.0)
                .then_some(())
        })
        .await;
        assert!(paused.elapsed() >= Duration::from_secs(BACKSTOP_SECS));
        let held = quarantined().await;
        assert!(
            held > 0.0,
            "pages released while their writer held its claim"
        );
        eprintln!("{held} pages quarantined past the backstop while p0 is stopped mid-copy");
    } else {
        // Decode's revoke is proven at once (no claim held; over TCP, decode's receiver cuts
        // a frame stalled mid-read): the pages come back while p0 is still stopped. (A
        // SIGSTOP that happens to land mid-copy keeps them quarantined instead: also right.)
        let stalls = || metric(c.admin("d0"), &token, "duet_kv_quarantine_stalls_total", "");
        poll(
            "the aborted pages back",
            Duration::from_secs(30),
            || async {
                let by_chance = pause == Pause::Sigstop && kv_transport == "shm";
                (quarantined().await == 0.0 || (by_chance && stalls().await >= 1.0)).then_some(())
            },
        )
        .await;
        // Wait past the backstop anyway, as the reproduction does.
        let past = Duration::from_secs(BACKSTOP_SECS + 1);
        if let Some(rest) = past.checked_sub(paused.elapsed()) {
            tokio::time::sleep(rest).await;
        }
    }

    // Six requests decode on d0 (p0 is down or stalled) in pages the aborted attempt held.
    let mut shorts = Vec::new();
    for i in 0..6 {
        let body = json!({"prompt": short_prompt(i), "max_tokens": 120, "ignore_eos": true,
                          "temperature": 0});
        shorts.push(tokio::spawn(complete(http, body)));
    }
    poll(
        "the short requests decoding",
        Duration::from_secs(60),
        || async {
            (metric(c.admin("d0"), &token, "duet_sequences_running", "").await >= 1.0).then_some(())
        },
    )
    .await;
    if pause != Pause::StallHook {
        kill(p0_pid, Signal::SIGCONT).expect("SIGCONT p0");
    }
    for (i, (request, want)) in shorts.into_iter().zip(&short_want).enumerate() {
        let got = request.await.expect("request");
        assert_eq!(got.as_deref(), Ok(want.as_str()), "short request {i}");
    }
    let got = long_request.await.expect("long request");
    assert_eq!(got.as_deref(), Ok(long_want.as_str()), "the long request");
    if pause == Pause::StallHook && kv_transport == "shm" {
        // The stalled writer woke after decode had revoked the grant: refused, not landed.
        poll(
            "the stale write refused",
            Duration::from_secs(30),
            || async {
                (metric(c.admin("p0"), &token, "duet_kv_writes_refused_total", "").await >= 1.0)
                    .then_some(())
            },
        )
        .await;
    }
    let refused = metric(c.admin("p0"), &token, "duet_kv_writes_refused_total", "").await;
    assert_quiet(&c, &["p0", "d0"]).await;
    let report = check_history(&history).await;
    eprintln!("{kv_transport} {pause:?}: {refused} stale writes refused; history: {report}");
}

#[tokio::test(flavor = "multi_thread")]
async fn shm_a_writer_stopped_between_runs_never_lands_in_reused_pages() {
    paused_writer("shm", Pause::Sigstop).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn shm_a_writer_stopped_mid_copy_keeps_its_pages_quarantined_until_it_ends() {
    paused_writer("shm", Pause::SigstopMidCopy).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn shm_a_transfer_stalled_past_the_backstop_is_refused_when_it_wakes() {
    paused_writer("shm", Pause::StallHook).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn tcp_a_writer_stopped_between_runs_never_lands_in_reused_pages() {
    paused_writer("tcp", Pause::Sigstop).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn tcp_a_writer_stopped_mid_frame_never_lands_in_reused_pages() {
    paused_writer("tcp", Pause::SigstopMidCopy).await;
}
