//! `duet up` a three-node cluster; `duet tree` shows all of it; unknown paths get suggestions.

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread")]
async fn tree_lists_every_node_and_actor() {
    let c = ClusterDir::new(
        &[("router", "router"), ("p0", "prefill"), ("d0", "decode")],
        "",
    );
    let up = Running::up(&c.config).await;
    assert!(up.first_line.starts_with("ready"), "{}", up.first_line);
    assert!(up.first_line.contains("nodes=3"), "{}", up.first_line);

    let tree = tree_json(&c.config).await;
    let nodes = tree.as_array().expect("a list of nodes");
    let names: Vec<&str> = nodes.iter().filter_map(|n| n["node"].as_str()).collect();
    assert_eq!(names, ["router", "p0", "d0"]);
    for n in nodes {
        assert_eq!(n["status"], "up", "{n}");
        let node = n["node"].as_str().unwrap_or_default();
        let root = &n["root"];
        assert_eq!(root["path"], node);
        for key in ["path", "name", "status", "restarts", "children"] {
            assert!(root.get(key).is_some(), "root of {node} lacks `{key}`");
        }
        let role = n["role"].as_str().unwrap_or_default();
        // Each worker names the device it owns (the default, `cpu`); a router owns none.
        let device = if role == "router" { None } else { Some("cpu") };
        assert_eq!(n["device"].as_str(), device, "{n}");
        let peers: Vec<&str> = names.iter().copied().filter(|p| *p != node).collect();
        let mut expected = vec![
            format!("{node}/listener"),
            format!("{node}/links"),
            format!("{node}/membership"),
            format!("{node}/{role}"),
            format!("{node}/{role}/echo"),
        ];
        expected.extend(peers.iter().map(|p| format!("{node}/links/{p}")));
        for path in expected {
            let actor =
                find(&tree, &path).unwrap_or_else(|| panic!("{path} missing from the tree"));
            assert_eq!(actor["status"], "running", "{path}");
            assert_eq!(actor["restarts"], 0, "{path}");
        }
    }

    let text = duet(&["tree", "--config", path_str(&c.config)]).await;
    assert!(text.status.success());
    assert!(
        text.stdout.contains("p0 (prefill, up, device cpu)"),
        "{}",
        text.stdout
    );
    assert!(
        text.stdout.contains("echo [echo] running   d0/decode/echo"),
        "{}",
        text.stdout
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_paths_list_the_nearest_ones() {
    let c = ClusterDir::new(&[("router", "router"), ("p0", "prefill")], "");
    let _up = Running::up(&c.config).await;

    let out = duet(&["kill", "--config", path_str(&c.config), "p0/prefil/echo"]).await;
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("no actor at `p0/prefil/echo`"),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr.contains("nearest: p0/prefill/echo"),
        "{}",
        out.stderr
    );

    let out = duet(&["stop", "--config", path_str(&c.config), "q0/prefill/echo"]).await;
    assert!(!out.status.success());
    assert!(out.stderr.contains("no node `q0`"), "{}", out.stderr);
    assert!(out.stderr.contains("nearest: p0"), "{}", out.stderr);

    let out = duet(&["kill", "--config", path_str(&c.config), "p0"]).await;
    assert!(!out.status.success());
    assert!(out.stderr.contains("root supervisor"), "{}", out.stderr);
}
