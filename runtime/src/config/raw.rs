//! The file as written (serde structs with spans) and its validation into [`ClusterConfig`].

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use super::{
    ACTOR_KINDS, ClusterConfig, ConfigError, CredentialsConfig, LinkConfig, MAX_RESTARTS_LIMIT,
    MAX_WITHIN_SECS, MembershipConfig, NodeConfig, OtlpProtocol, RestartPolicy, Role, SAMPLERS,
    SupervisionConfig, TelemetryConfig,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    #[serde(default)]
    cluster: RawCluster,
    #[serde(default)]
    credentials: RawCredentials,
    #[serde(default)]
    link: RawLink,
    #[serde(default)]
    membership: RawMembership,
    #[serde(default)]
    supervision: BTreeMap<String, Spanned<RawPolicy>>,
    #[serde(default)]
    telemetry: RawTelemetry,
    #[serde(default, rename = "node")]
    nodes: Vec<Spanned<RawNode>>,
    /// Application tables (such as `[serving]`) that the runtime carries but does not read;
    /// their owners validate them from [`ClusterConfig::source`].
    #[serde(default)]
    serving: Option<toml::Value>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCluster {
    name: Option<Spanned<String>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCredentials {
    dir: Option<String>,
    cert: Option<String>,
    key: Option<String>,
    token_file: Option<String>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLink {
    max_frame_bytes: Option<Spanned<u64>>,
    request_timeout_ms: Option<Spanned<u64>>,
    connect_timeout_ms: Option<Spanned<u64>>,
    reconnect_min_ms: Option<Spanned<u64>>,
    reconnect_max_ms: Option<Spanned<u64>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMembership {
    heartbeat_interval_ms: Option<Spanned<u64>>,
    failure_threshold: Option<Spanned<u64>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTelemetry {
    otlp_endpoint: Option<Spanned<String>>,
    otlp_protocol: Option<Spanned<String>>,
    sampler: Option<Spanned<String>>,
    sampler_arg: Option<Spanned<f64>>,
    log_format: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    max_restarts: Option<Spanned<u64>>,
    within_secs: Option<Spanned<u64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNode {
    name: Spanned<String>,
    role: Spanned<String>,
    address: Spanned<String>,
    admin: Option<Spanned<String>>,
    host: Option<Spanned<String>>,
}

/// Builds errors that point into one file.
struct Reporter<'a> {
    file: String,
    text: &'a str,
}

impl Reporter<'_> {
    fn error(&self, span: Range<usize>, key: impl Into<String>, message: String) -> ConfigError {
        let line = self.text[..span.start.min(self.text.len())]
            .bytes()
            .filter(|b| *b == b'\n')
            .count()
            + 1;
        ConfigError {
            file: self.file.clone(),
            line,
            key: key.into(),
            message,
        }
    }

    /// An integer in `range`, or the default when the key is absent.
    fn int_in(
        &self,
        value: &Option<Spanned<u64>>,
        key: &str,
        range: std::ops::RangeInclusive<u64>,
        default: u64,
    ) -> Result<u64, ConfigError> {
        let Some(value) = value else {
            return Ok(default);
        };
        let v = *value.get_ref();
        if range.contains(&v) {
            Ok(v)
        } else {
            Err(self.error(
                value.span(),
                key,
                format!(
                    "{v} is out of range: expected an integer from {} to {}",
                    range.start(),
                    range.end()
                ),
            ))
        }
    }
}

pub(super) fn validate(
    raw: RawConfig,
    text: &str,
    path: &Path,
) -> Result<ClusterConfig, ConfigError> {
    let r = Reporter {
        file: path.display().to_string(),
        text,
    };
    let dir = path.parent().unwrap_or(Path::new("."));

    let name = match raw.cluster.name {
        Some(n) if !valid_name(n.get_ref()) => {
            return Err(r.error(
                n.span(),
                "cluster.name",
                format!(
                    "`{}` is not a valid name: expected letters, digits, '-' or '_'",
                    n.get_ref()
                ),
            ));
        }
        Some(n) => n.into_inner(),
        None => "duet".to_string(),
    };

    let resolve = |p: &str| -> PathBuf {
        let p = Path::new(p);
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            dir.join(p)
        }
    };
    let cred_dir = resolve(raw.credentials.dir.as_deref().unwrap_or(".duet"));
    let in_dir = |given: &Option<String>, file: &str| {
        given
            .as_deref()
            .map_or_else(|| cred_dir.join(file), resolve)
    };
    let credentials = CredentialsConfig {
        cert: in_dir(&raw.credentials.cert, "cluster.crt"),
        key: in_dir(&raw.credentials.key, "cluster.key"),
        token_file: in_dir(&raw.credentials.token_file, "token"),
    };

    let l = &raw.link;
    let ms = Duration::from_millis;
    let link = LinkConfig {
        max_frame_bytes: r.int_in(
            &l.max_frame_bytes,
            "link.max_frame_bytes",
            1024..=(1 << 30),
            16 << 20,
        )? as u32,
        request_timeout: ms(r.int_in(
            &l.request_timeout_ms,
            "link.request_timeout_ms",
            1..=3_600_000,
            5_000,
        )?),
        connect_timeout: ms(r.int_in(
            &l.connect_timeout_ms,
            "link.connect_timeout_ms",
            1..=600_000,
            2_000,
        )?),
        reconnect_min: ms(r.int_in(
            &l.reconnect_min_ms,
            "link.reconnect_min_ms",
            1..=600_000,
            100,
        )?),
        reconnect_max: ms(r.int_in(
            &l.reconnect_max_ms,
            "link.reconnect_max_ms",
            1..=600_000,
            2_000,
        )?),
    };
    if link.reconnect_min > link.reconnect_max {
        let span = l
            .reconnect_min_ms
            .as_ref()
            .or(l.reconnect_max_ms.as_ref())
            .map_or(0..0, |s| s.span());
        return Err(r.error(
            span,
            "link.reconnect_min_ms",
            format!(
                "{} ms is above link.reconnect_max_ms ({} ms): expected min <= max",
                link.reconnect_min.as_millis(),
                link.reconnect_max.as_millis()
            ),
        ));
    }

    let m = &raw.membership;
    let membership = MembershipConfig {
        heartbeat_interval: ms(r.int_in(
            &m.heartbeat_interval_ms,
            "membership.heartbeat_interval_ms",
            10..=60_000,
            250,
        )?),
        failure_threshold: r.int_in(
            &m.failure_threshold,
            "membership.failure_threshold",
            1..=1_000,
            8,
        )? as u32,
    };

    let mut supervision = SupervisionConfig {
        default: RestartPolicy::default(),
        per_kind: BTreeMap::new(),
    };
    for (kind, policy) in &raw.supervision {
        let key = format!("supervision.{kind}");
        if kind != "default" && !ACTOR_KINDS.contains(&kind.as_str()) {
            return Err(r.error(
                policy.span(),
                key,
                format!(
                    "unknown actor kind `{kind}`: expected `default` or one of {}",
                    ACTOR_KINDS.join(", ")
                ),
            ));
        }
        let base = RestartPolicy::default();
        let p = policy.get_ref();
        let parsed = RestartPolicy {
            max_restarts: r.int_in(
                &p.max_restarts,
                &format!("{key}.max_restarts"),
                0..=u64::from(MAX_RESTARTS_LIMIT),
                u64::from(base.max_restarts),
            )? as u32,
            within: Duration::from_secs(r.int_in(
                &p.within_secs,
                &format!("{key}.within_secs"),
                1..=MAX_WITHIN_SECS,
                base.within.as_secs(),
            )?),
        };
        if kind == "default" {
            supervision.default = parsed;
        } else {
            supervision.per_kind.insert(kind.clone(), parsed);
        }
    }

    if raw.nodes.is_empty() {
        return Err(r.error(
            0..0,
            "node",
            "the cluster has no nodes: expected at least one [[node]] table".to_string(),
        ));
    }
    let mut nodes = Vec::with_capacity(raw.nodes.len());
    let mut names: HashMap<String, usize> = HashMap::new();
    let mut links: HashMap<String, String> = HashMap::new();
    // Admin addresses clash only on one host: every node may use the same port on its own
    // host (as every pod does in Kubernetes).
    let mut admins: HashMap<(String, SocketAddr), String> = HashMap::new();
    for (i, node) in raw.nodes.iter().enumerate() {
        let node = node.get_ref();
        let name = node.name.get_ref();
        if !valid_name(name) {
            return Err(r.error(
                node.name.span(),
                format!("node[{i}].name"),
                format!("`{name}` is not a valid node name: expected letters, digits, '-' or '_'"),
            ));
        }
        if let Some(first) = names.insert(name.clone(), i) {
            return Err(r.error(
                node.name.span(),
                format!("node[{i}].name"),
                format!("duplicate node name `{name}` (also node[{first}]): names must be unique"),
            ));
        }
        let (address, dial) = parse_node_addr(&r, &node.address, &format!("node[{i}].address"))?;
        let admin = match &node.admin {
            Some(a) => parse_addr(&r, a, &format!("node[{i}].admin"))?,
            // Admin listens on loopback unless the operator says otherwise, on the same port
            // number as the link (TCP and UDP ports do not clash).
            None => SocketAddr::new([127, 0, 0, 1].into(), address.port()),
        };
        let host = match &node.host {
            Some(h) if !valid_name(h.get_ref()) => {
                return Err(r.error(
                    h.span(),
                    format!("node[{i}].host"),
                    format!(
                        "`{}` is not a valid host name: expected letters, digits, '-' or '_'",
                        h.get_ref()
                    ),
                ));
            }
            Some(h) => h.get_ref().clone(),
            // A node named by DNS is its own host (a pod), known by that name.
            None => dial
                .as_ref()
                .and_then(|d| d.rsplit_once(':'))
                .map_or_else(|| host_of(address), |(h, _)| h.to_string()),
        };
        let link_key = dial.clone().unwrap_or_else(|| address.to_string());
        if let Some(other) = links.insert(link_key, name.clone()) {
            return Err(r.error(
                node.address.span(),
                format!("node[{i}].address"),
                format!("{address} is already the address of node `{other}`: expected one address per node"),
            ));
        }
        if let Some(other) = admins.insert((host.clone(), admin), name.clone()) {
            let span = node
                .admin
                .as_ref()
                .map_or(node.address.span(), |a| a.span());
            return Err(r.error(
                span,
                format!("node[{i}].admin"),
                format!("admin address {admin} is already used by node `{other}` on the same host ({host}): give each node on one host its own admin address"),
            ));
        }
        let role = match node.role.get_ref().as_str() {
            "router" => Role::Router,
            "prefill" => Role::Prefill,
            "decode" => Role::Decode,
            other => {
                return Err(r.error(
                    node.role.span(),
                    format!("node[{i}].role"),
                    format!(
                        "unknown role `{other}`: expected one of `router`, `prefill`, `decode`"
                    ),
                ));
            }
        };
        nodes.push(NodeConfig {
            name: name.clone(),
            role,
            address,
            dial,
            admin,
            host,
        });
    }

    let _ = raw.serving;
    let t = &raw.telemetry;
    let mut telemetry = TelemetryConfig::default();
    if let Some(e) = &t.otlp_endpoint {
        let url = e.get_ref().trim_end_matches('/');
        if !url.starts_with("http://") && !url.starts_with("https://") {
            return Err(r.error(
                e.span(),
                "telemetry.otlp_endpoint",
                format!("`{url}` is not an OTLP collector URL: expected http://HOST[:PORT], such as \"http://127.0.0.1:4318\""),
            ));
        }
        telemetry.otlp_endpoint = Some(url.to_string());
    }
    if let Some(p) = &t.otlp_protocol {
        telemetry.otlp_protocol = OtlpProtocol::parse(p.get_ref()).ok_or_else(|| {
            let names: Vec<&str> = OtlpProtocol::ALL.iter().map(|p| p.name()).collect();
            r.error(
                p.span(),
                "telemetry.otlp_protocol",
                format!(
                    "unknown OTLP protocol `{}`: expected one of {}",
                    p.get_ref(),
                    names.join(", ")
                ),
            )
        })?;
    }
    if let Some(s) = &t.sampler {
        if !SAMPLERS.contains(&s.get_ref().as_str()) {
            return Err(r.error(
                s.span(),
                "telemetry.sampler",
                format!(
                    "unknown sampler `{}`: expected one of {}",
                    s.get_ref(),
                    SAMPLERS.join(", ")
                ),
            ));
        }
        telemetry.sampler = s.get_ref().clone();
    }
    if let Some(a) = &t.sampler_arg {
        if !(0.0..=1.0).contains(a.get_ref()) {
            return Err(r.error(
                a.span(),
                "telemetry.sampler_arg",
                format!(
                    "{} is out of range: expected a ratio from 0.0 to 1.0",
                    a.get_ref()
                ),
            ));
        }
        telemetry.sampler_arg = *a.get_ref();
    }
    if let Some(f) = &t.log_format {
        telemetry.json_logs = match f.get_ref().as_str() {
            "text" => false,
            "json" => true,
            other => {
                return Err(r.error(
                    f.span(),
                    "telemetry.log_format",
                    format!("unknown log format `{other}`: expected \"text\" or \"json\""),
                ));
            }
        };
    }

    Ok(ClusterConfig {
        path: path.to_path_buf(),
        source: text.to_string(),
        name,
        credentials,
        link,
        membership,
        supervision,
        nodes,
        telemetry,
    })
}

/// A node's link address: `IP:PORT`, or `NAME:PORT` with a DNS name (then the node binds every
/// interface on PORT and peers resolve NAME at each dial).
fn parse_node_addr(
    r: &Reporter<'_>,
    value: &Spanned<String>,
    key: &str,
) -> Result<(SocketAddr, Option<String>), ConfigError> {
    let text = value.get_ref();
    if let Ok(a) = text.parse::<SocketAddr>() {
        return Ok((a, None));
    }
    let named = text.rsplit_once(':').and_then(|(host, port)| {
        let port: u16 = port.parse().ok()?;
        let dns = !host.is_empty()
            && host.len() <= 253
            && host.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                    && !label.starts_with('-')
                    && !label.ends_with('-')
            })
            // All digits and dots is a broken IP, not a name.
            && !host.chars().all(|c| c.is_ascii_digit() || c == '.');
        (dns && port != 0).then(|| {
            (
                SocketAddr::new([0, 0, 0, 0].into(), port),
                Some(text.clone()),
            )
        })
    });
    named.ok_or_else(|| {
        r.error(
            value.span(),
            key,
            format!(
                "`{text}` is not a node address: expected IP:PORT or DNS-NAME:PORT, such as \"127.0.0.1:7100\" or \"duet-decode-0.duet-decode:7500\""
            ),
        )
    })
}

fn parse_addr(
    r: &Reporter<'_>,
    value: &Spanned<String>,
    key: &str,
) -> Result<SocketAddr, ConfigError> {
    value.get_ref().parse().map_err(|_| {
        r.error(
            value.span(),
            key,
            format!(
                "`{}` is not a socket address: expected IP:PORT, such as \"127.0.0.1:7100\"",
                value.get_ref()
            ),
        )
    })
}

/// Node and cluster names appear in actor paths (`NODE/actor/child`) and metric labels.
/// The host a node runs on when its `host` key is not set: every loopback address is this
/// machine; any other address names its own host (two nodes that share one usually share it
/// by their IP, which is what clashes).
pub(super) fn host_of(address: SocketAddr) -> String {
    if address.ip().is_loopback() {
        "localhost".to_string()
    } else {
        address.ip().to_string()
    }
}

pub(super) fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}
