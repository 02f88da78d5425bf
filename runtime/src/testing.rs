//! Helpers for tests and benchmarks that start real nodes on loopback.

use std::hash::{BuildHasher, Hasher};
use std::net::{TcpListener, UdpSocket};

/// `n` distinct loopback ports, each free for both UDP (a link) and TCP (an admin API).
///
/// They are drawn below the kernel's ephemeral range (32768 and up), so a client socket of
/// another test cannot take one between this check and the node's bind, and the probe sockets
/// are held until all are chosen so no port is handed out twice.
pub fn free_loopback_ports(n: usize) -> Vec<u16> {
    let mut held = Vec::new();
    let mut seed = std::collections::hash_map::RandomState::new().build_hasher();
    while held.len() < n {
        seed.write_usize(held.len());
        let port = 20_000 + (seed.finish() % 12_000) as u16;
        let Ok(udp) = UdpSocket::bind(("127.0.0.1", port)) else {
            continue;
        };
        let Ok(tcp) = TcpListener::bind(("127.0.0.1", port)) else {
            continue;
        };
        held.push((udp, tcp, port));
    }
    held.iter().map(|(_, _, p)| *p).collect()
}
