//! The KV transfer micro-benchmark: throughput per backend beside memcpy and a raw TCP stream,
//! measured in one run (`cargo bench -p duet-transport --bench transfer`, or
//! `duet bench --experiment transfer`).
//!
//! The payload is 256 pages of SmolLM2-135M's f16 layout (368,640 bytes each: 30 layers, K and
//! V, 3 KV heads of 64, 16 tokens), written as runs of 8 consecutive pages, pool to pool
//! through each backend's `KvTransport` (a fence ends each round). It panics if a backend
//! fails or lands wrong bytes: a benchmark that measured a broken copy would report nonsense.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Instant;

use duet_gpu::{KvDtype, KvLayout, KvPool};
use serde::Serialize;

use crate::shm::ShmRegion;
use crate::{
    Backend, ClaimTable, Endpoint, Grants, KvTransport, LocalRegistration, TcpReceiver, WriteGrant,
    coalesce, connect, unwatched,
};

const PAGE: usize = 30 * 2 * 16 * 3 * 64 * 2;
const PAGES: usize = 256;
const RUN: usize = 8;
/// Rounds per path (best of them counts); the raw stream and the tcp backend alternate.
const ROUNDS: usize = 15;

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// GB/s of each path, measured in the same run.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct TransferReport {
    /// Bytes moved per round.
    pub bytes: usize,
    /// memcpy, run by run (best before and after the backends).
    pub memcpy_gbps: f64,
    /// The local backend.
    pub local_gbps: f64,
    /// The shm backend.
    pub shm_gbps: f64,
    /// One raw loopback TCP stream.
    pub raw_tcp_gbps: f64,
    /// The tcp backend.
    pub tcp_gbps: f64,
    /// The tcp backend's speed against the raw stream's in each pair of adjacent rounds
    /// (raw, backend, raw, backend...): the least, the median and the greatest. A noisy
    /// neighbour moves both of a pair, so the pairs show the backend's own cost where
    /// best-of figures taken at different moments would not.
    pub tcp_pair_ratio: (f64, f64, f64),
}

impl std::fmt::Display for TransferReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "KV transfer, {PAGES} pages of {PAGE} bytes ({:.0} MB) in runs of {RUN} pages, best of {ROUNDS}:",
            self.bytes as f64 / 1e6
        )?;
        writeln!(f, "  memcpy                {:>6.2} GB/s", self.memcpy_gbps)?;
        writeln!(
            f,
            "  local backend         {:>6.2} GB/s   {:.2}x memcpy",
            self.local_gbps,
            self.local_gbps / self.memcpy_gbps
        )?;
        writeln!(
            f,
            "  shm backend           {:>6.2} GB/s   {:.2}x memcpy (target >= 0.8)",
            self.shm_gbps,
            self.shm_gbps / self.memcpy_gbps
        )?;
        writeln!(f, "  raw TCP stream        {:>6.2} GB/s", self.raw_tcp_gbps)?;
        write!(
            f,
            "  tcp backend           {:>6.2} GB/s   {:.2}x raw TCP (target >= 0.9); {ROUNDS} interleaved pairs: median {:.2}x, {:.2}-{:.2}x",
            self.tcp_gbps,
            self.tcp_gbps / self.raw_tcp_gbps,
            self.tcp_pair_ratio.1,
            self.tcp_pair_ratio.0,
            self.tcp_pair_ratio.2
        )
    }
}

/// Runs the benchmark (about a second of copies; it needs /dev/shm and loopback TCP).
pub fn measure() -> TransferReport {
    let total = PAGE * PAGES;
    let src: Vec<u8> = (0..total).map(|i| (i * 31 % 251) as u8).collect();

    // memcpy, run by run (measured again at the end; the best of both counts, so a noisy
    // neighbour early in the run does not flatter the backends).
    let mut copy_dst = vec![0u8; total];
    let mut memcpy_round = || {
        let mut best = f64::MAX;
        for _ in 0..ROUNDS {
            let t = Instant::now();
            for run in src.chunks(PAGE * RUN).zip(copy_dst.chunks_mut(PAGE * RUN)) {
                run.1.copy_from_slice(run.0);
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        gbps(total, best)
    };
    let memcpy_first = memcpy_round();

    // Raw TCP: the same bytes through one loopback stream into a buffer, a round at a time,
    // interleaved with the tcp backend's rounds below.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let reader = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let mut buf = vec![0u8; total];
        // Until the sender closes.
        while s.read_exact(&mut buf).is_ok() {
            s.write_all(&[1]).expect("ack");
        }
    });
    let mut raw = TcpStream::connect(addr).expect("connect");
    raw.set_nodelay(true).expect("nodelay");
    let mut raw_round = || {
        let t = Instant::now();
        for run in src.chunks(PAGE * RUN) {
            raw.write_all(run).expect("write");
        }
        let mut ack = [0u8; 1];
        raw.read_exact(&mut ack).expect("ack");
        t.elapsed().as_secs_f64()
    };

    // The backends themselves, through the KvTransport trait: pool to pool, runs of RUN pages.
    let layout = KvLayout {
        n_layers: 30,
        n_kv_heads: 3,
        head_dim: 64,
        page_size: 16,
        dtype: KvDtype::F16,
    };
    assert_eq!(layout.page_bytes(), PAGE);
    let mut source = KvPool::new(layout, PAGES).expect("pool");
    // Every byte written: untouched pages would all map the kernel's zero page and read from
    // cache, flattering the copies.
    for p in 0..PAGES as u32 {
        for layer in 0..layout.n_layers {
            for slot in 0..layout.page_size {
                let x = (p as usize * 31 + layer * 7 + slot) as f32;
                source.write_token(p, layer, slot, &[x; 192], &[-x; 192]);
            }
        }
    }
    let runs = coalesce((0..PAGES as u32).map(|p| (p, (p + 7) % PAGES as u32)));
    let runs: Vec<_> = runs
        .iter()
        .flat_map(|r| {
            (0..r.n).step_by(RUN).map(move |i| crate::PageRun {
                src: r.src + i,
                dst: r.dst + i,
                n: (r.n - i).min(RUN as u32),
            })
        })
        .collect();
    // One grant per round, checked by every backend as in serving (a claim per run for the
    // backends that map the pool, a grant lookup per frame for TCP).
    let claims = format!("bench-claims-{}", std::process::id());
    let grants = Grants::with_claims(ClaimTable::create(&claims, ROUNDS).expect("claims"));
    let all: Vec<u32> = (0..PAGES as u32).collect();
    let round_grants: Vec<WriteGrant> = (1..=ROUNDS as u64)
        .map(|round| grants.grant(round, &layout, &all))
        .collect();
    let round = |t: &mut Box<dyn KvTransport>, grant: WriteGrant| {
        let s = Instant::now();
        t.write(grant, &source.memory(), &layout, &runs, &mut unwatched)
            .expect("write");
        t.fence(grant.attempt).expect("fence");
        s.elapsed().as_secs_f64()
    };
    let measure = |t: &mut Box<dyn KvTransport>| {
        let best = round_grants
            .iter()
            .map(|&g| round(t, g))
            .fold(f64::MAX, f64::min);
        gbps(total, best)
    };
    let check = |dst: &KvPool| {
        for p in [0u32, 100, 255] {
            let to = (p + 7) % PAGES as u32;
            assert_eq!(
                dst.copy_bytes(layout.run_bytes(to, 1)).expect("bytes"),
                source.copy_bytes(layout.run_bytes(p, 1)).expect("bytes")
            );
        }
    };

    let dst = KvPool::new(layout, PAGES).expect("pool");
    let reg = LocalRegistration::new(dst.memory());
    let mut endpoint = Endpoint {
        host: crate::host_id(),
        local: Some(reg.key()),
        shm: None,
        claims: Some(claims.clone()),
        tcp: None,
    };
    let local = measure(&mut connect(&endpoint, Backend::Local).expect("local"));
    check(&dst);

    let name = format!("bench-{}", std::process::id());
    let region = ShmRegion::create(&name, total).expect("shm");
    let dst = KvPool::with_memory(layout, PAGES, Arc::new(region)).expect("pool");
    endpoint.shm = Some(name);
    let shm = measure(&mut connect(&endpoint, Backend::Shm).expect("shm"));
    check(&dst);
    drop(dst);

    let dst = KvPool::new(layout, PAGES).expect("pool");
    let rx = TcpReceiver::start(
        "127.0.0.1:0".parse().expect("addr"),
        dst.memory(),
        grants,
        Arc::new(|_| {}),
    )
    .expect("receiver");
    endpoint.tcp = Some(rx.endpoint());
    let mut tcp = connect(&endpoint, Backend::Tcp).expect("tcp");
    let (mut raw_best, mut tcp_best) = (f64::MAX, f64::MAX);
    let mut pairs = Vec::with_capacity(ROUNDS);
    for &grant in &round_grants {
        let r = raw_round();
        let t = round(&mut tcp, grant);
        (raw_best, tcp_best) = (raw_best.min(r), tcp_best.min(t));
        pairs.push(r / t);
    }
    pairs.sort_by(f64::total_cmp);
    check(&dst);
    drop(raw);
    reader.join().expect("reader");

    let memcpy = memcpy_first.max(memcpy_round());
    assert_eq!(copy_dst, src);
    TransferReport {
        bytes: total,
        memcpy_gbps: memcpy,
        local_gbps: local,
        shm_gbps: shm,
        raw_tcp_gbps: gbps(total, raw_best),
        tcp_gbps: gbps(total, tcp_best),
        tcp_pair_ratio: (pairs[0], pairs[ROUNDS / 2], pairs[ROUNDS - 1]),
    }
}
