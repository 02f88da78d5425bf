use std::path::Path;
use std::time::Duration;

use super::*;

const NODES: &str = r#"
[[node]]
name = "router"
role = "router"
address = "127.0.0.1:7100"

[[node]]
name = "p0"
role = "prefill"
address = "127.0.0.1:7101"
"#;

fn parse(text: &str) -> Result<ClusterConfig, ConfigError> {
    ClusterConfig::parse(text, Path::new("/tmp/cluster.toml"))
}

#[test]
fn defaults_fill_everything_not_written() {
    let c = parse(NODES).expect("valid");
    assert_eq!(c.name, "duet");
    assert_eq!(c.nodes.len(), 2);
    assert_eq!(c.nodes[1].admin, "127.0.0.1:7101".parse().unwrap());
    assert_eq!(c.membership.down_after(), Duration::from_secs(2));
    assert_eq!(c.supervision.policy("echo"), RestartPolicy::default());
    assert_eq!(c.credentials.token_file, Path::new("/tmp/.duet/token"));
    assert_eq!(c.link.max_frame_bytes, 16 << 20);
}

#[test]
fn telemetry_exports_over_http_unless_grpc_is_asked_for() {
    let c = parse(NODES).expect("valid");
    assert_eq!(c.telemetry.otlp_protocol, OtlpProtocol::HttpProtobuf);
    let text = format!(
        "[telemetry]\notlp_endpoint = \"http://jaeger\"\notlp_protocol = \"grpc\"\n{NODES}"
    );
    let c = parse(&text).expect("valid");
    assert_eq!(c.telemetry.otlp_protocol, OtlpProtocol::Grpc);
    assert_eq!(c.telemetry.otlp_endpoint.as_deref(), Some("http://jaeger"));
}

#[test]
fn per_kind_policy_overrides_default() {
    let text = format!(
        "[supervision.default]\nmax_restarts = 1\n[supervision.echo]\nmax_restarts = 7\nwithin_secs = 60\n{NODES}"
    );
    let c = parse(&text).expect("valid");
    assert_eq!(c.supervision.policy("link").max_restarts, 1);
    assert_eq!(
        c.supervision.policy("echo"),
        RestartPolicy {
            max_restarts: 7,
            within: Duration::from_secs(60)
        }
    );
}

#[test]
fn every_serving_actor_kind_takes_a_policy() {
    for kind in ["router", "bootstrap", "worker", "kv_sender", "kv_receiver"] {
        let text = format!("[supervision.{kind}]\nmax_restarts = 3\n{NODES}");
        let c = parse(&text).unwrap_or_else(|e| panic!("{kind}: {e}"));
        assert_eq!(c.supervision.policy(kind).max_restarts, 3, "{kind}");
    }
}

#[test]
fn the_repository_default_cluster_is_valid() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../cluster.toml");
    let c = ClusterConfig::load(&path).expect("default cluster.toml is valid");
    let roles: Vec<Role> = c.nodes.iter().map(|n| n.role).collect();
    assert_eq!(roles, [Role::Router, Role::Prefill, Role::Decode]);
    assert!(
        c.nodes
            .iter()
            .all(|n| n.address.ip().is_loopback() && n.admin.ip().is_loopback())
    );
}

/// Nodes on different hosts may share a port (each listens on its own host, as pods do); on one
/// host the default loopback admin addresses still clash, and `host` says which nodes share one.
#[test]
fn ports_clash_only_on_one_host() {
    let node = |name: &str, role: &str, addr: &str, host: &str| {
        format!("[[node]]\nname = \"{name}\"\nrole = \"{role}\"\naddress = \"{addr}\"\n{host}")
    };
    let three = format!(
        "{}{}{}",
        node("router", "router", "198.18.0.2:7500", ""),
        node("p0", "prefill", "198.18.0.3:7500", ""),
        node("d0", "decode", "198.18.0.4:7500", "")
    );
    let c = parse(&three).expect("one port on three hosts");
    let hosts: Vec<&str> = c.nodes.iter().map(|n| n.host.as_str()).collect();
    assert_eq!(hosts, ["198.18.0.2", "198.18.0.3", "198.18.0.4"]);
    assert!(
        c.nodes
            .iter()
            .all(|n| n.admin == "127.0.0.1:7500".parse().unwrap())
    );
    assert_eq!(parse(NODES).expect("loopback").nodes[0].host, "localhost");

    // Two addresses of one machine, said to be one host: their admin ports clash.
    let shared = format!(
        "{}{}",
        node("a", "router", "198.18.0.2:7500", "host = \"box1\"\n"),
        node("b", "prefill", "198.18.0.9:7500", "host = \"box1\"\n")
    );
    let e = parse(&shared).expect_err("same host, same admin port");
    assert_eq!((e.line, e.key.as_str()), (9, "node[1].admin"), "{e}");
    assert!(e.message.contains("on the same host (box1)"), "{e}");
    let bad = node("a", "router", "198.18.0.2:7500", "host = \"no such\"\n");
    let e = parse(&bad).expect_err("bad host name");
    assert_eq!((e.line, e.key.as_str()), (5, "node[0].host"), "{e}");
}

/// Each invalid file, the line and key the error must name, and text the message must contain.
#[test]
fn nodes_may_be_named_by_dns_and_share_a_port() {
    // As a Kubernetes chart writes them: each pod by its stable name, all on one port.
    let c = parse(
        "[[node]]\nname = \"r\"\nrole = \"router\"\naddress = \"duet-router-0.duet-router:7500\"\n\
         [[node]]\nname = \"d\"\nrole = \"decode\"\naddress = \"duet-decode-0.duet-decode:7500\"\n",
    )
    .expect("DNS names");
    let d = c.node("d").expect("d");
    assert_eq!(d.dial.as_deref(), Some("duet-decode-0.duet-decode:7500"));
    // It binds every interface of its own host (its IP is not in the file)...
    assert_eq!(d.address, "0.0.0.0:7500".parse().expect("addr"));
    // ...is its own host, and keeps its admin API on loopback.
    assert_eq!(d.host, "duet-decode-0.duet-decode");
    assert!(d.admin.ip().is_loopback());
}

#[test]
fn invalid_files_name_line_key_and_expectation() {
    let node = |name: &str, role: &str, addr: &str| {
        format!("[[node]]\nname = \"{name}\"\nrole = \"{role}\"\naddress = \"{addr}\"\n")
    };
    let ok_a = node("a", "router", "127.0.0.1:7100");
    let cases: Vec<(&str, String, usize, &str, &str)> = vec![
        (
            "unknown top-level key",
            format!("colour = \"blue\"\n{ok_a}"),
            1,
            "colour",
            "unknown field `colour`",
        ),
        (
            "unknown node key",
            format!("{ok_a}port = 3\n"),
            5,
            "node[0].port",
            "unknown field `port`",
        ),
        (
            "duplicate node name",
            format!("{ok_a}{}", node("a", "prefill", "127.0.0.1:7101")),
            6,
            "node[1].name",
            "duplicate node name `a`",
        ),
        (
            "two nodes on one address",
            format!("{ok_a}{}", node("b", "prefill", "127.0.0.1:7100")),
            8,
            "node[1].address",
            "already the address of node `a`",
        ),
        (
            "address that does not parse",
            node("a", "router", "localhost"),
            4,
            "node[0].address",
            "expected IP:PORT",
        ),
        (
            "address without a port",
            node("a", "router", "127.0.0.1"),
            4,
            "node[0].address",
            "is not a node address",
        ),
        (
            "DNS name without a port",
            node("a", "router", "duet-router-0.duet"),
            4,
            "node[0].address",
            "expected IP:PORT or DNS-NAME:PORT",
        ),
        (
            "two nodes on one DNS name",
            format!(
                "{}{}",
                node("a", "router", "duet-0.duet:7500"),
                node("b", "prefill", "duet-0.duet:7500")
            ),
            8,
            "node[1].address",
            "already the address of node `a`",
        ),
        (
            "role that does not exist",
            node("a", "trainer", "127.0.0.1:7100"),
            3,
            "node[0].role",
            "unknown role `trainer`: expected one of `router`, `prefill`, `decode`",
        ),
        (
            "role of the wrong type",
            "[[node]]\nname = \"a\"\nrole = 3\naddress = \"127.0.0.1:7100\"\n".to_string(),
            3,
            "node[0].role",
            "invalid type: integer `3`, expected a string",
        ),
        (
            "restart intensity out of range",
            format!("[supervision.echo]\nmax_restarts = 99999\n{ok_a}"),
            2,
            "supervision.echo.max_restarts",
            "99999 is out of range: expected an integer from 0 to 10000",
        ),
        (
            "restart window of zero",
            format!("[supervision.default]\nwithin_secs = 0\n{ok_a}"),
            2,
            "supervision.default.within_secs",
            "out of range: expected an integer from 1 to 86400",
        ),
        (
            "restart policy for an unknown actor kind",
            format!("[supervision.gpu]\nmax_restarts = 1\n{ok_a}"),
            1,
            "supervision.gpu",
            "unknown actor kind `gpu`",
        ),
        (
            "unknown key in a restart policy",
            format!("[supervision.echo]\nretries = 1\n{ok_a}"),
            2,
            "supervision.echo.retries",
            "unknown field `retries`",
        ),
        (
            "no nodes",
            "[cluster]\nname = \"x\"\n".to_string(),
            1,
            "node",
            "expected at least one [[node]]",
        ),
        (
            "node without a name",
            "[[node]]\nrole = \"router\"\naddress = \"127.0.0.1:7100\"\n".to_string(),
            1,
            "node[0]",
            "missing field `name`",
        ),
        (
            "node name with a slash",
            node("a/b", "router", "127.0.0.1:7100"),
            2,
            "node[0].name",
            "not a valid node name",
        ),
        (
            "heartbeat interval of zero",
            format!("[membership]\nheartbeat_interval_ms = 0\n{ok_a}"),
            2,
            "membership.heartbeat_interval_ms",
            "expected an integer from 10 to 60000",
        ),
        (
            "failure threshold of zero",
            format!("[membership]\nfailure_threshold = 0\n{ok_a}"),
            2,
            "membership.failure_threshold",
            "expected an integer from 1 to 1000",
        ),
        (
            "frame limit too small",
            format!("[link]\nmax_frame_bytes = 10\n{ok_a}"),
            2,
            "link.max_frame_bytes",
            "expected an integer from 1024",
        ),
        (
            "reconnect backoff upside down",
            format!("[link]\nreconnect_min_ms = 5000\nreconnect_max_ms = 100\n{ok_a}"),
            2,
            "link.reconnect_min_ms",
            "expected min <= max",
        ),
        (
            "two nodes on one admin address",
            format!(
                "{ok_a}admin = \"127.0.0.1:9000\"\n{}admin = \"127.0.0.1:9000\"\n",
                node("b", "prefill", "127.0.0.1:7101")
            ),
            10,
            "node[1].admin",
            "already used by node `a`",
        ),
        (
            "admin address that does not parse",
            format!("{ok_a}admin = \"everywhere\"\n"),
            5,
            "node[0].admin",
            "is not a socket address",
        ),
        (
            "broken TOML",
            format!("{ok_a}[[node]\n"),
            5,
            "node[0]",
            "unclosed array table, expected `]`",
        ),
        (
            "negative number",
            format!("[link]\nrequest_timeout_ms = -1\n{ok_a}"),
            2,
            "link.request_timeout_ms",
            "invalid value: integer `-1`",
        ),
        (
            "OTLP protocol Duet does not export",
            format!("[telemetry]\notlp_protocol = \"http/json\"\n{ok_a}"),
            2,
            "telemetry.otlp_protocol",
            "expected one of http/protobuf, grpc",
        ),
    ];
    assert!(cases.len() >= 15);
    for (what, text, line, key, expect) in cases {
        let err = match parse(&text) {
            Ok(_) => panic!("{what}: accepted an invalid file:\n{text}"),
            Err(e) => e,
        };
        assert_eq!(err.file, "/tmp/cluster.toml", "{what}");
        assert_eq!((err.line, err.key.as_str()), (line, key), "{what}: {err}");
        assert!(
            err.message.contains(expect),
            "{what}: message `{}` lacks `{expect}`",
            err.message
        );
        let shown = err.to_string();
        assert!(
            shown.starts_with(&format!("/tmp/cluster.toml:{line}: `{key}`")),
            "{what}: {shown}"
        );
    }
}
