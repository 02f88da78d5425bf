//! Two real nodes in this process, linked over loopback QUIC.

#![allow(dead_code)] // each test binary uses part of it

use std::sync::Arc;
use std::time::{Duration, Instant};

use duet_runtime::config::ClusterConfig;
use duet_runtime::credentials::Credentials;
use duet_runtime::node::Node;

pub struct Pair {
    pub _dir: tempfile::TempDir,
    pub config: Arc<ClusterConfig>,
    pub a: Node,
    pub b: Node,
}

/// Nodes `a` and `b` (plus `extra` TOML), started, with a's link to b up.
pub async fn pair_with(extra: &str) -> Pair {
    let dir = tempfile::tempdir().expect("tempdir");
    let ports = duet_runtime::testing::free_loopback_ports(2);
    let (pa, pb) = (ports[0], ports[1]);
    let text = format!(
        "{extra}\n[[node]]\nname = \"a\"\nrole = \"prefill\"\naddress = \"127.0.0.1:{}\"\n\
         [[node]]\nname = \"b\"\nrole = \"decode\"\naddress = \"127.0.0.1:{}\"\n",
        pa, pb
    );
    let path = dir.path().join("cluster.toml");
    std::fs::write(&path, text).expect("write");
    let config = Arc::new(ClusterConfig::load(&path).expect("config"));
    Credentials::generate(&config.credentials).expect("credentials");
    let a = Node::start(config.clone(), "a").await.expect("start a");
    let b = Node::start(config.clone(), "b").await.expect("start b");
    let link = a.context().links.get("b").expect("handle").clone();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !link.is_connected() {
        assert!(Instant::now() < deadline, "a never connected to b");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Pair {
        _dir: dir,
        config,
        a,
        b,
    }
}

pub async fn pair() -> Pair {
    pair_with("").await
}
