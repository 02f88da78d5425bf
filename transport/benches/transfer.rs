//! KV transfer throughput per backend beside memcpy and a raw TCP stream, in one run.
//! `cargo bench -p duet-transport --bench transfer`.
//!
//! The payload is 256 pages of SmolLM2-135M's f16 layout (368,640 bytes each: 30 layers, K and
//! V, 3 KV heads of 64, 16 tokens), written as runs of 8 consecutive pages.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use duet_transport::shm::ShmRegion;
use duet_transport::tcp::{TcpSender, receive};

const PAGE: usize = 30 * 2 * 16 * 3 * 64 * 2;
const PAGES: usize = 256;
const RUN: usize = 8;
const ROUNDS: usize = 5;

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn main() {
    let total = PAGE * PAGES;
    let src: Vec<u8> = (0..total).map(|i| (i * 31 % 251) as u8).collect();

    // memcpy, run by run.
    let mut dst = vec![0u8; total];
    let mut best = f64::MAX;
    for _ in 0..ROUNDS {
        let t = Instant::now();
        for run in src.chunks(PAGE * RUN).zip(dst.chunks_mut(PAGE * RUN)) {
            run.1.copy_from_slice(run.0);
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    let memcpy = gbps(total, best);
    assert_eq!(dst, src);

    // shm: the destination is a shared-memory region.
    let name = format!("bench-{}", std::process::id());
    let mut region = ShmRegion::create(&name, total).expect("shm");
    let mut best = f64::MAX;
    for _ in 0..ROUNDS {
        let t = Instant::now();
        for (i, run) in src.chunks(PAGE * RUN).enumerate() {
            region.write(i * PAGE * RUN, run).expect("write");
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    let shm = gbps(total, best);
    assert_eq!(region.bytes(), &src[..]);
    drop(region);

    // Raw TCP: the same bytes through one loopback stream into a buffer.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let reader = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let mut buf = vec![0u8; total];
        for _ in 0..ROUNDS {
            s.read_exact(&mut buf).expect("read");
            s.write_all(&[1]).expect("ack");
        }
    });
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let mut best = f64::MAX;
    for _ in 0..ROUNDS {
        let t = Instant::now();
        for run in src.chunks(PAGE * RUN) {
            s.write_all(run).expect("write");
        }
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack).expect("ack");
        best = best.min(t.elapsed().as_secs_f64());
    }
    let raw_tcp = gbps(total, best);
    reader.join().expect("reader");

    // The tcp backend: framed runs landing in place, a fence per round.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let receiver = std::thread::spawn(move || {
        let (stream, _) = listener.accept().expect("accept");
        let mut dest = vec![0u8; total];
        let got = receive(stream, 1, &mut dest.as_mut_slice()).expect("receive");
        (dest, got)
    });
    let mut sender = TcpSender::connect(addr, 1).expect("connect");
    let mut best = f64::MAX;
    for round in 0..ROUNDS {
        let t = Instant::now();
        for (i, run) in src.chunks(PAGE * RUN).enumerate() {
            sender
                .write(round as u64, (i * PAGE * RUN) as u64, run)
                .expect("write");
        }
        sender.fence(round as u64).expect("fence");
        best = best.min(t.elapsed().as_secs_f64());
    }
    sender.close().expect("close");
    let (dest, _) = receiver.join().expect("receiver");
    assert_eq!(dest, src);
    let tcp = gbps(total, best);

    println!(
        "KV transfer, {PAGES} pages of {PAGE} bytes ({:.0} MB) in runs of {RUN} pages, best of {ROUNDS}:",
        total as f64 / 1e6
    );
    println!("  memcpy                {memcpy:>6.2} GB/s");
    println!(
        "  shm backend           {shm:>6.2} GB/s   {:.2}x memcpy (target >= 0.8)",
        shm / memcpy
    );
    println!("  raw TCP stream        {raw_tcp:>6.2} GB/s");
    println!(
        "  tcp backend           {tcp:>6.2} GB/s   {:.2}x raw TCP (target >= 0.9)",
        tcp / raw_tcp
    );
}
