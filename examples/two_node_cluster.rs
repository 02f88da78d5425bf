//! A two-node cluster started from code: a router and a decode worker serving the tiny model,
//! in this process, from a cluster file written into a temporary folder. Prints each node's
//! supervision tree (what `duet tree` shows), sends one completion and prints it.
//!
//! ```sh
//! cargo run --example two_node_cluster
//! ```

mod common;

use std::time::Duration;

use duet_runtime::admin::client::{self, Method};
use duet_runtime::tree::ActorInfo;

fn print_tree(a: &ActorInfo, depth: usize) {
    println!(
        "{}{} ({}) {}{}",
        "  ".repeat(depth),
        a.name,
        a.kind,
        a.status,
        if a.restarts > 0 {
            format!(", {} restarts", a.restarts)
        } else {
            String::new()
        }
    );
    for c in &a.children {
        print_tree(c, depth + 1);
    }
}

#[tokio::main]
async fn main() {
    duet_runtime::telemetry::init_logs("warn");
    let cluster = common::Cluster::start(&[("router", "router"), ("d0", "decode")], "", 1).await;
    for node in ["router", "d0"] {
        let tree = client::call(
            cluster.admin(node),
            &cluster.token,
            Method::GET,
            "/v1/tree",
            None,
            Duration::from_secs(5),
        )
        .await
        .expect("the admin API answers");
        let root: ActorInfo =
            serde_json::from_value(tree["root"].clone()).expect("a supervision tree");
        println!("\n{node}'s supervision tree:");
        print_tree(&root, 1);
    }
    let mut text = String::new();
    let body = serde_json::json!({
        "model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0, "stream": true,
    });
    common::stream(cluster.http, "/v1/completions", &body, |event| {
        text.push_str(event["choices"][0]["text"].as_str().unwrap_or_default());
    })
    .expect("a completion");
    println!("\ncompletion of \"Hello\" (random tiny weights, so the text is noise): {text:?}");
    assert!(!text.is_empty(), "the cluster answered nothing");
    // Leaving main ends the nodes with the process (`duet up` would drain them on Ctrl-C).
}
