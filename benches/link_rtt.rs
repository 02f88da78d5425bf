//! Link-layer round trip and one-way rate between two nodes, beside raw quinn in the same run.
//!
//! Two nodes run in this process on loopback, each with its own QUIC endpoint, TLS 1.3 with
//! the pinned cluster certificate, and its supervision tree. The link layer's figure is an
//! `echo.ping` request answered by the remote echo actor (envelope encode, stream write,
//! listener decode, dispatch into the actor's mailbox, reply, answer routing). The raw figure
//! is the same size of payload echoed over one quinn bidirectional stream by a bare task,
//! with the same TLS and transport settings. Run: `cargo bench --bench link_rtt`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use duet_runtime::config::ClusterConfig;
use duet_runtime::credentials::{CLUSTER_SERVER_NAME, Credentials};
use duet_runtime::echo;
use duet_runtime::link::{LinkHandle, tls};
use duet_runtime::node::Node;

const WARMUP: usize = 2_000;
const BATCHES: usize = 20;
const BATCH: usize = 1_000;
const ONE_WAY: usize = 100_000;
const PAYLOAD: usize = 32;

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

fn report(name: &str, mut samples: Vec<Duration>) -> f64 {
    samples.sort();
    let p50 = percentile(&samples, 0.50);
    println!(
        "{name:<30} p50 {p50:>7.1} us   p99 {:>7.1} us   ({} round trips)",
        percentile(&samples, 0.99),
        samples.len()
    );
    p50
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(bench());
}

async fn bench() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("cluster.toml");
    let ports = duet_runtime::testing::free_loopback_ports(2);
    let (pa, pb) = (ports[0], ports[1]);
    std::fs::write(
        &path,
        format!(
            "[[node]]\nname = \"a\"\nrole = \"prefill\"\naddress = \"127.0.0.1:{pa}\"\n\
             [[node]]\nname = \"b\"\nrole = \"decode\"\naddress = \"127.0.0.1:{pb}\"\n"
        ),
    )
    .expect("write config");
    let config = Arc::new(ClusterConfig::load(&path).expect("config"));
    Credentials::generate(&config.credentials).expect("credentials");
    let creds = Credentials::load(&config.credentials).expect("credentials");

    let mut raw = RawQuinn::connect(&creds).await;
    let a = Node::start(config.clone(), "a").await.expect("start a");
    let b = Node::start(config, "b").await.expect("start b");
    let link = a.context().links.get("b").expect("link").clone();
    while !link.is_connected() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Alternate batches so both see the same machine (the other core's load drifts).
    let (mut raw_samples, mut link_samples) = (Vec::new(), Vec::new());
    raw.round_trips(WARMUP, &mut Vec::new()).await;
    link_round_trips(&link, WARMUP, &mut Vec::new()).await;
    for _ in 0..BATCHES {
        raw.round_trips(BATCH, &mut raw_samples).await;
        link_round_trips(&link, BATCH, &mut link_samples).await;
    }
    println!("round trip of a {PAYLOAD}-byte request and its answer, interleaved batches:");
    let raw_p50 = report("raw quinn stream", raw_samples);
    let link_p50 = report("link layer (envelope + actor)", link_samples);
    println!(
        "link-layer p50 / raw quinn p50 = {:.2} (target <= 1.5)",
        link_p50 / raw_p50
    );

    println!("one-way messages of {PAYLOAD} bytes ({ONE_WAY}), until the receiver counted all:");
    let raw_rate = raw.one_way().await;
    let link_rate = link_one_way(&link).await;
    println!("raw quinn stream               {raw_rate:>9.0} msg/s");
    println!("link layer (to the actor)      {link_rate:>9.0} msg/s");
    println!("link-layer / raw quinn rate = {:.2}", link_rate / raw_rate);
    a.stop().await;
    b.stop().await;
}

async fn link_round_trips(link: &LinkHandle, n: usize, samples: &mut Vec<Duration>) {
    let body = vec![7u8; PAYLOAD];
    for _ in 0..n {
        let start = Instant::now();
        let answer = link
            .request(
                echo::PING,
                "bench",
                echo::SERVICE,
                body.clone(),
                Duration::from_secs(5),
            )
            .await
            .expect("echo");
        samples.push(start.elapsed());
        assert_eq!(answer.len(), PAYLOAD);
    }
}

async fn link_count(link: &LinkHandle) -> u64 {
    let body = link
        .request(
            echo::COUNT,
            "bench",
            echo::SERVICE,
            Vec::new(),
            Duration::from_secs(60),
        )
        .await
        .expect("count");
    duet_runtime::wire::decode_body(&body).expect("u64")
}

async fn link_one_way(link: &LinkHandle) -> f64 {
    let base = link_count(link).await;
    let body = vec![7u8; PAYLOAD];
    let start = Instant::now();
    for _ in 0..ONE_WAY {
        link.send(echo::NOTE, "bench", echo::SERVICE, body.clone())
            .await
            .expect("note");
    }
    // One ordered stream: the count is answered after every note was delivered.
    let count = link_count(link).await;
    let elapsed = start.elapsed();
    assert_eq!(count - base, ONE_WAY as u64);
    ONE_WAY as f64 / elapsed.as_secs_f64()
}

/// The same exchange over a bare quinn stream: same TLS, same transport settings.
struct RawQuinn {
    conn: quinn::Connection,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
}

impl RawQuinn {
    async fn connect(creds: &Credentials) -> RawQuinn {
        let (server_cfg, client_cfg) =
            tls::endpoint_configs(creds, Duration::from_secs(1), Duration::from_secs(5))
                .expect("tls");
        let server = quinn::Endpoint::server(server_cfg, "127.0.0.1:0".parse().expect("addr"))
            .expect("server");
        let addr = server.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Some(incoming) = server.accept().await {
                tokio::spawn(serve_raw(incoming));
            }
        });
        let mut client =
            quinn::Endpoint::client("127.0.0.1:0".parse().expect("addr")).expect("client");
        client.set_default_client_config(client_cfg);
        let conn = client
            .connect(addr, CLUSTER_SERVER_NAME)
            .expect("connect")
            .await
            .expect("handshake");
        let (send, recv) = conn.open_bi().await.expect("stream");
        RawQuinn { conn, send, recv }
    }

    fn frame(op: u8) -> Vec<u8> {
        let mut frame = (PAYLOAD as u32).to_be_bytes().to_vec();
        frame.extend(std::iter::repeat_n(7u8, PAYLOAD));
        frame[4] = op;
        frame
    }

    async fn round_trips(&mut self, n: usize, samples: &mut Vec<Duration>) {
        let frame = Self::frame(OP_ECHO);
        let mut answer = vec![0u8; 4 + PAYLOAD];
        for _ in 0..n {
            let start = Instant::now();
            self.send.write_all(&frame).await.expect("write");
            self.recv.read_exact(&mut answer).await.expect("read");
            samples.push(start.elapsed());
        }
    }

    async fn one_way(&mut self) -> f64 {
        let note = Self::frame(OP_NOTE);
        let start = Instant::now();
        for _ in 0..ONE_WAY {
            self.send.write_all(&note).await.expect("write");
        }
        self.send
            .write_all(&Self::frame(OP_COUNT))
            .await
            .expect("write");
        let mut count = [0u8; 12];
        self.recv.read_exact(&mut count).await.expect("count");
        let elapsed = start.elapsed();
        self.conn.close(0u32.into(), b"done");
        ONE_WAY as f64 / elapsed.as_secs_f64()
    }
}

const OP_NOTE: u8 = 0;
const OP_ECHO: u8 = 1;
const OP_COUNT: u8 = 2;

async fn serve_raw(incoming: quinn::Incoming) {
    let Ok(conn) = incoming.await else { return };
    let Ok((mut send, mut recv)) = conn.accept_bi().await else {
        return;
    };
    let mut header = [0u8; 4];
    let mut buf = vec![0u8; 1 << 16];
    let mut notes = 0u64;
    while recv.read_exact(&mut header).await.is_ok() {
        let len = u32::from_be_bytes(header) as usize;
        if len == 0 || len > buf.len() || recv.read_exact(&mut buf[..len]).await.is_err() {
            return;
        }
        let reply = match buf[0] {
            OP_ECHO => {
                let mut frame = header.to_vec();
                frame.extend_from_slice(&buf[..len]);
                frame
            }
            OP_COUNT => {
                let mut frame = 8u32.to_be_bytes().to_vec();
                frame.extend_from_slice(&notes.to_be_bytes());
                frame
            }
            _ => {
                notes += 1;
                continue;
            }
        };
        if send.write_all(&reply).await.is_err() {
            return;
        }
    }
}
