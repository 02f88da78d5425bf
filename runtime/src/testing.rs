//! Helpers for tests and benchmarks that start real nodes on loopback.

use std::hash::{BuildHasher, Hasher};
use std::net::{TcpListener, UdpSocket};

/// `n` distinct loopback ports, each free for both UDP (a link) and TCP (an admin API).
///
/// They are drawn below the kernel's ephemeral range (32768 and up), so a client socket of
/// another test cannot take one between this check and the node's bind, and the probe sockets
/// are held until all are chosen so no port is handed out twice in one call. A port is never
/// handed out twice by one process either: the tests of a binary run side by side, and a
/// port one test had chosen but whose node had not bound it yet (it loads the model first)
/// probed free for another (a router's HTTP bind then failed with `Address already in use`
/// on a port a decode worker's link held).
pub fn free_loopback_ports(n: usize) -> Vec<u16> {
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut handed = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    let mut held = Vec::new();
    let mut seed = std::collections::hash_map::RandomState::new().build_hasher();
    while held.len() < n {
        seed.write_usize(held.len());
        let port = 20_000 + (seed.finish() % 12_000) as u16;
        if handed.contains(&port) {
            continue;
        }
        let Ok(udp) = UdpSocket::bind(("127.0.0.1", port)) else {
            continue;
        };
        let Ok(tcp) = TcpListener::bind(("127.0.0.1", port)) else {
            continue;
        };
        held.push((udp, tcp, port));
    }
    let ports: Vec<u16> = held.iter().map(|(_, _, p)| *p).collect();
    handed.extend(&ports);
    ports
}

/// The loopback ports of a test's Jaeger.
#[derive(Debug, Clone, Copy)]
pub struct JaegerPorts {
    /// The query API over HTTP (`/api/traces/ID`).
    pub query: u16,
    /// The query API over gRPC.
    pub query_grpc: u16,
    /// The OTLP receiver over HTTP (protobuf).
    pub otlp_http: u16,
    /// The OTLP receiver over gRPC.
    pub otlp_grpc: u16,
}

impl JaegerPorts {
    /// Four free loopback ports.
    pub fn free() -> JaegerPorts {
        let p = free_loopback_ports(4);
        JaegerPorts {
            query: p[0],
            query_grpc: p[1],
            otlp_http: p[2],
            otlp_grpc: p[3],
        }
    }
}

/// The configuration of an all-in-one Jaeger (v2) for tests, examples and benchmarks: traces
/// in memory (up to 100,000, enough for a benchmark's load),
/// OTLP in over HTTP and over gRPC, the query API over HTTP and gRPC, all on loopback.
pub fn jaeger_config(p: JaegerPorts) -> String {
    format!(
        "service:\n  extensions: [jaeger_storage, jaeger_query]\n  pipelines:\n    traces:\n      \
         receivers: [otlp]\n      processors: [batch]\n      exporters: [jaeger_storage_exporter]\n  \
         telemetry:\n    metrics:\n      level: none\n\
         extensions:\n  jaeger_query:\n    storage:\n      traces: mem\n    http:\n      \
         endpoint: 127.0.0.1:{}\n    grpc:\n      endpoint: 127.0.0.1:{}\n  \
         jaeger_storage:\n    backends:\n      mem:\n        memory:\n          max_traces: 100000\n\
         receivers:\n  otlp:\n    protocols:\n      http:\n        endpoint: 127.0.0.1:{}\n      \
         grpc:\n        endpoint: 127.0.0.1:{}\n\
         processors:\n  batch:\n    timeout: 100ms\n\
         exporters:\n  jaeger_storage_exporter:\n    trace_storage: mem\n",
        p.query, p.query_grpc, p.otlp_http, p.otlp_grpc
    )
}

/// Runs a `tools/NAME/install.sh` (which builds the pinned tool once and caches it) and
/// returns the path it prints.
pub fn pinned_tool(script: &std::path::Path) -> std::path::PathBuf {
    let out = std::process::Command::new("bash")
        .arg(script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", script.display()));
    assert!(out.status.success(), "{} failed", script.display());
    std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

#[cfg(test)]
mod tests {
    use super::free_loopback_ports;

    #[test]
    fn no_port_is_handed_out_twice_by_one_process() {
        // A first test's ports, their probe sockets closed, then another's many: none of
        // the second's is the first's (2,000 of the 12,000 drawn at random would, without
        // the record, include about eight of the first's 50).
        let first = free_loopback_ports(50);
        let second = free_loopback_ports(2_000);
        assert!(
            second.iter().all(|p| !first.contains(p)),
            "a port was handed out twice"
        );
        let mut all = [first, second].concat();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 2_050);
        assert!(all.iter().all(|p| (20_000..32_000).contains(p)));
    }
}
