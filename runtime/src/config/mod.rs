//! `cluster.toml`: the schema, its defaults, and validation on load.
//!
//! Parsing happens in two passes. serde + toml turn the text into `raw` structs (unknown keys,
//! wrong types and unknown roles fail here, with the span toml reports); then [`validate`]
//! turns those into [`ClusterConfig`], a type that cannot hold an invalid cluster (duplicate
//! names, clashing addresses, policies out of range). Every error is a [`ConfigError`] that names
//! the file, the line and the dotted key, and says what was expected. `docs/cluster-toml.md`
//! documents every key and its default.

mod locate;
mod raw;

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use locate::key_at;

/// The actor kinds whose restart policy `[supervision.KIND]` may set.
///
/// Each kind is a kind of child a supervisor restarts; `default` applies to kinds not listed.
pub const ACTOR_KINDS: &[&str] = &[
    "supervisor",
    "listener",
    "link",
    "membership",
    "echo",
    "router",
    "worker",
    "bootstrap",
    "kv_sender",
    "kv_receiver",
    // Not an actor: a node process under `duet up`, restarted when it dies.
    "node",
];

/// Largest `max_restarts` accepted; beyond this a crash loop is no longer a policy.
pub const MAX_RESTARTS_LIMIT: u32 = 10_000;
/// Largest restart window accepted, in seconds (one day).
pub const MAX_WITHIN_SECS: u64 = 86_400;

/// A validated cluster description.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// The file this was loaded from (absolute when loaded from disk).
    pub path: PathBuf,
    /// The file's text, for the tables that other crates own (`[serving]`).
    pub source: String,
    /// Name of the cluster; part of the TLS handshake so two clusters never join by mistake.
    pub name: String,
    /// Where the certificate, key and token live.
    pub credentials: CredentialsConfig,
    /// Link-layer settings (QUIC between nodes).
    pub link: LinkConfig,
    /// Heartbeats and failure detection.
    pub membership: MembershipConfig,
    /// Restart policies by actor kind.
    pub supervision: SupervisionConfig,
    /// Every node of the cluster, in file order.
    pub nodes: Vec<NodeConfig>,
    /// Traces and log format (`[telemetry]`); the standard OpenTelemetry environment
    /// variables override it.
    pub telemetry: TelemetryConfig,
}

/// `[telemetry]`: where traces go and how logs look.
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetryConfig {
    /// OTLP collector URL (such as `http://127.0.0.1:4318`); tracing is off without one.
    pub otlp_endpoint: Option<String>,
    /// How spans travel to it.
    pub otlp_protocol: OtlpProtocol,
    /// Sampler name, as `OTEL_TRACES_SAMPLER` spells it.
    pub sampler: String,
    /// Sampler argument (the ratio of the ratio samplers).
    pub sampler_arg: f64,
    /// Log lines as JSON objects instead of text.
    pub json_logs: bool,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: None,
            otlp_protocol: OtlpProtocol::HttpProtobuf,
            sampler: "parentbased_always_on".to_string(),
            sampler_arg: 1.0,
            json_logs: false,
        }
    }
}

/// The OTLP transports Duet exports spans over, as `OTEL_EXPORTER_OTLP_PROTOCOL` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// `http/protobuf`: protobuf bodies POSTed to `/v1/traces` (usual port 4318).
    HttpProtobuf,
    /// `grpc`: the OTLP trace service over HTTP/2 (usual port 4317).
    Grpc,
}

impl OtlpProtocol {
    /// Every protocol, in the order errors list them.
    pub const ALL: [OtlpProtocol; 2] = [OtlpProtocol::HttpProtobuf, OtlpProtocol::Grpc];

    /// The protocol `name` names (`grpc`, `http/protobuf`).
    pub fn parse(name: &str) -> Option<OtlpProtocol> {
        OtlpProtocol::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Its name in `OTEL_EXPORTER_OTLP_PROTOCOL`.
    pub fn name(self) -> &'static str {
        match self {
            OtlpProtocol::HttpProtobuf => "http/protobuf",
            OtlpProtocol::Grpc => "grpc",
        }
    }

    /// The port collectors listen on for it, used when an endpoint names none.
    pub fn default_port(self) -> u16 {
        match self {
            OtlpProtocol::HttpProtobuf => 4318,
            OtlpProtocol::Grpc => 4317,
        }
    }
}

/// Samplers `OTEL_TRACES_SAMPLER` and `telemetry.sampler` accept.
pub const SAMPLERS: &[&str] = &[
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
];

/// Paths of the cluster credentials (all resolved against the config file's folder).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CredentialsConfig {
    /// Cluster certificate (PEM); every node presents it and accepts only it.
    pub cert: PathBuf,
    /// Private key of the cluster certificate (PEM).
    pub key: PathBuf,
    /// File holding the cluster token (admin API and link handshake).
    pub token_file: PathBuf,
}

/// Link-layer settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkConfig {
    /// Largest envelope accepted on the wire; larger frames close the stream.
    pub max_frame_bytes: u32,
    /// Deadline for a request when the caller gives none.
    pub request_timeout: Duration,
    /// Deadline for dialing a peer and completing the handshake.
    pub connect_timeout: Duration,
    /// First reconnect delay after a link drops.
    pub reconnect_min: Duration,
    /// Ceiling of the exponential reconnect backoff.
    pub reconnect_max: Duration,
}

/// Membership settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MembershipConfig {
    /// How often each node pings every peer.
    pub heartbeat_interval: Duration,
    /// Consecutive missed heartbeats after which a peer is marked down.
    pub failure_threshold: u32,
}

impl MembershipConfig {
    /// The deadline within which a silent peer is marked down.
    pub fn down_after(&self) -> Duration {
        self.heartbeat_interval * self.failure_threshold
    }
}

/// Restart policies: `default`, overridden per actor kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SupervisionConfig {
    /// Policy for kinds without their own table.
    pub default: RestartPolicy,
    /// Policies set per kind.
    pub per_kind: BTreeMap<String, RestartPolicy>,
}

impl SupervisionConfig {
    /// The policy that governs children of `kind`.
    pub fn policy(&self, kind: &str) -> RestartPolicy {
        self.per_kind.get(kind).copied().unwrap_or(self.default)
    }
}

/// At most `max_restarts` restarts within `within`; one more escalates to the parent (as in OTP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestartPolicy {
    /// Restarts allowed inside the window.
    pub max_restarts: u32,
    /// The sliding window.
    pub within: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            max_restarts: 3,
            within: Duration::from_secs(10),
        }
    }
}

/// What a node does in the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Front door: takes client requests and pairs workers.
    Router,
    /// Runs prompt prefill and streams KV to decode.
    Prefill,
    /// Holds KV pages and runs the decode batch.
    Decode,
}

impl Role {
    /// The role's name as written in cluster.toml.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Router => "router",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One node entry (`[[node]]`, or a node that joined: see [`ClusterConfig::joiner`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeConfig {
    /// Unique node name; the first segment of every actor path on it.
    pub name: String,
    /// The node's role.
    pub role: Role,
    /// UDP address of the node's QUIC link endpoint: what it binds, and what peers dial unless
    /// `dial` names it. For an address given as `NAME:PORT` this is `0.0.0.0:PORT` (every
    /// interface of its host, whose IP the file does not know), unless the node is started
    /// with `--address IP:PORT`.
    pub address: SocketAddr,
    /// `NAME:PORT` when the file gives the address by DNS name (a Kubernetes pod's stable
    /// name): peers resolve it at every dial, so a node that comes back with another IP is
    /// found.
    #[serde(default)]
    pub dial: Option<String>,
    /// TCP address of the node's admin HTTP API.
    pub admin: SocketAddr,
    /// The host the node runs on (`host`, else `localhost` for a loopback address, else the
    /// address's IP): admin addresses need only differ among nodes of one host.
    pub host: String,
}

/// A cluster.toml that could not be loaded: where, which key, and what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}: `{key}`: {message}")]
pub struct ConfigError {
    /// The file (as given).
    pub file: String,
    /// 1-based line of the offending key (0 when the file could not be read).
    pub line: usize,
    /// Dotted key path, such as `node[2].address`.
    pub key: String,
    /// What is wrong and what is expected.
    pub message: String,
}

impl ClusterConfig {
    /// Reads and validates a cluster file.
    pub fn load(path: &Path) -> Result<ClusterConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: path.display().to_string(),
            line: 0,
            key: String::new(),
            message: format!("cannot read the file: {e}"),
        })?;
        let path = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        Self::parse(&text, &path)
    }

    /// Validates cluster text as if it were the file at `path` (relative paths in it resolve
    /// against `path`'s folder).
    pub fn parse(text: &str, path: &Path) -> Result<ClusterConfig, ConfigError> {
        let file = path.display().to_string();
        let raw: raw::RawConfig = toml::from_str(text).map_err(|e| {
            let at = e.span().map_or(0, |s| s.start);
            let (line, key) = key_at(text, at);
            ConfigError {
                file: file.clone(),
                line,
                key,
                message: e.message().trim().to_string(),
            }
        })?;
        raw::validate(raw, text, path)
    }

    /// The node called `name`.
    pub fn node(&self, name: &str) -> Option<&NodeConfig> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// Every node except `name`.
    pub fn peers_of<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a NodeConfig> + 'a {
        self.nodes.iter().filter(move |n| n.name != name)
    }

    /// The entry of a node that is not in the file and joins the cluster (`duet node --name
    /// NAME --role ROLE --address IP:PORT`): checked as a `[[node]]` table would be against
    /// the file's nodes (a valid name none of them has, an address none of them uses, an admin
    /// address free on its host). The admin address defaults to loopback on the link's port.
    pub fn joiner(
        &self,
        name: &str,
        role: Role,
        address: SocketAddr,
        admin: Option<SocketAddr>,
        host: Option<String>,
    ) -> Result<NodeConfig, String> {
        if !raw::valid_name(name) {
            return Err(format!(
                "`{name}` is not a valid node name: expected letters, digits, '-' or '_'"
            ));
        }
        if let Some(n) = self.node(name) {
            return Err(format!(
                "node `{name}` is in {} already (as a {}): start it with --name alone",
                self.path.display(),
                n.role
            ));
        }
        if let Some(n) = self.nodes.iter().find(|n| n.address == address) {
            return Err(format!(
                "{address} is the address of node `{}`: expected an address of its own",
                n.name
            ));
        }
        let admin = admin.unwrap_or_else(|| SocketAddr::new([127, 0, 0, 1].into(), address.port()));
        let host = host.unwrap_or_else(|| raw::host_of(address));
        if let Some(n) = self
            .nodes
            .iter()
            .find(|n| n.host == host && n.admin == admin)
        {
            return Err(format!(
                "admin address {admin} is already used by node `{}` on the same host ({host}): \
                 give this node its own (--admin IP:PORT)",
                n.name
            ));
        }
        Ok(NodeConfig {
            name: name.to_string(),
            role,
            address,
            dial: None,
            admin,
            host,
        })
    }
}

#[cfg(test)]
mod tests;
